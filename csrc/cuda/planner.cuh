// Device-side planner for packed (varlen) calls. cu_seqlens lives on the GPU, so
// the chunk table is built on the GPU too: no host-device sync, graph capturable.
//
// plan_kernel  grid 1 x 1024 threads
//   reads  cu_seqlens [N + 1]
//   writes chunk_offsets [N + 1] (prefix sum of ceil(len / 64)), error (0 or 1:
//          cu_seqlens[0] != 0, decreasing, or cu_seqlens[N] != T), and when asked
//          seg_offsets [N + 1] (prefix sum of max(1, ceil(chunks / seg_chunks)): the
//          context-parallel segments of every sequence, see csrc/planner.h)
// poison_kernel grid-stride
//   writes NaN into an output when error is set, so a bad cu_seqlens is never
//   silent garbage (the compute kernels skip all work in that case).
#pragma once

#include <cub/block/block_scan.cuh>

#include "common.cuh"

namespace flashgdn {
namespace cuda {

constexpr int kPlanThreads = 1024;

__global__ void __launch_bounds__(kPlanThreads)
    plan_kernel(SeqLayout s, int64_t total_tokens, int64_t seg_chunks, int64_t* chunk_offsets,
                int64_t* seg_offsets, int* error) {
  using Scan = cub::BlockScan<int64_t, kPlanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int bad;
  if (threadIdx.x == 0) {
    bad = (s.cu(0) != 0 || s.cu(s.N) != total_tokens) ? 1 : 0;
    chunk_offsets[0] = 0;
    if (seg_offsets) seg_offsets[0] = 0;
  }
  __syncthreads();
  int64_t carry = 0, seg_carry = 0;
  for (int64_t base = 0; base < s.N; base += kPlanThreads) {
    const int64_t n = base + threadIdx.x;
    int64_t count = 0;
    if (n < s.N) {
      const int64_t len = s.cu(n + 1) - s.cu(n);
      if (len < 0) bad = 1;
      count = len > 0 ? (len + C - 1) / C : 0;
    }
    int64_t incl, total;
    Scan(tmp).InclusiveSum(count, incl, total);
    if (n < s.N) chunk_offsets[n + 1] = carry + incl;
    carry += total;
    __syncthreads();
    if (seg_offsets) {
      const int64_t segs = n < s.N ? (count > seg_chunks ? (count + seg_chunks - 1) / seg_chunks : 1) : 0;
      Scan(tmp).InclusiveSum(segs, incl, total);
      if (n < s.N) seg_offsets[n + 1] = seg_carry + incl;
      seg_carry += total;
      __syncthreads();
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
