"""benchmarks/README.md's tables are generated from benchmarks/results/ (benchmarks/index.py): they
must be what the result files give, so a result added or replaced without regenerating them, or a
table edited by hand, fails here."""

import subprocess
import sys
from pathlib import Path

from benchmarks.index import load_results, show_command

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tables_are_the_result_files():
    out = subprocess.run([sys.executable, "-m", "benchmarks.index", "--check"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_every_result_has_a_benchmark_and_a_date():
    results = load_results()
    assert results
    for r in results:
        assert len(r.date) == 10 and r.date[:2] == "20", (r.path.name, r.date)


def test_commands_show_outside_paths_by_their_last_component():
    cmd = "python -m benchmarks.run --model /scratch/x/SmolLM2 --label 'NVIDIA H100, MLX CUDA backend' --note 'a b'"
    assert show_command(cmd, drop="--note") == "python -m benchmarks.run --model SmolLM2 --label 'NVIDIA H100, MLX CUDA backend'"
    inside = str(ROOT / "benchmarks" / "chat_prompts.txt")
    assert show_command(f"python x.py {inside}") == "python x.py benchmarks/chat_prompts.txt"


def test_a_benchmark_prints_its_table_from_any_folder(tmp_path):
    """What a benchmark prints after writing its result reads that file alone: another JSON beside
    it in an --out folder (not a result of ours) is no concern of it."""
    from benchmarks.index import render_file

    name = "serve-steps-default-v1-cpu-linux-x86-64-2-cores.json"
    (tmp_path / name).write_text((ROOT / "benchmarks" / "results" / name).read_text())
    (tmp_path / "notes.json").write_text("{}")
    assert render_file(tmp_path / name).startswith("#### default-v1 (the previous embedded default), CPU (Linux x86_64, 2 cores)")
