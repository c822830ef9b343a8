// Forward kernels of the chunked WY algorithm (docs/algorithm.md).
//
// wy_kernel      grid (max_chunks, H_v), 256 threads, ~100 KB smem
//   One chunk of one value head: in-chunk cumulative gates G, the strictly lower
//   A[r,s] = beta_r exp(G_r - G_s) k_r.k_s, T = (I + A)^-1 by forward
//   substitution, W = T diag(beta exp(G)) K and U0 = T diag(beta) V.
//   reads  k, v, g, beta          writes G, W, U0 (fp32 workspace), optionally T
//
// state_fwd_kernel  grid (N, H_v, V / 32), 256 threads, ~140 KB smem
//   The sequential pass over the chunks of one sequence for 32 value columns of
//   one head, state block S (128 x 32, fp32) kept in shared memory:
//     U = U0 - W S,  O = scale (diag(exp G) Q S + (Q K^T . Dec) U),
//     S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T U.
//   reads  q, k, W, U0, G, initial state
//   writes o, final state; optionally the state entering each chunk (h) and U
//          (the backward's recomputation)
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
  float* Tmat;       // [TT, Hv, C] or null
  float* h;          // [max_chunks, Hv, D, D] or null
  float* U;          // [TT, Hv, D] or null
};

constexpr size_t kWySmem = sizeof(float) * (2 * C * LDD + 2 * C * LDC + 2 * C);

template <typename In>
__global__ void __launch_bounds__(NT, 1) wy_kernel(FwdParams p) {
  if (p.seqs.failed()) return;
  const ChunkRef ck = locate_chunk(p.seqs, blockIdx.x);
  if (ck.L == 0) return;
  const int64_t h = blockIdx.y, hq = h / (p.Hv / p.Hqk);
  extern __shared__ float smem[];
  float* Ks = smem;             // [C][LDD]
  float* Vs = Ks + C * LDD;     // [C][LDD]
  float* As = Vs + C * LDD;     // [C][LDC]
  float* Ts = As + C * LDC;     // [C][LDC]
  float* bs = Ts + C * LDC;     // [C]
  float* Gs = bs + C;           // [C]

  load_rows(Ks, LDD, static_cast<const In*>(p.k) + (ck.tok0 * p.Hqk + hq) * D, p.Hqk * D, ck.L,
            C, D);
  load_rows(Vs, LDD, static_cast<const In*>(p.v) + (ck.tok0 * p.Hv + h) * D, p.Hv * D, ck.L, C,
            D);
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
  if (p.Tmat)
    for (int e = threadIdx.x; e < ck.L * C; e += NT) {
      const int r = e / C, c = e % C;
      p.Tmat[((ck.tok0 + r) * p.Hv + h) * C + c] = Ts[r * LDC + c];
    }
  for (int e = threadIdx.x; e < C * D; e += NT) {
    const int r = e / D, c = e % D;
    Ks[r * LDD + c] *= bs[r] * __expf(Gs[r]);
    Vs[r * LDD + c] *= bs[r];
  }
  if (threadIdx.x < ck.L) p.G[(ck.tok0 + threadIdx.x) * p.Hv + h] = Gs[threadIdx.x];
  __syncthreads();

  Tile<C, D, 4, 8> w;
  w.zero();
  w.mma<false, false, C>(Ts, LDC, Ks, LDD);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (w.row(i) < ck.L) p.W[((ck.tok0 + w.row(i)) * p.Hv + h) * D + w.col(j)] = w.a[i][j];
  w.zero();
  w.mma<false, false, C>(Ts, LDC, Vs, LDD);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (w.row(i) < ck.L) p.U0[((ck.tok0 + w.row(i)) * p.Hv + h) * D + w.col(j)] = w.a[i][j];
}

constexpr size_t kStateFwdSmem =
    sizeof(float) * (3 * C * LDD + D * LDV + C * LDV + C * LDC + 2 * C);

template <typename In>
__global__ void __launch_bounds__(NT, 1) state_fwd_kernel(FwdParams p) {
  if (p.seqs.failed()) return;
  const int64_t n = blockIdx.x, h = blockIdx.y, hq = h / (p.Hv / p.Hqk);
  const int vb = blockIdx.z * BV;
  extern __shared__ float smem[];
  float* Qs = smem;             // [C][LDD]
  float* Ks = Qs + C * LDD;     // [C][LDD]
  float* Ws = Ks + C * LDD;     // [C][LDD]
  float* Ss = Ws + C * LDD;     // [D][LDV] state block
  float* Us = Ss + D * LDV;     // [C][LDV]
  float* Ps = Us + C * LDV;     // [C][LDC]
  float* Gs = Ps + C * LDC;     // [C]
  float* eL = Gs + C;           // [C]

  const int64_t state_off = (n * p.Hv + h) * D * D;
  load_state_block(Ss, p.h0 ? p.h0 + state_off : nullptr, vb);
  const int64_t start = p.seqs.seq_start(n), len = p.seqs.seq_len(n);
  const int64_t chunk0 = p.seqs.first_chunk(n);
  for (int64_t c0 = 0; c0 < len; c0 += C) {
    const int64_t tok0 = start + c0;
    const int L = static_cast<int>(len - c0 < C ? len - c0 : C);
    __syncthreads();  // previous chunk done with every buffer
    if (p.h) store_state_block(p.h + ((chunk0 + c0 / C) * p.Hv + h) * D * D, Ss, vb);
    load_rows(Qs, LDD, static_cast<const In*>(p.q) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L, C, D);
    load_rows(Ks, LDD, static_cast<const In*>(p.k) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L, C, D);
    load_rows(Ws, LDD, p.W + (tok0 * p.Hv + h) * D, p.Hv * D, L, C, D);
    load_rows(Us, LDV, p.U0 + (tok0 * p.Hv + h) * D + vb, p.Hv * D, L, C, BV);
    if (threadIdx.x < C) {
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      Gs[threadIdx.x] = p.G[(tok0 + r) * p.Hv + h];
    }
    __syncthreads();
    if (threadIdx.x < C) eL[threadIdx.x] = __expf(Gs[C - 1] - Gs[threadIdx.x]);

    {  // U = U0 - W S
      Tile<C, BV, 2, 4> u;
      u.zero();
      u.mma<false, false, D>(Ws, LDD, Ss, LDV);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = u.row(i), c = u.col(j);
          const float val = Us[r * LDV + c] - u.a[i][j];
          Us[r * LDV + c] = val;
          if (p.U && r < L) p.U[((tok0 + r) * p.Hv + h) * D + vb + c] = val;
        }
    }
    decayed_qk(Ps, Qs, Ks, Gs);  // P = (Q K^T) . Dec
    __syncthreads();
    if (p.o) {  // O = scale (exp(G) Q S + P U)
      Tile<C, BV, 2, 4> o;
      o.zero();
      o.mma<false, false, D>(Qs, LDD, Ss, LDV);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) o.a[i][j] *= __expf(Gs[o.row(i)]);
      o.mma<false, false, C>(Ps, LDC, Us, LDV);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = o.row(i), c = o.col(j);
          if (r < L)
            static_cast<In*>(p.o)[((tok0 + r) * p.Hv + h) * D + vb + c] =
                from_f<In>(p.scale * o.a[i][j]);
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < C * BV; e += NT) {
      const int r = e / BV, c = e % BV;
      Us[r * LDV + c] *= eL[r];
    }
    __syncthreads();
    {  // S <- exp(G_last) S + K^T (eL U)
      Tile<D, BV, 4, 4> st;
      st.zero();
      st.mma<true, false, C>(Ks, LDD, Us, LDV);
      const float gl = __expf(Gs[C - 1]);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float& s = Ss[st.row(i) * LDV + st.col(j)];
          s = gl * s + st.a[i][j];
        }
    }
  }
  __syncthreads();
  if (p.ht) store_state_block(p.ht + state_off, Ss, vb);
}

}  // namespace cuda
}  // namespace flashgdn
