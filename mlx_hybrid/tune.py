"""`hybrid tune`: the speculation settings that are fastest for one model on this device.

A speculative step costs one verification pass over n candidate tokens plus the drafting, and
yields T tokens; how fast the pass grows with n depends on the device (ReDrafter section 4.2:
beam width 1 was best on an M1 Max, 3-4 on an M2 Ultra). The tuner measures, here:

1. the verification cost t(n): a target pass over n candidates after a chat-sized context, as a
   chain and as a branching tree (the tree mask takes a different attention path), timed as the
   greedy loop runs passes, each queued before the host reads the last;
2. acceptance: the target's greedy runs over calibration prompts (`calibration.greedy_runs`) give,
   for every ReDrafter beam width x length, the accepted drafts per step and the candidates left
   after prefix de-duplication, and for Medusa the head accuracies, from which the greedy sparse
   tree of each size has a known expected length (Medusa section 3.3.1);
3. the drafting cost of each setting;

On MLX's CUDA backend it first measures, for each projection weight shape of the model, the row
kernel against MLX's matmul at every candidate count, and keeps in the profile the most rows the
kernel should take for that shape (`linear.LIMITS`; the verification cost is then measured with
those limits, so the same cost model holds at every model size). Where a tree-attention kernel
runs (Metal, CUDA) it measures a pass with the kernel (at each of its simdgroup counts) and with
MLX's attention over the tree's mask at each tree size, and keeps the kernel's cheaper simdgroup
count and the most nodes it should take (`tree_attention.WARPS`, `tree_attention.LIMIT`). Then it
predicts tokens/s = T / (t(n) + drafting) for every setting, then runs the best predicted settings,
the defaults and plain decoding end to end on the prompts and keeps the fastest measured (so host
overheads the model leaves out cannot pick a loser); where the tree-attention kernel runs, the
fastest setting then runs end to end with the kernel's limit and with the other extreme in turns,
and the faster limit stays (`check_attention_limit`). The result is a profile
(`mlx_hybrid.profiles`) that chat and generate use from then on, and a plot of the curves.
"""

import time
from dataclasses import asdict
from pathlib import Path
from statistics import median

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_hybrid.cache import commit
from mlx_hybrid.decode import generate_step, prefill
from mlx_hybrid.errors import HybridError
from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid import tree_attention
from mlx_hybrid.models import linear, qlinear
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.profiles import Settings, device_name, model_key, shape_limits
from mlx_hybrid.speculative.calibration import beam_acceptance, greedy_runs
from mlx_hybrid.speculative.proposer import load_proposer
from mlx_hybrid.speculative.redrafter import trims_padding
from mlx_hybrid.speculative.steps import speculative_steps
from mlx_hybrid.speculative.tree import expected_length, greedy_paths
from mlx_hybrid.speculative.verify import verify
from mlx_hybrid.tree_mask import TreeMask

COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
WIDTHS = (1, 2, 3, 4, 6, 8)
MAX_LENGTH = 6
TREE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
PROMPTS_FILE = Path(__file__).parent / "data" / "lee_prompts.txt"


def calibration_prompts(path: str | Path | None = None) -> list[str]:
    """Prompts, one a line: path, or the first half of the shipped set (the Lee corpus held-out
    articles from gensim's PyPI wheel, two sentences each; the second half is the benchmarks')."""
    if path is None:
        lines = PROMPTS_FILE.read_text().splitlines()
        return lines[: len(lines) // 2]
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise HybridError(f"cannot read prompts from {path} ({e})") from None
    if not lines:
        raise HybridError(f"{path} has no prompts (one a line)")
    return lines


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm-up: kernels for this shape
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return median(times)


def stages(methods: list[str]) -> list[str]:
    """The stages `tune` reports progress for, in order."""
    return (["projection cost"] * (kernel_backend() == "cuda") + ["attention cost"] * (kernel_backend() is not None)
            + ["verification cost", "greedy runs"]
            + ["beam acceptance", "drafting cost"] * ("redrafter" in methods) + ["tree cost"] * ("medusa" in methods)
            + ["end-to-end runs"] + ["attention check"] * (kernel_backend() is not None))


def binary_tree(n: int) -> TreeMask:
    return TreeMask.from_parents([-1] + [(t - 1) // 2 for t in range(1, n)])


def projection_layers(model: nn.Module) -> dict[tuple[int, int], nn.Module]:
    """One layer of each weight shape (N, K) whose products over a pass's rows can take a row
    kernel: float `linear.Linear` layers (`row_matmul`), quantized ones in a format `qrow_matmul`
    reads, and the embedding where it is also the LM head."""
    found = {}
    for _, m in model.named_modules():
        if type(m) is qlinear.QuantizedLinear and qlinear.reads(m):
            found.setdefault((m.weight.shape[0], m.scales.shape[1] * m.group_size), m)
        elif type(m) is linear.Linear or (type(m) is nn.Embedding and getattr(model.args, "tie_word_embeddings", False)):
            found.setdefault(tuple(m.weight.shape), m)
    return found


def _products(layer: nn.Module, x: mx.array):
    """The kernel's and MLX's product of x with the layer's weight (transposed)."""
    if isinstance(layer, qlinear.QuantizedLinear):
        kw = dict(group_size=layer.group_size, bits=layer.bits)
        return (lambda: qlinear.qrow_matmul(x, layer.weight, layer.scales, layer.biases, backend="cuda", **kw),
                lambda: mx.quantized_matmul(x, layer.weight, layer.scales, layer.biases, transpose=True, **kw))
    return lambda: linear.row_matmul(x, layer.weight, backend="cuda"), lambda: x @ layer.weight.T


def row_limits(model: nn.Module, counts=COUNTS, reps: int = 5, chain: int = 10, progress=None) -> dict:
    """For each projection shape, seconds of `chain` products over n rows (each n of counts from 2
    to linear.ROWS) on its row kernel and on MLX's product, and the most rows the kernel should
    take (`linear.row_limit`): {"NxK": {"n", "kernel", "matmul", "limit"}}. A chain, so that the
    host's cost per launch counts as it does in a pass."""
    counts = [n for n in counts if 1 < n <= linear.ROWS]
    layers = projection_layers(model)
    out = {}
    for i, ((N, K), layer) in enumerate(layers.items()):
        dtype = layer.scales.dtype if isinstance(layer, qlinear.QuantizedLinear) else layer.weight.dtype
        times = {"kernel": [], "matmul": []}
        for n in counts:
            x = mx.random.normal((n, K), key=mx.random.key(n)).astype(dtype)
            mx.eval(x)
            for name, product in zip(times, _products(layer, x)):
                times[name].append(_median_seconds(lambda: mx.eval([product() for _ in range(chain)]), reps) / chain)
        out[f"{N}x{K}"] = {"n": counts, **times, "limit": linear.row_limit(counts, times["kernel"], times["matmul"])}
        if progress:
            progress(i + 1, len(layers))
    return out


def attention_limit(model: nn.Module, counts=COUNTS, context: int = 256, reps: int = 5, progress=None) -> dict:
    """Seconds of a verification pass over a binary tree of n nodes (2..64) after `context`
    tokens, its attention on the tree-attention kernel at each of `tree_attention.WARP_CHOICES`
    simdgroups a threadgroup and on MLX's attention with the tree's mask; the kernel's warps that
    cost least over all n, and the most nodes the kernel should take at them (`linear.row_limit`'s
    rule): {"n", "by_warps", "warps", "kernel", "masked", "limit"}. The whole pass as the greedy
    loop runs it (`queued_passes`), so that what the kernel saves in launches and what it costs
    in reads are weighed as the loop weighs them; the paths take turns, timing by timing, so that
    a host whose speed drifts over the minutes this takes favours none of them."""
    counts = [n for n in counts if n > 1]
    saved = tree_attention.LIMIT, tree_attention.WARPS
    runs = [(warps, None) for warps in tree_attention.WARP_CHOICES] + [(saved[1], 0)]  # the last: masked
    costs = [[] for _ in runs]
    timed = queued_passes(model, context)
    try:
        for i, n in enumerate(counts):
            seconds = [[] for _ in runs]
            for rep in range(reps + 1):  # round 0 warms each path up: its trace and kernels
                for j, (warps, limit) in enumerate(runs):
                    tree_attention.WARPS, tree_attention.LIMIT = warps, limit
                    t = timed(n, "tree")
                    if rep:
                        seconds[j].append(t)
            for cost, s in zip(costs, seconds):
                cost.append(median(s))
            if progress:
                progress(i + 1, len(counts))
    finally:
        tree_attention.LIMIT, tree_attention.WARPS = saved
    *kernel, masked = costs
    by_warps = dict(zip(tree_attention.WARP_CHOICES, kernel))
    warps = min(by_warps, key=lambda w: sum(by_warps[w]))
    return {"n": counts, "by_warps": {str(w): k for w, k in by_warps.items()}, "warps": warps, "kernel": by_warps[warps],
            "masked": masked, "limit": linear.row_limit(counts, by_warps[warps], masked)}


def verification_cost(model: nn.Module, counts=COUNTS, context: int = 256, reps: int = 5, progress=None,
                      shapes=("chain", "tree"), queued: int | None = None) -> dict:
    """Seconds per verification pass over n candidates after `context` tokens, as a chain and as
    a binary tree (those of `shapes`): {"n", "chain", "tree"}, the median of reps timings (after
    one that warms up) of `queued_passes`."""
    timed = queued_passes(model, context, queued)
    out = {"n": list(counts)} | {shape: [] for shape in shapes}
    for i, n in enumerate(counts):
        for shape in shapes:
            out[shape].append(median([timed(n, shape) for _ in range(reps + 1)][1:]))
        if progress:
            progress(i + 1, len(counts))
    return out


def queued_passes(model: nn.Module, context: int = 256, queued: int | None = None):
    """A timer of verification passes after `context` tokens: timed(n, shape) runs `queued`
    passes over n candidates as a chain or a binary tree ("chain", "tree") and returns seconds a
    pass. They run as the greedy loop runs them (`speculative.steps._greedy_passes`): placed on
    the device (`TreeMask.at`, so `verify` replays its compiled pass), each followed by its
    argmax and the cache moves of an accepted path (a `DevicePath` commit, written at the next
    pass; here the root alone, at the context's end, so every pass starts there), and each
    queued before the host reads the last one's argmax, so that one pass's host work overlaps
    another's device work. Timed one at a time instead, a pass costs the sum of the two, and
    that misjudges a kernel that trades host time for device time (`attention_limit`). queued:
    by default 4 on a GPU, 1 on the CPU, where the host computes the pass itself and nothing
    overlaps."""
    if queued is None:
        queued = 1 if mx.default_device().type == mx.DeviceType.cpu else 4
    rng = np.random.default_rng(0)
    V = model.args.vocab_size
    cache = model.make_cache()
    prefill(model, mx.array(rng.integers(0, V, context)), cache)
    pos = mx.array([cache[0].offset], mx.int32)
    root, last = mx.zeros((1,), mx.int32), mx.array(0, mx.int32)
    tokens, trees = {}, {}  # per n, and per (n, shape): made once, timed many times

    def timed(n: int, shape: str) -> float:
        if n not in tokens:
            tokens[n] = mx.array(rng.integers(0, V, n))[None]
        if (n, shape) not in trees:
            trees[n, shape] = TreeMask.chain(n) if shape == "chain" else binary_tree(n)
        tree = trees[n, shape]
        tic = time.perf_counter()
        behind = None
        for _ in range(queued):
            logits, _ = verify(model, tokens[n], cache, tree.at(pos, cache[0].offset))
            top = mx.argmax(logits[0], axis=-1)
            commit(cache, root, last)
            mx.async_eval(top)
            if behind is not None:
                np.array(behind)  # acceptance reads the pass behind on the host
            behind = top
        np.array(behind)
        return (time.perf_counter() - tic) / queued

    return timed


def _cost(verify: dict, n: float, branching: bool) -> float:
    return float(np.interp(n, verify["n"], verify["tree" if branching else "chain"]))


def decode_speed(model, proposer, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Greedy decode tokens/s over prompts (time from each prompt's first token to its last) and
    tokens per target pass; proposer None: plain decoding (`generate_step`)."""
    total, seconds, passes = 0, 0.0, 0
    for prompt in prompts:
        steps = (
            ((t,) for t, _ in generate_step(mx.array(prompt), model, model.make_cache(), lambda x: mx.argmax(x, -1), max_tokens=new_tokens))
            if proposer is None
            else (new for new, _ in speculative_steps(model, proposer, prompt, model.make_cache(), SamplingParams()))
        )
        n, k, tic = 0, 0, None
        for new in steps:
            if tic is None:
                tic = time.perf_counter()
            n, k = n + len(new), k + 1
            if n >= new_tokens:
                break
        seconds += time.perf_counter() - tic
        total, passes = total + n - 1, passes + k - 1
    return total / seconds, total / max(passes, 1)


def _measure(model, model_dir, method, settings, prompts, new_tokens) -> float:
    proposer = None if method is None else load_proposer(method, model, model_dir, settings=settings)
    # Warm-up on the same prompts: MLX's CUDA backend compiles kernels per shape on first use, and
    # each tree and cache length brings new shapes.
    decode_speed(model, proposer, prompts, new_tokens)
    return decode_speed(model, proposer, prompts, new_tokens)[0]


def tune(
    model: nn.Module,
    tokenizer,
    model_dir: str | Path,
    prompts: list[str],
    methods: list[str],
    new_tokens: int = 48,
    widths=WIDTHS,
    max_length: int = MAX_LENGTH,
    tree_sizes=TREE_SIZES,
    counts=COUNTS,
    validate: int = 2,
    progress=None,
    into: dict | None = None,
) -> dict:
    """Measure, predict and validate (module docstring); returns the profile.

    progress(stage, done, total) reports each stage (`stages(methods)`, in order). validate: how
    many of the best predicted settings per method are run end to end, besides the default.
    into: the dict the profile is built in, so that a caller interrupted mid-way (Ctrl-C) keeps
    the results of the stages its "stages" list names as finished."""
    report = progress or (lambda *a: None)
    ids = [tokenizer.encode(p) for p in prompts]
    model_dir = Path(model_dir)
    profile = into if into is not None else {}
    profile.update({"device": device_name(), "model": str(model_dir.resolve()), "model_key": model_key(model_dir),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "mlx": mx.__version__, "new_tokens": new_tokens,
                    "prompts": len(prompts), "stages": []})
    if kernel_backend() == "cuda":
        limits = profile["row_limits"] = row_limits(model, counts, progress=lambda d, t: report("projection cost", d, t))
        linear.LIMITS.update(shape_limits(limits))
        profile["stages"].append("projection cost")
    if kernel_backend() is not None:
        attention = profile["tree_attention"] = attention_limit(model, counts, progress=lambda d, t: report("attention cost", d, t))
        tree_attention.LIMIT, tree_attention.WARPS = attention["limit"], attention["warps"]
        profile["stages"].append("attention cost")
    verify = verification_cost(model, counts, progress=lambda d, t: report("verification cost", d, t))
    profile["verification_seconds"] = verify
    profile["stages"].append("verification cost")
    runs = greedy_runs(model, ids, new_tokens, progress=lambda d, t: report("greedy runs", d, t))
    hidden = runs[0].hidden[0]
    history = runs[0].tokens[: runs[0].start + 2]
    candidates = {}  # method -> [(settings, prediction row)]
    if "redrafter" in methods:
        proposer = load_proposer("redrafter", model, model_dir)
        stats = beam_acceptance(proposer.drafter, proposer.embed, runs, list(widths), max_length,
                                progress=lambda d, t: report("beam acceptance", d, t))
        rows = []
        for s in stats:
            for length, acc, cand in zip(s.lengths, s.accepted.mean(1), s.candidates.mean(1)):
                settings = Settings(s.width, length)
                p = load_proposer("redrafter", model, model_dir, settings=settings)
                draft = _median_seconds(lambda: mx.eval(p.draft(mx.array(history[-1:]), hidden).arrays()), 3)
                verified = cand if trims_padding() else s.width * (length - 1) + 1  # a packed beam's padding
                step = _cost(verify, verified, s.width > 1) + draft
                rows.append(dict(beam_width=s.width, beam_length=length, tokens_per_step=1 + float(acc), candidates=float(cand),
                                 draft_seconds=draft, predicted_tps=(1 + acc) / step))
            report("drafting cost", len(rows), len(stats) * len(stats[0].lengths))
        default = Settings(proposer.drafter.config.beam_width, proposer.drafter.config.beam_length)
        candidates["redrafter"] = (rows, default, lambda r: Settings(r["beam_width"], r["beam_length"]))
        profile["redrafter"] = rows
        profile["stages"].append("drafting cost")
    if "medusa" in methods:
        from mlx_hybrid.speculative.medusa import head_accuracies

        proposer = load_proposer("medusa", model, model_dir)
        heads = proposer.heads
        acc = head_accuracies(heads, runs)
        profile["medusa_head_accuracies"] = acc.round(4).tolist()
        rows = []
        sizes = [s for s in tree_sizes if s <= acc.size]
        for i, size in enumerate(sizes):
            paths = greedy_paths(acc, size)
            settings = Settings(medusa_choices=paths)
            p = load_proposer("medusa", model, model_dir, settings=settings)
            draft = _median_seconds(lambda: mx.eval(p.draft(mx.array(history[-1:]), hidden).arrays()), 3)
            per_step = expected_length(paths, acc)
            step = _cost(verify, size + 1, p.tree.tree.mask is not None) + draft
            rows.append(dict(tree_size=size, medusa_choices=paths, tokens_per_step=per_step, draft_seconds=draft,
                             predicted_tps=per_step / step))
            report("tree cost", i + 1, len(sizes))
        candidates["medusa"] = (rows, Settings(), lambda r: Settings(medusa_choices=r["medusa_choices"]))
        profile["medusa"] = rows
        profile["stages"].append("tree cost")

    # End to end: plain decoding, each method's default and its best predictions.
    todo = [("plain", None, None, None)]
    for method, (rows, default, to_settings) in candidates.items():
        todo.append((method, "default", default, None))
        for r in sorted(rows, key=lambda r: -r["predicted_tps"])[:validate]:
            todo.append((method, "predicted", to_settings(r), r))
    measured = profile["measured"] = []
    for i, (method, kind, settings, row) in enumerate(todo):
        tps = _measure(model, model_dir, None if method == "plain" else method, settings, ids[:3], new_tokens)
        entry = dict(method=method, kind=kind, tps=tps, **({k: v for k, v in asdict(settings).items() if v} if settings else {}))
        entry.pop("source", None)
        measured.append(entry)
        if row is not None:
            row["measured_tps"] = tps
        report("end-to-end runs", i + 1, len(todo))
    profile["stages"].append("end-to-end runs")
    plain = measured[0]["tps"]
    profile["plain_tps"] = plain
    profile["best"] = {}
    for method in candidates:
        best = max((m for m in measured if m["method"] == method), key=lambda m: m["tps"])
        profile["best"][method] = {k: v for k, v in best.items() if k not in ("method", "kind")} | {"speedup": best["tps"] / plain}
    i = max(range(len(measured)), key=lambda i: measured[i]["tps"])
    fastest = measured[i]
    profile["choice"] = None if fastest["method"] == "plain" else fastest["method"]
    if "tree_attention" in profile and profile["choice"] is not None:
        method, _, settings, _ = todo[i]
        attention = profile["tree_attention"]
        attention["end_to_end"] = check_attention_limit(
            attention["limit"], max(attention["n"]), lambda: _measure(model, model_dir, method, settings, ids[:3], new_tokens),
            progress=lambda d, t: report("attention check", d, t))
        attention["limit"] = attention["end_to_end"]["limit"]
        profile["stages"].append("attention check")
    return profile


def check_attention_limit(limit: int, largest: int, measure, rounds: int = 2, progress=None) -> dict:
    """The tree-attention kernel's limit, checked end to end on the chosen setting: measure()
    gives its tokens/s, run with `tree_attention.LIMIT` set to each limit in turn, and the limit
    kept is left set. The passes `attention_limit` times carry less host work than the loop's (no
    drafting, no Python between passes), and the kernel's gain is in host work (one launch a
    layer for MLX's four), so where the two paths time close there the loop can still favour one
    clearly. The other extreme (the kernel for every tree up to `largest` nodes where limit stops
    short of that, else MLX's attention for every tree) runs in turns with limit, `rounds` times
    each, and the one with the higher median stays (limit on a tie):
    {"limit", "tps": {limit: [tokens/s, ...], ...}}."""
    other = largest if limit < largest else 0
    tps = {limit: [], other: []}
    for i in range(rounds):
        for n in tps:
            tree_attention.LIMIT = n
            tps[n].append(measure())
        if progress:
            progress(i + 1, rounds)
    best = tree_attention.LIMIT = other if median(tps[other]) > median(tps[limit]) else limit
    return {"limit": best, "tps": {str(n): v for n, v in tps.items()}}


def plot(profile: dict, path: Path):
    """Predicted (lines) and measured (points) tokens/s vs beam width per beam length, Medusa's vs
    tree size, and the verification cost vs candidates (with the attention cost stage's two
    paths, where it ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + ("redrafter" in profile) + ("medusa" in profile)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.6))
    axes = np.atleast_1d(axes)
    v = profile["verification_seconds"]
    ax = axes[0]
    ax.plot(v["n"], np.array(v["chain"]) * 1e3, "o-", label="chain")
    ax.plot(v["n"], np.array(v["tree"]) * 1e3, "s--", label="tree")
    if "tree_attention" in profile:  # the attention cost stage: which path a tree's attention takes
        a = profile["tree_attention"]
        ax.plot(a["n"], np.array(a["kernel"]) * 1e3, ":", label="tree, attention kernel")
        ax.plot(a["n"], np.array(a["masked"]) * 1e3, ":", label="tree, MLX attention + mask")
    ax.set(xlabel="candidate tokens verified", ylabel="ms per verification pass", title="verification cost")
    ax.legend(fontsize=8)
    k = 1
    if "redrafter" in profile:
        ax = axes[k]
        k += 1
        rows = profile["redrafter"]
        for length in sorted({r["beam_length"] for r in rows}):
            rs = sorted((r for r in rows if r["beam_length"] == length), key=lambda r: r["beam_width"])
            line = ax.plot([r["beam_width"] for r in rs], [r["predicted_tps"] for r in rs], "-", label=f"BL {length}")[0]
            pts = [r for r in rs if "measured_tps" in r]
            ax.plot([r["beam_width"] for r in pts], [r["measured_tps"] for r in pts], "o", color=line.get_color())
        ax.axhline(profile["plain_tps"], color="gray", ls=":", label="plain")
        ax.set(xlabel="beam width", ylabel="tokens/s", title="ReDrafter: predicted (lines), measured (dots)")
        ax.legend(fontsize=7, ncol=2)
    if "medusa" in profile:
        ax = axes[k]
        rows = profile["medusa"]
        ax.plot([r["tree_size"] for r in rows], [r["predicted_tps"] for r in rows], "-", label="predicted")
        pts = [r for r in rows if "measured_tps" in r]
        ax.plot([r["tree_size"] for r in pts], [r["measured_tps"] for r in pts], "o", label="measured")
        ax.axhline(profile["plain_tps"], color="gray", ls=":", label="plain")
        ax.set(xscale="log", xlabel="tree candidates", ylabel="tokens/s", title="Medusa")
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(profile['model']).name} on {profile['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
