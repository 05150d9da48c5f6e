// The persistent sm_90a block-sparse forward for head dimension 64 (fp16 and
// bf16).
#include "cuda/flash_fwd_sm90_bsparse_persist_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_bsparse_persist_d64(bool bf16) {
  return make_fwd_kernel_sm90_bsparse_persist<64>(bf16);
}
}  // namespace attn::cuda
