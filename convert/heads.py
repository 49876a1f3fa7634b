"""Speculative-decoding heads in their released PyTorch layouts -> `medusa/` and `redrafter/` beside a model.

The target layout is docs/formats/speculative-heads.md: the reference implementations' tensor
names, so conversion renames little, checks every shape against the heads' config and the
target's (hidden_size, vocab_size), casts and optionally quantizes like the target.

- FasterDecoding/Medusa: `config.json` (`medusa_num_heads`, `medusa_num_layers`) and
  `medusa_lm_head.pt` or `.safetensors`, the state dict of `MedusaModel.medusa_head` (names
  `{i}.{j}.linear.weight`, ...; given the `medusa_head.` prefix here).
- apple/ml-recurrent-drafter: `Drafter.save_pretrained` output, `config.json` with
  `model_type: recurrent_drafting_drafter` and `model.safetensors` (or a PyTorch .bin).
"""

import json
from pathlib import Path

from mlx_hybrid.convert.checkpoint import read_shapes
from mlx_hybrid.errors import HybridError

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
DRAFTER_FILES = ("model.safetensors", "pytorch_model.bin")
DRAFTER_FIELDS = ("hidden_size", "vocab_size", "exit_dim", "num_draft_layers", "num_lookback_tokens", "rnn",
                  "tied_lm_head", "beam_width", "beam_length")


def _config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise HybridError(f"no config.json in {path}")
    try:
        return json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HybridError(f"{path / 'config.json'} is not valid JSON ({e})") from None


def _weights(path: Path, names: tuple[str, ...], what: str) -> Path:
    for name in names:
        if (path / name).is_file():
            return path / name
    raise HybridError(f"no {what} weights in {path} (expected {' or '.join(names)})")


def medusa_plan(path: str | Path, target: dict) -> tuple[Path, dict, dict]:
    """(weights file, output config.json, expected output shapes) for Medusa heads at path."""
    path = Path(path)
    config = _config(path)
    if "medusa_num_heads" not in config:
        raise HybridError(f"{path} is not FasterDecoding/Medusa heads (its config.json has no medusa_num_heads)")
    heads, layers = config["medusa_num_heads"], config.get("medusa_num_layers", 1)
    H, V = target["hidden_size"], target["vocab_size"]
    shapes = {}
    for i in range(heads):
        for j in range(layers):
            shapes[f"medusa_head.{i}.{j}.linear.weight"] = (H, H)
            shapes[f"medusa_head.{i}.{j}.linear.bias"] = (H,)
        shapes[f"medusa_head.{i}.{layers}.weight"] = (V, H)
    out = {"model_type": "medusa", "medusa_num_heads": heads, "medusa_num_layers": layers, "hidden_size": H,
           "vocab_size": V}
    return _weights(path, MEDUSA_FILES, "Medusa head"), out, shapes


def redrafter_plan(path: str | Path, target: dict) -> tuple[Path, dict, dict]:
    """(weights file, output config.json, expected output shapes) for a ReDrafter drafter at path."""
    path = Path(path)
    config = _config(path)
    if config.get("model_type") != "recurrent_drafting_drafter":
        raise HybridError(f"{path} is not an apple/ml-recurrent-drafter drafter (model_type "
                          f"'{config.get('model_type')}', expected 'recurrent_drafting_drafter')")
    for field in ("hidden_size", "vocab_size"):
        if config.get(field) != target[field]:
            raise HybridError(f"{path}: drafter {field} {config.get(field)} differs from the model's {target[field]}")
    H, V, E, n = config["hidden_size"], config["vocab_size"], config["exit_dim"], config["num_draft_layers"]
    shapes = {}
    if E != 2 * H:
        shapes.update({"input_proj.weight": (E, 2 * H), "input_proj.bias": (E,)})
    for j in range(n):
        shapes.update({f"lm_head.{j}.linear.weight": (E, E), f"lm_head.{j}.linear.bias": (E,)})
    if not config.get("tied_lm_head"):
        shapes[f"lm_head.{n}.weight"] = (V, E)
    if config.get("rnn"):
        shapes.update({"rnn_w.weight": (H, H), "rnn_u.weight": (H, H), "rnn_u.bias": (H,)})
    out = {"model_type": "recurrent_drafting_drafter", **{k: config[k] for k in DRAFTER_FIELDS if k in config}}
    return _weights(path, DRAFTER_FILES, "drafter"), out, shapes


def output_name(kind: str, name: str) -> str:
    """Medusa's file holds `medusa_head`'s own state dict; speculative-heads.md names its tensors from the model."""
    return f"medusa_head.{name}" if kind == "medusa" and not name.startswith("medusa_head.") else name


def check(kind: str, file: Path, shapes: dict) -> None:
    """Fail naming the first tensor of `file` that the heads' config does not expect, or expects otherwise."""
    found = {output_name(kind, n): s for n, s in read_shapes(file).items()}
    for name, shape in found.items():
        if name not in shapes:
            raise HybridError(f"unexpected tensor '{name}' in {file} (not in {kind} heads of this config)")
        if shape != shapes[name]:
            raise HybridError(f"tensor '{name}' in {file} has shape {list(shape)}, but the configs imply "
                              f"{list(shapes[name])}")
    missing = [n for n in shapes if n not in found]
    if missing:
        raise HybridError(f"{file} lacks tensor '{missing[0]}'")

