"""Bounds on every number a request, a flag or a settings file sets, from the model and the device.

Past these bounds nothing fails fast: a draft of 100000 tokens runs 100000 draft passes a step,
a verification pass over 100000 nodes asks for 100000 x vocabulary float32 logits, a token id
past the embedding reads outside it, and a top-k past the vocabulary or a negative seed fails
deep inside MLX. Each check raises a one-line `HybridError` naming the input and its bound.
"""

import math

import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_hybrid.errors import HybridError

SEED_BOUND = 2**64  # mx.random.seed takes an unsigned 64-bit integer
# Positions are int32 on the device (`Tree.at`, the kernels' offsets): the longest context a model
# without a stated one can have.
POSITION_BOUND = 2**31 - 1
LOGIT_BYTES = 4  # verification and drafting score every node in float32


def context_of(model: nn.Module) -> int:
    """The model's context in tokens (config.json's max_position_embeddings, else the position bound)."""
    return getattr(model.args, "max_position_embeddings", None) or POSITION_BOUND


def check_sampling(params, vocab_size: int | None = None):
    """Temperature, top-p, min-p, repetition penalty finite and in range; top-k below the
    vocabulary (mlx-lm's top-k partitions the logits at k); a seed MLX and numpy both take."""
    for name, value in (("temperature", params.temp), ("top-p", params.top_p), ("min-p", params.min_p),
                        ("repetition penalty", params.repetition_penalty)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise HybridError(f"{name} must be a finite number, got {value}")
    if params.temp < 0:
        raise HybridError(f"temperature must be >= 0, got {params.temp}")
    if not 0 <= params.top_p <= 1:
        raise HybridError(f"top-p must be in [0, 1], got {params.top_p}")
    if not 0 <= params.min_p <= 1:
        raise HybridError(f"min-p must be in [0, 1], got {params.min_p}")
    if params.repetition_penalty is not None and params.repetition_penalty <= 0:
        raise HybridError(f"repetition penalty must be > 0, got {params.repetition_penalty}")
    if not isinstance(params.top_k, int) or params.top_k < 0:
        raise HybridError(f"top-k must be an integer >= 0, got {params.top_k}")
    if vocab_size is not None and params.top_k >= vocab_size:
        raise HybridError(f"top-k must be below the vocabulary size ({vocab_size}), got {params.top_k}")
    if not isinstance(params.repetition_context_size, int) or params.repetition_context_size < 1:
        raise HybridError(f"repetition context must be an integer >= 1, got {params.repetition_context_size}")
    if params.seed is not None and not (isinstance(params.seed, int) and 0 <= params.seed < SEED_BOUND):
        raise HybridError(f"seed must be an integer in [0, 2^64), got {params.seed}")


def check_token_ids(tokens, vocab_size: int) -> list[int]:
    """tokens as a list of ints, each an id of the model's vocabulary (an id past the embedding
    table would read memory outside it)."""
    try:
        ids = np.asarray(tokens)
    except (ValueError, TypeError, OverflowError):
        ids = np.asarray([], object)
    if ids.ndim != 1 or (ids.size and (ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer))):
        raise HybridError("a prompt given as tokens must be a flat list of integer token ids")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise HybridError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return ids.tolist()


def clip_max_tokens(max_tokens: int, model: nn.Module, used: int = 0) -> int:
    """max_tokens cut to the context left after `used` tokens; >= 1 or a HybridError."""
    if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
        raise HybridError(f"max tokens must be >= 1, got {max_tokens}")
    return min(max_tokens, max(1, context_of(model) - used))


def tree_limit(model: nn.Module) -> int:
    """The most nodes one verification pass may hold: within the model's context, and with its
    float32 logits (nodes x vocabulary) within what the device's memory budget leaves beside the
    weights (`adaptive.default_budget`)."""
    from mlx_hybrid.adaptive import default_budget

    budget, _ = default_budget()
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    memory = max(1, (budget - weights) // (LOGIT_BYTES * model.args.vocab_size))
    return min(context_of(model) - 1, memory)


def check_tree_size(nodes: int, model: nn.Module, what: str):
    """A candidate tree of `nodes` nodes (root included) that `what` asks for fits `tree_limit`."""
    limit = tree_limit(model)
    if nodes > limit:
        raise HybridError(f"{what} makes verification trees of {nodes} tokens; this model and device take at most {limit}")


def check_draft_count(k, model: nn.Module):
    if not isinstance(k, int) or k < 1:
        raise HybridError(f"the draft must propose at least 1 token per step, got {k}")
    check_tree_size(k + 1, model, f"--num-draft {k}")


def check_beam(width, length, model: nn.Module, what: str = "ReDrafter"):
    """A ReDrafter beam: width in [1, vocabulary], length >= 2 (the root and a draft), and its
    packed tree (at most width x (length - 1) + 1 nodes) within `tree_limit`."""
    if not (isinstance(width, int) and isinstance(length, int)) or width < 1 or length < 2:
        raise HybridError(f"{what}: beam width must be >= 1 and length >= 2, got {width} x {length}")
    if width > model.args.vocab_size:
        raise HybridError(f"{what}: beam width {width} exceeds the vocabulary ({model.args.vocab_size})")
    check_tree_size(width * (length - 1) + 1, model, f"{what} beam {width}x{length}")
