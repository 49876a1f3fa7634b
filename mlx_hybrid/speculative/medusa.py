"""Medusa heads (Cai et al.): K extra heads on the target's last hidden state, head k guessing the
token k + 2 places ahead; their top-k guesses form a candidate tree verified in one pass.

Layout and tensor names: docs/formats/speculative-heads.md. The tree is the heads directory's `medusa_choices` (written
by `calibrate`, the greedy construction of section 3.3.1 from head accuracies measured here) or
else a small Cartesian tree.

Heads with `tied_lm_head` end in the target's own LM head instead of one each: a draft then
reads one vocabulary projection for all the heads (their rows in one product) instead of K. With
Llama 3's 128256-token vocabulary K = 4 projections of their own are 0.85 of a Llama-3.2-1B
decode step's read and 0.28 of a Llama-3-8B one's (docs/speculative.md, Performance model).
"""

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_hybrid.errors import HybridError
from mlx_hybrid.limits import check_tree_size
from mlx_hybrid.models.linear import Linear
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.speculative.accept import Candidates, Draft
from mlx_hybrid.speculative.calibration import GreedyRun, greedy_runs
from mlx_hybrid.speculative.load import check_blocks, check_target, load_into, read_config, target_head_state
from mlx_hybrid.speculative.topk import beam_step
from mlx_hybrid.speculative.tree import MedusaTree, cartesian_paths, expected_length, greedy_paths

# Default tree without calibration: top-3 of head 0, top-2 of heads 1-2, top-1 further out.
DEFAULT_TOPK = (3, 2, 2)


@dataclass
class MedusaConfig:
    medusa_num_heads: int
    medusa_num_layers: int
    hidden_size: int
    vocab_size: int
    medusa_choices: list | None = None
    head_accuracies: list | None = None  # written by `calibrate`
    tied_lm_head: bool = False  # the target's LM head after the ResBlocks, none of each head's own

    @classmethod
    def from_dict(cls, config: dict) -> "MedusaConfig":
        return cls(**{k: config[k] for k in cls.__dataclass_fields__ if k in config})


class ResBlock(nn.Module):
    def __init__(self, dims: int):
        super().__init__()
        self.linear = Linear(dims, dims)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, target_head=None):
        """target_head: the target's hidden-to-logits function, which `tied_lm_head` heads end
        with (a plain attribute, not a parameter: the weights stay the target's)."""
        super().__init__()
        self.config = config
        H, V, L = config.hidden_size, config.vocab_size, config.medusa_num_layers
        self.medusa_head = [[ResBlock(H) for _ in range(L)] + ([] if config.tied_lm_head else [nn.Linear(H, V, bias=False)])
                            for _ in range(config.medusa_num_heads)]
        self.target_head = target_head
        self._stacks = {}  # the heads' weights stacked layer by layer (`fuse`)

    def __call__(self, h: mx.array) -> mx.array:
        """Logits (heads, ..., vocab) for hidden states h (..., hidden)."""
        if not self._stacks:
            out = []
            for head in self.medusa_head:
                x = h
                for layer in head:
                    x = layer(x)
                out.append(x)
            x = mx.stack(out)
        else:
            x = h.reshape(1, -1, h.shape[-1])
            for w, b in self._stacks["blocks"]:
                x = x + nn.silu(_per_head(x, w) + b[:, None])
            if not self.config.tied_lm_head:
                x = _per_head(x, self._stacks["lm"])
        if self.config.tied_lm_head:  # every head's rows through the one projection: one read of it
            x = self.target_head(x.reshape(-1, x.shape[-1]))
        return x.reshape(len(self.medusa_head), *h.shape[:-1], -1)

    def fuse(self):
        """Stack the heads' weights layer by layer, so that each layer of all the heads is one
        batched product: a draft from one hidden state is 3 kernel launches on a GPU instead of 16
        (a ResBlock product, its SiLU and the LM head a head, and their stacking). The heads' own
        parameters become views of the stacks, so the weights are not held twice. Quantized heads
        stay apart (one quantized product a head)."""
        if any(isinstance(m, nn.QuantizedLinear) for _, m in self.named_modules()):
            return
        L, tied = self.config.medusa_num_layers, self.config.tied_lm_head
        blocks = [(mx.stack([h[j].linear.weight for h in self.medusa_head]), mx.stack([h[j].linear.bias for h in self.medusa_head]))
                  for j in range(L)]
        lm = None if tied else mx.stack([h[L].weight for h in self.medusa_head])
        for i, head in enumerate(self.medusa_head):
            for j, (w, b) in enumerate(blocks):
                head[j].linear.weight, head[j].linear.bias = w[i], b[i]
            if not tied:
                head[L].weight = lm[i]
        mx.eval(blocks, lm, self.parameters())
        self._stacks = {"blocks": blocks, "lm": lm}

    def default_tree(self) -> MedusaTree:
        if self.config.medusa_choices:
            return MedusaTree(self.config.medusa_choices)
        k = self.config.medusa_num_heads
        return MedusaTree(cartesian_paths(list(DEFAULT_TOPK[:k]) + [1] * max(0, k - len(DEFAULT_TOPK))))

    def tree_of_size(self, size: int) -> MedusaTree:
        """A tree of size candidates: the greedy sparse tree from the calibrated accuracies, else
        the first size nodes of the default tree (breadth first, so every prefix stays in)."""
        if self.config.head_accuracies:
            return MedusaTree(greedy_paths(np.array(self.config.head_accuracies)[: self.config.medusa_num_heads], size))
        return MedusaTree(self.default_tree().paths[:size])


def check_choices(choices, num_heads, target: nn.Module | None, where: str) -> MedusaTree:
    """The tree of `choices` (paths from a heads config or a tuning profile, named by `where`),
    checked before use: a list, within the model's tree bound (checked before it is built: a
    tree's ancestor mask is nodes x nodes), well formed, and no deeper than the heads go."""
    if not isinstance(choices, list):
        raise HybridError(f"{where}: medusa_choices must be a list of paths")
    if target is not None:
        check_tree_size(len(choices) + 1, target, where)
    try:
        tree = MedusaTree(choices)
    except (ValueError, TypeError, IndexError, OverflowError) as e:
        raise HybridError(f"{where}: bad medusa_choices ({e})") from None
    if not isinstance(num_heads, int) or tree.num_heads > num_heads:
        raise HybridError(f"{where}: medusa_choices go {tree.num_heads} heads deep, the heads have {num_heads}")
    return tree


def load_medusa(path: str | Path, target: nn.Module, dtype: str | None = None) -> MedusaHeads:
    path = Path(path)
    config = read_config(path, "medusa", ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size"))
    check_target(path, config, target)
    tied = config.get("tied_lm_head", False)
    if not isinstance(tied, bool):
        raise HybridError(f"{path / 'config.json'}: 'tied_lm_head' must be true or false, got {tied!r}")
    check_blocks(path, config["medusa_num_heads"], "medusa_head.", "medusa_num_heads")
    if tied:
        check_blocks(path, config["medusa_num_layers"], "medusa_head.0.", "medusa_num_layers (ResBlocks; the LM head is the target's)")
    else:
        check_blocks(path, config["medusa_num_layers"] + 1, "medusa_head.0.", "medusa_num_layers + 1 (ResBlocks and the LM head)")
    heads = MedusaHeads(MedusaConfig.from_dict(config), target._logits if tied else None)
    if heads.config.medusa_choices:
        check_choices(heads.config.medusa_choices, heads.config.medusa_num_heads, target, f"{path / 'config.json'}")
    load_into(heads, path, config, target, dtype)
    heads.fuse()
    return heads


def _per_head(x: mx.array, w: mx.array) -> mx.array:
    """x (1 or heads, n, in) through each head's weight w (heads, out, in): (heads, n, out). One
    row is a batch of matrix-vector products, which MLX's CUDA backend runs as one kernel (a
    matmul would go to cuBLASLt, 11-19 us of host time a call: models/linear.py)."""
    if x.shape[1] == 1:
        return (w @ x.swapaxes(1, 2)).swapaxes(1, 2)
    return x @ w.swapaxes(1, 2)


class MedusaProposer:
    """Candidates from the heads' top-k tokens at the hidden state that produced the root."""

    name = "medusa"
    drafts_on_device = True

    def __init__(self, heads: MedusaHeads, tree: MedusaTree | None = None, target: nn.Module | None = None):
        """target: the model the heads draft for, whose LM head `tied_lm_head` heads end with."""
        if heads.config.tied_lm_head and target is None:
            raise HybridError("Medusa heads with tied_lm_head draft through the target's LM head: give the target")
        self.heads = heads
        self.tree = tree or heads.default_tree()
        self.depth = self.tree.num_heads
        self._top = max(self.tree.topk)
        self._rows = mx.array(self.tree.retrieve)
        self._no_scores = mx.zeros((self.depth, 1))
        mx.eval(self._no_scores)  # else the trace below would fill it again every pass
        # One shape per tree: compiled once, replayed each pass (see `ReDrafterProposer`); the
        # weights are inputs, the target's LM head's too where the heads end with it.
        head = [target_head_state(target)] if heads.config.tied_lm_head else []
        self._tokens = mx.compile(self._tree_tokens, inputs=[heads.state] + head)

    def draft(self, root: mx.array, hidden: mx.array) -> Draft:
        """The tree's tokens from root (1,) and the heads' top-k at hidden (H,), on the device."""
        return Draft(self._tokens(root, hidden), self.tree.tree, self._rows)

    def _tree_tokens(self, root: mx.array, hidden: mx.array) -> mx.array:
        logits = self.heads(hidden)[: self.depth, None]  # (depth, 1, V)
        # Each head's best tokens, best first: a one-beam search step per head (one kernel on a GPU).
        _, top, _ = beam_step(logits, self._no_scores, self._top)
        return self.tree.tokens(root, top)

    def propose(self, history: list[int], hidden: mx.array, sampling: SamplingParams) -> Candidates:
        tokens = self.draft(mx.array(history[-1:]), hidden).tokens
        return Candidates(np.array(tokens), self.tree.parents, tree=self.tree.tree)


def head_accuracies(heads: MedusaHeads, runs: list[GreedyRun], topk: int = 10) -> np.ndarray:
    """accuracies[h][k]: how often head h's rank-k token is the target's own greedy continuation,
    over the target's greedy runs (`calibration.greedy_runs`; Medusa section 3.3.1)."""
    K = heads.config.medusa_num_heads
    hits, counts = np.zeros((K, topk)), np.zeros(K)
    for run in runs:
        ranks = np.array(mx.argsort(-heads(run.hidden), axis=-1)[..., :topk])  # (K, n, topk)
        for h in range(K):
            for t in range(ranks.shape[1]):
                target = run.start + t + h + 2
                if target < len(run.tokens):
                    counts[h] += 1
                    hit = np.flatnonzero(ranks[h, t] == run.tokens[target])
                    if hit.size:
                        hits[h, hit[0]] += 1
    return hits / np.maximum(counts, 1)[:, None]


def calibrate(model: nn.Module, heads_dir: str | Path, prompts: list[list[int]], num_nodes: int = 63, new_tokens: int = 64, topk: int = 10) -> dict:
    """Measure head accuracies on prompts, build the greedy sparse tree of num_nodes candidates and
    store it (with the accuracies) in the heads' config.json; returns what was written."""
    heads_dir = Path(heads_dir)
    heads = load_medusa(heads_dir, model)
    acc = head_accuracies(heads, greedy_runs(model, prompts, new_tokens), topk)
    paths = greedy_paths(acc, num_nodes)
    config = json.loads((heads_dir / "config.json").read_text())
    config.update(medusa_choices=paths, head_accuracies=acc.round(6).tolist())
    fd, tmp = tempfile.mkstemp(dir=heads_dir, suffix=".json.tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, heads_dir / "config.json")
    return {"medusa_choices": paths, "head_accuracies": acc.tolist(), "expected_length": expected_length(paths, acc)}
