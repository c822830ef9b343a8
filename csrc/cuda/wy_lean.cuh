// wy_lean_kernel<In, kH>  grid (max_chunks * H_v / wy_heads), 128 threads (one warpgroup),
//   kH >= wy_heads value heads of one q/k head a block (38 KB smem at two heads, 5 blocks an SM).
//   The default forward pass's WY part (wy_batched_kernel's outputs, not its bits) in the
//   shape an auxiliary warpgroup of a fused forward kernel can run (docs/perf-notes.md plan
//   item 1): one warpgroup, block-wide barriers only between its phases, few instructions:
//   * K K^T and Q K^T, only their lower block triangle: warp w rows 16 w .. +16, columns
//     0 .. 16 w + 15, m16n8k16 on the inputs' 16-bit type (exact products);
//   * per head one exp2 an element, Dec[r, s] = 2^{(G_r - G_s) log2 e} (s <= r):
//     A = diag(beta) (Dec . K K^T) strictly below the diagonal, fp16 into shared memory
//     (the diagonal 16 x 16 blocks also in fp32), P = Dec . Q K^T to global memory (fp16);
//   * T = (I + A)^-1 by doubling: the four 16 x 16 diagonal blocks by fp32 substitution,
//     then the blocks of 16 joined pairwise, then those of 32
//     ([[T1, 0], [A21, T2]] -> [[T1, 0], [-T2 (A21 T1), T2]]), every join as transposed
//     products (X^T = T1^T A21^T, T21^T = -X^T T2^T) so that X^T's accumulators are the next
//     product's A operand in registers; fp16 operands, fp32 accumulation
//     (bench/precision_study.py "inverse by doubling": o and state errors as wy_kernel's);
//   * Tv16 = T diag(beta) in fp16 from the fp32 results (the joins' accumulators, the
//     substitution's values), staged in shared memory, stored as 16-byte rows.
//   reads  k, q, g, beta
//   writes P16, Tv16 (lower block triangle; with !tri16 zero blocks above it), G, EG, Lb, and
//          the fp16 copies of bf16 k and q where FwdParams::Kh_w asks
//   Not for the backward's recomputation (T, fp32 P): launch.cu takes wy_batched_kernel there.
#pragma once

#include "fwd_kernels.cuh"

namespace flashgdn {
namespace cuda {

constexpr int kLeanThreads = 128;
constexpr int kLeanLd = 72;         // fp16 [64][72] tiles: 144-byte rows, ldmatrix conflict free
// A head's part: its A (then T) tile and Tv16 staging tile (fp16). The four fp32 copies of
// A's diagonal blocks (16 rows of 64 bytes, the tiles' row stride) lie in the tiles' blocks
// above the diagonal, which nothing else reads or writes: diagonal blocks 0 and 1 in the Tv
// tile, 2 and 3 in the A tile, at row block 0, columns 16 .. 47 and row block 1, columns
// 32 .. 63.
constexpr size_t kLeanTile = sizeof(__half) * C * kLeanLd;
constexpr size_t kLeanHead = 2 * kLeanTile;
constexpr int kLeanDiagLd = kLeanLd / 2;  // floats
constexpr size_t wy_lean_tiles(int kH) {
  return sizeof(uint16_t) * 2 * C * LDH > kH * kLeanHead ? sizeof(uint16_t) * 2 * C * LDH
                                                         : kH * kLeanHead;
}
// the tail: beta and G of kH heads, |k|^2
constexpr size_t wy_lean_smem(int kH) { return wy_lean_tiles(kH) + sizeof(float) * (2 * kH + 1) * C; }

// T[row][col] = v of one head (row_off: its row offset) into Tmat / T16, rows in the chunk
// (wy_lean_kernel<., ., true>).
__device__ __forceinline__ void lean_put_t(const FwdParams& p, int64_t row_off, int L, int row,
                                           int col, float v) {
  if (row < L) {
    const int64_t idx = (row_off + static_cast<int64_t>(row) * p.Hv) * C + col;
    if (p.Tmat != nullptr) p.Tmat[idx] = v;
    if (p.T16 != nullptr) p.T16[idx] = __float2half_rn(v);
  }
}
// T21 = -y^T of a join (y: the m16 x 16 accumulators of T21^T, its rows T's columns i0 (the
// thread's row g's) and i0 + 8, its columns T's rows j0 + 8 nt + 2t (+1)) into Tmat / T16.
__device__ __forceinline__ void lean_store_t(const FwdParams& p, const float (&y)[2][4],
                                             int64_t row_off, int L, int i0, int j0) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      lean_put_t(p, row_off, L, j0 + 8 * nt + acc_col(e), i0 + (e >= 2 ? 8 : 0), -y[nt][e]);
}

// blocks an SM: one head (36 KB) 5, two heads (38 KB) 5, three (56 KB) 4, four (75 KB) 3
constexpr int wy_lean_occupancy(int kH) { return kH <= 2 ? 5 : kH == 3 ? 4 : 3; }

// kT (opt-in, FLASHGDN_WY_LEAN_T=1; not yet run on a GPU): also T (fp32 Tmat or fp16 T16)
// and fp32 P (Pmat) as the backward's recomputation and the kept forward ask, whole rows
// with zero blocks above the diagonal as wy_batched_kernel writes them: T from the fp32
// values where they are formed (the substitution's columns, the joins' accumulators).
template <typename In, int kH, bool kT = false>
__global__ void __launch_bounds__(kLeanThreads, wy_lean_occupancy(kH)) wy_lean_kernel(FwdParams p) {
  if (p.seqs.failed()) return;
  const int nh = p.wy_heads;  // divides H_v / H_qk, at most kH
  const WyBlock wb = wy_block(p, nh);
  const int64_t chunk = wb.chunk, h0 = wb.h0, hq = wb.hq;
  const ChunkRef ck = locate_chunk(p.seqs, chunk);
  if (ck.L == 0) return;
  const int L = ck.L;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  constexpr float kL2e = 1.4426950408889634f;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  In* Ks = reinterpret_cast<In*>(smem_raw);  // [C][LDH], then the heads' parts over them
  In* Qs = Ks + C * LDH;
  auto a_tile = [&](int hi) { return reinterpret_cast<__half*>(smem_raw + hi * kLeanHead); };
  auto tv_tile = [&](int hi) { return a_tile(hi) + C * kLeanLd; };
  auto diag = [&](int hi, int b) {  // row 0 of diagonal block b's fp32 copy (rows kLeanDiagLd apart)
    __half* tile = b < 2 ? tv_tile(hi) : a_tile(hi);
    return reinterpret_cast<float*>(tile + (b & 1) * (16 * kLeanLd + 16) + 16);
  };
  float* bs_all = reinterpret_cast<float*>(smem_raw + wy_lean_tiles(kH));  // [heads][C]
  float* Gs_all = bs_all + kH * C;                                       // [heads][C]
  float* kn = Gs_all + kH * C;                                           // [C] |k_r|^2

  const int64_t qk_off = (ck.tok0 * p.Hqk + hq) * D, row_off0 = ck.tok0 * p.Hv + h0;
  cp_async_tile_by<C, D, LDH, kLeanThreads>(Ks, static_cast<const In*>(p.k) + qk_off, p.Hqk * D,
                                            L, tid);
  cp_async_tile_by<C, D, LDH, kLeanThreads>(Qs, static_cast<const In*>(p.q) + qk_off, p.Hqk * D,
                                            L, tid);
  cp_async_commit();
  // gates: warp w takes heads w, w + 4, ..., lane l rows 2 l, 2 l + 1 (beta 0 past the chunk)
  for (int hi = warp; hi < nh; hi += 4) {
    const int r0 = 2 * lane;
    const int64_t i0 = (ck.tok0 + r0) * p.Hv + h0 + hi;
    float g0 = 0.f, g1 = 0.f, b0 = 0.f, b1 = 0.f;
    if (r0 < L) {
      g0 = load_scalar(p.g, p.g_dtype, i0);
      b0 = load_scalar(p.beta, p.beta_dtype, i0);
    }
    if (r0 + 1 < L) {
      g1 = load_scalar(p.g, p.g_dtype, i0 + p.Hv);
      b1 = load_scalar(p.beta, p.beta_dtype, i0 + p.Hv);
    }
    float incl = g0 + g1;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const float y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    *reinterpret_cast<float2*>(Gs_all + hi * C + r0) = make_float2(incl - g1, incl);
    *reinterpret_cast<float2*>(bs_all + hi * C + r0) = make_float2(b0, b1);
  }
  cp_async_wait<0>();
  __syncthreads();
  wy_fp16_copies<In, kLeanThreads>(p, Ks, Qs, h0, qk_off, L);

  // Q K^T, then K K^T, their lower block triangles one after the other (32 accumulators a
  // thread at most), on m16n8k16 in the inputs' 16-bit type (ldmatrix moves bits): rows
  // 16 rb .. +16, column blocks jp <= rb, with rb = w for Q K^T and 3 - w for K K^T (every
  // warp five 16 x 16 blocks of products and epilogue)
  const __half* Kh = reinterpret_cast<const __half*>(Ks);
  auto lower_product = [&](float (&acc)[8][4], const In* X, int rb) {
    const __half* Xh = reinterpret_cast<const __half*>(X);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll 2
    for (int k0 = 0; k0 < D; k0 += 16) {
      uint32_t a[4];
      frag_a16(a, Xh, LDH, 16 * rb, k0);
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        if (jp > rb) break;  // warp-uniform
        uint32_t b0[2], b1[2];
        frag_b16_pair(b0, b1, Kh, LDH, 16 * jp, k0);
        mma_16(acc[2 * jp], a, b0, Ks);
        mma_16(acc[2 * jp + 1], a, b1, Ks);
      }
    }
  };
  // Dec[r, s] for the thread's elements of column tile j (rows ra, ra + 8; columns s, s + 1)
  auto decay = [&](float (&d)[4], const float* Gs, const float (&gr)[2], int ra, int j) {
    const int s = 8 * j + 2 * t;
    const float2 gs = *reinterpret_cast<const float2*>(Gs + s);
    const float gs0 = gs.x * kL2e, gs1 = gs.y * kL2e;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = ra + 8 * i;
      d[2 * i] = s <= r ? exp2f(gr[i] - gs0) : 0.f;
      d[2 * i + 1] = s + 1 <= r ? exp2f(gr[i] - gs1) : 0.f;
    }
  };

  // P = Dec . Q K^T (fp16) to global memory, every head
  {
    const int rb = warp, ra = 16 * rb + g;
    float qk[8][4];
    lower_product(qk, Qs, rb);
    for (int hi = 0; hi < nh && (p.P16 != nullptr || (kT && p.Pmat != nullptr)); ++hi) {
      const float* Gs = Gs_all + hi * C;
      const int64_t row_off = row_off0 + hi;
      const float gr[2] = {Gs[ra] * kL2e, Gs[ra + 8] * kL2e};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j >= 2 * (rb + 1)) break;
        float d[4];
        decay(d, Gs, gr, ra, j);
        const int s = 8 * j + 2 * t;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = ra + 8 * i;
          if constexpr (kT) {
            if (r < L && p.Pmat != nullptr)
              *reinterpret_cast<float2*>(p.Pmat + (row_off + r * p.Hv) * C + s) =
                  make_float2(round_tf32(d[2 * i] * qk[j][2 * i]),
                              round_tf32(d[2 * i + 1] * qk[j][2 * i + 1]));
            if (r < L && p.P16 != nullptr)
              *reinterpret_cast<uint32_t*>(p.P16 + (row_off + r * p.Hv) * C + s) =
                  pack_half2(d[2 * i] * qk[j][2 * i], d[2 * i + 1] * qk[j][2 * i + 1]);
          } else if (r < L) {
            *reinterpret_cast<uint32_t*>(p.P16 + (row_off + r * p.Hv) * C + s) =
                pack_half2(d[2 * i] * qk[j][2 * i], d[2 * i + 1] * qk[j][2 * i + 1]);
          }
        }
      }
    }
  }
  // A = diag(beta) (Dec . K K^T) strictly below the diagonal: fp16 blocks into the head's A
  // tile (over K and Q, after the barrier), the diagonal blocks also as fp32; |k|^2
  {
    const int rb = 3 - warp, m0 = 16 * rb, ra = m0 + g;
    float kk[8][4];
    lower_product(kk, Ks, rb);
    __syncthreads();  // every read of K, Q done: the heads' parts go over them
    for (int hi = 0; hi < nh; ++hi) {
      const float* bs = bs_all + hi * C;
      const float* Gs = Gs_all + hi * C;
      const float gr[2] = {Gs[ra] * kL2e, Gs[ra + 8] * kL2e}, br[2] = {bs[ra], bs[ra + 8]};
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        if (jp > rb) break;
        float av[2][4];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int j = 2 * jp + hf, s = 8 * j + 2 * t;
          float d[4];
          decay(d, Gs, gr, ra, j);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int r = ra + 8 * i;
            const float k0 = kk[j][2 * i], k1 = kk[j][2 * i + 1];
            av[hf][2 * i] = s < r ? br[i] * d[2 * i] * k0 : 0.f;
            av[hf][2 * i + 1] = s + 1 < r ? br[i] * d[2 * i + 1] * k1 : 0.f;
            if (jp == rb) {  // the diagonal block: fp32 A for the substitution, |k|^2
              *reinterpret_cast<float2*>(diag(hi, rb) + (r - m0) * kLeanDiagLd + s - m0) =
                  make_float2(av[hf][2 * i], av[hf][2 * i + 1]);
              if (hi == 0) {
                if (s == r) kn[r] = k0;
                if (s + 1 == r) kn[r] = k1;
              }
            }
          }
        }
        uint32_t a[4];
        acc_to_a16(a, av[0], av[1]);
        store_frag_a16(a_tile(hi), kLeanLd, m0, 16 * jp, a);
      }
    }
  }
  // blocks of P16 and Tv16 above the diagonal: zero with whole tiles (!tri16), NaN under
  // FLASHGDN_DEBUG=16 (no reader may take them), else not written
  if (!p.tri16 || (p.debug & 16)) {
    const uint4 fill = (p.debug & 16) ? make_uint4(kHalf2NaN, kHalf2NaN, kHalf2NaN, kHalf2NaN)
                                      : make_uint4(0u, 0u, 0u, 0u);
    for (int e = tid; e < nh * C * (C / 8); e += kLeanThreads) {
      const int hi = e / (C * (C / 8)), r = (e / (C / 8)) % C, c = 8 * (e % (C / 8));
      if (r < L && c / 16 > r / 16) {
        const int64_t idx = (row_off0 + hi + r * p.Hv) * C + c;
        if (p.P16 != nullptr) *reinterpret_cast<uint4*>(p.P16 + idx) = fill;
        *reinterpret_cast<uint4*>(p.Tv16 + idx) = fill;
        if constexpr (kT) {  // zero blocks of T and fp32 P (the backward asks no NaN poison)
          const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
          if (p.T16 != nullptr) *reinterpret_cast<uint4*>(p.T16 + idx) = make_uint4(0u, 0u, 0u, 0u);
          if (p.Tmat != nullptr) {
            *reinterpret_cast<float4*>(p.Tmat + idx) = z;
            *reinterpret_cast<float4*>(p.Tmat + idx + 4) = z;
          }
          if (p.Pmat != nullptr) {
            *reinterpret_cast<float4*>(p.Pmat + idx) = z;
            *reinterpret_cast<float4*>(p.Pmat + idx + 4) = z;
          }
        }
      }
    }
  }
  __syncthreads();

  // Diagonal blocks of T by fp32 forward substitution, a thread a column of one head's block:
  // T_bb (fp16) over A_bb in the A tile, T_bb diag(beta) (fp16) into the Tv tile
  for (int task = tid; task < nh * C; task += kLeanThreads) {
    const int hi = task / C, b = (task % C) / 16, jj = task % 16;
    const float* a = diag(hi, b);
    float tc[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float acc = r == jj ? 1.f : 0.f;
#pragma unroll
      for (int s = 0; s < r; ++s) acc -= a[r * kLeanDiagLd + s] * tc[s];
      tc[r] = acc;
    }
    const float bj = bs_all[hi * C + 16 * b + jj];
    __half* tt = a_tile(hi) + 16 * b * kLeanLd + 16 * b + jj;
    __half* tv = tv_tile(hi) + 16 * b * kLeanLd + 16 * b + jj;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      tt[r * kLeanLd] = __float2half_rn(tc[r]);
      tv[r * kLeanLd] = __float2half_rn(tc[r] * bj);
    }
    if constexpr (kT) {  // T's column 16 b + jj of block b
#pragma unroll
      for (int r = 0; r < 16; ++r) lean_put_t(p, row_off0 + hi, L, 16 * b + r, 16 * b + jj, tc[r]);
    }
  }
  __syncthreads();

  // Joins of 16: rows m = r0 + 16 .. +16, columns r0 .. +16 (r0 = 0, 32), a warp each
  for (int task = warp; task < 2 * nh; task += 4) {
    const int hi = task >> 1, r0 = 32 * (task & 1), m = r0 + 16;
    __half* tt = a_tile(hi);
    const float* bs = bs_all + hi * C;
    float x[2][4] = {}, y[2][4] = {};
    uint32_t a[4], b0[2], b1[2];
    frag_a16_trans(a, tt, kLeanLd, r0, r0);      // T1^T
    frag_b16_pair(b0, b1, tt, kLeanLd, m, r0);   // A21^T
    mma_f16(x[0], a, b0);
    mma_f16(x[1], a, b1);
    acc_to_a16(a, x[0], x[1]);                   // X^T
    frag_b16_pair(b0, b1, tt, kLeanLd, m, m);    // T2^T
    mma_f16(y[0], a, b0);
    mma_f16(y[1], a, b1);                        // y = -T21^T
    const int i0 = r0 + g;
    acc_to_a16(a, y[0], y[1], -1.f, -1.f);
    store_frag_a16_trans(tt, kLeanLd, m, r0, a);  // T21 over A21 (read above)
    acc_to_a16(a, y[0], y[1], -bs[i0], -bs[i0 + 8]);
    store_frag_a16_trans(tv_tile(hi), kLeanLd, m, r0, a);
    if constexpr (kT) lean_store_t(p, y, row_off0 + hi, L, i0, m);
  }
  __syncthreads();

  // The join of 32: rows 32 + 16 jh .. +16, columns 16 ih .. +16 of T21 = -T2 (A21 T1), a
  // warp task (head, ih, jh); only T diag(beta) is written (T itself is read no more), so the
  // tasks read A21 while others store. Blocks above the diagonal (unwritten) are skipped.
  for (int task = warp; task < 4 * nh; task += 4) {
    const int hi = task >> 2, ih = (task >> 1) & 1, jh = task & 1;
    const __half* tt = a_tile(hi);
    const float* bs = bs_all + hi * C;
    float x[4][4] = {}, y[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      if (ks < ih) continue;  // T1[k][i] = 0 for k < 16 <= i
      uint32_t a[4];
      frag_a16_trans(a, tt, kLeanLd, 16 * ih, 16 * ks);  // T1^T rows 16 ih .., k 16 ks ..
#pragma unroll
      for (int jn = 0; jn < 2; ++jn) {
        uint32_t b0[2], b1[2];
        frag_b16_pair(b0, b1, tt, kLeanLd, 32 + 16 * jn, 16 * ks);  // A21^T
        mma_f16(x[2 * jn], a, b0);
        mma_f16(x[2 * jn + 1], a, b1);
      }
    }
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      if (ks > jh) continue;  // T2[j][k] = 0 for j < 16 <= k
      uint32_t a[4], b0[2], b1[2];
      acc_to_a16(a, x[2 * ks], x[2 * ks + 1]);                         // X^T
      frag_b16_pair(b0, b1, tt, kLeanLd, 32 + 16 * jh, 32 + 16 * ks);  // T2^T
      mma_f16(y[0], a, b0);
      mma_f16(y[1], a, b1);
    }
    const int i0 = 16 * ih + g;
    uint32_t a[4];
    acc_to_a16(a, y[0], y[1], -bs[i0], -bs[i0 + 8]);
    store_frag_a16_trans(tv_tile(hi), kLeanLd, 32 + 16 * jh, 16 * ih, a);
    if constexpr (kT) lean_store_t(p, y, row_off0 + hi, L, i0, 32 + 16 * jh);
  }
  __syncthreads();

  // Tv16 (lower block triangle) as 16-byte row pieces, G, e^G, the warm-up bound
  for (int e = tid; e < nh * C * (C / 8); e += kLeanThreads) {
    const int hi = e / (C * (C / 8)), r = (e / (C / 8)) % C, c = 8 * (e % (C / 8));
    if (r < L && c / 16 <= r / 16)
      *reinterpret_cast<uint4*>(p.Tv16 + (row_off0 + hi + r * p.Hv) * C + c) =
          *reinterpret_cast<const uint4*>(tv_tile(hi) + r * kLeanLd + c);
  }
  for (int hi = 0; hi < nh; ++hi) {
    const float* bs = bs_all + hi * C;
    const float* Gs = Gs_all + hi * C;
    if (p.Lb != nullptr && warp == hi % 4) wy_store_lb(p, bs, Gs, kn, L, chunk * p.Hv + h0 + hi);
    wy_store_gates(p, Gs, row_off0 + hi, L, tid, kLeanThreads);
  }
}

}  // namespace cuda
}  // namespace flashgdn
