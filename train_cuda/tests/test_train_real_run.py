"""scripts/real_run.sh end to end on the CPU: tiny random teacher, tiny corpus, --tiny sizes."""

import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_real_run_script(tmp_path, teacher_dir, article_corpus):
    corpus = article_corpus
    out = tmp_path / "out"
    cmd = ["bash", str(ROOT / "scripts" / "real_run.sh"), str(teacher_dir), str(corpus), str(out), "--tiny"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    ppl = report["perplexity"]
    assert [r["attention_layers"] for r in ppl] == [4, 2, 1]
    assert ppl[0]["ratio"] == 1.0 and all(r["ppl"] > 1 for r in ppl)
    assert set(report["seconds"]) == {"pseudo-labels", "distill50", "distill25", "perplexity", "total"}
    # The 25% student was converted from the 50% one.
    assert json.loads((out / "configs" / "distill25.json").read_text())["init"] == str(out / "distill50" / "model")
