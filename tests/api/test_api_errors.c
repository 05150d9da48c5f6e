/* API contract tests: every error path of every public function.
 *
 * For each failing call we check
 *   - the status is the one attn.h documents,
 *   - attn_last_error_message() is non-empty and names the offending argument
 *     (as a whole word, so "q" does not match inside "seqlen_q"),
 *   - outputs are untouched: out-parameters and output buffers are poisoned
 *     before the call and must be byte-identical afterwards.
 * Successful calls must leave the message empty.
 *
 * C99 + POSIX (setenv, pthreads). */
#define _POSIX_C_SOURCE 200809L

#include "api_check.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef ATTN_TEST_CUDA_BUILT
#define ATTN_TEST_CUDA_BUILT 0
#endif
#ifndef ATTN_TEST_HAVE_OPENMP
#define ATTN_TEST_HAVE_OPENMP 1
#endif

/* ------------------------------------------------------------------------ */
/* Problems, plans and buffers                                               */
/* ------------------------------------------------------------------------ */

typedef struct prob {
  int64_t batch, hq, hkv, lq, lk, dqk, dv;
  attn_mask_t mask;
  int64_t wl, wr;
  attn_passes_t passes;
  int32_t allow_empty;
} prob_t;

/* fp32, BSHD, GQA 4/2, causal with Lq < Lk, forward + backward. */
static prob_t std_prob(void) {
  prob_t p;
  p.batch = 2, p.hq = 4, p.hkv = 2, p.lq = 5, p.lk = 7, p.dqk = 8, p.dv = 8;
  p.mask = ATTN_MASK_CAUSAL, p.wl = -1, p.wr = -1;
  p.passes = ATTN_PASSES_FORWARD_BACKWARD;
  p.allow_empty = 0;
  return p;
}

static attn_context_t g_ctx; /* CPU, one thread; made by the group setup */

static attn_plan_desc_t desc_for(const prob_t *p) {
  attn_plan_desc_t d = NULL;
  EXPECT_OK(attn_plan_desc_create(&d));
  EXPECT_OK(attn_plan_desc_set_shape(d, p->batch, p->hq, p->hkv, p->lq, p->lk, p->dqk, p->dv));
  EXPECT_OK(attn_plan_desc_set_mask(d, p->mask, p->wl, p->wr));
  EXPECT_OK(attn_plan_desc_set_passes(d, p->passes));
  EXPECT_OK(attn_plan_desc_set_allow_empty_rows(d, p->allow_empty));
  return d;
}

static attn_plan_t plan_for(const prob_t *p) {
  attn_plan_desc_t d = desc_for(p);
  attn_plan_t plan = NULL;
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_desc_destroy(d));
  return plan;
}

/* fp32 BSHD buffers for prob p; outputs poisoned, inputs random. */
typedef struct io {
  size_t nq, nk, nv, no, nlse; /* element counts */
  size_t ws_f, ws_b;           /* workspace bytes */
  float *q, *k, *v, *o, *d_o, *dq, *dk, *dv, *lse;
  void *wsf, *wsb;
} io_t;

static void io_alloc(io_t *io, attn_plan_t plan, const prob_t *p) {
  io->nq = (size_t)(p->batch * p->lq * p->hq * p->dqk);
  io->nk = (size_t)(p->batch * p->lk * p->hkv * p->dqk);
  io->nv = (size_t)(p->batch * p->lk * p->hkv * p->dv);
  io->no = (size_t)(p->batch * p->lq * p->hq * p->dv);
  io->nlse = (size_t)(p->batch * p->hq * p->lq);
  io->q = xmalloc(io->nq * 4);
  io->k = xmalloc(io->nk * 4);
  io->v = xmalloc(io->nv * 4);
  io->o = xmalloc(io->no * 4);
  io->d_o = xmalloc(io->no * 4);
  io->dq = xmalloc(io->nq * 4);
  io->dk = xmalloc(io->nk * 4);
  io->dv = xmalloc(io->nv * 4);
  io->lse = xmalloc(io->nlse * 4);
  fill_random(io->q, io->nq, 1);
  fill_random(io->k, io->nk, 2);
  fill_random(io->v, io->nv, 3);
  fill_random(io->d_o, io->no, 4);
  poison(io->o, io->no * 4);
  poison(io->lse, io->nlse * 4);
  poison(io->dq, io->nq * 4);
  poison(io->dk, io->nk * 4);
  poison(io->dv, io->nv * 4);
  io->ws_f = io->ws_b = 0;
  EXPECT_OK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &io->ws_f));
  if (p->passes == ATTN_PASSES_FORWARD_BACKWARD)
    EXPECT_OK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &io->ws_b));
  io->wsf = xmalloc(io->ws_f);
  io->wsb = xmalloc(io->ws_b);
}

static void io_free(io_t *io) {
  free(io->q), free(io->k), free(io->v), free(io->o), free(io->d_o);
  free(io->dq), free(io->dk), free(io->dv), free(io->lse), free(io->wsf), free(io->wsb);
}

static void expect_outputs_untouched(const io_t *io, const char *file, int line) {
  check_poisoned(io->o, io->no * 4, "O", file, line);
  check_poisoned(io->lse, io->nlse * 4, "LSE", file, line);
  check_poisoned(io->dq, io->nq * 4, "dQ", file, line);
  check_poisoned(io->dk, io->nk * 4, "dK", file, line);
  check_poisoned(io->dv, io->nv * 4, "dV", file, line);
}
#define EXPECT_IO_UNTOUCHED(io) expect_outputs_untouched((io), __FILE__, __LINE__)

/* The one-line summary of a plan made from desc, or "" when plan creation fails. */
static void summary_of_desc(attn_plan_desc_t d, char *out, size_t cap) {
  attn_plan_t plan = NULL;
  out[0] = '\0';
  if (attn_plan_create(g_ctx, d, &plan) != ATTN_STATUS_SUCCESS) return;
  EXPECT_OK(attn_plan_summary(plan, out, cap, NULL));
  EXPECT_OK(attn_plan_destroy(plan));
}

static int group_setup(void **state) {
  (void)state;
  return attn_context_create(ATTN_BACKEND_CPU, 0, 1, &g_ctx) == ATTN_STATUS_SUCCESS ? 0 : -1;
}

static int group_teardown(void **state) {
  (void)state;
  return attn_context_destroy(g_ctx) == ATTN_STATUS_SUCCESS ? 0 : -1;
}

/* ------------------------------------------------------------------------ */
/* Version, status strings                                                   */
/* ------------------------------------------------------------------------ */

static void test_version(void **state) {
  char expect[32];
  (void)state;
  assert_int_equal(attn_version_number(), ATTN_VERSION_NUMBER);
  assert_int_equal(ATTN_VERSION_NUMBER,
                   ATTN_VERSION_MAJOR * 10000 + ATTN_VERSION_MINOR * 100 + ATTN_VERSION_PATCH);
  snprintf(expect, sizeof expect, "%d.%d.%d", ATTN_VERSION_MAJOR, ATTN_VERSION_MINOR,
           ATTN_VERSION_PATCH);
  assert_non_null(attn_version_string());
  assert_string_equal(attn_version_string(), expect);
  /* Static storage: the same string every time. */
  assert_ptr_equal(attn_version_string(), attn_version_string());
}

static void test_status_string(void **state) {
  static const struct {
    attn_status_t s;
    const char *name;
  } all[] = {
      {ATTN_STATUS_SUCCESS, "ATTN_STATUS_SUCCESS"},
      {ATTN_STATUS_INVALID_ARGUMENT, "ATTN_STATUS_INVALID_ARGUMENT"},
      {ATTN_STATUS_INVALID_HANDLE, "ATTN_STATUS_INVALID_HANDLE"},
      {ATTN_STATUS_NOT_SUPPORTED, "ATTN_STATUS_NOT_SUPPORTED"},
      {ATTN_STATUS_WORKSPACE_TOO_SMALL, "ATTN_STATUS_WORKSPACE_TOO_SMALL"},
      {ATTN_STATUS_OUT_OF_MEMORY, "ATTN_STATUS_OUT_OF_MEMORY"},
      {ATTN_STATUS_BACKEND_UNAVAILABLE, "ATTN_STATUS_BACKEND_UNAVAILABLE"},
      {ATTN_STATUS_BACKEND_ERROR, "ATTN_STATUS_BACKEND_ERROR"},
      {ATTN_STATUS_CAPACITY, "ATTN_STATUS_CAPACITY"},
      {ATTN_STATUS_COMMUNICATION_ERROR, "ATTN_STATUS_COMMUNICATION_ERROR"},
      {ATTN_STATUS_INTERNAL_ERROR, "ATTN_STATUS_INTERNAL_ERROR"},
  };
  size_t i;
  (void)state;
  for (i = 0; i < sizeof all / sizeof all[0]; ++i) {
    assert_int_equal((int)all[i].s, (int)i); /* the codes are 0..10, dense */
    assert_non_null(attn_status_string(all[i].s));
    assert_string_equal(attn_status_string(all[i].s), all[i].name);
  }
  assert_string_equal(attn_status_string((attn_status_t)11), "ATTN_STATUS_UNKNOWN");
  assert_string_equal(attn_status_string((attn_status_t)-1), "ATTN_STATUS_UNKNOWN");
  assert_string_equal(attn_status_string((attn_status_t)12345), "ATTN_STATUS_UNKNOWN");
}

/* ------------------------------------------------------------------------ */
/* Context                                                                   */
/* ------------------------------------------------------------------------ */

static void test_context_create_errors(void **state) {
  attn_context_t ctx;
  attn_backend_t b;
  int32_t n;
  (void)state;

  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "ctx", attn_context_create(ATTN_BACKEND_CPU, 0, 1, NULL));

  POISON_VAR(ctx);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "backend",
              attn_context_create((attn_backend_t)3, 0, 1, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "backend",
              attn_context_create((attn_backend_t)-1, 0, 1, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "device", attn_context_create(ATTN_BACKEND_CPU, -1, 1, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "device", attn_context_create(ATTN_BACKEND_CPU, 1, 1, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "num_threads",
              attn_context_create(ATTN_BACKEND_CPU, 0, -1, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "num_threads",
              attn_context_create(ATTN_BACKEND_AUTO, 0, -5, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);

#if !ATTN_TEST_CUDA_BUILT
  /* CUDA in a CPU-only build: not built in. */
  EXPECT_FAIL(ATTN_STATUS_BACKEND_UNAVAILABLE, "CUDA", attn_context_create(ATTN_BACKEND_CUDA, 0, 1, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);
  /* AUTO resolves to the CPU, where device 1 does not exist. */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "device", attn_context_create(ATTN_BACKEND_AUTO, 1, 1, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);
  EXPECT_OK(attn_context_create(ATTN_BACKEND_AUTO, 0, 1, &ctx));
  POISON_VAR(b);
  EXPECT_OK(attn_context_get_backend(ctx, &b));
  assert_int_equal(b, ATTN_BACKEND_CPU);
  EXPECT_OK(attn_context_destroy(ctx));
#else
  {
    attn_status_t st = attn_context_create(ATTN_BACKEND_CUDA, 0, 1, &ctx);
    if (st == ATTN_STATUS_SUCCESS) {
      EXPECT_OK(attn_context_destroy(ctx));
    } else {
      EXPECT_FAIL(ATTN_STATUS_BACKEND_UNAVAILABLE, "CUDA", st);
      EXPECT_VAR_UNTOUCHED(ctx);
    }
  }
#endif

  /* num_threads = 0: one per core, so at least 1. */
  EXPECT_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 0, &ctx));
  n = -7;
  EXPECT_OK(attn_context_get_num_threads(ctx, &n));
  assert_true(n >= 1);
  EXPECT_OK(attn_context_destroy(ctx));

  EXPECT_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 3, &ctx));
  EXPECT_OK(attn_context_get_num_threads(ctx, &n));
  assert_int_equal(n, ATTN_TEST_HAVE_OPENMP ? 3 : 1);
  EXPECT_OK(attn_context_get_backend(ctx, &b));
  assert_int_equal(b, ATTN_BACKEND_CPU);
  EXPECT_OK(attn_context_destroy(ctx));
}

static void test_context_handles(void **state) {
  attn_context_t ctx, dead;
  attn_plan_desc_t pd;
  attn_backend_t b;
  int32_t n;
  int local = 0;
  (void)state;

  EXPECT_OK(attn_context_destroy(NULL));

  /* NULL handle, NULL out-pointers. */
  POISON_VAR(b);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_get_backend(NULL, &b));
  EXPECT_VAR_UNTOUCHED(b);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "backend", attn_context_get_backend(g_ctx, NULL));
  POISON_VAR(n);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_get_num_threads(NULL, &n));
  EXPECT_VAR_UNTOUCHED(n);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "num_threads", attn_context_get_num_threads(g_ctx, NULL));

  /* A handle of another kind, and a pointer that was never a handle. */
  EXPECT_OK(attn_plan_desc_create(&pd));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_get_backend((attn_context_t)(void *)pd, &b));
  EXPECT_VAR_UNTOUCHED(b);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx",
              attn_context_get_num_threads((attn_context_t)(void *)pd, &n));
  EXPECT_VAR_UNTOUCHED(n);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_get_backend((attn_context_t)(void *)&local, &b));
  EXPECT_VAR_UNTOUCHED(b);
  /* Destroying it as a context fails and leaves the descriptor alive. */
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_destroy((attn_context_t)(void *)pd));
  EXPECT_OK(attn_plan_desc_set_dtype(pd, ATTN_DTYPE_FP16));
  EXPECT_OK(attn_plan_desc_destroy(pd));

  /* Use after destroy, double destroy. */
  EXPECT_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx));
  dead = ctx;
  EXPECT_OK(attn_context_destroy(ctx));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_get_backend(dead, &b));
  EXPECT_VAR_UNTOUCHED(b);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_get_num_threads(dead, &n));
  EXPECT_VAR_UNTOUCHED(n);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_destroy(dead));
}

/* A context may be destroyed while plans made from it live on. */
static void test_context_outlived_by_plan(void **state) {
  attn_context_t ctx;
  attn_plan_desc_t d;
  attn_plan_t plan;
  prob_t p = std_prob();
  io_t io;
  (void)state;
  EXPECT_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx));
  d = desc_for(&p);
  EXPECT_OK(attn_plan_create(ctx, d, &plan));
  EXPECT_OK(attn_plan_desc_destroy(d));
  EXPECT_OK(attn_context_destroy(ctx));
  io_alloc(&io, plan, &p);
  EXPECT_OK(attn_forward(plan, io.q, io.k, io.v, io.o, io.lse, io.wsf, io.ws_f, NULL));
  EXPECT_OK(attn_backward(plan, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb,
                          io.ws_b, NULL));
  assert_true(isfinite(io.o[0]) && isfinite(io.dq[0]) && isfinite(io.dk[0]));
  io_free(&io);
  EXPECT_OK(attn_plan_destroy(plan));
}

/* ------------------------------------------------------------------------ */
/* Tensor descriptors                                                        */
/* ------------------------------------------------------------------------ */

static void test_tensor_desc_errors(void **state) {
  attn_tensor_desc_t t, dead;
  attn_plan_desc_t pd;
  const int64_t dims[4] = {2, 3, 4, 5};
  const int64_t strides[4] = {120, 40, 10, 1};
  int64_t bad[4];
  attn_dtype_t dt;
  int32_t nd;
  int64_t got_dims[ATTN_MAX_DIMS], got_strides[ATTN_MAX_DIMS];
  int64_t many[ATTN_MAX_DIMS + 1];
  int i;
  (void)state;

  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "desc", attn_tensor_desc_create(NULL));
  EXPECT_OK(attn_tensor_desc_destroy(NULL));

  EXPECT_OK(attn_tensor_desc_create(&t));
  /* A fresh descriptor has ndim 0. */
  EXPECT_OK(attn_tensor_desc_get(t, &dt, &nd, NULL, NULL));
  assert_int_equal(nd, 0);

  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_BF16, 4, dims, strides));

  /* set: every bad argument, and the descriptor keeps what it had. */
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_set(NULL, ATTN_DTYPE_FP32, 4, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dtype", attn_tensor_desc_set(t, (attn_dtype_t)3, 4, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dtype", attn_tensor_desc_set(t, (attn_dtype_t)-1, 4, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "ndim", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 0, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "ndim", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, -1, dims, NULL));
  for (i = 0; i <= ATTN_MAX_DIMS; ++i) many[i] = 1;
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "ndim",
              attn_tensor_desc_set(t, ATTN_DTYPE_FP32, ATTN_MAX_DIMS + 1, many, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dims", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, NULL, NULL));
  memcpy(bad, dims, sizeof bad);
  bad[1] = -3;
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dims", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, bad, NULL));
  memcpy(bad, strides, sizeof bad);
  bad[2] = -10;
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "strides", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, bad));

  poison(got_dims, sizeof got_dims);
  poison(got_strides, sizeof got_strides);
  EXPECT_OK(attn_tensor_desc_get(t, &dt, &nd, got_dims, got_strides));
  assert_int_equal(dt, ATTN_DTYPE_BF16);
  assert_int_equal(nd, 4);
  assert_memory_equal(got_dims, dims, sizeof dims);
  assert_memory_equal(got_strides, strides, sizeof strides);
  /* Only ndim entries are written. */
  EXPECT_UNTOUCHED(got_dims + 4, sizeof got_dims - sizeof dims);
  EXPECT_UNTOUCHED(got_strides + 4, sizeof got_strides - sizeof strides);

  /* The maximum rank works; NULL strides give row-major strides. */
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP16, ATTN_MAX_DIMS, many, NULL));
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, NULL));
  EXPECT_OK(attn_tensor_desc_get(t, &dt, &nd, NULL, got_strides));
  assert_int_equal(got_strides[0], 60);
  assert_int_equal(got_strides[1], 20);
  assert_int_equal(got_strides[2], 5);
  assert_int_equal(got_strides[3], 1);
  /* Zero-sized dims are allowed (dims >= 0). */
  memcpy(bad, dims, sizeof bad);
  bad[0] = 0;
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, bad, NULL));
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, strides));

  /* get: NULL handle, NULL dtype/ndim; nothing is written. */
  POISON_VAR(dt);
  POISON_VAR(nd);
  poison(got_dims, sizeof got_dims);
  poison(got_strides, sizeof got_strides);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_get(NULL, &dt, &nd, got_dims, got_strides));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dtype", attn_tensor_desc_get(t, NULL, &nd, got_dims, got_strides));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "ndim", attn_tensor_desc_get(t, &dt, NULL, got_dims, got_strides));
  EXPECT_VAR_UNTOUCHED(dt);
  EXPECT_VAR_UNTOUCHED(nd);
  EXPECT_UNTOUCHED(got_dims, sizeof got_dims);
  EXPECT_UNTOUCHED(got_strides, sizeof got_strides);

  /* Wrong kind. */
  EXPECT_OK(attn_plan_desc_create(&pd));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc",
              attn_tensor_desc_get((attn_tensor_desc_t)(void *)pd, &dt, &nd, got_dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc",
              attn_tensor_desc_set((attn_tensor_desc_t)(void *)pd, ATTN_DTYPE_FP32, 4, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_destroy((attn_tensor_desc_t)(void *)pd));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_destroy((attn_tensor_desc_t)(void *)g_ctx));
  EXPECT_OK(attn_plan_desc_destroy(pd));
  EXPECT_VAR_UNTOUCHED(dt);
  EXPECT_VAR_UNTOUCHED(nd);

  /* Use after destroy, double destroy. */
  dead = t;
  EXPECT_OK(attn_tensor_desc_destroy(t));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_get(dead, &dt, &nd, NULL, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_set(dead, ATTN_DTYPE_FP32, 4, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_destroy(dead));
  EXPECT_VAR_UNTOUCHED(dt);
  EXPECT_VAR_UNTOUCHED(nd);
}

/* ------------------------------------------------------------------------ */
/* Plan descriptor                                                           */
/* ------------------------------------------------------------------------ */

static const int32_t k_cu2[3] = {0, 3, 5};

/* Every setter with handle h; all must fail with INVALID_HANDLE naming "desc". */
static void expect_setters_reject(attn_plan_desc_t h, attn_tensor_desc_t t) {
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_shape(h, 1, 1, 1, 4, 4, 8, 8));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_dtype(h, ATTN_DTYPE_FP32));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_layout(h, ATTN_LAYOUT_BSHD));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_tensor(h, ATTN_TENSOR_Q, t));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_tensor(h, ATTN_TENSOR_Q, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_softmax_scale(h, 0.5f));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_softcap(h, 0.0f));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_mask(h, ATTN_MASK_NONE, -1, -1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_varlen(h, 2, k_cu2, k_cu2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_varlen(h, 2, NULL, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_allow_empty_rows(h, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_passes(h, ATTN_PASSES_FORWARD));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_deterministic(h, 1));
}

static void test_plan_desc_handles(void **state) {
  attn_plan_desc_t d, dead;
  attn_tensor_desc_t t;
  attn_plan_t plan;
  const int64_t dims[4] = {1, 4, 1, 8};
  (void)state;

  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "desc", attn_plan_desc_create(NULL));
  EXPECT_OK(attn_plan_desc_destroy(NULL));

  EXPECT_OK(attn_tensor_desc_create(&t));
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, NULL));

  expect_setters_reject(NULL, t);
  expect_setters_reject((attn_plan_desc_t)(void *)g_ctx, t);
  expect_setters_reject((attn_plan_desc_t)(void *)t, t);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_destroy((attn_plan_desc_t)(void *)t));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_destroy((attn_plan_desc_t)(void *)g_ctx));

  EXPECT_OK(attn_plan_desc_create(&d));
  /* set_tensor: the tensor handle must be a live tensor descriptor. */
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "tensor",
              attn_plan_desc_set_tensor(d, ATTN_TENSOR_K, (attn_tensor_desc_t)(void *)d));
  dead = d;
  EXPECT_OK(attn_plan_desc_destroy(d));
  expect_setters_reject(dead, t);
  plan = (attn_plan_t)(void *)&plan; /* poison */
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_create(g_ctx, dead, &plan));
  assert_ptr_equal(plan, (void *)&plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_destroy(dead));

  {
    attn_tensor_desc_t dead_t = t;
    EXPECT_OK(attn_plan_desc_create(&d));
    EXPECT_OK(attn_tensor_desc_destroy(t));
    EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "tensor", attn_plan_desc_set_tensor(d, ATTN_TENSOR_Q, dead_t));
    EXPECT_OK(attn_plan_desc_destroy(d));
  }
}

static void test_plan_desc_setter_ranges(void **state) {
  prob_t p = std_prob();
  attn_plan_desc_t d;
  attn_tensor_desc_t t;
  char before[512], after[512];
  const int32_t cu_ok[3] = {0, 3, 5};
  const int32_t cu_bad0[3] = {1, 3, 5};
  const int32_t cu_dec[3] = {0, 4, 2};
  (void)state;

  d = desc_for(&p);
  EXPECT_OK(attn_plan_desc_set_softmax_scale(d, 0.25f));
  EXPECT_OK(attn_plan_desc_set_softcap(d, 30.0f));
  summary_of_desc(d, before, sizeof before);
  assert_true(before[0] != '\0');

  /* shape */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "batch", attn_plan_desc_set_shape(d, 0, 4, 2, 8, 8, 16, 16));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "batch", attn_plan_desc_set_shape(d, -1, 4, 2, 8, 8, 16, 16));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "heads_q", attn_plan_desc_set_shape(d, 1, 0, 2, 8, 8, 16, 16));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "heads_kv", attn_plan_desc_set_shape(d, 1, 4, 0, 8, 8, 16, 16));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "seqlen_q", attn_plan_desc_set_shape(d, 1, 4, 2, -1, 8, 16, 16));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "seqlen_kv", attn_plan_desc_set_shape(d, 1, 4, 2, 8, -1, 16, 16));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "head_dim_qk", attn_plan_desc_set_shape(d, 1, 4, 2, 8, 8, 0, 16));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "head_dim_qk", attn_plan_desc_set_shape(d, 1, 4, 2, 8, 8, 1025, 16));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "head_dim_v", attn_plan_desc_set_shape(d, 1, 4, 2, 8, 8, 16, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "head_dim_v", attn_plan_desc_set_shape(d, 1, 4, 2, 8, 8, 16, 1025));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "shape",
              attn_plan_desc_set_shape(d, 1 << 20, 1 << 20, 1, 1 << 20, 1 << 20, 1024, 1024));
  /* dtype, layout, role */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dtype", attn_plan_desc_set_dtype(d, (attn_dtype_t)3));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dtype", attn_plan_desc_set_dtype(d, (attn_dtype_t)-1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "layout", attn_plan_desc_set_layout(d, (attn_layout_t)3));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "layout", attn_plan_desc_set_layout(d, (attn_layout_t)-1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "role", attn_plan_desc_set_tensor(d, (attn_tensor_role_t)8, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "role", attn_plan_desc_set_tensor(d, (attn_tensor_role_t)-1, NULL));
  /* a tensor descriptor whose dims were never set */
  EXPECT_OK(attn_tensor_desc_create(&t));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "tensor", attn_plan_desc_set_tensor(d, ATTN_TENSOR_Q, t));
  EXPECT_OK(attn_tensor_desc_destroy(t));
  /* scale, softcap */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "scale", attn_plan_desc_set_softmax_scale(d, 0.0f));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "scale", attn_plan_desc_set_softmax_scale(d, -1.0f));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "scale", attn_plan_desc_set_softmax_scale(d, (float)NAN));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "scale", attn_plan_desc_set_softmax_scale(d, (float)INFINITY));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cap", attn_plan_desc_set_softcap(d, -1.0f));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cap", attn_plan_desc_set_softcap(d, (float)NAN));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cap", attn_plan_desc_set_softcap(d, (float)INFINITY));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "1e+30", attn_plan_desc_set_softcap(d, 3e38f));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cap", attn_plan_desc_set_softcap(d, 1.0001e30f));
  EXPECT_OK(attn_plan_desc_set_softcap(d, 1e30f)); /* the edge itself */
  EXPECT_OK(attn_plan_desc_set_softcap(d, 30.0f));  /* as set above */
  /* mask: bad enum; window args must be -1 for NONE and CAUSAL; >= -1 for WINDOW */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "mask", attn_plan_desc_set_mask(d, (attn_mask_t)3, -1, -1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "mask", attn_plan_desc_set_mask(d, (attn_mask_t)-1, -1, -1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "window_left", attn_plan_desc_set_mask(d, ATTN_MASK_NONE, 0, -1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "window_right", attn_plan_desc_set_mask(d, ATTN_MASK_NONE, -1, 3));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "window_left", attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, 4, -1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "window_right", attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "window_left", attn_plan_desc_set_mask(d, ATTN_MASK_WINDOW, -2, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "window_right", attn_plan_desc_set_mask(d, ATTN_MASK_WINDOW, 0, -7));
  /* varlen offsets */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cu_seqlens_q", attn_plan_desc_set_varlen(d, 2, NULL, cu_ok));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cu_seqlens_kv", attn_plan_desc_set_varlen(d, 2, cu_ok, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "batch", attn_plan_desc_set_varlen(d, 0, cu_ok, cu_ok));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "batch", attn_plan_desc_set_varlen(d, -3, cu_ok, cu_ok));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cu_seqlens_q", attn_plan_desc_set_varlen(d, 2, cu_bad0, cu_ok));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cu_seqlens_kv", attn_plan_desc_set_varlen(d, 2, cu_ok, cu_bad0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cu_seqlens_q", attn_plan_desc_set_varlen(d, 2, cu_dec, cu_ok));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "cu_seqlens_kv", attn_plan_desc_set_varlen(d, 2, cu_ok, cu_dec));
  /* flags */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "allow", attn_plan_desc_set_allow_empty_rows(d, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "allow", attn_plan_desc_set_allow_empty_rows(d, -1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "passes", attn_plan_desc_set_passes(d, (attn_passes_t)0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "passes", attn_plan_desc_set_passes(d, (attn_passes_t)2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "passes", attn_plan_desc_set_passes(d, (attn_passes_t)4));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "deterministic", attn_plan_desc_set_deterministic(d, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "deterministic", attn_plan_desc_set_deterministic(d, -1));

  /* None of the failed setters changed the descriptor. */
  summary_of_desc(d, after, sizeof after);
  assert_string_equal(before, after);

  /* Boundary values that are valid. */
  EXPECT_OK(attn_plan_desc_set_shape(d, 1, 1, 1, 0, 0, 1, 1));
  EXPECT_OK(attn_plan_desc_set_shape(d, 1, 1, 1, 1, 1, 1024, 1024));
  EXPECT_OK(attn_plan_desc_set_softcap(d, 0.0f));
  EXPECT_OK(attn_plan_desc_set_mask(d, ATTN_MASK_WINDOW, -1, -1));
  EXPECT_OK(attn_plan_desc_set_mask(d, ATTN_MASK_WINDOW, 0, 0));
  EXPECT_OK(attn_plan_desc_set_allow_empty_rows(d, 0));
  EXPECT_OK(attn_plan_desc_set_deterministic(d, 1));
  EXPECT_OK(attn_plan_desc_set_deterministic(d, 0));
  EXPECT_OK(attn_plan_desc_set_varlen(d, 2, NULL, NULL)); /* clearing is always fine */
  EXPECT_OK(attn_plan_desc_destroy(d));
}

/* ------------------------------------------------------------------------ */
/* Plan creation                                                             */
/* ------------------------------------------------------------------------ */

#define POISON_PLAN(pl) ((pl) = (attn_plan_t)(void *)(uintptr_t)0xA5A5A5A0u)
#define EXPECT_PLAN_UNTOUCHED(pl) assert_ptr_equal((void *)(pl), (void *)(uintptr_t)0xA5A5A5A0u)
/* d makes a plan (created, then destroyed). */
#define EXPECT_PLAN_CREATES(d) \
  do { \
    attn_plan_t created_; \
    EXPECT_OK(attn_plan_create(g_ctx, (d), &created_)); \
    EXPECT_OK(attn_plan_destroy(created_)); \
  } while (0)

static void test_plan_create_handles(void **state) {
  prob_t p = std_prob();
  attn_plan_desc_t d = desc_for(&p);
  attn_context_t ctx, dead;
  attn_plan_t plan;
  (void)state;

  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_plan_create(NULL, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_create(g_ctx, NULL, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "plan", attn_plan_create(g_ctx, d, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_plan_create((attn_context_t)(void *)d, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_create(g_ctx, (attn_plan_desc_t)(void *)g_ctx, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);

  EXPECT_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx));
  dead = ctx;
  EXPECT_OK(attn_context_destroy(ctx));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_plan_create(dead, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);

  /* The descriptor may be destroyed after the plan is made. */
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_desc_destroy(d));
  EXPECT_OK(attn_plan_destroy(plan));
}

static void test_plan_create_shape_and_heads(void **state) {
  attn_plan_desc_t d;
  attn_plan_t plan;
  (void)state;

  /* The shape's head dims default to 0: must be set. */
  EXPECT_OK(attn_plan_desc_create(&d));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "shape", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);

  /* heads_q % heads_kv != 0: rejected at plan creation, not by the setter. */
  EXPECT_OK(attn_plan_desc_set_shape(d, 1, 8, 3, 4, 4, 8, 8));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "heads_q", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "heads_kv", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_shape(d, 1, 2, 4, 4, 4, 8, 8)); /* heads_kv > heads_q */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "heads_q", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);

  /* GQA, MQA and a different head_dim_v are fine. */
  EXPECT_OK(attn_plan_desc_set_shape(d, 1, 8, 2, 4, 4, 8, 16));
  EXPECT_PLAN_CREATES(d);
  EXPECT_OK(attn_plan_desc_set_shape(d, 1, 8, 1, 4, 4, 8, 8));
  EXPECT_PLAN_CREATES(d);
  EXPECT_OK(attn_plan_desc_destroy(d));
}

/* Rows that see no key: rejected unless allowed, and then O = 0, LSE = -inf. */
static void test_empty_rows(void **state) {
  prob_t p = std_prob();
  attn_plan_desc_t d;
  attn_plan_t plan;
  io_t io;
  int64_t b, s, h, c;
  (void)state;

  /* Causal with Lq > Lk: the first Lq - Lk queries see nothing. */
  p.lq = 9, p.lk = 6, p.mask = ATTN_MASK_CAUSAL;
  d = desc_for(&p);
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "mask", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_destroy(d));

  /* A window with Lq > Lk: off = -3, window (1, 1): query 0 sees [-4, -2]. */
  p.mask = ATTN_MASK_WINDOW, p.wl = 1, p.wr = 1;
  d = desc_for(&p);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "mask", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  /* Allowed: works, for the window ... */
  EXPECT_OK(attn_plan_desc_set_allow_empty_rows(d, 1));
  EXPECT_PLAN_CREATES(d);
  EXPECT_OK(attn_plan_desc_destroy(d));

  /* ... and for causal, checked on the outputs. */
  p.mask = ATTN_MASK_CAUSAL, p.wl = -1, p.wr = -1, p.allow_empty = 1;
  plan = plan_for(&p);
  io_alloc(&io, plan, &p);
  EXPECT_OK(attn_forward(plan, io.q, io.k, io.v, io.o, io.lse, io.wsf, io.ws_f, NULL));
  EXPECT_OK(attn_backward(plan, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb,
                          io.ws_b, NULL));
  for (b = 0; b < p.batch; ++b)
    for (h = 0; h < p.hq; ++h)
      for (s = 0; s < p.lq; ++s) {
        const int empty = s < p.lq - p.lk;
        const float lse = io.lse[(b * p.hq + h) * p.lq + s];
        if (empty) {
          assert_true(isinf(lse) && lse < 0.0f);
        } else {
          assert_true(isfinite(lse));
        }
        for (c = 0; c < p.dv; ++c) {
          const float o = io.o[((b * p.lq + s) * p.hq + h) * p.dv + c];
          const float dq = io.dq[((b * p.lq + s) * p.hq + h) * p.dqk + c];
          assert_true(isfinite(o) && isfinite(dq));
          if (empty) {
            assert_true(o == 0.0f);
            assert_true(dq == 0.0f);
          }
        }
      }
  for (c = 0; c < (int64_t)io.nk; ++c) assert_true(isfinite(io.dk[c]) && isfinite(io.dv[c]));
  /* A non-finite V at a key that the empty rows share a tile with (the last
     key, seen by the last query only): the empty rows still give exactly 0
     (they got their P = 0 times Inf in the accumulator), and LSE = -inf. */
  io.v[((0 * p.lk + (p.lk - 1)) * p.hkv + 0) * p.dv + 3] = INFINITY;
  io.v[((1 * p.lk + (p.lk - 1)) * p.hkv + 1) * p.dv + 0] = NAN;
  poison(io.o, io.no * 4);
  EXPECT_OK(attn_forward(plan, io.q, io.k, io.v, io.o, io.lse, io.wsf, io.ws_f, NULL));
  for (b = 0; b < p.batch; ++b)
    for (h = 0; h < p.hq; ++h)
      for (s = 0; s < p.lq - p.lk; ++s) {
        assert_true(isinf(io.lse[(b * p.hq + h) * p.lq + s]));
        for (c = 0; c < p.dv; ++c) assert_true(io.o[((b * p.lq + s) * p.hq + h) * p.dv + c] == 0.0f);
      }
  io_free(&io);
  EXPECT_OK(attn_plan_destroy(plan));

  /* No query rows but keys (Lq = 0 < Lk): nothing to compute; every tensor
     may be NULL in the forward, and the backward gives dK = dV = 0. */
  p.lq = 0, p.lk = 6;
  plan = plan_for(&p);
  io_alloc(&io, plan, &p);
  EXPECT_OK(attn_forward(plan, NULL, NULL, NULL, NULL, NULL, io.wsf, io.ws_f, NULL));
  EXPECT_OK(attn_backward(plan, NULL, io.k, io.v, NULL, NULL, NULL, NULL, io.dk, io.dv, io.wsb,
                          io.ws_b, NULL));
  for (c = 0; c < (int64_t)io.nk; ++c) assert_true(io.dk[c] == 0.0f && io.dv[c] == 0.0f);
  io_free(&io);
  EXPECT_OK(attn_plan_destroy(plan));
  p.lq = 9;

  /* No keys at all (Lk = 0): every row is empty; K and V may be NULL. */
  p.lk = 0;
  plan = plan_for(&p);
  io_alloc(&io, plan, &p);
  EXPECT_OK(attn_forward(plan, io.q, NULL, NULL, io.o, io.lse, io.wsf, io.ws_f, NULL));
  for (c = 0; c < (int64_t)io.no; ++c) assert_true(io.o[c] == 0.0f);
  for (c = 0; c < (int64_t)io.nlse; ++c) assert_true(isinf(io.lse[c]) && io.lse[c] < 0.0f);
  /* ... and the backward gives dQ = 0, with K, V, dK, dV NULL. */
  EXPECT_OK(attn_backward(plan, io.q, NULL, NULL, io.o, io.lse, io.d_o, io.dq, NULL, NULL, io.wsb,
                          io.ws_b, NULL));
  for (c = 0; c < (int64_t)io.nq; ++c) assert_true(io.dq[c] == 0.0f);
  io_free(&io);
  EXPECT_OK(attn_plan_destroy(plan));
}

static void test_varlen_errors(void **state) {
  attn_plan_desc_t d;
  attn_plan_t plan;
  /* lengths q: 3, 0, 4 (max 4); kv: 5, 2, 4 (max 5) */
  const int32_t cu_q[4] = {0, 3, 3, 7};
  const int32_t cu_kv[4] = {0, 5, 7, 11};
  /* q longer than kv in sequence 0 */
  const int32_t cu_q_long[4] = {0, 6, 6, 10};
  (void)state;

  EXPECT_OK(attn_plan_desc_create(&d));
  EXPECT_OK(attn_plan_desc_set_shape(d, 3, 4, 2, 4, 5, 8, 8));
  EXPECT_OK(attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, -1));
  EXPECT_OK(attn_plan_desc_set_varlen(d, 3, cu_q, cu_kv));
  EXPECT_PLAN_CREATES(d);

  POISON_PLAN(plan);
  /* batch of the offsets != batch of the shape */
  EXPECT_OK(attn_plan_desc_set_varlen(d, 2, cu_q, cu_kv));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "batch", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_varlen(d, 3, cu_q, cu_kv));

  /* seqlen_q / seqlen_kv must be the longest sequences */
  EXPECT_OK(attn_plan_desc_set_shape(d, 3, 4, 2, 5, 5, 8, 8));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "seqlen_q", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_shape(d, 3, 4, 2, 4, 9, 8, 8));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "seqlen_kv", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_shape(d, 3, 4, 2, 4, 5, 8, 8));

  /* Layout conflicts: BHSD (or BSHD) named explicitly with a varlen batch. */
  EXPECT_OK(attn_plan_desc_set_layout(d, ATTN_LAYOUT_BHSD));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "layout", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_layout(d, ATTN_LAYOUT_BSHD));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "layout", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  /* THD named explicitly is fine with varlen ... */
  EXPECT_OK(attn_plan_desc_set_layout(d, ATTN_LAYOUT_THD));
  EXPECT_PLAN_CREATES(d);
  /* ... but not without it. */
  EXPECT_OK(attn_plan_desc_set_varlen(d, 3, NULL, NULL));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "THD", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "layout", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_layout(d, ATTN_LAYOUT_BSHD));
  EXPECT_PLAN_CREATES(d); /* fixed-length again */
  EXPECT_OK(attn_plan_desc_destroy(d));

  /* Tensor overrides of a varlen plan are THD: [total_tokens, heads, dim]. */
  EXPECT_OK(attn_plan_desc_create(&d));
  EXPECT_OK(attn_plan_desc_set_shape(d, 3, 4, 2, 4, 5, 8, 8));
  EXPECT_OK(attn_plan_desc_set_varlen(d, 3, cu_q, cu_kv));
  {
    attn_tensor_desc_t t;
    int64_t dims[3] = {7, 4, 8}; /* total_q = 7 */
    const int64_t strides[3] = {4 * 8 + 16, 8, 1};
    EXPECT_OK(attn_tensor_desc_create(&t));
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 3, dims, strides));
    EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_Q, t));
    EXPECT_PLAN_CREATES(d);
    dims[0] = 8; /* not the total */
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 3, dims, NULL));
    EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_Q, t));
    POISON_PLAN(plan);
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "tensor Q", attn_plan_create(g_ctx, d, &plan));
    EXPECT_PLAN_UNTOUCHED(plan);
    dims[0] = 11, dims[1] = 2; /* K: total_kv = 11, heads_kv = 2 */
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 3, dims, NULL));
    EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_Q, NULL));
    EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_K, t));
    EXPECT_PLAN_CREATES(d);
    EXPECT_OK(attn_tensor_desc_destroy(t));
  }
  EXPECT_OK(attn_plan_desc_destroy(d));

  /* A varlen sequence with more queries than keys leaves causal rows empty. */
  EXPECT_OK(attn_plan_desc_create(&d));
  EXPECT_OK(attn_plan_desc_set_shape(d, 3, 4, 2, 6, 5, 8, 8));
  EXPECT_OK(attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, -1));
  EXPECT_OK(attn_plan_desc_set_varlen(d, 3, cu_q_long, cu_kv));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "mask", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_allow_empty_rows(d, 1));
  EXPECT_PLAN_CREATES(d);
  EXPECT_OK(attn_plan_desc_destroy(d));
}

/* Tensor overrides are checked at plan creation and the message names the tensor. */
static void test_tensor_override_errors(void **state) {
  static const char *const names[8] = {"tensor Q",  "tensor K",  "tensor V",  "tensor O",
                                       "tensor dO", "tensor dQ", "tensor dK", "tensor dV"};
  prob_t p = std_prob();
  attn_plan_desc_t d;
  attn_tensor_desc_t t;
  attn_plan_t plan;
  int r;
  (void)state;

  p.dqk = 8, p.dv = 12; /* so that V-like and K-like dims differ */
  d = desc_for(&p);
  EXPECT_OK(attn_tensor_desc_create(&t));
  POISON_PLAN(plan);

  for (r = 0; r < 8; ++r) {
    const int q_side = r == ATTN_TENSOR_Q || r == ATTN_TENSOR_O || r == ATTN_TENSOR_DO || r == ATTN_TENSOR_DQ;
    const int v_dim = r == ATTN_TENSOR_V || r == ATTN_TENSOR_O || r == ATTN_TENSOR_DO || r == ATTN_TENSOR_DV;
    int64_t dims[4], strides[4], wrong[4];
    const attn_tensor_role_t role = (attn_tensor_role_t)r;
    dims[0] = p.batch;
    dims[1] = q_side ? p.lq : p.lk;
    dims[2] = q_side ? p.hq : p.hkv;
    dims[3] = v_dim ? p.dv : p.dqk;

    /* right dims, padded strides: accepted */
    strides[3] = 1, strides[2] = dims[3] + 4, strides[1] = strides[2] * dims[2] + 8;
    strides[0] = strides[1] * dims[1];
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, strides));
    EXPECT_OK(attn_plan_desc_set_tensor(d, role, t));
    EXPECT_PLAN_CREATES(d);
    POISON_PLAN(plan);

    /* wrong sequence length */
    memcpy(wrong, dims, sizeof wrong);
    wrong[1] += 1;
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, wrong, NULL));
    EXPECT_OK(attn_plan_desc_set_tensor(d, role, t));
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, names[r], attn_plan_create(g_ctx, d, &plan));
    EXPECT_PLAN_UNTOUCHED(plan);
    /* wrong head dim (the K dim where the V dim is expected and vice versa) */
    memcpy(wrong, dims, sizeof wrong);
    wrong[3] = v_dim ? p.dqk : p.dv;
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, wrong, NULL));
    EXPECT_OK(attn_plan_desc_set_tensor(d, role, t));
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, names[r], attn_plan_create(g_ctx, d, &plan));
    EXPECT_PLAN_UNTOUCHED(plan);
    /* wrong rank (THD-like) */
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 3, dims + 1, NULL));
    EXPECT_OK(attn_plan_desc_set_tensor(d, role, t));
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, names[r], attn_plan_create(g_ctx, d, &plan));
    EXPECT_PLAN_UNTOUCHED(plan);
    /* BHSD order while the plan is BSHD */
    wrong[0] = dims[0], wrong[1] = dims[2], wrong[2] = dims[1], wrong[3] = dims[3];
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, wrong, NULL));
    EXPECT_OK(attn_plan_desc_set_tensor(d, role, t));
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, names[r], attn_plan_create(g_ctx, d, &plan));
    EXPECT_PLAN_UNTOUCHED(plan);
    /* dtype mismatch */
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP16, 4, dims, NULL));
    EXPECT_OK(attn_plan_desc_set_tensor(d, role, t));
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, names[r], attn_plan_create(g_ctx, d, &plan));
    EXPECT_PLAN_UNTOUCHED(plan);
    /* last stride != 1 */
    strides[3] = 2, strides[2] = 2 * dims[3], strides[1] = strides[2] * dims[2];
    strides[0] = strides[1] * dims[1];
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, strides));
    EXPECT_OK(attn_plan_desc_set_tensor(d, role, t));
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, names[r], attn_plan_create(g_ctx, d, &plan));
    EXPECT_PLAN_UNTOUCHED(plan);

    /* NULL restores the default strides. */
    EXPECT_OK(attn_plan_desc_set_tensor(d, role, NULL));
    EXPECT_PLAN_CREATES(d);
    POISON_PLAN(plan);
  }

  /* The descriptor is copied: changing or destroying it later has no effect. */
  {
    int64_t dims[4];
    dims[0] = p.batch, dims[1] = p.lk, dims[2] = p.hkv, dims[3] = p.dqk;
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, NULL));
    EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_K, t));
    dims[1] += 3;
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, NULL));
    EXPECT_OK(attn_tensor_desc_destroy(t));
    EXPECT_PLAN_CREATES(d);
  }
  EXPECT_OK(attn_plan_desc_destroy(d));
}

/* attn.h says output tensors must not overlap themselves. Overlap *within*
 * one output is visible from its strides at plan creation (here O with a zero
 * sequence stride, so every query row writes the same memory), so it is
 * rejected with INVALID_ARGUMENT naming O. */
static void test_output_self_overlap_rejected(void **state) {
  prob_t p = std_prob();
  attn_plan_desc_t d = desc_for(&p);
  attn_tensor_desc_t t;
  attn_plan_t plan;
  int64_t dims[4], strides[4];
  (void)state;
  dims[0] = p.batch, dims[1] = p.lq, dims[2] = p.hq, dims[3] = p.dv;
  strides[3] = 1, strides[2] = p.dv, strides[1] = 0, strides[0] = p.hq * p.dv;
  EXPECT_OK(attn_tensor_desc_create(&t));
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, strides));
  EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_O, t));
  EXPECT_OK(attn_tensor_desc_destroy(t));
  POISON_PLAN(plan);
  {
    attn_status_t st = attn_plan_create(g_ctx, d, &plan);
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "O", st);
    EXPECT_PLAN_UNTOUCHED(plan);
    EXPECT_OK(attn_plan_desc_destroy(d));
  }
}

static void test_layout_thd_without_varlen(void **state) {
  prob_t p = std_prob();
  attn_plan_desc_t d = desc_for(&p);
  attn_plan_t plan;
  (void)state;
  EXPECT_OK(attn_plan_desc_set_layout(d, ATTN_LAYOUT_THD));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "layout", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_layout(d, ATTN_LAYOUT_BHSD));
  EXPECT_PLAN_CREATES(d);
  EXPECT_OK(attn_plan_desc_destroy(d));
}

/* ATTN_CPU_ISA: an unknown name is an error at plan creation (not at context
 * creation); a valid one selects that kernel. */
static void test_cpu_isa_env(void **state) {
  prob_t p = std_prob();
  attn_plan_desc_t d = desc_for(&p);
  attn_plan_t plan;
  attn_context_t ctx;
  attn_plan_info_t info;
  attn_status_t st;
  char *saved = getenv("ATTN_CPU_ISA") ? strdup(getenv("ATTN_CPU_ISA")) : NULL;
  (void)state;

  assert_int_equal(setenv("ATTN_CPU_ISA", "bogus-isa", 1), 0);
  EXPECT_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx));
  POISON_PLAN(plan);
  st = attn_plan_create(ctx, d, &plan);
  /* attn.h does not say which status; accept either documented category. */
  if (st != ATTN_STATUS_NOT_SUPPORTED) EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "ATTN_CPU_ISA", st);
  else EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "ATTN_CPU_ISA", st);
  EXPECT_PLAN_UNTOUCHED(plan);

  assert_int_equal(setenv("ATTN_CPU_ISA", "generic", 1), 0);
  EXPECT_OK(attn_plan_create(ctx, d, &plan));
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_string_equal(info.kernel, "cpu-generic");
  EXPECT_OK(attn_plan_destroy(plan));

  /* A built-but-unsupported ISA must be NOT_SUPPORTED; on this machine it may
   * simply work. */
  assert_int_equal(setenv("ATTN_CPU_ISA", "avx512", 1), 0);
  POISON_PLAN(plan);
  st = attn_plan_create(ctx, d, &plan);
  if (st == ATTN_STATUS_SUCCESS) {
    EXPECT_OK(attn_plan_destroy(plan));
  } else {
    EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "ATTN_CPU_ISA", st);
    EXPECT_PLAN_UNTOUCHED(plan);
  }

  if (saved) {
    setenv("ATTN_CPU_ISA", saved, 1);
    free(saved);
  } else {
    unsetenv("ATTN_CPU_ISA");
  }
  EXPECT_OK(attn_context_destroy(ctx));
  EXPECT_OK(attn_plan_desc_destroy(d));
}

/* ------------------------------------------------------------------------ */
/* Plan queries                                                              */
/* ------------------------------------------------------------------------ */

static void test_workspace_size(void **state) {
  prob_t p = std_prob();
  attn_plan_t fb, fwd_only;
  size_t bytes, fwd_bytes;
  (void)state;
  fb = plan_for(&p);
  p.passes = ATTN_PASSES_FORWARD;
  fwd_only = plan_for(&p);

  POISON_VAR(bytes);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_workspace_size(NULL, ATTN_PASS_FORWARD, &bytes));
  EXPECT_VAR_UNTOUCHED(bytes);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              attn_plan_workspace_size((attn_plan_t)(void *)g_ctx, ATTN_PASS_FORWARD, &bytes));
  EXPECT_VAR_UNTOUCHED(bytes);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "bytes", attn_plan_workspace_size(fb, ATTN_PASS_FORWARD, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "pass", attn_plan_workspace_size(fb, (attn_pass_t)0, &bytes));
  EXPECT_VAR_UNTOUCHED(bytes);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "pass", attn_plan_workspace_size(fb, (attn_pass_t)3, &bytes));
  EXPECT_VAR_UNTOUCHED(bytes);
  /* BACKWARD on a forward-only plan */
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "BACKWARD", attn_plan_workspace_size(fwd_only, ATTN_PASS_BACKWARD, &bytes));
  EXPECT_VAR_UNTOUCHED(bytes);

  EXPECT_OK(attn_plan_workspace_size(fwd_only, ATTN_PASS_FORWARD, &fwd_bytes));
  EXPECT_OK(attn_plan_workspace_size(fb, ATTN_PASS_FORWARD, &bytes));
  assert_int_equal(bytes, fwd_bytes);
  EXPECT_OK(attn_plan_workspace_size(fb, ATTN_PASS_BACKWARD, &bytes));

  EXPECT_OK(attn_plan_destroy(fb));
  EXPECT_OK(attn_plan_destroy(fwd_only));
}

static void test_describe(void **state) {
  prob_t p = std_prob();
  attn_plan_t plan = plan_for(&p), fwd_only;
  attn_plan_info_t full, info, ref;
  union {
    attn_plan_info_t info;
    unsigned char raw[sizeof(attn_plan_info_t) + 64];
  } big;
  size_t ws_f, ws_b;
  const size_t old_size = offsetof(attn_plan_info_t, visible_pairs);
  const size_t min_size = offsetof(attn_plan_info_t, dtype);
  uint64_t bad_sizes[4];
  size_t i;
  (void)state;

  /* Full struct. */
  poison(&full, sizeof full);
  full.struct_size = sizeof full;
  EXPECT_OK(attn_plan_describe(plan, &full));
  assert_int_equal(full.struct_size, sizeof full);
  assert_int_equal(full.backend, ATTN_BACKEND_CPU);
  assert_int_equal(full.dtype, ATTN_DTYPE_FP32);
  assert_int_equal(full.supports_backward, 1);
  assert_int_equal(full.num_threads, 1);
  assert_true(full.tile_q > 0 && full.tile_kv > 0);
  EXPECT_OK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_f));
  EXPECT_OK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &ws_b));
  assert_int_equal(full.workspace_bytes_forward, ws_f);
  assert_int_equal(full.workspace_bytes_backward, ws_b);
  /* Lq 5, Lk 7, causal bottom-right: row i sees i + 3 keys, 25 pairs per
   * (batch, head); 2 batches x 4 query heads. */
  assert_int_equal(full.visible_pairs, 200);
  assert_true(full.flops_forward == 4.0 * 200 * 8);
  assert_true(full.flops_backward == 2.5 * full.flops_forward);
  assert_non_null(memchr(full.algorithm, '\0', sizeof full.algorithm));
  assert_non_null(memchr(full.kernel, '\0', sizeof full.kernel));
  assert_true(full.algorithm[0] != '\0');
  assert_true(strncmp(full.kernel, "cpu-", 4) == 0);

  /* Errors: NULL plan, wrong kind, NULL info, struct_size too small. */
  poison(&info, sizeof info);
  info.struct_size = sizeof info;
  ref = info;
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_describe(NULL, &info));
  assert_memory_equal(&info, &ref, sizeof info);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_describe((attn_plan_t)(void *)g_ctx, &info));
  assert_memory_equal(&info, &ref, sizeof info);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "info", attn_plan_describe(plan, NULL));
  bad_sizes[0] = 0, bad_sizes[1] = 4, bad_sizes[2] = sizeof(uint64_t), bad_sizes[3] = min_size - 1;
  for (i = 0; i < 4; ++i) {
    poison(&info, sizeof info);
    info.struct_size = bad_sizes[i];
    ref = info;
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "struct_size", attn_plan_describe(plan, &info));
    assert_memory_equal(&info, &ref, sizeof info);
  }

  /* An "old" caller: only the prefix it knows is filled. */
  poison(&info, sizeof info);
  info.struct_size = old_size;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.struct_size, old_size);
  assert_memory_equal((const char *)&info + sizeof info.struct_size,
                      (const char *)&full + sizeof full.struct_size, old_size - sizeof info.struct_size);
  EXPECT_UNTOUCHED((const char *)&info + old_size, sizeof info - old_size);

  /* The smallest accepted size: struct_size and backend. */
  poison(&info, sizeof info);
  info.struct_size = min_size;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.struct_size, min_size);
  assert_int_equal(info.backend, ATTN_BACKEND_CPU);
  EXPECT_UNTOUCHED((const char *)&info + min_size, sizeof info - min_size);

  /* A "newer" caller with a bigger struct: what the library knows is filled,
   * nothing beyond it is written. */
  poison(&big, sizeof big);
  big.info.struct_size = sizeof big;
  EXPECT_OK(attn_plan_describe(plan, &big.info));
  assert_memory_equal(big.raw + sizeof full.struct_size, (const char *)&full + sizeof full.struct_size,
                      sizeof full - sizeof full.struct_size);
  EXPECT_UNTOUCHED(big.raw + sizeof full, sizeof big - sizeof full);

  /* A forward-only plan reports no backward workspace. */
  p.passes = ATTN_PASSES_FORWARD;
  fwd_only = plan_for(&p);
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(fwd_only, &info));
  assert_int_equal(info.supports_backward, 0);
  assert_int_equal(info.workspace_bytes_backward, 0);
  EXPECT_OK(attn_plan_destroy(fwd_only));
  EXPECT_OK(attn_plan_destroy(plan));
}

static void test_summary(void **state) {
  prob_t p = std_prob();
  attn_plan_t plan = plan_for(&p);
  char full[1024], buf[1024];
  size_t needed, len;
  (void)state;

  needed = 0;
  EXPECT_OK(attn_plan_summary(plan, full, sizeof full, &needed));
  len = strlen(full);
  assert_true(len > 0);
  assert_int_equal(needed, len + 1);
  assert_non_null(strstr(full, "backend=cpu"));
  assert_non_null(strstr(full, "mask=causal"));
  assert_null(strchr(full, '\n')); /* one line */

  /* Errors: nothing written. */
  POISON_VAR(needed);
  poison(buf, sizeof buf);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_summary(NULL, buf, sizeof buf, &needed));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              attn_plan_summary((attn_plan_t)(void *)g_ctx, buf, sizeof buf, &needed));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "buf", attn_plan_summary(plan, NULL, 16, &needed));
  EXPECT_VAR_UNTOUCHED(needed);
  EXPECT_UNTOUCHED(buf, sizeof buf);

  /* capacity 0: only *needed; buf may be NULL, or is left alone. */
  EXPECT_OK(attn_plan_summary(plan, NULL, 0, &needed));
  assert_int_equal(needed, len + 1);
  POISON_VAR(needed);
  EXPECT_OK(attn_plan_summary(plan, buf, 0, &needed));
  assert_int_equal(needed, len + 1);
  EXPECT_UNTOUCHED(buf, sizeof buf);
  EXPECT_OK(attn_plan_summary(plan, NULL, 0, NULL));

  /* capacity 1: just the NUL. */
  EXPECT_OK(attn_plan_summary(plan, buf, 1, &needed));
  assert_int_equal(buf[0], '\0');
  EXPECT_UNTOUCHED(buf + 1, sizeof buf - 1);
  assert_int_equal(needed, len + 1);

  /* capacity 10: 9 characters and a NUL, nothing after. */
  poison(buf, sizeof buf);
  EXPECT_OK(attn_plan_summary(plan, buf, 10, NULL));
  assert_int_equal(strlen(buf), 9);
  assert_memory_equal(buf, full, 9);
  EXPECT_UNTOUCHED(buf + 10, sizeof buf - 10);

  /* capacity len: one character short. */
  poison(buf, sizeof buf);
  EXPECT_OK(attn_plan_summary(plan, buf, len, &needed));
  assert_int_equal(strlen(buf), len - 1);
  assert_memory_equal(buf, full, len - 1);
  assert_int_equal(needed, len + 1);
  EXPECT_UNTOUCHED(buf + len, sizeof buf - len);

  /* capacity len + 1: exact. */
  poison(buf, sizeof buf);
  EXPECT_OK(attn_plan_summary(plan, buf, len + 1, &needed));
  assert_string_equal(buf, full);
  EXPECT_UNTOUCHED(buf + len + 1, sizeof buf - len - 1);

  EXPECT_OK(attn_plan_destroy(plan));
}

/* ------------------------------------------------------------------------ */
/* Execution                                                                 */
/* ------------------------------------------------------------------------ */

/* A plan's forward with each tensor NULL, a short workspace and a missing
 * one: each call fails with the documented status naming the argument and
 * writes neither O nor LSE (io's outputs stay poisoned). */
static void expect_forward_argument_errors(attn_plan_t plan, io_t *io) {
#define FWD(q_, k_, v_, o_, lse_, ws_, bytes_) \
  attn_forward(plan, (q_), (k_), (v_), (o_), (lse_), (ws_), (bytes_), NULL)
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "q", FWD(NULL, io->k, io->v, io->o, io->lse, io->wsf, io->ws_f));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "k", FWD(io->q, NULL, io->v, io->o, io->lse, io->wsf, io->ws_f));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "v", FWD(io->q, io->k, NULL, io->o, io->lse, io->wsf, io->ws_f));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "o", FWD(io->q, io->k, io->v, NULL, io->lse, io->wsf, io->ws_f));
  EXPECT_IO_UNTOUCHED(io);
  EXPECT_FAIL(ATTN_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes",
              FWD(io->q, io->k, io->v, io->o, io->lse, io->wsf, io->ws_f - 1));
  EXPECT_FAIL(ATTN_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes",
              FWD(io->q, io->k, io->v, io->o, io->lse, NULL, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "workspace",
              FWD(io->q, io->k, io->v, io->o, io->lse, NULL, io->ws_f));
  EXPECT_IO_UNTOUCHED(io);
#undef FWD
}

/* A plan's backward with each tensor NULL, a short workspace (also the
 * forward's size where that is smaller) and a missing one: each call fails
 * with the documented status naming the argument, and dQ, dK, dV stay
 * poisoned (the caller checks that O and LSE did not change). */
static void expect_backward_argument_errors(attn_plan_t plan, io_t *io) {
#define BWD1(...) attn_backward(plan, __VA_ARGS__, NULL)
#define ALL io->q, io->k, io->v, io->o, io->lse, io->d_o, io->dq, io->dk, io->dv
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "q", BWD1(NULL, io->k, io->v, io->o, io->lse, io->d_o, io->dq, io->dk, io->dv, io->wsb, io->ws_b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "k", BWD1(io->q, NULL, io->v, io->o, io->lse, io->d_o, io->dq, io->dk, io->dv, io->wsb, io->ws_b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "v", BWD1(io->q, io->k, NULL, io->o, io->lse, io->d_o, io->dq, io->dk, io->dv, io->wsb, io->ws_b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "o", BWD1(io->q, io->k, io->v, NULL, io->lse, io->d_o, io->dq, io->dk, io->dv, io->wsb, io->ws_b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "lse", BWD1(io->q, io->k, io->v, io->o, NULL, io->d_o, io->dq, io->dk, io->dv, io->wsb, io->ws_b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "d_o", BWD1(io->q, io->k, io->v, io->o, io->lse, NULL, io->dq, io->dk, io->dv, io->wsb, io->ws_b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dq", BWD1(io->q, io->k, io->v, io->o, io->lse, io->d_o, NULL, io->dk, io->dv, io->wsb, io->ws_b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dk", BWD1(io->q, io->k, io->v, io->o, io->lse, io->d_o, io->dq, NULL, io->dv, io->wsb, io->ws_b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dv", BWD1(io->q, io->k, io->v, io->o, io->lse, io->d_o, io->dq, io->dk, NULL, io->wsb, io->ws_b));
  EXPECT_FAIL(ATTN_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes", BWD1(ALL, io->wsb, io->ws_b - 1));
  /* the forward's workspace size is not enough for the backward */
  if (io->ws_f < io->ws_b)
    EXPECT_FAIL(ATTN_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes", BWD1(ALL, io->wsb, io->ws_f));
  EXPECT_FAIL(ATTN_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes", BWD1(ALL, NULL, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "workspace", BWD1(ALL, NULL, io->ws_b));
#undef ALL
#undef BWD1
  check_poisoned(io->dq, io->nq * 4, "dQ", __FILE__, __LINE__);
  check_poisoned(io->dk, io->nk * 4, "dK", __FILE__, __LINE__);
  check_poisoned(io->dv, io->nv * 4, "dV", __FILE__, __LINE__);
}

static void test_forward_errors(void **state) {
  prob_t p = std_prob();
  attn_plan_t plan = plan_for(&p), dead;
  io_t io;
  (void)state;
  io_alloc(&io, plan, &p);
  assert_true(io.ws_f > 0);

  /* handles */
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              attn_forward(NULL, io.q, io.k, io.v, io.o, io.lse, io.wsf, io.ws_f, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              attn_forward((attn_plan_t)(void *)g_ctx, io.q, io.k, io.v, io.o, io.lse, io.wsf, io.ws_f, NULL));
  EXPECT_IO_UNTOUCHED(&io);
  expect_forward_argument_errors(plan, &io);

  /* lse is optional; a bigger workspace is fine. */
  EXPECT_OK(attn_forward(plan, io.q, io.k, io.v, io.o, NULL, io.wsf, io.ws_f, NULL));
  EXPECT_UNTOUCHED(io.lse, io.nlse * 4);
  {
    void *big = xmalloc(io.ws_f + 1000);
    EXPECT_OK(attn_forward(plan, io.q, io.k, io.v, io.o, io.lse, big, io.ws_f + 1000, NULL));
    free(big);
  }
  assert_true(isfinite(io.lse[0]) && isfinite(io.o[0]));

  /* destroyed plan */
  dead = plan;
  EXPECT_OK(attn_plan_destroy(plan));
  poison(io.o, io.no * 4);
  poison(io.lse, io.nlse * 4);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              attn_forward(dead, io.q, io.k, io.v, io.o, io.lse, io.wsf, io.ws_f, NULL));
  EXPECT_IO_UNTOUCHED(&io);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_destroy(dead));
  io_free(&io);
}

static void test_backward_errors(void **state) {
  prob_t p = std_prob();
  attn_plan_t plan = plan_for(&p), fwd_only, dead;
  io_t io;
  float *o_ref, *lse_ref;
  (void)state;
  io_alloc(&io, plan, &p);
  assert_true(io.ws_b > 0);
  EXPECT_OK(attn_forward(plan, io.q, io.k, io.v, io.o, io.lse, io.wsf, io.ws_f, NULL));
  o_ref = xmalloc(io.no * 4);
  lse_ref = xmalloc(io.nlse * 4);
  memcpy(o_ref, io.o, io.no * 4);
  memcpy(lse_ref, io.lse, io.nlse * 4);

#define BWD(pl, q_, k_, v_, o_, lse_, do_, dq_, dk_, dv_, ws_, wsb_) \
  attn_backward((pl), (q_), (k_), (v_), (o_), (lse_), (do_), (dq_), (dk_), (dv_), (ws_), (wsb_), NULL)

  /* dQ, dK, dV are poisoned (by io_alloc) and must stay so. */
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              BWD(NULL, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb, io.ws_b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              BWD((attn_plan_t)(void *)g_ctx, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb, io.ws_b));
  expect_backward_argument_errors(plan, &io);
  /* inputs are not written either */
  assert_memory_equal(io.o, o_ref, io.no * 4);
  assert_memory_equal(io.lse, lse_ref, io.nlse * 4);

  /* A forward-only plan. */
  p.passes = ATTN_PASSES_FORWARD;
  fwd_only = plan_for(&p);
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "plan",
              BWD(fwd_only, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb, io.ws_b));
  check_poisoned(io.dq, io.nq * 4, "dQ", __FILE__, __LINE__);
  check_poisoned(io.dk, io.nk * 4, "dK", __FILE__, __LINE__);
  check_poisoned(io.dv, io.nv * 4, "dV", __FILE__, __LINE__);
  EXPECT_OK(attn_plan_destroy(fwd_only));

  EXPECT_OK(BWD(plan, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb, io.ws_b));
  assert_true(isfinite(io.dq[0]) && isfinite(io.dk[0]) && isfinite(io.dv[0]));

  dead = plan;
  EXPECT_OK(attn_plan_destroy(plan));
  poison(io.dq, io.nq * 4);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              BWD(dead, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb, io.ws_b));
  check_poisoned(io.dq, io.nq * 4, "dQ", __FILE__, __LINE__);
#undef BWD
  free(o_ref);
  free(lse_ref);
  io_free(&io);
}

/* An empty problem (seqlen_q = 0) accepts NULL tensors. */
static void test_empty_problem(void **state) {
  prob_t p = std_prob();
  attn_plan_t plan;
  size_t wf = 0, wb = 0;
  void *wsf, *wsb;
  (void)state;
  p.lq = 0, p.lk = 0, p.mask = ATTN_MASK_NONE;
  plan = plan_for(&p);
  EXPECT_OK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &wf));
  EXPECT_OK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &wb));
  wsf = wf ? xmalloc(wf) : NULL;
  wsb = wb ? xmalloc(wb) : NULL;
  EXPECT_OK(attn_forward(plan, NULL, NULL, NULL, NULL, NULL, wsf, wf, NULL));
  EXPECT_OK(attn_backward(plan, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, wsb, wb, NULL));
  free(wsf);
  free(wsb);
  EXPECT_OK(attn_plan_destroy(plan));
}

/* ------------------------------------------------------------------------ */
/* Merge                                                                     */
/* ------------------------------------------------------------------------ */

typedef struct merge_fixture {
  attn_tensor_desc_t od, ld;
  float o0[2 * 3 * 8], o1[2 * 3 * 8], l0[6], l1[6];
  const void *o_parts[2];
  const float *lse_parts[2];
  float out[2 * 3 * 8], lse_out[6];
} merge_fixture_t;

static void merge_setup(merge_fixture_t *m) {
  const int64_t od[3] = {2, 3, 8}, ld[2] = {2, 3};
  EXPECT_OK(attn_tensor_desc_create(&m->od));
  EXPECT_OK(attn_tensor_desc_create(&m->ld));
  EXPECT_OK(attn_tensor_desc_set(m->od, ATTN_DTYPE_FP32, 3, od, NULL));
  EXPECT_OK(attn_tensor_desc_set(m->ld, ATTN_DTYPE_FP32, 2, ld, NULL));
  fill_random(m->o0, 48, 11);
  fill_random(m->o1, 48, 12);
  fill_random(m->l0, 6, 13);
  fill_random(m->l1, 6, 14);
  m->o_parts[0] = m->o0, m->o_parts[1] = m->o1;
  m->lse_parts[0] = m->l0, m->lse_parts[1] = m->l1;
  poison(m->out, sizeof m->out);
  poison(m->lse_out, sizeof m->lse_out);
}

static void merge_teardown(merge_fixture_t *m) {
  EXPECT_OK(attn_tensor_desc_destroy(m->od));
  EXPECT_OK(attn_tensor_desc_destroy(m->ld));
}

static void test_merge_errors(void **state) {
  merge_fixture_t m;
  attn_tensor_desc_t bad, dead;
  attn_plan_desc_t pd;
  const void *o_with_null[2];
  const float *l_with_null[2];
  int64_t dims[4], strides[3];
  (void)state;
  merge_setup(&m);
  EXPECT_OK(attn_tensor_desc_create(&bad));
  EXPECT_OK(attn_plan_desc_create(&pd));

#define MERGE(ctx_, n_, od_, ld_, op_, lp_, oo_, lo_) \
  attn_merge_states((ctx_), (n_), (od_), (ld_), (op_), (lp_), (oo_), (lo_), NULL)
  /* handles */
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", MERGE(NULL, 2, m.od, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx",
              MERGE((attn_context_t)(void *)pd, 2, m.od, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "o_desc", MERGE(g_ctx, 2, NULL, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "o_desc",
              MERGE(g_ctx, 2, (attn_tensor_desc_t)(void *)pd, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "lse_desc", MERGE(g_ctx, 2, m.od, NULL, m.o_parts, m.lse_parts, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "lse_desc",
              MERGE(g_ctx, 2, m.od, (attn_tensor_desc_t)(void *)g_ctx, m.o_parts, m.lse_parts, m.out, m.lse_out));
  /* num_parts */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "num_parts", MERGE(g_ctx, 0, m.od, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "num_parts", MERGE(g_ctx, -1, m.od, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  /* o_desc: never set, rank 1, last stride != 1 */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "o_desc", MERGE(g_ctx, 2, bad, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  dims[0] = 8;
  EXPECT_OK(attn_tensor_desc_set(bad, ATTN_DTYPE_FP32, 1, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "o_desc", MERGE(g_ctx, 2, bad, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  dims[0] = 2, dims[1] = 3, dims[2] = 4;
  strides[0] = 24, strides[1] = 8, strides[2] = 2;
  EXPECT_OK(attn_tensor_desc_set(bad, ATTN_DTYPE_FP32, 3, dims, strides));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "o_desc", MERGE(g_ctx, 2, bad, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  /* lse_desc: not fp32, wrong dims, wrong rank */
  dims[0] = 2, dims[1] = 3;
  EXPECT_OK(attn_tensor_desc_set(bad, ATTN_DTYPE_FP16, 2, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "lse_desc", MERGE(g_ctx, 2, m.od, bad, m.o_parts, m.lse_parts, m.out, m.lse_out));
  dims[1] = 4;
  EXPECT_OK(attn_tensor_desc_set(bad, ATTN_DTYPE_FP32, 2, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "lse_desc", MERGE(g_ctx, 2, m.od, bad, m.o_parts, m.lse_parts, m.out, m.lse_out));
  dims[0] = 2, dims[1] = 3, dims[2] = 8;
  EXPECT_OK(attn_tensor_desc_set(bad, ATTN_DTYPE_FP32, 3, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "lse_desc", MERGE(g_ctx, 2, m.od, bad, m.o_parts, m.lse_parts, m.out, m.lse_out));
  /* pointer arrays and their entries */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "o_parts", MERGE(g_ctx, 2, m.od, m.ld, NULL, m.lse_parts, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "lse_parts", MERGE(g_ctx, 2, m.od, m.ld, m.o_parts, NULL, m.out, m.lse_out));
  o_with_null[0] = m.o0, o_with_null[1] = NULL;
  l_with_null[0] = NULL, l_with_null[1] = m.l1;
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "o_parts[1]", MERGE(g_ctx, 2, m.od, m.ld, o_with_null, m.lse_parts, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "lse_parts[0]", MERGE(g_ctx, 2, m.od, m.ld, m.o_parts, l_with_null, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "o_out", MERGE(g_ctx, 2, m.od, m.ld, m.o_parts, m.lse_parts, NULL, m.lse_out));
  /* head_dim 0: O has no element, but every row's LSE is merged, so a
   * NULL LSE part is still refused (and valid ones merge). */
  {
    attn_tensor_desc_t o0 = NULL, l0 = NULL;
    const int64_t o0_dims[2] = {2, 0}, l0_dims[1] = {2};
    const float la[2] = {0.0f, -INFINITY}, lb[2] = {0.0f, 1.5f};
    const float *l_null[2], *l_ok[2];
    float lse_merged[2] = {7.0f, 7.0f};
    l_null[0] = la, l_null[1] = NULL;
    l_ok[0] = la, l_ok[1] = lb;
    EXPECT_OK(attn_tensor_desc_create(&o0));
    EXPECT_OK(attn_tensor_desc_create(&l0));
    EXPECT_OK(attn_tensor_desc_set(o0, ATTN_DTYPE_FP32, 2, o0_dims, NULL));
    EXPECT_OK(attn_tensor_desc_set(l0, ATTN_DTYPE_FP32, 1, l0_dims, NULL));
    EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "lse_parts[1]",
                MERGE(g_ctx, 2, o0, l0, m.o_parts, l_null, NULL, lse_merged));
    assert_true(lse_merged[0] == 7.0f && lse_merged[1] == 7.0f);
    EXPECT_OK(MERGE(g_ctx, 2, o0, l0, m.o_parts, l_ok, NULL, lse_merged));
    assert_float_equal(lse_merged[0], logf(2.0f), 1e-6);
    assert_float_equal(lse_merged[1], 1.5f, 1e-6);
    EXPECT_OK(attn_tensor_desc_destroy(o0));
    EXPECT_OK(attn_tensor_desc_destroy(l0));
  }
  /* destroyed descriptor */
  dead = bad;
  EXPECT_OK(attn_tensor_desc_destroy(bad));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "o_desc", MERGE(g_ctx, 2, dead, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "lse_desc", MERGE(g_ctx, 2, m.od, dead, m.o_parts, m.lse_parts, m.out, m.lse_out));

  EXPECT_UNTOUCHED(m.out, sizeof m.out);
  EXPECT_UNTOUCHED(m.lse_out, sizeof m.lse_out);
  EXPECT_OK(attn_plan_desc_destroy(pd));
  merge_teardown(&m);
}

static void test_merge_works(void **state) {
  merge_fixture_t m;
  float inplace[48], inplace_lse[6];
  const void *parts_ip[2];
  const float *lse_ip[2];
  int r, c;
  (void)state;
  merge_setup(&m);

  EXPECT_OK(MERGE(g_ctx, 2, m.od, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  for (r = 0; r < 6; ++r) {
    const double l0 = m.l0[r], l1 = m.l1[r];
    const double mx = l0 > l1 ? l0 : l1;
    const double lse = mx + log(exp(l0 - mx) + exp(l1 - mx));
    assert_true(fabs(lse - m.lse_out[r]) < 1e-5);
    for (c = 0; c < 8; ++c) {
      const double ref = exp(l0 - lse) * m.o0[r * 8 + c] + exp(l1 - lse) * m.o1[r * 8 + c];
      assert_true(fabs(ref - m.out[r * 8 + c]) < 1e-5);
    }
  }
  /* lse_out may be NULL; in place into part 0 gives the same. */
  memcpy(inplace, m.o0, sizeof inplace);
  memcpy(inplace_lse, m.l0, sizeof inplace_lse);
  parts_ip[0] = inplace, parts_ip[1] = m.o1;
  lse_ip[0] = inplace_lse, lse_ip[1] = m.l1;
  EXPECT_OK(MERGE(g_ctx, 2, m.od, m.ld, parts_ip, lse_ip, inplace, inplace_lse));
  assert_memory_equal(inplace, m.out, sizeof inplace);
  assert_memory_equal(inplace_lse, m.lse_out, sizeof inplace_lse);
  poison(m.out, sizeof m.out);
  EXPECT_OK(MERGE(g_ctx, 2, m.od, m.ld, m.o_parts, m.lse_parts, m.out, NULL));
  assert_memory_equal(inplace, m.out, sizeof inplace);

  /* Every part empty: O = 0, LSE = -inf, never NaN. One empty part: no effect. */
  for (r = 0; r < 6; ++r) m.l0[r] = m.l1[r] = -INFINITY;
  EXPECT_OK(MERGE(g_ctx, 2, m.od, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  for (r = 0; r < 6; ++r) assert_true(isinf(m.lse_out[r]) && m.lse_out[r] < 0.0f);
  for (r = 0; r < 48; ++r) assert_true(m.out[r] == 0.0f);
  fill_random(m.l1, 6, 14);
  EXPECT_OK(MERGE(g_ctx, 2, m.od, m.ld, m.o_parts, m.lse_parts, m.out, m.lse_out));
  for (r = 0; r < 6; ++r) assert_true(fabsf(m.lse_out[r] - m.l1[r]) < 1e-6f);
  for (r = 0; r < 48; ++r) assert_true(fabsf(m.out[r] - m.o1[r]) < 1e-6f);
#undef MERGE
  merge_teardown(&m);
}

/* ------------------------------------------------------------------------ */
/* Use after destroy, across every function                                  */
/* ------------------------------------------------------------------------ */

static void test_destroyed_handles_everywhere(void **state) {
  prob_t p = std_prob();
  attn_context_t ctx;
  attn_tensor_desc_t t;
  attn_plan_desc_t d;
  attn_plan_t plan;
  attn_plan_info_t info;
  attn_backend_t b;
  attn_dtype_t dt;
  int32_t n;
  size_t bytes;
  char buf[64];
  io_t io;
  const int64_t dims[2] = {2, 8};
  const void *parts[1];
  const float *lparts[1];
  (void)state;

  EXPECT_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx));
  EXPECT_OK(attn_tensor_desc_create(&t));
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 2, dims, NULL));
  d = desc_for(&p);
  EXPECT_OK(attn_plan_create(ctx, d, &plan));
  io_alloc(&io, plan, &p);
  parts[0] = io.o;
  lparts[0] = io.lse;

  EXPECT_OK(attn_plan_destroy(plan));
  EXPECT_OK(attn_plan_desc_destroy(d));
  EXPECT_OK(attn_tensor_desc_destroy(t));
  EXPECT_OK(attn_context_destroy(ctx));

  POISON_VAR(b);
  POISON_VAR(dt);
  POISON_VAR(n);
  POISON_VAR(bytes);
  poison(&info, sizeof info);
  info.struct_size = sizeof info;
  poison(buf, sizeof buf);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_get_backend(ctx, &b));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_get_num_threads(ctx, &n));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_plan_create(ctx, d, &plan));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx",
              attn_merge_states(ctx, 1, t, t, parts, lparts, io.o, io.lse, NULL));
  expect_setters_reject(d, NULL);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &bytes));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_describe(plan, &info));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_summary(plan, buf, sizeof buf, &bytes));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              attn_forward(plan, io.q, io.k, io.v, io.o, io.lse, io.wsf, io.ws_f, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              attn_backward(plan, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb, io.ws_b, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 2, dims, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_get(t, &dt, &n, NULL, NULL));
  /* double destroys */
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_destroy(plan));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_destroy(d));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_tensor_desc_destroy(t));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_context_destroy(ctx));

  EXPECT_VAR_UNTOUCHED(b);
  EXPECT_VAR_UNTOUCHED(dt);
  EXPECT_VAR_UNTOUCHED(n);
  EXPECT_VAR_UNTOUCHED(bytes);
  EXPECT_UNTOUCHED((const char *)&info + sizeof info.struct_size, sizeof info - sizeof info.struct_size);
  EXPECT_UNTOUCHED(buf, sizeof buf);
  EXPECT_IO_UNTOUCHED(&io);
  io_free(&io);
}

/* ------------------------------------------------------------------------ */
/* The last-error message                                                    */
/* ------------------------------------------------------------------------ */

static void test_last_error_reset(void **state) {
  attn_backend_t b;
  char saved[1024];
  (void)state;
  assert_non_null(attn_last_error_message());

  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "backend", attn_context_get_backend(g_ctx, NULL));
  snprintf(saved, sizeof saved, "%s", attn_last_error_message());
  /* These do not touch it. */
  (void)attn_status_string(ATTN_STATUS_INVALID_ARGUMENT);
  (void)attn_version_number();
  (void)attn_version_string();
  (void)attn_last_error_message();
  assert_string_equal(attn_last_error_message(), saved);
  /* A successful call clears it ... */
  EXPECT_OK(attn_context_get_backend(g_ctx, &b));
  assert_string_equal(attn_last_error_message(), "");

  /* ... as does any other call, even destroy(NULL). */
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_plan_destroy((attn_plan_t)(void *)g_ctx));
  EXPECT_OK(attn_plan_destroy(NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "desc", attn_tensor_desc_create(NULL));
  EXPECT_OK(attn_tensor_desc_destroy(NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "desc", attn_plan_desc_create(NULL));
  EXPECT_OK(attn_plan_desc_destroy(NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "ctx", attn_context_create(ATTN_BACKEND_CPU, 0, 0, NULL));
  EXPECT_OK(attn_context_destroy(NULL));
  /* A new failure replaces an old one. */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "ctx", attn_context_create(ATTN_BACKEND_CPU, 0, 0, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "num_threads", attn_context_get_num_threads(g_ctx, NULL));
  assert_null(strstr(attn_last_error_message(), "ctx is NULL"));
}

typedef struct thread_probe {
  char seen_at_start[256];
  char own_error[256];
  attn_status_t own_status;
  char after_success[256];
} thread_probe_t;

static void *probe_thread(void *arg) {
  thread_probe_t *t = (thread_probe_t *)arg;
  attn_tensor_desc_t td;
  snprintf(t->seen_at_start, sizeof t->seen_at_start, "%s", attn_last_error_message());
  t->own_status = attn_plan_desc_set_passes(NULL, ATTN_PASSES_FORWARD);
  snprintf(t->own_error, sizeof t->own_error, "%s", attn_last_error_message());
  /* the main thread's failure is still pending while we do this */
  if (attn_tensor_desc_create(&td) == ATTN_STATUS_SUCCESS) attn_tensor_desc_destroy(td);
  snprintf(t->after_success, sizeof t->after_success, "%s", attn_last_error_message());
  return NULL;
}

static void test_last_error_thread_local(void **state) {
  pthread_t th;
  thread_probe_t probe;
  attn_context_t ctx;
  char mine[1024];
  (void)state;
  memset(&probe, 0, sizeof probe);

  POISON_VAR(ctx);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "num_threads", attn_context_create(ATTN_BACKEND_CPU, 0, -2, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);
  snprintf(mine, sizeof mine, "%s", attn_last_error_message());
  assert_int_equal(pthread_create(&th, NULL, probe_thread, &probe), 0);
  assert_int_equal(pthread_join(th, NULL), 0);

  /* The other thread never saw our failure, and its own did not reach us. */
  assert_string_equal(probe.seen_at_start, "");
  assert_int_equal(probe.own_status, ATTN_STATUS_INVALID_HANDLE);
  assert_true(contains_word(probe.own_error, "desc"));
  assert_string_equal(probe.after_success, "");
  assert_string_equal(attn_last_error_message(), mine);
  assert_true(contains_word(mine, "num_threads"));
}

/* ------------------------------------------------------------------------ */
/* Block masks                                                               */
/* ------------------------------------------------------------------------ */

#define POISON_MASK(m) ((m) = (attn_block_mask_t)(void *)(uintptr_t)0xA5A5A5A0u)
#define EXPECT_MASK_UNTOUCHED(m) assert_ptr_equal((void *)(m), (void *)(uintptr_t)0xA5A5A5A0u)

/* A window reaching past every key (INT64_MAX) is the unbounded one, also
 * for rows before the aligned diagonal (Lq > Lk): the arithmetic on the
 * diagonal must not overflow. */
static uint64_t visible_pairs_of(const prob_t *p) {
  attn_plan_t plan = plan_for(p);
  attn_plan_info_t info;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(plan, &info));
  EXPECT_OK(attn_plan_destroy(plan));
  return info.visible_pairs;
}

static void test_window_reaching_past_every_key(void **state) {
  const int64_t shapes[2][2] = {{7, 5}, {5, 7}};
  int k;
  (void)state;
  for (k = 0; k < 2; ++k) {
    prob_t wide = std_prob(), ref = std_prob();
    wide.lq = ref.lq = shapes[k][0];
    wide.lk = ref.lk = shapes[k][1];
    wide.allow_empty = ref.allow_empty = 1;
    wide.mask = ATTN_MASK_WINDOW, wide.wl = INT64_MAX, wide.wr = 0;
    ref.mask = ATTN_MASK_CAUSAL;
    assert_int_equal(visible_pairs_of(&wide), visible_pairs_of(&ref));
    wide.wl = 1, wide.wr = INT64_MAX;
    ref.mask = ATTN_MASK_WINDOW, ref.wl = 1, ref.wr = -1;
    assert_int_equal(visible_pairs_of(&wide), visible_pairs_of(&ref));
  }
}

static void test_block_mask_create_errors(void **state) {
  attn_block_mask_t m;
  (void)state;
  POISON_MASK(m);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "mask", attn_block_mask_create(1, 1, 8, 8, 4, 4, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "batch", attn_block_mask_create(0, 1, 8, 8, 4, 4, &m));
  EXPECT_MASK_UNTOUCHED(m);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "heads", attn_block_mask_create(1, 0, 8, 8, 4, 4, &m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "seqlen_q", attn_block_mask_create(1, 1, -1, 8, 4, 4, &m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "seqlen_kv", attn_block_mask_create(1, 1, 8, -1, 4, 4, &m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "block_q", attn_block_mask_create(1, 1, 8, 8, 0, 4, &m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "block_kv", attn_block_mask_create(1, 1, 8, 8, 4, 0, &m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "block_q",
              attn_block_mask_create(1, 1, 8, 8, (int64_t)1 << 17, 4, &m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "seqlen_kv",
              attn_block_mask_create(1, 1, 8, (int64_t)1 << 40, 4, 1, &m));
  /* batch x heads x query blocks would overflow int64 (and index past the
   * rows the mask holds) */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "batch",
              attn_block_mask_create((int64_t)1 << 62, 4, 8, 8, 4, 4, &m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "batch",
              attn_block_mask_create((int64_t)1 << 20, (int64_t)1 << 10, 1 << 12, 8, 1, 4, &m));
  EXPECT_MASK_UNTOUCHED(m);

  /* destroy: NULL is a no-op; twice, or another kind, is INVALID_HANDLE */
  EXPECT_OK(attn_block_mask_destroy(NULL));
  EXPECT_OK(attn_block_mask_create(1, 1, 8, 8, 4, 4, &m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_block_mask_destroy((attn_block_mask_t)(void *)g_ctx));
  EXPECT_OK(attn_block_mask_destroy(m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_block_mask_destroy(m));
}

/* A 1 x 1 mask, Lq = Lk = 10, blocks 4 x 4 (3 x 3 blocks, the last ragged):
 * row q lists key block q full and, for q = 0, key block 2 partial. */
enum { BM_L = 10, BM_B = 4, BM_N = 3 };

static attn_block_mask_t small_mask(void) {
  attn_block_mask_t m = NULL;
  const int32_t num_f[BM_N] = {1, 1, 1}, idx_f[BM_N] = {0, 1, 2};
  const int32_t num_p[BM_N] = {1, 0, 0}, idx_p[BM_N] = {2, 7, 7};
  uint8_t bits[BM_N * 2];
  memset(bits, 0, sizeof bits);
  bits[0] = 0x21; /* (row 0, key 0) and (row 1, key 1) */
  EXPECT_OK(attn_block_mask_create(1, 1, BM_L, BM_L, BM_B, BM_B, &m));
  EXPECT_OK(attn_block_mask_set_blocks(m, num_p, idx_p, 1, bits, num_f, idx_f, 1));
  return m;
}

/* The tables of small_mask, read back. */
typedef struct bm_tables {
  int32_t num_p[BM_N], idx_p[BM_N * BM_N], num_f[BM_N], idx_f[BM_N * BM_N];
  uint8_t bits[BM_N * BM_N * 2];
} bm_tables;

static void read_tables(attn_block_mask_t m, bm_tables *t) {
  memset(t, 0, sizeof *t);
  EXPECT_OK(attn_block_mask_get_blocks(m, t->num_p, t->idx_p, BM_N, t->bits, t->num_f, t->idx_f, BM_N));
}

static void test_block_mask_set_blocks_errors(void **state) {
  attn_block_mask_t m = small_mask();
  bm_tables before, after;
  int32_t num[BM_N] = {1, 1, 1}, idx[BM_N * 2] = {0, 0, 1, 1, 2, 2}, full_num[BM_N] = {0, 0, 0};
  int32_t full_idx[BM_N * 2] = {0, 0, 0, 0, 0, 0}, max_p = -1, max_f = -1;
  (void)state;
  read_tables(m, &before);
  assert_int_equal(before.num_f[0], 1);
  assert_int_equal(before.idx_f[0], 0);
  assert_int_equal(before.num_p[0], 1);
  assert_int_equal(before.idx_p[0], 2);
  assert_int_equal(before.bits[0], 0x21);
  assert_int_equal(before.idx_p[1], -1); /* unused slots */
  EXPECT_OK(attn_block_mask_get_max_blocks(m, &max_p, &max_f));
  assert_int_equal(max_p, 1);
  assert_int_equal(max_f, 1);

  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask",
              attn_block_mask_set_blocks(NULL, num, idx, 2, NULL, NULL, NULL, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "kv_indices",
              attn_block_mask_set_blocks(m, num, NULL, 2, NULL, NULL, NULL, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "full_kv_indices",
              attn_block_mask_set_blocks(m, NULL, NULL, 0, NULL, full_num, NULL, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "partial_bits",
              attn_block_mask_set_blocks(m, NULL, NULL, 0, before.bits, full_num, full_idx, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "max_partial",
              attn_block_mask_set_blocks(m, num, idx, 0, NULL, NULL, NULL, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "max_full",
              attn_block_mask_set_blocks(m, NULL, NULL, 0, NULL, full_num, full_idx, 0));
  /* counts */
  num[1] = -1;
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "kv_num_blocks",
              attn_block_mask_set_blocks(m, num, idx, 2, NULL, NULL, NULL, 0));
  num[1] = 3; /* more than max_partial = 2 */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "kv_num_blocks",
              attn_block_mask_set_blocks(m, num, idx, 2, NULL, NULL, NULL, 0));
  num[1] = 1, full_num[2] = 4; /* more than the 3 key blocks */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "full_kv_num_blocks",
              attn_block_mask_set_blocks(m, num, idx, 2, NULL, full_num, full_idx, 2));
  full_num[2] = 0;
  /* indices: out of range, repeated, listed both full and partial */
  idx[2] = 3;
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "kv_indices",
              attn_block_mask_set_blocks(m, num, idx, 2, NULL, NULL, NULL, 0));
  idx[2] = -1;
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "kv_indices",
              attn_block_mask_set_blocks(m, num, idx, 2, NULL, NULL, NULL, 0));
  idx[2] = 1, num[1] = 2, idx[3] = 1;
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "twice",
              attn_block_mask_set_blocks(m, num, idx, 2, NULL, NULL, NULL, 0));
  num[1] = 1, full_num[1] = 1, full_idx[2] = 1;
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "partial",
              attn_block_mask_set_blocks(m, num, idx, 2, NULL, full_num, full_idx, 2));
  assert_true(strstr(attn_last_error_message(), "kv_indices[0][0][1]") != NULL);

  /* every failure left the mask as it was */
  read_tables(m, &after);
  assert_memory_equal(&before, &after, sizeof before);

  /* an empty table set clears the mask */
  EXPECT_OK(attn_block_mask_set_blocks(m, NULL, NULL, 0, NULL, NULL, NULL, 0));
  EXPECT_OK(attn_block_mask_get_max_blocks(m, &max_p, &max_f));
  assert_int_equal(max_p, 0);
  assert_int_equal(max_f, 0);
  EXPECT_OK(attn_block_mask_destroy(m));
}

/* The device-table variant on a CPU context reads host tables: the same
 * mask as attn_block_mask_set_blocks, the same checks, and its own handle
 * checks (the CUDA path is tested in tests/gpu/test_block_sparse_gpu.cpp). */
static void test_block_mask_set_device_blocks_cpu(void **state) {
  attn_block_mask_t m = small_mask(), copy = NULL;
  bm_tables before, after;
  int32_t num[BM_N] = {1, 0, 2}, idx[BM_N * 2] = {2, 0, 0, 0, 0, 1};
  int32_t full_num[BM_N] = {1, 1, 0}, full_idx[BM_N] = {0, 1, 0};
  uint8_t bits[BM_N * 2 * 2];
  (void)state;
  for (int i = 0; i < (int)sizeof bits; ++i) bits[i] = (uint8_t)(0x5b + 37 * i);
  read_tables(m, &before);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask",
              attn_block_mask_set_device_blocks(NULL, g_ctx, NULL, num, idx, 2, bits, full_num,
                                                full_idx, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx",
              attn_block_mask_set_device_blocks(m, NULL, NULL, num, idx, 2, bits, full_num,
                                                full_idx, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx",
              attn_block_mask_set_device_blocks(m, (attn_context_t)(void *)m, NULL, num, idx, 2,
                                                bits, full_num, full_idx, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "kv_indices",
              attn_block_mask_set_device_blocks(m, g_ctx, NULL, num, NULL, 2, bits, full_num,
                                                full_idx, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "max_full",
              attn_block_mask_set_device_blocks(m, g_ctx, NULL, num, idx, 2, bits, full_num,
                                                full_idx, 0));
  idx[5] = 3; /* key block 3 of 3 */
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "kv_indices[0][0][2][1]",
              attn_block_mask_set_device_blocks(m, g_ctx, NULL, num, idx, 2, bits, full_num,
                                                full_idx, 1));
  idx[5] = 1;
  read_tables(m, &after);
  assert_memory_equal(&before, &after, sizeof before);

  /* success: equal to the host variant on the same tables */
  EXPECT_OK(attn_block_mask_create(1, 1, BM_L, BM_L, BM_B, BM_B, &copy));
  EXPECT_OK(attn_block_mask_set_blocks(copy, num, idx, 2, bits, full_num, full_idx, 1));
  EXPECT_OK(attn_block_mask_set_device_blocks(m, g_ctx, NULL, num, idx, 2, bits, full_num,
                                              full_idx, 1));
  read_tables(m, &after);
  read_tables(copy, &before);
  assert_memory_equal(&before, &after, sizeof before);
  assert_int_equal(after.num_p[2], 2);
  assert_int_equal(after.num_f[1], 1);
  EXPECT_OK(attn_block_mask_destroy(copy));
  EXPECT_OK(attn_block_mask_destroy(m));
}

static void test_block_mask_get_and_add_errors(void **state) {
  attn_block_mask_t m = small_mask();
  bm_tables t, ref;
  int32_t mx;
  uint8_t visible[BM_L * BM_L];
  (void)state;
  poison(&t, sizeof t);
  ref = t;
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask",
              attn_block_mask_get_blocks(NULL, t.num_p, t.idx_p, BM_N, t.bits, t.num_f, t.idx_f, BM_N));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "kv_num_blocks",
              attn_block_mask_get_blocks(m, NULL, t.idx_p, BM_N, t.bits, t.num_f, t.idx_f, BM_N));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "kv_indices",
              attn_block_mask_get_blocks(m, t.num_p, NULL, BM_N, t.bits, t.num_f, t.idx_f, BM_N));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "full_kv_num_blocks",
              attn_block_mask_get_blocks(m, t.num_p, t.idx_p, BM_N, t.bits, NULL, t.idx_f, BM_N));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "full_kv_indices",
              attn_block_mask_get_blocks(m, t.num_p, t.idx_p, BM_N, t.bits, t.num_f, NULL, BM_N));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "max_partial must be >= 1, got 0",
              attn_block_mask_get_blocks(m, t.num_p, t.idx_p, 0, t.bits, t.num_f, t.idx_f, BM_N));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "max_full must be >= 1, got 0",
              attn_block_mask_get_blocks(m, t.num_p, t.idx_p, BM_N, t.bits, t.num_f, t.idx_f, 0));
  assert_memory_equal(&t, &ref, sizeof t);
  POISON_VAR(mx);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "max_partial", attn_block_mask_get_max_blocks(m, NULL, &mx));
  EXPECT_VAR_UNTOUCHED(mx);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "max_full", attn_block_mask_get_max_blocks(m, &mx, NULL));
  EXPECT_VAR_UNTOUCHED(mx);

  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_block_mask_add_dense(NULL, visible));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "visible", attn_block_mask_add_dense(m, NULL));

  /* add_dense ORs: one element in block (1, 2) adds it as a partial block;
   * filling block (0, 2) makes that one full. */
  memset(visible, 0, sizeof visible);
  visible[5 * BM_L + 9] = 1;                     /* query 5 (block 1), key 9 (block 2) */
  visible[0 * BM_L + 8] = visible[0 * BM_L + 9] = 1; /* block (0, 2): its rows 0..3, keys 8, 9 */
  visible[1 * BM_L + 8] = visible[1 * BM_L + 9] = 1;
  visible[2 * BM_L + 8] = visible[2 * BM_L + 9] = 1;
  visible[3 * BM_L + 8] = visible[3 * BM_L + 9] = 1;
  EXPECT_OK(attn_block_mask_add_dense(m, visible));
  read_tables(m, &t);
  assert_int_equal(t.num_f[0], 2); /* key blocks 0 and 2 */
  assert_int_equal(t.idx_f[0], 0);
  assert_int_equal(t.idx_f[1], 2);
  assert_int_equal(t.num_p[0], 0);
  assert_int_equal(t.num_p[1], 1);
  assert_int_equal(t.idx_p[BM_N], 2);
  assert_int_equal(t.bits[BM_N * 2], 0x20); /* row 1 of the block, key 1 of the block: bit 5 */
  assert_int_equal(t.bits[BM_N * 2 + 1], 0);
  EXPECT_OK(attn_block_mask_destroy(m));
}

static void test_block_mask_builder_errors(void **state) {
  attn_block_mask_t m = small_mask(); /* Lq = Lk = 10, 3 x 3 blocks */
  bm_tables before, after;
  const int64_t ok_keys[2] = {0, 9}, bad_keys[2] = {0, 10}, neg[1] = {-1};
  const int32_t docs[BM_L] = {0, 0, 0, 1, 1, 1, 1, 2, 2, 2};
  (void)state;
  read_tables(m, &before);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_block_mask_add_window(NULL, 1, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "left", attn_block_mask_add_window(m, -2, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "right", attn_block_mask_add_window(m, 1, -2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_block_mask_add_global_keys(NULL, ok_keys, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "keys", attn_block_mask_add_global_keys(m, NULL, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "count", attn_block_mask_add_global_keys(m, ok_keys, -1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "keys", attn_block_mask_add_global_keys(m, bad_keys, 2));
  assert_true(strstr(attn_last_error_message(), "keys[1]") != NULL);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "keys", attn_block_mask_add_global_keys(m, neg, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_block_mask_add_global_queries(NULL, ok_keys, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "queries", attn_block_mask_add_global_queries(m, NULL, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "queries",
              attn_block_mask_add_global_queries(m, bad_keys, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_block_mask_add_strided(NULL, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "stride", attn_block_mask_add_strided(m, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_block_mask_add_random_blocks(NULL, 1, 7));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "blocks_per_row",
              attn_block_mask_add_random_blocks(m, -1, 7));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "blocks_per_row",
              attn_block_mask_add_random_blocks(m, BM_N + 1, 7));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_block_mask_and_documents(NULL, docs, docs));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "doc_q", attn_block_mask_and_documents(m, NULL, docs));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "doc_kv", attn_block_mask_and_documents(m, docs, NULL));
  read_tables(m, &after);
  assert_memory_equal(&before, &after, sizeof before);

  /* count 0 with NULL is fine and changes nothing; so do 0 random blocks */
  EXPECT_OK(attn_block_mask_add_global_keys(m, NULL, 0));
  EXPECT_OK(attn_block_mask_add_random_blocks(m, 0, 7));
  read_tables(m, &after);
  assert_memory_equal(&before, &after, sizeof before);
  EXPECT_OK(attn_block_mask_destroy(m));
}

/* A problem the CUDA kernels take: bf16, BSHD, batch 2, heads 4/2, head_dim
 * dim, causal, forward and backward. */
static attn_plan_desc_t cuda_desc(int64_t lq, int64_t lk, int64_t dim) {
  prob_t p = std_prob();
  attn_plan_desc_t d;
  p.lq = lq, p.lk = lk, p.dqk = p.dv = dim;
  d = desc_for(&p);
  EXPECT_OK(attn_plan_desc_set_dtype(d, ATTN_DTYPE_BF16));
  return d;
}

static void describe_plan(attn_plan_t plan, attn_plan_info_t *info) {
  memset(info, 0, sizeof *info);
  info->struct_size = sizeof *info;
  EXPECT_OK(attn_plan_describe(plan, info));
}

/* (query tile, KV tile) pairs holding a pair that a causal plan with the
 * selection window(left, 0) shows (i + lk - lq - left <= j <= i + lk - lq). */
static uint64_t causal_window_tile_pairs(int64_t lq, int64_t lk, int64_t left, int64_t tq,
                                         int64_t tk) {
  uint64_t n = 0;
  int64_t qt, kt, i;
  for (qt = 0; qt * tq < lq; ++qt)
    for (kt = 0; kt * tk < lk; ++kt) {
      int hit = 0;
      for (i = qt * tq; i < (qt + 1) * tq && i < lq && !hit; ++i) {
        const int64_t hi = i + lk - lq, lo = hi - left;
        hit = lo < (kt + 1) * tk && hi >= kt * tk && hi >= 0 && lo < lk;
      }
      n += (uint64_t)hit;
    }
  return n;
}

/* On a CUDA context: a block mask on problems the CUDA kernels take (bf16,
 * head_dim 64 and 128) makes a plan that runs there; what they do not take
 * is refused with NOT_SUPPORTED naming the feature, *plan unchanged. */
static void check_cuda_block_mask_plans(attn_context_t cuda) {
  static const int64_t dims[2] = {64, 128};
  attn_block_mask_t m = NULL;
  attn_plan_desc_t d;
  attn_plan_t plan;
  attn_plan_info_t info;
  int k;
  /* per KV head, blocks of 64: 100 keys behind the diagonal; 200 x 300 */
  EXPECT_OK(attn_block_mask_create(1, 2, 200, 300, 64, 64, &m));
  EXPECT_OK(attn_block_mask_add_window(m, 100, 0));
  for (k = 0; k < 2; ++k) {
    d = cuda_desc(200, 300, dims[k]);
    EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
    EXPECT_OK(attn_plan_create(cuda, d, &plan));
    describe_plan(plan, &info);
    assert_int_equal(info.backend, ATTN_BACKEND_CUDA);
    assert_int_equal(info.dtype, ATTN_DTYPE_BF16);
    assert_int_equal(info.supports_backward, 1);
    assert_true(strstr(info.kernel, "bsparse") != NULL);
    assert_int_equal(info.block_q, 64);
    assert_int_equal(info.block_kv, 64);
    assert_int_equal(info.visible_pairs, 2 * 4 * 200 * 101);
    assert_true(info.tile_q > 0 && info.tile_kv > 0);
    assert_int_equal(info.visited_tile_pairs,
                     2 * 4 * causal_window_tile_pairs(200, 300, 100, info.tile_q, info.tile_kv));
    assert_int_equal(info.total_tile_pairs, 2 * 4 * ((200 + info.tile_q - 1) / info.tile_q) *
                                                ((300 + info.tile_kv - 1) / info.tile_kv));
    EXPECT_OK(attn_plan_destroy(plan));
    EXPECT_OK(attn_plan_desc_destroy(d));
  }

  d = cuda_desc(200, 300, 64);
  EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  POISON_PLAN(plan);
  EXPECT_OK(attn_plan_desc_set_dtype(d, ATTN_DTYPE_FP32));
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "fp32", attn_plan_create(cuda, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_dtype(d, ATTN_DTYPE_BF16));
  EXPECT_OK(attn_plan_desc_set_shape(d, 2, 4, 2, 200, 300, 8, 8));
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "head_dim", attn_plan_create(cuda, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_shape(d, 2, 4, 2, 200, 300, 64, 128));
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "head_dim_v", attn_plan_create(cuda, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_shape(d, 2, 4, 2, 200, 300, 64, 64));
  {
    /* Q with a head stride of 68 elements: not a multiple of 8 */
    attn_tensor_desc_t t = NULL;
    const int64_t qdims[4] = {2, 200, 4, 64}, qstrides[4] = {200 * 4 * 68, 4 * 68, 68, 1};
    EXPECT_OK(attn_tensor_desc_create(&t));
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_BF16, 4, qdims, qstrides));
    EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_Q, t));
    EXPECT_OK(attn_tensor_desc_destroy(t));
    EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "strides", attn_plan_create(cuda, d, &plan));
    EXPECT_PLAN_UNTOUCHED(plan);
  }
  EXPECT_OK(attn_plan_desc_destroy(d));
  EXPECT_OK(attn_block_mask_destroy(m));
}

/* Most pairs a MoBA row may see, summed over one sequence's rows: its own
 * block up to the diagonal and top_k whole past blocks (lq == lk). */
static uint64_t moba_bound(int64_t len, int64_t block, int64_t top_k) {
  uint64_t n = 0;
  int64_t i;
  for (i = 0; i < len; ++i) {
    const int64_t own = i / block;
    n += (uint64_t)(i - own * block + 1 + (own < top_k ? own : top_k) * block);
  }
  return n;
}

/* On a CUDA context: MoBA on problems the CUDA kernels take (bf16, head_dim
 * 64 and 128, block_size a multiple of 128, top_k <= 32) makes a plan that
 * runs there; beyond those limits NOT_SUPPORTED names the feature, *plan
 * unchanged, except where top_k keeps every block (the dense causal plan). */
static void check_cuda_moba_plans(attn_context_t cuda) {
  static const int64_t dims[2] = {64, 128};
  attn_plan_desc_t d;
  attn_plan_t plan;
  attn_plan_info_t info;
  int k;
  for (k = 0; k < 2; ++k) {
    /* 384 keys: 3 blocks of 128, top 1 of at most 2 past ones */
    d = cuda_desc(384, 384, dims[k]);
    EXPECT_OK(attn_plan_desc_set_moba(d, 128, 1, k));
    EXPECT_OK(attn_plan_create(cuda, d, &plan));
    describe_plan(plan, &info);
    assert_int_equal(info.backend, ATTN_BACKEND_CUDA);
    assert_int_equal(info.dtype, ATTN_DTYPE_BF16);
    assert_int_equal(info.supports_backward, 1);
    assert_true(strstr(info.kernel, "moba") != NULL);
    assert_true(strstr(info.algorithm, "moba") != NULL);
    assert_null(strstr(info.algorithm, "every-block"));
    assert_int_equal(info.visible_pairs, 2 * 4 * moba_bound(384, 128, 1));
    EXPECT_OK(attn_plan_destroy(plan));
    EXPECT_OK(attn_plan_desc_destroy(d));
  }

  d = cuda_desc(384, 384, 64);
  POISON_PLAN(plan);
  /* block_size not a multiple of 128 (6 blocks, top 1) */
  EXPECT_OK(attn_plan_desc_set_moba(d, 64, 1, 0));
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "block_size", attn_plan_create(cuda, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  /* ... unless top_k keeps every past block: the dense causal plan */
  EXPECT_OK(attn_plan_desc_set_moba(d, 64, 5, 0));
  EXPECT_OK(attn_plan_create(cuda, d, &plan));
  describe_plan(plan, &info);
  assert_int_equal(info.backend, ATTN_BACKEND_CUDA);
  assert_true(strncmp(info.algorithm, "moba-keeps-every-block:", 23) == 0);
  assert_int_equal(info.visible_pairs, 2 * 4 * (384 * 385 / 2));
  EXPECT_OK(attn_plan_destroy(plan));
  POISON_PLAN(plan);
  /* fp32 */
  EXPECT_OK(attn_plan_desc_set_moba(d, 128, 1, 0));
  EXPECT_OK(attn_plan_desc_set_dtype(d, ATTN_DTYPE_FP32));
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "fp32", attn_plan_create(cuda, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_dtype(d, ATTN_DTYPE_BF16));
  /* top_k 33 of 39 past blocks (5120 keys) */
  EXPECT_OK(attn_plan_desc_set_shape(d, 2, 4, 2, 384, 5120, 64, 64));
  EXPECT_OK(attn_plan_desc_set_moba(d, 128, 33, 1));
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "top_k", attn_plan_create(cuda, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_moba(d, 128, 32, 1));
  EXPECT_OK(attn_plan_create(cuda, d, &plan));
  describe_plan(plan, &info);
  assert_int_equal(info.backend, ATTN_BACKEND_CUDA);
  assert_true(strstr(info.kernel, "moba") != NULL);
  EXPECT_OK(attn_plan_destroy(plan));
  POISON_PLAN(plan);
  /* a varlen batch: a plan per sequence length; not with a kept selection
   * (the sequences share one workspace one after another) */
  {
    const int32_t cu[3] = {0, 640, 1024};
    EXPECT_OK(attn_plan_desc_set_shape(d, 2, 4, 2, 640, 640, 64, 64));
    EXPECT_OK(attn_plan_desc_set_varlen(d, 2, cu, cu));
    EXPECT_OK(attn_plan_desc_set_moba(d, 128, 1, 1));
    EXPECT_OK(attn_plan_create(cuda, d, &plan));
    describe_plan(plan, &info);
    assert_string_equal(info.algorithm, "flash-moba-per-sequence-online-softmax");
    assert_true(strstr(info.kernel, "moba") != NULL);
    EXPECT_OK(attn_plan_destroy(plan));
    POISON_PLAN(plan);
    EXPECT_OK(attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD_BACKWARD));
    EXPECT_OK(attn_plan_desc_set_moba_keep_selection(d, 1));
    EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "varlen", attn_plan_create(cuda, d, &plan));
    EXPECT_PLAN_UNTOUCHED(plan);
  }
  EXPECT_OK(attn_plan_desc_destroy(d));
}

static void test_block_mask_plans(void **state) {
  prob_t p = std_prob(); /* batch 2, heads 4/2, Lq 5, Lk 7, causal */
  attn_block_mask_t m = NULL, other = NULL;
  attn_plan_desc_t d;
  attn_plan_t plan;
  attn_plan_info_t info;
  attn_context_t cuda = NULL;
  const int32_t all2[2] = {2, 2}, idx2[4] = {0, 1, 0, 1};
  const int32_t one[8] = {1, 1, 1, 1, 1, 1, 1, 1}, first[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int32_t cu[3] = {0, 5, 10};
  (void)state;
  p.mask = ATTN_MASK_NONE;

  /* setter errors */
  EXPECT_OK(attn_block_mask_create(1, 1, 5, 7, 4, 4, &m)); /* 2 x 2 blocks */
  EXPECT_OK(attn_block_mask_set_blocks(m, NULL, NULL, 0, NULL, all2, idx2, 2));
  d = desc_for(&p);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_block_mask(NULL, m));
  EXPECT_OK(attn_block_mask_create(1, 1, 5, 7, 4, 4, &other));
  EXPECT_OK(attn_block_mask_destroy(other));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "mask", attn_plan_desc_set_block_mask(d, other));

  /* the descriptor copies the mask: clearing or destroying it later changes nothing */
  EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  EXPECT_OK(attn_block_mask_set_blocks(m, NULL, NULL, 0, NULL, NULL, NULL, 0));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.visible_pairs, 2 * 4 * 5 * 7); /* every block listed */
  assert_int_equal(info.block_q, 4);
  assert_int_equal(info.block_kv, 4);
  assert_int_equal(info.visited_tile_pairs, 2 * 4);
  assert_int_equal(info.total_tile_pairs, 2 * 4);
  assert_true(strstr(info.algorithm, "block-sparse") != NULL);
  EXPECT_OK(attn_plan_destroy(plan));

  /* the (now empty) mask leaves every row empty */
  EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "block", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  assert_true(strstr(attn_last_error_message(), "allow_empty_rows") != NULL);
  EXPECT_OK(attn_plan_desc_set_allow_empty_rows(d, 1));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.visible_pairs, 0);
  assert_int_equal(info.visited_tile_pairs, 0);
  EXPECT_OK(attn_plan_destroy(plan));
  EXPECT_OK(attn_plan_desc_set_allow_empty_rows(d, 0));

  /* a mask of the wrong batch, heads or lengths */
  EXPECT_OK(attn_block_mask_destroy(m));
  EXPECT_OK(attn_block_mask_create(3, 1, 5, 7, 4, 4, &m));
  EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "batch", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_block_mask_destroy(m));
  EXPECT_OK(attn_block_mask_create(1, 4, 5, 7, 4, 4, &m)); /* heads_q, not heads_kv */
  EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "heads_kv", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_block_mask_destroy(m));
  EXPECT_OK(attn_block_mask_create(2, 2, 7, 5, 4, 4, &m));
  EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "seqlen_q", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_block_mask_destroy(m));

  /* per batch and KV head, each row listing only key block 0: 4 keys */
  EXPECT_OK(attn_block_mask_create(2, 2, 5, 7, 4, 4, &m));
  EXPECT_OK(attn_block_mask_set_blocks(m, NULL, NULL, 0, NULL, one, first, 1));
  EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.visible_pairs, 2 * 4 * 5 * 4);
  EXPECT_OK(attn_plan_destroy(plan));

  /* varlen: the mask is given for the longest sequence (5/7 here is not
   * the batch's 5/5), each sequence reading its corner, sequence by
   * sequence (4 keys of each row of both sequences) */
  EXPECT_OK(attn_plan_desc_set_shape(d, 2, 4, 2, 5, 5, 8, 8));
  EXPECT_OK(attn_plan_desc_set_varlen(d, 2, cu, cu));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "seqlen_q/seqlen_kv", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  {
    attn_block_mask_t mv = NULL;
    EXPECT_OK(attn_block_mask_create(2, 2, 5, 5, 4, 4, &mv));
    EXPECT_OK(attn_block_mask_set_blocks(mv, NULL, NULL, 0, NULL, one, first, 1));
    EXPECT_OK(attn_plan_desc_set_block_mask(d, mv));
    EXPECT_OK(attn_block_mask_destroy(mv));
    EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
    EXPECT_OK(attn_plan_describe(plan, &info));
    assert_int_equal(info.visible_pairs, 2 * 4 * 5 * 4);
    assert_string_equal(info.algorithm, "flash-block-sparse-per-sequence-online-softmax");
    EXPECT_OK(attn_plan_destroy(plan));
    EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  }
  EXPECT_OK(attn_plan_desc_set_varlen(d, 2, NULL, NULL));
  EXPECT_OK(attn_plan_desc_set_shape(d, 2, 4, 2, 5, 7, 8, 8));

  /* CUDA (where a CUDA context can be made): its own problems and refusals */
  if (attn_context_create(ATTN_BACKEND_CUDA, 0, 1, &cuda) == ATTN_STATUS_SUCCESS) {
    check_cuda_block_mask_plans(cuda);
    EXPECT_OK(attn_context_destroy(cuda));
  } else {
    printf("  (no CUDA context here: the CUDA block-mask checks are not exercised)\n");
  }

  /* NULL detaches the mask: a dense plan again */
  EXPECT_OK(attn_plan_desc_set_block_mask(d, NULL));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.block_q, 0);
  assert_int_equal(info.visible_pairs, 2 * 4 * 5 * 7);
  EXPECT_OK(attn_plan_destroy(plan));
  EXPECT_OK(attn_plan_desc_destroy(d));
  EXPECT_OK(attn_block_mask_destroy(m));
}

static void test_moba_errors(void **state) {
  prob_t p = std_prob(); /* batch 2, heads 4/2, Lq 5, Lk 7, causal */
  attn_plan_desc_t d = desc_for(&p);
  attn_plan_t plan;
  attn_plan_info_t info;
  attn_block_mask_t m = NULL;
  attn_context_t cuda = NULL;
  int32_t cu[3] = {0, 5, 10};
  (void)state;
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_moba(NULL, 2, 1, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "block_size", attn_plan_desc_set_moba(d, -1, 1, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "block_size",
              attn_plan_desc_set_moba(d, (int64_t)1 << 17, 1, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "top_k", attn_plan_desc_set_moba(d, 2, -1, 0));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "shared_per_group", attn_plan_desc_set_moba(d, 2, 1, 2));
  /* the failed setters left MoBA off: a dense causal plan */
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.visible_pairs, 200);
  EXPECT_OK(attn_plan_destroy(plan));

  /* blocks of 2, top 1: row i (diagonal d = i + 2) sees its own block up to
   * d and at most one whole past block: 3, 4, 3, 4, 3 keys, an upper bound */
  EXPECT_OK(attn_plan_desc_set_moba(d, 2, 1, 0));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.visible_pairs, 2 * 4 * 17);
  assert_true(strstr(info.algorithm, "moba") != NULL);
  assert_null(strstr(info.algorithm, "every-block"));
  EXPECT_OK(attn_plan_destroy(plan));

  /* top 3 of 4 blocks of 2: every past block of every row, the causal mask
   * itself; the plan is the dense causal one and says so */
  EXPECT_OK(attn_plan_desc_set_moba(d, 2, 3, 1));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.visible_pairs, 200);
  assert_true(strncmp(info.algorithm, "moba-keeps-every-block:", 23) == 0);
  EXPECT_OK(attn_plan_destroy(plan));
  EXPECT_OK(attn_plan_desc_set_moba(d, 2, 1, 0));

  /* the mask must be causal */
  EXPECT_OK(attn_plan_desc_set_mask(d, ATTN_MASK_NONE, -1, -1));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "ATTN_MASK_CAUSAL", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, -1));

  /* not with a block mask; a varlen batch runs on the CPU backend */
  EXPECT_OK(attn_block_mask_create(1, 1, 5, 7, 4, 4, &m));
  EXPECT_OK(attn_block_mask_add_window(m, -1, -1));
  EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "block", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_block_mask(d, NULL));
  EXPECT_OK(attn_block_mask_destroy(m));
  EXPECT_OK(attn_plan_desc_set_shape(d, 2, 4, 2, 5, 5, 8, 8));
  EXPECT_OK(attn_plan_desc_set_varlen(d, 2, cu, cu));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  describe_plan(plan, &info);
  assert_true(strstr(info.algorithm, "moba") != NULL);
  assert_null(strstr(info.algorithm, "every-block"));
  EXPECT_OK(attn_plan_destroy(plan));
  EXPECT_OK(attn_plan_desc_set_varlen(d, 2, NULL, NULL));
  EXPECT_OK(attn_plan_desc_set_shape(d, 2, 4, 2, 5, 7, 8, 8));

  /* CUDA (where a CUDA context can be made): its own problems and limits */
  if (attn_context_create(ATTN_BACKEND_CUDA, 0, 1, &cuda) == ATTN_STATUS_SUCCESS) {
    check_cuda_moba_plans(cuda);
    EXPECT_OK(attn_context_destroy(cuda));
  } else {
    printf("  (no CUDA context here: the CUDA MoBA checks are not exercised)\n");
  }

  /* block_size 0 turns it off again */
  EXPECT_OK(attn_plan_desc_set_moba(d, 0, 0, 0));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.visible_pairs, 200);
  EXPECT_OK(attn_plan_destroy(plan));
  EXPECT_OK(attn_plan_desc_destroy(d));
}

/* attn_plan_desc_set_moba_keep_selection: the setter takes 0 or 1; plan
 * creation refuses keep = 1 without MoBA or without a backward pass (the
 * message names keep_selection, *plan is untouched), keep = 0 undoes it, and
 * a MoBA plan that keeps every block is the dense causal plan, with nothing
 * to keep. */
static void test_moba_keep_selection_errors(void **state) {
  prob_t p = std_prob(); /* batch 2, heads 4/2, Lq 5, Lk 7 (4 blocks of 2), causal, fwd + bwd */
  attn_plan_desc_t d = desc_for(&p);
  attn_plan_t plan;
  attn_plan_info_t info;
  const char *kept;
  (void)state;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "desc", attn_plan_desc_set_moba_keep_selection(NULL, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "keep", attn_plan_desc_set_moba_keep_selection(d, 2));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "keep", attn_plan_desc_set_moba_keep_selection(d, -1));
  /* the failed setters left it off: a dense causal plan */
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_null(strstr(info.algorithm, "kept-selection"));
  EXPECT_OK(attn_plan_destroy(plan));

  /* keep without MoBA */
  EXPECT_OK(attn_plan_desc_set_moba_keep_selection(d, 1));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "keep_selection", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  /* keep = 0 undoes it */
  EXPECT_OK(attn_plan_desc_set_moba_keep_selection(d, 0));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.visible_pairs, 200);
  assert_null(strstr(info.algorithm, "kept-selection"));
  EXPECT_OK(attn_plan_destroy(plan));

  /* MoBA (blocks of 2, top 1) with a backward pass: the passes share it */
  EXPECT_OK(attn_plan_desc_set_moba(d, 2, 1, 0));
  EXPECT_OK(attn_plan_desc_set_moba_keep_selection(d, 1));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_true(strstr(info.algorithm, "moba") != NULL);
  kept = strstr(info.algorithm, "+kept-selection");
  assert_non_null(kept);
  assert_string_equal(kept, "+kept-selection");
  EXPECT_OK(attn_plan_destroy(plan));

  /* MoBA on a forward-only plan: there is no backward to keep it for */
  EXPECT_OK(attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD));
  POISON_PLAN(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "keep_selection", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_moba_keep_selection(d, 0));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_true(strstr(info.algorithm, "moba") != NULL);
  assert_null(strstr(info.algorithm, "kept-selection"));
  EXPECT_OK(attn_plan_destroy(plan));
  EXPECT_OK(attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD_BACKWARD));

  /* top 3 of 4 blocks keeps every past block: the dense causal plan, where
   * keep has no effect */
  EXPECT_OK(attn_plan_desc_set_moba(d, 2, 3, 0));
  EXPECT_OK(attn_plan_desc_set_moba_keep_selection(d, 1));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_int_equal(info.visible_pairs, 200);
  assert_true(strncmp(info.algorithm, "moba-keeps-every-block:", 23) == 0);
  assert_null(strstr(info.algorithm, "kept-selection"));
  EXPECT_OK(attn_plan_destroy(plan));
  EXPECT_OK(attn_plan_desc_destroy(d));
}

/* Execution errors of the plans whose workspace and schedule differ from the
 * dense ones. attn_forward and attn_backward get a plan made from d (its
 * shape is p's) and bad arguments: each call fails with the documented
 * status, names the argument, and writes no output (O, LSE, dQ, dK, dV stay
 * poisoned; O and LSE are not changed by a failed backward); the good calls
 * then succeed. */
static void expect_execution_errors(attn_plan_desc_t d, const prob_t *p) {
  attn_plan_t plan = NULL, fwd_only = NULL;
  io_t io;
  float *o_ref, *lse_ref;
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  io_alloc(&io, plan, p);
  assert_true(io.ws_f > 0 && io.ws_b > 0);

  expect_forward_argument_errors(plan, &io);
  EXPECT_OK(attn_forward(plan, io.q, io.k, io.v, io.o, io.lse, io.wsf, io.ws_f, NULL));
  assert_true(isfinite(io.o[0]) && isfinite(io.lse[0]));
  o_ref = xmalloc(io.no * 4);
  lse_ref = xmalloc(io.nlse * 4);
  memcpy(o_ref, io.o, io.no * 4);
  memcpy(lse_ref, io.lse, io.nlse * 4);

#define BWD(pl, q_, k_, v_, o_, lse_, do_, dq_, dk_, dv_, ws_, bytes_) \
  attn_backward((pl), (q_), (k_), (v_), (o_), (lse_), (do_), (dq_), (dk_), (dv_), (ws_), (bytes_), NULL)
  expect_backward_argument_errors(plan, &io);
  /* a forward-only plan of the same problem has no backward */
  EXPECT_OK(attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD));
  EXPECT_OK(attn_plan_create(g_ctx, d, &fwd_only));
  EXPECT_OK(attn_plan_desc_set_passes(d, p->passes));
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "plan",
              BWD(fwd_only, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb, io.ws_b));
  EXPECT_OK(attn_plan_destroy(fwd_only));
  check_poisoned(io.dq, io.nq * 4, "dQ", __FILE__, __LINE__);
  check_poisoned(io.dk, io.nk * 4, "dK", __FILE__, __LINE__);
  check_poisoned(io.dv, io.nv * 4, "dV", __FILE__, __LINE__);
  assert_memory_equal(io.o, o_ref, io.no * 4);
  assert_memory_equal(io.lse, lse_ref, io.nlse * 4);
  EXPECT_OK(BWD(plan, io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv, io.wsb, io.ws_b));
  assert_true(isfinite(io.dq[0]) && isfinite(io.dk[0]) && isfinite(io.dv[0]));
#undef BWD
  free(o_ref);
  free(lse_ref);
  io_free(&io);
  EXPECT_OK(attn_plan_destroy(plan));
}

/* Tensors of the wrong shape or strides are refused at plan creation, as
 * for a dense plan: the message names the tensor, *plan is unchanged. */
static void expect_tensor_errors(attn_plan_desc_t d, const prob_t *p) {
  attn_tensor_desc_t t = NULL;
  attn_plan_t plan;
  int64_t dims[4], strides[4];
  EXPECT_OK(attn_tensor_desc_create(&t));
  POISON_PLAN(plan);
  /* K one key short */
  dims[0] = p->batch, dims[1] = p->lk - 1, dims[2] = p->hkv, dims[3] = p->dqk;
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, NULL));
  EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_K, t));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "tensor K", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_K, NULL));
  /* O with a head_dim stride of 2 */
  dims[0] = p->batch, dims[1] = p->lq, dims[2] = p->hq, dims[3] = p->dv;
  strides[3] = 2, strides[2] = 2 * p->dv, strides[1] = strides[2] * p->hq;
  strides[0] = strides[1] * p->lq;
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, strides));
  EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_O, t));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "tensor O", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_O, NULL));
  /* dV whose sequence stride 0 makes every key write the same row */
  dims[0] = p->batch, dims[1] = p->lk, dims[2] = p->hkv, dims[3] = p->dv;
  strides[3] = 1, strides[2] = p->dv, strides[1] = 0, strides[0] = p->hkv * p->dv;
  EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, strides));
  EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_DV, t));
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "dV", attn_plan_create(g_ctx, d, &plan));
  EXPECT_PLAN_UNTOUCHED(plan);
  EXPECT_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_DV, NULL));
  EXPECT_OK(attn_tensor_desc_destroy(t));
}

static void test_block_mask_execution_errors(void **state) {
  prob_t p = std_prob(); /* batch 2, heads 4/2, Lq 5, Lk 7, causal */
  attn_plan_desc_t d = desc_for(&p);
  attn_block_mask_t m = NULL;
  attn_plan_t plan = NULL;
  attn_plan_info_t info;
  (void)state;
  /* per batch and KV head, blocks of 2 x 3: the diagonal and 2 keys behind
   * it, in partial blocks */
  EXPECT_OK(attn_block_mask_create(2, 2, 5, 7, 2, 3, &m));
  EXPECT_OK(attn_block_mask_add_window(m, 2, 0));
  EXPECT_OK(attn_plan_desc_set_block_mask(d, m));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_true(strstr(info.algorithm, "block-sparse") != NULL);
  assert_int_equal(info.visible_pairs, 2 * 4 * 5 * 3);
  EXPECT_OK(attn_plan_destroy(plan));
  expect_execution_errors(d, &p);
  expect_tensor_errors(d, &p);
  EXPECT_OK(attn_plan_desc_destroy(d));
  EXPECT_OK(attn_block_mask_destroy(m));
}

static void test_moba_execution_errors(void **state) {
  prob_t p = std_prob(); /* batch 2, heads 4/2, Lq 5, Lk 7, causal */
  attn_plan_desc_t d = desc_for(&p);
  attn_plan_t plan = NULL;
  attn_plan_info_t info;
  (void)state;
  /* blocks of 2, top 1 of up to 3 past blocks: a selection made at run time */
  EXPECT_OK(attn_plan_desc_set_moba(d, 2, 1, 1));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_true(strstr(info.algorithm, "moba") != NULL);
  assert_null(strstr(info.algorithm, "every-block"));
  EXPECT_OK(attn_plan_destroy(plan));
  expect_execution_errors(d, &p);
  expect_tensor_errors(d, &p);
  EXPECT_OK(attn_plan_desc_destroy(d));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_version),
      cmocka_unit_test(test_status_string),
      cmocka_unit_test(test_context_create_errors),
      cmocka_unit_test(test_context_handles),
      cmocka_unit_test(test_context_outlived_by_plan),
      cmocka_unit_test(test_tensor_desc_errors),
      cmocka_unit_test(test_plan_desc_handles),
      cmocka_unit_test(test_plan_desc_setter_ranges),
      cmocka_unit_test(test_plan_create_handles),
      cmocka_unit_test(test_plan_create_shape_and_heads),
      cmocka_unit_test(test_empty_rows),
      cmocka_unit_test(test_varlen_errors),
      cmocka_unit_test(test_layout_thd_without_varlen),
      cmocka_unit_test(test_tensor_override_errors),
      cmocka_unit_test(test_output_self_overlap_rejected),
      cmocka_unit_test(test_cpu_isa_env),
      cmocka_unit_test(test_workspace_size),
      cmocka_unit_test(test_describe),
      cmocka_unit_test(test_summary),
      cmocka_unit_test(test_forward_errors),
      cmocka_unit_test(test_backward_errors),
      cmocka_unit_test(test_empty_problem),
      cmocka_unit_test(test_merge_errors),
      cmocka_unit_test(test_merge_works),
      cmocka_unit_test(test_destroyed_handles_everywhere),
      cmocka_unit_test(test_last_error_reset),
      cmocka_unit_test(test_last_error_thread_local),
      cmocka_unit_test(test_window_reaching_past_every_key),
      cmocka_unit_test(test_block_mask_create_errors),
      cmocka_unit_test(test_block_mask_set_blocks_errors),
      cmocka_unit_test(test_block_mask_set_device_blocks_cpu),
      cmocka_unit_test(test_block_mask_get_and_add_errors),
      cmocka_unit_test(test_block_mask_builder_errors),
      cmocka_unit_test(test_block_mask_plans),
      cmocka_unit_test(test_moba_errors),
      cmocka_unit_test(test_moba_keep_selection_errors),
      cmocka_unit_test(test_block_mask_execution_errors),
      cmocka_unit_test(test_moba_execution_errors),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
