// Device-side planner for packed (varlen) calls. cu_seqlens lives on the GPU, so
// the chunk table is built on the GPU too: no host-device sync, graph capturable.
//
// plan_kernel  grid 1 x 1024 threads
//   reads  cu_seqlens [N + 1]
//   writes chunk_offsets [N + 1] (prefix sum of ceil(len / 64)), error (0 or 1:
//          cu_seqlens[0] != 0, decreasing, or cu_seqlens[N] != T), and when asked
//          seg_offsets [N + 1] (prefix sum of max(1, ceil(chunks / seg_chunks)): the
//          context-parallel segments of every sequence, see csrc/planner.h) and then
//          split_seqs [N + 1] ([0] = R, [1 + r] = the r-th sequence of more than one
//          segment: the sequences seg_combine_kernel walks) and seg_items [segments + 1]
//          ([0] = their segments' count, then those segments' indices: phase 1's work,
//          for_each_segment_block); with a
//          DeviceSegChoice, first picks seg_chunks (and, if asked, the column block)
//          (16, 32 or 128) from the actual lengths under the planner's cost model and writes them to
//          choice.chosen [2]
// poison_kernel grid-stride
//   writes NaN into an output when error is set, so a bad cu_seqlens is never
//   silent garbage (the compute kernels skip all work in that case).
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../planner.h"
#include "common.cuh"

namespace flashgdn {
namespace cuda {

constexpr int kPlanThreads = 1024;

// The device's choice of segment length (varlen, SegmentPlan::device_choice): the cost
// model of csrc/planner.h on the actual lengths, over unsplit and min_seg and the longer
// candidates after it (next_seg_candidate)
struct DeviceSegChoice {
  ForwardCost cost;
  double heads = 0;
  int sms = 0, col_block = 32;
  bool pick_col_block = false;  // also choose the column block (16, 32, or 128 if allow_cols)
  bool allow_cols = false;      // column block 128 (state_fwd_cols_kernel) is a candidate
  bool allow_split = true;      // false: only the column block is chosen (unsplit plan)
  int col_blocks = 0;           // the column blocks launched (SegmentPlan::device_col_blocks)
  int64_t min_seg = 0;
  int64_t* chosen = nullptr;  // writes [chunks per segment, column block] here
};

__global__ void __launch_bounds__(kPlanThreads)
    plan_kernel(SeqLayout s, int64_t total_tokens, int64_t seg_chunks, int64_t* chunk_offsets,
                int64_t* seg_offsets, int64_t* split_seqs, int64_t* seg_items, int* error,
                DeviceSegChoice choice) {
  using Scan = cub::BlockScan<int64_t, kPlanThreads>;
  using Reduce = cub::BlockReduce<int64_t, kPlanThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int bad;
  __shared__ int64_t seg_shared;
  if (threadIdx.x == 0) {
    bad = (s.cu(0) != 0 || s.cu(s.N) != total_tokens) ? 1 : 0;
    chunk_offsets[0] = 0;
    if (seg_offsets) seg_offsets[0] = 0;
  }
  __syncthreads();
  auto chunks_of = [&](int64_t n) -> int64_t {
    const int64_t len = s.cu(n + 1) - s.cu(n);
    return len > 0 ? (len + C - 1) / C : 0;
  };
  int64_t carry = 0, longest = 0;
  for (int64_t base = 0; base < s.N; base += kPlanThreads) {
    const int64_t n = base + threadIdx.x;
    int64_t count = 0;
    if (n < s.N) {
      if (s.cu(n + 1) - s.cu(n) < 0) bad = 1;
      count = chunks_of(n);
      longest = count > longest ? count : longest;
    }
    int64_t incl, total;
    Scan(tmp.scan).InclusiveSum(count, incl, total);
    if (n < s.N) chunk_offsets[n + 1] = carry + incl;
    carry += total;
    __syncthreads();
  }
  if (choice.chosen != nullptr) {  // choose the segment length from the actual lengths
    longest = Reduce(tmp.reduce).Reduce(longest, [](int64_t a, int64_t b) { return a > b ? a : b; });
    __syncthreads();
    if (threadIdx.x == 0) seg_shared = longest;
    __syncthreads();
    longest = seg_shared;
    LoadStats st;
    st.longest = static_cast<double>(longest);
    st.total = static_cast<double>(carry);
    st.segs = static_cast<double>(s.N);  // unsplit: one segment per sequence
    // unsplit (longer than any sequence) at each column block, then the splits, each of
    // which must beat the best unsplit plan by min_gain
    int best_bw = choice.col_block;
    double best = 1e300;
    const int bws[3] = {16, 32, 128};
    auto candidate = [&](int bw) {
      if (!choice.pick_col_block) return bw == choice.col_block;
      return (bw != 128 || choice.allow_cols) && (choice.col_blocks & col_block_bit(bw)) != 0;
    };
    for (int bw : bws) {
      if (!candidate(bw)) continue;
      const double t = estimate_state_pass_us(choice.cost, st, choice.heads, choice.sms, bw, 0.0);
      if (t < best) best = t, best_bw = bw;
    }
    int64_t best_seg = carry + 1;
    const double bar = (1.0 - choice.cost.min_gain) * best;
    for (int64_t seg = choice.min_seg; choice.allow_split && seg > 0 && seg < longest;
         seg = next_seg_candidate(seg)) {
      int64_t segs = 0;
      for (int64_t n = threadIdx.x; n < s.N; n += kPlanThreads) {
        const int64_t c = chunks_of(n);
        segs += segments_of(c, seg);
      }
      segs = Reduce(tmp.reduce).Sum(segs);
      __syncthreads();
      if (threadIdx.x == 0) seg_shared = segs;
      __syncthreads();
      st.segs = static_cast<double>(seg_shared);
      st.max_segs_per_seq = static_cast<double>(segments_of(longest, seg));
      for (int bw : bws) {
        if (!candidate(bw) || !seg_candidate_for(bw, seg, longest)) continue;
        const double t = estimate_state_pass_us(choice.cost, st, choice.heads, choice.sms, bw,
                                                static_cast<double>(seg));
        if (t < bar && t < best) best = t, best_seg = seg, best_bw = bw;
      }
      __syncthreads();
    }
    if (choice.allow_split) seg_chunks = best_seg;
    if (threadIdx.x == 0) {
      choice.chosen[0] = choice.allow_split ? best_seg : seg_chunks;
      choice.chosen[1] = best_bw;
    }
  }
  if (seg_offsets) {
    int64_t seg_carry = 0, split_carry = 0;
    for (int64_t base = 0; base < s.N; base += kPlanThreads) {
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
  __syncthreads();
  if (threadIdx.x == 0) *error = bad;
}

template <typename T>
__global__ void poison_kernel(T* out, int64_t n, const int* error) {
  if (*error == 0) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f<T>(__int_as_float(0x7fc00000));
}

}  // namespace cuda
}  // namespace flashgdn
