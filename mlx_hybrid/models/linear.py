"""nn.Linear whose products over a few rows (a verification pass's nodes) run as one kernel that
reads the weight once, on MLX's CUDA backend.

There MLX hands a product over more than one row to cuBLASLt, which builds its descriptors and
asks for a heuristic on every call: 11-19 us of host time against about 3 us for a kernel launch
(benchmarks/results/pass-cost-mt-4288e06-nvidia-h100.json), and a speculative verification pass
of a small model over a few dozen rows is bound by that host time. MLX's batched matrix-vector
kernel avoids cuBLASLt but re-reads the weight once a row: 1.6 ms of the 3.6 ms a Medusa pass of
25 nodes kept the H100 busy (benchmarks/README.md). `row_matmul` (metal_kernels/row_matmul.cu)
reads it once for all the rows, and forms each row's sums in the order MLX's matrix-vector kernel
forms a decode step's, so a node's projection is the decode step's bit for bit (bias apart).
On Metal MLX's own matmul has no such host cost and is kept.
"""

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import kernel_backend, load_kernel

# The most rows the kernel takes; more go to nn.Linear's matmul.
ROWS = 64
# Weight rows a threadgroup, and its simdgroups, which split the input rows between them.
COLUMNS = 2
WARPS = 8


def row_matmul_ref(x: mx.array, w: mx.array) -> mx.array:
    """x (M, K) @ w (N, K)^T: the ground truth of `row_matmul`."""
    return x @ w.T


def row_matmul(x: mx.array, w: mx.array, *, backend: str) -> mx.array:
    """`row_matmul_ref` on the 'metal' or 'cuda' kernel, for M <= ROWS rows."""
    M, K = x.shape
    N = w.shape[0]
    npt = 4 if K % 128 == 0 else 2 if K % 64 == 0 else 1  # as MLX's matrix-vector kernel loads
    template = [("T", x.dtype), ("M", M), ("N", N), ("K", K), ("NPT", npt), ("C", COLUMNS), ("NW", WARPS), ("MW", -(-M // WARPS))]
    kernel = load_kernel(backend, "row_matmul", ("x", "w"), ("y",))
    return kernel(
        inputs=[x, w],
        template=template,
        grid=(-(-N // COLUMNS) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )[0]


def row_product(x: mx.array, w: mx.array) -> mx.array | None:
    """x (..., K) @ w (N, K)^T on the row kernel where it takes x: 2..ROWS rows in w's dtype, on
    CUDA; else None."""
    rows = x.size // x.shape[-1]
    if rows == 1 or rows > ROWS or kernel_backend() != "cuda" or x.dtype != w.dtype:
        return None
    return row_matmul(x.reshape(rows, -1), w, backend="cuda").reshape(*x.shape[:-1], -1)


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        y = row_product(x, self.weight)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y
