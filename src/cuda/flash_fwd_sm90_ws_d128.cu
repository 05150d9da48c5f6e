// The warp-specialised sm_90a forward for head dimension 128 (fp16 and bf16,
// dense and block-sparse); a file of its own so that it compiles in parallel.
#include "cuda/flash_fwd_sm90_ws_launch.cuh"

namespace attn::cuda {
FwdKernel fwd_kernel_sm90_ws_d128(bool bf16, bool sparse) {
  return make_fwd_kernel_sm90_ws<128>(bf16, sparse);
}

bool fwd_sm90_ws_maps_encode(const flash::FwdParams& params, int d, bool bf16, int heads_q,
                             int batch) {
  flash::FwdWsParams wp{};
  wp.p = params;
  // Stand-in bases with the alignment the forward requires of its tensors.
  const void* base = reinterpret_cast<const void*>(uintptr_t(1) << 20);
  wp.p.q = wp.p.k = wp.p.v = base;
  wp.heads_q = heads_q;
  wp.batch = batch;
  return encode_fwd_ws_maps(wp, d, bf16);
}
}  // namespace attn::cuda
