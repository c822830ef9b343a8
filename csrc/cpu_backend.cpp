// CPU backend: the chunked WY algorithm of docs/algorithm.md in fp32, one task per
// (sequence, head) for the forward and per (sequence, q/k head) for the backward
// (so the gradients of grouped value heads are summed without races), spread
// over std::thread workers.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "backends.h"

namespace flashgdn {
namespace {

constexpr int D = kHeadDim;
constexpr int C = kChunk;

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0);  // inf/nan
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // overflow to inf
  if (ax < 0x38800000u) {                        // subnormal or zero in half
    if (ax < 0x33000000u) return sign;
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // value * 2^24 = m >> shift
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    uint32_t r = m >> shift;
    if (rem > half || (rem == half && (r & 1))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = ((ax >> 13) - (112u << 10));
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) ++r;
  return sign | static_cast<uint16_t>(r);
}

float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

float load(const void* p, flashgdn_dtype t, int64_t i) {
  switch (t) {
    case FLASHGDN_DTYPE_F32: return static_cast<const float*>(p)[i];
    case FLASHGDN_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return half_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

void store(void* p, flashgdn_dtype t, int64_t i, float x) {
  switch (t) {
    case FLASHGDN_DTYPE_F32: static_cast<float*>(p)[i] = x; break;
    case FLASHGDN_DTYPE_BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(x); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_half(x); break;
  }
}

// State conversions at the boundary: matrix `m` of a caller's state tensor (any
// state dtype, KV or VK layout) to and from an fp32 [K, V] working copy S.
void load_state(const StateBuf& st, int64_t m, float* S) {
  const int64_t base = m * D * D;
  if (st.native()) {
    std::memcpy(S, static_cast<const float*>(st.data) + base, sizeof(float) * D * D);
    return;
  }
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) S[i * D + j] = load(st.data, st.dtype, base + st.offset(i, j));
}

void store_state(const StateBuf& st, int64_t m, const float* S) {
  const int64_t base = m * D * D;
  if (st.native()) {
    std::memcpy(static_cast<float*>(st.data) + base, S, sizeof(float) * D * D);
    return;
  }
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) store(st.data, st.dtype, base + st.offset(i, j), S[i * D + j]);
}

struct Seq {
  int64_t start, len;
};

std::vector<Seq> sequences(const Problem& p) {
  std::vector<Seq> s(p.N);
  for (int64_t i = 0; i < p.N; ++i) {
    if (!p.varlen()) {
      s[i] = {i * p.T, p.T};
    } else if (p.cu_dtype == FLASHGDN_DTYPE_I32) {
      auto cu = static_cast<const int32_t*>(p.cu_seqlens);
      s[i] = {cu[i], cu[i + 1] - cu[i]};
    } else {
      auto cu = static_cast<const int64_t*>(p.cu_seqlens);
      s[i] = {cu[i], cu[i + 1] - cu[i]};
    }
  }
  return s;
}

// C[M,N] (+)= alpha * op(A)[M,Kd] op(B)[Kd,N]; op(X) = X^T when the flag is set.
// Row-major with leading dimensions; i-k-j loop order for contiguous inner access.
void gemm(float* Cm, int ldc, const float* A, int lda, bool ta, const float* Bm, int ldb, bool tb,
          int M, int N, int Kd, float alpha, bool accumulate) {
  if (!accumulate)
    for (int i = 0; i < M; ++i) std::fill(Cm + i * ldc, Cm + i * ldc + N, 0.f);
  for (int i = 0; i < M; ++i) {
    float* c = Cm + i * ldc;
    for (int kk = 0; kk < Kd; ++kk) {
      const float a = alpha * (ta ? A[kk * lda + i] : A[i * lda + kk]);
      if (a == 0.f) continue;
      if (!tb) {
        const float* b = Bm + kk * ldb;
        for (int j = 0; j < N; ++j) c[j] += a * b[j];
      } else {
        for (int j = 0; j < N; ++j) c[j] += a * Bm[j * ldb + kk];
      }
    }
  }
}

// Everything the forward and backward need about one chunk of one head, computed
// from its inputs: gates, the WY inverse T = (I + A)^-1, W, U0 and the masked
// products. Rows >= L are zero.
struct Chunk {
  int L = 0;
  float Q[C * D], K[C * D], V[C * D];
  float b[C], G[C], Gam[C], eL[C];
  float KK[C * C], Dec[C * C];  // KK = K K^T, Dec[r,s] = exp(G_r - G_s) for s <= r, else 0
  float A[C * C], Tm[C * C];
  float W[C * D], U0[C * D];

  void load_inputs(const Problem& p, int64_t tok0, int len, int64_t h) {
    L = len;
    const int64_t hq = h / p.group();
    std::fill(Q, Q + C * D, 0.f);
    std::fill(K, K + C * D, 0.f);
    std::fill(V, V + C * D, 0.f);
    float acc = 0.f;
    for (int r = 0; r < C; ++r) {
      if (r < L) {
        const int64_t t = tok0 + r;
        for (int c = 0; c < D; ++c) {
          Q[r * D + c] = load(p.q, p.qkv_dtype, (t * p.Hqk + hq) * D + c);
          K[r * D + c] = load(p.k, p.qkv_dtype, (t * p.Hqk + hq) * D + c);
          V[r * D + c] = load(p.v, p.qkv_dtype, (t * p.Hv + h) * D + c);
        }
        b[r] = load(p.beta, p.beta_dtype, t * p.Hv + h);
        acc += load(p.g, p.g_dtype, t * p.Hv + h);
      } else {
        b[r] = 0.f;
      }
      G[r] = acc;
      Gam[r] = std::exp(acc);
    }
    for (int r = 0; r < C; ++r) eL[r] = std::exp(G[C - 1] - G[r]);
  }

  void compute_wy() {
    gemm(KK, C, K, D, false, K, D, true, C, C, D, 1.f, false);
    for (int r = 0; r < C; ++r)
      for (int s = 0; s < C; ++s) {
        Dec[r * C + s] = s <= r ? std::exp(G[r] - G[s]) : 0.f;
        A[r * C + s] = s < r ? b[r] * KK[r * C + s] * Dec[r * C + s] : 0.f;
      }
    // Forward substitution: row r of T = e_r - sum_{s<r} A[r,s] T[s,:].
    for (int r = 0; r < C; ++r) {
      float* t = Tm + r * C;
      std::fill(t, t + C, 0.f);
      t[r] = 1.f;
      for (int s = 0; s < r; ++s) {
        const float a = A[r * C + s];
        if (a == 0.f) continue;
        for (int j = 0; j <= s; ++j) t[j] -= a * Tm[s * C + j];
      }
    }
    float Kb[C * D], Vb[C * D];
    for (int r = 0; r < C; ++r)
      for (int c = 0; c < D; ++c) {
        Kb[r * D + c] = b[r] * Gam[r] * K[r * D + c];
        Vb[r * D + c] = b[r] * V[r * D + c];
      }
    gemm(W, D, Tm, C, false, Kb, D, false, C, D, C, 1.f, false);
    gemm(U0, D, Tm, C, false, Vb, D, false, C, D, C, 1.f, false);
  }
};

// U = U0 - W S, P = (Q K^T) . Dec, and (optionally) O = scale (Gam Q S + P U).
void chunk_forward(const Chunk& ck, const float* S, float scale, float* U, float* P, float* O) {
  std::memcpy(U, ck.U0, sizeof(float) * C * D);
  gemm(U, D, ck.W, D, false, S, D, false, C, D, D, -1.f, true);
  gemm(P, C, ck.Q, D, false, ck.K, D, true, C, C, D, 1.f, false);
  for (int i = 0; i < C * C; ++i) P[i] *= ck.Dec[i];
  if (O) {
    gemm(O, D, ck.Q, D, false, S, D, false, C, D, D, 1.f, false);
    for (int r = 0; r < C; ++r)
      for (int c = 0; c < D; ++c) O[r * D + c] *= scale * ck.Gam[r];
    gemm(O, D, P, C, false, U, D, false, C, D, C, scale, true);
  }
}

// S <- exp(G_last) S + (eL K)^T U.
void chunk_state_update(const Chunk& ck, float* S, const float* U) {
  const float gl = ck.Gam[C - 1];
  for (int i = 0; i < D * D; ++i) S[i] *= gl;
  float Ke[C * D];
  for (int r = 0; r < C; ++r)
    for (int c = 0; c < D; ++c) Ke[r * D + c] = ck.eL[r] * ck.K[r * D + c];
  gemm(S, D, Ke, D, true, U, D, false, D, D, C, 1.f, true);
}

template <typename F>
void parallel_for(int64_t n, F&& f) {
  const int64_t workers =
      std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> next{0};
  auto run = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < n;) f(i);
  };
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(run);
  run();
  for (auto& t : pool) t.join();
}

// Gate tensors may be float64; the gate computes in double precision, like the CUDA
// kernels (cuda/gate.cu), and rounds once to each output's dtype.
double load_gate(const void* p, flashgdn_dtype t, int64_t i) {
  return t == FLASHGDN_DTYPE_F64 ? static_cast<const double*>(p)[i]
                                 : static_cast<double>(load(p, t, i));
}

void store_gate(void* p, flashgdn_dtype t, int64_t i, double x) {
  if (t == FLASHGDN_DTYPE_F64) static_cast<double*>(p)[i] = x;
  else store(p, t, i, static_cast<float>(x));
}

int64_t slot_of(const DecodeProblem& p, int64_t b) {
  return p.idx_dtype == FLASHGDN_DTYPE_I32 ? static_cast<const int32_t*>(p.indices)[b]
                                           : static_cast<const int64_t*>(p.indices)[b];
}

// softplus(x) = log(1 + e^x) = max(x, 0) + log1p(e^-|x|): no overflow for large x.
double softplus(double x) { return std::max(x, 0.0) + std::log1p(std::exp(-std::abs(x))); }

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace

void cpu_decode(const DecodeProblem& p) {
  parallel_for(p.B * p.Hv, [&](int64_t task) {
    const int64_t b = task / p.Hv, h = task % p.Hv, hq = h / p.group();
    const int64_t slot = slot_of(p, b);
    if (slot < 0) {  // skipped sequence: zero output, no state
      for (int64_t t = 0; t < p.T; ++t)
        for (int c = 0; c < D; ++c)
          store(p.o, p.qkv_dtype, ((b * p.T + t) * p.Hv + h) * D + c, 0.f);
      return;
    }
    // The slot's state as fp32 [K, V], written back (rounded once) after the T tokens.
    std::vector<float> state(D * D);
    float* S = state.data();
    load_state(p.pool, slot * p.Hv + h, S);
    float q[D], k[D], sa[D], sb[D];
    for (int64_t t = 0; t < p.T; ++t) {
      const int64_t tok = b * p.T + t;
      float qq = 0.f, kk = 0.f;
      for (int c = 0; c < D; ++c) {
        q[c] = load(p.q, p.qkv_dtype, (tok * p.Hqk + hq) * D + c);
        k[c] = load(p.k, p.qkv_dtype, (tok * p.Hqk + hq) * D + c);
        qq += q[c] * q[c];
        kk += k[c] * k[c];
      }
      if (p.l2norm) {
        const float rq = 1.f / std::sqrt(qq + 1e-6f), rk = 1.f / std::sqrt(kk + 1e-6f);
        for (int c = 0; c < D; ++c) {
          q[c] *= rq;
          k[c] *= rk;
        }
      }
      float qk = 0.f;
      for (int c = 0; c < D; ++c) qk += q[c] * k[c];
      const float eg = std::exp(load(p.g, p.g_dtype, tok * p.Hv + h));
      const float beta = load(p.beta, p.beta_dtype, tok * p.Hv + h);
      // sa = S^T k, sb = S^T q of the state before this token's decay.
      std::fill(sa, sa + D, 0.f);
      std::fill(sb, sb + D, 0.f);
      for (int i = 0; i < D; ++i)
        for (int j = 0; j < D; ++j) {
          sa[j] += S[i * D + j] * k[i];
          sb[j] += S[i * D + j] * q[i];
        }
      // u = beta (v - eg S^T k); o = scale (eg S^T q + (q . k) u); S = eg S + k u^T.
      float u[D];
      for (int j = 0; j < D; ++j) {
        const float v = load(p.v, p.qkv_dtype, (tok * p.Hv + h) * D + j);
        u[j] = beta * (v - eg * sa[j]);
        store(p.o, p.qkv_dtype, (tok * p.Hv + h) * D + j, p.scale * (eg * sb[j] + qk * u[j]));
      }
      for (int i = 0; i < D; ++i)
        for (int j = 0; j < D; ++j) S[i * D + j] = eg * S[i * D + j] + k[i] * u[j];
    }
    store_state(p.pool, slot * p.Hv + h, S);
  });
}

void cpu_gating_fwd(const GatingProblem& p) {
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t h = i % p.H;
    const double x = load_gate(p.a, p.a_dtype, i) + load_gate(p.dt_bias, p.dt_dtype, h);
    const double decay = std::exp(load_gate(p.A_log, p.A_dtype, h));
    store_gate(p.g, p.g_dtype, i, -decay * softplus(x));
    store_gate(p.beta, p.beta_dtype, i, sigmoid(load_gate(p.b, p.b_dtype, i)));
  }
}

// da = -dg exp(A_log) sigmoid(a + dt_bias), dA_log = sum dg g, ddt_bias = sum da,
// db = dbeta beta (1 - beta); the per-head sums accumulate in order.
void cpu_gating_bwd(const GatingProblem& p) {
  std::vector<double> sA(p.H, 0.0), sdt(p.H, 0.0);
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t h = i % p.H;
    const double x = load_gate(p.a, p.a_dtype, i) + load_gate(p.dt_bias, p.dt_dtype, h);
    const double decay = std::exp(load_gate(p.A_log, p.A_dtype, h));
    const double dg = load_gate(p.dg, p.dg_dtype, i);
    const double da = -dg * decay * sigmoid(x);
    store_gate(p.da, p.a_dtype, i, da);
    sA[h] += -dg * decay * softplus(x);
    sdt[h] += da;
    const double bt = sigmoid(load_gate(p.b, p.b_dtype, i));
    store_gate(p.db, p.b_dtype, i, load_gate(p.dbeta, p.dbeta_dtype, i) * bt * (1.0 - bt));
  }
  for (int64_t h = 0; h < p.H; ++h) {
    store_gate(p.dA_log, p.A_dtype, h, sA[h]);
    store_gate(p.ddt_bias, p.dt_dtype, h, sdt[h]);
  }
}

void cpu_fwd(const Problem& p, const FwdOutputs& out) {
  const auto seqs = sequences(p);
  parallel_for(p.N * p.Hv, [&](int64_t task) {
    const int64_t n = task / p.Hv, h = task % p.Hv;
    std::vector<float> S(D * D, 0.f);
    if (p.h0_io.present()) load_state(p.h0_io, n * p.Hv + h, S.data());
    auto ck = std::make_unique<Chunk>();
    std::vector<float> U(C * D), P(C * C), O(C * D);
    for (int64_t c0 = 0; c0 < seqs[n].len; c0 += C) {
      const int64_t tok0 = seqs[n].start + c0;
      ck->load_inputs(p, tok0, static_cast<int>(std::min<int64_t>(C, seqs[n].len - c0)), h);
      ck->compute_wy();
      chunk_forward(*ck, S.data(), p.scale, U.data(), P.data(), O.data());
      for (int r = 0; r < ck->L; ++r)
        for (int c = 0; c < D; ++c)
          store(out.o, p.qkv_dtype, ((tok0 + r) * p.Hv + h) * D + c, O[r * D + c]);
      chunk_state_update(*ck, S.data(), U.data());
    }
    if (out.final_state_io.present()) store_state(out.final_state_io, n * p.Hv + h, S.data());
  });
}

void cpu_bwd(const Problem& p, const BwdIO& io) {
  const auto seqs = sequences(p);
  parallel_for(p.N * p.Hqk, [&](int64_t task) {
    const int64_t n = task / p.Hqk, hq = task % p.Hqk;
    const int64_t len = seqs[n].len, tok_start = seqs[n].start;
    const int64_t nchunks = (len + C - 1) / C;
    std::vector<float> dq(len * D, 0.f), dk(len * D, 0.f);
    std::vector<float> hs(nchunks * D * D), S(D * D), dS(D * D), dSnew(D * D);
    std::vector<float> U(C * D), P(C * C), dO(C * D), dU(C * D), dVt(C * D), Y(C * D), Z(C * D),
        R(C * D), dA(C * C), dP(C * C), M1(C * C), M2(C * C), dQ(C * D), dK(C * D), tmp(C * D);
    auto ck = std::make_unique<Chunk>();
    for (int64_t h = hq * p.group(); h < (hq + 1) * p.group(); ++h) {
      // Recompute the state entering every chunk.
      std::fill(S.begin(), S.end(), 0.f);
      if (p.h0_io.present()) load_state(p.h0_io, n * p.Hv + h, S.data());
      for (int64_t ci = 0; ci < nchunks; ++ci) {
        ck->load_inputs(p, tok_start + ci * C, static_cast<int>(std::min<int64_t>(C, len - ci * C)),
                        h);
        ck->compute_wy();
        std::memcpy(hs.data() + ci * D * D, S.data(), sizeof(float) * D * D);
        chunk_forward(*ck, S.data(), p.scale, U.data(), P.data(), nullptr);
        chunk_state_update(*ck, S.data(), U.data());
      }
      std::fill(dS.begin(), dS.end(), 0.f);
      if (io.d_final_state_io.present()) load_state(io.d_final_state_io, n * p.Hv + h, dS.data());
      for (int64_t ci = nchunks - 1; ci >= 0; --ci) {
        const int64_t tok0 = tok_start + ci * C;
        ck->load_inputs(p, tok0, static_cast<int>(std::min<int64_t>(C, len - ci * C)), h);
        ck->compute_wy();
        const Chunk& k = *ck;
        const float* S0 = hs.data() + ci * D * D;
        chunk_forward(k, S0, p.scale, U.data(), P.data(), nullptr);
        std::fill(dO.begin(), dO.end(), 0.f);
        for (int r = 0; r < k.L; ++r)
          for (int c = 0; c < D; ++c)
            dO[r * D + c] = load(io.d_o, p.qkv_dtype, ((tok0 + r) * p.Hv + h) * D + c);
        // Sequential part: dU, dVt = T^T dU and the state gradient entering the chunk.
        for (int r = 0; r < C; ++r)
          for (int c = 0; c < D; ++c) tmp[r * D + c] = k.eL[r] * k.K[r * D + c];
        gemm(dU.data(), D, tmp.data(), D, false, dS.data(), D, false, C, D, D, 1.f, false);
        gemm(dU.data(), D, P.data(), C, true, dO.data(), D, false, C, D, C, p.scale, true);
        gemm(dVt.data(), D, k.Tm, C, true, dU.data(), D, false, C, D, C, 1.f, false);
        for (int i = 0; i < D * D; ++i) dSnew[i] = k.Gam[C - 1] * dS[i];
        for (int r = 0; r < C; ++r)
          for (int c = 0; c < D; ++c) tmp[r * D + c] = p.scale * k.Gam[r] * k.Q[r * D + c];
        gemm(dSnew.data(), D, tmp.data(), D, true, dO.data(), D, false, D, D, C, 1.f, true);
        for (int r = 0; r < C; ++r)
          for (int c = 0; c < D; ++c) tmp[r * D + c] = -k.b[r] * k.Gam[r] * k.K[r * D + c];
        gemm(dSnew.data(), D, tmp.data(), D, true, dVt.data(), D, false, D, D, C, 1.f, true);
        // Parallel part: gradients of the chunk's inputs.
        float dG[C], db[C];
        gemm(Y.data(), D, dO.data(), D, false, S0, D, true, C, D, D, 1.f, false);
        gemm(Z.data(), D, dVt.data(), D, false, S0, D, true, C, D, D, 1.f, false);
        gemm(R.data(), D, U.data(), D, false, dS.data(), D, true, C, D, D, 1.f, false);
        gemm(dA.data(), C, dVt.data(), D, false, U.data(), D, true, C, C, D, -1.f, false);
        gemm(dP.data(), C, dO.data(), D, false, U.data(), D, true, C, C, D, p.scale, false);
        float last = 0.f, colsum[C] = {};
        for (int r = 0; r < C; ++r) {
          float qy = 0.f, kz = 0.f, kr = 0.f, vd = 0.f;
          for (int c = 0; c < D; ++c) {
            qy += k.Q[r * D + c] * Y[r * D + c];
            kz += k.K[r * D + c] * Z[r * D + c];
            kr += k.K[r * D + c] * R[r * D + c];
            vd += k.V[r * D + c] * dVt[r * D + c];
          }
          dG[r] = p.scale * k.Gam[r] * qy - k.b[r] * k.Gam[r] * kz - k.eL[r] * kr;
          db[r] = vd - k.Gam[r] * kz;
          last += k.eL[r] * kr;
          for (int s = 0; s < C; ++s) {
            const int i = r * C + s;
            const float da = s < r ? dA[i] : 0.f, dp = s <= r ? dP[i] : 0.f;
            M1[i] = dp * k.Dec[i];
            M2[i] = k.b[r] * da * k.Dec[i];
            db[r] += da * k.KK[i] * k.Dec[i];
            const float e = da * k.A[i] + dp * P[i];
            dG[r] += e;
            colsum[s] += e;
          }
        }
        float s0ds = 0.f;
        for (int i = 0; i < D * D; ++i) s0ds += S0[i] * dS[i];
        for (int r = 0; r < C; ++r) dG[r] -= colsum[r];
        dG[k.L - 1] += last + k.Gam[k.L - 1] * s0ds;
        for (int r = 0; r < C; ++r)
          for (int c = 0; c < D; ++c) {
            const int i = r * D + c;
            dQ[i] = p.scale * k.Gam[r] * Y[i];
            dK[i] = -k.b[r] * k.Gam[r] * Z[i] + k.eL[r] * R[i];
          }
        gemm(dQ.data(), D, M1.data(), C, false, k.K, D, false, C, D, C, 1.f, true);
        gemm(dK.data(), D, M1.data(), C, true, k.Q, D, false, C, D, C, 1.f, true);
        gemm(dK.data(), D, M2.data(), C, false, k.K, D, false, C, D, C, 1.f, true);
        gemm(dK.data(), D, M2.data(), C, true, k.K, D, false, C, D, C, 1.f, true);
        float run = 0.f;
        for (int r = k.L - 1; r >= 0; --r) {
          run += dG[r];
          const int64_t t = tok0 + r;
          store(io.dg, p.g_dtype, t * p.Hv + h, run);
          store(io.dbeta, p.beta_dtype, t * p.Hv + h, db[r]);
          for (int c = 0; c < D; ++c) {
            store(io.dv, p.qkv_dtype, (t * p.Hv + h) * D + c, k.b[r] * dVt[r * D + c]);
            dq[(ci * C + r) * D + c] += dQ[r * D + c];
            dk[(ci * C + r) * D + c] += dK[r * D + c];
          }
        }
        dS.swap(dSnew);
      }
      if (io.dh0_io.present()) store_state(io.dh0_io, n * p.Hv + h, dS.data());
    }
    for (int64_t r = 0; r < len; ++r)
      for (int c = 0; c < D; ++c) {
        const int64_t idx = ((tok_start + r) * p.Hqk + hq) * D + c;
        store(io.dq, p.qkv_dtype, idx, dq[r * D + c]);
        store(io.dk, p.qkv_dtype, idx, dk[r * D + c]);
      }
  });
}

}  // namespace flashgdn
