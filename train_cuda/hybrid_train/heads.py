"""Medusa heads and the ReDrafter drafter in PyTorch, with the MLX runtime's tensor names and math
(`docs/formats/speculative-heads.md`, `medusa.py`, `redrafter.py`), so `state_dict()` is the export.

Both read the base model's last hidden state h_t (after the final norm, the input of its lm_head).
Positions, as in the runtime: the base's own head predicts token t+1 from h_t; Medusa head k
(k = 1..K, stored as medusa_head.{k-1}) predicts token t+k+1; ReDrafter's step j (j = 1..T) predicts
token t+j+1 from h_t and the tokens t+1..t+j (the first is the base's own next token). During
training those tokens are the sequence's own (teacher forcing): on the base's greedy continuations
they are exactly what the drafter will be fed at inference when its guesses are right.

A base model is a Hugging Face Llama/Mistral directory, a .gguf file (`teacher.py`) or a hybrid
directory (`model.py`); all are transformers CausalLMs, so `base.model(...)` gives h and
`base.lm_head` its logits.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from hybrid_train import data
from hybrid_train.errors import TrainError
from hybrid_train.losses import IGNORE
from hybrid_train.model import load_hybrid
from hybrid_train.teacher import load_teacher
from hybrid_train.train import set_checkpointing


def load_base(path: str | Path, dtype=torch.float32, device="cpu"):
    """A frozen base model in eval mode: a teacher (HF directory or .gguf) or a hybrid directory."""
    path = Path(path)
    if path.suffix != ".gguf" and (path / "config.json").is_file():
        if json.loads((path / "config.json").read_text()).get("model_type") == "llama_hybrid":
            model = load_hybrid(path, dtype)
            model.requires_grad_(False)
            return model.to(device).eval()
    return load_teacher(path, dtype, device)


def is_recurrent(model) -> bool:
    """Whether any layer is a recurrent mixer (no KV cache, and padding would enter its state)."""
    return any(getattr(layer, "kind", "attention") != "attention" for layer in model.model.layers)


def hidden_states(base, input_ids: torch.Tensor) -> torch.Tensor:
    """The last hidden state (batch, L, hidden): the output of the final norm."""
    return base.model(input_ids=input_ids, use_cache=False).last_hidden_state


def ahead_mask(labels: torch.Tensor, k: int) -> torch.Tensor:
    """(batch, L - k): positions t whose hidden state lies on the response (labels[t] is a response
    token, the base's own next one) and whose token t+k+1 (labels[t+k]) exists in it."""
    L = labels.shape[1]
    return (labels[:, : L - k] != IGNORE) & (labels[:, k:] != IGNORE)


class ResBlock(nn.Module):
    """x + silu(W x + b), starting as the identity (W = 0, b = 0) as Medusa's reference code does."""

    def __init__(self, dims: int):
        super().__init__()
        self.linear = nn.Linear(dims, dims)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of ResBlocks, each ending in an LM head of its own (Medusa's layout) or, with
    tied_lm_head, in the base's own (frozen in Medusa-1) LM head: the heads are then K x L
    ResBlocks and a draft reads one vocabulary projection for all of them instead of K, which at
    Llama 3's 128256 tokens is most of what the heads cost (docs/speculative.md)."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1, tied_lm_head: bool = False):
        super().__init__()
        self.hidden, self.vocab, self.num_heads, self.num_layers, self.tied_lm_head = hidden, vocab, num_heads, num_layers, tied_lm_head
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], *([] if tied_lm_head else [nn.Linear(hidden, vocab, bias=False)]))
            for _ in range(num_heads)
        )
        self.__dict__["base_head"] = None  # the base's LM head when tied: not a parameter of the heads

    @classmethod
    def for_base(cls, base, num_heads: int, num_layers: int = 1, tied_lm_head: bool = False) -> "MedusaHeads":
        """Heads whose LM heads start as copies of the base's (Medusa's reference initialization),
        or that end with the base's own."""
        heads = cls(base.config.hidden_size, base.config.vocab_size, num_heads, num_layers, tied_lm_head)
        with torch.no_grad():
            if tied_lm_head:
                heads.__dict__["base_head"] = base.lm_head
            else:
                for head in heads.medusa_head:
                    head[-1].weight.copy_(base.lm_head.weight)
        return heads

    def forward(self, h: torch.Tensor, masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Logits of head k at the positions masks[k-1] selects (from `ahead_mask(labels, k)`): (n_k, vocab)."""
        L = h.shape[1]
        out = [head(h[:, : L - k][mask]) for k, (head, mask) in enumerate(zip(self.medusa_head, masks), 1)]
        return [self.base_head(x) for x in out] if self.tied_lm_head else out

    def config(self) -> dict:
        return {"model_type": "medusa", "medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "hidden_size": self.hidden, "vocab_size": self.vocab, **({"tied_lm_head": True} if self.tied_lm_head else {})}


class MedusaLM(nn.Module):
    """Medusa-2: the backbone and its heads, trained together."""

    def __init__(self, base, heads: MedusaHeads):
        super().__init__()
        self.base, self.heads = base, heads

    def forward(self, input_ids: torch.Tensor, masks: list[torch.Tensor]):
        """The backbone's logits (batch, L, vocab) and the heads' (as MedusaHeads.forward)."""
        h = hidden_states(self.base, input_ids)
        return self.base.lm_head(h), self.heads(h, masks)

    def activation_checkpointing_enable(self, **kwargs):
        """The backbone's (the heads are too small to checkpoint)."""
        set_checkpointing(self.base, True)

    def activation_checkpointing_disable(self):
        set_checkpointing(self.base, False)


class Drafter(nn.Module):
    """ReDrafter's recurrent drafter (ml-recurrent-drafter's `Drafter` layout).

    tied_lm_head: the last ResBlock's output goes through the base's own (frozen) LM head instead of
    a vocabulary-sized layer of the drafter's own, so the drafter is ~2 M parameters instead of
    vocab x exit_dim more (57 M for SmolLM2's 49152 tokens): small enough to ship as package data.
    Then exit_dim is the hidden size and input_proj starts as [I, 0] (the drafter first guesses the
    base's own next token from h, like Medusa's copied heads)."""

    def __init__(self, hidden: int, vocab: int, exit_dim: int | None = None, num_draft_layers: int = 2, rnn: bool = True,
                 tied_lm_head: bool = False):
        super().__init__()
        self.hidden, self.vocab, self.rnn, self.tied_lm_head = hidden, vocab, rnn, tied_lm_head
        self.exit_dim = hidden if tied_lm_head else exit_dim or 2 * hidden
        if tied_lm_head and exit_dim not in (None, hidden):
            raise TrainError(f"a drafter with tied_lm_head has exit_dim = hidden ({hidden}), not {exit_dim}")
        if self.exit_dim != 2 * hidden:
            self.input_proj = nn.Linear(2 * hidden, self.exit_dim)
        own_head = [] if tied_lm_head else [nn.Linear(self.exit_dim, vocab, bias=False)]
        self.lm_head = nn.Sequential(*[ResBlock(self.exit_dim) for _ in range(num_draft_layers)], *own_head)
        self.__dict__["base_head"] = None  # the base's LM head when tied: not a parameter of the drafter
        if rnn:
            self.rnn_u = nn.Linear(hidden, hidden, bias=True)
            self.rnn_w = nn.Linear(hidden, hidden, bias=False)

    @classmethod
    def for_base(cls, base, exit_dim: int | None = None, num_draft_layers: int = 2, rnn: bool = True,
                 tied_lm_head: bool = False) -> "Drafter":
        """Without input_proj, the LM head starts as [base lm_head, 0]: at first the drafter guesses
        from h alone, like Medusa's copied heads; the state's half then learns from zero."""
        d = cls(base.config.hidden_size, base.config.vocab_size, exit_dim, num_draft_layers, rnn, tied_lm_head)
        with torch.no_grad():
            if tied_lm_head:
                d.__dict__["base_head"] = base.lm_head
                d.input_proj.weight.zero_()
                d.input_proj.weight[:, : d.hidden].copy_(torch.eye(d.hidden))
                d.input_proj.bias.zero_()
            elif d.exit_dim == 2 * d.hidden:
                d.lm_head[-1].weight.zero_()
                d.lm_head[-1].weight[:, : d.hidden].copy_(base.lm_head.weight)
        return d

    def step(self, state: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        if self.rnn:
            return F.silu(self.rnn_w(embedding) + self.rnn_u(state))
        return state + embedding

    def logits(self, h: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h, state], dim=-1)
        if hasattr(self, "input_proj"):
            x = self.input_proj(x)
        x = self.lm_head(x)
        return self.base_head(x) if self.tied_lm_head else x

    def forward(self, h: torch.Tensor, embeddings: torch.Tensor, masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Teacher-forced unroll over every position at once: step j's logits at the positions
        masks[j-1] selects (from `ahead_mask(labels, j)`), (n_j, vocab). embeddings: the base's
        embeddings of the sequence's tokens (batch, L, hidden)."""
        L = h.shape[1]
        state = torch.zeros_like(h)
        out = []
        for j, mask in enumerate(masks, 1):  # state at t after tokens t+1..t+j
            state = self.step(state[:, : L - j], embeddings[:, j:])
            out.append(self.logits(h[:, : L - j][mask], state[mask]))
        return out

    def config(self, beam_width: int = 4, beam_length: int = 4) -> dict:
        return {"model_type": "recurrent_drafting_drafter", "hidden_size": self.hidden, "vocab_size": self.vocab,
                "exit_dim": self.exit_dim, "num_draft_layers": len(self.lm_head) - (not self.tied_lm_head), "rnn": self.rnn,
                "beam_width": beam_width, "beam_length": beam_length, **({"tied_lm_head": True} if self.tied_lm_head else {})}


def save_heads(module: nn.Module, config: dict, path: Path):
    """config.json + model.safetensors (float32) in `path`, written beside it and renamed into place."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"), {"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def examples_from(path: str | Path, seq_len: int) -> list:
    """(input_ids, labels) of a pseudo-labels .jsonl (the base model's own continuations)."""
    return [data.example(r["prompt_ids"], r["response_ids"], seq_len) for r in data.read_jsonl(path, ("prompt_ids", "response_ids"))]


@torch.no_grad()
def top1_accuracy(base, examples: list, device, medusa: MedusaHeads | None = None, drafter: Drafter | None = None,
                  steps: int = 0, batch_size: int = 8) -> dict:
    """Top-1 accuracy of each Medusa head / drafted step against the sequence's next tokens (on the
    base's greedy continuations: the tokens greedy verification would accept), and of the base's own
    head. Counts positions as the runtime's `medusa.head_accuracies` does: hidden states from the
    last prompt token on, targets inside the continuation."""
    ahead = medusa.num_heads if medusa is not None else steps
    hits, counts = torch.zeros(ahead + 1, dtype=torch.long), torch.zeros(ahead + 1, dtype=torch.long)
    for i in range(0, len(examples), batch_size):
        batch = {k: v.to(device) for k, v in data.collate(examples[i : i + batch_size]).items()}
        ids, labels = batch["input_ids"], batch["labels"]
        h = hidden_states(base, ids)
        masks = [ahead_mask(labels, k) for k in range(ahead + 1)]
        own = base.lm_head(h[masks[0]]).argmax(-1)
        if medusa is not None:
            guesses = [g.argmax(-1) for g in medusa(h, masks[1:])]
        else:
            guesses = [g.argmax(-1) for g in drafter(h, base.get_input_embeddings()(ids), masks[1:])]
        for k, guess in enumerate([own] + guesses):
            target = labels[:, k:][masks[k]]
            hits[k] += int((guess == target).sum())
            counts[k] += int(masks[k].sum())
    acc = (hits / counts.clamp_min(1)).tolist()
    return {"base_top1": acc[0], "top1": acc[1:], "positions": counts[1:].tolist(), "examples": len(examples)}

