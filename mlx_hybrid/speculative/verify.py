"""The verification pass: the target over a candidate tree, as one compiled function where it can.

A tree placed on the device (`TreeMask.at`: node 0's position is a device array) is run through
`mx.compile`d function of arrays, traced once a shape and replayed: such passes repeat their
shapes (the KV buffers grow every `cache.STEP` tokens), and a pass of a small model is bound by
the host's time per op, which replaying cuts to MLX's own, without Python building a few hundred
ops again. Inside the trace the model runs its ordinary forward pass with the tree mask, over
caches rebuilt from the arrays handed in; what the layers hold for `commit` (the nodes' keys and
values, or the state after each node) and the KV buffers they wrote come back out to the real
caches. The trace keeps the weights the model has at its first pass, and the kernels it took then:
another choice of kernels (`kernel_settings`) is traced apart.
"""

import functools
import weakref

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid import tree_attention
from mlx_hybrid.cache import KVCache
from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.models import linear
from mlx_hybrid.tree_mask import TreeMask

# (id(model), cache kinds, kernel settings) -> its compiled pass. The pass holds the model weakly
# and the entry leaves with the model: a strong hold here would keep every model that ever
# verified alive.
_COMPILED: dict[tuple, object] = {}


def verify(model: nn.Module, tokens: mx.array, cache: list, tree: TreeMask) -> tuple[mx.array, mx.array]:
    """Logits and hidden states (1, nodes, .) of the target over the tree's tokens (1, nodes); the
    caches hold the nodes until `commit`."""
    if tree.pos is not None and compiles(model, cache):
        return _compiled(model, tokens, cache, tree)
    return model(tokens, cache, mask=tree, return_hidden=True)


def compiles(model: nn.Module, cache: list) -> bool:
    """Whether every layer can run inside the compiled pass: attention over a KV cache that holds
    something and has no sliding window (whose buffer start moves), and Mamba, Mamba2 or DSLA
    mixers on their GPU kernels (`scan.ssm_step`, `dsla_step`, which return every node's state as
    arrays; the reference paths hold a function instead). A convertible attention layer running as
    DSLA takes the eager pass."""
    for layer, c in zip(model.layers, cache):
        if isinstance(c, KVCache):
            if c.window is not None or c.keys is None:
                return False
        elif c.arrays is None or kernel_backend() is None or getattr(layer, "kind", None) not in ("mamba", "mamba2", "dsla"):
            return False
    return True


def _compiled(model: nn.Module, tokens: mx.array, cache: list, tree: TreeMask) -> tuple[mx.array, mx.array]:
    """`verify` through the compiled function: each layer hands in its two arrays (a KV cache's
    buffers, a recurrent layer's window and state) and gets two back (the nodes' keys and values,
    or the window and state after each node)."""
    n = tokens.shape[1]
    for c in cache:
        if isinstance(c, KVCache):
            c.make_room(n, tree.bound)  # the buffers may grow only out here, not inside the trace
    kinds = tuple(type(c) for c in cache)
    key = (id(model), kinds, kernel_settings())
    if key not in _COMPILED:  # an id is reused only after its model's entry was popped
        _COMPILED[key] = mx.compile(functools.partial(_pass, weakref.proxy(model), kinds))
        weakref.finalize(model, _COMPILED.pop, key, None)
    arrays = [a for c in cache for a in c.state]
    logits, h, *out = _COMPILED[key](tokens, tree.pos, tree.node_depths(), tree.parent_array(), tree.visible(), *arrays)
    for c in cache:
        if isinstance(c, KVCache):  # the buffers, with the tree written where attention wrote it
            (c.keys, c.values, a, b), out = out[:4], out[4:]
            c.hold(c.buffer_row(tree.pos), a, b)
        else:
            (a, b), out = out[:2], out[2:]
            c.hold([a, b])
    return logits, h


def kernel_settings() -> tuple:
    """What a trace fixes besides shapes: which parts of the pass take this project's kernels
    (`tree_attention.LIMIT` and `WARPS`, `linear.ROWS` and `LIMITS`), read by the layers as they
    are traced. A pass traced under other settings is another pass: the tuner times each path
    in turn, and a profile applied later must change what chat runs."""
    return tree_attention.LIMIT, tree_attention.WARPS, linear.ROWS, tuple(sorted(linear.LIMITS.items()))


def _pass(model: nn.Module, kinds: tuple, tokens, pos, depths, parents, visible, *arrays):
    """The traced pass: logits, hidden states and each layer's held arrays for tree nodes tokens
    (1, n) with node 0 at pos, over caches whose arrays (two a layer, in turn) hold the context
    before pos; a KV cache's two buffers come back first (`KVCache.write_tree`). Room for the
    nodes was made before (bound 0: no buffer grows here)."""
    caches = []
    for kind, a, b in zip(kinds, arrays[::2], arrays[1::2]):
        c = kind()
        c.state = [a, b]
        caches.append(c)
    logits, h = model(tokens, caches, mask=TreeMask(parents, depths, visible, pos, 0), return_hidden=True)
    return logits, h, *[x for c in caches for x in (c.state if isinstance(c, KVCache) else []) + c.held]
