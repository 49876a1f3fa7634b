"""`hybrid tune` and speculation profiles: the batched beam search against a plain one, offline
acceptance statistics against real speculative steps, profiles saved, reused and preset, and
one-line errors."""

import io
import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tests.helpers.cli import assert_one_line_error, run
from tests.test_speculative_cli import model_dir  # noqa: F401  (fixture: a target with medusa/, redrafter/, draft/)

from mlx_hybrid import profiles
from mlx_hybrid import tune as tune_module
from mlx_hybrid.decode import generate_step
from mlx_hybrid.generate import generate
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.loader import load
from mlx_hybrid.speculative.calibration import beam_acceptance, greedy_runs
from mlx_hybrid.speculative import load_proposer
from mlx_hybrid.speculative.steps import speculative_steps
from mlx_hybrid.speculative.redrafter import Drafter, DrafterConfig
from mlx_hybrid.tune import verification_cost


def reference_beam_search(drafter, h, root, embed, width, length):
    """One root, numpy bookkeeping, every (beam, token) extension scored: the beams after each step."""
    beams, scores = [[root]], np.zeros(1)
    state = mx.zeros((1, drafter.config.hidden_size))
    out = []
    for _ in range(length - 1):
        state = drafter.step(state, embed(mx.array([b[-1] for b in beams])))
        logp = np.array(nn.log_softmax(drafter.logits(h[None], state), axis=-1), np.float64)
        total = scores[:, None] + logp
        order = np.argsort(-total, axis=None, kind="stable")[:width]
        origin, token = np.unravel_index(order, total.shape)
        beams = [beams[o] + [int(t)] for o, t in zip(origin, token)]
        state, scores = state[mx.array(origin)], total[origin, token]
        out.append(beams)
    return out


def test_batched_beam_search_matches_one_root_at_a_time():
    V, H = 11, 8
    mx.random.seed(0)
    drafter = Drafter(DrafterConfig(H, V, 2 * H, 1, True))
    embed = nn.Embedding(V, H)
    h = mx.random.normal((3, H))
    roots = mx.array([4, 0, 9])
    steps = drafter.beam_search(h, roots, embed, 3, 5)
    assert [s.shape for s in steps] == [(3, 3, l) for l in range(2, 6)]
    for b in range(3):
        want = reference_beam_search(drafter, h[b], int(roots[b]), embed, 3, 5)
        for got, beams in zip(steps, want):
            assert np.array(got[b]).tolist() == beams


def test_offline_acceptance_equals_real_speculative_steps(model_dir):  # noqa: F811
    """The accepted drafts the tuner predicts at a position are what a ReDrafter step rooted there
    accepts when it runs (greedy, beam 3 x 4), at every step of a real run."""
    from mlx_hybrid.profiles import Settings

    model, tokenizer = load(model_dir)
    prompts = [tokenizer.encode(t) for t in ("The quick brown fox", "Once upon a time there")]
    runs = greedy_runs(model, prompts, 30)
    proposer = load_proposer("redrafter", model, model_dir, settings=Settings(3, 4))
    stats = {s.width: s for s in beam_acceptance(proposer.drafter, proposer.embed, runs, [1, 3], 4, batch=7)}
    s = stats[3]
    offline = {pos: (s.accepted[2, j], s.candidates[2, j]) for j, pos in enumerate(s.positions)}
    checked = 0
    for r, prompt in enumerate(prompts):
        gen = speculative_steps(model, proposer, prompt, model.make_cache(), SamplingParams())
        first, _ = next(gen)
        assert first == [runs[r].tokens[len(prompt)]]
        at = len(prompt)
        for new, acc in gen:
            if (r, at) not in offline:
                break
            assert acc == offline[(r, at)][0], (r, at)
            assert new == runs[r].tokens[at + 1 : at + 1 + len(new)]
            checked += 1
            at += len(new)
    assert checked >= 10
    assert np.all(stats[1].accepted <= 3) and np.all(stats[1].candidates[1] == 3)  # width 1: a chain


def test_verification_cost_times_passes_as_the_greedy_loop_queues_them(monkeypatch, model_dir):  # noqa: F811
    """Every timed pass is placed on the device, so that `verify` replays its compiled pass as the
    greedy loop's do, `queued` of them a timing, and keeps an accepted path on the device (a
    `DevicePath` commit: the loop's cache moves) that the host never advances to, so all start at
    the context."""
    from mlx_hybrid.speculative import verify as verify_module

    model, _ = load(model_dir)
    seen, compiled = [], []
    real_verify, real_compiled = tune_module.verify, verify_module._compiled
    monkeypatch.setattr(tune_module, "verify", lambda m, tokens, cache, tree: seen.append((tree.pos is not None, cache[0].offset)) or real_verify(m, tokens, cache, tree))
    monkeypatch.setattr(verify_module, "_compiled", lambda *a: compiled.append(1) or real_compiled(*a))
    commits = []
    real_commit = tune_module.commit
    monkeypatch.setattr(tune_module, "commit", lambda cache, path, last: commits.append(last is not None) or real_commit(cache, path, last))
    cost = verification_cost(model, counts=(1, 4), context=16, reps=1, queued=3)
    assert cost["n"] == [1, 4] and all(t > 0 for t in cost["chain"] + cost["tree"])
    assert seen == [(True, 16)] * (2 * 2 * 2 * 3)  # counts x shapes x (warm-up + reps) x queued
    assert len(compiled) == len(seen)
    # Each pass keeps a path on the device, as the loop's do: its keys and values are written at the next pass.
    assert commits == [True] * len(seen)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_HYBRID_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tune_cli_saves_a_profile_that_generate_uses(monkeypatch, capsys, model_dir, cache_dir):  # noqa: F811
    code, out, err = run(monkeypatch, capsys, "tune", "-m", model_dir, "--new-tokens", 10, "--max-width", 2,
                         "--max-length", 3)
    assert code == 0, err
    path = profiles.profile_path(model_dir)
    profile = json.loads(path.read_text())
    assert f"profile {path}" in out.replace("\n", "")
    assert set(profile["best"]) == {"redrafter", "medusa"}
    grid = {(r["beam_width"], r["beam_length"]) for r in profile["redrafter"]}
    assert grid == {(1, 2), (1, 3), (2, 2), (2, 3)}
    assert all(r["tokens_per_step"] >= 1 for r in profile["redrafter"] + profile["medusa"])
    assert profile["measured"][0]["method"] == "plain" and profile["plain_tps"] > 0
    best = profile["best"]["redrafter"]
    assert (best["beam_width"], best["beam_length"]) in grid | {(4, 4)}  # validated or the drafter's default

    # The next run finds it: generate without --speculative follows the profile's choice.
    profile["choice"] = "redrafter"
    profile["best"]["redrafter"] |= {"beam_width": 2, "beam_length": 3}
    path.write_text(json.dumps(profile))
    model, tokenizer = load(model_dir)
    want = generate(model, tokenizer, "The quick brown fox", max_tokens=12)
    code, out, err = run(monkeypatch, capsys, "generate", "-m", model_dir, "-p", "The quick brown fox", "--raw",
                         "--max-tokens", 12, "-v")
    assert code == 0, err
    assert out == want + "\n"
    assert f"speculation: redrafter, beam 2x3 (tuned profile {path})" in err.replace("\n", "")
    assert "tok/step" in err
    # Another model (other heads) does not take this model's profile.
    assert profiles.load_profile(model_dir / "draft") is None


def test_presets_by_chip(monkeypatch, model_dir, cache_dir):  # noqa: F811
    monkeypatch.setattr(profiles, "device_name", lambda: "Apple M2 Ultra (gpu)")
    s = profiles.settings_for("redrafter", model_dir)
    assert (s.beam_width, s.beam_length, s.source) == (3, 4, "M2 Ultra preset")
    assert profiles.settings_for("medusa", model_dir).tree_size == 9
    monkeypatch.setattr(profiles, "device_name", lambda: "Apple M1 Max (gpu)")
    assert profiles.settings_for("redrafter", model_dir).beam_width == 1
    monkeypatch.setattr(profiles, "device_name", lambda: "Apple M1 (gpu)")
    assert profiles.settings_for("redrafter", model_dir).source == "M1 preset"
    monkeypatch.setattr(profiles, "device_name", lambda: "AMD EPYC (cpu)")
    s = profiles.settings_for("redrafter", model_dir)
    assert s.beam_width is None and "hybrid tune" in s.source
    # A preset Medusa tree of 9 candidates runs and stays exact.
    model, tokenizer = load(model_dir)
    medusa = load_proposer("medusa", model, model_dir, settings=profiles.Settings(tree_size=9))
    assert len(medusa.tree) == 10
    prompt = tokenizer.encode("The quick brown fox")
    want = [t for t, _ in generate_step(mx.array(prompt), model, model.make_cache(), lambda x: mx.argmax(x, -1), max_tokens=12)]
    got = []
    for new, _ in speculative_steps(model, medusa, prompt, model.make_cache(), SamplingParams()):
        got += new
        if len(got) >= 12:
            break
    assert got[:12] == want


def test_tune_bad_input(monkeypatch, capsys, model_dir, tmp_path, cache_dir):  # noqa: F811
    code, _, err = run(monkeypatch, capsys, "tune", "-m", model_dir, "--method", "eagle")
    assert_one_line_error(code, err, "--method must be")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err = run(monkeypatch, capsys, "tune", "-m", model_dir, "--prompts", empty)
    assert_one_line_error(code, err, "has no prompts")
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("medusa", "redrafter", "draft"))
    code, _, err = run(monkeypatch, capsys, "tune", "-m", bare)
    assert_one_line_error(code, err, "nothing to tune")
    code, _, err = run(monkeypatch, capsys, "tune", "-m", model_dir, "--new-tokens", 3, "--max-length", 5)
    assert_one_line_error(code, err, "--new-tokens")


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def on_cpu(monkeypatch):
    """The default device reads as the CPU, where speculation cannot win (on any test machine)."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))


def test_tune_on_a_cpu_says_so_and_asks_on_a_terminal(monkeypatch, capsys, model_dir, cache_dir, on_cpu):  # noqa: F811
    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    code, out, err = run(monkeypatch, capsys, "tune", "-m", model_dir)
    assert code == 0 and out == ""
    assert "note: on a CPU" in err and "continue? [y/N]" in err
    assert not profiles.profile_path(model_dir).exists()


def interrupt_after_the_first_stage(monkeypatch):
    real = tune_module.tune

    def tune(*args, progress, **kwargs):
        def report(stage, done, total):
            if stage != "verification cost":
                raise KeyboardInterrupt
            progress(stage, done, total)

        return real(*args, progress=report, **kwargs)

    monkeypatch.setattr(tune_module, "tune", tune)


def test_interrupted_tune_keeps_the_finished_stages(monkeypatch, capsys, model_dir, cache_dir, on_cpu):  # noqa: F811
    interrupt_after_the_first_stage(monkeypatch)
    # Not a terminal: the CPU note, then tuning without a question.
    code, _, err = run(monkeypatch, capsys, "tune", "-m", model_dir, "--new-tokens", 10, stdin="")
    assert code == 130
    path = profiles.profile_path(model_dir)
    assert "note: on a CPU" in err and "continue?" not in err
    assert f"interrupted; the profile keeps the finished stages (verification cost): {path}" in err.replace("\n", "")
    saved = json.loads(path.read_text())
    assert saved["stages"] == ["verification cost"]
    assert saved["verification_seconds"]["n"] == list(tune_module.COUNTS)
    assert len(saved["verification_seconds"]["chain"]) == len(tune_module.COUNTS)
    assert profiles.load_profile(model_dir) == (saved, path)
    assert list(path.parent.glob("*.tmp")) == []

    # A complete profile from an earlier run is worth more than an interrupted one's stages.
    complete = {"choice": None, "best": {}, "stages": tune_module.stages(["redrafter", "medusa"])}
    path.write_text(json.dumps(complete))
    code, _, err = run(monkeypatch, capsys, "tune", "-m", model_dir, "--new-tokens", 10, "--yes")
    assert code == 130 and "the complete profile from an earlier run stays" in err.replace("\n", "")
    assert json.loads(path.read_text()) == complete


def test_row_limits_per_projection_shape_and_in_the_profile(monkeypatch, model_dir, cache_dir):  # noqa: F811
    """On CUDA `tune` measures the row kernel against the matmul for each projection shape (here a
    kernel that returns zeros stands in: the bookkeeping is under test, not the speed), and a
    profile's limits come back as linear.LIMITS keys; malformed ones make the profile ignored."""
    from mlx_hybrid.models import linear

    monkeypatch.setattr(linear, "load_kernel", lambda *a, **k: lambda **kw: [mx.zeros(kw["output_shapes"][0])])
    model, _ = load(model_dir)
    limits = tune_module.row_limits(model, counts=(1, 2, 4), reps=1, chain=2)
    assert set(limits) == {f"{n}x{k}" for n, k in tune_module.projection_layers(model)}
    assert set(tune_module.projection_layers(model)) >= {tuple(m.weight.shape) for _, m in model.named_modules()
                                                          if type(m) is linear.Linear}
    assert all(r["n"] == [2, 4] and r["limit"] in (0, 2, 4) for r in limits.values())
    from mlx_hybrid.models import qlinear  # a quantized model: its layers' qrow_matmul against MLX's quantized product

    monkeypatch.setattr(qlinear, "load_kernel", lambda *a, **k: lambda **kw: [mx.zeros(kw["output_shapes"][0])])
    nn.quantize(model, 32, 4)
    quantized = [m for _, m in model.named_modules() if type(m) is qlinear.QuantizedLinear]
    assert quantized and set(tune_module.row_limits(model, counts=(2,), reps=1, chain=1)) >= {
        f"{m.weight.shape[0]}x{m.scales.shape[1] * 32}" for m in quantized}
    path = profiles.profile_path(model_dir)
    profile = {"best": {}, "choice": None, "row_limits": {"96x32": {"limit": 8}}}
    profiles.save_profile(profile, path)
    assert profiles.kernel_limits(model_dir) == ({(96, 32): 8}, None, 8)
    profiles.save_profile(profile | {"row_limits": {"96x32": {"limit": 1000}}}, path)
    with pytest.warns(profiles.ProfileWarning, match="row_limits needs NxK"):
        assert profiles.kernel_limits(model_dir) == ({}, None, 8)


def test_attention_limit_keeps_the_kernel_up_to_where_masked_attention_wins(monkeypatch, model_dir, cache_dir):  # noqa: F811
    """`attention_limit` times each tree size with the kernel allowed (LIMIT None) at each of its
    warps choices and refused (LIMIT 0), restores LIMIT and WARPS, keeps the warps that cost least
    in all, and the last size up to which the kernel at them never lost (here stand-in passes: the
    kernel's cost n at 8 warps, n - 1 at 4 from 4 nodes on, masked attention's 4.5, so 4 warps
    win, up to 4 nodes); the kernel then takes no tree past the limit, and a profile's limit and
    warps come back with the rows'."""
    from mlx_hybrid import tree_attention

    order = []

    def fake_passes(model, context=256, queued=None):
        def timed(n, shape):
            order.append((n, tree_attention.WARPS, tree_attention.LIMIT))
            if tree_attention.LIMIT == 0:
                return 4.5
            return float(n - (tree_attention.WARPS == 4 and n >= 4))

        return timed

    monkeypatch.setattr(tune_module, "queued_passes", fake_passes)
    monkeypatch.setattr(tree_attention, "LIMIT", 7)
    got = tune_module.attention_limit(None, counts=(1, 2, 4, 8, 16), reps=2)
    assert got == {"n": [2, 4, 8, 16], "by_warps": {"8": [2.0, 4.0, 8.0, 16.0], "4": [2.0, 3.0, 7.0, 15.0]}, "warps": 4,
                   "kernel": [2.0, 3.0, 7.0, 15.0], "masked": [4.5] * 4, "limit": 4}
    # The paths take turns, timing by timing (a warm-up round, then reps), not one path's sizes after another's.
    assert order == [(n, *run) for n in (2, 4, 8, 16) for _ in range(3) for run in ((8, None), (4, None), (8, 0))]
    assert tree_attention.LIMIT == 7 and tree_attention.WARPS == 8
    monkeypatch.setattr(tree_attention, "kernel_backend", lambda: "cuda")
    keys = mx.zeros((1, 2, 40, 16), mx.float16)
    for nodes, want in ((7, "cuda"), (8, None)):
        assert tree_attention.tree_kernel(mx.zeros((1, 6, nodes, 16), mx.float16), keys, None) == want
    path = profiles.profile_path(model_dir)
    profile = {"best": {}, "choice": None, "tree_attention": {"limit": 12, "warps": 4}, "row_limits": {"96x32": {"limit": 8}}}
    profiles.save_profile(profile, path)
    assert profiles.kernel_limits(model_dir) == ({(96, 32): 8}, 12, 4)
    from mlx_hybrid.models import linear

    monkeypatch.setattr(linear, "LIMITS", {})
    monkeypatch.setattr(tree_attention, "WARPS", 8)
    profiles.use_kernel_limits(model_dir)  # what chat does before it speculates
    assert tree_attention.LIMIT == 12 and tree_attention.WARPS == 4 and linear.LIMITS == {(96, 32): 8}
    assert tree_attention.launch(32, 8, 17, 128, mx.bfloat16)[2] == 4 * 32  # threads a threadgroup
    profile.pop("row_limits")
    for bad in ({"limit": -1}, {"limit": 12, "warps": 3}):
        profiles.save_profile(profile | {"tree_attention": bad}, path)
        with pytest.warns(profiles.ProfileWarning, match="tree_attention needs"):
            assert profiles.kernel_limits(model_dir) == ({}, None, 8)


def test_check_attention_limit_runs_both_extremes_in_turns_and_keeps_the_faster(monkeypatch):
    """The measured limit and the other extreme (the kernel for every tree, or for none where the
    limit already covers every size) take turns, each run with `tree_attention.LIMIT` set to it,
    and the one with the higher median stays set; on a tie the measured limit stays."""
    from mlx_hybrid import tree_attention

    monkeypatch.setattr(tree_attention, "LIMIT", None)
    calls = []

    def measure(speeds):
        return lambda: calls.append(tree_attention.LIMIT) or speeds[tree_attention.LIMIT].pop(0)

    got = tune_module.check_attention_limit(4, 64, measure({4: [10.0, 11.0], 64: [12.0, 11.5]}))
    assert calls == [4, 64, 4, 64]
    assert got == {"limit": 64, "tps": {"4": [10.0, 11.0], "64": [12.0, 11.5]}} and tree_attention.LIMIT == 64
    calls.clear()
    got = tune_module.check_attention_limit(64, 64, measure({64: [10.0, 10.0], 0: [10.0, 9.0]}))
    assert calls == [64, 0, 64, 0] and got["limit"] == 64 == tree_attention.LIMIT
    assert tune_module.check_attention_limit(64, 64, measure({64: [9.0, 9.0], 0: [10.0, 9.5]}))["limit"] == 0 == tree_attention.LIMIT


def test_tune_checks_the_attention_limit_end_to_end_on_its_choice(monkeypatch, capsys, model_dir, cache_dir):  # noqa: F811
    """Where a tree-attention kernel runs, `hybrid tune` runs its fastest setting end to end at the
    measured limit and at the other extreme, and the profile keeps the faster (here a stand-in
    end-to-end speed that grows with the limit, so the kernel for every tree wins)."""
    from mlx_hybrid import tree_attention

    runs = []

    def fake_measure(model, model_dir, method, settings, ids, new_tokens):
        runs.append((method, tree_attention.LIMIT))
        return 100.0 if method is None else 120.0 + (tree_attention.LIMIT or 0)

    monkeypatch.setattr(tune_module, "kernel_backend", lambda: "metal")  # the tune's stages; the passes stay on the CPU's paths
    monkeypatch.setattr(tune_module, "attention_limit", lambda model, counts, progress=None: {
        "n": [2, 4, 64], "warps": 8, "kernel": [1.0, 1.0, 2.0], "masked": [1.5, 1.0, 1.0], "limit": 4})
    monkeypatch.setattr(tune_module, "verification_cost", lambda model, counts, progress=None: {"n": [1, 64], "chain": [1.0, 2.0], "tree": [1.0, 2.0]})
    monkeypatch.setattr(tune_module, "_measure", fake_measure)
    monkeypatch.setattr(tree_attention, "LIMIT", None)
    code, out, err = run(monkeypatch, capsys, "tune", "-m", model_dir, "--new-tokens", 6, "--max-width", 1, "--max-length", 2, "--yes")
    assert code == 0, err
    profile = json.loads(profiles.profile_path(model_dir).read_text())
    assert profile["choice"] in ("redrafter", "medusa")
    assert profile["tree_attention"]["end_to_end"] == {"limit": 64, "tps": {"4": [124.0, 124.0], "64": [184.0, 184.0]}}
    assert profile["tree_attention"]["limit"] == 64 and profile["stages"][-1] == "attention check"
    assert runs[-4:] == [(profile["choice"], 4), (profile["choice"], 64)] * 2
    assert profiles.kernel_limits(model_dir) == ({}, 64, 8)  # what chat then runs
    said = "tree-attention kernel: trees of up to 64 nodes (tok/s with it taking trees of up to 4 nodes 124.0, trees of up to 64 nodes 184.0)"
    assert said in " ".join(out.split())  # rich wraps lines at spaces
