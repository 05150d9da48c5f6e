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

/* attn_plan_create must fail with `status` naming `word`, leaving *plan. */
static void expect_plan_fails(attn_plan_desc_t desc, attn_status_t status, const char *word,
                              const char *file, int line) {
  attn_plan_t plan;
  POISON_VAR(plan);
  check_status(attn_plan_create(g_ctx, desc, &plan), status, word, "attn_plan_create", file, line);
  check_poisoned(&plan, sizeof plan, "plan", file, line);
}
#define EXPECT_PLAN_FAILS(desc, status, word) expect_plan_fails(desc, status, word, __FILE__, __LINE__)

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
  assert_true(info.visible_pairs == 0 && info.visited_tile_pairs == 0 && info.total_tile_pairs == 0);
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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_many_heads_empty_sequences),
      cmocka_unit_test(test_visible_pairs_saturate),
      cmocka_unit_test(test_moba_workspace_past_64_bits),
      cmocka_unit_test(test_moba_extremes),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
