// MoBA's gathered forward on the warp-specialised sm_90a kernel for head
// dimension 128 (fp16 and bf16); a file of its own so that it compiles in
// parallel.
#include "cuda/flash_fwd_sm90_ws_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_ws_moba_gather_d128(bool bf16) {
  return make_fwd_kernel_sm90_ws_moba_gather<128>(bf16);
}

size_t fwd_sm90_ws_moba_gather_smem(int d) {
  return d == 64 ? fwd_ws_moba_gather_smem<64>() : fwd_ws_moba_gather_smem<128>();
}
}  // namespace attn::cuda
