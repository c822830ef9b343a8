"""Decode over a state pool (fused_recurrent_gated_delta_rule_update), on CPU and GPU.

Against the float64 token-by-token reference and against the chunked path (decoding
T tokens from a state == the chunked forward with that initial state), slots permuted
and negative, grouped heads, fp16, T = 1 and T > 1, validation, torch.compile and
CUDA-graph capture.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import pytest
import torch
import torch.nn.functional as F

import flashgdn
from flashgdn import ops
from flashgdn.reference import recurrent_gated_delta_rule_ref
from conftest import HAS_GPU, NO_GPU_REASON, rel_err

O_TOL = 4.3e-3     # bf16/fp16 rounding of o itself, as for the chunked path
STATE_TOL = 1e-5   # fp32 state math over a handful of tokens

@dataclasses.dataclass
class DCase:
    name: str
    slots: List[int]           # slot per sequence (negative: skip)
    T: int
    hqk: int
    hv: int
    num_slots: int = 6
    dtype: torch.dtype = torch.bfloat16
    gate_dtype: torch.dtype = torch.float32
    idx_dtype: torch.dtype = torch.int32


def make_decode_inputs(c: DCase, device: str, seed: int = 0, qk_norm: bool = True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B = len(c.slots)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = randn(B, c.T, c.hqk, 128)
    k = randn(B, c.T, c.hqk, 128)
    if qk_norm:
        k = F.normalize(k, dim=-1)
    v = randn(B, c.T, c.hv, 128)
    g = F.logsigmoid(randn(B, c.T, c.hv)) / 4
    beta = torch.sigmoid(randn(B, c.T, c.hv))
    pool = randn(c.num_slots, c.hv, 128, 128) * 0.1
    return dict(q=q.to(c.dtype).to(device), k=k.to(c.dtype).to(device),
                v=v.to(c.dtype).to(device), g=g.to(c.gate_dtype).to(device),
                beta=beta.to(c.gate_dtype).to(device), state_pool=pool.to(device),
                state_indices=torch.tensor(c.slots, dtype=c.idx_dtype).to(device))


def decode(inp: dict, **kw) -> torch.Tensor:
    return flashgdn.fused_recurrent_gated_delta_rule_update(**inp, **kw)


def check_against(inp: dict, pool_before: torch.Tensor, o: torch.Tensor, ref_fn,
                  o_tol: float = O_TOL, state_tol: float = STATE_TOL) -> None:
    """ref_fn(valid_rows, initial_state) -> (o, final_state) for the valid sequences."""
    slots = inp["state_indices"].tolist()
    valid = [b for b, s in enumerate(slots) if s >= 0]
    skipped = [b for b, s in enumerate(slots) if s < 0]
    pool = inp["state_pool"]
    assert o.shape == inp["v"].shape and o.dtype == inp["v"].dtype
    if skipped:
        assert torch.equal(o[skipped], torch.zeros_like(o[skipped])), "skipped rows must be 0"
    used = [slots[b] for b in valid]
    untouched = [s for s in range(pool.shape[0]) if s not in used]
    assert torch.equal(pool[untouched], pool_before[untouched]), "unused slots must not change"
    if not valid:
        return
    ro, rh = ref_fn(valid, pool_before[used])
    e_o, e_h = rel_err(o[valid], ro), rel_err(pool[used], rh)
    print(f"rel err o {e_o:.2e} state {e_h:.2e}")
    assert e_o < o_tol
    assert e_h < state_tol


def ref_float64(inp: dict, scale: Optional[float] = None):
    def fn(valid, h0):
        return recurrent_gated_delta_rule_ref(*(inp[n][valid] for n in ("q", "k", "v", "g",
                                                                         "beta")),
                                              scale=scale, initial_state=h0)
    return fn


CASES = [
    DCase("T1_one_head", [2], 1, 1, 1),
    DCase("T1_gva_permuted_negative", [4, -1, 0, 5, -7, 1], 1, 2, 8, idx_dtype=torch.int64),
    DCase("T4_gva_permuted", [3, 1, 0], 4, 2, 4),
    DCase("T8_fp16_bf16_gates", [1, -1, 2], 8, 1, 2, dtype=torch.float16,
          gate_dtype=torch.bfloat16),
    DCase("T16_fp16_gates", [0, 3], 16, 2, 2, gate_dtype=torch.float16),
    DCase("T64_max", [1], 64, 1, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decode_matches_reference(case: DCase, device: str):
    inp = make_decode_inputs(case, device)
    before = inp["state_pool"].clone()
    o = decode(inp)
    check_against(inp, before, o, ref_float64(inp))


@pytest.mark.parametrize("T", [1, 3, 8])
def test_decode_equals_chunked_path(T: int, device: str):
    """T tokens decoded from the pool == chunk_gated_delta_rule from that initial state."""
    case = DCase("ch", [5, -1, 2, 0], T, 2, 4)
    inp = make_decode_inputs(case, device, seed=1)
    before = inp["state_pool"].clone()
    o = decode(inp)

    def chunked(valid, h0):
        oc, hc = flashgdn.chunk_gated_delta_rule(
            *(inp[n][valid] for n in ("q", "k", "v", "g", "beta")), initial_state=h0,
            output_final_state=True)
        return oc.double(), hc.double()

    # the CUDA chunked forward multiplies on TF32 tensor cores (~4e-4 on the state)
    check_against(inp, before, o, chunked, o_tol=4e-3,
                  state_tol=2e-3 if device == "cuda" else 1e-5)


def test_decode_token_by_token_equals_one_call(device: str):
    """Four calls of T = 1 carry the state exactly like one call of T = 4."""
    inp = make_decode_inputs(DCase("tb", [1, 3], 4, 1, 2), device, seed=2)
    pool_a = inp["state_pool"].clone()
    o_all = decode(inp)
    outs = []
    for t in range(4):
        step = {n: (x[:, t:t + 1].contiguous() if n in ("q", "k", "v", "g", "beta") else x)
                for n, x in inp.items()}
        outs.append(decode({**step, "state_pool": pool_a}))
    assert rel_err(torch.cat(outs, 1), o_all.double()) < 4e-3
    assert rel_err(pool_a, inp["state_pool"].double()) < 1e-6


def test_decode_l2norm_in_kernel(device: str):
    case = DCase("l2", [2, 0, -1], 3, 2, 4)
    inp = make_decode_inputs(case, device, seed=3, qk_norm=False)
    inp["q"] = (inp["q"].float() * 3).to(inp["q"].dtype)
    before = inp["state_pool"].clone()
    o = decode(inp, use_qk_l2norm_in_kernel=True)

    def l2(x):
        x = x.double()
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)

    normed = {**inp, "q": l2(inp["q"]), "k": l2(inp["k"])}
    check_against(inp, before, o, ref_float64(normed))


def test_decode_scale(device: str):
    inp = make_decode_inputs(DCase("sc", [1], 2, 1, 1), device, seed=4)
    before = inp["state_pool"].clone()
    o = decode(inp, scale=0.3)
    check_against(inp, before, o, ref_float64(inp, scale=0.3))


def test_decode_all_skipped(device: str):
    inp = make_decode_inputs(DCase("sk", [-1, -1], 2, 1, 2), device, seed=5)
    before = inp["state_pool"].clone()
    o = decode(inp)
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.equal(inp["state_pool"], before)


def test_decode_empty_batch(device: str):
    inp = make_decode_inputs(DCase("e", [0], 1, 1, 1), device)
    inp = {n: (x[:0] if n != "state_pool" else x) for n, x in inp.items()}
    before = inp["state_pool"].clone()
    o = decode(inp)
    assert o.shape == (0, 1, 1, 128)
    assert torch.equal(inp["state_pool"], before)


# ----------------------------------------------------------------------------- validation


def base(device: str = "cpu") -> dict:
    return make_decode_inputs(DCase("v", [1, 0], 2, 2, 4, num_slots=3), device)


BAD = [
    ("q_3d", lambda a: {**a, "q": a["q"][0]}, "q must be 4-D"),
    ("q_fp32", lambda a: {**a, "q": a["q"].float()}, "q must have dtype bfloat16 or float16"),
    ("head_dim_64", lambda a: {**a, "q": a["q"][..., :64].contiguous(),
                               "k": a["k"][..., :64].contiguous()}, "head dim K\\) must be 128"),
    ("q_noncontiguous", lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)},
     "q must be contiguous"),
    ("k_dtype", lambda a: {**a, "k": a["k"].half()}, "k must have the dtype of q"),
    ("k_shape", lambda a: {**a, "k": a["k"][:, :1].contiguous()}, "k must have the shape of q"),
    ("v_dtype", lambda a: {**a, "v": a["v"].half()}, "v must have the dtype of q"),
    ("v_tokens", lambda a: {**a, "v": a["v"][:, :1].contiguous()}, "v must have shape"),
    ("heads_not_divisible", lambda a: {**a, "v": a["v"][:, :, :3].contiguous(),
                                       "g": a["g"][..., :3].contiguous(),
                                       "beta": a["beta"][..., :3].contiguous(),
                                       "state_pool": a["state_pool"][:, :3].contiguous()},
     "must be a positive multiple"),
    ("g_shape", lambda a: {**a, "g": a["g"][..., :2].contiguous()}, "g must have shape"),
    ("g_int", lambda a: {**a, "g": a["g"].to(torch.int32)}, "g must have dtype"),
    ("beta_fp64", lambda a: {**a, "beta": a["beta"].double()}, "beta must have dtype"),
    ("too_many_tokens", lambda a: {n: (x.repeat_interleave(33, 1) if n in ("q", "k", "v", "g",
                                                                        "beta") else x)
                                   for n, x in a.items()}, "between 1 and 64 for decode"),
    ("pool_fp64", lambda a: {**a, "state_pool": a["state_pool"].double()},
     "state_pool must have dtype float32 or bfloat16 or float16, got float64"),
    ("pool_3d", lambda a: {**a, "state_pool": a["state_pool"][0]}, "state_pool must be 4-D"),
    ("pool_heads", lambda a: {**a, "state_pool": a["state_pool"][:, :2].contiguous()},
     "state_pool must have shape"),
    ("pool_noncontiguous", lambda a: {**a, "state_pool": a["state_pool"].transpose(2, 3)},
     "state_pool must be contiguous"),
    ("indices_float", lambda a: {**a, "state_indices": a["state_indices"].float()},
     "state_indices must have dtype int32 or int64"),
    ("indices_length", lambda a: {**a, "state_indices": a["state_indices"][:1]},
     "state_indices must have shape \\[2\\]"),
    ("indices_2d", lambda a: {**a, "state_indices": a["state_indices"][None]},
     "state_indices must have shape"),
    ("scale_negative", lambda a: {**a, "scale": -1.0}, "scale must be a positive number"),
]


@pytest.mark.parametrize("name,mutate,msg", BAD, ids=[c[0] for c in BAD])
def test_decode_bad_input_raises(name, mutate, msg, device):
    a = mutate(base(device))
    before = a["state_pool"].clone()
    with pytest.raises(ValueError, match=msg):
        decode(a)
    assert torch.equal(a["state_pool"], before), "a rejected call must not touch the pool"


def test_decode_slot_out_of_range_cpu():
    a = base("cpu")
    a["state_indices"] = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="state_indices\\[1\\] = 3 is out of range"):
        decode(a)


def test_decode_duplicate_slot_cpu():
    a = base("cpu")
    a["state_indices"] = torch.tensor([2, 2], dtype=torch.int64)
    with pytest.raises(ValueError, match="slot 2 for more than one sequence"):
        decode(a)


def test_decode_not_a_tensor():
    a = base("cpu")
    with pytest.raises(TypeError, match="state_indices must be a torch.Tensor"):
        decode({**a, "state_indices": [1, 0]})


# ----------------------------------------------------------------------- torch integration


def test_decode_opcheck(device):
    a = base(device)
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], a["state_pool"], a["state_indices"],
            0.1, False)
    torch.library.opcheck(ops._decode_op, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_decode_direct_call_without_the_dispatcher(device, monkeypatch):
    """Eager decode runs the op's body directly (ops._direct_call_ok), with the op's bits in
    o and the pool; under the profiler it goes through the op, which the profiler names."""
    a = base(device)
    b = {n: (x.clone() if n == "state_pool" else x) for n, x in a.items()}
    o_op = torch.ops.flashgdn.fused_recurrent_gdn_update(
        b["q"], b["k"], b["v"], b["g"], b["beta"], b["state_pool"], b["state_indices"],
        128 ** -0.5, False)
    real_op = ops._decode_op

    def refuse(*x, **y):
        raise AssertionError("the dispatcher was used")

    monkeypatch.setattr(ops, "_decode_op", refuse)
    pool0 = a["state_pool"].clone()
    o = decode(a)  # the direct call
    assert torch.equal(o, o_op) and torch.equal(a["state_pool"], b["state_pool"])
    assert not torch.equal(a["state_pool"], pool0)
    monkeypatch.setattr(ops, "_decode_op", real_op)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode(a)
    assert any("flashgdn::fused_recurrent_gdn_update" in e.name for e in prof.events())


def test_decode_torch_compile_fullgraph(device):
    """Compiled (aot_eager) decode updates the pool like eager: the mutation is declared."""
    a = make_decode_inputs(DCase("tc", [2, -1, 0], 3, 2, 4), device, seed=6)
    pool_eager, pool_comp = a["state_pool"].clone(), a["state_pool"].clone()

    def f(q, k, v, g, beta, pool, idx):
        o = flashgdn.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pool, idx)
        return o.float() * 2

    args = [a[n] for n in ("q", "k", "v", "g", "beta")]
    eager = f(*args, pool_eager, a["state_indices"])
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*args, pool_comp, a["state_indices"])
    assert torch.equal(out, eager)
    assert torch.equal(pool_comp, pool_eager)
    # A second call continues from the updated pool (the state really lives in the pool).
    eager2 = f(*args, pool_eager, a["state_indices"])
    out2 = compiled(*args, pool_comp, a["state_indices"])
    assert torch.equal(out2, eager2) and torch.equal(pool_comp, pool_eager)


# ------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("bv", ["8", "16", "32", None])
@pytest.mark.parametrize("T", [1, 5])
def test_decode_gpu_matches_cpu_backend(bv, T, monkeypatch):
    """Every column-block width of the CUDA kernel (FLASHGDN_DECODE_BV) == the CPU backend."""
    if bv is not None:
        monkeypatch.setenv("FLASHGDN_DECODE_BV", bv)
    case = DCase("gc", [7, -1, 0, 3, 9, 2, -3, 5], T, 2, 8, num_slots=10)
    cpu = make_decode_inputs(case, "cpu", seed=7)
    gpu_in = {n: x.cuda() for n, x in cpu.items()}
    o_c = decode(cpu, use_qk_l2norm_in_kernel=True)
    o_g = decode(gpu_in, use_qk_l2norm_in_kernel=True)
    assert rel_err(o_g.cpu(), o_c) < 4e-3
    assert rel_err(gpu_in["state_pool"].cpu(), cpu["state_pool"].double()) < 1e-5
    skipped = [1, 6]
    assert torch.equal(o_g[skipped], torch.zeros_like(o_g[skipped]))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("B,T,hqk,hv", [(64, 1, 16, 32), (16, 4, 4, 16), (3, 8, 16, 32)])
def test_decode_gpu_large(B, T, hqk, hv):
    gen = torch.Generator().manual_seed(8)
    slots = torch.randperm(2 * B, generator=gen)[:B]
    slots[::5] = -1
    case = DCase("large", slots.tolist(), T, hqk, hv, num_slots=2 * B)
    inp = make_decode_inputs(case, "cuda", seed=8)
    before = inp["state_pool"].clone()
    o = decode(inp)
    check_against(inp, before, o, ref_float64(inp))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_decode_gpu_slot_out_of_range_gives_nan():
    a = base("cuda")
    a["state_indices"] = torch.tensor([1, 3], dtype=torch.int32, device="cuda")
    before = a["state_pool"].clone()
    o = decode(a)
    torch.cuda.synchronize()
    assert torch.isnan(o[1]).all() and torch.isfinite(o[0]).all()
    assert torch.equal(a["state_pool"][[0, 2]], before[[0, 2]])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_decode_gpu_pool_on_other_device_raises():
    a = base("cuda")
    with pytest.raises(ValueError, match="state_pool must be on the same device as q"):
        decode({**a, "state_pool": a["state_pool"].cpu()})
    with pytest.raises(ValueError, match="state_indices must be on the same device as q"):
        decode({**a, "state_indices": a["state_indices"].cpu()})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_decode_cuda_graph_capture():
    """Captured decode: new tokens and new slots (read on the device) at every replay."""
    case = DCase("cg", [3, 0, -1, 5], 2, 2, 8, num_slots=8)
    static = make_decode_inputs(case, "cuda", seed=9)
    pool = static["state_pool"]

    def step():
        return decode(static, use_qk_l2norm_in_kernel=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    eager_pool = pool.clone()
    for it, slots in enumerate(([3, 0, -1, 5], [-1, 7, 1, 2], [6, -1, -1, 0])):
        fresh = make_decode_inputs(case, "cuda", seed=20 + it)
        with torch.no_grad():
            for n in ("q", "k", "v", "g", "beta"):
                static[n].copy_(fresh[n])
            static["state_indices"].copy_(torch.tensor(slots, dtype=torch.int32))
        graph.replay()
        expect = decode({**static, "state_pool": eager_pool}, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
        assert torch.equal(out, expect)
        assert torch.equal(pool, eager_pool)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_decode_torch_compile_inductor_gpu():
    a = make_decode_inputs(DCase("ind", [1, -1, 0], 2, 2, 4), "cuda", seed=10)
    pool_eager = a["state_pool"].clone()

    @torch.compile(fullgraph=True)
    def f(q, k, v, g, beta, pool, idx):
        return flashgdn.fused_recurrent_gated_delta_rule_update(q, k * 1.0, v, g, beta, pool,
                                                                idx) * 2

    args = [a[n] for n in ("q", "k", "v", "g", "beta")]
    out = f(*args, a["state_pool"], a["state_indices"])
    ref = decode({**a, "state_pool": pool_eager}) * 2
    assert rel_err(out, ref.double()) < 1e-2
    assert rel_err(a["state_pool"], pool_eager.double()) < 1e-6
