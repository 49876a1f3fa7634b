"""The `hybrid` command: real output on good input; one line on stderr and a non-zero exit on bad input."""

import json

import pytest


from mlx_hybrid.chat import ChatSession
from mlx_hybrid.generate import stream_generate
from mlx_hybrid.loader import load
from tests.helpers.cli import assert_one_line_error, run
from tests.helpers.factories import make_hf_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("cli") / "m", seed=5)


def test_generate_matches_api(monkeypatch, capsys, model_dir):
    code, out, _ = run(monkeypatch, capsys, "generate", "--model", model_dir, "-p", "Once upon", "--max-tokens", 15)
    assert code == 0
    model, tok = load(model_dir)
    prompt = ChatSession(model, tok).render([{"role": "user", "content": "Once upon"}])
    expected = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=15))
    assert out == expected + "\n"


def test_generate_reads_stdin_raw(monkeypatch, capsys, model_dir):
    code, out, err = run(
        monkeypatch, capsys, "generate", "--model", model_dir, "--raw", "--max-tokens", 10, "-v", stdin="The quick"
    )
    assert code == 0
    model, tok = load(model_dir)
    assert out == "".join(r.text for r in stream_generate(model, tok, "The quick", max_tokens=10)) + "\n"
    assert "tok/s" in err and "peak memory" in err


def test_chat_session_commands(monkeypatch, capsys, model_dir):
    code, out, _ = run(
        monkeypatch, capsys, "chat", "--model", model_dir, "--max-tokens", 6, stdin="hello\n/reset\nthe fox\n/exit\n"
    )
    assert code == 0
    assert out.count("reply 6 tok,") == 2
    assert "History cleared." in out
    assert "context " in out


def test_help_reads_well(monkeypatch, capsys):
    code, out, _ = run(monkeypatch, capsys, "--help")
    assert code == 0 and "chat" in out and "generate" in out


def _commands():
    import typer

    from mlx_hybrid.cli.main import app

    return [[]] + [[name] for name in typer.main.get_command(app).commands]


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "hybrid")
def test_help_shows_no_value_placeholder_for_flags(monkeypatch, capsys, command):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(monkeypatch, capsys, *command, "--help")
    assert code == 0 and "--help" in out
    assert "<bool>" not in out
    if command == ["generate"]:
        assert "<int>" in out  # options that take a value keep their type


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--temp", "-1"], ["temperature"]),
        (["--top-p", "1.5"], ["top-p"]),
        (["--top-k", "-2"], ["top-k"]),
        (["--max-tokens", "0"], ["max tokens"]),
        (["--max-tokens", "abc"], ["--max-tokens"]),
        (["--repetition-penalty", "0"], ["repetition penalty"]),
        (["--bogus"], ["--bogus"]),
    ],
)
def test_invalid_flags(monkeypatch, capsys, model_dir, args, fragments):
    code, _, err = run(monkeypatch, capsys, "generate", "--model", model_dir, "-p", "hi", *args)
    assert_one_line_error(code, err, *fragments)


def test_prompt_longer_than_context(monkeypatch, capsys, model_dir):
    code, _, err = run(monkeypatch, capsys, "generate", "--model", model_dir, "--raw", "-p", "fox " * 600)
    assert_one_line_error(code, err, "limit is 512")


def test_bad_model_dirs(monkeypatch, capsys, model_dir, tmp_path):
    code, _, err = run(monkeypatch, capsys, "generate", "--model", tmp_path / "nope", "-p", "hi")
    assert_one_line_error(code, err, "not found", "nope")

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, _, err = run(monkeypatch, capsys, "generate", "--model", unknown, "-p", "hi")
    assert_one_line_error(code, err, "gpt2", "llama")

    truncated = make_hf_model_dir(tmp_path / "truncated", seed=1)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run(monkeypatch, capsys, "generate", "--model", truncated, "-p", "hi")
    assert_one_line_error(code, err, "model.safetensors")

    no_weights = make_hf_model_dir(tmp_path / "noweights", seed=1)
    (no_weights / "model.safetensors").unlink()
    code, _, err = run(monkeypatch, capsys, "generate", "--model", no_weights, "-p", "hi")
    assert_one_line_error(code, err, "no *.safetensors")

    wrong_shape = make_hf_model_dir(tmp_path / "wrongshape", seed=1)
    config = json.loads((wrong_shape / "config.json").read_text())
    (wrong_shape / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    code, _, err = run(monkeypatch, capsys, "generate", "--model", wrong_shape, "-p", "hi")
    assert_one_line_error(code, err, "do not match config.json")

    no_tok = make_hf_model_dir(tmp_path / "notok", seed=1, tokenizer=False)
    code, _, err = run(monkeypatch, capsys, "generate", "--model", no_tok, "-p", "hi")
    assert_one_line_error(code, err, "tokenizer")


def test_generate_without_model_uses_the_embedded_default(monkeypatch, capsys):
    code, out, err = run(monkeypatch, capsys, "generate", "-p", "Hello!", "--max-tokens", "4")
    assert code in (0, None) and out.strip(), err


def test_missing_embedded_default_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("mlx_hybrid.default_model.PATH", tmp_path / "gone")
    code, out, err = run(monkeypatch, capsys, "generate", "-p", "Hello!", "--max-tokens", "4")
    assert_one_line_error(code, err, "embedded default model is missing")


def test_convert_gguf_takes_only_dtype(monkeypatch, capsys, tmp_path):
    code, out, err = run(monkeypatch, capsys, "convert", tmp_path / "m.gguf", tmp_path / "dst", "-q")
    assert_one_line_error(code, err, "takes only --dtype")
    assert not (tmp_path / "dst").exists()


def test_version_is_pyprojects(monkeypatch, capsys):
    import re
    from pathlib import Path

    import mlx_hybrid

    # pyproject.toml's [project] version (tomllib is Python 3.11+; the project supports 3.10).
    declared = re.search(r'^version = "([^"]+)"$', (Path(__file__).parents[1] / "pyproject.toml").read_text(), re.M).group(1)
    assert mlx_hybrid.__version__ == declared
    code, out, _ = run(monkeypatch, capsys, "--version")
    assert code == 0 and out == f"mlx-hybrid {declared}\n"
