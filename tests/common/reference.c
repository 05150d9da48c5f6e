/* See reference.h. */
#include "reference.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* ------------------------------------------------------------------------ */
/* Geometry                                                                  */
/* ------------------------------------------------------------------------ */

int64_t ref_lq(const ref_problem *p, int64_t b) { return p->cu_q[b + 1] - p->cu_q[b]; }
int64_t ref_lk(const ref_problem *p, int64_t b) { return p->cu_kv[b + 1] - p->cu_kv[b]; }

int ref_mask_visible(int64_t lq, int64_t lk, int64_t left, int64_t right, int64_t i, int64_t j) {
  const int64_t diag = i + (lk - lq); /* the key aligned with query i */
  if (i < 0 || i >= lq || j < 0 || j >= lk) return 0;
  /* compared as distances to the diagonal, which are small: any reach,
   * INT64_MAX included, is exact without overflow */
  if (left >= 0 && diag - j > left) return 0;
  if (right >= 0 && j - diag > right) return 0;
  return 1;
}

int ref_visible(const ref_problem *p, int64_t b, int64_t i, int64_t j) {
  if (!ref_mask_visible(ref_lq(p, b), ref_lk(p, b), p->window_left, p->window_right, i, j))
    return 0;
  return p->key_filter == NULL || p->key_filter[p->cu_kv[b] + j] != 0;
}

int ref_row_sees_any(const ref_problem *p, int64_t b, int64_t i) {
  int64_t j;
  for (j = 0; j < ref_lk(p, b); ++j)
    if (ref_visible(p, b, i, j)) return 1;
  return 0;
}

int ref_key_seen(const ref_problem *p, int64_t b, int64_t j) {
  int64_t i;
  for (i = 0; i < ref_lq(p, b); ++i)
    if (ref_visible(p, b, i, j)) return 1;
  return 0;
}

int64_t ref_offset(const ref_problem *p, const ref_strides *t, int q_side, int64_t b, int64_t s,
                   int64_t h) {
  const int64_t base =
      p->varlen ? (q_side ? p->cu_q[b] : p->cu_kv[b]) * t->seq : b * t->batch;
  return base + s * t->seq + h * t->head;
}

int64_t ref_lse_index(const ref_problem *p, int64_t b, int64_t h, int64_t s) {
  if (p->varlen) return h * p->cu_q[p->batch] + p->cu_q[b] + s;
  return (b * p->heads_q + h) * ref_lq(p, 0) + s;
}

size_t ref_lse_count(const ref_problem *p) {
  /* the same for both layouts: every query token of every head */
  return (size_t)(p->heads_q * p->cu_q[p->batch]);
}

static void *ref_alloc(size_t bytes) {
  void *ptr = calloc(bytes == 0 ? 1 : bytes, 1);
  if (ptr == NULL) {
    fprintf(stderr, "reference: out of memory (%zu bytes)\n", bytes);
    abort();
  }
  return ptr;
}

static int64_t max_lq(const ref_problem *p) {
  int64_t b, m = 0;
  for (b = 0; b < p->batch; ++b)
    if (ref_lq(p, b) > m) m = ref_lq(p, b);
  return m;
}

static int64_t max_lk(const ref_problem *p) {
  int64_t b, m = 0;
  for (b = 0; b < p->batch; ++b)
    if (ref_lk(p, b) > m) m = ref_lk(p, b);
  return m;
}

static int64_t group_size(const ref_problem *p) { return p->heads_q / p->heads_kv; }

int ref_visible_head(const ref_problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
  int64_t mb, mh, rows, cols;
  if (!ref_visible(p, b, i, j)) return 0;
  if (p->pair_mask == NULL) return 1;
  mb = p->pair_mask_batch == 1 ? 0 : b;
  mh = p->pair_mask_heads == 1 ? 0 : p->pair_mask_heads == p->heads_q ? h : h / group_size(p);
  rows = p->pair_mask_rows > 0 ? p->pair_mask_rows : ref_lq(p, b);
  cols = p->pair_mask_cols > 0 ? p->pair_mask_cols : ref_lk(p, b);
  return p->pair_mask[((mb * p->pair_mask_heads + mh) * rows + i) * cols + j] != 0;
}

int ref_row_sees_any_head(const ref_problem *p, int64_t b, int64_t h, int64_t i) {
  int64_t j;
  for (j = 0; j < ref_lk(p, b); ++j)
    if (ref_visible_head(p, b, h, i, j)) return 1;
  return 0;
}

int ref_key_seen_head(const ref_problem *p, int64_t b, int64_t hk, int64_t j) {
  int64_t h, i;
  for (h = hk * group_size(p); h < (hk + 1) * group_size(p); ++h)
    for (i = 0; i < ref_lq(p, b); ++i)
      if (ref_visible_head(p, b, h, i, j)) return 1;
  return 0;
}

void ref_moba_select(const ref_problem *p, const double *q, const double *k, int64_t block,
                     int64_t top_k, int shared, unsigned char *pair) {
  const int64_t rows = max_lq(p), cols = max_lk(p), nb_max = (cols + block - 1) / block;
  const int64_t dqk = p->head_dim_qk, group = group_size(p);
  double *mean = (double *)ref_alloc(sizeof(double) * (size_t)(p->heads_kv * nb_max * dqk));
  double *gate = (double *)ref_alloc(sizeof(double) * (size_t)(nb_max > 0 ? nb_max : 1));
  unsigned char *taken = (unsigned char *)ref_alloc((size_t)(nb_max > 0 ? nb_max : 1));
  int64_t b, h, hk, kb, j, c, i, t, hh;
  memset(pair, 0, (size_t)(p->batch * p->heads_q) * (size_t)rows * (size_t)cols);
  for (b = 0; b < p->batch; ++b) {
    const int64_t lq = ref_lq(p, b), lk = ref_lk(p, b), nb = (lk + block - 1) / block;
    for (hk = 0; hk < p->heads_kv; ++hk)
      for (kb = 0; kb < nb; ++kb) {
        double *m = mean + (hk * nb + kb) * dqk;
        const int64_t j1 = (kb + 1) * block < lk ? (kb + 1) * block : lk;
        for (c = 0; c < dqk; ++c) m[c] = 0.0;
        for (j = kb * block; j < j1; ++j)
          for (c = 0; c < dqk; ++c) m[c] += k[ref_offset(p, &p->k, 0, b, j, hk) + c];
        for (c = 0; c < dqk; ++c) m[c] /= (double)(j1 - kb * block);
      }
    for (h = 0; h < p->heads_q; ++h)
      for (i = 0; i < lq; ++i) {
        const int64_t d = i + lk - lq, own = d >= 0 ? d / block : -1;
        /* the heads whose gates add up: the group when shared */
        const int64_t h0 = shared ? (h / group) * group : h, h1 = shared ? h0 + group : h + 1;
        unsigned char *row =
            pair + ((size_t)(b * p->heads_q + h) * (size_t)rows + (size_t)i) * (size_t)cols;
        if (own < 0) continue;
        for (kb = 0; kb < own; ++kb) {
          gate[kb] = 0.0;
          taken[kb] = 0;
          for (hh = h0; hh < h1; ++hh)
            for (c = 0; c < dqk; ++c)
              gate[kb] += q[ref_offset(p, &p->q, 1, b, i, hh) + c] *
                          mean[((hh / group) * nb + kb) * dqk + c];
        }
        for (t = 0; t < top_k && t < own; ++t) { /* the largest untaken gate, lowest index */
          int64_t best = -1;
          for (kb = 0; kb < own; ++kb)
            if (!taken[kb] && (best < 0 || gate[kb] > gate[best])) best = kb;
          taken[best] = 1;
        }
        for (kb = 0; kb <= own; ++kb)
          if (kb == own || taken[kb])
            for (j = kb * block; j < (kb + 1) * block && j < lk; ++j) row[j] = 1;
      }
  }
  free(mean);
  free(gate);
  free(taken);
}

/* ------------------------------------------------------------------------ */
/* fp64                                                                      */
/* ------------------------------------------------------------------------ */

/* The logits z (-inf where masked) and probabilities P, both [lq][lk], and
 * the LSE of each row, for query head h of sequence b. */
static void scores_fp64(const ref_problem *p, int64_t b, int64_t h, const double *q,
                        const double *k, double *z, double *prob, double *lse) {
  const int64_t lq = ref_lq(p, b), lk = ref_lk(p, b), hk = h / group_size(p);
  int64_t i, j, c;
  for (i = 0; i < lq; ++i) {
    const double *qi = q + ref_offset(p, &p->q, 1, b, i, h);
    double m = -INFINITY, sum = 0.0;
    for (j = 0; j < lk; ++j) {
      const double *kj = k + ref_offset(p, &p->k, 0, b, j, hk);
      double u = 0.0;
      if (!ref_visible_head(p, b, h, i, j)) {
        z[i * lk + j] = -INFINITY;
        continue;
      }
      for (c = 0; c < p->head_dim_qk; ++c) u += qi[c] * kj[c];
      u *= p->scale;
      z[i * lk + j] = p->softcap > 0.0 ? p->softcap * tanh(u / p->softcap) : u;
      if (z[i * lk + j] > m) m = z[i * lk + j];
    }
    if (m == -INFINITY) { /* the row sees no key */
      for (j = 0; j < lk; ++j) prob[i * lk + j] = 0.0;
      lse[i] = -INFINITY;
      continue;
    }
    for (j = 0; j < lk; ++j) sum += exp(z[i * lk + j] - m);
    lse[i] = m + log(sum);
    for (j = 0; j < lk; ++j) prob[i * lk + j] = exp(z[i * lk + j] - lse[i]);
  }
}

/* O_i = sum_j P_ij V_j for query row i of sequence b, KV head hk; prob is
 * the [lq][lk] probability matrix of scores_fp64. */
static void row_output(const ref_problem *p, int64_t b, int64_t hk, int64_t i, int64_t lk,
                       const double *prob, const double *v, double *oi) {
  int64_t j, c;
  for (c = 0; c < p->head_dim_v; ++c) oi[c] = 0.0;
  for (j = 0; j < lk; ++j) {
    const double *vj = v + ref_offset(p, &p->v, 0, b, j, hk);
    const double pij = prob[i * lk + j];
    if (pij == 0.0) continue;
    for (c = 0; c < p->head_dim_v; ++c) oi[c] += pij * vj[c];
  }
}

/* The fp64 scratch of one (sequence, query head) at a time, sized for the
 * longest sequences. */
typedef struct fp64_scratch {
  double *z;       /* [lq][lk] logits (-inf where masked) */
  double *prob;    /* [lq][lk] */
  double *row_lse; /* [lq] */
  double *oi;      /* [dv] one output row */
} fp64_scratch;

static void fp64_alloc(const ref_problem *p, fp64_scratch *w) {
  const size_t mq = (size_t)max_lq(p), mk = (size_t)max_lk(p);
  w->z = (double *)ref_alloc(sizeof(double) * mq * mk);
  w->prob = (double *)ref_alloc(sizeof(double) * mq * mk);
  w->row_lse = (double *)ref_alloc(sizeof(double) * mq);
  w->oi = (double *)ref_alloc(sizeof(double) * (size_t)p->head_dim_v);
}

static void fp64_free(fp64_scratch *w) {
  free(w->z);
  free(w->prob);
  free(w->row_lse);
  free(w->oi);
}

double ref_max_abs_logit(const ref_problem *p, const double *q, const double *k) {
  fp64_scratch sc;
  double zmax = 0.0;
  int64_t b, h, e;
  fp64_alloc(p, &sc);
  for (b = 0; b < p->batch; ++b)
    for (h = 0; h < p->heads_q; ++h) {
      scores_fp64(p, b, h, q, k, sc.z, sc.prob, sc.row_lse);
      for (e = 0; e < ref_lq(p, b) * ref_lk(p, b); ++e)
        if (sc.z[e] != -INFINITY && fabs(sc.z[e]) > zmax) zmax = fabs(sc.z[e]);
    }
  fp64_free(&sc);
  return zmax;
}

double ref_logit_error_scale(const ref_problem *p, const double *q, const double *k) {
  double zmax = ref_max_abs_logit(p, q, k);
  int64_t b, h, i, j, c;
  if (p->softcap <= 0.0) return zmax;
  for (b = 0; b < p->batch; ++b)
    for (h = 0; h < p->heads_q; ++h)
      for (i = 0; i < ref_lq(p, b); ++i) {
        const double *qi = q + ref_offset(p, &p->q, 1, b, i, h);
        for (j = 0; j < ref_lk(p, b); ++j) {
          const double *kj = k + ref_offset(p, &p->k, 0, b, j, h / group_size(p));
          double u = 0.0, terms = 0.0, t, gain, z;
          if (!ref_visible_head(p, b, h, i, j)) continue;
          for (c = 0; c < p->head_dim_qk; ++c) {
            u += qi[c] * kj[c];
            terms += fabs(qi[c] * kj[c]);
          }
          t = tanh(p->scale * u / p->softcap);
          gain = 2.0 * fabs(t) / p->softcap > 1.0 ? 2.0 * fabs(t) / p->softcap : 1.0;
          z = p->scale * terms * (1.0 - t * t) * gain;
          if (z > zmax) zmax = z;
        }
      }
  return zmax;
}

void ref_forward(const ref_problem *p, const double *q, const double *k, const double *v,
                 double *o, double *lse) {
  fp64_scratch sc;
  int64_t b, h, i;
  fp64_alloc(p, &sc);
  for (b = 0; b < p->batch; ++b) {
    const int64_t lq = ref_lq(p, b), lk = ref_lk(p, b);
    for (h = 0; h < p->heads_q; ++h) {
      const int64_t hk = h / group_size(p);
      scores_fp64(p, b, h, q, k, sc.z, sc.prob, sc.row_lse);
      for (i = 0; i < lq; ++i) {
        row_output(p, b, hk, i, lk, sc.prob, v, o + ref_offset(p, &p->o, 1, b, i, h));
        if (lse != NULL) lse[ref_lse_index(p, b, h, i)] = sc.row_lse[i];
      }
    }
  }
  fp64_free(&sc);
}

/* Sets elements [0, width) of rows [0, lk) of every KV head of sequence b
 * of x (a dK or dV tensor, strides t) to 0. */
static void zero_kv_rows(const ref_problem *p, const ref_strides *t, int64_t b, int64_t width,
                         double *x) {
  int64_t hk, j, c;
  for (hk = 0; hk < p->heads_kv; ++hk)
    for (j = 0; j < ref_lk(p, b); ++j) {
      double *row = x + ref_offset(p, t, 0, b, j, hk);
      for (c = 0; c < width; ++c) row[c] = 0.0;
    }
}

/* dz/du of the softcapped logit z = cap * tanh(u / cap), from z:
 * 1 - (z / cap)^2; 1 without softcap. */
static double softcap_slope(const ref_problem *p, double z) {
  double t;
  if (p->softcap <= 0.0) return 1.0;
  t = z / p->softcap;
  return 1.0 - t * t;
}

void ref_backward(const ref_problem *p, const double *q, const double *k, const double *v,
                  const double *d_o, double *dq, double *dk, double *dv) {
  const int64_t dqk = p->head_dim_qk, dvd = p->head_dim_v;
  fp64_scratch sc;
  int64_t b, h, hk, i, j, c;
  fp64_alloc(p, &sc);

  for (b = 0; b < p->batch; ++b) {
    const int64_t lq = ref_lq(p, b), lk = ref_lk(p, b);
    zero_kv_rows(p, &p->dk, b, dqk, dk);
    zero_kv_rows(p, &p->dv, b, dvd, dv);
    for (h = 0; h < p->heads_q; ++h) {
      hk = h / group_size(p);
      scores_fp64(p, b, h, q, k, sc.z, sc.prob, sc.row_lse);
      for (i = 0; i < lq; ++i) {
        const double *qi = q + ref_offset(p, &p->q, 1, b, i, h);
        const double *doi = d_o + ref_offset(p, &p->d_o, 1, b, i, h);
        double *dqi = dq + ref_offset(p, &p->dq, 1, b, i, h);
        double delta = 0.0;
        /* O_i, then D_i = dO_i . O_i */
        row_output(p, b, hk, i, lk, sc.prob, v, sc.oi);
        for (c = 0; c < dvd; ++c) delta += doi[c] * sc.oi[c];
        for (c = 0; c < dqk; ++c) dqi[c] = 0.0;

        for (j = 0; j < lk; ++j) {
          const double *kj = k + ref_offset(p, &p->k, 0, b, j, hk);
          const double *vj = v + ref_offset(p, &p->v, 0, b, j, hk);
          double *dkj = dk + ref_offset(p, &p->dk, 0, b, j, hk);
          double *dvj = dv + ref_offset(p, &p->dv, 0, b, j, hk);
          const double pij = sc.prob[i * lk + j];
          double dp = 0.0, du;
          if (sc.z[i * lk + j] == -INFINITY) continue; /* masked: no gradient */
          for (c = 0; c < dvd; ++c) dp += doi[c] * vj[c];
          du = pij * (dp - delta) * softcap_slope(p, sc.z[i * lk + j]); /* dL/dz dz/du */
          du *= p->scale; /* u = scale * q.k */
          for (c = 0; c < dqk; ++c) {
            dqi[c] += du * kj[c];
            dkj[c] += du * qi[c];
          }
          for (c = 0; c < dvd; ++c) dvj[c] += pij * doi[c];
        }
      }
    }
  }
  fp64_free(&sc);
}

void ref_backward_o_error_floor(const ref_problem *p, double u, const double *q,
                                const double *k, const double *v, const double *d_o,
                                const double *o_given, double *floor_dq, double *floor_dk) {
  const int64_t dqk = p->head_dim_qk, dvd = p->head_dim_v, mk = max_lk(p);
  /* the measured part of dK's floor, signed, [lk][dqk] of one KV head */
  double *given_dk = (double *)ref_alloc(sizeof(double) * (size_t)(mk * dqk));
  fp64_scratch sc;
  int64_t b, h, hk, i, j, c;
  fp64_alloc(p, &sc);
  for (b = 0; b < p->batch; ++b) {
    const int64_t lq = ref_lq(p, b), lk = ref_lk(p, b);
    zero_kv_rows(p, &p->dk, b, dqk, floor_dk); /* first sums of squares over the rows */
    for (hk = 0; hk < p->heads_kv; ++hk) {
      memset(given_dk, 0, sizeof(double) * (size_t)(lk * dqk));
      for (h = hk * group_size(p); h < (hk + 1) * group_size(p); ++h) {
        scores_fp64(p, b, h, q, k, sc.z, sc.prob, sc.row_lse);
        for (i = 0; i < lq; ++i) {
          const double *qi = q + ref_offset(p, &p->q, 1, b, i, h);
          const double *doi = d_o + ref_offset(p, &p->d_o, 1, b, i, h);
          double *fq = floor_dq + ref_offset(p, &p->dq, 1, b, i, h);
          double e = 0.0, given = 0.0;
          row_output(p, b, hk, i, lk, sc.prob, v, sc.oi);
          for (c = 0; c < dvd; ++c) e += doi[c] * sc.oi[c] * doi[c] * sc.oi[c];
          e = 2.0 * u * sqrt(e); /* E_i */
          if (o_given != NULL) { /* dD_i of the O handed over, exactly */
            const double *oi = o_given + ref_offset(p, &p->o, 1, b, i, h);
            for (c = 0; c < dvd; ++c) given += doi[c] * (oi[c] - sc.oi[c]);
          }
          for (c = 0; c < dqk; ++c) fq[c] = 0.0;
          for (j = 0; j < lk; ++j) {
            const double *kj = k + ref_offset(p, &p->k, 0, b, j, hk);
            double *fk = floor_dk + ref_offset(p, &p->dk, 0, b, j, hk);
            double w = sc.prob[i * lk + j] * p->scale;
            if (w == 0.0) continue;
            w *= softcap_slope(p, sc.z[i * lk + j]);
            for (c = 0; c < dqk; ++c) {
              fq[c] += w * (e + fabs(given)) * kj[c]; /* signed: D_i's error is common to the row */
              fk[c] += w * e * qi[c] * w * e * qi[c];
              given_dk[j * dqk + c] += w * given * qi[c];
            }
          }
          for (c = 0; c < dqk; ++c) fq[c] = fabs(fq[c]);
        }
      }
      for (j = 0; j < lk; ++j) {
        double *fk = floor_dk + ref_offset(p, &p->dk, 0, b, j, hk);
        for (c = 0; c < dqk; ++c) fk[c] = sqrt(fk[c]) + fabs(given_dk[j * dqk + c]);
      }
    }
  }
  fp64_free(&sc);
  free(given_dk);
}

void ref_backward_o_rounding_floor(const ref_problem *p, double u, const double *q,
                                   const double *k, const double *v, const double *d_o,
                                   double *floor_dq, double *floor_dk) {
  ref_backward_o_error_floor(p, u, q, k, v, d_o, NULL, floor_dq, floor_dk);
}

/* ------------------------------------------------------------------------ */
/* Same precision, framework style                                          */
/* ------------------------------------------------------------------------ */

typedef struct lowp_scratch {
  float *qs;   /* [lq][dqk]  q * scale, rounded */
  float *s;    /* [lq][lk]   scores after softcap (-inf where masked) */
  float *t;    /* [lq][lk]   tanh outputs (softcap only) */
  float *prob; /* [lq][lk] */
  float *lse;  /* [lq] */
  float *acc;  /* [max(dqk, dv)] one fp32 accumulator row */
} lowp_scratch;

static void lowp_alloc(const ref_problem *p, lowp_scratch *w) {
  const size_t mq = (size_t)max_lq(p), mk = (size_t)max_lk(p);
  w->qs = (float *)ref_alloc(sizeof(float) * mq * (size_t)p->head_dim_qk);
  w->s = (float *)ref_alloc(sizeof(float) * mq * mk);
  w->t = (float *)ref_alloc(sizeof(float) * mq * mk);
  w->prob = (float *)ref_alloc(sizeof(float) * mq * mk);
  w->lse = (float *)ref_alloc(sizeof(float) * mq);
  w->acc = (float *)ref_alloc(sizeof(float) * (size_t)(p->head_dim_qk + p->head_dim_v));
}

static void lowp_free(lowp_scratch *w) {
  free(w->qs);
  free(w->s);
  free(w->t);
  free(w->prob);
  free(w->lse);
  free(w->acc);
}

/* Forward graph of query head h of sequence b, every op rounded:
 *   qs = q * scale;  s = qs k^T;  s = cap * tanh(s / cap);  P = softmax(s). */
static void scores_lowp(const ref_problem *p, attn_dtype_t dt, int64_t b, int64_t h,
                        const double *q, const double *k, lowp_scratch *w) {
  const int64_t lq = ref_lq(p, b), lk = ref_lk(p, b), hk = h / group_size(p);
  const int64_t dqk = p->head_dim_qk;
  const float scale = (float)p->scale, cap = (float)p->softcap;
  int64_t i, j, c;
  for (i = 0; i < lq; ++i) {
    const double *qi = q + ref_offset(p, &p->q, 1, b, i, h);
    for (c = 0; c < dqk; ++c) w->qs[i * dqk + c] = tu_round_float((float)qi[c] * scale, dt);
  }
  for (i = 0; i < lq; ++i) {
    float m = -INFINITY, sum = 0.0f;
    for (j = 0; j < lk; ++j) {
      const double *kj = k + ref_offset(p, &p->k, 0, b, j, hk);
      float acc = 0.0f, sij;
      for (c = 0; c < dqk; ++c) acc += w->qs[i * dqk + c] * (float)kj[c];
      sij = tu_round_float(acc, dt);
      if (cap > 0.0f) {
        const float x = tu_round_float(sij / cap, dt);
        const float t = tu_round_float(tanhf(x), dt);
        w->t[i * lk + j] = t;
        sij = tu_round_float(t * cap, dt);
      }
      if (!ref_visible_head(p, b, h, i, j)) sij = -INFINITY;
      w->s[i * lk + j] = sij;
      if (sij > m) m = sij;
    }
    if (m == -INFINITY) {
      for (j = 0; j < lk; ++j) w->prob[i * lk + j] = 0.0f;
      w->lse[i] = -INFINITY;
      continue;
    }
    for (j = 0; j < lk; ++j) sum += expf(w->s[i * lk + j] - m);
    for (j = 0; j < lk; ++j)
      w->prob[i * lk + j] = tu_round_float(expf(w->s[i * lk + j] - m) / sum, dt);
    w->lse[i] = m + logf(sum);
  }
}

void ref_lowp_forward(const ref_problem *p, attn_dtype_t dt, const double *q, const double *k,
                      const double *v, double *o, double *lse) {
  lowp_scratch w;
  int64_t b, h, i, j, c;
  lowp_alloc(p, &w);
  for (b = 0; b < p->batch; ++b) {
    const int64_t lq = ref_lq(p, b), lk = ref_lk(p, b);
    for (h = 0; h < p->heads_q; ++h) {
      const int64_t hk = h / group_size(p);
      scores_lowp(p, dt, b, h, q, k, &w);
      for (i = 0; i < lq; ++i) {
        double *oi = o + ref_offset(p, &p->o, 1, b, i, h);
        for (c = 0; c < p->head_dim_v; ++c) w.acc[c] = 0.0f;
        for (j = 0; j < lk; ++j) {
          const double *vj = v + ref_offset(p, &p->v, 0, b, j, hk);
          const float pij = w.prob[i * lk + j];
          if (pij == 0.0f) continue;
          for (c = 0; c < p->head_dim_v; ++c) w.acc[c] += pij * (float)vj[c];
        }
        for (c = 0; c < p->head_dim_v; ++c) oi[c] = tu_round_float(w.acc[c], dt);
        if (lse != NULL) lse[ref_lse_index(p, b, h, i)] = w.lse[i];
      }
    }
  }
  lowp_free(&w);
}

void ref_lowp_backward(const ref_problem *p, attn_dtype_t dt, const double *q, const double *k,
                       const double *v, const double *d_o, double *dq, double *dk, double *dv) {
  const int64_t mk = max_lk(p), dqk = p->head_dim_qk, dvd = p->head_dim_v;
  const float scale = (float)p->scale, cap = (float)p->softcap;
  /* dK and dV of one (sequence, KV head), summed over its group in fp32 and
   * rounded once, as the backward of a broadcast (repeat) would. */
  float *acc_dk = (float *)ref_alloc(sizeof(float) * (size_t)(mk * dqk));
  float *acc_dv = (float *)ref_alloc(sizeof(float) * (size_t)(mk * dvd));
  float *ds = (float *)ref_alloc(sizeof(float) * (size_t)mk);
  lowp_scratch w;
  int64_t b, h, hk, i, j, c;
  lowp_alloc(p, &w);
  for (b = 0; b < p->batch; ++b) {
    const int64_t lq = ref_lq(p, b), lk = ref_lk(p, b);
    for (hk = 0; hk < p->heads_kv; ++hk) {
      memset(acc_dk, 0, sizeof(float) * (size_t)(lk * dqk));
      memset(acc_dv, 0, sizeof(float) * (size_t)(lk * dvd));
      for (h = hk * group_size(p); h < (hk + 1) * group_size(p); ++h) {
        scores_lowp(p, dt, b, h, q, k, &w);
        for (i = 0; i < lq; ++i) {
          const double *doi = d_o + ref_offset(p, &p->d_o, 1, b, i, h);
          double *dqi = dq + ref_offset(p, &p->dq, 1, b, i, h);
          float delta = 0.0f;
          /* D = dO . O with O the forward's output rounded to the dtype: the
           * API hands the backward O in the dtype, so every implementation
           * pays for that rounding (it dominates dQ and dK when P is nearly
           * one-hot, where dP - D cancels). */
          for (c = 0; c < dvd; ++c) w.acc[c] = 0.0f;
          for (j = 0; j < lk; ++j) {
            const double *vj = v + ref_offset(p, &p->v, 0, b, j, hk);
            for (c = 0; c < dvd; ++c) w.acc[c] += w.prob[i * lk + j] * (float)vj[c];
          }
          for (c = 0; c < dvd; ++c) delta += (float)doi[c] * tu_round_float(w.acc[c], dt);
          /* dP = dO V^T (rounded), then the softmax backward
           * dS = P * (dP - D) */
          for (j = 0; j < lk; ++j) {
            const double *vj = v + ref_offset(p, &p->v, 0, b, j, hk);
            float acc = 0.0f;
            for (c = 0; c < dvd; ++c) acc += (float)doi[c] * (float)vj[c];
            ds[j] = tu_round_float(acc, dt);
          }
          for (j = 0; j < lk; ++j) {
            float g = tu_round_float(w.prob[i * lk + j] * (ds[j] - delta), dt);
            if (w.s[i * lk + j] == -INFINITY) g = 0.0f;
            if (cap > 0.0f && g != 0.0f) {
              const float t = w.t[i * lk + j];
              g = tu_round_float(g * cap, dt);               /* through * cap */
              g = tu_round_float(g * (1.0f - t * t), dt);    /* through tanh */
              g = tu_round_float(g / cap, dt);               /* through / cap */
            }
            ds[j] = g;
          }
          /* dQs = dS K, dQ = dQs * scale; dK += dS^T Qs; dV += P^T dO */
          for (c = 0; c < dqk; ++c) w.acc[c] = 0.0f;
          for (j = 0; j < lk; ++j) {
            const double *kj = k + ref_offset(p, &p->k, 0, b, j, hk);
            if (ds[j] == 0.0f) continue;
            for (c = 0; c < dqk; ++c) w.acc[c] += ds[j] * (float)kj[c];
          }
          for (c = 0; c < dqk; ++c)
            dqi[c] = tu_round_float(tu_round_float(w.acc[c], dt) * scale, dt);
          for (j = 0; j < lk; ++j) {
            const float pij = w.prob[i * lk + j];
            for (c = 0; c < dqk; ++c) acc_dk[j * dqk + c] += ds[j] * w.qs[i * dqk + c];
            for (c = 0; c < dvd; ++c) acc_dv[j * dvd + c] += pij * (float)doi[c];
          }
        }
      }
      for (j = 0; j < lk; ++j) {
        double *dkj = dk + ref_offset(p, &p->dk, 0, b, j, hk);
        double *dvj = dv + ref_offset(p, &p->dv, 0, b, j, hk);
        for (c = 0; c < dqk; ++c) dkj[c] = tu_round_float(acc_dk[j * dqk + c], dt);
        for (c = 0; c < dvd; ++c) dvj[c] = tu_round_float(acc_dv[j * dvd + c], dt);
      }
    }
  }
  lowp_free(&w);
  free(acc_dk);
  free(acc_dv);
  free(ds);
}
