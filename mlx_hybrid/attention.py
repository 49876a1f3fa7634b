"""Scaled dot-product attention with RoPE, over the cache: causal for new tokens, or over the
nodes of a candidate tree (`mlx_hybrid.tree_mask.TreeMask`, a verification pass).

The tree's keys and values are held for `commit` (`KVCache.hold`): each node sees the cached
rows before the tree, itself and its ancestors. Which implementation runs is decided here, not by
the model: on a GPU the tree-attention kernel (`mlx_hybrid.tree_attention`), which walks each
node's parents and turns queries and keys by RoPE itself, else MLX's attention with the tree's
mask spelled out, over the buffer with the tree written after the context (`KVCache.write_tree`).
"""

import mlx.core as mx

from mlx_hybrid.cache import KVCache
from mlx_hybrid.rope import apply_rope, apply_rope_at
from mlx_hybrid.tree_attention import tree_attention, tree_kernel
from mlx_hybrid.tree_mask import TreeMask


def attention(layer, qkv: mx.array, mask: TreeMask | None, cache: KVCache) -> mx.array:
    """The attention output before o_proj, from the fused projection qkv of queries, keys and
    values before RoPE: (batch, L, (heads + 2 kv_heads) * head_dim) for L new tokens, giving
    (batch, L, heads * head_dim); for a tree, its nodes as rows (nodes, ...), giving (nodes,
    heads * head_dim). layer: the attention module: its head counts, head_dim and scale, and its
    RoPE frequencies `_freqs` (underscored: an array, not a parameter)."""
    if isinstance(mask, TreeMask):
        return _tree_attention(layer, qkv, mask, cache)
    B, L, _ = qkv.shape
    qkv = qkv.reshape(B, L, -1, layer.head_dim).transpose(0, 2, 1, 3)
    qk, v = mx.split(qkv, [layer.n_heads + layer.n_kv_heads], axis=1)
    q, k = mx.split(apply_rope(qk, layer._freqs, cache.offset), [layer.n_heads], axis=1)
    k, v = cache.update_and_fetch(k, v)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=layer.scale, mask=cache.make_mask(L))
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


def _tree_attention(layer, qkv: mx.array, tree: TreeMask, cache: KVCache) -> mx.array:
    """Each node at position (node 0's + its depth) sees the cache before node 0, itself and its
    ancestors; its keys and values are held for `commit`. The per-pass arrays (positions,
    parents, mask) are built once for all the layers (`TreeMask.once`)."""
    T, H, KV = qkv.shape[0], layer.n_heads, layer.n_kv_heads
    pos, bound = tree.position(cache.offset)
    depths = tree.node_depths()
    positions = tree.once(("positions", tree.host_offset(cache.offset)), lambda: pos + depths)
    # Views of the projection, (1, heads, nodes, head_dim): the kernel takes strided inputs.
    qk, v = mx.split(qkv.reshape(T, -1, 1, layer.head_dim), [H + KV], axis=1)
    qk, v = qk.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3)
    keys, values, row = cache.tree_buffers(T, pos, bound, v)
    if backend := tree_kernel(qk, keys, cache.window):
        q, k = mx.split(qk, [H], axis=1)
        parents = tree.once("parents", tree.parent_array)
        node_rows = cache.buffer_row(positions)
        out, k = tree_attention(q, keys, values, k, v, parents, node_rows, positions, layer._freqs, scale=layer.scale, backend=backend)
    else:
        # a node per batch entry in RoPE, so that each gets its own position
        turned = apply_rope_at(qk.transpose(2, 1, 0, 3), layer._freqs, positions).transpose(2, 1, 0, 3)
        q, k = mx.split(turned, [H], axis=1)
        mask = cache.tree_mask(tree, row, depths)
        keys, values = cache.write_tree(tree, row, k, v)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=layer.scale, mask=mask).transpose(0, 2, 1, 3)
    cache.hold(row, k, v)
    return out.reshape(T, -1)
