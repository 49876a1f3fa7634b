#!/usr/bin/env python
"""Device time of the verification pass's own kernels at SmolLM2-135M's shapes: tree attention
(25 and 17 nodes over 256-1024 cached rows) and the projections of a pass's rows (the row kernel
against MLX's batched matrix-vector kernel, the path before it, and cuBLAS), each the median of
the kernel durations CUPTI records (PyTorch's profiler) over 40 calls, in microseconds.

--sweep also times the tree-attention kernel under each rows/simdgroups setting, and the row
kernel under each weight rows/simdgroups setting; --heads H,KV,D times tree attention at another
model's heads (32,8,128: Llama-3-8B's). Run it under another checkout's package (PYTHONPATH) for
an A/B of the kernels with one signature. Prints JSON.

    python3 -m benchmarks.gpu.kernel_bench [--sweep] [--heads H,KV,D]
"""

import argparse
import json
import sys
from collections import defaultdict
from statistics import median

import torch  # first: its CUDA libraries load before MLX's
from torch.profiler import ProfilerActivity, profile

import mlx.core as mx  # noqa: E402

from benchmarks.gpu.kernel_profile import device_events  # noqa: E402

from mlx_hybrid import tree_attention as ta  # noqa: E402
from mlx_hybrid.models import linear  # noqa: E402
from mlx_hybrid.tree_mask import tree_depths  # noqa: E402

CALLS = 40


def device_us(fn) -> dict:
    """Median device time per kernel name of fn's launches, over CALLS calls (after 5 to warm)."""
    for _ in range(5):
        mx.eval(fn())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            mx.eval(fn())
    times = defaultdict(list)
    for e in device_events(prof):
        times[e["name"][:60]].append(e["dur"])
    return {name: round(median(d), 2) for name, d in times.items() if len(d) >= CALLS}


def tree_case(T: int, P: int, H=9, KV=3, D=64, dtype=mx.bfloat16):
    k = mx.random.normal((1, KV, P + 64, D)).astype(dtype)
    v = mx.random.normal((1, KV, P + 64, D)).astype(dtype)
    qk = mx.random.normal((T, H + KV, 1, D)).astype(dtype).transpose(2, 1, 0, 3)  # strided, as out of the projection
    q, tk = qk[:, :H], qk[:, H:]
    tv = mx.random.normal((T, KV, 1, D)).astype(dtype).transpose(2, 1, 0, 3)
    tree = [-1] + [(t - 1) // 3 for t in range(1, T)]
    parents = mx.array(tree, mx.int32)
    positions = mx.arange(P, P + T, dtype=mx.int32)
    freqs = 100000.0 ** (mx.arange(0, D, 2) / D)
    node_rows = mx.array(P + tree_depths(tree))
    mx.eval(k, v, q, tk, tv, parents, node_rows, positions, freqs)
    args = (q, k, v, tk, tv, parents, node_rows, positions, freqs)
    return lambda: ta.tree_attention(*args, scale=D**-0.5, backend="cuda")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size of the tree-attention cases")
    args = p.parse_args(argv)
    heads = dict(zip(("H", "KV", "D"), map(int, args.heads.split(","))))
    mx.random.seed(0)
    out = {"mlx": mx.__version__, "device": torch.cuda.get_device_name(0), "heads": args.heads}
    for T, P in ((25, 256), (25, 512), (25, 1024), (17, 256), (64, 256)):
        fn = tree_case(T, P, **heads)
        out[f"tree_attention_T{T}_P{P}"] = device_us(fn)
        if args.sweep and hasattr(ta, "WARPS") and P == 256:
            for rows in (2, 4, 8):
                for warps in (4, 8):
                    ta.ROWS, ta.WARPS = rows, warps
                    out[f"tree_attention_T{T}_P{P}_B{rows}_NW{warps}"] = device_us(tree_case(T, P, **heads))
            ta.ROWS, ta.WARPS = 4, 8
    for n_in, n_out, what in ((576, 960, "qkv"), (576, 576, "o"), (576, 3072, "gate_up"), (1536, 576, "down")):
        w = (mx.random.normal((n_out, n_in)) * 0.04).astype(mx.bfloat16)
        for M in (17, 25, 64):
            x = mx.random.normal((M, n_in)).astype(mx.bfloat16)
            mx.eval(w, x)
            case = f"{what}_M{M}"
            out[f"{case}_gemv_batched"] = device_us(lambda: (w @ x[:, :, None])[..., 0])
            out[f"{case}_cublas"] = device_us(lambda: x @ w.T)
            if hasattr(linear, "row_matmul"):
                out[f"{case}_row_kernel"] = device_us(lambda: linear.row_matmul(x, w, backend="cuda"))
                if args.sweep:
                    saved = linear.COLUMNS, linear.WARPS
                    for linear.COLUMNS in (1, 2, 4):
                        for linear.WARPS in (4, 8):
                            out[f"{case}_row_kernel_C{linear.COLUMNS}_NW{linear.WARPS}"] = device_us(lambda: linear.row_matmul(x, w, backend="cuda"))
                    linear.COLUMNS, linear.WARPS = saved
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
