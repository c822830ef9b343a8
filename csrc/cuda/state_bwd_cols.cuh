// state_bwd_cols_kernel: the backward's reverse pass with the value columns as the rows of
// the tensor-core products (opt-in: FLASHGDN_BWD_COLS=1; state_fwd_cols.cuh's shape for the
// reverse recurrence, on TF32 like state_bwd_tc_kernel).
//
// grid (1 [x 2 in phase 1], H_v, segments or slots: for_each_segment_block), 256 threads
// (8 warps), ~216 KB smem, 1 block/SM.
// One block runs one segment (last chunk to first) of one sequence for all 128 value columns
// of one head; warp w owns the columns 16 w .. 16 w + 15 of dS^T (16 x 128, fp32
// accumulators) and never exchanges data with the other warps. Per chunk, going backwards:
//   KdS^T = dS^T K^T,  dU^T = scale dO^T P + KdS^T diag(e^{G_last - G}),  dVt^T = dU^T T,
//   dS^T <- e^{G_last} dS^T + (scale dO^T diag(e^G)) Q - (dVt^T diag(beta e^G)) K,
// the same algebra as state_bwd_tc_kernel (bwd_kernels.cuh), each accumulator feeding the
// next product as a paired-k tf32 A fragment from registers (mma.cuh). The next chunk's Q,
// K, dO (16-bit) and P, T (fp32) are copied by cp.async while the current one computes, and
// its per-token factors (scale e^G, -beta e^G, e^{G_last - G}, e^{G_last}) are formed from
// registers loaded a chunk ahead: one block barrier per chunk. Segments, warm-ups and phases
// as state_bwd_tc_kernel (phase 1: summaries of dS, on the identity with dO = 0).
//   reads  q, k, do, beta, G, T, P, dht, seg_in
//   writes dh (dS leaving each chunk) and dVt as fp16 record blocks with their factors
//          (mma.cuh: through a warp's staging, one bulk store a warp), dh0 (phase 0);
//          seg_L, seg_M (phase 1)
#pragma once

#include "bwd_kernels.cuh"

namespace flashgdn {
namespace cuda {

template <typename In>
struct StateBwdColsSmem {
  static constexpr size_t kStage =
      sizeof(In) * 3 * C * LDH + sizeof(float) * 2 * C * LDA + sizeof(float4) * C;
  // and each warp's staging of its records (mma.cuh)
  static constexpr size_t kBytes = 2 * kStage + (NT / 32) * kRecStageBytes;
};

// One segment block of state_bwd_cols_kernel (for_each_segment_block).
template <typename In>
__device__ __forceinline__ void state_bwd_cols_segment(const BwdParams& p, const SegmentBlock& b) {
  using SM = StateBwdColsSmem<In>;
  const int64_t h = b.h, hq = b.hq, z = b.z, n = b.n, start = b.start, len = b.len;
  const int64_t chunk0 = b.chunk0, c_begin = b.c_begin, c_end = b.c_end, j = b.j;
  const bool identity = b.identity;
  const int64_t c_last = b.ss.c_first;  // the pass runs chunks c_last down to c_begin
  const bool outputs = p.phase == 0;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Qst = [&](int s) { return reinterpret_cast<In*>(smem_raw + s * SM::kStage); };
  auto Kst = [&](int s) { return Qst(s) + C * LDH; };
  auto dOst = [&](int s) { return Kst(s) + C * LDH; };
  auto Pst = [&](int s) { return reinterpret_cast<float*>(dOst(s) + C * LDH); };
  auto Tst = [&](int s) { return Pst(s) + C * LDA; };
  auto Fst = [&](int s) { return reinterpret_cast<float4*>(Tst(s) + C * LDA); };
  const int warp = threadIdx.x >> 5, lane = lane_id();
  const int v0 = 16 * warp, tc = 2 * (lane & 3);
  __half* rec_stage = reinterpret_cast<__half*>(smem_raw + 2 * SM::kStage + warp * kRecStageBytes);

  // per-token factors of the chunk issued last (threads < C), stored after a step's work
  float g_pre = 0.f, gl_pre = 0.f, beta_pre = 0.f;
  auto issue = [&](int64_t ci, int s) {
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    cp_async_tile<C, D, LDH>(Qst(s), static_cast<const In*>(p.q) + (tok0 * p.Hqk + hq) * D,
                             p.Hqk * D, L);
    cp_async_tile<C, D, LDH>(Kst(s), static_cast<const In*>(p.k) + (tok0 * p.Hqk + hq) * D,
                             p.Hqk * D, L);
    if (!identity)  // the transition: dO = 0
      cp_async_tile<C, D, LDH>(dOst(s), static_cast<const In*>(p.d_o) + (tok0 * p.Hv + h) * D,
                               p.Hv * D, L);
    cp_async_tile<C, C, LDA>(Pst(s), p.Pmat + (tok0 * p.Hv + h) * C, p.Hv * C, L);
    cp_async_tile<C, C, LDA>(Tst(s), p.Tmat + (tok0 * p.Hv + h) * C, p.Hv * C, L);
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

  // dS^T: values v0 + (g, g + 8), keys 8 jn + (2t, 2t + 1); dS is stored [key][value]
  float ds[16][4];
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

  for (int64_t ci = c_last; ci >= c_begin; --ci) {
    const int s = static_cast<int>((c_last - ci) & 1);
    const int L = chunk_rows(len, ci);
    const bool out = outputs && ci < c_end;  // not a warm-up chunk
    cp_async_wait<0>();
    __syncthreads();  // stage s landed; stage s ^ 1 (the previous chunk) no longer read
    if (ci > c_begin) issue(ci - 1, s ^ 1);
    if (out && !(p.debug & 4)) {  // dh: dS leaving chunk ci, an fp16 record block
      const int64_t rec = (chunk0 + ci) * p.Hv + h;
      store_record_cols(reinterpret_cast<__half*>(record_at<D>(p.dh, rec, true)) + v0 * D,
                        p.dh_scale + rec * 8 + warp, ds, rec_stage);
    }
    const In* Q = Qst(s);
    const In* K = Kst(s);
    const float4* F = Fst(s);

    // KdS^T = dS^T K^T: 16 x 64 (token tiles nt), k = 128 keys
    float kd[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      uint32_t a[4];
      acc_to_a_tf32(a, ds[kk], 1.f, 1.f);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        uint32_t bk[2];
        frag_b(bk, K, LDH, 8 * nt, 8 * kk);  // B(key, token) = K[token][key]
        mma_tf32(kd[nt], a, bk);
      }
    }
    // dO^T as A fragments (k = tokens); zero for the transition
    uint32_t doa[8][4];
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      if (identity) {
        doa[ks][0] = doa[ks][1] = doa[ks][2] = doa[ks][3] = 0u;
      } else {
        frag_a_trans(doa[ks], dOst(s), LDH, v0, 8 * ks);
      }
    }
    // dU^T = scale dO^T P + KdS^T diag(e^{G_last - G}); P[r][s'] = 0 for s' > r
    float du[8][4] = {};
    {
      const float* P = Pst(s);
#pragma unroll
      for (int ns = 0; ns < 8; ++ns)
#pragma unroll
        for (int kr = ns; kr < 8; ++kr) {
          uint32_t bp[2];
          frag_b_kn_f32<false>(bp, P, LDA, 8 * ns, 8 * kr);  // P is tf32 already
          mma_tf32(du[ns], doa[kr], bp);
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
    // dVt^T = dU^T T; T[r][s] = 0 for s > r
    float dv[8][4] = {};
    {
      const float* T = Tst(s);
#pragma unroll
      for (int kr = 0; kr < 8; ++kr) {
        uint32_t a[4];
        acc_to_a_tf32(a, du[kr], 1.f, 1.f);
#pragma unroll
        for (int ns = 0; ns <= kr; ++ns) {
          uint32_t bt[2];
          frag_b_kn_f32<true>(bt, T, LDA, 8 * ns, 8 * kr);
          mma_tf32(dv[ns], a, bt);
        }
      }
    }
    if (out && !(p.debug & 8)) {  // dVt: a token record block
      const int64_t rec = (chunk0 + ci) * p.Hv + h;
      store_record_cols(reinterpret_cast<__half*>(record_at<C>(p.dVt, rec, true)) + v0 * C,
                        p.dVt_scale + rec * 8 + warp, dv, rec_stage);
    }
    // dS^T <- e^{G_last} dS^T + (scale dO^T diag(e^G)) Q - (dVt^T diag(beta e^G)) K
    {
      const float egl = F[C - 1].w;
#pragma unroll
      for (int jn = 0; jn < 16; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[jn][e] *= egl;
#pragma unroll
      for (int kr = 0; kr < 8; ++kr) {
        const float4 f0 = F[8 * kr + tc], f1 = F[8 * kr + tc + 1];
        uint32_t ax[4], ay[4];
        // doa holds exact tf32 values of dO (paired k: slots 0, 1 token 2t; 2, 3 token 2t + 1)
        ax[0] = __float_as_uint(round_tf32(__uint_as_float(doa[kr][0]) * f0.x));
        ax[1] = __float_as_uint(round_tf32(__uint_as_float(doa[kr][1]) * f0.x));
        ax[2] = __float_as_uint(round_tf32(__uint_as_float(doa[kr][2]) * f1.x));
        ax[3] = __float_as_uint(round_tf32(__uint_as_float(doa[kr][3]) * f1.x));
        acc_to_a_tf32(ay, dv[kr], f0.y, f1.y);
#pragma unroll
        for (int jn = 0; jn < 16; ++jn) {
          uint32_t bq[2], bk[2];
          frag_b_trans(bq, Q, LDH, 8 * jn, 8 * kr);  // B(token, key) = Q[token][key]
          frag_b_trans(bk, K, LDH, 8 * jn, 8 * kr);
          mma_tf32(ds[jn], ax, bq);
          mma_tf32(ds[jn], ay, bk);
        }
      }
    }
    if (ci > c_begin) store_factors(s ^ 1);  // chunk ci - 1's, loaded a step ago
  }

  // the dS leaving the segment: dh0 (the first segment), or this block's summary
  float* dst = nullptr;
  if (p.phase == 1) dst = (identity ? p.seg_M : p.seg_L) + (z * p.Hv + h) * D * D;
  else if (j == 0 && p.dh0) dst = p.dh0 + (n * p.Hv + h) * D * D;
  if (dst) store_state_cols(dst, ds, v0);
  if (lane == 0) bulk_wait();  // the records' bulk stores are complete
}

template <typename In>
__global__ void __launch_bounds__(NT, 1) state_bwd_cols_kernel(BwdParams p) {
  if (p.seqs.failed()) return;
  for_each_segment_block<D>(p, true, [&](const SegmentBlock& b) {
    state_bwd_cols_segment<In>(p, b);
  });
}

}  // namespace cuda
}  // namespace flashgdn
