"""keep_for_backward: the forward keeps what the backward would recompute (the state entering
every chunk, U, T, P) and the backward reads it instead of re-running the forward's pass.

The backward on a kept workspace runs the same kernels on the same records as the backward
that recomputes them, so its gradients must be bit-identical; o must meet the float64
reference like the plain forward's. A kept workspace of another problem gives NaN gradients
(the tag check on the device), a too small one a clear error.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

import flashgdn
import flashgdn.ops as ops
from conftest import HAS_GPU, NO_GPU_REASON, Case, cotangents, make_inputs, reference, rel_err

NAMES = ["q", "k", "v", "g", "beta", "initial_state"]
O_TOL = 8e-3


def grads(case: Case, device: str, keep: bool, seed: int = 0, twice: bool = False):
    inp = make_inputs(case, device, seed)
    leaves = {n: (inp[n].clone().requires_grad_() if inp[n] is not None else None) for n in NAMES}
    o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                            output_final_state=True, keep_for_backward=keep)
    do, dht = cotangents(o, ht, seed + 100)
    wrt = [leaves[n] for n in NAMES if leaves[n] is not None]
    loss = (o * do).sum() + (ht * dht).sum()
    out = torch.autograd.grad(loss, wrt, retain_graph=twice)
    again = torch.autograd.grad(loss, wrt) if twice else None
    return inp, o.detach(), ht.detach(), out, again


def check_against_recomputation(case: Case, seed: int) -> None:
    inp, o_k, ht_k, g_k, again = grads(case, "cuda", True, seed, twice=True)
    _, o_r, ht_r, g_r, _ = grads(case, "cuda", False, seed)
    names = [n for n in NAMES if inp[n] is not None]
    for n, a, b in zip(names, g_k, g_r):
        assert torch.isfinite(a).all(), f"d{n} not finite"
        assert torch.equal(a, b), f"d{n}: kept {rel_err(a, b.double()):.2e} from recomputed"
    for n, a, b in zip(names, again, g_k):  # the kept workspace is only read
        assert torch.equal(a, b), f"d{n} differs on a second backward"
    ro, rh = reference(inp)
    e_o, e_h = rel_err(o_k, ro), rel_err(ht_k, rh)
    print(f"  {case.name}: o {e_o:.2e} (plain forward {rel_err(o_r, ro):.2e}), state {e_h:.2e}")
    assert e_o < O_TOL and e_h < O_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("cols", ["0", "1"], ids=["narrow", "cols"])
@pytest.mark.parametrize("cp", ["off", "on"])
def test_kept_backward_is_the_recomputing_one(monkeypatch, cols: str, cp: str):
    """Both kinds of sequential passes (16/32 columns with fp32 records, 128 columns with
    fp16 ones), with and without context parallelism (short segments: warm-ups and exact
    g == 0 segments, whose reverse pass needs segment buffers of its own next to the kept
    ones). Packed odd lengths, grouped heads, h0, g == 0 and very negative gates."""
    monkeypatch.setenv("FLASHGDN_BWD_COLS", cols)
    if cp == "on":
        monkeypatch.setenv("FLASHGDN_CP", "on")
        monkeypatch.setenv("FLASHGDN_CP_SEG", "5")
    check_against_recomputation(Case("kept", [700, 1300, 64, 1], 2, 8, gate="mixed"), seed=3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kept_backward_fixed_length_and_default_plan(monkeypatch, dtype: torch.dtype):
    """Fixed-length batch (no cu_seqlens: the tag check's error flag is the backward's own)
    with the planner's own choices; both input dtypes."""
    for key in ("FLASHGDN_BWD_COLS", "FLASHGDN_CP", "FLASHGDN_CP_SEG"):
        monkeypatch.delenv(key, raising=False)
    check_against_recomputation(
        Case("kept_fixed", [1500, 1500], 4, 16, varlen=False, gate="mixed", dtype=dtype), seed=4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("lens", [[2500], [2100, 2001]], ids=["one", "packed"])
def test_kept_backward_short_split(monkeypatch, lens: List[int]):
    """Shapes the backward's short split takes (planner.h backward_short_seg, the default:
    one sequence of 40 chunks by the longest-sequence rule; two packed ones of ~33 chunks,
    no host lengths, by the average rule; 8 value heads): the kept forward records for that
    plan, and the backward on its workspace matches the recomputing one."""
    for key in ("FLASHGDN_BWD_COLS", "FLASHGDN_CP", "FLASHGDN_CP_SEG", "FLASHGDN_BWD_SHORT"):
        monkeypatch.delenv(key, raising=False)
    check_against_recomputation(Case("kept_short", lens, 2, 8, gate="mixed"), seed=9)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_kept_workspace_of_another_problem_gives_nan():
    """The backward compares the kept workspace's tag with its own problem on the device:
    inputs of other shapes (fewer tokens) or another scale give NaN gradients, the same
    values at other addresses (saved-tensor offloading) the same gradients, and a kept
    workspace smaller than the problem needs raises, naming kept_workspace."""
    case = Case("tag", [300, 200], 2, 4, gate="mixed")
    a = make_inputs(case, "cuda", 1)
    args = lambda x, scale=0.088: (x["q"], x["k"], x["v"], x["g"], x["beta"], scale,  # noqa: E731
                                   x["initial_state"], x["cu_seqlens"])
    o, ht, kept = ops._fwd_kept_op(*args(a), True)
    assert kept.numel() > 0
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    good = ops._bwd_kept_op(*args(a), do, dht, kept)
    assert all(torch.isfinite(x).all() for x in good)
    ref = ops._bwd_op(*args(a), do, dht)
    assert all(torch.equal(x, y) for x, y in zip(good, ref))
    moved = {n: (t.clone() if t is not None else None) for n, t in a.items()}
    assert all(torch.equal(x, y) for x, y in zip(ops._bwd_kept_op(*args(moved), do, dht, kept),
                                                 ref))
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for n, x in zip(names, ops._bwd_kept_op(*args(a, scale=0.1), do, dht, kept)):
        assert torch.isnan(x).all(), f"{n} not NaN on a kept workspace of another scale"
    b = make_inputs(Case("tag_short", [250, 200], 2, 4, gate="mixed"), "cuda", 2)
    db, dhtb = torch.randn_like(b["v"]), torch.randn_like(ht)
    for n, x in zip(names, ops._bwd_kept_op(*args(b), db, dhtb, kept)):
        assert torch.isnan(x).all(), f"{n} not NaN on a kept workspace of other shapes"
    with pytest.raises(ValueError, match="kept_workspace"):
        ops._bwd_kept_op(*args(a), do, dht, kept[: kept.numel() // 2])


def test_keep_for_backward_on_cpu_is_the_plain_call():
    """The CPU backend keeps nothing: keep_for_backward=True gives the same o and gradients,
    and the kept ops run there with an empty kept workspace."""
    case = Case("kept_cpu", [130, 70], 2, 4, gate="mixed")
    _, o_k, ht_k, g_k, _ = grads(case, "cpu", True, seed=6)
    _, o_r, ht_r, g_r, _ = grads(case, "cpu", False, seed=6)
    assert torch.equal(o_k, o_r) and torch.equal(ht_k, ht_r)
    assert all(torch.equal(a, b) for a, b in zip(g_k, g_r))
    x = make_inputs(case, "cpu", 6)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.088, x["initial_state"], x["cu_seqlens"])
    o, ht, kept = ops._fwd_kept_op(*args, True)
    assert kept.numel() == 0 and torch.equal(o, ops._fwd_op(*args, True)[0])
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    for a, b in zip(ops._bwd_kept_op(*args, do, dht, kept), ops._bwd_op(*args, do, dht)):
        assert torch.equal(a, b)


def test_opcheck_kept_ops(device):
    """The kept forward (its workspace output sized at run time: an unbacked size under fake
    tensors) and the kept backward pass torch.library's checks. On CUDA the kept workspace
    holds bytes no kernel writes (alignment gaps, buffers of plans not taken), so two runs'
    workspaces differ there and the eager-vs-compiled output comparison
    (test_aot_dispatch_dynamic) cannot apply to it; the compiled kept path is checked bit for
    bit on o and the gradients by test_torch_compile_fullgraph_keep instead."""
    a = make_inputs(Case("oc_kept", [40, 30], 1, 2), device)
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        a[n] = a[n].requires_grad_()
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], 0.1, a["initial_state"], a["cu_seqlens"],
            True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    if device == "cpu":  # the CPU keeps nothing: an empty, comparable workspace
        checks += ("test_aot_dispatch_dynamic",)
    torch.library.opcheck(ops._fwd_kept_op, args, test_utils=checks)
    det = [x.detach() if isinstance(x, torch.Tensor) else x for x in args]
    o, ht, kept = ops._fwd_kept_op(*det)
    torch.library.opcheck(ops._bwd_kept_op, (*det[:8], torch.randn_like(o), torch.randn_like(ht),
                                             kept),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_torch_compile_fullgraph_keep(device):
    """torch.compile(fullgraph=True) of forward + backward with keep_for_backward: the same
    loss and gradients as the eager kept call, bit for bit (the plain forward's WY kernel,
    wy_lean_kernel, is not the kept one's, so its o may differ in the last bits)."""
    a = make_inputs(Case("tc_kept", [100, 60], 2, 4, gate="mixed"), device)

    def f(q, k, v, g, beta, h0, keep=True):
        o, ht = flashgdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True,
                                                cu_seqlens=a["cu_seqlens"],
                                                keep_for_backward=keep)
        return o.float().square().sum() + ht.sum()

    leaves = [a[n].clone().requires_grad_() for n in NAMES]
    eager = f(*leaves, keep=True)
    eager_grads = torch.autograd.grad(eager, leaves)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    grads = torch.autograd.grad(out, leaves)
    assert torch.equal(out, eager)
    for x, y in zip(grads, eager_grads):
        assert torch.equal(x, y)


def test_from_raw_keep_for_backward(device):
    """chunk_gated_delta_rule_from_raw passes keep_for_backward on: the same o and gradients
    (to a, b, A_log, dt_bias as well) as without it, bit for bit."""
    from test_gating import RAW_NAMES, raw_inputs
    inp = raw_inputs(Case("raw_kept", [130, 70], 2, 4, gate="mixed"), device, seed=9)
    res = []
    for keep in (False, True):
        leaves = {n: inp[n].clone().requires_grad_() for n in RAW_NAMES}
        o, ht = flashgdn.chunk_gated_delta_rule_from_raw(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                         output_final_state=True,
                                                         keep_for_backward=keep)
        do, dht = cotangents(o, ht, 11)
        grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), list(leaves.values()))
        res.append((o.detach(), grads))
    (o0, g0), (o1, g1) = res
    assert torch.equal(o0, o1) or device == "cuda"  # CUDA: the kept forward's plan may differ
    assert rel_err(o1, o0.double()) < 2e-3
    for n, x, y in zip(RAW_NAMES, g1, g0):
        assert torch.equal(x, y), f"d{n}"
