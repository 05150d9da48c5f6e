// Instantiates and launches flash_fwd_sm90_persist_kernel<T, D, BM>;
// included by flash_fwd_sm90_persist_d{64,128}.cu (fp16 and bf16, each tile
// shape of fwd_sm90_config, no softcap).
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_fwd.hpp"
#include "flash/fwd_sm90_persist_kernel.cuh"

namespace attn::cuda {

template <class T, int D, int BM>
cudaError_t fwd_sm90_persist_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_sm90_persist_kernel<T, D, BM>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::fwd_sm90_persist_smem_bytes(D, BM)));
}

template <class T, int D, int BM>
cudaError_t fwd_sm90_persist_launch(const flash::FwdParams& params, int m_blocks, int heads_q,
                                    int batch, int blocks, cudaStream_t stream) {
  constexpr flash::FwdSm90Config cfg = flash::fwd_sm90_config(D, BM);
  const flash::FwdSm90Items items{m_blocks, heads_q, m_blocks * heads_q * batch};
  flash::flash_fwd_sm90_persist_kernel<T, D, BM>
      <<<unsigned(blocks), cfg.threads(), flash::fwd_sm90_persist_smem_bytes(D, BM), stream>>>(
          params, items);
  return cudaGetLastError();
}

// Through FwdKernel::launch: one block per query tile (each walks one item).
template <class T, int D, int BM>
cudaError_t fwd_sm90_persist_launch_all(const flash::FwdParams& params, int m_blocks,
                                        int heads_q, int batch, cudaStream_t stream) {
  return fwd_sm90_persist_launch<T, D, BM>(params, m_blocks, heads_q, batch,
                                           m_blocks * heads_q * batch, stream);
}

template <class T, int D, int BM>
FwdKernel make_fwd_kernel_sm90_persist_t() {
  return {&fwd_sm90_persist_prepare<T, D, BM>, &fwd_sm90_persist_launch_all<T, D, BM>,
          reinterpret_cast<const void*>(&flash::flash_fwd_sm90_persist_kernel<T, D, BM>),
          &fwd_sm90_persist_launch<T, D, BM>};
}

}  // namespace attn::cuda
