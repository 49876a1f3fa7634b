"""scripts/real_default.py end to end on the CPU: tiny random teacher, tiny corpus, --tiny sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_train.model import load_hybrid, mixer_types
from hybrid_train.teacher import load_teacher, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_real_default_script(tmp_path, teacher_dir, article_corpus):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "real_default.py"), "--teacher", str(teacher_dir),
           "--corpus", str(article_corpus), "--out", str(out), "--tiny"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    # The student: the teacher's layers, every 2nd one Mamba2; what the settings freeze is the
    # teacher's, bit for bit (the runtime rebuilds those parts from the teacher).
    student, teacher = load_hybrid(out / "student" / "model"), load_teacher(teacher_dir)
    n = teacher.config.num_hidden_layers
    assert mixer_types(student) == ["attention" if i % 2 == 0 else "mamba2" for i in range(n)]
    teacher_weights = dict(teacher.named_parameters())
    frozen = [k for k in dict(student.named_parameters()) if {"mlp", "self_attn", "embed_tokens"} & set(k.split("."))]
    assert frozen and all(torch.equal(student.get_parameter(k), teacher_weights[k]) for k in frozen)
    assert not torch.equal(student.get_parameter("model.layers.1.mamba.out_proj.weight"),
                           teacher_weights["model.layers.1.self_attn.o_proj.weight"])  # the mixers trained
    for ppl in report["perplexity"].values():  # news and held-out chat
        assert ppl[1]["ratio"] > 0 and ppl[1]["word_ppl"] > 1 and ppl[0]["word_ratio"] == 1.0
    # The held-out chat answers are not in the distillation data.
    lines = {name: (out / name).read_text().splitlines() for name in ("news.jsonl", "chat.jsonl", "distill.jsonl", "chat-heldout.txt")}
    assert len(lines["news.jsonl"]) == 2 * 8  # 2 samples of each of the 8 windows
    assert lines["distill.jsonl"] == lines["news.jsonl"] + lines["chat.jsonl"][:-2] and len(lines["chat-heldout.txt"]) == 2
    drafter = json.loads((out / "redrafter" / "redrafter" / "config.json").read_text())
    assert drafter["tied_lm_head"] and drafter["exit_dim"] == teacher.config.hidden_size
    assert len(report["redrafter"]["top1"]) == 2
    assert set(report["seconds"]) >= {"news", "questions", "chat", "student", "redrafter", "perplexity-news", "perplexity-chat", "total"}


@pytest.mark.parametrize("name, samples, freeze", [
    ("real_hybrid_target", 1, ["mlp"]),
    ("real_quality", 8, ["mlp", "self_attn", "embed_tokens"]),
])
def test_real_default_script_with_other_settings(tmp_path, teacher_dir, article_corpus, name, samples, freeze):
    """--settings: configs/real_hybrid_target.yaml (one news sample a window, the teacher's MLPs
    frozen in the student) and configs/real_quality.yaml (eight samples, the default's parts frozen)
    run the same stages with their own settings; --tiny still shrinks them. --gpus 2: the labelling
    and training stages run as two processes (torchrun, gloo)."""
    out = tmp_path / "out"
    settings = ROOT / "configs" / f"{name}.yaml"
    cmd = [sys.executable, str(ROOT / "scripts" / "real_default.py"), "--teacher", str(teacher_dir),
           "--corpus", str(article_corpus), "--out", str(out), "--gpus", "2", "--settings", str(settings), "--tiny"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    for trained in ("student", "redrafter"):
        assert torch.load(out / trained / "checkpoint.pt", weights_only=False)["world"] == 2
    assert len((out / "news.jsonl").read_text().splitlines()) == 8 * samples  # of each of the 8 windows
    assert json.loads((out / "configs" / "student.json").read_text())["freeze"] == freeze
    assert len(json.loads((out / "report.json").read_text())["redrafter"]["top1"]) == 2
    missing = subprocess.run(cmd[:-2] + [str(tmp_path / "none.yaml")], capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.strip() == f"error: no settings file {tmp_path / 'none.yaml'}"
