"""The k best continuations of a beam-search step, best first: ReDrafter's beam search takes one
per drafted token, and Medusa takes each head's best tokens as a one-beam step per head.

`beam_step_ref` is the reference in MLX ops, which every device without a kernel runs; on a GPU
`beam_step` is two kernel launches instead of ~14 small ops: many threadgroups each take a chunk
of a beam's logits (metal_kernels/beam_topk_chunks.cu), then one per sequence merges the chunks
(beam_topk_merge.cu). A threadgroup per sequence alone read 4 x 49152 logits with one SM's worth
of threads, latency-bound: by the H100's draft timings, most of a 3.5 ms ReDrafter draft
(benchmarks/README.md, "The beam step on one SM").
"""

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.kernels import kernel_backend, load_kernel

TG = 128  # threads a threadgroup: with k <= 16 its candidate lists fit Metal's 32 KB
PER_THREAD = 16  # logits a thread reads in beam_topk_chunks, all loads issued before any is used


def beam_step(logits: mx.array, scores: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """The k best continuations of a beam search step, best first: for logits (B, W, V) after each
    of W beams with log-probabilities scores (B, W), the beam each continues, its token and its
    new score, each (B, k)."""
    backend = kernel_backend()
    B, W, V = logits.shape
    if backend is None or k > 16 or W > k:  # the kernels keep k candidates per thread in threadgroup memory
        return beam_step_ref(logits, scores, k)
    chunks = -(-V // (TG * PER_THREAD))
    parts = load_kernel(backend, "beam_topk_chunks", ("logits",), ("part_m", "part_s", "part_v", "part_i"))(
        inputs=[logits],
        template=[("T", logits.dtype), ("K", k), ("TG", TG), ("E", PER_THREAD)],
        grid=(chunks * TG, B * W, 1),
        threadgroup=(TG, 1, 1),
        output_shapes=[(B, W, chunks), (B, W, chunks), (B, W, chunks, k), (B, W, chunks, k)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, mx.int32],
    )
    return load_kernel(backend, "beam_topk_merge", ("part_m", "part_s", "part_v", "part_i", "scores"),
                       ("origin", "token", "score"))(
        inputs=[*parts, scores.astype(mx.float32)],
        template=[("K", k), ("TG", TG), ("V", V)],
        grid=(TG * B, 1, 1),
        threadgroup=(TG, 1, 1),
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
