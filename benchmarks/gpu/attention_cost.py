#!/usr/bin/env python
"""Device time of one layer's attention in a verification pass, on the tree-attention kernel and on
MLX's path (RoPE, the tree mask, the tree's keys and values written into the KV buffer, cuDNN's
attention: `mlx_hybrid.attention`), at a model shape's heads, for trees of T nodes over a cache of
P rows.

Each layer's attention runs alone (one evaluation a layer), as a pass runs layer after layer: the
sum of the kernel durations CUPTI records (PyTorch's profiler) for one call, the median over the
calls (MLX's attention converts the boolean mask in each call, where a compiled pass converts it
once for all layers). For the kernel also its registers a thread and its thread blocks an SM, as
CUPTI reports them, and its largest difference from MLX's output.
Trees: ReDrafter-shaped (4 beams from a root, 4 x 4 + 1 nodes) and binary (the T of a Medusa tree).
Writes JSON (--out) and prints it.

    python -m benchmarks.gpu.attention_cost --shape llama-3-8b [--context 256] [--warps 8|4] [--out FILE.json]
"""

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

import torch  # first: its CUDA libraries load before MLX's
from torch.profiler import ProfilerActivity, profile

import mlx.core as mx  # noqa: E402

from benchmarks.gpu.kernel_profile import device_events  # noqa: E402
from benchmarks.run import SYNTHETIC  # noqa: E402

from mlx_hybrid import tree_attention  # noqa: E402
from mlx_hybrid.attention import _tree_attention  # noqa: E402
from mlx_hybrid.cache import KVCache  # noqa: E402
from mlx_hybrid.kernels import kernel_backend  # noqa: E402
from mlx_hybrid.models.llama import Attention, ModelArgs  # noqa: E402
from mlx_hybrid.tree_mask import TreeMask  # noqa: E402
from mlx_hybrid.tune import binary_tree  # noqa: E402

CALLS = 30
TREES = {
    "beams 4x5": [-1] + [p for b in range(4) for p in (0, 1 + 4 * b, 2 + 4 * b, 3 + 4 * b)],
    "binary 34": binary_tree(34).parents,
}


def layer_cost(layer: Attention, parents: list[int], context: int, kernel: bool, dtype) -> tuple[dict, mx.array]:
    """Per call: the summed kernel durations (us) and, for the kernel, CUPTI's launch figures; and
    the layer's output, to compare the two paths."""
    n, heads, kv, d = len(parents), layer.n_heads, layer.n_kv_heads, layer.head_dim
    cache = KVCache()
    cache.update_and_fetch(*(mx.random.normal((1, kv, context, d), key=mx.random.key(i)).astype(dtype) for i in (0, 1)))
    qkv = mx.random.normal((n, (heads + 2 * kv) * d), key=mx.random.key(2)).astype(dtype)
    # One placed tree for every call: what a pass builds once for all its layers (positions, mask,
    # scatter index) is built in the first call only, as in a pass's first layer.
    tree = TreeMask.from_parents(parents).at(mx.array([context], mx.int32), context)
    tree_attention.LIMIT = None if kernel else 0

    def call():
        out = _tree_attention(layer, qkv, tree, cache)
        cache._held = None  # held for a commit that never comes: the cache stays at P rows
        mx.eval(out, cache.state)
        return out

    for _ in range(3):  # kernels built, buffers grown
        out = call()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
    events = sorted(device_events(prof), key=lambda e: e["ts"])
    per_call = len(events) / CALLS
    sums = [sum(e["dur"] for e in events[round(i * per_call) : round((i + 1) * per_call)]) for i in range(CALLS)]
    row = {"us": round(median(sums), 1), "kernels": round(per_call, 1)}
    launch = next((e.get("args", {}) for e in events if "tree_attention" in e["name"]), None)
    if launch:
        row |= {"registers": launch.get("registers per thread"), "grid": launch.get("grid"), "block": launch.get("block"),
                "blocks_per_sm": launch.get("blocks per SM")}
    return row, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SYNTHETIC), default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--context", type=int, default=256, help="cached rows before the tree (default 256)")
    p.add_argument("--warps", type=int, choices=tree_attention.WARP_CHOICES, default=tree_attention.WARPS,
                   help="the kernel's simdgroups a threadgroup, as a tuning profile sets them")
    p.add_argument("--out", type=Path, help="the JSON file to write")
    args = p.parse_args(argv)
    if kernel_backend() != "cuda" or not torch.cuda.is_available():
        print("error: attention_cost times CUDA kernels: it needs MLX's CUDA backend and a CUDA build of torch", file=sys.stderr)
        return 1
    dtype = getattr(mx, args.dtype)
    tree_attention.WARPS = args.warps
    layer = Attention(ModelArgs.from_dict(dict(SYNTHETIC[args.shape], model_type="llama")))
    out = {"shape": args.shape, "dtype": args.dtype, "context": args.context, "warps": args.warps, "mlx": mx.__version__,
           "device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
           "command": "python -m benchmarks.gpu.attention_cost " + " ".join(argv if argv is not None else sys.argv[1:]), "trees": {}}
    for name, parents in TREES.items():
        mlx_row, want = layer_cost(layer, parents, args.context, False, dtype)
        kernel_row, got = layer_cost(layer, parents, args.context, True, dtype)
        kernel_row["max_abs_diff"] = float(mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))))
        out["trees"][name] = {"nodes": len(parents), "mlx": mlx_row, "kernel": kernel_row}
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
