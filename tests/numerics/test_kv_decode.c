/*
 * Decode plans over the paged KV cache against the fp64 reference.
 *
 * Each case fills a cache through a random schedule of multi-sequence
 * appends (prefill chunks, then the step's new tokens), keeping an exact
 * fp64 mirror of every sequence's K and V by position. The step's queries
 * are then run by attn_decode_prepare + attn_decode_execute and compared
 * with the reference over the mirrored tokens: query token t of a
 * sequence of n tokens and q_len queries is a one-row problem at position
 * p = n - q_len + t over the keys 0..p, of which the reference's
 * key_filter keeps those of the window and the sinks (j > p - w or j <
 * sinks). So the mask is materialised per (query, key) in the reference,
 * independently of the library's page walk.
 *
 * Tolerance as in harness.h: max |X_lib - X_ref| <= 2 max |X_lowp - X_ref|
 * + atol, with X_lowp the same-precision yardstick, atol = (max(4 u, 1e-5)
 * + 4 u32 Z) max |O_ref| for O and 1e-5 max(1, max |LSE_ref|) for LSE.
 * Every element of O and LSE must be written (they are poisoned with NaN
 * first; the workspace is filled with 0xff bytes).
 *
 * Also here: forked sequences (copy-on-write of a shared partial page,
 * pages-in-use accounting, release of one side), and a rolling-window cache
 * decoded step by step against the dense window plan over all tokens,
 * with pages in use bounded throughout. Caller memory lies between guard
 * bytes that no operation may change.
 *
 * ATTN_TEST_SEED=<n> reproduces a run's inputs.
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
#include <pthread.h>

#include "reference.h"
#include "testutil.h"

#define CHECK(call)                                                                            \
  do {                                                                                         \
    attn_status_t st_ = (call);                                                                \
    if (st_ != ATTN_STATUS_SUCCESS) {                                                          \
      print_error("%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call,                    \
                  attn_status_string(st_), attn_last_error_message());                         \
      fail();                                                                                  \
    }                                                                                          \
  } while (0)

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size ? size : 1);
  assert_non_null(p);
  return p;
}

/* ------------------------------------------------------------------------ */
/* A cache and its exact mirror                                              */
/* ------------------------------------------------------------------------ */

typedef struct mirror_seq {
  int64_t id;
  int64_t len;
  double *k, *v; /* [capacity][heads_kv][dim] by position */
} mirror_seq;

typedef struct kv_env {
  attn_kv_cache_config_t cfg;
  attn_context_t ctx;
  attn_kv_cache_t cache;
  /* Caller memory: `memory_bytes` (attn_kv_cache_memory_size) at `memory`,
   * between two guards of kGuardBytes inside `block`; NULL: the library's. */
  unsigned char *block, *memory;
  size_t memory_bytes;
  int threads;
  int64_t capacity;
  int nseq;
  mirror_seq seq[64];
} kv_env;

enum { kGuardBytes = 256 };

/* The guards' pattern: known, position-dependent and never zero. */
static unsigned char guard_byte(size_t i) { return (unsigned char)(1 + (i * 37) % 255); }

/* Fails unless both guards around the caller's memory still hold their
 * pattern: the cache must stay inside the bytes it was given. */
static void env_check_guards(const kv_env *e, const char *when) {
  long i;
  if (e->memory == NULL) return;
  for (i = -kGuardBytes; i < kGuardBytes; ++i) {
    const long at = i < 0 ? i : (long)e->memory_bytes + i;
    if (e->memory[at] != guard_byte((size_t)(i + kGuardBytes))) {
      print_error("%s: byte %ld of the caller's memory (%zu bytes given) was written\n", when, at,
                  e->memory_bytes);
      fail();
    }
  }
}

/* offset < 0: the library allocates the pool; else the caller's memory
 * starts `offset` bytes past a 64-byte boundary (the cache needs no
 * alignment from the caller). */
static void env_create_at(kv_env *e, const attn_kv_cache_config_t *cfg, int threads,
                          int offset, int nseq, int64_t capacity) {
  int i;
  memset(e, 0, sizeof *e);
  e->cfg = *cfg;
  e->threads = threads;
  e->capacity = capacity;
  e->nseq = nseq;
  CHECK(attn_context_create(ATTN_BACKEND_CPU, 0, threads, &e->ctx));
  if (offset >= 0) {
    size_t block_bytes, lead;
    CHECK(attn_kv_cache_memory_size(cfg, &e->memory_bytes));
    block_bytes = 64 + kGuardBytes + (size_t)offset + e->memory_bytes + kGuardBytes;
    e->block = (unsigned char *)malloc(block_bytes);
    assert_non_null(e->block);
    lead = (64 - (size_t)((uintptr_t)e->block % 64)) % 64;
    e->memory = e->block + lead + kGuardBytes + offset;
    for (i = -kGuardBytes; i < kGuardBytes; ++i) {
      const long at = i < 0 ? (long)i : (long)e->memory_bytes + i;
      e->memory[at] = guard_byte((size_t)(i + kGuardBytes));
    }
    memset(e->memory, 0xA5, e->memory_bytes);
    CHECK(attn_kv_cache_create(e->ctx, cfg, e->memory, e->memory_bytes, &e->cache));
    env_check_guards(e, "create");
  } else {
    CHECK(attn_kv_cache_create(e->ctx, cfg, NULL, 0, &e->cache));
  }
  for (i = 0; i < nseq; ++i) {
    e->seq[i].id = 1000 + 7 * i;
    e->seq[i].k = (double *)xcalloc((size_t)(capacity * cfg->heads_kv * cfg->head_dim_qk), 8);
    e->seq[i].v = (double *)xcalloc((size_t)(capacity * cfg->heads_kv * cfg->head_dim_v), 8);
    CHECK(attn_kv_cache_add_sequence(e->cache, e->seq[i].id));
  }
}

static void env_create(kv_env *e, const attn_kv_cache_config_t *cfg, int threads,
                       int caller_memory, int nseq, int64_t capacity) {
  env_create_at(e, cfg, threads, caller_memory ? 1 : -1, nseq, capacity);
}

static void env_destroy(kv_env *e) {
  int i;
  for (i = 0; i < e->nseq; ++i) free(e->seq[i].k), free(e->seq[i].v);
  env_check_guards(e, "before destroy");
  CHECK(attn_kv_cache_destroy(e->cache));
  env_check_guards(e, "destroy");
  CHECK(attn_context_destroy(e->ctx));
  free(e->block);
}

static int64_t pages_in_use(const kv_env *e) {
  attn_kv_cache_info_t info;
  info.struct_size = sizeof info;
  CHECK(attn_kv_cache_get_info(e->cache, &info));
  return info.pages_in_use;
}

/* Appends counts[i] random tokens to sequences idx[i] (mirror indices) in
 * one call; on success records them in the mirrors. Returns the status. */
static attn_status_t env_try_append(kv_env *e, tu_rng *rng, int n, const int *idx,
                                    const int32_t *counts) {
  const int64_t hkv = e->cfg.heads_kv, dqk = e->cfg.head_dim_qk, dv = e->cfg.head_dim_v;
  const attn_dtype_t dt = (attn_dtype_t)e->cfg.dtype;
  int64_t total = 0, off = 0, len;
  int64_t ids[64];
  tu_buffer k, v;
  attn_status_t status;
  int i;
  for (i = 0; i < n; ++i) total += counts[i], ids[i] = e->seq[idx[i]].id;
  tu_buffer_alloc(&k, dt, (size_t)(total * hkv * dqk));
  tu_buffer_alloc(&v, dt, (size_t)(total * hkv * dv));
  tu_fill_normal(rng, &k, 1.0);
  tu_fill_normal(rng, &v, 1.0);
  status = attn_kv_cache_append(e->cache, n, ids, counts, k.data, v.data, NULL);
  for (i = 0; i < n && status == ATTN_STATUS_SUCCESS; ++i) {
    mirror_seq *s = &e->seq[idx[i]];
    assert_true(s->len + counts[i] <= e->capacity);
    memcpy(s->k + s->len * hkv * dqk, k.mirror + off * hkv * dqk,
           (size_t)(counts[i] * hkv * dqk) * 8);
    memcpy(s->v + s->len * hkv * dv, v.mirror + off * hkv * dv, (size_t)(counts[i] * hkv * dv) * 8);
    s->len += counts[i];
    off += counts[i];
  }
  /* Either way the library's lengths must equal the mirrors'. */
  for (i = 0; i < n; ++i) {
    CHECK(attn_kv_cache_sequence_length(e->cache, e->seq[idx[i]].id, &len));
    assert_int_equal(len, e->seq[idx[i]].len);
  }
  tu_buffer_free(&k);
  tu_buffer_free(&v);
  return status;
}

static void env_append(kv_env *e, tu_rng *rng, int n, const int *idx, const int32_t *counts) {
  CHECK(env_try_append(e, rng, n, idx, counts));
}

/* ------------------------------------------------------------------------ */
/* One decode step against the reference                                     */
/* ------------------------------------------------------------------------ */

typedef struct step {
  int n;                /* sequences in the batch */
  int idx[64];          /* mirror indices, in batch order */
  int32_t q_len[64];
  int64_t heads_q;
  int64_t max_q;
  int64_t chunk_tokens; /* the plan's kv_chunk_tokens */
  float softcap;
  float scale;          /* 0: the default 1/sqrt(d_qk) */
} step;

typedef struct step_result {
  attn_decode_step_info_t info;
  double err_o, tol_o;
} step_result;

static int key_visible(const attn_kv_cache_config_t *c, int64_t p, int64_t j) {
  return j <= p && (c->window == 0 || j > p - c->window || j < c->sink_tokens);
}

static double atol_scale(attn_dtype_t dtype, double zmax) {
  const double a = 4.0 * tu_unit_roundoff(dtype);
  return (a > 1e-5 ? a : 1e-5) + 4.0 * tu_unit_roundoff(ATTN_DTYPE_FP32) * zmax;
}

static void judge(const char *label, const tu_err *lib, const tu_err *lowp, double atol,
                  double *tol_out) {
  const double tol = 2.0 * lowp->max_err + atol;
  char line[512];
  if (tol_out) *tol_out = tol;
  if (!tu_err_ok(lib, tol) || lowp->bad > 0) {
    tu_err_format(lib, tol, line, sizeof line);
    print_error("%s: %s (yardstick error %.3g)\n", label, line, lowp->max_err);
    fail();
  }
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The split a step must report, from attn.h: a chunk is a run of the pages
 * a sequence's queries read; kv_chunk_tokens n > 0 cuts at n tokens rounded
 * up to whole pages, -1 never; 0 on the CPU cuts only a batch of fewer
 * (sequence, KV head) tasks than threads, at max(ceil(P / ceil(2 threads /
 * tasks)), ceil(split_min_chunk_tokens / page_size)) pages, P the most
 * pages a sequence reads. The step reports the chunk length only when some
 * sequence has more than one chunk. */
static void check_split(const kv_env *e, const step *st, attn_decode_plan_t plan,
                        const attn_decode_step_info_t *info, const char *label) {
  const attn_kv_cache_config_t *c = &e->cfg;
  const int64_t ps = c->page_size, tasks = st->n * c->heads_kv;
  const int autos = st->chunk_tokens == 0 && e->threads > 1;
  int64_t pages[64], most = 0, chunk = 0, units = 0, split = 0, max_chunks = 1;
  attn_decode_plan_info_t pi;
  int i;
  pi.struct_size = sizeof pi;
  CHECK(attn_decode_plan_describe(plan, &pi));
  assert_int_equal(pi.split_target_tasks, autos ? e->threads : 0);
  assert_int_equal(pi.split_min_chunk_tokens > 0, autos);
  for (i = 0; i < st->n; ++i) {
    const mirror_seq *s = &e->seq[st->idx[i]];
    int64_t j, t, last = -1;
    pages[i] = 0;
    for (j = 0; j < s->len; ++j) { /* pages holding a key some query sees */
      int seen = 0;
      for (t = s->len - st->q_len[i]; t < s->len && !seen; ++t) seen = key_visible(c, t, j);
      if (seen && j / ps != last) ++pages[i], last = j / ps;
    }
    most = pages[i] > most ? pages[i] : most;
  }
  if (st->chunk_tokens > 0) {
    chunk = ceil_div(st->chunk_tokens, ps);
  } else if (autos && tasks < e->threads) {
    const int64_t floor_pages = ceil_div(pi.split_min_chunk_tokens, ps);
    chunk = ceil_div(most, ceil_div(2 * (int64_t)e->threads, tasks));
    if (chunk < floor_pages) chunk = floor_pages;
  }
  for (i = 0; i < st->n; ++i) {
    const int64_t n = chunk > 0 && pages[i] > chunk ? ceil_div(pages[i], chunk) : 1;
    units += n;
    split += n > 1;
    max_chunks = n > max_chunks ? n : max_chunks;
  }
  if (info->num_work_units != units || info->split_sequences != split ||
      info->max_chunks != max_chunks || info->kv_chunk_tokens != (split > 0 ? chunk * ps : 0)) {
    print_error("%s: split (units, split sequences, max chunks, chunk tokens) is (%lld, %lld, "
                "%lld, %lld), expected (%lld, %lld, %lld, %lld)\n",
                label, (long long)info->num_work_units, (long long)info->split_sequences,
                (long long)info->max_chunks, (long long)info->kv_chunk_tokens, (long long)units,
                (long long)split, (long long)max_chunks, (long long)(split > 0 ? chunk * ps : 0));
    fail();
  }
}

/* Runs the step through the library and checks O and LSE. */
static void run_step(kv_env *e, tu_rng *rng, const step *st, const char *label,
                     step_result *res) {
  const attn_kv_cache_config_t *c = &e->cfg;
  const attn_dtype_t dt = (attn_dtype_t)c->dtype;
  const int64_t hq = st->heads_q, hkv = c->heads_kv, dqk = c->head_dim_qk, dv = c->head_dim_v;
  const int64_t group = hq / hkv;
  attn_decode_config_t dc;
  attn_decode_plan_t plan = NULL;
  size_t ws_bytes = 0;
  void *ws;
  int64_t total_q = 0, total_kv = 0, ids[64];
  int64_t *cu_q, *cu_kv;
  unsigned char *filter;
  double *kg, *vg, *o_ref, *o_lowp, *lse_ref, *lse_lowp;
  float *lse;
  tu_buffer q, o;
  ref_problem rp;
  tu_err lib, lowp;
  int i;
  int64_t t, row, j, h, ch;
  (void)group;

  dc = tu_decode_config(hq, st->n + 1, st->max_q, st->chunk_tokens);
  dc.softcap = st->softcap;
  dc.softmax_scale = st->scale;
  CHECK(attn_decode_plan_create(e->ctx, e->cache, &dc, &plan));
  CHECK(attn_decode_plan_workspace_size(plan, &ws_bytes));
  ws = malloc(ws_bytes + 1);
  assert_non_null(ws);
  tu_poison_bytes(ws, ws_bytes + 1);

  for (i = 0; i < st->n; ++i) total_q += st->q_len[i], ids[i] = e->seq[st->idx[i]].id;
  tu_buffer_alloc(&q, dt, (size_t)(total_q * hq * dqk));
  tu_buffer_alloc(&o, dt, (size_t)(total_q * hq * dv));
  tu_fill_normal(rng, &q, 1.0);
  lse = (float *)xcalloc((size_t)(hq * total_q), sizeof(float));
  tu_poison(lse, ATTN_DTYPE_FP32, (size_t)(hq * total_q));

  memset(&res->info, 0, sizeof res->info);
  res->info.struct_size = sizeof res->info;
  CHECK(attn_decode_prepare(plan, e->cache, st->n, ids, st->q_len, (char *)ws + 1, ws_bytes,
                            &res->info, NULL));
  assert_int_equal(res->info.total_q, total_q);
  check_split(e, st, plan, &res->info, label);
  CHECK(attn_decode_execute(plan, e->cache, q.data, o.data, lse, (char *)ws + 1, ws_bytes, NULL));

  /* The reference: one row per query token over the keys at positions
   * 0..p, filtered by the window and the sinks. */
  cu_q = (int64_t *)xcalloc((size_t)total_q + 1, 8);
  cu_kv = (int64_t *)xcalloc((size_t)total_q + 1, 8);
  row = 0;
  for (i = 0; i < st->n; ++i) {
    const mirror_seq *s = &e->seq[st->idx[i]];
    for (t = 0; t < st->q_len[i]; ++t, ++row) {
      const int64_t p = s->len - st->q_len[i] + t;
      cu_q[row + 1] = row + 1;
      cu_kv[row + 1] = cu_kv[row] + p + 1;
    }
  }
  total_kv = cu_kv[total_q];
  kg = (double *)xcalloc((size_t)(total_kv * hkv * dqk), 8);
  vg = (double *)xcalloc((size_t)(total_kv * hkv * dv), 8);
  filter = (unsigned char *)xcalloc((size_t)total_kv, 1);
  row = 0;
  for (i = 0; i < st->n; ++i) {
    const mirror_seq *s = &e->seq[st->idx[i]];
    for (t = 0; t < st->q_len[i]; ++t, ++row) {
      const int64_t p = s->len - st->q_len[i] + t;
      memcpy(kg + cu_kv[row] * hkv * dqk, s->k, (size_t)((p + 1) * hkv * dqk) * 8);
      memcpy(vg + cu_kv[row] * hkv * dv, s->v, (size_t)((p + 1) * hkv * dv) * 8);
      for (j = 0; j <= p; ++j) filter[cu_kv[row] + j] = (unsigned char)key_visible(c, p, j);
    }
  }
  {
    /* The step's report: visible pairs exactly; KV bytes read at least
     * those of the visible keys, at most a page more at each end of the
     * window and sink ranges. */
    uint64_t pairs = 0;
    double keys = 0.0, slack = 0.0;
    const double bpt = (double)(hkv * (dqk + dv)) * (double)tu_dtype_size(dt);
    for (j = 0; j < total_kv; ++j) pairs += filter[j];
    assert_int_equal(res->info.visible_pairs, pairs * (uint64_t)hq);
    row = 0;
    for (i = 0; i < st->n; ++i) {
      const mirror_seq *s = &e->seq[st->idx[i]];
      for (j = 0; j < s->len; ++j) { /* keys any query of s sees */
        int seen = 0;
        for (t = s->len - st->q_len[i]; t < s->len && !seen; ++t) seen = key_visible(c, t, j);
        keys += seen;
      }
      slack += 4.0 * (double)c->page_size;
      row += st->q_len[i];
    }
    assert_true(res->info.kv_bytes_read >= keys * bpt);
    assert_true(res->info.kv_bytes_read <= (keys + slack) * bpt);
  }
  memset(&rp, 0, sizeof rp);
  rp.batch = total_q;
  rp.heads_q = hq, rp.heads_kv = hkv;
  rp.head_dim_qk = dqk, rp.head_dim_v = dv;
  rp.cu_q = cu_q, rp.cu_kv = cu_kv;
  rp.varlen = 1;
  rp.scale = st->scale > 0.0f ? (double)st->scale : (double)(float)(1.0 / sqrt((double)dqk));
  rp.softcap = st->softcap;
  rp.window_left = -1, rp.window_right = -1;
  rp.key_filter = filter;
  rp.q.seq = hq * dqk, rp.q.head = dqk;
  rp.o = rp.q, rp.o.seq = hq * dv, rp.o.head = dv;
  rp.k.seq = hkv * dqk, rp.k.head = dqk;
  rp.v.seq = hkv * dv, rp.v.head = dv;
  o_ref = (double *)xcalloc((size_t)(total_q * hq * dv), 8);
  o_lowp = (double *)xcalloc((size_t)(total_q * hq * dv), 8);
  lse_ref = (double *)xcalloc((size_t)(total_q * hq), 8);
  lse_lowp = (double *)xcalloc((size_t)(total_q * hq), 8);
  ref_forward(&rp, q.mirror, kg, vg, o_ref, lse_ref);
  ref_lowp_forward(&rp, dt, q.mirror, kg, vg, o_lowp, lse_lowp);

  tu_err_init(&lib, "O");
  tu_err_init(&lowp, "O");
  for (row = 0; row < total_q; ++row)
    for (h = 0; h < hq; ++h)
      for (ch = 0; ch < dv; ++ch) {
        const size_t at = (size_t)((row * hq + h) * dv + ch);
        if (tu_is_poison(o.data, at, dt)) {
          print_error("%s: O[%lld, %lld, %lld] was not written\n", label, (long long)row,
                      (long long)h, (long long)ch);
          fail();
        }
        tu_err_add(&lib, 0, row, h, ch, tu_load(o.data, at, dt), o_ref[at]);
        tu_err_add(&lowp, 0, row, h, ch, o_lowp[at], o_ref[at]);
      }
  judge(label, &lib, &lowp, atol_scale(dt, ref_max_abs_logit(&rp, q.mirror, kg)) * lib.max_ref,
        &res->tol_o);
  res->err_o = lib.max_err;
  assert_true(lib.max_ref > 0.0); /* not vacuous */
  tu_err_init(&lib, "LSE");
  tu_err_init(&lowp, "LSE");
  for (h = 0; h < hq; ++h)
    for (row = 0; row < total_q; ++row) {
      const size_t at = (size_t)(h * total_q + row);
      tu_err_add(&lib, 0, row, h, -1, lse[at], lse_ref[ref_lse_index(&rp, row, h, 0)]);
      tu_err_add(&lowp, 0, row, h, -1, lse_lowp[ref_lse_index(&rp, row, h, 0)],
                 lse_ref[ref_lse_index(&rp, row, h, 0)]);
    }
  judge(label, &lib, &lowp, 1e-5 * (lib.max_ref > 1.0 ? lib.max_ref : 1.0), NULL);

  free(cu_q), free(cu_kv), free(kg), free(vg), free(filter);
  free(o_ref), free(o_lowp), free(lse_ref), free(lse_lowp), free(lse), free(ws);
  tu_buffer_free(&q);
  tu_buffer_free(&o);
  CHECK(attn_decode_plan_destroy(plan));
}

/* ------------------------------------------------------------------------ */
/* The case matrix                                                           */
/* ------------------------------------------------------------------------ */

typedef struct kv_case {
  const char *name;
  attn_dtype_t dtype;
  attn_kv_layout_t layout;
  int64_t page_size;
  int64_t heads_q, heads_kv, dqk, dv;
  int nseq;
  int64_t max_len;   /* longest sequence */
  int64_t max_q;     /* query tokens per sequence: random in 1..max_q */
  int64_t window, sinks;
  float softcap;
  int threads;
  int caller_memory;
  float scale; /* 0: default */
} kv_case;

/* Fills the cache by a random interleaved append schedule, then runs one
 * step with split-KV off, forced on (small chunks) and automatic. */
static void run_case(const kv_case *kc) {
  tu_rng rng = tu_rng_for(kc->name);
  attn_kv_cache_config_t cfg;
  kv_env e;
  step st;
  step_result off, on, autos;
  int64_t target[64], pages = 0, bound = 0;
  int32_t qlen[64];
  int i, pass;
  char label[256];

  cfg = tu_kv_cache_config(kc->dtype, kc->layout, kc->page_size, 0 /* set below */, kc->heads_kv,
                           kc->dqk, kc->dv, kc->window, kc->sinks);
  for (i = 0; i < kc->nseq; ++i) {
    qlen[i] = (int32_t)tu_rng_int(&rng, 1, kc->max_q);
    target[i] = i == 0 ? kc->max_len : tu_rng_int(&rng, qlen[i], kc->max_len);
    pages += (target[i] + kc->page_size - 1) / kc->page_size + 1;
  }
  cfg.num_pages = pages + 2;
  env_create(&e, &cfg, kc->threads, kc->caller_memory, kc->nseq, kc->max_len);

  /* Prefill: rounds of appends to a random subset, each a random chunk,
   * until every sequence holds all but its step's tokens. */
  for (;;) {
    int idx[64], n = 0;
    int32_t cnt[64];
    for (i = 0; i < kc->nseq; ++i) {
      const int64_t left = target[i] - qlen[i] - e.seq[i].len;
      if (left <= 0 || tu_rng_int(&rng, 0, 3) == 0) continue;
      idx[n] = i;
      cnt[n] = (int32_t)tu_rng_int(&rng, 1, left < 3 * kc->page_size ? left : 3 * kc->page_size);
      ++n;
    }
    if (n == 0) {
      int done = 1;
      for (i = 0; i < kc->nseq; ++i) done &= e.seq[i].len == target[i] - qlen[i];
      if (done) break;
      continue;
    }
    env_append(&e, &rng, n, idx, cnt);
  }
  /* The step's tokens, all sequences in one call, in a shuffled order. */
  {
    int32_t perm[64];
    int idx[64];
    int32_t cnt[64];
    tu_rng_permutation(&rng, perm, (size_t)kc->nseq);
    for (i = 0; i < kc->nseq; ++i) idx[i] = perm[i], cnt[i] = qlen[perm[i]];
    env_append(&e, &rng, kc->nseq, idx, cnt);
    memset(&st, 0, sizeof st);
    st.n = kc->nseq;
    for (i = 0; i < kc->nseq; ++i) st.idx[i] = perm[(i + 1) % kc->nseq], st.q_len[i] = qlen[st.idx[i]];
  }
  /* A window keeps each sequence to its sinks, window and last append. */
  if (kc->window > 0) {
    for (i = 0; i < kc->nseq; ++i)
      bound += (kc->sinks + kc->page_size - 1) / kc->page_size +
               (kc->window - 1 + qlen[i] + kc->page_size - 1) / kc->page_size + 1;
    if (pages_in_use(&e) > bound) {
      print_error("%s: %lld pages in use, the window allows %lld\n", kc->name,
                  (long long)pages_in_use(&e), (long long)bound);
      fail();
    }
  }

  st.heads_q = kc->heads_q;
  st.max_q = kc->max_q;
  st.softcap = kc->softcap;
  st.scale = kc->scale;
  for (pass = 0; pass < 3; ++pass) {
    step_result *r = pass == 0 ? &off : pass == 1 ? &on : &autos;
    st.chunk_tokens = pass == 0 ? -1 : pass == 1 ? 2 * kc->page_size : 0;
    snprintf(label, sizeof label, "%s (kv_chunk_tokens %lld)", kc->name,
             (long long)st.chunk_tokens);
    run_step(&e, &rng, &st, label, r);
  }
  assert_int_equal(off.info.split_sequences, 0);
  assert_int_equal(off.info.num_work_units, kc->nseq);
  {
    /* Forced: every sequence whose pages span more than two is split. */
    int64_t longest = 0;
    for (i = 0; i < kc->nseq; ++i) longest = e.seq[i].len > longest ? e.seq[i].len : longest;
    if (kc->window == 0 && longest > 3 * kc->page_size) assert_true(on.info.split_sequences > 0);
    assert_true(on.info.num_work_units >= kc->nseq);
    /* Auto: threads to spare and a long sequence. */
    if (kc->threads > 1 && kc->nseq * kc->heads_kv < kc->threads && kc->window == 0 &&
        longest >= 1024)
      assert_true(autos.info.split_sequences > 0);
    if (kc->threads == 1) assert_int_equal(autos.info.split_sequences, 0);
  }
  env_destroy(&e);
}

#define F32 ATTN_DTYPE_FP32
#define F16 ATTN_DTYPE_FP16
#define B16 ATTN_DTYPE_BF16
#define NHD ATTN_KV_LAYOUT_NHD
#define HND ATTN_KV_LAYOUT_HND

static const kv_case kCases[] = {
    /* name, dtype, layout, page size, heads q/kv, dims qk/v, sequences, longest, max q,
       window, sinks, softcap, threads, caller memory, scale */
    {"mha-ps16-nhd-q1", F32, NHD, 16, 4, 4, 32, 32, 5, 150, 1, 0, 0, 0.0f, 1, 0, 0.0f},
    {"mha-ps16-hnd-q1", F32, HND, 16, 4, 4, 32, 32, 5, 150, 1, 0, 0, 0.0f, 1, 1, 0.0f},
    {"gqa4-ps1-nhd-q3", F32, NHD, 1, 8, 2, 16, 24, 4, 40, 3, 0, 0, 0.0f, 1, 0, 0.0f},
    {"gqa4-ps7-hnd-q4", F32, HND, 7, 8, 2, 40, 24, 6, 120, 4, 0, 0, 0.0f, 2, 1, 0.0f},
    {"gqa8-ps64-nhd-q1", F32, NHD, 64, 8, 1, 64, 64, 3, 300, 1, 0, 0, 0.0f, 3, 0, 0.0f},
    {"gqa8-ps64-hnd-q5", F32, HND, 64, 16, 2, 64, 64, 3, 260, 5, 0, 0, 0.0f, 1, 0, 0.0f},
    {"gqa4-ps16-bf16-q2", B16, NHD, 16, 8, 2, 64, 64, 4, 200, 2, 0, 0, 0.0f, 2, 0, 0.0f},
    {"gqa8-ps7-bf16-hnd", B16, HND, 7, 8, 1, 32, 32, 5, 90, 3, 0, 0, 0.0f, 1, 1, 0.0f},
    {"gqa4-ps16-fp16-q1", F16, NHD, 16, 8, 2, 64, 64, 4, 180, 1, 0, 0, 0.0f, 2, 0, 0.0f},
    {"mha-ps1-fp16-hnd-q2", F16, HND, 1, 2, 2, 16, 16, 3, 50, 2, 0, 0, 0.0f, 1, 0, 0.0f},
    {"softcap-gqa4-ps16", F32, NHD, 16, 4, 1, 32, 32, 3, 100, 2, 0, 0, 5.0f, 1, 0, 0.0f},
    {"scale-softcap-bf16", B16, HND, 16, 4, 2, 32, 32, 3, 100, 2, 0, 0, 3.0f, 1, 0, 0.45f},
    {"scale-fp16-ps7", F16, NHD, 7, 8, 2, 24, 40, 3, 60, 3, 0, 0, 0.0f, 1, 0, 0.07f},
    /* rolling windows, with and without sinks */
    {"win24-ps16-nhd-q1", F32, NHD, 16, 4, 2, 32, 32, 4, 200, 1, 24, 0, 0.0f, 1, 0, 0.0f},
    {"win24-sink4-ps16-q3", F32, HND, 16, 4, 2, 32, 32, 4, 200, 3, 24, 4, 0.0f, 1, 0, 0.0f},
    {"win10-sink3-ps7-q4", F32, NHD, 7, 8, 1, 16, 16, 5, 150, 4, 10, 3, 0.0f, 2, 1, 0.0f},
    {"win5-sink1-ps1-bf16", B16, HND, 1, 4, 4, 16, 16, 3, 60, 2, 5, 1, 0.0f, 1, 0, 0.0f},
    {"win1-ps64-fp16-q1", F16, NHD, 64, 8, 2, 32, 32, 3, 300, 1, 1, 0, 0.0f, 1, 0, 0.0f},
    {"win100-sink20-ps7-q5", F32, HND, 7, 4, 1, 32, 16, 3, 260, 5, 100, 20, 0.0f, 1, 0, 0.0f},
    /* auto split with threads to spare: one long sequence */
    {"auto-split-1seq", F32, NHD, 16, 4, 1, 32, 32, 1, 1500, 1, 0, 0, 0.0f, 4, 0, 0.0f},
};

static void test_case(void **state) { run_case((const kv_case *)*state); }

/* ------------------------------------------------------------------------ */
/* Forks                                                                     */
/* ------------------------------------------------------------------------ */

static void copy_mirror(kv_env *e, int to, int from, int64_t len) {
  const int64_t hkv = e->cfg.heads_kv;
  memcpy(e->seq[to].k, e->seq[from].k, (size_t)(len * hkv * e->cfg.head_dim_qk) * 8);
  memcpy(e->seq[to].v, e->seq[from].v, (size_t)(len * hkv * e->cfg.head_dim_v) * 8);
  e->seq[to].len = len;
}

static void test_fork(void **state) {
  const attn_dtype_t dtypes[2] = {ATTN_DTYPE_FP32, ATTN_DTYPE_BF16};
  int d;
  (void)state;
  for (d = 0; d < 2; ++d) {
    tu_rng rng = tu_rng_for(d == 0 ? "fork-fp32" : "fork-bf16");
    attn_kv_cache_config_t cfg;
    kv_env e;
    step st;
    step_result r;
    int idx[3] = {0, 1, 2};
    int32_t cnt[3];
    int64_t before, after_fork, len;
    const int64_t ps = 8, prefix = 45; /* 5 full pages and a partial sixth */

    cfg = tu_kv_cache_config(dtypes[d], d == 0 ? ATTN_KV_LAYOUT_NHD : ATTN_KV_LAYOUT_HND, ps, 40,
                             2, 32, 32, 0, 0);
    env_create(&e, &cfg, 1, 0, 1, 200);
    cnt[0] = (int32_t)prefix;
    env_append(&e, &rng, 1, idx, cnt);
    before = pages_in_use(&e);
    assert_int_equal(before, 6);

    /* Sequence 1: a full fork; sequence 2: the first 20 tokens (2 full
     * pages and a partial one). */
    e.nseq = 3;
    e.seq[1].id = 77, e.seq[2].id = 78;
    e.seq[1].k = (double *)xcalloc((size_t)(200 * 2 * 32), 8);
    e.seq[1].v = (double *)xcalloc((size_t)(200 * 2 * 32), 8);
    e.seq[2].k = (double *)xcalloc((size_t)(200 * 2 * 32), 8);
    e.seq[2].v = (double *)xcalloc((size_t)(200 * 2 * 32), 8);
    CHECK(attn_kv_cache_fork(e.cache, e.seq[0].id, 77, prefix));
    CHECK(attn_kv_cache_fork(e.cache, e.seq[0].id, 78, 20));
    copy_mirror(&e, 1, 0, prefix);
    copy_mirror(&e, 2, 0, 20);
    CHECK(attn_kv_cache_sequence_length(e.cache, 78, &len));
    assert_int_equal(len, 20);
    after_fork = pages_in_use(&e);
    assert_int_equal(after_fork, before); /* nothing duplicated */

    /* One token each: 0 copies its shared partial page, 1 then owns the
     * original alone and writes in place, 2 copies page 2. */
    cnt[0] = cnt[1] = cnt[2] = 1;
    env_append(&e, &rng, 3, idx, cnt);
    assert_int_equal(pages_in_use(&e), before + 2);
    /* Then a different chunk for each, crossing pages. */
    cnt[0] = 9, cnt[1] = 3, cnt[2] = 12;
    env_append(&e, &rng, 3, idx, cnt);

    memset(&st, 0, sizeof st);
    st.n = 3;
    st.idx[0] = 0, st.idx[1] = 1, st.idx[2] = 2;
    st.q_len[0] = 3, st.q_len[1] = 2, st.q_len[2] = 4;
    st.heads_q = 4;
    st.max_q = 4;
    st.chunk_tokens = -1;
    run_step(&e, &rng, &st, "fork: all three", &r);
    st.chunk_tokens = ps;
    run_step(&e, &rng, &st, "fork: all three, split", &r);

    /* Releasing 0 keeps 1 and 2 intact; pages only 0 held return. */
    {
      const int64_t in_use = pages_in_use(&e);
      CHECK(attn_kv_cache_release(e.cache, e.seq[0].id));
      /* 0 owned its copied page 5 and page 6 alone. */
      assert_int_equal(pages_in_use(&e), in_use - 2);
      st.n = 2;
      st.idx[0] = 2, st.idx[1] = 1;
      st.q_len[0] = 1, st.q_len[1] = 2;
      st.chunk_tokens = -1;
      run_step(&e, &rng, &st, "fork: after releasing the parent", &r);
      CHECK(attn_kv_cache_release(e.cache, 77));
      CHECK(attn_kv_cache_release(e.cache, 78));
      assert_int_equal(pages_in_use(&e), 0);
    }
    env_destroy(&e);
  }
}

/* Forks in a windowed cache with sinks: both sides keep appending and
 * evicting; pages shared by the two are freed only when both let go. */
static void test_fork_windowed(void **state) {
  tu_rng rng = tu_rng_for("fork-windowed");
  attn_kv_cache_config_t cfg;
  kv_env e;
  step st;
  step_result r;
  int idx[2] = {0, 1}, round;
  int32_t cnt[2];
  const int64_t ps = 4, w = 12, sinks = 2;
  (void)state;
  cfg = tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_HND, ps, 16, 1, 16, 16, w, sinks);
  env_create(&e, &cfg, 1, 1, 1, 400);
  cnt[0] = 30;
  env_append(&e, &rng, 1, idx, cnt);
  e.nseq = 2;
  e.seq[1].id = 5;
  e.seq[1].k = (double *)xcalloc(400 * 16, 8);
  e.seq[1].v = (double *)xcalloc(400 * 16, 8);
  {
    const int64_t before = pages_in_use(&e);
    CHECK(attn_kv_cache_fork(e.cache, e.seq[0].id, 5, 30));
    copy_mirror(&e, 1, 0, 30);
    assert_int_equal(pages_in_use(&e), before);
  }
  memset(&st, 0, sizeof st);
  st.n = 2;
  st.idx[0] = 1, st.idx[1] = 0;
  st.heads_q = 2;
  /* Before anything is appended: the last 4 tokens of child and parent see
   * keys from position 30 - 4 - 12 + 1 = 15 (page 3) on, one page below
   * what the child's next token needs (19, page 4): the fork keeps it, as
   * the parent still holds it. */
  st.max_q = 4;
  st.q_len[0] = st.q_len[1] = 4;
  st.chunk_tokens = -1;
  run_step(&e, &rng, &st, "windowed fork, last tokens", &r);
  st.max_q = 3;
  for (round = 0; round < 25; ++round) {
    cnt[0] = (int32_t)tu_rng_int(&rng, 1, 3);
    cnt[1] = (int32_t)tu_rng_int(&rng, 1, 3);
    env_append(&e, &rng, 2, idx, cnt);
    /* Sinks (1 page) plus w - 1 + 3 positions (at most 5 pages) each. */
    assert_true(pages_in_use(&e) <= 2 * (1 + 5));
    st.q_len[0] = cnt[1], st.q_len[1] = cnt[0];
    st.chunk_tokens = round % 2 ? ps : -1;
    run_step(&e, &rng, &st, "windowed fork", &r);
  }
  CHECK(attn_kv_cache_release(e.cache, e.seq[0].id));
  assert_true(pages_in_use(&e) <= 1 + 5);
  cnt[0] = 2;
  idx[0] = 1;
  env_append(&e, &rng, 1, idx, cnt);
  st.n = 1;
  st.idx[0] = 1;
  st.q_len[0] = 2;
  run_step(&e, &rng, &st, "windowed fork, parent released", &r);
  env_destroy(&e);
}

/* Caller memory of exactly attn_kv_cache_memory_size bytes, at several
 * misaligned starts, between guards: appends, a fork and its copy-on-write
 * copy, filling every page of the pool, a refused append, decode steps and
 * refilling released pages never write outside it, while the cache does
 * keep its pages there (the decodes match the reference). */
static void test_caller_memory_stays_inside(void **state) {
  static const struct {
    attn_dtype_t dtype;
    attn_kv_layout_t layout;
    int64_t ps, pages, hkv, dqk, dv;
  } configs[] = {
      {ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, 4, 6, 2, 8, 12},
      {ATTN_DTYPE_BF16, ATTN_KV_LAYOUT_HND, 3, 7, 1, 16, 8},
      {ATTN_DTYPE_FP16, ATTN_KV_LAYOUT_NHD, 5, 5, 2, 4, 4},
  };
  static const int offsets[] = {0, 1, 33, 63};
  size_t ci, oi;
  (void)state;
  for (ci = 0; ci < sizeof configs / sizeof configs[0]; ++ci)
    for (oi = 0; oi < sizeof offsets / sizeof offsets[0]; ++oi) {
      const int64_t ps = configs[ci].ps, pages = configs[ci].pages, cap = pages * ps + 8;
      tu_rng rng = tu_rng_for("caller-memory");
      attn_kv_cache_config_t cfg;
      kv_env e;
      step st;
      step_result r;
      int idx[2] = {0, 1};
      int32_t cnt[2];
      size_t b, changed = 0;
      char label[128];
      snprintf(label, sizeof label, "caller memory: config %zu, offset %d", ci, offsets[oi]);
      cfg = tu_kv_cache_config(configs[ci].dtype, configs[ci].layout, ps, pages, configs[ci].hkv,
                               configs[ci].dqk, configs[ci].dv, 0, 0);
      env_create_at(&e, &cfg, 1, offsets[oi], 1, cap);
      cnt[0] = (int32_t)(2 * ps + 1); /* a partial third page */
      env_append(&e, &rng, 1, idx, cnt);
      env_check_guards(&e, label);
      e.nseq = 2;
      e.seq[1].id = 5;
      e.seq[1].k = (double *)xcalloc((size_t)(cap * configs[ci].hkv * configs[ci].dqk), 8);
      e.seq[1].v = (double *)xcalloc((size_t)(cap * configs[ci].hkv * configs[ci].dv), 8);
      CHECK(attn_kv_cache_fork(e.cache, e.seq[0].id, 5, 2 * ps + 1));
      copy_mirror(&e, 1, 0, 2 * ps + 1);
      cnt[0] = 0, cnt[1] = 1; /* 1 copies the shared partial page */
      env_append(&e, &rng, 2, idx, cnt);
      assert_int_equal(pages_in_use(&e), 4);
      env_check_guards(&e, label);
      /* Fill both partial pages, then every free page. */
      cnt[0] = (int32_t)(ps - 1), cnt[1] = (int32_t)(ps - 2);
      env_append(&e, &rng, 2, idx, cnt);
      cnt[0] = (int32_t)((pages - 4 + 1) / 2 * ps), cnt[1] = (int32_t)((pages - 4) / 2 * ps);
      env_append(&e, &rng, 2, idx, cnt);
      assert_int_equal(pages_in_use(&e), pages);
      env_check_guards(&e, label);
      cnt[0] = 1, cnt[1] = 0;
      assert_int_equal(env_try_append(&e, &rng, 2, idx, cnt), ATTN_STATUS_CAPACITY);
      env_check_guards(&e, label);
      for (b = 0; b < e.memory_bytes; ++b) changed += e.memory[b] != 0xA5;
      assert_true(changed > 0); /* the pages are in the caller's memory */

      memset(&st, 0, sizeof st);
      st.n = 2;
      st.idx[0] = 1, st.idx[1] = 0;
      st.q_len[0] = 3, st.q_len[1] = 2;
      st.heads_q = 2 * configs[ci].hkv;
      st.max_q = 3;
      st.chunk_tokens = -1;
      run_step(&e, &rng, &st, label, &r);
      st.chunk_tokens = ps;
      run_step(&e, &rng, &st, label, &r);
      env_check_guards(&e, label);

      /* Released pages are refilled by the other sequence. */
      CHECK(attn_kv_cache_release(e.cache, e.seq[0].id));
      cnt[0] = (int32_t)((pages - pages_in_use(&e)) * ps);
      idx[0] = 1;
      env_append(&e, &rng, 1, idx, cnt);
      assert_int_equal(pages_in_use(&e), pages);
      env_check_guards(&e, label);
      st.n = 1;
      st.idx[0] = 1;
      run_step(&e, &rng, &st, label, &r);
      env_check_guards(&e, label);
      env_destroy(&e);
    }
}

/* The split of single steps, its four reported numbers worked out by hand
 * from attn.h (chunk lengths in pages; P: pages a sequence reads). */
static void test_split_policy(void **state) {
  static const struct {
    const char *name;
    int threads;
    int64_t ps, hkv, window, sinks, chunk_tokens;
    int n;
    int64_t len[4];
    int32_t q[4];
    int64_t units, split, max_chunks, kv_chunk_tokens; /* expected */
  } cases[] = {
      /* Automatic, 4 threads, 1 task: at most 8 chunks of at least 16
       * pages. P = 7: one chunk. */
      {"auto-short", 4, 16, 1, 0, 0, 0, 1, {100}, {1}, 1, 0, 1, 0},
      /* P = 19: 16 and 3 pages. */
      {"auto-floor", 4, 16, 1, 0, 0, 0, 1, {300}, {2}, 2, 1, 2, 256},
      /* P = 188: 8 chunks of ceil(188 / 8) = 24 pages. */
      {"auto-8-chunks", 4, 16, 1, 0, 0, 0, 1, {3000}, {1}, 8, 1, 8, 384},
      /* 2 tasks: at most 4 chunks of at least ceil(256 / 7) = 37 pages;
       * P = 286: chunks of 72 pages, 4 for the first sequence, 1 for the
       * second (6 pages). */
      {"auto-ps7-2-seqs", 4, 7, 1, 0, 0, 0, 2, {2000, 40}, {1, 3}, 5, 1, 4, 504},
      /* 3 tasks: at most 3 chunks; P = 57, 38, 1: chunks of 19 pages. */
      {"auto-3-seqs", 4, 16, 1, 0, 0, 0, 3, {900, 600, 10}, {1, 2, 1}, 6, 2, 3, 304},
      /* 4 tasks for 4 threads: no split, however long. */
      {"auto-4-seqs", 4, 16, 1, 0, 0, 0, 4, {1000, 1000, 500, 20}, {1, 1, 2, 1}, 4, 0, 1, 0},
      {"auto-2-seqs-2-heads", 4, 16, 2, 0, 0, 0, 2, {1000, 1000}, {1, 1}, 2, 0, 1, 0},
      /* 2 tasks (2 KV heads): at most 4 chunks; P = 94: 24 pages. */
      {"auto-1-seq-2-heads", 4, 16, 2, 0, 0, 0, 1, {1500}, {3}, 4, 1, 4, 384},
      /* 3 threads: at most 6 chunks, of at least 32 pages of 8; P = 150. */
      {"auto-3-threads", 3, 8, 1, 0, 0, 0, 1, {1200}, {1}, 5, 1, 5, 256},
      /* Window 600, 20 sinks: keys 0..19 and 1399..1999, pages 0, 1 and
       * 87..124, P = 40: 3 chunks of the 16-page floor. */
      {"auto-window", 4, 16, 1, 600, 20, 0, 1, {2000}, {2}, 3, 1, 3, 256},
      /* 1 thread: never automatically. */
      {"auto-1-thread", 1, 16, 1, 0, 0, 0, 1, {3000}, {1}, 1, 0, 1, 0},
      /* Never, with threads to spare. */
      {"never", 4, 16, 1, 0, 0, -1, 1, {3000}, {1}, 1, 0, 1, 0},
      /* Forced 43 tokens: 3 pages of 16; P = 13 and 3. */
      {"forced-rounded-up", 1, 16, 1, 0, 0, 43, 2, {200, 40}, {1, 2}, 6, 1, 5, 48},
      /* Forced, longer than every sequence: no split. */
      {"forced-longer", 1, 16, 1, 0, 0, 1000, 2, {200, 40}, {1, 2}, 2, 0, 1, 0},
      /* Forced, not the automatic split, with threads to spare: 2 pages. */
      {"forced-threads", 4, 16, 1, 0, 0, 32, 1, {300}, {1}, 10, 1, 10, 32},
      /* Forced 14 tokens (2 pages of 7), window 30 and 3 sinks: keys 0..2
       * and 468..499, pages 0 and 66..71, P = 7: 4 chunks. */
      {"forced-window", 2, 7, 1, 30, 3, 14, 1, {500}, {3}, 4, 1, 4, 14},
  };
  size_t c;
  (void)state;
  for (c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
    tu_rng rng = tu_rng_for(cases[c].name);
    attn_kv_cache_config_t cfg;
    kv_env e;
    step st;
    step_result r;
    int64_t pages = 2, longest = 0;
    int i;
    for (i = 0; i < cases[c].n; ++i) {
      pages += ceil_div(cases[c].len[i], cases[c].ps);
      longest = cases[c].len[i] > longest ? cases[c].len[i] : longest;
    }
    cfg = tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, cases[c].ps, pages,
                             cases[c].hkv, 8, 8, cases[c].window, cases[c].sinks);
    env_create(&e, &cfg, cases[c].threads, 0, cases[c].n, longest);
    /* Prefill in chunks (a window evicts between them), then each
     * sequence's query tokens. */
    for (;;) {
      int idx[4], n = 0;
      int32_t cnt[4];
      for (i = 0; i < cases[c].n; ++i) {
        const int64_t left = cases[c].len[i] - cases[c].q[i] - e.seq[i].len;
        if (left <= 0) continue;
        idx[n] = i;
        cnt[n++] = (int32_t)(left < 128 ? left : 128);
      }
      if (n == 0) break;
      env_append(&e, &rng, n, idx, cnt);
    }
    {
      int idx[4];
      for (i = 0; i < cases[c].n; ++i) idx[i] = i;
      env_append(&e, &rng, cases[c].n, idx, cases[c].q);
    }
    memset(&st, 0, sizeof st);
    st.n = cases[c].n;
    for (i = 0; i < st.n; ++i) st.idx[i] = i, st.q_len[i] = cases[c].q[i];
    st.heads_q = 2 * cases[c].hkv;
    st.max_q = 3;
    st.chunk_tokens = cases[c].chunk_tokens;
    run_step(&e, &rng, &st, cases[c].name, &r);
    if (r.info.num_work_units != cases[c].units || r.info.split_sequences != cases[c].split ||
        r.info.max_chunks != cases[c].max_chunks ||
        r.info.kv_chunk_tokens != cases[c].kv_chunk_tokens) {
      print_error("%s: split (%lld, %lld, %lld, %lld), expected (%lld, %lld, %lld, %lld)\n",
                  cases[c].name, (long long)r.info.num_work_units,
                  (long long)r.info.split_sequences, (long long)r.info.max_chunks,
                  (long long)r.info.kv_chunk_tokens, (long long)cases[c].units,
                  (long long)cases[c].split, (long long)cases[c].max_chunks,
                  (long long)cases[c].kv_chunk_tokens);
      fail();
    }
    env_destroy(&e);
  }
}

/* Random operations (add, batched appends that may run out of pages, forks
 * at random prefixes, releases) on a small pool, with decode steps over all
 * live sequences against the reference in between: shared pages must never
 * leak another sequence's tokens, a failed append must change nothing, and
 * releasing everything must return every page. */
static void random_operations(const char *label, int64_t window, int64_t sinks,
                              attn_kv_layout_t layout) {
  tu_rng rng = tu_rng_for(label);
  attn_kv_cache_config_t cfg;
  kv_env e;
  step st;
  step_result r;
  int live[64], nlive = 0, op, i;
  int32_t last_append[64];
  int64_t next_id = 1;
  const int64_t ps = 4;
  int failures = 0, forks = 0, steps = 0;

  cfg = tu_kv_cache_config(ATTN_DTYPE_FP32, layout, ps, 24, 2, 8, 8, window, sinks);
  env_create(&e, &cfg, 1, 0, 0, 200);
  e.nseq = 64; /* mirror slots, allocated below as sequences appear */
  for (i = 0; i < 64; ++i) {
    e.seq[i].k = (double *)xcalloc(200 * 2 * 8, 8);
    e.seq[i].v = (double *)xcalloc(200 * 2 * 8, 8);
    e.seq[i].id = -1;
  }
  memset(&st, 0, sizeof st);
  st.heads_q = 4;
  st.max_q = 4;

  for (op = 0; op < 300; ++op) {
    const int64_t kind = tu_rng_int(&rng, 0, 9);
    if ((kind == 0 || nlive == 0) && nlive < 10) { /* add */
      int slot = 0;
      while (e.seq[slot].id >= 0) ++slot;
      e.seq[slot].id = next_id++;
      e.seq[slot].len = 0;
      last_append[slot] = 0;
      CHECK(attn_kv_cache_add_sequence(e.cache, e.seq[slot].id));
      live[nlive++] = slot;
    } else if (kind <= 5) { /* append to a random subset; may run out of pages */
      int idx[64], n = 0;
      int32_t cnt[64];
      const int64_t pages = pages_in_use(&e);
      attn_status_t status;
      for (i = 0; i < nlive; ++i) {
        if (tu_rng_int(&rng, 0, 1) == 0 || e.seq[live[i]].len > 180) continue;
        idx[n] = live[i];
        cnt[n] = (int32_t)tu_rng_int(&rng, 1, 2 * ps);
        ++n;
      }
      if (n == 0) continue;
      status = env_try_append(&e, &rng, n, idx, cnt); /* checks the lengths */
      if (status == ATTN_STATUS_CAPACITY) {
        ++failures;
        assert_int_equal(pages_in_use(&e), pages);
        continue;
      }
      if (status == ATTN_STATUS_INVALID_ARGUMENT && window == 0) {
        /* Without a window a sequence can outgrow the whole pool (96 tokens
         * here), which attn.h refuses as an argument error, not CAPACITY. */
        int too_long = 0;
        for (i = 0; i < n; ++i)
          too_long |= (e.seq[idx[i]].len + cnt[i] + ps - 1) / ps > cfg.num_pages;
        assert_true(too_long);
        assert_int_equal(pages_in_use(&e), pages);
        ++failures;
        continue;
      }
      CHECK(status);
      for (i = 0; i < n; ++i) last_append[idx[i]] = cnt[i];
    } else if (kind == 6 && nlive < 10) { /* fork */
      const int parent = live[tu_rng_int(&rng, 0, nlive - 1)];
      int slot = 0;
      int64_t prefix = e.seq[parent].len;
      if (window == 0) prefix = tu_rng_int(&rng, 0, e.seq[parent].len);
      while (e.seq[slot].id >= 0) ++slot;
      e.seq[slot].id = next_id++;
      CHECK(attn_kv_cache_fork(e.cache, e.seq[parent].id, e.seq[slot].id, prefix));
      copy_mirror(&e, slot, parent, prefix);
      /* a whole fork keeps what the parent holds: its last tokens decode
       * as the parent's do */
      last_append[slot] = prefix == e.seq[parent].len ? last_append[parent] : 0;
      live[nlive++] = slot;
      ++forks;
    } else if (kind == 7 && nlive > 0) { /* release */
      const int64_t at = tu_rng_int(&rng, 0, nlive - 1);
      CHECK(attn_kv_cache_release(e.cache, e.seq[live[at]].id));
      e.seq[live[at]].id = -1;
      live[at] = live[--nlive];
    } else { /* a decode step over every sequence that can be queried */
      st.n = 0;
      for (i = 0; i < nlive; ++i) {
        const int s_ = live[i];
        int32_t q = (int32_t)(window > 0 ? last_append[s_] : e.seq[s_].len);
        if (q > 4) q = 4;
        if (q < 1) continue;
        st.idx[st.n] = s_;
        st.q_len[st.n] = (int32_t)tu_rng_int(&rng, 1, q);
        ++st.n;
      }
      if (st.n == 0) continue;
      st.chunk_tokens = tu_rng_int(&rng, 0, 1) ? -1 : ps;
      run_step(&e, &rng, &st, label, &r);
      ++steps;
    }
  }
  for (i = 0; i < nlive; ++i) CHECK(attn_kv_cache_release(e.cache, e.seq[live[i]].id));
  assert_int_equal(pages_in_use(&e), 0);
  assert_true(forks > 0);
  assert_true(failures > 0); /* the pool was small enough to run out */
  assert_true(steps >= 10);
  env_destroy(&e);
}

static void test_random_operations(void **state) {
  (void)state;
  random_operations("random-ops", 0, 0, ATTN_KV_LAYOUT_NHD);
  random_operations("random-ops-window", 10, 3, ATTN_KV_LAYOUT_HND);
}

/* Several threads execute one plan on one cache at once, each with its own
 * workspace and outputs: every result equals the serial one bit for bit. */
typedef struct exec_job {
  attn_decode_plan_t plan;
  attn_kv_cache_t cache;
  const float *q;
  float *o, *lse;
  void *ws;
  size_t bytes;
  attn_status_t status;
} exec_job;

static void *exec_thread(void *arg) {
  exec_job *j = (exec_job *)arg;
  int rep;
  j->status = ATTN_STATUS_SUCCESS;
  for (rep = 0; rep < 20 && j->status == ATTN_STATUS_SUCCESS; ++rep)
    j->status = attn_decode_execute(j->plan, j->cache, j->q, j->o, j->lse, j->ws, j->bytes, NULL);
  return NULL;
}

static void test_concurrent_execute(void **state) {
  enum { kThreads = 4 };
  tu_rng rng = tu_rng_for("concurrent-execute");
  attn_kv_cache_config_t cfg;
  kv_env e;
  attn_decode_config_t dc;
  attn_decode_plan_t plan;
  size_t bytes;
  exec_job jobs[kThreads];
  pthread_t threads[kThreads];
  int idx[3] = {0, 1, 2};
  int32_t cnt[3] = {300, 40, 2}, ql[3] = {2, 2, 2};
  int64_t ids[3];
  const size_t no = 6 * 8 * 32, nl = 8 * 6;
  float *q, *o_serial, *lse_serial;
  int i;
  (void)state;
  cfg = tu_kv_cache_config(ATTN_DTYPE_FP32, ATTN_KV_LAYOUT_NHD, 16, 40, 2, 32, 32, 0, 0);
  env_create(&e, &cfg, 2, 0, 3, 400);
  env_append(&e, &rng, 3, idx, cnt);
  for (i = 0; i < 3; ++i) ids[i] = e.seq[i].id;
  dc = tu_decode_config(8, 3, 2, 64);
  CHECK(attn_decode_plan_create(e.ctx, e.cache, &dc, &plan));
  CHECK(attn_decode_plan_workspace_size(plan, &bytes));
  q = (float *)xcalloc(no, 4); /* [6, 8, 32]: d_qk = d_v */
  for (i = 0; i < (int)(6 * 8 * 32); ++i) q[i] = (float)tu_rng_normal(&rng, 0.0, 1.0);
  o_serial = (float *)xcalloc(no, 4);
  lse_serial = (float *)xcalloc(nl, 4);
  for (i = 0; i < kThreads; ++i) {
    jobs[i].plan = plan, jobs[i].cache = e.cache, jobs[i].q = q;
    jobs[i].o = (float *)xcalloc(no, 4);
    jobs[i].lse = (float *)xcalloc(nl, 4);
    jobs[i].ws = xcalloc(bytes, 1);
    jobs[i].bytes = bytes;
    CHECK(attn_decode_prepare(plan, e.cache, 3, ids, ql, jobs[i].ws, bytes, NULL, NULL));
  }
  CHECK(attn_decode_execute(plan, e.cache, q, o_serial, lse_serial, jobs[0].ws, bytes, NULL));
  for (i = 0; i < kThreads; ++i) assert_int_equal(pthread_create(&threads[i], NULL, exec_thread, &jobs[i]), 0);
  for (i = 0; i < kThreads; ++i) assert_int_equal(pthread_join(threads[i], NULL), 0);
  for (i = 0; i < kThreads; ++i) {
    assert_int_equal(jobs[i].status, ATTN_STATUS_SUCCESS);
    assert_memory_equal(jobs[i].o, o_serial, no * 4);
    assert_memory_equal(jobs[i].lse, lse_serial, nl * 4);
    free(jobs[i].o), free(jobs[i].lse), free(jobs[i].ws);
  }
  free(q), free(o_serial), free(lse_serial);
  CHECK(attn_decode_plan_destroy(plan));
  env_destroy(&e);
}

/* ------------------------------------------------------------------------ */
/* A rolling window against the dense window plan                            */
/* ------------------------------------------------------------------------ */

/* A rolling-window cache of 3 sequences (window 20, pages of 4, 2 KV
 * heads, d 16) grows by q tokens per sequence and step, 90 steps; every
 * 15th step decodes the q newest tokens of each and compares them with the
 * last q rows of the dense window plan (window (19, 0)) over every token
 * ever appended, while pages in use stay bounded. */
typedef struct rolling_case {
  const char *name;
  attn_dtype_t dtype;
  attn_kv_layout_t layout;
  int32_t q;
} rolling_case;

static const rolling_case kRolling[] = {
    {"rolling-window-fp32-nhd-q1", F32, NHD, 1},
    {"rolling-window-fp32-hnd-q4", F32, HND, 4},
    {"rolling-window-bf16-hnd-q3", B16, HND, 3},
    {"rolling-window-bf16-nhd-q1", B16, NHD, 1},
    {"rolling-window-fp16-nhd-q2", F16, NHD, 2},
    {"rolling-window-fp16-hnd-q3", F16, HND, 3},
};

static void test_rolling_window_matches_window_plan(void **state) {
  const rolling_case *rc = (const rolling_case *)*state;
  const attn_dtype_t dt = rc->dtype;
  const int32_t q_len = rc->q;
  tu_rng rng = tu_rng_for(rc->name);
  const int64_t w = 20, ps = 4, hq = 4, hkv = 2, d = 16, steps = 90;
  const int nseq = 3;
  /* Both compute in fp32 and round O to the dtype: at most an ulp apart. */
  const double rel = dt == ATTN_DTYPE_FP32 ? 0.0 : 2.0 * tu_unit_roundoff(dt);
  attn_kv_cache_config_t cfg;
  kv_env e;
  attn_decode_config_t dc;
  attn_decode_plan_t dplan;
  size_t dws_bytes;
  void *dws;
  int64_t s, peak = 0;
  int i;

  cfg = tu_kv_cache_config(dt, rc->layout, ps,
                           nseq * ((w + q_len) / ps + 3) /* pages: far less than the tokens */,
                           hkv, d, d, w, 0);
  env_create(&e, &cfg, 1, 0, nseq, 5 + steps * q_len);

  dc = tu_decode_config(hq, nseq, q_len, 2 * ps);
  CHECK(attn_decode_plan_create(e.ctx, e.cache, &dc, &dplan));
  CHECK(attn_decode_plan_workspace_size(dplan, &dws_bytes));
  dws = malloc(dws_bytes);
  assert_non_null(dws);
  {
    /* Staggered starts: prompts of 1, 3 and 5 tokens. */
    int idx[3] = {0, 1, 2};
    int32_t cnt[3] = {1, 3, 5};
    env_append(&e, &rng, nseq, idx, cnt);
  }
  for (s = 0; s < steps; ++s) {
    int idx[3] = {0, 1, 2};
    int32_t cnt[3], ql[3];
    int64_t ids[3];
    int32_t cu[4];
    tu_buffer q, k, v, q_dec, o_dense, o_dec;
    float *lse_dec, *lse_dense;
    attn_plan_desc_t desc;
    attn_plan_t plan;
    size_t ws_bytes;
    void *ws;
    int64_t total = 0, off = 0, x, t, h, longest = 0;
    double max_diff = 0.0, max_o = 0.0;

    for (i = 0; i < nseq; ++i) cnt[i] = ql[i] = q_len;
    env_append(&e, &rng, nseq, idx, cnt);
    peak = pages_in_use(&e) > peak ? pages_in_use(&e) : peak;
    if (s % 15 != 14) continue;

    /* Dense window plan over every token ever appended, each a query. */
    cu[0] = 0;
    for (i = 0; i < nseq; ++i) {
      ids[i] = e.seq[i].id;
      cu[i + 1] = cu[i] + (int32_t)e.seq[i].len;
      total += e.seq[i].len;
      longest = e.seq[i].len > longest ? e.seq[i].len : longest;
    }
    tu_buffer_alloc(&q, dt, (size_t)(total * hq * d));
    tu_fill_normal(&rng, &q, 1.0);
    tu_buffer_alloc(&k, dt, (size_t)(total * hkv * d));
    tu_buffer_alloc(&v, dt, (size_t)(total * hkv * d));
    for (i = 0; i < nseq; ++i) {
      for (x = 0; x < e.seq[i].len * hkv * d; ++x) {
        tu_buffer_set(&k, (size_t)(off + x), e.seq[i].k[x]);
        tu_buffer_set(&v, (size_t)(off + x), e.seq[i].v[x]);
      }
      off += e.seq[i].len * hkv * d;
    }
    /* The decode's queries: the last q_len rows of each sequence's. */
    tu_buffer_alloc(&q_dec, dt, (size_t)(nseq * q_len * hq * d));
    for (i = 0; i < nseq; ++i)
      for (t = 0; t < q_len; ++t)
        for (x = 0; x < hq * d; ++x)
          tu_buffer_set(&q_dec, (size_t)((i * q_len + t) * hq * d + x),
                        q.mirror[(cu[i + 1] - q_len + t) * hq * d + x]);
    CHECK(attn_plan_desc_create(&desc));
    CHECK(attn_plan_desc_set_shape(desc, nseq, hq, hkv, longest, longest, d, d));
    CHECK(attn_plan_desc_set_dtype(desc, dt));
    CHECK(attn_plan_desc_set_varlen(desc, nseq, cu, cu));
    CHECK(attn_plan_desc_set_mask(desc, ATTN_MASK_WINDOW, w - 1, 0));
    CHECK(attn_plan_create(e.ctx, desc, &plan));
    CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_bytes));
    ws = malloc(ws_bytes ? ws_bytes : 1);
    tu_buffer_alloc(&o_dense, dt, (size_t)(total * hq * d));
    tu_buffer_alloc(&o_dec, dt, (size_t)(nseq * q_len * hq * d));
    lse_dense = (float *)xcalloc((size_t)(total * hq), 4);
    lse_dec = (float *)xcalloc((size_t)(nseq * q_len * hq), 4);
    tu_poison(o_dec.data, dt, (size_t)(nseq * q_len * hq * d));
    tu_poison(lse_dec, ATTN_DTYPE_FP32, (size_t)(nseq * q_len * hq));
    CHECK(attn_forward(plan, q.data, k.data, v.data, o_dense.data, lse_dense, ws, ws_bytes, NULL));
    CHECK(attn_decode_prepare(dplan, e.cache, nseq, ids, ql, dws, dws_bytes, NULL, NULL));
    CHECK(attn_decode_execute(dplan, e.cache, q_dec.data, o_dec.data, lse_dec, dws, dws_bytes,
                              NULL));
    for (x = 0; x < total * hq * d; ++x) {
      const double a = fabs(tu_load(o_dense.data, (size_t)x, dt));
      max_o = a > max_o ? a : max_o;
    }
    for (i = 0; i < nseq; ++i)
      for (t = 0; t < q_len; ++t) {
        const int64_t dec_row = i * q_len + t, dense_row = cu[i + 1] - q_len + t;
        for (x = 0; x < hq * d; ++x) {
          const double a = tu_load(o_dec.data, (size_t)(dec_row * hq * d + x), dt);
          const double b = tu_load(o_dense.data, (size_t)(dense_row * hq * d + x), dt);
          const double diff = fabs(a - b) - rel * (fabs(a) > fabs(b) ? fabs(a) : fabs(b));
          max_diff = diff > max_diff || isnan(diff) ? diff : max_diff;
        }
        for (h = 0; h < hq; ++h) {
          const double diff = fabs((double)lse_dec[h * nseq * q_len + dec_row] -
                                   (double)lse_dense[h * total + dense_row]);
          max_diff = diff > max_diff || isnan(diff) ? diff : max_diff;
        }
      }
    if (!(max_diff <= 1e-5 * (max_o > 1.0 ? max_o : 1.0))) {
      print_error("%s, step %lld: decode vs window plan differ by %g beyond %g relative\n",
                  rc->name, (long long)s, max_diff, rel);
      fail();
    }
    assert_true(max_o > 0.0);
    free(ws), free(lse_dense), free(lse_dec);
    CHECK(attn_plan_destroy(plan));
    CHECK(attn_plan_desc_destroy(desc));
    tu_buffer_free(&q), tu_buffer_free(&k), tu_buffer_free(&v);
    tu_buffer_free(&q_dec), tu_buffer_free(&o_dense), tu_buffer_free(&o_dec);
  }
  /* Bounded, as attn.h says: (window + tokens appended at once) /
   * page_size + 2 pages per sequence, though 5 + 90 q tokens were appended
   * to each. */
  if (peak > nseq * ((w + q_len) / ps + 2)) {
    print_error("%s: peak pages in use %lld exceeds %lld\n", rc->name, (long long)peak,
                (long long)(nseq * ((w + q_len) / ps + 2)));
    fail();
  }
  free(dws);
  CHECK(attn_decode_plan_destroy(dplan));
  env_destroy(&e);
}

int main(void) {
  struct CMUnitTest
      tests[sizeof kCases / sizeof kCases[0] + sizeof kRolling / sizeof kRolling[0] + 6];
  size_t n = 0, i;
  tu_seed();
  for (i = 0; i < sizeof kCases / sizeof kCases[0]; ++i) {
    struct CMUnitTest t = {kCases[i].name, test_case, NULL, NULL, (void *)&kCases[i]};
    tests[n++] = t;
  }
  {
    struct CMUnitTest t1 = cmocka_unit_test(test_fork);
    struct CMUnitTest t3 = cmocka_unit_test(test_fork_windowed);
    struct CMUnitTest t4 = cmocka_unit_test(test_concurrent_execute);
    tests[n++] = t1;
    for (i = 0; i < sizeof kRolling / sizeof kRolling[0]; ++i) {
      struct CMUnitTest t = {kRolling[i].name, test_rolling_window_matches_window_plan, NULL, NULL,
                             (void *)&kRolling[i]};
      tests[n++] = t;
    }
    tests[n++] = t3;
    struct CMUnitTest t5 = cmocka_unit_test(test_random_operations);
    struct CMUnitTest t6 = cmocka_unit_test(test_caller_memory_stays_inside);
    struct CMUnitTest t7 = cmocka_unit_test(test_split_policy);
    tests[n++] = t4;
    tests[n++] = t5;
    tests[n++] = t6;
    tests[n++] = t7;
  }
  return _cmocka_run_group_tests("kv_decode", tests, n, NULL, NULL);
}
