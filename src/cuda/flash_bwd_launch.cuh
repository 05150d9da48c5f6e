// Instantiates and launches the backward kernels for <T, D>; included once
// per head dimension by flash_bwd_d*.cu.
#pragma once

#include <cuda_runtime.h>

#include "cuda/flash_bwd.hpp"
#include "flash/bwd_dq_kernel.cuh"
#include "flash/bwd_kernel.cuh"

namespace attn::cuda {

template <class T, int D, int V, bool S, bool M = false>
cudaError_t bwd_prepare() {
  cudaError_t e = cudaFuncSetAttribute(flash::flash_bwd_dkdv_kernel<T, D, V, S, M>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(flash::bwd_config(D, V).smem_bytes(D)));
  if (e != cudaSuccess) return e;
  if constexpr (S) {
    e = cudaFuncSetAttribute(flash::flash_bwd_dkdv_bsparse_persistent_kernel<T, D, V>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(flash::bwd_config(D, V).smem_bytes(D)));
    if (e != cudaSuccess) return e;
  }
  return cudaFuncSetAttribute(flash::flash_bwd_dq_kernel<T, D, S, M>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::dq_config(D).smem_bytes(D)));
}

template <int D>
unsigned row_blocks(int64_t n_rows) {
  constexpr int64_t per_block = flash::kRowKernelThreads / flash::row_threads(D);
  return unsigned((n_rows + per_block - 1) / per_block);
}

template <class T, int D>
cudaError_t bwd_preprocess(const flash::BwdParams& p, int64_t n_rows, cudaStream_t stream) {
  flash::flash_bwd_preprocess_kernel<T, D>
      <<<row_blocks<D>(n_rows), flash::kRowKernelThreads, 0, stream>>>(p, n_rows);
  return cudaGetLastError();
}

template <class T, int D>
cudaError_t bwd_convert(const flash::BwdParams& p, int64_t n_rows, cudaStream_t stream) {
  flash::flash_bwd_convert_dq_kernel<T, D>
      <<<row_blocks<D>(n_rows), flash::kRowKernelThreads, 0, stream>>>(p, n_rows);
  return cudaGetLastError();
}

template <class T, int D>
cudaError_t bwd_convert_dkdv(const flash::BwdParams& p, int64_t n_rows, cudaStream_t stream) {
  flash::flash_bwd_convert_dkdv_kernel<T, D>
      <<<row_blocks<D>(n_rows), flash::kRowKernelThreads, 0, stream>>>(p, n_rows);
  return cudaGetLastError();
}

template <class T, int D>
cudaError_t bwd_convert_dkdv_tiles(const flash::BwdParams& p, int64_t n_rows,
                                   cudaStream_t stream) {
  flash::flash_bwd_convert_dkdv_tiles_kernel<T, D>
      <<<row_blocks<D>(n_rows), flash::kRowKernelThreads, 0, stream>>>(p, n_rows);
  return cudaGetLastError();
}

template <class T, int D, int V, bool S, bool M = false>
cudaError_t bwd_dkdv(const flash::BwdParams& p, int n_blocks, int heads_kv, int batch,
                     cudaStream_t stream) {
  constexpr flash::BwdConfig cfg = flash::bwd_config(D, V);
  const dim3 grid{unsigned(n_blocks), unsigned(heads_kv), unsigned(batch)};
  flash::flash_bwd_dkdv_kernel<T, D, V, S, M><<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(p);
  return cudaGetLastError();
}

template <class T, int D, bool S, bool M = false>
cudaError_t bwd_dq(const flash::BwdParams& p, int m_blocks, int heads_q, int batch,
                   cudaStream_t stream) {
  constexpr flash::DqConfig cfg = flash::dq_config(D);
  const dim3 grid{unsigned(m_blocks), unsigned(heads_q), unsigned(batch)};
  flash::flash_bwd_dq_kernel<T, D, S, M><<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(p);
  return cudaGetLastError();
}

// Block-sparse only: the persistent dK/dV kernel (grid (n_blocks, 1, 1); the
// other arguments are ignored).
template <class T, int D, int V>
cudaError_t bwd_dkdv_persistent(const flash::BwdParams& p, int n_blocks, int, int,
                                cudaStream_t stream) {
  constexpr flash::BwdConfig cfg = flash::bwd_config(D, V);
  flash::flash_bwd_dkdv_bsparse_persistent_kernel<T, D, V>
      <<<dim3(unsigned(n_blocks)), cfg.threads(), cfg.smem_bytes(D), stream>>>(p);
  return cudaGetLastError();
}

// The block-sparse kernels of the set, instantiated only when S.
template <class T, int D, int V, bool S>
void add_bsparse_kernels(BwdKernels& k) {
  if constexpr (S) {
    k.convert_dkdv_tiles = &bwd_convert_dkdv_tiles<T, D>;
    k.dkdv_persistent = &bwd_dkdv_persistent<T, D, V>;
    k.dkdv_persistent_func =
        reinterpret_cast<const void*>(&flash::flash_bwd_dkdv_bsparse_persistent_kernel<T, D, V>);
  }
}

template <class T, int D, int V, bool S, bool M = false>
BwdKernels make_bwd_kernels_t() {
  BwdKernels k{&bwd_prepare<T, D, V, S, M>,
               &bwd_preprocess<T, D>,
               &bwd_dkdv<T, D, V, S, M>,
               &bwd_dq<T, D, S, M>,
               &bwd_convert<T, D>,
               &bwd_convert_dkdv<T, D>,
               reinterpret_cast<const void*>(&flash::flash_bwd_dkdv_kernel<T, D, V, S, M>),
               reinterpret_cast<const void*>(&flash::flash_bwd_dq_kernel<T, D, S, M>)};
  add_bsparse_kernels<T, D, V, S>(k);
  return k;
}

template <int D, int V>
BwdKernels make_bwd_kernels_v(bool bf16, bool sparse) {
  if (sparse)
    return bf16 ? make_bwd_kernels_t<__nv_bfloat16, D, V, true>()
                : make_bwd_kernels_t<__half, D, V, true>();
  return bf16 ? make_bwd_kernels_t<__nv_bfloat16, D, V, false>()
              : make_bwd_kernels_t<__half, D, V, false>();
}

// Variant 1 exists only where bwd_variants(D) > 1.
template <int D>
BwdKernels make_bwd_kernels(bool bf16, int variant, bool sparse) {
  if constexpr (flash::bwd_variants(D) > 1) {
    if (variant == 1) return make_bwd_kernels_v<D, 1>(bf16, sparse);
  }
  return make_bwd_kernels_v<D, 0>(bf16, sparse);
}

// MoBA's dK/dV kernel over gathered rows, with the MoBA dQ kernel.
template <class T, int D, int V>
cudaError_t bwd_gather_prepare() {
  cudaError_t e = cudaFuncSetAttribute(flash::flash_bwd_dkdv_moba_gather_kernel<T, D, V>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(flash::bwd_config(D, V).smem_bytes(D)));
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(flash::flash_bwd_dq_kernel<T, D, false, true>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::dq_config(D).smem_bytes(D)));
}

template <class T, int D, int V>
cudaError_t bwd_gather_dkdv(const flash::BwdParams& p, int n_blocks, int heads_kv, int batch,
                            cudaStream_t stream) {
  constexpr flash::BwdConfig cfg = flash::bwd_config(D, V);
  const dim3 grid{unsigned(n_blocks), unsigned(heads_kv), unsigned(batch)};
  flash::flash_bwd_dkdv_moba_gather_kernel<T, D, V>
      <<<grid, cfg.threads(), cfg.smem_bytes(D), stream>>>(p);
  return cudaGetLastError();
}

template <class T, int D, int V, bool Gather>
BwdKernels make_bwd_kernels_moba_t() {
  if constexpr (!Gather) {
    return make_bwd_kernels_t<T, D, V, false, true>();
  } else {
    return {&bwd_gather_prepare<T, D, V>,
            &bwd_preprocess<T, D>,
            &bwd_gather_dkdv<T, D, V>,
            &bwd_dq<T, D, false, true>,
            &bwd_convert<T, D>,
            &bwd_convert_dkdv<T, D>,
            reinterpret_cast<const void*>(&flash::flash_bwd_dkdv_moba_gather_kernel<T, D, V>),
            reinterpret_cast<const void*>(&flash::flash_bwd_dq_kernel<T, D, false, true>)};
  }
}

template <int D, int V>
BwdKernels make_bwd_kernels_moba_v(bool bf16, bool gather) {
  if (gather)
    return bf16 ? make_bwd_kernels_moba_t<__nv_bfloat16, D, V, true>()
                : make_bwd_kernels_moba_t<__half, D, V, true>();
  return bf16 ? make_bwd_kernels_moba_t<__nv_bfloat16, D, V, false>()
              : make_bwd_kernels_moba_t<__half, D, V, false>();
}

// MoBA's instantiations (run-time lists from the workspace; gather: the
// dK/dV kernel over the rows that selected each block).
template <int D>
BwdKernels make_bwd_kernels_moba(bool bf16, int variant, bool gather) {
  if constexpr (flash::bwd_variants(D) > 1) {
    if (variant == 1) return make_bwd_kernels_moba_v<D, 1>(bf16, gather);
  }
  return make_bwd_kernels_moba_v<D, 0>(bf16, gather);
}

}  // namespace attn::cuda
