// The validated, backend-neutral description of one attention problem, as a
// plan freezes it. Backends read only this.
#pragma once

#include <attn/attn.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "schedule/block_mask.hpp"
#include "schedule/dense_schedule.hpp"

namespace attn {

// Where element (batch b, position s, head h, channel c) of a Q/K/V/O-like
// tensor lives: seq_offset(b) + s * seq + h * head + c. For fixed-length
// batches seq_offset(b) = b * batch; for varlen (THD) it is cu[b] * seq.
struct TensorStrides {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head = 0;
};

struct Problem {
  attn_dtype_t dtype = ATTN_DTYPE_FP32;
  attn_layout_t layout = ATTN_LAYOUT_BSHD;
  int64_t batch = 1;
  int64_t heads_q = 1, heads_kv = 1;
  int64_t seqlen_q = 0, seqlen_kv = 0;  // max over the batch for varlen
  int64_t head_dim_qk = 0, head_dim_v = 0;
  float scale = 1.0f;
  float softcap = 0.0f;  // 0: off
  attn_mask_t mask = ATTN_MASK_NONE;
  WindowBounds window;   // the mask as bounds (causal = {-1, 0})
  bool varlen = false;
  std::vector<int64_t> cu_q, cu_kv;  // batch + 1 offsets (also for fixed length)
  bool allow_empty_rows = false;
  bool backward = false;
  // Bit-identical gradients run after run (attn_plan_desc_set_deterministic);
  // the CPU backend always is.
  bool deterministic = false;
  // Block-sparse selection on top of the window; null for dense plans.
  std::shared_ptr<const BlockMask> block_mask;
  // MoBA: a run-time block selection on top of the causal mask; 0: off.
  int64_t moba_block = 0, moba_top_k = 0;
  bool moba_shared = false;  // one selection per GQA group (else per query head)
  // The forward leaves the selection at the start of its workspace and the
  // backward reads it there (attn_plan_desc_set_moba_keep_selection).
  bool moba_keep_selection = false;
  int64_t moba_num_blocks() const { return (seqlen_kv + moba_block - 1) / moba_block; }
  int64_t moba_heads() const { return moba_shared ? heads_kv : heads_q; }
  // diagonal_shift[b] is added to the bottom-right diagonal offset lk - lq
  // of sequence b (empty: 0 for every sequence). Internal (no public
  // setter): ring steps run blocks of longer sequences as dense problems
  // that keep their global alignment, which for a varlen batch differs per
  // sequence. Empty for user plans.
  std::vector<int64_t> diagonal_shift;

  // Indexed by attn_tensor_role_t.
  TensorStrides strides[8];

  int64_t group() const { return heads_q / heads_kv; }
  int64_t total_q() const { return cu_q.back(); }
  int64_t total_kv() const { return cu_kv.back(); }
  int64_t lq(int64_t b) const { return cu_q[b + 1] - cu_q[b]; }
  int64_t lk(int64_t b) const { return cu_kv[b + 1] - cu_kv[b]; }
  int64_t shift(int64_t b) const { return diagonal_shift.empty() ? 0 : diagonal_shift[size_t(b)]; }
  SequenceMask sequence_mask(int64_t b) const {
    return SequenceMask(lq(b), lk(b), window, lk(b) - lq(b) + shift(b));
  }

  // Element offset of (b, s, h, 0) in tensor `role`.
  int64_t offset(attn_tensor_role_t role, int64_t b, int64_t s, int64_t h) const {
    const TensorStrides& t = strides[role];
    bool is_q_side = role == ATTN_TENSOR_Q || role == ATTN_TENSOR_O || role == ATTN_TENSOR_DO ||
                     role == ATTN_TENSOR_DQ;
    int64_t base = varlen ? (is_q_side ? cu_q[b] : cu_kv[b]) * t.seq : b * t.batch;
    return base + s * t.seq + h * t.head;
  }
  // Offset of LSE row (b, h, s): [batch, heads_q, seqlen_q] or, varlen,
  // [heads_q, total_q].
  int64_t lse_offset(int64_t b, int64_t h, int64_t s) const {
    return varlen ? h * total_q() + cu_q[b] + s : (b * heads_q + h) * seqlen_q + s;
  }
  int64_t lse_elements() const { return varlen ? heads_q * total_q() : batch * heads_q * seqlen_q; }
};

}  // namespace attn
