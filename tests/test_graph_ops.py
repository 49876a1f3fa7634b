"""Op budgets of a greedy speculative pass as a GPU builds it (benchmarks/graph_ops.py counts the
graph's nodes on any machine). A small model's pass on a GPU costs per op, not per token, so the
pass may add only a few ops to a decode step: these fail when a change adds ops to the
verification forward, the acceptance or the cache moves, which no timing on this CPU would show.
The counting runs in a process of its own (its stand-ins would stay in compiled functions)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.speculative import write_heads
from mlx_hybrid.loader import load_model
from tests.helpers.factories import make_hf_model_dir, make_hybrid_dir

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 4


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_pass_adds_few_ops_to_a_decode_step(tmp_path, kind):
    if kind == "llama":
        path = make_hf_model_dir(tmp_path / "m", num_hidden_layers=LAYERS, tokenizer=False)
        attention = LAYERS
    else:
        path, _ = make_hybrid_dir(tmp_path / "m", ["attention", "mamba", "mamba2", "attention"], seed=1)
        attention = 2
    write_heads(path, load_model(path, "float32"), seed=0, draft_layers=1)
    out = subprocess.run([sys.executable, "-m", "benchmarks.graph_ops", "--model", str(path)], capture_output=True, text=True, check=True, cwd=ROOT)
    counts = json.loads(out.stdout)
    step = counts["plain step"][0]
    for method in ("medusa", "redrafter"):
        parts = counts[method]
        # The tree path (tree attention, tree ssm_step) has no more kernels than the decode step,
        # which also takes its log-probabilities and argmax.
        assert parts["verification forward"][0] <= step, (method, parts, step)
        # Argmax, one kernel, the hidden state's gather, the next position.
        assert parts["acceptance"][0] <= 8, (method, parts)
        # The accepted path's keys and values: one scatter per buffer, its index built once (6
        # kernels); a recurrent layer's state: a gather per array.
        assert parts["cache moves"][0] <= 2 * attention + 6 + 2 * (LAYERS - attention), (method, parts)
