// Backward kernels (dense and block-sparse) for head dimension 96 (fp16 and bf16).
#include "cuda/flash_bwd_launch.cuh"

namespace attn::cuda {
BwdKernels bwd_kernels_d96(bool bf16, int variant, bool sparse) {
  return make_bwd_kernels<96>(bf16, variant, sparse);
}
}  // namespace attn::cuda
