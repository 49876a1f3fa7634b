"""How `distill` scales over the GPUs of one host: the same distillation (a 50% Mamba2 student of a
Llama teacher, KL + NLL on 512-token sequences) on 1, 2 and 4 GPUs with DDP and FSDP, as tokens/s
per GPU, scaling efficiency and the peak memory a GPU held, in one table
(OUT/train-scaling-SHAPE.json and .png, the table printed as benchmarks/README.md shows it).

    python train_cuda/scripts/scaling.py --shape llama-3.2-1b --runs ddp:1,ddp:2,ddp:4,fsdp:2,fsdp:4 --out OUT
    python train_cuda/scripts/scaling.py --shape llama-3.2-3b --freeze none --grad-checkpointing \
        --runs ddp:1,fsdp:2,fsdp:4,fsdp:4:shard --out OUT

The teacher has random weights in the shape's dimensions and a small byte-level tokenizer (the
data are random token ids over the shape's whole vocabulary): speed and memory do not depend on
the values. Each run is `torchrun --standalone --nproc_per_node=G -m hybrid_train distill` with a
batch of --per-gpu examples on each GPU (weak scaling: a step's examples grow with the GPUs);
tokens/s is over the steps after --warmup, peak memory the most any process held in a step
(`torch.cuda.max_memory_allocated`). A run that runs out of GPU memory is reported as such.
A run is `PARALLEL:GPUS[:shard]`, shard: the frozen teacher sharded too (teacher_sharding).
"""

import argparse
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# transformers LlamaConfig fields of the published models (random weights here); tiny: a check on the CPU.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, rope_theta=10000.0),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}


def make_teacher(path: Path, shape: str) -> Path:
    """A Hugging Face Llama directory with random bf16 weights and a 300-token byte-level tokenizer,
    made in a process of its own: on the GPU (seconds, not the minutes transformers' initialization
    takes on the CPU), whose memory is all given back before the runs."""
    if not (path / "config.json").is_file():
        child = multiprocessing.get_context("spawn").Process(target=_make_teacher, args=(path, shape))
        child.start()
        child.join()
        if child.exitcode:
            sys.exit(f"error: making the {shape} teacher failed")
    return path


def _make_teacher(path: Path, shape: str):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["random weights, random tokens"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    tmp = path.with_name(path.name + ".tmp")
    fast.save_pretrained(tmp)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)


def make_data(path: Path, vocab: int, rows: int, prompt: int, response: int) -> Path:
    """Pseudo-labels of random token ids: prompt, then the response the loss is on."""
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"prompt_ids": [rng.randrange(vocab) for _ in range(prompt)],
                                        "response_ids": [rng.randrange(vocab) for _ in range(response)]}) + "\n"
                            for _ in range(rows)))
    return path


def device() -> str:
    """The GPUs' name and count, from nvidia-smi (this process never touches CUDA itself)."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.split("\n")
    except OSError:
        return "CPU"
    names = [n.strip() for n in names if n.strip()]
    return f"{names[0]} ({len(names)} of one host)" if names else "CPU"


def measure(out: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[warmup:]
    seconds = timed[-1]["elapsed_s"] - rows[warmup - 1]["elapsed_s"]
    return {"tokens_per_s": sum(r["tokens"] for r in timed) / seconds, "steps_timed": len(timed),
            "peak_gib": max(r.get("peak_gib", 0.0) for r in rows), "last_loss": rows[-1]["loss"]}


def run(args, teacher: Path, data: Path, spec: str) -> dict:
    parallel, gpus, *rest = spec.split(":")
    gpus = int(gpus)
    shard = rest == ["shard"]
    name = f"{parallel}-{gpus}" + ("-shard" if shard else "")
    out = args.out / name
    cfg = dict(teacher=str(teacher), data=str(data), out=str(out), steps=args.steps, batch_size=args.per_gpu * gpus,
               micro_batch=args.micro, seq_len=args.seq_len, lr=1e-4, save_every=10**6, parallel=parallel,
               teacher_sharding="shard" if shard else "replicate", grad_checkpointing=args.grad_checkpointing,
               freeze=[] if args.freeze == "none" else args.freeze.split(","), calibrate=2, mixer="mamba2",
               attention={"every": 2})
    (args.out / f"{name}.json").write_text(json.dumps(cfg, indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", "hybrid_train", "distill", "--config", str(args.out / f"{name}.json")]
    began = time.time()
    done = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    (args.out / f"{name}.log").write_text(done.stdout[-20000:] + done.stderr[-20000:])
    row = {"run": name, "parallel": parallel, "gpus": gpus, "teacher": "sharded" if shard else "replicated",
           "wall_s": round(time.time() - began, 1)}
    if done.returncode:
        oom = "OutOfMemoryError" in done.stderr or "CUDA out of memory" in done.stderr
        return {**row, "error": "out of memory" if oom else done.stderr.strip().splitlines()[-1][-300:]}
    return {**row, **measure(out, args.warmup)}


def plot(rows: list[dict], path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key in sorted({(r["parallel"], r["teacher"]) for r in rows}):
        pts = [r for r in rows if (r["parallel"], r["teacher"]) == key and "error" not in r]
        if pts:
            label = f"{key[0]} (teacher {key[1]})"
            a.plot([r["gpus"] for r in pts], [r["tokens_per_s"] / r["gpus"] for r in pts], "o-", label=label)
            b.plot([r["gpus"] for r in pts], [r["peak_gib"] for r in pts], "o-", label=label)
    a.set(xlabel="GPUs", ylabel="tokens/s per GPU", title="throughput")
    b.set(xlabel="GPUs", ylabel="peak GiB per GPU", title="memory")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_xticks(sorted({r["gpus"] for r in rows}))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    p.add_argument("--runs", default="ddp:1,ddp:2,ddp:4,fsdp:2,fsdp:4", help="PARALLEL:GPUS[:shard], comma-separated")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    p.add_argument("--per-gpu", type=int, default=8, help="examples a GPU takes per step")
    p.add_argument("--micro", type=int, default=4, help="examples per forward")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--freeze", default="mlp", help="parts kept the teacher's (distill's freeze), comma-separated, or none")
    p.add_argument("--grad-checkpointing", action="store_true")
    args = p.parse_args()
    if args.warmup < 1 or args.steps <= args.warmup:
        p.error("--steps must exceed --warmup, which must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    teacher = make_teacher(args.out / f"teacher-{args.shape}", args.shape)
    data = make_data(args.out / "labels.jsonl", SHAPES[args.shape]["vocab_size"], 256, args.seq_len // 8, args.seq_len - args.seq_len // 8)
    rows = []
    for spec in args.runs.split(","):
        rows.append(run(args, teacher, data, spec))
        print(json.dumps(rows[-1]), flush=True)
    title = (f"distill, {args.shape} (random weights), {args.per_gpu} x {args.seq_len} tokens a GPU a step, "
             f"freeze {args.freeze}{', activation checkpointing' if args.grad_checkpointing else ''}")
    report = {"shape": args.shape, "device": device(), "date": date.today().isoformat(), "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
              "command": " ".join(["python", "train_cuda/scripts/scaling.py", *sys.argv[1:]]).replace(str(args.out), "OUT"),
              "runs": rows}
    # Named as benchmarks/results/ names them (add the device: -nvidia-h100), and printed as its
    # README shows them (benchmarks/index.py).
    result = args.out / f"train-scaling-{args.shape}.json"
    result.write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, result.with_suffix(".png"), title)
    sys.path.insert(0, str(ROOT.parent))
    from benchmarks.index import render_file

    print(render_file(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
