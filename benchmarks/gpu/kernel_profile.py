#!/usr/bin/env python
"""The device's side of a plain decode step and of each method's greedy pass: every CUDA kernel
the process runs, recorded by PyTorch's profiler (CUPTI sees MLX's kernels as well as torch's),
per step or pass.

`pass_cost.py --split` shows the host's side; this shows whether the device keeps up: per loop,
the wall time a step or pass takes as the loops run them (host and device overlapped), the
device's busy time (the union of kernel intervals) and the sum of kernel times in it, the kernels
launched, and the kernels that take the most time. A loop whose busy time is close to its wall
time is bound by the device.

MODEL: a model directory with its medusa/ and/or redrafter/, or a new directory for random
weights in `--shape` (default SmolLM2-135M's) with untrained heads (`speculative.py`'s).
`--rows` and `--tree-limit` set which projections take the row kernel and which trees the
tree-attention kernel (`linear.ROWS`, `tree_attention.LIMIT`), as a tuning profile would; by
default both kernels take everything they fit. Prints JSON.

    python -m benchmarks.gpu.kernel_profile OUTDIR/llama-target [--dtype bfloat16] [--tree-size 24] [--beam 4x5] [--heads-dtype bfloat16] [--top 12] [--sequence]
    python -m benchmarks.gpu.kernel_profile MODELDIR --shape llama-3-8b --dtype bfloat16 --beam 4x5 --rows 0 --tree-limit 4
"""

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch  # first: its CUDA libraries load before MLX's
from torch.profiler import ProfilerActivity, profile

import mlx.core as mx  # noqa: E402

BENCH = Path(__file__).resolve().parents[1]
from benchmarks.run import SYNTHETIC, parse_beam  # noqa: E402
from benchmarks.speculative import synthetic_target  # noqa: E402

from mlx_hybrid import tree_attention  # noqa: E402
from mlx_hybrid.cache import trim_cache  # noqa: E402
from mlx_hybrid.decode import generate_step, generation_stream, prefill  # noqa: E402
from mlx_hybrid.loader import load_model  # noqa: E402
from mlx_hybrid.models import linear  # noqa: E402
from mlx_hybrid.profiles import Settings  # noqa: E402
from mlx_hybrid.speculative.proposer import load_proposer  # noqa: E402
from mlx_hybrid.speculative.steps import _greedy_passes  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(prof) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]


def summarize(events: list[dict], items: int, wall_ms: float, top: int, sequence: bool = False) -> dict:
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    busy, end = 0.0, float("-inf")
    for s, t in spans:  # the union of the intervals
        if t > end:
            busy += t - max(s, end)
            end = t
    names = defaultdict(lambda: [0, 0.0])
    for e in events:
        names[e["name"][:90]][0] += 1
        names[e["name"][:90]][1] += e["dur"]
    ranked = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "wall_ms": round(wall_ms, 3),
        "busy_ms": round(busy / 1000 / items, 3),
        "kernel_ms": round(sum(e["dur"] for e in events) / 1000 / items, 3),
        "kernels": round(len(events) / items, 1),
        "top": [{"name": n, "per_item": round(c / items, 2), "us": round(d / items, 1)} for n, (c, d) in ranked],
    } | ({"sequence": sequence_of(events, len(events) // items)} if sequence else {})


def sequence_of(events: list[dict], n: int) -> list[str]:
    """The last n kernels in launch order (about one step or pass), each as name [grid] [block]:
    where a copy sits in the sequence says which op made it."""
    last = sorted(events, key=lambda e: e["ts"])[-n:]
    return [f"{e['name'][:70]} {e.get('args', {}).get('grid', '')} {e.get('args', {}).get('block', '')}" for e in last]


def profiled(make_steps, items: int, top: int, sequence: bool = False) -> dict:
    steps = make_steps()
    for _ in range(10):  # warm: kernels compiled, traces made
        next(steps)
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: no device rows
    with profile(activities=[activity]) as prof:
        next(steps)
        t = time.perf_counter()
        for _ in range(items):
            next(steps)
        wall = (time.perf_counter() - t) / items * 1000
    steps.close()
    return summarize(device_events(prof), items + 1, wall, top, sequence)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--dtype", default=None, help="cast the target (e.g. bfloat16); default: as stored")
    p.add_argument("--heads-dtype", default=None, help="the heads' and drafter's dtype; default: the target's")
    p.add_argument("--tree-size", type=int, default=0, help="Medusa tree size (default: its own tree)")
    p.add_argument("--beam", default="", help="ReDrafter beams WxL[,WxL...] (default: its own)")
    p.add_argument("--shape", choices=sorted(SYNTHETIC), default="smollm2-135m", help="a new random target's shape")
    p.add_argument("--rows", type=int, default=None, help="the most rows a projection gives the row kernel (0: MLX's matmul)")
    p.add_argument("--tree-limit", type=int, default=None, help="the most nodes the tree-attention kernel takes (0: MLX's attention)")
    p.add_argument("--items", type=int, default=30)
    p.add_argument("--top", type=int, default=12, help="kernels listed per loop, most time first")
    p.add_argument("--sequence", action="store_true", help="also list one step's or pass's kernels in launch order")
    args = p.parse_args(argv)

    d = synthetic_target(args.model, args.shape)
    if args.rows is not None:
        linear.ROWS = args.rows
    tree_attention.LIMIT = args.tree_limit
    model = load_model(d, args.dtype)
    V = model.args.vocab_size
    variants = {}
    if (d / "medusa").is_dir():
        variants["medusa"] = ("medusa", Settings(tree_size=args.tree_size) if args.tree_size else None)
    if (d / "redrafter").is_dir():
        for b in args.beam.split(",") if args.beam else [""]:
            w, l = parse_beam(b) if b else (None, None)
            variants[f"redrafter{' ' + b if b else ''}"] = ("redrafter", Settings(w, l) if b else None)
    out = {"model": str(d), "dtype": str(model.model.embed_tokens.weight.dtype), "mlx": mx.__version__, "torch": torch.__version__,
           "rows": linear.ROWS, "tree_limit": args.tree_limit, "command": "python -m benchmarks.gpu.kernel_profile " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d")}
    with mx.stream(generation_stream):
        cache = model.make_cache()
        prefill(model, mx.random.randint(0, V, (256,), key=mx.random.key(0)), cache)
        hidden = model(mx.array([[5]]), cache, return_hidden=True)[1][0, -1]
        for c in cache:
            c.trim(1)
        mx.eval(hidden, [c.state for c in cache])
        argmax = lambda x: mx.argmax(x, -1)  # noqa: E731
        out["decode"] = profiled(lambda: generate_step(mx.array([5]), model, cache, argmax, max_tokens=10**6), args.items, args.top, args.sequence)
        trim_cache(cache, cache[0].offset - 256)
        for name, (method, settings) in variants.items():
            proposer = load_proposer(method, model, d, settings=settings, heads_dtype=args.heads_dtype)
            out[name] = profiled(lambda: _greedy_passes(model, proposer, cache, mx.array([7], mx.int32), hidden), args.items, args.top, args.sequence)
            trim_cache(cache, cache[0].offset - 256)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
