"""Token generation: chunked prefill, pipelined decode, sampling, stop strings and stats.

Decode is pipelined: step n+1 is queued with `mx.async_eval` before token n is handed back, so
the device never waits on Python between tokens.
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_hybrid.adaptive import is_adaptive, request_cache
from mlx_hybrid.errors import HybridError
from mlx_hybrid.models.linear import matmul_only

# Thread-local: MLX streams belong to the thread that made them, and a server decodes on a worker
# thread of its own (mlx_hybrid.server.engine).
generation_stream = mx.new_thread_local_stream(mx.default_device())


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


@dataclass
class GenerationResponse:
    text: str  # text added since the previous response
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or None while running


def prefill(model: nn.Module, tokens: mx.array, cache: list, step_size: int = 512, progress=None):
    """Feed tokens through the model in chunks of step_size, filling the cache. Its products take
    MLX's matmul (`matmul_only`): a prompt's row counts would each build the row kernel on CUDA."""
    done = 0
    with mx.stream(generation_stream), matmul_only():
        while done < tokens.size:
            chunk = tokens[done : done + step_size]
            model(chunk[None], cache)
            mx.eval([c.state for c in cache])
            done += chunk.size
            if progress:
                progress(done, tokens.size)


def generate_step(
    prompt: mx.array,
    model: nn.Module,
    cache: list,
    sampler: Callable[[mx.array], mx.array],
    logits_processors: list = (),
    max_tokens: int = 256,
    prefill_step_size: int = 512,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs) for up to max_tokens new tokens after prompt, which must be non-empty."""

    def step(tokens: mx.array, history: mx.array):
        logits = model(tokens[None], cache)[:, -1, :]
        for processor in logits_processors:
            logits = processor(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs

    prefill(model, prompt[:-1], cache, prefill_step_size)
    history = prompt
    with mx.stream(generation_stream):
        token, logprobs = step(prompt[-1:], history)
        mx.async_eval(token, logprobs)
        for n in range(max_tokens):
            if n + 1 < max_tokens:
                if logits_processors:
                    history = mx.concatenate([history, token])
                next_token, next_logprobs = step(token, history)
                mx.async_eval(next_token, next_logprobs)
            yield token.item(), logprobs
            if n % 256 == 255:
                mx.clear_cache()
            if n + 1 < max_tokens:
                token, logprobs = next_token, next_logprobs


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (what a cache can keep)."""
    if len(a) <= len(b) and b[: len(a)] == a:
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def context_limit(model: nn.Module) -> int | None:
    return getattr(model.args, "max_position_embeddings", None)


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def request_tokens(model: nn.Module, tokenizer: TokenizerWrapper, prompt, cache: list | None, max_tokens: int):
    """The prompt's tokens and max_tokens cut to the context left after what cache holds; one-line
    errors for an empty prompt, max_tokens < 1 or a prompt beyond the model's context."""
    if max_tokens < 1:
        raise HybridError(f"max tokens must be >= 1, got {max_tokens}")
    tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise HybridError("the prompt is empty")
    used = cache[0].offset if cache else 0
    limit = context_limit(model)
    if limit is not None and used + len(tokens) >= limit:
        raise HybridError(f"the prompt needs {used + len(tokens)} tokens of context but the model's limit is {limit}")
    if limit is not None:
        max_tokens = min(max_tokens, limit - used - len(tokens))
    return tokens, max_tokens


class TextStream:
    """Generated tokens in, printable text out: detokenizes, finishes at EOS, at max tokens or at a
    stop string (cut off), and holds back text that may be the start of a stop string."""

    def __init__(self, tokenizer: TokenizerWrapper, stop=()):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.eos = set(tokenizer.eos_token_ids)
        self.stops = [s for s in stop if s]
        self.text, self.emitted = "", 0

    def add(self, token: int, last: bool) -> tuple[str, str | None]:
        """The new text and the finish reason (None, "stop" or "length") after token."""
        finish = "stop" if token in self.eos else ("length" if last else None)
        if token not in self.eos:
            self.detokenizer.add_token(token)
        if finish:
            self.detokenizer.finalize()
        text = self.text + self.detokenizer.last_segment
        hit = min((i for i in (text.find(s, max(0, self.emitted - len(s))) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            text, finish = text[:hit], "stop"
        end = len(text) if finish else len(text) - _held_back(text, self.stops)
        piece, self.emitted = text[self.emitted : end], max(self.emitted, end)
        self.text = text
        return piece, finish


def stream_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop: list[str] | tuple = (),
    cache: list | None = None,
    prefill_step_size: int = 512,
    memory_budget: str | int | None = None,
) -> Iterator[GenerationResponse]:
    """Stream text pieces (with per-token stats) for prompt, a string or token ids.

    With a `cache` from `model.make_cache()` the prompt continues what the cache already holds,
    which is how a chat keeps its history without re-reading it. Without one, a model with DSLA
    weights runs as many layers as DSLA as weights + cache need to fit memory_budget (bytes or
    e.g. "8GB"; default: the device's, see `mlx_hybrid.adaptive`); a budget also applies to others.
    """
    sampling = sampling or SamplingParams()
    sampling.check()
    tokens, max_tokens = request_tokens(model, tokenizer, prompt, cache, max_tokens)
    if cache is None and (memory_budget is not None or is_adaptive(model)):
        cache, _ = request_cache(model, len(tokens), max_tokens, memory_budget, prefill_step_size)
    cache = cache if cache is not None else model.make_cache()
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)

    stream = TextStream(tokenizer, stop)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    steps = generate_step(
        mx.array(tokens), model, cache, sampling.sampler(), sampling.logits_processors(), max_tokens, prefill_step_size
    )
    prompt_tps = 0.0
    for n, (token, _) in enumerate(steps):
        if n == 0:
            prompt_time = time.perf_counter() - tic
            prompt_tps = len(tokens) / prompt_time
            tic = time.perf_counter()
        piece, finish = stream.add(token, last=n + 1 == max_tokens)
        elapsed = time.perf_counter() - tic
        yield GenerationResponse(
            text=piece,
            token=token,
            prompt_tokens=len(tokens),
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
        )
        if finish:
            break


def generate(model: nn.Module, tokenizer: TokenizerWrapper, prompt: str | list[int], **kwargs) -> str:
    """The whole completion of prompt as one string (see `stream_generate` for the options)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
