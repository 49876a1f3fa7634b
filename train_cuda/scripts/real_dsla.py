"""The DSLA run: DSLA-Serve's chained conversion of half of a base model's layers, exported as one
model directory that the MLX runtime runs with any prefix of the conversion order as DSLA.

    python train_cuda/scripts/real_dsla.py --base BASE --corpus CORPUS_DIR --out OUT [--tiny] [--resume]
    python -m benchmarks.dsla_conversion run --model OUT/adaptive --text CORPUS_DIR/heldout.txt --label LABEL

BASE: a Hugging Face Llama/Mistral directory or a .gguf file (converted once into OUT/base; needs
the gguf and accelerate packages). CORPUS_DIR: train.txt and heldout.txt, one document a line
(scripts/fetch_corpus.py). The `dsla` stage ranks layers by attention entropy on prompts from
train.txt, then converts the lower-entropy half one layer per phase, training on train.txt blocks
(KL to the base on every token, no pseudo-labels); settings: configs/real_dsla.yaml, --tiny
shrinks them for a CPU test. OUT/adaptive is written by `hybrid_train.model.save_adaptive`: the
base's attention and the phases' DSLA mixers, in conversion order (least sensitive first), with
entropy.json recording the command that made it. A finished step is skipped, so a killed run
restarted with --resume goes on where it stopped. Timings and per-phase KL: OUT/report.json.
Held-out perplexity per conversion rate comes from the second command (benchmarks/, MLX).
"""

import json
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from real_run import check_corpus, finish, hf_model, make_prompts, script_main, stage, start  # noqa: E402

from hybrid_train.layers import conversion_order  # noqa: E402
from hybrid_train.model import load_hybrid, mixer_types, save_adaptive  # noqa: E402
from hybrid_train.teacher import load_teacher, load_tokenizer  # noqa: E402

SETTINGS = HERE.parent / "configs" / "real_dsla.yaml"
TINY = {  # sizes for the CPU test of this script
    "calibration": {"max_prompts": 4},
    "dsla": {"steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2, "hybrid": {"gate_rank": 4}},
}


def export(base: Path, dsla: Path, out: Path, command: str):
    """save_adaptive of the base and the stage's final student, DSLA layers in the order the stage converted them.
    out/entropy.json as benchmarks/dsla_conversion.py `build` writes it: `run` shows the command that made the weights."""
    student = load_hybrid(dsla / "model")
    entropy = json.loads((dsla / "entropy.json").read_text())["entropy"]
    kinds = mixer_types(student)
    order = [i for i in conversion_order(entropy) if kinds[i] == "dsla"]
    save_adaptive(load_teacher(str(base)), student, out, order, tokenizer=load_tokenizer(str(base)))
    (out / "entropy.json").write_text(json.dumps({"entropy": entropy, "order": order, "command": command}, indent=1) + "\n")


def phases(dsla: Path) -> list[dict]:
    """Per phase: the layer, its KL to the base at the first and last step, its training seconds."""
    rows = []
    for path in sorted(dsla.glob("phase*")):
        metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line]
        rows.append({"layer": int(path.name.split("layer")[1]), "kl_first": metrics[0]["kl"], "kl_last": metrics[-1]["kl"],
                     "gate_similarity_last": metrics[-1]["gate_similarity"], "seconds": round(metrics[-1]["elapsed_s"], 1)})
    return rows


def run(args) -> int:
    check_corpus(args.corpus)
    settings, out, timings, began = start(args, SETTINGS, TINY)
    base = hf_model(args.base, out / "base", timings)

    p = settings["calibration"]
    calibration = out / "calibration.txt"
    calibration.write_text("\n".join(make_prompts(args.corpus / "train.txt", p["sentences"], p["stride"], p["max_prompts"])) + "\n")
    dsla = out / "dsla"
    if not (dsla / "model" / "config.json").is_file():
        cfg = dict(settings["dsla"], teacher=str(base), data=[str(args.corpus / "train.txt")], calibration=str(calibration),
                   out=str(dsla))
        stage("dsla", cfg, out, args.resume, timings)

    adaptive = out / "adaptive"
    if not (adaptive / "config.json").is_file():
        t = time.time()
        export(base, dsla, adaptive, "python train_cuda/scripts/real_dsla.py " + shlex.join(sys.argv[1:]))
        timings["export"] = round(time.time() - t, 1)
    order = json.loads((adaptive / "config.json").read_text())["dsla_conversion"]["order"]
    entropy = json.loads((dsla / "entropy.json").read_text())["entropy"]

    report = {
        "base": str(args.base),
        "corpus": str(args.corpus),
        "calibration_prompts": len(calibration.read_text().splitlines()),
        "layers": len(entropy),
        "order": order,
        "entropy": entropy,
        "phases": phases(dsla),
    }
    finish(out, report, timings, began)
    print(f"next: python -m benchmarks.dsla_conversion run --model {adaptive} --text {args.corpus / 'heldout.txt'} --name NAME --label LABEL")
    return 0


if __name__ == "__main__":
    sys.exit(script_main(__doc__, "base", run))
