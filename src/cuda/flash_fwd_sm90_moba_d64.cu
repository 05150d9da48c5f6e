// The sm_90a (wgmma) MoBA forward for head dimension 64 (fp16 and bf16); a
// file of its own so that it compiles in parallel with the others.
#include "cuda/flash_fwd_sm90_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_moba_d64(bool bf16) { return make_fwd_kernel_sm90_moba<64>(bf16); }
FwdKernel fwd_kernel_sm90_moba_gather_d64(bool bf16) {
  return make_fwd_kernel_sm90_moba_gather<64>(bf16);
}
}  // namespace attn::cuda
