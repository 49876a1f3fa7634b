"""scripts/real_default.py end to end on the CPU: tiny random teacher, tiny corpus, --tiny sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hybrid_train.model import load_hybrid, mixer_types
from hybrid_train.teacher import load_teacher

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


@pytest.mark.parametrize("name, samples, freeze, gpus", [
    ("real_hybrid_target", 1, ["mlp"], 2),
    ("real_quality_e2e", 8, ["mlp", "self_attn", "embed_tokens"], 1),
])
def test_real_default_script_with_other_settings(tmp_path, teacher_dir, article_corpus, name, samples, freeze, gpus):
    """--settings: configs/real_hybrid_target.yaml (one news sample a window, the teacher's MLPs
    frozen in the student) and configs/real_quality_e2e.yaml (eight samples, the default's parts
    frozen, then the end-to-end stage) run the same stages with their own settings; --tiny still
    shrinks them. --gpus 2: the labelling and training stages run as two processes (torchrun, gloo)."""
    out = tmp_path / "out"
    settings = ROOT / "configs" / f"{name}.yaml"
    cmd = [sys.executable, str(ROOT / "scripts" / "real_default.py"), "--teacher", str(teacher_dir),
           "--corpus", str(article_corpus), "--out", str(out), "--gpus", str(gpus), "--settings", str(settings), "--tiny"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    for trained in ("student", "redrafter"):
        assert torch.load(out / trained / "checkpoint.pt", weights_only=False)["world"] == gpus
    assert len((out / "news.jsonl").read_text().splitlines()) == 8 * samples  # of each of the 8 windows
    assert json.loads((out / "configs" / "student.json").read_text())["freeze"] == freeze
    report = json.loads((out / "report.json").read_text())
    assert len(report["redrafter"]["top1"]) == 2
    if name == "real_quality_e2e":
        # The second stage starts from the first's student and trains all but the embeddings; the
        # drafter and the perplexity stages take its student, perplexity lists both.
        stage2 = json.loads((out / "configs" / "end-to-end.json").read_text())
        assert stage2["init"] == str(out / "student" / "model") and stage2["freeze"] == ["embed_tokens"]
        first, second = load_hybrid(out / "student" / "model"), load_hybrid(out / "student-e2e" / "model")
        assert mixer_types(second) == mixer_types(first)
        assert torch.equal(second.get_parameter("model.embed_tokens.weight"), first.get_parameter("model.embed_tokens.weight"))
        for k in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mamba.out_proj.weight"):
            assert not torch.equal(second.get_parameter(k), first.get_parameter(k)), k
        assert json.loads((out / "configs" / "redrafter.json").read_text())["base"] == str(out / "student-e2e" / "model")
        assert all(len(rows) == 3 for rows in report["perplexity"].values())
        assert report["seconds"]["end-to-end"] > 0
    missing = subprocess.run(cmd[:-2] + [str(tmp_path / "none.yaml")], capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.strip() == f"error: no settings file {tmp_path / 'none.yaml'}"


def test_quality_e2e_settings_are_the_quality_recipe_plus_its_second_stage():
    """configs/real_quality_e2e.yaml is configs/real_quality.yaml (run on GPUs, reported in the
    README) with an end-to-end section and nothing else changed."""
    quality = yaml.safe_load((ROOT / "configs" / "real_quality.yaml").read_text())
    e2e = yaml.safe_load((ROOT / "configs" / "real_quality_e2e.yaml").read_text())
    assert set(e2e.pop("end-to-end")) >= {"steps", "lr", "freeze"} and e2e == quality
