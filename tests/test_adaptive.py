"""Adaptive DSLA conversion: a model carrying attention and DSLA weights for some layers runs as
many of them as DSLA as a request needs to fit a memory budget, least sensitive first.

References: the plain model (no conversion: identical tokens and logits), the PyTorch reference
(tests/helpers/torch_hybrid.py) of the model with those layers as DSLA (logits, ATOL 1e-4 as in
test_hybrid_parity.py: logits ~2.5, measured max |diff| ~5e-6), the existing hybrid runtime on a
llama_hybrid directory with those layers as DSLA (greedy tokens, exact), and the caches' measured
nbytes (the policy's estimate, exact).
"""

import copy
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from tests.helpers.factories import make_hybrid_dir
from safetensors.torch import save_file
from tests.helpers.cli import assert_one_line_error, run

from mlx_hybrid.adaptive import ConversionPolicy, cache_nbytes, kv_rows, parse_budget, request_cache
from mlx_hybrid.cache import STEP, KVCache, StateCache
from mlx_hybrid.chat import ChatSession
from mlx_hybrid.errors import HybridError
from mlx_hybrid.decode import generate_step
from mlx_hybrid.generate import stream_generate
from mlx_hybrid.loader import load

ATOL = 1e-4
KINDS = ["attention", "attention", "mamba", "attention", "attention"]  # layer 2 is a Mamba layer throughout
CONVERTIBLE = [0, 1, 3, 4]
ORDER = [3, 0, 4, 1]  # least sensitive first
MAX_LAYERS = 3


def save_dir(path, torch_model, kinds, src, extra=None):
    """A llama_hybrid directory for torch_model (tokenizer and config from src, mixer_types = kinds)."""
    path.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, path / f.name)
    state = {k: v.contiguous() for k, v in torch_model.state_dict().items()}
    save_file(state | (extra or {}), str(path / "model.safetensors"), {"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["mixer_types"] = kinds
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The adaptive directory, the torch models it is made of, and a factory of references."""
    root = tmp_path_factory.mktemp("adaptive")
    base, base_torch = make_hybrid_dir(root / "base", KINDS, seed=4, max_position_embeddings=2048)
    all_dsla = [("dsla" if i in CONVERTIBLE else k) for i, k in enumerate(KINDS)]
    _, dsla_torch = make_hybrid_dir(root / "dsla", all_dsla, seed=4, max_position_embeddings=2048)
    for i in (0, 1, 3, 4):  # shared layers of both builds agree (same seed, same base model)
        for part in ("mlp", "input_layernorm", "post_attention_layernorm"):
            a, b = (m.model.layers[i].get_submodule(part).state_dict() for m in (base_torch, dsla_torch))
            assert all(torch.equal(a[k], b[k]) for k in a)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a distilled DSLA layer's q, k, v, o differ from the attention's
        for i in CONVERTIBLE:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                w = getattr(dsla_torch.model.layers[i].dsla, name).weight
                w.add_(0.03 * torch.randn(w.shape, generator=g))
    dsla_tensors = {k: v.contiguous() for k, v in dsla_torch.state_dict().items() if ".dsla." in k}
    adaptive = save_dir(root / "adaptive", base_torch, KINDS, base, dsla_tensors)
    config = json.loads((adaptive / "config.json").read_text())
    config["dsla_conversion"] = {"order": ORDER, "max_layers": MAX_LAYERS}
    (adaptive / "config.json").write_text(json.dumps(config, indent=2))

    def reference(dsla_layers):
        """PyTorch model and runtime directory with exactly these layers as DSLA."""
        model = copy.deepcopy(base_torch)
        for i in dsla_layers:
            model.model.layers[i] = copy.deepcopy(dsla_torch.model.layers[i])
        kinds = [("dsla" if i in dsla_layers else k) for i, k in enumerate(KINDS)]
        name = "ref-" + "-".join(map(str, sorted(dsla_layers)))
        path = root / name if (root / name).exists() else save_dir(root / name, model, kinds, base)
        return model.eval(), path

    return adaptive, base, reference


@pytest.fixture(scope="module")
def loaded(dirs):
    return load(dirs[0], "float32")


def prompt_ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(5, 300, n)]


def greedy(model, prompt, cache, max_tokens):
    return [t for t, _ in generate_step(mx.array(prompt), model, cache, lambda x: mx.argmax(x, -1), max_tokens=max_tokens)]


def test_both_weight_sets_load(loaded):
    model, _ = loaded
    for i, layer in enumerate(model.layers):
        assert ("dsla" in layer) == (i in CONVERTIBLE)
    assert model.args.dsla_order == ORDER and model.args.dsla_max_layers == MAX_LAYERS
    cache = model.make_cache([3, 0])
    assert [type(c) for c in cache] == [StateCache, KVCache, StateCache, StateCache, KVCache]
    with pytest.raises(ValueError, match=r"\[2\] have no DSLA"):
        model.make_cache([2])


def test_no_conversion_is_the_plain_model(dirs, loaded):
    """A prompt that fits the budget runs with no DSLA layer: same logits and tokens as the plain model."""
    model, tok = loaded
    plain, _ = load(dirs[1], "float32")
    ids = prompt_ids(40)
    cache, plan = request_cache(model, len(ids), 20, budget="64GB")
    assert plan.dsla_layers == [] and all(isinstance(c, KVCache) for i, c in enumerate(cache) if i != 2)
    np.testing.assert_array_equal(np.array(model(mx.array([ids]), cache)), np.array(plain(mx.array([ids]))))
    got = [r.token for r in stream_generate(model, tok, ids, max_tokens=20, memory_budget="64GB")]
    assert got == [r.token for r in stream_generate(plain, tok, ids, max_tokens=20)]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_converted_layers_match_a_hybrid_with_those_layers_as_dsla(dirs, loaded, k):
    model, tok = loaded
    ref_torch, ref_dir = dirs[2](ORDER[:k])
    ids = prompt_ids(48, seed=k)
    with torch.no_grad():
        expected = ref_torch(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    got = np.array(model(mx.array([ids]), model.make_cache(ORDER[:k]))[0])
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    ref, _ = load(ref_dir, "float32")
    assert greedy(model, ids, model.make_cache(ORDER[:k]), 24) == greedy(ref, ids, ref.make_cache(), 24)


def budget_for(policy, prompt, max_tokens, k):
    """The smallest budget that holds the request with the first k convertible layers as DSLA."""
    from mlx_hybrid.adaptive import request_chunks

    return policy.weights_bytes + policy.cache_bytes(request_chunks(prompt, max_tokens), ORDER[:k])


def test_long_prompt_over_budget_is_converted_and_stays_within_it(dirs, loaded):
    """A budget that cannot hold the full KV cache of a long prompt: the two least sensitive
    layers run as DSLA, generation completes, and weights + the caches measured at every step
    stay within the budget, while the unconverted cache measured on the same request exceeds it."""
    model, tok = loaded
    ids, max_tokens = prompt_ids(700), 40
    policy = ConversionPolicy(model, "1GB")
    budget = budget_for(policy, len(ids), max_tokens, 2)
    cache, plan = request_cache(model, len(ids), max_tokens, budget)
    assert plan.dsla_layers == [3, 0] and plan.rate == 2 / 5
    peak, tokens = 0, []
    for t, _ in generate_step(mx.array(ids), model, cache, lambda x: mx.argmax(x, -1), max_tokens=max_tokens):
        tokens.append(t)
        peak = max(peak, cache_nbytes(cache))
    assert len(tokens) == max_tokens
    assert policy.weights_bytes + peak <= budget
    assert peak == plan.cache_bytes
    plain_cache = model.make_cache()
    greedy(model, ids, plain_cache, max_tokens)
    assert policy.weights_bytes + cache_nbytes(plain_cache) > budget
    _, ref_dir = dirs[2]([3, 0])
    ref, _ = load(ref_dir, "float32")
    assert [r.token for r in stream_generate(model, tok, ids, max_tokens=max_tokens, memory_budget=budget)] == (
        greedy(ref, ids, ref.make_cache(), max_tokens)
    )


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("prompt,max_tokens", [(1, 1), (200, 56), (256, 1), (257, 300), (600, 3)])
def test_cache_estimate_is_exact(loaded, dirs, dtype, prompt, max_tokens):
    model = loaded[0] if dtype == "float32" else load(dirs[0], dtype)[0]
    policy = ConversionPolicy(model, "64GB")
    for k in (0, 2):
        cache = model.make_cache(ORDER[:k])
        greedy(model, prompt_ids(prompt), cache, max_tokens)
        from mlx_hybrid.adaptive import request_chunks

        assert cache_nbytes(cache) == policy.cache_bytes(request_chunks(prompt, max_tokens), ORDER[:k])


def test_sliding_window_rows_follow_the_cache():
    """kv_rows repeats KVCache's arithmetic, sliding-window drops included."""
    for window in (None, 8, 300):
        for chunks in ([512, 512, 100] + [1] * 40, [1] * 700, [300, 1, 1], [STEP] * 3):
            c = KVCache(window)
            x = mx.zeros((1, 1, 1, 2))
            for n in chunks:
                c.update_and_fetch(mx.repeat(x, n, axis=2), mx.repeat(x, n, axis=2))
            assert kv_rows(chunks, window) == c.keys.shape[2], (window, chunks[:3])


def test_policy_converts_least_sensitive_first_up_to_the_maximum(loaded):
    model, _ = loaded
    policy = ConversionPolicy(model, "64GB")
    for k in range(MAX_LAYERS + 1):
        policy.budget = budget_for(policy, 500, 10, k)
        assert policy.plan(500, 10).dsla_layers == ORDER[:k]
        policy.budget -= 1
        if k < MAX_LAYERS:
            assert policy.plan(500, 10).dsla_layers == ORDER[: k + 1]
    with pytest.raises(HybridError, match="even with 3 layers as DSLA, over the memory budget"):
        policy.plan(500, 10)  # the fourth convertible layer is past the configured maximum
    policy.budget = budget_for(policy, 500, 10, 1)
    assert [len(policy.plan(n, 10).dsla_layers) for n in (10, 250, 500, 900)] == [0, 1, 1, 3]


@pytest.mark.parametrize(
    "text,size",
    [("8GB", 8 * 10**9), ("1.5GiB", 3 * 2**29), ("512 MiB", 2**29), ("300k", 300_000), ("1234", 1234), (2e9, 2 * 10**9)],
)
def test_parse_budget(text, size):
    assert parse_budget(text) == size


@pytest.mark.parametrize("bad", ["", "lots", "-1GB", "0", "8XB", "1e9", "GB"])
def test_bad_budget_is_one_line_error(monkeypatch, capsys, dirs, bad):
    with pytest.raises(HybridError, match="memory budget"):
        parse_budget(bad)
    code, _, err = run(monkeypatch, capsys, "generate", "--model", dirs[0], "-p", "hi", "--memory-budget", bad)
    assert_one_line_error(code, err, "memory budget")


def test_budget_too_small_is_one_line_error(monkeypatch, capsys, dirs):
    code, _, err = run(monkeypatch, capsys, "generate", "--model", dirs[0], "-p", "hi", "--memory-budget", "1MB")
    assert_one_line_error(code, err, "even with 3 layers as DSLA", "over the memory budget of 1.00 MB")


def test_chat_converts_when_the_history_grows(loaded):
    """Turn 1 fits unconverted; turn 2's history does not: the session re-reads the history with one
    DSLA layer, and its reply equals fresh generation on that conversion."""
    model, tok = loaded
    policy = ConversionPolicy(model, "64GB")
    rereads = []
    session = ChatSession(model, tok, memory_budget=budget_for(policy, 300, 8, 1), on_reread=lambda *a: rereads.append(a))
    list(session.send("The quick brown fox " * 8, max_tokens=8))
    assert session.dsla_layers == [] and session.plan.dsla_layers == [] and rereads == []
    text = "Once upon a time there was a little robot who loved to read books. " * 6
    prompt = session.render(session.messages + [{"role": "user", "content": text}])
    assert 256 < len(prompt) + 8 <= 512  # the KV buffers grow to 512 rows: one layer must convert
    replies = [r.token for r in session.send(text, max_tokens=8)]
    assert session.dsla_layers == [3] and isinstance(session.cache[3], StateCache)
    assert rereads == [(0, len(prompt) - 1), (len(prompt) - 1, len(prompt) - 1)]  # the whole prompt, reported
    assert replies == greedy(model, prompt, model.make_cache([3]), 8)
    assert session.cache_bytes == cache_nbytes(session.cache) > 0


def test_cli_chat_shows_a_re_read(monkeypatch, capsys, dirs, loaded):
    """The turn that converts a layer re-reads the conversation: `hybrid chat` says so on stderr."""
    budget = budget_for(ConversionPolicy(loaded[0], "64GB"), 300, 8, 1)
    turns = ["The quick brown fox " * 8, "Once upon a time there was a little robot who loved to read books. " * 6]
    code, out, err = run(monkeypatch, capsys, "chat", "--model", dirs[0], "--max-tokens", 8, "--memory-budget", budget,
                         stdin="\n".join(turns + ["/exit"]) + "\n")
    assert code == 0 and "DSLA 0/5 layers" in out and "DSLA 1/5 layers" in out
    assert err.count("re-reading the conversation") == 1, err
    assert 256 < int(err.split("re-reading the conversation (")[1].split(" tokens)")[0]) < 512


def test_cli_chat_footer_shows_conversion_and_kv_memory(monkeypatch, capsys, dirs, loaded):
    code, out, _ = run(monkeypatch, capsys, "chat", "--model", dirs[0], "--max-tokens", 5, stdin="hello\n/exit\n")
    assert code == 0
    assert "DSLA 0/5 layers (0%)" in out and "KV " in out


def test_benchmark_entropy_ranking_matches_transformers(tmp_path):
    """benchmarks/dsla_conversion.py ranks layers by the final query's attention entropy: equal to
    the entropy of transformers' own attention weights (eager attention, output_attentions)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.dsla_conversion import attention_entropy
    from tests.helpers.factories import make_hf_model_dir

    path = make_hf_model_dir(tmp_path / "m", seed=6, num_hidden_layers=4)
    model, _ = load(path, "float32")
    prompts = [prompt_ids(30, seed=1), prompt_ids(45, seed=2)]
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    expected = np.zeros(4)
    with torch.no_grad():
        for ids in prompts:
            for i, a in enumerate(ref(torch.tensor([ids]), output_attentions=True).attentions):
                p = a[0, :, -1].double()
                expected[i] += float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean()) / len(prompts)
    np.testing.assert_allclose(attention_entropy(model, prompts), expected, atol=1e-4, rtol=0)
