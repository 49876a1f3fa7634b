"""Reading Medusa heads and ReDrafter drafters from their directories (docs/formats/speculative-heads.md).

As for models (`mlx_hybrid/loader.py`), every way a directory can be wrong ends in a one-line
`HybridError` naming the file or tensor at fault.
"""

from pathlib import Path

import mlx.nn as nn

from mlx_hybrid.errors import HybridError
from mlx_hybrid.loader import DTYPES, load_weights, read_config_json, set_weights
from mlx_hybrid.validate import check_count, check_quantization


def read_config(path: Path, model_type: str, required: tuple[str, ...]) -> dict:
    """config.json of a heads directory, checked for its model_type and required fields."""
    config = read_config_json(path)
    file = path / "config.json"
    if config.get("model_type") != model_type:
        raise HybridError(f"{file}: model_type is {config.get('model_type')!r}, expected {model_type!r}")
    missing = [k for k in required if k not in config]
    if missing:
        raise HybridError(f"{file} lacks the field '{missing[0]}'")
    for key in required:
        value = config[key]
        if key == "rnn" and not isinstance(value, bool):
            raise HybridError(f"{file}: 'rnn' must be true or false, got {value!r}")
        if key != "rnn" and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise HybridError(f"{file}: '{key}' must be a positive integer, got {value!r}")
    if config.get("quantization"):
        check_quantization(config["quantization"], file)
    return config


def check_blocks(path: Path, count: int, prefix: str, what: str):
    """The weights in path hold count blocks under prefix (checked before the module is built:
    a count of 10^9 in config.json would otherwise build 10^9 layers)."""
    check_count(count, load_weights(path), prefix, f"{path / 'config.json'}: {what}")


def load_into(module: nn.Module, path: Path, config: dict, target: nn.Module, dtype: str | None = None) -> nn.Module:
    """Load path's *.safetensors into module (quantized layers where the files hold scales), float
    tensors cast to dtype, by default the target's (`target_dtype`)."""
    weights = load_weights(path)
    if config.get("quantization"):
        q = config["quantization"]
        nn.quantize(module, q["group_size"], q["bits"], class_predicate=lambda p, m: f"{p}.scales" in weights)
    return set_weights(module, path, weights, dtype or target_dtype(target))


def target_dtype(target: nn.Module) -> str:
    """The float dtype the target computes in (its embedding's, or a quantized one's scales'):
    heads run in it, since train_cuda/ saves them in float32, which on a bfloat16 target would
    read twice the bytes a draft needs (Medusa's four LM heads: 450 MB a pass for SmolLM2-135M)."""
    embed = target.model.embed_tokens
    dtype = getattr(embed, "scales", embed.weight).dtype
    return next(name for name, d in DTYPES.items() if d == dtype)


def target_head_state(target: nn.Module) -> dict:
    """The arrays the target's LM head reads (its own, or the embedding it is tied to): inputs of
    a compiled draft that ends with it."""
    return target.lm_head.state if "lm_head" in target else target.model.embed_tokens.state


def check_target(path: Path, config: dict, target: nn.Module):
    """The heads must read the target's hidden states and predict over its vocabulary."""
    for key in ("hidden_size", "vocab_size"):
        want = getattr(target.args, key)
        if config[key] != want:
            raise HybridError(f"{path}: {key} is {config[key]} but the target model's is {want}")
