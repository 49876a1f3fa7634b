"""Sampling settings, checked once, and the samplers and logits processors they make (mlx-lm's)."""

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_hybrid.limits import check_sampling


@dataclass
class SamplingParams:
    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    seed: int | None = None

    def check(self, vocab_size: int | None = None):
        """One-line errors for values out of range (`limits.check_sampling`); vocab_size bounds top-k."""
        check_sampling(self, vocab_size)

    def sampler(self) -> Callable[[mx.array], mx.array]:
        return make_sampler(self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)

    def logits_processors(self) -> list:
        return make_logits_processors(
            repetition_penalty=self.repetition_penalty, repetition_context_size=self.repetition_context_size
        )
