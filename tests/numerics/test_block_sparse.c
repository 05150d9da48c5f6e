/*
 * Block-sparse plans against the fp64 reference. Each case draws a random
 * block mask, gives it to the library (as FlexAttention-style tables or as a
 * materialised boolean matrix), materialises the same selection on the test
 * side, and runs the numerics harness (forward and backward, exact checks of
 * empty rows, unseen keys, visible_pairs, visited tile pairs and
 * determinism; see harness.h), whose reference sees the plan's dense mask
 * AND the materialised selection.
 * Before that, the mask is read back (attn_block_mask_get_blocks) and must
 * select exactly the same elements, in canonical form.
 * The pattern builders (window, global keys and queries, strided, random
 * blocks, documents, and compositions) must give exactly the tables that
 * attn_block_mask_add_dense gives for their test-side matrices; composed
 * patterns (causal + window + sinks, BigBird, documents + causal, Sparse
 * Transformer) also run through the numerics harness.
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
#include "reference.h"
#include "sparse_patterns.h"
#include "testutil.h"

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
  int corner_bits;   /* a partial block's bits lie in a random quarter-size rectangle of it,
                        so that tiles it overlaps, or their visible part, may hold none */
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

static void run_sparse(void **state) {
  const sparse_case *sc = (const sparse_case *)*state;
  nc_case c = sc->base;
  tu_rng rng = tu_rng_for(sc->base.name);
  const sp_geom g = {sc->mask_batch, sc->mask_heads, c.seqlen_q, c.seqlen_kv, sc->block_q,
                     sc->block_kv};
  const sp_draw_opts opts = {sc->p_none, sc->empty_block0, sc->no_bits, sc->corner_bits};
  attn_block_mask_t mask = NULL;
  sp_tables d;
  const int64_t nkb = sp_kv_blocks(&g);
  sp_draw_tables(&g, &opts, &rng, &d);
  check(attn_block_mask_create(g.batch, g.heads, g.lq, g.lk, g.bq, g.bk, &mask),
        "attn_block_mask_create");
  if (sc->from == FROM_TABLES)
    check(attn_block_mask_set_blocks(mask, d.num_p, d.idx_p, (int32_t)nkb,
                                     sc->no_bits ? NULL : d.bits, d.num_f,
                                     d.idx_f, (int32_t)nkb),
          "attn_block_mask_set_blocks");
  else
    check(attn_block_mask_add_dense(mask, d.pair), "attn_block_mask_add_dense");
  sp_check_readback(&g, mask, d.pair, c.name);

  c.block_mask = mask;
  c.pair_mask = d.pair;
  c.mask_batch = sc->mask_batch;
  c.mask_heads = sc->mask_heads;
  nc_run(&c);
  check(attn_block_mask_destroy(mask), "attn_block_mask_destroy");
  sp_tables_free(&d);
}

#define SHAPE(b, hq, hkv, lq, lk, d) NC_SHAPE(b, hq, hkv, lq, lk, d, d)
#define CASE(name_, dtype_, ...) \
  {.name = (name_), .dtype = (dtype_), .backward = 1, __VA_ARGS__}

static const sparse_case kCases[] = {
    {CASE("b16_len100_none_fp32", FP32, SHAPE(1, 2, 2, 100, 100, 32), .threads = 1), 16, 16, 1, 2,
     FROM_TABLES, 0.4, 0, 0, 0},
    {CASE("b64_causal_gqa_per_head_bf16", BF16, SHAPE(1, 4, 2, 130, 200, 32), .mask = CAUSAL,
          .threads = 2),
     64, 64, 1, 2, FROM_TABLES, 0.3, 0, 0, 0},
    {CASE("b128_window_broadcast_fp16", FP16, SHAPE(2, 2, 2, 300, 300, 32), .mask = WINDOW,
          .left = 100, .right = 20, .threads = 2),
     128, 128, 2, 1, FROM_TABLES, 0.2, 0, 0, 0},
    {CASE("b48_nonpow2_q_gt_k_fp32", FP32, SHAPE(2, 2, 1, 150, 97, 24), .threads = 1), 48, 48, 1,
     1, FROM_TABLES, 0.3, 0, 0, 0},
    {CASE("b16x64_causal_fp32", FP32, SHAPE(1, 1, 1, 200, 200, 16), .mask = CAUSAL, .threads = 2),
     16, 64, 1, 1, FROM_TABLES, 0.3, 0, 0, 0},
    {CASE("b64x16_lq_lt_lk_bf16", BF16, SHAPE(1, 2, 1, 70, 250, 32), .mask = CAUSAL, .threads = 1),
     64, 16, 1, 1, FROM_TABLES, 0.5, 0, 0, 0},
    {CASE("b32_empty_rows_fp32", FP32, SHAPE(1, 2, 2, 90, 90, 16), .threads = 1), 32, 32, 1, 2,
     FROM_TABLES, 0.3, 1, 0, 0},
    {CASE("b128_causal_q_gt_k_empty_fp16", FP16, SHAPE(1, 2, 2, 260, 200, 32), .mask = CAUSAL,
          .threads = 2),
     128, 128, 1, 1, FROM_TABLES, 0.1, 0, 0, 0},
    {CASE("b96_softcap_per_batch_fp32", FP32, SHAPE(2, 2, 1, 200, 200, 32), .softcap = 8.0f,
          .threads = 2),
     96, 96, 2, 1, FROM_TABLES, 0.3, 0, 0, 0},
    {CASE("b32_shuffled_strides_gqa_fp16", FP16, SHAPE(2, 4, 2, 120, 140, 24), .mask = CAUSAL,
          .strides = NC_STRIDES_SHUFFLED, .threads = 2),
     32, 32, 2, 2, FROM_TABLES, 0.3, 0, 0, 0},
    {CASE("b64_bhsd_padded_window_fp32", FP32, SHAPE(1, 2, 2, 160, 160, 16), .mask = WINDOW,
          .left = 50, .right = 50, .layout = ATTN_LAYOUT_BHSD, .strides = NC_STRIDES_PADDED,
          .threads = 1),
     64, 64, 1, 2, FROM_TABLES, 0.3, 0, 0, 0},
    {CASE("b7x13_tiny_blocks_fp32", FP32, SHAPE(1, 1, 1, 50, 60, 8), .threads = 1), 7, 13, 1, 1,
     FROM_TABLES, 0.5, 0, 0, 0},
    {CASE("b32_no_bits_causal_bf16", BF16, SHAPE(1, 2, 1, 180, 180, 32), .mask = CAUSAL,
          .threads = 2),
     32, 32, 1, 1, FROM_TABLES, 0.4, 0, 1, 0},
    {CASE("b200_bigger_than_seq_fp32", FP32, SHAPE(1, 1, 1, 120, 150, 16), .threads = 1), 200, 200,
     1, 1, FROM_TABLES, 0.0, 0, 0, 0},
    {CASE("b160_corner_bits_causal_fp32", FP32, SHAPE(1, 2, 1, 333, 333, 16), .mask = CAUSAL,
          .threads = 2),
     160, 160, 1, 1, FROM_TABLES, 0.2, 0, 0, 1},
    {CASE("b192x128_corner_bits_window_gqa_bf16", BF16, SHAPE(1, 4, 2, 250, 300, 32),
          .mask = WINDOW, .left = 80, .right = 10, .threads = 1),
     192, 128, 1, 2, FROM_TABLES, 0.2, 0, 0, 1},
    {CASE("dense_b32_causal_fp32", FP32, SHAPE(1, 2, 2, 150, 150, 32), .mask = CAUSAL,
          .threads = 2),
     32, 32, 1, 2, FROM_DENSE, 0.3, 0, 0, 0},
    {CASE("dense_b48x80_window_bf16", BF16, SHAPE(2, 2, 1, 130, 170, 16), .mask = WINDOW,
          .left = 60, .right = 60, .threads = 1),
     48, 80, 2, 1, FROM_DENSE, 0.2, 0, 0, 0},
    {CASE("dense_b64_gqa_fp16", FP16, SHAPE(1, 4, 2, 100, 100, 32), .threads = 2), 64, 64, 1, 2,
     FROM_DENSE, 0.2, 0, 0, 0},
};

/* ------------------------------------------------------------------------ */
/* Pattern builders                                                          */
/* ------------------------------------------------------------------------ */

/* The same tables, bits included, byte for byte. */
static void expect_same_tables(const sp_geom *g, attn_block_mask_t a, attn_block_mask_t b,
                               const char *what) {
  const int64_t nqb = (g->lq + g->bq - 1) / g->bq, rows = g->batch * g->heads * nqb;
  const size_t tile = (size_t)ATTN_BLOCK_MASK_TILE_BYTES(g->bq, g->bk);
  int32_t mp[2], mf[2], k;
  int32_t *num_p[2], *idx_p[2], *num_f[2], *idx_f[2];
  uint8_t *bits[2];
  attn_block_mask_t m[2];
  m[0] = a, m[1] = b;
  for (k = 0; k < 2; ++k) {
    check(attn_block_mask_get_max_blocks(m[k], &mp[k], &mf[k]), "attn_block_mask_get_max_blocks");
  }
  if (mp[0] != mp[1] || mf[0] != mf[1])
    fail_msg("%s: longest rows differ: partial %d vs %d, full %d vs %d", what, mp[0], mp[1], mf[0],
             mf[1]);
  if (mp[0] < 1) mp[0] = mp[1] = 1;
  if (mf[0] < 1) mf[0] = mf[1] = 1;
  for (k = 0; k < 2; ++k) {
    num_p[k] = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
    num_f[k] = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
    idx_p[k] = (int32_t *)xcalloc((size_t)(rows * mp[k]), sizeof(int32_t));
    idx_f[k] = (int32_t *)xcalloc((size_t)(rows * mf[k]), sizeof(int32_t));
    bits[k] = (uint8_t *)xcalloc((size_t)(rows * mp[k]) * tile, 1);
    check(attn_block_mask_get_blocks(m[k], num_p[k], idx_p[k], mp[k], bits[k], num_f[k], idx_f[k],
                                     mf[k]),
          "attn_block_mask_get_blocks");
  }
  if (memcmp(num_p[0], num_p[1], (size_t)rows * sizeof(int32_t)) != 0 ||
      memcmp(num_f[0], num_f[1], (size_t)rows * sizeof(int32_t)) != 0 ||
      memcmp(idx_p[0], idx_p[1], (size_t)(rows * mp[0]) * sizeof(int32_t)) != 0 ||
      memcmp(idx_f[0], idx_f[1], (size_t)(rows * mf[0]) * sizeof(int32_t)) != 0 ||
      memcmp(bits[0], bits[1], (size_t)(rows * mp[0]) * tile) != 0)
    fail_msg("%s: the builder's tables differ from those of its materialised matrix", what);
  for (k = 0; k < 2; ++k) {
    free(num_p[k]);
    free(num_f[k]);
    free(idx_p[k]);
    free(idx_f[k]);
    free(bits[k]);
  }
}

static attn_block_mask_t new_mask(const sp_geom *g) {
  attn_block_mask_t m = NULL;
  check(attn_block_mask_create(g->batch, g->heads, g->lq, g->lk, g->bq, g->bk, &m),
        "attn_block_mask_create");
  return m;
}

/* A case builds a mask with the library's builders and the same pattern as
 * the matrix `sel` on the test side: start_case gives a new mask and a
 * cleared sel; finish_case compares the mask with add_dense(sel) and
 * destroys it. */
static attn_block_mask_t start_case(const sp_geom *g, unsigned char *sel) {
  memset(sel, 0, sp_matrix_size(g));
  return new_mask(g);
}

static void finish_case(const sp_geom *g, attn_block_mask_t built, const unsigned char *sel,
                        const char *what) {
  attn_block_mask_t dense = new_mask(g);
  check(attn_block_mask_add_dense(dense, sel), "attn_block_mask_add_dense");
  expect_same_tables(g, built, dense, what);
  check(attn_block_mask_destroy(dense), "attn_block_mask_destroy");
  check(attn_block_mask_destroy(built), "destroy");
}

static void test_builders_match_dense(void **state) {
  static const sp_geom geoms[] = {
      {1, 1, 100, 100, 16, 16}, {2, 1, 130, 97, 48, 48},  {1, 2, 70, 250, 64, 16},
      {1, 1, 200, 150, 128, 128}, {1, 1, 37, 53, 7, 13}, {2, 2, 96, 96, 96, 96},
  };
  tu_rng rng = tu_rng_for("builders_match_dense");
  size_t gi;
  (void)state;
  for (gi = 0; gi < sizeof geoms / sizeof geoms[0]; ++gi) {
    const sp_geom *g = &geoms[gi];
    unsigned char *sel = (unsigned char *)xcalloc(sp_matrix_size(g), 1);
    int32_t *dq = (int32_t *)xcalloc((size_t)(g->batch * g->lq), sizeof(int32_t));
    int32_t *dk = (int32_t *)xcalloc((size_t)(g->batch * g->lk), sizeof(int32_t));
    const int64_t nkb = (g->lk + g->bk - 1) / g->bk;
    const int64_t left = tu_rng_int(&rng, -1, g->lk), right = tu_rng_int(&rng, -1, 20);
    const int64_t stride = tu_rng_int(&rng, 1, 40);
    const int64_t per_row = tu_rng_int(&rng, 0, nkb < 3 ? nkb : 3);
    const uint64_t seed = tu_rng_next(&rng);
    int64_t keys[5], queries[3], k, b;
    attn_block_mask_t m;
    char what[160];
    for (k = 0; k < 5; ++k) keys[k] = tu_rng_int(&rng, 0, g->lk - 1);
    for (k = 0; k < 3; ++k) queries[k] = tu_rng_int(&rng, 0, g->lq - 1);
    for (b = 0; b < g->batch; ++b) {
      sp_draw_docs(&rng, dq + b * g->lq, g->lq, 40);
      sp_draw_docs(&rng, dk + b * g->lk, g->lk, 40);
    }
    snprintf(what, sizeof what, "geometry %zu (batch %lld heads %lld %lldx%lld blocks %lldx%lld)",
             gi, (long long)g->batch, (long long)g->heads, (long long)g->lq, (long long)g->lk,
             (long long)g->bq, (long long)g->bk);

    /* each builder alone */
    m = start_case(g, sel);
    check(attn_block_mask_add_window(m, left, right), "attn_block_mask_add_window");
    sp_or_window(g, sel, left, right);
    finish_case(g, m, sel, what);

    /* reaches beyond every sequence: the same as unbounded (no overflow of
     * the diagonal's arithmetic) */
    m = start_case(g, sel);
    check(attn_block_mask_add_window(m, INT64_MAX, right), "attn_block_mask_add_window");
    check(attn_block_mask_add_window(m, left, INT64_MAX), "attn_block_mask_add_window");
    sp_or_window(g, sel, -1, right);
    sp_or_window(g, sel, left, -1);
    finish_case(g, m, sel, what);

    m = start_case(g, sel);
    check(attn_block_mask_add_global_keys(m, keys, 5), "attn_block_mask_add_global_keys");
    sp_or_keys(g, sel, keys, 5, 0);
    finish_case(g, m, sel, what);

    m = start_case(g, sel);
    check(attn_block_mask_add_global_queries(m, queries, 3), "attn_block_mask_add_global_queries");
    sp_or_keys(g, sel, queries, 3, 1);
    finish_case(g, m, sel, what);

    m = start_case(g, sel);
    check(attn_block_mask_add_strided(m, stride), "attn_block_mask_add_strided");
    sp_or_strided(g, sel, stride);
    finish_case(g, m, sel, what);

    m = start_case(g, sel);
    check(attn_block_mask_add_random_blocks(m, (int32_t)per_row, seed),
          "attn_block_mask_add_random_blocks");
    sp_or_random_blocks(g, sel, per_row, seed);
    finish_case(g, m, sel, what);

    /* composed: (window AND documents) OR sinks OR global rows OR strided */
    m = start_case(g, sel);
    check(attn_block_mask_add_window(m, left, right), "attn_block_mask_add_window");
    check(attn_block_mask_and_documents(m, dq, dk), "attn_block_mask_and_documents");
    check(attn_block_mask_add_global_keys(m, keys, 2), "attn_block_mask_add_global_keys");
    check(attn_block_mask_add_global_queries(m, queries, 1), "attn_block_mask_add_global_queries");
    check(attn_block_mask_add_strided(m, stride), "attn_block_mask_add_strided");
    sp_or_window(g, sel, left, right);
    sp_and_docs(g, sel, dq, dk);
    sp_or_keys(g, sel, keys, 2, 0);
    sp_or_keys(g, sel, queries, 1, 1);
    sp_or_strided(g, sel, stride);
    finish_case(g, m, sel, what);
    free(sel);
    free(dq);
    free(dk);
  }
}

/* Numerics on composed patterns: the builders' mask in the plan, their
 * test-side matrix in the reference. */
typedef enum composed { CAUSAL_WINDOW_SINKS, BIGBIRD, DOCUMENTS_CAUSAL, STRIDED_LOCAL } composed;

typedef struct composed_case {
  nc_case base;
  int64_t block_q, block_kv;
  composed pattern;
  int empty_rows; /* the pattern and the plan's mask leave some rows without a key */
} composed_case;

/* Rows of every sequence that see no key under the plan's dense mask AND sel. */
static int64_t count_empty_rows(const nc_case *c, const sp_geom *g, const unsigned char *sel) {
  const int64_t left = c->mask == WINDOW ? c->left : -1;
  const int64_t right = c->mask == NONE ? -1 : c->mask == CAUSAL ? 0 : c->right;
  int64_t b, i, j, empty = 0;
  for (b = 0; b < g->batch; ++b)
    for (i = 0; i < g->lq; ++i) {
      int seen = 0;
      for (j = 0; j < g->lk && !seen; ++j)
        seen = sel[(size_t)b * sp_plane_size(g) + (size_t)(i * g->lk + j)] &&
               ref_mask_visible(g->lq, g->lk, left, right, i, j);
      empty += !seen;
    }
  return empty;
}

static void run_composed(void **state) {
  const composed_case *cc = (const composed_case *)*state;
  nc_case c = cc->base;
  const sp_geom g = {c.batch, 1, c.seqlen_q, c.seqlen_kv, cc->block_q, cc->block_kv};
  unsigned char *sel = (unsigned char *)xcalloc(sp_matrix_size(&g), 1);
  attn_block_mask_t m = new_mask(&g);
  tu_rng rng = tu_rng_for(c.name);
  int64_t sinks[8], globals[2], k, b;
  int32_t *dq = (int32_t *)xcalloc((size_t)(g.batch * g.lq), sizeof(int32_t));
  int32_t *dk = (int32_t *)xcalloc((size_t)(g.batch * g.lk), sizeof(int32_t));
  for (k = 0; k < 8; ++k) sinks[k] = k;
  switch (cc->pattern) {
    case CAUSAL_WINDOW_SINKS: /* a window not aligned with the blocks, 8 sink keys */
      check(attn_block_mask_add_window(m, 70, 0), "add_window");
      check(attn_block_mask_add_global_keys(m, sinks, 8), "add_global_keys");
      sp_or_window(&g, sel, 70, 0);
      sp_or_keys(&g, sel, sinks, 8, 0);
      break;
    case BIGBIRD: /* window of one block each side, first block global, 2 random */
      globals[0] = 0, globals[1] = 1;
      check(attn_block_mask_add_window(m, g.bk, g.bk), "add_window");
      check(attn_block_mask_add_global_keys(m, globals, 2), "add_global_keys");
      check(attn_block_mask_add_global_queries(m, globals, 2), "add_global_queries");
      check(attn_block_mask_add_random_blocks(m, 2, 20240611u), "add_random_blocks");
      sp_or_window(&g, sel, g.bk, g.bk);
      sp_or_keys(&g, sel, globals, 2, 0);
      sp_or_keys(&g, sel, globals, 2, 1);
      sp_or_random_blocks(&g, sel, 2, 20240611u);
      break;
    case DOCUMENTS_CAUSAL: /* packed documents; the plan is causal */
      for (b = 0; b < g.batch; ++b) sp_draw_docs(&rng, dq + b * g.lq, g.lq, 70);
      if (g.lq == g.lk) {
        memcpy(dk, dq, (size_t)(g.batch * g.lq) * sizeof(int32_t));
      } else {
        /* other cuts, and query 0 a padding token (document -1 has no key):
         * a query whose document has no key up to its diagonal sees none */
        for (b = 0; b < g.batch; ++b) {
          sp_draw_docs(&rng, dk + b * g.lk, g.lk, 70);
          dq[b * g.lq] = -1;
        }
      }
      check(attn_block_mask_add_window(m, -1, -1), "add_window");
      check(attn_block_mask_and_documents(m, dq, dk), "and_documents");
      sp_or_window(&g, sel, -1, -1);
      sp_and_docs(&g, sel, dq, dk);
      break;
    case STRIDED_LOCAL: /* Sparse Transformer: local window + strided (with a causal plan) */
      check(attn_block_mask_add_window(m, 15, 0), "add_window");
      check(attn_block_mask_add_strided(m, 16), "add_strided");
      sp_or_window(&g, sel, 15, 0);
      sp_or_strided(&g, sel, 16);
      break;
  }
  if ((count_empty_rows(&c, &g, sel) > 0) != cc->empty_rows)
    fail_msg("case error: the pattern leaves %lld rows empty",
             (long long)count_empty_rows(&c, &g, sel));
  c.block_mask = m;
  c.pair_mask = sel;
  c.mask_batch = g.batch;
  c.mask_heads = 1;
  nc_run(&c);
  check(attn_block_mask_destroy(m), "attn_block_mask_destroy");
  free(sel);
  free(dq);
  free(dk);
}

static const composed_case kComposed[] = {
    {CASE("causal_window70_sinks8_b48_bf16", BF16, SHAPE(1, 4, 2, 300, 300, 32), .mask = CAUSAL,
          .threads = 2),
     48, 48, CAUSAL_WINDOW_SINKS, 0},
    {CASE("bigbird_b32_fp32", FP32, SHAPE(2, 2, 1, 256, 256, 32), .threads = 2), 32, 32, BIGBIRD,
     0},
    {CASE("documents_causal_b64_fp16", FP16, SHAPE(2, 2, 2, 250, 250, 32), .mask = CAUSAL,
          .threads = 1),
     64, 64, DOCUMENTS_CAUSAL, 0},
    {CASE("strided16_causal_b16_fp32", FP32, SHAPE(1, 2, 2, 200, 200, 16), .mask = CAUSAL,
          .threads = 2),
     16, 16, STRIDED_LOCAL, 0},
    /* Odd lengths, seqlen_q != seqlen_kv, blocks that divide neither, and
     * rows left empty (the first queries of a causal or window plan with
     * seqlen_q > seqlen_kv, queries whose document has no key up to their
     * diagonal), which the plan then must be allowed to have. */
    {CASE("causal_window70_sinks8_173x131_gqa_empty_fp32", FP32, SHAPE(1, 4, 2, 173, 131, 16),
          .mask = CAUSAL, .threads = 2),
     48, 40, CAUSAL_WINDOW_SINKS, 1},
    {CASE("bigbird_97_b16x24_gqa_bf16", BF16, SHAPE(2, 2, 1, 97, 97, 24), .threads = 1), 16, 24,
     BIGBIRD, 0},
    {CASE("documents_causal_131x173_empty_fp16", FP16, SHAPE(2, 2, 2, 131, 173, 32),
          .mask = CAUSAL, .threads = 2),
     32, 48, DOCUMENTS_CAUSAL, 1},
    {CASE("strided16_window_131x97_empty_fp32", FP32, SHAPE(1, 2, 1, 131, 97, 16), WIN(60, 0),
          .threads = 1),
     13, 16, STRIDED_LOCAL, 1},
};

int main(void) {
  enum {
    N = sizeof kCases / sizeof kCases[0],
    NC = sizeof kComposed / sizeof kComposed[0],
    NT = 1 + N + NC
  };
  struct CMUnitTest tests[NT];
  size_t i;
  int rc = nc_isa_gate();
  if (rc != 0) return rc;
  memset(tests, 0, sizeof tests);
  tests[0].name = "builders_match_dense";
  tests[0].test_func = test_builders_match_dense;
  for (i = 0; i < N; ++i) {
    tests[1 + i].name = kCases[i].base.name;
    tests[1 + i].test_func = run_sparse;
    tests[1 + i].initial_state = (void *)&kCases[i];
  }
  for (i = 0; i < NC; ++i) {
    tests[1 + N + i].name = kComposed[i].base.name;
    tests[1 + N + i].test_func = run_composed;
    tests[1 + N + i].initial_state = (void *)&kComposed[i];
  }
  return _cmocka_run_group_tests("block-sparse", tests, NT, NULL, NULL);
}
