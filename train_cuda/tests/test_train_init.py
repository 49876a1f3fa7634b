"""Mamba2's initialization beyond the copied weights: the identity conv and `Mamba2.calibrate`.

Found on the first real run: with a random conv, a random z gate and norm weights of 1, the
attention-initialized 50% SmolLM2 student started at held-out perplexity ~3.6e5 (teacher 40),
its mixer outputs at cosine ~0 to the attention outputs they replace and 3-8x their size.
References here: the causal conv's definition, the teacher's own attention activations (o_proj
inputs, float64 statistics) and the teacher's logits.
"""

import torch
import torch.nn.functional as F

from hybrid_train.model import HybridArgs, causal_conv, convert_layers
from hybrid_train.teacher import load_teacher

KINDS = ["attention", "mamba2", "attention", "mamba2"]


def calibration_ids(n=4, length=24, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (length,), generator=g).tolist() for _ in range(n)]


def o_proj_inputs(teacher, layer, ids):
    """The teacher attention's output before o_proj at `layer`, (tokens, features), float64."""
    got = []
    hook = teacher.model.layers[layer].self_attn.o_proj.register_forward_hook(lambda m, a, o: got.append(a[0][0].double()))
    with torch.no_grad():
        for x in ids:
            teacher(torch.tensor([x]))
    hook.remove()
    return torch.cat(got)


def test_conv_starts_as_identity(teacher_dir):
    mixer = convert_layers(load_teacher(teacher_dir), KINDS, HybridArgs(d_state=16)).model.layers[1].mamba
    x = torch.randn(2, 9, mixer.conv1d.in_channels)
    with torch.no_grad():
        torch.testing.assert_close(causal_conv(mixer.conv1d, x), x, atol=0, rtol=0)


def test_calibrated_norm_weight_is_attention_head_rms(teacher_dir):
    teacher = load_teacher(teacher_dir)
    ids = calibration_ids()
    student = convert_layers(load_teacher(teacher_dir), KINDS, HybridArgs(d_state=16), ids)  # d_state = head_dim
    for layer in (1, 3):
        o = o_proj_inputs(teacher, layer, ids)  # (tokens, heads * 16)
        expected = o.reshape(len(o), -1, 16).pow(2).mean((0, 2)).sqrt().repeat_interleave(16)
        torch.testing.assert_close(student.model.layers[layer].mamba.norm.weight.double(), expected, atol=1e-6, rtol=1e-5)


def test_calibrated_gate_divides_out(teacher_dir):
    """z is positive and equal across each head's channels on the calibration tokens, so the per-head
    RMSNorm removes it: doubling z leaves the output unchanged (the norm's eps set to 0 here: on the
    first tokens y is small enough for eps to count), which a random z does not."""
    ids = calibration_ids()
    student = convert_layers(load_teacher(teacher_dir), KINDS, HybridArgs(d_state=16), ids)
    mixer = student.model.layers[1].mamba
    u = []
    hook = mixer.register_forward_pre_hook(lambda m, a: u.append(a[0]))
    with torch.no_grad():
        student(torch.tensor([ids[0]]))
    hook.remove()
    u = u[0]
    mixer.eps = 0.0
    with torch.no_grad():
        z = mixer.split(u)[0]
        assert bool((z > 0).all())
        before = mixer(u)
        mixer.in_proj.weight[: mixer.d_inner] *= 2
        torch.testing.assert_close(mixer(u), before, atol=1e-4, rtol=1e-4)
        mixer.in_proj.weight[: mixer.d_inner].normal_(0, 0.1)
        random = mixer(u)
        mixer.in_proj.weight[: mixer.d_inner] *= 2
        assert float((mixer(u) - random).abs().max()) > 1e-2


def test_calibration_brings_the_student_closer_to_the_teacher(teacher_dir):
    teacher = load_teacher(teacher_dir)
    ids = calibration_ids(n=8)
    test = torch.tensor(calibration_ids(n=4, seed=6))
    with torch.no_grad():
        target = F.log_softmax(teacher(test).logits, -1)
        kl = {}
        for name, calibration in (("plain", None), ("calibrated", ids)):
            torch.manual_seed(0)
            student = convert_layers(load_teacher(teacher_dir), KINDS, HybridArgs(d_state=16), calibration)
            logp = F.log_softmax(student(test).logits, -1)
            kl[name] = float((target.exp() * (target - logp)).sum(-1).mean())
    assert kl["calibrated"] < kl["plain"], kl
