#!/usr/bin/env python
"""Where the host spends each iteration of the greedy speculative loop (`_greedy_passes`), as
`speculative.py` runs it: a fresh cache a run, 64 tokens (or TOKENS). For every iteration, milliseconds
from the yield before it: building the pass (the model call), acceptance, the next draft, the
dispatch (`mx.async_eval`), reading the pass behind (`_read`: the wait for the device), and the
yield. Run 0 warms up; runs 1-3 are printed, the first iterations one by one and the rest as
medians, beside plain decoding's gaps between tokens. Shows what the first passes of a run cost
beyond the steady ones.

MODEL: a directory with medusa/ and redrafter/ (or a new one: random weights in SmolLM2-135M's
shape, `speculative.py`'s untrained heads); PROMPT: chat (the benchmark's first held-out chat
question, in the chat template) or a number of random tokens.

    python -m benchmarks.gpu.pass_phases MODEL chat|N OUT [TOKENS]
    python -m benchmarks.gpu.pass_phases OUTDIR/llama-target chat pass-phases.json
"""
import argparse
import json
import time
from pathlib import Path
from statistics import median

import mlx.core as mx

from benchmarks.speculative import CHAT_PROMPTS, synthetic_target  # noqa: E402

from benchmarks.gpu.phases import iterations, log, stamped  # noqa: E402

import mlx_hybrid.speculative.steps as loop  # noqa: E402
from mlx_hybrid.chat import render_chat  # noqa: E402
from mlx_hybrid.decode import generate_step  # noqa: E402
from mlx_hybrid.sampling import SamplingParams  # noqa: E402
from mlx_hybrid.loader import load_model, load_tokenizer  # noqa: E402
from mlx_hybrid.profiles import Settings  # noqa: E402
from mlx_hybrid.speculative import accept, load_proposer  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("model", type=Path)
p.add_argument("prompt", help="chat, or a number of random prompt tokens")
p.add_argument("out", type=Path, help="JSON file")
p.add_argument("tokens", type=int, nargs="?", default=64, help="tokens a run (default 64)")
args = p.parse_args()
d, kind, out_path, N = synthetic_target(args.model), args.prompt, args.out, args.tokens
model = load_model(d)
if kind == "chat":
    prompt = render_chat(load_tokenizer(d), [{"role": "user", "content": CHAT_PROMPTS.read_text().splitlines()[0]}])
else:
    prompt = mx.random.randint(0, model.args.vocab_size, (int(kind),), key=mx.random.key(0)).tolist()



loop.verify = stamped("build", loop.verify)
accept.greedy_rows = stamped("accept", accept.greedy_rows)
loop.commit = stamped("cache", loop.commit)
loop._read = stamped("read", loop._read)
mx.async_eval = stamped("dispatch", mx.async_eval)

runs = {}
for name, method, settings in [("medusa", "medusa", None), ("redrafter4x5", "redrafter", Settings(4, 5))]:
    p = load_proposer(method, model, d, settings=settings)
    p.draft = stamped("draft", p.draft)
    runs[name] = (lambda p: lambda: (new for new, _ in loop.speculative_steps(model, p, prompt, model.make_cache(), SamplingParams())))(p)
argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
runs["plain"] = lambda: ((t,) for t, _ in generate_step(mx.array(prompt), model, model.make_cache(), argmax, max_tokens=N))

out = {}
for rnd in range(4):
    for name, run in runs.items():
        log.clear()
        yields, n = [], 0
        for new in run():
            yields.append(time.perf_counter())
            n += len(new)
            if n >= N:
                break
        # each iteration: the phases logged between one yield and the next, from the first yield on
        its = iterations(yields)
        out[f"{name}_{rnd}"] = its
        if rnd:
            keys = sorted({k for it in its for k in it})
            steady = {k: round(median(it.get(k, 0.0) for it in its[3:]), 3) for k in keys} if len(its) > 4 else {}
            total = round(1000 * (yields[-1] - yields[0]), 2)
            print(f"{name} run {rnd}: {total} ms, {len(its)} gaps; first:", its[:3], "steady:", steady)
out_path.write_text(json.dumps(out))
