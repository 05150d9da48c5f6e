/* See testutil.h. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------ */
/* Random numbers: splitmix64, which is small, fast and good enough to draw */
/* test inputs.                                                              */
/* ------------------------------------------------------------------------ */

static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t tu_seed(void) {
  static int have_seed = 0;
  static uint64_t seed = 0;
  if (!have_seed) {
    const char *env = getenv("ATTN_TEST_SEED");
    if (env != NULL && env[0] != '\0') {
      seed = (uint64_t)strtoull(env, NULL, 0);
      fprintf(stderr, "test: seed %llu (from ATTN_TEST_SEED)\n", (unsigned long long)seed);
    } else {
      /* The clock, plus the address of a local as a little per-process
       * entropy (ASLR). Kept below 2^53 so it reads back as printed. */
      int local = 0;
      uint64_t t = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 20);
      seed = mix64(t ^ (uint64_t)(uintptr_t)&local) & ((1ULL << 53) - 1);
      fprintf(stderr, "test: seed %llu (rerun with ATTN_TEST_SEED=%llu to reproduce)\n",
              (unsigned long long)seed, (unsigned long long)seed);
    }
    have_seed = 1;
  }
  return seed;
}

tu_rng tu_rng_for(const char *label) {
  /* FNV-1a of the label, mixed with the seed. */
  uint64_t h = 0xcbf29ce484222325ULL;
  const unsigned char *p;
  tu_rng r;
  for (p = (const unsigned char *)label; *p != '\0'; ++p) h = (h ^ *p) * 0x100000001b3ULL;
  r.state = mix64(tu_seed() + 0x9e3779b97f4a7c15ULL) ^ h;
  return r;
}

uint64_t tu_rng_next(tu_rng *r) {
  r->state += 0x9e3779b97f4a7c15ULL;
  return mix64(r->state);
}

double tu_rng_uniform(tu_rng *r, double lo, double hi) {
  /* 53 random bits -> [0, 1) */
  double u = (double)(tu_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
  return lo + (hi - lo) * u;
}

double tu_rng_normal(tu_rng *r, double mean, double sd) {
  /* Box-Muller; u1 in (0, 1] so the log is finite. */
  const double two_pi = 6.283185307179586;
  double u1 = 1.0 - tu_rng_uniform(r, 0.0, 1.0);
  double u2 = tu_rng_uniform(r, 0.0, 1.0);
  return mean + sd * sqrt(-2.0 * log(u1)) * cos(two_pi * u2);
}

int64_t tu_rng_int(tu_rng *r, int64_t lo, int64_t hi) {
  uint64_t span = (uint64_t)(hi - lo) + 1;
  if (span == 0) return (int64_t)tu_rng_next(r); /* the whole range */
  return lo + (int64_t)(tu_rng_next(r) % span);
}

void tu_rng_permutation(tu_rng *r, int32_t *a, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i) a[i] = (int32_t)i;
  for (i = n; i > 1; --i) { /* Fisher-Yates */
    size_t j = (size_t)tu_rng_int(r, 0, (int64_t)i - 1);
    int32_t t = a[i - 1];
    a[i - 1] = a[j];
    a[j] = t;
  }
}

/* ------------------------------------------------------------------------ */
/* Element types                                                             */
/* ------------------------------------------------------------------------ */

size_t tu_dtype_size(attn_dtype_t dtype) { return dtype == ATTN_DTYPE_FP32 ? 4 : 2; }

const char *tu_dtype_name(attn_dtype_t dtype) {
  switch (dtype) {
    case ATTN_DTYPE_FP32: return "fp32";
    case ATTN_DTYPE_FP16: return "fp16";
    case ATTN_DTYPE_BF16: return "bf16";
  }
  return "?";
}

double tu_unit_roundoff(attn_dtype_t dtype) {
  switch (dtype) {
    case ATTN_DTYPE_FP32: return ldexp(1.0, -24);
    case ATTN_DTYPE_FP16: return ldexp(1.0, -11);
    case ATTN_DTYPE_BF16: return ldexp(1.0, -8);
  }
  return 1.0;
}

static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* v >> shift, rounded to nearest, ties to even. */
static uint32_t shift_round_even(uint32_t v, int shift) {
  uint32_t q, rem, half;
  if (shift <= 0) return v;
  if (shift >= 32) return 0;
  q = v >> shift;
  rem = v & ((1u << shift) - 1u);
  half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return q;
}

uint16_t tu_float_to_fp16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t mag = u & 0x7fffffffu;
  const int exp = (int)(mag >> 23) - 127; /* unbiased exponent of f */
  const uint32_t man = mag & 0x7fffffu;
  if (mag > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
  if (exp > 15) return (uint16_t)(sign | 0x7c00u);          /* infinity or overflow */
  if (exp >= -14) {
    /* A normal half: rebias and drop 13 mantissa bits. A carry out of the
     * mantissa moves into the exponent, up to infinity (0x7c00). */
    return (uint16_t)(sign | (((uint32_t)(exp + 15) << 10) + shift_round_even(man, 13)));
  }
  if ((mag >> 23) == 0) return sign; /* fp32 subnormal: far below half's range */
  /* A half subnormal (units of 2^-24): the significand with its implicit
   * bit, shifted; rounding up to 0x400 gives the smallest normal. */
  return (uint16_t)(sign | shift_round_even(man | 0x800000u, -1 - exp));
}

float tu_fp16_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float mag;
  if (exp == 0x1fu) return float_of(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    mag = ldexpf((float)man, -24);
    return sign ? -mag : mag;
  }
  return float_of(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t tu_float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return (uint16_t)((sign >> 16) | 0x7fc0u); /* NaN */
  /* Dropping 16 bits; a carry propagates into the exponent (to infinity
   * at the top). */
  return (uint16_t)((sign >> 16) | shift_round_even(mag, 16));
}

float tu_bf16_to_float(uint16_t h) { return float_of((uint32_t)h << 16); }

float tu_round_float(float x, attn_dtype_t dtype) {
  switch (dtype) {
    case ATTN_DTYPE_FP32: return x;
    case ATTN_DTYPE_FP16: return tu_fp16_to_float(tu_float_to_fp16(x));
    case ATTN_DTYPE_BF16: return tu_bf16_to_float(tu_float_to_bf16(x));
  }
  return x;
}

double tu_load(const void *buf, size_t i, attn_dtype_t dtype) {
  switch (dtype) {
    case ATTN_DTYPE_FP32: return ((const float *)buf)[i];
    case ATTN_DTYPE_FP16: return tu_fp16_to_float(((const uint16_t *)buf)[i]);
    case ATTN_DTYPE_BF16: return tu_bf16_to_float(((const uint16_t *)buf)[i]);
  }
  return NAN;
}

double tu_store(void *buf, size_t i, attn_dtype_t dtype, double v) {
  const float f = (float)v;
  switch (dtype) {
    case ATTN_DTYPE_FP32: ((float *)buf)[i] = f; break;
    case ATTN_DTYPE_FP16: ((uint16_t *)buf)[i] = tu_float_to_fp16(f); break;
    case ATTN_DTYPE_BF16: ((uint16_t *)buf)[i] = tu_float_to_bf16(f); break;
  }
  return tu_load(buf, i, dtype);
}

/* ------------------------------------------------------------------------ */
/* Buffers, filling, poisoning                                               */
/* ------------------------------------------------------------------------ */

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes == 0 ? 1 : bytes);
  if (p == NULL) {
    fprintf(stderr, "testutil: out of memory (%zu bytes)\n", bytes);
    abort();
  }
  return p;
}

void tu_buffer_alloc(tu_buffer *b, attn_dtype_t dtype, size_t n) {
  size_t i;
  b->dtype = dtype;
  b->n = n;
  b->data = xmalloc(n * tu_dtype_size(dtype));
  b->mirror = (double *)xmalloc(n * sizeof(double));
  tu_poison(b->data, dtype, n);
  for (i = 0; i < n; ++i) b->mirror[i] = NAN;
}

void tu_buffer_free(tu_buffer *b) {
  free(b->data);
  free(b->mirror);
  b->data = NULL;
  b->mirror = NULL;
  b->n = 0;
}

void tu_fill_uniform(tu_rng *r, tu_buffer *b, double lo, double hi) {
  size_t i;
  for (i = 0; i < b->n; ++i) {
    double v;
    do {
      v = tu_store(b->data, i, b->dtype, tu_rng_uniform(r, lo, hi));
    } while (v == 0.0);
    b->mirror[i] = v;
  }
}

void tu_fill_normal(tu_rng *r, tu_buffer *b, double sd) {
  size_t i;
  for (i = 0; i < b->n; ++i) {
    double v;
    do {
      v = tu_store(b->data, i, b->dtype, tu_rng_normal(r, 0.0, sd));
    } while (v == 0.0);
    b->mirror[i] = v;
  }
}

void tu_buffer_set(tu_buffer *b, size_t i, double v) {
  b->mirror[i] = tu_store(b->data, i, b->dtype, v);
}

size_t tu_buffer_changed(const tu_buffer *b) {
  size_t i, changed = 0;
  for (i = 0; i < b->n; ++i) {
    const double v = tu_load(b->data, i, b->dtype);
    /* NaN mirrors (poisoned, never filled) must still be NaN */
    if (!(v == b->mirror[i] || (isnan(v) && isnan(b->mirror[i])))) ++changed;
  }
  return changed;
}

void tu_poison(void *buf, attn_dtype_t dtype, size_t n) {
  size_t i;
  if (dtype == ATTN_DTYPE_FP32) {
    const uint32_t pattern = 0x7fffffffu;
    for (i = 0; i < n; ++i) memcpy((char *)buf + 4 * i, &pattern, 4);
  } else {
    uint16_t *h = (uint16_t *)buf;
    for (i = 0; i < n; ++i) h[i] = 0x7fffu;
  }
}

int tu_is_poison(const void *buf, size_t i, attn_dtype_t dtype) {
  if (dtype == ATTN_DTYPE_FP32) {
    uint32_t u;
    memcpy(&u, (const char *)buf + 4 * i, 4);
    return u == 0x7fffffffu;
  }
  return ((const uint16_t *)buf)[i] == 0x7fffu;
}

void tu_poison_bytes(void *p, size_t bytes) { memset(p, 0xff, bytes); }

/* ------------------------------------------------------------------------ */
/* Errors                                                                    */
/* ------------------------------------------------------------------------ */

void tu_err_init(tu_err *e, const char *what) {
  memset(e, 0, sizeof *e);
  e->what = what;
}

void tu_err_add(tu_err *e, int64_t b, int64_t s, int64_t h, int64_t c, double got, double ref) {
  int bad;
  ++e->count;
  if (isinf(ref))
    bad = got != ref;
  else
    bad = !isfinite(got);
  if (bad) {
    if (e->bad == 0) {
      e->bad_at[0] = b, e->bad_at[1] = s, e->bad_at[2] = h, e->bad_at[3] = c;
      e->bad_got = got;
      e->bad_ref = ref;
    }
    ++e->bad;
    return;
  }
  if (isinf(ref)) return; /* matching infinities: no error */
  if (fabs(ref) > e->max_ref) e->max_ref = fabs(ref);
  if (fabs(got - ref) > e->max_err) {
    e->max_err = fabs(got - ref);
    e->at[0] = b, e->at[1] = s, e->at[2] = h, e->at[3] = c;
    e->at_got = got;
    e->at_ref = ref;
  }
}

int tu_err_ok(const tu_err *e, double tol) { return e->bad == 0 && e->max_err <= tol; }

void tu_err_format(const tu_err *e, double tol, char *buf, size_t size) {
  int n = snprintf(buf, size,
                   "%s: max err %.3g (tol %.3g) at (b %lld, s %lld, h %lld, c %lld) got %.9g "
                   "ref %.9g; max |ref| %.3g over %zu elements",
                   e->what, e->max_err, tol, (long long)e->at[0], (long long)e->at[1],
                   (long long)e->at[2], (long long)e->at[3], e->at_got, e->at_ref, e->max_ref,
                   e->count);
  if (e->bad > 0 && n >= 0 && (size_t)n < size)
    snprintf(buf + n, size - (size_t)n,
             "; %zu BAD elements, first at (b %lld, s %lld, h %lld, c %lld) got %.9g ref %.9g",
             e->bad, (long long)e->bad_at[0], (long long)e->bad_at[1], (long long)e->bad_at[2],
             (long long)e->bad_at[3], e->bad_got, e->bad_ref);
}

attn_kv_cache_config_t tu_kv_cache_config(attn_dtype_t dtype, attn_kv_layout_t layout,
                                          int64_t page_size, int64_t num_pages, int64_t heads_kv,
                                          int64_t dim_qk, int64_t dim_v, int64_t window,
                                          int64_t sinks) {
  attn_kv_cache_config_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.dtype = dtype;
  c.layout = layout;
  c.page_size = page_size;
  c.num_pages = num_pages;
  c.heads_kv = heads_kv;
  c.head_dim_qk = dim_qk;
  c.head_dim_v = dim_v;
  c.window = window;
  c.sink_tokens = sinks;
  return c;
}

attn_decode_config_t tu_decode_config(int64_t heads_q, int64_t max_batch,
                                      int64_t max_query_tokens, int64_t kv_chunk_tokens) {
  attn_decode_config_t d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.heads_q = heads_q;
  d.max_batch = max_batch;
  d.max_query_tokens = max_query_tokens;
  d.kv_chunk_tokens = kv_chunk_tokens;
  return d;
}
