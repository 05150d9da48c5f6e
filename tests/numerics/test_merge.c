/*
 * attn_merge_states against the fp64 reference over all keys.
 *
 * The keys are split into disjoint parts; each part's state (O_p, LSE_p) is
 * computed either by the library (contiguous key ranges, one plan per part
 * reading K and V in place through strides) or by the fp64 reference over a
 * random key subset (rounded to the dtype, so masks can leave rows empty in
 * some parts). The parts are merged in a random order and must give the
 * attention over all keys.
 *
 * Tolerance rule as in harness.h: max |X_lib - X_ref| <= 2 * max |X_lowp -
 * X_ref| + atol, where X_lowp merges the same parts in plain fp32 (max
 * subtraction, weights, sum, rounding to the dtype); atol = max(4 u, 1e-5)
 * * max |O_ref| for O and 1e-5 * max(1, max |LSE_ref|) for LSE. As the
 * parts feed both, the yardstick must itself be within (64 u + 1e-5) *
 * max |O_ref| (LSE: 1e-4 * max(1, max |LSE_ref|)) of the reference. Exact: rows
 * no part saw give O = 0 and LSE = -inf; a row only one part saw is that
 * part's row, bit for bit; parts with LSE = -inf contribute
 * nothing whatever their O holds; nothing outside O and LSE is written and
 * the parts are left unchanged (except part 0 when merging in place).
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

#include "reference.h"
#include "testutil.h"

typedef enum mg_source {
  MG_LIBRARY,  /* contiguous key ranges, attn_forward per part (mask NONE) */
  MG_REFERENCE /* random key subsets, fp64 reference per part */
} mg_source;

typedef enum mg_layout {
  MG_BSHD,       /* O [B, S, H, D]; LSE [B, H, S] described as dims [B, S, H] */
  MG_BHSD,       /* O [B, H, S, D]; LSE [B, H, S] contiguous */
  MG_BSHD_PADDED /* O [B, S, H, D] with padded strides */
} mg_layout;

typedef struct mg_case {
  const char *name;
  attn_dtype_t dtype;
  int64_t batch, heads, lq, lk, dim;
  int parts; /* number of key parts; 0: random in 2..5 */
  mg_source source;
  attn_mask_t mask;    /* reference source only (the library's parts use NONE) */
  int64_t left, right; /* for ATTN_MASK_WINDOW; -1 = unbounded */
  int empty_parts;     /* extra parts that saw no key (LSE = -inf, garbage O) */
  int in_place;        /* o_out = o_parts[0], lse_out = lse_parts[0] */
  int no_lse_out;      /* lse_out = NULL */
  mg_layout layout;
  double scale; /* 0: 1/sqrt(dim) */
  double qk_sd; /* 0: 1 */
  int threads;
} mg_case;

typedef struct mg_run {
  const mg_case *c;
  tu_rng rng;
  int nparts; /* key parts + empty parts */
  ref_problem rp;
  int64_t *cu_q, *cu_kv; /* batch + 1 offsets */
  int64_t o_dims[4], o_strides[4]; /* in o_desc order */
  int64_t lse_dims[3], lse_strides[3];
  size_t o_n, lse_n;
  tu_buffer q, k, v;
  tu_buffer *o_part; /* nparts typed O buffers (mirror = their values) */
  float **lse_part;
  int32_t *key_part; /* part of each key */
  unsigned char *in_o; /* per element of an O buffer: 1 inside O, 0 in a gap */
  double *o_ref, *lse_ref, *o_lowp, *lse_lowp;
} mg_run;

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes == 0 ? 1 : bytes);
  assert_non_null(p);
  return p;
}

static void mg_fail(const mg_run *r, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  print_error("FAILED %s (%s, %d parts) seed %llu (ATTN_TEST_SEED=%llu reproduces)\n  %s\n",
              r->c->name, tu_dtype_name(r->c->dtype), r->nparts, (unsigned long long)tu_seed(),
              (unsigned long long)tu_seed(), msg);
  fail();
}

static void mg_ok(const mg_run *r, attn_status_t st, const char *call) {
  if (st != ATTN_STATUS_SUCCESS)
    mg_fail(r, "%s returned %s: %s", call, attn_status_string(st), attn_last_error_message());
}

/* Offsets of O row (b, s, h) and of its LSE. */
static size_t o_row(const mg_run *r, int64_t b, int64_t s, int64_t h) {
  if (r->c->layout == MG_BHSD)
    return (size_t)(b * r->o_strides[0] + h * r->o_strides[1] + s * r->o_strides[2]);
  return (size_t)(b * r->o_strides[0] + s * r->o_strides[1] + h * r->o_strides[2]);
}
static size_t lse_at(const mg_run *r, int64_t b, int64_t s, int64_t h) {
  return (size_t)((b * r->c->heads + h) * r->c->lq + s); /* [B, H, S] in memory */
}

static void setup(const mg_case *c, mg_run *r) {
  const int64_t B = c->batch, H = c->heads, S = c->lq, D = c->dim;
  const int bhsd = c->layout == MG_BHSD;
  const int64_t pad_h = c->layout == MG_BSHD_PADDED ? 3 : 0;
  const int64_t pad_s = c->layout == MG_BSHD_PADDED ? 5 : 0;
  const int64_t pad_b = c->layout == MG_BSHD_PADDED ? 7 : 0;
  int64_t b;
  memset(r, 0, sizeof *r);
  r->c = c;
  r->rng = tu_rng_for(c->name);
  r->nparts = (c->parts > 0 ? c->parts : (int)tu_rng_int(&r->rng, 2, 5)) + c->empty_parts;
  if (c->parts > c->lk) mg_fail(r, "case error: more parts than keys");

  /* O geometry and the LSE descriptor over O's leading dims */
  if (bhsd) {
    r->o_dims[0] = B, r->o_dims[1] = H, r->o_dims[2] = S, r->o_dims[3] = D;
    r->o_strides[3] = 1, r->o_strides[2] = D, r->o_strides[1] = S * D, r->o_strides[0] = H * S * D;
    r->lse_dims[0] = B, r->lse_dims[1] = H, r->lse_dims[2] = S;
    r->lse_strides[0] = H * S, r->lse_strides[1] = S, r->lse_strides[2] = 1;
  } else {
    r->o_dims[0] = B, r->o_dims[1] = S, r->o_dims[2] = H, r->o_dims[3] = D;
    r->o_strides[3] = 1, r->o_strides[2] = D + pad_h;
    r->o_strides[1] = H * r->o_strides[2] + pad_s, r->o_strides[0] = S * r->o_strides[1] + pad_b;
    r->lse_dims[0] = B, r->lse_dims[1] = S, r->lse_dims[2] = H;
    r->lse_strides[0] = H * S, r->lse_strides[1] = 1, r->lse_strides[2] = S;
  }
  r->o_n = o_row(r, B - 1, S - 1, H - 1) + (size_t)D;
  r->lse_n = (size_t)(B * H * S);
  r->in_o = (unsigned char *)calloc(r->o_n, 1);
  assert_non_null(r->in_o);
  {
    int64_t s, h;
    for (b = 0; b < B; ++b)
      for (s = 0; s < S; ++s)
        for (h = 0; h < H; ++h) memset(r->in_o + o_row(r, b, s, h), 1, (size_t)D);
  }

  /* the reference problem: Q, K, V in the plan's layout, O as above */
  r->cu_q = (int64_t *)xmalloc(sizeof(int64_t) * (size_t)(B + 1));
  r->cu_kv = (int64_t *)xmalloc(sizeof(int64_t) * (size_t)(B + 1));
  for (b = 0; b <= B; ++b) r->cu_q[b] = b * S, r->cu_kv[b] = b * c->lk;
  r->rp.batch = B;
  r->rp.heads_q = r->rp.heads_kv = H;
  r->rp.head_dim_qk = r->rp.head_dim_v = D;
  r->rp.cu_q = r->cu_q;
  r->rp.cu_kv = r->cu_kv;
  r->rp.scale = c->scale > 0.0 ? c->scale : (double)(float)(1.0 / sqrt((double)D));
  r->rp.window_left = c->mask == ATTN_MASK_WINDOW ? c->left : -1;
  r->rp.window_right = c->mask == ATTN_MASK_NONE ? -1 : c->mask == ATTN_MASK_CAUSAL ? 0 : c->right;
  if (bhsd) {
    r->rp.q.seq = D, r->rp.q.head = S * D, r->rp.q.batch = H * S * D;
    r->rp.k.seq = D, r->rp.k.head = c->lk * D, r->rp.k.batch = H * c->lk * D;
    r->rp.o.seq = r->o_strides[2], r->rp.o.head = r->o_strides[1];
  } else {
    r->rp.q.head = D, r->rp.q.seq = H * D, r->rp.q.batch = S * H * D;
    r->rp.k.head = D, r->rp.k.seq = H * D, r->rp.k.batch = c->lk * H * D;
    r->rp.o.seq = r->o_strides[1], r->rp.o.head = r->o_strides[2];
  }
  r->rp.o.batch = r->o_strides[0];
  r->rp.v = r->rp.k;

  tu_buffer_alloc(&r->q, c->dtype, (size_t)(B * S * H * D));
  tu_buffer_alloc(&r->k, c->dtype, (size_t)(B * c->lk * H * D));
  tu_buffer_alloc(&r->v, c->dtype, (size_t)(B * c->lk * H * D));
  tu_fill_normal(&r->rng, &r->q, c->qk_sd > 0.0 ? c->qk_sd : 1.0);
  tu_fill_normal(&r->rng, &r->k, c->qk_sd > 0.0 ? c->qk_sd : 1.0);
  tu_fill_normal(&r->rng, &r->v, 1.0);

  r->o_part = (tu_buffer *)xmalloc(sizeof(tu_buffer) * (size_t)r->nparts);
  r->lse_part = (float **)xmalloc(sizeof(float *) * (size_t)r->nparts);
  r->key_part = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)c->lk);
  r->o_ref = (double *)xmalloc(sizeof(double) * r->o_n);
  r->o_lowp = (double *)xmalloc(sizeof(double) * r->o_n);
  r->lse_ref = (double *)xmalloc(sizeof(double) * r->lse_n);
  r->lse_lowp = (double *)xmalloc(sizeof(double) * r->lse_n);
}

static void teardown(mg_run *r) {
  int p;
  for (p = 0; p < r->nparts; ++p) {
    tu_buffer_free(&r->o_part[p]);
    free(r->lse_part[p]);
  }
  free(r->o_part), free(r->lse_part), free(r->key_part), free(r->in_o);
  free(r->cu_q), free(r->cu_kv);
  free(r->o_ref), free(r->o_lowp), free(r->lse_ref), free(r->lse_lowp);
  tu_buffer_free(&r->q), tu_buffer_free(&r->k), tu_buffer_free(&r->v);
}

/* Assigns each key to one of `parts` parts, none empty: contiguous ranges
 * (library source) or a random assignment. */
static void split_keys(mg_run *r, int parts) {
  const int64_t lk = r->c->lk;
  int64_t j;
  if (r->c->source == MG_LIBRARY) {
    /* parts - 1 distinct cut points in 1..lk-1 */
    int64_t *cuts = (int64_t *)xmalloc(sizeof(int64_t) * (size_t)parts);
    int n = 0;
    while (n < parts - 1) {
      const int64_t x = tu_rng_int(&r->rng, 1, lk - 1);
      int dup = 0, i;
      for (i = 0; i < n; ++i) dup |= cuts[i] == x;
      if (!dup) cuts[n++] = x;
    }
    for (j = 0; j < lk; ++j) {
      int part = 0, i;
      for (i = 0; i < n; ++i) part += j >= cuts[i];
      r->key_part[j] = part;
    }
    free(cuts);
    return;
  }
  /* every part gets a key, the rest go anywhere */
  for (j = 0; j < lk; ++j)
    r->key_part[j] = (int32_t)(j < parts ? j : tu_rng_int(&r->rng, 0, parts - 1));
  /* shuffle so that the guaranteed first keys are not in order */
  for (j = lk - 1; j > 0; --j) {
    const int64_t i = tu_rng_int(&r->rng, 0, j);
    const int32_t t = r->key_part[j];
    r->key_part[j] = r->key_part[i];
    r->key_part[i] = t;
  }
}

/* Part p's state from the library: a plan over keys [lo, hi) reading K and
 * V in place. */
static void part_from_library(mg_run *r, attn_context_t ctx, int p, int64_t lo, int64_t hi) {
  const mg_case *c = r->c;
  const int bhsd = c->layout == MG_BHSD;
  const int64_t len = hi - lo, H = c->heads, D = c->dim;
  attn_plan_desc_t d = NULL;
  attn_tensor_desc_t td = NULL;
  attn_plan_t plan = NULL;
  int64_t kv_dims[4], kv_strides[4];
  size_t ws_bytes = 0;
  void *ws;
  const size_t es = tu_dtype_size(c->dtype);
  const size_t kv_off = (size_t)(bhsd ? lo * D : lo * H * D);

  mg_ok(r, attn_plan_desc_create(&d), "attn_plan_desc_create");
  mg_ok(r, attn_plan_desc_set_shape(d, c->batch, H, H, c->lq, len, D, D),
        "attn_plan_desc_set_shape");
  mg_ok(r, attn_plan_desc_set_dtype(d, c->dtype), "attn_plan_desc_set_dtype");
  mg_ok(r, attn_plan_desc_set_layout(d, bhsd ? ATTN_LAYOUT_BHSD : ATTN_LAYOUT_BSHD),
        "attn_plan_desc_set_layout");
  mg_ok(r, attn_plan_desc_set_softmax_scale(d, (float)r->rp.scale),
        "attn_plan_desc_set_softmax_scale");
  mg_ok(r, attn_tensor_desc_create(&td), "attn_tensor_desc_create");
  kv_dims[0] = c->batch, kv_dims[3] = D;
  kv_strides[0] = r->rp.k.batch, kv_strides[3] = 1;
  if (bhsd) {
    kv_dims[1] = H, kv_dims[2] = len;
    kv_strides[1] = r->rp.k.head, kv_strides[2] = r->rp.k.seq;
  } else {
    kv_dims[1] = len, kv_dims[2] = H;
    kv_strides[1] = r->rp.k.seq, kv_strides[2] = r->rp.k.head;
  }
  mg_ok(r, attn_tensor_desc_set(td, c->dtype, 4, kv_dims, kv_strides), "attn_tensor_desc_set");
  mg_ok(r, attn_plan_desc_set_tensor(d, ATTN_TENSOR_K, td), "attn_plan_desc_set_tensor");
  mg_ok(r, attn_plan_desc_set_tensor(d, ATTN_TENSOR_V, td), "attn_plan_desc_set_tensor");
  mg_ok(r, attn_tensor_desc_set(td, c->dtype, 4, r->o_dims, r->o_strides), "attn_tensor_desc_set");
  mg_ok(r, attn_plan_desc_set_tensor(d, ATTN_TENSOR_O, td), "attn_plan_desc_set_tensor");
  attn_tensor_desc_destroy(td);
  mg_ok(r, attn_plan_create(ctx, d, &plan), "attn_plan_create");
  attn_plan_desc_destroy(d);
  mg_ok(r, attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_bytes),
        "attn_plan_workspace_size");
  ws = xmalloc(ws_bytes);
  mg_ok(r,
        attn_forward(plan, r->q.data, (const char *)r->k.data + kv_off * es,
                     (const char *)r->v.data + kv_off * es, r->o_part[p].data, r->lse_part[p], ws,
                     ws_bytes, NULL),
        "attn_forward");
  free(ws);
  attn_plan_destroy(plan);
}

/* Part p's state from the fp64 reference over the keys assigned to it,
 * rounded to the dtype (O) and to fp32 (LSE). */
static void part_from_reference(mg_run *r, int p) {
  unsigned char *keep = (unsigned char *)xmalloc((size_t)(r->c->batch * r->c->lk));
  double *o = (double *)xmalloc(sizeof(double) * r->o_n);
  double *lse = (double *)xmalloc(sizeof(double) * r->lse_n);
  ref_problem sub = r->rp;
  int64_t j, b, s, h, ch;
  for (b = 0; b < r->c->batch; ++b) /* the same split in every sequence */
    for (j = 0; j < r->c->lk; ++j) keep[r->cu_kv[b] + j] = r->key_part[j] == p;
  sub.key_filter = keep;
  ref_forward(&sub, r->q.mirror, r->k.mirror, r->v.mirror, o, lse);
  for (b = 0; b < r->c->batch; ++b)
    for (s = 0; s < r->c->lq; ++s)
      for (h = 0; h < r->c->heads; ++h) {
        const size_t row = o_row(r, b, s, h);
        for (ch = 0; ch < r->c->dim; ++ch)
          tu_store(r->o_part[p].data, row + (size_t)ch, r->c->dtype, o[row + (size_t)ch]);
        r->lse_part[p][lse_at(r, b, s, h)] = (float)lse[ref_lse_index(&sub, b, h, s)];
      }
  free(keep);
  free(o);
  free(lse);
}

/* Builds every part. Buffers start filled with garbage (finite, not
 * poison) so that gaps and empty parts hold values that must not matter. */
static void build_parts(mg_run *r) {
  const mg_case *c = r->c;
  const int key_parts = r->nparts - c->empty_parts;
  attn_context_t ctx = NULL;
  int p;
  size_t e;
  split_keys(r, key_parts);
  mg_ok(r, attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx), "attn_context_create");
  for (p = 0; p < r->nparts; ++p) {
    tu_buffer_alloc(&r->o_part[p], c->dtype, r->o_n);
    tu_fill_uniform(&r->rng, &r->o_part[p], 100.0, 200.0);
    r->lse_part[p] = (float *)xmalloc(sizeof(float) * r->lse_n);
    for (e = 0; e < r->lse_n; ++e) r->lse_part[p][e] = -INFINITY;
    if (p >= key_parts) continue; /* an empty part: LSE -inf, O garbage */
    if (c->source == MG_LIBRARY) {
      int64_t lo = 0, hi;
      while (r->key_part[lo] != p) ++lo;
      for (hi = lo; hi < c->lk && r->key_part[hi] == p; ++hi) continue;
      part_from_library(r, ctx, p, lo, hi);
    } else {
      part_from_reference(r, p);
    }
    for (e = 0; e < r->o_n; ++e) r->o_part[p].mirror[e] = tu_load(r->o_part[p].data, e, c->dtype);
  }
  attn_context_destroy(ctx);
}

/* The plain fp32 merge of the parts, in the given order. */
static void lowp_merge(mg_run *r, const int32_t *order) {
  const mg_case *c = r->c;
  int64_t b, s, h, ch;
  int i;
  for (b = 0; b < c->batch; ++b)
    for (s = 0; s < c->lq; ++s)
      for (h = 0; h < c->heads; ++h) {
        const size_t row = o_row(r, b, s, h), l = lse_at(r, b, s, h);
        float m = -INFINITY, total = 0.0f;
        for (i = 0; i < r->nparts; ++i)
          if (r->lse_part[order[i]][l] > m) m = r->lse_part[order[i]][l];
        if (m == -INFINITY) {
          for (ch = 0; ch < c->dim; ++ch) r->o_lowp[row + (size_t)ch] = 0.0;
          r->lse_lowp[l] = -INFINITY;
          continue;
        }
        for (i = 0; i < r->nparts; ++i) total += expf(r->lse_part[order[i]][l] - m);
        for (ch = 0; ch < c->dim; ++ch) {
          float acc = 0.0f;
          for (i = 0; i < r->nparts; ++i) {
            const float w = expf(r->lse_part[order[i]][l] - m);
            if (w > 0.0f) acc += w * (float)r->o_part[order[i]].mirror[row + (size_t)ch];
          }
          r->o_lowp[row + (size_t)ch] = tu_round_float(acc / total, c->dtype);
        }
        r->lse_lowp[l] = m + logf(total);
      }
}

/* A row that exactly one part saw is that part's row: weight 1, the
 * others 0, so O and LSE come out exactly. */
static void check_single_part_rows(const mg_run *r, const void *o_out, const float *lse_out) {
  const mg_case *c = r->c;
  int64_t b, s, h, ch;
  int p;
  for (b = 0; b < c->batch; ++b)
    for (s = 0; s < c->lq; ++s)
      for (h = 0; h < c->heads; ++h) {
        const size_t row = o_row(r, b, s, h), l = lse_at(r, b, s, h);
        int seen = 0, only = -1;
        for (p = 0; p < r->nparts; ++p)
          if (r->lse_part[p][l] != -INFINITY) ++seen, only = p;
        if (seen != 1) continue;
        if (lse_out != NULL && lse_out[l] != r->lse_part[only][l])
          mg_fail(r, "LSE[b %lld, s %lld, h %lld] = %.9g, but only one part saw the row and its "
                  "LSE is %.9g", (long long)b, (long long)s, (long long)h, (double)lse_out[l],
                  (double)r->lse_part[only][l]);
        for (ch = 0; ch < c->dim; ++ch) {
          const double got = tu_load(o_out, row + (size_t)ch, c->dtype);
          const double want = r->o_part[only].mirror[row + (size_t)ch];
          if (got != want)
            mg_fail(r, "O[b %lld, s %lld, h %lld, c %lld] = %.9g, but only one part saw the row "
                    "and its O is %.9g", (long long)b, (long long)s, (long long)h, (long long)ch,
                    got, want);
        }
      }
}

static void run_merge(void **state) {
  const mg_case *c = (const mg_case *)*state;
  mg_run r;
  int32_t *order;
  const void **o_ptrs;
  const float **lse_ptrs;
  void *o_out;
  float *lse_out;
  tu_buffer out;
  float *lse_buf = NULL;
  unsigned char **saved;
  attn_context_t ctx = NULL;
  attn_tensor_desc_t od = NULL, ld = NULL;
  tu_err lib, low;
  double tol;
  char line[512];
  const size_t es = tu_dtype_size(c->dtype);
  int64_t b, s, h, ch;
  int i;

  setup(c, &r);
  build_parts(&r);
  /* the whole; the reference's LSE order [B, H, S] is lse_at's */
  ref_forward(&r.rp, r.q.mirror, r.k.mirror, r.v.mirror, r.o_ref, r.lse_ref);

  order = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)r.nparts);
  tu_rng_permutation(&r.rng, order, (size_t)r.nparts);
  o_ptrs = (const void **)xmalloc(sizeof(void *) * (size_t)r.nparts);
  lse_ptrs = (const float **)xmalloc(sizeof(float *) * (size_t)r.nparts);
  saved = (unsigned char **)xmalloc(sizeof(unsigned char *) * (size_t)r.nparts);
  for (i = 0; i < r.nparts; ++i) {
    o_ptrs[i] = r.o_part[order[i]].data;
    lse_ptrs[i] = r.lse_part[order[i]];
    saved[i] = (unsigned char *)xmalloc(r.o_n * es + r.lse_n * sizeof(float));
    memcpy(saved[i], o_ptrs[i], r.o_n * es);
    memcpy(saved[i] + r.o_n * es, lse_ptrs[i], r.lse_n * sizeof(float));
  }
  lowp_merge(&r, order);

  tu_buffer_alloc(&out, c->dtype, r.o_n); /* poisoned */
  if (c->in_place) {
    o_out = r.o_part[order[0]].data;
    lse_out = r.lse_part[order[0]];
  } else {
    o_out = out.data;
    lse_buf = (float *)xmalloc(sizeof(float) * r.lse_n);
    tu_poison(lse_buf, ATTN_DTYPE_FP32, r.lse_n);
    lse_out = lse_buf;
  }
  if (c->no_lse_out) lse_out = NULL;

  mg_ok(&r, attn_context_create(ATTN_BACKEND_CPU, 0, c->threads, &ctx), "attn_context_create");
  mg_ok(&r, attn_tensor_desc_create(&od), "attn_tensor_desc_create");
  mg_ok(&r, attn_tensor_desc_create(&ld), "attn_tensor_desc_create");
  mg_ok(&r, attn_tensor_desc_set(od, c->dtype, 4, r.o_dims, r.o_strides), "attn_tensor_desc_set");
  mg_ok(&r, attn_tensor_desc_set(ld, ATTN_DTYPE_FP32, 3, r.lse_dims, r.lse_strides),
        "attn_tensor_desc_set");
  mg_ok(&r, attn_merge_states(ctx, r.nparts, od, ld, o_ptrs, lse_ptrs, o_out, lse_out, NULL),
        "attn_merge_states");
  attn_tensor_desc_destroy(od);
  attn_tensor_desc_destroy(ld);
  attn_context_destroy(ctx);

  /* O */
  tu_err_init(&lib, "O");
  tu_err_init(&low, "O");
  for (b = 0; b < c->batch; ++b)
    for (s = 0; s < c->lq; ++s)
      for (h = 0; h < c->heads; ++h) {
        const size_t row = o_row(&r, b, s, h);
        const int empty = r.lse_ref[lse_at(&r, b, s, h)] == -INFINITY;
        for (ch = 0; ch < c->dim; ++ch) {
          const double got = tu_load(o_out, row + (size_t)ch, c->dtype);
          tu_err_add(&lib, b, s, h, ch, got, r.o_ref[row + (size_t)ch]);
          tu_err_add(&low, b, s, h, ch, r.o_lowp[row + (size_t)ch], r.o_ref[row + (size_t)ch]);
          if (empty && got != 0.0)
            mg_fail(&r, "O[b %lld, s %lld, h %lld, c %lld] = %.9g in a row no part saw (must be 0)",
                    (long long)b, (long long)s, (long long)h, (long long)ch, got);
        }
      }
  if (lib.max_ref == 0.0) mg_fail(&r, "case error: the reference O is all zero");
  check_single_part_rows(&r, o_out, lse_out);
  {
    const double a = 4.0 * tu_unit_roundoff(c->dtype);
    tol = 2.0 * low.max_err + (a > 1e-5 ? a : 1e-5) * lib.max_ref;
    /* The parts feed the library and the yardstick alike: wrong parts would
     * fool the ratio, so the yardstick must itself be close to the whole.
     * The parts' fp32 LSEs are rounded to u |LSE| absolutely, which the
     * weights exp(LSE_p - LSE) turn into a relative error of that size: with
     * large logits that term dominates. */
    double lse_abs = 1.0;
    size_t l;
    for (l = 0; l < r.lse_n; ++l)
      if (isfinite(r.lse_ref[l]) && fabs(r.lse_ref[l]) > lse_abs) lse_abs = fabs(r.lse_ref[l]);
    if (!(low.max_err <= (64.0 * tu_unit_roundoff(c->dtype) + 8.0 * 0x1p-24 * lse_abs + 1e-5) *
                             lib.max_ref))
      mg_fail(&r, "case error: the fp32 merge of the parts is %.3g off the reference",
              low.max_err);
  }
  if (low.bad > 0 || !tu_err_ok(&lib, tol)) {
    tu_err_format(&lib, tol, line, sizeof line);
    mg_fail(&r, "%s (yardstick error %.3g, %zu bad)", line, low.max_err, low.bad);
  }
  printf("  %-30s %d parts: O %.2g/%.2g", c->name, r.nparts, lib.max_err, tol);

  /* LSE */
  if (lse_out != NULL) {
    tu_err_init(&lib, "LSE");
    tu_err_init(&low, "LSE");
    for (b = 0; b < c->batch; ++b)
      for (s = 0; s < c->lq; ++s)
        for (h = 0; h < c->heads; ++h) {
          const size_t l = lse_at(&r, b, s, h);
          tu_err_add(&lib, b, s, h, -1, lse_out[l], r.lse_ref[l]);
          tu_err_add(&low, b, s, h, -1, r.lse_lowp[l], r.lse_ref[l]);
        }
    tol = 2.0 * low.max_err + 1e-5 * (lib.max_ref > 1.0 ? lib.max_ref : 1.0);
    if (!(low.max_err <= 1e-4 * (lib.max_ref > 1.0 ? lib.max_ref : 1.0)))
      mg_fail(&r, "case error: the fp32 merge of the parts is %.3g off the reference LSE",
              low.max_err);
    if (low.bad > 0 || !tu_err_ok(&lib, tol)) {
      tu_err_format(&lib, tol, line, sizeof line);
      mg_fail(&r, "%s (yardstick error %.3g, %zu bad)", line, low.max_err, low.bad);
    }
    printf(" LSE %.2g/%.2g", lib.max_err, tol);
  }
  printf("\n");

  /* Nothing else written: not the gaps of O, not the parts (but part 0
   * when merging in place, whose gaps must keep their old values). */
  for (i = 0; i < r.nparts; ++i) {
    size_t e;
    if (c->in_place && i == 0) {
      for (e = 0; e < r.o_n; ++e)
        if (!r.in_o[e] && memcmp((const char *)o_ptrs[0] + e * es, saved[0] + e * es, es) != 0)
          mg_fail(&r, "the in-place merge wrote element %zu, outside O", e);
      continue;
    }
    if (memcmp(saved[i], o_ptrs[i], r.o_n * es) != 0 ||
        memcmp(saved[i] + r.o_n * es, lse_ptrs[i], r.lse_n * sizeof(float)) != 0)
      mg_fail(&r, "attn_merge_states changed input part %d", i);
  }
  if (!c->in_place) {
    size_t e;
    for (e = 0; e < r.o_n; ++e)
      if (!r.in_o[e] && !tu_is_poison(out.data, e, c->dtype))
        mg_fail(&r, "attn_merge_states wrote element %zu, outside O", e);
    if (c->no_lse_out)
      for (e = 0; e < r.lse_n; ++e)
        if (!tu_is_poison(lse_buf, e, ATTN_DTYPE_FP32))
          mg_fail(&r, "lse_out was NULL but the LSE buffer was written");
  }

  for (i = 0; i < r.nparts; ++i) free(saved[i]);
  free(saved), free(order), free(o_ptrs), free(lse_ptrs), free(lse_buf);
  tu_buffer_free(&out);
  teardown(&r);
}

/* All parts empty: O = 0 and LSE = -inf exactly, never NaN. */
static void test_all_parts_empty(void **state) {
  const attn_dtype_t dtypes[3] = {ATTN_DTYPE_FP32, ATTN_DTYPE_FP16, ATTN_DTYPE_BF16};
  const int64_t dims[3] = {2, 3, 5}, lse_dims[2] = {2, 3};
  tu_rng rng = tu_rng_for("merge/all_empty");
  attn_context_t ctx = NULL;
  attn_tensor_desc_t od = NULL, ld = NULL;
  int d, p, e;
  (void)state;
  assert_int_equal(attn_context_create(ATTN_BACKEND_CPU, 0, 2, &ctx), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_tensor_desc_create(&od), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_tensor_desc_create(&ld), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_tensor_desc_set(ld, ATTN_DTYPE_FP32, 2, lse_dims, NULL),
                   ATTN_STATUS_SUCCESS);
  for (d = 0; d < 3; ++d) {
    tu_buffer parts[3], out;
    float lse[3][6], lse_out[6];
    const void *o_ptrs[3];
    const float *lse_ptrs[3];
    assert_int_equal(attn_tensor_desc_set(od, dtypes[d], 3, dims, NULL), ATTN_STATUS_SUCCESS);
    for (p = 0; p < 3; ++p) {
      tu_buffer_alloc(&parts[p], dtypes[d], 30);
      tu_fill_uniform(&rng, &parts[p], -50.0, 50.0);
      for (e = 0; e < 6; ++e) lse[p][e] = -INFINITY;
      o_ptrs[p] = parts[p].data;
      lse_ptrs[p] = lse[p];
    }
    tu_buffer_alloc(&out, dtypes[d], 30);
    tu_poison(lse_out, ATTN_DTYPE_FP32, 6);
    assert_int_equal(attn_merge_states(ctx, 3, od, ld, o_ptrs, lse_ptrs, out.data, lse_out, NULL),
                     ATTN_STATUS_SUCCESS);
    for (e = 0; e < 30; ++e) assert_true(tu_load(out.data, (size_t)e, dtypes[d]) == 0.0);
    for (e = 0; e < 6; ++e) assert_true(lse_out[e] == -INFINITY);
    /* one part alone, in place */
    assert_int_equal(
        attn_merge_states(ctx, 1, od, ld, o_ptrs, lse_ptrs, parts[0].data, lse[0], NULL),
        ATTN_STATUS_SUCCESS);
    for (e = 0; e < 30; ++e) assert_true(tu_load(parts[0].data, (size_t)e, dtypes[d]) == 0.0);
    for (e = 0; e < 6; ++e) assert_true(lse[0][e] == -INFINITY);
    for (p = 0; p < 3; ++p) tu_buffer_free(&parts[p]);
    tu_buffer_free(&out);
  }
  attn_tensor_desc_destroy(od);
  attn_tensor_desc_destroy(ld);
  attn_context_destroy(ctx);
}

/* Non-finite inputs (attn.h): an empty part (LSE = -inf) contributes
 * nothing even where its O is NaN; a NaN LSE in any part, or in every part,
 * makes the row's O and LSE NaN (not the empty row's 0 and -inf). fp32, 3
 * parts, rows of 4: row 0 every LSE NaN, row 1 one NaN LSE among finite
 * ones, row 2 a NaN O in an empty part. */
static void test_nan_parts(void **state) {
  const int64_t dims[2] = {3, 4}, lse_dims[1] = {3};
  attn_context_t ctx = NULL;
  attn_tensor_desc_t od = NULL, ld = NULL;
  float o[3][12], lse[3][3], o_out[12], lse_out[3];
  const void *o_ptrs[3];
  const float *lse_ptrs[3];
  int p, c;
  (void)state;
  for (p = 0; p < 3; ++p) {
    for (c = 0; c < 12; ++c) o[p][c] = 0.25f * (float)(p + 1) + 0.125f * (float)c;
    lse[p][0] = NAN;
    lse[p][1] = p == 1 ? NAN : 0.5f * (float)p;
    lse[p][2] = p == 2 ? -INFINITY : 0.5f * (float)p;
    o_ptrs[p] = o[p];
    lse_ptrs[p] = lse[p];
  }
  o[2][8 + 1] = NAN; /* row 2 of the empty part */
  assert_int_equal(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_tensor_desc_create(&od), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_tensor_desc_create(&ld), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_tensor_desc_set(od, ATTN_DTYPE_FP32, 2, dims, NULL), ATTN_STATUS_SUCCESS);
  assert_int_equal(attn_tensor_desc_set(ld, ATTN_DTYPE_FP32, 1, lse_dims, NULL),
                   ATTN_STATUS_SUCCESS);
  tu_poison(o_out, ATTN_DTYPE_FP32, 12);
  tu_poison(lse_out, ATTN_DTYPE_FP32, 3);
  assert_int_equal(attn_merge_states(ctx, 3, od, ld, o_ptrs, lse_ptrs, o_out, lse_out, NULL),
                   ATTN_STATUS_SUCCESS);
  assert_true(isnan(lse_out[0]) && isnan(lse_out[1]));
  for (c = 0; c < 8; ++c) assert_true(isnan(o_out[c]));
  /* row 2: parts 0 and 1 with LSE 0 and 0.5 */
  assert_true(fabsf(lse_out[2] - (0.5f + logf(1.0f + expf(-0.5f)))) < 1e-6f);
  for (c = 0; c < 4; ++c) {
    const float w0 = 1.0f / (1.0f + expf(0.5f)), w1 = 1.0f - w0;
    assert_true(fabsf(o_out[8 + c] - (w0 * o[0][8 + c] + w1 * o[1][8 + c])) < 1e-5f);
  }
  attn_tensor_desc_destroy(od);
  attn_tensor_desc_destroy(ld);
  attn_context_destroy(ctx);
}

#define FP32 ATTN_DTYPE_FP32
#define FP16 ATTN_DTYPE_FP16
#define BF16 ATTN_DTYPE_BF16

#define SHAPE(b, h, lq_, lk_, d) .batch = (b), .heads = (h), .lq = (lq_), .lk = (lk_), .dim = (d)

static const mg_case kCases[] = {
    /* parts computed by the library over contiguous key ranges (2..5 unless given) */
    {.name = "library_parts_fp32", .dtype = FP32, SHAPE(2, 3, 37, 100, 24),
     .source = MG_LIBRARY, .threads = 1},
    {.name = "library_parts_fp16", .dtype = FP16, SHAPE(2, 3, 37, 100, 24),
     .source = MG_LIBRARY, .threads = 2},
    {.name = "library_parts_bf16_bhsd", .dtype = BF16, SHAPE(1, 2, 50, 120, 32), .parts = 5,
     .source = MG_LIBRARY, .layout = MG_BHSD, .threads = 1},
    {.name = "library_parts_padded_empty", .dtype = FP32, SHAPE(2, 2, 30, 80, 16), .parts = 3,
     .source = MG_LIBRARY, .empty_parts = 2, .layout = MG_BSHD_PADDED, .threads = 2},
    {.name = "library_parts_in_place", .dtype = FP16, SHAPE(1, 4, 40, 90, 16), .parts = 4,
     .source = MG_LIBRARY, .in_place = 1, .threads = 2},
    {.name = "library_parts_many_tiles", .dtype = FP32, SHAPE(1, 1, 200, 500, 16), .parts = 2,
     .source = MG_LIBRARY, .threads = 1},

    /* parts from the reference over random key subsets, with masks */
    {.name = "random_subsets_causal_fp32", .dtype = FP32, SHAPE(2, 2, 40, 60, 16),
     .source = MG_REFERENCE, .mask = ATTN_MASK_CAUSAL, .threads = 1},
    {.name = "random_subsets_causal_fp16", .dtype = FP16, SHAPE(1, 3, 40, 60, 16),
     .source = MG_REFERENCE, .mask = ATTN_MASK_CAUSAL, .layout = MG_BHSD, .threads = 2},
    {.name = "random_subsets_window_bf16", .dtype = BF16, SHAPE(2, 2, 50, 50, 16),
     .source = MG_REFERENCE, .mask = ATTN_MASK_WINDOW, .left = 3, .right = 2, .empty_parts = 1,
     .layout = MG_BSHD_PADDED, .threads = 1},
    {.name = "random_subsets_empty_rows", .dtype = FP32, SHAPE(1, 2, 60, 30, 8), .parts = 3,
     .source = MG_REFERENCE, .mask = ATTN_MASK_CAUSAL, .empty_parts = 1, .threads = 2},
    {.name = "random_subsets_in_place_bf16", .dtype = BF16, SHAPE(1, 2, 30, 40, 16), .parts = 4,
     .source = MG_REFERENCE, .empty_parts = 1, .in_place = 1, .threads = 1},
    {.name = "random_subsets_no_lse_out", .dtype = FP16, SHAPE(1, 2, 30, 40, 16), .parts = 3,
     .source = MG_REFERENCE, .no_lse_out = 1, .threads = 2},
    {.name = "one_part", .dtype = FP32, SHAPE(1, 2, 20, 30, 8), .parts = 1,
     .source = MG_REFERENCE, .threads = 1},

    /* empty parts are the identity: one real part among empty ones */
    {.name = "one_part_among_empty_fp16", .dtype = FP16, SHAPE(2, 2, 20, 30, 8), .parts = 1,
     .source = MG_LIBRARY, .empty_parts = 3, .threads = 2},
    {.name = "one_part_among_empty_in_place", .dtype = BF16, SHAPE(1, 2, 20, 30, 8), .parts = 1,
     .source = MG_REFERENCE, .mask = ATTN_MASK_CAUSAL, .empty_parts = 2, .in_place = 1,
     .layout = MG_BHSD, .threads = 1},

    /* more parts than the library keeps weights for on its stack (64) */
    {.name = "seventy_parts", .dtype = FP32, SHAPE(1, 2, 30, 150, 8), .parts = 70,
     .source = MG_REFERENCE, .mask = ATTN_MASK_CAUSAL, .threads = 2},
    {.name = "seventy_parts_in_place_fp16", .dtype = FP16, SHAPE(1, 1, 20, 100, 8), .parts = 66,
     .source = MG_REFERENCE, .empty_parts = 4, .in_place = 1, .threads = 1},

    /* large logits: part LSEs far apart, weights underflow */
    {.name = "large_logits_fp32", .dtype = FP32, SHAPE(1, 2, 40, 80, 32), .parts = 4,
     .source = MG_REFERENCE, .scale = 8.0, .qk_sd = 2.0, .threads = 2},
    {.name = "large_logits_bf16", .dtype = BF16, SHAPE(1, 2, 40, 80, 32), .source = MG_LIBRARY,
     .scale = 8.0, .qk_sd = 2.0, .threads = 1},
};

int main(void) {
  enum { N = sizeof kCases / sizeof kCases[0] };
  struct CMUnitTest tests[N + 2];
  size_t i;
  tu_seed();
  for (i = 0; i < N; ++i) {
    memset(&tests[i], 0, sizeof tests[i]);
    tests[i].name = kCases[i].name;
    tests[i].test_func = run_merge;
    tests[i].initial_state = (void *)&kCases[i];
  }
  memset(&tests[N], 0, sizeof tests[N]);
  tests[N].name = "all_parts_empty";
  tests[N].test_func = test_all_parts_empty;
  memset(&tests[N + 1], 0, sizeof tests[N + 1]);
  tests[N + 1].name = "nan_parts";
  tests[N + 1].test_func = test_nan_parts;
  return _cmocka_run_group_tests("merge", tests, N + 2, NULL, NULL);
}
