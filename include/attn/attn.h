/*
 * libattn: an embedded attention runtime.
 *
 * The public C API. C99, no CUDA or C++ types: streams are passed as void*
 * (a cudaStream_t on the CUDA backend), tensors as raw pointers plus the
 * shapes and strides the plan was built with.
 *
 * How it is used
 *   1. attn_context_create()   pick a backend (CPU, CUDA, AUTO), a device and
 *                               a thread count.
 *   2. attn_plan_desc_create() and its setters describe one attention problem:
 *                               shapes, dtype, layout, mask, scale, passes.
 *   3. attn_plan_create()      validates the description against the
 *                               context's backend and freezes it into a plan.
 *   4. attn_plan_workspace_size() tells how many scratch bytes each pass needs;
 *                               the caller owns that memory.
 *   5. attn_forward() / attn_backward() run the plan as many times as wanted.
 *
 * Conventions that hold for every function
 *   - Every function returns attn_status_t. On failure,
 *     attn_last_error_message() says what was wrong and names the argument.
 *     A failed call writes none of its outputs (out-parameters and tensors)
 *     and leaks nothing.
 *   - No function throws, aborts or exits.
 *   - destroy functions accept NULL and then do nothing.
 *   - Handles are opaque. A handle that was destroyed is detected and
 *     rejected with ATTN_STATUS_INVALID_HANDLE, unless its memory address has
 *     since been reused for a new handle of the same kind.
 *   - Integers are fixed width; sizes are size_t; element strides are int64_t
 *     counted in elements, not bytes.
 *
 * Masks and alignment (bottom-right, as FlashAttention >= 2.1 and cuDNN's
 * BOTTOM_RIGHT). For one sequence with Lq queries and Lk keys let
 * off = Lk - Lq, so that the last query lines up with the last key. Query i
 * (0-based) sees key j when
 *
 *     i + off - left  <=  j  <=  i + off + right        (both bounds inclusive)
 *
 * where a negative left or right means "unbounded on that side". CAUSAL is
 * left = unbounded, right = 0. Example, Lq = 3, Lk = 5 (off = 2), window
 * left = 1, right = 0 ('x' = visible):
 *
 *              key j:  0 1 2 3 4
 *     query 0          . x x . .       sees j in [1, 2]
 *     query 1          . . x x .       sees j in [2, 3]
 *     query 2          . . . x x       sees j in [3, 4]
 *
 * With Lq > Lk and CAUSAL, the first Lq - Lk queries see no key at all. A row
 * that sees no key produces O = 0 and LSE = -inf (never NaN); since such rows
 * are usually a mistake, plan creation rejects any problem where a row is left
 * empty unless attn_plan_desc_set_allow_empty_rows() was called.
 *
 * Numerics: fp32 accumulation and softmax for every input dtype. The
 * log-sum-exp output is fp32, natural log, laid out [batch, heads_q, seqlen_q]
 * (contiguous) for fixed-length batches and [heads_q, total_q] for varlen.
 */
#ifndef ATTN_ATTN_H
#define ATTN_ATTN_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#  if defined(ATTN_BUILDING_LIBRARY) && !defined(ATTN_STATIC)
#    define ATTN_API __declspec(dllexport)
#  elif !defined(ATTN_STATIC)
#    define ATTN_API __declspec(dllimport)
#  else
#    define ATTN_API
#  endif
#elif defined(__GNUC__)
#  define ATTN_API __attribute__((visibility("default")))
#else
#  define ATTN_API
#endif

/* In C++ the enumerations get a fixed int base, so that any int a C or FFI
 * caller passes is a valid value to check (and reject) rather than undefined
 * behaviour. The size and representation are those of the C enum. */
#if defined(__cplusplus)
#  define ATTN_ENUM_BASE : int
#else
#  define ATTN_ENUM_BASE
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                   */
/* ------------------------------------------------------------------------ */

#define ATTN_VERSION_MAJOR 0
#define ATTN_VERSION_MINOR 1
#define ATTN_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, so versions compare as integers. */
#define ATTN_VERSION_NUMBER \
  (ATTN_VERSION_MAJOR * 10000 + ATTN_VERSION_MINOR * 100 + ATTN_VERSION_PATCH)

/* The version of the library actually loaded at run time, in the form of
 * ATTN_VERSION_NUMBER. Compare with the macro to catch header/library skew.
 * Thread-safe, never fails. */
ATTN_API uint32_t attn_version_number(void);

/* "MAJOR.MINOR.PATCH" of the loaded library. Static storage, never NULL. */
ATTN_API const char *attn_version_string(void);

/* ------------------------------------------------------------------------ */
/* Status codes and errors                                                   */
/* ------------------------------------------------------------------------ */

typedef enum attn_status ATTN_ENUM_BASE {
  ATTN_STATUS_SUCCESS = 0,
  /* An argument is NULL, out of range or inconsistent with another. */
  ATTN_STATUS_INVALID_ARGUMENT = 1,
  /* A handle is NULL, of the wrong kind, or already destroyed. */
  ATTN_STATUS_INVALID_HANDLE = 2,
  /* The request is valid but the chosen backend cannot do it (the message
   * names the feature). Nothing else is run in its place. */
  ATTN_STATUS_NOT_SUPPORTED = 3,
  /* The workspace passed to an execution is smaller than the plan needs. */
  ATTN_STATUS_WORKSPACE_TOO_SMALL = 4,
  /* Host (or device) memory could not be allocated. */
  ATTN_STATUS_OUT_OF_MEMORY = 5,
  /* The requested backend is not built into this library or has no usable
   * device on this machine. */
  ATTN_STATUS_BACKEND_UNAVAILABLE = 6,
  /* The backend's runtime (e.g. CUDA) reported an error during a call. */
  ATTN_STATUS_BACKEND_ERROR = 7,
  /* A fixed-capacity object (a KV cache) has no room left. */
  ATTN_STATUS_CAPACITY = 8,
  /* A transport between ranks (a ring communicator) failed. */
  ATTN_STATUS_COMMUNICATION_ERROR = 9,
  /* A bug in the library. Please report it with the message. */
  ATTN_STATUS_INTERNAL_ERROR = 10
} attn_status_t;

/* A short, static name for a status ("ATTN_STATUS_INVALID_ARGUMENT"); for an
 * unknown value, "ATTN_STATUS_UNKNOWN". Never NULL, thread-safe. */
ATTN_API const char *attn_status_string(attn_status_t status);

/* What the most recent call of this library *on the calling thread* found
 * wrong, naming the offending argument, or "" if that call succeeded. Every
 * API function except this one, attn_status_string() and the version queries
 * resets it on entry. The string is owned by the library and stays valid
 * until the next library call on the same thread. Never NULL. */
ATTN_API const char *attn_last_error_message(void);

/* ------------------------------------------------------------------------ */
/* Enumerations                                                              */
/* ------------------------------------------------------------------------ */

typedef enum attn_backend ATTN_ENUM_BASE {
  /* CUDA when this library was built with it and a device is present, else
   * the CPU. The context records what was chosen
   * (attn_context_get_backend). */
  ATTN_BACKEND_AUTO = 0,
  ATTN_BACKEND_CPU = 1,
  ATTN_BACKEND_CUDA = 2
} attn_backend_t;

typedef enum attn_dtype ATTN_ENUM_BASE {
  ATTN_DTYPE_FP32 = 0,
  ATTN_DTYPE_FP16 = 1, /* IEEE binary16 */
  ATTN_DTYPE_BF16 = 2  /* bfloat16 */
} attn_dtype_t;

/* Default memory layout of Q, K, V, O and their gradients. Only the default
 * strides follow from it; attn_plan_desc_set_tensor() overrides the strides
 * of one tensor. The last (head-dimension) stride is always 1. */
typedef enum attn_layout ATTN_ENUM_BASE {
  /* [batch, seqlen, heads, head_dim], the layout of most frameworks. */
  ATTN_LAYOUT_BSHD = 0,
  /* [batch, heads, seqlen, head_dim]. */
  ATTN_LAYOUT_BHSD = 1,
  /* [total_tokens, heads, head_dim]: sequences packed back to back, for
   * varlen batches (attn_plan_desc_set_varlen). Chosen automatically when a
   * varlen batch is set; naming it without one is an error. */
  ATTN_LAYOUT_THD = 2
} attn_layout_t;

typedef enum attn_mask ATTN_ENUM_BASE {
  ATTN_MASK_NONE = 0,   /* every query sees every key */
  ATTN_MASK_CAUSAL = 1, /* bottom-right aligned; see the picture above */
  ATTN_MASK_WINDOW = 2  /* sliding window (left, right), inclusive */
} attn_mask_t;

/* The tensors of a plan, to override their strides one by one. */
typedef enum attn_tensor_role ATTN_ENUM_BASE {
  ATTN_TENSOR_Q = 0,
  ATTN_TENSOR_K = 1,
  ATTN_TENSOR_V = 2,
  ATTN_TENSOR_O = 3,
  ATTN_TENSOR_DO = 4,
  ATTN_TENSOR_DQ = 5,
  ATTN_TENSOR_DK = 6,
  ATTN_TENSOR_DV = 7
} attn_tensor_role_t;

/* Which passes a plan must be able to run. */
typedef enum attn_passes ATTN_ENUM_BASE {
  ATTN_PASSES_FORWARD = 1,
  ATTN_PASSES_FORWARD_BACKWARD = 3
} attn_passes_t;

/* One pass, for workspace queries. */
typedef enum attn_pass ATTN_ENUM_BASE {
  ATTN_PASS_FORWARD = 1,
  ATTN_PASS_BACKWARD = 2
} attn_pass_t;

/* ------------------------------------------------------------------------ */
/* Handles                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct attn_context *attn_context_t;         /* backend + device */
typedef struct attn_tensor_desc *attn_tensor_desc_t; /* dtype, dims, strides */
typedef struct attn_plan_desc *attn_plan_desc_t;     /* a mutable description */
typedef struct attn_plan *attn_plan_t;               /* an immutable plan */
/* attn_kv_cache_t is reserved for the streaming KV state (no function takes
 * it yet); attn_comm_t is one rank's end of a ring communicator (see "Ring
 * attention" below). */
typedef struct attn_kv_cache *attn_kv_cache_t;
typedef struct attn_comm *attn_comm_t;

/* ------------------------------------------------------------------------ */
/* Context                                                                   */
/* ------------------------------------------------------------------------ */

/* Create a context on `backend`.
 *   device       CUDA device ordinal; must be 0 for the CPU backend.
 *   num_threads  CPU worker threads used by each execution, >= 0; 0 means
 *                one per available core. In a library built without OpenMP,
 *                executions run on the calling thread and
 *                attn_context_get_num_threads reports 1.
 * On success *ctx owns a new context; free it with attn_context_destroy.
 * Plans copy what they need, so a context may be destroyed while plans made
 * from it live on. A context is immutable and may be shared by threads.
 * Returns SUCCESS, INVALID_ARGUMENT (ctx NULL, bad enum, device or
 * num_threads out of range), BACKEND_UNAVAILABLE (backend not built in or no
 * device), OUT_OF_MEMORY. */
ATTN_API attn_status_t attn_context_create(attn_backend_t backend, int32_t device,
                                           int32_t num_threads, attn_context_t *ctx);

/* Destroys ctx. NULL is a no-op. Returns SUCCESS or INVALID_HANDLE. Not to be
 * called while another thread uses the same context. */
ATTN_API attn_status_t attn_context_destroy(attn_context_t ctx);

/* The backend the context runs on (never AUTO). Returns SUCCESS,
 * INVALID_HANDLE, INVALID_ARGUMENT (backend NULL). Thread-safe. */
ATTN_API attn_status_t attn_context_get_backend(attn_context_t ctx, attn_backend_t *backend);

/* The number of CPU threads an execution on this context uses. Returns
 * SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT. Thread-safe. */
ATTN_API attn_status_t attn_context_get_num_threads(attn_context_t ctx, int32_t *num_threads);

/* ------------------------------------------------------------------------ */
/* Tensor descriptors                                                        */
/* ------------------------------------------------------------------------ */

#define ATTN_MAX_DIMS 8

/* Creates an empty tensor descriptor (ndim 0). Owned by the caller: free it
 * with attn_tensor_desc_destroy. Not thread-safe while being set. Returns
 * SUCCESS, INVALID_ARGUMENT (desc NULL), OUT_OF_MEMORY. */
ATTN_API attn_status_t attn_tensor_desc_create(attn_tensor_desc_t *desc);

/* NULL is a no-op. Returns SUCCESS or INVALID_HANDLE. */
ATTN_API attn_status_t attn_tensor_desc_destroy(attn_tensor_desc_t desc);

/* Sets dtype, dims and strides (in elements). strides may be NULL for a
 * contiguous row-major tensor. dims must be >= 0, strides >= 0, ndim in
 * 1..ATTN_MAX_DIMS. The arrays are copied. Returns SUCCESS, INVALID_HANDLE,
 * INVALID_ARGUMENT (on which the descriptor is unchanged). */
ATTN_API attn_status_t attn_tensor_desc_set(attn_tensor_desc_t desc, attn_dtype_t dtype,
                                            int32_t ndim, const int64_t *dims,
                                            const int64_t *strides);

/* Reads back what was set. dims and strides must each have room for
 * ATTN_MAX_DIMS entries (or be NULL when not wanted). Returns SUCCESS,
 * INVALID_HANDLE, INVALID_ARGUMENT (ndim or dtype NULL). */
ATTN_API attn_status_t attn_tensor_desc_get(attn_tensor_desc_t desc, attn_dtype_t *dtype,
                                            int32_t *ndim, int64_t *dims, int64_t *strides);

/* ------------------------------------------------------------------------ */
/* Plan descriptor                                                           */
/* ------------------------------------------------------------------------ */

/* A plan descriptor collects the parameters of one attention problem through
 * typed setters. Each setter checks its own arguments and returns
 * INVALID_ARGUMENT (descriptor unchanged) when they are out of range;
 * consistency between parameters is checked by attn_plan_create. A
 * descriptor is owned by the caller and may be reused or destroyed after
 * plans are made from it. Not thread-safe while being modified.
 *
 * Defaults: batch 1, heads 1/1, seqlen 0/0 (must be set), head dims 0 (must
 * be set), FP32, BSHD, scale 1/sqrt(head_dim_qk), no softcap, no mask,
 * fixed-length batch, empty rows rejected, forward pass only, not
 * deterministic. */
ATTN_API attn_status_t attn_plan_desc_create(attn_plan_desc_t *desc);
ATTN_API attn_status_t attn_plan_desc_destroy(attn_plan_desc_t desc);

/* Problem shape. heads_q must be a multiple of heads_kv (GQA; heads_kv == 1
 * is MQA), checked at plan creation. For a varlen batch, seqlen_q and
 * seqlen_kv are the longest sequence of each side (as FlashAttention's
 * max_seqlen), checked against the offsets at plan creation.
 * Ranges: batch >= 1, heads >= 1, seqlen >= 0, head dims in 1..1024. */
ATTN_API attn_status_t attn_plan_desc_set_shape(attn_plan_desc_t desc, int64_t batch,
                                                int64_t heads_q, int64_t heads_kv,
                                                int64_t seqlen_q, int64_t seqlen_kv,
                                                int64_t head_dim_qk, int64_t head_dim_v);

/* Element type of Q, K, V, O, dO, dQ, dK, dV (LSE is always fp32). */
ATTN_API attn_status_t attn_plan_desc_set_dtype(attn_plan_desc_t desc, attn_dtype_t dtype);

/* Default layout (BSHD or BHSD; THD is implied by a varlen batch). */
ATTN_API attn_status_t attn_plan_desc_set_layout(attn_plan_desc_t desc, attn_layout_t layout);

/* Override one tensor's strides. `tensor` must have the plan's dtype and the
 * dims of that tensor in the plan's layout order: BSHD [batch, seqlen, heads,
 * dim], BHSD [batch, heads, seqlen, dim], THD [total, heads, dim]; its last
 * stride must be 1. Checked at plan creation, where a mismatch names the
 * tensor. The descriptor is copied; passing NULL restores the layout's
 * default strides for that role. Output tensors (O, dQ, dK, dV) must not
 * overlap themselves or the inputs. */
ATTN_API attn_status_t attn_plan_desc_set_tensor(attn_plan_desc_t desc, attn_tensor_role_t role,
                                                 attn_tensor_desc_t tensor);

/* Softmax scale applied to Q.K^T; must be finite and > 0. Default
 * 1/sqrt(head_dim_qk). */
ATTN_API attn_status_t attn_plan_desc_set_softmax_scale(attn_plan_desc_t desc, float scale);

/* Logit soft-capping: scores become cap * tanh(scale * q.k / cap) before the
 * softmax (Gemma 2). cap must be finite and >= 0; 0 disables it (default). */
ATTN_API attn_status_t attn_plan_desc_set_softcap(attn_plan_desc_t desc, float cap);

/* The mask. For NONE and CAUSAL, window_left and window_right must both be
 * -1. For WINDOW they are the inclusive reach to the left and right of the
 * aligned diagonal (see the picture at the top); -1 means unbounded. */
ATTN_API attn_status_t attn_plan_desc_set_mask(attn_plan_desc_t desc, attn_mask_t mask,
                                               int64_t window_left, int64_t window_right);

/* A varlen batch: `batch` sequences packed back to back. cu_seqlens_q and
 * cu_seqlens_kv hold batch + 1 non-decreasing offsets starting at 0 (host
 * memory, copied); sequence b owns tokens [cu[b], cu[b+1]). Sequences of
 * length 0 are allowed. The layout becomes THD. batch must equal the shape's
 * batch (checked at plan creation). Passing NULL for both clears varlen. */
ATTN_API attn_status_t attn_plan_desc_set_varlen(attn_plan_desc_t desc, int64_t batch,
                                                 const int32_t *cu_seqlens_q,
                                                 const int32_t *cu_seqlens_kv);

/* Allow rows that see no key (they produce O = 0, LSE = -inf). Default 0. */
ATTN_API attn_status_t attn_plan_desc_set_allow_empty_rows(attn_plan_desc_t desc, int32_t allow);

/* Which passes the plan must support. Default ATTN_PASSES_FORWARD. */
ATTN_API attn_status_t attn_plan_desc_set_passes(attn_plan_desc_t desc, attn_passes_t passes);

/* Deterministic gradients: 1 asks that attn_backward produce bit-identical
 * dQ, dK and dV run after run for the same inputs (no floating-point
 * atomics whose order varies); 0 (default) allows the faster kernels whose
 * accumulation order may vary, so results may differ in the last bits from
 * run to run. Must be 0 or 1. The forward pass is deterministic either way,
 * and the CPU backend is always deterministic. attn_plan_describe's kernel
 * names the variant that runs. */
ATTN_API attn_status_t attn_plan_desc_set_deterministic(attn_plan_desc_t desc,
                                                        int32_t deterministic);

/* ------------------------------------------------------------------------ */
/* Plan                                                                      */
/* ------------------------------------------------------------------------ */

/* Validates desc against ctx's backend and creates an immutable plan. The
 * plan copies everything it needs: desc and ctx may be destroyed afterwards.
 * Returns SUCCESS, INVALID_HANDLE (ctx or desc), INVALID_ARGUMENT
 * (inconsistent parameters, e.g. heads_q % heads_kv != 0, a tensor's dims or
 * dtype, varlen offsets, empty rows not allowed), NOT_SUPPORTED (the
 * backend cannot do this problem; the message names the feature),
 * OUT_OF_MEMORY. On failure *plan is unchanged. */
ATTN_API attn_status_t attn_plan_create(attn_context_t ctx, attn_plan_desc_t desc,
                                        attn_plan_t *plan);

/* NULL is a no-op. Returns SUCCESS or INVALID_HANDLE. Must not race with an
 * execution of the same plan. */
ATTN_API attn_status_t attn_plan_destroy(attn_plan_t plan);

/* Workspace bytes `pass` needs (0 is possible). Returns SUCCESS,
 * INVALID_HANDLE, INVALID_ARGUMENT (bytes NULL, unknown pass),
 * NOT_SUPPORTED (BACKWARD on a forward-only plan). Thread-safe. */
ATTN_API attn_status_t attn_plan_workspace_size(attn_plan_t plan, attn_pass_t pass,
                                                size_t *bytes);

/* What a plan will run: the proof that nothing else is substituted.
 * Size-tagged: set struct_size = sizeof(attn_plan_info_t) before the call;
 * the library fills only the fields that fit, so old callers keep working
 * when fields are appended. */
typedef struct attn_plan_info {
  uint64_t struct_size;
  int32_t backend;          /* attn_backend_t */
  int32_t dtype;            /* attn_dtype_t */
  int32_t tile_q;           /* query rows per tile */
  int32_t tile_kv;          /* key rows per tile */
  int32_t num_threads;      /* CPU threads used per execution */
  int32_t supports_backward;
  uint64_t workspace_bytes_forward;
  uint64_t workspace_bytes_backward; /* 0 for a forward-only plan */
  uint64_t visible_pairs;   /* (query, key) pairs the mask lets through, all heads */
  double flops_forward;     /* 4 * pairs * d (d = (d_qk + d_v) / 2) */
  double flops_backward;    /* 2.5 x forward */
  double bytes_forward;     /* minimum bytes moved: read Q,K,V once, write O, LSE */
  double bytes_backward;    /* read Q,K,V,O,dO,LSE once, write dQ,dK,dV */
  char algorithm[64];       /* e.g. "flash-tiled-online-softmax" */
  char kernel[64];          /* backend kernel variant, e.g. "cpu-avx512" */
} attn_plan_info_t;

/* Fills *info. Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (info NULL
 * or struct_size smaller than the first two fields). Thread-safe. */
ATTN_API attn_status_t attn_plan_describe(attn_plan_t plan, attn_plan_info_t *info);

/* One human-readable line describing the plan, written like snprintf: at most
 * `capacity` bytes including the terminating NUL; *needed (if not NULL)
 * receives the full length + 1. buf may be NULL when capacity is 0.
 * Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT. Thread-safe. */
ATTN_API attn_status_t attn_plan_summary(attn_plan_t plan, char *buf, size_t capacity,
                                         size_t *needed);

/* ------------------------------------------------------------------------ */
/* Execution                                                                 */
/* ------------------------------------------------------------------------ */

/* Forward pass: O = softmax(mask(scale * Q K^T)) V, and LSE when lse is not
 * NULL. Tensors live where the backend computes (host memory for the CPU
 * backend, device memory for CUDA) with the shapes, dtype and strides of the
 * plan. workspace must hold at least attn_plan_workspace_size(FORWARD)
 * bytes (it may be NULL when that is 0); the caller owns it and must not use
 * it for anything else during the call. stream is a cudaStream_t on the CUDA
 * backend and is ignored by the CPU backend, which returns when the result
 * is written. Never allocates.
 * Thread-safety: several threads may execute one plan at once with distinct
 * workspaces and outputs.
 * CUDA backend: every tensor pointer and the workspace must be 16-byte
 * aligned (cudaMalloc's are), else INVALID_ARGUMENT naming the pointer; its
 * kernels also need strides that are multiples of 8 elements, which plan
 * creation checks (NOT_SUPPORTED).
 * Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (a NULL tensor when the
 * problem is non-empty, a misaligned pointer), WORKSPACE_TOO_SMALL,
 * BACKEND_ERROR. On failure no output has been written. */
ATTN_API attn_status_t attn_forward(attn_plan_t plan, const void *q, const void *k,
                                    const void *v, void *o, float *lse, void *workspace,
                                    size_t workspace_bytes, void *stream);

/* Backward pass: from dO and the forward's O and LSE, computes dQ, dK and
 * dV (each fully overwritten). Probabilities are recomputed from LSE, so
 * lse must come from a forward of the same plan on the same Q, K, V. The
 * plan must have been created with ATTN_PASSES_FORWARD_BACKWARD. Workspace,
 * stream and threads as for attn_forward. Returns SUCCESS, INVALID_HANDLE,
 * INVALID_ARGUMENT, NOT_SUPPORTED (forward-only plan),
 * WORKSPACE_TOO_SMALL, BACKEND_ERROR. */
ATTN_API attn_status_t attn_backward(attn_plan_t plan, const void *q, const void *k,
                                     const void *v, const void *o, const float *lse,
                                     const void *d_o, void *dq, void *dk, void *dv,
                                     void *workspace, size_t workspace_bytes, void *stream);

/* ------------------------------------------------------------------------ */
/* Merging partial softmax states                                            */
/* ------------------------------------------------------------------------ */

/* Merges num_parts partial results (O_p, LSE_p), each computed over a
 * disjoint set of keys, into the result over their union:
 *
 *     LSE = log(sum_p exp(LSE_p)),   O = sum_p exp(LSE_p - LSE) * O_p
 *
 * Exact, associative and order-independent up to rounding; a part with
 * LSE = -inf (it saw no key) contributes nothing, and if every part is empty
 * the result is O = 0, LSE = -inf, never NaN.
 *
 *   o_desc     dims [..., head_dim] and strides of every O_p and of o_out
 *              (last stride 1); its dtype is that of the O tensors.
 *   lse_desc   dims equal to o_desc's dims without the last, fp32, with
 *              its own strides (so LSE [batch, heads, seqlen] can describe
 *              the rows of O [batch, seqlen, heads, dim]).
 *   o_parts, lse_parts  host arrays of num_parts pointers (to host memory
 *              on the CPU backend, device memory on CUDA).
 *   o_out, lse_out  results; lse_out may be NULL. o_out may equal o_parts[0]
 *              and lse_out lse_parts[0] (in-place merge); no other overlap.
 * num_parts >= 1. Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT,
 * NOT_SUPPORTED, BACKEND_ERROR. Thread-safe for distinct outputs. */
ATTN_API attn_status_t attn_merge_states(attn_context_t ctx, int32_t num_parts,
                                         attn_tensor_desc_t o_desc, attn_tensor_desc_t lse_desc,
                                         const void *const *o_parts,
                                         const float *const *lse_parts, void *o_out,
                                         float *lse_out, void *stream);

/* ------------------------------------------------------------------------ */
/* Ring attention: sequences split over ranks                                */
/* ------------------------------------------------------------------------ */

/* A sequence too long for one device is split over the N ranks of a
 * communicator. Each rank keeps its shard of the queries; the key/value
 * shards travel around the ring (rank r sends to r + 1 and receives from
 * r - 1) while each rank attends to the shard it holds and merges the
 * result into its running (O, LSE) state. After N steps every rank has O and
 * LSE of its own queries over the whole sequence, exactly as a dense plan
 * over the whole sequence would give them (up to rounding).
 *
 * How the sequence is laid over the ranks (for every batch entry; seqlen_q
 * and seqlen_kv are cut alike, each into equal chunks):
 *
 *   CONTIGUOUS  rank r holds chunk r of N.           needs seqlen % N == 0
 *   ZIGZAG      rank r holds chunks r and 2N-1-r of  needs seqlen % 2N == 0
 *               2N, in that order, so that causal
 *               work is the same on every rank.
 *
 *   e.g. N = 2, seqlen 8, ZIGZAG:  rank 0 holds positions 0 1 | 6 7,
 *                                  rank 1 holds positions 2 3 | 4 5.
 *
 * A rank's local tensors are the global ones restricted to the positions it
 * holds, in that order, with the layout's contiguous strides over the local
 * shape: Q, O, dO, dQ [batch, seqlen_q / N, heads_q, dim] (BSHD) or
 * [batch, heads_q, seqlen_q / N, dim] (BHSD), K, V, dK, dV likewise with
 * seqlen_kv / N, LSE [batch, heads_q, seqlen_q / N]. Masks keep their
 * global meaning (bottom-right alignment over the global lengths). */

typedef enum attn_ring_layout ATTN_ENUM_BASE {
  ATTN_RING_LAYOUT_CONTIGUOUS = 0,
  ATTN_RING_LAYOUT_ZIGZAG = 1
} attn_ring_layout_t;

/* Creates an in-process group of num_ranks communicators, for ranks that are
 * threads of this process (one context per rank; CPU backend). comms must
 * have room for num_ranks handles; comms[i] gets rank i. Every wait of an
 * exchange gives up after timeout_ms milliseconds (0: waits without bound)
 * and then fails the group. Each handle is owned by the caller (destroy each
 * with attn_comm_destroy) and used by one thread at a time.
 * num_ranks in 1..1024, timeout_ms >= 0. On failure no handle is created
 * and comms is unchanged. Returns SUCCESS, INVALID_ARGUMENT, OUT_OF_MEMORY. */
ATTN_API attn_status_t attn_comm_create_inprocess(int32_t num_ranks, int64_t timeout_ms,
                                                  attn_comm_t *comms);

/* Wraps an NCCL communicator (an ncclComm_t passed as void*) the host
 * application created, one per rank (ncclCommInitRank, ncclCommInitAll):
 * ranks, size and device are NCCL's. nccl_comm stays owned by the caller and
 * must outlive *comm and every ring plan made from it. The new handle (free
 * it with attn_comm_destroy) creates its own communication stream on the
 * communicator's device; exchanges are ordered with the execution's stream
 * by events, never by waiting on the host. Ring plans on it need a CUDA
 * context on that device; plan creation is then collective (every rank
 * creates its plan, and a mismatch fails all of them with
 * COMMUNICATION_ERROR). A rank that fails during an execution cannot stop
 * its peers' enqueued NCCL operations: the application aborts the NCCL
 * communicator (ncclCommAbort) to release them. Returns SUCCESS,
 * INVALID_ARGUMENT (NULL), BACKEND_UNAVAILABLE (built without NCCL),
 * COMMUNICATION_ERROR (NCCL's message), BACKEND_ERROR, OUT_OF_MEMORY. */
ATTN_API attn_status_t attn_comm_create_nccl(void *nccl_comm, attn_comm_t *comm);

/* Destroys one rank's communicator. NULL is a no-op. Ring plans made from
 * it keep what they need alive (they must still be destroyed) but fail with
 * COMMUNICATION_ERROR from then on. In-process, leaving fails the whole
 * group: the other ranks' ring executions fail too instead of waiting for
 * this rank. (NCCL peers cannot be told; see attn_comm_create_nccl.)
 * Returns SUCCESS or INVALID_HANDLE. */
ATTN_API attn_status_t attn_comm_destroy(attn_comm_t comm);

/* This rank's index in 0..size-1, and the number of ranks. Returns SUCCESS,
 * INVALID_HANDLE, INVALID_ARGUMENT (out pointer NULL). Thread-safe. */
ATTN_API attn_status_t attn_comm_get_rank(attn_comm_t comm, int32_t *rank);
ATTN_API attn_status_t attn_comm_get_size(attn_comm_t comm, int32_t *size);

/* Creates this rank's ring plan for the problem `desc` describes with its
 * GLOBAL sequence lengths (the same descriptor a dense plan over the whole
 * sequence would take). Every rank of comm must create its plan from an
 * equal descriptor and layout; a mismatch is found at the first exchange
 * and fails every rank with COMMUNICATION_ERROR.
 * The plan is an ordinary attn_plan_t: attn_plan_workspace_size,
 * attn_forward and attn_backward take it with the rank's local tensors (see
 * above), attn_plan_describe reports the global problem's pairs, FLOPs and
 * bytes with this rank's workspace, and attn_ring_plan_describe the ring.
 * attn_forward and attn_backward on a ring plan are collective: every rank
 * calls the same pass with its shards; a rank returns when the ring is done.
 * Their executions must not overlap on one communicator. A failure of one
 * rank during an execution fails the group: every rank then returns
 * COMMUNICATION_ERROR (outputs unwritten) and the communicators are no
 * longer usable. A rank that fails before it starts (an invalid argument, a
 * small workspace) is noticed by the others through their timeout, or at
 * once if it then destroys its (in-process) communicator.
 * Supported: CPU contexts with in-process communicators (full, causal and
 * window masks, GQA, softcap, head_dim_v != head_dim_qk, every dtype, BSHD
 * and BHSD), and CUDA contexts with NCCL communicators for what the CUDA
 * backend runs, when every block of the ring is fully visible or aligned
 * like the whole sequence (full and causal masks with seqlen_q ==
 * seqlen_kv). Not supported (NOT_SUPPORTED): varlen batches, custom strides
 * (attn_plan_desc_set_tensor), other CUDA rings (windows, causal with
 * seqlen_q != seqlen_kv). A communicator of the other kind than ctx's
 * backend is INVALID_ARGUMENT.
 * Returns SUCCESS, INVALID_HANDLE (ctx, desc, comm), INVALID_ARGUMENT
 * (layout, lengths not divisible as the layout needs, and whatever
 * attn_plan_create rejects), NOT_SUPPORTED, OUT_OF_MEMORY. On failure *plan
 * is unchanged. */
ATTN_API attn_status_t attn_ring_plan_create(attn_context_t ctx, attn_plan_desc_t desc,
                                             attn_comm_t comm, attn_ring_layout_t layout,
                                             attn_plan_t *plan);

/* What a ring plan does on this rank. Size-tagged like attn_plan_info_t. */
typedef struct attn_ring_info {
  uint64_t struct_size;
  int32_t layout;             /* attn_ring_layout_t */
  int32_t rank;
  int32_t size;               /* ranks in the ring */
  int32_t steps;              /* attention steps per pass (= size) */
  int32_t exchanges_forward;  /* sends per forward: size - 1 */
  int32_t exchanges_backward; /* sends per backward: K/V size - 1 times, dK/dV size times */
  int64_t local_seqlen_q;     /* positions of each sequence this rank holds */
  int64_t local_seqlen_kv;
  uint64_t bytes_per_step_forward;  /* bytes sent per forward exchange (K and V, dtype) */
  uint64_t bytes_per_step_backward; /* per backward step: K, V (dtype) and dK, dV (fp32) */
  uint64_t blocks_computed;   /* (query chunk, KV chunk) blocks run per pass on this rank */
  uint64_t blocks_skipped;    /* blocks the mask hides wholly, never run */
  uint64_t local_visible_pairs; /* (query, key) pairs computed on this rank, all heads */
  char transport[32];         /* "inprocess" or "nccl" */
} attn_ring_info_t;

/* Fills *info (only the fields that fit info->struct_size). Returns
 * SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (info NULL, struct_size too
 * small, plan not a ring plan). Thread-safe. */
ATTN_API attn_status_t attn_ring_plan_describe(attn_plan_t plan, attn_ring_info_t *info);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTN_ATTN_H */
