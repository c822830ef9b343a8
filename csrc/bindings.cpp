// Python bindings (nanobind, module flashgdn._C): DLPack arrays in, C API calls out.
// No dependency on torch: any framework whose tensors export DLPack works. Outputs
// and the CUDA workspace are allocated by the caller (the Python layer), so calls
// are allocation-free, asynchronous and CUDA-graph capturable.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>

#include "flashgdn/flashgdn.h"

namespace nb = nanobind;
using OptArray = std::optional<nb::ndarray<>>;

namespace {

flashgdn_dtype to_dtype(nb::dlpack::dtype t) {
  using code = nb::dlpack::dtype_code;
  if (t.lanes != 1) return FLASHGDN_DTYPE_OTHER;
  if (t.code == static_cast<uint8_t>(code::Float) && t.bits == 32) return FLASHGDN_DTYPE_F32;
  if (t.code == static_cast<uint8_t>(code::Float) && t.bits == 16) return FLASHGDN_DTYPE_F16;
  if (t.code == static_cast<uint8_t>(code::Float) && t.bits == 64) return FLASHGDN_DTYPE_F64;
  if (t.code == static_cast<uint8_t>(code::Bfloat) && t.bits == 16) return FLASHGDN_DTYPE_BF16;
  if (t.code == static_cast<uint8_t>(code::Int) && t.bits == 32) return FLASHGDN_DTYPE_I32;
  if (t.code == static_cast<uint8_t>(code::Int) && t.bits == 64) return FLASHGDN_DTYPE_I64;
  return FLASHGDN_DTYPE_OTHER;
}

flashgdn_tensor to_tensor(const OptArray& a, const char* name) {
  flashgdn_tensor t{};
  if (!a) return t;
  if (a->ndim() > FLASHGDN_MAX_DIMS)
    throw nb::value_error((std::string(name) + " has too many dimensions (" +
                           std::to_string(a->ndim()) + ")")
                              .c_str());
  t.data = a->data();
  t.dtype = to_dtype(a->dtype());
  const int dev = a->device_type();
  t.device = dev == nb::device::cpu::value    ? FLASHGDN_DEVICE_CPU
             : dev == nb::device::cuda::value ? FLASHGDN_DEVICE_CUDA
                                              : FLASHGDN_DEVICE_OTHER;
  t.device_id = a->device_id();
  t.ndim = static_cast<int32_t>(a->ndim());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = a->shape(i);
    t.strides[i] = a->stride(i);
  }
  // A zero-element tensor may carry a null pointer; keep it "present".
  if (t.data == nullptr) t.data = reinterpret_cast<void*>(uintptr_t{16});
  return t;
}

void check(int rc) {
  if (rc != 0) throw nb::value_error(flashgdn_last_error());
}

flashgdn_fwd_args fwd_args(const OptArray& q, const OptArray& k, const OptArray& v,
                           const OptArray& g, const OptArray& beta, const OptArray& h0,
                           const OptArray& cu, float scale, const OptArray& o,
                           const OptArray& ht, int32_t state_layout, int64_t max_seqlen) {
  flashgdn_fwd_args a{};
  a.state_layout = state_layout;
  a.max_seqlen = max_seqlen;
  a.q = to_tensor(q, "q");
  a.k = to_tensor(k, "k");
  a.v = to_tensor(v, "v");
  a.g = to_tensor(g, "g");
  a.beta = to_tensor(beta, "beta");
  a.initial_state = to_tensor(h0, "initial_state");
  a.cu_seqlens = to_tensor(cu, "cu_seqlens");
  a.scale = scale;
  a.o = to_tensor(o, "o");
  a.final_state = to_tensor(ht, "final_state");
  return a;
}

flashgdn_bwd_args bwd_args(const OptArray& q, const OptArray& k, const OptArray& v,
                           const OptArray& g, const OptArray& beta, const OptArray& h0,
                           const OptArray& cu, float scale, const OptArray& d_o,
                           const OptArray& dht, const OptArray& dq, const OptArray& dk,
                           const OptArray& dv, const OptArray& dg, const OptArray& dbeta,
                           const OptArray& dh0, int32_t state_layout, int64_t max_seqlen) {
  flashgdn_bwd_args a{};
  a.state_layout = state_layout;
  a.max_seqlen = max_seqlen;
  a.q = to_tensor(q, "q");
  a.k = to_tensor(k, "k");
  a.v = to_tensor(v, "v");
  a.g = to_tensor(g, "g");
  a.beta = to_tensor(beta, "beta");
  a.initial_state = to_tensor(h0, "initial_state");
  a.cu_seqlens = to_tensor(cu, "cu_seqlens");
  a.scale = scale;
  a.d_o = to_tensor(d_o, "do");
  a.d_final_state = to_tensor(dht, "dht");
  a.dq = to_tensor(dq, "dq");
  a.dk = to_tensor(dk, "dk");
  a.dv = to_tensor(dv, "dv");
  a.dg = to_tensor(dg, "dg");
  a.dbeta = to_tensor(dbeta, "dbeta");
  a.dh0 = to_tensor(dh0, "dh0");
  return a;
}

flashgdn_gating_bwd_args gating_bwd_args(const OptArray& a, const OptArray& A_log,
                                         const OptArray& dt_bias, const OptArray& b,
                                         const OptArray& dg, const OptArray& dbeta,
                                         const OptArray& da, const OptArray& dA_log,
                                         const OptArray& ddt_bias, const OptArray& db) {
  flashgdn_gating_bwd_args r{};
  r.a = to_tensor(a, "a");
  r.A_log = to_tensor(A_log, "A_log");
  r.dt_bias = to_tensor(dt_bias, "dt_bias");
  r.b = to_tensor(b, "b");
  r.dg = to_tensor(dg, "dg");
  r.dbeta = to_tensor(dbeta, "dbeta");
  r.da = to_tensor(da, "da");
  r.dA_log = to_tensor(dA_log, "dA_log");
  r.ddt_bias = to_tensor(ddt_bias, "ddt_bias");
  r.db = to_tensor(db, "db");
  return r;
}

template <typename Args>
void set_workspace(Args& a, const OptArray& ws, uintptr_t stream) {
  if (ws) {
    a.workspace = ws->data();
    a.workspace_bytes = ws->nbytes();
  }
  a.stream = reinterpret_cast<void*>(stream);
}

// The workspace of a call given none: alloc(bytes) for the bytes `size` (the C API's
// *_workspace_size) says, set in `a`; returned (None where no bytes are needed or no alloc).
// One crossing instead of two: the workspace-size call converted every array again.
template <typename Args>
nb::object alloc_workspace(Args& a, const OptArray& ws, const std::optional<nb::callable>& alloc,
                           int (*size)(const Args*, size_t*)) {
  if (ws || !alloc) return nb::none();
  size_t bytes = 0;
  check(size(&a, &bytes));
  if (bytes == 0) return nb::none();
  nb::object w = (*alloc)(bytes);
  const auto arr = nb::cast<nb::ndarray<>>(w);
  if (arr.nbytes() < bytes)
    throw nb::value_error("alloc returned a workspace smaller than the bytes it was asked for");
  a.workspace = arr.data();
  a.workspace_bytes = arr.nbytes();
  return w;
}

// A keep_for_backward forward's workspace for the backward (flashgdn_bwd_args::kept_workspace).
void set_kept(flashgdn_bwd_args& a, const OptArray& kept) {
  if (kept && kept->nbytes() > 0) {
    a.kept_workspace = kept->data();
    a.kept_workspace_bytes = kept->nbytes();
  }
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() =
      "flashgdn native core: chunked Gated DeltaNet forward/backward, decode over a state "
      "pool, fused gate (CPU and CUDA)";
  m.def("version", [] { return std::string(flashgdn_version()); });
  m.def("has_cuda", [] {
#ifdef FLASHGDN_WITH_CUDA
    return true;
#else
    return false;
#endif
  });

  auto none = [](const char* n) { return nb::arg(n).none(); };

  m.def(
      "fwd_workspace_size",
      [](OptArray q, OptArray k, OptArray v, OptArray g, OptArray beta, OptArray h0, OptArray cu,
         float scale, OptArray o, OptArray ht, int32_t state_layout, int64_t max_seqlen,
         bool keep_for_backward, OptArray cu_host) {
        auto a = fwd_args(q, k, v, g, beta, h0, cu, scale, o, ht, state_layout, max_seqlen);
        a.keep_for_backward = keep_for_backward ? 1 : 0;
        a.cu_seqlens_host = to_tensor(cu_host, "cu_seqlens_host");
        size_t bytes = 0;
        check(flashgdn_fwd_workspace_size(&a, &bytes));
        return bytes;
      },
      none("q"), none("k"), none("v"), none("g"), none("beta"), none("initial_state"),
      none("cu_seqlens"), nb::arg("scale"), none("o"), none("final_state"),
      nb::arg("state_layout") = 0, nb::arg("max_seqlen") = 0, nb::arg("keep_for_backward") = false,
      none("cu_seqlens_host") = nb::none(),
      "Bytes of workspace the forward needs (0 on the CPU). Validates the arguments.");

  m.def(
      "fwd",
      [](OptArray q, OptArray k, OptArray v, OptArray g, OptArray beta, OptArray h0, OptArray cu,
         float scale, OptArray o, OptArray ht, OptArray ws, uintptr_t stream,
         int32_t state_layout, int64_t max_seqlen, bool keep_for_backward, OptArray cu_host,
         std::optional<nb::callable> alloc) {
        auto a = fwd_args(q, k, v, g, beta, h0, cu, scale, o, ht, state_layout, max_seqlen);
        a.keep_for_backward = keep_for_backward ? 1 : 0;
        a.cu_seqlens_host = to_tensor(cu_host, "cu_seqlens_host");
        set_workspace(a, ws, stream);
        nb::object made = alloc_workspace(a, ws, alloc, flashgdn_fwd_workspace_size);
        check(flashgdn_fwd(&a));
        return made;
      },
      none("q"), none("k"), none("v"), none("g"), none("beta"), none("initial_state"),
      none("cu_seqlens"), nb::arg("scale"), none("o"), none("final_state"), none("workspace"),
      nb::arg("stream") = 0, nb::arg("state_layout") = 0, nb::arg("max_seqlen") = 0,
      nb::arg("keep_for_backward") = false, none("cu_seqlens_host") = nb::none(),
      none("alloc") = nb::none(),
      "Chunked GDN forward into preallocated o (and final_state); asynchronous on CUDA.\n"
      "keep_for_backward: leave the backward's recomputation in the workspace (bwd's\n"
      "kept_workspace). Without a workspace, alloc(nbytes) (a callable returning a DLPack\n"
      "array of at least nbytes bytes) makes the one fwd_workspace_size asks for; it is\n"
      "returned (None where none is needed).");

  m.def(
      "bwd_workspace_size",
      [](OptArray q, OptArray k, OptArray v, OptArray g, OptArray beta, OptArray h0, OptArray cu,
         float scale, OptArray d_o, OptArray dht, OptArray dq, OptArray dk, OptArray dv,
         OptArray dg, OptArray dbeta, OptArray dh0, int32_t state_layout, int64_t max_seqlen,
         OptArray kept, OptArray cu_host) {
        auto a = bwd_args(q, k, v, g, beta, h0, cu, scale, d_o, dht, dq, dk, dv, dg, dbeta, dh0,
                          state_layout, max_seqlen);
        set_kept(a, kept);
        a.cu_seqlens_host = to_tensor(cu_host, "cu_seqlens_host");
        size_t bytes = 0;
        check(flashgdn_bwd_workspace_size(&a, &bytes));
        return bytes;
      },
      none("q"), none("k"), none("v"), none("g"), none("beta"), none("initial_state"),
      none("cu_seqlens"), nb::arg("scale"), none("do"), none("dht"), none("dq"), none("dk"),
      none("dv"), none("dg"), none("dbeta"), none("dh0"), nb::arg("state_layout") = 0,
      nb::arg("max_seqlen") = 0, none("kept_workspace") = nb::none(),
      none("cu_seqlens_host") = nb::none(),
      "Bytes of workspace the backward needs (0 on the CPU); with kept_workspace, its own\n"
      "part next to a keep_for_backward forward's workspace. Validates the arguments.");

  m.def(
      "bwd",
      [](OptArray q, OptArray k, OptArray v, OptArray g, OptArray beta, OptArray h0, OptArray cu,
         float scale, OptArray d_o, OptArray dht, OptArray dq, OptArray dk, OptArray dv,
         OptArray dg, OptArray dbeta, OptArray dh0, OptArray ws, uintptr_t stream,
         int32_t state_layout, int64_t max_seqlen, OptArray kept, OptArray cu_host,
         std::optional<nb::callable> alloc) {
        auto a = bwd_args(q, k, v, g, beta, h0, cu, scale, d_o, dht, dq, dk, dv, dg, dbeta, dh0,
                          state_layout, max_seqlen);
        set_kept(a, kept);
        a.cu_seqlens_host = to_tensor(cu_host, "cu_seqlens_host");
        set_workspace(a, ws, stream);
        nb::object made = alloc_workspace(a, ws, alloc, flashgdn_bwd_workspace_size);
        check(flashgdn_bwd(&a));
        return made;
      },
      none("q"), none("k"), none("v"), none("g"), none("beta"), none("initial_state"),
      none("cu_seqlens"), nb::arg("scale"), none("do"), none("dht"), none("dq"), none("dk"),
      none("dv"), none("dg"), none("dbeta"), none("dh0"), none("workspace"),
      nb::arg("stream") = 0, nb::arg("state_layout") = 0, nb::arg("max_seqlen") = 0,
      none("kept_workspace") = nb::none(), none("cu_seqlens_host") = nb::none(),
      none("alloc") = nb::none(),
      "Chunked GDN backward into preallocated gradients; asynchronous on CUDA.\n"
      "kept_workspace: the workspace of a keep_for_backward forward of the same inputs\n"
      "(read only); workspace then needs bwd_workspace_size(..., kept_workspace=...) bytes.\n"
      "Without a workspace, alloc(nbytes) makes it (as fwd's alloc) and it is returned.");

  m.def(
      "decode",
      [](OptArray q, OptArray k, OptArray v, OptArray g, OptArray beta, OptArray state_pool,
         OptArray state_indices, float scale, bool use_qk_l2norm, OptArray o, uintptr_t stream,
         int32_t state_layout) {
        flashgdn_decode_args a{};
        a.state_layout = state_layout;
        a.q = to_tensor(q, "q");
        a.k = to_tensor(k, "k");
        a.v = to_tensor(v, "v");
        a.g = to_tensor(g, "g");
        a.beta = to_tensor(beta, "beta");
        a.state_pool = to_tensor(state_pool, "state_pool");
        a.state_indices = to_tensor(state_indices, "state_indices");
        a.scale = scale;
        a.use_qk_l2norm = use_qk_l2norm ? 1 : 0;
        a.o = to_tensor(o, "o");
        a.stream = reinterpret_cast<void*>(stream);
        check(flashgdn_decode(&a));
      },
      none("q"), none("k"), none("v"), none("g"), none("beta"), none("state_pool"),
      none("state_indices"), nb::arg("scale"), nb::arg("use_qk_l2norm"), none("o"),
      nb::arg("stream") = 0, nb::arg("state_layout") = 0,
      "Recurrent GDN step for T <= 64 tokens per sequence into preallocated o, updating the "
      "state_pool slots given by state_indices in place; asynchronous on CUDA.");

  m.def(
      "gating_fwd",
      [](OptArray a, OptArray A_log, OptArray dt_bias, OptArray b, OptArray g, OptArray beta,
         uintptr_t stream) {
        flashgdn_gating_fwd_args r{};
        r.a = to_tensor(a, "a");
        r.A_log = to_tensor(A_log, "A_log");
        r.dt_bias = to_tensor(dt_bias, "dt_bias");
        r.b = to_tensor(b, "b");
        r.g = to_tensor(g, "g");
        r.beta = to_tensor(beta, "beta");
        r.stream = reinterpret_cast<void*>(stream);
        check(flashgdn_gating_fwd(&r));
      },
      none("a"), none("A_log"), none("dt_bias"), none("b"), none("g"), none("beta"),
      nb::arg("stream") = 0,
      "g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) into preallocated g, beta.");

  m.def(
      "gating_bwd_workspace_size",
      [](OptArray a, OptArray A_log, OptArray dt_bias, OptArray b, OptArray dg, OptArray dbeta,
         OptArray da, OptArray dA_log, OptArray ddt_bias, OptArray db) {
        auto r = gating_bwd_args(a, A_log, dt_bias, b, dg, dbeta, da, dA_log, ddt_bias, db);
        size_t bytes = 0;
        check(flashgdn_gating_bwd_workspace_size(&r, &bytes));
        return bytes;
      },
      none("a"), none("A_log"), none("dt_bias"), none("b"), none("dg"), none("dbeta"),
      none("da"), none("dA_log"), none("ddt_bias"), none("db"),
      "Bytes of workspace the gate backward needs (0 on the CPU). Validates the arguments.");

  m.def(
      "gating_bwd",
      [](OptArray a, OptArray A_log, OptArray dt_bias, OptArray b, OptArray dg, OptArray dbeta,
         OptArray da, OptArray dA_log, OptArray ddt_bias, OptArray db, OptArray ws,
         uintptr_t stream) {
        auto r = gating_bwd_args(a, A_log, dt_bias, b, dg, dbeta, da, dA_log, ddt_bias, db);
        set_workspace(r, ws, stream);
        check(flashgdn_gating_bwd(&r));
      },
      none("a"), none("A_log"), none("dt_bias"), none("b"), none("dg"), none("dbeta"),
      none("da"), none("dA_log"), none("ddt_bias"), none("db"), none("workspace"),
      nb::arg("stream") = 0,
      "Gate backward into preallocated da, dA_log, ddt_bias, db; asynchronous on CUDA.");
}
