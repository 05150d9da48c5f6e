/*
 * Block-sparse plans against the fp64 reference. Each case draws a random
 * block mask, gives it to the library (as FlexAttention-style tables or as a
 * materialised boolean matrix), materialises the same selection on the test
 * side, and runs the numerics harness (forward and backward, exact checks of
 * empty rows, unseen keys, visible_pairs and determinism; see harness.h),
 * whose reference sees the plan's dense mask AND the materialised selection.
 * Before that, the mask is read back (attn_block_mask_get_blocks) and must
 * select exactly the same elements, in canonical form.
 * Run once per CPU kernel variant (ATTN_CPU_ISA).
 */
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

#define FP32 ATTN_DTYPE_FP32
#define FP16 ATTN_DTYPE_FP16
#define BF16 ATTN_DTYPE_BF16
#define NONE ATTN_MASK_NONE
#define CAUSAL ATTN_MASK_CAUSAL
#define WINDOW ATTN_MASK_WINDOW

typedef enum source {
  FROM_TABLES = 0, /* attn_block_mask_set_blocks with random tables */
  FROM_DENSE = 1   /* attn_block_mask_add_dense with a random blocky matrix */
} source;

typedef struct sparse_case {
  nc_case base; /* name, dtype, shape, dense mask, threads, backward */
  int64_t block_q, block_kv;
  int64_t mask_batch, mask_heads; /* 1, or the batch / heads_kv */
  source from;
  double p_none;     /* chance that a block is not listed */
  int empty_block0;  /* query block 0 of mask slot 0 lists nothing: empty rows */
  int no_bits;       /* tables without partial_bits: partial blocks select everything */
} sparse_case;

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n == 0 ? 1 : n, size);
  assert_non_null(p);
  return p;
}

static void check(attn_status_t st, const char *call) {
  if (st != ATTN_STATUS_SUCCESS)
    fail_msg("%s returned %s: %s", call, attn_status_string(st), attn_last_error_message());
}

/* The selection as a [mask_batch][mask_heads][lq][lk] matrix, drawn block by
 * block; when tables are given, also as FlexAttention tables (indices in a
 * random order, unused slots filled with junk the library must not read). */
typedef struct drawn {
  unsigned char *pair;
  int32_t *num_p, *idx_p, *num_f, *idx_f;
  uint8_t *bits;
} drawn;

static void draw(const sparse_case *sc, tu_rng *rng, drawn *d) {
  const nc_case *c = &sc->base;
  const int64_t lq = c->seqlen_q, lk = c->seqlen_kv, bq = sc->block_q, bk = sc->block_kv;
  const int64_t nqb = (lq + bq - 1) / bq, nkb = (lk + bk - 1) / bk;
  const int64_t rows = sc->mask_batch * sc->mask_heads * nqb;
  const size_t tile_bytes = (size_t)ATTN_BLOCK_MASK_TILE_BYTES(bq, bk);
  int32_t *order = (int32_t *)xcalloc((size_t)nkb, sizeof(int32_t));
  int64_t k, e, r, col;
  d->pair = (unsigned char *)xcalloc((size_t)(sc->mask_batch * sc->mask_heads * lq * lk), 1);
  d->num_p = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
  d->num_f = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
  d->idx_p = (int32_t *)xcalloc((size_t)(rows * nkb), sizeof(int32_t));
  d->idx_f = (int32_t *)xcalloc((size_t)(rows * nkb), sizeof(int32_t));
  d->bits = (uint8_t *)xcalloc((size_t)(rows * nkb) * tile_bytes, 1);
  for (k = 0; k < rows * nkb; ++k) d->idx_p[k] = d->idx_f[k] = 12345;
  memset(d->bits, 0xA5, (size_t)(rows * nkb) * tile_bytes);
  for (k = 0; k < rows; ++k) {
    const int64_t slot = k / nqb, qb = k % nqb;
    unsigned char *plane = d->pair + (size_t)(slot * lq * lk);
    tu_rng_permutation(rng, order, (size_t)nkb);
    for (e = 0; e < nkb; ++e) {
      const int64_t kb = order[e];
      const double kind = tu_rng_uniform(rng, 0.0, 1.0);
      const double density = tu_rng_uniform(rng, 0.15, 0.85);
      const int listed = tu_rng_uniform(rng, 0.0, 1.0) >= sc->p_none && !(sc->empty_block0 && k == 0);
      /* full 30%, partial with random bits 50%, partial with every bit set 20%
       * (also those outside the sequence, which the library must ignore) */
      const int full = kind < 0.3, with_bits = kind >= 0.3 && kind < 0.8 && !sc->no_bits;
      uint8_t *tile = NULL;
      if (!listed) continue;
      if (sc->from == FROM_TABLES && full) {
        d->idx_f[k * nkb + d->num_f[k]++] = (int32_t)kb;
      } else if (sc->from == FROM_TABLES) {
        tile = d->bits + (size_t)(k * nkb + d->num_p[k]) * tile_bytes;
        memset(tile, with_bits ? 0 : 0xFF, tile_bytes);
        d->idx_p[k * nkb + d->num_p[k]++] = (int32_t)kb;
      }
      for (r = 0; r < bq; ++r)
        for (col = 0; col < bk; ++col) {
          const int64_t i = qb * bq + r, j = kb * bk + col, t = r * bk + col;
          const int on = full || !with_bits || tu_rng_uniform(rng, 0.0, 1.0) < density;
          if (tile != NULL && with_bits && on) tile[t / 8] = (uint8_t)(tile[t / 8] | (1u << (t % 8)));
          if (i < lq && j < lk && on) plane[i * lk + j] = 1;
        }
    }
  }
  free(order);
}

static void free_drawn(drawn *d) {
  free(d->pair);
  free(d->num_p);
  free(d->idx_p);
  free(d->num_f);
  free(d->idx_f);
  free(d->bits);
}

/* Reads the mask back and checks that it selects exactly `pair`, in
 * canonical form: a block is listed full iff all its in-range elements are
 * selected, partial iff some are, not at all iff none; lists sorted; unused
 * slots -1. */
static void check_readback(const sparse_case *sc, attn_block_mask_t mask, const unsigned char *pair) {
  const nc_case *c = &sc->base;
  const int64_t lq = c->seqlen_q, lk = c->seqlen_kv, bq = sc->block_q, bk = sc->block_kv;
  const int64_t nqb = (lq + bq - 1) / bq, nkb = (lk + bk - 1) / bk;
  const int64_t rows = sc->mask_batch * sc->mask_heads * nqb;
  const size_t tile_bytes = (size_t)ATTN_BLOCK_MASK_TILE_BYTES(bq, bk);
  int32_t max_p = -1, max_f = -1, mp, mf;
  int32_t *num_p, *idx_p, *num_f, *idx_f;
  uint8_t *bits;
  int64_t k, kb, r, col, e;
  check(attn_block_mask_get_max_blocks(mask, &max_p, &max_f), "attn_block_mask_get_max_blocks");
  mp = max_p > 0 ? max_p : 1;
  mf = max_f > 0 ? max_f : 1;
  num_p = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
  num_f = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
  idx_p = (int32_t *)xcalloc((size_t)(rows * mp), sizeof(int32_t));
  idx_f = (int32_t *)xcalloc((size_t)(rows * mf), sizeof(int32_t));
  bits = (uint8_t *)xcalloc((size_t)(rows * mp) * tile_bytes, 1);
  check(attn_block_mask_get_blocks(mask, num_p, idx_p, mp, bits, num_f, idx_f, mf),
        "attn_block_mask_get_blocks");
  for (k = 0; k < rows; ++k) {
    const int64_t slot = k / nqb, qb = k % nqb;
    const unsigned char *plane = pair + (size_t)(slot * lq * lk);
    int32_t ep = 0, ef = 0;
    for (e = num_p[k]; e < mp; ++e) assert_int_equal(idx_p[k * mp + e], -1);
    for (e = num_f[k]; e < mf; ++e) assert_int_equal(idx_f[k * mf + e], -1);
    for (kb = 0; kb < nkb; ++kb) {
      int64_t on = 0, in_range = 0;
      const int is_full = ef < num_f[k] && idx_f[k * mf + ef] == kb;
      const int is_partial = ep < num_p[k] && idx_p[k * mp + ep] == kb;
      const uint8_t *tile = bits + (size_t)(k * mp + ep) * tile_bytes;
      for (r = 0; r < bq; ++r)
        for (col = 0; col < bk; ++col) {
          const int64_t i = qb * bq + r, j = kb * bk + col, t = r * bk + col;
          const int bit = (tile[t / 8] >> (t % 8)) & 1;
          if (i >= lq || j >= lk) {
            if (is_partial && bit) fail_msg("row %lld block %lld: a bit outside the sequence is set", (long long)k, (long long)kb);
            continue;
          }
          ++in_range;
          on += plane[i * lk + j] != 0;
          if (is_partial && bit != (plane[i * lk + j] != 0))
            fail_msg("row %lld block %lld element (%lld, %lld): bit %d, expected %d", (long long)k,
                     (long long)kb, (long long)r, (long long)col, bit, plane[i * lk + j] != 0);
        }
      if (is_full != (on == in_range && on > 0) || is_partial != (on > 0 && on < in_range))
        fail_msg("row %lld key block %lld: listed full %d partial %d, but %lld of %lld elements "
                 "are selected", (long long)k, (long long)kb, is_full, is_partial, (long long)on,
                 (long long)in_range);
      ef += is_full;
      ep += is_partial;
    }
    /* every listed index was matched in increasing order: sorted, in range */
    assert_int_equal(ef, num_f[k]);
    assert_int_equal(ep, num_p[k]);
  }
  free(num_p);
  free(num_f);
  free(idx_p);
  free(idx_f);
  free(bits);
}

static void run_sparse(void **state) {
  const sparse_case *sc = (const sparse_case *)*state;
  nc_case c = sc->base;
  tu_rng rng = tu_rng_for(sc->base.name);
  attn_block_mask_t mask = NULL;
  drawn d;
  const int64_t nkb = (c.seqlen_kv + sc->block_kv - 1) / sc->block_kv;
  memset(&d, 0, sizeof d);
  draw(sc, &rng, &d);
  check(attn_block_mask_create(sc->mask_batch, sc->mask_heads, c.seqlen_q, c.seqlen_kv,
                               sc->block_q, sc->block_kv, &mask),
        "attn_block_mask_create");
  if (sc->from == FROM_TABLES)
    check(attn_block_mask_set_blocks(mask, d.num_p, d.idx_p, (int32_t)nkb,
                                     sc->no_bits ? NULL : d.bits, d.num_f,
                                     d.idx_f, (int32_t)nkb),
          "attn_block_mask_set_blocks");
  else
    check(attn_block_mask_add_dense(mask, d.pair), "attn_block_mask_add_dense");
  check_readback(sc, mask, d.pair);

  c.block_mask = mask;
  c.pair_mask = d.pair;
  c.mask_batch = sc->mask_batch;
  c.mask_heads = sc->mask_heads;
  nc_run(&c);
  check(attn_block_mask_destroy(mask), "attn_block_mask_destroy");
  free_drawn(&d);
}

#define SHAPE(b, hq, hkv, lq, lk, d) \
  .batch = (b), .heads_q = (hq), .heads_kv = (hkv), .seqlen_q = (lq), .seqlen_kv = (lk), \
  .dqk = (d), .dv = (d)
#define CASE(name_, dtype_, ...) \
  {.name = (name_), .dtype = (dtype_), .backward = 1, __VA_ARGS__}

static const sparse_case kCases[] = {
    {CASE("b16_len100_none_fp32", FP32, SHAPE(1, 2, 2, 100, 100, 32), .threads = 1), 16, 16, 1, 2,
     FROM_TABLES, 0.4, 0, 0},
    {CASE("b64_causal_gqa_per_head_bf16", BF16, SHAPE(1, 4, 2, 130, 200, 32), .mask = CAUSAL,
          .threads = 2),
     64, 64, 1, 2, FROM_TABLES, 0.3, 0, 0},
    {CASE("b128_window_broadcast_fp16", FP16, SHAPE(2, 2, 2, 300, 300, 32), .mask = WINDOW,
          .left = 100, .right = 20, .threads = 2),
     128, 128, 2, 1, FROM_TABLES, 0.2, 0, 0},
    {CASE("b48_nonpow2_q_gt_k_fp32", FP32, SHAPE(2, 2, 1, 150, 97, 24), .threads = 1), 48, 48, 1,
     1, FROM_TABLES, 0.3, 0, 0},
    {CASE("b16x64_causal_fp32", FP32, SHAPE(1, 1, 1, 200, 200, 16), .mask = CAUSAL, .threads = 2),
     16, 64, 1, 1, FROM_TABLES, 0.3, 0, 0},
    {CASE("b64x16_lq_lt_lk_bf16", BF16, SHAPE(1, 2, 1, 70, 250, 32), .mask = CAUSAL, .threads = 1),
     64, 16, 1, 1, FROM_TABLES, 0.5, 0, 0},
    {CASE("b32_empty_rows_fp32", FP32, SHAPE(1, 2, 2, 90, 90, 16), .threads = 1), 32, 32, 1, 2,
     FROM_TABLES, 0.3, 1, 0},
    {CASE("b128_causal_q_gt_k_empty_fp16", FP16, SHAPE(1, 2, 2, 260, 200, 32), .mask = CAUSAL,
          .threads = 2),
     128, 128, 1, 1, FROM_TABLES, 0.1, 0, 0},
    {CASE("b96_softcap_per_batch_fp32", FP32, SHAPE(2, 2, 1, 200, 200, 32), .softcap = 8.0f,
          .threads = 2),
     96, 96, 2, 1, FROM_TABLES, 0.3, 0, 0},
    {CASE("b7x13_tiny_blocks_fp32", FP32, SHAPE(1, 1, 1, 50, 60, 8), .threads = 1), 7, 13, 1, 1,
     FROM_TABLES, 0.5, 0, 0},
    {CASE("b32_no_bits_causal_bf16", BF16, SHAPE(1, 2, 1, 180, 180, 32), .mask = CAUSAL,
          .threads = 2),
     32, 32, 1, 1, FROM_TABLES, 0.4, 0, 1},
    {CASE("b200_bigger_than_seq_fp32", FP32, SHAPE(1, 1, 1, 120, 150, 16), .threads = 1), 200, 200,
     1, 1, FROM_TABLES, 0.0, 0, 0},
    {CASE("dense_b32_causal_fp32", FP32, SHAPE(1, 2, 2, 150, 150, 32), .mask = CAUSAL,
          .threads = 2),
     32, 32, 1, 2, FROM_DENSE, 0.3, 0, 0},
    {CASE("dense_b48x80_window_bf16", BF16, SHAPE(2, 2, 1, 130, 170, 16), .mask = WINDOW,
          .left = 60, .right = 60, .threads = 1),
     48, 80, 2, 1, FROM_DENSE, 0.2, 0, 0},
    {CASE("dense_b64_gqa_fp16", FP16, SHAPE(1, 4, 2, 100, 100, 32), .threads = 2), 64, 64, 1, 2,
     FROM_DENSE, 0.2, 0, 0},
};

int main(void) {
  enum { N = sizeof kCases / sizeof kCases[0] };
  struct CMUnitTest tests[N];
  size_t i;
  int rc = nc_isa_gate();
  if (rc != 0) return rc;
  for (i = 0; i < N; ++i) {
    memset(&tests[i], 0, sizeof tests[i]);
    tests[i].name = kCases[i].base.name;
    tests[i].test_func = run_sparse;
    tests[i].initial_state = (void *)&kCases[i];
  }
  return _cmocka_run_group_tests("block-sparse", tests, N, NULL, NULL);
}
