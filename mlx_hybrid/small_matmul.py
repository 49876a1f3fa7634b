"""Linear layers over the few rows of a verification pass (2 to `MAX_ROWS` candidate tokens).

On a GPU, MLX multiplies one row by a matrix with a matrix-vector kernel, but a few rows through a
general matmul (cuBLAS on MLX's CUDA backend) whose launch takes two to three times as long
(benchmarks/README.md), and a small model's verification pass is launch-bound: its projections
then cost more than the whole decode step they replace. `small_matmul` is one plain kernel launch
(metal_kernels/small_matmul.cu and its Metal twin) doing the one-row product's work once per row;
`small_qmatmul` the same for quantized weights, whose multi-row kernel on MLX's CUDA backend is
slow on the GPU as well. Their references are MLX's `x @ w.T` and `mx.quantized_matmul`.
"""

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import kernel_backend, load_kernel

MAX_ROWS = 64  # a Medusa tree's nodes; past this the rows' partial sums outgrow the registers


def _launch(name: str, inputs: list, M: int, N: int, template: list, dtype: mx.Dtype, backend: str) -> mx.array:
    C = 4 if M <= 16 else 2 if M <= 32 else 1  # columns per simdgroup: M * C partial sums a thread
    names = ("x", "w", "scales", "biases")[: len(inputs)]
    kernel = load_kernel(backend, name, names, ("y",))
    warps = 4
    simdgroups = -(-N // C)
    (y,) = kernel(
        inputs=inputs,
        template=[("T", dtype), ("M", M), ("C", C), *template],
        grid=(-(-simdgroups // warps) * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[dtype],
    )
    return y


def small_matmul(x: mx.array, w: mx.array, *, backend: str) -> mx.array:
    """x (M, K) @ w.T for w (N, K) on the 'metal' or 'cuda' kernel; M <= MAX_ROWS, K % 4 == 0."""
    return _launch("small_matmul", [x, w], x.shape[0], w.shape[0], [], x.dtype, backend)


def small_qmatmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, *,
                  backend: str) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)` (affine mode)
    on the 'metal' or 'cuda' kernel; x (M, K) with M <= MAX_ROWS, bits 2, 4 or 8, group_size % 8 == 0."""
    return _launch("small_qmatmul", [x, w, scales, biases], x.shape[0], scales.shape[0],
                   [("BITS", bits), ("GS", group_size)], x.dtype, backend)


def _kernel_for(layer: nn.Module, x: mx.array):
    """The product `linear` runs layer's matmul with, as f(x2d, backend), or None for layer(x)."""
    if type(layer) is nn.Linear:
        w = layer.weight
        if w.dtype == x.dtype and w.shape[1] % 4 == 0:
            return lambda x2, backend: small_matmul(x2, w, backend=backend)
    elif type(layer) is nn.QuantizedLinear:
        g, b = layer.group_size, layer.bits
        if (getattr(layer, "mode", "affine") == "affine" and b in (2, 4, 8) and g % 8 == 0
                and layer.scales.dtype == x.dtype):
            return lambda x2, backend: small_qmatmul(x2, layer.weight, layer.scales, layer.biases, g, b, backend=backend)
    return None


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """layer(x), through `small_matmul` or `small_qmatmul` where they apply: on a GPU kernel
    backend, 2 to MAX_ROWS rows, an `nn.Linear` with weights in x's dtype or an affine
    `nn.QuantizedLinear` (2, 4 or 8 bits) with scales in x's dtype."""
    rows = x.size // x.shape[-1]
    if not 2 <= rows <= MAX_ROWS or (backend := kernel_backend()) is None or (product := _kernel_for(layer, x)) is None:
        return layer(x)
    y = product(x.reshape(rows, -1), backend).reshape(*x.shape[:-1], -1)
    return y + layer.bias if "bias" in layer else y
