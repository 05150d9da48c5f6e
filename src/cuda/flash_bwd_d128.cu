// Backward kernels (dense and block-sparse) for head dimension 128 (fp16 and bf16).
#include "cuda/flash_bwd_launch.cuh"

namespace attn::cuda {
BwdKernels bwd_kernels_d128(bool bf16, int variant, bool sparse) {
  return make_bwd_kernels<128>(bf16, variant, sparse);
}
}  // namespace attn::cuda
