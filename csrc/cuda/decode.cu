// Decode kernel of the CUDA backend: the token-by-token GDN recurrence for a few
// tokens per sequence (T = 1..64: decode, speculative verification), on states that
// live in a slot pool and are updated in place. Launch code at the bottom.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "../backends.h"
#include "launch_util.cuh"

namespace flashgdn {
namespace {

using namespace cuda_util;

constexpr int D = kHeadDim;      // K = V = 128
constexpr int kThreads = 128;    // threads per block (= D: one q/k element per thread)
constexpr int kWarps = kThreads / 32;
constexpr float kL2Eps = 1e-6f;  // x / sqrt(|x|^2 + eps), as the chunk path's l2norm

struct DecodeParams {
  const void *q, *k, *v, *g, *beta;
  const void* indices;
  void* pool;  // [num_slots, Hv, 128, 128] of the state type, KV or VK layout
  void* o;
  int64_t B, T, Hqk, Hv, num_slots;
  float scale;
  int l2norm, g_dtype, beta_dtype, idx64;
};

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
  return __float2bfloat16(x);
}
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half(x); }

// Loads and stores of one state element type S (the pool's dtype), widened to fp32 on
// load and rounded to nearest on store: single elements, and kVec contiguous elements
// (16 bytes, one vector access) for the VK layout. 16-bit elements are unpacked with
// bit operations (element 0 in the low half of each 32-bit word).
template <typename S> struct StateElem;
template <> struct StateElem<float> {
  static constexpr int kVec = 4;
  static __device__ __forceinline__ float load(const float* p) { return *p; }
  static __device__ __forceinline__ void store(float* p, float x) { *p = x; }
  static __device__ __forceinline__ void load_vec(const float* p, float* x) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  }
  static __device__ __forceinline__ void store_vec(float* p, const float* x) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  }
};
template <typename S, typename Traits> struct StateElem16 {
  static constexpr int kVec = 8;
  static __device__ __forceinline__ float load(const S* p) { return to_float(*p); }
  static __device__ __forceinline__ void store(S* p, float x) { *p = from_float<S>(x); }
  static __device__ __forceinline__ void load_vec(const S* p, float* x) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = Traits::widen(static_cast<uint16_t>(w[i] & 0xffffu));
      x[2 * i + 1] = Traits::widen(static_cast<uint16_t>(w[i] >> 16));
    }
  }
  static __device__ __forceinline__ void store_vec(S* p, const float* x) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<uint32_t>(Traits::narrow(x[2 * i])) |
             (static_cast<uint32_t>(Traits::narrow(x[2 * i + 1])) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
};
struct Bf16Bits {
  static __device__ __forceinline__ float widen(uint16_t b) {
    return __uint_as_float(static_cast<uint32_t>(b) << 16);
  }
  static __device__ __forceinline__ uint16_t narrow(float x) {
    return __bfloat16_as_ushort(__float2bfloat16(x));
  }
};
struct HalfBits {
  static __device__ __forceinline__ float widen(uint16_t b) {
    return __half2float(__ushort_as_half(b));
  }
  static __device__ __forceinline__ uint16_t narrow(float x) {
    return __half_as_ushort(__float2half(x));
  }
};
template <> struct StateElem<__nv_bfloat16> : StateElem16<__nv_bfloat16, Bf16Bits> {};
template <> struct StateElem<__half> : StateElem16<__half, HalfBits> {};

// decode_kernel<T, S, BV, VK>: one block per (sequence b, value head h, block of BV value
// columns), 128 threads; grid.x = B * H_v * (128 / BV), the column block fastest.
// T: dtype of q/k/v/o; S: dtype of the state pool (fp32, bf16, fp16); VK: pool layout
// [.., V, K] (else [.., K, V]).
//
// Computes, for t = 0..T-1 with S the [K, V] state slice S[:, v0 : v0 + BV]:
//   (q, k l2-normalised when l2norm)  S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);
//   S = S + k_t u^T;  o_t = scale S^T q_t
// in the fused form u = beta (v - e S_old^T k), o = scale (e S_old^T q + (q.k) u),
// S = e S_old + k u^T (e = exp(g_t)): one block reduction over K per token.
//
// Reads q, k [B, T, H_qk, 128] (head h / (H_v / H_qk)), v [B, T, H_v, 128], g and beta
// [B, T, H_v] (fp32/bf16/fp16), state_indices [B] and the slice of state_pool[slot, h];
// writes o[b, :, h, v0 : v0 + BV] and the state slice back in place. The slice is held
// in fp32 registers for all T tokens: a 16-bit pool is widened once on load and
// rounded once on store. A negative slot writes zeros to o and touches no state; a
// slot >= num_slots writes NaN to o and touches no state (slots are only known on the
// device).
//
// Thread layout, KV pool ([K, V] rows are K): thread tid owns column j = tid % BV and
// rows i = rg + NR * ii (rg = tid / BV, NR = 128 / BV row groups, ii < BV), so every
// warp reads and writes whole 32-byte sectors of state rows. Column sums over K:
// shuffles over the row groups of a warp, then shared memory over the 4 warps.
// Thread layout, VK pool ([V, K] rows are V, K contiguous): thread tid owns column
// j = tid / NR and runs of kVec contiguous K elements (one 16-byte access each) at
// i = (rg + NR * c) * kVec + e (rg = tid % NR, c < BV / kVec), so the NR threads of a
// column read 16 NR contiguous bytes per access and sit in one warp: the column sums
// need shuffles only.
// Shared buffers are double-buffered by token parity (two barriers per token for KV,
// one for VK).
template <typename T, typename S, int BV, bool VK>
__global__ void __launch_bounds__(kThreads) decode_kernel(DecodeParams p) {
  static_assert(BV == 8 || BV == 16 || BV == 32, "column block of 8, 16 or 32");
  using E = StateElem<S>;
  constexpr int NR = kThreads / BV;  // row groups (threads sharing a column)
  constexpr int RPT = D / NR;        // rows per thread (= BV)
  constexpr int NCB = D / BV;        // column blocks per head
  constexpr int VEC = VK ? E::kVec : 1;  // contiguous K elements per access (VK)
  static_assert(RPT % VEC == 0, "whole 16-byte runs per thread");
  static_assert(!VK || NR <= 32, "VK: a column's threads share a warp");

  __shared__ __align__(16) float sq[2][D];
  __shared__ __align__(16) float sk[2][D];
  __shared__ float snorm[2][kWarps][3];   // per-warp |q|^2, |k|^2, q.k
  __shared__ float2 sdot[2][kWarps][BV];  // KV: per-warp partial (S^T k, S^T q)

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int col = VK ? tid / NR : tid % BV;
  const int rg = VK ? tid % NR : tid / BV;
  // K index of the thread's ii-th state element.
  auto row = [rg](int ii) { return VK ? (rg + NR * (ii / VEC)) * VEC + ii % VEC : rg + NR * ii; };
  const int64_t cb = blockIdx.x % NCB;
  const int64_t bh = blockIdx.x / NCB;
  const int64_t h = bh % p.Hv, b = bh / p.Hv;
  const int64_t hq = h / (p.Hv / p.Hqk);
  const int64_t v0 = cb * BV;

  const int64_t slot = p.idx64 ? static_cast<const int64_t*>(p.indices)[b]
                               : static_cast<const int32_t*>(p.indices)[b];
  T* o = static_cast<T*>(p.o);
  if (slot < 0 || slot >= p.num_slots) {
    const float fill = slot < 0 ? 0.f : __int_as_float(0x7fc00000);  // quiet NaN
    if (rg == 0)
      for (int64_t t = 0; t < p.T; ++t)
        o[((b * p.T + t) * p.Hv + h) * D + v0 + col] = from_float<T>(fill);
    return;
  }

  // KV: element (i, j) at i * D + j; VK: at j * D + i.
  S* const mat = static_cast<S*>(p.pool) + (slot * p.Hv + h) * D * D;
  float s[RPT];
  if constexpr (VK) {
    const S* src = mat + (v0 + col) * D;
#pragma unroll
    for (int c = 0; c < RPT / VEC; ++c) E::load_vec(src + (rg + NR * c) * VEC, s + c * VEC);
  } else {
#pragma unroll
    for (int ii = 0; ii < RPT; ++ii) s[ii] = E::load(mat + row(ii) * D + v0 + col);
  }

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  for (int64_t t = 0; t < p.T; ++t) {
    const int buf = static_cast<int>(t & 1);
    const int64_t tok = b * p.T + t;
    // q, k of this token into shared memory; |q|^2, |k|^2 and q.k over the block.
    const float qe = to_float(q[(tok * p.Hqk + hq) * D + tid]);
    const float ke = to_float(k[(tok * p.Hqk + hq) * D + tid]);
    sq[buf][tid] = qe;
    sk[buf][tid] = ke;
    float nq = qe * qe, nk = ke * ke, qk = qe * ke;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      nq += __shfl_xor_sync(0xffffffffu, nq, off);
      nk += __shfl_xor_sync(0xffffffffu, nk, off);
      qk += __shfl_xor_sync(0xffffffffu, qk, off);
    }
    if (lane == 0) {
      snorm[buf][warp][0] = nq;
      snorm[buf][warp][1] = nk;
      snorm[buf][warp][2] = qk;
    }
    // Per-token scalars and this thread's v element, loaded while the barrier waits.
    const int64_t th = tok * p.Hv + h;
    const float eg = __expf(load_as<float>(p.g, p.g_dtype, th));
    const float beta = load_as<float>(p.beta, p.beta_dtype, th);
    const float ve = to_float(v[th * D + v0 + col]);
    __syncthreads();

    nq = nk = qk = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      nq += snorm[buf][w][0];
      nk += snorm[buf][w][1];
      qk += snorm[buf][w][2];
    }
    const float rq = p.l2norm ? rsqrtf(nq + kL2Eps) : 1.f;
    const float rk = p.l2norm ? rsqrtf(nk + kL2Eps) : 1.f;

    // Column sums S_old^T k and S_old^T q (raw q, k; normalisation applied after).
    float da = 0.f, db = 0.f;
#pragma unroll
    for (int ii = 0; ii < RPT; ++ii) {
      const int i = row(ii);
      da = fmaf(s[ii], sk[buf][i], da);
      db = fmaf(s[ii], sq[buf][i], db);
    }
    if constexpr (VK) {  // the NR threads of a column are consecutive lanes of one warp
#pragma unroll
      for (int off = 1; off < NR; off *= 2) {
        da += __shfl_xor_sync(0xffffffffu, da, off);
        db += __shfl_xor_sync(0xffffffffu, db, off);
      }
    } else {
#pragma unroll
      for (int off = BV; off < 32; off *= 2) {
        da += __shfl_xor_sync(0xffffffffu, da, off);
        db += __shfl_xor_sync(0xffffffffu, db, off);
      }
      if (lane < BV) sdot[buf][warp][col] = make_float2(da, db);
      __syncthreads();

      da = db = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float2 x = sdot[buf][w][col];
        da += x.x;
        db += x.y;
      }
    }
    const float u = beta * (ve - eg * (da * rk));
    if (rg == 0)
      o[th * D + v0 + col] = from_float<T>(p.scale * (eg * (db * rq) + (qk * rq * rk) * u));
    const float uk = u * rk;  // S += (rk k_raw) u^T
#pragma unroll
    for (int ii = 0; ii < RPT; ++ii) s[ii] = fmaf(sk[buf][row(ii)], uk, eg * s[ii]);
  }

  if constexpr (VK) {
    S* dst = mat + (v0 + col) * D;
#pragma unroll
    for (int c = 0; c < RPT / VEC; ++c) E::store_vec(dst + (rg + NR * c) * VEC, s + c * VEC);
  } else {
#pragma unroll
    for (int ii = 0; ii < RPT; ++ii) E::store(mat + row(ii) * D + v0 + col, s[ii]);
  }
}

// Value columns per block: the widest block that still gives each SM about four
// blocks (small batches need narrow blocks to spread the state traffic).
// FLASHGDN_DECODE_BV = 8 | 16 | 32 overrides (for benchmarking).
int decode_column_block(const DecodeProblem& p, int sms) {
  if (const char* e = std::getenv("FLASHGDN_DECODE_BV")) {
    const int bv = std::atoi(e);
    if (bv == 8 || bv == 16 || bv == 32) return bv;
  }
  const int64_t pairs = p.B * p.Hv;
  if (pairs * (D / 32) >= 4LL * sms) return 32;
  if (pairs * (D / 16) >= 4LL * sms) return 16;
  return 8;
}

template <typename T, typename S, int BV, bool VK>
void launch(const DecodeParams& dp, cudaStream_t st) {
  const int64_t blocks = dp.B * dp.Hv * (D / BV);
  if (blocks > 0x7fffffffLL) throw Error("decode: too many sequences x heads for one launch");
  decode_kernel<T, S, BV, VK><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(dp);
  check_cuda(cudaGetLastError(), "decode_kernel launch");
}

template <typename T, typename S, bool VK>
void launch_bv(const DecodeParams& dp, int bv, cudaStream_t st) {
  if (bv == 32) launch<T, S, 32, VK>(dp, st);
  else if (bv == 16) launch<T, S, 16, VK>(dp, st);
  else launch<T, S, 8, VK>(dp, st);
}

// Dispatch on the pool's dtype and layout.
template <typename T>
void launch_state(const DecodeParams& dp, const StateBuf& pool, int bv, cudaStream_t st) {
  const bool vk = pool.layout == FLASHGDN_STATE_LAYOUT_VK;
  switch (pool.dtype) {
    case FLASHGDN_DTYPE_F32:
      return vk ? launch_bv<T, float, true>(dp, bv, st) : launch_bv<T, float, false>(dp, bv, st);
    case FLASHGDN_DTYPE_BF16:
      return vk ? launch_bv<T, __nv_bfloat16, true>(dp, bv, st)
                : launch_bv<T, __nv_bfloat16, false>(dp, bv, st);
    default:
      return vk ? launch_bv<T, __half, true>(dp, bv, st) : launch_bv<T, __half, false>(dp, bv, st);
  }
}

}  // namespace

void cuda_decode(const DecodeProblem& p, void* stream) {
  if (p.B == 0) return;
  DeviceGuard guard(p.device_id);
  DecodeParams dp{};
  dp.q = p.q;
  dp.k = p.k;
  dp.v = p.v;
  dp.g = p.g;
  dp.beta = p.beta;
  dp.indices = p.indices;
  dp.pool = p.pool.data;
  dp.o = p.o;
  dp.B = p.B;
  dp.T = p.T;
  dp.Hqk = p.Hqk;
  dp.Hv = p.Hv;
  dp.num_slots = p.num_slots;
  dp.scale = p.scale;
  dp.l2norm = p.l2norm ? 1 : 0;
  dp.g_dtype = p.g_dtype;
  dp.beta_dtype = p.beta_dtype;
  dp.idx64 = p.idx_dtype == FLASHGDN_DTYPE_I64 ? 1 : 0;
  const int bv = decode_column_block(p, sm_count(p.device_id));
  auto st = static_cast<cudaStream_t>(stream);
  if (p.qkv_dtype == FLASHGDN_DTYPE_BF16) launch_state<__nv_bfloat16>(dp, p.pool, bv, st);
  else launch_state<__half>(dp, p.pool, bv, st);
}

}  // namespace flashgdn
