"""Text generation: one streaming entry point for plain and speculative decoding.

`stream_generate` checks the request, makes the cache (converted to fit a memory budget when the
model has DSLA layers: `mlx_hybrid.adaptive`), runs the token steps of plain decoding
(`mlx_hybrid.decode`) or of a speculator (`mlx_hybrid.speculative`), detokenizes, applies stop
strings and reports speed and memory with every piece of text.
"""

import time
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_hybrid.adaptive import Plan, request_cache
from mlx_hybrid.decode import generate_step
from mlx_hybrid.errors import HybridError
from mlx_hybrid.limits import check_token_ids, clip_max_tokens
from mlx_hybrid.generation_config import model_sampling_defaults
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.speculative.proposer import Proposer
from mlx_hybrid.speculative.steps import speculative_steps


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
    method: str | None = None  # the speculator's (medusa, redrafter, draft); None: plain decoding
    steps: int = 0  # target forward passes since the prompt's
    tokens_per_step: float = 1.0  # tokens the target produced per pass
    acceptance_rate: float = 0.0  # accepted drafts / (steps x the speculator's depth)
    plan: Plan | None = None  # the DSLA conversion a memory policy chose for this request


def context_limit(model: nn.Module) -> int | None:
    return getattr(model.args, "max_position_embeddings", None)


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def request_tokens(model: nn.Module, tokenizer: TokenizerWrapper, prompt, cache: list | None, max_tokens: int):
    """The prompt's tokens and max_tokens cut to the context left after what cache holds; one-line
    errors for an empty prompt, ids outside the vocabulary, max_tokens < 1 or a prompt beyond the
    model's context."""
    clip_max_tokens(max_tokens, model)
    tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else check_token_ids(prompt, model.args.vocab_size)
    if not tokens:
        raise HybridError("the prompt is empty")
    used = cache[0].offset if cache else 0
    limit = context_limit(model)
    if limit is not None and used + len(tokens) >= limit:
        raise HybridError(f"the prompt needs {used + len(tokens)} tokens of context but the model's limit is {limit}")
    return tokens, clip_max_tokens(max_tokens, model, used + len(tokens))


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
    history: list[int] = (),
    speculator: Proposer | None = None,
    prefill_step_size: int = 512,
    memory_budget: str | int | None = None,
    progress=None,
) -> Iterator[GenerationResponse]:
    """Stream text pieces (with per-token stats) for prompt, a string or token ids.

    With a `cache` from `model.make_cache()` the prompt continues what the cache already holds,
    which is how a chat keeps its history without re-reading it (`history`: those tokens, which a
    draft model must see too). Without one, a model with DSLA weights runs as many layers as DSLA
    as weights + cache need to fit memory_budget (bytes or e.g. "8GB"; default: the device's,
    see `mlx_hybrid.adaptive`); a budget also applies to others.

    sampling None: the model's generation_config.json defaults (`mlx_hybrid.generation_config`),
    else greedy.

    speculator (`mlx_hybrid.speculative.load_proposer`): decode speculatively, a target pass
    verifying its drafts. At temperature 0 the tokens are plain greedy decoding's; above it, draft-
    model and ReDrafter tokens are distributed as sampling from the target, Medusa's follow its
    typical acceptance.

    progress(done, total): the prompt but its last token is read in chunks; called with (0, total)
    once the request is accepted, then after each chunk, when every layer's cache holds it (where
    a chat snapshots its caches: `mlx_hybrid.chat`).
    """
    if sampling is None:  # the model's generation_config.json, else greedy
        sampling = model_sampling_defaults(model).params(speculative=speculator is not None)
    sampling.check(model.args.vocab_size)
    if speculator is not None and sampling.repetition_penalty is not None:
        raise HybridError("speculative decoding does not support a repetition penalty")
    tokens, max_tokens = request_tokens(model, tokenizer, prompt, cache, max_tokens)
    plan = None
    if cache is None:
        cache, plan = request_cache(model, len(tokens), max_tokens, memory_budget, prefill_step_size)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)

    if speculator is None:
        steps = (([token], 0) for token, _ in generate_step(
            mx.array(tokens), model, cache, sampling.sampler(), sampling.logits_processors(), max_tokens, prefill_step_size,
            progress,
        ))
    else:
        steps = speculative_steps(model, speculator, tokens, cache, sampling, history, prefill_step_size, progress=progress)
    stream = TextStream(tokenizer, stop)
    depth = speculator.depth if speculator is not None else 1
    mx.reset_peak_memory()
    tic = time.perf_counter()
    if progress:
        progress(0, len(tokens) - 1)
    prompt_tps, n, passes, accepted = 0.0, 0, 0, 0
    for new, drafts in steps:
        if n == 0:
            prompt_tps = len(tokens) / (time.perf_counter() - tic)
            tic = time.perf_counter()
        else:
            passes, accepted = passes + 1, accepted + drafts
        for token in new:
            n += 1
            piece, finish = stream.add(token, last=n == max_tokens)
            elapsed = time.perf_counter() - tic
            yield GenerationResponse(
                text=piece,
                token=token,
                prompt_tokens=len(tokens),
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=n / elapsed if elapsed > 0 else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                method=None if speculator is None else speculator.name,
                steps=passes,
                tokens_per_step=(n - 1) / passes if passes else 1.0,
                acceptance_rate=accepted / (passes * depth) if passes and speculator is not None else 0.0,
                plan=plan,
            )
            if finish:
                return


def generate(model: nn.Module, tokenizer: TokenizerWrapper, prompt: str | list[int], **kwargs) -> str:
    """The whole completion of prompt as one string (see `stream_generate` for the options)."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, **kwargs))
