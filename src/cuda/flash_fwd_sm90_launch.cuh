// Instantiates and launches flash_fwd_sm90_kernel<T, D, BM, Cap, Sparse,
// Moba>; included by flash_fwd_sm90_d{64,128}.cu (dense: fp16 and bf16, with
// and without softcap, each tile shape of fwd_sm90_config),
// flash_fwd_sm90_bsparse_d{64,128}.cu (block-sparse: the default tile shape,
// no softcap) and flash_fwd_sm90_moba_d{64,128}.cu (MoBA: 128-row tiles, no
// softcap).
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_fwd.hpp"
#include "flash/fwd_sm90_kernel.cuh"

namespace attn::cuda {

template <class T, int D, int BM, bool Cap, bool Sparse, bool Moba>
cudaError_t fwd_sm90_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_sm90_kernel<T, D, BM, Cap, Sparse, Moba>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::fwd_sm90_config(D, BM).smem_bytes(D)));
}

// m_blocks: the query tiles per (sequence, head); Sparse: the work items of
// a slot of the tile lists (one per query tile).
template <class T, int D, int BM, bool Cap, bool Sparse, bool Moba>
cudaError_t fwd_sm90_launch(const flash::FwdParams& params, int m_blocks, int heads_q, int batch,
                            cudaStream_t stream) {
  constexpr flash::FwdSm90Config cfg = flash::fwd_sm90_config(D, BM);
  const dim3 grid{unsigned(m_blocks), unsigned(heads_q), unsigned(batch)};
  flash::flash_fwd_sm90_kernel<T, D, BM, Cap, Sparse, Moba>
      <<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <class T, int D, int BM, bool Cap, bool Sparse = false, bool Moba = false>
FwdKernel make_fwd_kernel_sm90_t() {
  return {&fwd_sm90_prepare<T, D, BM, Cap, Sparse, Moba>,
          &fwd_sm90_launch<T, D, BM, Cap, Sparse, Moba>,
          reinterpret_cast<const void*>(
              &flash::flash_fwd_sm90_kernel<T, D, BM, Cap, Sparse, Moba>)};
}

template <int D, int BM>
FwdKernel make_fwd_kernel_sm90(bool bf16, bool softcap) {
  if (bf16)
    return softcap ? make_fwd_kernel_sm90_t<__nv_bfloat16, D, BM, true>()
                   : make_fwd_kernel_sm90_t<__nv_bfloat16, D, BM, false>();
  return softcap ? make_fwd_kernel_sm90_t<__half, D, BM, true>()
                 : make_fwd_kernel_sm90_t<__half, D, BM, false>();
}

// The block-sparse instantiation: the default tile shape, no softcap.
template <int D>
FwdKernel make_fwd_kernel_sm90_bsparse(bool bf16) {
  constexpr int BM = flash::fwd_sm90_config(D).block_m;
  return bf16 ? make_fwd_kernel_sm90_t<__nv_bfloat16, D, BM, false, true>()
              : make_fwd_kernel_sm90_t<__half, D, BM, false, true>();
}

// The MoBA instantiation: 128-row tiles (those of the q lists, which the
// sm_80 forward and the deterministic dQ kernel share), no softcap.
template <int D>
FwdKernel make_fwd_kernel_sm90_moba(bool bf16) {
  constexpr int BM = flash::kSm90MobaBlockM;
  return bf16 ? make_fwd_kernel_sm90_t<__nv_bfloat16, D, BM, false, false, true>()
              : make_fwd_kernel_sm90_t<__half, D, BM, false, false, true>();
}

// MoBA's gathered forward on wgmma (flash_fwd_sm90_moba_gather_kernel):
// 128-row tiles of the round lists; m_blocks: thread blocks per (sequence,
// head).
template <class T, int D>
cudaError_t fwd_sm90_gather_prepare() {
  return cudaFuncSetAttribute(
      flash::flash_fwd_sm90_moba_gather_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      int(flash::fwd_sm90_config(D, flash::kSm90MobaBlockM).smem_bytes(D)));
}

template <class T, int D>
cudaError_t fwd_sm90_gather_launch(const flash::FwdParams& params, int m_blocks, int heads_q,
                                   int batch, cudaStream_t stream) {
  constexpr flash::FwdSm90Config cfg = flash::fwd_sm90_config(D, flash::kSm90MobaBlockM);
  const dim3 grid{unsigned(m_blocks), unsigned(heads_q), unsigned(batch)};
  flash::flash_fwd_sm90_moba_gather_kernel<T, D>
      <<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <int D>
FwdKernel make_fwd_kernel_sm90_moba_gather(bool bf16) {
  if (bf16)
    return {&fwd_sm90_gather_prepare<__nv_bfloat16, D>, &fwd_sm90_gather_launch<__nv_bfloat16, D>,
            reinterpret_cast<const void*>(
                &flash::flash_fwd_sm90_moba_gather_kernel<__nv_bfloat16, D>)};
  return {&fwd_sm90_gather_prepare<__half, D>, &fwd_sm90_gather_launch<__half, D>,
          reinterpret_cast<const void*>(&flash::flash_fwd_sm90_moba_gather_kernel<__half, D>)};
}

}  // namespace attn::cuda
