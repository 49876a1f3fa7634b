"""DSLA-Serve checkpoints: one in their layout (tests/helpers/dsla_serve_reference.py writes it as their
run_distill.py saves) converts with `hybrid convert`, and the runtime matches their layer, written
independently from their code, on the same weights: prefill, chunked prefill, step decode and
tree verification, in float32; and adaptive conversion runs their DSLA layers in place of
attention as their server's `convert_transformer_to_dsla` does.

Tolerance: |runtime - reference| <= 1e-4 x the largest |logit| (logits up to 2.6; measured <= 2.1e-6 x).
The reference runs their GLA recurrence token by token, the runtime its chunked form (a step's
single token, a tree's nodes in parallel), so only summation order differs. Dropping any part of
their form (the softmax mix, the full-rank gates, the absent output norm) moves the logits by
far more (test_form_moves_the_logits); the clamp at -50 moves them by less than float32 rounding
(a gate of exp(-50) is 0 to float32 beside k v) and is checked only for running.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mlx_hybrid import dsla_step
from mlx_hybrid.cache import StateCache
from mlx_hybrid.loader import load, load_model
from mlx_hybrid.models import hybrid
from mlx_hybrid.speculative.tree import path_to
from mlx_hybrid.tree_mask import TreeMask
from tests.helpers import cuda_emulator
from tests.helpers import dsla_serve_reference as ref
from tests.helpers.cli import assert_one_line_error, run
from tests.helpers.factories import GPU_BACKENDS, make_tokenizer

REL_TOL = 1e-4
DSLA_LIST = [1, 3]  # layers 0 and 2 keep attention
PROMPT = np.random.default_rng(0).integers(0, 300, 150).tolist()  # crosses the runtime's 64-token chunks
SCHEDULES = {"prefill+decode": [100] + [1] * 50, "chunked": [5, 2, 1, 70, 3, 9, 60]}
TREE = [-1, 0, 0, 1, 1, 2, -1, 3, 7, 6]


def assert_close(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    diff = np.abs(got - want).max()
    assert diff <= REL_TOL * np.abs(want).max(), f"{what}: max |diff| {diff:.3g} vs largest logit {np.abs(want).max():.3g}"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(their checkpoint, its conversion, the base model's directory, their model, the base model)."""
    root = tmp_path_factory.mktemp("dsla_serve")
    tok = make_tokenizer(root / "tokenizer")
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    base = ref.base_model(1, **ids)
    base_dir = root / "base"
    base.save_pretrained(base_dir)
    make_tokenizer(base_dir)
    theirs = ref.convert_layers(ref.base_model(1, **ids), DSLA_LIST, seed=2)
    src = ref.save_checkpoint(theirs, root / "dsla-serve")
    assert len(list(src.glob("*.safetensors"))) > 1  # sharded with an index, as theirs are
    return src, root / "converted", base_dir, theirs, base


@pytest.fixture(scope="module")
def converted(built, tmp_path_factory):
    """The converted model (float32) and the reference's logits on PROMPT."""
    src, dst, _, theirs, _ = built
    from mlx_hybrid.convert.hf import convert

    convert(src, dst)
    return load_model(dst, "float32"), ref.logits(theirs, PROMPT)


def test_cli_converts_and_verifies(monkeypatch, capsys, built, tmp_path):
    src = built[0]
    code, out, _ = run(monkeypatch, capsys, "convert", src, tmp_path / "out", "--verify")
    assert code == 0, out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "llama_hybrid" and config["mixer_types"] == ["attention", "dsla", "attention", "dsla"]
    assert (config["gate_rank"], config["gate_clamp"], config["dsla_mix"], config["dsla_o_norm"], config["dsla_kv_heads"]) == (
        0, -50.0, "softmax", False, 4)
    assert "dsla_list" not in config and "kernel_hidden_size" not in config
    weights = mx.load(str(next((tmp_path / "out").glob("*.safetensors"))))
    assert not [k for k in weights if k.startswith(("model.layers.1.self_attn.", "model.layers.3.self_attn."))]
    diff = float(out.split("largest |logit difference| ")[1].split(",")[0])
    assert diff < 1e-4 and "top-1 agreement 100.0%" in out


def test_prefill_matches_their_layer(converted, exact_float32):
    model, expected = converted
    assert_close(model(mx.array([PROMPT]))[0], expected, "prefill")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_chunks_and_decode_steps_match_their_layer(converted, schedule, exact_float32):
    model, expected = converted
    cache, done = model.make_cache(), 0
    for n in SCHEDULES[schedule]:
        assert_close(model(mx.array([PROMPT[done : done + n]]), cache)[0], expected[done : done + n], f"tokens {done}..{done + n}")
        done += n
    assert done == len(PROMPT) and isinstance(cache[1], StateCache)


@pytest.mark.parametrize("kernel", ["unfused", "emulated", *GPU_BACKENDS])
def test_tree_verification_matches_their_layer(built, converted, kernel, monkeypatch, request):
    """A candidate tree after a prompt: each node's logits are their model's on the prompt and the
    node's path; after accepting a path, the next token's are theirs on prompt + path + token.
    "emulated" runs the DSLA layers' tree pass and decode step on `dsla_step`'s CUDA body on the
    CPU, "cuda" and "metal" on the GPU's kernel (float32 matmuls: conftest.py turns TF32 off)."""
    if kernel in ("unfused", "emulated"):
        request.getfixturevalue("exact_float32")
    if kernel == "emulated":
        if not cuda_emulator.AVAILABLE:
            pytest.skip("g++ not found: the CUDA body cannot be run on the CPU")
        monkeypatch.setattr(hybrid, "kernel_backend", lambda: "cuda")
        monkeypatch.setattr(dsla_step, "load_kernel", cuda_emulator.load_kernel)
    model, _ = converted
    theirs = built[3]
    prompt, nodes = PROMPT[:30], PROMPT[100 : 100 + len(TREE)]
    cache = model.make_cache()
    model(mx.array([prompt]), cache)
    logits = np.array(model(mx.array([nodes]), cache, mask=TreeMask.from_parents(TREE))[0])
    for node in range(len(TREE)):
        path = [nodes[t] for t in path_to(TREE, node)]
        assert_close(logits[node], ref.logits(theirs, prompt + path)[-1], f"node {node}")
    accepted = path_to(TREE, 8)
    for c in cache:
        c.commit(accepted)
    following = prompt + [nodes[t] for t in accepted] + [PROMPT[140]]
    assert_close(model(mx.array([following[-1:]]), cache)[0, -1], ref.logits(theirs, following)[-1], "after the accepted path")


def test_form_moves_the_logits(built, converted):
    """The parity tests pin DSLA-Serve's form only if each of its parts changes the logits far beyond tolerance."""
    model, expected = converted
    scale = np.abs(expected).max()
    layer = model.layers[1].dsla
    alpha = layer.alpha_list
    layer.alpha_list = mx.array([0.0, 0.0])
    try:
        assert np.abs(np.array(model(mx.array([PROMPT]))[0]) - expected).max() > 100 * REL_TOL * scale
    finally:
        layer.alpha_list = alpha
    theirs = built[3]
    with torch.no_grad():  # the full-rank gates' weights matter ...
        gk = theirs.model.layers[1].self_attn.gk_proj.weight
        kept = gk.clone()
        gk.mul_(0.5)
        try:
            assert np.abs(ref.logits(theirs, PROMPT) - expected).max() > 100 * REL_TOL * scale
        finally:
            gk.copy_(kept)
    o = np.array(model(mx.array([PROMPT]))[0])  # ... and an RMSNorm per head after the mix would not be theirs
    layer.o_norm = hybrid.nn.RMSNorm(layer.head_dim)
    try:
        assert np.abs(np.array(model(mx.array([PROMPT]))[0]) - o).max() > 100 * REL_TOL * scale
    finally:
        del layer["o_norm"]


def test_adaptive_conversion_runs_their_layers(built, tmp_path, exact_float32):
    """Their serving setup: the base model, with layers converted to their DSLA layers on demand
    (server.py's `convert_transformer_to_dsla`, least sensitive first). An adaptive directory of
    the base model's weights and the converted DSLA layers runs, with k layers converted, as the
    base model with those k layers replaced by theirs."""
    import copy

    src, dst, base_dir, theirs, base = built
    from mlx_hybrid.convert.hf import convert

    if not dst.exists():
        convert(src, dst)
    order = [3, 1]
    adaptive = shutil.copytree(base_dir, tmp_path / "adaptive", ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config.update(mixer_types=["attention"] * 4, dsla_conversion={"order": order, "max_layers": 2})
    (adaptive / "config.json").write_text(json.dumps(config))
    dsla = {k: v for f in dst.glob("*.safetensors") for k, v in mx.load(str(f)).items() if ".dsla." in k}
    state = {k: v.contiguous() for k, v in base.state_dict().items()}
    save_file(state, str(adaptive / "model.safetensors"))
    mx.save_safetensors(str(adaptive / "dsla.safetensors"), dsla)
    model, _ = load(adaptive, "float32")
    ids = PROMPT[:48]
    for k in range(3):
        expected = copy.deepcopy(base)
        for i in order[:k]:
            expected.model.layers[i].self_attn = theirs.model.layers[i].self_attn
        assert_close(model(mx.array([ids]), model.make_cache(order[:k]))[0], ref.logits(expected, ids), f"{k} layers as DSLA")


@pytest.mark.parametrize(
    "edit,fragment",
    [
        ({"kernel_hidden_size": 8}, "kernel_hidden_size 8 is not the head size 16"),
        ({"dsla_list": [1, 7]}, "dsla_list must list layer indices in [0, 4)"),
        ({"attention_bias": True}, "no q/k/v/o biases"),
    ],
)
def test_bad_checkpoints_fail_in_one_line(monkeypatch, capsys, built, tmp_path, edit, fragment):
    src = shutil.copytree(built[0], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | edit))
    code, _, err = run(monkeypatch, capsys, "convert", src, tmp_path / "out")
    assert_one_line_error(code, err, fragment)
    assert not (tmp_path / "out").exists()
