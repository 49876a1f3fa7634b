"""Hugging Face Hub model ids (`--model org/name`), resolved through a hub cache populated here:
no test touches the network (HF_HUB_OFFLINE is set in each). Last, `hybrid serve` itself as a
subprocess: a Hub id, the tuned profile's speculation, the openai client, Ctrl-C."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from tests.helpers.factories import make_hf_model_dir, make_hybrid_dir
from tests.helpers.cli import assert_one_line_error, run
from tests.test_server import add_redrafter, chat_reference

from mlx_hybrid.errors import HybridError
from mlx_hybrid.generate import generate
from mlx_hybrid.hub import resolve
from mlx_hybrid.loader import load

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(cache: Path, repo_id: str, src: Path) -> Path:
    """Lay out src as huggingface-hub caches a downloaded repo: refs/main -> snapshots/<commit>/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(src, snapshot)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(hub cache dir, {repo id: snapshot dir}): a Llama model and a hybrid one with a drafter."""
    root = tmp_path_factory.mktemp("hub")
    llama = make_hf_model_dir(root / "src" / "llama", seed=4)
    hybrid, _ = make_hybrid_dir(root / "src" / "hybrid", ["attention", "mamba2"], seed=5)
    add_redrafter(hybrid)
    cache = root / "cache"
    return cache, {"org/tiny": add_to_hub_cache(cache, "org/tiny", llama), "org/hybrid": add_to_hub_cache(cache, "org/hybrid", hybrid)}


@pytest.fixture
def offline(monkeypatch, hub):
    """huggingface-hub reads these at import (from HF_HUB_CACHE, HF_HUB_OFFLINE): set them here."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub[1]


def test_resolve(offline, tmp_path):
    assert resolve("org/tiny") == offline["org/tiny"]
    assert resolve(tmp_path) == tmp_path  # a local path is used as is
    assert resolve("no/such/dir") == Path("no/such/dir")  # not an id: the loader says it is missing
    with pytest.raises(HybridError, match="'org/missing'.*HF_HUB_OFFLINE"):
        resolve("org/missing")


def test_cli_takes_hub_ids(monkeypatch, capsys, offline, tmp_path):
    model, tokenizer = load(offline["org/tiny"])
    code, out, err = run(monkeypatch, capsys, "generate", "-m", "org/tiny", "-p", "Once upon", "--raw", "--max-tokens", 8)
    assert code == 0, err
    assert out == generate(model, tokenizer, "Once upon", max_tokens=8) + "\n"
    code, out, err = run(monkeypatch, capsys, "convert", "org/tiny", tmp_path / "converted")
    assert code == 0, err
    assert (tmp_path / "converted" / "config.json").is_file()
    code, _, err = run(monkeypatch, capsys, "chat", "-m", "org/missing")
    assert_one_line_error(code, err, "'org/missing'", "Hugging Face cache")
    code, _, err = run(monkeypatch, capsys, "tune", "-m", "org/tiny")
    assert_one_line_error(code, err, "nothing to tune", str(offline["org/tiny"]))  # resolved, then found no heads


def test_serve_command(monkeypatch, hub, tmp_path):
    """`hybrid serve -m org/hybrid` in a subprocess: offline Hub cache, the tuned profile's
    speculation, answers equal to plain greedy decoding, a stop on Ctrl-C without a traceback."""
    from mlx_hybrid.profiles import profile_path, save_profile

    cache, snapshots = hub
    monkeypatch.setenv("MLX_HYBRID_CACHE", str(tmp_path))  # where profiles live, here and in the server
    save_profile({"choice": "redrafter", "best": {"redrafter": {"beam_width": 2, "beam_length": 3}}}, profile_path(snapshots["org/hybrid"]))
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")

    command = [sys.executable, "-m", "mlx_hybrid.cli.main", "serve", "-m", "org/hybrid", "--port", "0", "--temp", "0"]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = None, time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = server.stderr.readline()
            assert line or server.poll() is None, "the server exited before serving"
            if line.startswith("Serving "):
                url = line.split(" at ")[1].split()[0]
        assert url and url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
        messages = [{"role": "user", "content": "Once upon a time"}]
        r = client.chat.completions.create(model="org/hybrid", messages=messages, max_tokens=12)
        assert r.choices[0].message.content == chat_reference(load(snapshots["org/hybrid"]), messages, 12)
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=60) as reply:
            assert json.load(reply)["speculated_tokens"] > 0
        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 130  # the CLI's exit status after Ctrl-C
        assert "Traceback" not in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
