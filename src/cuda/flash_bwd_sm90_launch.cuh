// Instantiates and launches flash_bwd_dkdv_sm90_kernel<T, D, Accum, Cap>;
// included by flash_bwd_sm90_d64.cu and flash_bwd_sm90_d128.cu (fp16 and
// bf16, with and without dQ, with and without softcap), and
// flash_bwd_dkdv_sm90_bsparse_kernel<T, D, Accum>, included by
// flash_bwd_sm90_bsparse_d{64,128}.cu (fp16 and bf16, with and without dQ),
// and flash_bwd_dkdv_sm90_moba_kernel<T, D, Accum> and
// flash_bwd_dkdv_sm90_moba_gather_kernel<T, D, Accum>, included by
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
#if ATTN_BWD_SM90_TRACE
  flash::bwd_sm90::trace_print_kernel<<<1, 1, 0, stream>>>();  // diagnostic builds
#endif
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

// The listed instantiations (no softcap): kernel K (K<T, D, Accum>: the
// block-sparse flash_bwd_dkdv_sm90_bsparse_kernel, grid (the most work items
// of a slot, heads_kv * group_splits, batch); MoBA's
// flash_bwd_dkdv_sm90_moba_kernel and flash_bwd_dkdv_sm90_moba_gather_kernel,
// the dense kernel's grid); Sparse: the block-sparse kernel's shared memory
// (three stages of query tiles, bwd_sm90_sparse_config).
template <auto K, int D, bool Sparse>
constexpr flash::BwdSm90Config bwd_sm90_listed_config() {
  return Sparse ? flash::bwd_sm90_sparse_config(D) : flash::bwd_sm90_config(D);
}

template <auto K, int D, bool Sparse>
cudaError_t bwd_sm90_listed_prepare() {
  return cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(bwd_sm90_listed_config<K, D, Sparse>().smem_bytes(D)));
}

template <auto K, int D, bool Sparse>
cudaError_t bwd_sm90_listed_dkdv(const flash::BwdParams& params, int n_blocks, int heads_kv,
                                 int batch, cudaStream_t stream) {
  constexpr flash::BwdSm90Config cfg = bwd_sm90_listed_config<K, D, Sparse>();
  const dim3 grid{unsigned(n_blocks), unsigned(heads_kv), unsigned(batch)};
  K<<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(params);
#if ATTN_BWD_SM90_TRACE
  flash::bwd_sm90::trace_print_kernel<<<1, 1, 0, stream>>>();  // diagnostic builds
#endif
  return cudaGetLastError();
}

template <auto K, int D, bool Sparse>
BwdSm90Kernel make_bwd_kernel_sm90_listed_t() {
  return {&bwd_sm90_listed_prepare<K, D, Sparse>, &bwd_sm90_listed_dkdv<K, D, Sparse>,
          reinterpret_cast<const void*>(K)};
}

// The instantiation of kernel template K for the dtype; deterministic: the
// one without the dQ part.
template <template <class, int, bool> class Pick, int D>
BwdSm90Kernel make_bwd_kernel_sm90_listed(bool bf16, bool deterministic) {
  constexpr bool S = Pick<__nv_bfloat16, D, false>::sparse;
  if (bf16)
    return deterministic ? make_bwd_kernel_sm90_listed_t<Pick<__nv_bfloat16, D, false>::k, D, S>()
                         : make_bwd_kernel_sm90_listed_t<Pick<__nv_bfloat16, D, true>::k, D, S>();
  return deterministic ? make_bwd_kernel_sm90_listed_t<Pick<__half, D, false>::k, D, S>()
                       : make_bwd_kernel_sm90_listed_t<Pick<__half, D, true>::k, D, S>();
}

template <class T, int D, bool A>
struct PickBsparse {
  static constexpr auto k = &flash::flash_bwd_dkdv_sm90_bsparse_kernel<T, D, A>;
  static constexpr bool sparse = true;
};
template <class T, int D, bool A>
struct PickMoba {
  static constexpr auto k = &flash::flash_bwd_dkdv_sm90_moba_kernel<T, D, A>;
  static constexpr bool sparse = false;
};
template <class T, int D, bool A>
struct PickMobaGather {
  static constexpr auto k = &flash::flash_bwd_dkdv_sm90_moba_gather_kernel<T, D, A>;
  static constexpr bool sparse = false;
};

template <int D>
BwdSm90Kernel make_bwd_kernel_sm90_bsparse(bool bf16, bool deterministic) {
  return make_bwd_kernel_sm90_listed<PickBsparse, D>(bf16, deterministic);
}
template <int D>
BwdSm90Kernel make_bwd_kernel_sm90_moba(bool bf16, bool deterministic) {
  return make_bwd_kernel_sm90_listed<PickMoba, D>(bf16, deterministic);
}
template <int D>
BwdSm90Kernel make_bwd_kernel_sm90_moba_gather(bool bf16, bool deterministic) {
  return make_bwd_kernel_sm90_listed<PickMobaGather, D>(bf16, deterministic);
}

}  // namespace attn::cuda
