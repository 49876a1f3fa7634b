"""Caches that outlive a request: a prompt that shares a prefix with an earlier one (the same
system prompt, a chat that grows turn by turn) reads only the tokens after it.

An entry is a sequence's per-layer caches and the tokens they hold. A request takes a copy of
the entry that saves it the most tokens, cut back to what it shares with the request: a KV cache
can forget its newest tokens (`KVCache.trim`), a recurrent state cannot (`StateCache.trimmable`
is 0), so an entry of a hybrid model serves only prompts that continue all of its tokens. That
is why the server also stores snapshots of a hybrid model's caches at prefix points a later
prompt is likely to continue (`mlx_hybrid.server.engine`): the end of the system prompt and the
end of the prompt before the reply, besides the whole conversation after it.

Entries are evicted least recently used first, to keep their memory (`nbytes` of the arrays
they hold) within a bound.
"""

from collections import OrderedDict

import mlx.core as mx

from mlx_hybrid.cache import KVCache, StateCache
from mlx_hybrid.decode import common_prefix


def copy_cache(cache: list, n: int) -> list:
    """A copy of per-sequence caches cut back to their first n tokens (n >= `floor(cache)`).
    The KV rows are copied, not viewed, and the copy is evaluated at once: a view, or a copy not
    yet made, keeps the whole source buffer alive (memory the cache's bound does not see), and
    makes the source's next write copy it whole (MLX writes in place only into unshared buffers)."""
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            k = KVCache(c.window)
            rows = n - c.start
            k.keys, k.values = (mx.contiguous(a[..., :rows, :]) for a in (c.keys, c.values))
            k.start, k.offset = c.start, n
            out.append(k)
        else:  # a recurrent state is replaced, never written in place: share its arrays
            s = StateCache()
            s.update(list(c.arrays), c.offset)
            out.append(s)
    mx.eval([c.state for c in out])
    return out


def floor(cache: list) -> int:
    """The fewest tokens the caches can be cut back to: all of them if a layer is recurrent."""
    return max(c.offset - c.trimmable() for c in cache)


def cache_nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], list] = OrderedDict()  # tokens -> caches, oldest first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def fetch(self, tokens: list[int]) -> tuple[list | None, int]:
        """(a copy of the caches holding the longest reusable prefix of tokens, its length), or
        (None, 0). At least the last token is left to read, since its logits are needed."""
        best, best_n = None, 0
        for key, cache in self.entries.items():
            n = min(common_prefix(list(key), tokens), len(tokens) - 1)
            if n > best_n and n >= floor(cache):
                best, best_n = key, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        return copy_cache(self.entries[best], best_n), best_n

    def insert(self, tokens: list[int], cache: list):
        """Keep cache, which holds exactly tokens (the caller gives it up). Entries it makes
        redundant (a prefix it can be cut back to) go; then the oldest, down to the bound."""
        size = cache_nbytes(cache)
        if not tokens or size > self.max_bytes:
            return
        key, low = tuple(tokens), floor(cache)
        for old in [k for k in self.entries if len(k) >= low and len(k) <= len(key) and key[: len(k)] == k]:
            self._drop(old)
        self.entries[key] = cache
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[int, ...]):
        self.nbytes -= cache_nbytes(self.entries.pop(key))

    def clear(self):
        self.entries.clear()
        self.nbytes = 0
