"""nn.QuantizedLinear whose products over a few rows (a verification pass's nodes) run as one
kernel that reads each packed weight word once, on MLX's CUDA backend.

There MLX's quantized product over more than one row is its matrix-vector kernel (qmv) once a row,
each row re-reading the weight, or a tiled kernel made for many rows, while a pass over a few
dozen rows of a model bound by reading its weights should cost about what one decode step's read
costs. `qrow_matmul` (metal_kernels/qrow_matmul.cu) reads it once for all the rows
(up to linear.ROWS), in MLX's affine format (4 or 8 bits, groups of 32, 64 or 128). On Metal MLX
has its own few-row kernel (qmv_wide, which reuses each weight group across the rows) and is kept.

Greedy exactness. The kernel is exact in float32: each element is dequantized as s * q + b in
float32 and each row's sum is formed in float32 in an order that does not depend on the other
rows, then rounded once, so it is `qrow_matmul_ref` to float32 rounding. It is not MLX's decode
step (qmv over one row) bit for bit, and cannot cheaply be: at 4 bits with float16 or bfloat16
activations MLX's CUDA qmv accumulates each lane's 16 partial sums in the activation's own type,
dequantizing through CUTLASS vector ops whose fusion into multiply-adds is the compiler's choice,
and reduces the warp with cooperative groups; Metal's qmv pre-scales x by powers of 16 and reduces
with simd_sum, in the hardware's order. One body, line for line the same on both backends, cannot
follow both, and matching the half-type accumulation would make the pass less accurate than the
step. So a tree node's logits can differ from the decode step's by the step's own rounding, a few
units in the last place of the dtype, and greedy speculative decoding gives plain greedy decoding's
tokens except at a near-tie, where the target's two best logits are closer than that and either is
its greedy choice within its own rounding (docs/speculative.md, Acceptance and exactness).
"""

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import kernel_backend, load_kernel
from mlx_hybrid.models import linear
from mlx_hybrid.models.linear import COLUMNS, WARPS, launch_rows

# MLX's affine formats the kernel reads: a uint32 word holds whole elements, 4 words a group's.
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def qrow_matmul_ref(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """x (M, K) @ dequantize(w)^T, in float32, rounded to x's dtype: the ground truth of `qrow_matmul`."""
    f32 = mx.float32
    weight = mx.dequantize(w, scales.astype(f32), biases.astype(f32), group_size=group_size, bits=bits)
    return (x.astype(f32) @ weight.T).astype(x.dtype)


def qrow_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int,
                backend: str) -> mx.array:
    """`qrow_matmul_ref` on the 'metal' or 'cuda' kernel, for M <= ROWS rows; x, scales and
    biases share a float dtype."""
    M, K = x.shape
    N = w.shape[0]
    template = [("T", x.dtype), ("N", N), ("K", K), ("GS", group_size), ("BITS", bits), ("C", COLUMNS), ("NW", WARPS),
                ("MW", -(-M // WARPS))]
    kernel = load_kernel(backend, "qrow_matmul", ("x", "w", "scales", "biases"), ("y",), reference=_reference)
    return launch_rows(kernel, [x, w, scales, biases], template, (M, N), x.dtype)


def _reference(*, inputs, template, **_):
    """`qrow_matmul`'s launch in MLX ops (its fallback)."""
    t = dict(template)
    return [qrow_matmul_ref(*inputs, t["GS"], t["BITS"])]


def reads(layer: nn.QuantizedLinear) -> bool:
    """Whether the kernel reads the layer's format."""
    return layer.mode == "affine" and layer.bits in BITS and layer.group_size in GROUP_SIZES


def qrow_product(x: mx.array, layer: nn.QuantizedLinear) -> mx.array | None:
    """x @ layer's dequantized weight^T on the kernel where it takes x: a matrix of 2..ROWS rows
    (2..linear.LIMITS' limit for the weight's shape, where tuned) in the scales' dtype, an affine
    format it reads, on CUDA; else None. As for the float row
    kernel (linear.row_product), rows along a sequence axis (a prompt's) take MLX's op."""
    if x.ndim != 2 or not 1 < x.shape[0] <= linear.LIMITS.get((layer.weight.shape[0], x.shape[1]), linear.ROWS) or kernel_backend() != "cuda":
        return None
    if not reads(layer) or x.dtype != layer.scales.dtype:
        return None
    return qrow_matmul(x, layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=layer.bits, backend="cuda")


class QuantizedLinear(nn.QuantizedLinear):
    """What `linear.Linear` becomes under nn.quantize; its parameters and saved form are
    nn.QuantizedLinear's."""

    def __call__(self, x: mx.array) -> mx.array:
        y = qrow_product(x, self)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y
