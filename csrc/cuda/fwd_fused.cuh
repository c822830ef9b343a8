// gdn_fwd_fused_kernel<In, kT, kStages, chain regs, aux regs>: the plain forward's 128-column
// state pass with (part of) the WY part inside it (opt-in, FLASHGDN_FUSED, launch.cu
// fused_mode; docs/perf-notes.md version 39: correct, and slower than the default kernels on
// every variant measured, because the pass is near the SM's shared-memory wavefront rate).
//   kT (FLASHGDN_FUSED=3): T diag(beta) and P formed inside; before it only wy_gates_kernel
//     runs (G, e^G, e^{G_last - G}, Lb): no T diag(beta), P or fp16 copy of k and q goes
//     through HBM.
//   !kT (FLASHGDN_FUSED=1, 2, 4): P formed inside; wy_lean_kernel without its Q K^T before it
//     (T diag(beta), G, e^G, Lb): no P or fp16 copy of k and q goes through HBM.
//
// grid as state_fwd_cols_kernel's ((1 [x 2 in phase 1], H_v, segments or slots):
// for_each_segment_block), 384 threads, one block an SM (two stages ~164 KB, kT ~173 KB; three
// stages ~209 KB).
//   * warpgroups 0 and 1 (the chain): state_fwd_cols_kernel's ping-pong step
//     (state_fwd_cols_segment<., ., ., true, kStages, kFused = kT ? 2 : 1>): warpgroup 1
//     issues chunk c + 1's copies of k, q (the inputs' tiles), v, e^G (and !kT T diag(beta))
//     into the stage and signals landed[s]; both wait on full[s], step the state over chunk c
//     and write o;
//   * warpgroup 2 (auxiliary): per chunk of the same segment blocks, in the same order, once
//     landed[s]: the chunk's cumulative gates (kT: lean_gates; else wy_lean_kernel's G, loaded
//     a chunk ahead), Q K^T -> P = Dec . Q K^T (fp16, straight into the stage's P tile; phase
//     0's output chunks only), with kT K K^T -> A = diag(beta) (Dec . K K^T) -> T = (I + A)^-1
//     by doubling -> T diag(beta) (fp16, straight into the stage's T tile), all with
//     wy_lean_kernel's warpgroup functions (the same arithmetic, so the same values as its P16
//     and Tv16), then k and q to fp16 in place (bf16 inputs) and its 128 arrivals on full[s].
// setmaxnreg: the chain / the auxiliary warpgroup 224 / 56 (FLASHGDN_FUSED=1) or 216 / 72
// (2 x 128 x chain + 128 x aux <= 64512, the pool of a 384-thread block).
//   reads  k, q, v, g, beta, EG, Lb (and !kT: Tv16, G), initial state, seg_in
//   writes o, final state (phase 0); seg_L, seg_M (phase 1)
#pragma once

#include <type_traits>

#include "state_fwd_cols.cuh"
#include "wy_lean.cuh"

namespace flashgdn {
namespace cuda {

constexpr int kFusedThreads = 3 * 128;
constexpr int kFusedLaunchRegs = (65536 / kFusedThreads) / 8 * 8;
// (compile-time probes override them: -DFLASHGDN_FUSED_CHAIN_REGS=.. -DFLASHGDN_FUSED_AUX_REGS=..)
#ifndef FLASHGDN_FUSED_CHAIN_REGS
#define FLASHGDN_FUSED_CHAIN_REGS 224
#define FLASHGDN_FUSED_AUX_REGS 56
#endif
constexpr int kFusedChainRegs = FLASHGDN_FUSED_CHAIN_REGS, kFusedAuxRegs = FLASHGDN_FUSED_AUX_REGS;
static_assert(2 * 128 * kFusedChainRegs + 128 * kFusedAuxRegs <= kFusedThreads * kFusedLaunchRegs,
              "the roles' registers fit the block's pool");

struct FwdFusedSmem {
  using Sm = StateFwdColsSmem;
  static_assert(Sm::LDP == kLeanLd, "the stage's T and P tiles are the lean functions' tiles");
  // state_fwd_cols_kernel's stages (two: and its output staging) and mbarriers full, empty,
  // landed (kStages each), then the auxiliary warpgroup's chunk G and beta and (kT) A tile
  static constexpr size_t bars(int stages) { return Sm::stage_bars_at(stages, false); }
  static constexpr size_t aux(int stages) {
    return (bars(stages) + 3 * stages * sizeof(uint64_t) + 15) / 16 * 16;
  }
  static constexpr size_t bytes(bool t, int stages) {
    return aux(stages) + 2 * sizeof(float) * C + (t ? kLeanTile : 0);
  }
};
static_assert(FwdFusedSmem::bytes(true, 2) <= 227 * 1024 && FwdFusedSmem::bytes(false, 3) <= 227 * 1024,
              "the fused forward fits a block's smem");

// The auxiliary warpgroup's walk over one segment block (threads 256 .. 383): the chain's
// chunks c_first .. c_end - 1 in order, use index n_used + (ci - c_first) as the chain counts
// them (stage n % 2, parity (n / 2) & 1).
template <typename In, bool kT, int kStages>
__device__ __forceinline__ void fused_aux_segment(const FwdParams& p, const SegmentBlock& b,
                                                  uint32_t& n_used) {
  using Sm = StateFwdColsSmem;
  constexpr int LDP = Sm::LDP;
  const int64_t h = b.h, start = b.start, len = b.len;
  const int64_t c_begin = b.c_begin, c_end = b.c_end, c_first = b.ss.c_first;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Kst = [&](int s) { return reinterpret_cast<In*>(smem_raw + s * Sm::kStage); };
  auto Qst = [&](int s) { return Kst(s) + C * LDH; };
  auto Tst = [&](int s) { return reinterpret_cast<__half*>(Kst(s) + 3 * C * LDH); };
  auto Pst = [&](int s) { return Tst(s) + C * LDP; };
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw + FwdFusedSmem::bars(kStages));
  uint64_t* landed = full + 2 * kStages;
  float* Gs = reinterpret_cast<float*>(smem_raw + FwdFusedSmem::aux(kStages));
  float* bs = Gs + C;
  __half* A = reinterpret_cast<__half*>(bs + C);  // kT

  const int wt = static_cast<int>(threadIdx.x) - 2 * 128, warp = wt >> 5;
  const bool want_o = p.phase == 0 && p.o != nullptr && !(p.debug & 1);
  auto sync = [] { named_bar_sync(1, 128); };
  const uint32_t n0 = n_used;
  // !kT: wy_lean_kernel's G of an output chunk (rows past L: G_{L-1}), loaded a chunk ahead
  auto load_g = [&](int64_t ci) {
    const int L = chunk_rows(len, ci);
    return wt < C && want_o && ci >= c_begin && ci < c_end
               ? p.G[(start + ci * C + (wt < L ? wt : L - 1)) * p.Hv + h]
               : 0.f;
  };
  float g_next = kT ? 0.f : load_g(c_first);
  for (int64_t ci = c_first; ci < c_end; ++ci) {
    const uint32_t n = n0 + static_cast<uint32_t>(ci - c_first);
    const int s = static_cast<int>(n % kStages);
    const int L = chunk_rows(len, ci);
    const bool out = want_o && ci >= c_begin;
    if constexpr (kT) {
      lean_gates(p, start + ci * C, L, h, 1, Gs, bs, warp);  // warp 0
      sync();
    } else {
      const float g = g_next;
      g_next = load_g(ci + 1);
      if (out) {
        if (wt < C) Gs[wt] = g;
        sync();
      }
    }
    mbar_wait(&landed[s], (n / kStages) & 1);  // K, Q (zeros past L) in stage s
    const In* K = Kst(s);
    if (out) {  // P = Dec . Q K^T into the stage's P tile (every row: Q's rows past L are zero)
      float qk[8][4];
      lean_lower_product(qk, Qst(s), K, warp);
      __half* P = Pst(s);
      lean_p_epilogue(qk, Gs, warp, C, [&](int r, int c, float p0, float p1) {
        *reinterpret_cast<uint32_t*>(P + r * LDP + c) = pack_half2(p0, p1);
      });
    }
    if constexpr (kT) {
      const LeanTiles tiles{A, Tst(s), 0};
      {
        float kk[8][4];
        lean_lower_product(kk, K, K, 3 - warp);
        lean_a_epilogue(kk, tiles, 0, Gs, bs, 3 - warp, nullptr, false);
      }
      sync();
      lean_inverse(tiles, bs, 1, wt, sync);  // T diag(beta) into the stage's T tile; ends synced
    } else {
      sync();  // every read of K, Q (and of Gs) done
    }
    if constexpr (!std::is_same<In, __half>::value) {  // K (and Q) to fp16 in place
      tile_to_half_in_place<In>(reinterpret_cast<__half*>(Kst(s)), wt);
      if (out) tile_to_half_in_place<In>(reinterpret_cast<__half*>(Qst(s)), wt);
    }
    mbar_arrive(&full[s]);
  }
  if (c_first < c_end) n_used = n0 + static_cast<uint32_t>(c_end - c_first);
}

// kStages: the chain's stages (three: copies two chunks ahead, the output staged in the V
// tile); kChainRegs / kAuxRegs: the roles' setmaxnreg counts (launch.cu fused_mode).
template <typename In, bool kT, int kStages = 2, int kChainRegs = kFusedChainRegs,
          int kAuxRegs = kFusedAuxRegs>
__global__ void __launch_bounds__(kFusedThreads, 1) gdn_fwd_fused_kernel(FwdParams p) {
  static_assert(2 * 128 * kChainRegs + 128 * kAuxRegs <= kFusedThreads * kFusedLaunchRegs,
                "the roles' registers fit the block's pool");
  PdlCompletion pdl_completion;  // a programmatic dependent in the chain (mma.cuh)
  if (p.seqs.failed() || !col_block_chosen<D>(p)) return;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw + FwdFusedSmem::bars(kStages));
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      mbar_init(&bars[st], 128);               // full: the auxiliary warpgroup's arrivals
      mbar_init(&bars[kStages + st], 8);       // empty: one arrival per chain warp
      mbar_init(&bars[2 * kStages + st], 128); // landed: a cp.async arrival per thread of warpgroup 1
    }
  }
  __syncthreads();
  // both roles walk the same segment blocks (for_each_segment_block's barriers, where it
  // loops, are met by all 384 threads)
  uint32_t n_used = 0;
  if (threadIdx.x < 2 * 128) {
    setmaxnreg_inc<kChainRegs>();
    for_each_segment_block<D>(p, false, [&](const SegmentBlock& b) {
      state_fwd_cols_segment<In, false, false, true, kStages, kT ? 2 : 1>(p, b, n_used);
    });
  } else {
    setmaxnreg_dec<kAuxRegs>();
    for_each_segment_block<D>(p, false, [&](const SegmentBlock& b) {
      fused_aux_segment<In, kT, kStages>(p, b, n_used);
    });
  }
}

}  // namespace cuda
}  // namespace flashgdn
