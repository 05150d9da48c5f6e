/*
 * Backward pass against the fp64 reference: dQ, dK, dV from the library's
 * own forward O and LSE (the forward is checked too). Same matrix as the
 * forward test, with fewer long sequences. Tolerance rule and exact checks:
 * harness.h. Run once per CPU kernel variant (ATTN_CPU_ISA).
 */
#include <stddef.h>

#include "dense_cases.h"
#include "harness.h"

/* Every case runs the backward pass too. */
#define SHAPE(...) NC_SHAPE(__VA_ARGS__), .backward = 1
#define VARLEN(...) NC_VARLEN(__VA_ARGS__), .backward = 1

static const nc_case kCases[] = {
    /* --- short and odd lengths ------------------------------------------------------ */
    {.name = "len1x1_fp32", .dtype = FP32, SHAPE(1, 2, 2, 1, 1, 16, 16), .threads = 1},
    NC_CASES_SHORT,

    /* --- degenerate sizes ------------------------------------------------------------ */
    NC_CASES_EMPTY,
    {.name = "batch64_len3_bf16", .dtype = BF16, SHAPE(64, 2, 1, 3, 5, 16, 16), .mask = CAUSAL,
     .threads = 2},
    {.name = "dims_512_fp32", .dtype = FP32, SHAPE(1, 2, 1, 20, 30, 512, 256), .mask = CAUSAL,
     .threads = 1},

    /* --- masks over several tiles ----------------------------------------------------- */
    {.name = "len129_none_fp32", .dtype = FP32, SHAPE(2, 2, 2, 129, 129, 64, 64), .threads = 2},
    {.name = "len129_causal_fp16_bhsd_gqa2", .dtype = FP16, .layout = BHSD,
     SHAPE(1, 4, 2, 129, 129, 64, 64), .mask = CAUSAL, .threads = 1},
    {.name = "len500_causal_fp32", .dtype = FP32, SHAPE(1, 1, 1, 500, 500, 32, 32),
     .mask = CAUSAL, .threads = 2},
    {.name = "len100x400_causal_bf16_mqa", .dtype = BF16, SHAPE(1, 2, 1, 100, 400, 32, 32),
     .mask = CAUSAL, .threads = 1},
    {.name = "len400x100_causal_empty_fp32", .dtype = FP32, SHAPE(1, 2, 2, 400, 100, 40, 24),
     .mask = CAUSAL, .threads = 2},
    {.name = "win_0_0_fp32", .dtype = FP32, SHAPE(1, 2, 2, 150, 150, 32, 32), WIN(0, 0),
     .threads = 1},
    {.name = "win_3_5_fp16", .dtype = FP16, SHAPE(1, 2, 2, 200, 200, 32, 32), WIN(3, 5),
     .threads = 2},
    {.name = "win_95_0_tile_edge_fp32", .dtype = FP32, SHAPE(1, 1, 1, 300, 300, 16, 16),
     WIN(95, 0), .threads = 1},
    {.name = "win_some_rows_empty_bf16", .dtype = BF16, SHAPE(1, 2, 2, 129, 40, 32, 32),
     WIN(10, 0), .threads = 2},
    {.name = "win_unbounded_left_empty_fp32", .dtype = FP32, SHAPE(1, 1, 1, 300, 129, 32, 32),
     WIN(-1, 2), .threads = 1},
    {.name = "win_keys_unseen_fp32", .dtype = FP32, SHAPE(1, 2, 2, 100, 300, 16, 16), WIN(5, 0),
     .threads = 2},
    {.name = "win_7_unbounded_fp16_bhsd", .dtype = FP16, .layout = BHSD,
     SHAPE(1, 2, 2, 129, 200, 32, 32), WIN(7, -1), .threads = 1},

    /* --- GQA / MQA: dK and dV sum over the group ----------------------------------------- */
    {.name = "gqa2_fp32", .dtype = FP32, SHAPE(2, 8, 4, 57, 71, 32, 32), .threads = 1},
    {.name = "gqa4_causal_bf16_bhsd", .dtype = BF16, .layout = BHSD,
     SHAPE(1, 8, 2, 57, 71, 32, 32), .mask = CAUSAL, .threads = 2},
    {.name = "mqa_win_fp16", .dtype = FP16, SHAPE(1, 8, 1, 57, 71, 32, 32), WIN(20, 5),
     .threads = 1},
    {.name = "gqa8_causal_fp32", .dtype = FP32, SHAPE(1, 16, 2, 33, 97, 16, 16), .mask = CAUSAL,
     .threads = 2},

    /* --- head dims -------------------------------------------------------------------------- */
    {.name = "dims_64_32_fp32", .dtype = FP32, SHAPE(1, 2, 2, 129, 129, 64, 32), .threads = 1},
    {.name = "dims_40_72_causal_fp16", .dtype = FP16, SHAPE(1, 2, 1, 100, 130, 40, 72),
     .mask = CAUSAL, .threads = 2},
    {.name = "dims_7_13_fp32_bhsd", .dtype = FP32, .layout = BHSD, SHAPE(1, 3, 1, 40, 60, 7, 13),
     .mask = CAUSAL, .threads = 1},
    {.name = "dims_1_1_bf16", .dtype = BF16, SHAPE(1, 1, 1, 20, 20, 1, 1), .threads = 2},
    {.name = "dims_160_96_fp32", .dtype = FP32, SHAPE(1, 1, 1, 100, 100, 160, 96),
     .mask = CAUSAL, .threads = 2},

    /* --- softcap ------------------------------------------------------------------------------ */
    NC_CASES_SOFTCAP,
    {.name = "softcap2_saturated_fp32", .dtype = FP32, SHAPE(1, 2, 1, 97, 120, 32, 32),
     .mask = CAUSAL, .softcap = 2.0f, .qk_sd = 3.0, .threads = 2},

    /* --- varlen with empty sequences --------------------------------------------------------- */
    NC_CASES_VARLEN_EMPTY,

    /* --- strides ----------------------------------------------------------------------------- */
    {.name = "packed_qkv_causal_fp32_gqa", .dtype = FP32, SHAPE(2, 4, 2, 129, 129, 32, 32),
     .mask = CAUSAL, .strides = NC_STRIDES_PACKED, .threads = 1},
    {.name = "packed_qkv_bhsd_bf16", .dtype = BF16, .layout = BHSD,
     SHAPE(1, 2, 2, 100, 100, 64, 64), .strides = NC_STRIDES_PACKED, .threads = 2},
    {.name = "packed_qkv_varlen_fp16", .dtype = FP16,
     VARLEN(3, 3, 1, ((const int32_t[]){97, 0, 15}), ((const int32_t[]){97, 0, 15}), 32, 32),
     .mask = CAUSAL, .strides = NC_STRIDES_PACKED, .threads = 1},
    {.name = "padded_win_fp32", .dtype = FP32, SHAPE(2, 2, 2, 129, 70, 40, 24), WIN(20, 10),
     .strides = NC_STRIDES_PADDED, .threads = 2},
    {.name = "padded_bhsd_causal_fp16_gqa", .dtype = FP16, .layout = BHSD,
     SHAPE(2, 6, 3, 50, 150, 32, 32), .mask = CAUSAL, .strides = NC_STRIDES_PADDED, .threads = 1},
    {.name = "padded_varlen_bf16", .dtype = BF16,
     VARLEN(3, 2, 2, ((const int32_t[]){33, 100, 0}), ((const int32_t[]){40, 100, 9}), 16, 24),
     .strides = NC_STRIDES_PADDED, .threads = 2},

    {.name = "shuffled_strides_causal_fp32_gqa", .dtype = FP32,
     SHAPE(2, 4, 2, 129, 100, 32, 24), .mask = CAUSAL, .strides = NC_STRIDES_SHUFFLED,
     .threads = 2},
    {.name = "shuffled_strides_varlen_bf16", .dtype = BF16,
     VARLEN(3, 2, 1, ((const int32_t[]){60, 0, 100}), ((const int32_t[]){30, 20, 130}), 24, 40),
     WIN(16, 16), .strides = NC_STRIDES_SHUFFLED, .threads = 1},
    {.name = "broadcast_kv_fp16", .dtype = FP16, SHAPE(3, 2, 1, 50, 120, 32, 32), .mask = CAUSAL,
     .strides = NC_STRIDES_BROADCAST_KV, .threads = 2},

    /* --- strong capping of large products: the logit's rounding lies before the cap ------ */
    {.name = "softcap075_scale6_sd25_fp32", .dtype = FP32, SHAPE(1, 2, 2, 118, 76, 72, 16),
     .mask = CAUSAL, .scale = 6.375f, .softcap = 0.75f, .qk_sd = 2.5, .threads = 2},

    /* --- every key alike: the true dQ is 0, all that remains is error -------------------- */
    {.name = "uniform_kv_fp32", .dtype = FP32, SHAPE(2, 4, 2, 60, 500, 8, 8), .uniform_kv = 1,
     .threads = 2},

    /* --- large logits ------------------------------------------------------------------ */
    {.name = "logits_scale10_rising_fp32", .dtype = FP32, SHAPE(1, 2, 2, 200, 300, 32, 32),
     .scale = 10.0f, .qk_sd = 0.3, .logit_trend = 1, .threads = 1},
    {.name = "logits_big_inputs_causal_fp16", .dtype = FP16, SHAPE(1, 2, 2, 200, 200, 64, 64),
     .mask = CAUSAL, .qk_sd = 3.0, .threads = 2},
};

int main(void) {
  int rc = nc_isa_gate();
  if (rc != 0) return rc;
  return nc_run_group("backward", kCases, sizeof kCases / sizeof kCases[0], 12, 250, 1);
}
