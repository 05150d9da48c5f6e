// Instantiates and launches flash_fwd_sm90_bsparse_persist_kernel<T, D>
// (the persistent block-sparse forward on sm_90a); included by
// flash_fwd_sm90_bsparse_persist_d{64,128}.cu.
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_fwd.hpp"
#include "flash/fwd_sm90_bsparse_persist_kernel.cuh"

namespace attn::cuda {

template <class T, int D>
cudaError_t fwd_sm90_bsparse_persist_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_sm90_bsparse_persist_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::fwd_sm90_bsparse_persist_smem_bytes(D)));
}

// Grid (blocks, 1, 1): the blocks the work items were dealt to.
template <class T, int D>
cudaError_t fwd_sm90_bsparse_persist_launch(const flash::FwdParams& params, int blocks, int, int,
                                            cudaStream_t stream) {
  flash::flash_fwd_sm90_bsparse_persist_kernel<T, D>
      <<<dim3(unsigned(blocks)), flash::fwd_sm90_config(D).threads(),
         flash::fwd_sm90_bsparse_persist_smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <int D>
FwdKernel make_fwd_kernel_sm90_bsparse_persist(bool bf16) {
  if (bf16)
    return {&fwd_sm90_bsparse_persist_prepare<__nv_bfloat16, D>,
            &fwd_sm90_bsparse_persist_launch<__nv_bfloat16, D>,
            reinterpret_cast<const void*>(
                &flash::flash_fwd_sm90_bsparse_persist_kernel<__nv_bfloat16, D>)};
  return {&fwd_sm90_bsparse_persist_prepare<__half, D>,
          &fwd_sm90_bsparse_persist_launch<__half, D>,
          reinterpret_cast<const void*>(&flash::flash_fwd_sm90_bsparse_persist_kernel<__half, D>)};
}

}  // namespace attn::cuda
