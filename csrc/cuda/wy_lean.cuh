// wy_lean_kernel<In, kH>  grid (max_chunks * H_v / wy_heads), 128 threads (one warpgroup),
//   kH == wy_heads value heads of one q/k head a block (38 KB smem at two heads, 5 blocks an SM;
//   kQ = false, no q read: one head 19 KB, 8 blocks an SM; two heads 37,888 bytes, 6).
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
//   The phases are warpgroup functions (lean_lower_product, lean_p_epilogue, lean_a_epilogue,
//   lean_inverse), which the fused forward's auxiliary warpgroup (fwd_fused.cuh) runs too.
//   reads  k, q (not where no P is asked: the fused forward's FLASHGDN_FUSED=1, 2), g, beta
//   writes P16, Tv16 (lower block triangle; with !tri16 zero blocks above it), G, EG, Lb, and
//          the fp16 copies of bf16 k and q where FwdParams::Kh_w asks; kT also T (Tmat or
//          T16) and fp32 P (Pmat)
//   The backward's recomputation and the kept forward (T, fp32 P) take wy_batched_kernel
//   unless FLASHGDN_WY_LEAN_T=1 asks for kT (launch.cu wy_lean_heads).
//
// wy_gates_kernel (below): only G, EG and Lb, for the fused forward's FLASHGDN_FUSED=3.
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
// kQ: q's tile too (P or the fp16 copies asked); without it (the fused forward's kWy 1, which
// forms P itself) only K's tile lies under the heads' tiles
constexpr size_t wy_lean_tiles(int kH, bool kQ = true) {
  const size_t inputs = sizeof(uint16_t) * (kQ ? 2 : 1) * C * LDH;
  return inputs > kH * kLeanHead ? inputs : kH * kLeanHead;
}
// the tail: beta and G of kH heads, |k|^2 (!kQ: |k|^2 in head 0's A tile's padding columns
// 64 .. 71, which nothing else reads or writes: wy_lean_kn_ld)
constexpr size_t wy_lean_smem(int kH, bool kQ = true) {
  return wy_lean_tiles(kH, kQ) + sizeof(float) * (2 * kH + (kQ ? 1 : 0)) * C;
}
// |k_r|^2's place: kn[r * kn_ld]
constexpr int wy_lean_kn_ld(bool kQ) { return kQ ? 1 : kLeanLd / 2; }

// blocks an SM: one head (36 KB) 5, two heads (38 KB) 5, three (56 KB) 4, four (75 KB) 3;
// without q's tile: one head (19 KB) 8 (64 registers: ptxas spills 4 bytes), two heads
// (37,888 bytes: with the 1 KB the SM reserves a block, six fill its 228 KB exactly) 6
constexpr int wy_lean_occupancy(int kH, bool kQ = true) {
  return !kQ && kH == 1 ? 8 : !kQ && kH == 2 ? 6 : kH <= 2 ? 5 : kH == 3 ? 4 : 3;
}

// The warpgroup's chunk work, as device functions a kernel composes (wy_lean_kernel below; a
// fused forward kernel's auxiliary warpgroup, docs/perf-notes.md plan item 1). They run on
// the 128 threads of one warpgroup (wt = the thread's index in it, warp = wt / 32), for nh
// value heads of one q/k head whose tiles LeanTiles places; `sync` is the warpgroup's
// barrier between phases (__syncthreads in a block of one warpgroup, a named barrier of 128
// threads in a larger one).

// Where head hi's A (then T) tile and T diag(beta) tile lie ([C][kLeanLd] fp16 each, heads
// `stride` halves apart), and the fp32 copies of A's diagonal blocks in their unused upper
// blocks (kLeanHead's comment).
struct LeanTiles {
  __half* a0;
  __half* tv0;
  int stride;
  __device__ __forceinline__ __half* a(int hi) const { return a0 + hi * stride; }
  __device__ __forceinline__ __half* tv(int hi) const { return tv0 + hi * stride; }
  // row 0 of diagonal block b's fp32 copy (rows kLeanDiagLd floats apart)
  __device__ __forceinline__ float* diag(int hi, int b) const {
    __half* tile = b < 2 ? tv(hi) : a(hi);
    return reinterpret_cast<float*>(tile + (b & 1) * (16 * kLeanLd + 16) + 16);
  }
};

constexpr float kLeanL2e = 1.4426950408889634f;

// A lane's g and beta: rows 2 lane, 2 lane + 1 of value head h in the chunk from tok0 (L
// rows; g 0 and beta 0 past them, so G stays at G_{L-1}).
struct LeanGb {
  float g0 = 0.f, g1 = 0.f, b0 = 0.f, b1 = 0.f;
};
__device__ __forceinline__ LeanGb lean_gates_load(const FwdParams& p, int64_t tok0, int L,
                                                  int64_t h, int lane) {
  LeanGb v;
  const int r0 = 2 * lane;
  const int64_t i0 = (tok0 + r0) * p.Hv + h;
  if (r0 < L) {
    v.g0 = load_scalar(p.g, p.g_dtype, i0);
    v.b0 = load_scalar(p.beta, p.beta_dtype, i0);
  }
  if (r0 + 1 < L) {
    v.g1 = load_scalar(p.g, p.g_dtype, i0 + p.Hv);
    v.b1 = load_scalar(p.beta, p.beta_dtype, i0 + p.Hv);
  }
  return v;
}
// The warp's inclusive scan of the loaded g into G (Gs[C]) and beta into bs[C].
__device__ __forceinline__ void lean_gates_scan(const LeanGb& v, float* Gs, float* bs, int lane) {
  const int r0 = 2 * lane;
  float incl = v.g0 + v.g1;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const float y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  *reinterpret_cast<float2*>(Gs + r0) = make_float2(incl - v.g1, incl);
  *reinterpret_cast<float2*>(bs + r0) = make_float2(v.b0, v.b1);
}
// Cumulative gates G (an inclusive scan over the chunk's rows) and beta of the nh value heads
// from h0 into Gs_all, bs_all ([heads][C]): warp w takes heads w, w + 4, ..., lane l rows
// 2 l, 2 l + 1 (lean_gates_load, lean_gates_scan); warp: the calling warp's index in its
// warpgroup.
__device__ __forceinline__ void lean_gates(const FwdParams& p, int64_t tok0, int L, int64_t h0,
                                           int nh, float* Gs_all, float* bs_all, int warp) {
  const int lane = lane_id();
  for (int hi = warp; hi < nh; hi += 4)
    lean_gates_scan(lean_gates_load(p, tok0, L, h0 + hi, lane), Gs_all + hi * C,
                    bs_all + hi * C, lane);
}

// The lower block triangle of X K^T (X = Q or K, [C][LDH] tiles in the 16-bit input type):
// rows 16 rb .. +16 of the calling warp, column blocks jp <= rb, m16n8k16 with fp32
// accumulators (acc[j]: columns 8 j ..; tiles past the triangle stay zero).
template <typename In>
__device__ __forceinline__ void lean_lower_product(float (&acc)[8][4], const In* X, const In* Ks,
                                                   int rb) {
  const __half* Xh = reinterpret_cast<const __half*>(X);
  const __half* Kh = reinterpret_cast<const __half*>(Ks);
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
}

// Dec[r, s] = 2^{(G_r - G_s) log2 e} (0 above the diagonal) for the thread's elements of
// column tile j: rows ra, ra + 8 (gr: their G times log2 e), columns 8 j + 2t, + 1.
__device__ __forceinline__ void lean_decay(float (&d)[4], const float* Gs, const float (&gr)[2],
                                           int ra, int j) {
  const int s = 8 * j + 2 * (lane_id() & 3);
  const float2 gs = *reinterpret_cast<const float2*>(Gs + s);
  const float gs0 = gs.x * kLeanL2e, gs1 = gs.y * kLeanL2e;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = ra + 8 * i;
    d[2 * i] = s <= r ? exp2f(gr[i] - gs0) : 0.f;
    d[2 * i + 1] = s + 1 <= r ? exp2f(gr[i] - gs1) : 0.f;
  }
}

// P = Dec . Q K^T of one head from Q K^T's accumulators (lean_lower_product, row block rb):
// store(r, s, p0, p1) takes rows r < L, columns s, s + 1 (fp32).
template <typename Store>
__device__ __forceinline__ void lean_p_epilogue(const float (&qk)[8][4], const float* Gs, int rb,
                                                int L, Store store) {
  const int ra = 16 * rb + (lane_id() >> 2), t = lane_id() & 3;
  const float gr[2] = {Gs[ra] * kLeanL2e, Gs[ra + 8] * kLeanL2e};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j >= 2 * (rb + 1)) break;
    float d[4];
    lean_decay(d, Gs, gr, ra, j);
    const int s = 8 * j + 2 * t;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = ra + 8 * i;
      if (r < L) store(r, s, d[2 * i] * qk[j][2 * i], d[2 * i + 1] * qk[j][2 * i + 1]);
    }
  }
}

// A = diag(beta) (Dec . K K^T) strictly below the diagonal of head hi from K K^T's
// accumulators (row block rb): fp16 blocks into its A tile (stmatrix), the diagonal block
// also as fp32 (tiles.diag); |k_r|^2 into kn[r * kn_ld] where with_kn.
__device__ __forceinline__ void lean_a_epilogue(const float (&kk)[8][4], const LeanTiles& tiles,
                                                int hi, const float* Gs, const float* bs, int rb,
                                                float* kn, bool with_kn, int kn_ld = 1) {
  const int m0 = 16 * rb, ra = m0 + (lane_id() >> 2), t = lane_id() & 3;
  const float gr[2] = {Gs[ra] * kLeanL2e, Gs[ra + 8] * kLeanL2e}, br[2] = {bs[ra], bs[ra + 8]};
#pragma unroll
  for (int jp = 0; jp < 4; ++jp) {
    if (jp > rb) break;
    float av[2][4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int j = 2 * jp + hf, s = 8 * j + 2 * t;
      float d[4];
      lean_decay(d, Gs, gr, ra, j);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = ra + 8 * i;
        const float k0 = kk[j][2 * i], k1 = kk[j][2 * i + 1];
        av[hf][2 * i] = s < r ? br[i] * d[2 * i] * k0 : 0.f;
        av[hf][2 * i + 1] = s + 1 < r ? br[i] * d[2 * i + 1] * k1 : 0.f;
        if (jp == rb) {  // the diagonal block: fp32 A for the substitution, |k|^2
          *reinterpret_cast<float2*>(tiles.diag(hi, rb) + (r - m0) * kLeanDiagLd + s - m0) =
              make_float2(av[hf][2 * i], av[hf][2 * i + 1]);
          if (with_kn) {
            if (s == r) kn[r * kn_ld] = k0;
            if (s + 1 == r) kn[r * kn_ld] = k1;
          }
        }
      }
    }
    uint32_t a[4];
    acc_to_a16(a, av[0], av[1]);
    store_frag_a16(tiles.a(hi), kLeanLd, m0, 16 * jp, a);
  }
}

// Where T itself goes besides T diag(beta): nowhere (the forward), or (wy_lean_kernel<., .,
// true>) a sink with column(hi, b, jj, tc) for a substitution thread's column jj of diagonal
// block b, tc[r] = T[16 b + r][16 b + jj], and join(hi, y, i0, j0) for a join's
// accumulators y of -T21^T (rows: T's columns i0 and i0 + 8; columns: T's rows j0 + 8 nt +
// 2t (+1)).
struct LeanNoT {
  __device__ __forceinline__ void column(int, int, int, const float (&)[16]) const {}
  __device__ __forceinline__ void join(int, const float (&)[2][4], int, int) const {}
};

// Column jj of a diagonal block's inverse, (I + A_bb)^-1 e_jj, by fp32 forward substitution
// (a: A_bb's rows, ld floats apart; strictly lower).
__device__ __forceinline__ void lean_substitute(float (&tc)[16], const float* a, int ld, int jj) {
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    float acc = r == jj ? 1.f : 0.f;
#pragma unroll
    for (int s = 0; s < r; ++s) acc -= a[r * ld + s] * tc[s];
    tc[r] = acc;
  }
}

// T = (I + A)^-1 of nh heads by doubling (after lean_a_epilogue and a `sync`): T diag(beta)
// (fp16, lower block triangle) into each head's Tv tile, T itself to `sink`; the A tiles
// hold T's diagonal blocks and the joins of 16 afterwards. bs_all: beta, [heads][C]. Ends
// with a `sync`.
template <typename Sync, typename TSink = LeanNoT>
__device__ __forceinline__ void lean_inverse(const LeanTiles& tiles, const float* bs_all, int nh,
                                             int wt, Sync sync, TSink sink = {}) {
  const int warp = wt >> 5, lane = lane_id(), g = lane >> 2;
  // Diagonal blocks of T by fp32 forward substitution, a thread a column of one head's block:
  // T_bb (fp16) over A_bb in the A tile, T_bb diag(beta) (fp16) into the Tv tile
  for (int task = wt; task < nh * C; task += kLeanThreads) {
    const int hi = task / C, b = (task % C) / 16, jj = task % 16;
    float tc[16];
    lean_substitute(tc, tiles.diag(hi, b), kLeanDiagLd, jj);
    const float bj = bs_all[hi * C + 16 * b + jj];
    __half* tt = tiles.a(hi) + 16 * b * kLeanLd + 16 * b + jj;
    __half* tv = tiles.tv(hi) + 16 * b * kLeanLd + 16 * b + jj;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      tt[r * kLeanLd] = __float2half_rn(tc[r]);
      tv[r * kLeanLd] = __float2half_rn(tc[r] * bj);
    }
    sink.column(hi, b, jj, tc);
  }
  sync();

  // Joins of 16: rows m = r0 + 16 .. +16, columns r0 .. +16 (r0 = 0, 32), a warp each
  for (int task = warp; task < 2 * nh; task += 4) {
    const int hi = task >> 1, r0 = 32 * (task & 1), m = r0 + 16;
    __half* tt = tiles.a(hi);
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
    store_frag_a16_trans(tiles.tv(hi), kLeanLd, m, r0, a);
    sink.join(hi, y, i0, m);
  }
  sync();

  // The join of 32: rows 32 + 16 jh .. +16, columns 16 ih .. +16 of T21 = -T2 (A21 T1), a
  // warp task (head, ih, jh); only T diag(beta) is written (T itself is read no more), so the
  // tasks read A21 while others store. Blocks above the diagonal (unwritten) are skipped.
  for (int task = warp; task < 4 * nh; task += 4) {
    const int hi = task >> 2, ih = (task >> 1) & 1, jh = task & 1;
    const __half* tt = tiles.a(hi);
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
    store_frag_a16_trans(tiles.tv(hi), kLeanLd, 32 + 16 * jh, 16 * ih, a);
    sink.join(hi, y, i0, 32 + 16 * jh);
  }
  sync();
}

// kT (FLASHGDN_WY_LEAN_T=1): also T (fp32 Tmat or fp16 T16) and fp32 P (Pmat) as the
// backward's recomputation and the kept forward ask, whole rows with zero blocks above the
// diagonal as wy_batched_kernel writes them: T from the fp32 values where they are formed
// (the substitution's columns, the joins' accumulators), fp16 T16 staged as 16-byte rows.
// kQ = false (launch.cu wy_lean_k_only): no P, no copies asked, so no q read; K's tile alone
// under the heads' tiles, a smaller block and more of them an SM (wy_lean_occupancy).
template <typename In, int kH, bool kT = false, bool kQ = true>
__global__ void __launch_bounds__(kLeanThreads, wy_lean_occupancy(kH, kQ))
    wy_lean_kernel(FwdParams p) {
  static_assert(kQ || !kT, "kT asks for fp32 P: q's tile");
  if (p.seqs.failed()) return;
  // p.wy_heads == kH (launch_wy picks the instantiation by the heads a block), so the head
  // loops below have trip counts the compiler knows
  constexpr int nh = kH;
  const WyBlock wb = wy_block(p, nh);
  const int64_t chunk = wb.chunk, h0 = wb.h0, hq = wb.hq;
  const ChunkRef ck = wb.ck;
  if (ck.L == 0) return;
  const int L = ck.L;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = lane_id();

  extern __shared__ __align__(16) unsigned char smem_raw[];
  In* Ks = reinterpret_cast<In*>(smem_raw);  // [C][LDH], then the heads' tiles over them
  In* Qs = Ks + C * LDH;
  const LeanTiles tiles{reinterpret_cast<__half*>(smem_raw),
                        reinterpret_cast<__half*>(smem_raw) + C * kLeanLd,
                        static_cast<int>(kLeanHead / sizeof(__half))};
  float* bs_all = reinterpret_cast<float*>(smem_raw + wy_lean_tiles(kH, kQ));  // [heads][C]
  float* Gs_all = bs_all + kH * C;                                       // [heads][C]
  // |k_r|^2: kn[r * kn_ld] (!kQ: the padding of head 0's A tile, written after every read of K)
  constexpr int kn_ld = wy_lean_kn_ld(kQ);
  float* kn = kQ ? Gs_all + kH * C : reinterpret_cast<float*>(tiles.a0 + C);
  auto sync = [] { __syncthreads(); };

  const int64_t qk_off = (ck.tok0 * p.Hqk + hq) * D, row_off0 = ck.tok0 * p.Hv + h0;
  cp_async_tile_by<C, D, LDH, kLeanThreads>(Ks, static_cast<const In*>(p.k) + qk_off, p.Hqk * D,
                                            L, tid);
  // no P asked (the fused forward forms it: FLASHGDN_FUSED=1, 2): no q, no Q K^T
  const bool with_p =
      kQ && (p.P16 != nullptr || (kT && p.Pmat != nullptr) || p.Qh_w != nullptr);
  if (with_p)
    cp_async_tile_by<C, D, LDH, kLeanThreads>(Qs, static_cast<const In*>(p.q) + qk_off,
                                              p.Hqk * D, L, tid);
  cp_async_commit();
  lean_gates(p, ck.tok0, L, h0, nh, Gs_all, bs_all, warp);
  cp_async_wait<0>();
  sync();
  if constexpr (kQ) wy_fp16_copies<In, kLeanThreads>(p, Ks, Qs, h0, qk_off, L);

  // Q K^T, then K K^T (32 accumulators a thread at a time): row block rb = w for Q K^T and
  // 3 - w for K K^T, so that every warp takes five 16 x 16 blocks of products and epilogue.
  // P = Dec . Q K^T (fp16) to global memory, every head
  if (with_p) {
    float qk[8][4];
    lean_lower_product(qk, Qs, Ks, warp);
    for (int hi = 0; hi < nh && (p.P16 != nullptr || (kT && p.Pmat != nullptr)); ++hi) {
      const int64_t row_off = row_off0 + hi;
      lean_p_epilogue(qk, Gs_all + hi * C, warp, L, [&](int r, int s, float p0, float p1) {
        if (!kT || p.P16 != nullptr)
          *reinterpret_cast<uint32_t*>(p.P16 + (row_off + r * p.Hv) * C + s) = pack_half2(p0, p1);
        if (kT && p.Pmat != nullptr)
          *reinterpret_cast<float2*>(p.Pmat + (row_off + r * p.Hv) * C + s) =
              make_float2(round_tf32(p0), round_tf32(p1));
      });
    }
  }
  // A into the heads' A tiles (over K and Q, after the barrier), |k|^2
  {
    float kk[8][4];
    lean_lower_product(kk, Ks, Ks, 3 - warp);
    sync();  // every read of K, Q done: the heads' tiles go over them
    for (int hi = 0; hi < nh; ++hi)
      lean_a_epilogue(kk, tiles, hi, Gs_all + hi * C, bs_all + hi * C, 3 - warp, kn, hi == 0,
                      kn_ld);
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
  sync();
  if constexpr (kT) {  // T itself, rows in the chunk: fp32 Tmat or fp16 T16
    // fp32 Tmat: stored where the values are formed. fp16 T16: staged in shared memory and
    // stored as 16-byte rows below (2-byte stores from here cost the recomputation ~200 us at
    // 16/32 x 32768): the A tile holds T's diagonal blocks and the joins of 16 after the
    // inverse; the join of 32's block (rows 32 .., columns 0 .. 31) goes into the Tv tile's
    // upper right quarter (rows 0 .. 31, columns 32 .. 63), free once the substitution has
    // read the fp32 diagonal blocks there and read by no one else.
    struct Sink {
      const FwdParams& p;
      const LeanTiles& tiles;
      int64_t row_off0;
      int L;
      __device__ void column(int hi, int b, int jj, const float (&tc)[16]) const {
        if (p.Tmat == nullptr) return;
#pragma unroll
        for (int r = 0; r < 16; ++r) {
          const int row = 16 * b + r;
          if (row < L) p.Tmat[(row_off0 + hi + static_cast<int64_t>(row) * p.Hv) * C + 16 * b + jj] = tc[r];
        }
      }
      __device__ void join(int hi, const float (&y)[2][4], int i0, int j0) const {
        const int c0 = i0 - (lane_id() >> 2);  // the block's first column of T
        if (p.T16 != nullptr && j0 >= 32 && c0 < 32) {  // the join of 32
          uint32_t a[4];
          acc_to_a16(a, y[0], y[1], -1.f, -1.f);
          store_frag_a16_trans(tiles.tv(hi), kLeanLd, j0 - 32, 32 + c0, a);
        }
        if (p.Tmat == nullptr) return;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = j0 + 8 * nt + acc_col(e);
            if (row < L)
              p.Tmat[(row_off0 + hi + static_cast<int64_t>(row) * p.Hv) * C + i0 + (e >= 2 ? 8 : 0)] =
                  -y[nt][e];
          }
      }
    };
    lean_inverse(tiles, bs_all, nh, tid, sync, Sink{p, tiles, row_off0, L});
  } else {
    lean_inverse(tiles, bs_all, nh, tid, sync);
  }

  // Tv16 (and kT's T16; lower block triangle) as 16-byte row pieces, G, e^G, the warm-up bound
  for (int e = tid; e < nh * C * (C / 8); e += kLeanThreads) {
    const int hi = e / (C * (C / 8)), r = (e / (C / 8)) % C, c = 8 * (e % (C / 8));
    if (r < L && c / 16 <= r / 16) {
      const int64_t idx = (row_off0 + hi + r * p.Hv) * C + c;
      *reinterpret_cast<uint4*>(p.Tv16 + idx) =
          *reinterpret_cast<const uint4*>(tiles.tv(hi) + r * kLeanLd + c);
      if (kT && p.T16 != nullptr) {
        const __half* t = r >= 32 && c < 32 ? tiles.tv(hi) + (r - 32) * kLeanLd + 32 + c
                                            : tiles.a(hi) + r * kLeanLd + c;
        *reinterpret_cast<uint4*>(p.T16 + idx) = *reinterpret_cast<const uint4*>(t);
      }
    }
  }
  for (int hi = 0; hi < nh; ++hi) {
    const float* bs = bs_all + hi * C;
    const float* Gs = Gs_all + hi * C;
    if (p.Lb != nullptr && warp == hi % 4)
      wy_store_lb(p, bs, Gs, kn, L, chunk * p.Hv + h0 + hi, kn_ld);
    wy_store_gates(p, Gs, row_off0 + hi, L, tid, kLeanThreads);
  }
}

// wy_gates_kernel<In>  grid (max_chunks * H_v / wy_heads), 128 threads, ~2.3 KB static smem
//   The only pre-pass of the fused forward (gdn_fwd_fused_kernel, fwd_fused.cuh, which forms
//   T diag(beta) and P itself): per chunk and value head the cumulative gates G (lean_gates:
//   the same bits as wy_lean_kernel's), e^G and e^{G_last - G} for the state pass's copies,
//   and the warm-up bound Lb, with |k_r|^2 summed from k's rows (two threads a row).
//   reads  k, g, beta
//   writes G, EG, Lb
template <typename In>
__global__ void __launch_bounds__(kLeanThreads) wy_gates_kernel(FwdParams p) {
  if (p.seqs.failed()) return;
  const int nh = p.wy_heads;  // divides H_v / H_qk, at most kWyMaxHeads
  const WyBlock wb = wy_block(p, nh);
  const ChunkRef ck = wb.ck;
  if (ck.L == 0) return;
  const int L = ck.L, tid = static_cast<int>(threadIdx.x), warp = tid >> 5;
  __shared__ float bs_all[kWyMaxHeads * C], Gs_all[kWyMaxHeads * C], kn[C];
  lean_gates(p, ck.tok0, L, wb.h0, nh, Gs_all, bs_all, warp);
  {
    const int r = tid >> 1, half = tid & 1;
    float acc = 0.f;
    if (r < L) {
      const In* src = static_cast<const In*>(p.k) + ((ck.tok0 + r) * p.Hqk + wb.hq) * D + 64 * half;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float f[8];
        unpack8(f, *reinterpret_cast<const uint4*>(src + 8 * i), src);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = fmaf(f[j], f[j], acc);
      }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (half == 0) kn[r] = acc;
  }
  __syncthreads();
  const int64_t row_off0 = ck.tok0 * p.Hv + wb.h0;
  for (int hi = 0; hi < nh; ++hi) {
    const float* bs = bs_all + hi * C;
    const float* Gs = Gs_all + hi * C;
    if (p.Lb != nullptr && warp == hi % 4) wy_store_lb(p, bs, Gs, kn, L, wb.chunk * p.Hv + wb.h0 + hi);
    wy_store_gates(p, Gs, row_off0 + hi, L, tid, kLeanThreads);
  }
}

}  // namespace cuda
}  // namespace flashgdn
