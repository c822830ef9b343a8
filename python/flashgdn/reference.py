"""Float64 token-by-token reference of the GDN recurrence (for tests and accuracy checks).

Differentiable with torch.autograd, so it also gives reference gradients.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# tokens a checkpointed block of the reference's recurrence under autograd
CKPT_TOKENS = 64


def _steps(S: Tensor, kb: Tensor, qb: Tensor, vb: Tensor, egb: Tensor,
           bb: Tensor) -> Tuple[Tensor, Tensor]:
    """The recurrence over one block of tokens from state S [H_v, K, V]: (the state after
    it, the rows S^T q_t [t, H_v, V] before the scale)."""
    rows = []
    for t in range(kb.shape[0]):
        S = egb[t][:, None, None] * S                          # S = exp(g_t) S
        pred = torch.bmm(kb[t].unsqueeze(1), S).squeeze(1)     # S^T k_t, per head
        u = bb[t][:, None] * (vb[t] - pred)                    # beta_t (v_t - S^T k_t)
        S = S + kb[t].unsqueeze(2) * u.unsqueeze(1)            # S + k_t u^T
        rows.append(torch.bmm(qb[t].unsqueeze(1), S).squeeze(1))  # S^T q_t
    return S, torch.stack(rows)


def recurrent_gated_delta_rule_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Returns (o [B, T, H_v, V], final_state [N, H_v, K, V]) in float64.

    Inputs as for flashgdn.chunk_gated_delta_rule (any float dtype; computed in float64).
    """
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    grp = Hv // Hqk
    scale = K ** -0.5 if scale is None else scale
    f = torch.float64
    q, k, v = (x.to(f).repeat_interleave(grp, dim=2) if x is not v else x.to(f) for x in (q, k, v))
    eg, beta = torch.exp(g.to(f)), beta.to(f)
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        bounds = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    segments: list = [[] for _ in range(B)]
    finals = []
    for n, (b, s, e) in enumerate(bounds):
        S = (initial_state[n].to(f) if initial_state is not None
             else torch.zeros(Hv, K, V, dtype=f, device=q.device))
        rows = []
        # one token at a time; batched products (bmm, broadcasting) rather than einsum: per
        # call on this repository's 2-core CPU, 2.6 against 7.7 us of host overhead (8 x 8
        # heads' states) and 6.2 against 34.7 us at 4 x 128 x 128; a 2000-token reference
        # 0.19 against 0.25 s. The GPU tests' references (up to 32k tokens) are launch-bound
        # the same way (not yet timed there). Same values: bit-identical o and final state on
        # the CPU for the cases tried, gradients within 5e-16.
        kb, qb, vb, egb, bb = k[b, s:e], q[b, s:e], v[b, s:e], eg[b, s:e], beta[b, s:e]
        # Under autograd, blocks of CKPT_TOKENS tokens are checkpointed: each token's step
        # keeps ~2 states alive for the backward (8 MB a token at 32 heads), 41 GB for
        # 5120 tokens, which ran the GPU tests out of memory beside each other; checkpointed,
        # a block boundary's state is kept and one block's steps are recomputed at a time
        # (the same float64 operations on the same values).
        grad = torch.is_grad_enabled() and any(
            x.requires_grad for x in (kb, qb, vb, egb, bb, S))
        for t0 in range(0, e - s, CKPT_TOKENS):
            t1 = min(t0 + CKPT_TOKENS, e - s)
            args = (S, kb[t0:t1], qb[t0:t1], vb[t0:t1], egb[t0:t1], bb[t0:t1])
            if grad:
                S, blk = checkpoint(_steps, *args, use_reentrant=False)
            else:
                S, blk = _steps(*args)
            rows.append(blk)
        segments[b].append(scale * torch.cat(rows) if rows
                           else torch.zeros(0, Hv, V, dtype=f, device=q.device))
        finals.append(S)
    o = torch.stack([torch.cat(segs) for segs in segments])
    return o, torch.stack(finals)
