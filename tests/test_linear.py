"""mlx_hybrid.models.linear: the row kernel's CUDA body (run on the CPU by tests/helpers/cuda_emulator.py)
against float64 numpy, the Linear's kernel path against nn.Linear, and on a GPU the kernels
against the reference; on MLX's CUDA backend each row's product is the one a single-row call (a
decode step) computes, bit for bit (without a bias: a single row with one goes to cuBLAS's fused
bias instead)."""

from importlib import resources

from tests.helpers import cuda_emulator
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tests.helpers.factories import GPU_BACKENDS, make_hf_model_dir

from mlx_hybrid.decode import prefill
from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.loader import load_model
from mlx_hybrid.models import linear
from mlx_hybrid.tree_mask import TreeMask

# (rows, in, out): one row, the 4/2/1 elements-a-load cases (128 | K, 64 | K, neither), a tree's
# rows, the most rows, and outputs that leave a threadgroup's last weight rows empty.
SHAPES = [(1, 128, 16), (5, 192, 40), (17, 96, 33), (25, 256, 9), (linear.ROWS, 64, 20)]


def _layers(bias: bool, dtype=mx.float32, dims=(96, 40)):
    mx.random.seed(0)
    ref = nn.Linear(*dims, bias=bias)
    ref.set_dtype(dtype)
    rows = linear.Linear(*dims, bias=bias)
    rows.update(ref.parameters())
    return ref, rows


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_cuda_body_on_the_cpu_matches_numpy():
    body = resources.files("mlx_hybrid.metal_kernels").joinpath("row_matmul.cu").read_text()
    rng = np.random.default_rng(0)
    for M, K, N in SHAPES:
        x = rng.standard_normal((M, K)).astype(np.float32)
        w = rng.standard_normal((N, K)).astype(np.float32)
        calls = []
        fake = lambda *a, **k: calls.append(k) or [mx.zeros(k["output_shapes"][0])]  # noqa: E731
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(linear, "load_kernel", lambda *a, **k: fake)
            linear.row_matmul(mx.array(x), mx.array(w), backend="cuda")
        launch = calls[0]
        threads = launch["threadgroup"][0]
        (got,) = cuda_emulator.run(
            body,
            inputs=[(name, np.array(a), None) for name, a in zip(("x", "w", "nw", "r"), launch["inputs"])],
            outputs=[("y", (M, N))],
            template=[(k, "float" if k == "T" else v) for k, v in launch["template"]],
            blocks=launch["grid"][0] // threads,
            threads=threads,
        )
        np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), atol=1e-4, rtol=1e-5, err_msg=f"{M}x{K} @ {N}x{K}")


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_path_matches_nn_linear(monkeypatch, bias):
    """The CUDA path with its kernel emulated on the CPU: float32, sums reordered, to 1e-5."""
    monkeypatch.setattr(linear, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(linear, "load_kernel", cuda_emulator.load_kernel)
    ref, rows = _layers(bias)
    x = mx.random.normal((7, 96))
    got = rows(x)
    assert got.shape == (7, 40)
    np.testing.assert_allclose(np.array(got), np.array(ref(x)), atol=1e-5, rtol=1e-5)


def _fused_case(M: int, K: int, N: int, gated: bool, seed: int = 2):
    """A projection's input (M, K, or 2K gated), layer, RMSNorm and residual, and its float64
    numpy reference for each of `fused_project`'s options."""
    rng = np.random.default_rng(seed)
    layer, norm = linear.Linear(K, N, bias=False), nn.RMSNorm(K, eps=1e-5)
    layer.weight = mx.array(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K))
    norm.weight = mx.array(rng.uniform(0.5, 1.5, K).astype(np.float32))
    x = mx.array(rng.standard_normal((M, 2 * K if gated else K)).astype(np.float32))
    residual = mx.array(rng.standard_normal((M, N)).astype(np.float32))

    def reference(use_norm: bool, use_residual: bool) -> np.ndarray:
        a, w = np.array(x, np.float64), np.array(layer.weight, np.float64)
        if gated:
            gate, up = a[:, :K], a[:, K:]
            a = gate / (1 + np.exp(-gate)) * up
        if use_norm:
            a = a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-5) * np.array(norm.weight, np.float64)
        y = a @ w.T
        return y + np.array(residual, np.float64) if use_residual else y

    return x, layer, norm, residual, reference


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
@pytest.mark.parametrize("gated,use_norm,use_residual", [(False, True, False), (False, False, True), (False, True, True), (True, False, True)])
def test_fused_ops_in_the_cuda_body_match_numpy(monkeypatch, gated, use_norm, use_residual):
    """`fused_project` on the row kernel's CUDA body (emulated, float32): the RMSNorm before the
    product, SwiGLU before it and the residual after it, in one launch, against float64 numpy."""
    monkeypatch.setattr(linear, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(linear, "load_kernel", cuda_emulator.load_kernel)
    calls = []
    row_matmul = linear.row_matmul
    monkeypatch.setattr(linear, "row_matmul", lambda *a, **k: calls.append(k) or row_matmul(*a, **k))
    for M, K, N in [(5, 192, 40), (17, 96, 33)]:
        x, layer, norm, residual, reference = _fused_case(M, K, N, gated)
        got = linear.fused_project(layer, x, norm if use_norm else None, gated, residual if use_residual else None)
        np.testing.assert_allclose(np.array(got), reference(use_norm, use_residual), atol=1e-4, rtol=1e-4, err_msg=f"{M}x{K} @ {N}x{K}")
    assert len(calls) == 2  # one launch each, the ops inside it


def test_fused_project_without_the_kernel_is_the_ops_one_by_one():
    """On the CPU (no kernel) `fused_project` is MLX's RMSNorm, SwiGLU, product and add, in turn."""
    for gated in (False, True):
        x, layer, norm, residual, reference = _fused_case(6, 64, 24, gated)
        got = linear.fused_project(layer, x, None if gated else norm, gated, residual)
        np.testing.assert_allclose(np.array(got), reference(not gated, True), atol=1e-4, rtol=1e-4)


def test_kernel_path_only_for_a_few_rows(monkeypatch):
    """A matrix of 2..ROWS rows takes the kernel; one row, more than ROWS, or tokens along a
    sequence axis (batch, L, K) take nn.Linear's own matmul."""
    calls = []
    monkeypatch.setattr(linear, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(linear, "row_matmul", lambda x, w, backend, **_: calls.append(x.shape) or x @ w.T)
    _, rows = _layers(False)
    rows(mx.zeros((linear.ROWS, 96)))
    assert calls == [(linear.ROWS, 96)]
    rows(mx.zeros((linear.ROWS + 1, 96)))
    rows(mx.zeros((1, 96)))
    rows(mx.zeros((1, linear.ROWS, 96)))
    assert calls == [(linear.ROWS, 96)]


def test_prompt_reads_take_the_matmul(monkeypatch, tmp_path):
    """A prompt's chunks (tokens along a sequence axis) are read by MLX's matmul: on CUDA each new
    warp share of a prompt's rows would build the row kernel again (seconds on the H100), while
    verification passes repeat a few row counts and keep it. The same tokens as a tree's nodes
    take the kernel."""
    calls = []

    def row_matmul(x, w, backend, gated=False, **_):  # shapes only: norm and residual left out
        calls.append(x.shape)
        return (linear.swiglu(*mx.split(x, 2, axis=-1)) if gated else x) @ w.T

    monkeypatch.setattr(linear, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(linear, "row_matmul", row_matmul)
    model = load_model(make_hf_model_dir(tmp_path / "m"), "float32")
    cache = model.make_cache()
    prefill(model, mx.arange(3, 13), cache)
    assert calls == [] and cache[0].offset == 10
    model(mx.arange(3, 13)[None], cache, mask=TreeMask.chain(10))
    assert calls and all(shape[0] == 10 for shape in calls)


def test_one_build_serves_every_row_count_of_a_warp_share(monkeypatch):
    """MLX builds a kernel once a template: row counts that give each simdgroup as many rows (MW)
    share one, so a chat turn's new tokens or a draft model's re-read ones build no new kernel."""
    templates = {}
    fake = lambda *a, **k: templates.setdefault(k["output_shapes"][0][0], k["template"]) and [mx.zeros(k["output_shapes"][0])]  # noqa: E731
    monkeypatch.setattr(linear, "load_kernel", lambda *a, **k: fake)
    w = mx.zeros((40, 96))
    for M in range(2, 2 * linear.WARPS + 1):
        linear.row_matmul(mx.zeros((M, 96)), w, backend="cuda")
    builds = {M: tuple(t) for M, t in templates.items()}
    assert len(set(builds.values())) == 2
    assert len({builds[M] for M in range(2, linear.WARPS + 1)}) == 1

# Half types: float32 sums rounded once; outputs are O(10) (K <= 256 unit normals).
PARITY_TOL = {mx.float32: 1e-4, mx.float16: 2e-2, mx.bfloat16: 1.6e-1}


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_matches_reference(backend, dtype):
    rng = np.random.default_rng(1)
    for M, K, N in SHAPES:
        x, w = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype) for s in ((M, K), (N, K)))
        with mx.stream(mx.gpu):
            got = linear.row_matmul(x, w, backend=backend)
        with mx.stream(mx.cpu):  # exact float32 (MLX's CUDA backend multiplies float32 in TF32)
            want = linear.row_matmul_ref(x.astype(mx.float32), w.astype(mx.float32))
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), atol=PARITY_TOL[dtype], rtol=1e-2, err_msg=f"{dtype} {M}x{K} @ {N}x{K}")


@pytest.mark.skipif(kernel_backend() != "cuda", reason="the row kernel path runs on MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_cuda_rows_equal_single_row_products(dtype):
    """In-features with 1, 2 and 4 elements a load (SmolLM2-135M's 576 and 1536 among them)."""
    for dims in ((96, 40), (576, 72), (1536, 48)):
        ref, rows = _layers(False, dtype, dims)
        for n in (17, 25, linear.ROWS):
            x = mx.random.normal((n, dims[0])).astype(dtype)
            got = rows(x)
            singles = mx.concatenate([rows(x[t : t + 1]) for t in range(n)])
            assert mx.array_equal(got, singles).item(), f"{dtype}, {dims}, {n} rows"
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref(x).astype(mx.float32)), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(kernel_backend() != "cuda", reason="the row kernel path runs on MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_cuda_fused_ops_match_mlx_ops(dtype):
    """At SmolLM2-135M's shapes, `fused_project` in one launch against MLX's own RMSNorm, SwiGLU and
    add around the row kernel: the residual bit for bit (rounded as MLX's add rounds), the norm
    and SwiGLU to a step of dtype (the norm's sum of squares is formed in another order)."""
    for (K, N), gated, use_norm, use_residual in [((576, 960), False, True, False), ((576, 576), False, False, True),
                                                 ((1536, 576), True, False, True), ((576, 3072), False, True, False)]:
        x, layer, norm, residual, _ = _fused_case(25, K, N, gated)
        layer.set_dtype(dtype)
        norm.set_dtype(dtype)
        x, residual = x.astype(dtype), residual.astype(dtype)
        got = linear.fused_project(layer, x, norm if use_norm else None, gated, residual if use_residual else None)
        a = norm(x) if use_norm else linear.swiglu(*mx.split(x, 2, axis=-1)) if gated else x
        want = layer(a) + residual if use_residual else layer(a)
        label = f"{dtype} {K}->{N} gated={gated} norm={use_norm} residual={use_residual}"
        if not (use_norm or gated):
            assert mx.array_equal(got, want).item(), label
        tol = 1e-5 if dtype == mx.float32 else 4e-2
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tol, rtol=tol, err_msg=label)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_fused_kernel_matches_reference(backend):
    """Each backend's body with the norm, SwiGLU and residual inside (float32) against float64
    numpy: Metal's twin too, which the model code does not call (MLX's matmul serves there)."""
    for gated, use_norm, use_residual in [(False, True, False), (False, False, True), (True, False, True)]:
        x, layer, norm, residual, reference = _fused_case(17, 192, 40, gated)
        with mx.stream(mx.gpu):
            got = linear.row_matmul(x, layer.weight, backend=backend, norm=norm if use_norm else None, gated=gated,
                                    residual=residual if use_residual else None)
        np.testing.assert_allclose(np.array(got), reference(use_norm, use_residual), atol=1e-4, rtol=1e-4, err_msg=f"{backend} gated={gated} norm={use_norm}")


def test_row_limit_is_the_last_count_the_kernel_never_lost():
    counts = [2, 4, 8, 16]
    assert linear.row_limit(counts, [1, 2, 3, 9], [2, 2, 4, 5]) == 8  # a tie keeps the kernel
    assert linear.row_limit(counts, [3, 1, 1, 1], [2, 2, 2, 2]) == 0  # lost at 2 rows: never the kernel
    assert linear.row_limit(counts, [1, 1, 1, 1], [2, 2, 2, 2]) == 16


def test_a_shapes_limit_sends_more_rows_to_the_matmul(monkeypatch):
    """linear.LIMITS (a tuned profile's) caps the rows the kernel takes for that weight shape only."""
    monkeypatch.setattr(linear, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(linear, "load_kernel", lambda *a, **k: lambda **kw: [mx.zeros(kw["output_shapes"][0])])
    monkeypatch.setattr(linear, "LIMITS", {(20, 64): 4})
    x, w, other = mx.ones((5, 64)), mx.ones((20, 64)), mx.ones((21, 64))
    assert linear.row_product(x, w) is None and linear.row_product(x[:4], w) is not None
    assert linear.row_product(x, other) is not None  # untuned shape: up to ROWS
