"""Bad input as a hostile or careless user would give it: model folders that ask to run code,
numbers past every bound, bad token ids, the API from several threads, malformed GGUF files,
interrupts in the middle of a chat, `convert --force` and a table of inputs that must each end in
one line on stderr and a non-zero exit (docs/security.md lists what is checked)."""

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from tests.helpers.factories import make_hf_model_dir
from gguf import GGUFWriter
from tests.helpers.cli import assert_one_line_error, run
from tests.test_gguf import gguf_name, permute_rows
from transformers import AutoTokenizer, LlamaForCausalLM

from mlx.utils import tree_flatten

import mlx_hybrid.adaptive as adaptive
from mlx_hybrid import profiles, template
from mlx_hybrid.chat import ChatSession
from mlx_hybrid.convert import publish
from mlx_hybrid.convert.gguf import convert_gguf
from mlx_hybrid.convert.hf import convert
from mlx_hybrid.errors import HybridError
from mlx_hybrid.generate import generate, stream_generate
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.limits import check_beam, clip_max_tokens, tree_limit
from mlx_hybrid.loader import load, load_tokenizer
from mlx_hybrid.speculative import load_proposer

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("harden") / "m", seed=5)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load(model_dir)


def variant(model_dir: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(model_dir, dst)
    if edit:
        edit(dst)
    return dst


def edit_json(file: Path, **changes):
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


# ---- remote code -------------------------------------------------------------------------------


def _with_code(path: Path, marker: Path, file="tokenizer_config.json"):
    """A folder whose config asks transformers for its own tokenizer class, in evil.py, which
    would leave marker behind if it ever ran."""
    edit_json(path / file, tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]})
    (path / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )
    return path


def test_model_folders_never_run_code(monkeypatch, capsys, model_dir, tmp_path):
    marker = tmp_path / "ran"
    folder = _with_code(variant(model_dir, tmp_path / "evil"), marker)
    # transformers would ask "run the custom code? [y/N]" and read the answer from stdin.
    code, _, err = run(monkeypatch, capsys, "chat", "--model", folder, stdin="y\nhello\n")
    assert_one_line_error(code, err, "auto_map", "never runs code")
    with pytest.raises(HybridError, match="auto_map"):
        load(folder)
    code, _, err = run(monkeypatch, capsys, "convert", folder, tmp_path / "out")
    assert_one_line_error(code, err, "auto_map")
    assert not (tmp_path / "out").exists()
    in_config = _with_code(variant(model_dir, tmp_path / "evil2"), marker, "config.json")
    with pytest.raises(HybridError, match="config.json names Python code"):
        load(in_config)
    # Without the folder check, transformers is told not to run code (trust_remote_code=False) and refuses.
    monkeypatch.setattr("mlx_hybrid.loader.refuse_remote_code", lambda path: None)
    with pytest.raises(HybridError, match="custom code"):
        load_tokenizer(folder)
    assert not marker.exists()


# ---- bounds ------------------------------------------------------------------------------------


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_HYBRID_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


BAD_PROFILES = {
    "corrupt": lambda p: p.write_text("{not json"),
    "non-utf8": lambda p: p.write_bytes(b'{"choice": "\xff"}'),
    "not-an-object": lambda p: p.write_text("[1, 2]"),
    "beam-100000": lambda p: p.write_text(json.dumps(
        {"choice": "redrafter", "best": {"redrafter": {"beam_width": 100000, "beam_length": 4}}})),
    "beam-of-strings": lambda p: p.write_text(json.dumps(
        {"choice": "redrafter", "best": {"redrafter": {"beam_width": "4", "beam_length": 4}}})),
    "medusa-tree-100000": lambda p: p.write_text(json.dumps(
        {"choice": "medusa", "best": {"medusa": {"medusa_choices": [[i] for i in range(100000)]}}})),
    "medusa-bad-paths": lambda p: p.write_text(json.dumps({"choice": "medusa", "best": {"medusa": {"medusa_choices": [[0, 1]]}}})),
    "unknown-method": lambda p: p.write_text(json.dumps({"choice": "telepathy"})),
    "method-the-model-lacks": lambda p: p.write_text(json.dumps({"choice": "draft"})),
}


@pytest.mark.parametrize("case", BAD_PROFILES)
def test_bad_profiles_are_named_and_ignored(monkeypatch, capsys, model_dir, tmp_path, cache_dir, case):
    """A profile chat and generate cannot use is named in one warning and ignored: plain decoding,
    never a hang or a traceback."""
    target = variant(model_dir, tmp_path / "m")
    for method in ("redrafter", "medusa"):  # beside the model: the profile may name them
        (target / method).mkdir()
        (target / method / "config.json").write_text(json.dumps({"medusa_num_heads": 3}))
    path = profiles.profile_path(target)
    path.parent.mkdir(parents=True)
    BAD_PROFILES[case](path)
    args = ("generate", "-m", target, "-p", "The quick brown fox", "--raw", "--max-tokens", 6)
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ignoring the tuning profile") and str(path) in lines[0], err
    model, tok = load(target)
    assert out == generate(model, tok, "The quick brown fox", max_tokens=6) + "\n"


def test_numeric_bounds_come_from_the_model_and_device(loaded, model_dir, tmp_path, monkeypatch):

    model, tok = loaded
    context = model.args.max_position_embeddings
    assert tree_limit(model) == context - 1  # a tiny model: the context binds, not memory
    with pytest.raises(HybridError, match="beam width 400 exceeds the vocabulary"):
        check_beam(400, 2, model)
    with pytest.raises(HybridError, match="trees of 601 tokens; .* at most 511"):
        check_beam(200, 4, model)
    assert clip_max_tokens(10**12, model, 100) == context - 100
    # Generation takes max_tokens of 10^12 and stops at the context.
    replies = list(stream_generate(model, tok, [5] * 500, max_tokens=10**12))
    assert len(replies) <= context - 500
    draft = variant(model_dir, tmp_path / "draft")
    for k, message in ((0, "at least 1 token"), (100000, "at most 511")):
        with pytest.raises(HybridError, match=message):
            load_proposer("draft", model, path=draft, num_draft=k)
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    monkeypatch.setattr(adaptive, "default_budget", lambda: (weights + model.args.vocab_size * 4 * 10, "test"))
    assert tree_limit(model) == 10  # on a device with less memory: ten nodes' float32 logits beside the weights


# ---- token ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ids", [[2147483647], [10**6], [-1], [320], [1.5], ["a"], [[1, 2]], [True], [2**70]])
def test_token_ids_are_checked_at_the_api(loaded, ids):
    model, tok = loaded
    with pytest.raises(HybridError, match="vocabulary|token ids"):
        list(stream_generate(model, tok, ids, max_tokens=2))
    assert generate(model, tok, [5, 6, 7], max_tokens=3)  # in range: runs


def test_vocabulary_sizes_are_checked_on_load(model_dir, tmp_path):
    def shrink(d):  # a consistent model of 300 tokens under the 320-token tokenizer
        weights = mx.load(str(d / "model.safetensors"))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = weights[name][:300]
        mx.save_safetensors(str(d / "model.safetensors"), weights)
        edit_json(d / "config.json", vocab_size=300)

    small = variant(model_dir, tmp_path / "small", shrink)
    with pytest.raises(HybridError, match="tokenizer has 320 tokens but the model's vocabulary .* is 300"):
        load(small)
    eos = variant(model_dir, tmp_path / "eos", lambda d: edit_json(d / "config.json", eos_token_id=10**6))
    with pytest.raises(HybridError, match="end-of-sequence id 1000000"):
        load(eos)


# ---- threads -----------------------------------------------------------------------------------


def test_api_from_several_threads(loaded):
    """One loaded model shared by threads: each generates on its own MLX stream, greedy tokens
    equal the main thread's, and a ChatSession goes on from thread to thread."""
    model, tok = loaded
    want = generate(model, tok, "The quick brown fox", max_tokens=8)
    got, errors = {}, []

    def worker(i):
        try:
            got[i] = generate(model, tok, "The quick brown fox", max_tokens=8)
            generate(model, tok, "Hybrid", max_tokens=4, sampling=SamplingParams(temp=1.0, seed=i))
        except Exception as e:  # surfaced below with the thread's number
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == {i: want for i in range(4)}, errors

    session, texts = ChatSession(model, tok), ["Once upon a time", "The lazy dog", "Speculative"]
    for text in texts:
        t = threading.Thread(target=lambda: list(session.send(text, max_tokens=5)))
        t.start()
        t.join()
    fresh = ChatSession(model, tok)
    for text in texts:
        list(fresh.send(text, max_tokens=5))
    assert session.messages == fresh.messages and session.tokens == fresh.tokens


# ---- GGUF --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("gguf_src") / "hf", seed=11)


def write_gguf(hf_dir: Path, path: Path, spoil: str | None = None):
    """A float32 llama.cpp-style GGUF of the model in hf_dir, spoiled one way (`BAD_GGUFS`)."""
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg, tok = model.config, AutoTokenizer.from_pretrained(hf_dir)
    w = GGUFWriter(path, "llama")
    if spoil != "no-block-count":
        w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(0 if spoil == "zero-heads" else cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    if spoil != "no-token-types":
        w.add_token_types([1] * len(tokens))
    if spoil != "no-merges":
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    w.add_eos_token_id(10**6 if spoil == "eos-out-of-range" else tok.eos_token_id)
    for name, t in model.state_dict().items():
        a = t.numpy()
        if spoil == "missing-tensor" and name == "model.layers.1.mlp.up_proj.weight":
            continue
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(name.split(".")[-2])
        if heads:
            a = permute_rows(a, heads)
        if spoil == "nan-tensor" and name == "model.norm.weight":
            a = a.copy()
            a[3] = np.nan
        if spoil == "wrong-shape" and name == "model.layers.0.mlp.down_proj.weight":
            a = a[:, :64]
        w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    if spoil == "unknown-tensor":
        w.add_tensor("blk.0.ssm_a.weight", np.zeros((4, 4), np.float32))
    if spoil == "extra-layer":
        w.add_tensor("blk.9.attn_q.weight", np.zeros((64, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if spoil == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


BAD_GGUFS = {
    "missing-tensor": "lacks tensor 'model.layers.1.mlp.up_proj.weight'",
    "no-block-count": "lacks the metadata 'llama.block_count'",
    "zero-heads": "head_count' must be positive",
    "no-token-types": "tokenizer.ggml.token_type",
    "no-merges": "tokenizer.ggml.merges",
    "eos-out-of-range": "eos_token_id",
    "nan-tensor": "NaN or Inf",
    "wrong-shape": "has shape",
    "unknown-tensor": "unexpected tensor 'blk.0.ssm_a.weight'",
    "extra-layer": "unexpected tensor 'blk.9.attn_q.weight'",
    "truncated": "not a valid GGUF",
}


@pytest.mark.parametrize("spoil", BAD_GGUFS)
def test_gguf_is_checked_before_anything_is_written(monkeypatch, capsys, gguf_source, tmp_path, spoil):
    src = write_gguf(gguf_source, tmp_path / "m.gguf", spoil)
    dst = tmp_path / "out" / "mlx"
    code, _, err = run(monkeypatch, capsys, "convert", src, dst)
    assert_one_line_error(code, err, BAD_GGUFS[spoil])
    assert not dst.exists() and not (dst.parent.exists() and _leftovers(dst))


def test_gguf_force_replaces(gguf_source, tmp_path):
    src = write_gguf(gguf_source, tmp_path / "m.gguf")
    dst = tmp_path / "mlx"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(HybridError, match="already exists"):
        convert_gguf(src, dst)
    convert_gguf(src, dst, force=True)
    assert not (dst / "old.txt").exists()
    load(dst)
    with pytest.raises(HybridError, match="holds the source"):
        convert_gguf(src, tmp_path, force=True)


# ---- chat state --------------------------------------------------------------------------------


def test_chat_state_survives_exceptions_and_interrupts(loaded, monkeypatch):
    model, tok = loaded
    session = ChatSession(model, tok)

    def consistent(reply_open=False):
        """The history alternates user, assistant; with no reply open, the cache holds exactly session.tokens."""
        assert [m["role"] for m in session.messages] == ["user", "assistant"] * (len(session.messages) // 2)
        assert reply_open or all(c.offset == len(session.tokens) for c in session.cache)

    with pytest.raises(ValueError):  # the consumer raises mid-reply and never closes the reply
        for i, _ in enumerate(session.send("Once upon a time", max_tokens=20)):
            if i == 3:
                raise ValueError("consumer bug")
    list(session.send("The lazy dog", max_tokens=4))
    consistent()
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C mid-reply
        for i, _ in enumerate(session.send("Hybrid models", max_tokens=20)):
            if i == 2:
                raise KeyboardInterrupt
    consistent(reply_open=True)
    def interrupt(fed):
        raise KeyboardInterrupt

    sync = session._sync
    monkeypatch.setattr(session, "_sync", interrupt)
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C lands in the reply's cleanup
        list(session.send("Speculative", max_tokens=4))
    monkeypatch.setattr(session, "_sync", sync)
    got = [r.token for r in session.send("The end", max_tokens=6)]  # heals, then answers as a fresh run would
    consistent()
    fresh = ChatSession(model, tok).render(session.messages[:-1])
    assert got == [r.token for r in stream_generate(model, tok, fresh, max_tokens=6)]

    replies = session.send("One at a time", max_tokens=50)
    next(replies)  # left open: the next turn closes it first
    assert len(list(session.send("me too", max_tokens=2))) == 2
    assert [m["content"] for m in session.messages[-4::2]] == ["One at a time", "me too"]
    consistent()


def _scripted_input(monkeypatch, actions):
    actions = list(actions)

    def fake_input(prompt=""):
        if not actions:
            raise EOFError
        a = actions.pop(0)
        if isinstance(a, BaseException):
            raise a
        return a

    monkeypatch.setattr("builtins.input", fake_input)
    return actions


def test_ctrl_c_at_the_chat_prompt_keeps_the_conversation(monkeypatch, capsys, model_dir):
    # A Ctrl-C and a line of bytes that are not UTF-8 (kept by Python as surrogates) at the prompt.
    _scripted_input(monkeypatch, ["hello", KeyboardInterrupt(), "\udcff\udcfe hi", "the fox", "/exit"])
    code, out, err = run(monkeypatch, capsys, "chat", "--model", model_dir, "--max-tokens", 4)
    assert code == 0 and out.count("reply 4 tok") == 2 and "Ctrl-C again to quit" in out, out
    assert err.strip() == "error: the input is not UTF-8 text; it was skipped"
    first, second = [int(line.split("context ")[1].split("/")[0]) for line in out.splitlines() if "context " in line]
    assert second > first  # the second turn still holds the first

    left = _scripted_input(monkeypatch, ["hello", KeyboardInterrupt(), KeyboardInterrupt(), "never read"])
    code, out, _ = run(monkeypatch, capsys, "chat", "--model", model_dir, "--max-tokens", 4)
    assert code == 0 and out.count("reply 4 tok") == 1 and left == ["never read"]


def test_ctrl_c_during_start_up_is_quiet(model_dir):
    """SIGINT while the libraries import or the prompt is read: status 130, no traceback."""
    for delay in (1.0, 3.0):
        p = subprocess.Popen([sys.executable, "-c", "from mlx_hybrid.cli import run; run()", "generate", "-m", str(model_dir)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 130 and b"Traceback" not in err, err.decode()[-2000:]



def test_ctrl_c_inside_a_finalizer_is_not_lost():
    """A SIGINT that lands in a `__del__` (the garbage collector runs them at any moment) would be
    printed and dropped there; the CLI's handler delivers it again once the finalizer returned."""
    from mlx_hybrid.cli import on_interrupt

    def interrupt():
        raise KeyboardInterrupt

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):  # the handler runs here, inside __del__
                pass

    previous = signal.signal(signal.SIGINT, on_interrupt(interrupt))
    try:
        with pytest.raises(KeyboardInterrupt):
            Finalized()  # freed at once
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, previous)

# ---- convert --force ---------------------------------------------------------------------------


def _leftovers(dst: Path):
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def test_force_swaps_atomically_and_cleans_stale_staging(model_dir, tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    convert(model_dir, dst)
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        stale = [tmp_path / f".dst.staging-{dead.pid}-0000", tmp_path / f".dst.old-{dead.pid}-1111"]
        busy = tmp_path / f".dst.staging-{alive.pid}-2222"
        for d in stale + [busy]:
            d.mkdir()
            (d / "shard").write_text("half-written")
        seen, done = [], threading.Event()

        def watch():  # the destination, read continuously while --force replaces it
            while not done.is_set():
                seen.append((dst / "config.json").is_file())

        watcher = threading.Thread(target=watch)
        watcher.start()
        convert(model_dir, dst, quantize=True, force=True)
        done.set()
        watcher.join()
        assert seen and all(seen), f"{seen.count(False)} of {len(seen)} reads found no destination"
        assert "quantization" in json.loads((dst / "config.json").read_text())
        assert _leftovers(dst) == [busy.name]  # the live run's staging stays
    finally:
        alive.kill()
        alive.wait()
    shutil.rmtree(busy)

    # Where the filesystem cannot exchange: two renames, and the old one comes back if the second fails.
    monkeypatch.setattr(publish, "exchange", lambda a, b: False)
    convert(model_dir, dst, force=True)
    assert "quantization" not in json.loads((dst / "config.json").read_text()) and not _leftovers(dst)
    rename = os.rename

    def failing_rename(a, b):
        if ".staging-" in str(a):
            raise OSError(28, "No space left on device", str(b))
        return rename(a, b)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(HybridError, match="No space left on device.*unchanged"):
        convert(model_dir, dst, quantize=True, force=True)
    assert "quantization" not in json.loads((dst / "config.json").read_text()) and not _leftovers(dst)


# ---- chat templates: the limits change nothing a template may legitimately do ----------------

RICH_TEMPLATE = """{{ bos_token }}{%- set ns = namespace(system=none, turns=0) -%}
{%- if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] | trim %}{% endif -%}
{%- if ns.system %}<|im_start|>system\n{{ ns.system }} {{ {'tools': [], 'n': messages | length} | tojson }}<|im_end|>\n{% endif -%}
{%- for m in messages if m['role'] != 'system' -%}
{%- if loop.index0 > 40 %}{% break %}{% endif -%}
{%- set ns.turns = ns.turns + 1 -%}
<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'][:200] }}{% endgeneration %}{% else %}{{ m['content'] | replace('  ', ' ') }}{% endif %}<|im_end|>{{ '\n' if not loop.last else '' }}
{%- endfor -%}
{{ '\n' ~ ns.turns ~ ' turns' }}{% for i in range(2) %}{% continue %}{% endfor -%}
{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"""


def test_limited_templates_render_as_transformers_does(model_dir, tmp_path):
    folder = variant(model_dir, tmp_path / "rich", _template(RICH_TEMPLATE))
    model, tok = load(folder)
    messages = [{"role": "system", "content": " Be brief. "}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn  {i} of a long chat"} for i in range(9)]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert template.render(tok, messages, model.args.max_position_embeddings) == want
    assert "9 turns" in want and '"n": 10' in want


# ---- one line, non-zero exit: the table --------------------------------------------------------


def _config(**changes):
    return lambda d: edit_json(d / "config.json", **changes)


def _template(source):
    return lambda d: (d / "chat_template.jinja").write_text(source)


def _weights(name, value):
    def spoil(d):
        w = mx.load(str(d / "model.safetensors"))
        a = np.array(w[name])
        a.flat[0] = value
        w[name] = mx.array(a)
        mx.save_safetensors(str(d / "model.safetensors"), w)
    return spoil


def _swap_token_ids(d):
    data = json.loads((d / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(data))


def _full_disk(monkeypatch):
    def full(file, arrays, metadata):
        raise OSError(28, "No space left on device", str(file))
    monkeypatch.setattr(publish, "save_safetensors", full)
    monkeypatch.setattr("mlx_hybrid.convert.hf.save_safetensors", full)


def _read_only(monkeypatch):
    def denied(dst):
        raise PermissionError(13, "Permission denied", str(dst.parent))
    monkeypatch.setattr(publish, "staging_dir", denied)


GEN = ("generate", "-p", "hi", "--max-tokens", "4")
# case: (arguments after the command's name and model, folder edit, monkeypatch setup, stdin, message fragment)
TABLE = {
    "seed -1": (["--seed", "-1"], None, None, None, "seed"),
    "seed 2^64": (["--seed", str(2**64)], None, None, None, "seed"),
    "top-k 10^9": (["--top-k", "1000000000"], None, None, None, "top-k"),
    "top-k = vocabulary": (["--top-k", "320", "--temp", "1"], None, None, None, "top-k"),
    "temp nan": (["--temp", "nan"], None, None, None, "temperature"),
    "temp inf": (["--temp", "inf"], None, None, None, "temperature"),
    "temp -inf": (["--temp", "-inf"], None, None, None, "temperature"),
    "top-p nan": (["--top-p", "nan"], None, None, None, "top-p"),
    "min-p inf": (["--min-p", "inf"], None, None, None, "min-p"),
    "repetition penalty nan": (["--repetition-penalty", "nan"], None, None, None, "repetition penalty"),
    "max-tokens -5": (["--max-tokens", "-5"], None, None, None, "max tokens"),
    "num-draft 100000": (["--speculative", "draft", "--num-draft", "100000"], "draft", None, None, "at most 511"),
    "num-draft 0": (["--speculative", "draft", "--num-draft", "0"], "draft", None, None, "at least 1"),
    "draft with another tokenizer": (["--speculative", "draft"], "draft-other-tokenizer", None, None, "another tokenizer"),
    "speculative bogus": (["--speculative", "bogus"], None, None, None, "unknown speculative method"),
    "memory budget abc": (["--memory-budget", "abc"], None, None, None, "not a size"),
    "stdin not UTF-8": (["-p", "-"], None, None, b"\xff\xfe hi", "not UTF-8"),
    "config []": ([], lambda d: (d / "config.json").write_text("[]"), None, None, "JSON object"),
    "config null": ([], lambda d: (d / "config.json").write_text("null"), None, None, "JSON object"),
    "config 42": ([], lambda d: (d / "config.json").write_text("42"), None, None, "JSON object"),
    "config not UTF-8": ([], lambda d: (d / "config.json").write_bytes(b'{"model_type": "\xff"}'), None, None, "UTF-8"),
    "config deeply nested": ([], lambda d: (d / "config.json").write_text("[" * 100000 + "]" * 100000), None, None, "JSON"),
    "zero heads": ([], _config(num_attention_heads=0), None, None, "num_attention_heads"),
    "negative hidden size": ([], _config(hidden_size=-64), None, None, "hidden_size"),
    "hidden size a string": ([], _config(hidden_size="64"), None, None, "hidden_size"),
    "kv heads not dividing": ([], _config(num_key_value_heads=3), None, None, "num_key_value_heads"),
    "10^9 layers": ([], _config(num_hidden_layers=10**9), None, None, "num_hidden_layers"),
    "rms eps NaN": ([], _config(rms_norm_eps=float("nan")), None, None, "rms_norm_eps"),
    "quantization nonsense": ([], _config(quantization={"group_size": 7, "bits": 3}), None, None, "group_size"),
    "quantization a string": ([], _config(quantization="yes"), None, None, "quantization"),
    "quantization module entry": ([], _config(quantization={"group_size": 64, "bits": 4, "q_proj": 5}), None, None,
                                  "quantization.q_proj"),
    "mamba_config not JSON": ([], lambda d: (d / "mamba_config.json").write_text("{"), None, None, "mamba_config.json"),
    "eos id 10^6": ([], _config(eos_token_id=10**6), None, None, "end-of-sequence"),
    "NaN weight": ([], _weights("model.layers.1.mlp.up_proj.weight", np.nan), None, None, "NaN or Inf"),
    "Inf weight": ([], _weights("model.norm.weight", np.inf), None, None, "NaN or Inf"),
    "template: nested range loops": ([], _template("{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"),
                                     None, None, "chat template was stopped"),
    "template: nested loops over a string": ([], _template("{% set s = 'ab' * 1500 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"),
                                             None, None, "iterations"),
    "template: sandbox escape": ([], _template("{{ ''.__class__.__mro__ }}"), None, None, "unsafe"),
    "template: syntax": ([], _template("{% for %}"), None, None, "not valid Jinja"),
    "template: raise_exception": ([], _template("{{ raise_exception('no system role') }}"), None, None, "no system role"),
    "template: undefined": ([], _template("{{ foo.bar.baz }}"), None, None, "undefined"),
    "template: 'x' * 10^9": ([], _template("{{ 'x' * 1000000000 }}"), None, None, "repeated"),
    "template: recursion": ([], _template("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"), None, None, "recursion"),
    "template: doubling string": ([], _template("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"),
                                  None, None, "chat template was stopped"),
    "template: 2 ** 10^8": ([], _template("{{ 2 ** 100000000 }}"), None, None, "power"),
    "template: format width": ([], _template("{{ '%0999999999d' % 1 }}"), None, None, "count"),
    "template: center 10^9": ([], _template("{{ 'x' | center(1000000000) }}"), None, None, "count"),
    "template: namespace underscore": ([], _template("{% set ns = namespace(_x=1) %}"), None, None, "underscore"),
    "template: deadline": ([], None, lambda mp: mp.setattr(template, "SECONDS", -1.0), None, "ran longer than"),
    "convert: read-only destination": (None, None, _read_only, None, "Permission denied"),
    "convert: full disk": (None, None, _full_disk, None, "No space left on device"),
    "convert: NaN source tensor": (None, _weights("model.layers.0.self_attn.q_proj.weight", np.nan), None, None, "NaN or Inf"),
    "convert: config [] source": (None, lambda d: (d / "config.json").write_text("[]"), None, None, "JSON object"),
}


@pytest.mark.parametrize("case", TABLE)
def test_bad_input_is_one_line_and_non_zero(monkeypatch, capsys, model_dir, tmp_path, case):
    args, edit, setup, stdin, fragment = TABLE[case]
    folder = model_dir
    if edit == "draft":
        folder = variant(model_dir, tmp_path / "m")
        shutil.copytree(model_dir, folder / "draft")
    elif edit == "draft-other-tokenizer":
        folder = variant(model_dir, tmp_path / "m")
        variant(model_dir, folder / "draft", _swap_token_ids)
    elif edit is not None:
        folder = variant(model_dir, tmp_path / "m", edit)
    if setup:
        setup(monkeypatch)
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    if args is None:  # a conversion: the destination exists and must survive
        dst = tmp_path / "out"
        dst.mkdir()
        (dst / "keep.txt").write_text("mine")
        code, _, err = run(monkeypatch, capsys, "convert", folder, dst, "--force")
        assert (dst / "keep.txt").read_text() == "mine" and not _leftovers(dst)
    else:
        command = list(GEN)
        if "-p" in args:
            command = ["generate", "--max-tokens", "4"]
        code, _, err = run(monkeypatch, capsys, *command, "--model", folder, *args)
    assert_one_line_error(code, err, fragment)

