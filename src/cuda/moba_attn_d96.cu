// MoBA's forward and backward kernels for head dimension 96 (fp16 and bf16).
#include "cuda/flash_bwd_launch.cuh"
#include "cuda/flash_fwd_launch.cuh"
#include "cuda/moba_kernels.hpp"

namespace attn::cuda {
FwdKernel fwd_kernel_moba_d96(bool bf16) { return make_fwd_kernel_moba<96>(bf16); }
FwdKernel fwd_kernel_moba_gather_d96(bool bf16) { return make_fwd_kernel_moba_gather<96>(bf16); }
BwdKernels bwd_kernels_moba_d96(bool bf16, int variant, bool gather) {
  return make_bwd_kernels_moba<96>(bf16, variant, gather);
}
}  // namespace attn::cuda
