"""The checkpoint directories `hybrid convert` reads: what kind each is, its config, its tensors.

Kinds are told apart by their files: a MambaInLlama release has `mamba_config.json` beside a
Llama/Mistral `config.json`; a DSLA-Serve checkpoint is a Llama config.json with a `dsla_list`
(convert/dsla_serve.py); this project's hybrids say `model_type: llama_hybrid`; the rest is a
plain Hugging Face Llama or Mistral. Weights are safetensors or PyTorch `.bin` files, sharded
with an index or not. Tensors are read one at a time (MLX loads safetensors lazily, torch maps
`.bin` files), so converting never holds the whole model in memory.
"""

import ctypes
import json
import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from mlx_hybrid.convert import dsla_serve
from mlx_hybrid.errors import HybridError
from mlx_hybrid.models import hybrid, llama
from mlx_hybrid.validate import check_model_config, read_json_object

KINDS = ("llama", "mistral", "mamba_in_llama", "llama_hybrid", "dsla_serve")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # one of them is required
# Copied beside the weights when present: the tokenizer, its chat template and generation defaults.
TOKENIZER_EXTRAS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
# Tensors some checkpoints carry that no model parameter holds (recomputed at run time).
IGNORED = ("rotary_emb.inv_freq",)


@dataclass
class Checkpoint:
    path: Path
    kind: str  # one of KINDS
    config: dict  # config.json in the runtime's terms (a MambaInLlama or DSLA-Serve one translated)
    files: list[Path]  # weight files, all safetensors or all PyTorch .bin
    shapes: dict[str, tuple[int, ...]]  # every tensor in the files, in file order
    renames: list[tuple[str, str]] = field(default_factory=list)  # (source prefix, converted prefix) pairs

    def converted_name(self, name: str) -> str:
        return next((dst + name[len(src) :] for src, dst in self.renames if name.startswith(src)), name)

    def source_name(self, name: str) -> str:
        return next((src + name[len(dst) :] for src, dst in self.renames if name.startswith(dst)), name)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Detect the kind of checkpoint in `path` and read its config and tensor shapes (not the data)."""
    path = Path(path)
    if not path.is_dir():
        raise HybridError(f"source directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HybridError(f"cannot tell what kind of checkpoint {path} is: it has no config.json")
    config = read_json_object(config_file)
    if config.get("quantization"):
        raise HybridError(f"{path} is already an MLX-quantized model directory; convert from the float checkpoint")
    if config.get("quantization_config"):
        q = config["quantization_config"]
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise HybridError(f"{path} is quantized ({method}); only float checkpoints convert")
    model_type = config.get("model_type")
    mamba_config = path / hybrid.MAMBA_IN_LLAMA_CONFIG
    if mamba_config.is_file() and model_type in ("llama", "mistral"):
        kind = "mamba_in_llama"
    elif dsla_serve.is_dsla_serve(config):
        kind = "dsla_serve"
    elif model_type in ("llama", "mistral", "llama_hybrid") and not mamba_config.is_file():
        kind = model_type
    else:
        raise HybridError(
            f"cannot convert {path}: unknown kind (model_type '{model_type}'"
            f"{' with ' + mamba_config.name if mamba_config.is_file() else ''}); hybrid convert takes Hugging Face "
            "llama/mistral, llama_hybrid, MambaInLlama and DSLA-Serve checkpoints"
        )
    files = weight_files(path)
    shapes = {}
    for file in files:
        for name, shape in read_shapes(file).items():
            if name in shapes:
                raise HybridError(f"tensor '{name}' appears twice in {path}")
            shapes[name] = shape
    check_model_config(config, config_file, shapes)
    renames = []
    try:
        if kind == "mamba_in_llama":
            config = hybrid.config_from_mamba_in_llama(config, read_json_object(mamba_config), shapes)
        elif kind == "dsla_serve":
            config, renames = dsla_serve.hybrid_config(config), dsla_serve.renames(config)
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise HybridError(f"{path}: {e}") from None
    config.setdefault("tie_word_embeddings", "lm_head.weight" not in shapes)
    return Checkpoint(path, kind, config, files, shapes, renames)


def weight_files(path: Path) -> list[Path]:
    """The weight files: those an index lists, else every *.safetensors, else every PyTorch *.bin."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            try:
                names = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError) as e:
                raise HybridError(f"{path / index} is not a valid index ({e})") from None
            missing = [n for n in names if not (path / n).is_file()]
            if missing:
                raise HybridError(f"{path / missing[0]} is listed in {index} but missing")
            return [path / n for n in names]
    files = sorted(path.glob("*.safetensors")) or sorted(
        f for f in path.glob("*.bin") if f.name not in ("training_args.bin", "optimizer.bin")
    )
    if not files:
        raise HybridError(f"no weights in {path} (expected *.safetensors or PyTorch *.bin files)")
    return files


def _bad_file(file: Path, e: Exception) -> HybridError:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    kind = "safetensors" if file.suffix == ".safetensors" else "PyTorch checkpoint"
    return HybridError(f"cannot read {file}: truncated or corrupt {kind} ({reason})")


def require_torch(purpose: str):
    """torch, or a one-line error saying how to install it (it is an optional dependency)."""
    try:
        import torch
    except ImportError:
        raise HybridError(f"{purpose} needs PyTorch: pip install 'mlx-hybrid[torch]'") from None
    return torch


def _load_bin(file: Path) -> dict:
    """A PyTorch state dict, memory-mapped: tensors are paged in only when read."""
    torch = require_torch(f"reading {file.name}")
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # zip/pickle errors of every kind
        raise _bad_file(file, e) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HybridError(f"{file} is not a flat state dict of tensors")
    return state


def _load_safetensors(file: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(file))  # lazy: checks the header against the file size, reads nothing yet
    except Exception as e:
        raise _bad_file(file, e) from None


def read_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    tensors = _load_safetensors(file) if file.suffix == ".safetensors" else _load_bin(file)
    return {name: tuple(t.shape) for name, t in tensors.items()}


def _to_mlx(t) -> mx.array:
    import torch

    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the bits
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


try:
    _libc = ctypes.CDLL(None)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # no libc madvise (Windows): pages stay resident, as torch leaves them
    _libc = None


def _release(t):
    """Drop the file pages under a converted tensor from the resident set.

    torch maps the whole .bin file, and every page read stays resident until the state dict is
    gone, so the process would end up holding the whole file. The pages are clean copies of the
    file (private, never written), so dropping them is safe: touching them again re-reads the file.
    """
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None or _libc is None:
        return
    storage = t.untyped_storage()
    start = storage.data_ptr() - storage.data_ptr() % mmap.PAGESIZE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(storage.data_ptr() + storage.nbytes() - start), advice)


def file_tensors(file: Path) -> Iterator[tuple[str, mx.array]]:
    """Yield (name, array) for every tensor of one safetensors or PyTorch file, one at a time."""
    if file.suffix == ".safetensors":
        arrays = _load_safetensors(file)
        for name in list(arrays):
            yield name, arrays.pop(name)
    else:
        state = _load_bin(file)
        for name in list(state):
            t = state.pop(name)
            a = _to_mlx(t)  # a copy
            _release(t)
            yield name, a


def tensors(checkpoint: Checkpoint) -> Iterator[tuple[str, mx.array]]:
    """Yield (name, array) for every tensor, one file and one tensor at a time."""
    for file in checkpoint.files:
        yield from file_tensors(file)


def torch_state(checkpoint: Checkpoint) -> dict:
    """All tensors as float32 torch tensors under their converted names (for running the source in PyTorch)."""
    import torch

    state = {}
    for file in checkpoint.files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(file))
        else:
            state.update(_load_bin(file))
    return {checkpoint.converted_name(k): v.to(torch.float32) for k, v in state.items()}


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, in the Hugging Face / MambaInLlama layout (see docs/formats/hybrid-checkpoint.md)."""
    arch = hybrid if config.get("model_type") == "llama_hybrid" else llama
    try:
        a = arch.ModelArgs.from_dict(config)
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        raise HybridError(f"config.json: {e}") from None
    h, hd, inter = a.hidden_size, a.head_dim, a.intermediate_size
    q, kv = a.num_attention_heads * hd, a.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (a.vocab_size, h)}

    def linear(name, out, inp, bias=False):
        shapes[f"{name}.weight"] = (out, inp)
        if bias:
            shapes[f"{name}.bias"] = (out,)

    def conv(name, channels):  # depthwise, PyTorch's Conv1d layout
        shapes[f"{name}.weight"] = (channels, 1, a.d_conv)
        if a.conv_bias:
            shapes[f"{name}.bias"] = (channels,)

    for i, kind in enumerate(getattr(a, "mixer_types", None) or ["attention"] * a.num_hidden_layers):
        p = f"model.layers.{i}."
        mixer = p + hybrid.MIXER_NAME[kind]
        if kind in ("attention", "dsla"):
            kv_width = a.dsla_kv_heads * hd if kind == "dsla" else kv
            for proj, out in (("q_proj", q), ("k_proj", kv_width), ("v_proj", kv_width)):
                linear(f"{mixer}.{proj}", out, h, a.attention_bias)
            linear(f"{mixer}.o_proj", h, q, a.attention_bias)
        if kind == "dsla":
            if a.gate_rank:
                for g in ("gate1", "gate2"):
                    linear(f"{mixer}.{g}_down", a.gate_rank, h)
                    linear(f"{mixer}.{g}_up", q, a.gate_rank, bias=True)
            else:
                linear(f"{mixer}.gk_proj", q, h, bias=True)
                linear(f"{mixer}.gk_proj2", q, h, bias=True)
            if a.dsla_mix == "gamma":
                shapes[f"{mixer}.gamma"] = (1,)
            else:
                shapes[f"{mixer}.alpha_list"] = (2,)
            if a.dsla_o_norm:
                shapes[f"{mixer}.o_norm.weight"] = (hd,)
        elif kind == "mamba":
            for proj, out in (("in_proj_x", a.d_xb), ("in_proj_z", a.d_inner), ("B_proj", a.d_xb),
                              ("C_proj", a.d_inner), ("dt_proj_down", a.dt_rank)):
                linear(f"{mixer}.{proj}", out, h)
            linear(f"{mixer}.dt_proj", a.d_inner, a.dt_rank, bias=True)
            conv(f"{mixer}.conv1d", a.d_inner)
            shapes[f"{mixer}.A_log"] = (a.d_inner, a.d_state)
            shapes[f"{mixer}.D"] = (a.d_inner,)
            linear(f"{mixer}.out_proj", h, a.d_inner)
        elif kind == "mamba2":
            heads = a.d_inner // a.d_state
            linear(f"{mixer}.in_proj", 2 * a.d_inner + 2 * a.d_xb + heads, h)
            conv(f"{mixer}.conv1d", a.d_inner + 2 * a.d_xb)
            for name in ("dt_bias", "A_log", "D"):
                shapes[f"{mixer}.{name}"] = (heads,)
            shapes[f"{mixer}.norm.weight"] = (a.d_inner,)
            linear(f"{mixer}.out_proj", h, a.d_inner)
        for proj, out, inp in (("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter)):
            linear(f"{p}mlp.{proj}", out, inp, a.mlp_bias)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, h)
    return shapes


def check_shapes(checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
    """The tensors to convert, under their converted names; fails naming (as the source does) the
    first tensor the config does not expect, or expects otherwise."""
    expected = expected_shapes(checkpoint.config)
    for source, shape in checkpoint.shapes.items():
        name = checkpoint.converted_name(source)
        if name in expected:
            if shape != expected[name]:
                raise HybridError(
                    f"tensor '{source}' has shape {list(shape)} but config.json implies {list(expected[name])}"
                )
        elif not (name.endswith(IGNORED) or (name == "lm_head.weight" and checkpoint.config["tie_word_embeddings"])):
            raise HybridError(f"unexpected tensor '{source}' in {checkpoint.path} (not in a {checkpoint.kind} model "
                              "of this config)")
    converted = {checkpoint.converted_name(n) for n in checkpoint.shapes}
    missing = [n for n in expected if n not in converted]
    if missing:
        raise HybridError(f"{checkpoint.path} lacks tensor '{checkpoint.source_name(missing[0])}'")
    return expected
