// MoBA plans on a varlen batch on the CUDA backend (see moba_varlen.cpp):
// a fixed-length MoBA plan per sequence length, run sequence by sequence.
#pragma once

#include <memory>

#include "core/context.hpp"
#include "plan/backend.hpp"
#include "plan/problem.hpp"

namespace attn::cuda {

// problem: a validated MoBA problem (moba_block > 0) on a varlen batch.
// Throws NOT_SUPPORTED for a kept selection, and what each sequence's plan
// throws.
std::unique_ptr<BackendPlan> make_varlen_moba_plan(const Problem& problem,
                                                   const ContextConfig& ctx);

}  // namespace attn::cuda
