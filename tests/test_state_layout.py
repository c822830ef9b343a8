"""State layouts ("kv" = [.., K, V], "vk" = [.., V, K]) and state dtypes (fp32, bf16, fp16).

Every combination is checked against the default kv/fp32 path on the same inputs:

* chunk_gated_delta_rule: the states are converted at the boundary only (math in fp32
  [K, V]), so with the initial state's values representable in its dtype the output o
  and every input gradient are bit-equal to the kv/fp32 path, and the final state / dh0
  are that path's fp32 results rounded once to their dtype and laid out as asked.
* decode: the pool is read and written natively; on the CPU the math is the same
  loop, so o is bit-equal and the pool is the kv/fp32 pool rounded once per call; the
  CUDA vk kernel sums in another order, so there the comparison has a tolerance.

Plus validation messages, opcheck / torch.compile, and CUDA-graph capture (GPU).
"""
from __future__ import annotations

import itertools
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import flashgdn
from flashgdn import ops, _C
from conftest import HAS_GPU, NO_GPU_REASON, Case, make_inputs, rel_err

LAYOUTS = ("kv", "vk")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMBOS = list(itertools.product(LAYOUTS, DTYPES))
COMBO_IDS = [f"{l}-{str(d).split('.')[-1]}" for l, d in COMBOS]


def to_layout(x_kv: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """fp32 [.., K, V] -> the given layout and dtype (contiguous)."""
    x = x_kv.transpose(-1, -2) if layout == "vk" else x_kv
    return x.to(dtype).contiguous()


def to_kv(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A state in `layout` -> [.., K, V] (same dtype)."""
    return (x.transpose(-1, -2) if layout == "vk" else x).contiguous()


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values made representable in dtype (so converting them is exact)."""
    return x.to(dtype).float()


def assert_rounded_once(got_kv: torch.Tensor, ref_fp32: torch.Tensor, dtype: torch.dtype,
                        exact: bool) -> None:
    """got (in dtype) == ref rounded to dtype: bit-equal, or within one rounding."""
    assert got_kv.dtype == dtype
    assert torch.isfinite(got_kv).all()
    if exact or dtype == torch.float32:  # fp32: the same kernels, transposes are exact
        assert torch.equal(got_kv, ref_fp32.to(dtype)), (
            f"max diff {(got_kv.float() - ref_fp32).abs().max().item():.3e}")
        return
    fi = torch.finfo(dtype)
    bound = fi.eps * ref_fp32.abs() + fi.tiny  # round to nearest: <= eps/2 relative
    diff = (got_kv.float() - ref_fp32).abs()
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item():.3e}"


# --------------------------------------------------------------------------- chunk: forward


CHUNK_CASE = Case("sl", [70, 1, 130], 2, 4)  # packed: partial chunks, a 1-token sequence


@pytest.mark.parametrize("layout,dtype", COMBOS, ids=COMBO_IDS)
def test_chunk_forward_matches_kv_fp32(layout, dtype, device):
    a = make_inputs(CHUNK_CASE, device, seed=11)
    h0_kv = rounded(a["initial_state"], dtype)
    common = {n: a[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")}
    o_ref, ht_ref = flashgdn.chunk_gated_delta_rule(**common, initial_state=h0_kv,
                                                    output_final_state=True)
    h0 = to_layout(h0_kv, layout, dtype)
    h0_before = h0.clone()
    o, ht = flashgdn.chunk_gated_delta_rule(**common, initial_state=h0, output_final_state=True,
                                            state_layout=layout)
    assert torch.equal(h0, h0_before), "initial_state must not be modified"
    assert torch.equal(o, o_ref), "o must be bit-equal to the kv/fp32 path"
    assert ht.dtype == dtype and ht.shape == ht_ref.shape
    # the final state's rounding: bit-equal to torch's round-to-nearest-even on the CPU
    assert_rounded_once(to_kv(ht, layout), ht_ref, dtype, exact=device == "cpu")
    # a transposed layout really is transposed (the state is not symmetric)
    if layout == "vk" and dtype == torch.float32:
        assert not torch.equal(ht, ht_ref)
        assert torch.equal(ht.transpose(-1, -2), ht_ref)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("h0_dtype,final_dtype", [
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
    (None, torch.bfloat16), (None, torch.float16), (torch.float16, None), (None, None)])
def test_chunk_final_state_dtype(layout, h0_dtype, final_dtype, device):
    a = make_inputs(Case("fd", [100, 40], 1, 2), device, seed=12)
    common = {n: a[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")}
    h0_kv = None if h0_dtype is None else rounded(a["initial_state"], h0_dtype)
    o_ref, ht_ref = flashgdn.chunk_gated_delta_rule(**common, initial_state=h0_kv,
                                                    output_final_state=True)
    h0 = None if h0_dtype is None else to_layout(h0_kv, layout, h0_dtype)
    o, ht = flashgdn.chunk_gated_delta_rule(**common, initial_state=h0, output_final_state=True,
                                            state_layout=layout, final_state_dtype=final_dtype)
    expect = final_dtype or h0_dtype or torch.float32
    assert ht.dtype == expect
    assert torch.equal(o, o_ref)
    assert_rounded_once(to_kv(ht, layout), ht_ref, expect, exact=device == "cpu")


def test_chunk_fwd_low_level_and_from_raw(device):
    """chunk_gated_delta_rule_fwd and _from_raw pass state_layout / final_state_dtype on."""
    a = make_inputs(Case("ll", [80], 1, 2, varlen=False), device, seed=13)
    common = {n: a[n] for n in ("q", "k", "v", "g", "beta")}
    h0_kv = rounded(a["initial_state"], torch.bfloat16)
    o_ref, ht_ref = flashgdn.chunk_gated_delta_rule_fwd(**common, initial_state=h0_kv,
                                                        output_final_state=True)
    o, ht = flashgdn.chunk_gated_delta_rule_fwd(
        **common, initial_state=to_layout(h0_kv, "vk", torch.bfloat16), output_final_state=True,
        state_layout="vk", final_state_dtype=torch.float32)
    assert torch.equal(o, o_ref) and ht.dtype == torch.float32
    assert torch.equal(to_kv(ht, "vk"), ht_ref)

    gen = torch.Generator().manual_seed(0)
    raw = {n: torch.randn(1, 80, 2, generator=gen).to(device) for n in ("a", "b")}
    A_log = torch.zeros(2, device=device)
    dt_bias = torch.zeros(2, device=device)
    qkv = {n: a[n] for n in ("q", "k", "v")}
    o1, h1 = flashgdn.chunk_gated_delta_rule_from_raw(**qkv, **raw, A_log=A_log, dt_bias=dt_bias,
                                                      initial_state=h0_kv,
                                                      output_final_state=True)
    o2, h2 = flashgdn.chunk_gated_delta_rule_from_raw(
        **qkv, **raw, A_log=A_log, dt_bias=dt_bias,
        initial_state=to_layout(h0_kv, "vk", torch.bfloat16), output_final_state=True,
        state_layout="vk")
    assert torch.equal(o1, o2) and h2.dtype == torch.bfloat16
    assert_rounded_once(to_kv(h2, "vk"), h1, torch.bfloat16, exact=device == "cpu")


# -------------------------------------------------------------------------- chunk: autograd


@pytest.mark.parametrize("layout,dtype", COMBOS, ids=COMBO_IDS)
def test_chunk_gradients_match_kv_fp32(layout, dtype, device):
    """Autograd through o and the final state: dq..dbeta bit-equal, dh0 rounded once."""
    a = make_inputs(Case("gr", [90, 40], 2, 4), device, seed=14)
    gen = torch.Generator().manual_seed(15)
    w_o = torch.randn(a["v"].shape, generator=gen).to(device)
    w_h = rounded(torch.randn(a["initial_state"].shape, generator=gen), dtype).to(device)
    h0_kv = rounded(a["initial_state"], dtype)
    names = ("q", "k", "v", "g", "beta")

    def run(h0, lay, weight_h):
        leaves = {n: a[n].clone().requires_grad_() for n in names}
        h0 = h0.clone().requires_grad_()
        o, ht = flashgdn.chunk_gated_delta_rule(**leaves, initial_state=h0,
                                                cu_seqlens=a["cu_seqlens"],
                                                output_final_state=True, state_layout=lay)
        loss = (o.float() * w_o).sum() + (ht.float() * weight_h).sum()
        grads = torch.autograd.grad(loss, [leaves[n] for n in names] + [h0])
        return o, ht, grads

    o_ref, ht_ref, g_ref = run(h0_kv, "kv", w_h)
    o, ht, g = run(to_layout(h0_kv, layout, dtype), layout, to_layout(w_h, layout, torch.float32))
    assert torch.equal(o, o_ref)
    for n, x, r in zip(names, g[:5], g_ref[:5]):
        assert x.dtype == r.dtype and torch.equal(x, r), f"d{n} differs from the kv/fp32 path"
    dh0 = g[5]
    assert dh0.dtype == dtype and dh0.shape == h0_kv.shape
    assert g_ref[5].abs().max() > 0
    assert_rounded_once(to_kv(dh0, layout), g_ref[5], dtype, exact=device == "cpu")


@pytest.mark.parametrize("layout,dht_dtype", [("vk", torch.bfloat16), ("vk", torch.float32),
                                              ("kv", torch.float16)])
def test_chunk_bwd_low_level_dht_dtype(layout, dht_dtype, device):
    """chunk_gated_delta_rule_bwd: dht in any state dtype, dh0 in initial_state's dtype."""
    a = make_inputs(Case("lb", [75, 20], 1, 2), device, seed=16)
    common = {n: a[n] for n in ("q", "k", "v", "g", "beta")}
    gen = torch.Generator().manual_seed(17)
    do = torch.randn(a["v"].shape, generator=gen).to(a["v"].dtype).to(device)
    dht_kv = rounded(torch.randn(a["initial_state"].shape, generator=gen), dht_dtype).to(device)
    h0_kv = rounded(a["initial_state"], torch.bfloat16)
    ref = flashgdn.chunk_gated_delta_rule_bwd(**common, do=do, initial_state=h0_kv, dht=dht_kv,
                                              cu_seqlens=a["cu_seqlens"])
    got = flashgdn.chunk_gated_delta_rule_bwd(
        **common, do=do, initial_state=to_layout(h0_kv, layout, torch.bfloat16),
        dht=to_layout(dht_kv, layout, dht_dtype), cu_seqlens=a["cu_seqlens"],
        state_layout=layout)
    for x, r in zip(got[:5], ref[:5]):
        assert torch.equal(x, r)
    assert got[5].dtype == torch.bfloat16
    assert_rounded_once(to_kv(got[5], layout), ref[5], torch.bfloat16, exact=device == "cpu")


# ------------------------------------------------------------------------------- decode


def make_decode(slots, T, hqk, hv, num_slots, device, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    B = len(slots)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    inp = dict(q=randn(B, T, hqk, 128), k=F.normalize(randn(B, T, hqk, 128), dim=-1),
               v=randn(B, T, hv, 128), g=F.logsigmoid(randn(B, T, hv)) / 4,
               beta=torch.sigmoid(randn(B, T, hv)))
    inp = {n: (x.to(dtype) if n in ("q", "k", "v") else x).to(device) for n, x in inp.items()}
    inp["state_indices"] = torch.tensor(slots, dtype=torch.int32, device=device)
    pool = (randn(num_slots, hv, 128, 128) * 0.1).to(device)
    return inp, pool


DECODE_SHAPES = [
    pytest.param([3, -1, 0, 5], 1, 2, 4, id="T1_gva_negative_slot"),
    pytest.param([1, 4], 4, 1, 2, id="T4"),
]


@pytest.mark.parametrize("slots,T,hqk,hv", DECODE_SHAPES)
@pytest.mark.parametrize("layout,dtype", COMBOS, ids=COMBO_IDS)
def test_decode_matches_kv_fp32(layout, dtype, slots, T, hqk, hv, device):
    inp, pool = make_decode(slots, T, hqk, hv, 6, device, seed=21)
    pool_kv = rounded(pool, dtype)
    ref_pool = pool_kv.clone()
    o_ref = flashgdn.fused_recurrent_gated_delta_rule_update(**inp, state_pool=ref_pool,
                                                             use_qk_l2norm_in_kernel=True)
    pool_l = to_layout(pool_kv, layout, dtype)
    before = pool_l.clone()
    o = flashgdn.fused_recurrent_gated_delta_rule_update(**inp, state_pool=pool_l,
                                                         use_qk_l2norm_in_kernel=True,
                                                         state_layout=layout)
    used = [s for s in slots if s >= 0]
    unused = [s for s in range(6) if s not in used]
    assert torch.equal(pool_l[unused], before[unused]), "unused slots must not change"
    skipped = [b for b, s in enumerate(slots) if s < 0]
    assert torch.equal(o[skipped], torch.zeros_like(o[skipped]))
    assert not torch.equal(pool_l[used], before[used]), "the used slots must be updated"
    got_kv = to_kv(pool_l, layout)
    if device == "cpu":  # the same fp32 loop: bit-equal, the pool rounded once per call
        assert torch.equal(o, o_ref)
        assert_rounded_once(got_kv[used], ref_pool[used], dtype, exact=True)
    else:
        e_o = rel_err(o, o_ref.double())
        print(f"rel err o {e_o:.2e}")
        assert e_o < 1e-3
        if layout == "kv" and dtype == torch.float32:
            assert torch.equal(o, o_ref) and torch.equal(got_kv, ref_pool)
        tol = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 5e-4}[dtype]
        e_h = rel_err(got_kv[used].float(), ref_pool[used].double())
        print(f"rel err state {e_h:.2e}")
        assert e_h < tol


def test_decode_bf16_pool_rounds_once_per_call():
    """T = 8 tokens in one call == the fp32 pool after 8 tokens, rounded once (CPU, exact);
    eight calls of one token round eight times and differ."""
    inp, pool = make_decode([0, 2], 8, 1, 2, 3, "cpu", seed=22)
    pool_kv = rounded(pool, torch.bfloat16)
    ref = pool_kv.clone()
    flashgdn.fused_recurrent_gated_delta_rule_update(**inp, state_pool=ref)
    one = to_layout(pool_kv, "vk", torch.bfloat16)
    flashgdn.fused_recurrent_gated_delta_rule_update(**inp, state_pool=one, state_layout="vk")
    assert torch.equal(to_kv(one, "vk"), ref.bfloat16())
    steps = to_layout(pool_kv, "vk", torch.bfloat16)
    for t in range(8):
        step = {n: (x[:, t:t + 1].contiguous() if n != "state_indices" else x)
                for n, x in inp.items()}
        flashgdn.fused_recurrent_gated_delta_rule_update(**step, state_pool=steps,
                                                         state_layout="vk")
    assert not torch.equal(steps, one)
    assert rel_err(to_kv(steps, "vk")[[0, 2]].float(), ref[[0, 2]].double()) < 2e-2


# --------------------------------------------------------------------------- validation


def chunk_args(device="cpu"):
    a = make_inputs(Case("val", [30, 30], 1, 4, varlen=False), device, seed=30)
    return {n: a[n] for n in ("q", "k", "v", "g", "beta", "initial_state")}


def test_bad_layout_string_raises(device):
    a = chunk_args(device)
    for bad in ("KV", "k,v", "", None, 1):
        with pytest.raises(ValueError, match="state_layout must be 'kv' .* or 'vk' .*, got"):
            flashgdn.chunk_gated_delta_rule(**a, state_layout=bad)
    with pytest.raises(ValueError, match="state_layout must be 'kv'"):
        flashgdn.chunk_gated_delta_rule_fwd(**a, state_layout="xy")
    do = torch.zeros_like(a["v"])
    with pytest.raises(ValueError, match="state_layout must be 'kv'"):
        flashgdn.chunk_gated_delta_rule_bwd(**a, do=do, state_layout="xy")
    inp, pool = make_decode([0], 1, 1, 4, 2, device, seed=31)
    before = pool.clone()
    with pytest.raises(ValueError, match="state_layout must be 'kv' .* got 'transposed'"):
        flashgdn.fused_recurrent_gated_delta_rule_update(**inp, state_pool=pool,
                                                         state_layout="transposed")
    assert torch.equal(pool, before)


def test_bad_layout_code_in_c_api_raises(device):
    """The C API checks the numeric layout itself (callers that bypass Python)."""
    a = chunk_args(device)
    o = torch.empty_like(a["v"])
    with pytest.raises(ValueError, match="state_layout must be FLASHGDN_STATE_LAYOUT_KV \\(0"
                                         ".*FLASHGDN_STATE_LAYOUT_VK \\(1.*got 2"):
        _C.fwd_workspace_size(a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"],
                              None, 0.1, o, None, state_layout=2)
    inp, pool = make_decode([0], 1, 1, 4, 2, device, seed=32)
    with pytest.raises(ValueError, match="state_layout must be FLASHGDN_STATE_LAYOUT_KV.*got -1"):
        _C.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool,
                  inp["state_indices"], 0.1, False, torch.empty_like(inp["v"]), 0,
                  state_layout=-1)


@pytest.mark.parametrize("layout,dims", [("kv", "N sequences, H_v, K, V; state_layout 'kv'"),
                                         ("vk", "N sequences, H_v, V, K; state_layout 'vk'")])
def test_bad_state_shape_message_names_layout(layout, dims, device):
    a = chunk_args(device)
    bad = a["initial_state"][..., :64].contiguous()
    with pytest.raises(ValueError, match=(r"initial_state must have shape \[2, 4, 128, 128\] \("
                                          + dims.replace("(", r"\(") + r"\), got "
                                          r"\[2, 4, 128, 64\]")):
        flashgdn.chunk_gated_delta_rule(**{**a, "initial_state": bad.to(torch.bfloat16)},
                                        state_layout=layout)
    do = torch.zeros_like(a["v"])
    with pytest.raises(ValueError, match=r"dht must have shape \[2, 4, 128, 128\] \(" + dims):
        flashgdn.chunk_gated_delta_rule_bwd(**a, do=do, dht=bad, state_layout=layout)
    inp, pool = make_decode([0], 1, 1, 4, 2, device, seed=33)
    with pytest.raises(ValueError, match=(r"state_pool must have shape \[2, 4, 128, 128\] "
                                          r"\(num_slots, H_v, "
                                          + ("V, K" if layout == "vk" else "K, V"))):
        flashgdn.fused_recurrent_gated_delta_rule_update(
            **inp, state_pool=pool[..., :64].contiguous(), state_layout=layout)
    with pytest.raises(ValueError, match=r"state_pool must be 4-D \[num_slots, H_v, "
                                         + ("V, K" if layout == "vk" else "K, V")):
        flashgdn.fused_recurrent_gated_delta_rule_update(**inp, state_pool=pool[0],
                                                         state_layout=layout)


def test_bad_state_dtype_raises(device):
    a = chunk_args(device)
    msg = "must have dtype float32 or bfloat16 or float16, got "
    with pytest.raises(ValueError, match="initial_state " + msg + "float64"):
        flashgdn.chunk_gated_delta_rule(**{**a, "initial_state": a["initial_state"].double()},
                                        state_layout="vk")
    with pytest.raises(ValueError, match="final_state_dtype must be torch.float32, "
                                         "torch.bfloat16 or torch.float16, got torch.float64"):
        flashgdn.chunk_gated_delta_rule(**a, output_final_state=True,
                                        final_state_dtype=torch.float64)
    with pytest.raises(ValueError, match="final_state_dtype must be"):
        flashgdn.chunk_gated_delta_rule(**a, output_final_state=True,
                                        final_state_dtype=torch.int32)
    do = torch.zeros_like(a["v"])
    with pytest.raises(ValueError, match="dht " + msg + "float64"):
        flashgdn.chunk_gated_delta_rule_bwd(**a, do=do, dht=a["initial_state"].double())
    inp, pool = make_decode([0], 1, 1, 4, 2, device, seed=34)
    for bad, name in ((pool.double(), "float64"), (pool.to(torch.int32), "int32")):
        with pytest.raises(ValueError, match="state_pool " + msg + name):
            flashgdn.fused_recurrent_gated_delta_rule_update(**inp, state_pool=bad,
                                                             state_layout="vk")


# ---------------------------------------------------------------------- torch integration


def test_opcheck_bf16_vk(device):
    a = make_inputs(Case("oc", [40, 30], 1, 2), device, seed=40)
    for n in ("q", "k", "v", "g", "beta"):
        a[n] = a[n].requires_grad_()
    h0 = to_layout(a["initial_state"], "vk", torch.bfloat16).requires_grad_()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops._fwd_op, (a["q"], a["k"], a["v"], a["g"], a["beta"], 0.1, h0,
                                        a["cu_seqlens"], True, "vk", None), test_utils=utils)
    torch.library.opcheck(ops._fwd_op, (a["q"], a["k"], a["v"], a["g"], a["beta"], 0.1, None,
                                        a["cu_seqlens"], True, "vk", torch.float16),
                          test_utils=utils)
    inp, pool = make_decode([1, -1], 2, 1, 2, 3, device, seed=41)
    torch.library.opcheck(ops._decode_op, (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                           to_layout(pool, "vk", torch.bfloat16),
                                           inp["state_indices"], 0.1, True, "vk"),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_torch_compile_bf16_vk(device):
    a = make_inputs(Case("tc", [100], 2, 4, varlen=False), device, seed=42)

    def f(q, k, v, g, beta, h0):
        o, ht = flashgdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True, state_layout="vk")
        return o.float().square().sum() + ht.float().sum(), ht

    h0 = to_layout(a["initial_state"], "vk", torch.bfloat16)
    leaves = [a[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    leaves.append(h0.requires_grad_())
    eager, ht_e = f(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out, ht_c = compiled(*leaves)
    grads = torch.autograd.grad(out, leaves)
    assert ht_c.dtype == torch.bfloat16 and torch.equal(ht_c, ht_e)
    assert torch.equal(out, eager)
    for x, r in zip(grads, eager_grads):
        assert x.dtype == r.dtype and torch.equal(x, r)
    assert grads[-1].dtype == torch.bfloat16


# ------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("bv", ["8", "16", "32"])
@pytest.mark.parametrize("layout,dtype", COMBOS, ids=COMBO_IDS)
def test_decode_gpu_every_column_block(layout, dtype, bv, monkeypatch):
    """Each column block width of the CUDA decode kernel (FLASHGDN_DECODE_BV) in every
    layout/dtype, with grouped heads, T = 3, permuted and negative slots."""
    slots = [7, -1, 2, 0, 5, -1, 3]
    inp, pool = make_decode(slots, 3, 4, 8, 9, "cuda", seed=50)
    pool_kv = rounded(pool, dtype)
    ref_pool = pool_kv.clone()
    o_ref = flashgdn.fused_recurrent_gated_delta_rule_update(**inp, state_pool=ref_pool,
                                                             use_qk_l2norm_in_kernel=True)
    monkeypatch.setenv("FLASHGDN_DECODE_BV", bv)
    pool_l = to_layout(pool_kv, layout, dtype)
    before = pool_l.clone()
    o = flashgdn.fused_recurrent_gated_delta_rule_update(**inp, state_pool=pool_l,
                                                         use_qk_l2norm_in_kernel=True,
                                                         state_layout=layout)
    used = [s for s in slots if s >= 0]
    unused = [s for s in range(9) if s not in used]
    assert torch.equal(pool_l[unused], before[unused])
    assert torch.equal(o[[1, 5]], torch.zeros_like(o[[1, 5]]))
    e_o = rel_err(o, o_ref.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 5e-4}[dtype]
    e_h = rel_err(to_kv(pool_l, layout)[used].float(), ref_pool[used].double())
    print(f"bv {bv}: rel err o {e_o:.2e} state {e_h:.2e}")
    assert e_o < 1e-3 and e_h < tol


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("layout,dtype", COMBOS, ids=COMBO_IDS)
def test_chunk_gpu_equals_cpu(layout, dtype):
    """CUDA vs CPU on the same non-kv/fp32 states (both through their own conversions)."""
    a = make_inputs(Case("gc", [150, 64, 3], 2, 4), "cpu", seed=51)
    h0 = to_layout(a["initial_state"], layout, dtype)
    common = {n: a[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")}
    o_c, ht_c = flashgdn.chunk_gated_delta_rule(**common, initial_state=h0,
                                                output_final_state=True, state_layout=layout)
    o_g, ht_g = flashgdn.chunk_gated_delta_rule(
        **{n: x.cuda() for n, x in common.items()}, initial_state=h0.cuda(),
        output_final_state=True, state_layout=layout)
    assert ht_g.dtype == dtype
    assert rel_err(o_g.cpu(), o_c.double()) < 4e-3
    # the CUDA forward multiplies on TF32 tensor cores (~4e-4 on the state)
    assert rel_err(to_kv(ht_g, layout).cpu().float(), to_kv(ht_c, layout).double()) < (
        2e-3 if dtype != torch.bfloat16 else 6e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_workspace_grows_only_for_converted_states():
    a = make_inputs(Case("ws", [100, 60], 1, 2), "cuda", seed=52)
    o = torch.empty_like(a["v"])
    h0 = a["initial_state"]
    ht = torch.empty_like(h0)
    args = lambda h, t: (a["q"], a["k"], a["v"], a["g"], a["beta"], h, a["cu_seqlens"], 0.1, o,
                         t)
    base = _C.fwd_workspace_size(*args(h0, ht))
    one = 2 * 2 * 128 * 128 * 4  # N * H_v fp32 [K, V] matrices (a multiple of 256 bytes)
    assert _C.fwd_workspace_size(*args(h0, ht), state_layout=1) == base + 2 * one
    assert _C.fwd_workspace_size(*args(h0.bfloat16(), ht)) == base + one
    assert _C.fwd_workspace_size(*args(h0, ht.half())) == base + one
    assert _C.fwd_workspace_size(*args(None, None), state_layout=1) == _C.fwd_workspace_size(
        *args(None, None))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_decode_cuda_graph_capture_bf16_vk():
    """Captured decode on a bf16 vk pool: new tokens and slots at each replay; the graph
    matches eager calls bit for bit, and eager matches the kv/fp32 path."""
    slots0 = [3, 0, -1, 5]
    static, pool = make_decode(slots0, 2, 2, 8, 8, "cuda", seed=60)
    pool_vk = to_layout(pool, "vk", torch.bfloat16)

    def step():
        return flashgdn.fused_recurrent_gated_delta_rule_update(
            **static, state_pool=pool_vk, use_qk_l2norm_in_kernel=True, state_layout="vk")

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    eager_pool = pool_vk.clone()
    for it, slots in enumerate(([3, 0, -1, 5], [-1, 7, 1, 2], [6, -1, -1, 0])):
        fresh, _ = make_decode(slots, 2, 2, 8, 8, "cuda", seed=70 + it)
        with torch.no_grad():
            for n in ("q", "k", "v", "g", "beta", "state_indices"):
                static[n].copy_(fresh[n])
        kv_pool = to_kv(eager_pool, "vk").float()
        o_kv = flashgdn.fused_recurrent_gated_delta_rule_update(
            **static, state_pool=kv_pool, use_qk_l2norm_in_kernel=True)
        graph.replay()
        expect = flashgdn.fused_recurrent_gated_delta_rule_update(
            **static, state_pool=eager_pool, use_qk_l2norm_in_kernel=True, state_layout="vk")
        torch.cuda.synchronize()
        assert torch.equal(out, expect)
        assert torch.equal(pool_vk, eager_pool)
        used = [x for x in slots if x >= 0]
        assert rel_err(out, o_kv.double()) < 1e-3
        assert rel_err(to_kv(eager_pool, "vk")[used].float(), kv_pool[used].double()) < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_chunk_cuda_graph_capture_bf16_vk():
    """Forward + backward with bf16 vk states under CUDA-graph capture (the boundary
    conversions are plain kernels on the stream): replay == eager."""
    a = make_inputs(Case("cgc", [200, 90, 7], 2, 4), "cuda", seed=61)
    static = {n: a[n].clone() for n in ("q", "k", "v", "g", "beta", "cu_seqlens")}
    static["h0"] = to_layout(a["initial_state"], "vk", torch.bfloat16)
    names = ("q", "k", "v", "g", "beta", "h0")

    def step():
        leaves = {n: static[n].detach().requires_grad_() for n in names}
        o, ht = flashgdn.chunk_gated_delta_rule(
            leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
            initial_state=leaves["h0"], cu_seqlens=static["cu_seqlens"],
            output_final_state=True, state_layout="vk")
        loss = o.float().square().sum() + ht.float().square().sum()
        return (o, ht) + torch.autograd.grad(loss, [leaves[n] for n in names])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    fresh = make_inputs(Case("cgc", [200, 90, 7], 2, 4), "cuda", seed=62)
    with torch.no_grad():
        for n in ("q", "k", "v", "g", "beta"):
            static[n].copy_(fresh[n])
        static["h0"].copy_(to_layout(fresh["initial_state"], "vk", torch.bfloat16))
    graph.replay()
    expect = step()
    torch.cuda.synchronize()
    assert outs[1].dtype == torch.bfloat16 and outs[-1].dtype == torch.bfloat16
    for x, r in zip(outs, expect):
        assert torch.equal(x, r)
