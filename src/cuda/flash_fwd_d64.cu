// Dense forward kernels for head dimension 64 (fp16 and bf16).
#include "cuda/flash_fwd_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_d64(bool bf16) { return make_fwd_kernel<64>(bf16); }
}  // namespace attn::cuda
