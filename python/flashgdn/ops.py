"""PyTorch front end: custom ops (autograd, fake/meta kernels, CUDA graphs, torch.compile).

The native core (``flashgdn._C``) takes DLPack tensors and preallocated outputs; this
module allocates outputs and the CUDA workspace with torch's allocator and passes the
current stream, so each call is asynchronous and graph-capturable.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import _C

_HEAD_DIM = 128
_EMPTY_SHAPE = (0,)


# The current CUDA stream of a device as an integer, as inductor's generated code reads it (one
# C call; torch.cuda.current_stream(device).cuda_stream builds a Stream object: 3-7 us a call on
# the H100 machine's host).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(t: Tensor) -> int:
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:
        return _raw_stream(t.device.index)
    return torch.cuda.current_stream(t.device).cuda_stream


def _workspace(nbytes: int, like: Tensor) -> Optional[Tensor]:
    return torch.empty(nbytes, dtype=torch.uint8, device=like.device) if nbytes > 0 else None


def _alloc_on(like: Tensor) -> Callable[[int], Tensor]:
    """The bindings' alloc: a uint8 workspace of nbytes on like's device. _C.fwd / _C.bwd
    size and make it in the one call (no separate *_workspace_size call converting every
    argument again)."""
    device = like.device
    return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device)


def _d(t: Optional[Tensor]) -> Optional[Tensor]:
    """Detached view for DLPack export (which refuses tensors that require grad)."""
    return None if t is None else t.detach()


def _dl(t: Optional[Tensor]) -> object:
    """t (detached) as a DLPack capsule for one binding call: to_dlpack is one C call (~0.7 us)
    where nanobind's import of a tensor goes through Tensor.__dlpack__, a Python method
    (~5.5-7 us), for each of a call's ten-odd arrays. A capsule is consumed by the call that
    takes it: pass it once."""
    return None if t is None else _to_dlpack(t.detach())


def _num_seqs(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> Tuple[int, ...]:
    # [N, H_v, K, V] ("kv") or [N, H_v, V, K] ("vk"): the same shape, as K = V = 128.
    return (_num_seqs(q, cu_seqlens), v.shape[2], _HEAD_DIM, _HEAD_DIM)


# State layouts (the C API's flashgdn_state_layout codes) and state dtypes.
_STATE_LAYOUTS = {"kv": 0, "vk": 1}
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _layout_code(state_layout: str) -> int:
    code = _STATE_LAYOUTS.get(state_layout) if isinstance(state_layout, str) else None
    if code is None:
        raise ValueError("state_layout must be 'kv' (states [..., K, V]) or 'vk' (states "
                         f"[..., V, K]), got {state_layout!r}")
    return code


def _final_state_dtype(initial_state: Optional[Tensor],
                       final_state_dtype: Optional[torch.dtype]) -> torch.dtype:
    """final_state_dtype, else the dtype of initial_state, else float32."""
    if final_state_dtype is None:
        return initial_state.dtype if initial_state is not None else torch.float32
    if final_state_dtype not in _STATE_DTYPES:
        raise ValueError("final_state_dtype must be torch.float32, torch.bfloat16 or "
                         f"torch.float16, got {final_state_dtype!r}")
    return final_state_dtype


# ----------------------------------------------------------------------------- forward op


@torch.library.custom_op("flashgdn::chunk_gdn_fwd", mutates_args=())
def _fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    output_final_state: bool,
    state_layout: str = "kv",
    final_state_dtype: Optional[torch.dtype] = None,
    max_seqlen: int = 0,
    cu_seqlens_host: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    o, ht, _ = _run_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
                        state_layout, final_state_dtype, max_seqlen, cu_seqlens_host, keep=False)
    return o, ht


def _run_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
             state_layout, final_state_dtype, max_seqlen, cu_seqlens_host, keep: bool):
    layout = _layout_code(state_layout)
    ht_dtype = _final_state_dtype(initial_state, final_state_dtype)
    o = torch.empty_like(v)
    ht = (
        torch.empty(_state_shape(q, v, cu_seqlens), dtype=ht_dtype, device=q.device)
        if output_final_state
        else None
    )
    args = (_dl(q), _dl(k), _dl(v), _dl(g), _dl(beta), _dl(initial_state), _dl(cu_seqlens),
            scale, _dl(o), _dl(ht))
    ws = _C.fwd(*args, None, _stream(q), state_layout=layout, max_seqlen=max_seqlen,
                keep_for_backward=keep, cu_seqlens_host=_dl(cu_seqlens_host),
                alloc=_alloc_on(q))
    if ht is None:
        ht = q.new_empty(_EMPTY_SHAPE, dtype=ht_dtype)
    if ws is None:
        ws = q.new_empty(_EMPTY_SHAPE, dtype=torch.uint8)
    return o, ht, ws


@_fwd_op.register_fake
def _fwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
              state_layout="kv", final_state_dtype=None, max_seqlen=0, cu_seqlens_host=None):
    _layout_code(state_layout)
    ht_dtype = _final_state_dtype(initial_state, final_state_dtype)
    o = torch.empty_like(v)
    shape = _state_shape(q, v, cu_seqlens) if output_final_state else _EMPTY_SHAPE
    return o, q.new_empty(shape, dtype=ht_dtype)


# ------------------------------------------------- forward that keeps its records (training)


@torch.library.custom_op("flashgdn::chunk_gdn_fwd_kept", mutates_args=())
def _fwd_kept_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    output_final_state: bool,
    state_layout: str = "kv",
    final_state_dtype: Optional[torch.dtype] = None,
    max_seqlen: int = 0,
    cu_seqlens_host: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """_fwd_op that also returns the kept workspace (uint8; empty on the CPU): what the
    backward would recompute, which _bwd_kept_op reads instead."""
    return _run_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
                    state_layout, final_state_dtype, max_seqlen, cu_seqlens_host, keep=True)


@_fwd_kept_op.register_fake
def _fwd_kept_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
                   state_layout="kv", final_state_dtype=None, max_seqlen=0,
                   cu_seqlens_host=None):
    o, ht = _fwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
                      state_layout, final_state_dtype, max_seqlen)
    nbytes = torch.library.get_ctx().new_dynamic_size()
    return o, ht, q.new_empty((nbytes,), dtype=torch.uint8)


# ---------------------------------------------------------------------------- backward op


@torch.library.custom_op("flashgdn::chunk_gdn_bwd", mutates_args=())
def _bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    do: Tensor,
    dht: Optional[Tensor],
    state_layout: str = "kv",
    max_seqlen: int = 0,
    cu_seqlens_host: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _run_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, state_layout,
                    max_seqlen, None, cu_seqlens_host)


def _run_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, state_layout,
             max_seqlen, kept: Optional[Tensor], cu_seqlens_host: Optional[Tensor]):
    layout = _layout_code(state_layout)
    if kept is not None and kept.numel() == 0:  # the CPU keeps nothing
        kept = None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
    dh0 = torch.empty_like(initial_state) if initial_state is not None else None
    args = (
        _dl(q), _dl(k), _dl(v), _dl(g), _dl(beta), _dl(initial_state), _dl(cu_seqlens), scale,
        _dl(_d(do).contiguous()), None if dht is None else _dl(_d(dht).contiguous()),
        _dl(dq), _dl(dk), _dl(dv), _dl(dg), _dl(dbeta), _dl(dh0),
    )
    _C.bwd(*args, None, _stream(q), state_layout=layout, max_seqlen=max_seqlen,
           kept_workspace=_dl(kept), cu_seqlens_host=_dl(cu_seqlens_host),
           alloc=_alloc_on(q))
    if dh0 is None:
        dh0 = q.new_empty(_EMPTY_SHAPE, dtype=torch.float32)
    return dq, dk, dv, dg, dbeta, dh0


@_bwd_op.register_fake
def _bwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, state_layout="kv",
              max_seqlen=0, cu_seqlens_host=None):
    _layout_code(state_layout)
    dh0 = torch.empty_like(initial_state) if initial_state is not None else q.new_empty(
        _EMPTY_SHAPE, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


@torch.library.custom_op("flashgdn::chunk_gdn_bwd_kept", mutates_args=())
def _bwd_kept_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    do: Tensor,
    dht: Optional[Tensor],
    kept: Tensor,
    state_layout: str = "kv",
    max_seqlen: int = 0,
    cu_seqlens_host: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """_bwd_op on the workspace _fwd_kept_op kept for these inputs (read, not written)."""
    return _run_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, state_layout,
                    max_seqlen, kept, cu_seqlens_host)


@_bwd_kept_op.register_fake
def _bwd_kept_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, kept,
                   state_layout="kv", max_seqlen=0, cu_seqlens_host=None):
    return _bwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, state_layout,
                     max_seqlen)


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, state_layout,
     _final_state_dtype_arg, max_seqlen, cu_seqlens_host) = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.state_layout = state_layout
    ctx.max_seqlen = max_seqlen
    ctx.cu_seqlens_host = cu_seqlens_host  # a host tensor, not versioned by autograd


def _input_grads(ctx, do, dht, kept: Optional[Tensor]):
    """The forward op's input gradients: _bwd_op, or _bwd_kept_op on the kept workspace."""
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if not ctx.output_final_state or dht is None or dht.numel() == 0:
        dht = None
    # dht comes in the final state's dtype and layout; dh0 has initial_state's.
    args = (q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do, dht)
    if kept is None:
        dq, dk, dv, dg, dbeta, dh0 = _bwd_op(*args, ctx.state_layout, ctx.max_seqlen,
                                             ctx.cu_seqlens_host)
    else:
        dq, dk, dv, dg, dbeta, dh0 = _bwd_kept_op(*args, kept, ctx.state_layout, ctx.max_seqlen,
                                                  ctx.cu_seqlens_host)
    return (dq, dk, dv, dg, dbeta, None, (dh0 if initial_state is not None else None), None, None,
            None, None, None, None)


def _backward(ctx, do, dht):
    return _input_grads(ctx, do, dht, None)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _kept_setup_context(ctx, inputs, output):
    _setup_context(ctx, inputs, output)
    ctx.kept = output[2]  # read only by the backward; not an input, so not saved by version
    ctx.mark_non_differentiable(output[2])
    # no zero "gradient" of the kept workspace (a fill of its whole size, ~0.5 ms at 32
    # value heads x 32k tokens): absent gradients arrive as None (handled below)
    ctx.set_materialize_grads(False)


def _kept_backward(ctx, do, dht, _dws):
    return _input_grads(ctx, do, dht, ctx.kept)


_fwd_kept_op.register_autograd(_kept_backward, setup_context=_kept_setup_context)


# ------------------------------------------------------------------------------ decode op


@torch.library.custom_op("flashgdn::fused_recurrent_gdn_update", mutates_args=("state_pool",))
def _decode_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    state_layout: str = "kv",
) -> Tensor:
    return _run_decode(q, k, v, g, beta, state_pool, state_indices, scale,
                       use_qk_l2norm_in_kernel, state_layout)


def _run_decode(q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm_in_kernel,
                state_layout):
    layout = _layout_code(state_layout)
    o = torch.empty_like(v)
    _C.decode(_dl(q), _dl(k), _dl(v), _dl(g), _dl(beta), _dl(state_pool), _dl(state_indices),
              scale, use_qk_l2norm_in_kernel, _dl(o), _stream(q), state_layout=layout)
    return o


@_decode_op.register_fake
def _decode_fake(q, k, v, g, beta, state_pool, state_indices, scale, use_qk_l2norm_in_kernel,
                 state_layout="kv"):
    _layout_code(state_layout)
    return torch.empty_like(v)


# ------------------------------------------------------------------------------- gate ops


def _gate_out_dtype(*xs: Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


@torch.library.custom_op("flashgdn::gdn_gating_fwd", mutates_args=())
def _gating_fwd_op(a: Tensor, A_log: Tensor, dt_bias: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    dt = _gate_out_dtype(a, A_log, dt_bias, b)
    g = torch.empty(a.shape, dtype=dt, device=a.device)
    beta = torch.empty(a.shape, dtype=dt, device=a.device)
    _C.gating_fwd(_dl(a), _dl(A_log), _dl(dt_bias), _dl(b), _dl(g), _dl(beta), _stream(a))
    return g, beta


@_gating_fwd_op.register_fake
def _gating_fwd_fake(a, A_log, dt_bias, b):
    dt = _gate_out_dtype(a, A_log, dt_bias, b)
    return a.new_empty(a.shape, dtype=dt), a.new_empty(a.shape, dtype=dt)


@torch.library.custom_op("flashgdn::gdn_gating_bwd", mutates_args=())
def _gating_bwd_op(
    a: Tensor, A_log: Tensor, dt_bias: Tensor, b: Tensor, dg: Tensor, dbeta: Tensor
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    da, dA_log = torch.empty_like(a), torch.empty_like(A_log)
    ddt_bias, db = torch.empty_like(dt_bias), torch.empty_like(b)
    args = (_d(a), _d(A_log), _d(dt_bias), _d(b), _d(dg).contiguous(), _d(dbeta).contiguous(),
            da, dA_log, ddt_bias, db)
    ws = _workspace(_C.gating_bwd_workspace_size(*args), a)
    _C.gating_bwd(*args, ws, _stream(a))
    return da, dA_log, ddt_bias, db


@_gating_bwd_op.register_fake
def _gating_bwd_fake(a, A_log, dt_bias, b, dg, dbeta):
    return (torch.empty_like(a), torch.empty_like(A_log), torch.empty_like(dt_bias),
            torch.empty_like(b))


def _gating_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gating_backward(ctx, dg, dbeta):
    a, A_log, dt_bias, b = ctx.saved_tensors
    dt = _gate_out_dtype(a, A_log, dt_bias, b)
    if dg is None:
        dg = torch.zeros(a.shape, dtype=dt, device=a.device)
    if dbeta is None:
        dbeta = torch.zeros(a.shape, dtype=dt, device=a.device)
    return _gating_bwd_op(a, A_log, dt_bias, b, dg, dbeta)


_gating_fwd_op.register_autograd(_gating_backward, setup_context=_gating_setup_context)


# ------------------------------------------------------------------------------ public API


def _require_tensor(name: str, x: object, optional: bool = False) -> None:
    if x is None and optional:
        return
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _resolve_scale(scale: Optional[float]) -> float:
    if scale is None:
        return _HEAD_DIM ** -0.5
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    return float(scale)


def _fla_keywords(g: Tensor, state_layout: str, transpose_state_layout: Optional[bool],
                  use_gate_in_kernel: bool, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
                  cp_context: object) -> Tuple[str, Tensor]:
    """FLA 0.5's keywords of chunk_gated_delta_rule in flashgdn's terms: (state_layout, g)."""
    if cp_context is not None:
        raise NotImplementedError("cp_context (FLA's multi-GPU context parallelism) is not "
                                  "supported; flashgdn splits long sequences within the GPU "
                                  "by itself, pass cp_context=None")
    if transpose_state_layout is not None:
        want = "vk" if transpose_state_layout else "kv"
        if state_layout not in ("kv", want):
            raise ValueError(f"transpose_state_layout={transpose_state_layout} contradicts "
                             f"state_layout={state_layout!r}; pass one of them")
        state_layout = want
    if use_gate_in_kernel:
        _require_tensor("g", g)
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log ([H_v]): g is then the raw "
                             "gate input of g = -exp(A_log) * softplus(g + dt_bias)")
        _require_tensor("A_log", A_log)
        _require_tensor("dt_bias", dt_bias, optional=True)
        if dt_bias is None:
            dt_bias = torch.zeros_like(A_log)
        g, _ = gdn_gating(g, A_log, dt_bias, torch.zeros_like(g))
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are read only with use_gate_in_kernel=True")
    return state_layout, g


def _host_cu(q: Tensor, cu_seqlens: Optional[Tensor],
             cu_seqlens_cpu: Optional[Tensor]) -> Optional[Tensor]:
    """The host copy of cu_seqlens handed to the planner, checked (None without one).

    Checked on the host: a CPU tensor of cu_seqlens' shape and an integer dtype, with valid
    offsets for the q's tokens (no device sync: cu_seqlens itself is not read). The library
    takes the longest sequence from it (the max_seqlen hint) and makes the choice the device
    would make from cu_seqlens on the host instead (no planning kernel beside the others).
    None while torch.compile traces: reading values is data-dependent for the compiler, so
    the plan assumes the worst case there (fullgraph=True keeps working).
    """
    if cu_seqlens_cpu is None or torch.compiler.is_compiling():
        return None
    _require_tensor("cu_seqlens_cpu", cu_seqlens_cpu)
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens; pass cu_seqlens too")
    if cu_seqlens_cpu.device.type != "cpu":
        raise ValueError("cu_seqlens_cpu must be a CPU tensor (the host copy of cu_seqlens), got "
                         f"device {cu_seqlens_cpu.device}")
    if cu_seqlens_cpu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens_cpu must be int32 or int64, got {cu_seqlens_cpu.dtype}")
    if tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape):
        raise ValueError(f"cu_seqlens_cpu must have the shape of cu_seqlens "
                         f"{tuple(cu_seqlens.shape)}, got {tuple(cu_seqlens_cpu.shape)}")
    total = q.shape[0] * q.shape[1] if q.ndim >= 2 else 0
    check_cu_seqlens(cu_seqlens_cpu, total, name="cu_seqlens_cpu")
    return cu_seqlens_cpu.contiguous()


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_layout: str = "kv",
    final_state_dtype: Optional[torch.dtype] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
    transpose_state_layout: Optional[bool] = None,
    use_gate_in_kernel: bool = False,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    cp_context: object = None,
    keep_for_backward: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Gated DeltaNet over chunks of 64 tokens (forward; differentiable).

    Per value head, with state S (K x V): S = exp(g_t) S; u = beta_t (v_t - S^T k_t);
    S = S + k_t u^T; o_t = scale S^T q_t.

    Args:
        q, k: [B, T, H_qk, 128], bf16 or fp16.
        v: [B, T, H_v, 128], dtype of q; H_v a multiple of H_qk (grouped heads).
        g: [B, T, H_v] log-decay (<= 0), fp32/bf16/fp16.
        beta: [B, T, H_v], fp32/bf16/fp16.
        scale: defaults to 128 ** -0.5.
        initial_state: [N, H_v, 128, 128], N = B (or number of sequences); fp32, bf16 or
            fp16, in ``state_layout``. Its gradient dh0 has its dtype and layout.
        output_final_state: also return the final states [N, H_v, 128, 128].
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (then B == 1).
        use_qk_l2norm_in_kernel: l2-normalise q and k over the head dim first.
        state_layout: "kv" (default; states [N, H_v, K, V], as FLA) or "vk" (the
            transpose [N, H_v, V, K], as vLLM's state pools).
        final_state_dtype: dtype of the final state (fp32, bf16 or fp16); default: that
            of initial_state if given, else fp32. The math is fp32 in every case.
        cu_seqlens_cpu: optional host copy of cu_seqlens (as FLA takes it), int32/int64 on
            the CPU. It is read on the host (no device sync): the context-parallel planner
            plans for the longest sequence instead of the worst case (one sequence holding
            every token; e.g. no split launches at all for many short sequences) and makes
            the choice it would make on the device from cu_seqlens on the host instead.
            Every plan is valid for any lengths, so a copy that differs from cu_seqlens
            costs speed, never correctness. Not read under torch.compile.
        transpose_state_layout, use_gate_in_kernel, A_log, dt_bias: FLA 0.5's keywords,
            for dropping in: transpose_state_layout=True is state_layout="vk";
            use_gate_in_kernel=True takes g as the raw gate input and forms
            g = -exp(A_log) * softplus(g + dt_bias) first (A_log [H_v] required, dt_bias
            [H_v] optional; the fused gate kernel, differentiable in A_log and dt_bias).
        cp_context: FLA's multi-GPU context parallelism: not supported (must be None);
            flashgdn splits long sequences within the GPU by itself.
        keep_for_backward: trade memory for backward time (CUDA, when a gradient is
            needed). The backward normally recomputes the state entering every chunk (a
            second run of the forward's pass); with True the forward writes those records
            instead and holds them until the backward (about 3x the bytes of q, k and v
            together: ~1.5 GB at 32 value heads x 32768 tokens), which then skips the
            recomputation. Same gradients, bit for bit.

    Returns:
        (o [B, T, H_v, 128] in the dtype of v, final_state or None).
    """
    state_layout, g = _fla_keywords(g, state_layout, transpose_state_layout, use_gate_in_kernel,
                                    A_log, dt_bias, cp_context)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_tensor(name, x)
    _require_tensor("initial_state", initial_state, optional=True)
    _require_tensor("cu_seqlens", cu_seqlens, optional=True)
    _layout_code(state_layout)
    _final_state_dtype(initial_state, final_state_dtype)
    host_cu = _host_cu(q, cu_seqlens, cu_seqlens_cpu)  # gives max_seqlen in the library
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    args = (q, k, v, g, beta, _resolve_scale(scale), initial_state, cu_seqlens,
            bool(output_final_state), state_layout, final_state_dtype, 0, host_cu)
    grads = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    if keep_for_backward and grads and q.is_cuda:
        o, ht, _ = _fwd_kept_op(*args)
    elif not grads and _direct_call_ok(args):
        o, ht, _ = _run_fwd(*args, keep=False)  # _fwd_op's body, without the dispatcher
    else:
        o, ht = _fwd_op(*args)
    return o, (ht if output_final_state else None)


def _direct_call_ok(args: Tuple[object, ...]) -> bool:
    """Whether a call that needs no gradient may run its op's body directly rather than
    through the dispatcher (~40-80 us a call on the H100 machine's host, docs/benchmarks.md
    session 51): only with plain tensors (no subclass: FakeTensor, DTensor, ...) and nothing
    that interposes on the op: no torch.compile / export tracing, no torch dispatch or
    function mode (FakeTensorMode, FlopCounterMode, torch.device(...)), no torch.jit trace, no
    functorch transform (vmap, grad), no profiler (which then names the op). Where torch lacks
    one of these checks, the dispatcher."""
    c = torch._C
    try:
        if (torch.compiler.is_compiling() or c._get_tracing_state() is not None or
                c._len_torch_dispatch_stack() > 0 or
                c._is_torch_function_mode_enabled() or c._are_functorch_transforms_active() or
                torch.autograd._profiler_enabled()):
            return False
    except AttributeError:
        return False
    return all(type(a) is Tensor for a in args if isinstance(a, Tensor))


def chunk_gated_delta_rule_from_raw(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_layout: str = "kv",
    final_state_dtype: Optional[torch.dtype] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
    keep_for_backward: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """chunk_gated_delta_rule from a Qwen3-Next layer's raw gate inputs (differentiable).

    Computes ``g, beta = gdn_gating(a, A_log, dt_bias, b)`` (fp32), i.e.
    g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), then runs
    :func:`chunk_gated_delta_rule`. Gradients flow to a, b, A_log and dt_bias.

    Args:
        a, b: [B, T, H_v] gate and beta logits (fp32, bf16 or fp16).
        A_log, dt_bias: [H_v] per-head parameters (fp32, bf16 or fp16).
        Everything else as for :func:`chunk_gated_delta_rule`.
    """
    g, beta = gdn_gating(a, A_log, dt_bias, b)
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  state_layout=state_layout, final_state_dtype=final_state_dtype,
                                  cu_seqlens_cpu=cu_seqlens_cpu,
                                  keep_for_backward=keep_for_backward)


def gdn_gating(a: Tensor, A_log: Tensor, dt_bias: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    """Qwen3-Next gate: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.

    One elementwise kernel (CPU or CUDA), differentiable: gradients for a, A_log, dt_bias
    and b (the per-head sums for A_log and dt_bias are deterministic).

    Args:
        a, b: [..., H_v] (same shape), fp32, bf16, fp16 or fp64.
        A_log, dt_bias: [H_v], fp32, bf16, fp16 or fp64.

    Returns:
        (g, beta), each of the shape of a, float32 (float64 when an input is float64).
    """
    for name, x in (("a", a), ("A_log", A_log), ("dt_bias", dt_bias), ("b", b)):
        _require_tensor(name, x)
    return _gating_fwd_op(a, A_log, dt_bias, b)


def fused_recurrent_gated_delta_rule_update(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_indices: Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_layout: str = "kv",
) -> Tensor:
    """Decode: the recurrence for a few tokens per sequence, states updated in place.

    Sequence b reads its state from ``state_pool[state_indices[b]]``, runs its T tokens
    token by token (same operator as :func:`chunk_gated_delta_rule`) and writes the state
    back there. A negative slot skips the sequence: its output is zero and no state is
    touched (padding of CUDA-graph batches). Slots are read on the device: no host sync,
    CUDA-graph capturable. Inference only (no autograd).

    Args:
        q, k: [B, T, H_qk, 128], bf16 or fp16; T from 1 to 64 (e.g. 1 for decode, a few
            for speculative verification).
        v: [B, T, H_v, 128], dtype of q; H_v a multiple of H_qk.
        g, beta: [B, T, H_v], fp32/bf16/fp16.
        state_pool: [num_slots, H_v, 128, 128] fp32, bf16 or fp16, in ``state_layout``,
            updated in place (read and written natively; a 16-bit pool is widened to fp32
            once and rounded once per call).
        state_indices: [B] int32/int64 slot per sequence (negative: skip). Slots must be
            distinct; an out-of-range slot raises on the CPU and gives NaN output (pool
            untouched) on CUDA.
        scale: defaults to 128 ** -0.5.
        use_qk_l2norm_in_kernel: l2-normalise q and k over the head dim first (in fp32).
        state_layout: "kv" (default; [num_slots, H_v, K, V]) or "vk" ([num_slots, H_v, V, K],
            vLLM's layout).

    Returns:
        o: [B, T, H_v, 128] in the dtype of v.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                    ("state_pool", state_pool), ("state_indices", state_indices)):
        _require_tensor(name, x)
    _layout_code(state_layout)
    args = (q, k, v, g, beta, state_pool, state_indices, _resolve_scale(scale),
            bool(use_qk_l2norm_in_kernel), state_layout)
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta))
    if not grads and _direct_call_ok(args):
        return _run_decode(*args)  # _decode_op's body, without the dispatcher
    return _decode_op(*args)


def chunk_gated_delta_rule_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    state_layout: str = "kv",
    final_state_dtype: Optional[torch.dtype] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Forward only, no autograd graph: returns (o, final_state or None).

    state_layout, final_state_dtype and cu_seqlens_cpu as for :func:`chunk_gated_delta_rule`.
    """
    _layout_code(state_layout)
    _final_state_dtype(initial_state, final_state_dtype)
    host_cu = _host_cu(q, cu_seqlens, cu_seqlens_cpu)
    with torch.no_grad():
        o, ht = _fwd_op(q, k, v, g, beta, _resolve_scale(scale), initial_state, cu_seqlens,
                        bool(output_final_state), state_layout, final_state_dtype, 0, host_cu)
    return o, (ht if output_final_state else None)


def chunk_gated_delta_rule_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    do: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    dht: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    state_layout: str = "kv",
    cu_seqlens_cpu: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Backward: gradients (dq, dk, dv, dg, dbeta, dh0 or None) given do (and dht).

    initial_state, dht and dh0 are in ``state_layout``; dht may have any state dtype
    (fp32/bf16/fp16), dh0 has the dtype of initial_state; cu_seqlens_cpu as for
    :func:`chunk_gated_delta_rule`.
    """
    _layout_code(state_layout)
    host_cu = _host_cu(q, cu_seqlens, cu_seqlens_cpu)
    with torch.no_grad():
        dq, dk, dv, dg, dbeta, dh0 = _bwd_op(q, k, v, g, beta, _resolve_scale(scale),
                                             initial_state, cu_seqlens, do, dht, state_layout,
                                             0, host_cu)
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None)


# Host copies of up to this many offsets are checked as a Python list (cu_seqlens_cpu on every
# call). The 2-core CPU machine, us a check, list / tensor ops: 3 offsets 3.8 / 41, 65 8.2 / 36,
# 257 24 / 39, 1025 115 / 40; the list's loop grows with the offsets, the tensor ops do not.
_LIST_CHECK_MAX = 256


def _check_cu_list(cu: List[int], total_tokens: int, name: str) -> None:
    """check_cu_seqlens's checks, with its messages, on the offsets as a list."""
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(f"{name} must be non-decreasing; {name}[{i}] = {cu[i]} "
                             f"< {name}[{i - 1}] = {cu[i - 1]}")
    if cu[-1] != total_tokens:
        raise ValueError(f"{name}[-1] must equal the number of tokens T = {total_tokens}, "
                         f"got {cu[-1]}")


def check_cu_seqlens(cu_seqlens: Tensor, total_tokens: int, name: str = "cu_seqlens") -> None:
    """Validates cu_seqlens values on the host (synchronises; for debugging, not the hot path).

    The kernels check cu_seqlens on the device without a sync and write NaN to every output
    when it is invalid; this helper raises a ValueError that says what is wrong (naming the
    argument `name`).
    """
    if cu_seqlens.device.type == "cpu" and cu_seqlens.ndim == 1 and \
            2 <= cu_seqlens.numel() <= _LIST_CHECK_MAX:
        _check_cu_list(cu_seqlens.tolist(), total_tokens, name)
        return
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu.ndim != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries, got {tuple(cu.shape)}")
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    bad = torch.nonzero(cu[1:] < cu[:-1])
    if bad.numel():
        i = int(bad[0]) + 1
        raise ValueError(f"{name} must be non-decreasing; {name}[{i}] = {int(cu[i])} "
                         f"< {name}[{i - 1}] = {int(cu[i - 1])}")
    if int(cu[-1]) != total_tokens:
        raise ValueError(f"{name}[-1] must equal the number of tokens T = {total_tokens}, "
                         f"got {int(cu[-1])}")
