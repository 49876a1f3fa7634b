#!/usr/bin/env python
"""Decode time per token and cache memory as the context grows: Llama vs a 50%-attention hybrid.

One process, one backend, one set of Llama weights: mlx-lm's Llama, this runtime's Llama and
this runtime's hybrids of the same shape, whose recurrent layers replace every other attention
layer (Mamba2 and Mamba, attention-initialized shapes, random weights) plus an all-Mamba2 model
as the flat baseline. For each context length the caches are filled to that length, then
--steps greedy decode steps are timed, pipelined as generation runs them, in 5 rounds taken by
all models in turn (median). The context is filled with random keys and values (attention
layers) after a short real prefill (recurrent layers): a decode step's cost depends on the
cache's size, not its contents, and a real 16k-token prefill would take the CPU hours. Cache
memory is the bytes the caches hold per sequence.

    python -m benchmarks.hybrid_context --shape smollm2-135m
    python -m benchmarks.hybrid_context --shape llama-3.2-1b --dtype bfloat16 --label "NVIDIA H100, MLX CUDA backend"
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
import mlx.nn as nn
import mlx.utils

BENCH_DIR = Path(__file__).resolve().parent
from benchmarks.index import render_file  # noqa: E402
from benchmarks.run import SYNTHETIC, device_description, slugify  # noqa: E402

from mlx_hybrid.models import hybrid, llama  # noqa: E402

CONTEXTS = (1024, 2048, 4096, 8192, 16384)
PREFILL = 16  # real tokens through every layer before the synthetic fill
ROUNDS = 5  # timing rounds per model and context


def llama_config(shape: str) -> dict:
    cfg = dict(SYNTHETIC[shape], model_type="llama")
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], 32768)
    return cfg


def random_weights(model: nn.Module, seed: int, dtype) -> dict:
    mx.random.seed(seed)
    params = mlx.utils.tree_flatten(model.parameters())
    return {k: (mx.random.normal(v.shape) * 0.02).astype(dtype) for k, v in params}


def build_models(shape: str, dtype, seed: int):
    """(name, model, make_cache) for mlx-lm's Llama, ours, and our hybrids, sharing the Llama weights."""
    from mlx_lm.models import llama as lm_llama

    cfg = llama_config(shape)
    ours = llama.Model(llama.ModelArgs.from_dict(cfg))
    weights = random_weights(ours, seed, dtype)
    ours.load_weights(list(weights.items()))

    lm_args = lm_llama.ModelArgs.from_dict(cfg)
    theirs = lm_llama.Model(lm_args)
    split = {}
    for k, v in weights.items():  # our fused projections back to the Hugging Face names
        if ".qkv_proj." in k:
            a = ours.args
            sizes = [a.num_attention_heads * a.head_dim, (a.num_attention_heads + a.num_key_value_heads) * a.head_dim]
            for name, part in zip(("q_proj", "k_proj", "v_proj"), mx.split(v, sizes)):
                split[k.replace("qkv_proj", name)] = part
        elif ".gate_up_proj." in k:
            for name, part in zip(("gate_proj", "up_proj"), mx.split(v, 2)):
                split[k.replace("gate_up_proj", name)] = part
        else:
            split[k] = v
    theirs.load_weights(list(split.items()))

    from mlx_lm.models.cache import make_prompt_cache

    models = [("mlx-lm Llama", theirs, lambda: make_prompt_cache(theirs)), ("mlx-hybrid Llama", ours, ours.make_cache)]
    n = cfg["num_hidden_layers"]
    head_dim = ours.args.head_dim
    for name, kinds in (
        ("hybrid 50% attn (Mamba2)", ["attention" if i % 2 == 0 else "mamba2" for i in range(n)]),
        ("hybrid 50% attn (Mamba)", ["attention" if i % 2 == 0 else "mamba" for i in range(n)]),
        ("hybrid 0% attn (Mamba2)", ["mamba2"] * n),
    ):
        args = hybrid.ModelArgs.from_dict(dict(cfg, model_type="llama_hybrid", mixer_types=kinds, d_state=head_dim))
        model = hybrid.Model(args)
        hw = random_weights(model, seed, dtype)
        hw.update({k: v for k, v in weights.items() if k in hw and ".mamba." not in k})  # shared Llama weights
        for k in hw:
            leaf = k.rpartition(".")[2]
            if leaf == "A_log":
                hw[k] = mx.log(mx.random.uniform(1, 16, hw[k].shape)).astype(mx.float32)
            elif leaf in ("D", "dt_bias"):
                hw[k] = hw[k].astype(mx.float32)
        model.load_weights(list(hw.items()))
        models.append((name, model, model.make_cache))
    for _, m, _ in models:
        mx.eval(m.parameters())
    return cfg, models


def fill(model, cache: list, context: int, dtype):
    """Prefill PREFILL real tokens, then pad every KV cache with random keys/values up to context."""
    model(mx.arange(PREFILL)[None], cache=cache)
    for c in cache:
        if hasattr(c, "keys") and c.keys is not None:
            kv_heads, head_dim = c.keys.shape[1], c.keys.shape[3]
            shape = (1, kv_heads, context - PREFILL, head_dim)
            c.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
    mx.eval([c.state for c in cache])


def cache_bytes(cache: list) -> int:
    total = 0
    for c in cache:
        if getattr(c, "keys", None) is not None:
            # Count the tokens held, not the spare capacity of the last growth step.
            total += sum(a[..., : c.offset - getattr(c, "start", 0), :].nbytes for a in (c.keys, c.values))
        else:
            total += sum(a.nbytes for a in c.state)
    return total


def decode_timer(model, cache: list):
    """A function timing n greedy steps (seconds per token), pipelined as `generate` runs them:
    each step is queued before the previous one finishes."""
    token = mx.array([[1]])

    def run(n: int) -> float:
        nonlocal token
        tic = time.perf_counter()
        for _ in range(n):
            token = model(token, cache=cache)[:, -1:].argmax(-1)
            mx.async_eval(token)
        mx.eval(token)
        return (time.perf_counter() - tic) / n

    run(3)  # warm-up
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SYNTHETIC), default="smollm2-135m")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="weights and KV dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--label", default=None)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    dtype_name = a.dtype or ("float32" if mx.default_device() == mx.cpu else "bfloat16")
    dtype = getattr(mx, dtype_name)
    device = device_description()
    label = a.label or device["default_label"]
    contexts = [int(c) for c in a.contexts.split(",")]
    cfg, models = build_models(a.shape, dtype, seed=0)

    rows = []
    for context in contexts:
        # All models at this context are timed in turns (ROUNDS rounds, median per model), so
        # that drifts of the machine fall on every model alike.
        caches = [make_cache() for _, _, make_cache in models]
        for (_, model, _), cache in zip(models, caches):
            fill(model, cache, context, dtype)
        timers = [decode_timer(model, cache) for (_, model, _), cache in zip(models, caches)]
        times = [[] for _ in models]
        for _ in range(ROUNDS):
            for timer, t in zip(timers, times):
                t.append(timer(a.steps))
        for (name, _, _), cache, t in zip(models, caches, times):
            ms = median(t) * 1e3
            rows.append(dict(model=name, context=context, ms_per_token=ms, cache_bytes=cache_bytes(cache)))
            print(f"{context:>6} {name:<26} {ms:8.2f} ms/token  cache {rows[-1]['cache_bytes'] / 2**20:8.1f} MiB", flush=True)
        del caches, timers
        mx.clear_cache()

    slug = slugify(f"hybrid-context-{a.shape}-{label}")
    out = a.out or BENCH_DIR / "results" / f"{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args = list(argv if argv is not None else sys.argv[1:])
    if "--out" in args:  # where this run wrote its files is not part of how to reproduce it
        del args[args.index("--out") : args.index("--out") + 2]
    command = "python -m benchmarks.hybrid_context " + shlex.join(args)
    result = dict(date=time.strftime("%Y-%m-%d"), shape=a.shape, dtype=dtype_name, device=device, label=label,
                  command=command.strip(), steps=a.steps, config=cfg, rows=rows)
    out.write_text(json.dumps(result, indent=2))
    png = out.with_suffix(".png")
    plot(result, png)
    print(render_file(out))
    return 0


def plot(result: dict, png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["model"] for r in result["rows"]):
        rs = [r for r in result["rows"] if r["model"] == name]
        ctx = [r["context"] for r in rs]
        ax1.plot(ctx, [r["ms_per_token"] for r in rs], marker="o", label=name)
        ax2.plot(ctx, [r["cache_bytes"] / 2**20 for r in rs], marker="o", label=name)
    for ax, ylabel in ((ax1, "decode ms / token"), (ax2, "cache MiB / sequence")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{result['shape']} shape, {result['dtype']}, {result['label']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
