// Instantiates and launches flash_bwd_dkdv_sm90_kernel<T, D, Accum, Cap>;
// included by flash_bwd_sm90_d64.cu and flash_bwd_sm90_d128.cu (fp16 and
// bf16, with and without dQ, with and without softcap), and
// flash_bwd_dkdv_sm90_bsparse_kernel<T, D, Accum>, included by
// flash_bwd_sm90_bsparse_d{64,128}.cu (fp16 and bf16, with and without dQ),
// and flash_bwd_dkdv_sm90_moba_kernel<T, D, Accum>, included by
// flash_bwd_sm90_moba_d{64,128}.cu (likewise).
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_bwd_sm90.hpp"
#include "flash/bwd_sm90_kernel.cuh"

namespace attn::cuda {

template <class T, int D, bool A, bool Cap>
cudaError_t bwd_sm90_prepare() {
  return cudaFuncSetAttribute(flash::flash_bwd_dkdv_sm90_kernel<T, D, A, Cap>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::bwd_sm90_config(D).smem_bytes(D)));
}

template <class T, int D, bool A, bool Cap>
cudaError_t bwd_sm90_dkdv(const flash::BwdParams& params, int n_blocks, int heads_kv, int batch,
                          cudaStream_t stream) {
  constexpr flash::BwdSm90Config cfg = flash::bwd_sm90_config(D);
  const dim3 grid{unsigned(n_blocks), unsigned(heads_kv), unsigned(batch)};
  flash::flash_bwd_dkdv_sm90_kernel<T, D, A, Cap>
      <<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <class T, int D, bool A, bool Cap>
BwdSm90Kernel make_bwd_kernel_sm90_t() {
  return {&bwd_sm90_prepare<T, D, A, Cap>, &bwd_sm90_dkdv<T, D, A, Cap>,
          reinterpret_cast<const void*>(&flash::flash_bwd_dkdv_sm90_kernel<T, D, A, Cap>)};
}

template <class T, int D, bool Cap>
BwdSm90Kernel make_bwd_kernel_sm90_cap(bool deterministic) {
  return deterministic ? make_bwd_kernel_sm90_t<T, D, false, Cap>()
                       : make_bwd_kernel_sm90_t<T, D, true, Cap>();
}

// deterministic: the instantiation without the dQ part; softcap: the one
// that applies the plan's cap.
template <int D>
BwdSm90Kernel make_bwd_kernel_sm90(bool bf16, bool deterministic, bool softcap) {
  if (bf16)
    return softcap ? make_bwd_kernel_sm90_cap<__nv_bfloat16, D, true>(deterministic)
                   : make_bwd_kernel_sm90_cap<__nv_bfloat16, D, false>(deterministic);
  return softcap ? make_bwd_kernel_sm90_cap<__half, D, true>(deterministic)
                 : make_bwd_kernel_sm90_cap<__half, D, false>(deterministic);
}

// The block-sparse instantiations (flash_bwd_dkdv_sm90_bsparse_kernel, no
// softcap): grid (the most work items of a slot, heads_kv * group_splits,
// batch).
template <class T, int D, bool A>
cudaError_t bwd_sm90_bsparse_prepare() {
  return cudaFuncSetAttribute(flash::flash_bwd_dkdv_sm90_bsparse_kernel<T, D, A>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::bwd_sm90_config(D).smem_bytes(D)));
}

template <class T, int D, bool A>
cudaError_t bwd_sm90_bsparse_dkdv(const flash::BwdParams& params, int n_items, int heads_kv,
                                  int batch, cudaStream_t stream) {
  constexpr flash::BwdSm90Config cfg = flash::bwd_sm90_config(D);
  const dim3 grid{unsigned(n_items), unsigned(heads_kv), unsigned(batch)};
  flash::flash_bwd_dkdv_sm90_bsparse_kernel<T, D, A>
      <<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <class T, int D, bool A>
BwdSm90Kernel make_bwd_kernel_sm90_bsparse_t() {
  return {&bwd_sm90_bsparse_prepare<T, D, A>, &bwd_sm90_bsparse_dkdv<T, D, A>,
          reinterpret_cast<const void*>(&flash::flash_bwd_dkdv_sm90_bsparse_kernel<T, D, A>)};
}

// deterministic: the instantiation without the dQ part.
template <int D>
BwdSm90Kernel make_bwd_kernel_sm90_bsparse(bool bf16, bool deterministic) {
  if (bf16)
    return deterministic ? make_bwd_kernel_sm90_bsparse_t<__nv_bfloat16, D, false>()
                         : make_bwd_kernel_sm90_bsparse_t<__nv_bfloat16, D, true>();
  return deterministic ? make_bwd_kernel_sm90_bsparse_t<__half, D, false>()
                       : make_bwd_kernel_sm90_bsparse_t<__half, D, true>();
}

// The MoBA instantiations (flash_bwd_dkdv_sm90_moba_kernel, no softcap):
// the dense kernel's grid.
template <class T, int D, bool A>
cudaError_t bwd_sm90_moba_prepare() {
  return cudaFuncSetAttribute(flash::flash_bwd_dkdv_sm90_moba_kernel<T, D, A>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::bwd_sm90_config(D).smem_bytes(D)));
}

template <class T, int D, bool A>
cudaError_t bwd_sm90_moba_dkdv(const flash::BwdParams& params, int n_blocks, int heads_kv,
                               int batch, cudaStream_t stream) {
  constexpr flash::BwdSm90Config cfg = flash::bwd_sm90_config(D);
  const dim3 grid{unsigned(n_blocks), unsigned(heads_kv), unsigned(batch)};
  flash::flash_bwd_dkdv_sm90_moba_kernel<T, D, A>
      <<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
  return cudaGetLastError();
}

template <class T, int D, bool A>
BwdSm90Kernel make_bwd_kernel_sm90_moba_t() {
  return {&bwd_sm90_moba_prepare<T, D, A>, &bwd_sm90_moba_dkdv<T, D, A>,
          reinterpret_cast<const void*>(&flash::flash_bwd_dkdv_sm90_moba_kernel<T, D, A>)};
}

// deterministic: the instantiation without the dQ part.
template <int D>
BwdSm90Kernel make_bwd_kernel_sm90_moba(bool bf16, bool deterministic) {
  if (bf16)
    return deterministic ? make_bwd_kernel_sm90_moba_t<__nv_bfloat16, D, false>()
                         : make_bwd_kernel_sm90_moba_t<__nv_bfloat16, D, true>();
  return deterministic ? make_bwd_kernel_sm90_moba_t<__half, D, false>()
                       : make_bwd_kernel_sm90_moba_t<__half, D, true>();
}

}  // namespace attn::cuda
