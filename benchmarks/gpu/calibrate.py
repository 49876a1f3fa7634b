"""Calibrate MODEL's Medusa tree (NODES, default 24; MODEL, default /tmp/mt) on 24 held-out chat
questions of the heads run (not the benchmark's: benchmarks/chat_prompts.txt). 24 nodes: the
quickest Medusa tree in each of the thirteenth session's three H100 runs (16 to 63 nodes;
benchmarks/README.md).

    python3 benchmarks/gpu/calibrate.py [NODES] [MODEL]
"""
import json
import sys
from pathlib import Path

from mlx_hybrid.chat import render_chat
from mlx_hybrid.loader import load_model, load_tokenizer
from mlx_hybrid.speculative.medusa import calibrate

mt = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/mt")
model, tokenizer = load_model(mt), load_tokenizer(mt)
benchmark = {q.strip().lower() for q in Path("benchmarks/chat_prompts.txt").read_text().splitlines()}
# The held-out questions from their pseudo-labels (each row keeps its prompt), which `labels.sh`
# keeps for later runs; the run's own question file is not made again when they are carried.
questions = [json.loads(line)["prompt"] for line in open("/tmp/heads/chat-heldout.jsonl")]
questions = [q for q in questions if q.strip().lower() not in benchmark][:24]
prompts = [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in questions]
r = calibrate(model, mt / "medusa", prompts, num_nodes=int(sys.argv[1]) if len(sys.argv) > 1 else 24)
print(f"calibrated on {len(questions)} questions; top-1 per head {[round(a[0], 3) for a in r['head_accuracies']]}; "
      f"expected tokens a pass {r['expected_length']:.3f}")
