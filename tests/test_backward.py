"""Gradients (dq, dk, dv, dg, dbeta, dh0) against autograd through the float64 reference."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch

import flashgdn
from conftest import (CASES, HAS_GPU, NO_GPU_REASON, Case, cotangents, cuda_kernels_run,
                      make_inputs, out_of_fp16_range_inputs, reference, reference_grads,
                      rel_err)

GRAD_TOL = 8e-3
NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


def run_grads(case: Case, device: str, seed: int = 0, do_scale: float = 1.0,
              host_lengths: bool = False):
    """host_lengths: also hand flashgdn cu_seqlens_cpu (packed inputs), as bench_gdn.py does."""
    inp = make_inputs(case, device, seed)
    leaves = {n: (inp[n].clone().requires_grad_() if inp[n] is not None else None) for n in NAMES}
    cu = inp["cu_seqlens"]
    extra = {"cu_seqlens_cpu": cu.cpu()} if host_lengths and cu is not None else {}
    o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True,
                                            **extra)
    do, dht = cotangents(o, ht, seed + 100, do_scale)
    wrt = [leaves[n] for n in NAMES if leaves[n] is not None]
    ours = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), wrt)
    names = [n for n in NAMES if leaves[n] is not None]
    refs = reference_grads(inp, do, dht, names)  # (cached across a test's switched runs)
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


def test_reference_checkpointing_keeps_its_gradients(monkeypatch):
    """The float64 reference checkpoints blocks of CKPT_TOKENS tokens under autograd (its
    saved states ran the GPU tests out of memory side by side): outputs and every gradient
    equal bit for bit to the reference without checkpointing, across block boundaries
    (partial last blocks, packed sequences, h0, grouped heads). CPU, no GPU needed."""
    import flashgdn.reference as R
    case = Case("ckpt", [150, 64, 29], 2, 4, gate="mixed")
    inp = make_inputs(case, "cpu", 11)
    monkeypatch.setattr(R, "CKPT_TOKENS", 32)
    results = []
    for plain in (False, True):
        if plain:  # the recurrence as before: every step's tensors saved
            monkeypatch.setattr(R, "checkpoint", lambda fn, *a, **kw: fn(*a))
        leaves = {n: (inp[n].double().clone().requires_grad_() if inp[n] is not None else None)
                  for n in NAMES}
        o, ht = R.recurrent_gated_delta_rule_ref(**leaves, cu_seqlens=inp["cu_seqlens"])
        do, dht = cotangents(o, ht, 12)
        wrt = [leaves[n] for n in NAMES if leaves[n] is not None]
        results.append((o, ht) + torch.autograd.grad((o * do).sum() + (ht * dht).sum(), wrt))
    assert len(results[0]) == 2 + len([n for n in NAMES if inp[n] is not None])
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"output {i}: {(a - b).abs().max().item():.3e}"


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


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_tensor_core_reverse_pass_matches_simt(monkeypatch):
    """The reverse pass over dS runs on TF32 tensor cores (state_bwd_tc_kernel);
    FLASHGDN_BWD_SIMT=1 selects the fp32 SIMT pass. Both agree within TF32 rounding and the
    tensor-core one is as accurate against the float64 reference."""
    case = Case("tc_vs_simt", [700, 1300, 64], 2, 8, gate="mixed")
    names, tc, refs, _ = run_grads(case, "cuda", seed=21)
    monkeypatch.setenv("FLASHGDN_BWD_SIMT", "1")
    _, simt, _, _ = run_grads(case, "cuda", seed=21)
    for n, a, b, r in zip(names, tc, simt, refs):
        e_tc, e_simt = rel_err(a, r), rel_err(b, r)
        print(f"  d{n}: tensor cores {e_tc:.2e}, SIMT {e_simt:.2e}, between {rel_err(a, b):.2e}")
        assert rel_err(a, b) < 5e-3, f"d{n}: TC and SIMT differ by {rel_err(a, b):.3e}"
        assert e_tc < max(1.5 * e_simt, 2e-3), f"d{n}: TC {e_tc:.3e} vs SIMT {e_simt:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("hqk,hv,dtype", [(2, 8, torch.bfloat16), (4, 4, torch.float16),
                                          (1, 4, torch.bfloat16)], ids=["2-8-bf16", "4-4-fp16", "1-4-bf16"])
def test_grad_chunk_tensor_cores_vs_simt(monkeypatch, hqk: int, hv: int, dtype: torch.dtype):
    """The per-chunk gradients run on TF32 tensor cores (grad_chunk_tc_kernel: warp tiles,
    h and dS read into fragments) by default; FLASHGDN_GRAD_TC=0 keeps the fp32 SIMT
    products. Both must match the float64 reference, agree within TF32 rounding, and the
    default must be deterministic. Grouped value heads (dq, dk summed over 1, 2 or 4 heads),
    lengths not multiple of 64 (one of 1 token), an initial state, g == 0 heads."""
    case = Case("grad_tc", [700, 1300, 64, 1], hqk, hv, gate="mixed", dtype=dtype)
    names, tc, refs, _ = run_grads(case, "cuda", seed=22)
    _, tc2, _, _ = run_grads(case, "cuda", seed=22)
    monkeypatch.setenv("FLASHGDN_GRAD_TC", "0")
    _, simt, _, _ = run_grads(case, "cuda", seed=22)
    for n, a, b, c, r in zip(names, tc, tc2, simt, refs):
        print(f"  d{n}: grad TC {rel_err(a, r):.2e}, SIMT {rel_err(c, r):.2e}, "
              f"between {rel_err(a, c):.2e}")
        assert torch.equal(a, b), f"d{n}: two runs differ"
        assert rel_err(a, r) < GRAD_TOL, f"d{n}: {rel_err(a, r):.3e} against the reference"
        assert rel_err(a, r) < max(1.5 * rel_err(c, r), 2e-3), f"d{n}: less accurate than SIMT"
        assert rel_err(a, c) < 5e-3, f"d{n}: differs from the SIMT products by {rel_err(a, c):.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_auto_pass_backward_out_of_fp16_range(monkeypatch):
    """The backward's recomputation runs the forward's pass: with FLASHGDN_FWD_PASS=auto and
    heads whose v leaves fp16's range, the gradients are finite and agree with the tf32
    pass's within rounding."""
    _, inp = out_of_fp16_range_inputs(seed=4)

    def grads():
        leaves = {n: (inp[n].clone().requires_grad_() if inp[n] is not None else None)
                  for n in NAMES}
        o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                output_final_state=True)
        do, dht = cotangents(o, ht, 7)
        wrt = [leaves[n] for n in NAMES if leaves[n] is not None]
        return torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), wrt)

    monkeypatch.setenv("FLASHGDN_FWD_PASS", "auto")
    auto = grads()
    monkeypatch.setenv("FLASHGDN_FWD_PASS", "tf32")
    tf32 = grads()
    for a, b in zip(auto, tf32):
        assert torch.isfinite(a).all()
        assert rel_err(a, b.double()) < 2e-3


def assert_as_accurate_as_default(label: str, names, other, dflt, refs,
                                  agree: Optional[float] = None) -> None:
    """Gradients of a switched kernel (`other`) against the default's: each as accurate
    against the float64 reference (within 1.2x, or 2e-3), and with `agree` also within that
    relative difference of the default's."""
    for n, a, b, r in zip(names, other, dflt, refs):
        e_o, e_d = rel_err(a, r), rel_err(b, r)
        print(f"  d{n}: {label} {e_o:.2e}, default {e_d:.2e}")
        assert e_o < max(1.2 * e_d, 2e-3), f"d{n}: {label} {e_o:.3e} vs default {e_d:.3e}"
        if agree is not None:
            assert rel_err(a, b.double()) < agree, f"d{n}: {label} and default differ"


def switched_as_accurate(monkeypatch, label: str, case: Case, seed: int, do_scale: float,
                         base: Dict[str, Optional[str]], other: Dict[str, Optional[str]],
                         host_lengths: bool = False
                         ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Gradients under the environment `base`, then `other` (None: unset): the other's as
    accurate against the float64 reference as the base's, within 2e-3 of them, and finite.
    Returns both sets of gradients (base, other)."""
    def apply(settings: Dict[str, Optional[str]]) -> None:
        for k, v in settings.items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, v)
    apply(base)
    names, dflt, refs, _ = run_grads(case, "cuda", seed=seed, do_scale=do_scale,
                                     host_lengths=host_lengths)
    apply(other)
    _, got, _, _ = run_grads(case, "cuda", seed=seed, do_scale=do_scale,
                             host_lengths=host_lengths)
    assert_as_accurate_as_default(label, names, got, dflt, refs, agree=2e-3)
    for n, a in zip(names, got):
        assert torch.isfinite(a).all(), f"d{n} not finite"
    return dflt, got


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("fwd_pass", ["tf32", "f16wu"])
def test_backward_with_other_forward_passes(monkeypatch, fwd_pass: str):
    """The backward's recomputation runs the selected forward pass (FLASHGDN_FWD_PASS):
    every one gives gradients as accurate as the default's against the float64 reference.
    Grouped heads, lengths not multiple of 64, g == 0 and very negative gates."""
    case = Case("passes", [700, 1300, 64], 2, 8, gate="mixed")
    names, dflt, refs, _ = run_grads(case, "cuda", seed=31)
    monkeypatch.setenv("FLASHGDN_FWD_PASS", fwd_pass)
    _, other, _, _ = run_grads(case, "cuda", seed=31)
    assert_as_accurate_as_default(fwd_pass, names, other, dflt, refs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("cp", ["off", "on"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reverse_pass_cols_kernel(monkeypatch, cp: str, dtype: torch.dtype):
    """FLASHGDN_BWD_COLS=1 runs the reverse pass in state_bwd_cols_kernel and the forward's
    recomputation (which records h and U) in state_fwd_cols_kernel (one block per head and
    segment, the value columns as the products' rows): every gradient as accurate as the
    default reverse pass's against the float64 reference and within TF32 rounding of it.
    With CP on: short segments, warm-ups, and exact segments on the g == 0 heads (summaries
    on the identity, chained by seg_combine_kernel). Odd lengths, grouped heads, h0."""
    case = Case("bwd_cols", [700, 1300, 64, 1], 2, 8, gate="mixed", dtype=dtype)
    if cp == "on":
        monkeypatch.setenv("FLASHGDN_CP", "on")
        monkeypatch.setenv("FLASHGDN_CP_SEG", "5")
    names, dflt, refs, _ = run_grads(case, "cuda", seed=41)
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "1")
    _, cols, _, _ = run_grads(case, "cuda", seed=41)
    assert_as_accurate_as_default(f"cols (CP {cp} {dtype})", names, cols, dflt, refs,
                                  agree=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("do_scale", [1e-8, 1e6])
def test_cols_records_keep_their_range(monkeypatch, do_scale: float):
    """The 128-column passes hand h, dS, U and dVt to the per-chunk gradients as fp16 blocks,
    each with a power-of-two factor (csrc/cuda/mma.cuh): with the loss scaled by 1e-8 or
    1e6 (dS and dVt far below or above fp16's range unscaled) every gradient is as accurate
    against the float64 reference as with the 16/32-column passes' fp32 records, and within
    rounding of them. g == 0 and very negative gates, odd lengths, h0."""
    case = Case("rec_range", [700, 1300, 64], 2, 8, gate="mixed")
    switched_as_accurate(monkeypatch, f"cols (dO x {do_scale:g})", case, 47, do_scale,
                         {"FLASHGDN_BWD_COLS": "0"}, {"FLASHGDN_BWD_COLS": "1"})


def short_split_as_accurate(monkeypatch, label: str, case: Case, seed: int,
                            off: Optional[str], on: Optional[str],
                            host_lengths: bool = False) -> None:
    """FLASHGDN_BWD_SHORT `off`, then `on` (None: unset), the planner's own choices otherwise:
    switched_as_accurate, the reverse pass in state_bwd_cols_kernel under `on` and not under
    `off` (the short split taken, and only by the switch)."""
    for k in ("FLASHGDN_BWD_COLS", "FLASHGDN_CP", "FLASHGDN_CP_SEG"):
        monkeypatch.delenv(k, raising=False)
    switched_as_accurate(monkeypatch, label, case, seed, 1.0,
                         {"FLASHGDN_BWD_SHORT": off}, {"FLASHGDN_BWD_SHORT": on},
                         host_lengths=host_lengths)
    for value, taken in ((on, True), (off, False)):
        if value is None:
            monkeypatch.delenv("FLASHGDN_BWD_SHORT", raising=False)
        else:
            monkeypatch.setenv("FLASHGDN_BWD_SHORT", value)
        ran = cuda_kernels_run(lambda: run_grads(case, "cuda", seed=seed,
                                                 host_lengths=host_lengths))
        assert any("state_bwd_cols_kernel" in n for n in ran) == taken, (value, sorted(ran))


# Shapes the backward's short split takes by default (12-chunk segments, 128 columns): one
# sequence of 40 chunks (its last one partial), a batch of two of 32; g == 0 heads among them.
SHORT_SPLIT_CASES = [
    Case("short_split_one", [2500], 2, 8, gate="mixed"),
    Case("short_split_batch", [2048, 2048], 2, 4, varlen=False, gate="mixed",
         dtype=torch.float16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("case", SHORT_SPLIT_CASES, ids=lambda c: c.name)
def test_backward_short_split(monkeypatch, case: Case):
    """The backward's short split (planner.h backward_short_split: 12-chunk segments in the
    128-column passes where the work is short and the longest sequence has 32 chunks or
    more) runs by default on these shapes, where the cost model's plan keeps the 16/32-column
    passes unsplit (FLASHGDN_BWD_SHORT=0): every gradient as accurate against the float64
    reference as that plan's, within 2e-3 of it, finite. Warm-started segments on decaying
    heads, exact ones on g == 0 heads, very negative gates, h0, grouped heads; one sequence
    of 40 chunks (its last one partial), a batch of two."""
    short_split_as_accurate(monkeypatch, "short split", case, 71, off="0", on=None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_backward_short_split_by_average(monkeypatch):
    """The short split's region by the tokens and the average sequence (planner.h
    backward_short_split_avg, part of the default since session 56) takes packed sequences
    the longest-sequence rule alone (FLASHGDN_BWD_SHORT=1) cannot judge (no host lengths:
    2 x ~2000 tokens, 65 chunks of tokens, 8 value heads), whose backward then runs in the
    128-column passes in 12-chunk segments: every gradient as accurate against the float64
    reference as that rule's plan (16/32 columns, unsplit), within 2e-3 of it, finite.
    g == 0 and very negative gates, h0, grouped heads, odd lengths."""
    case = Case("short_avg", [2100, 2001], 2, 8, gate="mixed")
    short_split_as_accurate(monkeypatch, "short split by average", case, 73, off="1", on=None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_backward_short_split_packed(monkeypatch):
    """The short split for packed sequences of few value heads by the known longest one
    (planner.h backward_short_split_packed, part of the default since session 60): eight
    sequences, 8100 tokens in all (127 chunks of tokens, 129 counted with a partial chunk a
    sequence: over the longest-sequence rule's 128; 16 a sequence on average: under the
    average rule's 32), the longest 33 chunks, 8 value heads, the host's lengths given.
    Sessions 56-59's rules (FLASHGDN_BWD_SHORT=3) keep the 16/32-column passes unsplit; the
    default runs the 128-column passes in 12-chunk segments, every gradient as accurate
    against the float64 reference, within 2e-3 of it, finite."""
    case = Case("short_packed", [2100, 1000, 1000, 1000, 1000, 1000, 500, 500], 2, 8,
                gate="mixed")
    short_split_as_accurate(monkeypatch, "short split packed", case, 75, off="3", on=None,
                            host_lengths=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("case", SHORT_SPLIT_CASES, ids=lambda c: c.name)
def test_backward_exact_reach(monkeypatch, case: Case):
    """The backward's exact reach (the default since session 59; FLASHGDN_BWD_EXACT_REACH=0
    not): in the short split (12-chunk segments), the recomputation's second segment and the
    reverse pass's second-to-last, whose warm-up walks reach the sequence's start / end on
    the g == 0 heads, start exact from the chain instead of from h0 / dht. It changes the
    gradients' rounding (not every one bit-equal to the switch-off's: the default takes it),
    and every gradient is as accurate against the float64 reference as with it off, within
    2e-3 of those."""
    for k in ("FLASHGDN_BWD_COLS", "FLASHGDN_CP", "FLASHGDN_CP_SEG", "FLASHGDN_BWD_SHORT",
              "FLASHGDN_BWD_EXACT_REACH"):
        monkeypatch.delenv(k, raising=False)
    off, dflt = switched_as_accurate(monkeypatch, "backward exact reach", case, 79, 1.0,
                                     {"FLASHGDN_BWD_EXACT_REACH": "0"},
                                     {"FLASHGDN_BWD_EXACT_REACH": None})
    assert not all(torch.equal(a, b) for a, b in zip(off, dflt)), "the default is not the reach"


# Shapes for the ready queue (128-column passes): the short split's 12-chunk segments (split,
# warm-ups and exact g == 0 heads, four value heads a q/k head), packed odd lengths with a
# one-token sequence (fp16, two a q/k head), and one unsplit sequence (one a q/k head).
QUEUE_CASES = [
    Case("queue_short_split", [2500], 2, 8, gate="mixed"),
    Case("queue_packed", [700, 1300, 64, 1, 2600], 2, 4, gate="mixed", dtype=torch.float16),
    Case("queue_unsplit", [1000], 4, 4, gate="mixed"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "no_pdl"])
@pytest.mark.parametrize("case", QUEUE_CASES, ids=lambda c: c.name)
def test_backward_ready_queue_same_bits(monkeypatch, case: Case, pdl: str):
    """The ready queue (the default since session 60; FLASHGDN_BWD_QUEUE=0 off): the
    per-chunk gradients' blocks take (chunk, q/k head) items in the order the reverse pass
    completes their records, as its programmatic dependent (FLASHGDN_PDL=1) or after it
    (=0). Each item's arithmetic is the same in any order, so every gradient equals the
    queue-off run's bit for bit, twice in a row (the default: one signal a reverse-pass block),
    and with one signal a warp (FLASHGDN_BWD_QUEUE=1) too (no hang: a slot no block fills
    traps). The default takes the queue on these shapes (value heads x chunks <= 2048): its
    kernels' instantiations ran."""
    for k in ("FLASHGDN_CP", "FLASHGDN_CP_SEG", "FLASHGDN_BWD_SHORT", "FLASHGDN_BWD_QUEUE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "1")
    monkeypatch.setenv("FLASHGDN_PDL", pdl)
    runs = {}
    for label, queue in (("off", "0"), ("on", None), ("on again", None), ("per warp", "1")):
        if queue is None:
            monkeypatch.delenv("FLASHGDN_BWD_QUEUE", raising=False)
        else:
            monkeypatch.setenv("FLASHGDN_BWD_QUEUE", queue)
        out = []
        ran = cuda_kernels_run(lambda: out.append(run_grads(case, "cuda", seed=83)))
        assert any("state_bwd_cols_kernel" in n for n in ran), sorted(ran)
        assert any("grad_chunk_tc_kernel" in n for n in ran), sorted(ran)
        queued = any("grad_chunk_tc_kernel" in n and "true, true>" in n for n in ran)
        assert queued == (label != "off"), (label, sorted(ran))
        names, ours = out[0][0], out[0][1]
        runs[label] = ours
    for n, a, b, c, d in zip(names, runs["off"], runs["on"], runs["on again"],
                             runs["per warp"]):
        assert torch.isfinite(b).all(), f"d{n} not finite"
        assert torch.equal(a, b), f"d{n}: the ready queue's differs from the queue-off run's"
        assert torch.equal(b, c), f"d{n}: the ready queue's differs run to run"
        assert torch.equal(a, d), f"d{n}: the per-warp signals' differs from the queue-off run's"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_backward_ready_queue_rule(monkeypatch):
    """The ready queue by default (launch.cu bwd_queue) where value heads x chunks of tokens
    <= 2048 (2/4 heads x 2048 tokens: 128), not beyond (16/32 heads x 8192 tokens: 4096), in
    the 128-column passes either way; FLASHGDN_BWD_QUEUE=1 takes it there too. The queue is
    grad_chunk_tc_kernel's: beyond the region the gradients run by default in
    grad_chunk_wg_kernel (test_grad_wg_default_rule), which has none, so FLASHGDN_GRAD_WG=0
    here."""
    for k in ("FLASHGDN_CP", "FLASHGDN_CP_SEG", "FLASHGDN_BWD_SHORT", "FLASHGDN_BWD_QUEUE",
              "FLASHGDN_PDL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "1")
    monkeypatch.setenv("FLASHGDN_GRAD_WG", "0")

    def queued(case: Case) -> bool:
        inp = make_inputs(case, "cuda", 5)
        leaves = {n: (inp[n].clone().requires_grad_() if inp[n] is not None else None)
                  for n in NAMES}
        wrt = [leaves[n] for n in NAMES if leaves[n] is not None]

        def step():
            o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                    output_final_state=True)
            torch.autograd.grad(o.float().square().sum() + ht.square().sum(), wrt)
        ran = cuda_kernels_run(step)
        assert any("state_bwd_cols_kernel" in n for n in ran), sorted(ran)
        return any("grad_chunk_tc_kernel" in n and "true, true>" in n for n in ran)

    small, large = Case("q_small", [2048], 2, 4), Case("q_large", [8192], 16, 32)
    assert queued(small)
    assert not queued(large)
    monkeypatch.setenv("FLASHGDN_BWD_QUEUE", "1")
    assert queued(large)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("cp", ["off", "on"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_recompute_on_tma_kernel_same_bits(monkeypatch, cp: str, dtype: torch.dtype):
    """The backward's recomputation in state_fwd_tma_kernel's kRec (TMA producer, wgmma state
    warpgroups; the default since session 56) records the same states and U as
    state_fwd_cols_kernel's (FLASHGDN_REC_TMA=0), so the gradients are equal bit for bit; and
    each setting runs its kernel in the backward. 128-column passes, unsplit and in 5-chunk
    segments (warm-ups, exact g == 0 heads), packed odd lengths, grouped heads, h0."""
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "1")
    for k in ("FLASHGDN_CP", "FLASHGDN_CP_SEG", "FLASHGDN_BWD_SHORT"):
        monkeypatch.delenv(k, raising=False)
    if cp == "on":
        monkeypatch.setenv("FLASHGDN_CP", "on")
        monkeypatch.setenv("FLASHGDN_CP_SEG", "5")
    case = Case("rec_tma", [700, 1300, 64, 1], 2, 8, gate="mixed", dtype=dtype)
    inp = make_inputs(case, "cuda", 41)
    grads, ran = {}, {}
    for rec in ("0", None):
        if rec is None:
            monkeypatch.delenv("FLASHGDN_REC_TMA", raising=False)
        else:
            monkeypatch.setenv("FLASHGDN_REC_TMA", rec)
        leaves = {n: (inp[n].clone().requires_grad_() if inp[n] is not None else None)
                  for n in NAMES}
        o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                output_final_state=True)
        do, dht = cotangents(o, ht, 141)
        wrt = [leaves[n] for n in NAMES if leaves[n] is not None]
        out = []
        ran[rec] = cuda_kernels_run(lambda: out.extend(
            torch.autograd.grad((o * do).sum() + (ht * dht).sum(), wrt)))
        grads[rec] = out
    assert any("state_fwd_cols_kernel" in n for n in ran["0"]), sorted(ran["0"])
    assert not any("state_fwd_tma_kernel" in n for n in ran["0"]), sorted(ran["0"])
    assert any("state_fwd_tma_kernel" in n for n in ran[None]), sorted(ran[None])
    assert not any("state_fwd_cols_kernel" in n for n in ran[None]), sorted(ran[None])
    for n, a, b in zip([n for n in NAMES if inp[n] is not None], grads[None], grads["0"]):
        assert torch.isfinite(a).all(), f"d{n} not finite"
        assert torch.equal(a, b), f"d{n}: the TMA recomputation's differs from the cols one's"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_cols_row_scale_keeps_small_columns(monkeypatch):
    """FLASHGDN_BWD_ROWSCALE=1 (opt-in; NOT YET RUN ON A GPU when written): the 128-column
    reverse pass scales each value column by its own power of two, so value columns whose
    dO and dS_T are 1e-6 times their 15 neighbours' (half of every 16) keep the accuracy of
    the 16/32-column TF32 passes in their gradient dv (the default's shared per-warp factor
    loses bits there: bench/precision_study_bwd.py --reverse-pass)."""
    case = Case("row_scale", [700, 1300, 64], 2, 8, gate="mixed")
    inp = make_inputs(case, "cuda", 53)
    small = torch.tensor([c for c in range(128) if c % 16 >= 8], device="cuda")
    f = torch.ones(128, device="cuda")
    f[small] = 1e-6

    def grads():
        leaves = {n: inp[n].clone().requires_grad_() for n in NAMES}
        o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                output_final_state=True)
        gen = torch.Generator().manual_seed(54)
        do = (torch.randn(o.shape, generator=gen).cuda() * f).to(o.dtype)
        dht = torch.randn(ht.shape, generator=gen).cuda() * f
        dv = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves["v"])[0]
        return dv, do, dht

    monkeypatch.setenv("FLASHGDN_BWD_COLS", "0")
    dv_tf32, do, dht = grads()
    ref_leaves = {n: inp[n].double().clone().requires_grad_() for n in NAMES}
    ro, rh = reference({**ref_leaves, "cu_seqlens": inp["cu_seqlens"]})
    ref = torch.autograd.grad((ro * do.double()).sum() + (rh * dht.double()).sum(),
                              ref_leaves["v"])[0]
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "1")
    dv_warp, _, _ = grads()
    monkeypatch.setenv("FLASHGDN_BWD_ROWSCALE", "1")
    dv_row, _, _ = grads()
    e = {k: rel_err(x.index_select(-1, small), ref.index_select(-1, small))
         for k, x in (("tf32", dv_tf32), ("warp", dv_warp), ("row", dv_row))}
    print("  dv of the small columns: " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()))
    assert e["row"] < 1.25 * e["tf32"] + 1e-5, e
    assert rel_err(dv_row, ref) < GRAD_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_cols_workspace_holds_fp16_buffers(monkeypatch):
    """Where the 128-column passes run, T, P, the h / dS records and U / dVt are fp16 and
    the backward's workspace carves them at half their fp32 sizes (launch.cu carve_bwd):
    the workspace asked for is smaller than the 16/32-column passes' by at least half the
    fp32 state records (chunks x heads x 128 x 128 x 4 bytes, h and dS together), and the
    gradients in it still meet the float64 reference. CP off, so that both plans carve no
    segment buffers."""
    import flashgdn.ops as ops
    asked = []
    real = ops._alloc_on  # the bindings' workspace allocator (sized by the library)

    def spy(like):
        make = real(like)

        def alloc(nbytes):
            asked.append(nbytes)
            return make(nbytes)
        return alloc

    monkeypatch.setattr(ops, "_alloc_on", spy)
    monkeypatch.setenv("FLASHGDN_CP", "off")
    case = Case("ws_cols", [1000, 300], 2, 8, gate="mixed")
    got = {}
    for v in ("0", "1"):
        monkeypatch.setenv("FLASHGDN_BWD_COLS", v)
        asked.clear()
        names, ours, refs, _ = run_grads(case, "cuda", seed=5)
        got[v] = asked[-1]  # the backward's (the forward's comes first)
        for n, a, r in zip(names, ours, refs):
            assert rel_err(a, r) < GRAD_TOL, f"BWD_COLS={v} d{n}: {rel_err(a, r):.3e}"
    chunks = 16 + 5
    records = chunks * 8 * 128 * 128 * 4  # one fp32 state record buffer
    print(f"  backward workspace: 16/32 columns {got['0']} B, 128 columns {got['1']} B")
    assert got["0"] - got["1"] >= records, (got["0"], got["1"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_backward_auto_takes_cols_kernels_on_wide_work(monkeypatch):
    """Without FLASHGDN_BWD_COLS, a backward whose work is large (32 value heads x 80 chunks:
    planner.h backward_cols) runs its sequential passes in the 128-column kernels: as
    accurate as the 16/32-column passes (FLASHGDN_BWD_COLS=0) against the float64
    reference, and within TF32 rounding of them. g == 0 heads among decaying ones, h0."""
    monkeypatch.delenv("FLASHGDN_BWD_COLS", raising=False)
    case = Case("bwd_auto_cols", [5120], 8, 32, gate="mixed")
    names, auto, refs, _ = run_grads(case, "cuda", seed=43)
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "0")
    _, narrow, _, _ = run_grads(case, "cuda", seed=43)
    assert_as_accurate_as_default("auto (cols)", names, auto, narrow, refs, agree=2e-3)
    # the two runs took different kernels: their gradients are not bit-identical
    assert any(not torch.equal(a, b) for a, b in zip(auto, narrow))


# grad_chunk_wg_kernel (FLASHGDN_GRAD_WG=1; by default beyond the ready queue's region): the
# per-chunk gradients on wgmma, bf16 inputs with the 128-column passes' fp16 records. Packed
# odd lengths, a one-token sequence, g == 0 and very negative gates, h0; one, two and four
# value heads a q/k head.
GRAD_WG_CASES = [
    Case("grad_wg_packed", [700, 1300, 64, 1], 2, 8, gate="mixed"),
    Case("grad_wg_group1", [517, 130], 4, 4, gate="mixed"),
    Case("grad_wg_group2", [1000], 2, 4, varlen=False, gate="mixed"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("do_scale", [1.0, 1e-8, 1e6])
@pytest.mark.parametrize("case", GRAD_WG_CASES, ids=lambda c: c.name)
def test_grad_wg_kernel(monkeypatch, case: Case, do_scale: float):
    """FLASHGDN_GRAD_WG=1 runs the per-chunk gradients in grad_chunk_wg_kernel, =0 in
    grad_chunk_tc_kernel (the default chooses by launch.cu grad_wg: test_grad_wg_default_rule):
    every gradient of the former as accurate against the float64 reference as the latter's,
    within 2e-3 of them, finite, with the loss scaled by 1, 1e-8 and 1e6."""
    for k in ("FLASHGDN_CP", "FLASHGDN_CP_SEG", "FLASHGDN_BWD_SHORT", "FLASHGDN_BWD_QUEUE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "1")
    switched_as_accurate(monkeypatch, f"grad_wg (dO x {do_scale:g})", case, 53, do_scale,
                         {"FLASHGDN_GRAD_WG": "0"}, {"FLASHGDN_GRAD_WG": "1"})
    for value, taken in (("1", True), ("0", False)):
        monkeypatch.setenv("FLASHGDN_GRAD_WG", value)
        ran = cuda_kernels_run(lambda: run_grads(case, "cuda", seed=53, do_scale=do_scale))
        assert any("grad_chunk_wg_kernel" in n for n in ran) == taken, (value, sorted(ran))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_grad_wg_kernel_split(monkeypatch):
    """grad_chunk_wg_kernel under short segments (CP on, 5-chunk segments: warm-ups and
    exact g == 0 heads in the passes before it): as accurate as grad_chunk_tc_kernel."""
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "1")
    monkeypatch.setenv("FLASHGDN_CP", "on")
    monkeypatch.setenv("FLASHGDN_CP_SEG", "5")
    case = Case("grad_wg_split", [2100, 333], 2, 8, gate="mixed")
    switched_as_accurate(monkeypatch, "grad_wg (CP on)", case, 59, 1.0,
                         {"FLASHGDN_GRAD_WG": "0"}, {"FLASHGDN_GRAD_WG": "1"})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("blocks", [3, 7])
@pytest.mark.parametrize("case", GRAD_WG_CASES, ids=lambda c: c.name)
def test_grad_wg_persistent_grid(monkeypatch, case: Case, blocks: int):
    """grad_chunk_wg_kernel's blocks take every gridDim.x-th (chunk, q/k head) item, the
    next item's records copied under the current one's tail. With the grid capped at 3 or 7
    blocks (FLASHGDN_GRAD_WG_GRID; 5-23 items a block, across sequences of odd lengths and
    q/k heads) every gradient equals the uncapped run's bit for bit (these cases have fewer
    items than SMs: one item a block there)."""
    for k in ("FLASHGDN_CP", "FLASHGDN_CP_SEG", "FLASHGDN_BWD_SHORT", "FLASHGDN_BWD_QUEUE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "1")
    monkeypatch.setenv("FLASHGDN_GRAD_WG", "1")
    monkeypatch.delenv("FLASHGDN_GRAD_WG_GRID", raising=False)
    names, full, refs, _ = run_grads(case, "cuda", seed=67)
    monkeypatch.setenv("FLASHGDN_GRAD_WG_GRID", str(blocks))
    _, capped, _, _ = run_grads(case, "cuda", seed=67)
    for n, a, b, r in zip(names, capped, full, refs):
        assert torch.equal(a, b), f"d{n}: capped grid differs by {(a - b).abs().max().item():.3e}"
        assert rel_err(a, r) < GRAD_TOL, f"d{n}: {rel_err(a, r):.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("hv,tokens,dtype,wg", [
    (8, 33000, torch.bfloat16, True),    # value heads x chunks 4128 > 2048: wgmma
    (8, 33000, torch.float16, False),    # fp16 inputs: grad_chunk_tc_kernel
    (4, 8192, torch.bfloat16, False),    # 512 <= 2048: the ready queue's region
], ids=["bf16_large", "fp16_large", "bf16_queue_region"])
def test_grad_wg_default_rule(monkeypatch, hv: int, tokens: int, dtype: torch.dtype, wg: bool):
    """With FLASHGDN_GRAD_WG unset the per-chunk gradients run in grad_chunk_wg_kernel exactly
    where launch.cu grad_wg says: bf16 inputs, the 128-column passes' records, value heads x
    chunks of tokens beyond the ready queue's region; grad_chunk_tc_kernel elsewhere. Finite
    gradients either way (their accuracy: test_grad_wg_kernel)."""
    for k in ("FLASHGDN_GRAD_WG", "FLASHGDN_BWD_COLS", "FLASHGDN_BWD_QUEUE", "FLASHGDN_CP",
              "FLASHGDN_CP_SEG", "FLASHGDN_BWD_SHORT"):
        monkeypatch.delenv(k, raising=False)
    case = Case("grad_wg_rule", [tokens], hv // 2, hv, varlen=False, gate="mixed", dtype=dtype)
    inp = make_inputs(case, "cuda", 61)
    leaves = {n: (inp[n].clone().requires_grad_() if inp[n] is not None else None) for n in NAMES}
    grads = []

    def call():
        o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                output_final_state=True)
        wrt = [x for x in leaves.values() if x is not None]
        grads[:] = torch.autograd.grad(o.float().sum() + ht.sum(), wrt)

    ran = cuda_kernels_run(call)
    assert any("grad_chunk_wg_kernel" in n for n in ran) == wg, sorted(ran)
    assert any("grad_chunk_tc_kernel" in n for n in ran) == (not wg), sorted(ran)
    for x in grads:
        assert torch.isfinite(x).all()
