// The sm_90a (wgmma) dense dK/dV kernel for head dimension 128 (fp16 and bf16).
#include "cuda/flash_bwd_sm90_launch.cuh"

namespace attn::cuda {
BwdSm90Kernel bwd_kernel_sm90_d128(bool bf16, bool deterministic, bool softcap) {
  return make_bwd_kernel_sm90<128>(bf16, deterministic, softcap);
}
}  // namespace attn::cuda
