// Instantiates and launches flash_fwd_kernel<T, D>; included once per head
// dimension by flash_fwd_d*.cu.
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_fwd.hpp"
#include "flash/fwd_kernel.cuh"

namespace attn::cuda {

template <class T, int D>
cudaError_t fwd_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::fwd_config(D).smem_bytes(D)));
}

template <class T, int D>
cudaError_t fwd_launch(const flash::FwdParams& params, int m_blocks, int heads_q, int batch,
                       cudaStream_t stream) {
  constexpr flash::FwdConfig cfg = flash::fwd_config(D);
  const dim3 grid{unsigned(m_blocks), unsigned(heads_q), unsigned(batch)};
  flash::flash_fwd_kernel<T, D><<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <int D>
FwdKernel make_fwd_kernel(bool bf16) {
  if (bf16)
    return {&fwd_prepare<__nv_bfloat16, D>, &fwd_launch<__nv_bfloat16, D>,
            reinterpret_cast<const void*>(&flash::flash_fwd_kernel<__nv_bfloat16, D>)};
  return {&fwd_prepare<__half, D>, &fwd_launch<__half, D>,
          reinterpret_cast<const void*>(&flash::flash_fwd_kernel<__half, D>)};
}

}  // namespace attn::cuda
