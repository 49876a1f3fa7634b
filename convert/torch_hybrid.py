"""Independent PyTorch reference for the hybrid models: MambaInLlama's Mamba and Mamba2 mixers and DSLA.

`hybrid convert --verify` runs a hybrid source through this (transformers has no such layers),
and the parity tests compare the MLX runtime against it. The mixers keep MambaInLlama's module
and tensor names and the semantics of their prefill `forward`, but the fused CUDA ops
(selective_scan_fn, mamba_chunk_scan_combined, causal_conv1d, the gated RMSNorm kernel) are
replaced by naive token-by-token loops in float64, so nothing here shares code or structure
with the MLX runtime.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def repeat_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """MambaInLlama's repeat_kv: (b, groups, L, size) -> (b, groups * n_rep, L, size), each group n_rep times."""
    b, g, L, size = t.shape
    return t[:, :, None].expand(b, g, n_rep, L, size).reshape(b, g * n_rep, L, size)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def causal_conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of x (b, channels, L): nn.Conv1d padded by d_conv - 1 on both sides, first L outputs."""
    return conv(x)[..., : x.shape[-1]]


def selective_scan(u, delta, A, B, C, D, z, delta_bias):
    """mamba_ssm's selective_scan_fn(..., delta_softplus=True), one token at a time in float64.

    u, delta, z: (b, d, L); A: (d, n); B, C: (b, groups, n, L), channel c in group c // (d / groups).
    """
    dtype = u.dtype
    u, delta, A, B, C, D, z = (t.double() for t in (u, delta, A, B, C, D, z))
    delta = F.softplus(delta + delta_bias.double()[:, None])
    d = u.shape[1]
    B = B.repeat_interleave(d // B.shape[1], dim=1)  # (b, d, n, L)
    C = C.repeat_interleave(d // C.shape[1], dim=1)
    h = u.new_zeros(u.shape[0], d, A.shape[1])
    ys = []
    for t in range(u.shape[-1]):
        h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u[:, :, t])[..., None] * B[..., t]
        ys.append((h * C[..., t]).sum(-1))
    y = torch.stack(ys, dim=-1) + D[:, None] * u
    return (y * F.silu(z)).to(dtype)


class Mamba(nn.Module):
    """MambaInLlama's `mamba/hybrid_mamba_layer.Mamba` (repeat_kv_before_conv=True, no projection biases)."""

    def __init__(self, d_model, d_inner, d_xb, d_state=16, d_conv=4, dt_rank="auto", conv_bias=True):
        super().__init__()
        self.d_inner, self.d_xb, self.d_state, self.d_conv = d_inner, d_xb, d_state, d_conv
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
        self.in_proj_x = nn.Linear(d_model, d_xb, bias=False)
        self.in_proj_z = nn.Linear(d_model, d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1, bias=conv_bias)
        self.num_groups = d_inner // d_xb  # num_C_head // num_B_head
        self.B_proj = nn.Linear(d_model, d_xb, bias=False)
        self.C_proj = nn.Linear(d_model, d_inner, bias=False)
        self.dt_proj_down = nn.Linear(d_model, self.dt_rank, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def _expand(self, t):
        """(b, L, groups * d_state) -> (b, L, groups * num_groups * d_state), runs of d_state repeated."""
        b, L, _ = t.shape
        t = t.view(b, L, -1, self.d_state).transpose(1, 2)
        return repeat_kv(t, self.num_groups).transpose(1, 2).reshape(b, L, -1)

    def forward(self, u):
        b, L, _ = u.shape
        n = self.d_state
        z = self.in_proj_z(u).transpose(1, 2)
        A = -torch.exp(self.A_log.float())
        B = self._expand(self.B_proj(u)).view(b, L, -1, n).permute(0, 2, 3, 1)  # (b, groups, n, L)
        C = self.C_proj(u).view(b, L, -1, n).permute(0, 2, 3, 1)
        # The Linear adds dt_proj.bias here, and the scan adds it again as delta_bias.
        dt = self.dt_proj(self.dt_proj_down(u)).transpose(1, 2)
        x = self._expand(self.in_proj_x(u)).transpose(1, 2)  # repeated before the conv
        x = F.silu(causal_conv(self.conv1d, x))
        y = selective_scan(x, dt, A, B, C, self.D.float(), z, self.dt_proj.bias.float())
        return self.out_proj(y.transpose(1, 2))


class Mamba2(nn.Module):
    """MambaInLlama's `mamba2/hybrid_mamba_layer.Mamba2` as released: ngroups = nheads, headdim = d_state,
    conv over [x, B, C] before KV expansion, scalar A and D per head, gated RMSNorm (norm after gate)."""

    def __init__(self, d_model, d_inner, d_xb, d_state, d_conv=4, conv_bias=True):
        super().__init__()
        self.d_inner, self.d_xb, self.d_state = d_inner, d_xb, d_state
        self.nheads = d_inner // d_state
        self.repeat_group = d_inner // d_xb
        self.in_proj = nn.Linear(d_model, 2 * d_inner + 2 * d_xb + self.nheads, bias=False)  # [z, x, B, C, dt]
        conv_dim = d_inner + 2 * d_xb
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(self.nheads))
        self.A_log = nn.Parameter(torch.zeros(self.nheads))
        self.D = nn.Parameter(torch.ones(self.nheads))
        self.norm = RMSNorm(d_inner, eps=1e-5)
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def _heads(self, t, expand: bool):
        b, L, _ = t.shape
        t = t.view(b, L, -1, self.d_state)
        return repeat_kv(t.transpose(1, 2), self.repeat_group).transpose(1, 2) if expand else t

    def forward(self, u):
        b, L, _ = u.shape
        z, xBC, dt = torch.split(self.in_proj(u), [self.d_inner, self.d_inner + 2 * self.d_xb, self.nheads], dim=-1)
        # As causal_conv1d_fn computes it (their fallback without that package keeps the *last*
        # d_conv - 1 outputs instead of the first L, a bug the released models never ran).
        xBC = F.silu(causal_conv(self.conv1d, xBC.transpose(1, 2)).transpose(1, 2))
        x, B, C = torch.split(xBC, [self.d_xb, self.d_xb, self.d_inner], dim=-1)
        x, B, C = self._heads(x, True), self._heads(B, True), self._heads(C, False)  # (b, L, heads, d_state)
        # mamba_chunk_scan_combined(dt_bias=..., dt_softplus=True), per head h: state (headdim, d_state).
        x, B, C = x.double(), B.double(), C.double()
        dt = F.softplus(dt.double() + self.dt_bias.double())
        A = -torch.exp(self.A_log.double())
        h = x.new_zeros(b, self.nheads, self.d_state, self.d_state)
        ys = []
        for t in range(L):
            decay = torch.exp(dt[:, t] * A)[..., None, None]
            h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
            ys.append((h * C[:, t, :, None, :]).sum(-1) + self.D.double()[:, None] * x[:, t])
        y = torch.stack(ys, dim=1).reshape(b, L, self.d_inner).to(u.dtype)
        # RMSNormGated(norm_before_gate=False, group_size=d_state): normalize y * silu(z) per head.
        gated = (y * F.silu(z)).view(b, L, self.nheads, self.d_state)
        y = rms_norm(gated, 1.0, self.norm.eps).reshape(b, L, self.d_inner) * self.norm.weight
        return self.out_proj(y)


class DSLA(nn.Module):
    """Dual-state linear attention as mlx_hybrid specifies it, in either form, as the plain per-token
    recurrence of both states: S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t, o_t = q_t S_t, o = w1 o1 + w2 o2.
    This project's form: low-rank gates, (w1, w2) = (gamma, 1 - gamma), an RMSNorm per head after the mix;
    DSLA-Serve's (gate_rank 0): full-rank gates gk_proj, gk_proj2, softmax(alpha_list), no norm, clamped gates."""

    def __init__(self, hidden, heads, kv_heads, head_dim, eps, gate_rank, gate_norm, gate_clamp=None, mix="gamma",
                 o_norm=True):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.gate_norm, self.gate_clamp = heads, kv_heads, head_dim, gate_norm, gate_clamp
        width = heads * head_dim
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(width, hidden, bias=False)
        if gate_rank:
            self.gate1_down = nn.Linear(hidden, gate_rank, bias=False)
            self.gate1_up = nn.Linear(gate_rank, width, bias=True)
            self.gate2_down = nn.Linear(hidden, gate_rank, bias=False)
            self.gate2_up = nn.Linear(gate_rank, width, bias=True)
        else:
            self.gk_proj = nn.Linear(hidden, width, bias=True)
            self.gk_proj2 = nn.Linear(hidden, width, bias=True)
        if mix == "gamma":
            self.gamma = nn.Parameter(torch.tensor([0.5]))
        else:
            self.alpha_list = nn.Parameter(torch.zeros(2))
        self.o_norm = RMSNorm(head_dim, eps) if o_norm else None

    def gate_logits(self, u):
        if hasattr(self, "gk_proj"):
            return self.gk_proj(u), self.gk_proj2(u)
        return self.gate1_up(self.gate1_down(u)), self.gate2_up(self.gate2_down(u))

    def forward(self, u):
        b, L, _ = u.shape
        r = self.heads // self.kv_heads

        def heads(t):
            return t.view(b, L, -1, self.head_dim).double()

        q = heads(self.q_proj(u)) / math.sqrt(self.head_dim)
        k = heads(self.k_proj(u)).repeat_interleave(r, dim=2)
        v = heads(self.v_proj(u)).repeat_interleave(r, dim=2)
        gates = [heads(F.logsigmoid(a)) / self.gate_norm for a in self.gate_logits(u)]
        if self.gate_clamp is not None:
            gates = [g.clamp_min(self.gate_clamp) for g in gates]
        states = [q.new_zeros(b, self.heads, self.head_dim, self.head_dim) for _ in gates]
        if hasattr(self, "gamma"):
            w1, w2 = self.gamma.double(), 1 - self.gamma.double()
        else:
            w1, w2 = torch.softmax(self.alpha_list.double(), 0)
        outs = []
        for t in range(L):
            kv = k[:, t, :, :, None] * v[:, t, :, None, :]
            states = [torch.exp(g[:, t])[..., None] * s + kv for g, s in zip(gates, states)]
            o1, o2 = (torch.einsum("bhf,bhfe->bhe", q[:, t], s) for s in states)
            outs.append(w1 * o1 + w2 * o2)
        o = torch.stack(outs, dim=1).to(u.dtype)
        if self.o_norm is not None:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(b, L, -1))


class MLP(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HybridDecoderLayer(nn.Module):
    """MambaInLlama's MambaDecoderLayer (mixer under `mamba`, or `dsla`), called the way transformers 5's
    LlamaModel calls a LlamaDecoderLayer: hidden states first, everything else as keywords, a tensor back."""

    def __init__(self, config, name: str, mixer: nn.Module):
        super().__init__()
        self.mixer_name = name
        setattr(self, name, mixer)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, *args, **kwargs):
        h = hidden_states + getattr(self, self.mixer_name)(self.input_layernorm(hidden_states))
        return h + self.mlp(self.post_attention_layernorm(h))


def make_mixer(kind: str, config, ssm: dict) -> tuple[str, nn.Module]:
    """(attribute name, mixer) for a layer kind; ssm: d_inner, d_xb, d_state, d_conv, dt_rank, conv_bias, gate_*,
    dsla_* (the DSLA form; this project's where absent)."""
    hidden = config.hidden_size
    if kind == "mamba":
        return "mamba", Mamba(
            hidden, ssm["d_inner"], ssm["d_xb"], ssm["d_state"], ssm["d_conv"], ssm["dt_rank"], ssm["conv_bias"]
        )
    if kind == "mamba2":
        return "mamba", Mamba2(hidden, ssm["d_inner"], ssm["d_xb"], ssm["d_state"], ssm["d_conv"], ssm["conv_bias"])
    if kind == "dsla":
        heads, kv = config.num_attention_heads, ssm.get("dsla_kv_heads") or config.num_key_value_heads
        return "dsla", DSLA(hidden, heads, kv, config.head_dim, config.rms_norm_eps, ssm["gate_rank"], ssm["gate_norm"],
                            ssm.get("gate_clamp"), ssm.get("dsla_mix", "gamma"), ssm.get("dsla_o_norm", True))
    raise ValueError(kind)


# config.json fields of this project's hybrid format that a transformers Llama/Mistral config lacks.
DSLA_FORM = ("gate_rank", "gate_norm", "gate_clamp", "dsla_mix", "dsla_o_norm", "dsla_kv_heads")
HYBRID_FIELDS = ("base_model_type", "mixer_types", "d_state", "d_conv", "d_inner", "d_xb", "dt_rank",
                 "conv_bias", *DSLA_FORM, "quantization", "quantization_config")


@torch.no_grad()
def build_reference(config: dict, state: dict[str, torch.Tensor]) -> nn.Module:
    """A float32 transformers Llama/Mistral with the hybrid's mixers swapped in, holding `state`.

    config is a `llama_hybrid` config.json; the SSM sizes it leaves out take the runtime's defaults.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from mlx_hybrid.models.hybrid import ModelArgs

    args = ModelArgs.from_dict(config)
    ssm = {k: getattr(args, k) for k in ("d_inner", "d_xb", "d_state", "d_conv", "dt_rank", "conv_bias", *DSLA_FORM)}
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[args.base_model_type]
    base = {k: v for k, v in config.items() if k not in HYBRID_FIELDS and k != "model_type"}
    hf_config = config_cls(**base)
    model = model_cls(hf_config).float()
    for i, kind in enumerate(args.mixer_types):
        if kind != "attention":
            model.model.layers[i] = HybridDecoderLayer(hf_config, *make_mixer(kind, hf_config, ssm))
    state = dict(state)
    if hf_config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict({k: v.float() for k, v in state.items() if "rotary_emb" not in k}, strict=True)
    return model.eval()
