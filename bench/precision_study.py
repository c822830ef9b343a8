"""Which operand precisions can the chunked forward afford? A CPU study, no GPU needed.

Runs the chunked WY forward of docs/algorithm.md in float64, rounding the operands of each
product to a chosen format (tf32, bf16, fp16) and every product's result to fp32 (fp32
accumulation), and measures o and the final state against the float64 token-by-token
reference (python/flashgdn/reference.py). The rows are candidate designs for the tensor-core
kernels: what each of W S, Q S, P U and K^T U may take as operands (bf16 wgmma runs at twice
the tf32 rate and halves the shared-memory bytes) while staying under FLA 0.5's errors
(o 4.3e-3, final state 3.7e-3 on bf16 inputs).

    python bench/precision_study.py                 # 2 x 4096 tokens, 8 heads, ~1 minute
    python bench/precision_study.py --tokens 8192 --gates hard
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from flashgdn.reference import recurrent_gated_delta_rule_ref

C = 64
F64 = torch.float64


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power of two that puts amax in [2^14, 2^15), at most 2^126 (csrc/cuda/mma.cuh
    pow2_scale): fp16 then keeps 11 significant bits down to 2^-28 of amax."""
    amax = amax.clamp_min(2.0 ** -126)
    return torch.exp2(torch.clamp(14 - torch.floor(torch.log2(amax)), max=126))


def rnd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x rounded to fmt (round to nearest even), returned as float64."""
    if fmt == "f64":
        return x
    if fmt == "f32":
        return x.float().double()
    if fmt == "bf16":
        return x.bfloat16().double()
    if fmt == "f16":
        return x.half().double()
    if fmt == "tf32":  # 10 explicit mantissa bits: clear the low 13 bits of the fp32 pattern
        b = x.float().view(torch.int32)
        b = (b + 0x0FFF + ((b >> 13) & 1)) & ~0x1FFF
        return b.view(torch.float32).double()
    if fmt == "f16mat":  # fp16 after one power of two for the whole matrix (largest
        # magnitude into [2^14, 2^15)): a 16-bit operand with its own exponent, no range limit
        sc = _pow2_scale(x.abs().amax())
        return (x * sc).half().double() / sc
    if fmt == "f16blk":  # a matrix as the backward's 128-column passes record it
        # (csrc/cuda/mma.cuh): fp16 blocks of 16 columns x all rows, each multiplied by the
        # power of two that puts its largest magnitude in [2^14, 2^15) (at most 2^126)
        rows, n = x.shape
        xb = x.reshape(rows, n // 16, 16)
        sc = _pow2_scale(xb.abs().amax(dim=(0, 2), keepdim=True))
        return ((xb * sc).half().double() / sc).reshape(rows, n)
    raise ValueError(fmt)


@dataclass(frozen=True)
class Design:
    name: str
    w: str     # W = T diag(beta e^G) K as stored between kernels
    u0: str    # U0 = T diag(beta) V as stored
    p: str     # P = (Q K^T) . Dec as stored
    s_ws: str  # S as the B operand of W S
    s_qs: str  # S as the B operand of Q S
    u: str     # U = U0 - W S as the operand of P U and of K^T (eL U)
    t: str = "tf32"  # T diag(beta e^G) and T diag(beta) as operands of W and U0
    # W, U0 never formed (docs/perf-notes.md, FlashQLA's forward): the gate-free inverse
    # T_raw stored in format t, U = (Dec . T_raw . beta) (V - diag(e^G) K S) with both
    # operands of that product in format u, K S with S in format s_ws
    wy_free: bool = False
    # format of the operands of the inverse's off-diagonal block products (wy_kernel's block
    # rows: X_ij = sum_k A_ik T_kj, T_ij = -T_ii X_ij), "f64" for an exact inverse; the 16 x 16
    # diagonal blocks always by fp32 substitution
    inv: str = "f64"
    # the inverse by doubling instead (FlashInfer's SM90 prefill, docs/perf-notes.md version
    # 37): A stored in format a_fmt, 8 x 8 diagonal blocks by fp32 substitution, then
    # [[T1, 0], [A21, T2]] -> [[T1, 0], [-T2 (A21 T1), T2]] for blocks of 8, 16, 32 with
    # operands in format inv and fp32 results
    doubling: bool = False
    a_fmt: str = "f32"
    # e^G folded into Q before its fp16 rounding (a fused kernel's Q tile scaled row by row,
    # docs/perf-notes.md version 41), so that Q S needs no scaling before P U is added
    q_eg: bool = False


DESIGNS = (
    Design("session 12: tf32 operands, W fp16", "f16", "tf32", "tf32", "tf32", "tf32", "tf32"),
    Design("fp32 operands everywhere", "f32", "f32", "f32", "f32", "f32", "f32", t="f32"),
    Design("bf16 S for Q S only (output path)", "f16", "tf32", "tf32", "tf32", "bf16", "tf32"),
    Design("bf16 S, tf32 U", "f16", "tf32", "tf32", "bf16", "bf16", "tf32"),
    Design("bf16 W, U0, P, S, U (FLA-like)", "bf16", "bf16", "bf16", "bf16", "bf16", "bf16"),
    Design("fp16 W, U0, P, S, U", "f16", "f16", "f16", "f16", "f16", "f16"),
    # what the kernels do since version 10 (docs/perf-notes.md): U0 tf32-rounded fp32, then
    # the default pass copies U (and S, P, W) to fp16; wy_kernel's T operands tf32
    Design("shipped: fp16 pass from W, U0 (f16wu)", "f16", "tf32", "f16", "f16", "f16", "f16"),
    Design("shipped: tf32 pass", "f16", "tf32", "tf32", "tf32", "tf32", "tf32"),
    Design("W/U0-free, fp16 T_raw and operands (default)", "-", "-", "f16", "f16", "f16", "f16",
           t="f16", wy_free=True),
    Design("W/U0-free, bf16 (FlashQLA-like)", "-", "-", "bf16", "bf16", "bf16", "bf16",
           t="bf16", wy_free=True),
    # the inverse's block products on tensor cores (a wy_kernel design question, perf-notes
    # version 15): fp32 today ("f32"), tf32 or fp16 operands with fp32 accumulation
    Design("default, inverse blocks fp32 (as wy_kernel)", "-", "-", "f16", "f16", "f16", "f16",
           t="f16", wy_free=True, inv="f32"),
    Design("default, inverse blocks tf32", "-", "-", "f16", "f16", "f16", "f16",
           t="f16", wy_free=True, inv="tf32"),
    Design("default, inverse blocks fp16", "-", "-", "f16", "f16", "f16", "f16",
           t="f16", wy_free=True, inv="f16"),
    # a fused kernel's auxiliary warpgroup: the inverse by doubling from 8 x 8 blocks
    Design("default, inverse by doubling, A fp32, products fp16", "-", "-", "f16", "f16", "f16",
           "f16", t="f16", wy_free=True, inv="f16", doubling=True),
    Design("default, inverse by doubling, A and products fp16 (FlashInfer-like)", "-", "-",
           "f16", "f16", "f16", "f16", t="f16", wy_free=True, inv="f16", doubling=True,
           a_fmt="f16"),
    Design("default, inverse by doubling, A and products tf32", "-", "-", "f16", "f16", "f16",
           "f16", t="f16", wy_free=True, inv="tf32", doubling=True, a_fmt="tf32"),
    Design("FlashInfer-like doubling, e^G folded into fp16 Q", "-", "-", "f16", "f16", "f16",
           "f16", t="f16", wy_free=True, inv="f16", doubling=True, a_fmt="f16", q_eg=True),
)


def doubling_inverse(A: torch.Tensor, fmt: str, a_fmt: str) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A by doubling: A rounded to a_fmt, 8 x 8
    diagonal blocks by fp32 substitution, then each pair of diagonal blocks of size b (8, 16,
    32) joined: T21 = -T2 (A21 T1), both products with operands in fmt, fp32 results."""
    n = A.shape[0]
    f32 = lambda x: rnd(x, "f32")  # noqa: E731
    A = rnd(A, a_fmt)
    T = torch.zeros_like(A)
    for r0 in range(0, n, 8):
        r1 = min(n, r0 + 8)
        Ti = torch.zeros(r1 - r0, r1 - r0, dtype=F64)
        for r in range(r1 - r0):
            Ti[r] = f32(torch.eye(r1 - r0, dtype=F64)[r] - A[r0 + r, r0:r0 + r] @ Ti[:r])
        T[r0:r1, r0:r1] = Ti
    b = 8
    while b < n:
        for r0 in range(0, n, 2 * b):
            m = r0 + b
            if m >= n:
                continue
            r1 = min(n, r0 + 2 * b)
            X = f32(rnd(A[m:r1, r0:m], fmt) @ rnd(T[r0:m, r0:m], fmt))
            T[m:r1, r0:m] = -f32(rnd(T[m:r1, m:r1], fmt) @ rnd(X, fmt))
        b *= 2
    return T


def block_inverse(A: torch.Tensor, fmt: str) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A as wy_kernel forms it: 16 x 16 diagonal
    blocks by fp32 substitution, then block rows i = 1, 2, 3: X_ij = sum_{k=j}^{i-1} A_ik T_kj
    and T_ij = -T_ii X_ij with operands rounded to fmt and fp32 results."""
    n, B = A.shape[0], 16
    if fmt == "f64":
        return torch.linalg.inv(torch.eye(n, dtype=F64) + A)
    f32 = lambda x: rnd(x, "f32")  # noqa: E731
    T = torch.zeros_like(A)
    nb = (n + B - 1) // B
    for i in range(nb):
        r0, r1 = i * B, min(n, (i + 1) * B)
        Ti = torch.zeros(r1 - r0, r1 - r0, dtype=F64)
        for r in range(r1 - r0):  # substitution, fp32 per step
            Ti[r] = f32(torch.eye(r1 - r0, dtype=F64)[r] - A[r0 + r, r0:r0 + r] @ Ti[:r])
        T[r0:r1, r0:r1] = Ti
    for i in range(1, nb):
        r0, r1 = i * B, min(n, (i + 1) * B)
        X = f32(rnd(A[r0:r1, :r0], fmt) @ rnd(T[:r0, :r0], fmt))
        T[r0:r1, :r0] = -f32(rnd(T[r0:r1, r0:r1], fmt) @ rnd(X, fmt))
    return T


def chunked_forward(q, k, v, g, beta, scale: float, d: Design,
                    ranges: Dict[str, float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """One sequence, one head: q, k, v [T, 128], g, beta [T] (float64); returns o, S.
    `ranges` collects the largest magnitude of each stored or shared operand."""
    T = q.shape[0]
    S = torch.zeros(q.shape[1], v.shape[1], dtype=F64)
    out = []
    f32 = lambda x: rnd(x, "f32")  # noqa: E731 - a product's fp32 result
    for c0 in range(0, T, C):
        Q, K, V = q[c0:c0 + C], k[c0:c0 + C], v[c0:c0 + C]
        G = f32(torch.cumsum(g[c0:c0 + C], 0))
        b = beta[c0:c0 + C]
        n = K.shape[0]
        dec = torch.tril(torch.exp(G[:, None] - G[None, :]))
        P = rnd(f32(Q @ K.T) * dec, d.p)
        if d.wy_free:
            A0 = f32(torch.tril(b[:, None] * f32(K @ K.T), -1))
            Tinv = doubling_inverse(A0, d.inv, d.a_fmt) if d.doubling else block_inverse(A0, d.inv)
            Traw = rnd(f32(Tinv), d.t)
            Ag = rnd(f32(Traw * dec * b[None, :]), d.u)
            Wp = rnd(f32(V - torch.exp(G)[:, None] * f32(K @ rnd(S, d.s_ws))), d.u)
            U = f32(Ag @ Wp)
            W = U0 = Traw  # for the ranges below
        else:
            A = f32(torch.tril(b[:, None] * dec * f32(K @ K.T), -1))
            Tm = f32(torch.linalg.inv(torch.eye(n, dtype=F64) + A))
            W = rnd(f32(rnd(Tm * (b * torch.exp(G))[None, :], d.t) @ K), d.w)
            U0 = rnd(f32(rnd(Tm * b[None, :], d.t) @ V), d.u0)
            U = f32(U0 - f32(W @ rnd(S, d.s_ws)))
        Ur = rnd(U, d.u)
        if d.q_eg:
            O = f32(scale * (f32(rnd(torch.exp(G)[:, None] * Q, "f16") @ rnd(S, d.s_qs)) +
                             f32(P @ Ur)))
        else:
            O = f32(scale * (torch.exp(G)[:, None] * f32(Q @ rnd(S, d.s_qs)) + f32(P @ Ur)))
        eL = torch.exp(G[-1] - G)
        S = f32(torch.exp(G[-1]) * S + f32(K.T @ rnd(eL[:, None] * U, d.u)))
        for name, x in (("W", W), ("U0", U0), ("P", P), ("S", S), ("U", U)):
            ranges[name] = max(ranges.get(name, 0.0), float(x.abs().max()))
        out.append(O)
    return torch.cat(out), S


def make_inputs(tokens: int, heads: int, gates: str, seed: int,
                qk_norm: bool, v_scale: float = 1.0) -> Dict[str, torch.Tensor]:
    """bench/bench_gdn.py's inputs (bf16 q, k, v; l2-normalised q, k; every 4th head g == 0),
    v multiplied by v_scale before its bf16 rounding."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    norm = (lambda x: torch.nn.functional.normalize(x, dim=-1)) if qk_norm else (lambda x: x / 16)
    q = norm(rn(tokens, heads, 128)).bfloat16().double()
    k = norm(rn(tokens, heads, 128)).bfloat16().double()
    v = (rn(tokens, heads, 128) * v_scale).bfloat16().double()
    g = torch.nn.functional.logsigmoid(rn(tokens, heads)).double()
    g = g / 16 if gates == "bench" else g * 8  # "hard": gates down to about -25
    g[:, ::4] = 0.0
    beta = torch.sigmoid(rn(tokens, heads)).double()
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqs", type=int, default=2, help="independent sequences (seeds)")
    ap.add_argument("--gates", choices=("bench", "hard"), default="bench")
    ap.add_argument("--no-qk-norm", action="store_true",
                    help="q, k not l2-normalised (randn / 16: |k| about 0.7, norms spread)")
    ap.add_argument("--v-scale", type=float, default=1.0,
                    help="v times this (fp16's range: normal from 6.1e-5, max 65504)")
    args = ap.parse_args()
    scale = 128 ** -0.5
    errs: Dict[str, Tuple[list, list]] = {d.name: ([], []) for d in DESIGNS}
    ranges: Dict[str, float] = {}
    o_refs, s_refs = [], []
    for seed in range(args.seqs):
        x = make_inputs(args.tokens, args.heads, args.gates, seed, not args.no_qk_norm,
                        args.v_scale)
        ro, rs = recurrent_gated_delta_rule_ref(
            x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None], scale)
        o_refs.append(ro[0])
        s_refs.append(rs[0])
        for d in DESIGNS:
            os_, ss = [], []
            for h in range(args.heads):
                o, s = chunked_forward(x["q"][:, h], x["k"][:, h], x["v"][:, h], x["g"][:, h],
                                       x["beta"][:, h], scale, d, ranges)
                os_.append(o)
                ss.append(s)
            errs[d.name][0].append(torch.stack(os_, 1))
            errs[d.name][1].append(torch.stack(ss))
    ro, rs = torch.stack(o_refs), torch.stack(s_refs)
    o_floor = rel(ro.bfloat16().double(), ro)
    print(f"{args.seqs} x {args.tokens} tokens, {args.heads} heads, gates '{args.gates}', "
          f"v x {args.v_scale:g}, "
          f"q/k {'raw' if args.no_qk_norm else 'l2-normalised'}; bf16 rounding of o itself: "
          f"{o_floor:.2e}; largest |x|: " + ", ".join(f"{k} {v:.3g}" for k, v in ranges.items())
          + " (fp16 max 65504)\n")
    print("| design | o (fp32) | o (bf16 output) | final state |\n|---|---|---|---|")
    for d in DESIGNS:
        o = torch.stack(errs[d.name][0])
        s = torch.stack(errs[d.name][1])
        print(f"| {d.name} | {rel(o, ro):.2e} | {rel(o.bfloat16().double(), ro):.2e} | "
              f"{rel(s, rs):.2e} |")


if __name__ == "__main__":
    main()
