// The sm_90a (wgmma) dense forward for head dimension 64 (fp16 and bf16):
// 192- and 128-row query tiles, softcap with 128-row tiles only (the
// 192-row shape's 168 registers per thread spill under it).
#include "cuda/flash_fwd_sm90_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_d64(bool bf16, int block_m, bool softcap) {
  if (block_m == 128 || softcap) return make_fwd_kernel_sm90<64, 128>(bf16, softcap);
  return bf16 ? make_fwd_kernel_sm90_t<__nv_bfloat16, 64, 192, false>()
              : make_fwd_kernel_sm90_t<__half, 64, 192, false>();
}
}  // namespace attn::cuda
