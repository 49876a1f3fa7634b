#!/usr/bin/env python
"""The host's time to dispatch one op (`mx.async_eval` of a graph of N alike, independent ops,
divided by N; microseconds, the median of 20 dispatches), for the ops a decode step and a
verification pass are made of, at SmolLM2-135M's shapes in bfloat16; and the graphs themselves:
each kind of node a decode step and a greedy Medusa / ReDrafter pass dispatch (`--graphs MODEL`,
a directory with medusa/ and redrafter/, or a new one: random weights, untrained heads).

A speculative pass on a fast host is bound by the host's dispatch (`pass_phases.py`): this says
which of its ops cost the host most. Prints JSON.

    python -m benchmarks.gpu.dispatch_cost [--graphs DIR] > dispatch.json
"""
import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.models.linear import row_matmul, swiglu
from mlx_hybrid.rope import rope_frequencies
from mlx_hybrid.tree_attention import tree_attention
from mlx_hybrid.tune import binary_tree

dt = mx.bfloat16
backend = kernel_backend()


def dispatch_us(make, n: int, reps: int = 20) -> dict:
    """(building, dispatching) microseconds an op: make() builds n independent ops."""
    build, disp = [], []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        outs = make()
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        build.append(t1 - t0)
        disp.append(t2 - t1)
    return dict(build=round(1e6 * median(build[3:]) / n, 2), dispatch=round(1e6 * median(disp[3:]) / n, 2))


def copy_kernel(pad: int):
    """A kernel that copies 576 elements, its source padded by `pad` bytes of comment: what the
    size of a custom kernel's source costs each dispatch (MLX hashes it)."""
    src = "unsigned int i = threadIdx.x + blockIdx.x * blockDim.x; if (i < 576) y[i] = x[i];\n" + "// " + "x" * pad + "\n"
    return mx.fast.cuda_kernel(name=f"copy_pad{pad}", input_names=["x"], output_names=["y"], source=src)


def micro() -> dict:
    r = lambda *s: mx.random.normal(s).astype(dt)  # noqa: E731
    N = 120
    w, buf, idx = r(960, 576), r(1, 3, 512, 64), mx.zeros((1, 3, 25, 64), mx.int32)
    lin = nn.Linear(576, 960, bias=False)
    lin.weight = w
    tree = binary_tree(25)
    parents, node_rows, positions = tree.parent_array(), 200 + tree.node_depths(), mx.arange(200, 225, dtype=mx.int32)
    freqs = rope_frequencies(64, 100000.0, None)
    # each op its own input (mx.compile would merge alike ops on one input into one)
    ins = {s: [r(*s) for _ in range(N)] for s in [(1, 1, 576), (25, 576), (25, 1536), (1, 3, 25, 64), (1, 9, 25, 64)]}
    mx.eval(w, buf, idx, parents, node_rows, positions, freqs, ins)
    cases = {
        "gemv, 1 row (a decode step's Linear)": ((1, 1, 576), lin),
        "add": ((25, 576), lambda x: x + 1),
        "matmul, 25 rows (cuBLASLt)": ((25, 576), lambda x: x @ w.T),
        "swiglu, compiled": ((25, 1536), lambda x: swiglu(x, x)),
        "put_along_axis into a [1,3,512,64] buffer": ((1, 3, 25, 64), lambda x: mx.put_along_axis(buf, idx, x, axis=2)),
        "reshape + transpose + add": ((25, 576), lambda x: x.reshape(25, 9, 64).transpose(1, 0, 2) + 1),
    }
    if backend == "cuda":
        small, big = copy_kernel(0), copy_kernel(8192)
        call = lambda k, x: k(inputs=[x], grid=(576, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(576,)], output_dtypes=[dt])[0]  # noqa: E731
        tk = ins[(1, 3, 25, 64)][0]
        cases |= {
            "row kernel, 25 rows": ((25, 576), lambda x: row_matmul(x, w, backend="cuda")),
            "custom kernel, small source": ((25, 576), lambda x: call(small, x)),
            "custom kernel, 8 KB more source": ((25, 576), lambda x: call(big, x)),
            "tree attention, 25 nodes": ((1, 9, 25, 64), lambda q: tree_attention(q, buf, buf, tk, tk, parents, node_rows, positions, freqs, scale=0.125, backend="cuda")[0]),
        }
    out = {}
    for name, (shape, op) in cases.items():
        xs = ins[shape]
        out[name] = dispatch_us(lambda: [op(x) for x in xs], N)
        # traced once and replayed, as a pass's compiled function is
        f = mx.compile(lambda *xs: [op(x) for x in xs])
        out[name + ", replayed from mx.compile"] = dispatch_us(lambda: f(*xs), N)
    return out


def graphs(d: Path) -> dict:
    """Node kinds of what a decode step and each method's pass dispatch (`mx.export_to_dot`)."""
    from benchmarks.speculative import synthetic_target

    from mlx_hybrid.decode import generate_step
    from mlx_hybrid.sampling import SamplingParams
    from mlx_hybrid.loader import load_model
    from mlx_hybrid.profiles import Settings
    from mlx_hybrid.speculative.proposer import load_proposer
    from mlx_hybrid.speculative.steps import speculative_steps

    d = synthetic_target(d)
    model = load_model(d)
    prompt = mx.random.randint(0, model.args.vocab_size, (128,), key=mx.random.key(0)).tolist()
    dispatch, seen, out = mx.async_eval, [], {}
    dot = Path(tempfile.mkdtemp()) / "graph.dot"

    def capture(*arrays):
        seen.append(arrays)
        if len(seen) == 6:  # a step in the middle of the run
            mx.export_to_dot(str(dot), *arrays)
        dispatch(*arrays)

    mx.async_eval = capture
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    runs = {"decode": lambda: generate_step(mx.array(prompt), model, model.make_cache(), argmax, max_tokens=12)}
    for name, method, settings in [("medusa", "medusa", None), ("redrafter 4x5", "redrafter", Settings(4, 5))]:
        p = load_proposer(method, model, d, settings=settings)
        runs[name] = (lambda p: lambda: speculative_steps(model, p, prompt, model.make_cache(), SamplingParams()))(p)
    for name, run in runs.items():
        for _ in range(2):  # the second run's graphs: traces made
            seen.clear()
            for i, _ in enumerate(run()):
                if i == 8:
                    break
        text = dot.read_text()
        kinds = Counter(line.split('label ="')[1].split('"')[0] for line in text.splitlines() if 'label ="' in line)
        out[name] = dict(nodes=sum(kinds.values()), kinds=dict(kinds.most_common()))
    mx.async_eval = dispatch
    return out


p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--graphs", type=Path, metavar="DIR", help="also count the graphs of this model (with medusa/ and redrafter/), or of a new random one")
args = p.parse_args()
result = {"ops": micro()}
if args.graphs:
    result["graphs"] = graphs(args.graphs)
print(json.dumps(result, indent=1))
