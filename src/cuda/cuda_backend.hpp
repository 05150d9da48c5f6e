// The CUDA backend's entry point, used by src/plan (built only with CUDA).
#pragma once

#include <memory>

#include "core/context.hpp"
#include "plan/backend.hpp"
#include "plan/per_sequence_plan.hpp"
#include "plan/problem.hpp"

namespace attn::cuda {

// Binds a validated problem to the CUDA kernels on ctx.device. Throws
// NOT_SUPPORTED (naming the feature) for what the kernels cannot do: fp32,
// head dims other than 64/96/128/256 or unequal qk/v
// head dims, strides that are not multiples of 8 elements, a device older
// than sm_80 or one this build has no code for. May allocate small device
// metadata (varlen offsets, a block-sparse plan's tile lists), freed with
// the plan.
std::unique_ptr<BackendPlan> make_plan(const Problem& problem, const ContextConfig& ctx);

// What a plan run sequence by sequence (plan/per_sequence_plan.hpp) needs of
// this backend on ctx.device: the CUDA MoBA plans of varlen batches.
PerSequenceOps per_sequence_ops(const ContextConfig& ctx);

}  // namespace attn::cuda
