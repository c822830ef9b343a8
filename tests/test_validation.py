"""Bad input must raise a clear error naming the argument, never crash or hang."""
from __future__ import annotations

import pytest
import torch

import flashgdn
from conftest import HAS_GPU, NO_GPU_REASON, Case, make_inputs


def base(device: str = "cpu", varlen: bool = False):
    case = Case("v", [3, 5] if varlen else [8, 8], 2, 4, varlen=varlen)
    return make_inputs(case, device)


def call(**kw):
    return flashgdn.chunk_gated_delta_rule(**kw, output_final_state=True)


BAD_CASES = [
    ("q_3d", lambda a: {**a, "q": a["q"][0]}, "q must be 4-D"),
    ("q_fp32", lambda a: {**a, "q": a["q"].float()}, "q must have dtype bfloat16 or float16"),
    ("head_dim_64", lambda a: {**a, "q": a["q"][..., :64].contiguous(),
                               "k": a["k"][..., :64].contiguous()}, "head dim K\\) must be 128"),
    ("v_head_dim", lambda a: {**a, "v": a["v"][..., :96].contiguous()}, "head dim V\\) must be 128"),
    ("k_shape", lambda a: {**a, "k": a["k"][:, :4].contiguous()}, "k must have the shape of q"),
    ("k_dtype", lambda a: {**a, "k": a["k"].half()}, "k must have the dtype of q"),
    ("v_dtype", lambda a: {**a, "v": a["v"].half()}, "v must have the dtype of q"),
    ("v_length", lambda a: {**a, "v": a["v"][:, :4].contiguous()}, "v must have shape"),
    ("heads_not_divisible", lambda a: {**a, "v": a["v"][:, :, :3].contiguous(),
                                       "g": a["g"][..., :3].contiguous(),
                                       "beta": a["beta"][..., :3].contiguous()},
     "must be a positive multiple"),
    ("g_shape", lambda a: {**a, "g": a["g"][..., :2].contiguous()}, "g must have shape"),
    ("g_int", lambda a: {**a, "g": a["g"].to(torch.int32)}, "g must have dtype"),
    ("beta_shape", lambda a: {**a, "beta": a["beta"][:, :3].contiguous()}, "beta must have shape"),
    ("beta_fp64", lambda a: {**a, "beta": a["beta"].double()}, "beta must have dtype"),
    ("q_noncontiguous", lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)},
     "q must be contiguous"),
    ("h0_shape", lambda a: {**a, "initial_state": a["initial_state"][:1].contiguous()},
     "initial_state must have shape"),
    ("h0_fp64", lambda a: {**a, "initial_state": a["initial_state"].double()},
     "initial_state must have dtype float32 or bfloat16 or float16, got float64"),
    ("cu_with_batch2", lambda a: {**a, "cu_seqlens": torch.tensor([0, 4, 8], dtype=torch.int32,
                                                                device=a["q"].device)},
     "batch size must be 1"),
]


@pytest.mark.parametrize("name,mutate,msg", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_raises(name, mutate, msg, device):
    with pytest.raises(ValueError, match=msg):
        call(**mutate(base(device)))


VARLEN_BAD = [
    ("cu_float", lambda cu: cu.float(), "cu_seqlens must have dtype int32 or int64"),
    ("cu_2d", lambda cu: cu[None], "cu_seqlens must be 1-D"),
    ("cu_short", lambda cu: cu[:1], "cu_seqlens must be 1-D with N \\+ 1 >= 2"),
]


@pytest.mark.parametrize("name,mutate,msg", VARLEN_BAD, ids=[c[0] for c in VARLEN_BAD])
def test_bad_cu_seqlens_meta(name, mutate, msg, device):
    a = base(device, varlen=True)
    a["initial_state"] = None
    with pytest.raises(ValueError, match=msg):
        call(**{**a, "cu_seqlens": mutate(a["cu_seqlens"])})


CU_VALUES_BAD = [
    ("not_from_zero", [1, 3, 8], "cu_seqlens\\[0\\] must be 0"),
    ("decreasing", [0, 5, 3, 8], "must be non-decreasing"),
    ("past_the_end", [0, 3, 9], "must equal the number of tokens"),
    ("short_of_the_end", [0, 3, 7], "must equal the number of tokens"),
]


@pytest.mark.parametrize("name,values,msg", CU_VALUES_BAD, ids=[c[0] for c in CU_VALUES_BAD])
def test_bad_cu_seqlens_values_cpu(name, values, msg):
    a = base("cpu", varlen=True)
    a["initial_state"] = None
    with pytest.raises(ValueError, match=msg):
        call(**{**a, "cu_seqlens": torch.tensor(values, dtype=torch.int32)})
    with pytest.raises(ValueError, match=msg):
        flashgdn.check_cu_seqlens(torch.tensor(values), a["q"].shape[1])


CU_HOST_BAD = [
    ("without_cu_seqlens", True, torch.tensor([0, 3, 8]), "pass cu_seqlens too"),
    ("float", False, torch.tensor([0.0, 3.0, 8.0]), "cu_seqlens_host must have dtype"),
    ("wrong_length", False, torch.tensor([0, 8]), "cu_seqlens_host must have the shape"),
    ("two_dims", False, torch.tensor([[0, 3, 8]]), "cu_seqlens_host must have the shape"),
    ("strided", False, torch.tensor([0, 0, 3, 0, 8, 0])[::2], "cu_seqlens_host must be contiguous"),
    ("first_not_zero", False, torch.tensor([1, 3, 8]), "cu_seqlens_host\\[0\\] must be 0"),
    ("decreasing", False, torch.tensor([0, 9, 8]), "cu_seqlens_host must be non-decreasing"),
    ("wrong_total", False, torch.tensor([0, 3, 7]),
     "cu_seqlens_host\\[-1\\] must equal the number of tokens"),
]


@pytest.mark.parametrize("name,drop_cu,host,msg", CU_HOST_BAD, ids=[c[0] for c in CU_HOST_BAD])
def test_bad_cu_seqlens_host(name, drop_cu, host, msg):
    """The bindings' host copy of cu_seqlens (what cu_seqlens_cpu is handed on as, a
    planning hint the library reads on the host) is checked by the library itself, forward
    and backward, with errors naming it (Python checks cu_seqlens_cpu before it gets there)."""
    from flashgdn import _C
    from flashgdn.ops import _d
    a = base("cpu", varlen=True)
    o = torch.empty_like(a["v"])
    cu = None if drop_cu else a["cu_seqlens"]
    args = (_d(a["q"]), _d(a["k"]), _d(a["v"]), _d(a["g"]), _d(a["beta"]), None, cu, 1.0, o, None)
    with pytest.raises(ValueError, match=msg):
        _C.fwd_workspace_size(*args, cu_seqlens_host=host)
    bwd_args = (*args[:8], torch.zeros_like(a["v"]), None, torch.empty_like(a["q"]),
                torch.empty_like(a["k"]), torch.empty_like(a["v"]), torch.empty_like(a["g"]),
                torch.empty_like(a["beta"]), None)
    with pytest.raises(ValueError, match=msg):
        _C.bwd_workspace_size(*bwd_args, cu_seqlens_host=host)


def test_cu_seqlens_cpu_gives_the_same_results_on_the_cpu():
    """On the CPU the host copy only reaches the planner's inputs: the same o and state with
    and without it, and the same gradients."""
    a = base("cpu", varlen=True)
    cu_cpu = a["cu_seqlens"].clone()
    o1, h1 = call(**a)
    o2, h2 = call(**a, cu_seqlens_cpu=cu_cpu)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    grads = []
    for extra in ({}, {"cu_seqlens_cpu": cu_cpu}):
        leaves = {n: a[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
        o, ht = call(**{**a, **leaves}, **extra)
        grads.append(torch.autograd.grad(o.float().sum() + ht.sum(), list(leaves.values())))
    for x, y in zip(*grads):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("name,values,msg", CU_VALUES_BAD, ids=[c[0] for c in CU_VALUES_BAD])
def test_bad_cu_seqlens_values_gpu_give_nan_not_garbage(name, values, msg):
    """On the GPU values are checked on the device (no sync): every output becomes NaN."""
    a = base("cuda", varlen=True)
    a["initial_state"] = None
    cu = torch.tensor(values, dtype=torch.int32, device="cuda")
    o, ht = call(**{**a, "cu_seqlens": cu})
    torch.cuda.synchronize()
    assert torch.isnan(o.float()).all() and torch.isnan(ht).all()
    # every gradient too (one poison launch fills all six of the backward's outputs)
    names = ("q", "k", "v", "g", "beta")
    leaves = {n: a[n].clone().requires_grad_() for n in names}
    h0 = torch.zeros(len(values) - 1, *ht.shape[1:], device="cuda", requires_grad=True)
    o, ht = call(**{**a, **leaves, "initial_state": h0, "cu_seqlens": cu})
    grads = torch.autograd.grad(o.float().sum() + ht.sum(), [*leaves.values(), h0])
    for n, d in zip((*names, "h0"), grads):
        assert torch.isnan(d.float()).all(), f"d{n} is not all NaN"
    with pytest.raises(ValueError, match=msg):
        flashgdn.check_cu_seqlens(cu, a["q"].shape[1])


CU_CPU_BAD = [
    ("without_cu_seqlens", lambda a: ({**a, "cu_seqlens": None}, torch.tensor([0, 3, 8])),
     "pass cu_seqlens too"),
    ("on_the_gpu_or_not_cpu", lambda a: (a, torch.tensor([0, 3, 8], device="meta")),
     "cu_seqlens_cpu must be a CPU tensor"),
    ("float", lambda a: (a, torch.tensor([0.0, 3.0, 8.0])), "cu_seqlens_cpu must be int32 or int64"),
    ("wrong_length", lambda a: (a, torch.tensor([0, 8])), "cu_seqlens_cpu must have the shape"),
    ("decreasing", lambda a: (a, torch.tensor([0, 9, 8])), "cu_seqlens_cpu must be non-decreasing"),
    ("wrong_total", lambda a: (a, torch.tensor([0, 3, 7])),
     "cu_seqlens_cpu\\[-1\\] must equal the number of tokens"),
]


@pytest.mark.parametrize("name,mutate,msg", CU_CPU_BAD, ids=[c[0] for c in CU_CPU_BAD])
def test_bad_cu_seqlens_cpu(name, mutate, msg, device):
    """cu_seqlens_cpu (FLA's host copy of cu_seqlens, a planning hint) is checked on the
    host: the errors name it."""
    a = base(device, varlen=True)
    a["initial_state"] = None
    args, cu_cpu = mutate(a)
    with pytest.raises(ValueError, match=msg):
        call(**args, cu_seqlens_cpu=cu_cpu)


def test_max_seqlen_must_not_be_negative():
    """The bindings' planning hint (what cu_seqlens_cpu turns into) is validated by the
    library itself as well."""
    from flashgdn import _C
    from flashgdn.ops import _d
    a = base("cpu", varlen=True)
    o = torch.empty_like(a["v"])
    args = (_d(a["q"]), _d(a["k"]), _d(a["v"]), _d(a["g"]), _d(a["beta"]), None,
            a["cu_seqlens"], 1.0, o, None)
    with pytest.raises(ValueError, match="max_seqlen must be >= 0"):
        _C.fwd_workspace_size(*args, max_seqlen=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_mixed_devices():
    a = base("cuda")
    with pytest.raises(ValueError, match="k must be on the same device as q"):
        call(**{**a, "k": a["k"].cpu()})
    with pytest.raises(ValueError, match="initial_state must be on the same device"):
        call(**{**a, "initial_state": a["initial_state"].cpu()})


def test_non_tensor_and_bad_scale():
    a = base()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        call(**{**a, "q": a["q"].numpy() if False else [1, 2, 3]})
    with pytest.raises(ValueError, match="scale must be a positive number"):
        call(**a, scale=-1.0)


def test_backward_gradient_checks():
    a = base()
    o, _ = call(**a)
    with pytest.raises(ValueError, match="do must have the shape of v"):
        flashgdn.chunk_gated_delta_rule_bwd(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                            o[:, :4].contiguous(),
                                            initial_state=a["initial_state"])
    with pytest.raises(ValueError, match="dht must have shape"):
        flashgdn.chunk_gated_delta_rule_bwd(a["q"], a["k"], a["v"], a["g"], a["beta"], o,
                                            initial_state=a["initial_state"],
                                            dht=torch.zeros(1, 4, 128, 128))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_misaligned_view_is_rejected():
    a = base("cuda")
    n = a["q"].numel()
    storage = torch.empty(n + 8, dtype=a["q"].dtype, device="cuda")
    q = storage[1:1 + n].view(a["q"].shape)
    q.copy_(a["q"])
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned address"):
        call(**{**a, "q": q})
