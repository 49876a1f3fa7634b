"""Small (quantized) matmul: the CUDA kernel bodies (run on the CPU by tests/cuda_emulator.py)
against float64 numpy, the GPU kernels against MLX's `x @ w.T` and `mx.quantized_matmul`, and
`linear`'s dispatch (which layers and row counts take a kernel) through the emulator."""

import cuda_emulator
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from factories import GPU_BACKENDS, make_hf_model_dir, make_hybrid_dir

from mlx_hybrid import small_matmul
from mlx_hybrid.loader import load_model
from mlx_hybrid.small_matmul import MAX_ROWS, linear
from mlx_hybrid.speculative.tree import Tree

# (rows, K, N): every columns-per-simdgroup choice (4, 2, 1), a K that ends inside a 128-wide
# step of the lanes, and N not filling the last simdgroup or threadgroup.
SHAPES = [(2, 8, 5), (16, 132, 37), (17, 576, 70), (33, 64, 9), (MAX_ROWS, 260, 130)]


def make_case(M, K, N, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_cuda_body_on_the_cpu_matches_numpy(monkeypatch):
    monkeypatch.setattr(small_matmul, "load_kernel", cuda_emulator.load_kernel)
    for i, (M, K, N) in enumerate(SHAPES):
        x, w = make_case(M, K, N, seed=i)
        got = small_matmul.small_matmul(mx.array(x), mx.array(w), backend="cuda")
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=1e-5, err_msg=f"{M}x{K} @ ({N}x{K}).T")


# (rows, K, N, bits, group size): 4 and 8 bits at MLX's default group size, 2 bits at 32, a K of
# one group and one that ends inside a 256-wide step of the lanes.
QSHAPES = [(3, 64, 7, 4, 64), (17, 576, 70, 4, 64), (33, 320, 20, 8, 64), (MAX_ROWS, 96, 11, 2, 32)]


def make_qcase(M, K, N, bits, group_size, seed):
    x, w = make_case(M, K, N, seed)
    return x, mx.quantize(mx.array(w), group_size=group_size, bits=bits)


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_quantized_cuda_body_on_the_cpu_matches_numpy(monkeypatch):
    """Against float64 numpy over MLX's own dequantized weights (the packing is MLX's)."""
    monkeypatch.setattr(small_matmul, "load_kernel", cuda_emulator.load_kernel)
    for i, (M, K, N, bits, gs) in enumerate(QSHAPES):
        x, (wq, scales, biases) = make_qcase(M, K, N, bits, gs, seed=i)
        got = small_matmul.small_qmatmul(mx.array(x), wq, scales, biases, gs, bits, backend="cuda")
        w = np.array(mx.dequantize(wq, scales, biases, group_size=gs, bits=bits))
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=1e-5, err_msg=f"{bits}-bit {M}x{K} @ ({N}x{K}).T")


# Half types: float32 sums of products of the rounded inputs, rounded once, as the float32
# reference below is (fp16 2**-11, bf16 2**-8 relative to |y|, which reaches ~3 sqrt(K)).
PARITY_RTOL = {mx.float32: 1e-5, mx.float16: 1e-3, mx.bfloat16: 8e-3}


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_matches_reference(backend, dtype):
    for i, (M, K, N) in enumerate(SHAPES):
        x, w = make_case(M, K, N, seed=i)
        with mx.stream(mx.gpu):
            xs, ws = mx.array(x).astype(dtype), mx.array(w).astype(dtype)
            got = small_matmul.small_matmul(xs, ws, backend=backend)
        with mx.stream(mx.cpu):  # exact float32: MLX's CUDA backend multiplies float32 in TF32
            want = (xs.astype(mx.float32) @ ws.astype(mx.float32).T).astype(dtype)
        got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=PARITY_RTOL[dtype] * scale, err_msg=f"{dtype} {M}x{K} @ ({N}x{K}).T")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_quantized_kernel_matches_reference(backend, dtype):
    for i, (M, K, N, bits, gs) in enumerate(QSHAPES):
        x, (wq, scales, biases) = make_qcase(M, K, N, bits, gs, seed=i)
        with mx.stream(mx.gpu):
            xs, ss, bs = mx.array(x).astype(dtype), scales.astype(dtype), biases.astype(dtype)
            got = small_matmul.small_qmatmul(xs, wq, ss, bs, gs, bits, backend=backend)
        with mx.stream(mx.cpu):  # exact float32, rounded once
            want = mx.quantized_matmul(xs.astype(mx.float32), wq, ss.astype(mx.float32), bs.astype(mx.float32),
                                       transpose=True, group_size=gs, bits=bits).astype(dtype)
        got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=PARITY_RTOL[dtype] * scale, err_msg=f"{dtype} {bits}-bit {M}x{K} @ ({N}x{K}).T")


def emulate_counting(monkeypatch) -> list:
    """Send `linear` down its GPU path with the kernels emulated; returns the list their launches
    append to."""
    launches = []

    def counted(*args, **kwargs):
        kernel = cuda_emulator.load_kernel(*args, **kwargs)
        return lambda **kw: launches.append(1) or kernel(**kw)

    monkeypatch.setattr(small_matmul, "load_kernel", counted)
    monkeypatch.setattr(small_matmul, "kernel_backend", lambda: "cuda")
    return launches


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_linear_takes_the_kernel_for_a_few_rows(monkeypatch):
    """Layers over 2..MAX_ROWS rows go through a kernel (bias added after it), a 4-bit one too;
    one row, more rows, 3-bit weights and weights of another dtype keep MLX's product."""
    launches = emulate_counting(monkeypatch)
    mx.random.seed(0)
    layer = nn.Linear(24, 10, bias=True)
    for shape in [(1, 3, 24), (2, 24), (1, MAX_ROWS, 24)]:
        x = mx.random.normal(shape)
        np.testing.assert_allclose(np.array(linear(layer, x)), np.array(layer(x)), atol=1e-5)
    assert len(launches) == 3
    quantized = nn.QuantizedLinear(64, 16, bias=True, group_size=32, bits=4)
    x = mx.random.normal((1, 5, 64))
    np.testing.assert_allclose(np.array(linear(quantized, x)), np.array(quantized(x)), atol=1e-4)
    assert len(launches) == 4
    three_bit = nn.QuantizedLinear(64, 16, bias=False, group_size=64, bits=3)  # fields cross words
    for layer, x in [(layer, mx.random.normal((1, 1, 24))), (layer, mx.random.normal((1, MAX_ROWS + 1, 24))),
                     (three_bit, mx.random.normal((1, 3, 64))), (layer, mx.random.normal((1, 3, 24)).astype(mx.float16))]:
        np.testing.assert_allclose(np.array(linear(layer, x)), np.array(layer(x)), atol=1e-5)
    assert len(launches) == 4


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA bodies cannot be run on the CPU")
@pytest.mark.parametrize("kind", ["llama", "llama 4-bit", "hybrid"])
def test_verification_pass_through_the_kernels_matches_mlx(tmp_path, monkeypatch, kind):
    """A candidate tree's logits after a prompt, with every projection of the pass that can take a
    kernel through it (emulated), against the same model on MLX's products (float32, so only
    summation order differs)."""
    if kind == "hybrid":
        model = load_model(make_hybrid_dir(tmp_path / "h", ["attention", "mamba2"], seed=3)[0], "float32")
    else:
        model = load_model(make_hf_model_dir(tmp_path / "m", tokenizer=False), "float32")
        if kind == "llama 4-bit":
            nn.quantize(model, group_size=32, bits=4)
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 6]
    tokens = mx.array([[5, 17, 42, 9, 33, 21, 7, 60, 11]])

    def verify():
        cache = model.make_cache()
        model(mx.array([list(range(1, 70))]), cache)  # 69 rows: MLX's product
        return np.array(model(tokens, cache, tree=Tree.from_parents(parents)))

    reference = verify()
    launches = emulate_counting(monkeypatch)
    got = verify()
    # 4 a Llama layer; the hybrid: its attention layer's 4, the Mamba2 layer's MLP (2) and in_proj
    # (its out_proj takes a kernel where the fused ssm_step runs, on a GPU)
    assert len(launches) == (4 * len(model.layers) if kind != "hybrid" else 4 + 2 + 1)
    np.testing.assert_allclose(got, reference, atol=1e-4 * np.abs(reference).max())


def test_row_counts_share_a_few_compiled_variants(monkeypatch):
    """A kernel is compiled per template, so rows are rounded up to a power of two: a prompt of any
    length up to MAX_ROWS reuses one of five variants instead of compiling its own."""
    seen = set()

    def stub(*_, **__):
        def launch(*, inputs, template, output_shapes, output_dtypes, **___):
            seen.add(dict(template)["MT"])
            assert int(inputs[-1][0]) == inputs[0].size // inputs[0].shape[-1]  # the true row count
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return launch

    monkeypatch.setattr(small_matmul, "load_kernel", stub)
    w = mx.zeros((8, 16))
    for rows in range(2, MAX_ROWS + 1):
        small_matmul.small_matmul(mx.zeros((1, rows, 16)), w, backend="cuda")
    assert seen == {4, 8, 16, 32, 64}
