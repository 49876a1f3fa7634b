#!/usr/bin/env python
"""Where a speculative pass spends its time: forward passes over 1, 8, 17, 34 and 64 tokens as a
chain and as a binary tree (per-node positions), each through the tree-attention kernel (where
the device has one; its projections as they run, all on MLX's matmul, all per row
(mlx_hybrid/models/linear.py)) and through MLX's attention with a mask (causal, or an array for
the tree), MLX's attention alone with each kind of mask (30 calls), single ops (a chain of 200 on
a 576-wide activation), each proposer's draft compiled (as the loop runs it) and eager, a verification with device-side acceptance, the accepted path's KV
rows written when it is a prefix of the nodes vs another path, and, as the loops run them (host and device
overlapped), a plain decode step and a greedy pass of each method.

A model directory with its medusa/ and/or redrafter/ (the default hybrid, a converted target), or
a new directory: random weights in --shape's (SmolLM2-135M's by default; benchmarks/run.py's
SYNTHETIC) with untrained heads (benchmarks/speculative.py's). --dtype casts the target's floats.
--forwards: only the decode step and the forwards over 8, 17, 34 and 64 tokens, on each path of
the projections: as tuned (the model's profile's limits, else those `hybrid tune` would measure,
measured first; printed as row_limits and tree_attention_limit), all on MLX's matmul, all on the row kernel, and with
MLX's attention over a mask (the pass-cost table, written into --results; a new directory then
gets no heads). 256 context tokens, each timing the median of 20 synchronous runs
(milliseconds; the host waits for each; with --forwards the median of 3 rounds' over the whole
sweep) unless it says pipelined. BITS (4 or 8) quantizes the
target as `hybrid convert` does by default. Prints JSON. --passes: only the pipelined decode
step and passes, for each variant of the pass (the row kernel for the projections or MLX's
matmuls, the placed-tree pass compiled or eager), the variants interleaved in 3 rounds. --split: only the pipelined
decode step and passes in 5 rounds, each split into the host's building, dispatching and waiting
(a loop that waits is bound by the device, one that does not by the host).

    python -m benchmarks.pass_cost benchmarks/results/models/smollm2-135m-speculative [BITS] [--passes | --split]
    python -m benchmarks.pass_cost path/to/model
    python -m benchmarks.pass_cost MODELDIR 4 --shape llama-3-8b --dtype bfloat16 --forwards   # MODELDIR: new, for random weights
"""
import argparse, sys, time, json, shlex
from pathlib import Path
from statistics import median
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from benchmarks.run import SYNTHETIC, device_description, slugify
from benchmarks.speculative import kernel_limits, synthetic_target
from mlx_hybrid.loader import DTYPES, load_model
from mlx_hybrid.decode import generate_step, prefill, generation_stream
from mlx_hybrid.speculative.proposer import load_proposer
from mlx_hybrid.speculative.steps import _greedy_passes
from mlx_hybrid.speculative import verify
from mlx_hybrid.speculative.load import target_dtype
from mlx_hybrid import attention
from mlx_hybrid.speculative import accept
from mlx_hybrid.tree_mask import TreeMask
from mlx_hybrid.tune import binary_tree
from mlx_hybrid.cache import commit, trim_cache
from mlx_hybrid.models import linear
from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.tree_attention import tree_attention
from mlx_hybrid import tree_attention as tree_attention_module

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("model", type=Path, help="a model directory with its heads, or a new one for random weights")
parser.add_argument("bits", type=int, nargs="?", choices=(4, 8), help="quantize the target to these bits")
only = parser.add_mutually_exclusive_group()
only.add_argument("--passes", action="store_true", help="only the pipelined step and passes, each variant of the pass")
only.add_argument("--split", action="store_true", help="only the pipelined step and passes, split into build, dispatch, wait")
only.add_argument("--forwards", action="store_true", help="only the decode step and the forwards over T tokens, each projection path")
parser.add_argument("--shape", choices=SYNTHETIC, help="the shape of a new random-weight target (default smollm2-135m), "
                    "and the result's name for one made before (a quantized run of it)")
parser.add_argument("--dtype", choices=DTYPES, help="the target's float dtype (default: the runtime's)")
parser.add_argument("--results", type=Path, help="--forwards: also write the pass-cost table's result file into this directory")
args = parser.parse_args()
passes_only, split_only = args.passes, args.split
synthetic = not (args.model / "config.json").is_file()
d = synthetic_target(args.model, args.shape or "smollm2-135m", heads=not args.forwards)  # made only where there is no model yet
model = load_model(d, args.dtype)
methods = [m for m in ("medusa", "redrafter") if (d / m).is_dir()]
if args.bits:  # a quantized target, as `hybrid convert` writes by default
    nn.quantize(model, 64, args.bits)
rng = np.random.default_rng(0)
V = model.args.vocab_size

def ms(fn, reps=20):
    for _ in range(3): fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return round(1000 * median(ts), 3)

out = {}
with mx.stream(generation_stream):
    cache = model.make_cache()
    prefill(model, mx.array(rng.integers(0, V, 256)), cache)
    # Decoding as the loops run it, host and device overlapped: plain decoding, and greedy passes
    # queued one ahead of the host (per pass; the context grows by what each pass accepts).
    def per_item(steps, n=40):
        next(steps)
        t = time.perf_counter()
        for _ in range(n): next(steps)
        dt = (time.perf_counter() - t) / n
        steps.close()
        return round(1000 * dt, 3)
    trim_cache(cache, cache[0].offset - 256)
    hidden = model(mx.array([[5]]), cache, return_hidden=True)[1][0, -1]
    for c in cache: c.trim(1)
    proposers = {method: load_proposer(method, model, d) for method in methods}
    def pipelined(suffix=""):
        out["decode_pipelined" + suffix] = median(per_item(generate_step(mx.array([5]), model, cache, lambda x: mx.argmax(x, -1), max_tokens=50)) for _ in range(3))
        trim_cache(cache, cache[0].offset - 256)
        for method, p in proposers.items():
            out[f"{method}_pass_pipelined{suffix}"] = median(per_item(_greedy_passes(model, p, cache, mx.array([7], mx.int32), hidden), 20) for _ in range(3))
            trim_cache(cache, cache[0].offset - 256)
    if split_only:
        # Each pipelined step or pass as the host spends it: building its graph (Python, MLX),
        # dispatching it (`mx.async_eval`: MLX encodes and launches its kernels on this thread),
        # then waiting for the one before (the device's time that the host's does not hide).
        stamps, dispatch = [], mx.async_eval
        def stamped(*arrays):
            t = time.perf_counter(); dispatch(*arrays); stamps.append((t, time.perf_counter()))
        mx.async_eval = stamped
        def split(steps, n=40):
            next(steps)
            parts = []
            for _ in range(n):
                t0 = time.perf_counter(); next(steps); t1 = time.perf_counter()
                a0, a1 = stamps[-1]
                parts.append((a0 - t0, a1 - a0, t1 - a1, t1 - t0))
            steps.close()
            return {k: round(1000 * median(p[i] for p in parts), 3) for i, k in enumerate(("build", "dispatch", "wait", "total"))}
        for r in range(5):
            out[f"decode_r{r}"] = split(generate_step(mx.array([5]), model, cache, lambda x: mx.argmax(x, -1), max_tokens=50))
            trim_cache(cache, cache[0].offset - 256)
            for method, p in proposers.items():
                out[f"{method}_r{r}"] = split(_greedy_passes(model, p, cache, mx.array([7], mx.int32), hidden), 20)
                trim_cache(cache, cache[0].offset - 256)
        print(json.dumps(out, indent=1)); sys.exit()
    # The pass's variants, interleaved in rounds: the projections on the row kernel or (rows 0)
    # on MLX's matmuls, with and without the compiled placed-tree pass (`verify`).
    variants = [(f"_rows{rb}{'' if c else '_eager'}", rb, c) for rb in (0, linear.ROWS) for c in (True, False)]
    for r in range(3 if passes_only else 1):
        for suffix, rb, compiled in variants if passes_only else [("", linear.ROWS, True)]:
            saved = linear.ROWS, verify.compiles
            linear.ROWS = rb
            verify._COMPILED.clear()  # traced anew under this limit
            if not compiled:
                verify.compiles = lambda model, cache: False
            pipelined(suffix + (f"_r{r}" if passes_only else ""))
            linear.ROWS, verify.compiles = saved
    if passes_only:
        print(json.dumps(out, indent=1)); sys.exit()
    def fwd(tokens, tree):
        def f():
            lg = model(tokens[None], cache, mask=tree)
            mx.eval(lg)
            commit(cache, []) if tree is not None else [c.trim(tokens.shape[0]) for c in cache]
        return f
    # --forwards: every cell in 3 rounds, the median of its rounds' medians, so that a drift of
    # the device's or host's speed during the sweep lands on no one cell alone.
    cells = {}
    def cell(key, fn):
        cells.setdefault(key, []).append(ms(fn))
    for r in range(3 if args.forwards else 1):
        cell("T1_decode", fwd(mx.array([5]), None))
        if r == 0 and kernel_backend():  # the paths `hybrid tune` chose (a profile's, else measured now)
            out |= kernel_limits(d, model)
        for T in (8, 17, 34, 64):
            toks = mx.array(np.random.default_rng(T).integers(0, V, T))
            for shape, tree in (("chain", TreeMask.chain(T)), ("tree", binary_tree(T))):
                if kernel_backend():
                    cell(f"T{T}_{shape}_kernel", fwd(toks, tree))  # each projection on the path tuned for it
                    # every projection on MLX's matmul, then every one on the row kernel
                    tuned, tuned_tree = dict(linear.LIMITS), tree_attention_module.LIMIT
                    tree_attention_module.LIMIT = None
                    for suffix, rows in (("_matmul", 0), ("_rows", linear.ROWS)):
                        rows, linear.ROWS = linear.ROWS, rows
                        linear.LIMITS.clear()
                        cell(f"T{T}_{shape}_kernel{suffix}", fwd(toks, tree))
                        linear.ROWS = rows
                    linear.LIMITS.update(tuned)
                    tree_attention_module.LIMIT = tuned_tree
                kernel, attention.tree_kernel = attention.tree_kernel, lambda *args: None
                cell(f"T{T}_{shape}_masked", fwd(toks, tree))
                attention.tree_kernel = kernel
    out |= {key: median(v) for key, v in cells.items()}
    if args.forwards:
        if args.results:  # the pass-cost table's row (benchmarks/index.py)
            device = device_description()
            shape = args.shape or (args.model.name if not synthetic else "smollm2-135m")
            name = f"pass-cost-forwards-{shape}-{target_dtype(model)}{f'-{args.bits}bit' if args.bits else ''}"
            result = dict(label=device["default_label"], device=device, shape=shape, dtype=target_dtype(model), bits=args.bits, command="python -m benchmarks.pass_cost " + shlex.join(sys.argv[1:]), times=out,
                          timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
            args.results.mkdir(parents=True, exist_ok=True)
            (args.results / f"{slugify(name + ' ' + device['default_label'])}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(out, indent=1)); sys.exit()
    # sdpa alone
    H, KV, D = model.args.num_attention_heads, model.args.num_key_value_heads, model.args.head_dim
    for T in (1, 34):
        q = mx.random.normal((1, H, T, D)).astype(mx.float16); k = mx.random.normal((1, KV, 290, D)).astype(mx.float16); v = k
        m = mx.random.uniform(shape=(T, 290)) > 0.3
        for name, mask in (("none", None), ("causal", "causal" if T > 1 else None), ("bool", m)):
            def f():
                outs = [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask) for _ in range(30)]
                mx.eval(outs)
            out[f"sdpa30_T{T}_{name}"] = ms(f)
        if kernel_backend():
            tree = binary_tree(T)
            par, rows = tree.parent_array(), 290 - T + tree.node_depths()
            tk = k[..., :T, :]  # the tree's own keys and values
            at, freqs = mx.arange(290 - T, 290, dtype=mx.int32), mx.ones((D // 2,))
            f = lambda: mx.eval([tree_attention(q, k, v, tk, tk, par, rows, at, freqs, scale=0.1, backend=kernel_backend()) for _ in range(30)])
            out[f"tree_attention30_T{T}"] = ms(f)
    # One op's cost: a chain of 200 dependent ops on a 576-wide activation of 1 or 34 rows, total
    # and host time (building the graph and handing it to the device) per op, in microseconds.
    W = (mx.random.normal((576, 576)) * 0.04).astype(mx.float16)
    q4, q8 = mx.quantize(W, 64, 4), mx.quantize(W, 64, 8)
    up, down = nn.Linear(576, 3072, bias=False), nn.Linear(3072, 576, bias=False)
    rows_up, rows_down, rows_sq = linear.Linear(576, 3072, bias=False), linear.Linear(3072, 576, bias=False), linear.Linear(576, 576, bias=False)
    for a, b in ((rows_up, up), (rows_down, down)):
        a.weight = b.weight = (b.weight * 0.5).astype(mx.float16)
    rows_sq.weight = W
    ops = {
        "add": lambda x: x + 1,
        "matmul": lambda x: x @ W.T,
        "rows_matmul": rows_sq,  # mlx_hybrid.models.linear's row kernel (1 row: MLX's gemv)
        "mlp_pair": lambda x: down(up(x)),  # 576 -> 3072 -> 576: two matmuls an op
        "rows_mlp_pair": lambda x: rows_down(rows_up(x)),
        "qmm4": lambda x: mx.quantized_matmul(x, *q4, True, 64, 4),
        "qmm8": lambda x: mx.quantized_matmul(x, *q8, True, 64, 8),
        "rms_norm": lambda x: mx.fast.rms_norm(x, None, 1e-5),
        "transpose": lambda x: x.T,  # a view: no data moves (what graph_ops.py counts apart)
    }
    for name, op in ops.items():
        # Matmuls at every pass size: how a verification's cost grows with its candidates.
        for T in (1, 8, 17, 34, 64) if "matmul" in name or name in ("qmm4", "mlp_pair", "rows_mlp_pair") else (1, 34):
            x = mx.random.normal((T, 576)).astype(mx.float16)
            mx.eval(x, W, q4, q8, up.weight, down.weight)
            def chain():
                y = x
                for _ in range(200):
                    y = op(y)
                return y
            def host():
                t = time.perf_counter(); y = chain(); mx.async_eval(y); b = time.perf_counter() - t; mx.eval(y)
                return b
            out[f"op_{name}_T{T}_us"] = round(1000 * ms(lambda: mx.eval(chain())) / 200, 2)
            out[f"op_{name}_T{T}_host_us"] = round(1e6 * median(host() for _ in range(10)) / 200, 2)
    for method in methods:
        p = load_proposer(method, model, d)
        root = mx.array([7], mx.int32)
        out[f"{method}_draft"] = ms(lambda: mx.eval(p.draft(root, hidden).arrays()))
        eager = p._tree_tokens if method == "medusa" else p._search_and_pack
        out[f"{method}_draft_eager"] = ms(lambda: mx.eval(eager(root, hidden)))
        dr = p.draft(root, hidden); mx.eval(dr.arrays())
        out[f"{method}_T"] = len(dr.tokens)
        def verify_accept():
            lg, hs = model(dr.tokens[None], cache, mask=dr.tree, return_hidden=True)
            info, last = accept.greedy_rows(dr, lg[0]); info.tolist(); commit(cache, [])
        out[f"{method}_verify_accept"] = ms(verify_accept)
        for path in ([0], [0, 1, 2], [0, 2, 5]):
            def comp():
                lg = model(dr.tokens[None], cache, mask=dr.tree); mx.eval(lg)
                t = time.perf_counter(); commit(cache, path); mx.eval([c.keys for c in cache]); b = time.perf_counter() - t
                for c in cache: c.trim(len(path))
                return b
            comp(); out[f"{method}_compact_{path}"] = round(1000 * median(comp() for _ in range(10)), 3)
print(json.dumps(out, indent=1))
