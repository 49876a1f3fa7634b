"""scripts/real_default.py end to end on the CPU: tiny random teacher, tiny corpus, --tiny sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hybrid_train import stages
from hybrid_train.model import load_hybrid, mixer_types
from hybrid_train.teacher import load_teacher

ROOT = Path(__file__).resolve().parents[1]


def test_real_default_script(tmp_path, teacher_dir, article_corpus):
    """The default's settings with configs/real_quality_e2e.yaml's end-to-end stage added, as two
    processes (--gpus 2: every labelling and training stage under torchrun, gloo). One run covers
    the default's stages and the second stage; the other settings files are checked without a run
    (below), and real_quality_e2e.yaml is real_quality.yaml plus that stage."""
    out = tmp_path / "out"
    settings = yaml.safe_load((ROOT / "configs" / "real_default.yaml").read_text())
    settings["end-to-end"] = yaml.safe_load((ROOT / "configs" / "real_quality_e2e.yaml").read_text())["end-to-end"]
    (tmp_path / "settings.yaml").write_text(yaml.safe_dump(settings))
    cmd = [sys.executable, str(ROOT / "scripts" / "real_default.py"), "--teacher", str(teacher_dir),
           "--corpus", str(article_corpus), "--out", str(out), "--gpus", "2", "--settings", str(tmp_path / "settings.yaml"), "--tiny"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for trained in ("student", "student-e2e", "redrafter"):
        assert torch.load(out / trained / "checkpoint.pt", weights_only=False)["world"] == 2
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
    # The second stage starts from that student and trains all but the embeddings; the drafter
    # and the perplexity stages take its student, perplexity lists both students.
    stage2 = json.loads((out / "configs" / "end-to-end.json").read_text())
    assert stage2["init"] == str(out / "student" / "model") and stage2["freeze"] == ["embed_tokens"]
    second = load_hybrid(out / "student-e2e" / "model")
    assert mixer_types(second) == mixer_types(student)
    assert torch.equal(second.get_parameter("model.embed_tokens.weight"), teacher_weights["model.embed_tokens.weight"])
    for k in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mamba.out_proj.weight"):
        assert not torch.equal(second.get_parameter(k), student.get_parameter(k)), k
    assert json.loads((out / "configs" / "redrafter.json").read_text())["base"] == str(out / "student-e2e" / "model")
    for ppl in report["perplexity"].values():  # news and held-out chat: teacher, student, second student
        assert len(ppl) == 3 and ppl[0]["word_ratio"] == 1.0
        assert all(row["ratio"] > 0 and row["word_ppl"] > 1 for row in ppl[1:])
    # The held-out chat answers are not in the distillation data.
    lines = {name: (out / name).read_text().splitlines() for name in ("news.jsonl", "chat.jsonl", "distill.jsonl", "chat-heldout.txt")}
    assert len(lines["news.jsonl"]) == 2 * 8  # 2 samples of each of the 8 windows
    assert lines["distill.jsonl"] == lines["news.jsonl"] + lines["chat.jsonl"][:-2] and len(lines["chat-heldout.txt"]) == 2
    drafter = json.loads((out / "redrafter" / "redrafter" / "config.json").read_text())
    assert drafter["tied_lm_head"] and drafter["exit_dim"] == teacher.config.hidden_size
    assert len(report["redrafter"]["top1"]) == 2
    assert set(report["seconds"]) >= {"news", "questions", "chat", "student", "end-to-end", "redrafter", "perplexity-news", "perplexity-chat", "total"}
    missing = subprocess.run(cmd[:-2] + [str(tmp_path / "none.yaml")], capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.strip() == f"error: no settings file {tmp_path / 'none.yaml'}"
    # The second student and its drafter convert for the runtime (benchmarks/gpu/reproduce.sh's
    # quality stage), where greedy speculation decodes what plain greedy decoding does.
    import mlx.core as mx

    from mlx_hybrid.convert.hf import convert
    from mlx_hybrid.decode import generate_step
    from mlx_hybrid.loader import load_model
    from mlx_hybrid.sampling import SamplingParams
    from mlx_hybrid.speculative import load_proposer
    from mlx_hybrid.speculative.steps import speculative_steps

    target = convert(out / "student-e2e" / "model", tmp_path / "target", dtype="float32", redrafter=out / "redrafter" / "redrafter")
    model = load_model(target)
    prompt = [3, 17, 29, 5, 41, 7, 11]
    plain = [t for t, _ in generate_step(mx.array(prompt), model, model.make_cache(), lambda x: mx.argmax(x, -1), max_tokens=16)]
    drafted = []
    for new, _ in speculative_steps(model, load_proposer("redrafter", model, target), prompt, model.make_cache(), SamplingParams()):
        drafted += new
        if len(drafted) >= 16:
            break
    assert drafted[:16] == plain


@pytest.mark.parametrize("name", ["real_default", "real_hybrid_target", "real_quality", "real_quality_e2e"])
def test_real_default_settings_parse(name):
    """Every settings file of real_default.py has the sections it reads, and its training sections
    are valid distill configs: a typo fails here, not minutes into a GPU run."""
    settings = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    assert {"news", "questions", "pseudo-labels", "student", "drafter-labels", "redrafter", "perplexity"} <= set(settings)
    for section in ("student", "end-to-end"):
        if section in settings:
            stages.parse(stages.DistillConfig, dict(settings[section], teacher="t", data="d", out="o"))


def test_quality_e2e_settings_are_the_quality_recipe_plus_its_second_stage():
    """configs/real_quality_e2e.yaml is configs/real_quality.yaml (run on GPUs, reported in the
    README) with an end-to-end section and nothing else changed."""
    quality = yaml.safe_load((ROOT / "configs" / "real_quality.yaml").read_text())
    e2e = yaml.safe_load((ROOT / "configs" / "real_quality_e2e.yaml").read_text())
    assert set(e2e.pop("end-to-end")) >= {"steps", "lr", "freeze"} and e2e == quality
