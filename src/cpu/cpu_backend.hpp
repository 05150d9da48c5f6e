// The CPU backend's entry points, used by src/plan and src/api.
#pragma once

#include <memory>

#include "core/context.hpp"
#include "core/tensor.hpp"
#include "plan/backend.hpp"
#include "plan/per_sequence_plan.hpp"
#include "plan/problem.hpp"

namespace attn::cpu {

// Binds a validated problem to the CPU kernels. The instruction-set variant
// is the best the processor supports, or the one named by the environment
// variable ATTN_CPU_ISA (generic, avx2, avx512); naming one that is not
// built or not supported by the processor is NOT_SUPPORTED, an unknown name
// INVALID_ARGUMENT.
std::unique_ptr<BackendPlan> make_plan(const Problem& problem, const ContextConfig& ctx);

// What a plan run sequence by sequence (plan/per_sequence_plan.hpp) needs of
// this backend: its plans, and LSE rows copied on return. The CPU backend
// runs varlen MoBA natively; this serves the test hook
// ATTN_CPU_MOBA_PER_SEQUENCE=1, so that the CPU tests check that plan.
PerSequenceOps per_sequence_ops(const ContextConfig& ctx);

// Merge of partial (O, LSE) states; see attn_merge_states. Shapes are
// validated by the caller: o has ndim dims (last = head dim, stride 1), lse
// the leading ndim - 1 dims.
void merge_states(const ContextConfig& ctx, int32_t num_parts, const TensorDesc& o,
                  const TensorDesc& lse, const void* const* o_parts, const float* const* lse_parts,
                  void* o_out, float* lse_out);

}  // namespace attn::cpu
