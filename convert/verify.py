"""Check a conversion: run the source in PyTorch and the converted model in MLX on the same prompts.

NaN or Inf weights never get this far (conversion and loading refuse them, naming the tensor);
what this reports besides the differences is NaN or Inf in the converted logits.

The source runs in float32: transformers for Llama/Mistral, the float64-scan reference in
`torch_hybrid` for hybrids (transformers has no Mamba-in-Llama or DSLA layers). The converted
model runs in float32 too, so what differs is what the conversion changed (dtype, quantization).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_hybrid.convert.checkpoint import Checkpoint, require_torch, torch_state

PROMPTS = (
    "The capital of France is",
    "Once upon a time there was a little robot who loved to read books.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Speculative decoding verifies many drafted tokens in one forward pass.",
)


@dataclass
class Verification:
    prompts: int
    max_diff: float  # largest |logit difference| over every position of every prompt
    agree: int  # positions whose top-1 token is the same
    positions: int
    nonfinite: int = 0  # positions whose converted logits hold NaN or Inf (an overflow in the dtype)

    def __str__(self) -> str:
        bad = f"; {self.nonfinite} positions with NaN/Inf logits" if self.nonfinite else ""
        return (
            f"{self.prompts} prompts, {self.positions} positions: largest |logit difference| {self.max_diff:.3g}, "
            f"top-1 agreement {100 * self.agree / self.positions:.1f}% ({self.agree}/{self.positions}){bad}"
        )


def torch_model(checkpoint: Checkpoint):
    """The source checkpoint as a float32 PyTorch model."""
    import torch

    if checkpoint.kind in ("llama", "mistral"):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=torch.float32, trust_remote_code=False).eval()
    from mlx_hybrid.convert.torch_hybrid import build_reference

    return build_reference(checkpoint.config, torch_state(checkpoint))


def verify(checkpoint: Checkpoint, dst: str | Path, prompts=PROMPTS) -> Verification:
    import mlx.core as mx

    from mlx_hybrid.loader import load

    torch = require_torch("--verify")

    model, tokenizer = load(dst, "float32")
    reference = torch_model(checkpoint)
    max_diff, agree, positions, nonfinite = 0.0, 0, 0, 0
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        ours = np.array(model(mx.array([ids]))[0])
        with torch.no_grad():
            theirs = reference(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
        nonfinite += int((~np.isfinite(ours)).any(-1).sum())
        max_diff = max(max_diff, float(np.abs(ours - theirs).max()))
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        positions += len(ids)
    return Verification(len(prompts), max_diff, agree, positions, nonfinite)
