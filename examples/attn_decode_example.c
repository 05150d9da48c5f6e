/*
 * A decode loop over the paged KV cache, as an inference server runs it.
 *
 * There is no model here: each new token's key and value are made up from
 * the previous step's attention output, which is enough to show the calls
 * and their order:
 *
 *   1. a cache (pages of 16 tokens, GQA with 8 query heads on 2 KV heads,
 *      bf16) and a decode plan for up to 4 sequences;
 *   2. prefill: append each prompt's K/V and attend from all its tokens
 *      (a chunked-prefill step, query_lens = prompt length);
 *   3. decode steps: append one token per sequence, prepare, execute;
 *   4. beam search: fork a sequence; the shared prefix costs no pages;
 *   5. release sequences; pages return to the pool.
 *
 * At the end the last step's output is checked against a direct
 * computation over the same tokens.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <attn/attn.h>

#define HQ 8
#define HKV 2
#define D 64
#define PAGE 16
#define MAX_SEQS 4
#define MAX_TOKENS 256

#define CHECK(call)                                                                  \
  do {                                                                               \
    attn_status_t st_ = (call);                                                      \
    if (st_ != ATTN_STATUS_SUCCESS) {                                                \
      fprintf(stderr, "%s failed: %s: %s\n", #call, attn_status_string(st_),         \
              attn_last_error_message());                                            \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

/* fp32 -> bf16, rounding to nearest even (the inputs here are finite). */
static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint32_t g_rng = 12345u;
static float rnd(void) {
  g_rng = g_rng * 1664525u + 1013904223u;
  return (float)(g_rng >> 8) / 8388608.0f - 1.0f;
}

/* What the application keeps per sequence: here, a copy of its K and V
 * (only to check the result at the end) and its last output. */
typedef struct app_seq {
  int64_t id;
  int64_t len;
  float k[MAX_TOKENS][HKV][D], v[MAX_TOKENS][HKV][D];
  float last_o[HQ][D];
} app_seq;

static app_seq g_seq[MAX_SEQS];

/* K/V of `n` new tokens of sequence s into bf16 buffers (and the copy). */
static void make_tokens(app_seq *s, int n, uint16_t *k, uint16_t *v, int from_output) {
  int t, h, c;
  for (t = 0; t < n; ++t)
    for (h = 0; h < HKV; ++h)
      for (c = 0; c < D; ++c) {
        const float kf = from_output ? s->last_o[h * (HQ / HKV)][c] + 0.1f * rnd() : rnd();
        const float vf = from_output ? s->last_o[h * (HQ / HKV) + 1][c] + 0.1f * rnd() : rnd();
        k[(t * HKV + h) * D + c] = to_bf16(kf);
        v[(t * HKV + h) * D + c] = to_bf16(vf);
        s->k[s->len + t][h][c] = from_bf16(k[(t * HKV + h) * D + c]);
        s->v[s->len + t][h][c] = from_bf16(v[(t * HKV + h) * D + c]);
      }
}

static int64_t pages_in_use(attn_kv_cache_t cache) {
  attn_kv_cache_info_t info;
  info.struct_size = sizeof info;
  CHECK(attn_kv_cache_get_info(cache, &info));
  return info.pages_in_use;
}

int main(void) {
  attn_context_t ctx;
  attn_kv_cache_config_t cfg;
  attn_kv_cache_t cache;
  attn_decode_config_t dc;
  attn_decode_plan_t plan;
  attn_decode_plan_info_t pinfo;
  attn_decode_step_info_t sinfo;
  size_t ws_bytes;
  void *ws;
  static uint16_t k[MAX_SEQS * MAX_TOKENS * HKV * D], v[MAX_SEQS * MAX_TOKENS * HKV * D];
  static uint16_t q[MAX_SEQS * MAX_TOKENS * HQ * D], o[MAX_SEQS * MAX_TOKENS * HQ * D];
  static float qf[MAX_SEQS][HQ][D];
  const int prompt[3] = {37, 100, 5};
  int64_t ids[MAX_SEQS];
  int32_t counts[MAX_SEQS];
  int nseq = 3, i, step, h, c;
  int64_t off;
  double max_err = 0.0;

  CHECK(attn_context_create(ATTN_BACKEND_CPU, 0, 0, &ctx));

  /* 1. The cache and the plan. */
  memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  cfg.dtype = ATTN_DTYPE_BF16;
  cfg.layout = ATTN_KV_LAYOUT_NHD;
  cfg.page_size = PAGE;
  cfg.num_pages = 64;
  cfg.heads_kv = HKV;
  cfg.head_dim_qk = D;
  cfg.head_dim_v = D;
  CHECK(attn_kv_cache_create(ctx, &cfg, NULL, 0, &cache));

  memset(&dc, 0, sizeof dc);
  dc.struct_size = sizeof dc;
  dc.heads_q = HQ;
  dc.max_batch = MAX_SEQS;
  dc.max_query_tokens = 128; /* the longest prefill chunk */
  CHECK(attn_decode_plan_create(ctx, cache, &dc, &plan));
  CHECK(attn_decode_plan_workspace_size(plan, &ws_bytes));
  ws = malloc(ws_bytes);
  if (!ws) return 1;
  pinfo.struct_size = sizeof pinfo;
  CHECK(attn_decode_plan_describe(plan, &pinfo));
  printf("decode plan: %s on %s, %d threads, workspace %llu bytes\n", pinfo.algorithm,
         pinfo.kernel, pinfo.num_threads, (unsigned long long)pinfo.workspace_bytes);

  /* 2. Prefill: all prompts in one append and one step. */
  off = 0;
  for (i = 0; i < nseq; ++i) {
    g_seq[i].id = 100 + i;
    CHECK(attn_kv_cache_add_sequence(cache, g_seq[i].id));
    make_tokens(&g_seq[i], prompt[i], k + off * HKV * D, v + off * HKV * D, 0);
    ids[i] = g_seq[i].id;
    counts[i] = prompt[i];
    off += prompt[i];
  }
  CHECK(attn_kv_cache_append(cache, nseq, ids, counts, k, v, NULL));
  for (i = 0; i < nseq; ++i) g_seq[i].len += prompt[i];
  for (i = 0; i < (int)(off * HQ * D); ++i) q[i] = to_bf16(rnd());
  CHECK(attn_decode_prepare(plan, cache, nseq, ids, counts, ws, ws_bytes, NULL, NULL));
  CHECK(attn_decode_execute(plan, cache, q, o, NULL, ws, ws_bytes, NULL));
  /* Each sequence's last prompt token's output seeds its first decode step. */
  off = 0;
  for (i = 0; i < nseq; ++i) {
    off += prompt[i];
    for (h = 0; h < HQ; ++h)
      for (c = 0; c < D; ++c) g_seq[i].last_o[h][c] = from_bf16(o[((off - 1) * HQ + h) * D + c]);
  }
  printf("prefill: %d sequences, %lld pages in use\n", nseq, (long long)pages_in_use(cache));

  /* 3-4. Decode steps; at step 10 sequence 1 forks a second beam. */
  for (step = 0; step < 40; ++step) {
    if (step == 10) {
      const int64_t before = pages_in_use(cache);
      g_seq[3] = g_seq[1];
      g_seq[3].id = 200;
      CHECK(attn_kv_cache_fork(cache, g_seq[1].id, g_seq[3].id, g_seq[1].len));
      nseq = 4;
      printf("step %d: forked sequence %lld into %lld, pages in use %lld -> %lld\n", step,
             (long long)g_seq[1].id, (long long)g_seq[3].id, (long long)before,
             (long long)pages_in_use(cache));
    }
    for (i = 0; i < nseq; ++i) {
      ids[i] = g_seq[i].id;
      counts[i] = 1;
      make_tokens(&g_seq[i], 1, k + i * HKV * D, v + i * HKV * D, 1);
    }
    CHECK(attn_kv_cache_append(cache, nseq, ids, counts, k, v, NULL));
    for (i = 0; i < nseq; ++i) {
      g_seq[i].len += 1;
      for (h = 0; h < HQ; ++h)
        for (c = 0; c < D; ++c) {
          q[(i * HQ + h) * D + c] = to_bf16(g_seq[i].last_o[h][c] + rnd());
          qf[i][h][c] = from_bf16(q[(i * HQ + h) * D + c]);
        }
    }
    sinfo.struct_size = sizeof sinfo;
    CHECK(attn_decode_prepare(plan, cache, nseq, ids, counts, ws, ws_bytes, &sinfo, NULL));
    CHECK(attn_decode_execute(plan, cache, q, o, NULL, ws, ws_bytes, NULL));
    for (i = 0; i < nseq; ++i)
      for (h = 0; h < HQ; ++h)
        for (c = 0; c < D; ++c) g_seq[i].last_o[h][c] = from_bf16(o[(i * HQ + h) * D + c]);
  }
  printf("after 40 steps: lengths %lld %lld %lld %lld, %lld pages in use, last step read %.0f KV "
         "bytes in %lld work units\n",
         (long long)g_seq[0].len, (long long)g_seq[1].len, (long long)g_seq[2].len,
         (long long)g_seq[3].len, (long long)pages_in_use(cache), sinfo.kv_bytes_read,
         (long long)sinfo.num_work_units);

  /* Check the last step directly: softmax(q k^T / sqrt(D)) v per head. */
  for (i = 0; i < nseq; ++i)
    for (h = 0; h < HQ; ++h) {
      const int g = h / (HQ / HKV);
      double mx = -INFINITY, sum = 0.0, acc[D] = {0};
      int64_t j;
      static double s[MAX_TOKENS];
      for (j = 0; j < g_seq[i].len; ++j) {
        double dot = 0.0;
        for (c = 0; c < D; ++c) dot += (double)qf[i][h][c] * g_seq[i].k[j][g][c];
        s[j] = dot / sqrt((double)D);
        if (s[j] > mx) mx = s[j];
      }
      for (j = 0; j < g_seq[i].len; ++j) {
        const double p = exp(s[j] - mx);
        sum += p;
        for (c = 0; c < D; ++c) acc[c] += p * g_seq[i].v[j][g][c];
      }
      for (c = 0; c < D; ++c) {
        const double err = fabs(acc[c] / sum - g_seq[i].last_o[h][c]);
        if (err > max_err) max_err = err;
      }
    }
  printf("last step vs direct computation: max |error| %.2e (bf16 output)\n", max_err);

  /* 5. Release: the beam and its parent share a prefix; both must go for
   * those pages to return. */
  for (i = 0; i < nseq; ++i) CHECK(attn_kv_cache_release(cache, g_seq[i].id));
  printf("released all: %lld pages in use\n", (long long)pages_in_use(cache));

  free(ws);
  CHECK(attn_decode_plan_destroy(plan));
  CHECK(attn_kv_cache_destroy(cache));
  CHECK(attn_context_destroy(ctx));
  return max_err < 2e-2 ? 0 : 1;
}
