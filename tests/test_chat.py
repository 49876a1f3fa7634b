"""ChatSession keeps history in the KV cache; every turn must equal a fresh run on the full history.

On a hybrid model (recurrent layers) the reference for "the history was not read again" is the
tokens a decoder layer is called with, counted by a stand-in for that layer; replies are compared
with fresh generation on the whole conversation (greedy, float32, exact tokens)."""

import mlx.core as mx
import pytest
from tests.helpers.factories import make_hf_model_dir, make_hybrid_dir

from mlx_hybrid.cache import KVCache
from mlx_hybrid.chat import ChatSession
from mlx_hybrid.decode import common_prefix
from mlx_hybrid.generate import stream_generate
from mlx_hybrid.loader import load


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load(make_hf_model_dir(tmp_path_factory.mktemp("chat"), seed=3), dtype="float32")


def fresh_reply(model, tokenizer, messages, max_tokens):
    prompt = ChatSession(model, tokenizer).render(messages)
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


def test_turns_match_fresh_generation(loaded):
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer, system="Be brief.")
    for text in ["Once upon a time", "The quick brown fox", "Hybrid models"]:
        expected = fresh_reply(model, tokenizer, session.messages + [{"role": "user", "content": text}], 12)
        got = [r.token for r in session.send(text, max_tokens=12)]
        assert got == expected
        # The cache holds exactly the tracked tokens, in every layer.
        assert all(c.offset == len(session.tokens) for c in session.cache)
    assert [m["role"] for m in session.messages] == ["system"] + ["user", "assistant"] * 3


def test_second_turn_reuses_cache(loaded):
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer)
    list(session.send("Once upon a time", max_tokens=8))
    before = len(session.tokens)
    replies = session.send("The lazy dog", max_tokens=4)
    first = next(replies)
    assert first.prompt_tokens < len(session.render(session.messages))  # only the new suffix was prefilled
    assert before > 0
    list(replies)


def test_interrupted_reply_keeps_cache_consistent(loaded):
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer)
    replies = session.send("Once upon a time", max_tokens=30)
    for i, _ in enumerate(replies):
        if i == 5:
            break
    replies.close()  # what Ctrl-C does in `hybrid chat`
    assert session.messages[-1]["role"] == "assistant"
    assert all(c.offset == len(session.tokens) for c in session.cache)
    expected = fresh_reply(model, tokenizer, session.messages + [{"role": "user", "content": "Speculative"}], 10)
    assert [r.token for r in session.send("Speculative", max_tokens=10)] == expected


def test_rejected_prompt_leaves_history_unchanged(loaded):
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer)
    list(session.send("hello", max_tokens=4))
    messages, tokens = list(session.messages), list(session.tokens)
    with pytest.raises(Exception, match="context"):
        list(session.send("fox " * 600, max_tokens=4))
    assert session.messages == messages
    assert session.tokens == tokens[: len(session.tokens)]
    assert all(c.offset == len(session.tokens) for c in session.cache)


def test_reset(loaded):
    model, tokenizer = loaded
    session = ChatSession(model, tokenizer, system="sys")
    list(session.send("hello", max_tokens=3))
    session.reset()
    assert session.messages == [{"role": "system", "content": "sys"}]
    assert session.tokens == [] and all(c.offset == 0 for c in session.cache)


# ---- hybrid models: a recurrent state cannot be trimmed, only restored to a snapshot -----------

def test_kv_cache_restores_its_snapshot():
    """The attention layers of a hybrid go back with its recurrent ones: restore is a trim back
    to the snapshot's offset, keys and values before it untouched."""
    cache, rows = KVCache(), mx.random.normal((1, 2, 7, 4))
    cache.update_and_fetch(rows[:, :, :5], rows[:, :, :5])
    snap = cache.snapshot()
    cache.update_and_fetch(rows[:, :, 5:], rows[:, :, 5:])
    cache.restore(snap)
    assert cache.offset == 5
    keys, _ = cache.update_and_fetch(rows[:, :, 5:6], rows[:, :, 5:6])
    assert mx.array_equal(keys, rows[:, :, :6])


HYBRID = ["attention", "mamba2", "attention", "mamba2"]
SPY = 2  # the layer the stand-in replaces: after a Mamba2 layer, so an interrupt there leaves layer 1 ahead


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path, _ = make_hybrid_dir(tmp_path_factory.mktemp("chat") / "hybrid", HYBRID, seed=3, max_position_embeddings=2048)
    return load(path, dtype="float32")


class Spy:
    """Stands in for a decoder layer: counts the tokens it is called with, and once armed raises
    KeyboardInterrupt from its next call, after the layers before it have updated their caches
    (a Ctrl-C that lands between layers)."""

    def __init__(self, layer):
        self.layer, self.fed, self.armed = layer, 0, False

    def __call__(self, x, mask=None, cache=None):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        self.fed += x.shape[1]
        return self.layer(x, mask, cache)


@pytest.fixture
def spy(hybrid):
    layers = hybrid[0].model.layers
    s = Spy(layers[SPY])
    layers[SPY] = s
    yield s
    layers[SPY] = s.layer


def interrupted(session, text, after, between_layers=None):
    """Send text and stop the reply after `after` tokens, as `hybrid chat` does: Ctrl-C in the
    consumer, or with between_layers (a Spy) inside the model's next pass; then close the reply.
    Returns the tokens shown."""
    shown, replies = [], session.send(text, max_tokens=40)
    with pytest.raises(KeyboardInterrupt):
        try:
            for r in replies:
                shown.append(r.token)
                if len(shown) == after:
                    if between_layers is None:
                        raise KeyboardInterrupt
                    between_layers.armed = True
        finally:
            replies.close()
    assert len(shown) == after and session.messages[-1]["role"] == "assistant"
    assert all(c.offset == len(session.tokens) for c in session.cache)
    return shown


def reply_and_count(session, spy, text, max_tokens):
    """The reply's tokens and the prompt tokens the turn fed the model (decode steps taken out:
    each token but the last shown, unless max_tokens ended the reply, feeds one step)."""
    before = spy.fed
    got = [r.token for r in session.send(text, max_tokens=max_tokens)]
    return got, spy.fed - before - min(len(got), max_tokens - 1)


@pytest.mark.parametrize("where", ["consumer", "between layers"])
def test_interrupted_reply_on_a_hybrid_reads_only_the_reply_again(hybrid, spy, where):
    """Ctrl-C mid-reply, in the consumer or between two layers of the model's pass: the next turn
    restores the caches at the end of the prompt and reads from there, and answers as a fresh run."""
    model, tok = hybrid
    session = ChatSession(model, tok, system="Be brief.")
    list(session.send("The quick brown fox", max_tokens=6))
    prompt = session.render(session.messages + [{"role": "user", "content": "Once upon a time"}])
    shown = interrupted(session, "Once upon a time", 5, spy if where == "between layers" else None)
    messages = session.messages + [{"role": "user", "content": "Hybrid models"}]
    following = session.render(messages)
    # The re-rendered partial reply differs from the tokens generated: the cache must go back into
    # the reply, which a recurrent state can do only through a snapshot.
    assert len(prompt) <= common_prefix(prompt + shown, following) < len(prompt) + len(shown)
    got, fed = reply_and_count(session, spy, "Hybrid models", 8)
    assert fed == len(following) - (len(prompt) - 1)
    assert got == fresh_reply(model, tok, messages, 8)


def test_forced_reread_is_reported_and_ctrl_c_keeps_the_session(hybrid, spy):
    """An edited system message leaves no snapshot to return to: the history (over one 512-token
    chunk) is read again and reported; Ctrl-C in its second chunk, between layers, keeps the first
    chunk, and the next turn reads the rest and answers as a fresh run."""
    model, tok = hybrid
    reports = []

    def on_reread(done, total):
        reports.append((done, total))
        if done == 512:
            spy.armed = True

    session = ChatSession(model, tok, system="Be brief.", on_reread=on_reread)
    list(session.send("Once upon a time there was a little robot who loved to read books. " * 16, max_tokens=4))
    assert reports == [] and len(session.tokens) > 600
    session.messages = [{"role": "system", "content": "Be terse."}] + session.messages[1:]
    messages = session.messages + [{"role": "user", "content": "The quick brown fox"}]
    with pytest.raises(KeyboardInterrupt):
        list(session.send("The quick brown fox", max_tokens=6))
    prompt = session.render(messages)
    assert reports == [(0, len(prompt) - 1), (512, len(prompt) - 1)]
    assert session.messages == messages[:-1]  # the turn never replied: the history is unchanged
    assert session.tokens == prompt[:512] and all(c.offset == 512 for c in session.cache)

    reports.clear()
    got, fed = reply_and_count(session, spy, "The quick brown fox", 6)
    assert reports == [(0, len(prompt) - 513), (len(prompt) - 513, len(prompt) - 513)]
    assert fed == len(prompt) - 512
    assert got == fresh_reply(model, tok, messages, 6)
    reports.clear()
    list(session.send("Speculative", max_tokens=4))  # the history is in the cache again
    assert reports == []
