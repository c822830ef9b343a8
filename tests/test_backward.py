"""Gradients (dq, dk, dv, dg, dbeta, dh0) against autograd through the float64 reference."""
from __future__ import annotations

import pytest
import torch

import flashgdn
from conftest import CASES, HAS_GPU, NO_GPU_REASON, Case, make_inputs, reference, rel_err

GRAD_TOL = 8e-3
NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


def run_grads(case: Case, device: str, seed: int = 0):
    inp = make_inputs(case, device, seed)
    leaves = {n: (inp[n].clone().requires_grad_() if inp[n] is not None else None) for n in NAMES}
    o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                            output_final_state=True)
    gen = torch.Generator().manual_seed(seed + 100)
    do = torch.randn(o.shape, generator=gen).to(o.dtype).to(device)
    dht = torch.randn(ht.shape, generator=gen).to(device)
    wrt = [leaves[n] for n in NAMES if leaves[n] is not None]
    ours = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), wrt)

    ref_leaves = {n: (inp[n].double().clone().requires_grad_() if inp[n] is not None else None)
                  for n in NAMES}
    ro, rh = reference({**ref_leaves, "cu_seqlens": inp["cu_seqlens"]})
    ref_wrt = [ref_leaves[n] for n in NAMES if ref_leaves[n] is not None]
    refs = torch.autograd.grad((ro * do.double()).sum() + (rh * dht.double()).sum(), ref_wrt)
    names = [n for n in NAMES if leaves[n] is not None]
    return names, ours, refs, wrt


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients_match_reference(case: Case, device: str):
    names, ours, refs, wrt = run_grads(case, device)
    errs = {}
    for n, a, b, x in zip(names, ours, refs, wrt):
        assert a.shape == x.shape and a.dtype == x.dtype, n
        errs[n] = rel_err(a, b)
    print(f"[{device}] {case.name}: " + " ".join(f"d{n} {e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < GRAD_TOL, f"d{n} relative error {e:.3e}"


def test_backward_without_final_state_grad(device: str):
    inp = make_inputs(Case("nf", [80], 1, 2), device, seed=7)
    q = inp["q"].clone().requires_grad_()
    o, _ = flashgdn.chunk_gated_delta_rule(**{**inp, "q": q})
    (dq,) = torch.autograd.grad(o.float().sum(), [q])
    qr = inp["q"].double().clone().requires_grad_()
    ro, _ = reference({**inp, "q": qr})
    (rdq,) = torch.autograd.grad(ro.sum(), [qr])
    assert rel_err(dq, rdq) < GRAD_TOL


def test_low_level_bwd_api(device: str):
    inp = make_inputs(Case("ll", [130], 2, 4), device, seed=8)
    o, ht = flashgdn.chunk_gated_delta_rule_fwd(**inp, output_final_state=True)
    do = torch.randn_like(o)
    dht = torch.randn_like(ht)
    dq, dk, dv, dg, dbeta, dh0 = flashgdn.chunk_gated_delta_rule_bwd(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], do,
        initial_state=inp["initial_state"], dht=dht, cu_seqlens=inp["cu_seqlens"])
    leaves = {n: inp[n].double().clone().requires_grad_() for n in NAMES}
    ro, rh = reference({**leaves, "cu_seqlens": inp["cu_seqlens"]})
    refs = torch.autograd.grad((ro * do.double()).sum() + (rh * dht.double()).sum(),
                               [leaves[n] for n in NAMES])
    for n, a, b in zip(NAMES, (dq, dk, dv, dg, dbeta, dh0), refs):
        assert rel_err(a, b) < GRAD_TOL, n


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("lens,hqk,hv", [([2048], 2, 8), ([1500, 500, 47], 4, 8)])
def test_gradients_gpu_large(lens, hqk, hv):
    case = Case("large", lens, hqk, hv, gate="mixed")
    names, ours, refs, _ = run_grads(case, "cuda", seed=9)
    errs = {n: rel_err(a, b) for n, a, b in zip(names, ours, refs)}
    print(f"[cuda] large {lens} {hqk}/{hv}: " + " ".join(f"d{n} {e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < GRAD_TOL, f"d{n} relative error {e:.3e}"
