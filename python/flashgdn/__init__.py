"""flashgdn: Gated DeltaNet (GDN) kernels for NVIDIA Hopper, with a CPU fallback.

Drop-in for FLA's / FlashQLA's ``chunk_gated_delta_rule``::

    from flashgdn import chunk_gated_delta_rule
    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                            output_final_state=True, cu_seqlens=cu)

Decode over a state pool (vLLM/SGLang style), updating the states in place::

    o = flashgdn.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, state_pool, slots)

Qwen3-Next gate from raw inputs: ``g, beta = flashgdn.gdn_gating(a, A_log, dt_bias, b)``,
or ``flashgdn.chunk_gated_delta_rule_from_raw(q, k, v, a, b, A_log, dt_bias, ...)``.
"""
from __future__ import annotations

from . import _C
from .ops import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_bwd,
    chunk_gated_delta_rule_from_raw,
    chunk_gated_delta_rule_fwd,
    check_cu_seqlens,
    fused_recurrent_gated_delta_rule_update,
    gdn_gating,
)

__version__: str = _C.version()

#: True when this build contains the CUDA (SM90) backend.
HAS_CUDA: bool = _C.has_cuda()

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_fwd",
    "chunk_gated_delta_rule_bwd",
    "chunk_gated_delta_rule_from_raw",
    "fused_recurrent_gated_delta_rule_update",
    "gdn_gating",
    "check_cu_seqlens",
    "HAS_CUDA",
    "__version__",
]
