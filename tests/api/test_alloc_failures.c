/* "A failed call changes no output and leaks nothing", when the failure is
 * an allocation: every call of the block-mask, KV-cache, decode and ring
 * APIs that may allocate is run again and again with its 1st, 2nd, 3rd ...
 * allocation failing, until a run makes no more allocations than the one
 * that failed. Each failed run must return OUT_OF_MEMORY with a message,
 * leave its outputs and the objects it works on as they were, and free
 * everything it allocated on the way.
 *
 * Allocations are counted and failed per thread by replacing malloc and
 * its relatives in this executable (forwarding to glibc's __libc_*
 * functions; the C++ runtime's operator new calls malloc), so the test is
 * built only on glibc systems without sanitizers.
 *
 * C99 + POSIX (pthreads). */
#define _GNU_SOURCE

#include "api_check.h"
#include "testutil.h"

#include <errno.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* Failing allocator (per thread)                                            */
/* ------------------------------------------------------------------------ */

/* Allocations are counted and failed on the calling thread only; frees
 * are counted on every thread, since a thread the call starts and joins
 * (the in-process ring's message thread) frees what was allocated for it. */
static __thread int t_armed;
static __thread long t_count;   /* allocations while armed */
static __thread long t_fail_at; /* the one that fails (1-based) */
static atomic_int g_tracking;
static atomic_long g_live; /* allocated minus freed while tracking */

static int alloc_hook_fails(void) {
  if (!t_armed || ++t_count != t_fail_at) return 0;
  errno = ENOMEM; /* as glibc's own failures; pthread_create checks it */
  return 1;
}
static void *alloc_hook_new(void *p) {
  if (p != NULL && t_armed) atomic_fetch_add(&g_live, 1);
  return p;
}
static void alloc_hook_free(void *p) {
  if (p != NULL && atomic_load_explicit(&g_tracking, memory_order_relaxed))
    atomic_fetch_sub(&g_live, 1);
}
#include "replace_malloc.h"

/* ------------------------------------------------------------------------ */
/* Scenarios                                                                 */
/* ------------------------------------------------------------------------ */

enum { L = 64, HQ = 4, HKV = 2, D = 16, PS = 4 };

/* Everything a scenario works on. Handles a call creates start poisoned. */
typedef struct world {
  attn_context_t ctx;
  attn_plan_desc_t desc;
  attn_block_mask_t mask, new_mask;
  attn_plan_t plan;
  attn_kv_cache_t cache, new_cache;
  attn_decode_plan_t dplan, new_dplan;
  attn_comm_t comms[2], new_comms[2];
  attn_decode_step_info_t info;
  void *ws;
  size_t ws_bytes;
  float kv[2][8 * HKV * D];
  int32_t before[8]; /* a scenario's record of the state it must keep */
  int64_t before64[8];
  unsigned char mask_before[2048]; /* a mask's tables (mask_tables) */
  float cache_before[3 * HQ * D];  /* a cache's decode fingerprint */
} world;

static world w;

static void fill(float *x, size_t n, float base) {
  for (size_t i = 0; i < n; ++i) x[i] = base + 0.01f * (float)(i % 13) + 0.003f;
}

static attn_plan_desc_t new_desc(void) {
  attn_plan_desc_t d;
  CHECK_OK(attn_plan_desc_create(&d));
  CHECK_OK(attn_plan_desc_set_shape(d, 1, HQ, HKV, L, L, D, D));
  CHECK_OK(attn_plan_desc_set_mask(d, ATTN_MASK_CAUSAL, -1, -1));
  CHECK_OK(attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD_BACKWARD));
  return d;
}

/* The whole contents of a (1, HKV, L, L, 8, 16) mask, as get_blocks reads
 * them back (4 KV blocks: at most 4 entries a row), packed into out. */
enum { kMaskRows = HKV * (L / 8), kMaskMax = L / 16, kTile = ATTN_BLOCK_MASK_TILE_BYTES(8, 16) };
typedef struct mask_tables {
  int32_t num_p[kMaskRows], idx_p[kMaskRows * kMaskMax];
  int32_t num_f[kMaskRows], idx_f[kMaskRows * kMaskMax];
  uint8_t bits[kMaskRows * kMaskMax * kTile];
} mask_tables;
static void mask_snapshot(attn_block_mask_t m, unsigned char *out) {
  mask_tables t;
  _Static_assert(sizeof t <= sizeof w.mask_before, "room for a mask's tables");
  memset(&t, 0, sizeof t);
  CHECK_OK(attn_block_mask_get_blocks(m, t.num_p, t.idx_p, kMaskMax, t.bits, t.num_f, t.idx_f,
                                      kMaskMax));
  memcpy(out, &t, sizeof t);
}

static attn_kv_cache_config_t cache_config(void) {
  return tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, PS, 16, HKV, D, D, 0, 0);
}

static attn_decode_config_t decode_config(void) { return tu_decode_config(HQ, 2, 2, 0); }

/* A cache with sequence 1 (6 tokens, the last page shared with sequence 2,
 * a fork of 5 tokens) and sequence 3 (3 tokens). */
static void make_cache(void) {
  attn_kv_cache_config_t c = cache_config();
  const int64_t ids[2] = {1, 3};
  const int32_t n[2] = {6, 2};
  CHECK_OK(attn_kv_cache_create(w.ctx, &c, NULL, 0, &w.cache));
  CHECK_OK(attn_kv_cache_add_sequence(w.cache, 1));
  CHECK_OK(attn_kv_cache_add_sequence(w.cache, 3));
  fill(w.kv[0], sizeof w.kv[0] / 4, 0.25f);
  fill(w.kv[1], sizeof w.kv[1] / 4, -0.5f);
  CHECK_OK(attn_kv_cache_append(w.cache, 2, ids, n, w.kv[0], w.kv[1], NULL));
  CHECK_OK(attn_kv_cache_fork(w.cache, 1, 2, 5));
}

static void cache_state(int64_t *out) {
  attn_kv_cache_info_t info;
  info.struct_size = sizeof info;
  CHECK_OK(attn_kv_cache_get_info(w.cache, &info));
  out[0] = info.pages_in_use;
  out[1] = info.num_sequences;
  CHECK_OK(attn_kv_cache_sequence_length(w.cache, 1, &out[2]));
  CHECK_OK(attn_kv_cache_sequence_length(w.cache, 2, &out[3]));
  CHECK_OK(attn_kv_cache_sequence_length(w.cache, 3, &out[4]));
}

/* The cache's contents as one decode step sees them: the output of a query
 * token (fixed values) over sequences 1, 2 and 3 (2 shares a partly filled
 * page with 1, which a failed append must not have written into). */
static void cache_fingerprint(float *out) {
  const attn_decode_config_t dc = tu_decode_config(HQ, 3, 1, 0);
  const int64_t ids[3] = {1, 2, 3};
  const int32_t ql[3] = {1, 1, 1};
  float q[3 * HQ * D];
  attn_decode_plan_t plan = NULL;
  size_t bytes = 0;
  void *ws;
  fill(q, sizeof q / 4, 0.75f);
  CHECK_OK(attn_decode_plan_create(w.ctx, w.cache, &dc, &plan));
  CHECK_OK(attn_decode_plan_workspace_size(plan, &bytes));
  ws = malloc(bytes);
  if (ws == NULL) abort();
  CHECK_OK(attn_decode_prepare(plan, w.cache, 3, ids, ql, ws, bytes, NULL, NULL));
  CHECK_OK(attn_decode_execute(plan, w.cache, q, out, NULL, ws, bytes, NULL));
  free(ws);
  CHECK_OK(attn_decode_plan_destroy(plan));
}

typedef struct scenario {
  const char *name;
  void (*setup)(void);
  attn_status_t (*call)(void);
  /* After a failed call: 1 when the outputs and objects are as before. */
  int (*unchanged)(void);
  void (*teardown)(int call_succeeded);
} scenario;

/* --- block masks ---------------------------------------------------------- */

static void s_none(void) {}
static attn_status_t c_mask_create(void) {
  return attn_block_mask_create(1, HKV, L, L, 8, 16, &w.new_mask);
}
static int u_new_mask(void) { return is_poisoned(&w.new_mask, sizeof w.new_mask); }
static void t_mask_create(int ok) {
  if (ok) CHECK_OK(attn_block_mask_destroy(w.new_mask));
}

static void s_mask(void) {
  const int64_t sinks[2] = {0, 3};
  CHECK_OK(attn_block_mask_create(1, HKV, L, L, 8, 16, &w.mask));
  CHECK_OK(attn_block_mask_add_global_keys(w.mask, sinks, 2));
  mask_snapshot(w.mask, w.mask_before);
}
static int u_mask(void) {
  unsigned char now[sizeof w.mask_before];
  memset(now, 0, sizeof now);
  mask_snapshot(w.mask, now);
  return memcmp(now, w.mask_before, sizeof(mask_tables)) == 0;
}
static void t_mask(int ok) {
  (void)ok;
  CHECK_OK(attn_block_mask_destroy(w.mask));
}
static attn_status_t c_add_window(void) { return attn_block_mask_add_window(w.mask, 20, 0); }
static attn_status_t c_add_random(void) { return attn_block_mask_add_random_blocks(w.mask, 2, 7); }
static attn_status_t c_and_documents(void) {
  int32_t dq[L], dk[L];
  for (int i = 0; i < L; ++i) dq[i] = dk[i] = i / 24;
  return attn_block_mask_and_documents(w.mask, dq, dk);
}
static attn_status_t c_add_dense(void) {
  static uint8_t visible[HKV][L][L];
  for (int h = 0; h < HKV; ++h)
    for (int i = 0; i < L; ++i)
      for (int j = 0; j < L; ++j) visible[h][i][j] = (uint8_t)((i * 7 + j * 3 + h) % 5 == 0);
  return attn_block_mask_add_dense(w.mask, &visible[0][0][0]);
}
static attn_status_t c_set_blocks(void) {
  enum { NQB = L / 8 };
  int32_t num_p[HKV][NQB], idx_p[HKV][NQB][1], num_f[HKV][NQB], idx_f[HKV][NQB][1];
  uint8_t bits[HKV][NQB][1][ATTN_BLOCK_MASK_TILE_BYTES(8, 16)];
  memset(bits, 0x35, sizeof bits);
  for (int h = 0; h < HKV; ++h)
    for (int q = 0; q < NQB; ++q) {
      num_p[h][q] = 1, idx_p[h][q][0] = q % 4;
      num_f[h][q] = 1, idx_f[h][q][0] = (q + 1) % 4;
    }
  return attn_block_mask_set_blocks(w.mask, &num_p[0][0], &idx_p[0][0][0], 1, &bits[0][0][0][0],
                                    &num_f[0][0], &idx_f[0][0][0], 1);
}

/* --- plans ---------------------------------------------------------------- */

static void s_desc_with_mask(void) {
  s_mask();
  w.desc = new_desc();
  CHECK_OK(attn_plan_desc_set_allow_empty_rows(w.desc, 1));
}
static attn_status_t c_set_block_mask(void) { return attn_plan_desc_set_block_mask(w.desc, w.mask); }
/* The descriptor still has no block mask: its plan is dense. */
static int u_desc_without_mask(void) {
  attn_plan_t plan = NULL;
  attn_plan_info_t info;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  CHECK_OK(attn_plan_create(w.ctx, w.desc, &plan));
  CHECK_OK(attn_plan_describe(plan, &info));
  CHECK_OK(attn_plan_destroy(plan));
  return info.block_q == 0 && info.block_kv == 0;
}
static void t_desc_with_mask(int ok) {
  (void)ok;
  CHECK_OK(attn_plan_desc_destroy(w.desc));
  t_mask(1);
}

static void s_sparse_desc(void) {
  s_desc_with_mask();
  CHECK_OK(attn_plan_desc_set_block_mask(w.desc, w.mask));
  poison(&w.plan, sizeof w.plan);
}
static attn_status_t c_plan_create(void) { return attn_plan_create(w.ctx, w.desc, &w.plan); }
static int u_plan(void) { return is_poisoned(&w.plan, sizeof w.plan); }
static void t_sparse_desc(int ok) {
  if (ok) CHECK_OK(attn_plan_destroy(w.plan));
  t_desc_with_mask(1);
}

static void s_moba_desc(void) {
  w.desc = new_desc();
  CHECK_OK(attn_plan_desc_set_moba(w.desc, 16, 2, 1));
  poison(&w.plan, sizeof w.plan);
}
static void t_moba_desc(int ok) {
  if (ok) CHECK_OK(attn_plan_destroy(w.plan));
  CHECK_OK(attn_plan_desc_destroy(w.desc));
}

/* --- KV cache and decode -------------------------------------------------- */

static attn_status_t c_cache_create(void) {
  attn_kv_cache_config_t c = cache_config();
  return attn_kv_cache_create(w.ctx, &c, NULL, 0, &w.new_cache);
}
static int u_new_cache(void) { return is_poisoned(&w.new_cache, sizeof w.new_cache); }
static void t_cache_create(int ok) {
  if (ok) CHECK_OK(attn_kv_cache_destroy(w.new_cache));
}

static void s_cache(void) {
  make_cache();
  cache_state(w.before64);
  cache_fingerprint(w.cache_before);
}
static int u_cache(void) {
  int64_t now[5];
  float out[3 * HQ * D];
  cache_state(now);
  cache_fingerprint(out);
  return memcmp(now, w.before64, sizeof now) == 0 &&
         memcmp(out, w.cache_before, sizeof out) == 0 &&
         attn_kv_cache_sequence_length(w.cache, 9, &now[0]) == ATTN_STATUS_INVALID_ARGUMENT;
}
static void t_cache(int ok) {
  (void)ok;
  CHECK_OK(attn_kv_cache_destroy(w.cache));
}
static attn_status_t c_add_sequence(void) { return attn_kv_cache_add_sequence(w.cache, 9); }
static attn_status_t c_fork(void) { return attn_kv_cache_fork(w.cache, 1, 9, 6); }
static attn_status_t c_truncate(void) { return attn_kv_cache_truncate(w.cache, 1, 3); }
static attn_status_t c_append(void) {
  /* 2 appends into the shared partly filled page (a copy), 3 new pages */
  const int64_t ids[3] = {1, 2, 3};
  const int32_t n[3] = {1, 3, 2};
  return attn_kv_cache_append(w.cache, 3, ids, n, w.kv[0], w.kv[1], NULL);
}

static void s_cache_for_plan(void) {
  s_cache();
  poison(&w.new_dplan, sizeof w.new_dplan);
}
static attn_status_t c_decode_plan_create(void) {
  attn_decode_config_t d = decode_config();
  return attn_decode_plan_create(w.ctx, w.cache, &d, &w.new_dplan);
}
static int u_new_dplan(void) { return is_poisoned(&w.new_dplan, sizeof w.new_dplan) && u_cache(); }
static void t_cache_for_plan(int ok) {
  if (ok) CHECK_OK(attn_decode_plan_destroy(w.new_dplan));
  t_cache(1);
}

static void s_prepare(void) {
  attn_decode_config_t d = decode_config();
  s_cache();
  CHECK_OK(attn_decode_plan_create(w.ctx, w.cache, &d, &w.dplan));
  CHECK_OK(attn_decode_plan_workspace_size(w.dplan, &w.ws_bytes));
  w.ws = malloc(w.ws_bytes);
  poison(w.ws, w.ws_bytes);
  poison(&w.info, sizeof w.info);
  w.info.struct_size = sizeof w.info;
}
static attn_status_t c_prepare(void) {
  const int64_t ids[2] = {1, 2};
  const int32_t ql[2] = {2, 1};
  return attn_decode_prepare(w.dplan, w.cache, 2, ids, ql, w.ws, w.ws_bytes, &w.info, NULL);
}
static int u_prepare(void) {
  return is_poisoned(w.ws, w.ws_bytes) &&
         is_poisoned((char *)&w.info + sizeof w.info.struct_size,
                     sizeof w.info - sizeof w.info.struct_size);
}
static void t_prepare(int ok) {
  (void)ok;
  free(w.ws);
  CHECK_OK(attn_decode_plan_destroy(w.dplan));
  t_cache(1);
}

/* --- ring ----------------------------------------------------------------- */

static void *idle_thread(void *arg) { return arg; }

/* A thread started and joined here leaves its stack (and the thread-local
 * storage glibc allocates with it) in glibc's cache of stacks, which the
 * group's message thread then reuses: glibc keeps that memory after a
 * failed call, and it would otherwise be counted as the call's. */
static void s_new_comms(void) {
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, idle_thread, NULL), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  poison(w.new_comms, sizeof w.new_comms);
}
static attn_status_t c_comm_create(void) { return attn_comm_create_inprocess(2, 1000, w.new_comms); }
static int u_new_comms(void) { return is_poisoned(w.new_comms, sizeof w.new_comms); }
static void t_new_comms(int ok) {
  if (!ok) return;
  CHECK_OK(attn_comm_destroy(w.new_comms[0]));
  CHECK_OK(attn_comm_destroy(w.new_comms[1]));
}

static void s_ring(void) {
  CHECK_OK(attn_comm_create_inprocess(2, 1000, w.comms));
  w.desc = new_desc();
  poison(&w.plan, sizeof w.plan);
}
static attn_status_t c_ring_plan_create(void) {
  return attn_ring_plan_create(w.ctx, w.desc, w.comms[0], ATTN_RING_LAYOUT_ZIGZAG, &w.plan);
}
static void t_ring(int ok) {
  if (ok) CHECK_OK(attn_plan_destroy(w.plan));
  CHECK_OK(attn_plan_desc_destroy(w.desc));
  CHECK_OK(attn_comm_destroy(w.comms[0]));
  CHECK_OK(attn_comm_destroy(w.comms[1]));
}

static void s_comms(void) { CHECK_OK(attn_comm_create_inprocess(2, 1000, w.comms)); }
static attn_status_t c_comm_destroy(void) { return attn_comm_destroy(w.comms[0]); }
static int u_comm_live(void) {
  int32_t rank = -1;
  return attn_comm_get_rank(w.comms[0], &rank) == ATTN_STATUS_SUCCESS && rank == 0;
}
static void t_comms(int ok) {
  if (!ok) CHECK_OK(attn_comm_destroy(w.comms[0]));
  CHECK_OK(attn_comm_destroy(w.comms[1]));
}

static const scenario kScenarios[] = {
    {"attn_block_mask_create", s_none, c_mask_create, u_new_mask, t_mask_create},
    {"attn_block_mask_add_window", s_mask, c_add_window, u_mask, t_mask},
    {"attn_block_mask_add_random_blocks", s_mask, c_add_random, u_mask, t_mask},
    {"attn_block_mask_and_documents", s_mask, c_and_documents, u_mask, t_mask},
    {"attn_block_mask_add_dense", s_mask, c_add_dense, u_mask, t_mask},
    {"attn_block_mask_set_blocks", s_mask, c_set_blocks, u_mask, t_mask},
    {"attn_plan_desc_set_block_mask", s_desc_with_mask, c_set_block_mask, u_desc_without_mask,
     t_desc_with_mask},
    {"attn_plan_create (block mask)", s_sparse_desc, c_plan_create, u_plan, t_sparse_desc},
    {"attn_plan_create (MoBA)", s_moba_desc, c_plan_create, u_plan, t_moba_desc},
    {"attn_kv_cache_create", s_none, c_cache_create, u_new_cache, t_cache_create},
    {"attn_kv_cache_add_sequence", s_cache, c_add_sequence, u_cache, t_cache},
    {"attn_kv_cache_fork", s_cache, c_fork, u_cache, t_cache},
    {"attn_kv_cache_truncate", s_cache, c_truncate, u_cache, t_cache},
    {"attn_kv_cache_append", s_cache, c_append, u_cache, t_cache},
    {"attn_decode_plan_create", s_cache_for_plan, c_decode_plan_create, u_new_dplan,
     t_cache_for_plan},
    {"attn_decode_prepare", s_prepare, c_prepare, u_prepare, t_prepare},
    {"attn_comm_create_inprocess", s_new_comms, c_comm_create, u_new_comms, t_new_comms},
    {"attn_ring_plan_create", s_ring, c_ring_plan_create, u_plan, t_ring},
    {"attn_comm_destroy", s_comms, c_comm_destroy, u_comm_live, t_comms},
};

static void run_scenario(void **state) {
  const scenario *sc = (const scenario *)*state;
  long failed_runs = 0;
  for (long n = 1;; ++n) {
    poison(&w.new_mask, sizeof w.new_mask);
    poison(&w.new_cache, sizeof w.new_cache);
    sc->setup();
    atomic_store(&g_live, 0);
    atomic_store(&g_tracking, 1);
    t_count = 0, t_fail_at = n, t_armed = 1;
    const attn_status_t st = sc->call();
    t_armed = 0;
    atomic_store(&g_tracking, 0);
    const long count = t_count, live = atomic_load(&g_live);
    const int reached = count >= n;
    if (st == ATTN_STATUS_SUCCESS) {
      sc->teardown(1);
      if (!reached) break; /* no allocation left to fail */
      continue;            /* the failed allocation was not needed */
    }
    /* The first thing wrong, checked in this order; teardown either way. */
    const char *msg = attn_last_error_message();
    char wrong[512] = "";
    if (st != ATTN_STATUS_OUT_OF_MEMORY || !reached || msg[0] == '\0')
      snprintf(wrong, sizeof wrong, "%s, \"%s\" (expected OUT_OF_MEMORY)", attn_status_string(st),
               msg);
    else if (live != 0)
      snprintf(wrong, sizeof wrong, "%ld allocation(s) not freed", live);
    else if (!sc->unchanged())
      snprintf(wrong, sizeof wrong, "an output or the object changed");
    sc->teardown(0);
    if (wrong[0] != '\0') {
      print_error("%s with allocation %ld failing: %s\n", sc->name, n, wrong);
      fail();
    }
    ++failed_runs;
  }
  /* Each of these calls allocates: the sweep must have tested something. */
  assert_true(failed_runs > 0);
}

static int group_setup(void **state) {
  (void)state;
  return attn_context_create(ATTN_BACKEND_CPU, 0, 1, &w.ctx) == ATTN_STATUS_SUCCESS ? 0 : -1;
}
static int group_teardown(void **state) {
  (void)state;
  return attn_context_destroy(w.ctx) == ATTN_STATUS_SUCCESS ? 0 : -1;
}

int main(void) {
  enum { N = sizeof kScenarios / sizeof kScenarios[0] };
  struct CMUnitTest tests[N];
  memset(tests, 0, sizeof tests);
  for (size_t i = 0; i < N; ++i) {
    tests[i].name = kScenarios[i].name;
    tests[i].test_func = run_scenario;
    tests[i].initial_state = (void *)&kScenarios[i];
  }
  return _cmocka_run_group_tests("alloc_failures", tests, N, group_setup, group_teardown);
}
