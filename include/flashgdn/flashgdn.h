/*
 * flashgdn C API: chunked Gated DeltaNet (GDN) forward and backward, the fused
 * recurrent decode step over a state pool, and the fused gate (gdn_gating).
 *
 * For C/C++ callers (inference engines) that hold raw device or host pointers.
 * Every tensor is described by a flashgdn_tensor (pointer, dtype, device, shape,
 * strides in elements); a tensor whose data is NULL is "absent" (optional ones).
 *
 * Shapes (K = V = 128):
 *   q, k        [B, T, H_qk, K]   bf16 or fp16
 *   v           [B, T, H_v,  V]   same dtype as q
 *   g, beta     [B, T, H_v]       fp32, bf16 or fp16 (g is the log-decay, <= 0)
 *   initial_state / final_state   [N, H_v, K, V] (state_layout KV, the default) or
 *                                 [N, H_v, V, K] (state_layout VK); fp32, bf16 or fp16,
 *                                 each its own dtype (see "State layout and dtype" below)
 *   cu_seqlens  [N + 1] int32 or int64 (varlen: B must be 1), same device as q
 *   o           [B, T, H_v, V]    same dtype as v
 * Without cu_seqlens, N = B and each batch row is one sequence.
 * max_seqlen (packed sequences, optional): the longest sequence in tokens, as the caller
 * knows it without reading cu_seqlens from the device. The context-parallel planner then
 * plans for it instead of the worst case (one sequence holding every token), e.g. no split
 * at all for many short sequences. Only the choice of plan reads it: every plan is valid
 * for any lengths, so a wrong value costs speed, never correctness. 0 = unknown.
 * cu_seqlens_host (packed sequences, optional): the host copy of cu_seqlens, checked like
 * it (0 first, non-decreasing, T last). The planner then makes on the host the choice it
 * otherwise makes on the device from cu_seqlens (segment length, column block, schedule),
 * with no planning kernel beside the others, and takes max_seqlen from it when that is 0.
 * Like max_seqlen it only steers the choice: a copy that differs from cu_seqlens costs
 * speed, never correctness (the kernels read cu_seqlens).
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
  FLASHGDN_DTYPE_F64 = 5, /* only flashgdn_gating_* accept it */
  FLASHGDN_DTYPE_OTHER = 99
} flashgdn_dtype;

typedef enum {
  FLASHGDN_DEVICE_CPU = 0,
  FLASHGDN_DEVICE_CUDA = 1,
  FLASHGDN_DEVICE_OTHER = 99
} flashgdn_device;

/*
 * State layout and dtype. Every recurrent state (initial_state, final_state,
 * d_final_state, dh0, state_pool) is a stack of 128 x 128 matrices. The layout says
 * which index is the row:
 *   FLASHGDN_STATE_LAYOUT_KV (0, default): [.., K, V], S[k][v] (FLA, FlashQLA, transformers)
 *   FLASHGDN_STATE_LAYOUT_VK (1):          [.., V, K], the transpose (vLLM/SGLang pools)
 * Since K = V = 128 both have the same shape; the layout is a convention the caller
 * declares in the args' state_layout field. Each state tensor's dtype comes from its
 * descriptor: fp32 (default), bf16 or fp16. The math is fp32 either way: a 16-bit state
 * is widened on load and rounded once on store (once per call for the decode pool).
 * A zero-initialised args struct means KV, and fp32 tensors behave exactly as before.
 */
typedef enum {
  FLASHGDN_STATE_LAYOUT_KV = 0,
  FLASHGDN_STATE_LAYOUT_VK = 1
} flashgdn_state_layout;

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
  int32_t state_layout;          /* flashgdn_state_layout of initial_state, final_state */
  int64_t max_seqlen;            /* optional planning hint with cu_seqlens: the longest
                                    sequence in tokens, 0 = unknown (see below) */
  int32_t keep_for_backward;     /* != 0: leave in the workspace what the backward would
                                    recompute (see "Keeping the forward" below) */
  flashgdn_tensor cu_seqlens_host; /* optional planning hint with cu_seqlens: its host copy
                                      [N + 1] int32 or int64 (see below) */
} flashgdn_fwd_args;

typedef struct {
  flashgdn_tensor q, k, v, g, beta;
  flashgdn_tensor initial_state; /* optional */
  flashgdn_tensor cu_seqlens;    /* optional */
  float scale;
  flashgdn_tensor d_o;           /* gradient of o, like o */
  flashgdn_tensor d_final_state; /* optional gradient of the final state */
  flashgdn_tensor dq, dk, dv, dg, dbeta; /* outputs, like their inputs */
  flashgdn_tensor dh0;           /* optional output, shape of initial_state; any state dtype */
  void* workspace;
  size_t workspace_bytes;
  void* stream;
  int32_t state_layout;          /* flashgdn_state_layout of initial_state, d_final_state, dh0 */
  int64_t max_seqlen;            /* optional planning hint, as in flashgdn_fwd_args */
  const void* kept_workspace;    /* optional: the workspace of a keep_for_backward forward of
                                    these inputs (read only): no recomputation, and
                                    `workspace` needs only the backward's own part */
  size_t kept_workspace_bytes;
  flashgdn_tensor cu_seqlens_host; /* optional planning hint, as in flashgdn_fwd_args */
} flashgdn_bwd_args;

/*
 * Keeping the forward (training, CUDA; ignored on the CPU). The backward needs the state
 * entering every chunk, which it normally recomputes (a second run of the forward's
 * pass). With keep_for_backward != 0 the forward runs that recomputation itself, writing o
 * and final_state as usual and leaving its records in the workspace; the
 * flashgdn_fwd_workspace_size for it is larger (about 3x q, k and v together). Keep that
 * workspace unchanged and hand it to flashgdn_bwd as kept_workspace, with the same q, k,
 * v, g, beta, initial_state, cu_seqlens, scale, max_seqlen and cu_seqlens_host: the backward skips the
 * recomputation and its own workspace (flashgdn_bwd_workspace_size with kept_workspace
 * set) is smaller. The backward only reads the kept workspace, so it can run more than
 * once on it. The forward also writes a tag of its problem there (shapes, dtypes, scale,
 * max_seqlen, cu_seqlens_host), which the backward compares on the device: a kept workspace of a problem of
 * other shapes, dtypes, scale or planning hints, or one never filled, gives NaN gradients (no host sync)
 * rather than garbage. The tag cannot tell two forwards of the same shapes apart (it
 * leaves out the inputs' addresses, which saved-tensor offloading changes): pairing each
 * backward with its forward's workspace is the caller's part.
 */

/*
 * Decode: the token-by-token recurrence for T = 1..64 tokens per sequence (decode,
 * speculative verification), reading and updating states of a state pool in place.
 *   q, k            [B, T, H_qk, K]   bf16 or fp16
 *   v, o            [B, T, H_v, V]    dtype of q
 *   g, beta         [B, T, H_v]       fp32, bf16 or fp16
 *   state_pool      [num_slots, H_v, K, V] (KV) or [num_slots, H_v, V, K] (VK); fp32,
 *                   bf16 or fp16; read and written in place (16-bit pools: widened to
 *                   fp32 on load, rounded once per call on store). 16-byte aligned on CUDA.
 *   state_indices   [B] int32 or int64: the slot of each sequence; a negative slot
 *                   skips the sequence (its o is zero, no state is touched).
 * Slot values are read on the device (no host sync). On the CPU an out-of-range slot
 * (>= num_slots) or a slot used twice is an error; on CUDA an out-of-range slot makes
 * that sequence's o NaN and leaves the pool untouched, and a repeated slot is undefined.
 * use_qk_l2norm != 0 l2-normalises q and k (x / sqrt(|x|^2 + 1e-6)) in fp32 first.
 * No workspace; CUDA calls are asynchronous on `stream` and CUDA-graph capturable.
 */
typedef struct {
  flashgdn_tensor q, k, v, g, beta;
  flashgdn_tensor state_pool;    /* in/out */
  flashgdn_tensor state_indices;
  float scale;                   /* <= 0: use K^-0.5 */
  int32_t use_qk_l2norm;
  flashgdn_tensor o;             /* output */
  void* stream;
  int32_t state_layout;          /* flashgdn_state_layout of state_pool */
} flashgdn_decode_args;

/*
 * Gate (Qwen3-Next): g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).
 *   a, b            [..., H_v] (1 to 4 dims, same shape)   fp32, bf16, fp16 or fp64
 *   A_log, dt_bias  [H_v]                                  same dtype choice
 *   g, beta         shape of a, each fp32, bf16, fp16 or fp64 (outputs)
 * Computed in double precision, rounded once to each output's dtype;
 * softplus(x) = max(x, 0) + log1p(exp(-|x|)) (no overflow for large x).
 * Backward, from dg and dbeta (shape of a, any of those dtypes): da, db like a and b;
 * dA_log, ddt_bias like A_log and dt_bias, summed over all leading positions in a fixed
 * order (deterministic); CUDA calls need the workspace flashgdn_gating_bwd_workspace_size says.
 */
typedef struct {
  flashgdn_tensor a, A_log, dt_bias, b;
  flashgdn_tensor g, beta;       /* outputs */
  void* stream;
} flashgdn_gating_fwd_args;

typedef struct {
  flashgdn_tensor a, A_log, dt_bias, b;
  flashgdn_tensor dg, dbeta;     /* gradients of g and beta */
  flashgdn_tensor da, dA_log, ddt_bias, db; /* outputs */
  void* workspace;
  size_t workspace_bytes;
  void* stream;
} flashgdn_gating_bwd_args;

int flashgdn_fwd_workspace_size(const flashgdn_fwd_args* args, size_t* bytes);
int flashgdn_fwd(const flashgdn_fwd_args* args);
int flashgdn_bwd_workspace_size(const flashgdn_bwd_args* args, size_t* bytes);
int flashgdn_bwd(const flashgdn_bwd_args* args);
int flashgdn_decode(const flashgdn_decode_args* args);
int flashgdn_gating_fwd(const flashgdn_gating_fwd_args* args);
int flashgdn_gating_bwd_workspace_size(const flashgdn_gating_bwd_args* args, size_t* bytes);
int flashgdn_gating_bwd(const flashgdn_gating_bwd_args* args);
const char* flashgdn_last_error(void);
const char* flashgdn_version(void);

#ifdef __cplusplus
}
#endif
#endif /* FLASHGDN_FLASHGDN_H */
