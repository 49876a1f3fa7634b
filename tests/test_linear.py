"""mlx_hybrid.models.linear: the row kernel's CUDA body (run on the CPU by tests/cuda_emulator.py)
against float64 numpy, the Linear's kernel path against nn.Linear, and on a GPU the kernels
against the reference; on MLX's CUDA backend each row's product is the one a single-row call (a
decode step) computes, bit for bit (without a bias: a single row with one goes to cuBLAS's fused
bias instead)."""

from importlib import resources

import cuda_emulator
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from factories import GPU_BACKENDS

from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.models import linear

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
            inputs=[("x", x, None), ("w", w, None)],
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
    x = mx.random.normal((1, 7, 96))
    got = rows(x)
    assert got.shape == (1, 7, 40)
    np.testing.assert_allclose(np.array(got), np.array(ref(x)), atol=1e-5, rtol=1e-5)


def test_kernel_path_only_for_a_few_rows(monkeypatch):
    """One row, or more than ROWS, is nn.Linear's own matmul."""
    calls = []
    monkeypatch.setattr(linear, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(linear, "row_matmul", lambda x, w, backend: calls.append(x.shape) or x @ w.T)
    _, rows = _layers(False)
    rows(mx.zeros((1, linear.ROWS, 96)))
    assert calls == [(linear.ROWS, 96)]
    rows(mx.zeros((1, linear.ROWS + 1, 96)))
    rows(mx.zeros((1, 1, 96)))
    assert calls == [(linear.ROWS, 96)]


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
            x = mx.random.normal((1, n, dims[0])).astype(dtype)
            got = rows(x)
            singles = mx.concatenate([rows(x[:, t : t + 1]) for t in range(n)], axis=1)
            assert mx.array_equal(got, singles).item(), f"{dtype}, {dims}, {n} rows"
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref(x).astype(mx.float32)), atol=2e-2, rtol=2e-2)
