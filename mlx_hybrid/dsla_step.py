"""A DSLA mixer between its projections in one GPU launch: a decode step, or the nodes of a
candidate tree (a verification pass).

Per head, for the two states i = 1, 2 (dk = dv = head_dim):

    log g_i = max(logsigmoid(a_i) / gate_norm, clamp)      a_i the gate projection's output
    S_i    <- diag(exp(log g_i)) S_i + k^T v
    o       = q (w1 S_1 + w2 S_2) / sqrt(head_dim),   then RMSNorm per head if the layer has one

Unfused, a layer's decode step is ~46 ops besides ~60 views as benchmarks/graph_ops.py counts
them (two gated linear-attention updates, their gates, the mix, the norm), and a GPU pays a launch
and host time for each; on the kernel it is 5-7, the projections included. The pure-MLX reference is the DSLA
mixer's unfused path (`mlx_hybrid.models.hybrid.DSLA`, `gated_linear_attention` for a step and
`gated_linear_attention_tree` for a tree), which every backend without a kernel runs; the kernel
is metal_kernels/dsla_step.metal and its CUDA twin. `dsla_step_ref` is the same computation from
the kernel's own arguments: the ground truth of a launch, and what runs if the kernel fails.
"""

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import DECODE_PARENTS, load_kernel


def lanes(head_dim: int) -> int:
    """Threads a value column, each a share of its head_dim key rows: a power of two that keeps a
    head's threadgroup near 256 threads (a head's state is read and written once a node)."""
    return 1 << (max(1, min(32, 256 // head_dim)).bit_length() - 1)


def dsla_step(qkv, a1, a2, s1, s2, mix, norm_w, consts, parents=None, *, kv_heads: int, backend: str):
    """DSLA between its projections on the fused kernel: one decode step, or with `parents` the
    nodes of a candidate tree, each continuing its parent's states.

    qkv: (batch, TN, (heads + 2 kv_heads) head_dim) the q, k, v projection rows; a1, a2: (batch,
    TN, heads head_dim) the gates' pre-activations; s1, s2: (batch, heads, head_dim, head_dim) the
    states (key rows, value columns); mix: gamma (1,) or alpha_list (2,) float32, the mix gamma o1
    + (1 - gamma) o2 or softmax(alpha_list) . (o1, o2); norm_w: (head_dim,) the output RMSNorm's
    weight, None for no norm; consts: (3,) float32, 1 / gate_norm, the log-gate clamp (-inf for
    none) and the norm's eps; parents: (TN,) int32, node t continues node parents[t] (-1: the
    states), parents before children; without it TN must be 1.
    Returns the outputs (batch, TN, heads head_dim) in qkv's dtype and the states (float32)
    after the token, or with `parents` after each node: (batch, TN, heads, head_dim, head_dim).
    """
    b, heads, D, _ = s1.shape
    TN = qkv.shape[1]
    if (parents is None and TN != 1) or (parents is not None and parents.shape != (TN,)):
        raise ValueError(f"dsla_step takes one token or a tree of parents for each, got {TN} tokens")
    if D > 1024 or heads % kv_heads or qkv.shape[2] != (heads + 2 * kv_heads) * D or a1.shape != (b, TN, heads * D):
        raise ValueError(f"dsla_step: shapes qkv {qkv.shape}, gates {a1.shape}, states {s1.shape} do not fit {kv_heads} KV heads")
    tree = parents is not None
    S = lanes(D)
    threads = -(-D * S // 32) * 32  # whole SIMD groups: all take part in the shuffles
    norm = norm_w is not None
    states = (b, TN, heads, D, D) if tree else s1.shape
    names = ("qkv", "a1", "a2", "s1", "s2", "mix", "norm_w", "consts", "parents")
    return load_kernel(backend, "dsla_step", names, ("y", "s1_out", "s2_out"), reference=_reference)(
        inputs=[qkv, a1, a2, s1.astype(mx.float32), s2.astype(mx.float32), mix, norm_w if norm else consts, consts,
                parents if tree else DECODE_PARENTS],
        # T, Tg, Tn name every input dtype: MLX caches a compiled CUDA kernel by its name, which
        # holds the template arguments only.
        template=[("T", qkv.dtype), ("Tg", a1.dtype), ("Tn", norm_w.dtype if norm else mx.float32), ("H", heads),
                  ("KV", kv_heads), ("D", D), ("S", S), ("SOFTMAX", mix.size == 2), ("NORM", norm)],
        grid=(heads * threads, b, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(b, TN, heads * D), states, states],
        output_dtypes=[qkv.dtype, mx.float32, mx.float32],
    )


def dsla_step_ref(qkv, a1, a2, s1, s2, mix, norm_w, consts, parents=None, *, kv_heads: int):
    """`dsla_step` in MLX ops (float32), from the same arguments, with the same outputs."""
    b, heads, D, _ = s1.shape
    TN = qkv.shape[1]
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731  the kernel computes in float32
    q, k, v = mx.split(f32(qkv).reshape(b, TN, -1, D), [heads, heads + kv_heads], axis=2)
    k, v = (mx.repeat(a, heads // kv_heads, axis=2) for a in (k, v))  # (b, TN, heads, D)
    q = q * D**-0.5
    g1, g2 = (mx.maximum(nn.log_sigmoid(f32(a)).reshape(b, TN, heads, D) * consts[0], consts[1]) for a in (a1, a2))
    w1 = mx.sigmoid(mix[0] - mix[1]) if mix.size == 2 else mix[0]  # softmax of two, or gamma
    kv = k[..., :, None] * v[..., None, :]  # (b, TN, heads, D keys, D values)
    tree = list(range(-1, TN - 1)) if parents is None else parents
    states, ys = ([f32(s1)], [f32(s2)]), []
    for t in range(TN):
        after = []
        for g, held in zip((g1, g2), states):
            # the parent's state: a gather on the device where the parents are an array
            parent = mx.stack(held)[tree[t] + 1] if isinstance(tree, mx.array) else held[tree[t] + 1]
            after.append(mx.exp(g[:, t, ..., None]) * parent + kv[:, t])
            held.append(after[-1])
        o1, o2 = ((q[:, t, :, :, None] * h).sum(axis=-2) for h in after)  # (b, heads, D)
        o = w1 * o1 + (1 - w1) * o2
        if norm_w is not None:
            o = o * mx.rsqrt((o * o).mean(axis=-1, keepdims=True) + consts[2]) * f32(norm_w)
        ys.append(o)
    y = mx.stack(ys, axis=1).reshape(b, TN, heads * D).astype(qkv.dtype)
    s1_out, s2_out = (mx.stack(held[1:], axis=1) for held in states)
    return (y, s1_out, s2_out) if parents is not None else (y, s1_out[:, 0], s2_out[:, 0])


def _reference(*, inputs, template, output_shapes, **_):
    """`dsla_step_ref` on the kernel's launch (its fallback)."""
    qkv, a1, a2, s1, s2, mix, norm_w, consts, parents = inputs
    t = dict(template)
    tree = len(output_shapes[1]) == 5  # a tree's states come per node
    return list(dsla_step_ref(qkv, a1, a2, s1, s2, mix, norm_w if t["NORM"] else None, consts, parents if tree else None, kv_heads=t["KV"]))

