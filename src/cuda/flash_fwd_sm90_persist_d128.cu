// The persistent sm_90a (wgmma) dense forward for head dimension 128 (fp16
// and bf16, no softcap).
#include "cuda/flash_fwd_sm90_persist_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_persist_d128(bool bf16) {
  return bf16 ? make_fwd_kernel_sm90_persist_t<__nv_bfloat16, 128, 128>()
              : make_fwd_kernel_sm90_persist_t<__half, 128, 128>();
}
}  // namespace attn::cuda
