/*
 * Reference attention for the numerics tests.
 *
 * ref_forward / ref_backward: the conventional algorithm in fp64. For each
 * sequence and query head the full score matrix S and probability matrix P
 * are materialised; nothing is tiled or fused, so the code reads like the
 * formulas:
 *
 *     u_ij = scale * q_i . k_j
 *     z_ij = cap * tanh(u_ij / cap)           (softcap; z = u without it)
 *     z_ij = -inf where query i does not see key j (mask, see attn.h)
 *     P_ij = exp(z_ij - LSE_i),  LSE_i = log sum_j exp(z_ij)
 *     O_i  = sum_j P_ij v_j                   (O = 0, LSE = -inf: no key seen)
 *
 *     dP_ij = dO_i . v_j,   D_i = dO_i . O_i
 *     dZ_ij = P_ij (dP_ij - D_i),   dU_ij = dZ_ij (1 - (z_ij / cap)^2)
 *     dQ_i = scale sum_j dU_ij k_j,  dK_j = scale sum_i dU_ij q_i,
 *     dV_j = sum_i P_ij dO_i
 *
 * with dK and dV of a KV head summed over the query heads of its group
 * (query head h uses KV head h / (heads_q / heads_kv)).
 *
 * ref_lowp_forward / ref_lowp_backward: the same graph evaluated the way a
 * plain framework would in the test's precision: every op's result (q *
 * scale, S, the softcap steps, P, O, and each gradient) rounded to the
 * dtype, with fp32 accumulation inside matrix products and softmax. The
 * softmax backward uses D = dO . O with O rounded to the dtype, because
 * attn_backward receives O in the dtype: that rounding is an error floor of
 * the API itself. Its error against the fp64 reference is the yardstick of
 * the tolerance rule.
 *
 * Tensors are double arrays holding exact values (already rounded from the
 * test's dtype). Element (b, s, h, c) of a tensor with strides t lives at
 *     base(b) + s * t.seq + h * t.head + c
 * where base(b) = b * t.batch for fixed-length batches and cu[b] * t.seq
 * for varlen ones (cu = cu_q for Q, O, dO, dQ; cu_kv for K, V, dK, dV), as
 * the library's TensorStrides. LSE is laid out like the library's:
 * [batch, heads_q, seqlen_q], or [heads_q, total_q] for varlen.
 */
#ifndef ATTN_REFERENCE_H
#define ATTN_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

#include <attn/attn.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ref_strides {
  int64_t batch;
  int64_t seq;
  int64_t head;
} ref_strides;

typedef struct ref_problem {
  int64_t batch, heads_q, heads_kv;
  int64_t head_dim_qk, head_dim_v;
  /* batch + 1 offsets of each sequence's tokens, also for fixed-length
   * batches (then b * seqlen). */
  const int64_t *cu_q, *cu_kv;
  int varlen; /* where sequence b starts: cu[b] * seq (1) or b * batch (0) */
  double scale;
  double softcap; /* 0: off */
  /* The mask as a window; -1 = unbounded. NONE = (-1, -1), CAUSAL = (-1, 0). */
  int64_t window_left, window_right;
  /* Optional (NULL: all keys): only keys with key_filter[cu_kv[b] + j] != 0
   * exist, to compute partial states over a subset of the keys. */
  const unsigned char *key_filter;
  ref_strides q, k, v, o, d_o, dq, dk, dv;
  /* Optional (NULL: none): a block-sparse or MoBA selection, materialised.
   * Query i of sequence b in query head h sees key j only when
   * pair_mask[((mb * pair_mask_heads + mh) * rows + i) * cols + j] != 0,
   * where mb = b (0 when pair_mask_batch is 1) and mh = 0 when
   * pair_mask_heads is 1, h when it is heads_q, else the KV head h / group;
   * rows and cols are pair_mask_rows and pair_mask_cols (a varlen batch's
   * longest sequence: each sequence's slab is padded to them), or the
   * sequence's lq and lk where those are 0 (fixed-length batches). The
   * window applies on top. */
  const unsigned char *pair_mask;
  int64_t pair_mask_batch, pair_mask_heads;
  int64_t pair_mask_rows, pair_mask_cols;
} ref_problem;

int64_t ref_lq(const ref_problem *p, int64_t b);
int64_t ref_lk(const ref_problem *p, int64_t b);

/* Whether query i of a sequence with lq queries and lk keys sees key j, by
 * the header's definition (bottom-right aligned window, inclusive). */
int ref_mask_visible(int64_t lq, int64_t lk, int64_t left, int64_t right, int64_t i, int64_t j);
/* The same for sequence b of the problem, including key_filter. */
int ref_visible(const ref_problem *p, int64_t b, int64_t i, int64_t j);
/* The same for query head h, including pair_mask (which the three functions
 * without a head ignore); ref_key_seen_head: seen by a query head of KV head
 * hk's group. */
int ref_visible_head(const ref_problem *p, int64_t b, int64_t h, int64_t i, int64_t j);
int ref_row_sees_any_head(const ref_problem *p, int64_t b, int64_t h, int64_t i);
int ref_key_seen_head(const ref_problem *p, int64_t b, int64_t hk, int64_t j);

/* MoBA's selection (attn_plan_desc_set_moba) computed directly in fp64:
 * block means of K, gates q . mean per past block summed over the selecting
 * heads, the top_k largest (ties: lower block index) plus the own block,
 * each sequence on its own (bottom-right aligned). Writes pair
 * [batch][heads_q][rows][cols], rows and cols the longest sequence's
 * lengths (fixed-length batches: lq and lk): 1 where the key's block is
 * selected for the query (the causal mask is left to the window), 0 in the
 * padding. */
void ref_moba_select(const ref_problem *p, const double *q, const double *k, int64_t block,
                     int64_t top_k, int shared, unsigned char *pair);
/* Whether query row i of sequence b sees at least one key. */
int ref_row_sees_any(const ref_problem *p, int64_t b, int64_t i);
/* Whether key j of sequence b is seen by at least one query row. */
int ref_key_seen(const ref_problem *p, int64_t b, int64_t j);

/* Element offset of (b, s, h, 0); q_side selects cu_q or cu_kv. */
int64_t ref_offset(const ref_problem *p, const ref_strides *t, int q_side, int64_t b, int64_t s,
                   int64_t h);
/* Offset of LSE row (b, h, s), and the number of LSE elements. */
int64_t ref_lse_index(const ref_problem *p, int64_t b, int64_t h, int64_t s);
size_t ref_lse_count(const ref_problem *p);

/* The largest |z_ij| over visible pairs (0 when there are none): how well
 * the logits are conditioned, since fp32 logits carry an error ~ 2^-24 z. */
double ref_max_abs_logit(const ref_problem *p, const double *q, const double *k);

/* The magnitude Z of the rounding error of fp32 logits, ~ u32 Z, over
 * visible pairs. Without softcap the largest |z| (ref_max_abs_logit).
 * With softcap the rounding happens in u = scale q.k before the cap, with
 * an error du ~ u32 S, S = scale sum_c |q_c k_c| (the products summed,
 * however much they cancel); du reaches z = cap tanh(u / cap) as g du
 * (g = 1 - tanh^2 <= 1) and the backward's factor g as g 2 |tanh| du / cap.
 * Z is then also at least S g max(1, 2 |tanh| / cap) of every pair: large
 * where strong capping (cap < 2) meets products far larger than the cap. */
double ref_logit_error_scale(const ref_problem *p, const double *q, const double *k);

/* fp64 reference. Writes every element of O (and LSE when not NULL), or of
 * dQ, dK and dV; nothing else. */
void ref_forward(const ref_problem *p, const double *q, const double *k, const double *v,
                 double *o, double *lse);
void ref_backward(const ref_problem *p, const double *q, const double *k, const double *v,
                  const double *d_o, double *dq, double *dk, double *dv);

/* Error floor of the backward from O being handed over in a dtype of unit
 * roundoff u. D_i = dO_i . O_i is then off by dD_i, a sum of dim_v
 * independent roundings of |error| <= u |dO_ic O_ic| each, bounded here at
 * about 3.5 standard deviations: E_i = 2 u sqrt(sum_c (dO_ic O_ic)^2).
 * dD_i moves dS_ij = P_ij (dP_ij - D_i) by P_ij dD_i g_ij (g the softcap
 * factor, else 1), hence
 *     dQ_ic by scale |sum_j P_ij g_ij k_jc| E_i  (one dD_i per row), and
 *     dK_jc by scale sqrt(sum_i (P_ij g_ij E_i q_ic)^2)  (rows independent),
 * summed over the query heads of a KV head's group; dV does not depend on
 * D. Writes these bounds where dQ and dK would go. They matter when rows
 * are nearly one-hot: dP - D then cancels and the rounding of O dominates
 * the true dQ and dK. */
void ref_backward_o_rounding_floor(const ref_problem *p, double u, const double *q,
                                   const double *k, const double *v, const double *d_o,
                                   double *floor_dq, double *floor_dk);
/* The same, plus what the backward inherits from the O actually handed to
 * it, o_given (laid out with p->o's strides; NULL: none): the forward's own
 * error, within its tolerance, moves D_i by exactly
 * dD_i = sum_c dO_ic (o_given_ic - O_ic), which adds |dD_i| to E_i for dQ
 * and |scale sum_i P_ij g_ij dD_i q_ic| (signed over the rows, which may
 * share its sign) to dK. In fp32 this exceeds the rounding: O sums lk
 * products, off by up to ~lk/4 units in the last place. */
void ref_backward_o_error_floor(const ref_problem *p, double u, const double *q,
                                const double *k, const double *v, const double *d_o,
                                const double *o_given, double *floor_dq, double *floor_dk);

/* The same-precision framework-style computation (see above). Outputs are
 * values of `dtype` (LSE: fp32), as doubles. */
void ref_lowp_forward(const ref_problem *p, attn_dtype_t dtype, const double *q, const double *k,
                      const double *v, double *o, double *lse);
void ref_lowp_backward(const ref_problem *p, attn_dtype_t dtype, const double *q,
                       const double *k, const double *v, const double *d_o, double *dq,
                       double *dk, double *dv);

#ifdef __cplusplus
}
#endif

#endif /* ATTN_REFERENCE_H */
