#include "plan/merge.hpp"

#include "attn_config.h"
#include "core/error.hpp"
#include "cpu/cpu_backend.hpp"
#if ATTN_HAVE_CUDA
#include "cuda/merge_cuda.hpp"
#endif

namespace attn {

void merge_states(const ContextConfig& ctx, int32_t num_parts, const TensorDesc& o,
                  const TensorDesc& lse, const void* const* o_parts, const float* const* lse_parts,
                  void* o_out, float* lse_out, void* stream) {
  switch (ctx.backend) {
    case ATTN_BACKEND_CPU:  // synchronous: the stream is not used
      cpu::merge_states(ctx, num_parts, o, lse, o_parts, lse_parts, o_out, lse_out);
      return;
#if ATTN_HAVE_CUDA
    case ATTN_BACKEND_CUDA:
      cuda::merge_states(ctx, num_parts, o, lse, o_parts, lse_parts, o_out, lse_out, stream);
      return;
#endif
    default:
      not_supported("attn_merge_states: this build of libattn has no CUDA backend");
  }
}

}  // namespace attn
