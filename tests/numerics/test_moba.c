/*
 * MoBA plans (attn_plan_desc_set_moba) against a direct fp64
 * implementation: the reference pools the keys of each block, gates every
 * past block, takes the top_k (ties: lower block index) plus the own block
 * (ref_moba_select), materialises that selection and runs the fp64
 * attention with the causal mask on top; the harness then checks O, LSE,
 * dQ, dK and dV with its usual tolerance rule and exact checks (harness.h).
 * Q and K are drawn from {-2, -1, 1, 2} so that the library's fp32 gates
 * equal the fp64 ones exactly and both pick the same blocks, ties included
 * (block sizes are powers of two wherever gates are compared). Run once per
 * CPU kernel variant (ATTN_CPU_ISA).
 */
#include <stddef.h>

#include "harness.h"

#define SHAPE(b, hq, hkv, lq, lk, d) NC_SHAPE(b, hq, hkv, lq, lk, d, d)
#define MOBA(block, k, shared) \
  .mask = ATTN_MASK_CAUSAL, .moba_block = (block), .moba_top_k = (k), .moba_shared = (shared), \
  .qk_integers = 1, .scale = 0.1f, .backward = 1

static const nc_case kCases[] = {
    {.name = "b16_top3_per_head_fp32", .dtype = ATTN_DTYPE_FP32, SHAPE(1, 2, 2, 200, 200, 32),
     MOBA(16, 3, 0), .threads = 1},
    {.name = "b32_top2_shared_gqa_bf16", .dtype = ATTN_DTYPE_BF16, SHAPE(2, 4, 2, 150, 300, 32),
     MOBA(32, 2, 1), .threads = 2},
    {.name = "b64_top1_per_head_gqa_fp16", .dtype = ATTN_DTYPE_FP16, SHAPE(1, 4, 2, 260, 260, 16),
     MOBA(64, 1, 0), .threads = 2},
    {.name = "b8_top4_shared_mqa_fp32", .dtype = ATTN_DTYPE_FP32, SHAPE(1, 3, 1, 120, 120, 8),
     MOBA(8, 4, 1), .threads = 2},
    {.name = "b48_top0_own_block_only_fp32", .dtype = ATTN_DTYPE_FP32, SHAPE(1, 2, 1, 170, 170, 24),
     MOBA(48, 0, 0), .threads = 1},
    {.name = "b48_top_all_is_causal_bf16", .dtype = ATTN_DTYPE_BF16, SHAPE(1, 2, 2, 100, 140, 32),
     MOBA(48, 100, 1), .threads = 2},
    {.name = "b16_bhsd_shuffled_strides_bf16", .dtype = ATTN_DTYPE_BF16, .layout = ATTN_LAYOUT_BHSD,
     SHAPE(2, 2, 1, 110, 110, 16), MOBA(16, 2, 1), .strides = NC_STRIDES_SHUFFLED, .threads = 2},
    {.name = "b16_q_gt_k_empty_rows_fp32", .dtype = ATTN_DTYPE_FP32, SHAPE(1, 2, 2, 130, 90, 16),
     MOBA(16, 2, 0), .threads = 2},
};

int main(void) {
  int rc = nc_isa_gate();
  if (rc != 0) return rc;
  return nc_run_group("moba", kCases, sizeof kCases / sizeof kCases[0], 0, 0, 1);
}
