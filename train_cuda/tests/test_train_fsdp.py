"""`parallel: fsdp` (FSDP2) on the CPU, with gloo: sharded over processes, and over two nodes
through a c10d rendezvous, distillation ends with the one-process run's weights; killed with kill -9,
it resumes on another number of processes to those weights; bad settings fail in one line.

One process is the reference (no sharding, no collectives). With micro_batch = 1 every run cuts
each step into the same micro-batches, so the runs differ only in the order of float32 sums (the
gradient reduced across processes, the shards' norms), which Adam's division by the root of small
second moments amplifies: over 12 steps at lr 1e-3 DDP on two processes ends within 3e-5 of one
process, and so does FSDP (measured); the tolerance is 1e-4, while the training moves weights by
up to 1.2e-2.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import write_config
from safetensors.torch import load_file

from hybrid_train.__main__ import main
from hybrid_train.errors import TrainError
from hybrid_train.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(steps=12, save_every=3, batch_size=6, micro_batch=1, lr=1e-3, seed=7, parallel="fsdp",
              teacher_sharding="shard", grad_checkpointing=True)
TOL = dict(atol=1e-4, rtol=0)


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _torchrun(cfg: Path, *launch: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "hybrid_train", "distill", "--config", str(cfg)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _kill_all(marker: str):
    """kill -9 every process whose command line holds marker: torchrun's agent and its workers
    (which it starts in sessions of their own)."""
    for pid in [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]:
        try:
            if marker in (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass  # gone already


def _weights(out: Path) -> dict:
    return load_file(out / "model" / "model.safetensors")


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], **TOL)


def test_fsdp_on_processes_and_nodes_equals_one_process_and_resumes_on_another_count(tmp_path, teacher_dir, labels):
    def cfg(name):
        return write_config(tmp_path / f"{name}.json", teacher=str(teacher_dir), data=str(labels), out=str(tmp_path / name), **COMMON)

    assert main(["distill", "--config", str(cfg("one"))]) == 0
    one = _weights(tmp_path / "one")

    # Two nodes of one process each, as a multi-node job starts (torchrun's c10d rendezvous).
    rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_free_port()}", "--rdzv-id=fsdp"]
    nodes = [subprocess.Popen(_torchrun(cfg("nodes"), *rdzv), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for node in nodes:
        assert node.wait(timeout=300) == 0, node.stderr.read()[-3000:]
    _same(one, _weights(tmp_path / "nodes"))
    assert _losses(tmp_path / "nodes") == pytest.approx(_losses(tmp_path / "one"), abs=1e-4)

    # Two processes, killed after a checkpoint, resumed on three.
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_torchrun(cfg("killed"), "--standalone", "--nproc_per_node=2"), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (killed / "checkpoint" / "meta.pt").exists() and proc.poll() is None:
        time.sleep(0.01)
    _kill_all(str(tmp_path / "killed.json"))
    proc.wait()
    stopped_at = torch.load(killed / "checkpoint" / "meta.pt", weights_only=False)["step"]
    assert 3 <= stopped_at < 12 and not (killed / "model").exists()
    done = subprocess.run(_torchrun(cfg("killed"), "--standalone", "--nproc_per_node=3") + ["--resume"], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.load(killed / "checkpoint" / "meta.pt", weights_only=False)["world"] == 3
    _same(one, _weights(killed))
    assert _losses(killed) == pytest.approx(_losses(tmp_path / "one"), abs=1e-4)  # each step logged once


def _checkpointed(tmp_path, **cfg) -> TrainConfig:
    """A one-process run of 2 steps on a linear model, checkpointed, and its config."""
    cfg = TrainConfig(out=str(tmp_path / "o"), steps=2, batch_size=2, save_every=1, **cfg)
    env = SimpleNamespace(world=1, rank=0, main=True, device=torch.device("cpu"), barrier=lambda: None,
                          reduce=lambda v, op=None: v, gather=lambda o: [o])
    examples = [([1, 2], [2, 3])] * 4
    train(cfg, torch.nn.Embedding(8, 4), examples, lambda m, b: (m(b["input_ids"]).square().mean(), {}), False, env)
    return cfg


def _resume_on_two(cfg: TrainConfig):
    """train() as process 0 of 2 resuming cfg's run; the checks it fails come before any collective."""
    cfg.steps = 4
    env = SimpleNamespace(world=2, rank=0, main=True, device=torch.device("cpu"), barrier=lambda: None)
    train(cfg, torch.nn.Embedding(8, 4), [([1, 2], [2, 3])] * 4, None, True, env)


def test_resuming_on_another_count_needs_micro_batch(tmp_path):
    cfg = _checkpointed(tmp_path, parallel="fsdp")
    with pytest.raises(TrainError, match="written by 1 processes, not 2: set micro_batch"):
        _resume_on_two(cfg)


def test_a_checkpoint_resumes_only_with_its_parallel(tmp_path):
    cfg = _checkpointed(tmp_path, parallel="ddp")
    cfg.parallel = "fsdp"
    with pytest.raises(TrainError, match="written with parallel: ddp; resume with that"):
        _resume_on_two(cfg)


@pytest.mark.parametrize("key,value,message", [("parallel", "zero3", "parallel must be ddp or fsdp"),
                                               ("teacher_sharding", "half", "teacher_sharding must be replicate or shard")])
def test_bad_parallel_settings_fail_in_one_line(tmp_path, teacher_dir, labels, capsys, key, value, message):
    cfg = write_config(tmp_path / "c.json", teacher=str(teacher_dir), data=str(labels), out=str(tmp_path / "o"), steps=1,
                       **{key: value})
    assert main(["distill", "--config", str(cfg)]) == 1
    assert capsys.readouterr().err.strip() == f"error: {message}, got '{value}'"


def test_scaling_script_counts_every_process_tokens(tmp_path):
    """scripts/scaling.py on the CPU: each run's log counts the tokens of all its processes (2 a
    process of 32 tokens each), and the report, table and plot hold every run."""
    out = tmp_path / "s"
    cmd = [sys.executable, str(ROOT / "scripts" / "scaling.py"), "--shape", "tiny", "--runs", "ddp:1,fsdp:2:shard", "--per-gpu", "2",
           "--micro", "1", "--seq-len", "32", "--steps", "3", "--warmup", "1", "--out", str(out)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for run, processes in (("ddp-1", 1), ("fsdp-2-shard", 2)):
        rows = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["tokens"] for r in rows] == [2 * 32 * processes] * 3
    report = json.loads((out / "train-scaling-tiny.json").read_text())
    assert [(r["parallel"], r["gpus"], r["teacher"]) for r in report["runs"]] == [("ddp", 1, "replicated"), ("fsdp", 2, "sharded")]
    assert all(r["tokens_per_s"] > 0 for r in report["runs"]) and (out / "train-scaling-tiny.png").is_file()
    assert "| fsdp | 2 | sharded |" in done.stdout  # the table as benchmarks/README.md shows it
