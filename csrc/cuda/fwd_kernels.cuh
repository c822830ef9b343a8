// Forward kernels of the chunked WY algorithm (docs/algorithm.md) on tensor cores with fp32
// accumulation (mma.cuh): the default state pass on fp16 operands (m16n8k16; fp16 has tf32's
// 10-bit mantissa), wy_kernel and the opt-in tf32 passes on TF32 (m16n8k8 / wgmma; bf16 and
// fp16 inputs are exact tf32 operands at any magnitude).
//
// wy_kernel      grid (max_chunks * H_v / wy_heads: the heads of a chunk side by side),
//                256 threads; the default pass: a block takes wy_heads (up to 4) value heads
//                of one q/k head, 62 KB smem (3 blocks per SM), or one head, 44 KB (4 per
//                SM); the tf32 / wgmma passes: one head, 105 KB (2 per SM)
//   Everything of one chunk of one value head that does not depend on the state:
//   cumulative gates G, A[r,s] = beta_r exp(G_r - G_s) k_r.k_s (s < r), T = (I + A)^-1
//   blockwise (16 x 16 diagonal blocks by substitution, then block rows),
//   W = T diag(beta exp G) K, U0 = T diag(beta) V,
//   P = (Q K^T) . Dec (Dec[r,s] = exp(G_r - G_s), s <= r), and the chunk's warm-up bound
//   Lb = sum_r g_r + log max(1, |1 - beta_r |k_r|^2|) (log of a bound on how much the
//   chunk's transition can keep of an earlier state; used by the context-parallel pass).
//   (The plain forward takes wy_lean_kernel instead, wy_lean.cuh: the same outputs for the
//   default pass from one warpgroup a block; wy_kernel and wy_batched_kernel remain the
//   backward's, the kept forward's and FLASHGDN_WY_LEAN=0's.)
//   reads  q, k, v (not for the default pass), g, beta
//   writes G (and e^G, e^{G_last - G} for the cols pass), P (tf32-rounded fp32 and/or fp16),
//   Lb; T when the backward asks; fp16 copies
//   of bf16 k and q for the fp16 passes; and either T diag(beta) in fp16 (Tv16, the default
//   pass, kFree) or W (fp16: tf32's 10-bit mantissa) and U0 (tf32-rounded fp32)
//
// state_fwd_kernel<BW>  grid (128 / BW [x 2 in phase 1], H_v, segments or slots), 256 threads,
//   ~208 KB smem (BW 32)
//   The sequential pass over the chunks of one segment of one sequence for BW value
//   columns of one head. The state block S (128 x BW, fp32) stays in the accumulator
//   registers of the 8 warps across chunks; a tf32 copy of S^T in shared memory feeds
//   the products. The next chunk's W, K, Q, P, G are copied by cp.async while the current
//   one computes. Per chunk:
//     U = U0 - W S,  O = scale (diag(exp G) Q S + P U),  S <- exp(G_last) S + K^T diag(eL) U.
//   Context parallelism (context_parallel.cuh): each block runs one segment, from h0, a
//   warm-up or its exact entering state seg_in (phase 0), or forms the segment's summary
//   L, M (phase 1: the transition M is the same pass on the identity with U0 = 0).
//   For packed sequences the device may choose the column block (col_block_dev): both
//   instantiations are launched and the one not chosen returns at once.
//   reads  k, q, W, U0, P, G, Lb, initial state, seg_in
//   writes o, final state (phase 0); seg_L, seg_M (phase 1); for the backward's
//   recomputation (p.h set) the state entering every chunk (h) and U = U0 - W S
//
// The segment machinery (segment_start, segment_block) and seg_combine_kernel /
// sub_start_kernel: context_parallel.cuh.
#pragma once

#include <type_traits>

#include "../planner.h"
#include "common.cuh"
#include "context_parallel.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace flashgdn {
namespace cuda {

constexpr int LDH = 136;  // 16-bit [64][128] tiles
constexpr int LDW = 136;  // fp32 [.][128] tiles read with paired loads
constexpr int LDA = 72;   // fp32 [.][64] tiles

struct FwdParams : SegParams {
  float scale;
  const void *q, *k, *v, *g, *beta;
  int g_dtype, beta_dtype;
  const float* h0;   // [N, Hv, D, D] or null
  void* o;           // [TT, Hv, D] or null
  float* ht;         // [N, Hv, D, D] or null
  float* G;          // [TT, Hv]
  __half* W;         // [TT, Hv, D] fp16: tf32's 10-bit mantissa in 16 bits (|W| ~ 1 / |k|)
  float* U0;         // [TT, Hv, D] tf32-rounded fp32: U0 scales with v, so it keeps fp32's
                     //   range (the tf32 pass takes any v; bench/precision_study.py)
  float* Tmat;       // [TT, Hv, C] or null
  __half* T16;       // [TT, Hv, C] or null: fp16 T (the backward's 128-column reverse pass)
  float* Pmat;       // [TT, Hv, C] or null: tf32 P for the tf32 passes and the backward
  __half* P16;       // [TT, Hv, C] or null: fp16 P for the fp16 pass
  const __half *Kh, *Qh;  // [TT, Hqk, D] fp16 k and q of the fp16 pass (the inputs, or wy's copies)
  __half *Kh_w, *Qh_w;    // bf16 inputs: where wy_kernel writes the fp16 copies (else null)
  // bf16 inputs whose only fp16 readers are state_fwd_cols_kernel's ping-pong forward passes
  // (launch.cu kq_in_pass): those copy the bf16 k and q tiles and convert them to fp16 in
  // shared memory (the same conversion as wy_fp16_copies: the same bits), and wy_kernel
  // writes no copies (Kh_w, Qh_w null; Kh, Qh unused).
  bool kq_bf16;
  // the state pass is gdn_fwd_fused_kernel (launch.cu fused_in_pass): wy_gates_kernel before
  // it writes only G, EG and Lb (no Tv16, P16, Kh, Qh)
  bool fused;
  // with fused: state_fwd_tma_kernel's kWy the pass takes (launch.cu cols_tma_wy: 1 P, 2 P and
  // T diag(beta)), 0: gdn_fwd_fused_kernel (FLASHGDN_FUSED)
  int tma_wy;
  __half* Tv16;      // [TT, Hv, C] fp16 T diag(beta): the W/U0-free pass's (else null)
  // Tv16 and P16 hold only their lower block triangle (the 16 x 16 blocks at or below the
  // diagonal: 10 of 16): wy_kernel does not store the zero blocks above it, and their
  // readers (state_fwd_cols_kernel, state_fwd_f16_kernel, whose products take only those
  // blocks) do not copy them. The plain forward of the default pass (launch.cu tri16).
  bool tri16;
  int wy_heads;      // value heads a wy_kernel block takes (launch_wy sets it)
  float2* EG;        // [TT, Hv] (e^G, e^{G_last - G}) per token: the cols pass's (else null)
  // backward recomputation (state_fwd_kernel records them when h is set)
  float* h;          // [max_chunks, Hv, D, D] or null; fp16 records (mma.cuh) when written
                     // by state_fwd_cols_kernel
  float* h_scale;    // [max_chunks, Hv, 8]: those records' factors
  float* U;          // [TT, Hv, D] or null; fp16 record blocks like h
  float* U_scale;    // [max_chunks, Hv, 8]
  int debug;         // timing experiments only (FLASHGDN_DEBUG): 1 no output, 2 no loads,
                     // 4 no h / dh records, 8 no U / dVt (128-column passes); tests: 16
                     // NaN in the blocks tri16 leaves unstored (proves nothing reads them);
                     // 32 no o stores to global memory (state_fwd_cols_kernel, ping-pong)
  // fp16 range guard (FLASHGDN_FWD_PASS=auto): the guarded fp16 pass writes, per block, whether
  // its U left fp16's comfortable range (or its state turned non-finite); the tf32 pass
  // launched right after with redo_pass set recomputes exactly those blocks.
  int* redo;         // [grid x, H_v, segments] (redo_index) or null
  bool redo_pass;
};

// The guarded fp16 pass hands a block to the tf32 pass when some |U| (the fp16 copy's
// source) exceeds kF16Hi (half of fp16's largest value: headroom for the products' sums)
// or, nonzero, stays below kF16Lo everywhere (its fp16 copies would be mostly subnormal).
constexpr float kF16Hi = 32768.f;
constexpr float kF16Lo = 1.f / 4096.f;

// A segment block's redo flag (FwdParams::redo): its column block, head and segment.
__device__ __forceinline__ int64_t redo_index(const SegmentBlock& b) {
  return blockIdx.x +
         static_cast<int64_t>(gridDim.x) * (blockIdx.y + static_cast<int64_t>(gridDim.y) * b.z);
}

// ---------------------------------------------------------------------------------------
// wy_kernel

constexpr int kXsLd = 9;  // inverse_block_rows_tc's per-warp scratch [16][9] floats

// The block rows of T = (I + A)^-1 (A strictly lower triangular, fp32 [C][LDA] in As, the
// 16 x 16 diagonal blocks of T already in Ts and the blocks above them zero) on TF32
// mma.sync, fp32 accumulation: for block rows i = 1, 2, 3 in turn, warp w < 2 i takes the
// 8 columns c0 = 8 w (block column j = w / 2) and forms
//   X = sum_{k=j}^{i-1} A_ik T_kj[:, c0..c0+8)   (16 x 8, k steps of 8 over rows 16 j .. 16 i)
//   T_ij[:, c0..c0+8) = -T_ii X                  (X through the warp's scratch xs: the
//                                                  accumulator layout is not a B fragment)
// One barrier per block row. Operands rounded to tf32 (bench/precision_study.py "inverse
// blocks tf32": o and state errors as with fp32 products).
__device__ __forceinline__ void inverse_block_rows_tc(const float* As, float* Ts, float* xs) {
  constexpr int B = 16;
  const int warp = threadIdx.x >> 5, g = lane_id() >> 2, t = lane_id() & 3;
  // B fragment of B(k, n) = M[k][n] (fp32, n contiguous) in the paired-k convention
  auto frag_b_kn = [&](uint32_t(&b)[2], const float* m, int ld, int n0, int k0) {
    b[0] = __float_as_uint(round_tf32(m[(k0 + 2 * t) * ld + n0 + g]));
    b[1] = __float_as_uint(round_tf32(m[(k0 + 2 * t + 1) * ld + n0 + g]));
  };
#pragma unroll
  for (int bi = 1; bi < C / B; ++bi) {
    if (warp < 2 * bi) {
      const int c0 = 8 * warp, bj = warp / 2, r0 = B * bi;
      float x[4] = {};
      for (int k0 = B * bj; k0 < r0; k0 += 8) {
        uint32_t a[4], b[2];
        frag_a_rna(a, As, LDA, r0, k0);
        frag_b_kn(b, Ts, LDA, c0, k0);
        mma_tf32(x, a, b);
      }
      xs[g * kXsLd + 2 * t] = x[0];
      xs[g * kXsLd + 2 * t + 1] = x[1];
      xs[(g + 8) * kXsLd + 2 * t] = x[2];
      xs[(g + 8) * kXsLd + 2 * t + 1] = x[3];
      __syncwarp();
      float y[4] = {};
#pragma unroll
      for (int k0 = 0; k0 < B; k0 += 8) {
        uint32_t a[4], b[2];
        frag_a_rna(a, Ts, LDA, r0, r0 + k0);
        frag_b_kn(b, xs, kXsLd, 0, k0);
        mma_tf32(y, a, b);
      }
      __syncwarp();  // xs is rewritten in the next block row
      Ts[(r0 + g) * LDA + c0 + 2 * t] = -y[0];
      Ts[(r0 + g) * LDA + c0 + 2 * t + 1] = -y[1];
      Ts[(r0 + g + 8) * LDA + c0 + 2 * t] = -y[2];
      Ts[(r0 + g + 8) * LDA + c0 + 2 * t + 1] = -y[3];
    }
    __syncthreads();
  }
}

// kFree: K and Q tiles, then A, T and the inverse's scratch in the same bytes once K K^T and
// Q K^T are in registers (42 KB); else K, Q, V, A, T, T diag(beta) side by side (105 KB, 2
// per SM). The tail holds beta and G of up to kWyMaxHeads value heads and |k|^2.
constexpr int kWyMaxHeads = 4;
constexpr size_t kWyTail = sizeof(float) * (2 * kWyMaxHeads + 1) * C;  // beta, G, |k|^2
constexpr size_t kWyFreeTiles = sizeof(float) * (2 * C * LDA + (NT / 32) * 16 * kXsLd);
static_assert(kWyFreeTiles >= sizeof(uint16_t) * 2 * C * LDH, "A, T cover the K, Q tiles");
// kMulti stages P in a tile of its own after the scratch (its stores then run beside the
// substitution, which writes T's bytes): 62 KB, 3 blocks per SM as the registers allow
template <bool kFree, bool kMulti = false>
constexpr size_t kWySmem = kFree ? kWyFreeTiles + (kMulti ? sizeof(float) * C * LDA : 0) + kWyTail
                                 : sizeof(uint16_t) * 3 * C * LDH + sizeof(float) * 3 * C * LDA +
                                       kWyTail;

// The start both wy kernels share (the default pass's): the block's chunk and value heads,
// the gates, the fp16 copies of k and q, and K K^T, Q K^T.
// Block blockIdx.x: chunk, its first value head h0 of nh and their q/k head hq. The value
// heads of a chunk are neighbours in the launch order, so the heads that share a q/k head
// find its K and Q tiles in L2 (H100, 2026-11-23: 16/32 x 32768 0.690 -> 0.428 ms, 2/8 0.113
// -> 0.102; the chunk-major grid read them from DRAM once per value head). 32-bit divisions
// (the grid is below 2^31 blocks; a 64-bit one is ~70 instructions). ck: where the chunk
// lies (ck.L == 0: past the last chunk, the block has nothing to do).
struct WyBlock {
  int64_t chunk, h0, hq;
  ChunkRef ck;
};
__device__ __forceinline__ WyBlock wy_block(const FwdParams& p, int nh) {
  const uint32_t blocks_per_chunk = static_cast<uint32_t>(p.Hv) / static_cast<uint32_t>(nh);
  WyBlock b;
  b.chunk = blockIdx.x / blocks_per_chunk;
  b.h0 = (blockIdx.x % blocks_per_chunk) * static_cast<uint32_t>(nh);
  b.hq = static_cast<uint32_t>(b.h0) / static_cast<uint32_t>(p.Hv / p.Hqk);
  b.ck = locate_chunk(p.seqs, b.chunk);
  return b;
}

// Cumulative gates G (an inclusive scan over the chunk's rows, two warps a head) and beta of
// the nh value heads from h0 into Gs_all, bs_all ([heads][C]; rows past L: beta 0). The
// second warp of a head lacks the first's total until wy_gates_carry, after a barrier.
__device__ __forceinline__ void wy_gates(const FwdParams& p, const ChunkRef& ck, int64_t h0,
                                         int nh, float* bs_all, float* Gs_all) {
  const int warp = threadIdx.x >> 5, lane = lane_id();
  if (warp >= 2 * nh) return;
  const int i = warp >> 1, r = 32 * (warp & 1) + lane;
  float* bs = bs_all + i * C;
  float gv = 0.f;
  if (r < ck.L) {
    gv = load_scalar(p.g, p.g_dtype, (ck.tok0 + r) * p.Hv + h0 + i);
    bs[r] = load_scalar(p.beta, p.beta_dtype, (ck.tok0 + r) * p.Hv + h0 + i);
  } else {
    bs[r] = 0.f;
  }
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const float y = __shfl_up_sync(0xffffffffu, gv, o);
    if (lane >= o) gv += y;
  }
  Gs_all[i * C + r] = gv;
}
__device__ __forceinline__ void wy_gates_carry(int nh, float* Gs_all) {
  const int warp = threadIdx.x >> 5;
  if (warp < 2 * nh && (warp & 1))
    Gs_all[(warp >> 1) * C + 32 + lane_id()] += Gs_all[(warp >> 1) * C + 31];
}

// Eight 16-bit values (one 16-byte piece of In) as fp16, rounded to nearest: wy_fp16_copies'
// copies and the 128-column pass's in-place conversions (FwdParams::kq_bf16), the same bits.
template <typename In>
__device__ __forceinline__ uint4 half8_of(const In* src) {
  float f[8];
  unpack8(f, *reinterpret_cast<const uint4*>(src), src);
  return make_uint4(pack_half2(f[0], f[1]), pack_half2(f[2], f[3]), pack_half2(f[4], f[5]),
                    pack_half2(f[6], f[7]));
}

// fp16 copies of this chunk's k and q rows (staged in Ks, Qs) for the fp16 state pass, by the
// NTHR threads of the first block of each q/k head (bf16 inputs; exact for |x| in [2^-14,
// 65504], the range of l2-normalised q and k). Thread t takes the 16-byte piece 8 (t % 16) of
// rows t / 16 + (NTHR / 16) i of K and of Q, its addresses formed once (the loop over a piece
// index before 2026-11-26 divided it and multiplied 64-bit strides for every piece: 18% of
// wy_batched_kernel's instructions, H100 ncu source counters).
template <typename In, int NTHR = NT>
__device__ __forceinline__ void wy_fp16_copies(const FwdParams& p, const In* Ks, const In* Qs,
                                               int64_t h0, int64_t qk_off, int L) {
  if (p.Kh_w == nullptr || h0 % (p.Hv / p.Hqk) != 0) return;
  constexpr int kPieces = D / 8, kRows = NTHR / kPieces;  // 16 pieces a row, NTHR / 16 rows a pass
  const int r0 = threadIdx.x / kPieces, c = (threadIdx.x % kPieces) * 8;
  const int64_t stride = static_cast<int64_t>(p.Hqk) * D;
  __half* gk = p.Kh_w + qk_off + r0 * stride + c;
  __half* gq = p.Qh_w + qk_off + r0 * stride + c;
  const In* sk = Ks + r0 * LDH + c;
  const In* sq = Qs + r0 * LDH + c;
#pragma unroll
  for (int i = 0; i < C / kRows; ++i) {
    if (r0 + kRows * i < L) {
      *reinterpret_cast<uint4*>(gk + kRows * i * stride) = half8_of(sk + kRows * i * LDH);
      *reinterpret_cast<uint4*>(gq + kRows * i * stride) = half8_of(sq + kRows * i * LDH);
    }
  }
}

// K K^T and Q K^T on m16n8k16 in the inputs' 16-bit type (ldmatrix moves bits: the tiles are
// read through __half pointers): the warp's rows m0 .. +16, columns n0 .. +32.
template <typename In>
__device__ __forceinline__ void wy_kk_qk16(float (&kk)[4][4], float (&qk)[4][4], const In* Ks,
                                           const In* Qs, int m0, int n0) {
  const __half* Kh = reinterpret_cast<const __half*>(Ks);
  const __half* Qh = reinterpret_cast<const __half*>(Qs);
#pragma unroll 4
  for (int k0 = 0; k0 < D; k0 += 16) {
    uint32_t ak[4], aq[4];
    frag_a16(ak, Kh, LDH, m0, k0);
    frag_a16(aq, Qh, LDH, m0, k0);
#pragma unroll
    for (int jp = 0; jp < 2; ++jp) {  // B(k, n) = K[n][k]: columns n0 + 16 jp .. + 16
      uint32_t b0[2], b1[2];
      frag_b16_pair(b0, b1, Kh, LDH, n0 + 16 * jp, k0);
      mma_16(kk[2 * jp], ak, b0, Ks);
      mma_16(kk[2 * jp + 1], ak, b1, Ks);
      mma_16(qk[2 * jp], aq, b0, Ks);
      mma_16(qk[2 * jp + 1], aq, b1, Ks);
    }
  }
}

// FwdParams::tri16: whether the 16-byte piece of a Tv16 / P16 row r at column c (a multiple
// of 8) lies in a block above the diagonal, where nothing is stored (debug & 16: NaN, which
// no reader may take; tests/test_context_parallel.py test_tri16_bit_identical).
__device__ __forceinline__ bool tri16_skip(const FwdParams& p, int r, int c) {
  return p.tri16 && c / 16 > r / 16 && !(p.debug & 16);
}
__device__ __forceinline__ bool tri16_poison(const FwdParams& p, int r, int c) {
  return p.tri16 && c / 16 > r / 16 && (p.debug & 16);
}
constexpr uint32_t kHalf2NaN = 0x7e007e00u;

// One 16-byte piece of Tv16 <- T diag(beta) in fp16 (and of T itself, fp32 Tmat or fp16 T16,
// for the backward) at idx, row r, columns s .. s + 7: tr points at T's row piece, null for
// a block above the diagonal (zero, not formed); b0, b1 are beta of those columns. With
// p.tri16 no such block of Tv16 is stored.
__device__ __forceinline__ void wy_store_tv16_piece(const FwdParams& p, int r, int s, int64_t idx,
                                                    const float* tr, float4 b0, float4 b1) {
  float4 t0 = make_float4(0.f, 0.f, 0.f, 0.f), t1 = t0;
  if (tr != nullptr) {
    t0 = *reinterpret_cast<const float4*>(tr);
    t1 = *reinterpret_cast<const float4*>(tr + 4);
  }
  if (tri16_poison(p, r, s))
    *reinterpret_cast<uint4*>(p.Tv16 + idx) =
        make_uint4(kHalf2NaN, kHalf2NaN, kHalf2NaN, kHalf2NaN);
  else if (!tri16_skip(p, r, s))
    *reinterpret_cast<uint4*>(p.Tv16 + idx) =
        make_uint4(pack_half2(t0.x * b0.x, t0.y * b0.y), pack_half2(t0.z * b0.z, t0.w * b0.w),
                   pack_half2(t1.x * b1.x, t1.y * b1.y), pack_half2(t1.z * b1.z, t1.w * b1.w));
  if (p.Tmat) {
    *reinterpret_cast<float4*>(p.Tmat + idx) = t0;
    *reinterpret_cast<float4*>(p.Tmat + idx + 4) = t1;
  }
  if (p.T16)
    *reinterpret_cast<uint4*>(p.T16 + idx) =
        make_uint4(pack_half2(t0.x, t0.y), pack_half2(t0.z, t0.w), pack_half2(t1.x, t1.y),
                   pack_half2(t1.z, t1.w));
}

// The 16-byte pieces a thread stores of a chunk's 64 x 64 T: columns s = 8 (t % 8) of rows
// t / 8 + 32 i (i < 2), a warp covering 4 whole rows a store.
constexpr int kTvRows = NT / (C / 8);  // 32 rows a pass
__device__ __forceinline__ int tv16_row0() { return static_cast<int>(threadIdx.x) / (C / 8); }
__device__ __forceinline__ int tv16_col() { return 8 * (static_cast<int>(threadIdx.x) % (C / 8)); }

// Tv16 (T, for the backward) of one value head, its pieces' rows and addresses formed once a
// thread. t_at(r, s) points at T's row r, columns s .. s + 7, in a block at or below the
// diagonal.
template <typename TAt>
__device__ __forceinline__ void wy_store_tv16(const FwdParams& p, const float* bs,
                                              int64_t row_off, int L, TAt t_at) {
  const int r0 = tv16_row0(), s = tv16_col();
  const float4 b0 = *reinterpret_cast<const float4*>(bs + s);
  const float4 b1 = *reinterpret_cast<const float4*>(bs + s + 4);
#pragma unroll
  for (int i = 0; i < C / kTvRows; ++i) {
    const int r = r0 + kTvRows * i;
    if (r >= L) break;
    wy_store_tv16_piece(p, r, s, (row_off + static_cast<int64_t>(r) * p.Hv) * C + s,
                        s / 16 <= r / 16 ? t_at(r, s) : nullptr, b0, b1);
  }
}

// The chunk's warm-up bound Lb[lb_idx] = G_last + sum_r log max(1, |1 - beta_r |k_r|^2|) of
// one value head (kernel header), by one whole warp.
__device__ __forceinline__ void wy_store_lb(const FwdParams& p, const float* bs, const float* Gs,
                                            const float* kn, int L, int64_t lb_idx,
                                            int kn_ld = 1) {
  const int lane = lane_id();
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lane + 32 * i;
    if (r < L) acc += __logf(fmaxf(1.f, fabsf(1.f - bs[r] * kn[r * kn_ld])));
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) p.Lb[lb_idx] = Gs[L - 1] + acc;
}

// G and (the 128-column pass's) e^G, e^{G_last - G} of one value head, rows tid, tid +
// nthreads, ...
__device__ __forceinline__ void wy_store_gates(const FwdParams& p, const float* Gs,
                                               int64_t row_off, int L, int tid, int nthreads) {
  for (int r = tid; r < L; r += nthreads) {
    p.G[row_off + r * p.Hv] = Gs[r];
    if (p.EG != nullptr)
      p.EG[row_off + r * p.Hv] = make_float2(__expf(Gs[r]), __expf(Gs[L - 1] - Gs[r]));
  }
}

// kFree (the default f16 pass): T diag(beta) goes out as fp16 (Tv16) instead of W and U0,
// which are never formed (the state pass builds U from V, K S and Tv16), so v is not read.
// It also runs on tensor cores where the !kFree (tf32 / wgmma pass) kernel loops in fp32:
// K K^T and Q K^T on m16n8k16 in the inputs' own type (ldmatrix fragments, half the mma of
// TF32, no widening; the products of 16-bit values are exact in both, only the fp32
// accumulation order differs), and the inverse's block rows on TF32 mma.sync
// (inverse_block_rows_tc, one barrier per block row instead of fp32 loops of all 256
// threads; bench/precision_study.py "inverse blocks tf32": the same o and state errors).
// H100, 16/32 x 32768: 0.811 -> 0.680 ms (perf-notes version 16).
// A and T over the dead K, Q tiles (42 KB) and at most 64 registers: 4 blocks per SM
// instead of 3 (H100, 2026-11-23: 2/8 x 32768 0.129 -> 0.113 ms; 16/32 0.680 -> 0.690,
// where DRAM (54%, 1.8 TB/s) and L2 (66%) are the busier side).
// kMulti (kFree only): a block takes p.wy_heads value heads of one q/k head (they share K,
// Q, K K^T and Q K^T: loaded and multiplied once, the products kept in registers across
// the heads' epilogues and inverses), at 3 blocks per SM for the registers.
template <typename In, bool kFree = false, bool kMulti = false>
__global__ void __launch_bounds__(NT, kFree ? (kMulti ? 3 : 4) : 2) wy_kernel(FwdParams p) {
  static_assert(kFree || !kMulti, "several heads a block: the default pass's kernel only");
  if (p.seqs.failed()) return;
  const int nh = kMulti ? p.wy_heads : 1;  // divides H_v / H_qk
  const WyBlock wb = wy_block(p, nh);
  const int64_t chunk = wb.chunk, h0 = wb.h0, hq = wb.hq;
  const ChunkRef ck = wb.ck;
  if (ck.L == 0) return;
  const int L = ck.L;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  In* Ks = reinterpret_cast<In*>(smem_raw);  // [C][LDH]
  In* Qs = Ks + C * LDH;
  In* Vs = Qs + C * LDH;  // !kFree
  // kFree: A and T over the K, Q tiles (written after the products' barrier)
  float* As = kFree ? reinterpret_cast<float*>(smem_raw) : reinterpret_cast<float*>(Vs + C * LDH);
                                                       // [C][LDA] A, then T diag(beta e^G)
  float* Ts = As + C * LDA;                            // [C][LDA] T
  float* Tv = Ts + C * LDA;                            // [C][LDA] T diag(beta) (!kFree)
  [[maybe_unused]] float* xs = Ts + C * LDA;           // kFree: the inverse's scratch
  // [heads][C] beta
  float* bs_all = reinterpret_cast<float*>(smem_raw + kWySmem<kFree, kMulti> - kWyTail);
  float* Gs_all = bs_all + kWyMaxHeads * C;            // [heads][C]
  float* kn = Gs_all + kWyMaxHeads * C;                // [C] |k_r|^2 (shared by the heads)

  const int64_t qk_off = (ck.tok0 * p.Hqk + hq) * D, row_off0 = ck.tok0 * p.Hv + h0;
  const In* kg = static_cast<const In*>(p.k) + qk_off;
  cp_async_tile<C, D, LDH>(Ks, kg, p.Hqk * D, L);
  if constexpr (!kFree)
    cp_async_tile<C, D, LDH>(Vs, static_cast<const In*>(p.v) + row_off0 * D, p.Hv * D, L);
  cp_async_tile<C, D, LDH>(Qs, static_cast<const In*>(p.q) + qk_off, p.Hqk * D, L);
  cp_async_commit();
  const int warp = threadIdx.x >> 5, lane = lane_id();
  wy_gates(p, ck, h0, nh, bs_all, Gs_all);
  cp_async_wait<0>();
  __syncthreads();
  wy_gates_carry(nh, Gs_all);
  wy_fp16_copies(p, Ks, Qs, h0, qk_off, L);
  __syncthreads();

  // P, staged for the stores: in T's bytes (written from the substitution on), or (kMulti) in a
  // tile of its own after the inverse's scratch
  float* Ps = kMulti ? xs + (NT / 32) * 16 * kXsLd : Ts;
  // K K^T and Q K^T: warp w owns rows 16 (w % 4) .. +16, columns 32 (w / 4) .. +32
  const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
  float kk[4][4] = {}, qk[4][4] = {};
  if constexpr (kFree) {  // 16-bit m16n8k16
    wy_kk_qk16(kk, qk, Ks, Qs, m0, n0);
  } else {
#pragma unroll 4
    for (int k0 = 0; k0 < D; k0 += 8) {
      uint32_t ak[4], aq[4];
      frag_a(ak, Ks, LDH, m0, k0);
      frag_a(aq, Qs, LDH, m0, k0);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b[2];
        frag_b(b, Ks, LDH, n0 + 8 * j, k0);
        mma_tf32(kk[j], ak, b);
        mma_tf32(qk[j], aq, b);
      }
    }
  }
  if constexpr (kFree) __syncthreads();  // every read of K, Q done: A goes over them

  // the value heads of the block in turn (one for !kMulti)
  for (int hi = 0; hi < nh; ++hi) {
    const int64_t row_off = row_off0 + hi;
    const float* bs = bs_all + hi * C;
    const float* Gs = Gs_all + hi * C;
    // No barrier between heads: the epilogue writes As and Ps, whose last readers (the
    // inverse's block rows, the P stores) a barrier already closed; the previous head's T
    // stores read only Ts, which the substitution rewrites after the epilogue's barrier.
    {
      // A and P from the products: each thread's values sit in 2 rows and 8 columns, so their
      // gates (in log2 units: one FADD and one EX2 a decay factor) and beta are read once;
      // pairs of columns go out as float2
      constexpr float kL2e = 1.4426950408889634f;
      // this thread's rows ra, ra + 8 and columns n0 + 8 j + ca (+1)
      const int ra = m0 + acc_row(0), ca = acc_col(0);
      const float gr[2] = {Gs[ra] * kL2e, Gs[ra + 8] * kL2e}, br[2] = {bs[ra], bs[ra + 8]};
  #pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int s = n0 + 8 * j + ca;
        if (n0 + 8 * j > m0 + 15) {  // the tile lies above the diagonal (warp-uniform): zero
  #pragma unroll
          for (int i = 0; i < 2; ++i) {
            *reinterpret_cast<float2*>(As + (ra + 8 * i) * LDA + s) = make_float2(0.f, 0.f);
            *reinterpret_cast<float2*>(Ps + (ra + 8 * i) * LDA + s) = make_float2(0.f, 0.f);
          }
          continue;
        }
        const float gs0 = Gs[s] * kL2e, gs1 = Gs[s + 1] * kL2e;
  #pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = ra + 8 * i;
          const float d0 = s <= r ? exp2f(gr[i] - gs0) : 0.f;  // Dec[r, s], zero above the diagonal
          const float d1 = s + 1 <= r ? exp2f(gr[i] - gs1) : 0.f;
          const float k0 = kk[j][2 * i], k1 = kk[j][2 * i + 1];
          *reinterpret_cast<float2*>(As + r * LDA + s) =
              make_float2(s < r ? br[i] * d0 * k0 : 0.f, s + 1 < r ? br[i] * d1 * k1 : 0.f);
          // P rounded to tf32 (round half away) in every pass, also where only its fp16 copy
          // is used (round half even of fp32 would differ on ties): the forward that keeps
          // its records for the backward and the one that does not give the same bits
          *reinterpret_cast<float2*>(Ps + r * LDA + s) =
              make_float2(round_tf32(qk[j][2 * i] * d0), round_tf32(qk[j][2 * i + 1] * d1));
          if (hi == 0) {
            if (s == r) kn[r] = k0;
            if (s + 1 == r) kn[r] = k1;
          }
        }
      }
    }
    __syncthreads();
    // P's rows out in 16-byte pieces, a warp's store covering whole rows (the accumulator
    // layout would write 16 bytes of each of 8 rows): fp32 (tf32-rounded) and/or fp16 (exact:
    // tf32 and fp16 share the 10-bit mantissa); the chunk's warm-up bound, G and e^G. kMulti:
    // by warps 2..7 while warps 0, 1 run the substitution below (P has its own tile), else by
    // every thread before it.
    auto p_stores = [&](int tid, int nthreads, int lb_warp) {
      if (p.Pmat != nullptr) {
        for (int e = tid; e < L * (C / 4); e += nthreads) {
          const int r = e / (C / 4), c = 4 * (e % (C / 4));
          *reinterpret_cast<float4*>(p.Pmat + (row_off + r * p.Hv) * C + c) =
              *reinterpret_cast<const float4*>(Ps + r * LDA + c);
        }
      }
      if (p.P16 != nullptr) {
        for (int e = tid; e < L * (C / 8); e += nthreads) {
          const int r = e / (C / 8), c = 8 * (e % (C / 8));
          if (tri16_skip(p, r, c)) continue;
          const float4 a = *reinterpret_cast<const float4*>(Ps + r * LDA + c);
          const float4 b = *reinterpret_cast<const float4*>(Ps + r * LDA + c + 4);
          *reinterpret_cast<uint4*>(p.P16 + (row_off + r * p.Hv) * C + c) =
              tri16_poison(p, r, c)
                  ? make_uint4(kHalf2NaN, kHalf2NaN, kHalf2NaN, kHalf2NaN)
                  : make_uint4(pack_half2(a.x, a.y), pack_half2(a.z, a.w), pack_half2(b.x, b.y),
                               pack_half2(b.z, b.w));
        }
      }
      if (p.Lb != nullptr && warp == lb_warp)  // warm-up bound of the chunk
        wy_store_lb(p, bs, Gs, kn, L, chunk * p.Hv + h0 + hi);
      wy_store_gates(p, Gs, row_off, L, tid, nthreads);
    };
    if constexpr (!kMulti) {
      p_stores(threadIdx.x, NT, 0);
      __syncthreads();  // P's stores read T's bytes
    }

    // T = (I + A)^-1 blockwise over 16 x 16 blocks (A strictly lower triangular):
    //   diagonal blocks by forward substitution, T_ii[r, j] = delta_rj - sum_{s<r} A_ii[r, s] T_ii[s, j]
    //   (one column per thread, 64 threads, chains of at most 15 steps);
    //   then block rows i = 1..3 in turn: X_ij = sum_{k=j}^{i-1} A_ik T_kj (in registers, then
    //   in A_ij's place: block row i of A is not read again) and T_ij = -T_ii X_ij for every
    //   j < i, all 256 threads; blocks above the diagonal are zero.
    //   fp32 throughout: the dependent chain is ~250 FMAs instead of 2016 for a whole column.
    {
      constexpr int B = 16;
      if constexpr (kMulti)
        if (threadIdx.x >= C) p_stores(threadIdx.x - C, NT - C, 2);
      if (threadIdx.x < C) {
        const int b = threadIdx.x / B, jj = threadIdx.x % B, r0 = b * B;
        float t[B];
  #pragma unroll
        for (int r = 0; r < B; ++r) {
          float acc = r == jj ? 1.f : 0.f;
  #pragma unroll
          for (int s = 0; s < r; ++s) acc -= As[(r0 + r) * LDA + r0 + s] * t[s];
          t[r] = acc;
        }
  #pragma unroll
        for (int r = 0; r < B; ++r) Ts[(r0 + r) * LDA + r0 + jj] = t[r];
      }
      if constexpr (!kFree) {  // zero blocks above the diagonal (kFree: never read)
        for (int e = threadIdx.x; e < C * C; e += NT) {
          const int r = e / C, c = e % C;
          if (c / B > r / B) Ts[r * LDA + c] = 0.f;
        }
      }
      __syncthreads();
      if constexpr (kFree) {  // TF32 block rows, each warp with its 16 x 8 scratch for X
        inverse_block_rows_tc(As, Ts, xs + warp * 16 * kXsLd);
      } else {
        static_assert((C / B - 1) * B * B <= 3 * NT, "three X values per thread at most");
  #pragma unroll
        for (int bi = 1; bi < C / B; ++bi) {
          float x[3];
  #pragma unroll
          for (int i = 0; i < 3; ++i) {  // X_ij for j < bi: element e = threadIdx.x + i NT
            const int e = threadIdx.x + i * NT;
            if (e < bi * B * B) {
              const int bj = e / (B * B), r = bi * B + (e % (B * B)) / B, c = bj * B + e % B;
              float acc = 0.f;
              for (int s = bj * B; s < bi * B; ++s) acc += As[r * LDA + s] * Ts[s * LDA + c];
              x[i] = acc;
            }
          }
          __syncthreads();  // every read of block row bi of A done
  #pragma unroll
          for (int i = 0; i < 3; ++i) {
            const int e = threadIdx.x + i * NT;
            if (e < bi * B * B) {
              const int bj = e / (B * B), r = bi * B + (e % (B * B)) / B, c = bj * B + e % B;
              As[r * LDA + c] = x[i];
            }
          }
          __syncthreads();
          for (int e = threadIdx.x; e < bi * B * B; e += NT) {  // T_ij = -T_ii X_ij
            const int bj = e / (B * B), r = bi * B + (e % (B * B)) / B, c = bj * B + e % B;
            float acc = 0.f;
            for (int s = bi * B; s <= r; ++s) acc += Ts[r * LDA + s] * As[s * LDA + c];
            Ts[r * LDA + c] = -acc;
          }
          __syncthreads();
        }
      }
    }
    if constexpr (kFree) {
      wy_store_tv16(p, bs, row_off, L, [&](int r, int s) { return Ts + r * LDA + s; });
    } else {  // As <- T diag(beta exp G), Tv <- T diag(beta) (tf32 operands of W and U0)
      // each thread keeps one column s, so its factors are computed once
      const int s = threadIdx.x % C;
      const float fb = bs[s], fe = fb * __expf(Gs[s]);
      for (int r = threadIdx.x / C; r < C; r += NT / C) {
        const float t = Ts[r * LDA + s];
        As[r * LDA + s] = round_tf32(t * fe);
        Tv[r * LDA + s] = round_tf32(t * fb);
        if (p.Tmat && r < L) p.Tmat[(row_off + r * p.Hv) * C + s] = t;
      }
    }
  }  // value heads
  if constexpr (kFree) return;  // no W, U0
  __syncthreads();

  // W = As K and U0 = Tv V: warp w owns rows 16 (w % 4) .. +16, columns 64 (w / 4) .. +64.
  // T is lower triangular, so the k steps stop at the warp's last row.
  {
    const int m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2);
    float w[8][4] = {}, u[8][4] = {};
    for (int k0 = 0; k0 < m0 + 16; k0 += 8) {
      uint32_t aw[4], au[4];
      frag_a(aw, As, LDA, m0, k0);
      frag_a(au, Tv, LDA, m0, k0);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t bk[2], bv[2];
        frag_b_trans(bk, Ks, LDH, n0 + 8 * j, k0);
        frag_b_trans(bv, Vs, LDH, n0 + 8 * j, k0);
        mma_tf32(w[j], aw, bk);
        mma_tf32(u[j], au, bv);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = m0 + acc_row(e), c = n0 + 8 * j + acc_col(e);
        if (r < L) {
          const int64_t idx = (row_off0 + r * p.Hv) * D + c;
          *reinterpret_cast<__half2*>(p.W + idx) = __floats2half2_rn(w[j][e], w[j][e + 1]);
          *reinterpret_cast<float2*>(p.U0 + idx) =
              make_float2(round_tf32(u[j][e]), round_tf32(u[j][e + 1]));
        }
      }
  }
}

// ---------------------------------------------------------------------------------------
// wy_batched_kernel<In, kH>  grid (max_chunks * H_v / wy_heads), 256 threads, up to kH = 4
//   value heads a block: 74 KB smem, 3 blocks per SM; kH = 2 (wy_heads 2, e.g. 16/32 heads):
//   47 KB and 4 blocks per SM, 64 registers. Reads k, q, g, beta; writes Tv16 (T, P for the
//   backward), P16, G, EG, Lb and the fp16 copies of k, q (as wy_kernel, its header).
//   The default pass's wy_kernel<In, true, true> with the same outputs, bit for bit
//   (tests/test_context_parallel.py test_wy_batched_bit_identical), from the same reads.
//   There a block's value heads go through the epilogue, the substitution and the
//   inverse's three block rows one after another, five block barriers a head, and in most
//   of those phases most warps wait: the substitution is 64 threads' work, the block rows
//   2, 4 and 6 warps'. Here every phase takes all of the block's heads at once (4 heads:
//   the substitution is exactly 256 threads' work, the block rows 8, 16 and 24 warp tasks),
//   eleven barriers a block instead of twenty-three. What makes the heads fit side by side:
//   - each head keeps only the lower block triangle of A (ten 16 x 16 fp32 blocks,
//     kWyBlk floats each), and T is formed in A's place (the substitution's diagonal
//     blocks after a warp's reads, a block row's T_ij once every X of the row is formed);
//   - P goes to global memory through a warp's own 1 KB scratch, not a block's staging tile.
constexpr int kWyBLd = 24;  // a block's row stride (floats): A fragments' float2 loads conflict free
constexpr int kWyBlk = 16 * kWyBLd;
constexpr int kWyTri = 10;  // blocks of a 4 x 4 lower block triangle
// the K, Q tiles, then kH heads' blocks over them
constexpr size_t wy_batched_tiles(int kH) {
  return sizeof(float) * kH * kWyTri * kWyBlk > sizeof(uint16_t) * 2 * C * LDH
             ? sizeof(float) * kH * kWyTri * kWyBlk
             : sizeof(uint16_t) * 2 * C * LDH;
}
// A warp's scratch: the block rows' X [16][kXsLd] fp32, or the epilogue's P rows [16][kWyPLd]
// fp16 (its 16 x 32 accumulator tile, restaged so that a store covers 64 bytes of 8 rows)
constexpr int kWyPLd = 40;  // 80-byte rows: the accumulator layout's 32-bit writes conflict free
constexpr int kWyScratch = 16 * kWyPLd / 2;  // floats
static_assert(kWyScratch >= 16 * kXsLd, "X fits in a warp's scratch");
// the tail: beta and G of kH heads, |k|^2
constexpr size_t wy_batched_tail(int kH) { return sizeof(float) * (2 * kH + 1) * C; }
constexpr size_t wy_batched_smem(int kH) {
  return wy_batched_tiles(kH) + sizeof(float) * (NT / 32) * kWyScratch + wy_batched_tail(kH);
}
static_assert(wy_batched_smem(kWyMaxHeads) <= 227 * 1024 / 3, "three blocks of 4 heads per SM");
static_assert(wy_batched_smem(2) <= 227 * 1024 / 4, "four blocks of 2 heads per SM");

// wy_batched_kernel's Tv16 (T, for the backward) of all its heads: wy_store_tv16's pieces, the
// blocks' offsets and the rows' global offsets formed once for every head.
__device__ __forceinline__ void wy_batched_store_tv16(const FwdParams& p, const float* Ab,
                                                      const float* bs_all, int64_t row_off0,
                                                      int nh, int L) {
  constexpr int B = 16;
  const int r0 = tv16_row0(), s = tv16_col();
  int toff[C / kTvRows];  // the piece's offset in a head's blocks (-1: above the diagonal)
  int64_t gidx[C / kTvRows];
#pragma unroll
  for (int i = 0; i < C / kTvRows; ++i) {
    const int r = r0 + kTvRows * i, bi = r / B, bj = s / B;
    toff[i] = bj <= bi ? (bi * (bi + 1) / 2 + bj) * kWyBlk + (r % B) * kWyBLd + s % B : -1;
    gidx[i] = (row_off0 + static_cast<int64_t>(r) * p.Hv) * C + s;
  }
  for (int hi = 0; hi < nh; ++hi) {
    const float* bs = bs_all + hi * C;
    const float4 b0 = *reinterpret_cast<const float4*>(bs + s);
    const float4 b1 = *reinterpret_cast<const float4*>(bs + s + 4);
    const float* Th = Ab + hi * kWyTri * kWyBlk;
#pragma unroll
    for (int i = 0; i < C / kTvRows; ++i) {
      const int r = r0 + kTvRows * i;
      if (r >= L) break;
      wy_store_tv16_piece(p, r, s, gidx[i] + hi * C, toff[i] >= 0 ? Th + toff[i] : nullptr, b0,
                          b1);
    }
  }
}

// Block (i, j), j <= i, of value head h's lower block triangle.
__device__ __forceinline__ float* wy_blk(float* base, int h, int i, int j) {
  return base + (h * kWyTri + i * (i + 1) / 2 + j) * kWyBlk;
}

template <typename In, int kH>
__global__ void __launch_bounds__(NT, kH <= 2 ? 4 : 3) wy_batched_kernel(FwdParams p) {
  static_assert(kH >= 2 && kH <= kWyMaxHeads, "value heads a block");
  constexpr size_t kSmem = wy_batched_smem(kH);
  if (p.seqs.failed()) return;
  const int nh = p.wy_heads;  // divides H_v / H_qk, at most kH
  const WyBlock wb = wy_block(p, nh);
  const int64_t chunk = wb.chunk, h0 = wb.h0, hq = wb.hq;
  const ChunkRef ck = wb.ck;
  if (ck.L == 0) return;
  const int L = ck.L;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  In* Ks = reinterpret_cast<In*>(smem_raw);  // [C][LDH], then the heads' blocks over them
  In* Qs = Ks + C * LDH;
  float* Ab = reinterpret_cast<float*>(smem_raw);  // [heads][kWyTri][kWyBlk] A, then T
  float* xs = reinterpret_cast<float*>(smem_raw + wy_batched_tiles(kH));  // [warps][kWyScratch]
  float* bs_all = reinterpret_cast<float*>(smem_raw + kSmem - wy_batched_tail(kH));  // [heads][C]
  float* Gs_all = bs_all + kH * C;                                                  // [heads][C]
  float* kn = Gs_all + kH * C;  // [C] |k_r|^2

  const int64_t qk_off = (ck.tok0 * p.Hqk + hq) * D, row_off0 = ck.tok0 * p.Hv + h0;
  cp_async_tile<C, D, LDH>(Ks, static_cast<const In*>(p.k) + qk_off, p.Hqk * D, L);
  cp_async_tile<C, D, LDH>(Qs, static_cast<const In*>(p.q) + qk_off, p.Hqk * D, L);
  cp_async_commit();
  const int warp = threadIdx.x >> 5, lane = lane_id();
  wy_gates(p, ck, h0, nh, bs_all, Gs_all);
  cp_async_wait<0>();
  __syncthreads();
  wy_gates_carry(nh, Gs_all);
  wy_fp16_copies(p, Ks, Qs, h0, qk_off, L);
  __syncthreads();

  // K K^T and Q K^T (as wy_kernel): warp w rows 16 (w % 4) .. +16, columns 32 (w / 4) .. +32
  const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
  float kk[4][4] = {}, qk[4][4] = {};
  wy_kk_qk16(kk, qk, Ks, Qs, m0, n0);
  __syncthreads();  // every read of K, Q done: the blocks go over them

  // Epilogue, every head: A's lower blocks to shared memory, P (tf32-rounded, as wy_kernel)
  // to global memory: fp16 through the warp's scratch (a 16-byte store a lane, 64 bytes of 8
  // rows a warp store; the accumulator layout's would write 16 bytes of 8 rows), fp32 (the
  // backward's) straight from the accumulators
  {
    constexpr float kL2e = 1.4426950408889634f;
    const int ra = m0 + acc_row(0), ca = acc_col(0), bi = warp & 3;
    __half* ps = reinterpret_cast<__half*>(xs + warp * kWyScratch);  // [16][kWyPLd]
    for (int hi = 0; hi < nh; ++hi) {
      const float* bs = bs_all + hi * C;
      const float* Gs = Gs_all + hi * C;
      const int64_t row_off = row_off0 + hi;
      const float gr[2] = {Gs[ra] * kL2e, Gs[ra + 8] * kL2e}, br[2] = {bs[ra], bs[ra + 8]};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int s = n0 + 8 * j + ca;
        float pv[2][2] = {};
        if (n0 + 8 * j <= m0 + 15) {  // the tile meets the lower triangle (warp-uniform)
          const float gs0 = Gs[s] * kL2e, gs1 = Gs[s + 1] * kL2e;
          float* ab = wy_blk(Ab, hi, bi, (n0 + 8 * j) / 16) + (n0 + 8 * j) % 16 + ca;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int r = ra + 8 * i;
            const float d0 = s <= r ? exp2f(gr[i] - gs0) : 0.f;
            const float d1 = s + 1 <= r ? exp2f(gr[i] - gs1) : 0.f;
            const float k0 = kk[j][2 * i], k1 = kk[j][2 * i + 1];
            *reinterpret_cast<float2*>(ab + (acc_row(0) + 8 * i) * kWyBLd) =
                make_float2(s < r ? br[i] * d0 * k0 : 0.f, s + 1 < r ? br[i] * d1 * k1 : 0.f);
            pv[i][0] = round_tf32(qk[j][2 * i] * d0);
            pv[i][1] = round_tf32(qk[j][2 * i + 1] * d1);
            if (hi == 0) {
              if (s == r) kn[r] = k0;
              if (s + 1 == r) kn[r] = k1;
            }
          }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = ra + 8 * i;
          *reinterpret_cast<uint32_t*>(ps + (acc_row(0) + 8 * i) * kWyPLd + 8 * j + ca) =
              pack_half2(pv[i][0], pv[i][1]);
          if (p.Pmat != nullptr && r < L)
            *reinterpret_cast<float2*>(p.Pmat + (row_off + r * p.Hv) * C + s) =
                make_float2(pv[i][0], pv[i][1]);
        }
      }
      __syncwarp();
      if (p.P16 != nullptr) {
#pragma unroll
        for (int e = lane; e < 16 * 4; e += 32) {  // 16 rows of 4 pieces of 8 values
          const int r = m0 + e / 4, c = 8 * (e % 4);
          if (r < L && !tri16_skip(p, r, n0 + c))
            *reinterpret_cast<uint4*>(p.P16 + (row_off + r * p.Hv) * C + n0 + c) =
                tri16_poison(p, r, n0 + c)
                    ? make_uint4(kHalf2NaN, kHalf2NaN, kHalf2NaN, kHalf2NaN)
                    : *reinterpret_cast<const uint4*>(ps + (e / 4) * kWyPLd + c);
        }
      }
      __syncwarp();  // ps is rewritten for the next head
    }
  }
  __syncthreads();

  // Diagonal blocks of T by forward substitution, a thread a column of one head's block
  // (4 heads: all 256 threads), T_ii over A_ii once the warp's reads are done
  constexpr int B = 16;
  if (threadIdx.x < nh * C) {  // whole warps
    const int hi = threadIdx.x / C, b = (threadIdx.x % C) / B, jj = threadIdx.x % B;
    float* a = wy_blk(Ab, hi, b, b);
    float t[B];
#pragma unroll
    for (int r = 0; r < B; ++r) {
      float acc = r == jj ? 1.f : 0.f;
#pragma unroll
      for (int s = 0; s < r; ++s) acc -= a[r * kWyBLd + s] * t[s];
      t[r] = acc;
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < B; ++r) a[r * kWyBLd + jj] = t[r];
  }
  __syncthreads();

  // Block rows i = 1..3 of every head on TF32 mma.sync (inverse_block_rows_tc's products in
  // its order): task (head, w), w < 2 i, takes the 8 columns c0 = 8 w of block column
  // j = w / 2: X = sum_{k=j}^{i-1} A_ik T_kj[:, c0..], then T_ij[:, c0..] = -T_ii X over A_ij
  // (after a barrier: A_ij is read by the row's X of every j' <= j)
  {
    const int g = lane >> 2, t = lane & 3;
    float* xw = xs + warp * kWyScratch;
    auto frag_b_kn = [&](uint32_t(&bf)[2], const float* m, int ld, int c, int k0) {
      bf[0] = __float_as_uint(round_tf32(m[(k0 + 2 * t) * ld + c + g]));
      bf[1] = __float_as_uint(round_tf32(m[(k0 + 2 * t + 1) * ld + c + g]));
    };
    constexpr int kMaxTasks = (kH * 2 * (C / B - 1) + NT / 32 - 1) / (NT / 32);
#pragma unroll
    for (int bi = 1; bi < C / B; ++bi) {
      const int ntask = nh * 2 * bi;
      float x[kMaxTasks][4];
#pragma unroll
      for (int m = 0; m < kMaxTasks; ++m) {
        const int q = warp + (NT / 32) * m;
#pragma unroll
        for (int e = 0; e < 4; ++e) x[m][e] = 0.f;
        if (q >= ntask) continue;
        const int hi = q / (2 * bi), w = q % (2 * bi), bj = w / 2, c = 8 * (w & 1);
        for (int kb = bj; kb < bi; ++kb) {
          const float* a_ik = wy_blk(Ab, hi, bi, kb);
          const float* t_kj = wy_blk(Ab, hi, kb, bj);
#pragma unroll
          for (int k0 = 0; k0 < B; k0 += 8) {
            uint32_t a[4], bf[2];
            frag_a_rna(a, a_ik, kWyBLd, 0, k0);
            frag_b_kn(bf, t_kj, kWyBLd, c, k0);
            mma_tf32(x[m], a, bf);
          }
        }
      }
      __syncthreads();  // every X of the row formed: its A blocks may be overwritten
#pragma unroll
      for (int m = 0; m < kMaxTasks; ++m) {
        const int q = warp + (NT / 32) * m;
        if (q >= ntask) continue;
        const int hi = q / (2 * bi), w = q % (2 * bi), bj = w / 2, c = 8 * (w & 1);
        xw[g * kXsLd + 2 * t] = x[m][0];
        xw[g * kXsLd + 2 * t + 1] = x[m][1];
        xw[(g + 8) * kXsLd + 2 * t] = x[m][2];
        xw[(g + 8) * kXsLd + 2 * t + 1] = x[m][3];
        __syncwarp();
        const float* t_ii = wy_blk(Ab, hi, bi, bi);
        float y[4] = {};
#pragma unroll
        for (int k0 = 0; k0 < B; k0 += 8) {
          uint32_t a[4], bf[2];
          frag_a_rna(a, t_ii, kWyBLd, 0, k0);
          frag_b_kn(bf, xw, kXsLd, 0, k0);
          mma_tf32(y, a, bf);
        }
        __syncwarp();  // xw is rewritten by the next task
        float* t_ij = wy_blk(Ab, hi, bi, bj) + c + 2 * t;
        *reinterpret_cast<float2*>(t_ij + g * kWyBLd) = make_float2(-y[0], -y[1]);
        *reinterpret_cast<float2*>(t_ij + (g + 8) * kWyBLd) = make_float2(-y[2], -y[3]);
      }
      __syncthreads();
    }
  }

  // Tv16 <- T diag(beta) in fp16 (and T, fp32 or fp16, for the backward), G, e^G, the warm-up
  // bound: every head (as wy_kernel's stores)
  wy_batched_store_tv16(p, Ab, bs_all, row_off0, nh, L);
  for (int hi = 0; hi < nh; ++hi) {
    const float* bs = bs_all + hi * C;
    const float* Gs = Gs_all + hi * C;
    const int64_t row_off = row_off0 + hi;
    if (p.Lb != nullptr && warp == hi)  // warm-up bound of the chunk
      wy_store_lb(p, bs, Gs, kn, L, chunk * p.Hv + h0 + hi);
    wy_store_gates(p, Gs, row_off, L, threadIdx.x, NT);
  }
}

// ---------------------------------------------------------------------------------------
// state_fwd_kernel

template <typename In, int BW>
struct StateFwdSmem {
  static constexpr size_t kStage =
      sizeof(__half) * C * LDH + sizeof(float) * (C * LDA + C) + sizeof(In) * 2 * C * LDH;
  static constexpr size_t kBytes = 2 * kStage + sizeof(float) * (BW * LDW + 2 * BW * LDA);
};

// The state entering a forward segment's first chunk: seg_in for an exact segment (phase 0),
// h0 at the sequence's start, else null (zero: warm-ups, phase-1 local states, no h0).
__device__ __forceinline__ const float* entering_state(const FwdParams& p, const SegmentBlock& b) {
  const float* src = nullptr;
  if (p.phase == 0 && b.ss.src == SegSource::Exact)
    src = b.sub > 0 ? p.sub_L + sub_offset(p, b.z, b.h, b.sub)
                    : p.seg_in + (b.z * p.Hv + b.h) * D * D;
  if (b.ss.src == SegSource::H0 && p.h0 != nullptr) src = p.h0 + (b.n * p.Hv + b.h) * D * D;
  return src;
}

// Where the state leaving a forward segment goes: this block's summary (phase 1: L, or M for
// the identity's columns), the final state after the sequence's last chunk, else nowhere.
__device__ __forceinline__ float* leaving_state(const FwdParams& p, const SegmentBlock& b) {
  if (p.phase == 1) return (b.identity ? p.seg_M : p.seg_L) + (b.z * p.Hv + b.h) * D * D;
  if (b.c_end >= b.nch && p.ht) return p.ht + (b.n * p.Hv + b.h) * D * D;
  return nullptr;
}

// U0 of chunk ci, rows m0 + (g, g + 8), columns b.vb + n0 + 8 jj + (2t, 2t + 1), straight
// into registers (zero past the chunk's end and for the transition, U0 = 0).
template <int NJ>
__device__ __forceinline__ void load_u0_rows(float (&u)[NJ][4], const FwdParams& p,
                                             const SegmentBlock& b, int64_t ci, int m0, int n0) {
  if (b.identity) {
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) u[jj][e] = 0.f;
    return;
  }
  const int64_t tok0 = b.start + ci * C;
  const int L = chunk_rows(b.len, ci);
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int r = m0 + acc_row(e), c = b.vb + n0 + 8 * jj + acc_col(e);
      float2 v = make_float2(0.f, 0.f);
      if (r < L) v = *reinterpret_cast<const float2*>(p.U0 + ((tok0 + r) * p.Hv + b.h) * D + c);
      u[jj][e] = v.x;
      u[jj][e + 1] = v.y;
    }
}

// Writes scale * acc, a warp's 16 x 8 NJ block of the outputs (rows m0 .. of the chunk at
// token tok0 with L rows, columns col0 ..), as In pairs.
template <typename In, int NJ>
__device__ __forceinline__ void store_o_block(const FwdParams& p, const float (&acc)[NJ][4],
                                              int64_t tok0, int L, int64_t h, int m0, int col0) {
  In* o = static_cast<In*>(p.o);
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int r = m0 + acc_row(e), c = col0 + 8 * jj + acc_col(e);
      if (r < L) {
        In pair[2] = {from_f<In>(p.scale * acc[jj][e]), from_f<In>(p.scale * acc[jj][e + 1])};
        *reinterpret_cast<uint32_t*>(o + ((tok0 + r) * p.Hv + h) * D + c) =
            *reinterpret_cast<const uint32_t*>(pair);
      }
    }
}

// SegParams::corr, phase 1 of an exact segment: whether this block writes outputs (its local
// outputs O_loc, or Q_eff from the identity's block), and the store of a warp's 16 x 8 NJ
// block of them (rows m0 .. of the chunk at token tok0 with L rows, columns col0 ..) as
// scale * acc in fp32, [h][column][token].
__device__ __forceinline__ bool corr_outputs(const FwdParams& p, const SegmentBlock& b) {
  return p.corr && p.phase == 1 && b.ss.src == SegSource::Exact;
}
template <int NJ>
__device__ __forceinline__ void store_o_corr(const FwdParams& p, const SegmentBlock& b,
                                             const float (&acc)[NJ][4], int64_t tok0, int L,
                                             int m0, int col0) {
  float* dst = (b.identity ? p.q_eff : p.o_loc) + static_cast<size_t>(b.h) * D * p.corr_ld + tok0;
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = m0 + acc_row(e), c = col0 + 8 * jj + acc_col(e);
      if (r < L) __stcg(dst + static_cast<size_t>(c) * p.corr_ld + r, p.scale * acc[jj][e]);
    }
}

// One segment block of state_fwd_mma_kernel (for_each_segment_block).
template <typename In, int BW, typename PT>
__device__ __forceinline__ void state_fwd_mma_segment(const FwdParams& p, const SegmentBlock& b) {
  static_assert(BW == 16 || BW == 32, "column block of 16 or 32");
  constexpr int NJ = BW / 16;  // n tiles per warp of the 64 x BW products
  constexpr int NS = BW / 8;   // n tiles per warp of the 128 x BW state update
  // ---- which segment of which sequence, where its state comes from (phase 0), or which
  // summary this block forms (phase 1; the local state is zero-based for an exact segment)
  // the redo of a guarded fp16 pass: only the blocks it flagged (same grid, same segments)
  if (p.redo_pass && p.redo[redo_index(b)] == 0) return;
  const int64_t h = b.h, hq = b.hq, start = b.start, len = b.len;
  const int64_t chunk0 = b.chunk0, c_begin = b.c_begin, c_end = b.c_end;
  const SegStart ss = b.ss;
  const int vb = b.vb;
  const bool identity = b.identity;
  const int64_t c_first = ss.c_first;
  // P as stored: tf32-rounded fp32 (Pmat) or fp16 (P16, the guarded fp16 pass's workspace;
  // both exact tf32 operands)
  const PT* pmat;
  if constexpr (std::is_same<PT, float>::value) pmat = p.Pmat;
  else pmat = p.P16;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* stage_base = reinterpret_cast<float*>(smem_raw);
  auto Wst = [&](int s) { return reinterpret_cast<__half*>(smem_raw + s * StateFwdSmem<In, BW>::kStage); };
  auto Pst = [&](int s) { return reinterpret_cast<float*>(Wst(s) + C * LDH); };
  auto Gst = [&](int s) { return Pst(s) + C * LDA; };
  auto Kst = [&](int s) { return reinterpret_cast<In*>(Gst(s) + C); };
  auto Qst = [&](int s) { return Kst(s) + C * LDH; };
  float* Ss = reinterpret_cast<float*>(smem_raw + 2 * StateFwdSmem<In, BW>::kStage);  // [BW][LDW] S^T
  float* Us = Ss + BW * LDW;  // [BW][LDA] U^T
  float* Ue = Us + BW * LDA;  // [BW][LDA] (diag(eL) U)^T
  (void)stage_base;

  const int warp = threadIdx.x >> 5;
  const In* kbase = static_cast<const In*>(p.k);
  const In* qbase = static_cast<const In*>(p.q);
  const bool want_o = p.phase == 0 && p.o != nullptr && !(p.debug & 1);
  const bool record = p.phase == 0 && p.h != nullptr;  // the backward's recomputation

  auto issue = [&](int64_t ci, int s) {
    if (p.debug & 2) return;
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    cp_async_tile<C, D, LDH>(Wst(s), p.W + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    cp_async_tile<C, D, LDH>(Kst(s), kbase + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    if (want_o && ci >= c_begin) {
      cp_async_tile<C, D, LDH>(Qst(s), qbase + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
      cp_async_tile<C, C, LDA>(reinterpret_cast<PT*>(Pst(s)), pmat + (tok0 * p.Hv + h) * C,
                               p.Hv * C, L);
    }
    if (threadIdx.x < C) {
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      cp_async4(Gst(s) + threadIdx.x, p.G + (tok0 + r) * p.Hv + h);
    }
    cp_async_commit();
  };
  // U0 of rows m0 + (g, g + 8), columns n0 + 8 jj + (2t, 2t + 1) straight into registers
  const int m0 = 16 * (warp >> 1), n0 = (warp & 1) * (BW / 2);
  auto load_u0 = [&](float (&u)[NJ][4], int64_t ci) { load_u0_rows(u, p, b, ci, m0, n0); };

  // ---- initial state: registers (load_acc_state's layout)
  float sacc[NS][4];
  load_acc_state(sacc, entering_state(p, b), vb, identity);
  store_acc_state_smem_t(Ss, LDW, sacc);

  // U0 registers alternate between two sets (the loop is unrolled by two), so a chunk's
  // U0 loads are issued one whole step before their use and nothing waits on them.
  float u0a[NJ][4], u0b[NJ][4];
  if (c_first < c_end) {
    issue(c_first, 0);
    load_u0(u0a, c_first);
  }
  auto step = [&](const int64_t ci, const float (&u0)[NJ][4], float (&u0n)[NJ][4]) {
    const int s = static_cast<int>((ci - c_first) & 1);
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    cp_async_wait<0>();
    __syncthreads();  // stage s landed; Ss, Us, Ue of the previous chunk complete
    if (ci + 1 < c_end) {
      issue(ci + 1, s ^ 1);
      load_u0(u0n, ci + 1);  // used one step later: no wait here
    }
    const bool out = want_o && ci >= c_begin;
    if (record && ci >= c_begin)  // the state entering chunk ci
      store_acc_state(p.h + ((chunk0 + ci) * p.Hv + h) * D * D, sacc, vb);
    const __half* W = Wst(s);
    const float* G = Gst(s);
    const float gl = G[C - 1];

    // U = U0 - W S and QS = Q S. Even and odd k steps go to separate accumulators (summed
    // at the end) so that each dependent mma chain is half as long.
    float ua[NJ][4] = {}, qa[NJ][4] = {};
    {
      float ub[NJ][4] = {}, qb[NJ][4] = {};
      auto products = [&](auto with_q) {  // with_q: Q S as well (chunks with outputs)
        constexpr bool kQ = decltype(with_q)::value;
        const In* Q = Qst(s);
#pragma unroll 2
        for (int k0 = 0; k0 < D; k0 += 16) {
          uint32_t aw[4], aq[4], aw2[4], aq2[4];
          frag_a(aw, W, LDH, m0, k0);
          if constexpr (kQ) frag_a(aq, Q, LDH, m0, k0);
          frag_a(aw2, W, LDH, m0, k0 + 8);
          if constexpr (kQ) frag_a(aq2, Q, LDH, m0, k0 + 8);
#pragma unroll
          for (int jj = 0; jj < NJ; ++jj) {
            uint32_t b[2], b2[2];
            frag_b(b, Ss, LDW, n0 + 8 * jj, k0);
            frag_b(b2, Ss, LDW, n0 + 8 * jj, k0 + 8);
            mma_tf32(ua[jj], aw, b);
            if constexpr (kQ) mma_tf32(qa[jj], aq, b);
            mma_tf32(ub[jj], aw2, b2);
            if constexpr (kQ) mma_tf32(qb[jj], aq2, b2);
          }
        }
      };
      if (out) products(std::true_type{});
      else products(std::false_type{});
      add_acc(ua, ub);
      add_acc(qa, qb);
    }
    // per-row gate factors of this thread's two rows (g, g + 8): exp(G_r), exp(G_last - G_r)
    const float eg_lo = __expf(G[m0 + acc_row(0)]), eg_hi = __expf(G[m0 + acc_row(2)]);
    const float el_lo = __expf(gl - G[m0 + acc_row(0)]), el_hi = __expf(gl - G[m0 + acc_row(2)]);
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + acc_row(e), c = n0 + 8 * jj + acc_col(e);
        const float u = u0[jj][e] - ua[jj][e];
        if (record && (e & 1) == 0 && ci >= c_begin && r < L)
          __stcg(reinterpret_cast<float2*>(p.U + ((tok0 + r) * p.Hv + h) * D + vb + c),
                 make_float2(u, u0[jj][e + 1] - ua[jj][e + 1]));
        Us[c * LDA + r] = round_tf32(u);
        Ue[c * LDA + r] = round_tf32(u * (e < 2 ? el_lo : el_hi));
        qa[jj][e] *= e < 2 ? eg_lo : eg_hi;
      }
    __syncthreads();  // U complete

    if (out) {  // O = diag(e^G) Q S + P U; P is lower triangular
      const PT* P = reinterpret_cast<const PT*>(Pst(s));
      for (int k0 = 0; k0 < m0 + 16; k0 += 8) {
        uint32_t ap[4];
        frag_a(ap, P, LDA, m0, k0);
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          uint32_t b[2];
          frag_b(b, Us, LDA, n0 + 8 * jj, k0);
          mma_tf32(qa[jj], ap, b);
        }
      }
      store_o_block<In>(p, qa, tok0, L, h, m0, vb + n0);
    }
    {  // S <- exp(G_last) S + K^T Ue^T
      const float eg = __expf(gl);
#pragma unroll
      for (int jn = 0; jn < NS; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[jn][e] *= eg;
      const In* K = Kst(s);
      float sb[NS][4] = {};  // odd k steps (shorter dependent chains), added at the end
#pragma unroll
      for (int k0 = 0; k0 < C; k0 += 16) {
        uint32_t ak[4], ak2[4];
        frag_a_trans(ak, K, LDH, 16 * warp, k0);
        frag_a_trans(ak2, K, LDH, 16 * warp, k0 + 8);
#pragma unroll
        for (int jn = 0; jn < NS; ++jn) {
          uint32_t b[2], b2[2];
          frag_b(b, Ue, LDA, 8 * jn, k0);
          frag_b(b2, Ue, LDA, 8 * jn, k0 + 8);
          mma_tf32(sacc[jn], ak, b);
          mma_tf32(sb[jn], ak2, b2);
        }
      }
      add_acc(sacc, sb);
      store_acc_state_smem_t(Ss, LDW, sacc);
    }
  };
  for (int64_t ci = c_first; ci < c_end; ci += 2) {
    step(ci, u0a, u0b);
    if (ci + 1 < c_end) step(ci + 1, u0b, u0a);
  }

  // ---- the state leaving the segment: the final state, or this block's summary
  if (float* dst = leaving_state(p, b)) store_acc_state(dst, sacc, vb);
}

template <typename In, int BW, typename PT = float>
__global__ void __launch_bounds__(NT, 1) state_fwd_mma_kernel(FwdParams p) {
  if (p.seqs.failed() || !col_block_chosen<BW>(p)) return;
  for_each_segment_block<BW>(p, false, [&](const SegmentBlock& b) {
    state_fwd_mma_segment<In, BW, PT>(p, b);
  });
}

// ---------------------------------------------------------------------------------------
// state_fwd_f16_kernel: the sequential pass on fp16 operands (m16n8k16, fp32 accumulation)
//
// The forward passes on fp16 operands. Same grid, segments, phases and records as
// state_fwd_mma_kernel (header above); the operands (K, Q, P, W or T diag(beta), and the
// per-chunk copies of S, U and diag(eL) U) are fp16 (tf32's 10-bit mantissa, so the same
// rounding; docs/perf-notes.md, operand precision), so each product takes half the mma
// instructions of tf32 and every fragment comes whole from one ldmatrix. S stays in fp32
// accumulators across chunks; its fp16 copy [128][BW] feeds K S (or W S) and Q S. The
// chunk tiles go through three cp.async stages (~200 / 206 KB of shared memory at 16 / 32
// columns): chunk c + 2's copies are issued in step c right after its first products.
// Phase 1 with SegParams::corr writes an exact segment's outputs (O_loc, Q_eff) in fp32.
//   kFree (the default, FLASHGDN_FWD_PASS=f16): per chunk KS = K S, W' = V - diag(e^G) KS,
//          U = T diag(beta) W' (one more 64 x 64 x BW product and barrier than below), then
//          O and S as in the tf32 pass; V is loaded one chunk ahead into registers.
//   !kFree (FLASHGDN_FWD_PASS=f16wu, and auto with kGuard): U = U0 - W S.
//   reads  Kh, Qh (fp16 k, q: the inputs, or wy_kernel's copies of bf16 inputs), P16, G, Lb,
//          initial state, seg_in; kFree: Tv16, v; else W, U0
//   writes as state_fwd_mma_kernel

// kFree: the W tile's place holds T diag(beta) [C][LDP] and one more [C][LDS] tile holds W'.
template <int BW, bool kFree = false>
struct StateFwdF16Smem {
  static constexpr int LDP = C + 8;   // P [C][LDP]: rows 144 bytes apart, ldmatrix conflict free
  static constexpr int LDS = BW + 8;  // S [D][LDS], U and diag(eL) U [C][LDS]: idem (80 / 48 B)
  static constexpr size_t kTile = sizeof(__half) * C * LDH;  // W, K, Q
  static constexpr size_t kStage = 3 * kTile + sizeof(__half) * C * LDP + sizeof(float) * C;
  // three stages: a chunk's copies are issued two steps ahead, after the step's first
  // products (H100, 2026-11-24: issued one step ahead at that point they landed late, 4-10%
  // slower; at the head of the step their ~170 instructions a thread delay every product)
  static constexpr int kStages = 3;
  static constexpr size_t kBytes =
      kStages * kStage + sizeof(__half) * (D + (kFree ? 3 : 2) * C) * LDS;
};

// The per-thread values the fp16 pass loads one chunk ahead: U0 (fp32) or, for the W/U0-free
// pass, V as raw 16-bit pairs (converted only at their use, so no step waits on the load).
template <bool kRaw, int NJ>
struct AheadRegs {
  float x[NJ][4];
};
template <int NJ>
struct AheadRegs<true, NJ> {
  uint32_t x[NJ][2];
};

// V of chunk ci, rows m0 + (g, g + 8), columns b.vb + n0 + 8 jj + (2t, 2t + 1), as raw pairs
// (zero past the chunk's end and for the transition, whose V is zero).
template <typename In, int NJ>
__device__ __forceinline__ void load_v_pairs(uint32_t (&u)[NJ][2], const FwdParams& p,
                                             const SegmentBlock& b, int64_t ci, int m0, int n0) {
  const In* v = static_cast<const In*>(p.v);
  const int64_t tok0 = b.start + ci * C;
  const int L = chunk_rows(b.len, ci);
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int r = m0 + acc_row(e), c = b.vb + n0 + 8 * jj + acc_col(e);
      u[jj][e >> 1] = !b.identity && r < L
          ? *reinterpret_cast<const uint32_t*>(v + ((tok0 + r) * p.Hv + b.h) * D + c) : 0u;
    }
}
__device__ __forceinline__ float2 pair_to_float2(uint32_t v, const __nv_bfloat16*) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
__device__ __forceinline__ float2 pair_to_float2(uint32_t v, const __half*) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// One segment block of state_fwd_f16_kernel (for_each_segment_block).
template <typename In, int BW, bool kGuard, bool kFree>
__device__ __forceinline__ void state_fwd_f16_segment(const FwdParams& p, const SegmentBlock& b) {
  static_assert(BW == 16 || BW == 32, "column block of 16 or 32");
  using Sm = StateFwdF16Smem<BW, kFree>;
  constexpr int NJ = BW / 16;  // n8 tiles per warp of the 64 x BW products
  constexpr int NS = BW / 8;   // n8 tiles per warp of the 128 x BW state update
  constexpr int LDS = Sm::LDS, LDP = Sm::LDP;
  const int64_t h = b.h, hq = b.hq, start = b.start, len = b.len;
  const int64_t chunk0 = b.chunk0, c_begin = b.c_begin, c_end = b.c_end;
  const int vb = b.vb;
  const bool identity = b.identity;
  const int64_t c_first = b.ss.c_first;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Wst = [&](int s) { return reinterpret_cast<__half*>(smem_raw + s * Sm::kStage); };
  auto Kst = [&](int s) { return Wst(s) + C * LDH; };
  auto Qst = [&](int s) { return Kst(s) + C * LDH; };
  auto Pst = [&](int s) { return Qst(s) + C * LDH; };
  auto Gst = [&](int s) { return reinterpret_cast<float*>(Pst(s) + C * LDP); };
  __half* Sh = reinterpret_cast<__half*>(smem_raw + Sm::kStages * Sm::kStage);  // [D][LDS] S
  __half* Uh = Sh + D * LDS;                                           // [C][LDS] U
  __half* Ueh = Uh + C * LDS;                                          // [C][LDS] diag(eL) U
  __half* Wph = Ueh + C * LDS;  // kFree: [C][LDS] W' = V - diag(e^G) K S

  const int warp = threadIdx.x >> 5;
  const bool corr_out = corr_outputs(p, b);
  const bool want_o = ((p.phase == 0 && p.o != nullptr) || corr_out) && !(p.debug & 1);
  const bool record = p.phase == 0 && p.h != nullptr;  // the backward's recomputation

  auto issue = [&](int64_t ci, int s) {
    if (p.debug & 2) return;
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    // T diag(beta) and P: only their lower block triangle, the blocks the products below
    // read (wy_kernel stores no other where p.tri16)
    auto copy_tri = [&](__half* dst, const __half* src) {
      cp_async_tile<C, C, LDP, true>(dst, src, p.Hv * C, L);
    };
    if constexpr (kFree)  // T diag(beta) in the W tile's place
      copy_tri(Wst(s), p.Tv16 + (tok0 * p.Hv + h) * C);
    else
      cp_async_tile<C, D, LDH>(Wst(s), p.W + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    cp_async_tile<C, D, LDH>(Kst(s), p.Kh + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    if (want_o && ci >= c_begin) {
      cp_async_tile<C, D, LDH>(Qst(s), p.Qh + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
      copy_tri(Pst(s), p.P16 + (tok0 * p.Hv + h) * C);
    }
    if (threadIdx.x < C) {
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      cp_async4(Gst(s) + threadIdx.x, p.G + (tok0 + r) * p.Hv + h);
    }
    cp_async_commit();
  };
  // U0 of rows m0 + (g, g + 8), columns n0 + 8 jj + (2t, 2t + 1) straight into registers
  const int m0 = 16 * (warp >> 1), n0 = (warp & 1) * (BW / 2);
  using Ahead = AheadRegs<kFree, NJ>;
  auto load_u0 = [&](Ahead& u, int64_t ci) {
    if constexpr (kFree) load_v_pairs<In>(u.x, p, b, ci, m0, n0);
    else load_u0_rows(u.x, p, b, ci, m0, n0);
  };
  // B fragments of the warp's NJ n8 tiles (columns n0 ..) of a [k][LDS] tile, k0..k0+15
  auto frag_b_cols = [&](uint32_t (&bf)[NJ][2], const __half* t, int k0) {
    if constexpr (NJ == 2) frag_b16_trans2(bf[0], bf[1], t, LDS, n0, k0);
    else frag_b16_trans(bf[0], t, LDS, n0, k0);
  };

  float sacc[NS][4];
  load_acc_state(sacc, entering_state(p, b), vb, identity);
  store_acc_state_smem_h(Sh, LDS, sacc);
  // kGuard: whether every |U| stayed within kF16Hi (false on NaN too) and the largest |U|
  bool u_in_range = true;
  float u_max = 0.f;

  Ahead u0a, u0b;
  // one commit group per chunk, empty past the segment's end: at a step's start the groups
  // in flight are its chunk's and the next one's
  if (c_first < c_end) {
    issue(c_first, 0);
    load_u0(u0a, c_first);
  }
  if (c_first + 1 < c_end) issue(c_first + 1, 1);
  else cp_async_commit();
  auto step = [&](const int64_t ci, const Ahead& u0, Ahead& u0n) {
    const int s = static_cast<int>(ci - c_first) % Sm::kStages;
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    cp_async_wait<1>();
    __syncthreads();  // stage s landed; Sh, Uh, Ueh of the previous chunk complete; the
                      // stage of chunk ci - 1 is free for chunk ci + 2
    if (ci + 1 < c_end) load_u0(u0n, ci + 1);
    const bool out = want_o && ci >= c_begin;
    if (record && ci >= c_begin)  // the state entering chunk ci
      store_acc_state(p.h + ((chunk0 + ci) * p.Hv + h) * D * D, sacc, vb);
    const __half* W;  // the A operand of the first product: W, or K (kFree: K S)
    if constexpr (kFree) W = Kst(s);
    else W = Wst(s);
    const float* G = Gst(s);
    const float gl = G[C - 1];

    // U = U0 - W S (kFree: K S) and QS = Q S (even and odd k16 steps in separate accumulators)
    float ua[NJ][4] = {}, qa[NJ][4] = {};
    {
      float ub[NJ][4] = {}, qb[NJ][4] = {};
      auto products = [&](auto with_q) {
        constexpr bool kQ = decltype(with_q)::value;
        const __half* Q = Qst(s);
#pragma unroll
        for (int k0 = 0; k0 < D; k0 += 32) {
          uint32_t aw[4], aw2[4], aq[4], aq2[4], bs[NJ][2], bs2[NJ][2];
          frag_a16(aw, W, LDH, m0, k0);
          frag_a16(aw2, W, LDH, m0, k0 + 16);
          if constexpr (kQ) {
            frag_a16(aq, Q, LDH, m0, k0);
            frag_a16(aq2, Q, LDH, m0, k0 + 16);
          }
          frag_b_cols(bs, Sh, k0);
          frag_b_cols(bs2, Sh, k0 + 16);
#pragma unroll
          for (int jj = 0; jj < NJ; ++jj) {
            mma_f16(ua[jj], aw, bs[jj]);
            mma_f16(ub[jj], aw2, bs2[jj]);
            if constexpr (kQ) {
              mma_f16(qa[jj], aq, bs[jj]);
              mma_f16(qb[jj], aq2, bs2[jj]);
            }
          }
        }
      };
      if (out) products(std::true_type{});
      else products(std::false_type{});
      if (ci + 2 < c_end) issue(ci + 2, (s + 2) % Sm::kStages);  // under the products' latency
      else cp_async_commit();
      add_acc(ua, ub);
      add_acc(qa, qb);
    }
    const float eg_lo = __expf(G[m0 + acc_row(0)]), eg_hi = __expf(G[m0 + acc_row(2)]);
    const float el_lo = __expf(gl - G[m0 + acc_row(0)]), el_hi = __expf(gl - G[m0 + acc_row(2)]);
    // this thread's U pair (row r, columns c, c + 1): the backward's record, the range guard,
    // the fp16 copies of U and diag(eL) U
    auto emit_u = [&](int r, int c, float x0, float x1, float el) {
      if (record && ci >= c_begin && r < L)
        __stcg(reinterpret_cast<float2*>(p.U + ((tok0 + r) * p.Hv + h) * D + vb + c),
               make_float2(x0, x1));
      if constexpr (kGuard) {
        u_in_range &= fabsf(x0) <= kF16Hi && fabsf(x1) <= kF16Hi;
        u_max = fmaxf(u_max, fmaxf(fabsf(x0), fabsf(x1)));
      }
      *reinterpret_cast<uint32_t*>(Uh + r * LDS + c) = pack_half2(x0, x1);
      *reinterpret_cast<uint32_t*>(Ueh + r * LDS + c) = pack_half2(x0 * el, x1 * el);
    };
    if constexpr (kFree) {  // W' = V - diag(e^G) K S, then U = T diag(beta) W'
      const In* vtype = nullptr;
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = m0 + acc_row(e), c = n0 + 8 * jj + acc_col(e);
          const float eg = e < 2 ? eg_lo : eg_hi;
          const float2 vv = pair_to_float2(u0.x[jj][e >> 1], vtype);
          *reinterpret_cast<uint32_t*>(Wph + r * LDS + c) =
              pack_half2(vv.x - eg * ua[jj][e], vv.y - eg * ua[jj][e + 1]);
          qa[jj][e] *= eg;
          qa[jj][e + 1] *= eg;
        }
      __syncthreads();  // W' complete
      float ut[NJ][4] = {};
      const __half* Tvt = Wst(s);
      for (int k0 = 0; k0 < m0 + 16; k0 += 16) {  // T is lower triangular
        uint32_t at[4], bw[NJ][2];
        frag_a16(at, Tvt, LDP, m0, k0);
        frag_b_cols(bw, Wph, k0);
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) mma_f16(ut[jj], at, bw[jj]);
      }
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          emit_u(m0 + acc_row(e), n0 + 8 * jj + acc_col(e), ut[jj][e], ut[jj][e + 1],
                 e < 2 ? el_lo : el_hi);
    } else {
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = m0 + acc_row(e), c = n0 + 8 * jj + acc_col(e);
          const float x0 = u0.x[jj][e] - ua[jj][e], x1 = u0.x[jj][e + 1] - ua[jj][e + 1];
          const float el = e < 2 ? el_lo : el_hi, eg = e < 2 ? eg_lo : eg_hi;
          emit_u(r, c, x0, x1, el);
          qa[jj][e] *= eg;
          qa[jj][e + 1] *= eg;
        }
    }
    __syncthreads();  // U complete

    if (out) {  // O = diag(e^G) Q S + P U; P is lower triangular
      const __half* P = Pst(s);
      for (int k0 = 0; k0 < m0 + 16; k0 += 16) {
        uint32_t ap[4], bu[NJ][2];
        frag_a16(ap, P, LDP, m0, k0);
        frag_b_cols(bu, Uh, k0);
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) mma_f16(qa[jj], ap, bu[jj]);
      }
      if (corr_out) store_o_corr(p, b, qa, tok0, L, m0, vb + n0);
      else store_o_block<In>(p, qa, tok0, L, h, m0, vb + n0);
    }
    {  // S <- exp(G_last) S + K^T diag(eL) U: warp w rows 16 w .. +16, all BW columns
      const float eg = __expf(gl);
#pragma unroll
      for (int jn = 0; jn < NS; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[jn][e] *= eg;
      const __half* K = Kst(s);
      float sb[NS][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < C; k0 += 32) {
        uint32_t ak[4], ak2[4];
        frag_a16_trans(ak, K, LDH, 16 * warp, k0);
        frag_a16_trans(ak2, K, LDH, 16 * warp, k0 + 16);
#pragma unroll
        for (int jp = 0; jp < NS / 2; ++jp) {
          uint32_t b0[2], b1[2], c0[2], c1[2];
          frag_b16_trans2(b0, b1, Ueh, LDS, 16 * jp, k0);
          frag_b16_trans2(c0, c1, Ueh, LDS, 16 * jp, k0 + 16);
          mma_f16(sacc[2 * jp], ak, b0);
          mma_f16(sacc[2 * jp + 1], ak, b1);
          mma_f16(sb[2 * jp], ak2, c0);
          mma_f16(sb[2 * jp + 1], ak2, c1);
        }
      }
      add_acc(sacc, sb);
      store_acc_state_smem_h(Sh, LDS, sacc);
    }
  };
  for (int64_t ci = c_first; ci < c_end; ci += 2) {
    step(ci, u0a, u0b);
    if (ci + 1 < c_end) step(ci + 1, u0b, u0a);
  }

  if (float* dst = leaving_state(p, b)) store_acc_state(dst, sacc, vb);
  if constexpr (kGuard) {  // hand the block to the tf32 redo when fp16 did not hold
    bool big = !u_in_range;
#pragma unroll
    for (int jn = 0; jn < NS; ++jn)
#pragma unroll
      for (int e = 0; e < 4; ++e) big |= !isfinite(sacc[jn][e]);
    big = __syncthreads_or(big);
    const bool any_normal = __syncthreads_or(u_max >= kF16Lo);  // block-wide largest |U|
    const bool any_nonzero = __syncthreads_or(u_max > 0.f);
    if (threadIdx.x == 0) p.redo[redo_index(b)] = big || (any_nonzero && !any_normal) ? 1 : 0;
  }
}

template <typename In, int BW, bool kGuard = false, bool kFree = false>
__global__ void __launch_bounds__(NT, 1) state_fwd_f16_kernel(FwdParams p) {
  if (p.seqs.failed() || !col_block_chosen<BW>(p)) return;
  for_each_segment_block<BW>(p, false, [&](const SegmentBlock& b) {
    state_fwd_f16_segment<In, BW, kGuard, kFree>(p, b);
  });
}

// ---------------------------------------------------------------------------------------
// state_fwd_kernel: the sequential pass on warpgroup tensor cores (wgmma, tf32)

template <typename In, int BW>
struct StateFwdWgSmem {
  static constexpr size_t kW = sizeof(__half) * C * LDH;  // W: [64][LDH]
  static constexpr size_t kP = sizeof(float) * C * C;      // P, core-matrix [64][64]
  static constexpr size_t kH = sizeof(In) * C * LDH;       // K, Q: [64][LDH]
  static constexpr size_t kStage = kW + kP + 2 * kH + sizeof(float) * C;
  static_assert(kStage % 128 == 0, "stages keep the core-matrix tiles 128-byte aligned");
  static constexpr size_t kBytes = 2 * kStage + sizeof(float) * (BW * D + 2 * BW * C);
};

// One segment block of state_fwd_kernel (for_each_segment_block).
template <typename In, int BW>
__device__ __forceinline__ void state_fwd_segment(const FwdParams& p, const SegmentBlock& b) {
  static_assert(BW == 16 || BW == 32, "column block of 16 or 32");
  constexpr int NS = BW / 8;  // 8-column accumulator tiles per warp (every product is 64 x BW)
  using Smem = StateFwdWgSmem<In, BW>;
  const int64_t h = b.h, hq = b.hq, start = b.start, len = b.len;
  const int64_t chunk0 = b.chunk0, c_begin = b.c_begin, c_end = b.c_end;
  const SegStart ss = b.ss;
  const int vb = b.vb;
  const bool identity = b.identity;
  const int64_t c_first = ss.c_first;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Wst = [&](int s) { return reinterpret_cast<__half*>(smem_raw + s * Smem::kStage); };
  auto Pst = [&](int s) { return reinterpret_cast<float*>(smem_raw + s * Smem::kStage + Smem::kW); };
  auto Kst = [&](int s) { return reinterpret_cast<In*>(Pst(s) + C * C); };
  auto Qst = [&](int s) { return Kst(s) + C * LDH; };
  auto Gst = [&](int s) { return reinterpret_cast<float*>(Qst(s) + C * LDH); };
  float* Ss = reinterpret_cast<float*>(smem_raw + 2 * Smem::kStage);  // core [BW][128]: S^T
  float* Us = Ss + BW * D;  // core [BW][64]: U^T
  float* Ue = Us + BW * C;  // core [BW][64]: (diag(eL) U)^T, tokens in paired_slot order

  // Warpgroup 0 forms U = U0 - W S; warpgroup 1 the outputs, scale (diag(e^G) Q S + P U);
  // both update their 64 rows of S. rw: this warp's first row in its warpgroup's products.
  const int warp = threadIdx.x >> 5, wg = warp >> 2, rw = 16 * (warp & 3);
  const In* kbase = static_cast<const In*>(p.k);
  const In* qbase = static_cast<const In*>(p.q);
  const bool want_o = p.phase == 0 && p.o != nullptr && !(p.debug & 1);
  const bool record = p.phase == 0 && p.h != nullptr;

  auto issue = [&](int64_t ci, int s) {
    if (p.debug & 2) return;
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    cp_async_tile<C, D, LDH>(Wst(s), p.W + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    cp_async_tile<C, D, LDH>(Kst(s), kbase + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    if (want_o && ci >= c_begin) {
      cp_async_tile<C, D, LDH>(Qst(s), qbase + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
      cp_async_core_tile<C, C>(Pst(s), p.Pmat + (tok0 * p.Hv + h) * C, p.Hv * C, L);
    }
    if (threadIdx.x < C) {
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      cp_async4(Gst(s) + threadIdx.x, p.G + (tok0 + r) * p.Hv + h);
    }
    cp_async_commit();
  };
  // U0 of this warp's rows rw + (g, g + 8), all BW columns (warpgroup 0 only)
  auto load_u0 = [&](float (&u)[NS][4], int64_t ci) {
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
#pragma unroll
    for (int jj = 0; jj < NS; ++jj)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = rw + acc_row(e), c = vb + 8 * jj + acc_col(e);
        float2 v = make_float2(0.f, 0.f);
        if (!identity && r < L)
          v = *reinterpret_cast<const float2*>(p.U0 + ((tok0 + r) * p.Hv + h) * D + c);
        u[jj][e] = v.x;
        u[jj][e + 1] = v.y;
      }
  };

  // ---- initial state: registers (load_acc_state's layout), S^T in shared memory
  float sacc[NS][4];
  load_acc_state(sacc, entering_state(p, b), vb, identity);
  store_acc_state_core_t(Ss, sacc);

  float u0a[NS][4] = {}, u0b[NS][4] = {};
  float acc[NS][4] = {};  // warpgroup 0: W S, warpgroup 1: Q S, then the output
  float urec[NS][4] = {};  // warpgroup 0: U = U0 - W S, for the backward's record
  if (c_first < c_end) {
    issue(c_first, 0);
    if (wg == 0) load_u0(u0a, c_first);
  }
  auto step = [&](const int64_t ci, const float (&u0)[NS][4], float (&u0n)[NS][4]) {
    const int s = static_cast<int>((ci - c_first) & 1);
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    cp_async_wait<0>();
    fence_proxy_async();  // this thread's cp.async and S^T writes, visible to wgmma
    __syncthreads();      // stage s landed; S^T complete; Us, Ue free
    const bool out = want_o && ci >= c_begin;
    const float* G = Gst(s);
    const float gl = G[C - 1];
    const float g_lo = G[rw + acc_row(0)], g_hi = G[rw + acc_row(2)];

    if (wg == 0 || out) {  // warpgroup 0: W S, warpgroup 1: Q S (A from registers)
      uint32_t af[D / 8][4];
#pragma unroll
      for (int k8 = 0; k8 < D / 8; ++k8) {
        if (wg == 0) frag_a_natural(af[k8], Wst(s), LDH, rw, 8 * k8);
        else frag_a_natural(af[k8], Qst(s), LDH, rw, 8 * k8);
      }
      wgmma_fence();
#pragma unroll
      for (int k8 = 0; k8 < D / 8; ++k8) wgmma_rs(acc, af[k8], core_desc<D>(Ss, k8), k8 > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_acc(acc);
#pragma unroll
      for (int k8 = 0; k8 < D / 8; ++k8) fence_frag(af[k8]);
    }
    if (wg == 0) {  // U = U0 - W S
      const float el_lo = __expf(gl - g_lo), el_hi = __expf(gl - g_hi);
#pragma unroll
      for (int jj = 0; jj < NS; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = rw + acc_row(e), c = 8 * jj + acc_col(e);
          const float u = u0[jj][e] - acc[jj][e];
          urec[jj][e] = u;  // recorded while the S update runs
          Us[core_index<C>(c, r)] = round_tf32(u);
          Ue[core_index<C>(c, paired_slot(r))] = round_tf32(u * (e < 2 ? el_lo : el_hi));
        }
    } else if (out) {  // Q S scaled by e^G per row
      const float eg_lo = __expf(g_lo), eg_hi = __expf(g_hi);
#pragma unroll
      for (int jj = 0; jj < NS; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[jj][e] *= e < 2 ? eg_lo : eg_hi;
    }
    // The proxy fence waits for every memory access this thread has in flight: the next
    // chunk's copies and U0 loads and this chunk's global stores come after it.
    fence_proxy_async();  // Us, Ue visible to wgmma
    __syncthreads();      // U complete; every read of S^T done
    if (record && ci >= c_begin)  // the state entering chunk ci
      store_acc_state(p.h + ((chunk0 + ci) * p.Hv + h) * D * D, sacc, vb);

    // S <- exp(G_last) S + K^T diag(eL) U, this warp's 16 rows of S. The decay is applied
    // before any wgmma of this stage is issued: an accumulator touched by other instructions
    // while a wgmma is in flight makes ptxas serialise every wgmma of the kernel (C7514).
    const float eg = __expf(gl);
#pragma unroll
    for (int jn = 0; jn < NS; ++jn)
#pragma unroll
      for (int e = 0; e < 4; ++e) sacc[jn][e] *= eg;
    // + P U (P lower triangular, zero above the diagonal): used by warpgroup 1 on output
    // chunks only, but issued by both warpgroups on every chunk. A wgmma issued under a
    // condition leaves its accumulators merged with the other path's values in flight, and
    // ptxas then serialises every wgmma of the kernel (C7515); warpgroup 0's acc is dead here
    // (U is in urec) and the next chunk's first product overwrites it.
    {
      wgmma_fence();
#pragma unroll
      for (int k8 = 0; k8 < C / 8; ++k8)
        wgmma_ss(acc, core_desc<C>(Pst(s), k8), core_desc<C>(Us, k8), true);
      wgmma_commit();
    }
    uint32_t kf[C / 8][4];
#pragma unroll
    for (int k8 = 0; k8 < C / 8; ++k8) frag_a_trans(kf[k8], Kst(s), LDH, 16 * warp, 8 * k8);
    wgmma_fence();
#pragma unroll
    for (int k8 = 0; k8 < C / 8; ++k8) wgmma_rs(sacc, kf[k8], core_desc<C>(Ue, k8), true);
    wgmma_commit();

    // while the tensor cores work: the next chunk's copies and U0, the record of U
    if (ci + 1 < c_end) {
      issue(ci + 1, s ^ 1);
      if (wg == 0) load_u0(u0n, ci + 1);  // used one step later
    }
    if (record && ci >= c_begin && wg == 0) {
#pragma unroll
      for (int jj = 0; jj < NS; ++jj)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = rw + acc_row(e), c = vb + 8 * jj + acc_col(e);
          if (r < L)
            __stcg(reinterpret_cast<float2*>(p.U + ((tok0 + r) * p.Hv + h) * D + c),
                   make_float2(urec[jj][e], urec[jj][e + 1]));
        }
    }
    wgmma_wait<0>();
    fence_acc(sacc);
    fence_acc(acc);
#pragma unroll
    for (int k8 = 0; k8 < C / 8; ++k8) fence_frag(kf[k8]);
    if (wg == 1 && out) store_o_block<In>(p, acc, tok0, L, h, rw, vb);
    store_acc_state_core_t(Ss, sacc);
  };
  for (int64_t ci = c_first; ci < c_end; ci += 2) {
    step(ci, u0a, u0b);
    if (ci + 1 < c_end) step(ci + 1, u0b, u0a);
  }

  // ---- the state leaving the segment: the final state, or this block's summary
  if (float* dst = leaving_state(p, b)) store_acc_state(dst, sacc, vb);
}

template <typename In, int BW>
__global__ void __launch_bounds__(NT, 1) state_fwd_kernel(FwdParams p) {
  if (p.seqs.failed() || !col_block_chosen<BW>(p)) return;
  for_each_segment_block<BW>(p, false, [&](const SegmentBlock& b) {
    state_fwd_segment<In, BW>(p, b);
  });
}

}  // namespace cuda
}  // namespace flashgdn
