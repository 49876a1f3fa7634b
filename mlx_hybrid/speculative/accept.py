"""Which candidates the target accepts, and the token it adds after them.

Every rule walks the candidate tree from node 0 (the target's own token, always accepted) and
returns the accepted path plus the next token, drawn from the target at the path's last node:

- `greedy`: a child is accepted when it is the target's argmax at its parent. The output is
  exactly plain greedy decoding. `greedy_rows` is the same rule on the device, over the tree's
  root-to-leaf rows, for the greedy loop that never waits on the host between passes.
- `rejection`: speculative sampling (Leviathan et al., Chen et al.), generalized to several drafts
  per node as in SpecInfer: the drafts below a node, drawn independently from the draft
  distribution q, are tried in order; draft x is accepted with probability min(1, r(x) / q(x)),
  and after each rejection r becomes normalize(max(r - q, 0)), starting from r = p, the target's
  distribution. When all are rejected the next token is drawn from r. The output is distributed
  exactly as sampling from the target.
- `typical`: Medusa's typical acceptance (section 2.3.1): a candidate is accepted when the
  target gives it probability above min(epsilon, delta * exp(-entropy)); the longest accepted
  candidate wins, ties broken by likelihood. Faster, not distribution-preserving.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlx_hybrid.kernels import kernel_backend, load_kernel
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.tree_mask import TreeMask


@dataclass
class Candidates:
    """What a proposer hands to verification.

    tokens: (T,) node tokens, node 0 the target's last token. parents: the tree (`TreeMask`).
    drafts: node -> the nodes drafted below it, in the order they were drawn, one entry per draw
        (a node drawn twice appears twice); defaults to the children in node order.
    q: (T, V) numpy, the draft distribution each node's drafts were drawn from (rejection only).
    tree: the `TreeMask` of parents, when the proposer has it built already.
    """

    tokens: np.ndarray
    parents: list[int]
    drafts: dict[int, list[int]] | None = None
    q: np.ndarray | None = None
    tree: TreeMask | None = None

    def verification_tree(self) -> TreeMask:
        return self.tree if self.tree is not None else TreeMask.from_parents(self.parents)

    def draft_lists(self) -> dict[int, list[int]]:
        if self.drafts is not None:
            return self.drafts
        out: dict[int, list[int]] = {}
        for t, p in enumerate(self.parents):
            if p >= 0:
                out.setdefault(p, []).append(t)
        return out


@dataclass
class Draft:
    """A greedy proposer's candidates, left on the device: tokens (T,), the `TreeMask`, and rows
    (R, depth + 1) int32, the nodes of each root-to-leaf candidate, padded with -1."""

    tokens: mx.array
    tree: TreeMask
    rows: mx.array

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.tree.parents, self.tree.depths, self.tree.mask, self.rows) if isinstance(a, mx.array)]


def target_logprobs(logits: mx.array, sampling: SamplingParams) -> mx.array:
    """Log-probabilities of the distribution `sampling.sampler()` draws from (temp > 0): mlx-lm's
    top-p, min-p and top-k filters in its order, then the temperature."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < sampling.top_p < 1:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p != 0:
        logprobs = apply_min_p(logprobs, sampling.min_p, 1)
    if sampling.top_k > 0:
        logprobs = apply_top_k(logprobs, sampling.top_k)
    scaled = logprobs / sampling.temp
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def greedy(cand: Candidates, logits: mx.array) -> tuple[list[int], int]:
    """Follow the target's argmax down the tree; logits (T, V)."""
    best = np.array(mx.argmax(logits, axis=-1))
    drafts = cand.draft_lists()
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in drafts.get(node, ()) if cand.tokens[c] == best[node]), None)
        if nxt is None:
            return path, int(best[node])
        path.append(nxt)


def greedy_rows(draft: Draft, logits: mx.array) -> tuple[mx.array, mx.array]:
    """`greedy` without leaving the device; logits (T, V). The siblings of a node hold distinct
    tokens, so every row that accepts the most drafts accepts the same path.

    Returns info, int32 [accepted drafts n, next token, the best row's nodes, their tokens] (the
    path is the first n + 1 nodes of the row), and the path's last node. On a GPU this is an
    argmax and one kernel launch (metal_kernels/greedy_accept.cu), not ~18 small ops."""
    backend = kernel_backend()
    if backend is None:
        return greedy_rows_ref(draft.tokens, draft.rows, logits)
    return greedy_rows_kernel(draft.tokens, draft.rows, mx.argmax(logits, axis=-1), backend=backend)


def greedy_rows_kernel(tokens: mx.array, rows: mx.array, best: mx.array, *, backend: str) -> tuple[mx.array, mx.array]:
    """`greedy_rows_ref` on the 'metal' or 'cuda' kernel, from the argmax at each node."""
    width = rows.shape[1]
    info, last = load_kernel(backend, "greedy_accept", ("tokens", "rows", "best"), ("info", "last"), reference=_accept_reference)(
        inputs=[tokens.astype(mx.int32), rows.astype(mx.int32), best],
        template=[("TB", best.dtype)],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(2 + 2 * width,), ()],
        output_dtypes=[mx.int32, mx.int32],
    )
    return info, last


@mx.compile  # a dozen small ops with one shape per tree: one fused replay per pass
def greedy_rows_ref(tokens: mx.array, rows: mx.array, logits: mx.array) -> tuple[mx.array, mx.array]:
    """`greedy_rows` in MLX ops, the reference and the path on devices without the kernel."""
    return _accept_best(tokens, rows, mx.argmax(logits, axis=-1))


def _accept_reference(*, inputs, **_):
    """`greedy_rows_ref` on the kernel's launch (its fallback), from the argmax at each node."""
    return _accept_best(*inputs)


def _accept_best(tokens: mx.array, rows: mx.array, best: mx.array) -> tuple[mx.array, mx.array]:
    best = best.astype(mx.int32)
    safe = mx.maximum(rows, 0)
    tokens = tokens.astype(mx.int32)
    ok = (rows[:, 1:] >= 0) & (tokens[safe[:, 1:]] == best[safe[:, :-1]])
    n = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
    r = mx.argmax(n)
    last = safe[r, n[r]]
    return mx.concatenate([n[r][None], best[last][None], rows[r], tokens[safe[r]]]), last


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(len(probs), p=probs / probs.sum()))


def rejection(cand: Candidates, p: np.ndarray, rng: np.random.Generator) -> tuple[list[int], int]:
    """Multi-draft speculative sampling down the tree; p (T, V) target probabilities (float64)."""
    drafts = cand.draft_lists()
    path = [0]
    while True:
        node = path[-1]
        r = p[node]
        for child in drafts.get(node, ()):
            q = cand.q[node]
            x = cand.tokens[child]
            if rng.random() * q[x] < r[x]:  # probability min(1, r(x) / q(x))
                path.append(child)
                break
            residual = np.maximum(r - q, 0.0)
            if residual.sum() <= 0:  # r <= q everywhere means r == q: nothing left to correct
                residual = r
            r = residual / residual.sum()
        else:
            return path, _draw(r, rng)


def typical(
    cand: Candidates, retrieve: np.ndarray, logprobs: mx.array, epsilon: float, delta: float,
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance over the root-to-leaf rows `retrieve` (padded with -1)."""
    parents = np.array(cand.parents)
    probs = mx.exp(logprobs)
    entropy = -(probs * mx.where(probs > 0, logprobs, 0)).sum(axis=-1)
    threshold = mx.minimum(epsilon, delta * mx.exp(-entropy))
    safe = np.maximum(parents, 0)
    idx = mx.array(safe)
    cand_logp = mx.take_along_axis(logprobs[idx], mx.array(cand.tokens.astype(np.int32))[:, None], axis=-1)[:, 0]
    ok = mx.exp(cand_logp) > threshold[idx]
    ok, cand_logp = np.array(ok), np.array(cand_logp, np.float64)
    ok[0], cand_logp[0] = True, 0.0  # the root is the target's own token
    ok, cand_logp = np.append(ok, False), np.append(cand_logp, 0.0)  # index -1: padding
    rows_ok = np.cumprod(ok[retrieve], axis=1)
    lengths = rows_ok.sum(axis=1)
    best = lengths.max()
    tied = np.flatnonzero(lengths == best)
    likelihood = (cand_logp[retrieve[tied, :best]]).sum(axis=1)
    row = retrieve[tied[int(np.argmax(likelihood))], :best]
    path = [int(n) for n in row]
    return path, _draw(np.array(probs[path[-1]], np.float64), rng)
