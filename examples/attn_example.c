/* Causal attention forward and backward on the CPU backend: build a plan,
 * size the workspace, run it, and check one output row by hand. */
#include <attn/attn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                              \
  do {                                                                           \
    attn_status_t st_ = (call);                                                  \
    if (st_ != ATTN_STATUS_SUCCESS) {                                            \
      fprintf(stderr, "%s failed: %s: %s\n", #call, attn_status_string(st_),     \
              attn_last_error_message());                                        \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (p == NULL) {
    fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

int main(void) {
  const int64_t batch = 2, heads = 4, seqlen = 300, dim = 64;
  const size_t n = (size_t)(batch * seqlen * heads * dim);
  float *q = xmalloc(n * sizeof *q), *k = xmalloc(n * sizeof *k), *v = xmalloc(n * sizeof *v);
  float *o = xmalloc(n * sizeof *o), *lse = xmalloc((size_t)(batch * heads * seqlen) * sizeof *lse);
  unsigned state = 12345u;
  for (size_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u; q[i] = (float)(state >> 8) / 16777216.0f - 0.5f;
    state = state * 1664525u + 1013904223u; k[i] = (float)(state >> 8) / 16777216.0f - 0.5f;
    state = state * 1664525u + 1013904223u; v[i] = (float)(state >> 8) / 16777216.0f - 0.5f;
  }

  attn_context_t ctx;
  CHECK(attn_context_create(ATTN_BACKEND_CPU, 0, 0, &ctx));

  attn_plan_desc_t desc;
  CHECK(attn_plan_desc_create(&desc));
  CHECK(attn_plan_desc_set_shape(desc, batch, heads, heads, seqlen, seqlen, dim, dim));
  CHECK(attn_plan_desc_set_dtype(desc, ATTN_DTYPE_FP32));
  CHECK(attn_plan_desc_set_layout(desc, ATTN_LAYOUT_BSHD));
  CHECK(attn_plan_desc_set_mask(desc, ATTN_MASK_CAUSAL, -1, -1));

  attn_plan_t plan;
  CHECK(attn_plan_create(ctx, desc, &plan));
  CHECK(attn_plan_desc_destroy(desc));

  char line[512];
  CHECK(attn_plan_summary(plan, line, sizeof line, NULL));
  printf("plan: %s\n", line);

  size_t ws_bytes = 0;
  CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_bytes));
  void *ws = xmalloc(ws_bytes);
  CHECK(attn_forward(plan, q, k, v, o, lse, ws, ws_bytes, NULL));

  /* Check the last query row of batch 1, head 2 by hand (it sees every key). */
  const int64_t b = 1, h = 2, i = seqlen - 1;
  const float scale = 1.0f / sqrtf((float)dim);
  double mx = -INFINITY, sum = 0.0, err = 0.0;
  double *p = xmalloc((size_t)seqlen * sizeof *p);
  for (int64_t j = 0; j < seqlen; ++j) {
    double s = 0.0;
    for (int64_t c = 0; c < dim; ++c)
      s += (double)q[((b * seqlen + i) * heads + h) * dim + c] *
           (double)k[((b * seqlen + j) * heads + h) * dim + c];
    p[j] = s * scale;
    if (p[j] > mx) mx = p[j];
  }
  for (int64_t j = 0; j < seqlen; ++j) sum += (p[j] = exp(p[j] - mx));
  for (int64_t c = 0; c < dim; ++c) {
    double ref = 0.0;
    for (int64_t j = 0; j < seqlen; ++j) ref += p[j] / sum * v[((b * seqlen + j) * heads + h) * dim + c];
    double e = fabs(ref - o[((b * seqlen + i) * heads + h) * dim + c]);
    if (e > err) err = e;
  }
  double lse_err = fabs(mx + log(sum) - lse[(b * heads + h) * seqlen + i]);
  printf("row check: max |O - ref| = %.3g, |LSE - ref| = %.3g\n", err, lse_err);

  free(p);
  free(ws);
  CHECK(attn_plan_destroy(plan));
  CHECK(attn_context_destroy(ctx));
  free(q); free(k); free(v); free(o); free(lse);
  if (err > 1e-5 || lse_err > 1e-5) {
    fprintf(stderr, "mismatch\n");
    return 1;
  }
  printf("ok\n");
  return 0;
}
