/*
 * MoBA plans (attn_plan_desc_set_moba) against a direct fp64
 * implementation: the reference pools the keys of each block, gates every
 * past block, takes the top_k (ties: lower block index) plus the own block
 * (ref_moba_select), materialises that selection and runs the fp64
 * attention with the causal mask on top; the harness then checks O, LSE,
 * dQ, dK and dV with its usual tolerance rule and exact checks (harness.h).
 * Q and K are drawn from {-2, -1, 1, 2} so that the library's fp32 gates
 * equal the fp64 ones exactly and both pick the same blocks, ties included
 * (block sizes are powers of two wherever gates are compared). Run once per
 * CPU kernel variant (ATTN_CPU_ISA).
 *
 * Then the kept selection (attn_plan_desc_set_moba_keep_selection): the
 * same problems as plans that keep the forward's selection for the
 * backward, against the plans that select in each pass (see kept_selection
 * below).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "testutil.h"

#define SHAPE(b, hq, hkv, lq, lk, d) NC_SHAPE(b, hq, hkv, lq, lk, d, d)
#define MOBA(block, k, shared) \
  .mask = ATTN_MASK_CAUSAL, .moba_block = (block), .moba_top_k = (k), .moba_shared = (shared), \
  .qk_integers = 1, .scale = 0.1f, .backward = 1

static const nc_case kCases[] = {
    {.name = "b16_top3_per_head_fp32", .dtype = ATTN_DTYPE_FP32, SHAPE(1, 2, 2, 200, 200, 32),
     MOBA(16, 3, 0), .threads = 1},
    {.name = "b32_top2_shared_gqa_bf16", .dtype = ATTN_DTYPE_BF16, SHAPE(2, 4, 2, 150, 300, 32),
     MOBA(32, 2, 1), .threads = 2},
    {.name = "b64_top1_per_head_gqa_fp16", .dtype = ATTN_DTYPE_FP16, SHAPE(1, 4, 2, 260, 260, 16),
     MOBA(64, 1, 0), .threads = 2},
    {.name = "b8_top4_shared_mqa_fp32", .dtype = ATTN_DTYPE_FP32, SHAPE(1, 3, 1, 120, 120, 8),
     MOBA(8, 4, 1), .threads = 2},
    {.name = "b48_top0_own_block_only_fp32", .dtype = ATTN_DTYPE_FP32, SHAPE(1, 2, 1, 170, 170, 24),
     MOBA(48, 0, 0), .threads = 1},
    {.name = "b48_top_all_is_causal_bf16", .dtype = ATTN_DTYPE_BF16, SHAPE(1, 2, 2, 100, 140, 32),
     MOBA(48, 100, 1), .threads = 2},
    {.name = "b16_bhsd_shuffled_strides_bf16", .dtype = ATTN_DTYPE_BF16, .layout = ATTN_LAYOUT_BHSD,
     SHAPE(2, 2, 1, 110, 110, 16), MOBA(16, 2, 1), .strides = NC_STRIDES_SHUFFLED, .threads = 2},
    {.name = "b16_q_gt_k_empty_rows_fp32", .dtype = ATTN_DTYPE_FP32, SHAPE(1, 2, 2, 130, 90, 16),
     MOBA(16, 2, 0), .threads = 2},
    /* Varlen batches: each sequence pools and gates its own blocks (the
     * blocks counted on the longest one); an empty sequence, one with
     * fewer keys than queries, one shorter than a block. */
    {.name = "varlen_b16_top2_per_head_gqa_fp32", .dtype = ATTN_DTYPE_FP32,
     NC_VARLEN(4, 4, 2, ((const int32_t[]){150, 0, 60, 9}), ((const int32_t[]){170, 25, 40, 9}),
               16, 16),
     MOBA(16, 2, 0), .threads = 2},
    {.name = "varlen_b32_top1_shared_bf16", .dtype = ATTN_DTYPE_BF16,
     NC_VARLEN(3, 2, 1, ((const int32_t[]){200, 33, 97}), ((const int32_t[]){200, 130, 97}), 32,
               32),
     MOBA(32, 1, 1), .threads = 2},
    {.name = "varlen_b8_top3_kept_fp16", .dtype = ATTN_DTYPE_FP16,
     NC_VARLEN(2, 3, 3, ((const int32_t[]){70, 120}), ((const int32_t[]){90, 120}), 16, 16),
     MOBA(8, 3, 0), .moba_keep = 1, .threads = 1},
};

/* ------------------------------------------------------------------------ */
/* The kept selection                                                        */
/* ------------------------------------------------------------------------ */

/* One problem (BSHD, dqk = dv = dim, causal, scale 0.1), run by two MoBA
 * plans with a backward pass that differ only in keep_selection. The plan
 * that selects in each pass runs the forward and the backward on their own
 * workspaces; the kept one runs both on ONE buffer of the larger of the two
 * workspace sizes, at an odd address, poisoned before the forward. O, LSE,
 * dQ, dK and dV must have the same bits (the CPU backend is deterministic;
 * the fp64 checks of these selections are the cases above). Then the
 * backward must really read what the forward left: with the whole workspace
 * zeroed (no selection bit set: no row sees a key) it gives another dK, and
 * a fresh forward on that buffer gives the right bits again. */
typedef struct keep_case {
  const char *name;
  attn_dtype_t dtype;
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_kv, dim;
  int64_t block, top_k;
  int shared, threads;
} keep_case;

static const keep_case kKeepCases[] = {
    {"kept_b16_top3_per_head_fp32", FP32, 1, 2, 2, 200, 200, 32, 16, 3, 0, 1},
    {"kept_b32_top2_shared_gqa_bf16", BF16, 2, 4, 2, 150, 300, 32, 32, 2, 1, 2},
    {"kept_b16_top1_per_head_gqa_fp32", FP32, 1, 4, 2, 96, 160, 16, 16, 1, 0, 2},
    {"kept_b16_top2_shared_q_gt_k_bf16", BF16, 1, 4, 2, 130, 90, 16, 16, 2, 1, 1},
};

static void keep_fail(const keep_case *c, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  print_error("FAILED %s seed %llu (ATTN_TEST_SEED=%llu reproduces)\n  %s\n", c->name,
              (unsigned long long)tu_seed(), (unsigned long long)tu_seed(), msg);
  fail();
}

static void keep_check(const keep_case *c, attn_status_t st, const char *call) {
  if (st != ATTN_STATUS_SUCCESS)
    keep_fail(c, "%s returned %s: %s", call, attn_status_string(st), attn_last_error_message());
}

static void *keep_alloc(size_t bytes) {
  void *p = malloc(bytes == 0 ? 1 : bytes);
  if (p == NULL) {
    fprintf(stderr, "test_moba: out of memory\n");
    abort();
  }
  return p;
}

static attn_plan_t keep_plan(const keep_case *c, attn_context_t ctx, int keep) {
  attn_plan_desc_t d = NULL;
  attn_plan_t plan = NULL;
  keep_check(c, attn_plan_desc_create(&d), "attn_plan_desc_create");
  keep_check(c,
             attn_plan_desc_set_shape(d, c->batch, c->heads_q, c->heads_kv, c->seqlen_q,
                                      c->seqlen_kv, c->dim, c->dim),
             "attn_plan_desc_set_shape");
  keep_check(c, attn_plan_desc_set_dtype(d, c->dtype), "attn_plan_desc_set_dtype");
  keep_check(c, attn_plan_desc_set_layout(d, ATTN_LAYOUT_BSHD), "attn_plan_desc_set_layout");
  keep_check(c, attn_plan_desc_set_softmax_scale(d, 0.1f), "attn_plan_desc_set_softmax_scale");
  keep_check(c, attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, -1), "attn_plan_desc_set_mask");
  keep_check(c, attn_plan_desc_set_moba(d, c->block, c->top_k, c->shared),
             "attn_plan_desc_set_moba");
  keep_check(c, attn_plan_desc_set_moba_keep_selection(d, keep),
             "attn_plan_desc_set_moba_keep_selection");
  /* seqlen_q > seqlen_kv: the first rows see no key */
  keep_check(c, attn_plan_desc_set_allow_empty_rows(d, c->seqlen_q > c->seqlen_kv),
             "attn_plan_desc_set_allow_empty_rows");
  keep_check(c, attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD_BACKWARD),
             "attn_plan_desc_set_passes");
  keep_check(c, attn_plan_create(ctx, d, &plan), "attn_plan_create");
  attn_plan_desc_destroy(d);
  return plan;
}

/* The outputs of one plan's forward and backward. */
typedef struct keep_out {
  void *o, *dq, *dk, *dv;
  float *lse;
} keep_out;

static void keep_out_alloc(const keep_case *c, keep_out *out, size_t nq, size_t nk, size_t nlse) {
  const size_t es = tu_dtype_size(c->dtype);
  out->o = keep_alloc(nq * es);
  out->dq = keep_alloc(nq * es);
  out->dk = keep_alloc(nk * es);
  out->dv = keep_alloc(nk * es);
  out->lse = (float *)keep_alloc(nlse * sizeof(float));
  tu_poison(out->o, c->dtype, nq);
  tu_poison(out->dq, c->dtype, nq);
  tu_poison(out->dk, c->dtype, nk);
  tu_poison(out->dv, c->dtype, nk);
  tu_poison(out->lse, ATTN_DTYPE_FP32, nlse);
}

static void keep_out_free(keep_out *out) {
  free(out->o);
  free(out->dq);
  free(out->dk);
  free(out->dv);
  free(out->lse);
}

static void keep_describe(const keep_case *c, attn_plan_t plan, int keep) {
  static const char kSuffix[] = "+kept-selection";
  const size_t ns = sizeof kSuffix - 1;
  attn_plan_info_t info;
  size_t n;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  keep_check(c, attn_plan_describe(plan, &info), "attn_plan_describe");
  n = strlen(info.algorithm);
  if (strstr(info.algorithm, "moba") == NULL ||
      strstr(info.algorithm, "moba-keeps-every-block") != NULL)
    keep_fail(c, "attn_plan_describe: algorithm \"%s\" is not a MoBA selection", info.algorithm);
  if (keep && (n < ns || strcmp(info.algorithm + n - ns, kSuffix) != 0))
    keep_fail(c, "attn_plan_describe: the kept plan's algorithm \"%s\" does not end with \"%s\"",
              info.algorithm, kSuffix);
  if (!keep && strstr(info.algorithm, kSuffix) != NULL)
    keep_fail(c, "attn_plan_describe: the plain plan's algorithm \"%s\" says \"%s\"",
              info.algorithm, kSuffix);
}

static void keep_same_bits(const keep_case *c, const void *got, const void *want, size_t bytes,
                           const char *what, const char *when) {
  if (memcmp(got, want, bytes) != 0)
    keep_fail(c, "%s of the kept plan %s differs from the plain plan's", what, when);
}

static void kept_selection(void **state) {
  static const double kValues[4] = {-2.0, -1.0, 1.0, 2.0};
  const keep_case *c = (const keep_case *)*state;
  const size_t es = tu_dtype_size(c->dtype);
  const size_t nq = (size_t)(c->batch * c->seqlen_q * c->heads_q * c->dim);
  const size_t nk = (size_t)(c->batch * c->seqlen_kv * c->heads_kv * c->dim);
  const size_t nlse = (size_t)(c->batch * c->heads_q * c->seqlen_q);
  tu_rng rng = tu_rng_for(c->name);
  tu_buffer q, k, v, d_o;
  attn_context_t ctx = NULL;
  attn_plan_t plain, kept;
  keep_out ref, got;
  size_t ws_f, ws_b, bytes, e;
  unsigned char *block_f, *block_b, *block;
  void *ws;

  tu_buffer_alloc(&q, c->dtype, nq);
  tu_buffer_alloc(&k, c->dtype, nk);
  tu_buffer_alloc(&v, c->dtype, nk);
  tu_buffer_alloc(&d_o, c->dtype, nq);
  for (e = 0; e < nq; ++e) tu_buffer_set(&q, e, kValues[tu_rng_int(&rng, 0, 3)]);
  for (e = 0; e < nk; ++e) tu_buffer_set(&k, e, kValues[tu_rng_int(&rng, 0, 3)]);
  tu_fill_normal(&rng, &v, 1.0);
  tu_fill_normal(&rng, &d_o, 1.0);
  keep_out_alloc(c, &ref, nq, nk, nlse);
  keep_out_alloc(c, &got, nq, nk, nlse);

  keep_check(c, attn_context_create(ATTN_BACKEND_CPU, 0, c->threads, &ctx), "attn_context_create");
  plain = keep_plan(c, ctx, 0);
  kept = keep_plan(c, ctx, 1);
  attn_context_destroy(ctx);
  keep_describe(c, plain, 0);
  keep_describe(c, kept, 1);

  /* the plain plan: a workspace per pass */
  keep_check(c, attn_plan_workspace_size(plain, ATTN_PASS_FORWARD, &ws_f),
             "attn_plan_workspace_size");
  keep_check(c, attn_plan_workspace_size(plain, ATTN_PASS_BACKWARD, &ws_b),
             "attn_plan_workspace_size");
  block_f = (unsigned char *)keep_alloc(ws_f);
  block_b = (unsigned char *)keep_alloc(ws_b);
  tu_poison_bytes(block_f, ws_f);
  tu_poison_bytes(block_b, ws_b);
  keep_check(c, attn_forward(plain, q.data, k.data, v.data, ref.o, ref.lse, block_f, ws_f, NULL),
             "attn_forward (plain)");
  keep_check(c,
             attn_backward(plain, q.data, k.data, v.data, ref.o, ref.lse, d_o.data, ref.dq, ref.dk,
                           ref.dv, block_b, ws_b, NULL),
             "attn_backward (plain)");
  free(block_f);
  free(block_b);

  /* the kept plan: one workspace for both passes, at an odd address */
  keep_check(c, attn_plan_workspace_size(kept, ATTN_PASS_FORWARD, &ws_f),
             "attn_plan_workspace_size");
  keep_check(c, attn_plan_workspace_size(kept, ATTN_PASS_BACKWARD, &ws_b),
             "attn_plan_workspace_size");
  bytes = ws_f > ws_b ? ws_f : ws_b;
  if (bytes == 0) keep_fail(c, "the kept plan's workspaces are empty: nowhere to keep a selection");
  block = (unsigned char *)keep_alloc(bytes + 64);
  ws = block + 1 + 2 * tu_rng_int(&rng, 0, 31);
  tu_poison_bytes(block, bytes + 64);
  keep_check(c, attn_forward(kept, q.data, k.data, v.data, got.o, got.lse, ws, bytes, NULL),
             "attn_forward (kept)");
  keep_same_bits(c, got.o, ref.o, nq * es, "O", "(forward)");
  keep_same_bits(c, got.lse, ref.lse, nlse * sizeof(float), "LSE", "(forward)");
  /* The kept plan's backward on ws, its gradients bit-identical to ref's. */
#define KEPT_BACKWARD_SAME(what)                                                                 \
  do {                                                                                           \
    keep_check(c,                                                                                \
               attn_backward(kept, q.data, k.data, v.data, got.o, got.lse, d_o.data, got.dq,     \
                             got.dk, got.dv, ws, bytes, NULL),                                   \
               "attn_backward (kept) " what);                                                   \
    keep_same_bits(c, got.dq, ref.dq, nq * es, "dQ", what);                                      \
    keep_same_bits(c, got.dk, ref.dk, nk * es, "dK", what);                                      \
    keep_same_bits(c, got.dv, ref.dv, nk * es, "dV", what);                                      \
  } while (0)
  KEPT_BACKWARD_SAME("(backward on the forward's workspace)");

  /* the backward reads the selection the workspace holds: none at all */
  memset(ws, 0, bytes);
  tu_poison(got.dq, c->dtype, nq);
  tu_poison(got.dk, c->dtype, nk);
  tu_poison(got.dv, c->dtype, nk);
  keep_check(c,
             attn_backward(kept, q.data, k.data, v.data, got.o, got.lse, d_o.data, got.dq, got.dk,
                           got.dv, ws, bytes, NULL),
             "attn_backward (kept, zeroed workspace)");
  if (memcmp(got.dk, ref.dk, nk * es) == 0)
    keep_fail(c, "the kept plan's backward on a zeroed workspace gave the right dK: "
              "it did not read the kept selection");

  /* a fresh forward on that buffer keeps the selection again */
  tu_poison(got.dq, c->dtype, nq);
  tu_poison(got.dk, c->dtype, nk);
  tu_poison(got.dv, c->dtype, nk);
  keep_check(c, attn_forward(kept, q.data, k.data, v.data, got.o, got.lse, ws, bytes, NULL),
             "attn_forward (kept, again)");
  KEPT_BACKWARD_SAME("(after a fresh forward)");
#undef KEPT_BACKWARD_SAME
  if (tu_buffer_changed(&q) || tu_buffer_changed(&k) || tu_buffer_changed(&v) ||
      tu_buffer_changed(&d_o))
    keep_fail(c, "an input changed");

  printf("  %-34s bit-identical to the plain plan; workspace %zu bytes (forward %zu, backward "
         "%zu)\n",
         c->name, bytes, ws_f, ws_b);
  fflush(stdout);
  free(block);
  attn_plan_destroy(plain);
  attn_plan_destroy(kept);
  keep_out_free(&ref);
  keep_out_free(&got);
  tu_buffer_free(&q);
  tu_buffer_free(&k);
  tu_buffer_free(&v);
  tu_buffer_free(&d_o);
}

/* A NaN gate ranks above every number (attn.h), wherever its block lies:
 * with one NaN key in block n (its first key), every row of block n and
 * after gives a NaN (block n is its own or among its top_k), every row
 * before it a finite O and LSE. The fp32 CPU plan; the CUDA selector keys
 * NaN the same way (test_moba_gpu). */
static void nan_gate_ranks_first(void **state) {
  enum { L = 40, BS = 4, D = 8, TOP_K = 2 };
  static const float kValues[4] = {-2.0f, -1.0f, 1.0f, 2.0f};
  float q[L * D], k[L * D], v[L * D], o[L * D], lse[L];
  attn_context_t ctx = NULL;
  attn_plan_desc_t d = NULL;
  attn_plan_t plan = NULL;
  tu_rng rng = tu_rng_for("nan_gate_ranks_first");
  size_t ws_bytes = 0;
  void *ws;
  int n, i, c;
  (void)state;
  for (i = 0; i < L * D; ++i) {
    q[i] = kValues[tu_rng_int(&rng, 0, 3)];
    k[i] = kValues[tu_rng_int(&rng, 0, 3)];
    v[i] = (float)tu_rng_int(&rng, -8, 8) / 8.0f + 0.0625f;
  }
  assert_int_equal(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_create(&d), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_shape(d, 1, 1, 1, L, L, D, D), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, -1), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_moba(d, BS, TOP_K, 0), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_create(ctx, d, &plan), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_bytes),
                   ATTN_STATUS_SUCCESS);
  ws = keep_alloc(ws_bytes);
  for (n = 0; n < L / BS - 1; ++n) {
    const float saved = k[n * BS * D];
    k[n * BS * D] = NAN;
    tu_poison(o, ATTN_DTYPE_FP32, L * D);
    assert_int_equal(attn_forward(plan, q, k, v, o, lse, ws, ws_bytes, NULL), ATTN_STATUS_SUCCESS);
    for (i = 0; i < L; ++i) {
      const int want_nan = i >= n * BS;
      for (c = 0; c < D; ++c)
        if (want_nan != (o[i * D + c] != o[i * D + c])) {
          print_error("NaN in block %d: row %d, O[%d] = %g (%s expected)\n", n, i, c,
                      (double)o[i * D + c], want_nan ? "NaN" : "a number");
          fail();
        }
      if (!want_nan && !(lse[i] > -INFINITY && lse[i] < INFINITY)) {
        print_error("NaN in block %d: row %d, LSE = %g\n", n, i, (double)lse[i]);
        fail();
      }
    }
    k[n * BS * D] = saved;
  }
  free(ws);
  attn_plan_destroy(plan);
  attn_plan_desc_destroy(d);
  attn_context_destroy(ctx);
}

int main(void) {
  enum { NKEEP = sizeof kKeepCases / sizeof kKeepCases[0] };
  const struct CMUnitTest nan_tests[] = {cmocka_unit_test(nan_gate_ranks_first)};
  struct CMUnitTest keep_tests[NKEEP];
  size_t i;
  int rc = nc_isa_gate();
  if (rc != 0) return rc;
  rc = nc_run_group("moba", kCases, sizeof kCases / sizeof kCases[0], 0, 0, 1);
  memset(keep_tests, 0, sizeof keep_tests);
  for (i = 0; i < NKEEP; ++i) {
    keep_tests[i].name = kKeepCases[i].name;
    keep_tests[i].test_func = kept_selection;
    keep_tests[i].initial_state = (void *)&kKeepCases[i];
  }
  rc += _cmocka_run_group_tests("moba-kept-selection", keep_tests, NKEEP, NULL, NULL);
  return rc + cmocka_run_group_tests_name("moba-nan-gates", nan_tests, NULL, NULL);
}
