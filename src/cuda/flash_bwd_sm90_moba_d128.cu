// The sm_90a (wgmma) MoBA dK/dV kernel for head dimension 128 (fp16 and bf16,
// with and without dQ); a file of its own so that it compiles in parallel
// with the others.
#include "cuda/flash_bwd_sm90_launch.cuh"

namespace attn::cuda {
BwdSm90Kernel bwd_kernel_sm90_moba_d128(bool bf16, bool deterministic) {
  return make_bwd_kernel_sm90_moba<128>(bf16, deterministic);
}
BwdSm90Kernel bwd_kernel_sm90_moba_gather_d128(bool bf16, bool deterministic) {
  return make_bwd_kernel_sm90_moba_gather<128>(bf16, deterministic);
}
}  // namespace attn::cuda
