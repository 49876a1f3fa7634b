"""Students exported by `save_hybrid` load in the MLX runtime (`mlx_hybrid.load`) and give the same logits.

Tolerance: logits ~3 in magnitude; torch float32 vs MLX float32, different summation orders and
scan algorithms (chunked here, token by token there): measured max |diff| <= 7e-6; ATOL 1e-4.
"""

import json
import logging

import numpy as np
import pytest
import torch
from conftest import DSLA_SERVE, make_teacher

from hybrid_train.model import HybridArgs, convert_layers, load_hybrid, save_hybrid
from hybrid_train.teacher import load_teacher, load_tokenizer

mlx_hybrid = pytest.importorskip("mlx_hybrid")
import mlx.core as mx  # noqa: E402

ATOL = 1e-4


def perturb(model):
    """Move every parameter off its initial value (0, 1, identity), so a misplaced one changes the logits."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "gamma", "alpha_list")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1 or name.endswith("gk_proj.weight"):  # DSLA-Serve's history gate starts as the identity
                p.add_(0.1 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize(
    "arch,kinds,overrides,dsla",
    [
        ("llama", ["dsla", "attention", "mamba2", "mamba"], {}, {"gate_rank": 4}),
        ("mistral", ["attention", "mamba", "attention", "dsla"], {"sliding_window": 8}, {"gate_rank": 4}),  # window < length
        ("llama", ["attention", "dsla", "attention", "dsla"], {}, DSLA_SERVE),
    ],
    ids=["llama", "mistral", "dsla-serve-form"],
)
def test_export_loads_in_mlx_with_the_same_logits(tmp_path, arch, kinds, overrides, dsla):
    teacher = make_teacher(tmp_path / "teacher", arch=arch, **overrides)
    student = convert_layers(load_teacher(teacher), kinds, HybridArgs(d_state=8, **dsla))
    perturb(student)
    out = tmp_path / "student"
    save_hybrid(student, out, load_tokenizer(teacher))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama_hybrid" and config["base_model_type"] == arch
    assert config["mixer_types"] == kinds

    ids = np.random.default_rng(0).integers(0, 300, (1, 40))
    with torch.no_grad():
        expected = student(torch.tensor(ids), use_cache=False).logits[0].numpy()
    model, tokenizer = mlx_hybrid.load(out, dtype="float32")
    got = np.array(model(mx.array(ids)))[0]
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    assert tokenizer.encode("Hybrid models") == load_tokenizer(teacher).encode("Hybrid models")
    # And back into torch, bit for bit.
    with torch.no_grad():
        again = load_hybrid(out)(torch.tensor(ids), use_cache=False).logits[0].numpy()
    np.testing.assert_array_equal(again, expected)


def test_a_students_tokenizer_loads_without_a_notice(tmp_path, caplog):
    """A student's directory (config.json of model_type llama_hybrid) with the GGUF teacher's
    tokenizer, as the stages save it: loading that tokenizer gives the teacher's ids, and
    transformers logs no notice of a model type it does not know (it did at every load)."""
    from mlx_hybrid.default_model import PATH, TEACHER, teacher_gguf
    from mlx_hybrid.validate import read_json_object

    teacher = load_tokenizer(teacher_gguf(read_json_object(PATH / TEACHER)))  # CI installs its package
    teacher.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama_hybrid", "base_model_type": "llama"}))
    with caplog.at_level(logging.WARNING, logger="transformers"):
        assert load_tokenizer(tmp_path).encode("Hybrid models") == teacher.encode("Hybrid models")
    assert "llama_hybrid" not in caplog.text
