// Device-side planner for packed (varlen) calls. cu_seqlens lives on the GPU, so
// the chunk table is built on the GPU too: no host-device sync, graph capturable.
//
// plan_kernel  grid 1 x 512 threads (kPlanThreads; 92 registers, no spill: at 1024 the cost
//              model's fp64 estimates spilled ~500 bytes), or 64 (kPlanAsideThreads: held to
//              64 registers by its launch bounds, 28 bytes of spill, so that it fits beside
//              three wy blocks; at 72 registers, session 34's, it did not), or 128
//              (kPlanTableThreads, kChoose false; 512 past 128 sequences) where the launch
//              makes no choice
//   reads  cu_seqlens [N + 1]
//   writes chunk_offsets [N + 1] (prefix sum of ceil(len / 64)), error (0 or 1:
//          cu_seqlens[0] != 0, decreasing, or cu_seqlens[N] != T), and when asked
//          seg_offsets [N + 1] (prefix sum of max(1, ceil(chunks / seg_chunks)): the
//          context-parallel segments of every sequence, see csrc/planner.h) and then
//          split_seqs [N + 1] ([0] = R, [1 + r] = the r-th sequence of more than one
//          segment: the sequences seg_combine_kernel walks) and seg_items [segments + 1]
//          ([0] = their segments' count, then those segments' indices: phase 1's work,
//          for_each_segment_block); with a
//          DeviceSegChoice, first picks seg_chunks (and, if asked, the column block:
//          16, 32 or 128, and the schedule) from the actual lengths under the planner's
//          cost model (choose_plan) and writes them to choice.chosen [4], or writes the
//          choice the host made from the caller's copy of cu_seqlens (has_preset). PlanPart
//          splits it in two launches (the table and the error, then the choice and the
//          segment tables) so that a choice made here runs beside wy_kernel (run_planner)
// poison_kernel grid-stride, one launch for all of a call's outputs (PoisonList)
//   writes NaN into the outputs when error is set, so a bad cu_seqlens is never
//   silent garbage (the compute kernels skip all work in that case). One launch: two
//   (forward) or six (backward) launches of 1024 blocks that return at once took ~1.5 us
//   each (H100, graph replay). A programmatic dependent of the kernel before it (pdl_wait
//   first), so that its launch overlaps that kernel's tail.
// workspace_tag_kernel  1 x 32 threads (one acts)
//   a forward that keeps its records for the backward writes its problem's tag into the
//   kept workspace; the backward on that workspace compares it and sets its own error flag
//   on a mismatch (else copies the forward planner's verdict on cu_seqlens, or clears it for
//   fixed lengths), so that its kernels skip their work and poison_kernel fills the
//   gradients with NaN
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../planner.h"
#include "common.cuh"
#include "mma.cuh"  // pdl_wait

namespace flashgdn {
namespace cuda {

constexpr int kPlanThreads = 512;
// The choice's launch beside wy_kernel (PlanPart::Segments): 64 threads (4096 registers at
// the 64 a thread plan_kernel's launch bounds hold them to) fit beside three wy_kernel
// blocks of 256 threads at 80 registers (61440 of an SM's 65536), and its 4.3 KB of shared
// memory beside their 3 x 73 KB, so the choice takes no wy_kernel block's place
constexpr int kPlanAsideThreads = 64;
// The launch that makes no choice (the chunk table and the error, the host's or its preset
// segment tables): plan_kernel<kPlanTableThreads, false> up to that many sequences (one
// round of the block's scans), plan_kernel<kPlanThreads, false> past it
constexpr int kPlanTableThreads = 128;

// The device's choice (DeviceChoiceParams, csrc/planner.h) and where it writes it: [chunks
// per segment, column block, schedule, phase-0 merge] (device_pick's out: schedule 0
// sequential split, 1 overlapped or unsplit; merge: SegParams::p0_merge of a sequential
// split at column block 128, best_p0_merge, else 1)
struct DeviceSegChoice : DeviceChoiceParams {
  int64_t* chosen = nullptr;
  // the choice made on the host from the caller's copy of cu_seqlens (device_choice_on_host):
  // plan_kernel writes it to chosen instead of choosing
  bool has_preset = false;
  int64_t preset[4] = {};
};

// Sequences whose chunk counts the choice keeps in shared memory, a lane a candidate length
// summing their segments (choose_plan): most packed calls of TP rows.
constexpr int kFewSeqs = 64;

struct ChoiceScratch {
  int64_t chunks[kFewSeqs];          // the sequences' chunks, where N <= kFewSeqs
  int64_t seg[kMaxSegCandidates];    // candidate segment lengths
  unsigned long long segs[kMaxSegCandidates];  // segments they cut the sequences into
  double est[kMaxPlanCandidates][3];  // [unsplit, then each length] x [16, 32, 128]:
                                      //   sequential, overlapped and saturated estimates
                                      //   (device_candidate; 1e300: none)
  int merge[kMaxPlanCandidates];      // the sequential estimate's phase-0 merge
  int n;                              // candidate lengths
  int64_t chosen;                     // the segment length chosen
};

// plan_kernel's choice (all threads call it; returns the segment length chosen, or
// seg_chunks when only the column block is chosen): the steps of device_choice_on_host
// (csrc/planner.h, planner.cpp) spread over the block. Thread 0 lists the candidate lengths
// (device_seg_candidates); a thread per length sums the segments the sequences make at it
// (up to kFewSeqs sequences, from their counts in shared memory; more: every thread its
// sequences' at each length, reduced by shuffles and atomics); a thread per candidate
// evaluates the cost model (device_candidate: fp64, every schedule's estimate from one
// SplitTerms); thread 0 picks (device_pick). (When all 1024 threads evaluated every
// candidate the kernel took 17 us, H100, 16/32 heads 8192 x 4 tokens, 5 us without the
// choice; H200 2026-11-26, 4/16 heads 28672 + 4096, 64 threads: 18 us, before the
// candidates' estimates shared their terms.)
template <int kThreads, typename ChunksOf>
__device__ __forceinline__ int64_t choose_plan(const SeqLayout& s, ChunksOf chunks_of,
                                               int64_t longest, int64_t total,
                                               int64_t seg_chunks, const DeviceSegChoice& choice,
                                               ChoiceScratch& sc) {
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) sc.n = device_seg_candidates(choice, longest, sc.seg);
  if (threadIdx.x < kMaxSegCandidates) sc.segs[threadIdx.x] = 0;
  const bool few = s.N <= kFewSeqs;
  if (few && threadIdx.x < s.N) sc.chunks[threadIdx.x] = chunks_of(threadIdx.x);
  __syncthreads();
  const int nk = sc.n;
  if (few) {
    // a thread a candidate length over the few sequences' counts in shared memory: no
    // dependent chain of shuffles and atomics per candidate
    if (threadIdx.x < nk) {
      unsigned long long acc = 0;
      for (int64_t n = 0; n < s.N; ++n)
        acc += static_cast<unsigned long long>(segments_of(sc.chunks[n], sc.seg[threadIdx.x]));
      sc.segs[threadIdx.x] = acc;
    }
  } else {
    // sequences outer, candidates inner: each thread reads its sequences' lengths once (the
    // other order reloaded them per candidate, a dependent global round trip each)
    for (int64_t base = 0; base < s.N; base += kThreads) {
      const int64_t n = base + threadIdx.x;
      const int64_t chunks = n < s.N ? chunks_of(n) : -1;
      for (int k = 0; k < nk; ++k) {
        unsigned long long acc =
            chunks >= 0 ? static_cast<unsigned long long>(segments_of(chunks, sc.seg[k])) : 0;
#pragma unroll
        for (int o = 16; o > 0; o /= 2) acc += __shfl_down_sync(0xffffffffu, acc, o);
        if (lane == 0 && acc != 0) atomicAdd(&sc.segs[k], acc);
      }
    }
  }
  __syncthreads();
  const int ncand = 3 * (1 + nk);
  for (int i = threadIdx.x; i < ncand; i += kThreads) {
    const SplitEstimate e = device_candidate(choice, i, sc.seg, sc.segs, longest, total, s.N);
    sc.est[i][0] = e.sequential;
    sc.est[i][1] = e.overlapped;
    sc.est[i][2] = e.saturated;
    sc.merge[i] = e.merge;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t out[4];
    device_pick(choice, ncand, sc.est, sc.merge, sc.seg, total, seg_chunks, out);
    sc.chosen = out[0];
    for (int j = 0; j < 4; ++j) choice.chosen[j] = out[j];
  }
  __syncthreads();
  return sc.chosen;
}

// What one plan_kernel launch does: all of it, or (where the choice runs beside wy_kernel,
// see run_planner) the chunk table and the error flag, then in a second launch the choice
// and the segment tables.
enum class PlanPart : int { All = 0, Table = 1, Segments = 2 };

// (The launch bounds hold the 64-thread launch, kPlanAsideThreads, to 64 registers a thread.)
// kChoose false (kPlanTableThreads): no device choice in the launch (the host's plan, or its
// preset choice from cu_seqlens_cpu), so none of choose_plan's code or scratch; launch.cu
// takes it wherever the choice is not made here (run_planner).
template <int kThreads, bool kChoose = true>
__global__ void __launch_bounds__(kThreads, kThreads <= 64 ? 65536 / (64 * kThreads) : 1)
    plan_kernel(SeqLayout s, int64_t total_tokens, int64_t seg_chunks, int64_t* chunk_offsets,
                int64_t* seg_offsets, int64_t* split_seqs, int64_t* seg_items, int* error,
                const __grid_constant__ DeviceSegChoice choice, PlanPart part) {
  static_assert(kThreads % 32 == 0 &&
                    (!kChoose || (kThreads >= kMaxSegCandidates && kThreads >= kFewSeqs)),
                "a thread a length, and one for each of few sequences");
  const bool table = part != PlanPart::Segments;
  // The choice's parameters stay in parameter space (__grid_constant__, never written, its
  // preset read at constant indices): a written or dynamically indexed parameter struct is
  // copied to every thread's stack first (352 bytes a thread in the table launch's build).
  int64_t* const chosen = part == PlanPart::Table ? nullptr : choice.chosen;
  if (part == PlanPart::Table) seg_offsets = nullptr;
  using Scan = cub::BlockScan<int64_t, kThreads>;
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int64_t seg_shared;
  // the error: each thread's own finding, joined by the barrier before the flag's store (no
  // barrier between thread 0's reads of cu_seqlens' ends and every thread's reads: one
  // dependent global round trip, not two)
  int bad = 0;
  if (threadIdx.x == 0) {
    bad = (s.cu(0) != 0 || s.cu(s.N) != total_tokens) ? 1 : 0;
    if (table) chunk_offsets[0] = 0;
    if (seg_offsets) seg_offsets[0] = 0;
  }
  // Where every sequence has a thread (N <= kThreads) its chunk count is read once and
  // kept in a register for the choice and the segment tables (each read of cu_seqlens is a
  // dependent global round trip)
  const bool one_pass = s.N <= kThreads;
  int64_t mine = 0;
  auto chunks_for = [](int64_t len) -> int64_t { return len > 0 ? (len + C - 1) / C : 0; };
  auto chunks_of = [&](int64_t n) -> int64_t {
    return one_pass ? mine : chunks_for(s.cu(n + 1) - s.cu(n));
  };
  int64_t carry = 0, longest = 0;
  for (int64_t base = 0; base < s.N; base += kThreads) {
    const int64_t n = base + threadIdx.x;
    int64_t count = 0;
    if (n < s.N) {
      const int64_t len = s.cu(n + 1) - s.cu(n);
      if (len < 0) bad = 1;
      count = chunks_for(len);
      mine = count;
      longest = count > longest ? count : longest;
    }
    int64_t incl, total;
    Scan(tmp.scan).InclusiveSum(count, incl, total);
    if (table && n < s.N) chunk_offsets[n + 1] = carry + incl;
    carry += total;
    __syncthreads();
  }
  if (chosen != nullptr && choice.has_preset) {  // the host's choice
    if (threadIdx.x == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) chosen[j] = choice.preset[j];
    }
    seg_chunks = choice.preset[0];
  } else if (chosen != nullptr) {  // choose the segment length from the actual lengths
    if constexpr (kChoose) {
      __shared__ ChoiceScratch choose;
      longest =
          Reduce(tmp.reduce).Reduce(longest, [](int64_t a, int64_t b) { return a > b ? a : b; });
      if (threadIdx.x == 0) seg_shared = longest;
      __syncthreads();
      longest = seg_shared;
      __syncthreads();
      seg_chunks = choose_plan<kThreads>(s, chunks_of, longest, carry, seg_chunks, choice, choose);
    } else {
      __trap();  // launch.cu never asks a table launch for a choice
    }
  }
  if (seg_offsets) {
    int64_t seg_carry = 0, split_carry = 0;
    for (int64_t base = 0; base < s.N; base += kThreads) {
      const int64_t n = base + threadIdx.x;
      const int64_t count = n < s.N ? chunks_of(n) : 0;
      const int64_t segs = n < s.N ? segments_of(count, seg_chunks) : 0;
      int64_t incl, total;
      Scan(tmp.scan).InclusiveSum(segs, incl, total);
      if (n < s.N) seg_offsets[n + 1] = seg_carry + incl;
      seg_carry += total;
      __syncthreads();
      if (split_seqs) {  // compact the split sequences' indices and their segments'
        const int64_t first_seg = seg_carry - total + incl - segs;  // seg_offsets[n]
        const int64_t split = segs > 1 ? 1 : 0;
        Scan(tmp.scan).InclusiveSum(split, incl, total);
        const int64_t rank = split_carry + incl - split;  // split sequences before n
        if (split) {
          split_seqs[1 + rank] = n;
          // the split sequences' segments before n: all segments before n less one for each
          // sequence before n that has one
          const int64_t item0 = first_seg - (n - rank);
          for (int64_t j = 0; j < segs; ++j) seg_items[1 + item0 + j] = first_seg + j;
        }
        split_carry += total;
        __syncthreads();
      }
    }
    if (split_seqs && threadIdx.x == 0) {
      split_seqs[0] = split_carry;
      seg_items[0] = seg_carry - (s.N - split_carry);
    }
  }
  bad = __syncthreads_or(bad);
  if (table && threadIdx.x == 0) *error = bad;
}

// The outputs poison_kernel overwrites: up to kPoisonMax arrays of n elements of a dtype.
constexpr int kPoisonMax = 6;
struct PoisonList {
  void* ptr[kPoisonMax];
  int64_t n[kPoisonMax];
  int dtype[kPoisonMax];  // flashgdn_dtype: F32, F16 or BF16
  int count = 0;
};

template <typename T>
__device__ __forceinline__ void poison_array(void* out, int64_t n) {
  T* o = static_cast<T*>(out);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    o[i] = from_f<T>(__int_as_float(0x7fc00000));
}

__global__ void poison_kernel(const __grid_constant__ PoisonList list, const int* error) {
  // launched as the programmatic dependent of the call's last kernel (Poison::launch): its
  // blocks start under that kernel's tail and wait here for it (and, by the chain's
  // PdlCompletion, every kernel before it) before reading the flag
  pdl_wait();
  if (*error == 0) return;
  for (int a = 0; a < list.count; ++a) {
    void* out = list.ptr[a];
    if (list.dtype[a] == FLASHGDN_DTYPE_F32) poison_array<float>(out, list.n[a]);
    else if (list.dtype[a] == FLASHGDN_DTYPE_BF16) poison_array<__nv_bfloat16>(out, list.n[a]);
    else poison_array<__half>(out, list.n[a]);
  }
}

__global__ void workspace_tag_kernel(unsigned long long* tag, unsigned long long value,
                                     const int* fwd_error, int* error, int check, int varlen) {
  if (threadIdx.x != 0) return;
  if (!check) {
    *tag = value;
    return;
  }
  *error = *tag != value ? 1 : varlen ? *fwd_error : 0;
}

}  // namespace cuda
}  // namespace flashgdn
