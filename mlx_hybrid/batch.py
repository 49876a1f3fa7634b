"""Plain decoding of several sequences in one forward pass (continuous batching).

Each sequence reads its prompt alone, into the ordinary per-sequence caches (`KVCache`,
`StateCache`), and then joins a `Batch`: its attention layers' keys and values become one row of
a `BatchKVCache`, left-padded to the longest row, and its recurrent states one row of a
`StateCache` whose arrays are stacked along the batch axis. A decode step then runs every row's
next token through the model as one (rows, 1) batch. A row leaves when its sequence ends (its
caches can be taken out again, `Batch.take`) and another can join between any two steps, so the
batch stays full under load without waiting for its slowest member.

The models need no batch-specific code: attention reads the position of each row's next token
from `BatchKVCache.offset` (an array: RoPE turns each row at its own position) and masks each
row's padding through `BatchKVCache.make_mask`; Mamba, Mamba2 and DSLA layers already carry a
batch axis in their states. Speculative verification passes stay batch 1 (their candidate trees
and cache moves are per sequence), so a row that speculates leaves the batch first.
"""

import mlx.core as mx

from mlx_hybrid.cache import STEP, KVCache, StateCache


def _capacity(columns: int) -> int:
    return (columns // STEP + 1) * STEP  # always room for the next token's column


class BatchKVCache:
    """Keys and values (rows, kv_heads, columns, head_dim) of one attention layer for several
    sequences: row r holds its keys in columns [pad[r], size), column c at absolute position
    start[r] + c - pad[r]. Decode steps only (one new token a row): prompts are read per sequence."""

    def __init__(self, window: int | None, shared: dict | None = None):
        self.window = window
        self.keys = self.values = None
        self.size = 0  # columns in use, the same for every row
        self.pad: list[int] = []
        self.start: list[int] = []  # absolute position of each row's first held key
        # The positions and mask of a step, built once for all the layers of a `Batch` (they
        # share pad, start and size), not once a layer: a decode step is a chain of small ops.
        self.shared = {} if shared is None else shared

    def _once(self, name: str, build):
        key = (name, self.size, self.window)
        if key not in self.shared:
            if len(self.shared) > 4:  # earlier steps'
                self.shared.clear()
            self.shared[key] = build()
        return self.shared[key]

    @property
    def offset(self) -> mx.array:
        """Each row's position of its next token (RoPE takes one offset per batch entry)."""
        return self._once("offset", lambda: mx.array([s + self.size - p for s, p in zip(self.start, self.pad)], mx.int32))

    def add(self, cache: KVCache):
        """Append a sequence's cache as the last row."""
        n = cache.size
        keys, values = cache.keys[..., :n, :], cache.values[..., :n, :]
        if self.keys is None:
            self.keys, self.values, self.size = keys, values, n
            self.pad, self.start = [0], [cache.start]
        else:
            if n > self.size:  # the new row is the longest: pad the others on the left
                grow = n - self.size
                self.keys, self.values = (_pad_left(a[..., : self.size, :], grow) for a in (self.keys, self.values))
                self.pad = [p + grow for p in self.pad]
                self.size = n
            keys, values = (_pad_left(a, self.size - n) for a in (keys, values))
            self.keys = mx.concatenate([self.keys[..., : self.size, :], keys])
            self.values = mx.concatenate([self.values[..., : self.size, :], values])
            self.pad.append(self.size - n)
            self.start.append(cache.start)
        self._reserve()

    def _reserve(self):
        """Grow the buffers to room for the next column (in STEP chunks, as `KVCache`)."""
        if self.keys.shape[2] <= self.size:
            extra = _capacity(self.size) - self.keys.shape[2]
            self.keys, self.values = (mx.pad(a, [(0, 0), (0, 0), (0, extra), (0, 0)]) for a in (self.keys, self.values))

    def keep(self, rows: list[int]):
        """Keep only these rows (in this order); columns no row uses any more are dropped."""
        drop = min(self.pad[r] for r in rows)
        index = mx.array(rows, mx.int32)
        self.keys, self.values = (a[index, :, drop : self.size] for a in (self.keys, self.values))
        self.pad = [self.pad[r] - drop for r in rows]
        self.start = [self.start[r] for r in rows]
        self.size -= drop
        self._reserve()

    def take(self, row: int) -> KVCache:
        """Row `row` as a per-sequence cache: a copy, so that it holds no view of the batch's
        buffers (a view would keep them alive, and make the next step copy them whole); the
        caller evaluates it (`Batch.take`)."""
        cache = KVCache(self.window)
        pad = self.pad[row]
        cache.keys, cache.values = (mx.contiguous(a[row : row + 1, :, pad : self.size]) for a in (self.keys, self.values))
        cache.start = self.start[row]
        cache.offset = cache.start + self.size - pad
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append one token a row (rows, kv_heads, 1, head_dim); return every column in use."""
        if keys.shape[2] != 1:
            raise ValueError("a batch decodes one token a row; read prompts per sequence")
        self._reserve()
        self.keys[..., self.size : self.size + 1, :] = keys
        self.values[..., self.size : self.size + 1, :] = values
        self.size += 1
        return self.keys[..., : self.size, :], self.values[..., : self.size, :]

    def make_mask(self, n: int) -> mx.array | None:
        """(rows, 1, 1, columns) for the newest token of each row: its own columns, within the
        window; None where no row has padding and no window applies."""
        if not any(self.pad) and self.window is None:
            return None
        return self._once("mask", self._mask)

    def _mask(self) -> mx.array:
        columns = mx.arange(self.size)[None]
        mask = columns >= mx.array(self.pad)[:, None]
        if self.window is not None:
            mask = mask & (self.size - 1 - columns < self.window)
        return mask[:, None, None, :]

    state, nbytes = KVCache.state, KVCache.nbytes  # the buffers, as a KV cache's


def _pad_left(a: mx.array, n: int) -> mx.array:
    return a if n == 0 else mx.pad(a, [(0, 0), (0, 0), (n, 0), (0, 0)])


class Batch:
    """The caches of several sequences as one batch for the model: `caches` is what a forward
    pass takes (one entry a layer); rows are numbered in the order they joined, less those that left."""

    def __init__(self):
        self.caches: list | None = None
        self.rows = 0
        self.shared: dict = {}  # what the layers' `BatchKVCache`s build once a step

    def add(self, cache: list):
        """Append a sequence's per-layer caches (`model.make_cache()`, holding at least one token)."""
        if self.caches is None:
            self.caches = [BatchKVCache(c.window, self.shared) if isinstance(c, KVCache) else StateCache() for c in cache]
        self.shared.clear()  # the rows change
        for b, c in zip(self.caches, cache):
            if isinstance(b, BatchKVCache):
                b.add(c)
            else:
                b.arrays = list(c.arrays) if b.arrays is None else [mx.concatenate([x, y]) for x, y in zip(b.arrays, c.arrays)]
        self.rows += 1

    def keep(self, rows: list[int]):
        """Keep only these rows, in this order (the others' memory is freed)."""
        if not rows:
            self.caches, self.rows = None, 0
            return
        index = mx.array(rows, mx.int32)
        self.shared.clear()
        for b in self.caches:
            if isinstance(b, BatchKVCache):
                b.keep(rows)
            else:
                b.arrays = [a[index] for a in b.arrays]
        self.rows = len(rows)

    def take(self, row: int, length: int) -> list:
        """Row `row`'s caches as a sequence's own, holding `length` tokens: copies, evaluated at
        once (not yet made, they would keep the batch's whole buffers alive; see `copy_cache`)."""
        out = []
        for b in self.caches:
            if isinstance(b, BatchKVCache):
                out.append(b.take(row))
            else:
                c = StateCache()
                c.update([mx.contiguous(a[row : row + 1]) for a in b.arrays], length)
                out.append(c)
        mx.eval([c.state for c in out])
        return out

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches or [])
