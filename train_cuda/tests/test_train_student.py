"""Attention initialization (Algorithm 1 of "The Mamba in the Llama") and the choice of attention layers.

Degenerate case (section 2.1): with identity discretization (dt = 1, A = 0) and no D, a recurrent
mixer fed the x, B, C (or q, k, v) its attention initialization gives computes attention without
softmax or RoPE, y_t = sum_{s<=t} (q_t . k_s / sqrt(d)) v_s per head with the KV heads shared by
their query groups. Tolerance: float32 scan vs float64 reference, outputs ~1, measured <= 2e-6.
"""

import math

import pytest
import torch
from conftest import DSLA_SERVE, make_teacher

from hybrid_train import layers
from hybrid_train.errors import TrainError
from hybrid_train.model import HybridArgs, convert_layers
from hybrid_train.scan import chunked_gla
from hybrid_train.teacher import load_teacher

ATOL = 1e-5
L = 33


def linear_attention(attn, u, heads, kv_heads):
    """Teacher's attention layer without softmax and RoPE, float64, before o_proj: (L, heads * head_dim)."""
    u = u[0].double()
    q, k, v = (getattr(attn, n).weight.double() @ u.T for n in ("q_proj", "k_proj", "v_proj"))
    hd = q.shape[0] // heads
    q, k, v = (t.T.reshape(L, -1, hd) for t in (q, k, v))
    causal = torch.ones(L, L, dtype=torch.float64).tril()
    rep = heads // kv_heads
    return torch.cat([(causal * (q[:, h] @ k[:, h // rep].T) / math.sqrt(hd)) @ v[:, h // rep] for h in range(heads)], -1)


def identity_scan(q, k, v):
    """chunked_gla with all gates 1 (log gate 0): q, k (b, heads, L, dk), v (b, heads, L, dv)."""
    return chunked_gla(q, k, v, torch.zeros_like(q[..., :1]), chunk=8)[0]


@pytest.mark.parametrize("kind,form", [("mamba", {}), ("mamba2", {}), ("dsla", {}), ("dsla", DSLA_SERVE)],
                         ids=["mamba", "mamba2", "dsla", "dsla-serve"])
def test_attention_initialized_mixer_is_linearized_attention(teacher_dir, kind, form):
    teacher = load_teacher(teacher_dir)
    student = convert_layers(load_teacher(teacher_dir), [kind] * 4, HybridArgs(d_state=16, **form))  # d_state = head_dim
    cfg = teacher.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(3)
    u = torch.randn(1, L, cfg.hidden_size)
    layer = 1
    mixer = student.model.layers[layer].mixer
    with torch.no_grad():
        if kind == "mamba":  # one GLA head per channel c, reading B, C of group c // d_state
            x, _, B, C, _ = mixer.inputs(u)
            q = C.repeat_interleave(16, dim=2).transpose(1, 2) * hd**-0.5
            y = identity_scan(q, B.repeat_interleave(16, dim=2).transpose(1, 2), x.transpose(1, 2)[..., None])
            y = y[..., 0].transpose(1, 2)
        elif kind == "mamba2":
            _, xBC, _ = mixer.split(u)
            x, B, C = mixer.heads(xBC)
            y = identity_scan(C.transpose(1, 2) * hd**-0.5, B.transpose(1, 2), x.transpose(1, 2))
            y = y.transpose(1, 2).reshape(1, L, -1)
        else:
            y = identity_scan(*mixer.qkv(u)).transpose(1, 2).reshape(1, L, -1)
    expected = linear_attention(teacher.model.layers[layer].self_attn, u, cfg.num_attention_heads, cfg.num_key_value_heads)
    torch.testing.assert_close(y[0].double(), expected, atol=ATOL, rtol=0)
    # out_proj / o_proj is the attention's O.
    out_weight = mixer.o_proj.weight if kind == "dsla" else mixer.out_proj.weight
    torch.testing.assert_close(out_weight, teacher.model.layers[layer].self_attn.o_proj.weight, atol=0, rtol=0)


def test_conversion_keeps_everything_else(teacher_dir):
    teacher = load_teacher(teacher_dir)
    student = convert_layers(load_teacher(teacher_dir), ["attention", "mamba2", "attention", "mamba2"], HybridArgs())
    ours, theirs = student.state_dict(), teacher.state_dict()
    for name, value in theirs.items():
        if ".self_attn." in name and name.split(".")[2] in ("1", "3"):
            continue
        torch.testing.assert_close(ours[name], value, atol=0, rtol=0)
    ids = torch.randint(0, 300, (1, 20))
    all_attention = convert_layers(load_teacher(teacher_dir), ["attention"] * 4, HybridArgs())
    with torch.no_grad():
        torch.testing.assert_close(all_attention(ids).logits, teacher(ids).logits, atol=0, rtol=0)


def test_stepwise_conversion_rules(teacher_dir):
    student = convert_layers(load_teacher(teacher_dir), ["attention", "mamba", "attention", "mamba"], HybridArgs())
    trained = student.model.layers[1].mamba.A_log.detach().clone()
    convert_layers(student, ["attention", "mamba", "mamba", "mamba"], HybridArgs())  # 50% -> 25%
    torch.testing.assert_close(student.model.layers[1].mamba.A_log, trained, atol=0, rtol=0)
    with pytest.raises(TrainError, match="layer 1 is already mamba; it cannot become attention"):
        convert_layers(student, ["attention"] * 4, HybridArgs())
    with pytest.raises(TrainError, match="SSM sizes"):
        convert_layers(student, ["attention", "mamba", "mamba", "mamba"], HybridArgs(d_state=8))


def test_attention_layer_specs():
    assert layers.attention_layers({"every": 2}, 8) == [0, 2, 4, 6]
    assert layers.attention_layers({"every": 4}, 8) == [0, 4]  # a subset of every 2: stepwise 50% -> 25%
    assert layers.attention_layers({"layers": [5, 1]}, 8) == [1, 5]
    entropy = [0.3, 2.0, 0.1, 1.5]
    assert layers.conversion_order(entropy) == [2, 0, 3, 1]
    assert layers.attention_layers({"entropy": True, "keep": 0.5}, 4, entropy) == [1, 3]
    assert layers.attention_layers({"entropy": True, "keep": 1}, 4, entropy) == [1]
    with pytest.raises(TrainError, match="not a layer index"):
        layers.attention_layers({"layers": [9]}, 8)


def test_attention_entropy(tmp_path):
    """Layer 1 with q = 0 attends uniformly: entropy log L exactly. Layer 2 with huge q, k is near one-hot."""
    teacher = load_teacher(make_teacher(tmp_path / "t", seed=1))
    with torch.no_grad():
        teacher.model.layers[1].self_attn.q_proj.weight.zero_()
        teacher.model.layers[2].self_attn.q_proj.weight.mul_(40)
        teacher.model.layers[2].self_attn.k_proj.weight.mul_(40)
    prompts = [list(range(5, 5 + n)) for n in (6, 11)]
    entropy = layers.attention_entropy(teacher, prompts)
    assert entropy[1] == pytest.approx((math.log(6) + math.log(11)) / 2, abs=1e-6)
    assert entropy[2] < 0.2 * min(entropy[0], entropy[3])
    assert layers.conversion_order(entropy)[0] == 2 and layers.conversion_order(entropy)[-1] == 1


def test_dsla_serve_form_distills(teacher_dir):
    """train_cuda trains DSLA-Serve's form: its gates and mix get gradients, and a few steps of the
    `dsla` stage's loss (KL to the teacher) lower it."""
    from hybrid_train.losses import distill_loss

    teacher = load_teacher(teacher_dir)
    student = convert_layers(load_teacher(teacher_dir), ["attention", "dsla", "attention", "attention"], HybridArgs(**DSLA_SERVE))
    mixer = student.model.layers[1].dsla
    assert mixer.o_norm is None and mixer.k_proj.weight.shape == (64, 64) and mixer.alpha_list.shape == (2,)
    student.requires_grad_(False)
    mixer.requires_grad_(True)
    opt = torch.optim.Adam(mixer.parameters(), lr=3e-3)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (4, 24))
    with torch.no_grad():
        target = teacher(ids, use_cache=False).logits
    losses = []
    for _ in range(8):
        loss, _ = distill_loss(student(ids, use_cache=False).logits, target, ids, alpha=0.0, beta=1.0)
        opt.zero_grad()
        loss.backward()
        assert all(mixer.get_parameter(n).grad.abs().sum() > 0 for n in ("gk_proj.weight", "gk_proj2.bias", "alpha_list"))
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
