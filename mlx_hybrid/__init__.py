"""mlx-hybrid: fast on-device LLM inference on MLX.

The exports load on first use, so that the `hybrid` command starts at once and can take a Ctrl-C
quietly while MLX and transformers (seconds on a cold start) are still loading.
"""

import importlib
import sys
import types
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mlx-hybrid")  # the installed distribution's: pyproject.toml is the one source
except PackageNotFoundError:  # a checkout on sys.path that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "ChatSession": "mlx_hybrid.chat",
    "GenerationResponse": "mlx_hybrid.generate",
    "HybridError": "mlx_hybrid.errors",
    "SamplingParams": "mlx_hybrid.sampling",
    "generate": "mlx_hybrid.generate",
    "load": "mlx_hybrid.loader",
    "load_default": "mlx_hybrid.loader",
    "load_model": "mlx_hybrid.loader",
    "stream_generate": "mlx_hybrid.generate",
}
__all__ = sorted(_EXPORTS)


class _Package(types.ModuleType):
    def __getattr__(self, name):
        if name not in _EXPORTS:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        types.ModuleType.__setattr__(self, name, value)
        return value

    def __setattr__(self, name, value):
        # Importing the submodule mlx_hybrid.generate binds the module to this name: the export,
        # the function, keeps it (as when the package imported it eagerly).
        if not (name in _EXPORTS and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
