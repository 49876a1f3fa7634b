#!/usr/bin/env python
"""Operations per plain decode step and per greedy speculative pass, as a GPU runs them, counted
on any machine.

On a GPU a small model's pass costs per operation, not per token: every MLX op costs 4-20 us of
host time on the H100 whatever its size (benchmarks/results/pass-cost-ops-nvidia-h100.json), so a pass can be no faster than
its op count allows, and speculation pays only when a pass has few more ops than a decode step.
This builds the graphs of a plain decode step (forward, log-probabilities, argmax) and of each
part of a greedy pass (the draft, the verification forward, the acceptance, and the cache moves to
the accepted path, which the device makes before the host reads it) without running them, and counts their nodes
(`mx.export_to_dot`).

A CPU stream spells MLX's fused ops (rms_norm, rope, attention, dequantize) out as their fallback graphs, and
our GPU kernels do not exist there. So the counts are taken with both replaced by one-node
stand-ins (`mx.depends` on every input, with the output's shape) and with the kernel dispatch
told the device is a CUDA GPU: the graphs are the ones a GPU builds. "views" move no data
(transpose, slice, broadcast, split, reshape of a contiguous array, ...); "kernels" are the rest.

    python -m benchmarks.graph_ops          # SmolLM2-135M shape (float16 and 4-bit) and the default hybrid
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx
import mlx.nn as nn

from benchmarks.index import render_file  # noqa: E402
from benchmarks.run import make_synthetic  # noqa: E402
from benchmarks.speculative import write_heads  # noqa: E402

from mlx_hybrid.cache import commit  # noqa: E402
from mlx_hybrid.default_model import default_model_path  # noqa: E402
from mlx_hybrid.decode import prefill  # noqa: E402
from mlx_hybrid.loader import load_model  # noqa: E402
from mlx_hybrid.speculative import accept, redrafter  # noqa: E402
from mlx_hybrid.speculative.proposer import load_proposer  # noqa: E402
from mlx_hybrid.speculative.verify import verify  # noqa: E402

ROOT = Path(__file__).resolve().parent
VIEWS = {"Transpose", "Slice", "Squeeze", "ExpandDims", "Broadcast", "Split", "AsStrided", "Reshape", "Flatten", "Unflatten"}


def count(*arrays: mx.array) -> tuple[int, int]:
    """(kernels, views) among the unevaluated nodes behind arrays."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    ops = collections.Counter(re.findall(r'label ="([A-Za-z]+)', dot.getvalue()))
    views = sum(n for op, n in ops.items() if op in VIEWS)
    return sum(ops.values()) - views, views


@contextlib.contextmanager
def gpu_graphs():
    """Build graphs as on a CUDA GPU: fused ops and our kernels as one node each (see the top).

    Use it in a process of its own: MLX keeps what a compiled function traced, so one traced here
    would keep the stand-ins afterwards."""
    leaves: dict = {}

    def leaf(shape, dtype):  # an evaluated array: no node of its own
        if (tuple(shape), dtype) not in leaves:
            leaves[tuple(shape), dtype] = mx.zeros(shape, dtype)
            mx.eval(leaves[tuple(shape), dtype])
        return leaves[tuple(shape), dtype]

    def node(out, *inputs):
        return mx.depends(out, [a for a in inputs if isinstance(a, mx.array)])

    def kernel(*_, **__):
        def launch(*, inputs, output_shapes, output_dtypes, **___):
            return node([leaf(s, d) for s, d in zip(output_shapes, output_dtypes)], *inputs)

        return launch

    with contextlib.ExitStack() as stack:
        patch = lambda *a: stack.enter_context(mock.patch.object(*a))  # noqa: E731
        patch(mx.fast, "rms_norm", lambda x, w, eps: node(x, w))
        patch(mx.fast, "rope", lambda x, *_, offset, freqs=None, **__: node(x, offset, freqs))
        patch(mx.fast, "scaled_dot_product_attention", lambda q, k, v, *, scale, mask=None, **_: node(q, k, v, mask))
        patch(mx, "dequantize", lambda w, scales, biases=None, group_size=64, bits=4, *_, **kw: node(
            leaf((*w.shape[:-1], w.shape[-1] * 32 // bits), kw.get("dtype") or scales.dtype), w, scales, biases))
        patch(redrafter, "trims_padding", lambda: False)
        for name, module in list(sys.modules.items()):
            if name.startswith("mlx_hybrid") and hasattr(module, "kernel_backend"):
                patch(module, "kernel_backend", lambda: "cuda")
            if name.startswith("mlx_hybrid") and hasattr(module, "load_kernel"):
                patch(module, "load_kernel", kernel)
        yield


class Tally:
    """Counts what each new piece adds to the graph built so far: nothing is evaluated, so a
    half-precision model costs no CPU time beyond a short prompt."""

    def __init__(self):
        self.arrays, self.total = [], (0, 0)

    def __call__(self, *arrays: mx.array) -> tuple[int, int]:
        self.arrays += [a for a in arrays if isinstance(a, mx.array)]
        before, self.total = self.total, count(*self.arrays)
        return self.total[0] - before[0], self.total[1] - before[1]


def measure(model, heads_dir: Path, methods: list[str]) -> dict:
    """Counts for a plain step and, per method, each part of a pass (after a 4-token prompt: the
    counts do not depend on the context's length)."""
    out = {}
    for method in [None, *methods]:
        cache = model.make_cache()
        prefill(model, mx.array([1, 2, 3, 4]), cache)
        mx.eval([c.state for c in cache])
        with gpu_graphs():
            tally = Tally()
            logits, hidden = model(mx.array([[5]]), cache, return_hidden=True)
            if method is None:
                logprobs = logits[:, -1, :] - mx.logsumexp(logits[:, -1, :], axis=-1, keepdims=True)
                out["plain step"] = tally(mx.argmax(logprobs, axis=-1), logprobs)
                continue
            mx.eval(hidden, [c.state for c in cache])
            proposer = load_proposer(method, model, heads_dir)
            draft = proposer.draft(mx.array([3], mx.int32), hidden[0, -1])
            parts = {"draft": tally(*draft.arrays())}
            pos = mx.array([cache[0].offset], mx.int32)
            logits, hiddens = verify(model, draft.tokens[None], cache, draft.tree.at(pos, cache[0].offset))
            parts["verification forward"] = tally(logits, hiddens, *[a for c in cache for a in c.state])
            info, last = accept.greedy_rows(draft, logits[0])
            parts["acceptance"] = tally(info, last, hiddens[0, last], pos + info[:1] + 1)
            commit(cache, info[2 : 2 + draft.rows.shape[1]], last)
            parts["cache moves"] = tally(*[a for c in cache for a in c.state])
            out[method] = dict(parts, nodes=len(draft.tokens))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "graph-ops.json")
    parser.add_argument("--model", type=Path, help="count this model directory (with its medusa/ and redrafter/), print JSON only")
    args = parser.parse_args(argv)

    if args.model:
        methods = [m for m in ("medusa", "redrafter") if (args.model / m).is_dir()]
        print(json.dumps(measure(load_model(args.model), args.model, methods)))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        target = make_synthetic("smollm2-135m", Path(tmp) / "smollm2-135m", seed=0)
        model = load_model(target, "float16")
        write_heads(target, model, seed=0, draft_layers=2)
        results["SmolLM2-135M shape, float16 (30 attention layers)"] = measure(model, target, ["medusa", "redrafter"])
        model = load_model(target, "float16")  # a new model: the first's compiled tree pass keeps its weights
        nn.quantize(model, 64, 4)
        results["SmolLM2-135M shape, 4-bit"] = measure(model, target, ["medusa", "redrafter"])
    default = load_model(default_model_path(), "float16")
    results["default hybrid (30 layers, 15 Mamba2)"] = measure(default, default_model_path(), ["redrafter"])

    args.out.write_text(json.dumps(dict(results=results, mlx=mx.__version__, date=time.strftime("%Y-%m-%d")), indent=1) + "\n")
    print(render_file(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
