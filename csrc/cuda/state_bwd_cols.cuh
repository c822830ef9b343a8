// state_bwd_cols_kernel: the backward's reverse pass with the value columns as the rows of
// the tensor-core products (state_fwd_cols.cuh's shape for the reverse recurrence), on fp16
// m16n8k16 mma with fp32 accumulators; where launch.cu's bwd_cols says (planner.h
// backward_cols, FLASHGDN_BWD_COLS), else state_bwd_tc_kernel at 16 / 32 columns (TF32).
//
// grid (1 [x 2 in phase 1], H_v, segments or slots: for_each_segment_block), 256 threads
// (8 warps), ~188 KB smem, 1 block/SM.
// One block runs one segment (last chunk to first) of one sequence for all 128 value columns
// of one head; warp w owns the columns 16 w .. 16 w + 15 of dS^T (16 x 128, fp32
// accumulators) and never exchanges data with the other warps. Per chunk, going backwards:
//   KdS^T = dS^T K^T,  dU^T = scale dO^T P + KdS^T diag(e^{G_last - G}),  dVt^T = dU^T T,
//   dS^T <- e^{G_last} dS^T + (scale dO^T diag(e^G)) Q - (dVt^T diag(beta e^G)) K,
// the same algebra as state_bwd_tc_kernel (bwd_kernels.cuh), each accumulator feeding the
// next product as an fp16 A fragment from registers. Every row of these products is one
// value column and the recurrence is linear in (dS, dO), so a warp keeps dS^T times a power
// of two 2^e of its own (dS_sc = 2^e dS^T) and re-chooses e each chunk from the largest
// magnitudes of dS_sc and of the chunk's dO, putting the larger in [2^5, 2^6): every fp16
// operand then keeps fp16's 11 bits (as TF32) down to 2^-19 of it, with 2^10 of headroom
// below 65504 for the sums in dU and dVt, for any scale of the loss. The new factor costs
// nothing in the state update (e^{G_last} 2^d in one multiply). B operands by ldmatrix: K, Q fp16 (the inputs, or wy_kernel's fp16
// copies of bf16 ones), P and T (wy_kernel's fp16 copies, BwdParams::P16, T16). The next
// chunk's tiles are copied by cp.async while the current one computes, and its per-token
// factors (scale e^G, -beta e^G, e^{G_last - G}, e^{G_last}) are formed from registers
// loaded a chunk ahead: one block barrier per chunk. Segments, warm-ups and phases as
// state_bwd_tc_kernel (phase 1: summaries of dS, on the identity with dO = 0).
//   reads  Kh, Qh, do, beta, G, T16, P16, dht, seg_in
//   writes dh (dS leaving each chunk) and dVt as fp16 record blocks with their factors
//          (mma.cuh: through a warp's staging, one bulk store a warp), dh0 (phase 0);
//          seg_L, seg_M (phase 1); with the ready queue (kSignal, phase 0) rq_count,
//          rq_slot, rq_ends (BwdParams): each (chunk, q/k head) once its records are complete
#pragma once

#include "bwd_kernels.cuh"

namespace flashgdn {
namespace cuda {

template <typename In>
struct StateBwdColsSmem {
  static constexpr int LDP = C + 8;  // [C][LDP] T, P (fp16): rows 144 B apart
  static constexpr size_t kStage =
      sizeof(__half) * (3 * C * LDH + 2 * C * LDP) + sizeof(float4) * C;
  // and each warp's staging of its records (mma.cuh)
  static constexpr size_t kBytes = 2 * kStage + (NT / 32) * kRecStageBytes;
};

// The larger magnitude of the two 16-bit values (bf16 or fp16 bits, sign bits cleared) of m,
// as a float.
template <typename In>
__device__ __forceinline__ float abs16_pair_max(uint32_t m) {
  const uint32_t top = max(m >> 16, m & 0xffffu);
  if constexpr (std::is_same_v<In, __nv_bfloat16>) return __uint_as_float(top << 16);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(top)));
}
// The largest magnitude of a warp's 16-bit fragments x (bf16 or fp16 bits), as a float.
template <typename In, int N>
__device__ __forceinline__ float warp_amax16(const uint32_t (&x)[N][4]) {
  uint32_t m = 0u;
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) m = __vmaxu2(m, x[j][i] & 0x7fff7fffu);
  const float f = abs16_pair_max<In>(m);
  return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(f)));
}
// kRow: the largest magnitudes of rows g (m[0]) and g + 8 (m[1]) of a warp's m16 A
// fragments of 16-bit values (a0, a2: row g; a1, a3: row g + 8), and of its m16n8 fp32
// accumulator tiles (elements 0, 1: row g; 2, 3: row g + 8); a row lies in a quad's 4 lanes.
__device__ __forceinline__ void quad_max(float (&m)[2]) {
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    m[0] = fmaxf(m[0], __shfl_xor_sync(0xffffffffu, m[0], o));
    m[1] = fmaxf(m[1], __shfl_xor_sync(0xffffffffu, m[1], o));
  }
}
template <typename In, int N>
__device__ __forceinline__ void row_amax16(const uint32_t (&x)[N][4], float (&m)[2]) {
  uint32_t a = 0u, b = 0u;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    a = __vmaxu2(a, __vmaxu2(x[j][0] & 0x7fff7fffu, x[j][2] & 0x7fff7fffu));
    b = __vmaxu2(b, __vmaxu2(x[j][1] & 0x7fff7fffu, x[j][3] & 0x7fff7fffu));
  }
  m[0] = abs16_pair_max<In>(a);
  m[1] = abs16_pair_max<In>(b);
  quad_max(m);
}
template <int NJ>
__device__ __forceinline__ void row_amax(const float (&x)[NJ][4], float (&m)[2]) {
  m[0] = m[1] = 0.f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    m[0] = fmaxf(m[0], fmaxf(fabsf(x[j][0]), fabsf(x[j][1])));
    m[1] = fmaxf(m[1], fmaxf(fabsf(x[j][2]), fabsf(x[j][3])));
  }
  quad_max(m);
}
// kRow: the largest magnitude over the warp of rows whose values are x times back[row].
__device__ __forceinline__ unsigned warp_amax_rows(const float (&m)[2], const float (&back)[2]) {
  return __reduce_max_sync(0xffffffffu, __float_as_uint(fmaxf(m[0] * back[0], m[1] * back[1])));
}

// 2^k as a float, k in [-126, 127].
__device__ __forceinline__ float exp2i(int k) { return __int_as_float((127 + k) << 23); }

// The change d of the warp's exponent e (dS_sc = 2^e dS^T) that puts the larger of dS_sc's
// largest magnitude (ms, scaled) and the chunk's dO's (mo, unscaled) in [2^5, 2^6); 0 when
// both are zero (or subnormal). e + d stays in [-120, 120].
__device__ __forceinline__ int bwd_scale_shift(float ms, float mo, int e) {
  const int bs = (__float_as_int(ms) >> 23) & 0xff;  // biased exponents: 0 for zero
  const int bo = (__float_as_int(mo) >> 23) & 0xff;
  const int b = max(bs, bo == 0 ? 0 : bo + e);
  if (b == 0) return 0;
  return min(max(132 - b, -120 - e), 120 - e);  // biased 132: [2^5, 2^6)
}

// One segment block of state_bwd_cols_kernel (for_each_segment_block). kRow (opt-in,
// FLASHGDN_BWD_ROWSCALE=1, tested, 1-2% slower): a power of two per value column (rows g
// and g + 8 of a thread each their own) instead of one per warp, so that a column far
// smaller than its 15 neighbours keeps its bits (bench/precision_study_bwd.py
// --reverse-pass, "f16row").
// kSignal (phase 0 with the ready queue, BwdParams::rq_count): chunk ci's records are
// counted into the queue at chunk ci - 2's start, when all but each warp's newest two bulk
// stores (chunk ci - 1's) are complete, and the last two after the segment's final wait:
// nothing in the chain waits for a store issued less than a chunk before. kSignal 1: lane 0
// of each warp counts its own (ready_signal); 2 (FLASHGDN_BWD_QUEUE=2): the lanes 0 make
// theirs visible before the chunk's block barrier and thread 0 counts the block's eight
// after it, one release atomic a chunk (ready_signal_block).
template <typename In, bool kRow, int kSignal>
__device__ __forceinline__ void state_bwd_cols_segment(const BwdParams& p, const SegmentBlock& b) {
  using SM = StateBwdColsSmem<In>;
  const int64_t h = b.h, hq = b.hq, z = b.z, n = b.n, start = b.start, len = b.len;
  const int64_t chunk0 = b.chunk0, c_begin = b.c_begin, c_end = b.c_end, j = b.j;
  const bool identity = b.identity;
  const int64_t c_last = b.ss.c_first;  // the pass runs chunks c_last down to c_begin
  const bool outputs = p.phase == 0;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Qst = [&](int s) { return reinterpret_cast<__half*>(smem_raw + s * SM::kStage); };
  auto Kst = [&](int s) { return Qst(s) + C * LDH; };
  auto dOst = [&](int s) { return reinterpret_cast<In*>(Kst(s) + C * LDH); };
  auto Pst = [&](int s) { return reinterpret_cast<__half*>(dOst(s) + C * LDH); };
  auto Tst = [&](int s) { return Pst(s) + C * SM::LDP; };
  auto Fst = [&](int s) { return reinterpret_cast<float4*>(Tst(s) + C * SM::LDP); };
  const int warp = threadIdx.x >> 5, lane = lane_id();
  const int v0 = 16 * warp, tc = 2 * (lane & 3);
  __half* rec_stage = reinterpret_cast<__half*>(smem_raw + 2 * SM::kStage + warp * kRecStageBytes);

  // per-token factors of the chunk issued last (threads < C), stored after a step's work
  float g_pre = 0.f, gl_pre = 0.f, beta_pre = 0.f;
  auto issue = [&](int64_t ci, int s) {
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    // the transition (phase 1's M, identity): dO = 0, so neither Q (the dO term of the state
    // update) nor P (dU's) is read, and none of dO, Q, P is loaded
    if (!identity) {
      cp_async_tile<C, D, LDH>(Qst(s), p.Qh + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
      cp_async_tile<C, D, LDH>(dOst(s), static_cast<const In*>(p.d_o) + (tok0 * p.Hv + h) * D,
                               p.Hv * D, L);
      cp_async_tile<C, C, SM::LDP>(Pst(s), p.P16 + (tok0 * p.Hv + h) * C, p.Hv * C, L);
    }
    cp_async_tile<C, D, LDH>(Kst(s), p.Kh + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    cp_async_tile<C, C, SM::LDP>(Tst(s), p.T16 + (tok0 * p.Hv + h) * C, p.Hv * C, L);
    cp_async_commit();
    if (threadIdx.x < C) {  // rows past the chunk's end: G_last, beta 0
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      g_pre = p.G[(tok0 + r) * p.Hv + h];
      gl_pre = p.G[(tok0 + L - 1) * p.Hv + h];
      beta_pre = threadIdx.x < L ? load_scalar(p.beta, p.beta_dtype, (tok0 + r) * p.Hv + h) : 0.f;
    }
  };
  auto store_factors = [&](int s) {
    if (threadIdx.x < C) {
      const float eg = __expf(g_pre);
      Fst(s)[threadIdx.x] = make_float4(p.scale * eg, -beta_pre * eg, __expf(gl_pre - g_pre),
                                        __expf(gl_pre));
    }
  };

  // dS_sc = 2^e dS^T: values v0 + (g, g + 8), keys 8 jn + (2t, 2t + 1); dS is stored
  // [key][value]
  float ds[16][4];
  constexpr int R1 = kRow ? 1 : 0;  // row g + 8's exponent: its own (kRow) or the warp's
  int e[2] = {0, 0};
  {
    const float* src = nullptr;
    if (b.ss.src == SegSource::H0 && p.dht) src = p.dht + (n * p.Hv + h) * D * D;
    if (p.phase == 0 && b.ss.src == SegSource::Exact) src = p.seg_in + (z * p.Hv + h) * D * D;
    load_state_cols(ds, src, identity, v0);
  }
  if (c_last >= c_begin) {
    issue(c_last, 0);
    store_factors(0);
  }

  // kSignal: the chunks whose records the block stored last (stored1) and the one before
  // (stored2), each counted once its bulk stores are complete; -1 none
  int64_t stored1 = -1, stored2 = -1;
  for (int64_t ci = c_last; ci >= c_begin; --ci) {
    const int s = static_cast<int>((c_last - ci) & 1);
    const bool out = outputs && ci < c_end;  // not a warm-up chunk
    if (kSignal == 2 && lane == 0 && stored2 >= 0) {  // before the barrier thread 0 counts after
      ready_stores_wait(p);
      if (!(p.debug & 16384)) fence_proxy_async_global();
    }
    cp_async_wait<0>();
    __syncthreads();  // stage s landed; stage s ^ 1 (the previous chunk) no longer read
    if (ci > c_begin) issue(ci - 1, s ^ 1);
    if (kSignal != 0) {
      if (stored2 >= 0) {
        if (kSignal == 2 && threadIdx.x == 0) ready_signal_block(p, chunk0 + stored2, hq);
        if (kSignal == 1 && lane == 0) {
          ready_stores_wait(p);
          ready_signal(p, chunk0 + stored2, hq);
        }
      }
      stored2 = stored1;
      stored1 = out ? ci : -1;
    }
    const __half* Q = Qst(s);
    const __half* K = Kst(s);
    const float4* F = Fst(s);

    // dO^T as raw 16-bit A fragments (k = tokens 16 kt ..); zero for the transition
    uint32_t dor[4][4];
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      if (identity) {
        dor[kt][0] = dor[kt][1] = dor[kt][2] = dor[kt][3] = 0u;
      } else {
        frag_a16_trans(dor[kt], reinterpret_cast<const __half*>(dOst(s)), LDH, v0, 16 * kt);
      }
    }
    // the new exponents (the warp's, or rows g and g + 8's): 2^d rescales dS_sc (folded
    // into its uses below)
    float ms[2], mo[2];
    unsigned ms_bits = 0u;
    if constexpr (kRow) {
      row_amax(ds, ms);
      row_amax16<In>(dor, mo);
    } else {
      ms_bits = warp_amax_bits(ds);
      ms[0] = __uint_as_float(ms_bits);
      mo[0] = warp_amax16<In>(dor);
    }
    float r[2], back_old[2], sig[2], back[2];
#pragma unroll
    for (int q = 0; q <= R1; ++q) {
      const int d = bwd_scale_shift(ms[q], mo[q], e[q]);
      r[q] = exp2i(d);
      back_old[q] = exp2i(-e[q]);
      e[q] += d;
      sig[q] = exp2i(e[q]);
      back[q] = exp2i(-e[q]);
    }
    if (out && !(p.debug & 4)) {  // dh: dS leaving chunk ci, an fp16 record block
      const int64_t rec = (chunk0 + ci) * p.Hv + h;
      __half* dst = reinterpret_cast<__half*>(record_at<D>(p.dh, rec, true)) + v0 * D;
      if constexpr (kRow)
        store_record_cols(dst, p.dh_scale + rec * 8 + warp, ds, rec_stage,
                          warp_amax_rows(ms, back_old), 1.f, back_old);
      else
        store_record_cols(dst, p.dh_scale + rec * 8 + warp, ds, rec_stage, ms_bits, back_old[0]);
    }

    // KdS^T = dS^T K^T: 16 x 64 (token tiles nt), k = 128 keys, A = dS_sc 2^d
    float kd[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      uint32_t a[4];
      acc_to_a16(a, ds[2 * kk], ds[2 * kk + 1], r[0], r[R1]);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b0[2], b1[2];
        frag_b16_pair(b0, b1, K, LDH, 16 * np, 16 * kk);  // B(key, token) = K[token][key]
        mma_f16(kd[2 * np], a, b0);
        mma_f16(kd[2 * np + 1], a, b1);
      }
    }
    // acc (16 x 64 over token tiles) += A (k step kt of 16 tokens) B, B(r, s) = M[r][s] for a
    // lower-triangular 64 x 64 token matrix M (P or T): the k step meets only tiles np <= kt
    auto tri_mma = [](float(&acc)[8][4], const uint32_t(&a)[4], const __half* M, int kt) {
#pragma unroll
      for (int np = 0; np <= kt; ++np) {
        uint32_t b0[2], b1[2];
        frag_b16_trans2(b0, b1, M, SM::LDP, 16 * np, 16 * kt);
        mma_f16(acc[2 * np], a, b0);
        mma_f16(acc[2 * np + 1], a, b1);
      }
    };
    // dU^T = scale dO^T P + KdS^T diag(e^{G_last - G}) (times 2^e); P[r][s'] = 0 for s' > r
    float du[8][4] = {};
    if (!identity) {
      const __half* P = Pst(s);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        uint32_t a[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = pair_to_float2(dor[kt][i], static_cast<const In*>(nullptr));
          const float sg = sig[(i & 1) ? R1 : 0];  // a1, a3: row g + 8
          a[i] = pack_half2(sg * f.x, sg * f.y);
        }
        tri_mma(du, a, P, kt);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float l0 = F[8 * nt + tc].z, l1 = F[8 * nt + tc + 1].z;
      du[nt][0] = p.scale * du[nt][0] + l0 * kd[nt][0];
      du[nt][1] = p.scale * du[nt][1] + l1 * kd[nt][1];
      du[nt][2] = p.scale * du[nt][2] + l0 * kd[nt][2];
      du[nt][3] = p.scale * du[nt][3] + l1 * kd[nt][3];
    }
    // dVt^T = dU^T T (times 2^e); T[r][s] = 0 for s > r
    float dv[8][4] = {};
    {
      const __half* T = Tst(s);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        uint32_t a[4];
        acc_to_a16(a, du[2 * kt], du[2 * kt + 1]);
        tri_mma(dv, a, T, kt);
      }
    }
    if (out && !(p.debug & 8)) {  // dVt: a token record block
      const int64_t rec = (chunk0 + ci) * p.Hv + h;
      __half* dst = reinterpret_cast<__half*>(record_at<C>(p.dVt, rec, true)) + v0 * C;
      if constexpr (kRow) {
        float mv[2];
        row_amax(dv, mv);
        store_record_cols(dst, p.dVt_scale + rec * 8 + warp, dv, rec_stage,
                          warp_amax_rows(mv, back), 1.f, back);
      } else {
        store_record_cols(dst, p.dVt_scale + rec * 8 + warp, dv, rec_stage, warp_amax_bits(dv),
                          back[0]);
      }
    }
    // dS_sc <- e^{G_last} 2^d dS_sc + (scale 2^e dO^T diag(e^G)) Q - (dVt^T diag(beta e^G)) K
    {
      const float egl[2] = {F[C - 1].w * r[0], F[C - 1].w * r[R1]};
#pragma unroll
      for (int jn = 0; jn < 16; ++jn)
#pragma unroll
        for (int q = 0; q < 4; ++q) ds[jn][q] *= egl[q < 2 ? 0 : 1];
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        // tokens 16 kt + tc (+1) for a0 / a1, + 8 for a2 / a3
        const float4 f0 = F[16 * kt + tc], f1 = F[16 * kt + tc + 1];
        const float4 f8 = F[16 * kt + tc + 8], f9 = F[16 * kt + tc + 9];
        uint32_t ay[4];
        ay[0] = pack_half2(f0.y * dv[2 * kt][0], f1.y * dv[2 * kt][1]);
        ay[1] = pack_half2(f0.y * dv[2 * kt][2], f1.y * dv[2 * kt][3]);
        ay[2] = pack_half2(f8.y * dv[2 * kt + 1][0], f9.y * dv[2 * kt + 1][1]);
        ay[3] = pack_half2(f8.y * dv[2 * kt + 1][2], f9.y * dv[2 * kt + 1][3]);
        uint32_t ax[4];
        if (!identity) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = pair_to_float2(dor[kt][i], static_cast<const In*>(nullptr));
            const float x0 = i < 2 ? f0.x : f8.x, x1 = i < 2 ? f1.x : f9.x;
            const float sg = sig[(i & 1) ? R1 : 0];
            ax[i] = pack_half2(sg * x0 * f.x, sg * x1 * f.y);
          }
        }
#pragma unroll
        for (int jp = 0; jp < 8; ++jp) {
          uint32_t bk0[2], bk1[2];
          frag_b16_trans2(bk0, bk1, K, LDH, 16 * jp, 16 * kt);  // B(token, key) = K[token][key]
          mma_f16(ds[2 * jp], ay, bk0);
          mma_f16(ds[2 * jp + 1], ay, bk1);
          if (!identity) {
            uint32_t bq0[2], bq1[2];
            frag_b16_trans2(bq0, bq1, Q, LDH, 16 * jp, 16 * kt);
            mma_f16(ds[2 * jp], ax, bq0);
            mma_f16(ds[2 * jp + 1], ax, bq1);
          }
        }
      }
    }
    if (ci > c_begin) store_factors(s ^ 1);  // chunk ci - 1's, loaded a step ago
  }

  // the dS leaving the segment: dh0 (the first segment), or this block's summary
  float* dst = nullptr;
  if (p.phase == 1) dst = (identity ? p.seg_M : p.seg_L) + (z * p.Hv + h) * D * D;
  else if (j == 0 && p.dh0) dst = p.dh0 + (n * p.Hv + h) * D * D;
  if (dst) {
    const float back[2] = {exp2i(-e[0]), exp2i(-e[R1])};
#pragma unroll
    for (int jn = 0; jn < 16; ++jn)
#pragma unroll
      for (int q = 0; q < 4; ++q) ds[jn][q] *= back[q < 2 ? 0 : 1];
    store_state_cols(dst, ds, v0);
  }
  if (lane == 0) bulk_wait();  // the records' bulk stores are complete
  if (kSignal == 1 && lane == 0) {
    if (stored2 >= 0) ready_signal(p, chunk0 + stored2, hq);
    if (stored1 >= 0) ready_signal(p, chunk0 + stored1, hq);
  }
  if (kSignal == 2) {
    if (lane == 0) fence_proxy_async_global();
    __syncthreads();
    if (threadIdx.x == 0) {
      if (stored2 >= 0) ready_signal_block(p, chunk0 + stored2, hq);
      if (stored1 >= 0) ready_signal_block(p, chunk0 + stored1, hq);
    }
  }
}

// kSignal: phase 0 with the ready queue (launch.cu bwd_queue): the gradients' kernel, its
// programmatic dependent, starts once every block has started, on the SMs left idle.
template <typename In, bool kRow = false, int kSignal = 0>
__global__ void __launch_bounds__(NT, 1) state_bwd_cols_kernel(BwdParams p) {
  if constexpr (kSignal != 0) pdl_trigger();
  if (p.seqs.failed()) return;
  for_each_segment_block<D>(p, true, [&](const SegmentBlock& b) {
    state_bwd_cols_segment<In, kRow, kSignal>(p, b);
  });
}

}  // namespace cuda
}  // namespace flashgdn
