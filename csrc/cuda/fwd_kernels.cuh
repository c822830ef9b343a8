// Forward kernels of the chunked WY algorithm (docs/algorithm.md).
//
// wy_kernel      grid (max_chunks, H_v), 256 threads, ~150 KB smem
//   Everything of one chunk of one value head that does not depend on the state:
//   in-chunk cumulative gates G, A[r,s] = beta_r exp(G_r - G_s) k_r.k_s (s < r),
//   T = (I + A)^-1 by forward substitution, W = T diag(beta exp G) K,
//   U0 = T diag(beta) V, P = (Q K^T) . Dec, and for the output
//   Q' = diag(exp G) Q - P W and O0 = P U0, so that O = scale (O0 + Q' S0).
//   reads  q, k, v, g, beta
//   writes G, W, U0 (fp32 workspace); Q', O0 when the output is wanted;
//          T and P when the backward asks for them
//
// state_fwd_kernel<BW>  grid (N, H_v, 128 / BW), 256 threads, ~115 KB smem
//   The sequential pass over the chunks of one sequence for BW value columns of one
//   head, state block S (128 x BW, fp32) in shared memory; per chunk only
//     U = U0 - W S,  O = scale (O0 + Q' S),  S <- exp(G_last) S + K^T diag(eL) U.
//   reads  k, W, U0, G, Q', O0, initial state
//   writes o, final state; optionally the state entering each chunk (h) and U
#pragma once

#include "common.cuh"

namespace flashgdn {
namespace cuda {

struct FwdParams {
  SeqLayout seqs;
  int64_t Hqk, Hv;
  float scale;
  const void *q, *k, *v, *g, *beta;
  int g_dtype, beta_dtype;
  const float* h0;   // [N, Hv, D, D] or null
  void* o;           // [TT, Hv, D] or null
  float* ht;         // [N, Hv, D, D] or null
  float* G;          // [TT, Hv]
  float* W;          // [TT, Hv, D]
  float* U0;         // [TT, Hv, D]
  float* Qp;         // [TT, Hv, D] Q' (with o)
  float* O0;         // [TT, Hv, D] (with o)
  float* Tmat;       // [TT, Hv, C] or null
  float* Pmat;       // [TT, Hv, C] or null
  float* h;          // [max_chunks, Hv, D, D] or null
  float* U;          // [TT, Hv, D] or null
};

constexpr size_t kWySmem = sizeof(float) * (3 * C * LDD + 3 * C * LDC + 2 * C);

template <typename In>
__global__ void __launch_bounds__(NT, 1) wy_kernel(FwdParams p) {
  if (p.seqs.failed()) return;
  const ChunkRef ck = locate_chunk(p.seqs, blockIdx.x);
  if (ck.L == 0) return;
  const int64_t h = blockIdx.y, hq = h / (p.Hv / p.Hqk);
  const bool want_p = p.Qp != nullptr || p.Pmat != nullptr;
  extern __shared__ float smem[];
  float* Ks = smem;             // [C][LDD] K, then diag(beta exp G) K, then W
  float* Vs = Ks + C * LDD;     // [C][LDD] V, then diag(beta) V, then U0
  float* Qs = Vs + C * LDD;     // [C][LDD]
  float* As = Qs + C * LDD;     // [C][LDC]
  float* Ts = As + C * LDC;     // [C][LDC]
  float* Ps = Ts + C * LDC;     // [C][LDC]
  float* bs = Ps + C * LDC;     // [C]
  float* Gs = bs + C;           // [C]

  const int64_t qk_off = (ck.tok0 * p.Hqk + hq) * D, row_off = ck.tok0 * p.Hv + h;
  load_chunk(Ks, static_cast<const In*>(p.k) + qk_off, p.Hqk * D, ck.L);
  load_chunk(Vs, static_cast<const In*>(p.v) + row_off * D, p.Hv * D, ck.L);
  if (want_p) load_chunk(Qs, static_cast<const In*>(p.q) + qk_off, p.Hqk * D, ck.L);
  if (threadIdx.x == 0) {
    float acc = 0.f;
    for (int r = 0; r < C; ++r) {
      if (r < ck.L) {
        acc += load_scalar(p.g, p.g_dtype, (ck.tok0 + r) * p.Hv + h);
        bs[r] = load_scalar(p.beta, p.beta_dtype, (ck.tok0 + r) * p.Hv + h);
      } else {
        bs[r] = 0.f;
      }
      Gs[r] = acc;
    }
  }
  __syncthreads();

  {  // A = beta_r exp(G_r - G_s) (K K^T)_rs for s < r
    Tile<C, C, 4, 4> kk;
    kk.zero();
    kk.mma<false, true, D>(Ks, LDD, Ks, LDD);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = kk.row(i), s = kk.col(j);
        As[r * LDC + s] = s < r ? bs[r] * __expf(Gs[r] - Gs[s]) * kk.a[i][j] : 0.f;
      }
  }
  if (want_p) decayed_qk(Ps, Qs, Ks, Gs);
  __syncthreads();

  // T = (I + A)^-1, row by row: T[r, j] = delta_rj - sum_{j <= s < r} A[r, s] T[s, j].
  // Four threads per column j split the sum.
  {
    const int j = threadIdx.x / 4, part = threadIdx.x % 4;
    for (int r = 0; r < C; ++r) {
      float sum = 0.f;
      for (int s = j + part; s < r; s += 4) sum += As[r * LDC + s] * Ts[s * LDC + j];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (part == 0) Ts[r * LDC + j] = (j == r ? 1.f : 0.f) - (j < r ? sum : 0.f);
      __syncthreads();
    }
  }
  for (int e = threadIdx.x; e < ck.L * C; e += NT) {
    const int r = e / C, c = e % C;
    if (p.Tmat) p.Tmat[(row_off + r * p.Hv) * C + c] = Ts[r * LDC + c];
    if (p.Pmat) p.Pmat[(row_off + r * p.Hv) * C + c] = Ps[r * LDC + c];
  }
  for (int e = threadIdx.x; e < C * D; e += NT) {
    const int r = e / D, c = e % D;
    Ks[r * LDD + c] *= bs[r] * __expf(Gs[r]);
    Vs[r * LDD + c] *= bs[r];
  }
  if (threadIdx.x < ck.L) p.G[row_off + threadIdx.x * p.Hv] = Gs[threadIdx.x];
  __syncthreads();

  Tile<C, D, 4, 8> w, u0;
  w.zero();
  w.mma<false, false, C>(Ts, LDC, Ks, LDD);
  u0.zero();
  u0.mma<false, false, C>(Ts, LDC, Vs, LDD);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (w.row(i) < ck.L) {
        const int64_t idx = (row_off + w.row(i) * p.Hv) * D + w.col(j);
        p.W[idx] = w.a[i][j];
        p.U0[idx] = u0.a[i][j];
      }
  if (p.Qp == nullptr) return;

  __syncthreads();  // every thread done reading Ks, Vs
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      Ks[w.row(i) * LDD + w.col(j)] = w.a[i][j];
      Vs[w.row(i) * LDD + w.col(j)] = u0.a[i][j];
    }
  __syncthreads();
  // Q' = diag(exp G) Q - P W and O0 = P U0
  w.zero();
  w.mma<false, false, C>(Ps, LDC, Ks, LDD);
  u0.zero();
  u0.mma<false, false, C>(Ps, LDC, Vs, LDD);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int r = w.row(i), c = w.col(j);
      if (r < ck.L) {
        const int64_t idx = (row_off + r * p.Hv) * D + c;
        p.Qp[idx] = __expf(Gs[r]) * Qs[r * LDD + c] - w.a[i][j];
        p.O0[idx] = u0.a[i][j];
      }
    }
}

template <int BW>
constexpr size_t state_fwd_smem() {
  return sizeof(float) * (3 * C * LDD + (D + C) * (BW + 1) + 2 * C);
}

template <typename In, int BW>
__global__ void __launch_bounds__(NT, 1) state_fwd_kernel(FwdParams p) {
  if (p.seqs.failed()) return;
  using CB = ColBlock<BW>;
  constexpr int LD = CB::LD, CN = CB::CN;
  const int64_t n = blockIdx.x, h = blockIdx.y, hq = h / (p.Hv / p.Hqk);
  const int vb = blockIdx.z * BW;
  const bool out = p.o != nullptr;
  extern __shared__ float smem[];
  float* Ws = smem;             // [C][LDD]
  float* Qp = Ws + C * LDD;     // [C][LDD] Q'
  float* Ks = Qp + C * LDD;     // [C][LDD]
  float* Ss = Ks + C * LDD;     // [D][LD] state block
  float* Us = Ss + D * LD;      // [C][LD]
  float* Gs = Us + C * LD;      // [C]
  float* eL = Gs + C;           // [C]

  const int64_t state_off = (n * p.Hv + h) * D * D;
  load_state_block<BW>(Ss, p.h0 ? p.h0 + state_off : nullptr, vb);
  const int64_t start = p.seqs.seq_start(n), len = p.seqs.seq_len(n);
  const int64_t chunk0 = p.seqs.first_chunk(n);
  for (int64_t c0 = 0; c0 < len; c0 += C) {
    const int64_t tok0 = start + c0;
    const int L = static_cast<int>(len - c0 < C ? len - c0 : C);
    __syncthreads();  // previous chunk done with every buffer
    if (p.h) store_state_block<BW>(p.h + ((chunk0 + c0 / C) * p.Hv + h) * D * D, Ss, vb);
    load_chunk(Ks, static_cast<const In*>(p.k) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    load_chunk(Ws, p.W + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    if (out) load_chunk(Qp, p.Qp + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    if (threadIdx.x < C) {
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      Gs[threadIdx.x] = p.G[(tok0 + r) * p.Hv + h];
    }
    __syncthreads();
    if (threadIdx.x < C) eL[threadIdx.x] = __expf(Gs[C - 1] - Gs[threadIdx.x]);
    {  // U = U0 - W S, and O = scale (O0 + Q' S)
      Tile<C, BW, 2, CN> u;
      u.zero();
      u.mma<false, false, D>(Ws, LDD, Ss, LD);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < CN; ++j) {
          const int r = u.row(i), c = u.col(j);
          const int64_t idx = ((tok0 + r) * p.Hv + h) * D + vb + c;
          const float val = r < L ? p.U0[idx] - u.a[i][j] : 0.f;
          Us[r * LD + c] = val;
          if (p.U && r < L) p.U[idx] = val;
        }
      if (out) {
        u.zero();
        u.mma<false, false, D>(Qp, LDD, Ss, LD);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < CN; ++j) {
            const int r = u.row(i), c = u.col(j);
            const int64_t idx = ((tok0 + r) * p.Hv + h) * D + vb + c;
            if (r < L) static_cast<In*>(p.o)[idx] = from_f<In>(p.scale * (p.O0[idx] + u.a[i][j]));
          }
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < C * BW; e += NT) {
      const int r = e / BW, c = e % BW;
      Us[r * LD + c] *= eL[r];
    }
    __syncthreads();
    {  // S <- exp(G_last) S + K^T (eL U)
      Tile<D, BW, 4, CN> st;
      st.zero();
      st.mma<true, false, C>(Ks, LDD, Us, LD);
      const float gl = __expf(Gs[C - 1]);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < CN; ++j) {
          float& s = Ss[st.row(i) * LD + st.col(j)];
          s = gl * s + st.a[i][j];
        }
    }
  }
  __syncthreads();
  if (p.ht) store_state_block<BW>(p.ht + state_off, Ss, vb);
}

}  // namespace cuda
}  // namespace flashgdn
