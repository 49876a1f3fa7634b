"""`hybrid doctor`: this device, and every GPU kernel once against its pure-MLX reference.

What a user runs first, and pastes into a bug report. Each kernel runs once at a small shape in
float32, through the function that launches it in the runtime, and is compared with its reference
on the same launch (`kernels.references_only`), the reference computed on the CPU in exact float32
(MLX's CUDA backend multiplies float32 in TF32). Each reference is also compared with the same
computation in float64 numpy, written out here independently, so on a machine without a kernel
backend (a CPU) the doctor checks the references, which are what runs there and what a failed
kernel falls back to.
"""

import os
import platform
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_hybrid import dsla_step, kernels, scan, tree_attention
from mlx_hybrid.models import linear, qlinear
from mlx_hybrid.rope import rope_frequencies
from mlx_hybrid.speculative import accept, topk, tree
from mlx_hybrid.tree_mask import tree_depths


@dataclass
class Case:
    """One launch of a kernel: `run(backend)` launches it (its outputs), `expect()` gives the
    outputs in float64 numpy; `tolerance` bounds |difference| / max(1, max |expected|)."""

    kernel: str
    run: Callable[[str], list]
    expect: Callable[[], list]
    tolerance: float = 1e-4


@dataclass
class Result:
    kernel: str
    kernel_error: float | None  # max |kernel - reference|, None where no kernel runs
    reference_error: float  # max |reference - float64|
    ms: float | None  # a launch, averaged
    ok: bool
    problem: str = ""


def _f32(*arrays):
    """float32 copies (what the kernel reads) and their values in float64 (what numpy computes on)."""
    return [mx.array(a.astype(np.float32)) for a in arrays], [a.astype(np.float32).astype(np.float64) for a in arrays]


def _silu(a):
    return a / (1 + np.exp(-a))


def _scan_case(rng) -> Case:
    b, L, d, g, n, save = 2, 5, 72, 2, 16, [2, 4]  # 72 channels: a partial threadgroup
    arrays, (x, dt, A, B, C, D, h) = _f32(rng.standard_normal((b, L, d)), rng.uniform(0.001, 0.1, (b, L, d)),
                                          -np.exp(rng.uniform(0, 2.5, (n, d))), rng.standard_normal((b, L, g, n)),
                                          rng.standard_normal((b, L, g, n)), rng.standard_normal(d), rng.standard_normal((b, n, d)))

    def expect():
        Bc, Cc = (np.repeat(m, d // g, axis=2).transpose(0, 1, 3, 2) for m in (B, C))  # (b, L, n, d)
        state, ys, saved = h, [], []
        for t in range(L):
            state = np.exp(dt[:, t, None] * A) * state + (dt[:, t] * x[:, t])[:, None] * Bc[:, t]
            ys.append((Cc[:, t] * state).sum(axis=1) + D * x[:, t])
            saved += [state] if t in save else []
        return [np.stack(ys, axis=1), np.stack(saved, axis=1)]

    return Case("selective_scan", lambda backend: scan.selective_scan_kernel(*arrays, save=save, backend=backend), expect)


def _step_case(rng) -> Case:
    """A Mamba2 mixer over a candidate tree: 4 heads of 16 in 2 KV groups, a conv of width 4."""
    b, n, d, d_xb, K, parents = 1, 16, 64, 32, 4, [-1, 0, 0, 1, 3, -1]
    heads, r, width, T = d // n, d // d_xb, d + 2 * d_xb, len(parents)
    P = d + width + heads  # z, then [x, B, C], then dt
    arrays, (u, window, w, bias, dt_bias, A_log, D, h) = _f32(
        rng.standard_normal((b, T, P)) * 0.5, rng.standard_normal((b, K - 1, width)) * 0.5, rng.standard_normal((width, K)) * 0.5,
        rng.standard_normal(width) * 0.1, rng.standard_normal(heads) * 0.3, rng.standard_normal(heads) * 0.3,
        rng.standard_normal(heads), rng.standard_normal((b, n, d)))
    u_, window_, w_, bias_, dt_bias_, A_log_, D_, h_ = arrays

    def launch(backend):
        return scan.ssm_step(u_, u_[..., -heads:], window_, w_, bias_, dt_bias_, A_log_, D_, h_, mx.array(parents, mx.int32),
                             mamba2=True, d_xb=d_xb, offsets=(d, 0, 0, 0), backend=backend)

    def expect():
        rows = np.concatenate([window, u[..., d : d + width]], axis=1)  # the cached conv inputs, then the nodes'
        idx = []
        for t in range(T):  # each node's K conv inputs, oldest first: the cache, its ancestors, itself
            chain, p = [K - 1 + t], parents[t]
            while len(chain) < K:
                chain.append(K - 1 + p if p >= 0 else chain[-1] - 1 if chain[-1] < K - 1 else K - 2)
                p = parents[p] if p >= 0 else -1
            idx.append(chain[::-1])
        conv = _silu(np.einsum("btkc,ck->btc", rows[:, idx], w) + bias)
        head = np.arange(d) // n
        x = conv[..., (head // r) * n + np.arange(d) % n]  # (b, T, d)
        Bm = conv[..., d_xb + (head // r)[:, None] * n + np.arange(n)]  # (b, T, d, n)
        Cm = conv[..., 2 * d_xb + head[:, None] * n + np.arange(n)]
        raw = u[..., -heads:][..., head] + dt_bias[head]
        dt = np.where(raw > 20, raw, np.log1p(np.exp(raw)))
        decay = np.exp(-np.exp(A_log[head]) * dt)  # (b, T, d)
        states = []
        for t in range(T):
            before = h if parents[t] < 0 else states[parents[t]]
            states.append(decay[:, t, None] * before + (dt[:, t] * x[:, t])[:, None] * Bm[:, t].transpose(0, 2, 1))
        states = np.stack(states, axis=1)  # (b, T, n, d)
        y = (Cm.transpose(0, 1, 3, 2) * states).sum(axis=2) + D[head] * x
        return [y * _silu(u[..., :d]), rows[:, np.array(idx)[:, 1:]], states]

    return Case("ssm_step", launch, expect)


def _dsla_case(rng) -> Case:
    """A DSLA mixer over a candidate tree: 4 heads of 16 over 2 K/V heads, both gated states, the
    softmax mix, the log-gate clamp and the per-head RMSNorm (every option of the kernel but gamma)."""
    b, heads, kv, D, parents = 1, 4, 2, 16, [-1, 0, 0, 1, 3, -1]
    T = len(parents)
    arrays, (qkv, a1, a2, s1, s2, mix, nw, consts) = _f32(
        rng.standard_normal((b, T, (heads + 2 * kv) * D)), rng.standard_normal((b, T, heads * D)) * 3,
        rng.standard_normal((b, T, heads * D)) * 3, rng.standard_normal((b, heads, D, D)), rng.standard_normal((b, heads, D, D)),
        rng.standard_normal(2), rng.uniform(0.5, 1.5, D), np.array([1 / 16, -0.1, 1e-5]))

    def expect():
        q, k, v = np.split(qkv.reshape(b, T, -1, D), [heads, heads + kv], axis=2)
        k, v = (np.repeat(a, heads // kv, axis=2) for a in (k, v))
        w = np.exp(mix) / np.exp(mix).sum()
        states, ys = ([s1], [s2]), []
        for t, p in enumerate(parents):
            o = 0
            for a, held, wi in zip((a1, a2), states, w):
                g = np.maximum(-np.log1p(np.exp(-a[:, t].reshape(b, heads, D))) * consts[0], consts[1])  # logsigmoid
                h = np.exp(g)[..., None] * held[p + 1] + k[:, t, :, :, None] * v[:, t, :, None, :]
                held.append(h)
                o = o + wi * np.einsum("bhi,bhij->bhj", q[:, t] / np.sqrt(D), h)
            ys.append(o / np.sqrt((o * o).mean(axis=-1, keepdims=True) + consts[2]) * nw)
        return [np.stack(ys, axis=1).reshape(b, T, -1), np.stack(states[0][1:], axis=1), np.stack(states[1][1:], axis=1)]

    qkv_, a1_, a2_, s1_, s2_, mix_, nw_, consts_ = arrays
    tree = mx.array(parents, mx.int32)
    return Case("dsla_step", lambda backend: list(dsla_step.dsla_step(qkv_, a1_, a2_, s1_, s2_, mix_, nw_, consts_, tree, kv_heads=kv,
                                                                      backend=backend)), expect)


def _numpy_rope(a, positions, freqs):
    """a (1, heads, T, D) turned by non-traditional RoPE at positions, the angle in float32 as MLX's."""
    half = a.shape[-1] // 2
    angle = (positions[:, None].astype(np.float32) * (np.float32(1) / freqs[None])).astype(np.float64)
    cos, sin = np.cos(angle), np.sin(angle)
    return np.concatenate([a[..., :half] * cos - a[..., half:] * sin, a[..., :half] * sin + a[..., half:] * cos], axis=-1)


def _attention_case(rng) -> Case:
    H, KV, D, prefix, parents = 4, 2, 32, 5, [-1, 0, 0, 1, 3, -1]
    T, R = len(parents), H // KV
    positions = tree_depths(parents) + prefix
    freqs = np.array(rope_frequencies(D, 10000.0, None))
    arrays, (q, k, v, tk, tv) = _f32(rng.standard_normal((1, H, T, D)), rng.standard_normal((1, KV, prefix + 3, D)),
                                     rng.standard_normal((1, KV, prefix + 3, D)), rng.standard_normal((1, KV, T, D)),
                                     rng.standard_normal((1, KV, T, D)))
    extra = [mx.array(parents, mx.int32), mx.array(positions), mx.array(positions), mx.array(freqs)]  # node rows = positions: the cache starts at 0

    def expect():
        qt, kt = _numpy_rope(q, positions, freqs), _numpy_rope(tk, positions, freqs)
        out = np.zeros((1, T, H, D))
        for t in range(T):
            nodes, node = [], t
            while node >= 0:
                nodes, node = nodes + [node], parents[node]
            for head in range(H):
                keys = np.concatenate([k[0, head // R, :prefix], kt[0, head // R, nodes]])
                s = keys @ qt[0, head, t] * D**-0.5
                p = np.exp(s - s.max())
                out[0, t, head] = p / p.sum() @ np.concatenate([v[0, head // R, :prefix], tv[0, head // R, nodes]])
        return [out, kt]

    return Case("tree_attention", lambda backend: tree_attention.tree_attention(*arrays, *extra, scale=D**-0.5, backend=backend), expect)


def _rows_case(rng) -> Case:
    """5 rows through an RMSNorm, a 64 x 40 projection and a residual, in one launch."""
    arrays, (x, w, nw, res) = _f32(rng.standard_normal((5, 64)), rng.standard_normal((40, 64)) / 8, rng.uniform(0.5, 1.5, 64),
                                   rng.standard_normal((5, 40)))
    norm = nn.RMSNorm(64, eps=1e-5)
    norm.weight = arrays[2]

    def expect():
        return [(x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-5) * nw) @ w.T + res]

    return Case("row_matmul", lambda backend: [linear.row_matmul(arrays[0], arrays[1], backend=backend, norm=norm, residual=arrays[3])], expect)


def numpy_dequantize(wq, scales, biases, group_size: int, bits: int) -> np.ndarray:
    """MLX's affine format read in float64: element e of a uint32 word in bits [e*bits, (e+1)*bits),
    each group of group_size elements s * q + b."""
    words = np.array(wq).astype(np.uint64)
    q = (words[..., None] >> (bits * np.arange(32 // bits, dtype=np.uint64))) & ((1 << bits) - 1)
    expand = lambda a: np.repeat(np.array(a.astype(mx.float32), np.float64), group_size, axis=1)  # noqa: E731
    return q.reshape(words.shape[0], -1) * expand(scales) + expand(biases)


def _qrows_case(rng) -> Case:
    """5 rows through a 4-bit 128 x 40 projection in groups of 64."""
    (x,), _ = _f32(rng.standard_normal((5, 128)))
    wq, scales, biases = mx.quantize(mx.array(rng.standard_normal((40, 128)).astype(np.float32)), 64, 4)

    def expect():
        return [np.array(x, np.float64) @ numpy_dequantize(wq, scales, biases, 64, 4).T]

    return Case("qrow_matmul", lambda backend: [qlinear.qrow_matmul(x, wq, scales, biases, group_size=64, bits=4, backend=backend)], expect)


def _numpy_best(x, k):
    """The k largest along the last axis, ties to the lower index, and their indices."""
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, order, axis=-1), order


def _beam_cases(rng) -> list[Case]:
    """A beam-search step's two kernels: 3 beams over 3000 logits (two chunks, the last partial)."""
    B, W, V, k = 1, 3, 3000, 4
    size = topk.TG * topk.PER_THREAD
    chunks = -(-V // size)
    (logits, scores), (x, s) = _f32(rng.standard_normal((B, W, V)) * 3, -np.sort(rng.uniform(0, 5, (B, W)), axis=1))

    def chunk_parts():
        padded = np.concatenate([x, np.full((B, W, chunks * size - V), -np.inf)], axis=-1).reshape(B, W, chunks, size)
        m = padded.max(axis=-1)
        values, at = _numpy_best(padded, k)
        v = at + np.arange(chunks)[:, None] * size
        return [m, np.exp(padded - m[..., None]).sum(axis=-1), np.where(v < V, values, -3.0e38), np.where(v < V, v, topk.PAST_END)]

    def merge():
        total = (s[..., None] + x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).reshape(B, -1)
        score, at = _numpy_best(total, k)
        return [at // V, at % V, score]

    parts = [mx.array(p.astype(np.int32 if i == 3 else np.float32)) for i, p in enumerate(chunk_parts())]
    return [Case("beam_topk_chunks", lambda backend: topk.chunk_parts(logits, k, backend=backend), chunk_parts),
            Case("beam_topk_merge", lambda backend: topk.merge_parts(parts, scores, k, V, backend=backend), merge)]


def _pack_case(rng) -> Case:
    beams = np.array([[7, 3, 5, 2], [7, 3, 5, 9], [7, 1, 4, 4]], np.int32)  # shared prefixes of 3 and 1 tokens
    BW, BL = beams.shape
    TN = BW * (BL - 1) + 1

    def expect():
        nodes, tokens, parents, depths, node_of = {}, [], [], [], np.zeros((BW, BL), np.int64)
        for b in range(BW):
            for depth in range(BL):
                key = tuple(beams[b, : depth + 1])
                if key not in nodes:
                    nodes[key] = len(tokens)
                    tokens.append(beams[b, depth])
                    parents.append(node_of[b, depth - 1] if depth else -1)
                    depths.append(depth)
                node_of[b, depth] = nodes[key]
        count = len(tokens)
        tokens, parents, depths = (np.array(a + [fill] * (TN - count)) for a, fill in ((tokens, 0), (parents, -1), (depths, 0)))
        mask = np.eye(TN, dtype=bool)
        for t in range(TN):
            p = parents[t]
            while p >= 0:
                mask[t, p], p = True, parents[p]
        return [tokens, parents, depths, mask, node_of, np.array(count)]

    def launch(backend):
        p = tree.pack_beams_kernel(mx.array(beams), backend=backend)
        return [p.tokens, p.tree.parents, p.tree.depths, p.tree.mask, p.node_of, p.count]

    return Case("pack_beams", launch, expect, tolerance=0)


def _accept_case(rng) -> Case:
    """A 7-node tree whose rows accept 0 to 2 drafts; the longest row, the first on ties, wins."""
    tokens = np.array([5, 8, 9, 3, 6, 2, 4], np.int32)
    rows = np.array([[0, 1, 3, -1], [0, 1, 4, 6], [0, 2, 5, -1]], np.int32)
    best = np.array([8, 3, 0, 1, 2, 7, 7], np.int32)  # accepts 0 -> 1 -> 3, then token 1

    def expect():
        W, found = rows.shape[1], []
        for row in rows:
            n = 0
            while n + 1 < W and row[n + 1] >= 0 and tokens[row[n + 1]] == best[row[n]]:
                n += 1
            found.append(n)
        r = int(np.argmax(found))
        n, row = found[r], rows[r]
        return [np.concatenate([[n, best[row[n]]], row, tokens[np.maximum(row, 0)]]), np.array(row[n])]

    return Case("greedy_accept", lambda backend: accept.greedy_rows_kernel(mx.array(tokens), mx.array(rows), mx.array(best), backend=backend),
                expect, tolerance=0)


def cases(seed: int = 0) -> list[Case]:
    """One small launch of each kernel, in the order a speculative step runs them."""
    rng = np.random.default_rng(seed)
    return [_scan_case(rng), _step_case(rng), _dsla_case(rng), _attention_case(rng), _rows_case(rng), _qrows_case(rng), *_beam_cases(rng), _pack_case(rng),
            _accept_case(rng)]


def _numpy(a) -> np.ndarray:
    return np.array(a.astype(mx.float32) if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating) else a)


def _difference(got: list, want: list) -> float:
    """max |got - want| / max(1, max |want|) over the outputs; inf where integer outputs or shapes
    differ at all."""
    worst = 0.0
    for g, w in zip(got, want):
        g, w = _numpy(g), _numpy(w)
        if g.shape != w.shape or (not np.issubdtype(w.dtype, np.floating) and not np.array_equal(g, w)):
            return float("inf")
        if g.size and np.issubdtype(w.dtype, np.floating):
            worst = max(worst, float(np.abs(g.astype(np.float64) - w).max()) / max(1.0, float(np.abs(w).max())))
    return worst


def _reference(case: Case, backend: str) -> list:
    with kernels.references_only(), mx.stream(mx.cpu):
        out = case.run(backend)
        mx.eval(out)
        return out


def check(case: Case, backend: str | None, repeats: int = 10) -> Result:
    """The case's reference against float64 numpy; on a kernel backend, also its kernel against
    the reference, and the kernel's time a launch."""
    reference = _reference(case, backend or "metal")
    reference_error = _difference(reference, case.expect())
    ok = reference_error <= case.tolerance
    problem = "" if ok else f"reference off by {reference_error:.2g}"
    if backend is None:
        return Result(case.kernel, None, reference_error, None, ok, problem)
    try:
        got = case.run(backend)
        mx.eval(got)
        start = time.perf_counter()
        for _ in range(repeats):
            mx.eval(case.run(backend))
        ms = (time.perf_counter() - start) / repeats * 1e3
    except Exception as e:  # the fallback catches the kernel's own errors; anything else is reported too
        return Result(case.kernel, None, reference_error, None, False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if case.kernel in kernels.failures():
        return Result(case.kernel, None, reference_error, None, False, kernels.failures()[case.kernel])
    kernel_error = _difference(got, reference)
    if kernel_error > case.tolerance:
        ok, problem = False, (problem + "; " if problem else "") + f"kernel off by {kernel_error:.2g}"
    return Result(case.kernel, kernel_error, reference_error, ms, ok, problem)


def simd_width(backend: str) -> int:
    """The threads a simdgroup (warp) of this GPU, which the kernels assume to be 32."""
    if backend == "metal":
        kernel = mx.fast.metal_kernel(name="simd_width", input_names=["x"], output_names=["out"],
                                      source="if (thread_position_in_grid.x == 0) { out[0] = threads_per_simdgroup + x[0]; }")
    else:
        kernel = mx.fast.cuda_kernel(name="simd_width", input_names=["x"], output_names=["out"],
                                     source="if (threadIdx.x == 0) { out[0] = warpSize + x[0]; }")
    (out,) = kernel(inputs=[mx.zeros((1,), mx.int32)], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.int32])
    return int(out.item())


def device() -> dict[str, str]:
    """What to tell about this machine: device, kernel backend, MLX version, memory, simd width."""
    backend = kernels.kernel_backend()
    info = mx.device_info()
    memory = info.get("memory_size") or info.get("total_memory")
    if memory is None and hasattr(os, "sysconf"):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "device": f"{mx.default_device()}: {info.get('device_name', platform.processor())} ({info.get('architecture', platform.machine())})",
        "backend": backend or "none: every kernel's pure-MLX reference runs instead",
        "MLX": mx.__version__,
        "memory": f"{memory / 2**30:.1f} GiB" if memory else "unknown",
        "simdgroup width": _simd_width_or_error(backend) if backend else "n/a",
    }


def _simd_width_or_error(backend: str) -> str:
    try:
        return str(simd_width(backend))
    except Exception as e:  # a GPU that cannot run the simplest kernel: say why
        return f"unknown ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
