#!/usr/bin/env python
"""Selective-scan kernel against the memory-bandwidth floor.

A decode step (L = 1) reads each state once and writes it once, and does a few flops per
element, so its floor is bytes moved / the device's achievable bandwidth. This script measures
that bandwidth (a large elementwise add, bytes read + written over the best time), times
`selective_scan` for realistic state sizes (Mamba-1 style: N = 16, A per state row; Mamba-2
style: N = 64/128, one A per channel) and reports time / floor. It also times multi-step calls
(L = 4 and 8, two saved states: draft verification) against the L = 1 step.

Each timed evaluation runs a batch of independent calls that cycle through a pool of distinct
states of >= 256 MB in total, so that states are read from device memory and not from a
last-level cache that held them from the previous call. Graphs are built before the timer
starts; the time is mx.eval of the batch over the number of calls, median of --reps.

On a GPU with a kernel this times the kernel; elsewhere `selective_scan` is the pure-MLX
reference, and the script says so (and skips the states above --max-state-mb, default 64 there).

    python -m benchmarks.scan_bandwidth
    python -m benchmarks.scan_bandwidth --reps 5 --max-state-mb 16

Writes benchmarks/results/scan-bandwidth-<device>.json and prints its table.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from statistics import median

import mlx.core as mx

from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.scan import selective_scan
from benchmarks.index import render_file
from benchmarks.run import device_description, slugify

RESULTS = Path(__file__).resolve().parent / "results"
MB = 2**20
POOL_BYTES = 256 * MB

# (batch, channels, N, NA): Mamba-1 (d_inner 2048/4096, N 16, A per row) and Mamba-2 (N 64/128,
# A per head, i.e. per channel here), state from 1 MB to 256 MB.
DECODE_SHAPES = [
    (1, 2048, 128, 1),
    (1, 4096, 128, 1),
    (8, 4096, 16, 16),
    (8, 4096, 128, 1),
    (64, 4096, 16, 16),
    (64, 2048, 64, 1),
    (64, 4096, 64, 1),
    (64, 4096, 128, 1),
    (64, 4096, 128, 128),
    (128, 4096, 128, 1),
]
MULTI_STEP_SHAPES = [(1, 4096, 128, 1), (8, 4096, 128, 1), (64, 4096, 128, 1)]


def measure_bandwidth(gb: float, reps: int) -> dict:
    """Best (read + written bytes) / time of `a + 1` over a float32 array of `gb` GB."""
    a = mx.random.uniform(shape=(int(gb * 2**30) // 4,))
    mx.eval(a)
    mx.eval(a + 1)
    times = []
    for _ in range(reps):
        b = a + 1
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(b)
        times.append(time.perf_counter() - t0)
        del b
    moved = 2 * a.nbytes
    return {"op": "a + 1, float32", "bytes_moved": moved, "best_s": min(times), "bytes_per_s": moved / min(times)}


def make_inputs(batch, L, channels, n, na, dtype, pool):
    """Step inputs shared by all calls (small) and `pool` distinct float32 states."""
    k = mx.random.split(mx.random.key(0), 6)
    x = mx.random.normal((batch, L, channels), key=k[0]).astype(dtype)
    dt = (0.001 + 0.1 * mx.random.uniform(shape=(batch, L, channels), key=k[1])).astype(dtype)
    A = -mx.exp(mx.random.uniform(shape=(na, channels), key=k[2]))
    B = mx.random.normal((batch, L, 1, n), key=k[3]).astype(dtype)
    C = mx.random.normal((batch, L, 1, n), key=k[4]).astype(dtype)
    D = mx.ones((channels,))
    states = [mx.random.normal((batch, n, channels)) for _ in range(pool)]
    mx.eval(x, dt, A, B, C, D, *states)
    return (x, dt, A, B, C, D), states


def bytes_moved(batch, L, channels, n, na, dtype, n_saved) -> int:
    """State read once and written per saved position, plus x, dt, y, B, C, A and D."""
    item = dtype.size
    state = batch * n * channels * 4
    return state * (1 + n_saved) + 3 * batch * L * channels * item + 2 * batch * L * n * item + (na + 1) * channels * 4


def time_calls(batch, L, channels, n, na, dtype, save, reps, op=None) -> float:
    """Median seconds per call of `selective_scan` (see the module docstring), or of `op(state)`."""
    state_bytes = batch * n * channels * 4
    pool = max(1, min(64, math.ceil(POOL_BYTES / state_bytes)))
    calls = max(pool, 8)
    inputs, states = make_inputs(batch, L, channels, n, na, dtype, pool)

    def batch_of_calls():
        if op is not None:
            return [op(states[i % pool]) for i in range(calls)]
        return [selective_scan(*inputs, states[i % pool], save) for i in range(calls)]

    mx.eval(batch_of_calls())  # warm-up: kernel compilation, allocator
    times = []
    for _ in range(reps):
        outs = batch_of_calls()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - t0) / calls)
        del outs
    return median(times)


def main():
    backend = kernel_backend()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per shape (median reported)")
    p.add_argument("--bandwidth-gb", type=float, default=1.0, help="array size for the bandwidth measurement")
    p.add_argument("--dtype", default="float16" if backend else "float32",
                   help="dtype of x, dt, B, C (state is float32); default float16 on a GPU kernel, float32 otherwise")
    p.add_argument("--max-state-mb", type=float, default=math.inf if backend else 64,
                   help="skip shapes with a larger state (default: none on a GPU kernel, 64 otherwise)")
    p.add_argument("--out", type=Path, help="JSON path (default results/scan-bandwidth-<device>.json)")
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    device = device_description()
    timed = f"{backend.upper()} kernel" if backend else "pure-MLX reference (no GPU kernel on this device)"
    print(f"device: {device['default_label']}; timing selective_scan = {timed}; inputs {args.dtype}\n")

    bw = measure_bandwidth(args.bandwidth_gb, max(args.reps // 2, 5))
    print(f"achievable bandwidth: {bw['bytes_per_s'] / 1e9:.0f} GB/s ({bw['op']}, {bw['bytes_moved'] / 1e9:.2f} GB moved)\n")

    rows = []
    for batch, channels, n, na in DECODE_SHAPES:
        if batch * n * channels * 4 > args.max_state_mb * MB:
            continue
        # The same harness on MLX's own memory-bound op over the state: what a call costs this
        # runtime at this size, launch overhead included.
        t_op = time_calls(batch, 1, channels, n, na, dtype, None, args.reps, op=lambda h: h * 0.5)
        for L in (1, 4, 8) if (batch, channels, n, na) in MULTI_STEP_SHAPES else (1,):
            save = [L - 1] if L == 1 else [L // 2, L - 1]
            t = time_calls(batch, L, channels, n, na, dtype, save, args.reps)
            moved = bytes_moved(batch, L, channels, n, na, dtype, len(save))
            floor = moved / bw["bytes_per_s"]
            rows.append(dict(batch=batch, channels=channels, n=n, na=na, L=L, save=save,
                             state_mb=batch * n * channels * 4 / MB, bytes_moved=moved,
                             time_s=t, floor_s=floor, ratio=t / floor, mlx_state_op_s=t_op))
    for r in rows:
        base = next(q for q in rows if q["L"] == 1 and all(q[k] == r[k] for k in ("batch", "channels", "n", "na")))
        r["vs_L1"] = r["time_s"] / base["time_s"]

    out = args.out or RESULTS / f"scan-bandwidth-{slugify(device['name'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"), device=device, mlx=mx.__version__,
        timed=timed, input_dtype=args.dtype, reps=args.reps, bandwidth=bw, rows=rows,
    ), indent=1) + "\n")
    print(render_file(out))


if __name__ == "__main__":
    main()
