// Instantiates and launches flash_fwd_kernel<T, D, Sparse, Moba> (and MoBA's
// flash_fwd_moba_gather_kernel<T, D>); included once per head dimension by
// flash_fwd_d*.cu (and moba_attn_d*.cu for MoBA).
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_fwd.hpp"
#include "flash/fwd_kernel.cuh"

namespace attn::cuda {

template <class T, int D, bool S, bool M = false>
cudaError_t fwd_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_kernel<T, D, S, M>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::fwd_config(D).smem_bytes(D)));
}

template <class T, int D, bool S, bool M = false>
cudaError_t fwd_launch(const flash::FwdParams& params, int m_blocks, int heads_q, int batch,
                       cudaStream_t stream) {
  constexpr flash::FwdConfig cfg = flash::fwd_config(D);
  const dim3 grid{unsigned(m_blocks), unsigned(heads_q), unsigned(batch)};
  flash::flash_fwd_kernel<T, D, S, M><<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <class T, int D, bool S, bool M = false>
FwdKernel make_fwd_kernel_t() {
  return {&fwd_prepare<T, D, S, M>, &fwd_launch<T, D, S, M>,
          reinterpret_cast<const void*>(&flash::flash_fwd_kernel<T, D, S, M>)};
}

template <int D>
FwdKernel make_fwd_kernel(bool bf16, bool sparse) {
  if (sparse)
    return bf16 ? make_fwd_kernel_t<__nv_bfloat16, D, true>() : make_fwd_kernel_t<__half, D, true>();
  return bf16 ? make_fwd_kernel_t<__nv_bfloat16, D, false>() : make_fwd_kernel_t<__half, D, false>();
}

// MoBA's instantiation (run-time block lists from the workspace).
template <int D>
FwdKernel make_fwd_kernel_moba(bool bf16) {
  return bf16 ? make_fwd_kernel_t<__nv_bfloat16, D, false, true>()
              : make_fwd_kernel_t<__half, D, false, true>();
}

// MoBA's gathered forward (one launch per block; m_blocks: the tiles of
// that block's row list).
template <class T, int D>
cudaError_t fwd_gather_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_moba_gather_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::fwd_config(D).smem_bytes(D)));
}

template <class T, int D>
cudaError_t fwd_gather_launch(const flash::FwdParams& params, int m_blocks, int heads_q, int batch,
                              cudaStream_t stream) {
  constexpr flash::FwdConfig cfg = flash::fwd_config(D);
  const dim3 grid{unsigned(m_blocks), unsigned(heads_q), unsigned(batch)};
  flash::flash_fwd_moba_gather_kernel<T, D>
      <<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <int D>
FwdKernel make_fwd_kernel_moba_gather(bool bf16) {
  if (bf16)
    return {&fwd_gather_prepare<__nv_bfloat16, D>, &fwd_gather_launch<__nv_bfloat16, D>,
            reinterpret_cast<const void*>(&flash::flash_fwd_moba_gather_kernel<__nv_bfloat16, D>)};
  return {&fwd_gather_prepare<__half, D>, &fwd_gather_launch<__half, D>,
          reinterpret_cast<const void*>(&flash::flash_fwd_moba_gather_kernel<__half, D>)};
}

}  // namespace attn::cuda
