"""Speculative verification in recurrent layers: a candidate tree run in one pass against plain
step-by-step decoding along each of its root-to-node paths (the independent reference).

Each mixer (Mamba, Mamba2, DSLA) of a random hybrid first consumes a real prefix, then a tree of
candidate inputs; every node's output must equal the output of decoding its path token by token
from the prefix state, and `commit(path)` must leave exactly the state that decoding the path
leaves. Same float32 model on both sides, only summation order differs: atol 1e-5.
"""

import mlx.core as mx
import numpy as np
import pytest
from tests.helpers import cuda_emulator
from tests.helpers.factories import GPU_BACKENDS, check_placed_against_eager, make_hybrid_dir, took_compiled_pass

from mlx_hybrid.cache import StateCache
from mlx_hybrid.loader import load_model
from mlx_hybrid.models.hybrid import ancestor_index
from mlx_hybrid.speculative.tree import path_to
from mlx_hybrid.tree_mask import TreeMask

ATOL = 1e-5
# Parent-before-child order; two roots (-1: the cached state), a chain longer than the conv
# window (0 -> 1 -> 3 -> 7 -> 8) so that windows are taken from nodes only.
TREE = [-1, 0, 0, 1, 1, 2, -1, 3, 7, 6]


def test_ancestor_index():
    # K = 4: positions 0-2 are the cached window, node t sits at 3 + t.
    idx = np.array(ancestor_index(mx.array([-1, 0, 0, 1, -1]), 4))
    assert idx.tolist() == [[0, 1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 5], [2, 3, 4, 6], [0, 1, 2, 7]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = make_hybrid_dir(tmp_path_factory.mktemp("tree") / "m", ["mamba", "mamba2", "dsla", "attention"], seed=4)
    return load_model(path, "float32")


def device_tree(parents: list[int]) -> TreeMask:
    """The tree as `pack_beams` builds it: parents as an array on the device."""
    host = TreeMask.from_parents(parents)
    return TreeMask(mx.array(parents, mx.int32), host.depths, host.mask)


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["mamba", "mamba2", "dsla"])
def test_tree_pass_equals_decoding_each_path(model, layer, where):
    mixer = model.layers[layer].mixer
    hidden = model.args.hidden_size
    rng = np.random.default_rng(layer)
    prefix = mx.array(rng.standard_normal((2, 5, hidden)).astype(np.float32))
    nodes = mx.array(rng.standard_normal((2, len(TREE), hidden)).astype(np.float32))

    cache = StateCache()
    mixer(prefix, cache=cache)
    start = cache.snapshot()
    out = mixer(nodes, TreeMask.from_parents(TREE) if where == "host" else device_tree(TREE), cache)
    assert cache.snapshot() == start  # a verification pass alone does not advance the cache

    for node in range(len(TREE)):
        path = path_to(TREE, node)
        ref = StateCache()
        ref.restore(start)
        steps = [mixer(nodes[:, t : t + 1], cache=ref) for t in path]
        np.testing.assert_allclose(np.array(out[:, node]), np.array(steps[-1][:, 0]), atol=ATOL, err_msg=f"node {node}")

        accepted = StateCache()
        accepted.restore(start)
        accepted.hold(cache._held)
        accepted.commit(path)
        assert accepted.offset == ref.offset
        for got, want in zip(accepted.arrays, ref.arrays):
            np.testing.assert_allclose(np.array(got), np.array(want), atol=ATOL, err_msg=f"state after node {node}")


def test_hybrid_model_verifies_a_tree(model, exact_float32):
    """The whole hybrid (Mamba, Mamba2, DSLA and attention layers) verifies a candidate tree in
    one pass: each node's logits equal decoding its path token by token, and after accepting a
    path the cache continues exactly as if the path had been decoded."""
    tree_parents = [-1, 0, 0, 1, 1, 2, 3, 6]  # one root: the token the target produced last
    prompt = mx.array([[3, 14, 15, 9, 26, 5]])
    nodes = mx.array([[7, 11, 2, 30, 8, 19, 4, 21]])
    cache = model.make_cache()
    model(prompt, cache)
    logits = model(nodes, cache, mask=TreeMask.from_parents(tree_parents))

    def fresh_after(path):
        ref = model.make_cache()
        model(prompt, ref)
        return ref, [model(nodes[:, t : t + 1], ref) for t in path]

    for node in range(len(tree_parents)):
        _, steps = fresh_after(path_to(tree_parents, node))
        np.testing.assert_allclose(np.array(logits[:, node]), np.array(steps[-1][:, 0]), atol=1e-4, err_msg=f"node {node}")

    path = path_to(tree_parents, 7)  # 0 -> 1 -> 3 -> 6 -> 7: a branch off the first children
    for c in cache:
        c.commit(path)
    ref, _ = fresh_after(path)
    nxt = mx.array([[12]])
    np.testing.assert_allclose(np.array(model(nxt, cache)), np.array(model(nxt, ref)), atol=1e-4)
    assert [c.offset for c in cache] == [c.offset for c in ref]


EMULATED = pytest.param("emulated", marks=pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA bodies cannot be run on the CPU"))


@pytest.mark.parametrize("backend", [EMULATED, *GPU_BACKENDS])
def test_placed_hybrid_pass_equals_the_eager_pass(tmp_path, monkeypatch, backend):
    """A tree placed on the device (`TreeMask.at`, as greedy passes run) through a hybrid of
    attention, Mamba, Mamba2 and DSLA layers takes the compiled pass (recurrent layers on
    `ssm_step` and `dsla_step`): the same logits, hidden states, held keys and per-node states as
    the eager pass, and after `commit` the same caches, over passes that grow the buffer.
    "emulated" runs the kernels' CUDA bodies on the
    CPU, uncompiled (the emulator needs real arrays): the pass's plumbing on any machine."""
    from mlx_hybrid import dsla_step, scan, tree_attention
    from mlx_hybrid.models import hybrid
    from mlx_hybrid.speculative import verify

    model = load_model(make_hybrid_dir(tmp_path / "h", ["attention", "mamba", "mamba2", "dsla", "attention"], seed=6)[0], "float32")
    if backend == "emulated":
        for module in (scan, tree_attention, dsla_step):
            monkeypatch.setattr(module, "load_kernel", cuda_emulator.load_kernel)
        for module in (scan, tree_attention, hybrid, verify):
            monkeypatch.setattr(module, "kernel_backend", lambda: "cuda")
        mx.disable_compile()
    try:
        check_placed_against_eager(model, TREE, path_to(TREE, 8))
        assert took_compiled_pass(model)  # the placed passes took the compiled route
    finally:
        mx.enable_compile()
