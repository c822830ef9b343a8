// The fused forward's WY warpgroup of state_fwd_tma_kernel (kWy: FLASHGDN_COLS_TMA=4|5,
// docs/perf-notes.md plan item 1 and version 43), threads 384-511 of its 512: per chunk, from
// the K and Q tiles TMA landed in the stage, P = Dec . Q K^T into the stage's P tile (Q K^T as
// one wgmma group: mma.sync in this role slows the state warpgroups' wgmma), with kWy 2 also
// T diag(beta) (wy_inverse: A from K K^T, the diagonal blocks by substitution, the joins as
// doubling steps on wgmma) into its T tile; then bf16 K and Q to fp16 in place and its
// arrivals on full[s].
//   reads  the stage's K and Q tiles; g and beta (kWy 2) or G (kWy 1)
//   writes the stage's P (and T) tiles, K and Q as fp16
#pragma once

#include "state_fwd_tma_layout.cuh"
#include "wy_lean.cuh"

namespace flashgdn {
namespace cuda {

// Q K^T of the stage's 128-byte-swizzled [64][128] tiles (the input type) as one wgmma group of
// the calling warpgroup: its accumulators have lean_lower_product's layout with row block rb =
// the warp (rows 16 w + g, + 8; acc[j]: columns 8 j + 2t, + 1), over all 64 columns.
template <typename In>
__device__ __forceinline__ void qk_wgmma(float (&acc)[8][4], const unsigned char* Q,
                                         const unsigned char* K) {
  wgmma_fence();
  fence_acc(acc);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int off = (kk >> 2) * 8192 + (kk & 3) * 32;
    wgmma_ss_n64<In>(acc, sw128_desc(Q + off, 16, 1024), sw128_desc(K + off, 16, 1024), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc(acc);
}

// lean_lower_product (wy_lean.cuh) on the stage's 128-byte-swizzled [64][128] tiles (X, K in
// the 16-bit input type): the lower block triangle of X K^T, rows 16 rb .. +16 of the calling
// warp; the same fragments in the same order as there, so the same values.
template <typename In>
__device__ __forceinline__ void lean_lower_product_sw(float (&acc)[8][4], const unsigned char* X,
                                                      const unsigned char* Kt, int rb) {
  const int l = lane_id();
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  auto ldsm = [](uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(ptr)));
  };
#pragma unroll 1
  for (int k0 = 0; k0 < D; k0 += 16) {
    uint32_t a[4];
    ldsm(a[0], a[1], a[2], a[3], X + swz128(16 * rb + (l & 7) + ((l >> 3) & 1) * 8, k0 + (l >> 4) * 8));
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      if (jp > rb) break;  // warp-uniform
      uint32_t b0[2], b1[2];
      ldsm(b0[0], b0[1], b1[0], b1[1],
           Kt + swz128(16 * jp + (l & 7) + (l >> 4) * 8, k0 + ((l >> 3) & 1) * 8));
      mma_16(acc[2 * jp], a, b0, static_cast<const In*>(nullptr));
      mma_16(acc[2 * jp + 1], a, b1, static_cast<const In*>(nullptr));
    }
  }
}

// T diag(beta) of a chunk into the stage's T tile (kWy 2, the WY warpgroup), every product on
// wgmma (mma.sync there slows the state warpgroups' wgmma: docs/perf-notes.md version 43).
// K K^T as one wgmma group; A = diag(beta) (Dec . K K^T) strictly below the diagonal with
// lean_a_epilogue's arithmetic, into A1 (blocks (1,0), (3,2)) and A2 (the lower left 32 x 32),
// fp16 swizzled tiles whose other blocks stay zero, and its diagonal blocks in fp32; their
// inverses by lean_inverse's fp32 substitution; then the doubling in 64 x 64 form: with D the
// block diagonal of the inverses so far (fp16, in the T tile), (I + A_diag + A_off)^-1 =
// D - D A_off D (A_off D A_off is zero), once with A1 (blocks of 16 -> 32) and once with A2
// (32 -> 64), X = D A_off (SS, A_off read MN-major) then Z = X D (X's fp16 fragments from
// registers), as lean_inverse's joins: fp16 operands, fp32 accumulation. T diag(beta) is
// formed from fp32 values (the substitution's, the joins' accumulators). Threads: the
// warpgroup's 128 (wt), `sync` its barrier.
template <typename In, typename Sync>
__device__ __forceinline__ void wy_inverse(unsigned char* st, const float* Gs, const float* bs,
                                           unsigned char* wyt, int warp, int wt, Sync sync) {
  using Sm = StateFwdTmaSmem;
  unsigned char* A1 = wyt;
  unsigned char* A2 = wyt + 8192;
  float* Adg = reinterpret_cast<float*>(wyt + 16384);  // [4][16][16] A's diagonal blocks
  float* Tdg = Adg + 4 * 256;                          // [4][16][16] their inverses
  float* Z1 = Tdg + 4 * 256;                           // [2][16][16] T's blocks (1,0), (3,2)
  unsigned char* Tt = st + Sm::kOffT;
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
  {  // A from K K^T: the warp's rows 16 warp + g, + 8
    float kk[8][4];
    qk_wgmma<In>(kk, st + Sm::kOffK, st + Sm::kOffK);
    const int rb = warp, m0 = 16 * rb, ra = m0 + g;
    const float gr[2] = {Gs[ra] * kLeanL2e, Gs[ra + 8] * kLeanL2e}, br[2] = {bs[ra], bs[ra + 8]};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j >= 2 * (rb + 1)) break;  // warp-uniform: column tiles up to the diagonal block
      const int jp = j >> 1, s = 8 * j + 2 * t;
      float d[4];
      lean_decay(d, Gs, gr, ra, j);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = ra + 8 * i;
        const float a0 = s < r ? br[i] * d[2 * i] * kk[j][2 * i] : 0.f;
        const float a1 = s + 1 < r ? br[i] * d[2 * i + 1] * kk[j][2 * i + 1] : 0.f;
        if (jp == rb)
          *reinterpret_cast<float2*>(Adg + rb * 256 + (r - m0) * 16 + (s - m0)) =
              make_float2(a0, a1);
        else
          *reinterpret_cast<uint32_t*>(((rb & 1) && jp == rb - 1 ? A1 : A2) + swz128(r, s)) =
              pack_half2(a0, a1);
      }
    }
  }
  // D's blocks below the diagonal zero: blocks (1,0), (2,0), (2,1), (3,0), (3,1), (3,2)
  for (int i = wt; i < 192; i += 128) {
    const int blk = i >> 5, rr = (i >> 1) & 15, hf = i & 1;
    const int rbk = blk < 1 ? 1 : blk < 3 ? 2 : 3, jb = blk < 1 ? 0 : blk < 3 ? blk - 1 : blk - 3;
    *reinterpret_cast<uint4*>(Tt + swz128(16 * rbk + rr, 16 * jb + 8 * hf)) = make_uint4(0u, 0u, 0u, 0u);
  }
  sync();  // A's diagonal blocks complete
  if (wt < 64) {  // the diagonal blocks' inverses, a thread a column (lean_inverse's arithmetic)
    const int b = wt >> 4, jj = wt & 15;
    float tc[16];
    lean_substitute(tc, Adg + b * 256, 16, jj);
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      Tdg[b * 256 + r * 16 + jj] = tc[r];
      *reinterpret_cast<__half*>(Tt + swz128(16 * b + r, 16 * b + jj)) = __float2half_rn(tc[r]);
    }
  }
  fence_proxy_async();  // D, A1 and A2 (generic writes) for the products
  sync();
  // one doubling step: z = D A_off D
  auto step = [&](const unsigned char* Aoff, float (&z)[8][4]) {
    float x[8][4];
    wgmma_fence();
    fence_acc(x);
#pragma unroll
    for (int kt = 0; kt < 4; ++kt)
      wgmma_ss_n64<__half, true>(x, sw128_desc(Tt + kt * 32, 16, 1024),
                                 sw128_desc(Aoff + kt * 2048, 8192, 1024), kt > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(x);
    uint32_t xa[4][4];
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) acc_to_a16(xa[kt], x[2 * kt], x[2 * kt + 1]);
    wgmma_fence();
    fence_acc(z);
#pragma unroll
    for (int kt = 0; kt < 4; ++kt)
      wgmma_rs_f16<64, true>(z, xa[kt], sw128_desc(Tt + kt * 2048, 8192, 1024), kt > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(z);
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) fence_frag(xa[kt]);
  };
  {  // blocks of 16 -> 32: T's blocks (1,0) and (3,2) = -z (warps 1 and 3, column block warp - 1)
    float z[8][4];
    step(A1, z);
    sync();  // every warp's products have read D
    if (warp & 1) {
      const int jb = warp - 1;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int j = 2 * jb + hf, r = 16 * warp + g + 8 * i, c = 8 * j + 2 * t;
          const float v0 = -z[j][2 * i], v1 = -z[j][2 * i + 1];
          *reinterpret_cast<uint32_t*>(Tt + swz128(r, c)) = pack_half2(v0, v1);
          *reinterpret_cast<float2*>(Z1 + (warp >> 1) * 256 + (r - 16 * warp) * 16 + c - 16 * jb) =
              make_float2(v0, v1);
        }
    }
    fence_proxy_async();
    sync();
  }
  {  // blocks of 32 -> 64: T's lower left 32 x 32 = -z (warps 2 and 3, column tiles 0-3)
    float z[8][4];
    step(A2, z);
    sync();  // every warp's products have read D: T diag(beta) goes over it
    if (warp >= 2) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = 16 * warp + g + 8 * i, c = 8 * j + 2 * t;
          *reinterpret_cast<uint32_t*>(Tt + swz128(r, c)) =
              pack_half2(-z[j][2 * i] * bs[c], -z[j][2 * i + 1] * bs[c + 1]);
        }
    }
  }
  // the other lower blocks of T diag(beta): the diagonal ones and (1,0), (3,2), from fp32
  for (int e = wt; e < 768; e += 128) {  // column pairs: 4 + 2 blocks of 128
    const int blk = e >> 7, q = e & 127, rr = q >> 3, cc = 2 * (q & 7);
    const int rbk = blk < 4 ? blk : 2 * (blk - 4) + 1, jb = blk < 4 ? blk : 2 * (blk - 4);
    const float* src = (blk < 4 ? Tdg + blk * 256 : Z1 + (blk - 4) * 256) + rr * 16 + cc;
    const int r = 16 * rbk + rr, c = 16 * jb + cc;
    *reinterpret_cast<uint32_t*>(Tt + swz128(r, c)) = pack_half2(src[0] * bs[c], src[1] * bs[c + 1]);
  }
}

// The WY warpgroup's part of one segment block (kWy, threads 384-511), chunk ci in stage
// n % kStages as the state warpgroups count them. Once landed[s]: P = Dec . Q K^T into the
// stage's P tile (output chunks; Q K^T as one wgmma group, lean_p_epilogue's values; every row:
// rows past the chunk's end hold the next rows' finite values, their o is not stored), with G
// from wy_lean_kernel (!kT, kWy 1: loaded a chunk ahead) or (kT, kWy 2) the chunk's G and beta
// from g and beta (lean_gates' loads a chunk ahead of its scan) and T diag(beta) by wy_inverse
// into the stage's T tile. Then bf16 K and Q to fp16 in place, a proxy fence and its 128
// arrivals on full[s]. Its own barrier: named barrier 6.
// kKByProducer (kWy 3, bf16 inputs): the producer's warps 1-3 convert K instead; the WY
// warpgroup meets them on named barrier 7 (224 threads) once its reads of K are done (after
// Q K^T, or after landed[s] where the chunk has no P), then converts Q only. A sync on both
// sides, not an arrival: an arrival could run a chunk ahead and complete the barrier's next
// phase with the WY warpgroup's own arrivals.
template <typename In, int kStages, bool kT, bool kKByProducer = false>
__device__ __forceinline__ void tma_wy(const FwdParams& p, const SegmentBlock& b, uint32_t n0,
                                       unsigned char* base, uint64_t* full, uint64_t* landed) {
  using Sm = StateFwdTmaSmem;
  const int wt = static_cast<int>(threadIdx.x) - 384, warp = wt >> 5;
  const bool want_o = p.phase == 0 && p.o != nullptr && !(p.debug & 1);
  float* Gs = reinterpret_cast<float*>(base + Sm::wy(kStages));
  float* bs = Gs + C;
  unsigned char* wyt = base + Sm::wy_tiles(kStages);  // kT: wy_inverse's tiles
  if (kT) {  // the A tiles' blocks that no chunk writes: zero for good
    for (int i = wt; i < 2 * 512; i += 128)
      *reinterpret_cast<uint4*>(wyt + 16 * i) = make_uint4(0u, 0u, 0u, 0u);
  }
  auto sync = [] { named_bar_sync(6, 128); };
  // !kT: G of an output chunk's row wt (rows past L: G_{L-1})
  auto load_g = [&](int64_t ci) {
    const int L = chunk_rows(b.len, ci);
    return wt < C && want_o && ci >= b.c_begin && ci < b.c_end
               ? p.G[(b.start + ci * C + (wt < L ? wt : L - 1)) * p.Hv + b.h]
               : 0.f;
  };
  float g_next = kT ? 0.f : load_g(b.ss.c_first);
  // kT: lean_gates' loads (warp 0) a chunk ahead of its scan
  auto load_gb = [&](int64_t ci) {
    return warp == 0 && ci < b.c_end
               ? lean_gates_load(p, b.start + ci * C, chunk_rows(b.len, ci), b.h, lane_id())
               : LeanGb{};
  };
  LeanGb gb_next;
  if constexpr (kT) gb_next = load_gb(b.ss.c_first);
  for (int64_t ci = b.ss.c_first; ci < b.c_end; ++ci) {
    const uint32_t n = n0 + static_cast<uint32_t>(ci - b.ss.c_first);
    const int s = static_cast<int>(n % kStages);
    const int L = chunk_rows(b.len, ci);
    const bool out = want_o && ci >= b.c_begin;
    if constexpr (kT) {  // lean_gates' scan
      const LeanGb gb = gb_next;
      gb_next = load_gb(ci + 1);
      // the previous chunk's last readers of bs (wy_inverse's final stores of T diag(beta),
      // after its last barrier) are done before warp 0 overwrites it: without this barrier a
      // lagging warp scaled some columns by the next chunk's beta (graph replays differing
      // from the eager call on packed short sequences; found in session 53)
      if (ci != b.ss.c_first) sync();
      if (warp == 0) lean_gates_scan(gb, Gs, bs, lane_id());
      sync();
    } else {
      const float g = g_next;
      g_next = load_g(ci + 1);
      if (out) {
        if (wt < C) Gs[wt] = g;  // the previous chunk's readers passed a sync
        sync();
      }
    }
    unsigned char* st = base + s * Sm::kStage;
    mbar_wait(&landed[s], (n / kStages) & 1);
    if (out && !(p.debug & 512)) {  // (FLASHGDN_DEBUG & 512, timing only: no products)
      float qk[8][4];
      if (p.debug & 1024)  // (FLASHGDN_DEBUG & 1024: on mma.sync, lean_lower_product's way)
        lean_lower_product_sw<In>(qk, st + Sm::kOffQ, st + Sm::kOffK, warp);
      else
        qk_wgmma<In>(qk, st + Sm::kOffQ, st + Sm::kOffK);
      if constexpr (kKByProducer) named_bar_sync(7, 224);  // K read: the producer converts it
      unsigned char* P = st + Sm::kOffP;
      lean_p_epilogue(qk, Gs, warp, C, [&](int r, int c, float p0, float p1) {
        *reinterpret_cast<uint32_t*>(P + swz128(r, c)) = pack_half2(p0, p1);
      });
    } else if constexpr (kKByProducer) {
      named_bar_sync(7, 224);  // no product read K
    }
    if (kT && !(p.debug & 512)) {
      wy_inverse<In>(st, Gs, bs, wyt, warp, wt, sync);
    } else if (out || kT) {
      sync();  // every read of K and Q (and of Gs) done
    }
    if constexpr (!std::is_same<In, __half>::value) {  // K (and Q) to fp16 in place
      if constexpr (!kKByProducer) tile_sw_to_half<In, 128>(st + Sm::kOffK, wt);
      if (out) tile_sw_to_half<In, 128>(st + Sm::kOffQ, wt);
    }
    fence_proxy_async();  // the tiles' generic writes, for the state warpgroups' wgmma
    mbar_arrive(&full[s]);
  }
}

}  // namespace cuda
}  // namespace flashgdn
