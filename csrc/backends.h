// Entry points of the backends. The C API (flashgdn.cpp) validates the call, builds
// a Problem and dispatches here by device.
#pragma once

#include <cstddef>

#include "problem.h"

namespace flashgdn {

// CPU backend (cpu_backend.cpp): same chunked algorithm, fp32 arithmetic, threads.
void cpu_fwd(const Problem& p, const FwdOutputs& out);
void cpu_bwd(const Problem& p, const BwdIO& io);
void cpu_decode(const DecodeProblem& p);
void cpu_gating_fwd(const GatingProblem& p);
void cpu_gating_bwd(const GatingProblem& p);

#ifdef FLASHGDN_WITH_CUDA
// CUDA backend (cuda/launch.cu): kernels for SM90, asynchronous on `stream`.
// p.keep_for_backward: the forward's workspace is what the backward would recompute
// (records, T, P, U: the backward's "kept" part); the backward reads it from io.kept, and
// `kept` sizes the backward's own part only.
size_t cuda_fwd_workspace_bytes(const Problem& p);
size_t cuda_bwd_workspace_bytes(const Problem& p, bool kept = false);
void cuda_fwd(const Problem& p, const FwdOutputs& out, void* workspace, void* stream);
void cuda_bwd(const Problem& p, const BwdIO& io, void* workspace, void* stream);
// State boundary (cuda/state_io.cu): the entry points the C API calls. They convert
// states that are not fp32 [K, V] (bf16/fp16, or the VK layout) through fp32 [K, V]
// buffers placed after the kernels' workspace, around cuda_fwd / cuda_bwd.
size_t cuda_fwd_total_workspace_bytes(const Problem& p, const FwdOutputs& out);
size_t cuda_bwd_total_workspace_bytes(const Problem& p, const BwdIO& io);
// The kept part of a keep_for_backward forward's workspace (its start): what
// flashgdn_bwd's kept_workspace must hold.
size_t cuda_kept_workspace_bytes(const Problem& p);
void cuda_fwd_states(const Problem& p, const FwdOutputs& out, void* workspace, void* stream);
void cuda_bwd_states(const Problem& p, const BwdIO& io, void* workspace, void* stream);
// Decode (cuda/decode.cu): one recurrent step kernel over a state pool; no workspace.
void cuda_decode(const DecodeProblem& p, void* stream);
// Gate (cuda/gate.cu): elementwise forward; backward with a deterministic per-head sum.
void cuda_gating_fwd(const GatingProblem& p, void* stream);
size_t cuda_gating_bwd_workspace_bytes(const GatingProblem& p);
void cuda_gating_bwd(const GatingProblem& p, void* workspace, void* stream);
#endif

}  // namespace flashgdn
