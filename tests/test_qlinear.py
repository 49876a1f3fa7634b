"""mlx_hybrid.models.qlinear: the reference against float64 numpy unpacking of MLX's affine format
and against MLX's own quantized product, the kernel's CUDA body (run on the CPU by
tests/helpers/cuda_emulator.py) against the reference under the module's exactness policy (float32
sums; a row's result independent of the other rows), the loader's quantized layers as the
subclass, and greedy speculative decoding of a 4-bit target on the emulated kernel equal to plain
greedy decoding. The Metal body: tests/test_metal.py."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tests.helpers import cuda_emulator
from tests.helpers.factories import GPU_BACKENDS, make_hf_model_dir
from tests.test_linear import PARITY_TOL
from tests.test_speculative import OracleProposer, run_steps, tie_free_references

from mlx_hybrid.convert.hf import convert
from mlx_hybrid.doctor import numpy_dequantize
from mlx_hybrid.loader import load_model
from mlx_hybrid.models import linear, qlinear

# (rows, in, out, group size, bits): a tree's rows, the most rows, a lane with no whole 4-word
# step left (K = 192 at 4 bits: 24 words), outputs leaving a threadgroup's last weight row empty,
# each group size and bit width.
SHAPES = [(5, 192, 40, 64, 4), (17, 128, 33, 32, 8), (linear.ROWS, 256, 9, 128, 4), (2, 64, 20, 64, 8), (9, 1024, 6, 32, 4)]


def quantized(N: int, K: int, group_size: int, bits: int, dtype=mx.float32, seed: int = 0):
    """An affine-quantized (N, K) weight: packed words, scales and biases in dtype."""
    w = mx.array(np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size, bits)
    return wq, scales.astype(dtype), biases.astype(dtype)


def test_reference_is_the_dequantized_product():
    """`qrow_matmul_ref` against the format unpacked in float64 numpy, and MLX's own quantized
    product (nn.QuantizedLinear) against it, on the CPU: it checks the format's arithmetic, not a
    device (on the CUDA backend MLX's product raised at one of these shapes)."""
    rng = np.random.default_rng(1)
    with mx.stream(mx.cpu):
        check_reference(rng)


def check_reference(rng):
    for M, K, N, gs, bits in SHAPES:
        wq, scales, biases = quantized(N, K, gs, bits)
        x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
        want = np.array(x, np.float64) @ numpy_dequantize(wq, scales, biases, gs, bits).T
        got = qlinear.qrow_matmul_ref(x, wq, scales, biases, gs, bits)
        np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=1e-5, err_msg=f"{M}x{K} @ {N}x{K}, {bits} bits, groups of {gs}")
        mlx = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=gs, bits=bits)
        np.testing.assert_allclose(np.array(mlx), want, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_cuda_body_on_the_cpu_follows_the_policy(monkeypatch):
    """The CUDA body (float32, emulated) is the reference to float32 rounding at every shape, and
    each row's result is bit for bit the one the kernel gives that row alone: a node's sums do
    not depend on the other nodes of the pass."""
    monkeypatch.setattr(qlinear, "load_kernel", cuda_emulator.load_kernel)
    rng = np.random.default_rng(2)
    for M, K, N, gs, bits in SHAPES:
        wq, scales, biases = quantized(N, K, gs, bits, seed=M)
        x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
        got = qlinear.qrow_matmul(x, wq, scales, biases, group_size=gs, bits=bits, backend="cuda")
        want = qlinear.qrow_matmul_ref(x, wq, scales, biases, gs, bits)
        label = f"{M}x{K} @ {N}x{K}, {bits} bits, groups of {gs}"
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-5, err_msg=label)
        if M <= linear.WARPS:  # one build: a row alone has the same warp share
            alone = [qlinear.qrow_matmul(x[m : m + 1], wq, scales, biases, group_size=gs, bits=bits, backend="cuda") for m in (0, M - 1)]
            assert mx.array_equal(got[mx.array([0, M - 1])], mx.concatenate(alone)).item(), label


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_matches_reference(backend, dtype):
    """On the device: the kernel against its reference in exact float32 (tolerances as the float
    row kernel's: float32 sums rounded once to the dtype)."""
    rng = np.random.default_rng(3)
    for M, K, N, gs, bits in SHAPES:
        wq, scales, biases = quantized(N, K, gs, bits, dtype, seed=M)
        x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
        with mx.stream(mx.gpu):
            got = qlinear.qrow_matmul(x, wq, scales, biases, group_size=gs, bits=bits, backend=backend)
        with mx.stream(mx.cpu):  # exact float32 (MLX's CUDA backend multiplies float32 in TF32)
            f32 = mx.float32
            want = qlinear.qrow_matmul_ref(x.astype(f32), wq, scales.astype(f32), biases.astype(f32), gs, bits)
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), atol=PARITY_TOL[dtype], rtol=1e-2,
                                   err_msg=f"{dtype} {M}x{K} @ {N}x{K}, {bits} bits, groups of {gs}")


def test_kernel_path_only_for_a_few_rows_in_a_format_it_reads(monkeypatch):
    """On CUDA a matrix of 2..ROWS rows in the scales' dtype takes the kernel; one row, more than
    ROWS, a sequence axis, another dtype or a format it does not read take MLX's op."""
    calls = []
    monkeypatch.setattr(qlinear, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(qlinear, "qrow_matmul", lambda x, *a, **k: calls.append(x.shape) or qlinear.qrow_matmul_ref(x, *a, k["group_size"], k["bits"]))
    layer = linear.Linear(64, 24).to_quantized(64, 4)
    for shape in [(linear.ROWS, 64), (linear.ROWS + 1, 64), (1, 64), (1, 3, 64)]:
        layer(mx.zeros(shape))
    layer(mx.zeros((4, 64), mx.float16))
    linear.Linear(64, 24).to_quantized(64, 6)(mx.zeros((4, 64)))
    assert calls == [(linear.ROWS, 64)]


@pytest.mark.skipif(not cuda_emulator.AVAILABLE, reason="g++ not found: the CUDA body cannot be run on the CPU")
def test_greedy_speculative_decoding_of_a_4bit_target_on_the_kernel(tmp_path, monkeypatch):
    """A 4-bit target (converted with groups of 64, loaded by the loader: its projections are the
    subclass) decoded greedily by verification passes whose projections all run on the emulated
    CUDA body equals plain greedy decoding, on prompts without a near-tie (the policy)."""
    src = make_hf_model_dir(tmp_path / "src", intermediate_size=128, seed=4)
    model = load_model(convert(src, tmp_path / "q", quantize=True, bits=4, group_size=64), "float32")
    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and all(type(m) is qlinear.QuantizedLinear for m in layers)
    [(prompt, ref)] = tie_free_references(model, 1, n=10, seed=3)
    calls = []
    monkeypatch.setattr(qlinear, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(qlinear, "load_kernel", cuda_emulator.load_kernel)
    qrow_matmul = qlinear.qrow_matmul
    monkeypatch.setattr(qlinear, "qrow_matmul", lambda x, *a, **k: calls.append(x.shape[0]) or qrow_matmul(x, *a, **k))
    mx.disable_compile()  # the emulator needs real arrays
    try:
        got, steps, accepted = run_steps(model, OracleProposer(ref, model.args.vocab_size, seed=0, prompt_len=len(prompt)), prompt, 10)
    finally:
        mx.enable_compile()
    assert got == ref
    assert calls and accepted > 0


def test_a_shapes_limit_sends_more_rows_to_mlx(monkeypatch):
    """linear.LIMITS (a tuned profile's, keyed by the unpacked weight shape) caps the rows the
    quantized kernel takes too."""
    monkeypatch.setattr(qlinear, "kernel_backend", lambda: "cuda")
    monkeypatch.setattr(qlinear, "load_kernel", lambda *a, **k: lambda **kw: [mx.zeros(kw["output_shapes"][0])])
    layer = nn.QuantizedLinear(64, 20, bias=False, group_size=32, bits=4)
    monkeypatch.setattr(linear, "LIMITS", {(20, 64): 4})
    x = mx.ones((5, 64))
    assert qlinear.qrow_product(x, layer) is None and qlinear.qrow_product(x[:4], layer) is not None
