// attn_merge_states, dispatched to the context's backend.
#pragma once

#include <cstdint>

#include "core/context.hpp"
#include "core/tensor.hpp"

namespace attn {

// Shapes are validated by the caller (src/api): o has ndim >= 2 dims with a
// unit last stride, lse the leading ndim - 1 dims, fp32.
void merge_states(const ContextConfig& ctx, int32_t num_parts, const TensorDesc& o,
                  const TensorDesc& lse, const void* const* o_parts, const float* const* lse_parts,
                  void* o_out, float* lse_out, void* stream);

}  // namespace attn
