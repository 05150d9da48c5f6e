/* Integer limits of every size a caller passes: values near 2^31, 2^62 and
 * INT64_MAX, and products of valid values that pass 64 bits (elements,
 * pairs, workspace bytes, page pools, block tables). Each must give the
 * documented status with a message naming the argument, change nothing and
 * leak nothing (also run under valgrind and the sanitizers), or, where attn.h
 * says so, work (statistics saturate, a reach past every key is unbounded).
 * No test allocates what the hostile sizes describe: they fail, or succeed,
 * before anything of that size exists.
 *
 * C99. */
#include "api_check.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define INVALID ATTN_STATUS_INVALID_ARGUMENT
#define I64(x) ((int64_t)(x))
#define P2(n) (I64(1) << (n))

static attn_context_t g_ctx; /* CPU, one thread */

static int group_setup(void **state) {
  (void)state;
  return attn_context_create(ATTN_BACKEND_CPU, 0, 1, &g_ctx) == ATTN_STATUS_SUCCESS ? 0 : -1;
}

static int group_teardown(void **state) {
  (void)state;
  return attn_context_destroy(g_ctx) == ATTN_STATUS_SUCCESS ? 0 : -1;
}

/* A descriptor of the given shape (no mask, forward only). */
static attn_plan_desc_t shape_desc(int64_t batch, int64_t hq, int64_t hkv, int64_t lq, int64_t lk,
                                   int64_t d) {
  attn_plan_desc_t desc = NULL;
  CHECK_OK(attn_plan_desc_create(&desc));
  CHECK_OK(attn_plan_desc_set_shape(desc, batch, hq, hkv, lq, lk, d, d));
  return desc;
}

/* The summary line of a plan made from desc ("" if that fails): what a
 * failed setter must leave as it was. */
static void summary_of(attn_plan_desc_t desc, char *out, size_t cap) {
  attn_plan_t plan = NULL;
  out[0] = '\0';
  if (attn_plan_create(g_ctx, desc, &plan) != ATTN_STATUS_SUCCESS) return;
  CHECK_OK(attn_plan_summary(plan, out, cap, NULL));
  CHECK_OK(attn_plan_destroy(plan));
}

/* attn_plan_create must fail with `status` naming `word`, leaving *plan. */
static void expect_plan_fails(attn_plan_desc_t desc, attn_status_t status, const char *word,
                              const char *file, int line) {
  attn_plan_t plan;
  POISON_VAR(plan);
  check_status(attn_plan_create(g_ctx, desc, &plan), status, word, "attn_plan_create", file, line);
  check_poisoned(&plan, sizeof plan, "plan", file, line);
}
#define EXPECT_PLAN_FAILS(desc, status, word) \
  expect_plan_fails(desc, status, word, __FILE__, __LINE__)

/* ------------------------------------------------------------------------ */
/* Plan descriptors: shape, varlen batch                                     */
/* ------------------------------------------------------------------------ */

static void test_shape_ranges(void **state) {
  attn_plan_desc_t d = shape_desc(2, 4, 2, 5, 7, 8);
  char before[512], after[512];
  (void)state;
  summary_of(d, before, sizeof before);
  assert_true(before[0] != '\0');
  /* Each count is at most 2^31 - 1, also where the element count is 0 (a
   * batch of INT64_MAX empty sequences used to reach plan creation, whose
   * offsets then failed to allocate as an internal error). */
  EXPECT_FAIL(INVALID, "batch", attn_plan_desc_set_shape(d, INT64_MAX, 1, 1, 0, 0, 8, 8));
  EXPECT_FAIL(INVALID, "batch", attn_plan_desc_set_shape(d, P2(31), 1, 1, 1, 1, 8, 8));
  EXPECT_FAIL(INVALID, "heads_q", attn_plan_desc_set_shape(d, 1, INT64_MAX, 1, 0, 0, 8, 8));
  EXPECT_FAIL(INVALID, "heads_q", attn_plan_desc_set_shape(d, 1, P2(31), 1, 1, 1, 8, 8));
  EXPECT_FAIL(INVALID, "heads_kv", attn_plan_desc_set_shape(d, 1, 1, P2(31), 0, 0, 8, 8));
  EXPECT_FAIL(INVALID, "seqlen_q", attn_plan_desc_set_shape(d, 1, 1, 1, P2(31), 1, 1, 1));
  EXPECT_FAIL(INVALID, "seqlen_q", attn_plan_desc_set_shape(d, 1, 1, 1, P2(62), 1, 1, 1));
  EXPECT_FAIL(INVALID, "seqlen_kv", attn_plan_desc_set_shape(d, 1, 1, 1, 1, INT64_MAX, 1, 1));
  EXPECT_FAIL(INVALID, "head_dim_qk", attn_plan_desc_set_shape(d, 1, 1, 1, 1, 1, INT64_MAX, 1));
  EXPECT_FAIL(INVALID, "head_dim_v", attn_plan_desc_set_shape(d, 1, 1, 1, 1, 1, 1, INT64_MIN));
  /* Valid counts whose product of elements passes 9e15. */
  EXPECT_FAIL(INVALID, "shape",
              attn_plan_desc_set_shape(d, P2(31) - 1, P2(31) - 1, 1, P2(31) - 1, 1, 1024, 1024));
  EXPECT_FAIL(INVALID, "shape", attn_plan_desc_set_shape(d, 1, P2(13), 1, P2(31) - 1, 1, 1024, 1));
  summary_of(d, after, sizeof after);
  assert_string_equal(before, after);
  /* The largest of each is accepted. */
  EXPECT_OK(attn_plan_desc_set_shape(d, P2(31) - 1, 1, 1, 1, 1, 1, 1));
  EXPECT_OK(attn_plan_desc_set_shape(d, 1, P2(31) - 1, P2(31) - 1, 1, 1, 1, 1));
  EXPECT_OK(attn_plan_desc_set_shape(d, 1, 1, 1, P2(31) - 1, P2(31) - 1, 1, 1));
  CHECK_OK(attn_plan_desc_destroy(d));
}

static void test_varlen_batch_range(void **state) {
  attn_plan_desc_t d = shape_desc(1, 2, 2, 4, 4, 8);
  const int32_t cu[3] = {0, 2, 4};
  char before[512], after[512];
  (void)state;
  summary_of(d, before, sizeof before);
  /* Refused before batch + 1 offsets are read from the arrays (or copied:
   * INT64_MAX + 1 of them used to be an internal error). */
  EXPECT_FAIL(INVALID, "batch", attn_plan_desc_set_varlen(d, INT64_MAX, cu, cu));
  EXPECT_FAIL(INVALID, "batch", attn_plan_desc_set_varlen(d, P2(31), cu, cu));
  EXPECT_FAIL(INVALID, "batch", attn_plan_desc_set_varlen(d, INT64_MIN, cu, cu));
  summary_of(d, after, sizeof after);
  assert_string_equal(before, after);
  EXPECT_OK(attn_plan_desc_set_varlen(d, 2, cu, cu));
  CHECK_OK(attn_plan_desc_destroy(d));
}

/* ------------------------------------------------------------------------ */
/* Plans: head counts, pair counts and workspaces past 64 bits               */
/* ------------------------------------------------------------------------ */

/* 2^31 - 1 query heads over empty sequences: plan creation must not walk
 * the heads one by one for every sequence (it used to, per tile pair). */
static void test_many_heads_empty_sequences(void **state) {
  attn_plan_desc_t d = shape_desc(4, P2(31) - 1, 1, 0, 0, 8);
  attn_plan_t plan = NULL;
  attn_plan_info_t info;
  (void)state;
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_true(info.visible_pairs == 0 && info.visited_tile_pairs == 0);
  assert_true(info.total_tile_pairs == 0);
  CHECK_OK(attn_plan_destroy(plan));
  CHECK_OK(attn_plan_desc_destroy(d));
}

/* 3 x (2^31 - 1) heads x 2^16 x 2^16 pairs: about 1.5 x 2^64 visible pairs.
 * The count saturates at UINT64_MAX (it used to wrap to a small number);
 * the FLOP count, a double, stays exact. */
static void test_visible_pairs_saturate(void **state) {
  const int64_t hq = P2(31) - 1, l = P2(16);
  attn_plan_desc_t d = shape_desc(3, hq, 1, l, l, 1);
  attn_plan_t plan = NULL;
  attn_plan_info_t info;
  double pairs = 3.0 * (double)hq * (double)l * (double)l;
  (void)state;
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_true(info.visible_pairs == UINT64_MAX);
  assert_true(fabs(info.flops_forward - 4.0 * pairs) <= 1e-12 * 4.0 * pairs);
  /* Tile pairs still fit: ceil(2^16 / tile)^2 per head. */
  assert_true(info.total_tile_pairs > 0 && info.total_tile_pairs < UINT64_MAX);
  assert_true(info.visited_tile_pairs == info.total_tile_pairs);
  CHECK_OK(attn_plan_destroy(plan));
  CHECK_OK(attn_plan_desc_destroy(d));
}

/* MoBA with blocks of 1 key: the selection holds a bit per (row, key block)
 * and query head, 2^20 heads x 2^24 rows x 2^24 blocks = 2^65 bytes. Its size
 * used to wrap in 64 bits into a workspace far too small, which execution
 * would have written past. */
static void test_moba_workspace_past_64_bits(void **state) {
  attn_plan_desc_t d = shape_desc(1, P2(20), 1, P2(24), P2(24), 1);
  (void)state;
  CHECK_OK(attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, -1));
  CHECK_OK(attn_plan_desc_set_moba(d, 1, 1, 0));
  EXPECT_PLAN_FAILS(d, INVALID, "workspace");
  /* The same with one selection per group: the group of 2^20 heads
   * shares one bit row, 2^45 bytes, which is a valid (if large) size. */
  CHECK_OK(attn_plan_desc_set_moba(d, 1, 1, 1));
  {
    attn_plan_t plan = NULL;
    size_t bytes = 0;
    EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
    EXPECT_OK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &bytes));
    assert_true(bytes >= ((size_t)1 << 45));
    CHECK_OK(attn_plan_destroy(plan));
  }
  CHECK_OK(attn_plan_desc_destroy(d));
}

/* top_k and block_size at their extremes: a top_k that covers every past
 * block (INT64_MAX does) is the dense causal plan; so is a block longer
 * than the keys. */
static void test_moba_extremes(void **state) {
  attn_plan_desc_t d = shape_desc(1, 2, 2, 300, 300, 8);
  attn_plan_t plan = NULL;
  attn_plan_info_t info;
  (void)state;
  CHECK_OK(attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, -1));
  CHECK_OK(attn_plan_desc_set_moba(d, 1, INT64_MAX, 0));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  info.struct_size = sizeof info;
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_true(strncmp(info.algorithm, "moba-keeps-every-block:", 23) == 0);
  CHECK_OK(attn_plan_destroy(plan));
  CHECK_OK(attn_plan_desc_set_moba(d, 65536, 0, 1));
  EXPECT_OK(attn_plan_create(g_ctx, d, &plan));
  EXPECT_OK(attn_plan_describe(plan, &info));
  assert_true(strncmp(info.algorithm, "moba-keeps-every-block:", 23) == 0);
  CHECK_OK(attn_plan_destroy(plan));
  EXPECT_FAIL(INVALID, "block_size", attn_plan_desc_set_moba(d, 65537, 0, 0));
  EXPECT_FAIL(INVALID, "block_size", attn_plan_desc_set_moba(d, INT64_MAX, 0, 0));
  EXPECT_FAIL(INVALID, "top_k", attn_plan_desc_set_moba(d, 64, INT64_MIN, 0));
  CHECK_OK(attn_plan_desc_destroy(d));
}

/* ------------------------------------------------------------------------ */
/* Tensor descriptors: dims and strides whose reach passes 2^60 elements     */
/* ------------------------------------------------------------------------ */

static void expect_desc_is(attn_tensor_desc_t t, int32_t ndim, const int64_t *dims,
                           const int64_t *strides) {
  attn_dtype_t dtype;
  int32_t n = 0, i;
  int64_t got_dims[ATTN_MAX_DIMS], got_strides[ATTN_MAX_DIMS];
  CHECK_OK(attn_tensor_desc_get(t, &dtype, &n, got_dims, got_strides));
  assert_int_equal(n, ndim);
  for (i = 0; i < ndim; ++i) {
    assert_true(got_dims[i] == dims[i]);
    assert_true(got_strides[i] == strides[i]);
  }
}

static void test_tensor_desc_reach(void **state) {
  attn_tensor_desc_t t = NULL;
  const int64_t dims[2] = {3, 5}, strides[2] = {5, 1};
  (void)state;
  CHECK_OK(attn_tensor_desc_create(&t));
  CHECK_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP16, 2, dims, strides));
  {
    /* More elements than 2^60, by count: the default strides would
     * overflow int64 (2^40 x 2^40), also behind a dim of 0. */
    const int64_t big[2] = {P2(40), P2(40)}, hidden[3] = {0, P2(62), P2(62)};
    const int64_t over[3] = {P2(20), P2(20), P2(20) + 1};
    EXPECT_FAIL(INVALID, "dims", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 2, big, NULL));
    EXPECT_FAIL(INVALID, "dims", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 3, hidden, NULL));
    EXPECT_FAIL(INVALID, "dims", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 3, over, NULL));
  }
  {
    /* By reach: strides whose last element lies 2^60 or more elements from
     * the first; (dims - 1) x strides used to overflow int64 in the
     * offsets (and in the overlap check of output tensors). */
    const int64_t d2[2] = {4, 8}, s_far[2] = {P2(62), 1}, s_max[2] = {INT64_MAX, INT64_MAX};
    const int64_t d_edge[2] = {2, 1}, s_edge[2] = {P2(60), 1};
    EXPECT_FAIL(INVALID, "strides", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 2, d2, s_far));
    EXPECT_FAIL(INVALID, "strides", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 2, d2, s_max));
    EXPECT_FAIL(INVALID, "strides", attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 2, d_edge, s_edge));
  }
  expect_desc_is(t, 2, dims, strides);
  {
    /* The edges that fit: 2^60 elements by count, a last element 2^60 - 1
     * past the first, and any stride of a tensor without elements. */
    const int64_t full[2] = {P2(30), P2(30)}, d_edge[2] = {2, 1}, s_edge[2] = {P2(60) - 1, 1};
    const int64_t d_empty[2] = {0, 4}, s_empty[2] = {INT64_MAX, 1};
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 2, full, NULL));
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 2, d_edge, s_edge));
    EXPECT_OK(attn_tensor_desc_set(t, ATTN_DTYPE_FP32, 2, d_empty, s_empty));
  }
  CHECK_OK(attn_tensor_desc_destroy(t));
}

/* attn_merge_states takes its shapes from descriptors, so their bounds
 * bound every offset it forms; num_parts only counts the caller's arrays:
 * INT32_MAX parts over an O without rows reads none of them. */
static void test_merge_extremes(void **state) {
  attn_tensor_desc_t o = NULL, l = NULL;
  const int64_t od[3] = {0, P2(20), 64}, ld[2] = {0, P2(20)};
  const void *o_parts[1] = {NULL};
  const float *lse_parts[1] = {NULL};
  (void)state;
  CHECK_OK(attn_tensor_desc_create(&o));
  CHECK_OK(attn_tensor_desc_create(&l));
  CHECK_OK(attn_tensor_desc_set(o, ATTN_DTYPE_FP32, 3, od, NULL));
  CHECK_OK(attn_tensor_desc_set(l, ATTN_DTYPE_FP32, 2, ld, NULL));
  EXPECT_OK(attn_merge_states(g_ctx, INT32_MAX, o, l, o_parts, lse_parts, NULL, NULL, NULL));
  EXPECT_FAIL(INVALID, "num_parts",
              attn_merge_states(g_ctx, INT32_MIN, o, l, o_parts, lse_parts, NULL, NULL, NULL));
  CHECK_OK(attn_tensor_desc_destroy(o));
  CHECK_OK(attn_tensor_desc_destroy(l));
}

/* ------------------------------------------------------------------------ */
/* Block masks                                                               */
/* ------------------------------------------------------------------------ */

static void test_block_mask_create_ranges(void **state) {
  attn_block_mask_t m;
  (void)state;
  POISON_VAR(m);
  /* seqlen + block - 1 overflowed int64 for seqlen near INT64_MAX, and the
   * negative block count that came out passed every check. */
  EXPECT_FAIL(INVALID, "seqlen_q", attn_block_mask_create(1, 1, INT64_MAX, 8, 2, 2, &m));
  EXPECT_FAIL(INVALID, "seqlen_kv", attn_block_mask_create(1, 1, 8, INT64_MAX, 4, 4, &m));
  EXPECT_FAIL(INVALID, "seqlen_q", attn_block_mask_create(1, 1, P2(31), 8, 4, 4, &m));
  EXPECT_FAIL(INVALID, "seqlen_kv", attn_block_mask_create(1, 1, 8, P2(47), 65536, 65536, &m));
  EXPECT_FAIL(INVALID, "batch", attn_block_mask_create(INT64_MAX, INT64_MAX, 1, 1, 1, 1, &m));
  EXPECT_VAR_UNTOUCHED(m);
  EXPECT_OK(attn_block_mask_create(1, 1, P2(31) - 1, P2(31) - 1, 65536, 65536, &m));
  CHECK_OK(attn_block_mask_destroy(m));
}

/* The tables of a mask, read back: equal contents read back equal. */
typedef struct tables {
  int32_t max_partial, max_full, rows;
  size_t tile_bytes;
  int32_t *num, *idx, *fnum, *fidx;
  uint8_t *bits;
} tables;

static tables read_tables(attn_block_mask_t m, int32_t rows, size_t tile_bytes) {
  tables t;
  CHECK_OK(attn_block_mask_get_max_blocks(m, &t.max_partial, &t.max_full));
  if (t.max_partial < 1) t.max_partial = 1;
  if (t.max_full < 1) t.max_full = 1;
  t.rows = rows, t.tile_bytes = tile_bytes;
  t.num = xmalloc((size_t)rows * 4), t.fnum = xmalloc((size_t)rows * 4);
  t.idx = xmalloc((size_t)rows * (size_t)t.max_partial * 4);
  t.fidx = xmalloc((size_t)rows * (size_t)t.max_full * 4);
  t.bits = xmalloc((size_t)rows * (size_t)t.max_partial * tile_bytes);
  CHECK_OK(attn_block_mask_get_blocks(m, t.num, t.idx, t.max_partial, t.bits, t.fnum, t.fidx,
                                      t.max_full));
  return t;
}

static void free_tables(tables *t) {
  free(t->num), free(t->fnum), free(t->idx), free(t->fidx), free(t->bits);
}

static void expect_same_tables(attn_block_mask_t a, attn_block_mask_t b, int32_t rows,
                               size_t tile_bytes) {
  tables x = read_tables(a, rows, tile_bytes), y = read_tables(b, rows, tile_bytes);
  assert_int_equal(x.max_partial, y.max_partial);
  assert_int_equal(x.max_full, y.max_full);
  assert_memory_equal(x.num, y.num, (size_t)rows * 4);
  assert_memory_equal(x.fnum, y.fnum, (size_t)rows * 4);
  assert_memory_equal(x.idx, y.idx, (size_t)rows * (size_t)x.max_partial * 4);
  assert_memory_equal(x.fidx, y.fidx, (size_t)rows * (size_t)x.max_full * 4);
  assert_memory_equal(x.bits, y.bits, (size_t)rows * (size_t)x.max_partial * tile_bytes);
  free_tables(&x), free_tables(&y);
}

/* Strides up to INT64_MAX select exactly the keys j with d(i) - j a
 * multiple of the stride, as the materialised mask does. ((d - j) % s + s)
 * overflowed for s near INT64_MAX, and then selected keys 2 below the
 * diagonal (INT64_MIN + 1 is a multiple of INT64_MAX). */
static void test_block_mask_strided_extremes(void **state) {
  const int64_t strides[] = {1, 2, 3, 7, 13, P2(31) - 1, P2(62), INT64_MAX - 1, INT64_MAX};
  const int64_t lq = 9, lk = 14, bq = 4, bk = 4; /* d(i) = i + 5 */
  const int32_t rows = 3;
  const size_t tile_bytes = (size_t)ATTN_BLOCK_MASK_TILE_BYTES(bq, bk);
  uint8_t visible[9 * 14];
  size_t k;
  (void)state;
  for (k = 0; k < sizeof strides / sizeof strides[0]; ++k) {
    attn_block_mask_t by_rule = NULL, by_matrix = NULL;
    int64_t i, j;
    for (i = 0; i < lq; ++i)
      for (j = 0; j < lk; ++j) {
        /* small x: its remainder by any stride is exact */
        const int64_t x = i + (lk - lq) - j;
        visible[i * lk + j] = (uint8_t)(x % strides[k] == 0);
      }
    CHECK_OK(attn_block_mask_create(1, 1, lq, lk, bq, bk, &by_rule));
    CHECK_OK(attn_block_mask_create(1, 1, lq, lk, bq, bk, &by_matrix));
    EXPECT_OK(attn_block_mask_add_strided(by_rule, strides[k]));
    EXPECT_OK(attn_block_mask_add_dense(by_matrix, visible));
    expect_same_tables(by_rule, by_matrix, rows, tile_bytes);
    CHECK_OK(attn_block_mask_destroy(by_rule));
    CHECK_OK(attn_block_mask_destroy(by_matrix));
  }
}

/* Tables whose claimed size passes 2^62 bytes: refused before anything is
 * read (the dummy arrays here hold one entry) or written. */
static void test_block_mask_table_sizes(void **state) {
  attn_block_mask_t m = NULL;
  int32_t num[1] = {0}, idx[1] = {0};
  uint8_t bits[1] = {0};
  int32_t out_num[4], out_idx[4], out_fnum[4], out_fidx[4];
  uint8_t out_bits[4];
  (void)state;
  /* 2^14 rows of 65536 x 65536-bit tiles: 2^14 x (2^31 - 1) x 2^29 bytes. */
  CHECK_OK(attn_block_mask_create(1, 1, P2(30), 8, 65536, 65536, &m));
  EXPECT_FAIL(INVALID, "max_partial",
              attn_block_mask_set_blocks(m, num, idx, INT32_MAX, bits, NULL, NULL, 0));
  EXPECT_FAIL(INVALID, "max_partial",
              attn_block_mask_set_device_blocks(m, g_ctx, NULL, num, idx, INT32_MAX, bits, NULL,
                                                NULL, 0));
  poison(out_num, sizeof out_num), poison(out_idx, sizeof out_idx);
  poison(out_fnum, sizeof out_fnum), poison(out_fidx, sizeof out_fidx);
  poison(out_bits, sizeof out_bits);
  EXPECT_FAIL(INVALID, "max_partial",
              attn_block_mask_get_blocks(m, out_num, out_idx, INT32_MAX, out_bits, out_fnum,
                                         out_fidx, 1));
  EXPECT_UNTOUCHED(out_num, sizeof out_num);
  EXPECT_UNTOUCHED(out_idx, sizeof out_idx);
  EXPECT_UNTOUCHED(out_fnum, sizeof out_fnum);
  EXPECT_UNTOUCHED(out_fidx, sizeof out_fidx);
  EXPECT_UNTOUCHED(out_bits, sizeof out_bits);
  CHECK_OK(attn_block_mask_destroy(m));
}

/* A materialised mask of 2 x (2^31 - 1)^2 bytes: its index overflowed
 * int64; now refused before a byte of it is read. */
static void test_block_mask_dense_size(void **state) {
  attn_block_mask_t m = NULL;
  uint8_t visible[1] = {1};
  int32_t max_partial = -1, max_full = -1;
  (void)state;
  CHECK_OK(attn_block_mask_create(2, 1, P2(31) - 1, P2(31) - 1, 65536, 65536, &m));
  EXPECT_FAIL(INVALID, "visible", attn_block_mask_add_dense(m, visible));
  CHECK_OK(attn_block_mask_get_max_blocks(m, &max_partial, &max_full));
  assert_int_equal(max_partial, 0);
  assert_int_equal(max_full, 0);
  CHECK_OK(attn_block_mask_destroy(m));
}

/* The tile size macro in 64-bit arithmetic: with int arguments at the
 * largest block size (2^32 bits) it used to overflow an int. */
static void test_tile_bytes_macro(void **state) {
  const int bq = 65536, bk = 65536, small_q = 8, small_k = 13;
  (void)state;
  assert_true(ATTN_BLOCK_MASK_TILE_BYTES(bq, bk) == (uint64_t)536870912);
  assert_true(ATTN_BLOCK_MASK_TILE_BYTES(small_q, small_k) == 13);
  assert_true(ATTN_BLOCK_MASK_TILE_BYTES(1, 1) == 1);
}

/* ------------------------------------------------------------------------ */
/* Contexts: thread counts                                                   */
/* ------------------------------------------------------------------------ */

/* Each thread has scratch in every workspace, and an OpenMP runtime that
 * cannot start a team exits the process: counts past 4096 are refused. */
static void test_context_threads(void **state) {
  attn_context_t ctx;
  int32_t n = 0;
  (void)state;
  POISON_VAR(ctx);
  EXPECT_FAIL(INVALID, "num_threads", attn_context_create(ATTN_BACKEND_CPU, 0, 4097, &ctx));
  EXPECT_FAIL(INVALID, "num_threads", attn_context_create(ATTN_BACKEND_CPU, 0, INT32_MAX, &ctx));
  EXPECT_FAIL(INVALID, "num_threads", attn_context_create(ATTN_BACKEND_AUTO, 0, INT32_MAX, &ctx));
  EXPECT_VAR_UNTOUCHED(ctx);
  EXPECT_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 4096, &ctx));
  CHECK_OK(attn_context_get_num_threads(ctx, &n));
  assert_true(n == 4096 || n == 1); /* 1 without OpenMP */
  CHECK_OK(attn_context_destroy(ctx));
}

/* ------------------------------------------------------------------------ */
/* KV caches and decode plans                                                */
/* ------------------------------------------------------------------------ */

static void expect_config_fails(attn_kv_cache_config_t c, const char *word, const char *file,
                                int line) {
  size_t bytes;
  attn_kv_cache_t cache;
  POISON_VAR(bytes);
  check_status(attn_kv_cache_memory_size(&c, &bytes), INVALID, word, "attn_kv_cache_memory_size",
               file, line);
  check_poisoned(&bytes, sizeof bytes, "bytes", file, line);
  POISON_VAR(cache);
  check_status(attn_kv_cache_create(g_ctx, &c, NULL, 0, &cache), INVALID, word,
               "attn_kv_cache_create", file, line);
  check_poisoned(&cache, sizeof cache, "cache", file, line);
}
#define EXPECT_CONFIG_FAILS(c, word) expect_config_fails(c, word, __FILE__, __LINE__)

static void test_kv_cache_config_sizes(void **state) {
  attn_kv_cache_config_t c;
  size_t bytes = 0;
  (void)state;
  /* A pool past 1e18 elements, by its page size (the message used to name
   * num_pages only), and 2^31 KV heads (indexed in 32 bits). */
  c = tu_kv_cache_config(ATTN_DTYPE_FP16, ATTN_KV_LAYOUT_NHD, INT64_MAX, 1, 1, 1, 1, 0, 0);
  EXPECT_CONFIG_FAILS(c, "page_size");
  c.page_size = P2(40), c.num_pages = P2(31) - 1;
  EXPECT_CONFIG_FAILS(c, "page_size");
  c = tu_kv_cache_config(ATTN_DTYPE_FP16, ATTN_KV_LAYOUT_HND, 16, 4, P2(31), 64, 64, 0, 0);
  EXPECT_CONFIG_FAILS(c, "heads_kv");
  c.heads_kv = INT64_MAX;
  EXPECT_CONFIG_FAILS(c, "heads_kv");
  /* Large but valid: its size is reported, nothing is allocated. */
  c = tu_kv_cache_config(ATTN_DTYPE_FP16, ATTN_KV_LAYOUT_NHD, P2(40), 1, 1, 1, 1, 0, 0);
  EXPECT_OK(attn_kv_cache_memory_size(&c, &bytes));
  assert_true(bytes >= ((size_t)4 << 40));
}

/* One decode step over two sequences of a small cache (fp32, NHD, pages of
 * 4, 2 KV heads of dim 8, 4 query heads), with kv_chunk_tokens `chunk`. */
static float *decode_step(attn_kv_cache_t cache, int64_t chunk, attn_decode_step_info_t *info) {
  attn_decode_config_t dc = tu_decode_config(4, 2, 1, chunk);
  attn_decode_plan_t plan = NULL;
  const int64_t ids[2] = {1, 2};
  const int32_t ql[2] = {1, 1};
  size_t bytes = 0;
  float q[2 * 4 * 8], *o = xmalloc(2 * 4 * 8 * 4);
  void *ws;
  fill_random(q, sizeof q / 4, 7);
  EXPECT_OK(attn_decode_plan_create(g_ctx, cache, &dc, &plan));
  EXPECT_OK(attn_decode_plan_workspace_size(plan, &bytes));
  ws = xmalloc(bytes);
  info->struct_size = sizeof *info;
  EXPECT_OK(attn_decode_prepare(plan, cache, 2, ids, ql, ws, bytes, info, NULL));
  EXPECT_OK(attn_decode_execute(plan, cache, q, o, NULL, ws, bytes, NULL));
  free(ws);
  CHECK_OK(attn_decode_plan_destroy(plan));
  return o;
}

/* num_seqs past the live sequences: refused before num_seqs ids are read
 * (the arrays hold 2) or a table of that many is reserved (2^31 - 1 used to
 * allocate 16 GB first). */
static void test_kv_append_num_seqs(void **state) {
  attn_kv_cache_config_t c = tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, 4, 8, 1, 4,
                                                4, 0, 0);
  attn_kv_cache_t cache = NULL;
  const int64_t ids[2] = {1, 2};
  const int32_t n[2] = {1, 1};
  float kv[2 * 4];
  attn_kv_cache_info_t info;
  int64_t len = -1;
  (void)state;
  fill_random(kv, 8, 3);
  CHECK_OK(attn_kv_cache_create(g_ctx, &c, NULL, 0, &cache));
  CHECK_OK(attn_kv_cache_add_sequence(cache, 1));
  CHECK_OK(attn_kv_cache_add_sequence(cache, 2));
  EXPECT_FAIL(INVALID, "num_seqs", attn_kv_cache_append(cache, INT32_MAX, ids, n, kv, kv, NULL));
  EXPECT_FAIL(INVALID, "num_seqs", attn_kv_cache_append(cache, 3, ids, n, kv, kv, NULL));
  info.struct_size = sizeof info;
  CHECK_OK(attn_kv_cache_get_info(cache, &info));
  assert_int_equal(info.pages_in_use, 0);
  CHECK_OK(attn_kv_cache_sequence_length(cache, 1, &len));
  assert_int_equal(len, 0);
  EXPECT_OK(attn_kv_cache_append(cache, 2, ids, n, kv, kv, NULL));
  CHECK_OK(attn_kv_cache_destroy(cache));
}

static void test_decode_limits(void **state) {
  attn_kv_cache_config_t c = tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, 4, 16, 2, 8,
                                                8, 0, 0);
  attn_kv_cache_t cache = NULL;
  attn_decode_config_t dc;
  attn_decode_plan_t plan;
  attn_decode_step_info_t split_info, whole_info;
  const int64_t ids[2] = {1, 2};
  const int32_t n[2] = {13, 22};
  float k[35 * 2 * 8], v[35 * 2 * 8], *split, *whole;
  (void)state;
  CHECK_OK(attn_kv_cache_create(g_ctx, &c, NULL, 0, &cache));
  CHECK_OK(attn_kv_cache_add_sequence(cache, 1));
  CHECK_OK(attn_kv_cache_add_sequence(cache, 2));
  fill_random(k, sizeof k / 4, 1), fill_random(v, sizeof v / 4, 2);
  CHECK_OK(attn_kv_cache_append(cache, 2, ids, n, k, v, NULL));

  /* max_kv_tokens of INT64_MAX: its pages per sequence were rounded up as
   * max_kv_tokens + page_size - 1, which overflowed into a negative count
   * that passed the size check and made a plan whose prepare then failed
   * as an INTERNAL_ERROR. */
  POISON_VAR(plan);
  dc = tu_decode_config(4, 2, 1, 0);
  dc.max_kv_tokens = INT64_MAX;
  EXPECT_FAIL(INVALID, "max_kv_tokens", attn_decode_plan_create(g_ctx, cache, &dc, &plan));
  dc.max_kv_tokens = P2(62);
  EXPECT_FAIL(INVALID, "max_kv_tokens", attn_decode_plan_create(g_ctx, cache, &dc, &plan));
  /* heads_q as a plan's: at most 2^31 - 1 (and a multiple of heads_kv). */
  dc = tu_decode_config(P2(31), 2, 1, 0);
  EXPECT_FAIL(INVALID, "heads_q", attn_decode_plan_create(g_ctx, cache, &dc, &plan));
  dc.heads_q = INT64_MAX - 1;
  EXPECT_FAIL(INVALID, "heads_q", attn_decode_plan_create(g_ctx, cache, &dc, &plan));
  /* The largest heads_q with the largest batch and query tokens, split
   * into chunks of a page: partial states past 2^62 bytes, refused. */
  dc = tu_decode_config(P2(31) - 2, P2(24), P2(24), 4);
  EXPECT_FAIL(INVALID, "config", attn_decode_plan_create(g_ctx, cache, &dc, &plan));
  EXPECT_VAR_UNTOUCHED(plan);

  /* kv_chunk_tokens of INT64_MAX is one chunk per sequence (its page count
   * overflowed the same way): the same output as never splitting. */
  split = decode_step(cache, INT64_MAX, &split_info);
  whole = decode_step(cache, -1, &whole_info);
  assert_memory_equal(split, whole, 2 * 4 * 8 * 4);
  assert_int_equal(split_info.split_sequences, 0);
  assert_int_equal(split_info.num_work_units, 2);
  assert_true(split_info.visible_pairs == whole_info.visible_pairs);
  free(split), free(whole);
  CHECK_OK(attn_kv_cache_destroy(cache));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shape_ranges),
      cmocka_unit_test(test_varlen_batch_range),
      cmocka_unit_test(test_many_heads_empty_sequences),
      cmocka_unit_test(test_visible_pairs_saturate),
      cmocka_unit_test(test_moba_workspace_past_64_bits),
      cmocka_unit_test(test_moba_extremes),
      cmocka_unit_test(test_tensor_desc_reach),
      cmocka_unit_test(test_merge_extremes),
      cmocka_unit_test(test_block_mask_create_ranges),
      cmocka_unit_test(test_block_mask_strided_extremes),
      cmocka_unit_test(test_block_mask_table_sizes),
      cmocka_unit_test(test_block_mask_dense_size),
      cmocka_unit_test(test_tile_bytes_macro),
      cmocka_unit_test(test_context_threads),
      cmocka_unit_test(test_kv_cache_config_sizes),
      cmocka_unit_test(test_kv_append_num_seqs),
      cmocka_unit_test(test_decode_limits),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
