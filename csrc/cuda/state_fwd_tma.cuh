// state_fwd_tma_kernel: the forward's 128-column pass (phases 0 and 1 of the plain forward)
// with its tiles loaded by TMA and every product on warpgroup tensor cores, in the shape of
// FlashInfer's Hopper forward (docs/perf-notes.md version 41; the shape measured first as
// bench/probe_tma_chain.cu). kWy 1 (the fused forward's WY warpgroup forming P) is the default
// phase-0 pass but on the overlapped schedule below 32 value heads (launch.cu cols_tma_wy,
// versions 44, 57); kWy 0, the plain pass, is opt-in (FLASHGDN_COLS_TMA=1), kWy 2 too (=4).
//
// grid as state_fwd_cols_kernel's (1 [x 2 in phase 1], H_v, segments or slots:
// for_each_segment_block), 384 threads (kWy 512, ~170 KB), ~150 KB smem (kStages = 3,
// FLASHGDN_COLS_STAGES=3: ~215 KB), one block an SM. Stages: the chunk's tiles, a ring of kStages.
// * Warpgroup 2 (72 registers) produces: for each chunk of the block's segments, once the
//   stage is free (empty[s]), one thread issues TMA loads (completing on landed[s]) of K and Q
//   ([64 tokens][128] as two 64 x 64 boxes: the inputs, bf16 or fp16, or wy's fp16 copies) and
//   V (the input dtype) into 128-byte-swizzled tiles; its warp's lanes then copy the chunk's
//   (e^G, e^{G_last - G}) pairs (rows past the chunk's end repeat its last row, as the
//   cp.async kernels do); the other three warps copy the lower block triangles of T diag(beta)
//   and P ([64][64] fp16: all wy stores where tri16) by cp.async into swizzled tiles whose
//   upper blocks they zeroed at the start, and once landed[s], with kq_bf16, convert K and Q
//   to fp16 in place; all 128 threads arrive on full[s].
// * Warpgroups 0 and 1 (216 registers) own value rows 0-63 and 64-127 of S^T in fp32
//   accumulators (warp w: rows 16 w + g, + 8, keys 8 j + 2t, + 1: state_fwd_cols_kernel's
//   layout, so load_state_cols / store_state_cols serve). Per chunk three wgmma groups, A from
//   registers (fp16), B through swizzled descriptors, the two warpgroups issuing their groups
//   in strict alternation (named barriers 1 and 2):
//     X^T = S^T K^T and Y^T = S^T Q^T (m64 n64 k128, K-major B);
//     U^T = (V^T - X^T diag(e^G)) (T diag(beta))^T (m64 n64 k64; V^T by ldmatrix.trans);
//     S^T <- e^{G_last} S^T + U^T diag(e^{G_last - G}) K (m64 n128 k64, K as MN-major B: the
//     same tile) and O^T = scale (Y^T diag(e^G) + U^T P^T) (m64 n64 k64).
//   Rows past a chunk's end hold whatever TMA read there (the next sequence's rows, or zeros
//   past the tensor's end): W'^T, U^T and U^T diag(e^{G_last - G}) are set to zero at those
//   token columns (selects, so that no value there reaches a valid one even as NaN), and O
//   rows past the end are not stored. Each warp releases the stage (empty[s]) after the
//   chunk's last group; O^T goes out through a staging tile per warpgroup, 16-byte rows.
// kSsY (FLASHGDN_COLS_TMA=3, two stages): Y = S^T (diag(e^G) Q)^T in the last group as an SS
// wgmma, from S^T's fp16 fragments staged by stmatrix in a swizzled tile of the warpgroup and
// the Q tile the producer scaled by e^G (plan item 1's first step: the state role then needs
// 168 registers, not 216; docs/perf-notes.md version 41; on H100 7-13% slower than =1).
// kWy (512 threads; docs/perf-notes.md plan item 1 and version 43): the fused forward. A fourth
// warpgroup (tma_wy, setmaxnreg kTmaWyRegs) forms per chunk, from the landed K and Q tiles,
// P = Dec . Q K^T (one wgmma group; mma.sync there slows the state warpgroups' wgmma) into the
// stage's P tile and converts bf16 K and Q to fp16 in place. kWy 1 (FLASHGDN_COLS_TMA=5, three
// stages): P only, from wy_lean_kernel's G (which runs before without Q K^T), the producer's
// warps 1-3 copying T diag(beta); H100: 5-17% faster than the default at 24+ value heads.
// kWy 2 (=4, two stages): also the chunk's G and beta from g and beta and T diag(beta) by
// wy_lean_kernel's inverse into the T tile (wy_gates_kernel before it), the producer's warp 0
// alone issuing loads; ~2x slower (the inverse on mma.sync). Both give the default's bits.
// Reproducible run to run (bench/repeat_check.py) and, at FLASHGDN_COLS_TMA=1, bit-identical to
// state_fwd_cols_kernel's outputs since the producer commits its cp.async group (a missing
// commit let full[s] complete before the last T / P rows landed: docs/perf-notes.md v43).
// The same segments, warm-ups, phases, identity blocks (phase 1's M: V = 0), sub-segment
// records and programmatic-dependent waits as state_fwd_cols_kernel. Where a block runs one
// segment (not looped, not kFlat), warp 4 looks it up under the set-up before the first
// barrier (lookup_segment_block: one warp's 32-way search) and every role reads it from shared
// memory after; before session 53 each role looked it up itself after the barrier, ~6-8 k
// cycles of dependent loads ahead of the first TMA issue (FLASHGDN_DEBUG & 4096 still does).
// kWy 2 was not reproducible run to run until session 53 (a missing barrier before the WY
// warpgroup's gate scan overwrote beta under a lagging warp's reads; tma_wy).
//   reads  k, q (kq_bf16) or Kh, Qh, v (TMA), Tv16, P16 (lower block triangles; kWy 1: Tv16,
//          G; kWy 2: g and beta instead), EG, initial state, seg_in
//   writes o, final state (phase 0); seg_L, seg_M, sub_L, sub_M (phase 1); kRec: h, U and
//          their factors (the backward's recomputation: fp16 record blocks, mma.cuh) instead
//          of o
#pragma once

#include "fwd_tma_wy.cuh"
#include "state_fwd_cols.cuh"
#include "state_fwd_tma_layout.cuh"
#include "wgmma.cuh"

namespace flashgdn {
namespace cuda {

// The producer warpgroup's part of one segment block, chunk ci into stage n % 2 (use n):
// warp 0 (lane 0) issues the TMA loads, which complete on landed[s], then its lanes copy the
// chunk's (e^G, e^{G_last - G}) pairs and arrive on full[s]; warps 1-3 copy the lower block
// triangles of T diag(beta) and P by cp.async into the swizzled tiles, and once landed[s]
// convert the bf16 K and Q tiles to fp16 in place (kq_bf16: elementwise, so the swizzle does
// not matter), wait for their copies, make their writes visible to the tensor cores' reads
// (fence.proxy.async) and arrive on full[s]. full[s] thus counts 128 arrivals.
// kWy 2: warps 1-3 have nothing to do (the WY warpgroup forms T diag(beta) and P and converts
// K and Q), and full[s] counts warp 0's 32 arrivals and the WY warpgroup's 128. kWy 1: they
// copy T diag(beta) only (the WY warpgroup forms P and converts), full[s] counts 128 + 128.
// kWy 3 (bf16): as kWy 1, and once the WY warpgroup has read K (named barrier 7, tma_wy) they
// convert K to fp16 in place while it forms P.
template <typename In, int kStages, bool kSsY, int kWy = 0>
__device__ __forceinline__ void tma_produce(const FwdParams& p, const TmaMaps& m,
                                            const SegmentBlock& b, uint32_t n0,
                                            unsigned char* base, uint64_t* full,
                                            uint64_t* empty, uint64_t* landed) {
  using Sm = StateFwdTmaSmem;
  const int lane = lane_id(), pw = (threadIdx.x >> 5) - 8;  // the warp in the warpgroup
  if (kWy == 2 && pw != 0) return;
  const bool want_o = p.phase == 0 && p.o != nullptr && !(p.debug & 1);
  const int h = static_cast<int>(b.h), hq = static_cast<int>(b.hq);
  for (int64_t ci = b.ss.c_first; ci < b.c_end; ++ci) {
    const uint32_t n = n0 + static_cast<uint32_t>(ci - b.ss.c_first);
    const int s = static_cast<int>(n % kStages);
    if (n >= kStages) mbar_wait(&empty[s], ((n / kStages) - 1) & 1);
    unsigned char* st = base + s * Sm::kStage;
    const int64_t tok0 = b.start + ci * C;
    const int L = chunk_rows(b.len, ci);
    const bool out = want_o && ci >= b.c_begin;
    if (pw == 0) {
      if (lane == 0) {
        const uint32_t bytes = 16384 + (out ? 16384 : 0) + (b.identity ? 0 : 16384);
        mbar_arrive_expect_tx(&landed[s], bytes);
        const int z = static_cast<int>(tok0);
        tma_load_3d(st + Sm::kOffK, &m.k, 0, hq, z, &landed[s]);
        tma_load_3d(st + Sm::kOffK + 8192, &m.k, 64, hq, z, &landed[s]);
        if (out) {
          tma_load_3d(st + Sm::kOffQ, &m.q, 0, hq, z, &landed[s]);
          tma_load_3d(st + Sm::kOffQ + 8192, &m.q, 64, hq, z, &landed[s]);
        }
        if (!b.identity) {
          tma_load_3d(st + Sm::kOffV, &m.v, 0, h, z, &landed[s]);
          tma_load_3d(st + Sm::kOffV + 8192, &m.v, 64, h, z, &landed[s]);
        }
      }
      // rows past the chunk's end repeat its last row (e^{G_last} of the chunk's last token)
      float2* E = reinterpret_cast<float2*>(st + Sm::kOffE);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = lane + 32 * half, rr = r < L ? r : L - 1;
        E[r] = p.EG[(tok0 + rr) * p.Hv + h];
      }
    } else {
      const int t = static_cast<int>(threadIdx.x) - 288;
      // T diag(beta) and P: their lower block triangle (what wy stores where tri16; the
      // blocks above stay the zeros written at the kernel's start), rows past the chunk's
      // end zero-filled
      auto copy_tri = [&](unsigned char* tile, const __half* src) {
        for (int i = t; i < 320; i += 96) {  // 16-byte pieces: 32, 64, 96, 128 a row block
          const int rb = i < 32 ? 0 : i < 96 ? 1 : i < 192 ? 2 : 3;
          const int base = 16 * rb * (rb + 1), per = 2 * (rb + 1);
          const int r = 16 * rb + (i - base) / per, cp = (i - base) % per;
          const __half* g = src + ((tok0 + r) * p.Hv + h) * C + 8 * cp;
          cp_async16(tile + swz128(r, 8 * cp), r < L ? g : src, r < L);
        }
      };
      copy_tri(st + Sm::kOffT, p.Tv16);
      if (out && kWy == 0) copy_tri(st + Sm::kOffP, p.P16);
      // a group of their own: cp.async.wait_group (below) waits only for committed groups,
      // and without this commit full[s] could complete while the last rows (60-63 of T and
      // P, issued last) were still in flight: docs/perf-notes.md version 43
      cp_async_commit();
      // kSsY: Q's rows times e^G (row r's e^G in Eq), for the state warpgroups' S^T Q^T
      float* Eq = reinterpret_cast<float*>(st + Sm::kOffE + 512);
      if (kSsY && out) {
        if (t < C) Eq[t] = p.EG[(tok0 + (t < L ? t : L - 1)) * p.Hv + h].x;
        named_bar_sync(5, 96);
      }
      if (kWy == 0) mbar_wait(&landed[s], (n / kStages) & 1);
      if (kSsY && out) {  // Q (the bf16 inputs or fp16), scaled by e^G, to fp16 in place
        auto scale_q = [&](auto tag) {
          using T = decltype(tag);
          for (int i = t; i < C * D / 8; i += 96) {
            unsigned char* piece = st + Sm::kOffQ + 16 * i;
            const float e = Eq[(i & 511) >> 3];  // two 8 KB halves of 8 pieces a row
            const uint4 raw = *reinterpret_cast<const uint4*>(piece);
            const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
            uint32_t o[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const float2 f = bits_to_float2(w[k], static_cast<const T*>(nullptr));
              o[k] = pack_half2(e * f.x, e * f.y);
            }
            *reinterpret_cast<uint4*>(piece) = make_uint4(o[0], o[1], o[2], o[3]);
          }
        };
        if (p.kq_bf16) scale_q(In{});
        else scale_q(__half{});  // wy's fp16 copies or the fp16 inputs
      }
      if (kWy == 0 && p.kq_bf16) {  // 96 threads, 16 KB a tile: 1024 pieces of 8 values
        tile_sw_to_half<In, 96>(st + Sm::kOffK, t);
        if (out && !kSsY) tile_sw_to_half<In, 96>(st + Sm::kOffQ, t);
      }
      if constexpr (kWy == 3) {  // K to fp16 once the WY warpgroup has read it (tma_wy)
        mbar_wait(&landed[s], (n / kStages) & 1);  // the tiles' bytes, seen by these threads
        named_bar_sync(7, 224);
        tile_sw_to_half<In, 96>(st + Sm::kOffK, t);
      }
      cp_async_wait<0>();
      fence_proxy_async();  // the conversions' and copies' writes, for the tensor cores' reads
    }
    mbar_arrive(&full[s]);
  }
}

// The alternation of the two state warpgroups' wgmma groups: warpgroup 0 waits on named
// barrier 1 before each group but its first, warpgroup 1 on barrier 2 before each; after
// committing a group each arrives on the other's barrier.
struct TmaIssueOrder {
  bool wg0;
  bool first = true;
  __device__ __forceinline__ void wait() {
    if (!wg0) named_bar_sync(2, 256);
    else if (!first) named_bar_sync(1, 256);
    first = false;
  }
  __device__ __forceinline__ void notify() const { named_bar_arrive(wg0 ? 2 : 1, 256); }
};


// One chunk of a state warpgroup (kOut: with outputs). s: the stage; L: the chunk's rows.
// kSsY (FLASHGDN_COLS_TMA=3): Y = S^T Q^T not beside X in the first group from S^T's
// registers, but in the last group from S^T's fp16 fragments staged in the warpgroup's tile
// St (stmatrix, 128-byte swizzle) against the Q tile the producer scaled by e^G: 32 fewer
// registers live through the chunk (ptxas: the state role without spills down to 168).
// u_rec (kRec's chunks past the warm-up, else null): U's token record block of this warp's
// value columns, with its factor at u_scale, through the warp's rec_stage (mma.cuh).
template <typename In, bool kOut, bool kSsY>
__device__ __forceinline__ void tma_chunk(const FwdParams& p, float (&sacc)[16][4],
                                          const unsigned char* st, TmaIssueOrder& order,
                                          bool identity, int L, uint64_t* empty_s, __half* Ost,
                                          int64_t tok0, int64_t h, unsigned char* St,
                                          __half* u_rec = nullptr, float* u_scale = nullptr,
                                          __half* rec_stage = nullptr) {
  constexpr bool kY1 = kOut && !kSsY;  // Y in the first group
  using Sm = StateFwdTmaSmem;
  const int warp = threadIdx.x >> 5, lane = lane_id();
  const int wg = warp >> 2, wq = warp & 3, t = lane & 3;
  const unsigned char* K = st + Sm::kOffK;
  const float2* E = reinterpret_cast<const float2*>(st + Sm::kOffE);
  auto valid = [&](int tok) { return tok < L; };

  uint32_t sa[8][4];
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) acc_to_a16(sa[kk], sacc[2 * kk], sacc[2 * kk + 1]);
  float x[8][4] = {}, y[8][4] = {};  // kSsY: y's registers live from the last group on
  order.wait();
  wgmma_fence();
  fence_acc(x);
  if constexpr (kY1) fence_acc(y);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    wgmma_rs_f16<64>(x, sa[kk], sw128_desc(K + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024),
                     kk > 0);
  if constexpr (kY1) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_rs_f16<64>(y, sa[kk],
                       sw128_desc(st + Sm::kOffQ + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024),
                       kk > 0);
  }
  wgmma_commit();
  order.notify();
  if constexpr (kSsY && kOut) {  // S^T's fp16 fragments into St while X runs
    const int mi = lane >> 3, rr = 16 * wq + (mi & 1) * 8 + (lane & 7);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      stmatrix_x4(St + swz128(rr, 16 * kk + (mi >> 1) * 8), sa[kk][0], sa[kk][1], sa[kk][2],
                  sa[kk][3]);
    fence_proxy_async();  // for the tensor cores' reads of St in the last group
  }
  wgmma_wait<0>();
  fence_acc(x);
  if constexpr (kY1) fence_acc(y);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) fence_frag(sa[kk]);

  // W'^T = V^T - X^T diag(e^G), zero at token columns past the chunk's end. V^T's A
  // fragments by ldmatrix.trans: matrix mi = lane / 8 holds value rows + 8 (mi & 1), tokens
  // + 8 (mi >> 1); lane's row address: token row, 16-byte piece of its 8 values.
  uint32_t wa[4][4];
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    uint32_t vf[4] = {0u, 0u, 0u, 0u};
    if (!identity) {
      const int mi = lane >> 3, r = lane & 7;
      const int tok = 16 * kt + 8 * (mi >> 1) + r, vc = 64 * wg + 16 * wq + 8 * (mi & 1);
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(vf[0]), "=r"(vf[1]), "=r"(vf[2]), "=r"(vf[3])
                   : "r"(smem_addr(st + Sm::kOffV + swz128(tok, vc))));
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int j = 2 * kt + hf, c0 = 8 * j + 2 * t;
      const float e0 = E[c0].x, e1 = E[c0 + 1].x;
      const float2 lo = bits_to_float2(vf[2 * hf], static_cast<const In*>(nullptr));
      const float2 hi = bits_to_float2(vf[2 * hf + 1], static_cast<const In*>(nullptr));
      const bool ok0 = valid(c0), ok1 = valid(c0 + 1);
      wa[kt][2 * hf] = pack_half2(ok0 ? lo.x - e0 * x[j][0] : 0.f, ok1 ? lo.y - e1 * x[j][1] : 0.f);
      wa[kt][2 * hf + 1] =
          pack_half2(ok0 ? hi.x - e0 * x[j][2] : 0.f, ok1 ? hi.y - e1 * x[j][3] : 0.f);
    }
  }

  float u[8][4] = {};
  order.wait();
  wgmma_fence();
  fence_acc(u);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt)
    wgmma_rs_f16<64>(u, wa[kt], sw128_desc(st + Sm::kOffT + kt * 32, 16, 1024), kt > 0);
  wgmma_commit();
  order.notify();
  wgmma_wait<0>();
  fence_acc(u);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) fence_frag(wa[kt]);
  // U (zero at token columns past the end: W'^T is, and T's rows there are zero-filled)
  if (u_rec != nullptr) store_record_cols(u_rec, u_scale, u, rec_stage);

  // U^T and U^T diag(e^{G_last - G}) as A fragments, zero at token columns past the end
  uint32_t ua[4][4], ue[4][4];
#pragma unroll
  for (int kt = 0; kt < 4; ++kt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int j = 2 * kt + hf, c0 = 8 * j + 2 * t;
      const bool ok0 = valid(c0), ok1 = valid(c0 + 1);
      const float l0 = E[c0].y, l1 = E[c0 + 1].y;
      ua[kt][2 * hf] = pack_half2(ok0 ? u[j][0] : 0.f, ok1 ? u[j][1] : 0.f);
      ua[kt][2 * hf + 1] = pack_half2(ok0 ? u[j][2] : 0.f, ok1 ? u[j][3] : 0.f);
      ue[kt][2 * hf] = pack_half2(ok0 ? l0 * u[j][0] : 0.f, ok1 ? l1 * u[j][1] : 0.f);
      ue[kt][2 * hf + 1] = pack_half2(ok0 ? l0 * u[j][2] : 0.f, ok1 ? l1 * u[j][3] : 0.f);
    }
  const float egl = E[C - 1].x;
#pragma unroll
  for (int jn = 0; jn < 16; ++jn)
#pragma unroll
    for (int e = 0; e < 4; ++e) sacc[jn][e] *= egl;
  if constexpr (kY1) scale_by_eg(y, E);
  if constexpr (kSsY && kOut) named_bar_sync(3 + wg, 128);  // St complete (all four warps)
  order.wait();
  wgmma_fence();
  fence_acc(sacc);
  fence_acc(y);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt)
    wgmma_rs_f16<128, true>(sacc, ue[kt], sw128_desc(K + kt * 2048, 8192, 1024), true);
  if constexpr (kSsY && kOut) {  // Y = S^T (diag(e^G) Q)^T, both operands in shared memory
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_ss_n64(y, sw128_desc(St + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024),
                   sw128_desc(st + Sm::kOffQ + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024),
                   kk > 0);
  }
  if constexpr (kOut) {
#pragma unroll
    for (int kt = 0; kt < 4; ++kt)
      wgmma_rs_f16<64>(y, ua[kt], sw128_desc(st + Sm::kOffP + kt * 32, 16, 1024), true);
  }
  wgmma_commit();
  order.notify();
  wgmma_wait<0>();
  fence_acc(sacc);
  fence_acc(y);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    fence_frag(ue[kt]);
    fence_frag(ua[kt]);
  }
  __syncwarp();
  if (lane == 0) mbar_arrive(empty_s);  // this warp's reads of the stage are done

  if constexpr (kOut) {  // O^T -> staging [token][64 values] -> 16-byte rows of o
    named_bar_sync(3 + wg, 128);  // the previous chunk's staging read back
    const int mi = lane >> 3, i = lane & 7;
    const float sc = p.scale;
    __half* ost = Ost + 16 * wq;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
      stmatrix_x4_trans(ost + (16 * nt + (mi >> 1) * 8 + i) * Sm::kLdo + (mi & 1) * 8,
                        pack_in2<In>(sc * y[2 * nt][0], sc * y[2 * nt][1]),
                        pack_in2<In>(sc * y[2 * nt][2], sc * y[2 * nt][3]),
                        pack_in2<In>(sc * y[2 * nt + 1][0], sc * y[2 * nt + 1][1]),
                        pack_in2<In>(sc * y[2 * nt + 1][2], sc * y[2 * nt + 1][3]));
    named_bar_sync(3 + wg, 128);
    In* dst = static_cast<In*>(p.o) + h * D + 64 * wg;
    const int wt = static_cast<int>(threadIdx.x) - 128 * wg;
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int piece = wt + 128 * it, r = piece >> 3, c = (piece & 7) * 8;
      if (r < L)
        st_global_16(dst + (tok0 + r) * p.Hv * D + c,
                     *reinterpret_cast<const uint4*>(Ost + r * Sm::kLdo + c));
    }
  }
}

// A state warpgroup's part of one segment block. kRec (the backward's recomputation, p.h
// set, phase 0): the state entering every chunk past the warm-up and its U as fp16 record
// blocks, each warp its 16 value columns (state_fwd_cols_kernel's records, its layout).
template <typename In, int kStages, bool kSsY, bool kRec = false>
__device__ __forceinline__ void tma_consume(const FwdParams& p, const SegmentBlock& b,
                                            uint32_t n0, unsigned char* base, uint64_t* full,
                                            uint64_t* empty, TmaIssueOrder& order) {
  using Sm = StateFwdTmaSmem;
  const int warp = threadIdx.x >> 5;
  const int v0 = 16 * warp;
  const bool want_o = p.phase == 0 && p.o != nullptr && !(p.debug & 1);
  const bool record = kRec && p.phase == 0 && p.h != nullptr;
  __half* rec_stage =
      kRec ? reinterpret_cast<__half*>(base + Sm::rec(kStages) + warp * kRecStageBytes) : nullptr;
  __half* Ost =
      reinterpret_cast<__half*>(base + Sm::ost(kStages, kSsY)) + (warp >> 2) * C * Sm::kLdo;
  unsigned char* St = base + Sm::s_tiles(kStages) + (warp >> 2) * 16384;  // kSsY only
  float sacc[16][4];
  if (b.ss.src == SegSource::Exact) pdl_wait();  // as in state_fwd_cols_segment
  // The entering state's loads (64 KB a block, from every SM at once) wait until the first
  // chunk's tiles have landed, so that they do not queue ahead of the producer's dependent
  // loads (its segment lookup) and the tiles. Measured (docs/perf-notes.md version 52): the
  // same bits, 0-2% faster on CP rows, neutral on the many-sequence ones; the block's first
  // chunk (~20 us, its timeline in the notes) waits on something else. FLASHGDN_DEBUG & 2048:
  // at once, as before.
  if (b.ss.c_first < b.c_end && !(p.debug & 2048)) {
    uint64_t* landed = full + 2 * kStages;
    mbar_wait(&landed[n0 % kStages], (n0 / kStages) & 1);
  }
  load_state_cols(sacc, entering_state(p, b), b.identity, v0);
  for (int64_t ci = b.ss.c_first; ci < b.c_end; ++ci) {
    if (ci + 1 == b.c_end) pdl_trigger();
    const uint32_t n = n0 + static_cast<uint32_t>(ci - b.ss.c_first);
    const int s = static_cast<int>(n % kStages);
    mbar_wait(&full[s], (n / kStages) & 1);
    if (float* dst = sub_record(p, b, ci)) store_state_cols(dst, sacc, v0);
    const unsigned char* st = base + s * Sm::kStage;
    const int64_t tok0 = b.start + ci * C;
    const int L = chunk_rows(b.len, ci);
    if (kRec && record && ci >= b.c_begin) {  // the state entering chunk ci, then (in tma_chunk) U
      const int64_t rec = (b.chunk0 + ci) * p.Hv + b.h;
      if (!(p.debug & 4))
        store_record_cols(reinterpret_cast<__half*>(record_at<D>(p.h, rec, true)) + v0 * D,
                          p.h_scale + rec * 8 + warp, sacc, rec_stage);
      __half* u_rec = p.debug & 8 ? nullptr
                                  : reinterpret_cast<__half*>(record_at<C>(p.U, rec, true)) + v0 * C;
      tma_chunk<In, false, kSsY>(p, sacc, st, order, b.identity, L, &empty[s], Ost, tok0, b.h,
                                 St, u_rec, p.U_scale + rec * 8 + warp, rec_stage);
    } else if (want_o && ci >= b.c_begin)
      tma_chunk<In, true, kSsY>(p, sacc, st, order, b.identity, L, &empty[s], Ost, tok0, b.h,
                                St);
    else
      tma_chunk<In, false, kSsY>(p, sacc, st, order, b.identity, L, &empty[s], Ost, tok0, b.h,
                                 St);
  }
  if (float* dst = leaving_state(p, b)) store_state_cols(dst, sacc, v0);
  if (kRec && lane_id() == 0) bulk_wait();  // the records' bulk stores are complete
}

// kWy: 0 (FLASHGDN_COLS_TMA=1, 3), 2 (=4: T diag(beta) and P formed by the WY warpgroup),
// 1 (=5: P only), 3 (kWy 1 on bf16 inputs with K converted by the producer's warps 1-3:
// FLASHGDN_TMA_KCONV=1, opt-in; tested, measured neutral in session 54). kFlat (kWy 1,
// looped phase 0 without the host's slot count: grid y = 1, the slots walk every head's
// segments; for_each_segment_block).
// kRec (the backward's recomputation without outputs, launch.cu tma_record_pass; the default,
// FLASHGDN_REC_TMA=0 state_fwd_cols_kernel's instead): the plain pass (kWy 0, two stages)
// recording the state entering every chunk and U (tma_consume), ~197 KB smem.
template <typename In, int kStages = 2, bool kSsY = false, int kWy = 0, bool kFlat = false,
          bool kRec = false>
__global__ void __launch_bounds__(kWy ? kTmaWyThreads : kTmaThreads, 1)
    state_fwd_tma_kernel(const __grid_constant__ TmaMaps maps, FwdParams p) {
  static_assert(!kRec || (kWy == 0 && kStages == 2 && !kSsY && !kFlat),
                "kRec: the plain pass, two stages");
  static_assert(!kWy || (kStages == (kWy == 2 ? 2 : 3) && !kSsY),
                "kWy 2: two stages, 1 and 3: three; Y from registers");
  static_assert(kWy != 3 || !std::is_same<In, __half>::value, "kWy 3: bf16 inputs (K converted)");
  static_assert(!kFlat || kWy == 1, "the flat walk: kWy 1 only");
  PdlCompletion pdl_completion;  // as in state_fwd_cols_kernel
  if (pass_skipped<D>(p)) return;
  using Sm = StateFwdTmaSmem;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // 1024-byte aligned (the swizzled tiles) by an offset from smem_raw, not by rounding the
  // address as an integer: a pointer derived from smem_raw keeps its shared state space, so
  // the roles' accesses through base compile to LDS / STS rather than generic LD / ST (kWy 1:
  // the state warpgroups' 86 generic loads and 39 spill accesses gone, the WY warpgroup's
  // stores STS). kWy 2 keeps the rounded generic address: with LDS / STS ptxas serializes
  // every wgmma of that instantiation (C7512) at each register split tried.
  unsigned char* base;
  if constexpr (kWy == 2) {
    base = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  } else {
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    base = smem_raw + ((1024u - (raw & 1023u)) & 1023u);
  }
  uint64_t* full = reinterpret_cast<uint64_t*>(base + Sm::bars(kStages));
  uint64_t* empty = full + kStages;
  uint64_t* landed = full + 2 * kStages;
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      // the producer's (kWy 2: warp 0's) and the WY's arrivals
      mbar_init(&full[s], kWy == 2 ? 32 + 128 : kWy != 0 ? 256 : 128);
      mbar_init(&empty[s], 8);    // one arrival a state warp
      mbar_init(&landed[s], 1);   // the TMA issue (its bytes expected)
    }
    fence_mbar_init();
  }
  if (warp > 8 && warp < 12) {  // the blocks of T diag(beta) and P above their diagonal: zero
    // for good (the copies and stores of the lower blocks come after the barrier below)
    const int t = static_cast<int>(threadIdx.x) - 288;
    for (int i = t; i < kStages * 2 * 512; i += 96) {  // 2 tiles a stage, 512 pieces each
      const int r = (i & 511) >> 3, cp = i & 7;  // row, 16-byte piece of the row
      if (cp < 2 * (r / 16 + 1)) continue;       // at or below the block diagonal
      unsigned char* tile =
          base + (i >> 10) * Sm::kStage + Sm::kOffT + ((i >> 9) & 1) * (Sm::kOffP - Sm::kOffT);
      *reinterpret_cast<uint4*>(tile + swz128(r, 8 * cp)) = make_uint4(0u, 0u, 0u, 0u);
    }
    fence_proxy_async();
  }
  // the block's segment, looked up by warp 4 under the set-up above (lookup_ahead), read by
  // every role after the barrier
  __shared__ PreSegmentBlock pre_block;
  const bool ahead = !kFlat && lookup_ahead(p);
  if (ahead && warp == 4) lookup_segment_block<D>(p, false, &pre_block);
  const PreSegmentBlock* pre = ahead ? &pre_block : nullptr;
  __syncthreads();
  // the roles as separate code (ptxas then gives each its setmaxnreg budget); their segment
  // walks meet at for_each_segment_block's barriers between looped items
  uint32_t n_used = 0;
  // Programmatic dependents are released by the state warps at their last chunk only (the
  // producer once triggered after its loads; version 41's differences with it were most
  // likely the missing cp.async commit of version 43, but the late trigger costs nothing).
  if (kWy && warp >= 12) {
    setmaxnreg_dec<tma_wy_regs(kWy, 2)>();
    for_each_segment_block<D, kFlat>(p, false, [&](const SegmentBlock& b) {
      tma_wy<In, kStages, kWy == 2, kWy == 3>(p, b, n_used, base, full, landed);
      if (b.ss.c_first < b.c_end) n_used += static_cast<uint32_t>(b.c_end - b.ss.c_first);
    }, pre);
  } else if (warp >= 8) {
    setmaxnreg_dec<kWy ? tma_wy_regs(kWy, 1) : kTmaProducerRegs>();
    for_each_segment_block<D, kFlat>(p, false, [&](const SegmentBlock& b) {
      tma_produce<In, kStages, kSsY, kWy>(p, maps, b, n_used, base, full, empty, landed);
      if (b.ss.c_first < b.c_end) n_used += static_cast<uint32_t>(b.c_end - b.ss.c_first);
    }, pre);
  } else {
    setmaxnreg_inc<kWy ? tma_wy_regs(kWy, 0) : kTmaStateRegs>();
    TmaIssueOrder order{warp < 4};
    for_each_segment_block<D, kFlat>(p, false, [&](const SegmentBlock& b) {
      tma_consume<In, kStages, kSsY, kRec>(p, b, n_used, base, full, empty, order);
      if (b.ss.c_first < b.c_end) n_used += static_cast<uint32_t>(b.c_end - b.ss.c_first);
    }, pre);
    // warpgroup 1's last arrival on barrier 1 taken, so the barrier is empty at exit
    if (order.wg0 && !order.first) named_bar_sync(1, 256);
  }
}

}  // namespace cuda
}  // namespace flashgdn
