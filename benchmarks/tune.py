#!/usr/bin/env python
"""Tuned speculation vs the defaults and fixed settings, side by side in one run.

Loads (or, without one or with --retune, makes) the `hybrid tune` profile of --model on this
device, then decodes the benchmark prompts (the held-out half of the shipped prompt set, never seen
by the tuner) greedily with: this runtime's plain decoding, mlx-lm's plain decoding of the same
weights, each method's untuned default, a grid of fixed settings, and the profile's choice. Runners
are warmed up once and interleaved over --trials (median tokens/s). Run it twice: the second run
says the profile was reused.

    python -m benchmarks.tune --model DIR --label "NVIDIA H100, MLX CUDA backend"
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from statistics import median

import mlx.core as mx
from mlx.utils import tree_map

BENCH_DIR = Path(__file__).resolve().parent
from benchmarks.index import render_file  # noqa: E402
from benchmarks.run import device_description, slugify  # noqa: E402

from mlx_hybrid.loader import load  # noqa: E402
from mlx_hybrid.profiles import Settings, load_profile, profile_path, save_profile, use_kernel_limits  # noqa: E402
from mlx_hybrid.speculative.proposer import load_proposer  # noqa: E402
from mlx_hybrid.tune import PROMPTS_FILE, calibration_prompts, decode_speed, plot, tune  # noqa: E402

FIXED = {
    "redrafter": [Settings(w, l) for w in (1, 2, 4, 8) for l in (3, 5)],
    "medusa": [Settings(tree_size=s) for s in (4, 16, 64)],
}


def describe(method: str | None, s: Settings | None) -> str:
    if method is None:
        return "plain"
    if s is None or not (s.beam_width or s.medusa_choices or s.tree_size):
        return "default"
    if method == "redrafter":
        return f"beam {s.beam_width}x{s.beam_length}"
    return f"tree {len(s.medusa_choices) if s.medusa_choices else s.tree_size}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="target directory with medusa/ and/or redrafter/")
    p.add_argument("--prompts", type=int, default=6, help="benchmark prompts (from the held-out half)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--retune", action="store_true", help="tune again even if a profile exists")
    p.add_argument("--dtype", default=None, help="load the model in this dtype (CPU: float32; MLX's CPU float16 is slow)")
    p.add_argument("--small", action="store_true", help="a CPU-sized tuning: 6 prompts x 24 tokens, beams <= 4x4, <= 32 candidates")
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)

    model, tokenizer = load(args.model, dtype=args.dtype)
    methods = [m for m in ("redrafter", "medusa") if (args.model / m).is_dir()]
    found = None if args.retune else load_profile(args.model)
    tic = time.perf_counter()
    if found is None:
        small = dict(new_tokens=24, widths=(1, 2, 3, 4), max_length=4, tree_sizes=(1, 2, 4, 8, 16, 32),
                     counts=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32)) if args.small else {}
        texts = calibration_prompts()[: 6 if args.small else None]
        profile = tune(model, tokenizer, args.model, texts, methods, **small)
        path = profile_path(args.model)
        save_profile(profile, path)
        status = f"created ({time.perf_counter() - tic:.0f} s of tuning)"
    else:
        profile, path = found
        status = f"reused (made {profile['created']})"
        use_kernel_limits(args.model, model)  # as `hybrid tune` left them, and chat sets them
    plot(profile, BENCH_DIR / "results" / f"{slugify('tune profile ' + args.model.name + ' ' + (args.label or device_description()['default_label']))}.png")
    lines = PROMPTS_FILE.read_text().splitlines()
    prompts = [tokenizer.encode(t) for t in lines[len(lines) // 2 :][: args.prompts]]

    def best(method) -> Settings:
        b = profile["best"][method]
        return Settings(b.get("beam_width"), b.get("beam_length"), b.get("medusa_choices"))

    runners = {"plain": (None, None)}
    for method in methods:
        runners[f"{method} default"] = (method, Settings())
        for s in FIXED[method]:
            runners[f"{method} fixed {describe(method, s)}"] = (method, s)
        runners[f"{method} tuned {describe(method, best(method))}"] = (method, best(method))
    choice = profile["choice"]
    tuned_name = "plain" if choice is None else f"{choice} tuned {describe(choice, best(choice))}"
    proposers = {name: None if m is None else load_proposer(m, model, args.model, settings=s) for name, (m, s) in runners.items()}

    from mlx_lm.generate import generate_step as lm_generate_step
    from mlx_lm.utils import load_model as lm_load_model

    lm_model = lm_load_model(args.model)[0]
    if args.dtype:  # the same weights in the same dtype as ours
        dtype = getattr(mx, args.dtype)
        lm_model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, lm_model.parameters()))

    def lm_plain(ids):
        total, seconds = 0, 0.0
        for prompt in ids:
            tic, n = None, 0
            for _ in lm_generate_step(mx.array(prompt), lm_model, max_tokens=args.new_tokens, sampler=lambda x: mx.argmax(x, -1)):
                tic = tic or time.perf_counter()
                n += 1
            seconds += time.perf_counter() - tic
            total += n - 1
        return total / seconds, 1.0

    run = {name: (lambda ids, pr=pr: decode_speed(model, pr, ids, args.new_tokens)) for name, pr in proposers.items()}
    run["mlx-lm plain"] = lm_plain
    trials = {name: [] for name in run}
    for name, fn in run.items():  # warm-up on the same prompts: MLX's CUDA backend compiles kernels per shape
        fn(prompts)
    for _ in range(args.trials):
        for name, fn in run.items():
            trials[name].append(fn(prompts))
    base = median(t[0] for t in trials["plain"])
    rows = [dict(runner=name, tps=median(t[0] for t in ts), tokens_per_step=median(t[1] for t in ts)) for name, ts in trials.items()]
    for r in rows:
        r["vs_plain"] = r["tps"] / base
    tuned_tps = next(r["tps"] for r in rows if r["runner"] == tuned_name)
    beaten = [r["runner"] for r in rows if r["runner"] != tuned_name and r["tps"] > tuned_tps]

    device = device_description()
    label = args.label or device["default_label"]
    command = "python -m benchmarks.tune " + shlex.join(argv if argv is not None else sys.argv[1:])
    slug = slugify(f"tune {args.model.name} {label}")
    out_dir = BENCH_DIR / "results"
    out_dir.mkdir(exist_ok=True)
    result = dict(label=label, device=device, command=command, profile=str(path), profile_status=status, choice=tuned_name,
                  rows=rows, trials=trials, faster_than_tuned=beaten, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
    (out_dir / f"{slug}.json").write_text(json.dumps(result, indent=2))
    print(render_file(out_dir / f"{slug}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
