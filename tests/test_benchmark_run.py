"""`python -m benchmarks.run`, the decode benchmark, end to end on a tiny model: it must run on the
library as it is (no test imports its timing loop otherwise), and with both runtimes forced to
float32 mlx-hybrid's greedy tokens must be mlx-lm's, the independent reference it is measured
against."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.factories import make_hf_model_dir

ROOT = Path(__file__).resolve().parents[1]


def test_decode_benchmark_runs_and_both_runtimes_agree(tmp_path):
    model = make_hf_model_dir(tmp_path / "tiny", seed=2)
    out = tmp_path / "decode.json"
    command = [sys.executable, "-m", "benchmarks.run", "--model", str(model), "--prompt-tokens", "8", "--gen-tokens", "4",
               "--trials", "1", "--dtype", "float32", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"fp16", "4bit"}
    for name, variant in result["variants"].items():
        runtimes = variant["runtimes"]
        assert variant["tokens_match"], name
        assert runtimes["mlx_hybrid"]["tokens"] == runtimes["mlx_lm"]["tokens"] and len(runtimes["mlx_lm"]["tokens"]) == 4
        assert runtimes["mlx_hybrid"]["median"]["decode_tps"] > 0
