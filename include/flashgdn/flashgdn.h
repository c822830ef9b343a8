/*
 * flashgdn C API: chunked Gated DeltaNet (GDN) forward and backward.
 *
 * For C/C++ callers (inference engines) that hold raw device or host pointers.
 * Every tensor is described by a flashgdn_tensor (pointer, dtype, device, shape,
 * strides in elements); a tensor whose data is NULL is "absent" (optional ones).
 *
 * Shapes (K = V = 128):
 *   q, k        [B, T, H_qk, K]   bf16 or fp16
 *   v           [B, T, H_v,  V]   same dtype as q
 *   g, beta     [B, T, H_v]       fp32, bf16 or fp16 (g is the log-decay, <= 0)
 *   initial_state / final_state   [N, H_v, K, V] fp32
 *   cu_seqlens  [N + 1] int32 or int64 (varlen: B must be 1), same device as q
 *   o           [B, T, H_v, V]    same dtype as v
 * Without cu_seqlens, N = B and each batch row is one sequence.
 *
 * Calls are asynchronous on CUDA (enqueued on `stream`, a cudaStream_t) and never
 * synchronise with the host. CUDA calls need a caller-provided workspace of the
 * size the *_workspace_size function returns (CPU calls ignore it).
 * Return value: 0 on success, non-zero on error; flashgdn_last_error() then
 * returns a message naming the argument and what was expected (thread-local).
 */
#ifndef FLASHGDN_FLASHGDN_H
#define FLASHGDN_FLASHGDN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  FLASHGDN_DTYPE_F32 = 0,
  FLASHGDN_DTYPE_F16 = 1,
  FLASHGDN_DTYPE_BF16 = 2,
  FLASHGDN_DTYPE_I32 = 3,
  FLASHGDN_DTYPE_I64 = 4,
  FLASHGDN_DTYPE_OTHER = 99
} flashgdn_dtype;

typedef enum {
  FLASHGDN_DEVICE_CPU = 0,
  FLASHGDN_DEVICE_CUDA = 1,
  FLASHGDN_DEVICE_OTHER = 99
} flashgdn_device;

#define FLASHGDN_MAX_DIMS 4

typedef struct {
  void* data;             /* NULL: absent */
  flashgdn_dtype dtype;
  flashgdn_device device;
  int32_t device_id;
  int32_t ndim;
  int64_t shape[FLASHGDN_MAX_DIMS];
  int64_t strides[FLASHGDN_MAX_DIMS]; /* in elements */
} flashgdn_tensor;

typedef struct {
  flashgdn_tensor q, k, v, g, beta;
  flashgdn_tensor initial_state; /* optional */
  flashgdn_tensor cu_seqlens;    /* optional */
  float scale;                   /* <= 0: use K^-0.5 */
  flashgdn_tensor o;             /* output */
  flashgdn_tensor final_state;   /* optional output */
  void* workspace;
  size_t workspace_bytes;
  void* stream;                  /* cudaStream_t, NULL = default stream */
} flashgdn_fwd_args;

typedef struct {
  flashgdn_tensor q, k, v, g, beta;
  flashgdn_tensor initial_state; /* optional */
  flashgdn_tensor cu_seqlens;    /* optional */
  float scale;
  flashgdn_tensor d_o;           /* gradient of o, like o */
  flashgdn_tensor d_final_state; /* optional gradient of the final state */
  flashgdn_tensor dq, dk, dv, dg, dbeta; /* outputs, like their inputs */
  flashgdn_tensor dh0;           /* optional output, like initial_state (fp32) */
  void* workspace;
  size_t workspace_bytes;
  void* stream;
} flashgdn_bwd_args;

int flashgdn_fwd_workspace_size(const flashgdn_fwd_args* args, size_t* bytes);
int flashgdn_fwd(const flashgdn_fwd_args* args);
int flashgdn_bwd_workspace_size(const flashgdn_bwd_args* args, size_t* bytes);
int flashgdn_bwd(const flashgdn_bwd_args* args);
const char* flashgdn_last_error(void);
const char* flashgdn_version(void);

#ifdef __cplusplus
}
#endif
#endif /* FLASHGDN_FLASHGDN_H */
