/*
 * The library's backward pass against finite differences of its own
 * forward pass, in fp32 on small problems: an fp64-free check that dQ, dK
 * and dV are the gradients of what attn_forward computes.
 *
 * loss = sum(O * G) for a random G, so dO = G. Central differences with a
 * step of 2^-7 (the step actually taken is measured on the fp32 values),
 * at every element of small tensors and at random ones of larger tensors.
 * Tolerance: |fd - grad| <= 1e-2 * M + 1e-4, M the largest |fd| over dQ,
 * dK and dV of the case. Run once per CPU kernel variant (ATTN_CPU_ISA).
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

typedef struct gc_case {
  const char *name;
  int64_t batch, hq, hkv, dqk, dv;
  int64_t lq, lk;                  /* fixed-length batch */
  const int32_t *lens_q, *lens_kv; /* varlen when non-NULL */
  attn_mask_t mask;
  int64_t left, right;
  float scale, softcap; /* scale 0: the default */
  int threads;
} gc_case;

typedef struct gc_run {
  const gc_case *c;
  attn_plan_t plan, plan_fd;
  void *ws_fwd, *ws_bwd, *ws_fd;
  size_t ws_fwd_bytes, ws_bwd_bytes, ws_fd_bytes;
  int64_t total_q, total_kv;
  size_t nq, nk, nv, no;
  float *q, *k, *v, *g, *o, *lse, *dq, *dk, *dv;
} gc_run;

static float *falloc(size_t n) {
  float *p = (float *)malloc((n == 0 ? 1 : n) * sizeof(float));
  assert_non_null(p);
  return p;
}

static void fill(tu_rng *rng, float *x, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i) x[i] = (float)tu_rng_normal(rng, 0.0, 1.0);
}

static void expect_ok(const gc_case *c, attn_status_t st, const char *call) {
  if (st != ATTN_STATUS_SUCCESS) {
    print_error("%s: %s returned %s: %s (seed %llu)\n", c->name, call, attn_status_string(st),
                attn_last_error_message(), (unsigned long long)tu_seed());
    fail();
  }
}

/* A forward-backward plan of the case on `threads` threads. */
static attn_plan_t make_plan(const gc_case *c, int32_t threads, int64_t max_q, int64_t max_kv,
                             const int32_t *cu_q, const int32_t *cu_kv) {
  attn_context_t ctx = NULL;
  attn_plan_desc_t d = NULL;
  attn_plan_t plan = NULL;
  expect_ok(c, attn_context_create(ATTN_BACKEND_CPU, 0, threads, &ctx), "attn_context_create");
  expect_ok(c, attn_plan_desc_create(&d), "attn_plan_desc_create");
  expect_ok(c, attn_plan_desc_set_shape(d, c->batch, c->hq, c->hkv, max_q, max_kv, c->dqk, c->dv),
            "attn_plan_desc_set_shape");
  if (cu_q != NULL)
    expect_ok(c, attn_plan_desc_set_varlen(d, c->batch, cu_q, cu_kv), "attn_plan_desc_set_varlen");
  if (c->scale > 0.0f)
    expect_ok(c, attn_plan_desc_set_softmax_scale(d, c->scale), "attn_plan_desc_set_softmax_scale");
  if (c->softcap > 0.0f)
    expect_ok(c, attn_plan_desc_set_softcap(d, c->softcap), "attn_plan_desc_set_softcap");
  expect_ok(c, attn_plan_desc_set_mask(d, c->mask, c->left, c->right), "attn_plan_desc_set_mask");
  expect_ok(c, attn_plan_desc_set_allow_empty_rows(d, 1), "attn_plan_desc_set_allow_empty_rows");
  expect_ok(c, attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD_BACKWARD),
            "attn_plan_desc_set_passes");
  expect_ok(c, attn_plan_create(ctx, d, &plan), "attn_plan_create");
  attn_plan_desc_destroy(d);
  attn_context_destroy(ctx);
  return plan;
}

static void *workspace(const gc_case *c, attn_plan_t plan, attn_pass_t pass, size_t *bytes) {
  expect_ok(c, attn_plan_workspace_size(plan, pass, bytes), "attn_plan_workspace_size");
  return malloc(*bytes + 1);
}

static void gc_setup(const gc_case *c, gc_run *r, tu_rng *rng) {
  int32_t *cu_q = NULL, *cu_kv = NULL;
  int64_t max_q = c->lq, max_kv = c->lk, b;

  memset(r, 0, sizeof *r);
  r->c = c;
  if (c->lens_q != NULL) {
    cu_q = (int32_t *)calloc((size_t)c->batch + 1, sizeof(int32_t));
    cu_kv = (int32_t *)calloc((size_t)c->batch + 1, sizeof(int32_t));
    max_q = max_kv = 0;
    for (b = 0; b < c->batch; ++b) {
      cu_q[b + 1] = cu_q[b] + c->lens_q[b];
      cu_kv[b + 1] = cu_kv[b] + c->lens_kv[b];
      if (c->lens_q[b] > max_q) max_q = c->lens_q[b];
      if (c->lens_kv[b] > max_kv) max_kv = c->lens_kv[b];
    }
    r->total_q = cu_q[c->batch];
    r->total_kv = cu_kv[c->batch];
  } else {
    r->total_q = c->batch * c->lq;
    r->total_kv = c->batch * c->lk;
  }
  /* The gradients come from a plan on the case's thread count; the many
   * forwards of the finite differences run on one thread (results do not
   * depend on it, and tiny parallel calls would only spin). */
  r->plan = make_plan(c, c->threads, max_q, max_kv, cu_q, cu_kv);
  r->plan_fd = make_plan(c, 1, max_q, max_kv, cu_q, cu_kv);
  free(cu_q);
  free(cu_kv);
  r->ws_fwd = workspace(c, r->plan, ATTN_PASS_FORWARD, &r->ws_fwd_bytes);
  r->ws_bwd = workspace(c, r->plan, ATTN_PASS_BACKWARD, &r->ws_bwd_bytes);
  r->ws_fd = workspace(c, r->plan_fd, ATTN_PASS_FORWARD, &r->ws_fd_bytes);

  /* contiguous BSHD / THD: every element belongs to the tensor */
  r->nq = (size_t)(r->total_q * c->hq * c->dqk);
  r->no = (size_t)(r->total_q * c->hq * c->dv);
  r->nk = (size_t)(r->total_kv * c->hkv * c->dqk);
  r->nv = (size_t)(r->total_kv * c->hkv * c->dv);
  r->q = falloc(r->nq), r->k = falloc(r->nk), r->v = falloc(r->nv);
  r->g = falloc(r->no), r->o = falloc(r->no);
  r->lse = falloc((size_t)(r->total_q * c->hq));
  r->dq = falloc(r->nq), r->dk = falloc(r->nk), r->dv = falloc(r->nv);
  fill(rng, r->q, r->nq);
  fill(rng, r->k, r->nk);
  fill(rng, r->v, r->nv);
  fill(rng, r->g, r->no);
}

static void gc_free(gc_run *r) {
  attn_plan_destroy(r->plan);
  attn_plan_destroy(r->plan_fd);
  free(r->ws_fwd), free(r->ws_bwd), free(r->ws_fd);
  free(r->q), free(r->k), free(r->v), free(r->g), free(r->o), free(r->lse);
  free(r->dq), free(r->dk), free(r->dv);
}

/* sum(O * G) of a forward by `plan`; O and LSE are left in r. */
static double run_forward(gc_run *r, attn_plan_t plan, void *ws, size_t ws_bytes) {
  double sum = 0.0;
  size_t i;
  tu_poison(r->o, ATTN_DTYPE_FP32, r->no);
  expect_ok(r->c, attn_forward(plan, r->q, r->k, r->v, r->o, r->lse, ws, ws_bytes, NULL),
            "attn_forward");
  for (i = 0; i < r->no; ++i) sum += (double)r->o[i] * (double)r->g[i];
  return sum;
}

static double loss(gc_run *r) { return run_forward(r, r->plan_fd, r->ws_fd, r->ws_fd_bytes); }

/* Finite differences of the elements of x (all of them, or kMaxProbes
 * random ones for a large tensor); the largest |fd| and the largest
 * |fd - grad| with its index. */
enum { kMaxProbes = 400 };

typedef struct fd_result {
  double max_fd, max_err, fd_at, grad_at;
  size_t at;
} fd_result;

static void finite_differences(gc_run *r, tu_rng *rng, float *x, size_t n, const float *grad,
                               fd_result *res) {
  const float eps = 0.0078125f; /* 2^-7 */
  const size_t probes = n > kMaxProbes ? kMaxProbes : n;
  size_t p;
  memset(res, 0, sizeof *res);
  for (p = 0; p < probes; ++p) {
    const size_t i = n > kMaxProbes ? (size_t)tu_rng_int(rng, 0, (int64_t)n - 1) : p;
    const float saved = x[i];
    const float up_x = saved + eps, down_x = saved - eps;
    double up, down, fd;
    x[i] = up_x;
    up = loss(r);
    x[i] = down_x;
    down = loss(r);
    x[i] = saved;
    fd = (up - down) / ((double)up_x - (double)down_x);
    if (fabs(fd) > res->max_fd) res->max_fd = fabs(fd);
    if (fabs(fd - grad[i]) > res->max_err) {
      res->max_err = fabs(fd - grad[i]);
      res->at = i;
      res->fd_at = fd;
      res->grad_at = grad[i];
    }
  }
}

static void run_gradcheck(void **state) {
  const gc_case *c = (const gc_case *)*state;
  tu_rng rng = tu_rng_for(c->name);
  const char *names[3] = {"dQ", "dK", "dV"};
  fd_result res[3];
  double m = 0.0, tol;
  gc_run r;
  int i;

  gc_setup(c, &r, &rng);
  run_forward(&r, r.plan, r.ws_fwd, r.ws_fwd_bytes); /* O and LSE at the point */
  tu_poison(r.dq, ATTN_DTYPE_FP32, r.nq);
  tu_poison(r.dk, ATTN_DTYPE_FP32, r.nk);
  tu_poison(r.dv, ATTN_DTYPE_FP32, r.nv);
  expect_ok(c,
            attn_backward(r.plan, r.q, r.k, r.v, r.o, r.lse, r.g, r.dq, r.dk, r.dv, r.ws_bwd,
                          r.ws_bwd_bytes, NULL),
            "attn_backward");

  finite_differences(&r, &rng, r.q, r.nq, r.dq, &res[0]);
  finite_differences(&r, &rng, r.k, r.nk, r.dk, &res[1]);
  finite_differences(&r, &rng, r.v, r.nv, r.dv, &res[2]);
  for (i = 0; i < 3; ++i)
    if (res[i].max_fd > m) m = res[i].max_fd;
  tol = 1e-2 * m + 1e-4;
  printf("  %-28s dQ %.2g dK %.2g dV %.2g (tol %.2g)\n", c->name, res[0].max_err, res[1].max_err,
         res[2].max_err, tol);
  for (i = 0; i < 3; ++i)
    if (!(res[i].max_err <= tol)) { /* also catches NaN (poison left) */
      print_error("%s: %s element %zu: backward %.9g, finite differences %.9g (tol %.3g, "
                  "seed %llu)\n",
                  c->name, names[i], res[i].at, res[i].grad_at, res[i].fd_at, tol,
                  (unsigned long long)tu_seed());
      fail();
    }
  if (m == 0.0) {
    print_error("%s: every gradient is zero; the check is vacuous\n", c->name);
    fail();
  }
  gc_free(&r);
}

static const int32_t kLensQ[] = {5, 0, 7, 3};
static const int32_t kLensK[] = {6, 4, 0, 3};

#define SHAPE(b, hq_, hkv_, lq_, lk_, dqk_, dv_) \
  .batch = (b), .hq = (hq_), .hkv = (hkv_), .lq = (lq_), .lk = (lk_), .dqk = (dqk_), .dv = (dv_)
#define NO_WINDOW .left = -1, .right = -1

static const gc_case kCases[] = {
    {.name = "plain", SHAPE(1, 2, 2, 6, 9, 8, 8), .mask = ATTN_MASK_NONE, NO_WINDOW, .threads = 1},
    {.name = "causal_gqa", SHAPE(2, 4, 2, 7, 5, 6, 5), .mask = ATTN_MASK_CAUSAL, NO_WINDOW,
     .threads = 2},
    {.name = "window_mqa", SHAPE(1, 3, 1, 8, 8, 5, 7), .mask = ATTN_MASK_WINDOW, .left = 2,
     .right = 1, .scale = 0.6f, .threads = 1},
    {.name = "softcap", SHAPE(1, 2, 1, 6, 7, 8, 4), .mask = ATTN_MASK_NONE, NO_WINDOW,
     .scale = 1.0f, .softcap = 3.0f, .threads = 2},
    {.name = "softcap_causal", SHAPE(1, 2, 2, 5, 8, 4, 4), .mask = ATTN_MASK_CAUSAL, NO_WINDOW,
     .scale = 0.8f, .softcap = 1.5f, .threads = 1},
    {.name = "varlen_empty", .batch = 4, .hq = 2, .hkv = 1, .dqk = 4, .dv = 6, .lens_q = kLensQ,
     .lens_kv = kLensK, .mask = ATTN_MASK_WINDOW, .left = -1, .right = 1, .threads = 2},
    {.name = "multi_tile_causal", SHAPE(1, 1, 1, 130, 110, 4, 3), .mask = ATTN_MASK_CAUSAL,
     NO_WINDOW, .threads = 2},
    {.name = "multi_tile_window", SHAPE(1, 1, 1, 200, 200, 3, 2), .mask = ATTN_MASK_WINDOW,
     .left = 100, .right = 3, .threads = 1},
};

int main(void) {
  struct CMUnitTest tests[sizeof kCases / sizeof kCases[0]];
  size_t i;
  int rc = nc_isa_gate();
  if (rc != 0) return rc;
  for (i = 0; i < sizeof kCases / sizeof kCases[0]; ++i) {
    memset(&tests[i], 0, sizeof tests[i]);
    tests[i].name = kCases[i].name;
    tests[i].test_func = run_gradcheck;
    tests[i].initial_state = (void *)&kCases[i];
  }
  return _cmocka_run_group_tests("gradcheck", tests, sizeof tests / sizeof tests[0], NULL, NULL);
}
