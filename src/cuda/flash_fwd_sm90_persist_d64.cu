// The persistent sm_90a (wgmma) dense forward for head dimension 64 (fp16
// and bf16, 192- and 128-row query tiles, no softcap).
#include "cuda/flash_fwd_sm90_persist_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_persist_d64(bool bf16, int block_m) {
  if (block_m == 128)
    return bf16 ? make_fwd_kernel_sm90_persist_t<__nv_bfloat16, 64, 128>()
                : make_fwd_kernel_sm90_persist_t<__half, 64, 128>();
  return bf16 ? make_fwd_kernel_sm90_persist_t<__nv_bfloat16, 64, 192>()
              : make_fwd_kernel_sm90_persist_t<__half, 64, 192>();
}
}  // namespace attn::cuda
