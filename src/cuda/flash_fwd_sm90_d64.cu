// The sm_90a (wgmma) dense forward for head dimension 64 (fp16 and bf16).
#include "cuda/flash_fwd_sm90_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_d64(bool bf16) { return make_fwd_kernel_sm90<64, false>(bf16); }
}  // namespace attn::cuda
