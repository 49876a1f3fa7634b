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
never as a ratio of two exponentials, so no chunk length can overflow. Every chunk's own part is
computed for all chunks at once (batched over a chunk axis); only the carried state is a loop, of
two element-wise ops a chunk: a GPU step of a small model is bound by the host's kernel launches,
which a loop of whole chunk computations multiplies. Pure PyTorch, float32; autograd
differentiates it directly.
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
    T = min(chunk, L)
    pad = -L % T  # the last chunk filled with tokens that add nothing (k = 0) and forget nothing (g = 0)
    q, k, v, g = (torch.nn.functional.pad(t, (0, 0, 0, pad)).unflatten(2, (-1, T)) for t in (q, k, v, g))  # (b, h, n, T, .)
    cum = g.cumsum(3)  # b_t within each chunk
    last = cum[:, :, :, -1:]  # (b, h, n, 1, dk or 1)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if scalar:
        diff = cum[..., 0, None] - cum[..., 0][..., None, :]  # b_t - b_s, (b, h, n, T, T)
        decay = torch.where(causal, diff, -torch.inf).exp()
        scores = (q @ k.transpose(-1, -2)) * decay
    else:
        diff = cum[..., :, None, :] - cum[..., None, :, :]  # (b, h, n, T, T, dk)
        decay = torch.where(causal[..., None], diff, -torch.inf).exp()
        scores = torch.einsum("bhntd,bhnsd,bhntsd->bhnts", q, k, decay)
    # Each chunk's contribution to the state at its end, and how much of the state before it survives.
    added = (k * (last - cum).exp()).transpose(-1, -2) @ v  # (b, h, n, dk, dv)
    kept = last.transpose(-1, -2).exp()  # (b, h, n, dk or 1, 1)
    before = []
    for c in range(q.shape[2]):
        before.append(state)
        state = kept[:, :, c] * state + added[:, :, c]
    o = (q * cum.exp()) @ torch.stack(before, 2) + scores @ v
    return o.flatten(2, 3)[:, :, :L], state
