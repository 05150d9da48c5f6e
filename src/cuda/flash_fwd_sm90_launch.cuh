// Instantiates and launches flash_fwd_sm90_kernel<T, D, Sparse>; included
// by flash_fwd_sm90_d{64,128}.cu (dense) and flash_fwd_sm90_bsparse_d{64,128}.cu
// (block-sparse), fp16 and bf16 each.
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_fwd.hpp"
#include "flash/fwd_sm90_kernel.cuh"

namespace attn::cuda {

template <class T, int D, bool Sparse>
cudaError_t fwd_sm90_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_sm90_kernel<T, D, Sparse>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::fwd_sm90_config(D).smem_bytes(D)));
}

template <class T, int D, bool Sparse>
cudaError_t fwd_sm90_launch(const flash::FwdParams& params, int m_blocks, int heads_q, int batch,
                            cudaStream_t stream) {
  constexpr flash::FwdSm90Config cfg = flash::fwd_sm90_config(D);
  const dim3 grid{unsigned(m_blocks), unsigned(heads_q), unsigned(batch)};
  flash::flash_fwd_sm90_kernel<T, D, Sparse>
      <<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <class T, int D, bool Sparse>
FwdKernel make_fwd_kernel_sm90_t() {
  return {&fwd_sm90_prepare<T, D, Sparse>, &fwd_sm90_launch<T, D, Sparse>,
          reinterpret_cast<const void*>(&flash::flash_fwd_sm90_kernel<T, D, Sparse>)};
}

// m_blocks: the query tiles per (sequence, head); Sparse: the work items of
// a slot of the tile lists (one per query tile).
template <int D, bool Sparse>
FwdKernel make_fwd_kernel_sm90(bool bf16) {
  return bf16 ? make_fwd_kernel_sm90_t<__nv_bfloat16, D, Sparse>()
              : make_fwd_kernel_sm90_t<__half, D, Sparse>();
}

}  // namespace attn::cuda
