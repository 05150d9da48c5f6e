// Host-side handles to the attention kernels' MoBA instantiations (the
// forward, dK/dV and deterministic dQ kernels walking the selector's lists),
// compiled by nvcc in moba_attn_d*.cu, one file per head dimension.
#pragma once

#include "cuda/flash_bwd.hpp"
#include "cuda/flash_fwd.hpp"

namespace attn::cuda {

FwdKernel fwd_kernel_moba_d64(bool bf16);
FwdKernel fwd_kernel_moba_d96(bool bf16);
FwdKernel fwd_kernel_moba_d128(bool bf16);
FwdKernel fwd_kernel_moba_d256(bool bf16);
// The gathered forward (flash_fwd_moba_gather_kernel): one block per launch.
FwdKernel fwd_kernel_moba_gather_d64(bool bf16);
FwdKernel fwd_kernel_moba_gather_d96(bool bf16);
FwdKernel fwd_kernel_moba_gather_d128(bool bf16);
FwdKernel fwd_kernel_moba_gather_d256(bool bf16);

// variant: see flash::bwd_config; gather: the dK/dV kernel over the rows
// that selected each block (flash_bwd_dkdv_moba_gather_kernel).
BwdKernels bwd_kernels_moba_d64(bool bf16, int variant, bool gather);
BwdKernels bwd_kernels_moba_d96(bool bf16, int variant, bool gather);
BwdKernels bwd_kernels_moba_d128(bool bf16, int variant, bool gather);
BwdKernels bwd_kernels_moba_d256(bool bf16, int variant, bool gather);

}  // namespace attn::cuda
