// Backward kernels (docs/algorithm.md, "Backward"), fp32 SIMT. The forward quantities are
// recomputed first by wy_kernel (G, W, U0, T, P) and the forward's state pass
// (state_fwd_kernel with p.h set, context-parallel like the forward: h, the state entering
// every chunk, and U); then:
//
// state_bwd_kernel<BW>  grid (N, H_v, 128 / BW), 256 threads, <= 150 KB smem
//   Reverse sequential pass for BW value columns of one head, dS (128 x BW)
//   in shared memory, starting from dht (P and T come from wy_kernel):
//     dU  = scale P^T dO + diag(exp(G_last - G)) K dS,   dVt = T^T dU,
//     dS <- exp(G_last) dS + (scale diag(exp G) Q)^T dO - (diag(beta exp G) K)^T dVt.
//   reads  q, k, do, beta, G, T, P, dht    writes dh (dS leaving each chunk), dVt, dh0
//
// grad_chunk_kernel     grid (max_chunks, H_qk), 256 threads, ~213 KB smem (fp32 SIMT;
//   grad_chunk_tc_kernel at the end of this file is the default, on tensor cores)
//   All input gradients of one chunk for the value heads of one q/k head (so
//   dq and dk of grouped heads are summed in registers, deterministically):
//   dv = beta dVt, dbeta, dg (reverse cumsum of dG), dq, dk.
//   reads  q, k, v, do, beta, G, U, dVt, h, dh    writes dq, dk, dv, dg, dbeta
#pragma once

#include <type_traits>

#include "common.cuh"
#include "fwd_kernels.cuh"

namespace flashgdn {
namespace cuda {

// SegParams: the segments of the reverse pass, the forward's plan walked last to first.
struct BwdParams : SegParams {
  float scale;
  const void *q, *k, *v, *beta, *d_o;
  const __half *Kh, *Qh;  // fp16 k and q (the inputs, or wy_kernel's copies): the reverse pass
  int g_dtype, beta_dtype;
  const float* dht;   // [N, Hv, D, D] or null
  const float* G;     // [TT, Hv]
  const float* Tmat;  // [TT, Hv, C]
  const float* Pmat;  // [TT, Hv, C] (Q K^T) . Dec
  // rec16: T and P in fp16 instead (the same tf32-rounded values), for state_bwd_cols_kernel
  const __half *T16, *P16;
  // The records of the sequential passes: fp32, or (rec16: both passes in the 128-column
  // kernels, launch.cu bwd_cols) fp16 record blocks with a factor each (mma.cuh).
  const float* U;     // [TT, Hv, D]
  const float* h;     // [max_chunks, Hv, D, D]
  float* dh;          // [max_chunks, Hv, D, D]
  float* dVt;         // [TT, Hv, D]
  const float* h_scale;  // [max_chunks, Hv, 8] each: the record blocks' factors (rec16)
  float* dh_scale;
  const float* U_scale;
  float* dVt_scale;
  bool rec16;
  float* dh0;         // [N, Hv, D, D] or null
  void *dq, *dk, *dv, *dg, *dbeta;
  int debug;  // FwdParams::debug (timing experiments only)
  // The ready queue (null: off; launch.cu bwd_queue): the reverse pass's phase 0
  // (state_bwd_cols_kernel) counts the warps whose records of a (chunk, q/k head) item are
  // complete in rq_count[item] (item = chunk * H_qk + q/k head) and, at the last of its
  // 8 x H_v / H_qk, appends item + 1 to rq_slot at rq_ends[1]; grad_chunk_tc_kernel, its
  // programmatic dependent, takes slot rq_ends[0]++ per block and works on that item, so
  // its blocks run on the SMs the reverse pass leaves idle as soon as their records exist,
  // in the order they came. All zero before the reverse pass (one memset a call).
  int* rq_count;  // [max_chunks * H_qk]
  int* rq_slot;   // [max_chunks * H_qk]
  int* rq_ends;   // [2]: the next slot to take, the next to fill
  int rq_signal;  // phase 0's signals: 0 none (no queue), 1 one a warp, 2 one a block
};

// The ready queue's two ends (BwdParams::rq_*). ready_signal: called by lane 0 of each
// warp of a reverse-pass block once its bulk stores of chunk `chunk`'s records have completed
// (bulk_wait): the writes are made visible at gpu scope before the count (the last warp of
// the item publishes it with release semantics). ready_take: thread 0 of a gradient block
// takes the next slot and waits for its item (acquire); a slot unfilled for ~8 s is a bug
// (an item no reverse-pass block completes): the kernel traps rather than hangs.
__device__ __forceinline__ void fence_proxy_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}
// A signalling lane's wait for its bulk stores of the chunk two back: all but the newest two
// groups (the last chunk's dh and dVt) complete; all of them under the debug switches that
// leave records out (4, 8); none with 8192 (timing experiments only, as 16384 / 32768 below:
// without the proxy fence / without the gpu fence or release).
__device__ __forceinline__ void ready_stores_wait(const BwdParams& p) {
  if (p.debug & 8192) return;
  if (p.debug & 12) bulk_wait();
  else bulk_wait_done<2>();
}
// The item's last count: appends it to the queue (after an acquire fence over the counts).
__device__ __forceinline__ void ready_publish(const BwdParams& p, int64_t item) {
  __threadfence();
  const int slot = atomicAdd(p.rq_ends + 1, 1);
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(p.rq_slot + slot),
               "r"(static_cast<int>(item) + 1)
               : "memory");
}
__device__ __forceinline__ void ready_signal(const BwdParams& p, int64_t chunk, int64_t hq) {
  if (!(p.debug & 16384)) fence_proxy_async_global();
  if (!(p.debug & 32768)) __threadfence();
  const int64_t item = chunk * p.Hqk + hq;
  const int need = static_cast<int>(8 * (p.Hv / p.Hqk));
  if (atomicAdd(p.rq_count + item, 1) == need - 1) ready_publish(p, item);
}
// ready_signal_block: thread 0 of a reverse-pass block, after a block barrier that every
// warp's lane 0 reached with its bulk stores of the chunk complete and fenced
// (fence_proxy_async_global): counts the block's eight warps with one release atomic (the
// barrier-then-release pattern of a grid barrier's arrival).
__device__ __forceinline__ void ready_signal_block(const BwdParams& p, int64_t chunk, int64_t hq) {
  const int64_t item = chunk * p.Hqk + hq;
  const int need = static_cast<int>(8 * (p.Hv / p.Hqk));
  int old;
  if (p.debug & 32768)
    old = atomicAdd(p.rq_count + item, 8);
  else
    asm volatile("atom.add.release.gpu.global.s32 %0, [%1], 8;\n"
                 : "=r"(old)
                 : "l"(p.rq_count + item)
                 : "memory");
  if (old == need - 8) ready_publish(p, item);
}
__device__ __forceinline__ int ready_take(const BwdParams& p) {
  const int slot = atomicAdd(p.rq_ends, 1);
  int v;
  unsigned ns = 64;
  for (uint32_t spins = 0;; ++spins) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p.rq_slot + slot) : "memory");
    if (v != 0) break;
    if (spins > (1u << 24)) __trap();
    __nanosleep(ns);
    ns = ns < 512 ? 2 * ns : ns;
  }
  return v - 1;
}

template <int BW>
constexpr size_t state_bwd_smem() {
  return sizeof(float) * (2 * C * LDD + 2 * C * LDC + (3 * C + D) * (BW + 1) + 4 * C);
}

template <typename In, int BW>
__global__ void __launch_bounds__(NT, 1) state_bwd_kernel(BwdParams p) {
  if (p.seqs.failed()) return;
  using CB = ColBlock<BW>;
  constexpr int LD = CB::LD, CN = CB::CN;
  const int64_t n = blockIdx.x, h = blockIdx.y, hq = h / (p.Hv / p.Hqk);
  const int vb = blockIdx.z * BW;
  extern __shared__ float smem[];
  float* Qs = smem;              // [C][LDD]
  float* Ks = Qs + C * LDD;      // [C][LDD]
  float* Ts = Ks + C * LDD;      // [C][LDC]
  float* Ps = Ts + C * LDC;      // [C][LDC]
  float* dOs = Ps + C * LDC;     // [C][LD]
  float* dUs = dOs + C * LD;     // [C][LD]
  float* dVs = dUs + C * LD;     // [C][LD]
  float* dSs = dVs + C * LD;     // [D][LD]
  float* Gs = dSs + D * LD;      // [C]
  float* eL = Gs + C;            // [C]
  float* gam = eL + C;           // [C]
  float* bs = gam + C;           // [C]

  const int64_t state_off = (n * p.Hv + h) * D * D;
  load_state_block<BW>(dSs, p.dht ? p.dht + state_off : nullptr, vb);
  const int64_t start = p.seqs.seq_start(n), len = p.seqs.seq_len(n);
  const int64_t chunk0 = p.seqs.first_chunk(n);
  const int64_t nchunks = (len + C - 1) / C;
  for (int64_t ci = nchunks - 1; ci >= 0; --ci) {
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    __syncthreads();
    store_state_block<BW>(p.dh + ((chunk0 + ci) * p.Hv + h) * D * D, dSs, vb);
    load_chunk(Qs, static_cast<const In*>(p.q) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    load_chunk(Ks, static_cast<const In*>(p.k) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    load_rows(Ts, LDC, p.Tmat + (tok0 * p.Hv + h) * C, p.Hv * C, L, C, C);
    load_rows(Ps, LDC, p.Pmat + (tok0 * p.Hv + h) * C, p.Hv * C, L, C, C);
    load_rows(dOs, LD, static_cast<const In*>(p.d_o) + (tok0 * p.Hv + h) * D + vb, p.Hv * D, L,
              C, BW);
    if (threadIdx.x < C) {
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      Gs[threadIdx.x] = p.G[(tok0 + r) * p.Hv + h];
      bs[threadIdx.x] =
          threadIdx.x < L ? load_scalar(p.beta, p.beta_dtype, (tok0 + threadIdx.x) * p.Hv + h)
                          : 0.f;
    }
    __syncthreads();
    if (threadIdx.x < C) {
      eL[threadIdx.x] = __expf(Gs[C - 1] - Gs[threadIdx.x]);
      gam[threadIdx.x] = __expf(Gs[threadIdx.x]);
    }
    __syncthreads();
    {  // dU = scale P^T dO + eL K dS
      Tile<C, BW, 2, CN> a, b;
      a.zero();
      a.template mma<true, false, C>(Ps, LDC, dOs, LD);
      b.zero();
      b.template mma<false, false, D>(Ks, LDD, dSs, LD);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < CN; ++j) {
          const int r = a.row(i), c = a.col(j);
          dUs[r * LD + c] = p.scale * a.a[i][j] + eL[r] * b.a[i][j];
        }
    }
    __syncthreads();
    {  // dVt = T^T dU
      Tile<C, BW, 2, CN> t;
      t.zero();
      t.template mma<true, false, C>(Ts, LDC, dUs, LD);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < CN; ++j) {
          const int r = t.row(i), c = t.col(j);
          if (r < L) p.dVt[((tok0 + r) * p.Hv + h) * D + vb + c] = t.a[i][j];
          // scaled for the state update below
          dVs[r * LD + c] = -bs[r] * gam[r] * t.a[i][j];
          dOs[r * LD + c] *= p.scale * gam[r];
        }
    }
    __syncthreads();
    {  // dS <- exp(G_last) dS + Q^T (scale gam dO) - K^T (beta gam dVt)
      Tile<D, BW, 4, CN> st;
      st.zero();
      st.template mma<true, false, C>(Qs, LDD, dOs, LD);
      st.template mma<true, false, C>(Ks, LDD, dVs, LD);
      const float gl = __expf(Gs[C - 1]);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < CN; ++j) {
          float& s = dSs[st.row(i) * LD + st.col(j)];
          s = gl * s + st.a[i][j];
        }
    }
  }
  __syncthreads();
  if (p.dh0) store_state_block<BW>(p.dh0 + state_off, dSs, vb);
}

// ---------------------------------------------------------------------------------------
// state_bwd_tc_kernel<BW>  grid (128 / BW [x 2 in phase 1], H_v, segments or slots), 256 threads,
//   ~210 KB smem (BW 32)
//   The reverse sequential pass of state_bwd_kernel on TF32 tensor cores (mma.cuh), laid
//   out as state_fwd_kernel: dS (128 x BW) in the accumulator registers of the 8 warps, a
//   tf32 copy of dS^T in shared memory, the previous chunk's Q, K, P, T, dO, G copied by
//   cp.async while the current one computes. Per chunk (last first):
//     dU = scale P^T dO + diag(eL) K dS,  dVt = T^T dU,
//     dS <- exp(G_last) dS + Q^T diag(scale gam) dO - K^T diag(beta gam) dVt.
//   Context parallelism as the forward's state pass, mirrored: dS <- M_c^T dS + (dO terms)
//   is affine with the transpose of the forward's chunk transition, so the same warm-up
//   bound holds. A segment's dS enters at its last chunk from dht (the last segment), from
//   a warm-up over the chunks after it, or exactly from seg_in; phase 1 forms the summaries
//   (L: the dS leaving the segment's first chunk from its own start; M: the pass on the
//   identity with dO = 0) that seg_combine_kernel chains last to first.
//   reads  q, k, do, beta, G, T, P, Lb, dht, seg_in
//   writes dh (dS leaving each chunk), dVt, dh0 (phase 0); seg_L, seg_M (phase 1)

template <typename In, int BW>
struct StateBwdSmem {
  static constexpr int LDO = BW + 8;  // dO tile [C][LDO] (ldmatrix rows 16 bytes apart mod 128)
  static constexpr size_t kStage =
      sizeof(In) * (2 * C * LDH + C * LDO) + sizeof(float) * (2 * C * LDA + C);
  static constexpr size_t kBytes = 2 * kStage + sizeof(float) * (BW * LDW + 4 * BW * LDA + C);
};

// A fragment of A(m, k) = X[k][m] from an fp32 tile X [k][m] (leading dimension ld).
__device__ __forceinline__ void frag_a_trans_f32(uint32_t (&a)[4], const float* x, int ld,
                                                 int m0, int k0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  const float* p0 = x + (k0 + 2 * t) * ld + m0 + g;
  a[0] = __float_as_uint(round_tf32(p0[0]));
  a[1] = __float_as_uint(round_tf32(p0[8]));
  a[2] = __float_as_uint(round_tf32(p0[ld]));
  a[3] = __float_as_uint(round_tf32(p0[ld + 8]));
}

// One segment block of state_bwd_tc_kernel (for_each_segment_block).
template <typename In, int BW>
__device__ __forceinline__ void state_bwd_tc_segment(const BwdParams& p, const SegmentBlock& b) {
  static_assert(BW == 16 || BW == 32, "column block of 16 or 32");
  using SM = StateBwdSmem<In, BW>;
  constexpr int NJ = BW / 16, NS = BW / 8, LDO = SM::LDO;
  // ---- which segment, where dS comes from (phase 0), or which summary this block forms
  // (phase 1, for a segment whose predecessor starts exactly from it: the dS leaving the
  // segment from its own start, or the columns of its transition, from I)
  const int64_t h = b.h, hq = b.hq, z = b.z, n = b.n, start = b.start, len = b.len;
  const int64_t chunk0 = b.chunk0, c_begin = b.c_begin, c_end = b.c_end, j = b.j;
  const SegStart ss = b.ss;
  const int vb = b.vb;
  const bool identity = b.identity;
  const int64_t c_last = ss.c_first;  // the pass runs chunks c_last down to c_begin
  const bool outputs = p.phase == 0;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto Qst = [&](int s) { return reinterpret_cast<In*>(smem_raw + s * SM::kStage); };
  auto Kst = [&](int s) { return Qst(s) + C * LDH; };
  auto dOst = [&](int s) { return Kst(s) + C * LDH; };
  auto Pst = [&](int s) { return reinterpret_cast<float*>(dOst(s) + C * LDO); };
  auto Tst = [&](int s) { return Pst(s) + C * LDA; };
  auto Gst = [&](int s) { return Tst(s) + C * LDA; };
  float* dSs = reinterpret_cast<float*>(smem_raw + 2 * SM::kStage);  // [BW][LDW] dS^T
  float* dOt = dSs + BW * LDW;  // [BW][LDA] dO^T
  float* Xt = dOt + BW * LDA;   // [BW][LDA] (scale gam dO)^T
  float* dUt = Xt + BW * LDA;   // [BW][LDA] dU^T
  float* Yt = dUt + BW * LDA;   // [BW][LDA] (-beta gam dVt)^T
  float* Bs = Yt + BW * LDA;    // [C] beta

  const int warp = threadIdx.x >> 5;
  const int m0 = 16 * (warp >> 1), n0 = (warp & 1) * (BW / 2);
  const In* qbase = static_cast<const In*>(p.q);
  const In* kbase = static_cast<const In*>(p.k);
  const In* dobase = static_cast<const In*>(p.d_o);
  float beta_pre = 0.f;  // beta of the chunk issued last (thread < C)

  auto issue = [&](int64_t ci, int s) {
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    cp_async_tile<C, D, LDH>(Qst(s), qbase + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    cp_async_tile<C, D, LDH>(Kst(s), kbase + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
    cp_async_tile<C, BW, LDO>(dOst(s), dobase + (tok0 * p.Hv + h) * D + vb, p.Hv * D, L);
    cp_async_tile<C, C, LDA>(Pst(s), p.Pmat + (tok0 * p.Hv + h) * C, p.Hv * C, L);
    cp_async_tile<C, C, LDA>(Tst(s), p.Tmat + (tok0 * p.Hv + h) * C, p.Hv * C, L);
    if (threadIdx.x < C) {
      const int r = threadIdx.x < L ? threadIdx.x : L - 1;
      cp_async4(Gst(s) + threadIdx.x, p.G + (tok0 + r) * p.Hv + h);
      beta_pre = threadIdx.x < L ? load_scalar(p.beta, p.beta_dtype, (tok0 + threadIdx.x) * p.Hv + h)
                                 : 0.f;
    }
    cp_async_commit();
  };

  // dS registers (load_acc_state's layout)
  float sacc[NS][4];
  const int64_t state_off = (n * p.Hv + h) * D * D;
  {
    const float* src = nullptr;
    if (ss.src == SegSource::H0 && p.dht) src = p.dht + state_off;
    if (p.phase == 0 && ss.src == SegSource::Exact) src = p.seg_in + (z * p.Hv + h) * D * D;
    load_acc_state(sacc, src, vb, identity);
  }
  store_acc_state_smem_t(dSs, LDW, sacc);
  if (c_last >= c_begin) issue(c_last, 0);

  for (int64_t ci = c_last; ci >= c_begin; --ci) {
    const int s = static_cast<int>((c_last - ci) & 1);
    const int64_t tok0 = start + ci * C;
    const int L = chunk_rows(len, ci);
    const bool out = outputs && ci < c_end;  // not a warm-up chunk
    cp_async_wait<0>();
    __syncthreads();  // stage s landed; every shared buffer of the previous chunk consumed
    if (threadIdx.x < C) Bs[threadIdx.x] = beta_pre;
    if (ci > c_begin) issue(ci - 1, s ^ 1);
    if (out)  // dh: dS leaving chunk ci
      store_acc_state(p.dh + ((chunk0 + ci) * p.Hv + h) * D * D, sacc, vb);
    const float* G = Gst(s);
    const float gl = G[C - 1];
    {  // dO^T and (scale gam dO)^T as fp32 B tiles
      const In* dO = dOst(s);
      for (int e = threadIdx.x; e < C * BW; e += NT) {
        const int r = e / BW, c = e % BW;
        const float x = identity ? 0.f : to_f(dO[r * LDO + c]);  // the transition: dO = 0
        dOt[c * LDA + r] = x;  // 16-bit values are exact tf32
        Xt[c * LDA + r] = round_tf32(p.scale * __expf(G[r]) * x);
      }
    }
    __syncthreads();

    // dU = scale P^T dO + diag(eL) K dS (P^T is upper triangular: k >= m0 only)
    float du[NJ][4] = {}, kd[NJ][4] = {};
    {
      const In* K = Kst(s);
      float kd2[NJ][4] = {};  // odd k steps: shorter dependent chains
#pragma unroll 2
      for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t a[4], a2[4];
        frag_a(a, K, LDH, m0, k0);
        frag_a(a2, K, LDH, m0, k0 + 8);
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          uint32_t b[2], b2[2];
          frag_b(b, dSs, LDW, n0 + 8 * jj, k0);
          frag_b(b2, dSs, LDW, n0 + 8 * jj, k0 + 8);
          mma_tf32(kd[jj], a, b);
          mma_tf32(kd2[jj], a2, b2);
        }
      }
      add_acc(kd, kd2);
      const float* P = Pst(s);
      for (int k0 = m0; k0 < C; k0 += 8) {
        uint32_t a[4];
        frag_a_trans_f32(a, P, LDA, m0, k0);
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          uint32_t b[2];
          frag_b(b, dOt, LDA, n0 + 8 * jj, k0);
          mma_tf32(du[jj], a, b);
        }
      }
    }
#pragma unroll
    for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + acc_row(e), c = n0 + 8 * jj + acc_col(e);
        dUt[c * LDA + r] = round_tf32(p.scale * du[jj][e] + __expf(gl - G[r]) * kd[jj][e]);
      }
    __syncthreads();

    // dVt = T^T dU (T^T upper triangular)
    {
      float dv[NJ][4] = {};
      const float* T = Tst(s);
      for (int k0 = m0; k0 < C; k0 += 8) {
        uint32_t a[4];
        frag_a_trans_f32(a, T, LDA, m0, k0);
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          uint32_t b[2];
          frag_b(b, dUt, LDA, n0 + 8 * jj, k0);
          mma_tf32(dv[jj], a, b);
        }
      }
#pragma unroll
      for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = m0 + acc_row(e), c = n0 + 8 * jj + acc_col(e);
          if (out && r < L)
            __stcg(reinterpret_cast<float2*>(p.dVt + ((tok0 + r) * p.Hv + h) * D + vb + c),
                   make_float2(dv[jj][e], dv[jj][e + 1]));
          const float bg = -Bs[r] * __expf(G[r]);
          Yt[c * LDA + r] = round_tf32(bg * dv[jj][e]);
          Yt[(c + 1) * LDA + r] = round_tf32(bg * dv[jj][e + 1]);
        }
    }
    __syncthreads();

    // dS <- exp(G_last) dS + Q^T X + K^T Y
    {
      const float eg = __expf(gl);
#pragma unroll
      for (int jn = 0; jn < NS; ++jn)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[jn][e] *= eg;
      const In* Q = Qst(s);
      const In* K = Kst(s);
      float sb[NS][4] = {};  // K^T Y in its own accumulators: two dependent chains, not one
#pragma unroll 2
      for (int k0 = 0; k0 < C; k0 += 8) {
        uint32_t aq[4], ak[4];
        frag_a_trans(aq, Q, LDH, 16 * warp, k0);
        frag_a_trans(ak, K, LDH, 16 * warp, k0);
#pragma unroll
        for (int jn = 0; jn < NS; ++jn) {
          uint32_t bx[2], by[2];
          frag_b(bx, Xt, LDA, 8 * jn, k0);
          frag_b(by, Yt, LDA, 8 * jn, k0);
          mma_tf32(sacc[jn], aq, bx);
          mma_tf32(sb[jn], ak, by);
        }
      }
      add_acc(sacc, sb);
      store_acc_state_smem_t(dSs, LDW, sacc);
    }
  }
  // ---- the dS leaving the segment: dh0 (the first segment), or this block's summary
  float* dst = nullptr;
  if (p.phase == 1) dst = (identity ? p.seg_M : p.seg_L) + (z * p.Hv + h) * D * D;
  else if (j == 0 && p.dh0) dst = p.dh0 + state_off;
  if (dst) store_acc_state(dst, sacc, vb);
}

template <typename In, int BW>
__global__ void __launch_bounds__(NT, 1) state_bwd_tc_kernel(BwdParams p) {
  if (p.seqs.failed() || !col_block_chosen<BW>(p)) return;
  for_each_segment_block<BW>(p, true, [&](const SegmentBlock& b) {
    state_bwd_tc_segment<In, BW>(p, b);
  });
}

constexpr size_t kGradSmem =
    sizeof(float) * (5 * C * LDD + D * LDV + 2 * C * LDC + 8 * C + NT);

// The fp32 SIMT reference (FLASHGDN_GRAD_TC=0) of grad_chunk_tc_kernel below.
template <typename In>
__global__ void __launch_bounds__(NT, 1) grad_chunk_kernel(BwdParams p) {
  using T128 = Tile<C, D, 4, 8>;  // C x D results
  using T64 = Tile<C, C, 4, 4>;   // C x C results
  if (p.seqs.failed()) return;
  const ChunkRef ck = locate_chunk(p.seqs, blockIdx.x);
  if (ck.L == 0) return;
  const int64_t chunk = blockIdx.x, hq = blockIdx.y, group = p.Hv / p.Hqk;
  const int L = ck.L;
  const int64_t tok0 = ck.tok0;
  extern __shared__ float smem[];
  float* Qs = smem;             // [C][LDD]
  float* Ks = Qs + C * LDD;     // [C][LDD]
  float* dOs = Ks + C * LDD;    // [C][LDD]
  float* Us = dOs + C * LDD;    // [C][LDD]
  float* dVs = Us + C * LDD;    // [C][LDD]
  float* Xs = dVs + C * LDD;    // [D][LDV] quarter of h or dh; later E [C][LDC]
  float* M1 = Xs + D * LDV;     // [C][LDC]
  float* M2 = M1 + C * LDC;     // [C][LDC]
  float* Gs = M2 + C * LDC;     // [C]
  float* gam = Gs + C;
  float* eL = gam + C;
  float* bs = eL + C;
  float* dG = bs + C;
  float* db = dG + C;
  float* lastrow = db + C;
  float* red = lastrow + 2 * C;  // [NT]
  static_assert(C * LDC <= D * LDV, "E must fit in the X buffer");

  load_chunk(Qs, static_cast<const In*>(p.q) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);
  load_chunk(Ks, static_cast<const In*>(p.k) + (tok0 * p.Hqk + hq) * D, p.Hqk * D, L);

  T128 dQ, dK;
  dQ.zero();
  dK.zero();
  for (int64_t h = hq * group; h < (hq + 1) * group; ++h) {
    __syncthreads();
    load_chunk(dOs, static_cast<const In*>(p.d_o) + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    load_chunk(Us, p.U + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    load_chunk(dVs, p.dVt + (tok0 * p.Hv + h) * D, p.Hv * D, L);
    if (threadIdx.x < C) {
      const int r = threadIdx.x;
      Gs[r] = p.G[(tok0 + (r < L ? r : L - 1)) * p.Hv + h];
      bs[r] = r < L ? load_scalar(p.beta, p.beta_dtype, (tok0 + r) * p.Hv + h) : 0.f;
      dG[r] = 0.f;
      db[r] = 0.f;
    }
    __syncthreads();
    if (threadIdx.x < C) {
      gam[threadIdx.x] = __expf(Gs[threadIdx.x]);
      eL[threadIdx.x] = __expf(Gs[C - 1] - Gs[threadIdx.x]);
    }
    const float* S0 = p.h + (chunk * p.Hv + h) * D * D;
    const float* dSL = p.dh + (chunk * p.Hv + h) * D * D;

    {  // Y = dO S0^T, Z = dVt S0^T (over four 32-column quarters of S0)
      T128 Y, Z;
      Y.zero();
      Z.zero();
      for (int q4 = 0; q4 < D / BV; ++q4) {
        __syncthreads();
        for (int e = threadIdx.x; e < D * BV; e += NT) {
          const int r = e / BV, c = e % BV;
          Xs[r * LDV + c] = S0[r * D + q4 * BV + c];
        }
        __syncthreads();
        Y.template mma<false, true, BV>(dOs + q4 * BV, LDD, Xs, LDV);
        Z.template mma<false, true, BV>(dVs + q4 * BV, LDD, Xs, LDV);
      }
#pragma unroll
      for (int i = 0; i < T128::kRows; ++i) {
        const int r = Y.row(i);
        float qy = 0.f, kz = 0.f;
#pragma unroll
        for (int j = 0; j < T128::kCols; ++j) {
          const int c = Y.col(j);
          dQ.a[i][j] += p.scale * gam[r] * Y.a[i][j];
          dK.a[i][j] -= bs[r] * gam[r] * Z.a[i][j];
          qy += Qs[r * LDD + c] * Y.a[i][j];
          kz += Ks[r * LDD + c] * Z.a[i][j];
        }
        qy = T128::row_sum(qy);
        kz = T128::row_sum(kz);
        if (Y.row_leader()) {
          dG[r] += p.scale * gam[r] * qy - bs[r] * gam[r] * kz;
          db[r] -= gam[r] * kz;
        }
      }
    }
    {  // R = U dSL^T
      T128 R;
      R.zero();
      for (int q4 = 0; q4 < D / BV; ++q4) {
        __syncthreads();
        for (int e = threadIdx.x; e < D * BV; e += NT) {
          const int r = e / BV, c = e % BV;
          Xs[r * LDV + c] = dSL[r * D + q4 * BV + c];
        }
        __syncthreads();
        R.template mma<false, true, BV>(Us + q4 * BV, LDD, Xs, LDV);
      }
#pragma unroll
      for (int i = 0; i < T128::kRows; ++i) {
        const int r = R.row(i);
        float kr = 0.f;
#pragma unroll
        for (int j = 0; j < T128::kCols; ++j) {
          dK.a[i][j] += eL[r] * R.a[i][j];
          kr += Ks[r * LDD + R.col(j)] * R.a[i][j];
        }
        kr = T128::row_sum(kr);
        if (R.row_leader()) {
          dG[r] -= eL[r] * kr;
          lastrow[r] = eL[r] * kr;
        }
      }
    }
    {  // <S0, dSL>, reduced deterministically
      float acc = 0.f;
      for (int e = threadIdx.x; e < D * D; e += NT) acc += S0[e] * dSL[e];
      red[threadIdx.x] = acc;
    }
    __syncthreads();  // Xs free again; red and lastrow complete
    {  // masked C x C products: dA, dP, A, P -> M1 = dP . Dec, M2 = beta dA . Dec, E
      T64 t1, t2, t3, t4;
      t1.zero();
      t2.zero();
      t3.zero();
      t4.zero();
      t1.template mma<false, true, D>(dVs, LDD, Us, LDD);
      t2.template mma<false, true, D>(dOs, LDD, Us, LDD);
      t3.template mma<false, true, D>(Ks, LDD, Ks, LDD);
      t4.template mma<false, true, D>(Qs, LDD, Ks, LDD);
      float* E = Xs;
#pragma unroll
      for (int i = 0; i < T64::kRows; ++i) {
        const int r = t1.row(i);
        float dbp = 0.f;
#pragma unroll
        for (int j = 0; j < T64::kCols; ++j) {
          const int s = t1.col(j);
          const float dec = s <= r ? __expf(Gs[r] - Gs[s]) : 0.f;
          const float dA = s < r ? -t1.a[i][j] : 0.f;
          const float dP = s <= r ? p.scale * t2.a[i][j] : 0.f;
          const float A = s < r ? bs[r] * t3.a[i][j] * dec : 0.f;
          const float P = t4.a[i][j] * dec;
          M1[r * LDC + s] = dP * dec;
          M2[r * LDC + s] = bs[r] * dA * dec;
          dbp += dA * t3.a[i][j] * dec;
          E[r * LDC + s] = dA * A + dP * P;
        }
        dbp = T64::row_sum(dbp);
        if (t1.row_leader()) db[r] += dbp;
      }
    }
    __syncthreads();
    if (threadIdx.x < C) {  // dG_r += rowsum(E)_r - colsum(E)_r
      const int r = threadIdx.x;
      const float* E = Xs;
      float acc = 0.f;
      for (int s = 0; s < C; ++s) acc += E[r * LDC + s] - E[s * LDC + r];
      dG[r] += acc;
    }
    dQ.template mma<false, false, C>(M1, LDC, Ks, LDD);
    dK.template mma<true, false, C>(M1, LDC, Qs, LDD);
    dK.template mma<false, false, C>(M2, LDC, Ks, LDD);
    dK.template mma<true, false, C>(M2, LDC, Ks, LDD);
    {  // dv = beta dVt and dbeta += v . dVt; four threads per row
      const int r = threadIdx.x / 4, part = threadIdx.x % 4;
      float vd = 0.f;
      if (r < L) {
        const In* vrow = static_cast<const In*>(p.v) + ((tok0 + r) * p.Hv + h) * D;
        In* dvrow = static_cast<In*>(p.dv) + ((tok0 + r) * p.Hv + h) * D;
        for (int c = part * 32; c < part * 32 + 32; ++c) {
          const float d = dVs[r * LDD + c];
          vd += to_f(vrow[c]) * d;
          dvrow[c] = from_f<In>(bs[r] * d);
        }
      }
      vd += __shfl_xor_sync(0xffffffffu, vd, 1);
      vd += __shfl_xor_sync(0xffffffffu, vd, 2);
      __syncthreads();  // dG column sums done before the serial pass below
      if (part == 0 && r < L) db[r] += vd;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // last-row terms, then dg = reverse cumsum of dG
      float last = 0.f, s0ds = 0.f;
      for (int r = 0; r < C; ++r) last += lastrow[r];
      for (int t = 0; t < NT; ++t) s0ds += red[t];
      dG[L - 1] += last + gam[L - 1] * s0ds;
      float run = 0.f;
      for (int r = L - 1; r >= 0; --r) {
        run += dG[r];
        store_scalar(p.dg, p.g_dtype, (tok0 + r) * p.Hv + h, run);
        store_scalar(p.dbeta, p.beta_dtype, (tok0 + r) * p.Hv + h, db[r]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < T128::kRows; ++i)
#pragma unroll
    for (int j = 0; j < T128::kCols; ++j) {
      const int r = dQ.row(i), c = dQ.col(j);
      if (r < L) {
        const int64_t idx = ((tok0 + r) * p.Hqk + hq) * D + c;
        static_cast<In*>(p.dq)[idx] = from_f<In>(dQ.a[i][j]);
        static_cast<In*>(p.dk)[idx] = from_f<In>(dK.a[i][j]);
      }
    }
}

// ---------------------------------------------------------------------------------------
// grad_chunk_tc_kernel  grid (max_chunks, H_qk), 256 threads, ~205 KB smem (kRec16 ~187 KB)
//   (kQueue: block (x, y) works on the ready queue's next (chunk, q/k head) instead, running
//   beside the reverse pass's phase 0 as its programmatic dependent; BwdParams::rq_slot)
//   grad_chunk_kernel's gradients (same quantities, same order of the value heads) on TF32
//   mma.sync with register fragments read by paired loads (mma.cuh), not per element:
//   * 64 x 128 results (dO h^T, dVt h^T, U dS^T, dq, dk) are column strips: warp w holds
//     columns 16 w .. 16 w + 15 of all 64 rows. The state h and dS of the chunk (fp32,
//     2 x 64 KB per head, or the 128-column passes' fp16 record blocks, 2 x 32 KB, whose
//     16 columns are a slice) arrive in slices of 16 k columns through three cp.async stages
//     (in the scratch of the 64 x 64 phase, free until then); <h, dS> falls out of the B
//     fragments. The next value head's operands are prefetched into L2 meanwhile.
//   * 64 x 64 products (dVt U^T, dO U^T, K K^T, Q K^T) are 32 x 16 warp tiles.
//   * kRec16: U and dVt are read as the fp16 record blocks they arrive as (exact tf32 by
//     widening), their blocks' powers of two folded into the B operands.
//   * dq += M1 K and dk += M1^T Q + (M2 + M2^T) K from M1, M1^T, M2 + M2^T stored once in
//     shared memory, K and Q read transposed by ldmatrix.
//   Row sums across warps go through shared scratch in a fixed order: deterministic.
//   reads  q, k, v, do, beta, G, U, dVt, h, dh (and their factors, kRec16)
//   writes dq, dk, dv, dg, dbeta
// kRec16: U and dVt stay the record blocks they arrive as ([2][8][C][kRecLd] fp16: block vb
// holds value columns 16 vb .. 16 vb + 15, rows 48 bytes apart: paired loads conflict free)
// instead of fp32 tiles [2][C][LDW].
constexpr int kRecLd = 24;
template <typename In, bool kRec16>
struct GradSmem {
  static constexpr size_t kUD =
      kRec16 ? sizeof(__half) * 2 * 8 * C * kRecLd : sizeof(float) * 2 * C * LDW;
  static constexpr size_t kTiles = sizeof(In) * 3 * C * LDH + kUD + sizeof(float) * 4 * C * LDA;
  static constexpr size_t kBytes = kTiles + sizeof(float) * (8 * C + 4 * 8 * C + 8 + 32);
};

// Brings a chunk and head's h or dS record into L2 (64 KB fp32, or 32 KB of fp16 record
// blocks): 128-byte lines, one or two a thread of the block.
template <bool kRec16>
__device__ __forceinline__ void prefetch_l2_record(const float* rec) {
  const char* b = reinterpret_cast<const char*>(rec) + 128 * threadIdx.x;
  prefetch_l2(b);
  if (!kRec16) prefetch_l2(b + 128 * NT);
}
// L2 prefetch of what grad_chunk_tc_kernel reads for value head h of a chunk: h and dS
// (contiguous) and the chunk's L rows of dO, v, U and dVt.
template <typename In, bool kRec16>
__device__ __forceinline__ void prefetch_grad_head(const BwdParams& p, int64_t chunk,
                                                   int64_t tok0, int L, int64_t h) {
  prefetch_l2_record<kRec16>(record_at<D>(p.h, chunk * p.Hv + h, kRec16));
  prefetch_l2_record<kRec16>(record_at<D>(p.dh, chunk * p.Hv + h, kRec16));
  // rows: 2 lines of dO and v, 4 of U and dVt each (one of each tensor a thread), or U's
  // and dVt's record blocks (16 KB each)
  const int r = threadIdx.x >> 2, part = threadIdx.x & 3;
  if constexpr (kRec16) {
    const float* blk = record_at<C>(threadIdx.x < 128 ? p.U : p.dVt, chunk * p.Hv + h, true);
    prefetch_l2(reinterpret_cast<const char*>(blk) + 128 * (threadIdx.x & 127));
  }
  if (threadIdx.x < 2 * C) {  // the per-token G and beta (one line each: H_v apart)
    const int rr = threadIdx.x & (C - 1);
    const int64_t i = (tok0 + (rr < L ? rr : L - 1)) * p.Hv + h;
    if (threadIdx.x < C) prefetch_l2(p.G + i);
    else prefetch_l2(static_cast<const char*>(p.beta) + i * (p.beta_dtype == FLASHGDN_DTYPE_F32 ? 4 : 2));
  }
  if (r < L) {
    const int64_t row = ((tok0 + r) * p.Hv + h) * D;
    if constexpr (!kRec16) {
      prefetch_l2(reinterpret_cast<const char*>(p.U + row) + 128 * part);
      prefetch_l2(reinterpret_cast<const char*>(p.dVt + row) + 128 * part);
    }
    if (part < 2) {
      prefetch_l2(reinterpret_cast<const char*>(static_cast<const In*>(p.d_o) + row) + 128 * part);
      prefetch_l2(reinterpret_cast<const char*>(static_cast<const In*>(p.v) + row) + 128 * part);
    }
  }
}

// Products of record blocks on fp16 mma (grad_chunk_tc_kernel, kRec16): the blocks' factors
// are powers of two, so a product's pair factor is 2^(e_a + e_b). pair_exp gives that exponent
// (no fp32 under- or overflow on the way), pow2f builds 2^e as fp32 (0 below the normal range,
// inf above), and pow2h the ratio 2^d (d <= 0) as fp16, 0 below fp16's smallest subnormal.
__device__ __forceinline__ int pair_exp(float a, float b) {
  return ((__float_as_int(a) >> 23) & 0xff) + ((__float_as_int(b) >> 23) & 0xff) - 254;
}
__device__ __forceinline__ float pow2f(int e) {
  return e < -126 ? 0.f : e > 127 ? __int_as_float(0x7f800000) : __int_as_float((e + 127) << 23);
}
__device__ __forceinline__ __half2 pow2h(int d) {
  return __float2half2_rn(d < -24 ? 0.f : __int_as_float((d + 127) << 23));
}

// The end of a value head of the per-chunk gradients (grad_chunk_tc_kernel,
// grad_chunk_wg_kernel), by one warp, two rows a lane: the last row's terms (the rows'
// lastrow, gam_last <h, dS> from the eight warps' partial sums red), then dg = the reverse
// cumulative sum of dG over the chunk's L rows, and the stores of dg and dbeta (db).
__device__ __forceinline__ void finish_dg_dbeta(const BwdParams& p, int64_t tok0, int L,
                                                int64_t h, const float* gam, const float* dG,
                                                const float* db, const float* lastrow,
                                                const float* red) {
  const int l = lane_id();
  float last = lastrow[l] + lastrow[l + 32];
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) last += __shfl_xor_sync(0xffffffffu, last, m);
  float s0ds = 0.f;
  for (int w = 0; w < 8; ++w) s0ds += red[w];
  const int r0 = 2 * l, r1 = 2 * l + 1;
  float x0 = r0 < L ? dG[r0] : 0.f, x1 = r1 < L ? dG[r1] : 0.f;
  const float tail = last + gam[L - 1] * s0ds;
  if (r0 == L - 1) x0 += tail;
  if (r1 == L - 1) x1 += tail;
  float incl = x0 + x1;  // suffix sums over lanes l' >= l
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const float y = __shfl_down_sync(0xffffffffu, incl, m);
    if (l + m < 32) incl += y;
  }
  float after = __shfl_down_sync(0xffffffffu, incl, 1);
  if (l == 31) after = 0.f;
  const float run1 = x1 + after, run0 = x0 + run1;
  const int64_t base = tok0 * p.Hv + h;
  if (r0 < L) {
    store_scalar(p.dg, p.g_dtype, base + r0 * p.Hv, run0);
    store_scalar(p.dbeta, p.beta_dtype, base + r0 * p.Hv, db[r0]);
  }
  if (r1 < L) {
    store_scalar(p.dg, p.g_dtype, base + r1 * p.Hv, run1);
    store_scalar(p.dbeta, p.beta_dtype, base + r1 * p.Hv, db[r1]);
  }
}

// kRec16: h, dS, U and dVt are the 128-column passes' fp16 record blocks (BwdParams::rec16),
// else fp32 ([key][value], [token][value]).
// kQueue (kRec16 only): the ready queue's order (BwdParams::rq_slot, launch.cu bwd_queue).
template <typename In, bool kRec16, bool kQueue = false>
__global__ void __launch_bounds__(NT, 1) grad_chunk_tc_kernel(BwdParams p) {
  // h / dS slices [128][16] with 24-word rows (8 mod 16), or of fp16 record blocks with
  // 24-half rows (12 words): paired loads conflict free
  constexpr int LDK = 24;
  constexpr int kSliceFloats = kRec16 ? D * LDK / 2 : D * LDK;  // one matrix of a stage
  static_assert(3 * 2 * D * LDK <= 4 * C * LDA, "three h / dS slice stages fit in M1 .. E");
  // the ready queue (launched as the reverse pass's programmatic dependent): this grid's
  // completion must imply that pass's (dh0; the kernels after this one), so block (0, 0)
  // waits for it before it returns
  const bool dep_wait = kQueue && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;
  if (p.seqs.failed()) {
    if (dep_wait) pdl_wait();
    return;
  }
  ChunkRef ck = locate_chunk(p.seqs, blockIdx.x);
  if (ck.L == 0) {
    if (dep_wait) pdl_wait();
    return;
  }
  int64_t chunk = blockIdx.x, hq = blockIdx.y;
  if constexpr (kQueue) {  // a block whose own (chunk, q/k head) exists takes the next item
    __shared__ int item;
    if (threadIdx.x == 0) item = ready_take(p);
    __syncthreads();
    chunk = item / p.Hqk;
    hq = item - chunk * p.Hqk;
    ck = locate_chunk(p.seqs, chunk);
  }
  const int64_t group = p.Hv / p.Hqk;
  const int L = ck.L;
  const int64_t tok0 = ck.tok0;
  const int warp = threadIdx.x >> 5, g = lane_id() >> 2, t = lane_id() & 3;
  const int nw = 16 * warp;                       // this warp's column strip
  const int wm = 32 * (warp >> 2), wn = 16 * (warp & 3);  // its 64 x 64 tile

  extern __shared__ __align__(16) unsigned char smem_raw[];
  In* Qs = reinterpret_cast<In*>(smem_raw);  // [C][LDH]
  In* Ks = Qs + C * LDH;
  In* dOs = Ks + C * LDH;
  float* Us = reinterpret_cast<float*>(dOs + C * LDH);  // [C][LDW] (kRec16: unused)
  float* dVs = Us + C * LDW;
  // kRec16: the U and dVt record blocks in Us's place, [8][C][kRecLd] fp16 each
  __half* RU = reinterpret_cast<__half*>(dOs + C * LDH);
  __half* RD = RU + 8 * C * kRecLd;
  float* M1 = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(dOs + C * LDH) +
                                       GradSmem<In, kRec16>::kUD);  // [C][LDA] dP . Dec (tf32)
  float* M1t = M1 + C * LDA;    // its transpose
  float* M2s = M1t + C * LDA;   // M2 + M2^T, M2 = beta dA . Dec (strictly lower)
  float* E = M2s + C * LDA;     // dA . A + dP . P
  float* Gs = E + C * LDA;      // [C] each
  float* gam = Gs + C;
  float* eL = gam + C;
  float* bs = eL + C;
  float* dG = bs + C;
  float* db = dG + C;
  float* lastrow = db + C;
  float* part = lastrow + C;    // [4][8][C] per-warp partial row sums
  float* red = part + 4 * 8 * C;  // [8] per-warp partial sums of <h, dS>
  float* vdt = red + 8;           // [C] v . dVt per row (dbeta)
  float* recsc = vdt + C;         // [32] the record blocks' factors: h, dS, U, dVt (kRec16)

  const int64_t qk_off = (tok0 * p.Hqk + hq) * D;
  cp_async_tile<C, D, LDH>(Qs, static_cast<const In*>(p.q) + qk_off, p.Hqk * D, L);
  cp_async_tile<C, D, LDH>(Ks, static_cast<const In*>(p.k) + qk_off, p.Hqk * D, L);
  cp_async_commit();

  // A value head's dO and U, dVt (fp32 rows, or their record blocks) into dOs, Us, dVs (RU,
  // RD): one cp.async group. The first head's at the loop's start; each later head's as soon
  // as the head before it no longer reads those tiles (after its 64 x 64 products), so the
  // copies run under that head's dq / dk products.
  auto copy_head = [&](int64_t hh) {
    const int64_t off = (tok0 * p.Hv + hh) * D;
    cp_async_tile<C, D, LDH>(dOs, static_cast<const In*>(p.d_o) + off, p.Hv * D, L);
    if constexpr (kRec16) {  // two 16 KB record blocks, 32-byte rows -> 48-byte rows
      const int64_t rec = chunk * p.Hv + hh;
      const __half* us = reinterpret_cast<const __half*>(record_at<C>(p.U, rec, true));
      const __half* ds = reinterpret_cast<const __half*>(record_at<C>(p.dVt, rec, true));
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int idx = static_cast<int>(threadIdx.x) + NT * j, mat = idx >> 10, pc = idx & 1023;
        const int row = (pc >> 1) & (C - 1), blk = pc >> 7, c8 = pc & 1;
        // rows past the chunk read as zero (the products' A operands need no mask)
        cp_async16((mat ? RD : RU) + (blk * C + row) * kRecLd + 8 * c8, (mat ? ds : us) + 8 * pc,
                   row < L);
      }
    } else {
      cp_async_tile<C, D, LDW>(Us, p.U + off, p.Hv * D, L);
      cp_async_tile<C, D, LDW>(dVs, p.dVt + off, p.Hv * D, L);
    }
    cp_async_commit();
  };

  float dq[4][2][4] = {}, dk[4][2][4] = {};  // rows 16 mt + g (+8), columns nw + 8 nt + 2t (+1)
  for (int64_t h = hq * group; h < (hq + 1) * group; ++h) {
    __syncthreads();  // the previous head's scalars and scratch are no longer read
    // the per-token scalars' loads first (their latency under the copies' issue below)
    float ld_g = 0.f, ld_glast = 0.f, ld_beta = 0.f, ld_scale = 0.f;
    if (threadIdx.x < C) {
      const int r = threadIdx.x;
      ld_g = p.G[(tok0 + (r < L ? r : L - 1)) * p.Hv + h];
      ld_glast = p.G[(tok0 + L - 1) * p.Hv + h];
      ld_beta = r < L ? load_scalar(p.beta, p.beta_dtype, (tok0 + r) * p.Hv + h) : 0.f;
    }
    if (kRec16 && threadIdx.x < 32) {
      const int64_t i = (chunk * p.Hv + h) * 8 + (threadIdx.x & 7);
      const int w = threadIdx.x >> 3;
      ld_scale = (w == 0 ? p.h_scale : w == 1 ? p.dh_scale : w == 2 ? p.U_scale : p.dVt_scale)[i];
    }
    const int64_t v_off = (tok0 * p.Hv + h) * D;
    if (h == hq * group) copy_head(h);
    const float* S0 = record_at<D>(p.h, chunk * p.Hv + h, kRec16);
    const float* dSL = record_at<D>(p.dh, chunk * p.Hv + h, kRec16);
    if (h == hq * group) {  // the first head's h, dS and v into L2 (later heads: below)
      prefetch_l2_record<kRec16>(S0);
      prefetch_l2_record<kRec16>(dSL);
      const int r = threadIdx.x >> 2, part = threadIdx.x & 3;
      if (r < L && part < 2)
        prefetch_l2(reinterpret_cast<const char*>(static_cast<const In*>(p.v) + v_off +
                                                  r * p.Hv * D) +
                    128 * part);
    }
    // h and dS reach the products in slices of 16 columns (k), three stages of cp.async
    // copies in the scratch that M1 .. E use later: stage st holds h then dS, [128][LDK]
    auto stage = [&](int st) { return M1 + st * 2 * kSliceFloats; };
    auto copy_slice = [&](int sl) {
      float* dst = stage(sl % 3);
      if constexpr (kRec16) {  // record block sl: [128][16] fp16, contiguous
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int idx = static_cast<int>(threadIdx.x) + NT * j;  // 2 x 128 rows x 2 pieces
          const int mat = idx >> 8, row = (idx >> 1) & 127, c8 = idx & 1;
          const __half* src = reinterpret_cast<const __half*>(mat ? dSL : S0) + sl * D * 16;
          cp_async16(reinterpret_cast<__half*>(dst + mat * kSliceFloats) + row * LDK + 8 * c8,
                     src + row * 16 + 8 * c8, true);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int idx = static_cast<int>(threadIdx.x) + NT * j;  // 2 x 128 rows x 4 pieces
          const int mat = idx >> 9, row = (idx >> 2) & 127, c4 = idx & 3;
          cp_async16(dst + mat * D * LDK + row * LDK + 4 * c4,
                     (mat ? dSL : S0) + row * D + 16 * sl + 4 * c4, true);
        }
      }
    };
    copy_slice(0);
    cp_async_commit();  // slice 0 (the head's dO, U, dVt: the group before)
    copy_slice(1);
    cp_async_commit();
    if (threadIdx.x < C) {
      const int r = threadIdx.x;
      Gs[r] = ld_g;
      gam[r] = __expf(ld_g);
      eL[r] = __expf(ld_glast - ld_g);
      bs[r] = ld_beta;
      dG[r] = 0.f;
    }
    if (kRec16 && threadIdx.x < 32) recsc[threadIdx.x] = ld_scale;
    // the row pass's v (row threadIdx / 4, columns 32 (threadIdx % 4) ..): loads in flight
    // across the wait below
    uint4 vrow[4];
    if ((threadIdx.x >> 2) < L) {
      const In* src = static_cast<const In*>(p.v) + v_off +
                      static_cast<int64_t>(threadIdx.x >> 2) * p.Hv * D + 32 * (threadIdx.x & 3);
#pragma unroll
      for (int c8 = 0; c8 < 4; ++c8) vrow[c8] = *reinterpret_cast<const uint4*>(src + 8 * c8);
    }
    // the head's dO, U, dVt group (and Q, K): all but slices 0 and 1, which land under the
    // row pass (the first slice's wait below)
    cp_async_wait<2>();
    __syncthreads();

    // ---- per row (four threads each): dv = beta dVt, v . dVt. fp32 records: U and dVt are
    // rounded to tf32 in place in Us, dVs (zero past the chunk), so that the products below
    // read plain fragments. kRec16: dVt from its record blocks (fp16 times a power of two);
    // the products read the blocks themselves.
    {
      const int r = threadIdx.x >> 2, qq = threadIdx.x & 3;  // columns 32 qq .. + 31
      float* urow = Us + r * LDW + 32 * qq;  // fp32 records
      float* drow = dVs + r * LDW + 32 * qq;
      float vd = 0.f;
      if (r < L) {
        const int64_t off = v_off + static_cast<int64_t>(r) * p.Hv * D + 32 * qq;
        In* dvrow = static_cast<In*>(p.dv) + off;
        const float br = bs[r];
#pragma unroll
        for (int c8 = 0; c8 < 4; ++c8) {
          float rd[8];  // kRec16: dVt of columns 32 qq + 8 c8 .. from record block
          if constexpr (kRec16) {  // 2 qq + c8 / 2, its half c8 % 2
            const int vb = 2 * qq + (c8 >> 1);
            const float sd = recsc[24 + vb];
            const uint4 dd = *reinterpret_cast<const uint4*>(RD + (vb * C + r) * kRecLd +
                                                             8 * (c8 & 1));
            const __half* de = reinterpret_cast<const __half*>(&dd);
#pragma unroll
            for (int e = 0; e < 8; ++e) rd[e] = sd * __half2float(de[e]);
          }
          const In* ve = reinterpret_cast<const In*>(&vrow[c8]);
          uint4 out;
          In* oe = reinterpret_cast<In*>(&out);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            float d;
            if constexpr (kRec16) d = rd[e];
            else d = drow[8 * c8 + e];
            vd += to_f(ve[e]) * d;
            oe[e] = from_f<In>(br * d);
          }
          *reinterpret_cast<uint4*>(dvrow + 8 * c8) = out;
        }
      }
      if constexpr (!kRec16) {
#pragma unroll
        for (int c4 = 0; c4 < 8; ++c4) {
          float4 u = *reinterpret_cast<float4*>(urow + 4 * c4);
          float4 d = *reinterpret_cast<float4*>(drow + 4 * c4);
          u = make_float4(round_tf32(u.x), round_tf32(u.y), round_tf32(u.z), round_tf32(u.w));
          d = make_float4(round_tf32(d.x), round_tf32(d.y), round_tf32(d.z), round_tf32(d.w));
          *reinterpret_cast<float4*>(urow + 4 * c4) = u;
          *reinterpret_cast<float4*>(drow + 4 * c4) = d;
        }
      }
#pragma unroll
      for (int m = 1; m <= 2; m <<= 1) vd += __shfl_xor_sync(0xffffffffu, vd, m);
      if (qq == 0) vdt[r] = vd;
    }
    // (kRec16: the first slice's barrier below orders the row pass before the products)
    if constexpr (!kRec16) __syncthreads();

    // ---- Y = dO h^T, Z = dVt h^T, R = U dS^T (column strips), <h, dS>
    {
      float Y[4][2][4] = {}, Z[4][2][4] = {}, R[4][2][4] = {};
      // kRec16: the largest factor of Z's (h x dVt) and R's (dS x U) block pairs over the
      // slices (powers of two: the ratios below are exact)
      float zmax = 1.f, rmax = 1.f;
      int ze = 0, re = 0;  // their exponents
      if constexpr (kRec16) {
        ze = re = -1000;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          ze = max(ze, pair_exp(recsc[b], recsc[24 + b]));
          re = max(re, pair_exp(recsc[8 + b], recsc[16 + b]));
        }
        zmax = pow2f(ze);
        rmax = pow2f(re);
      }
      float s0ds = 0.f;
#pragma unroll 1
      for (int sl = 0; sl < D / 16; ++sl) {
        cp_async_wait<1>();  // slice sl has landed (only slice sl + 1 may be in flight)
        __syncthreads();     // ... for every thread; and stage (sl + 2) % 3 is read by none
        if (sl + 2 < D / 16) copy_slice(sl + 2);
        cp_async_commit();  // (empty at the end: keeps one group per slice)
        const float* Hs = stage(sl % 3);
        const float* Ds = Hs + kSliceFloats;
        float sh = 1.f, sd = 1.f;
        if constexpr (kRec16) {  // the h and dS blocks' factors
          sh = recsc[sl];
          sd = recsc[8 + sl];
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // two k8 steps of tf32
          const int k0 = 16 * sl + 8 * half, kl = 8 * half;
          uint32_t bS[2][2], bD[2][2];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const int off = (nw + 8 * nt + g) * LDK + kl + 2 * t;
            float2 fs, fd;
            if constexpr (kRec16) {  // fp16 times a power of two: exact tf32 values
              fs = __half22float2(*reinterpret_cast<const __half2*>(
                  reinterpret_cast<const __half*>(Hs) + off));
              fd = __half22float2(*reinterpret_cast<const __half2*>(
                  reinterpret_cast<const __half*>(Ds) + off));
              fs.x *= sh;
              fs.y *= sh;
              fd.x *= sd;
              fd.y *= sd;
              bS[nt][0] = __float_as_uint(fs.x);
              bS[nt][1] = __float_as_uint(fs.y);
            } else {
              fs = *reinterpret_cast<const float2*>(Hs + off);
              fd = *reinterpret_cast<const float2*>(Ds + off);
              bS[nt][0] = __float_as_uint(round_tf32(fs.x));
              bS[nt][1] = __float_as_uint(round_tf32(fs.y));
              bD[nt][0] = __float_as_uint(round_tf32(fd.x));
              bD[nt][1] = __float_as_uint(round_tf32(fd.y));
            }
            s0ds += fs.x * fd.x + fs.y * fd.y;
          }
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            uint32_t aO[4];
            frag_a(aO, dOs, LDH, 16 * mt, k0);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) mma_tf32(Y[mt][nt], aO, bS[nt]);
            if constexpr (!kRec16) {
              uint32_t aV[4], aU[4];
              frag_a(aV, dVs, LDW, 16 * mt, k0);
              frag_a(aU, Us, LDW, 16 * mt, k0);
#pragma unroll
              for (int nt = 0; nt < 2; ++nt) {
                mma_tf32(Z[mt][nt], aV, bS[nt]);
                mma_tf32(R[mt][nt], aU, bD[nt]);
              }
            }
          }
        }
        if constexpr (kRec16) {
          // Z = dVt h^T and R = U dS^T from the fp16 blocks themselves: one m16n8k16 step
          // per slice, the B blocks times their factor relative to the largest one over
          // the slices (an exact power of two <= 1; Z and R come out times 1 / zmax, 1 / rmax)
          const __half2 rz = pow2h(pair_exp(sh, recsc[24 + sl]) - ze);
          const __half2 rr = pow2h(pair_exp(sd, recsc[16 + sl]) - re);
          uint32_t bh[2][2], bd[2][2];
          frag_b16_pair(bh[0], bh[1], reinterpret_cast<const __half*>(Hs), LDK, nw, 0);
          frag_b16_pair(bd[0], bd[1], reinterpret_cast<const __half*>(Ds), LDK, nw, 0);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&bh[nt][e]), rz);
              __half2 y = __hmul2(*reinterpret_cast<const __half2*>(&bd[nt][e]), rr);
              bh[nt][e] = *reinterpret_cast<const uint32_t*>(&x);
              bd[nt][e] = *reinterpret_cast<const uint32_t*>(&y);
            }
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            uint32_t aV[4], aU[4];
            frag_a16(aV, RD + sl * C * kRecLd, kRecLd, 16 * mt, 0);
            frag_a16(aU, RU + sl * C * kRecLd, kRecLd, 16 * mt, 0);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              mma_f16(Z[mt][nt], aV, bh[nt]);
              mma_f16(R[mt][nt], aU, bd[nt]);
            }
          }
        }
      }
      // dq += scale gam Y, dk += eL R - beta gam Z; row dots Q.Y, K.Z, K.R
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = 16 * mt + g + 8 * hf;
          const float sg = p.scale * gam[r], bg = bs[r] * gam[r] * zmax, el = eL[r] * rmax;
          float qy = 0.f, kz = 0.f, kr = 0.f;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
              const int c = nw + 8 * nt + 2 * t + (e & 1);
              const float q = to_f(Qs[r * LDH + c]), k = to_f(Ks[r * LDH + c]);
              qy += q * Y[mt][nt][e];
              kz += k * Z[mt][nt][e];
              kr += k * R[mt][nt][e];
              dq[mt][nt][e] += sg * Y[mt][nt][e];
              dk[mt][nt][e] += el * R[mt][nt][e] - bg * Z[mt][nt][e];
            }
#pragma unroll
          for (int m = 1; m <= 2; m <<= 1) {
            qy += __shfl_xor_sync(0xffffffffu, qy, m);
            kz += __shfl_xor_sync(0xffffffffu, kz, m);
            kr += __shfl_xor_sync(0xffffffffu, kr, m);
          }
          if (t == 0) {
            part[(0 * 8 + warp) * C + r] = qy;
            part[(1 * 8 + warp) * C + r] = kz * zmax;
            part[(2 * 8 + warp) * C + r] = kr * rmax;
          }
        }
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) s0ds += __shfl_xor_sync(0xffffffffu, s0ds, m);
      if (lane_id() == 0) red[warp] = s0ds;
    }
    __syncthreads();
    if (threadIdx.x < C) {
      const int r = threadIdx.x;
      float qy = 0.f, kz = 0.f, kr = 0.f;
      for (int w = 0; w < 8; ++w) {
        qy += part[(0 * 8 + w) * C + r];
        kz += part[(1 * 8 + w) * C + r];
        kr += part[(2 * 8 + w) * C + r];
      }
      dG[r] += p.scale * gam[r] * qy - bs[r] * gam[r] * kz - eL[r] * kr;
      db[r] = -gam[r] * kz;
      lastrow[r] = eL[r] * kr;
    }

    // The next head's operands into L2 while this one finishes (its h and dS slices are
    // copied only a slice or two ahead of their products). (Prefetching the first head of
    // the block the next wave runs, during the last head, measured 1.6% slower at 16/32 x
    // 32k: perf-notes version 26.)
    if (h + 1 < (hq + 1) * group) prefetch_grad_head<In, kRec16>(p, chunk, tok0, L, h + 1);
    // ---- 64 x 64: dVt U^T, dO U^T (tf32), K K^T, Q K^T (the inputs' own 16-bit type, exact
    // products) -> M1, M1^T, M2 + M2^T, E, row sums for dbeta
    {
      float t1[2][2][4] = {}, t2[2][2][4] = {}, t3[2][2][4] = {}, t4[2][2][4] = {};
      // kRec16: dVt U^T on fp16 from the blocks, one k16 step per block pair, U's blocks times
      // their pair's factor relative to the largest (t1 comes out times 1 / tmax)
      float tmax = 1.f;
      if constexpr (kRec16) {
        int te = -1000;
#pragma unroll
        for (int b = 0; b < 8; ++b) te = max(te, pair_exp(recsc[16 + b], recsc[24 + b]));
        tmax = pow2f(te);
#pragma unroll 2
        for (int vb = 0; vb < 8; ++vb) {
          const __half2 ru = pow2h(pair_exp(recsc[16 + vb], recsc[24 + vb]) - te);
          uint32_t bu[2][2];
          frag_b16_pair(bu[0], bu[1], RU + vb * C * kRecLd, kRecLd, wn, 0);
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&bu[j][e]), ru);
              bu[j][e] = *reinterpret_cast<const uint32_t*>(&x);
            }
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            uint32_t aV[4];
            frag_a16(aV, RD + vb * C * kRecLd, kRecLd, wm + 16 * i, 0);
#pragma unroll
            for (int j = 0; j < 2; ++j) mma_f16(t1[i][j], aV, bu[j]);
          }
        }
      }
#pragma unroll 4
      for (int k0 = 0; k0 < D; k0 += 8) {
        uint32_t bU[2][2];  // U for dO U^T (and, fp32 records, for dVt U^T)
        const int vb = k0 >> 4, kk = k0 & 15;
        float su = 1.f;
        if constexpr (kRec16) su = recsc[16 + vb];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if constexpr (kRec16) {
            uint32_t raw[2];
            frag_b(raw, RU + vb * C * kRecLd, kRecLd, wn + 8 * j, kk);
            bU[j][0] = __float_as_uint(su * __uint_as_float(raw[0]));
            bU[j][1] = __float_as_uint(su * __uint_as_float(raw[1]));
          } else {
            frag_b(bU[j], Us, LDW, wn + 8 * j, k0);
          }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          uint32_t aO[4];
          frag_a(aO, dOs, LDH, wm + 16 * i, k0);
#pragma unroll
          for (int j = 0; j < 2; ++j) mma_tf32(t2[i][j], aO, bU[j]);
          if constexpr (!kRec16) {
            uint32_t aV[4];
            frag_a(aV, dVs, LDW, wm + 16 * i, k0);
#pragma unroll
            for (int j = 0; j < 2; ++j) mma_tf32(t1[i][j], aV, bU[j]);
          }
        }
      }
      const __half* Kh = reinterpret_cast<const __half*>(Ks);
      const __half* Qh = reinterpret_cast<const __half*>(Qs);
#pragma unroll 2
      for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t bK[2][2];
        frag_b16_pair(bK[0], bK[1], Kh, LDH, wn, k0);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          uint32_t aK[4], aQ[4];
          frag_a16(aK, Kh, LDH, wm + 16 * i, k0);
          frag_a16(aQ, Qh, LDH, wm + 16 * i, k0);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            mma_16(t3[i][j], aK, bK[j], Ks);
            mma_16(t4[i][j], aQ, bK[j], Ks);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = wm + 16 * i + g + 8 * hf;
          const float gr = Gs[r], br = bs[r];
          float dbp = 0.f;
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 2 * hf; e < 2 * hf + 2; ++e) {
              const int s = wn + 8 * j + 2 * t + (e & 1);
              const float dec = s <= r ? __expf(gr - Gs[s]) : 0.f;
              const float dA = s < r ? -tmax * t1[i][j][e] : 0.f;
              const float dP = s <= r ? p.scale * t2[i][j][e] : 0.f;
              const float A = s < r ? br * t3[i][j][e] * dec : 0.f;
              const float P = t4[i][j][e] * dec;
              const float m1 = round_tf32(dP * dec), m2 = round_tf32(br * dA * dec);
              M1[r * LDA + s] = m1;
              M1t[s * LDA + r] = m1;
              if (s <= r) {
                M2s[r * LDA + s] = m2;  // zero on the diagonal
                M2s[s * LDA + r] = m2;
              }
              dbp += dA * t3[i][j][e] * dec;
              E[r * LDA + s] = dA * A + dP * P;
            }
          dbp += __shfl_xor_sync(0xffffffffu, dbp, 1);
          dbp += __shfl_xor_sync(0xffffffffu, dbp, 2);
          if (t == 0) part[(3 * 8 + (warp & 3)) * C + r] = dbp;
        }
    }
    __syncthreads();
    // dOs, Us, dVs (RU, RD) are no longer read: the next head's copies run under what follows
    if (h + 1 < (hq + 1) * group) copy_head(h + 1);

    // ---- per row (four threads each): dG += rowsum(E) - colsum(E); dbeta
    {
      const int r = threadIdx.x >> 2, qq = threadIdx.x & 3;
      float es = 0.f;
#pragma unroll 4
      for (int s = 16 * qq; s < 16 * qq + 16; ++s) es += E[r * LDA + s] - E[s * LDA + r];
#pragma unroll
      for (int m = 1; m <= 2; m <<= 1) es += __shfl_xor_sync(0xffffffffu, es, m);
      if (qq == 0) {
        float dbp = 0.f;
        for (int w = 0; w < 4; ++w) dbp += part[(3 * 8 + w) * C + r];
        dG[r] += es;
        db[r] += dbp + vdt[r];
      }
    }
    // ---- dq += M1 K, dk += M1^T Q + (M2 + M2^T) K
#pragma unroll 2
    for (int k0 = 0; k0 < C; k0 += 8) {
      uint32_t bK[2][2], bQ[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        frag_b_trans(bK[nt], Ks, LDH, nw + 8 * nt, k0);
        frag_b_trans(bQ[nt], Qs, LDH, nw + 8 * nt, k0);
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        uint32_t a1[4], a1t[4], a2[4];
        frag_a(a1, M1, LDA, 16 * mt, k0);
        frag_a(a1t, M1t, LDA, 16 * mt, k0);
        frag_a(a2, M2s, LDA, 16 * mt, k0);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          mma_tf32(dq[mt][nt], a1, bK[nt]);
          mma_tf32(dk[mt][nt], a1t, bQ[nt]);
          mma_tf32(dk[mt][nt], a2, bK[nt]);
        }
      }
    }
    __syncthreads();
    // ---- last-row terms, then dg = reverse cumsum of dG (warp 0, two rows per lane)
    if (warp == 0) finish_dg_dbeta(p, tok0, L, h, gam, dG, db, lastrow, red);
  }
  // dq and dk through the Q and K tiles (no longer read after the last head's products),
  // then out as whole 16-byte pieces of rows
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = 16 * mt + g + 4 * e, c = nw + 8 * nt + 2 * t;
        In q2[2] = {from_f<In>(dq[mt][nt][e]), from_f<In>(dq[mt][nt][e + 1])};
        In k2[2] = {from_f<In>(dk[mt][nt][e]), from_f<In>(dk[mt][nt][e + 1])};
        *reinterpret_cast<uint32_t*>(Qs + r * LDH + c) = *reinterpret_cast<const uint32_t*>(q2);
        *reinterpret_cast<uint32_t*>(Ks + r * LDH + c) = *reinterpret_cast<const uint32_t*>(k2);
      }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = static_cast<int>(threadIdx.x) + NT * i;  // 64 rows x 16 pieces
    const int r = idx >> 4, c8 = 8 * (idx & 15);
    if (r < L) {
      const int64_t off = ((tok0 + r) * p.Hqk + hq) * D + c8;
      *reinterpret_cast<uint4*>(static_cast<In*>(p.dq) + off) =
          *reinterpret_cast<const uint4*>(Qs + r * LDH + c8);
      *reinterpret_cast<uint4*>(static_cast<In*>(p.dk) + off) =
          *reinterpret_cast<const uint4*>(Ks + r * LDH + c8);
    }
  }
  if (dep_wait) pdl_wait();
}

}  // namespace cuda
}  // namespace flashgdn
