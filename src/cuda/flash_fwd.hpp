// Host-side handles to the forward kernels, one per (dtype, head dim, dense
// or block-sparse).
// Plain C++: the kernels themselves are compiled by nvcc in
// flash_fwd_d*.cu, one file per head dimension so that builds parallelise.
#pragma once

#include <cuda_runtime_api.h>

#include "flash/fwd_params.cuh"

namespace attn::cuda {

struct FwdKernel {
  // Raises the kernel's dynamic shared-memory limit on the current device.
  cudaError_t (*prepare)();
  // Enqueues grid (m_blocks, heads_q, batch) on stream; returns the launch error.
  cudaError_t (*launch)(const flash::FwdParams& params, int m_blocks, int heads_q, int batch,
                        cudaStream_t stream);
  const void* func;  // for cudaFuncGetAttributes
};

FwdKernel fwd_kernel_d64(bool bf16, bool sparse);
FwdKernel fwd_kernel_d96(bool bf16, bool sparse);
FwdKernel fwd_kernel_d128(bool bf16, bool sparse);
FwdKernel fwd_kernel_d256(bool bf16, bool sparse);

// The sm_90a (wgmma) dense forward, d = 64 and 128 (flash/fwd_sm90_kernel.cuh).
// Its image holds code only where the build targeted sm_90a: the caller
// checks cudaFuncGetAttributes' ptxVersion (90) before choosing it.
// block_m: the query tile's rows, 192 or 128 (flash::fwd_sm90_config(64,
// block_m)); softcap: the instantiation that applies the plan's cap (at
// d = 64 built with 128-row tiles only: softcap ignores block_m).
FwdKernel fwd_kernel_sm90_d64(bool bf16, int block_m, bool softcap);
FwdKernel fwd_kernel_sm90_d128(bool bf16, bool softcap);
// Its Sparse instantiation, for block-sparse plans without softcap, in the
// default tile shape (grid x: the work items of the forward tile lists,
// flash::TileLists::items).
FwdKernel fwd_kernel_sm90_bsparse_d64(bool bf16);
FwdKernel fwd_kernel_sm90_bsparse_d128(bool bf16);
// Its Moba instantiation, for MoBA plans without softcap (the tile-union
// q lists), with 128-row tiles (flash::kSm90MobaBlockM); grid as the dense one.
FwdKernel fwd_kernel_sm90_moba_d64(bool bf16);
FwdKernel fwd_kernel_sm90_moba_d128(bool bf16);
// The warp-specialised persistent sm_90a forward (flash/fwd_sm90_ws_kernel.cuh),
// dense or block-sparse (grid x: the work items per (sequence, head), as the
// one-tile kernels'; the launch deals them over one block per SM), for
// fixed-length plans without softcap; flash::fwd_sm90_ws_config's tiles.
FwdKernel fwd_kernel_sm90_ws_d64(bool bf16, bool sparse);
FwdKernel fwd_kernel_sm90_ws_d128(bool bf16, bool sparse);
// Whether its tensor maps encode for these strides and lengths (params'
// pointers are ignored).
bool fwd_sm90_ws_maps_encode(const flash::FwdParams& params, int d, bool bf16, int heads_q,
                             int batch);
// MoBA's gathered forward on wgmma (round lists, 128-row tiles).
FwdKernel fwd_kernel_sm90_moba_gather_d64(bool bf16);
FwdKernel fwd_kernel_sm90_moba_gather_d128(bool bf16);
// The same rounds on the warp-specialised forward (grid x: the most tiles a
// round can have per (sequence, head)), and the dynamic shared memory it
// takes (flash::fwd_sm90_ws_config's and the rows' records).
FwdKernel fwd_kernel_sm90_ws_moba_gather_d64(bool bf16);
FwdKernel fwd_kernel_sm90_ws_moba_gather_d128(bool bf16);
size_t fwd_sm90_ws_moba_gather_smem(int d);

}  // namespace attn::cuda
