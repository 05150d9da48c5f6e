/*
 * libattn: an embedded attention runtime.
 *
 * The public C API, for C (C89 and later) and C++ (C++11 and later; its
 * enums name their underlying type). No CUDA or C++ types: streams are passed as void*
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
 * Non-finite inputs: the kernels multiply whole tiles, so a NaN or Inf in K
 * or V can reach the outputs and gradients of every row whose tiles hold it,
 * also of rows that do not see that key (a probability of 0 times Inf is
 * NaN), as in other tiled attention kernels. Rows that see no key still give
 * exactly O = 0 and LSE = -inf.
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
 * behaviour. The size and representation are those of the C enum: 4 bytes
 * (C compilers' default; options that shrink enums, such as GCC's
 * -fshort-enums, are not supported: the library writes enum outputs as 4
 * bytes). */
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
/* attn_kv_cache_t is a paged KV cache (see "Streaming KV cache and decode
 * plans"); attn_comm_t is one rank's end of a ring communicator (see "Ring
 * attention"). attn_block_mask_t and attn_decode_plan_t are declared in
 * their sections. */
typedef struct attn_kv_cache *attn_kv_cache_t;
typedef struct attn_comm *attn_comm_t;

/* ------------------------------------------------------------------------ */
/* Context                                                                   */
/* ------------------------------------------------------------------------ */

/* Create a context on `backend`.
 *   device       CUDA device ordinal; must be 0 for the CPU backend.
 *   num_threads  CPU worker threads used by each execution, 0..4096; 0
 *                means one per available core (at most 4096: each thread
 *                has scratch in the workspaces). In a library built without OpenMP,
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
 * 1..ATTN_MAX_DIMS. So that element and byte offsets fit in 64 bits, the
 * product of the dims (a dim of 0 counting as 1) is at most 2^60 and, when
 * no dim is 0, the last element lies less than 2^60 elements past the
 * first (sum of (dims[i] - 1) x strides[i] < 2^60; a tensor without
 * elements may have any strides). The
 * arrays are copied. Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (the
 * message names dims or strides; the descriptor is then unchanged). */
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
 * Ranges: batch and heads in 1..2^31 - 1, seqlen in 0..2^31 - 1 (as varlen
 * offsets, which are int32), head dims in 1..1024; and batch x max(heads_q,
 * heads_kv) x max(seqlen_q, seqlen_kv) x max(head_dim_qk, head_dim_v) at
 * most 9e15 elements (the message then names the shape). */
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
 * softmax (Gemma 2). cap must be finite, >= 0 and at most 1e30 (the
 * kernels' base-2 form of larger caps leaves the fp32 range); 0 disables it
 * (default). */
ATTN_API attn_status_t attn_plan_desc_set_softcap(attn_plan_desc_t desc, float cap);

/* The mask. For NONE and CAUSAL, window_left and window_right must both be
 * -1. For WINDOW they are the inclusive reach to the left and right of the
 * aligned diagonal (see the picture at the top); -1 means unbounded. */
ATTN_API attn_status_t attn_plan_desc_set_mask(attn_plan_desc_t desc, attn_mask_t mask,
                                               int64_t window_left, int64_t window_right);

/* A varlen batch: `batch` sequences packed back to back. cu_seqlens_q and
 * cu_seqlens_kv hold batch + 1 non-decreasing offsets starting at 0 (host
 * memory, copied); sequence b owns tokens [cu[b], cu[b+1]). Sequences of
 * length 0 are allowed. The layout becomes THD: a layout set explicitly
 * (attn_plan_desc_set_layout) must then be ATTN_LAYOUT_THD, else plan
 * creation fails with INVALID_ARGUMENT. batch, in 1..2^31 - 1 (checked
 * before the arrays are read), must equal the shape's batch (checked at
 * plan creation). Passing NULL for both clears varlen. */
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
 * dtype, varlen offsets, empty rows not allowed, or a pass whose workspace
 * would exceed 2^62 bytes, such as MoBA's selection with small blocks over
 * long sequences and many heads: the message says "workspace" and gives the
 * shape), NOT_SUPPORTED (the backend cannot do this problem; the message
 * names the feature), OUT_OF_MEMORY, BACKEND_ERROR (CUDA: a runtime call
 * failed while the plan's device state was set up). On failure *plan is
 * unchanged.
 * Besides its dtypes and head dims, the CUDA backend's kernels bound the
 * shape by their grids and 32-bit arithmetic (NOT_SUPPORTED, naming the
 * value): heads_q and batch at most 65535; seqlen_q and seqlen_kv below
 * 2^30 and a varlen batch's tokens below 2^31 on each side; for a backward
 * pass fewer than 2^33 (token, head) rows on each side; MoBA selections whose
 * lists would need more than 2^31 - 1 blocks of a grid; block masks seen
 * as more than 2^31 - 1 (slot, tile) lists, bit tiles or tile visits. */
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
 * when fields are appended. Size-tagged output structs in general: a
 * caller built against a newer header (a larger struct_size) gets the
 * fields this library knows, and the ones it does not are left as they
 * were: zero the struct before the call to tell them apart. */
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
  uint64_t visible_pairs;   /* (query, key) pairs the mask lets through, all heads;
                               UINT64_MAX when there are more (the tile pair counts
                               below saturate likewise; the FLOPs do not) */
  double flops_forward;     /* 4 * pairs * d (d = (d_qk + d_v) / 2) */
  double flops_backward;    /* 2.5 x forward */
  double bytes_forward;     /* minimum bytes moved: read Q,K,V once, write O, LSE */
  double bytes_backward;    /* read Q,K,V,O,dO,LSE once, write dQ,dK,dV */
  char algorithm[64];       /* e.g. "flash-tiled-online-softmax" */
  char kernel[64];          /* backend kernel variant, e.g. "cpu-avx512" */
  /* (query tile, KV tile) pairs the kernels visit, summed over sequences and
   * query heads, with the tile sizes above: those holding at least one
   * visible (query, key) pair (for MoBA an upper bound, see
   * attn_plan_desc_set_moba); total_tile_pairs is the number a mask without
   * any restriction would visit. Their ratio is the tile density of a
   * causal, windowed or block-sparse plan. */
  uint64_t visited_tile_pairs;
  uint64_t total_tile_pairs;
  /* The block mask's block sizes (attn_plan_desc_set_block_mask), 0 when
   * the plan has none. */
  int32_t block_q;
  int32_t block_kv;
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
 * LSE = -inf (it saw no key) contributes nothing, whatever its O holds, and
 * if every part is empty the result is O = 0, LSE = -inf, never NaN. A NaN
 * LSE in any part makes the row's O and LSE NaN.
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
 * num_parts >= 1. The CPU backend merges on return (stream unused). The
 * CUDA backend enqueues kernels on `stream` (a cudaStream_t; NULL: the
 * legacy default stream), never synchronises or allocates, and can be
 * captured in a CUDA graph; its pointers must be aligned to their element
 * (INVALID_ARGUMENT otherwise). It merges up to 128 parts per kernel launch;
 * more chain through o_out and lse_out (O rounded to its dtype between
 * launches), so they need lse_out (NOT_SUPPORTED without).
 * Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT, NOT_SUPPORTED,
 * BACKEND_ERROR. Thread-safe for distinct outputs. */
ATTN_API attn_status_t attn_merge_states(attn_context_t ctx, int32_t num_parts,
                                         attn_tensor_desc_t o_desc, attn_tensor_desc_t lse_desc,
                                         const void *const *o_parts,
                                         const float *const *lse_parts, void *o_out,
                                         float *lse_out, void *stream);

/* ------------------------------------------------------------------------ */
/* Block-sparse attention                                                    */
/* ------------------------------------------------------------------------ */

/* A block mask restricts a plan to chosen blocks of block_q queries by
 * block_kv keys. Query i sees key j when
 *
 *     dense(i, j)  AND  selected(i, j)
 *
 * where dense is the plan's own mask (none, causal or window, bottom-right
 * aligned; see the top of this file), always applied, and selected(i, j)
 * holds when key block j / block_kv is listed for query block i / block_q
 * either as a FULL block (every element) or as a PARTIAL block whose bit
 * tile has bit (i % block_q, j % block_kv) set. A partial block given
 * without bits selects every element, like a full one. Example: Lq = Lk =
 * 6, causal plan, block_q = block_kv = 2; query block 1 (queries 2, 3)
 * lists key block 0 as full and key block 1 as partial with bit rows
 * "01" and "11" (bit c of a row is key 2 + c); key block 2 is not listed:
 *
 *              key j:  0 1 | 2 3 | 4 5
 *     query 2          x x | . . | . .    key 3 is selected, causal hides it
 *     query 3          x x | x x | . .
 *
 * The last blocks may be ragged (seqlen not a multiple of the block); bits
 * outside the sequences are ignored. A mask has `batch` 1 (shared by every
 * sequence) or the plan's batch, and `heads` 1 (shared by every head) or
 * the plan's heads_kv: mask head h applies to KV head h and to the query
 * heads of its GQA group. Its seqlen_q and seqlen_kv are the plan's.
 *
 * Storage is canonical, so that two masks selecting the same elements read
 * back the same: a block whose in-range elements are all selected is full,
 * a partial block keeps its bits, a block selecting nothing is not listed,
 * lists are sorted by key block.
 *
 * Bit tiles are block_q rows of block_kv bits, row-major, packed
 * ATTN_BLOCK_MASK_TILE_BYTES(block_q, block_kv) bytes per tile: bit
 * t = r * block_kv + c is bit (t % 8) of byte t / 8.
 *
 * The tables follow FlexAttention's BlockMask (int32; host memory, or
 * device memory with attn_block_mask_set_device_blocks):
 *   kv_num_blocks       [batch][heads][num_q_blocks]   partial blocks per row
 *   kv_indices          [batch][heads][num_q_blocks][max_partial]
 *   partial_bits        [batch][heads][num_q_blocks][max_partial][tile bytes]
 *   full_kv_num_blocks  [batch][heads][num_q_blocks]   full blocks per row
 *   full_kv_indices     [batch][heads][num_q_blocks][max_full]
 * with num_q_blocks = ceil(seqlen_q / block_q), num_kv_blocks likewise.
 *
 * Both backends run block-sparse plans, forward and backward, visiting
 * only the tiles that hold selected elements; the CUDA backend builds its
 * tile lists (and bit tiles in its own tile geometry) at plan creation and
 * keeps them in device memory owned by the plan. With a varlen batch the
 * mask is given for the longest sequence (its seqlen_q and seqlen_kv are
 * the plan's) with batch 1 (one mask for every sequence) or one entry per
 * sequence, and sequence b takes the mask's blocks over its own lengths,
 * counted from its first position: the corner [0, seqlen_q(b)) x [0,
 * seqlen_kv(b)), with the plan's mask aligned to those lengths on top. Such
 * a plan runs sequence by sequence, one plan per distinct lengths (and mask
 * entry), on both backends (attn_plan_describe's algorithm is then
 * "flash-block-sparse-per-sequence-online-softmax"): batches of many short
 * sequences pay one launch
 * sequence each.
 *
 * A block mask is not thread-safe while being modified; a plan descriptor
 * copies it, so it may be changed or destroyed afterwards. */

typedef struct attn_block_mask *attn_block_mask_t;

/* In uint64_t arithmetic: 65536 x 65536 bits would overflow an int. */
#define ATTN_BLOCK_MASK_TILE_BYTES(block_q, block_kv) \
  (((uint64_t)(block_q) * (uint64_t)(block_kv) + 7u) / 8u)

/* Creates an empty block mask (no block listed: it selects nothing).
 * Ranges: batch >= 1, heads >= 1, seqlen in 0..2^31 - 1 (the lengths a plan
 * takes), block sizes 1..65536, and at most 2^31 - 1 rows (batch x
 * heads x query blocks; the message names batch and heads). A mask holds
 * at most 2^31 - 1 partial blocks (with bit tiles): a call that would make
 * more fails with INVALID_ARGUMENT, the mask unchanged. On success *mask owns a new mask; free
 * it with attn_block_mask_destroy. Returns SUCCESS, INVALID_ARGUMENT,
 * OUT_OF_MEMORY. */
ATTN_API attn_status_t attn_block_mask_create(int64_t batch, int64_t heads, int64_t seqlen_q,
                                              int64_t seqlen_kv, int64_t block_q,
                                              int64_t block_kv, attn_block_mask_t *mask);

/* NULL is a no-op. Returns SUCCESS or INVALID_HANDLE. */
ATTN_API attn_status_t attn_block_mask_destroy(attn_block_mask_t mask);

/* Replaces the mask's contents with the given tables (layouts above; only
 * the first count entries of each index row are read). kv_num_blocks and
 * kv_indices are both NULL (no partial block) or both given, likewise the
 * full pair; partial_bits may be NULL (every partial block selects all its
 * elements). Each count is in 0..min(max, num_kv_blocks); each index in
 * 0..num_kv_blocks-1; no index may repeat within a row, partial and full
 * together. max_partial / max_full >= 1 when their tables are given, and
 * the tables they describe (rows x max entries of 4 bytes, rows x
 * max_partial bit tiles) at most 2^62 bytes each, checked before any is
 * read (the message names max_partial or max_full). The
 * arrays are copied. Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (the
 * message names the table and the entry), OUT_OF_MEMORY; on failure the
 * mask is unchanged. */
ATTN_API attn_status_t attn_block_mask_set_blocks(attn_block_mask_t mask,
                                                  const int32_t *kv_num_blocks,
                                                  const int32_t *kv_indices, int32_t max_partial,
                                                  const uint8_t *partial_bits,
                                                  const int32_t *full_kv_num_blocks,
                                                  const int32_t *full_kv_indices,
                                                  int32_t max_full);

/* As attn_block_mask_set_blocks, for tables in the memory ctx's backend
 * computes on: device memory of ctx's device on the CUDA backend (e.g.
 * FlexAttention's BlockMask tensors where torch made them), host memory on
 * the CPU backend. On CUDA the tables are read in the order of `stream` (a
 * cudaStream_t; NULL: the legacy default stream), so work queued before on
 * it that writes them is waited for, and the call returns once they are
 * copied to the host (the mask lives in host memory; plans upload their
 * own tile lists). stream is ignored on the CPU backend. Returns SUCCESS,
 * INVALID_HANDLE (mask, ctx), INVALID_ARGUMENT (as attn_block_mask_set_blocks,
 * or a table that is not memory of ctx's device: the message names it),
 * BACKEND_ERROR (a CUDA failure while copying), OUT_OF_MEMORY; on failure
 * the mask is unchanged. */
ATTN_API attn_status_t attn_block_mask_set_device_blocks(
    attn_block_mask_t mask, attn_context_t ctx, void *stream, const int32_t *kv_num_blocks,
    const int32_t *kv_indices, int32_t max_partial, const uint8_t *partial_bits,
    const int32_t *full_kv_num_blocks, const int32_t *full_kv_indices, int32_t max_full);

/* The longest row of partial and of full blocks (0 where a mask has none):
 * attn_block_mask_get_blocks accepts max_partial and max_full of at least
 * these and at least 1. Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT
 * (an output NULL). */
ATTN_API attn_status_t attn_block_mask_get_max_blocks(attn_block_mask_t mask,
                                                      int32_t *max_partial, int32_t *max_full);

/* Reads the (canonical) contents back into tables laid out as for
 * attn_block_mask_set_blocks, indices sorted; unused index slots are -1 and
 * unused bit tiles zero. partial_bits may be NULL; every other pointer is
 * required. max_partial and max_full must be at least what
 * attn_block_mask_get_max_blocks reports (and >= 1), and the tables they
 * describe at most 2^62 bytes each, as for attn_block_mask_set_blocks. Returns SUCCESS,
 * INVALID_HANDLE, INVALID_ARGUMENT (nothing written then). */
ATTN_API attn_status_t attn_block_mask_get_blocks(attn_block_mask_t mask, int32_t *kv_num_blocks,
                                                  int32_t *kv_indices, int32_t max_partial,
                                                  uint8_t *partial_bits,
                                                  int32_t *full_kv_num_blocks,
                                                  int32_t *full_kv_indices, int32_t max_full);

/* ORs a materialised boolean mask into the mask: visible[b][h][i][j]
 * (uint8, nonzero = selected), [batch][heads][seqlen_q][seqlen_kv] of the
 * mask, host memory, read only during the call. Blocks whose in-range
 * elements are all selected become full, others partial with bits.
 * Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (visible NULL, or
 * more than 2^62 bytes of it), OUT_OF_MEMORY; on failure the mask is
 * unchanged. */
ATTN_API attn_status_t attn_block_mask_add_dense(attn_block_mask_t mask, const uint8_t *visible);

/* Pattern builders. Each selects elements by a rule on (query i, key j) of
 * one sequence, the same for every batch and head of the mask, and ORs them
 * into the mask (attn_block_mask_and_documents ANDs), keeping the canonical
 * form; so patterns compose, and with the plan's dense mask (e.g. a causal
 * plan with a window, sinks and global rows). Windows and strides are
 * measured from the aligned diagonal d(i) = i + seqlen_kv - seqlen_q, as
 * the plan's masks. They cost at most O(seqlen_q * seqlen_kv) per call.
 * Each returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (the mask is then
 * unchanged), OUT_OF_MEMORY. */

/* Keys d(i) - left <= j <= d(i) + right (inclusive; -1 = unbounded):
 * sliding windows of any width, aligned with the blocks or not. */
ATTN_API attn_status_t attn_block_mask_add_window(attn_block_mask_t mask, int64_t left,
                                                  int64_t right);

/* Every query sees the keys keys[0..count) (0 <= key < seqlen_kv): sink
 * tokens (StreamingLLM: keys 0..n-1) and Longformer's global tokens as
 * keys. keys may be NULL when count is 0. */
ATTN_API attn_status_t attn_block_mask_add_global_keys(attn_block_mask_t mask,
                                                       const int64_t *keys, int64_t count);

/* The queries queries[0..count) (0 <= query < seqlen_q) see every key:
 * Longformer's global tokens as queries. */
ATTN_API attn_status_t attn_block_mask_add_global_queries(attn_block_mask_t mask,
                                                          const int64_t *queries, int64_t count);

/* Keys j with d(i) - j a multiple of stride (>= 1): the strided head of the
 * Sparse Transformer (with a causal plan, j <= d(i)); its local head is a
 * window (stride - 1, 0). */
ATTN_API attn_status_t attn_block_mask_add_strided(attn_block_mask_t mask, int64_t stride);

/* For every (batch, head, query block) row, blocks_per_row (0..num_kv_blocks)
 * distinct whole key blocks chosen at random: BigBird's random blocks
 * (BigBird = window + global keys and queries + random blocks). The draw is
 * fixed by seed, on every platform: with state = seed, rows in the order
 * [batch][heads][query block], a row starts from perm = 0..num_kv_blocks-1
 * and for t = 0..blocks_per_row-1 swaps perm[t] with perm[t + x % (n - t)]
 * (n = num_kv_blocks) and selects perm[t], where x is splitmix64's next
 * output: state += 0x9E3779B97F4A7C15, z = state,
 * z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9, z = (z ^ z >> 27) *
 * 0x94D049BB133111EB, x = z ^ z >> 31 (uint64 arithmetic). */
ATTN_API attn_status_t attn_block_mask_add_random_blocks(attn_block_mask_t mask,
                                                         int32_t blocks_per_row, uint64_t seed);

/* Document masking for packed sequences: keeps only the selected pairs
 * whose query and key belong to the same document, doc_q[b][i] ==
 * doc_kv[b][j], with doc_q [batch][seqlen_q] and doc_kv [batch][seqlen_kv]
 * (the mask's batch) any int32 document ids. An AND: call it after the
 * builders whose selection it restricts (e.g. a window, or every block via
 * attn_block_mask_add_window(mask, -1, -1)) and before any whose selection
 * should cross documents. */
ATTN_API attn_status_t attn_block_mask_and_documents(attn_block_mask_t mask, const int32_t *doc_q,
                                                     const int32_t *doc_kv);

/* Attaches a copy of `mask` to the plan descriptor (NULL detaches it).
 * Checked at plan creation: the mask's batch (1 or the plan's), heads (1
 * or heads_kv), seqlen_q and seqlen_kv (the plan's; with a varlen batch,
 * the longest sequence's: see the block mask section above);
 * and rows left without any visible key are
 * rejected unless attn_plan_desc_set_allow_empty_rows was called. Returns
 * SUCCESS, INVALID_HANDLE (desc, or a mask that is not NULL and not live),
 * OUT_OF_MEMORY. */
ATTN_API attn_status_t attn_plan_desc_set_block_mask(attn_plan_desc_t desc,
                                                     attn_block_mask_t mask);

/* ------------------------------------------------------------------------ */
/* MoBA: a learned block selector                                            */
/* ------------------------------------------------------------------------ */

/* Mixture of Block Attention (MoBA): each query picks, at run time, the key
 * blocks it attends to. Keys are cut into blocks of block_size (the last
 * may be ragged), each sequence's on its own in a varlen batch (its
 * lengths being seqlen_q and seqlen_kv below). For query i with aligned
 * diagonal d = i + seqlen_kv - seqlen_q, its own block is d / block_size;
 * every block before it is a
 * past block, and the gate of past block kb is
 *
 *     g(i, kb) = sum over the selecting heads of  q_i . mean(K of block kb)
 *
 * (no softmax scale; fp32 sums over channels in order, then over heads).
 * The query sees the keys of its own block (causally) and of the top_k past
 * blocks with the largest gates (all of them when there are fewer); equal
 * gates prefer the lower block index, and a NaN gate ranks above every
 * number (so that a NaN in q or in a block's keys reaches the output, as in
 * dense attention). Later blocks are never seen. With
 * shared_per_group = 1 the selecting heads are the query heads of a GQA
 * group and the group shares one selection; with 0 each query head selects
 * on its own. The selection is a constant for the backward pass: the gate
 * gets no gradient. The plan's mask must be ATTN_MASK_CAUSAL.
 *
 * block_size 0 turns MoBA off (the default); otherwise 1..65536, top_k >= 0,
 * shared_per_group 0 or 1. Checked at plan creation: the mask, no block mask
 * at the same time (NOT_SUPPORTED). A top_k that covers every past block
 * (top_k >= ceil(seqlen_kv / block_size) - 1, with a varlen batch's longest
 * seqlen_kv) selects the
 * whole causal mask: that plan runs as the dense causal plan on either
 * backend (attn_plan_describe's algorithm then starts with
 * "moba-keeps-every-block:"; ring plans refuse MoBA all the same), and the
 * CUDA limits below do not apply. The
 * CUDA backend (forward and backward, the passes' workspaces holding the
 * selection) needs block_size a multiple of 128 and top_k <= 32, else
 * NOT_SUPPORTED; a varlen batch runs there as one fixed-length plan per
 * sequence length, sequence after sequence on the stream (algorithm
 * "flash-moba-per-sequence-online-softmax"; a kept selection is then
 * NOT_SUPPORTED); its gates are as accurate as fp32 dot products (computed
 * on tensor cores from fp32 values split into three bf16 terms: within 2^-22
 * RMS of the exact product, relative to sqrt(sum_c (q_c mean_c)^2), on the
 * GPU test's inputs, as an fp32 loop over the channels) but summed in another order than the CPU backend's, so the
 * two may pick differently between gates within a few fp32 roundings of
 * each other. attn_plan_describe's visible_pairs and
 * visited_tile_pairs are then upper bounds, since the selection depends on
 * the data; the workspace holds the pooled keys and the selection (on the
 * CUDA backend, whose default schedule gathers per block the rows that
 * chose it (see README), also those rows and, in the forward, an fp32
 * softmax state per query row). */
ATTN_API attn_status_t attn_plan_desc_set_moba(attn_plan_desc_t desc, int64_t block_size,
                                               int64_t top_k, int32_t shared_per_group);

/* MoBA plans with a backward pass: keep = 1 makes the forward leave its
 * selection (the block means and the blocks every row chose) at the start
 * of its workspace and the backward read it there instead of selecting
 * again (on an H200 at L = 32K, 16 heads, block 512, top 3 the selection
 * is about a tenth of the backward's time). The backward must then be
 * given the workspace of the forward that made O and LSE from the same Q
 * and K, unchanged since (a reserve space, as cuDNN's RNNs have: one buffer
 * of the larger of the two passes' workspace sizes serves both); it cannot
 * check that, and reads whatever selection lies there. keep = 0, the
 * default, has each pass select on its own. Checked at plan creation: keep
 * = 1 on a plan without MoBA or without a backward pass is INVALID_ARGUMENT;
 * on a MoBA plan that keeps every block (the dense causal plan) it has no
 * effect. attn_plan_describe's algorithm says "+kept-selection" when the
 * passes share it. Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (keep
 * not 0 or 1). */
ATTN_API attn_status_t attn_plan_desc_set_moba_keep_selection(attn_plan_desc_t desc,
                                                              int32_t keep);

/* ------------------------------------------------------------------------ */
/* Streaming KV cache and decode plans                                       */
/* ------------------------------------------------------------------------ */

/* The state an inference server keeps between steps: a paged KV cache that
 * owns (or is given) memory for pages of keys and values, sequences that are
 * added, grow by appended tokens, fork and are released, and decode plans
 * that attend from each sequence's newest tokens to everything the cache
 * holds for it.
 *
 * Positions are absolute: token t of a sequence (0-based, in append order)
 * stays at position t, also when older pages are evicted by a rolling
 * window. Masks are applied by position.
 *
 * Stream order (CUDA backend): pages freed by attn_kv_cache_release,
 * attn_kv_cache_truncate or a window's eviction return to the pool at once,
 * on the host, and the next append may write another sequence's tokens
 * into them on its stream. Work enqueued earlier that still reads them (a
 * decode step) must be ordered before the appends that follow (running a
 * cache's appends and decode steps on one stream does that; else an event).
 *
 * Thread-safety of a cache: the mutating calls (append, add, fork, truncate,
 * release, destroy) must not run concurrently with each other, nor with
 * attn_decode_prepare / attn_decode_execute on the same cache; the library
 * does not lock. Read-only queries (attn_kv_cache_get_info,
 * attn_kv_cache_sequence_length) and several attn_decode_execute calls (with
 * distinct workspaces and outputs) may run at the same time. */

/* How a page stores its tokens. */
typedef enum attn_kv_layout ATTN_ENUM_BASE {
  /* Token-major: K page [page_size, heads_kv, head_dim_qk], V page
   * [page_size, heads_kv, head_dim_v]. */
  ATTN_KV_LAYOUT_NHD = 0,
  /* Head-major: K page [heads_kv, page_size, head_dim_qk], V page
   * [heads_kv, page_size, head_dim_v]. */
  ATTN_KV_LAYOUT_HND = 1
} attn_kv_layout_t;

/* A cache's fixed configuration. Size-tagged: set struct_size =
 * sizeof(attn_kv_cache_config_t); fields are only ever appended. A smaller
 * struct_size (a caller built against an older header) gives the appended
 * fields their default, zero; a larger one (a newer header) must have only
 * zero bytes past what this library knows, which is at most 4096 bytes in
 * all, else INVALID_ARGUMENT: a field this library would ignore is refused
 * rather than dropped. The same holds for attn_decode_config_t.
 *
 * Rolling window: with window = w > 0, the query at position p sees the keys
 * at positions p - w + 1 .. p (w keys, itself included) and the sink tokens
 * at positions 0 .. sink_tokens - 1. Appending to a sequence of n tokens
 * first frees the pages that lie wholly below position n - w + 1 and hold
 * no sink token: no query of that append or a later one can see them. A
 * sequence therefore holds at most about (sink_tokens + w + tokens appended
 * in one call) / page_size + 2 pages, however long it grows. window = 0
 * keeps every token (and then sink_tokens must be 0).
 *
 * Sizes: the pool, num_pages x page_size x heads_kv x (head_dim_qk +
 * head_dim_v) elements, is at most 1e18 (4e18 bytes at 4 bytes an element;
 * the message names the fields). */
typedef struct attn_kv_cache_config {
  uint64_t struct_size;
  int32_t dtype;        /* attn_dtype_t of K and V */
  int32_t layout;       /* attn_kv_layout_t */
  int64_t page_size;    /* tokens per page, >= 1 */
  int64_t num_pages;    /* pages in the pool, 1 .. 2^31 - 1 */
  int64_t heads_kv;     /* 1 .. 2^31 - 1 */
  int64_t head_dim_qk;  /* 1 .. 1024 */
  int64_t head_dim_v;   /* 1 .. 1024 */
  int64_t window;       /* 0: no window; else w in 1..2^60 as above */
  int64_t sink_tokens;  /* 0..2^60; only with a window */
} attn_kv_cache_config_t;

/* Bytes of page memory a cache of *config needs, for callers that supply it
 * (attn_kv_cache_create with memory != NULL). It includes slack so that any
 * base address works: the memory needs no particular alignment. Returns
 * SUCCESS, INVALID_ARGUMENT (config or bytes NULL, a field out of range; the
 * message names the field). Thread-safe. */
ATTN_API attn_status_t attn_kv_cache_memory_size(const attn_kv_cache_config_t *config,
                                                 size_t *bytes);

/* Creates a cache on ctx's backend.
 *   memory, memory_bytes  NULL and 0: the library allocates the page memory
 *                 and frees it in attn_kv_cache_destroy (on the CUDA
 *                 backend with cudaMalloc on ctx's device). Otherwise the
 *                 caller's memory (host memory on the CPU backend, device
 *                 memory of ctx's device on the CUDA backend) of at least
 *                 attn_kv_cache_memory_size() bytes; it stays owned by the
 *                 caller, must outlive the cache and is not touched by
 *                 anyone else meanwhile.
 * The bookkeeping (page tables, reference counts) is small host memory that
 * the library always allocates, on every backend: fork, release, eviction
 * and the CAPACITY check are host steps. On success *cache owns a new,
 * empty cache. Returns
 * SUCCESS, INVALID_HANDLE (ctx), INVALID_ARGUMENT (config, memory_bytes too
 * small, memory NULL with memory_bytes != 0), NOT_SUPPORTED (no CUDA backend
 * in this build; on the CUDA backend, page_size past 2^31 - 1, which its
 * kernels hold in 32 bits), OUT_OF_MEMORY, BACKEND_ERROR (CUDA: the pool's
 * allocation failed otherwise than for memory).
 * On failure *cache is unchanged. */
ATTN_API attn_status_t attn_kv_cache_create(attn_context_t ctx,
                                            const attn_kv_cache_config_t *config, void *memory,
                                            size_t memory_bytes, attn_kv_cache_t *cache);

/* NULL is a no-op. Returns SUCCESS or INVALID_HANDLE. Releases every
 * sequence and, when the library allocated it, the page memory. */
ATTN_API attn_status_t attn_kv_cache_destroy(attn_kv_cache_t cache);

/* Adds an empty sequence (length 0, no page) under the caller's id, any
 * seq_id >= 0 not live in this cache. Returns SUCCESS, INVALID_HANDLE,
 * INVALID_ARGUMENT (negative or live seq_id), OUT_OF_MEMORY. */
ATTN_API attn_status_t attn_kv_cache_add_sequence(attn_kv_cache_t cache, int64_t seq_id);

/* Appends num_tokens[i] tokens to sequence seq_ids[i] for i < num_seqs: a
 * prefill chunk or one decode token each. k is [total, heads_kv,
 * head_dim_qk] and v [total, heads_kv, head_dim_v], contiguous, in the
 * cache's dtype, holding the sequences' tokens back to back in the order of
 * seq_ids (total = sum of num_tokens). Host memory on the CPU backend
 * (stream ignored, the copy is done on return). On the CUDA backend k and
 * v are device memory and the copies into the pages (and the copy-on-write
 * page copies) are enqueued on `stream` (a cudaStream_t, NULL: the legacy
 * default stream) without synchronising the host: k and v must stay valid
 * until the stream has run them, and decode steps that read the pages must
 * be ordered after them (the same stream, or an event). The ids must be
 * live and distinct; num_tokens[i] >= 0.
 * All or nothing: the pages the whole batch needs (new pages, and a copy of
 * a shared, partly filled last page, see attn_kv_cache_fork) are counted
 * first; if the pool has too few free pages the call returns CAPACITY and
 * changes nothing (lengths, pages in use and contents stay as they were;
 * on the CUDA backend every check is made on the host before anything is
 * enqueued).
 * Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (NULL arrays, num_seqs <
 * 1 or more than the live sequences, unknown or repeated id, negative
 * count, k or v NULL with total > 0, a sequence that would need more pages
 * than the whole pool), CAPACITY,
 * OUT_OF_MEMORY (for the call's own bookkeeping; nothing changed then),
 * BACKEND_ERROR (CUDA backend: the copies could not be enqueued, e.g. on
 * a failed device context or an invalid stream; the sequences' lengths
 * have advanced over tokens whose contents are undefined: release them). */
ATTN_API attn_status_t attn_kv_cache_append(attn_kv_cache_t cache, int32_t num_seqs,
                                            const int64_t *seq_ids, const int32_t *num_tokens,
                                            const void *k, const void *v, void *stream);

/* Creates sequence child_id holding the first num_tokens tokens of
 * parent_id (0 <= num_tokens <= the parent's length), as beam search and
 * prompt caching use. No data is copied: the child shares the parent's
 * pages, which are reference-counted; a shared page that is partly filled
 * is copied by whichever sequence appends into it first (copy-on-write),
 * so neither sequence ever sees the other's later tokens. In a windowed
 * cache the tokens the child's next token will see must not have been
 * evicted from the parent; the child also keeps the older ones the parent
 * still holds, so that a decode step over the child's last tokens works
 * wherever it works over the parent's. Returns SUCCESS, INVALID_HANDLE,
 * INVALID_ARGUMENT (unknown
 * parent, negative or live child_id, num_tokens out of range or evicted),
 * OUT_OF_MEMORY. */
ATTN_API attn_status_t attn_kv_cache_fork(attn_kv_cache_t cache, int64_t parent_id,
                                          int64_t child_id, int64_t num_tokens);

/* Shortens seq_id to its first num_tokens tokens (0 <= num_tokens <= its
 * length), e.g. to drop the draft tokens speculative decoding rejected: the
 * sequence keeps the pages attn_kv_cache_fork would give a child of that
 * length, and the others return to the pool once no other sequence shares
 * them; the next append continues at position num_tokens (a partly filled
 * last page that another sequence shares is copied first, as after a
 * fork). No data is copied or cleared. In a windowed cache it is refused
 * if the appends since already evicted keys that the token after
 * num_tokens would see. CUDA: see "Stream order" above. Returns SUCCESS, INVALID_HANDLE,
 * INVALID_ARGUMENT (seq_id not live, num_tokens out of range or evicted;
 * nothing changed), OUT_OF_MEMORY (nothing changed). */
ATTN_API attn_status_t attn_kv_cache_truncate(attn_kv_cache_t cache, int64_t seq_id,
                                              int64_t num_tokens);

/* Ends sequence seq_id; its pages return to the pool once no other
 * sequence shares them (CUDA: see "Stream order" above). Returns SUCCESS,
 * INVALID_HANDLE, INVALID_ARGUMENT (seq_id not live, e.g. released twice). */
ATTN_API attn_status_t attn_kv_cache_release(attn_kv_cache_t cache, int64_t seq_id);

/* The number of tokens appended to seq_id so far (evicted ones included:
 * the next token's position). Returns SUCCESS, INVALID_HANDLE,
 * INVALID_ARGUMENT (length NULL, seq_id not live). */
ATTN_API attn_status_t attn_kv_cache_sequence_length(attn_kv_cache_t cache, int64_t seq_id,
                                                     int64_t *length);

/* A report of a cache's use. Size-tagged as attn_plan_info_t. */
typedef struct attn_kv_cache_info {
  uint64_t struct_size;
  int64_t num_pages;        /* pages in the pool */
  int64_t pages_in_use;     /* pages held by at least one sequence */
  int64_t num_sequences;    /* live sequences */
  int64_t page_size;        /* tokens per page */
  uint64_t bytes_per_token; /* K and V bytes of one token, all KV heads */
  uint64_t memory_bytes;    /* page memory of the pool, both K and V:
                             * num_pages * page_size * bytes_per_token */
  int32_t owns_memory;      /* 1 when the library allocated the memory */
  int32_t reserved;         /* 0 */
} attn_kv_cache_info_t;

/* Fills *info (the fields that fit in info->struct_size). Returns SUCCESS,
 * INVALID_HANDLE, INVALID_ARGUMENT (info NULL or struct_size too small). */
ATTN_API attn_status_t attn_kv_cache_get_info(attn_kv_cache_t cache, attn_kv_cache_info_t *info);

/* A decode (or chunked-prefill) plan: the newest q_len tokens of each
 * sequence of a batch attend to everything the cache holds for it. Query
 * token t of a sequence whose cache holds n tokens (the new ones included:
 * append first, then attend) is at position n - q_len + t and sees the
 * keys at positions <= its own, limited by the cache's window and sinks.
 * q_len > 1 serves speculative decoding (attn_kv_cache_truncate then drops
 * the rejected draft tokens) and chunked prefill.
 *
 * Use: attn_decode_plan_create (once) -> attn_decode_plan_workspace_size ->
 * per step: append the new tokens' K/V, attn_decode_prepare (a host step
 * that writes the batch's page tables and split into the workspace) ->
 * attn_decode_execute (reads only the workspace, the cache's pages and Q).
 *
 * Tensors of one step (contiguous, in the cache's dtype; LSE fp32):
 *   Q   [total_q, heads_q, head_dim_qk]  the batch's query tokens back to
 *       back in the order of seq_ids (total_q = sum of query_lens)
 *   O   [total_q, heads_q, head_dim_v]
 *   LSE [heads_q, total_q]               natural log, as for varlen plans
 * Query head h uses KV head h / (heads_q / heads_kv); the query heads of a
 * group (and all query tokens of a sequence) are processed together so
 * that each K/V page is loaded once per group.
 *
 * Split-KV: when a batch has too few (sequence, KV head) pairs to occupy
 * the threads, long sequences are cut into chunks of whole pages processed
 * in parallel, and the chunks' (O, LSE) states are merged as
 * attn_merge_states does. A chunk is a run of the pages a sequence's
 * queries read (with a window: its sink pages and the window's), and the
 * sequences of a step are cut at one chunk length. attn_decode_prepare
 * chooses the split from the batch and reports it. */
typedef struct attn_decode_plan *attn_decode_plan_t;

/* Size-tagged as attn_kv_cache_config_t. */
typedef struct attn_decode_config {
  uint64_t struct_size;
  int64_t heads_q;          /* 1 .. 2^31 - 1, a multiple of the cache's heads_kv */
  int64_t max_batch;        /* sequences per step, 1 .. 2^24 */
  int64_t max_query_tokens; /* query tokens per sequence per step, 1 .. 2^24 */
  /* Most keys one sequence's queries may see, >= 0; it bounds the
   * workspace. 0: the cache's capacity (num_pages * page_size); for a
   * windowed cache, at most sink_tokens + window + max_query_tokens - 1,
   * all that the queries of one step can see. The workspace's page lists
   * are bounded: max_batch * (max_kv_tokens / page_size + 2) must stay
   * within 1e10 entries (the default max_kv_tokens counts too: a large
   * pool of small pages with a large max_batch may need an explicit one). */
  int64_t max_kv_tokens;
  /* Split-KV: 0 lets attn_decode_prepare choose; -1 never splits; n > 0
   * splits every sequence into chunks of n tokens rounded up to whole
   * pages (for tuning, and for tests that compare split and unsplit). */
  int64_t kv_chunk_tokens;
  float softmax_scale;      /* > 0, or 0 for 1/sqrt(head_dim_qk) */
  float softcap;            /* 0 .. 1e30; 0 disables, see attn_plan_desc_set_softcap */
} attn_decode_config_t;

/* Creates a decode plan for caches configured like `cache` (dtype, layout,
 * page size, heads, head dims, window, sinks, pool size; the plan copies
 * them and may then run on any cache so configured, on ctx's backend).
 * The CUDA backend runs fp16 and bf16 caches with head_dim_qk ==
 * head_dim_v of 64 or 128 and max_query_tokens * (heads_q / heads_kv) <=
 * 1024, on sm_80 or newer, both page layouts; it allocates a pinned host
 * staging area for attn_decode_prepare (the size of the workspace's
 * metadata). Returns SUCCESS, INVALID_HANDLE (ctx, cache), INVALID_ARGUMENT
 * (config NULL, a field out of range, heads_q not a multiple of heads_kv,
 * limits past the page-list bound at max_kv_tokens, a cache on another
 * backend than ctx; the message names it),
 * NOT_SUPPORTED (what the CUDA kernel lacks, named), OUT_OF_MEMORY,
 * BACKEND_ERROR (CUDA: a device query, the kernels' attributes, the pinned
 * staging area or its event failed). On
 * success *plan owns a new plan; free it with attn_decode_plan_destroy (it
 * does not keep the cache alive). On failure *plan is unchanged. A plan is
 * immutable: several threads may use it at once with distinct workspaces. */
ATTN_API attn_status_t attn_decode_plan_create(attn_context_t ctx, attn_kv_cache_t cache,
                                               const attn_decode_config_t *config,
                                               attn_decode_plan_t *plan);

/* NULL is a no-op. Returns SUCCESS or INVALID_HANDLE. */
ATTN_API attn_status_t attn_decode_plan_destroy(attn_decode_plan_t plan);

/* Workspace bytes one step needs, for any batch within the plan's limits.
 * Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (bytes NULL). */
ATTN_API attn_status_t attn_decode_plan_workspace_size(attn_decode_plan_t plan, size_t *bytes);

/* What one prepared step runs. Size-tagged. */
typedef struct attn_decode_step_info {
  uint64_t struct_size;
  int64_t total_q;            /* query tokens of the batch */
  int64_t num_work_units;     /* (sequence, KV chunk) pairs; x heads_kv tasks */
  int64_t split_sequences;    /* sequences cut into more than one chunk */
  int64_t max_chunks;         /* most chunks of one sequence */
  int64_t kv_chunk_tokens;    /* chunk length used (0: no split) */
  uint64_t visible_pairs;     /* (query, key) pairs, all query heads */
  double kv_bytes_read;       /* K and V bytes of the pages the step reads */
} attn_decode_step_info_t;

/* The host step of one decode step: checks the batch against the cache
 * and writes into `workspace` (host memory on the CPU backend) the
 * metadata that attn_decode_execute reads: each sequence's length, the
 * pages it reads and the split. Sequence seq_ids[i] contributes
 * query_lens[i] query tokens (1 .. max_query_tokens, at most its length).
 * Ids may repeat. Metadata are tied to the cache's state: any mutation of
 * the cache makes them stale, and attn_decode_execute then refuses them.
 * info may be NULL. stream is for device backends, where the metadata go
 * to the device workspace in the stream's order (so a captured execute can
 * be replayed after each prepare); the CPU backend ignores it.
 * CUDA: the workspace is device memory. The metadata are written into the
 * plan's pinned staging area and copied to the workspace with
 * cudaMemcpyAsync on `stream`. Prepares of one plan are serialised, and
 * each first waits (on the host) until the previous prepare's copies have
 * run, so that the staging area can be reused: a prepare may block until
 * the work queued before the last prepare's copies on its stream is done.
 * A CUDA graph that captured attn_decode_execute may be replayed after
 * each prepare into the same workspace (same plan, cache, Q/O/LSE
 * pointers, a batch within the plan's limits): under capture the kernels'
 * launch shape depends only on the plan. Outside capture, execute launches
 * exactly the blocks of the workspace's last prepare on the host, so the
 * device must then read that prepare's metadata: order a later prepare
 * into the same workspace after the executes of the earlier one (the same
 * stream does). Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT
 * (num_seqs outside 1 .. max_batch, NULL arrays, unknown id, query_lens out
 * of range, a cache configured differently from the plan's, more visible
 * keys than max_kv_tokens, keys the queries need were evicted,
 * info->struct_size below its first two fields, 16 bytes),
 * WORKSPACE_TOO_SMALL, OUT_OF_MEMORY (the host step builds the metadata in
 * host memory first), BACKEND_ERROR (CUDA: the staging copy or its event
 * failed). On failure *info is not written, and neither is the workspace
 * unless a failed copy had started into it (then it holds no prepared
 * step). */
ATTN_API attn_status_t attn_decode_prepare(attn_decode_plan_t plan, attn_kv_cache_t cache,
                                           int32_t num_seqs, const int64_t *seq_ids,
                                           const int32_t *query_lens, void *workspace,
                                           size_t workspace_bytes,
                                           attn_decode_step_info_t *info, void *stream);

/* Runs the prepared step: O (and LSE unless NULL) for every query token,
 * from Q and the cache's pages. Never allocates. stream as for
 * attn_forward. On the CUDA backend Q, O, LSE and the workspace are device
 * memory, and execute only enqueues kernels that read the workspace (a
 * decode kernel over (work unit, KV head) blocks, then a combine kernel for
 * split sequences): it never synchronises and can be captured in a CUDA
 * graph. Whether the workspace was prepared by this plan for this cache's
 * current state, with no prepare by another plan into it since, is checked
 * on the host against the library's record of the last prepare into that
 * workspace (a graph replay checks nothing). A workspace is known by its
 * address: a prepare into another buffer that overlaps it is not noticed,
 * so give each plan's workspaces distinct, non-overlapping buffers.
 * On CUDA, q must be 16-byte aligned, o aligned to its element and lse to 4
 * bytes. Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (q or o NULL or
 * misaligned, a workspace not prepared by this plan for this cache's current state),
 * WORKSPACE_TOO_SMALL, BACKEND_ERROR (CUDA: a launch failed; outputs the
 * kernels had started on are undefined). Other failures write no output. */
ATTN_API attn_status_t attn_decode_execute(attn_decode_plan_t plan, attn_kv_cache_t cache,
                                           const void *q, void *o, float *lse, void *workspace,
                                           size_t workspace_bytes, void *stream);

/* What a decode plan runs. Size-tagged. */
typedef struct attn_decode_plan_info {
  uint64_t struct_size;
  int32_t backend;            /* attn_backend_t */
  int32_t dtype;              /* attn_dtype_t */
  int64_t heads_q, heads_kv;
  int64_t max_batch, max_query_tokens, max_kv_tokens;
  int64_t kv_chunk_tokens;    /* the configured split policy (0 auto, -1 never) */
  int32_t num_threads;
  int32_t reserved;           /* 0 */
  uint64_t workspace_bytes;
  char algorithm[64];         /* "paged-decode-gqa-packed-split-kv", or without
                                 "-split-kv" where the plan never splits (-1,
                                 or automatic with nothing to split over) */
  char kernel[64];            /* "cpu-scalar", "cuda-sm80-mma-paged" */
  /* Appended: the automatic split (kv_chunk_tokens 0). A step's tasks are
   * (work unit, KV head, tile of 16 packed query rows) on CUDA and (work
   * unit, KV head) on the CPU. split_target_tasks is how many run at once:
   * CUDA, the decode blocks resident per SM times the SMs; CPU, the
   * threads; 0: the plan does not split by itself. Prepare splits a batch
   * with fewer tasks than that (CPU: fewer than the threads) into chunks of
   * whole pages, at least split_min_chunk_tokens long (CUDA: the count that
   * fills whole waves of split_target_tasks best, at most two waves; CPU:
   * with T tasks and P the most pages a sequence of the batch reads,
   * max(ceil(P / ceil(2 threads / T)), ceil(split_min_chunk_tokens /
   * page_size)) pages, so at most ceil(2 threads / T) chunks). */
  int64_t split_target_tasks;
  int64_t split_min_chunk_tokens;
} attn_decode_plan_info_t;

/* Fills *info. Returns SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (info NULL
 * or struct_size too small). */
ATTN_API attn_status_t attn_decode_plan_describe(attn_decode_plan_t plan,
                                                 attn_decode_plan_info_t *info);

/* ------------------------------------------------------------------------ */
/* Ring attention: sequences split over ranks                                */
/* ------------------------------------------------------------------------ */

/* A sequence too long for one device is split over the N ranks of a
 * communicator. Each rank keeps its shard of the queries; the key/value
 * shards travel around the ring (rank r sends to r + 1 and receives from
 * r - 1) while each rank attends to the shard it holds and merges the
 * result into its running (O, LSE) state. After N steps every rank has O and
 * LSE of its own queries over the whole sequence, exactly as a dense plan
 * over the whole sequence would give them (up to rounding). Rounding: the
 * CPU backend keeps each step's partial O, dQ, dK and dV in fp32; the CUDA
 * backend's dense kernels write them in the dtype, so each step's part
 * carries one rounding to fp16/bf16 into the fp32 merge and sums (dK and
 * dV, sums of N parts, up to N such roundings of the parts' magnitude).
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
 * global meaning (bottom-right alignment over the global lengths).
 *
 * Varlen batches (attn_plan_desc_set_varlen): each sequence b is
 * cut alike, its own lengths Lq_b and Lk_b into N (CONTIGUOUS) or 2N
 * (ZIGZAG) equal chunks, so every Lq_b and Lk_b must be a multiple of N
 * (2N). Rank r holds, for every sequence in order, its chunk(s) of that
 * sequence, packed back to back (THD): Q, O, dO, dQ [sum_b Lq_b / N,
 * heads_q, dim], K, V, dK, dV [sum_b Lk_b / N, heads_kv, dim], LSE
 * [heads_q, sum_b Lq_b / N]. The cu_seqlens given to the descriptor are the
 * GLOBAL ones, the same on every rank; each sequence keeps its own
 * bottom-right alignment, as in a dense varlen plan.
 *
 *   e.g. N = 2, ZIGZAG, lengths 4 and 8 (cu_seqlens {0, 4, 12}):
 *     rank 0 holds a0 | a3 | b0 b1 | b6 b7    (6 tokens)
 *     rank 1 holds a1 | a2 | b2 b3 | b4 b5    (6 tokens)  */

typedef enum attn_ring_layout ATTN_ENUM_BASE {
  ATTN_RING_LAYOUT_CONTIGUOUS = 0,
  ATTN_RING_LAYOUT_ZIGZAG = 1
} attn_ring_layout_t;

/* Creates an in-process group of num_ranks communicators, for ranks that are
 * threads of this process (one context per rank; CPU backend). comms must
 * have room for num_ranks handles; comms[i] gets rank i. Every wait of an
 * exchange gives up after timeout_ms milliseconds (0, or 2^40 and more:
 * waits without bound) and then fails the group. Each handle is owned by the caller (destroy each
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
 * creates its plan; a mismatch fails all of them with COMMUNICATION_ERROR,
 * and so does a rank whose creation fails for a reason of its own, any but
 * an invalid comm handle: it returns that reason, its peers
 * COMMUNICATION_ERROR naming it). An execution returns once its ring is
 * enqueued on the stream: an NCCL error that arises after that is returned
 * (COMMUNICATION_ERROR) by the next ring plan creation or execution on the
 * communicator, and the outputs of the failed execution are undefined. A
 * rank that fails during an execution cannot stop its peers' enqueued NCCL
 * operations, nor tell its peers: its own stream then waits for its
 * enqueued exchanges (so that the workspace is not reused under them;
 * synchronising that stream before the communicator is aborted may wait
 * forever), and the application aborts the NCCL communicator
 * (ncclCommAbort) to release them. Returns SUCCESS,
 * INVALID_ARGUMENT (NULL), BACKEND_UNAVAILABLE (built without NCCL),
 * COMMUNICATION_ERROR (NCCL's message), BACKEND_ERROR, OUT_OF_MEMORY. */
ATTN_API attn_status_t attn_comm_create_nccl(void *nccl_comm, attn_comm_t *comm);

/* Destroys one rank's communicator. NULL is a no-op. Ring plans made from
 * it keep what they need alive (they must still be destroyed) but fail with
 * COMMUNICATION_ERROR from then on. In-process, leaving makes the group
 * unusable: every later ring execution of the other ranks fails
 * (COMMUNICATION_ERROR), and so does a running one that still waits for
 * this rank's part, instead of waiting for it; a peer still finishing an
 * execution whose exchanges with this rank are done is not disturbed, so
 * each rank may destroy its communicator as soon as its own call has
 * returned. (NCCL peers cannot be told; see attn_comm_create_nccl.)
 * Returns SUCCESS, INVALID_HANDLE or OUT_OF_MEMORY (the handle then stays
 * live and nothing happened). */
ATTN_API attn_status_t attn_comm_destroy(attn_comm_t comm);

/* This rank's index in 0..size-1, and the number of ranks. Returns SUCCESS,
 * INVALID_HANDLE, INVALID_ARGUMENT (out pointer NULL). Thread-safe. */
ATTN_API attn_status_t attn_comm_get_rank(attn_comm_t comm, int32_t *rank);
ATTN_API attn_status_t attn_comm_get_size(attn_comm_t comm, int32_t *size);

/* Creates this rank's ring plan for the problem `desc` describes with its
 * GLOBAL sequence lengths (the same descriptor a dense plan over the whole
 * sequence would take). Every rank of comm must create its plan from an
 * equal descriptor and layout; a mismatch fails every rank with
 * COMMUNICATION_ERROR (NCCL: at creation; in-process: at the first
 * exchange).
 * The plan is an ordinary attn_plan_t: attn_plan_workspace_size,
 * attn_forward and attn_backward take it with the rank's local tensors (see
 * above), attn_plan_describe reports the global problem's pairs, FLOPs and
 * bytes with this rank's workspace, and attn_ring_plan_describe the ring.
 * attn_forward and attn_backward on a ring plan are collective: every rank
 * calls the same pass with its shards; a rank returns when its own part of
 * the ring is done, its peers possibly still finishing theirs (NCCL:
 * enqueued on the stream; see attn_comm_create_nccl).
 * Their executions must not overlap on one communicator: one that starts
 * while another runs on the same rank's communicator returns
 * INVALID_ARGUMENT at once, writing nothing (the running one and the group
 * are unaffected). Nor may a ring plan's creation overlap an execution on
 * the same communicator (over NCCL, creation exchanges with the peers on
 * that communicator; this is not checked). In-process, a
 * failure of one rank during an execution fails the group: every rank
 * still in that execution returns COMMUNICATION_ERROR (outputs unwritten;
 * a rank whose part had already completed may have returned SUCCESS) and
 * the communicators are no longer usable; a rank that fails before it starts (an invalid
 * argument, a small workspace) is noticed by the others through their
 * timeout, or at once if it then destroys its communicator. NCCL peers are
 * not told (see attn_comm_create_nccl): they wait in their exchanges until
 * the application aborts the NCCL communicator.
 * Supported: CPU contexts with in-process communicators (full, causal and
 * window masks, GQA, softcap, head_dim_v != head_dim_qk, every dtype, BSHD,
 * BHSD and varlen batches), and CUDA contexts with NCCL communicators for
 * the same problems where the CUDA backend runs them (fp16 and bf16, its
 * head dimensions; see attn_plan_create). Not supported (NOT_SUPPORTED):
 * custom strides (attn_plan_desc_set_tensor), block masks, MoBA, and what
 * the backend rejects for a dense plan. A communicator of the other kind
 * than ctx's backend is INVALID_ARGUMENT.
 * On success *plan owns a new plan; free it with attn_plan_destroy (it keeps
 * what it needs of comm alive).
 * Returns SUCCESS, INVALID_HANDLE (ctx, desc, comm), INVALID_ARGUMENT
 * (layout, seqlen_q or seqlen_kv 0, lengths not divisible as the layout
 * needs (for varlen, the message names the first sequence that does not
 * divide), and whatever attn_plan_create rejects), NOT_SUPPORTED,
 * OUT_OF_MEMORY,
 * COMMUNICATION_ERROR (NCCL: the ranks' plans differ, or a peer's creation
 * failed; its own status says why), BACKEND_ERROR. On failure *plan is
 * unchanged. */
ATTN_API attn_status_t attn_ring_plan_create(attn_context_t ctx, attn_plan_desc_t desc,
                                             attn_comm_t comm, attn_ring_layout_t layout,
                                             attn_plan_t *plan);

/* What a ring plan does on this rank. Size-tagged like attn_plan_info_t. */
typedef struct attn_ring_plan_info {
  uint64_t struct_size;
  int32_t layout;             /* attn_ring_layout_t */
  int32_t rank;
  int32_t size;               /* ranks in the ring */
  int32_t steps;              /* attention steps per pass (= size) */
  int32_t exchanges_forward;  /* sends per forward: size - 1 */
  int32_t exchanges_backward; /* sends per backward: K/V size - 1 times, dK/dV size - 1
                                 times (the own shard's dK/dV stay home; 0 in all on 1
                                 rank); dK/dV size times in a plan created with
                                 ATTN_RING_DKV_HOME=0 (a plan without a backward pass
                                 reports what one would send) */
  int64_t local_seqlen_q;     /* positions of each sequence this rank holds
                                 (varlen: of all sequences together) */
  int64_t local_seqlen_kv;
  uint64_t bytes_per_step_forward;  /* bytes sent per forward exchange (K and V, dtype) */
  uint64_t bytes_per_step_backward; /* per backward step: K, V (dtype) and dK, dV (fp32) */
  uint64_t blocks_computed;   /* (query chunk, KV chunk) blocks run per pass on this rank */
  uint64_t blocks_skipped;    /* blocks the mask hides wholly, never run */
  uint64_t local_visible_pairs; /* (query, key) pairs computed on this rank, all heads */
  char transport[32];         /* "inprocess" or "nccl" */
} attn_ring_plan_info_t;

/* Fills *info (only the fields that fit info->struct_size). Returns
 * SUCCESS, INVALID_HANDLE, INVALID_ARGUMENT (info NULL, struct_size too
 * small, plan not a ring plan). Thread-safe. */
ATTN_API attn_status_t attn_ring_plan_describe(attn_plan_t plan, attn_ring_plan_info_t *info);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTN_ATTN_H */
