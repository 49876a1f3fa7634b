"""Rotary position embeddings, including Llama 3.1's frequency scaling.

The inverse frequencies are computed once here and handed to `mx.fast.rope`, so every
scaling type runs through the same fused kernel.
"""

import math

import mlx.core as mx


def rope_frequencies(dims: int, base: float, scaling: dict | None) -> mx.array:
    """Per-pair wavelength multipliers (the `freqs` argument of `mx.fast.rope`)."""
    freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return freqs
    if kind == "linear":
        return freqs * scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelens = 2 * math.pi * freqs
        smooth = (old_len / wavelens - low) / (high - low)
        medium = freqs / ((1 - smooth) / factor + smooth)
        scaled = mx.where(wavelens > old_len / low, freqs * factor, freqs)
        is_medium = (wavelens > old_len / high) & (wavelens < old_len / low)
        return mx.where(is_medium, medium, scaled)
    raise ValueError(f"unsupported rope_scaling type '{kind}' (supported: default, linear, llama3)")


def apply_rope(x: mx.array, freqs: mx.array, offset: int, traditional: bool = False) -> mx.array:
    """Rotate x (batch, heads, length, head_dim) for positions offset, offset+1, ..."""
    return mx.fast.rope(
        x, x.shape[-1], traditional=traditional, base=None, scale=1.0, offset=offset, freqs=freqs
    )


def apply_rope_at(x: mx.array, freqs: mx.array, positions: mx.array, traditional: bool = False) -> mx.array:
    """Rotate x (tokens, heads, 1, head_dim), one token per batch entry, each at its own position
    (positions: (tokens,) ints).

    Candidate-tree tokens are not consecutive (siblings share a position), so each token is its
    own batch entry with its own offset: the same fused kernel, hence the same values, as decoding
    the tokens one by one."""
    return mx.fast.rope(x, x.shape[-1], traditional=traditional, base=None, scale=1.0, offset=positions, freqs=freqs)
