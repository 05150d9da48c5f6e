/*
 * Forward pass against the fp64 reference: O and LSE over a matrix of
 * masks, GQA ratios, lengths, varlen batches, head dims, softcap, dtypes,
 * layouts and strides. The tolerance rule and the exact checks are in
 * harness.h. Run once per CPU kernel variant (ATTN_CPU_ISA, see meson.build).
 */
#include <stddef.h>

#include "dense_cases.h"
#include "harness.h"

#define SHAPE NC_SHAPE
#define VARLEN NC_VARLEN

static const nc_case kCases[] = {
    /* --- lengths 1 and 7, square and not ------------------------------------- */
    {.name = "len1x1_none_fp32", .dtype = FP32, SHAPE(1, 2, 2, 1, 1, 16, 16), .threads = 1},
    NC_CASES_SHORT,

    /* --- degenerate sizes ------------------------------------------------------------- */
    NC_CASES_EMPTY,
    {.name = "varlen_all_kv_empty_bf16", .dtype = BF16,
     VARLEN(3, 2, 2, ((const int32_t[]){4, 0, 2}), ((const int32_t[]){0, 0, 0}), 8, 8),
     .threads = 2},
    {.name = "batch64_len3_fp16", .dtype = FP16, SHAPE(64, 2, 1, 3, 5, 16, 16), .mask = CAUSAL,
     .threads = 2},
    {.name = "heads32_8_fp32", .dtype = FP32, SHAPE(1, 32, 8, 20, 30, 16, 16), .threads = 2},
    {.name = "dims_1024_fp32", .dtype = FP32, SHAPE(1, 1, 1, 20, 30, 1024, 1024), .mask = CAUSAL,
     .threads = 1},
    {.name = "dims_1024_3_bf16", .dtype = BF16, SHAPE(1, 2, 1, 9, 100, 1024, 3), .threads = 2},
    {.name = "lse_null_fp32", .dtype = FP32, SHAPE(1, 2, 2, 129, 129, 32, 32), .mask = CAUSAL,
     .no_lse = 1, .threads = 2},
    {.name = "lse_null_varlen_fp16", .dtype = FP16,
     VARLEN(2, 2, 1, ((const int32_t[]){30, 7}), ((const int32_t[]){0, 20}), 16, 16),
     .no_lse = 1, .threads = 1},

    /* --- masks over several 96-row tiles ------------------------------------------ */
    {.name = "len129_none_fp32", .dtype = FP32, SHAPE(2, 4, 4, 129, 129, 64, 64), .threads = 1},
    {.name = "len129_causal_fp16_bhsd_gqa2", .dtype = FP16, .layout = BHSD,
     SHAPE(2, 4, 2, 129, 129, 64, 64), .mask = CAUSAL, .threads = 2},
    {.name = "len1000_causal_fp32", .dtype = FP32, SHAPE(1, 1, 1, 1000, 1000, 32, 32),
     .mask = CAUSAL, .threads = 2},
    {.name = "len129x1000_causal_bf16_mqa", .dtype = BF16, SHAPE(1, 2, 1, 129, 1000, 64, 64),
     .mask = CAUSAL, .threads = 1},
    {.name = "len1000x129_causal_empty_fp32", .dtype = FP32, SHAPE(1, 2, 2, 1000, 129, 40, 72),
     .mask = CAUSAL, .threads = 2},
    {.name = "len1000x7_none_fp16", .dtype = FP16, SHAPE(1, 1, 1, 1000, 7, 16, 16), .threads = 1},
    {.name = "win_0_0_fp32", .dtype = FP32, SHAPE(1, 2, 2, 200, 200, 32, 32), WIN(0, 0),
     .threads = 1},
    {.name = "win_left_beyond_lk_fp16", .dtype = FP16, SHAPE(1, 2, 2, 129, 300, 32, 32),
     WIN(5000, 0), .threads = 2},
    {.name = "win_3_5_bf16", .dtype = BF16, SHAPE(2, 2, 2, 200, 200, 32, 32), WIN(3, 5),
     .threads = 1},
    {.name = "win_95_0_tile_edge_fp32", .dtype = FP32, SHAPE(1, 1, 1, 300, 300, 16, 16),
     WIN(95, 0), .threads = 2},
    {.name = "win_96_1_tile_edge_fp16_bhsd", .dtype = FP16, .layout = BHSD,
     SHAPE(1, 1, 1, 290, 290, 16, 16), WIN(96, 1), .threads = 1},
    {.name = "win_some_rows_empty_fp32", .dtype = FP32, SHAPE(1, 2, 2, 129, 40, 32, 32),
     WIN(10, 0), .threads = 1},
    {.name = "win_unbounded_left_empty_fp16", .dtype = FP16, SHAPE(1, 2, 2, 300, 129, 32, 32),
     WIN(-1, 2), .threads = 2},
    {.name = "win_unbounded_right_fp32", .dtype = FP32, SHAPE(1, 2, 2, 129, 200, 32, 32),
     WIN(7, -1), .threads = 1},
    {.name = "win_0_unbounded_bf16_bhsd", .dtype = BF16, .layout = BHSD,
     SHAPE(1, 2, 2, 100, 100, 32, 32), WIN(0, -1), .threads = 2},
    {.name = "win_rows_past_keys_fp32", .dtype = FP32, SHAPE(1, 1, 1, 50, 200, 16, 16),
     WIN(2, 3), .threads = 1},
    {.name = "len1000_win_100_20_bf16", .dtype = BF16, SHAPE(1, 1, 1, 1000, 1000, 64, 64),
     WIN(100, 20), .threads = 2},

    /* --- GQA / MQA ------------------------------------------------------------------ */
    {.name = "gqa2_fp32", .dtype = FP32, SHAPE(2, 8, 4, 57, 71, 32, 32), .threads = 2},
    {.name = "gqa4_causal_fp16_bhsd", .dtype = FP16, .layout = BHSD, SHAPE(1, 8, 2, 57, 71, 32, 32),
     .mask = CAUSAL, .threads = 1},
    {.name = "mqa_win_bf16", .dtype = BF16, SHAPE(1, 8, 1, 57, 71, 32, 32), WIN(20, 5),
     .threads = 2},
    {.name = "gqa8_causal_fp32", .dtype = FP32, SHAPE(1, 16, 2, 33, 97, 16, 16), .mask = CAUSAL,
     .threads = 1},

    /* --- head dims --------------------------------------------------------------------- */
    {.name = "dims_64_32_fp32", .dtype = FP32, SHAPE(1, 2, 2, 129, 129, 64, 32), .threads = 2},
    {.name = "dims_40_72_causal_fp16", .dtype = FP16, SHAPE(1, 2, 1, 100, 130, 40, 72),
     .mask = CAUSAL, .threads = 1},
    {.name = "dims_7_7_fp32", .dtype = FP32, SHAPE(2, 2, 2, 50, 50, 7, 7), .threads = 1},
    {.name = "dims_7_13_bf16_bhsd", .dtype = BF16, .layout = BHSD, SHAPE(1, 3, 1, 40, 60, 7, 13),
     .mask = CAUSAL, .threads = 2},
    {.name = "dims_1_1_fp32", .dtype = FP32, SHAPE(1, 1, 1, 20, 20, 1, 1), .threads = 1},
    {.name = "dims_1_5_fp16", .dtype = FP16, SHAPE(1, 2, 2, 20, 33, 1, 5), .mask = CAUSAL,
     .threads = 2},
    {.name = "dims_256_128_fp32", .dtype = FP32, SHAPE(1, 1, 1, 100, 100, 256, 128),
     .mask = CAUSAL, .threads = 2},

    /* --- softcap ------------------------------------------------------------------------ */
    NC_CASES_SOFTCAP,

    /* --- varlen ---------------------------------------------------------------------------- */
    NC_CASES_VARLEN_EMPTY,
    {.name = "varlen_long_causal_fp32", .dtype = FP32,
     VARLEN(3, 2, 1, ((const int32_t[]){300, 7, 200}), ((const int32_t[]){250, 1, 400}), 32, 32),
     .mask = CAUSAL, .threads = 1},

    /* --- strides ------------------------------------------------------------------------------ */
    {.name = "packed_qkv_causal_fp32_gqa", .dtype = FP32, SHAPE(2, 4, 2, 129, 129, 32, 32),
     .mask = CAUSAL, .strides = NC_STRIDES_PACKED, .threads = 2},
    {.name = "packed_qkv_bhsd_fp16", .dtype = FP16, .layout = BHSD,
     SHAPE(1, 2, 2, 100, 100, 64, 64), .strides = NC_STRIDES_PACKED, .threads = 1},
    {.name = "packed_qkv_varlen_bf16", .dtype = BF16,
     VARLEN(3, 3, 1, ((const int32_t[]){97, 0, 15}), ((const int32_t[]){97, 0, 15}), 32, 32),
     .mask = CAUSAL, .strides = NC_STRIDES_PACKED, .threads = 2},
    {.name = "padded_win_fp32", .dtype = FP32, SHAPE(2, 2, 2, 129, 70, 40, 24), WIN(20, 10),
     .strides = NC_STRIDES_PADDED, .threads = 1},
    {.name = "padded_bhsd_causal_bf16_gqa", .dtype = BF16, .layout = BHSD,
     SHAPE(2, 6, 3, 50, 150, 32, 32), .mask = CAUSAL, .strides = NC_STRIDES_PADDED, .threads = 2},
    {.name = "padded_varlen_fp16", .dtype = FP16,
     VARLEN(3, 2, 2, ((const int32_t[]){33, 100, 0}), ((const int32_t[]){40, 100, 9}), 16, 24),
     .strides = NC_STRIDES_PADDED, .threads = 1},

    {.name = "shuffled_strides_causal_fp16_gqa", .dtype = FP16, SHAPE(2, 4, 2, 129, 100, 32, 24),
     .mask = CAUSAL, .strides = NC_STRIDES_SHUFFLED, .threads = 2},
    {.name = "shuffled_strides_varlen_fp32", .dtype = FP32,
     VARLEN(3, 2, 1, ((const int32_t[]){60, 0, 100}), ((const int32_t[]){30, 20, 130}), 24, 40),
     WIN(16, 16), .strides = NC_STRIDES_SHUFFLED, .threads = 1},
    {.name = "broadcast_kv_win_bf16_bhsd", .dtype = BF16, .layout = BHSD,
     SHAPE(3, 2, 1, 50, 120, 32, 32), WIN(20, 5), .strides = NC_STRIDES_BROADCAST_KV,
     .threads = 2},

    /* --- large logits: the running max moves from tile to tile ---------------------------- */
    {.name = "logits_scale12_rising_fp32", .dtype = FP32, SHAPE(1, 2, 2, 300, 300, 64, 64),
     .scale = 12.0f, .qk_sd = 0.3, .logit_trend = 1, .threads = 2},
    {.name = "logits_scale10_falling_causal_fp32", .dtype = FP32, SHAPE(1, 2, 2, 300, 300, 64, 64),
     .mask = CAUSAL, .scale = 10.0f, .logit_trend = -1, .threads = 1},
    {.name = "logits_big_inputs_fp32", .dtype = FP32, SHAPE(1, 2, 2, 200, 500, 64, 64),
     .scale = 0.5f, .qk_sd = 3.0, .threads = 2},
    {.name = "logits_scale10_rising_bf16", .dtype = BF16, SHAPE(1, 1, 1, 200, 400, 32, 32),
     .scale = 10.0f, .logit_trend = 1, .threads = 1},
    {.name = "logits_big_inputs_fp16", .dtype = FP16, SHAPE(1, 2, 2, 300, 300, 64, 64),
     .qk_sd = 4.0, .logit_trend = 1, .threads = 2},
};

int main(void) {
  int rc = nc_isa_gate();
  if (rc != 0) return rc;
  return nc_run_group("forward", kCases, sizeof kCases / sizeof kCases[0], 16, 400, 0);
}
