"""Attention over the nodes of a candidate tree, the verification pass of speculative decoding:
each node sees the cached rows before the tree, itself and its ancestors, and nothing else. The
nodes' keys and values come apart from the cache's: the cache receives only the accepted path's,
after the pass (`KVCache.hold`), one write per array instead of a write and a move.

`tree_attention_ref` is the ground truth, MLX's attention with that mask spelled out. On a GPU,
`tree_attention` is one kernel launch (metal_kernels/tree_attention.cu) that walks each node's
parents instead of reading a mask: on MLX's CUDA backend attention with an array mask runs a mask
conversion and a cuDNN call per layer, about twice the time of causal attention at a few dozen
queries (benchmarks/README.md), and a verification pass of a small model is launch-bound. For
the same reason the kernel turns the queries and the tree's keys by RoPE itself.
"""

import mlx.core as mx

from mlx_hybrid.kernels import bits_float, float_bits, kernel_backend, load_kernel
from mlx_hybrid.rope import apply_rope_at

# The most nodes a pass gives the kernel, where `hybrid tune` measured that MLX's attention with
# the tree's mask wins beyond (`mlx_hybrid.tune.attention_limit`); None: every tree the kernel
# fits. The kernel saves launches, which a small model's pass is bound by; a large model's pass
# is bound by its reads, and there MLX's fused attention can be the faster (head dim 128, four
# query heads a key), so which wins depends on the model and the device and is measured.
LIMIT: int | None = None


def tree_attention_ref(q: mx.array, keys: mx.array, values: mx.array, tree_keys: mx.array, tree_values: mx.array,
                       visible: mx.array, prefix: int | mx.array, scale: float | mx.array, positions: mx.array,
                       freqs: mx.array) -> tuple[mx.array, mx.array]:
    """q (1, H, T, D) for the T nodes and tree_keys (1, KV, T, D) before RoPE, which turns them at
    positions (T,) with `freqs` (`mlx_hybrid.rope`); keys, values (1, KV, >= prefix, D), the cache,
    whose first prefix rows come before the tree; tree_values (1, KV, T, D) the nodes'; visible
    (T, T) bool, node s is node t or an ancestor of it (`TreeMask.visible`). prefix and scale may be
    arrays of one element, as the kernel takes them (the rows past prefix are then masked, not
    cut: inside mx.compile an array's value is unknown). Returns the output (1, T, H, D) and the
    tree's turned keys."""
    q, tree_keys = (apply_rope_at(a.transpose(2, 1, 0, 3), freqs, positions).transpose(2, 1, 0, 3) for a in (q, tree_keys))
    T = q.shape[2]
    if isinstance(prefix, int):
        keys, values = keys[..., :prefix, :], values[..., :prefix, :]
    cached = mx.broadcast_to((mx.arange(keys.shape[2]) < prefix)[None], (T, keys.shape[2]))
    keys = mx.concatenate([keys, tree_keys], axis=2)
    values = mx.concatenate([values, tree_values], axis=2)
    mask = mx.concatenate([cached, visible], axis=1)
    if isinstance(scale, mx.array):
        q, scale = (q.astype(mx.float32) * scale).astype(q.dtype), 1.0
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3), tree_keys


def _visible(parents: mx.array) -> mx.array:
    """`TreeMask.visible` from parents on the device: node t's row marks t and its ancestors."""
    T = parents.shape[0]
    node, mask = mx.arange(T), mx.zeros((T, T), mx.bool_)
    for _ in range(T):
        mask = mask | (node[:, None] == mx.arange(T))
        node = mx.where(node >= 0, parents[mx.maximum(node, 0)], -1)
    return mask


def _attention_reference(*, inputs, template, **_):
    """`tree_attention_ref` on the kernel's launch (its fallback): node 0, a root, sits at row P."""
    q, keys, values, tree_keys, tree_values, parents, node_rows, positions, freqs = inputs
    scale = bits_float(dict(template)["SCALE"])
    return tree_attention_ref(q, keys, values, tree_keys, tree_values, _visible(parents), node_rows[:1], scale, positions, freqs)


# Visible rows a lane group scores side by side, and simdgroups a threadgroup (metal_kernels/
# tree_attention.cu): ROWS 4 and WARPS 8 for SmolLM2-135M's heads (9 x 64 over 3 KV heads) on the H100.
# `hybrid tune` times each of WARP_CHOICES per model and device and a profile sets WARPS: with
# fewer simdgroups more threadgroups fit a GPU core at once, which large heads can need (at
# Llama-3-8B's a thread holds about 190 registers, so one threadgroup of 8 fills an H100 core).
ROWS = 4
WARP_CHOICES = (8, 4)
WARPS = WARP_CHOICES[0]
# Threadgroup memory a kernel may take: Apple GPUs give 32 KB (CUDA's static limit is 48 KB).
SHARED_BYTES = 32 << 10


def lanes_per_row(D: int) -> int:
    """Lanes that share a row (a power of two that divides D), so each holds at least 8 elements."""
    G = 32
    while G > 1 and (D % G or D // G < 8):
        G //= 2
    return G


def launch(H: int, KV: int, T: int, D: int, dtype) -> tuple[list, int, int] | None:
    """The kernel's template, threadgroups (one per node and KV head) and threads a threadgroup
    for H query heads over KV key/value heads, T nodes, head size D, in dtype; None when its
    threadgroup memory would not fit (then the caller takes the reference)."""
    R, G = H // KV, lanes_per_row(D)
    for warps in (WARPS, WARPS // 2, 1):
        shared = 4 * (2 * T + 2 + R * D + warps * R * (D + 2)) + dtype.size * T * D
        if shared <= SHARED_BYTES:
            template = [("T", dtype), ("H", H), ("R", R), ("TN", T), ("D", D), ("G", G), ("E", D // G), ("NW", warps), ("B", ROWS)]
            return template, T * KV, warps * 32
    return None


def tree_attention(q: mx.array, keys: mx.array, values: mx.array, tree_keys: mx.array, tree_values: mx.array,
                   parents: mx.array, node_rows: mx.array, positions: mx.array, freqs: mx.array,
                   *, scale: float, backend: str) -> tuple[mx.array, mx.array]:
    """`tree_attention_ref` on the 'metal' or 'cuda' kernel, with prefix given as node_rows (T,)
    int32, each node's row in the cache's buffer (prefix + its depth), an array so that one
    compiled kernel serves every step; scale is compiled in (a model's constant). Inputs keep
    their strides (queries and keys come transposed out of the projection, the cache's keys are
    its whole buffer)."""
    _, H, T, D = q.shape
    KV = keys.shape[1]
    template, groups, threads = launch(H, KV, T, D, q.dtype)
    names = ("q", "k", "v", "tk", "tv", "parents", "node_rows", "positions", "freqs")
    kernel = load_kernel(backend, "tree_attention", names, ("out", "rk"), contiguous=False, reference=_attention_reference)
    return kernel(
        inputs=[q, keys, values, tree_keys, tree_values, parents, node_rows, positions, freqs],
        template=template + [("SCALE", float_bits(scale))],
        grid=(groups * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(1, T, H, D), (1, KV, T, D)],
        output_dtypes=[q.dtype, q.dtype],
    )


def tree_kernel(qk: mx.array, keys: mx.array, window: int | None) -> str | None:
    """The backend whose kernel can run this layer's tree attention, if any, for the nodes'
    queries and keys qk (1, heads + kv_heads, nodes, D) over the cache's keys: the kernel takes
    one sequence, keys in the queries' dtype, no sliding window that hides part of the cache, and
    a tree whose turned keys fit its threadgroup memory, of at most LIMIT nodes."""
    backend = kernel_backend()
    if backend is None or qk.shape[0] != 1 or keys.dtype != qk.dtype:
        return None
    if window is not None and keys.shape[2] > window:
        return None
    _, heads, T, D = qk.shape
    if LIMIT is not None and T > LIMIT:
        return None
    KV = keys.shape[1]
    return backend if launch(heads - KV, KV, T, D, qk.dtype) else None
