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
`accept_on_device` does the same for a path the host has not read yet, so that greedy passes can
be queued one ahead of the host; `advance` then moves the offsets once it has.
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
        self._reserve(size + n, keys, values)
        self.keys[..., size : size + n, :] = keys
        self.values[..., size : size + n, :] = values
        self.offset += n
        return self.keys[..., : size + n, :], self.values[..., : size + n, :]

    def _reserve(self, rows: int, keys: mx.array, values: mx.array):
        """Room for `rows` buffer rows. The whole old buffer is copied: while greedy passes run
        ahead of the host (`write_tree`), rows past `offset` may hold accepted tokens already."""
        if self.keys is not None and rows <= self.keys.shape[2]:
            return
        capacity = (rows + STEP - 1) // STEP * STEP
        shape = (*keys.shape[:2], capacity, keys.shape[3])
        new_k, new_v = mx.zeros(shape, keys.dtype), mx.zeros(shape, values.dtype)
        if self.keys is not None:
            new_k[..., : self.keys.shape[2], :] = self.keys
            new_v[..., : self.values.shape[2], :] = self.values
        self.keys, self.values = new_k, new_v

    def write_tree(self, keys: mx.array, values: mx.array, pos: mx.array, bound: int) -> tuple[mx.array, mx.array, mx.array]:
        """Write a candidate tree's n keys/values at absolute position pos, a (1,) int32 device
        array that may not be known on the host yet (bound: the most it can be). Returns the whole
        buffers and the buffer row of node 0; `offset` moves only on `accept` / `advance`."""
        n = keys.shape[2]
        if self.window is not None:
            self._drop_unreachable()
        self._reserve(bound - self.start + n, keys, values)
        row = pos if self.start == 0 else pos - self.start
        self.keys = mx.slice_update(self.keys, keys, row, (2,))
        self.values = mx.slice_update(self.values, values, row, (2,))
        self.pending = (row, n)
        return self.keys, self.values, row

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

    def tree_mask(self, tree, row: mx.array, depths: mx.array) -> mx.array:
        """Mask (n, buffer rows) for the tree just written at buffer row `row` (`write_tree`):
        every node sees the rows before the tree (within the window), then itself and its
        ancestors, nothing past them. Built once per pass (`Tree.once`)."""
        key = ("mask", tree.host_offset(self.offset), self.start, self.keys.shape[2])
        return tree.once(key, lambda: self._tree_mask(tree, row, depths))

    def _tree_mask(self, tree, row: mx.array, depths: mx.array) -> mx.array:
        n = len(tree)
        rel = mx.arange(self.keys.shape[2]) - row  # buffer row relative to node 0
        before = rel < 0
        if self.window is not None:
            before = before & (depths[:, None] - rel[None] < self.window)
        own = tree.visible()[:, mx.clip(rel, 0, n - 1)] & ((rel >= 0) & (rel < n))[None]
        return before | own

    def accept(self, path: list[int]):
        """Of the rows the last verification pass wrote (`write_tree`), keep those of the accepted
        path (node indices, root first) in path order, and drop the rest."""
        self.pending = None
        base = self.offset - self.start  # buffer row of node 0
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
        self.offset += len(path)

    def accept_on_device(self, nodes: mx.array, last: mx.array, memo: dict):
        """`accept` for a path the host has not read: nodes (W,) int32, the accepted path's nodes
        first, then any valid nodes (the rows past the path are left for the next tree to
        overwrite). All W rows move, with one gather and one write per array; the gather index is
        shared through memo by the layers that wrote at the same row. `advance` moves `offset`
        once the host knows the path's length."""
        row, _ = self.pending
        self.pending = None
        for name in ("keys", "values"):
            buffer = getattr(self, name)
            shape = (*buffer.shape[:2], nodes.shape[0], buffer.shape[3])
            key = (id(row), shape)
            if key not in memo:
                memo[key] = (row, mx.broadcast_to((row + nodes)[None, None, :, None], shape))
            moved = mx.take_along_axis(buffer, memo[key][1], axis=2)
            setattr(self, name, mx.slice_update(buffer, moved, row, (2,)))

    def advance(self, n: int):
        """The host learned that the last `accept_on_device` kept n tokens."""
        self.offset += n

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

    def accept_on_device(self, nodes: mx.array, last: mx.array, memo: dict):
        """`accept` for a path the host has not read: the state after node `last` (a device
        scalar); `advance` moves `offset` once the host knows the path's length."""
        self.arrays = self.pending(last)
        self.pending = None

    def advance(self, n: int):
        self.offset += n

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


def accept_on_device(cache: list, nodes: mx.array, last: mx.array):
    """Every layer keeps a path the host has not read yet (`KVCache.accept_on_device`)."""
    memo: dict = {}
    for c in cache:
        c.accept_on_device(nodes, last, memo)


def trim_cache(cache: list, n: int) -> int:
    """Trim every layer by the same amount (the most all layers allow, at most n)."""
    n = min([n] + [c.trimmable() for c in cache])
    for c in cache:
        c.trim(n)
    return n
