/* Sparse attention on the CPU backend: a BigBird-style block mask (sliding
 * window, sink tokens and seeded random blocks) composed with a causal plan,
 * then a MoBA plan whose blocks each query selects at run time. Each part
 * prints what attn_plan_describe reports and checks one output row by hand
 * against the rule it was given. */
#include <attn/attn.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                              \
  do {                                                                           \
    attn_status_t st_ = (call);                                                  \
    if (st_ != ATTN_STATUS_SUCCESS) {                                            \
      fprintf(stderr, "%s failed: %s: %s\n", #call, attn_status_string(st_),     \
              attn_last_error_message());                                        \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

/* Problem: batch 1, 8 query heads on 2 KV heads, seqlen 1000, head dim 64,
 * fp32, BSHD ([batch][seqlen][heads][dim]). */
enum { kHeadsQ = 8, kHeadsKv = 2, kLen = 1000, kDim = 64 };

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (p == NULL) {
    fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

static float *random_tensor(int64_t heads, unsigned *state) {
  const size_t n = (size_t)kLen * (size_t)heads * kDim;
  float *x = xmalloc(n * sizeof *x);
  for (size_t i = 0; i < n; ++i) {
    *state = *state * 1664525u + 1013904223u;
    x[i] = (float)(*state >> 8) / 16777216.0f - 0.5f;
  }
  return x;
}

static const float *row_of(const float *x, int64_t heads, int64_t t, int64_t h) {
  return x + (t * heads + h) * kDim;
}

/* O and LSE of query i of query head h over the keys with visible[j] != 0,
 * in double; returns the largest error of the library's row. */
static double check_row(const float *q, const float *k, const float *v, const float *o,
                        const float *lse, int64_t h, int64_t i, const uint8_t *visible) {
  const int64_t hk = h / (kHeadsQ / kHeadsKv);
  const double scale = 1.0 / sqrt((double)kDim);
  double p[kLen], mx = -INFINITY, sum = 0.0, err = 0.0;
  for (int64_t j = 0; j < kLen; ++j) {
    p[j] = -INFINITY;
    if (!visible[j]) continue;
    double s = 0.0;
    for (int64_t c = 0; c < kDim; ++c)
      s += (double)row_of(q, kHeadsQ, i, h)[c] * (double)row_of(k, kHeadsKv, j, hk)[c];
    p[j] = s * scale;
    if (p[j] > mx) mx = p[j];
  }
  for (int64_t j = 0; j < kLen; ++j) sum += p[j] = visible[j] ? exp(p[j] - mx) : 0.0;
  for (int64_t c = 0; c < kDim; ++c) {
    double ref = 0.0;
    for (int64_t j = 0; j < kLen; ++j) ref += p[j] / sum * row_of(v, kHeadsKv, j, hk)[c];
    const double e = fabs(ref - row_of(o, kHeadsQ, i, h)[c]);
    if (e > err) err = e;
  }
  const double lse_err = fabs(mx + log(sum) - lse[h * kLen + i]);
  return err > lse_err ? err : lse_err;
}

static attn_plan_desc_t causal_desc(void) {
  attn_plan_desc_t desc;
  CHECK(attn_plan_desc_create(&desc));
  CHECK(attn_plan_desc_set_shape(desc, 1, kHeadsQ, kHeadsKv, kLen, kLen, kDim, kDim));
  CHECK(attn_plan_desc_set_dtype(desc, ATTN_DTYPE_FP32));
  CHECK(attn_plan_desc_set_layout(desc, ATTN_LAYOUT_BSHD));
  CHECK(attn_plan_desc_set_mask(desc, ATTN_MASK_CAUSAL, -1, -1));
  return desc;
}

static void print_info(const char *name, attn_plan_t plan) {
  attn_plan_info_t info;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  CHECK(attn_plan_describe(plan, &info));
  printf("%s: %s, kernel %s, %llu visible pairs, tiles %llu of %llu (%.1f%%), "
         "workspace %llu bytes\n",
         name, info.algorithm, info.kernel, (unsigned long long)info.visible_pairs,
         (unsigned long long)info.visited_tile_pairs, (unsigned long long)info.total_tile_pairs,
         100.0 * (double)info.visited_tile_pairs / (double)info.total_tile_pairs,
         (unsigned long long)info.workspace_bytes_forward);
}

/* Runs the plan's forward pass into o and lse (the caller's buffers). */
static void forward(attn_plan_t plan, const float *q, const float *k, const float *v, float *o,
                    float *lse) {
  size_t ws_bytes = 0;
  CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_bytes));
  void *ws = xmalloc(ws_bytes);
  CHECK(attn_forward(plan, q, k, v, o, lse, ws, ws_bytes, NULL));
  free(ws);
}

int main(void) {
  unsigned state = 2024u;
  float *q = random_tensor(kHeadsQ, &state), *k = random_tensor(kHeadsKv, &state),
        *v = random_tensor(kHeadsKv, &state);
  float *o = xmalloc((size_t)kLen * kHeadsQ * kDim * sizeof *o);
  float *lse = xmalloc((size_t)kHeadsQ * kLen * sizeof *lse);
  uint8_t visible[kLen];
  int failed = 0;

  attn_context_t ctx;
  CHECK(attn_context_create(ATTN_BACKEND_CPU, 0, 0, &ctx));

  /* 1. BigBird-style: a window of 192 keys, 16 sink tokens and 2 random
   * blocks of 64 keys per query block, one mask for every head (heads = 1),
   * under the plan's causal mask. */
  const int64_t block = 64;
  attn_block_mask_t mask;
  CHECK(attn_block_mask_create(1, 1, kLen, kLen, block, block, &mask));
  CHECK(attn_block_mask_add_window(mask, 192, 0));
  int64_t sinks[16];
  for (int i = 0; i < 16; ++i) sinks[i] = i;
  CHECK(attn_block_mask_add_global_keys(mask, sinks, 16));
  CHECK(attn_block_mask_add_random_blocks(mask, 2, 7));

  attn_plan_desc_t desc = causal_desc();
  CHECK(attn_plan_desc_set_block_mask(desc, mask));
  attn_plan_t plan;
  CHECK(attn_plan_create(ctx, desc, &plan));
  CHECK(attn_plan_desc_destroy(desc));
  print_info("block-sparse", plan);
  forward(plan, q, k, v, o, lse);

  /* The mask's selection of query i, read back: full blocks select all
   * their keys, partial ones those whose bit is set; the causal plan keeps
   * keys j <= i. */
  int32_t max_partial = 0, max_full = 0;
  CHECK(attn_block_mask_get_max_blocks(mask, &max_partial, &max_full));
  if (max_partial < 1) max_partial = 1;
  if (max_full < 1) max_full = 1;
  const int64_t nqb = (kLen + block - 1) / block;
  const size_t tile_bytes = ATTN_BLOCK_MASK_TILE_BYTES(block, block);
  int32_t *num = xmalloc((size_t)nqb * sizeof *num), *full_num = xmalloc((size_t)nqb * sizeof *full_num);
  int32_t *idx = xmalloc((size_t)(nqb * max_partial) * sizeof *idx);
  int32_t *full_idx = xmalloc((size_t)(nqb * max_full) * sizeof *full_idx);
  uint8_t *bits = xmalloc((size_t)(nqb * max_partial) * tile_bytes);
  CHECK(attn_block_mask_get_blocks(mask, num, idx, max_partial, bits, full_num, full_idx, max_full));
  const int64_t i = 777, h = 5, qb = i / block, r = i % block;
  memset(visible, 0, sizeof visible);
  for (int32_t n = 0; n < full_num[qb]; ++n)
    for (int64_t j = full_idx[qb * max_full + n] * block; j < (full_idx[qb * max_full + n] + 1) * block && j < kLen; ++j)
      visible[j] = 1;
  for (int32_t n = 0; n < num[qb]; ++n) {
    const uint8_t *tile = bits + (size_t)(qb * max_partial + n) * tile_bytes;
    for (int64_t c = 0; c < block; ++c) {
      const int64_t j = idx[qb * max_partial + n] * block + c, t = r * block + c;
      if (j < kLen && (tile[t / 8] >> (t % 8) & 1)) visible[j] = 1;
    }
  }
  int64_t seen = 0;
  for (int64_t j = 0; j < kLen; ++j) seen += visible[j] = visible[j] && j <= i;
  double err = check_row(q, k, v, o, lse, h, i, visible);
  printf("  row %lld of head %lld sees %lld keys: max error %.3g\n", (long long)i, (long long)h,
         (long long)seen, err);
  failed |= !(err < 1e-5);
  free(num); free(full_num); free(idx); free(full_idx); free(bits);
  CHECK(attn_plan_destroy(plan));
  CHECK(attn_block_mask_destroy(mask));

  /* 2. MoBA: blocks of 128 keys; each query sees its own block (causally)
   * and the 2 past blocks whose mean key scores highest against it, the
   * query heads of a GQA group choosing together. */
  const int64_t moba_block = 128, top_k = 2, group = kHeadsQ / kHeadsKv;
  desc = causal_desc();
  CHECK(attn_plan_desc_set_moba(desc, moba_block, top_k, 1));
  CHECK(attn_plan_create(ctx, desc, &plan));
  CHECK(attn_plan_desc_destroy(desc));
  print_info("moba", plan);
  forward(plan, q, k, v, o, lse);

  /* The gates of query i's past blocks by attn_plan_desc_set_moba's rule:
   * summed over its group's heads, q . mean(K of the block). */
  const int64_t own = i / moba_block, hk = h / group;
  double gate[kLen / 128 + 1];
  for (int64_t kb = 0; kb < own; ++kb) {
    gate[kb] = 0.0;
    for (int64_t c = 0; c < kDim; ++c) {
      double mean = 0.0;
      for (int64_t j = kb * moba_block; j < (kb + 1) * moba_block; ++j)
        mean += row_of(k, kHeadsKv, j, hk)[c];
      mean /= (double)moba_block;
      for (int64_t hh = hk * group; hh < (hk + 1) * group; ++hh)
        gate[kb] += (double)row_of(q, kHeadsQ, i, hh)[c] * mean;
    }
  }
  memset(visible, 0, sizeof visible);
  for (int64_t j = own * moba_block; j <= i; ++j) visible[j] = 1;
  printf("  row %lld of head %lld selects blocks", (long long)i, (long long)h);
  for (int64_t t = 0; t < top_k && t < own; ++t) {
    int64_t best = -1;
    for (int64_t kb = 0; kb < own; ++kb)
      if (!visible[kb * moba_block] && (best < 0 || gate[kb] > gate[best])) best = kb;
    for (int64_t j = best * moba_block; j < (best + 1) * moba_block; ++j) visible[j] = 1;
    printf(" %lld", (long long)best);
  }
  err = check_row(q, k, v, o, lse, h, i, visible);
  printf(" and its own (%lld): max error %.3g\n", (long long)own, err);
  printf("  (gates of blocks 0..%lld:", (long long)(own - 1));
  for (int64_t kb = 0; kb < own; ++kb) printf(" %.4f", gate[kb]);
  printf(")\n");
  failed |= !(err < 1e-5);
  CHECK(attn_plan_destroy(plan));

  CHECK(attn_context_destroy(ctx));
  free(q); free(k); free(v); free(o); free(lse);
  if (failed) {
    fprintf(stderr, "mismatch\n");
    return 1;
  }
  printf("ok\n");
  return 0;
}
