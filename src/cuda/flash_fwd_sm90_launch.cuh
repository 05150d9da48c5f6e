// Instantiates and launches flash_fwd_sm90_kernel<T, D>; included by
// flash_fwd_sm90_d64.cu and flash_fwd_sm90_d128.cu (fp16 and bf16 each).
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_fwd.hpp"
#include "flash/fwd_sm90_kernel.cuh"

namespace attn::cuda {

template <class T, int D>
cudaError_t fwd_sm90_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_sm90_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::fwd_sm90_config(D).smem_bytes(D)));
}

template <class T, int D>
cudaError_t fwd_sm90_launch(const flash::FwdParams& params, int m_blocks, int heads_q, int batch,
                            cudaStream_t stream) {
  constexpr flash::FwdSm90Config cfg = flash::fwd_sm90_config(D);
  const dim3 grid{unsigned(m_blocks), unsigned(heads_q), unsigned(batch)};
  flash::flash_fwd_sm90_kernel<T, D><<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <int D>
FwdKernel make_fwd_kernel_sm90(bool bf16) {
  if (bf16)
    return {&fwd_sm90_prepare<__nv_bfloat16, D>, &fwd_sm90_launch<__nv_bfloat16, D>,
            reinterpret_cast<const void*>(&flash::flash_fwd_sm90_kernel<__nv_bfloat16, D>)};
  return {&fwd_sm90_prepare<__half, D>, &fwd_sm90_launch<__half, D>,
          reinterpret_cast<const void*>(&flash::flash_fwd_sm90_kernel<__half, D>)};
}

}  // namespace attn::cuda
