"""Plain decoding: chunked prefill and the pipelined token loop.

Decode is pipelined: step n+1 is queued with `mx.async_eval` before token n is handed back, so
the device never waits on Python between tokens. All of it runs on `generation_stream`.
"""

from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

# One stream per thread (MLX binds a stream to the thread that made it): generation runs from any thread.
generation_stream = mx.new_thread_local_stream(mx.default_device())


def prefill(model: nn.Module, tokens: mx.array, cache: list, step_size: int = 512, progress=None):
    """Feed tokens through the model in chunks of step_size, filling the cache; progress(done,
    total) after each chunk, once every layer's cache holds it."""
    done = 0
    with mx.stream(generation_stream):
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
    progress=None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs) for up to max_tokens new tokens after prompt, which must be non-empty
    (progress: `prefill`'s, for the prompt but its last token)."""

    def step(tokens: mx.array, history: mx.array):
        logits = model(tokens[None], cache)[:, -1, :]
        for processor in logits_processors:
            logits = processor(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs

    prefill(model, prompt[:-1], cache, prefill_step_size, progress)
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
