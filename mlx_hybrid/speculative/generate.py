"""The speculative decoding loop and its streaming API.

Each step a proposer (Medusa heads, a ReDrafter drafter or a draft model) turns the token the
target produced last (the root) into a candidate tree; the target runs the whole tree in one
forward pass, an acceptance rule (`accept`) picks the path it agrees with plus one token of its
own, and the caches keep only that path. A step therefore yields between 1 and depth + 1 tokens
for one target pass.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_hybrid.cache import StateCache, accept_on_device, accept_path
from mlx_hybrid.errors import HybridError
from mlx_hybrid.generate import (
    GenerationResponse,
    SamplingParams,
    TextStream,
    generation_stream,
    prefill,
    request_tokens,
)
from mlx_hybrid.speculative import accept
from mlx_hybrid.speculative.tree import retrieve_indices

METHODS = ("medusa", "redrafter", "draft")
# Where each method's files are looked for inside the target model's directory (FORMAT.md).
SUBDIRS = {"medusa": "medusa", "redrafter": "redrafter", "draft": "draft"}


@dataclass
class SpeculativeResponse(GenerationResponse):
    steps: int = 0  # target forward passes since the prompt
    tokens_per_step: float = 0.0  # tokens the target produced per pass (1 without speculation)
    acceptance_rate: float = 0.0  # accepted draft tokens / (steps x draft depth)


def load_proposer(
    method: str,
    target: nn.Module,
    model_dir: str | Path | None = None,
    path: str | Path | None = None,
    num_draft: int = 4,
    settings=None,
    heads_dtype: str | None = None,
    tokenizer=None,
):
    """The proposer for method, its files at path or else in model_dir's subdirectory for it;
    settings (`mlx_hybrid.profiles.Settings`): the beam or tree to use instead of the defaults;
    heads_dtype: the float dtype Medusa heads or a drafter compute in (default: the target's);
    tokenizer: the target's, which a draft model's own tokenizer must agree with."""
    if method not in METHODS:
        raise HybridError(f"unknown speculative method '{method}' (choose from {', '.join(METHODS)})")
    if path is None:
        if model_dir is None:
            raise HybridError(f"--speculative {method} needs the path of its {SUBDIRS[method]} directory")
        path = Path(model_dir) / SUBDIRS[method]
        if not path.is_dir():
            raise HybridError(f"no {SUBDIRS[method]}/ directory in {model_dir}; give its path")
    if method == "medusa":
        from mlx_hybrid.speculative.medusa import MedusaProposer, load_medusa
        from mlx_hybrid.speculative.tree import MedusaTree

        heads = load_medusa(path, target, heads_dtype)
        tree = None
        if settings is not None and settings.medusa_choices:
            tree = MedusaTree(settings.medusa_choices)
        elif settings is not None and settings.tree_size:
            tree = heads.tree_of_size(settings.tree_size)
        return MedusaProposer(heads, tree)
    if method == "redrafter":
        from mlx_hybrid.speculative.redrafter import ReDrafterProposer, load_redrafter

        width, length = (settings.beam_width, settings.beam_length) if settings is not None else (None, None)
        return ReDrafterProposer(load_redrafter(path, target, heads_dtype), target, width, length)
    from mlx_hybrid.loader import load_model
    from mlx_hybrid.speculative.draft import DraftProposer
    from mlx_hybrid.validate import check_same_vocabulary

    if tokenizer is not None:
        check_same_vocabulary(Path(path), tokenizer)
    return DraftProposer(load_model(path), target, num_draft)


def _first_token(logits: mx.array, sampling: SamplingParams, rng: np.random.Generator) -> int:
    if sampling.temp == 0:
        return int(mx.argmax(logits).item())
    p = np.exp(np.array(accept.target_logprobs(logits, sampling), np.float64))
    return accept._draw(p, rng)


def speculative_steps(
    model: nn.Module,
    proposer,
    prompt: list[int],
    cache: list,
    sampling: SamplingParams,
    history: list[int] = (),
    prefill_step_size: int = 512,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> Iterator[tuple[list[int], int]]:
    """Yield (new tokens, accepted drafts) for each target pass; the first pass reads the prompt.

    history: the tokens `cache` already holds (a chat's earlier turns), which the draft model
    needs to see too. At temperature 0 the tokens are plain greedy decoding's; above it, draft-model
    and ReDrafter tokens are distributed as sampling from the target, and Medusa uses typical
    acceptance with epsilon, delta (its posterior threshold and alpha).
    """
    rng = np.random.default_rng(sampling.seed)
    with mx.stream(generation_stream):
        prefill(model, mx.array(prompt[:-1]), cache, prefill_step_size)
        logits, hidden = model(mx.array(prompt[-1:])[None], cache, return_hidden=True)
        hidden = hidden[0, -1]
        if sampling.temp == 0 and hasattr(proposer, "draft"):
            yield from _greedy_passes(model, proposer, cache, mx.argmax(logits[0, -1:], axis=-1).astype(mx.int32), hidden)
            return
        root = _first_token(logits[0, -1].astype(mx.float32), sampling, rng)
        yield [root], 0
        tokens = list(history) + list(prompt) + [root]
        while True:
            cand = proposer.propose(tokens, hidden, sampling)
            # Placed at the cache's offset, the pass takes the model's compiled route where it has one
            # (`Tree.at`), as greedy passes do: a small model's pass is bound by the host's time per op.
            tree = cand.verification_tree().at(mx.array([cache[0].offset], mx.int32), cache[0].offset)
            logits, hiddens = model(mx.array(cand.tokens)[None], cache, return_hidden=True, tree=tree)
            logits = logits[0].astype(mx.float32)
            if sampling.temp == 0:
                path, nxt = accept.greedy(cand, logits)
            elif cand.q is None:
                logprobs = accept.target_logprobs(logits, sampling)
                path, nxt = accept.typical(cand, retrieve_indices(cand.parents), logprobs, epsilon, delta, rng)
            else:
                p = np.exp(np.array(accept.target_logprobs(logits, sampling), np.float64))
                path, nxt = accept.rejection(cand, p, rng)
            accept_path(cache, path)
            hidden = hiddens[0, path[-1]]
            new = [int(cand.tokens[t]) for t in path[1:]] + [nxt]
            tokens += new
            yield new, len(path) - 1


def _greedy_passes(model: nn.Module, proposer, cache: list, root: mx.array, hidden: mx.array) -> Iterator[tuple[list[int], int]]:
    """Greedy speculation with the host one pass behind the device, as plain decoding queues the
    next token before reading this one: drafting, verification, acceptance (`accept.greedy_rows`)
    and the cache moves (`accept_on_device`) all run on the device, each pass placed at a position
    the device computes (`Tree.at`), so pass k + 1 is queued before the host reads pass k. The
    host only learns each pass's tokens and advances the caches' offsets (`advance`); on exit the
    recurrent states go back to those after the last pass it yielded.

    root: (1,) int32, the token after the prompt, still on the device; it is yielded first, once
    the first pass is queued behind it (as `generate_step` queues the second token)."""
    states = [c for c in cache if isinstance(c, StateCache)]
    pos = mx.array([cache[0].offset], mx.int32)
    mx.async_eval(root, hidden)  # an eval of its own: reading root waits for it alone, not the first pass
    draft = proposer.draft(root, hidden)
    behind, kept = None, [c.arrays for c in states]  # the pass the host has not read; the states it yielded
    try:
        while True:
            width = draft.rows.shape[1]
            bound = cache[0].offset + (behind[2] if behind else 0)  # the unread pass kept at most its width
            logits, hiddens = model(draft.tokens[None], cache, return_hidden=True, tree=draft.tree.at(pos, bound))
            info, last = accept.greedy_rows(draft, logits.squeeze(0))  # squeeze: logits[0] would be a copy (a gather)
            accept_on_device(cache, info[2 : 2 + width], last)
            pos = _next_position(pos, info)
            draft = proposer.draft(info[1:2], hiddens.squeeze(0)[last])
            mx.async_eval(info, pos, draft.arrays(), [c.state for c in states])  # KV caches write the path in the next pass
            ahead = (info, [c.arrays for c in states], width)
            if behind is None:
                yield [root.item()], 0
            else:
                n, new = _read(behind[0], behind[2])
                for c in cache:
                    c.advance(n + 1)
                kept = behind[1]
                yield new, n
            behind = ahead
    finally:  # the queued pass never happened, as far as the caches can tell
        for c, arrays in zip(states, kept):
            c.arrays = arrays


@mx.compile
def _next_position(pos: mx.array, info: mx.array) -> mx.array:
    """Node 0's position in the next pass, past the root and the n accepted drafts (one fused
    kernel instead of two adds)."""
    return pos + info[:1] + 1


def _read(info: mx.array, width: int) -> tuple[int, list[int]]:
    """(accepted drafts n, the pass's new tokens) from `accept.greedy_rows`' info."""
    info = info.tolist()
    n, nxt = info[0], info[1]
    return n, info[3 + width : 3 + width + n] + [nxt]


def speculative_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int],
    proposer,
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop: list[str] | tuple = (),
    cache: list | None = None,
    history: list[int] = (),
    prefill_step_size: int = 512,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> Iterator[SpeculativeResponse]:
    """`mlx_hybrid.stream_generate` with speculative decoding by proposer (`load_proposer`): the
    same responses, one per token, plus speculation stats (steps, tokens per step, acceptance).

    With a `cache` that already holds `history`, the prompt continues it (as a chat does)."""
    sampling = sampling or SamplingParams()
    sampling.check(model.args.vocab_size)
    if sampling.repetition_penalty is not None:
        raise HybridError("speculative decoding does not support a repetition penalty")
    cache = cache if cache is not None else model.make_cache()
    tokens, max_tokens = request_tokens(model, tokenizer, prompt, cache, max_tokens)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)

    stream = TextStream(tokenizer, stop)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps, n, steps, accepted = 0.0, 0, 0, 0
    depth = getattr(proposer, "depth", 1)
    for new, acc in speculative_steps(
        model, proposer, tokens, cache, sampling, history, prefill_step_size, epsilon, delta
    ):
        if n == 0:
            prompt_tps = len(tokens) / (time.perf_counter() - tic)
            tic = time.perf_counter()
        else:
            steps, accepted = steps + 1, accepted + acc
        for token in new:
            n += 1
            piece, finish = stream.add(token, last=n == max_tokens)
            elapsed = time.perf_counter() - tic
            yield SpeculativeResponse(
                text=piece,
                token=token,
                prompt_tokens=len(tokens),
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=n / elapsed if elapsed > 0 else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                steps=steps,
                tokens_per_step=(n - 1) / steps if steps else 1.0,
                acceptance_rate=accepted / (steps * depth) if steps else 0.0,
            )
            if finish:
                return
