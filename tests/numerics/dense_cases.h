/*
 * Cases that the forward and the backward tests both run, word for word:
 * short and degenerate lengths, softcap, varlen batches with empty
 * sequences. Each list expands inside a test's case table with that test's
 * SHAPE and VARLEN, which decide whether the backward pass runs too.
 */
#ifndef ATTN_NUMERICS_DENSE_CASES_H
#define ATTN_NUMERICS_DENSE_CASES_H

#include "harness.h"

/* Lengths 1 and 7: a causal row with one key, causal rows with none, the diagonal alone. */
#define NC_CASES_SHORT \
  {.name = "len1x7_causal_fp16", .dtype = FP16, SHAPE(2, 2, 1, 1, 7, 32, 32), .mask = CAUSAL, \
   .threads = 2}, \
  {.name = "len7x1_causal_empty_fp32", .dtype = FP32, SHAPE(1, 2, 2, 7, 1, 16, 8), \
   .mask = CAUSAL, .threads = 1}, \
  {.name = "len7x7_diag_bf16_bhsd", .dtype = BF16, .layout = BHSD, SHAPE(2, 3, 3, 7, 7, 24, 24), \
   WIN(0, 0), .threads = 2}

/* No keys at all, no queries at all. */
#define NC_CASES_EMPTY \
  {.name = "no_keys_fp32", .dtype = FP32, SHAPE(2, 2, 1, 5, 0, 16, 16), .threads = 2}, \
  {.name = "no_queries_fp16", .dtype = FP16, SHAPE(1, 2, 2, 0, 9, 16, 16), .threads = 1}

/* Softcap with and without a scale, with GQA, with a window. */
#define NC_CASES_SOFTCAP \
  {.name = "softcap30_scale1_fp32", .dtype = FP32, SHAPE(1, 2, 2, 129, 129, 64, 64), \
   .scale = 1.0f, .softcap = 30.0f, .threads = 1}, \
  {.name = "softcap5_causal_fp16_gqa", .dtype = FP16, SHAPE(1, 4, 2, 100, 100, 32, 32), \
   .mask = CAUSAL, .softcap = 5.0f, .qk_sd = 2.0, .threads = 2}, \
  {.name = "softcap20_win_bf16", .dtype = BF16, SHAPE(1, 2, 2, 150, 150, 32, 32), WIN(30, 3), \
   .scale = 1.0f, .softcap = 20.0f, .threads = 1}, \
  /* a cap far above the logits: z = cap tanh(u / cap) ~ u, where tanh of a \
   * small argument must keep its relative precision */ \
  {.name = "softcap1000_small_logits_fp32", .dtype = FP32, SHAPE(1, 2, 1, 40, 50, 16, 16), \
   .softcap = 1000.0f, .threads = 1}

/* Varlen batches in which some sequences have no queries or no keys. */
#define NC_CASES_VARLEN_EMPTY \
  {.name = "varlen_q_empty_causal_fp32", .dtype = FP32, \
   VARLEN(4, 2, 2, ((const int32_t[]){37, 0, 129, 1}), ((const int32_t[]){50, 10, 129, 1}), 32, \
          32), \
   .mask = CAUSAL, .threads = 2}, \
  {.name = "varlen_kv_empty_fp16_gqa", .dtype = FP16, \
   VARLEN(4, 4, 2, ((const int32_t[]){20, 5, 0, 64}), ((const int32_t[]){0, 30, 7, 64}), 32, 32), \
   .threads = 1}, \
  {.name = "varlen_win_empty_bf16", .dtype = BF16, \
   VARLEN(3, 2, 2, ((const int32_t[]){129, 1, 50}), ((const int32_t[]){200, 300, 40}), 32, 16), \
   WIN(16, 4), .threads = 2}

#endif /* ATTN_NUMERICS_DENSE_CASES_H */
