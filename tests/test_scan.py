"""Selective scan: the MLX reference against a float64 numpy loop, and the GPU kernels against
the reference.

The kernel parity tests call `selective_scan_kernel` with an explicit backend, so that a
machine without the kernel skips them instead of silently comparing the reference to itself.
"""

import itertools

import mlx.core as mx
import mlx.utils as nn_utils
import numpy as np
import pytest

from tests.helpers import cuda_emulator
from tests.helpers.factories import GPU_BACKENDS

from mlx_hybrid.scan import selective_scan, selective_scan_kernel, selective_scan_ref

# Float32 reference vs float64 loop: O(1) values, float32 rounding over at most 9 tokens.
REF_TOL = dict(atol=1e-5, rtol=1e-5)


def make_inputs(batch, L, channels, groups, n, na, dtype=mx.float32, seed=0):
    """Mamba-like magnitudes: dt in (0.001, 0.1) after softplus, A = -exp(U(0, 2.5))."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, L, channels))
    dt = np.log1p(np.exp(rng.uniform(-7, -2.3, (batch, L, channels))))
    A = -np.exp(rng.uniform(0, 2.5, (na, channels)))
    B = rng.standard_normal((batch, L, groups, n))
    C = rng.standard_normal((batch, L, groups, n))
    D = rng.standard_normal(channels)
    state = rng.standard_normal((batch, n, channels))

    def cast(a, to):
        return mx.array(a.astype(np.float32)).astype(to)

    return (cast(x, dtype), cast(dt, dtype), cast(A, mx.float32), cast(B, dtype), cast(C, dtype),
            cast(D, mx.float32), cast(state, mx.float32))


def numpy_scan(x, dt, A, B, C, D, state, save):
    """The recurrence written out per channel and state row, in float64."""
    x, dt, A, B, C, D, h = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (x, dt, A, B, C, D, state))
    batch, L, channels = x.shape
    n = B.shape[3]
    per_group = channels // B.shape[2]
    h = h.copy()
    y = np.zeros_like(x)
    saved = {}
    for t in range(L):
        for c in range(channels):
            g = c // per_group
            for k in range(n):
                a = A[0 if A.shape[0] == 1 else k, c]
                h[:, k, c] = np.exp(dt[:, t, c] * a) * h[:, k, c] + dt[:, t, c] * B[:, t, g, k] * x[:, t, c]
            y[:, t, c] = (C[:, t, g, :] * h[:, :, c]).sum(axis=1) + D[c] * x[:, t, c]
        saved[t] = h.copy()
    return y, np.stack([saved[t] for t in save], axis=1)


@pytest.mark.parametrize(
    "batch,L,channels,groups,n,na,save",
    [
        (1, 1, 8, 1, 4, 1, None),
        (2, 1, 12, 3, 4, 4, None),
        (2, 5, 8, 1, 6, 6, [0, 4]),
        (1, 9, 12, 4, 3, 1, [2, 5, 8]),
        (3, 4, 6, 2, 5, 1, [3, 1]),  # the reference keeps any order
    ],
)
def test_reference_matches_float64_loop(batch, L, channels, groups, n, na, save):
    args = make_inputs(batch, L, channels, groups, n, na)
    y, states = selective_scan_ref(*args, save=save)
    y64, states64 = numpy_scan(*args, save=[L - 1] if save is None else save)
    np.testing.assert_allclose(np.array(y), y64, **REF_TOL)
    np.testing.assert_allclose(np.array(states), states64, **REF_TOL)


def test_chunks_carry_the_state_and_saves_equal_prefix_scans():
    x, dt, A, B, C, D, state = make_inputs(2, 10, 8, 2, 4, 4, seed=1)
    y, states = selective_scan_ref(x, dt, A, B, C, D, state, save=[3, 9])
    y1, s1 = selective_scan_ref(x[:, :4], dt[:, :4], A, B[:, :4], C[:, :4], D, state)
    y2, s2 = selective_scan_ref(x[:, 4:], dt[:, 4:], A, B[:, 4:], C[:, 4:], D, s1[:, 0])
    # Same float32 operations in the same order: equal up to rounding of fused ops.
    np.testing.assert_allclose(np.array(y), np.concatenate([np.array(y1), np.array(y2)], axis=1), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.array(states[:, 0]), np.array(s1[:, 0]), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.array(states[:, 1]), np.array(s2[:, 0]), atol=1e-6, rtol=1e-6)


# A candidate tree in parent-before-child order: two roots (-1: the cached state), branches at 0 and 1.
TREE = [-1, 0, 0, 1, 1, 2, -1, 6, 3]


def tree_path(parents, t):
    path = [t]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_tree_scan_equals_a_scan_along_each_path():
    """Every node's output and state equal a plain scan over the tokens on its root path."""
    L = len(TREE)
    x, dt, A, B, C, D, state = make_inputs(2, L, 12, 3, 4, 4, seed=3)
    y, states = selective_scan_ref(x, dt, A, B, C, D, state, save=range(L), parents=TREE)
    for t in range(L):
        path = mx.array(tree_path(TREE, t))
        y_p, s_p = selective_scan_ref(x[:, path], dt[:, path], A, B[:, path], C[:, path], D, state)
        np.testing.assert_allclose(np.array(y[:, t]), np.array(y_p[:, -1]), **REF_TOL)
        np.testing.assert_allclose(np.array(states[:, t]), np.array(s_p[:, 0]), **REF_TOL)


def test_dispatch_matches_reference():
    """On the CPU `selective_scan` runs `selective_scan_ref` itself, so this checks the argument
    plumbing; on a GPU with a kernel it is a parity test of the dispatched kernel."""
    args = make_inputs(2, 6, 16, 4, 8, 1, seed=2)
    y, states = selective_scan(*args, save=[2, 5])
    y_ref, states_ref = selective_scan_ref(*args, save=[2, 5])
    np.testing.assert_allclose(np.array(y), np.array(y_ref), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(states), np.array(states_ref), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(save=[3, 1]), "ascending"),
        (dict(save=[2, 2]), "ascending"),
        (dict(save=[6]), r"in \[0, 6\)"),
        (dict(save=[]), "non-empty"),
        (dict(A=mx.zeros((3, 16))), "A must be"),
        (dict(state=mx.zeros((2, 16, 8))), "state must be"),
        (dict(B=mx.zeros((2, 6, 3, 8))), "multiple of groups"),
        (dict(x=mx.zeros((2, 6, 16), dtype=mx.int32)), "float32, float16 or bfloat16"),
        (dict(save=range(6), parents=[-1, 0, 2, 1, 1, 1]), "earlier position"),
        (dict(save=[5], parents=[-1, 0, 1, 1, 1, 1]), "save must be all positions"),
    ],
)
def test_bad_arguments_raise(change, message):
    names = ["x", "dt", "A", "B", "C", "D", "state"]
    kwargs = dict(zip(names, make_inputs(2, 6, 16, 4, 8, 1)), save=[5])
    if "B" in change:
        kwargs["C"] = change["B"]
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        selective_scan(**kwargs)


# ----------------------------------------------------------------------------- GPU parity

# (atol, rtol) for y; saved states are float32 in every case and use the float32 pair. Half
# types are compared with the reference run on the same half inputs, so the only difference
# left is the rounding of y to the half type (up to one ulp: 2**-10 fp16, 2**-7 bf16).
PARITY_TOL = {mx.float32: (1e-4, 1e-4), mx.float16: (1e-2, 1e-2), mx.bfloat16: (2e-2, 2e-2)}
PARITY_SHAPES = list(
    itertools.product([16, 64, 128], [1, 4], ["1", "n"], [1, 7, 300], [1, 3])  # n, groups, NA, L, batch
)
CHANNELS = 300  # not a multiple of the 64-thread threadgroup: the last group is partial


def check_parity(backend, dtype, shapes=PARITY_SHAPES, trees=tuple(itertools.product([16, 64], [1, 3])), device=mx.gpu):
    """The kernel against the reference at shapes (n, groups, NA, L, batch), and over TREE at
    trees (n, batch), on device (the CPU runs the Metal emulator)."""
    atol, rtol = PARITY_TOL[dtype]
    worst_y = worst_s = used = 0.0
    for n, groups, na, L, batch in shapes:
        args = make_inputs(batch, L, CHANNELS, groups, n, 1 if na == "1" else n, dtype, seed=n + L + batch)
        save = [L - 1] if L == 1 else [L // 2, L - 1]
        with mx.stream(device):
            y, states = selective_scan_kernel(*args, save=save, backend=backend)
            y_ref, states_ref = selective_scan_ref(*args, save=save)
        y, y_ref = np.array(y.astype(mx.float32)), np.array(y_ref.astype(mx.float32))
        states, states_ref = np.array(states), np.array(states_ref)
        case = f"{dtype} n={n} groups={groups} NA={na} L={L} batch={batch}"
        np.testing.assert_allclose(y, y_ref, atol=atol, rtol=rtol, err_msg=case)
        np.testing.assert_allclose(states, states_ref, atol=1e-4, rtol=1e-4, err_msg=case)
        worst_y = max(worst_y, float(np.abs(y - y_ref).max()))
        worst_s = max(worst_s, float(np.abs(states - states_ref).max()))
        used = max(used, float((np.abs(y - y_ref) / (atol + rtol * np.abs(y_ref))).max()))
    for n, batch in trees:  # trees: every node's state is saved
        args = make_inputs(batch, len(TREE), CHANNELS, 4, n, n, dtype, seed=n + batch)
        with mx.stream(device):
            y, states = selective_scan_kernel(*args, save=range(len(TREE)), parents=TREE, backend=backend)
            y_ref, states_ref = selective_scan_ref(*args, save=range(len(TREE)), parents=TREE)
        case = f"{dtype} tree n={n} batch={batch}"
        np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(y_ref.astype(mx.float32)),
                                   atol=atol, rtol=rtol, err_msg=case)
        np.testing.assert_allclose(np.array(states), np.array(states_ref), atol=1e-4, rtol=1e-4, err_msg=case)
    print(f"\n{backend} {dtype}: {len(shapes)} shapes, max |y - ref| {worst_y:.3g} "
          f"(at most {used:.0%} of the tolerance), max |state - ref| {worst_s:.3g}")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_matches_reference(backend, dtype):
    check_parity(backend, dtype)


# ----------------------------------------------------------------------------- fused decode step

# kind, n, repeats, batch, hidden. Hidden 72 at n = 8: 72 x 8 kernel threads, not a whole number of
# 128-thread blocks, so the threads past the last channel (which only join the shuffles) are run.
STEP_SHAPES = [(*s, 512) for s in itertools.product(["mamba", "mamba2"], [16, 64], [1, 4], [1, 3])]
STEP_SHAPES += [("mamba", 8, 3, 2, 72), ("mamba2", 8, 3, 1, 72)]


def step_layer(kind, n, repeats, dtype, seed, hidden):
    """A Mamba or Mamba2 mixer with random weights at trained-model magnitudes."""
    from mlx_hybrid.models import hybrid

    heads = max(repeats, hidden // 64)
    args = hybrid.ModelArgs(
        model_type="llama_hybrid", hidden_size=hidden, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=heads, num_key_value_heads=heads // repeats, vocab_size=8, d_state=n,
        d_xb=hidden // repeats, mixer_types=[kind],
    )
    layer = (hybrid.Mamba if kind == "mamba" else hybrid.Mamba2)(args)
    mx.random.seed(seed)
    params = {}
    for name, p in nn_utils.tree_flatten(layer.parameters()):
        scale = 0.3 if name.endswith(("A_log", "D", "bias")) else p.shape[-1] ** -0.5
        params[name] = (mx.random.normal(p.shape) * scale).astype(mx.float32 if name.endswith(hybrid.FP32_PARAMS) else dtype)
    layer.load_weights(list(params.items()))
    return layer


def check_step_parity(backend, dtype, monkeypatch):
    """Six decode steps of each mixer with the fused kernel vs its unfused pure-MLX path.

    Outputs, conv windows and states are compared after every step, so a wrong window shift
    shows from step two on. Half types: the kernel keeps conv outputs in float32 where the
    unfused path rounds them to the half type, so the half-type tolerances apply.
    """
    from mlx_hybrid.cache import StateCache
    from mlx_hybrid.models import hybrid

    atol, rtol = PARITY_TOL[dtype]
    worst = 0.0
    for kind, n, repeats, batch, hidden in STEP_SHAPES:
        layer = step_layer(kind, n, repeats, dtype, n + repeats + batch, hidden)
        u = (mx.random.normal((batch, 6, hidden)) * 0.5).astype(dtype)
        fused, ref = StateCache(), StateCache()
        for t in range(6):
            with mx.stream(mx.gpu):
                monkeypatch.setattr(hybrid, "kernel_backend", lambda: backend)
                y = layer(u[:, t : t + 1], cache=fused)
                monkeypatch.setattr(hybrid, "kernel_backend", lambda: None)
                y_ref = layer(u[:, t : t + 1], cache=ref)
            case = f"{dtype} {kind} n={n} repeats={repeats} batch={batch} step {t}"
            for got, want in zip([y, *fused.arrays], [y_ref, *ref.arrays]):
                got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
                np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=case)
                worst = max(worst, float(np.abs(got - want).max()))
    print(f"\n{backend} ssm_step {dtype}: {len(STEP_SHAPES)} shapes x 6 steps, max |fused - unfused| {worst:.3g}")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_step_kernel_matches_unfused_path(backend, dtype, monkeypatch):
    check_step_parity(backend, dtype, monkeypatch)


# A verification tree: two roots, and a chain (0 -> 1 -> 3 -> 7 -> 8) longer than the conv
# window, so that node windows come from the cache, from nodes and from both.
STEP_TREE = [-1, 0, 0, 1, 1, 2, -1, 3, 7, 6]


def check_tree_step_parity(dtype, kernel, monkeypatch, shapes=STEP_SHAPES):
    """Each mixer with the fused kernel (`kernel()` installs it) against its unfused path: a
    5-token prefix (unfused), a verification tree (outputs, and the window and state after every
    node), accepting a path, then two decode steps from the accepted state."""
    from mlx_hybrid.cache import StateCache
    from mlx_hybrid.models import hybrid
    from mlx_hybrid.tree_mask import TreeMask

    atol, rtol = PARITY_TOL[dtype]
    worst = 0.0
    for kind, n, repeats, batch, hidden in shapes:
        layer = step_layer(kind, n, repeats, dtype, 2 * n + repeats + batch, hidden)
        u = (mx.random.normal((batch, 5 + len(STEP_TREE) + 2, hidden)) * 0.5).astype(dtype)
        fused, ref = StateCache(), StateCache()
        monkeypatch.setattr(hybrid, "kernel_backend", lambda: None)
        layer(u[:, :5], cache=ref)
        fused.arrays, fused.offset = list(ref.arrays), ref.offset
        case = f"{dtype} {kind} n={n} repeats={repeats} batch={batch}"

        def compare(got, want, what):
            nonlocal worst
            got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
            np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"{case}: {what}")
            worst = max(worst, float(np.abs(got - want).max()))

        nodes = u[:, 5 : 5 + len(STEP_TREE)]
        with mx.stream(mx.gpu if kernel.__name__ != "emulated" else mx.cpu):
            kernel()
            y = layer(nodes, TreeMask.from_parents(STEP_TREE), fused)
            monkeypatch.setattr(hybrid, "kernel_backend", lambda: None)
            y_ref = layer(nodes, TreeMask.from_parents(STEP_TREE), ref)
            compare(y, y_ref, "tree outputs")
            for node in range(len(STEP_TREE)):
                for got, want, what in zip(fused._after(node), ref._after(node), ("window", "state")):
                    compare(got, want, f"{what} after node {node}")
            for c in (fused, ref):
                c.commit([0, 1, 3, 7, 8])
            for t in range(5 + len(STEP_TREE), u.shape[1]):
                kernel()
                y = layer(u[:, t : t + 1], cache=fused)
                monkeypatch.setattr(hybrid, "kernel_backend", lambda: None)
                compare(y, layer(u[:, t : t + 1], cache=ref), f"decode step after the accepted path, token {t}")
                for got, want, what in zip(fused.arrays, ref.arrays, ("window", "state")):
                    compare(got, want, f"{what} after token {t}")
    return worst


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_tree_step_kernel_matches_unfused_path(backend, dtype, monkeypatch):
    from mlx_hybrid.models import hybrid

    def installed():
        monkeypatch.setattr(hybrid, "kernel_backend", lambda: backend)

    worst = check_tree_step_parity(dtype, installed, monkeypatch)
    print(f"\n{backend} ssm_step over a tree {dtype}: {len(STEP_SHAPES)} shapes, max |fused - unfused| {worst:.3g}")


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_tree_step_cuda_body_on_the_cpu_matches_unfused_path(monkeypatch):
    """The GPU test above on every machine: the model code calls `ssm_step`, whose CUDA body runs
    on the CPU (tests/helpers/cuda_emulator.py)."""
    from mlx_hybrid import scan
    from mlx_hybrid.models import hybrid

    def emulated():
        monkeypatch.setattr(hybrid, "kernel_backend", lambda: "cuda")
        monkeypatch.setattr(scan, "load_kernel", cuda_emulator.load_kernel)

    shapes = [("mamba", 16, 4, 2, 512), ("mamba2", 16, 4, 2, 512), ("mamba2", 64, 1, 1, 512), *STEP_SHAPES[-2:]]
    check_tree_step_parity(mx.float32, emulated, monkeypatch, shapes)
