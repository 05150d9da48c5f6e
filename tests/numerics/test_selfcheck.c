/*
 * Checks of the test machinery itself, so that the library is judged by
 * something trustworthy:
 *   - fp16 / bf16 conversions: known values, round trips of every bit
 *     pattern, and round-to-nearest-even against a brute-force neighbour
 *     search;
 *   - the mask predicate against the picture in attn.h;
 *   - the fp64 reference: LSE and O on inputs with known answers, and its
 *     gradients against central finite differences in double (relative
 *     error 1e-6), with softcap, masks, GQA, varlen and strides;
 *   - the same-precision yardstick: close to the reference in fp32.
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

/* ------------------------------------------------------------------------ */
/* Conversions                                                               */
/* ------------------------------------------------------------------------ */

static void test_fp16_known_values(void **state) {
  (void)state;
  assert_int_equal(tu_float_to_fp16(1.0f), 0x3c00);
  assert_int_equal(tu_float_to_fp16(-2.0f), 0xc000);
  assert_int_equal(tu_float_to_fp16(65504.0f), 0x7bff);          /* largest finite */
  assert_int_equal(tu_float_to_fp16(65519.0f), 0x7bff);          /* below the midpoint */
  assert_int_equal(tu_float_to_fp16(65520.0f), 0x7c00);          /* midpoint: to even = inf */
  assert_int_equal(tu_float_to_fp16(1e30f), 0x7c00);
  assert_int_equal(tu_float_to_fp16(-INFINITY), 0xfc00);
  assert_int_equal(tu_float_to_fp16(ldexpf(1.0f, -14)), 0x0400); /* smallest normal */
  assert_int_equal(tu_float_to_fp16(ldexpf(1.0f, -24)), 0x0001); /* smallest subnormal */
  assert_int_equal(tu_float_to_fp16(ldexpf(1.0f, -25)), 0x0000); /* tie: to even (0) */
  assert_int_equal(tu_float_to_fp16(ldexpf(3.0f, -25)), 0x0002); /* tie: to even (2) */
  assert_int_equal(tu_float_to_fp16(ldexpf(1.5f, -25)), 0x0001);
  assert_int_equal(tu_float_to_fp16(ldexpf(1023.0f, -24)), 0x03ff);
  assert_int_equal(tu_float_to_fp16(ldexpf(2047.0f, -25)), 0x0400); /* rounds up into normals */
  assert_int_equal(tu_float_to_fp16(1.0f + ldexpf(1.0f, -11)), 0x3c00);     /* tie, even */
  assert_int_equal(tu_float_to_fp16(1.0f + 3 * ldexpf(1.0f, -11)), 0x3c02); /* tie, even */
  assert_int_equal(tu_float_to_fp16(1.0f + ldexpf(1.0f, -11) + ldexpf(1.0f, -20)), 0x3c01);
  assert_int_equal(tu_float_to_fp16(ldexpf(1.0f, -40)), 0x0000);
  assert_int_equal(tu_float_to_fp16(-ldexpf(1.0f, -40)), 0x8000);
  assert_true(isnan(tu_fp16_to_float(tu_float_to_fp16(NAN))));
  assert_true(tu_fp16_to_float(0x3555) == 0x1.554p-2f);
  assert_true(tu_fp16_to_float(0x0001) == ldexpf(1.0f, -24));
  assert_true(tu_fp16_to_float(0xfbff) == -65504.0f);
}

static void test_bf16_known_values(void **state) {
  (void)state;
  assert_int_equal(tu_float_to_bf16(1.0f), 0x3f80);
  assert_int_equal(tu_float_to_bf16(-2.0f), 0xc000);
  assert_int_equal(tu_float_to_bf16(1.0f + ldexpf(1.0f, -8)), 0x3f80);     /* tie, even */
  assert_int_equal(tu_float_to_bf16(1.0f + 3 * ldexpf(1.0f, -8)), 0x3f82); /* tie, even */
  assert_int_equal(tu_float_to_bf16(1.0f + ldexpf(1.0f, -8) + ldexpf(1.0f, -20)), 0x3f81);
  assert_int_equal(tu_float_to_bf16(3.4028235e38f), 0x7f80); /* FLT_MAX rounds to inf */
  assert_int_equal(tu_float_to_bf16(INFINITY), 0x7f80);
  assert_int_equal(tu_float_to_bf16(ldexpf(1.0f, -133)), 0x0001); /* smallest subnormal */
  assert_int_equal(tu_float_to_bf16(ldexpf(1.0f, -134)), 0x0000); /* tie: to even (0) */
  assert_int_equal(tu_float_to_bf16(ldexpf(3.0f, -134)), 0x0002); /* tie: to even (2) */
  assert_true(isnan(tu_bf16_to_float(tu_float_to_bf16(NAN))));
  assert_true(tu_bf16_to_float(0x4049) == 3.140625f);
}

/* Every non-NaN bit pattern survives the round trip; NaNs stay NaN. */
static void test_round_trips(void **state) {
  uint32_t h;
  (void)state;
  for (h = 0; h < 0x10000u; ++h) {
    const float f16 = tu_fp16_to_float((uint16_t)h), fb = tu_bf16_to_float((uint16_t)h);
    if (isnan(f16))
      assert_true(isnan(tu_fp16_to_float(tu_float_to_fp16(f16))));
    else
      assert_int_equal(tu_float_to_fp16(f16), h);
    if (isnan(fb))
      assert_true(isnan(tu_bf16_to_float(tu_float_to_bf16(fb))));
    else
      assert_int_equal(tu_float_to_bf16(fb), h);
  }
}

/* For random positive floats: the conversion is the nearest representable
 * value, and on a tie the one with an even mantissa. The neighbours are the
 * adjacent bit patterns. */
static void check_nearest(float x, uint16_t h, float (*to_float)(uint16_t), float max_finite) {
  const double err = fabs((double)x - (double)to_float(h));
  if ((double)x > max_finite) return; /* the overflow region has its known values */
  if (h > 0) {
    const double down = fabs((double)x - (double)to_float((uint16_t)(h - 1)));
    assert_true(err <= down);
    if (err == down) assert_true((h & 1u) == 0);
  }
  if (isfinite(to_float((uint16_t)(h + 1)))) {
    const double up = fabs((double)x - (double)to_float((uint16_t)(h + 1)));
    assert_true(err <= up);
    if (err == up) assert_true((h & 1u) == 0);
  }
}

static void test_round_to_nearest_even(void **state) {
  tu_rng rng = tu_rng_for("selfcheck/round");
  int i;
  (void)state;
  for (i = 0; i < 200000; ++i) {
    /* magnitudes over the whole fp16 range, subnormals included */
    const float x = (float)ldexp(tu_rng_uniform(&rng, 1.0, 2.0), (int)tu_rng_int(&rng, -26, 15));
    const uint16_t h = tu_float_to_fp16(x);
    check_nearest(x, h, tu_fp16_to_float, 65504.0f);
    check_nearest(x, tu_float_to_bf16(x), tu_bf16_to_float, 3.0e38f);
    /* the exact midpoint between two fp16 neighbours: a tie */
    if (h < 0x7bff) {
      const float mid = (float)(0.5 * ((double)tu_fp16_to_float(h) +
                                       (double)tu_fp16_to_float((uint16_t)(h + 1))));
      check_nearest(mid, tu_float_to_fp16(mid), tu_fp16_to_float, 65504.0f);
    }
  }
}

static void test_poison(void **state) {
  float f[3];
  uint16_t h[3];
  (void)state;
  tu_poison(f, ATTN_DTYPE_FP32, 3);
  tu_poison(h, ATTN_DTYPE_FP16, 3);
  assert_true(isnan(f[1]) && tu_is_poison(f, 2, ATTN_DTYPE_FP32));
  assert_true(isnan(tu_fp16_to_float(h[0])) && isnan(tu_bf16_to_float(h[0])));
  f[1] = 0.0f;
  assert_false(tu_is_poison(f, 1, ATTN_DTYPE_FP32));
}

/* ------------------------------------------------------------------------ */
/* Mask                                                                      */
/* ------------------------------------------------------------------------ */

static void test_mask_picture(void **state) {
  /* attn.h: Lq = 3, Lk = 5, window left = 1, right = 0 */
  static const char *const picture[3] = {".xx..", "..xx.", "...xx"};
  int64_t i, j;
  (void)state;
  for (i = 0; i < 3; ++i)
    for (j = 0; j < 5; ++j)
      assert_int_equal(ref_mask_visible(3, 5, 1, 0, i, j), picture[i][j] == 'x');
  /* causal with Lq > Lk: the first Lq - Lk rows see nothing, then the
   * lower-right triangle */
  for (i = 0; i < 7; ++i)
    for (j = 0; j < 4; ++j) assert_int_equal(ref_mask_visible(7, 4, -1, 0, i, j), j <= i - 3);
  /* unbounded both ways: everything */
  assert_true(ref_mask_visible(2, 9, -1, -1, 0, 8));
  assert_false(ref_mask_visible(2, 9, -1, -1, 0, 9));
  /* right reach past the aligned diagonal */
  assert_true(ref_mask_visible(4, 4, 0, 2, 1, 3));
  assert_false(ref_mask_visible(4, 4, 0, 2, 1, 4));
  assert_false(ref_mask_visible(4, 4, 0, 2, 1, 0));
}

/* ------------------------------------------------------------------------ */
/* The fp64 reference                                                        */
/* ------------------------------------------------------------------------ */

/* A tiny problem in BSHD (or THD for varlen) with optional padding. */
typedef struct tiny {
  const char *name;
  int64_t batch, hq, hkv, dqk, dv;
  const int64_t *cu_q, *cu_kv;
  int varlen;
  double scale, softcap;
  int64_t left, right;
  int64_t pad; /* added to every head and sequence stride */
} tiny;

typedef struct tiny_run {
  ref_problem p;
  double *q, *k, *v, *o, *d_o, *dq, *dk, *dv, *lse;
  size_t nq, nk, nv, no;
} tiny_run;

static void strides_for(const tiny *t, int q_side, int64_t dim, ref_strides *s) {
  const int64_t heads = q_side ? t->hq : t->hkv;
  const int64_t len = q_side ? t->cu_q[1] - t->cu_q[0] : t->cu_kv[1] - t->cu_kv[0];
  s->head = dim + t->pad;
  s->seq = heads * s->head + t->pad;
  s->batch = t->varlen ? 0 : len * s->seq + t->pad;
}

static size_t extent(const tiny *t, int q_side, const ref_strides *s) {
  const int64_t tokens = q_side ? t->cu_q[t->batch] : t->cu_kv[t->batch];
  /* (token count) * seq covers both layouts; a little slack is harmless */
  return (size_t)((tokens + t->batch) * s->seq + s->batch * t->batch + 8);
}

static double *alloc_fill(tu_rng *rng, size_t n) {
  double *a = (double *)malloc(n * sizeof(double));
  size_t i;
  for (i = 0; i < n; ++i) a[i] = tu_rng_normal(rng, 0.0, 1.0);
  return a;
}

static void tiny_setup(const tiny *t, tu_rng *rng, tiny_run *r) {
  memset(r, 0, sizeof *r);
  r->p.batch = t->batch;
  r->p.heads_q = t->hq;
  r->p.heads_kv = t->hkv;
  r->p.head_dim_qk = t->dqk;
  r->p.head_dim_v = t->dv;
  r->p.cu_q = t->cu_q;
  r->p.cu_kv = t->cu_kv;
  r->p.varlen = t->varlen;
  r->p.scale = t->scale;
  r->p.softcap = t->softcap;
  r->p.window_left = t->left;
  r->p.window_right = t->right;
  strides_for(t, 1, t->dqk, &r->p.q);
  strides_for(t, 0, t->dqk, &r->p.k);
  strides_for(t, 0, t->dv, &r->p.v);
  strides_for(t, 1, t->dv, &r->p.o);
  r->p.d_o = r->p.o;
  r->p.dq = r->p.q;
  r->p.dk = r->p.k;
  r->p.dv = r->p.v;
  r->nq = extent(t, 1, &r->p.q);
  r->nk = extent(t, 0, &r->p.k);
  r->nv = extent(t, 0, &r->p.v);
  r->no = extent(t, 1, &r->p.o);
  r->q = alloc_fill(rng, r->nq);
  r->k = alloc_fill(rng, r->nk);
  r->v = alloc_fill(rng, r->nv);
  r->d_o = alloc_fill(rng, r->no);
  r->o = alloc_fill(rng, r->no);
  r->dq = alloc_fill(rng, r->nq);
  r->dk = alloc_fill(rng, r->nk);
  r->dv = alloc_fill(rng, r->nv);
  r->lse = alloc_fill(rng, ref_lse_count(&r->p) + 1);
}

static void tiny_free(tiny_run *r) {
  free(r->q), free(r->k), free(r->v), free(r->o), free(r->d_o);
  free(r->dq), free(r->dk), free(r->dv), free(r->lse);
}

/* loss = sum over valid O elements of O * G (G = d_o). */
static double tiny_loss(tiny_run *r) {
  int64_t b, s, h, c;
  double loss = 0.0;
  ref_forward(&r->p, r->q, r->k, r->v, r->o, NULL);
  for (b = 0; b < r->p.batch; ++b)
    for (s = 0; s < ref_lq(&r->p, b); ++s)
      for (h = 0; h < r->p.heads_q; ++h)
        for (c = 0; c < r->p.head_dim_v; ++c) {
          const int64_t e = ref_offset(&r->p, &r->p.o, 1, b, s, h) + c;
          loss += r->o[e] * r->d_o[e];
        }
  return loss;
}

/* Central differences of the loss against one input tensor, compared with
 * the analytic gradient at the tensor's elements. */
static void fd_check(const tiny *t, tiny_run *r, double *x, const double *grad,
                     const ref_strides *st, int q_side, int64_t heads, int64_t dim,
                     const char *what) {
  const double eps = 1e-5;
  double max_grad = 0.0, max_err = 0.0;
  int64_t b, s, h, c, n = 0;
  for (b = 0; b < r->p.batch; ++b) {
    const int64_t len = q_side ? ref_lq(&r->p, b) : ref_lk(&r->p, b);
    for (s = 0; s < len; ++s)
      for (h = 0; h < heads; ++h)
        for (c = 0; c < dim; ++c) {
          const int64_t e = ref_offset(&r->p, st, q_side, b, s, h) + c;
          const double saved = x[e];
          double up, down, fd;
          x[e] = saved + eps;
          up = tiny_loss(r);
          x[e] = saved - eps;
          down = tiny_loss(r);
          x[e] = saved;
          fd = (up - down) / (2.0 * eps);
          if (fabs(grad[e]) > max_grad) max_grad = fabs(grad[e]);
          if (fabs(fd - grad[e]) > max_err) max_err = fabs(fd - grad[e]);
          ++n;
        }
  }
  if (n > 0 && !(max_err <= 1e-6 * max_grad + 1e-12)) {
    print_error("reference %s, case %s: finite differences differ by %.3g (max |grad| %.3g)\n",
                what, t->name, max_err, max_grad);
    fail();
  }
}

static void run_tiny_gradcheck(const tiny *t) {
  tu_rng rng = tu_rng_for(t->name);
  tiny_run r;
  tiny_setup(t, &rng, &r);
  ref_backward(&r.p, r.q, r.k, r.v, r.d_o, r.dq, r.dk, r.dv);
  fd_check(t, &r, r.q, r.dq, &r.p.q, 1, t->hq, t->dqk, "dQ");
  fd_check(t, &r, r.k, r.dk, &r.p.k, 0, t->hkv, t->dqk, "dK");
  fd_check(t, &r, r.v, r.dv, &r.p.v, 0, t->hkv, t->dv, "dV");
  tiny_free(&r);
}

static const int64_t kCu4[] = {0, 4};
static const int64_t kCu6[] = {0, 6};
static const int64_t kCu3x2[] = {0, 3, 6};
static const int64_t kCuVarQ[] = {0, 3, 3, 7, 8};  /* lengths 3, 0, 4, 1 */
static const int64_t kCuVarK[] = {0, 5, 7, 7, 10}; /* lengths 5, 2, 0, 3 */

static const tiny kTiny[] = {
    {.name = "plain", .batch = 1, .hq = 2, .hkv = 2, .dqk = 3, .dv = 4, .cu_q = kCu4, .cu_kv = kCu6,
     .scale = 0.5, .left = -1, .right = -1},
    {.name = "causal_more_queries", .batch = 1, .hq = 2, .hkv = 1, .dqk = 4, .dv = 3, .cu_q = kCu6,
     .cu_kv = kCu4, .scale = 0.7, .left = -1, .right = 0},
    {.name = "window_1_1", .batch = 2, .hq = 2, .hkv = 2, .dqk = 3, .dv = 3, .cu_q = kCu3x2,
     .cu_kv = kCu3x2, .scale = 0.6, .left = 1, .right = 1},
    {.name = "softcap", .batch = 1, .hq = 2, .hkv = 2, .dqk = 4, .dv = 2, .cu_q = kCu4,
     .cu_kv = kCu6, .scale = 1.3, .softcap = 1.5, .left = -1, .right = -1},
    {.name = "softcap_causal_gqa", .batch = 1, .hq = 4, .hkv = 2, .dqk = 3, .dv = 3, .cu_q = kCu4,
     .cu_kv = kCu6, .scale = 0.9, .softcap = 2.0, .left = -1, .right = 0},
    {.name = "varlen_empty_padded", .batch = 4, .hq = 2, .hkv = 1, .dqk = 3, .dv = 5,
     .cu_q = kCuVarQ, .cu_kv = kCuVarK, .varlen = 1, .scale = 0.5, .left = 2, .right = 0, .pad = 3},
    {.name = "padded_window", .batch = 1, .hq = 2, .hkv = 2, .dqk = 2, .dv = 3, .cu_q = kCu6,
     .cu_kv = kCu6, .scale = 0.8, .softcap = 3.0, .left = 0, .right = 2, .pad = 2},
};

static void test_reference_gradients(void **state) {
  size_t i;
  (void)state;
  for (i = 0; i < sizeof kTiny / sizeof kTiny[0]; ++i) run_tiny_gradcheck(&kTiny[i]);
}

/* Known answers: with Q = 0 every visible logit is 0 (softcap or not), so
 * LSE = log(number of visible keys) and O is the mean of the visible V rows;
 * rows that see nothing give O = 0 and LSE = -inf. */
static void test_reference_known_answers(void **state) {
  const tiny t = {.name = "known", .batch = 4, .hq = 2, .hkv = 1, .dqk = 3, .dv = 2,
                  .cu_q = kCuVarQ, .cu_kv = kCuVarK, .varlen = 1, .scale = 0.5, .softcap = 2.0,
                  .left = 1, .right = 0, .pad = 1};
  tu_rng rng = tu_rng_for("selfcheck/known");
  tiny_run r;
  int64_t b, i, j, h, c;
  (void)state;
  tiny_setup(&t, &rng, &r);
  memset(r.q, 0, r.nq * sizeof(double));
  ref_forward(&r.p, r.q, r.k, r.v, r.o, r.lse);
  for (b = 0; b < r.p.batch; ++b)
    for (i = 0; i < ref_lq(&r.p, b); ++i)
      for (h = 0; h < r.p.heads_q; ++h) {
        int64_t seen = 0;
        double mean[2] = {0.0, 0.0};
        const double lse = r.lse[ref_lse_index(&r.p, b, h, i)];
        const double *o = r.o + ref_offset(&r.p, &r.p.o, 1, b, i, h);
        for (j = 0; j < ref_lk(&r.p, b); ++j) {
          if (!ref_mask_visible(ref_lq(&r.p, b), ref_lk(&r.p, b), 1, 0, i, j)) continue;
          ++seen;
          for (c = 0; c < 2; ++c) mean[c] += r.v[ref_offset(&r.p, &r.p.v, 0, b, j, 0) + c];
        }
        if (seen == 0) {
          assert_true(lse == -INFINITY);
          assert_true(o[0] == 0.0 && o[1] == 0.0);
          continue;
        }
        assert_true(fabs(lse - log((double)seen)) < 1e-14);
        for (c = 0; c < 2; ++c) assert_true(fabs(o[c] - mean[c] / (double)seen) < 1e-14);
      }
  tiny_free(&r);
}

/* A key filter removes keys: the same as a problem without them. */
static void test_reference_key_filter(void **state) {
  static const int64_t cu_q[] = {0, 3}, cu_k5[] = {0, 5}, cu_k3[] = {0, 3};
  const unsigned char keep[5] = {1, 0, 1, 0, 1};
  const tiny t = {.name = "filter", .batch = 1, .hq = 1, .hkv = 1, .dqk = 4, .dv = 3, .cu_q = cu_q,
                  .cu_kv = cu_k5, .scale = 0.5, .left = -1, .right = -1};
  tu_rng rng = tu_rng_for("selfcheck/filter");
  tiny_run r;
  ref_problem sub;
  double ksub[3 * 4], vsub[3 * 3], osub[3 * 3], lse_sub[3];
  int64_t j, n = 0, c;
  (void)state;
  tiny_setup(&t, &rng, &r);
  for (j = 0; j < 5; ++j) {
    if (!keep[j]) continue;
    for (c = 0; c < 4; ++c) ksub[n * 4 + c] = r.k[ref_offset(&r.p, &r.p.k, 0, 0, j, 0) + c];
    for (c = 0; c < 3; ++c) vsub[n * 3 + c] = r.v[ref_offset(&r.p, &r.p.v, 0, 0, j, 0) + c];
    ++n;
  }
  sub = r.p;
  sub.cu_kv = cu_k3;
  sub.k.seq = 4, sub.k.head = 4, sub.k.batch = 12;
  sub.v.seq = 3, sub.v.head = 3, sub.v.batch = 9;
  sub.o.seq = 3, sub.o.head = 3, sub.o.batch = 9;
  ref_forward(&sub, r.q, ksub, vsub, osub, lse_sub);
  r.p.key_filter = keep;
  ref_forward(&r.p, r.q, r.k, r.v, r.o, r.lse);
  for (j = 0; j < 3; ++j) {
    assert_true(fabs(r.lse[j] - lse_sub[j]) < 1e-14);
    for (c = 0; c < 3; ++c)
      assert_true(fabs(r.o[ref_offset(&r.p, &r.p.o, 1, 0, j, 0) + c] - osub[j * 3 + c]) < 1e-14);
  }
  tiny_free(&r);
}

/* The yardstick computes the same function: close to the reference in fp32
 * and, more loosely, in fp16; and its rounding is visible (it is not the
 * reference in disguise). */
static void test_lowp_matches(void **state) {
  const tiny t = {.name = "lowp", .batch = 4, .hq = 2, .hkv = 1, .dqk = 3, .dv = 5,
                  .cu_q = kCuVarQ, .cu_kv = kCuVarK, .varlen = 1, .scale = 0.5, .softcap = 4.0,
                  .left = 2, .right = 0, .pad = 1};
  const attn_dtype_t dtypes[3] = {ATTN_DTYPE_FP32, ATTN_DTYPE_FP16, ATTN_DTYPE_BF16};
  const double tol[3] = {1e-5, 2e-2, 1e-1};
  tu_rng rng = tu_rng_for("selfcheck/lowp");
  tiny_run r;
  double *o_low, *dq_low, *dk_low, *dv_low, *lse_low;
  int d;
  size_t e;
  (void)state;
  tiny_setup(&t, &rng, &r);
  o_low = alloc_fill(&rng, r.no);
  dq_low = alloc_fill(&rng, r.nq);
  dk_low = alloc_fill(&rng, r.nk);
  dv_low = alloc_fill(&rng, r.nv);
  lse_low = alloc_fill(&rng, ref_lse_count(&r.p) + 1);
  /* round the inputs to bf16 so that all three dtypes see the same values */
  for (e = 0; e < r.nq; ++e) r.q[e] = tu_round_float((float)r.q[e], ATTN_DTYPE_BF16);
  for (e = 0; e < r.nk; ++e) r.k[e] = tu_round_float((float)r.k[e], ATTN_DTYPE_BF16);
  for (e = 0; e < r.nv; ++e) r.v[e] = tu_round_float((float)r.v[e], ATTN_DTYPE_BF16);
  for (e = 0; e < r.no; ++e) r.d_o[e] = tu_round_float((float)r.d_o[e], ATTN_DTYPE_BF16);
  ref_forward(&r.p, r.q, r.k, r.v, r.o, r.lse);
  ref_backward(&r.p, r.q, r.k, r.v, r.d_o, r.dq, r.dk, r.dv);
  for (d = 0; d < 3; ++d) {
    double err = 0.0, lse_err = 0.0, g_err = 0.0;
    int64_t b, s, h, c;
    ref_lowp_forward(&r.p, dtypes[d], r.q, r.k, r.v, o_low, lse_low);
    ref_lowp_backward(&r.p, dtypes[d], r.q, r.k, r.v, r.d_o, dq_low, dk_low, dv_low);
    for (b = 0; b < r.p.batch; ++b)
      for (s = 0; s < ref_lq(&r.p, b); ++s)
        for (h = 0; h < r.p.heads_q; ++h) {
          const double l = r.lse[ref_lse_index(&r.p, b, h, s)];
          const double ll = lse_low[ref_lse_index(&r.p, b, h, s)];
          if (l == -INFINITY)
            assert_true(ll == -INFINITY);
          else if (fabs(l - ll) > lse_err)
            lse_err = fabs(l - ll);
          for (c = 0; c < t.dv; ++c) {
            const int64_t i = ref_offset(&r.p, &r.p.o, 1, b, s, h) + c;
            if (fabs(r.o[i] - o_low[i]) > err) err = fabs(r.o[i] - o_low[i]);
          }
          for (c = 0; c < t.dqk; ++c) {
            const int64_t i = ref_offset(&r.p, &r.p.q, 1, b, s, h) + c;
            if (fabs(r.dq[i] - dq_low[i]) > g_err) g_err = fabs(r.dq[i] - dq_low[i]);
          }
        }
    for (b = 0; b < r.p.batch; ++b)
      for (s = 0; s < ref_lk(&r.p, b); ++s) {
        for (c = 0; c < t.dqk; ++c) {
          const int64_t i = ref_offset(&r.p, &r.p.k, 0, b, s, 0) + c;
          if (fabs(r.dk[i] - dk_low[i]) > g_err) g_err = fabs(r.dk[i] - dk_low[i]);
        }
        for (c = 0; c < t.dv; ++c) {
          const int64_t i = ref_offset(&r.p, &r.p.v, 0, b, s, 0) + c;
          if (fabs(r.dv[i] - dv_low[i]) > g_err) g_err = fabs(r.dv[i] - dv_low[i]);
        }
      }
    if (!(err < tol[d] && lse_err < tol[d] && g_err < 4 * tol[d])) {
      print_error("yardstick %s: O err %.3g, LSE err %.3g, grad err %.3g (tol %.3g)\n",
                  tu_dtype_name(dtypes[d]), err, lse_err, g_err, tol[d]);
      fail();
    }
    if (d > 0) assert_true(err > 0.0 && g_err > 0.0);
  }
  free(o_low), free(dq_low), free(dk_low), free(dv_low), free(lse_low);
  tiny_free(&r);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fp16_known_values),
      cmocka_unit_test(test_bf16_known_values),
      cmocka_unit_test(test_round_trips),
      cmocka_unit_test(test_round_to_nearest_even),
      cmocka_unit_test(test_poison),
      cmocka_unit_test(test_mask_picture),
      cmocka_unit_test(test_reference_known_answers),
      cmocka_unit_test(test_reference_key_filter),
      cmocka_unit_test(test_reference_gradients),
      cmocka_unit_test(test_lowp_matches),
  };
  tu_seed();
  return cmocka_run_group_tests_name("selfcheck", tests, NULL, NULL);
}
