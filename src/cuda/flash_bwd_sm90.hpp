// Host-side handle to the sm_90a (wgmma) dK/dV kernel of dense backward
// plans at d = 64 and 128 (flash/bwd_sm90_kernel.cuh), and of block-sparse
// ones (its Sparse instantiation, the default; ATTN_CUDA_BWD_SM90_SPARSE=0
// keeps the sm_80 kernel) and of MoBA plans under ATTN_CUDA_MOBA_SM90=1
// (its Moba instantiation; by default MoBA runs the sm_80 kernels).
// The other launches of the backward (preprocess, dQ conversion, split
// groups' dK/dV conversion) are the sm_80 set's (cuda/flash_bwd.hpp). Plain
// C++: the kernel is compiled by nvcc in flash_bwd_sm90_*.cu. Its image
// holds code only where the build targeted sm_90a: the caller checks
// cudaFuncGetAttributes' ptxVersion (90) before choosing it.
#pragma once

#include <cuda_runtime_api.h>

#include "flash/bwd_params.cuh"

namespace attn::cuda {

struct BwdSm90Kernel {
  // Raises the kernel's dynamic shared-memory limit on the current device.
  cudaError_t (*prepare)();
  // Grid (n_blocks, heads_kv * group_splits, batch), as BwdKernels::dkdv.
  cudaError_t (*dkdv)(const flash::BwdParams& params, int n_blocks, int heads_kv, int batch,
                      cudaStream_t stream);
  const void* func;  // for cudaFuncGetAttributes
};

// deterministic: the instantiation that leaves dQ to the deterministic dQ
// kernel (BwdKernels::dq); otherwise dQ is added into the accumulator.
// softcap: the instantiation that applies the plan's cap.
BwdSm90Kernel bwd_kernel_sm90_d64(bool bf16, bool deterministic, bool softcap);
BwdSm90Kernel bwd_kernel_sm90_d128(bool bf16, bool deterministic, bool softcap);
// The block-sparse instantiations (no softcap): dkdv's grid is (the most
// work items of a slot, heads_kv * group_splits, batch), as
// BwdKernels::dkdv's for block-sparse plans.
BwdSm90Kernel bwd_kernel_sm90_bsparse_d64(bool bf16, bool deterministic);
BwdSm90Kernel bwd_kernel_sm90_bsparse_d128(bool bf16, bool deterministic);
// The MoBA instantiations (no softcap; the tile-union kv lists), with the
// dense kernel's grid.
BwdSm90Kernel bwd_kernel_sm90_moba_d64(bool bf16, bool deterministic);
BwdSm90Kernel bwd_kernel_sm90_moba_d128(bool bf16, bool deterministic);
// MoBA's gathered rows (the row lists of cuda/moba_plan.hpp), no softcap.
BwdSm90Kernel bwd_kernel_sm90_moba_gather_d64(bool bf16, bool deterministic);
BwdSm90Kernel bwd_kernel_sm90_moba_gather_d128(bool bf16, bool deterministic);

}  // namespace attn::cuda
