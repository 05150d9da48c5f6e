// Host-side handles to the dense backward kernels, one set per (dtype, head
// dim). Plain C++: the kernels are compiled by nvcc in flash_bwd_d*.cu, one
// file per head dimension so that builds parallelise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flash/bwd_params.cuh"

namespace attn::cuda {

struct BwdKernels {
  // Raises the dynamic shared-memory limits of the dK/dV and dQ kernels on
  // the current device.
  cudaError_t (*prepare)();
  // D = rowsum(dO * O) (and zeroes dq_accum unless null) over n_rows =
  // total_q * heads_q rows.
  cudaError_t (*preprocess)(const flash::BwdParams& params, int64_t n_rows, cudaStream_t stream);
  // Grid (n_blocks, heads_kv * group_splits, batch).
  cudaError_t (*dkdv)(const flash::BwdParams& params, int n_blocks, int heads_kv, int batch,
                      cudaStream_t stream);
  // Deterministic dQ, grid (m_blocks, heads_q, batch).
  cudaError_t (*dq)(const flash::BwdParams& params, int m_blocks, int heads_q, int batch,
                    cudaStream_t stream);
  // dQ = scale * dq_accum in the dtype.
  cudaError_t (*convert)(const flash::BwdParams& params, int64_t n_rows, cudaStream_t stream);
  // Split groups: dK = scale * dk_accum, dV = dv_accum in the dtype over
  // n_rows = total_kv * heads_kv rows.
  cudaError_t (*convert_dkdv)(const flash::BwdParams& params, int64_t n_rows,
                              cudaStream_t stream);
  const void* dkdv_func;  // for cudaFuncGetAttributes
  const void* dq_func;
  // Block-sparse sets only (null otherwise). Plans with cut dK/dV lists: dK,
  // dV of the cut tiles from the compact accumulators, n_rows = batch *
  // heads_kv * max_cut * block_n (flash::BwdParams::dk_accum).
  cudaError_t (*convert_dkdv_tiles)(const flash::BwdParams& params, int64_t n_rows,
                                    cudaStream_t stream) = nullptr;
  // The persistent dK/dV kernel: grid (n_blocks, 1, 1), its work dealt in
  // params.sparse_kv (the other two arguments are ignored).
  cudaError_t (*dkdv_persistent)(const flash::BwdParams& params, int n_blocks, int heads_kv,
                                 int batch, cudaStream_t stream) = nullptr;
  const void* dkdv_persistent_func = nullptr;
};

// variant: see flash::bwd_config (0 unless flash::bwd_variants(d) > 1);
// sparse: the block-sparse instantiations of the dK/dV and dQ kernels.
BwdKernels bwd_kernels_d64(bool bf16, int variant, bool sparse);
BwdKernels bwd_kernels_d96(bool bf16, int variant, bool sparse);
BwdKernels bwd_kernels_d128(bool bf16, int variant, bool sparse);
BwdKernels bwd_kernels_d256(bool bf16, int variant, bool sparse);

}  // namespace attn::cuda
