"""Hybrid students: a transformers Llama/Mistral whose chosen layers have Mamba, Mamba2 or DSLA mixers.

The mixers compute exactly what the MLX runtime's layers compute (`mlx_hybrid/models/hybrid.py`,
format in `docs/formats/hybrid-checkpoint.md`) and use its tensor names, so a student's state_dict
is the exported checkpoint. Layers are attention-initialized ("The Mamba in the Llama",
Algorithm 1): x, B, C, out <- V, K, Q, O of the layer's attention, grouped KV heads expanded to
the query heads, and only dt, A, D, z, the conv (and DSLA's gates) are new.
"""

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hybrid_train.errors import TrainError
from hybrid_train.scan import chunked_gla

LAYER_TYPES = ("attention", "mamba", "mamba2", "dsla")
MIXER_NAME = {"attention": "self_attn", "mamba": "mamba", "mamba2": "mamba", "dsla": "dsla"}


@dataclass
class HybridArgs:
    """The hybrid fields of config.json (defaults as in the runtime; None = derived from the base config)."""

    d_state: int = 16
    d_conv: int = 4
    d_inner: int | None = None
    d_xb: int | None = None
    dt_rank: int | None = None
    conv_bias: bool = True
    # DSLA's form: this project's by default; DSLA-Serve's in `DSLA`'s docstring.
    gate_rank: int = 16  # 0: full-rank gates gk_proj, gk_proj2
    gate_norm: float = 16.0
    gate_clamp: float | None = None
    dsla_mix: str = "gamma"  # or "softmax" (of alpha_list)
    dsla_o_norm: bool = True
    dsla_kv_heads: int | None = None

    def resolve(self, config) -> "HybridArgs":
        """Fill the derived sizes from a transformers config and check the runtime's constraints."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.d_inner = self.d_inner or config.hidden_size
        self.d_xb = self.d_xb or config.num_key_value_heads * head_dim
        self.dt_rank = self.dt_rank or math.ceil(config.hidden_size / 16)
        self.dsla_kv_heads = self.dsla_kv_heads or config.num_key_value_heads
        if self.dsla_mix not in ("gamma", "softmax"):
            raise TrainError(f"dsla_mix must be gamma or softmax, got {self.dsla_mix!r}")
        if config.num_attention_heads % self.dsla_kv_heads or self.dsla_kv_heads % config.num_key_value_heads:
            raise TrainError(f"dsla_kv_heads ({self.dsla_kv_heads}) must divide the {config.num_attention_heads} heads "
                             f"and be a multiple of the {config.num_key_value_heads} K/V heads")
        for name in ("d_inner", "d_xb"):
            if getattr(self, name) % self.d_state:
                raise TrainError(f"{name} ({getattr(self, name)}) is not a multiple of d_state ({self.d_state})")
        if self.d_inner % self.d_xb:
            raise TrainError(f"d_inner ({self.d_inner}) is not a multiple of d_xb ({self.d_xb})")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "HybridArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def expand_groups(t: torch.Tensor, size: int, repeats: int) -> torch.Tensor:
    """Repeat each run of `size` features `repeats` times along the last axis (KV-head expansion)."""
    *lead, d = t.shape
    return t.reshape(*lead, d // size, 1, size).expand(*lead, d // size, repeats, size).reshape(*lead, d * repeats)


def causal_conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over time of x (batch, L, channels)."""
    return conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def log_uniform(n: int, lo: float = 1e-3, hi: float = 0.1) -> torch.Tensor:
    """Mamba's dt initialization: log-uniform in [lo, hi]."""
    return torch.exp(torch.rand(n) * (math.log(hi) - math.log(lo)) + math.log(lo))


class Mamba(nn.Module):
    """MambaInLlama's Mamba: per-channel dt and A (d_inner x d_state), x repeated before the conv,
    output gated by silu(z). dt_proj's bias is added twice (the Linear, then the scan's delta_bias),
    as in the released code the runtime follows; B and x are expanded by runs of d_state features."""

    chunk = 16  # the intra-chunk decay tensor is (batch, d_inner, T, T, d_state)

    def __init__(self, hidden: int, a: HybridArgs):
        super().__init__()
        self.d_inner, self.d_xb, self.d_state = a.d_inner, a.d_xb, a.d_state
        self.repeats = a.d_inner // a.d_xb
        self.in_proj_x = nn.Linear(hidden, a.d_xb, bias=False)
        self.in_proj_z = nn.Linear(hidden, a.d_inner, bias=False)
        self.B_proj = nn.Linear(hidden, a.d_xb, bias=False)
        self.C_proj = nn.Linear(hidden, a.d_inner, bias=False)
        self.dt_proj_down = nn.Linear(hidden, a.dt_rank, bias=False)
        self.dt_proj = nn.Linear(a.dt_rank, a.d_inner, bias=True)
        self.conv1d = nn.Conv1d(a.d_inner, a.d_inner, a.d_conv, groups=a.d_inner, padding=a.d_conv - 1, bias=a.conv_bias)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, a.d_state + 1, dtype=torch.float32)).repeat(a.d_inner, 1))
        self.D = nn.Parameter(torch.ones(a.d_inner))
        self.out_proj = nn.Linear(a.d_inner, hidden, bias=False)
        with torch.no_grad():  # dt starts log-uniform in [1e-3, 0.1]; the bias counts twice
            self.dt_proj.bias.copy_(inverse_softplus(log_uniform(a.d_inner)) / 2)

    def init_from_attention(self, attn: nn.Module):
        for dst, src in ((self.in_proj_x, attn.v_proj), (self.B_proj, attn.k_proj),
                         (self.C_proj, attn.q_proj), (self.out_proj, attn.o_proj)):
            dst.weight.copy_(src.weight)

    def inputs(self, u: torch.Tensor):
        """x (before the conv), z, B, C (batch, L, groups, d_state) and dt (positive), KV groups expanded."""
        b, L, _ = u.shape
        n, r = self.d_state, self.repeats
        x = expand_groups(self.in_proj_x(u), n, r)
        B = expand_groups(self.B_proj(u), n, r).reshape(b, L, -1, n)
        C = self.C_proj(u).reshape(b, L, -1, n)
        dt = F.softplus((self.dt_proj(self.dt_proj_down(u)) + self.dt_proj.bias).float())
        return x, self.in_proj_z(u), B, C, dt

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        x, z, B, C, dt = self.inputs(u)
        x = F.silu(causal_conv(self.conv1d, x)).float()
        n = self.d_state
        A = -torch.exp(self.A_log.float())  # (d_inner, n)
        # One GLA head per channel c, reading B and C of group c // d_state.
        q = C.float().repeat_interleave(n, dim=2).transpose(1, 2)  # (b, d_inner, L, n)
        k = (dt[..., None] * B.float().repeat_interleave(n, dim=2)).transpose(1, 2)
        g = (dt[..., None] * A).transpose(1, 2)
        y, _ = chunked_gla(q, k, x.transpose(1, 2)[..., None], g, chunk=self.chunk)
        y = y[..., 0].transpose(1, 2) + self.D.float() * x
        return self.out_proj((y * F.silu(z.float())).to(u.dtype))


class Mamba2(nn.Module):
    """MambaInLlama's Mamba2: heads of d_state channels with one dt and scalar A each, the conv over
    [x, B, C] before KV expansion, and an RMSNorm per head of y * silu(z)."""

    chunk = 64
    eps = 1e-5

    def __init__(self, hidden: int, a: HybridArgs):
        super().__init__()
        self.d_inner, self.d_xb, self.d_state = a.d_inner, a.d_xb, a.d_state
        self.nheads = a.d_inner // a.d_state
        self.repeats = a.d_inner // a.d_xb
        self.in_proj = nn.Linear(hidden, 2 * a.d_inner + 2 * a.d_xb + self.nheads, bias=False)  # [z, x, B, C, dt]
        conv_dim = a.d_inner + 2 * a.d_xb
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, a.d_conv, groups=conv_dim, padding=a.d_conv - 1, bias=a.conv_bias)
        self.dt_bias = nn.Parameter(inverse_softplus(log_uniform(self.nheads)))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nheads).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(self.nheads))
        self.norm = LlamaRMSNorm(a.d_inner)  # weight only; normalized per head
        self.out_proj = nn.Linear(a.d_inner, hidden, bias=False)

    def init_from_attention(self, attn: nn.Module):
        d, xb = self.d_inner, self.d_xb
        w = self.in_proj.weight
        w[d : d + xb] = attn.v_proj.weight
        w[d + xb : d + 2 * xb] = attn.k_proj.weight
        w[d + 2 * xb : 2 * d + 2 * xb] = attn.q_proj.weight
        self.out_proj.weight.copy_(attn.o_proj.weight)
        # The conv starts as the identity (its tap on the current token 1, the rest 0): a random conv
        # mixes each of x, B, C with its 3 predecessors and buries the copied V, K, Q.
        self.conv1d.weight.zero_()
        self.conv1d.weight[:, 0, -1] = 1
        if self.conv1d.bias is not None:
            self.conv1d.bias.zero_()

    def calibrate(self, u: torch.Tensor, attn_out: torch.Tensor, gate: float = 3.0):
        """Data-dependent part of the initialization, from the attention's own activations on a few
        sequences: u (tokens, hidden) the mixer's inputs, attn_out (tokens, d_inner) its o_proj inputs.

        z: every row is the mean input direction, scaled so z ~ `gate` (silu(z) > 0 on every token of
        SmolLM2's calibration text): the gate is then one positive scalar per token and head, which
        the per-head RMSNorm divides out, so y passes through as the attention's output would. A
        random z multiplies each channel by a random signed factor (cosine to the attention output ~0).
        norm.weight: the RMS of each head of the attention's output, so the normalized heads reach
        out_proj at the scale it was trained on (weight 1 is 1.3-6.5x too large in SmolLM2)."""
        mean = u.float().mean(0)
        self.in_proj.weight[: self.d_inner] = (gate * mean / mean.pow(2).sum()).to(self.in_proj.weight.dtype)
        rms = attn_out.float().reshape(-1, self.nheads, self.d_state).pow(2).mean((0, 2)).sqrt()
        self.norm.weight.copy_(rms.repeat_interleave(self.d_state))

    def split(self, u: torch.Tensor):
        """z, [x, B, C] (before the conv) and dt (pre-softplus) from the fused input projection."""
        return torch.split(self.in_proj(u), [self.d_inner, self.d_inner + 2 * self.d_xb, self.nheads], dim=-1)

    def heads(self, xBC: torch.Tensor):
        """x, B, C as (batch, L, heads, d_state), x and B KV-expanded to the heads."""
        b, L, _ = xBC.shape
        n, r = self.d_state, self.repeats
        x, B, C = torch.split(xBC, [self.d_xb, self.d_xb, self.d_inner], dim=-1)
        return expand_groups(x, n, r).reshape(b, L, -1, n), expand_groups(B, n, r).reshape(b, L, -1, n), C.reshape(b, L, -1, n)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, L, _ = u.shape
        n = self.d_state
        z, xBC, dt = self.split(u)
        x, B, C = self.heads(F.silu(causal_conv(self.conv1d, xBC)).float())
        dt = F.softplus(dt.float() + self.dt_bias.float())  # (b, L, heads)
        A = -torch.exp(self.A_log.float())
        q, k, v = C.transpose(1, 2), (dt[..., None] * B).transpose(1, 2), x.transpose(1, 2)
        y, _ = chunked_gla(q, k, v, (dt * A)[..., None].transpose(1, 2), chunk=self.chunk)
        y = y.transpose(1, 2) + self.D.float()[:, None] * x  # (b, L, heads, n)
        gated = y * F.silu(z.float()).reshape(b, L, -1, n)
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.out_proj((normed.reshape(b, L, -1) * self.norm.weight.float()).to(u.dtype))


def gate_similarity(G1: torch.Tensor, G2: torch.Tensor) -> torch.Tensor:
    """DSLA's contrastive term (eq. 9): cosine similarity of the two forget gates at each position,
    over the layer's whole gate (heads x key features), averaged over batch and positions.
    G1, G2: (batch, L, width) gate values in (0, 1)."""
    return F.cosine_similarity(G1.float(), G2.float(), dim=-1).mean()


class DSLA(nn.Module):
    """Dual-state linear attention (DSLA-Serve eq. 4-5): two gated linear-attention states mixed as
    w1 o1 + w2 o2. q, k, v, o keep the attention's weights (q scaled by head_dim^-0.5, KV heads
    expanded). Gates: log g = logsigmoid(W u + b) / gate_norm, clamped below at gate_clamp.
    This project's form: low-rank gates (gate*_down, gate*_up), (w1, w2) = (gamma, 1 - gamma), then an
    RMSNorm per head; DSLA-Serve's (utnslab/DSLA-Serve, src/layer.py; HybridArgs gate_rank 0, gate_clamp
    -50, dsla_mix softmax, dsla_o_norm false, dsla_kv_heads = heads): full-rank gates gk_proj, gk_proj2,
    softmax(alpha_list), no norm, as many K/V heads as query heads (`mlx_hybrid.models.hybrid.DSLA` runs
    either).

    After each forward, `similarity` holds `gate_similarity` of this call's gates (for the loss)."""

    chunk = 64

    def __init__(self, config, a: HybridArgs):
        super().__init__()
        hidden, bias = config.hidden_size, getattr(config, "attention_bias", False)
        self.n_heads, self.n_kv_heads = config.num_attention_heads, a.dsla_kv_heads or config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.n_heads
        self.gate_norm, self.gate_clamp = a.gate_norm, a.gate_clamp
        width = self.n_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, width, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(width, hidden, bias=bias)
        if a.gate_rank:
            self.gate1_down = nn.Linear(hidden, a.gate_rank, bias=False)
            self.gate1_up = nn.Linear(a.gate_rank, width, bias=True)
            self.gate2_down = nn.Linear(hidden, a.gate_rank, bias=False)
            self.gate2_up = nn.Linear(a.gate_rank, width, bias=True)
        else:
            self.gk_proj = nn.Linear(hidden, width, bias=True)
            self.gk_proj2 = nn.Linear(hidden, width, bias=True)
        if a.dsla_mix == "gamma":
            self.gamma = nn.Parameter(torch.tensor([0.5]))
        else:
            self.alpha_list = nn.Parameter(torch.rand(2))  # DSLA-Serve's init: uniform in [0, 1)
        self.o_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps) if a.dsla_o_norm else None
        self.similarity = None
        with torch.no_grad():
            if a.gate_rank:
                # History gate near identity (g ~ 0.999 per token), recency gate random (DSLA-Serve, appendix B).
                for layer in (self.gate1_down, self.gate1_up):
                    layer.weight.normal_(0, 0.01)
                self.gate1_up.bias.fill_(4.0)
                self.gate2_down.weight.normal_(0, 0.1)
                self.gate2_up.weight.normal_(0, 0.1)
                self.gate2_up.bias.zero_()
            else:  # as DSLA-Serve's code: the history gate's weight the identity, the recency gate's default
                nn.init.eye_(self.gk_proj.weight)
                self.gk_proj.bias.zero_()
                self.gk_proj2.bias.zero_()

    def init_from_attention(self, attn: nn.Module):
        """q, k, v, o from the attention; K/V heads repeated where this layer has more of them."""
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state = getattr(attn, name).state_dict()
            if name in ("k_proj", "v_proj"):
                r = self.n_kv_heads * self.head_dim // state["weight"].shape[0]
                state = {k: expand_groups(v.transpose(0, -1), self.head_dim, r).transpose(0, -1) for k, v in state.items()}
            getattr(self, name).load_state_dict(state)

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        b, L, _ = t.shape
        return t.reshape(b, L, -1, self.head_dim).transpose(1, 2)

    def qkv(self, u: torch.Tensor):
        """q (scaled), k, v as (batch, heads, L, head_dim), KV heads expanded."""
        r = self.n_heads // self.n_kv_heads
        q = self.heads(self.q_proj(u)) * self.head_dim**-0.5
        k = self.heads(self.k_proj(u)).repeat_interleave(r, dim=1)
        v = self.heads(self.v_proj(u)).repeat_interleave(r, dim=1)
        return q, k, v

    def log_gates(self, u: torch.Tensor) -> list[torch.Tensor]:
        """Both gates' log g (batch, L, heads * head_dim), float32."""
        logits = (self.gk_proj(u), self.gk_proj2(u)) if hasattr(self, "gk_proj") else (
            self.gate1_up(self.gate1_down(u)), self.gate2_up(self.gate2_down(u)))
        gates = [F.logsigmoid(a.float()) / self.gate_norm for a in logits]
        return gates if self.gate_clamp is None else [g.clamp_min(self.gate_clamp) for g in gates]

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, L, _ = u.shape
        q, k, v = self.qkv(u)
        g1, g2 = self.log_gates(u)
        self.similarity = gate_similarity(g1.exp(), g2.exp())
        o1, _ = chunked_gla(q, k, v, self.heads(g1), chunk=self.chunk)
        o2, _ = chunked_gla(q, k, v, self.heads(g2), chunk=self.chunk)
        if hasattr(self, "gamma"):
            w1 = self.gamma.float()
            w2 = 1 - w1
        else:
            w1, w2 = torch.softmax(self.alpha_list.float(), 0)
        o = (w1 * o1 + w2 * o2).to(u.dtype)
        if self.o_norm is not None:
            o = self.o_norm(o)
        return self.o_proj(o.transpose(1, 2).reshape(b, L, -1))


class HybridLayer(GradientCheckpointingLayer):
    """A Llama decoder layer with a recurrent mixer; called as transformers calls its decoder layers."""

    def __init__(self, kind: str, mixer: nn.Module, mlp: nn.Module, input_norm: nn.Module, post_norm: nn.Module):
        super().__init__()
        self.kind = kind
        setattr(self, MIXER_NAME[kind], mixer)
        self.mlp, self.input_layernorm, self.post_attention_layernorm = mlp, input_norm, post_norm

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, MIXER_NAME[self.kind])

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        h = hidden_states + self.mixer(self.input_layernorm(hidden_states))
        return h + self.mlp(self.post_attention_layernorm(h))


def make_mixer(kind: str, config, a: HybridArgs) -> nn.Module:
    if kind == "mamba":
        return Mamba(config.hidden_size, a)
    if kind == "mamba2":
        return Mamba2(config.hidden_size, a)
    return DSLA(config, a)


def mixer_types(model) -> list[str]:
    return [getattr(layer, "kind", "attention") for layer in model.model.layers]


@torch.no_grad()
def attention_activations(model, layers: list[int], calibration: list[list[int]]) -> dict[int, tuple]:
    """(inputs, o_proj inputs) of the attention of each of `layers`, as (tokens, features) tensors,
    over the calibration sequences (token id lists, run one by one: no padding in the statistics)."""
    got = {i: ([], []) for i in layers}
    hooks = []
    for i in layers:
        attn = model.model.layers[i].self_attn
        hooks.append(attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: got[i][0].append(kw.get("hidden_states", a[0] if a else None)[0].cpu()), with_kwargs=True))
        hooks.append(attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: got[i][1].append(a[0][0].cpu())))
    device = next(model.parameters()).device
    try:
        for ids in calibration:
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {i: (torch.cat(u), torch.cat(o)) for i, (u, o) in got.items()}


@torch.no_grad()
def convert_layers(model, kinds: list[str], args: HybridArgs, calibration: list[list[int]] | None = None):
    """Give layer i the mixer kinds[i], attention-initializing every layer that changes from attention.

    Layers already of that kind keep their weights; a recurrent layer cannot turn back into
    attention or into another kind. MLPs and norms stay the same modules. With `calibration`
    (token id lists), new Mamba2 mixers also get `Mamba2.calibrate` from the activations of the
    attention they replace (the model's own, before conversion).
    """
    current = mixer_types(model)
    if len(kinds) != len(current):
        raise TrainError(f"mixer_types lists {len(kinds)} layers but the model has {len(current)}")
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise TrainError(f"unknown layer type '{unknown[0]}' (known: {', '.join(LAYER_TYPES)})")
    args = HybridArgs(**asdict(args)).resolve(model.config)
    previous = getattr(model, "hybrid_args", None)
    if previous is not None and set(current) != {"attention"} and asdict(previous) != asdict(args):
        raise TrainError(f"SSM sizes {asdict(args)} differ from the model's {asdict(previous)}")
    for i, (old, new) in enumerate(zip(current, kinds)):
        if old not in (new, "attention"):
            raise TrainError(f"layer {i} is already {old}; it cannot become {new}")
    calibrated = [i for i, (old, new) in enumerate(zip(current, kinds)) if old != new and new == "mamba2"]
    stats = attention_activations(model, calibrated, calibration) if calibration and calibrated else {}
    for i, (old, new) in enumerate(zip(current, kinds)):
        if old == new:
            continue
        layer = model.model.layers[i]
        mixer = make_mixer(new, model.config, args).to(layer.self_attn.o_proj.weight.device)
        mixer.init_from_attention(layer.self_attn)
        if i in stats:
            mixer.calibrate(*(t.to(layer.self_attn.o_proj.weight.device) for t in stats[i]))
        model.model.layers[i] = HybridLayer(new, mixer, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
    model.hybrid_args = args
    return model


def hybrid_config(model) -> dict:
    """config.json of the runtime's hybrid format for this model."""
    config = model.config.to_dict()
    base = config.pop("model_type")
    config.pop("layer_types", None)  # transformers' own per-layer field; ours is mixer_types
    config.pop("quantization_config", None)  # a GGUF teacher's, copied by from_pretrained; our weights are float
    args = getattr(model, "hybrid_args", None) or HybridArgs().resolve(model.config)
    return dict(config, model_type="llama_hybrid", base_model_type=base, mixer_types=mixer_types(model), **asdict(args))


def save_hybrid(model, path: Path, tokenizer=None):
    """Write the model in the runtime's hybrid format (config.json, model.safetensors, tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), {"format": "pt"})
    (path / "config.json").write_text(json.dumps(hybrid_config(model), indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def save_model(model, path: Path, tokenizer=None):
    """A model with every layer attention (e.g. Medusa-2's fine-tuned teacher) in Hugging Face's
    format, so that it stays a Llama/Mistral to the runtime and to mlx-lm; a hybrid in ours."""
    if getattr(model, "hybrid_args", None) is not None or set(mixer_types(model)) != {"attention"}:
        return save_hybrid(model, path, tokenizer)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def save_adaptive(teacher, student, path: Path, order: list[int], max_layers: int | None = None, tokenizer=None):
    """Write a model whose layers in `order` run as attention or as DSLA, per request (runtime:
    mlx_hybrid/adaptive.py; format: "Adaptive DSLA conversion" in docs/formats/hybrid-checkpoint.md).

    Attention weights come from the teacher, DSLA mixers from the `dsla` stage's student, whose
    chained conversion order is `order` (least sensitive first). The two must share everything
    else, since the runtime keeps one MLP and one pair of norms per layer."""
    path = Path(path)
    if path.exists():
        raise TrainError(f"{path} exists")
    teacher_kinds, student_kinds = mixer_types(teacher), mixer_types(student)
    max_layers = len(order) if max_layers is None else max_layers
    if len(set(order)) != len(order) or not 0 <= max_layers <= len(order):
        raise TrainError(f"order {order} lists a layer twice or max_layers {max_layers} is not in [0, {len(order)}]")
    for i in order:
        if not 0 <= i < len(teacher_kinds) or teacher_kinds[i] != "attention" or student_kinds[i] != "dsla":
            raise TrainError(f"layer {i} must be attention in the teacher and dsla in the student")
    dsla = tuple(f"model.layers.{i}.dsla." for i in order)
    student_state = {k: v for k, v in student.state_dict().items() if not k.startswith(dsla)}
    state = {}
    for k, v in teacher.state_dict().items():
        if k.startswith(tuple(f"model.layers.{i}.self_attn." for i in order)):
            state[k] = v
        elif k not in student_state or not torch.equal(student_state[k].cpu(), v.cpu()):
            raise TrainError(f"student and teacher differ at {k}: only the DSLA mixers may differ")
        else:
            state[k] = v
    state.update({k: v for k, v in student.state_dict().items() if k.startswith(dsla)})
    state = {k: v.detach().float().contiguous().cpu() for k, v in state.items()}
    if teacher.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = dict(hybrid_config(teacher), **asdict(student.hybrid_args))
    config["dsla_conversion"] = {"order": list(order), "max_layers": max_layers}
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"), {"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    tmp.rename(path)


def load_hybrid(path: Path, dtype=torch.float32):
    """A hybrid directory written by `save_hybrid` (or a plain Llama/Mistral directory) as a torch model."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TrainError(f"cannot read {path / 'config.json'}: {e}") from None
    if config.get("model_type") != "llama_hybrid":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    base = {k: v for k, v in config.items() if k not in {f.name for f in fields(HybridArgs)}}
    kinds = base.pop("mixer_types")
    base_type = base.pop("base_model_type", "llama")
    base.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(base_type, **base), dtype=dtype)
    convert_layers(model, kinds, HybridArgs.from_dict(config))
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise TrainError(f"{path}: weights do not match config.json (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype)
