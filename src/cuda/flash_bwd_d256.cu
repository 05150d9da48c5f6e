// Backward kernels (dense and block-sparse) for head dimension 256 (fp16 and bf16).
#include "cuda/flash_bwd_launch.cuh"

namespace attn::cuda {
BwdKernels bwd_kernels_d256(bool bf16, int variant, bool sparse) {
  return make_bwd_kernels<256>(bf16, variant, sparse);
}
}  // namespace attn::cuda
