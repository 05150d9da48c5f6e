/* See harness.h. */
#include "harness.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "reference.h"
#include "testutil.h"

enum { NT = 8 }; /* tensors, indexed by attn_tensor_role_t */

static const char *const kRoleName[NT] = {"Q", "K", "V", "O", "dO", "dQ", "dK", "dV"};

static int is_q_side(int role) {
  return role == ATTN_TENSOR_Q || role == ATTN_TENSOR_O || role == ATTN_TENSOR_DO ||
         role == ATTN_TENSOR_DQ;
}

static int is_output(int role) {
  return role == ATTN_TENSOR_O || role == ATTN_TENSOR_DQ || role == ATTN_TENSOR_DK ||
         role == ATTN_TENSOR_DV;
}

static int has_v_dim(int role) {
  return role == ATTN_TENSOR_V || role == ATTN_TENSOR_O || role == ATTN_TENSOR_DO ||
         role == ATTN_TENSOR_DV;
}

/* A workspace at an odd address, poisoned: the library must align it
 * itself and must not rely on its contents. */
typedef struct workspace {
  unsigned char *block;
  void *ptr;
  size_t bytes;
} workspace;

/* Where one tensor lives. */
typedef struct tensor_geom {
  int buf;       /* the buffer holding it (its own role, or Q / dQ when packed) */
  size_t origin; /* element offset of (0, 0, 0, 0) in that buffer */
  ref_strides st;
  int64_t heads, dim;
  int custom;   /* its strides are given to the plan (attn_plan_desc_set_tensor) */
  int32_t ndim; /* dims and strides as given to attn_tensor_desc_set */
  int64_t dims[4], strides[4];
} tensor_geom;

typedef struct run {
  const nc_case *c;
  char desc[512]; /* the case in words, for messages */
  int varlen;
  int64_t seqlen_q, seqlen_kv; /* max over the batch for varlen */
  int32_t *cu_q32, *cu_kv32;
  int64_t *cu_q, *cu_kv;
  ref_problem rp;
  tensor_geom t[NT];
  tu_buffer buf[NT];        /* n == 0 when no tensor lives there */
  unsigned char *owner[NT]; /* per buffer element: role + 1, or 0 in a gap */
  double *ref[NT];          /* fp64 reference outputs, indexed like the buffers */
  double *lowp[NT];         /* same-precision yardstick outputs */
  float *lse;
  double *lse_ref, *lse_lowp;
  size_t lse_n;
  unsigned char *moba_pair; /* MoBA: the fp64 selection [batch][heads_q][lq][lk] */
  int64_t empty_rows; /* query rows (per head) that see no key */
  double zmax;        /* largest |logit| over visible pairs */
  char summary[512];
  /* moba_keep: the workspaces of the checked and of the repeated forward,
   * each handed to the backward run after it */
  workspace kept[2];
} run;

/* ------------------------------------------------------------------------ */
/* Failure reporting                                                         */
/* ------------------------------------------------------------------------ */

static void fail_case(const run *r, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  print_error("FAILED %s [%s] seed %llu (ATTN_TEST_SEED=%llu reproduces)\n  %s\n", r->c->name,
              r->desc, (unsigned long long)tu_seed(), (unsigned long long)tu_seed(), msg);
  fail();
}

static void check_status(const run *r, attn_status_t st, const char *call) {
  if (st != ATTN_STATUS_SUCCESS)
    fail_case(r, "%s returned %s: %s", call, attn_status_string(st), attn_last_error_message());
}

static void describe_case(run *r) {
  const nc_case *c = r->c;
  char mask[64];
  const char *strides[] = {"default",      "padded", "packed",     "shuffled",
                           "broadcast-kv", "mixed",  "zero-inputs"};
  switch (c->mask) {
    case ATTN_MASK_NONE: snprintf(mask, sizeof mask, "none"); break;
    case ATTN_MASK_CAUSAL: snprintf(mask, sizeof mask, "causal"); break;
    default:
      snprintf(mask, sizeof mask, "window(%lld,%lld)", (long long)c->left, (long long)c->right);
  }
  snprintf(r->desc, sizeof r->desc,
           "%s %s batch %lld%s heads %lld/%lld seqlen %lld/%lld dims %lld/%lld mask %s "
           "scale %g softcap %g strides %s qk_sd %g trend %d threads %d%s%s",
           tu_dtype_name(c->dtype),
           r->varlen ? "THD" : (c->layout == ATTN_LAYOUT_BHSD ? "BHSD" : "BSHD"),
           (long long)c->batch, r->varlen ? " (varlen)" : "", (long long)c->heads_q,
           (long long)c->heads_kv, (long long)r->seqlen_q, (long long)r->seqlen_kv,
           (long long)c->dqk, (long long)c->dv, mask, r->rp.scale, (double)c->softcap,
           strides[c->strides], c->qk_sd, c->logit_trend, c->threads, c->backward ? " +bwd" : "",
           c->no_lse ? " lse=NULL" : "");
  {
    size_t used = strlen(r->desc);
    static const char *const policy[] = {"", " allow-empty", " deny-empty"};
    snprintf(r->desc + used, sizeof r->desc - used, "%s%s%s%s%s", policy[c->empty_policy],
             c->deterministic ? " deterministic" : "", c->block_mask != NULL ? " block-mask" : "",
             c->varlen_names_layout ? " layout-named" : "", c->reuse_desc ? " reused-desc" : "");
    used = strlen(r->desc);
    if (c->moba_block > 0)
      snprintf(r->desc + used, sizeof r->desc - used, " moba(block %lld, top %lld%s%s)",
               (long long)c->moba_block, (long long)c->moba_top_k, c->moba_shared ? ", shared" : "",
               c->moba_keep ? ", kept" : "");
  }
  if (r->varlen) {
    int64_t b;
    size_t used = strlen(r->desc);
    for (b = 0; b < c->batch && used < sizeof r->desc; ++b) {
      snprintf(r->desc + used, sizeof r->desc - used, "%s%d/%d", b == 0 ? " lengths q/kv " : ", ",
               (int)c->lens_q[b], (int)c->lens_kv[b]);
      used = strlen(r->desc);
    }
  }
}

/* ------------------------------------------------------------------------ */
/* Setup                                                                     */
/* ------------------------------------------------------------------------ */

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n == 0 ? 1 : n, size);
  if (p == NULL) {
    fprintf(stderr, "harness: out of memory\n");
    abort();
  }
  return p;
}

static void setup_shape(run *r) {
  const nc_case *c = r->c;
  int64_t b;
  r->varlen = c->lens_q != NULL;
  r->cu_q32 = (int32_t *)xcalloc((size_t)c->batch + 1, sizeof(int32_t));
  r->cu_kv32 = (int32_t *)xcalloc((size_t)c->batch + 1, sizeof(int32_t));
  r->cu_q = (int64_t *)xcalloc((size_t)c->batch + 1, sizeof(int64_t));
  r->cu_kv = (int64_t *)xcalloc((size_t)c->batch + 1, sizeof(int64_t));
  r->seqlen_q = r->varlen ? 0 : c->seqlen_q;
  r->seqlen_kv = r->varlen ? 0 : c->seqlen_kv;
  for (b = 0; b < c->batch; ++b) {
    const int64_t lq = r->varlen ? c->lens_q[b] : c->seqlen_q;
    const int64_t lk = r->varlen ? c->lens_kv[b] : c->seqlen_kv;
    r->cu_q[b + 1] = r->cu_q[b] + lq;
    r->cu_kv[b + 1] = r->cu_kv[b] + lk;
    r->cu_q32[b + 1] = (int32_t)r->cu_q[b + 1];
    r->cu_kv32[b + 1] = (int32_t)r->cu_kv[b + 1];
    if (lq > r->seqlen_q) r->seqlen_q = lq;
    if (lk > r->seqlen_kv) r->seqlen_kv = lk;
  }

  memset(&r->rp, 0, sizeof r->rp);
  r->rp.batch = c->batch;
  r->rp.heads_q = c->heads_q;
  r->rp.heads_kv = c->heads_kv;
  r->rp.head_dim_qk = c->dqk;
  r->rp.head_dim_v = c->dv;
  r->rp.cu_q = r->cu_q;
  r->rp.cu_kv = r->cu_kv;
  r->rp.varlen = r->varlen;
  /* The scale the library uses: the float it was given, or its default. */
  r->rp.scale = c->scale > 0.0f ? (double)c->scale : (double)(float)(1.0 / sqrt((double)c->dqk));
  r->rp.softcap = c->softcap;
  switch (c->mask) {
    case ATTN_MASK_NONE: r->rp.window_left = -1, r->rp.window_right = -1; break;
    case ATTN_MASK_CAUSAL: r->rp.window_left = -1, r->rp.window_right = 0; break;
    case ATTN_MASK_WINDOW: r->rp.window_left = c->left, r->rp.window_right = c->right; break;
  }
  r->rp.pair_mask = c->pair_mask;
  r->rp.pair_mask_batch = c->mask_batch;
  r->rp.pair_mask_heads = c->mask_heads;
  /* Varlen: the selection is given for the longest sequence, each sequence
   * reading its corner of it (attn.h). */
  r->rp.pair_mask_rows = r->varlen ? r->seqlen_q : 0;
  r->rp.pair_mask_cols = r->varlen ? r->seqlen_kv : 0;
}

/* Element offset of (b, s, h, 0) of a tensor in its buffer. */
static size_t elem(const run *r, int role, int64_t b, int64_t s, int64_t h) {
  const tensor_geom *g = &r->t[role];
  return g->origin + (size_t)ref_offset(&r->rp, &g->st, is_q_side(role), b, s, h);
}

enum { DIM_B = 0, DIM_S = 1, DIM_H = 2 }; /* a tensor's outer dims */

/* The memory order of a layout's outer dims, innermost first (BSHD: head,
 * sequence, batch); a random one when rng is given. Returns their number. */
static int memory_order(attn_layout_t layout, tu_rng *rng, int order[3]) {
  int n = 3, i;
  switch (layout) {
    case ATTN_LAYOUT_BSHD: order[0] = DIM_H, order[1] = DIM_S, order[2] = DIM_B; break;
    case ATTN_LAYOUT_BHSD: order[0] = DIM_S, order[1] = DIM_H, order[2] = DIM_B; break;
    case ATTN_LAYOUT_THD: order[0] = DIM_H, order[1] = DIM_S, n = 2; break;
  }
  for (i = n - 1; rng != NULL && i > 0; --i) {
    const int j = (int)tu_rng_int(rng, 0, i), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  return n;
}

/* Strides and placement of each tensor, then the buffers. */
static void setup_geometry(run *r, tu_rng *rng) {
  const nc_case *c = r->c;
  const attn_layout_t layout = r->varlen ? ATTN_LAYOUT_THD : c->layout;
  size_t need[NT] = {0};
  int role, i;

  if (c->strides == NC_STRIDES_BROADCAST_KV && r->varlen)
    fail_case(r, "case error: broadcast K and V need a fixed-length batch");
  if (c->strides == NC_STRIDES_PACKED) {
    int same_tokens = c->dqk == c->dv;
    int64_t b;
    for (b = 0; b <= c->batch; ++b) same_tokens = same_tokens && r->cu_q[b] == r->cu_kv[b];
    if (!same_tokens) fail_case(r, "case error: packed QKV needs equal lengths and head dims");
  }

  for (role = 0; role < NT; ++role) {
    tensor_geom *g = &r->t[role];
    const int q = is_q_side(role);
    const int64_t heads = q ? c->heads_q : c->heads_kv;
    const int64_t dim = has_v_dim(role) ? c->dv : c->dqk;
    const int64_t len = q ? r->seqlen_q : r->seqlen_kv; /* fixed length */
    const int64_t tokens = q ? r->cu_q[c->batch] : r->cu_kv[c->batch];
    const int packed = c->strides == NC_STRIDES_PACKED && role != ATTN_TENSOR_O &&
                       role != ATTN_TENSOR_DO;
    const int mixed_custom = c->strides == NC_STRIDES_MIXED && tu_rng_int(rng, 0, 1);
    const int shuffled =
        c->strides == NC_STRIDES_SHUFFLED || c->strides == NC_STRIDES_ZERO_INPUTS || mixed_custom;
    const int padded = c->strides == NC_STRIDES_PADDED || shuffled ||
                       (c->strides == NC_STRIDES_PACKED && !packed);
    /* Pads differ per role so that no two tensors share strides by accident. */
    const int64_t pad[4] = {padded ? 1 + role : 0, padded ? 3 + 2 * role : 0,
                            padded ? 5 + role : 0, 0};
    /* Packed: [.., Hq + 2 Hkv, ..] with Q, K, V (or dQ, dK, dV) at head
     * offsets 0, Hq, Hq + Hkv. */
    const int64_t slots = packed ? c->heads_q + 2 * c->heads_kv : heads;
    const int64_t size[3] = {c->batch, layout == ATTN_LAYOUT_THD ? tokens : len, slots};
    int64_t stride[3] = {0, 0, 0}, first_slot = 0, cur;
    int order[3], n, k;
    size_t extent = 0;
    if (packed && (role == ATTN_TENSOR_K || role == ATTN_TENSOR_DK)) first_slot = c->heads_q;
    if (packed && (role == ATTN_TENSOR_V || role == ATTN_TENSOR_DV))
      first_slot = c->heads_q + c->heads_kv;

    /* Memory order of the outer dims, innermost first; each stride spans
     * the dims inside it plus a pad. */
    n = memory_order(layout, shuffled ? rng : NULL, order);
    cur = dim + pad[0];
    for (k = 0; k < n; ++k) {
      stride[order[k]] = cur;
      cur = cur * size[order[k]] + pad[k + 1];
    }
    if (c->strides == NC_STRIDES_BROADCAST_KV &&
        (role == ATTN_TENSOR_K || role == ATTN_TENSOR_V))
      stride[DIM_B] = 0; /* every sequence reads the same keys and values */
    if (c->strides == NC_STRIDES_ZERO_INPUTS && !is_output(role))
      for (k = 0; k < n; ++k) /* inputs may repeat along any dim: stride 0 */
        if (tu_rng_int(rng, 0, 2) == 0) stride[order[k]] = 0;

    g->heads = heads;
    g->dim = dim;
    g->custom = c->strides == NC_STRIDES_MIXED ? mixed_custom : c->strides != NC_STRIDES_DEFAULT;
    g->buf = role;
    if (packed) g->buf = role <= ATTN_TENSOR_V ? ATTN_TENSOR_Q : ATTN_TENSOR_DQ;
    g->st.batch = layout == ATTN_LAYOUT_THD ? 0 : stride[DIM_B];
    g->st.seq = stride[DIM_S];
    g->st.head = stride[DIM_H];
    switch (layout) {
      case ATTN_LAYOUT_BSHD:
        g->ndim = 4;
        g->dims[0] = c->batch, g->dims[1] = len, g->dims[2] = heads, g->dims[3] = dim;
        g->strides[0] = g->st.batch, g->strides[1] = g->st.seq, g->strides[2] = g->st.head;
        break;
      case ATTN_LAYOUT_BHSD:
        g->ndim = 4;
        g->dims[0] = c->batch, g->dims[1] = heads, g->dims[2] = len, g->dims[3] = dim;
        g->strides[0] = g->st.batch, g->strides[1] = g->st.head, g->strides[2] = g->st.seq;
        break;
      case ATTN_LAYOUT_THD:
        g->ndim = 3;
        g->dims[0] = tokens, g->dims[1] = heads, g->dims[2] = dim;
        g->strides[0] = g->st.seq, g->strides[1] = g->st.head;
        break;
    }
    g->strides[g->ndim - 1] = 1;
    g->origin = (size_t)(first_slot * g->st.head);
    if (tokens > 0) {
      const int64_t last_token =
          layout == ATTN_LAYOUT_THD ? (tokens - 1) * g->st.seq
                                    : (c->batch - 1) * g->st.batch + (len - 1) * g->st.seq;
      extent = g->origin + (size_t)(last_token + (heads - 1) * g->st.head + dim);
    }
    if (extent > need[g->buf]) need[g->buf] = extent;
  }

  for (i = 0; i < NT; ++i) {
    tu_buffer_alloc(&r->buf[i], c->dtype, need[i]);
    r->owner[i] = (unsigned char *)xcalloc(need[i], 1);
    r->ref[i] = (double *)xcalloc(need[i], sizeof(double));
    r->lowp[i] = (double *)xcalloc(need[i], sizeof(double));
  }
  /* Mark each tensor's elements; two tensors sharing one is a harness bug. */
  for (role = 0; role < NT; ++role) {
    const tensor_geom *g = &r->t[role];
    int64_t b, s, h, ch;
    for (b = 0; b < c->batch; ++b) {
      const int64_t n = is_q_side(role) ? ref_lq(&r->rp, b) : ref_lk(&r->rp, b);
      for (s = 0; s < n; ++s)
        for (h = 0; h < g->heads; ++h) {
          const size_t base = elem(r, role, b, s, h);
          for (ch = 0; ch < g->dim; ++ch) {
            /* inputs may share elements (broadcast K and V), outputs not */
            if (r->owner[g->buf][base + (size_t)ch] != 0 && is_output(role))
              fail_case(r, "harness error: tensors %s and %s overlap", kRoleName[role],
                        kRoleName[r->owner[g->buf][base + (size_t)ch] - 1]);
            r->owner[g->buf][base + (size_t)ch] = (unsigned char)(role + 1);
          }
        }
    }
  }
  r->rp.q = r->t[ATTN_TENSOR_Q].st;
  r->rp.k = r->t[ATTN_TENSOR_K].st;
  r->rp.v = r->t[ATTN_TENSOR_V].st;
  r->rp.o = r->t[ATTN_TENSOR_O].st;
  r->rp.d_o = r->t[ATTN_TENSOR_DO].st;
  r->rp.dq = r->t[ATTN_TENSOR_DQ].st;
  r->rp.dk = r->t[ATTN_TENSOR_DK].st;
  r->rp.dv = r->t[ATTN_TENSOR_DV].st;

  r->lse_n = ref_lse_count(&r->rp);
  r->lse = (float *)xcalloc(r->lse_n, sizeof(float));
  r->lse_ref = (double *)xcalloc(r->lse_n, sizeof(double));
  r->lse_lowp = (double *)xcalloc(r->lse_n, sizeof(double));
}


/* Pointers handed to the library and to the reference. */
static void *data_of(const run *r, int role) {
  const tensor_geom *g = &r->t[role];
  return (char *)r->buf[g->buf].data + g->origin * tu_dtype_size(r->c->dtype);
}
static const double *mirror_of(const run *r, int role) {
  return r->buf[r->t[role].buf].mirror + r->t[role].origin;
}

static void fill_inputs(run *r, tu_rng *rng) {
  const nc_case *c = r->c;
  const double sd = c->qk_sd > 0.0 ? c->qk_sd : 1.0;
  int i;
  /* Whole buffers, gaps included: a library reading a gap gets garbage. */
  for (i = 0; i < NT; ++i) {
    if (r->buf[i].n == 0) continue;
    if (i == ATTN_TENSOR_Q || i == ATTN_TENSOR_K) tu_fill_normal(rng, &r->buf[i], sd);
    if (i == ATTN_TENSOR_V || i == ATTN_TENSOR_DO) tu_fill_normal(rng, &r->buf[i], 1.0);
  }
  if (c->qk_integers) {
    static const double kValues[4] = {-2.0, -1.0, 1.0, 2.0};
    size_t e;
    if (c->strides == NC_STRIDES_PACKED) fail_case(r, "case error: integer Q, K need own buffers");
    for (i = ATTN_TENSOR_Q; i <= ATTN_TENSOR_K; ++i)
      for (e = 0; e < r->buf[i].n; ++e) tu_buffer_set(&r->buf[i], e, kValues[tu_rng_int(rng, 0, 3)]);
  }
  if (c->strides == NC_STRIDES_PACKED) {
    /* one buffer: redraw V's slots with sd 1 */
    int64_t b, s, h, ch;
    for (b = 0; b < c->batch; ++b)
      for (s = 0; s < ref_lk(&r->rp, b); ++s)
        for (h = 0; h < c->heads_kv; ++h)
          for (ch = 0; ch < c->dv; ++ch)
            tu_buffer_set(&r->buf[ATTN_TENSOR_Q], elem(r, ATTN_TENSOR_V, b, s, h) + (size_t)ch,
                          tu_rng_normal(rng, 0.0, 1.0) + 1e-3);
  }
  if (c->uniform_kv) {
    int role;
    int64_t b, s, h, ch;
    for (role = ATTN_TENSOR_K; role <= ATTN_TENSOR_V; ++role) {
      tu_buffer *buf = &r->buf[r->t[role].buf];
      for (b = 0; b < c->batch; ++b)
        for (s = 1; s < ref_lk(&r->rp, b); ++s)
          for (h = 0; h < c->heads_kv; ++h)
            for (ch = 0; ch < r->t[role].dim; ++ch)
              tu_buffer_set(buf, elem(r, role, b, s, h) + (size_t)ch,
                            buf->mirror[elem(r, role, b, 0, h) + (size_t)ch]);
    }
  }
  if (c->logit_trend != 0) {
    /* Channel 0: q = 1, k = trend * 8 * (a ramp from -1 to 1 along the keys),
     * so that the logits drift by 16 * scale across the sequence. */
    int64_t b, s, h;
    for (b = 0; b < c->batch; ++b) {
      const int64_t lk = ref_lk(&r->rp, b);
      for (s = 0; s < ref_lq(&r->rp, b); ++s)
        for (h = 0; h < c->heads_q; ++h)
          tu_buffer_set(&r->buf[r->t[ATTN_TENSOR_Q].buf], elem(r, ATTN_TENSOR_Q, b, s, h), 1.0);
      for (s = 0; s < lk; ++s)
        for (h = 0; h < c->heads_kv; ++h) {
          const double ramp = lk > 1 ? 2.0 * (double)s / (double)(lk - 1) - 1.0 : 1.0;
          tu_buffer_set(&r->buf[r->t[ATTN_TENSOR_K].buf], elem(r, ATTN_TENSOR_K, b, s, h),
                        c->logit_trend * 8.0 * ramp + 1e-3);
        }
    }
  }
}

/* ------------------------------------------------------------------------ */
/* Plans                                                                     */
/* ------------------------------------------------------------------------ */

/* reuse_desc: the descriptor first describes another problem, every setter
 * called with values that differ from the case's, and makes a plan of it
 * (which may be refused: the layout of a fixed-length batch set together
 * with a varlen one, say); try_plan then sets everything again. The layout
 * is left alone for a varlen case, which cannot unset it. */
static void describe_another(run *r, attn_context_t ctx, attn_plan_desc_t d) {
  const nc_case *c = r->c;
  static const int32_t cu[3] = {0, 3, 7};
  const int64_t dims[4] = {2, 5, 3, 9}; /* BSHD Q of the shape below */
  attn_block_mask_t m = NULL;
  attn_tensor_desc_t td = NULL;
  attn_plan_t p = NULL;
  check_status(r, attn_plan_desc_set_shape(d, 2, 6, 3, 5, 7, 9, 11), "attn_plan_desc_set_shape");
  check_status(r, attn_plan_desc_set_dtype(d, c->dtype == ATTN_DTYPE_FP32 ? ATTN_DTYPE_BF16
                                                                           : ATTN_DTYPE_FP32),
               "attn_plan_desc_set_dtype");
  if (!r->varlen)
    check_status(r,
                 attn_plan_desc_set_layout(d, c->layout == ATTN_LAYOUT_BSHD ? ATTN_LAYOUT_BHSD
                                                                           : ATTN_LAYOUT_BSHD),
                 "attn_plan_desc_set_layout");
  check_status(r, attn_plan_desc_set_varlen(d, 2, cu, cu), "attn_plan_desc_set_varlen");
  check_status(r, attn_plan_desc_set_softmax_scale(d, 3.0f), "attn_plan_desc_set_softmax_scale");
  check_status(r, attn_plan_desc_set_softcap(d, 7.0f), "attn_plan_desc_set_softcap");
  check_status(r, attn_plan_desc_set_mask(d, ATTN_MASK_WINDOW, 2, 1), "attn_plan_desc_set_mask");
  check_status(r, attn_block_mask_create(1, 1, 5, 7, 2, 3, &m), "attn_block_mask_create");
  check_status(r, attn_block_mask_add_window(m, 1, 1), "attn_block_mask_add_window");
  check_status(r, attn_plan_desc_set_block_mask(d, m), "attn_plan_desc_set_block_mask");
  attn_block_mask_destroy(m);
  check_status(r, attn_plan_desc_set_moba(d, 2, 1, 1), "attn_plan_desc_set_moba");
  check_status(r, attn_plan_desc_set_moba_keep_selection(d, 1),
               "attn_plan_desc_set_moba_keep_selection");
  check_status(r, attn_plan_desc_set_deterministic(d, !c->deterministic),
               "attn_plan_desc_set_deterministic");
  check_status(r, attn_plan_desc_set_allow_empty_rows(d, 1), "attn_plan_desc_set_allow_empty_rows");
  check_status(r,
               attn_plan_desc_set_passes(d, c->backward ? ATTN_PASSES_FORWARD
                                                        : ATTN_PASSES_FORWARD_BACKWARD),
               "attn_plan_desc_set_passes");
  check_status(r, attn_tensor_desc_create(&td), "attn_tensor_desc_create");
  check_status(r, attn_tensor_desc_set(td, ATTN_DTYPE_BF16, 4, dims, NULL), "attn_tensor_desc_set");
  check_status(r, attn_plan_desc_set_tensor(d, ATTN_TENSOR_Q, td), "attn_plan_desc_set_tensor");
  check_status(r, attn_plan_desc_set_tensor(d, ATTN_TENSOR_DV, td), "attn_plan_desc_set_tensor");
  attn_tensor_desc_destroy(td);
  attn_plan_create(ctx, d, &p); /* either way: the descriptor must stay usable */
  attn_plan_destroy(p);
}

/* nc_case.bad_tensor: a descriptor attn_plan_desc_set_tensor takes and
 * attn_plan_create must refuse (the strides are the layout's or the case's). */
static void spoil_tensor(nc_bad_tensor kind, int32_t ndim, attn_dtype_t *dtype, int64_t *dims,
                         int64_t *strides) {
  int32_t k;
  switch (kind) {
    case NC_BAD_DTYPE: *dtype = *dtype == ATTN_DTYPE_FP32 ? ATTN_DTYPE_FP16 : ATTN_DTYPE_FP32; break;
    case NC_BAD_DIMS: dims[0] += 1; break;
    case NC_BAD_LAST_STRIDE: strides[ndim - 1] = 2; break;
    case NC_BAD_OVERLAP:
      for (k = 0; k < ndim - 1; ++k)
        if (dims[k] > 1) {
          strides[k] = 0;
          break;
        }
      break;
  }
}

/* message: where a failure's attn_last_error_message() is kept (the calls
 * after attn_plan_create reset it), or NULL. */
static attn_status_t try_plan(run *r, attn_context_t ctx, int allow_empty, attn_plan_t *plan,
                              char *message, size_t size) {
  const nc_case *c = r->c;
  const int all = c->reuse_desc; /* call every setter, defaults included */
  attn_plan_desc_t d = NULL;
  attn_tensor_desc_t td = NULL;
  attn_status_t st;
  int role;
  check_status(r, attn_plan_desc_create(&d), "attn_plan_desc_create");
  if (all) describe_another(r, ctx, d);
  check_status(r,
               attn_plan_desc_set_shape(d, c->batch, c->heads_q, c->heads_kv,
                                        r->seqlen_q + (c->bad_varlen == 2), r->seqlen_kv, c->dqk,
                                        c->dv),
               "attn_plan_desc_set_shape");
  check_status(r, attn_plan_desc_set_dtype(d, c->dtype), "attn_plan_desc_set_dtype");
  if (r->varlen || all)
    check_status(r,
                 attn_plan_desc_set_varlen(d, c->bad_varlen == 1 ? c->batch - 1 : c->batch,
                                           r->varlen ? r->cu_q32 : NULL,
                                           r->varlen ? r->cu_kv32 : NULL),
                 "attn_plan_desc_set_varlen");
  if (!r->varlen || c->varlen_names_layout)
    check_status(r, attn_plan_desc_set_layout(d, c->layout), "attn_plan_desc_set_layout");
  if (c->scale > 0.0f || all)
    check_status(r, attn_plan_desc_set_softmax_scale(d, (float)r->rp.scale),
                 "attn_plan_desc_set_softmax_scale");
  if (c->softcap > 0.0f || all)
    check_status(r, attn_plan_desc_set_softcap(d, c->softcap), "attn_plan_desc_set_softcap");
  check_status(r,
               attn_plan_desc_set_mask(d, c->mask, c->mask == ATTN_MASK_WINDOW ? c->left : -1,
                                       c->mask == ATTN_MASK_WINDOW ? c->right : -1),
               "attn_plan_desc_set_mask");
  if (c->block_mask != NULL || all)
    check_status(r, attn_plan_desc_set_block_mask(d, c->block_mask),
                 "attn_plan_desc_set_block_mask");
  if (c->moba_block > 0 || all)
    check_status(r, attn_plan_desc_set_moba(d, c->moba_block, c->moba_top_k, c->moba_shared),
                 "attn_plan_desc_set_moba");
  if (c->moba_keep || all)
    check_status(r, attn_plan_desc_set_moba_keep_selection(d, c->moba_keep),
                 "attn_plan_desc_set_moba_keep_selection");
  if (c->deterministic || all)
    check_status(r, attn_plan_desc_set_deterministic(d, c->deterministic),
                 "attn_plan_desc_set_deterministic");
  if (allow_empty || all)
    check_status(r, attn_plan_desc_set_allow_empty_rows(d, allow_empty),
                 "attn_plan_desc_set_allow_empty_rows");
  check_status(r,
               attn_plan_desc_set_passes(d, c->backward ? ATTN_PASSES_FORWARD_BACKWARD
                                                        : ATTN_PASSES_FORWARD),
               "attn_plan_desc_set_passes");
  check_status(r, attn_tensor_desc_create(&td), "attn_tensor_desc_create");
  for (role = 0; role < NT; ++role) {
    const tensor_geom *g = &r->t[role];
    const int bad = c->bad_tensor == role + 1;
    if (g->custom || bad) {
      attn_dtype_t dtype = c->dtype;
      int64_t dims[4], strides[4];
      memcpy(dims, g->dims, sizeof dims);
      memcpy(strides, g->strides, sizeof strides);
      if (bad) spoil_tensor(c->bad_tensor_kind, g->ndim, &dtype, dims, strides);
      check_status(r, attn_tensor_desc_set(td, dtype, g->ndim, dims, strides),
                   "attn_tensor_desc_set");
    }
    if (g->custom || bad || all)
      check_status(r,
                   attn_plan_desc_set_tensor(d, (attn_tensor_role_t)role,
                                             g->custom || bad ? td : NULL),
                   "attn_plan_desc_set_tensor");
  }
  attn_tensor_desc_destroy(td);
  st = attn_plan_create(ctx, d, plan);
  if (message != NULL) snprintf(message, size, "%s", attn_last_error_message());
  attn_plan_desc_destroy(d);
  return st;
}

/* Creates the plan by the case's empty-row policy. With `refusal` NULL a
 * failure fails the case; else it is returned there (plan NULL). */
static attn_plan_t make_plan(run *r, attn_context_t ctx, nc_outcome *refusal) {
  attn_plan_t plan = NULL;
  attn_status_t st;
  char message[512];
  int allow = r->empty_rows > 0;
  if (r->c->empty_policy == NC_EMPTY_ALLOW) allow = 1;
  if (r->c->empty_policy == NC_EMPTY_DENY) allow = 0;
  if (r->empty_rows > 0 && r->c->empty_policy == NC_EMPTY_AUTO && refusal == NULL) {
    /* The contract: empty rows are rejected unless allowed. */
    st = try_plan(r, ctx, 0, &plan, NULL, 0);
    if (st != ATTN_STATUS_INVALID_ARGUMENT || plan != NULL)
      fail_case(r, "%lld empty rows: attn_plan_create without allow_empty_rows returned %s",
                (long long)r->empty_rows, attn_status_string(st));
  }
  st = try_plan(r, ctx, allow, &plan, message, sizeof message);
  if (st != ATTN_STATUS_SUCCESS && refusal != NULL) {
    refusal->status = st;
    snprintf(refusal->message, sizeof refusal->message, "%s", message);
    if (plan != NULL) fail_case(r, "attn_plan_create failed but wrote *plan");
    return NULL;
  }
  if (st != ATTN_STATUS_SUCCESS)
    fail_case(r, "attn_plan_create returned %s: %s", attn_status_string(st), message);
  return plan;
}

static void workspace_get(run *r, attn_plan_t plan, attn_pass_t pass, tu_rng *rng, workspace *w) {
  const size_t shift = (size_t)tu_rng_int(rng, 0, 63);
  check_status(r, attn_plan_workspace_size(plan, pass, &w->bytes), "attn_plan_workspace_size");
  if (r->c->moba_keep) {
    /* one buffer serves both passes: the larger size */
    size_t other = 0;
    check_status(r,
                 attn_plan_workspace_size(
                     plan, pass == ATTN_PASS_FORWARD ? ATTN_PASS_BACKWARD : ATTN_PASS_FORWARD,
                     &other),
                 "attn_plan_workspace_size");
    if (other > w->bytes) w->bytes = other;
  }
  w->block = (unsigned char *)xcalloc(w->bytes + 64, 1);
  tu_poison_bytes(w->block, w->bytes + 64);
  w->ptr = w->bytes > 0 ? w->block + shift : NULL;
}

/* After forward run k (0: the checked one, 1: the repeat): a plan that
 * keeps its MoBA selection hands the workspace to the backward run k. */
static void keep_or_free(run *r, int k, workspace *w) {
  if (r->c->moba_keep) {
    free(r->kept[k].block);
    r->kept[k] = *w;
  } else {
    free(w->block);
  }
  w->block = NULL;
}

/* The workspace of backward run k: forward run k's when the selection is
 * kept (the caller frees it either way), else a fresh one. */
static void backward_workspace(run *r, attn_plan_t plan, int k, tu_rng *rng, workspace *w) {
  if (r->c->moba_keep) {
    if (r->kept[k].block == NULL) fail_case(r, "harness error: no forward workspace kept");
    *w = r->kept[k];
    memset(&r->kept[k], 0, sizeof r->kept[k]);
  } else {
    workspace_get(r, plan, ATTN_PASS_BACKWARD, rng, w);
  }
}

/* ------------------------------------------------------------------------ */
/* Checks                                                                    */
/* ------------------------------------------------------------------------ */

/* The relative part of the absolute term (harness.h): the dtype's, plus the
 * error of fp32 logits of magnitude zmax. */
static double atol_scale(attn_dtype_t dtype, double zmax) {
  const double a = 4.0 * tu_unit_roundoff(dtype);
  return (a > 1e-5 ? a : 1e-5) + 4.0 * tu_unit_roundoff(ATTN_DTYPE_FP32) * zmax;
}

/* Library and yardstick errors of one tensor. */
static void compare_tensor(const run *r, int role, tu_err *lib, tu_err *lowp) {
  const tensor_geom *g = &r->t[role];
  const tu_buffer *buf = &r->buf[g->buf];
  int64_t b, s, h, ch;
  tu_err_init(lib, kRoleName[role]);
  tu_err_init(lowp, kRoleName[role]);
  for (b = 0; b < r->c->batch; ++b) {
    const int64_t n = is_q_side(role) ? ref_lq(&r->rp, b) : ref_lk(&r->rp, b);
    for (s = 0; s < n; ++s)
      for (h = 0; h < g->heads; ++h) {
        const size_t base = elem(r, role, b, s, h);
        for (ch = 0; ch < g->dim; ++ch) {
          const size_t e = base + (size_t)ch;
          const double ref = r->ref[g->buf][e];
          tu_err_add(lib, b, s, h, ch, tu_load(buf->data, e, buf->dtype), ref);
          tu_err_add(lowp, b, s, h, ch, r->lowp[g->buf][e], ref);
        }
      }
  }
}

static void compare_lse(const run *r, tu_err *lib, tu_err *lowp) {
  int64_t b, s, h;
  tu_err_init(lib, "LSE");
  tu_err_init(lowp, "LSE");
  for (b = 0; b < r->c->batch; ++b)
    for (h = 0; h < r->c->heads_q; ++h)
      for (s = 0; s < ref_lq(&r->rp, b); ++s) {
        const int64_t i = ref_lse_index(&r->rp, b, h, s);
        tu_err_add(lib, b, s, h, -1, r->lse[i], r->lse_ref[i]);
        tu_err_add(lowp, b, s, h, -1, r->lse_lowp[i], r->lse_ref[i]);
      }
}

/* Applies the tolerance rule to one tensor; appends to the summary. */
static void judge(run *r, const tu_err *lib, const tu_err *lowp, double atol) {
  const double tol = 2.0 * lowp->max_err + atol;
  char line[768];
  size_t used = strlen(r->summary);
  snprintf(r->summary + used, sizeof r->summary - used, " %s %.2g/%.2g", lib->what, lib->max_err,
           tol);
  if (lowp->bad > 0) {
    tu_err_format(lowp, tol, line, sizeof line);
    fail_case(r, "case error: the same-precision yardstick is not finite: %s", line);
  }
  if (!tu_err_ok(lib, tol)) {
    tu_err_format(lib, tol, line, sizeof line);
    fail_case(r, "%s (yardstick error %.3g)", line, lowp->max_err);
  }
}

/* Elements of every output buffer outside its tensors must still be poison. */
static void check_gaps(const run *r, int first_role, int last_role) {
  int role;
  for (role = first_role; role <= last_role; ++role) {
    const tu_buffer *buf = &r->buf[role];
    size_t e;
    for (e = 0; e < buf->n; ++e)
      if (r->owner[role][e] == 0 && !tu_is_poison(buf->data, e, buf->dtype))
        fail_case(r, "element %zu of the %s buffer, outside every tensor, was written", e,
                  kRoleName[role]);
  }
}

static void check_inputs_unchanged(const run *r, const char *after) {
  int i;
  for (i = 0; i < NT; ++i) {
    const int is_input = i == ATTN_TENSOR_Q || i == ATTN_TENSOR_K || i == ATTN_TENSOR_V ||
                         i == ATTN_TENSOR_DO;
    const size_t changed = is_input ? tu_buffer_changed(&r->buf[i]) : 0;
    if (changed > 0)
      fail_case(r, "%s changed %zu elements of the input buffer %s", after, changed, kRoleName[i]);
  }
}

/* What no visible pair reaches is exactly 0: the rows of O and dQ of a query
 * that sees no key (LSE = -inf is part of compare), the rows of dK and dV of
 * a key that no row sees. */
static void check_unreached_zero(const run *r, int role) {
  const tensor_geom *g = &r->t[role];
  const tu_buffer *buf = &r->buf[g->buf];
  const int q_side = is_q_side(role);
  int64_t b, s, h, ch;
  for (b = 0; b < r->c->batch; ++b)
    for (s = 0; s < (q_side ? ref_lq(&r->rp, b) : ref_lk(&r->rp, b)); ++s)
      for (h = 0; h < g->heads; ++h) {
        if (q_side ? ref_row_sees_any_head(&r->rp, b, h, s) : ref_key_seen_head(&r->rp, b, h, s))
          continue;
        for (ch = 0; ch < g->dim; ++ch) {
          const double got = tu_load(buf->data, elem(r, role, b, s, h) + (size_t)ch, buf->dtype);
          if (got != 0.0)
            fail_case(r, "%s[b %lld, %s %lld, h %lld, c %lld] = %.9g %s (must be exactly 0)",
                      kRoleName[role], (long long)b, q_side ? "s" : "key", (long long)s,
                      (long long)h, (long long)ch, got,
                      q_side ? "in a row that sees no key" : "for a key no row sees");
        }
      }
}

/* (query row, query head) pairs that see no key. */
static int64_t count_empty_rows(const run *r) {
  int64_t b, h, s, n = 0;
  for (b = 0; b < r->c->batch; ++b)
    for (h = 0; h < r->c->heads_q; ++h)
      for (s = 0; s < ref_lq(&r->rp, b); ++s) n += !ref_row_sees_any_head(&r->rp, b, h, s);
  return n;
}

/* Visible (query, key) pairs over every query head, as attn_plan_describe
 * reports them. */
static int64_t count_visible_pairs(const run *r) {
  int64_t b, h, i, j, n = 0;
  for (b = 0; b < r->c->batch; ++b)
    for (h = 0; h < r->c->heads_q; ++h)
      for (i = 0; i < ref_lq(&r->rp, b); ++i)
        for (j = 0; j < ref_lk(&r->rp, b); ++j) n += ref_visible_head(&r->rp, b, h, i, j);
  return n;
}

/* attn_plan_describe's tile pairs, from the plan's tile sizes: a (query
 * tile, KV tile) pair of a sequence and query head counts as visited when
 * it holds at least one visible pair (the dense mask AND the selection), so
 * that visited / total is the tile density; total counts every pair. */
static void count_tile_pairs(const run *r, int64_t tq, int64_t tk, uint64_t *visited,
                             uint64_t *total) {
  int64_t b, h, qt, kt, i, j;
  *visited = *total = 0;
  for (b = 0; b < r->c->batch; ++b) {
    const int64_t lq = ref_lq(&r->rp, b), lk = ref_lk(&r->rp, b);
    const int64_t nqt = (lq + tq - 1) / tq, nkt = (lk + tk - 1) / tk;
    *total += (uint64_t)(nqt * nkt * r->c->heads_q);
    for (h = 0; h < r->c->heads_q; ++h)
      for (qt = 0; qt < nqt; ++qt)
        for (kt = 0; kt < nkt; ++kt) {
          int hit = 0;
          for (i = qt * tq; i < (qt + 1) * tq && i < lq && !hit; ++i)
            for (j = kt * tk; j < (kt + 1) * tk && j < lk && !hit; ++j)
              hit = ref_visible_head(&r->rp, b, h, i, j);
          *visited += (uint64_t)hit;
        }
  }
}

/* Determinism: the CPU backend gives the same bits run after run. A second
 * run writes fresh poisoned buffers (a workspace at another address); every
 * element, gaps included, must equal the first run's. */
static void *clone_poisoned(const run *r, int buf) {
  void *p = xcalloc(r->buf[buf].n, tu_dtype_size(r->c->dtype));
  tu_poison(p, r->c->dtype, r->buf[buf].n);
  return p;
}

static void *at_origin(const run *r, void *base, int role) {
  return (char *)base + r->t[role].origin * tu_dtype_size(r->c->dtype);
}

static void require_same_bits(const run *r, const void *a, const void *b, size_t bytes,
                              const char *what) {
  if (memcmp(a, b, bytes) != 0) fail_case(r, "a second run gave different bits in %s", what);
}

static void check_forward_repeats(run *r, attn_plan_t plan, tu_rng *rng) {
  const int o_buf = r->t[ATTN_TENSOR_O].buf;
  void *o2 = clone_poisoned(r, o_buf);
  float *lse2 = (float *)xcalloc(r->lse_n, sizeof(float));
  workspace ws;
  attn_status_t st;
  tu_poison(lse2, ATTN_DTYPE_FP32, r->lse_n);
  workspace_get(r, plan, ATTN_PASS_FORWARD, rng, &ws);
  st = attn_forward(plan, data_of(r, ATTN_TENSOR_Q), data_of(r, ATTN_TENSOR_K),
                    data_of(r, ATTN_TENSOR_V), at_origin(r, o2, ATTN_TENSOR_O),
                    r->c->no_lse ? NULL : lse2, ws.ptr, ws.bytes, NULL);
  keep_or_free(r, 1, &ws);
  check_status(r, st, "attn_forward (repeated)");
  require_same_bits(r, o2, r->buf[o_buf].data, r->buf[o_buf].n * tu_dtype_size(r->c->dtype), "O");
  if (!r->c->no_lse) require_same_bits(r, lse2, r->lse, r->lse_n * sizeof(float), "LSE");
  free(o2);
  free(lse2);
}

static void check_backward_repeats(run *r, attn_plan_t plan, tu_rng *rng) {
  void *grads[NT] = {NULL};
  workspace ws;
  attn_status_t st;
  int i;
  for (i = ATTN_TENSOR_DQ; i <= ATTN_TENSOR_DV; ++i) grads[i] = clone_poisoned(r, i);
  backward_workspace(r, plan, 1, rng, &ws);
  st = attn_backward(plan, data_of(r, ATTN_TENSOR_Q), data_of(r, ATTN_TENSOR_K),
                     data_of(r, ATTN_TENSOR_V), data_of(r, ATTN_TENSOR_O), r->lse,
                     data_of(r, ATTN_TENSOR_DO),
                     at_origin(r, grads[r->t[ATTN_TENSOR_DQ].buf], ATTN_TENSOR_DQ),
                     at_origin(r, grads[r->t[ATTN_TENSOR_DK].buf], ATTN_TENSOR_DK),
                     at_origin(r, grads[r->t[ATTN_TENSOR_DV].buf], ATTN_TENSOR_DV), ws.ptr,
                     ws.bytes, NULL);
  free(ws.block);
  check_status(r, st, "attn_backward (repeated)");
  for (i = ATTN_TENSOR_DQ; i <= ATTN_TENSOR_DV; ++i) {
    require_same_bits(r, grads[i], r->buf[i].data, r->buf[i].n * tu_dtype_size(r->c->dtype),
                      kRoleName[i]);
    free(grads[i]);
  }
}

/* ------------------------------------------------------------------------ */
/* The run                                                                   */
/* ------------------------------------------------------------------------ */

static void run_forward(run *r, attn_plan_t plan, tu_rng *rng, int64_t pairs) {
  workspace ws;
  tu_err lib, lowp;
  attn_status_t st;
  const int o_buf = r->t[ATTN_TENSOR_O].buf;
  tu_poison(r->buf[o_buf].data, r->c->dtype, r->buf[o_buf].n);
  tu_poison(r->lse, ATTN_DTYPE_FP32, r->lse_n);
  workspace_get(r, plan, ATTN_PASS_FORWARD, rng, &ws);
  if (r->c->no_lse && r->c->backward) fail_case(r, "case error: the backward needs the LSE");
  st = attn_forward(plan, data_of(r, ATTN_TENSOR_Q), data_of(r, ATTN_TENSOR_K),
                    data_of(r, ATTN_TENSOR_V), data_of(r, ATTN_TENSOR_O),
                    r->c->no_lse ? NULL : r->lse, ws.ptr, ws.bytes, NULL);
  keep_or_free(r, 0, &ws);
  check_status(r, st, "attn_forward");
  check_inputs_unchanged(r, "attn_forward");

  ref_forward(&r->rp, mirror_of(r, ATTN_TENSOR_Q), mirror_of(r, ATTN_TENSOR_K),
              mirror_of(r, ATTN_TENSOR_V), r->ref[o_buf] + r->t[ATTN_TENSOR_O].origin, r->lse_ref);
  ref_lowp_forward(&r->rp, r->c->dtype, mirror_of(r, ATTN_TENSOR_Q), mirror_of(r, ATTN_TENSOR_K),
                   mirror_of(r, ATTN_TENSOR_V), r->lowp[o_buf] + r->t[ATTN_TENSOR_O].origin,
                   r->lse_lowp);

  compare_tensor(r, ATTN_TENSOR_O, &lib, &lowp);
  if (pairs > 0 && lib.max_ref == 0.0) fail_case(r, "harness error: the reference O is all zero");
  judge(r, &lib, &lowp, atol_scale(r->c->dtype, r->zmax) * lib.max_ref);
  if (!r->c->no_lse) {
    compare_lse(r, &lib, &lowp);
    judge(r, &lib, &lowp, 1e-5 * (lib.max_ref > 1.0 ? lib.max_ref : 1.0));
  }
  check_unreached_zero(r, ATTN_TENSOR_O);
  check_gaps(r, ATTN_TENSOR_O, ATTN_TENSOR_O);
  check_forward_repeats(r, plan, rng);
}

/* The largest |value| of a double array indexed like a tensor's buffer, over
 * the tensor's elements. */
static double max_over_tensor(const run *r, int role, const double *values) {
  const tensor_geom *g = &r->t[role];
  double m = 0.0;
  int64_t b, s, h, ch;
  for (b = 0; b < r->c->batch; ++b) {
    const int64_t n = is_q_side(role) ? ref_lq(&r->rp, b) : ref_lk(&r->rp, b);
    for (s = 0; s < n; ++s)
      for (h = 0; h < g->heads; ++h)
        for (ch = 0; ch < g->dim; ++ch) {
          const double x = fabs(values[elem(r, role, b, s, h) + (size_t)ch]);
          if (x > m) m = x;
        }
  }
  return m;
}

/* The largest errors dQ and dK inherit from the O handed to the backward:
 * its rounding to the dtype and the forward's own error, measured on the O
 * the library wrote (reference.h: ref_backward_o_error_floor); none for dV. */
static void o_error_floor(const run *r, double floor[3]) {
  const int q_buf = r->t[ATTN_TENSOR_DQ].buf, k_buf = r->t[ATTN_TENSOR_DK].buf;
  const tu_buffer *o_buf = &r->buf[r->t[ATTN_TENSOR_O].buf];
  double *fq = (double *)xcalloc(r->buf[q_buf].n, sizeof(double));
  double *fk = q_buf == k_buf ? fq : (double *)xcalloc(r->buf[k_buf].n, sizeof(double));
  double *o_lib = (double *)xcalloc(o_buf->n, sizeof(double));
  size_t e;
  for (e = 0; e < o_buf->n; ++e) o_lib[e] = tu_load(o_buf->data, e, o_buf->dtype);
  ref_backward_o_error_floor(&r->rp, tu_unit_roundoff(r->c->dtype), mirror_of(r, ATTN_TENSOR_Q),
                             mirror_of(r, ATTN_TENSOR_K), mirror_of(r, ATTN_TENSOR_V),
                             mirror_of(r, ATTN_TENSOR_DO), o_lib + r->t[ATTN_TENSOR_O].origin,
                             fq + r->t[ATTN_TENSOR_DQ].origin, fk + r->t[ATTN_TENSOR_DK].origin);
  floor[0] = max_over_tensor(r, ATTN_TENSOR_DQ, fq);
  floor[1] = max_over_tensor(r, ATTN_TENSOR_DK, fk);
  floor[2] = 0.0;
  if (fk != fq) free(fk);
  free(fq);
  free(o_lib);
}

static void run_backward(run *r, attn_plan_t plan, tu_rng *rng, int64_t pairs) {
  const int grads[3] = {ATTN_TENSOR_DQ, ATTN_TENSOR_DK, ATTN_TENSOR_DV};
  const int o_buf = r->t[ATTN_TENSOR_O].buf;
  tu_err lib[3], lowp[3];
  double magnitude = 0.0, floor[3];
  workspace ws;
  attn_status_t st;
  float *lse_copy = (float *)xcalloc(r->lse_n, sizeof(float));
  void *o_copy = xcalloc(r->buf[o_buf].n, tu_dtype_size(r->c->dtype));
  int i;

  for (i = ATTN_TENSOR_DQ; i <= ATTN_TENSOR_DV; ++i)
    tu_poison(r->buf[i].data, r->c->dtype, r->buf[i].n);
  memcpy(lse_copy, r->lse, r->lse_n * sizeof(float));
  memcpy(o_copy, r->buf[o_buf].data, r->buf[o_buf].n * tu_dtype_size(r->c->dtype));
  backward_workspace(r, plan, 0, rng, &ws);
  st = attn_backward(plan, data_of(r, ATTN_TENSOR_Q), data_of(r, ATTN_TENSOR_K),
                     data_of(r, ATTN_TENSOR_V), data_of(r, ATTN_TENSOR_O), r->lse,
                     data_of(r, ATTN_TENSOR_DO), data_of(r, ATTN_TENSOR_DQ),
                     data_of(r, ATTN_TENSOR_DK), data_of(r, ATTN_TENSOR_DV), ws.ptr, ws.bytes,
                     NULL);
  free(ws.block);
  check_status(r, st, "attn_backward");
  check_inputs_unchanged(r, "attn_backward");
  if (memcmp(lse_copy, r->lse, r->lse_n * sizeof(float)) != 0 ||
      memcmp(o_copy, r->buf[o_buf].data, r->buf[o_buf].n * tu_dtype_size(r->c->dtype)) != 0)
    fail_case(r, "attn_backward changed its inputs O or LSE");
  free(lse_copy);
  free(o_copy);

  ref_backward(&r->rp, mirror_of(r, ATTN_TENSOR_Q), mirror_of(r, ATTN_TENSOR_K),
               mirror_of(r, ATTN_TENSOR_V), mirror_of(r, ATTN_TENSOR_DO),
               r->ref[r->t[ATTN_TENSOR_DQ].buf] + r->t[ATTN_TENSOR_DQ].origin,
               r->ref[r->t[ATTN_TENSOR_DK].buf] + r->t[ATTN_TENSOR_DK].origin,
               r->ref[r->t[ATTN_TENSOR_DV].buf] + r->t[ATTN_TENSOR_DV].origin);
  ref_lowp_backward(&r->rp, r->c->dtype, mirror_of(r, ATTN_TENSOR_Q), mirror_of(r, ATTN_TENSOR_K),
                    mirror_of(r, ATTN_TENSOR_V), mirror_of(r, ATTN_TENSOR_DO),
                    r->lowp[r->t[ATTN_TENSOR_DQ].buf] + r->t[ATTN_TENSOR_DQ].origin,
                    r->lowp[r->t[ATTN_TENSOR_DK].buf] + r->t[ATTN_TENSOR_DK].origin,
                    r->lowp[r->t[ATTN_TENSOR_DV].buf] + r->t[ATTN_TENSOR_DV].origin);

  o_error_floor(r, floor);
  for (i = 0; i < 3; ++i) {
    compare_tensor(r, grads[i], &lib[i], &lowp[i]);
    if (lib[i].max_ref > magnitude) magnitude = lib[i].max_ref;
  }
  if (pairs > 0 && lib[2].max_ref == 0.0)
    fail_case(r, "harness error: the reference dV is all zero");
  for (i = 0; i < 3; ++i)
    judge(r, &lib[i], &lowp[i], atol_scale(r->c->dtype, r->zmax) * magnitude + 2.0 * floor[i]);
  check_unreached_zero(r, ATTN_TENSOR_DQ);
  check_unreached_zero(r, ATTN_TENSOR_DK);
  check_unreached_zero(r, ATTN_TENSOR_DV);
  check_gaps(r, ATTN_TENSOR_DQ, ATTN_TENSOR_DV);
  check_backward_repeats(r, plan, rng);
}

static void free_run(run *r) {
  int i;
  for (i = 0; i < NT; ++i) {
    tu_buffer_free(&r->buf[i]);
    free(r->owner[i]);
    free(r->ref[i]);
    free(r->lowp[i]);
  }
  free(r->cu_q32);
  free(r->cu_kv32);
  free(r->cu_q);
  free(r->cu_kv);
  free(r->lse);
  free(r->lse_ref);
  free(r->lse_lowp);
  free(r->moba_pair);
  free(r->kept[0].block);
  free(r->kept[1].block);
}

/* The rest of attn_plan_describe (the pairs are checked by the caller):
 * FLOPs, bytes and workspaces by attn.h's formulas from the plan's own
 * visible_pairs and shape, the backend, the passes, the block sizes, the
 * names MoBA plans get; and attn_plan_summary. */
static void check_report(run *r, attn_plan_t plan, const attn_plan_info_t *info) {
  const nc_case *c = r->c;
  const double es = (double)tu_dtype_size(c->dtype);
  const double q = (double)(r->cu_q[c->batch] * c->heads_q);   /* query rows, all heads */
  const double kv = (double)(r->cu_kv[c->batch] * c->heads_kv); /* key rows, all heads */
  const double dqk = (double)c->dqk, dv = (double)c->dv;
  const double flops = 4.0 * (double)info->visible_pairs * (dqk + dv) / 2.0;
  const double bytes_fwd = es * (q * dqk + kv * dqk + kv * dv + q * dv) + 4.0 * q;
  const double bytes_bwd = 2.0 * es * (q * dqk + kv * dqk + kv * dv) + 2.0 * es * q * dv + 4.0 * q;
  const int64_t lk = r->seqlen_kv;
  const int keeps_all = c->moba_block > 0 &&
                        c->moba_top_k >= (lk + c->moba_block - 1) / c->moba_block - 1;
  const size_t algo_len = strlen(info->algorithm);
  static const char kEvery[] = "moba-keeps-every-block:", kKept[] = "+kept-selection";
  size_t ws_f = 0, ws_b = 0, needed = 0;
  char *line;
#define NEAR(a, b) (fabs((a) - (b)) <= 1e-12 * fabs(b))
  if (info->backend != ATTN_BACKEND_CPU || info->dtype != (int32_t)c->dtype)
    fail_case(r, "attn_plan_describe: backend %d dtype %d", info->backend, info->dtype);
  if (!NEAR(info->flops_forward, flops) || !NEAR(info->flops_backward, 2.5 * flops))
    fail_case(r, "attn_plan_describe: flops %.17g / %.17g, attn.h's formula gives %.17g / %.17g",
              info->flops_forward, info->flops_backward, flops, 2.5 * flops);
  if (!NEAR(info->bytes_forward, bytes_fwd) || !NEAR(info->bytes_backward, bytes_bwd))
    fail_case(r, "attn_plan_describe: bytes %.17g / %.17g, attn.h's formula gives %.17g / %.17g",
              info->bytes_forward, info->bytes_backward, bytes_fwd, bytes_bwd);
#undef NEAR
  check_status(r, attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_f),
               "attn_plan_workspace_size");
  if (c->backward)
    check_status(r, attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &ws_b),
                 "attn_plan_workspace_size");
  if (info->workspace_bytes_forward != ws_f || info->workspace_bytes_backward != ws_b ||
      info->supports_backward != c->backward)
    fail_case(r, "attn_plan_describe: workspaces %llu / %llu (attn_plan_workspace_size: %zu / %zu), "
              "supports_backward %d", (unsigned long long)info->workspace_bytes_forward,
              (unsigned long long)info->workspace_bytes_backward, ws_f, ws_b,
              info->supports_backward);
  if (info->num_threads < 1 || (c->threads >= 0 && info->num_threads > (c->threads > 0 ? c->threads : 1)))
    fail_case(r, "attn_plan_describe: num_threads %d of a context of %d", info->num_threads,
              c->threads);
  if ((c->block_mask != NULL) != (info->block_q > 0 && info->block_kv > 0) ||
      (c->block_mask == NULL && (info->block_q != 0 || info->block_kv != 0)))
    fail_case(r, "attn_plan_describe: block sizes %d x %d", info->block_q, info->block_kv);
  if (strncmp(info->kernel, "cpu-", 4) != 0)
    fail_case(r, "attn_plan_describe: kernel \"%s\"", info->kernel);
  /* attn_plan_desc_set_moba: a top_k covering every past block is the
   * dense causal plan; attn_plan_desc_set_moba_keep_selection: a kept
   * selection is named, where there is one */
  if (keeps_all != (strncmp(info->algorithm, kEvery, sizeof kEvery - 1) == 0) ||
      (c->moba_keep && c->moba_block > 0 && !keeps_all) !=
          (algo_len >= sizeof kKept - 1 &&
           strcmp(info->algorithm + algo_len - (sizeof kKept - 1), kKept) == 0))
    fail_case(r, "attn_plan_describe: algorithm \"%s\"", info->algorithm);
  check_status(r, attn_plan_summary(plan, NULL, 0, &needed), "attn_plan_summary");
  if (needed < 2) fail_case(r, "attn_plan_summary needs %zu bytes", needed);
  line = (char *)xcalloc(needed, 1);
  check_status(r, attn_plan_summary(plan, line, needed, NULL), "attn_plan_summary");
  if (strlen(line) + 1 != needed)
    fail_case(r, "attn_plan_summary wrote %zu characters, said %zu bytes", strlen(line), needed);
  free(line);
}

/* nc_run, and nc_run_outcome when out is not NULL. */
static void run_case(const nc_case *c, nc_outcome *out) {
  run r;
  tu_rng rng = tu_rng_for(c->name);
  attn_context_t ctx = NULL;
  attn_plan_t plan = NULL;
  int64_t pairs = 0;
  /* The reference needs whole GQA groups; a spoilt description would not
   * run what it checks. */
  const int whole_groups = c->heads_q % c->heads_kv == 0;
  const int checkable = whole_groups && c->bad_tensor == 0 && c->bad_varlen == 0;

  memset(&r, 0, sizeof r);
  r.c = c;
  setup_shape(&r);
  if (!checkable) r.rp.pair_mask = NULL; /* its indexing would not hold */
  describe_case(&r);
  setup_geometry(&r, &rng);
  fill_inputs(&r, &rng);
  if (c->moba_block > 0 && checkable) {
    r.moba_pair = (unsigned char *)xcalloc((size_t)(c->batch * c->heads_q) *
                                               (size_t)(r.seqlen_q * r.seqlen_kv), 1);
    ref_moba_select(&r.rp, mirror_of(&r, ATTN_TENSOR_Q), mirror_of(&r, ATTN_TENSOR_K),
                    c->moba_block, c->moba_top_k, c->moba_shared, r.moba_pair);
    r.rp.pair_mask = r.moba_pair;
    r.rp.pair_mask_batch = c->batch;
    r.rp.pair_mask_heads = c->heads_q;
    r.rp.pair_mask_rows = r.seqlen_q; /* the longest sequence's (varlen) */
    r.rp.pair_mask_cols = r.seqlen_kv;
  }
  if (whole_groups) r.empty_rows = count_empty_rows(&r);
  if (out != NULL) {
    memset(out, 0, sizeof *out);
    out->empty_rows = r.empty_rows;
  }

  check_status(&r,
               attn_context_create(ATTN_BACKEND_CPU, 0,
                                   c->threads > 0 ? c->threads : c->threads < 0 ? 0 : 1, &ctx),
               "attn_context_create");
  plan = make_plan(&r, ctx, out);
  attn_context_destroy(ctx);
  if (plan == NULL) { /* refused, for the caller to judge */
    free_run(&r);
    return;
  }
  if (!checkable)
    fail_case(&r, "attn_plan_create accepted a problem the reference cannot check (%s)",
              !whole_groups ? "heads_q not a multiple of heads_kv" : "a spoilt description");
  pairs = count_visible_pairs(&r);
  r.zmax = ref_logit_error_scale(&r.rp, mirror_of(&r, ATTN_TENSOR_Q), mirror_of(&r, ATTN_TENSOR_K));
  {
    attn_plan_info_t info;
    uint64_t visited, total;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    check_status(&r, attn_plan_describe(plan, &info), "attn_plan_describe");
    /* MoBA's count is an upper bound, unless it keeps every block */
    if (c->moba_block > 0 && strncmp(info.algorithm, "moba-keeps-every-block:", 23) != 0
            ? info.visible_pairs < (uint64_t)pairs
            : info.visible_pairs != (uint64_t)pairs)
      fail_case(&r, "attn_plan_describe: visible_pairs %llu, the reference counts %lld",
                (unsigned long long)info.visible_pairs, (long long)pairs);
    if (info.tile_q < 1 || info.tile_kv < 1)
      fail_case(&r, "attn_plan_describe: tile sizes %d x %d", info.tile_q, info.tile_kv);
    count_tile_pairs(&r, info.tile_q, info.tile_kv, &visited, &total);
    /* MoBA's count is an upper bound: the selection depends on the data. */
    if (info.total_tile_pairs != total ||
        (c->moba_block > 0 ? info.visited_tile_pairs < visited || info.visited_tile_pairs > total
                           : info.visited_tile_pairs != visited))
      fail_case(&r, "attn_plan_describe: visited_tile_pairs %llu of total_tile_pairs %llu, "
                "the reference counts %llu of %llu (tiles %d x %d)",
                (unsigned long long)info.visited_tile_pairs,
                (unsigned long long)info.total_tile_pairs, (unsigned long long)visited,
                (unsigned long long)total, info.tile_q, info.tile_kv);
    check_report(&r, plan, &info);
  }

  run_forward(&r, plan, &rng, pairs);
  if (c->backward) run_backward(&r, plan, &rng, pairs);
  attn_plan_destroy(plan);

  printf("  %-34s%s (empty rows %lld, max |logit| %.3g)\n", c->name, r.summary,
         (long long)r.empty_rows, r.zmax);
  if (strncmp(c->name, "random_", 7) == 0) printf("    [%s]\n", r.desc);
  fflush(stdout);
  free_run(&r);
}

void nc_run(const nc_case *c) { run_case(c, NULL); }

void nc_run_outcome(const nc_case *c, nc_outcome *out) { run_case(c, out); }

/* ------------------------------------------------------------------------ */
/* Entry points                                                              */
/* ------------------------------------------------------------------------ */

/* Whether this CPU has what the library's `isa` kernels need (the features
 * src/cpu/cpu_backend.cpp checks); -1 for a name this test does not know. */
static int cpu_runs_isa(const char *isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (strcmp(isa, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (strcmp(isa, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return -1;
#else
  (void)isa;
  return -1;
#endif
}

int nc_isa_gate(void) {
  const char *isa = getenv("ATTN_CPU_ISA");
  attn_context_t ctx = NULL;
  attn_plan_desc_t d = NULL;
  attn_plan_t plan = NULL;
  attn_plan_info_t info;
  attn_status_t st;
  int rc = 0;

  tu_seed(); /* print it up front */
  if (attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx) != ATTN_STATUS_SUCCESS ||
      attn_plan_desc_create(&d) != ATTN_STATUS_SUCCESS ||
      attn_plan_desc_set_shape(d, 1, 1, 1, 1, 1, 8, 8) != ATTN_STATUS_SUCCESS) {
    fprintf(stderr, "isa gate: setup failed: %s\n", attn_last_error_message());
    return 1;
  }
  st = attn_plan_create(ctx, d, &plan);
  if (st == ATTN_STATUS_NOT_SUPPORTED && isa != NULL && isa[0] != '\0' && cpu_runs_isa(isa) == 1) {
    /* (The build registers these tests where it builds the variants.) */
    fprintf(stderr, "isa gate: this CPU runs the %s kernels, but the library refuses them: %s\n",
            isa, attn_last_error_message());
    rc = 1;
  } else if (st == ATTN_STATUS_NOT_SUPPORTED && isa != NULL && isa[0] != '\0') {
    printf("SKIP: ATTN_CPU_ISA=%s is not available here: %s\n", isa, attn_last_error_message());
    rc = 77;
  } else if (st != ATTN_STATUS_SUCCESS) {
    fprintf(stderr, "isa gate: attn_plan_create returned %s: %s\n", attn_status_string(st),
            attn_last_error_message());
    rc = 1;
  } else {
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (attn_plan_describe(plan, &info) != ATTN_STATUS_SUCCESS) {
      fprintf(stderr, "isa gate: attn_plan_describe failed: %s\n", attn_last_error_message());
      rc = 1;
    } else if (isa != NULL && isa[0] != '\0' &&
               (strncmp(info.kernel, "cpu-", 4) != 0 || strcmp(info.kernel + 4, isa) != 0)) {
      fprintf(stderr, "isa gate: ATTN_CPU_ISA=%s but the plan runs kernel %s\n", isa, info.kernel);
      rc = 1;
    } else {
      printf("kernel: %s\n", info.kernel);
    }
  }
  attn_plan_destroy(plan);
  attn_plan_desc_destroy(d);
  attn_context_destroy(ctx);
  return rc;
}

static void cmocka_case(void **state) { nc_run((const nc_case *)*state); }

/* Storage of one random case. */
typedef struct random_case {
  nc_case c;
  char name[32];
  int32_t lens_q[4], lens_kv[4];
} random_case;

static int64_t pick(tu_rng *rng, const int64_t *values, size_t n) {
  return values[tu_rng_int(rng, 0, (int64_t)n - 1)];
}

/* A length in 1..max_len, short ones (up to 8) a fifth of the time. */
static int64_t random_length(tu_rng *rng, int64_t max_len) {
  return tu_rng_int(rng, 0, 4) == 0 ? tu_rng_int(rng, 1, 8) : tu_rng_int(rng, 1, max_len);
}

static void random_case_draw(tu_rng *rng, int index, int64_t max_len, int backward,
                             random_case *rc) {
  static const int64_t dims[] = {1, 3, 7, 8, 16, 24, 32, 40, 64, 72, 80, 96, 128};
  static const int64_t groups[] = {1, 1, 2, 4};
  nc_case *c = &rc->c;
  int64_t b, lq_max = 0, lk_max = 0, cost;
  const int varlen = tu_rng_int(rng, 0, 2) == 0;

  memset(rc, 0, sizeof *rc);
  snprintf(rc->name, sizeof rc->name, "random_%02d", index);
  c->name = rc->name;
  c->dtype = (attn_dtype_t)tu_rng_int(rng, 0, 2);
  c->layout = tu_rng_int(rng, 0, 1) ? ATTN_LAYOUT_BHSD : ATTN_LAYOUT_BSHD;
  c->heads_kv = tu_rng_int(rng, 1, 3);
  c->heads_q = c->heads_kv * pick(rng, groups, sizeof groups / sizeof groups[0]);
  c->dqk = pick(rng, dims, sizeof dims / sizeof dims[0]);
  c->dv = tu_rng_int(rng, 0, 1) ? c->dqk : pick(rng, dims, sizeof dims / sizeof dims[0]);
  c->strides = (nc_strides)tu_rng_int(rng, 0, 4);
  if (c->strides == NC_STRIDES_PACKED) c->dv = c->dqk;
  if (c->strides == NC_STRIDES_BROADCAST_KV && varlen) c->strides = NC_STRIDES_SHUFFLED;
  if (varlen) {
    c->batch = tu_rng_int(rng, 1, 4);
    for (b = 0; b < c->batch; ++b) {
      /* empty sequences a sixth of the time */
      rc->lens_q[b] = tu_rng_int(rng, 0, 5) == 0 ? 0 : (int32_t)random_length(rng, max_len);
      rc->lens_kv[b] = tu_rng_int(rng, 0, 5) == 0 ? 0 : (int32_t)random_length(rng, max_len);
      if (c->strides == NC_STRIDES_PACKED) rc->lens_kv[b] = rc->lens_q[b];
    }
    if (rc->lens_q[0] == 0) rc->lens_q[0] = 1; /* some work in every case */
    if (rc->lens_kv[0] == 0) rc->lens_kv[0] = rc->lens_q[0];
    c->lens_q = rc->lens_q;
    c->lens_kv = rc->lens_kv;
    for (b = 0; b < c->batch; ++b) {
      if (rc->lens_q[b] > lq_max) lq_max = rc->lens_q[b];
      if (rc->lens_kv[b] > lk_max) lk_max = rc->lens_kv[b];
    }
  } else {
    c->batch = tu_rng_int(rng, 1, 2);
    c->seqlen_q = lq_max = random_length(rng, max_len);
    c->seqlen_kv = lk_max =
        c->strides == NC_STRIDES_PACKED ? c->seqlen_q : random_length(rng, max_len);
  }
  c->mask = (attn_mask_t)tu_rng_int(rng, 0, 2);
  if (c->mask == ATTN_MASK_WINDOW) {
    c->left = tu_rng_int(rng, 0, 3) == 0 ? -1 : tu_rng_int(rng, 0, lk_max + 4);
    c->right = tu_rng_int(rng, 0, 3) == 0 ? -1 : tu_rng_int(rng, 0, 8);
  }
  if (tu_rng_int(rng, 0, 3) == 0) c->softcap = (float)tu_rng_uniform(rng, 2.0, 30.0);
  if (tu_rng_int(rng, 0, 3) == 0) c->scale = (float)tu_rng_uniform(rng, 0.05, 2.0);
  if (tu_rng_int(rng, 0, 4) == 0) c->qk_sd = 2.5;
  if (tu_rng_int(rng, 0, 4) == 0) c->logit_trend = tu_rng_int(rng, 0, 1) ? 1 : -1;
  c->threads = (int)tu_rng_int(rng, 1, 2);
  c->backward = backward;

  /* Keep the reference's cost (pairs x dims x heads) bounded: fewer heads. */
  cost = c->batch * lq_max * lk_max * (c->dqk + c->dv);
  while (cost * c->heads_q > 12000000 && c->heads_q > 1) {
    if (c->heads_q > c->heads_kv)
      c->heads_q /= 2; /* group 4 -> 2 -> 1 */
    else
      c->heads_q = c->heads_kv = 1;
  }
}

int nc_run_group(const char *group, const nc_case *cases, size_t n, int random, int64_t max_len,
                 int backward) {
  const size_t total = n + (size_t)random;
  struct CMUnitTest *tests = (struct CMUnitTest *)xcalloc(total, sizeof *tests);
  random_case *extra = (random_case *)xcalloc((size_t)random, sizeof *extra);
  char label[64];
  tu_rng rng;
  size_t i;
  int failed;
  snprintf(label, sizeof label, "%s/random-cases", group);
  rng = tu_rng_for(label);
  for (i = 0; i < (size_t)random; ++i) random_case_draw(&rng, (int)i, max_len, backward, &extra[i]);
  for (i = 0; i < total; ++i) {
    const nc_case *c = i < n ? &cases[i] : &extra[i - n].c;
    tests[i].name = c->name;
    tests[i].test_func = cmocka_case;
    tests[i].initial_state = (void *)c;
  }
  failed = _cmocka_run_group_tests(group, tests, total, NULL, NULL);
  free(tests);
  free(extra);
  return failed;
}
