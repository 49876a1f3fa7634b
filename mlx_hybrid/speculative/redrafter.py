"""ReDrafter (Cheng et al.): a recurrent drafter conditioned on the target's last hidden state.

The drafter's state s runs over the draft tokens' embeddings (the target's embedding table), and
each next-token distribution is an MLP of [h, s]. Beam search of width BW and length BL proposes
BW sequences that all start with the target's token; shared prefixes are packed into one tree
(`tree.pack_beams`) that the target verifies in one pass. At temperature 0 search and packing stay
on the device (`draft`), so the step never waits for the host before verification.

At temperature > 0 the beams are instead BW independent samples from the drafter: beam search
picks its candidates deterministically, so accepting them with probability p/q (as the reference
code does) would not preserve the target's distribution, while independent draws verified by
multi-draft rejection sampling (`accept.rejection`) do. Layout and tensor names: docs/formats/speculative-heads.md. Beam
scores use log-softmax over the whole vocabulary (the reference first keeps the top 50 logits).
"""

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_hybrid.errors import HybridError
from mlx_hybrid.limits import check_beam
from mlx_hybrid.models.linear import Linear
from mlx_hybrid.sampling import SamplingParams
from mlx_hybrid.speculative.accept import Candidates, Draft, target_logprobs
from mlx_hybrid.speculative.load import check_blocks, check_target, load_into, read_config
from mlx_hybrid.speculative.medusa import ResBlock
from mlx_hybrid.speculative.topk import beam_step
from mlx_hybrid.speculative.tree import pack_beams
from mlx_hybrid.tree_mask import TreeMask


@dataclass
class DrafterConfig:
    hidden_size: int
    vocab_size: int
    exit_dim: int
    num_draft_layers: int
    rnn: bool
    tied_lm_head: bool = False  # the target's LM head after the ResBlocks, none of its own
    beam_width: int = 4
    beam_length: int = 4

    @classmethod
    def from_dict(cls, config: dict) -> "DrafterConfig":
        return cls(**{k: config[k] for k in cls.__dataclass_fields__ if k in config})


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, target_head=None):
        """target_head: the target's hidden-to-logits function, which a `tied_lm_head` drafter ends
        with (a plain attribute, not a parameter: the weights stay the target's)."""
        super().__init__()
        self.config = config
        H, E = config.hidden_size, config.exit_dim
        if E != 2 * H:
            self.input_proj = Linear(2 * H, E)
        own_head = [] if config.tied_lm_head else [Linear(E, config.vocab_size, bias=False)]  # the beams as rows: one read of the weight (linear.py)
        self.lm_head = [ResBlock(E) for _ in range(config.num_draft_layers)] + own_head
        self.target_head = target_head
        if config.rnn:
            self.rnn_u = Linear(H, H, bias=True)
            self.rnn_w = Linear(H, H, bias=False)

    def step(self, state: mx.array, embedding: mx.array) -> mx.array:
        """The RNN state after one more draft token."""
        if self.config.rnn:
            return nn.silu(self.rnn_w(embedding) + self.rnn_u(state))
        return state + embedding

    def logits(self, h: mx.array, state: mx.array) -> mx.array:
        x = mx.concatenate([mx.broadcast_to(h, state.shape), state], axis=-1)
        # The beams as the rows of a matrix: over a few rows on CUDA each product is one launch
        # that reads the weight once (`linear.row_product`).
        x = x.reshape(-1, x.shape[-1])
        if "input_proj" in self:
            x = self.input_proj(x)
        for layer in self.lm_head:
            x = layer(x)
        if self.config.tied_lm_head:
            x = self.target_head(x)
        return x.reshape(*state.shape[:-1], -1)

    def beam_search(self, h: mx.array, roots: mx.array, embed: nn.Embedding, width: int, length: int) -> list[mx.array]:
        """Beam search from a batch of roots (B,) and hidden states h (B, hidden): the beams after
        each step, [(B, width, 2), ..., (B, width, length)], root first, best beam first.

        A search stops nowhere early, so its first l tokens are exactly a length-l search's; the
        tuner reads every length from one search."""
        V, B = self.config.vocab_size, roots.shape[0]
        beams = roots.reshape(B, 1, 1)
        state = mx.zeros((B, 1, self.config.hidden_size), h.dtype)
        scores = mx.zeros((B, 1))
        h = h[:, None]
        steps = []
        for _ in range(length - 1):
            state = self.step(state, embed(beams[..., -1]))
            k = min(width, beams.shape[1] * V)
            origin, token, scores = beam_step(self.logits(h, state), scores, k)
            beams = mx.concatenate([mx.take_along_axis(beams, origin[..., None], axis=1), token[..., None].astype(beams.dtype)], axis=-1)
            state = mx.take_along_axis(state, origin[..., None], axis=1)
            out = beams
            if k < width:  # a vocabulary smaller than the width: repeat the best beam
                out = mx.concatenate([beams, mx.repeat(beams[:, :1], width - k, axis=1)], axis=1)
            steps.append(out)
        return steps

    def sample(self, h: mx.array, root: int, embed: nn.Embedding, width: int, length: int, sampling: SamplingParams):
        """`width` independent draws of length-1 tokens after root, and the distributions they
        were drawn from: (width, length) tokens, (width, length - 1, vocab) log-probabilities."""
        tokens = mx.full((width,), root)
        state = mx.zeros((width, self.config.hidden_size), h.dtype)
        beams, logq = [tokens], []
        for _ in range(length - 1):
            state = self.step(state, embed(tokens))
            lq = target_logprobs(self.logits(h, state).astype(mx.float32), sampling)
            tokens = mx.random.categorical(lq)
            beams.append(tokens)
            logq.append(lq)
        return mx.stack(beams, axis=1), mx.stack(logq, axis=1)


def load_redrafter(path: str | Path, target: nn.Module, dtype: str | None = None) -> Drafter:
    path = Path(path)
    config = read_config(path, "recurrent_drafting_drafter", ("hidden_size", "vocab_size", "exit_dim", "num_draft_layers", "rnn"))
    check_target(path, config, target)
    tied = config.get("tied_lm_head", False)
    if not isinstance(tied, bool):
        raise HybridError(f"{path / 'config.json'}: 'tied_lm_head' must be true or false, got {tied!r}")
    if tied and config["exit_dim"] != config["hidden_size"]:
        raise HybridError(f"{path / 'config.json'}: a drafter with tied_lm_head needs exit_dim = hidden_size ({config['hidden_size']})")
    if tied:
        check_blocks(path, config["num_draft_layers"], "lm_head.", "num_draft_layers (ResBlocks; the LM head is the target's)")
    else:
        check_blocks(path, config["num_draft_layers"] + 1, "lm_head.", "num_draft_layers + 1 (ResBlocks and the LM head)")
    drafter = Drafter(DrafterConfig.from_dict(config), target._logits if tied else None)
    return load_into(drafter, path, config, target, dtype)


def trims_padding() -> bool:
    """Whether a packed beam drops its padding before verification: on the CPU a pass costs about
    its token count and reading the count costs nothing; on a GPU a pass of a few dozen tokens
    costs the same as a shorter one, and reading the count would stall the device."""
    return mx.default_device().type == mx.DeviceType.cpu


def beam_draft(tokens, parents, depths, mask, node_of, count) -> Draft:
    """The `Draft` of a packed beam (`PackedBeam`'s arrays), its padding dropped where `trims_padding`."""
    if trims_padding():
        n = count.item()
        return Draft(tokens[:n], TreeMask(parents[:n], depths[:n], mask[:n, :n]), node_of)
    return Draft(tokens, TreeMask(parents, depths, mask), node_of)


class ReDrafterProposer:
    name = "redrafter"
    drafts_on_device = True

    def __init__(self, drafter: Drafter, target: nn.Module, beam_width: int | None = None, beam_length: int | None = None):
        self.drafter = drafter
        self.embed = target.model.embed_tokens
        self.width = beam_width or drafter.config.beam_width
        self.length = beam_length or drafter.config.beam_length
        check_beam(self.width, self.length, target)
        self.depth = self.length - 1
        # Search and packing have one shape per beam size, so they compile once: each pass then
        # replays the graph without Python and with its elementwise ops fused, which counts on a
        # GPU, where a draft is ~100 small kernels. The weights are inputs, not constants.
        head = [target.lm_head.state] if drafter.config.tied_lm_head and "lm_head" in target else []
        self._search = mx.compile(self._search_and_pack, inputs=[drafter.state, self.embed.state] + head)

    def draft(self, root: mx.array, hidden: mx.array) -> Draft:
        """Greedy: the packed beam of a beam search from root (1,) and hidden (H,), on the device."""
        return beam_draft(*self._search(root, hidden))

    def _search_and_pack(self, root: mx.array, hidden: mx.array) -> tuple[mx.array, ...]:
        beams = self.drafter.beam_search(hidden[None], root.reshape(1), self.embed, self.width, self.length)[-1].squeeze(0)  # not [0]: a gather
        packed = pack_beams(beams)
        return packed.tokens, packed.tree.parents, packed.tree.depths, packed.tree.mask, packed.node_of, packed.count

    def propose(self, history: list[int], hidden: mx.array, sampling: SamplingParams) -> Candidates:
        """Sampling: `width` independent drafts, packed, with the distributions they came from."""
        beams, logq = self.drafter.sample(hidden, history[-1], self.embed, self.width, self.length, sampling)
        packed = pack_beams(beams)
        n = packed.count.item()
        node_of, q = np.array(packed.node_of), np.exp(np.array(logq, np.float64))
        nodes = np.zeros((n, q.shape[-1]))
        nodes[node_of[:, :-1]] = q  # one prefix, one drafter distribution
        drafts: dict[int, list[int]] = {}
        for b in range(self.width):  # the draws below each node, in the order they were drawn
            for l in range(self.length - 1):
                drafts.setdefault(int(node_of[b, l]), []).append(int(node_of[b, l + 1]))
        return Candidates(np.array(packed.tokens[:n]), packed.tree.parents[:n].tolist(), drafts=drafts, q=nodes)
