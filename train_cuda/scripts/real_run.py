"""The real run: pseudo-labels -> 50% hybrid -> 25% hybrid, and perplexity of teacher and students
on held-out text (the shape of "The Mamba in the Llama" Table 6: the ratio to the teacher).

    python train_cuda/scripts/real_run.py --teacher TEACHER --corpus CORPUS_DIR --out OUT [--settings YAML] [--tiny] [--resume] [--gpus N]

TEACHER: a Hugging Face Llama/Mistral directory, or a .gguf file (converted once into OUT/teacher;
needs the gguf and accelerate packages). CORPUS_DIR: train.txt and heldout.txt, one document a
line (scripts/fetch_corpus.py writes them). Each stage runs as its own `python -m hybrid_train`
command from a config written to OUT/configs/ (settings: configs/real_run.yaml); --tiny shrinks
every size for a CPU smoke test. A stage whose model already exists is skipped, so a killed run
restarted with --resume goes on where it stopped. OUT/report.json gets the numbers and timings.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # hybrid_train, whether installed or not
SETTINGS = HERE.parent / "configs" / "real_run.yaml"
TINY = {  # sizes for the CPU test of this script
    "prompts": {"max_prompts": 8},
    "pseudo-labels": {"max_new_tokens": 16, "batch_size": 4},
    "distill50": {"steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
    "distill25": {"steps": 3, "batch_size": 4, "seq_len": 64, "warmup_steps": 1, "save_every": 2},
    "perplexity": {"seq_len": 32, "max_blocks": 4},
}


def make_prompts(text: Path, sentences: int, stride: int, max_prompts: int) -> list[str]:
    """Windows of consecutive sentences from each document (line) of the training text."""
    prompts = []
    for doc in text.read_text(encoding="utf-8").splitlines():
        parts = [s for s in re.split(r"(?<=[.!?])\s+", doc.strip()) if s]
        prompts += [" ".join(parts[i : i + sentences]) for i in range(0, max(1, len(parts) - sentences), stride)]
    return prompts[:max_prompts]


def hf_model(path: str, dest: Path, timings: dict) -> Path:
    """PATH, or for a .gguf file its Hugging Face conversion in DEST (made once, not in every stage)."""
    path = Path(path).resolve()
    if path.suffix != ".gguf":
        return path
    if not (dest / "config.json").is_file():
        began = time.time()
        subprocess.run([sys.executable, "-m", "hybrid_train", "gguf-to-hf", str(path), str(dest)], check=True, cwd=HERE.parent)
        timings["gguf-to-hf"] = round(time.time() - began, 1)
    return dest


def head_dim(model: Path) -> int:
    """The attention head size of a model directory: hybrids' d_state (Mamba2 heads = attention
    heads, as in MambaInLlama)."""
    config = json.loads((model / "config.json").read_text())
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


# GPUs of this host the training and labelling stages run on (--gpus), one process each, under torchrun.
GPUS = 1


def stage(name: str, cfg: dict, out: Path, resume: bool, timings: dict, kind: str | None = None):
    """Run `python -m hybrid_train KIND` (KIND defaults from the name) on cfg, timing it under name;
    with --gpus N every stage but perplexity (one process reads the held-out text quickly) runs
    under `torchrun --standalone --nproc_per_node=N` (DDP or FSDP: the config's `parallel`)."""
    path = out / "configs" / f"{name}.json"
    path.write_text(json.dumps(cfg, indent=1) + "\n")
    kind = kind or ("distill" if name.startswith("distill") else name)
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={GPUS}"] if GPUS > 1 and kind != "perplexity" else []
    cmd = [sys.executable, *launch, "-m", "hybrid_train", kind, "--config", str(path)] + (["--resume"] if resume else [])
    began = time.time()
    subprocess.run(cmd, check=True, cwd=HERE.parent)
    timings[name] = round(time.time() - began, 1)


def load_settings(path: Path, tiny: dict | None = None) -> dict:
    """A run's yaml settings, with the --tiny sizes (section -> values) laid over them when given."""
    settings = yaml.safe_load(path.read_text())
    for section, values in (tiny or {}).items():
        if section in settings:  # a section a settings file leaves out stays out
            settings[section].update(values)
    return settings


def parse_args(doc: str, base: str) -> argparse.Namespace:
    """The real-run scripts' command line: --BASE (model dir or .gguf), --corpus, --out, --tiny, --resume."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument(f"--{base}", required=True)
    parser.add_argument("--corpus", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--settings", type=Path, help="a settings file in place of the script's own (configs/)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, for a CPU test")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of this host to train and label on (torchrun)")
    return parser.parse_args()


def script_main(doc: str, base: str, run) -> int:
    """A real-run script's main: its command line (`parse_args`), then run(args), with a
    TrainError as one line on stderr and a failed stage's exit status (it printed its own error).
    The script puts hybrid_train on sys.path."""
    global GPUS
    args = parse_args(doc, base)
    GPUS = args.gpus
    from transformers.utils import logging

    from hybrid_train.errors import TrainError

    logging.disable_progress_bar()  # ours are the rich bars (as in hybrid_train's command line)
    try:
        return run(args)
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        return e.returncode


def check_corpus(corpus: Path):
    from hybrid_train.errors import TrainError

    missing = [name for name in ("train.txt", "heldout.txt") if not (corpus / name).is_file()]
    if missing:
        raise TrainError(f"{corpus} has no {missing[0]} (scripts/fetch_corpus.py writes the corpus)")


def start(args, path: Path, tiny: dict) -> tuple[dict, Path, dict, float]:
    """A run's settings (path, or --settings; with the --tiny sizes when asked), its out directory
    (made, with configs/), an empty timings dict for `stage` and the start time for `finish`."""
    from hybrid_train.errors import TrainError

    path = args.settings or path
    if not path.is_file():
        raise TrainError(f"no settings file {path}")
    out = args.out.resolve()
    (out / "configs").mkdir(parents=True, exist_ok=True)
    return load_settings(path, tiny if args.tiny else None), out, {}, time.time()


def finish(out: Path, report: dict, timings: dict, began: float) -> int:
    """OUT/report.json: the report with the stage timings and the total, also printed."""
    report["seconds"] = dict(timings, total=round(time.time() - began, 1))
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


def run(args) -> int:
    settings, out, timings, began = start(args, SETTINGS, TINY)
    teacher = hf_model(args.teacher, out / "teacher", timings)

    prompts = out / "prompts.txt"
    p = settings["prompts"]
    prompts.write_text("\n".join(make_prompts(args.corpus / "train.txt", p["sentences"], p["stride"], p["max_prompts"])) + "\n")
    labels = out / "labels.jsonl"
    if not labels.is_file():
        stage("pseudo-labels", dict(settings["pseudo-labels"], teacher=str(teacher), prompts=str(prompts), out=str(labels)),
              out, False, timings)
    previous = None
    for name in ("distill50", "distill25"):
        model = out / name / "model"
        if not (model / "config.json").is_file():
            cfg = dict(settings[name], teacher=str(teacher), data=str(labels), out=str(out / name),
                       text=[str(args.corpus / t) for t in settings[name].get("text", [])],
                       hybrid={"d_state": head_dim(teacher)}, init=previous)
            stage(name, cfg, out, args.resume, timings)
        previous = str(model)
    report_file = out / "perplexity.json"
    stage("perplexity", dict(settings["perplexity"], models=[str(teacher), str(out / "distill50" / "model"),
                                                           str(out / "distill25" / "model")],
                             text=[str(args.corpus / "heldout.txt")], out=str(report_file)), out, False, timings)
    report = {
        "teacher": str(args.teacher),
        "corpus": str(args.corpus),
        "prompts": len(prompts.read_text().splitlines()),
        "perplexity": json.loads(report_file.read_text()),
    }
    return finish(out, report, timings, began)


if __name__ == "__main__":
    sys.exit(script_main(__doc__, "teacher", run))
