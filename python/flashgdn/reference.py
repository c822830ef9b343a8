"""Float64 token-by-token reference of the GDN recurrence (for tests and accuracy checks).

Differentiable with torch.autograd, so it also gives reference gradients.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


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
    g, beta = g.to(f), beta.to(f)
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
        for t in range(s, e):
            S = torch.exp(g[b, t])[:, None, None] * S
            pred = torch.einsum("hkv,hk->hv", S, k[b, t])
            u = beta[b, t][:, None] * (v[b, t] - pred)
            S = S + torch.einsum("hk,hv->hkv", k[b, t], u)
            rows.append(scale * torch.einsum("hkv,hk->hv", S, q[b, t]))
        segments[b].append(torch.stack(rows) if rows
                           else torch.zeros(0, Hv, V, dtype=f, device=q.device))
        finals.append(S)
    o = torch.stack([torch.cat(segs) for segs in segments])
    return o, torch.stack(finals)
