// The shared layout and helpers of state_fwd_tma_kernel (state_fwd_tma.cuh) and of its fused
// forward's WY warpgroup (fwd_tma_wy.cuh): the tensor maps a launch passes, the roles' thread
// counts and setmaxnreg budgets, the shared-memory layout of the stages (128-byte-swizzled
// [64][128] K, Q, V tiles and [64][64] T diag(beta) and P tiles, as TMA writes them and wgmma
// reads them), the TMA load, the swizzled tiles' descriptors and addressing, and the SS
// wgmma both roles issue.
#pragma once

#include <cuda.h>

#include <type_traits>

#include "fwd_kernels.cuh"
#include "wgmma.cuh"

namespace flashgdn {
namespace cuda {

// The tensor maps of one launch (launch.cu tma_pass): 3-D views [tokens][heads][128] of k,
// q (the inputs or wy's fp16 copies) and v, boxes of 64 tokens x 1 head x 64 values.
struct TmaMaps {
  CUtensorMap k, q, v;
};

constexpr int kTmaThreads = 384;
// setmaxnreg: the launch's pool is 168 registers a thread (65536 / 384, a multiple of 8), and
// the roles must fit it or setmaxnreg.inc waits for ever; 72 / 216 the fewest spills (ptxas:
// none; 40 / 232 spilled 336 bytes in the producer's 64-bit index work, 80 / 208 12 bytes).
constexpr int kTmaProducerRegs = 72, kTmaStateRegs = 216;
static_assert(128 * kTmaProducerRegs + 256 * kTmaStateRegs <= kTmaThreads * 168,
              "the roles' registers fit the block's pool");
// kWy (FLASHGDN_COLS_TMA=4|5): a fourth warpgroup forms P (and T diag(beta)); 512 threads, a
// pool of 128 registers a thread. setmaxnreg of the state / producer / WY roles, read off the
// SASS per role (docs/perf-notes.md versions 43, 45): kWy 1 200 / 40 / 72 (the WY's product
// loop spilled at 64; the producer's spills at 24 about halved at 40, ptxas total 840 -> 388
// bytes; H100 A/B 2026-11-26: 32/32 x 32768 0.882 -> 0.846 ms, 16/32 8192x4 0.578 -> 0.566,
// none slower); kWy 2 200 / 24 / 88 (at 208 / 24 / 72 ptxas serialized every wgmma of the
// kernel, C7512, for the WY role's registers).
constexpr int kTmaWyThreads = 512;
constexpr int kTmaWyRegs[2][3] = {{200, 40, 72}, {200, 24, 88}};  // [kWy - 1][role]
constexpr int tma_wy_regs(int kWy, int role) { return kTmaWyRegs[kWy == 2 ? 1 : 0][role]; }
static_assert(256 * kTmaWyRegs[0][0] + 128 * (kTmaWyRegs[0][1] + kTmaWyRegs[0][2]) <= 65536 &&
                  256 * kTmaWyRegs[1][0] + 128 * (kTmaWyRegs[1][1] + kTmaWyRegs[1][2]) <= 65536,
              "the kWy roles' registers fit the block's pool");
struct StateFwdTmaSmem {
  // a stage: K, Q, V (two 8 KB column halves each), T diag(beta), P, E; 1024-byte aligned
  static constexpr int kOffK = 0, kOffQ = 16384, kOffV = 32768, kOffT = 49152, kOffP = 57344,
                       kOffE = 65536;
  static constexpr int kStage = 66560;
  static constexpr int kLdo = 72;  // output staging [64 tokens][72] a warpgroup
  // kStages stages (2, or 3: FLASHGDN_COLS_STAGES=3), then full, empty, landed [kStages];
  // kSsY: then each state warpgroup's S^T tile (fp16 [64][128], two swizzled halves, 1024-byte
  // aligned); then the output staging
  static constexpr size_t bars(int stages) { return stages * kStage; }
  static constexpr size_t s_tiles(int stages) { return bars(stages) + 1024; }
  static constexpr size_t ost(int stages, bool ssy = false) {
    return ssy ? s_tiles(stages) + 2 * 16384 : bars(stages) + 128;
  }
  static constexpr size_t bytes(int stages, bool ssy = false) {
    return ost(stages, ssy) + 2 * sizeof(__half) * C * kLdo + 1024;  // + the alignment's slack
  }
  // kRec (the backward's recomputation, two stages): after the output staging, each state
  // warp's staging of its records (mma.cuh kRecStageBytes)
  static constexpr size_t rec(int stages) {
    return (ost(stages) + 2 * sizeof(__half) * C * kLdo + 127) / 128 * 128;
  }
  static constexpr size_t rec_bytes(int stages) {
    return rec(stages) + 8 * static_cast<size_t>(kRecStageBytes) + 1024;
  }
  // kWy: after the output staging, the WY warpgroup's chunk G and beta; then (kWy 2, from a
  // 1024-byte boundary) its two A tiles (swizzled [64][64] fp16: A's blocks (1,0) and (3,2), and
  // its lower left 32 x 32), A's and T's diagonal 16 x 16 blocks and T's blocks (1,0), (3,2)
  // (fp32; wy_inverse)
  static constexpr size_t wy(int stages) { return ost(stages) + 2 * sizeof(__half) * C * kLdo; }
  static constexpr size_t wy_tiles(int stages) {
    return (wy(stages) + 2 * sizeof(float) * C + 1023) / 1024 * 1024;
  }
  static constexpr size_t kWyInverse = 2 * 8192 + 2 * 4096 + 2048;
  static constexpr size_t wy_bytes(int stages, bool t) {
    return wy_tiles(stages) + (t ? kWyInverse : 0) + 1024;
  }
};
static_assert(StateFwdTmaSmem::wy_bytes(2, true) <= 227 * 1024 &&
                  StateFwdTmaSmem::wy_bytes(3, false) <= 227 * 1024,
              "kWy: two stages (2) or three (1) fit");
static_assert(StateFwdTmaSmem::bytes(2, true) <= 227 * 1024, "kSsY: two stages fit");
static_assert(StateFwdTmaSmem::rec_bytes(2) <= 227 * 1024, "kRec: two stages and records fit");
static_assert(StateFwdTmaSmem::bytes(3) <= 227 * 1024, "one block an SM");

// one box of a 3-D map (x: value offset, y: head, z: token) into shared memory, signalling bar
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int x, int y, int z,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(smem_addr(bar))
      : "memory");
}
// Descriptor of a 128-byte-swizzled 16-bit tile: K-major (lbo unused, sbo 1024: 8-row groups)
// or MN-major (lbo between 64-value blocks along MN, sbo 1024 between 8-row groups along K).
__device__ __forceinline__ uint64_t sw128_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_addr(p) & 0x3ffff) >> 4) |
         (static_cast<uint64_t>(lbo >> 4) << 16) | (static_cast<uint64_t>(sbo >> 4) << 32) |
         (1ull << 62);
}
// Byte offset of element (r, c) of a [64][128] 16-bit tile stored as two swizzled 64-column
// halves (TMA's 128-byte swizzle: the 16-byte piece index XOR the row within 8).
__device__ __forceinline__ int swz128(int r, int c) {
  return (c >> 6) * 8192 + r * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4) + ((c & 7) << 1);
}
// A stage's [64][128] tile of In (bf16) to fp16 in place, the 16-byte pieces tid, tid + NTHR,
// ... (elementwise, so the swizzle does not matter): the producer's and the WY warpgroup's
// conversions of K and Q.
template <typename In, int NTHR>
__device__ __forceinline__ void tile_sw_to_half(unsigned char* tile, int tid) {
  for (int i = tid; i < C * D / 8; i += NTHR) {
    In* piece = reinterpret_cast<In*>(tile) + 8 * i;
    *reinterpret_cast<uint4*>(piece) = half8_of(piece);
  }
}
__device__ __forceinline__ float2 bits_to_float2(uint32_t v, const __half*) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
__device__ __forceinline__ float2 bits_to_float2(uint32_t v, const __nv_bfloat16*) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
// (wgmma_ss_n64, the m64n64k16 product with both operands from shared memory: wgmma.cuh)

}  // namespace cuda
}  // namespace flashgdn
