"""scripts/real_dsla.py --tiny end to end on the CPU, then benchmarks/dsla_conversion.py `run` on its export.

References for the runtime's perplexities: with no layer converted it must be the base's, and with
every layer of the order converted the `dsla` stage's final student's, both in PyTorch on the same
token blocks (float32 both sides; logits agree within ~4e-6, test_train_adaptive.py; rtol 1e-4).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_train.model import load_hybrid
from hybrid_train.teacher import load_teacher

mlx_hybrid = pytest.importorskip("mlx_hybrid")
ROOT = Path(__file__).resolve().parents[1]
from benchmarks.dsla_conversion import blocks  # noqa: E402  (after the skip: it imports mlx_hybrid)

SEQ_LEN = 32


@torch.no_grad()
def torch_perplexity(model, data: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for ids in data:
        logits = model(torch.tensor([ids[:-1]]), use_cache=False).logits[0].double()
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return math.exp(nll / count)


def test_real_dsla_script(tmp_path, teacher_dir, article_corpus):
    corpus = article_corpus
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / "real_dsla.py"), "--base", str(teacher_dir), "--corpus", str(corpus),
           "--out", str(out), "--tiny"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    entropy, order = report["entropy"], report["order"]
    assert len(order) == 2 and sorted(entropy[i] for i in order) == sorted(entropy)[:2]  # the low-entropy half
    assert [p["layer"] for p in report["phases"]] == order
    assert all(p["kl_last"] < p["kl_first"] for p in report["phases"])
    assert set(report["seconds"]) == {"dsla", "export", "total"}

    adaptive = out / "adaptive"
    model, tokenizer = mlx_hybrid.load(adaptive, dtype="float32")
    assert model.args.dsla_order == order and model.args.dsla_max_layers == 2
    results = tmp_path / "results"
    bench = [sys.executable, "-m", "benchmarks.dsla_conversion", "run", "--model", str(adaptive),
             "--text", str(corpus / "heldout.txt"), "--seq-len", str(SEQ_LEN), "--label", "tiny", "--results", str(results)]
    done = subprocess.run(bench, capture_output=True, text=True, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = [json.loads(p.read_text()) for p in results.glob("*.json")]
    assert result["build"].startswith("python train_cuda/scripts/real_dsla.py --base")
    rows = result["rows"]
    assert [r["dsla_layers"] for r in rows] == [0, 1, 2] and rows[-1]["layers"] == order

    data = blocks(tokenizer, corpus / "heldout.txt", SEQ_LEN, None)
    assert len(data) == result["blocks"]
    base = torch_perplexity(load_teacher(teacher_dir), data)
    student = torch_perplexity(load_hybrid(out / "dsla" / "model"), data)
    assert rows[0]["ppl"] == pytest.approx(base, rel=1e-4)
    assert rows[-1]["ppl"] == pytest.approx(student, rel=1e-4)
    assert abs(rows[-1]["ppl"] - rows[0]["ppl"]) > 1e-3 * rows[0]["ppl"]  # the DSLA layers run, and change the output
