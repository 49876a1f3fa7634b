"""Per-layer caches: a KV cache for attention, a fixed-size state for SSM and DSLA layers.

Every cache speaks one protocol (`Cache`): `offset`, `state`, `nbytes`, `snapshot`/`restore`,
`trimmable`/`trim`, and for a verification pass over a candidate tree (`mlx_hybrid.tree_mask`)
`hold` (by the layer: the nodes' keys/values or states, apart from the cache) then `commit(path)`
(by the speculative loop: keep the accepted path, drop the rest).

Growing in `STEP`-token chunks keeps decode from reallocating every token; `trim` rolls the
cache back so a chat can reuse the prefix it shares with the next turn. Sliding-window layers
drop keys no future query can reach.

A recurrent layer's state cannot be rolled back token by token; instead `snapshot` keeps a
reference to the current state (MLX arrays are immutable, so this copies nothing) and `restore`
returns to it. To verify speculative candidates, a recurrent layer runs them all and holds the
state after every candidate; `commit` then keeps the state at the end of the accepted path, so
accepted tokens are never run again. A KV cache holds the candidates' keys and values for
`commit`, which writes only the accepted path's into the buffer after the tokens before it;
attention reads the candidates apart from the buffer (the tree-attention kernel) or from the
buffer's rows after the context, where it writes them first (`write_tree`: one scatter per
array, where joining them to the buffer would copy the whole buffer every pass). A `DevicePath`
commits a path the host has not read yet, so that greedy passes can be queued one ahead of the
host; `advance` then moves the offsets once it has.
That write waits for the buffers' next use (`_flush`, at the start of the next pass): made in the
pass that read the buffers, it met them still held by the pass's attention kernels on a GPU (MLX
keeps a kernel's inputs until it has run), so it could not write in place and copied each whole
buffer first.
"""

import functools
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

STEP = 256


@dataclass
class DevicePath:
    """An accepted path the host has not read: nodes (W,) int32, the candidate row that holds it
    (its first n + 1 nodes, -1 past the row's end), and last, the path's last node (a device
    scalar). memo: scatter indices shared by the layers of one commit."""

    nodes: mx.array
    last: mx.array
    memo: dict = field(default_factory=dict)


class Cache:
    """The protocol every layer cache follows (see the module docstring)."""

    offset: int = 0  # tokens seen: the absolute position of the next one

    @property
    def state(self) -> list[mx.array]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def snapshot(self):
        """What `restore` returns to."""
        raise NotImplementedError

    def restore(self, snap):
        raise NotImplementedError

    def trimmable(self) -> int:
        """How many of the newest tokens `trim` can remove."""
        return 0

    def trim(self, n: int) -> int:
        """Forget the n newest tokens (at most `trimmable`); returns how many were removed."""
        return 0

    def commit(self, path: list[int] | DevicePath):
        """Keep the accepted path (node indices, root first) of the tree the last pass held."""
        raise NotImplementedError

    def advance(self, n: int):
        """The host learned that the last `DevicePath` commit kept n tokens."""
        self.offset += n


class KVCache(Cache):
    def __init__(self, window: int | None = None):
        self._keys = None
        self._values = None
        self._write = None  # (row index, keys, values) of a path a `DevicePath` commit kept, not yet in the buffers
        self.offset = 0  # absolute position of the next token
        self.start = 0  # absolute position of keys[..., 0, :]
        self.window = window
        self._held = None  # (buffer row of node 0, keys, values) of the last verification pass's tree

    def _buffer(name: str) -> property:
        """A buffer as it is read and replaced from outside: with the kept path written first."""
        return property(lambda self: self._flush() or getattr(self, name), lambda self, a: self._flush() or setattr(self, name, a))

    keys, values = _buffer("_keys"), _buffer("_values")
    del _buffer

    def _flush(self):
        """Write the path a `DevicePath` commit kept: one scatter per buffer, every node of its tree."""
        if self._write is not None:
            index, keys, values = self._write
            self._write = None
            self._keys = mx.put_along_axis(self._keys, index, keys, axis=2)
            self._values = mx.put_along_axis(self._values, index, values, axis=2)

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
        self._reserve(size + n, keys, values)  # flushes
        self._keys[..., size : size + n, :] = keys
        self._values[..., size : size + n, :] = values
        self.offset += n
        return self._keys[..., : size + n, :], self._values[..., : size + n, :]

    def _reserve(self, rows: int, keys: mx.array, values: mx.array):
        """Room for `rows` buffer rows. The whole old buffer is copied: while greedy passes run
        ahead of the host (`DevicePath` commits), rows past `offset` may hold accepted tokens already."""
        self._flush()
        if self._keys is not None and rows <= self._keys.shape[2]:
            return
        capacity = (rows + STEP - 1) // STEP * STEP
        shape = (*keys.shape[:2], capacity, keys.shape[3])
        new_k, new_v = mx.zeros(shape, keys.dtype), mx.zeros(shape, values.dtype)
        if self._keys is not None:
            new_k[..., : self._keys.shape[2], :] = self._keys
            new_v[..., : self._values.shape[2], :] = self._values
        self._keys, self._values = new_k, new_v

    def hold(self, row: mx.array, keys: mx.array, values: mx.array):
        """Hold a candidate tree's n keys/values (1, KV, n, D) until `commit`, which writes the
        accepted path's from buffer row `row` (node 0's: `tree_buffers`, which makes the room), a
        device array the host may not know yet. The tree stays held apart from the buffer (where
        MLX's attention also reads it from the buffer's rows, `write_tree`), so that committing a
        path is one write per array rather than a move of rows within the buffer."""
        self._held = (row, keys, values)

    @property
    def held(self) -> list[mx.array] | None:
        """The held tree's keys and values."""
        return None if self._held is None else list(self._held[1:])

    def write_tree(self, tree, row: mx.array, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The buffers with a tree's keys/values (1, KV, n, D) in rows row.. (`tree_buffers` made
        the room), for attention to read the context and the tree as one array; `commit` later
        overwrites those rows with the accepted path's. A scatter, whose index the layers share
        (`TreeMask.once`): on MLX's CUDA backend a write at a device offset is two kernels."""
        n = keys.shape[2]
        index = tree.once(("rows", tree.host_offset(self.offset), self.start, keys.shape),
                          lambda: mx.broadcast_to((row + mx.arange(n, dtype=mx.int32))[None, None, :, None], keys.shape))
        self._keys = mx.put_along_axis(self.keys, index, keys, axis=2)
        self._values = mx.put_along_axis(self.values, index, values, axis=2)
        return self._keys, self._values

    def tree_buffers(self, n: int, pos: mx.array, bound: int, like: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The whole buffers, with room for a tree of n nodes (1, KV, n, D) like `like` at pos
        (`hold`), and the buffer row where node 0 goes (rows before it precede the tree)."""
        self.make_room(n, bound, like, like)
        return self.keys, self.values, self.buffer_row(pos)

    def buffer_row(self, pos: mx.array) -> mx.array:
        """The buffer row of absolute position pos."""
        return pos if self.start == 0 else pos - self.start

    def make_room(self, n: int, bound: int, keys: mx.array | None = None, values: mx.array | None = None):
        """Buffer rows for a tree of n nodes placed at absolute position <= bound (`hold`),
        shaped like keys/values or else like the buffers already there."""
        if self.window is not None:
            self._drop_unreachable()
        self._reserve(bound - self.start + n, self.keys if keys is None else keys, self.values if values is None else values)

    def _drop_unreachable(self):
        # Queries from now on sit at positions >= offset and see keys > offset - window.
        drop = self.offset - self.window + 1 - self.start
        if drop >= STEP:
            self.keys = self.keys[..., drop:, :]  # rows past `offset` may hold a path the host has not read
            self.values = self.values[..., drop:, :]
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
        """Mask (n, buffer rows) for the tree written at buffer row `row` (`write_tree`): every
        node sees the rows before the tree (within the window), itself and its ancestors. Built
        once per pass (`TreeMask.once`)."""
        key = ("mask", tree.host_offset(self.offset), self.start, self.keys.shape[2])
        return tree.once(key, lambda: tree_mask_over(self.keys.shape[2], row, tree.visible(), depths, self.window))

    def commit(self, path: list[int] | DevicePath):
        """Write the accepted path's keys/values (node indices, root first, in path order) from
        the tree the last verification pass held (`hold`) after the tokens before it."""
        if isinstance(path, DevicePath):
            return self._commit_on_device(path)
        _, keys, values = self._held
        self._held = None
        base, n = self.offset - self.start, len(path)
        if n:
            index = _path_index(tuple(path))  # None: a prefix of the nodes, a view of them
            for name, rows in (("keys", keys), ("values", values)):
                rows = rows[..., :n, :] if index is None else mx.take(rows, index, axis=2)
                getattr(self, name)[..., base : base + n, :] = rows
        self.offset += n

    def _commit_on_device(self, path: DevicePath):
        """`commit` for a path the host has not read. One scatter per array writes every node of
        the tree: the row's nodes in row order from node 0's buffer row on, the others after
        them, where the next path overwrites them; the scatter's index is built once for the
        layers that share its shape and row (`path.memo`). `advance` moves `offset` once the host
        knows the path's length. The write itself waits for the buffers' next use (`_flush`)."""
        row, keys, values = self._held
        self._held = None
        key = (id(row), keys.shape)
        if key not in path.memo:
            path.memo[key] = (row, mx.broadcast_to(_destinations(path.nodes, keys.shape[2], row)[None, None, :, None], keys.shape))
        self._flush()
        self._write = (path.memo[key][1], keys, values)

    def trimmable(self) -> int:
        """How many of the newest tokens `trim` can remove and still serve later queries."""
        if self.window is None or self.start == 0:
            return self.size
        return max(0, self.offset - (self.start + self.window - 1))

    def trim(self, n: int) -> int:
        n = min(n, self.trimmable())
        self.offset -= n
        return n

    def snapshot(self) -> int:
        return self.offset

    def restore(self, snap: int):
        """Back to the offset of `snapshot`: rows before it are never overwritten, so a trim,
        unless a sliding window has dropped what it needs."""
        n = self.offset - snap
        if self.trim(n) != n:
            raise ValueError("a sliding-window cache cannot return that far")

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    @state.setter
    def state(self, arrays: list[mx.array]):
        self.keys, self.values = arrays


def tree_mask_over(rows: int, row: mx.array, visible: mx.array, depths: mx.array | None = None, window: int | None = None) -> mx.array:
    """`KVCache.tree_mask` for buffers of `rows` rows with the tree's n nodes in rows row..: the
    rows before `row` (within the window, from each node's depth), then the tree's own visible
    (n, n) ancestor mask, then nothing."""
    n = visible.shape[0]
    rel = mx.arange(rows) - row  # buffer row relative to node 0
    before = mx.broadcast_to(rel[None] < 0, (n, rows))
    if window is not None:
        before = before & (depths[:, None] - rel[None] < window)
    inside = (rel >= 0) & (rel < n)
    return before | (mx.take(visible, mx.clip(rel, 0, n - 1), axis=1) & inside[None])


@functools.lru_cache(maxsize=8)
def _path_index(path: tuple[int, ...]) -> mx.array | None:
    """The nodes to gather for an accepted path, built once for all the layers (None: the path is
    nodes 0, 1, ..., a slice)."""
    return None if path == tuple(range(len(path))) else mx.array(path, mx.int32)


def _destinations(nodes: mx.array, n: int, row: mx.array) -> mx.array:
    """Buffer row of each of a tree's n nodes for a `DevicePath` commit: row + the node's
    place in `nodes` (-1 past its end), and row + n - 1 for nodes not in it. That row is past the
    path unless every node is on it, and rows past the path are never read before a later path
    overwrites them, so colliding there is harmless."""
    width = nodes.shape[0]
    slot = mx.put_along_axis(mx.full((n + 1,), n - 1, mx.int32), mx.where(nodes < 0, n, nodes), mx.arange(width, dtype=mx.int32), axis=0)
    return row + slot[:n]


class StateCache(Cache):
    """The state of a recurrent layer: the same size at every context length.

    `arrays` is whatever the layer keeps (Mamba: conv window and SSM state; DSLA: two states);
    None until the first token.
    """

    def __init__(self):
        self.arrays: list[mx.array] | None = None
        self.offset = 0
        self._held = None  # the state after each node of the last verification pass (`hold`)

    def update(self, arrays: list[mx.array], n: int):
        """Replace the state after the layer has consumed n more tokens."""
        self.arrays = arrays
        self.offset += n

    def hold(self, after: list[mx.array] | Callable[[int | mx.array], list[mx.array]]):
        """Keep a verification pass's states until `commit`: the arrays after every node (node
        axis 1), or a function giving the arrays after a node (an int, or a device scalar)."""
        self._held = after

    @property
    def held(self) -> list[mx.array] | None:
        """The held per-node arrays, when the layer held arrays rather than a function."""
        return self._held if isinstance(self._held, list) else None

    def _after(self, node: int | mx.array) -> list[mx.array]:
        if callable(self._held):
            return self._held(node)
        return [mx.take(a, node, axis=1) for a in self._held]  # one gather, also for a device scalar

    def commit(self, path: list[int] | DevicePath):
        """The state becomes the one after the accepted path's last node (for a `DevicePath`,
        `advance` moves the offset once the host knows the path's length)."""
        if isinstance(path, DevicePath):
            self.arrays = self._after(path.last)
        elif path:
            self.arrays = self._after(path[-1])
            self.offset += len(path)
        self._held = None

    def snapshot(self) -> tuple[int, list[mx.array] | None]:
        return self.offset, self.arrays

    def restore(self, snap: tuple[int, list[mx.array] | None]):
        self.offset, self.arrays = snap

    @property
    def state(self) -> list[mx.array]:
        return self.arrays or []

    @state.setter
    def state(self, arrays: list[mx.array]):
        self.arrays = list(arrays)


def commit(cache: list[Cache], path: list[int] | mx.array, last: mx.array | None = None):
    """Every layer keeps the accepted path of the last verification pass: node indices, or on
    the device the candidate row that holds it and its last node (`DevicePath`)."""
    if last is not None:
        path = DevicePath(path, last)
    for c in cache:
        c.commit(path)


def trim_cache(cache: list[Cache], n: int) -> int:
    """Trim every layer by the same amount (the most all layers allow, at most n)."""
    n = min([n] + [c.trimmable() for c in cache])
    for c in cache:
        c.trim(n)
    return n


def rewind(cache: list[Cache], n: int, snapshot: tuple[int, list] | None) -> int | None:
    """Bring every layer back to its first n tokens, or as near below as it can: a trim where
    every layer can (layers may stand at different offsets: an interrupt between layers), else
    `snapshot`, (its tokens, every layer's `Cache.snapshot`) taken at a point of those n tokens.
    Returns the tokens the cache holds then; None when neither reaches, for a new cache."""
    for c in cache:
        c.trim(c.offset - n)
    if all(c.offset == n for c in cache):
        return n
    if snapshot is None or snapshot[0] > n:
        return None
    try:
        for c, snap in zip(cache, snapshot[1]):
            c.restore(snap)
    except ValueError:  # a sliding window dropped keys the snapshot needs
        return None
    return snapshot[0]
