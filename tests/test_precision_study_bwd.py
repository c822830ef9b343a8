"""bench/precision_study_bwd.py (CPU): its chunked forward's autograd gradients are the
operator's, and each backward operand format lands where the study says (docs/perf-notes.md,
"Operand precision for the backward")."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import precision_study_bwd as study  # noqa: E402

from conftest import rel_err  # noqa: E402

TOKENS, HEADS = 160, 2  # three chunks, the last partial


def _setup(do_scale: float):
    x = study.fwd.make_inputs(TOKENS, HEADS, "bench", 0, True)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(TOKENS, HEADS, 128, generator=gen, dtype=torch.float64) * do_scale
    dst = torch.randn(HEADS, 128, 128, generator=gen, dtype=torch.float64) * do_scale / 8
    leaves = {n: x[n].clone().requires_grad_() for n in study.NAMES}
    ro, rs = study.recurrent_gated_delta_rule_ref(*(leaves[n][None] for n in study.NAMES),
                                                  128 ** -0.5)
    ref = torch.autograd.grad((ro[0] * do).sum() + (rs[0] * dst).sum(),
                              [leaves[n] for n in study.NAMES])
    return x, do, dst, ref


def _errs(x, do, dst, ref, fw, bw, pow2):
    got = study.gradients(x, do, dst, 128 ** -0.5, fw, bw, pow2)
    return [float((a - r).norm() / r.norm()) for a, r in zip(got, ref)]


def test_float64_gradients_are_the_operators():
    x, do, dst, ref = _setup(1.0)
    got = study.gradients(x, do, dst, 128 ** -0.5, "f64", "f64", False)
    for a, r in zip(got, ref):
        assert rel_err(a, r) < 1e-6  # fp32 rounding of each product's result only


@pytest.mark.parametrize("do_scale", [1.0, 1e-8])
def test_backward_formats(do_scale: float):
    x, do, dst, ref = _setup(do_scale)
    tf32 = _errs(x, do, dst, ref, "f16", "tf32", False)
    bf16 = _errs(x, do, dst, ref, "f16", "bf16", False)
    f16 = _errs(x, do, dst, ref, "f16", "f16", False)
    f16s = _errs(x, do, dst, ref, "f16", "f16", True)
    f16m = _errs(x, do, dst, ref, "f16", "f16mat", False)
    assert max(tf32) < 2e-3
    # every operand matrix with its own power of two (the per-chunk gradients on fp16 mma,
    # perf-notes plan item 5): tf32's accuracy at any gradient scale
    assert max(m / t for m, t in zip(f16m, tf32)) < 1.05
    assert min(b / t for b, t in zip(bf16, tf32)) > 2  # bf16's 7-bit mantissa
    assert max(s / t for s, t in zip(f16s, tf32)) < 1.2  # scaled fp16 = tf32's accuracy
    if do_scale < 1e-6:
        assert min(f16) > 0.5  # unscaled fp16: the gradients underflow
    else:
        assert max(s / t for s, t in zip(f16, tf32)) < 1.2


@pytest.mark.parametrize("do_scale", [1.0, 1e-8])
def test_record_formats(do_scale: float):
    """The per-chunk records h and dS in 16 bits where the per-chunk gradients read them:
    h in fp16 costs nothing (the forward state's range), dS in bf16 raises dk's error
    (still below bf16 operands everywhere), dS in fp16 underflows with small gradients."""
    x, do, dst, ref = _setup(do_scale)
    names = list(study.NAMES)
    iq, ik = names.index("q"), names.index("k")

    def errs(rec):
        got = study.gradients(x, do, dst, 128 ** -0.5, "f16", "tf32", False, rec)
        return [float((a - r).norm() / r.norm()) for a, r in zip(got, ref)]

    tf32 = errs(None)
    h16 = errs("f16/tf32")
    assert max(a / b for a, b in zip(h16, tf32)) < 1.05
    ds_bf16 = errs("f16/bf16")
    bf16_all = _errs(x, do, dst, ref, "f16", "bf16", False)
    assert ds_bf16[ik] > 1.5 * tf32[ik] and ds_bf16[ik] < bf16_all[ik]
    assert ds_bf16[iq] < 1.05 * tf32[iq]  # dq reads h only
    # the 128-column passes' records: fp16 blocks of 16 columns with a power-of-two factor
    # each keep tf32's accuracy at any gradient scale (where unscaled fp16 dS underflows)
    blocks = errs("f16blk")
    assert max(a / b for a, b in zip(blocks, tf32)) < 1.1
    ds_f16 = errs("f16")
    if do_scale < 1e-6:
        assert ds_f16[ik] > 0.5  # dS underflows in fp16
    else:
        assert max(a / b for a, b in zip(ds_f16, tf32)) < 1.05


@pytest.mark.parametrize("do_scale", [1.0, 1e-8, 1e6])
def test_reverse_pass_fp16_scaled_is_tf32(do_scale: float):
    """state_bwd_cols_kernel's operands (fp16 after a power of two per 16 value columns and
    chunk, from the larger of max |dS| and max |dO|) give the TF32 kernels' records at any
    gradient scale: fp16 of x 2^e is tf32 of x while x 2^e stays a normal fp16."""
    x, do, dst, _ = _setup(do_scale)
    tf32 = study.reverse_pass_errors(x, do, dst, "tf32")
    warp = study.reverse_pass_errors(x, do, dst, "f16warp")
    assert max(tf32) < 1e-3
    assert max(w / t for w, t in zip(warp, tf32)) < 1.01


def test_reverse_pass_shared_factor_limit():
    """The factor is shared by 16 value columns: columns 1e4 times smaller than their
    neighbours keep TF32's accuracy within 25 %, at 1e6 they lose it (fp16 subnormals); a
    factor per value column ("f16row") keeps it at any ratio."""
    x, do, dst, _ = _setup(1.0)
    small = torch.tensor([c for c in range(128) if c % 16 >= 8])
    for ratio, worst in ((1e-4, 1.25), (1e-6, None)):
        f = torch.ones(128, dtype=torch.float64)
        f[small] = ratio
        d2, s2 = do * f, dst * f
        tf32 = study.reverse_pass_errors(x, d2, s2, "tf32", small)
        warp = study.reverse_pass_errors(x, d2, s2, "f16warp", small)
        row = study.reverse_pass_errors(x, d2, s2, "f16row", small)
        assert max(r / t for r, t in zip(row, tf32)) < 1.01
        if worst is not None:
            assert max(w / t for w, t in zip(warp, tf32)) < worst
        else:
            assert min(w / t for w, t in zip(warp, tf32)) > 10


@pytest.mark.parametrize("base", [0, -70])
def test_block_pair_products_keep_fp32_accuracy(base: int):
    """grad_chunk_tc_kernel's fp16 products of record block pairs (study.block_pair_product):
    each pair's power of two taken relative to the largest pair's in exponent arithmetic is
    within fp32 accumulation of float64 for factor spreads up to 2^60 (blocks more than 2^24
    below the largest drop out: their share is below that), also where every factor is tiny
    (pair exponents near -70 .. -130), where the first version's fp32 ratio gave 0 / 0."""
    for spread in (0, 10, 20, 30, 40, 60):
        e = study.block_pair_errors(spread, base)
        assert e["pair"] < 1e-7, (spread, e)
        if base == 0:
            assert e["fp32div"] < 1e-7, (spread, e)
    if base == -70:
        assert e["fp32div"] != e["fp32div"], "the fp32 ratio's 0 / 0 (NaN) is the edge it had"
