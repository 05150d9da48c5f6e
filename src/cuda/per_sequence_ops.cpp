// The CUDA side of a plan run sequence by sequence (plan/per_sequence_plan):
// the CUDA plan of each sequence, the LSE rows copied on the stream, and the
// pointers checked as attn_forward / attn_backward require on CUDA.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "core/error.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_util.hpp"

namespace attn::cuda {

PerSequenceOps per_sequence_ops(const ContextConfig& ctx) {
  PerSequenceOps ops;
  ops.make_plan = [ctx](const Problem& p) { return make_plan(p, ctx); };
  const int32_t device = ctx.device;
  ops.copy_rows = [device](float* dst, int64_t dst_pitch, const float* src, int64_t src_pitch,
                           int64_t width, int64_t rows, void* stream) {
    DeviceScope scope(device, "backend CUDA (varlen, sequence by sequence)");
    const auto s = static_cast<cudaStream_t>(stream);
    // 2D copies take pitches below 2^31 bytes (cudaDevAttrMaxPitch); a
    // varlen LSE of more queries is copied a row at a time.
    if (sizeof(float) * uint64_t(std::max(dst_pitch, src_pitch)) < (uint64_t(1) << 31)) {
      check(cudaMemcpy2DAsync(dst, sizeof(float) * size_t(dst_pitch), src,
                              sizeof(float) * size_t(src_pitch), sizeof(float) * size_t(width),
                              size_t(rows), cudaMemcpyDeviceToDevice, s),
            "cudaMemcpy2DAsync (a sequence's LSE)");
      return;
    }
    for (int64_t r = 0; r < rows; ++r)
      check(cudaMemcpyAsync(dst + r * dst_pitch, src + r * src_pitch, sizeof(float) * size_t(width),
                            cudaMemcpyDeviceToDevice, s),
            "cudaMemcpyAsync (a sequence's LSE)");
  };
  // As CudaPlan::forward / backward check them: the tensors of a side with
  // no tokens are not read.
  ops.check_forward = [](const ForwardArgs& a, bool has_q, bool has_kv) {
    if (!has_q) return;  // nothing runs
    require_aligned(a.q, "q"), require_aligned(a.o, "o");
    if (has_kv) require_aligned(a.k, "k"), require_aligned(a.v, "v");
    require_aligned(a.workspace, "workspace");
    require_lse_aligned(a.lse);
  };
  ops.check_backward = [](const BackwardArgs& a, bool has_q, bool has_kv) {
    if (has_q) {
      require_aligned(a.q, "q"), require_aligned(a.o, "o"), require_aligned(a.d_o, "d_o");
      require_aligned(a.dq, "dq");
      require_lse_aligned(a.lse);
    }
    if (has_kv) {
      require_aligned(a.k, "k"), require_aligned(a.v, "v");
      require_aligned(a.dk, "dk"), require_aligned(a.dv, "dv");
    }
    require_aligned(a.workspace, "workspace");
  };
  return ops;
}

}  // namespace attn::cuda
