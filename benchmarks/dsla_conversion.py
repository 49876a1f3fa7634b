#!/usr/bin/env python
"""Quality and cache memory at each DSLA conversion rate: perplexity ratio to the unconverted model.

`run` takes a model directory with DSLA weights (`dsla_conversion` in config.json,
docs/formats/hybrid-checkpoint.md) and, for k = 0 .. max_layers layers run as DSLA (least
sensitive first, as the runtime's policy converts them), measures perplexity on held-out text
(token blocks of --seq-len, each from an empty cache) and the cache memory: measured after a
block, and the policy's exact estimate at --context tokens. It also lists the conversion the
policy picks per prompt length under --budget (DSLA-Serve's Table 4 is such a table, set by hand).

The real numbers come from distilled DSLA weights: train_cuda/scripts/real_dsla.py runs
train_cuda's `dsla` stage (DSLA-Serve's chained conversion) and exports OUT/adaptive with
`hybrid_train.model.save_adaptive`; `run --model OUT/adaptive` measures it.

`build` makes such a directory without training, for trying the pipeline: every attention layer
of SOURCE also gets an attention-initialized DSLA (q, k, v, o copied, gates as train_cuda
initializes them: history gate near 1, recency gate random), ordered by attention entropy
(DSLA-Serve eq. 11, final query, averaged over heads and calibration blocks). Undistilled DSLA
layers are far worse than distilled ones. Both write entropy.json with the command that made the
weights, which `run` puts above its results.

Held-out text: the Lee corpus shipped in gensim's PyPI wheel (train_cuda/scripts/fetch_corpus.py
fetches it: train.txt for calibration, heldout.txt for perplexity).

    python train_cuda/scripts/fetch_corpus.py corpus
    python -m benchmarks.dsla_conversion build --source MODEL_DIR --calibration corpus/train.txt --out runs/smol-dsla
    python -m benchmarks.dsla_conversion run --model runs/smol-dsla --text corpus/heldout.txt
    python train_cuda/scripts/real_dsla.py --base SmolLM2-135M-Instruct.Q4_1.gguf --corpus corpus --out runs/dsla
    python -m benchmarks.dsla_conversion run --model runs/dsla/adaptive --text corpus/heldout.txt --label "..."
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
from benchmarks.index import render_file  # noqa: E402
from benchmarks.run import device_description, slugify  # noqa: E402

from mlx_hybrid.adaptive import ConversionPolicy, cache_nbytes, format_bytes, parse_budget, request_chunks  # noqa: E402
from mlx_hybrid.errors import HybridError  # noqa: E402
from mlx_hybrid.loader import load, load_weights  # noqa: E402
from mlx_hybrid.rope import apply_rope  # noqa: E402

PROMPTS = (512, 1024, 2048, 4096, 8192, 16384)


def blocks(tokenizer, file: Path, seq_len: int, limit: int | None) -> list[list[int]]:
    ids = tokenizer.encode(file.read_text(encoding="utf-8"))
    out = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    return out[:limit]


def attention_entropy(model, prompts: list[list[int]]) -> list[float]:
    """Per layer: entropy (nats) of the final query's attention, mean over heads and prompts."""
    total = np.zeros(len(model.layers))
    for ids in prompts:
        h = model.model.embed_tokens(mx.array([ids]))
        cache = model.make_cache()
        for i, (layer, c) in enumerate(zip(model.layers, cache)):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            L = x.shape[1]
            qkv = attn.qkv_proj(x).reshape(1, L, -1, attn.head_dim).transpose(0, 2, 1, 3)
            q, k, _ = mx.split(qkv, [attn.n_heads, attn.n_heads + attn.n_kv_heads], axis=1)
            q = apply_rope(q[:, :, -1:], attn._freqs, L - 1)
            k = mx.repeat(apply_rope(k, attn._freqs, 0), attn.n_heads // attn.n_kv_heads, axis=1)
            p = mx.softmax((q * attn.scale) @ k.swapaxes(-1, -2), axis=-1, precise=True)
            total[i] += (-(p * mx.log(mx.maximum(p, 1e-30))).sum(-1)).mean().item()
            h = layer(h, cache=c)
    return list(total / len(prompts))


def build(a) -> int:
    """An adaptive directory from SOURCE: attention-initialized DSLA for every attention layer."""
    config = json.loads((a.source / "config.json").read_text())
    if config.get("model_type") not in ("llama", "mistral", "llama_hybrid") or config.get("dsla_conversion"):
        raise HybridError(f"{a.source}: expected a Llama/Mistral or hybrid directory without DSLA weights")
    model, tokenizer = load(a.source)
    kinds = config.get("mixer_types") or ["attention"] * config["num_hidden_layers"]
    if set(kinds) != {"attention"}:
        raise HybridError("build takes an all-attention model (its entropy ranking needs every layer's attention)")
    calibration = blocks(tokenizer, a.calibration, a.seq_len, a.blocks)
    if not calibration:
        raise HybridError(f"{a.calibration} holds fewer than {a.seq_len} tokens")
    entropy = attention_entropy(model, calibration)
    order = sorted(range(len(entropy)), key=lambda i: (entropy[i], i))
    weights = load_weights(a.source)
    rng = np.random.default_rng(0)
    n_heads, head_dim, hidden = config["num_attention_heads"], config.get("head_dim"), config["hidden_size"]
    width = n_heads * (head_dim or hidden // n_heads)
    dtype = weights["model.layers.0.input_layernorm.weight"].dtype

    def normal(shape, std):
        return mx.array(rng.normal(0, std, shape).astype(np.float32)).astype(dtype)

    for i in order:
        src, dst = f"model.layers.{i}.self_attn.", f"model.layers.{i}.dsla."
        for name in [k for k in weights if k.startswith(src)]:
            weights[dst + name[len(src) :]] = weights[name]
        weights[dst + "gate1_down.weight"] = normal((a.gate_rank, hidden), 0.01)
        weights[dst + "gate1_up.weight"] = normal((width, a.gate_rank), 0.01)
        weights[dst + "gate1_up.bias"] = mx.full((width,), 4.0, dtype)
        weights[dst + "gate2_down.weight"] = normal((a.gate_rank, hidden), 0.1)
        weights[dst + "gate2_up.weight"] = normal((width, a.gate_rank), 0.1)
        weights[dst + "gate2_up.bias"] = mx.zeros((width,), dtype)
        weights[dst + "gamma"] = mx.array([0.5], mx.float32)
        weights[dst + "o_norm.weight"] = mx.ones((width // n_heads,), dtype)
    max_layers = len(order) if a.max_layers is None else a.max_layers
    config.update(model_type="llama_hybrid", base_model_type=config.get("base_model_type", config["model_type"]),
                  mixer_types=kinds, gate_rank=a.gate_rank, dsla_conversion={"order": order, "max_layers": max_layers})
    tmp = a.out.with_name(a.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(a.source, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.json.tmp"))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, {"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    command = "python -m benchmarks.dsla_conversion " + shlex.join(sys.argv[1:])
    (tmp / "entropy.json").write_text(json.dumps({"entropy": entropy, "order": order, "command": command}, indent=1) + "\n")
    if a.out.exists():
        shutil.rmtree(a.out)
    tmp.rename(a.out)
    print(f"wrote {a.out}: DSLA order {order} (max {max_layers})")
    return 0


def perplexity(model, data: list[list[int]], dsla_layers: list[int], progress) -> tuple[float, int]:
    """Perplexity over the blocks (each from an empty cache) and the cache bytes after one block."""
    nll, count, held = 0.0, 0, 0
    for ids in data:
        cache = model.make_cache(dsla_layers)
        logits = model(mx.array([ids[:-1]]), cache)[0].astype(mx.float32)
        target = mx.array(ids[1:])
        loss = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, target[:, None], axis=-1)[:, 0]
        nll += loss.sum().item()
        count += len(ids) - 1
        held = cache_nbytes(cache)
        progress()
    return math.exp(nll / count), held


def run(a) -> int:
    from rich.progress import Progress

    model, tokenizer = load(a.model)
    policy = ConversionPolicy(model, "1TB")
    if not policy.order:
        raise HybridError(f"{a.model} carries no DSLA weights (no dsla_conversion in config.json)")
    data = blocks(tokenizer, a.text, a.seq_len, a.blocks)
    if not data:
        raise HybridError(f"{a.text} holds fewer than {a.seq_len} tokens")
    ks = sorted(set(range(0, len(policy.order) + 1, a.every)) | {len(policy.order)})
    n_layers = len(model.layers)
    rows = []
    with Progress(transient=True) as bar:
        task = bar.add_task("perplexity per conversion rate", total=len(ks) * len(data))
        for k in ks:
            layers = policy.order[:k]
            ppl, held = perplexity(model, data, layers, lambda: bar.advance(task))
            at_context = policy.cache_bytes(request_chunks(a.context, 1), layers)
            rows.append(dict(dsla_layers=k, rate=k / n_layers, layers=layers, ppl=ppl, ratio=ppl / rows[0]["ppl"] if rows else 1.0,
                             cache_bytes_measured=held, cache_bytes_at_context=at_context))
            r = rows[-1]
            bar.console.print(f"{k:>3} DSLA ({r['rate']:5.1%})  ppl {ppl:10.3f}  ratio {r['ratio']:8.3f}  "
                              f"cache at {a.seq_len - 1}: {format_bytes(held)}  at {a.context}: {format_bytes(at_context)}")
    default = policy.weights_bytes + policy.cache_bytes(request_chunks(2048, 256), [])
    policy.budget = parse_budget(a.budget) if a.budget else default
    table = []
    for n in PROMPTS:
        try:
            plan = policy.plan(n, 256)
            table.append(dict(prompt=n, dsla_layers=len(plan.dsla_layers), rate=plan.rate, cache_bytes=plan.cache_bytes))
        except HybridError:
            table.append(dict(prompt=n, dsla_layers=None, rate=None, cache_bytes=None))

    device = device_description()
    label = a.label or device["default_label"]
    name = a.name or a.model.name
    slug = slugify(f"dsla-conversion-{name}-{label}")
    out = a.results / f"{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.dsla_conversion run " + shlex.join(sys.argv[2:])
    built = a.model / "entropy.json"  # written by `build` or real_dsla.py
    build_command = json.loads(built.read_text()).get("command") if built.is_file() else None
    result = dict(date=time.strftime("%Y-%m-%d"), name=name, label=label, device=device, command=command, build=build_command,
                  note=a.note, text=str(a.text), seq_len=a.seq_len,
                  blocks=len(data), tokens=sum(len(b) - 1 for b in data), context=a.context, layers=n_layers,
                  order=policy.order, weights_bytes=policy.weights_bytes, budget=policy.budget, rows=rows, policy=table)
    out.write_text(json.dumps(result, indent=2))
    png = out.with_suffix(".png")
    plot(result, png)
    print(render_file(out))
    return 0


def plot(result: dict, png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    rate = [100 * r["rate"] for r in rows]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(rate, [r["ratio"] for r in rows], marker="o", color="C0")
    ax1.set_yscale("log")
    ax1.set_xlabel("layers run as DSLA (%)")
    ax1.set_ylabel("perplexity / unconverted", color="C0")
    ax1.grid(alpha=0.3)
    ax2 = ax1.twinx()
    ax2.plot(rate, [r["cache_bytes_at_context"] / 2**20 for r in rows], marker="s", color="C1")
    ax2.set_ylabel(f"cache MiB at {result['context']} tokens", color="C1")
    ax2.set_ylim(bottom=0)
    fig.suptitle(f"DSLA conversion: {result['name']}, {result['label']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="attention-initialized DSLA weights for every layer, ordered by attention entropy")
    b.add_argument("--source", type=Path, required=True)
    b.add_argument("--calibration", type=Path, required=True, help="English text for the entropy ranking")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--seq-len", type=int, default=256)
    b.add_argument("--blocks", type=int, default=8)
    b.add_argument("--gate-rank", type=int, default=16)
    b.add_argument("--max-layers", type=int, default=None)
    r = sub.add_parser("run", help="perplexity ratio and cache memory per conversion rate")
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--text", type=Path, required=True, help="held-out English text")
    r.add_argument("--seq-len", type=int, default=256)
    r.add_argument("--blocks", type=int, default=None, help="at most this many blocks (default all)")
    r.add_argument("--every", type=int, default=1, help="measure every n-th conversion count")
    r.add_argument("--context", type=int, default=4096)
    r.add_argument("--budget", default=None, help="for the policy table; default weights + unconverted cache at 2304 tokens")
    r.add_argument("--name", default=None)
    r.add_argument("--label", default=None)
    r.add_argument("--note", default=None, help="a line shown above the result's table")
    r.add_argument("--results", type=Path, default=BENCH_DIR / "results", help="where the JSON and plot go")
    a = p.parse_args(argv)
    try:
        return build(a) if a.command == "build" else run(a)
    except HybridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
