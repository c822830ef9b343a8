// Gate kernels of the CUDA backend (Qwen3-Next's GDN gate), forward and backward:
//   g = -exp(A_log[h]) * softplus(a + dt_bias[h]),  beta = sigmoid(b)
// for a, b of shape [..., H] (n elements, head h = i % H). The arithmetic is double
// precision (exact to the output's rounding even for large |a|, where a fast fp32 exp
// loses ~1e-6; the kernels are memory-bound either way). Launch code at the bottom.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../backends.h"
#include "launch_util.cuh"

namespace flashgdn {
namespace {

using namespace cuda_util;

struct GateParams {
  const void *a, *A_log, *dt_bias, *b;
  int a_dt, A_dt, dt_dt, b_dt;
  void *g, *beta;
  int g_dt, beta_dt;
  const void *dg, *dbeta;
  int dg_dt, dbeta_dt;
  void *da, *dA_log, *ddt_bias, *db;
  int64_t n, H, rows;
};

using F = double;

// softplus(x) = log(1 + e^x) = max(x, 0) + log1p(e^-|x|): no overflow for large x.
__device__ __forceinline__ F softplus(F x) { return fmax(x, 0.0) + log1p(exp(-fabs(x))); }

__device__ __forceinline__ F sigmoid(F x) { return 1.0 / (1.0 + exp(-x)); }

// gate_fwd_kernel: grid-stride over the n elements (any grid). Reads a, b, A_log,
// dt_bias; writes g, beta.
__global__ void __launch_bounds__(256) gate_fwd_kernel(GateParams p) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < p.n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = i % p.H;
    const F x = load_as<F>(p.a, p.a_dt, i) + load_as<F>(p.dt_bias, p.dt_dt, h);
    const F decay = exp(load_as<F>(p.A_log, p.A_dt, h));
    store_as<F>(p.g, p.g_dt, i, -decay * softplus(x));
    store_as<F>(p.beta, p.beta_dt, i, sigmoid(load_as<F>(p.b, p.b_dt, i)));
  }
}

constexpr int kHeadTile = 32;  // heads per block (threadIdx.x)
constexpr int kRowLanes = 8;   // rows in flight per block (threadIdx.y)

// gate_bwd_kernel: grid (ceil(H / 32), P), block 32 x 8. Block (hx, part) handles
// heads hx*32 + tx and rows part*8 + ty + k * (P*8) of the [rows, H] view. Writes
//   da = -dg exp(A_log) sigmoid(a + dt_bias),  db = dbeta beta (1 - beta)
// elementwise, and per block the partial sums over its rows of dg * g (-> dA_log)
// and of da (-> ddt_bias), reduced over ty in a fixed order, to
// partial[part][0 / 1][h] (double). Deterministic for a given P.
__global__ void __launch_bounds__(kHeadTile * kRowLanes) gate_bwd_kernel(GateParams p,
                                                                         double* partial) {
  __shared__ double red[2][kRowLanes][kHeadTile];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t h = int64_t(blockIdx.x) * kHeadTile + tx;
  const int64_t part = blockIdx.y, parts = gridDim.y;
  double sA = 0.0, sdt = 0.0;
  if (h < p.H) {
    const F bias = load_as<F>(p.dt_bias, p.dt_dt, h);
    const F decay = exp(load_as<F>(p.A_log, p.A_dt, h));
    for (int64_t r = part * kRowLanes + ty; r < p.rows; r += parts * kRowLanes) {
      const int64_t i = r * p.H + h;
      const F x = load_as<F>(p.a, p.a_dt, i) + bias;
      const F dg = load_as<F>(p.dg, p.dg_dt, i);
      const F da = -dg * decay * sigmoid(x);
      store_as<F>(p.da, p.a_dt, i, da);
      sA += -dg * decay * softplus(x);
      sdt += da;
      const F bt = sigmoid(load_as<F>(p.b, p.b_dt, i));
      store_as<F>(p.db, p.b_dt, i, load_as<F>(p.dbeta, p.dbeta_dt, i) * bt * (1.0 - bt));
    }
  }
  red[0][ty][tx] = sA;
  red[1][ty][tx] = sdt;
  __syncthreads();
  if (ty < 2 && h < p.H) {
    double s = 0.0;
    for (int y = 0; y < kRowLanes; ++y) s += red[ty][y][tx];
    partial[(part * 2 + ty) * p.H + h] = s;
  }
}

// gate_sum_kernel: one thread per head sums the P partials in order and writes dA_log
// and ddt_bias in their dtypes (zeros when P = 0, i.e. no elements).
__global__ void __launch_bounds__(128) gate_sum_kernel(GateParams p, const double* partial,
                                                      int64_t parts) {
  const int64_t h = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= p.H) return;
  double sA = 0.0, sdt = 0.0;
  for (int64_t part = 0; part < parts; ++part) {
    sA += partial[(part * 2 + 0) * p.H + h];
    sdt += partial[(part * 2 + 1) * p.H + h];
  }
  store_as<double>(p.dA_log, p.A_dt, h, sA);
  store_as<double>(p.ddt_bias, p.dt_dt, h, sdt);
}

GateParams gate_params(const GatingProblem& p) {
  GateParams g{};
  g.a = p.a;
  g.A_log = p.A_log;
  g.dt_bias = p.dt_bias;
  g.b = p.b;
  g.a_dt = p.a_dtype;
  g.A_dt = p.A_dtype;
  g.dt_dt = p.dt_dtype;
  g.b_dt = p.b_dtype;
  g.g = p.g;
  g.beta = p.beta;
  g.g_dt = p.g_dtype;
  g.beta_dt = p.beta_dtype;
  g.dg = p.dg;
  g.dbeta = p.dbeta;
  g.dg_dt = p.dg_dtype;
  g.dbeta_dt = p.dbeta_dtype;
  g.da = p.da;
  g.dA_log = p.dA_log;
  g.ddt_bias = p.ddt_bias;
  g.db = p.db;
  g.n = p.n;
  g.H = p.H;
  g.rows = p.H > 0 ? p.n / p.H : 0;
  return g;
}

// Row parts of the backward: about 64 rows per thread row (8 per block step), at most
// 1024 parts; a function of the shape only, so the sums are reproducible.
int64_t bwd_parts(const GatingProblem& p) {
  if (p.n == 0 || p.H == 0) return 0;
  const int64_t rows = p.n / p.H;
  return std::min<int64_t>(1024, (rows + kRowLanes * 64 - 1) / (kRowLanes * 64));
}

}  // namespace

void cuda_gating_fwd(const GatingProblem& p, void* stream) {
  if (p.n == 0) return;
  DeviceGuard guard(p.device_id);
  const GateParams gp = gate_params(p);
  const int64_t blocks = std::min<int64_t>((p.n + 255) / 256, 8LL * sm_count(p.device_id));
  auto st = static_cast<cudaStream_t>(stream);
  gate_fwd_kernel<<<static_cast<unsigned>(blocks), 256, 0, st>>>(gp);
  check_cuda(cudaGetLastError(), "gate_fwd_kernel launch");
}

size_t cuda_gating_bwd_workspace_bytes(const GatingProblem& p) {
  return static_cast<size_t>(bwd_parts(p) * 2 * p.H) * sizeof(double);
}

void cuda_gating_bwd(const GatingProblem& p, void* workspace, void* stream) {
  if (p.H == 0) return;
  DeviceGuard guard(p.device_id);
  const GateParams gp = gate_params(p);
  auto st = static_cast<cudaStream_t>(stream);
  auto* partial = static_cast<double*>(workspace);
  const int64_t parts = bwd_parts(p);
  if (parts > 0) {
    const dim3 grid(static_cast<unsigned>((p.H + kHeadTile - 1) / kHeadTile),
                    static_cast<unsigned>(parts));
    const dim3 block(kHeadTile, kRowLanes);
    gate_bwd_kernel<<<grid, block, 0, st>>>(gp, partial);
    check_cuda(cudaGetLastError(), "gate_bwd_kernel launch");
  }
  gate_sum_kernel<<<static_cast<unsigned>((p.H + 127) / 128), 128, 0, st>>>(gp, partial, parts);
  check_cuda(cudaGetLastError(), "gate_sum_kernel launch");
}

}  // namespace flashgdn
