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
    return merge_parts(chunk_parts(logits, k, backend=backend), scores, k, V, backend=backend)


def chunk_parts(logits: mx.array, k: int, *, backend: str) -> list[mx.array]:
    """beam_topk_chunks on logits (B, W, V): each chunk's log-sum-exp parts and k best logits."""
    B, W, V = logits.shape
    chunks = -(-V // (TG * PER_THREAD))
    return load_kernel(backend, "beam_topk_chunks", ("logits",), ("part_m", "part_s", "part_v", "part_i"), reference=_chunks_reference)(
        inputs=[logits],
        template=[("T", logits.dtype), ("K", k), ("TG", TG), ("E", PER_THREAD)],
        grid=(chunks * TG, B * W, 1),
        threadgroup=(TG, 1, 1),
        output_shapes=[(B, W, chunks), (B, W, chunks), (B, W, chunks, k), (B, W, chunks, k)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, mx.int32],
    )


def merge_parts(parts: list[mx.array], scores: mx.array, k: int, V: int, *, backend: str) -> list[mx.array]:
    """beam_topk_merge: the k best continuations over all beams from `chunk_parts`' parts."""
    B = scores.shape[0]
    return load_kernel(backend, "beam_topk_merge", ("part_m", "part_s", "part_v", "part_i", "scores"),
                       ("origin", "token", "score"), reference=_merge_reference)(
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


PAST_END = 2147483647  # the kernels' index of an empty candidate slot


def _best(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest of x along its last axis, largest first, ties to the lower index (argmax
    takes the first), and their indices."""
    values, indices = [], []
    for _ in range(k):
        i = mx.argmax(x, axis=-1, keepdims=True)
        values.append(mx.take_along_axis(x, i, axis=-1))
        indices.append(i)
        x = mx.put_along_axis(x, i, mx.array(-mx.inf, x.dtype), axis=-1)
    return mx.concatenate(values, axis=-1), mx.concatenate(indices, axis=-1).astype(mx.int32)


def _chunks_reference(*, inputs, template, output_shapes, **_):
    """beam_topk_chunks' launch in MLX ops (its fallback): each chunk's max and sum of exponentials
    below it, and its K largest logits with their positions (-3e38 and PAST_END where the chunk
    has fewer)."""
    (logits,) = inputs
    t = dict(template)
    size, chunks = t["TG"] * t["E"], output_shapes[0][2]
    B, W, V = logits.shape
    x = mx.pad(logits.astype(mx.float32), [(0, 0), (0, 0), (0, chunks * size - V)], constant_values=-mx.inf)
    x = x.reshape(B, W, chunks, size)
    m = x.max(axis=-1)
    s = mx.exp(x - m[..., None]).sum(axis=-1)
    values, at = _best(x, t["K"])
    empty = values == -mx.inf
    v = at + mx.arange(chunks, dtype=mx.int32)[:, None] * size
    return [m, s, mx.where(empty, -3.0e38, values), mx.where(empty, PAST_END, v)]


def _merge_reference(*, inputs, template, **_):
    """beam_topk_merge's launch in MLX ops (its fallback): each beam's log-normalizer from its
    chunks' parts, then the K best candidates over all beams and chunks, ties to the lower
    w * V + v (the candidates' order in the parts is that order)."""
    part_m, part_s, part_v, part_i, scores = inputs
    t = dict(template)
    V = t["V"]
    B, W, chunks = part_m.shape
    top = part_m.max(axis=-1, keepdims=True)
    lse = top[..., 0] + mx.log((part_s * mx.exp(part_m - top)).sum(axis=-1))
    x = scores[..., None, None] + (part_v - lse[..., None, None])
    x = mx.where(part_i < V, x, -mx.inf).reshape(B, -1)
    score, at = _best(x, t["K"])
    ids = mx.take_along_axis((mx.arange(W, dtype=mx.int32)[:, None, None] * V + part_i).reshape(B, -1), at, axis=-1)
    return [ids // V, ids % V, score]
