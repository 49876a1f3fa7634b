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
"""

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlx_hybrid.errors import HybridError

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
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(profile, f, indent=1)
    os.replace(tmp, path)


def load_profile(model_dir: str | Path) -> tuple[dict, Path] | None:
    """This device's profile for model_dir, if `hybrid tune` made one (and the model is unchanged)."""
    path = profile_path(model_dir)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()), path
    except (OSError, json.JSONDecodeError) as e:
        raise HybridError(f"unreadable tuning profile {path} ({e}); delete it or run `hybrid tune` again") from None


def chip_preset(device: str) -> tuple[str, int] | None:
    """(chip, beam width) for an Apple chip name such as 'Apple M2 Max (gpu)'."""
    m = re.search(r"\b(M[12])(?: (Pro|Max|Ultra))?\b", device)
    if not m or "apple" not in device.lower():
        return None
    chip = m.group(1) + (f" {m.group(2)}" if m.group(2) else "")
    return chip, PRESETS[chip][1]


def settings_for(method: str, model_dir: str | Path | None) -> Settings:
    """Settings for method on this device: the tuned profile's, else the chip preset's, else the
    drafter's and heads' own defaults."""
    found = load_profile(model_dir) if model_dir is not None else None
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


def profile_choice(model_dir: str | Path | None) -> str | None:
    """The method the tuned profile found fastest here (None: plain decoding or no profile)."""
    found = load_profile(model_dir) if model_dir is not None else None
    return found[0].get("choice") if found else None
