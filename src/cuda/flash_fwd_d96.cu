// Forward kernels (dense and block-sparse) for head dimension 96 (fp16 and bf16).
#include "cuda/flash_fwd_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_d96(bool bf16, bool sparse) { return make_fwd_kernel<96>(bf16, sparse); }
}  // namespace attn::cuda
