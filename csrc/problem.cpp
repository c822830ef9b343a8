// Validation of every argument of the forward and backward calls. Each failure
// throws flashgdn::Error with a message that names the argument and what was
// expected. cu_seqlens values are checked here only when they live on the host;
// on the GPU they are checked by the planner kernel (no host-device sync).
#include "problem.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace flashgdn {

const char* dtype_name(flashgdn_dtype d) {
  switch (d) {
    case FLASHGDN_DTYPE_F32: return "float32";
    case FLASHGDN_DTYPE_F16: return "float16";
    case FLASHGDN_DTYPE_BF16: return "bfloat16";
    case FLASHGDN_DTYPE_I32: return "int32";
    case FLASHGDN_DTYPE_I64: return "int64";
    case FLASHGDN_DTYPE_F64: return "float64";
    default: return "unsupported dtype";
  }
}

namespace {

// Shapes are formatted with std::to_string only: iostreams inside an extension
// module can crash when the host process carries another libstdc++ locale setup
// (seen with torch on the device machine).
std::string join_dims(const int64_t* dims, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string shape_str(const flashgdn_tensor& t) { return join_dims(t.shape, t.ndim); }

std::string shape_str(std::initializer_list<int64_t> dims) {
  return join_dims(dims.begin(), static_cast<int>(dims.size()));
}

[[noreturn]] void fail(const std::string& msg) { throw Error(msg); }

bool present(const flashgdn_tensor& t) { return t.data != nullptr; }

void require_present(const flashgdn_tensor& t, const char* name) {
  if (!present(t)) fail(std::string(name) + " is required but was not given");
}

void check_contiguous(const flashgdn_tensor& t, const char* name) {
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] == 0) return;  // no elements: any strides (e.g. expanded) are fine
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected)
      fail(std::string(name) + " must be contiguous (row-major); got shape " + shape_str(t) +
           " with a non-contiguous stride in dim " + std::to_string(i));
    expected *= t.shape[i];
  }
}

void check_shape(const flashgdn_tensor& t, const char* name, std::initializer_list<int64_t> dims,
                 const char* meaning) {
  bool ok = t.ndim == static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) {
    if (!ok) break;
    ok = t.shape[i++] == d;
  }
  if (!ok)
    fail(std::string(name) + " must have shape " + shape_str(dims) + " " + meaning + ", got " +
         shape_str(t));
}

// The tensor every other one must share a device with: q, or a for the gate.
const char* device_ref(const Problem&) { return "q"; }
const char* device_ref(const DecodeProblem&) { return "q"; }
const char* device_ref(const GatingProblem&) { return "a"; }

template <typename P>
void check_device(const flashgdn_tensor& t, const char* name, const P& p) {
  if (t.device != p.device || (t.device == FLASHGDN_DEVICE_CUDA && t.device_id != p.device_id))
    fail(std::string(name) + " must be on the same device as " + device_ref(p) + " (" +
         (p.device == FLASHGDN_DEVICE_CPU ? std::string("cpu")
                                          : "cuda:" + std::to_string(p.device_id)) +
         ")");
}

void check_dtype_in(const flashgdn_tensor& t, const char* name,
                    std::initializer_list<flashgdn_dtype> allowed) {
  for (auto d : allowed)
    if (t.dtype == d) return;
  std::string list;
  for (auto d : allowed) list += std::string(list.empty() ? "" : " or ") + dtype_name(d);
  fail(std::string(name) + " must have dtype " + list + ", got " + dtype_name(t.dtype));
}

// Like `ref` in shape and dtype (outputs and gradients that mirror an input).
template <typename P>
void check_like(const flashgdn_tensor& t, const char* name, const flashgdn_tensor& ref,
                const char* ref_name, const P& p) {
  require_present(t, name);
  bool same = t.ndim == ref.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.shape[i] == ref.shape[i];
  if (!same)
    fail(std::string(name) + " must have the shape of " + ref_name + " " + shape_str(ref) +
         ", got " + shape_str(t));
  if (t.dtype != ref.dtype)
    fail(std::string(name) + " must have the dtype of " + ref_name + " (" + dtype_name(ref.dtype) +
         "), got " + dtype_name(t.dtype));
  check_device(t, name, p);
  check_contiguous(t, name);
}

// The CUDA kernels read q, k, v and do rows with 16-byte loads.
void check_aligned(const flashgdn_tensor& t, const char* name, const Problem& p) {
  if (p.device == FLASHGDN_DEVICE_CUDA && reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    fail(std::string(name) +
         " must start at a 16-byte aligned address on CUDA (a view with an odd storage "
         "offset was given; pass a copy)");
}

const char* layout_name(flashgdn_state_layout l) {
  return l == FLASHGDN_STATE_LAYOUT_VK ? "vk" : "kv";
}

flashgdn_state_layout check_layout(int32_t v) {
  if (v != FLASHGDN_STATE_LAYOUT_KV && v != FLASHGDN_STATE_LAYOUT_VK)
    fail("state_layout must be FLASHGDN_STATE_LAYOUT_KV (0, 'kv': [.., K, V]) or "
         "FLASHGDN_STATE_LAYOUT_VK (1, 'vk': [.., V, K]), got " + std::to_string(v));
  return static_cast<flashgdn_state_layout>(v);
}

// Shape meaning of a state tensor in the given layout, for error messages.
std::string state_dims(const char* lead, flashgdn_state_layout l) {
  return std::string("(") + lead +
         (l == FLASHGDN_STATE_LAYOUT_VK ? ", H_v, V, K; state_layout 'vk')"
                                        : ", H_v, K, V; state_layout 'kv')");
}

const auto kStateDtypes = {FLASHGDN_DTYPE_F32, FLASHGDN_DTYPE_BF16, FLASHGDN_DTYPE_F16};

StateBuf check_state(const flashgdn_tensor& t, const char* name, const Problem& p) {
  check_dtype_in(t, name, kStateDtypes);
  check_shape(t, name, {p.N, p.Hv, kHeadDim, kHeadDim},
              state_dims("N sequences", p.state_layout).c_str());
  check_device(t, name, p);
  check_contiguous(t, name);
  StateBuf s;
  s.data = t.data;
  s.dtype = t.dtype;
  s.layout = p.state_layout;
  return s;
}

template <typename I>
void check_cu_values(const I* cu, int64_t n1, int64_t total, const std::string& name = "cu_seqlens") {
  if (cu[0] != 0) fail(name + "[0] must be 0, got " + std::to_string(cu[0]));
  for (int64_t i = 1; i < n1; ++i)
    if (cu[i] < cu[i - 1])
      fail(name + " must be non-decreasing; " + name + "[" + std::to_string(i) + "] = " +
           std::to_string(cu[i]) + " < " + name + "[" + std::to_string(i - 1) + "] = " +
           std::to_string(cu[i - 1]));
  if (cu[n1 - 1] != total)
    fail(name + "[-1] must equal the number of tokens T = " + std::to_string(total) + ", got " +
         std::to_string(cu[n1 - 1]));
}

// Checks the inputs shared by forward and backward and fills the Problem.
Problem validate_inputs(const flashgdn_tensor& q, const flashgdn_tensor& k,
                        const flashgdn_tensor& v, const flashgdn_tensor& g,
                        const flashgdn_tensor& beta, const flashgdn_tensor& h0,
                        const flashgdn_tensor& cu, float scale, int32_t state_layout) {
  Problem p;
  p.state_layout = check_layout(state_layout);
  require_present(q, "q");
  require_present(k, "k");
  require_present(v, "v");
  require_present(g, "g");
  require_present(beta, "beta");
  if (q.device != FLASHGDN_DEVICE_CPU && q.device != FLASHGDN_DEVICE_CUDA)
    fail("q must be on a CPU or CUDA device");
  p.device = q.device;
  p.device_id = q.device_id;
#ifndef FLASHGDN_WITH_CUDA
  if (p.device == FLASHGDN_DEVICE_CUDA)
    fail("q is a CUDA tensor but this flashgdn build has no CUDA backend (built without nvcc)");
#endif
  if (q.ndim != 4)
    fail("q must be 4-D [B, T, H_qk, K], got " + std::to_string(q.ndim) + "-D " + shape_str(q));
  check_dtype_in(q, "q", {FLASHGDN_DTYPE_BF16, FLASHGDN_DTYPE_F16});
  p.B = q.shape[0];
  p.T = q.shape[1];
  p.Hqk = q.shape[2];
  p.TT = p.B * p.T;
  p.qkv_dtype = q.dtype;
  if (q.shape[3] != kHeadDim)
    fail("q.shape[-1] (head dim K) must be 128, got " + std::to_string(q.shape[3]));
  if (p.Hqk < 1) fail("q must have at least one head (H_qk >= 1)");
  check_contiguous(q, "q");
  check_like(k, "k", q, "q", p);
  if (v.ndim != 4)
    fail("v must be 4-D [B, T, H_v, V], got " + std::to_string(v.ndim) + "-D " + shape_str(v));
  if (v.shape[3] != kHeadDim)
    fail("v.shape[-1] (head dim V) must be 128, got " + std::to_string(v.shape[3]));
  p.Hv = v.shape[2];
  check_shape(v, "v", {p.B, p.T, p.Hv, kHeadDim}, "(B, T, H_v, V) with B, T of q");
  if (v.dtype != q.dtype)
    fail(std::string("v must have the dtype of q (") + dtype_name(q.dtype) + "), got " +
         dtype_name(v.dtype));
  check_device(v, "v", p);
  check_contiguous(v, "v");
  if (p.Hv < 1 || p.Hv % p.Hqk != 0)
    fail("the number of value heads H_v = " + std::to_string(p.Hv) +
         " must be a positive multiple of the number of q/k heads H_qk = " +
         std::to_string(p.Hqk));
  const auto gate_dtypes = {FLASHGDN_DTYPE_F32, FLASHGDN_DTYPE_BF16, FLASHGDN_DTYPE_F16};
  check_dtype_in(g, "g", gate_dtypes);
  check_shape(g, "g", {p.B, p.T, p.Hv}, "(B, T, H_v)");
  check_device(g, "g", p);
  check_contiguous(g, "g");
  check_dtype_in(beta, "beta", gate_dtypes);
  check_shape(beta, "beta", {p.B, p.T, p.Hv}, "(B, T, H_v)");
  check_device(beta, "beta", p);
  check_contiguous(beta, "beta");
  p.g = g.data;
  p.beta = beta.data;
  p.g_dtype = g.dtype;
  p.beta_dtype = beta.dtype;
  check_aligned(q, "q", p);
  check_aligned(k, "k", p);
  check_aligned(v, "v", p);
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;

  if (present(cu)) {
    if (cu.ndim != 1 || cu.shape[0] < 2)
      fail("cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape " + shape_str(cu));
    check_dtype_in(cu, "cu_seqlens", {FLASHGDN_DTYPE_I32, FLASHGDN_DTYPE_I64});
    check_device(cu, "cu_seqlens", p);
    check_contiguous(cu, "cu_seqlens");
    if (p.B != 1)
      fail("with cu_seqlens the batch size must be 1 (packed sequences), got B = " +
           std::to_string(p.B));
    if (cu.dtype == FLASHGDN_DTYPE_I32 && p.TT > INT32_MAX)
      fail("cu_seqlens is int32 but T exceeds the int32 range; pass int64");
    p.N = cu.shape[0] - 1;
    p.cu_seqlens = cu.data;
    p.cu_dtype = cu.dtype;
    if (p.device == FLASHGDN_DEVICE_CPU) {
      if (cu.dtype == FLASHGDN_DTYPE_I32)
        check_cu_values(static_cast<const int32_t*>(cu.data), cu.shape[0], p.TT);
      else
        check_cu_values(static_cast<const int64_t*>(cu.data), cu.shape[0], p.TT);
    }
  } else {
    p.N = p.B;
  }
  if (present(h0)) {
    p.h0_io = check_state(h0, "initial_state", p);
    if (p.h0_io.native()) p.h0 = static_cast<const float*>(h0.data);
  }
  if (!std::isfinite(scale)) fail("scale must be finite");
  p.scale = scale > 0.f ? scale : 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  return p;
}

}  // namespace

// The optional max_seqlen hint (packed sequences): >= 0; kept only with cu_seqlens.
static void set_max_seqlen(Problem& p, int64_t max_seqlen) {
  if (max_seqlen < 0)
    fail("max_seqlen must be >= 0 (the longest sequence in tokens, 0 = unknown), got " +
         std::to_string(max_seqlen));
  p.max_seqlen = p.varlen() ? max_seqlen : 0;
}

// The optional host copy of cu_seqlens (packed sequences): checked as cu_seqlens is, on the
// host; each sequence's chunks into p.host_chunks, and the max_seqlen hint from it where the
// caller gave none.
static void set_host_lengths(Problem& p, const flashgdn_tensor& cu) {
  if (!present(cu)) return;
  const std::string name = "cu_seqlens_host";
  if (!p.varlen())
    fail(name + " is the host copy of cu_seqlens; pass cu_seqlens too");
  if (cu.device != FLASHGDN_DEVICE_CPU) fail(name + " must be in host memory (device CPU)");
  check_dtype_in(cu, name.c_str(), {FLASHGDN_DTYPE_I32, FLASHGDN_DTYPE_I64});
  if (cu.ndim != 1 || cu.shape[0] != p.N + 1)
    fail(name + " must have the shape of cu_seqlens (" + std::to_string(p.N + 1) + ",), got " +
         shape_str(cu));
  check_contiguous(cu, name.c_str());
  std::vector<int64_t> v(static_cast<size_t>(p.N + 1));
  for (int64_t i = 0; i <= p.N; ++i)
    v[i] = cu.dtype == FLASHGDN_DTYPE_I32 ? static_cast<const int32_t*>(cu.data)[i]
                                          : static_cast<const int64_t*>(cu.data)[i];
  check_cu_values(v.data(), p.N + 1, p.TT, name);
  p.host_chunks.resize(static_cast<size_t>(p.N));
  int64_t longest = 0;
  for (int64_t i = 0; i < p.N; ++i) {
    const int64_t len = v[i + 1] - v[i];
    p.host_chunks[i] = (len + kChunk - 1) / kChunk;
    longest = std::max(longest, len);
  }
  if (p.max_seqlen == 0) p.max_seqlen = longest;
}

Problem validate_fwd(const flashgdn_fwd_args& a, FwdOutputs* out) {
  Problem p = validate_inputs(a.q, a.k, a.v, a.g, a.beta, a.initial_state, a.cu_seqlens, a.scale,
                              a.state_layout);
  set_max_seqlen(p, a.max_seqlen);
  set_host_lengths(p, a.cu_seqlens_host);
  check_like(a.o, "o", a.v, "v", p);
  out->o = a.o.data;
  p.keep_for_backward = a.keep_for_backward != 0;
  if (present(a.final_state)) {
    out->final_state_io = check_state(a.final_state, "final_state", p);
    if (out->final_state_io.native()) out->final_state = static_cast<float*>(a.final_state.data);
  }
  return p;
}

Problem validate_bwd(const flashgdn_bwd_args& a, BwdIO* io) {
  Problem p = validate_inputs(a.q, a.k, a.v, a.g, a.beta, a.initial_state, a.cu_seqlens, a.scale,
                              a.state_layout);
  set_max_seqlen(p, a.max_seqlen);
  set_host_lengths(p, a.cu_seqlens_host);
  check_like(a.d_o, "do", a.v, "v (do is the gradient of o)", p);
  check_aligned(a.d_o, "do", p);
  io->d_o = a.d_o.data;
  io->kept = a.kept_workspace;
  io->kept_bytes = a.kept_workspace_bytes;
  if (present(a.d_final_state)) {
    io->d_final_state_io = check_state(a.d_final_state, "dht", p);
    if (io->d_final_state_io.native())
      io->d_final_state = static_cast<const float*>(a.d_final_state.data);
  }
  check_like(a.dq, "dq", a.q, "q", p);
  check_like(a.dk, "dk", a.k, "k", p);
  check_like(a.dv, "dv", a.v, "v", p);
  check_like(a.dg, "dg", a.g, "g", p);
  check_like(a.dbeta, "dbeta", a.beta, "beta", p);
  io->dq = a.dq.data;
  io->dk = a.dk.data;
  io->dv = a.dv.data;
  io->dg = a.dg.data;
  io->dbeta = a.dbeta.data;
  if (present(a.dh0)) {
    io->dh0_io = check_state(a.dh0, "dh0", p);
    if (io->dh0_io.native()) io->dh0 = static_cast<float*>(a.dh0.data);
  }
  return p;
}

// ------------------------------------------------------------------------------ decode

namespace {

template <typename I>
void check_slot_values(const I* idx, int64_t B, int64_t num_slots) {
  std::vector<int64_t> seen;  // slots in use, sorted at the end
  seen.reserve(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = static_cast<int64_t>(idx[b]);
    if (s < 0) continue;
    if (s >= num_slots)
      fail("state_indices[" + std::to_string(b) + "] = " + std::to_string(s) +
           " is out of range for a state_pool of " + std::to_string(num_slots) +
           " slots (negative slots skip a sequence)");
    seen.push_back(s);
  }
  std::sort(seen.begin(), seen.end());
  for (size_t i = 1; i < seen.size(); ++i)
    if (seen[i] == seen[i - 1])
      fail("state_indices uses slot " + std::to_string(seen[i]) +
           " for more than one sequence (each non-negative slot may appear once)");
}

}  // namespace

DecodeProblem validate_decode(const flashgdn_decode_args& a) {
  const flashgdn_tensor none{};
  const Problem c =
      validate_inputs(a.q, a.k, a.v, a.g, a.beta, none, none, a.scale, a.state_layout);
  DecodeProblem p;
  p.B = c.B;
  p.T = c.T;
  p.Hqk = c.Hqk;
  p.Hv = c.Hv;
  p.scale = c.scale;
  p.l2norm = a.use_qk_l2norm != 0;
  p.qkv_dtype = c.qkv_dtype;
  p.g_dtype = c.g_dtype;
  p.beta_dtype = c.beta_dtype;
  p.device = c.device;
  p.device_id = c.device_id;
  p.q = c.q;
  p.k = c.k;
  p.v = c.v;
  p.g = c.g;
  p.beta = c.beta;
  if (p.T < 1 || p.T > kMaxDecodeTokens)
    fail("q.shape[1] (tokens per sequence T) must be between 1 and " +
         std::to_string(kMaxDecodeTokens) + " for decode, got " + std::to_string(p.T) +
         " (use chunk_gated_delta_rule for longer sequences)");

  const flashgdn_tensor& pool = a.state_pool;
  const flashgdn_state_layout layout = c.state_layout;
  const char* dims = layout == FLASHGDN_STATE_LAYOUT_VK ? "[num_slots, H_v, V, K]"
                                                        : "[num_slots, H_v, K, V]";
  require_present(pool, "state_pool");
  check_dtype_in(pool, "state_pool", kStateDtypes);
  if (pool.ndim != 4)
    fail(std::string("state_pool must be 4-D ") + dims + " (state_layout '" +
         layout_name(layout) + "'), got " + std::to_string(pool.ndim) + "-D " + shape_str(pool));
  check_shape(pool, "state_pool", {pool.shape[0], p.Hv, kHeadDim, kHeadDim},
              (state_dims("num_slots", layout) + " with H_v of v").c_str());
  check_device(pool, "state_pool", p);
  check_contiguous(pool, "state_pool");
  if (p.device == FLASHGDN_DEVICE_CUDA && reinterpret_cast<uintptr_t>(pool.data) % 16 != 0)
    fail("state_pool must start at a 16-byte aligned address on CUDA (a view with an odd "
         "storage offset was given; pass a copy)");
  p.num_slots = pool.shape[0];
  p.pool.data = pool.data;
  p.pool.dtype = pool.dtype;
  p.pool.layout = layout;

  const flashgdn_tensor& idx = a.state_indices;
  require_present(idx, "state_indices");
  check_dtype_in(idx, "state_indices", {FLASHGDN_DTYPE_I32, FLASHGDN_DTYPE_I64});
  check_shape(idx, "state_indices", {p.B}, "(B, one slot per sequence)");
  check_device(idx, "state_indices", p);
  check_contiguous(idx, "state_indices");
  p.indices = idx.data;
  p.idx_dtype = idx.dtype;

  check_like(a.o, "o", a.v, "v", p);
  p.o = a.o.data;

  if (p.device == FLASHGDN_DEVICE_CPU) {
    if (p.idx_dtype == FLASHGDN_DTYPE_I32)
      check_slot_values(static_cast<const int32_t*>(p.indices), p.B, p.num_slots);
    else
      check_slot_values(static_cast<const int64_t*>(p.indices), p.B, p.num_slots);
  }
  return p;
}

// ------------------------------------------------------------------------------ gating

namespace {

const auto kGateDtypes = {FLASHGDN_DTYPE_F32, FLASHGDN_DTYPE_BF16, FLASHGDN_DTYPE_F16,
                          FLASHGDN_DTYPE_F64};

// A gate tensor: given dtype set, the shape of `ref`, device of a, contiguous.
void check_gate_like(const flashgdn_tensor& t, const char* name, const flashgdn_tensor& ref,
                     const char* ref_name, const GatingProblem& p) {
  require_present(t, name);
  check_dtype_in(t, name, kGateDtypes);
  bool same = t.ndim == ref.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.shape[i] == ref.shape[i];
  if (!same)
    fail(std::string(name) + " must have the shape of " + ref_name + " " + shape_str(ref) +
         ", got " + shape_str(t));
  check_device(t, name, p);
  check_contiguous(t, name);
}

GatingProblem validate_gating_inputs(const flashgdn_tensor& a, const flashgdn_tensor& A_log,
                                     const flashgdn_tensor& dt_bias, const flashgdn_tensor& b) {
  GatingProblem p;
  require_present(a, "a");
  if (a.device != FLASHGDN_DEVICE_CPU && a.device != FLASHGDN_DEVICE_CUDA)
    fail("a must be on a CPU or CUDA device");
  p.device = a.device;
  p.device_id = a.device_id;
#ifndef FLASHGDN_WITH_CUDA
  if (p.device == FLASHGDN_DEVICE_CUDA)
    fail("a is a CUDA tensor but this flashgdn build has no CUDA backend (built without nvcc)");
#endif
  check_dtype_in(a, "a", kGateDtypes);
  if (a.ndim < 1)
    fail("a must have at least one dimension [..., H_v], got a 0-D tensor");
  check_contiguous(a, "a");
  p.H = a.shape[a.ndim - 1];
  p.n = 1;
  for (int i = 0; i < a.ndim; ++i) p.n *= a.shape[i];
  require_present(A_log, "A_log");
  check_dtype_in(A_log, "A_log", kGateDtypes);
  check_shape(A_log, "A_log", {p.H}, "(H_v, the last dim of a)");
  check_device(A_log, "A_log", p);
  check_contiguous(A_log, "A_log");
  require_present(dt_bias, "dt_bias");
  check_dtype_in(dt_bias, "dt_bias", kGateDtypes);
  check_shape(dt_bias, "dt_bias", {p.H}, "(H_v, the last dim of a)");
  check_device(dt_bias, "dt_bias", p);
  check_contiguous(dt_bias, "dt_bias");
  check_gate_like(b, "b", a, "a", p);
  p.a = a.data;
  p.A_log = A_log.data;
  p.dt_bias = dt_bias.data;
  p.b = b.data;
  p.a_dtype = a.dtype;
  p.A_dtype = A_log.dtype;
  p.dt_dtype = dt_bias.dtype;
  p.b_dtype = b.dtype;
  return p;
}

}  // namespace

GatingProblem validate_gating_fwd(const flashgdn_gating_fwd_args& a) {
  GatingProblem p = validate_gating_inputs(a.a, a.A_log, a.dt_bias, a.b);
  check_gate_like(a.g, "g", a.a, "a", p);
  check_gate_like(a.beta, "beta", a.a, "a", p);
  p.g = a.g.data;
  p.beta = a.beta.data;
  p.g_dtype = a.g.dtype;
  p.beta_dtype = a.beta.dtype;
  return p;
}

GatingProblem validate_gating_bwd(const flashgdn_gating_bwd_args& a) {
  GatingProblem p = validate_gating_inputs(a.a, a.A_log, a.dt_bias, a.b);
  check_gate_like(a.dg, "dg", a.a, "a", p);
  check_gate_like(a.dbeta, "dbeta", a.a, "a", p);
  check_like(a.da, "da", a.a, "a", p);
  check_like(a.dA_log, "dA_log", a.A_log, "A_log", p);
  check_like(a.ddt_bias, "ddt_bias", a.dt_bias, "dt_bias", p);
  check_like(a.db, "db", a.b, "b", p);
  p.dg = a.dg.data;
  p.dbeta = a.dbeta.data;
  p.dg_dtype = a.dg.dtype;
  p.dbeta_dtype = a.dbeta.dtype;
  p.da = a.da.data;
  p.dA_log = a.dA_log.data;
  p.ddt_bias = a.ddt_bias.data;
  p.db = a.db.data;
  return p;
}

}  // namespace flashgdn
