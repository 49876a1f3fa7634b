"""mlx_hybrid.models.linear: the per-row path gives nn.Linear's products, and on MLX's CUDA
backend each row's product is the one a single-row call (a decode step) computes, bit for bit
(without a bias: a single row with one goes to cuBLAS's fused bias instead)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_hybrid.kernels import kernel_backend
from mlx_hybrid.models import linear


def _layers(bias: bool, dtype=mx.float32):
    mx.random.seed(0)
    ref = nn.Linear(96, 40, bias=bias)
    ref.set_dtype(dtype)
    rows = linear.Linear(96, 40, bias=bias)
    rows.update(ref.parameters())
    return ref, rows


@pytest.mark.parametrize("bias", [False, True])
def test_per_row_path_matches_nn_linear(monkeypatch, bias):
    """Forced on the CPU (the path is CUDA's): float32, sums reordered, to 1e-5."""
    monkeypatch.setattr(linear, "kernel_backend", lambda: "cuda")
    ref, rows = _layers(bias)
    x = mx.random.normal((2, 7, 96))
    got = rows(x)
    assert got.shape == (2, 7, 40)
    np.testing.assert_allclose(np.array(got), np.array(ref(x)), atol=1e-5, rtol=1e-5)


def test_path_only_under_its_byte_budget(monkeypatch):
    """Past ROW_BYTES (rows x weight bytes) the call is nn.Linear's own matmul."""
    calls = []
    monkeypatch.setattr(linear, "kernel_backend", lambda: calls.append(1) or "cuda")
    _, rows = _layers(False)
    weight_bytes = rows.weight.nbytes
    monkeypatch.setattr(linear, "ROW_BYTES", 4 * weight_bytes)
    rows(mx.zeros((1, 4, 96)))
    assert calls == [1]  # 4 rows: within the budget, the backend is asked
    rows(mx.zeros((1, 5, 96)))
    rows(mx.zeros((1, 1, 96)))
    assert calls == [1]  # 5 rows over it, 1 row never: nn.Linear without asking


@pytest.mark.skipif(kernel_backend() != "cuda", reason="the per-row path runs on MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_cuda_rows_equal_single_row_products(dtype):
    ref, rows = _layers(False, dtype)
    x = mx.random.normal((1, 17, 96)).astype(dtype)
    got = rows(x)
    singles = mx.concatenate([rows(x[:, t : t + 1]) for t in range(17)], axis=1)
    assert mx.array_equal(got, singles).item()
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref(x).astype(mx.float32)), atol=2e-2, rtol=2e-2)
