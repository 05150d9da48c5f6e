/*
 * attn_bench_cpu: times one dense attention plan on libattn's CPU backend
 * and, in the same process and with the same thread count, cblas_sgemm of
 * the shapes the attention's matrix products have, so the two rates can be
 * compared on the same machine, in the same conditions.
 *
 *   attn_bench_cpu --seqlen 4096 --heads-q 8 --head-dim 64 --mask causal \
 *                  --threads 2 --passes fwd,bwd
 *
 * Run with --help for every option. What it measures:
 *   - attention: attn_forward and/or attn_backward on random non-zero
 *     inputs, wall clock (CLOCK_MONOTONIC) around each call after warm-up
 *     calls; median and minimum over the repeats. GFLOP/s come from the
 *     plan's own count (attn_plan_describe: flops_forward, flops_backward,
 *     which count only the (query, key) pairs the mask lets through).
 *   - sgemm, per head, fp32, row-major, on the same thread count:
 *       qk      M = seqlen_q, N = seqlen_kv, K = head_dim_qk   (S = Q K^T)
 *       pv      M = seqlen_q, N = head_dim_v, K = seqlen_kv    (O = P V)
 *       square  M = N = K = --sgemm-square (2048 by default), the BLAS
 *               ceiling of the machine
 *     each as 2 M N K / time.
 *   - the "comparable" BLAS rate of each pass: the rate BLAS would sustain on
 *     that pass's matrix products alone, the flop-weighted harmonic mean of
 *     the qk and pv rates: one qk and one pv product for the forward, two qk
 *     (S, dP) and three pv-shaped (dV, dK, dQ) for the backward.
 *
 * Output: human-readable lines, then machine-readable lines starting with
 * "meta," (key, value) and "csv," (one measurement each; the first csv line
 * names the columns).
 *
 * Threads: the library takes its count from the context. OpenBLAS is set to
 * the same count with openblas_set_num_threads when the library has it;
 * with another CBLAS set that implementation's variable (e.g.
 * OPENBLAS_NUM_THREADS, MKL_NUM_THREADS) to the same count by hand.
 * Between the phases the program sleeps a little (--settle-ms) so that the
 * spinning worker threads of one pool (OpenMP's, OpenBLAS's) have gone idle
 * before the other pool is timed: on a machine with few cores they would
 * otherwise steal its cycles.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "attn/attn.h"

/* ------------------------------------------------------------------------ */
/* Small utilities                                                           */
/* ------------------------------------------------------------------------ */

static void die(const char *what) {
  fprintf(stderr, "attn_bench_cpu: %s\n", what);
  exit(1);
}

static void check(attn_status_t st, const char *call) {
  if (st != ATTN_STATUS_SUCCESS) {
    fprintf(stderr, "attn_bench_cpu: %s failed: %s: %s\n", call, attn_status_string(st),
            attn_last_error_message());
    exit(1);
  }
}
#define CHECK(call) check((call), #call)

static double now_seconds(void) {
  struct timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) die("clock_gettime(CLOCK_MONOTONIC) failed");
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU time of the whole process (all threads), seconds. */
static double process_cpu_seconds(void) {
  struct timespec ts;
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) return 0.0;
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_ms(long ms) {
  struct timespec ts;
  if (ms <= 0) return;
  ts.tv_sec = ms / 1000;
  ts.tv_nsec = (ms % 1000) * 1000000L;
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static void *xalloc(size_t bytes) {
  void *p = NULL;
  if (bytes == 0) bytes = 64;
  if (posix_memalign(&p, 64, bytes) != 0 || p == NULL) die("out of memory");
  return p;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

typedef struct timing {
  double median_s;
  double min_s;
  int count;
} timing_t;

/* Sorts t[0..n) and summarises it. */
static timing_t summarise(double *t, int n) {
  timing_t r;
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  r.count = n;
  r.min_s = t[0];
  r.median_s = (n % 2) ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
  return r;
}

/* xorshift64*: reproducible inputs without depending on rand(). */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double rng_uniform(void) {
  uint64_t x = rng_state;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  rng_state = x;
  return (double)((x * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
}
/* Random, never zero: magnitude in [0.1, 1), either sign. */
static float rng_value(void) {
  const double u = rng_uniform();
  const double mag = 0.1 + 0.9 * rng_uniform();
  return (float)(u < 0.5 ? -mag : mag);
}

/* ------------------------------------------------------------------------ */
/* fp16 / bf16 conversion (round to nearest even)                            */
/* ------------------------------------------------------------------------ */

static uint32_t float_bits(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  return x;
}

static uint16_t float_to_fp16(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) /* inf, NaN (kept quiet) */
    return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u));
  if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds past 65504 */
  if (ax >= 0x38800000u) {                                  /* normal half */
    const uint32_t mant = ax & 0x7FFFFFu;
    const uint32_t rem = mant & 0x1FFFu;
    uint32_t h = ((((ax >> 23) - 127u + 15u)) << 10) | (mant >> 13);
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h; /* a carry is correct */
    return (uint16_t)(sign | h);
  } else { /* subnormal half or zero */
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7FFFFFu) | (e ? 0x800000u : 0u);
    const uint32_t shift = 126u - e;
    uint32_t h, rem, half;
    if (e == 0 || shift > 24u) return sign;
    h = m >> shift;
    rem = m & ((1u << shift) - 1u);
    half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return (uint16_t)(sign | h);
  }
}

static uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
  return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static size_t dtype_size(attn_dtype_t dt) { return dt == ATTN_DTYPE_FP32 ? 4 : 2; }

static const char *dtype_name(attn_dtype_t dt) {
  switch (dt) {
    case ATTN_DTYPE_FP16: return "fp16";
    case ATTN_DTYPE_BF16: return "bf16";
    default: return "fp32";
  }
}

/* A tensor of n random non-zero elements of type dt. */
static void *random_tensor(size_t n, attn_dtype_t dt) {
  void *p = xalloc(n * dtype_size(dt));
  size_t i;
  for (i = 0; i < n; ++i) {
    const float v = rng_value();
    if (dt == ATTN_DTYPE_FP32) {
      ((float *)p)[i] = v;
    } else if (dt == ATTN_DTYPE_FP16) {
      ((uint16_t *)p)[i] = float_to_fp16(v);
    } else {
      ((uint16_t *)p)[i] = float_to_bf16(v);
    }
  }
  return p;
}

static float *random_floats(size_t n) { return (float *)random_tensor(n, ATTN_DTYPE_FP32); }

/* Sum of |x| over the tensor, read as float: keeps the results live and
 * shows a NaN or inf at once. */
static double checksum(const void *p, size_t n, attn_dtype_t dt) {
  double s = 0.0;
  size_t i;
  for (i = 0; i < n; ++i) {
    float v;
    if (dt == ATTN_DTYPE_FP32) {
      v = ((const float *)p)[i];
    } else {
      const uint16_t h = ((const uint16_t *)p)[i];
      uint32_t bits;
      if (dt == ATTN_DTYPE_BF16) {
        bits = (uint32_t)h << 16;
      } else {
        const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
        const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
        if (e == 0x1Fu) {
          bits = sign | 0x7F800000u | (m << 13);
        } else if (e != 0) {
          bits = sign | ((e + 112u) << 23) | (m << 13);
        } else {
          float sub = (float)m * (1.0f / 16777216.0f); /* m * 2^-24 */
          bits = float_bits(sub) | sign;
        }
      }
      memcpy(&v, &bits, sizeof v);
    }
    s += fabs((double)v);
  }
  return s;
}

/* ------------------------------------------------------------------------ */
/* Options                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct options {
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim_qk, head_dim_v;
  attn_dtype_t dtype;
  attn_layout_t layout;
  attn_mask_t mask;
  int64_t window_left, window_right;
  float softcap;
  int threads;
  int run_fwd, run_bwd;
  int warmup, repeat;
  int sgemm;
  int64_t sgemm_square;
  long settle_ms;
  const char *label;
} options_t;

static void usage(FILE *f) {
  fputs(
      "usage: attn_bench_cpu [options]\n"
      "  --batch N            sequences (1)\n"
      "  --heads-q N          query heads (8)\n"
      "  --heads-kv N         key/value heads, divides heads-q (= heads-q)\n"
      "  --seqlen N           seqlen_q = seqlen_kv = N (4096)\n"
      "  --seqlen-q N         query length\n"
      "  --seqlen-kv N        key/value length (= seqlen-q)\n"
      "  --head-dim N         head_dim_qk = head_dim_v = N (64)\n"
      "  --head-dim-v N       value head dim (= head-dim)\n"
      "  --dtype T            fp32 | fp16 | bf16 (fp32)\n"
      "  --layout L           bshd | bhsd (bshd)\n"
      "  --mask M             none | causal | window LEFT RIGHT (none);\n"
      "                       -1 for an unbounded window side\n"
      "  --softcap X          logit soft-cap, 0 = off (0)\n"
      "  --threads N          threads for the library and the BLAS, 0 = all cores (0)\n"
      "  --passes P           fwd | bwd | fwd,bwd (fwd)\n"
      "  --warmup N           untimed calls before timing (1)\n"
      "  --repeat N           timed calls (5)\n"
      "  --no-sgemm           skip the cblas_sgemm comparison\n"
      "  --sgemm-square N     size of the square sgemm, 0 = skip (2048)\n"
      "  --settle-ms N        idle time between phases (250)\n"
      "  --label NAME         case name in the output (from the mask)\n"
      "  --help\n",
      f);
}

static int64_t parse_int(const char *opt, const char *s, int64_t lo, int64_t hi) {
  char *end = NULL;
  long long v;
  errno = 0;
  v = strtoll(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) {
    fprintf(stderr, "attn_bench_cpu: %s: '%s' is not an integer in [%lld, %lld]\n", opt, s,
            (long long)lo, (long long)hi);
    exit(2);
  }
  return (int64_t)v;
}

static const char *need_arg(int argc, char **argv, int *i) {
  if (*i + 1 >= argc) {
    fprintf(stderr, "attn_bench_cpu: %s needs a value\n", argv[*i]);
    exit(2);
  }
  return argv[++*i];
}

static void parse_options(int argc, char **argv, options_t *o) {
  int64_t seqlen_kv = -1, heads_kv = -1, head_dim_v = -1;
  const int64_t big = INT64_C(1) << 40;
  int i;
  memset(o, 0, sizeof *o);
  o->batch = 1;
  o->heads_q = 8;
  o->seqlen_q = 4096;
  o->head_dim_qk = 64;
  o->dtype = ATTN_DTYPE_FP32;
  o->layout = ATTN_LAYOUT_BSHD;
  o->mask = ATTN_MASK_NONE;
  o->window_left = o->window_right = -1;
  o->run_fwd = 1;
  o->warmup = 1;
  o->repeat = 5;
  o->sgemm = 1;
  o->sgemm_square = 2048;
  o->settle_ms = 250;

  for (i = 1; i < argc; ++i) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      exit(0);
    } else if (!strcmp(a, "--batch")) {
      o->batch = parse_int(a, need_arg(argc, argv, &i), 1, big);
    } else if (!strcmp(a, "--heads-q")) {
      o->heads_q = parse_int(a, need_arg(argc, argv, &i), 1, big);
    } else if (!strcmp(a, "--heads-kv")) {
      heads_kv = parse_int(a, need_arg(argc, argv, &i), 1, big);
    } else if (!strcmp(a, "--seqlen")) {
      o->seqlen_q = seqlen_kv = parse_int(a, need_arg(argc, argv, &i), 1, big);
    } else if (!strcmp(a, "--seqlen-q")) {
      o->seqlen_q = parse_int(a, need_arg(argc, argv, &i), 1, big);
    } else if (!strcmp(a, "--seqlen-kv")) {
      seqlen_kv = parse_int(a, need_arg(argc, argv, &i), 1, big);
    } else if (!strcmp(a, "--head-dim")) {
      o->head_dim_qk = head_dim_v = parse_int(a, need_arg(argc, argv, &i), 1, 1024);
    } else if (!strcmp(a, "--head-dim-v")) {
      head_dim_v = parse_int(a, need_arg(argc, argv, &i), 1, 1024);
    } else if (!strcmp(a, "--dtype")) {
      const char *v = need_arg(argc, argv, &i);
      if (!strcmp(v, "fp32")) o->dtype = ATTN_DTYPE_FP32;
      else if (!strcmp(v, "fp16")) o->dtype = ATTN_DTYPE_FP16;
      else if (!strcmp(v, "bf16")) o->dtype = ATTN_DTYPE_BF16;
      else die("--dtype must be fp32, fp16 or bf16");
    } else if (!strcmp(a, "--layout")) {
      const char *v = need_arg(argc, argv, &i);
      if (!strcmp(v, "bshd")) o->layout = ATTN_LAYOUT_BSHD;
      else if (!strcmp(v, "bhsd")) o->layout = ATTN_LAYOUT_BHSD;
      else die("--layout must be bshd or bhsd");
    } else if (!strcmp(a, "--mask")) {
      const char *v = need_arg(argc, argv, &i);
      if (!strcmp(v, "none") || !strcmp(v, "full")) {
        o->mask = ATTN_MASK_NONE;
      } else if (!strcmp(v, "causal")) {
        o->mask = ATTN_MASK_CAUSAL;
      } else if (!strcmp(v, "window")) {
        o->mask = ATTN_MASK_WINDOW;
        o->window_left = parse_int("--mask window LEFT", need_arg(argc, argv, &i), -1, big);
        o->window_right = parse_int("--mask window RIGHT", need_arg(argc, argv, &i), -1, big);
      } else {
        die("--mask must be none, causal or window LEFT RIGHT");
      }
    } else if (!strcmp(a, "--softcap")) {
      const char *v = need_arg(argc, argv, &i);
      char *end = NULL;
      o->softcap = strtof(v, &end);
      if (end == v || *end != '\0' || !(o->softcap >= 0.0f)) die("--softcap must be a number >= 0");
    } else if (!strcmp(a, "--threads")) {
      o->threads = (int)parse_int(a, need_arg(argc, argv, &i), 0, 4096);
    } else if (!strcmp(a, "--passes")) {
      const char *v = need_arg(argc, argv, &i);
      if (!strcmp(v, "fwd")) {
        o->run_fwd = 1, o->run_bwd = 0;
      } else if (!strcmp(v, "bwd")) {
        o->run_fwd = 0, o->run_bwd = 1;
      } else if (!strcmp(v, "fwd,bwd") || !strcmp(v, "both")) {
        o->run_fwd = 1, o->run_bwd = 1;
      } else {
        die("--passes must be fwd, bwd or fwd,bwd");
      }
    } else if (!strcmp(a, "--warmup")) {
      o->warmup = (int)parse_int(a, need_arg(argc, argv, &i), 0, 1000000);
    } else if (!strcmp(a, "--repeat")) {
      o->repeat = (int)parse_int(a, need_arg(argc, argv, &i), 1, 1000000);
    } else if (!strcmp(a, "--no-sgemm")) {
      o->sgemm = 0;
    } else if (!strcmp(a, "--sgemm-square")) {
      o->sgemm_square = parse_int(a, need_arg(argc, argv, &i), 0, 65536);
    } else if (!strcmp(a, "--settle-ms")) {
      o->settle_ms = (long)parse_int(a, need_arg(argc, argv, &i), 0, 60000);
    } else if (!strcmp(a, "--label")) {
      o->label = need_arg(argc, argv, &i);
    } else {
      fprintf(stderr, "attn_bench_cpu: unknown option '%s'\n", a);
      usage(stderr);
      exit(2);
    }
  }
  o->heads_kv = heads_kv > 0 ? heads_kv : o->heads_q;
  o->seqlen_kv = seqlen_kv > 0 ? seqlen_kv : o->seqlen_q;
  o->head_dim_v = head_dim_v > 0 ? head_dim_v : o->head_dim_qk;
}

/* ------------------------------------------------------------------------ */
/* sgemm                                                                     */
/* ------------------------------------------------------------------------ */

typedef struct gemm_result {
  const char *name;
  int64_t m, n, k;
  timing_t t;
  int done;
} gemm_result_t;

static double gemm_flops(const gemm_result_t *g) {
  return 2.0 * (double)g->m * (double)g->n * (double)g->k;
}

/* The enum type's name differs between CBLAS headers, so it is not named. */
static void sgemm_call(int trans_b, int m, int n, int k, const float *a, const float *b, int ldb,
                       float *c) {
  if (trans_b)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a, k, b, ldb, 0.0f, c, n);
  else
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a, k, b, ldb, 0.0f, c,
                n);
}

/* C[M x N] = A[M x K] * op(B), row-major; op(B) = B^T ([N x K] stored) when
 * trans_b, as for S = Q K^T. The warm-up call also sizes the repeat count:
 * at least `repeat` calls and at least ~0.5 s of timed work. */
static void time_sgemm(gemm_result_t *g, int trans_b, int warmup, int repeat) {
  const int m = (int)g->m, n = (int)g->n, k = (int)g->k;
  float *a = random_floats((size_t)m * (size_t)k);
  float *b = random_floats((size_t)k * (size_t)n);
  float *c = (float *)xalloc((size_t)m * (size_t)n * sizeof(float));
  const int ldb = trans_b ? k : n;
  double *t, t0, first = 0.0;
  int i, reps;
  for (i = 0; i < (warmup > 0 ? warmup : 1); ++i) {
    t0 = now_seconds();
    sgemm_call(trans_b, m, n, k, a, b, ldb, c);
    first = now_seconds() - t0;
  }
  reps = repeat;
  if (first > 0.0 && reps * first < 0.5) {
    reps = (int)(0.5 / first) + 1;
    if (reps > 1000) reps = 1000;
  }
  t = (double *)xalloc((size_t)reps * sizeof *t);
  for (i = 0; i < reps; ++i) {
    t0 = now_seconds();
    sgemm_call(trans_b, m, n, k, a, b, ldb, c);
    t[i] = now_seconds() - t0;
  }
  g->t = summarise(t, reps);
  g->done = 1;
  if (!isfinite(checksum(c, (size_t)m * (size_t)n, ATTN_DTYPE_FP32))) die("sgemm produced NaN");
  free(t);
  free(a);
  free(b);
  free(c);
}

/* ------------------------------------------------------------------------ */
/* main                                                                      */
/* ------------------------------------------------------------------------ */

typedef struct pass_result {
  const char *pass;
  double flops;
  timing_t t;
  double comparable; /* BLAS rate of this pass's products, GFLOP/s; 0 if unknown */
  int done;
} pass_result_t;

static double gflops(double flops, double seconds) {
  return seconds > 0.0 ? flops / seconds * 1e-9 : 0.0;
}

/* A CSV field that is empty when the value is unknown (0). */
static void print_optional(int decimals, double x) {
  if (x > 0.0) printf(",%.*f", decimals, x);
  else putchar(',');
}

static void print_shape(FILE *f, const options_t *o) {
  fprintf(f, "b%lld-hq%lld-hkv%lld-lq%lld-lk%lld-d%lld", (long long)o->batch,
          (long long)o->heads_q, (long long)o->heads_kv, (long long)o->seqlen_q,
          (long long)o->seqlen_kv, (long long)o->head_dim_qk);
  if (o->head_dim_v != o->head_dim_qk) fprintf(f, "-dv%lld", (long long)o->head_dim_v);
  if (o->layout == ATTN_LAYOUT_BHSD) fputs("-bhsd", f);
  if (o->softcap > 0.0f) fprintf(f, "-cap%g", (double)o->softcap);
}

int main(int argc, char **argv) {
  options_t o;
  attn_context_t ctx = NULL;
  attn_plan_desc_t desc = NULL;
  attn_plan_t plan = NULL;
  attn_plan_info_t info;
  char *summary;
  char label[96];
  size_t needed = 0, ws_fwd = 0, ws_bwd = 0, ws_bytes;
  size_t nq, nk, nv, no, nlse;
  void *q, *k, *v, *out, *d_o = NULL, *dq = NULL, *dk = NULL, *dv = NULL, *ws;
  float *lse;
  int32_t threads = 0;
  int i, blas_threads = -1;
  pass_result_t res[2];
  gemm_result_t gq, gp, gs;
  double *t;
  double rate_qk = 0.0, rate_pv = 0.0, rate_sq = 0.0;

  const double wall_start = now_seconds(), cpu_start = process_cpu_seconds();

  parse_options(argc, argv, &o);

  /* Plan */
  CHECK(attn_context_create(ATTN_BACKEND_CPU, 0, o.threads, &ctx));
  CHECK(attn_context_get_num_threads(ctx, &threads));
  CHECK(attn_plan_desc_create(&desc));
  CHECK(attn_plan_desc_set_shape(desc, o.batch, o.heads_q, o.heads_kv, o.seqlen_q, o.seqlen_kv,
                                 o.head_dim_qk, o.head_dim_v));
  CHECK(attn_plan_desc_set_dtype(desc, o.dtype));
  CHECK(attn_plan_desc_set_layout(desc, o.layout));
  CHECK(attn_plan_desc_set_mask(desc, o.mask, o.window_left, o.window_right));
  if (o.softcap > 0.0f) CHECK(attn_plan_desc_set_softcap(desc, o.softcap));
  CHECK(attn_plan_desc_set_passes(desc, o.run_bwd ? ATTN_PASSES_FORWARD_BACKWARD
                                                  : ATTN_PASSES_FORWARD));
  CHECK(attn_plan_create(ctx, desc, &plan));
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  CHECK(attn_plan_describe(plan, &info));
  CHECK(attn_plan_summary(plan, NULL, 0, &needed));
  summary = (char *)xalloc(needed);
  CHECK(attn_plan_summary(plan, summary, needed, NULL));
  CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_fwd));
  if (o.run_bwd) CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &ws_bwd));
  ws_bytes = ws_fwd > ws_bwd ? ws_fwd : ws_bwd;

  if (o.label) {
    snprintf(label, sizeof label, "%s", o.label);
  } else if (o.mask == ATTN_MASK_CAUSAL) {
    snprintf(label, sizeof label, "causal");
  } else if (o.mask == ATTN_MASK_WINDOW) {
    snprintf(label, sizeof label, "window_%lld_%lld", (long long)o.window_left,
             (long long)o.window_right);
  } else {
    snprintf(label, sizeof label, "full");
  }

  /* BLAS threads: the same count as the library's. */
#if defined(BENCH_HAVE_OPENBLAS_SET_NUM_THREADS)
  openblas_set_num_threads(threads);
#endif
#if defined(BENCH_HAVE_OPENBLAS_GET_NUM_THREADS)
  blas_threads = openblas_get_num_threads();
#endif

  printf("libattn %s CPU benchmark\n", attn_version_string());
  printf("plan:     %s\n", summary);
  printf("kernel:   %s (%s), tiles %d x %d, %d threads\n", info.kernel, info.algorithm,
         (int)info.tile_q, (int)info.tile_kv, (int)info.num_threads);
  printf("problem:  ");
  print_shape(stdout, &o);
  printf(" %s %s, %llu visible pairs, forward %.3f GFLOP, backward %.3f GFLOP\n",
         dtype_name(o.dtype), label, (unsigned long long)info.visible_pairs,
         info.flops_forward * 1e-9, info.flops_backward * 1e-9);
#if defined(BENCH_HAVE_OPENBLAS_GET_CORENAME)
  printf("blas:     OpenBLAS core %s", openblas_get_corename());
#else
  printf("blas:     CBLAS (not OpenBLAS: set its thread variable to %d)", (int)threads);
#endif
#if defined(BENCH_HAVE_OPENBLAS_GET_CONFIG)
  printf(", config '%s'", openblas_get_config());
#endif
  if (blas_threads > 0) printf(", %d threads", blas_threads);
  printf("\ntiming:   %d warm-up + %d timed calls, median and min, CLOCK_MONOTONIC\n", o.warmup,
         o.repeat);
  fflush(stdout);

  /* Tensors (default strides: element counts do not depend on the layout). */
  nq = (size_t)(o.batch * o.seqlen_q * o.heads_q * o.head_dim_qk);
  nk = (size_t)(o.batch * o.seqlen_kv * o.heads_kv * o.head_dim_qk);
  nv = (size_t)(o.batch * o.seqlen_kv * o.heads_kv * o.head_dim_v);
  no = (size_t)(o.batch * o.seqlen_q * o.heads_q * o.head_dim_v);
  nlse = (size_t)(o.batch * o.heads_q * o.seqlen_q);
  q = random_tensor(nq, o.dtype);
  k = random_tensor(nk, o.dtype);
  v = random_tensor(nv, o.dtype);
  out = xalloc(no * dtype_size(o.dtype));
  lse = (float *)xalloc(nlse * sizeof(float));
  if (o.run_bwd) {
    d_o = random_tensor(no, o.dtype);
    dq = xalloc(nq * dtype_size(o.dtype));
    dk = xalloc(nk * dtype_size(o.dtype));
    dv = xalloc(nv * dtype_size(o.dtype));
  }
  ws = xalloc(ws_bytes);
  memset(ws, 0, ws_bytes); /* fault the pages in before timing */
  memset(out, 0, no * dtype_size(o.dtype));
  memset(res, 0, sizeof res);
  memset(&gq, 0, sizeof gq);
  memset(&gp, 0, sizeof gp);
  memset(&gs, 0, sizeof gs);
  t = (double *)xalloc((size_t)o.repeat * sizeof *t);

  sleep_ms(o.settle_ms); /* let OpenBLAS's start-up threads go idle */

  /* Forward: also run (untimed, once) when only the backward is timed, to
   * produce O and LSE. */
  res[0].pass = "fwd";
  res[0].flops = info.flops_forward;
  for (i = 0; i < (o.run_fwd ? o.warmup : 1); ++i)
    CHECK(attn_forward(plan, q, k, v, out, lse, ws, ws_bytes, NULL));
  if (o.run_fwd) {
    for (i = 0; i < o.repeat; ++i) {
      const double t0 = now_seconds();
      CHECK(attn_forward(plan, q, k, v, out, lse, ws, ws_bytes, NULL));
      t[i] = now_seconds() - t0;
    }
    res[0].t = summarise(t, o.repeat);
    res[0].done = 1;
    fprintf(stderr, "fwd: median %.3f ms\n", res[0].t.median_s * 1e3);
  }
  if (!isfinite(checksum(out, no, o.dtype))) die("the forward produced a NaN or inf");

  res[1].pass = "bwd";
  res[1].flops = info.flops_backward;
  if (o.run_bwd) {
    for (i = 0; i < o.warmup; ++i)
      CHECK(attn_backward(plan, q, k, v, out, lse, d_o, dq, dk, dv, ws, ws_bytes, NULL));
    for (i = 0; i < o.repeat; ++i) {
      const double t0 = now_seconds();
      CHECK(attn_backward(plan, q, k, v, out, lse, d_o, dq, dk, dv, ws, ws_bytes, NULL));
      t[i] = now_seconds() - t0;
    }
    res[1].t = summarise(t, o.repeat);
    res[1].done = 1;
    fprintf(stderr, "bwd: median %.3f ms\n", res[1].t.median_s * 1e3);
    if (!isfinite(checksum(dq, nq, o.dtype) + checksum(dk, nk, o.dtype) +
                  checksum(dv, nv, o.dtype)))
      die("the backward produced a NaN or inf");
  }

  /* sgemm of the attention's shapes, per head, then the square ceiling. */
  if (o.sgemm) {
    gq.name = "qk";
    gq.m = o.seqlen_q, gq.n = o.seqlen_kv, gq.k = o.head_dim_qk;
    gp.name = "pv";
    gp.m = o.seqlen_q, gp.n = o.head_dim_v, gp.k = o.seqlen_kv;
    gs.name = "square";
    gs.m = gs.n = gs.k = o.sgemm_square;
    sleep_ms(o.settle_ms); /* let OpenMP's threads stop spinning */
    time_sgemm(&gq, 1, o.warmup, o.repeat);
    time_sgemm(&gp, 0, o.warmup, o.repeat);
    if (o.sgemm_square > 0) time_sgemm(&gs, 0, o.warmup, o.repeat);
    rate_qk = gflops(gemm_flops(&gq), gq.t.median_s);
    rate_pv = gflops(gemm_flops(&gp), gp.t.median_s);
    if (gs.done) rate_sq = gflops(gemm_flops(&gs), gs.t.median_s);
    /* Flop-weighted harmonic means (the products of a pass have equal flops
     * when head_dim_qk == head_dim_v). */
    if (rate_qk > 0.0 && rate_pv > 0.0) {
      res[0].comparable = 2.0 / (1.0 / rate_qk + 1.0 / rate_pv);
      res[1].comparable = 5.0 / (2.0 / rate_qk + 3.0 / rate_pv);
    }
  }

  /* Human-readable results */
  printf("\n%-8s %-5s %12s %12s %12s %12s %12s %10s %10s\n", "case", "pass", "median ms",
         "min ms", "GFLOP", "GFLOP/s med", "GFLOP/s best", "/blas-cmp", "/square");
  for (i = 0; i < 2; ++i) {
    const pass_result_t *r = &res[i];
    const double g = gflops(r->flops, r->t.median_s);
    if (!r->done) continue;
    printf("%-8s %-5s %12.3f %12.3f %12.3f %12.2f %12.2f", label, r->pass, r->t.median_s * 1e3,
           r->t.min_s * 1e3, r->flops * 1e-9, g, gflops(r->flops, r->t.min_s));
    if (r->comparable > 0.0) printf(" %10.3f", g / r->comparable);
    else printf(" %10s", "-");
    if (rate_sq > 0.0) printf(" %10.3f\n", g / rate_sq);
    else printf(" %10s\n", "-");
  }
  if (o.sgemm) {
    const gemm_result_t *gr[3];
    gr[0] = &gq, gr[1] = &gp, gr[2] = &gs;
    printf("\nsgemm (fp32, row-major, %d threads)\n", blas_threads > 0 ? blas_threads : threads);
    printf("%-8s %20s %12s %12s %12s %12s %12s\n", "shape", "M x N x K", "median ms", "min ms",
           "GFLOP", "GFLOP/s med", "GFLOP/s best");
    for (i = 0; i < 3; ++i) {
      char dims[64];
      if (!gr[i]->done) continue;
      snprintf(dims, sizeof dims, "%lld x %lld x %lld", (long long)gr[i]->m,
               (long long)gr[i]->n, (long long)gr[i]->k);
      printf("%-8s %20s %12.3f %12.3f %12.3f %12.2f %12.2f\n", gr[i]->name, dims,
             gr[i]->t.median_s * 1e3, gr[i]->t.min_s * 1e3, gemm_flops(gr[i]) * 1e-9,
             gflops(gemm_flops(gr[i]), gr[i]->t.median_s),
             gflops(gemm_flops(gr[i]), gr[i]->t.min_s));
    }
    printf("comparable BLAS rate: forward %.2f GFLOP/s (qk + pv), backward %.2f GFLOP/s "
           "(2 qk + 3 pv)\n",
           res[0].comparable, res[1].comparable);
  }

  /* Machine-readable results */
  printf("\nmeta,version,%s\n", attn_version_string());
  printf("meta,summary,%s\n", summary);
  printf("meta,kernel,%s\n", info.kernel);
  printf("meta,algorithm,%s\n", info.algorithm);
  printf("meta,threads,%d\n", (int)threads);
  printf("meta,blas_threads,%d\n", blas_threads);
#if defined(BENCH_HAVE_OPENBLAS_GET_CORENAME)
  printf("meta,blas_core,%s\n", openblas_get_corename());
#endif
#if defined(BENCH_HAVE_OPENBLAS_GET_CONFIG)
  printf("meta,blas_config,%s\n", openblas_get_config());
#endif
  {
    const double wall = now_seconds() - wall_start, cpu = process_cpu_seconds() - cpu_start;
    printf("meta,process_wall_s,%.3f\n", wall);
    printf("meta,process_cpu_s,%.3f\n", cpu);
  }
  printf("csv,kind,case,pass,shape,dtype,threads,gflop,median_ms,min_ms,gflops_median,"
         "gflops_best,comparable_gflops,ratio_comparable,ratio_square\n");
  for (i = 0; i < 2; ++i) {
    const pass_result_t *r = &res[i];
    const double g = gflops(r->flops, r->t.median_s);
    if (!r->done) continue;
    printf("csv,attn,%s,%s,", label, r->pass);
    print_shape(stdout, &o);
    printf(",%s,%d,%.6f,%.4f,%.4f,%.3f,%.3f", dtype_name(o.dtype), (int)threads, r->flops * 1e-9,
           r->t.median_s * 1e3, r->t.min_s * 1e3, g, gflops(r->flops, r->t.min_s));
    print_optional(3, r->comparable);
    print_optional(4, r->comparable > 0.0 ? g / r->comparable : 0.0);
    print_optional(4, rate_sq > 0.0 ? g / rate_sq : 0.0);
    putchar('\n');
  }
  if (o.sgemm) {
    const gemm_result_t *gr[3];
    gr[0] = &gq, gr[1] = &gp, gr[2] = &gs;
    for (i = 0; i < 3; ++i) {
      if (!gr[i]->done) continue;
      printf("csv,sgemm,%s,-,%lldx%lldx%lld,fp32,%d,%.6f,%.4f,%.4f,%.3f,%.3f,,",
             gr[i]->name, (long long)gr[i]->m, (long long)gr[i]->n, (long long)gr[i]->k,
             blas_threads > 0 ? blas_threads : (int)threads, gemm_flops(gr[i]) * 1e-9,
             gr[i]->t.median_s * 1e3, gr[i]->t.min_s * 1e3,
             gflops(gemm_flops(gr[i]), gr[i]->t.median_s),
             gflops(gemm_flops(gr[i]), gr[i]->t.min_s));
      print_optional(4,
                     rate_sq > 0.0 ? gflops(gemm_flops(gr[i]), gr[i]->t.median_s) / rate_sq : 0.0);
      putchar('\n');
    }
  }

  free(t);
  free(ws);
  free(dv);
  free(dk);
  free(dq);
  free(d_o);
  free(lse);
  free(out);
  free(v);
  free(k);
  free(q);
  free(summary);
  CHECK(attn_plan_destroy(plan));
  CHECK(attn_plan_desc_destroy(desc));
  CHECK(attn_context_destroy(ctx));
  return 0;
}
