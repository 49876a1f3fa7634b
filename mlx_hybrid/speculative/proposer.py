"""What speculative decoding asks of a proposer, and how one is loaded.

A proposer drafts the candidates a step verifies: Medusa heads and a ReDrafter drafter read the
target's last hidden state, a draft model reads the tokens. Every proposer can `propose` on the
host, at any temperature; Medusa and ReDrafter can also `draft` without leaving the device, which
the greedy loop uses to queue each pass before the host has read the last one.
"""

from pathlib import Path
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from mlx_hybrid.errors import HybridError
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.speculative.accept import Candidates, Draft

METHODS = ("medusa", "redrafter", "draft")
# Where each method's files are looked for inside the target model's directory (docs/formats/speculative-heads.md).
SUBDIRS = {"medusa": "medusa", "redrafter": "redrafter", "draft": "draft"}


class Proposer(Protocol):
    name: str  # the method: medusa, redrafter or draft
    depth: int  # the most drafts one step can accept
    drafts_on_device: bool  # whether `draft` exists

    def propose(self, history: list[int], hidden: mx.array, sampling: SamplingParams) -> Candidates:
        """Candidates after history (the last token is the root) and the hidden state that produced it."""

    def draft(self, root: mx.array, hidden: mx.array) -> Draft:
        """Greedy candidates from root (1,) and hidden (H,), left on the device."""


def load_proposer(
    method: str,
    target: nn.Module,
    model_dir: str | Path | None = None,
    path: str | Path | None = None,
    num_draft: int = 4,
    settings=None,
    heads_dtype: str | None = None,
    tokenizer=None,
) -> "Proposer":
    """The proposer for method, its files at path or else in model_dir's subdirectory for it;
    settings (`mlx_hybrid.profiles.Settings`): the beam or tree to use instead of the defaults;
    heads_dtype: the float dtype Medusa heads or a drafter compute in (default: the target's);
    tokenizer: the target's, which a draft model's own tokenizer must agree with."""
    if method not in METHODS:
        raise HybridError(f"unknown speculative method '{method}' (choose from {', '.join(METHODS)})")
    if path is None:
        if model_dir is None:
            raise HybridError(f"--speculative {method} needs the path of its {SUBDIRS[method]} directory")
        path = Path(model_dir) / SUBDIRS[method]
        if not path.is_dir():
            raise HybridError(f"no {SUBDIRS[method]}/ directory in {model_dir}; give its path")
    if method == "medusa":
        from mlx_hybrid.speculative.medusa import MedusaProposer, load_medusa
        from mlx_hybrid.speculative.tree import MedusaTree

        heads = load_medusa(path, target, heads_dtype)
        tree = None
        if settings is not None and settings.medusa_choices:
            tree = MedusaTree(settings.medusa_choices)
        elif settings is not None and settings.tree_size:
            tree = heads.tree_of_size(settings.tree_size)
        return MedusaProposer(heads, tree, target)
    if method == "redrafter":
        from mlx_hybrid.speculative.redrafter import ReDrafterProposer, load_redrafter

        width, length = (settings.beam_width, settings.beam_length) if settings is not None else (None, None)
        return ReDrafterProposer(load_redrafter(path, target, heads_dtype), target, width, length)
    from mlx_hybrid.loader import load_model
    from mlx_hybrid.speculative.draft import DraftProposer
    from mlx_hybrid.validate import check_same_vocabulary

    if tokenizer is not None:
        check_same_vocabulary(Path(path), tokenizer)
    return DraftProposer(load_model(path), target, num_draft)
