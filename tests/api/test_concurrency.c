/* Thread-safety contract tests.
 *
 *  - One plan (forward + backward, causal, GQA) executed from several pthreads
 *    at once, each with its own workspace and outputs, gives bitwise the same
 *    results as a serial run; plan queries (describe, summary, workspace
 *    size) run concurrently with the executions. fp32 and bf16.
 *  - Several threads creating and destroying contexts, descriptors and plans
 *    at the same time (the handle registry is shared), with the last-error
 *    message staying per thread.
 *
 * Worker threads never call CMocka (it longjmps); they record what went wrong
 * and the main thread asserts. */
#define _POSIX_C_SOURCE 200809L

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <attn/attn.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NUM_WORKERS 4
#define ITERATIONS 4

/* ------------------------------------------------------------------------ */

static uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even; inputs are finite */
  return (uint16_t)(u >> 16);
}

/* Deterministic values in [-1, 1) stored as `dtype`. */
static void fill(void *dst, size_t n, attn_dtype_t dtype, unsigned seed) {
  uint32_t s = seed * 2654435761u + 99u;
  size_t i;
  for (i = 0; i < n; ++i) {
    float x;
    s = s * 1664525u + 1013904223u;
    x = (float)(s >> 8) / 8388608.0f - 1.0f;
    if (dtype == ATTN_DTYPE_FP32)
      ((float *)dst)[i] = x;
    else
      ((uint16_t *)dst)[i] = float_to_bf16(x);
  }
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) abort();
  return p;
}

static void check_ok(attn_status_t st, const char *expr, const char *file, int line) {
  if (st != ATTN_STATUS_SUCCESS) {
    print_error("%s:%d: %s -> %s: %s\n", file, line, expr, attn_status_string(st),
                attn_last_error_message());
    _fail(file, line);
  }
}
#define OK(call) check_ok((call), #call, __FILE__, __LINE__)

/* ------------------------------------------------------------------------ */
/* Concurrent execution of one plan                                          */
/* ------------------------------------------------------------------------ */

/* batch 2, 8 query heads on 2 kv heads, Lq 150 < Lk 230 (bottom-right causal),
 * head dims 64 / 48: several 96-row tiles per sequence. */
enum { B = 2, HQ = 8, HKV = 2, LQ = 150, LK = 230, DQK = 64, DV = 48 };

typedef struct shared {
  attn_plan_t plan;
  size_t esize;
  size_t nq, nk, nv, no, nlse;
  size_t ws_f, ws_b;
  const void *q, *k, *v, *d_o;
  /* the serial run */
  const void *o, *dq, *dk, *dv;
  const float *lse;
  char summary[1024];
  attn_plan_info_t info;
  pthread_barrier_t start;
} shared_t;

typedef struct worker {
  shared_t *sh;
  int id;
  int mismatches;
  int failures;
  char first_problem[512];
} worker_t;

static void note(worker_t *w, const char *what) {
  if (w->first_problem[0] == '\0')
    snprintf(w->first_problem, sizeof w->first_problem, "worker %d: %s (%s)", w->id, what,
             attn_last_error_message());
}

static void *exec_worker(void *arg) {
  worker_t *w = (worker_t *)arg;
  const shared_t *sh = w->sh;
  void *o = xmalloc(sh->no * sh->esize), *dq = xmalloc(sh->nq * sh->esize);
  void *dk = xmalloc(sh->nk * sh->esize), *dv = xmalloc(sh->nv * sh->esize);
  float *lse = xmalloc(sh->nlse * sizeof(float));
  void *wsf = xmalloc(sh->ws_f), *wsb = xmalloc(sh->ws_b);
  int it;

  pthread_barrier_wait(&w->sh->start);
  for (it = 0; it < ITERATIONS; ++it) {
    attn_plan_info_t info;
    char line[1024];
    size_t bytes = 0;
    /* A different poison each iteration: every output byte must be rewritten. */
    const int pat = 0x11 * (w->id + 1) + it;
    memset(o, pat, sh->no * sh->esize);
    memset(lse, pat, sh->nlse * sizeof(float));
    memset(dq, pat, sh->nq * sh->esize);
    memset(dk, pat, sh->nk * sh->esize);
    memset(dv, pat, sh->nv * sh->esize);
    memset(wsf, pat, sh->ws_f);
    memset(wsb, pat, sh->ws_b);

    if (attn_forward(sh->plan, sh->q, sh->k, sh->v, o, lse, wsf, sh->ws_f, NULL) != ATTN_STATUS_SUCCESS) {
      ++w->failures;
      note(w, "attn_forward failed");
      continue;
    }
    if (memcmp(o, sh->o, sh->no * sh->esize) != 0) ++w->mismatches, note(w, "O differs from the serial run");
    if (memcmp(lse, sh->lse, sh->nlse * sizeof(float)) != 0)
      ++w->mismatches, note(w, "LSE differs from the serial run");

    if (attn_backward(sh->plan, sh->q, sh->k, sh->v, o, lse, sh->d_o, dq, dk, dv, wsb, sh->ws_b, NULL) !=
        ATTN_STATUS_SUCCESS) {
      ++w->failures;
      note(w, "attn_backward failed");
      continue;
    }
    if (memcmp(dq, sh->dq, sh->nq * sh->esize) != 0) ++w->mismatches, note(w, "dQ differs from the serial run");
    if (memcmp(dk, sh->dk, sh->nk * sh->esize) != 0) ++w->mismatches, note(w, "dK differs from the serial run");
    if (memcmp(dv, sh->dv, sh->nv * sh->esize) != 0) ++w->mismatches, note(w, "dV differs from the serial run");

    /* The queries are thread-safe too. */
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (attn_plan_describe(sh->plan, &info) != ATTN_STATUS_SUCCESS ||
        memcmp(&info, &sh->info, sizeof info) != 0)
      ++w->failures, note(w, "attn_plan_describe differs");
    if (attn_plan_summary(sh->plan, line, sizeof line, NULL) != ATTN_STATUS_SUCCESS ||
        strcmp(line, sh->summary) != 0)
      ++w->failures, note(w, "attn_plan_summary differs");
    if (attn_plan_workspace_size(sh->plan, ATTN_PASS_BACKWARD, &bytes) != ATTN_STATUS_SUCCESS ||
        bytes != sh->ws_b)
      ++w->failures, note(w, "attn_plan_workspace_size differs");
  }
  free(o), free(dq), free(dk), free(dv), free(lse), free(wsf), free(wsb);
  return NULL;
}

static void run_concurrent_plan(attn_dtype_t dtype, int32_t ctx_threads) {
  attn_context_t ctx;
  attn_plan_desc_t d;
  shared_t sh;
  worker_t workers[NUM_WORKERS];
  pthread_t threads[NUM_WORKERS];
  void *q, *k, *v, *d_o, *o, *dq, *dk, *dv, *wsf, *wsb;
  float *lse;
  int i, total_mismatch = 0, total_fail = 0;

  memset(&sh, 0, sizeof sh);
  OK(attn_context_create(ATTN_BACKEND_CPU, 0, ctx_threads, &ctx));
  OK(attn_plan_desc_create(&d));
  OK(attn_plan_desc_set_shape(d, B, HQ, HKV, LQ, LK, DQK, DV));
  OK(attn_plan_desc_set_dtype(d, dtype));
  OK(attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, -1));
  OK(attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD_BACKWARD));
  OK(attn_plan_create(ctx, d, &sh.plan));
  OK(attn_plan_desc_destroy(d));
  OK(attn_context_destroy(ctx)); /* the plan keeps what it needs */

  sh.esize = dtype == ATTN_DTYPE_FP32 ? 4 : 2;
  sh.nq = (size_t)B * LQ * HQ * DQK;
  sh.nk = (size_t)B * LK * HKV * DQK;
  sh.nv = (size_t)B * LK * HKV * DV;
  sh.no = (size_t)B * LQ * HQ * DV;
  sh.nlse = (size_t)B * HQ * LQ;
  OK(attn_plan_workspace_size(sh.plan, ATTN_PASS_FORWARD, &sh.ws_f));
  OK(attn_plan_workspace_size(sh.plan, ATTN_PASS_BACKWARD, &sh.ws_b));
  sh.info.struct_size = sizeof sh.info;
  OK(attn_plan_describe(sh.plan, &sh.info));
  OK(attn_plan_summary(sh.plan, sh.summary, sizeof sh.summary, NULL));

  q = xmalloc(sh.nq * sh.esize), k = xmalloc(sh.nk * sh.esize), v = xmalloc(sh.nv * sh.esize);
  d_o = xmalloc(sh.no * sh.esize);
  fill(q, sh.nq, dtype, 1), fill(k, sh.nk, dtype, 2), fill(v, sh.nv, dtype, 3);
  fill(d_o, sh.no, dtype, 4);
  o = xmalloc(sh.no * sh.esize), dq = xmalloc(sh.nq * sh.esize);
  dk = xmalloc(sh.nk * sh.esize), dv = xmalloc(sh.nv * sh.esize);
  lse = xmalloc(sh.nlse * sizeof(float));
  wsf = xmalloc(sh.ws_f), wsb = xmalloc(sh.ws_b);

  /* The serial reference. */
  OK(attn_forward(sh.plan, q, k, v, o, lse, wsf, sh.ws_f, NULL));
  OK(attn_backward(sh.plan, q, k, v, o, lse, d_o, dq, dk, dv, wsb, sh.ws_b, NULL));
  sh.q = q, sh.k = k, sh.v = v, sh.d_o = d_o;
  sh.o = o, sh.lse = lse, sh.dq = dq, sh.dk = dk, sh.dv = dv;

  assert_int_equal(pthread_barrier_init(&sh.start, NULL, NUM_WORKERS), 0);
  for (i = 0; i < NUM_WORKERS; ++i) {
    memset(&workers[i], 0, sizeof workers[i]);
    workers[i].sh = &sh;
    workers[i].id = i;
    assert_int_equal(pthread_create(&threads[i], NULL, exec_worker, &workers[i]), 0);
  }
  for (i = 0; i < NUM_WORKERS; ++i) {
    assert_int_equal(pthread_join(threads[i], NULL), 0);
    total_mismatch += workers[i].mismatches;
    total_fail += workers[i].failures;
    if (workers[i].first_problem[0]) print_error("%s\n", workers[i].first_problem);
  }
  pthread_barrier_destroy(&sh.start);

  free(q), free(k), free(v), free(d_o), free(o), free(dq), free(dk), free(dv), free(lse);
  free(wsf), free(wsb);
  OK(attn_plan_destroy(sh.plan));
  assert_int_equal(total_fail, 0);
  assert_int_equal(total_mismatch, 0);
}

static void test_concurrent_exec_fp32(void **state) {
  (void)state;
  run_concurrent_plan(ATTN_DTYPE_FP32, 2);
}

static void test_concurrent_exec_bf16(void **state) {
  (void)state;
  run_concurrent_plan(ATTN_DTYPE_BF16, 2);
}

/* One CPU thread per execution: all parallelism comes from the callers. */
static void test_concurrent_exec_fp32_single_threaded_ctx(void **state) {
  (void)state;
  run_concurrent_plan(ATTN_DTYPE_FP32, 1);
}

/* ------------------------------------------------------------------------ */
/* Concurrent creation and destruction                                       */
/* ------------------------------------------------------------------------ */

#define CHURN_ITERATIONS 150

typedef struct churn {
  int id;
  int failures;
  char first_problem[512];
  pthread_barrier_t *start;
} churn_t;

#define CHURN_OK(call)                                                                      \
  do {                                                                                      \
    attn_status_t st_ = (call);                                                             \
    if (st_ != ATTN_STATUS_SUCCESS || attn_last_error_message()[0] != '\0') {               \
      ++c->failures;                                                                        \
      if (!c->first_problem[0])                                                             \
        snprintf(c->first_problem, sizeof c->first_problem, "thread %d: %s -> %s: %s", c->id, \
                 #call, attn_status_string(st_), attn_last_error_message());                \
      goto done;                                                                            \
    }                                                                                       \
  } while (0)

static void *churn_worker(void *arg) {
  churn_t *c = (churn_t *)arg;
  int it;
  pthread_barrier_wait(c->start);
  for (it = 0; it < CHURN_ITERATIONS; ++it) {
    attn_context_t ctx = NULL;
    attn_plan_desc_t d = NULL;
    attn_tensor_desc_t t = NULL;
    attn_plan_t plan = NULL;
    attn_backend_t b;
    size_t ws = 0;
    char line[512];
    const int64_t seq = 1 + (c->id * 7 + it) % 40;
    const int64_t dims[4] = {1, seq, 4, 16};
    attn_status_t st;

    CHURN_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx));
    CHURN_OK(attn_context_get_backend(ctx, &b));
    CHURN_OK(attn_tensor_desc_create(&t));
    CHURN_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 4, dims, NULL));
    CHURN_OK(attn_plan_desc_create(&d));
    CHURN_OK(attn_plan_desc_set_shape(d, 1, 4, 2, seq, seq, 16, 16));
    CHURN_OK(attn_plan_desc_set_mask(d, (it & 1) ? ATTN_MASK_CAUSAL : ATTN_MASK_NONE, -1, -1));
    CHURN_OK(attn_plan_desc_set_tensor(d, ATTN_TENSOR_Q, t));
    CHURN_OK(attn_plan_create(ctx, d, &plan));
    CHURN_OK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws));
    CHURN_OK(attn_plan_summary(plan, line, sizeof line, NULL));

    /* A failure on this thread names this thread's argument, whatever the others do. */
    st = attn_plan_workspace_size(plan, (c->id & 1) ? ATTN_PASS_BACKWARD : (attn_pass_t)7, &ws);
    if (st == ATTN_STATUS_SUCCESS ||
        strstr(attn_last_error_message(), (c->id & 1) ? "BACKWARD" : "pass") == NULL) {
      ++c->failures;
      if (!c->first_problem[0])
        snprintf(c->first_problem, sizeof c->first_problem, "thread %d: expected failure, got %s: %s",
                 c->id, attn_status_string(st), attn_last_error_message());
    }

    /* Destroy in a thread-dependent order. */
    if (c->id & 1) {
      CHURN_OK(attn_context_destroy(ctx));
      CHURN_OK(attn_plan_desc_destroy(d));
      CHURN_OK(attn_tensor_desc_destroy(t));
      CHURN_OK(attn_plan_destroy(plan));
    } else {
      CHURN_OK(attn_plan_destroy(plan));
      CHURN_OK(attn_tensor_desc_destroy(t));
      CHURN_OK(attn_plan_desc_destroy(d));
      CHURN_OK(attn_context_destroy(ctx));
    }
  }
done:
  return NULL;
}

static void test_concurrent_create_destroy(void **state) {
  pthread_t threads[NUM_WORKERS];
  churn_t churn[NUM_WORKERS];
  pthread_barrier_t start;
  int i, fails = 0;
  (void)state;
  assert_int_equal(pthread_barrier_init(&start, NULL, NUM_WORKERS), 0);
  for (i = 0; i < NUM_WORKERS; ++i) {
    memset(&churn[i], 0, sizeof churn[i]);
    churn[i].id = i;
    churn[i].start = &start;
    assert_int_equal(pthread_create(&threads[i], NULL, churn_worker, &churn[i]), 0);
  }
  for (i = 0; i < NUM_WORKERS; ++i) {
    assert_int_equal(pthread_join(threads[i], NULL), 0);
    fails += churn[i].failures;
    if (churn[i].first_problem[0]) print_error("%s\n", churn[i].first_problem);
  }
  pthread_barrier_destroy(&start);
  assert_int_equal(fails, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_concurrent_exec_fp32),
      cmocka_unit_test(test_concurrent_exec_bf16),
      cmocka_unit_test(test_concurrent_exec_fp32_single_threaded_ctx),
      cmocka_unit_test(test_concurrent_create_destroy),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
