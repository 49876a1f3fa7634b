"""`hybrid serve`'s library: the model worker (batching, speculation, prompt cache) and the HTTP API,
driven with the official openai client on 127.0.0.1 only. Every answer is checked against plain
greedy generation of the same prompt; every request is bounded by the client's timeout and every
wait by a deadline."""

import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from tests.helpers.factories import make_hf_model_dir, make_hybrid_dir
from mlx.utils import tree_flatten

from mlx_hybrid.chat import render_chat
from mlx_hybrid.generate import generate
from mlx_hybrid.loader import load
from mlx_hybrid.server import Loaded, Server
from mlx_hybrid.server.engine import Engine, Failed, Finished, Job, Started

TIMEOUT = 60  # seconds a request may take
CONTEXT = 2048


def wait_for(condition, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def add_redrafter(path):
    import mlx.core as mx

    from mlx_hybrid.speculative.redrafter import Drafter, DrafterConfig

    model, _ = load(path)
    H, V = model.args.hidden_size, model.args.vocab_size
    (path / "redrafter").mkdir()
    drafter = Drafter(DrafterConfig(H, V, 2 * H, 1, True))
    mx.save_safetensors(str(path / "redrafter" / "model.safetensors"), dict(tree_flatten(drafter.parameters())))
    config = dict(model_type="recurrent_drafting_drafter", exit_dim=2 * H, num_draft_layers=1, rnn=True, hidden_size=H, vocab_size=V)
    (path / "redrafter" / "config.json").write_text(json.dumps(config))


def loader(path, speculator: str | None = None):
    def load_on_worker():
        model, tokenizer = load(path)
        proposer = None
        if speculator:
            from mlx_hybrid.speculative import load_proposer

            proposer = load_proposer(speculator, model, path)
        return Loaded(model, tokenizer, proposer)

    return load_on_worker


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("serve") / "llama", seed=7, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    path, _ = make_hybrid_dir(tmp_path_factory.mktemp("serve") / "hybrid", ["attention", "mamba2", "attention"], seed=3)
    add_redrafter(path)
    return path


@pytest.fixture(scope="module")
def llama(llama_dir):
    return load(llama_dir)


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    return load(hybrid_dir)


def start(path, speculator=None, **options) -> Server:
    server = Server(loader(path, speculator), "tiny", port=0, default_temp=0.0, **options)
    server.start()
    return server


@pytest.fixture(scope="module")
def server(llama_dir):
    server = start(llama_dir, prompt_cache_bytes=10**6)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=TIMEOUT, max_retries=0)


def chat_reference(loaded, messages, max_tokens, **kw) -> str:
    model, tokenizer = loaded
    return generate(model, tokenizer, render_chat(tokenizer, messages), max_tokens=max_tokens, **kw)


def ask(client, text, max_tokens=12, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, **kw)


# The worker, without HTTP.


class Collect:
    """A job's events, sent from the worker thread."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, (Finished, Failed)):
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e for e in self.events if isinstance(e, str))


def test_engine_batches_jobs_and_matches_plain_decoding(llama_dir, llama):
    """Jobs queued together run as one batch; each gets what it would get alone."""
    model, tokenizer = llama
    prompts = ["Once upon a time", "The quick brown fox", "Hybrid models", "Speculative decoding verifies"]
    lengths = [5, 17, 9, 13]  # rows leave the batch at different steps
    engine = Engine(loader(llama_dir))
    jobs = [Job(send=Collect(), prompt=p, max_tokens=n) for p, n in zip(prompts, lengths)]
    for job in jobs:
        engine.submit(job)  # queued before the worker starts: admitted in one go
    engine.start()
    try:
        for job in jobs:
            assert job.send.done.wait(TIMEOUT)
    finally:
        engine.stop()
    assert engine.peak_rows == 4
    for job, p, n in zip(jobs, prompts, lengths):
        assert isinstance(job.send.events[0], Started)
        assert job.send.text == generate(model, tokenizer, p, max_tokens=n)
        assert job.send.events[-1].completion_tokens <= n


def test_speculating_job_rejoins_the_batch_when_another_arrives(hybrid_dir, hybrid):
    """A lone job on a hybrid model speculates (ReDrafter); a second job arriving mid-way sends it
    back to the batch at the end of a pass, and both still get plain greedy decoding's tokens."""
    model, tokenizer = hybrid
    engine = Engine(loader(hybrid_dir, "redrafter"))
    second = Job(send=Collect(), prompt="The quick brown fox", max_tokens=20)

    class SubmitOnFifthPiece(Collect):
        def __call__(self, event):
            super().__call__(event)
            if sum(isinstance(e, str) for e in self.events) == 5:
                engine.submit(second)  # on the worker thread, between two speculative tokens

    first = Job(send=SubmitOnFifthPiece(), prompt="Once upon a time", max_tokens=60)
    engine.start()
    try:
        engine.submit(first)
        assert first.send.done.wait(TIMEOUT) and second.send.done.wait(TIMEOUT)
    finally:
        engine.stop()
    assert engine.speculated_tokens > 0 and engine.rejoined == 1
    assert first.send.text == generate(model, tokenizer, "Once upon a time", max_tokens=60)
    assert second.send.text == generate(model, tokenizer, "The quick brown fox", max_tokens=20)


EXIT_RIGHT_AFTER_STOP = """
import sys, threading
from mlx_hybrid.loader import load
from mlx_hybrid.server.engine import Engine, Failed, Finished, Job, Loaded
from mlx_hybrid.speculative import load_proposer

def load_on_worker():
    model, tokenizer = load(sys.argv[1])
    return Loaded(model, tokenizer, load_proposer("redrafter", model, sys.argv[1]))

events, done = [], threading.Event()
def send(event):
    events.append(event)
    if isinstance(event, (Finished, Failed)):
        done.set()

engine = Engine(load_on_worker)
engine.start()
engine.submit(Job(send=send, prompt="Once upon a time", max_tokens=8))
assert done.wait(60) and isinstance(events[-1], Finished), events[-1:]
assert engine.speculated_tokens > 0
engine.stop()
"""


def test_process_exits_cleanly_right_after_the_worker_stops(hybrid_dir):
    """The worker's thread frees MLX's thread-local streams and compile cache itself: left to its
    thread-exit destructors, racing the interpreter's finalization, they aborted the process
    (SIGABRT) in about half of such exits. Five exits here, each must be clean."""
    root = Path(__file__).resolve().parents[1]
    for _ in range(5):
        done = subprocess.run([sys.executable, "-c", EXIT_RIGHT_AFTER_STOP, str(hybrid_dir)], cwd=root, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


# The HTTP API.


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "mlx-hybrid"
    health = json.loads(raw(server, "GET", "/health")[1])
    assert health["status"] == "ok" and health["model"] == "tiny"


def test_chat_streamed_and_whole(client, llama):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}]
    want = chat_reference(llama, messages, 16)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
    assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
    usage = whole.usage
    assert usage.prompt_tokens == len(render_chat(llama[1], messages))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert whole.choices[0].finish_reason == ("length" if usage.completion_tokens == 16 else "stop")

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions(client, llama):
    model, tokenizer = llama
    r = client.completions.create(model="tiny", prompt="The quick brown fox")  # OpenAI's default: 16 tokens
    assert r.choices[0].text == generate(model, tokenizer, "The quick brown fox", max_tokens=16)
    ids = tokenizer.encode("Hybrid models")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=10)
    assert r.choices[0].text == generate(model, tokenizer, ids, max_tokens=10) and r.usage.prompt_tokens == len(ids)
    full = generate(model, tokenizer, "Once upon", max_tokens=24)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    streamed = client.completions.create(model="tiny", prompt="Once upon", max_tokens=24, stop=[stop], stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[: full.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_concurrent_clients_get_their_own_answers(client, llama):
    model, tokenizer = llama
    cases = [(f"{w} the lazy dog", 6 + 3 * i, i % 2 == 0) for i, w in enumerate(["Once", "Then", "Why", "How", "So", "And", "But", "Now"])]
    results = [None] * len(cases)

    def run(i, prompt, n, stream):
        if stream:
            results[i] = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True))
        else:
            results[i] = client.completions.create(model="tiny", prompt=prompt, max_tokens=n).choices[0].text

    threads = [threading.Thread(target=run, args=(i, *case)) for i, case in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert results == [generate(model, tokenizer, p, max_tokens=n) for p, n, _ in cases]


def test_seed_reproduces_sampled_text(client):
    texts = {ask(client, "Once upon a time", 20, temperature=0.9, top_p=0.95, seed=11).choices[0].message.content for _ in range(2)}
    assert len(texts) == 1


def test_growing_chat_reads_only_new_tokens(client, llama):
    messages, previous = [{"role": "system", "content": "You are a storyteller."}], None
    for text in ["Once upon a time", "The quick brown fox", "Hybrid models"]:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        assert r.choices[0].message.content == chat_reference(llama, messages, 8)
        if previous is not None:  # the previous turn's prompt (and more) came from the cache
            assert r.usage.prompt_tokens_details.cached_tokens >= previous
        previous = r.usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})


def raw(server, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    """A hand-made request, for what the openai client cannot send (a malformed body)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body is not None else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


BAD_REQUESTS = [
    (dict(max_tokens="12"), 400, "max_tokens", "invalid_type"),
    (dict(temperature=True), 400, "temperature", "invalid_type"),
    (dict(temperature=7.0), 400, "temperature", "invalid_value"),
    (dict(max_tokens=0), 400, "max_tokens", "invalid_value"),
    (dict(max_tokens=10**12), 400, "max_tokens", None),
    (dict(extra_body={"beam_search": True}), 400, "beam_search", "unrecognized_argument"),
    (dict(n=3), 400, "n", "unsupported_parameter"),
    (dict(messages=[{"role": "user", "content": "x" * 20000}]), 400, "messages", "context_length_exceeded"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role", "invalid_value"),
    (dict(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", "invalid_type"),
    (dict(messages=[]), 400, "messages", "invalid_value"),
    (dict(model="gpt-4o"), 404, "model", "model_not_found"),
    (dict(stream_options={"include_usage": True}), 400, "stream_options", "invalid_value"),
]


@pytest.mark.parametrize("change,status,param,code", BAD_REQUESTS, ids=[f"{b[2]}-{b[3]}" for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(client, change, status, param, code):
    request = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4) | change
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**request)
    e = caught.value
    assert e.status_code == status
    assert e.body["param"] == param and e.body["code"] == code and e.body["message"]
    assert e.body["type"] == "invalid_request_error"
    assert ask(client, "still serving?", 2).choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400),
    ("POST", "/v1/completions", b"\xff\xfe", 400),
    ("POST", "/v1/completions", b"[1, 2]", 400),
    ("GET", "/v1/chat/completions", None, 405),
    ("POST", "/v1/embeddings", b"{}", 404),
])
def test_malformed_bodies_and_routes(server, client, method, path, body, status):
    got, reply = raw(server, method, path, body)
    assert got == status
    error = json.loads(reply)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert ask(client, "still serving?", 2).choices[0].finish_reason in ("stop", "length")


def test_client_disconnect_stops_generation_and_frees_memory(server, client, llama):
    engine = server.engine
    ask(client, "warm up", 4)
    before = engine.stats()
    no_eos = {str(t): -100 for t in llama[1].eos_token_ids}  # would run to the context's end
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=CONTEXT - 10, stream=True, logit_bias=no_eos)
    pieces = iter(stream)
    next(pieces), next(pieces)
    stream.close()
    wait_for(lambda: engine.stats()["running"] == 0, "the cancelled job to leave")
    after = engine.stats()
    assert after["generated_tokens"] - before["generated_tokens"] < CONTEXT - 10
    assert after["prompt_cache"] == before["prompt_cache"]  # its caches were dropped, not kept
    assert after["memory"]["active"] <= before["memory"]["active"] + 64 * 1024
    assert ask(client, "still serving?", 2).choices[0].finish_reason in ("stop", "length")


def test_a_thousand_requests_stay_within_the_cache_bound(server, client):
    """Distinct prompts, so the prompt cache fills and evicts; memory then stays flat. Four
    clients send 250 requests each, one after another."""
    engine = server.engine
    for i in range(50):
        client.completions.create(model="tiny", prompt=f"warm {i}", max_tokens=1)
    base = engine.stats()["memory"]["active"]
    served = engine.stats()["served"]
    answered = [0] * 4

    def run(k):
        for i in range(250):
            r = client.completions.create(model="tiny", prompt=f"client {k} request {i} of many", max_tokens=1)
            answered[k] += r.usage.completion_tokens

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10 * TIMEOUT)
    stats = engine.stats()
    assert answered == [250] * 4 and stats["served"] - served == 1000
    assert stats["prompt_cache"]["bytes"] <= stats["prompt_cache"]["max_bytes"]
    assert stats["running"] == 0 and stats["queued"] == 0
    # What is live beyond the model: the prompt cache's entries, up to their bound.
    assert stats["memory"]["active"] <= base + stats["prompt_cache"]["max_bytes"]


@pytest.fixture(scope="module")
def hybrid_server(hybrid_dir):
    server = start(hybrid_dir, "redrafter")
    yield server
    server.stop()


def test_hybrid_speculative_chat_reuses_snapshots(hybrid_server, hybrid):
    """On a hybrid model (a Mamba2 layer: its state cannot be cut back) a growing chat and a new
    conversation with the same system prompt both resume from snapshots; replies are plain greedy
    decoding's although they are decoded speculatively."""
    client = openai.OpenAI(base_url=hybrid_server.url, api_key="unused", timeout=TIMEOUT, max_retries=0)
    tokenizer = hybrid[1]
    system = {"role": "system", "content": "You are a storyteller who likes foxes and robots."}
    messages = [system]
    for turn, text in enumerate(["Once upon a time", "The quick brown fox"]):
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10)
        assert r.choices[0].message.content == chat_reference(hybrid, messages, 10)
        if turn == 1:  # the first turn's prompt, all but its last token, was kept as a snapshot
            assert r.usage.prompt_tokens_details.cached_tokens >= first_prompt - 1
        first_prompt = r.usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    other = [system, {"role": "user", "content": "Hybrid models"}]
    r = client.chat.completions.create(model="tiny", messages=other, max_tokens=10)
    assert r.choices[0].message.content == chat_reference(hybrid, other, 10)
    system_tokens = len(render_chat(tokenizer, [system], add_generation_prompt=False))
    assert r.usage.prompt_tokens_details.cached_tokens == system_tokens
    assert hybrid_server.engine.speculated_tokens > 0


def test_readme_client_example(server, llama, capsys):
    """The README's five-line openai example, pointed at this server and model."""
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = readme.split("Any OpenAI client works; with `pip install openai`:\n\n```python\n")[1].split("```")[0]
    assert len(code.strip().splitlines()) == 5
    exec(code.replace("http://127.0.0.1:8080/v1", server.url).replace('model="default"', 'model="tiny"'), {})
    messages = [{"role": "user", "content": "Tell me a story."}]
    assert capsys.readouterr().out == chat_reference(llama, messages, 100)


def test_serve_command_errors(monkeypatch, capsys, tmp_path):
    """Bad options and a model that does not load end in one line before anything listens."""
    from tests.helpers.cli import assert_one_line_error, run

    code, _, err = run(monkeypatch, capsys, "serve", "--port", 70000)
    assert_one_line_error(code, err, "--port")
    code, _, err = run(monkeypatch, capsys, "serve", "--prompt-cache", "lots")
    assert_one_line_error(code, err, "'lots'")
    code, _, err = run(monkeypatch, capsys, "serve", "-m", tmp_path / "nothing-here")
    assert_one_line_error(code, err, "nothing-here")
