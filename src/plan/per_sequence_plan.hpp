// A varlen batch run sequence by sequence: one fixed-length plan per
// distinct (seqlen_q, seqlen_kv), each sequence's tensors viewed from its
// first token (see per_sequence_plan.cpp). What differs between backends
// comes in PerSequenceOps.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "plan/backend.hpp"
#include "plan/problem.hpp"

namespace attn {

struct PerSequenceOps {
  // The backend's plan of one sequence's fixed-length batch-1 problem.
  std::function<std::unique_ptr<BackendPlan>(const Problem&)> make_plan;
  // Copies `rows` rows of `width` floats, from rows src_pitch floats apart
  // to rows dst_pitch floats apart, in the order of `stream`.
  std::function<void(float* dst, int64_t dst_pitch, const float* src, int64_t src_pitch,
                     int64_t width, int64_t rows, void* stream)>
      copy_rows;
  // Checks an execution's pointers before any sequence runs (may be empty);
  // has_q / has_kv: whether the batch has query / key tokens at all (the
  // tensors of an empty side are not read, as in the whole-batch plans).
  std::function<void(const ForwardArgs&, bool has_q, bool has_kv)> check_forward;
  std::function<void(const BackwardArgs&, bool has_q, bool has_kv)> check_backward;
};

// problem: a validated MoBA or block-sparse problem on a varlen batch.
// Throws NOT_SUPPORTED for a kept MoBA selection (the sequences share one
// workspace), and what each sequence's plan throws.
std::unique_ptr<BackendPlan> make_per_sequence_plan(const Problem& problem,
                                                    const PerSequenceOps& ops);

}  // namespace attn
