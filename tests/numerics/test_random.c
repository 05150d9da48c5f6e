/*
 * Randomized differential test of the CPU backend against the fp64
 * reference. Each case is a small problem drawn from the seed that combines
 * the features of the public API at random: dtype, batch, GQA ratio,
 * seqlen_q != seqlen_kv, varlen batches (with empty sequences), head dims
 * (dqk != dv), masks and windows at their boundaries, softcap, scale,
 * layouts and strides, block masks (FlexAttention tables, dense matrices
 * and the pattern builders composed with each other and with the plan's
 * mask), MoBA (block size, top_k, per head or per group, kept selection),
 * allowed or refused empty rows, deterministic plans, threads, LSE or none,
 * reused plan descriptors, forward and backward. The numerics harness
 * (harness.h) then checks O, LSE, dQ, dK and dV against the reference with
 * its tolerance rule and its exact checks (empty rows, unseen keys,
 * untouched gaps and inputs, determinism, attn_plan_describe's pairs, tile
 * pairs, FLOPs and bytes); a block mask is also read back first.
 *
 * Some cases also combine what attn.h says plan creation refuses (MoBA with
 * a block mask or another mask, a block mask of the wrong size,
 * keep_selection without MoBA or without a backward pass, heads_q not a multiple of heads_kv, a layout other than
 * THD named with a varlen batch, varlen offsets that do not fit the shape,
 * a spoilt tensor descriptor, empty rows not allowed). Every case
 * predicts from attn.h whether plan creation must succeed and, if not,
 * which statuses it may return; a refusal attn.h does not document, an
 * acceptance of what it refuses, a status outside the documented ones or an
 * empty error message fails the case.
 *
 * Environment:
 *   ATTN_TEST_SEED=<n>      the seed (printed first); case i depends only on
 *                           the seed and i
 *   ATTN_RANDOM_CASES=<n>   how many cases (default kDefaultCases)
 *   ATTN_RANDOM_CASE=<i>    run case i alone (as a failure names it)
 * Run once per CPU kernel variant (ATTN_CPU_ISA).
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

#include "harness.h"
#include "sparse_patterns.h"
#include "testutil.h"

/* About 20 s per kernel variant in a release build on two busy cores, well
 * under a minute with ASan and UBSan (debugoptimized). */
enum { kDefaultCases = 600 };

enum { MAX_BATCH = 6, MAX_OPS = 4 };

/* ------------------------------------------------------------------------ */
/* Cases                                                                     */
/* ------------------------------------------------------------------------ */

typedef enum family { DENSE, SPARSE, MOBA } family;

/* How a block mask is built, one step at a time (each on every slot of the
 * mask except the tables, which are drawn per slot). */
typedef enum op_kind {
  OP_TABLES,        /* attn_block_mask_set_blocks: replaces the contents; a: which tables
                       (TABLES_*), b: row slots beyond the longest row */
  OP_DEVICE_TABLES, /* attn_block_mask_set_device_blocks with the CPU context: the same */
  OP_DENSE,         /* attn_block_mask_add_dense */
  OP_WINDOW,        /* attn_block_mask_add_window(a, b) */
  OP_KEYS,          /* attn_block_mask_add_global_keys, a positions */
  OP_QUERIES,       /* attn_block_mask_add_global_queries, a positions */
  OP_STRIDED,       /* attn_block_mask_add_strided(a) */
  OP_RANDOM,        /* attn_block_mask_add_random_blocks(a, seed) */
  OP_DOCUMENTS      /* attn_block_mask_and_documents, runs up to a tokens; b: DOCS_* */
} op_kind;

/* Document ids: a padding query (id -1, which no key has); runs named by
 * ids from a few values, the int32 extremes among them, so that runs far
 * apart may share a document. */
enum { DOCS_PADDING = 1, DOCS_ANY_IDS = 2 };

/* Which tables the tables steps pass. */
enum { TABLES_BOTH = 0, TABLES_PARTIAL_ONLY = 1, TABLES_FULL_ONLY = 2 };

static const char *const kOpName[] = {"tables",  "device-tables", "dense",  "window",   "keys",
                                      "queries", "strided",       "random", "documents"};

typedef struct mask_op {
  op_kind kind;
  int64_t a, b;
  uint64_t seed; /* the data the step draws (tables, positions, ids) */
  sp_draw_opts opts;
} mask_op;

typedef struct gen_case {
  nc_case c;
  char name[32];
  family fam;
  int32_t lens_q[MAX_BATCH], lens_kv[MAX_BATCH];
  /* the block mask: its geometry (which may differ from the plan's when a
   * refusal is drawn) and how it is built */
  sp_geom g;
  int nops;
  mask_op ops[MAX_OPS];
} gen_case;

static int64_t pick(tu_rng *rng, const int64_t *values, size_t n) {
  return values[tu_rng_int(rng, 0, (int64_t)n - 1)];
}
#define PICK(rng, array) pick((rng), (array), sizeof(array) / sizeof((array)[0]))

static int chance(tu_rng *rng, double p) { return tu_rng_uniform(rng, 0.0, 1.0) < p; }

/* A sequence length: tiny ones (0 among them), the edges of the CPU
 * kernels' 96-row tiles, or any up to max. */
static int64_t draw_len(tu_rng *rng, int64_t max, int allow_zero) {
  static const int64_t edges[] = {95, 96, 97, 191, 192, 193};
  const double u = tu_rng_uniform(rng, 0.0, 1.0);
  int64_t n;
  if (u < 0.15)
    n = tu_rng_int(rng, allow_zero ? 0 : 1, 4);
  else if (u < 0.3)
    n = PICK(rng, edges);
  else
    n = tu_rng_int(rng, 1, max);
  return n > max ? max : n;
}

/* A window reach for a sequence of lq queries and lk keys: unbounded, 0,
 * small, around the distances that make rows empty or full, around the
 * tile, or far beyond every sequence (where the library's own clamp to
 * "unbounded" starts, and INT64_MAX). */
static int64_t draw_reach(tu_rng *rng, int64_t lq, int64_t lk) {
  const int64_t d = lk > lq ? lk - lq : lq - lk;
  const int64_t edges[] = {d - 1, d, d + 1, lk - 1, lk, lq + lk - 1, lq + lk, lq + lk + 1,
                           95, 96, 97};
  const double u = tu_rng_uniform(rng, 0.0, 1.0);
  int64_t r;
  if (u < 0.2) return -1;
  if (u < 0.35) return 0;
  if (u < 0.55) return tu_rng_int(rng, 1, 8);
  if (u < 0.8) {
    r = PICK(rng, edges);
    return r < 0 ? 0 : r;
  }
  if (u < 0.95) return tu_rng_int(rng, 0, lq + lk + 2);
  return chance(rng, 0.5) ? INT64_MAX : (int64_t)1 << 40;
}

/* Reference work of a case, roughly in multiply-adds. */
static double cost(const gen_case *gc) {
  const nc_case *c = &gc->c;
  double pairs = 0.0;
  int64_t b;
  for (b = 0; b < c->batch; ++b)
    pairs += c->lens_q != NULL ? (double)gc->lens_q[b] * (double)gc->lens_kv[b]
                               : (double)c->seqlen_q * (double)c->seqlen_kv;
  return pairs * (double)c->heads_q * (double)(c->dqk + c->dv) * (c->backward ? 3.0 : 1.0);
}

static void shrink_lengths(gen_case *gc) {
  nc_case *c = &gc->c;
  int64_t b;
  if (c->lens_q != NULL) {
    for (b = 0; b < c->batch; ++b) {
      gc->lens_q[b] /= 2;
      gc->lens_kv[b] = c->strides == NC_STRIDES_PACKED ? gc->lens_q[b] : gc->lens_kv[b] / 2;
    }
  } else if (c->seqlen_q >= c->seqlen_kv) {
    c->seqlen_q /= 2;
    if (c->strides == NC_STRIDES_PACKED) c->seqlen_kv = c->seqlen_q;
  } else {
    c->seqlen_kv /= 2;
  }
}

static int64_t longest(const gen_case *gc) {
  const nc_case *c = &gc->c;
  int64_t b, n = c->seqlen_q > c->seqlen_kv ? c->seqlen_q : c->seqlen_kv;
  for (b = 0; c->lens_q != NULL && b < c->batch; ++b) {
    if (gc->lens_q[b] > n) n = gc->lens_q[b];
    if (gc->lens_kv[b] > n) n = gc->lens_kv[b];
  }
  return n;
}

/* Keeps a case within the reference's budget: sequences down to
 * keep_len, then fewer heads and sequences, then shorter ones. Heads stay a
 * whole GQA group unless a refusal drew them otherwise. */
static void fit_budget(gen_case *gc, double budget, int64_t keep_len) {
  nc_case *c = &gc->c;
  while (cost(gc) > budget) {
    if (longest(gc) > keep_len)
      shrink_lengths(gc);
    else if (c->heads_q % c->heads_kv == 0 && c->heads_q > c->heads_kv)
      c->heads_q -= c->heads_kv;
    else if (c->heads_q % c->heads_kv == 0 && c->heads_kv > 1)
      c->heads_q /= c->heads_kv, c->heads_kv = 1;
    else if (c->batch > 1)
      --c->batch;
    else
      shrink_lengths(gc);
  }
}

/* The refusals a case may be drawn with (attn.h documents each). */
typedef enum violation {
  V_NONE,
  V_HEADS,              /* heads_q % heads_kv != 0: INVALID_ARGUMENT */
  V_VARLEN_LAYOUT,      /* BSHD or BHSD named with a varlen batch: INVALID_ARGUMENT */
  V_SPARSE_GEOMETRY,    /* block mask of another batch, heads or lengths: INVALID_ARGUMENT */
  V_MOBA_SPARSE,        /* MoBA + block mask: NOT_SUPPORTED */
  V_MOBA_MASK,          /* MoBA without the causal mask: INVALID_ARGUMENT */
  V_KEEP_NO_MOBA,       /* keep_selection without MoBA: INVALID_ARGUMENT */
  V_KEEP_FORWARD_ONLY,  /* keep_selection without a backward pass: INVALID_ARGUMENT */
  V_TENSOR,             /* a tensor descriptor of another dtype or dims, a head_dim stride
                           other than 1, an output overlapping itself: INVALID_ARGUMENT */
  V_VARLEN_SHAPE,       /* varlen offsets for another batch, or seqlen_q not the longest
                           sequence: INVALID_ARGUMENT */
  V_COUNT
} violation;

static void draw_mask_ops(gen_case *gc, tu_rng *rng) {
  const sp_geom *g = &gc->g;
  int k;
  gc->nops = chance(rng, 0.03) ? 0 : (int)tu_rng_int(rng, 1, MAX_OPS);
  for (k = 0; k < gc->nops; ++k) {
    mask_op *op = &gc->ops[k];
    const double u = tu_rng_uniform(rng, 0.0, 1.0);
    memset(op, 0, sizeof *op);
    op->seed = tu_rng_next(rng);
    if (u < 0.15)
      op->kind = OP_TABLES;
    else if (u < 0.2)
      op->kind = OP_DEVICE_TABLES;
    else if (u < 0.33)
      op->kind = OP_DENSE;
    else if (u < 0.53)
      op->kind = OP_WINDOW;
    else if (u < 0.65)
      op->kind = OP_KEYS;
    else if (u < 0.72)
      op->kind = OP_QUERIES;
    else if (u < 0.81)
      op->kind = OP_STRIDED;
    else if (u < 0.9)
      op->kind = OP_RANDOM;
    else
      op->kind = OP_DOCUMENTS;
    switch (op->kind) {
      case OP_TABLES:
      case OP_DEVICE_TABLES:
      case OP_DENSE:
        op->a = tu_rng_int(rng, 0, 3) == 0 ? tu_rng_int(rng, 1, 2) : TABLES_BOTH;
        op->b = chance(rng, 0.5) ? tu_rng_int(rng, 0, 3) : -1; /* -1: every key block */
        op->opts.p_none = tu_rng_uniform(rng, 0.0, 0.9);
        op->opts.no_bits = chance(rng, 0.15);
        op->opts.corner_bits = chance(rng, 0.25);
        op->opts.empty_block0 = chance(rng, 0.1);
        break;
      case OP_WINDOW:
        op->a = draw_reach(rng, g->lq, g->lk);
        op->b = draw_reach(rng, g->lq, g->lk);
        break;
      case OP_KEYS: op->a = g->lk > 0 ? tu_rng_int(rng, 0, 9) : 0; break;
      case OP_QUERIES: op->a = g->lq > 0 ? tu_rng_int(rng, 0, 3) : 0; break;
      case OP_STRIDED: op->a = tu_rng_int(rng, 1, g->lk + 2); break;
      case OP_RANDOM:
        op->a = tu_rng_int(rng, 0, chance(rng, 0.3) || sp_kv_blocks(g) < 3 ? sp_kv_blocks(g) : 3);
        break;
      case OP_DOCUMENTS:
        op->a = tu_rng_int(rng, 1, (g->lq > g->lk ? g->lq : g->lk) + 1);
        op->b = (chance(rng, 0.3) ? DOCS_PADDING : 0) | (chance(rng, 0.3) ? DOCS_ANY_IDS : 0);
        break;
    }
  }
}

/* Block sizes: small, around the kernels' 96-row tiles, beyond the
 * sequences. A bit tile holds bq x bk bits, each drawn by the test: blocks
 * beyond the sequences on one side only. */
static void draw_blocks(tu_rng *rng, sp_geom *g) {
  static const int64_t blocks[] = {1,  2,  3,  5,   8,   13,  16,  24,   32,
                                   48, 64, 96, 100, 128, 200, 256, 1000, 65536};
  static const int64_t small[] = {1, 2, 3, 5, 8, 13, 16, 24, 32, 48, 64};
  g->bq = PICK(rng, blocks);
  g->bk = PICK(rng, blocks);
  while (g->bq * g->bk > 16384) {
    if (g->bq > g->bk)
      g->bq = PICK(rng, small);
    else
      g->bk = PICK(rng, small);
  }
}

/* Whether a tensor has elements and a dim of extent > 1 besides head_dim:
 * whether a stride of 0 can make two of its elements meet. */
static int spans_elements(const gen_case *gc, int role) {
  const nc_case *c = &gc->c;
  const int q = role == ATTN_TENSOR_Q || role == ATTN_TENSOR_O || role == ATTN_TENSOR_DO ||
                role == ATTN_TENSOR_DQ;
  const int64_t heads = q ? c->heads_q : c->heads_kv;
  int64_t tokens = 0, b;
  if (c->lens_q == NULL) {
    const int64_t len = q ? c->seqlen_q : c->seqlen_kv;
    return len > 0 && (c->batch > 1 || heads > 1 || len > 1);
  }
  for (b = 0; b < c->batch; ++b) tokens += q ? gc->lens_q[b] : gc->lens_kv[b];
  return tokens > 0 && (tokens > 1 || heads > 1);
}

static void draw_case(int index, gen_case *gc) {
  static const int64_t dims[] = {1,  2,  3,  4,  7,  8,  9,  15, 16,  17,  24,  31,  32,  33,
                                 40, 48, 63, 64, 65, 72, 80, 96, 100, 127, 128, 129, 192, 256};
  static const int64_t big_dims[] = {384, 512, 1000, 1024};
  static const int64_t moba_pow2[] = {1, 2, 4, 8, 16, 32, 64, 128};
  static const int64_t moba_other[] = {3, 5, 7, 12, 48, 100};
  char label[48];
  tu_rng rng;
  nc_case *c = &gc->c;
  violation v = V_NONE;
  int64_t max_len;
  double u;
  int64_t b;

  snprintf(label, sizeof label, "random-case-%d", index);
  rng = tu_rng_for(label);
  memset(gc, 0, sizeof *gc);
  snprintf(gc->name, sizeof gc->name, "case_%05d", index);
  c->name = gc->name;

  u = tu_rng_uniform(&rng, 0.0, 1.0);
  gc->fam = u < 0.45 ? DENSE : u < 0.8 ? SPARSE : MOBA;
  if (chance(&rng, 0.12)) v = (violation)tu_rng_int(&rng, V_HEADS, V_COUNT - 1);
  /* a violation that needs another family brings it along */
  if (v == V_SPARSE_GEOMETRY) gc->fam = SPARSE;
  if (v == V_MOBA_SPARSE || v == V_MOBA_MASK || v == V_KEEP_FORWARD_ONLY)
    gc->fam = MOBA;
  if (v == V_VARLEN_LAYOUT || v == V_KEEP_NO_MOBA) gc->fam = chance(&rng, 0.5) ? DENSE : SPARSE;

  c->dtype = (attn_dtype_t)tu_rng_int(&rng, 0, 2);
  c->layout = chance(&rng, 0.5) ? ATTN_LAYOUT_BHSD : ATTN_LAYOUT_BSHD;
  c->threads = chance(&rng, 0.1) ? -1 : (int)tu_rng_int(&rng, 1, 3); /* -1: one per core */
  c->heads_kv = tu_rng_int(&rng, 1, 4);
  c->heads_q = c->heads_kv * tu_rng_int(&rng, 1, 4);
  if (v == V_HEADS) {
    c->heads_kv = tu_rng_int(&rng, 2, 3);
    c->heads_q = c->heads_kv * tu_rng_int(&rng, 0, 2) + tu_rng_int(&rng, 1, c->heads_kv - 1);
  }
  c->dqk = chance(&rng, 0.04) ? PICK(&rng, big_dims) : PICK(&rng, dims);
  c->dv = chance(&rng, 0.5) ? c->dqk : chance(&rng, 0.04) ? PICK(&rng, big_dims) : PICK(&rng, dims);
  c->strides = (nc_strides)tu_rng_int(&rng, 0, 6);
  c->reuse_desc = chance(&rng, 0.2);
  c->backward = chance(&rng, 0.5);
  c->no_lse = !c->backward && chance(&rng, 0.15);
  c->deterministic = chance(&rng, 0.25);
  /* rarely refused: a refusal for empty rows runs no numerics */
  u = tu_rng_uniform(&rng, 0.0, 1.0);
  c->empty_policy = u < 0.45 ? NC_EMPTY_AUTO : u < 0.88 ? NC_EMPTY_ALLOW : NC_EMPTY_DENY;
  max_len = chance(&rng, 0.1) ? 600 : 300;

  /* lengths: varlen batches for every family (a block mask is then given
   * for the longest sequence), or when a refusal needs one */
  if (v == V_VARLEN_SHAPE) gc->fam = DENSE;
  if ((v != V_MOBA_SPARSE && chance(&rng, 0.35)) || v == V_VARLEN_LAYOUT || v == V_VARLEN_SHAPE) {
    c->batch = tu_rng_int(&rng, 1, MAX_BATCH);
    for (b = 0; b < c->batch; ++b) {
      gc->lens_q[b] = chance(&rng, 0.15) ? 0 : (int32_t)draw_len(&rng, max_len, 0);
      gc->lens_kv[b] = chance(&rng, 0.15) ? 0 : (int32_t)draw_len(&rng, max_len, 0);
    }
    c->lens_q = gc->lens_q;
    c->lens_kv = gc->lens_kv;
    c->varlen_names_layout = chance(&rng, 0.2) || v == V_VARLEN_LAYOUT;
    if (c->varlen_names_layout && v != V_VARLEN_LAYOUT) c->layout = ATTN_LAYOUT_THD;
    if (c->strides == NC_STRIDES_BROADCAST_KV) c->strides = NC_STRIDES_SHUFFLED;
  } else {
    c->batch = tu_rng_int(&rng, 1, 4);
    c->seqlen_q = draw_len(&rng, max_len, 1);
    c->seqlen_kv = draw_len(&rng, max_len, 1);
  }
  if (c->strides == NC_STRIDES_PACKED) { /* one QKV buffer: the same tokens and dims */
    c->dv = c->dqk;
    c->seqlen_kv = c->seqlen_q;
    for (b = 0; b < c->batch; ++b) gc->lens_kv[b] = gc->lens_q[b];
  }
  /* long sequences with few heads, or many heads over short ones */
  fit_budget(gc, 6.0e6, chance(&rng, 0.5) ? 192 : 48);

  {
    int64_t lq = c->seqlen_q, lk = c->seqlen_kv;
    for (b = 0; c->lens_q != NULL && b < c->batch; ++b) {
      if (gc->lens_q[b] > lq) lq = gc->lens_q[b];
      if (gc->lens_kv[b] > lk) lk = gc->lens_kv[b];
    }
    c->mask = (attn_mask_t)tu_rng_int(&rng, 0, 2);
    if (c->mask == ATTN_MASK_WINDOW) {
      c->left = draw_reach(&rng, lq, lk);
      c->right = draw_reach(&rng, lq, lk);
    }
    gc->g.lq = lq, gc->g.lk = lk;
  }
  if (chance(&rng, 0.25)) {
    /* strong capping, the usual 3..50, or caps far above the logits (not
     * in fp16, where the yardstick's gradient times the cap overflows) */
    u = tu_rng_uniform(&rng, 0.0, 1.0);
    c->softcap = (float)(u < 0.25 ? tu_rng_uniform(&rng, 0.5, 3.0)
                         : u < 0.8 || c->dtype == ATTN_DTYPE_FP16
                             ? tu_rng_uniform(&rng, 3.0, 50.0)
                             : exp(tu_rng_uniform(&rng, log(50.0), log(1.0e4))));
  }
  if (chance(&rng, 0.3))
    c->scale = (float)(chance(&rng, 0.15) ? tu_rng_uniform(&rng, 2.0, 12.0)
                                          : tu_rng_uniform(&rng, 0.05, 2.0));
  if (chance(&rng, 0.15)) c->qk_sd = 2.5;
  if (chance(&rng, 0.15)) c->logit_trend = chance(&rng, 0.5) ? 1 : -1;

  if (gc->fam == SPARSE) {
    sp_geom *g = &gc->g;
    draw_blocks(&rng, g);
    g->batch = chance(&rng, 0.5) ? 1 : c->batch;
    g->heads = chance(&rng, 0.5) ? 1 : c->heads_kv;
    if (v == V_SPARSE_GEOMETRY) {
      switch (tu_rng_int(&rng, 0, 3)) {
        case 0: g->batch = c->batch + 1; break;
        case 1: g->heads = c->heads_kv + 1; break;
        case 2: g->lq += 1; break;
        default: g->lk += 1; break;
      }
    }
    draw_mask_ops(gc, &rng);
  }
  if (gc->fam == MOBA) {
    /* Q and K from {-2, -1, 1, 2}: with power-of-two blocks every gate is
     * exact in fp32, so the library picks the blocks the reference picks,
     * ties included; other block sizes only where no gate decides (top_k 0,
     * or every past block kept; varlen: blocks counted on the longest
     * sequence, as the plan does). */
    const int64_t lk = gc->g.lk > 0 ? gc->g.lk : 1;
    int64_t nb;
    c->qk_integers = 1;
    c->logit_trend = 0;
    c->qk_sd = 0.0;
    if (c->strides == NC_STRIDES_PACKED) c->strides = NC_STRIDES_PADDED;
    c->mask = ATTN_MASK_CAUSAL;
    if (v == V_MOBA_MASK) {
      c->mask = chance(&rng, 0.5) ? ATTN_MASK_NONE : ATTN_MASK_WINDOW;
      c->left = c->mask == ATTN_MASK_WINDOW ? draw_reach(&rng, gc->g.lq, lk) : 0;
      c->right = c->mask == ATTN_MASK_WINDOW ? draw_reach(&rng, gc->g.lq, lk) : 0;
    }
    c->moba_block = PICK(&rng, moba_pow2);
    nb = (lk + c->moba_block - 1) / c->moba_block;
    u = tu_rng_uniform(&rng, 0.0, 1.0);
    c->moba_top_k = u < 0.15 ? 0 : u < 0.75 ? tu_rng_int(&rng, 1, 4)
                                            : nb - tu_rng_int(&rng, 0, 2) + (chance(&rng, 0.2) ? 1000 : 0);
    if (c->moba_top_k < 0) c->moba_top_k = 0;
    if (chance(&rng, 0.2)) {
      c->moba_block = PICK(&rng, moba_other);
      nb = (lk + c->moba_block - 1) / c->moba_block;
      c->moba_top_k = chance(&rng, 0.5) ? 0 : nb - 1 + tu_rng_int(&rng, 0, 3);
    }
    c->moba_shared = chance(&rng, 0.5);
    c->moba_keep = c->backward && chance(&rng, 0.4);
    /* integers of magnitude ~1.6: logits of standard deviation 0.2 to 1.2 */
    c->scale = (float)(tu_rng_uniform(&rng, 0.2, 1.2) / (1.6 * sqrt((double)c->dqk)));
    if (v == V_KEEP_FORWARD_ONLY) c->backward = 0, c->no_lse = 0, c->moba_keep = 1;
    if (v == V_MOBA_SPARSE) {
      sp_geom *g = &gc->g;
      draw_blocks(&rng, g);
      g->batch = 1, g->heads = 1;
      draw_mask_ops(gc, &rng);
      gc->fam = SPARSE; /* built like any block mask; the MoBA fields stay */
    }
  }
  if (v == V_KEEP_NO_MOBA) c->moba_keep = 1;
  if (v == V_VARLEN_SHAPE) c->bad_varlen = c->batch > 1 && chance(&rng, 0.5) ? 1 : 2;
  if (v == V_TENSOR) {
    const int role = (int)tu_rng_int(&rng, ATTN_TENSOR_Q, ATTN_TENSOR_DV);
    const int output = role == ATTN_TENSOR_O || role >= ATTN_TENSOR_DQ;
    c->bad_tensor = 1 + role;
    c->bad_tensor_kind = (nc_bad_tensor)tu_rng_int(&rng, NC_BAD_DTYPE,
                                                   output ? NC_BAD_OVERLAP : NC_BAD_LAST_STRIDE);
    /* an overlap needs a dim of extent > 1 besides head_dim */
    if (c->bad_tensor_kind == NC_BAD_OVERLAP && !spans_elements(gc, role)) c->bad_tensor_kind = NC_BAD_DIMS;
  }
}

/* ------------------------------------------------------------------------ */
/* The block mask                                                            */
/* ------------------------------------------------------------------------ */

static void check_ok(attn_status_t st, const char *call) {
  if (st != ATTN_STATUS_SUCCESS)
    fail_msg("%s returned %s: %s", call, attn_status_string(st), attn_last_error_message());
}

/* Drawn tables laid out for attn_block_mask_set_blocks with rows of
 * max_p / max_f slots: the longest row plus `extra` (every key block when
 * extra < 0), unused slots junk. TABLES_PARTIAL_ONLY lists the full blocks
 * as partial ones with every bit set and passes no full tables;
 * TABLES_FULL_ONLY passes no partial tables, where no block is partial
 * (else both). */
typedef struct laid_out {
  int32_t *num_p, *idx_p, *num_f, *idx_f, max_p, max_f;
  uint8_t *bits;
} laid_out;

static void lay_out(const sp_geom *g, const sp_tables *t, int which, int64_t extra, int no_bits,
                    laid_out *o) {
  const int64_t rows = g->batch * g->heads * sp_q_blocks(g), nkb = sp_kv_blocks(g);
  const size_t tile = (size_t)ATTN_BLOCK_MASK_TILE_BYTES(g->bq, g->bk);
  int64_t k, e, longest_p = 0, longest_f = 0, any_partial = 0;
  memset(o, 0, sizeof *o);
  for (k = 0; k < rows; ++k) {
    const int64_t np = t->num_p[k] + (which == TABLES_PARTIAL_ONLY ? t->num_f[k] : 0);
    if (np > longest_p) longest_p = np;
    if (t->num_f[k] > longest_f) longest_f = t->num_f[k];
    any_partial += t->num_p[k];
  }
  if (which == TABLES_FULL_ONLY && any_partial > 0) which = TABLES_BOTH;
  o->max_p = (int32_t)(extra < 0 ? nkb : longest_p + extra);
  o->max_f = (int32_t)(extra < 0 ? nkb : longest_f + extra);
  if (o->max_p < 1) o->max_p = 1;
  if (o->max_f < 1) o->max_f = 1;
  if (which != TABLES_FULL_ONLY) {
    o->num_p = (int32_t *)calloc((size_t)rows + 1, sizeof(int32_t));
    o->idx_p = (int32_t *)calloc((size_t)(rows * o->max_p) + 1, sizeof(int32_t));
    o->bits = no_bits ? NULL : (uint8_t *)calloc((size_t)(rows * o->max_p) * tile + 1, 1);
    assert_true(o->num_p != NULL && o->idx_p != NULL && (no_bits || o->bits != NULL));
    for (e = 0; e < rows * o->max_p; ++e) o->idx_p[e] = -7;
    if (o->bits != NULL) memset(o->bits, 0x5A, (size_t)(rows * o->max_p) * tile);
  }
  if (which != TABLES_PARTIAL_ONLY) {
    o->num_f = (int32_t *)calloc((size_t)rows + 1, sizeof(int32_t));
    o->idx_f = (int32_t *)calloc((size_t)(rows * o->max_f) + 1, sizeof(int32_t));
    assert_true(o->num_f != NULL && o->idx_f != NULL);
    for (e = 0; e < rows * o->max_f; ++e) o->idx_f[e] = 1 << 30;
  }
  for (k = 0; k < rows; ++k) {
    for (e = 0; e < t->num_p[k] && o->num_p != NULL; ++e) {
      const int32_t slot = o->num_p[k]++;
      o->idx_p[k * o->max_p + slot] = t->idx_p[k * nkb + e];
      if (o->bits != NULL)
        memcpy(o->bits + (size_t)(k * o->max_p + slot) * tile, t->bits + (size_t)(k * nkb + e) * tile,
               tile);
    }
    for (e = 0; e < t->num_f[k]; ++e) {
      if (o->num_f != NULL) {
        o->idx_f[k * o->max_f + o->num_f[k]++] = t->idx_f[k * nkb + e];
      } else { /* a full block as a partial one with every bit */
        const int32_t slot = o->num_p[k]++;
        o->idx_p[k * o->max_p + slot] = t->idx_f[k * nkb + e];
        if (o->bits != NULL) memset(o->bits + (size_t)(k * o->max_p + slot) * tile, 0xFF, tile);
      }
    }
  }
}

static void laid_out_free(laid_out *o) {
  free(o->num_p);
  free(o->idx_p);
  free(o->num_f);
  free(o->idx_f);
  free(o->bits);
}

/* Builds the library's mask and the same selection as a test-side matrix. */
static attn_block_mask_t build_mask(const gen_case *gc, attn_context_t ctx, unsigned char *sel) {
  const sp_geom *g = &gc->g;
  const size_t n = sp_matrix_size(g);
  attn_block_mask_t m = NULL;
  int k;
  size_t e;
  check_ok(attn_block_mask_create(g->batch, g->heads, g->lq, g->lk, g->bq, g->bk, &m),
           "attn_block_mask_create");
  memset(sel, 0, n);
  for (k = 0; k < gc->nops; ++k) {
    const mask_op *op = &gc->ops[k];
    tu_rng sub;
    sub.state = op->seed;
    switch (op->kind) {
      case OP_TABLES:
      case OP_DEVICE_TABLES:
      case OP_DENSE: {
        sp_tables t;
        laid_out o;
        sp_draw_tables(g, &op->opts, &sub, &t);
        lay_out(g, &t, (int)op->a, op->b, op->opts.no_bits, &o);
        if (op->kind == OP_TABLES)
          check_ok(attn_block_mask_set_blocks(m, o.num_p, o.idx_p, o.max_p, o.bits, o.num_f,
                                              o.idx_f, o.max_f),
                   "attn_block_mask_set_blocks");
        else if (op->kind == OP_DEVICE_TABLES)
          check_ok(attn_block_mask_set_device_blocks(m, ctx, NULL, o.num_p, o.idx_p, o.max_p,
                                                     o.bits, o.num_f, o.idx_f, o.max_f),
                   "attn_block_mask_set_device_blocks");
        else
          check_ok(attn_block_mask_add_dense(m, t.pair), "attn_block_mask_add_dense");
        for (e = 0; e < n; ++e)
          sel[e] = (unsigned char)((op->kind == OP_DENSE && sel[e]) || t.pair[e]);
        laid_out_free(&o);
        sp_tables_free(&t);
        break;
      }
      case OP_WINDOW:
        check_ok(attn_block_mask_add_window(m, op->a, op->b), "attn_block_mask_add_window");
        sp_or_window(g, sel, op->a, op->b);
        break;
      case OP_KEYS:
      case OP_QUERIES: {
        int64_t pos[10], i;
        const int64_t limit = op->kind == OP_KEYS ? g->lk : g->lq;
        for (i = 0; i < op->a; ++i) pos[i] = tu_rng_int(&sub, 0, limit - 1); /* repeats too */
        if (op->kind == OP_KEYS)
          check_ok(attn_block_mask_add_global_keys(m, op->a > 0 ? pos : NULL, op->a),
                   "attn_block_mask_add_global_keys");
        else
          check_ok(attn_block_mask_add_global_queries(m, op->a > 0 ? pos : NULL, op->a),
                   "attn_block_mask_add_global_queries");
        sp_or_keys(g, sel, pos, op->a, op->kind == OP_QUERIES);
        break;
      }
      case OP_STRIDED:
        check_ok(attn_block_mask_add_strided(m, op->a), "attn_block_mask_add_strided");
        sp_or_strided(g, sel, op->a);
        break;
      case OP_RANDOM:
        check_ok(attn_block_mask_add_random_blocks(m, (int32_t)op->a, op->seed),
                 "attn_block_mask_add_random_blocks");
        sp_or_random_blocks(g, sel, op->a, op->seed);
        break;
      case OP_DOCUMENTS: {
        int32_t *dq = (int32_t *)calloc((size_t)(g->batch * g->lq) + 1, sizeof(int32_t));
        int32_t *dk = (int32_t *)calloc((size_t)(g->batch * g->lk) + 1, sizeof(int32_t));
        int64_t bb;
        assert_non_null(dq);
        assert_non_null(dk);
        for (bb = 0; bb < g->batch; ++bb) {
          sp_draw_docs(&sub, dq + bb * g->lq, g->lq, op->a);
          /* the same cuts for keys when the lengths agree, else their own */
          if (g->lq == g->lk)
            memcpy(dk + bb * g->lk, dq + bb * g->lq, (size_t)g->lk * sizeof(int32_t));
          else
            sp_draw_docs(&sub, dk + bb * g->lk, g->lk, op->a);
          if ((op->b & DOCS_PADDING) && g->lq > 0) dq[bb * g->lq + tu_rng_int(&sub, 0, g->lq - 1)] = -1;
        }
        if (op->b & DOCS_ANY_IDS) {
          static const int32_t kIds[] = {INT32_MIN, -1, 0, 1, 7, INT32_MAX};
          int64_t t;
          for (t = 0; t < g->batch * g->lq; ++t)
            if (dq[t] != -1 || !(op->b & DOCS_PADDING)) dq[t] = kIds[dq[t] % 6];
          for (t = 0; t < g->batch * g->lk; ++t) dk[t] = kIds[dk[t] % 6];
        }
        check_ok(attn_block_mask_and_documents(m, dq, dk), "attn_block_mask_and_documents");
        sp_and_docs(g, sel, dq, dk);
        free(dq);
        free(dk);
        break;
      }
    }
  }
  return m;
}

/* ------------------------------------------------------------------------ */
/* What attn.h says plan creation does                                       */
/* ------------------------------------------------------------------------ */

typedef struct prediction {
  int refuse;          /* plan creation must fail */
  int invalid, unsupp; /* which statuses it may return then */
  char why[256];
} prediction;

static void reason(prediction *p, attn_status_t st, const char *why) {
  const size_t used = strlen(p->why);
  p->refuse = 1;
  if (st == ATTN_STATUS_INVALID_ARGUMENT) p->invalid = 1;
  if (st == ATTN_STATUS_NOT_SUPPORTED) p->unsupp = 1;
  snprintf(p->why + used, sizeof p->why - used, "%s%s (%s)", used > 0 ? "; " : "", why,
           st == ATTN_STATUS_INVALID_ARGUMENT ? "INVALID_ARGUMENT" : "NOT_SUPPORTED");
}

/* The plan's seqlen_q (q = 1) or seqlen_kv: a varlen batch's longest. */
static int64_t plan_length(const nc_case *c, int q) {
  int64_t m = 0, b;
  if (c->lens_q == NULL) return q ? c->seqlen_q : c->seqlen_kv;
  for (b = 0; b < c->batch; ++b) {
    const int64_t l = q ? c->lens_q[b] : c->lens_kv[b];
    if (l > m) m = l;
  }
  return m;
}

/* Every rule of attn.h that refuses the case. empty_rows < 0: unknown. */
static void predict(const gen_case *gc, int64_t empty_rows, prediction *p) {
  const nc_case *c = &gc->c;
  const int varlen = c->lens_q != NULL, sparse = gc->fam == SPARSE;
  memset(p, 0, sizeof *p);
  if (c->heads_q % c->heads_kv != 0)
    reason(p, ATTN_STATUS_INVALID_ARGUMENT, "heads_q not a multiple of heads_kv");
  if (varlen && c->varlen_names_layout && c->layout != ATTN_LAYOUT_THD)
    reason(p, ATTN_STATUS_INVALID_ARGUMENT, "a layout other than THD named with a varlen batch");
  if (sparse && ((gc->g.batch != 1 && gc->g.batch != c->batch) ||
                 (gc->g.heads != 1 && gc->g.heads != c->heads_kv)))
    reason(p, ATTN_STATUS_INVALID_ARGUMENT, "the block mask's batch or heads");
  if (sparse && (gc->g.lq != plan_length(c, 1) || gc->g.lk != plan_length(c, 0)))
    reason(p, ATTN_STATUS_INVALID_ARGUMENT, "the block mask's lengths");
  if (c->moba_block > 0 && sparse) reason(p, ATTN_STATUS_NOT_SUPPORTED, "MoBA with a block mask");
  if (c->moba_block > 0 && c->mask != ATTN_MASK_CAUSAL)
    reason(p, ATTN_STATUS_INVALID_ARGUMENT, "MoBA without the causal mask");
  if (c->moba_keep && c->moba_block == 0)
    reason(p, ATTN_STATUS_INVALID_ARGUMENT, "keep_selection without MoBA");
  if (c->moba_keep && !c->backward)
    reason(p, ATTN_STATUS_INVALID_ARGUMENT, "keep_selection without a backward pass");
  if (c->bad_tensor != 0) reason(p, ATTN_STATUS_INVALID_ARGUMENT, "a spoilt tensor descriptor");
  if (c->bad_varlen == 1)
    reason(p, ATTN_STATUS_INVALID_ARGUMENT, "varlen offsets for another batch than the shape's");
  if (c->bad_varlen == 2)
    reason(p, ATTN_STATUS_INVALID_ARGUMENT, "seqlen_q not the longest varlen sequence");
  if (c->empty_policy == NC_EMPTY_DENY && empty_rows != 0) {
    if (empty_rows > 0)
      reason(p, ATTN_STATUS_INVALID_ARGUMENT, "empty rows not allowed");
    else
      p->invalid = 1; /* may apply too: where the reference cannot count them */
  }
}

/* ------------------------------------------------------------------------ */
/* Description                                                               */
/* ------------------------------------------------------------------------ */

static void describe(const gen_case *gc, char *out, size_t size) {
  const nc_case *c = &gc->c;
  static const char *const strides[] = {"default",      "padded", "packed",     "shuffled",
                                        "broadcast-kv", "mixed",  "zero-inputs"};
  static const char *const layouts[] = {"BSHD", "BHSD", "THD"};
  static const char *const masks[] = {"none", "causal", "window"};
  static const char *const policy[] = {"auto", "allow", "deny"};
  size_t used;
  int64_t b;
  int k;
#define ADD(...) \
  (used = strlen(out), snprintf(out + used, used < size ? size - used : 0, __VA_ARGS__))
  out[0] = '\0';
  ADD("%s %s batch %lld heads %lld/%lld", tu_dtype_name(c->dtype),
      c->lens_q != NULL && !c->varlen_names_layout ? "THD" : layouts[c->layout],
      (long long)c->batch, (long long)c->heads_q, (long long)c->heads_kv);
  if (c->lens_q != NULL) {
    ADD(" varlen q/kv");
    for (b = 0; b < c->batch; ++b) ADD(" %d/%d", (int)gc->lens_q[b], (int)gc->lens_kv[b]);
    if (c->varlen_names_layout) ADD(" (layout named)");
  } else {
    ADD(" seqlen %lld/%lld", (long long)c->seqlen_q, (long long)c->seqlen_kv);
  }
  ADD(" dims %lld/%lld mask %s", (long long)c->dqk, (long long)c->dv, masks[c->mask]);
  if (c->mask == ATTN_MASK_WINDOW) ADD("(%lld,%lld)", (long long)c->left, (long long)c->right);
  if (c->scale > 0.0f)
    ADD(" scale %.9g", (double)c->scale);
  else
    ADD(" scale default");
  if (c->qk_integers)
    ADD(" q,k integers");
  else
    ADD(" q,k sd %g", c->qk_sd > 0.0 ? c->qk_sd : 1.0);
  ADD(" softcap %.9g strides %s trend %d threads %d %s%s%s%s empty-rows %s", (double)c->softcap,
      strides[c->strides], c->logit_trend, c->threads, c->backward ? "fwd+bwd" : "fwd",
      c->no_lse ? " lse=NULL" : "", c->deterministic ? " deterministic" : "",
      c->reuse_desc ? " reused-desc" : "", policy[c->empty_policy]);
  if (c->bad_tensor != 0) {
    static const char *const roles[] = {"Q", "K", "V", "O", "dO", "dQ", "dK", "dV"};
    static const char *const kinds[] = {"dtype", "dims", "last stride", "overlap"};
    ADD(" | spoilt tensor %s (%s)", roles[c->bad_tensor - 1], kinds[c->bad_tensor_kind]);
  }
  if (c->bad_varlen != 0)
    ADD(" | %s", c->bad_varlen == 1 ? "varlen offsets for batch - 1" : "seqlen_q = longest + 1");
  if (c->moba_block > 0 || c->moba_keep)
    ADD(" | moba block %lld top_k %lld %s%s", (long long)c->moba_block, (long long)c->moba_top_k,
        c->moba_shared ? "shared" : "per-head", c->moba_keep ? " kept" : "");
  if (gc->fam == SPARSE) {
    ADD(" | block mask batch %lld heads %lld lengths %lld/%lld blocks %lldx%lld:", (long long)gc->g.batch,
        (long long)gc->g.heads, (long long)gc->g.lq, (long long)gc->g.lk, (long long)gc->g.bq,
        (long long)gc->g.bk);
    if (gc->nops == 0) ADD(" (nothing)");
    for (k = 0; k < gc->nops; ++k) {
      const mask_op *op = &gc->ops[k];
      ADD(" %s", kOpName[op->kind]);
      switch (op->kind) {
        case OP_TABLES:
        case OP_DEVICE_TABLES:
        case OP_DENSE:
          ADD("(p_none %.2f%s%s%s", op->opts.p_none, op->opts.no_bits ? " no-bits" : "",
              op->opts.corner_bits ? " corner-bits" : "",
              op->opts.empty_block0 ? " empty-block0" : "");
          if (op->kind != OP_DENSE)
            ADD(" %s slots %s%lld", op->a == TABLES_PARTIAL_ONLY ? "partial-only"
                                    : op->a == TABLES_FULL_ONLY  ? "full-only"
                                                                 : "both",
                op->b < 0 ? "all" : "longest+", (long long)(op->b < 0 ? 0 : op->b));
          ADD(")");
          break;
        case OP_WINDOW: ADD("(%lld,%lld)", (long long)op->a, (long long)op->b); break;
        case OP_DOCUMENTS:
          ADD("(runs <= %lld%s%s)", (long long)op->a, (op->b & DOCS_PADDING) ? ", padding" : "",
              (op->b & DOCS_ANY_IDS) ? ", any ids" : "");
          break;
        default: ADD("(%lld)", (long long)op->a); break;
      }
    }
  }
#undef ADD
}

/* ------------------------------------------------------------------------ */
/* The test                                                                  */
/* ------------------------------------------------------------------------ */

static void random_case(void **state) {
  const int index = *(const int *)*state;
  gen_case gc;
  attn_context_t ctx = NULL;
  attn_block_mask_t mask = NULL;
  unsigned char *sel = NULL;
  nc_outcome out;
  prediction pred;
  char text[2048];

  draw_case(index, &gc);
  describe(&gc, text, sizeof text);
  printf("case %d: %s\n", index, text);
  fflush(stdout);

  if (gc.fam == SPARSE) {
    const int fits = gc.g.lq == plan_length(&gc.c, 1) && gc.g.lk == plan_length(&gc.c, 0) &&
                     (gc.g.batch == 1 || gc.g.batch == gc.c.batch) &&
                     (gc.g.heads == 1 || gc.g.heads == gc.c.heads_kv);
    char what[64];
    check_ok(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx), "attn_context_create");
    sel = (unsigned char *)calloc(sp_matrix_size(&gc.g) + 1, 1);
    assert_non_null(sel);
    mask = build_mask(&gc, ctx, sel);
    snprintf(what, sizeof what, "case %d: the block mask read back", index);
    sp_check_readback(&gc.g, mask, sel, what);
    gc.c.block_mask = mask;
    /* the reference takes the selection only where it fits the plan */
    gc.c.pair_mask = fits ? sel : NULL;
    gc.c.mask_batch = gc.g.batch;
    gc.c.mask_heads = gc.g.heads;
  }

  nc_run_outcome(&gc.c, &out);
  {
    const int checkable = gc.c.heads_q % gc.c.heads_kv == 0 && gc.c.bad_tensor == 0 &&
                          gc.c.bad_varlen == 0;
    predict(&gc, checkable ? out.empty_rows : -1, &pred);
  }
  if (out.status == ATTN_STATUS_SUCCESS) {
    if (pred.refuse)
      fail_msg("case %d: attn_plan_create accepted the problem, but attn.h says it refuses %s",
               index, pred.why);
    printf("  created\n");
  } else {
    const int documented = (out.status == ATTN_STATUS_INVALID_ARGUMENT && pred.invalid) ||
                           (out.status == ATTN_STATUS_NOT_SUPPORTED && pred.unsupp);
    if (!pred.refuse && !pred.invalid)
      fail_msg("case %d: attn_plan_create returned %s (\"%s\"), a refusal attn.h does not "
               "document for this problem", index, attn_status_string(out.status), out.message);
    if (!documented)
      fail_msg("case %d: attn_plan_create returned %s (\"%s\"), but attn.h gives %s for: %s",
               index, attn_status_string(out.status), out.message,
               pred.invalid && pred.unsupp ? "INVALID_ARGUMENT or NOT_SUPPORTED"
               : pred.invalid              ? "INVALID_ARGUMENT"
                                           : "NOT_SUPPORTED",
               pred.why);
    if (out.message[0] == '\0')
      fail_msg("case %d: attn_plan_create returned %s with an empty message", index,
               attn_status_string(out.status));
    printf("  refused as documented: %s: %s\n", attn_status_string(out.status), out.message);
  }
  fflush(stdout);
  attn_block_mask_destroy(mask);
  attn_context_destroy(ctx);
  free(sel);
}

static int env_int(const char *name, int fallback) {
  const char *s = getenv(name);
  return s != NULL && s[0] != '\0' ? atoi(s) : fallback;
}

int main(int argc, char **argv) {
  const int count = env_int("ATTN_RANDOM_CASES", kDefaultCases);
  const int only = env_int("ATTN_RANDOM_CASE", -1);
  const int n = only >= 0 ? 1 : count;
  const char *isa = getenv("ATTN_CPU_ISA");
  struct CMUnitTest *tests;
  char(*names)[16];
  int *index, i, rc = nc_isa_gate();
  if (rc != 0) return rc;
  if (n < 1) {
    fprintf(stderr, "ATTN_RANDOM_CASES must be >= 1\n");
    return 1;
  }
  tests = (struct CMUnitTest *)calloc((size_t)n, sizeof *tests);
  index = (int *)calloc((size_t)n, sizeof *index);
  names = (char(*)[16])calloc((size_t)n, sizeof *names);
  if (tests == NULL || index == NULL || names == NULL) return 1;
  for (i = 0; i < n; ++i) {
    index[i] = only >= 0 ? only : i;
    snprintf(names[i], sizeof names[i], "case_%05d", index[i]);
    tests[i].name = names[i];
    tests[i].test_func = random_case;
    tests[i].initial_state = &index[i];
  }
  printf("%d random cases; one alone: ATTN_TEST_SEED=%llu ATTN_RANDOM_CASE=<i>%s%s %s\n", n,
         (unsigned long long)tu_seed(), isa != NULL ? " ATTN_CPU_ISA=" : "", isa != NULL ? isa : "",
         argc > 0 ? argv[0] : "test_numerics_random");
  rc = _cmocka_run_group_tests("random", tests, (size_t)n, NULL, NULL);
  free(tests);
  free(index);
  free(names);
  return rc;
}
