"""Turn a llama.cpp GGUF Llama checkpoint into an MLX model directory, losslessly.

GGUF's Q4_0/Q4_1/Q8_0 blocks are 32 weights sharing one scale (and, for Q4_1, one minimum), which
is exactly MLX's affine quantization with group size 32 (`w = scale * q + bias`): those tensors
are repacked bit for bit, not re-quantized. Other quantized types have no exact MLX form and are
only taken when a float `dtype` is asked for (dequantized by the `gguf` package). llama.cpp stores
Q/K rows permuted for its interleaved RoPE; they are put back in the Hugging Face order, so the
result is an ordinary mlx-lm-layout directory that mlx-lm loads too.
"""

import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from mlx_hybrid.convert.checkpoint import expected_shapes
from mlx_hybrid.convert.publish import save_safetensors, staged
from mlx_hybrid.errors import HybridError
from mlx_hybrid.validate import check_model_config, first_nonfinite

GROUP = 32  # block size of Q4_0, Q4_1 and Q8_0
PRE_TOKENIZERS = ("default", "gpt2", "smollm")  # those `write_tokenizer` rebuilds exactly
SHARD_BYTES = 2 << 30
FLOAT_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Projections the runtime fuses into one matmul: they must share one quantization.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def hf_module(name: str) -> str:
    """GGUF tensor name -> Hugging Face module path ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj")."""
    module = name.removesuffix(".weight")
    if module.startswith("blk."):
        _, layer, leaf = module.split(".", 2)
        if leaf in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[leaf]}"
    elif module in TOP_NAMES:
        return TOP_NAMES[module]
    raise HybridError(f"unexpected tensor '{name}' in the GGUF file (not a Llama tensor)")


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ints (rows, cols) into MLX's uint32 words, lowest bits first."""
    per_word = 32 // bits
    q = q.astype(np.uint32).reshape(q.shape[0], -1, per_word)
    return np.bitwise_or.reduce(q << (np.arange(per_word, dtype=np.uint32) * bits), axis=-1)


def _f16(block_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(block_bytes).view(np.float16)[..., 0]


def repack(qtype, data: np.ndarray) -> tuple[int, dict[str, np.ndarray]]:
    """GGUF blocks (rows, row_bytes) -> (bits, MLX weight/scales/biases) holding the same values."""
    from gguf import GGMLQuantizationType as T

    rows = data.shape[0]
    if qtype == T.Q8_0:  # fp16 d, 32 x int8 q; w = d*q = d*(q+128) - 128*d
        b = data.reshape(rows, -1, 34)
        d = _f16(b[..., :2])
        q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).reshape(rows, -1)
        bias = -128 * d.astype(np.float32)
        return 8, {"weight": _pack(q, 8), "scales": d, "biases": bias.astype(np.float16)}
    # Q4_0: fp16 d, 16 bytes (w = d*(q-8)); Q4_1: fp16 d, fp16 m, 16 bytes (w = d*q + m).
    # Byte j of a block holds q[j] in its low nibble and q[j+16] in its high nibble.
    size = 18 if qtype == T.Q4_0 else 20
    b = data.reshape(rows, -1, size)
    d = _f16(b[..., :2])
    m = (-8 * d.astype(np.float32)).astype(np.float16) if qtype == T.Q4_0 else _f16(b[..., 2:4])
    qs = b[..., size - 16 :]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, -1)
    return 4, {"weight": _pack(q, 4), "scales": d, "biases": m}


def unpermute_rows(a: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q and K (rows are independent under quantization)."""
    return a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def permute_rows(a: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row interleave, as its converter applies it (the inverse of unpermute_rows)."""
    return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as e:  # the gguf package's own errors on a malformed value
        raise HybridError(f"GGUF metadata '{key}' is malformed ({type(e).__name__})") from None


def _required(reader, key, kind):
    value = _field(reader, key)
    if value is None:
        raise HybridError(f"the GGUF file lacks the metadata '{key}'")
    if not isinstance(value, kind):
        raise HybridError(f"GGUF metadata '{key}' is {type(value).__name__}, expected {kind.__name__}")
    return value


def _float(value):
    """A number as float; anything else as is, for `check_model_config` to name."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def read_config(reader) -> dict:
    """config.json contents from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise HybridError(f"unsupported GGUF architecture '{arch}' (supported: llama)")

    def get(key, default=None):
        return _field(reader, f"llama.{key}", default)

    if get("rope.scaling.type") not in (None, "none"):
        raise HybridError(f"unsupported GGUF rope scaling '{get('rope.scaling.type')}'")
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        _required(reader, f"llama.{key}", int)
    tokens = _required(reader, "tokenizer.ggml.tokens", list)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise HybridError("GGUF metadata 'tokenizer.ggml.tokens' must be a non-empty list of strings")
    heads, hidden = get("attention.head_count"), get("embedding_length")
    if heads <= 0:
        raise HybridError(f"GGUF metadata 'llama.attention.head_count' must be positive, got {heads}")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": _float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length"),
        "vocab_size": len(tokens),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def check_tensors(reader, config: dict, dtype: str | None) -> dict[str, int | None]:
    """Every tensor a Llama of this config needs, once, of its shape, in a type this conversion
    takes, and nothing else; returns the bits each module will be stored with (None: float)."""
    from gguf import GGMLQuantizationType as T

    expected = expected_shapes(config)
    seen, bits = set(), {}
    for tensor in reader.tensors:
        module = hf_module(tensor.name)
        name = f"{module}.weight"
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if name not in expected:
            raise HybridError(f"unexpected tensor '{tensor.name}' in the GGUF file (not in a Llama of its metadata)")
        if name in seen:
            raise HybridError(f"tensor '{tensor.name}' appears twice in the GGUF file")
        seen.add(name)
        if shape != expected[name]:
            raise HybridError(f"tensor '{tensor.name}' has shape {list(shape)} but the metadata implies {list(expected[name])}")
        exact = {T.Q4_0: 4, T.Q4_1: 4, T.Q8_0: 8}
        if dtype is None and tensor.tensor_type in exact and len(shape) == 2:
            bits[module] = exact[tensor.tensor_type]
        elif dtype is None and tensor.tensor_type not in (T.F32, T.F16, T.BF16):
            raise HybridError(
                f"tensor '{tensor.name}' is {tensor.tensor_type.name}, which has no exact MLX form: pass a float dtype to dequantize"
            )
        else:
            bits[module] = None
    missing = [n for n in expected if n not in seen]
    if missing:
        raise HybridError(f"the GGUF file lacks tensor '{missing[0]}' (Hugging Face name)")
    return bits


def convert_tensors(reader, config: dict, dtype: str | None) -> Iterator[tuple[str, dict, int | None]]:
    """Yield (module path, {param: array}, bits or None) per GGUF tensor, one at a time (bounded memory).

    dtype None keeps Q4_0/Q4_1/Q8_0 tensors quantized (exactly) and float tensors in float16, the
    dtype of the quantization scales; a float dtype dequantizes everything to it.
    """
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    exact = (T.Q4_0, T.Q4_1, T.Q8_0)
    for tensor in reader.tensors:
        module = hf_module(tensor.name)
        qtype, data = tensor.tensor_type, np.asarray(tensor.data)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest axis first
        if dtype is None and qtype in exact and len(shape) == 2:
            bits, parts = repack(qtype, data)
        elif dtype is None and qtype not in (T.F32, T.F16, T.BF16):
            raise HybridError(
                f"tensor '{tensor.name}' is {qtype.name}, which has no exact MLX form: pass a float dtype to dequantize"
            )
        else:
            try:
                w = dequantize(data, qtype).reshape(shape)
            except (NotImplementedError, ValueError) as e:
                raise HybridError(f"cannot dequantize tensor '{tensor.name}' ({qtype.name}): {e}") from None
            bits, parts = None, {"weight": w.astype(np.float32)}
        leaf = module.rpartition(".")[2]
        arrays = {}
        for param, a in parts.items():
            a = mx.array(unpermute_rows(a, heads[leaf]) if leaf in heads else a)
            if first_nonfinite([(tensor.name, a)]):
                raise HybridError(f"tensor '{tensor.name}' holds NaN or Inf values")
            if mx.issubdtype(a.dtype, mx.floating):
                a = a.astype(FLOAT_DTYPES[dtype or "float16"])
            arrays[param] = a
        yield module, arrays, bits


def check_tokenizer(reader):
    """The tokenizer metadata `write_tokenizer` needs, complete and consistent."""
    kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise HybridError(f"unsupported GGUF tokenizer '{kind}' (supported: gpt2 byte-level BPE)")
    if pre not in PRE_TOKENIZERS:
        raise HybridError(f"unsupported GGUF pre-tokenizer '{pre}' (supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _required(reader, "tokenizer.ggml.merges", list)
    if not all(isinstance(m, str) and " " in m for m in merges):
        raise HybridError("GGUF metadata 'tokenizer.ggml.merges' must be strings 'left right'")
    types = _required(reader, "tokenizer.ggml.token_type", list)
    if len(types) != len(tokens):
        raise HybridError(f"GGUF metadata lists {len(tokens)} tokens but {len(types)} token types")
    for key in ("bos", "eos", "unknown", "padding"):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is not None and not (isinstance(i, int) and 0 <= i < len(tokens)):
            raise HybridError(f"GGUF metadata 'tokenizer.ggml.{key}_token_id' ({i}) is not a token id [0, {len(tokens)})")
    template = _field(reader, "tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise HybridError("GGUF metadata 'tokenizer.chat_template' must be a string")


def write_tokenizer(reader, out: Path):
    """tokenizer.json + tokenizer_config.json for a GGUF byte-level BPE ("gpt2") vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pre = _field(reader, "tokenizer.ggml.pre", "default")
    # The pre-tokenizers of the vocabularies we can rebuild exactly ("smollm" splits digits first).
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre_split = {
        "default": byte_level,
        "gpt2": byte_level,
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
    }
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_split[pre]
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, _field(reader, "tokenizer.ggml.token_type")) if kind == 3]
    tok.add_special_tokens(control)

    def special(key):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        clean_up_tokenization_spaces=False,
        model_max_length=_field(reader, "llama.context_length"),
    )
    template = _field(reader, "tokenizer.chat_template")
    if template:
        fast.chat_template = template
    fast.save_pretrained(out)


def save_shards(tensors: dict[str, mx.array], out: Path):
    shards, current, size = [], {}, 0
    for name, a in tensors.items():
        if current and size + a.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name], size = a, size + a.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_safetensors(out / "model.safetensors", shards[0], metadata={"format": "mlx"})
        return
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": {}}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(out / file, shard, metadata={"format": "mlx"})
        index["weight_map"].update({name: file for name in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def quantization_config(bits: dict[str, int | None]) -> dict | None:
    """mlx-lm's "quantization" entry: the commonest bit width, per-module overrides for the rest."""
    counts = Counter(b for b in bits.values() if b)
    if not counts:
        return None
    main = counts.most_common(1)[0][0]
    config = {"group_size": GROUP, "bits": main}
    for module, b in bits.items():
        if b != main:
            config[module] = {"group_size": GROUP, "bits": b} if b else False
    for module in bits:
        parent, _, leaf = module.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf == group[0] and len({bits.get(f"{parent}.{p}") for p in group}) > 1:
                raise HybridError(
                    f"{parent}: {', '.join(group)} are stored with different quantizations; "
                    "pass a float dtype to dequantize"
                )
    return config


def convert_gguf(
    src: str | Path, dst: str | Path, dtype: str | None = None, progress: Callable[[int, int], None] | None = None,
    force: bool = False,
) -> Path:
    """Write an MLX model directory for the GGUF file src at dst. As for Hugging Face sources,
    everything is checked before anything is written (metadata, every tensor's presence, shape
    and type, the tokenizer), and dst appears, or replaces an existing one with force, in one step
    (`publish.staged`)."""
    from gguf import GGUFReader

    src, dst = Path(src), Path(dst)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise HybridError(f"unknown dtype '{dtype}' (choose from {', '.join(FLOAT_DTYPES)})")
    if not src.is_file():
        raise HybridError(f"GGUF file not found: {src}")
    if dst.exists() or dst.is_symlink():
        if not force:
            raise HybridError(f"{dst} already exists (pass --force to replace it)")
        if dst.resolve() in src.resolve().parents:
            raise HybridError(f"{dst} holds the source {src}; choose another destination")
    try:
        reader = GGUFReader(src)
    except Exception as e:  # the gguf package raises ValueError/struct.error etc. on bad files
        raise HybridError(
            f"cannot read {src}: not a valid GGUF file ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    config = read_config(reader)
    check_model_config(config, src)
    check_tokenizer(reader)
    bits = check_tensors(reader, config, dtype)
    quant = quantization_config({m: b for m, b in bits.items() if m.endswith(("_proj", "embed_tokens", "lm_head"))})
    with staged(dst) as tmp:
        tensors = {}
        for i, (module, arrays, _) in enumerate(convert_tensors(reader, config, dtype)):
            tensors.update({f"{module}.{p}": a for p, a in arrays.items()})
            if progress:
                progress(i + 1, len(reader.tensors))
        if quant:
            config["quantization"] = config["quantization_config"] = quant
        save_shards(tensors, tmp)
        write_tokenizer(reader, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return dst
