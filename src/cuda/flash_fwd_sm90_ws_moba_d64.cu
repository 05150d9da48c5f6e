// MoBA's gathered forward on the warp-specialised sm_90a kernel for head
// dimension 64 (fp16 and bf16); a file of its own so that it compiles in
// parallel.
#include "cuda/flash_fwd_sm90_ws_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_ws_moba_gather_d64(bool bf16) {
  return make_fwd_kernel_sm90_ws_moba_gather<64>(bf16);
}
}  // namespace attn::cuda
