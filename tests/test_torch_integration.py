"""torch.library integration: opcheck, torch.compile, CUDA graph capture."""
from __future__ import annotations

import pytest
import torch

import flashgdn
from flashgdn import ops
from conftest import HAS_GPU, NO_GPU_REASON, Case, make_inputs, rel_err


def test_opcheck_forward_and_backward(device):
    a = make_inputs(Case("oc", [40, 30], 1, 2), device)
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        a[n] = a[n].requires_grad_()
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], 0.1, a["initial_state"], a["cu_seqlens"],
            True)
    torch.library.opcheck(ops._fwd_op, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor", "test_aot_dispatch_dynamic"))


def test_direct_call_without_the_dispatcher(device, monkeypatch):
    """A forward that needs no gradient runs the custom op's body directly (ops
    _direct_call_ok: no dispatcher, ~40-80 us a call less on the host) with the dispatcher's
    bits; under a fake-tensor mode, the profiler or with grad-requiring inputs it goes
    through the op, which the profiler then names."""
    a = make_inputs(Case("direct", [70, 130], 1, 2), device)
    kw = dict(initial_state=a["initial_state"], output_final_state=True,
              cu_seqlens=a["cu_seqlens"])
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    via_op = torch.ops.flashgdn.chunk_gdn_fwd(*args, 128 ** -0.5, a["initial_state"],
                                              a["cu_seqlens"], True)
    real_op = ops._fwd_op

    def refuse(*x, **y):
        raise AssertionError("the dispatcher was used")

    monkeypatch.setattr(ops, "_fwd_op", refuse)
    with torch.no_grad():
        o, ht = flashgdn.chunk_gated_delta_rule(*args, **kw)  # the direct call
    assert torch.equal(o, via_op[0]) and torch.equal(ht, via_op[1])
    with pytest.raises(AssertionError, match="dispatcher"):  # the profiler keeps the op
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            flashgdn.chunk_gated_delta_rule(*args, **kw)
    monkeypatch.setattr(ops, "_fwd_op", real_op)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flashgdn.chunk_gated_delta_rule(*args, **kw)
    assert any("flashgdn::chunk_gdn_fwd" in e.name for e in prof.events())
    leaves = [x.clone().requires_grad_() for x in args]  # autograd: through the op
    o2, ht2 = flashgdn.chunk_gated_delta_rule(*leaves, **kw)
    assert o2.grad_fn is not None and torch.equal(o2.detach(), o)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:  # fake tensors: the op's fake implementation
        fake = [mode.from_tensor(x) for x in (*args, a["initial_state"], a["cu_seqlens"])]
        of, hf = flashgdn.chunk_gated_delta_rule(*fake[:5], initial_state=fake[5],
                                                 output_final_state=True, cu_seqlens=fake[6])
    assert of.shape == o.shape and hf.shape == ht.shape


def test_torch_compile_fullgraph(device):
    a = make_inputs(Case("tc", [100], 2, 4, varlen=False), device)

    def f(q, k, v, g, beta, h0):
        o, ht = flashgdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True)
        return o.float().square().sum() + ht.sum()

    leaves = [a[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta",
                                                      "initial_state")]
    eager = f(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*leaves)
    grads = torch.autograd.grad(out, leaves)
    assert rel_err(out, eager) < 1e-6
    for a_, b_ in zip(grads, eager_grads):
        assert rel_err(a_, b_.double()) < 1e-6


def test_torch_compile_fullgraph_with_fla_keywords(device):
    """FLA 0.5's keywords under torch.compile(fullgraph=True): cu_seqlens_cpu (its values
    are not read while compiling: the plan then assumes the worst case, as an eager call
    without it) and transpose_state_layout; the same results as that eager call."""
    a = make_inputs(Case("tck", [70, 130], 2, 4), device)
    cu_cpu = a["cu_seqlens"].cpu()
    h0_vk = a["initial_state"].transpose(-1, -2).contiguous()

    def f(q, k, v, g, beta, h0, hint=True):
        o, ht = flashgdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True,
                                                cu_seqlens=a["cu_seqlens"],
                                                cu_seqlens_cpu=cu_cpu if hint else None,
                                                transpose_state_layout=True)
        return o.float().square().sum() + ht.sum()

    leaves = [x.clone().requires_grad_() for x in (a["q"], a["k"], a["v"], a["g"], a["beta"],
                                                   h0_vk)]
    eager = f(*leaves, hint=False)
    eager_grads = torch.autograd.grad(eager, leaves)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    grads = torch.autograd.grad(out, leaves)
    assert rel_err(out, eager) < 1e-6
    for a_, b_ in zip(grads, eager_grads):
        assert rel_err(a_, b_.double()) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("bwd_cols", [None, "1"], ids=["default", "cols_queue"])
def test_cuda_graph_capture_forward_backward(monkeypatch, bwd_cols):
    """fwd + bwd captured in a CUDA graph, replayed twice on new inputs: equal to eager. With
    FLASHGDN_BWD_COLS=1 the backward runs its 128-column passes and the ready queue (a memset
    and a programmatic dependent launch inside the graph)."""
    if bwd_cols is None:
        monkeypatch.delenv("FLASHGDN_BWD_COLS", raising=False)
    else:
        monkeypatch.setenv("FLASHGDN_BWD_COLS", bwd_cols)
    a = make_inputs(Case("cg", [300, 200, 12], 2, 4, gate="mixed"), "cuda")
    static = {n: (t.clone() if t is not None else None) for n, t in a.items()}
    leaves = {n: static[n].requires_grad_() for n in ("q", "k", "v", "g", "beta",
                                                      "initial_state")}

    def step():
        o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=static["cu_seqlens"],
                                                output_final_state=True)
        loss = o.float().square().sum() + ht.square().sum()
        return (o, ht) + torch.autograd.grad(loss, list(leaves.values()))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    # New inputs copied into the static buffers, replay, compare with eager.
    b = make_inputs(Case("cg", [300, 200, 12], 2, 4, gate="mixed"), "cuda", seed=11)
    with torch.no_grad():
        for n in leaves:
            leaves[n].copy_(b[n])
    graph.replay()
    graph.replay()  # the queue's state is reset by the graph itself
    torch.cuda.synchronize()
    fresh = {n: b[n].clone().requires_grad_() for n in leaves}
    o, ht = flashgdn.chunk_gated_delta_rule(**fresh, cu_seqlens=b["cu_seqlens"],
                                            output_final_state=True)
    loss = o.float().square().sum() + ht.square().sum()
    expect = (o, ht) + torch.autograd.grad(loss, list(fresh.values()))
    for x, y in zip(outs, expect):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_torch_compile_inductor_gpu():
    a = make_inputs(Case("ind", [256], 2, 4, varlen=False), "cuda")

    @torch.compile(fullgraph=True)
    def f(q, k, v, g, beta):
        o, _ = flashgdn.chunk_gated_delta_rule(q, k * 1.0, v, g, beta)
        return o * 2

    out = f(a["q"], a["k"], a["v"], a["g"], a["beta"])
    ref, _ = flashgdn.chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"])
    assert rel_err(out, (ref * 2).double()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)
def test_calls_run_on_the_callers_stream():
    """ops._stream (the raw current stream, one C call) is torch's current stream, on the
    default stream and inside a side stream's context; 0 for CPU tensors."""
    x = torch.zeros(1, device="cuda")
    assert ops._stream(x) == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert ops._stream(x) == side.cuda_stream != torch.cuda.default_stream().cuda_stream
    assert ops._stream(torch.zeros(1)) == 0
