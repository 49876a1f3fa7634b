"""`hybrid generate --speculative`: the same text as plain greedy generation, speculation stats in
the footer, files found beside the model or given by path, one-line errors on bad input."""

import json
import shutil

import mlx.core as mx
import pytest
from tests.helpers.factories import make_hf_model_dir
from mlx.utils import tree_flatten
from tests.helpers.cli import assert_one_line_error, run

from mlx_hybrid.generate import generate
from mlx_hybrid.loader import load
from mlx_hybrid.speculative.medusa import MedusaConfig, MedusaHeads
from mlx_hybrid.speculative.redrafter import Drafter, DrafterConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_hf_model_dir(tmp_path_factory.mktemp("spec_cli") / "m", seed=5)
    model, _ = load(path)
    H, V = model.args.hidden_size, model.args.vocab_size
    for name, module, config in [
        ("medusa", MedusaHeads(MedusaConfig(3, 1, H, V)), dict(model_type="medusa", medusa_num_heads=3, medusa_num_layers=1)),
        ("redrafter", Drafter(DrafterConfig(H, V, 2 * H, 1, True)), dict(model_type="recurrent_drafting_drafter", exit_dim=2 * H, num_draft_layers=1, rnn=True)),
    ]:
        (path / name).mkdir()
        mx.save_safetensors(str(path / name / "model.safetensors"), dict(tree_flatten(module.parameters())))
        (path / name / "config.json").write_text(json.dumps(dict(config, hidden_size=H, vocab_size=V)))
    make_hf_model_dir(path / "draft", seed=6, tokenizer=False, num_hidden_layers=1)
    return path


@pytest.mark.parametrize("method", ["medusa", "redrafter", "draft"])
def test_generate_speculative_matches_plain(monkeypatch, capsys, model_dir, method):
    model, tokenizer = load(model_dir)
    want = generate(model, tokenizer, "The quick brown fox", max_tokens=20)
    code, out, err = run(monkeypatch, capsys, "generate", "-m", model_dir, "-p", "The quick brown fox", "--raw",
                         "--max-tokens", 20, "--speculative", method, "-v")
    assert code == 0, err
    assert out == want + "\n"
    assert "tok/step" in err and "of drafts accepted" in err


def test_generate_speculative_paths_and_errors(monkeypatch, capsys, model_dir, tmp_path):
    code, out, err = run(monkeypatch, capsys, "generate", "-m", model_dir, "-p", "hi", "--raw", "--max-tokens", 5,
                         "--speculative", "medusa", "--heads", model_dir / "medusa")
    assert code == 0, err
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("medusa", "redrafter", "draft"))
    code, _, err = run(monkeypatch, capsys, "generate", "-m", bare, "-p", "hi", "--speculative", "medusa")
    assert_one_line_error(code, err, "no medusa/ directory")
    code, _, err = run(monkeypatch, capsys, "generate", "-m", model_dir, "-p", "hi", "--speculative", "eagle")
    assert_one_line_error(code, err, "unknown speculative method")
    code, _, err = run(monkeypatch, capsys, "generate", "-m", model_dir, "-p", "hi", "--speculative", "draft", "--draft-model", tmp_path / "none")
    assert_one_line_error(code, err, "not found")
    code, _, err = run(monkeypatch, capsys, "generate", "-m", model_dir, "-p", "hi", "--speculative", "draft", "--repetition-penalty", 1.2)
    assert_one_line_error(code, err, "repetition penalty")


def test_chat_session_speculative_turns_match_plain(model_dir):
    """Two chat turns: the draft keeps its own cache across turns; replies equal plain greedy ones."""
    from mlx_hybrid.chat import ChatSession
    from mlx_hybrid.speculative import load_proposer

    model, tokenizer = load(model_dir)
    plain = ChatSession(model, tokenizer)
    spec = ChatSession(model, tokenizer, speculator=load_proposer("draft", model, model_dir, num_draft=3))
    for text in ("Tell me about the fox.", "And the robot?"):
        want = [r.token for r in plain.send(text, max_tokens=15)]
        got = list(spec.send(text, max_tokens=15))
        assert [r.token for r in got] == want
        assert got[-1].steps >= 1
        assert spec.tokens == plain.tokens


def test_chat_cli_speculative(monkeypatch, capsys, model_dir):
    code, out, err = run(monkeypatch, capsys, "chat", "-m", model_dir, "--speculative", "medusa", "--max-tokens", 8,
                         stdin="hello\n/exit\n")
    assert code == 0, err
    assert "tok/step" in out
