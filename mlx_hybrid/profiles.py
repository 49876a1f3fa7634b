"""Speculation settings per device and model: a tuned profile, else a chip preset, else defaults.

`hybrid tune` (mlx_hybrid.tune) measures the best ReDrafter beam and Medusa tree for one model on
one device and saves them here, keyed by the device's name and a fingerprint of the model and its
heads; `hybrid chat` and `hybrid generate` look them up on every start. Without a profile, Apple
chips get a preset derived from ReDrafter's on-device results (section 4.2, Table 2): beam width 1
was best on an M1 Max (32 GPU cores) and 3-4 on an M2 Ultra (76 cores), since a wider beam adds
verification work that a small GPU pays for in full. Chips the paper did not measure take the width
of the measured chip closest in GPU cores below them (M1 Ultra and M2 Max sit between the two and get
2). The paper varies the width at one beam length; the presets keep the drafters' default length 4.
A Medusa tree gets as many candidates as the preset beam verifies, BW * (BL - 1).

On MLX's CUDA backend a profile also holds, per projection weight shape, the most rows of a pass
the row kernel takes (`row_limits`, into `mlx_hybrid.models.linear.LIMITS`), and where a
tree-attention kernel runs, the most nodes it takes (`tree_attention`, into
`mlx_hybrid.tree_attention.LIMIT`).
"""

import hashlib
import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlx_hybrid.errors import HybridError
from mlx_hybrid.validate import read_json_object

# chip -> (GPU cores of its largest configuration, ReDrafter beam width)
PRESETS = {
    "M1": (8, 1),
    "M1 Pro": (16, 1),
    "M1 Max": (32, 1),  # measured: BW 1, 1.32x on Vicuna 7B
    "M1 Ultra": (64, 2),
    "M2": (10, 1),
    "M2 Pro": (19, 1),
    "M2 Max": (38, 2),
    "M2 Ultra": (76, 3),  # measured: BW 3 (7B), 2-3 (13B), 4 (33B)
}
PRESET_BEAM_LENGTH = 4
TUNED = ("redrafter", "medusa")  # the methods `hybrid tune` measures


@dataclass
class Settings:
    """What a proposer runs with, and where that came from (shown to the user)."""

    beam_width: int | None = None
    beam_length: int | None = None
    medusa_choices: list | None = None  # a tuned tree
    tree_size: int | None = None  # a preset: this many candidates, built from the heads' accuracies
    source: str = "defaults"

    def describe(self, method: str) -> str:
        if method == "redrafter" and self.beam_width:
            what = f"beam {self.beam_width}x{self.beam_length}"
        elif method == "medusa" and (self.medusa_choices or self.tree_size):
            what = f"tree of {len(self.medusa_choices) if self.medusa_choices else self.tree_size} candidates"
        else:
            what = "its own defaults"
        return f"{method}, {what} ({self.source})"


def cache_root() -> Path:
    """Where profiles live: $MLX_HYBRID_CACHE, else $XDG_CACHE_HOME/mlx-hybrid, else ~/.cache/mlx-hybrid."""
    if os.environ.get("MLX_HYBRID_CACHE"):
        return Path(os.environ["MLX_HYBRID_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-hybrid"


def device_name() -> str:
    """The chip (Mac), GPU or CPU name MLX reports for the default device, with the device type."""
    info = {}
    try:
        info = dict(mx.device_info())
    except Exception:  # older MLX: only the Metal query exists
        if mx.metal.is_available():
            info = dict(mx.metal.device_info())
    kind = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
    return f"{info.get('device_name') or 'unknown'} ({kind})"


def model_key(model_dir: str | Path) -> str:
    """A fingerprint of a model directory and the heads beside it: configs and weight file sizes."""
    model_dir = Path(model_dir).resolve()
    digest = hashlib.sha256()
    for path in sorted(model_dir.rglob("*")):
        if path.name == "config.json" or path.suffix == ".safetensors":
            digest.update(str(path.relative_to(model_dir)).encode())
            digest.update(path.read_bytes() if path.suffix == ".json" else str(path.stat().st_size).encode())
    return digest.hexdigest()[:12]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def profile_path(model_dir: str | Path, device: str | None = None) -> Path:
    device = device or device_name()
    return cache_root() / "profiles" / f"{_slug(device)}--{_slug(Path(model_dir).resolve().name)}-{model_key(model_dir)}.json"


def save_profile(profile: dict, path: Path):
    """Write profile at path in one rename: a run stopped mid-write (Ctrl-C, a full disk) leaves
    the earlier profile, or none, and no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class ProfileWarning(UserWarning):
    """A tuning profile that cannot be used: it is named and ignored (settings fall back to the
    chip preset or the defaults) rather than failing or hanging every run of the model."""


def load_profile(model_dir: str | Path, model=None) -> tuple[dict, Path] | None:
    """This device's profile for model_dir, if `hybrid tune` made one (and the model is unchanged)
    and it holds settings the model can run (`check_profile`, against `model` when given); a bad
    one is ignored with a `ProfileWarning` naming it."""
    path = profile_path(model_dir)
    if not path.is_file():
        return None
    try:
        profile = read_json_object(path)
        check_profile(profile, path, Path(model_dir), model)
    except HybridError as e:
        warnings.warn(f"ignoring the tuning profile: {e}; run `hybrid tune` again or delete it", ProfileWarning, stacklevel=2)
        return None
    return profile, path


def check_profile(profile: dict, path: Path, model_dir: Path, model=None):
    """What chat and generate read from a profile: the chosen method, one whose files are beside
    the model, and each method's best settings, of the right types and within the model's bounds
    (`mlx_hybrid.limits`): a beam of width 100000 would make every run of the model hang."""
    from mlx_hybrid.limits import check_beam
    from mlx_hybrid.speculative.medusa import check_choices

    best = profile.get("best", {})
    if not isinstance(best, dict) or not all(isinstance(v, dict) for v in best.values()):
        raise HybridError(f"{path}: 'best' must map methods to their settings")
    choice = profile.get("choice")
    for method in set(best) | ({choice} - {None}):
        if method not in TUNED:
            raise HybridError(f"{path}: unknown method {method!r} (tuned methods: {', '.join(TUNED)})")
        if not (model_dir / method).is_dir():
            raise HybridError(f"{path}: it names {method}, but {model_dir} has no {method}/ directory")
    redrafter, medusa = best.get("redrafter", {}), best.get("medusa", {})
    if redrafter.get("beam_width") is not None or redrafter.get("beam_length") is not None:
        width, length = redrafter.get("beam_width"), redrafter.get("beam_length")
        if model is not None:
            check_beam(width, length, model, f"{path}")
        elif not (isinstance(width, int) and isinstance(length, int) and width >= 1 and length >= 2):
            raise HybridError(f"{path}: beam must be width >= 1 x length >= 2, got {width} x {length}")
    if medusa.get("medusa_choices") is not None:
        heads = read_json_object(model_dir / "medusa" / "config.json").get("medusa_num_heads")
        check_choices(medusa["medusa_choices"], heads, model, f"{path}")
    from mlx_hybrid.models.linear import ROWS

    limits = profile.get("row_limits", {})
    if not isinstance(limits, dict):
        raise HybridError(f"{path}: 'row_limits' must map weight shapes NxK to their measurements")
    for shape, row in limits.items():
        limit = row.get("limit") if isinstance(row, dict) else None
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", str(shape)) or not isinstance(limit, int) or not 0 <= limit <= ROWS:
            raise HybridError(f"{path}: row_limits needs NxK: {{'limit': 0..{ROWS}}}, got {shape!r}: {row!r}")
    from mlx_hybrid.tree_attention import WARP_CHOICES

    attention = profile.get("tree_attention", {"limit": 0})
    limit = attention.get("limit") if isinstance(attention, dict) else None
    warps = attention.get("warps", WARP_CHOICES[0]) if isinstance(attention, dict) else None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0 or warps not in WARP_CHOICES:
        raise HybridError(f"{path}: tree_attention needs {{'limit': a node count >= 0, 'warps': one of {WARP_CHOICES}}}, got {attention!r}")


def chip_preset(device: str) -> tuple[str, int] | None:
    """(chip, beam width) for an Apple chip name such as 'Apple M2 Max (gpu)'."""
    m = re.search(r"\b(M[12])(?: (Pro|Max|Ultra))?\b", device)
    if not m or "apple" not in device.lower():
        return None
    chip = m.group(1) + (f" {m.group(2)}" if m.group(2) else "")
    return chip, PRESETS[chip][1]


def settings_for(method: str, model_dir: str | Path | None, model=None) -> Settings:
    """Settings for method on this device: the tuned profile's (checked against model), else the
    chip preset's, else the drafter's and heads' own defaults."""
    found = load_profile(model_dir, model) if model_dir is not None else None
    if found and method in found[0].get("best", {}):
        best = found[0]["best"][method]
        return Settings(best.get("beam_width"), best.get("beam_length"), best.get("medusa_choices"), source=f"tuned profile {found[1]}")
    device = device_name()
    preset = chip_preset(device)
    if preset is None:
        return Settings(source=f"no profile for {device}; `hybrid tune` makes one")
    chip, width = preset
    if method == "medusa":
        return Settings(tree_size=width * (PRESET_BEAM_LENGTH - 1), source=f"{chip} preset")
    return Settings(width, PRESET_BEAM_LENGTH, source=f"{chip} preset")


def kernel_limits(model_dir: str | Path | None, model=None) -> tuple[dict[tuple[int, int], int], int | None, int]:
    """Which parts of a verification pass take this project's kernels, as this device's profile
    measured them: the most rows the row kernel takes per weight shape (`linear.LIMITS`), the
    most nodes the tree-attention kernel takes (`tree_attention.LIMIT`) and its simdgroups a
    threadgroup (`tree_attention.WARPS`, its default where the profile predates that measure);
    ({}, None, the default) without a profile."""
    from mlx_hybrid.tree_attention import WARP_CHOICES

    found = load_profile(model_dir, model) if model_dir is not None else None
    profile = found[0] if found else {}
    attention = profile.get("tree_attention", {})
    return shape_limits(profile.get("row_limits", {})), attention.get("limit"), attention.get("warps", WARP_CHOICES[0])


def use_kernel_limits(model_dir: str | Path | None, model=None):
    """Make the passes that follow take the kernels where this device's profile measured that
    they win (`kernel_limits`): what chat, generate and serve do before they speculate, and what
    a program using `load_proposer` does to get the same passes."""
    from mlx_hybrid import tree_attention
    from mlx_hybrid.models import linear

    rows, tree_attention.LIMIT, tree_attention.WARPS = kernel_limits(model_dir, model)
    linear.LIMITS.update(rows)


def shape_limits(row_limits: dict) -> dict[tuple[int, int], int]:
    """A profile's row_limits ({"NxK": {"limit": ...}}) keyed as linear.LIMITS is: (N, K) -> limit."""
    return {tuple(int(d) for d in shape.split("x")): row["limit"] for shape, row in row_limits.items()}


def profile_choice(model_dir: str | Path | None, model=None) -> str | None:
    """The method the tuned profile found fastest here (None: plain decoding or no profile)."""
    found = load_profile(model_dir, model) if model_dir is not None else None
    return found[0].get("choice") if found else None
