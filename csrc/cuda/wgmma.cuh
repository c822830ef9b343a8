// Warpgroup tensor-core helpers (sm_90a): wgmma.mma_async m64nNk8 with tf32 operands and
// fp32 accumulators, shared-memory matrix descriptors, and the core-matrix tile layout the
// descriptors read.
//
// Layout ("interleaved", no swizzle). tf32 wgmma reads its shared operands K-major only: a
// tile of ROWS rows (M rows of A, or N columns of B) by KD k values is stored as core
// matrices of 8 rows x 4 k (128 contiguous bytes, row r at byte 16 (r % 8)); the core
// matrix of row group r / 8 and k group k / 4 starts at byte 128 ((r / 8) (KD / 4) + k / 4).
// The descriptor's leading byte offset (between k-adjacent core matrices) is then 128 and its
// stride byte offset (between row groups) 32 KD; one k8 instruction spans two core matrices,
// so the k step advances the start address by 256 bytes. Element (r, k) is at float index
// core_index<KD>(r, k); a 16-byte piece (r, 4 kq .. 4 kq + 3) of a row is contiguous.
//
// Register fragments. The accumulator of m64nN holds, in warp w of the warpgroup, rows
// 16 w + g and 16 w + g + 8 (g = lane / 4, t = lane % 4) and columns 8 j + 2 t (+1) as
// d[j][0..3] (the m16n8 accumulator layout, stacked). A from registers has the m16n8k8 tf32
// layout per warp: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4). A register A
// may use any permutation of k within each 8-step if the shared B tile stores its k values
// permuted the same way (mma.cuh's "paired k": slot t <-> k 2t, slot t + 4 <-> k 2t + 1).
//
// Ordering: shared writes of ordinary (generic-proxy) stores and cp.async become visible to
// wgmma after fence_proxy_async() (mma.cuh) by the writing thread and a barrier;
// wgmma_fence() before the first wgmma of a group whose accumulators or A registers were
// touched by other instructions; wgmma_wait<N>() before reading accumulators. fence_acc()
// keeps the compiler from moving accesses of the registers a wgmma group uses across the
// asynchronous section.
#pragma once

#include <cstdint>

#include "mma.cuh"

namespace flashgdn {
namespace cuda {

template <int KD>
__device__ __forceinline__ int core_index(int r, int k) {
  return (((r >> 3) * (KD / 4) + (k >> 2)) << 5) + ((r & 7) << 2) + (k & 3);
}

// Shared-memory matrix descriptor of a core-matrix tile with KD k values per row, starting
// at k step k8 (8 k values per step).
template <int KD>
__device__ __forceinline__ uint64_t core_desc(const float* tile, int k8) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile)) + 256u * k8;
  constexpr uint64_t lbo = 128, sbo = 32 * KD;
  return static_cast<uint64_t>((addr & 0x3ffff) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int NT>
__device__ __forceinline__ void fence_acc(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
__device__ __forceinline__ void fence_frag(uint32_t (&a)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[e])::"memory");
}

// d (+)= A B, m64 n(8 NT) k8, A and B from shared memory (descriptors); accumulate when acc.
template <int NT>
__device__ __forceinline__ void wgmma_ss(float (&d)[NT][4], uint64_t da, uint64_t db, bool acc);
// d (+)= A B with A from registers.
template <int NT>
__device__ __forceinline__ void wgmma_rs(float (&d)[NT][4], const uint32_t (&a)[4], uint64_t db,
                                         bool acc);

template <>
__device__ __forceinline__ void wgmma_ss<2>(float (&d)[2][4], uint64_t da, uint64_t db, bool acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),
        "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "l"(da), "l"(db), "r"(static_cast<int>(acc)));
}
template <>
__device__ __forceinline__ void wgmma_ss<4>(float (&d)[4][4], uint64_t da, uint64_t db, bool acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),
        "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),
        "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db), "r"(static_cast<int>(acc)));
}
template <>
__device__ __forceinline__ void wgmma_rs<2>(float (&d)[2][4], const uint32_t (&a)[4], uint64_t db,
                                            bool acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),
        "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(static_cast<int>(acc)));
}
template <>
__device__ __forceinline__ void wgmma_rs<4>(float (&d)[4][4], const uint32_t (&a)[4], uint64_t db,
                                            bool acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),
        "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),
        "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(static_cast<int>(acc)));
}

// A fragment in natural k order (a0 (g, k0 + t), a2 (g, k0 + t + 4), rows row0 + g (+8)) of
// a 16-bit tile [row][k]: exact tf32 operands for a register-A wgmma whose shared B tile
// stores k in order.
__device__ __forceinline__ uint32_t tf32_bits(__nv_bfloat16 x) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(x)) << 16;
}
__device__ __forceinline__ uint32_t tf32_bits(__half x) { return __float_as_uint(__half2float(x)); }
template <typename T>
__device__ __forceinline__ void frag_a_natural(uint32_t (&a)[4], const T* s, int ld, int row0,
                                               int k0) {
  const T* p = s + (row0 + (lane_id() >> 2)) * ld + k0 + (lane_id() & 3);
  a[0] = tf32_bits(p[0]);
  a[1] = tf32_bits(p[8 * ld]);
  a[2] = tf32_bits(p[4]);
  a[3] = tf32_bits(p[8 * ld + 4]);
}

// The k slot of k value k in mma.cuh's paired order (within each 8-step: k 2t -> slot t,
// k 2t + 1 -> slot t + 4): where a B tile stores k when A comes from frag_a_trans.
__device__ __forceinline__ int paired_slot(int k) {
  return (k & ~7) | ((k & 7) >> 1) | ((k & 1) << 2);
}

// The warps' register-held state block (mma.cuh load_acc_state's layout: warp w rows
// 16 w + (g, g + 8), columns 8 jn + (2t, 2t + 1)) written transposed and tf32-rounded into
// a core-matrix tile [8 NS][128]: S^T, the B operand of the next chunk's W S and Q S.
template <int NS>
__device__ __forceinline__ void store_acc_state_core_t(float* st, const float (&acc)[NS][4]) {
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int jn = 0; jn < NS; ++jn)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      st[core_index<128>(8 * jn + acc_col(e), 16 * warp + acc_row(e))] = round_tf32(acc[jn][e]);
}

// Copies a ROWS x KD fp32 tile (row r < L from src + r * stride, else zeros) into the
// core-matrix layout, 16 bytes per cp.async over the 256 threads of the block. Piece i of
// the destination (floats 4 i .. 4 i + 3) is row 8 (i / (2 KD)) + i % 8, k 4 ((i / 8) % (KD / 4)):
// eight consecutive threads fill one core matrix, and a warp reads 8 rows x 64 bytes.
template <int ROWS, int KD>
__device__ __forceinline__ void cp_async_core_tile(float* dst, const float* src, int64_t stride,
                                                   int L) {
  static_assert((KD == 64 || KD == 128) && ROWS % (1024 / KD) == 0, "tile shape");
  constexpr int kRowsPerPass = 1024 / KD, kPasses = ROWS / kRowsPerPass;
  const int i = threadIdx.x;
  const int r0 = 8 * (i / (2 * KD)) + (i & 7), k = 4 * ((i >> 3) % (KD / 4));
  const float* s = src + r0 * stride + k;
  float* d = dst + 4 * i;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = r0 + pass * kRowsPerPass;
    cp_async16(d + 1024 * pass, r < L ? s : src, r < L);
    s += kRowsPerPass * stride;
  }
}


// ---- fp16 operands (m64nNk16, fp32 accumulators), A from registers (the m16n8k16 A fragment
// layout per warp: warp w of the warpgroup holds rows 16 w ..), B from shared memory through a
// descriptor; kTransB: B is N-major (its N values contiguous in the core matrices' 16-byte
// rows) instead of K-major. The core-matrix tile of 16-bit values: 8 rows x 8 values (16
// bytes a row, 128 bytes a core matrix); f16_core_desc gives the byte offsets between core
// matrices along K (lbo) and along M or N (sbo), whichever the operand's major mode reads.
template <int N, bool kTransB = false>
__device__ __forceinline__ void wgmma_rs_f16(float (&d)[N / 8][4], const uint32_t (&a)[4],
                                             uint64_t db, bool acc);
__device__ __forceinline__ uint64_t f16_core_desc(const void* tile, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  return static_cast<uint64_t>((addr & 0x3ffff) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}
// m64n64k16 (A from registers): kTransB reads B MN-major (the two specialisations below).
template <bool kTransB>
__device__ __forceinline__ void wgmma_rs_f16_n64(float (&d)[8][4], const uint32_t (&a)[4],
                                                 uint64_t db, bool acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(static_cast<int>(acc)),
        "n"(kTransB ? 1 : 0));
}
template <>
__device__ __forceinline__ void wgmma_rs_f16<64, false>(float (&d)[8][4], const uint32_t (&a)[4],
                                                    uint64_t db, bool acc) {
  wgmma_rs_f16_n64<false>(d, a, db, acc);
}
template <>
__device__ __forceinline__ void wgmma_rs_f16<64, true>(float (&d)[8][4], const uint32_t (&a)[4],
                                                   uint64_t db, bool acc) {
  wgmma_rs_f16_n64<true>(d, a, db, acc);
}
template <>
__device__ __forceinline__ void wgmma_rs_f16<128, true>(float (&d)[16][4], const uint32_t (&a)[4],
                                                    uint64_t db, bool acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(static_cast<int>(acc)));
}

// Copies a ROWS x KD 16-bit tile (row r < L from src + r * stride, else zeros) into the
// core-matrix layout: core matrix (r / 8, k / 8) at 16-byte index 8 ((r / 8) (KD / 8) + k / 8),
// its row r % 8 at 16 (r % 8) bytes. Piece i (16 bytes) of the destination is row
// 8 (i / KD) + i % 8, values 8 ((i / 8) % (KD / 8)) ..: eight consecutive threads fill one
// core matrix, a warp reads 8 rows x 64 bytes.
// cp_async_core16_by: the same spread over NTHR threads (tid in [0, NTHR)), e.g. one warpgroup.
template <int ROWS, int KD, int NTHR = 256, typename T>
__device__ __forceinline__ void cp_async_core16_by(T* dst, const T* src, int64_t stride, int L,
                                                   int tid) {
  static_assert(sizeof(T) == 2 && (KD == 64 || KD == 128) && ROWS * KD / 8 % NTHR == 0, "tile");
  constexpr int kPieces = ROWS * KD / 8, kPasses = kPieces / NTHR;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int i = tid + NTHR * pass;
    const int r = 8 * (i / KD) + (i & 7), k = 8 * ((i >> 3) % (KD / 8));
    cp_async16(dst + 8 * i, r < L ? src + r * stride + k : src, r < L);
  }
}
template <int ROWS, int KD, typename T>
__device__ __forceinline__ void cp_async_core16(T* dst, const T* src, int64_t stride, int L) {
  cp_async_core16_by<ROWS, KD, 256>(dst, src, stride, L, static_cast<int>(threadIdx.x));
}


// ---- both operands from shared memory (m64nNk16, fp16 or bf16 as T, fp32 accumulators):
// d (+)= A B. kTransB / kTransA read B / A MN-major (a tile stored [k][n], n contiguous)
// instead of K-major. Descriptors from f16_core_desc (interleaved: lbo between core matrices
// along K, sbo along M or N, for either major mode, as state_fwd_cols's B operands) or
// sw128_desc / sw32_desc (swizzled tiles).
template <typename T = __half, bool kTransB = false, bool kTransA = false>
__device__ __forceinline__ void wgmma_ss_n32(float (&d)[4][4], uint64_t da, uint64_t db, bool acc) {
#define FLASHGDN_WGMMA_SS_N32(TY)                                                                 \
  asm volatile(                                                                                \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " "                              \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, %19, %20;\n}\n" \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),             \
        "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),             \
        "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]),             \
        "+f"(d[3][3])                                                                          \
      : "l"(da), "l"(db), "r"(static_cast<int>(acc)), "n"(kTransA ? 1 : 0),                   \
        "n"(kTransB ? 1 : 0))
  if constexpr (std::is_same<T, __nv_bfloat16>::value) FLASHGDN_WGMMA_SS_N32("bf16");
  else FLASHGDN_WGMMA_SS_N32("f16");
#undef FLASHGDN_WGMMA_SS_N32
}
template <typename T = __half, bool kTransB = false, bool kTransA = false>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[8][4], uint64_t da, uint64_t db, bool acc) {
#define FLASHGDN_WGMMA_SS_N64(TY)                                                                 \
  asm volatile(                                                                                \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                              \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,"     \
      "%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;\n}\n"               \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),             \
        "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),             \
        "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]),             \
        "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),             \
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]),             \
        "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),             \
        "+f"(d[7][2]), "+f"(d[7][3])                                                           \
      : "l"(da), "l"(db), "r"(static_cast<int>(acc)), "n"(kTransA ? 1 : 0),                   \
        "n"(kTransB ? 1 : 0))
  if constexpr (std::is_same<T, __nv_bfloat16>::value) FLASHGDN_WGMMA_SS_N64("bf16");
  else FLASHGDN_WGMMA_SS_N64("f16");
#undef FLASHGDN_WGMMA_SS_N64
}

}  // namespace cuda
}  // namespace flashgdn
