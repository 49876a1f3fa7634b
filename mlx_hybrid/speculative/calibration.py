"""Acceptance statistics of drafts, measured offline on the target's greedy continuations.

Under greedy acceptance a step accepts the longest drafted path that agrees with the target's own
greedy tokens, so one greedy run of the target over a prompt says, at every position, how many
tokens any draft proposed there would get accepted, with no verification pass. Medusa's tree
construction (section 3.3.1) and the tuner's beam choice both read these statistics.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_hybrid.errors import HybridError
from mlx_hybrid.decode import generate_step, prefill
from mlx_hybrid.speculative.tree import first_sharing


@dataclass
class GreedyRun:
    """tokens: a prompt and the target's greedy continuation. hidden (n, H): the target's hidden
    states from the prompt's last token on; hidden[i] produced tokens[start + i + 1]."""

    tokens: list[int]
    start: int
    hidden: mx.array


def greedy_runs(model: nn.Module, prompts: list[list[int]], new_tokens: int, progress=None) -> list[GreedyRun]:
    runs = []
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    for i, prompt in enumerate(prompts):
        cont = [t for t, _ in generate_step(mx.array(prompt), model, model.make_cache(), argmax, max_tokens=new_tokens)]
        seq = list(prompt) + cont
        cache = model.make_cache()
        prefill(model, mx.array(seq[: len(prompt) - 1]), cache)
        _, hidden = model(mx.array(seq[len(prompt) - 1 :])[None], cache, return_hidden=True)
        runs.append(GreedyRun(seq, len(prompt) - 1, hidden[0]))
        mx.eval(runs[-1].hidden)
        if progress:
            progress(i + 1, len(prompts))
    return runs


@dataclass
class BeamStats:
    """For one beam width, per beam length l = 2 .. max (rows) and position (columns): the drafts
    a step rooted there accepts (root not counted) and the candidates it verifies after prefix
    de-duplication (root counted). positions[j]: (run, index of the root in run.tokens)."""

    width: int
    lengths: list[int]
    accepted: np.ndarray
    candidates: np.ndarray
    positions: list[tuple[int, int]]


def beam_acceptance(drafter, embed: nn.Embedding, runs: list[GreedyRun], widths: list[int], max_length: int, batch: int = 16, progress=None) -> list[BeamStats]:
    """Accepted drafts and packed-beam sizes of ReDrafter beam search at every width x length, at
    every position of runs with max_length - 1 target tokens after the root."""
    roots, hiddens, truths, positions = [], [], [], []
    for r, run in enumerate(runs):
        for i in range(len(run.tokens) - run.start - max_length):
            at = run.start + i + 1  # the root: the target's token from hidden[i]
            positions.append((r, at))
            roots.append(run.tokens[at])
            hiddens.append(run.hidden[i])
            truths.append(run.tokens[at + 1 : at + max_length])
    if not roots:
        raise HybridError(f"the greedy runs are too short for beams of length {max_length}")
    truths = np.array(truths).reshape(len(roots), max_length - 1)
    out = []
    for w, width in enumerate(widths):
        accepted = np.zeros((max_length - 1, len(roots)))
        candidates = np.zeros((max_length - 1, len(roots)))
        for lo in range(0, len(roots), batch):
            hi = min(lo + batch, len(roots))
            steps = drafter.beam_search(mx.stack(hiddens[lo:hi]), mx.array(roots[lo:hi]), embed, width, max_length)
            for l, beams in enumerate(steps):  # beams (B, width, l + 2)
                unique = (first_sharing(beams) == mx.arange(width)[:, None]).sum(axis=(-2, -1))  # packed-beam size
                beams = np.array(beams)
                match = np.cumprod(beams[:, :, 1:] == truths[lo:hi, None, : l + 1], axis=-1).sum(-1)
                accepted[l, lo:hi] = match.max(axis=1)
                candidates[l, lo:hi] = np.array(unique)
            if progress:
                progress(w * len(roots) + hi, len(widths) * len(roots))
        out.append(BeamStats(width, list(range(2, max_length + 1)), accepted, candidates, positions))
    return out
