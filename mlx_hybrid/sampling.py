"""Sampling settings, checked once, and the samplers and logits processors they make (mlx-lm's)."""

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_hybrid.errors import HybridError


@dataclass
class SamplingParams:
    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    seed: int | None = None

    def check(self):
        if self.temp < 0:
            raise HybridError(f"temperature must be >= 0, got {self.temp}")
        if not 0 <= self.top_p <= 1:
            raise HybridError(f"top-p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise HybridError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise HybridError(f"min-p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise HybridError(f"repetition penalty must be > 0, got {self.repetition_penalty}")

    def sampler(self) -> Callable[[mx.array], mx.array]:
        return make_sampler(self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)

    def logits_processors(self) -> list:
        return make_logits_processors(
            repetition_penalty=self.repetition_penalty, repetition_context_size=self.repetition_context_size
        )
