"""`save_adaptive` writes a directory that the MLX runtime runs as the teacher, as the student, or as
any prefix of the chained conversion order, on one set of loaded weights.

References: the teacher and the student in PyTorch, and a PyTorch model with just the first k layers
of the order swapped for the student's. Tolerance as in test_train_export.py (torch float32 vs MLX
float32, measured max |diff| ~ 4e-6; ATOL 1e-4).
"""

import copy

import numpy as np
import pytest
import torch
from conftest import DSLA_SERVE, make_teacher

from hybrid_train.errors import TrainError
from hybrid_train.model import HybridArgs, convert_layers, save_adaptive
from hybrid_train.teacher import load_teacher, load_tokenizer

mlx_hybrid = pytest.importorskip("mlx_hybrid")
import mlx.core as mx  # noqa: E402

ATOL = 1e-4
ORDER = [2, 0, 3]


FORMS = {"ours": dict(gate_rank=4), "dsla-serve": DSLA_SERVE}  # DSLA in this project's form and in DSLA-Serve's


@pytest.fixture(scope="module", params=FORMS)
def models(tmp_path_factory, request):
    path = make_teacher(tmp_path_factory.mktemp("adaptive") / "teacher")
    teacher = load_teacher(path)
    student = convert_layers(copy.deepcopy(teacher), ["dsla", "attention", "dsla", "dsla"], HybridArgs(**FORMS[request.param]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # as after the dsla stage: the DSLA mixers (q, k, v, o included) are trained
        for name, p in student.named_parameters():
            if ".dsla." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return path, teacher.eval(), student.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids), use_cache=False).logits[0].numpy()


def test_runtime_runs_every_prefix_of_the_order(tmp_path, models):
    path, teacher, student = models
    out = tmp_path / "adaptive"
    save_adaptive(teacher, student, out, ORDER, max_layers=2, tokenizer=load_tokenizer(path))
    model, _ = mlx_hybrid.load(out, dtype="float32")
    assert model.args.dsla_order == ORDER and model.args.dsla_max_layers == 2
    ids = np.random.default_rng(0).integers(0, 300, (1, 40))
    for k in range(len(ORDER) + 1):
        expected = copy.deepcopy(teacher)
        for i in ORDER[:k]:
            expected.model.layers[i] = student.model.layers[i]
        got = np.array(model(mx.array(ids), model.make_cache(ORDER[:k])))[0]
        np.testing.assert_allclose(got, logits(expected, ids), atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.array(model(mx.array(ids)))[0], logits(teacher, ids), atol=ATOL, rtol=0)


def test_refuses_students_that_differ_outside_the_dsla_mixers(tmp_path, models):
    _, teacher, student = models
    with pytest.raises(TrainError, match="layer 1 must be attention in the teacher and dsla in the student"):
        save_adaptive(teacher, student, tmp_path / "a", [2, 1])
    other = copy.deepcopy(student)
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight.add_(1e-3)
    with pytest.raises(TrainError, match=r"differ at model\.layers\.1\.mlp\.up_proj\.weight"):
        save_adaptive(teacher, other, tmp_path / "b", ORDER)
    with pytest.raises(TrainError, match="max_layers 4"):
        save_adaptive(teacher, student, tmp_path / "c", ORDER, max_layers=4)
    assert not any(tmp_path.iterdir())  # nothing written on refusal
