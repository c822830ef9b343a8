// Launch code of the CUDA backend: workspace layout, kernel configuration and
// the order of launches for the forward and the backward. Everything is enqueued
// on the caller's stream; nothing here waits for the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include <unistd.h>  // environ: the switches in plan_key

#include "../backends.h"
#include "../planner.h"
#include "bwd_kernels.cuh"
#include "grad_chunk_wg.cuh"
#include "fwd_kernels.cuh"
#include "wy_lean.cuh"
#include "planner.cuh"
#include "state_bwd_cols.cuh"
#include "state_fwd_cols.cuh"
#include "state_fwd_cols_owg.cuh"
#include "fwd_fused.cuh"
#include "state_fwd_tma.cuh"

namespace flashgdn {
namespace {

using namespace cuda;

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Carves the workspace into fp32/int arrays; the same walk sizes it (base == null).
struct Carver {
  char* base;
  size_t used = 0;
  template <typename T>
  T* take(size_t count) {
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += align_up(count * sizeof(T));
    return p;
  }
};

// Which kernel runs the forward's sequential pass (all tested against each other and the
// float64 reference):
//   f16 (default)  fp16 operands, U formed in the pass as T diag(beta) (V - diag(e^G) K S)
//                  (wy_kernel writes fp16 T diag(beta), no W, U0; docs/perf-notes.md version
//                  11), in one of two kernels the planner picks per call (column block):
//                  state_fwd_f16_kernel<.., kFree> (16 or 32 value columns per block) or,
//                  forward only, state_fwd_cols_kernel (state_fwd_cols.cuh: all 128 columns
//                  of a head per block, the columns as the products' rows)
//   f16wu          state_fwd_f16_kernel: fp16 operands, U = U0 - W S from wy_kernel's W, U0
//   auto           f16wu with its range guard, then the tf32 pass redoing the blocks whose
//                  values left fp16's range (fwd_kernels.cuh, kF16Hi / kF16Lo)
//   tf32           state_fwd_mma_kernel (tf32 operands, fp32's range)
//   wgmma          the warpgroup state_fwd_kernel (tf32; slower, perf-notes version 8);
//                  also FLASHGDN_WGMMA=1
enum class FwdPass { F16, F16WU, Tf32, Wgmma, Auto };
bool uses_f16(FwdPass pass) {
  return pass == FwdPass::F16 || pass == FwdPass::F16WU || pass == FwdPass::Auto;
}
// An integer switch from the environment: its value, 0 when unset.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : 0;
}

// The switch `name` as an integer, or `unset` when it is not set (or empty).
int env_int_or(const char* name, int unset) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : unset;
}

// Programmatic dependent launch of the context-parallel chain's kernels (on by default;
// FLASHGDN_PDL=0 turns it off): see launch_kernel.
bool pdl_enabled() { return env_int_or("FLASHGDN_PDL", 1) != 0; }

// kernel<<<grid, threads, smem, st>>>(args...) (launch_kernel: NT threads); with `pdl` as
// the programmatic dependent of the kernel before it in `st` (sm_90): its blocks may start
// while that kernel still runs, as soon as each of that kernel's blocks has called
// pdl_trigger or exited, and they wait for its completion in pdl_wait (mma.cuh) before
// reading what it wrote. So the chain's
// prologues (segment decisions, the first chunk's copies) and the blocks that find nothing
// to do run under the previous kernel's tail. Captured into CUDA graphs as programmatic
// edges.
template <typename... KArgs, typename... Args>
void launch_kernel_threads(void (*kernel)(KArgs...), dim3 grid, int threads, size_t smem,
                           cudaStream_t st, bool pdl, const char* what, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl && pdl_enabled() ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what);
}
template <typename... KArgs, typename... Args>
void launch_kernel(void (*kernel)(KArgs...), dim3 grid, size_t smem, cudaStream_t st, bool pdl,
                   const char* what, Args&&... args) {
  launch_kernel_threads(kernel, grid, NT, smem, st, pdl, what, std::forward<Args>(args)...);
}

// FLASHGDN_COLS_WGMMA=1 (opt-in; tests pass on H100, no faster than the default): the
// forward's 128-column pass on warpgroup tensor cores (state_fwd_cols_wg_kernel); 2 and 3
// below are variants of it.
bool cols_wgmma() { return env_int("FLASHGDN_COLS_WGMMA") >= 1; }
// FLASHGDN_COLS_WGMMA=2: the wgmma kernel in the ping-pong schedule (state_fwd_cols_wg_kernel's
// kPing), which also converts bf16 k and q in shared memory where kq_in_pass allows
bool cols_wgmma_ping() { return env_int("FLASHGDN_COLS_WGMMA") >= 2; }
// =3: and the two warpgroups issue their wgmma groups in alternation (kOrder; not yet run on
// a GPU)
bool cols_wgmma_order() { return env_int("FLASHGDN_COLS_WGMMA") == 3; }
// The forward's 128-column passes (and the backward's recomputation in them) without a block
// barrier a chunk, their two warpgroups apart in the chunk step (state_fwd_cols_segment's
// kPing; bit-identical): the default; FLASHGDN_COLS_PING=0 the barrier-per-chunk schedule.
// The reverse pass (state_bwd_cols_kernel) keeps its barrier: the same schedule there, with
// its per-token factors formed mid-step by the issuing warpgroup, measured slower (H100,
// 16/32 x 32768: 735 -> 869 us; docs/perf-notes.md version 31).
bool cols_ping() { return env_int_or("FLASHGDN_COLS_PING", 1) != 0; }
// FLASHGDN_COLS_OWG=1 (opt-in; bit-identical, measured no faster on the H100: 16/32 x 32768
// phase 0 468 -> 479 us, docs/perf-notes.md version 37): phase 0 of the plain forward's
// 128-column pass with the outputs in a warpgroup of their own (state_fwd_cols_owg_kernel,
// 384 threads; the same bits as state_fwd_cols_kernel). Its output warps, one a scheduler,
// are the bound: the chain alone runs 295 us.
bool cols_owg() { return env_int("FLASHGDN_COLS_OWG") == 1; }
// FLASHGDN_COLS_STAGES=3 (opt-in; bit-identical, measured slower on the H200: phase 0 at
// 4/16 x 32768 272 -> 282 us, docs/perf-notes.md version 33): the forward's ping-pong
// 128-column pass (no records) with three stages of copies, chunk ci + 2's issued at the
// head of chunk ci.
bool cols_three_stages() { return env_int_or("FLASHGDN_COLS_STAGES", 2) == 3; }
// FLASHGDN_TMA_KCONV=1 (opt-in, session 53, not yet run on a GPU): kWy 1's non-flat launches on
// bf16 inputs take state_fwd_tma_kernel's kWy 3, whose producer warps 1-3 convert K to fp16
// while the WY warpgroup forms P (it converts Q only): P's latency off the chunk's path
// (docs/perf-notes.md version 53). The same conversions: the same bits.
bool tma_k_by_producer() { return env_int_or("FLASHGDN_TMA_KCONV", 0) == 1; }
// FLASHGDN_COLS_TMA=1 (opt-in, experimental, 2026-11-26): the plain forward's 128-column
// passes as state_fwd_tma_kernel (TMA loads, two wgmma warpgroups; state_fwd_tma.cuh) where
// tma_pass allows; bf16 k and q are converted in the pass (kq_in_pass) where the planner
// names 128 columns, else read from wy's fp16 copies. Its outputs equal the default kernel's
// bit for bit and are reproducible since the cp.async commit of docs/perf-notes.md version 43
// (before it, split plans differed run to run: version 42); 2-6% slower than the default.
bool cols_tma() { return env_int("FLASHGDN_COLS_TMA") >= 1; }
// FLASHGDN_COLS_TMA=3: that kernel with S^T Q^T from S^T staged in shared memory and e^G
// folded into the Q tile (kSsY, two stages; docs/perf-notes.md versions 41-42, plan item 1's
// first step; 7-13% slower than =1 on H100).
bool cols_tma_ssy() { return env_int("FLASHGDN_COLS_TMA") == 3; }
// The backward's recomputation (records, no outputs) in state_fwd_tma_kernel's kRec
// (tma_record_pass; the default since session 56) rather than state_fwd_cols_kernel
// (FLASHGDN_REC_TMA=0). The same records bit for bit; 2026-11-27, fwd+bwd over the 32
// backward rows 0.989x on an H200 (0.970x-1.002x; 16/32 x 32768 the recomputation's state
// pass ~0.60 -> ~0.55 ms), 0.992x on an H100; docs/benchmarks.md "Session 56".
bool rec_tma() { return env_int_or("FLASHGDN_REC_TMA", 1) != 0; }
// The overlapped schedule of a split sequential pass (the forward's, the backward's
// recomputation and its reverse pass): the phase-0 blocks of segments that do not start
// exact (h0 / dht, warm-ups: most of the decaying heads' work) run on the caller's stream
// while the exact heads' chain (phase 1, the combine, the phase-0 blocks of exact segments)
// runs on a high-priority stream beside it, forked and joined by events (graph-capturable).
// Otherwise the chain's last launch waits for every phase-0 block; with 48 blocks at 2/8 x
// 8192 most SMs idle through phase 1 and the combine. The plan's choice (the planner takes
// it for forward splits whose blocks fit in one wave beside each other, planner.h);
// FLASHGDN_CP_OVERLAP=1 forces it for every split pass, =0 never.
bool cp_overlap(const SegmentPlan& plan) {
  const int v = env_int_or("FLASHGDN_CP_OVERLAP", -1);
  return v < 0 ? plan.overlap || plan.device_overlap : v == 1;
}
// FLASHGDN_COLS_TMA=4 (opt-in, experimental, 2026-11-26; docs/perf-notes.md plan item 1 and
// version 43): the fused forward on that kernel, state_fwd_tma_kernel<., 2, false, 2> (kWy),
// whose fourth warpgroup forms T diag(beta) and P from the tiles it loads, wy_gates_kernel (G,
// e^G, Lb) before it instead of wy_lean_kernel, where fused_in_pass allows (else as =1);
// measured correct and 2x slower (H100, version 44).
// =5: kWy 1, P only (wy_lean_kernel without Q K^T before it); bit-identical to the default
// kernel's outputs. FLASHGDN_COLS_TMA unset (the default from version 44; at every head count
// since version 57, before at kTmaWyMinHeads or more): kWy 1 unless the plan runs the
// overlapped schedule (not its saturated form) below kTmaWyOverlapHeads or in two segments:
// there the warm-started phase 0 beside the chain measured slower with it (H100 2026-11-26,
// ms plain -> kWy 1: 4/16 x 8192
// 0.194 -> 0.232, 16/16 x 8192 0.208 -> 0.239, 8/24 6144+2048 0.242 -> 0.253, two segments:
// 16/48 x 4096 0.247 -> 0.263, 8/32 x 4096 0.203 -> 0.212; at 32 heads in three segments
// faster: 32/32 x 8192 0.331 -> 0.309, 8/32 x 8192 0.304 -> 0.281). Elsewhere faster (16/48
// x 32768 1.456 -> 1.228, 8/24 x 32768 0.727 -> 0.618, 4/16 8192x4 0.490 -> 0.435, with phase 1
// plain: tma_wy_phase); at 8 value heads slower on the overlapped schedule (2/8 x 32768
// 0.302 -> 0.340), faster elsewhere (H100 2026-11-27, 2/8 heads, ms plain -> kWy 1: 4096x8
// unsplit 0.315 -> 0.265, 8192x4 0.298 -> 0.270, 1024x8 0.100 -> 0.092, 2048x4 0.114 -> 0.113:
// wy_lean_kernel's Q K^T and P stores, ~20% of the call there, go into the pass).
// FLASHGDN_COLS_TMA=0 keeps the plain pass.
// Returns kWy (0: neither).
// (kTmaWyMinHeads, kTmaWyOverlapHeads: planner.h, whose cost model counts the difference)
int cols_tma_wy(const Problem& p, const SegmentPlan& plan) {
  const int v = env_int_or("FLASHGDN_COLS_TMA", -1);
  if (v >= 0) return v == 4 ? 2 : v == 5 ? 1 : 0;
  const bool overlapped = plan.split && cp_overlap(plan) && !plan.saturated;
  const bool overlap_ok = p.Hv >= kTmaWyOverlapHeads && plan.max_segments >= 3;
  return !overlapped || overlap_ok ? 1 : 0;
}
// Read once per call, when the workspace is carved (FwdBuffers::pass); the launches follow it.
FwdPass fwd_pass() {
  if (env_int("FLASHGDN_WGMMA") != 0) return FwdPass::Wgmma;
  const char* env = std::getenv("FLASHGDN_FWD_PASS");
  const std::string v = env != nullptr ? env : "";
  if (v.empty() || v == "f16") return FwdPass::F16;
  if (v == "tf32") return FwdPass::Tf32;
  if (v == "wgmma") return FwdPass::Wgmma;
  if (v == "auto") return FwdPass::Auto;
  if (v == "f16wu") return FwdPass::F16WU;
  throw Error("FLASHGDN_FWD_PASS: expected f16, f16wu, auto, tf32 or wgmma, got '" + v + "'");
}

struct FwdBuffers {
  FwdPass pass;  // the state pass these buffers were carved for
  bool p16;      // the backward's 128-column passes (BwdBuffers::rec16): P in fp16
  int64_t* chunk_offsets;
  int64_t* seg_offsets;  // varlen with context parallelism
  int64_t* split_seqs;   // varlen split plans: the sequences of more than one segment
  int64_t* seg_items;    //   and their segments (plan_kernel)
  int* error;
  float *G, *U0, *P, *Lb;  // P: tf32 (the tf32 passes and the backward), else null
  __half* W;          // tf32 precision in 16 bits (fwd_kernels.cuh)
  __half* P16;        // the fp16 pass's P (forward only), else null
  __half *Kh, *Qh;    // the fp16 pass on bf16 inputs: fp16 copies of k and q, else null
  __half* Tv16;       // the default f16 pass: T diag(beta) (W and U0 are null)
  bool tri16;         // Tv16 and P16 as their lower block triangle (FwdParams::tri16)
  float2* EG;         // f16 forward: (e^G, e^{G_last - G}) per token-head (cols kernel)
  float *seg_L, *seg_M, *seg_in;  // context parallelism: segment summaries, entering states
  float *o_loc, *q_eff;            // SegParams::corr: exact segments' local outputs, Q_eff
  int nsub;                        // FLASHGDN_CP_SUB: sub-segments of exact segments (0: none)
  float *sub_L, *sub_M;            //   their records (SegParams::sub_L, sub_M)
  float *scan_M, *scan_L;          // seg_scan_kernel's second buffers (scan_levels), else null
  int64_t* seg_chunks;             // varlen: the device's [segment length, column block,
                                   //   schedule] (plan_kernel)
  int* redo;                       // FLASHGDN_FWD_PASS=auto: per-block redo flags
};
struct BwdBuffers {
  FwdBuffers f;
  float *Tmat, *U, *dVt, *h, *dh, *h_scale, *dh_scale, *U_scale, *dVt_scale;
  // bwd_cols: both passes in the 128-column kernels; T, P and the records are fp16 views
  bool rec16 = false;
  // the problem tag of a forward that kept its records here (workspace_tag_kernel)
  unsigned long long* tag = nullptr;
  // a backward on a kept forward's workspace (read only): the reverse pass's own segment
  // buffers (SegParams::seg_L, seg_M, seg_in) and error flag, in the backward's workspace
  float *rseg_L = nullptr, *rseg_M = nullptr, *rseg_in = nullptr;
  int* error = nullptr;
  // the ready queue (BwdParams::rq_count, rq_slot, rq_ends), in the backward's own workspace
  int* ready = nullptr;
};

// Tv16 and P16 as their lower block triangle (FwdParams::tri16: 37.5% fewer of their bytes
// written by wy_kernel and read by the state pass): the plain forward of the default pass,
// whose readers are state_fwd_cols_kernel (mma.sync) and state_fwd_f16_kernel, not the
// backward's kernels or the opt-in wgmma one. FLASHGDN_TRI16=0: wy stores whole tiles (those
// two kernels copy the lower triangle either way).
bool tri16_stores(FwdPass pass, bool backward) {
  return !backward && pass == FwdPass::F16 && !cols_wgmma() &&
         env_int_or("FLASHGDN_TRI16", 1) != 0;
}

// `backward`: the recomputation (no outputs: P only for the backward's kernels, tf32 in
// fp32, or, with `p16` (the 128-column passes: BwdBuffers::rec16), fp16 in half the space).
FwdBuffers carve_common(const Problem& p, bool backward, bool p16, Carver& c) {
  FwdBuffers b{};
  const size_t tokheads = static_cast<size_t>(p.TT * p.Hv);
  const FwdPass pass = b.pass = fwd_pass();
  b.p16 = p16;
  b.chunk_offsets = c.take<int64_t>(p.N + 1);
  b.error = c.take<int>(1);
  b.G = c.take<float>(tokheads);
  if (pass == FwdPass::F16) {
    b.Tv16 = c.take<__half>(tokheads * C);
    b.EG = c.take<float2>(tokheads);  // for state_fwd_cols_kernel
  } else {
    b.W = c.take<__half>(tokheads * D);
    b.U0 = c.take<float>(tokheads * D);
  }
  if (backward || !uses_f16(pass))  // the backward's 128-column passes: P in fp16
    b.P = c.take<float>(p16 ? tokheads * C / 2 : tokheads * C);
  if (!backward && uses_f16(pass)) b.P16 = c.take<__half>(tokheads * C);
  b.tri16 = tri16_stores(pass, backward);
  if (uses_f16(pass) && p.qkv_dtype == FLASHGDN_DTYPE_BF16) {
    b.Kh = c.take<__half>(static_cast<size_t>(p.TT * p.Hqk) * D);
    b.Qh = c.take<__half>(static_cast<size_t>(p.TT * p.Hqk) * D);
  }
  return b;
}

// Sub-segments of the forward's exact segments: their phase 0 as that many blocks, from
// entering states formed in parallel (M_c S_in + L_c, sub_start_kernel) instead of one block
// walking the whole segment after the combine: the last link of the exact heads' chain gets
// nsub times shorter. The plan's count (4 with the overlapped schedule, else none);
// FLASHGDN_CP_SUB=<1..8> overrides. Split forward plans of the default pass whose
// 128-column kernel runs (the mma.sync one); 0 (none) otherwise. Read when the workspace is
// carved.
bool cp_corr(const SegmentPlan& plan, FwdPass pass, bool backward);
int cp_subsegments(const SegmentPlan& plan, FwdPass pass, bool backward) {
  const int n = env_int_or("FLASHGDN_CP_SUB", plan.nsub);
  if (n < 2 || n > 8 || backward || !plan.split || !plan.cols || pass != FwdPass::F16 ||
      cols_wgmma() || cp_corr(plan, pass, backward))
    return 0;
  return n;
}
// Exact segments' outputs by correction (SegParams::corr): the plan's choice
// (SegmentPlan::corr), FLASHGDN_CP_CORR=1 / 0 forces it on / off. Forward split plans of the
// default pass whose segments the host made (not the device's choice for packed
// sequences); not with the opt-in wgmma 128-column kernel. Read when the workspace is carved.
bool cp_corr(const SegmentPlan& plan, FwdPass pass, bool backward) {
  const int v = env_int_or("FLASHGDN_CP_CORR", -1);
  const bool want = v < 0 ? plan.corr : v == 1;
  return want && !backward && plan.split && !plan.device_choice && pass == FwdPass::F16 &&
         !cols_wgmma();
}

// The forward's chain on tensor cores (seg_walk_kernel, launch_seg_walk): its columns a block,
// 0 where FLASHGDN_CP_WALK=0 asks for the chain before it.
int walk_cols() {
  const int v = env_int_or("FLASHGDN_CP_WALK", 16);
  return v == 0 ? 0 : v == 32 ? 32 : 16;
}

// Levels of the log-depth scan (seg_scan_kernel) that replaced the combine's walk in the
// forward's state pass (and the backward's recomputation) until the walk ran on tensor cores
// (walk_cols; FLASHGDN_CP_WALK=0 brings the scan back): ceil(log2(steps)) for the most
// steps (segments - 1) a sequence of the plan can have; 0 (the walk) for one step, more than
// kScanMaxLevels levels, or FLASHGDN_CP_SCAN=0. Packed sequences: from all their chunks (a
// bound whatever the lengths; not the caller's max_seqlen hint, which only steers cost
// estimates: too few levels would leave entering states unformed); levels past the actual
// lengths' return at once (seg_scan_kernel).
int scan_levels(const Problem& p, const SegmentPlan& plan) {
  if (!plan.split || walk_cols() > 0 || env_int_or("FLASHGDN_CP_SCAN", 1) == 0) return 0;
  const int64_t longest = p.varlen() ? p.max_chunks() : (p.T + C - 1) / C;
  return scan_levels_for(longest, plan.seg_chunks, kScanMaxLevels);
}

FwdBuffers carve_fwd(const Problem& p, const SegmentPlan& plan, Carver& c,
                     bool backward = false, bool p16 = false) {
  FwdBuffers b = carve_common(p, backward, p16, c);
  b.Lb = c.take<float>(static_cast<size_t>(p.max_chunks() * p.Hv));
  b.seg_offsets = p.varlen() ? c.take<int64_t>(p.N + 1) : nullptr;
  if (plan.split) {
    if (p.varlen()) {
      b.split_seqs = c.take<int64_t>(p.N + 1);
      b.seg_items = c.take<int64_t>(plan.max_segments + 1);
    }
    const size_t segheads = static_cast<size_t>(plan.max_segments * p.Hv);
    b.seg_L = c.take<float>(segheads * D * D);
    b.seg_M = c.take<float>(segheads * D * D);
    b.seg_in = c.take<float>(segheads * D * D);
    b.nsub = cp_subsegments(plan, b.pass, backward);
    if (cp_corr(plan, b.pass, backward)) {
      const size_t cols = static_cast<size_t>(p.Hv) * D * p.TT;
      b.o_loc = c.take<float>(cols);
      b.q_eff = c.take<float>(cols);
    }
    if (b.nsub > 1) {
      b.sub_L = c.take<float>(segheads * (b.nsub - 1) * D * D);
      b.sub_M = c.take<float>(segheads * (b.nsub - 1) * D * D);
    }
    if (scan_levels(p, plan) > 0 && b.o_loc == nullptr) {
      b.scan_M = c.take<float>(segheads * D * D);
      b.scan_L = c.take<float>(segheads * D * D);
    }
  }
  // the device's choice (DeviceSegChoice::chosen): segment length, column block, schedule,
  // phase-0 merge
  if (plan.device_choice || plan.device_col_block) b.seg_chunks = c.take<int64_t>(4);
  if (b.pass == FwdPass::Auto)  // the largest launch: phase 1 at 16 columns
    b.redo = c.take<int>(static_cast<size_t>(2 * (D / 16) * p.Hv * plan.max_segments));
  return b;
}

// Whether the backward runs its passes in the 128-column kernels (defined below).
bool bwd_cols(const Problem& p);
// What the backward's recomputation writes and its later kernels read: the forward's
// buffers, T, P, U and the state records. A forward that keeps its records for the backward
// (Problem::keep_for_backward) fills exactly this, and with `outputs` (that forward, and the
// backward reading its workspace) an fp16 P for o where the recomputation's P is fp32.
BwdBuffers carve_kept(const Problem& p, const SegmentPlan& plan, Carver& c, bool outputs) {
  BwdBuffers b;
  // the 128-column passes (bwd_cols): T and P in fp16, the records as fp16 blocks
  // (mma.cuh); sized in floats, half of their fp32 counterparts
  const bool rec16 = b.rec16 = bwd_cols(p);
  b.f = carve_fwd(p, plan, c, true, rec16);  // the recomputation runs the forward's state pass
  const size_t tokheads = static_cast<size_t>(p.TT * p.Hv);
  const size_t recs = static_cast<size_t>(p.max_chunks() * p.Hv);
  b.Tmat = c.take<float>(rec16 ? tokheads * C / 2 : tokheads * C);
  // U (and dVt, carve_bwd_own): fp32 rows, or the fp16 record blocks, C x D halves per chunk
  // and head (more than the rows where many sequences are short)
  b.U = c.take<float>(rec16 ? recs * C * D / 2 : tokheads * D);
  b.h = c.take<float>(recs * D * D / (rec16 ? 2 : 1));
  // the record blocks' factors, 8 per chunk and head
  b.h_scale = c.take<float>(recs * 8);
  b.U_scale = c.take<float>(recs * 8);
  b.tag = c.take<unsigned long long>(1);
  // the narrow passes' outputs read P16 (the 128-column kernel's P16 is P itself)
  if (outputs && !rec16 && uses_f16(b.f.pass)) b.f.P16 = c.take<__half>(tokheads * C);
  return b;
}

// What only the backward writes: the reverse pass's records (dS, dVt) and their factors, in
// b.rec16's format; with a kept forward's workspace (`kept`, read only) also the reverse
// pass's segment buffers and an error flag, which otherwise share the forward's.
// The ready queue's ints (BwdParams::rq_count, rq_slot: an item each; rq_ends: 2).
size_t ready_queue_ints(const Problem& p) {
  return 2 * static_cast<size_t>(p.max_chunks() * p.Hqk) + 2;
}

void carve_bwd_own(const Problem& p, const SegmentPlan& plan, Carver& c, BwdBuffers& b,
                   bool kept) {
  const bool rec16 = b.rec16;
  const size_t tokheads = static_cast<size_t>(p.TT * p.Hv);
  const size_t recs = static_cast<size_t>(p.max_chunks() * p.Hv);
  b.dVt = c.take<float>(rec16 ? recs * C * D / 2 : tokheads * D);
  b.dh = c.take<float>(recs * D * D / (rec16 ? 2 : 1));
  b.dh_scale = c.take<float>(recs * 8);
  b.dVt_scale = c.take<float>(recs * 8);
  b.ready = c.take<int>(ready_queue_ints(p));
  if (!kept) return;
  b.error = c.take<int>(1);
  if (plan.split) {
    const size_t segheads = static_cast<size_t>(plan.max_segments * p.Hv);
    b.rseg_L = c.take<float>(segheads * D * D);
    b.rseg_M = c.take<float>(segheads * D * D);
    b.rseg_in = c.take<float>(segheads * D * D);
  }
}

BwdBuffers carve_bwd(const Problem& p, const SegmentPlan& plan, Carver& c) {
  BwdBuffers b = carve_kept(p, plan, c, false);
  carve_bwd_own(p, plan, c, b, false);
  return b;
}

// `error`: the backward's own flag on a kept forward's workspace (BwdBuffers::error), set
// also when the workspace's tag does not match (so the kernels skip their work).
SeqLayout seq_layout(const Problem& p, const FwdBuffers& b, const int* error = nullptr) {
  SeqLayout s;
  s.cu_seqlens = p.cu_seqlens;
  s.cu_is64 = p.cu_dtype == FLASHGDN_DTYPE_I64;
  s.T = p.T;
  s.N = p.N;
  s.chunk_offsets = p.varlen() ? b.chunk_offsets : nullptr;
  s.error = error != nullptr ? error : p.varlen() ? b.error : nullptr;
  return s;
}

template <typename K>
void set_smem(K kernel, size_t bytes) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             "cudaFuncSetAttribute");
}

// Makes `device` current for the scope of a call.
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};

int sm_count(int device);

// The NaN fill of a call's outputs when cu_seqlens was bad, one launch (poison_kernel).
struct Poison {
  PoisonList list;
  void add(void* out, flashgdn_dtype t, int64_t n) {
    if (out == nullptr || n == 0) return;
    list.ptr[list.count] = out;
    list.n[list.count] = n;
    list.dtype[list.count] = t;
    ++list.count;
  }
  void launch(const Problem& p, const int* error, cudaStream_t st) const {
    if (list.count == 0) return;
    // one block per SM: when error is unset (always, but for a bad cu_seqlens) every block
    // returns after one load
    // (the programmatic dependent of the call's last kernel: its blocks wait in pdl_wait)
    launch_kernel_threads(poison_kernel, dim3(sm_count(p.device_id)), 256, 0, st, true,
                          "poison_kernel launch", list, error);
  }
};

void run_planner(const Problem& p, const SeqLayout& s, const FwdBuffers& b, int64_t seg_chunks,
                 const DeviceSegChoice& choice, cudaStream_t st, PlanPart part = PlanPart::All) {
  if (!p.varlen()) return;
  // a choice made on the device needs choose_plan's instantiation; the table alone, the
  // host's plan and its preset choice take the lean one (FLASHGDN_PLAN_LEAN=0: the full
  // one, for A/B timings)
  const bool choose = (part != PlanPart::Table && choice.chosen != nullptr &&
                       !choice.has_preset) ||
                      env_int_or("FLASHGDN_PLAN_LEAN", 1) == 0;
  const auto go = [&](auto kernel, int threads) {
    kernel<<<1, threads, 0, st>>>(s, p.TT, seg_chunks, b.chunk_offsets, b.seg_offsets,
                                  b.split_seqs, b.seg_items, b.error, choice, part);
  };
  if (part == PlanPart::Segments)
    go(plan_kernel<kPlanAsideThreads>, kPlanAsideThreads);
  else if (!choose && p.N <= kPlanTableThreads)
    go(plan_kernel<kPlanTableThreads, false>, kPlanTableThreads);
  else if (!choose)  // many sequences: a thread each in fewer rounds of the block's scans
    go(plan_kernel<kPlanThreads, false>, kPlanThreads);
  else
    go(plan_kernel<kPlanThreads>, kPlanThreads);
  check_cuda(cudaGetLastError(), "plan_kernel launch");
}

FwdParams fwd_params(const Problem& p, const SeqLayout& s, const FwdBuffers& b) {
  FwdParams f{};
  f.seqs = s;
  f.Hqk = p.Hqk;
  f.Hv = p.Hv;
  f.scale = p.scale;
  f.q = p.q;
  f.k = p.k;
  f.v = p.v;
  f.g = p.g;
  f.beta = p.beta;
  f.g_dtype = p.g_dtype;
  f.beta_dtype = p.beta_dtype;
  f.h0 = p.h0;
  f.G = b.G;
  f.W = b.W;
  f.U0 = b.U0;
  f.Pmat = b.P;
  f.P16 = b.P16;
  f.Tv16 = b.Tv16;
  f.tri16 = b.tri16;
  f.EG = b.EG;
  if (b.Kh != nullptr) {  // bf16 inputs: wy_kernel writes fp16 copies for the fp16 pass
    f.Kh = f.Kh_w = b.Kh;
    f.Qh = f.Qh_w = b.Qh;
  } else if (p.qkv_dtype == FLASHGDN_DTYPE_F16) {
    f.Kh = static_cast<const __half*>(p.k);
    f.Qh = static_cast<const __half*>(p.q);
  }
  f.Lb = b.Lb;
  f.redo = b.redo;
  return f;
}

// Value columns per block of the sequential passes: the widest block (least
// duplicated work) that still gives every SM a block.
int column_block(const Problem& p, int sms) {
  const int64_t pairs = p.N * p.Hv;
  if (pairs * (D / 32) >= sms) return 32;
  if (pairs * (D / 16) >= sms) return 16;
  return 8;
}

int sm_count(int device) {
  static int cache[64] = {};
  if (device >= 0 && device < 64 && cache[device] > 0) return cache[device];
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  if (device >= 0 && device < 64) cache[device] = sms;
  return sms;
}

// What the planner knows of the call's sequences (csrc/planner.h SegmentQuery), without
// the switches: N, the chunks of all sequences and of each (fixed length), the hint on the
// longest, H_v, the SM count.
SegmentQuery sequence_query(const Problem& p) {
  SegmentQuery q;
  q.N = p.N;
  q.total_chunks = p.max_chunks();
  q.fixed_chunks = p.varlen() ? -1 : (p.T + C - 1) / C;
  if (p.varlen() && p.N == 1) {
    // one packed sequence holds every token (plan_kernel checks cu_seqlens = [0, T]): its
    // length is known exactly, which the wave count of the cost model needs
    q.fixed_chunks = q.total_chunks = (p.TT + C - 1) / C;
  }
  q.Hv = p.Hv;
  if (p.varlen() && p.max_seqlen > 0) q.longest_hint = (p.max_seqlen + C - 1) / C;
  q.sms = sm_count(p.device_id);
  return q;
}

// FLASHGDN_BWD_SIMT=1: the backward's fp32 SIMT kernels (reference for A/B comparisons).
bool bwd_simt() { return env_int_or("FLASHGDN_BWD_SIMT", 0) == 1; }
// The per-chunk gradients on TF32 tensor cores (grad_chunk_tc_kernel); FLASHGDN_GRAD_TC=0
// keeps the fp32 SIMT kernel for A/B comparisons.
bool grad_tc() { return !bwd_simt() && env_int_or("FLASHGDN_GRAD_TC", 1) != 0; }

// The backward's sequential passes in the one-block-per-head kernels (the reverse pass in
// state_bwd_cols_kernel, state_bwd_cols.cuh; the recomputation in state_fwd_tma_kernel's
// kRec, or state_fwd_cols_kernel (rec_tma), with the f16 pass) where backward_cols
// (planner.h) says they win;
// FLASHGDN_BWD_COLS=0 / 1 overrides. Both write fp16 record blocks, which only
// grad_chunk_tc_kernel reads: not with the SIMT reference kernels, and only with the
// default f16 forward pass (whose kernel records them).
int64_t bwd_short_seg(const Problem& p);
bool bwd_cols(const Problem& p) {
  if (fwd_pass() != FwdPass::F16 || !grad_tc()) return false;
  const int v = env_int_or("FLASHGDN_BWD_COLS", -1);
  if (v == 0 || v == 1) return v == 1;
  if (bwd_short_seg(p) > 0) return true;  // the short split runs in the 128-column passes
  const SegmentQuery q = sequence_query(p);
  return backward_cols(q.Hv, q.total_chunks, longest_chunks_bound(q), q.sms);
}

// The backward's short split (planner.h backward_short_seg): its segment length, or 0.
// Only where the planner would choose (FLASHGDN_CP, FLASHGDN_CP_SEG unset) and the backward's
// passes may take 128 columns (FLASHGDN_BWD_COLS not 0). FLASHGDN_BWD_SHORT unset: where
// any rule applies (backward_short_split: the longest sequence known, from a fixed length,
// one packed sequence or the max_seqlen / cu_seqlens_cpu hint; backward_short_split_avg: by
// the tokens and the average sequence, no host lengths; backward_short_split_packed: few
// value heads, packed, by the known longest); =1, =2 that rule alone; =3 either of the first
// two (sessions 56-59); =0 never.
int64_t bwd_short_seg(const Problem& p) {
  int mode = env_int_or("FLASHGDN_BWD_SHORT", kBackwardShortAll);
  if (mode < 0 || mode > kBackwardShortAll) mode = kBackwardShortAll;
  if (fwd_pass() != FwdPass::F16 || !grad_tc() || mode == 0 ||
      env_int_or("FLASHGDN_BWD_COLS", -1) == 0)
    return 0;
  SegmentQuery q = sequence_query(p);
  q.mode = cp_mode_from_env();
  q.forced_seg_chunks = cp_seg_chunks_from_env();
  return backward_short_seg(q, mode, (p.TT + C - 1) / C);
}

// The cost model of the planner. The overlapped schedule is the forward's (its sub-segments
// are the 128-column kernel's): not a candidate for the backward's plans, nor with
// FLASHGDN_CP_OVERLAP=0 (its saturated form, more blocks than a wave: ForwardCost's rule,
// FLASHGDN_CP_SAT=1 takes it wherever the model prefers it, =0 never);
// FLASHGDN_CP_SUB=n sets its sub-segments. The one-wave steps of 16 and
// 32 columns are the forward's fp16 pass's.
int fused_mode();
// Whether the 128-column forward's kernel follows the plan (tma_wy_mode's default, kWy by
// cols_tma_wy's rule): neither FLASHGDN_COLS_TMA nor FLASHGDN_FUSED names one.
bool tma_wy_by_plan() { return env_int_or("FLASHGDN_COLS_TMA", -1) < 0 && fused_mode() == 0; }
ForwardCost plan_cost(bool backward) {
  ForwardCost c;
  if (!backward && fwd_pass() == FwdPass::F16) {
    c.step_us_bw16_wave = ForwardCost::kFp16Bw16Wave;
    c.step_us_bw32_wave = ForwardCost::kFp16Bw32Wave;
  }
  c.overlap = !backward && env_int_or("FLASHGDN_CP_OVERLAP", -1) != 0;
  const int sat = env_int_or("FLASHGDN_CP_SAT", -1);
  if (sat == 0) c.overlap_saturated = false;
  if (sat == 1) force_saturated(c);
  const int n = env_int_or("FLASHGDN_CP_SUB", c.nsub);
  c.nsub = n >= 2 && n <= 8 ? n : 1;
  // FLASHGDN_STEP_US_BW128=<us>: the forward's 128-column chunk step in the cost model
  // (host and device plans), for measuring the plans another figure would make
  if (const char* e = std::getenv("FLASHGDN_STEP_US_BW128"); e != nullptr && !backward) {
    const double us = std::atof(e);
    if (us > 0) c.step_us_bw128 = us;
  }
  // FLASHGDN_COMBINE_US=<us>: the forward's chain cost a segment in the cost model (3.3 us,
  // the fp32 walk's; the tensor-core walk measured ~1.8 us a step on the H200, 2026-11-26),
  // for measuring the plans another figure would make (flashgdn_plan --combine)
  if (const char* e = std::getenv("FLASHGDN_COMBINE_US"); e != nullptr && !backward) {
    const double us = std::atof(e);
    if (us > 0) c.combine_us = us;
  }
  c.corr = !backward && fwd_pass() == FwdPass::F16 && env_int_or("FLASHGDN_CP_CORR", -1) != 0 &&
           !cols_wgmma();
  // the overlapped schedule's WY part outside the pass: only where the others take kWy
  // (cols_tma_wy's default; FLASHGDN_UNFUSED_WY_US=<us> sets it, for measurements)
  if (backward || fwd_pass() != FwdPass::F16 || !tma_wy_by_plan()) {
    c.unfused_wy_us = 0.0;
    c.fused_wy = false;
  }
  if (const char* e = std::getenv("FLASHGDN_UNFUSED_WY_US"); e != nullptr && *e && !backward)
    c.unfused_wy_us = std::max(0.0, std::atof(e));
  // ForwardCost::exact_p0 (the host's choice for packed sequences with phase 0 from their
  // blocks) and ::p0_list (phase 0 of one sequence list-scheduled): the forward's, each past
  // its margin; FLASHGDN_HOST_EXACT_P0 / FLASHGDN_P0_LIST =0 leave them out, =2 take them
  // without the margin (measurements)
  if (backward) {
    c.exact_p0 = c.p0_list = false;
  } else {
    const int exact = env_int_or("FLASHGDN_HOST_EXACT_P0", 1);
    c.exact_p0 = exact != 0;
    if (exact == 2) c.exact_p0_margin = 0.0;
    const int list = env_int_or("FLASHGDN_P0_LIST", 1);
    c.p0_list = list != 0;
    if (list == 2) c.p0_list_margin = 0.0;
  }
  // FLASHGDN_REACH_SEG=<chunks>: ForwardCost::reach_seg_longest (0: no kReachSegChunks
  // splits; the forward only, the backward's plans never take them)
  c.reach_seg_longest = backward ? 0 : env_int_or("FLASHGDN_REACH_SEG", 128);
  // FLASHGDN_UNFUSED_WY_LONGEST=<chunks>: from which longest sequence the term counts
  // (ForwardCost::unfused_wy_longest; measurements)
  if (const int l = env_int_or("FLASHGDN_UNFUSED_WY_LONGEST", 0); l > 0 && !backward)
    c.unfused_wy_longest = l;
  // FLASHGDN_CP_SHORT_LONGEST=<chunks> / FLASHGDN_CP_SHORT_MIN=<chunks>: from which sequence
  // length 128-column segments under 32 chunks are tried, and how short (ForwardCost; the
  // forward; measurements)
  if (backward) {
    c.short_seg_longest = kMinOverlapLongest;  // its plans as measured before kMinShortSegLongest
  } else {
    const int longest = env_int_or("FLASHGDN_CP_SHORT_LONGEST", 0);
    const int shortest = env_int_or("FLASHGDN_CP_SHORT_MIN", 0);
    if (longest > 0) c.short_seg_longest = longest;
    if (shortest > 0) c.short_seg_min = shortest;
  }
  return c;
}

bool device_schedule(const SegmentPlan& plan);

// The caller's host copy of cu_seqlens (Problem::host_chunks) makes the device's choice on
// the host for up to this many sequences (state_pass_params; the host's loop is sequences x
// candidate lengths, up to 32: ~1 us at 2 and 64 sequences; the device sums in parallel).
constexpr int64_t kHostChoiceSeqs = 2048;
bool host_choice(const Problem& p) {
  return !p.host_chunks.empty() && p.N <= kHostChoiceSeqs &&
         env_int_or("FLASHGDN_HOST_CHOICE", 1) != 0;
}

// The forward's plan of packed sequences completed on the host from the caller's copy of
// cu_seqlens (host_choice), where the device was to choose (device_col_block, device_choice);
// the backward's plans as before (not measured). Session 40, H100, CUDA graphs, forward ms:
// * the column block: the host makes the device's choice and the plan takes its block, so
//   only that block's kernels are launched and the passes that need the planner's own 128
//   columns run as for one sequence (kq_in_pass: bf16 k and q converted in the pass); 32/32
//   heads 28672 + 4096 1.188 -> 0.969, 16/16 0.657 -> 0.544. Not where the device would
//   schedule the overlapped launches and the choice is a narrow block (their narrow kernels
//   run in the overlapped launch's phase 0). FLASHGDN_HOST_COLS=0: the device's choice.
// * the slots: the count of the chosen segments at these lengths sizes the looped launches
//   (SegmentPlan::host_segments), about a block per segment, instead of a wave of slots
//   walking the device's list (FLASHGDN_HOST_COLS=2 keeps the wave); with the column block,
//   8/24 heads 28672 + 4096 0.918 -> 0.761.
// * exact segment counts: sequential splits also try the lengths that cut the longest
//   sequence into exactly m segments (SegmentPlan::host_exact, planner.cpp; FLASHGDN_HOST_SEGS=0:
//   the device's candidates only, its choice exactly): 1024 + 7168 tokens at 8/32, 16/32,
//   32/32 heads 0.393 -> 0.335, 0.399 -> 0.344, 0.422 -> 0.365.
// state_pass_params presets the same choice for plan_kernel.
// The forward's device choice for `plan` made on the host from the caller's copy, with the
// parameters plan_kernel gets; exact: SegmentPlan::host_exact (host_exact_counts).
void forward_choice_on_host(const Problem& p, const SegmentPlan& plan, bool exact,
                            int64_t out[4]) {
  const DeviceChoiceParams c =
      device_choice_params(plan, plan_cost(false), true, device_schedule(plan),
                           cp_subsegments(plan, fwd_pass(), false), p.Hv, sm_count(p.device_id));
  device_choice_on_host(c, p.host_chunks.data(), p.N, plan.seg_chunks, out, exact);
}
bool host_exact_counts(const SegmentPlan& plan) {
  return plan.device_choice && env_int_or("FLASHGDN_HOST_SEGS", 1) != 0;
}
void host_plan_choice(const Problem& p, SegmentPlan& plan) {
  const int host_cols = env_int_or("FLASHGDN_HOST_COLS", 1);
  if (!(plan.device_col_block || plan.device_choice) || !host_choice(p) || host_cols == 0)
    return;
  plan.host_exact = host_exact_counts(plan);
  int64_t out[4];
  forward_choice_on_host(p, plan, plan.host_exact, out);
  const int bw = static_cast<int>(out[1]);
  if (plan.device_col_block && (bw != D || plan.cols) && (bw == D || !plan.device_overlap)) {
    plan.col_block = bw;
    plan.device_col_block = false;
    plan.device_col_blocks = 0;
  }
  if (plan.device_choice && host_cols == 1) {
    int64_t segs = 0;
    for (const int64_t n : p.host_chunks) segs += segments_of(n, out[0]);
    plan.host_segments = segs;
  }
}

// Packed sequences whose lengths the host knows (host_choice) and which the planner's
// worst-case estimates (one sequence of every chunk) keep unsplit: the device-choice plan
// (SegmentQuery::device_choice_anyway) where the choice host_plan_choice then makes at the
// actual lengths is a split; else `plan` as it is. FLASHGDN_HOST_SPLIT=0: not tried.
// H100, 2026-11-26 (forward, CUDA graphs): 16/16 heads 2 x 4096 tokens stayed unsplit at
// 32 columns (0.253 ms) where segments of 20 at 128 columns, forced, took 0.198.
SegmentPlan host_split_plan(const Problem& p, const SegmentQuery& q, const SegmentPlan& plan) {
  if (q.mode != CpMode::Auto || q.forced_seg_chunks != 0 || q.fixed_chunks >= 0 || q.N <= 1 ||
      plan.split || plan.device_choice || !host_choice(p) ||
      env_int_or("FLASHGDN_HOST_SPLIT", 1) == 0)
    return plan;
  SegmentQuery anyway = q;
  anyway.device_choice_anyway = true;
  const SegmentPlan d = plan_segments(anyway, plan_cost(false));
  if (!d.device_choice) return plan;
  int64_t out[4];
  forward_choice_on_host(p, d, host_exact_counts(d), out);  // as host_plan_choice makes it
  const int64_t longest = *std::max_element(p.host_chunks.begin(), p.host_chunks.end());
  return out[0] <= longest ? d : plan;
}

// Column block and segment plan of the forward's state pass (csrc/planner.h;
// FLASHGDN_CP / FLASHGDN_CP_SEG / FLASHGDN_FWD_BW override). backward: the plan of the
// recomputation and the reverse pass, column block 128 only where bwd_cols (then both run
// one block per head and segment). Uncached: plan_forward below.
SegmentPlan plan_forward_uncached(const Problem& p, bool backward) {
  SegmentQuery q = sequence_query(p);
  q.allow_cols = fwd_pass() == FwdPass::F16 && (!backward || bwd_cols(p));
  q.mode = cp_mode_from_env();
  q.forced_seg_chunks = cp_seg_chunks_from_env();
  q.forced_col_block = col_block_from_env();
  if (backward) {  // the backward's short split (bwd_short_seg)
    const int64_t s = bwd_short_seg(p);
    if (s > 0) {
      q.mode = CpMode::On;
      q.forced_seg_chunks = s;
    }
  }
  SegmentPlan plan = plan_segments(q, plan_cost(backward));
  if (!backward) plan = host_split_plan(p, q, plan);
  // Where the host makes the device's choice and it is a sequential split, the overlapped
  // launches made for that choice (device_overlap: a second stream, phase-0 grids sized for
  // sub-segments, whose blocks then return at once) are not made; the choice is then made
  // again without them, which also lets 16- and 32-column splits in. The default since
  // 2026-11-27 (H100, forward ms: 4/16 24576 + 8192 0.498 -> 0.424, 16/16 0.545 -> 0.452,
  // 16/16 8192 + 24576 0.541 -> 0.448, 2/8 8192x4 0.310 -> 0.302; the issue-5 table's other
  // 148 rows within noise, docs/benchmarks.md session 48); an opt-in before (H200 2026-11-26:
  // 2/8 8192 x 4 0.313 -> 0.300 ms, no other row faster then). FLASHGDN_HOST_SCHEDULE=0: not.
  if (!backward && plan.device_overlap && device_schedule(plan) && host_choice(p) &&
      env_int_or("FLASHGDN_HOST_SCHEDULE", 1) == 1) {
    int64_t out[4];
    forward_choice_on_host(p, plan, /*exact=*/false, out);  // in the overlapped launches
    if (out[2] == 0) {  // a sequential split
      plan.device_overlap = false;
      plan.nsub = 1;
    }
  }
  if (!backward) host_plan_choice(p, plan);  // after the schedule: the choice it makes
  return plan;
}

// What a plan is made from, as bytes: every field of the problem but its data pointers and
// scale (sizes, heads, dtypes, device, state form, varlen, hints, the host's chunks a
// sequence) and every FLASHGDN_* switch as the environment holds it now.
std::string plan_key(const Problem& p, bool backward) {
  std::string k;
  k.reserve(160 + 8 * p.host_chunks.size());
  auto put = [&k](int64_t x) { k.append(reinterpret_cast<const char*>(&x), sizeof x); };
  for (const int64_t x :
       {int64_t{backward}, p.B, p.T, p.TT, p.Hqk, p.Hv, p.N, int64_t{p.qkv_dtype},
        int64_t{p.g_dtype}, int64_t{p.beta_dtype}, int64_t{p.cu_dtype}, int64_t{p.device},
        int64_t{p.device_id}, int64_t{p.h0 != nullptr}, int64_t{p.h0_io.present()},
        int64_t{p.h0_io.dtype}, int64_t{p.h0_io.layout}, int64_t{p.state_layout},
        int64_t{p.varlen()}, p.max_seqlen, int64_t{p.keep_for_backward},
        static_cast<int64_t>(p.host_chunks.size())})
    put(x);
  for (const int64_t x : p.host_chunks) put(x);
  for (char** e = environ; e != nullptr && *e != nullptr; ++e)
    if (std::strncmp(*e, "FLASHGDN_", 9) == 0) k.append(*e).push_back('\0');
  return k;
}

// plan_forward_uncached's plan, from a cache keyed by plan_key. The host's planning of packed
// sequences with their copy of cu_seqlens (the device's choice made on the host, the list
// schedules past their margins) took ~100-160 us a call on the H100 machine's host
// (2/8 28672+4096: _C.fwd 371 us with the copy, 210 without), and a call plans twice (the
// workspace's size, then the launches). A full cache is emptied. FLASHGDN_PLAN_CACHE=0: none.
constexpr size_t kPlanCacheEntries = 256;
SegmentPlan plan_forward(const Problem& p, bool backward) {
  if (env_int_or("FLASHGDN_PLAN_CACHE", 1) == 0) return plan_forward_uncached(p, backward);
  static std::mutex m;
  static std::unordered_map<std::string, SegmentPlan> cache;
  std::string key = plan_key(p, backward);
  {
    const std::lock_guard<std::mutex> lock(m);
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const SegmentPlan plan = plan_forward_uncached(p, backward);
  const std::lock_guard<std::mutex> lock(m);
  if (cache.size() >= kPlanCacheEntries) cache.clear();
  cache.emplace(std::move(key), plan);
  return plan;
}

// Slots of blocks_per_slot blocks each that fill `waves` waves of one block per SM (at
// least one slot): the looped launches' grid size (for_each_z_slice, launch_seg_combine).
int64_t wave_slots(int64_t waves, int sms, int64_t blocks_per_slot) {
  return std::max<int64_t>(1, waves * sms / blocks_per_slot);
}

// The sequential passes put segments in grid z, at most 65535 blocks: a larger count
// (packed inputs with very many sequences) goes out as several launches, each on a copy of
// the parameters whose z_base says where its slice starts. Looped passes
// (SegParams::looped, for_each_segment_block) launch instead a few slots of blocks_per_z
// blocks each, which walk the device's list of segments; every sequential-pass kernel runs
// one block per SM (136 to 209 KB of shared memory). Phase 0: one wave of slots.
// Several waves of slots that each walk many segments are long, and a last partial wave of
// them ran alone (H100, 16/32 heads, 1024 x 512 tokens: four waves, 18.8 ms against 17.3
// unlooped). Phase 1: four waves. Its work is uneven across heads (only heads whose next
// segment starts exact form summaries), and with one wave the few busy heads' slots walked
// their segments one after the other (2/8 heads, 28672 + 4096 tokens: 0.425 -> 0.506 ms).
template <typename Params, typename Launch>
void for_each_z_slice(const Params& f, int64_t count, int64_t blocks_per_z, int sms,
                      Launch&& launch) {
  constexpr int64_t kMaxZ = 65535;
  if (f.looped) {
    const int64_t slots =
        f.host_slots > 0 ? f.host_slots : wave_slots(f.phase == 1 ? 4 : 1, sms, blocks_per_z);
    Params all = f;
    all.z_base = 0;
    launch(all, static_cast<unsigned>(std::min({count, slots, kMaxZ})));
    return;
  }
  for (int64_t base = 0; base < count; base += kMaxZ) {
    Params slice = f;
    slice.z_base = base;
    launch(slice, static_cast<unsigned>(std::min(kMaxZ, count - base)));
  }
}

template <typename In, int BW>
void launch_state_fwd(const SegmentPlan& plan, const Problem& p, const FwdParams& f,
                      FwdPass pass, cudaStream_t st) {
  static std::once_flag once;
  std::call_once(once, [] {
    set_smem(state_fwd_kernel<In, BW>, StateFwdWgSmem<In, BW>::kBytes);
    set_smem(state_fwd_mma_kernel<In, BW>, StateFwdSmem<In, BW>::kBytes);
    set_smem(state_fwd_mma_kernel<In, BW, __half>, StateFwdSmem<In, BW>::kBytes);
    set_smem(state_fwd_f16_kernel<In, BW>, StateFwdF16Smem<BW>::kBytes);
    set_smem(state_fwd_f16_kernel<In, BW, true>, StateFwdF16Smem<BW>::kBytes);
    set_smem(state_fwd_f16_kernel<In, BW, false, true>, StateFwdF16Smem<BW, true>::kBytes);
  });
  const unsigned blocks_x = (f.phase == 1 ? 2 : 1) * (D / BW);  // phase 1: L and M columns
  for_each_z_slice(f, plan.max_segments, blocks_x * p.Hv, sm_count(p.device_id),
                   [&](const FwdParams& fz, unsigned z) {
    const dim3 grid(blocks_x, static_cast<unsigned>(p.Hv), z);
    if (pass == FwdPass::Wgmma)
      state_fwd_kernel<In, BW><<<grid, NT, StateFwdWgSmem<In, BW>::kBytes, st>>>(fz);
    else if (pass == FwdPass::Tf32)
      state_fwd_mma_kernel<In, BW><<<grid, NT, StateFwdSmem<In, BW>::kBytes, st>>>(fz);
    else if (pass == FwdPass::F16)
      state_fwd_f16_kernel<In, BW, false, true>
          <<<grid, NT, StateFwdF16Smem<BW, true>::kBytes, st>>>(fz);
    else if (pass == FwdPass::F16WU)
      state_fwd_f16_kernel<In, BW><<<grid, NT, StateFwdF16Smem<BW>::kBytes, st>>>(fz);
    else {  // Auto: the guarded fp16 pass, then the tf32 pass on the blocks it flagged
      state_fwd_f16_kernel<In, BW, true><<<grid, NT, StateFwdF16Smem<BW>::kBytes, st>>>(fz);
      check_cuda(cudaGetLastError(), "state_fwd_f16_kernel launch");
      FwdParams r = fz;
      r.redo_pass = true;
      state_fwd_mma_kernel<In, BW, __half><<<grid, NT, StateFwdSmem<In, BW>::kBytes, st>>>(r);
    }
    check_cuda(cudaGetLastError(), "state_fwd_kernel launch");
  });
}


// FLASHGDN_FUSED=<mode>: 0 (default) no fused kernel; 1 gdn_fwd_fused_kernel<., false> (P
// inside, wy_lean_kernel without Q K^T before it), 2 the same at 216 / 72 registers, 3
// gdn_fwd_fused_kernel<., true> (T diag(beta) and P inside, wy_gates_kernel before it), 4 as
// 2 with three stages.
int fused_mode() { return std::clamp(env_int_or("FLASHGDN_FUSED", 0), 0, 4); }

// The kWy of state_fwd_tma_kernel a fused pass takes: cols_tma_wy (FLASHGDN_COLS_TMA=4|5 or the
// default) unless FLASHGDN_FUSED, where set, asks for gdn_fwd_fused_kernel.
int tma_wy_mode(const Problem& p, const SegmentPlan& plan) {
  return fused_mode() == 0 ? cols_tma_wy(p, plan) : 0;
}
// Whether this phase takes kWy 1 (phase 0 always): phase 1 of a split plan (the summaries: no
// outputs, no P) takes the plain ping-pong pass, bf16 k converted in place (kq_bf16: wy_kernel
// wrote no copies). FLASHGDN_TMA_WY_PHASES=3: both phases kWy 1. H100 2026-11-26, ms both ->
// phase 0 only: 8/24 x 32768 0.686 -> 0.631, 16/48 12288+4096 0.745 -> 0.680, 4/16 8192x4
// 0.464 -> 0.428, 16/16 x 32768 0.550 -> 0.525; 4/16 6144+2048 0.206 -> 0.212.
bool tma_wy_phase(int phase) {
  return phase == 0 || ((env_int_or("FLASHGDN_TMA_WY_PHASES", 1) >> phase) & 1) != 0;
}

// Whether kWy 1's looped phase 0 without the host's slot count launches one wave of slots over
// every head's segments (kFlat) rather than a wave of slots a head (grid y = H_v). A wave a head
// leaves SMs idle where H_v does not divide the SM count: 24 heads take 5 slots a head, 120 of
// 132 SMs; 48 heads 2, 96. Default: the flat walk where a wave a head leaves more than 5% of the
// SMs idle. H100 2026-11-27, one process, a wave a head -> flat, ms: 8/24 28672+4096 0.784 ->
// 0.678, 12288+4096 0.430 -> 0.380, 16/48 28672+4096 1.401 -> 1.240, 1024x8 0.357 -> 0.315;
// where a wave a head fills 128 of 132 SMs the flat walk measured 2-4% slower (8/32
// 28672+4096 0.745 -> 0.764, 16/64 16384+16384 1.095 -> 1.143, 16/32 8192x4 0.594 -> 0.611).
// FLASHGDN_FLAT_HEADS=0: never, =1: always.
bool flat_heads(int64_t heads, int sms) {
  const int v = env_int_or("FLASHGDN_FLAT_HEADS", -1);
  if (v >= 0) return v == 1;
  const int64_t per_head = heads * (sms / heads);  // blocks of a wave a head
  return heads <= sms && 20 * per_head < 19 * static_cast<int64_t>(sms);
}

// FLASHGDN_CP_P0_MERGE=<m>: SegParams::p0_merge forced to m (0: the plan's or the device's).
int forced_p0_merge() { return std::max(0, env_int_or("FLASHGDN_CP_P0_MERGE", 0)); }

// cuTensorMapEncodeTiled from the driver, found once through the runtime (no -lcuda link).
using TensorMapEncode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                     const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                     const cuuint32_t*, CUtensorMapInterleave,
                                     CUtensorMapSwizzle, CUtensorMapL2promotion,
                                     CUtensorMapFloatOOBfill);
TensorMapEncode tensor_map_encode() {
  static TensorMapEncode fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<TensorMapEncode>(f);
  }();
  return fn;
}
// Whether TMA can read a tensor at ptr: the driver's encoder found, the address 16-byte aligned.
bool tma_can_read(const void* ptr) {
  return tensor_map_encode() != nullptr && ptr != nullptr &&
         (reinterpret_cast<uintptr_t>(ptr) & 15) == 0;
}
// A 3-D view [tokens][heads][width] of a 16-bit tensor, boxes of 64 tokens x 1 head x 64
// values, 128-byte swizzle, zeros past the tokens' end. False where TMA cannot take it
// (tma_can_read).
bool make_tma_map(CUtensorMap& m, const void* ptr, int64_t tokens, int64_t heads, int width,
                  CUtensorMapDataType type) {
  if (!tma_can_read(ptr)) return false;
  const TensorMapEncode enc = tensor_map_encode();
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(width), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(tokens)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(width) * 2,
                                 static_cast<cuuint64_t>(width * heads) * 2};
  const cuuint32_t box[3] = {64, 1, 64}, elem[3] = {1, 1, 1};
  return enc(&m, type, 3, const_cast<void*>(ptr), dims, strides, box, elem,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
// The tensor maps' element type of the 16-bit inputs.
CUtensorMapDataType tma_in_type(const Problem& p) {
  return p.qkv_dtype == FLASHGDN_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                            : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}
// Whether this launch of the 128-column pass is state_fwd_tma_kernel (FLASHGDN_COLS_TMA=1):
// the plain forward (no records, correction or fused WY part); maps: its tensor maps (k and
// q: the inputs, converted in the kernel where bf16 (kq_bf16), or wy's fp16 copies).
bool tma_pass(const Problem& p, const FwdParams& f, TmaMaps& maps) {
  // K and Q: the bf16 inputs converted in the kernel (kq_bf16), else fp16 (wy's copies or
  // the fp16 inputs)
  const void* k = f.kq_bf16 ? f.k : f.Kh;
  const void* q = f.kq_bf16 ? f.q : f.Qh;
  if (!cols_tma() || f.h != nullptr || f.corr || f.fused || f.Tv16 == nullptr ||
      f.EG == nullptr || k == nullptr ||
      (f.phase == 0 && f.o != nullptr && (f.P16 == nullptr || q == nullptr)))
    return false;
  // FLASHGDN_COLS_TMA_PHASES (a bit a phase, default 3: both): which phases take it (a
  // bisection switch of docs/perf-notes.md version 42)
  if (((env_int_or("FLASHGDN_COLS_TMA_PHASES", 3) >> f.phase) & 1) == 0) return false;
  const CUtensorMapDataType in16 = tma_in_type(p);
  const CUtensorMapDataType f16 = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUtensorMapDataType kq16 = f.kq_bf16 ? in16 : f16;
  if (q == nullptr) q = k;  // no outputs: never loaded
  return make_tma_map(maps.k, k, p.TT, p.Hqk, D, kq16) &&
         make_tma_map(maps.q, q, p.TT, p.Hqk, D, kq16) &&
         make_tma_map(maps.v, f.v, p.TT, p.Hv, D, in16);
}

// Whether this launch of the backward's recomputation (records, no outputs: not a kept
// forward's) is state_fwd_tma_kernel's kRec (rec_tma); maps: k (wy's fp16 copies or the fp16
// inputs) and v (q is never loaded without outputs).
bool tma_record_pass(const Problem& p, const FwdParams& f, TmaMaps& maps) {
  if (!rec_tma() || f.h == nullptr || f.o != nullptr || f.corr || f.fused || f.kq_bf16 ||
      f.Kh == nullptr || f.Tv16 == nullptr || f.EG == nullptr)
    return false;
  const CUtensorMapDataType f16 = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return make_tma_map(maps.k, f.Kh, p.TT, p.Hqk, D, f16) &&
         make_tma_map(maps.q, f.Kh, p.TT, p.Hqk, D, f16) &&
         make_tma_map(maps.v, f.v, p.TT, p.Hv, D, tma_in_type(p));
}

template <typename In>
void launch_state_cols(const SegmentPlan& plan, const Problem& p, const FwdParams& f,
                       cudaStream_t st, bool pdl = false) {
  constexpr bool kBf16 = std::is_same<In, __nv_bfloat16>::value;  // kWy 3's instantiation
  static std::once_flag once;
  std::call_once(once, [] {
    set_smem(state_fwd_cols_kernel<In>, StateFwdColsSmem::kBytes);
    set_smem(state_fwd_cols_kernel<In, true>, StateFwdColsSmem::kRecordBytes);
    set_smem(state_fwd_cols_kernel<In, false, true>, StateFwdColsSmem::kBytes);
    set_smem(state_fwd_cols_kernel<In, false, false, true>, StateFwdColsSmem::ping_bytes(false));
    set_smem(state_fwd_cols_kernel<In, true, false, true>, StateFwdColsSmem::ping_bytes(true));
    set_smem(state_fwd_cols_kernel<In, false, false, true, 3>,
             StateFwdColsSmem::stage_bytes(3, false));
    set_smem(state_fwd_cols_wg_kernel<In>, StateFwdColsWgSmem::kBytes);
    set_smem(state_fwd_cols_wg_kernel<In, true>, StateFwdColsWgSmem::kPingBytes);
    set_smem(state_fwd_cols_wg_kernel<In, true, true>, StateFwdColsWgSmem::kPingBytes);
    set_smem(state_fwd_cols_owg_kernel<In>, StateFwdOwgSmem::kBytes);
    set_smem(gdn_fwd_fused_kernel<In, false>, FwdFusedSmem::bytes(false, 2));
    set_smem(gdn_fwd_fused_kernel<In, false, 2, 216, 72>, FwdFusedSmem::bytes(false, 2));
    set_smem(gdn_fwd_fused_kernel<In, true, 2, 216, 72>, FwdFusedSmem::bytes(true, 2));
    set_smem(gdn_fwd_fused_kernel<In, false, 3, 216, 72>, FwdFusedSmem::bytes(false, 3));
    set_smem(state_fwd_tma_kernel<In>, StateFwdTmaSmem::bytes(2));
    set_smem(state_fwd_tma_kernel<In, 3>, StateFwdTmaSmem::bytes(3));
    set_smem(state_fwd_tma_kernel<In, 2, true>, StateFwdTmaSmem::bytes(2, true));
    set_smem(state_fwd_tma_kernel<In, 3, false, 1>, StateFwdTmaSmem::wy_bytes(3, false));
    set_smem(state_fwd_tma_kernel<In, 2, false, 2>, StateFwdTmaSmem::wy_bytes(2, true));
    set_smem(state_fwd_tma_kernel<In, 3, false, 1, true>, StateFwdTmaSmem::wy_bytes(3, false));
    set_smem(state_fwd_tma_kernel<In, 2, false, 0, false, true>, StateFwdTmaSmem::rec_bytes(2));
    if constexpr (kBf16)
      set_smem(state_fwd_tma_kernel<In, 3, false, 3>, StateFwdTmaSmem::wy_bytes(3, false));
  });
  TmaMaps maps;
  const bool tma_rec = tma_record_pass(p, f, maps);
  const bool tma = !tma_rec && tma_pass(p, f, maps);
  // the fused TMA kernel (tma_wy_mode): its maps are the inputs (fused_in_pass checked TMA can
  // read them)
  int wy_mode = f.tma_wy;
  const bool wy_plain = wy_mode == 1 && !tma_wy_phase(f.phase);  // this phase: the plain pass
  if (wy_plain) wy_mode = 0;
  if (wy_mode > 0) {
    const CUtensorMapDataType in16 = tma_in_type(p);
    if (!make_tma_map(maps.k, f.k, p.TT, p.Hqk, D, in16) ||
        !make_tma_map(maps.q, f.q, p.TT, p.Hqk, D, in16) ||
        !make_tma_map(maps.v, f.v, p.TT, p.Hv, D, in16))
      throw Error("flashgdn: the fused TMA forward (kWy): no tensor map for k, q or v");
  }
  const int64_t subs = f.phase == 0 && f.nsub > 1 ? f.nsub : 1;  // grid z = segments x subs
  const int64_t blocks_x = f.phase == 1 ? 2 : 1;
  // kWy 1's looped phase 0 without the host's slot count: one wave of slots walks every
  // head's segments (state_fwd_tma_kernel's kFlat, for_each_segment_block; grid y = 1) where a
  // wave of slots a head would leave SMs idle (flat_heads).
  const bool flat = wy_mode == 1 && f.looped && f.phase == 0 && f.host_slots <= 0 &&
                    f.h == nullptr && subs == 1 && flat_heads(p.Hv, sm_count(p.device_id));
  const int64_t heads_y = flat ? 1 : p.Hv;
  for_each_z_slice(f, plan.max_segments * subs * (flat ? p.Hv : 1), blocks_x * heads_y,
                   sm_count(p.device_id), [&](const FwdParams& fz, unsigned z) {
    const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(heads_y), z);
    const bool dep = pdl && fz.z_base == 0;  // only the first slice follows the chain's kernel
    const char* what = "state_fwd_cols_kernel launch";
    // phase 0 in merged segments: the sequential schedule (or the device's, under the
    // overlapped launches), the host's factor or the device's (SegParams::p0_merge_dev)
    FwdParams fm = fz;
    if (wy_plain) fm.kq_bf16 = p.qkv_dtype == FLASHGDN_DTYPE_BF16;
    const bool merge_ok =
        f.phase == 0 && !f.corr && (f.starts == 0 || (f.starts == 2 && f.schedule_dev));
    const int forced = forced_p0_merge();
    fm.p0_merge = 1;
    if (merge_ok && forced > 0) fm.p0_merge = forced;
    else if (merge_ok && subs == 1) fm.p0_merge = std::max(1, plan.p0_merge);
    // the device's merge in the forward only (not yet run under the backward's GPU tests;
    // state_pass_params keeps it out of the recomputation's choice as well)
    fm.p0_merge_dev = merge_ok && forced == 0 && f.h == nullptr && f.seg_chunks_dev != nullptr
                          ? f.seg_chunks_dev + 3
                          : nullptr;
    auto go = [&](auto kernel, size_t bytes) {
      launch_kernel(kernel, grid, bytes, st, dep, what, fm);
    };
    auto tgo = [&](auto kernel, size_t bytes, int threads = kTmaThreads) {  // its maps first
      launch_kernel_threads(kernel, grid, threads, bytes, st, dep, "state_fwd_tma_kernel launch",
                            maps, fm);
    };
    using Sm = StateFwdColsSmem;
    const bool ping = cols_ping();
    if (wy_mode == 2) {  // the fused TMA kernel
      tgo(state_fwd_tma_kernel<In, 2, false, 2>, StateFwdTmaSmem::wy_bytes(2, true),
          kTmaWyThreads);
    } else if (wy_mode == 1 && flat) {  // P only, every head's segments from one wave
      tgo(state_fwd_tma_kernel<In, 3, false, 1, true>, StateFwdTmaSmem::wy_bytes(3, false),
          kTmaWyThreads);
    } else if (wy_mode == 1 && kBf16 && tma_k_by_producer()) {  // kWy 3: K by the producer
      if constexpr (kBf16)  // (instantiated for bf16 inputs only)
        tgo(state_fwd_tma_kernel<In, 3, false, 3>, StateFwdTmaSmem::wy_bytes(3, false),
            kTmaWyThreads);
    } else if (wy_mode == 1) {  // P only: three stages (no inverse's tiles)
      tgo(state_fwd_tma_kernel<In, 3, false, 1>, StateFwdTmaSmem::wy_bytes(3, false),
          kTmaWyThreads);
    } else if (f.fused && !wy_plain) {  // (part of) the WY part in the pass (fused_in_pass)
      const int mode = fused_mode();
      auto fgo = [&](auto kernel, size_t bytes) {
        launch_kernel_threads(kernel, grid, kFusedThreads, bytes, st, dep, what, fm);
      };
      using FS = FwdFusedSmem;
      if (mode == 4) fgo(gdn_fwd_fused_kernel<In, false, 3, 216, 72>, FS::bytes(false, 3));
      else if (mode == 3) fgo(gdn_fwd_fused_kernel<In, true, 2, 216, 72>, FS::bytes(true, 2));
      else if (mode == 2) fgo(gdn_fwd_fused_kernel<In, false, 2, 216, 72>, FS::bytes(false, 2));
      else fgo(gdn_fwd_fused_kernel<In, false>, FS::bytes(false, 2));
    } else if (f.h == nullptr && cols_wgmma_order())
      go(state_fwd_cols_wg_kernel<In, true, true>, StateFwdColsWgSmem::kPingBytes);
    else if (f.h == nullptr && cols_wgmma_ping())
      go(state_fwd_cols_wg_kernel<In, true>, StateFwdColsWgSmem::kPingBytes);
    else if (f.h == nullptr && cols_wgmma())
      go(state_fwd_cols_wg_kernel<In>, StateFwdColsWgSmem::kBytes);
    else if (f.corr && f.phase == 1)  // exact segments' outputs by correction (the planner
      // takes them at 16 / 32 columns only; here forced: the barrier schedule, as tested)
      go(state_fwd_cols_kernel<In, false, true>, Sm::kBytes);
    else if (tma_rec)  // the backward's recomputation on the TMA kernel (rec_tma)
      tgo(state_fwd_tma_kernel<In, 2, false, 0, false, true>, StateFwdTmaSmem::rec_bytes(2));
    else if (f.h != nullptr)  // the backward's recomputation (launch.cu bwd_cols)
      ping ? go(state_fwd_cols_kernel<In, true, false, true>, Sm::ping_bytes(true))
           : go(state_fwd_cols_kernel<In, true>, Sm::kRecordBytes);
    else if (f.phase == 0 && f.o != nullptr && cols_owg() && !(f.debug & 1))
      launch_kernel_threads(state_fwd_cols_owg_kernel<In>, grid, kOwgThreads,
                            StateFwdOwgSmem::kBytes, st, dep, what, fm);
    else if (tma && cols_tma_ssy())
      tgo(state_fwd_tma_kernel<In, 2, true>, StateFwdTmaSmem::bytes(2, true));
    else if (tma && cols_three_stages())
      tgo(state_fwd_tma_kernel<In, 3>, StateFwdTmaSmem::bytes(3));
    else if (tma)
      tgo(state_fwd_tma_kernel<In>, StateFwdTmaSmem::bytes(2));
    else if (ping && cols_three_stages())
      go(state_fwd_cols_kernel<In, false, false, true, 3>, Sm::stage_bytes(3, false));
    else
      ping ? go(state_fwd_cols_kernel<In, false, false, true>, Sm::ping_bytes(false))
           : go(state_fwd_cols_kernel<In>, Sm::kBytes);
  });
}

// seg_combine_kernel: one block per sequence for fixed-length inputs; packed inputs walk
// the device's list of split sequences with about four waves of slots (a block of 139 KB is
// alone on its SM), each slot every gridDim.x-th of them: like phase 1, the work is uneven
// across heads (only exact heads chain), so one wave made the busy heads' slots walk
// their sequences one after the other.
void launch_seg_combine(const Problem& p, const SegParams& f, bool reverse, cudaStream_t st,
                        bool pdl = false) {
  static std::once_flag once;
  std::call_once(once, [] { set_smem(seg_combine_kernel, kCombineSmem); });
  constexpr int64_t kColBlocks = D / kCombineCols;
  const int64_t per_slot = p.Hv * kColBlocks;  // blocks of one sequence slot
  const int64_t slots = f.split_seqs != nullptr
                            ? std::min(p.N, wave_slots(4, sm_count(p.device_id), per_slot))
                            : p.N;
  const dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(p.Hv), kColBlocks);
  launch_kernel(seg_combine_kernel, grid, kCombineSmem, st, pdl, "seg_combine_kernel launch", f,
                reverse);
}

// The forward's chain (the state pass's and the recomputation's): the combine's walk on
// tensor cores, seg_walk_kernel, with FLASHGDN_CP_WALK=<16|32> columns a block (default 16);
// FLASHGDN_CP_WALK=0 the chain before 2026-11-26 (the scan where the plan has its levels,
// else seg_combine_kernel; walk_cols). H200, 2026-11-26, 4/16 heads x 32768 tokens (15
// steps): the chain 48 us as scan levels, 41 us at 32 columns, 27 us at 16 (64: 82 us).
// Slots as launch_seg_combine's (a block of ~153 KB at 16 columns is alone on its SM).
void launch_seg_walk(const Problem& p, const SegParams& f, bool reverse, cudaStream_t st,
                     bool pdl) {
  static std::once_flag once;
  std::call_once(once, [] {
    set_smem(seg_walk_kernel<16>, walk_smem<16>());
    set_smem(seg_walk_kernel<16, 3>, walk_smem<16, 3>());
    set_smem(seg_walk_kernel<32>, walk_smem<32>());
  });
  const int cols = walk_cols();
  // FLASHGDN_CP_WALK_STAGES=3 (16 columns; opt-in, timed with no change: H200 4/16 x 32768
  // 0.509 ms both ways): M three steps ahead
  const bool three = cols == 16 && env_int_or("FLASHGDN_CP_WALK_STAGES", 2) == 3;
  const int64_t col_blocks = D / cols;
  const int64_t per_slot = p.Hv * col_blocks;  // blocks of one sequence slot
  const int64_t slots = f.split_seqs != nullptr
                            ? std::min(p.N, wave_slots(4, sm_count(p.device_id), per_slot))
                            : p.N;
  const dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(p.Hv),
                  static_cast<unsigned>(col_blocks));
  if (cols == 32)
    launch_kernel(seg_walk_kernel<32>, grid, walk_smem<32>(), st, pdl, "seg_walk_kernel launch",
                  f, reverse);
  else if (three)
    launch_kernel(seg_walk_kernel<16, 3>, grid, walk_smem<16, 3>(), st, pdl,
                  "seg_walk_kernel launch", f, reverse);
  else
    launch_kernel(seg_walk_kernel<16>, grid, walk_smem<16>(), st, pdl, "seg_walk_kernel launch",
                  f, reverse);
}

// The forward's combine as a log-depth scan (seg_scan_kernel, scan_levels): one launch per
// level, each its predecessor's programmatic dependent (the first phase 1's), ping-ponging
// between phase 1's (seg_M, seg_L) and (scan_M, scan_L). False (nothing launched) where the
// plan takes the combine's walk.
bool launch_seg_scan(const Problem& p, const SegmentPlan& plan, const FwdBuffers& b,
                     const SegParams& f, cudaStream_t st) {
  const int levels = scan_levels(p, plan);
  if (levels == 0 || b.scan_M == nullptr || f.corr) return false;
  static std::once_flag once;
  std::call_once(once, [] { set_smem(seg_scan_kernel, kSubStartSmem); });
  const dim3 grid(static_cast<unsigned>(plan.max_segments), 4,
                  static_cast<unsigned>((p.Hv + kScanHeads - 1) / kScanHeads));
  float* bufs[2][2] = {{f.seg_M, f.seg_L}, {b.scan_M, b.scan_L}};
  for (int l = 0; l < levels; ++l) {
    float** src = bufs[l & 1];
    float** dst = bufs[(l + 1) & 1];
    launch_kernel(seg_scan_kernel, grid, kSubStartSmem, st, true, "seg_scan_kernel launch", f, l,
                  static_cast<const float*>(src[0]), static_cast<const float*>(src[1]), dst[0],
                  dst[1]);
  }
  return true;
}

template <typename In>
void launch_seg_correct(const Problem& p, const FwdParams& f, cudaStream_t st) {
  if (!f.corr || p.max_chunks() == 0) return;
  static std::once_flag once;
  std::call_once(once, [] { set_smem(seg_correct_kernel<In>, kCorrSmem); });
  const dim3 grid(static_cast<unsigned>(p.max_chunks()), static_cast<unsigned>(p.Hv));
  seg_correct_kernel<In><<<grid, NT, kCorrSmem, st>>>(f, f.o);
  check_cuda(cudaGetLastError(), "seg_correct_kernel launch");
}

void launch_sub_start(const Problem& p, const SegmentPlan& plan, const SegParams& f,
                      cudaStream_t st) {
  if (f.nsub <= 1) return;
  static std::once_flag once;
  std::call_once(once, [] { set_smem(sub_start_kernel, kSubStartSmem); });
  const dim3 grid(static_cast<unsigned>(plan.max_segments * (f.nsub - 1)),
                  static_cast<unsigned>(p.Hv), D / kSubCols);
  // right after the combine in the chain's stream (no correction with sub-segments)
  launch_kernel(sub_start_kernel, grid, kSubStartSmem, st, true, "sub_start_kernel launch", f);
}

// The largest divisor of n that is at most cap (>= 1): the value heads of one q/k head a WY
// block takes.
int largest_divisor_up_to(int n, int cap) {
  int best = 1;
  for (int d = 1; d <= cap; ++d)
    if (n % d == 0) best = d;
  return best;
}

// Value heads a block of the default pass's wy_kernel takes: the largest divisor of
// H_v / H_qk up to kWyMaxHeads (the heads of one q/k head share its K, Q and their products);
// FLASHGDN_WY_HEADS=<n> caps it (1: one head a block, the kernel before 2026-11-25).
int wy_heads(const Problem& p) {
  const int cap = std::max(1, std::min(kWyMaxHeads, env_int_or("FLASHGDN_WY_HEADS", kWyMaxHeads)));
  return largest_divisor_up_to(static_cast<int>(p.Hv / p.Hqk), cap);
}

// A block's value heads through each phase of wy_kernel together (wy_batched_kernel, the
// default where a block takes several); FLASHGDN_WY_BATCHED=0 one head after another
// (wy_kernel<In, true, true>, bit-identical).
bool wy_batched() { return env_int_or("FLASHGDN_WY_BATCHED", 1) != 0; }
// Blocks of two value heads in wy_batched_kernel<In, 2> (47 KB, 4 blocks per SM; the same
// bits) unless FLASHGDN_WY_OCC4=0 (the 4-head kernel's 74 KB, 3 blocks per SM).
bool wy_occ4() { return env_int_or("FLASHGDN_WY_OCC4", 1) != 0; }

// Value heads a wy_lean_kernel block takes (one warpgroup a block, the inverse by doubling),
// 0 for wy_batched_kernel / wy_kernel. The forward only (no T or fp32 P asked). By default
// two heads a block where H_v / H_qk is even, else the largest divisor up to kWyMaxHeads
// (H100, 2026-11-26, docs/benchmarks.md "Session 38": 16/32 x 32768 0.946 -> 0.887 ms,
// 32/32 1.036 -> 0.984, 8/24 within 2% either way; four-head blocks and one-head blocks
// of even ratios slower). FLASHGDN_WY_LEAN=<n>: the largest divisor of H_v / H_qk up to n
// (0: never).
// T or fp32 P asked (the backward's recomputation, the kept forward): only with
// FLASHGDN_WY_LEAN_T=1 (wy_lean_kernel<., ., true>; opt-in: tested, but 447 against 401 us
// at 16/32 x 32768 in the backward, docs/perf-notes.md version 39).
bool wy_lean_wants_t(const FwdParams& f) {
  return f.Tmat != nullptr || f.T16 != nullptr || f.Pmat != nullptr;
}
int wy_lean_heads(const Problem& p, const FwdParams& f) {
  if (f.Tv16 == nullptr) return 0;
  if (wy_lean_wants_t(f) && env_int_or("FLASHGDN_WY_LEAN_T", 0) == 0) return 0;
  const int group = static_cast<int>(p.Hv / p.Hqk);
  int cap = std::min(kWyMaxHeads, env_int_or("FLASHGDN_WY_LEAN", -1));
  if (cap < 0) cap = group % 2 == 0 ? 2 : kWyMaxHeads;
  if (cap == 0) return 0;
  return largest_divisor_up_to(group, cap);
}

// wy_lean_kernel without q's tile (kQ = false) where nothing of q is asked (no P16: the fused
// forward's kWy forms P; no fp16 copies; no kT): at one value head a block (H_v == H_qk, or
// any ratio under FLASHGDN_WY_LEAN=1) K's tile under one head's tiles, 19 KB, eight blocks an
// SM instead of five; at two, |k|^2 in the tiles' padding, 37,888 bytes, six instead of five.
// FLASHGDN_WY_LEAN_KONLY=<n>: up to n heads a block (default 2; 0 keeps the kernel with q's
// tile everywhere; the same bits either way).
bool wy_lean_k_only(const FwdParams& f, int heads) {
  return heads <= std::min(2, env_int_or("FLASHGDN_WY_LEAN_KONLY", 2)) && f.P16 == nullptr &&
         f.Kh_w == nullptr && f.Qh_w == nullptr && !wy_lean_wants_t(f);
}

template <typename In>
void launch_wy(const Problem& p, FwdParams f, cudaStream_t st) {
  static std::once_flag once;
  std::call_once(once, [] {
    set_smem(wy_kernel<In>, kWySmem<false>);
    set_smem(wy_kernel<In, true>, kWySmem<true>);
    set_smem(wy_kernel<In, true, true>, kWySmem<true, true>);
    set_smem(wy_batched_kernel<In, 2>, wy_batched_smem(2));
    set_smem(wy_batched_kernel<In, kWyMaxHeads>, wy_batched_smem(kWyMaxHeads));
    set_smem(wy_lean_kernel<In, 1>, wy_lean_smem(1));
    set_smem(wy_lean_kernel<In, 1, false, false>, wy_lean_smem(1, false));
    set_smem(wy_lean_kernel<In, 2>, wy_lean_smem(2));
    set_smem(wy_lean_kernel<In, 2, false, false>, wy_lean_smem(2, false));
    set_smem(wy_lean_kernel<In, 3>, wy_lean_smem(3));
    set_smem(wy_lean_kernel<In, kWyMaxHeads>, wy_lean_smem(kWyMaxHeads));
    set_smem(wy_lean_kernel<In, 1, true>, wy_lean_smem(1));
    set_smem(wy_lean_kernel<In, 2, true>, wy_lean_smem(2));
    set_smem(wy_lean_kernel<In, 3, true>, wy_lean_smem(3));
    set_smem(wy_lean_kernel<In, kWyMaxHeads, true>, wy_lean_smem(kWyMaxHeads));
  });
  if (p.max_chunks() == 0) return;
  // gdn_fwd_fused_kernel (FLASHGDN_FUSED=3) or state_fwd_tma_kernel's kWy (FLASHGDN_COLS_TMA=4)
  // forms T diag(beta) and P
  if (f.fused && (f.tma_wy == 2 || fused_mode() == 3)) {
    f.wy_heads = largest_divisor_up_to(static_cast<int>(p.Hv / p.Hqk), kWyMaxHeads);
    const dim3 grid(static_cast<unsigned>(p.max_chunks() * (p.Hv / f.wy_heads)));
    wy_gates_kernel<In><<<grid, kLeanThreads, 0, st>>>(f);
    check_cuda(cudaGetLastError(), "wy_gates_kernel launch");
    return;
  }
  if (const int nl = wy_lean_heads(p, f); nl > 0) {
    f.wy_heads = nl;
    const dim3 grid(static_cast<unsigned>(p.max_chunks() * (p.Hv / nl)));
    const bool k_only = wy_lean_k_only(f, nl);  // no T asked (so never with kT), 1 or 2 heads
    auto go = [&](auto with_t) {
      constexpr bool kT = decltype(with_t)::value;
      if (k_only && nl == 1)
        wy_lean_kernel<In, 1, false, false><<<grid, kLeanThreads, wy_lean_smem(1, false), st>>>(f);
      else if (k_only)
        wy_lean_kernel<In, 2, false, false><<<grid, kLeanThreads, wy_lean_smem(2, false), st>>>(f);
      else if (nl == 1)
        wy_lean_kernel<In, 1, kT><<<grid, kLeanThreads, wy_lean_smem(1), st>>>(f);
      else if (nl == 2)
        wy_lean_kernel<In, 2, kT><<<grid, kLeanThreads, wy_lean_smem(2), st>>>(f);
      else if (nl == 3)
        wy_lean_kernel<In, 3, kT><<<grid, kLeanThreads, wy_lean_smem(3), st>>>(f);
      else
        wy_lean_kernel<In, kWyMaxHeads, kT>
            <<<grid, kLeanThreads, wy_lean_smem(kWyMaxHeads), st>>>(f);
    };
    if (wy_lean_wants_t(f)) go(std::true_type{});
    else go(std::false_type{});
    check_cuda(cudaGetLastError(), "wy_lean_kernel launch");
    return;
  }
  f.wy_heads = f.Tv16 != nullptr ? wy_heads(p) : 1;
  const dim3 grid(static_cast<unsigned>(p.max_chunks() * (p.Hv / f.wy_heads)));
  if (f.Tv16 != nullptr && f.wy_heads == 2 && wy_batched() && wy_occ4())
    wy_batched_kernel<In, 2><<<grid, NT, wy_batched_smem(2), st>>>(f);
  else if (f.Tv16 != nullptr && f.wy_heads > 1 && wy_batched())
    wy_batched_kernel<In, kWyMaxHeads><<<grid, NT, wy_batched_smem(kWyMaxHeads), st>>>(f);
  else if (f.Tv16 != nullptr && f.wy_heads > 1)
    wy_kernel<In, true, true><<<grid, NT, kWySmem<true, true>, st>>>(f);
  else if (f.Tv16 != nullptr)
    wy_kernel<In, true><<<grid, NT, kWySmem<true>, st>>>(f);
  else
    wy_kernel<In><<<grid, NT, kWySmem<false>, st>>>(f);
  check_cuda(cudaGetLastError(), "wy_kernel launch");
}

template <typename In, int BW>
void launch_state_bwd_tc(const SegmentPlan& plan, const Problem& p, const BwdParams& g,
                         cudaStream_t st) {
  constexpr size_t smem = StateBwdSmem<In, BW>::kBytes;
  static std::once_flag once;
  std::call_once(once, [] { set_smem(state_bwd_tc_kernel<In, BW>, smem); });
  const unsigned blocks_x = (g.phase == 1 ? 2 : 1) * (D / BW);  // phase 1: L and M columns
  for_each_z_slice(g, plan.max_segments, blocks_x * p.Hv, sm_count(p.device_id),
                   [&](const BwdParams& gz, unsigned z) {
    state_bwd_tc_kernel<In, BW><<<dim3(blocks_x, static_cast<unsigned>(p.Hv), z), NT, smem,
                                  st>>>(gz);
    check_cuda(cudaGetLastError(), "state_bwd_tc_kernel launch");
  });
}

// FLASHGDN_BWD_ROWSCALE=1 (opt-in; tested on the H100, 1-2% slower, docs/benchmarks.md
// session 26): the reverse pass's power of two
// per value column instead of per warp (state_bwd_cols.cuh, kRow).
template <typename In>
void launch_state_bwd_cols(const SegmentPlan& plan, const Problem& p, const BwdParams& g,
                           cudaStream_t st) {
  constexpr size_t smem = StateBwdColsSmem<In>::kBytes;
  static std::once_flag once;
  std::call_once(once, [] {
    set_smem(state_bwd_cols_kernel<In, false>, smem);
    set_smem(state_bwd_cols_kernel<In, true>, smem);
    set_smem(state_bwd_cols_kernel<In, false, 1>, smem);
    set_smem(state_bwd_cols_kernel<In, true, 1>, smem);
    set_smem(state_bwd_cols_kernel<In, false, 2>, smem);
  });
  const bool rows = env_int_or("FLASHGDN_BWD_ROWSCALE", 0) == 1;
  // the ready queue's signals in phase 0 (state_bwd_cols_segment's kSignal, bwd_queue's
  // choice); one a warp with the row scale
  const int signal = g.phase != 0 ? 0 : rows && g.rq_signal != 0 ? 1 : g.rq_signal;
  const int64_t blocks_x = g.phase == 1 ? 2 : 1;
  for_each_z_slice(g, plan.max_segments, blocks_x * p.Hv, sm_count(p.device_id),
                   [&](const BwdParams& gz, unsigned z) {
    const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(p.Hv), z);
    if (signal == 2) state_bwd_cols_kernel<In, false, 2><<<grid, NT, smem, st>>>(gz);
    else if (rows && signal) state_bwd_cols_kernel<In, true, 1><<<grid, NT, smem, st>>>(gz);
    else if (signal) state_bwd_cols_kernel<In, false, 1><<<grid, NT, smem, st>>>(gz);
    else if (rows) state_bwd_cols_kernel<In, true><<<grid, NT, smem, st>>>(gz);
    else state_bwd_cols_kernel<In, false><<<grid, NT, smem, st>>>(gz);
    check_cuda(cudaGetLastError(), "state_bwd_cols_kernel launch");
  });
}

// Whether the sequential passes launch their bw-column kernel: the planner's column block,
// or both when the device picks one (the other returns at once).
bool launches(const SegmentPlan& plan, int bw) {
  if (bw == D && !plan.cols) return false;  // 128: state_fwd_cols_kernel (SegmentPlan::cols)
  return plan.device_col_block ? (plan.device_col_blocks & col_block_bit(bw)) != 0
                               : plan.col_block == bw;
}

// Whether the device picks the schedule (SegmentPlan::device_overlap; FLASHGDN_CP_OVERLAP
// set forces the host's).
bool device_schedule(const SegmentPlan& plan) {
  return plan.device_overlap && env_int_or("FLASHGDN_CP_OVERLAP", -1) < 0;
}

// The chain's stream and its fork/join events, one set per host thread and device, created
// on first use (per thread: two threads never share the stream, so one thread's graph
// capture cannot take in another's work). Null while `st` is being captured and this thread
// has no chain stream on the device yet: creating one is left to an eager call, and the
// caller runs the sequential schedule.
struct ChainStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  // the chain stream's next work waits for what `st` has so far (fork_from), and `st`'s for
  // what the chain stream has (join_into): events, so graph-capturable
  void fork_from(cudaStream_t st) const {
    check_cuda(cudaEventRecord(fork, st), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream, fork, 0), "cudaStreamWaitEvent");
  }
  void join_into(cudaStream_t st) const {
    check_cuda(cudaEventRecord(join, stream), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(st, join, 0), "cudaStreamWaitEvent");
  }
};
ChainStream* chain_stream(int device, cudaStream_t st) {
  thread_local ChainStream cache[64];
  if (device < 0 || device >= 64) throw Error("flashgdn: device index out of range");
  ChainStream& c = cache[device];
  if (c.stream == nullptr) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(st, &status), "cudaStreamIsCapturing");
    if (status != cudaStreamCaptureStatusNone) return nullptr;
    int least = 0, greatest = 0;
    check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest),
               "cudaDeviceGetStreamPriorityRange");
    check_cuda(cudaStreamCreateWithPriority(&c.stream, cudaStreamNonBlocking, greatest),
               "cudaStreamCreateWithPriority");
    check_cuda(cudaEventCreateWithFlags(&c.fork, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventCreateWithFlags(&c.join, cudaEventDisableTiming), "cudaEventCreate");
  }
  return &c;
}

// The phases of a sequential pass (the forward's, the recomputation or the reverse pass)
// over the plan's segments: `launch(stream, pdl)` runs the pass's kernels at f's phase and
// starts (pdl: after `between`, as the chain's programmatic dependents; launch_kernel),
// `between(stream)` turns phase 1's summaries into entering states (the combine, the
// sub-segment starts). Split: phase 1, between, then phase 0; with FLASHGDN_CP_OVERLAP the
// phase 0 of segments that do not start exact (they need nothing from the chain) runs on
// the caller's stream beside the chain on the chain stream, forked and joined by events;
// the sequential order when no chain stream can be had.
template <typename Params, typename Launch, typename Between>
void run_phases(int device, bool split, bool overlap, Params& f, cudaStream_t st,
                Launch&& launch, Between&& between) {
  const ChainStream* cs = split && overlap ? chain_stream(device, st) : nullptr;
  if (cs != nullptr) {
    cs->fork_from(st);
    f.phase = 0;
    f.starts = 1;  // segments from h0 / dht or a warm-up
    launch(st, false);
    f.phase = 1;
    f.starts = 0;
    launch(cs->stream, false);
    between(cs->stream);
    f.phase = 0;
    f.starts = 2;  // exact segments, from seg_in (or their sub-segments' records)
    launch(cs->stream, true);
    f.starts = 0;
    cs->join_into(st);
    return;
  }
  if (split) {  // exact entering states of the segments that need them
    f.phase = 1;
    launch(st, false);
    between(st);
  }
  f.phase = 0;
  launch(st, split);
}

// The reverse pass over the forward's segments (last to first), with the summaries and
// their chaining first when a segment starts exactly from its successor.
template <typename In>
void run_reverse_pass(const Problem& p, const SegmentPlan& plan, BwdParams& g, cudaStream_t st) {
  auto launch = [&](cudaStream_t s, bool /*pdl: the reverse pass's kernels wait on none*/) {
    if (g.rec16) {
      launch_state_bwd_cols<In>(plan, p, g, s);
      return;
    }
    if (launches(plan, 16)) launch_state_bwd_tc<In, 16>(plan, p, g, s);
    if (launches(plan, 32)) launch_state_bwd_tc<In, 32>(plan, p, g, s);
  };
  run_phases(p.device_id, plan.split, cp_overlap(plan), g, st, launch,
             [&](cudaStream_t s) { launch_seg_combine(p, g, true, s); });
}

template <typename In, int BW>
void launch_state_bwd(const Problem& p, const BwdParams& g, cudaStream_t st) {
  static std::once_flag once;
  std::call_once(once, [] { set_smem(state_bwd_kernel<In, BW>, state_bwd_smem<BW>()); });
  state_bwd_kernel<In, BW><<<dim3(static_cast<unsigned>(p.N), static_cast<unsigned>(p.Hv), D / BW),
                             NT, state_bwd_smem<BW>(), st>>>(g);
  check_cuda(cudaGetLastError(), "state_bwd_kernel launch");
}

// The state pass's parameters that follow from the plan and the workspace (f's segments,
// the device's choices, the correction buffers), and the device planner's brief. Host work
// only: the backward on a kept forward's workspace needs f exactly as the forward had it.
DeviceSegChoice state_pass_params(const Problem& p, const SegmentPlan& plan, const FwdBuffers& b,
                                  FwdParams& f) {
  DeviceSegChoice choice{};
  const bool dev_schedule = device_schedule(plan);
  if (plan.device_choice || plan.device_col_block) {
    // (the recomputation, f.h set, runs the backward's plan)
    static_cast<DeviceChoiceParams&>(choice) =
        device_choice_params(plan, plan_cost(f.h != nullptr), f.h == nullptr, dev_schedule,
                             b.nsub, p.Hv, sm_count(p.device_id));
    choice.chosen = b.seg_chunks;
    // the caller's host copy of cu_seqlens: the same choice made here (plan_kernel then
    // only writes it; FLASHGDN_HOST_CHOICE=0 leaves it to the device, for measurements)
    if (host_choice(p)) {
      device_choice_on_host(choice, p.host_chunks.data(), p.N, plan.seg_chunks, choice.preset,
                            plan.host_exact);
      choice.has_preset = true;
    }
  }
  f.seg_chunks = plan.seg_chunks;
  const int64_t nch = (p.T + C - 1) / C;
  f.segs_per_seq = p.varlen() ? 0 : std::max<int64_t>(1, (nch + f.seg_chunks - 1) / f.seg_chunks);
  f.seg_offsets = b.seg_offsets;
  f.split_seqs = b.split_seqs;
  f.seg_items = b.seg_items;
  // looped where the host sized the grids for lengths it does not know: packed sequences
  // (one packed sequence's segments are exact)
  // (not under the overlapped launches the device schedules: there, few sequences (the plan's
  // fit test) and a block per segment, so that the exact segments' blocks take SMs as the
  // warm-started ones end)
  f.looped = b.split_seqs != nullptr && p.N > 1 && b.nsub <= 1 && !dev_schedule;
  f.host_slots = plan.host_segments;
  f.seg_chunks_dev = plan.device_choice ? b.seg_chunks : nullptr;
  f.col_block_dev = plan.device_col_block ? b.seg_chunks + 1 : nullptr;
  f.schedule_dev = dev_schedule ? b.seg_chunks + 2 : nullptr;
  if (const char* v = std::getenv("FLASHGDN_DEBUG")) f.debug = std::atoi(v);
  f.slow_lookup = (f.debug & 4096) != 0;
  f.seg_L = b.seg_L;
  f.seg_M = b.seg_M;
  f.seg_in = b.seg_in;
  f.nsub = b.nsub;
  f.sub_L = b.sub_L;
  f.sub_M = b.sub_M;
  f.corr = b.o_loc != nullptr && f.h == nullptr;
  f.o_loc = b.o_loc;
  f.q_eff = b.q_eff;
  f.corr_ld = p.TT;
  f.corr_ht = f.corr ? f.ht : nullptr;
  // SegmentPlan::exact_reach (the planner's kReachSegChunks splits; FLASHGDN_EXACT_REACH=1 also
  // the forward's other host-planned sequential 128-column splits, for measurements with
  // FLASHGDN_CP_SEG): a segment whose warm-up would reach the sequence's start starts exact.
  // The backward (the default since session 59; FLASHGDN_BWD_EXACT_REACH=0 not): the same for
  // its recomputation (f.h: also the kept forward's, which must record what the
  // recomputation would) and, through the SegParams it hands on, its reverse pass (segments
  // whose walk reaches the sequence's end start exact instead of from dht): the short split's
  // 12-chunk segments reach both ends. Its passes run 128 columns where bwd_cols says so (the
  // plan's col_block may say 16 or 32). H200 2026-11-27, fwd+bwd ms, =0 -> default: 2/4 x
  // 8k_2seq 0.602 -> 0.494, 4/8 x 8k_2seq 0.708 -> 0.602, 8/16 x 8k_2seq 1.043 -> 0.980; the
  // short split's other 8k rows 4-12% faster, 2/4 x 32k_1seq 3%, the other 22 rows within
  // 0.5% (0.969x geomean over the 32).
  const bool fwd_reach = (plan.exact_reach ||
                          (env_int_or("FLASHGDN_EXACT_REACH", 0) == 1 && f.h == nullptr)) &&
                         plan.col_block == 128;
  const bool bwd_reach =
      env_int_or("FLASHGDN_BWD_EXACT_REACH", 1) == 1 && f.h != nullptr && bwd_cols(p);
  f.exact_reach = (fwd_reach || bwd_reach) && !f.corr && !plan.overlap &&
                  f.seg_chunks_dev == nullptr && !dev_schedule;
  return choice;
}

// Whether the pass's only readers of fp16 k and q are state_fwd_cols_kernel's ping-pong
// forward passes (both phases), which then copy the bf16 tiles and convert them in shared
// memory (FwdParams::kq_bf16): bf16 inputs, the plain forward (not the backward's
// recomputation, not a kept forward), the planner's 128 columns only (no 16 / 32-column
// pass, not the device's column choice), no correction, the default kernel (not three
// stages, the output warpgroup or wgmma). wy_kernel then writes no copies: 2 x 2 bytes a
// token and q/k head less written, and the pass reads the inputs instead of the copies.
// The conversions cost each value head's blocks (a 128-thread pass over two tiles a chunk by
// warpgroup 0, which issues no copies), the copies each q/k head's: taken where a q/k head
// has at most two value heads (H100, CUDA graphs, 2026-11-26, forward ms copies ->
// conversions: 32/32 x 32768 1.206 -> 1.033, x 8192 0.380 -> 0.341; 16/32 x 32768 0.988 ->
// 0.946; three and four value heads a q/k head within 0.5% either way: 8/24, 16/48, 4/16 x
// 32768 0.500 -> 0.498, 8/32 x 8192 0.308 -> 0.309; with the issuing warpgroup converting,
// four were 0.5-2.3% slower).
// With FLASHGDN_COLS_TMA=1 at any number of value heads a q/k head (state_fwd_tma_kernel
// converts in its producer warpgroup, beside the state warpgroups).
// FLASHGDN_KQ_COPIES=1 keeps the copies (the same bits; for measurements and the tests).
// =0 converts at any number of value heads a q/k head (for measurements). Converting a chunk
// ahead with three stages (at the head of the issuing warpgroup's step) measured slower
// (H100 2026-11-26: 16/32 x 32768 0.961 -> 1.052 ms, 4/16 x 32768 0.507 -> 0.550).
bool kq_in_pass(const Problem& p, const SegmentPlan& plan, const FwdParams& f) {
  const int forced = env_int_or("FLASHGDN_KQ_COPIES", -1);
  return p.qkv_dtype == FLASHGDN_DTYPE_BF16 &&
         (p.Hv <= 2 * p.Hqk || forced == 0 || cols_tma()) &&
         f.Kh_w != nullptr && f.h == nullptr && !f.corr && !plan.device_col_block &&
         launches(plan, D) && cols_ping() && (!cols_three_stages() || cols_tma()) &&
         !cols_owg() && (!cols_wgmma() || cols_wgmma_ping()) && forced != 1;
}

// Whether the plain forward's state pass is gdn_fwd_fused_kernel (fwd_fused.cuh: P, and
// with FLASHGDN_FUSED=3 T diag(beta), formed inside it; fused_mode): the W/U0-free pass at
// the planner's 128 columns only (not the device's column choice), no records, no T or fp32
// P kept, no correction, the default ping-pong kernel (no three stages of its own, no output
// warpgroup, no wgmma).
// With state_fwd_tma_kernel's kWy (cols_tma_wy: the default by plan, but the overlapped
// schedule below 32 value heads, or FLASHGDN_COLS_TMA=4|5) the same, where TMA can read k, q and v (tma_can_read);
// FLASHGDN_FUSED, where set, wins (wy_mode: tma_wy_mode's).
bool fused_in_pass(const Problem& p, const SegmentPlan& plan, const FwdParams& f, int wy_mode) {
  const bool tma_wy =
      wy_mode > 0 && tma_can_read(f.k) && tma_can_read(f.q) && tma_can_read(f.v);
  return (fused_mode() > 0 || tma_wy) && f.Tv16 != nullptr && f.EG != nullptr &&
         f.h == nullptr && f.Tmat == nullptr && f.T16 == nullptr && f.Pmat == nullptr &&
         !f.corr && !plan.device_col_block && launches(plan, D) && cols_ping() &&
         !cols_three_stages() && !cols_owg() && !cols_wgmma() &&
         (!cols_tma() || cols_tma_wy(p, plan) > 0);
}

// The planner kernel, wy_kernel and the state pass (with its context-parallel phases)
// for the forward (f.o, f.ht set), the backward's recomputation (f.h, f.U set) or both (a
// forward that keeps its records for the backward).
template <typename In>
void run_state_pass(const Problem& p, const SegmentPlan& plan, const FwdBuffers& b, FwdParams& f,
                    cudaStream_t st) {
  const DeviceSegChoice choice = state_pass_params(p, plan, b, f);
  const int wy_mode = tma_wy_mode(p, plan);
  f.fused = fused_in_pass(p, plan, f, wy_mode);
  f.tma_wy = f.fused ? wy_mode : 0;
  f.kq_bf16 = !f.fused && kq_in_pass(p, plan, f);
  if (f.fused) f.P16 = nullptr;  // P is formed in the pass (wy_lean_kernel: no Q K^T)
  if (f.kq_bf16 || f.fused) f.Kh_w = f.Qh_w = nullptr;  // wy_kernel: no copies
  // FLASHGDN_DEBUG & 256 (tests): the copies' space NaN and never written, so that any pass
  // still reading it shows (tests/test_context_parallel.py test_kq_bf16_tiles)
  if ((f.debug & 256) && b.Kh != nullptr && f.h == nullptr) {
    const size_t bytes = sizeof(__half) * static_cast<size_t>(p.TT * p.Hqk) * D;
    check_cuda(cudaMemsetAsync(b.Kh, 0xff, bytes, st), "debug poison of Kh");
    check_cuda(cudaMemsetAsync(b.Qh, 0xff, bytes, st), "debug poison of Qh");
    f.Kh_w = f.Qh_w = nullptr;
  }
  // The device's choice (its cost model, ~13 us on one SM: H100, 2/8 heads 28672 + 4096
  // tokens, 2026-11-25) needs nothing of wy_kernel, which needs only the chunk table: the
  // table first, then the choice and the segment tables on the chain stream beside wy_kernel
  // (FLASHGDN_PLAN_ASIDE=0: the whole planner before wy_kernel in the call's stream; =2:
  // wy_kernel launched before the choice; measurement switches)
  const int aside = env_int_or("FLASHGDN_PLAN_ASIDE", 1);
  const ChainStream* cs = p.varlen() && choice.chosen != nullptr && !choice.has_preset &&
                                  aside != 0
                              ? chain_stream(p.device_id, st)
                              : nullptr;
  if (cs != nullptr) {
    run_planner(p, f.seqs, b, plan.seg_chunks, choice, st, PlanPart::Table);
    cs->fork_from(st);
    const bool wy_first = aside == 2;
    if (wy_first) launch_wy<In>(p, f, st);
    run_planner(p, f.seqs, b, plan.seg_chunks, choice, cs->stream, PlanPart::Segments);
    if (!wy_first) launch_wy<In>(p, f, st);
    cs->join_into(st);
  } else {
    run_planner(p, f.seqs, b, plan.seg_chunks, choice, st);
    launch_wy<In>(p, f, st);
  }
  // bwd_cols: the backward's recomputation in the 128-column kernels too (launch_state_cols:
  // state_fwd_tma_kernel's kRec or state_fwd_cols_kernel, rec_tma), on the backward's
  // segments (whatever column block the plan or the device picked for them)
  const bool recompute_cols = f.h != nullptr && b.p16;
  auto launch = [&](cudaStream_t s, bool pdl) {
    if (f.corr && f.phase == 0 && f.starts == 2) return;  // exact segments: seg_correct_kernel
    if (recompute_cols) {
      FwdParams fc = f;
      fc.col_block_dev = nullptr;
      launch_state_cols<In>(plan, p, fc, s);
      return;
    }
    // the device's schedule: 16 and 32 columns unsplit only, in the launch beside the chain
    const bool narrow = !f.schedule_dev || (f.phase == 0 && f.starts == 1);
    if (narrow && launches(plan, 16)) launch_state_fwd<In, 16>(plan, p, f, b.pass, s);
    if (narrow && launches(plan, 32)) launch_state_fwd<In, 32>(plan, p, f, b.pass, s);
    if (launches(plan, D)) launch_state_cols<In>(plan, p, f, s, pdl);  // the f16 pass's 128 columns
  };
  if (p.N == 0) return;
  run_phases(p.device_id, plan.split, b.pass == FwdPass::F16 && cp_overlap(plan), f, st, launch,
             [&](cudaStream_t s) {
               if (walk_cols() > 0)
                 launch_seg_walk(p, f, false, s, true);
               else if (!launch_seg_scan(p, plan, b, f, s))
                 launch_seg_combine(p, f, false, s, true);
               launch_seg_correct<In>(p, f, s);
               launch_sub_start(p, plan, f, s);
             });
}

// The recomputation's parameters on a backward workspace: the forward's pass that also
// records the state entering every chunk and U (fp16 blocks, and T, P in fp16, when both
// passes run in the 128-column kernels: rec16).
FwdParams recompute_params(const Problem& p, const SeqLayout& s, const BwdBuffers& b) {
  FwdParams f = fwd_params(p, s, b.f);
  if (b.rec16) {  // the 128-column reverse pass reads T and P as fp16
    f.T16 = reinterpret_cast<__half*>(b.Tmat);
    f.P16 = reinterpret_cast<__half*>(b.f.P);
    f.Pmat = nullptr;
  } else {
    f.Tmat = b.Tmat;
  }
  f.h = b.h;  // the state pass records the state entering every chunk and U
  f.h_scale = b.h_scale;
  f.U = b.U;
  f.U_scale = b.U_scale;
  return f;
}

// What a kept forward's records depend on, hashed (FNV-1a) into the workspace's tag: the
// shapes, dtypes, scale, planning hints (max_seqlen, the host copy of cu_seqlens) and layout
// switches. Not the inputs' addresses: saved-tensor hooks
// (offloading to the host, torch.library's own checks) hand the backward the same values
// at other addresses. Never 0.
unsigned long long problem_tag(const Problem& p) {
  unsigned long long h = 1469598103934665603ull;
  auto mix = [&](unsigned long long x) {
    for (int i = 0; i < 8; ++i, x >>= 8) h = (h ^ (x & 0xff)) * 1099511628211ull;
  };
  for (int64_t x : {p.B, p.T, p.TT, p.Hqk, p.Hv, p.N, p.max_seqlen}) mix(static_cast<uint64_t>(x));
  // the host copy of cu_seqlens makes the plan's choice on the host (state_pass_params)
  mix(p.host_chunks.size());
  for (const int64_t x : p.host_chunks) mix(static_cast<uint64_t>(x));
  for (int x : {static_cast<int>(p.qkv_dtype), static_cast<int>(p.g_dtype),
                static_cast<int>(p.beta_dtype), static_cast<int>(p.cu_dtype),
                static_cast<int>(p.h0_io.present()), static_cast<int>(p.varlen()),
                // the workspace's layout also follows these switches (FLASHGDN_FWD_PASS,
                // FLASHGDN_BWD_COLS): a backward run under others must not read it
                static_cast<int>(fwd_pass()), static_cast<int>(bwd_cols(p))})
    mix(static_cast<uint64_t>(x));
  uint32_t sc;
  std::memcpy(&sc, &p.scale, sizeof sc);
  mix(sc);
  return h | 1ull;
}

void launch_workspace_tag(const Problem& p, const BwdBuffers& b, bool check, cudaStream_t st) {
  workspace_tag_kernel<<<1, 32, 0, st>>>(b.tag, problem_tag(p), b.f.error, b.error,
                                         check ? 1 : 0, p.varlen() ? 1 : 0);
  check_cuda(cudaGetLastError(), "workspace_tag_kernel launch");
}

// A forward that keeps what the backward would recompute (Problem::keep_for_backward): the
// backward's recomputation on the backward's plan and workspace, with o and the final
// state written as well, then the workspace's tag.
template <typename In>
void forward_kept(const Problem& p, const FwdOutputs& out, void* ws, cudaStream_t st) {
  const SegmentPlan plan = plan_forward(p, true);
  Carver c{static_cast<char*>(ws)};
  const BwdBuffers b = carve_kept(p, plan, c, true);
  const SeqLayout s = seq_layout(p, b.f);
  FwdParams f = recompute_params(p, s, b);
  f.o = out.o;
  f.ht = out.final_state;
  run_state_pass<In>(p, plan, b.f, f, st);
  launch_workspace_tag(p, b, false, st);
  if (p.varlen()) {
    Poison z;
    z.add(out.o, p.qkv_dtype, p.TT * p.Hv * D);
    z.add(out.final_state, FLASHGDN_DTYPE_F32, p.N * p.Hv * D * D);
    z.launch(p, b.f.error, st);
  }
}

template <typename In>
void forward(const Problem& p, const FwdOutputs& out, void* ws, cudaStream_t st) {
  if (p.keep_for_backward) return forward_kept<In>(p, out, ws, st);
  const SegmentPlan plan = plan_forward(p, false);
  Carver c{static_cast<char*>(ws)};
  const FwdBuffers b = carve_fwd(p, plan, c);
  const SeqLayout s = seq_layout(p, b);
  FwdParams f = fwd_params(p, s, b);
  f.o = out.o;
  f.ht = out.final_state;
  run_state_pass<In>(p, plan, b, f, st);
  if (p.varlen()) {
    Poison z;
    z.add(out.o, p.qkv_dtype, p.TT * p.Hv * D);
    z.add(out.final_state, FLASHGDN_DTYPE_F32, p.N * p.Hv * D * D);
    z.launch(p, b.error, st);
  }
}

// The ready queue (BwdParams::rq_count; FLASHGDN_BWD_QUEUE=0 off): grad_chunk_tc_kernel
// launched as the programmatic dependent of the reverse pass's phase 0, each block taking the
// next (chunk, q/k head) whose records that pass has completed, so the gradients run on the
// SMs the reverse pass leaves idle (few heads: 2/4 x 8192 has 44 blocks in its phase 0) while
// it still runs. Same arithmetic per item: the same bits in any order. Possible where both
// passes are the 128-column kernels (rec16) and phase 0 is the last launch before the
// gradients (not the overlapped schedule's two streams). With FLASHGDN_PDL=0 the gradients'
// kernel starts after the reverse pass, and every item is ready when a block takes it.
// Taken (FLASHGDN_BWD_QUEUE unset) where planner.h backward_ready_queue says (value heads x
// chunks of tokens <= 2048): measured
// (H100, 2026-11-28, bwd ms, queue against =0, two rounds alternated) 2/4 x 8k 3.4-6.6%
// faster, 4/8 x 8k 1.3-3.1%, 8/16 x 8k 2.5-10.5%, 2/4 x 32k 0.3-3.0%; beyond it mixed (16/32
// x 8k in 2 and 4 sequences 7-10% faster, in 1 and 8 1.5-3.2% slower; 4/8 x 32k in one
// sequence 4% slower, packed 3% faster) and slower on the 32k rows of 8/16 and 16/32 heads
// (2-5.5%): there phase 0 is memory-bound and fills the SMs, and the gradients' blocks that
// take the SMs its last wave frees slow it (16/32 x 32k: 735 -> 975 us; the signals' fences
// and waits are ~60 of those 240, FLASHGDN_DEBUG 57344) while doing little of their own work
// before it ends. The signals: one a block (kSignal 2, 0.985-1.0x of one a warp's time in
// the rule's region). =1 takes it wherever possible with one signal a warp, =2 wherever
// possible with one a block, =0 never (the queue is grad_chunk_tc_kernel's: where
// grad_chunk_wg_kernel runs, grad_wg, there is none). Returns the signals (BwdParams::rq_signal): 0 no queue,
// 1 one a warp, 2 one a block.
int bwd_queue(const Problem& p, const SegmentPlan& plan, bool rec16, bool tc, bool simt) {
  if (!rec16 || !tc || simt || p.N == 0 || (plan.split && cp_overlap(plan))) return 0;
  const int mode = env_int_or("FLASHGDN_BWD_QUEUE", -1);
  if (mode == 0 || mode == 1) return mode;
  return mode > 1 || backward_ready_queue(p.Hv, (p.TT + C - 1) / C) ? 2 : 0;
}

// The per-chunk gradients on wgmma (grad_chunk_wg_kernel): bf16 inputs with the fp16 record
// blocks (rec16). Taken (FLASHGDN_GRAD_WG unset) outside the ready queue's region (planner.h
// backward_ready_queue: value heads x chunks of tokens > 2048), where it measured faster
// (H200, 2026-11-28, bwd against grad_chunk_tc_kernel: the 32k rows of 4/8 - 16/32 heads and
// 16/32 x 8k 4-6%); inside it grad_chunk_tc_kernel runs beside the reverse pass (the queue),
// which this kernel does not, and was 0-8% faster at 2/4 - 8/16 x 8k. =1 takes it wherever
// possible (and no queue), =0 never.
bool grad_wg(const Problem& p, bool rec16, bool tc, bool simt) {
  if (!rec16 || !tc || simt || p.qkv_dtype != FLASHGDN_DTYPE_BF16) return false;
  if (p.max_chunks() * p.Hqk >= (int64_t{1} << 31)) return false;  // its items are int
  const int mode = env_int_or("FLASHGDN_GRAD_WG", -1);
  if (mode >= 0) return mode != 0;
  return !backward_ready_queue(p.Hv, (p.TT + C - 1) / C);
}

template <typename In>
void backward(const Problem& p, const BwdIO& io, void* ws, cudaStream_t st) {
  static std::once_flag once;
  std::call_once(once, [] {
    if constexpr (std::is_same_v<In, __nv_bfloat16>) {
      set_smem(grad_chunk_wg_kernel<In>, GradWgSmem::kBytes);
      set_smem(grad_chunk_wg_kernel<In, true>, GradWgSmem::kBytes);
    }
    set_smem(grad_chunk_kernel<In>, kGradSmem);
    set_smem(grad_chunk_tc_kernel<In, false>, GradSmem<In, false>::kBytes);
    set_smem(grad_chunk_tc_kernel<In, true>, GradSmem<In, true>::kBytes);
    set_smem(grad_chunk_tc_kernel<In, true, true>, GradSmem<In, true>::kBytes);
  });
  const bool simt = bwd_simt(), tc = grad_tc();
  const SegmentPlan plan = plan_forward(p, true);
  // io.kept: the workspace of a forward that kept its records (forward_kept), read only;
  // only the tag check runs before the reverse pass
  const bool kept = io.kept != nullptr;
  BwdBuffers b;
  Carver c{static_cast<char*>(ws)};
  if (kept) {
    Carver kc{static_cast<char*>(const_cast<void*>(io.kept))};
    b = carve_kept(p, plan, kc, true);
    carve_bwd_own(p, plan, c, b, true);
  } else {
    b = carve_bwd(p, plan, c);
  }
  const SeqLayout s = seq_layout(p, b.f, b.error);
  FwdParams f = recompute_params(p, s, b);
  if (kept) {
    state_pass_params(p, plan, b.f, f);
    launch_workspace_tag(p, b, true, st);
  } else {
    run_state_pass<In>(p, plan, b.f, f, st);
  }

  BwdParams g{};
  static_cast<SegParams&>(g) = f;  // sequences, heads, the forward's segments and buffers
  if (kept) {  // the kept workspace is read only: the reverse pass's own segment buffers
    g.seg_L = b.rseg_L;
    g.seg_M = b.rseg_M;
    g.seg_in = b.rseg_in;
  }
  g.scale = p.scale;
  g.q = p.q;
  g.k = p.k;
  g.Kh = f.Kh;  // null unless the forward pass is the fp16 one (bwd_cols requires it)
  g.Qh = f.Qh;
  g.v = p.v;
  g.beta = p.beta;
  g.d_o = io.d_o;
  g.g_dtype = p.g_dtype;
  g.beta_dtype = p.beta_dtype;
  g.dht = io.d_final_state;
  g.G = b.f.G;
  g.Tmat = f.Tmat;
  g.Pmat = f.Pmat;
  g.T16 = f.T16;
  g.P16 = f.P16;
  g.U = b.U;
  g.h = b.h;
  g.dh = b.dh;
  g.h_scale = b.h_scale;
  g.dh_scale = b.dh_scale;
  g.U_scale = b.U_scale;
  g.dVt_scale = b.dVt_scale;
  g.rec16 = b.rec16;  // both passes in the 128-column kernels, fp16 record blocks
  g.dVt = b.dVt;
  g.dh0 = io.dh0;
  g.dq = io.dq;
  g.dk = io.dk;
  g.dv = io.dv;
  g.dg = io.dg;
  g.dbeta = io.dbeta;
  g.debug = f.debug;
  // grad_chunk_wg_kernel's tensor maps: Q, K and dO (in maps.v), boxes of 64 tokens x 64 values
  TmaMaps wg_maps{};
  const bool wg = grad_wg(p, g.rec16, tc, simt) &&
                  make_tma_map(wg_maps.q, p.q, p.TT, p.Hqk, D, tma_in_type(p)) &&
                  make_tma_map(wg_maps.k, p.k, p.TT, p.Hqk, D, tma_in_type(p)) &&
                  make_tma_map(wg_maps.v, io.d_o, p.TT, p.Hv, D, tma_in_type(p));
  g.rq_signal = wg ? 0 : bwd_queue(p, plan, g.rec16, tc, simt);
  const bool queue = g.rq_signal != 0;
  if (queue) {
    const size_t items = static_cast<size_t>(p.max_chunks() * p.Hqk);
    check_cuda(cudaMemsetAsync(b.ready, 0, ready_queue_ints(p) * sizeof(int), st),
               "ready queue memset");
    g.rq_count = b.ready;
    g.rq_slot = b.ready + items;
    g.rq_ends = b.ready + 2 * items;
  }
  if (p.N > 0) {
    // FLASHGDN_BWD_SIMT=1: the fp32 SIMT kernels (reference for A/B comparisons)
    if (simt) {
      const int bw = column_block(p, sm_count(p.device_id));
      if (bw == 32) launch_state_bwd<In, 32>(p, g, st);
      else if (bw == 16) launch_state_bwd<In, 16>(p, g, st);
      else launch_state_bwd<In, 8>(p, g, st);
    } else {
      run_reverse_pass<In>(p, plan, g, st);
    }
  }
  if (p.max_chunks() > 0) {
    const dim3 grid(static_cast<unsigned>(p.max_chunks()), static_cast<unsigned>(p.Hqk));
    if constexpr (std::is_same_v<In, __nv_bfloat16>) {
      // persistent: one block an SM, each taking every gridDim.x-th (chunk, q/k head) item;
      // FLASHGDN_GRAD_WG_GRID=n caps the blocks at n (tests: many items a block, same bits)
      const int64_t items = p.max_chunks() * p.Hqk;
      const int cap = env_int_or("FLASHGDN_GRAD_WG_GRID", 0);
      const dim3 wgrid(static_cast<unsigned>(
          std::min<int64_t>(items, cap > 0 ? cap : sm_count(p.device_id))));
      if (wg && (g.debug & (1 << 20)))  // timing only: phase clocks printed by two blocks
      {
        grad_chunk_wg_kernel<In, true><<<wgrid, NT, GradWgSmem::kBytes, st>>>(wg_maps, g);
        grad_wg_probe_print<<<1, 1, 0, st>>>();
      }
      else if (wg)
        grad_chunk_wg_kernel<In><<<wgrid, NT, GradWgSmem::kBytes, st>>>(wg_maps, g);
    }
    if (wg) {
    } else if (queue)  // the ready queue's: the reverse pass's programmatic dependent
      launch_kernel(grad_chunk_tc_kernel<In, true, true>, grid, GradSmem<In, true>::kBytes, st,
                    true, "grad_chunk_tc_kernel launch", g);
    else if (tc && g.rec16)
      grad_chunk_tc_kernel<In, true><<<grid, NT, GradSmem<In, true>::kBytes, st>>>(g);
    else if (tc)
      grad_chunk_tc_kernel<In, false><<<grid, NT, GradSmem<In, false>::kBytes, st>>>(g);
    else grad_chunk_kernel<In><<<grid, NT, kGradSmem, st>>>(g);
    check_cuda(cudaGetLastError(), "grad_chunk_kernel launch");
  }
  if (p.varlen() || kept) {
    const int64_t qk = p.TT * p.Hqk * D, vv = p.TT * p.Hv * D, gg = p.TT * p.Hv;
    Poison z;
    z.add(io.dq, p.qkv_dtype, qk);
    z.add(io.dk, p.qkv_dtype, qk);
    z.add(io.dv, p.qkv_dtype, vv);
    z.add(io.dg, p.g_dtype, gg);
    z.add(io.dbeta, p.beta_dtype, gg);
    z.add(io.dh0, FLASHGDN_DTYPE_F32, p.N * p.Hv * D * D);
    z.launch(p, kept ? b.error : b.f.error, st);
  }
}

}  // namespace

size_t cuda_fwd_workspace_bytes(const Problem& p) {
  Carver c{nullptr};
  if (p.keep_for_backward) carve_kept(p, plan_forward(p, true), c, true);
  else carve_fwd(p, plan_forward(p, false), c);
  return c.used;
}

size_t cuda_bwd_workspace_bytes(const Problem& p, bool kept) {
  Carver c{nullptr};
  if (kept) {
    BwdBuffers b;
    b.rec16 = bwd_cols(p);
    carve_bwd_own(p, plan_forward(p, true), c, b, true);
  } else {
    carve_bwd(p, plan_forward(p, true), c);
  }
  return c.used;
}

void cuda_fwd(const Problem& p, const FwdOutputs& out, void* ws, void* stream) {
  DeviceGuard guard(p.device_id);
  auto st = static_cast<cudaStream_t>(stream);
  if (p.qkv_dtype == FLASHGDN_DTYPE_BF16) forward<__nv_bfloat16>(p, out, ws, st);
  else forward<__half>(p, out, ws, st);
}

void cuda_bwd(const Problem& p, const BwdIO& io, void* ws, void* stream) {
  DeviceGuard guard(p.device_id);
  auto st = static_cast<cudaStream_t>(stream);
  if (p.qkv_dtype == FLASHGDN_DTYPE_BF16) backward<__nv_bfloat16>(p, io, ws, st);
  else backward<__half>(p, io, ws, st);
}

}  // namespace flashgdn
