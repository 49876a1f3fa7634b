#!/usr/bin/env python
"""Where a pass of draft-model speculation spends its time, ours beside mlx-lm's on the same
weights. A slow pass is a host that builds: a kernel or a cuDNN plan for a shape not seen before
costs tens of milliseconds to seconds on MLX's CUDA backend, and this finds which passes paid it.

Part 1, one op at a time, each the median of 20 after 3 warm-ups, at the prompt's cache: a draft
model step of one token (ours, mlx-lm's), and a target forward over K + 1 tokens (ours as the
loop verifies, through the tree path with a chain; ours without a tree; mlx-lm's).
Part 2, the loop as `speculative.py` runs it (64 tokens, a warm-up run then 2): each iteration's
gap between yields, split into drafting (`DraftProposer.propose`, which waits for its tokens),
building the target's pass (`verify`), acceptance (`accept.greedy`, which waits for the pass) and
the cache moves (`commit`).
Part 3, the prompts in turn as `speculative.py` runs them (3 chat questions, a warm-up round then
2), the draft keeping its cache from one prompt to the next: each run's tokens a second and its
slowest passes, with the draft's prompt read (`prefill`) and its several-token re-reads split out.

MODEL: a directory with draft/ (or a new one: `speculative.py`'s synthetic target and draft). A
target whose draft is all of it (a draft that agrees often, so it re-reads): `make_synthetic`
(benchmarks/run.py) then `write_heads(d, load_model(d), 0, 30)` (benchmarks/speculative.py).

    python -m benchmarks.gpu.draft_phases OUTDIR/llama-target draft-phases.json [K]
"""
import argparse
import json
import time
from pathlib import Path
from statistics import median

import mlx.core as mx
import mlx.utils

from benchmarks.speculative import CHAT_PROMPTS, synthetic_target  # noqa: E402

from benchmarks.gpu.phases import iterations, log, stamped  # noqa: E402

import mlx_hybrid.speculative.steps as loop  # noqa: E402
from mlx_hybrid.chat import render_chat  # noqa: E402
from mlx_hybrid.decode import prefill  # noqa: E402
from mlx_hybrid.sampling import SamplingParams  # noqa: E402
from mlx_hybrid.loader import DTYPES, load_model, load_tokenizer  # noqa: E402
from mlx_hybrid.cache import commit  # noqa: E402
from mlx_hybrid.speculative import accept, load_proposer  # noqa: E402
from mlx_hybrid.speculative.load import target_dtype  # noqa: E402
from mlx_hybrid.tree_mask import TreeMask  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("model", type=Path)
p.add_argument("out", type=Path, help="JSON file")
p.add_argument("k", type=int, nargs="?", default=4, help="draft tokens a step (default 4)")
args = p.parse_args()
d, out_path, K = synthetic_target(args.model), args.out, args.k
model = load_model(d)
prompt = render_chat(load_tokenizer(d), [{"role": "user", "content": CHAT_PROMPTS.read_text().splitlines()[0]}])
proposer = load_proposer("draft", model, d, num_draft=K)


def lm_load(path):
    from mlx_lm.utils import load_model as lm_load_model

    m = lm_load_model(path)[0]
    dtype = DTYPES[target_dtype(model)]
    m.update(mlx.utils.tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, m.parameters()))
    return m


lm_target, lm_draft = lm_load(d), lm_load(d / "draft")


def ms(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t))
    return round(median(times), 3)


def primed(m, cache):
    prefill(m, mx.array(prompt[:-1]), cache)
    mx.eval([c.state for c in cache])
    return cache


def lm_primed(m):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(m)
    mx.eval(m(mx.array(prompt[:-1])[None], cache))
    return cache


tok1, toks = mx.array([[prompt[-1]]]), mx.array([prompt[-K - 1 :]])
ours_dc, lm_dc = primed(proposer.model, proposer.model.make_cache()), lm_primed(lm_draft)
ours_tc, lm_tc = primed(model, model.make_cache()), lm_primed(lm_target)


def step_and_trim(m, cache, x, tree=None):
    y = m(x, cache, mask=tree)
    mx.eval(mx.argmax(y[0, -1]))
    if tree is not None:
        commit(cache, [])  # none of the tree kept
    else:
        for c in cache:
            c.trim(x.shape[1])


ops = {
    "ours draft step (1 token)": ms(lambda: step_and_trim(proposer.model, ours_dc, tok1)),
    "mlx-lm draft step (1 token)": ms(lambda: step_and_trim(lm_draft, lm_dc, tok1)),
    f"ours verify, chain tree ({K + 1} tokens)": ms(lambda: step_and_trim(model, ours_tc, toks, TreeMask.chain(K + 1))),
    f"ours forward, no tree ({K + 1} tokens)": ms(lambda: step_and_trim(model, ours_tc, toks)),
    f"mlx-lm forward ({K + 1} tokens)": ms(lambda: step_and_trim(lm_target, lm_tc, toks)),
}
print(json.dumps(ops, indent=1))



loop.verify = stamped("build", loop.verify)
proposer.propose = stamped("draft", proposer.propose)
accept.greedy = stamped("accept", accept.greedy)
loop.commit = stamped("cache", loop.commit)


def logged_run(p):
    """The loop on prompt p for 64 tokens, the phase log cleared first: (yield times, tokens)."""
    log.clear()
    yields, n = [], 0
    for new, _ in loop.speculative_steps(model, proposer, p, model.make_cache(), SamplingParams()):
        yields.append(time.perf_counter())
        n += len(new)
        if n >= 64:
            break
    return yields, n


runs = {}
for rnd in range(3):
    yields, n = logged_run(prompt)
    its = iterations(yields)
    runs[rnd] = its
    if rnd:
        keys = sorted({k for it in its for k in it})
        print(f"loop run {rnd}: {len(its)} passes, {n} tokens; first:", its[:2],
              "median:", {k: round(median(it.get(k, 0.0) for it in its), 3) for k in keys})

import mlx_hybrid.speculative.draft as draft_module  # noqa: E402

draft_module.prefill = stamped("draft prefill", draft_module.prefill)
logits_of = draft_module.DraftProposer._logits


def reread(self, x):
    t = time.perf_counter()
    y = logits_of(self, x)
    if x.shape[0] > 1:
        log.append((f"reread {x.shape[0]}", t, time.perf_counter()))
    return y


draft_module.DraftProposer._logits = reread
questions = CHAT_PROMPTS.read_text().splitlines()[:3]
prompts = [render_chat(load_tokenizer(d), [{"role": "user", "content": q}]) for q in questions]
cycle = []
for rnd in range(3):
    for i, p in enumerate(prompts):
        yields, n = logged_run(p)
        its = iterations(yields)
        secs = yields[-1] - yields[0]
        slow = sorted(range(len(its)), key=lambda j: -its[j]["gap"])[:3]
        cycle.append(dict(round=rnd, prompt=i, prompt_tokens=len(p), tokens=n, tok_s=round(n / secs, 1),
                          slowest={j: its[j] for j in slow}))
        print(f"cycle round {rnd} prompt {i}: {n / secs:.1f} tok/s; slowest passes:", {j: its[j] for j in slow}, flush=True)
out_path.write_text(json.dumps(dict(ops=ops, loop=runs, cycle=cycle), indent=1))
