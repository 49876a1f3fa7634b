"""What a model folder must satisfy before anything in it is used: it is data, never code.

A folder comes from anywhere (a download, a conversion, a colleague), so everything read from it
is checked for what it is, not trusted for what it claims: config.json must be an object whose
sizes are positive integers agreeing with the weights (a layer count of 10^9 would build 10^9
layers before any shape check), a quantization block must name a quantization MLX has, the
tokenizer must not ask for code (`auto_map`: transformers would import the folder's Python), its
ids must fit the embedding table, and the weights must be finite. Every failure is one line
naming the file, field or tensor (docs/security.md lists them all).
"""

import json
import math
import re
from pathlib import Path

import mlx.core as mx

from mlx_hybrid.errors import HybridError

# Files that may name code to import (transformers' auto_map: "module.Class" inside the folder).
CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
# config.json fields that size the model: required positive integers, then optional ones.
SIZES = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                  "d_state", "d_conv", "d_inner", "d_xb", "dt_rank", "dsla_kv_heads")  # the last six: hybrids
# (DSLA's gate_rank may be 0, full-rank gates: `hybrid.ModelArgs` checks it.)
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
# MLX's affine quantization (mx.quantize): the group sizes and bit widths it has kernels for.
QUANT_GROUP_SIZES = (32, 64, 128)
QUANT_BITS = (2, 3, 4, 5, 6, 8)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def read_json_object(file: Path) -> dict:
    """A JSON file that must hold an object (config.json, a profile): one line if it does not."""
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise HybridError(f"{file} is not valid UTF-8 JSON ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise HybridError(f"cannot read {file} ({e.strerror or e})") from None
    if not isinstance(value, dict):
        raise HybridError(f"{file} must hold a JSON object, not {type(value).__name__}")
    return value


def refuse_remote_code(path: Path):
    """Fail if a file of the folder asks transformers to import Python code from it (auto_map)."""
    for name in CODE_FILES:
        file = path / name
        if not file.is_file():
            continue
        try:
            config = read_json_object(file)
        except HybridError:
            continue  # not a JSON object: transformers cannot read an auto_map from it either
        if config.get("auto_map"):
            raise HybridError(
                f"{file} names Python code to run (auto_map: {', '.join(sorted(config['auto_map']))}); "
                "mlx-hybrid never runs code from a model folder"
            )


def check_model_config(config: dict, file: Path, weight_names=None):
    """config.json's sizes: positive integers, heads that divide evenly, a layer count equal to
    the layers the weights hold (weight_names, when given), finite positive norms and RoPE base."""
    for key in SIZES:
        if not _positive_int(config.get(key)):
            raise HybridError(f"{file}: '{key}' must be a positive integer, got {config.get(key)!r}")
    for key in OPTIONAL_SIZES:
        if config.get(key) is not None and not _positive_int(config[key]):
            raise HybridError(f"{file}: '{key}' must be a positive integer, got {config[key]!r}")
    for key in POSITIVE_FLOATS:
        value = config.get(key)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise HybridError(f"{file}: '{key}' must be a finite positive number, got {value!r}")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv:
        raise HybridError(f"{file}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})")
    if not config.get("head_dim") and config["hidden_size"] % heads:
        raise HybridError(f"{file}: hidden_size ({config['hidden_size']}) is not a multiple of num_attention_heads ({heads})")
    if (config.get("head_dim") or config["hidden_size"] // heads) % 2:
        raise HybridError(f"{file}: the head size must be even (RoPE turns pairs of features)")
    if weight_names is not None:
        check_count(config["num_hidden_layers"], weight_names, "model.layers.", f"{file}: num_hidden_layers")
    if "quantization" in config:
        check_quantization(config["quantization"], file)


def check_count(count: int, names, prefix: str, what: str):
    """The weights hold exactly count blocks prefix + "0." .. prefix + f"{count - 1}."."""
    found = sorted({int(m.group(1)) for n in names if (m := re.match(re.escape(prefix) + r"(\d+)\.", n))})
    if len(found) != count or found != list(range(count)):
        raise HybridError(f"{what} is {count} but the weights hold {len(found)} ({prefix}N)")


def check_quantization(q, file: Path):
    """mlx-lm's quantization block: affine group_size and bits MLX supports, and per-module
    entries that are such a block or false (that module stays float)."""
    def check(block, where):
        if not isinstance(block, dict):
            raise HybridError(f"{file}: {where} must be an object with group_size and bits, got {block!r}")
        if block.get("mode", "affine") != "affine":
            raise HybridError(f"{file}: {where} mode {block['mode']!r} is not supported (only affine)")
        if block.get("group_size") not in QUANT_GROUP_SIZES or isinstance(block.get("group_size"), bool):
            raise HybridError(f"{file}: {where} group_size must be one of {QUANT_GROUP_SIZES}, got {block.get('group_size')!r}")
        if block.get("bits") not in QUANT_BITS or isinstance(block.get("bits"), bool):
            raise HybridError(f"{file}: {where} bits must be one of {QUANT_BITS}, got {block.get('bits')!r}")

    if q is None or q is False:
        return
    check(q, "quantization")
    for key, value in q.items():
        if isinstance(value, dict):
            check(value, f"quantization.{key}")
        elif key not in ("group_size", "bits", "mode") and value is not False:
            raise HybridError(f"{file}: quantization.{key} must be an object or false, got {value!r}")


def check_tokenizer_fits(tokenizer, vocab_size: int, path: Path):
    """Every id the tokenizer can produce (its added tokens too) and every EOS id must index the
    model's embedding table, or generation would read past it."""
    size = len(tokenizer._tokenizer)
    if size > vocab_size:
        raise HybridError(f"{path}: the tokenizer has {size} tokens but the model's vocabulary (config.json, weights) is {vocab_size}")
    bad = [i for i in tokenizer.eos_token_ids if not (isinstance(i, int) and 0 <= i < vocab_size)]
    if bad:
        raise HybridError(f"{path}: end-of-sequence id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def first_nonfinite(named: list[tuple[str, mx.array]]) -> str | None:
    """The name of the first float tensor holding NaN or Inf, else None. A tensor's float32 sum is
    finite unless the tensor holds NaN or Inf (or values near float32's limit, a broken weight
    too, told apart by an exact check): one reduction per tensor, evaluated together, costs about
    a third of reading the weights once."""
    floats = [(k, v) for k, v in named if mx.issubdtype(v.dtype, mx.floating)]
    if not floats:
        return None
    finite = mx.isfinite(mx.stack([v.astype(mx.float32).sum() for _, v in floats])).tolist()
    suspects = [kv for kv, ok in zip(floats, finite) if not ok]
    return next((k for k, v in suspects if not mx.isfinite(v).all().item()), None)


def check_same_vocabulary(draft_dir: Path, tokenizer):
    """A draft model's tokenizer must give every token the id the target's gives it (ids below
    the smaller of the two sizes): drafts are token ids, and under another vocabulary every draft
    would be rejected, or accepted as the wrong text. A draft folder without a tokenizer is
    taken on its vocabulary size alone (`DraftProposer`)."""
    from mlx_hybrid.loader import TOKENIZER_FILES, load_tokenizer

    if not any((draft_dir / f).is_file() for f in TOKENIZER_FILES):
        return
    theirs, ours = load_tokenizer(draft_dir).get_vocab(), tokenizer.get_vocab()
    n = min(len(theirs), len(ours))
    by_id = [{i: t for t, i in v.items() if i < n} for v in (theirs, ours)]
    differ = sorted(i for i in set(by_id[0]) | set(by_id[1]) if by_id[0].get(i) != by_id[1].get(i))
    if differ:
        i = differ[0]
        raise HybridError(
            f"the draft model in {draft_dir} has another tokenizer than the target: id {i} is "
            f"{by_id[0].get(i)!r} there and {by_id[1].get(i)!r} here"
        )
