#!/usr/bin/env python
"""Peak memory of `hybrid convert` vs `mlx_lm.convert` on a 1B-class Llama, against its float32 size.

Builds random bfloat16 weights in Llama-3.2-1B's shape (1.24B parameters, 4.94 GB in float32,
one model.safetensors as published, and optionally the same tensors as a PyTorch .bin), then
converts them in fresh processes, one conversion each: mlx-hybrid (bfloat16 as stored; 4-bit,
group size 64) and mlx-lm's converter on the same files with the same settings. Each child
reports its own peak resident set (ru_maxrss; Linux carries it over from the parent through
fork and exec, so the source is built in another child and the parent stays small) and,
sampled every 20 ms from /proc, the peak of its anonymous memory (RssAnon: what the process
allocated, as opposed to file pages it mapped, which the kernel can drop at will).
Writes a JSON file and a bar chart to benchmarks/results/.

    python -m benchmarks.convert_memory                 # safetensors source, both converters
    python -m benchmarks.convert_memory --bin           # also the PyTorch .bin source (mlx-hybrid only)
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
from benchmarks.run import SYNTHETIC, device_description, slugify  # noqa: E402

SHAPE = "llama-3.2-1b"

# Runs in the child: convert, then print peak RSS and peak RssAnon (MB) as JSON.
CHILD = r"""
import json, resource, sys, threading, time
peak_anon = 0
def sample():
    global peak_anon
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                peak_anon = max(peak_anon, int(line.split()[1]) // 1024)
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
tool, src, dst, quantize = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
start = time.perf_counter()
if tool == "mlx-hybrid":
    from mlx_hybrid.convert.hf import convert
    convert(src, dst, quantize=quantize, bits=4, group_size=64)
else:
    from mlx_lm import convert
    convert(src, dst, quantize=quantize, q_bits=4, q_group_size=64, dtype="bfloat16")
seconds = time.perf_counter() - start
time.sleep(0.05)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(json.dumps({"peak_rss_mb": peak, "peak_anon_mb": peak_anon, "seconds": round(seconds, 1)}))
"""


def build_source(dest: Path, with_bin: bool) -> int:
    """Random bfloat16 Llama-3.2-1B-shaped checkpoint (std 0.02, norms 1); returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    from tests.helpers.factories import make_tokenizer  # a tiny tokenizer: the converter copies it, nothing reads the vocab

    s = SYNTHETIC[SHAPE]
    dest.mkdir(parents=True, exist_ok=True)
    make_tokenizer(dest)
    h, hd, inter, vocab = s["hidden_size"], s["head_dim"], s["intermediate_size"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    gen = torch.Generator().manual_seed(0)
    state = {
        name: (torch.randn(shape, generator=gen) * 0.02 if len(shape) > 1 else torch.ones(shape)).to(torch.bfloat16)
        for name, shape in shapes.items()
    }
    save_file(state, str(dest / "model.safetensors"), {"format": "pt"})
    if with_bin:
        (dest.parent / f"{dest.name}-bin").mkdir(exist_ok=True)
        torch.save(state, dest.parent / f"{dest.name}-bin" / "pytorch_model.bin")
    config = dict(s, model_type="llama", architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
                  hidden_act="silu", bos_token_id=0, eos_token_id=3)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in dest.iterdir():
        if with_bin and f.name != "model.safetensors":
            (dest.parent / f"{dest.name}-bin" / f.name).write_bytes(f.read_bytes())
    return sum(t.numel() for t in state.values())


def measure(tool: str, src: Path, dst: Path, quantize: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, tool, str(src), str(dst), "1" if quantize else "0"],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tool} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(result: dict, png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [f"{r['tool']}\n{r['source']}, {r['output']}" for r in runs]
    fig, ax = plt.subplots(figsize=(1.6 * len(runs) + 2, 4))
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["peak_rss_mb"] / 1e3 for r in runs], 0.4, label="peak RSS")
    ax.bar([i + 0.2 for i in x], [r["peak_anon_mb"] / 1e3 for r in runs], 0.4, label="peak anonymous RSS")
    ax.axhline(result["float32_gb"], color="k", ls="--", lw=1, label="model in float32")
    ax.axhline(result["bf16_gb"], color="gray", ls=":", lw=1, label="model in bfloat16 (source size)")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("GB")
    ax.set_title(f"Converting {SHAPE} (random weights), {result['device']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", action="store_true", help="also convert the same weights from a PyTorch .bin")
    ap.add_argument("--work-dir", help="where the source and outputs go (default: a temp dir)")
    args = ap.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="convert-memory-"))
    src = work / f"{SHAPE}-bf16"
    print(f"building {src} ...", flush=True)
    build = f"from benchmarks import convert_memory as c; print(c.build_source(c.Path({str(src)!r}), {args.bin}))"
    params = int(subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, check=True, cwd=ROOT)
                 .stdout.split()[-1])
    jobs = [("mlx-hybrid", src, False), ("mlx-lm", src, False), ("mlx-hybrid", src, True), ("mlx-lm", src, True)]
    if args.bin:
        jobs += [("mlx-hybrid", work / f"{src.name}-bin", False), ("mlx-hybrid", work / f"{src.name}-bin", True)]
    result = {
        "shape": SHAPE, "parameters": params, "float32_gb": round(params * 4 / 1e9, 2),
        "bf16_gb": round(params * 2 / 1e9, 2), "device": device_description()["default_label"],
        "date": time.strftime("%Y-%m-%d"), "runs": [],
    }
    for i, (tool, source, quantize) in enumerate(jobs):
        r = measure(tool, source, work / f"out-{i}", quantize)
        kind = "safetensors" if source == src else ".bin"
        r.update(tool=tool, source=kind, output="4-bit g64" if quantize else "bf16")
        result["runs"].append(r)
        print(f"{tool:10s} {r['source']:11s} -> {r['output']:9s}: peak RSS {r['peak_rss_mb'] / 1e3:.2f} GB, "
              f"anonymous {r['peak_anon_mb'] / 1e3:.2f} GB, {r['seconds']} s "
              f"(float32 size {result['float32_gb']} GB)", flush=True)
    out = BENCH_DIR / "results" / f"convert-memory-{SHAPE}-{slugify(result['device'])}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
