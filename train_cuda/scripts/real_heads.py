"""The heads run: self-distillation data from a base model, Medusa-1 heads and a ReDrafter drafter
trained on it, and their top-1 accuracy per head / drafted step on held-out continuations.

    python train_cuda/scripts/real_heads.py --base BASE --corpus CORPUS_DIR --out OUT [--tiny] [--resume]

BASE: a Hugging Face Llama/Mistral directory, a .gguf file (converted once into OUT/base; needs the
gguf and accelerate packages) or an exported hybrid directory. CORPUS_DIR: train.txt and
heldout.txt, one document a line (scripts/fetch_corpus.py). The base continues windows of both
files greedily (`pseudo-labels`), and answers, with its chat template and greedily, questions it
wrote itself (Magpie, as in real_default.py; those in benchmarks/chat_prompts.txt, the speed
benchmark's prompts, are dropped); `medusa` and `redrafter` train on the train.txt continuations
and most answers, and measure accuracy on the held-out continuations and the last answers. Each stage runs as its own `python -m hybrid_train` command
from a config in OUT/configs/ (settings: configs/real_heads.yaml; --tiny shrinks them for a CPU
test). A finished stage is skipped, so a killed run restarted with --resume goes on where it
stopped. Results: OUT/report.json; heads in OUT/medusa1/medusa/ and OUT/redrafter/redrafter/
(copy them into BASE's model directory as medusa/ and redrafter/, or pass their paths), and with
`draft` among the stages a draft model (a few of BASE's layers, distilled) in OUT/draft/draft/
(`hybrid convert` it to BASE's converted directory's draft/). With
`medusa2` among the settings' `stages`, Medusa-2 then trains the base with Medusa-1's heads:
OUT/medusa2/model/ is the changed base, its heads in OUT/medusa2/model/medusa/.
"""

import json
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from real_default import merge, questions, user_turn_prefix, write_prompts  # noqa: E402
from real_run import finish, hf_model, make_prompts, script_main, stage, start  # noqa: E402

from hybrid_train.errors import TrainError  # noqa: E402
from hybrid_train.teacher import load_tokenizer  # noqa: E402

SETTINGS = HERE.parent / "configs" / "real_heads.yaml"
TINY = {  # sizes for the CPU test of this script
    "prompts": {"max_prompts": 8},
    "heldout": {"max_prompts": 4},
    "pseudo-labels": {"max_new_tokens": 16, "batch_size": 4},
    "chat": {"questions": 8, "question_batch_size": 4, "max_question_tokens": 12, "ended_only": False, "min_chars": 1,
             "heldout": 2, "max_new_tokens": 12, "batch_size": 4},
    "medusa1": {"num_heads": 3, "steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
    "medusa2": {"num_heads": 3, "steps": 2, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
    "redrafter": {"draft_steps": 3, "steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
    "draft": {"layers": [0, 3], "steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
}


def run(args) -> int:
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

    c = settings["chat"]
    tokenizer = load_tokenizer(base)
    seeds = write_prompts(out / "question-prompts.jsonl", [user_turn_prefix(tokenizer)] * c["questions"])
    asked = out / "questions.jsonl"
    if not asked.is_file():
        cfg = dict(settings["pseudo-labels"], teacher=str(base), prompts=str(seeds), out=str(asked), temperature=c["question_temperature"],
                   top_p=c["question_top_p"], seed=c["question_seed"], max_new_tokens=c["max_question_tokens"], batch_size=c["question_batch_size"])
        stage("questions", cfg, out, False, timings, kind="pseudo-labels")
    eos = tokenizer.eos_token_id if c["ended_only"] else None
    kept = questions(asked, eos, c["min_chars"])
    if len(kept) <= c["heldout"]:
        raise TrainError(f"the base wrote {len(kept)} usable questions: fewer than heldout ({c['heldout']}) + 1")
    for name, part in (("chat", kept[: -c["heldout"]]), ("chat-heldout", kept[-c["heldout"] :])):
        labels[name] = out / f"{name}.jsonl"
        if not labels[name].is_file():
            cfg = dict(settings["pseudo-labels"], teacher=str(base), prompts=str(write_prompts(out / f"{name}-prompts.jsonl", part)),
                       out=str(labels[name]), chat=True, max_new_tokens=c["max_new_tokens"], batch_size=c["batch_size"])
            stage(f"pseudo-labels-{name}", cfg, out, False, timings, kind="pseudo-labels")
    train = merge([labels["prompts"], labels["chat"]], out / "train.jsonl")
    heldout = merge([labels["heldout"], labels["chat-heldout"]], out / "eval.jsonl")

    reports = {}
    for name in settings["stages"]:
        kind = {"medusa1": "medusa"}.get(name, name)
        report = out / name / "report.json"
        if not report.is_file():
            cfg = dict(settings[name], base=str(base), data=str(train), eval_data=str(heldout), out=str(out / name))
            if name == "medusa2":  # the paper's two stages: Medusa-1's heads, then heads and backbone together
                cfg["init_heads"] = str(out / "medusa1" / "medusa")
            stage(name, cfg, out, args.resume, timings, kind=kind)
        reports[name] = json.loads(report.read_text())

    def count(path):
        return len(path.read_text().splitlines())

    report = {
        "base": str(args.base),
        "corpus": str(args.corpus),
        "train_sequences": count(train),
        "heldout_sequences": count(heldout),
        "chat_questions": len(kept),
        **{name: r["heldout"] for name, r in reports.items()},
    }
    return finish(out, report, timings, began)


if __name__ == "__main__":
    sys.exit(script_main(__doc__, "base", run))
