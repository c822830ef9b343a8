// Small host and device helpers of the decode (decode.cu) and gate (gate.cu) kernels:
// CUDA error checks, a device guard, the cached SM count, and element loads/stores
// by runtime dtype (the flashgdn_dtype codes of the C API). Self-contained on purpose:
// the chunked kernels keep their own helpers (common.cuh, launch.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../problem.h"

namespace flashgdn {
namespace cuda_util {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}

// Makes `device` current for the scope of a call.
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

// Streaming multiprocessors of `device`, queried once (no stream work: capture-safe).
inline int sm_count(int device) {
  static int cache[64] = {};
  if (device >= 0 && device < 64 && cache[device] > 0) return cache[device];
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  if (device >= 0 && device < 64) cache[device] = sms;
  return sms;
}

// Element loads and stores by flashgdn_dtype code, computed in F (float or double).
template <typename F>
__device__ __forceinline__ F load_as(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case FLASHGDN_DTYPE_F32: return static_cast<F>(static_cast<const float*>(p)[i]);
    case FLASHGDN_DTYPE_F64: return static_cast<F>(static_cast<const double*>(p)[i]);
    case FLASHGDN_DTYPE_BF16:
      return static_cast<F>(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]));
    default: return static_cast<F>(__half2float(static_cast<const __half*>(p)[i]));
  }
}

template <typename F>
__device__ __forceinline__ void store_as(void* p, int dtype, int64_t i, F x) {
  switch (dtype) {
    case FLASHGDN_DTYPE_F32: static_cast<float*>(p)[i] = static_cast<float>(x); break;
    case FLASHGDN_DTYPE_F64: static_cast<double*>(p)[i] = static_cast<double>(x); break;
    case FLASHGDN_DTYPE_BF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(static_cast<float>(x));
      break;
    default: static_cast<__half*>(p)[i] = __float2half(static_cast<float>(x)); break;
  }
}

}  // namespace cuda_util
}  // namespace flashgdn
