"""The heads run: self-distillation data from a base model, Medusa-1 heads and a ReDrafter drafter
trained on it, and their top-1 accuracy per head / drafted step on held-out continuations.

    python train_cuda/scripts/real_heads.py --base BASE --corpus CORPUS_DIR --out OUT [--tiny] [--resume]

BASE: a Hugging Face Llama/Mistral directory, a .gguf file (converted once into OUT/base; needs the
gguf and accelerate packages) or an exported hybrid directory. CORPUS_DIR: train.txt and
heldout.txt, one document a line (scripts/fetch_corpus.py). The base answers prompts from both
files greedily (`pseudo-labels`); `medusa` and `redrafter` train on the train.txt answers and
measure accuracy on the held-out ones. Each stage runs as its own `python -m hybrid_train` command
from a config in OUT/configs/ (settings: configs/real_heads.yaml; --tiny shrinks them for a CPU
test). A finished stage is skipped, so a killed run restarted with --resume goes on where it
stopped. Results: OUT/report.json; heads in OUT/medusa1/medusa/ and OUT/redrafter/redrafter/
(copy them into BASE's model directory as medusa/ and redrafter/, or pass their paths).
"""

import json
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from real_run import finish, hf_model, make_prompts, parse_args, stage, start  # noqa: E402

SETTINGS = HERE.parent / "configs" / "real_heads.yaml"
TINY = {  # sizes for the CPU test of this script
    "prompts": {"max_prompts": 8},
    "heldout": {"max_prompts": 4},
    "pseudo-labels": {"max_new_tokens": 16, "batch_size": 4},
    "medusa": {"num_heads": 3, "steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
    "redrafter": {"draft_steps": 3, "steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
}


def main() -> int:
    args = parse_args(__doc__, "base")
    settings, out, timings, began = start(args, SETTINGS, TINY)
    base = hf_model(args.base, out / "base", timings)

    labels = {}
    for name, text in (("prompts", "train.txt"), ("heldout", "heldout.txt")):
        p = settings[name]
        prompts = out / f"{name}.txt"
        prompts.write_text("\n".join(make_prompts(args.corpus / text, p["sentences"], p["stride"], p["max_prompts"])) + "\n")
        labels[name] = out / f"{name}.jsonl"
        if not labels[name].is_file():
            cfg = dict(settings["pseudo-labels"], teacher=str(base), prompts=str(prompts), out=str(labels[name]))
            stage(f"pseudo-labels-{name}", cfg, out, False, timings, kind="pseudo-labels")

    reports = {}
    for kind, name in (("medusa", "medusa1"), ("redrafter", "redrafter")):
        report = out / name / "report.json"
        if not report.is_file():
            cfg = dict(settings[kind], base=str(base), data=str(labels["prompts"]), eval_data=str(labels["heldout"]),
                       out=str(out / name))
            stage(name, cfg, out, args.resume, timings, kind=kind)
        reports[name] = json.loads(report.read_text())

    def count(path):
        return len(path.read_text().splitlines())

    report = {
        "base": str(args.base),
        "corpus": str(args.corpus),
        "train_sequences": count(labels["prompts"]),
        "heldout_sequences": count(labels["heldout"]),
        "medusa1": reports["medusa1"]["heldout"],
        "redrafter": reports["redrafter"]["heldout"],
    }
    return finish(out, report, timings, began)


if __name__ == "__main__":
    sys.exit(main())
