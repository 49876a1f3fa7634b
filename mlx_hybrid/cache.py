"""Per-layer caches: a KV cache for attention, a fixed-size state for SSM and DSLA layers.

Growing in `STEP`-token chunks keeps decode from reallocating every token; `trim` rolls the
cache back so a chat can reuse the prefix it shares with the next turn (and a speculative step
can drop rejected tokens). Sliding-window layers drop keys no future query can reach.

A recurrent layer's state cannot be rolled back token by token; instead `snapshot` keeps a
reference to the current state (MLX arrays are immutable, so this copies nothing) and `restore`
returns to it. To verify speculative candidates, a recurrent layer runs them all and leaves a
`pending` function that gives the state after any candidate; `accept` then keeps the state at
the end of the accepted path, so accepted tokens are never run again. A KV cache keeps the
candidates' rows after such a pass and `accept` moves the accepted path's rows together.
"""

import functools

import mlx.core as mx

STEP = 256


class KVCache:
    def __init__(self, window: int | None = None):
        self.keys = None
        self.values = None
        self.offset = 0  # absolute position of the next token
        self.start = 0  # absolute position of keys[..., 0, :]
        self.window = window
        self.pending = None  # candidate rows appended by the last verification pass, until `accept`

    @property
    def size(self) -> int:
        """Tokens held in the buffer."""
        return self.offset - self.start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append (batch, kv_heads, n, head_dim) keys/values; return all the keys/values held."""
        n = keys.shape[2]
        if self.window is not None:
            self._drop_unreachable()
        size = self.size
        if self.keys is None or size + n > self.keys.shape[2]:
            capacity = (size + n + STEP - 1) // STEP * STEP
            shape = (*keys.shape[:2], capacity, keys.shape[3])
            new_k, new_v = mx.zeros(shape, keys.dtype), mx.zeros(shape, values.dtype)
            if size:
                new_k[..., :size, :] = self.keys[..., :size, :]
                new_v[..., :size, :] = self.values[..., :size, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., size : size + n, :] = keys
        self.values[..., size : size + n, :] = values
        self.offset += n
        return self.keys[..., : size + n, :], self.values[..., : size + n, :]

    def _drop_unreachable(self):
        # Queries from now on sit at positions >= offset and see keys > offset - window.
        drop = self.offset - self.window + 1 - self.start
        if drop >= STEP:
            self.keys = self.keys[..., drop : self.size, :]
            self.values = self.values[..., drop : self.size, :]
            self.start += drop

    def make_mask(self, n: int):
        """Attention mask for the n newest tokens against everything held: None, "causal" or bool array."""
        size = self.size
        if self.window is None or size <= self.window:
            return None if n == 1 else "causal"
        q_pos = mx.arange(self.offset - n, self.offset)[:, None]
        k_pos = mx.arange(self.start, self.offset)[None]
        return (k_pos <= q_pos) & (q_pos - k_pos < self.window)

    def make_tree_mask(self, tree) -> mx.array:
        """Mask for the nodes of a candidate tree just appended (`tree.mask`: ancestor mask, None
        for a chain) against everything held: every node sees the cache before the tree (within the
        window), then itself and its ancestors. Built once per pass (`Tree.once`)."""
        return tree.once(("mask", self.size, self.offset, self.window), lambda: self._tree_mask(tree))

    def _tree_mask(self, tree) -> mx.array:
        n = len(tree)
        size = self.size
        if tree.mask is None and self.window is None:
            return "causal"
        own = mx.tril(mx.ones((n, n), mx.bool_)) if tree.mask is None else tree.mask
        mask = mx.concatenate([mx.ones((n, size - n), mx.bool_), own], axis=1)
        if self.window is not None:
            depth = mx.arange(n) if tree.depths is None else tree.depths
            q_pos = (self.offset - n + depth)[:, None]
            k_pos = mx.concatenate([mx.arange(self.start, self.offset - n), self.offset - n + depth])[None]
            mask = mask & (q_pos - k_pos < self.window)
        return mask

    def accept(self, path: list[int]):
        """Of the rows the last verification pass appended, keep those of the accepted path (node
        indices, root first) in path order, and drop the rest."""
        n, self.pending = self.pending, None
        base = self.offset - n - self.start  # buffer row of node 0
        # Rows already in place (a prefix of the nodes) stay; the rest move with one gather and
        # one write per array. Fancy indexing would spell this as ~14 ops per array, and on a GPU
        # each op costs host time whatever its size.
        keep = next((i for i, p in enumerate(path) if p != i), len(path))
        if keep < len(path):
            rows, end = tuple(base + p for p in path[keep:]), base + len(path)
            for name in ("keys", "values"):
                buffer = getattr(self, name)
                index = _row_index(rows, (*buffer.shape[:2], len(rows), buffer.shape[3]))
                buffer[..., base + keep : end, :] = mx.take_along_axis(buffer, index, axis=2)
        self.offset = self.start + base + len(path)

    def trimmable(self) -> int:
        """How many of the newest tokens `trim` can remove and still serve later queries."""
        if self.window is None or self.start == 0:
            return self.size
        return max(0, self.offset - (self.start + self.window - 1))

    def trim(self, n: int) -> int:
        """Forget the n newest tokens; returns how many were removed."""
        n = min(n, self.trimmable())
        self.offset -= n
        return n

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


@functools.lru_cache(maxsize=8)
def _row_index(rows: tuple[int, ...], shape: tuple[int, ...]) -> mx.array:
    """Buffer rows to gather, broadcast to shape: built once for all the layers that move the same
    rows (a broadcast is an op too)."""
    return mx.broadcast_to(mx.array(rows, mx.int32)[None, None, :, None], shape)


class StateCache:
    """The state of a recurrent layer: the same size at every context length.

    `arrays` is whatever the layer keeps (Mamba: conv window and SSM state; DSLA: two states);
    None until the first token.
    """

    def __init__(self):
        self.arrays: list[mx.array] | None = None
        self.offset = 0
        self.pending = None  # candidate node -> its state arrays, after a verification pass

    def update(self, arrays: list[mx.array], n: int):
        """Replace the state after the layer has consumed n more tokens."""
        self.arrays = arrays
        self.offset += n

    def accept(self, path: list[int]):
        """Advance along the accepted candidate path (node indices, root first) of the last
        verification pass: the state becomes the one after its last node."""
        if path:
            self.arrays = self.pending(path[-1])
            self.offset += len(path)
        self.pending = None

    def trimmable(self) -> int:
        return 0

    def trim(self, n: int) -> int:
        return 0

    def snapshot(self) -> tuple[int, list[mx.array] | None]:
        return self.offset, self.arrays

    def restore(self, snap: tuple[int, list[mx.array] | None]):
        self.offset, self.arrays = snap

    @property
    def state(self) -> list[mx.array]:
        return self.arrays or []

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def accept_path(cache: list, path: list[int]):
    """Every layer keeps the accepted path of the last verification pass (see `KVCache.accept`,
    `StateCache.accept`)."""
    for c in cache:
        c.accept(path)


def trim_cache(cache: list, n: int) -> int:
    """Trim every layer by the same amount (the most all layers allow, at most n)."""
    n = min([n] + [c.trimmable() for c in cache])
    for c in cache:
        c.trim(n)
    return n
