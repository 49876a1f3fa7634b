"""ChatSession keeps history in the KV cache; every turn must equal a fresh run on the full history."""

import pytest
from tests.helpers.factories import make_hf_model_dir

from mlx_hybrid.chat import ChatSession
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
