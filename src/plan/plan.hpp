// Plan descriptors (mutable, filled by the setters) and plans (validated and
// bound to a backend).
#pragma once

#include <attn/attn.h>

#include <memory>
#include <optional>
#include <vector>

#include "core/context.hpp"
#include "core/tensor.hpp"
#include "plan/backend.hpp"
#include "plan/problem.hpp"

namespace attn {

struct PlanDesc {
  int64_t batch = 1, heads_q = 1, heads_kv = 1;
  int64_t seqlen_q = 0, seqlen_kv = 0;
  int64_t head_dim_qk = 0, head_dim_v = 0;
  attn_dtype_t dtype = ATTN_DTYPE_FP32;
  attn_layout_t layout = ATTN_LAYOUT_BSHD;
  bool layout_set = false;
  std::optional<TensorDesc> tensors[8];
  std::optional<float> scale;
  float softcap = 0.0f;
  attn_mask_t mask = ATTN_MASK_NONE;
  int64_t window_left = -1, window_right = -1;
  bool varlen = false;
  int64_t varlen_batch = 0;
  std::vector<int64_t> cu_q, cu_kv;
  bool allow_empty_rows = false;
  attn_passes_t passes = ATTN_PASSES_FORWARD;
  bool deterministic = false;
  std::shared_ptr<const BlockMask> block_mask;  // attn_plan_desc_set_block_mask
  int64_t moba_block = 0, moba_top_k = 0;        // attn_plan_desc_set_moba; 0: off
  bool moba_shared = false;
  bool moba_keep_selection = false;  // attn_plan_desc_set_moba_keep_selection
  std::vector<int64_t> diagonal_shift;  // internal, per sequence; see Problem::diagonal_shift
};

struct Plan {
  ContextConfig context;
  Problem problem;
  std::unique_ptr<BackendPlan> impl;
  uint64_t visible_pairs = 0;      // saturated at UINT64_MAX
  double visible_pairs_f = 0.0;     // the same in floating point, for the FLOP counts
  uint64_t visited_tile_pairs = 0, total_tile_pairs = 0;
  // A MoBA plan whose top_k keeps every past block, run as the causal plan.
  bool moba_keeps_every_block = false;

  void describe(attn_plan_info_t& info) const;  // fills a full-size struct
};

// Checks desc for consistency, builds the Problem and binds the backend.
// Throws attn::Error (INVALID_ARGUMENT, NOT_SUPPORTED, ...).
std::unique_ptr<Plan> create_plan(const ContextConfig& ctx, const PlanDesc& desc);

const char* tensor_role_name(attn_tensor_role_t role);

}  // namespace attn
