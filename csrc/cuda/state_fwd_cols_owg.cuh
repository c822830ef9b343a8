// state_fwd_cols_owg_kernel: the forward's 128-column pass, phase 0 of the plain forward
// (outputs, no records, no correction), with the outputs formed by a warpgroup of their own
// (opt-in, FLASHGDN_COLS_OWG=1; docs/perf-notes.md version 36: the output is ~31% of
// state_fwd_cols_kernel's phase 0, in the same dependency-bound warps as the chain).
// Measured (version 37, H100, 16/32 x 32768): 479 us against state_fwd_cols_kernel's 468;
// the chain alone 295 (FLASHGDN_DEBUG=128), with the hand-over but no output math 349 (=64):
// the four output warps, one a scheduler, are the bound (IPC ~0.13 each, ~1050 instructions
// a chunk). On wgmma (both operands in shared memory, core-matrix tiles) the output was
// bit-identical but took 876 us: wgmma beside the chain's mma.sync on the same SM.
//
// grid as state_fwd_cols_kernel's phase 0 (1, H_v, segments or slots), 384 threads, one block
// an SM (~212 KB smem). Warpgroups 0 and 1 (warps 0..7, the chain) run state_fwd_cols_kernel's
// chunk step without its output: warp w owns value columns 16 w .. 16 w + 15 of S^T and forms
//   X^T = S^T K^T,  U^T = (V^T - X^T diag(e^G)) (T diag(beta))^T,
//   S^T <- e^{G_last} S^T + U^T diag(e^{G_last - G}) K,
// and hands the fp16 A fragments it multiplied, S^T (before the update) and U^T, to shared
// memory (stmatrix: the same registers come back through ldmatrix). Warpgroup 2 (warps 8..11,
// value columns 32 (w - 8) .. + 31 each) forms
//   O^T = scale (S^T Q^T diag(e^G) + U^T P^T)
// from them, token halves of 32 at a time, with the products accumulated in
// state_fwd_cols_kernel's order: the same bits (tests/test_context_parallel.py
// test_owg_bit_identical). Warpgroup 1 issues the chain's copies (K, V, T diag(beta), e^G and
// e^{G_last - G}; mbarriers full / empty per stage, two stages), warpgroup 2 its own (Q, P,
// e^G; two stages, a named barrier a chunk). The hand-over is one S^T and one U^T buffer,
// each with a full and a free mbarrier: the chain writes S^T of output chunk m after its
// X product, once the output warps are done reading chunk m - 1's, and U^T after its U
// product; the output warps free S^T after the second half's S Q^T and U^T after its P
// product. setmaxnreg: the chain's warps 200 registers, the output's 104 (kOwgChainRegs).
//   reads  Kh, Qh, Tv16, v, P16, EG (wy_kernel), Lb, initial state, seg_in
//   writes o, final state
#pragma once

#include "state_fwd_cols.cuh"

namespace flashgdn {
namespace cuda {

constexpr int kOwgThreads = 3 * 128;  // two chain warpgroups, one output warpgroup
// The block's pool is what its launch took: 168 registers a thread (65536 / 384, rounded down
// to a multiple of 8), 64512 in all; setmaxnreg.inc waits until the pool has them, so the
// roles' counts must fit it or the chain's warps wait for ever. 200 / 104: the fewest spills
// (ptxas: 24 bytes, in the segments' set-up; 208 / 88: 68, 216 / 72: 84).
constexpr int kOwgLaunchRegs = (65536 / kOwgThreads) / 8 * 8;
constexpr int kOwgChainRegs = 200, kOwgOutRegs = 104;
static_assert(2 * 128 * kOwgChainRegs + 128 * kOwgOutRegs <= kOwgThreads * kOwgLaunchRegs,
              "the roles' registers fit the block's pool");

struct StateFwdOwgSmem {
  static constexpr int LDP = C + 8;  // T diag(beta), P [64][72]; U^T [128][72]
  static constexpr int LDO = 40;     // an output warp's staging [64 tokens][40] (32 values)
  static constexpr size_t kTileH = sizeof(__half) * C * LDH;  // [64][136]
  static constexpr size_t kTileP = sizeof(__half) * C * LDP;  // [64][72]
  static constexpr size_t kE = sizeof(float2) * C;
  static constexpr size_t kChainStage = 2 * kTileH + kTileP + kE;  // K, V, T diag(beta), E
  static constexpr size_t kOutStage = kTileH + kTileP + kE;        // Q, P, E
  static constexpr size_t kOut = 2 * kChainStage;                  // the output's stages
  static constexpr size_t kS = kOut + 2 * kOutStage;               // S^T [128][136] fp16
  static constexpr size_t kU = kS + sizeof(__half) * D * LDH;      // U^T [128][72] fp16
  static constexpr size_t kO = kU + sizeof(__half) * D * LDP;      // 4 x [64][LDO] staging
  static constexpr size_t kBars = kO + sizeof(__half) * 4 * C * LDO;
  // full[2], empty[2], ofull[2], sfull, sfree, ufull, ufree
  static constexpr size_t kBytes = kBars + 10 * sizeof(uint64_t);
};
static_assert(StateFwdOwgSmem::kBytes <= 227 * 1024, "one block an SM");

// The chain's part of one segment block: state_fwd_cols_segment<In, false, false, true, 2>
// without Q, P and the output, handing S^T and U^T of every output chunk to the output
// warpgroup. n_used: the chain stages' uses so far; m_used: the output chunks so far.
template <typename In>
__device__ __forceinline__ void owg_chain_segment(const FwdParams& p, const SegmentBlock& b,
                                                  uint32_t& n_used, uint32_t& m_used) {
  using Sm = StateFwdOwgSmem;
  constexpr int LDP = Sm::LDP;
  constexpr int kIssuers = 128;  // warpgroup 1
  const int64_t h = b.h, hq = b.hq, start = b.start, len = b.len;
  const int64_t c_begin = b.c_begin, c_end = b.c_end, c_first = b.ss.c_first;
  const bool identity = b.identity;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Kst = [&](int s) { return reinterpret_cast<__half*>(smem_raw + s * Sm::kChainStage); };
  auto Vst = [&](int s) { return reinterpret_cast<In*>(Kst(s) + C * LDH); };
  auto Tst = [&](int s) { return reinterpret_cast<__half*>(Vst(s) + C * LDH); };
  auto Est = [&](int s) { return reinterpret_cast<float2*>(Tst(s) + C * LDP); };
  __half* Sbuf = reinterpret_cast<__half*>(smem_raw + Sm::kS);
  __half* Ubuf = reinterpret_cast<__half*>(smem_raw + Sm::kU);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw + Sm::kBars);
  uint64_t* empty = full + 2;
  uint64_t* sfull = full + 6;
  uint64_t* sfree = full + 7;
  uint64_t* ufull = full + 8;
  uint64_t* ufree = full + 9;
  const int warp = threadIdx.x >> 5, lane = lane_id();
  const int v0 = 16 * warp;
  const bool issuer = threadIdx.x >= 128;
  const int itid = static_cast<int>(threadIdx.x) - 128;
  const uint32_t n0 = n_used;

  auto copy_tiles = [&](int64_t ci, int s, auto whole) {
    constexpr bool kW = decltype(whole)::value;
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    cp_async_tile_by<C, D, LDH, kIssuers, kW>(Kst(s), p.Kh + (tok0 * p.Hqk + hq) * D, p.Hqk * D,
                                              L, itid);
    cp_async_tile_by<C, C, LDP, kIssuers, kW, true>(Tst(s), p.Tv16 + (tok0 * p.Hv + h) * C,
                                                    p.Hv * C, L, itid);
    if (!identity)
      cp_async_tile_by<C, D, LDH, kIssuers, kW>(
          Vst(s), static_cast<const In*>(p.v) + (tok0 * p.Hv + h) * D, p.Hv * D, L, itid);
    if (itid < C) {  // rows past the chunk's end repeat its last row: e^{G_last - G} = 1
      const int r = kW || itid < L ? itid : L - 1;
      cp_async8(Est(s) + itid, p.EG + (tok0 + r) * p.Hv + h);
    }
  };
  auto issue_use = [&](int64_t ci, uint32_t n) {
    if (n >= 2) mbar_wait(&empty[n % 2], ((n / 2) - 1) & 1);
    const int s = static_cast<int>(n % 2);
    if (chunk_rows(len, ci) == C) copy_tiles(ci, s, std::true_type{});
    else copy_tiles(ci, s, std::false_type{});
    cp_async_mbar_arrive(&full[s]);
  };

  float sacc[16][4];
  if (c_first < c_end && issuer) issue_use(c_first, n0);
  if (b.ss.src == SegSource::Exact) pdl_wait();
  load_state_cols(sacc, entering_state(p, b), identity, v0);

  // FLASHGDN_DEBUG & 128 (timing only, o garbage): no hand-over, the chain alone
  const bool hand = !(p.debug & 128);
  uint32_t m = m_used;  // the output chunk this one is, where it has outputs
  for (int64_t ci = c_first; ci < c_end; ++ci) {
    if (ci + 1 == c_end) pdl_trigger();
    const uint32_t n = n0 + static_cast<uint32_t>(ci - c_first);
    const int s = static_cast<int>(n % 2);
    if (issuer && ci + 1 < c_end) issue_use(ci + 1, n + 1);
    mbar_wait(&full[s], (n / 2) & 1);
    const bool out = hand && ci >= c_begin;
    const __half* K = Kst(s);
    const float2* E = Est(s);

    uint32_t sa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) acc_to_a16(sa[kk], sacc[2 * kk], sacc[2 * kk + 1]);
    float x[8][4] = {};
    sk_products<false>(x, x, sa, K, nullptr);  // no Q: its o argument is not touched
    if (out) {  // S^T of output chunk m, once the output warps are done with chunk m - 1's
      if (m > 0) mbar_wait(sfree, (m - 1) & 1);
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) store_frag_a16(Sbuf, LDH, v0, 16 * kk, sa[kk]);
      __syncwarp();
      if (lane == 0) mbar_arrive(sfull);
    }

    uint32_t wa[4][4];
    w_prime_frags(wa, x, Vst(s), E, v0, identity);
    float u[8][4] = {};
    tri_product(u, wa, Tst(s), LDP);
    uint32_t ua[4][4], ue[4][4];
    u_frags(ua, ue, u, E);
    if (out) {  // U^T of output chunk m
      if (m > 0) mbar_wait(ufree, (m - 1) & 1);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) store_frag_a16(Ubuf, LDP, v0, 16 * kt, ua[kt]);
      __syncwarp();
      if (lane == 0) mbar_arrive(ufull);
      ++m;
    }
    state_update_cols(sacc, ue, K, E[C - 1].x);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);  // this warp's reads of stage s are done
  }

  if (float* dst = leaving_state(p, b)) store_state_cols(dst, sacc, v0);
  if (c_first < c_end) n_used = n0 + static_cast<uint32_t>(c_end - c_first);
  m_used = m;
}

// The output warpgroup's part of one segment block: O^T of every output chunk from the
// chain's S^T and U^T and its own copies of Q, P and e^G. m_used: the output chunks so far
// (the S^T / U^T hand-overs' and the output stages' use index).
template <typename In>
__device__ __forceinline__ void owg_output_segment(const FwdParams& p, const SegmentBlock& b,
                                                   uint32_t& m_used) {
  using Sm = StateFwdOwgSmem;
  constexpr int LDP = Sm::LDP, LDO = Sm::LDO;
  const int64_t h = b.h, hq = b.hq, start = b.start, len = b.len;
  const int64_t c_end = b.c_end;
  const int64_t cb = b.c_begin > b.ss.c_first ? b.c_begin : b.ss.c_first;  // first output chunk
  if (cb >= c_end || (p.debug & 128)) return;
  // FLASHGDN_DEBUG & 64 (timing only, o garbage): the hand-over's waits and arrivals without
  // the output's products and stores
  const bool math = !(p.debug & 64);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Qst = [&](int s) {
    return reinterpret_cast<__half*>(smem_raw + Sm::kOut + s * Sm::kOutStage);
  };
  auto Pst = [&](int s) { return Qst(s) + C * LDH; };
  auto Est = [&](int s) { return reinterpret_cast<float2*>(Pst(s) + C * LDP); };
  const __half* Sbuf = reinterpret_cast<const __half*>(smem_raw + Sm::kS);
  const __half* Ubuf = reinterpret_cast<const __half*>(smem_raw + Sm::kU);
  const int otid = static_cast<int>(threadIdx.x) - 2 * 128;
  const int owarp = otid >> 5, lane = lane_id();
  __half* Ost = reinterpret_cast<__half*>(smem_raw + Sm::kO) + owarp * C * LDO;
  uint64_t* ofull = reinterpret_cast<uint64_t*>(smem_raw + Sm::kBars) + 4;
  uint64_t* sfull = ofull + 2;
  uint64_t* sfree = ofull + 3;
  uint64_t* ufull = ofull + 4;
  uint64_t* ufree = ofull + 5;
  const int vo = 32 * owarp;  // the warp's value columns (rows of O^T)
  const uint32_t m0 = m_used;

  auto issue = [&](int64_t ci, uint32_t m) {  // chunk ci's Q, P and e^G into stage m % 2
    const int s = static_cast<int>(m % 2);
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    auto copy = [&](auto whole) {
      constexpr bool kW = decltype(whole)::value;
      cp_async_tile_by<C, D, LDH, 128, kW>(Qst(s), p.Qh + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L,
                                           otid);
      cp_async_tile_by<C, C, LDP, 128, kW, true>(Pst(s), p.P16 + (tok0 * p.Hv + h) * C,
                                                 p.Hv * C, L, otid);
      if (otid < C) {
        const int r = kW || otid < L ? otid : L - 1;
        cp_async8(Est(s) + otid, p.EG + (tok0 + r) * p.Hv + h);
      }
    };
    if (L == C) copy(std::true_type{});
    else copy(std::false_type{});
    cp_async_mbar_arrive(&ofull[s]);
  };

  // the stage of chunk cb was last read for output chunk m0 - 2 (done: the named barrier at
  // the head of chunk m0 - 1)
  named_bar_sync(1, 128);
  issue(cb, m0);
  const int tc = 2 * (lane & 3);
  for (int64_t ci = cb; ci < c_end; ++ci) {
    const uint32_t m = m0 + static_cast<uint32_t>(ci - cb);
    const int s = static_cast<int>(m % 2);
    if (ci + 1 < c_end) {  // every output warp is done with chunk m - 1 (stage (m + 1) % 2)
      named_bar_sync(1, 128);
      issue(ci + 1, m + 1);
    }
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    mbar_wait(&ofull[s], (m / 2) & 1);
    mbar_wait(sfull, m & 1);
    const __half* Q = Qst(s);
    const __half* P = Pst(s);
    const float2* E = Est(s);
    if (!math) {
      mbar_wait(ufull, m & 1);
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(sfree);
        mbar_arrive(ufree);
      }
      continue;
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // tokens 32 hh .. 32 hh + 31
      float o[2][4][4] = {};          // [m16 tile of values][n8 tile of tokens]
      // software-pipelined: the fragments of k step kk + 1 are loaded before step kk's
      // products, so that one warp a scheduler has its ldmatrix latency covered
      uint32_t a[2][2][4], bq[2][2][4];  // [buffer][m16 tile | token block of 16][..]
      auto load_k = [&](int kk, int buf) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) frag_a16(a[buf][mt], Sbuf, LDH, vo + 16 * mt, 16 * kk);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          uint32_t(&b0)[2] = *reinterpret_cast<uint32_t(*)[2]>(&bq[buf][nt][0]);
          uint32_t(&b1)[2] = *reinterpret_cast<uint32_t(*)[2]>(&bq[buf][nt][2]);
          frag_b16_pair(b0, b1, Q, LDH, 32 * hh + 16 * nt, 16 * kk);
        }
      };
      load_k(0, 0);
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const int buf = kk & 1;
        if (kk + 1 < 8) load_k(kk + 1, buf ^ 1);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint32_t(&b0)[2] = *reinterpret_cast<const uint32_t(*)[2]>(&bq[buf][nt][0]);
          const uint32_t(&b1)[2] = *reinterpret_cast<const uint32_t(*)[2]>(&bq[buf][nt][2]);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma_f16(o[mt][2 * nt], a[buf][mt], b0);
            mma_f16(o[mt][2 * nt + 1], a[buf][mt], b1);
          }
        }
      }
      if (hh == 1) {  // S^T read for the last time
        __syncwarp();
        if (lane == 0) mbar_arrive(sfree);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // token tile 4 hh + j
        const float e0 = E[8 * (4 * hh + j) + tc].x, e1 = E[8 * (4 * hh + j) + tc + 1].x;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          o[mt][j][0] *= e0;
          o[mt][j][1] *= e1;
          o[mt][j][2] *= e0;
          o[mt][j][3] *= e1;
        }
      }
      if (hh == 0) mbar_wait(ufull, m & 1);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {  // token block 2 hh + nt of P: k blocks 0 .. 2 hh + nt
        const int gn = 2 * hh + nt;
#pragma unroll
        for (int kt = 0; kt <= gn; ++kt) {
          uint32_t b0[2], b1[2];
          frag_b16_pair(b0, b1, P, LDP, 16 * gn, 16 * kt);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            uint32_t ua[4];
            frag_a16(ua, Ubuf, LDP, vo + 16 * mt, 16 * kt);
            mma_f16(o[mt][2 * nt], ua, b0);
            mma_f16(o[mt][2 * nt + 1], ua, b1);
          }
        }
      }
      if (hh == 1) {  // U^T read for the last time
        __syncwarp();
        if (lane == 0) mbar_arrive(ufree);
      }
      // O^T tiles -> Ost [token][32 values] (stmatrix, transposed), then 16-byte rows to o
      const int mq = lane >> 3, i = lane & 7;
      const float sc = p.scale;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          stmatrix_x4_trans(
              Ost + (32 * hh + 16 * nt + (mq >> 1) * 8 + i) * LDO + 16 * mt + (mq & 1) * 8,
              pack_in2<In>(sc * o[mt][2 * nt][0], sc * o[mt][2 * nt][1]),
              pack_in2<In>(sc * o[mt][2 * nt][2], sc * o[mt][2 * nt][3]),
              pack_in2<In>(sc * o[mt][2 * nt + 1][0], sc * o[mt][2 * nt + 1][1]),
              pack_in2<In>(sc * o[mt][2 * nt + 1][2], sc * o[mt][2 * nt + 1][3]));
      __syncwarp();
      In* dst = static_cast<In*>(p.o);
      uint4 rows[4];
#pragma unroll
      for (int it = 0; it < 4; ++it) {  // 32 tokens x 4 pieces of 8 values
        const int piece = lane + 32 * it, r = piece >> 2, q = piece & 3;
        rows[it] = *reinterpret_cast<const uint4*>(Ost + (32 * hh + r) * LDO + 8 * q);
      }
      __syncwarp();  // the staging's rows are rewritten by the next chunk
#pragma unroll
      for (int it = 0; it < 4; ++it) {
        const int piece = lane + 32 * it, r = 32 * hh + (piece >> 2), q = piece & 3;
        if (r < L) st_global_16(dst + ((tok0 + r) * p.Hv + h) * D + vo + 8 * q, rows[it]);
      }
    }
  }
  m_used = m0 + static_cast<uint32_t>(c_end - cb);
}

template <typename In>
__global__ void __launch_bounds__(kOwgThreads, 1) state_fwd_cols_owg_kernel(FwdParams p) {
  PdlCompletion pdl_completion;  // a programmatic dependent in the chain (mma.cuh)
  if (p.seqs.failed() || !col_block_chosen<D>(p)) return;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw + StateFwdOwgSmem::kBars);
  if (threadIdx.x == 0) {
    mbar_init(&bars[0], 128);  // full: one cp.async arrival per thread of warpgroup 1
    mbar_init(&bars[1], 128);
    mbar_init(&bars[2], 8);    // empty: one arrival per chain warp
    mbar_init(&bars[3], 8);
    mbar_init(&bars[4], 128);  // ofull: one cp.async arrival per output thread
    mbar_init(&bars[5], 128);
    mbar_init(&bars[6], 8);    // sfull
    mbar_init(&bars[7], 4);    // sfree: one arrival per output warp
    mbar_init(&bars[8], 8);    // ufull
    mbar_init(&bars[9], 4);    // ufree
  }
  __syncthreads();
  // each role's whole code under its own register count (ptxas allocates a region below its
  // setmaxnreg with that count); both walk the same segment blocks (for_each_segment_block's
  // barriers, where it loops, are met by all 384 threads)
  uint32_t m_used = 0;
  if (threadIdx.x < 2 * 128) {
    setmaxnreg_inc<kOwgChainRegs>();
    uint32_t n_used = 0;
    for_each_segment_block<D>(p, false, [&](const SegmentBlock& b) {
      owg_chain_segment<In>(p, b, n_used, m_used);
    });
  } else {
    setmaxnreg_dec<kOwgOutRegs>();
    for_each_segment_block<D>(p, false, [&](const SegmentBlock& b) {
      owg_output_segment<In>(p, b, m_used);
    });
  }
}

}  // namespace cuda
}  // namespace flashgdn
