/*
 * Helpers shared by the numerics tests: a seeded random generator, fp16 and
 * bf16 conversions, typed buffers with an exact fp64 mirror, output poisoning
 * and an error accumulator. Plain C99; no test framework is needed here.
 *
 * Reproducing a failure: every process draws one seed (from the clock, or
 * from the environment variable ATTN_TEST_SEED when set) and prints it on
 * first use. Each test case derives its own generator from that seed and
 * the case's name (tu_rng_for), so a case gets the same inputs whichever
 * other cases run with it.
 */
#ifndef ATTN_TESTUTIL_H
#define ATTN_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include <attn/attn.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Random numbers                                                            */
/* ------------------------------------------------------------------------ */

/* The process-wide seed. The first call reads ATTN_TEST_SEED (decimal or
 * 0x-hex) or, when unset, mixes the clock, and prints the seed to stderr. */
uint64_t tu_seed(void);

typedef struct tu_rng {
  uint64_t state;
} tu_rng;

/* A generator for one test case: the process seed mixed with a hash of
 * `label` (the case name). */
tu_rng tu_rng_for(const char *label);

uint64_t tu_rng_next(tu_rng *r);
double tu_rng_uniform(tu_rng *r, double lo, double hi); /* in [lo, hi) */
double tu_rng_normal(tu_rng *r, double mean, double sd);
int64_t tu_rng_int(tu_rng *r, int64_t lo, int64_t hi); /* in [lo, hi] */
/* a[0..n) becomes a random permutation of 0..n-1. */
void tu_rng_permutation(tu_rng *r, int32_t *a, size_t n);

/* ------------------------------------------------------------------------ */
/* Element types                                                             */
/* ------------------------------------------------------------------------ */

size_t tu_dtype_size(attn_dtype_t dtype);
const char *tu_dtype_name(attn_dtype_t dtype);
/* Unit roundoff of the type: 2^-24 (fp32), 2^-11 (fp16), 2^-8 (bf16). */
double tu_unit_roundoff(attn_dtype_t dtype);

/* Conversions, rounding to nearest even; infinities and NaN are kept and
 * fp16 overflow gives infinity. */
uint16_t tu_float_to_fp16(float f);
float tu_fp16_to_float(uint16_t h);
uint16_t tu_float_to_bf16(float f);
float tu_bf16_to_float(uint16_t h);

/* x rounded to `dtype` (through fp32 for fp16/bf16), returned as float. */
float tu_round_float(float x, attn_dtype_t dtype);

/* Element i of a buffer of `dtype`, exactly, as a double. */
double tu_load(const void *buf, size_t i, attn_dtype_t dtype);
/* Stores v (rounded to fp32, then to dtype) and returns the stored value
 * exactly. */
double tu_store(void *buf, size_t i, attn_dtype_t dtype, double v);

/* ------------------------------------------------------------------------ */
/* Filling and poisoning                                                     */
/* ------------------------------------------------------------------------ */

/* A typed buffer of n elements and its fp64 mirror: mirror[i] is always the
 * exact value of element i (what a reference computes with). */
typedef struct tu_buffer {
  void *data;
  double *mirror;
  size_t n;
  attn_dtype_t dtype;
} tu_buffer;

/* Allocates data and mirror (both poisoned). Aborts on out of memory. */
void tu_buffer_alloc(tu_buffer *b, attn_dtype_t dtype, size_t n);
void tu_buffer_free(tu_buffer *b);

/* Random values, never zero after rounding to the buffer's dtype:
 * uniform in [lo, hi), or normal(0, sd). */
void tu_fill_uniform(tu_rng *r, tu_buffer *b, double lo, double hi);
void tu_fill_normal(tu_rng *r, tu_buffer *b, double sd);
/* Element i := v rounded to the dtype (mirror updated). */
void tu_buffer_set(tu_buffer *b, size_t i, double v);
/* Number of elements whose data no longer equals the mirror (0 for an
 * input the library must not have written). */
size_t tu_buffer_changed(const tu_buffer *b);

/* Fills n elements with a NaN bit pattern (0x7fffffff for fp32, 0x7fff for
 * fp16 and bf16) that no correct computation produces: outputs are poisoned
 * before every run so that an element left unwritten is caught. */
void tu_poison(void *buf, attn_dtype_t dtype, size_t n);
/* Whether element i still holds the poison pattern (bitwise). */
int tu_is_poison(const void *buf, size_t i, attn_dtype_t dtype);
/* Fills raw memory (a workspace) with bytes 0xff: NaNs in every fp type. */
void tu_poison_bytes(void *p, size_t bytes);

/* ------------------------------------------------------------------------ */
/* Error accumulation                                                        */
/* ------------------------------------------------------------------------ */

/* Accumulates |got - ref| over the elements of one tensor and remembers
 * where the largest error was. An element is *bad* (and fails any
 * tolerance) when got is NaN or infinite while ref is finite, or when ref
 * is infinite and got is not the same infinity. */
typedef struct tu_err {
  const char *what;   /* tensor name, e.g. "O" */
  size_t count;       /* elements compared */
  double max_err;     /* max |got - ref| over the good elements */
  double max_ref;     /* max |ref| over the finite refs: shows the check is not vacuous */
  int64_t at[4];      /* (b, s, h, c) of max_err */
  double at_got, at_ref;
  size_t bad;         /* bad elements */
  int64_t bad_at[4];  /* the first bad one */
  double bad_got, bad_ref;
} tu_err;

void tu_err_init(tu_err *e, const char *what);
/* Index components that do not apply may be -1. */
void tu_err_add(tu_err *e, int64_t b, int64_t s, int64_t h, int64_t c, double got, double ref);
/* 1 when no element is bad and max_err <= tol. */
int tu_err_ok(const tu_err *e, double tol);
/* One line: "O: max err 1.2e-07 at (b 0, s 3, h 1, c 5) got .. ref .., tol ..". */
void tu_err_format(const tu_err *e, double tol, char *buf, size_t size);

/* ------------------------------------------------------------------------ */
/* KV cache and decode configurations                                        */
/* ------------------------------------------------------------------------ */

/* A cache configuration (window 0: none). */
attn_kv_cache_config_t tu_kv_cache_config(attn_dtype_t dtype, attn_kv_layout_t layout,
                                          int64_t page_size, int64_t num_pages, int64_t heads_kv,
                                          int64_t dim_qk, int64_t dim_v, int64_t window,
                                          int64_t sinks);
/* A decode configuration; softmax_scale and softcap 0 (their defaults),
 * kv_chunk_tokens 0 picks the chunk. */
attn_decode_config_t tu_decode_config(int64_t heads_q, int64_t max_batch,
                                      int64_t max_query_tokens, int64_t kv_chunk_tokens);

#ifdef __cplusplus
}
#endif

#endif /* ATTN_TESTUTIL_H */
