"""nn.Linear whose products over a few rows run as one matrix-vector product per row on MLX's
CUDA backend.

There MLX hands a product over more than one row to cuBLASLt, which builds its descriptors and
asks for a heuristic on every call: 11-19 us of host time against about 3 us for MLX's own
matrix-vector kernel (benchmarks/results/pass-cost-mt-4288e06-nvidia-h100.json), and a speculative
verification pass of a small model over a few dozen rows is bound by that host time. Written as
`W @ x[..., None]`, the product is a batch of matrix-vector products with the weight broadcast
(batch stride 0), which MLX runs as its batched gemv kernel: one launch, each row's sums in the
order a decode step's are (bias apart). The weight is re-read once a row, so the device's time
grows with rows x weight bytes, and the path is taken only while that stays under `ROW_BYTES`.
"""

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import kernel_backend

# On the H100, SmolLM2-135M's greedy passes (17 and 64 nodes) were quickest under 128 MB, which
# sends every projection of a 17-node pass per row, against 24 MB and none, in interleaved rounds
# (benchmarks/README.md: `pass_cost.py --passes`).
ROW_BYTES = 128 << 20


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows == 1 or rows * self.weight.nbytes > ROW_BYTES or kernel_backend() != "cuda":
            return super().__call__(x)
        y = (self.weight @ x.reshape(rows, -1, 1)).reshape(*x.shape[:-1], -1)
        return y + self.bias if "bias" in self else y
