#!/usr/bin/env python
"""Benchmark mlx-hybrid against mlx-lm: prefill tok/s, decode tok/s and peak memory, fp16 and 4-bit.

Both runtimes load the SAME files (made by `mlx_lm.convert` from one float checkpoint), run on
the SAME backend in ONE process, on the SAME fixed-seed random prompt, greedy, exactly
--gen-tokens tokens (EOS ignored: the `generate_step` generators are driven directly). After one
warm-up each, the timed trials are interleaved (ours, mlx-lm, ours, mlx-lm, ...) so that drift
(thermals, other load) hits both alike. Medians are reported.

    python -m benchmarks.run --synthetic smollm2-135m
    python -m benchmarks.run --model path/to/hf-model --variants fp16,4bit --label "NVIDIA H100, MLX CUDA backend"

Writes --out (JSON with every raw number) and a PNG next to it, and prints a table;
`python -m benchmarks.index` then regenerates benchmarks/README.md's tables from the result files.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from statistics import median

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RUNTIMES = ("mlx_hybrid", "mlx_lm")
RUNTIME_NAMES = {"mlx_hybrid": "mlx-hybrid", "mlx_lm": "mlx-lm"}
VARIANTS = ("fp16", "4bit")
GROUP_SIZE = 64

# Llama 3.2's long-context RoPE scaling (1B and 3B alike).
LLAMA3_2_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

# Real architectures' shapes (config.json as published on the Hub, classic rope_theta/rope_scaling keys).
SYNTHETIC = {
    "smollm2-135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_2_ROPE,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "llama-3.2-3b": dict(
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_2_ROPE,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
}


class BenchError(Exception):
    """Bad input: printed as one line, exit status 2."""


# ----------------------------------------------------------------------------- arguments


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise BenchError(message)


def _positive(name, minimum=1):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _variants(text):
    items = [v.strip().lower() for v in text.split(",") if v.strip()]
    bad = [v for v in items if v not in VARIANTS]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(VARIANTS)}, got '{text}'")
    return list(dict.fromkeys(items))


def parse_beam(text: str) -> tuple[int, int]:
    """'4x5' -> ReDrafter's beam (width, length); ValueError where the text is not WxL. The
    callers check the range they need."""
    beam = tuple(int(x) for x in text.lower().split("x"))
    if len(beam) != 2:
        raise ValueError(f"not WxL: {text!r}")
    return beam


def parse_args(argv):
    p = _Parser(
        prog="python -m benchmarks.run",
        description="mlx-hybrid vs mlx-lm: prefill/decode tokens/s and peak memory on the same weights.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="Hugging Face-layout model dir (float, or MLX-quantized: then benchmarked as is)")
    src.add_argument("--synthetic", metavar="NAME", choices=sorted(SYNTHETIC), help=f"random weights in a real shape: {', '.join(SYNTHETIC)}")
    p.add_argument("--prompt-tokens", type=_positive("--prompt-tokens"), default=512)
    p.add_argument("--gen-tokens", type=_positive("--gen-tokens", 2), default=128)
    p.add_argument("--trials", type=_positive("--trials"), default=3)
    p.add_argument("--variants", type=_variants, default=list(VARIANTS), help="comma list of fp16,4bit (default both)")
    p.add_argument("--prefill-step-size", type=_positive("--prefill-step-size"), default=512, help="prefill chunk, the same for both runtimes (default 512)")
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        help="compute dtype forced on both runtimes (default: each runtime's own choice; mlx-hybrid upcasts to float32 on the CPU, mlx-lm keeps the stored dtype)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt and of synthetic weights (default 0)")
    p.add_argument("--out", metavar="FILE.json", help="results JSON (default benchmarks/results/decode-<model>-<label>.json); the PNG goes next to it")
    p.add_argument("--label", help="where it ran, e.g. 'NVIDIA H100, MLX CUDA backend' (default: derived from the device)")
    p.add_argument("--work-dir", metavar="DIR", help="keep the synthetic/converted models here and reuse them next time (default: a temp dir, deleted)")
    args = p.parse_args(argv)
    if args.out is not None and not args.out.endswith(".json"):
        raise BenchError(f"--out must name a .json file, got '{args.out}'")
    if args.label is not None and not slugify(args.label):
        raise BenchError("--label must contain at least one letter or digit")
    return args


# ----------------------------------------------------------------------------- labels


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _nvidia_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return names[0] if out.returncode == 0 and names else None


def device_description() -> dict:
    import mlx.core as mx

    dev = mx.default_device()
    info = {}
    with contextlib.suppress(Exception):
        info = dict(mx.device_info())
    system, machine = platform.system(), platform.machine()
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count()
    if dev.type == mx.DeviceType.gpu:
        if system == "Darwin":
            name = info.get("device_name") or "Apple GPU"
            label = f"{name}, MLX Metal backend"
        else:
            name = _nvidia_name() or info.get("device_name") or "GPU"
            label = f"{name}, MLX CUDA backend"
    else:
        name = info.get("device_name") or machine
        label = f"CPU ({system} {machine}, {cores} cores)"
    return {"mlx_device": str(dev), "name": str(name), "cores": cores, "platform": platform.platform(), "default_label": label}


# ----------------------------------------------------------------------------- models


# How much larger than the layers' weights a peaked target's embedding is (std 100 against 0.02).
PEAK = 5000


def make_synthetic(name: str, dest: Path, seed: int, peaked: bool = False) -> Path:
    """A float16 Hugging Face Llama dir with random weights (normal, std 0.02; norms 1) in `name`'s
    shape. MLX draws them (a key per tensor from `seed`): transformers' initialization of an 8B
    model takes minutes on a CPU. The tensors are named and shaped as mlx-lm's Llama has them,
    which is the checkpoints' layout both runtimes load.

    peaked: a target whose next token is a fixed function of its current one, about 70 above every
    other logit. A random model's logits are flat, so the two best are often within rounding of
    each other, and a verification pass, which sums in another order than a decode step, then
    decodes another token (docs/speculative.md); the oracle's continuation, computed by decode
    steps, would stop being what the passes decode. Here the embedding is PEAK times larger, so a
    position's residual stream is its token's embedding plus a little of the layers' outputs, and
    the LM head reads that embedding back: untied, head row pi(t) is token t's embedding (pi a
    fixed random permutation: the text walks pi); tied, the final norm is scaled down so that t's
    own logit peaks by as much (the text repeats its last token). The work per token, which is
    what the benchmarks time, is a random model's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    from tests.helpers.factories import make_tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(dest)
    config = {k: v for k, v in SYNTHETIC[name].items() if v is not None}
    config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, hidden_act="silu", model_type="llama",
                  architectures=["LlamaForCausalLM"], torch_dtype="float16")
    shapes = tree_flatten(Model(ModelArgs.from_dict(config)).parameters())  # lazy: nothing is allocated
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    weights = {
        k: mx.random.normal(p.shape, mx.float16, scale=0.02, key=key) if p.ndim > 1 else mx.ones(p.shape, mx.float16)
        for (k, p), key in zip(shapes, keys)
    }
    if peaked:
        embed = weights["model.embed_tokens.weight"]
        if "lm_head.weight" in weights:
            order = mx.argsort(mx.random.permutation(embed.shape[0], key=mx.random.key(seed + 1)))
            weights["lm_head.weight"] = embed[order]  # row pi(t) = embedding t
        else:  # t's logit: PEAK * g * |e_t|^2 / 0.02 = 100 g d; g = 0.8 / d puts it near 80
            weights["model.norm.weight"] = mx.full(weights["model.norm.weight"].shape, 0.8 / embed.shape[1], mx.float16)
        weights["model.embed_tokens.weight"] = embed * PEAK
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dest


def read_config(path: Path) -> dict:
    """config.json of a model directory both runtimes can load (the runtime's own checks)."""
    from mlx_hybrid.errors import HybridError
    from mlx_hybrid.loader import load_config

    try:
        config = load_config(path)
    except HybridError as e:
        raise BenchError(str(e)) from None
    if not list(path.glob("*.safetensors")):
        raise BenchError(f"no *.safetensors weight files in {path}")
    return config


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def convert_variant(src: Path, dest: Path, variant: str) -> Path:
    """fp16 or 4-bit (group 64) copy of src made by mlx-lm's converter; reused if already there."""
    if (dest / "config.json").is_file():
        return dest
    from mlx_lm import convert

    if dest.exists():
        shutil.rmtree(dest)
    kwargs = dict(dtype="float16")
    if variant == "4bit":
        kwargs.update(quantize=True, q_group_size=GROUP_SIZE, q_bits=4)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            convert(str(src), str(dest), **kwargs)
    except Exception as e:
        shutil.rmtree(dest, ignore_errors=True)
        raise BenchError(f"mlx_lm.convert failed on {src} ({variant}): {_first_line(e)}") from None
    return dest


def quantized_label(config: dict) -> str:
    q = config["quantization"]
    bits = q.get("bits", "?")
    mode = q.get("mode", "affine")
    return f"{bits}bit" if mode == "affine" else f"{mode}-{bits}bit"


# ----------------------------------------------------------------------------- measuring


def median_eval_ms(fn, reps: int = 30, warm: int = 3) -> float:
    """Median milliseconds of mx.eval(fn()) over reps synchronous runs (the graph built and
    evaluated in each), after warm runs."""
    import mlx.core as mx

    for _ in range(warm):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * median(times)


def float_dtype(model) -> str:
    """The most common floating dtype among a model's parameters (what its matmuls run in)."""
    from collections import Counter

    import mlx.core as mx
    from mlx.utils import tree_flatten

    counts = Counter(
        str(v.dtype).rpartition(".")[2] for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)
    )
    return counts.most_common(1)[0][0] if counts else "?"


class Bench:
    def __init__(self, prompt_ids: list[int], gen_tokens: int, prefill_step: int, dtype: str | None):
        import importlib

        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        # importlib: mlx-lm re-exports a `generate` function that shadows its module's name.
        lm_generate = importlib.import_module("mlx_lm.generate")
        hy_decode = importlib.import_module("mlx_hybrid.decode")

        self.mx = mx
        self.lm, self.hy = lm_generate, hy_decode
        self.prompt = mx.array(prompt_ids, dtype=mx.int32)
        self.gen_tokens = gen_tokens
        self.prefill_step = prefill_step
        self.dtype = dtype
        self.sampler = make_sampler(0.0)  # greedy (argmax), the same callable for both
        self.streams = [hy_decode.generation_stream, lm_generate.generation_stream]
        self.models: dict[str, object] = {}
        self.weights_bytes: dict[str, int] = {}
        self.compute_dtypes: dict[str, str] = {}

    def settle(self):
        """Finish all queued work and free what is no longer referenced."""
        mx = self.mx
        for s in self.streams:
            mx.synchronize(s)
        mx.synchronize()
        gc.collect()
        mx.clear_cache()

    def load(self, runtime: str, path: Path):
        mx = self.mx
        self.settle()
        before = mx.get_active_memory()
        try:
            if runtime == "mlx_hybrid":
                from mlx_hybrid.loader import load_model

                model = load_model(path, self.dtype)
            else:
                from mlx_lm.utils import load_model

                model, _ = load_model(path)
                if self.dtype:
                    model.set_dtype(getattr(mx, self.dtype))
                    mx.eval(model.parameters())  # materialize now: lazily cast weights would count as run memory
        except Exception as e:
            raise BenchError(f"{RUNTIME_NAMES[runtime]} cannot load {path}: {_first_line(e)}") from None
        self.settle()
        self.models[runtime] = model
        self.weights_bytes[runtime] = mx.get_active_memory() - before
        self.compute_dtypes[runtime] = float_dtype(model)

    def unload(self):
        self.models.clear()
        self.settle()

    def _steps(self, runtime: str):
        model = self.models[runtime]
        if runtime == "mlx_hybrid":
            return self.hy.generate_step(
                self.prompt, model, model.make_cache(), self.sampler, (), self.gen_tokens, self.prefill_step
            )
        return self.lm.generate_step(
            self.prompt, model, max_tokens=self.gen_tokens, sampler=self.sampler, prefill_step_size=self.prefill_step
        )

    def run(self, runtime: str, keep_logprobs: bool = False) -> dict:
        """One timed generation; with keep_logprobs also the first and last steps' log-probabilities."""
        mx = self.mx
        self.settle()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        tokens: list[int] = []
        kept = []
        t_first = t_last = None
        tic = time.perf_counter()
        steps = self._steps(runtime)
        for i, (token, logprobs) in enumerate(steps):
            now = time.perf_counter()
            tokens.append(int(token))
            if i == 0:
                t_first = now
                if keep_logprobs:
                    kept.append(logprobs)
            if i == self.gen_tokens - 1:
                t_last = now
                if keep_logprobs:
                    kept.append(logprobs)
                break
        steps.close()
        del steps
        self.settle()  # mlx-lm queues one step past the last token: let it finish outside the timing
        peak = mx.get_peak_memory()
        if len(tokens) != self.gen_tokens:
            raise RuntimeError(f"{runtime} produced {len(tokens)} tokens, expected {self.gen_tokens}")
        ttft = t_first - tic
        decode_s = t_last - t_first
        run_bytes = peak - base
        import numpy as np

        result = {
            "ttft_s": ttft,
            "decode_s": decode_s,
            "prefill_tps": self.prompt.size / ttft,
            "decode_tps": (self.gen_tokens - 1) / decode_s,
            "run_peak_gb": run_bytes / 1e9,
            "peak_memory_gb": (run_bytes + self.weights_bytes[runtime]) / 1e9,
            "tokens": tokens,
        }
        if keep_logprobs:
            result["logprobs"] = [np.array(lp.astype(mx.float32)).reshape(-1) for lp in kept]
        return result


def summarize(trials: list[dict]) -> dict:
    keys = ("prefill_tps", "decode_tps", "ttft_s", "decode_s", "peak_memory_gb", "run_peak_gb")
    return {k: median(t[k] for t in trials) for k in keys}


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------- reporting


def dtypes(v: dict) -> str:
    return " / ".join(v["runtimes"][r].get("compute_dtype", "?") for r in RUNTIMES)


def max_diff(v: dict) -> float:
    return max(v["logprobs_max_abs_diff"].values())


def fmt_ratio(r: float) -> str:
    return f"{r:.2f}×"


def plot(result: dict, png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(result["variants"])
    ours = [result["variants"][v]["runtimes"]["mlx_hybrid"]["median"]["decode_tps"] for v in variants]
    theirs = [result["variants"][v]["runtimes"]["mlx_lm"]["median"]["decode_tps"] for v in variants]
    fig, ax = plt.subplots(figsize=(1.8 + 2.4 * len(variants), 4.6))
    x = range(len(variants))
    w = 0.38
    b1 = ax.bar([i - w / 2 for i in x], ours, w, label="mlx-hybrid", color="#2b7bba")
    b2 = ax.bar([i + w / 2 for i in x], theirs, w, label="mlx-lm", color="#9a9a9a")
    top = max(ours + theirs)
    for bars in (b1, b2):
        for bar in bars:
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() * 0.5, f"{bar.get_height():.1f}",
                    ha="center", va="center", color="white", fontsize=9, fontweight="bold")
    for i, v in enumerate(variants):
        r = result["variants"][v]["ratios"]["decode"]
        ax.text(i - w / 2, ours[i] + top * 0.02, fmt_ratio(r), ha="center", va="bottom", fontsize=11,
                fontweight="bold", color="#1a7f37" if r >= 1 else "#b42318")
    ax.set_xticks(list(x), [f"{v}\n(dtype {dtypes(result['variants'][v])})" for v in variants], fontsize=8)
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_ylim(0, top * 1.18)
    s = result["settings"]
    ax.set_title(f"{result['model']['name']} decode: mlx-hybrid vs mlx-lm\n{result['label']}", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.text(0.5, 0.01, f"prompt {s['prompt_tokens']}, gen {s['gen_tokens']}, {s['trials']} trials; ratio = mlx-hybrid / mlx-lm",
             ha="center", fontsize=7, color="#555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(png, dpi=120)
    plt.close(fig)


def print_table(console, result: dict):
    from rich.table import Table

    t = Table(title=f"{result['model']['name']} — {result['label']} (medians, ratio = mlx-hybrid / mlx-lm)")
    for col in ("variant", "runtime", "dtype", "prefill tok/s", "decode tok/s", "peak GB", "prefill ×", "decode ×", "same tokens", "max Δlogprob"):
        t.add_column(col, justify="left" if col in ("variant", "runtime") else "right")
    for variant, v in result["variants"].items():
        for runtime in RUNTIMES:
            m = v["runtimes"][runtime]["median"]
            first = runtime == "mlx_hybrid"
            t.add_row(
                variant if first else "",
                RUNTIME_NAMES[runtime],
                v["runtimes"][runtime].get("compute_dtype", "?"),
                f"{m['prefill_tps']:.1f}",
                f"{m['decode_tps']:.1f}",
                f"{m['peak_memory_gb']:.3f}",
                fmt_ratio(v["ratios"]["prefill"]) if first else "",
                fmt_ratio(v["ratios"]["decode"]) if first else "",
                ("yes" if v["tokens_match"] else f"no @{v['first_mismatch']}") if first else "",
                f"{max_diff(v):.2g}" if first else "",
                end_section=not first,
            )
    console.print(t)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = "python -m benchmarks.run " + shlex.join(argv)

    # Input checks before the heavy imports.
    src_config = None
    if args.model:
        model_dir = Path(args.model).expanduser().resolve()
        src_config = read_config(model_dir)
        model_name = model_dir.name
        max_pos = src_config.get("max_position_embeddings")
        vocab = src_config.get("vocab_size")
        if not isinstance(vocab, int) or vocab < 1:
            raise BenchError(f"{model_dir / 'config.json'} has no valid vocab_size")
    else:
        model_dir = None
        model_name = args.synthetic
        max_pos = SYNTHETIC[args.synthetic]["max_position_embeddings"]
        vocab = SYNTHETIC[args.synthetic]["vocab_size"]
    if max_pos and args.prompt_tokens + args.gen_tokens > max_pos:
        raise BenchError(
            f"--prompt-tokens + --gen-tokens = {args.prompt_tokens + args.gen_tokens} exceeds the model's context ({max_pos})"
        )

    import mlx.core as mx
    import mlx_lm
    import numpy as np
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    device = device_description()
    label = args.label or device["default_label"]
    slug = slugify(label)
    out = Path(args.out) if args.out else BENCH_DIR / "results" / f"decode-{slugify(model_name)}-{slug}.json"
    out = out.resolve()
    png = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)

    work_ctx = contextlib.nullcontext(args.work_dir) if args.work_dir else tempfile.TemporaryDirectory(prefix="mlxh-bench-")
    with work_ctx as work:
        work = Path(work).resolve()
        work.mkdir(parents=True, exist_ok=True)

        # The files both runtimes load, one dir per variant.
        if src_config is not None and src_config.get("quantization"):
            variant_dirs = {quantized_label(src_config): model_dir}
            if args.variants != list(VARIANTS):
                console.print(f"[yellow]{model_dir} is already quantized: benchmarking it as is, --variants ignored")
        else:
            if model_dir is None:
                model_dir = work / f"{args.synthetic}-seed{args.seed}-hf"
                if not (model_dir / "config.json").is_file():
                    with console.status(f"building synthetic {args.synthetic} (random weights, MLX)…"):
                        make_synthetic(args.synthetic, model_dir, args.seed)
            variant_dirs = {}
            for variant in args.variants:
                with console.status(f"mlx_lm.convert → {variant}…"):
                    variant_dirs[variant] = convert_variant(model_dir, work / f"{slugify(model_name)}-{variant}", variant)

        rng = np.random.default_rng(args.seed)
        prompt_ids = rng.integers(0, vocab, size=args.prompt_tokens).tolist()
        bench = Bench(prompt_ids, args.gen_tokens, args.prefill_step_size, args.dtype)

        result = {
            "model": {
                "name": model_name,
                "source": "synthetic" if args.synthetic else "dir",
                "path": str(model_dir) if args.model else None,
                "synthetic_shape": SYNTHETIC.get(args.synthetic) if args.synthetic else None,
            },
            "label": label,
            "label_slug": slug,
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "argv": sys.argv,
            "device": device,
            "versions": {
                "mlx": mx.__version__,
                "mlx_lm": mlx_lm.__version__,
                "python": platform.python_version(),
            },
            "settings": {
                "prompt_tokens": args.prompt_tokens,
                "gen_tokens": args.gen_tokens,
                "trials": args.trials,
                "prefill_step_size": args.prefill_step_size,
                "dtype": args.dtype or "each runtime's default",
                "seed": args.seed,
                "variants": list(variant_dirs),
                "group_size": GROUP_SIZE,
                "sampler": "greedy",
                "order": "warm-up each once, then interleaved mlx_hybrid, mlx_lm per trial",
            },
            "units": {"tps": "tokens/s", "memory": "GB (1e9 bytes)", "time": "s"},
            "files": {"json": str(out), "png": str(png)},
            "variants": {},
        }

        total = len(variant_dirs) * 2 * (args.trials + 1)
        progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console,
        )
        with progress:
            task = progress.add_task("loading", total=total)
            for variant, path in variant_dirs.items():
                progress.update(task, description=f"{variant}: loading both models")
                for runtime in RUNTIMES:
                    bench.load(runtime, path)
                runs: dict[str, dict] = {r: {"warmup": None, "trials": []} for r in RUNTIMES}
                for runtime in RUNTIMES:
                    progress.update(task, description=f"{variant}: warm-up {RUNTIME_NAMES[runtime]}")
                    runs[runtime]["warmup"] = bench.run(runtime, keep_logprobs=True)
                    progress.advance(task)
                for trial in range(args.trials):
                    for runtime in RUNTIMES:
                        progress.update(task, description=f"{variant}: trial {trial + 1}/{args.trials} {RUNTIME_NAMES[runtime]}")
                        runs[runtime]["trials"].append(bench.run(runtime))
                        progress.advance(task)
                bench.unload()

                entry = {"path": str(path), "runtimes": {}}
                token_lists = {}
                for runtime in RUNTIMES:
                    all_runs = [runs[runtime]["warmup"], *runs[runtime]["trials"]]
                    token_lists[runtime] = all_runs[0]["tokens"]
                    entry["runtimes"][runtime] = {
                        "weights_gb": bench.weights_bytes[runtime] / 1e9,
                        "compute_dtype": bench.compute_dtypes[runtime],
                        "median": summarize(runs[runtime]["trials"]),
                        "trials": [{k: v for k, v in t.items() if k != "tokens"} for t in runs[runtime]["trials"]],
                        "warmup": {k: v for k, v in runs[runtime]["warmup"].items() if k not in ("tokens", "logprobs")},
                        "deterministic": all(r["tokens"] == all_runs[0]["tokens"] for r in all_runs),
                        "tokens": token_lists[runtime],
                    }
                ours, theirs = (entry["runtimes"][r]["median"] for r in RUNTIMES)
                entry["ratios"] = {
                    "decode": ours["decode_tps"] / theirs["decode_tps"],
                    "prefill": ours["prefill_tps"] / theirs["prefill_tps"],
                    "peak_memory": ours["peak_memory_gb"] / theirs["peak_memory_gb"],
                }
                entry["first_mismatch"] = first_mismatch(token_lists["mlx_hybrid"], token_lists["mlx_lm"])
                entry["tokens_match"] = entry["first_mismatch"] is None
                # Random weights tend to repeat one token, so also compare whole distributions (warm-up runs):
                # after the prompt (prefill path) and at the last generated token (decode path with the cache).
                lp_ours, lp_theirs = (runs[r]["warmup"]["logprobs"] for r in RUNTIMES)
                entry["logprobs_max_abs_diff"] = {
                    "first_token": float(np.max(np.abs(lp_ours[0] - lp_theirs[0]))),
                    "last_token": float(np.max(np.abs(lp_ours[1] - lp_theirs[1]))),
                }
                entry["distinct_tokens"] = len(set(token_lists["mlx_hybrid"]))
                result["variants"][variant] = entry

    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, png)
    table_console = Console()
    if not table_console.is_terminal:
        table_console = Console(width=140)
    print_table(table_console, result)
    for variant, v in result["variants"].items():
        if not v["tokens_match"]:
            console.print(f"[yellow]{variant}: the runtimes' greedy tokens differ from token {v['first_mismatch']} on")
    console.print(f"wrote {out} and {png}; python -m benchmarks.index puts them in benchmarks/README.md")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
