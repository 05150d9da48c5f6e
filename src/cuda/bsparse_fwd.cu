// The persistent block-sparse forward for every head dimension and dtype.
#include "cuda/bsparse_fwd.hpp"

#include <cuda_runtime.h>

#include "flash/fwd_kernel.cuh"

namespace attn::cuda {
namespace {

template <class T, int D>
cudaError_t prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_bsparse_persistent_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::fwd_config(D).smem_bytes(D)));
}

template <class T, int D>
cudaError_t launch(const flash::FwdParams& params, int blocks, int, int, cudaStream_t stream) {
  constexpr flash::FwdConfig cfg = flash::fwd_config(D);
  flash::flash_fwd_bsparse_persistent_kernel<T, D>
      <<<dim3(unsigned(blocks)), cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <class T, int D>
FwdKernel make() {
  return {&prepare<T, D>, &launch<T, D>,
          reinterpret_cast<const void*>(&flash::flash_fwd_bsparse_persistent_kernel<T, D>)};
}

template <int D>
FwdKernel make(bool bf16) {
  return bf16 ? make<__nv_bfloat16, D>() : make<__half, D>();
}

}  // namespace

FwdKernel fwd_kernel_bsparse_persistent(int d, bool bf16) {
  switch (d) {
    case 64: return make<64>(bf16);
    case 96: return make<96>(bf16);
    case 128: return make<128>(bf16);
    default: return make<256>(bf16);
  }
}

}  // namespace attn::cuda
