"""The speculative decoding loop.

Each step a proposer (Medusa heads, a ReDrafter drafter or a draft model) turns the token the
target produced last (the root) into a candidate tree; the target runs the whole tree in one
forward pass (`verify`), an acceptance rule (`accept`) picks the path it agrees with plus one
token of its own, and the caches keep only that path (`cache.commit`). A step therefore yields
between 1 and depth + 1 tokens for one target pass. `mlx_hybrid.generate.stream_generate` turns
the steps into text.
"""

from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_hybrid import decode
from mlx_hybrid.cache import StateCache, commit
from mlx_hybrid.decode import prefill
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.speculative import accept
from mlx_hybrid.speculative.proposer import Proposer
from mlx_hybrid.speculative.tree import retrieve_indices
from mlx_hybrid.speculative.verify import verify


def _first_token(logits: mx.array, sampling: SamplingParams, rng: np.random.Generator) -> int:
    if sampling.temp == 0:
        return int(mx.argmax(logits).item())
    p = np.exp(np.array(accept.target_logprobs(logits, sampling), np.float64))
    return accept._draw(p, rng)


def speculative_steps(
    model: nn.Module,
    proposer: Proposer,
    prompt: list[int],
    cache: list,
    sampling: SamplingParams,
    history: list[int] = (),
    prefill_step_size: int = 512,
    epsilon: float = 0.09,
    delta: float = 0.3,
    progress=None,
) -> Iterator[tuple[list[int], int]]:
    """Yield (new tokens, accepted drafts) for each target pass; the first pass reads the prompt.

    history: the tokens `cache` already holds (a chat's earlier turns), which the draft model
    needs to see too. At temperature 0 the tokens are plain greedy decoding's; above it, draft-model
    and ReDrafter tokens are distributed as sampling from the target, and Medusa uses typical
    acceptance with epsilon, delta (its posterior threshold and alpha); progress: `prefill`'s, for
    the prompt but its last token.
    """
    rng = np.random.default_rng(sampling.seed)
    with mx.stream(decode.generation_stream):
        prefill(model, mx.array(prompt[:-1]), cache, prefill_step_size, progress)
        logits, hidden = model(mx.array(prompt[-1:])[None], cache, return_hidden=True)
        hidden = hidden[0, -1]
        if sampling.temp == 0 and proposer.drafts_on_device:
            yield from _greedy_passes(model, proposer, cache, mx.argmax(logits[0, -1:], axis=-1).astype(mx.int32), hidden)
            return
        root = _first_token(logits[0, -1].astype(mx.float32), sampling, rng)
        yield [root], 0
        tokens = list(history) + list(prompt) + [root]
        while True:
            cand = proposer.propose(tokens, hidden, sampling)
            # Placed at the cache's offset, the pass takes the compiled route where it can
            # (`verify`), as greedy passes do: a small model's pass is bound by the host's time per op.
            tree = cand.verification_tree().at(mx.array([cache[0].offset], mx.int32), cache[0].offset)
            logits, hiddens = verify(model, mx.array(cand.tokens)[None], cache, tree)
            logits = logits[0].astype(mx.float32)
            if sampling.temp == 0:
                path, nxt = accept.greedy(cand, logits)
            elif cand.q is None:
                logprobs = accept.target_logprobs(logits, sampling)
                path, nxt = accept.typical(cand, retrieve_indices(cand.parents), logprobs, epsilon, delta, rng)
            else:
                p = np.exp(np.array(accept.target_logprobs(logits, sampling), np.float64))
                path, nxt = accept.rejection(cand, p, rng)
            commit(cache, path)
            hidden = hiddens[0, path[-1]]
            new = [int(cand.tokens[t]) for t in path[1:]] + [nxt]
            tokens += new
            yield new, len(path) - 1


def _greedy_passes(model: nn.Module, proposer: Proposer, cache: list, root: mx.array, hidden: mx.array) -> Iterator[tuple[list[int], int]]:
    """Greedy speculation with the host one pass behind the device, as plain decoding queues the
    next token before reading this one: drafting, verification, acceptance (`accept.greedy_rows`)
    and the cache moves (`commit` of a `DevicePath`) all run on the device, each pass placed at a position
    the device computes (`TreeMask.at`), so pass k + 1 is queued before the host reads pass k. The
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
            logits, hiddens = verify(model, draft.tokens[None], cache, draft.tree.at(pos, bound))
            info, last = accept.greedy_rows(draft, logits.squeeze(0))  # squeeze: logits[0] would be a copy (a gather)
            commit(cache, info[2 : 2 + width], last)
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
