"""Continuous batching: sequences that join and leave a `Batch` between steps get the logits each
would get decoded alone, for attention (full and sliding-window) and every recurrent layer kind."""

import mlx.core as mx
import pytest
from tests.helpers.factories import make_hf_model_dir, make_hybrid_dir

from mlx_hybrid.batch import Batch
from mlx_hybrid.decode import prefill
from mlx_hybrid.loader import load

PROMPTS = [[5, 9, 14, 20, 30], list(range(10, 30)), [7, 8], list(range(40, 53))]
STEPS = 10


@pytest.fixture(scope="module", params=["llama", "mistral", "hybrid"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m"
    if request.param == "hybrid":
        make_hybrid_dir(path, ["attention", "mamba", "mamba2", "dsla"])
    elif request.param == "mistral":
        make_hf_model_dir(path, arch="mistral", sliding_window=8)  # prompts and replies outgrow the window
    else:
        make_hf_model_dir(path)
    return load(path, dtype="float32")[0]


def read(model, prompt):
    cache = model.make_cache()
    prefill(model, mx.array(prompt), cache)
    return cache


def test_batch_matches_sequences_decoded_alone(model):
    alone = []
    for p in PROMPTS:
        cache, token, logits = read(model, p[:-1]), p[-1], []
        for _ in range(STEPS):
            logits.append(model(mx.array([[token]]), cache)[0, -1])
            token = int(mx.argmax(logits[-1]))
        alone.append(logits)

    # One sequence joins per step; each leaves after STEPS tokens, so rows of every length mix.
    batch, rows, tokens, got = Batch(), [], [], [[] for _ in PROMPTS]
    for step in range(len(PROMPTS) + STEPS - 1):
        if step < len(PROMPTS):
            batch.add(read(model, PROMPTS[step][:-1]))
            rows.append(step)
            tokens.append(PROMPTS[step][-1])
        logits = model(mx.array(tokens)[:, None], batch.caches)[:, -1]
        for i, r in enumerate(rows):
            got[r].append(logits[i])
        tokens = mx.argmax(logits, axis=-1).tolist()
        keep = [i for i, r in enumerate(rows) if len(got[r]) < STEPS]
        if len(keep) < len(rows):
            batch.keep(keep)
            rows, tokens = [rows[i] for i in keep], [tokens[i] for i in keep]
    assert batch.rows == 0
    for want, have in zip(alone, got):
        assert len(have) == STEPS
        for a, b in zip(want, have):
            assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item()


def test_take_returns_a_sequence_cache(model):
    """A row taken out of the batch continues on its own as if it had never been batched."""
    batch = Batch()
    for p in PROMPTS[:3]:
        batch.add(read(model, p))
    taken = batch.take(1, len(PROMPTS[1]))
    assert all(c.offset == len(PROMPTS[1]) for c in taken)
    alone = read(model, PROMPTS[1])
    a = model(mx.array([[3]]), taken)[0, -1]
    b = model(mx.array([[3]]), alone)[0, -1]
    assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item()
