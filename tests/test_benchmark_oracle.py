"""The benchmarks' oracle proposer (benchmarks/oracle.py) and the synthetic shapes it runs on.

Acceptance is checked against an independent target: `accept.greedy_rows` on logits whose argmax
at every node of depth d is the reference's token d places after the root, as a target that
decodes the reference gives; that target's accepted count, not the oracle's, moves the root on.
Exactness on a real tiny target follows tests/test_speculative.py (tie-free references).
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from tests.helpers.factories import make_hf_model_dir
from tests.test_speculative import N_TOKENS, run_steps, tie_free_references

from benchmarks import run as bench_run
from benchmarks.oracle import Depths, OracleBeams, OracleDraft, OracleTree, continuation, parse_profile, profile_of
from mlx_hybrid.errors import HybridError
from mlx_hybrid.loader import load_model
from mlx_hybrid.speculative import accept
from mlx_hybrid.speculative.tree import MedusaTree, cartesian_paths

VOCAB = 97
TREE = MedusaTree(cartesian_paths([3, 2, 2, 1]))  # the Medusa proposer's default tree for 4 heads


def shapes(reference, start, profile, vocab=VOCAB):
    return [OracleTree(TREE, reference, start, profile, vocab, seed=1), OracleBeams(4, 5, reference, start, profile, vocab, seed=1)]


def accepted_depths(oracle, reference: list[int], start: int, passes: int) -> list[int]:
    """The drafts a target decoding `reference` accepts at each of `passes` greedy passes."""
    pos, out = start, []
    for _ in range(passes):
        draft = oracle.draft(mx.array([reference[pos]], mx.int32), None)
        depths = np.array(draft.tree.depths)
        best = np.array(reference)[np.minimum(pos + depths + 1, len(reference) - 1)]
        info, _ = accept.greedy_rows(draft, mx.array(np.eye(VOCAB, dtype=np.float32)[best]))
        n = int(info[0].item())
        out.append(n)
        pos += n + 1
    return out


@pytest.mark.parametrize("profile,expect", [((1.0,) * 4, [4, 4]), ((0.0,) * 4, [0, 0])])
def test_oracle_at_certain_profiles(profile, expect):
    """All right: every pass accepts the shape's whole depth (4 for the tree, 4 for 4x5 beams);
    all wrong: no draft is ever accepted, one token a pass."""
    reference = np.random.default_rng(0).integers(0, VOCAB, 400).tolist()
    for oracle, depth in zip(shapes(reference, 3, profile), expect):
        assert set(accepted_depths(oracle, reference, 3, 60)) == {depth}, oracle.name


def test_oracle_mean_depth_matches_profile():
    """E[accepted] = sum over d of P(depths 1..d right) = .8 + .8*.5 + .8*.5*.5 + .8*.5*.5*.25
    = 1.45; over 60 passes `Depths` puts each of its 4 terms within 2.5 / 60 of its share, so the
    mean within 4 * 2.5 / 60 = 0.17 of it (independent draws: a standard deviation of 0.13)."""
    profile, passes = (0.8, 0.5, 0.5, 0.25), 60
    reference = np.random.default_rng(1).integers(0, VOCAB, passes * 5 + 10).tolist()
    for oracle in shapes(reference, 0, profile):
        assert abs(np.mean(accepted_depths(oracle, reference, 0, passes)) - 1.45) < 0.17, oracle.name


@pytest.mark.parametrize("profile", [(0.623, 0.657, 0.742, 0.777), (0.3, 0.9, 0.1, 0.99), (1.0, 0.5, 0.0, 1.0)])
def test_depths_reach_each_depth_in_its_share(profile):
    """Over n passes, the share that got d or more right is prod(profile[:d]) to within 2.5 / n,
    at every n and seed (a bound independent draws break at n = 30 more often than not)."""
    reached = np.cumprod(profile)
    for seed in range(20):
        depths = Depths(profile, seed)
        k = np.array([depths() for _ in range(1000)])
        for n in (30, 60, 1000):
            shares = np.array([(k[:n] >= d).mean() for d in range(1, len(profile) + 1)])
            assert np.abs(shares - reached).max() <= 2.5 / n, (seed, n)


def test_oracle_profile_shorter_than_the_depth_stops_there():
    reference = np.random.default_rng(2).integers(0, VOCAB, 200).tolist()
    for oracle in shapes(reference, 0, (1.0, 1.0)):
        assert set(accepted_depths(oracle, reference, 0, 30)) == {2}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("oracle") / "m", seed=0)


@pytest.fixture(scope="module")
def target(target_dir):
    model = load_model(target_dir, "float32")
    return model, tie_free_references(model, 3)


@pytest.mark.parametrize("on_device", [True, False])
def test_oracle_greedy_speculation_equals_plain_greedy(target, on_device):
    """Both shapes through the runtime's loops, the greedy device loop (`draft`) and the host loop
    (`propose`); the reference is `continuation`, checked against the tie-free one too."""
    model, references = target
    for i, (prompt, ref) in enumerate(references):
        full = list(prompt) + continuation(model, prompt, N_TOKENS + 4)
        assert full[len(prompt) : len(prompt) + N_TOKENS] == ref
        for oracle in shapes(full, len(prompt), (0.7, 0.6, 0.5, 0.5), model.args.vocab_size):
            oracle.drafts_on_device = on_device
            got, steps, accepted = run_steps(model, oracle, prompt, N_TOKENS)
            assert got == ref, (oracle.name, i)
            assert accepted > steps // 2, oracle.name  # the drafts were accepted, not only the target's tokens


def test_oracle_propose_refuses_history_off_its_reference():
    oracle = shapes([5, 6, 7, 8, 9], 2, (1.0,))[0]
    with pytest.raises(HybridError, match="token 3 is not"):
        oracle.propose([5, 6, 7, 1], None, None)


@pytest.mark.parametrize("text", ["", "0.5,x", "0.5,1.2", "-0.1", "nan"])
def test_parse_profile_rejects(text):
    with pytest.raises(HybridError, match="--profile takes"):
        parse_profile(text)


def test_parse_profile():
    assert parse_profile("0.6,0.5,0.45,0.4") == (0.6, 0.5, 0.45, 0.4)


TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            vocab_size=512, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None,
            max_position_embeddings=512, rms_norm_eps=1e-5)


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(bench_run.SYNTHETIC, "tiny", TINY)
    return "tiny"


def test_make_synthetic_writes_what_both_runtimes_load(tmp_path, tiny_shape):
    """MLX's random weights in the checkpoint layout: std 0.02, norms 1, untied head kept; the
    same seed gives the same bytes; mlx-lm (the independent loader) and ours give one model."""
    from mlx_lm.utils import load_model as lm_load_model

    d = bench_run.make_synthetic(tiny_shape, tmp_path / "a", seed=3)
    w = mx.load(str(d / "model.safetensors"))
    assert w["lm_head.weight"].shape == (512, 64) and w["model.layers.1.mlp.down_proj.weight"].shape == (64, 96)
    assert abs(float(w["model.embed_tokens.weight"].astype(mx.float32).std()) - 0.02) < 1e-3
    assert bool(mx.all(w["model.norm.weight"] == 1))
    again = mx.load(str(bench_run.make_synthetic(tiny_shape, tmp_path / "b", seed=3) / "model.safetensors"))
    assert all(mx.array_equal(w[k], again[k]) for k in w)
    x = mx.array([[1, 5, 9, 200]])
    ours = load_model(d, "float32")
    theirs = lm_load_model(d)[0]
    theirs.set_dtype(mx.float32)
    np.testing.assert_allclose(np.array(ours(x)), np.array(theirs(x)), atol=1e-4)


def test_large_shapes_are_the_published_configs():
    s = bench_run.SYNTHETIC
    assert {k: s["llama-3-8b"][k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                            "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings")} == dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)
    assert {k: s["llama-3.2-3b"][k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                              "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings")} == dict(
        hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192,
        vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)


def test_speculative_benchmark_oracle_end_to_end(tmp_path, tiny_shape):
    """`benchmarks.speculative --synthetic --oracle` on a tiny shape in bfloat16: oracle rows for
    the tree and the beam beside the peers' rows and none for the untrained heads, every row's
    tokens plain greedy decoding's (the peaked target has no near-tie for bfloat16's rounding to
    break)."""
    from benchmarks import speculative

    out = tmp_path / "results"
    assert speculative.main(["--synthetic", tiny_shape, "--oracle", "--profile", "0.9,0.8,0.7,0.6", "--gen-tokens", "12", "--dtype", "bfloat16",
                             "--prompt-tokens", "8", "--trials", "1", "--draft-layers", "1", "--work-dir", str(tmp_path),
                             "--results", str(out)]) == 0
    result = json.loads(next(out.glob("*.json")).read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert {"mlx-hybrid oracle medusa", "mlx-hybrid oracle redrafter", "mlx-lm oracle draft", "mlx-hybrid plain"} <= set(rows)
    assert "mlx-lm draft" not in rows  # a peaked target's own layers would draft it perfectly
    assert not {"mlx-hybrid medusa", "mlx-hybrid redrafter"} & set(rows)  # and its untrained heads predict it
    assert all(r["same"] for r in rows.values()), rows
    for name in ("mlx-hybrid oracle medusa", "mlx-hybrid oracle redrafter", "mlx-lm oracle draft"):
        assert rows[name]["tokens_per_step"] > 2, name  # 1 + .9 + .72 + .5 + .3 expected


def test_speculative_benchmark_checks_a_measured_tree_limit_end_to_end(tmp_path, tiny_shape, monkeypatch):
    """A tree-attention limit the benchmark measured itself is checked as `hybrid tune` checks
    its own: the first ReDrafter row runs with it and with the other extreme in turns, the faster
    limit is the one the rows run with, and the result file records both runs. (On this CPU the
    two limits run the same path, so either may win.)"""
    from benchmarks import speculative
    from mlx_hybrid import tree_attention

    measured = {"n": [2, 4, 64], "warps": 8, "kernel": [1.0, 1.0, 2.0], "masked": [1.5, 1.0, 1.0], "limit": 4}
    limits = {"row_limits": {}, "tree_attention_limit": 4, "tree_attention_warps": 8, "tree_attention_measured": measured}
    monkeypatch.setattr(speculative, "kernel_limits", lambda *a: dict(limits))
    monkeypatch.setattr(tree_attention, "LIMIT", None)
    out = tmp_path / "results"
    assert speculative.main(["--synthetic", tiny_shape, "--oracle", "--gen-tokens", "8", "--prompt-tokens", "8", "--trials", "1",
                             "--draft-layers", "1", "--work-dir", str(tmp_path), "--results", str(out)]) == 0
    result = json.loads(next(out.glob("*.json")).read_text())
    check = result["tree_attention_check"]
    assert check["method"] == "mlx-hybrid oracle redrafter" and set(check["tps"]) == {"4", "64"}
    assert all(len(v) == 2 and min(v) > 0 for v in check["tps"].values())
    assert result["tree_attention_limit"] == check["limit"] == tree_attention.LIMIT and check["limit"] in (4, 64)
    assert result["tree_attention_measured"] == measured


def test_speculative_benchmark_synthetic_rows(tmp_path, tiny_shape):
    """`benchmarks.speculative --synthetic` without the oracle: a row for each untrained method,
    tied Medusa heads among them, every row's tokens plain greedy decoding's."""
    from benchmarks import speculative

    out = tmp_path / "results"
    assert speculative.main(["--synthetic", tiny_shape, "--gen-tokens", "8", "--prompt-tokens", "8", "--trials", "1",
                             "--draft-layers", "1", "--work-dir", str(tmp_path), "--results", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(next(out.glob("*.json")).read_text())["rows"]}
    assert {"mlx-hybrid medusa", "mlx-hybrid medusa tied", "mlx-hybrid redrafter", "mlx-hybrid draft", "mlx-lm draft"} <= set(rows)
    assert all(r["same"] for r in rows.values()), rows


def test_speculative_plot_is_titled_by_the_model_name_not_its_path(tmp_path, monkeypatch):
    """A committed plot names the model as its result file does, not the directory it ran from."""
    import matplotlib.axes

    from benchmarks import speculative

    titles, set_title = [], matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda ax, text, **kw: titles.append(text) or set_title(ax, text, **kw))
    speculative.plot({"model": "/scratch/run/quality-target", "label": "GPU", "rows": [{"method": "plain", "tps": 9.0}]},
                     tmp_path / "p.png")
    assert titles == ["quality-target, GPU"]
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peaked_target_has_no_near_tie(tmp_path, tiny_shape, monkeypatch):
    """The oracle's target: in float16 and bfloat16 every position's best logit is far above the
    second (more than a third of the best), untied its next token is pi(current), tied the
    current one again."""
    for tied in (False, True):
        monkeypatch.setitem(bench_run.SYNTHETIC, "tiny", dict(TINY, tie_word_embeddings=tied))
        d = bench_run.make_synthetic(tiny_shape, tmp_path / str(tied), seed=0, peaked=True)
        x = mx.array(np.random.default_rng(0).integers(0, 512, 40))
        nexts = []
        for dtype in ("float16", "bfloat16"):
            model = load_model(d, dtype)
            top = mx.sort(model(x[None], model.make_cache())[0].astype(mx.float32), axis=-1)[:, -2:]
            assert bool(mx.all(top[:, 1] - top[:, 0] > top[:, 1] / 3)), (tied, dtype)
            nexts.append(mx.argmax(model(x[None], model.make_cache())[0], axis=-1))
        assert mx.array_equal(nexts[0], nexts[1])
        assert mx.array_equal(nexts[0], x) == tied


@pytest.mark.parametrize("profile", [(1.0,) * 4, (0.0,) * 4, (0.8, 0.6, 0.5, 0.5)])
def test_mlx_lm_oracle_draft_accepts_at_the_profile(target, target_dir, profile):
    """mlx-lm's speculative_generate_step with OracleDraft: the target's greedy tokens, and its
    drafts accepted as the profile says: all 4 a round, none, or on average
    .8 + .8*.6 + .8*.6*.5 + .8*.6*.5*.5 = 1.52 (within 0.35 over a few dozen rounds)."""
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.utils import load_model as lm_load_model

    model, references = target
    lm = lm_load_model(target_dir)[0]
    lm.set_dtype(mx.float32)
    accepted, rounds = 0, 0
    for prompt, ref in references:
        full = list(prompt) + continuation(model, prompt, N_TOKENS + 4)
        got, run = [], []
        for t, _, from_draft in speculative_generate_step(mx.array(prompt), lm, OracleDraft(full, len(prompt), profile, model.args.vocab_size),
                                                          num_draft_tokens=4, max_tokens=N_TOKENS, sampler=lambda x: mx.argmax(x, -1)):
            got.append(int(t))
            run.append(from_draft)
        assert got == ref
        rounds += run.count(False)
        accepted += run.count(True)
    if profile[0] == 1.0:
        assert accepted >= 4 * (rounds - len(references))  # every round but the last (cut at max_tokens) accepts 4
    elif profile[0] == 0.0:
        assert accepted == 0
    else:
        assert abs(accepted / rounds - 1.52) < 0.35


def test_speculative_benchmark_rejects_a_bad_profile(capsys):
    from benchmarks import speculative

    with pytest.raises(SystemExit) as e:
        speculative.main(["--synthetic", "smollm2-135m", "--oracle", "--profile", "0.5,2"])
    assert e.value.code == 2 and "--profile takes comma-separated probabilities in [0, 1], got '0.5,2'" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [(["--tree-limit", "-1"], "--tree-limit takes a node count >= 0, got -1"),
                                           (["--tree-warps", "4"], "--tree-warps goes with --tree-limit")])
def test_speculative_benchmark_rejects_bad_tree_limits(args, message, capsys):
    from benchmarks import speculative

    with pytest.raises(SystemExit) as e:
        speculative.main(["--synthetic", "smollm2-135m", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_speculative_benchmark_tree_limit_replaces_the_measured_one(monkeypatch, tmp_path):
    """--tree-limit and --tree-warps set the tree kernel's limit and simdgroups for the run, where
    a kernel backend would otherwise have them measured (`tune.attention_limit`), and the result
    file records them."""
    from benchmarks import speculative
    from mlx_hybrid import kernels, tree_attention, tune

    monkeypatch.setattr(kernels, "kernel_backend", lambda: "metal")  # measured, were no limit given
    monkeypatch.setattr(tune, "attention_limit", lambda model: pytest.fail("measured despite --tree-limit"))
    monkeypatch.setattr(tree_attention, "LIMIT", None)
    monkeypatch.setattr(tree_attention, "WARPS", 8)
    got = speculative.kernel_limits(tmp_path, None, 64, 4)
    assert (tree_attention.LIMIT, tree_attention.WARPS) == (64, 4)
    assert got == {"row_limits": {}, "tree_attention_limit": 64, "tree_attention_warps": 4}


def test_profile_of_counts_passes_at_each_depth():
    """Passes accepting 0, 1, 2, 2: 3 of 4 accepted one or more, 2 of those 3 two or more."""
    assert profile_of([0, 1, 2, 2]) == (0.75, 0.667)
    assert profile_of([0, 0]) == ()


def test_oracle_at_a_measured_profile_accepts_as_the_passes_did():
    """The oracle run at profile_of(passes) accepts, on average, what those passes accepted."""
    passes = np.random.default_rng(3).choice([0, 1, 2, 3, 4], 1000, p=[0.3, 0.25, 0.2, 0.15, 0.1]).tolist()
    reference = np.random.default_rng(4).integers(0, VOCAB, 6000).tolist()
    for oracle in shapes(reference, 0, profile_of(passes)):
        assert abs(np.mean(accepted_depths(oracle, reference, 0, 1000)) - np.mean(passes)) < 0.12, oracle.name


@pytest.mark.parametrize("args", [["--beam", "2y5"], ["--beam", "0x5"], ["--beam", "2x5", "--method", "medusa"]])
def test_oracle_measure_rejects_a_bad_beam(args, capsys):
    from benchmarks import oracle

    with pytest.raises(SystemExit) as e:
        oracle.main(args)
    assert e.value.code == 2 and "--beam takes WxL with --method redrafter" in capsys.readouterr().err
