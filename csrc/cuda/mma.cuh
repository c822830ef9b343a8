// Warp-level tensor-core helpers of the forward kernels: TF32 mma.sync (m16n8k8,
// fp32 accumulate), fp16 mma.sync (m16n8k16) with ldmatrix fragments, fragment loads
// from shared memory, cp.async copies.
//
// Fragment convention ("paired k"): inside one 8-wide k step, a thread (g = lane / 4,
// t = lane % 4) holds the k elements 2t and 2t + 1 of its rows (A) or column (B) as the
// tf32 k slots t and t + 4. The product is the same because A and B use the same
// permutation of k. The pair is contiguous in memory when a tile is stored k-contiguous
// (A as [row][k], B as [col][k]), so a fragment is one 64-bit (fp32) or 32-bit (bf16/fp16)
// shared load per row, and bf16/fp16 values become exact tf32 operands by widening.
// fp32 tiles read with paired loads use a leading dimension = 8 (mod 32) words; 16-bit
// tiles use 136 elements per 128-wide row (68 words = 4 mod 32). Both are conflict free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flashgdn {
namespace cuda {

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// fp32 -> tf32 with round-to-nearest (the tensor core would otherwise truncate).
__device__ __forceinline__ float round_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

// d += a b, m16n8k8, tf32 inputs, fp32 accumulators
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two 16-bit values packed in one register -> two exact tf32 operands (first, second).
__device__ __forceinline__ void widen2(uint32_t v, uint32_t& first, uint32_t& second,
                                       const __nv_bfloat16*) {
  first = v << 16;
  second = v & 0xffff0000u;
}
__device__ __forceinline__ void widen2(uint32_t v, uint32_t& first, uint32_t& second,
                                       const __half*) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v));
  first = __float_as_uint(f.x);
  second = __float_as_uint(f.y);
}

// A fragment (16 rows from row0, k step at k0) of a k-contiguous fp32 tile [row][k].
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const float* s, int ld, int row0,
                                       int k0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  const float2 x = *reinterpret_cast<const float2*>(s + (row0 + g) * ld + k0 + 2 * t);
  const float2 y = *reinterpret_cast<const float2*>(s + (row0 + g + 8) * ld + k0 + 2 * t);
  a[0] = __float_as_uint(x.x);
  a[2] = __float_as_uint(x.y);
  a[1] = __float_as_uint(y.x);
  a[3] = __float_as_uint(y.y);
}
// Same from a 16-bit tile [row][k].
template <typename T>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const T* s, int ld, int row0, int k0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  const uint32_t x = *reinterpret_cast<const uint32_t*>(s + (row0 + g) * ld + k0 + 2 * t);
  const uint32_t y = *reinterpret_cast<const uint32_t*>(s + (row0 + g + 8) * ld + k0 + 2 * t);
  widen2(x, a[0], a[2], s);
  widen2(y, a[1], a[3], s);
}
// frag_a / frag_b of an fp32 tile whose values are not tf32 yet: rounded to nearest here.
__device__ __forceinline__ void frag_a_rna(uint32_t (&a)[4], const float* s, int ld, int row0,
                                           int k0) {
  frag_a(a, s, ld, row0, k0);
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = __float_as_uint(round_tf32(__uint_as_float(a[i])));
}
// B fragment (8 columns from col0, k step at k0) of a k-contiguous fp32 tile [col][k].
__device__ __forceinline__ void frag_b(uint32_t (&b)[2], const float* s, int ld, int col0,
                                       int k0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  const float2 x = *reinterpret_cast<const float2*>(s + (col0 + g) * ld + k0 + 2 * t);
  b[0] = __float_as_uint(x.x);
  b[1] = __float_as_uint(x.y);
}
template <typename T>
__device__ __forceinline__ void frag_b(uint32_t (&b)[2], const T* s, int ld, int col0, int k0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  const uint32_t x = *reinterpret_cast<const uint32_t*>(s + (col0 + g) * ld + k0 + 2 * t);
  widen2(x, b[0], b[1], s);
}

// Fragments of the transpose of a 16-bit tile stored [k][i] (i contiguous): ldmatrix.trans
// yields the paired-k layout directly. A fragment of A(i, k) = X[k][i] for rows i0..i0+15,
// k0..k0+7; ld in elements (row stride 16 mod 128 bytes: conflict free for ld = 136).
template <typename T>
__device__ __forceinline__ void frag_a_trans(uint32_t (&a)[4], const T* s, int ld, int i0,
                                             int k0) {
  const int l = lane_id();
  // matrices: 0 = (k0..k0+7, i0..i0+7), 1 = (k0..k0+7, i0+8..i0+15)
  const T* p = s + (k0 + (l & 7)) * ld + i0 + ((l >> 3) & 1) * 8;
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t r0, r1;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr));
  widen2(r0, a[0], a[2], s);
  widen2(r1, a[1], a[3], s);
}
// B fragment of B(k, n) = X[k][n] (n contiguous, 16-bit) for columns n0..n0+7, k0..k0+7.
template <typename T>
__device__ __forceinline__ void frag_b_trans(uint32_t (&b)[2], const T* s, int ld, int n0,
                                             int k0) {
  const int l = lane_id();
  const T* p = s + (k0 + (l & 7)) * ld + n0;
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t r0;
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(r0)
               : "r"(addr));
  widen2(r0, b[0], b[1], s);
}

// ---- fp16 operands (m16n8k16, fp32 accumulation): the 10-bit mantissa of tf32 at twice
// its tensor rate, and whole fragments from ldmatrix (no widening). Standard fragment
// layout: A a0 = (g, 2t..2t+1), a1 = (g + 8, ..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..);
// B b0 = (k 2t..2t+1, n g), b1 = (k 2t + 8.., n g).

// d += a b, m16n8k16, fp16 inputs, fp32 accumulators
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b, m16n8k16, bf16 inputs, fp32 accumulators (same fragment layout as mma_f16)
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// m16n8k16 on the inputs' own 16-bit type (products exact, fp32 accumulation).
__device__ __forceinline__ void mma_16(float (&d)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2], const __half*) {
  mma_f16(d, a, b);
}
__device__ __forceinline__ void mma_16(float (&d)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2], const __nv_bfloat16*) {
  mma_bf16(d, a, b);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A fragment (rows row0..row0+15, k0..k0+15) of a 16-bit tile stored [row][k].
__device__ __forceinline__ void frag_a16(uint32_t (&a)[4], const __half* s, int ld, int row0,
                                         int k0) {
  const int l = lane_id();
  const __half* p = s + (row0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + k0 + (l >> 4) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(smem_addr(p)));
}
// A fragment of A(i, k) = X[k][i] (the transpose of a tile stored [k][i], i contiguous),
// rows i0..i0+15, k0..k0+15.
__device__ __forceinline__ void frag_a16_trans(uint32_t (&a)[4], const __half* s, int ld, int i0,
                                               int k0) {
  const int l = lane_id(), m = l >> 3;
  const __half* p = s + (k0 + (l & 7) + (m >> 1) * 8) * ld + i0 + (m & 1) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(smem_addr(p)));
}
// B fragments of B(k, n) = X[n][k] (a tile stored [n][k], k contiguous, e.g. K for K^T),
// k0..k0+15, columns n0..n0+7 (b0) and n0+8..n0+15 (b1). The same addresses per 8 x 8
// matrix as frag_a16 on rows n0..n0+15, with matrices 1 and 2 swapped so that each B
// fragment lands in two consecutive registers (frag_a16's a0, a2 / a1, a3 pairs cost ptxas
// a register move each before the mma).
__device__ __forceinline__ void frag_b16_pair(uint32_t (&b0)[2], uint32_t (&b1)[2],
                                              const __half* s, int ld, int n0, int k0) {
  const int l = lane_id();
  const __half* p = s + (n0 + (l & 7) + (l >> 4) * 8) * ld + k0 + ((l >> 3) & 1) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1])
               : "r"(smem_addr(p)));
}
// B fragments of B(k, n) = X[k][n] (a tile stored [k][n], n contiguous), k0..k0+15:
// columns n0..n0+7 (x2) or n0..n0+7 and n0+8..n0+15 (x4: b0 then b1).
__device__ __forceinline__ void frag_b16_trans(uint32_t (&b)[2], const __half* s, int ld, int n0,
                                               int k0) {
  const int l = lane_id();
  const __half* p = s + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + n0;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(b[0]), "=r"(b[1])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void frag_b16_trans2(uint32_t (&b0)[2], uint32_t (&b1)[2],
                                                const __half* s, int ld, int n0, int k0) {
  const int l = lane_id(), m = l >> 3;
  const __half* p = s + (k0 + (l & 7) + (m & 1) * 8) * ld + n0 + (m >> 1) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1])
               : "r"(smem_addr(p)));
}
// Two fp32 values -> one register of two fp16 (round to nearest).
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// x, y -> (hi, lo) fp16 pairs with hi = fp16(x), lo = fp16(x - hi) (round to nearest): the
// two-term split whose products Ml Bh + Mh Bl + Mh Bh give fp32's accuracy on fp16 mma.
__device__ __forceinline__ void split_half2(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x, y);
  const float2 f = __half22float2(h);
  const __half2 l = __floats2half2_rn(x - f.x, y - f.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// Accumulator element e (0..3) of an m16n8 tile: row g (+8 for e >= 2), column 2t (+1 odd e).
__device__ __forceinline__ int acc_row(int e) { return (lane_id() >> 2) + (e >= 2 ? 8 : 0); }
__device__ __forceinline__ int acc_col(int e) { return 2 * (lane_id() & 3) + (e & 1); }

// fp16 A fragment (m16 k16) of two adjacent m16n8 fp32 accumulator tiles (columns k0..k0+7
// and k0+8..k0+15): an accumulator becomes the next product's A operand in registers; rows
// g and g + 8 multiplied by fg and fg8 on the way.
__device__ __forceinline__ void acc_to_a16(uint32_t (&a)[4], const float (&lo)[4],
                                           const float (&hi)[4], float fg = 1.f,
                                           float fg8 = 1.f) {
  a[0] = pack_half2(fg * lo[0], fg * lo[1]);
  a[1] = pack_half2(fg8 * lo[2], fg8 * lo[3]);
  a[2] = pack_half2(fg * hi[0], fg * hi[1]);
  a[3] = pack_half2(fg8 * hi[2], fg8 * hi[3]);
}

// Four 8 x 8 16-bit matrices from registers into shared memory, transposed (sm_90).
__device__ __forceinline__ void stmatrix_x4_trans(void* p, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(
                   smem_addr(p)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Four 8 x 8 16-bit matrices from registers into shared memory as they are (sm_90): with
// frag_a16's addresses, the A fragment that frag_a16 reads back (the same registers).
__device__ __forceinline__ void stmatrix_x4(void* p, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(
                   smem_addr(p)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
// An A fragment (frag_a16's rows row0..row0+15, k0..k0+15) into a 16-bit tile [row][k].
__device__ __forceinline__ void store_frag_a16(__half* s, int ld, int row0, int k0,
                                               const uint32_t (&a)[4]) {
  const int l = lane_id();
  stmatrix_x4(s + (row0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + k0 + (l >> 4) * 8, a[0], a[1],
              a[2], a[3]);
}
// The 16 x 16 matrix whose A fragment is `a` (frag_a16's layout), transposed into a 16-bit
// tile [row][col] at rows row0..row0+15, columns col0..col0+15 (stmatrix .trans: lane l gives
// row l % 8 of 8 x 8 matrix l / 8, which lands at row offset 8 ((l / 16) % 2), column offset
// 8 ((l / 8) % 2)).
__device__ __forceinline__ void store_frag_a16_trans(__half* s, int ld, int row0, int col0,
                                                     const uint32_t (&a)[4]) {
  const int l = lane_id();
  stmatrix_x4_trans(s + (row0 + (l & 7) + ((l >> 4) & 1) * 8) * ld + col0 + ((l >> 3) & 1) * 8,
                    a[0], a[1], a[2], a[3]);
}
// A barrier of `count` threads (whole warps) on named barrier `id` (1..15; 0 is
// __syncthreads').
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// This warp's arrival on named barrier `id` without waiting (the producer side of a
// bar.sync by other warps with the same count).
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// The registers a thread of this warpgroup may use from here on (sm_90a; every thread of the
// warpgroup executes it): more for one role, fewer for another, within the block's share.
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src));
}

// The cols kernels' transposed state block: warp w holds S^T (or dS^T), value columns
// v0 + (g, g + 8) (v0 = 16 w) as rows, keys 8 jn + (2t, 2t + 1) as columns, of a 128 x 128 state stored
// [key][value]. Loaded from src (null: zero) or, with `identity`, the identity; stored to dst.
__device__ __forceinline__ void load_state_cols(float (&acc)[16][4], const float* src,
                                                bool identity, int v0) {
#pragma unroll
  for (int jn = 0; jn < 16; ++jn)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = v0 + acc_row(e), key = 8 * jn + acc_col(e);
      acc[jn][e] = identity ? (v == key ? 1.f : 0.f) : src ? __ldcg(src + key * 128 + v) : 0.f;
    }
}
__device__ __forceinline__ void store_state_cols(float* dst, const float (&acc)[16][4], int v0) {
#pragma unroll
  for (int jn = 0; jn < 16; ++jn)
#pragma unroll
    for (int e = 0; e < 4; ++e) __stcg(dst + (8 * jn + acc_col(e)) * 128 + v0 + acc_row(e), acc[jn][e]);
}

// a += b over a warp's m16n8 accumulator tiles (the halves of a product whose k steps were
// split between two accumulator sets to shorten the dependent mma chains).
template <int N>
__device__ __forceinline__ void add_acc(float (&a)[N][4], const float (&b)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[j][e] += b[j][e];
}

// The 128 x (8 NS) block of a state (or dS) that the sequential passes keep in the
// accumulator registers of their 8 warps: warp w holds rows 16 w + (g, g + 8), columns
// 8 jn + (2t, 2t + 1) of the block, whose first column in the full 128 x 128 state is vb.
// Loads from src (row stride 128; null: zero) or, with `identity`, the identity's columns.
template <int NS>
__device__ __forceinline__ void load_acc_state(float (&acc)[NS][4], const float* src, int vb,
                                               bool identity) {
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int jn = 0; jn < NS; ++jn)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int i = 16 * warp + acc_row(e), c = 8 * jn + acc_col(e);
      float2 v = make_float2(0.f, 0.f);
      if (identity) v = make_float2(i == vb + c ? 1.f : 0.f, i == vb + c + 1 ? 1.f : 0.f);
      else if (src) v = __ldcg(reinterpret_cast<const float2*>(src + i * 128 + vb + c));
      acc[jn][e] = v.x;
      acc[jn][e + 1] = v.y;
    }
}
// Stores the block into dst (row stride 128), bypassing L1.
template <int NS>
__device__ __forceinline__ void store_acc_state(float* dst, const float (&acc)[NS][4], int vb) {
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int jn = 0; jn < NS; ++jn)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int i = 16 * warp + acc_row(e), c = vb + 8 * jn + acc_col(e);
      __stcg(reinterpret_cast<float2*>(dst + i * 128 + c), make_float2(acc[jn][e], acc[jn][e + 1]));
    }
}
// Writes the block transposed and tf32-rounded into a shared tile [8 NS][ld] (column c of
// the block is row c of the tile): the B operand of the next chunk's products.
template <int NS>
__device__ __forceinline__ void store_acc_state_smem_t(float* st, int ld, const float (&acc)[NS][4]) {
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int jn = 0; jn < NS; ++jn)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * warp + acc_row(e), c = 8 * jn + acc_col(e);
      st[c * ld + i] = round_tf32(acc[jn][e]);
    }
}

// Writes the block as fp16 into a shared tile [128][ld] (row i of the state is row i of the
// tile, columns contiguous): the B operand (ldmatrix.trans) of the fp16 pass's products.
template <int NS>
__device__ __forceinline__ void store_acc_state_smem_h(__half* st, int ld, const float (&acc)[NS][4]) {
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int jn = 0; jn < NS; ++jn)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int i = 16 * warp + acc_row(e), c = 8 * jn + acc_col(e);
      *reinterpret_cast<uint32_t*>(st + i * ld + c) = pack_half2(acc[jn][e], acc[jn][e + 1]);
    }
}

// cp.async: 16 bytes (zero-filled when !valid) and 4 bytes.
// Brings the 128-byte line holding p into L2 (no register written, nothing to wait for).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (sm_90; launch.cu launch_kernel): a kernel launched as the
// programmatic dependent of the one before it in its stream may start while that one
// runs. pdl_wait blocks until that kernel has completed and its memory is visible; it
// must come before the first read of anything the kernels of the context-parallel chain
// write (phase 1's summaries, seg_in, sub-segment records). pdl_trigger lets this grid's
// dependent start once every block of this grid has triggered or exited. Both do nothing
// in a kernel launched without the attribute (or without a dependent).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// The chain's order must hold past a grid whose blocks may all return without pdl_wait
// (e.g. sub_start_kernel where the device chose the sequential schedule): a grid's
// completion says nothing about the kernel before it unless some block waited for it, and
// the kernels after it (a programmatic dependent's pdl_wait, a plain launch) rely on that.
// So every kernel that may be launched as a programmatic dependent declares one of these
// first: its block (0, 0, 0) waits before it exits, and the grid completes only after the
// kernel before it.
struct PdlCompletion {
  __device__ ~PdlCompletion() {
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) pdl_wait();
  }
};

// Copies a ROWS x COLS tile (row r < L from src + r * stride, else zeros) into a shared
// tile with leading dimension LD, 16 bytes per cp.async, spread over the 256 threads of the
// block. The shape is known at compile time, so each thread's row and column come from
// its index once and every further piece costs one pointer increment (no divisions).
// cp_async_tile_by: the same spread over NTHR threads (tid in [0, NTHR)), e.g. one warpgroup.
// kWhole: every row exists (L == ROWS; L is not read): no zero-fill predicates, the copies
// in their plain 16-byte form. kLower (square 16-bit tiles): only the 16 x 16 blocks at or
// below the diagonal (FwdParams::tri16); the others are left as they were.
constexpr int kTileThreads = 256;
template <int ROWS, int COLS, int LD, int NTHR, bool kWhole = false, bool kLower = false,
          typename T>
__device__ __forceinline__ void cp_async_tile_by(T* dst, const T* src, int64_t stride, int L,
                                                 int tid) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
  constexpr int kPerRow = COLS / kPer;  // 16-byte pieces per row
  static_assert(COLS % kPer == 0 && NTHR % kPerRow == 0, "tile shape");
  static_assert(!kLower || (ROWS == COLS && sizeof(T) == 2), "lower blocks: square 16-bit tiles");
  constexpr int kRowStep = NTHR / kPerRow;  // rows one pass covers
  static_assert(!kWhole || ROWS % kRowStep == 0, "whole tiles: passes cover the rows exactly");
  constexpr int kPasses = (ROWS + kRowStep - 1) / kRowStep;
  const int r0 = tid / kPerRow;
  const int c = (tid % kPerRow) * kPer;
  const T* s = src + r0 * stride + c;
  T* d = dst + r0 * LD + c;
  const int64_t step = kRowStep * stride;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int r = r0 + i * kRowStep;
    if (kLower && c / 16 > r / 16) {
      // a block above the diagonal: not copied
    } else if constexpr (kWhole) {
      const uint32_t da = static_cast<uint32_t>(__cvta_generic_to_shared(d + i * kRowStep * LD));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(da), "l"(s));
    } else if (ROWS % kRowStep == 0 || r < ROWS) {
      cp_async16(d + i * kRowStep * LD, r < L ? s : src, r < L);
    }
    s += step;
  }
}
template <int ROWS, int COLS, int LD, bool kLower = false, typename T>
__device__ __forceinline__ void cp_async_tile(T* dst, const T* src, int64_t stride, int L) {
  cp_async_tile_by<ROWS, COLS, LD, kTileThreads, false, kLower>(dst, src, stride, L,
                                                                static_cast<int>(threadIdx.x));
}

// mbarriers in shared memory (CTA scope): a phase completes when its count of arrivals is
// in; waiters name the phase by its parity (the first phase has parity 0).
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar))
               : "memory");
}
// an arrival of this thread once all its earlier cp.async copies have landed (counted in the
// barrier's init count: .noinc)
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// This thread's arrival on `bar`, announcing `bytes` that asynchronous copies will count down
// (expect_tx): the issuer's half of a TMA / bulk copy's completion.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Bulk (TMA) load of `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte
// aligned) from global into shared memory, completing on `bar`: the issuing thread first
// announces the bytes (expect_tx, which is also its arrival), the copy's completion counts
// them down.
__device__ __forceinline__ void bulk_load(void* sdst, const void* gsrc, uint32_t bytes,
                                          uint64_t* bar) {
  mbar_arrive_expect_tx(bar, bytes);
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(smem_addr(sdst)), "l"(gsrc), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// Makes mbarrier initialisations visible to the async proxy (the bulk copies' completions).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// A 16-byte global store (a uint4 copy through registers may leave as four 4-byte ones).
__device__ __forceinline__ void st_global_16(void* dst, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// ---------------------------------------------------------------------------------------
// Bulk (TMA) stores from shared memory: one thread issues, the copy reads the shared
// source asynchronously. Writers fence their shared stores into the async proxy first
// (this fence: also before wgmma reads of shared memory that ordinary stores or cp.async
// wrote).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_store(void* gdst, const void* ssrc, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gdst),
               "r"(smem_addr(ssrc)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// The issuing thread's bulk stores have read their shared source (.read) / are complete.
template <int N = 0>
__device__ __forceinline__ void bulk_wait_read() {  // at most N newest groups still reading
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// ... all but the N newest groups are complete (their writes done)
template <int N>
__device__ __forceinline__ void bulk_wait_done() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Records of the 128-column sequential passes, read by grad_chunk_tc_kernel. Per chunk and
// value head (rec = chunk * H_v + h) the state h or dS (8 blocks of 16 value columns x 128
// keys, [key][16 values]) and the per-token U or dVt (8 blocks of 16 value columns x 64
// tokens, [token][16 values]), in fp16: block vb holds the values 16 vb .. 16 vb + 15,
// contiguous (4 KB / 2 KB), multiplied by a power of two that puts its largest magnitude in
// [2^14, 2^15): fp16 keeps 11 significant bits down to 2^-28 of the block's largest value,
// as the tf32 operands that read them. scale[rec * 8 + vb] is the factor back. Buffers are
// sized for the fp32 records of the other passes: a state record at half rec x D x D, a
// token record at half rec x C x D.
// A warp's staging: a state record block, then a token record block (the per-token record
// of a step goes out while the state's is still read; each waits only for the bulk store
// that left its half a step earlier).
// The power of two that puts amax (>= 0) in [2^14, 2^15), at most 2^126 (zero, subnormal or
// tiny amax) so that its inverse, written to inv, stays a normal float.
__device__ __forceinline__ float pow2_scale(float amax, float& inv) {
  // biased exponent be: amax in [2^(be-127), 2^(be-126)); scale 2^(141 - be)
  const int se = min(253, 268 - ((__float_as_int(amax) >> 23) & 0xff));
  inv = __int_as_float((254 - se) << 23);
  return __int_as_float(se << 23);
}
constexpr int kRecStageBytes = (D + C) * 16 * 2;
constexpr int kRecStageTokens = D * 16;  // halves: where the token record block's half starts
template <int ROWS, typename T>
__device__ __forceinline__ T* record_at(T* base, int64_t rec, bool rec16) {
  using H = std::conditional_t<std::is_const_v<T>, const __half, __half>;
  return rec16 ? reinterpret_cast<T*>(reinterpret_cast<H*>(base) + rec * ROWS * D)
               : base + rec * ROWS * D;
}

// The largest magnitude over a warp's NJ m16n8 fp32 tiles, as its bits: a tree over the
// thread's values (a short dependent chain), then one warp reduction of the bits (as unsigned
// integers, non-negative floats order like their magnitudes).
template <int NJ>
__device__ __forceinline__ unsigned warp_amax_bits(const float (&x)[NJ][4]) {
  float mx[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    mx[j] = fmaxf(fmaxf(fabsf(x[j][0]), fabsf(x[j][1])), fmaxf(fabsf(x[j][2]), fabsf(x[j][3])));
#pragma unroll
  for (int j = NJ - 1; j >= 1; --j)  // a heap's tree: node i takes its children 2i + 1, 2i + 2
    mx[(j - 1) / 2] = fmaxf(mx[(j - 1) / 2], mx[j]);
  return __reduce_max_sync(0xffffffffu, __float_as_uint(mx[0]));
}

// The warp's value columns v0 .. v0 + 15 of x (NJ m16n8 tiles: values v0 + g (+8), rows 8 j
// + 2t (+1): keys of a state, tokens of U / dVt) as record block v0 / 16 at dst: scaled by
// the power of two of its largest magnitude (amax_bits: warp_amax_bits(x)), fp16, transposed
// into the warp's staging (stage: its half for NJ, kRecStageBytes) by stmatrix, then one
// bulk store of NJ x 256 bytes (lane 0, which also writes the factor back, times `back`, to
// *scale_dst: x holds the values times 1 / back). With per-row factors (`rows`: x's rows g
// and g + 8 hold their values times 1 / rows[0], 1 / rows[1]), amax_bits is the largest
// magnitude of the values themselves and each row is multiplied by its own factor too. The
// warp's bulk store from the same half (all but its newest one, which left from the other
// half) has read it before it is written (lane 0 waits).
template <int NJ>
__device__ __forceinline__ void store_record_cols(__half* dst, float* scale_dst,
                                                  const float (&x)[NJ][4], __half* stage,
                                                  unsigned amax_bits, float back = 1.f,
                                                  const float* rows = nullptr) {
  static_assert(NJ == D / 8 || NJ == C / 8, "record block shape");
  if (NJ == C / 8) stage += kRecStageTokens;
  if (lane_id() == 0) bulk_wait_read<1>();
  __syncwarp();
  float inv;
  const float sc = pow2_scale(__uint_as_float(amax_bits), inv);
  // (a row's product can overflow only where its values are zero or tiny: bounded, not inf)
  const float lo = rows ? fminf(sc * rows[0], 0x1p126f) : sc;
  const float hi = rows ? fminf(sc * rows[1], 0x1p126f) : sc;
  const int l = lane_id(), m = l >> 3, i = l & 7;
#pragma unroll
  for (int jp = 0; jp < NJ / 2; ++jp)
    stmatrix_x4_trans(stage + (16 * jp + (m >> 1) * 8 + i) * 16 + (m & 1) * 8,
                      pack_half2(lo * x[2 * jp][0], lo * x[2 * jp][1]),
                      pack_half2(hi * x[2 * jp][2], hi * x[2 * jp][3]),
                      pack_half2(lo * x[2 * jp + 1][0], lo * x[2 * jp + 1][1]),
                      pack_half2(hi * x[2 * jp + 1][2], hi * x[2 * jp + 1][3]));
  fence_proxy_async();
  __syncwarp();
  if (l == 0) {
    bulk_store(dst, stage, NJ * 256);
    *scale_dst = inv * back;
  }
}
template <int NJ>
__device__ __forceinline__ void store_record_cols(__half* dst, float* scale_dst,
                                                  const float (&x)[NJ][4], __half* stage) {
  store_record_cols(dst, scale_dst, x, stage, warp_amax_bits(x));
}

}  // namespace cuda
}  // namespace flashgdn
