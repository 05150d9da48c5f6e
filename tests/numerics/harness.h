/*
 * The runner shared by the forward and backward numerics tests: one
 * nc_case describes a problem; nc_run builds it with random inputs, runs the
 * library and checks it against the fp64 reference.
 *
 * Tolerance rule (FlashAttention's): for every output tensor X,
 *
 *     max |X_lib - X_ref|  <=  2 * max |X_lowp - X_ref|  +  atol
 *
 * where X_ref is the fp64 reference and X_lowp the same computation done
 * the way a plain framework would in the test's dtype (reference.h). The
 * absolute term is
 *
 *     O:           (max(4 u, 1e-5) + 4 u32 Z) * M_O
 *     dQ, dK, dV:  (max(4 u, 1e-5) + 4 u32 Z) * M_grad  +  2 F
 *     LSE (fp32):  1e-5 * max(1, max |LSE_ref|)
 *
 *   u       the dtype's unit roundoff (2^-24, 2^-11, 2^-8); 4 u M is about
 *           two units in the last place at magnitude M, as FlashAttention's
 *           tests allow. u32 = 2^-24.
 *   M_O     the largest |element| of the reference O; M_grad that of all
 *           three reference gradients, so that a gradient that is zero in
 *           exact arithmetic (dQ of a row that sees a single key) may carry
 *           fp32 noise.
 *   Z       the largest |logit|. fp32 logits carry an error ~ u32 Z (the
 *           library works in base 2 with log2(e) folded into the scale,
 *           up to 1.44x the rounding of natural-unit logits); this only
 *           matters for fp32 with large logits, where the ratio of two fp32
 *           max errors is too noisy for the factor 2 alone. With softcap
 *           the error arises before the cap, from products the capped
 *           logit no longer shows, and the backward's 1 - tanh^2 scales
 *           it by up to 2 / cap: Z then follows ref_logit_error_scale.
 *   F       for dQ and dK (0 for dV): the largest error they can inherit from
 *           the O attn_backward receives, rounded to the dtype and off the
 *           exact O by the forward's own error, measured on the library's O
 *           (ref_backward_o_error_floor): an error floor of the API that
 *           dominates when rows are nearly one-hot or their keys alike (dP -
 *           D cancels) and that the yardstick's own instance may undershoot.
 *           In fp32 the forward's error (sums of lk products) exceeds the
 *           rounding, and the yardstick's differs by chance.
 *
 * Exact requirements, besides the tolerance:
 *   - rows that see no key: O == 0 and LSE == -inf (and dQ == 0);
 *     keys that no row sees: dK == dV == 0;
 *   - every output element is written (outputs are poisoned with NaN
 *     before each run), and no element outside the tensors is touched
 *     (the gaps of padded and packed layouts stay poisoned);
 *   - the inputs are left unchanged;
 *   - a second run (fresh poisoned outputs, another workspace address)
 *     gives the same bits: the CPU backend is deterministic;
 *   - plan creation rejects a problem with empty rows unless
 *     allow_empty_rows is set;
 *   - attn_plan_describe: visible_pairs as the reference counts them, and,
 *     in the plan's tile sizes, total_tile_pairs = every (query tile, KV
 *     tile) pair of every sequence and query head, visited_tile_pairs =
 *     those holding at least one visible pair; FLOPs and bytes by attn.h's
 *     formulas, the workspaces attn_plan_workspace_size reports, backend,
 *     dtype, passes, block sizes and the names of MoBA plans; a summary.
 */
#ifndef ATTN_NUMERICS_HARNESS_H
#define ATTN_NUMERICS_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include <attn/attn.h>

typedef enum nc_strides {
  NC_STRIDES_DEFAULT = 0,  /* the layout's own strides; no tensor descriptor is set */
  NC_STRIDES_PADDED,       /* every tensor gets padded head, sequence and batch strides */
  NC_STRIDES_PACKED,       /* Q, K, V are head slices of one packed QKV buffer, dQ, dK, dV
                              of one dQKV buffer; O and dO are padded */
  NC_STRIDES_SHUFFLED,     /* every tensor stores its batch, sequence and head dims in a
                              random order, padded */
  NC_STRIDES_BROADCAST_KV, /* K and V have batch stride 0: every sequence reads the same
                              keys and values (fixed-length batches only) */
  NC_STRIDES_MIXED,        /* each tensor at random: the layout's own strides (none set)
                              or shuffled and padded ones */
  NC_STRIDES_ZERO_INPUTS   /* shuffled and padded, and each outer dim of Q, K, V and dO
                              at random of stride 0: inputs may repeat their rows */
} nc_strides;

/* How nc_case.bad_tensor spoils a tensor descriptor. */
typedef enum nc_bad_tensor {
  NC_BAD_DTYPE = 0,    /* another dtype than the plan's */
  NC_BAD_DIMS,         /* the first dim one too large */
  NC_BAD_LAST_STRIDE,  /* head_dim stride 2 */
  NC_BAD_OVERLAP       /* an output whose elements overlap: the stride of a dim of extent
                          > 1 is 0 (a no-op where there is none) */
} nc_bad_tensor;

/* Whether the plan allows rows that see no key (attn_plan_desc_set_allow_empty_rows). */
typedef enum nc_empty_policy {
  NC_EMPTY_AUTO = 0, /* allowed when the case has such rows, after checking that plan
                        creation refuses them otherwise (nc_run_outcome: one attempt) */
  NC_EMPTY_ALLOW,    /* always allowed, also when every row sees a key */
  NC_EMPTY_DENY      /* never allowed: a case with such rows must be refused */
} nc_empty_policy;

typedef struct nc_case {
  const char *name;
  attn_dtype_t dtype;
  attn_layout_t layout; /* BSHD or BHSD; ignored for varlen batches (THD) */
  int64_t batch, heads_q, heads_kv;
  int64_t seqlen_q, seqlen_kv; /* fixed-length batches */
  /* A varlen batch when non-NULL: `batch` lengths each (seqlen_* unused). */
  const int32_t *lens_q, *lens_kv;
  int64_t dqk, dv;
  attn_mask_t mask;
  int64_t left, right; /* for ATTN_MASK_WINDOW */
  float scale;         /* 0: not set (the library's default, 1/sqrt(dqk)) */
  float softcap;       /* 0: off */
  nc_strides strides;
  double qk_sd;    /* standard deviation of Q and K entries (0: 1); V and dO use 1 */
  int logit_trend; /* +1 / -1: a ramp added to the logits, growing / shrinking along the
                      keys, so that the running max changes from tile to tile */
  int threads;     /* the context's thread count (0: 1; -1: 0, one per core) */
  int backward;    /* also run and check the backward pass */
  int no_lse;      /* forward only: pass lse = NULL (LSE is optional) */
  /* Block-sparse: the plan gets block_mask and the reference its
   * materialised selection pair_mask [mask_batch][mask_heads][seqlen_q]
   * [seqlen_kv] (see ref_problem; varlen: the longest sequence's lengths,
   * each sequence reading its corner). NULL: a dense plan. */
  attn_block_mask_t block_mask;
  const unsigned char *pair_mask;
  int64_t mask_batch, mask_heads;
  /* MoBA (moba_block > 0; causal): the plan selects at run
   * time, the reference selects in fp64 (ref_moba_select); visible_pairs and
   * visited_tile_pairs are then checked as upper bounds. */
  int64_t moba_block, moba_top_k;
  int moba_shared;
  /* Q and K entries drawn from {-2, -1, 1, 2}: every gate, block mean and
   * their sums are exact in fp32, so MoBA's fp32 selection equals the fp64
   * one, ties included. */
  int qk_integers;
  /* Every key and value row of a sequence and KV head equals its first:
   * the softmax is uniform and the true dQ is 0, so that dQ is all error
   * (from the D = dO . O each row cancels against dP). */
  int uniform_kv;
  /* MoBA plans with a backward pass: the backward reads the forward's
   * selection (attn_plan_desc_set_moba_keep_selection), so each backward
   * gets the workspace of the forward before it (of the larger size). */
  int moba_keep;
  int deterministic;          /* attn_plan_desc_set_deterministic(1) */
  nc_empty_policy empty_policy;
  /* Varlen cases: also name `layout` (THD, or a conflicting BSHD / BHSD)
   * with attn_plan_desc_set_layout. */
  int varlen_names_layout;
  /* The plan descriptor first describes another problem (every setter
   * called with other values, a plan made from it), then this one with
   * every setter called again, defaults included. */
  int reuse_desc;
  /* Descriptions attn.h says plan creation refuses (INVALID_ARGUMENT), for
   * nc_run_outcome: bad_tensor = 1 + the role whose tensor descriptor is
   * spoilt as bad_tensor_kind says; bad_varlen 1: the offsets are given
   * for one sequence less than the shape's batch, 2: seqlen_q is one more
   * than the longest sequence. */
  int bad_tensor;
  nc_bad_tensor bad_tensor_kind;
  int bad_varlen;
} nc_case;

/* Shorthands for the case tables of the tests. */
#define FP32 ATTN_DTYPE_FP32
#define FP16 ATTN_DTYPE_FP16
#define BF16 ATTN_DTYPE_BF16
#define BSHD ATTN_LAYOUT_BSHD
#define BHSD ATTN_LAYOUT_BHSD
#define NONE ATTN_MASK_NONE
#define CAUSAL ATTN_MASK_CAUSAL
#define WINDOW ATTN_MASK_WINDOW
#define WIN(l, r) .mask = WINDOW, .left = (l), .right = (r)
/* The sizes of a fixed-length case, and of a varlen one. */
#define NC_SHAPE(b, hq, hkv, lq, lk, dqk_, dv_) \
  .batch = (b), .heads_q = (hq), .heads_kv = (hkv), .seqlen_q = (lq), .seqlen_kv = (lk), \
  .dqk = (dqk_), .dv = (dv_)
#define NC_VARLEN(b, hq, hkv, lens_q_, lens_kv_, dqk_, dv_) \
  .batch = (b), .heads_q = (hq), .heads_kv = (hkv), .lens_q = (lens_q_), .lens_kv = (lens_kv_), \
  .dqk = (dqk_), .dv = (dv_)

/* Call first in main(). When ATTN_CPU_ISA names a kernel variant, checks
 * that plans run it: returns 77 (meson's "skipped") when plan creation
 * reports NOT_SUPPORTED for it, 1 on an unexpected error, else 0. */
int nc_isa_gate(void);

/* Runs and checks one case (CMocka assertions). */
void nc_run(const nc_case *c);

/* What plan creation said of a case run by nc_run_outcome. */
typedef struct nc_outcome {
  attn_status_t status; /* attn_plan_create's */
  char message[512];    /* attn_last_error_message() after a refusal */
  int64_t empty_rows;   /* (query row, query head) pairs that see no key, by the reference;
                           0 when it cannot tell (heads_q not a multiple of heads_kv) */
} nc_outcome;

/* As nc_run, but a plan creation that fails is not a failure: it is
 * reported in *out and nothing runs, so that the caller judges whether the
 * refusal is one attn.h documents. When the plan is created, the case runs
 * and is checked as by nc_run (status SUCCESS). A plan created for a problem
 * that the reference cannot check (heads_q not a multiple of heads_kv, a
 * spoilt description) fails the case. */
void nc_run_outcome(const nc_case *c, nc_outcome *out);

/* Registers every case as a CMocka test named after it, followed by
 * `random` cases drawn from the seed (shapes, dtype, layout, mask, softcap,
 * strides, varlen, threads; sequences up to max_len), and runs them. The
 * random cases are new every run and reproduce with ATTN_TEST_SEED. */
int nc_run_group(const char *group, const nc_case *cases, size_t n, int random, int64_t max_len,
                 int backward);

#endif /* ATTN_NUMERICS_HARNESS_H */
