"""Every stage end to end on a tiny random teacher: it runs from its config file, lowers its loss,
and writes a model the next stage (and the MLX runtime) loads; a killed run resumes exactly; a
stage runs under torchrun with two processes (gloo on the CPU).

"Lowers its loss": each step is one full batch of the same examples (batch_size = their number),
so the logged losses of the first and last step are the loss of one fixed batch before and after.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SENTENCES, write_config
from safetensors.torch import load_file

from hybrid_train.__main__ import main
from hybrid_train.data import text_blocks
from hybrid_train.model import load_hybrid, mixer_types
from hybrid_train.teacher import load_teacher, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(batch_size=6, lr=3e-3, save_every=4, seed=0)


def run(stage, cfg_path, *extra):
    return main([stage, "--config", str(cfg_path), *extra])


def losses(out: Path, key="loss") -> list[float]:
    return [json.loads(line)[key] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_pseudo_labels_are_the_teachers_greedy_answers(labels, teacher_dir, prompts):
    rows = [json.loads(line) for line in labels.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts.read_text().split("\n")[:-1]
    teacher, tok = load_teacher(teacher_dir), load_tokenizer(teacher_dir)
    for r in rows[:5:4]:  # the first of a left-padded batch and one of the next batch, each alone
        ids = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        assert r["prompt_ids"] == list(ids)
        gen = teacher.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
        assert r["response_ids"] == gen[0, len(ids):].tolist()[: len(r["response_ids"])]
        assert len(r["response_ids"]) == 20 or r["response_ids"][-1] == tok.eos_token_id


@pytest.mark.parametrize("mixer", ["mamba", "mamba2", "dsla"])
def test_distill_lowers_its_loss(tmp_path, teacher_dir, labels, mixer):
    cfg = write_config(tmp_path / "c.yaml", teacher=str(teacher_dir), data=str(labels), out=str(tmp_path / "out"),
                       mixer=mixer, steps=8, hybrid={"d_state": 8}, **FAST)
    assert run("distill", cfg) == 0
    loss = losses(tmp_path / "out")
    assert len(loss) == 8 and loss[-1] < 0.8 * loss[0]
    student = load_hybrid(tmp_path / "out" / "model")
    assert mixer_types(student) == ["attention", mixer, "attention", mixer]
    assert (tmp_path / "out" / "loss.png").stat().st_size > 0
    # Stage one freezes the MLPs.
    teacher = load_teacher(teacher_dir)
    torch.testing.assert_close(student.model.layers[1].mlp.up_proj.weight, teacher.model.layers[1].mlp.up_proj.weight,
                               atol=0, rtol=0)


def test_stepwise_50_then_25_percent(tmp_path, teacher_dir, labels):
    common = dict(teacher=str(teacher_dir), data=str(labels), mixer="mamba2", steps=6, **FAST)
    assert run("distill", write_config(tmp_path / "a.json", out=str(tmp_path / "50"), attention={"every": 2}, **common)) == 0
    half = load_hybrid(tmp_path / "50" / "model")
    cfg = write_config(tmp_path / "b.json", out=str(tmp_path / "25"), init=str(tmp_path / "50" / "model"),
                       attention={"every": 4}, **common)
    assert run("distill", cfg) == 0
    quarter = load_hybrid(tmp_path / "25" / "model")
    assert mixer_types(half) == ["attention", "mamba2", "attention", "mamba2"]
    assert mixer_types(quarter) == ["attention", "mamba2", "mamba2", "mamba2"]
    loss = losses(tmp_path / "25")
    assert loss[-1] < 0.8 * loss[0]
    # The 25% run starts from the 50% result: its first loss is far below a fresh 25% conversion's.
    fresh = write_config(tmp_path / "c.json", out=str(tmp_path / "fresh"), attention={"every": 4}, **common)
    assert run("distill", fresh) == 0
    assert loss[0] < losses(tmp_path / "fresh")[0]


def test_sft_and_distilled_dpo_lower_their_losses(tmp_path, teacher_dir, labels):
    assert run("distill", write_config(tmp_path / "d.json", teacher=str(teacher_dir), data=str(labels),
                                       out=str(tmp_path / "d"), steps=2, **FAST)) == 0
    student = str(tmp_path / "d" / "model")
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text("".join(json.dumps({"prompt": s[:20], "response": s[20:]}) + "\n" for s in SENTENCES))
    assert run("sft", write_config(tmp_path / "s.json", model=student, data=str(sft_data), out=str(tmp_path / "s"),
                                   steps=6, **FAST)) == 0
    loss = losses(tmp_path / "s")
    assert loss[-1] < 0.7 * loss[0]
    # Preference pairs: the sentence preferred to the same words reversed.
    pairs = tmp_path / "dpo.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": s[:20], "chosen": s[20:], "rejected": " ".join(s[20:].split()[::-1])})
                             + "\n" for s in SENTENCES))
    assert run("dpo", write_config(tmp_path / "p.json", model=student, teacher=str(teacher_dir), data=str(pairs),
                                   out=str(tmp_path / "p"), steps=6, beta=0.5, **FAST)) == 0
    loss, accuracy = losses(tmp_path / "p"), losses(tmp_path / "p", "accuracy")
    assert loss[-1] < 0.7 * loss[0] and accuracy[-1] == 1.0


def test_dsla_chained_conversion(tmp_path, teacher_dir, corpus, prompts):
    blocks = len(text_blocks(load_tokenizer(teacher_dir), [str(corpus)], 32))  # all of them in each step
    cfg = write_config(tmp_path / "c.json", teacher=str(teacher_dir), data=[str(corpus)], out=str(tmp_path / "o"),
                       attention={"entropy": True, "keep": 0.5}, calibration=str(prompts), steps=5, seq_len=32,
                       hybrid={"gate_rank": 4}, lam=0.1, **dict(FAST, batch_size=blocks))
    assert run("dsla", cfg) == 0
    entropy = json.loads((tmp_path / "o" / "entropy.json").read_text())["entropy"]
    order = sorted(range(4), key=lambda i: entropy[i])
    phases = sorted(p.name for p in (tmp_path / "o").glob("phase*"))
    assert phases == [f"phase00-layer{order[0]}", f"phase01-layer{order[1]}"]  # least sensitive first
    student = load_hybrid(tmp_path / "o" / "model")
    assert [i for i, k in enumerate(mixer_types(student)) if k == "dsla"] == sorted(order[:2])
    teacher = load_teacher(teacher_dir)
    for phase in phases:
        kl = losses(tmp_path / "o" / phase, "kl")
        assert kl[-1] < kl[0]
    for i in order[2:]:  # layers kept as attention were frozen throughout
        torch.testing.assert_close(student.model.layers[i].self_attn.q_proj.weight,
                                   teacher.model.layers[i].self_attn.q_proj.weight, atol=0, rtol=0)


def test_perplexity_report(tmp_path, teacher_dir, corpus, labels):
    assert run("distill", write_config(tmp_path / "d.json", teacher=str(teacher_dir), data=str(labels),
                                       out=str(tmp_path / "d"), steps=2, **FAST)) == 0
    cfg = write_config(tmp_path / "p.json", models=[str(teacher_dir), str(tmp_path / "d" / "model")], text=[str(corpus)],
                       out=str(tmp_path / "ppl.json"), seq_len=32)
    assert run("perplexity", cfg) == 0
    report = json.loads((tmp_path / "ppl.json").read_text())
    assert report[0]["ratio"] == 1.0 and report[1]["attention_layers"] == 2
    assert report[1]["ratio"] == pytest.approx(report[1]["ppl"] / report[0]["ppl"])


def test_bad_configs_fail_with_one_line(tmp_path, teacher_dir, labels, capsys):
    assert run("distill", write_config(tmp_path / "a.json", teacher=str(teacher_dir), data=str(labels), out="x",
                                       steps=1, colour="red")) == 1
    assert capsys.readouterr().err.strip().startswith("error: unknown config key 'colour'")
    assert run("distill", write_config(tmp_path / "b.json", teacher=str(tmp_path / "nope"), data=str(labels), out="x",
                                       steps=1)) == 1
    assert "teacher directory not found" in capsys.readouterr().err
    out = tmp_path / "o"
    cfg = write_config(tmp_path / "c.json", teacher=str(teacher_dir), data=str(labels), out=str(out), steps=1, **FAST)
    assert run("distill", cfg) == 0
    assert run("distill", cfg) == 1  # a second run into the same out needs --resume
    assert "pass --resume" in capsys.readouterr().err


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def test_killed_run_resumes_to_the_same_weights(tmp_path, teacher_dir, labels):
    common = dict(teacher=str(teacher_dir), data=str(labels), steps=120, save_every=5, batch_size=3, lr=3e-3, seed=7)
    full = write_config(tmp_path / "full.json", out=str(tmp_path / "full"), **common)
    assert run("distill", full) == 0
    cfg = write_config(tmp_path / "k.json", out=str(tmp_path / "killed"), **common)
    cmd = [sys.executable, "-m", "hybrid_train", "distill", "--config", str(cfg)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "killed" / "checkpoint.pt"
    while not checkpoint.exists() and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    stopped_at = torch.load(checkpoint, weights_only=False)["step"]
    assert 5 <= stopped_at < 120 and not (tmp_path / "killed" / "model").exists()
    done = subprocess.run(cmd + ["--resume"], env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    a, b = load_file(tmp_path / "full" / "model" / "model.safetensors"), load_file(tmp_path / "killed" / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0, rtol=0)
    assert losses(tmp_path / "killed") == losses(tmp_path / "full")  # the log has each step once


def test_torchrun_two_processes(tmp_path, teacher_dir, labels):
    cfg = write_config(tmp_path / "c.json", teacher=str(teacher_dir), data=str(labels), out=str(tmp_path / "o"),
                       steps=6, batch_size=6, micro_batch=1, lr=3e-3, save_every=3)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "hybrid_train", "distill", "--config", str(cfg)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = losses(tmp_path / "o")
    assert len(loss) == 6 and loss[-1] < 0.8 * loss[0]
    assert torch.load(tmp_path / "o" / "checkpoint.pt", weights_only=False)["world"] == 2
    assert mixer_types(load_hybrid(tmp_path / "o" / "model")) == ["attention", "mamba2", "attention", "mamba2"]
