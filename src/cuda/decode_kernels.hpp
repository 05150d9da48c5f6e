// Host-side entry points to the paged decode and KV append kernels
// (compiled by nvcc in decode_kernels.cu). Plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "decode/decode_params.cuh"

namespace attn::cuda {

// The decode kernel's variants: cp.async 16-byte copies from every thread
// (sm_80+), bulk copies completing on mbarriers (sm_90+ code only), or
// tensor copies of 8-row segments through tensor maps, 128-byte swizzled
// (sm_90+ code only; page sizes that are multiples of 8).
// kSm90Bulk32: the bulk copies into segments 32 bytes apart (every copy's
// destination 32-byte aligned, a 2-way ldmatrix conflict), with shared
// memory asked for so that at most two blocks share an SM.
enum class DecodeKernel { kSm80CpAsync = 0, kSm90Bulk = 1, kSm90Tensor = 2, kSm90Bulk32 = 3 };

// cudaSuccess when this build has code of `variant` for the current
// device; *virtual_arch (when not null) then receives the virtual
// architecture that code was compiled for (major * 10 + minor, as
// cudaFuncAttributes::ptxVersion: 80 for sm_80 code, also when the driver
// compiled its PTX for a newer device), which decides __CUDA_ARCH__.
cudaError_t decode_kernels_available(DecodeKernel variant, int* virtual_arch);
// Raises the dynamic shared-memory limit of the decode kernel for (dtype,
// head_dim, pipeline stages, variant, balanced split: its kernel runs
// several units per block) on the current device (at plan creation:
// execute may run under graph capture).
cudaError_t decode_kernels_allow_smem(bool bf16, int head_dim, int stages, DecodeKernel variant,
                                      bool balanced);
// The virtual architecture (ptxVersion) the combine kernel of (dtype, head
// dim) was compiled for on the current device: below 90 it lacks
// griddepcontrol.wait (JIT from compute_80 PTX, e.g. on a newer GPU than
// the build's SASS), so it must not be launched as a dependent.
cudaError_t decode_combine_virtual_arch(bool bf16, int head_dim, int* virtual_arch);
// Decode blocks of that kernel that fit on one SM.
cudaError_t decode_kernels_blocks_per_sm(bool bf16, int head_dim, int stages, DecodeKernel variant,
                                         bool balanced, int* blocks);
// Enqueues the decode kernel, grid (blocks * heads_kv, 1, row_tiles), and when
// `combine` the combine kernel, grid (max_batch, heads_q, up to 8 query
// tokens), with programmatic dependent launch when `pdl` (sm_90+).
cudaError_t decode_kernels_launch(const decode::DecodeParams& p, bool bf16, int head_dim,
                                  int stages, DecodeKernel variant, bool balanced, int64_t blocks,
                                  int heads_kv, int row_tiles, bool combine, bool pdl,
                                  int64_t max_batch, cudaStream_t stream);
// Enqueues the append kernel over p.num_runs runs; `wide`: 16-byte copies.
cudaError_t kv_append_launch(const decode::AppendParams& p, bool wide, cudaStream_t stream);

}  // namespace attn::cuda
