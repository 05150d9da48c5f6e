#include "plan/merge.hpp"

#include "core/error.hpp"
#include "cpu/cpu_backend.hpp"

namespace attn {

void merge_states(const ContextConfig& ctx, int32_t num_parts, const TensorDesc& o,
                  const TensorDesc& lse, const void* const* o_parts, const float* const* lse_parts,
                  void* o_out, float* lse_out, void* stream) {
  (void)stream;  // the CPU merge is synchronous
  switch (ctx.backend) {
    case ATTN_BACKEND_CPU:
      cpu::merge_states(ctx, num_parts, o, lse, o_parts, lse_parts, o_out, lse_out);
      return;
    default:
      not_supported("attn_merge_states: the CUDA backend has no merge kernel in this build");
  }
}

}  // namespace attn
