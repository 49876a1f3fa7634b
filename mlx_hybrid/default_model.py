"""The embedded default model of `hybrid chat`: this project's own distilled hybrid of
SmolLM2-135M-Instruct (8 layers, 4 attention + 4 Mamba2, an 8192-token vocabulary) with its
ReDrafter drafter, 4-bit, shipped as package data so that `hybrid chat` needs no download and no
`--model`. docs/models.md says how it was made and how to rebuild it (`train_cuda/scripts/real_default.py`,
then `hybrid convert`).
"""

from pathlib import Path

PATH = Path(__file__).parent / "data" / "default"


def default_model_path() -> Path:
    if not (PATH / "config.json").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from this install ({PATH}): reinstall mlx-hybrid, or pass --model DIR")
    return PATH
