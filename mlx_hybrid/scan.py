"""Selective scan: the diagonal linear recurrence inside Mamba and Mamba2 layers.

    h_t[n, c] = exp(dt_t[c] * A[n, c]) * h_{t-1}[n, c] + dt_t[c] * B_t[g(c), n] * x_t[c]
    y_t[c]    = sum_n C_t[g(c), n] * h_t[n, c] + D[c] * x_t[c]

over channels c (Mamba2 heads are runs of channels sharing dt and A), with B and C shared by
the channels of a group, g(c) = c // (channels // groups). The state is laid out (batch, n,
channels) so that neighbouring kernel threads, one per channel, read neighbouring addresses.

One call advances a cached state over L tokens and returns the states after the positions in
`save`: L = 1 is the decode step, a prompt chunk with save = [L-1] is prefill, and a draft with
save = [j, L-1] is the multi-step verification of Algorithm 2 in "The Mamba in the Llama" (the
state after the last accepted token, without materializing the others). With `parents` the L
tokens are the nodes of a candidate tree, in an order where a parent comes before its children:
each node's state is advanced from its parent's (the cached state for parent -1), and every
node's state is returned, since which branch is accepted is known only afterwards.

`selective_scan_ref` is the ground truth and runs on every backend; `selective_scan` dispatches
to the Metal or CUDA kernel in `metal_kernels/` when the default device has one.

`ssm_step` is a whole Mamba or Mamba2 mixer between its two projections (conv, activations,
scan updates, gate) in one GPU launch, for a decode step or for the nodes of a candidate tree (a
verification pass): unfused, either is a chain of ~25 small ops a layer, and on a GPU each costs
a launch and host time. Its pure-MLX reference is `ssm_step_ref`, the same computation from the
same arguments; a backend without the kernel runs the mixer's unfused path
(`mlx_hybrid.models.hybrid`) instead, which the tests hold to the kernel's results.
"""

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import DECODE_PARENTS, kernel_backend, load_kernel


def selective_scan_ref(
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    state: mx.array,
    save: Sequence[int] | None = None,
    parents: Sequence[int] | None = None,
) -> tuple[mx.array, mx.array]:
    """Pure-MLX selective scan, one token at a time (in float32).

    x, dt: (batch, L, channels), dt already positive (softplus applied);
    A: (1 or n, channels), negative; B, C: (batch, L, groups, n); D: (channels,);
    state: (batch, n, channels) float32, the state before the first token;
    save: positions in [0, L) whose states to return (default: the last);
    parents: for a tree of tokens, each token's parent position (-1: the cached state); a list, or
        an int32 array built on the device (read there, by gathers).
    Returns y (batch, L, channels) in x's dtype and the saved states (batch, len(save), n, channels).
    """
    b, L, d = x.shape
    groups = B.shape[2]
    save = [L - 1] if save is None else list(save)
    # Broadcast group-shared B, C to channels: (b, L, n, channels).
    expand = d // groups
    Bc = mx.repeat(B.astype(mx.float32), expand, axis=2).transpose(0, 1, 3, 2)
    Cc = mx.repeat(C.astype(mx.float32), expand, axis=2).transpose(0, 1, 3, 2)
    xf, dtf, Af = x.astype(mx.float32), dt.astype(mx.float32), A.astype(mx.float32)
    h0 = state.astype(mx.float32)
    parents = list(range(-1, L - 1)) if parents is None else parents
    ys, hs = [], []
    for t in range(L):
        if isinstance(parents, mx.array):  # gathered on the device (inside mx.compile its values are unknown)
            h = mx.stack([h0, *hs])[parents[t] + 1]
        else:
            h = h0 if parents[t] < 0 else hs[parents[t]]
        h = mx.exp(dtf[:, t, None, :] * Af) * h + (dtf[:, t] * xf[:, t])[:, None, :] * Bc[:, t]
        ys.append((Cc[:, t] * h).sum(axis=1))
        hs.append(h)
    saved = {t: hs[t] for t in save}
    y = mx.stack(ys, axis=1) + D.astype(mx.float32) * xf
    return y.astype(x.dtype), mx.stack([saved[t] for t in save], axis=1)


def _check_inputs(x, dt, A, B, C, D, state, save, parents=None) -> list[int]:
    """Raise ValueError on shapes, dtypes, save positions or parents the kernels cannot take; return save."""
    if x.ndim != 3:
        raise ValueError(f"x must be (batch, L, channels), got shape {x.shape}")
    b, L, d = x.shape
    if dt.shape != x.shape:
        raise ValueError(f"dt must have x's shape {x.shape}, got {dt.shape}")
    if B.ndim != 4 or B.shape[:2] != (b, L):
        raise ValueError(f"B must be (batch, L, groups, n) = ({b}, {L}, groups, n), got {B.shape}")
    groups, n = B.shape[2], B.shape[3]
    if C.shape != B.shape:
        raise ValueError(f"C must have B's shape {B.shape}, got {C.shape}")
    if groups == 0 or d % groups:
        raise ValueError(f"channels ({d}) must be a multiple of groups ({groups})")
    if A.shape not in ((1, d), (n, d)):
        raise ValueError(f"A must be (1, {d}) or ({n}, {d}), got {A.shape}")
    if D.shape != (d,):
        raise ValueError(f"D must be ({d},), got {D.shape}")
    if state.shape != (b, n, d):
        raise ValueError(f"state must be (batch, n, channels) = ({b}, {n}, {d}), got {state.shape}")
    floats = (mx.float32, mx.float16, mx.bfloat16)
    for name, arr in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        if arr.dtype not in floats:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {arr.dtype}")
    if C.dtype != B.dtype:
        raise ValueError(f"B and C must have the same dtype, got {B.dtype} and {C.dtype}")
    save = [L - 1] if save is None else [int(p) for p in save]
    if not save or any(not 0 <= p < L for p in save) or any(p >= q for p, q in zip(save, save[1:])):
        raise ValueError(f"save must be non-empty, ascending, unique positions in [0, {L}), got {save}")
    if isinstance(parents, mx.array):  # built on the device: reading its values would wait for them
        if parents.shape != (L,):
            raise ValueError(f"parents must give each of the {L} tokens a parent, got shape {parents.shape}")
    elif parents is not None and (len(parents) != L or any(not -1 <= p < t for t, p in enumerate(parents))):
        raise ValueError(f"parents must give each of the {L} tokens an earlier position or -1, got {list(parents)}")
    if parents is not None and save != list(range(L)):
        raise ValueError("a tree scan returns every node's state: save must be all positions")
    # The kernels index with 32-bit ints; the saved states are the largest array.
    if max(x.size, B.size, b * len(save) * n * d) >= 2**31:
        raise ValueError("selective_scan: arrays of 2**31 or more elements are not supported")
    return save


def selective_scan_kernel(x, dt, A, B, C, D, state, save=None, parents=None, *, backend: str):
    """`selective_scan` on the 'metal' or 'cuda' kernel explicitly (the parity tests call this)."""
    save = _check_inputs(x, dt, A, B, C, D, state, save, parents)
    return _launch(backend, x, dt, A, B, C, D, state, save, parents)


def selective_scan(x, dt, A, B, C, D, state, save=None, parents=None):
    """`selective_scan_ref`'s signature and results, on the Metal or CUDA kernel when the default
    device is a GPU with one, else on `selective_scan_ref`.

    Unlike the reference, `save` must be non-empty, ascending and unique (the kernel writes the
    states in one pass over the tokens); this is checked on every backend, so code that runs on
    the CPU runs unchanged on the GPU.
    """
    save = _check_inputs(x, dt, A, B, C, D, state, save, parents)
    backend = kernel_backend()
    if backend is None:
        return selective_scan_ref(x, dt, A, B, C, D, state, save, parents)
    return _launch(backend, x, dt, A, B, C, D, state, save, parents)


def _launch(backend, x, dt, A, B, C, D, state, save, parents=None):
    """Run the kernel on checked inputs: one GPU thread per (batch, channel) walks the whole
    sequence with its state column in registers (metal_kernels/selective_scan.cu)."""
    b, L, d = x.shape
    n = B.shape[3]
    names = ("x", "dt", "A", "B", "C", "D", "state", "save", "parents")
    y, states = load_kernel(backend, "selective_scan", names, ("y", "states"), reference=_scan_reference)(
        inputs=[x, dt, A.astype(mx.float32), B, C, D.astype(mx.float32), state.astype(mx.float32),
                mx.array(save, dtype=mx.int32), mx.array([-1] if parents is None else parents).astype(mx.int32)],
        # T, Tdt, Tbc name every input dtype: MLX caches a compiled CUDA kernel by its name,
        # which holds the template arguments only.
        template=[("T", x.dtype), ("Tdt", dt.dtype), ("Tbc", B.dtype), ("N", n), ("NA", A.shape[0]),
                  ("TREE", parents is not None)],
        grid=(d, b, 1),
        # Small threadgroups: at N = 128 a thread holds ~170 registers, so a 256-thread group
        # takes most of an SM's register file; 64-thread groups keep more warps resident (on an
        # H100: multi-step calls 17-26% faster, large decode steps up to 8%; benchmarks/README.md).
        threadgroup=(min(64, d), 1, 1),
        output_shapes=[x.shape, (b, len(save), n, d)],
        output_dtypes=[x.dtype, mx.float32],
    )
    return y, states


def _scan_reference(*, inputs, template, **_):
    """`selective_scan_ref` on the kernel's launch (its fallback)."""
    x, dt, A, B, C, D, state, save, parents = inputs
    return selective_scan_ref(x, dt, A, B, C, D, state, save.tolist(), parents if dict(template)["TREE"] else None)


def ssm_step(u, dt, window, conv_w, conv_b, dt_bias, A_log, D, state, parents=None, *, mamba2: bool, d_xb: int, offsets, backend: str):
    """A Mamba (mamba2=False) or Mamba2 mixer between its two projections on the fused GPU kernel:
    one decode step, or with `parents` the nodes of a candidate tree.

    u: (batch, TN, P) the mixer's input projection, with x, z, B, C at `offsets` (x and B before
    the KV-group expansion; Mamba2's [x, B, C] contiguous from x's offset); dt: (batch, TN, heads
    or channels) before `dt_bias`; window: (batch, K-1, conv channels) the conv inputs before u;
    conv_w: (conv channels, K); conv_b: (conv channels,); A_log: (heads,) or (channels, n);
    state: (batch, n, channels) float32; parents: (TN,) int32, node t continues node parents[t]
    (-1: window and state), parents before children; without it TN must be 1.
    Returns the gated outputs y * silu(z) (batch, TN, channels) and the window and state after
    the token, or with `parents` after each node: (batch, TN, K-1, conv channels) and
    (batch, TN, n, channels) (metal_kernels/ssm_step.cu).
    """
    b, n, d = state.shape
    TN, K = u.shape[1], conv_w.shape[1]
    if K < 2 or (parents is None and TN != 1) or (parents is not None and parents.shape != (TN,)):
        raise ValueError(f"ssm_step takes one token or a tree of parents for each, and a conv of width >= 2, got L={TN}, K={K}")
    ox, oz, ob, oc = offsets
    dtype = u.dtype
    tree = parents is not None
    lanes = min(32, 1 << (n.bit_length() - 1))  # threads a channel, each a share of its n state rows
    return load_kernel(
        backend, "ssm_step", ("u", "dt", "window", "conv_w", "conv_b", "dt_bias", "A_log", "D", "state", "parents"),
        ("g", "window_out", "state_out"), reference=_step_reference,
    )(
        inputs=[u, dt, window, conv_w.astype(dtype), conv_b.astype(dtype), dt_bias.astype(mx.float32),
                A_log.astype(mx.float32), D.astype(mx.float32), state.astype(mx.float32), parents if tree else DECODE_PARENTS],
        template=[("T", dtype), ("N", n), ("S", lanes), ("R", d // d_xb), ("K", K), ("MAMBA2", mamba2), ("DI", d),
                  ("DXB", d_xb), ("OX", ox), ("OZ", oz), ("OB", ob), ("OC", oc)],
        grid=(d * lanes, b, 1),
        threadgroup=(min(128, -(-d * lanes // 32) * 32), 1, 1),  # whole SIMD groups: all take part in the shuffles
        output_shapes=[(b, TN, d), (b, TN, *window.shape[1:]) if tree else window.shape, (b, TN, n, d) if tree else state.shape],
        output_dtypes=[dtype, dtype, mx.float32],
    )


def ssm_step_ref(u, dt, window, conv_w, conv_b, dt_bias, A_log, D, state, parents=None, *, mamba2: bool, d_xb: int, offsets):
    """`ssm_step` in MLX ops, from the same arguments (conv weights in u's dtype, the rest as the
    kernel takes them), with its outputs: the ground truth of the fused kernel, and what runs if
    the kernel fails."""
    from mlx_hybrid.models.hybrid import ancestor_index, expand_groups  # hybrid imports this module

    b, n, d = state.shape
    TN, K = u.shape[1], conv_w.shape[1]
    ox, oz, ob, oc = offsets
    r, width = d // d_xb, conv_w.shape[0]
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731  the kernel computes in float32
    # The conv inputs: Mamba2's [x, B, C] as stored, Mamba's x expanded to every head.
    conv_in = u[..., ox : ox + width] if mamba2 else expand_groups(u[..., ox : ox + d_xb], n, r)
    rows = mx.concatenate([window.astype(u.dtype), conv_in], axis=1)  # (b, K-1 + TN, width)
    idx = ancestor_index(mx.array([-1], mx.int32) if parents is None else parents, K)  # oldest first, the node last
    conv = nn.silu((f32(rows[:, idx]) * f32(conv_w).T).sum(axis=2) + f32(conv_b))  # (b, TN, width)
    heads = d // n
    if mamba2:
        x = expand_groups(conv[..., :d_xb], n, r)
        Bm = expand_groups(conv[..., d_xb : 2 * d_xb], n, r).reshape(b, TN, heads, n)
        Cm = conv[..., 2 * d_xb : 2 * d_xb + d].reshape(b, TN, heads, n)
        dt = mx.repeat(f32(dt[..., :heads]) + f32(dt_bias), n, axis=-1)
        A, Dc = mx.repeat(-mx.exp(f32(A_log)), n)[None], mx.repeat(f32(D), n)
    else:
        x = conv
        Bm = expand_groups(f32(u[..., ob : ob + d_xb]), n, r).reshape(b, TN, heads, n)
        Cm = f32(u[..., oc : oc + d]).reshape(b, TN, heads, n)
        dt, A, Dc = f32(dt[..., :d]) + f32(dt_bias), -mx.exp(f32(A_log)).T, f32(D)
    dt = mx.where(dt > 20, dt, mx.log1p(mx.exp(dt)))  # softplus, as the kernel takes it
    tree = list(range(-1, TN - 1)) if parents is None else parents
    y, states = selective_scan_ref(x, dt, A, Bm, Cm, Dc, state, range(TN), tree)
    g = (y * nn.silu(f32(u[..., oz : oz + d]))).astype(u.dtype)
    after = rows[:, idx[:, 1:]]  # each node's window: its K-1 newest conv inputs, oldest first
    if parents is None:
        return g, after[:, 0], states[:, 0]
    return g, after, states


def _step_reference(*, inputs, template, output_shapes, **_):
    """`ssm_step_ref` on the kernel's launch (its fallback): over a tree when it returns a window a node."""
    u, dt, window, conv_w, conv_b, dt_bias, A_log, D, state, parents = inputs
    t = dict(template)
    tree = len(output_shapes[1]) == 4
    return ssm_step_ref(u, dt, window, conv_w, conv_b, dt_bias, A_log, D, state, parents if tree else None,
                        mamba2=bool(t["MAMBA2"]), d_xb=t["DXB"], offsets=(t["OX"], t["OZ"], t["OB"], t["OC"]))
