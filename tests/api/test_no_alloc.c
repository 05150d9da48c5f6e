/* "Execution never allocates": attn_forward and attn_backward (dense,
 * block-sparse, MoBA and ring plans) and attn_decode_execute are run with
 * malloc and its relatives counted, after a first run that lets the thread
 * pools settle. Every call must return SUCCESS, write its outputs, and make
 * no allocation on any thread.
 *
 * The counting replaces malloc, calloc, realloc and the aligned variants in
 * this executable (the C++ runtime's operator new calls malloc) and
 * forwards them to glibc's __libc_* functions, so the test is built only on
 * glibc systems without sanitizers. It first checks that the counter sees
 * an allocation, so that it cannot pass by counting nothing.
 *
 * C99 + POSIX (pthreads). */
#define _GNU_SOURCE

#include "api_check.h"
#include "testutil.h"

#include <execinfo.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------ */
/* Counting allocator                                                        */
/* ------------------------------------------------------------------------ */

static atomic_int g_armed;
static atomic_long g_allocs;

/* The call stack of the first counted allocation, printed on failure. */
enum { kMaxFrames = 24 };
static void *g_first_frames[kMaxFrames];
static atomic_int g_first_depth;
static __thread int t_in_backtrace;

static void count_one(void) {
  if (!atomic_load_explicit(&g_armed, memory_order_relaxed) || t_in_backtrace) return;
  if (atomic_fetch_add_explicit(&g_allocs, 1, memory_order_relaxed) == 0) {
    t_in_backtrace = 1;
    atomic_store(&g_first_depth, backtrace(g_first_frames, kMaxFrames));
    t_in_backtrace = 0;
  }
}

/* Counts; never fails. */
static int alloc_hook_fails(void) {
  count_one();
  return 0;
}
static void *alloc_hook_new(void *p) { return p; }
static void alloc_hook_free(void *p) { (void)p; }
#include "replace_malloc.h"

static void arm(void) {
  atomic_store(&g_first_depth, 0);
  atomic_store(&g_allocs, 0);
  atomic_store(&g_armed, 1);
}
static long disarm(void) {
  atomic_store(&g_armed, 0);
  return atomic_load(&g_allocs);
}

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

static uint64_t g_seed;

/* Random non-zero values in [-1, -0.05] U [0.05, 1]. */
static float *random_floats(size_t n, uint64_t *state) {
  float *p = (float *)malloc(sizeof(float) * (n ? n : 1));
  for (size_t i = 0; i < n; ++i) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    const double u = (double)(*state >> 11) / 9007199254740992.0; /* [0, 1) */
    const double mag = 0.05 + 0.95 * u;
    p[i] = (float)((*state >> 7) & 1 ? mag : -mag);
  }
  return p;
}

/* NaN everywhere: outputs left unwritten stay NaN. */
static float *poisoned(size_t n) {
  float *p = (float *)malloc(sizeof(float) * (n ? n : 1));
  for (size_t i = 0; i < n; ++i) p[i] = NAN;
  return p;
}

static void poison_nan(float *p, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = NAN;
}

static void assert_written(const float *p, size_t n, const char *what) {
  for (size_t i = 0; i < n; ++i)
    if (isnan(p[i])) {
      print_error("%s[%zu] was not written\n", what, i);
      fail();
    }
}

static void expect_no_alloc(long count, const char *what) {
  if (count != 0) {
    print_error("%s made %ld allocation(s) (seed %llu); the first from:\n", what, count,
                (unsigned long long)g_seed);
    backtrace_symbols_fd(g_first_frames, atomic_load(&g_first_depth), 2);
    fail();
  }
}

/* ------------------------------------------------------------------------ */
/* The counter itself                                                        */
/* ------------------------------------------------------------------------ */

static void test_counter_counts(void **state) {
  (void)state;
  arm();
  void *volatile p = malloc(24);
  const long n = disarm();
  free(p);
  assert_true(n >= 1);
}

/* ------------------------------------------------------------------------ */
/* Plans of one process: dense, block-sparse, MoBA                           */
/* ------------------------------------------------------------------------ */

enum { PB = 2, PHQ = 4, PHKV = 2, PL = 200, PD = 32 };

typedef enum { KIND_DENSE, KIND_BLOCK_SPARSE, KIND_MOBA } plan_kind;

static void run_plan_without_alloc(plan_kind kind, const char *what) {
  uint64_t st = g_seed ^ (uint64_t)kind * 0x9E3779B97F4A7C15ull;
  attn_context_t ctx;
  attn_plan_desc_t desc;
  attn_plan_t plan;
  CHECK_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 2, &ctx));
  CHECK_OK(attn_plan_desc_create(&desc));
  CHECK_OK(attn_plan_desc_set_shape(desc, PB, PHQ, PHKV, PL, PL, PD, PD));
  CHECK_OK(attn_plan_desc_set_mask(desc, ATTN_MASK_CAUSAL, -1, -1));
  CHECK_OK(attn_plan_desc_set_passes(desc, ATTN_PASSES_FORWARD_BACKWARD));
  if (kind == KIND_BLOCK_SPARSE) {
    attn_block_mask_t mask;
    const int64_t sinks[2] = {0, 1};
    CHECK_OK(attn_block_mask_create(PB, PHKV, PL, PL, 32, 16, &mask));
    CHECK_OK(attn_block_mask_add_window(mask, 40, 0));
    CHECK_OK(attn_block_mask_add_global_keys(mask, sinks, 2));
    CHECK_OK(attn_block_mask_add_random_blocks(mask, 2, g_seed));
    CHECK_OK(attn_plan_desc_set_block_mask(desc, mask));
    CHECK_OK(attn_block_mask_destroy(mask));
  } else if (kind == KIND_MOBA) {
    CHECK_OK(attn_plan_desc_set_moba(desc, 32, 2, 1));
  }
  CHECK_OK(attn_plan_create(ctx, desc, &plan));

  const size_t nq = (size_t)PB * PL * PHQ * PD, nk = (size_t)PB * PL * PHKV * PD;
  const size_t nl = (size_t)PB * PHQ * PL;
  float *q = random_floats(nq, &st), *k = random_floats(nk, &st), *v = random_floats(nk, &st);
  float *d_o = random_floats(nq, &st);
  float *o = poisoned(nq), *lse = poisoned(nl);
  float *dq = poisoned(nq), *dk = poisoned(nk), *dv = poisoned(nk);
  size_t fwd_bytes, bwd_bytes;
  CHECK_OK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fwd_bytes));
  CHECK_OK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &bwd_bytes));
  void *ws = malloc(fwd_bytes > bwd_bytes ? fwd_bytes : bwd_bytes);

  for (int round = 0; round < 2; ++round) { /* round 0 lets the thread pool settle */
    poison_nan(o, nq), poison_nan(lse, nl);
    poison_nan(dq, nq), poison_nan(dk, nk), poison_nan(dv, nk);
    if (round == 1) arm();
    const attn_status_t f = attn_forward(plan, q, k, v, o, lse, ws, fwd_bytes, NULL);
    const attn_status_t b =
        attn_backward(plan, q, k, v, o, lse, d_o, dq, dk, dv, ws, bwd_bytes, NULL);
    const long n = disarm();
    CHECK_OK(f);
    CHECK_OK(b);
    assert_written(o, nq, "O");
    assert_written(lse, nl, "LSE");
    assert_written(dq, nq, "dQ");
    assert_written(dk, nk, "dK");
    assert_written(dv, nk, "dV");
    if (round == 1) expect_no_alloc(n, what);
  }

  free(ws);
  free(q), free(k), free(v), free(d_o), free(o), free(lse), free(dq), free(dk), free(dv);
  CHECK_OK(attn_plan_destroy(plan));
  CHECK_OK(attn_plan_desc_destroy(desc));
  CHECK_OK(attn_context_destroy(ctx));
}

static void test_dense(void **state) {
  (void)state;
  run_plan_without_alloc(KIND_DENSE, "dense forward + backward");
}
static void test_block_sparse(void **state) {
  (void)state;
  run_plan_without_alloc(KIND_BLOCK_SPARSE, "block-sparse forward + backward");
}
static void test_moba(void **state) {
  (void)state;
  run_plan_without_alloc(KIND_MOBA, "MoBA forward + backward");
}

/* ------------------------------------------------------------------------ */
/* Decode                                                                    */
/* ------------------------------------------------------------------------ */

static void test_decode_execute(void **state) {
  (void)state;
  enum { HKV = 2, HQ = 4, D = 16, PS = 8, NSEQ = 3, QL = 2 };
  uint64_t st = g_seed ^ 0xDEC0DEull;
  attn_context_t ctx;
  attn_kv_cache_t cache;
  attn_decode_plan_t plan;
  CHECK_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 2, &ctx));
  const attn_kv_cache_config_t cc =
      tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, PS, 64, HKV, D, D, 0, 0);
  CHECK_OK(attn_kv_cache_create(ctx, &cc, NULL, 0, &cache));

  int64_t ids[NSEQ];
  int32_t prompt[NSEQ] = {70, 9, 33}, qlens[NSEQ];
  int64_t total = 0;
  for (int i = 0; i < NSEQ; ++i) {
    ids[i] = 10 + i;
    qlens[i] = QL;
    total += prompt[i];
    CHECK_OK(attn_kv_cache_add_sequence(cache, ids[i]));
  }
  float *k = random_floats((size_t)total * HKV * D, &st);
  float *v = random_floats((size_t)total * HKV * D, &st);
  CHECK_OK(attn_kv_cache_append(cache, NSEQ, ids, prompt, k, v, NULL));

  /* kv chunks of 2 pages: split, so that the merge runs too */
  const attn_decode_config_t dc = tu_decode_config(HQ, NSEQ, QL, 2 * PS);
  CHECK_OK(attn_decode_plan_create(ctx, cache, &dc, &plan));
  size_t ws_bytes;
  CHECK_OK(attn_decode_plan_workspace_size(plan, &ws_bytes));
  void *ws = malloc(ws_bytes);
  attn_decode_step_info_t info;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  CHECK_OK(attn_decode_prepare(plan, cache, NSEQ, ids, qlens, ws, ws_bytes, &info, NULL));
  assert_true(info.split_sequences >= 1);

  const size_t nq = (size_t)NSEQ * QL * HQ * D, nl = (size_t)HQ * NSEQ * QL;
  float *q = random_floats(nq, &st), *o = poisoned(nq), *lse = poisoned(nl);
  for (int round = 0; round < 2; ++round) {
    poison_nan(o, nq), poison_nan(lse, nl);
    if (round == 1) arm();
    const attn_status_t s = attn_decode_execute(plan, cache, q, o, lse, ws, ws_bytes, NULL);
    const long n = disarm();
    CHECK_OK(s);
    assert_written(o, nq, "O");
    assert_written(lse, nl, "LSE");
    if (round == 1) expect_no_alloc(n, "attn_decode_execute");
  }

  free(ws), free(q), free(o), free(lse), free(k), free(v);
  CHECK_OK(attn_decode_plan_destroy(plan));
  CHECK_OK(attn_kv_cache_destroy(cache));
  CHECK_OK(attn_context_destroy(ctx));
}

/* ------------------------------------------------------------------------ */
/* Ring: two ranks on threads of this process                                */
/* ------------------------------------------------------------------------ */

enum { RN = 2, RB = 1, RHQ = 2, RHKV = 1, RL = 128, RD = 16 };

typedef struct ring_rank {
  attn_comm_t comm;
  pthread_barrier_t *ready, *go, *done, *disarmed;
  attn_status_t status[2][2]; /* [round][forward, backward] */
  int written[2];
  char message[256];
} ring_rank;

static void *ring_rank_main(void *arg) {
  ring_rank *r = (ring_rank *)arg;
  int32_t rank = 0;
  attn_comm_get_rank(r->comm, &rank);
  uint64_t st = g_seed ^ (0xA11CEull + (uint64_t)rank);
  attn_context_t ctx = NULL;
  attn_plan_desc_t desc = NULL;
  attn_plan_t plan = NULL;
  attn_status_t s = attn_context_create(ATTN_BACKEND_CPU, 0, 2, &ctx);
  if (s == ATTN_STATUS_SUCCESS) s = attn_plan_desc_create(&desc);
  if (s == ATTN_STATUS_SUCCESS)
    s = attn_plan_desc_set_shape(desc, RB, RHQ, RHKV, RL, RL, RD, RD);
  if (s == ATTN_STATUS_SUCCESS) s = attn_plan_desc_set_mask(desc, ATTN_MASK_CAUSAL, -1, -1);
  if (s == ATTN_STATUS_SUCCESS) s = attn_plan_desc_set_passes(desc, ATTN_PASSES_FORWARD_BACKWARD);
  if (s == ATTN_STATUS_SUCCESS)
    s = attn_ring_plan_create(ctx, desc, r->comm, ATTN_RING_LAYOUT_ZIGZAG, &plan);
  size_t fwd_bytes = 0, bwd_bytes = 0;
  if (s == ATTN_STATUS_SUCCESS) s = attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fwd_bytes);
  if (s == ATTN_STATUS_SUCCESS) s = attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &bwd_bytes);
  if (s != ATTN_STATUS_SUCCESS) {
    snprintf(r->message, sizeof r->message, "setup: %s", attn_last_error_message());
    /* a leaving rank releases its peer */
    attn_comm_destroy(r->comm);
    r->comm = NULL;
  }

  const size_t lq = RL / RN;
  const size_t nq = RB * lq * RHQ * RD, nk = RB * lq * RHKV * RD, nl = RB * RHQ * lq;
  float *q = random_floats(nq, &st), *k = random_floats(nk, &st), *v = random_floats(nk, &st);
  float *d_o = random_floats(nq, &st);
  float *o = poisoned(nq), *lse = poisoned(nl);
  float *dq = poisoned(nq), *dk = poisoned(nk), *dv = poisoned(nk);
  void *ws = malloc(fwd_bytes > bwd_bytes ? fwd_bytes : bwd_bytes);

  for (int round = 0; round < 2; ++round) {
    poison_nan(o, nq), poison_nan(lse, nl);
    poison_nan(dq, nq), poison_nan(dk, nk), poison_nan(dv, nk);
    if (round == 1) {
      pthread_barrier_wait(r->ready); /* the main thread arms the counter */
      pthread_barrier_wait(r->go);
    }
    if (plan != NULL) {
      r->status[round][0] = attn_forward(plan, q, k, v, o, lse, ws, fwd_bytes, NULL);
      r->status[round][1] =
          attn_backward(plan, q, k, v, o, lse, d_o, dq, dk, dv, ws, bwd_bytes, NULL);
    } else {
      r->status[round][0] = r->status[round][1] = ATTN_STATUS_INVALID_HANDLE;
    }
    if (round == 1) {
      pthread_barrier_wait(r->done); /* the main thread reads the count, */
      pthread_barrier_wait(r->disarmed); /* and stops counting before this thread goes on */
    }
    int written = 1;
    for (size_t i = 0; i < nq; ++i) written = written && !isnan(o[i]) && !isnan(dq[i]);
    for (size_t i = 0; i < nk; ++i) written = written && !isnan(dk[i]) && !isnan(dv[i]);
    r->written[round] = written;
    if (r->message[0] == '\0' && (r->status[round][0] != ATTN_STATUS_SUCCESS ||
                                  r->status[round][1] != ATTN_STATUS_SUCCESS))
      snprintf(r->message, sizeof r->message, "round %d: %s", round, attn_last_error_message());
  }

  free(ws);
  free(q), free(k), free(v), free(d_o), free(o), free(lse), free(dq), free(dk), free(dv);
  attn_plan_destroy(plan);
  attn_plan_desc_destroy(desc);
  attn_context_destroy(ctx);
  return NULL;
}

static void test_ring(void **state) {
  (void)state;
  attn_comm_t comms[RN];
  CHECK_OK(attn_comm_create_inprocess(RN, 60000, comms));
  pthread_barrier_t ready, go, done, disarmed;
  pthread_barrier_init(&ready, NULL, RN + 1);
  pthread_barrier_init(&go, NULL, RN + 1);
  pthread_barrier_init(&done, NULL, RN + 1);
  pthread_barrier_init(&disarmed, NULL, RN + 1);
  ring_rank ranks[RN];
  pthread_t threads[RN];
  memset(ranks, 0, sizeof ranks);
  for (int r = 0; r < RN; ++r) {
    ranks[r].comm = comms[r];
    ranks[r].ready = &ready, ranks[r].go = &go, ranks[r].done = &done;
    ranks[r].disarmed = &disarmed;
    assert_int_equal(pthread_create(&threads[r], NULL, ring_rank_main, &ranks[r]), 0);
  }
  pthread_barrier_wait(&ready);
  arm();
  pthread_barrier_wait(&go);
  pthread_barrier_wait(&done);
  const long n = disarm();
  pthread_barrier_wait(&disarmed);
  for (int r = 0; r < RN; ++r) pthread_join(threads[r], NULL);
  pthread_barrier_destroy(&ready);
  pthread_barrier_destroy(&go);
  pthread_barrier_destroy(&done);
  pthread_barrier_destroy(&disarmed);

  for (int r = 0; r < RN; ++r) {
    for (int round = 0; round < 2; ++round) {
      if (ranks[r].status[round][0] != ATTN_STATUS_SUCCESS ||
          ranks[r].status[round][1] != ATTN_STATUS_SUCCESS || !ranks[r].written[round]) {
        print_error("rank %d, round %d: %s / %s, outputs %s: %s\n", r, round,
                    attn_status_string(ranks[r].status[round][0]),
                    attn_status_string(ranks[r].status[round][1]),
                    ranks[r].written[round] ? "written" : "not written", ranks[r].message);
        fail();
      }
    }
    CHECK_OK(attn_comm_destroy(ranks[r].comm));
  }
  expect_no_alloc(n, "ring forward + backward (2 in-process ranks)");
}

int main(void) {
  void *frames[4];
  backtrace(frames, 4); /* loads the unwinder now, not inside a counted call */
  const char *env = getenv("ATTN_TEST_SEED");
  g_seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL);
  fprintf(stderr, "ATTN_TEST_SEED=%llu\n", (unsigned long long)g_seed);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_counter_counts), cmocka_unit_test(test_dense),
      cmocka_unit_test(test_block_sparse),   cmocka_unit_test(test_moba),
      cmocka_unit_test(test_decode_execute), cmocka_unit_test(test_ring),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
