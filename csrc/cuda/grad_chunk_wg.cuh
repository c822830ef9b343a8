// grad_chunk_wg_kernel  grid (min(chunks x H_qk, SMs)), 256 threads (two warpgroups), ~200 KB
//   smem, persistent: block b takes the (chunk, q/k head) items b, b + gridDim.x, ... (chunks
//   first) and copies the next item's records under the current item's last head and dq / dk
//   (launch.cu grad_wg: the default beyond the ready queue's region, FLASHGDN_GRAD_WG; 4-6%
//   faster backward there than grad_chunk_tc_kernel on the H200, 3.7-5.4% on the H100; inside
//   the region that kernel runs beside the reverse pass: docs/perf-notes.md versions 61, 62)
//   grad_chunk_tc_kernel's gradients (bwd_kernels.cuh: same quantities, the value heads of
//   a q/k head in the same order, dq and dk summed in registers) with every product on
//   wgmma, both operands from shared memory: a head's products are ~80 asynchronous
//   instructions a warpgroup instead of ~600 mma.sync a warp with their fragments.
//   bf16 inputs and the 128-column passes' fp16 record blocks (BwdParams::rec16) only.
//   Per value head (warpgroup wg takes key columns 64 wg .. of the 64 x 128 products and
//   token columns 32 wg .. of the 64 x 64 ones):
//   * operands: Q, K (bf16, the item's) and dO [64 x 128] by TMA (tensor maps: two boxes of
//     64 tokens x 64 values a tile, 128-byte swizzled; rows past the chunk zeroed in smem);
//     h, dS [128 keys x 128 values] and U, dVt [64 x 128] by one bulk
//     copy a record (mbarriers), as their fp16 blocks lie ([block][row][16 values]), then
//     rewritten 32-byte swizzled in place (sw32_desc) by the row passes, which also bring
//     the blocks' powers of two to one factor a matrix (a block 2^k below the largest keeps
//     k fewer low bits, its products 2^k smaller: grad_chunk_tc_kernel's loss); dO becomes
//     fp16 times 2^k_r per row (its largest element in [2^14, 2^15): exact), undone per
//     row of Y and dO U^T.
//   * Y = dO h^T, Z = dVt h^T, R = U dS^T (fp16, two rounds of m64n32), then dq += scale
//     gam Y, dk += eL R - beta gam Z and the rows' dots; dVt U^T, dO U^T (fp16), K K^T,
//     Q K^T (bf16, m64n32), issued under the epilogues; M1 = dP . Dec and M2 + M2^T summed
//     over the value heads in fp32 (the last head writes the sums as bf16 (hi, lo) pairs: 16
//     bits of mantissa, fp32's range): dq += M1 K, dk += M1^T Q + (M2 + M2^T) K (bf16,
//     m64n64), once an item, the last head's dg / dbeta stored under them.
//   * The next head's copies are issued once the products stop reading the tiles (h, dS
//     after Y, Z, R; dO, U, dVt after the 64 x 64 products), its rows brought into L2 at the
//     head's start. After an item's last head the next item's h, dS and dO are copied the
//     same way, its Q, K, U, dVt after the dq / dk products (the M tiles lie in U's and
//     dVt's place).
//   Row sums across threads go through shared memory in a fixed order: deterministic.
//   reads  q, k, v, do, beta, G, U, dVt, h, dh and their factors
//   writes dq, dk, dv, dg, dbeta
#pragma once

#include <cstdio>

#include "bwd_kernels.cuh"
#include "state_fwd_tma_layout.cuh"
#include "wgmma.cuh"

namespace flashgdn {
namespace cuda {

// Descriptor of a 32-byte-swizzled K-major 16-bit tile (rows of 16 values, 32 bytes; the two
// 16-byte halves of rows 4..7 of every 8 swapped: byte-address bit 4 ^= bit 7), 8-row groups
// 256 bytes apart: a k16 step of the fp16 record blocks, which the bulk copies land as
// [block][row][16 values] and the row passes rewrite swizzled in place.
__device__ __forceinline__ uint64_t sw32_desc(const void* p) {
  return static_cast<uint64_t>((smem_addr(p) & 0x3ffff) >> 4) | (1ull << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32) | (3ull << 62);
}

struct GradWgSmem {
  static constexpr int kTile = C * D * 2;  // [64][128] 16-bit tile
  static constexpr int kRec = D * D * 2;   // [128][128] fp16 core tile
  static constexpr int kM = C * C * 2;     // [64][64] bf16 core tile (M1, M2 pairs: in kH)
  static constexpr int kLdE = C + 1;       // E, M1, M2 + M2^T [64][65] fp32
  static constexpr int kQ = 0, kK = kQ + kTile, kDO = kK + kTile, kU = kDO + kTile,
                       kDV = kU + kTile, kH = kDV + kTile, kDS = kH + kRec, kM1 = kDS + kRec,
                       kM2 = kM1 + 4 * C * kLdE, kE = kM2 + 4 * C * kLdE,
                       kScal = kE + 4 * C * kLdE;
  // floats: two buffers of 9 per-token arrays, red [2][8], part [3][2][C], dbp [2][C],
  // the record factors [32]
  static constexpr int kBuf = 9 * C;
  static constexpr int kScalFloats = 2 * kBuf + 16 + 6 * C + 2 * C + 32;
  static constexpr int kBars = kScal + 4 * kScalFloats;  // mbarriers: h / dS, U / dVt / dO, Q / K
  static constexpr int kNext = kBars + 24;                // GradWgNext [2]
  // (+1024: the tiles' base rounded up to 1024 bytes, the 128-byte swizzle's period)
  static constexpr size_t kBytes = kNext + 64 + 1024;
};
// The block's next item, written by thread 0 at an item's start (two slots, by the items'
// parity): kept in shared memory rather than registers, which the head loop has none left for.
struct GradWgNext {
  long long tok0;
  int chunk, hq, L;  // L == 0: no next item
};
static_assert(GradWgSmem::kBytes + 256 <= 227 * 1024, "one block an SM (with the probe's 256 bytes)");

// Half index of element (r, c) of a 16-bit core-matrix tile with NCG groups of 8 columns.
template <int NCG>
__device__ __forceinline__ int core16(int r, int c) {
  return (((r >> 3) * NCG + (c >> 3)) << 6) + ((r & 7) << 3) + (c & 7);
}
__device__ __forceinline__ int fexp(float f) { return ((__float_as_int(f) >> 23) & 0xff) - 127; }
// 8 fp16 values (16 bytes) times a power of two (h2: 2^d, d <= 0, pow2h)
__device__ __forceinline__ uint4 scale_h8(uint4 x, __half2 h2) {
  __half2* e = reinterpret_cast<__half2*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = __hmul2(e[i], h2);
  return x;
}
// x -> bf16 (hi, lo) with hi + lo = x to 16 bits of mantissa
__device__ __forceinline__ void split_bf16(float x, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(x - __bfloat162float(hi));
}

// threadIdx.x through an opaque move: address arithmetic derived from it inside the head
// loop is not hoisted out of it (hoisted, the per-thread offsets of every copy and epilogue
// stayed live across the loop and spilled)
__device__ __forceinline__ int opaque_tid() {
  int x;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
  return x;
}

__device__ long long g_wg_probe[2][26];
__global__ void grad_wg_probe_print() {
  for (int b = 0; b < 2; ++b) {
    const long long* x = g_wg_probe[b];
    printf("probe %d group %lld: h0 %lld %lld %lld %lld %lld %lld %lld %lld | h1 %lld %lld %lld "
           "%lld %lld %lld %lld %lld | end %lld %lld %lld %lld %lld\n",
           b, x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11], x[12], x[13],
           x[14], x[15], x[16], x[17], x[18], x[19], x[20], x[21], x[0]);
    printf("probe %d: the item took %lld ns (%.2f GHz); the block's %lld items took %lld ns\n", b,
           x[22], x[22] > 0 ? static_cast<double>(x[0]) / x[22] : 0.0, x[24], x[23]);
  }
}
// kProbe (timing only, FLASHGDN_DEBUG bit 1 << 20): thread 0 of blocks 0 and 64 records the
// clock at each phase boundary of the first two heads of its second item (from that item's
// start: its first head's operands were copied under the first item's tail)
template <typename In, bool kProbe = false>
__global__ void __launch_bounds__(NT, 1)
    grad_chunk_wg_kernel(const __grid_constant__ TmaMaps maps, BwdParams p) {
  __shared__ long long probe_ts[32];  // (the probe's: clocks 0-21, globaltimer 22, 24)
#define PROBE(i)                                                                     \
  do {                                                                               \
    if constexpr (kProbe) {                                                          \
      const int hi_ = static_cast<int>(h - hq * group);                              \
      if (threadIdx.x == 0 && hi_ < 2 && n_item == 1) probe_ts[2 + (i) + 8 * hi_] = clock64(); \
    }                                                                                \
  } while (0)
  static_assert(std::is_same_v<In, __nv_bfloat16>, "bf16 inputs");
  using Sm = GradWgSmem;
  if (p.seqs.failed()) return;
  // the items: (chunk, q/k head) pairs over the sequences' chunks, chunks first; block b
  // takes items b, b + gridDim.x, ...
  // (launch.cu grad_wg: chunks x H_qk < 2^31)
  const int n_chunks = static_cast<int>(
      p.seqs.cu_seqlens ? p.seqs.chunk_offsets[p.seqs.N] : p.seqs.N * ((p.seqs.T + C - 1) / C));
  const int n_items = n_chunks * p.Hqk;
  const int64_t group = p.Hv / p.Hqk;
  int item = blockIdx.x;
  if (item >= n_items) return;
  int chunk = item % n_chunks, hq = item / n_chunks;
  ChunkRef ck = locate_chunk(p.seqs, chunk);
  int n_item = 0;  // items this block has done
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, g = lane_id() >> 2,
            t = lane_id() & 3;

  extern __shared__ __align__(16) unsigned char smem_base[];
  // 1024-byte aligned (Q, K, dO: TMA's 128-byte swizzle) by an offset from smem_base, which
  // keeps the shared state space (state_fwd_tma_kernel's note)
  unsigned char* smem_raw =
      smem_base + ((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_base)) & 1023u)) & 1023u);
  In* Qc = reinterpret_cast<In*>(smem_raw + Sm::kQ);
  In* Kc = reinterpret_cast<In*>(smem_raw + Sm::kK);
  // Q, K, dO: [64][128] as TMA lands them, two 128-byte-swizzled 64-column halves (swz128,
  // sw128_desc); dO (In) becomes fp16 in place in the row pass
  __half* dOc = reinterpret_cast<__half*>(smem_raw + Sm::kDO);
  __half* Uc = reinterpret_cast<__half*>(smem_raw + Sm::kU);
  __half* dVc = reinterpret_cast<__half*>(smem_raw + Sm::kDV);
  __half* Hc = reinterpret_cast<__half*>(smem_raw + Sm::kH);
  __half* dSc = reinterpret_cast<__half*>(smem_raw + Sm::kDS);
  // M1 and M2 + M2^T summed over the value heads (fp32), as bf16 (hi, lo) tiles in U's and
  // dVt's place once the last head's products are done (h and dS then take the next item's
  // first head): dq and dk's products with K and Q, one set an item (K and Q are the heads'
  // common factors)
  float* M1s = reinterpret_cast<float*>(smem_raw + Sm::kM1);
  float* M2s = reinterpret_cast<float*>(smem_raw + Sm::kM2);
  __nv_bfloat16* M1h = reinterpret_cast<__nv_bfloat16*>(smem_raw + Sm::kU);
  __nv_bfloat16* M1l = M1h + C * C;
  __nv_bfloat16* M2h = M1l + C * C;
  __nv_bfloat16* M2l = M2h + C * C;
  float* E = reinterpret_cast<float*>(smem_raw + Sm::kE);
  float* scal = reinterpret_cast<float*>(smem_raw + Sm::kScal);
  float* red = scal + 2 * Sm::kBuf;  // [2][8] <h, dS> per warp
  float* part = red + 16;            // [3][2][C]: Q.Y, K.Z, K.R per warpgroup
  float* dbp = part + 6 * C;         // [2][C]
  float* recsc = dbp + 2 * C;        // [32]: h, dS, U, dVt factors
  GradWgNext* nexts = reinterpret_cast<GradWgNext*>(smem_raw + Sm::kNext);

  // an item's Q and K (TMA, bar_q: copy_qk); a value head's dO (TMA, bar_v: copy_do) and its
  // U and dVt (bulk copies, bar_v: copy_uv), its h and dS (bulk
  // copies, bar_h: copy_h): each record one contiguous copy. A buffer's copy is issued after
  // a barrier that follows the last generic writes to it (the row passes', fenced into the
  // async proxy) and reads of it. The next item's h and dS are issued under the last head's
  // 64 x 64 epilogue, its dO after that head's products, its Q, K, U, dVt after the item's
  // dq / dk products: the next item starts on landed operands.
  uint64_t* bar_h = reinterpret_cast<uint64_t*>(smem_raw + Sm::kBars);
  uint64_t* bar_v = bar_h + 1;
  uint64_t* bar_q = bar_h + 2;
  if (tid == 0) {
    mbar_init(bar_h, 2);  // two copies, each announcing its bytes
    mbar_init(bar_v, 3);  // U, dVt, dO
    mbar_init(bar_q, 1);  // Q and K
    fence_mbar_init();
    for (const CUtensorMap* m : {&maps.q, &maps.k, &maps.v})  // the descriptors into cache
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(m)) : "memory");
  }
  __syncthreads();
  // (TMA boxes of 64 tokens x 64 values, int32 coordinates: rows past the chunk are the
  // next sequence's or, past the tensor's end, zeros; dO's row pass and the item's first
  // head zero them)
  auto copy_qk = [&](int64_t tk0, int64_t hqq) {
    if (opaque_tid() == 0) {
      mbar_arrive_expect_tx(bar_q, 2 * Sm::kTile);
      const int z = static_cast<int>(tk0), y = static_cast<int>(hqq);
      tma_load_3d(Qc, &maps.q, 0, y, z, bar_q);
      tma_load_3d(reinterpret_cast<char*>(Qc) + 8192, &maps.q, 64, y, z, bar_q);
      tma_load_3d(Kc, &maps.k, 0, y, z, bar_q);
      tma_load_3d(reinterpret_cast<char*>(Kc) + 8192, &maps.k, 64, y, z, bar_q);
    }
  };
  auto copy_do = [&](int64_t tk0, int64_t hh) {
    if (opaque_tid() == 0) {
      mbar_arrive_expect_tx(bar_v, Sm::kTile);
      const int z = static_cast<int>(tk0), y = static_cast<int>(hh);
      tma_load_3d(dOc, &maps.v, 0, y, z, bar_v);
      tma_load_3d(reinterpret_cast<char*>(dOc) + 8192, &maps.v, 64, y, z, bar_v);
    }
  };
  auto copy_uv = [&](int64_t ch, int64_t hh) {
    const int64_t rec = ch * p.Hv + hh;
    if (opaque_tid() == 0) {
      bulk_load(Uc, record_at<C>(p.U, rec, true), Sm::kTile, bar_v);
      bulk_load(dVc, record_at<C>(p.dVt, rec, true), Sm::kTile, bar_v);
    }
  };
  auto copy_h = [&](int64_t ch, int64_t hh) {
    const int64_t rec = ch * p.Hv + hh;
    if (opaque_tid() == 0) {
      bulk_load(Hc, record_at<D>(p.h, rec, true), Sm::kRec, bar_h);
      bulk_load(dSc, record_at<D>(p.dh, rec, true), Sm::kRec, bar_h);
    }
  };
  copy_qk(ck.tok0, hq);
  copy_h(chunk, hq * group);  // (with Q and K)
  copy_do(ck.tok0, hq * group);
  copy_uv(chunk, hq * group);
  uint32_t n_head = 0;  // heads this block has done: the mbarriers' phases
  for (;;) {  // the block's items
    const int L = ck.L;
    const int64_t tok0 = ck.tok0;
    const GradWgNext* nx = nexts + (n_item & 1);  // (read after the first head's B1)
    if (tid == 0) {
      const int next = item + static_cast<int>(gridDim.x);
      GradWgNext v{0, 0, 0, 0};
      if (next < n_items) {
        v.chunk = next % n_chunks;
        v.hq = next / n_chunks;
        const ChunkRef r = locate_chunk(p.seqs, v.chunk);
        v.tok0 = r.tok0;
        v.L = r.L;
      }
      nexts[n_item & 1] = v;
    }
    if constexpr (kProbe) {
      if (threadIdx.x == 0 && n_item == 1) {
        probe_ts[0] = clock64();
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(probe_ts[22]));
      }
      if (threadIdx.x == 0 && n_item == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(probe_ts[24]));
    }

    // a head's last-row terms, dg and dbeta (finish_dg_dbeta; warp 0, run under the next
    // head's row pass, or after the last head)
    auto finish_head = [&](int64_t h, int buf) {
      const float* gam = scal + buf * Sm::kBuf + C;
      const float* dG = gam + 3 * C;
      finish_dg_dbeta(p, tok0, L, h, gam, dG, dG + C, dG + 2 * C, red + buf * 8);
    };
    constexpr uint32_t kRGm = 128 * (C / 8);  // row-group stride of a [.][64] core tile (bytes)
    constexpr uint32_t kRecBlk = D * 16 * 2, kVBlk = C * 16 * 2;  // a record block (bytes)
    float dq[8][4] = {}, dk[8][4] = {};  // rows 16 w + g (+8), key columns 64 wg + 8 j + 2 t (+1)

    for (int64_t h = hq * group; h < (hq + 1) * group; ++h) {
      const int tid = opaque_tid(), wg = tid >> 7, w = (tid >> 5) & 3, g = (tid & 31) >> 2,
                t = tid & 3;
      const int buf = static_cast<int>(h - hq * group) & 1;
      float* Gs = scal + buf * Sm::kBuf;
      float* gam = Gs + C;
      float* eL = gam + C;
      float* bs = eL + C;
      float* dG = bs + C;
      float* db = dG + C;
      float* lastrow = db + C;
      float* vdt = lastrow + C;
      float* dof = vdt + C;  // 2^-k_r: dO's row factors
      const int64_t v_off = (tok0 * p.Hv + h) * D;
      float ld_g = 0.f, ld_glast = 0.f, ld_beta = 0.f, ld_scale = 0.f;
      if (tid < C) {
        ld_g = p.G[(tok0 + (tid < L ? tid : L - 1)) * p.Hv + h];
        ld_glast = p.G[(tok0 + L - 1) * p.Hv + h];
        ld_beta = tid < L ? load_scalar(p.beta, p.beta_dtype, (tok0 + tid) * p.Hv + h) : 0.f;
      }
      if (tid < 32) {
        const int64_t i = (static_cast<int64_t>(chunk) * p.Hv + h) * 8 + (tid & 7);
        const int m = tid >> 3;
        ld_scale = (m == 0 ? p.h_scale : m == 1 ? p.dh_scale : m == 2 ? p.U_scale : p.dVt_scale)[i];
      }
      // the row passes: row rr, columns 32 qq .. (a warp's eight rows in each quarter: the
      // tiles' 16-byte pieces without bank conflicts; a row's four threads are lanes
      // l, l + 8, l + 16, l + 24)
      const int rr = (tid & 7) + 8 * (tid >> 5), qq = (tid >> 3) & 3;
      uint4 vrow[4];
      if (rr < L) {
        const In* src = static_cast<const In*>(p.v) + v_off + static_cast<int64_t>(rr) * p.Hv * D +
                        32 * qq;
#pragma unroll
        for (int c8 = 0; c8 < 4; ++c8) vrow[c8] = *reinterpret_cast<const uint4*>(src + 8 * c8);
      }
      const uint32_t par = n_head & 1u;
      PROBE(0);
      mbar_wait(bar_h, par);  // the head's h and dS
      if (tid < C) {
        Gs[tid] = ld_g;
        gam[tid] = __expf(ld_g);
        eL[tid] = __expf(ld_glast - ld_g);
        bs[tid] = ld_beta;
      }
      if (tid < 32) recsc[tid] = ld_scale;
      __syncthreads();  // (B1) the head's h, dS and scalars
      PROBE(1);
      if (tid < 32 && h > hq * group) finish_head(h - 1, buf ^ 1);
      // the next head's operands into L2 (its copies are issued once this head's products
      // are done with the tiles; without this prefetch, as a runtime switch, the backward
      // measured 1.1-1.6% faster on three of four rows: docs/perf-notes.md version 62)
      if (h + 1 < (hq + 1) * group) prefetch_grad_head<In, true>(p, chunk, tok0, L, h + 1);
      else if (nx->L) prefetch_grad_head<In, true>(p, nx->chunk, nx->tok0, nx->L, nx->hq * group);

      // the matrices' largest factors
      float fmax[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        float x = recsc[8 * m];
#pragma unroll
        for (int b = 1; b < 8; ++b) x = fmaxf(x, recsc[8 * m + b]);
        fmax[m] = x;
      }
      {
        // h and dS to one factor each, 32-byte swizzled in place (sw32_desc); <h, dS> on the
        // way. Row i of a record: block i / 128, key i % 128
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = tid + NT * j, vb = i >> 7, sw = (i >> 2) & 1;
          const __half2 rh = pow2h(fexp(recsc[vb]) - fexp(fmax[0]));
          const __half2 rd = pow2h(fexp(recsc[8 + vb]) - fexp(fmax[1]));
          uint4 a[2], b[2];
          float sj = 0.f;
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            a[h2] = *reinterpret_cast<const uint4*>(Hc + 16 * i + 8 * h2);
            b[h2] = *reinterpret_cast<const uint4*>(dSc + 16 * i + 8 * h2);
            const __half2* ah = reinterpret_cast<const __half2*>(&a[h2]);
            const __half2* bh = reinterpret_cast<const __half2*>(&b[h2]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 x = __half22float2(ah[e]), y = __half22float2(bh[e]);
              sj += x.x * y.x + x.y * y.y;
            }
          }
          s += sj * pow2f(pair_exp(recsc[vb], recsc[8 + vb]));
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            *reinterpret_cast<uint4*>(Hc + 16 * i + 8 * (h2 ^ sw)) = scale_h8(a[h2], rh);
            *reinterpret_cast<uint4*>(dSc + 16 * i + 8 * (h2 ^ sw)) = scale_h8(b[h2], rd);
          }
        }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane_id() == 0) red[buf * 8 + (tid >> 5)] = s;
      }
      mbar_wait(bar_v, par);  // the head's dO, U and dVt
      if (h == hq * group) {  // the item's Q and K; rows past the chunk zeroed
        mbar_wait(bar_q, static_cast<uint32_t>(n_item) & 1u);
        if (L < C) {
          const int n = (C - L) * (D / 8);  // 16-byte pieces of a tile's rows past the chunk
          for (int i = tid; i < 2 * n; i += NT) {
            const int j = i < n ? i : i - n, r = L + (j >> 4), c = 8 * (j & 15);
            char* tile = reinterpret_cast<char*>(i < n ? Qc : Kc);
            *reinterpret_cast<uint4*>(tile + swz128(r, c)) = make_uint4(0u, 0u, 0u, 0u);
          }
        }
      }
      __syncthreads();  // the head's dO, U, dVt
      PROBE(2);
      // ---- row pass: dv = beta dVt, v . dVt; U, dVt to one factor; dO to fp16 per row
      {
        float vd = 0.f;
        const float br = bs[rr];
        In* dvrow = static_cast<In*>(p.dv) + v_off + static_cast<int64_t>(rr) * p.Hv * D + 32 * qq;
        float m = 0.f;
        uint4 dor[4];
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const int sw = (rr >> 2) & 1;  // the 32-byte swizzle of row rr
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          // U and dVt, block vb = 2 qq + k, row rr: [vb][row][16 values] as copied, rewritten
          // 32-byte swizzled (sw32_desc) times their common factor; rows past the chunk zeroed
          const int vb = 2 * qq + k, base = (vb * C + rr) * 16;
          uint4 dd[2], uu[2];
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            dd[h2] = rr < L ? *reinterpret_cast<const uint4*>(dVc + base + 8 * h2) : zero;
            uu[h2] = rr < L ? *reinterpret_cast<const uint4*>(Uc + base + 8 * h2) : zero;
          }
          const float sd = recsc[24 + vb];
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int c = 2 * k + h2;  // columns 32 qq + 8 c ..
            const __half* de = reinterpret_cast<const __half*>(&dd[h2]);
            const In* ve = reinterpret_cast<const In*>(&vrow[c]);
            uint4 out;
            In* oe = reinterpret_cast<In*>(&out);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              const float d = sd * __half2float(de[e]);
              if (rr < L) vd += to_f(ve[e]) * d;
              oe[e] = from_f<In>(br * d);
            }
            if (rr < L) *reinterpret_cast<uint4*>(dvrow + 8 * c) = out;
          }
          const __half2 rdv = pow2h(fexp(sd) - fexp(fmax[3]));
          const __half2 ru = pow2h(fexp(recsc[16 + vb]) - fexp(fmax[2]));
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            *reinterpret_cast<uint4*>(dVc + base + 8 * (h2 ^ sw)) = scale_h8(dd[h2], rdv);
            *reinterpret_cast<uint4*>(Uc + base + 8 * (h2 ^ sw)) = scale_h8(uu[h2], ru);
          }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          dor[c] = rr < L ? *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(dOc) +
                                                            swz128(rr, 32 * qq + 8 * c))
                          : zero;
          const In* oi = reinterpret_cast<const In*>(&dor[c]);
#pragma unroll
          for (int e = 0; e < 8; ++e) m = fmaxf(m, fabsf(to_f(oi[e])));
        }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        const int kr = m > 0.f ? min(max(14 - fexp(m), -126), 126) : 0;
        const float up = pow2f(kr);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const In* oi = reinterpret_cast<const In*>(&dor[c]);
          uint4 o;
          uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
          for (int e = 0; e < 4; ++e) ow[e] = pack_half2(up * to_f(oi[2 * e]), up * to_f(oi[2 * e + 1]));
          *reinterpret_cast<uint4*>(reinterpret_cast<char*>(dOc) + swz128(rr, 32 * qq + 8 * c)) = o;
        }
        vd += __shfl_xor_sync(0xffffffffu, vd, 8);
        vd += __shfl_xor_sync(0xffffffffu, vd, 16);
        if (qq == 0) {
          vdt[rr] = vd;
          dof[rr] = pow2f(-kr);
          dG[rr] = 0.f;
        }
      }
      fence_proxy_async();
      __syncthreads();  // (B2) the operand tiles in their final form
      PROBE(3);

      // ---- Y = dO h^T, Z = dVt h^T, R = U dS^T: keys 64 wg + 32 qk .. in two rounds qk (B
      // K-major: key rows), then dVt U^T, dO U^T (fp16), K K^T, Q K^T (bf16): token columns
      // 32 wg .. (B K-major). Issued ahead of the epilogues: round 1 runs under round 0's
      // epilogue, the 64 x 64 products under round 1's.
      float t1[4][4] = {}, t2[4][4] = {}, t3[4][4] = {}, t4[4][4] = {};
      {
        const float fz = pow2f(pair_exp(fmax[3], fmax[0])), fr = pow2f(pair_exp(fmax[2], fmax[1]));
        float qy[2] = {}, kz[2] = {}, kr[2] = {};
        // h, dS, U, dVt as the row passes left them ([vb][row][16 values], 32-byte swizzled):
        // a k16 step is a block vb, rows 32 bytes apart
        auto issue_round = [&](int qk, float (&Y)[4][4], float (&Z)[4][4], float (&R)[4][4]) {
          const uint32_t bofs = (64 * wg + 32 * qk) * 32;
          wgmma_fence();
#pragma unroll
          for (int kt = 0; kt < 8; ++kt) {
            // (a k16 step of a 128-byte-swizzled tile: 32 bytes, 8192 a 64-column half)
            const uint32_t ko = (kt >> 2) * 8192 + (kt & 3) * 32, kr = kRecBlk * kt, kv = kVBlk * kt;
            const uint64_t dh = sw32_desc(reinterpret_cast<char*>(Hc) + bofs + kr);
            wgmma_ss_n32<__half>(Y, sw128_desc(reinterpret_cast<char*>(dOc) + ko, 16, 1024),
                                   dh, kt > 0);
            wgmma_ss_n32<__half>(
                Z, sw32_desc(reinterpret_cast<char*>(dVc) + kv), dh, kt > 0);
            wgmma_ss_n32<__half>(
                R, sw32_desc(reinterpret_cast<char*>(Uc) + kv),
                sw32_desc(reinterpret_cast<char*>(dSc) + bofs + kr), kt > 0);
          }
          wgmma_commit();
        };
        auto epi_round = [&](int qk, float (&Y)[4][4], float (&Z)[4][4], float (&R)[4][4]) {
          fence_acc(Y);
          fence_acc(Z);
          fence_acc(R);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int r = 16 * w + g + 8 * hf;
            const float fy = fmax[0] * dof[r];
            const float sg = p.scale * gam[r], bg = bs[r] * gam[r], el = eL[r];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int c = 64 * wg + 32 * qk + 8 * j + 2 * t;
              const __nv_bfloat162 q2 =
                  *reinterpret_cast<const __nv_bfloat162*>(reinterpret_cast<const char*>(Qc) + swz128(r, c));
              const __nv_bfloat162 k2 =
                  *reinterpret_cast<const __nv_bfloat162*>(reinterpret_cast<const char*>(Kc) + swz128(r, c));
              const float2 qf = __bfloat1622float2(q2), kf = __bfloat1622float2(k2);
#pragma unroll
              for (int o = 0; o < 2; ++o) {
                const int e = 2 * hf + o;
                const float y = fy * Y[j][e], z = fz * Z[j][e], rv = fr * R[j][e];
                const float q = o ? qf.y : qf.x, k = o ? kf.y : kf.x;
                qy[hf] += q * y;
                kz[hf] += k * z;
                kr[hf] += k * rv;
                dq[4 * qk + j][e] += sg * y;
                dk[4 * qk + j][e] += el * rv - bg * z;
              }
            }
          }
        };
        float Y0[4][4] = {}, Z0[4][4] = {}, R0[4][4] = {}, Y1[4][4] = {}, Z1[4][4] = {},
              R1[4][4] = {};
        issue_round(0, Y0, Z0, R0);
        issue_round(1, Y1, Z1, R1);
        wgmma_wait<1>();
        epi_round(0, Y0, Z0, R0);
        {
          const uint32_t bofs = 32 * wg * 128;  // K's rows 32 wg .. (swizzled rows: 128 bytes)
          wgmma_fence();
#pragma unroll
          for (int kt = 0; kt < 8; ++kt) {
            const uint32_t ko = (kt >> 2) * 8192 + (kt & 3) * 32, kv = kVBlk * kt;
            const uint64_t du = sw32_desc(reinterpret_cast<char*>(Uc) + 4 * wg * 256 + kv);
            const uint64_t dkb = sw128_desc(reinterpret_cast<char*>(Kc) + bofs + ko, 16, 1024);
            wgmma_ss_n32<__half>(
                t1, sw32_desc(reinterpret_cast<char*>(dVc) + kv), du, kt > 0);
            wgmma_ss_n32<__half>(t2, sw128_desc(reinterpret_cast<char*>(dOc) + ko, 16, 1024),
                                   du, kt > 0);
            wgmma_ss_n32<__nv_bfloat16>(t3, sw128_desc(reinterpret_cast<char*>(Kc) + ko, 16, 1024),
                                    dkb, kt > 0);
            wgmma_ss_n32<__nv_bfloat16>(t4, sw128_desc(reinterpret_cast<char*>(Qc) + ko, 16, 1024),
                                    dkb, kt > 0);
          }
          wgmma_commit();
        }
        wgmma_wait<1>();  // round 1 (the 64 x 64 products may still run)
        epi_round(1, Y1, Z1, R1);
        __syncthreads();  // both warpgroups' Y, Z, R done: h and dS are free
        PROBE(4);
        if (h + 1 < (hq + 1) * group) copy_h(chunk, h + 1);
        else if (nx->L) copy_h(nx->chunk, nx->hq * group);  // the next item's first head
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = 16 * w + g + 8 * hf;
#pragma unroll
          for (int m = 1; m <= 2; m <<= 1) {
            qy[hf] += __shfl_xor_sync(0xffffffffu, qy[hf], m);
            kz[hf] += __shfl_xor_sync(0xffffffffu, kz[hf], m);
            kr[hf] += __shfl_xor_sync(0xffffffffu, kr[hf], m);
          }
          if (t == 0) {
            part[(0 * 2 + wg) * C + r] = qy[hf];
            part[(1 * 2 + wg) * C + r] = kz[hf];
            part[(2 * 2 + wg) * C + r] = kr[hf];
          }
        }
        wgmma_wait<0>();
        fence_acc(t1);
        fence_acc(t2);
        fence_acc(t3);
        fence_acc(t4);
      }
      __syncthreads();  // (B3) both warpgroups' products done: the tiles are free; parts written
      PROBE(5);
      if (h + 1 < (hq + 1) * group) {
        copy_do(tok0, h + 1);
        copy_uv(chunk, h + 1);
      } else if (nx->L) {
        copy_do(nx->tok0, nx->hq * group);  // (U and dVt hold the M tiles until the end)
      }
      if (tid < C) {
        const int r = tid;
        const float qy = part[0 * C + r] + part[1 * C + r];
        const float kz = part[2 * C + r] + part[3 * C + r];
        const float kr = part[4 * C + r] + part[5 * C + r];
        dG[r] += p.scale * gam[r] * qy - bs[r] * gam[r] * kz - eL[r] * kr;
        db[r] = -gam[r] * kz;
        lastrow[r] = eL[r] * kr;
      }
      // ---- the 64 x 64 epilogue: M1, M2 + M2^T (bf16 pairs), E, dbeta's row sums
      {
        const float f1 = pow2f(pair_exp(fmax[3], fmax[2]));
        const bool first = h == hq * group, last = h + 1 == (hq + 1) * group;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = 16 * w + g + 8 * hf;
          const float gr = Gs[r], br = bs[r], f2 = p.scale * fmax[2] * dof[r];
          float dsum = 0.f;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int o = 0; o < 2; ++o) {
              const int e = 2 * hf + o, s = 32 * wg + 8 * j + 2 * t + o;
              const float dec = s <= r ? __expf(gr - Gs[s]) : 0.f;
              const float dA = s < r ? -f1 * t1[j][e] : 0.f;
              const float dP = s <= r ? f2 * t2[j][e] : 0.f;
              const float A = s < r ? br * t3[j][e] * dec : 0.f;
              const float P = t4[j][e] * dec;
              const float m1 = dP * dec, m2 = br * dA * dec;
              // each (r, s) and its mirror belong to one thread: sums without races. The
              // item's last head writes the sums as the bf16 (hi, lo) tiles (U and dVt are
              // free once its 64 x 64 products are done)
              const float v1 = first ? m1 : M1s[r * Sm::kLdE + s] + m1;
              if (!last) M1s[r * Sm::kLdE + s] = v1;
              else split_bf16(v1, M1h[core16<8>(r, s)], M1l[core16<8>(r, s)]);
              if (s <= r) {
                const float v2 = first ? m2 : M2s[r * Sm::kLdE + s] + m2;
                if (!last) M2s[r * Sm::kLdE + s] = v2;
                else split_bf16(v2, M2h[core16<8>(r, s)], M2l[core16<8>(r, s)]);
                if (s < r) {
                  const float v3 = first ? m2 : M2s[s * Sm::kLdE + r] + m2;
                  if (!last) M2s[s * Sm::kLdE + r] = v3;
                  else split_bf16(v3, M2h[core16<8>(s, r)], M2l[core16<8>(s, r)]);
                }
              }
              dsum += dA * t3[j][e] * dec;
              E[r * Sm::kLdE + s] = dA * A + dP * P;
            }
          }
          dsum += __shfl_xor_sync(0xffffffffu, dsum, 1);
          dsum += __shfl_xor_sync(0xffffffffu, dsum, 2);
          if (t == 0) dbp[wg * C + r] = dsum;
        }
      }
      if (h + 1 == (hq + 1) * group) fence_proxy_async();  // the M tiles, for dq / dk
      __syncthreads();  // (B4) E; dG's first terms; the last head's M tiles
      PROBE(6);
      // ---- dG += rowsum(E) - colsum(E); dbeta
      {
        float es = 0.f;
#pragma unroll 4
        for (int s = 16 * qq; s < 16 * qq + 16; ++s) es += E[rr * Sm::kLdE + s] - E[s * Sm::kLdE + rr];
#pragma unroll
        for (int m = 8; m <= 16; m <<= 1) es += __shfl_xor_sync(0xffffffffu, es, m);
        if (qq == 0) {
          dG[rr] += es;
          db[rr] += dbp[rr] + dbp[C + rr] + vdt[rr];
        }
      }
      PROBE(7);
      ++n_head;
    }
#define PROBE_END(i)                                                             \
  do {                                                                           \
    if constexpr (kProbe) {                                                      \
      if (threadIdx.x == 0 && n_item == 1) probe_ts[18 + (i)] = clock64();       \
    }                                                                            \
  } while (0)
    __syncthreads();  // the last head's dG, db (its M tiles: B4)
    PROBE_END(0);
    // ---- dq += M1 K, dk += M1^T Q + (M2 + M2^T) K: keys 64 wg .. (B N-major, A's hi and lo)
    {
      const uint32_t nofs = 8192 * wg;  // keys 64 wg ..: the tiles' swizzled half wg
      wgmma_fence();
      fence_acc(dq);
      fence_acc(dk);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {  // (16 tokens: 16 swizzled rows, 2048 bytes)
        const uint64_t bk = sw128_desc(reinterpret_cast<char*>(Kc) + nofs + 2048 * kt, 8192, 1024);
        const uint64_t bq = sw128_desc(reinterpret_cast<char*>(Qc) + nofs + 2048 * kt, 8192, 1024);
        const uint32_t ak = 256 * kt, at = 2 * kt * kRGm;  // K-major / MN-major k steps
        wgmma_ss_n64<__nv_bfloat16, true>(dq, f16_core_desc(reinterpret_cast<char*>(M1h) + ak, 128, kRGm), bk, true);
        wgmma_ss_n64<__nv_bfloat16, true>(dq, f16_core_desc(reinterpret_cast<char*>(M1l) + ak, 128, kRGm), bk, true);
        wgmma_ss_n64<__nv_bfloat16, true, true>(dk, f16_core_desc(reinterpret_cast<char*>(M1h) + at, kRGm, 128), bq, true);
        wgmma_ss_n64<__nv_bfloat16, true, true>(dk, f16_core_desc(reinterpret_cast<char*>(M1l) + at, kRGm, 128), bq, true);
        wgmma_ss_n64<__nv_bfloat16, true>(dk, f16_core_desc(reinterpret_cast<char*>(M2h) + ak, 128, kRGm), bk, true);
        wgmma_ss_n64<__nv_bfloat16, true>(dk, f16_core_desc(reinterpret_cast<char*>(M2l) + ak, 128, kRGm), bk, true);
      }
      wgmma_commit();
      // the last head's last-row terms, dg and dbeta under the products
      if (tid < 32) finish_head((hq + 1) * group - 1, static_cast<int>(group - 1) & 1);
      PROBE_END(1);
      wgmma_wait<0>();
      fence_acc(dq);
      fence_acc(dk);
    }
    PROBE_END(2);
    __syncthreads();  // both warpgroups' dq / dk products done: Q, K, U, dVt are free
    PROBE_END(3);
    if (nx->L) {
      copy_qk(nx->tok0, nx->hq);
      copy_uv(nx->chunk, nx->hq * group);
    }
    if constexpr (kProbe) {  // (printed by grad_wg_probe_print: no call in this kernel)
      const int sel = blockIdx.x == 0 ? 0 : blockIdx.x == 64 ? 1 : -1;
      if (threadIdx.x == 0 && sel >= 0 && n_item == 1) {
        const long long t0 = probe_ts[0];
        for (int i = 0; i < 22; ++i) g_wg_probe[sel][i] = probe_ts[i] - t0;
        long long ns;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
        g_wg_probe[sel][22] = ns - probe_ts[22];  // the item's ns (the clock's rate)
        g_wg_probe[sel][0] = clock64() - t0;
        g_wg_probe[sel][1] = group;
      }
    }
#undef PROBE
#undef PROBE_END
    // dq, dk: pairs of columns straight from the accumulators
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = 16 * w + g + 8 * hf;
      if (r >= L) continue;
      const int64_t off = ((tok0 + r) * p.Hqk + hq) * D + 64 * wg + 2 * t;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<__nv_bfloat162*>(static_cast<In*>(p.dq) + off + 8 * j) =
            __floats2bfloat162_rn(dq[j][2 * hf], dq[j][2 * hf + 1]);
        *reinterpret_cast<__nv_bfloat162*>(static_cast<In*>(p.dk) + off + 8 * j) =
            __floats2bfloat162_rn(dk[j][2 * hf], dk[j][2 * hf + 1]);
      }
    }
    if (nx->L == 0) break;
    item += gridDim.x;
    chunk = nx->chunk;
    hq = nx->hq;
    ck.tok0 = nx->tok0;
    ck.L = nx->L;
    ++n_item;
  }  // items
  if constexpr (kProbe) {
    const int sel = blockIdx.x == 0 ? 0 : blockIdx.x == 64 ? 1 : -1;
    if (threadIdx.x == 0 && sel >= 0) {
      long long ns;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
      g_wg_probe[sel][23] = ns - probe_ts[24];
      g_wg_probe[sel][24] = n_item + 1;
    }
  }
}

}  // namespace cuda
}  // namespace flashgdn
