// The persistent sm_90a block-sparse forward for head dimension 128 (fp16 and
// bf16).
#include "cuda/flash_fwd_sm90_bsparse_persist_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_bsparse_persist_d128(bool bf16) {
  return make_fwd_kernel_sm90_bsparse_persist<128>(bf16);
}
}  // namespace attn::cuda
