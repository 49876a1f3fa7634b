"""Calibrate MODEL's Medusa tree on held-out chat questions of the heads run: measure each head's
top-k accuracy on them and write the greedy sparse tree of NODES nodes (`medusa_choices`) into
MODEL/medusa/config.json (`mlx_hybrid.speculative.medusa.calibrate`).

QUESTIONS is the heads run's `chat-heldout.jsonl` (train_cuda/scripts/real_heads.py: questions no
head trained on, each row keeping its prompt); those that are also the benchmark's
(benchmarks/chat_prompts.txt) are dropped, so the tree is not fitted to the benchmark. 24 nodes:
the quickest Medusa tree among 16 to 63 nodes on the H100 (a bigger tree costs more pass time than
its extra accepted tokens bring).

    python -m benchmarks.gpu.calibrate OUTDIR/llama-target OUTDIR/heads/chat-heldout.jsonl [--nodes 24]
"""
import argparse
import json
from pathlib import Path

BENCHMARK_PROMPTS = Path(__file__).resolve().parents[1] / "chat_prompts.txt"

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("model", type=Path, help="target directory with medusa/")
p.add_argument("questions", type=Path, help="the heads run's chat-heldout.jsonl")
p.add_argument("--nodes", type=int, default=24)
p.add_argument("--count", type=int, default=24, help="questions to calibrate on")
args = p.parse_args()

from mlx_hybrid.chat import render_chat  # noqa: E402
from mlx_hybrid.loader import load_model, load_tokenizer  # noqa: E402
from mlx_hybrid.speculative.medusa import calibrate  # noqa: E402

model, tokenizer = load_model(args.model), load_tokenizer(args.model)
benchmark = {q.strip().lower() for q in BENCHMARK_PROMPTS.read_text().splitlines()}
questions = [json.loads(line)["prompt"] for line in args.questions.open()]
questions = [q for q in questions if q.strip().lower() not in benchmark][: args.count]
prompts = [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in questions]
r = calibrate(model, args.model / "medusa", prompts, num_nodes=args.nodes)
print(f"calibrated on {len(questions)} questions; top-1 per head {[round(a[0], 3) for a in r['head_accuracies']]}; "
      f"expected tokens a pass {r['expected_length']:.3f}")
