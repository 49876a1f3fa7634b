"""DSLA-Serve's layer as an independent reference, written from their code (utnslab/DSLA-Serve,
src/layer.py: `DualStateLinearAttention`), not from this project's.

It sits in a transformers Llama where their `convert_transformer_to_dsla_multiple` puts it, as
the `self_attn` of the layers in `config.dsla_list`, and their Triton `fused_recurrent_gla` is
replaced by the plain recurrence of flash-linear-attention's naive GLA (fla/ops/gla/naive.py),
token by token in float32. `save_checkpoint` writes what their run_distill.py saves with
`save_pretrained`: the Llama config with their extra fields, and the model's tensors under their
names (sharded, as their released checkpoints are).
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.factories import BASE_CONFIG, make_tokenizer


def naive_recurrent_gla(q, k, v, gk):
    """fla's naive recurrent GLA over (batch, heads, L, d) inputs, from a zero state:
    h_t = h_{t-1} * exp(gk_t)[:, None] + k_t^T v_t, o_t = (q_t / sqrt(d)) h_t."""
    q, k, v, gk = (t.float() for t in (q, k, v, gk))
    b, h, L, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    o = torch.zeros_like(v)
    for t in range(L):
        state = state * gk[:, :, t].exp()[..., None] + k[:, :, t, :, None] * v[:, :, t, None, :]
        o[:, :, t] = (q[:, :, t, :, None] * dk**-0.5 * state).sum(-2)
    return o


class DualStateLinearAttention(nn.Module):
    """Their layer: q, k, v, o with as many K/V heads as query heads and no RoPE; full-rank gates
    gk_proj, gk_proj2 with bias, logsigmoid / 16 clamped at -50; the two GLA outputs mixed by
    softmax(alpha_list); no output norm."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, self.hidden_size, bias=False)
        ker = config.kernel_hidden_size
        self.gk_proj = nn.Linear(width, ker * self.num_heads, bias=True)
        nn.init.eye_(self.gk_proj.weight)
        self.gk_proj2 = nn.Linear(width, ker * self.num_heads, bias=True)
        self.gk_proj.bias.data.fill_(0.0)
        self.gk_proj2.bias.data.fill_(0.0)
        self.gate_logit_normalizer = 16
        self.clamp_min = -50
        self.alpha_list = nn.Parameter(torch.empty(2).uniform_(0, 1))

    def forward(self, hidden_states, *args, **kwargs):
        b, L, _ = hidden_states.shape

        def heads(t):
            return t.view(b, L, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(hidden_states)), heads(self.k_proj(hidden_states)), heads(self.v_proj(hidden_states))
        gk = torch.clamp_min(F.logsigmoid(heads(self.gk_proj(hidden_states))) / self.gate_logit_normalizer, self.clamp_min)
        gk2 = torch.clamp_min(F.logsigmoid(heads(self.gk_proj2(hidden_states))) / self.gate_logit_normalizer, self.clamp_min)
        far, close = naive_recurrent_gla(q, k, v, gk), naive_recurrent_gla(q, k, v, gk2)
        alpha = F.softmax(self.alpha_list, dim=0)
        out = alpha[0] * far + alpha[1] * close
        return self.o_proj(out.transpose(1, 2).reshape(b, L, self.hidden_size)), None


@torch.no_grad()
def randomize(layer: DualStateLinearAttention, g: torch.Generator):
    """Distilled-looking weights: projections off their init, history gates slow and recency
    gates fast, a few gate logits so negative that the clamp bounds them."""
    for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
        proj.weight.normal_(0, 0.08, generator=g)
    for proj, lo, hi in ((layer.gk_proj, 1.0, 6.0), (layer.gk_proj2, -4.0, 1.0)):
        proj.weight.add_(torch.randn(proj.weight.shape, generator=g), alpha=0.1)
        proj.bias.uniform_(lo, hi, generator=g)
        proj.bias[torch.rand(proj.bias.shape, generator=g) < 0.05] = -2000.0
    layer.alpha_list.normal_(0, 1, generator=g)


@torch.no_grad()
def base_model(seed: int, vocab_size: int, **overrides):
    """A random transformers Llama (grouped K/V heads, as their server's Llama-3.1-8B has)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**dict(BASE_CONFIG, vocab_size=vocab_size, num_hidden_layers=4, **overrides)))
    for p in model.parameters():
        p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p), alpha=0.08)
    return model.eval()


@torch.no_grad()
def convert_layers(model, dsla_list: list[int], layers: dict[int, DualStateLinearAttention] | None = None, seed: int = 0):
    """Their conversion in place: the layers in dsla_list get a DualStateLinearAttention as
    `self_attn` (the given modules, else new random ones); MLPs and norms stay."""
    config = model.config
    config.kernel_hidden_size = config.hidden_size // config.num_attention_heads
    config.dsla_list = list(dsla_list)
    g = torch.Generator().manual_seed(seed)
    for i in dsla_list:
        if layers is None:
            layer = DualStateLinearAttention(config)
            randomize(layer, g)
        else:
            layer = layers[i]
        model.model.layers[i].self_attn = layer
    return model


def save_checkpoint(model, path: Path) -> Path:
    """What their run_distill.py leaves: `save_pretrained` (sharded) and the tokenizer."""
    path = Path(path)
    make_tokenizer(path)
    model.config.layer_to_train = -1
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
    assert json.loads((path / "config.json").read_text())["dsla_list"] == model.config.dsla_list
    return path


@torch.no_grad()
def logits(model, ids: list[int]):
    """Full-sequence float logits (L, vocab) as numpy, without a cache."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
