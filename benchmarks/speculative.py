#!/usr/bin/env python
"""Speculative decoding: decode tokens/s and tokens per target pass, each method vs plain decoding.

One process, one backend, the same weights for everything: this runtime's plain greedy decoding,
its Medusa, ReDrafter and draft-model speculation, and mlx-lm's plain and draft-model
(`speculative_generate_step`) decoding. Greedy, exactly --gen-tokens tokens after a fixed-seed
prompt (--model: real news prompts held out from tuning; --synthetic: random tokens); each runner is
warmed up once, then each trial runs them prompt by prompt, in turn. Decode
tokens/s = (tokens - 1) / time from the first to the last token, as in benchmarks/run.py (median
of the trials); "vs mlx-hybrid plain" is the median of each trial's ratio to that trial's plain
decoding.
"same tokens" checks each method's output against our plain greedy tokens.

--model DIR takes a target with its `medusa/`, `redrafter/` and `draft/` subdirectories
(docs/formats/speculative-heads.md; the trained ones come from train_cuda/). --synthetic NAME
builds a random-weight target in a real shape, Medusa heads initialized as Medusa does before
training (ResBlocks zero, LM heads copies of the target's) and the same heads ending with the
target's own LM head (`medusa-tied/`, a row "medusa tied": one vocabulary projection a draft), a
random drafter, and a draft made of the target's first --draft-layers layers: acceptance is then
low and the numbers show overhead, not the speedup trained heads give. --medusa-sizes 16,24 adds a Medusa row per tree size and
--beam 4x5,2x5 a ReDrafter row per beam, side by side with the rest. --oracle adds, for each Medusa
tree and ReDrafter beam, a row whose drafts are the target's own greedy continuation corrupted to
the per-depth acceptance --profile (benchmarks/oracle.py): the speedup those heads would give at
that acceptance, at any model size. "vs mlx-lm draft" is each row's paired ratio to mlx-lm's
draft-model decoding.

    python -m benchmarks.speculative --synthetic smollm2-135m
    python -m benchmarks.speculative --synthetic llama-3-8b --oracle --profile 0.6,0.5,0.45,0.4
    python -m benchmarks.speculative --model path/to/model --label "NVIDIA H100, MLX CUDA backend"
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from functools import partial
from pathlib import Path
from statistics import median

import mlx.core as mx
import mlx.utils

BENCH_DIR = Path(__file__).resolve().parent
from benchmarks.index import render_file  # noqa: E402
from benchmarks.oracle import PROFILE, OracleBeams, OracleDraft, OracleTree, continuation, parse_profile  # noqa: E402
from benchmarks.run import SYNTHETIC, device_description, make_synthetic, parse_beam, slugify  # noqa: E402

from mlx_hybrid.chat import render_chat  # noqa: E402
from mlx_hybrid.errors import HybridError  # noqa: E402
from mlx_hybrid.decode import generate_step  # noqa: E402
from mlx_hybrid.sampling import SamplingParams  # noqa: E402
from mlx_hybrid.loader import DTYPES, load_model, load_tokenizer  # noqa: E402
from mlx_hybrid.profiles import Settings  # noqa: E402
from mlx_hybrid.speculative.proposer import load_proposer  # noqa: E402
from mlx_hybrid.speculative.steps import speculative_steps  # noqa: E402
from mlx_hybrid.speculative.load import target_dtype  # noqa: E402
from mlx_hybrid.tree_attention import WARP_CHOICES  # noqa: E402
from mlx_hybrid.tune import PROMPTS_FILE  # noqa: E402

# Chat questions the SmolLM2 teacher wrote itself (Magpie) in the default model's training run
# (train_cuda/scripts/real_default.py), its last 128: held out from the default's distillation and
# drafter data, and dropped from the heads run's data (real_heads.py).
CHAT_PROMPTS = BENCH_DIR / "chat_prompts.txt"


def write_heads(target_dir: Path, model, seed: int, draft_layers: int):
    """Medusa heads (Medusa's initialization), the same heads with `tied_lm_head`, a random
    drafter and (draft_layers > 0) a draft of the target's first layers, in the
    docs/formats/speculative-heads.md layout, beside a synthetic target."""
    from safetensors.numpy import save_file

    import numpy as np

    rng = np.random.default_rng(seed)
    H, V = model.args.hidden_size, model.args.vocab_size
    lm = np.array((model.lm_head.weight if "lm_head" in model else model.model.embed_tokens.weight).astype(mx.float16))  # as the target is stored
    heads = 4
    medusa = {}
    for i in range(heads):
        medusa[f"medusa_head.{i}.0.linear.weight"] = np.zeros((H, H), np.float32)
        medusa[f"medusa_head.{i}.0.linear.bias"] = np.zeros(H, np.float32)
        medusa[f"medusa_head.{i}.1.weight"] = lm
    drafter = {
        "lm_head.0.linear.weight": rng.normal(0, 0.02, (2 * H, 2 * H)).astype(np.float16),
        "lm_head.0.linear.bias": np.zeros(2 * H, np.float32),
        "lm_head.1.weight": rng.normal(0, 0.02, (V, 2 * H)).astype(np.float16),
        "rnn_u.weight": rng.normal(0, 0.02, (H, H)).astype(np.float16),
        "rnn_u.bias": np.zeros(H, np.float32),
        "rnn_w.weight": rng.normal(0, 0.02, (H, H)).astype(np.float16),
    }
    tied = {k: v for k, v in medusa.items() if not k.endswith(".1.weight")}
    for name, tensors, config in [
        ("medusa", medusa, dict(model_type="medusa", medusa_num_heads=heads, medusa_num_layers=1)),
        ("medusa-tied", tied, dict(model_type="medusa", medusa_num_heads=heads, medusa_num_layers=1, tied_lm_head=True)),
        ("redrafter", drafter, dict(model_type="recurrent_drafting_drafter", exit_dim=2 * H, num_draft_layers=1, rnn=True)),
    ]:
        (target_dir / name).mkdir(exist_ok=True)
        save_file(tensors, str(target_dir / name / "model.safetensors"))
        (target_dir / name / "config.json").write_text(json.dumps(dict(config, hidden_size=H, vocab_size=V)))
    if not draft_layers:
        return
    draft = target_dir / "draft"
    draft.mkdir(exist_ok=True)
    config = json.loads((target_dir / "config.json").read_text())
    config["num_hidden_layers"] = draft_layers
    (draft / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(next(target_dir.glob("*.safetensors"))))
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}
    mx.save_safetensors(str(draft / "model.safetensors"), keep)


def timed(tokens_iter, n: int):
    """Drive a token generator for n tokens: (tokens, seconds from first to last token)."""
    tokens, first = [], None
    for t in tokens_iter:
        tokens.append(t)
        if first is None:
            first = time.perf_counter()
        if len(tokens) == n:
            break
    return tokens, time.perf_counter() - first


def synthetic_target(d: Path, shape: str = "smollm2-135m", heads: bool = True) -> Path:
    """d, made first where it has no model: random weights in `shape` (SYNTHETIC) with, where
    heads, untrained heads and a 2-layer draft beside them (`write_heads`), as the pass-cost tools
    use it."""
    if not (d / "config.json").is_file():
        make_synthetic(shape, d, seed=0)
        if heads:
            write_heads(d, load_model(d), 0, 2)
    return d


def kernel_limits(target_dir: Path, model, tree_limit: int | None = None, tree_warps: int | None = None) -> dict:
    """Which parts of a pass take this project's kernels (`linear.LIMITS`, `tree_attention.LIMIT`)
    and the tree kernel's simdgroups (`tree_attention.WARPS`), set as `hybrid chat` sets them: from
    the model's tuning profile, else, where the kernels run, measured now as `hybrid tune`
    measures them, so that a pass never takes the slower path. tree_limit (and tree_warps): the
    tree kernel's instead, to compare the two attention paths end to end. Returns them for the
    result file, with the attention measurement where it ran here (`check_tree_limit` checks
    its limit end to end)."""
    from mlx_hybrid import profiles, tree_attention, tune
    from mlx_hybrid.kernels import kernel_backend
    from mlx_hybrid.models import linear

    rows, tree, warps = profiles.kernel_limits(target_dir, model)
    measured = None
    if not rows and kernel_backend() == "cuda":
        rows = profiles.shape_limits(tune.row_limits(model))
    linear.LIMITS.update(rows)
    if tree_limit is not None:
        tree, warps = tree_limit, tree_warps or warps
    elif tree is None and kernel_backend() is not None:
        measured = tune.attention_limit(model)
        tree, warps = measured["limit"], measured["warps"]
    tree_attention.LIMIT, tree_attention.WARPS = tree, warps
    return {"row_limits": {f"{n}x{k}": v for (n, k), v in rows.items()}, "tree_attention_limit": tree,
            "tree_attention_warps": tree_attention.WARPS} | ({"tree_attention_measured": measured} if measured else {})


def check_tree_limit(run: dict, limits: dict, prompt: list[int], n: int) -> dict:
    """A tree-attention limit measured here (`tune.attention_limit`), checked end to end as
    `hybrid tune` checks its own (`tune.check_attention_limit`, which leaves the faster set), on
    the first ReDrafter row (else Medusa's): the measured limit and the other extreme in turns.
    limits: `kernel_limits`' result, returned with the limit kept and the check's runs."""
    from mlx_hybrid import tune

    name = next((m for kind in ("redrafter", "medusa") for m in run if kind in m), None)
    if "tree_attention_measured" not in limits or name is None:
        return limits

    def measure() -> float:
        run[name](prompt, n)  # warm-up: this limit's trace
        tokens, secs, _ = run[name](prompt, n)
        return (len(tokens) - 1) / secs

    check = tune.check_attention_limit(limits["tree_attention_limit"], max(limits["tree_attention_measured"]["n"]), measure)
    return limits | {"tree_attention_limit": check["limit"], "tree_attention_check": check | {"method": name}}


def runners(target_dir: Path, ours, k: int, beams: list[tuple[int, int]], medusa_sizes: list[int] = (),
            heads_dtype: str | None = None, profile: tuple[float, ...] | None = None, heads_rows: bool = True):
    """name -> function(prompt, n) -> (tokens, seconds, target passes). ReDrafter runs with each
    beam (the first named plainly), Medusa with its own tree and with each tree size; with
    heads_dtype, each of those again with its heads in that dtype; with profile, an oracle of
    each tree and beam drafting at that acceptance. heads_rows=False: the oracle rows only, the
    heads on disk giving just their shapes (a peaked target's untrained heads predict its next
    token by construction: with tied embeddings it repeats its last one, as a head that has not
    moved off the target's own LM head does)."""
    from mlx_lm.generate import generate_step as lm_generate_step
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.utils import load_model as lm_load_model

    dtype = DTYPES[target_dtype(ours)]
    cast = lambda m: m.update(mlx.utils.tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, m.parameters())) or m  # noqa: E731
    try:
        lm_target = cast(lm_load_model(target_dir)[0])
    except ValueError:  # "Model type llama_hybrid not supported": mlx-lm has no hybrid models
        lm_target = None
    lm_draft = cast(lm_load_model(target_dir / "draft")[0]) if lm_target and (target_dir / "draft").is_dir() else None
    greedy = SamplingParams()
    argmax = lambda x: mx.argmax(x, axis=-1)  # noqa: E731

    def ours_plain(prompt, n):
        toks, secs = timed((t for t, _ in generate_step(mx.array(prompt), ours, ours.make_cache(), argmax, max_tokens=n)), n)
        return toks, secs, n

    def lm_plain(prompt, n):
        toks, secs = timed((int(t) for t, _ in lm_generate_step(mx.array(prompt), lm_target, max_tokens=n, sampler=argmax)), n)
        return toks, secs, n

    def spec(proposer):
        def run(prompt, n):
            steps = [0]

            def tokens():
                for new, _ in speculative_steps(ours, proposer, prompt, ours.make_cache(), greedy):
                    steps[0] += 1
                    yield from new

            toks, secs = timed(tokens(), n)
            return toks, secs, steps[0]

        return run

    references = {}

    def reference(prompt, n):
        """The prompt and its first n greedy tokens, computed once."""
        key = (tuple(prompt), n)
        if key not in references:
            references[key] = list(prompt) + continuation(ours, prompt, n)
        return references[key]

    def oracle(make, depth):
        """A fresh oracle each run (its draws start over), on the prompt's greedy continuation."""
        def run(prompt, n):
            proposer = make(reference(prompt, n + depth), len(prompt), profile, ours.args.vocab_size)
            return spec(proposer)(prompt, n)

        return run

    def lm_spec(prompt, n, draft=None):
        steps = [0]

        def tokens():
            for t, _, from_draft in speculative_generate_step(
                mx.array(prompt), lm_target, draft or lm_draft, num_draft_tokens=k, max_tokens=n, sampler=argmax
            ):
                steps[0] += not from_draft
                yield int(t)

        toks, secs = timed(tokens(), n)
        return toks, secs, steps[0]

    def lm_oracle(prompt, n):
        """mlx-lm's draft-model decoding with a draft at the oracle's acceptance (`OracleDraft`)."""
        return lm_spec(prompt, n, OracleDraft(reference(prompt, n + k), len(prompt), profile[:k], ours.args.vocab_size))

    out = {"mlx-hybrid plain": ours_plain} | ({"mlx-lm plain": lm_plain} if lm_target else {})
    variants = {
        "medusa": [("", None)] + [(f" {n} nodes", Settings(tree_size=n)) for n in medusa_sizes],
        "redrafter": [("" if i == 0 else f" {w}x{l}", Settings(w, l)) for i, (w, l) in enumerate(beams)],
        "draft": [("", None)],
    }
    dtypes = [(None, "")] + ([(heads_dtype, f" {heads_dtype} heads")] if heads_dtype else [])
    for method, settings in variants.items():
        if (target_dir / method).is_dir():
            for suffix, setting in settings:
                for dtype, named in dtypes if method != "draft" else dtypes[:1]:
                    proposer = load_proposer(method, ours, target_dir, num_draft=k, settings=setting, heads_dtype=dtype)
                    if heads_rows:
                        out[f"mlx-hybrid {method}{suffix}{named}"] = spec(proposer)
                if profile is not None and method == "medusa":
                    out[f"mlx-hybrid oracle medusa{suffix}"] = oracle(partial(OracleTree, proposer.tree), proposer.depth)
                elif profile is not None and method == "redrafter":
                    out[f"mlx-hybrid oracle redrafter{suffix}"] = oracle(partial(OracleBeams, proposer.width, proposer.length), proposer.depth)
    if heads_rows and (target_dir / "medusa-tied").is_dir():
        out["mlx-hybrid medusa tied"] = spec(load_proposer("medusa", ours, path=target_dir / "medusa-tied", num_draft=k))
    if lm_draft is not None:
        out["mlx-lm draft"] = lm_spec
    if profile is not None and lm_target is not None:
        out["mlx-lm oracle draft"] = lm_oracle
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="target directory with medusa/, redrafter/, draft/ beside it")
    src.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="random-weight target in this shape")
    p.add_argument("--prompt-tokens", type=int, default=128, help="synthetic: random prompt length")
    p.add_argument("--prompts", type=int, default=4, help="--model: held-out prompts per trial")
    p.add_argument("--prompt-set", choices=("chat", "news"), default="chat",
                   help="--model: chat questions (chat_prompts.txt, in the chat template) or news openings")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--num-draft", type=int, default=4, help="draft tokens per step (ours and mlx-lm's)")
    p.add_argument("--beam", default="4x4", help="ReDrafter beam width x length; several, comma-separated, give a row each")
    p.add_argument("--medusa-sizes", default="", help="Medusa tree sizes (comma-separated) to run beside its own tree, "
                   "each the greedy tree from the calibrated head accuracies")
    p.add_argument("--heads-dtype", choices=sorted(DTYPES), default=None,
                   help="run each Medusa and ReDrafter row again with the heads in this dtype (default: the target's only)")
    p.add_argument("--draft-layers", type=int, default=2, help="synthetic: layers of the truncated draft")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="the target's float dtype (default: the runtime's for its files)")
    p.add_argument("--oracle", action="store_true", help="add oracle rows: drafts from the target's greedy continuation "
                   "at the --profile acceptance, in each Medusa tree's and ReDrafter beam's shape")
    p.add_argument("--profile", default=",".join(map(str, PROFILE)),
                   help="--oracle: per-depth acceptance, depth d's chance given d - 1 was right (default: the 135M "
                   "default's trained drafter, benchmarks/oracle.py)")
    p.add_argument("--tree-limit", type=int, default=None, help="the most nodes the tree-attention kernel takes (0: MLX's "
                   "attention over the tree's mask everywhere), instead of the profile's or a measured limit")
    p.add_argument("--tree-warps", type=int, choices=WARP_CHOICES, default=None, help="with --tree-limit: the kernel's simdgroups a threadgroup")
    p.add_argument("--work-dir", type=Path, default=BENCH_DIR / "results" / "models")
    p.add_argument("--label", default=None)
    p.add_argument("--results", type=Path, default=BENCH_DIR / "results", help="where the JSON and plot go")
    args = p.parse_args(argv)
    try:
        beams = [parse_beam(b) for b in args.beam.split(",")]
        medusa_sizes = [int(n) for n in args.medusa_sizes.split(",") if n]
    except ValueError:
        p.error(f"--beam takes WxL[,WxL...] and --medusa-sizes N[,N...], got {args.beam!r} and {args.medusa_sizes!r}")
    if args.tree_limit is not None and args.tree_limit < 0:
        p.error(f"--tree-limit takes a node count >= 0, got {args.tree_limit}")
    if args.tree_warps is not None and args.tree_limit is None:
        p.error("--tree-warps goes with --tree-limit")
    try:
        profile = parse_profile(args.profile) if args.oracle else None
    except HybridError as e:
        p.error(str(e))

    if args.synthetic:
        # With --oracle a peaked target (run.make_synthetic), so that passes decode the oracle's
        # continuation; a draft of its first layers would agree with it always, so mlx-lm's
        # draft-model row runs an oracle draft instead (OracleDraft), and its untrained heads
        # give the oracle rows their shapes but no rows of their own.
        peaked = args.oracle
        target_dir = args.work_dir / f"{args.synthetic}{'-peaked' if peaked else ''}-speculative"
        if not (target_dir / "config.json").is_file():
            make_synthetic(args.synthetic, target_dir, seed=0, peaked=peaked)
        ours = load_model(target_dir, args.dtype)
        if not (target_dir / "medusa").is_dir():
            write_heads(target_dir, ours, seed=0, draft_layers=0 if peaked else args.draft_layers)
    else:
        target_dir = args.model
        ours = load_model(target_dir, args.dtype)
    limits = kernel_limits(target_dir, ours, args.tree_limit, args.tree_warps)
    device = device_description()
    label = args.label or device["default_label"]
    if args.synthetic:
        prompts = [mx.random.randint(0, ours.args.vocab_size, (args.prompt_tokens,), key=mx.random.key(0)).tolist()]
        prompt_desc = f"{args.prompt_tokens} random prompt tokens"
    elif args.prompt_set == "chat":  # questions held out from every training run (chat_prompts.txt)
        tokenizer = load_tokenizer(target_dir)
        lines = CHAT_PROMPTS.read_text().splitlines()[: args.prompts]
        prompts = [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in lines]
        prompt_desc = f"each of {len(prompts)} held-out chat questions"
    else:  # real text: the held-out half of the shipped prompts (the tuner calibrates on the other half)
        tokenizer = load_tokenizer(target_dir)
        lines = PROMPTS_FILE.read_text().splitlines()
        prompts = [tokenizer.encode(t) for t in lines[len(lines) // 2 :][: args.prompts]]
        prompt_desc = f"each of {len(prompts)} held-out news prompts"
    run = runners(target_dir, ours, args.num_draft, beams, medusa_sizes, args.heads_dtype, profile, heads_rows=not (args.synthetic and args.oracle))
    limits = check_tree_limit(run, limits, prompts[0], args.gen_tokens)
    trials = {name: [] for name in run}
    reference = {}
    for name, fn in run.items():  # warm-up; the reference tokens
        for i, prompt in enumerate(prompts):
            reference.setdefault(i, fn(prompt, args.gen_tokens)[0])
    for _ in range(args.trials):
        # Prompt by prompt, every runner in turn: on a host whose speed drifts from second to
        # second (a GPU's host), runners compared within a trial then ran under the same drift.
        results = {name: [] for name in run}
        for prompt in prompts:
            for name, fn in run.items():
                results[name].append(fn(prompt, args.gen_tokens))
        for name, rs in results.items():
            tokens, secs = sum(len(t) - 1 for t, _, _ in rs), sum(s for _, s, _ in rs)
            steps = sum(k - 1 for _, _, k in rs)
            same = all(t == reference[i] for i, (t, _, _) in enumerate(rs))
            trials[name].append(dict(tps=tokens / secs, tokens_per_step=tokens / max(steps, 1), same=same))
    plain = [t["tps"] for t in trials["mlx-hybrid plain"]]
    rows = []
    for name, ts in trials.items():
        tps = median(t["tps"] for t in ts)
        speedup = median(t["tps"] / p for t, p in zip(ts, plain))  # paired: each trial against its own plain run
        per_step = median(t["tokens_per_step"] for t in ts) if "plain" not in name else 1.0
        rows.append(dict(method=name, tps=tps, speedup=speedup, tokens_per_step=per_step, same=all(t["same"] for t in ts)))
    command = "python -m benchmarks.speculative " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = dict(label=label, device=device, command=command, model=str(args.synthetic or args.model),
                  dtype=target_dtype(ours), prompts=prompt_desc, **limits, args={k: str(v) for k, v in vars(args).items()},
                  rows=rows, trials=trials, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
    slug = slugify(f"speculative {args.synthetic or args.model.name} {'' if args.synthetic else args.prompt_set} {label}")
    out_dir = args.results
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{slug}.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / f"{slug}.png")
    print(render_file(out_dir / f"{slug}.json"))
    return 0


def plot(result: dict, path: Path) -> None:
    """Each row's tokens/s as a bar, titled by the model's name (a directory's last part: the
    plot travels with the results, the path it was run from does not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh([r["method"] for r in rows][::-1], [r["tps"] for r in rows][::-1], color="tab:blue")
    ax.set_xlabel("decode tokens/s (greedy)")
    ax.set_title(f"{Path(result['model']).name}, {result['label']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
