// Backward kernels (docs/algorithm.md, "Backward"), fp32 SIMT. The forward quantities are
// recomputed first by wy_kernel (G, W, U0, T, P) and the forward's state pass
// (state_fwd_kernel with p.h set, context-parallel like the forward: h, the state entering
// every chunk, and U); then:
//
// state_bwd_kernel<BW>  grid (N, H_v, 128 / BW), 256 threads, <= 150 KB smem
//   Reverse sequential pass for BW value columns of one head, dS (128 x BW)
//   in shared memory, starting from dht (P and T come from wy_kernel):
//     dU  = scale P^T dO + diag(exp(G_last - G)) K dS,   dVt = T^T dU,
//     dS <- exp(G_last) dS + (scale diag(exp G) Q)^T dO - (diag(beta exp G) K)^T dVt.
//   reads  q, k, do, beta, G, T, P, dht    writes dh (dS leaving each chunk), dVt, dh0
//
// grad_chunk_kernel<kTc> grid (max_chunks, H_qk), 256 threads, ~213 KB smem
//   All input gradients of one chunk for the value heads of one q/k head (so
//   dq and dk of grouped heads are summed in registers, deterministically):
//   dv = beta dVt, dbeta, dg (reverse cumsum of dG), dq, dk.
//   reads  q, k, v, do, beta, G, U, dVt, h, dh    writes dq, dk, dv, dg, dbeta
#pragma once

#include <type_traits>

#include "common.cuh"
#include "fwd_kernels.cuh"

namespace flashgdn {
namespace cuda {

// SegParams: the segments of the reverse pass, the forward's plan walked last to first.
struct BwdParams : SegParams {
  float scale;
  const void *q, *k, *v, *beta, *d_o;
  int g_dtype, beta_dtype;
  const float* dht;   // [N, Hv, D, D] or null
  const float* G;     // [TT, Hv]
  const float* Tmat;  // [TT, Hv, C]
  const float* Pmat;  // [TT, Hv, C] (Q K^T) . Dec
  const float* U;     // [TT, Hv, D]
  const float* h;     // [max_chunks, Hv, D, D]
  float* dh;          // [max_chunks, Hv, D, D]
  float* dVt;         // [TT, Hv, D]
  float* dh0;         // [N, Hv, D, D] or null
  void *dq, *dk, *dv, *dg, *dbeta;
};

template <int BW>
constexpr size_t state_bwd_smem() {
  return sizeof(float) * (2 * C * LDD + 2 * C * LDC + (3 * C + D) * (BW + 1) + 4 * C);
}

template <typename In, int BW>
__global__ void __launch_bounds__(NT, 1) state_bwd_kernel(BwdParams p) {
  if (p.seqs.failed()) return;
  using CB = ColBlock<BW>;
  constexpr int LD = CB::LD, CN = CB::CN;
  const int64_t n = blockIdx.x, h = blockIdx.y, hq = h / (p.Hv / p.Hqk);
  const int vb = blockIdx.z * BW;
  extern __shared__ float smem[];
  float* Qs = smem;              // [C][LDD]
  float* Ks = Qs + C * LDD;      // [C][LDD]
  float* Ts = Ks + C * LDD;      // [C][LDC]
  float* Ps = Ts + C * LDC;      // [C][LDC]
  float* dOs = Ps + C * LDC;     // [C][LD]
  float* dUs = dOs + C * LD;     // [C][LD]
  float* dVs = dUs + C * LD;     // [C][LD]
  float* dSs = dVs + C * LD;     // [D][LD]
  float* Gs = dSs + D * LD;      // [C]
  float* eL = Gs + C;            // [C]
  float* gam = eL + C;           // [C]
  float* bs = gam + C;           // [C]

  const int64_t state_off = (n * p.Hv + h) * D * D;
  load_state_block<BW>(dSs, p.dht ? p.dht + state_off : nullptr, vb);
  const int64_t start = p.seqs.seq_start(n), len = p.seqs.seq_len(n);
  const int64_t chunk0 = p.seqs.first_chunk(n);
  const int64_t nchunks = (len + C - 1) / C;
  for (int64_t ci = nchunks - 1; ci >= 0; --ci) {
    const int64_t tok0 = start + ci * C;
    const int L = static_cast<int>(len - ci * C < C ? len - ci * C : C);
    __syncthreads();
    store_state_block<BW>(p.dh + ((chunk0 + ci) * p.Hv + h) * D * D, dSs, vb);
    load_chunk(Qs, static_cast<const In*>(p.q) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    load_chunk(Ks, static_cast<const In*>(p.k) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    load_rows(Ts, LDC, p.Tmat + (tok0 * p.Hv + h) * C, p.Hv * C, L, C, C);
    load_rows(Ps, LDC, p.Pmat + (tok0 * p.Hv + h) * C, p.Hv * C, L, C, C);
    load_rows(dOs, LD, static_cast<const In*>(p.d_o) + (tok0 * p.Hv + h) * D + vb, p.Hv * D, L,
              C, BW);
    if (threadIdx.x < C) {
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      Gs[threadIdx.x] = p.G[(tok0 + r) * p.Hv + h];
      bs[threadIdx.x] =
          threadIdx.x < L ? load_scalar(p.beta, p.beta_dtype, (tok0 + threadIdx.x) * p.Hv + h)
                          : 0.f;
    }
    __syncthreads();
    if (threadIdx.x < C) {
      eL[threadIdx.x] = __expf(Gs[C - 1] - Gs[threadIdx.x]);
      gam[threadIdx.x] = __expf(Gs[threadIdx.x]);
    }
    __syncthreads();
    {  // dU = scale P^T dO + eL K dS
      Tile<C, BW, 2, CN> a, b;
      a.zero();
      a.template mma<true, false, C>(Ps, LDC, dOs, LD);
      b.zero();
      b.template mma<false, false, D>(Ks, LDD, dSs, LD);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < CN; ++j) {
          const int r = a.row(i), c = a.col(j);
          dUs[r * LD + c] = p.scale * a.a[i][j] + eL[r] * b.a[i][j];
        }
    }
    __syncthreads();
    {  // dVt = T^T dU
      Tile<C, BW, 2, CN> t;
      t.zero();
      t.template mma<true, false, C>(Ts, LDC, dUs, LD);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < CN; ++j) {
          const int r = t.row(i), c = t.col(j);
          if (r < L) p.dVt[((tok0 + r) * p.Hv + h) * D + vb + c] = t.a[i][j];
          // scaled for the state update below
          dVs[r * LD + c] = -bs[r] * gam[r] * t.a[i][j];
          dOs[r * LD + c] *= p.scale * gam[r];
        }
    }
    __syncthreads();
    {  // dS <- exp(G_last) dS + Q^T (scale gam dO) - K^T (beta gam dVt)
      Tile<D, BW, 4, CN> st;
      st.zero();
      st.template mma<true, false, C>(Qs, LDD, dOs, LD);
      st.template mma<true, false, C>(Ks, LDD, dVs, LD);
      const float gl = __expf(Gs[C - 1]);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < CN; ++j) {
          float& s = dSs[st.row(i) * LD + st.col(j)];
          s = gl * s + st.a[i][j];
        }
    }
  }
  __syncthreads();
  if (p.dh0) store_state_block<BW>(p.dh0 + state_off, dSs, vb);
}

// ---------------------------------------------------------------------------------------
// state_bwd_tc_kernel<BW>  grid (128 / BW [x 2 in phase 1], H_v, segments), 256 threads,
//   ~210 KB smem (BW 32)
//   The reverse sequential pass of state_bwd_kernel on TF32 tensor cores (mma.cuh), laid
//   out as state_fwd_kernel: dS (128 x BW) in the accumulator registers of the 8 warps, a
//   tf32 copy of dS^T in shared memory, the previous chunk's Q, K, P, T, dO, G copied by
//   cp.async while the current one computes. Per chunk (last first):
//     dU = scale P^T dO + diag(eL) K dS,  dVt = T^T dU,
//     dS <- exp(G_last) dS + Q^T diag(scale gam) dO - K^T diag(beta gam) dVt.
//   Context parallelism as the forward's state pass, mirrored: dS <- M_c^T dS + (dO terms)
//   is affine with the transpose of the forward's chunk transition, so the same warm-up
//   bound holds. A segment's dS enters at its last chunk from dht (the last segment), from
//   a warm-up over the chunks after it, or exactly from seg_in; phase 1 forms the summaries
//   (L: the dS leaving the segment's first chunk from its own start; M: the pass on the
//   identity with dO = 0) that seg_combine_kernel chains last to first.
//   reads  q, k, do, beta, G, T, P, Lb, dht, seg_in
//   writes dh (dS leaving each chunk), dVt, dh0 (phase 0); seg_L, seg_M (phase 1)

template <typename In, int BW>
struct StateBwdSmem {
  static constexpr int LDO = BW + 8;  // dO tile [C][LDO] (ldmatrix rows 16 bytes apart mod 128)
  static constexpr size_t kStage =
      sizeof(In) * (2 * C * LDH + C * LDO) + sizeof(float) * (2 * C * LDA + C);
  static constexpr size_t kBytes = 2 * kStage + sizeof(float) * (BW * LDW + 4 * BW * LDA + C);
};

// A fragment of A(m, k) = X[k][m] from an fp32 tile X [k][m] (leading dimension ld).
__device__ __forceinline__ void frag_a_trans_f32(uint32_t (&a)[4], const float* x, int ld,
                                                 int m0, int k0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  const float* p0 = x + (k0 + 2 * t) * ld + m0 + g;
  a[0] = __float_as_uint(round_tf32(p0[0]));
  a[1] = __float_as_uint(round_tf32(p0[8]));
  a[2] = __float_as_uint(round_tf32(p0[ld]));
  a[3] = __float_as_uint(round_tf32(p0[ld + 8]));
}

template <typename In, int BW>
__global__ void __launch_bounds__(NT, 1) state_bwd_tc_kernel(BwdParams p) {
  static_assert(BW == 16 || BW == 32, "column block of 16 or 32");
  using SM = StateBwdSmem<In, BW>;
  constexpr int NJ = BW / 16, NS = BW / 8, LDO = SM::LDO, CBN = D / BW;
  if (p.seqs.failed() || !col_block_chosen<BW>(p)) return;
  const int64_t h = blockIdx.y, hq = h / (p.Hv / p.Hqk), z = blockIdx.z;
  int64_t n, j;
  if (!locate_segment(p, z, n, j)) return;
  const int64_t start = p.seqs.seq_start(n), len = p.seqs.seq_len(n);
  const int64_t nch = (len + C - 1) / C, chunk0 = p.seqs.first_chunk(n);
  const int64_t seg = seg_chunks(p);
  const int64_t c_begin = j * seg;
  if (j > 0 && c_begin >= nch) return;
  const int64_t c_end = c_begin + seg < nch ? c_begin + seg : nch;  // chunks [c_begin, c_end)

  // ---- where dS comes from (phase 0), or which summary this block forms (phase 1, for a
  // segment whose predecessor starts exactly from it: blocks x < D / BW the dS leaving the
  // segment from its own start, blocks x >= D / BW the columns of its transition, from I)
  const SegStart ss = segment_start(p, chunk0, nch, h, j, true);
  const int cb = static_cast<int>(blockIdx.x) % CBN, vb = cb * BW;
  bool identity = false;
  if (p.phase == 1) {
    if (j == 0) return;  // no predecessor
    if (segment_start(p, chunk0, nch, h, j - 1, true).src != SegSource::Exact) return;
    identity = static_cast<int>(blockIdx.x) >= CBN;
    if (identity && ss.src != SegSource::Exact) return;
  } else if (blockIdx.x >= CBN) {
    return;
  }
  const int64_t c_last = ss.c_first;  // the pass runs chunks c_last down to c_begin
  const bool outputs = p.phase == 0;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Qst = [&](int s) { return reinterpret_cast<In*>(smem_raw + s * SM::kStage); };
  auto Kst = [&](int s) { return Qst(s) + C * LDH; };
  auto dOst = [&](int s) { return Kst(s) + C * LDH; };
  auto Pst = [&](int s) { return reinterpret_cast<float*>(dOst(s) + C * LDO); };
  auto Tst = [&](int s) { return Pst(s) + C * LDA; };
  auto Gst = [&](int s) { return Tst(s) + C * LDA; };
  float* dSs = reinterpret_cast<float*>(smem_raw + 2 * SM::kStage);  // [BW][LDW] dS^T
  float* dOt = dSs + BW * LDW;  // [BW][LDA] dO^T
  float* Xt = dOt + BW * LDA;   // [BW][LDA] (scale gam dO)^T
  float* dUt = Xt + BW * LDA;   // [BW][LDA] dU^T
  float* Yt = dUt + BW * LDA;   // [BW][LDA] (-beta gam dVt)^T
  float* Bs = Yt + BW * LDA;    // [C] beta

  const int warp = threadIdx.x >> 5;
  const int m0 = 16 * (warp >> 1), n0 = (warp & 1) * (BW / 2);
  const In* qbase = static_cast<const In*>(p.q);
  const In* kbase = static_cast<const In*>(p.k);
  const In* dobase = static_cast<const In*>(p.d_o);
  float beta_pre = 0.f;  // beta of the chunk issued last (thread < C)

  auto issue = [&](int64_t ci, int s) {
    const int64_t tok0 = start + ci * C;
    const int L = static_cast<int>(len - ci * C < C ? len - ci * C : C);
    cp_async_tile<C, D, LDH>(Qst(s), qbase + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    cp_async_tile<C, D, LDH>(Kst(s), kbase + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    cp_async_tile<C, BW, LDO>(dOst(s), dobase + (tok0 * p.Hv + h) * D + vb, p.Hv * D, L);
    cp_async_tile<C, C, LDA>(Pst(s), p.Pmat + (tok0 * p.Hv + h) * C, p.Hv * C, L);
    cp_async_tile<C, C, LDA>(Tst(s), p.Tmat + (tok0 * p.Hv + h) * C, p.Hv * C, L);
    if (threadIdx.x < C) {
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      cp_async4(Gst(s) + threadIdx.x, p.G + (tok0 + r) * p.Hv + h);
      beta_pre = threadIdx.x < L ? load_scalar(p.beta, p.beta_dtype, (tok0 + threadIdx.x) * p.Hv + h)
                                 : 0.f;
    }
    cp_async_commit();
  };

  // dS registers (load_acc_state's layout)
  float sacc[NS][4];
  const int64_t state_off = (n * p.Hv + h) * D * D;
  {
    const float* src = nullptr;
    if (ss.src == SegSource::H0 && p.dht) src = p.dht + state_off;
    if (p.phase == 0 && ss.src == SegSource::Exact) src = p.seg_in + (z * p.Hv + h) * D * D;
    load_acc_state(sacc, src, vb, identity);
  }
  store_acc_state_smem_t(dSs, LDW, sacc);
  if (c_last >= c_begin) issue(c_last, 0);

  for (int64_t ci = c_last; ci >= c_begin; --ci) {
    const int s = static_cast<int>((c_last - ci) & 1);
    const int64_t tok0 = start + ci * C;
    const int L = static_cast<int>(len - ci * C < C ? len - ci * C : C);
    const bool out = outputs && ci < c_end;  // not a warm-up chunk
    cp_async_wait<0>();
    __syncthreads();  // stage s landed; every shared buffer of the previous chunk consumed
    if (threadIdx.x < C) Bs[threadIdx.x] = beta_pre;
    if (ci > c_begin) issue(ci - 1, s ^ 1);
    if (out)  // dh: dS leaving chunk ci
      store_acc_state(p.dh + ((chunk0 + ci) * p.Hv + h) * D * D, sacc, vb);
    const float* G = Gst(s);
    const float gl = G[C - 1];
    {  // dO^T and (scale gam dO)^T as fp32 B tiles
      const In* dO = dOst(s);
      for (int e = threadIdx.x; e < C * BW; e += NT) {
        const int r = e / BW, c = e % BW;
        const float x = identity ? 0.f : to_f(dO[r * LDO + c]);  // the transition: dO = 0
        dOt[c * LDA + r] = x;  // 16-bit values are exact tf32
        Xt[c * LDA + r] = round_tf32(p.scale * __expf(G[r]) * x);
      }
    }
    __syncthreads();

    // dU = scale P^T dO + diag(eL) K dS (P^T is upper triangular: k >= m0 only)
    float du[NJ][4] = {}, kd[NJ][4] = {};
    {
      const In* K = Kst(s);
      float kd2[NJ][4] = {};  // odd k steps: shorter dependent chains
#pragma unroll 2
      for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t a[4], a2[4];
        frag_a(a, K, LDH, m0, k0);
        frag_a(a2, K, LDH, m0, k0 + 8);
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          uint32_t b[2], b2[2];
          frag_b(b, dSs, LDW, n0 + 8 * jj, k0);
          frag_b(b2, dSs, LDW, n0 + 8 * jj, k0 + 8);
          mma_tf32(kd[jj], a, b);
          mma_tf32(kd2[jj], a2, b2);
        }
      }
      add_acc(kd, kd2);
      const float* P = Pst(s);
      for (int k0 = m0; k0 < C; k0 += 8) {
        uint32_t a[4];
        frag_a_trans_f32(a, P, LDA, m0, k0);
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          uint32_t b[2];
          frag_b(b, dOt, LDA, n0 + 8 * jj, k0);
          mma_tf32(du[jj], a, b);
        }
      }
    }
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + acc_row(e), c = n0 + 8 * jj + acc_col(e);
        dUt[c * LDA + r] = round_tf32(p.scale * du[jj][e] + __expf(gl - G[r]) * kd[jj][e]);
      }
    __syncthreads();

    // dVt = T^T dU (T^T upper triangular)
    {
      float dv[NJ][4] = {};
      const float* T = Tst(s);
      for (int k0 = m0; k0 < C; k0 += 8) {
        uint32_t a[4];
        frag_a_trans_f32(a, T, LDA, m0, k0);
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          uint32_t b[2];
          frag_b(b, dUt, LDA, n0 + 8 * jj, k0);
          mma_tf32(dv[jj], a, b);
        }
      }
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = m0 + acc_row(e), c = n0 + 8 * jj + acc_col(e);
          if (out && r < L)
            __stcg(reinterpret_cast<float2*>(p.dVt + ((tok0 + r) * p.Hv + h) * D + vb + c),
                   make_float2(dv[jj][e], dv[jj][e + 1]));
          const float bg = -Bs[r] * __expf(G[r]);
          Yt[c * LDA + r] = round_tf32(bg * dv[jj][e]);
          Yt[(c + 1) * LDA + r] = round_tf32(bg * dv[jj][e + 1]);
        }
    }
    __syncthreads();

    // dS <- exp(G_last) dS + Q^T X + K^T Y
    {
      const float eg = __expf(gl);
#pragma unroll
      for (int jn = 0; jn < NS; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[jn][e] *= eg;
      const In* Q = Qst(s);
      const In* K = Kst(s);
      float sb[NS][4] = {};  // K^T Y in its own accumulators: two dependent chains, not one
#pragma unroll 2
      for (int k0 = 0; k0 < C; k0 += 8) {
        uint32_t aq[4], ak[4];
        frag_a_trans(aq, Q, LDH, 16 * warp, k0);
        frag_a_trans(ak, K, LDH, 16 * warp, k0);
#pragma unroll
        for (int jn = 0; jn < NS; ++jn) {
          uint32_t bx[2], by[2];
          frag_b(bx, Xt, LDA, 8 * jn, k0);
          frag_b(by, Yt, LDA, 8 * jn, k0);
          mma_tf32(sacc[jn], aq, bx);
          mma_tf32(sb[jn], ak, by);
        }
      }
      add_acc(sacc, sb);
      store_acc_state_smem_t(dSs, LDW, sacc);
    }
  }
  // ---- the dS leaving the segment: dh0 (the first segment), or this block's summary
  float* dst = nullptr;
  if (p.phase == 1) dst = (identity ? p.seg_M : p.seg_L) + (z * p.Hv + h) * D * D;
  else if (j == 0 && p.dh0) dst = p.dh0 + state_off;
  if (dst) store_acc_state(dst, sacc, vb);
}

constexpr size_t kGradSmem =
    sizeof(float) * (5 * C * LDD + D * LDV + 2 * C * LDC + 8 * C + NT + 2 * C);

// kTc: the products on TF32 tensor cores (TcTile, mma.cuh), else fp32 FMA (Tile).
template <typename In, bool kTc>
__global__ void __launch_bounds__(NT, 1) grad_chunk_kernel(BwdParams p) {
  using T128 = std::conditional_t<kTc, TcTile<C, D>, Tile<C, D, 4, 8>>;  // C x D results
  using T64 = std::conditional_t<kTc, TcTile<C, C>, Tile<C, C, 4, 4>>;   // C x C results
  if (p.seqs.failed()) return;
  const ChunkRef ck = locate_chunk(p.seqs, blockIdx.x);
  if (ck.L == 0) return;
  const int64_t chunk = blockIdx.x, hq = blockIdx.y, group = p.Hv / p.Hqk;
  const int L = ck.L;
  const int64_t tok0 = ck.tok0;
  extern __shared__ float smem[];
  float* Qs = smem;             // [C][LDD]
  float* Ks = Qs + C * LDD;     // [C][LDD]
  float* dOs = Ks + C * LDD;    // [C][LDD]
  float* Us = dOs + C * LDD;    // [C][LDD]
  float* dVs = Us + C * LDD;    // [C][LDD]
  float* Xs = dVs + C * LDD;    // [D][LDV] quarter of h or dh; later E [C][LDC]
  float* M1 = Xs + D * LDV;     // [C][LDC]
  float* M2 = M1 + C * LDC;     // [C][LDC]
  float* Gs = M2 + C * LDC;     // [C]
  float* gam = Gs + C;
  float* eL = gam + C;
  float* bs = eL + C;
  float* dG = bs + C;
  float* db = dG + C;
  float* lastrow = db + C;
  float* red = lastrow + 2 * C;  // [NT]
  float* rs = red + NT;          // [2 C] row sums across warps (TcTile)
  static_assert(C * LDC <= D * LDV, "E must fit in the X buffer");

  load_chunk(Qs, static_cast<const In*>(p.q) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
  load_chunk(Ks, static_cast<const In*>(p.k) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);

  T128 dQ, dK;
  dQ.zero();
  dK.zero();
  for (int64_t h = hq * group; h < (hq + 1) * group; ++h) {
    __syncthreads();
    load_chunk(dOs, static_cast<const In*>(p.d_o) + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    load_chunk(Us, p.U + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    load_chunk(dVs, p.dVt + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    if (threadIdx.x < C) {
      const int r = threadIdx.x;
      Gs[r] = p.G[(tok0 + (r < L ? r : L - 1)) * p.Hv + h];
      bs[r] = r < L ? load_scalar(p.beta, p.beta_dtype, (tok0 + r) * p.Hv + h) : 0.f;
      dG[r] = 0.f;
      db[r] = 0.f;
    }
    __syncthreads();
    if (threadIdx.x < C) {
      gam[threadIdx.x] = __expf(Gs[threadIdx.x]);
      eL[threadIdx.x] = __expf(Gs[C - 1] - Gs[threadIdx.x]);
    }
    const float* S0 = p.h + (chunk * p.Hv + h) * D * D;
    const float* dSL = p.dh + (chunk * p.Hv + h) * D * D;

    {  // Y = dO S0^T, Z = dVt S0^T (over four 32-column quarters of S0)
      T128 Y, Z;
      Y.zero();
      Z.zero();
      for (int q4 = 0; q4 < D / BV; ++q4) {
        __syncthreads();
        for (int e = threadIdx.x; e < D * BV; e += NT) {
          const int r = e / BV, c = e % BV;
          Xs[r * LDV + c] = S0[r * D + q4 * BV + c];
        }
        __syncthreads();
        Y.template mma<false, true, BV>(dOs + q4 * BV, LDD, Xs, LDV);
        Z.template mma<false, true, BV>(dVs + q4 * BV, LDD, Xs, LDV);
      }
#pragma unroll
      for (int i = 0; i < T128::kRows; ++i) {
        const int r = Y.row(i);
        float qy = 0.f, kz = 0.f;
#pragma unroll
        for (int j = 0; j < T128::kCols; ++j) {
          const int c = Y.col(j);
          dQ.a[i][j] += p.scale * gam[r] * Y.a[i][j];
          dK.a[i][j] -= bs[r] * gam[r] * Z.a[i][j];
          qy += Qs[r * LDD + c] * Y.a[i][j];
          kz += Ks[r * LDD + c] * Z.a[i][j];
        }
        qy = Y.row_sum_block(qy, i, rs);
        kz = Y.row_sum_block(kz, i, rs);
        if (Y.row_leader()) {
          dG[r] += p.scale * gam[r] * qy - bs[r] * gam[r] * kz;
          db[r] -= gam[r] * kz;
        }
      }
    }
    {  // R = U dSL^T
      T128 R;
      R.zero();
      for (int q4 = 0; q4 < D / BV; ++q4) {
        __syncthreads();
        for (int e = threadIdx.x; e < D * BV; e += NT) {
          const int r = e / BV, c = e % BV;
          Xs[r * LDV + c] = dSL[r * D + q4 * BV + c];
        }
        __syncthreads();
        R.template mma<false, true, BV>(Us + q4 * BV, LDD, Xs, LDV);
      }
#pragma unroll
      for (int i = 0; i < T128::kRows; ++i) {
        const int r = R.row(i);
        float kr = 0.f;
#pragma unroll
        for (int j = 0; j < T128::kCols; ++j) {
          dK.a[i][j] += eL[r] * R.a[i][j];
          kr += Ks[r * LDD + R.col(j)] * R.a[i][j];
        }
        kr = R.row_sum_block(kr, i, rs);
        if (R.row_leader()) {
          dG[r] -= eL[r] * kr;
          lastrow[r] = eL[r] * kr;
        }
      }
    }
    {  // <S0, dSL>, reduced deterministically
      float acc = 0.f;
      for (int e = threadIdx.x; e < D * D; e += NT) acc += S0[e] * dSL[e];
      red[threadIdx.x] = acc;
    }
    __syncthreads();  // Xs free again; red and lastrow complete
    {  // masked C x C products: dA, dP, A, P -> M1 = dP . Dec, M2 = beta dA . Dec, E
      T64 t1, t2, t3, t4;
      t1.zero();
      t2.zero();
      t3.zero();
      t4.zero();
      t1.template mma<false, true, D>(dVs, LDD, Us, LDD);
      t2.template mma<false, true, D>(dOs, LDD, Us, LDD);
      t3.template mma<false, true, D>(Ks, LDD, Ks, LDD);
      t4.template mma<false, true, D>(Qs, LDD, Ks, LDD);
      float* E = Xs;
#pragma unroll
      for (int i = 0; i < T64::kRows; ++i) {
        const int r = t1.row(i);
        float dbp = 0.f;
#pragma unroll
        for (int j = 0; j < T64::kCols; ++j) {
          const int s = t1.col(j);
          const float dec = s <= r ? __expf(Gs[r] - Gs[s]) : 0.f;
          const float dA = s < r ? -t1.a[i][j] : 0.f;
          const float dP = s <= r ? p.scale * t2.a[i][j] : 0.f;
          const float A = s < r ? bs[r] * t3.a[i][j] * dec : 0.f;
          const float P = t4.a[i][j] * dec;
          M1[r * LDC + s] = dP * dec;
          M2[r * LDC + s] = bs[r] * dA * dec;
          dbp += dA * t3.a[i][j] * dec;
          E[r * LDC + s] = dA * A + dP * P;
        }
        dbp = t1.row_sum_block(dbp, i, rs);
        if (t1.row_leader()) db[r] += dbp;
      }
    }
    __syncthreads();
    if (threadIdx.x < C) {  // dG_r += rowsum(E)_r - colsum(E)_r
      const int r = threadIdx.x;
      const float* E = Xs;
      float acc = 0.f;
      for (int s = 0; s < C; ++s) acc += E[r * LDC + s] - E[s * LDC + r];
      dG[r] += acc;
    }
    dQ.template mma<false, false, C>(M1, LDC, Ks, LDD);
    dK.template mma<true, false, C>(M1, LDC, Qs, LDD);
    dK.template mma<false, false, C>(M2, LDC, Ks, LDD);
    dK.template mma<true, false, C>(M2, LDC, Ks, LDD);
    {  // dv = beta dVt and dbeta += v . dVt; four threads per row
      const int r = threadIdx.x / 4, part = threadIdx.x % 4;
      float vd = 0.f;
      if (r < L) {
        const In* vrow = static_cast<const In*>(p.v) + ((tok0 + r) * p.Hv + h) * D;
        In* dvrow = static_cast<In*>(p.dv) + ((tok0 + r) * p.Hv + h) * D;
        for (int c = part * 32; c < part * 32 + 32; ++c) {
          const float d = dVs[r * LDD + c];
          vd += to_f(vrow[c]) * d;
          dvrow[c] = from_f<In>(bs[r] * d);
        }
      }
      vd += __shfl_xor_sync(0xffffffffu, vd, 1);
      vd += __shfl_xor_sync(0xffffffffu, vd, 2);
      __syncthreads();  // dG column sums done before the serial pass below
      if (part == 0 && r < L) db[r] += vd;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // last-row terms, then dg = reverse cumsum of dG
      float last = 0.f, s0ds = 0.f;
      for (int r = 0; r < C; ++r) last += lastrow[r];
      for (int t = 0; t < NT; ++t) s0ds += red[t];
      dG[L - 1] += last + gam[L - 1] * s0ds;
      float run = 0.f;
      for (int r = L - 1; r >= 0; --r) {
        run += dG[r];
        store_scalar(p.dg, p.g_dtype, (tok0 + r) * p.Hv + h, run);
        store_scalar(p.dbeta, p.beta_dtype, (tok0 + r) * p.Hv + h, db[r]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < T128::kRows; ++i)
#pragma unroll
    for (int j = 0; j < T128::kCols; ++j) {
      const int r = dQ.row(i), c = dQ.col(j);
      if (r < L) {
        const int64_t idx = ((tok0 + r) * p.Hqk + hq) * D + c;
        static_cast<In*>(p.dq)[idx] = from_f<In>(dQ.a[i][j]);
        static_cast<In*>(p.dk)[idx] = from_f<In>(dK.a[i][j]);
      }
    }
}

}  // namespace cuda
}  // namespace flashgdn
