"""Sampling defaults from a model's generation_config.json: the SamplingParams that chat, generate,
serve and the Python API build from it, flags and request fields over it, and one-line errors
for bad files."""

import importlib
import json
import shutil

import openai
import pytest
from tests.helpers.cli import assert_one_line_error, run
from tests.helpers.factories import make_hf_model_dir

from mlx_hybrid.generate import generate
from mlx_hybrid.loader import load
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.server import Loaded, Server

# What the file below sets, as SamplingParams names it (written independently of the mapping).
FILE = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3}
EXPECTED = SamplingParams(temp=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("gencfg") / "plain", seed=5)


def with_config(plain_dir, path, config: dict | str):
    shutil.copytree(plain_dir, path)
    text = config if isinstance(config, str) else json.dumps(config)
    (path / "generation_config.json").write_text(text)
    return path


@pytest.fixture(scope="module")
def model_dir(plain_dir, tmp_path_factory):
    return with_config(plain_dir, tmp_path_factory.mktemp("gencfg") / "configured", FILE)


@pytest.fixture
def captured(monkeypatch):
    """The SamplingParams `hybrid generate` and `hybrid chat` hand to stream_generate."""
    seen = []

    def fake(model, tokenizer, prompt, *, sampling, **kwargs):
        seen.append(sampling)
        return iter(())

    monkeypatch.setattr(importlib.import_module("mlx_hybrid.generate"), "stream_generate", fake)
    return seen


def test_generate_takes_the_files_defaults(monkeypatch, capsys, model_dir, captured):
    code, _, err = run(monkeypatch, capsys, "generate", "-m", model_dir, "-p", "hi", "-v")
    assert code == 0, err
    assert captured == [EXPECTED]
    assert "temperature 0.7, top-p 0.9, top-k 20, min-p 0.05, repetition penalty 1.3 (generation_config.json)" in err


def test_flags_win_over_the_file(monkeypatch, capsys, model_dir, captured):
    code, _, err = run(monkeypatch, capsys, "generate", "-m", model_dir, "-p", "hi", "--top-k", 5, "--temp", 0.2, "-v")
    assert code == 0, err
    assert captured == [SamplingParams(temp=0.2, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.3)]
    assert "temperature 0.2, top-k 5 (flags)" in err
    code, _, err = run(monkeypatch, capsys, "generate", "-m", model_dir, "-p", "hi", "--temp", 0)  # still greedy
    assert code == 0, err
    assert captured[-1].temp == 0.0


def test_chat_header_shows_the_settings_and_where_they_came_from(monkeypatch, capsys, model_dir, plain_dir):
    code, out, err = run(monkeypatch, capsys, "chat", "-m", model_dir, "--min-p", 0.1, stdin="/exit\n")
    assert code == 0, err
    assert "sampling: temperature 0.7, top-p 0.9, top-k 20, repetition penalty 1.3 (generation_config.json); min-p 0.1 (flags)" in out
    code, out, err = run(monkeypatch, capsys, "chat", "-m", plain_dir, stdin="/exit\n")
    assert "sampling: greedy (built-in default)" in out


def test_do_sample_false_is_greedy(plain_dir, tmp_path):
    path = with_config(plain_dir, tmp_path / "m", {"do_sample": False, "temperature": 0.9, "repetition_penalty": 1.0})
    model, _ = load(path)
    assert model.sampling_defaults.params() == SamplingParams()  # a penalty of 1 is none


def test_python_api_uses_the_files_defaults(plain_dir, tmp_path):
    path = with_config(plain_dir, tmp_path / "m", {"do_sample": False, "repetition_penalty": 5.0})
    model, tokenizer = load(path)
    got = generate(model, tokenizer, "The quick brown fox", max_tokens=20)
    penalized = generate(model, tokenizer, "The quick brown fox", max_tokens=20, sampling=SamplingParams(repetition_penalty=5.0))
    greedy = generate(model, tokenizer, "The quick brown fox", max_tokens=20, sampling=SamplingParams())
    assert got == penalized and penalized != greedy


def test_serve_requests_that_omit_fields_take_the_files_defaults(model_dir):
    server = Server(lambda: Loaded(*load(model_dir)), "tiny", port=0)
    jobs = []
    submit = server.engine.submit
    server.engine.submit = lambda job: (jobs.append(job), submit(job))
    server.start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=60, max_retries=0)
        ask = lambda **kw: client.chat.completions.create(  # noqa: E731
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, seed=1, **kw)
        ask()
        ask(temperature=0.0, extra_body={"top_k": 4})
    finally:
        server.stop()
    assert jobs[0].sampling == SamplingParams(temp=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.3, seed=1)
    assert jobs[1].sampling == SamplingParams(temp=0.0, top_p=0.9, top_k=4, min_p=0.05, repetition_penalty=1.3, seed=1)


@pytest.mark.parametrize(
    "config, fragments",
    [
        ({"temperature": -0.5}, ["'temperature' must be a number >= 0"]),
        ({"temperature": "hot"}, ["'temperature'"]),
        ({"top_p": 0}, ["'top_p' must be a number in (0, 1]"]),
        ({"top_p": 1.5}, ["'top_p'"]),
        ({"top_k": 2.5}, ["'top_k' must be an integer >= 0"]),
        ({"top_k": -1}, ["'top_k'"]),
        ({"top_k": 100000}, ["'top_k' must be below the vocabulary size"]),
        ({"min_p": 2}, ["'min_p' must be a number in [0, 1]"]),
        ({"repetition_penalty": 0}, ["'repetition_penalty' must be a number > 0"]),
        ({"do_sample": "yes"}, ["'do_sample' must be true or false"]),
        ("{not json", ["is not valid UTF-8 JSON"]),
        ("[1, 2]", ["must hold a JSON object"]),
    ],
)
def test_bad_files_are_one_line_errors(monkeypatch, capsys, plain_dir, tmp_path, config, fragments):
    path = with_config(plain_dir, tmp_path / "m", config)
    code, _, err = run(monkeypatch, capsys, "generate", "-m", path, "-p", "hi")
    assert_one_line_error(code, err, str(path / "generation_config.json"), *fragments)
