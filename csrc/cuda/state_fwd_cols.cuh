// state_fwd_cols_kernel: the forward's sequential pass with the value columns as the rows of
// the tensor-core products (the default f16 pass at column block 128, chosen by the planner
// or forced with FLASHGDN_FWD_BW=128; forward only).
//
// grid (1 [x 2 in phase 1], H_v, segments or slots: for_each_segment_block), 256 threads
// (8 warps), ~167 KB smem (the opt-in three stages, kStages = 3: ~214 KB), 1 block/SM.
// One block runs one segment of one sequence for all 128 value columns of one head; warp w
// owns the value columns 16 w .. 16 w + 15 of the state and never exchanges data with the
// other warps: every product has the warp's 16 columns as its M dimension,
//   X^T  = S^T K^T                      (16 x 64, k = 128 keys)
//   U^T  = (V^T - X^T diag(e^G)) (T diag(beta))^T   (16 x 64, k = 64 tokens, T lower triangular)
//   O^T  = scale (S^T Q^T diag(e^G) + U^T P^T)
//   S^T <- e^{G_last} S^T + U^T diag(e^{G_last - G}) K   (16 x 128, k = 64 tokens)
// so each accumulator becomes the next product's A operand in registers (fp16, the m16n8
// accumulator pairs are the m16k16 A fragment), and S^T stays in fp32 accumulators across
// chunks. The shared operands K, Q, T diag(beta), P, V (fp16 / the input dtype) and the
// per-token gate factors (e^G, e^{G_last - G}) of the next chunk are copied by cp.async while
// the current one computes: by default without a block barrier (the ping-pong schedule,
// kPing below: warpgroup 1 issues the copies, mbarriers per stage; opt-in, a third stage),
// else one block barrier per chunk. Same segments, warm-ups, phases (phase 1: summaries L
// and, on the identity with V = 0, M) as the other state passes (fwd_kernels.cuh). The
// backward's recomputation (p.h set) records the state entering every chunk and U as fp16
// record blocks (mma.cuh: stmatrix into a warp's staging, one bulk store a warp); it runs
// here where launch.cu's bwd_cols says, else in state_fwd_f16_kernel (fp32 records).
// In phase 0 after the combine (or sub_start_kernel) it is launched as their programmatic
// dependent (launch.cu launch_kernel): only the blocks of exact segments wait (pdl_wait),
// after issuing their first chunk's copies, before loading their entering state.
//   reads  Kh, Qh, Tv16, v, P16, EG (wy_kernel), Lb, initial state, seg_in
//   writes o, final state (phase 0); seg_L, seg_M (phase 1); h, U and their factors (recomputation)
#pragma once

#include "fwd_kernels.cuh"

namespace flashgdn {
namespace cuda {

struct StateFwdColsSmem {
  static constexpr int LDP = C + 8;  // [C][LDP] T diag(beta), P: rows 144 B apart
  static constexpr int LDO = 24;     // per-warp output staging [C][LDO]: rows 48 B apart
  static constexpr size_t kTile = sizeof(__half) * C * LDH;  // K, Q, V [64][136]
  static constexpr size_t kStage = 3 * kTile + 2 * sizeof(__half) * C * LDP + sizeof(float2) * C;
  static constexpr size_t kBytes = 2 * kStage + sizeof(__half) * (NT / 32) * C * LDO;
  // the recomputation: each warp's staging of its records (mma.cuh) after the above
  static constexpr size_t kRecordBytes = kBytes + (NT / 32) * kRecStageBytes;
  // the ping-pong schedule (kPing): its stages' mbarriers full[2], empty[2], landed[2] (the
  // conversions of bf16 k and q, FwdParams::kq_bf16) after the above
  static constexpr size_t bars_at(bool record) { return record ? kRecordBytes : kBytes; }
  static constexpr size_t ping_bytes(bool record) { return bars_at(record) + 6 * sizeof(uint64_t); }
  // three stages (the forward's ping-pong kernel without records, kStages = 3): no output
  // staging of its own (a warp stages its O^T rows in its own 16 columns of the stage's V
  // tile, which only that warp reads), then the mbarriers full[3], empty[3]
  static constexpr size_t kBytes3 = 3 * kStage;
  static constexpr size_t stage_bars_at(int stages, bool record) {
    return stages == 3 ? kBytes3 : bars_at(record);
  }
  static constexpr size_t stage_bytes(int stages, bool record) {
    return stages == 3 ? kBytes3 + 6 * sizeof(uint64_t) : ping_bytes(record);
  }
};
static_assert(StateFwdColsSmem::stage_bytes(3, false) <= 227 * 1024,
              "three stages fit the 227 KB a block may opt in to");

// A [C][LDH] tile holding the inputs' 16-bit values (bf16 k or q rows; rows past the chunk's
// end zeros) to fp16 in place, by the 128 threads of one warpgroup (wt: the thread's index in
// it): row wt / 16 + 8 i, values 8 (wt % 16) .. (the conversions of FwdParams::kq_bf16 and
// of the fused forward's auxiliary warpgroup).
template <typename In>
__device__ __forceinline__ void tile_to_half_in_place(__half* tile, int wt) {
  const int r0 = wt / (D / 8), c = (wt % (D / 8)) * 8;
#pragma unroll
  for (int i = 0; i < C / 8; ++i) {
    __half* piece = tile + (r0 + 8 * i) * LDH + c;
    *reinterpret_cast<uint4*>(piece) = half8_of(reinterpret_cast<const In*>(piece));
  }
}

template <typename In>
__device__ __forceinline__ uint32_t pack_in2(float lo, float hi) {
  In pair[2] = {from_f<In>(lo), from_f<In>(hi)};
  return *reinterpret_cast<const uint32_t*>(pair);
}

// Pieces shared by the cols kernels' chunk steps. A thread's token columns of n8 tile j are
// 8 j + 2t and 8 j + 2t + 1 (tc = 2t); E holds (e^G, e^{G_last - G}) per token.

// W'^T = V^T - X^T diag(e^G) as fp16 A fragments (k = tokens 16 kt ..): V^T from the padded
// V tile (ldmatrix.trans: a0 (v g, tokens 2t..), a1 (v g + 8), a2 / a3 tokens + 8), zero for
// the transition.
template <typename In>
__device__ __forceinline__ void w_prime_frags(uint32_t (&wa)[4][4], const float (&x)[8][4],
                                              const In* V, const float2* E, int v0,
                                              bool identity) {
  const int tc = 2 * (lane_id() & 3);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    uint32_t vf[4] = {0u, 0u, 0u, 0u};
    if (!identity) frag_a16_trans(vf, reinterpret_cast<const __half*>(V), LDH, v0, 16 * kt);
    const In* vt = nullptr;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {  // tile 2 kt + hf
      const int j = 2 * kt + hf;
      const float2 e0 = E[8 * j + tc], e1 = E[8 * j + tc + 1];
      const float2 lo = pair_to_float2(vf[2 * hf], vt), hi = pair_to_float2(vf[2 * hf + 1], vt);
      wa[kt][2 * hf] = pack_half2(lo.x - e0.x * x[j][0], lo.y - e1.x * x[j][1]);
      wa[kt][2 * hf + 1] = pack_half2(hi.x - e0.x * x[j][2], hi.y - e1.x * x[j][3]);
    }
  }
}

// fp16 A fragments of U^T (for P U) and of U^T diag(e^{G_last - G}) (for the state update).
__device__ __forceinline__ void u_frags(uint32_t (&ua)[4][4], uint32_t (&ue)[4][4],
                                        const float (&u)[8][4], const float2* E) {
  const int tc = 2 * (lane_id() & 3);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    acc_to_a16(ua[kt], u[2 * kt], u[2 * kt + 1]);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int j = 2 * kt + hf;
      const float l0 = E[8 * j + tc].y, l1 = E[8 * j + tc + 1].y;
      ue[kt][2 * hf] = pack_half2(u[j][0] * l0, u[j][1] * l1);
      ue[kt][2 * hf + 1] = pack_half2(u[j][2] * l0, u[j][3] * l1);
    }
  }
}

// X^T = S^T K^T from the fp16 A fragments sa of S^T (k = keys) and K's B fragments (rows =
// tokens): n8 tiles of tokens 8 j ..; kQ: O^T's first part S^T Q^T beside it, from the same
// A fragments.
template <bool kQ>
__device__ __forceinline__ void sk_products(float (&x)[8][4], float (&o)[8][4],
                                            const uint32_t (&sa)[8][4], const __half* K,
                                            const __half* Q) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      uint32_t b0[2], b1[2];
      frag_b16_pair(b0, b1, K, LDH, 16 * nt, 16 * kk);
      mma_f16(x[2 * nt], sa[kk], b0);
      mma_f16(x[2 * nt + 1], sa[kk], b1);
      if constexpr (kQ) {
        uint32_t c0[2], c1[2];
        frag_b16_pair(c0, c1, Q, LDH, 16 * nt, 16 * kk);
        mma_f16(o[2 * nt], sa[kk], c0);
        mma_f16(o[2 * nt + 1], sa[kk], c1);
      }
    }
}

// d += A M^T for a 64 x 64 tile M [r][s] (rows ldm apart) that is zero for s > r, so that
// only its blocks at or below the diagonal are read: U^T = W'^T (T diag(beta))^T (a the
// A fragments of W'^T) and O^T's U^T P^T (a those of U^T); n8 tiles of tokens r.
__device__ __forceinline__ void tri_product(float (&d)[8][4], const uint32_t (&a)[4][4],
                                            const __half* M, int ldm) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int kt = 0; kt <= nt; ++kt) {
      uint32_t b0[2], b1[2];
      frag_b16_pair(b0, b1, M, ldm, 16 * nt, 16 * kt);
      mma_f16(d[2 * nt], a[kt], b0);
      mma_f16(d[2 * nt + 1], a[kt], b1);
    }
}

// S^T <- e^{G_last} S^T + U^T diag(e^{G_last - G}) K: n8 tiles of keys, k = tokens (ue: the
// A fragments of U^T diag(e^{G_last - G}), egl = e^{G_last}).
__device__ __forceinline__ void state_update_cols(float (&sacc)[16][4], const uint32_t (&ue)[4][4],
                                                  const __half* K, float egl) {
#pragma unroll
  for (int jn = 0; jn < 16; ++jn)
#pragma unroll
    for (int e = 0; e < 4; ++e) sacc[jn][e] *= egl;
#pragma unroll
  for (int kt = 0; kt < 4; ++kt)
#pragma unroll
    for (int jp = 0; jp < 8; ++jp) {
      uint32_t b0[2], b1[2];
      frag_b16_trans2(b0, b1, K, LDH, 16 * jp, 16 * kt);
      mma_f16(sacc[2 * jp], ue[kt], b0);
      mma_f16(sacc[2 * jp + 1], ue[kt], b1);
    }
}

// o (O^T tiles) *= e^G of each token column.
__device__ __forceinline__ void scale_by_eg(float (&o)[8][4], const float2* E) {
  const int tc = 2 * (lane_id() & 3);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float e0 = E[8 * j + tc].x, e1 = E[8 * j + tc + 1].x;
    o[j][0] *= e0;
    o[j][1] *= e1;
    o[j][2] *= e0;
    o[j][3] *= e1;
  }
}

// O^T out, times p.scale: the warp's tiles transposed by stmatrix into its staging tile Ost
// [token][ldo] (16 values), then 16-byte rows to o (rows below L).
template <typename In>
__device__ __forceinline__ void store_o_cols(const FwdParams& p, const float (&o)[8][4],
                                             __half* Ost, int ldo, int64_t tok0, int L,
                                             int64_t h, int v0) {
  const int lane = lane_id(), m = lane >> 3, i = lane & 7;
  const float sc = p.scale;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
    stmatrix_x4_trans(Ost + (16 * nt + (m >> 1) * 8 + i) * ldo + (m & 1) * 8,
                      pack_in2<In>(sc * o[2 * nt][0], sc * o[2 * nt][1]),
                      pack_in2<In>(sc * o[2 * nt][2], sc * o[2 * nt][3]),
                      pack_in2<In>(sc * o[2 * nt + 1][0], sc * o[2 * nt + 1][1]),
                      pack_in2<In>(sc * o[2 * nt + 1][2], sc * o[2 * nt + 1][3]));
  __syncwarp();
  In* dst = static_cast<In*>(p.o);
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int piece = lane + 32 * it, r = piece >> 1, half = piece & 1;
    if (r < L)
      *reinterpret_cast<uint4*>(dst + ((tok0 + r) * p.Hv + h) * D + v0 + 8 * half) =
          *reinterpret_cast<const uint4*>(Ost + r * ldo + 8 * half);
  }
  __syncwarp();
}

// kRecord: the backward's recomputation (p.h, p.U set); the forward's instantiation has no
// recording code at all. The B fragments of K^T, Q^T, (T diag(beta))^T and P^T come from
// frag_b16_pair (each fragment in consecutive registers; frag_a16's pairs a0, a2 / a1, a3
// cost ~330 register moves per chunk): chunk loop 1631 -> 1220 SASS instructions, H100
// 1-2% faster on 18 of the 20 TP rows (perf-notes version 16).
// One segment block of state_fwd_cols_kernel (for_each_segment_block).
// kPing (the default; FLASHGDN_COLS_PING=0 turns it off): the two warpgroups are not held
// in step by a block barrier a chunk. Warpgroup 1 alone issues the copies (chunk ci + 1's at
// the head of its chunk ci, once both warpgroups have released that stage: empty[s], one
// arrival a warp), each of its threads signalling their landing on full[s]
// (cp.async.mbarrier.arrive); both warpgroups wait on full[s]. Warpgroup 0, which issues
// nothing, runs ahead by up to about a chunk less the copies' latency, so the two are in
// different phases of the chunk step (the products of one beside the conversions and
// dependent waits of the other) on each scheduler's pair of warps. n_used counts the chunks
// this block ran before this segment (the stages' use index and so the phases' parities).
// kStages = 3 (kPing without records or correction): chunk ci + 2's copies go out at the
// head of chunk ci (with two stages warpgroup 0 spent ~10% of its samples waiting on
// full[s]: H200 ncu source counters). Each warp stages its output rows in its own columns
// of the V tile (StateFwdColsSmem::kBytes3) and releases the stage after reading them back.
// kFused (gdn_fwd_fused_kernel, fwd_fused.cuh): the chain of the fused forward. K and Q come
// as the inputs' tiles (as with p.kq_bf16), P is not copied (kFused 1: T diag(beta) is, from
// wy_lean_kernel's Tv16; 2: neither): the fused kernel's auxiliary warpgroup forms them in the
// stage, converts K and Q to fp16 in place and arrives on full[s] once landed[s] has told it
// the copies are in.
template <typename In, bool kRecord, bool kCorr, bool kPing = false, int kStages = 2,
          int kFused = 0>
__device__ __forceinline__ void state_fwd_cols_segment(const FwdParams& p, const SegmentBlock& b,
                                                       uint32_t& n_used) {
  static_assert(kStages == 2 || (kStages == 3 && kPing && !kRecord && !kCorr),
                "three stages: the ping-pong forward without records or correction");
  static_assert(!kFused || (kPing && !kRecord && !kCorr),
                "the fused forward: the ping-pong chain without records or correction");
  using Sm = StateFwdColsSmem;
  constexpr int LDP = Sm::LDP, LDO = Sm::LDO;
  const int64_t h = b.h, hq = b.hq, start = b.start, len = b.len;
  const int64_t c_begin = b.c_begin, c_end = b.c_end, c_first = b.ss.c_first;
  const bool identity = b.identity;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Kst = [&](int s) { return reinterpret_cast<__half*>(smem_raw + s * Sm::kStage); };
  auto Qst = [&](int s) { return Kst(s) + C * LDH; };
  auto Vst = [&](int s) { return reinterpret_cast<In*>(Qst(s) + C * LDH); };
  auto Tst = [&](int s) { return reinterpret_cast<__half*>(Vst(s) + C * LDH); };
  auto Pst = [&](int s) { return Tst(s) + C * LDP; };
  auto Est = [&](int s) { return reinterpret_cast<float2*>(Pst(s) + C * LDP); };
  const int warp = threadIdx.x >> 5, lane = lane_id();
  __half* Ost = reinterpret_cast<__half*>(smem_raw + 2 * Sm::kStage) + warp * C * LDO;
  __half* rec_stage = reinterpret_cast<__half*>(smem_raw + Sm::kBytes + warp * kRecStageBytes);

  const int v0 = 16 * warp;  // the warp's value columns (rows of S^T)
  const bool corr_out = kCorr && corr_outputs(p, b);  // SegParams::corr: O_loc or Q_eff
  const bool want_o = ((p.phase == 0 && p.o != nullptr) || corr_out) && !(p.debug & 1);
  const bool record = kRecord && p.phase == 0 && p.h != nullptr;
  // kPing: the stages' mbarriers; warpgroup 1 issues the copies (with the barrier schedule,
  // every thread)
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw + Sm::stage_bars_at(kStages, kRecord));
  uint64_t* empty = full + kStages;
  constexpr int kIssuers = kPing ? NT / 2 : NT;
  const bool issuer = !kPing || threadIdx.x >= NT / 2;
  const int itid = kPing ? static_cast<int>(threadIdx.x) - NT / 2 : static_cast<int>(threadIdx.x);
  const uint32_t n0 = n_used;  // kPing: the use index of chunk ci is n0 + ci - c_first
  // p.kq_bf16 (the plain ping-pong forward, bf16 inputs): K and Q come as bf16 tiles. The
  // copies signal landed[s] (asynchronously, as they do full[s] otherwise); warpgroup 0,
  // which issues nothing and runs ahead, converts the tiles in place after its state update
  // of the chunk before and arrives on full[s] (warpgroup 1 converting its own pieces
  // lengthened its path: 16/32 x 32768 phase 0 471 -> 492 us, H100)
  const bool conv = kPing && !kRecord && !kCorr && kStages == 2 && p.kq_bf16 && !kFused;
  const bool raw_kq = conv || kFused > 0;  // K and Q tiles as the inputs' bits
  uint64_t* landed = full + 2 * kStages;

  // chunk ci's tiles into stage s; kWhole (ping-pong, a chunk of C rows): no zero fill, so
  // no predicates a copy
  auto copy_tiles = [&](int64_t ci, int s, auto whole) {
    constexpr bool kW = decltype(whole)::value;
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    // T diag(beta) and P: only their lower block triangle, the blocks the products read
    // (wy_kernel stores no other where p.tri16)
    auto copy_tri = [&](__half* dst, const __half* src) {
      cp_async_tile_by<C, C, LDP, kIssuers, kW, true>(dst, src, p.Hv * C, L, itid);
    };
    // conv: the bf16 inputs' bits into the fp16 tiles, converted in place after landing
    const __half* ksrc = raw_kq ? static_cast<const __half*>(p.k) : p.Kh;
    const __half* qsrc = raw_kq ? static_cast<const __half*>(p.q) : p.Qh;
    cp_async_tile_by<C, D, LDH, kIssuers, kW>(Kst(s), ksrc + (tok0 * p.Hqk + hq) * D, p.Hqk * D,
                                              L, itid);
    if (kFused < 2) copy_tri(Tst(s), p.Tv16 + (tok0 * p.Hv + h) * C);
    if (!identity)
      cp_async_tile_by<C, D, LDH, kIssuers, kW>(
          Vst(s), static_cast<const In*>(p.v) + (tok0 * p.Hv + h) * D, p.Hv * D, L, itid);
    if (want_o && ci >= c_begin) {
      cp_async_tile_by<C, D, LDH, kIssuers, kW>(Qst(s), qsrc + (tok0 * p.Hqk + hq) * D,
                                                p.Hqk * D, L, itid);
      if (!kFused) copy_tri(Pst(s), p.P16 + (tok0 * p.Hv + h) * C);
    }
    if (itid < C) {  // rows past the chunk's end repeat its last row: e^{G_last - G} = 1
      const int r = kW || itid < L ? itid : L - 1;
      cp_async8(Est(s) + itid, p.EG + (tok0 + r) * p.Hv + h);
    }
  };
  auto issue = [&](int64_t ci, int s) {
    if (kPing && !(p.debug & 2) && chunk_rows(len, ci) == C) copy_tiles(ci, s, std::true_type{});
    else if (!(p.debug & 2)) copy_tiles(ci, s, std::false_type{});
    if constexpr (kPing) cp_async_mbar_arrive(raw_kq ? &landed[s] : &full[s]);
    else cp_async_commit();
  };
  // conv, warpgroup 0: chunk ci's K (and Q) tiles (use n) to fp16 in place once landed
  // (thread t: row t / 16 + 8 i, values 8 (t % 16) ..; rows past the chunk's end are
  // zeros), then its arrival on full
  auto convert_use = [&](int64_t ci, uint32_t n) {
    const int s = static_cast<int>(n % kStages);
    mbar_wait(&landed[s], (n / kStages) & 1);
    const bool with_q = want_o && ci >= c_begin;
    const int t = static_cast<int>(threadIdx.x);
    tile_to_half_in_place<In>(Kst(s), t);
    if (with_q) tile_to_half_in_place<In>(Qst(s), t);
    mbar_arrive(&full[s]);
  };
  // kPing: chunk ci's copies (use n) into stage n % kStages once its previous use
  // (n - kStages) is released
  auto issue_use = [&](int64_t ci, uint32_t n) {
    if (n >= kStages) mbar_wait(&empty[n % kStages], ((n / kStages) - 1) & 1);
    issue(ci, static_cast<int>(n % kStages));
  };

  // S^T: values v0 + (g, g + 8), keys 8 jn + (2t, 2t + 1); S is stored [key][value]
  float sacc[16][4];
  // wy_kernel's outputs are complete before the chain starts: the first chunk's copies go
  // out before the wait below
  if constexpr (kPing) {
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j)
      if (c_first + j < c_end && issuer) issue_use(c_first + j, n0 + j);
    if (conv && !issuer && c_first < c_end) convert_use(c_first, n0);  // the first chunk's
  } else {
    if (c_first < c_end) issue(c_first, 0);
  }
  // an exact segment's entering state (seg_in, a sub-segment's) is the chain's: wait for
  // the kernel before (launch_kernel's pdl); the other blocks need nothing from it
  if (b.ss.src == SegSource::Exact) pdl_wait();
  load_state_cols(sacc, entering_state(p, b), identity, v0);

  for (int64_t ci = c_first; ci < c_end; ++ci) {
    if (ci + 1 == c_end) pdl_trigger();  // the chain's next kernel may start its prologue
    const uint32_t n = n0 + static_cast<uint32_t>(ci - c_first);
    const int s = kPing ? static_cast<int>(n % kStages) : static_cast<int>((ci - c_first) & 1);
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    if constexpr (kPing) {
      if (issuer && ci + kStages - 1 < c_end) issue_use(ci + kStages - 1, n + kStages - 1);
      mbar_wait(&full[s], (n / kStages) & 1);  // stage s landed
    } else {
      cp_async_wait<0>();
      __syncthreads();  // stage s landed; stage s ^ 1 (the previous chunk) no longer read
      if (ci + 1 < c_end) issue(ci + 1, s ^ 1);
    }
    // kPing: this warp's reads of stage s are done (after the last product that reads it)
    auto release = [&] {
      if constexpr (kPing) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
      }
    };
    const bool out = want_o && ci >= c_begin;
    if (float* dst = sub_record(p, b, ci)) store_state_cols(dst, sacc, v0);
    if (kRecord && record && ci >= c_begin && !(p.debug & 4)) {  // the state entering chunk ci
      const int64_t rec = (b.chunk0 + ci) * p.Hv + h;
      store_record_cols(reinterpret_cast<__half*>(record_at<D>(p.h, rec, true)) + v0 * D,
                        p.h_scale + rec * 8 + warp, sacc, rec_stage);
    }
    const __half* K = Kst(s);
    const float2* E = Est(s);

    // fp16 A fragments of S^T (k = keys)
    uint32_t sa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) acc_to_a16(sa[kk], sacc[2 * kk], sacc[2 * kk + 1]);

    // X^T = S^T K^T (and Q S as O^T's first part): n8 tiles of tokens 8 j ..
    float x[8][4] = {}, o[8][4] = {};
    if (out) sk_products<true>(x, o, sa, K, Qst(s));
    else sk_products<false>(x, o, sa, K, Qst(s));

    uint32_t wa[4][4];  // W'^T = V^T - X^T diag(e^G)
    w_prime_frags(wa, x, Vst(s), E, v0, identity);
    // U^T = W'^T (T diag(beta))^T: T diag(beta) [r][s] is zero for s > r
    float u[8][4] = {};
    tri_product(u, wa, Tst(s), LDP);
    if (kRecord && record && ci >= c_begin && !(p.debug & 8)) {  // U: a token record block
      const int64_t rec = (b.chunk0 + ci) * p.Hv + h;
      store_record_cols(reinterpret_cast<__half*>(record_at<C>(p.U, rec, true)) + v0 * C,
                        p.U_scale + rec * 8 + warp, u, rec_stage);
    }
    uint32_t ua[4][4], ue[4][4];  // U^T and U^T diag(e^{G_last - G})
    u_frags(ua, ue, u, E);
    state_update_cols(sacc, ue, K, E[C - 1].x);
    if (!out) release();
    // conv: the next chunk's K and Q (issued at this chunk's head by warpgroup 1) to fp16
    if (conv && !issuer && ci + 1 < c_end) convert_use(ci + 1, n + 1);
    // O^T = S^T Q^T diag(e^G) + U^T P^T, then out through shared memory (the staging written
    // out rather than store_o_cols: the ping-pong schedule reads the rows back before it
    // releases the stage, three stages stage them in the V tile)
    if (out) {
      const __half* P = Pst(s);
      scale_by_eg(o, E);
      tri_product(o, ua, P, LDP);  // O^T += U^T P^T
      if constexpr (kStages == 2) release();  // three stages: after the staging's reads
      if (kCorr && corr_out) {  // fp32 [h][value][token]: a thread's token pairs adjacent
        float* dst = (identity ? p.q_eff : p.o_loc) + static_cast<size_t>(h) * D * p.corr_ld +
                     tok0;
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = 8 * j + acc_col(e), v = v0 + acc_row(e);
            if (r < L) __stcg(dst + static_cast<size_t>(v) * p.corr_ld + r, p.scale * o[j][e]);
          }
        continue;
      }
      // O^T tiles -> Ost [token][16 values] (transposed by stmatrix; three stages: the
      // warp's own columns of the V tile, rows LDH apart), then 16-byte rows out
      const int m = lane >> 3, i = lane & 7;
      __half* ost = kStages == 3 ? reinterpret_cast<__half*>(Vst(s)) + v0 : Ost;
      constexpr int ldo = kStages == 3 ? LDH : LDO;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float sc = p.scale;
        stmatrix_x4_trans(ost + (16 * nt + (m >> 1) * 8 + i) * ldo + (m & 1) * 8,
                          pack_in2<In>(sc * o[2 * nt][0], sc * o[2 * nt][1]),
                          pack_in2<In>(sc * o[2 * nt][2], sc * o[2 * nt][3]),
                          pack_in2<In>(sc * o[2 * nt + 1][0], sc * o[2 * nt + 1][1]),
                          pack_in2<In>(sc * o[2 * nt + 1][2], sc * o[2 * nt + 1][3]));
      }
      __syncwarp();
      In* dst = static_cast<In*>(p.o);
      if constexpr (kPing) {  // all four rows read (three stages: the stage released), stored
        uint4 rows[4];
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          const int piece = lane + 32 * it, r = piece >> 1, half = piece & 1;
          rows[it] = *reinterpret_cast<const uint4*>(ost + r * ldo + 8 * half);
        }
        if constexpr (kStages == 3) release();
        else __syncwarp();  // Ost is reused by the next chunk
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          const int piece = lane + 32 * it, r = piece >> 1, half = piece & 1;
          if (r < L && !(p.debug & 32))
            st_global_16(dst + ((tok0 + r) * p.Hv + h) * D + v0 + 8 * half, rows[it]);
        }
      } else {
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          const int piece = lane + 32 * it, r = piece >> 1, half = piece & 1;
          if (r < L)
            *reinterpret_cast<uint4*>(dst + ((tok0 + r) * p.Hv + h) * D + v0 + 8 * half) =
                *reinterpret_cast<const uint4*>(Ost + r * LDO + 8 * half);
        }
        __syncwarp();
      }
    }
  }

  // the state leaving the segment: the final state, or this block's summary
  if (float* dst = leaving_state(p, b)) store_state_cols(dst, sacc, v0);
  if (kRecord && lane == 0) bulk_wait();  // the records' bulk stores are complete
  if (c_first < c_end) n_used = n0 + static_cast<uint32_t>(c_end - c_first);
}

// kCorr: phase 1 with SegParams::corr (its own instantiation: the fp32 output path costs
// the phase-0 kernel ~32 bytes of spills)
// kPing: the ping-pong schedule (state_fwd_cols_segment) with kStages stages,
// StateFwdColsSmem::stage_bytes(kStages, kRecord).
template <typename In, bool kRecord = false, bool kCorr = false, bool kPing = false,
          int kStages = 2>
__global__ void __launch_bounds__(NT, 1) state_fwd_cols_kernel(FwdParams p) {
  PdlCompletion pdl_completion;  // a programmatic dependent in the chain (mma.cuh)
  if (pass_skipped<D>(p)) return;
  if constexpr (kPing) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint64_t* bars = reinterpret_cast<uint64_t*>(
        smem_raw + StateFwdColsSmem::stage_bars_at(kStages, kRecord));
    if (threadIdx.x == 0) {
#pragma unroll
      for (int st = 0; st < kStages; ++st) {
        // full: one (cp.async) arrival per issuing thread
        mbar_init(&bars[st], NT / 2);
        mbar_init(&bars[kStages + st], NT / 32);  // empty: one arrival per warp
        // landed (two stages): one cp.async arrival per issuing thread
        if (kStages == 2) mbar_init(&bars[2 * kStages + st], NT / 2);
      }
    }
    __syncthreads();
  }
  uint32_t n_used = 0;
  for_each_segment_block<D, false, true>(p, false, [&](const SegmentBlock& b) {
    state_fwd_cols_segment<In, kRecord, kCorr, kPing, kStages>(p, b, n_used);
  });
}


// ---------------------------------------------------------------------------------------
// state_fwd_cols_wg_kernel: state_fwd_cols_kernel with every product on warpgroup tensor
// cores (wgmma m64nNk16, fp16, fp32 accumulators; opt-in: FLASHGDN_COLS_WGMMA=1, tested on
// H100 in session 15 and no faster than the mma.sync kernel). Same grid, algebra, registers and output path; the two warpgroups own value
// columns 0..63 and 64..127 (warp w still owns 16 w ..). A operands stay in registers (the
// m16n8k16 A layout per warp is wgmma's), B operands are read by the tensor cores straight
// from shared memory, so the ldmatrix traffic of the mma.sync kernel (~60 KB per warp and
// chunk) is gone: K, Q, T diag(beta) and P are stored as core-matrix tiles (wgmma.cuh,
// cp_async_core16) and K serves both X^T = S^T K^T (K-major B) and the state update
// U^T diag(eL) K (N-major B, the same bytes). V stays a padded tile read by ldmatrix.
//   reads / writes as state_fwd_cols_kernel (no records)
struct StateFwdColsWgSmem {
  static constexpr int LDO = 24;
  static constexpr size_t kCoreD = sizeof(__half) * C * D;  // K, Q core tiles [64][128]
  static constexpr size_t kCoreC = sizeof(__half) * C * C;  // T diag(beta), P [64][64]
  static constexpr size_t kV = sizeof(__half) * C * LDH;    // V [64][136]
  static constexpr size_t kStage = 2 * kCoreD + 2 * kCoreC + kV + sizeof(float2) * C;
  static constexpr size_t kBytes = 2 * kStage + sizeof(__half) * (NT / 32) * C * LDO;
  // kPing: mbarriers full[2], empty[2], landed[2] after the above
  static constexpr size_t kPingBytes = kBytes + 6 * sizeof(uint64_t);
};

// One segment block of state_fwd_cols_wg_kernel (for_each_segment_block).
// kPing (FLASHGDN_COLS_WGMMA=2): state_fwd_cols_segment's ping-pong schedule instead of a
// block barrier a chunk. Warpgroup 1 issues chunk ci + 1's copies at the head of its chunk
// ci (once empty[s] says both warpgroups released the stage) and, after its first products,
// waits for them, makes them visible to the tensor cores' reads (fence.proxy.async: cp.async
// writes are the generic proxy's, wgmma reads the async proxy's) and arrives on full[s], or
// with p.kq_bf16 on landed[s]: then warpgroup 0, after its state update, converts the bf16 K
// and Q tiles to fp16 in place (elementwise: the core-matrix layout does not matter), fences
// and arrives on full[s]. A warp releases the stage (empty[s]) after its last wgmma's wait.
// kOrder (FLASHGDN_COLS_WGMMA=3, with kPing; written 2026-11-26 after the session's device
// time, NOT yet run on a GPU): the two warpgroups issue their wgmma groups in strict
// alternation, as FlashInfer's Hopper forward does (docs/perf-notes.md version 39), so that
// one warpgroup's products run on the tensor cores while the other does its epilogue:
// warpgroup 0 waits on named barrier 1 before each group but its segment's first, warpgroup
// 1 on barrier 2 before each; after committing a group each arrives on the other's barrier;
// warpgroup 0's last wait, after the segment, takes warpgroup 1's last arrival. The same
// products on the same operands: the same bits.
template <typename In, bool kPing = false, bool kOrder = false>
__device__ __forceinline__ void state_fwd_cols_wg_segment(const FwdParams& p,
                                                          const SegmentBlock& b,
                                                          uint32_t& n_used) {
  using Sm = StateFwdColsWgSmem;
  constexpr int LDO = Sm::LDO;
  // core-matrix byte strides: a row group of 8 tokens spans D / 8 (K, Q) or C / 8 (T, P) core
  // matrices of 128 bytes
  constexpr uint32_t kRowGroupD = 128 * (D / 8), kRowGroupC = 128 * (C / 8);
  constexpr int kTokens16D = 2 * kRowGroupD / sizeof(__half);  // 16 token rows of K, in halves
  const int64_t h = b.h, hq = b.hq, start = b.start, len = b.len;
  const int64_t c_begin = b.c_begin, c_end = b.c_end, c_first = b.ss.c_first;
  const bool identity = b.identity;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Kst = [&](int s) { return reinterpret_cast<__half*>(smem_raw + s * Sm::kStage); };
  auto Qst = [&](int s) { return Kst(s) + C * D; };
  auto Tst = [&](int s) { return Qst(s) + C * D; };
  auto Pst = [&](int s) { return Tst(s) + C * C; };
  auto Vst = [&](int s) { return reinterpret_cast<In*>(Pst(s) + C * C); };
  auto Est = [&](int s) { return reinterpret_cast<float2*>(Vst(s) + C * LDH); };
  const int warp = threadIdx.x >> 5, lane = lane_id();
  __half* Ost = reinterpret_cast<__half*>(smem_raw + 2 * Sm::kStage) + warp * C * LDO;
  const int v0 = 16 * warp;
  const bool want_o = p.phase == 0 && p.o != nullptr && !(p.debug & 1);
  // kPing: the stages' mbarriers; warpgroup 1 (itid) issues the copies
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw + Sm::kBytes);
  uint64_t* empty = full + 2;
  uint64_t* landed = full + 4;
  constexpr int kIssuers = kPing ? NT / 2 : NT;
  const bool issuer = !kPing || threadIdx.x >= NT / 2;
  const int itid = kPing ? static_cast<int>(threadIdx.x) - NT / 2 : static_cast<int>(threadIdx.x);
  const bool conv = kPing && p.kq_bf16;  // K and Q as the inputs' bf16 tiles
  const uint32_t n0 = n_used;
  static_assert(!kOrder || kPing, "the issue order: in the ping-pong schedule");
  const bool wg0 = threadIdx.x < NT / 2;
  bool first_group = true;  // kOrder, warpgroup 0: its segment's first wgmma group waits for no one
  auto order_wait = [&] {
    if constexpr (kOrder) {
      if (!wg0) named_bar_sync(2, NT);
      else if (!first_group) named_bar_sync(1, NT);
      first_group = false;
    }
  };
  auto order_notify = [&] {
    if constexpr (kOrder) named_bar_arrive(wg0 ? 2 : 1, NT);
  };

  auto issue = [&](int64_t ci, int s) {
    if (p.debug & 2) return;
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    const __half* ksrc = conv ? static_cast<const __half*>(p.k) : p.Kh;
    const __half* qsrc = conv ? static_cast<const __half*>(p.q) : p.Qh;
    cp_async_core16_by<C, D, kIssuers>(Kst(s), ksrc + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L, itid);
    cp_async_core16_by<C, C, kIssuers>(Tst(s), p.Tv16 + (tok0 * p.Hv + h) * C, p.Hv * C, L, itid);
    if (!identity)
      cp_async_tile_by<C, D, LDH, kIssuers>(
          Vst(s), static_cast<const In*>(p.v) + (tok0 * p.Hv + h) * D, p.Hv * D, L, itid);
    if (want_o && ci >= c_begin) {
      cp_async_core16_by<C, D, kIssuers>(Qst(s), qsrc + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L,
                                         itid);
      cp_async_core16_by<C, C, kIssuers>(Pst(s), p.P16 + (tok0 * p.Hv + h) * C, p.Hv * C, L,
                                         itid);
    }
    if (itid < C) {
      const int r = itid < L ? itid : L - 1;
      cp_async8(Est(s) + itid, p.EG + (tok0 + r) * p.Hv + h);
    }
    cp_async_commit();
  };
  // kPing, warpgroup 1: chunk ci's copies (use n) into stage n % 2 once its use n - 2 is
  // released; publish: once they landed, visible to wgmma, signalled
  auto issue_use = [&](int64_t ci, uint32_t n) {
    if (n >= 2) mbar_wait(&empty[n & 1], ((n >> 1) - 1) & 1);
    issue(ci, static_cast<int>(n & 1));
  };
  auto publish = [&](uint32_t n) {
    cp_async_wait<0>();
    fence_proxy_async();
    mbar_arrive(conv ? &landed[n & 1] : &full[n & 1]);
  };
  // kPing with conv, warpgroup 0: chunk ci's K (and Q) tiles (use n) to fp16 in place
  auto convert_use = [&](int64_t ci, uint32_t n) {
    const int s = static_cast<int>(n & 1);
    mbar_wait(&landed[s], (n >> 1) & 1);
    const int t = static_cast<int>(threadIdx.x);
    auto convert = [&](__half* tile) {
#pragma unroll
      for (int i = 0; i < C * D / 8 / (NT / 2); ++i) {
        In* piece = reinterpret_cast<In*>(tile) + 8 * (t + (NT / 2) * i);
        *reinterpret_cast<uint4*>(piece) = half8_of(piece);
      }
    };
    convert(Kst(s));
    if (want_o && ci >= c_begin) convert(Qst(s));
    fence_proxy_async();
    mbar_arrive(&full[s]);
  };

  float sacc[16][4];
  if constexpr (kPing) {
    if (c_first < c_end && issuer) {
      issue_use(c_first, n0);
      publish(n0);
    }
    if (conv && !issuer && c_first < c_end) convert_use(c_first, n0);
  } else {
    if (c_first < c_end) issue(c_first, 0);
  }
  if (b.ss.src == SegSource::Exact) pdl_wait();  // as in state_fwd_cols_segment
  load_state_cols(sacc, entering_state(p, b), identity, v0);

  for (int64_t ci = c_first; ci < c_end; ++ci) {
    const uint32_t n = n0 + static_cast<uint32_t>(ci - c_first);
    const int s = kPing ? static_cast<int>(n & 1) : static_cast<int>((ci - c_first) & 1);
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    const bool next = ci + 1 < c_end;
    if constexpr (kPing) {
      if (issuer && next) issue_use(ci + 1, n + 1);
      mbar_wait(&full[s], (n >> 1) & 1);  // stage s landed and visible
    } else {
      cp_async_wait<0>();
      fence_proxy_async();  // this thread's cp.async data, visible to the tensor cores' reads
      __syncthreads();
      if (next) issue(ci + 1, s ^ 1);
    }
    // the chunk's work, compiled once with and once without outputs, so that every wgmma
    // sequence is straight-line code (a conditional one makes ptxas serialise, C7519)
    auto chunk = [&](auto with_out) {
      constexpr bool kOut = decltype(with_out)::value;
      const __half* K = Kst(s);
      const float2* E = Est(s);

      uint32_t sa[8][4];
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) acc_to_a16(sa[kk], sacc[2 * kk], sacc[2 * kk + 1]);

      // X^T = S^T K^T and Q S: B = K^T (K-major: token rows, keys contiguous), k16 = 2 key groups
      float x[8][4] = {}, o[8][4] = {};
      order_wait();
      wgmma_fence();
      fence_acc(x);
      fence_acc(o);
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        wgmma_rs_f16<64>(x, sa[kk], f16_core_desc(K + 16 * kk * 8, 128, kRowGroupD), true);
      if constexpr (kOut) {
        const __half* Q = Qst(s);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
          wgmma_rs_f16<64>(o, sa[kk], f16_core_desc(Q + 16 * kk * 8, 128, kRowGroupD), true);
      }
      wgmma_commit();
      order_notify();
      if (kPing && issuer && next) publish(n + 1);  // the next chunk's copies, under the products
      wgmma_wait<0>();
      fence_acc(x);
      fence_acc(o);
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) fence_frag(sa[kk]);

      uint32_t wa[4][4];  // W'^T = V^T - X^T diag(e^G)
      w_prime_frags(wa, x, Vst(s), E, v0, identity);
      // U^T = W'^T (T diag(beta))^T: B K-major on the [r][s] tile (r rows, s contiguous)
      float u[8][4] = {};
      order_wait();
      wgmma_fence();
      fence_acc(u);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt)
        wgmma_rs_f16<64>(u, wa[kt], f16_core_desc(Tst(s) + 16 * kt * 8, 128, kRowGroupC), true);
      wgmma_commit();
      order_notify();
      wgmma_wait<0>();
      fence_acc(u);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) fence_frag(wa[kt]);

      uint32_t ua[4][4], ue[4][4];  // U^T and U^T diag(e^{G_last - G})
      u_frags(ua, ue, u, E);
      // S^T <- e^{G_last} S^T + U^T diag(eL) K: B = K N-major (keys contiguous in the core
      // rows, token groups along k), k16 = 2 token groups; O^T += U^T P^T (P K-major)
      const float egl = E[C - 1].x;
#pragma unroll
      for (int jn = 0; jn < 16; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[jn][e] *= egl;
      if constexpr (kOut) scale_by_eg(o, E);
      order_wait();
      wgmma_fence();
      fence_acc(sacc);
      fence_acc(o);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt)
        wgmma_rs_f16<128, true>(sacc, ue[kt], f16_core_desc(K + kt * kTokens16D, kRowGroupD, 128),
                                true);
      if constexpr (kOut) {
        const __half* P = Pst(s);
#pragma unroll
        for (int kt = 0; kt < 4; ++kt)
          wgmma_rs_f16<64>(o, ua[kt], f16_core_desc(P + 16 * kt * 8, 128, kRowGroupC), true);
      }
      wgmma_commit();
      order_notify();
      wgmma_wait<0>();
      fence_acc(sacc);
      fence_acc(o);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        fence_frag(ue[kt]);
        fence_frag(ua[kt]);
      }
      if constexpr (kPing) {  // this warp's reads of stage s are done
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
      }

      if constexpr (kOut) store_o_cols<In>(p, o, Ost, LDO, tok0, L, h, v0);
    };
    if (want_o && ci >= c_begin) chunk(std::true_type{});
    else chunk(std::false_type{});
    if (conv && !issuer && next) convert_use(ci + 1, n + 1);
  }

  // kOrder: warpgroup 1's last arrival (after its last group) taken, so barrier 1 is empty
  if (kOrder && wg0 && c_first < c_end) named_bar_sync(1, NT);
  if (float* dst = leaving_state(p, b)) store_state_cols(dst, sacc, v0);
  if (c_first < c_end) n_used = n0 + static_cast<uint32_t>(c_end - c_first);
}

template <typename In, bool kPing = false, bool kOrder = false>
__global__ void __launch_bounds__(NT, 1) state_fwd_cols_wg_kernel(FwdParams p) {
  PdlCompletion pdl_completion;  // as in state_fwd_cols_kernel
  if (p.seqs.failed() || !col_block_chosen<D>(p)) return;
  if constexpr (kPing) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw + StateFwdColsWgSmem::kBytes);
    if (threadIdx.x == 0) {
      for (int st = 0; st < 2; ++st) {
        mbar_init(&bars[st], NT / 2);      // full: warpgroup 1's (or with conv 0's) threads
        mbar_init(&bars[2 + st], NT / 32); // empty: one arrival per warp
        mbar_init(&bars[4 + st], NT / 2);  // landed: warpgroup 1's threads
      }
    }
    __syncthreads();
  }
  uint32_t n_used = 0;
  for_each_segment_block<D>(p, false, [&](const SegmentBlock& b) {
    state_fwd_cols_wg_segment<In, kPing, kOrder>(p, b, n_used);
  });
}

}  // namespace cuda
}  // namespace flashgdn
