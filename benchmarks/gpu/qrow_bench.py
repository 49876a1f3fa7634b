#!/usr/bin/env python
"""Time of a few rows' product with 4-bit weights at the Llama-3.2-1B, Llama-3.2-3B and
Llama-3-8B projection shapes (bfloat16 rows, groups of 64): the quantized row kernel
(`models.qlinear.qrow_matmul`) and MLX's `quantized_matmul` over T rows, against MLX's product
over one row (a decode step's, qmv), in microseconds a call. Each call reads another copy of the
weight (256 MB of copies, or 32, more than the GPU's L2 cache), 32 calls are evaluated at once,
and the median over 7 repeats is kept. Also: the kernel's largest difference from its reference
and from one-row products of the same rows, in units of the largest output (qlinear's exactness
policy). Prints JSON, and writes it to --out.

    python3 -m benchmarks.gpu.qrow_bench --out $OUT/qrow-bench.json
"""

import argparse
import json
import time
from statistics import median

import mlx.core as mx

from mlx_hybrid.models import qlinear

# (hidden, intermediate, query heads, key-value heads, head dim)
MODELS = {"llama-3.2-1b": (2048, 8192, 32, 8, 64), "llama-3.2-3b": (3072, 8192, 24, 8, 128), "llama-3-8b": (4096, 14336, 32, 8, 128)}
ROWS = (8, 17, 34, 64)
CALLS, REPEATS, GROUP, BITS = 32, 7, 64, 4


def projections(hidden: int, inter: int, heads: int, kv: int, dim: int) -> dict:
    """A decoder layer's projections as (out, in), the fused layout the runtime loads."""
    return {"qkv_proj": ((heads + 2 * kv) * dim, hidden), "o_proj": (hidden, heads * dim), "gate_up_proj": (2 * inter, hidden),
            "down_proj": (hidden, inter)}


def us_a_call(fn, weights: list, xs: list) -> float:
    """Median over REPEATS of CALLS calls evaluated together, each on the next weight copy."""
    mx.eval([fn(xs[i % len(xs)], *weights[i % len(weights)]) for i in range(CALLS)])  # builds, warms
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        mx.eval([fn(xs[i % len(xs)], *weights[i % len(weights)]) for i in range(CALLS)])
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return round(median(times), 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    results = {"device": mx.device_info().get("device_name", "gpu"), "mlx": mx.__version__, "bits": BITS, "group_size": GROUP,
               "dtype": "bfloat16", "rows": list(ROWS), "shapes": {}}
    kernel = lambda x, w, s, b: qlinear.qrow_matmul(x, w, s, b, group_size=GROUP, bits=BITS, backend="cuda")  # noqa: E731
    mlx = lambda x, w, s, b: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=GROUP, bits=BITS)  # noqa: E731
    for model, dims in MODELS.items():
        for name, (N, K) in projections(*dims).items():
            copies = min(CALLS, max(2, -(-(256 << 20) // (N * K * BITS // 8))))
            weights = [mx.quantize(mx.random.normal((N, K)).astype(mx.bfloat16) * 0.02, GROUP, BITS) for _ in range(copies)]
            mx.eval(weights)
            row = {"decode_step_qmv_us": us_a_call(mlx, weights, [mx.random.normal((1, K)).astype(mx.bfloat16)])}
            for T in ROWS:
                xs = [mx.random.normal((T, K)).astype(mx.bfloat16) for _ in range(4)]
                mx.eval(xs)
                w, s, b = weights[0]
                got = kernel(xs[0], w, s, b)
                scale = mx.abs(got.astype(mx.float32)).max()
                ref = qlinear.qrow_matmul_ref(xs[0], w, s, b, GROUP, BITS)
                step = mx.concatenate([mlx(xs[0][t : t + 1], w, s, b) for t in range(T)])
                row[f"T{T}"] = {
                    "kernel_us": us_a_call(kernel, weights, xs),
                    "quantized_matmul_us": us_a_call(mlx, weights, xs),
                    "kernel_vs_reference": float(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max() / scale),
                    "kernel_vs_decode_step": float(mx.abs(got.astype(mx.float32) - step.astype(mx.float32)).max() / scale),
                    "kernel_equals_decode_step": bool(mx.array_equal(got, step).item()),
                }
            results["shapes"][f"{model} {name} {N}x{K}"] = row
            print(f"{model} {name} {N}x{K}: {json.dumps(row)}", flush=True)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
