/* API contract tests of the KV cache and the decode plans: every error path.
 *
 * For each failing call we check the status attn.h documents, that the
 * message names the offending argument (as a whole word), and that nothing
 * changed: out-parameters and output buffers are poisoned before the call
 * and compared byte for byte after it, and the cache's state (lengths,
 * pages in use, sequences, and the contents, through a decode step whose
 * output must be bit-identical) is as before.
 *
 * C99. */
#include "api_check.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define INVALID ATTN_STATUS_INVALID_ARGUMENT

/* ------------------------------------------------------------------------ */
/* A small cache: fp32, NHD, page size 4, 2 KV heads of dim 8             */
/* ------------------------------------------------------------------------ */

#define HKV 2
#define DIM 8
#define HQ 4

static attn_context_t g_ctx;

static attn_kv_cache_config_t small_config(int64_t num_pages) {
  return tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, 4, num_pages, HKV, DIM, DIM, 0,
                            0);
}

static attn_kv_cache_t make_cache(const attn_kv_cache_config_t *c) {
  attn_kv_cache_t cache = NULL;
  EXPECT_OK(attn_kv_cache_create(g_ctx, c, NULL, 0, &cache));
  return cache;
}

static unsigned g_seed = 1;

/* Appends n random tokens to sequence id. */
static void append(attn_kv_cache_t cache, int64_t id, int32_t n) {
  float *k = xmalloc((size_t)n * HKV * DIM * 4), *v = xmalloc((size_t)n * HKV * DIM * 4);
  fill_random(k, (size_t)n * HKV * DIM, g_seed++);
  fill_random(v, (size_t)n * HKV * DIM, g_seed++);
  EXPECT_OK(attn_kv_cache_append(cache, 1, &id, &n, k, v, NULL));
  free(k), free(v);
}

/* Sequences 1 and 2, of n1 and n2 random tokens. */
static void add_two(attn_kv_cache_t cache, int32_t n1, int32_t n2) {
  EXPECT_OK(attn_kv_cache_add_sequence(cache, 1));
  EXPECT_OK(attn_kv_cache_add_sequence(cache, 2));
  append(cache, 1, n1);
  append(cache, 2, n2);
}

static int64_t length_of(attn_kv_cache_t cache, int64_t id) {
  int64_t n = -1;
  EXPECT_OK(attn_kv_cache_sequence_length(cache, id, &n));
  return n;
}

static attn_kv_cache_info_t info_of(attn_kv_cache_t cache) {
  attn_kv_cache_info_t info;
  info.struct_size = sizeof info;
  EXPECT_OK(attn_kv_cache_get_info(cache, &info));
  return info;
}

static attn_decode_config_t decode_config(void) { return tu_decode_config(HQ, 4, 2, 0); }

/* The output of one decode step (one query token per sequence, fixed Q)
 * over the given sequences: a fingerprint of the cache's contents. */
static float *decode_fingerprint(attn_kv_cache_t cache, int n, const int64_t *ids) {
  attn_decode_config_t dc = decode_config();
  attn_decode_plan_t plan = NULL;
  size_t bytes = 0;
  void *ws;
  float q[4 * HQ * DIM], *o = xmalloc((size_t)n * HQ * DIM * 4);
  int32_t ql[4] = {1, 1, 1, 1};
  fill_random(q, sizeof q / 4, 99);
  EXPECT_OK(attn_decode_plan_create(g_ctx, cache, &dc, &plan));
  EXPECT_OK(attn_decode_plan_workspace_size(plan, &bytes));
  ws = xmalloc(bytes);
  EXPECT_OK(attn_decode_prepare(plan, cache, n, ids, ql, ws, bytes, NULL, NULL));
  EXPECT_OK(attn_decode_execute(plan, cache, q, o, NULL, ws, bytes, NULL));
  free(ws);
  EXPECT_OK(attn_decode_plan_destroy(plan));
  return o;
}

/* Records lengths, pages in use, the number of sequences and the decode
 * output of `ids`, to compare after a failed call. */
typedef struct snapshot {
  int n;
  int64_t ids[4], len[4];
  attn_kv_cache_info_t info;
  float *out;
} snapshot;

static snapshot take(attn_kv_cache_t cache, int n, const int64_t *ids) {
  snapshot s;
  int i;
  s.n = n;
  for (i = 0; i < n; ++i) s.ids[i] = ids[i], s.len[i] = length_of(cache, ids[i]);
  s.info = info_of(cache);
  s.out = decode_fingerprint(cache, n, ids);
  return s;
}

static void expect_unchanged(attn_kv_cache_t cache, snapshot *s, const char *file, int line) {
  attn_kv_cache_info_t now = info_of(cache);
  float *out;
  int i;
  for (i = 0; i < s->n; ++i) {
    if (length_of(cache, s->ids[i]) != s->len[i]) {
      print_error("%s:%d: sequence %lld changed length\n", file, line, (long long)s->ids[i]);
      _fail(file, line);
    }
  }
  if (now.pages_in_use != s->info.pages_in_use || now.num_sequences != s->info.num_sequences) {
    print_error("%s:%d: pages in use %lld -> %lld, sequences %lld -> %lld\n", file, line,
                (long long)s->info.pages_in_use, (long long)now.pages_in_use,
                (long long)s->info.num_sequences, (long long)now.num_sequences);
    _fail(file, line);
  }
  out = decode_fingerprint(cache, s->n, s->ids);
  if (memcmp(out, s->out, (size_t)s->n * HQ * DIM * 4) != 0) {
    print_error("%s:%d: the cache's contents changed\n", file, line);
    _fail(file, line);
  }
  free(out);
}
#define EXPECT_CACHE_UNCHANGED(cache, snap) expect_unchanged((cache), (snap), __FILE__, __LINE__)

static int group_setup(void **state) {
  (void)state;
  return attn_context_create(ATTN_BACKEND_CPU, 0, 1, &g_ctx) == ATTN_STATUS_SUCCESS ? 0 : -1;
}

static int group_teardown(void **state) {
  (void)state;
  return attn_context_destroy(g_ctx) == ATTN_STATUS_SUCCESS ? 0 : -1;
}

/* ------------------------------------------------------------------------ */
/* Configuration and creation                                                */
/* ------------------------------------------------------------------------ */

static void test_config_fields(void **state) {
  attn_kv_cache_config_t c;
  size_t bytes;
  attn_kv_cache_t cache;
  (void)state;
#define BAD_FIELD(field, value, word)                                          \
  do {                                                                         \
    c = small_config(8);                                                       \
    c.field = value;                                                           \
    POISON_VAR(bytes);                                                         \
    EXPECT_FAIL(INVALID, word, attn_kv_cache_memory_size(&c, &bytes));         \
    EXPECT_VAR_UNTOUCHED(bytes);                                               \
    POISON_VAR(cache);                                                         \
    EXPECT_FAIL(INVALID, word, attn_kv_cache_create(g_ctx, &c, NULL, 0, &cache)); \
    EXPECT_VAR_UNTOUCHED(cache);                                               \
  } while (0)
  BAD_FIELD(struct_size, 8, "struct_size");
  BAD_FIELD(dtype, 7, "dtype");
  BAD_FIELD(layout, 2, "layout");
  BAD_FIELD(layout, -1, "layout");
  BAD_FIELD(page_size, 0, "page_size");
  BAD_FIELD(num_pages, 0, "num_pages");
  BAD_FIELD(num_pages, (int64_t)1 << 31, "num_pages");
  BAD_FIELD(heads_kv, 0, "heads_kv");
  BAD_FIELD(head_dim_qk, 0, "head_dim_qk");
  BAD_FIELD(head_dim_qk, 1025, "head_dim_qk");
  BAD_FIELD(head_dim_v, 0, "head_dim_v");
  BAD_FIELD(window, -1, "window");
  BAD_FIELD(sink_tokens, -1, "sink_tokens");
  BAD_FIELD(sink_tokens, 4, "sink_tokens"); /* sinks without a window */
  /* Positions stay far from int64 overflow (window + sinks + query tokens). */
  BAD_FIELD(window, INT64_MAX, "window");
  BAD_FIELD(window, ((int64_t)1 << 60) + 1, "window");
  {
    attn_kv_cache_config_t windowed = small_config(8);
    windowed.window = 16;
    windowed.sink_tokens = INT64_MAX;
    POISON_VAR(bytes);
    EXPECT_FAIL(INVALID, "sink_tokens", attn_kv_cache_memory_size(&windowed, &bytes));
    EXPECT_VAR_UNTOUCHED(bytes);
    windowed.sink_tokens = ((int64_t)1 << 60) + 1;
    POISON_VAR(cache);
    EXPECT_FAIL(INVALID, "sink_tokens", attn_kv_cache_create(g_ctx, &windowed, NULL, 0, &cache));
    EXPECT_VAR_UNTOUCHED(cache);
    /* The largest allowed values work, decode plan included. */
    windowed.window = (int64_t)1 << 60;
    windowed.sink_tokens = (int64_t)1 << 60;
    EXPECT_OK(attn_kv_cache_create(g_ctx, &windowed, NULL, 0, &cache));
    {
      attn_decode_config_t d = decode_config();
      attn_decode_plan_t plan;
      attn_decode_plan_info_t info;
      EXPECT_OK(attn_decode_plan_create(g_ctx, cache, &d, &plan));
      info.struct_size = sizeof info;
      EXPECT_OK(attn_decode_plan_describe(plan, &info));
      assert_int_equal(info.max_kv_tokens, 8 * 4); /* the pool's capacity */
      EXPECT_OK(attn_decode_plan_destroy(plan));
    }
    EXPECT_OK(attn_kv_cache_destroy(cache));
  }
#undef BAD_FIELD
  POISON_VAR(bytes);
  EXPECT_FAIL(INVALID, "config", attn_kv_cache_memory_size(NULL, &bytes));
  EXPECT_VAR_UNTOUCHED(bytes);
  c = small_config(8);
  EXPECT_FAIL(INVALID, "bytes", attn_kv_cache_memory_size(&c, NULL));
  EXPECT_OK(attn_kv_cache_memory_size(&c, &bytes));
  /* 8 pages x 4 tokens x 2 heads x (8 + 8) floats, plus alignment slack */
  assert_true(bytes >= 8 * 4 * HKV * (DIM + DIM) * 4);
  assert_true(bytes < 8 * 4 * HKV * (DIM + DIM) * 4 + 256);

  /* A caller built against a newer header: a larger struct whose bytes
   * past this library's are zero is accepted (the same cache); one with a
   * byte set there asks for a field this library does not know and is
   * refused; an implausibly large struct_size is refused unread. The
   * same for the decode config. */
  {
    struct {
      attn_kv_cache_config_t known;
      unsigned char newer[24];
    } big;
    size_t same = 0;
    memset(&big, 0, sizeof big);
    big.known = small_config(8);
    big.known.struct_size = sizeof big;
    EXPECT_OK(attn_kv_cache_memory_size(&big.known, &same));
    assert_int_equal(same, bytes);
    big.newer[5] = 1;
    POISON_VAR(same);
    EXPECT_FAIL(INVALID, "newer", attn_kv_cache_memory_size(&big.known, &same));
    EXPECT_VAR_UNTOUCHED(same);
    POISON_VAR(cache);
    EXPECT_FAIL(INVALID, "newer", attn_kv_cache_create(g_ctx, &big.known, NULL, 0, &cache));
    EXPECT_VAR_UNTOUCHED(cache);
    big.newer[5] = 0;
    big.known.struct_size = (uint64_t)1 << 40;
    EXPECT_FAIL(INVALID, "implausibly large", attn_kv_cache_memory_size(&big.known, &same));

    EXPECT_OK(attn_kv_cache_create(g_ctx, &c, NULL, 0, &cache));
    {
      struct {
        attn_decode_config_t known;
        unsigned char newer[16];
      } dbig;
      attn_decode_plan_t plan;
      memset(&dbig, 0, sizeof dbig);
      dbig.known = decode_config();
      dbig.known.struct_size = sizeof dbig;
      EXPECT_OK(attn_decode_plan_create(g_ctx, cache, &dbig.known, &plan));
      EXPECT_OK(attn_decode_plan_destroy(plan));
      dbig.newer[15] = 0x80;
      POISON_VAR(plan);
      EXPECT_FAIL(INVALID, "newer", attn_decode_plan_create(g_ctx, cache, &dbig.known, &plan));
      EXPECT_VAR_UNTOUCHED(plan);
    }
    EXPECT_OK(attn_kv_cache_destroy(cache));
  }
}

static void test_create_errors(void **state) {
  attn_kv_cache_config_t c = small_config(8);
  attn_kv_cache_t cache;
  attn_kv_cache_info_t info;
  size_t bytes = 0;
  char *mem;
  (void)state;
  POISON_VAR(cache);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_kv_cache_create(NULL, &c, NULL, 0, &cache));
  EXPECT_VAR_UNTOUCHED(cache);
  EXPECT_FAIL(INVALID, "config", attn_kv_cache_create(g_ctx, NULL, NULL, 0, &cache));
  EXPECT_VAR_UNTOUCHED(cache);
  EXPECT_FAIL(INVALID, "cache", attn_kv_cache_create(g_ctx, &c, NULL, 0, NULL));
  EXPECT_FAIL(INVALID, "memory", attn_kv_cache_create(g_ctx, &c, NULL, 100, &cache));
  EXPECT_VAR_UNTOUCHED(cache);

  /* Caller memory: one byte short is refused, the exact size works. */
  EXPECT_OK(attn_kv_cache_memory_size(&c, &bytes));
  mem = xmalloc(bytes);
  poison(mem, bytes);
  EXPECT_FAIL(INVALID, "memory_bytes", attn_kv_cache_create(g_ctx, &c, mem, bytes - 1, &cache));
  EXPECT_VAR_UNTOUCHED(cache);
  EXPECT_UNTOUCHED(mem, bytes);
  EXPECT_FAIL(INVALID, "memory_bytes", attn_kv_cache_create(g_ctx, &c, mem, 0, &cache));
  EXPECT_OK(attn_kv_cache_create(g_ctx, &c, mem, bytes, &cache));
  info = info_of(cache);
  assert_int_equal(info.owns_memory, 0);
  assert_int_equal(info.num_pages, 8);
  assert_int_equal(info.pages_in_use, 0);
  assert_int_equal(info.bytes_per_token, HKV * (DIM + DIM) * 4);
  EXPECT_OK(attn_kv_cache_destroy(cache));
  free(mem);

  cache = make_cache(&c);
  info = info_of(cache);
  assert_int_equal(info.owns_memory, 1);
  /* Info: NULL, too small a struct_size; a smaller (older) struct gets
   * only its fields. */
  EXPECT_FAIL(INVALID, "info", attn_kv_cache_get_info(cache, NULL));
  POISON_VAR(info);
  info.struct_size = 4;
  EXPECT_FAIL(INVALID, "info", attn_kv_cache_get_info(cache, &info));
  assert_int_equal(info.struct_size, 4);
  POISON_VAR(info);
  info.struct_size = offsetof(attn_kv_cache_info_t, pages_in_use);
  EXPECT_OK(attn_kv_cache_get_info(cache, &info));
  assert_int_equal(info.num_pages, 8);
  check_poisoned(&info.pages_in_use, sizeof info - offsetof(attn_kv_cache_info_t, pages_in_use),
                 "fields past struct_size", __FILE__, __LINE__);
  EXPECT_OK(attn_kv_cache_destroy(cache));
  EXPECT_OK(attn_kv_cache_destroy(NULL));
}

/* bytes_per_token is the K and V bytes of one token over all KV heads, and
 * memory_bytes the pool's pages of K and V: num_pages * page_size tokens.
 * Neither depends on the layout, on who owns the memory or on its use. */
static void test_info_sizes(void **state) {
  static const struct {
    attn_dtype_t dtype;
    attn_kv_layout_t layout;
    int64_t page_size, num_pages, heads_kv, dqk, dv;
    uint64_t elem;
  } cases[] = {
      {ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, 4, 8, 2, 8, 8, 4},
      {ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_HND, 3, 11, 2, 5, 9, 4},
      {ATTN_DTYPE_FP16, ATTN_KV_LAYOUT_HND, 5, 3, 1, 3, 7, 2},
      {ATTN_DTYPE_FP16, ATTN_KV_LAYOUT_NHD, 16, 9, 4, 64, 32, 2},
      {ATTN_DTYPE_BF16, ATTN_KV_LAYOUT_NHD, 7, 5, 3, 16, 40, 2},
      {ATTN_DTYPE_BF16, ATTN_KV_LAYOUT_HND, 1, 2, 1, 1, 1, 2},
  };
  size_t i;
  int owned;
  (void)state;
  for (i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    const attn_kv_cache_config_t c =
        tu_kv_cache_config(cases[i].dtype, cases[i].layout, cases[i].page_size,
                           cases[i].num_pages, cases[i].heads_kv, cases[i].dqk, cases[i].dv, 0, 0);
    const uint64_t per_token =
        (uint64_t)(cases[i].heads_kv * (cases[i].dqk + cases[i].dv)) * cases[i].elem;
    const uint64_t pool = (uint64_t)(cases[i].num_pages * cases[i].page_size) * per_token;
    size_t bytes = 0;
    EXPECT_OK(attn_kv_cache_memory_size(&c, &bytes));
    assert_true(bytes >= pool);
    for (owned = 0; owned < 2; ++owned) {
      /* Caller memory starts one byte past an allocation's start. */
      char *mem = owned ? NULL : xmalloc(bytes + 1);
      attn_kv_cache_t cache = NULL;
      attn_kv_cache_info_t info;
      const int64_t id = 3;
      const int32_t n = (int32_t)(cases[i].page_size + 1);
      const size_t kb = (size_t)n * (size_t)(cases[i].heads_kv * cases[i].dqk) * cases[i].elem;
      const size_t vb = (size_t)n * (size_t)(cases[i].heads_kv * cases[i].dv) * cases[i].elem;
      unsigned char *k = xmalloc(kb), *v = xmalloc(vb);
      memset(k, 0x3C, kb); /* 1.06 in fp16, 0.0115 in bf16 and fp32 */
      memset(v, 0x3E, vb);
      EXPECT_OK(
          attn_kv_cache_create(g_ctx, &c, owned ? NULL : mem + 1, owned ? 0 : bytes, &cache));
      info = info_of(cache);
      assert_int_equal(info.owns_memory, owned);
      assert_int_equal(info.page_size, cases[i].page_size);
      assert_int_equal(info.num_pages, cases[i].num_pages);
      assert_int_equal(info.bytes_per_token, per_token);
      assert_int_equal(info.memory_bytes, pool);
      /* In use or not, the pool is the same size. */
      EXPECT_OK(attn_kv_cache_add_sequence(cache, id));
      EXPECT_OK(attn_kv_cache_append(cache, 1, &id, &n, k, v, NULL));
      info = info_of(cache);
      assert_int_equal(info.pages_in_use, 2);
      assert_int_equal(info.bytes_per_token, per_token);
      assert_int_equal(info.memory_bytes, pool);
      EXPECT_OK(attn_kv_cache_destroy(cache));
      free(k), free(v), free(mem);
    }
  }
}

static void test_cuda_context_refused(void **state) {
  attn_context_t cuda = NULL;
  attn_kv_cache_config_t c = small_config(8);
  attn_kv_cache_t cuda_cache, cache;
  attn_decode_config_t d = decode_config();
  attn_decode_plan_t plan;
  (void)state;
  if (attn_context_create(ATTN_BACKEND_CUDA, 0, 1, &cuda) != ATTN_STATUS_SUCCESS) {
    skip(); /* no CUDA device or not built: the check is reached only with one */
  }
  /* An fp32 cache lives on the device, but the CUDA decode kernel runs fp16
   * and bf16 only. */
  EXPECT_OK(attn_kv_cache_create(cuda, &c, NULL, 0, &cuda_cache));
  POISON_VAR(plan);
  EXPECT_FAIL(ATTN_STATUS_NOT_SUPPORTED, "fp16", attn_decode_plan_create(cuda, cuda_cache, &d, &plan));
  EXPECT_VAR_UNTOUCHED(plan);
  EXPECT_OK(attn_kv_cache_destroy(cuda_cache));
  /* A decode plan on CUDA over a CPU cache: refused, not run elsewhere. */
  cache = make_cache(&c);
  POISON_VAR(plan);
  EXPECT_FAIL(ATTN_STATUS_INVALID_ARGUMENT, "backend", attn_decode_plan_create(cuda, cache, &d, &plan));
  EXPECT_VAR_UNTOUCHED(plan);
  EXPECT_OK(attn_kv_cache_destroy(cache));
  EXPECT_OK(attn_context_destroy(cuda));
}

/* ------------------------------------------------------------------------ */
/* Sequences                                                                 */
/* ------------------------------------------------------------------------ */

static void test_add_release_length(void **state) {
  attn_kv_cache_config_t c = small_config(8);
  attn_kv_cache_t cache = make_cache(&c);
  int64_t len;
  (void)state;
  EXPECT_FAIL(INVALID, "seq_id", attn_kv_cache_add_sequence(cache, -1));
  EXPECT_OK(attn_kv_cache_add_sequence(cache, 5));
  EXPECT_FAIL(INVALID, "seq_id", attn_kv_cache_add_sequence(cache, 5));
  assert_int_equal(info_of(cache).num_sequences, 1);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache", attn_kv_cache_add_sequence(NULL, 6));

  POISON_VAR(len);
  EXPECT_FAIL(INVALID, "seq_id", attn_kv_cache_sequence_length(cache, 6, &len));
  EXPECT_VAR_UNTOUCHED(len);
  EXPECT_FAIL(INVALID, "length", attn_kv_cache_sequence_length(cache, 5, NULL));
  append(cache, 5, 6);
  assert_int_equal(length_of(cache, 5), 6);
  assert_int_equal(info_of(cache).pages_in_use, 2);

  /* 7 shares 5's first page and holds its own copy of the second. */
  EXPECT_OK(attn_kv_cache_fork(cache, 5, 7, 5));
  append(cache, 7, 2);
  assert_int_equal(info_of(cache).pages_in_use, 3);
  {
    /* An unknown id: refused, and no sequence or page is let go. */
    const int64_t live[2] = {5, 7};
    snapshot s = take(cache, 2, live);
    EXPECT_FAIL(INVALID, "seq_id", attn_kv_cache_release(cache, 6));
    EXPECT_CACHE_UNCHANGED(cache, &s);
    EXPECT_FAIL(INVALID, "seq_id", attn_kv_cache_release(cache, -1));
    EXPECT_CACHE_UNCHANGED(cache, &s);
    free(s.out);
  }
  EXPECT_OK(attn_kv_cache_release(cache, 5));
  assert_int_equal(info_of(cache).pages_in_use, 2); /* the shared page stays */
  assert_int_equal(info_of(cache).num_sequences, 1);
  {
    /* Twice: refused, and the message says what may have happened; the
     * other sequence and the page it shared with 5 are kept. */
    const int64_t live = 7;
    snapshot s = take(cache, 1, &live);
    EXPECT_FAIL(INVALID, "seq_id", attn_kv_cache_release(cache, 5));
    assert_non_null(strstr(attn_last_error_message(), "released already"));
    EXPECT_CACHE_UNCHANGED(cache, &s);
    free(s.out);
  }
  EXPECT_OK(attn_kv_cache_release(cache, 7));
  assert_int_equal(info_of(cache).pages_in_use, 0);
  assert_int_equal(info_of(cache).num_sequences, 0);
  POISON_VAR(len);
  EXPECT_FAIL(INVALID, "seq_id", attn_kv_cache_sequence_length(cache, 5, &len));
  EXPECT_VAR_UNTOUCHED(len);
  EXPECT_OK(attn_kv_cache_destroy(cache));
}

static void test_append_errors(void **state) {
  attn_kv_cache_config_t c = small_config(8);
  attn_kv_cache_t cache = make_cache(&c);
  const int64_t ids2[2] = {1, 2};
  int64_t ids[2];
  int32_t n[2];
  float k[64 * HKV * DIM], v[64 * HKV * DIM];
  snapshot s;
  (void)state;
  fill_random(k, sizeof k / 4, 3);
  fill_random(v, sizeof v / 4, 4);
  add_two(cache, 5, 3);
  s = take(cache, 2, ids2);

  ids[0] = 1, ids[1] = 9, n[0] = 1, n[1] = 1;
  EXPECT_FAIL(INVALID, "seq_ids", attn_kv_cache_append(cache, 2, ids, n, k, v, NULL));
  EXPECT_CACHE_UNCHANGED(cache, &s);
  ids[1] = 1; /* repeated */
  EXPECT_FAIL(INVALID, "seq_ids", attn_kv_cache_append(cache, 2, ids, n, k, v, NULL));
  EXPECT_CACHE_UNCHANGED(cache, &s);
  ids[1] = 2, n[1] = -1;
  EXPECT_FAIL(INVALID, "num_tokens", attn_kv_cache_append(cache, 2, ids, n, k, v, NULL));
  EXPECT_CACHE_UNCHANGED(cache, &s);
  n[1] = 1;
  EXPECT_FAIL(INVALID, "num_seqs", attn_kv_cache_append(cache, 0, ids, n, k, v, NULL));
  EXPECT_FAIL(INVALID, "seq_ids", attn_kv_cache_append(cache, 2, NULL, n, k, v, NULL));
  EXPECT_FAIL(INVALID, "num_tokens", attn_kv_cache_append(cache, 2, ids, NULL, k, v, NULL));
  EXPECT_FAIL(INVALID, "k", attn_kv_cache_append(cache, 2, ids, n, NULL, v, NULL));
  EXPECT_FAIL(INVALID, "v", attn_kv_cache_append(cache, 2, ids, n, k, NULL, NULL));
  EXPECT_CACHE_UNCHANGED(cache, &s);
  /* A sequence longer than the whole pool (8 pages of 4) is an argument
   * error, not a capacity one: no release could make room. */
  n[0] = 28, n[1] = 0;
  EXPECT_FAIL(INVALID, "num_tokens", attn_kv_cache_append(cache, 2, ids, n, k, v, NULL));
  EXPECT_CACHE_UNCHANGED(cache, &s);
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache", attn_kv_cache_append(NULL, 2, ids, n, k, v, NULL));
  /* Zero tokens everywhere: a no-op that may pass NULL data. */
  n[0] = 0, n[1] = 0;
  EXPECT_OK(attn_kv_cache_append(cache, 2, ids, n, NULL, NULL, NULL));
  EXPECT_CACHE_UNCHANGED(cache, &s);
  free(s.out);
  EXPECT_OK(attn_kv_cache_destroy(cache));
}

static void test_capacity(void **state) {
  attn_kv_cache_config_t c = small_config(6);
  attn_kv_cache_t cache = make_cache(&c);
  const int64_t ids3[3] = {1, 2, 3};
  int64_t ids[3];
  int32_t n[3];
  float k[16 * HKV * DIM], v[16 * HKV * DIM];
  snapshot s;
  (void)state;
  fill_random(k, sizeof k / 4, 5);
  fill_random(v, sizeof v / 4, 6);
  add_two(cache, 10, 5); /* 3 pages with 2 free slots; 2 pages with 3 */
  assert_int_equal(info_of(cache).pages_in_use, 5);

  /* 1 free page; the batch needs 2 (sequence 2 grows by 2 pages; sequence
   * 1 fits in its last page). The first part would fit: nothing may be
   * written anyway. */
  EXPECT_OK(attn_kv_cache_fork(cache, 1, 3, 10)); /* shares 3 pages */
  assert_int_equal(info_of(cache).pages_in_use, 5);
  s = take(cache, 3, ids3);
  ids[0] = 1, ids[1] = 2, n[0] = 2, n[1] = 8;
  EXPECT_FAIL(ATTN_STATUS_CAPACITY, "pages", attn_kv_cache_append(cache, 2, ids, n, k, v, NULL));
  EXPECT_CACHE_UNCHANGED(cache, &s);

  /* Copy-on-write counts: 1 and 3 share a partial last page; appending to
   * 1 needs a copy (1 page) and 2 needs a new page: 2 > 1 free. */
  ids[0] = 1, ids[1] = 3, ids[2] = 2, n[0] = 1, n[1] = 1, n[2] = 4;
  EXPECT_FAIL(ATTN_STATUS_CAPACITY, "pages", attn_kv_cache_append(cache, 3, ids, n, k, v, NULL));
  EXPECT_CACHE_UNCHANGED(cache, &s);
  /* Without sequence 2 it fits: 1 copies, 3 then writes in place. */
  EXPECT_OK(attn_kv_cache_append(cache, 2, ids, n, k, v, NULL));
  assert_int_equal(info_of(cache).pages_in_use, 6);
  assert_int_equal(length_of(cache, 1), 11);
  assert_int_equal(length_of(cache, 3), 11);
  free(s.out);

  /* Full: any new page fails; releasing makes room. */
  s = take(cache, 3, ids3);
  ids[0] = 2, n[0] = 4;
  EXPECT_FAIL(ATTN_STATUS_CAPACITY, "pages", attn_kv_cache_append(cache, 1, ids, n, k, v, NULL));
  EXPECT_CACHE_UNCHANGED(cache, &s);
  free(s.out);
  EXPECT_OK(attn_kv_cache_release(cache, 3));
  assert_int_equal(info_of(cache).pages_in_use, 5); /* 3's own copy of page 2 */
  EXPECT_OK(attn_kv_cache_append(cache, 1, ids, n, k, v, NULL));
  assert_int_equal(length_of(cache, 2), 9);
  EXPECT_OK(attn_kv_cache_destroy(cache));
}

static void test_fork_errors(void **state) {
  attn_kv_cache_config_t c = small_config(8);
  attn_kv_cache_t cache = make_cache(&c);
  const int64_t ids[2] = {1, 2};
  snapshot s;
  (void)state;
  add_two(cache, 6, 2);
  s = take(cache, 2, ids);
  EXPECT_FAIL(INVALID, "parent_id", attn_kv_cache_fork(cache, 7, 3, 1));
  EXPECT_FAIL(INVALID, "child_id", attn_kv_cache_fork(cache, 1, 2, 1));
  EXPECT_FAIL(INVALID, "child_id", attn_kv_cache_fork(cache, 1, -3, 1));
  EXPECT_FAIL(INVALID, "num_tokens", attn_kv_cache_fork(cache, 1, 3, 7));
  EXPECT_FAIL(INVALID, "num_tokens", attn_kv_cache_fork(cache, 1, 3, -1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache", attn_kv_cache_fork(NULL, 1, 3, 1));
  EXPECT_CACHE_UNCHANGED(cache, &s);
  free(s.out);
  EXPECT_OK(attn_kv_cache_fork(cache, 1, 3, 0)); /* an empty child */
  assert_int_equal(length_of(cache, 3), 0);
  EXPECT_OK(attn_kv_cache_destroy(cache));

  /* A windowed cache: the child's visible tokens must still be held. */
  c.window = 4;
  cache = make_cache(&c);
  EXPECT_OK(attn_kv_cache_add_sequence(cache, 1));
  append(cache, 1, 8);
  append(cache, 1, 8); /* evicts positions below 8 - 4 + 1 = 5: page 0 */
  assert_int_equal(info_of(cache).pages_in_use, 3);
  {
    const int64_t one = 1;
    s = take(cache, 1, &one);
    /* A child of 6 tokens would see positions 3..5 next: page 0 is gone. */
    EXPECT_FAIL(INVALID, "num_tokens", attn_kv_cache_fork(cache, 1, 2, 6));
    EXPECT_CACHE_UNCHANGED(cache, &s);
    free(s.out);
  }
  EXPECT_OK(attn_kv_cache_fork(cache, 1, 2, 10)); /* sees 7..9 next: held */
  assert_int_equal(info_of(cache).pages_in_use, 3);
  EXPECT_OK(attn_kv_cache_destroy(cache));
}

/* ------------------------------------------------------------------------ */
/* Decode plans                                                              */
/* ------------------------------------------------------------------------ */

static void test_decode_plan_create_errors(void **state) {
  attn_kv_cache_config_t c = small_config(8);
  attn_kv_cache_t cache = make_cache(&c);
  attn_decode_config_t d;
  attn_decode_plan_t plan;
  (void)state;
#define BAD_DECODE(field, value, word)                                           \
  do {                                                                           \
    d = decode_config();                                                         \
    d.field = value;                                                             \
    POISON_VAR(plan);                                                            \
    EXPECT_FAIL(INVALID, word, attn_decode_plan_create(g_ctx, cache, &d, &plan)); \
    EXPECT_VAR_UNTOUCHED(plan);                                                  \
  } while (0)
  BAD_DECODE(struct_size, 8, "struct_size");
  BAD_DECODE(heads_q, 0, "heads_q");
  BAD_DECODE(heads_q, 3, "heads_q"); /* not a multiple of heads_kv = 2 */
  BAD_DECODE(max_batch, 0, "max_batch");
  BAD_DECODE(max_query_tokens, 0, "max_query_tokens");
  BAD_DECODE(max_kv_tokens, -1, "max_kv_tokens");
  BAD_DECODE(kv_chunk_tokens, -2, "kv_chunk_tokens");
  BAD_DECODE(softmax_scale, -1.0f, "softmax_scale");
  BAD_DECODE(softmax_scale, NAN, "softmax_scale");
  BAD_DECODE(softcap, -1.0f, "softcap");
  BAD_DECODE(softcap, INFINITY, "softcap");
  BAD_DECODE(softcap, 3e38f, "softcap");
  /* Limits whose workspace does not fit in size_t: refused, not wrapped. */
  d = decode_config();
  d.heads_q = (int64_t)1 << 40;
  d.max_batch = (int64_t)1 << 24;
  d.max_query_tokens = (int64_t)1 << 24;
  d.kv_chunk_tokens = 4;
  POISON_VAR(plan);
  EXPECT_FAIL(INVALID, "config", attn_decode_plan_create(g_ctx, cache, &d, &plan));
  EXPECT_VAR_UNTOUCHED(plan);
  d = decode_config();
  d.heads_q = (int64_t)1 << 62;
  EXPECT_FAIL(INVALID, "config", attn_decode_plan_create(g_ctx, cache, &d, &plan));
  EXPECT_VAR_UNTOUCHED(plan);
#undef BAD_DECODE
  d = decode_config();
  POISON_VAR(plan);
  EXPECT_FAIL(INVALID, "config", attn_decode_plan_create(g_ctx, cache, NULL, &plan));
  EXPECT_FAIL(INVALID, "plan", attn_decode_plan_create(g_ctx, cache, &d, NULL));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "ctx", attn_decode_plan_create(NULL, cache, &d, &plan));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache", attn_decode_plan_create(g_ctx, NULL, &d, &plan));
  EXPECT_VAR_UNTOUCHED(plan);
  EXPECT_OK(attn_decode_plan_destroy(NULL));
  EXPECT_OK(attn_kv_cache_destroy(cache));
}

typedef struct decode_fixture {
  attn_kv_cache_t cache;
  attn_decode_plan_t plan;
  size_t bytes;
  char *ws;
  float q[4 * 2 * HQ * DIM];
  float o[4 * 2 * HQ * DIM];
  float lse[4 * 2 * HQ];
} decode_fixture;

/* Sequences 1 (6 tokens) and 2 (3 tokens); plan: max_batch 4, 2 queries. */
static void fixture_make(decode_fixture *f, const attn_kv_cache_config_t *c) {
  attn_decode_config_t d = decode_config();
  f->cache = make_cache(c);
  add_two(f->cache, 6, 3);
  EXPECT_OK(attn_decode_plan_create(g_ctx, f->cache, &d, &f->plan));
  EXPECT_OK(attn_decode_plan_workspace_size(f->plan, &f->bytes));
  assert_true(f->bytes > 0);
  f->ws = xmalloc(f->bytes);
  fill_random(f->q, sizeof f->q / 4, 7);
}

static void fixture_free(decode_fixture *f) {
  free(f->ws);
  EXPECT_OK(attn_decode_plan_destroy(f->plan));
  EXPECT_OK(attn_kv_cache_destroy(f->cache));
}

static void test_prepare_errors(void **state) {
  attn_kv_cache_config_t c = small_config(8);
  decode_fixture f;
  attn_decode_step_info_t info;
  int64_t ids[5] = {1, 2, 1, 2, 1};
  int32_t ql[5] = {1, 2, 1, 1, 1};
  (void)state;
  fixture_make(&f, &c);
#define EXPECT_PREPARE_FAILS(status, word, ...)                           \
  do {                                                                    \
    poison(f.ws, f.bytes);                                                \
    POISON_VAR(info);                                                     \
    info.struct_size = sizeof info;                                       \
    EXPECT_FAIL(status, word, attn_decode_prepare(__VA_ARGS__, NULL));          \
    EXPECT_UNTOUCHED(f.ws, f.bytes);                                      \
    check_poisoned(&info.total_q, sizeof info - sizeof info.struct_size,  \
                   "info", __FILE__, __LINE__);                           \
  } while (0)
  EXPECT_PREPARE_FAILS(INVALID, "num_seqs", f.plan, f.cache, 0, ids, ql, f.ws, f.bytes, &info);
  EXPECT_PREPARE_FAILS(INVALID, "num_seqs", f.plan, f.cache, 5, ids, ql, f.ws, f.bytes, &info);
  EXPECT_PREPARE_FAILS(INVALID, "seq_ids", f.plan, f.cache, 2, NULL, ql, f.ws, f.bytes, &info);
  EXPECT_PREPARE_FAILS(INVALID, "query_lens", f.plan, f.cache, 2, ids, NULL, f.ws, f.bytes, &info);
  EXPECT_PREPARE_FAILS(ATTN_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes", f.plan, f.cache, 2, ids,
                       ql, f.ws, f.bytes - 1, &info);
  EXPECT_PREPARE_FAILS(INVALID, "workspace", f.plan, f.cache, 2, ids, ql, NULL, f.bytes, &info);
  EXPECT_PREPARE_FAILS(ATTN_STATUS_INVALID_HANDLE, "plan", NULL, f.cache, 2, ids, ql, f.ws, f.bytes,
                       &info);
  EXPECT_PREPARE_FAILS(ATTN_STATUS_INVALID_HANDLE, "cache", f.plan, NULL, 2, ids, ql, f.ws, f.bytes,
                       &info);
  ids[1] = 3; /* unknown */
  EXPECT_PREPARE_FAILS(INVALID, "seq_ids", f.plan, f.cache, 2, ids, ql, f.ws, f.bytes, &info);
  ids[1] = 2;
  ql[1] = 0;
  EXPECT_PREPARE_FAILS(INVALID, "query_lens", f.plan, f.cache, 2, ids, ql, f.ws, f.bytes, &info);
  ql[1] = 3; /* above max_query_tokens */
  EXPECT_PREPARE_FAILS(INVALID, "query_lens", f.plan, f.cache, 2, ids, ql, f.ws, f.bytes, &info);
  ql[1] = 2;
  {
    /* More queries than the sequence holds. */
    int32_t one_q = 2;
    int64_t empty = 4;
    EXPECT_OK(attn_kv_cache_add_sequence(f.cache, 4));
    append(f.cache, 4, 1);
    EXPECT_PREPARE_FAILS(INVALID, "query_lens", f.plan, f.cache, 1, &empty, &one_q, f.ws, f.bytes,
                         &info);
  }
  /* Info too small. */
  poison(f.ws, f.bytes);
  POISON_VAR(info);
  info.struct_size = 4;
  EXPECT_FAIL(INVALID, "info", attn_decode_prepare(f.plan, f.cache, 2, ids, ql, f.ws, f.bytes, &info, NULL));
  EXPECT_UNTOUCHED(f.ws, f.bytes);
  /* Repeated ids are allowed. */
  info.struct_size = sizeof info;
  EXPECT_OK(attn_decode_prepare(f.plan, f.cache, 4, ids, ql, f.ws, f.bytes, &info, NULL));
  assert_int_equal(info.total_q, 5);
  assert_int_equal(info.num_work_units, 4);
  assert_int_equal(info.split_sequences, 0);
  assert_true(info.kv_bytes_read > 0.0);

  /* A cache configured differently (HND pages). */
  {
    attn_kv_cache_config_t c2 = small_config(8);
    attn_kv_cache_t other;
    c2.layout = ATTN_KV_LAYOUT_HND;
    other = make_cache(&c2);
    EXPECT_OK(attn_kv_cache_add_sequence(other, 1));
    append(other, 1, 2);
    EXPECT_PREPARE_FAILS(INVALID, "cache", f.plan, other, 1, ids, ql, f.ws, f.bytes, &info);
    EXPECT_OK(attn_kv_cache_destroy(other));
  }
#undef EXPECT_PREPARE_FAILS
  fixture_free(&f);
}

/* Appends tokens [from, from + n) of a fixed stream of random tokens
 * (seeded by `stream`) to sequence id: the same token data whatever the
 * split into calls. */
static void append_stream(attn_kv_cache_t cache, int64_t id, unsigned stream, int32_t from,
                          int32_t n) {
  const size_t row = (size_t)HKV * DIM, total = (size_t)(from + n) * row;
  float *k = xmalloc(total * 4), *v = xmalloc(total * 4);
  fill_random(k, total, 1000u + 2u * stream);
  fill_random(v, total, 1001u + 2u * stream);
  EXPECT_OK(attn_kv_cache_append(cache, 1, &id, &n, k + (size_t)from * row, v + (size_t)from * row,
                                 NULL));
  free(k), free(v);
}

/* attn_kv_cache_truncate: a sequence cut back to n tokens and appended to
 * decodes exactly as one that only ever held those n tokens plus the new
 * ones (pages of 4 tokens, cut inside a page); a page it shares with a
 * fork is copied, not overwritten; in a windowed cache a cut behind the
 * evicted keys is refused; bad arguments, nothing changed. */
static void test_truncate(void **state) {
  (void)state;
  for (int windowed = 0; windowed < 2; ++windowed) {
    /* window 8, tokens appended one at a time: after 20 the cache keeps
       positions 12.. only, so 19 (the next token's window 12..19) is the
       shortest cut it can make */
    const int64_t window = windowed ? 8 : 0;
    const int32_t cut = windowed ? 19 : 13;
    attn_kv_cache_config_t c =
        tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, 4, 16, HKV, DIM, DIM, window, 0);
    attn_kv_cache_t a = make_cache(&c), b = make_cache(&c);
    const int64_t one = 1, two = 2;
    float *fa, *fb, *f2_before, *f2_after;
    /* windowed: one token per append, so that the window evicts as it goes */
#define APPEND(cache, stream, n)                                              \
  do {                                                                        \
    if (windowed)                                                             \
      for (int32_t t_ = 0; t_ < (n); ++t_) append_stream(cache, 1, stream, t_, 1); \
    else                                                                      \
      append_stream(cache, 1, stream, 0, n);                                  \
  } while (0)
    EXPECT_OK(attn_kv_cache_add_sequence(a, 1));
    APPEND(a, 1, 20);
    EXPECT_OK(attn_kv_cache_fork(a, 1, 2, 20)); /* shares every page, the cut one too */
    f2_before = decode_fingerprint(a, 1, &two);
    if (windowed) {
      float *f1 = decode_fingerprint(a, 1, &one);
      EXPECT_FAIL(INVALID, "evicted", attn_kv_cache_truncate(a, 1, 13));
      assert_int_equal(length_of(a, 1), 20);
      fa = decode_fingerprint(a, 1, &one);
      assert_memory_equal(fa, f1, (size_t)HQ * DIM * 4);
      free(fa), free(f1);
    }
    EXPECT_FAIL(INVALID, "num_tokens", attn_kv_cache_truncate(a, 1, 21));
    EXPECT_FAIL(INVALID, "num_tokens", attn_kv_cache_truncate(a, 1, -1));
    EXPECT_FAIL(INVALID, "seq_id", attn_kv_cache_truncate(a, 7, 1));
    EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache", attn_kv_cache_truncate(NULL, 1, 1));
    assert_int_equal(length_of(a, 1), 20);
    EXPECT_OK(attn_kv_cache_truncate(a, 1, cut));
    assert_int_equal(length_of(a, 1), cut);
    APPEND(a, 2, 3); /* into the shared, cut page: copied first */

    EXPECT_OK(attn_kv_cache_add_sequence(b, 1));
    APPEND(b, 1, cut);
    APPEND(b, 2, 3);
#undef APPEND
    fa = decode_fingerprint(a, 1, &one);
    fb = decode_fingerprint(b, 1, &one);
    assert_memory_equal(fa, fb, (size_t)HQ * DIM * 4);
    f2_after = decode_fingerprint(a, 1, &two);
    assert_memory_equal(f2_after, f2_before, (size_t)HQ * DIM * 4); /* the fork unchanged */
    /* cut to nothing: the sequence starts again */
    EXPECT_OK(attn_kv_cache_release(a, 2));
    if (!windowed) {
      EXPECT_OK(attn_kv_cache_truncate(a, 1, 0));
      assert_int_equal(length_of(a, 1), 0);
    }
    free(fa), free(fb), free(f2_before), free(f2_after);
    EXPECT_OK(attn_kv_cache_destroy(a));
    EXPECT_OK(attn_kv_cache_destroy(b));
  }
}

static void test_prepare_limits(void **state) {
  attn_kv_cache_config_t c = small_config(16);
  attn_kv_cache_t cache;
  attn_decode_config_t d = decode_config();
  attn_decode_plan_t plan;
  size_t bytes;
  char *ws;
  int64_t id = 1;
  int32_t ql = 2;
  (void)state;
  /* max_kv_tokens: a sequence of 12 tokens against a limit of 10. */
  cache = make_cache(&c);
  EXPECT_OK(attn_kv_cache_add_sequence(cache, 1));
  append(cache, 1, 12);
  d.max_kv_tokens = 10;
  EXPECT_OK(attn_decode_plan_create(g_ctx, cache, &d, &plan));
  EXPECT_OK(attn_decode_plan_workspace_size(plan, &bytes));
  ws = xmalloc(bytes);
  poison(ws, bytes);
  EXPECT_FAIL(INVALID, "max_kv_tokens", attn_decode_prepare(plan, cache, 1, &id, &ql, ws, bytes, NULL, NULL));
  EXPECT_UNTOUCHED(ws, bytes);
  free(ws);
  EXPECT_OK(attn_decode_plan_destroy(plan));
  EXPECT_OK(attn_kv_cache_destroy(cache));

  /* Window 4: appending 1 token to 11 frees the pages below position
   * 11 - 4 + 1 = 8; 2 queries (positions 10, 11) would need position 7. */
  c.window = 4;
  cache = make_cache(&c);
  EXPECT_OK(attn_kv_cache_add_sequence(cache, 1));
  append(cache, 1, 11);
  append(cache, 1, 1);
  d = decode_config();
  EXPECT_OK(attn_decode_plan_create(g_ctx, cache, &d, &plan));
  EXPECT_OK(attn_decode_plan_workspace_size(plan, &bytes));
  ws = xmalloc(bytes);
  poison(ws, bytes);
  EXPECT_FAIL(INVALID, "evicted", attn_decode_prepare(plan, cache, 1, &id, &ql, ws, bytes, NULL, NULL));
  EXPECT_UNTOUCHED(ws, bytes);
  ql = 1;
  EXPECT_OK(attn_decode_prepare(plan, cache, 1, &id, &ql, ws, bytes, NULL, NULL));
  free(ws);
  EXPECT_OK(attn_decode_plan_destroy(plan));
  EXPECT_OK(attn_kv_cache_destroy(cache));

  /* The default max_kv_tokens over a pool smaller than the window's reach
   * (8 tokens against 2 sinks + window 4 + 5 queries - 1 = 10): 5 queries
   * after appends of one token see 10 keys, more than 8, but only because
   * keys were evicted, and the message says that. */
  c = tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, 1, 8, HKV, DIM, DIM, 4, 2);
  cache = make_cache(&c);
  EXPECT_OK(attn_kv_cache_add_sequence(cache, 1));
  for (int t = 0; t < 10; ++t) append(cache, 1, 1);
  d = tu_decode_config(HQ, 1, 5, 0);
  EXPECT_OK(attn_decode_plan_create(g_ctx, cache, &d, &plan));
  EXPECT_OK(attn_decode_plan_workspace_size(plan, &bytes));
  ws = xmalloc(bytes);
  poison(ws, bytes);
  ql = 5;
  EXPECT_FAIL(INVALID, "evicted", attn_decode_prepare(plan, cache, 1, &id, &ql, ws, bytes, NULL, NULL));
  EXPECT_UNTOUCHED(ws, bytes);
  free(ws);
  EXPECT_OK(attn_decode_plan_destroy(plan));
  EXPECT_OK(attn_kv_cache_destroy(cache));
}

static void test_execute_errors(void **state) {
  attn_kv_cache_config_t c = small_config(8);
  decode_fixture f;
  const int64_t ids[2] = {1, 2};
  const int32_t ql[2] = {2, 1};
  const size_t no = 3 * HQ * DIM * 4, nl = 3 * HQ * 4;
  (void)state;
  fixture_make(&f, &c);
#define EXPECT_EXECUTE_FAILS(status, word, ...)                  \
  do {                                                           \
    poison(f.o, sizeof f.o);                                     \
    poison(f.lse, sizeof f.lse);                                 \
    EXPECT_FAIL(status, word, attn_decode_execute(__VA_ARGS__)); \
    EXPECT_UNTOUCHED(f.o, sizeof f.o);                           \
    EXPECT_UNTOUCHED(f.lse, sizeof f.lse);                       \
  } while (0)
  /* Never prepared. */
  poison(f.ws, f.bytes);
  EXPECT_EXECUTE_FAILS(INVALID, "workspace", f.plan, f.cache, f.q, f.o, f.lse, f.ws, f.bytes, NULL);
  EXPECT_OK(attn_decode_prepare(f.plan, f.cache, 2, ids, ql, f.ws, f.bytes, NULL, NULL));
  EXPECT_EXECUTE_FAILS(INVALID, "q", f.plan, f.cache, NULL, f.o, f.lse, f.ws, f.bytes, NULL);
  EXPECT_EXECUTE_FAILS(INVALID, "o", f.plan, f.cache, f.q, NULL, f.lse, f.ws, f.bytes, NULL);
  EXPECT_EXECUTE_FAILS(ATTN_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes", f.plan, f.cache, f.q, f.o,
                       f.lse, f.ws, f.bytes - 1, NULL);
  EXPECT_EXECUTE_FAILS(INVALID, "workspace", f.plan, f.cache, f.q, f.o, f.lse, NULL, f.bytes, NULL);
  EXPECT_EXECUTE_FAILS(ATTN_STATUS_INVALID_HANDLE, "plan", NULL, f.cache, f.q, f.o, f.lse, f.ws,
                       f.bytes, NULL);
  EXPECT_EXECUTE_FAILS(ATTN_STATUS_INVALID_HANDLE, "cache", f.plan, NULL, f.q, f.o, f.lse, f.ws,
                       f.bytes, NULL);
  {
    /* Another cache of the same configuration: the metadata are not its. */
    attn_kv_cache_t other = make_cache(&c);
    EXPECT_EXECUTE_FAILS(INVALID, "cache", f.plan, other, f.q, f.o, f.lse, f.ws, f.bytes, NULL);
    EXPECT_OK(attn_kv_cache_destroy(other));
  }
  {
    /* Another plan's workspace. */
    attn_decode_config_t d = decode_config();
    attn_decode_plan_t other;
    EXPECT_OK(attn_decode_plan_create(g_ctx, f.cache, &d, &other));
    EXPECT_EXECUTE_FAILS(INVALID, "workspace", other, f.cache, f.q, f.o, f.lse, f.ws, f.bytes, NULL);
    /* This plan's workspace, prepared by the other plan since (one buffer
     * shared by two plans): this plan is refused until it prepares again. */
    EXPECT_OK(attn_decode_prepare(other, f.cache, 2, ids, ql, f.ws, f.bytes, NULL, NULL));
    EXPECT_EXECUTE_FAILS(INVALID, "workspace", f.plan, f.cache, f.q, f.o, f.lse, f.ws, f.bytes, NULL);
    EXPECT_OK(attn_decode_plan_destroy(other));
    EXPECT_OK(attn_decode_prepare(f.plan, f.cache, 2, ids, ql, f.ws, f.bytes, NULL, NULL));
  }
  /* Prepared, then the cache changed: stale. */
  EXPECT_OK(attn_kv_cache_add_sequence(f.cache, 9));
  EXPECT_EXECUTE_FAILS(INVALID, "workspace", f.plan, f.cache, f.q, f.o, f.lse, f.ws, f.bytes, NULL);
  /* Prepared again: runs, writing exactly O [3, HQ, DIM] and LSE [HQ, 3]. */
  EXPECT_OK(attn_decode_prepare(f.plan, f.cache, 2, ids, ql, f.ws, f.bytes, NULL, NULL));
  poison(f.o, sizeof f.o);
  poison(f.lse, sizeof f.lse);
  EXPECT_OK(attn_decode_execute(f.plan, f.cache, f.q, f.o, f.lse, f.ws, f.bytes, NULL));
  EXPECT_UNTOUCHED((char *)f.o + no, sizeof f.o - no);
  EXPECT_UNTOUCHED((char *)f.lse + nl, sizeof f.lse - nl);
  {
    size_t i;
    for (i = 0; i < no / 4; ++i) assert_true(isfinite(f.o[i]));
    for (i = 0; i < nl / 4; ++i) assert_true(isfinite(f.lse[i]));
  }
  /* lse may be NULL. */
  EXPECT_OK(attn_decode_execute(f.plan, f.cache, f.q, f.o, NULL, f.ws, f.bytes, NULL));
  {
    /* The plan destroyed and a smaller one made, likely at the same address:
     * the metadata (two query tokens for sequence 1) are not its, and
     * running them would overrun its one-token scratch rows. */
    attn_decode_config_t d = decode_config();
    d.max_query_tokens = 1;
    EXPECT_OK(attn_decode_plan_destroy(f.plan));
    EXPECT_OK(attn_decode_plan_create(g_ctx, f.cache, &d, &f.plan));
    {
      size_t smaller = 0;
      EXPECT_OK(attn_decode_plan_workspace_size(f.plan, &smaller));
      assert_true(smaller <= f.bytes);
    }
    EXPECT_EXECUTE_FAILS(INVALID, "workspace", f.plan, f.cache, f.q, f.o, f.lse, f.ws, f.bytes,
                         NULL);
  }
  {
    /* The cache destroyed and a new one made, likely at the same address
     * and in the same state history: the metadata still do not match it
     * (the message names the cache or the workspace, by address). */
    EXPECT_OK(attn_kv_cache_destroy(f.cache));
    f.cache = make_cache(&c);
    add_two(f.cache, 6, 3);
    EXPECT_EXECUTE_FAILS(INVALID, NULL, f.plan, f.cache, f.q, f.o, f.lse, f.ws, f.bytes, NULL);
  }
#undef EXPECT_EXECUTE_FAILS
  fixture_free(&f);
}

/* Appends n random tokens in c's dtype and head dims to sequence id. */
static void append_as(attn_kv_cache_t cache, const attn_kv_cache_config_t *c, int64_t id,
                      int32_t n) {
  const attn_dtype_t dt = (attn_dtype_t)c->dtype;
  const size_t nk = (size_t)(n * c->heads_kv * c->head_dim_qk);
  const size_t nv = (size_t)(n * c->heads_kv * c->head_dim_v);
  float *kf = xmalloc(nk * 4), *vf = xmalloc(nv * 4);
  char *k = xmalloc(nk * 4), *v = xmalloc(nv * 4);
  size_t i;
  fill_random(kf, nk, g_seed++);
  fill_random(vf, nv, g_seed++);
  for (i = 0; i < nk; ++i) tu_store(k, i, dt, kf[i]);
  for (i = 0; i < nv; ++i) tu_store(v, i, dt, vf[i]);
  EXPECT_OK(attn_kv_cache_append(cache, 1, &id, &n, k, v, NULL));
  free(kf), free(vf), free(k), free(v);
}

/* A plan runs only on caches configured like the one it was made for: a
 * cache that differs in a single field, holding the same sequences, is
 * refused by prepare and by execute, which write nothing; the plan and
 * its workspace still serve the right cache afterwards. */
static void test_cache_mismatch(void **state) {
  enum { DTYPE, LAYOUT, PAGE_SIZE, NUM_PAGES, HEADS_KV, DIM_QK, DIM_V, WINDOW_ON, WINDOW,
         SINKS_ON, SINKS, NUM_FIELDS };
  const int64_t ids[2] = {1, 2};
  const int32_t ql[2] = {2, 1};
  const size_t no = 3 * HQ * DIM * 4, nl = 3 * HQ * 4;
  int field;
  (void)state;
  for (field = 0; field < NUM_FIELDS; ++field) {
    attn_kv_cache_config_t c = small_config(8), other_c;
    attn_kv_cache_t other;
    decode_fixture f;
    attn_decode_step_info_t info;
    float o_first[4 * 2 * HQ * DIM], lse_first[4 * 2 * HQ];
    if (field >= WINDOW) c.window = 16;
    if (field == SINKS) c.sink_tokens = 2;
    other_c = c;
    switch (field) {
      case DTYPE: other_c.dtype = ATTN_DTYPE_FP16; break;
      case LAYOUT: other_c.layout = ATTN_KV_LAYOUT_HND; break;
      case PAGE_SIZE: other_c.page_size = 8; break;
      case NUM_PAGES: other_c.num_pages = 9; break;
      case HEADS_KV: other_c.heads_kv = 1; break; /* HQ is a multiple of both */
      case DIM_QK: other_c.head_dim_qk = 16; break;
      case DIM_V: other_c.head_dim_v = 4; break;
      case WINDOW_ON: other_c.window = 16; break;
      case WINDOW: other_c.window = 24; break;
      case SINKS_ON: other_c.sink_tokens = 2; break;
      default: other_c.sink_tokens = 3; break;
    }
    fixture_make(&f, &c);
    other = make_cache(&other_c);
    EXPECT_OK(attn_kv_cache_add_sequence(other, 1));
    EXPECT_OK(attn_kv_cache_add_sequence(other, 2));
    append_as(other, &other_c, 1, 6);
    append_as(other, &other_c, 2, 3);

    poison(f.ws, f.bytes);
    POISON_VAR(info);
    info.struct_size = sizeof info;
    EXPECT_FAIL(INVALID, "cache",
                attn_decode_prepare(f.plan, other, 2, ids, ql, f.ws, f.bytes, &info, NULL));
    assert_non_null(strstr(attn_last_error_message(), "configured differently"));
    EXPECT_UNTOUCHED(f.ws, f.bytes);
    check_poisoned(&info.total_q, sizeof info - sizeof info.struct_size, "info", __FILE__,
                   __LINE__);

    EXPECT_OK(attn_decode_prepare(f.plan, f.cache, 2, ids, ql, f.ws, f.bytes, NULL, NULL));
    EXPECT_OK(attn_decode_execute(f.plan, f.cache, f.q, o_first, lse_first, f.ws, f.bytes, NULL));
    poison(f.o, sizeof f.o);
    poison(f.lse, sizeof f.lse);
    EXPECT_FAIL(INVALID, "cache",
                attn_decode_execute(f.plan, other, f.q, f.o, f.lse, f.ws, f.bytes, NULL));
    assert_non_null(strstr(attn_last_error_message(), "configured differently"));
    EXPECT_UNTOUCHED(f.o, sizeof f.o);
    EXPECT_UNTOUCHED(f.lse, sizeof f.lse);

    /* The prepared step still runs on its own cache, bit for bit. */
    EXPECT_OK(attn_decode_execute(f.plan, f.cache, f.q, f.o, f.lse, f.ws, f.bytes, NULL));
    assert_memory_equal(f.o, o_first, no);
    assert_memory_equal(f.lse, lse_first, nl);
    EXPECT_OK(attn_kv_cache_destroy(other));
    fixture_free(&f);
  }
}

static void test_describe(void **state) {
  attn_kv_cache_config_t c = small_config(8);
  decode_fixture f;
  attn_decode_plan_info_t info;
  size_t bytes = 0;
  (void)state;
  fixture_make(&f, &c);
  EXPECT_FAIL(INVALID, "info", attn_decode_plan_describe(f.plan, NULL));
  POISON_VAR(info);
  info.struct_size = 4;
  EXPECT_FAIL(INVALID, "info", attn_decode_plan_describe(f.plan, &info));
  EXPECT_FAIL(INVALID, "bytes", attn_decode_plan_workspace_size(f.plan, NULL));
  info.struct_size = sizeof info;
  EXPECT_OK(attn_decode_plan_describe(f.plan, &info));
  EXPECT_OK(attn_decode_plan_workspace_size(f.plan, &bytes));
  assert_int_equal(info.backend, ATTN_BACKEND_CPU);
  assert_int_equal(info.dtype, ATTN_DTYPE_FP32);
  assert_int_equal(info.heads_q, HQ);
  assert_int_equal(info.heads_kv, HKV);
  assert_int_equal(info.max_batch, 4);
  assert_int_equal(info.max_kv_tokens, 32); /* the pool: 8 pages of 4 */
  assert_int_equal(info.workspace_bytes, bytes);
  assert_true(strlen(info.kernel) > 0);
  assert_true(strlen(info.algorithm) > 0);
  /* One thread: the plan never splits by itself. */
  assert_int_equal(info.split_target_tasks, 0);
  assert_int_equal(info.split_min_chunk_tokens, 0);
  {
    /* Three threads: the automatic split aims at them. */
    attn_context_t ctx3;
    attn_decode_config_t d = decode_config();
    attn_decode_plan_t plan3;
    EXPECT_OK(attn_context_create(ATTN_BACKEND_CPU, 0, 3, &ctx3));
    EXPECT_OK(attn_decode_plan_create(ctx3, f.cache, &d, &plan3));
    POISON_VAR(info);
    info.struct_size = sizeof info;
    EXPECT_OK(attn_decode_plan_describe(plan3, &info));
    assert_int_equal(info.num_threads, 3);
    assert_int_equal(info.split_target_tasks, 3);
    assert_int_equal(info.split_min_chunk_tokens, 256);
    EXPECT_OK(attn_decode_plan_destroy(plan3));
    EXPECT_OK(attn_context_destroy(ctx3));
  }
  fixture_free(&f);
}

static void test_destroyed_handles(void **state) {
  attn_kv_cache_config_t c = small_config(8);
  attn_kv_cache_t cache = make_cache(&c);
  attn_decode_config_t d = decode_config();
  attn_decode_plan_t plan;
  attn_kv_cache_info_t info;
  size_t bytes;
  (void)state;
  EXPECT_OK(attn_decode_plan_create(g_ctx, cache, &d, &plan));
  /* A handle of another kind. */
  info.struct_size = sizeof info;
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache",
              attn_kv_cache_get_info((attn_kv_cache_t)(void *)plan, &info));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan",
              attn_decode_plan_workspace_size((attn_decode_plan_t)(void *)cache, &bytes));
  EXPECT_OK(attn_kv_cache_destroy(cache));
  /* The plan copied what it needs. */
  EXPECT_OK(attn_decode_plan_workspace_size(plan, &bytes));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache", attn_kv_cache_destroy(cache));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache", attn_kv_cache_get_info(cache, &info));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache", attn_kv_cache_add_sequence(cache, 1));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "cache", attn_kv_cache_release(cache, 1));
  EXPECT_OK(attn_decode_plan_destroy(plan));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_decode_plan_destroy(plan));
  EXPECT_FAIL(ATTN_STATUS_INVALID_HANDLE, "plan", attn_decode_plan_workspace_size(plan, &bytes));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_config_fields),
      cmocka_unit_test(test_create_errors),
      cmocka_unit_test(test_info_sizes),
      cmocka_unit_test(test_cuda_context_refused),
      cmocka_unit_test(test_add_release_length),
      cmocka_unit_test(test_append_errors),
      cmocka_unit_test(test_capacity),
      cmocka_unit_test(test_fork_errors),
      cmocka_unit_test(test_decode_plan_create_errors),
      cmocka_unit_test(test_prepare_errors),
      cmocka_unit_test(test_prepare_limits),
      cmocka_unit_test(test_truncate),
      cmocka_unit_test(test_execute_errors),
      cmocka_unit_test(test_cache_mismatch),
      cmocka_unit_test(test_describe),
      cmocka_unit_test(test_destroyed_handles),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
