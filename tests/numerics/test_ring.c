/*
 * Ring attention on in-process rings of 1..5 ranks (one thread and one CPU
 * context per rank) against the fp64 reference over the whole sequence.
 *
 * Each case draws global Q, K, V and dO, hands every rank its shards
 * (contiguous or zigzag), runs forward and backward on all ranks at once
 * and puts the local outputs back in their global places. The yardstick is
 * the dense plan over the whole sequence, run on the same inputs: for every
 * output X,
 *
 *     max |X_ring - X_ref|  <=  2 max |X_dense - X_ref|  +  atol
 *
 * with atol = (4 u + 4 u32 Z) M as in harness.h (M the largest |X_ref|, of
 * the three gradients together for dQ, dK, dV; Z the largest logit) and
 * 1e-5 max(1, |LSE_ref|) for LSE. The dense plan itself is checked against
 * the reference by the forward and backward tests, and here bounded by
 * 8 atol (LSE: 1e-2 max(1, |LSE_ref|)), so that an error it shared with
 * the ring could not widen the tolerance to cover itself. Outputs are poisoned
 * before the run (an unwritten element is NaN and fails), and inputs must
 * come back unchanged. Varlen batches (THD shards of sequences of different
 * lengths) are compared with the dense varlen plan over the whole batch.
 * Besides the fixed cases, 12 cases drawn from the seed
 * (ranks, layouts, dtypes, masks, windows, GQA, softcap, seqlen_q !=
 * seqlen_kv with empty rows allowed) run each time.
 */
#define _POSIX_C_SOURCE 200809L

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <attn/attn.h>

#include "reference.h"
#include "testutil.h"

typedef struct ring_case {
  const char *name;
  int32_t ranks;
  attn_ring_layout_t ring_layout;
  attn_dtype_t dtype;
  attn_layout_t layout; /* BSHD or BHSD */
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_kv, dqk, dv;
  attn_mask_t mask;
  int64_t left, right; /* ATTN_MASK_WINDOW */
  float softcap;
  int allow_empty_rows; /* random cases: Lq > Lk with a mask can empty rows */
  /* Varlen batches (layout THD): the lengths of the batch's sequences;
   * seqlen_q and seqlen_kv are then the longest. NULL: fixed length. */
  const int64_t *lens_q, *lens_kv;
} ring_case;

/* One tensor's geometry: [batch, seq, heads, dim] in the case's layout. */
typedef struct geom {
  int64_t batch, seq, heads, dim;
  int bhsd;
} geom;

static size_t geom_count(const geom *g) { return (size_t)(g->batch * g->seq * g->heads * g->dim); }

static size_t geom_index(const geom *g, int64_t b, int64_t s, int64_t h, int64_t c) {
  if (g->bhsd) return (size_t)(((b * g->heads + h) * g->seq + s) * g->dim + c);
  return (size_t)(((b * g->seq + s) * g->heads + h) * g->dim + c);
}

static ref_strides geom_strides(const geom *g) {
  ref_strides t;
  if (g->bhsd) {
    t.batch = g->heads * g->seq * g->dim, t.seq = g->dim, t.head = g->seq * g->dim;
  } else {
    t.batch = g->seq * g->heads * g->dim, t.seq = g->heads * g->dim, t.head = g->dim;
  }
  return t;
}

/* Global position of local position s on `rank` (the layouts of attn.h). */
static int64_t global_pos(const ring_case *c, int32_t rank, int64_t global_len, int64_t s) {
  const int zig = c->ring_layout == ATTN_RING_LAYOUT_ZIGZAG;
  const int64_t chunk = global_len / (zig ? 2 * c->ranks : c->ranks);
  const int64_t k = s / chunk, within = s % chunk;
  const int64_t g = zig ? (k == 0 ? rank : 2 * c->ranks - 1 - rank) : rank;
  return g * chunk + within;
}

/* Index of (sequence b, position s, head h, 0) in a tensor of geometry g
 * whose sequences start at cu (varlen: g is [1, total, heads, dim], THD). */
static size_t seq_index(const ring_case *c, const geom *g, const int64_t *cu, int64_t b,
                        int64_t s, int64_t h) {
  return c->lens_q ? geom_index(g, 0, cu[b] + s, h, 0) : geom_index(g, b, s, h, 0);
}

/* Copies between a global tensor and one rank's shard (to_local: global ->
 * local), element by element in the dtype. cu and lcu: where each sequence
 * starts, globally and in the shard (b * length for fixed-length batches). */
static void shard_copy(const ring_case *c, int32_t rank, const geom *gg, const geom *lg,
                       const int64_t *cu, const int64_t *lcu, size_t elem, void *global,
                       void *local, int to_local) {
  for (int64_t b = 0; b < c->batch; ++b)
    for (int64_t s = 0; s < lcu[b + 1] - lcu[b]; ++s) {
      const int64_t gs = global_pos(c, rank, cu[b + 1] - cu[b], s);
      for (int64_t h = 0; h < lg->heads; ++h) {
        char *gp = (char *)global + seq_index(c, gg, cu, b, gs, h) * elem;
        char *lp = (char *)local + seq_index(c, lg, lcu, b, s, h) * elem;
        if (to_local)
          memcpy(lp, gp, (size_t)lg->dim * elem);
        else
          memcpy(gp, lp, (size_t)lg->dim * elem);
      }
    }
}

/* LSE shard copy (local -> global): [batch, heads, seq], or varlen
 * [heads, total]. */
static void lse_to_global(const ring_case *c, int32_t rank, const int64_t *cu, const int64_t *lcu,
                          const float *local, float *global) {
  const int64_t total = cu[c->batch], local_total = lcu[c->batch];
  for (int64_t b = 0; b < c->batch; ++b)
    for (int64_t h = 0; h < c->heads_q; ++h)
      for (int64_t s = 0; s < lcu[b + 1] - lcu[b]; ++s) {
        const int64_t len = cu[b + 1] - cu[b], gs = global_pos(c, rank, len, s);
        const size_t gi = (size_t)(c->lens_q ? h * total + cu[b] + gs : (b * c->heads_q + h) * len + gs);
        const size_t li = (size_t)(c->lens_q ? h * local_total + lcu[b] + s
                                             : (b * c->heads_q + h) * (lcu[b + 1] - lcu[b]) + s);
        global[gi] = local[li];
      }
}

typedef struct rank_job {
  const ring_case *c;
  attn_plan_desc_t desc;
  attn_comm_t comm;
  int32_t rank;
  void *q, *k, *v, *d_o;      /* local inputs */
  void *o, *dq, *dk, *dv;     /* local outputs */
  float *lse;
  attn_status_t st_create, st_fwd, st_bwd;
  int32_t exchanges_backward; /* attn_ring_plan_describe */
  char message[512];
} rank_job;

static void *rank_main(void *arg) {
  rank_job *j = (rank_job *)arg;
  attn_context_t ctx = NULL;
  attn_plan_t plan = NULL;
  j->st_create = j->st_fwd = j->st_bwd = ATTN_STATUS_INTERNAL_ERROR;
  if (attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx) != ATTN_STATUS_SUCCESS) return NULL;
  j->st_create = attn_ring_plan_create(ctx, j->desc, j->comm, j->c->ring_layout, &plan);
  if (j->st_create != ATTN_STATUS_SUCCESS) {
    snprintf(j->message, sizeof j->message, "%s", attn_last_error_message());
    attn_context_destroy(ctx);
    return NULL;
  }
  attn_ring_plan_info_t info;
  info.struct_size = sizeof info;
  j->exchanges_backward = attn_ring_plan_describe(plan, &info) == ATTN_STATUS_SUCCESS
                              ? info.exchanges_backward
                              : -1;
  size_t fwd = 0, bwd = 0;
  attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fwd);
  attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &bwd);
  const size_t bytes = fwd > bwd ? fwd : bwd;
  void *ws = malloc(bytes ? bytes : 1);
  tu_poison_bytes(ws, bytes);
  j->st_fwd = attn_forward(plan, j->q, j->k, j->v, j->o, j->lse, ws, fwd, NULL);
  if (j->st_fwd != ATTN_STATUS_SUCCESS) {
    snprintf(j->message, sizeof j->message, "%s", attn_last_error_message());
  } else {
    tu_poison_bytes(ws, bytes);
    j->st_bwd = attn_backward(plan, j->q, j->k, j->v, j->o, j->lse, j->d_o, j->dq, j->dk, j->dv,
                              ws, bwd, NULL);
    if (j->st_bwd != ATTN_STATUS_SUCCESS)
      snprintf(j->message, sizeof j->message, "%s", attn_last_error_message());
  }
  free(ws);
  attn_plan_destroy(plan);
  attn_context_destroy(ctx);
  return NULL;
}

static double max_abs(const double *x, size_t n) {
  double m = 0.0;
  for (size_t i = 0; i < n; ++i)
    if (isfinite(x[i]) && fabs(x[i]) > m) m = fabs(x[i]);
  return m;
}

/* Error of a dtype buffer against a reference, element by element. */
static void err_of(tu_err *e, const geom *g, const void *got, attn_dtype_t dtype,
                   const double *ref) {
  for (int64_t b = 0; b < g->batch; ++b)
    for (int64_t s = 0; s < g->seq; ++s)
      for (int64_t h = 0; h < g->heads; ++h)
        for (int64_t c = 0; c < g->dim; ++c) {
          const size_t i = geom_index(g, b, s, h, c);
          tu_err_add(e, b, s, h, c, tu_load(got, i, dtype), ref[i]);
        }
}

/* LSE errors, reported by flat index (b and h 0) for varlen batches. */
static void err_of_lse(tu_err *e, const ring_case *c, size_t n, const float *got,
                       const double *ref) {
  for (size_t i = 0; i < n; ++i) {
    const int64_t per_b = c->heads_q * c->seqlen_q, ii = (int64_t)i;
    if (c->lens_q)
      tu_err_add(e, 0, ii, 0, -1, (double)got[i], ref[i]);
    else
      tu_err_add(e, ii / per_b, ii % c->seqlen_q, ii % per_b / c->seqlen_q, -1, (double)got[i],
                 ref[i]);
  }
}

/* The ring within twice the dense plan's error plus atol; the dense plan,
 * whose error sets the tolerance, within `cap` itself (it is the library's
 * own code: an error it shared with the ring would otherwise widen the
 * tolerance to cover itself). */
/* The dense yardstick's bound, in units of atol (over 60 seeds its error
 * stayed below 1.4 atol). */
static const double kCapScale = 8.0;

static int check(const char *name, const tu_err *ring, const tu_err *dense, double atol,
                 double cap) {
  const double tol = 2.0 * dense->max_err + atol;
  char line[512];
  tu_err_format(ring, tol, line, sizeof line);
  const int ok = tu_err_ok(ring, tol) && dense->bad == 0;
  if (!ok) print_error("%s: %s (dense plan's max err %.3g)\n", name, line, dense->max_err);
  if (dense->max_err > cap) {
    print_error("%s: the dense yardstick's %s error %.3g is above its bound %.3g\n", name,
                dense->what, dense->max_err, cap);
    return 0;
  }
  return ok;
}

static void run_case(void **state) {
  const ring_case *c = (const ring_case *)*state;
  tu_rng rng = tu_rng_for(c->name);
  const attn_dtype_t dt = c->dtype;
  const size_t es = tu_dtype_size(dt);
  const int bhsd = c->layout == ATTN_LAYOUT_BHSD;
  const int32_t n = c->ranks;
  /* Where each sequence starts, globally and in a rank's shard. */
  int64_t *cu_q = malloc(sizeof(int64_t) * (size_t)(c->batch + 1));
  int64_t *cu_kv = malloc(sizeof(int64_t) * (size_t)(c->batch + 1));
  int64_t *lcu_q = malloc(sizeof(int64_t) * (size_t)(c->batch + 1));
  int64_t *lcu_kv = malloc(sizeof(int64_t) * (size_t)(c->batch + 1));
  int32_t *cu32_q = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
  int32_t *cu32_kv = malloc(sizeof(int32_t) * (size_t)(c->batch + 1));
  cu_q[0] = cu_kv[0] = 0;
  for (int64_t b = 0; b < c->batch; ++b) {
    cu_q[b + 1] = cu_q[b] + (c->lens_q ? c->lens_q[b] : c->seqlen_q);
    cu_kv[b + 1] = cu_kv[b] + (c->lens_kv ? c->lens_kv[b] : c->seqlen_kv);
  }
  for (int64_t b = 0; b <= c->batch; ++b) {
    lcu_q[b] = cu_q[b] / n, lcu_kv[b] = cu_kv[b] / n;
    cu32_q[b] = (int32_t)cu_q[b], cu32_kv[b] = (int32_t)cu_kv[b];
  }
  const int64_t tq = cu_q[c->batch], tk = cu_kv[c->batch];
  /* Fixed length: [batch, seq, heads, dim]; varlen: [1, total, heads, dim]. */
  const int64_t gb = c->lens_q ? 1 : c->batch;
  const int64_t gsq = c->lens_q ? tq : c->seqlen_q, gsk = c->lens_q ? tk : c->seqlen_kv;
  const geom gq = {gb, gsq, c->heads_q, c->dqk, bhsd};
  const geom go = {gb, gsq, c->heads_q, c->dv, bhsd};
  const geom gk = {gb, gsk, c->heads_kv, c->dqk, bhsd};
  const geom gv = {gb, gsk, c->heads_kv, c->dv, bhsd};
  const size_t lse_n = (size_t)(c->heads_q * tq);

  tu_buffer q, k, v, d_o;
  tu_buffer_alloc(&q, dt, geom_count(&gq));
  tu_buffer_alloc(&k, dt, geom_count(&gk));
  tu_buffer_alloc(&v, dt, geom_count(&gv));
  tu_buffer_alloc(&d_o, dt, geom_count(&go));
  tu_fill_normal(&rng, &q, 1.0);
  tu_fill_normal(&rng, &k, 1.0);
  tu_fill_normal(&rng, &v, 1.0);
  tu_fill_normal(&rng, &d_o, 1.0);

  /* fp64 reference over the whole sequence. */
  ref_problem p;
  memset(&p, 0, sizeof p);
  p.batch = c->batch, p.heads_q = c->heads_q, p.heads_kv = c->heads_kv;
  p.head_dim_qk = c->dqk, p.head_dim_v = c->dv;
  p.cu_q = cu_q, p.cu_kv = cu_kv, p.varlen = c->lens_q != NULL;
  p.scale = (double)(float)(1.0 / sqrt((double)c->dqk));
  p.softcap = c->softcap;
  p.window_left = c->mask == ATTN_MASK_WINDOW ? c->left : -1;
  p.window_right = c->mask == ATTN_MASK_NONE ? -1 : c->mask == ATTN_MASK_CAUSAL ? 0 : c->right;
  p.q = p.dq = geom_strides(&gq);
  p.o = p.d_o = geom_strides(&go);
  p.k = p.dk = geom_strides(&gk);
  p.v = p.dv = geom_strides(&gv);
  double *o_ref = malloc(sizeof(double) * geom_count(&go));
  double *lse_ref = malloc(sizeof(double) * lse_n);
  double *dq_ref = malloc(sizeof(double) * geom_count(&gq));
  double *dk_ref = malloc(sizeof(double) * geom_count(&gk));
  double *dv_ref = malloc(sizeof(double) * geom_count(&gv));
  ref_forward(&p, q.mirror, k.mirror, v.mirror, o_ref, lse_ref);
  ref_backward(&p, q.mirror, k.mirror, v.mirror, d_o.mirror, dq_ref, dk_ref, dv_ref);

  attn_plan_desc_t desc;
  assert_int_equal(attn_plan_desc_create(&desc), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_shape(desc, c->batch, c->heads_q, c->heads_kv, c->seqlen_q,
                                            c->seqlen_kv, c->dqk, c->dv),
                   ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_dtype(desc, dt), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_layout(desc, c->layout), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_mask(desc, c->mask, c->mask == ATTN_MASK_WINDOW ? c->left : -1,
                                           c->mask == ATTN_MASK_WINDOW ? c->right : -1),
                   ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_softcap(desc, c->softcap), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_allow_empty_rows(desc, c->allow_empty_rows),
                   ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_plan_desc_set_passes(desc, ATTN_PASSES_FORWARD_BACKWARD),
                   ATTN_STATUS_SUCCESS);
  if (c->lens_q)
    assert_int_equal(attn_plan_desc_set_varlen(desc, c->batch, cu32_q, cu32_kv), ATTN_STATUS_SUCCESS);

  /* The dense plan over the whole sequence: the yardstick. */
  void *o_d = malloc(geom_count(&go) * es), *dq_d = malloc(geom_count(&gq) * es);
  void *dk_d = malloc(geom_count(&gk) * es), *dv_d = malloc(geom_count(&gv) * es);
  float *lse_d = malloc(sizeof(float) * lse_n);
  {
    attn_context_t ctx;
    attn_plan_t plan;
    assert_int_equal(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx), ATTN_STATUS_SUCCESS);
    assert_int_equal(attn_plan_create(ctx, desc, &plan), ATTN_STATUS_SUCCESS);
    size_t fwd, bwd;
    attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fwd);
    attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &bwd);
    void *ws = malloc((fwd > bwd ? fwd : bwd) + 1);
    assert_int_equal(attn_forward(plan, q.data, k.data, v.data, o_d, lse_d, ws, fwd, NULL),
                     ATTN_STATUS_SUCCESS);
    assert_int_equal(attn_backward(plan, q.data, k.data, v.data, o_d, lse_d, d_o.data, dq_d, dk_d,
                                   dv_d, ws, bwd, NULL),
                     ATTN_STATUS_SUCCESS);
    free(ws);
    attn_plan_destroy(plan);
    attn_context_destroy(ctx);
  }

  /* The ring: shards in, run every rank, results back to global places. */
  const int64_t lq = gsq / n, lk = gsk / n;
  const geom lgq = {gb, lq, c->heads_q, c->dqk, bhsd};
  const geom lgo = {gb, lq, c->heads_q, c->dv, bhsd};
  const geom lgk = {gb, lk, c->heads_kv, c->dqk, bhsd};
  const geom lgv = {gb, lk, c->heads_kv, c->dv, bhsd};
  const size_t local_lse_n = lse_n / (size_t)n;
  attn_comm_t *comms = malloc(sizeof(attn_comm_t) * (size_t)n);
  assert_int_equal(attn_comm_create_inprocess(n, 60000, comms), ATTN_STATUS_SUCCESS);
  rank_job *jobs = calloc((size_t)n, sizeof(rank_job));
  pthread_t *threads = malloc(sizeof(pthread_t) * (size_t)n);
  for (int32_t r = 0; r < n; ++r) {
    rank_job *j = &jobs[r];
    j->c = c, j->desc = desc, j->comm = comms[r], j->rank = r;
    j->q = malloc(geom_count(&lgq) * es), j->k = malloc(geom_count(&lgk) * es);
    j->v = malloc(geom_count(&lgv) * es), j->d_o = malloc(geom_count(&lgo) * es);
    j->o = malloc(geom_count(&lgo) * es), j->dq = malloc(geom_count(&lgq) * es);
    j->dk = malloc(geom_count(&lgk) * es), j->dv = malloc(geom_count(&lgv) * es);
    j->lse = malloc(sizeof(float) * local_lse_n);
    shard_copy(c, r, &gq, &lgq, cu_q, lcu_q, es, q.data, j->q, 1);
    shard_copy(c, r, &gk, &lgk, cu_kv, lcu_kv, es, k.data, j->k, 1);
    shard_copy(c, r, &gv, &lgv, cu_kv, lcu_kv, es, v.data, j->v, 1);
    shard_copy(c, r, &go, &lgo, cu_q, lcu_q, es, d_o.data, j->d_o, 1);
    tu_poison(j->o, dt, geom_count(&lgo));
    tu_poison(j->dq, dt, geom_count(&lgq));
    tu_poison(j->dk, dt, geom_count(&lgk));
    tu_poison(j->dv, dt, geom_count(&lgv));
    tu_poison(j->lse, ATTN_DTYPE_FP32, local_lse_n);
  }
  for (int32_t r = 0; r < n; ++r) assert_int_equal(pthread_create(&threads[r], NULL, rank_main, &jobs[r]), 0);
  for (int32_t r = 0; r < n; ++r) pthread_join(threads[r], NULL);

  void *o_r = malloc(geom_count(&go) * es), *dq_r = malloc(geom_count(&gq) * es);
  void *dk_r = malloc(geom_count(&gk) * es), *dv_r = malloc(geom_count(&gv) * es);
  float *lse_r = malloc(sizeof(float) * lse_n);
  int ok = 1;
  /* By default the own dK/dV stay home, one dK/dV exchange fewer;
     ATTN_RING_DKV_HOME=0 (the numerics-ring-dkv-exchange entry) sends them
     round too. The count also shows which schedule ran. */
  const char *home_env = getenv("ATTN_RING_DKV_HOME");
  const int dkv_home = home_env == NULL || strcmp(home_env, "0") != 0;
  const int32_t want_exchanges = n > 1 ? 2 * n - 1 - (dkv_home ? 1 : 0) : 0;
  for (int32_t r = 0; r < n; ++r) {
    rank_job *j = &jobs[r];
    if (j->st_create != ATTN_STATUS_SUCCESS || j->st_fwd != ATTN_STATUS_SUCCESS ||
        j->st_bwd != ATTN_STATUS_SUCCESS) {
      print_error("rank %d: create %s, forward %s, backward %s: %s\n", r,
                  attn_status_string(j->st_create), attn_status_string(j->st_fwd),
                  attn_status_string(j->st_bwd), j->message);
      ok = 0;
      continue;
    }
    if (j->exchanges_backward != want_exchanges) {
      print_error("rank %d: attn_ring_plan_describe: %d backward exchanges, expected %d\n", r,
                  j->exchanges_backward, want_exchanges);
      ok = 0;
    }
    shard_copy(c, r, &go, &lgo, cu_q, lcu_q, es, o_r, j->o, 0);
    shard_copy(c, r, &gq, &lgq, cu_q, lcu_q, es, dq_r, j->dq, 0);
    shard_copy(c, r, &gk, &lgk, cu_kv, lcu_kv, es, dk_r, j->dk, 0);
    shard_copy(c, r, &gv, &lgv, cu_kv, lcu_kv, es, dv_r, j->dv, 0);
    lse_to_global(c, r, cu_q, lcu_q, j->lse, lse_r);
    /* The inputs must be untouched: compare with a fresh shard. */
    void *fresh = malloc(geom_count(&lgo) * es + geom_count(&lgq) * es + geom_count(&lgk) * es +
                         geom_count(&lgv) * es);
    shard_copy(c, r, &gq, &lgq, cu_q, lcu_q, es, q.data, fresh, 1);
    if (memcmp(fresh, j->q, geom_count(&lgq) * es) != 0) ok = 0, print_error("rank %d wrote Q\n", r);
    shard_copy(c, r, &gk, &lgk, cu_kv, lcu_kv, es, k.data, fresh, 1);
    if (memcmp(fresh, j->k, geom_count(&lgk) * es) != 0) ok = 0, print_error("rank %d wrote K\n", r);
    shard_copy(c, r, &gv, &lgv, cu_kv, lcu_kv, es, v.data, fresh, 1);
    if (memcmp(fresh, j->v, geom_count(&lgv) * es) != 0) ok = 0, print_error("rank %d wrote V\n", r);
    shard_copy(c, r, &go, &lgo, cu_q, lcu_q, es, d_o.data, fresh, 1);
    if (memcmp(fresh, j->d_o, geom_count(&lgo) * es) != 0) ok = 0, print_error("rank %d wrote dO\n", r);
    free(fresh);
  }

  if (ok) {
    const double u = tu_unit_roundoff(dt), u32 = tu_unit_roundoff(ATTN_DTYPE_FP32);
    const double z = ref_max_abs_logit(&p, q.mirror, k.mirror);
    const double rel = 4.0 * u + 4.0 * u32 * z;
    double m_grad = max_abs(dq_ref, geom_count(&gq));
    const double mk = max_abs(dk_ref, geom_count(&gk)), mv = max_abs(dv_ref, geom_count(&gv));
    if (mk > m_grad) m_grad = mk;
    if (mv > m_grad) m_grad = mv;
    const double m_lse = max_abs(lse_ref, lse_n);
    tu_err er, ed;
    tu_err_init(&er, "O"), tu_err_init(&ed, "O");
    err_of(&er, &go, o_r, dt, o_ref), err_of(&ed, &go, o_d, dt, o_ref);
    const double m_o = max_abs(o_ref, geom_count(&go));
    ok &= check(c->name, &er, &ed, rel * m_o, kCapScale * rel * m_o);
    tu_err_init(&er, "LSE"), tu_err_init(&ed, "LSE");
    err_of_lse(&er, c, lse_n, lse_r, lse_ref), err_of_lse(&ed, c, lse_n, lse_d, lse_ref);
    ok &= check(c->name, &er, &ed, 1e-5 * (m_lse > 1.0 ? m_lse : 1.0),
                1e-2 * (m_lse > 1.0 ? m_lse : 1.0));
    tu_err_init(&er, "dQ"), tu_err_init(&ed, "dQ");
    err_of(&er, &gq, dq_r, dt, dq_ref), err_of(&ed, &gq, dq_d, dt, dq_ref);
    ok &= check(c->name, &er, &ed, rel * m_grad, kCapScale * rel * m_grad);
    tu_err_init(&er, "dK"), tu_err_init(&ed, "dK");
    err_of(&er, &gk, dk_r, dt, dk_ref), err_of(&ed, &gk, dk_d, dt, dk_ref);
    ok &= check(c->name, &er, &ed, rel * m_grad, kCapScale * rel * m_grad);
    tu_err_init(&er, "dV"), tu_err_init(&ed, "dV");
    err_of(&er, &gv, dv_r, dt, dv_ref), err_of(&ed, &gv, dv_d, dt, dv_ref);
    ok &= check(c->name, &er, &ed, rel * m_grad, kCapScale * rel * m_grad);
  }

  for (int32_t r = 0; r < n; ++r) {
    rank_job *j = &jobs[r];
    free(j->q), free(j->k), free(j->v), free(j->d_o);
    free(j->o), free(j->dq), free(j->dk), free(j->dv), free(j->lse);
    attn_comm_destroy(comms[r]);
  }
  free(jobs), free(threads), free(comms);
  free(o_r), free(dq_r), free(dk_r), free(dv_r), free(lse_r);
  free(o_d), free(dq_d), free(dk_d), free(dv_d), free(lse_d);
  free(o_ref), free(lse_ref), free(dq_ref), free(dk_ref), free(dv_ref);
  free(cu_q), free(cu_kv), free(lcu_q), free(lcu_kv), free(cu32_q), free(cu32_kv);
  attn_plan_desc_destroy(desc);
  tu_buffer_free(&q), tu_buffer_free(&k), tu_buffer_free(&v), tu_buffer_free(&d_o);
  assert_true(ok);
}

#define CONTIG ATTN_RING_LAYOUT_CONTIGUOUS
#define ZIGZAG ATTN_RING_LAYOUT_ZIGZAG
#define F32 ATTN_DTYPE_FP32
#define F16 ATTN_DTYPE_FP16
#define BF16 ATTN_DTYPE_BF16
#define BSHD ATTN_LAYOUT_BSHD
#define BHSD ATTN_LAYOUT_BHSD

static const ring_case kCases[] = {
    /* name                       ranks layout  dtype layout  B Hq Hkv  Lq   Lk  dqk dv  mask                 l  r  cap empty */
    {"r1-contiguous-full-fp32",     1, CONTIG, F32,  BSHD, 1, 2, 2,  24,  24, 16, 16, ATTN_MASK_NONE,   -1, -1, 0.0f, 0, NULL, NULL},
    {"r1-zigzag-causal-bf16",       1, ZIGZAG, BF16, BSHD, 1, 2, 1,  26,  26, 16, 16, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, NULL, NULL},
    {"r2-contiguous-causal-gqa",    2, CONTIG, F32,  BSHD, 2, 4, 2,  24,  24, 16,  8, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, NULL, NULL},
    {"r2-zigzag-full-fp32",         2, ZIGZAG, F32,  BSHD, 1, 2, 2,  20,  20, 8,   8, ATTN_MASK_NONE,   -1, -1, 0.0f, 0, NULL, NULL},
    {"r2-zigzag-causal-bhsd-fp16",  2, ZIGZAG, F16,  BHSD, 2, 2, 1,  20,  20, 16, 16, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, NULL, NULL},
    {"r2-contiguous-causal-lq<lk",  2, CONTIG, F32,  BSHD, 1, 2, 1,  12,  20, 16, 16, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, NULL, NULL},
    {"r2-zigzag-causal-multitile",  2, ZIGZAG, F32,  BSHD, 1, 2, 1, 400, 400, 32, 32, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, NULL, NULL},
    {"r3-zigzag-causal-gqa",        3, ZIGZAG, F32,  BSHD, 1, 4, 2,  30,  30, 16, 16, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, NULL, NULL},
    {"r3-contiguous-window-fp32",   3, CONTIG, F32,  BSHD, 2, 2, 2,  33,  33, 8,  16, ATTN_MASK_WINDOW,  5,  3, 0.0f, 0, NULL, NULL},
    {"r3-contiguous-causal-softcap",3, CONTIG, F32,  BSHD, 1, 2, 2,  21,  21, 16, 16, ATTN_MASK_CAUSAL, -1, -1, 5.0f, 0, NULL, NULL},
    {"r3-zigzag-full-bf16",         3, ZIGZAG, BF16, BHSD, 1, 3, 1,  36,  36, 16, 16, ATTN_MASK_NONE,   -1, -1, 0.0f, 0, NULL, NULL},
    {"r4-zigzag-full-bf16",         4, ZIGZAG, BF16, BSHD, 1, 2, 2,  32,  32, 16, 16, ATTN_MASK_NONE,   -1, -1, 0.0f, 0, NULL, NULL},
    {"r4-zigzag-window-fp32",       4, ZIGZAG, F32,  BSHD, 1, 2, 1,  40,  40, 16, 16, ATTN_MASK_WINDOW,  6,  0, 0.0f, 0, NULL, NULL},
    {"r4-contiguous-window-right",  4, CONTIG, F32,  BSHD, 1, 2, 2,  28,  28, 8,   8, ATTN_MASK_WINDOW, -1,  4, 0.0f, 0, NULL, NULL},
    {"r5-contiguous-causal-bf16",   5, CONTIG, BF16, BSHD, 1, 2, 1,  35,  35, 16, 16, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, NULL, NULL},
    {"r5-zigzag-window-bf16",       5, ZIGZAG, BF16, BSHD, 1, 2, 2,  50,  50, 16, 16, ATTN_MASK_WINDOW,  3,  2, 0.0f, 0, NULL, NULL},
    {"r5-zigzag-causal-fp32",       5, ZIGZAG, F32,  BSHD, 2, 2, 1,  30,  30, 8,   8, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, NULL, NULL},
};

/* Varlen batches: sequence lengths, each a multiple of the ring's chunk
 * count (N, or 2N for zigzag). A local chunk of one token and chunks of
 * several tiles (the CPU tile is 96) are both among them. */
#define THD ATTN_LAYOUT_THD
static const int64_t kR1Q[] = {5, 17, 1}, kR1K[] = {5, 17, 1};
static const int64_t kR2ZQ[] = {4, 12, 8}, kR2ZK[] = {4, 12, 8};
static const int64_t kR2CQ[] = {2, 400, 6}, kR2CK[] = {4, 400, 14};
static const int64_t kR3ZQ[] = {6, 600, 12}, kR3ZK[] = {6, 600, 12};
static const int64_t kR3CQ[] = {9, 30, 3}, kR3CK[] = {9, 30, 3};
static const int64_t kR4ZQ[] = {8, 40, 16}, kR4ZK[] = {8, 40, 24};
static const int64_t kR4CQ[] = {4, 20, 12}, kR4CK[] = {8, 12, 4};
static const int64_t kR4EQ[] = {16, 24}, kR4EK[] = {8, 24};
/* Empty sequences: keys only, queries only (rows without keys), neither. */
static const int64_t kR2EQ[] = {8, 0, 16, 0, 4}, kR2EK[] = {8, 4, 0, 0, 4};

static const ring_case kVarlenCases[] = {
    /* name                               ranks layout  dtype layout B Hq Hkv Lq   Lk  dqk dv mask              l   r  cap empty lens */
    {"varlen-r1-contiguous-full-gqa",       1, CONTIG, F32,  THD, 3, 4, 2,  17,  17, 16, 16, ATTN_MASK_NONE,   -1, -1, 0.0f, 0, kR1Q, kR1K},
    {"varlen-r2-zigzag-causal-bf16",        2, ZIGZAG, BF16, THD, 3, 4, 2,  12,  12, 16, 16, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, kR2ZQ, kR2ZK},
    {"varlen-r2-contiguous-causal-lq<lk",   2, CONTIG, F32,  THD, 3, 2, 1, 400, 400, 32, 32, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, kR2CQ, kR2CK},
    {"varlen-r3-zigzag-causal-multitile",   3, ZIGZAG, F32,  THD, 3, 2, 2, 600, 600, 16, 16, ATTN_MASK_CAUSAL, -1, -1, 0.0f, 0, kR3ZQ, kR3ZK},
    {"varlen-r3-contiguous-window-fp32",    3, CONTIG, F32,  THD, 3, 2, 1,  30,  30, 8,  16, ATTN_MASK_WINDOW,  5,  2, 0.0f, 0, kR3CQ, kR3CK},
    {"varlen-r4-zigzag-window-bf16",        4, ZIGZAG, BF16, THD, 3, 4, 2,  40,  40, 16, 16, ATTN_MASK_WINDOW,  6,  0, 0.0f, 1, kR4ZQ, kR4ZK},
    {"varlen-r4-contiguous-full-bf16",      4, CONTIG, BF16, THD, 3, 3, 1,  20,  12, 16,  8, ATTN_MASK_NONE,   -1, -1, 0.0f, 0, kR4CQ, kR4CK},
    {"varlen-r4-zigzag-causal-lq>lk-gqa",   4, ZIGZAG, F32,  THD, 2, 4, 2,  24,  24, 16, 16, ATTN_MASK_CAUSAL, -1, -1, 5.0f, 1, kR4EQ, kR4EK},
    {"varlen-r2-zigzag-window-empty-seqs",  2, ZIGZAG, F32,  THD, 5, 4, 2,  16,   8, 16, 16, ATTN_MASK_WINDOW,  5,  0, 0.0f, 1, kR2EQ, kR2EK},
};

/* Cases drawn from the seed: new every run, reproduced by ATTN_TEST_SEED. */
enum { kRandomCases = 12 };
static ring_case random_cases[kRandomCases];
static char random_names[kRandomCases][96];

static void draw_random_cases(void) {
  tu_rng r = tu_rng_for("ring-random");
  const attn_dtype_t dtypes[3] = {F32, F16, BF16};
  const attn_mask_t masks[3] = {ATTN_MASK_NONE, ATTN_MASK_CAUSAL, ATTN_MASK_WINDOW};
  const int64_t dims[3] = {8, 16, 24};
  for (int i = 0; i < kRandomCases; ++i) {
    ring_case *c = &random_cases[i];
    memset(c, 0, sizeof *c);
    c->ranks = (int32_t)tu_rng_int(&r, 1, 5);
    c->ring_layout = tu_rng_int(&r, 0, 1) ? ZIGZAG : CONTIG;
    c->dtype = dtypes[tu_rng_int(&r, 0, 2)];
    c->layout = tu_rng_int(&r, 0, 1) ? BHSD : BSHD;
    c->batch = tu_rng_int(&r, 1, 2);
    c->heads_kv = tu_rng_int(&r, 1, 2);
    c->heads_q = c->heads_kv * tu_rng_int(&r, 1, 3);
    const int64_t parts = c->ring_layout == ZIGZAG ? 2 * c->ranks : c->ranks;
    c->seqlen_q = parts * tu_rng_int(&r, 1, 9);
    c->seqlen_kv = tu_rng_int(&r, 0, 2) ? c->seqlen_q : parts * tu_rng_int(&r, 1, 9);
    c->dqk = dims[tu_rng_int(&r, 0, 2)];
    c->dv = dims[tu_rng_int(&r, 0, 2)];
    c->mask = masks[tu_rng_int(&r, 0, 2)];
    c->left = c->mask == ATTN_MASK_WINDOW ? tu_rng_int(&r, -1, 12) : -1;
    c->right = c->mask == ATTN_MASK_WINDOW ? tu_rng_int(&r, -1, 12) : -1;
    c->softcap = tu_rng_int(&r, 0, 3) == 0 ? 5.0f : 0.0f;
    c->allow_empty_rows = 1;
    snprintf(random_names[i], sizeof random_names[i],
             "random-%d: r%d %s %s %s B%lld H%lld/%lld L%lld/%lld d%lld/%lld mask %d (%lld,%lld)%s",
             i, c->ranks, c->ring_layout == ZIGZAG ? "zigzag" : "contiguous",
             tu_dtype_name(c->dtype), c->layout == BHSD ? "BHSD" : "BSHD", (long long)c->batch,
             (long long)c->heads_q, (long long)c->heads_kv, (long long)c->seqlen_q,
             (long long)c->seqlen_kv, (long long)c->dqk, (long long)c->dv, (int)c->mask,
             (long long)c->left, (long long)c->right, c->softcap > 0.0f ? " softcap" : "");
    c->name = random_names[i];
  }
}

int main(void) {
  tu_seed(); /* prints the seed */
  draw_random_cases();
  enum { N = sizeof kCases / sizeof kCases[0], V = sizeof kVarlenCases / sizeof kVarlenCases[0] };
  struct CMUnitTest tests[N + V + kRandomCases];
  for (size_t i = 0; i < N + V + kRandomCases; ++i) {
    const ring_case *c = i < N       ? &kCases[i]
                         : i < N + V ? &kVarlenCases[i - N]
                                     : &random_cases[i - N - V];
    struct CMUnitTest t = {c->name, run_case, NULL, NULL, (void *)c};
    tests[i] = t;
  }
  return cmocka_run_group_tests_name("numerics-ring", tests, NULL, NULL);
}
