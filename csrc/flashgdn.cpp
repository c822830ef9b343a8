// C API (include/flashgdn/flashgdn.h): validates each call, then dispatches to the
// CPU or CUDA backend. Exceptions never cross the C boundary: they become a
// non-zero return code and a thread-local message.
#include "flashgdn/flashgdn.h"

#include <exception>
#include <string>

#include "backends.h"

namespace {

thread_local std::string g_last_error;

template <typename F>
int guarded(F&& f) {
  try {
    f();
    g_last_error.clear();
    return 0;
  } catch (const std::exception& e) {
    g_last_error = e.what();
  } catch (...) {
    g_last_error = "unknown error";
  }
  return 1;
}

void check_workspace(size_t need, size_t have, const void* ptr) {
  if (need > 0 && (ptr == nullptr || have < need))
    throw flashgdn::Error("workspace must be at least " + std::to_string(need) +
                          " bytes (see *_workspace_size), got " + std::to_string(have) +
                          (ptr ? "" : " (null pointer)"));
}

}  // namespace

extern "C" {

int flashgdn_fwd_workspace_size(const flashgdn_fwd_args* args, size_t* bytes) {
  return guarded([&] {
    flashgdn::FwdOutputs out;
    const auto p = flashgdn::validate_fwd(*args, &out);
    *bytes = 0;
#ifdef FLASHGDN_WITH_CUDA
    if (p.device == FLASHGDN_DEVICE_CUDA) *bytes = flashgdn::cuda_fwd_total_workspace_bytes(p, out);
#endif
    (void)p;
  });
}

int flashgdn_fwd(const flashgdn_fwd_args* args) {
  return guarded([&] {
    flashgdn::FwdOutputs out;
    const auto p = flashgdn::validate_fwd(*args, &out);
    if (p.device == FLASHGDN_DEVICE_CPU) return flashgdn::cpu_fwd(p, out);
#ifdef FLASHGDN_WITH_CUDA
    check_workspace(flashgdn::cuda_fwd_total_workspace_bytes(p, out), args->workspace_bytes,
                    args->workspace);
    flashgdn::cuda_fwd_states(p, out, args->workspace, args->stream);
#endif
  });
}

int flashgdn_bwd_workspace_size(const flashgdn_bwd_args* args, size_t* bytes) {
  return guarded([&] {
    flashgdn::BwdIO io;
    const auto p = flashgdn::validate_bwd(*args, &io);
    *bytes = 0;
#ifdef FLASHGDN_WITH_CUDA
    if (p.device == FLASHGDN_DEVICE_CUDA) *bytes = flashgdn::cuda_bwd_total_workspace_bytes(p, io);
#endif
    (void)p;
  });
}

int flashgdn_bwd(const flashgdn_bwd_args* args) {
  return guarded([&] {
    flashgdn::BwdIO io;
    const auto p = flashgdn::validate_bwd(*args, &io);
    if (p.device == FLASHGDN_DEVICE_CPU) return flashgdn::cpu_bwd(p, io);
#ifdef FLASHGDN_WITH_CUDA
    check_workspace(flashgdn::cuda_bwd_total_workspace_bytes(p, io), args->workspace_bytes,
                    args->workspace);
    if (io.kept != nullptr && io.kept_bytes < flashgdn::cuda_kept_workspace_bytes(p))
      throw flashgdn::Error("kept_workspace must be at least " +
                            std::to_string(flashgdn::cuda_kept_workspace_bytes(p)) +
                            " bytes (the workspace of a keep_for_backward forward of these "
                            "inputs), got " + std::to_string(io.kept_bytes));
    flashgdn::cuda_bwd_states(p, io, args->workspace, args->stream);
#endif
  });
}

int flashgdn_decode(const flashgdn_decode_args* args) {
  return guarded([&] {
    const auto p = flashgdn::validate_decode(*args);
    if (p.B == 0) return;
    if (p.device == FLASHGDN_DEVICE_CPU) return flashgdn::cpu_decode(p);
#ifdef FLASHGDN_WITH_CUDA
    flashgdn::cuda_decode(p, args->stream);
#endif
  });
}

int flashgdn_gating_fwd(const flashgdn_gating_fwd_args* args) {
  return guarded([&] {
    const auto p = flashgdn::validate_gating_fwd(*args);
    if (p.n == 0) return;
    if (p.device == FLASHGDN_DEVICE_CPU) return flashgdn::cpu_gating_fwd(p);
#ifdef FLASHGDN_WITH_CUDA
    flashgdn::cuda_gating_fwd(p, args->stream);
#endif
  });
}

int flashgdn_gating_bwd_workspace_size(const flashgdn_gating_bwd_args* args, size_t* bytes) {
  return guarded([&] {
    const auto p = flashgdn::validate_gating_bwd(*args);
    *bytes = 0;
#ifdef FLASHGDN_WITH_CUDA
    if (p.device == FLASHGDN_DEVICE_CUDA) *bytes = flashgdn::cuda_gating_bwd_workspace_bytes(p);
#endif
    (void)p;
  });
}

int flashgdn_gating_bwd(const flashgdn_gating_bwd_args* args) {
  return guarded([&] {
    const auto p = flashgdn::validate_gating_bwd(*args);
    if (p.device == FLASHGDN_DEVICE_CPU) return flashgdn::cpu_gating_bwd(p);
#ifdef FLASHGDN_WITH_CUDA
    check_workspace(flashgdn::cuda_gating_bwd_workspace_bytes(p), args->workspace_bytes,
                    args->workspace);
    flashgdn::cuda_gating_bwd(p, args->workspace, args->stream);
#endif
  });
}

const char* flashgdn_last_error(void) { return g_last_error.c_str(); }

const char* flashgdn_version(void) { return FLASHGDN_VERSION; }

}  // extern "C"
