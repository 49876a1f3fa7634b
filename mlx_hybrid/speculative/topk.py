"""The k best continuations of a beam-search step, best first: ReDrafter's beam search takes one
per drafted token, and Medusa takes each head's best tokens as a one-beam step per head.

`beam_step_ref` is the reference in MLX ops, which every device without a kernel runs; on a GPU
`beam_step` is one kernel launch (metal_kernels/beam_topk.cu) instead of ~14 small ops.
"""

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import kernel_backend, load_kernel


def beam_step(logits: mx.array, scores: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """The k best continuations of a beam search step, best first: for logits (B, W, V) after each
    of W beams with log-probabilities scores (B, W), the beam each continues, its token and its
    new score, each (B, k)."""
    backend = kernel_backend()
    if backend is None or k > 16:  # the kernel keeps k candidates per thread in threadgroup memory
        return beam_step_ref(logits, scores, k)
    B = logits.shape[0]
    return load_kernel(backend, "beam_topk", ("logits", "scores"), ("origin", "token", "score"))(
        inputs=[logits, scores.astype(mx.float32)],
        template=[("T", logits.dtype), ("K", k), ("TG", 128)],
        grid=(128 * B, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(B, k)] * 3,
        output_dtypes=[mx.int32, mx.int32, mx.float32],
    )


def beam_step_ref(logits: mx.array, scores: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """`beam_step` in MLX ops."""
    B, _, V = logits.shape
    total = (scores[..., None] + nn.log_softmax(logits.astype(mx.float32), axis=-1)).reshape(B, -1)
    best = mx.argpartition(-total, k - 1, axis=-1)[:, :k]
    best = mx.take_along_axis(best, mx.argsort(-mx.take_along_axis(total, best, axis=-1), axis=-1), axis=-1)
    return (best // V).astype(mx.int32), (best % V).astype(mx.int32), mx.take_along_axis(total, best, axis=-1)
