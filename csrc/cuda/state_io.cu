// State boundary of the chunked CUDA path. The forward and backward kernels
// (launch.cu, fwd_kernels.cuh, bwd_kernels.cuh) read and write states as fp32 [K, V]
// matrices. A caller may keep its states in bf16 or fp16 and/or in the VK layout
// ([.., V, K], the transpose); such states pass through fp32 [K, V] buffers that sit
// in the caller's workspace right after the kernels' own part:
//
//   workspace = [ kernels' workspace (cuda_{fwd,bwd}_workspace_bytes) | h0 | ht or dht | dh0 ]
//
// where only the states that need a conversion get a buffer. h0 and dht are converted
// in before the kernels run; ht and dh0 are converted out after them. Everything is
// enqueued on the caller's stream (no host sync, no allocation: CUDA-graph capturable).
// fp32 [K, V] states go straight to the kernels, exactly as before.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../backends.h"
#include "launch_util.cuh"

namespace flashgdn {
namespace {

using namespace cuda_util;

constexpr int D = kHeadDim;                            // 128 x 128 matrices
constexpr int kTile = 32;                              // square tiles of 32 x 32
constexpr int kTilesPerMatrix = (D / kTile) * (D / kTile);  // 16
constexpr int kRowsPerPass = 8;                        // block of 32 x 8 threads

__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T narrow(float x);
template <> __device__ __forceinline__ float narrow(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 narrow(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half narrow(float x) { return __float2half(x); }

// One 32 x 32 tile (blockIdx.x % 16) of matrix blockIdx.x / 16: element (r, c) of `src`
// goes to (r, c) of `dst`, or to (c, r) when Transpose (through shared memory, so that
// both the reads and the writes are whole 128-byte rows of a warp).
template <typename In, typename Out, bool Transpose>
__device__ __forceinline__ void copy_tile(const In* __restrict__ src, Out* __restrict__ dst) {
  __shared__ float tile[kTile][kTile + 1];  // +1: no bank conflicts on the transposed read
  const int64_t m = blockIdx.x / kTilesPerMatrix;
  const int t = blockIdx.x % kTilesPerMatrix;
  const int r0 = (t / (D / kTile)) * kTile, c0 = (t % (D / kTile)) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  src += m * D * D;
  dst += m * D * D;
  if constexpr (!Transpose) {
    for (int y = ty; y < kTile; y += kRowsPerPass) {
      const int i = (r0 + y) * D + c0 + tx;
      dst[i] = narrow<Out>(widen(src[i]));
    }
  } else {
    for (int y = ty; y < kTile; y += kRowsPerPass) tile[y][tx] = widen(src[(r0 + y) * D + c0 + tx]);
    __syncthreads();
    for (int y = ty; y < kTile; y += kRowsPerPass)
      dst[(c0 + y) * D + r0 + tx] = narrow<Out>(tile[tx][y]);
  }
}

// state_load_kernel<In, VK>: a caller's state -> fp32 [K, V] buffer for the kernels.
// Grid: M * 16 blocks (M = N * H_v matrices, 16 tiles each) of 32 x 8 threads.
// Reads src [M, 128, 128] of In (fp32/bf16/fp16) in [K, V] or, with VK, [V, K];
// writes dst [M, 128, 128] fp32 [K, V] (exact: widening and transposing only).
template <typename In, bool VK>
__global__ void __launch_bounds__(kTile * kRowsPerPass)
    state_load_kernel(const In* __restrict__ src, float* __restrict__ dst) {
  copy_tile<In, float, VK>(src, dst);
}

// state_store_kernel<Out, VK>: the kernels' fp32 [K, V] result -> a caller's state.
// Grid: M * 16 blocks of 32 x 8 threads. Reads src [M, 128, 128] fp32 [K, V]; writes
// dst [M, 128, 128] of Out, in [K, V] or, with VK, [V, K] (rounded to nearest even).
template <typename Out, bool VK>
__global__ void __launch_bounds__(kTile * kRowsPerPass)
    state_store_kernel(const float* __restrict__ src, Out* __restrict__ dst) {
  copy_tile<float, Out, VK>(src, dst);
}

dim3 tile_grid(int64_t mats) {
  const int64_t blocks = mats * kTilesPerMatrix;
  if (blocks > INT_MAX) throw Error("state conversion: too many states (N x H_v) for one launch");
  return dim3(static_cast<unsigned>(blocks));
}

template <typename In, bool VK>
void launch_load(const void* src, float* dst, int64_t mats, cudaStream_t st) {
  state_load_kernel<In, VK><<<tile_grid(mats), dim3(kTile, kRowsPerPass), 0, st>>>(
      static_cast<const In*>(src), dst);
  check_cuda(cudaGetLastError(), "state_load_kernel launch");
}

template <typename Out, bool VK>
void launch_store(const float* src, void* dst, int64_t mats, cudaStream_t st) {
  state_store_kernel<Out, VK><<<tile_grid(mats), dim3(kTile, kRowsPerPass), 0, st>>>(
      src, static_cast<Out*>(dst));
  check_cuda(cudaGetLastError(), "state_store_kernel launch");
}

// `mats` matrices of `s` -> fp32 [K, V] at dst.
void load_to_f32_kv(const StateBuf& s, float* dst, int64_t mats, cudaStream_t st) {
  if (mats == 0) return;
  const bool vk = s.layout == FLASHGDN_STATE_LAYOUT_VK;
  switch (s.dtype) {
    case FLASHGDN_DTYPE_F32:
      return vk ? launch_load<float, true>(s.data, dst, mats, st)
                : launch_load<float, false>(s.data, dst, mats, st);
    case FLASHGDN_DTYPE_BF16:
      return vk ? launch_load<__nv_bfloat16, true>(s.data, dst, mats, st)
                : launch_load<__nv_bfloat16, false>(s.data, dst, mats, st);
    default:
      return vk ? launch_load<__half, true>(s.data, dst, mats, st)
                : launch_load<__half, false>(s.data, dst, mats, st);
  }
}

// fp32 [K, V] at src -> `mats` matrices of `s`.
void store_from_f32_kv(const float* src, const StateBuf& s, int64_t mats, cudaStream_t st) {
  if (mats == 0) return;
  const bool vk = s.layout == FLASHGDN_STATE_LAYOUT_VK;
  switch (s.dtype) {
    case FLASHGDN_DTYPE_F32:
      return vk ? launch_store<float, true>(src, s.data, mats, st)
                : launch_store<float, false>(src, s.data, mats, st);
    case FLASHGDN_DTYPE_BF16:
      return vk ? launch_store<__nv_bfloat16, true>(src, s.data, mats, st)
                : launch_store<__nv_bfloat16, false>(src, s.data, mats, st);
    default:
      return vk ? launch_store<__half, true>(src, s.data, mats, st)
                : launch_store<__half, false>(src, s.data, mats, st);
  }
}

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

bool staged(const StateBuf& s) { return s.present() && !s.native(); }

size_t state_buffer_bytes(const Problem& p) {
  return align_up(static_cast<size_t>(p.N * p.Hv) * D * D * sizeof(float));
}

// The Problem the kernels see: h0 is the fp32 [K, V] pointer (`h0_kv`, or a stand-in
// when only sizing, so that a size that depends on h0 being present stays right).
Problem kernel_problem(const Problem& p, const float* h0_kv) {
  Problem k = p;
  if (p.h0_io.present()) k.h0 = h0_kv;
  return k;
}

const float* sizing_stand_in(const Problem& p) {
  return p.h0 ? p.h0 : static_cast<const float*>(p.h0_io.data);
}

// Hands out the state buffers after the kernels' part of the workspace.
struct StateCarver {
  char* next;
  size_t bytes;
  float* take() {
    float* b = reinterpret_cast<float*>(next);
    next += bytes;
    return b;
  }
};

}  // namespace

size_t cuda_fwd_total_workspace_bytes(const Problem& p, const FwdOutputs& out) {
  size_t n = align_up(cuda_fwd_workspace_bytes(kernel_problem(p, sizing_stand_in(p))));
  n += (staged(p.h0_io) + staged(out.final_state_io)) * state_buffer_bytes(p);
  return n;
}

size_t cuda_bwd_total_workspace_bytes(const Problem& p, const BwdIO& io) {
  size_t n = align_up(
      cuda_bwd_workspace_bytes(kernel_problem(p, sizing_stand_in(p)), io.kept != nullptr));
  n += (staged(p.h0_io) + staged(io.d_final_state_io) + staged(io.dh0_io)) * state_buffer_bytes(p);
  return n;
}

namespace {

// A state input the kernels read as fp32 [K, V]: converted into the next staging buffer when
// it comes in another dtype or layout, else `native` (the pointer the kernels use as is).
const float* stage_in(const StateBuf& s, const float* native, StateCarver& c, int64_t mats,
                      cudaStream_t st) {
  if (!staged(s)) return native;
  float* buf = c.take();
  load_to_f32_kv(s, buf, mats, st);
  return buf;
}

}  // namespace

size_t cuda_kept_workspace_bytes(const Problem& p) {
  Problem k = kernel_problem(p, sizing_stand_in(p));
  k.keep_for_backward = true;
  return cuda_fwd_workspace_bytes(k);
}

void cuda_fwd_states(const Problem& p, const FwdOutputs& out, void* workspace, void* stream) {
  DeviceGuard guard(p.device_id);
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t mats = p.N * p.Hv;
  const size_t inner = align_up(cuda_fwd_workspace_bytes(kernel_problem(p, sizing_stand_in(p))));
  StateCarver c{static_cast<char*>(workspace) + inner, state_buffer_bytes(p)};

  const float* h0 = stage_in(p.h0_io, p.h0, c, mats, st);
  FwdOutputs o = out;
  if (staged(out.final_state_io)) o.final_state = c.take();

  cuda_fwd(kernel_problem(p, h0), o, workspace, stream);

  if (staged(out.final_state_io)) store_from_f32_kv(o.final_state, out.final_state_io, mats, st);
}

void cuda_bwd_states(const Problem& p, const BwdIO& io, void* workspace, void* stream) {
  DeviceGuard guard(p.device_id);
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t mats = p.N * p.Hv;
  const size_t inner = align_up(
      cuda_bwd_workspace_bytes(kernel_problem(p, sizing_stand_in(p)), io.kept != nullptr));
  StateCarver c{static_cast<char*>(workspace) + inner, state_buffer_bytes(p)};

  const float* h0 = stage_in(p.h0_io, p.h0, c, mats, st);
  BwdIO k = io;
  k.d_final_state = stage_in(io.d_final_state_io, io.d_final_state, c, mats, st);
  if (staged(io.dh0_io)) k.dh0 = c.take();

  cuda_bwd(kernel_problem(p, h0), k, workspace, stream);

  if (staged(io.dh0_io)) store_from_f32_kv(k.dh0, io.dh0_io, mats, st);
}

}  // namespace flashgdn
