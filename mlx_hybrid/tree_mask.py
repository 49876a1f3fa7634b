"""The attention mask of a verification pass: a tree of candidate tokens.

A model called with `mask=TreeMask(...)` reads its tokens as the nodes of a tree that continues
the cache: node t continues node `parents[t]` (-1: the cache itself), so each node sees the
cached tokens, itself and its ancestors, at position (cache offset + its depth). Attention layers
read it as per-node positions and an ancestor mask, or on a GPU as the parents
(`mlx_hybrid.attention`); recurrent layers advance each node's state from its parent's. The
caches hold the nodes apart until `commit(path)` keeps the accepted ones (`mlx_hybrid.cache`).
A chain (parents -1, 0, 1, ...) is the causal mask over several new tokens.
"""

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


@dataclass
class TreeMask:
    """The mask of a verification pass: which nodes each node sees, and where they sit.

    parents: node t continues node parents[t] (-1: the cache); parents precede children. A list,
        or an int32 array when the tree was built on the device (`pack_beams`).
    depths: (T,) int32, each node's distance from the cache (root 0): its position is the cache
        offset plus its depth. None for a chain, where node t sits at depth t.
    mask: (T, T) bool, mask[t, s] is True when s is t or one of its ancestors. None for a chain,
        where it is the causal mask.
    pos, bound: node 0's absolute position on the device and the most it can be (`at`); None:
        the cache's offset.
    """

    parents: list[int] | mx.array
    depths: mx.array | None = None
    mask: mx.array | None = None
    pos: mx.array | None = None
    bound: int = 0
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_parents(cls, parents: list[int]) -> "TreeMask":
        parents = [int(p) for p in parents]
        if parents == list(range(-1, len(parents) - 1)):
            return cls(parents)
        depth, mask = tree_depths(parents), ancestor_mask(parents)
        return cls(parents, mx.array(depth, mx.int32), mx.array(mask))

    @classmethod
    def chain(cls, n: int) -> "TreeMask":
        return cls(list(range(-1, n - 1)))

    def __len__(self) -> int:
        return len(self.parents)

    def once(self, key, make):
        """make(), built once for all the layers of a pass that ask with the same key: every
        attention layer needs the same positions and mask, and on a GPU each op is a kernel
        launch. A tree is reused across passes, so old keys are dropped."""
        if key not in self._memo:
            if len(self._memo) >= 8:
                self._memo.clear()
            self._memo[key] = make()
        return self._memo[key]

    def at(self, pos: mx.array, bound: int) -> "TreeMask":
        """This tree placed at absolute position pos, a (1,) int32 device array the host may not
        know yet (bound: the most it can be), with a memo of its own: a greedy pass queued behind
        the previous one's acceptance."""
        return TreeMask(self.parents, self.depths, self.mask, pos, bound)

    def position(self, offset: int) -> tuple[mx.array, int]:
        """Node 0's position as a device array and its host bound: `pos`, or else the cache offset."""
        if self.pos is not None:
            return self.pos, self.bound
        return self.once(("pos", offset), lambda: mx.array([offset], mx.int32)), offset

    def host_offset(self, offset: int) -> int | None:
        """What memo keys of per-position arrays carry: the cache offset, unless `pos` fixes it."""
        return None if self.pos is not None else offset

    def node_depths(self) -> mx.array:
        """`depths`, spelled out for a chain."""
        return self.depths if self.depths is not None else self.once("depths", lambda: mx.arange(len(self), dtype=mx.int32))

    def parent_array(self) -> mx.array:
        return self.parents if isinstance(self.parents, mx.array) else mx.array(self.parents, mx.int32)

    def visible(self) -> mx.array:
        """The ancestor mask, the causal mask for a chain."""
        return self.mask if self.mask is not None else mx.tril(mx.ones((len(self),) * 2, mx.bool_))


def check_parents(parents: list[int]):
    for t, p in enumerate(parents):
        if not -1 <= p < t:
            raise ValueError(f"node {t} has parent {p}: parents must precede their children")


def tree_depths(parents: list[int]) -> np.ndarray:
    check_parents(parents)
    depth = np.zeros(len(parents), np.int32)
    for t, p in enumerate(parents):
        depth[t] = 0 if p < 0 else depth[p] + 1
    return depth


def ancestor_mask(parents: list[int]) -> np.ndarray:
    """mask[t, s]: node s is node t or one of its ancestors."""
    check_parents(parents)
    mask = np.zeros((len(parents), len(parents)), bool)
    for t, p in enumerate(parents):
        if p >= 0:
            mask[t] = mask[p]
        mask[t, t] = True
    return mask
