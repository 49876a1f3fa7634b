"""Hybrid Llama/Mistral: some attention layers replaced by Mamba, Mamba2 or DSLA layers.

Embeddings, norms, MLPs and the remaining attention layers are the Llama ones. The recurrent
layers are attention-initialized ("The Mamba in the Llama", Algorithm 1): x, B, C come from the
attention's V, K, Q projections, with grouped KV heads expanded to the query heads, so a layer
starts out as linearized attention and distillation only has to learn dt, A, D and the rest.

The Mamba and Mamba2 layers follow the released MambaInLlama checkpoints tensor for tensor,
quirks included (see `Mamba`). DSLA (dual-state linear attention, DSLA-Serve eq. 4-5) comes in
two forms chosen by configuration (`DSLA`): this project's own and DSLA-Serve's released layer.
The checkpoint format is described in `docs/formats/hybrid-checkpoint.md`.
"""

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.cache import KVCache, StateCache
from mlx_hybrid.dsla_step import dsla_step
from mlx_hybrid.models import llama
from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.models.linear import Linear, fused_project
from mlx_hybrid.scan import selective_scan, ssm_step
from mlx_hybrid.tree_mask import TreeMask

MAMBA_IN_LLAMA_CONFIG = "mamba_config.json"  # beside config.json in MambaInLlama releases
LAYER_TYPES = ("attention", "mamba", "mamba2", "dsla")
# Per-layer-kind attribute holding the mixer (MambaInLlama names its SSM mixers "mamba").
MIXER_NAME = {"attention": "self_attn", "mamba": "mamba", "mamba2": "mamba", "dsla": "dsla"}
# Parameters kept in float32 whatever the model dtype: the recurrence compounds their rounding.
FP32_PARAMS = ("A_log", "D", "dt_bias", "gamma", "alpha_list")
DSLA_MIXES = ("gamma", "softmax")


@dataclass
class ModelArgs(llama.ModelArgs):
    base_model_type: str = "llama"  # llama or mistral (sliding-window attention layers)
    mixer_types: list[str] | None = None
    d_state: int = 16  # SSM state per channel (Mamba2: also the head size)
    d_conv: int = 4
    d_inner: int | None = None  # SSM channels; default hidden_size
    d_xb: int | None = None  # width of x and B before KV-head expansion; default kv_heads * head_dim
    dt_rank: int | None = None  # Mamba's low-rank dt projection; default ceil(hidden_size / 16)
    conv_bias: bool = True
    # DSLA: this project's form by default; DSLA-Serve's is gate_rank 0, gate_clamp -50, dsla_mix
    # "softmax", dsla_o_norm false, dsla_kv_heads = num_attention_heads (see `DSLA`).
    gate_rank: int = 16  # rank of the forget-gate projections; 0: full rank (gk_proj, gk_proj2)
    gate_norm: float = 16.0  # DSLA gates are logsigmoid(.) / gate_norm, as in GLA
    gate_clamp: float | None = None  # lower bound of the log gates
    dsla_mix: str = "gamma"  # gamma: gamma o1 + (1 - gamma) o2; softmax: softmax(alpha_list) . (o1, o2)
    dsla_o_norm: bool = True  # a per-head RMSNorm of the mixed output
    dsla_kv_heads: int | None = None  # K/V heads of the DSLA layers; default num_key_value_heads
    # Attention layers that also carry DSLA weights, least sensitive first, and how many of them
    # may run as DSLA at once: {"order": [...], "max_layers": k} (see mlx_hybrid/adaptive.py).
    dsla_conversion: dict | None = None

    def __post_init__(self):
        window = self.sliding_window if self.base_model_type == "mistral" else None
        super().__post_init__()
        self.sliding_window = window
        self.mixer_types = self.mixer_types or ["attention"] * self.num_hidden_layers
        if len(self.mixer_types) != self.num_hidden_layers:
            raise ValueError(
                f"mixer_types lists {len(self.mixer_types)} layers but num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.mixer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown layer type '{unknown[0]}' (known: {', '.join(LAYER_TYPES)})")
        self.d_inner = self.d_inner or self.hidden_size
        self.d_xb = self.d_xb or self.num_key_value_heads * self.head_dim
        self.dt_rank = self.dt_rank or math.ceil(self.hidden_size / 16)
        for name in ("d_inner", "d_xb"):
            if getattr(self, name) % self.d_state:
                raise ValueError(f"{name} ({getattr(self, name)}) is not a multiple of d_state ({self.d_state})")
        if self.d_inner % self.d_xb:
            raise ValueError(f"d_inner ({self.d_inner}) is not a multiple of d_xb ({self.d_xb})")
        self.dsla_kv_heads = self.dsla_kv_heads or self.num_key_value_heads
        if self.num_attention_heads % self.dsla_kv_heads:
            raise ValueError(f"dsla_kv_heads ({self.dsla_kv_heads}) does not divide num_attention_heads ({self.num_attention_heads})")
        if self.dsla_mix not in DSLA_MIXES:
            raise ValueError(f"dsla_mix must be one of {', '.join(DSLA_MIXES)}, got {self.dsla_mix!r}")
        if not isinstance(self.gate_rank, int) or isinstance(self.gate_rank, bool) or self.gate_rank < 0:
            raise ValueError(f"gate_rank must be a non-negative integer (0: full rank), got {self.gate_rank!r}")
        self.dsla_order, self.dsla_max_layers = self._dsla_conversion()

    def _dsla_conversion(self) -> tuple[list[int], int]:
        conv = self.dsla_conversion or {}
        if not isinstance(conv, dict) or set(conv) - {"order", "max_layers"}:
            raise ValueError(f"dsla_conversion must be {{'order': [...], 'max_layers': k}}, got {conv!r}")
        order = conv.get("order", [])
        if not isinstance(order, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in order):
            raise ValueError(f"dsla_conversion.order must be a list of layer indices, got {order!r}")
        if len(set(order)) != len(order):
            raise ValueError(f"dsla_conversion.order lists a layer twice: {order}")
        for i in order:
            if not 0 <= i < self.num_hidden_layers or self.mixer_types[i] != "attention":
                raise ValueError(f"dsla_conversion.order: layer {i} is not an attention layer of this model")
        max_layers = conv.get("max_layers", len(order))
        if not isinstance(max_layers, int) or isinstance(max_layers, bool) or not 0 <= max_layers <= len(order):
            raise ValueError(f"dsla_conversion.max_layers must be an integer in [0, {len(order)}], got {max_layers!r}")
        return order, max_layers


def expand_groups(t: mx.array, size: int, repeats: int) -> mx.array:
    """Repeat each run of `size` features `repeats` times along the last axis (KV-head expansion)."""
    if repeats == 1:
        return t
    *lead, d = t.shape
    return mx.repeat(t.reshape(*lead, d // size, 1, size), repeats, axis=-2).reshape(*lead, d * repeats)


def ancestor_index(parents: mx.array, K: int) -> mx.array:
    """For each node of a candidate tree, the positions of its last K conv inputs (itself last)
    in [the K-1 cached inputs; the nodes]: a node's predecessors are its ancestors, then the cache.
    Built on the device from the parents (a packed beam's are known only there)."""
    T = parents.shape[0]
    # The input before each position of [cache; nodes]: a node's parent, the last cached input for
    # a root, the previous cached input within the cache (position 0 is never stepped back from).
    before = mx.concatenate([mx.arange(-1, K - 2), mx.where(parents >= 0, parents + K - 1, K - 2)])
    cols = [mx.arange(K - 1, K - 1 + T)]
    for _ in range(K - 1):
        cols.append(before[cols[-1]])
    return mx.stack(cols[::-1], axis=1)


# Decode steps are chains of small ops; compiling the elementwise stretches between the matmuls
# and the scan fuses them into a few kernels (integer arguments are compile-time constants).


@mx.compile
def _depthwise_conv(xp: mx.array, w: mx.array) -> mx.array:
    """sum_k xp[:, t + k] * w[:, k] for t < L, over padded input xp (batch, L + K - 1, C)."""
    K = w.shape[-1]
    L = xp.shape[1] - K + 1
    return sum(xp[:, k : k + L] * w[:, k] for k in range(K))


@mx.compile
def _mamba_inputs(proj, d_xb: int, d_inner: int, n: int, r: int):
    """Split Mamba's fused projection into x, z, B, C, dt_low, expanding x and B by d_state runs."""
    B_, L, _ = proj.shape
    x, z, Bm, Cm, dt = mx.split(proj, [d_xb, d_xb + d_inner, 2 * d_xb + d_inner, 2 * (d_xb + d_inner)], axis=-1)
    Bm = expand_groups(Bm, n, r).reshape(B_, L, -1, n)
    return expand_groups(x, n, r), z, Bm, Cm.reshape(B_, L, -1, n), dt


@mx.compile
def _mamba2_inputs(xBC, dt, dt_bias, A_log, D, d_xb: int, n: int, r: int):
    """x, B, C (KV groups expanded) and per-channel dt, A, D from Mamba2's convolved projection."""
    B_, L, _ = xBC.shape
    x, Bm, Cm = mx.split(nn.silu(xBC), [d_xb, 2 * d_xb], axis=-1)
    x = expand_groups(x, n, r)
    Bm = expand_groups(Bm, n, r).reshape(B_, L, -1, n)
    dt = mx.repeat(nn.softplus(dt + dt_bias), n, axis=-1)
    A = mx.repeat(-mx.exp(A_log.astype(mx.float32)), n)[None]
    return x, Bm, Cm.reshape(B_, L, -1, n), dt, A, mx.repeat(D, n)


@mx.compile
def _head_rms_norm(y, weight, n: int, eps: float):
    """RMSNorm over each run of n channels (a Mamba2 head), times weight."""
    B_, L, d = y.shape
    return mx.fast.rms_norm(y.reshape(B_, L, d // n, n), None, eps).reshape(B_, L, d) * weight


@mx.compile
def _silu_gate(y, z):
    return y * nn.silu(z)


class CausalConv(nn.Module):
    """Depthwise causal convolution over time, weights in PyTorch's Conv1d layout (C, 1, K)."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))
        if bias:
            self.bias = mx.zeros((channels,))

    def __call__(self, x: mx.array, window: mx.array | None) -> tuple[mx.array, mx.array]:
        """Convolve x (batch, L, C) continuing from window, the K-1 previous inputs; return the new window."""
        B, L, C = x.shape
        K = self.weight.shape[-1]
        if window is None:
            window = mx.zeros((B, K - 1, C), x.dtype)
        xp = mx.concatenate([window.astype(x.dtype), x], axis=1)
        out = _depthwise_conv(xp, self.weight[:, 0, :].astype(x.dtype))
        if "bias" in self:
            out = out + self.bias.astype(x.dtype)
        return out, xp[:, L:]

    def tree(self, x: mx.array, window: mx.array | None, tree):
        """Convolve the nodes of a candidate tree, each over its own ancestors; also return a
        function giving the window after any node."""
        B, T, C = x.shape
        K = self.weight.shape[-1]
        if window is None:
            window = mx.zeros((B, K - 1, C), x.dtype)
        xp = mx.concatenate([window.astype(x.dtype), x], axis=1)
        idx = ancestor_index(tree.parent_array(), K)
        out = (xp[:, idx] * self.weight[:, 0, :].T.astype(x.dtype)).sum(axis=2)
        if "bias" in self:
            out = out + self.bias.astype(x.dtype)
        return out, lambda node: xp[:, idx[node, 1:]]

    def step_args(self, window: mx.array | None, u: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Window (zeros before the first token), weights (C, K) and bias for `ssm_step`."""
        C, _, K = self.weight.shape
        if window is None:
            window = mx.zeros((_batched(u).shape[0], K - 1, C), u.dtype)
        bias = self.bias if "bias" in self else mx.zeros((C,), u.dtype)
        return window, self.weight.reshape(C, K), bias


def _batched(a: mx.array) -> mx.array:
    """a (batch, tokens, features), also from a tree's (nodes, features): the nodes as rows of a
    matrix (`llama.LlamaModel`) are a batch of one."""
    return a.reshape(-1, *a.shape[-2:])


def _parents(tree: TreeMask | None) -> mx.array | None:
    """The tree's parents for `ssm_step` (one array per pass, shared with the attention layers)."""
    return None if tree is None else tree.once("parents", tree.parent_array)


def _kernel_backend(u: mx.array, tree: TreeMask | None) -> str | None:
    """The backend of `ssm_step` for a decode step or a tree, where the device has one."""
    return kernel_backend() if tree is not None or u.shape[1] == 1 else None


def _finish(cache: StateCache, arrays: list[mx.array], tree: TreeMask | None):
    """After a fused step (`ssm_step`, `dsla_step`): the decode step's arrays, or every node's (a tree)."""
    if tree is None:
        cache.update(arrays, 1)
    else:
        cache.hold(arrays)


def _output(y: mx.array, shape: tuple, residual: mx.array | None) -> mx.array:
    """residual + y, y back in the input's layout `shape` (nodes as rows stay rows; the reference
    paths run (batch, tokens, .))."""
    y = y.reshape(*shape[:-1], -1)
    return y if residual is None else residual + y


class Mamba(nn.Module):
    """MambaInLlama's Mamba layer: per-channel dt and A (d_inner x d_state), x gated by silu(z).

    Two quirks of the released code are kept so its checkpoints give the same outputs: dt_proj's
    bias is added twice (once by the Linear, once as the scan's delta_bias), and B, x are expanded
    by repeating each d_state-sized run of features, which equals KV-head expansion when d_state
    is the head size.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.d_inner, self.d_xb, self.d_state, self.dt_rank = args.d_inner, args.d_xb, args.d_state, args.dt_rank
        self.repeats = args.d_inner // args.d_xb
        # in_proj fuses MambaInLlama's in_proj_x, in_proj_z, B_proj, C_proj and dt_proj_down.
        width = 2 * self.d_xb + 2 * self.d_inner + self.dt_rank
        self.in_proj = Linear(args.hidden_size, width, bias=False)
        self.conv1d = CausalConv(self.d_inner, args.d_conv, args.conv_bias)
        self.dt_proj = Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = mx.zeros((self.d_inner, self.d_state))
        self.D = mx.ones((self.d_inner,))
        self.out_proj = Linear(self.d_inner, args.hidden_size, bias=False)

    def kernel_step(self, u, window, state, parents, backend: str, norm=None, residual=None):
        """The mixer on `ssm_step`: output, window and state after one token u, or with parents
        after each node of the tree u (([batch,] tokens, hidden): see `_batched`); u normalized
        by `norm` first and the output added to `residual`, if given (in the projections'
        launches: `linear.fused_project`)."""
        proj = fused_project(self.in_proj, u, norm)
        dt = self.dt_proj(proj[..., -self.dt_rank :])  # the bias is added again in the kernel
        d_xb, d_inner = self.d_xb, self.d_inner
        y, window, state = ssm_step(
            _batched(proj), _batched(dt), *self.conv1d.step_args(window, u), self.dt_proj.bias, self.A_log, self.D, state,
            parents, mamba2=False, d_xb=d_xb, offsets=(0, d_xb, d_xb + d_inner, 2 * d_xb + d_inner), backend=backend,
        )
        return fused_project(self.out_proj, y.reshape(*u.shape[:-1], -1), residual=residual), window, state

    def project(self, u: mx.array):
        """x, z, B, C, dt (pre-softplus) for input u, KV groups expanded (see the class docstring)."""
        x, z, Bm, Cm, dt = _mamba_inputs(self.in_proj(u), self.d_xb, self.d_inner, self.d_state, self.repeats)
        return x, z, Bm, Cm, self.dt_proj(dt) + self.dt_proj.bias

    def __call__(self, u: mx.array, mask: TreeMask | None = None, cache: StateCache = None, norm=None, residual=None) -> mx.array:
        """residual + the mixer over norm(u) (both optional), advancing the cache; with a tree
        mask, u holds its nodes as rows and the cache holds the state after each (`StateCache.hold`)."""
        window, state = cache.arrays or (None, mx.zeros((_batched(u).shape[0], self.d_state, self.d_inner)))
        if backend := _kernel_backend(u, mask):
            y, window, state = self.kernel_step(u, window, state, _parents(mask), backend, norm, residual)
            _finish(cache, [window, state], mask)
            return y
        shape, u = u.shape, _batched(u if norm is None else norm(u))
        x, z, Bm, Cm, dt = self.project(u)
        A = -mx.exp(self.A_log.astype(mx.float32)).T
        if mask is not None:
            x, window_after = self.conv1d.tree(x, window, mask)
            y, states = selective_scan(nn.silu(x), nn.softplus(dt), A, Bm, Cm, self.D, state, range(len(mask)), mask.parents)
            cache.hold(lambda node: [window_after(node), states[:, node]])
        else:
            x, window = self.conv1d(x, window)
            y, states = selective_scan(nn.silu(x), nn.softplus(dt), A, Bm, Cm, self.D, state)
            cache.update([window, states[:, -1]], u.shape[1])
        return _output(self.out_proj(_silu_gate(y, z)), shape, residual)


class Mamba2(nn.Module):
    """MambaInLlama's Mamba2 layer: one dt and scalar A per head (heads of d_state channels),
    convolution over [x, B, C] before KV-head expansion, and a gated RMSNorm per head."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.d_inner, self.d_xb, self.d_state = args.d_inner, args.d_xb, args.d_state
        self.nheads = args.d_inner // args.d_state
        self.repeats = args.d_inner // args.d_xb
        self.eps = 1e-5
        self.in_proj = Linear(args.hidden_size, 2 * self.d_inner + 2 * self.d_xb + self.nheads, bias=False)
        self.conv1d = CausalConv(self.d_inner + 2 * self.d_xb, args.d_conv, args.conv_bias)
        self.dt_bias = mx.zeros((self.nheads,))
        self.A_log = mx.zeros((self.nheads,))
        self.D = mx.ones((self.nheads,))
        self.norm = nn.RMSNorm(self.d_inner)  # weight only: normalized per head below
        self.out_proj = Linear(self.d_inner, args.hidden_size, bias=False)

    def kernel_step(self, u, window, state, parents, backend: str, norm=None, residual=None):
        """The mixer on `ssm_step`: output, window and state after one token u, or with parents
        after each node of the tree u (([batch,] tokens, hidden): see `_batched`); norm and
        residual as `Mamba.kernel_step`'s."""
        proj = _batched(fused_project(self.in_proj, u, norm))
        y, window, state = ssm_step(
            proj, proj[..., -self.nheads :], *self.conv1d.step_args(window, u), self.dt_bias, self.A_log, self.D,
            state, parents, mamba2=True, d_xb=self.d_xb, offsets=(self.d_inner, 0, 0, 0), backend=backend,
        )
        y = _head_rms_norm(y, self.norm.weight, self.d_state, self.eps)
        return fused_project(self.out_proj, y.reshape(*u.shape[:-1], -1), residual=residual), window, state

    def __call__(self, u: mx.array, mask: TreeMask | None = None, cache: StateCache = None, norm=None, residual=None) -> mx.array:
        """As `Mamba.__call__`."""
        n, r = self.d_state, self.repeats
        window, state = cache.arrays or (None, mx.zeros((_batched(u).shape[0], n, self.d_inner)))
        if backend := _kernel_backend(u, mask):
            y, window, state = self.kernel_step(u, window, state, _parents(mask), backend, norm, residual)
            _finish(cache, [window, state], mask)
            return y
        shape, u = u.shape, _batched(u if norm is None else norm(u))
        L = u.shape[1]
        z, xBC, dt = mx.split(self.in_proj(u), [self.d_inner, 2 * self.d_inner + 2 * self.d_xb], axis=-1)
        if mask is not None:
            xBC, window_after = self.conv1d.tree(xBC, window, mask)
        else:
            xBC, window = self.conv1d(xBC, window)
        x, Bm, Cm, dt, A, D = _mamba2_inputs(xBC, dt, self.dt_bias, self.A_log, self.D, self.d_xb, n, r)
        if mask is not None:
            y, states = selective_scan(x, dt, A, Bm, Cm, D, state, range(L), mask.parents)
            cache.hold(lambda node: [window_after(node), states[:, node]])
        else:
            y, states = selective_scan(x, dt, A, Bm, Cm, D, state)
            cache.update([window, states[:, -1]], L)
        return _output(self.out_proj(_head_rms_norm(_silu_gate(y, z), self.norm.weight, n, self.eps)), shape, residual)


def _gla_block(q, k, v, b, visible, state):
    """Outputs for a block of tokens with cumulative log gates b (decays enter only as
    exp(b_t - b_s), never as a ratio of exponentials, so no block length can overflow) that see
    the state before the block and the tokens s with visible[t, s]."""
    inter = (q * mx.exp(b)) @ state
    decay = mx.exp(mx.where(visible[:, :, None], b[:, :, :, None, :] - b[:, :, None, :, :], -mx.inf))
    scores = (q[:, :, :, None, :] * k[:, :, None, :, :] * decay).sum(-1)
    return inter + scores @ v


@mx.compile
def gated_linear_attention(q, k, v, g, state, chunk: int = 64):
    """o_t = q_t S_t with S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t, per head, in chunks.

    q, k, g: (batch, heads, L, dk); v: (batch, heads, L, dv); state: (batch, heads, dk, dv).
    Runs in float32.
    """
    q, k, v, g = (t.astype(mx.float32) for t in (q, k, v, g))
    outs = []
    for start in range(0, q.shape[2], chunk):
        qc, kc, vc, gc = (t[:, :, start : start + chunk] for t in (q, k, v, g))
        b = mx.cumsum(gc, axis=2)
        outs.append(_gla_block(qc, kc, vc, b, mx.tril(mx.ones((b.shape[2],) * 2, mx.bool_)), state))
        last = b[:, :, -1:, :]
        state = mx.exp(last).swapaxes(2, 3) * state + (kc * mx.exp(last - b)).swapaxes(2, 3) @ vc
    return mx.concatenate(outs, axis=2), state


def gated_linear_attention_tree(q, k, v, g, state, visible: mx.array):
    """`gated_linear_attention` over the nodes of a candidate tree (visible = `ancestor_mask`):
    each node continues its parent's state. Returns the outputs and a function giving the state
    after any node (an int, or a device scalar while the host has not read the path)."""
    q, k, v, g = (t.astype(mx.float32) for t in (q, k, v, g))
    b = visible.astype(mx.float32) @ g  # log gates summed along each node's path

    def state_after(node: int) -> mx.array:
        decay = mx.exp(mx.where(visible[node][:, None], mx.expand_dims(b[:, :, node], 2) - b, -mx.inf))
        return mx.exp(b[:, :, node, :, None]) * state + (k * decay).swapaxes(2, 3) @ v

    return _gla_block(q, k, v, b, visible, state), state_after


class DSLA(nn.Module):
    """Dual-state linear attention: two gated linear-attention states with data-dependent forget
    gates, mixed as q (w1 S1 + w2 S2) (DSLA-Serve eq. 4-5), in one of two forms.

    q, k, v, o have the attention's shapes (q scaled by head_dim^-0.5, KV heads expanded), so an
    attention-initialized DSLA layer with gates fixed at 1 is linearized attention. Gates are
    GLA's: log g = logsigmoid(W u + b) / gate_norm, one per key feature and head, and no RoPE.
    This project's form (the defaults) has low-rank gate projections (gate*_down, gate*_up),
    w1 = gamma, w2 = 1 - gamma, and a per-head RMSNorm of the mixed output (o_norm).
    DSLA-Serve's released layer (utnslab/DSLA-Serve, src/layer.py) has full-rank gates with bias
    (gk_proj, gk_proj2), (w1, w2) = softmax(alpha_list), no output norm, log gates clamped at
    -50, and as many K/V heads as query heads (`ModelArgs` fields gate_rank, dsla_mix,
    dsla_o_norm, gate_clamp, dsla_kv_heads).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.dsla_kv_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        self.gate_norm, self.gate_clamp = args.gate_norm, args.gate_clamp
        qkv = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = Linear(args.hidden_size, qkv, bias=args.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.attention_bias)
        width = self.n_heads * self.head_dim
        if args.gate_rank:
            self.gate1_down = Linear(args.hidden_size, args.gate_rank, bias=False)
            self.gate1_up = Linear(args.gate_rank, width, bias=True)
            self.gate2_down = Linear(args.hidden_size, args.gate_rank, bias=False)
            self.gate2_up = Linear(args.gate_rank, width, bias=True)
        else:
            self.gk_proj = Linear(args.hidden_size, width, bias=True)
            self.gk_proj2 = Linear(args.hidden_size, width, bias=True)
        if args.dsla_mix == "gamma":
            self.gamma = mx.array([0.5])
        else:
            self.alpha_list = mx.zeros((2,))
        if args.dsla_o_norm:
            self.o_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        clamp = -math.inf if self.gate_clamp is None else self.gate_clamp
        self._step_consts = mx.array([1 / self.gate_norm, clamp, args.rms_norm_eps], mx.float32)  # `dsla_step`'s

    def _heads(self, t: mx.array) -> mx.array:
        B, L, _ = t.shape
        return t.reshape(B, L, -1, self.head_dim).transpose(0, 2, 1, 3)

    def gate_logits(self, u: mx.array) -> tuple[mx.array, mx.array]:
        """The two gates' pre-activations (..., heads * head_dim)."""
        if "gk_proj" in self:
            return self.gk_proj(u), self.gk_proj2(u)
        return self.gate1_up(self.gate1_down(u)), self.gate2_up(self.gate2_down(u))

    def log_gate(self, a: mx.array) -> mx.array:
        """log g from a gate's pre-activation, in float32, as heads (batch, heads, L, head_dim)."""
        g = nn.log_sigmoid(a.astype(mx.float32)) / self.gate_norm
        return self._heads(g if self.gate_clamp is None else mx.maximum(g, self.gate_clamp))

    def mix_weights(self) -> tuple[mx.array, mx.array]:
        """(w1, w2), the weights of the two states' outputs, in float32."""
        if "gamma" in self:
            gamma = self.gamma.astype(mx.float32)
            return gamma, 1 - gamma
        w = mx.softmax(self.alpha_list.astype(mx.float32), precise=True)
        return w[0], w[1]

    def kernel_step(self, u, s1, s2, parents, backend: str, norm=None, residual=None):
        """The mixer on `dsla_step`: output and both states after one token u, or with parents
        after each node of the tree u (([batch,] tokens, hidden): see `_batched`); u normalized
        by `norm` first and the output added to `residual`, if given."""
        x = u if norm is None else norm(u)
        a1, a2 = self.gate_logits(x)
        mix = self.gamma if "gamma" in self else self.alpha_list
        o, s1, s2 = dsla_step(
            _batched(self.qkv_proj(x)), _batched(a1), _batched(a2), s1, s2, mix, self.o_norm.weight if "o_norm" in self else None,
            self._step_consts, parents, kv_heads=self.n_kv_heads, backend=backend,
        )
        return fused_project(self.o_proj, o.reshape(*u.shape[:-1], -1), residual=residual), s1, s2

    def __call__(self, u: mx.array, mask: TreeMask | None = None, cache: StateCache = None, norm=None, residual=None) -> mx.array:
        """As `Mamba.__call__`."""
        s1, s2 = cache.arrays or [mx.zeros((_batched(u).shape[0], self.n_heads, self.head_dim, self.head_dim))] * 2
        if backend := _kernel_backend(u, mask):
            y, s1, s2 = self.kernel_step(u, s1, s2, _parents(mask), backend, norm, residual)
            _finish(cache, [s1, s2], mask)
            return y
        shape, u = u.shape, _batched(u if norm is None else norm(u))
        B, L, _ = u.shape
        qkv = self._heads(self.qkv_proj(u))
        q, k, v = mx.split(qkv, [self.n_heads, self.n_heads + self.n_kv_heads], axis=1)
        r = self.n_heads // self.n_kv_heads
        k, v = mx.repeat(k, r, axis=1), mx.repeat(v, r, axis=1)
        q = q * self.scale
        g1, g2 = (self.log_gate(a) for a in self.gate_logits(u))
        if mask is not None:
            visible = mask.visible()
            (o1, after1), (o2, after2) = (gated_linear_attention_tree(q, k, v, g, s, visible) for g, s in ((g1, s1), (g2, s2)))
            cache.hold(lambda node: [after1(node), after2(node)])
        else:
            o1, s1 = gated_linear_attention(q, k, v, g1, s1)
            o2, s2 = gated_linear_attention(q, k, v, g2, s2)
            cache.update([s1, s2], L)
        w1, w2 = self.mix_weights()
        o = (w1 * o1 + w2 * o2).astype(u.dtype)
        if "o_norm" in self:
            o = self.o_norm(o)
        return _output(self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1)), shape, residual)


MIXERS = {"attention": llama.Attention, "mamba": Mamba, "mamba2": Mamba2, "dsla": DSLA}


class HybridLayer(nn.Module):
    """A Llama decoder layer whose token mixer is attention, Mamba, Mamba2 or DSLA.

    A convertible attention layer also holds a DSLA mixer (same MLP and norms) and runs as DSLA
    whenever it is handed a `StateCache` instead of a `KVCache` (`Model.make_cache`), so each
    sequence picks its own conversion with both weight sets loaded once.
    """

    def __init__(self, args: ModelArgs, kind: str, convertible: bool = False):
        super().__init__()
        self.kind = kind
        setattr(self, MIXER_NAME[kind], MIXERS[kind](args))
        if convertible:
            self.dsla = DSLA(args)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self[MIXER_NAME[self.kind]]

    def __call__(self, x: mx.array, mask: TreeMask | None = None, cache=None) -> mx.array:
        """As `llama.DecoderLayer`: norms and residual adds go to the mixer's and MLP's projections."""
        kind = "dsla" if self.kind == "attention" and isinstance(cache, StateCache) else self.kind
        h = self[MIXER_NAME[kind]](x, mask, cache, norm=self.input_layernorm, residual=x)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        # Replaces the Llama layers built above (their weights were never materialized).
        self.model.layers = [HybridLayer(args, kind, i in args.dsla_order) for i, kind in enumerate(args.mixer_types)]

    def make_cache(self, dsla_layers=()) -> list:
        """Caches for one sequence; the convertible layers in dsla_layers run as DSLA for it."""
        dsla_layers = set(dsla_layers)
        if not dsla_layers <= set(self.args.dsla_order):
            raise ValueError(f"layers {sorted(dsla_layers - set(self.args.dsla_order))} have no DSLA weights")
        return [
            KVCache(self.args.sliding_window) if kind == "attention" and i not in dsla_layers else StateCache()
            for i, kind in enumerate(self.args.mixer_types)
        ]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Fuse MambaInLlama's separate Mamba input projections, then the Llama fusions."""
        for i, kind in enumerate(self.args.mixer_types):
            prefix = f"model.layers.{i}.mamba."
            if kind == "mamba" and f"{prefix}in_proj_x.weight" in weights:
                for param in ("weight", "scales", "biases"):
                    names = [f"{prefix}{p}.{param}" for p in MAMBA_IN_PROJ]
                    if all(n in weights for n in names):
                        weights[f"{prefix}in_proj.{param}"] = mx.concatenate([weights.pop(n) for n in names])
        return super().sanitize(weights)


# MambaInLlama's Mamba input projections, in the order `Mamba.in_proj` concatenates them.
MAMBA_IN_PROJ = ("in_proj_x", "in_proj_z", "B_proj", "C_proj", "dt_proj_down")
# ssm_cfg options of the MambaInLlama layers whose other values change the computation, at the
# values the released models use (and the only ones implemented here).
MAMBA_FIXED = {"repeat_kv_before_conv": True, "proj_x_bias": False, "proj_z_bias": False, "out_proj_bias": False}
MAMBA2_FIXED = {
    "repeat_kv_before_conv": False,
    "rmsnorm": True,
    "norm_before_gate": False,
    "D_has_hdim": False,
    "bias": False,
    "d_ssm": None,
    "dt_limit": (0.0, float("inf")),
}


def config_from_mamba_in_llama(config: dict, mamba_config: dict, weight_names) -> dict:
    """Our hybrid config from a MambaInLlama release: its Llama config.json plus mamba_config.json.

    Which layers are Mamba and which Mamba2 is read off the tensor names (Mamba2 has one fused
    in_proj), since mamba_config.json has the same fields for both.
    """
    ssm = dict(mamba_config.get("ssm_cfg") or {})
    attn = set(mamba_config.get("attn_layers") or [])
    n_layers = mamba_config.get("n_layer", config.get("num_hidden_layers"))
    mamba2 = any(".mamba.in_proj.weight" in k for k in weight_names)
    for key, value in (MAMBA2_FIXED if mamba2 else MAMBA_FIXED).items():
        got = ssm.get(key, value)
        if (tuple(got) if isinstance(got, list) else got) != value:
            raise ValueError(f"mamba_config.json: ssm_cfg {key}={got} is not supported (only {value})")
    d_model = mamba_config.get("d_model", config["hidden_size"])
    d_inner = mamba_config.get("d_inner") or ssm.get("expand", 2) * d_model
    d_state = ssm.get("d_state", 128 if mamba2 else 16)
    if mamba2 and ssm.get("ngroups", d_inner // d_state) * d_state != d_inner:
        raise ValueError(f"mamba_config.json: ngroups * d_state must equal d_inner ({d_inner})")
    dt_rank = ssm.get("dt_rank", "auto")
    return dict(
        config,
        model_type="llama_hybrid",
        base_model_type=config.get("model_type"),
        mixer_types=["attention" if i in attn else ("mamba2" if mamba2 else "mamba") for i in range(n_layers)],
        d_state=d_state,
        d_conv=ssm.get("d_conv", 4),
        d_inner=d_inner,
        d_xb=mamba_config.get("d_xb"),
        dt_rank=None if dt_rank == "auto" else dt_rank,
        conv_bias=ssm.get("conv_bias", True),
    )
