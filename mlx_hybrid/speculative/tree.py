"""Candidate trees: what the target verifies in one forward pass, built by each proposer.

A tree is a list of nodes in parent-before-child order; node t continues node `parents[t]`, and
-1 means it continues the cache (node 0, the token the target produced last, is the only root
anything is drafted below; a packed beam's padding nodes are roots that no candidate reaches).
The model reads it as its attention mask (`mlx_hybrid.tree_mask.TreeMask`).

Medusa builds its tree from paths of top-k ranks, one rank per head (`MedusaTree`), either the
Cartesian product of per-head top-k or a sparse tree chosen greedily from measured head
accuracies (`greedy_paths`). ReDrafter packs its beams by prefix de-duplication (`pack_beams`),
on the device, so that drafting, verification and acceptance run without waiting for the host.
"""

import heapq
import itertools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_hybrid.kernels import kernel_backend, load_kernel
from mlx_hybrid.tree_mask import TreeMask


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root down to node."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def retrieve_indices(parents: list[int]) -> np.ndarray:
    """One row per leaf: the nodes of its root-to-leaf path, padded with -1 to the deepest.

    Every candidate sequence the tree holds is a prefix of one of these rows, so scoring the rows
    scores every candidate (Medusa's `retrieve_indices`)."""
    has_child = np.zeros(len(parents), bool)
    for p in parents:
        if p >= 0:
            has_child[p] = True
    paths = [path_to(parents, t) for t in range(len(parents)) if not has_child[t]]
    width = max(len(p) for p in paths)
    return np.array([p + [-1] * (width - len(p)) for p in paths], np.int32)


class MedusaTree:
    """A Medusa candidate tree from paths of top-k ranks (`medusa_choices`).

    Node 0 is the target's own next token; a path [r0, r1, ..., rk] is the node holding head k's
    rank-rk token, below the node of [r0, ..., r(k-1)]. Every prefix of a path must be a path too.
    """

    def __init__(self, paths: list[list[int]]):
        # The all-top-1 chain first: accepting a prefix of it (the likeliest outcome) keeps a
        # prefix of the nodes, which the KV caches keep without moving rows (`KVCache.accept`).
        paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (any(p), len(p), p))
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError("a Medusa tree needs non-empty paths of ranks >= 0")
        node = {(): 0}
        for p in paths:
            if p[:-1] not in node:
                raise ValueError(f"path {list(p)} lacks its prefix {list(p[:-1])} in the tree")
            node[p] = len(node)
        self.paths = [list(p) for p in paths]
        self.num_heads = max(len(p) for p in paths)
        # The largest rank used at each head: how many top-k tokens each head must supply.
        self.topk = [max(p[d] for p in paths if len(p) > d) + 1 for d in range(self.num_heads)]
        self.parents = [-1] + [node[p[:-1]] for p in paths]
        self.tree = TreeMask.from_parents(self.parents)
        self.retrieve = retrieve_indices(self.parents)

    def __len__(self) -> int:
        return len(self.parents)

    def token_index(self, k: int) -> np.ndarray:
        """Where each node's token sits in [root, head 0's top k, head 1's top k, ...]."""
        return np.array([0] + [1 + (len(p) - 1) * k + p[-1] for p in self.paths], np.int32)

    def tokens(self, root: mx.array, top: mx.array) -> mx.array:
        """The tree's tokens (T,) from the root token (1,) and each head's top tokens, best first:
        top (heads, k), k at least every head's top-k."""
        flat = mx.concatenate([root.reshape(1).astype(top.dtype), top.reshape(-1)])
        return flat[mx.array(self.token_index(top.shape[1]))]


def cartesian_paths(topk: list[int]) -> list[list[int]]:
    """The paths of a Cartesian-product tree: every combination of head 0's top-topk[0] with head 1's
    top-topk[1] ... (each prefix included, since every prefix is itself a candidate)."""
    if not topk or min(topk) < 1:
        raise ValueError(f"every head needs top-k >= 1, got {topk}")
    return [list(p) for d in range(1, len(topk) + 1) for p in itertools.product(*(range(k) for k in topk[:d]))]


def greedy_paths(accuracies, num_nodes: int) -> list[list[int]]:
    """The sparse tree of num_nodes candidates (root not counted) with the most expected accepted
    tokens, as in Medusa section 3.3.1: accuracies[h][k] is how often head h's rank-k token is the
    right one, a candidate's chance of acceptance is the product along its path, and the expected
    length is their sum. Since extending a path never raises its product, taking the best frontier
    node num_nodes times is optimal and keeps every prefix in the tree."""
    acc = np.asarray(accuracies, np.float64)
    heads, ranks = acc.shape
    frontier = [(-acc[0, k], (k,)) for k in range(ranks)]
    heapq.heapify(frontier)
    paths = []
    while frontier and len(paths) < num_nodes:
        neg, path = heapq.heappop(frontier)
        paths.append(list(path))
        if len(path) < heads:
            for k in range(ranks):
                heapq.heappush(frontier, (neg * acc[len(path), k], path + (k,)))
    return paths


def expected_length(paths: list[list[int]], accuracies) -> float:
    """Expected accepted tokens per step (root included) of a tree under independent head accuracies."""
    acc = np.asarray(accuracies, np.float64)
    return 1.0 + sum(float(np.prod([acc[d, r] for d, r in enumerate(p)])) for p in paths)


@dataclass
class PackedBeam:
    """Beams with shared prefixes stored once (ReDrafter section 3.3), built on the device.

    tokens: (T,) the unique prefixes' last tokens, beam-major (parents before children), then
        padding up to T = BW * (BL - 1) + 1, the size when no two beams share more than the root.
    tree: the dynamic tree; a padding node hangs off the cache alone (parent -1, depth 0) and no
        beam reaches it, so it is never accepted.
    node_of: (BW, BL) the node of each beam position: position l of beam b is node node_of[b, l].
    count: how many nodes are unique prefixes (the rest is padding).
    """

    tokens: mx.array
    tree: TreeMask
    node_of: mx.array
    count: mx.array


def first_sharing(beams: mx.array) -> mx.array:
    """For beams (..., BW, BL): the first beam with the same tokens 0..l as beam b, at [..., b, l]."""
    width = beams.shape[-2]
    equal = mx.cumprod((beams[..., :, None, :] == beams[..., None, :, :]).astype(mx.int32), axis=-1)  # (..., BW, BW, BL)
    return mx.argmax(equal * mx.arange(width, 0, -1)[:, None], axis=-2)


def pack_beams(beams: mx.array) -> PackedBeam:
    """De-duplicate the prefixes of equal-length beams (BW, BL) that start with one shared token,
    on the device: on a GPU one kernel launch (metal_kernels/pack_beams.cu) instead of the ~35
    small ops of `pack_beams_ref`, the reference, which every other device runs."""
    beams = mx.array(beams).astype(mx.int32)
    width, length = beams.shape
    backend = kernel_backend()
    if backend is None or width * length > 1024:  # the kernel is one threadgroup, a thread per position
        return pack_beams_ref(beams)
    return pack_beams_kernel(beams, backend=backend)


def pack_beams_kernel(beams: mx.array, *, backend: str) -> PackedBeam:
    """`pack_beams` on the 'metal' or 'cuda' kernel, for beams (BW, BL) int32, BW * BL <= 1024."""
    width, length = beams.shape
    size = width * (length - 1) + 1
    tokens, parents, depths, mask, node_of, count = load_kernel(
        backend, "pack_beams", ("beams",), ("tokens", "parents", "depths", "mask", "node_of", "count"), reference=_pack_reference
    )(
        inputs=[beams],
        template=[("BW", width), ("BL", length), ("TN", size)],
        grid=(width * length, 1, 1),
        threadgroup=(width * length, 1, 1),
        output_shapes=[(size,), (size,), (size,), (size, size), (width, length), ()],
        output_dtypes=[mx.int32, mx.int32, mx.int32, mx.bool_, mx.int32, mx.int32],
    )
    return PackedBeam(tokens, TreeMask(parents, depths, mask), node_of, count)


def _pack_reference(*, inputs, **_):
    """`pack_beams_ref` on the kernel's launch (its fallback)."""
    p = pack_beams_ref(inputs[0])
    return [p.tokens, p.tree.parents, p.tree.depths, p.tree.mask, p.node_of, p.count.astype(mx.int32)]


def pack_beams_ref(beams: mx.array) -> PackedBeam:
    """`pack_beams` in MLX ops, without a trie.

    Two beam positions (b, l) and (c, l) are one node when beams b and c agree on tokens 0..l:
    equal[b, c, l] = all(beams[b, :l+1] == beams[c, :l+1]) is a cumulative product, and each
    position maps to the first beam sharing its prefix (ReDrafter appendix A.1). The size is
    fixed, so the verification pass can be built before the search has run and keeps one shape
    (the CUDA backend compiles kernels per shape)."""
    beams = mx.array(beams).astype(mx.int32)
    width, length = beams.shape
    size = width * (length - 1) + 1
    first = first_sharing(beams)
    new = first == mx.arange(width)[:, None]
    index = (mx.cumsum(new.reshape(-1).astype(mx.int32)) - 1).reshape(width, length)  # node number of each new prefix
    node_of = mx.take_along_axis(index, first, axis=0)
    slot = mx.where(new, index, size).reshape(-1)  # positions that repeat a prefix write to a spare slot

    def scatter(values: mx.array, fill: int) -> mx.array:
        out = mx.full((size + 1,), fill, mx.int32)
        out[slot] = values.astype(mx.int32).reshape(-1)
        return out[:size]

    depths = mx.broadcast_to(mx.arange(length), (width, length))
    parents = mx.concatenate([mx.full((width, 1), -1, mx.int32), node_of[:, :-1]], axis=1)
    # mask[t, s]: some beam position at node t has node s at or before it on its beam.
    at = (node_of[..., None] == mx.arange(size)).astype(mx.float32)  # (BW, BL, T)
    upto = mx.cumsum(at, axis=1)
    mask = (at.reshape(-1, size).T @ upto.reshape(-1, size) > 0) | mx.eye(size, dtype=mx.bool_)
    tree = TreeMask(scatter(parents, -1), scatter(depths, 0), mask)
    return PackedBeam(scatter(beams, 0), tree, node_of, new.sum())
