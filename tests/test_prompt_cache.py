"""The prompt cache: the longest reusable prefix, cut back where a KV cache allows and never where
a recurrent state is, copies that leave the entry intact, and an LRU memory bound."""

import mlx.core as mx
import pytest
from tests.helpers.factories import make_hf_model_dir, make_hybrid_dir

from mlx_hybrid.decode import prefill
from mlx_hybrid.loader import load
from mlx_hybrid.prompt_cache import PromptCache, cache_nbytes


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pc")
    llama = load(make_hf_model_dir(root / "llama"), dtype="float32")[0]
    hybrid = load(make_hybrid_dir(root / "hybrid", ["attention", "mamba2"])[0], dtype="float32")[0]
    return {"llama": llama, "hybrid": hybrid}


def read(model, tokens, cache=None):
    cache = cache if cache is not None else model.make_cache()
    prefill(model, mx.array(tokens), cache)
    return cache


def next_logits(model, cache, token=3):
    return model(mx.array([[token]]), cache)[0, -1]


A = list(range(10, 40))


def test_kv_entry_is_cut_back_to_the_shared_prefix(models):
    model = models["llama"]
    pc = PromptCache(10**8)
    pc.insert(A, read(model, A))
    prompt = A[:20] + [90, 91, 92]
    cache, n = pc.fetch(prompt)
    assert n == 20 and all(c.offset == 20 for c in cache)
    want = next_logits(model, read(model, prompt[:-1]), prompt[-1])
    got = next_logits(model, read(model, prompt[20:-1], cache), prompt[-1])
    assert mx.allclose(want, got, atol=1e-5).item()
    # The entry itself was copied, not changed: it still serves its whole prefix.
    cache, n = pc.fetch(A + [5])
    assert n == len(A)
    assert mx.allclose(next_logits(model, cache, 5), next_logits(model, read(model, A), 5), atol=1e-5).item()


def test_recurrent_entry_serves_only_its_continuations(models):
    model = models["hybrid"]
    pc = PromptCache(10**8)
    pc.insert(A, read(model, A))
    assert pc.fetch(A[:20] + [90, 91]) == (None, 0)  # a Mamba2 state cannot forget tokens
    assert pc.fetch(A) == (None, 0)  # the last token's logits are needed: nothing left to read
    cache, n = pc.fetch(A + [90, 91])
    assert n == len(A)
    want = next_logits(model, read(model, A + [90]), 91)
    assert mx.allclose(next_logits(model, read(model, [90], cache), 91), want, atol=1e-5).item()


def test_redundant_prefixes_and_memory_bound(models):
    model = models["llama"]
    one = read(model, A[:10])
    size = cache_nbytes(one)
    pc = PromptCache(3 * size)
    pc.insert(A[:10], one)
    pc.insert(A[:20], read(model, A[:20]))  # can be cut back to A[:10]: that entry goes
    assert list(pc.entries) == [tuple(A[:20])]
    for i in range(5):
        pc.insert([100 + i] * 5, read(model, [100 + i] * 5))
    assert pc.nbytes <= pc.max_bytes and len(pc) == 3
    assert [k[0] for k in pc.entries] == [102, 103, 104]  # least recently used went first
    pc.fetch([102] * 5 + [1])  # a hit makes an entry the most recent
    pc.insert([105] * 5, read(model, [105] * 5))
    assert [k[0] for k in pc.entries] == [104, 102, 105]
    PromptCache(size - 1).insert(A[:10], read(model, A[:10]))  # larger than the bound: not kept, no error


def test_copies_hold_only_their_own_memory(models):
    """A copy (an entry's, or a row taken out of a batch) must not keep its source's buffers
    alive: the cache's memory bound counts only the copy."""
    from mlx_hybrid.batch import Batch
    from mlx_hybrid.prompt_cache import copy_cache

    model = models["hybrid"]
    source = read(model, list(range(3, 300)))  # KV buffers of 512 rows, 299 used
    size = cache_nbytes(source)
    base = mx.get_active_memory() - size
    copy = copy_cache(source, 299)
    del source
    assert mx.get_active_memory() - base < cache_nbytes(copy) + size / 4  # source kept: + size
    batch = Batch()
    for i in range(8):
        batch.add(read(model, list(range(3 + i, 200))))
    size = batch.nbytes
    base = mx.get_active_memory() - size
    taken = batch.take(2, 197)
    batch.keep([])
    assert mx.get_active_memory() - base < cache_nbytes(taken) + size / 4  # the batch kept: + size
