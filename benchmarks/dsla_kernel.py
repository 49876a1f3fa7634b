#!/usr/bin/env python
"""DSLA on its fused kernel (`mlx_hybrid.dsla_step`) against the pure-MLX path, side by side in one
run on the device MLX runs on (a GPU with a kernel backend: CUDA or Metal).

1. One DSLA layer in a real shape (random weights, bfloat16), in both forms (this project's and
   DSLA-Serve's): a decode step and a verification pass over a tree of 1 + 4 chains of 5 (21
   nodes, ReDrafter's 4x5 beams), after a 256-token prefix; each the median of --reps synchronous
   calls (graph built and evaluated per call), with the kernel and unfused, and the largest
   difference of their outputs and states (bfloat16 inputs, float32 states).
2. An adaptive model in that shape (random weights, bfloat16; every layer carries DSLA weights of
   the form) decoding greedily after a --prompt-tokens prompt, at 0%, 25% and 50% of its layers
   converted to DSLA (`make_cache`), with the kernel and unfused: decode tokens/s, best of --trials.

The unfused path is what every backend without the kernel runs (the kernel's reference); "unfused"
here routes the DSLA layers there and leaves everything else as it is.

    python -m benchmarks.dsla_kernel OUT_DIR [--shape llama-3.2-1b]

Writes OUT_DIR/dsla-kernel-<device>.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from benchmarks.index import render_file
from benchmarks.run import SYNTHETIC, device_description, median_eval_ms, slugify
from mlx_hybrid.cache import StateCache
from mlx_hybrid.convert.dsla_serve import FORM
from mlx_hybrid.decode import generate_step
from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.models import hybrid
from mlx_hybrid.speculative.tree import path_to
from mlx_hybrid.tree_mask import TreeMask

FORMS = {
    "ours": {},
    "dsla-serve": FORM,  # + dsla_kv_heads = heads
}
TREE = [-1] + [p for w in range(4) for p in [0] + [1 + 5 * w + i for i in range(4)]]  # 1 + 4 chains of 5
RATES = (0.0, 0.25, 0.5)


@contextmanager
def unfused():
    """The DSLA layers on their pure-MLX path (`hybrid.kernel_backend` is what DSLA asks)."""
    kernel = hybrid.kernel_backend
    hybrid.kernel_backend = lambda: None
    try:
        yield
    finally:
        hybrid.kernel_backend = kernel


def model_args(shape: str, form: str, convertible: bool) -> hybrid.ModelArgs:
    config = dict(SYNTHETIC[shape])
    n = config["num_hidden_layers"]
    form_args = dict(FORMS[form], **({"dsla_kv_heads": config["num_attention_heads"]} if form == "dsla-serve" else {}))
    conversion = {"order": list(range(n)), "max_layers": n} if convertible else None
    return hybrid.ModelArgs(model_type="llama_hybrid", mixer_types=["attention"] * n, dsla_conversion=conversion, **config, **form_args)


def in_bfloat16(module):
    """module in bfloat16 but for the parameters the loader keeps in float32 (`hybrid.FP32_PARAMS`)."""
    module.set_dtype(mx.bfloat16)
    keep = [(k, v.astype(mx.float32)) for k, v in tree_flatten(module.parameters()) if k.rpartition(".")[2] in hybrid.FP32_PARAMS]
    return module.update(tree_unflatten(keep))


def layer_times(shape: str, form: str, reps: int) -> dict:
    args = model_args(shape, form, False)
    layer = in_bfloat16(hybrid.DSLA(args))
    mx.random.seed(0)
    hidden = args.hidden_size
    cache = StateCache()
    with unfused():
        layer(mx.random.normal((1, 256, hidden)).astype(mx.bfloat16), cache=cache)
    start = cache.snapshot()
    step = mx.random.normal((1, 1, hidden)).astype(mx.bfloat16)
    nodes = mx.random.normal((1, len(TREE), hidden)).astype(mx.bfloat16)
    tree, path = TreeMask.from_parents(TREE), path_to(TREE, len(TREE) - 1)  # a 5-token path

    def decode():
        cache.restore(start)
        return [layer(step, cache=cache), *cache.arrays]

    def verify():
        cache.restore(start)
        out = layer(nodes, tree, cache)
        cache.commit(path)
        return [out, *cache.arrays]

    rows = {}
    for name, fn in (("decode step", decode), (f"tree pass, {len(TREE)} nodes", verify)):
        kernel, got = round(1e3 * median_eval_ms(fn, reps), 1), fn()
        with unfused():
            plain, want = round(1e3 * median_eval_ms(fn, reps), 1), fn()
        diff = max(mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item() for g, w in zip(got, want))
        rows[name] = {"kernel_us": kernel, "unfused_us": plain, "speedup": round(plain / kernel, 2), "max_abs_diff": diff}
    return rows


def decode_rate(model, k: int, prompt: mx.array, tokens: int) -> float:
    """Greedy decode tokens/s with the first k layers of the order as DSLA (the first token, which
    ends the prefill, is not counted)."""
    cache = model.make_cache(model.args.dsla_order[:k])
    steps = generate_step(prompt, model, cache, lambda x: mx.argmax(x, -1), max_tokens=tokens)
    next(steps)
    t = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - t)


def adaptive_rates(shape: str, form: str, prompt_tokens: int, tokens: int, trials: int) -> list[dict]:
    model = in_bfloat16(hybrid.Model(model_args(shape, form, True)))
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, model.args.vocab_size, (prompt_tokens,))
    n = len(model.layers)
    rows = []
    for rate in RATES:
        k = round(rate * n)
        kernel = max(decode_rate(model, k, prompt, tokens) for _ in range(trials))
        with unfused():
            plain = max(decode_rate(model, k, prompt, tokens) for _ in range(trials))
        rows.append({"rate": rate, "dsla_layers": k, "kernel_tok_s": round(kernel, 1), "unfused_tok_s": round(plain, 1),
                     "speedup": round(kernel / plain, 3)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="directory for the JSON")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SYNTHETIC))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--trials", type=int, default=2)
    a = p.parse_args(argv)
    if kernel_backend() is None:
        print("error: the default device has no kernel backend (a GPU with MLX's CUDA or Metal backend)", file=sys.stderr)
        return 1
    device = device_description()
    result = {
        "device": device, "backend": kernel_backend(), "shape": a.shape, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.dsla_kernel " + " ".join(sys.argv[1:] if argv is None else argv),
        "tree": TREE, "layer": {}, "adaptive": {},
    }
    for form in FORMS:
        result["layer"][form] = layer_times(a.shape, form, a.reps)
        result["adaptive"][form] = adaptive_rates(a.shape, form, a.prompt_tokens, a.gen_tokens, a.trials)
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"dsla-kernel-{slugify(device['default_label'])}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(render_file(out))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
