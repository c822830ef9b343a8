"""Which operand precisions can the backward afford? A CPU study, no GPU needed.

The companion of bench/precision_study.py for the gradients. The chunked forward of
docs/algorithm.md runs in float64 with its stored and shared operands rounded as the fp16
forward pass rounds them; every matrix product is an autograd function whose backward
rounds *its* operands (the incoming gradient and the saved factors) to a chosen format and
its results to fp32, so the backward's products (dS, dU, dVt and the per-chunk gradients
are all such products) see that format, while the elementwise work and the inverse stay
float64 (fp32 in the kernels). Gradients of q, k, v, g, beta are measured against the
float64 gradients of the token-by-token reference.

The question is range as much as mantissa: gradients scale with dO, and a training loss
makes dO small (1e-4 .. 1e-8 per element is common). bf16 and tf32 keep fp32's exponent;
fp16 does not, unless the kernel scales dO by a power of two first (a device-side max and
an exponent: loss scaling inside the op), which the `fp16, dO scaled` rows emulate.

    python bench/precision_study_bwd.py                  # 512 tokens, 4 heads, ~20 s
    python bench/precision_study_bwd.py --do-scales 1,1e-6
    python bench/precision_study_bwd.py --reverse-pass --do-scales 1,1e-8,1e6
"""
from __future__ import annotations

import argparse
import math
from typing import Dict, List, Optional, Tuple

import torch

from flashgdn.reference import recurrent_gated_delta_rule_ref

import precision_study as fwd  # noqa: E402 - same folder: rnd, make_inputs, rel

C = 64
F64 = torch.float64


class _MM(torch.autograd.Function):
    """C = fp32(rnd(a, fa) @ rnd(b, fb)); backward: dA = fp32(rnd(dC) @ rnd(b)^T),
    dB = fp32(rnd(a)^T @ rnd(dC)), every operand rounded to `fb_`."""

    @staticmethod
    def forward(ctx, a, b, fa: str, fb: str, fbw: str):  # noqa: D102
        ctx.save_for_backward(a, b)
        ctx.fbw = fbw
        return fwd.rnd(fwd.rnd(a, fa) @ fwd.rnd(b, fb), "f32")

    @staticmethod
    def backward(ctx, dc):  # noqa: D102
        a, b = ctx.saved_tensors
        f = ctx.fbw
        dcr = fwd.rnd(dc, f)
        da = fwd.rnd(dcr @ fwd.rnd(b, f).transpose(-1, -2), "f32")
        db = fwd.rnd(fwd.rnd(a, f).transpose(-1, -2) @ dcr, "f32")
        return da, db, None, None, None


class _MMRecord(torch.autograd.Function):
    """_MM whose dA = dC @ B^T reads a stored record in format `frec`: the saved B (the
    chunk states h, as the per-chunk gradients read them: dO h^T, dVt h^T) or dC (the state
    gradient dS, as they read it: dK = U dS^T); every other operand as _MM rounds it."""

    @staticmethod
    def forward(ctx, a, b, fa: str, fb: str, fbw: str, frec_b: str, frec_dc: str):  # noqa: D102
        ctx.save_for_backward(a, b)
        ctx.f = (fbw, frec_b, frec_dc)
        return fwd.rnd(fwd.rnd(a, fa) @ fwd.rnd(b, fb), "f32")

    @staticmethod
    def backward(ctx, dc):  # noqa: D102
        a, b = ctx.saved_tensors
        f, f_b, f_dc = ctx.f
        da = fwd.rnd(fwd.rnd(dc, f_dc) @ fwd.rnd(b, f_b).transpose(-1, -2), "f32")
        db = fwd.rnd(fwd.rnd(a, f).transpose(-1, -2) @ fwd.rnd(dc, f), "f32")
        return da, db, None, None, None, None, None


class _Store(torch.autograd.Function):
    """A stored or shared operand rounded to fmt in the forward; its gradient passes as is."""

    @staticmethod
    def forward(ctx, x, fmt: str):  # noqa: D102
        return fwd.rnd(x, fmt)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return g, None


def chunked_forward_ad(q, k, v, g, beta, scale: float, fw: str, bw: str,
                       rec: Optional[str] = None):
    """One sequence, one head (float64 leaves): o, final state. `fw`: the forward's operand
    format (f64 or f16, as the default pass), `bw`: the backward products' operand format,
    `rec`: the format of the per-chunk records h and dS where the per-chunk gradients read
    them, "fmt" for both or "h_fmt/ds_fmt" (None: bw)."""
    T = q.shape[0]
    S = torch.zeros(q.shape[1], v.shape[1], dtype=F64)
    rec_h, _, rec_ds = (rec or bw).partition("/")
    rec_ds = rec_ds or rec_h
    mm = lambda a, b: _MM.apply(a, b, fw, fw, bw)  # noqa: E731
    mm_h = lambda a, b: _MMRecord.apply(a, b, fw, fw, bw, rec_h, bw)  # noqa: E731
    mm_ds = lambda a, b: _MMRecord.apply(a, b, fw, fw, bw, bw, rec_ds)  # noqa: E731
    st = lambda x: _Store.apply(x, fw)  # noqa: E731
    out = []
    for c0 in range(0, T, C):
        Q, K, V = q[c0:c0 + C], k[c0:c0 + C], v[c0:c0 + C]
        G = torch.cumsum(g[c0:c0 + C], 0)
        b = beta[c0:c0 + C]
        n = K.shape[0]
        dec = torch.tril(torch.exp(G[:, None] - G[None, :]))
        A = torch.tril(b[:, None] * dec * mm(K, K.T), -1)
        Tm = torch.linalg.inv(torch.eye(n, dtype=F64) + A)
        W = st(mm(Tm * (b * torch.exp(G))[None, :], K))
        U0 = mm(Tm * b[None, :], V)
        P = st(mm(Q, K.T) * dec)
        U = U0 - mm_h(W, st(S))
        O = scale * (torch.exp(G)[:, None] * mm_h(Q, st(S)) + mm(P, st(U)))
        eL = torch.exp(G[-1] - G)
        S = torch.exp(G[-1]) * S + mm_ds(K.T, st(eL[:, None] * U))
        out.append(O)
    return torch.cat(out), S


def _scaled_f16(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x (rows = value columns) rounded to fp16 after each row's power of two 2^e, which puts
    the row's `amax` (a [rows, 1] bound, shared as the caller groups rows) in [2^5, 2^6),
    then divided back: state_bwd_cols_kernel's operands."""
    e = 5 - torch.floor(torch.log2(amax.clamp_min(1e-300)))
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-120, 120)
    f = torch.pow(2.0, e)
    return (x * f).half().double() / f


def reverse_pass(q, k, g, beta, do, dst, scale: float, mode: str):
    """The backward's reverse pass of one head of one sequence in the kernels' chunk form
    (state_bwd_cols.cuh), from the last chunk: per chunk, going backwards,
        KdS^T = dS^T K^T,  dU^T = scale dO^T P + KdS^T diag(e^{G_last - G}),  dVt^T = dU^T T,
        dS^T <- e^{G_last} dS^T + (scale dO^T diag(e^G)) Q - (dVt^T diag(beta e^G)) K,
    the elementwise work in float64 and every product's operands rounded per `mode`:
    "f64" exact; "tf32" the TF32 kernels (state_bwd_tc_kernel; the 128-column one before
    session 25); "f16warp" state_bwd_cols_kernel: fp16 operands, the A operands (rows =
    value columns) times a power of two per 16 value columns and chunk that puts the larger
    of max |dS| and max |dO| of those columns in [2^5, 2^6), K, Q, P, T in fp16; "f16row"
    the same with a power of two per value column. Returns the records dh (the dS leaving
    each chunk, [chunks, V, K] as dS^T) and dVt ([T, V])."""
    T_ = q.shape[0]
    V = do.shape[1]
    dS = dst.T.clone()  # dS^T [V, K]
    dh, dvt = [], torch.zeros(T_, V, dtype=F64)
    if mode == "tf32":
        ra = lambda x, amax: fwd.rnd(x, "tf32")  # noqa: E731
        rb = lambda x: fwd.rnd(x, "tf32")  # noqa: E731
    elif mode in ("f16warp", "f16row"):
        ra = _scaled_f16
        rb = lambda x: fwd.rnd(fwd.rnd(x, "tf32"), "f16")  # noqa: E731
    else:
        ra = lambda x, amax: x  # noqa: E731
        rb = lambda x: x  # noqa: E731
    starts = list(range(0, T_, C))
    for c0 in reversed(starts):
        Q, K, O = q[c0:c0 + C], k[c0:c0 + C], do[c0:c0 + C]
        G = torch.cumsum(g[c0:c0 + C], 0)
        b = beta[c0:c0 + C]
        n = K.shape[0]
        dec = torch.tril(torch.exp(G[:, None] - G[None, :]))
        A = torch.tril(b[:, None] * dec * (K @ K.T), -1)
        Tm = torch.linalg.inv(torch.eye(n, dtype=F64) + A)
        P = (Q @ K.T) * dec
        el, egl, eg = torch.exp(G[-1] - G), torch.exp(G[-1]), torch.exp(G)
        dh.append(dS.clone())
        # the operands' common bound per row: the rows' own, or their block of 16's
        amax = torch.maximum(dS.abs().amax(1, keepdim=True), O.T.abs().amax(1, keepdim=True))
        if mode == "f16warp":
            amax = amax.reshape(V // 16, 16).amax(1, keepdim=True).expand(V // 16, 16)
            amax = amax.reshape(V, 1)
        kd = ra(dS, amax) @ rb(K).T
        du = scale * (ra(O.T, amax) @ rb(P)) + kd * el[None, :]
        dv = ra(du, amax) @ rb(Tm)
        dvt[c0:c0 + n] = dv.T
        dS = (egl * dS + ra(scale * O.T * eg[None, :], amax) @ rb(Q)
              - ra(dv * (b * eg)[None, :], amax) @ rb(K))
    return torch.stack(dh[::-1]), dvt


def reverse_pass_errors(x: Dict[str, torch.Tensor], do: torch.Tensor, dst: torch.Tensor,
                        mode: str, cols: Optional[torch.Tensor] = None) -> Tuple[float, float]:
    """Relative errors of the reverse pass's records (dh, dVt) in `mode` against float64 over
    all heads, on the value columns `cols` (default all)."""
    scale = 128 ** -0.5
    num = [0.0, 0.0]
    den = [0.0, 0.0]
    for h in range(x["q"].shape[1]):
        args = [x[n][:, h] for n in ("q", "k", "g", "beta")] + [do[:, h], dst[h], scale]
        ref = reverse_pass(*args, "f64")
        got = reverse_pass(*args, mode)
        for i, dim in enumerate((1, 1)):
            r, a = ref[i], got[i]
            if cols is not None:
                r, a = r.index_select(dim, cols), a.index_select(dim, cols)
            num[i] += float((a - r).pow(2).sum())
            den[i] += float(r.pow(2).sum())
    return tuple(math.sqrt(n / d) for n, d in zip(num, den))


def block_pair_product(a16: torch.Tensor, b16: torch.Tensor, ea: torch.Tensor,
                       eb: torch.Tensor, mode: str) -> torch.Tensor:
    """A product of grad_chunk_tc_kernel over 8 record block pairs (Z = dVt h^T, R = U dS^T,
    dVt U^T): a16 [8, M, 16] and b16 [8, N, 16] fp16 record blocks (float64 tensors holding
    fp16 values), ea, eb [8] integer exponents of their factors (powers of two).
      "exact"   sum_b 2^(ea_b + eb_b) a_b b_b^T in float64
      "pair"    the kernel: B block b times 2^(ea_b + eb_b - e_max) rounded to fp16 (HMUL2;
                0 below fp16's smallest subnormal), exact products accumulated (fp32 in the
                kernel, float64 here), times 2^e_max once
      "fp32div" the first version: the ratio as (s_a s_b) / max(s_a s_b) in fp32, whose
                products flush to zero below 2^-126 (NaN where every pair does)"""
    e = (ea + eb).to(torch.int64)
    if mode == "exact":
        return sum(torch.ldexp(a16[b] @ b16[b].T, e[b].double()) for b in range(8))
    if mode == "pair":
        emax = int(e.max())
        out = torch.zeros(a16.shape[1], b16.shape[1], dtype=F64)
        for b in range(8):
            d = int(e[b]) - emax
            r = 2.0 ** d if d >= -24 else 0.0
            out += a16[b] @ (b16[b] * r).half().double().T
        return torch.ldexp(out, torch.tensor(float(emax), dtype=F64))
    if mode == "fp32div":
        sa = torch.ldexp(torch.ones(8, dtype=torch.float32), ea.float())
        sb = torch.ldexp(torch.ones(8, dtype=torch.float32), eb.float())
        pair = sa * sb
        pair = torch.where(pair.abs() < 2.0 ** -126, torch.zeros_like(pair), pair)  # FTZ
        ratio, top = pair / pair.max(), pair.max().double()
        out = sum(a16[b] @ (b16[b] * float(ratio[b])).half().double().T for b in range(8))
        return out * top
    raise ValueError(mode)


def block_pair_errors(spread: int, base: int = 0, seed: int = 0) -> Dict[str, float]:
    """Relative error of block_pair_product's modes against "exact" for record blocks whose
    pair exponents spread over `spread` (evenly, from base + 0 down to base - spread), with
    values as the records hold them (largest magnitude in [2^14, 2^15))."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(8, 64, 16, generator=gen, dtype=F64) * 2.0 ** 13).half().double()
    b = (torch.randn(8, 128, 16, generator=gen, dtype=F64) * 2.0 ** 13).half().double()
    ea = torch.tensor([base - (spread * i) // 7 for i in range(8)])
    eb = torch.zeros(8, dtype=torch.int64) + base
    ref = block_pair_product(a, b, ea, eb, "exact")
    out = {}
    for mode in ("pair", "fp32div"):
        got = block_pair_product(a, b, ea, eb, mode)
        out[mode] = float((got - ref).norm() / ref.norm())
    return out


NAMES = ("q", "k", "v", "g", "beta")


def gradients(x: Dict[str, torch.Tensor], do: torch.Tensor, dst: torch.Tensor, scale: float,
              fw: str, bw: str, do_pow2: bool, rec: Optional[str] = None) -> List[torch.Tensor]:
    """Gradients of sum(o * do) + sum(S_T * dst) over all heads; with do_pow2 the output
    gradients are multiplied by a power of two bringing max |do| to about 1 first, and the
    results divided by it afterwards (exact: a power of two)."""
    e = 0
    if do_pow2:
        e = -int(math.floor(math.log2(float(torch.cat([do.abs().flatten(),
                                                       dst.abs().flatten()]).max()))))
    f = 2.0 ** e
    leaves = {n: x[n].clone().requires_grad_() for n in NAMES}
    loss = 0
    for h in range(x["q"].shape[1]):
        o, s = chunked_forward_ad(*(leaves[n][:, h] for n in NAMES), scale, fw, bw, rec)
        loss = loss + (o * (do[:, h] * f)).sum() + (s * (dst[h] * f)).sum()
    grads = torch.autograd.grad(loss, [leaves[n] for n in NAMES])
    return [gr / f for gr in grads]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--do-scales", default="1,1e-4,1e-8",
                    help="magnitudes of the output gradients dO and dS_T (times randn)")
    ap.add_argument("--block-pairs", action="store_true",
                    help="only the gradient kernel's fp16 products of record block pairs "
                         "(block_pair_product): error against float64 by factor spread")
    ap.add_argument("--reverse-pass", action="store_true",
                    help="only the reverse pass's operand formats (reverse_pass): uniform "
                         "gradient scales, then half of each 16 value columns made smaller")
    args = ap.parse_args()
    scale = 128 ** -0.5
    x = fwd.make_inputs(args.tokens, args.heads, "bench", 0, True)
    gen = torch.Generator().manual_seed(1)
    base_do = torch.randn(args.tokens, args.heads, 128, generator=gen, dtype=F64)
    base_dst = torch.randn(args.heads, 128, 128, generator=gen, dtype=F64) / 8
    if args.block_pairs:
        print("fp16 products of 8 record block pairs, relative error against float64\n")
        print("| pair exponents | spread | pair (kernel) | fp32 ratio (first version) |")
        print("|---|---|---|---|")
        for base in (0, -70):
            for spread in (0, 10, 20, 30, 40, 60):
                e = block_pair_errors(spread, base)
                print(f"| {base} .. {base - spread} | {spread} | {e['pair']:.2e} | "
                      f"{e['fp32div']:.2e} |")
        return
    if args.reverse_pass:
        modes = ("tf32", "f16warp", "f16row")
        print("reverse pass records against float64 (dh | dVt), all value columns:\n")
        print("| dO scale | " + " | ".join(modes) + " |\n|---|---|---|---|")
        for sc in (float(v) for v in args.do_scales.split(",")):
            errs = [reverse_pass_errors(x, base_do * sc, base_dst * sc, m) for m in modes]
            print(f"| {sc:g} | " + " | ".join(f"{a:.2e} / {b:.2e}" for a, b in errs) + " |")
        small = torch.tensor([c for c in range(128) if c % 16 >= 8])
        print("\nthe value columns 8..15 of every 16 made `ratio` times smaller (dO and dS_T), "
              "errors on those columns:\n")
        print("| ratio | " + " | ".join(modes) + " |\n|---|---|---|---|")
        for ratio in (1e-3, 1e-4, 1e-5, 1e-6):
            f = torch.ones(128, dtype=F64)
            f[small] = ratio
            errs = [reverse_pass_errors(x, base_do * f, base_dst * f, m, small) for m in modes]
            print(f"| {ratio:g} | " + " | ".join(f"{a:.2e} / {b:.2e}" for a, b in errs) + " |")
        return
    designs: List[Tuple[str, str, str, bool, Optional[str]]] = [
        ("tf32 backward operands (today), fp16 forward", "f16", "tf32", False, None),
        ("bf16 backward operands (FLA-like)", "f16", "bf16", False, None),
        ("fp16 backward operands", "f16", "f16", False, None),
        ("fp16 backward operands, dO scaled by 2^e", "f16", "f16", True, None),
        ("fp16 backward operands, each matrix scaled by 2^e", "f16", "f16mat", False, None),
        ("tf32 operands, h and dS records in bf16", "f16", "tf32", False, "bf16"),
        ("tf32 operands, h and dS records in fp16", "f16", "tf32", False, "f16"),
        ("tf32 operands, h records in fp16, dS in bf16", "f16", "tf32", False, "f16/bf16"),
        ("tf32 operands, h and dS as scaled fp16 blocks (128-column passes)", "f16", "tf32",
         False, "f16blk"),
    ]
    print(f"{args.tokens} tokens, {args.heads} heads, bench gates (every 4th head g == 0), "
          "l2-normalised q/k; relative error of each gradient against float64\n")
    print("| design | dO scale | dq | dk | dv | dg | dbeta |\n|---|---|---|---|---|---|---|")
    for sc in (float(s) for s in args.do_scales.split(",")):
        do, dst = base_do * sc, base_dst * sc
        leaves = {n: x[n].clone().requires_grad_() for n in NAMES}
        ro, rs = recurrent_gated_delta_rule_ref(*(leaves[n][None] for n in NAMES), scale)
        ref = torch.autograd.grad((ro[0] * do).sum() + (rs[0] * dst).sum(),
                                  [leaves[n] for n in NAMES])
        for name, fw, bw, pow2, rec in designs:
            got = gradients(x, do, dst, scale, fw, bw, pow2, rec)
            errs = []
            for a, r in zip(got, ref):
                e = fwd.rel(a, r)
                errs.append("nan" if not math.isfinite(e) else f"{e:.1e}")
            print(f"| {name} | {sc:g} | " + " | ".join(errs) + " |", flush=True)


if __name__ == "__main__":
    main()
