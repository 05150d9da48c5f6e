// Instantiates and launches flash_bwd_dkdv_sm90_kernel<T, D>; included by
// flash_bwd_sm90_d64.cu and flash_bwd_sm90_d128.cu (fp16 and bf16 each).
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_bwd_sm90.hpp"
#include "flash/bwd_sm90_kernel.cuh"

namespace attn::cuda {

template <class T, int D>
cudaError_t bwd_sm90_prepare() {
  return cudaFuncSetAttribute(flash::flash_bwd_dkdv_sm90_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::bwd_sm90_config(D).smem_bytes(D)));
}

template <class T, int D>
cudaError_t bwd_sm90_dkdv(const flash::BwdParams& params, int n_blocks, int heads_kv, int batch,
                          cudaStream_t stream) {
  constexpr flash::BwdSm90Config cfg = flash::bwd_sm90_config(D);
  const dim3 grid{unsigned(n_blocks), unsigned(heads_kv), unsigned(batch)};
  flash::flash_bwd_dkdv_sm90_kernel<T, D><<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <int D>
BwdSm90Kernel make_bwd_kernel_sm90(bool bf16) {
  if (bf16)
    return {&bwd_sm90_prepare<__nv_bfloat16, D>, &bwd_sm90_dkdv<__nv_bfloat16, D>,
            reinterpret_cast<const void*>(&flash::flash_bwd_dkdv_sm90_kernel<__nv_bfloat16, D>)};
  return {&bwd_sm90_prepare<__half, D>, &bwd_sm90_dkdv<__half, D>,
          reinterpret_cast<const void*>(&flash::flash_bwd_dkdv_sm90_kernel<__half, D>)};
}

}  // namespace attn::cuda
