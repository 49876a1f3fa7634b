"""Linear layers over a few rows (2 to `MAX_ROWS`): a verification pass's candidate tokens, a
ReDrafter step's beams, a short prompt.

On a GPU, MLX multiplies one row by a matrix with a matrix-vector kernel, but a few rows through a
general matmul (cuBLAS on MLX's CUDA backend) whose launch takes two to three times as long
(benchmarks/README.md), and a small model's verification pass is launch-bound: its projections
then cost more than the whole decode step they replace. `small_matmul` is one plain kernel launch
(metal_kernels/small_matmul.cu and its Metal twin) doing the one-row product's work once per row;
`small_qmatmul` the same for quantized weights, whose multi-row kernel on MLX's CUDA backend is
slow on the GPU as well. Their references are MLX's `x @ w.T` and `mx.quantized_matmul`.
"""

import functools

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import kernel_backend, load_kernel

MAX_ROWS = 64  # a Medusa tree's nodes; past this the rows' partial sums outgrow the registers


@functools.cache
def _rows(m: int) -> mx.array:
    return mx.array([m], mx.int32)


def _launch(name: str, inputs: list, N: int, template: list, backend: str) -> mx.array:
    """y (..., N) for x (..., K), inputs[0]: no reshape (each would be one more op in a pass)."""
    x = inputs[0]
    M = x.size // x.shape[-1]
    MT = max(4, 1 << (M - 1).bit_length())  # compiled per power of two, not per row count
    C = 4 if MT <= 16 else 2 if MT <= 32 else 1  # columns per simdgroup: MT * C partial sums a thread
    names = ("x", "w", "scales", "biases")[: len(inputs)] + ("rows",)
    kernel = load_kernel(backend, name, names, ("y",))
    warps = 4
    simdgroups = -(-N // C)
    (y,) = kernel(
        inputs=[*inputs, _rows(M)],
        template=[("T", x.dtype), ("MT", MT), ("C", C), *template],
        grid=(-(-simdgroups // warps) * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], N)],
        output_dtypes=[x.dtype],
    )
    return y


def small_matmul(x: mx.array, w: mx.array, *, backend: str) -> mx.array:
    """x (..., K) @ w.T for w (N, K) on the 'metal' or 'cuda' kernel; at most MAX_ROWS rows, K % 4 == 0."""
    return _launch("small_matmul", [x, w], w.shape[0], [], backend)


def small_qmatmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, *,
                  backend: str) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)` (affine mode)
    on the 'metal' or 'cuda' kernel; x (..., K) with at most MAX_ROWS rows, bits 2, 4 or 8,
    group_size % 8 == 0."""
    return _launch("small_qmatmul", [x, w, scales, biases], scales.shape[0], [("BITS", bits), ("GS", group_size)], backend)


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """layer(x), through `small_matmul` or `small_qmatmul` where they apply: on a GPU kernel
    backend, 2 to MAX_ROWS rows, an `nn.Linear` with weights in x's dtype or an affine
    `nn.QuantizedLinear` (2, 4 or 8 bits) with scales in x's dtype."""
    backend = kernel_backend() if 2 <= x.size // x.shape[-1] <= MAX_ROWS else None
    if backend and type(layer) is nn.Linear and layer.weight.dtype == x.dtype and x.shape[-1] % 4 == 0:
        y = small_matmul(x, layer.weight, backend=backend)
    elif (backend and type(layer) is nn.QuantizedLinear and getattr(layer, "mode", "affine") == "affine"
          and layer.bits in (2, 4, 8) and layer.group_size % 8 == 0 and layer.scales.dtype == x.dtype):
        y = small_qmatmul(x, layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits, backend=backend)
    else:
        return layer(x)
    return y + layer.bias if "bias" in layer else y
