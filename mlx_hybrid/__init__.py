"""mlx-hybrid: fast on-device LLM inference on MLX."""

from mlx_hybrid.chat import ChatSession
from mlx_hybrid.errors import HybridError
from mlx_hybrid.generate import GenerationResponse, generate, stream_generate
from mlx_hybrid.loader import load, load_model
from mlx_hybrid.sampling import SamplingParams

__all__ = [
    "ChatSession",
    "GenerationResponse",
    "HybridError",
    "SamplingParams",
    "generate",
    "load",
    "load_model",
    "stream_generate",
]
