"""Which layers keep attention: every n-th, an explicit list, or DSLA-Serve's attention-entropy ranking.

Attention entropy (DSLA-Serve eq. 11) of a layer is the entropy of its attention weights for the
final query of a prompt, averaged over heads and calibration prompts. A layer with low entropy
attends to few tokens and is the least sensitive to linearization, so layers are converted in
ascending entropy and the highest-entropy layers keep attention.
"""

import math

import torch

from hybrid_train.errors import TrainError


@torch.no_grad()
def attention_entropy(teacher, prompts: list[list[int]]) -> list[float]:
    """Mean entropy (nats) of each layer's final-query attention over the prompts (token id lists)."""
    previous = teacher.config._attn_implementation
    teacher.set_attn_implementation("eager")  # the fused kernels do not return attention weights
    try:
        total = torch.zeros(teacher.config.num_hidden_layers, dtype=torch.float64)
        device = next(teacher.parameters()).device
        for ids in prompts:
            out = teacher(torch.tensor([ids], device=device), output_attentions=True, use_cache=False)
            for i, att in enumerate(out.attentions):
                p = att[0, :, -1].double()  # (heads, L): the final query's weights
                total[i] += -(p * p.clamp_min(1e-30).log()).sum(-1).mean().cpu()
    finally:
        teacher.set_attn_implementation(previous)
    return (total / len(prompts)).tolist()


def conversion_order(entropy: list[float]) -> list[int]:
    """Layers in the order to convert them: ascending attention entropy (least sensitive first)."""
    return sorted(range(len(entropy)), key=lambda i: (entropy[i], i))


def attention_layers(spec: dict, n_layers: int, entropy: list[float] | None = None) -> list[int]:
    """The layers that keep attention, from a config spec:

    {"every": n}               keep layers 0, n, 2n, ... (MambaInLlama's interleave; n=2 is 50%)
    {"layers": [i, ...]}       keep exactly these
    {"entropy": ..., "keep": k} keep the k (or the fraction k < 1) highest-entropy layers
    """
    if "every" in spec:
        n = spec["every"]
        if not isinstance(n, int) or n < 1:
            raise TrainError(f"attention.every must be a positive integer, got {n!r}")
        return list(range(0, n_layers, n))
    if "layers" in spec:
        layers = sorted(set(spec["layers"]))
        bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < n_layers]
        if bad:
            raise TrainError(f"attention.layers: {bad[0]!r} is not a layer index in [0, {n_layers})")
        return layers
    if "entropy" in spec:
        keep = spec.get("keep")
        if not isinstance(keep, (int, float)) or keep < 0:
            raise TrainError("attention.entropy needs keep: a layer count or a fraction in (0, 1)")
        count = math.ceil(keep * n_layers) if isinstance(keep, float) and keep < 1 else int(keep)
        if count > n_layers:
            raise TrainError(f"attention.keep {keep} exceeds the {n_layers} layers")
        return sorted(conversion_order(entropy)[n_layers - count :])
    raise TrainError(f"attention spec needs one of every, layers, entropy; got {sorted(spec)}")
