"""Each loss on a small example whose value is worked out by hand in the comments."""

import math

import pytest
import torch

from hybrid_train.losses import IGNORE, distill_loss, dpo_loss, nll_loss, sequence_logprob
from hybrid_train.model import gate_similarity

LN3 = math.log(3)


def test_distill_loss_by_hand():
    # Position 0: student p = (1/4, 3/4), teacher q = (1/2, 1/2), label 1:
    #   NLL = -ln(3/4) = 0.287682; KL(q || p) = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3) = 0.143841.
    # Position 1: masked (a prompt token), whatever its logits.
    # Position 2: student = teacher = (1/2, 1/2), label 0: NLL = ln 2 = 0.693147, KL = 0.
    student = torch.tensor([[[0.0, LN3], [9.0, -9.0], [0.0, 0.0]]])
    teacher = torch.tensor([[[0.0, 0.0], [-9.0, 9.0], [0.0, 0.0]]])
    labels = torch.tensor([[1, IGNORE, 0]])
    loss, parts = distill_loss(student, teacher, labels, alpha=1.0, beta=0.1)
    nll = (0.287682072 + 0.693147181) / 2  # 0.490414626
    kl = 0.143841036 / 2  # 0.071920518
    assert parts["nll"].item() == pytest.approx(nll, abs=1e-6)
    assert parts["kl"].item() == pytest.approx(kl, abs=1e-6)
    assert loss.item() == pytest.approx(nll + 0.1 * kl, abs=1e-6)  # 0.497606678 with alpha = 1, beta = 0.1
    # alpha = 0, beta = 1 is the pure word-level KL.
    assert distill_loss(student, teacher, labels, alpha=0.0, beta=1.0)[0].item() == pytest.approx(kl, abs=1e-6)


def test_nll_and_sequence_logprob_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [0.0, LN3], [5.0, 1.0]]])
    labels = torch.tensor([[1, 1, IGNORE]])
    # log p: ln(1/2) + ln(3/4) = ln(3/8) = -0.980829
    assert sequence_logprob(logits, labels).item() == pytest.approx(math.log(3 / 8), abs=1e-6)
    assert nll_loss(logits, labels).item() == pytest.approx(-math.log(3 / 8) / 2, abs=1e-6)


def test_dpo_loss_by_hand():
    # margin = beta ((log p_w - log ref_w) - (log p_l - log ref_l)) = 0.1 ((-2 + 2.5) - (-3 + 2)) = 0.15
    # loss = -ln sigmoid(0.15) = ln(1 + e^-0.15) = 0.620957
    loss, parts = dpo_loss(torch.tensor([-2.0]), torch.tensor([-3.0]), torch.tensor([-2.5]), torch.tensor([-2.0]), beta=0.1)
    assert loss.item() == pytest.approx(0.620957, abs=1e-6)
    assert parts["accuracy"].item() == 1.0
    # Student equal to the reference: margin 0, loss ln 2.
    same = dpo_loss(torch.tensor([-4.0]), torch.tensor([-1.0]), torch.tensor([-4.0]), torch.tensor([-1.0]))[0]
    assert same.item() == pytest.approx(math.log(2), abs=1e-7)


def test_gate_contrastive_term_by_hand():
    # Position 0: G1 = (1, 0), G2 = (1, 1): cos = 1 / sqrt 2. Position 1: equal gates: cos = 1.
    G1 = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])
    G2 = torch.tensor([[[1.0, 1.0], [0.5, 0.5]]])
    assert gate_similarity(G1, G2).item() == pytest.approx((1 / math.sqrt(2) + 1) / 2, abs=1e-6)  # 0.853553
