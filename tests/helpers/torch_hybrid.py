"""Random hybrid models on the independent PyTorch reference in `mlx_hybrid.convert.torch_hybrid`
(MambaInLlama's Mamba and Mamba2 mixers and DSLA as naive float64 loops; `hybrid convert --verify`
runs it too). `build_hybrid` swaps these mixers into a transformers Llama/Mistral the way
MambaInLlama's `MambaTransformerHybridModelWrapper` does (Algorithm 1 of "The Mamba in the Llama":
x, B, C, out <- V, K, Q, O), then perturbs every new parameter so that none sits at a value
(0, 1, identity) that would hide a mistake.
"""

import torch
from torch import nn

from mlx_hybrid.convert.torch_hybrid import (  # noqa: F401  (re-exported for the tests)
    DSLA,
    HybridDecoderLayer,
    Mamba,
    Mamba2,
    make_mixer,
)


@torch.no_grad()
def init_from_attention(mixer: nn.Module, attn: nn.Module):
    """Algorithm 1 as MambaInLlama's wrappers do it: x <- V, B <- K, C <- Q, out <- O (DSLA keeps Q, K, V, O)."""
    if isinstance(mixer, Mamba):
        for dst, src in ((mixer.in_proj_x, attn.v_proj), (mixer.B_proj, attn.k_proj),
                         (mixer.C_proj, attn.q_proj), (mixer.out_proj, attn.o_proj)):
            dst.load_state_dict(src.state_dict())
    elif isinstance(mixer, Mamba2):
        d_inner, d_xb = mixer.d_inner, mixer.d_xb
        w = mixer.in_proj.weight
        w[d_inner : d_inner + d_xb] = attn.v_proj.weight
        w[d_inner + d_xb : d_inner + 2 * d_xb] = attn.k_proj.weight
        w[d_inner + 2 * d_xb : 2 * d_inner + 2 * d_xb] = attn.q_proj.weight
        mixer.out_proj.load_state_dict(attn.o_proj.state_dict())
    else:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(mixer, name).load_state_dict(getattr(attn, name).state_dict())


@torch.no_grad()
def perturb_new_parameters(mixer: nn.Module, scale: float = 0.08):
    """Randomize what Algorithm 1 leaves at its init (z, dt, A, D, conv, gates, gamma, norms), so none is 0 or 1."""
    randn = torch.randn_like
    if isinstance(mixer, Mamba):
        mixer.in_proj_z.weight.normal_(0, scale)
        mixer.dt_proj_down.weight.normal_(0, scale)
        mixer.dt_proj.weight.normal_(0, 0.3)
        mixer.dt_proj.bias.copy_(-1.5 + 0.5 * randn(mixer.dt_proj.bias))  # softplus(2 * bias) ~ 0.05 .. 0.5
        mixer.A_log.add_(0.3 * randn(mixer.A_log))
    elif isinstance(mixer, Mamba2):
        d_inner, d_xb = mixer.d_inner, mixer.d_xb
        mixer.in_proj.weight[:d_inner].normal_(0, scale)  # z
        mixer.in_proj.weight[2 * d_inner + 2 * d_xb :].normal_(0, 0.3)  # dt
        mixer.dt_bias.copy_(-2.0 + 0.5 * randn(mixer.dt_bias))
        mixer.A_log.copy_(torch.log(torch.empty_like(mixer.A_log).uniform_(1, 16)))
        mixer.norm.weight.add_(0.3 * randn(mixer.norm.weight))
    else:
        for layer in (mixer.gate1_down, mixer.gate1_up, mixer.gate2_down, mixer.gate2_up):
            layer.weight.normal_(0, 0.3)
        mixer.gate1_up.bias.copy_(2.0 + randn(mixer.gate1_up.bias))  # slow forgetting
        mixer.gate2_up.bias.copy_(-1.0 + randn(mixer.gate2_up.bias))  # fast forgetting
        mixer.gamma.fill_(0.3)
        mixer.o_norm.weight.add_(0.3 * randn(mixer.o_norm.weight))
    if isinstance(mixer, (Mamba, Mamba2)):
        mixer.D.add_(0.5 * randn(mixer.D))
        mixer.conv1d.weight.normal_(0, 0.5)
        if mixer.conv1d.bias is not None:
            mixer.conv1d.bias.normal_(0, 0.1)


@torch.no_grad()
def build_hybrid(model: nn.Module, layer_types: list[str], ssm: dict) -> nn.Module:
    """Replace the non-attention layers of a transformers Llama/Mistral model in place, as MambaInLlama's
    wrapper does: new mixer from the layer's attention (Algorithm 1), MLP and norms copied over."""
    for i, kind in enumerate(layer_types):
        if kind == "attention":
            continue
        old = model.model.layers[i]
        name, mixer = make_mixer(kind, model.config, ssm)
        init_from_attention(mixer, old.self_attn)
        perturb_new_parameters(mixer)
        layer = HybridDecoderLayer(model.config, name, mixer)
        for part in ("mlp", "input_layernorm", "post_attention_layernorm"):
            getattr(layer, part).load_state_dict(getattr(old, part).state_dict())
        model.model.layers[i] = layer
    return model.eval()


@torch.no_grad()
def logits(model: nn.Module, ids: list[int]):
    """Full-sequence float logits (L, vocab) as numpy, without a KV cache."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
