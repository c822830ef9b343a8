// Shared device helpers of the CUDA backend: element conversion, the chunk
// locator (which sequence and tokens a chunk index covers), and `Tile`, the
// block-wide fp32 matrix product from shared memory in which each of the 256
// threads owns an RM x CN register micro-tile of the M x N result.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flashgdn {
namespace cuda {

constexpr int D = 128;     // head dim K = V
constexpr int C = 64;      // chunk length
constexpr int NT = 256;    // threads per block of every kernel
constexpr int LDD = D + 1; // padded leading dims of fp32 smem tiles (odd: no bank conflicts)
constexpr int LDC = C + 1;
constexpr int BV = 32;     // value columns per quarter of a state in grad_chunk_kernel
constexpr int LDV = BV + 1;
// The sequential passes take 8, 16 or 32 value columns per block (template BW, smem
// leading dim BW + 1), chosen by the launcher so that small head counts fill the GPU.
template <int BW> struct ColBlock {
  static_assert(BW == 8 || BW == 16 || BW == 32, "column block of 8, 16 or 32");
  static constexpr int LD = BW + 1;
  static constexpr int CN = BW / 8;  // columns per thread in the C x BW and D x BW tiles
};

// dtype codes shared with the host (flashgdn_dtype values)
enum : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

// g, beta and their gradients may each be fp32, bf16 or fp16 (runtime dtype).
__device__ __forceinline__ float load_scalar(const void* p, int dtype, int64_t i) {
  if (dtype == kF32) return static_cast<const float*>(p)[i];
  if (dtype == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return __half2float(static_cast<const __half*>(p)[i]);
}
__device__ __forceinline__ void store_scalar(void* p, int dtype, int64_t i, float x) {
  if (dtype == kF32) static_cast<float*>(p)[i] = x;
  else if (dtype == kBF16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(x);
  else static_cast<__half*>(p)[i] = __float2half(x);
}

// Sequence layout of a call: either B fixed-length rows or packed cu_seqlens.
struct SeqLayout {
  const void* cu_seqlens;        // null: fixed length T per sequence
  int cu_is64;
  int64_t T;                     // per-sequence length without cu_seqlens
  int64_t N;                     // sequences
  const int64_t* chunk_offsets;  // [N + 1] first global chunk of each sequence (varlen)
  const int* error;              // set by the planner when cu_seqlens is invalid (varlen)

  __device__ __forceinline__ int64_t cu(int64_t i) const {
    return cu_is64 ? static_cast<const int64_t*>(cu_seqlens)[i]
                   : static_cast<int64_t>(static_cast<const int32_t*>(cu_seqlens)[i]);
  }
  __device__ __forceinline__ bool failed() const { return error != nullptr && *error != 0; }
  __device__ __forceinline__ int64_t seq_start(int64_t n) const {
    return cu_seqlens ? cu(n) : n * T;
  }
  __device__ __forceinline__ int64_t seq_len(int64_t n) const {
    return cu_seqlens ? cu(n + 1) - cu(n) : T;
  }
  __device__ __forceinline__ int64_t first_chunk(int64_t n) const {
    return cu_seqlens ? chunk_offsets[n] : n * ((T + C - 1) / C);
  }
};

struct ChunkRef {
  int64_t seq, tok0;
  int L;  // valid rows, 1..64; 0 when the chunk index is past the last chunk
};

// Tokens in chunk ci (tokens ci * C .. ci * C + C - 1) of a sequence of len tokens: C, or
// fewer for the last chunk.
__device__ __forceinline__ int chunk_rows(int64_t len, int64_t ci) {
  const int64_t rem = len - ci * C;
  return static_cast<int>(rem < C ? rem : C);
}

// Maps a global chunk index to its sequence and first token.
__device__ __forceinline__ ChunkRef locate_chunk(const SeqLayout& s, int64_t c) {
  ChunkRef r{0, 0, 0};
  int64_t n;
  if (!s.cu_seqlens) {
    const int64_t per = (s.T + C - 1) / C;
    if (per == 0) return r;
    n = c / per;
    if (n >= s.N) return r;
  } else {
    if (c >= s.chunk_offsets[s.N]) return r;
    int64_t lo = 0, hi = s.N - 1;  // last n with chunk_offsets[n] <= c
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (s.chunk_offsets[mid] <= c) lo = mid; else hi = mid - 1;
    }
    n = lo;
  }
  const int64_t local = c - s.first_chunk(n);
  r.seq = n;
  r.tok0 = s.seq_start(n) + local * C;
  r.L = chunk_rows(s.seq_len(n), local);
  return r;
}

// dst[r][c] (ld `ldd`) = src[r * row_stride + c] for r < L, zero for L <= r < rows.
template <typename T>
__device__ __forceinline__ void load_rows(float* dst, int ldd, const T* src, int64_t row_stride,
                                          int L, int rows, int cols) {
  for (int e = threadIdx.x; e < rows * cols; e += NT) {
    const int r = e / cols, c = e % cols;
    dst[r * ldd + c] = r < L ? to_f(src[r * row_stride + c]) : 0.f;
  }
}

// dst[r][c] (ld LDD) = src[r * row_stride + c] for a full C x D chunk (zero rows r >= L),
// with 16-byte loads: every load of a thread is issued before the first shared store.
// Needs src and row_stride 16-byte aligned (checked by validation / the workspace carver).
__device__ __forceinline__ void unpack8(float* out, uint4 v, const __nv_bfloat16*) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void unpack8(float* out, uint4 v, const __half*) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void unpack8(float* out, uint4 v, const float*) {  // 4 floats
  const float4 f = *reinterpret_cast<const float4*>(&v);
  out[0] = f.x;
  out[1] = f.y;
  out[2] = f.z;
  out[3] = f.w;
}

template <typename T>
__device__ __forceinline__ void load_chunk(float* dst, const T* src, int64_t row_stride, int L) {
  constexpr int kPer = 16 / sizeof(T);         // elements per 16-byte load
  constexpr int kVecRow = D / kPer;            // loads per row
  constexpr int kIters = C * kVecRow / NT;     // loads per thread
  uint4 v[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int e = threadIdx.x + i * NT, r = e / kVecRow, c = (e % kVecRow) * kPer;
    v[i] = r < L ? *reinterpret_cast<const uint4*>(src + r * row_stride + c) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int e = threadIdx.x + i * NT, r = e / kVecRow, c = (e % kVecRow) * kPer;
    float f[8];
    unpack8(f, v[i], src);
#pragma unroll
    for (int j = 0; j < kPer; ++j) dst[r * LDD + c + j] = f[j];
  }
}

// An M x N fp32 result distributed over the block: thread t owns rows
// t / TX + i * TY (i < RM) and columns t % TX + j * TX (j < CN).
template <int M, int N, int RM, int CN>
struct Tile {
  static constexpr int TX = N / CN, TY = M / RM;
  static constexpr int kRows = RM, kCols = CN;  // a[kRows][kCols] per thread
  static_assert(TX * TY == NT, "tile must cover the block exactly");
  static_assert(32 % TX == 0, "a row's threads must sit in one warp");
  float a[RM][CN];

  __device__ __forceinline__ int row(int i) const { return threadIdx.x / TX + i * TY; }
  __device__ __forceinline__ int col(int j) const { return threadIdx.x % TX + j * TX; }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < CN; ++j) a[i][j] = 0.f;
  }
  // a += op(A) op(B) over an inner dimension KD. op(A)(r, k) = TA ? A[k*lda + r] : A[r*lda + k];
  // op(B)(k, c) = TB ? B[c*ldb + k] : B[k*ldb + c]. Operands live in shared memory.
  template <bool TA, bool TB, int KD>
  __device__ __forceinline__ void mma(const float* A, int lda, const float* B, int ldb) {
    int rr[RM], cc[CN];
#pragma unroll
    for (int i = 0; i < RM; ++i) rr[i] = row(i);
#pragma unroll
    for (int j = 0; j < CN; ++j) cc[j] = col(j);
#pragma unroll 4
    for (int k = 0; k < KD; ++k) {
      float av[RM], bv[CN];
#pragma unroll
      for (int i = 0; i < RM; ++i) av[i] = TA ? A[k * lda + rr[i]] : A[rr[i] * lda + k];
#pragma unroll
      for (int j = 0; j < CN; ++j) bv[j] = TB ? B[cc[j] * ldb + k] : B[k * ldb + cc[j]];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < CN; ++j) a[i][j] = fmaf(av[i], bv[j], a[i][j]);
    }
  }
  // Sum of x over the TX threads that share a row (result valid in every one of them).
  static __device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int o = TX / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
  }
  __device__ __forceinline__ bool row_leader() const { return threadIdx.x % TX == 0; }
};


// Ps[r][s] = (Q K^T)[r, s] exp(G_r - G_s) for s <= r, else 0 (C x C, ld LDC).
__device__ __forceinline__ void decayed_qk(float* Ps, const float* Qs, const float* Ks,
                                           const float* Gs) {
  Tile<C, C, 4, 4> qk;
  qk.zero();
  qk.mma<false, true, D>(Qs, LDD, Ks, LDD);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = qk.row(i), s = qk.col(j);
      Ps[r * LDC + s] = s <= r ? qk.a[i][j] * __expf(Gs[r] - Gs[s]) : 0.f;
    }
}

// A D x BW block (value columns vb..vb+BW) of a D x D state in global memory, to and
// from shared memory (ld BW + 1). A null source reads as zeros.
template <int BW>
__device__ __forceinline__ void load_state_block(float* dst, const float* src, int vb) {
  for (int e = threadIdx.x; e < D * BW; e += NT) {
    const int r = e / BW, c = e % BW;
    dst[r * (BW + 1) + c] = src ? src[r * D + vb + c] : 0.f;
  }
}
template <int BW>
__device__ __forceinline__ void store_state_block(float* dst, const float* src, int vb) {
  for (int e = threadIdx.x; e < D * BW; e += NT) {
    const int r = e / BW, c = e % BW;
    dst[r * D + vb + c] = src[r * (BW + 1) + c];
  }
}

}  // namespace cuda
}  // namespace flashgdn
