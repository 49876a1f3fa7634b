"""The chunked scan against the recurrence run one token at a time in float64.

Tolerance: inputs ~N(0, 1), outputs up to ~10; float32 chunked vs float64 loop, measured <= 3e-6.
"""

import pytest
import torch

from hybrid_train.scan import chunked_gla

ATOL = 2e-5


def gla_loop(q, k, v, g, state):
    """S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t, o_t = q_t S_t, token by token in float64."""
    q, k, v, g, S = (t.double() for t in (q, k, v, g, state))
    outs = []
    for t in range(q.shape[2]):
        S = g[:, :, t, :, None].exp() * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, None, :] @ S)[:, :, 0])
    return torch.stack(outs, dim=2), S


@pytest.mark.parametrize("gate", ["per-feature", "scalar"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_scan_matches_the_recurrence(gate, chunk):
    torch.manual_seed(0)
    b, h, L, dk, dv = 2, 3, 37, 8, 5
    q, k = torch.randn(b, h, L, dk), torch.randn(b, h, L, dk)
    v = torch.randn(b, h, L, dv)
    # Log gates from near 0 (remember) to about -4 (forget at once), as the mixers produce.
    g = -torch.rand(b, h, L, dk if gate == "per-feature" else 1) * 4
    state = torch.randn(b, h, dk, dv)
    o, final = chunked_gla(q, k, v, g, state, chunk=chunk)
    o_ref, final_ref = gla_loop(q, k, v, g.expand(b, h, L, dk), state)
    torch.testing.assert_close(o.double(), o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(final.double(), final_ref, atol=ATOL, rtol=0)


def test_long_chunks_do_not_overflow():
    """Strong forgetting over a 64-token chunk: a ratio of exponentials would overflow float32 (e^-1280)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 1, 64, 4), torch.randn(1, 1, 64, 4), torch.randn(1, 1, 64, 4)
    g = torch.full((1, 1, 64, 4), -20.0)
    o, _ = chunked_gla(q, k, v, g, chunk=64)
    assert torch.isfinite(o).all()
    o_ref, _ = gla_loop(q, k, v, g, torch.zeros(1, 1, 4, 4))
    torch.testing.assert_close(o.double(), o_ref, atol=ATOL, rtol=0)


def test_gradients_match_the_recurrence():
    torch.manual_seed(2)
    shapes = [(1, 2, 20, 4), (1, 2, 20, 4), (1, 2, 20, 3), (1, 2, 20, 4)]
    inputs = [torch.randn(s, dtype=torch.float64) for s in shapes]
    inputs[3] = -inputs[3].abs()
    ours = [t.float().requires_grad_() for t in inputs]
    ref = [t.clone().requires_grad_() for t in inputs]
    chunked_gla(*ours, chunk=6)[0].pow(2).sum().backward()
    gla_loop(*ref, torch.zeros(1, 2, 4, 3, dtype=torch.float64))[0].pow(2).sum().backward()
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-3, rtol=1e-4)
