"""Chunked gated linear attention: the one recurrence behind the Mamba, Mamba2 and DSLA mixers.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,    o_t = q_t S_t

per head, with S (dk, dv) and a log forget gate g_t <= 0 that is either one per key feature
(dk wide) or one scalar per head (width 1). The mixers map onto it as
  Mamba:  a head per channel, q = C, k = dt B, v = x (dv = 1), g = dt A (per state feature)
  Mamba2: a head per Mamba2 head, q = C, k = dt B, v = x, g = dt A (scalar)
  DSLA:   q, k, v of the attention, g from the gate projections (per key feature)

Training needs the whole sequence at once, so the scan runs in chunks of T tokens: inside a chunk
the outputs are a masked (T x T) attention with decays exp(b_t - b_s) (b the cumulative log gate),
between chunks only the (dk, dv) state is carried. exp(b_t - b_s) is formed from the difference,
never as a ratio of two exponentials, so no chunk length can overflow. Pure PyTorch, float32;
autograd differentiates it directly.
"""

import torch


def chunked_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o (batch, heads, L, dv) and the final state (batch, heads, dk, dv), in float32.

    q, k: (batch, heads, L, dk); v: (batch, heads, L, dv); g: (batch, heads, L, dk or 1), the log
    gates; state: the state before the first token (zeros if None).
    """
    q, k, v, g = (t.float() for t in (q, k, v, g))
    b, h, L, dk = q.shape
    dv = v.shape[-1]
    scalar = g.shape[-1] == 1
    if state is None:
        state = q.new_zeros(b, h, dk, dv)
    outs = []
    for start in range(0, L, chunk):
        qc, kc, vc, gc = (t[:, :, start : start + chunk] for t in (q, k, v, g))
        T = qc.shape[2]
        cum = gc.cumsum(2)  # b_t, (b, h, T, dk or 1)
        inter = (qc * cum.exp()) @ state
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if scalar:
            diff = cum[..., 0, None] - cum[..., 0][:, :, None, :]  # b_t - b_s, (b, h, T, T)
            decay = torch.where(causal, diff, -torch.inf).exp()
            scores = (qc @ kc.transpose(-1, -2)) * decay
        else:
            diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # (b, h, T, T, dk)
            decay = torch.where(causal[:, :, None], diff, -torch.inf).exp()
            scores = torch.einsum("bhtd,bhsd,bhtsd->bhts", qc, kc, decay)
        outs.append(inter + scores @ vc)
        last = cum[:, :, -1:]  # (b, h, 1, dk or 1)
        state = last.transpose(-1, -2).exp() * state + (kc * (last - cum).exp()).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=2), state

