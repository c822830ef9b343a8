// Problem description and validation: turns the C API's tensor descriptors into
// one checked `Problem` (sizes, dtypes, pointers) that every backend consumes.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashgdn/flashgdn.h"

namespace flashgdn {

constexpr int kHeadDim = 128;  // K = V = 128
constexpr int kChunk = 64;     // chunk length of the WY form
constexpr int kMaxDecodeTokens = 64;  // tokens per sequence of one decode call

// Raised for invalid arguments; the C API turns it into an error code + message.
struct Error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A recurrent state tensor as the caller gave it: [M, 128, 128] matrices (M = N * H_v or
// num_slots * H_v) in `dtype` (fp32, bf16, fp16) and `layout` (KV: S[k][v], VK: S[v][k]).
struct StateBuf {
  void* data = nullptr;
  flashgdn_dtype dtype = FLASHGDN_DTYPE_F32;
  flashgdn_state_layout layout = FLASHGDN_STATE_LAYOUT_KV;
  bool present() const { return data != nullptr; }
  // fp32 [K, V]: the form the chunked kernels read and write directly.
  bool native() const { return dtype == FLASHGDN_DTYPE_F32 && layout == FLASHGDN_STATE_LAYOUT_KV; }
  // Offset of element (k, v) inside one matrix.
  int64_t offset(int64_t k, int64_t v) const {
    return layout == FLASHGDN_STATE_LAYOUT_KV ? k * 128 + v : v * 128 + k;
  }
};

struct Problem {
  int64_t B = 0, T = 0;  // batch and padded length of the [B, T, ...] inputs
  int64_t TT = 0;        // B * T flattened tokens
  int64_t Hqk = 0, Hv = 0;
  int64_t N = 0;         // number of sequences
  float scale = 0.f;
  flashgdn_dtype qkv_dtype = FLASHGDN_DTYPE_BF16;
  flashgdn_dtype g_dtype = FLASHGDN_DTYPE_F32, beta_dtype = FLASHGDN_DTYPE_F32;
  flashgdn_dtype cu_dtype = FLASHGDN_DTYPE_I32;
  flashgdn_device device = FLASHGDN_DEVICE_CPU;
  int device_id = 0;
  const void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
  const float* h0 = nullptr;       // optional: fp32 [K, V] (set only when h0_io is native;
                                   // otherwise a backend converts h0_io into a buffer)
  StateBuf h0_io;                  // initial_state as given (absent: data == nullptr)
  flashgdn_state_layout state_layout = FLASHGDN_STATE_LAYOUT_KV;
  const void* cu_seqlens = nullptr;  // optional (varlen)
  int64_t max_seqlen = 0;            // varlen planning hint: the longest sequence (0: unknown)
  // varlen planning hint: each sequence's chunks from the caller's host copy of cu_seqlens
  // (cu_seqlens_host; empty: none). The device's choice of plan is then made on the host
  // (launch.cu state_pass_params); only the choice reads it
  std::vector<int64_t> host_chunks;
  bool keep_for_backward = false;    // forward: run the backward's recomputation, keep it

  bool varlen() const { return cu_seqlens != nullptr; }
  int64_t group() const { return Hv / Hqk; }
  // Upper bound on the number of 64-token chunks over all sequences (exact without varlen).
  int64_t max_chunks() const {
    return varlen() ? (TT + kChunk - 1) / kChunk + N : B * ((T + kChunk - 1) / kChunk);
  }
};

struct FwdOutputs {
  void* o = nullptr;
  float* final_state = nullptr;  // optional: fp32 [K, V] (set only when final_state_io is native)
  StateBuf final_state_io;       // final_state as given
};

struct BwdIO {
  const void* d_o = nullptr;
  const float* d_final_state = nullptr;  // optional: fp32 [K, V] (only when native)
  StateBuf d_final_state_io;             // dht as given
  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dg = nullptr, *dbeta = nullptr;
  float* dh0 = nullptr;  // optional: fp32 [K, V] (only when native)
  StateBuf dh0_io;       // dh0 as given
  const void* kept = nullptr;  // a keep_for_backward forward's workspace (read only), or null
  size_t kept_bytes = 0;
};

// Decode (flashgdn_decode): B sequences of T tokens each, states in a slot pool.
struct DecodeProblem {
  int64_t B = 0, T = 0, Hqk = 0, Hv = 0;
  int64_t num_slots = 0;
  float scale = 0.f;
  bool l2norm = false;
  flashgdn_dtype qkv_dtype = FLASHGDN_DTYPE_BF16;
  flashgdn_dtype g_dtype = FLASHGDN_DTYPE_F32, beta_dtype = FLASHGDN_DTYPE_F32;
  flashgdn_dtype idx_dtype = FLASHGDN_DTYPE_I32;
  flashgdn_device device = FLASHGDN_DEVICE_CPU;
  int device_id = 0;
  const void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
  const void* indices = nullptr;
  StateBuf pool;  // in/out: [num_slots, H_v, 128, 128] in pool.dtype and pool.layout
  void* o = nullptr;
  int64_t group() const { return Hv / Hqk; }
};

// Gate (flashgdn_gating_*): n = numel(a) positions, H value heads (last dim of a).
struct GatingProblem {
  int64_t n = 0, H = 0;
  flashgdn_device device = FLASHGDN_DEVICE_CPU;
  int device_id = 0;
  const void *a = nullptr, *A_log = nullptr, *dt_bias = nullptr, *b = nullptr;
  flashgdn_dtype a_dtype{}, A_dtype{}, dt_dtype{}, b_dtype{};
  // forward outputs / backward inputs and outputs (by dtype)
  void *g = nullptr, *beta = nullptr;
  flashgdn_dtype g_dtype{}, beta_dtype{};
  const void *dg = nullptr, *dbeta = nullptr;
  flashgdn_dtype dg_dtype{}, dbeta_dtype{};
  void *da = nullptr, *dA_log = nullptr, *ddt_bias = nullptr, *db = nullptr;
};

Problem validate_fwd(const flashgdn_fwd_args& a, FwdOutputs* out);
Problem validate_bwd(const flashgdn_bwd_args& a, BwdIO* io);
DecodeProblem validate_decode(const flashgdn_decode_args& a);
GatingProblem validate_gating_fwd(const flashgdn_gating_fwd_args& a);
GatingProblem validate_gating_bwd(const flashgdn_gating_bwd_args& a);

const char* dtype_name(flashgdn_dtype d);

}  // namespace flashgdn
