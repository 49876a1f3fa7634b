"""Tree machinery of speculative decoding, on hand-built examples, and Llama verification passes
against plain decoding of each candidate path (the independent reference).

Verification: a random float32 Llama/Mistral consumes a prefix, then a candidate tree in one
forward pass; every node's logits must equal those of running the prefix plus the node's path as
one ordinary sequence (atol 1e-4: same model, only the order of summation differs). After
`accept(path)` the cache must continue exactly like a cache that consumed the path.
"""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from tests.helpers import cuda_emulator
from tests.helpers.factories import GPU_BACKENDS, check_placed_against_eager, make_hf_model_dir, took_compiled_pass

from mlx_hybrid.cache import KVCache, commit
from mlx_hybrid.loader import load_model
from mlx_hybrid.speculative.tree import (
    MedusaTree,
    cartesian_paths,
    expected_length,
    greedy_paths,
    pack_beams,
    path_to,
    retrieve_indices,
)
from mlx_hybrid.tree_mask import TreeMask, ancestor_mask, tree_depths

ATOL = 1e-4
# Two levels below the root, uneven: 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}, 4 -> {6}.
PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def test_depths_mask_retrieve():
    assert tree_depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert ancestor_mask(PARENTS).astype(int).tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 0, 1],
    ]
    assert retrieve_indices(PARENTS).tolist() == [[0, 1, 3, -1], [0, 2, 5, -1], [0, 1, 4, 6]]
    tree = TreeMask.from_parents(PARENTS)
    assert np.array(tree.depths).tolist() == [0, 1, 1, 2, 2, 2, 3]
    chain = TreeMask.from_parents([-1, 0, 1, 2])
    assert chain.depths is None and chain.mask is None  # a chain runs as ordinary causal attention
    with pytest.raises(ValueError, match="precede"):
        tree_depths([-1, 2, 0])


def test_medusa_tree_from_paths():
    t = MedusaTree([[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 2]])
    # The all-top-1 chain first, then by depth: node 0 is the root, nodes 1-2 the chain.
    assert t.paths == [[0], [0, 0], [1], [0, 1], [1, 0], [0, 0, 2]]
    assert t.parents == [-1, 0, 1, 0, 1, 3, 2]
    assert t.topk == [2, 2, 3]
    # Flat token layout for k = 3: [root, head0 top-3, head1 top-3, head2 top-3].
    assert t.token_index(3).tolist() == [0, 1, 4, 2, 5, 4, 9]
    tokens = t.tokens(mx.array([9]), mx.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]]))
    assert tokens.tolist() == [9, 10, 20, 11, 21, 20, 32]
    assert np.array(t.tree.depths).tolist() == [0, 1, 2, 1, 2, 2, 3]
    assert t.retrieve.tolist() == [[0, 1, 4, -1], [0, 3, 5, -1], [0, 1, 2, 6]]
    with pytest.raises(ValueError, match="prefix"):
        MedusaTree([[0, 1]])


def test_cartesian_paths():
    paths = cartesian_paths([2, 3])
    assert paths == [[0], [1], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    tree = MedusaTree(paths)
    assert len(tree) == 1 + 2 + 6 and len(tree.retrieve) == 6


def test_greedy_paths():
    acc = [[0.6, 0.2], [0.5, 0.1]]
    # Path products: [0] .6, [0,0] .3, [1] .2, [1,0] .1, [0,1] .06, [1,1] .02.
    assert greedy_paths(acc, 3) == [[0], [0, 0], [1]]
    assert greedy_paths(acc, 10) == [[0], [0, 0], [1], [1, 0], [0, 1], [1, 1]]
    assert expected_length([[0], [0, 0], [1]], acc) == pytest.approx(1 + 0.6 + 0.3 + 0.2)
    # Against brute force over all prefix-closed trees of 4 nodes on 3 heads x 3 ranks.
    rng = np.random.default_rng(0)
    acc = np.sort(rng.uniform(0, 1, (3, 3)), axis=1)[:, ::-1]
    every = cartesian_paths([3, 3, 3])
    best = max(
        expected_length(list(c), acc)
        for c in itertools.combinations(every, 4)
        if all(len(p) == 1 or list(p[:-1]) in [list(q) for q in c] for p in c)
    )
    assert expected_length(greedy_paths(acc, 4), acc) == pytest.approx(best)


def test_pack_beams_hand_example():
    beams = [[5, 1, 2], [5, 1, 3], [5, 4, 2], [5, 1, 2]]
    packed = pack_beams(beams)
    # 6 unique prefixes, then padding up to 4 x 2 + 1 = 9 nodes, each a root of its own.
    assert packed.count.item() == 6
    assert packed.tokens.tolist() == [5, 1, 2, 3, 4, 2, 0, 0, 0]
    assert packed.tree.parents.tolist() == [-1, 0, 1, 1, 0, 4, -1, -1, -1]
    assert packed.tree.depths.tolist() == [0, 1, 2, 2, 1, 2, 0, 0, 0]
    assert packed.node_of.tolist() == [[0, 1, 2], [0, 1, 3], [0, 4, 5], [0, 1, 2]]
    mask = ancestor_mask(packed.tree.parents.tolist())
    assert np.array(packed.tree.mask).tolist() == mask.tolist()


def test_pack_beams_random():
    rng = np.random.default_rng(1)
    for _ in range(50):
        beams = rng.integers(0, 3, (6, 4))
        beams[:, 0] = 7
        p = pack_beams(beams)
        n = p.count.item()
        tokens, parents, node_of = np.array(p.tokens), p.tree.parents.tolist(), np.array(p.node_of)
        assert len(tokens) == 6 * 3 + 1
        prefixes = [tuple(tokens[path_to(parents, t)]) for t in range(n)]
        # Exactly the distinct prefixes of the beams, each once, parents before children.
        assert sorted(prefixes) == sorted({tuple(b[: l + 1]) for b in beams.tolist() for l in range(4)})
        assert all(-1 <= par < t for t, par in enumerate(parents))
        assert parents[n:] == [-1] * (len(tokens) - n) and node_of.max() < n  # padding: unreachable roots
        for b in range(6):
            assert tokens[node_of[b]].tolist() == beams[b].tolist()
            assert [parents[i] for i in node_of[b]] == [-1] + node_of[b, :-1].tolist()
        assert np.array(p.tree.mask).tolist() == ancestor_mask(parents).tolist()
        assert np.array(p.tree.depths).tolist() == tree_depths(parents).tolist()


def beam_cases(seed: int):
    """Beams of several sizes (thread counts below, at and above a warp) with many shared prefixes."""
    rng = np.random.default_rng(seed)
    for width, length in [(1, 2), (4, 5), (6, 4), (8, 5), (3, 7)]:
        for _ in range(3):
            beams = rng.integers(0, 3, (width, length))
            beams[:, 0] = 7
            yield beams


def packed_arrays(p) -> list[np.ndarray]:
    return [np.array(a) for a in (p.tokens, p.tree.parents, p.tree.depths, p.tree.mask, p.node_of, p.count)]


def emulate(monkeypatch, module):
    """`module` runs its kernels' CUDA bodies on the CPU (tests/helpers/cuda_emulator.py), as on a GPU."""
    monkeypatch.setattr(module, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(module, "load_kernel", cuda_emulator.load_kernel)


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_pack_beams_cuda_body_on_the_cpu_matches_reference(monkeypatch):
    from mlx_hybrid.speculative import tree

    emulate(monkeypatch, tree)
    for beams in beam_cases(8):
        got, want = packed_arrays(tree.pack_beams(beams)), packed_arrays(tree.pack_beams_ref(beams))
        for name, g, w in zip(("tokens", "parents", "depths", "mask", "node_of", "count"), got, want):
            assert g.tolist() == w.tolist(), f"{name} for beams {beams.tolist()}"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_pack_beams_kernel_matches_reference(backend, monkeypatch):
    from mlx_hybrid.speculative import tree

    monkeypatch.setattr(tree, "kernel_backend", lambda: backend)
    with mx.stream(mx.gpu):
        for beams in beam_cases(9):
            got, want = packed_arrays(tree.pack_beams(beams)), packed_arrays(tree.pack_beams_ref(beams))
            for g, w in zip(got, want):
                assert g.tolist() == w.tolist(), f"beams {beams.tolist()}"


# (batch, beams so far, vocabulary, k): the first step (one beam), vocabularies not a multiple of
# the 128 threads, k = 16 (the kernels' most), k = beams x vocabulary (everything kept), and
# vocabularies of several 2048-logit chunks, one ending inside its last chunk, one a whole number.
BEAM_STEPS = [(1, 1, 300, 4), (2, 4, 300, 4), (1, 4, 5000, 8), (3, 3, 50, 3), (1, 8, 129, 16), (2, 1, 3, 3),
              (2, 2, 4096, 4)]


def beam_step_case(batch, beams, vocab, seed):
    rng = np.random.default_rng(seed)
    logits = mx.array((3 * rng.standard_normal((batch, beams, vocab))).astype(np.float32))
    scores = mx.array(-np.sort(rng.uniform(0, 5, (batch, beams)), axis=1).astype(np.float32))
    return logits, scores


def check_beam_step(got, want, case):
    for name, g, w in zip(("origin", "token"), got[:2], want[:2]):
        assert np.array(g).astype(np.int64).tolist() == np.array(w).astype(np.int64).tolist(), f"{name}, {case}"
    np.testing.assert_allclose(np.array(got[2]), np.array(want[2]), atol=1e-5, rtol=1e-5, err_msg=f"score, {case}")


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_beam_topk_cuda_body_on_the_cpu_matches_reference(monkeypatch):
    """The beam-step kernels' CUDA bodies (tests/helpers/cuda_emulator.py) against `beam_step_ref`: the
    log-normalizer merged across threads and chunks, each thread's sorted candidates, the
    pairwise merges."""
    from mlx_hybrid.speculative import topk

    emulate(monkeypatch, topk)
    for i, (batch, beams, vocab, k) in enumerate(BEAM_STEPS):
        logits, scores = beam_step_case(batch, beams, vocab, seed=i)
        check_beam_step(topk.beam_step(logits, scores, k), topk.beam_step_ref(logits, scores, k),
                        f"batch {batch}, {beams} beams, vocabulary {vocab}, k {k}")
    # Ties go to the lower beam x vocabulary index: integer logits (equal scores within a beam, kept
    # apart in the merges, in one chunk and across chunks), and ten equal best tokens all in
    # thread 0's stride (kept apart in one thread's list).
    rng = np.random.default_rng(3)
    one_thread = np.zeros((1, 1, 1280), np.float32)
    one_thread[0, 0, ::128] = 2.0
    beams = np.array([[-0.3, -1.7, -2.2]], np.float32)
    for logits, scores in [(rng.integers(0, 3, (1, 3, 2000)).astype(np.float32), beams),
                           (rng.integers(0, 3, (1, 3, 5000)).astype(np.float32), beams),  # across chunks
                           (one_thread, np.zeros((1, 1), np.float32))]:
        origin, token, _ = topk.beam_step(mx.array(logits), mx.array(scores), 8)
        V = logits.shape[2]
        total = (scores[..., None] + logits - np.log(np.exp(logits).sum(-1, keepdims=True))).reshape(-1)
        best = np.argsort(-total, kind="stable")[:8]
        assert origin[0].tolist() == (best // V).tolist() and token[0].tolist() == (best % V).tolist()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_beam_topk_kernel_matches_reference(backend, dtype, monkeypatch):
    from mlx_hybrid.speculative import topk

    monkeypatch.setattr(topk, "kernel_backend", lambda: backend)
    with mx.stream(mx.gpu):
        for i, (batch, beams, vocab, k) in enumerate(BEAM_STEPS):
            logits, scores = beam_step_case(batch, beams, vocab, seed=10 + i)
            logits = logits.astype(dtype)  # both sides read the same rounded logits
            got, want = topk.beam_step(logits, scores, k), topk.beam_step_ref(logits, scores, k)
            check_beam_step(got, want, f"{dtype}, batch {batch}, {beams} beams, vocabulary {vocab}, k {k}")


def kv_rows(a, b):
    return mx.broadcast_to(mx.arange(a, b, dtype=mx.float32)[None, None, :, None], (1, 2, b - a, 4))


def hold_tree(cache, keys, values, pos, bound):
    """What an attention layer does with a tree's keys/values: room at pos (<= bound), then hold."""
    held = cache.tree_buffers(keys.shape[2], pos, bound, keys)
    cache.hold(held[2], keys, values)
    return held


def test_kv_cache_commit_compacts():
    cache = KVCache()
    cache.update_and_fetch(kv_rows(0, 5), kv_rows(100, 105))  # a 5-token prefix
    hold_tree(cache, kv_rows(5, 11), kv_rows(105, 111), mx.array([5], mx.int32), 5)  # 6 candidate nodes
    assert cache.offset == 5
    cache.commit([0, 2, 5])
    assert cache.offset == 8 and cache.held is None
    k, v = cache.update_and_fetch(kv_rows(50, 51), kv_rows(150, 151))
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 10, 50]
    assert v[0, 1, :, 3].tolist() == [100, 101, 102, 103, 104, 105, 107, 110, 150]
    # A path that is a prefix of the nodes is written without a gather.
    hold_tree(cache, kv_rows(60, 63), kv_rows(160, 163), mx.array([9], mx.int32), 9)
    cache.commit([0, 1])
    assert cache.offset == 11 and cache.keys[0, 0, :11, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 10, 50, 60, 61]


def test_kv_cache_device_commits_run_ahead_of_the_host():
    """Two trees queued before the host reads either path: the second is held where the first
    path ended (a device position), the rows its accepting writes past that path's (the rest of
    the first row, the nodes off it) are overwritten, and the first path survives the buffer
    growing past the host's offset."""
    cache = KVCache()
    cache.update_and_fetch(kv_rows(0, 250), kv_rows(1000, 1250))
    pos = mx.array([250], mx.int32)
    hold_tree(cache, kv_rows(300, 306), kv_rows(1300, 1306), pos, 250)
    commit([cache], mx.array([0, 2, 5, 3], mx.int32), mx.array(5))  # path 0, 2, 5 of the row (n = 2)
    pos = pos + 3
    hold_tree(cache, kv_rows(400, 410), kv_rows(1400, 1410), pos, 250 + 4)  # grows the buffer past 256
    commit([cache], mx.array([0, 1, 4, -1], mx.int32), mx.array(4))  # path 0, 1, 4, a short row
    for n in (3, 3):
        cache.advance(n)
    assert cache.offset == 256 and cache.keys.shape[2] == 512
    assert cache.keys[0, 1, 248:256, 0].tolist() == [248, 249, 300, 302, 305, 400, 401, 404]
    assert cache.values[0, 0, 248:256, 2].tolist() == [1248, 1249, 1300, 1302, 1305, 1400, 1401, 1404]


def test_kv_cache_device_commit_keeps_a_whole_chain():
    """Every node on the path (a chain accepted to its end): no row is left for the nodes off it."""
    cache = KVCache()
    cache.update_and_fetch(kv_rows(0, 3), kv_rows(100, 103))
    hold_tree(cache, kv_rows(10, 14), kv_rows(110, 114), mx.array([3], mx.int32), 3)
    commit([cache], mx.array([0, 1, 2, 3], mx.int32), mx.array(3))
    cache.advance(4)
    assert cache.keys[0, 0, :7, 0].tolist() == [0, 1, 2, 10, 11, 12, 13]
    assert cache.values[0, 1, :7, 1].tolist() == [100, 101, 102, 110, 111, 112, 113]


def test_kv_cache_writes_a_kept_path_before_the_next_write():
    """A `DevicePath` commit leaves its write for the buffers' next use; a decode step after it (the
    loop ended, a chat goes on) must find the path in place and its own row after it, and a
    row written after a trim must not be overwritten by the path's late write."""
    cache = KVCache()
    cache.update_and_fetch(kv_rows(0, 3), kv_rows(100, 103))
    hold_tree(cache, kv_rows(10, 14), kv_rows(110, 114), mx.array([3], mx.int32), 3)
    commit([cache], mx.array([0, 2, -1], mx.int32), mx.array(2))  # path 0, 2 (n = 1)
    cache.advance(2)
    k, v = cache.update_and_fetch(kv_rows(50, 51), kv_rows(150, 151))
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 10, 12, 50]
    assert v[0, 1, :, 1].tolist() == [100, 101, 102, 110, 112, 150]
    hold_tree(cache, kv_rows(20, 23), kv_rows(120, 123), mx.array([6], mx.int32), 6)
    commit([cache], mx.array([0, 1, 2], mx.int32), mx.array(2))  # queued, never read
    cache.trim(1)
    k, _ = cache.update_and_fetch(kv_rows(60, 61), kv_rows(160, 161))
    assert k[0, 1, :, 0].tolist() == [0, 1, 2, 10, 12, 60]


def test_kv_cache_sliding_window_keeps_a_path_the_host_has_not_read():
    """Dropping the rows no query can reach (a sliding window) while a path is queued past the
    host's offset keeps that path: passes A, B, C as the greedy loop queues them."""
    cache = KVCache(window=8)
    cache.update_and_fetch(kv_rows(0, 262), kv_rows(1000, 1262))
    pos = mx.array([262], mx.int32)
    for tokens, nodes, host in ((kv_rows(500, 502), [0, 1], 262), (kv_rows(600, 603), [0, 1, 2], 262), (kv_rows(700, 701), [0], 264)):
        if host == 264:
            cache.advance(2)  # the host reads A; B's rows lie past its offset when C drops rows
        hold_tree(cache, tokens, tokens + 1000, pos, host + len(nodes))
        commit([cache], mx.array(nodes, mx.int32), mx.array(nodes[-1]))
        pos = pos + len(nodes)
    cache.advance(3)
    cache.advance(1)
    assert cache.start == 257 and cache.offset == 268
    assert cache.keys[0, 0, : cache.size, 0].tolist() == [257, 258, 259, 260, 261, 500, 501, 600, 601, 602, 700]
    assert cache.values[0, 1, : cache.size, 3].tolist() == [1257, 1258, 1259, 1260, 1261, 1500, 1501, 1600, 1601, 1602, 1700]


def test_tree_mask_sees_the_prefix_and_the_ancestors():
    """The mask over the buffer, the tree's rows from its buffer row on, for a tree placed at a
    device position, with a window."""
    cache = KVCache(window=4)
    cache.update_and_fetch(kv_rows(0, 5), kv_rows(0, 5))
    tree = TreeMask.from_parents([-1, 0, 0, 2]).at(mx.array([5], mx.int32), 5)
    _, _, row = hold_tree(cache, kv_rows(5, 9), kv_rows(5, 9), tree.pos, tree.bound)
    mask = np.array(cache.tree_mask(tree, row, tree.node_depths()))
    want = np.zeros((4, cache.keys.shape[2]), bool)
    for t, depth in enumerate([0, 1, 1, 2]):
        want[t, max(0, 5 + depth - 3) : 5] = True  # rows within the window before the tree
    want[:, 5:9] = ancestor_mask([-1, 0, 0, 2])  # the tree's rows, then nothing
    np.testing.assert_array_equal(mask, want)


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request, tmp_path_factory):
    extra = dict(sliding_window=6) if request.param == "mistral" else {}
    path = make_hf_model_dir(tmp_path_factory.mktemp(request.param), request.param, seed=3, tokenizer=False, **extra)
    return load_model(path, "float32")


def test_tree_pass_equals_plain_decoding(model):
    rng = np.random.default_rng(2)
    vocab = model.args.vocab_size
    prefix = rng.integers(0, vocab, 11).tolist()
    tokens = rng.integers(0, vocab, len(PARENTS)).tolist()
    cache = model.make_cache()
    model(mx.array([prefix]), cache)
    logits, hidden = model(mx.array([tokens]), cache, mask=TreeMask.from_parents(PARENTS), return_hidden=True)
    for node in range(len(PARENTS)):
        path = path_to(PARENTS, node)
        ref_logits, ref_hidden = model(mx.array([prefix + [tokens[t] for t in path]]), return_hidden=True)
        np.testing.assert_allclose(np.array(logits[0, node]), np.array(ref_logits[0, -1]), atol=ATOL, err_msg=f"node {node}")
        np.testing.assert_allclose(np.array(hidden[0, node]), np.array(ref_hidden[0, -1]), atol=ATOL)

    path = [0, 1, 4, 6]
    commit(cache, path)
    assert cache[0].offset == len(prefix) + len(path)
    nxt = rng.integers(0, vocab, 3).tolist()
    got = model(mx.array([nxt]), cache)
    ref = model(mx.array([prefix + [tokens[t] for t in path] + nxt]))
    np.testing.assert_allclose(np.array(got[0]), np.array(ref[0, -3:]), atol=ATOL)


def test_placed_tree_pass_equals_the_eager_pass(model):
    """A tree placed on the device (`TreeMask.at`, as greedy passes run) goes through the compiled
    pass on a cache without a window (Mistral's takes the eager one): the same logits, hidden
    states and held keys as the eager pass (atol 1e-5), over passes that grow the buffer."""
    check_placed_against_eager(model, PARENTS, [0, 1, 4, 6])
    assert took_compiled_pass(model) == (model.args.sliding_window is None)



def test_a_model_that_verified_is_freed_with_its_compiled_pass(tmp_path):
    """The compiled pass's registry holds neither the model nor its pass once the model is gone."""
    import gc
    import weakref

    from mlx_hybrid.loader import load
    from mlx_hybrid.speculative import verify

    model, _ = load(make_hf_model_dir(tmp_path / "m", seed=9))
    check_placed_against_eager(model, PARENTS, [0, 1, 4, 6])
    key = next(k for k in verify._COMPILED if k[0] == id(model))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None and key not in verify._COMPILED


def test_other_kernel_settings_trace_the_pass_apart(tmp_path, monkeypatch):
    """A trace fixes which parts of the pass take the kernels, so the compiled pass is kept per
    kernel settings: the tuner times the tree kernel's path and MLX's in turn, and chat applies a
    profile's limits after loading; settings seen before reuse their trace."""
    from mlx_hybrid import tree_attention
    from mlx_hybrid.loader import load
    from mlx_hybrid.speculative import verify

    model, _ = load(make_hf_model_dir(tmp_path / "m", seed=9))
    traced = lambda: {k[2] for k in verify._COMPILED if k[0] == id(model)}  # noqa: E731
    check_placed_against_eager(model, PARENTS, [0, 1, 4, 6])
    first = traced()
    monkeypatch.setattr(tree_attention, "LIMIT", 0)
    check_placed_against_eager(model, PARENTS, [0, 1, 4, 6])
    assert len(first) == 1 and first < traced() and len(traced()) == 2
    monkeypatch.setattr(tree_attention, "LIMIT", next(iter(first))[0])
    check_placed_against_eager(model, PARENTS, [0, 1, 4, 6])
    assert len(traced()) == 2


def test_chain_pass_then_accept_is_a_trim(model, exact_float32):
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, model.args.vocab_size, 9).tolist()
    chain = rng.integers(0, model.args.vocab_size, 5).tolist()
    cache = model.make_cache()
    model(mx.array([prefix]), cache)
    logits = model(mx.array([chain]), cache, mask=TreeMask.chain(5))
    ref = model(mx.array([prefix + chain]))
    np.testing.assert_allclose(np.array(logits[0]), np.array(ref[0, -5:]), atol=ATOL)
    commit(cache, [0, 1])
    got = model(mx.array([chain[2:3]]), cache)
    np.testing.assert_allclose(np.array(got[0, -1]), np.array(ref[0, len(prefix) + 2]), atol=ATOL)


def greedy_cases(count: int, seed: int = 4):
    """(draft, logits, n, parents): Medusa trees and packed beams whose tokens often match the
    argmax, so that long paths occur. Siblings hold distinct tokens, as both proposers make them."""
    from mlx_hybrid.speculative.accept import Draft

    rng = np.random.default_rng(seed)
    V = 5
    medusa = MedusaTree(cartesian_paths([2, 2, 1]))
    for trial in range(count):
        if trial % 2:
            beams = rng.integers(0, 3, (4, 4))
            beams[:, 0] = 1
            packed = pack_beams(beams)
            n = packed.count.item()
            draft = Draft(packed.tokens, packed.tree, packed.node_of)
            parents = packed.tree.parents[:n].tolist()
        else:
            top = mx.stack([mx.array(rng.permutation(3)) for _ in medusa.topk])  # each head's distinct top-k
            draft = Draft(medusa.tokens(mx.array([1]), top), medusa.tree, mx.array(medusa.retrieve))
            n, parents = len(medusa), medusa.parents
        logits = mx.array(rng.standard_normal((len(draft.tokens), V)).astype(np.float32))
        logits[:, :3] += 4  # the argmax is usually one of the drafted tokens
        yield draft, logits, n, parents


def test_greedy_rows_equals_host_greedy():
    """Device-side greedy acceptance over a tree's rows against the host walk (`accept.greedy`)."""
    from mlx_hybrid.speculative.accept import Candidates, greedy, greedy_rows

    for draft, logits, n, parents in greedy_cases(60):
        path, nxt = greedy(Candidates(np.array(draft.tokens)[:n], parents), logits[:n])
        info, last = greedy_rows(draft, logits)
        info = info.tolist()
        width = (len(info) - 2) // 2
        assert info[0] == len(path) - 1 and info[1] == nxt and last.item() == path[-1]
        assert info[2 : 3 + info[0]] == path
        assert info[3 + width : 3 + width + info[0]] == np.array(draft.tokens)[path[1:]].tolist()


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_greedy_accept_cuda_body_on_the_cpu_matches_reference(monkeypatch):
    """The acceptance kernel's CUDA body (tests/helpers/cuda_emulator.py) against `greedy_rows_ref`: also
    a tree with more rows than the block has threads, where nothing or one row is accepted (ties:
    the first row wins), and a sparse tree whose rows are padded."""
    from mlx_hybrid.speculative import accept
    from mlx_hybrid.speculative.accept import Draft, greedy_rows_kernel, greedy_rows_ref

    emulate(monkeypatch, accept)
    rng = np.random.default_rng(5)
    extra = []
    for tree, top_k, V, boost in [(MedusaTree(cartesian_paths([40, 2])), 40, 50, 45), (MedusaTree(cartesian_paths([40, 2])), 40, 50, 0),
                                  (MedusaTree([[0], [1], [0, 0], [0, 1], [0, 0, 0], [1, 0]]), 3, 5, 0)]:
        for _ in range(3):
            top = mx.stack([mx.array(rng.permutation(top_k)) for _ in tree.topk])
            logits = mx.array(rng.standard_normal((len(tree), V)).astype(np.float32))
            logits[:, boost : boost + 2] += 4  # boost 45: no drafted token is ever the argmax
            extra.append((Draft(tree.tokens(mx.array([1]), top), tree.tree, mx.array(tree.retrieve)), logits))
    for draft, logits in [c[:2] for c in greedy_cases(12, seed=6)] + extra:
        want_info, want_last = greedy_rows_ref(draft.tokens, draft.rows, logits)
        info, last = greedy_rows_kernel(draft.tokens, draft.rows, mx.argmax(logits, axis=-1), backend="cuda")
        assert info.tolist() == want_info.tolist() and last.item() == want_last.item()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_greedy_accept_kernel_matches_reference(backend):
    from mlx_hybrid.speculative.accept import greedy_rows_kernel, greedy_rows_ref

    with mx.stream(mx.gpu):
        for draft, logits, _, _ in greedy_cases(40, seed=7):
            want_info, want_last = greedy_rows_ref(draft.tokens, draft.rows, logits)
            info, last = greedy_rows_kernel(draft.tokens, draft.rows, mx.argmax(logits, axis=-1), backend=backend)
            assert info.tolist() == want_info.tolist() and last.item() == want_last.item()
