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
The same launch can also take the RMSNorm or SwiGLU before a projection and the residual add
after it (`fused_project`). On Metal MLX's own matmul has no such host cost and is kept.
"""

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import bits_float, float_bits, kernel_backend, load_kernel

# The most rows the kernel takes; more go to nn.Linear's matmul.
ROWS = 64
# Per weight shape (N, K), the most rows the kernel takes for it, where `hybrid tune` measured
# that MLX's matmul wins beyond (`mlx_hybrid.tune.row_limits`). The kernel reads the weight once
# but each simdgroup takes its rows one after another, so its time grows with the rows;
# cuBLASLt's is nearly flat plus a fixed host cost. Which wins at a count depends on the weight's
# size and the device, so it is measured. Untuned shapes take up to ROWS.
LIMITS: dict[tuple[int, int], int] = {}
# Weight rows a threadgroup, and its simdgroups, which split the input rows between them.
COLUMNS = 2
WARPS = 8


def row_matmul_ref(x: mx.array, w: mx.array) -> mx.array:
    """x (M, K) @ w (N, K)^T: the ground truth of `row_matmul`."""
    return x @ w.T


@mx.compile
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def row_matmul(x: mx.array, w: mx.array, *, backend: str, norm: nn.RMSNorm | None = None, gated: bool = False,
               residual: mx.array | None = None) -> mx.array:
    """`row_matmul_ref` on the 'metal' or 'cuda' kernel, for M <= ROWS rows, with what surrounds
    a projection in a decoder layer inside the same launch: `norm` (an RMSNorm) of x's rows
    before it; gated, SwiGLU before it, x (M, 2K) holding the gate's columns then the up's; the
    residual (M, N) added after it."""
    M = x.shape[0]
    N, K = w.shape
    npt = 4 if K % 128 == 0 else 2 if K % 64 == 0 else 1  # as MLX's matrix-vector kernel loads
    flags = [("NORM", norm is not None), ("GATE", gated), ("RES", residual is not None), ("EPS", 0 if norm is None else float_bits(norm.eps))]
    template = [("T", x.dtype), ("N", N), ("K", K), ("NPT", npt), ("C", COLUMNS), ("NW", WARPS), ("MW", -(-M // WARPS)), *flags]
    kernel = load_kernel(backend, "row_matmul", ("x", "w", "nw", "r"), ("y",), reference=_rows_reference)
    inputs = [x, w, x if norm is None else norm.weight, x if residual is None else residual]
    return launch_rows(kernel, inputs, template, (M, N), x.dtype)


def launch_rows(kernel, inputs: list, template: list, shape: tuple[int, int], dtype: mx.Dtype) -> mx.array:
    """One launch of a row kernel (this one or qlinear's) for an output of shape (M, N): a
    threadgroup of WARPS simdgroups for each COLUMNS weight rows."""
    return kernel(inputs=inputs, template=template, grid=(-(-shape[1] // COLUMNS) * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
                  output_shapes=[shape], output_dtypes=[dtype])[0]


def _rows_reference(*, inputs, template, **_):
    """`row_matmul`'s launch in MLX ops (its fallback): SwiGLU, RMSNorm, product, residual."""
    x, w, nw, r = inputs
    t = dict(template)
    if t["GATE"]:
        x = swiglu(*mx.split(x, 2, axis=-1))
    if t["NORM"]:
        x32 = x.astype(mx.float32)
        x = (x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + bits_float(t["EPS"]))).astype(x.dtype) * nw
    y = row_matmul_ref(x, w)
    return [r + y if t["RES"] else y]


def row_product(x: mx.array, w: mx.array, norm: nn.RMSNorm | None = None, gated: bool = False,
                residual: mx.array | None = None) -> mx.array | None:
    """x @ w (N, K)^T on the row kernel where it takes x: a matrix (rows, K) of 2..ROWS rows (a
    verification pass's nodes, a drafter's beams) in w's dtype, on CUDA; else None. norm, gated,
    residual (rows, N): as `row_matmul`. Inputs with a sequence axis (batch, L, K), a prompt's
    chunks, take MLX's matmul: their row counts are any, and on CUDA the first product of each
    new warp share of rows (MW) builds the kernel for every weight shape, about a second each (a
    draft's 62-token prompt read took 6.6 s the first time on the H100 and 7 ms the next); a
    prompt is read once, so cuBLASLt's host time costs it little."""
    if x.ndim != 2 or not 1 < x.shape[0] <= LIMITS.get(tuple(w.shape), ROWS) or kernel_backend() != "cuda" or x.dtype != w.dtype:
        return None
    return row_matmul(x, w, backend="cuda", norm=norm, gated=gated, residual=residual)


def row_limit(counts: list[int], kernel: list[float], matmul: list[float]) -> int:
    """The most rows the row kernel should take for a weight, from its seconds and the matmul's
    at each row count: the last count up to which the kernel never lost (0: it always lost)."""
    limit = 0
    for n, a, b in zip(counts, kernel, matmul):
        if a > b:
            break
        limit = n
    return limit


def fused_project(layer: nn.Module, x: mx.array, norm: nn.RMSNorm | None = None, gated: bool = False,
                  residual: mx.array | None = None) -> mx.array:
    """residual + layer(f(x)), f the RMSNorm `norm` or (gated) SwiGLU of x's two halves: for a
    verification pass's nodes one launch of the row kernel (`row_matmul`), where it takes them;
    otherwise MLX's ops one by one. A pass of a small model is bound by the host's time a
    launch, and this takes a decoder layer from ten launches to five."""
    if type(layer) is Linear and "bias" not in layer:
        y = row_product(x, layer.weight, norm=norm, gated=gated, residual=residual)
        if y is not None:
            return y
    if norm is not None:
        x = norm(x)
    if gated:
        x = swiglu(*mx.split(x, 2, axis=-1))
    y = layer(x)
    return y if residual is None else residual + y


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        y = row_product(x, self.weight)
        if y is None:
            return super().__call__(x)
        return y + self.bias if "bias" in self else y

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", quantize_input: bool = False):
        """nn.quantize's hook: an affine layer becomes `qlinear.QuantizedLinear`, nn.QuantizedLinear's
        parameters with the few-row quantized kernel."""
        if mode != "affine" or quantize_input:
            return super().to_quantized(group_size, bits, mode, quantize_input)
        from mlx_hybrid.models.qlinear import QuantizedLinear  # qlinear imports this module

        return QuantizedLinear.from_linear(self, group_size, bits, mode)
