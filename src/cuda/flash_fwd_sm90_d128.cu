// The sm_90a (wgmma) dense forward for head dimension 128 (fp16 and bf16).
#include "cuda/flash_fwd_sm90_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_d128(bool bf16, bool softcap) {
  return make_fwd_kernel_sm90<128, 128>(bf16, softcap);
}
}  // namespace attn::cuda
