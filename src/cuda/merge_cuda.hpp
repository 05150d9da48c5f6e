// attn_merge_states on the CUDA backend (kernels/merge/merge_states.cuh).
#pragma once

#include <cstdint>

#include "core/context.hpp"
#include "core/tensor.hpp"

namespace attn::cuda {

// The most parts one call merges without lse_out (above it, launches chain
// through o_out and lse_out; see attn_merge_states).
int32_t merge_max_parts_without_lse();

// Shapes as plan/merge.hpp's; pointers are device memory of ctx.device.
// Enqueues on `stream`; never synchronises or allocates.
void merge_states(const ContextConfig& ctx, int32_t num_parts, const TensorDesc& o,
                  const TensorDesc& lse, const void* const* o_parts, const float* const* lse_parts,
                  void* o_out, float* lse_out, void* stream);

}  // namespace attn::cuda
