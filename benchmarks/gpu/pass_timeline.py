#!/usr/bin/env python
"""When each pass's tokens reach the caller in `speculative.py`'s greedy loop: plain decoding and
greedy Medusa (24 nodes) and ReDrafter (2x5) passes, a fresh cache a run as the benchmark runs
them, 128 random prompt tokens, 64 tokens; milliseconds from the first token to each yield, in 4
rounds (the last two printed as the gaps between yields). Shows a pass's steady cost against a
decode step's and what filling the pipeline costs at the start of a run.

MODEL: a directory with medusa/ and redrafter/, or a new one for random weights in SmolLM2-135M's
shape with untrained heads (`speculative.py`'s). Writes JSON to OUT.

    python -m benchmarks.gpu.pass_timeline DIR pass-timeline.json
"""
import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.speculative import synthetic_target  # noqa: E402

from mlx_hybrid.decode import generate_step  # noqa: E402
from mlx_hybrid.sampling import SamplingParams  # noqa: E402
from mlx_hybrid.loader import load_model  # noqa: E402
from mlx_hybrid.profiles import Settings  # noqa: E402
from mlx_hybrid.speculative.proposer import load_proposer  # noqa: E402
from mlx_hybrid.speculative.steps import speculative_steps  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("model", type=Path)
p.add_argument("out", type=Path, help="JSON file")
args = p.parse_args()
d, out_path = synthetic_target(args.model), args.out
model = load_model(d)
prompt = mx.random.randint(0, model.args.vocab_size, (128,), key=mx.random.key(0)).tolist()
argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
runs = {"plain": lambda: ((t,) for t, _ in generate_step(mx.array(prompt), model, model.make_cache(), argmax, max_tokens=64))}
for name, method, settings in [("medusa24", "medusa", Settings(tree_size=24)), ("redrafter2x5", "redrafter", Settings(2, 5))]:
    proposer = load_proposer(method, model, d, settings=settings)
    runs[name] = (lambda p: lambda: (new for new, _ in speculative_steps(model, p, prompt, model.make_cache(), SamplingParams())))(proposer)
out = {}
for rnd in range(4):  # round 0 warms up (kernels, traces)
    for name, run in runs.items():
        stamps, n = [], 0
        for new in run():
            stamps.append((time.perf_counter(), len(new)))
            n += len(new)
            if n >= 64:
                break
        out[f"{name}_{rnd}"] = [(round(1000 * (t - stamps[0][0]), 2), k) for t, k in stamps]
for key, stamps in out.items():
    if key.endswith(("_2", "_3")):
        gaps = [round(b[0] - a[0], 2) for a, b in zip(stamps, stamps[1:])]
        print(key, "total", stamps[-1][0], "ms,", len(stamps) - 1, "yields; gaps", gaps[:6], "...", gaps[-4:])
out_path.write_text(json.dumps(out))
