// The warp-specialised sm_90a forward for head dimension 64 (fp16 and bf16,
// dense and block-sparse); a file of its own so that it compiles in parallel.
#include "cuda/flash_fwd_sm90_ws_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_ws_d64(bool bf16, bool sparse) {
  return make_fwd_kernel_sm90_ws<64>(bf16, sparse);
}
}  // namespace attn::cuda
