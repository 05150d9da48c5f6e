// Host-side entry points to the paged decode and KV append kernels
// (compiled by nvcc in decode_kernels.cu). Plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "decode/decode_params.cuh"

namespace attn::cuda {

// cudaSuccess when this build has decode code for the current device.
cudaError_t decode_kernels_available();
// Raises the dynamic shared-memory limit of the decode kernel for (dtype,
// head_dim, pipeline stages) on the current device (at plan creation:
// execute may run under graph capture).
cudaError_t decode_kernels_allow_smem(bool bf16, int head_dim, int stages);
// Decode blocks of that kernel that fit on one SM.
cudaError_t decode_kernels_blocks_per_sm(bool bf16, int head_dim, int stages, int* blocks);
// Enqueues the decode kernel, grid (max_units, heads_kv, row_tiles), and
// when `combine` the combine kernel, grid (max_batch, heads_q, up to 8
// query tokens).
cudaError_t decode_kernels_launch(const decode::DecodeParams& p, bool bf16, int head_dim,
                                  int stages, int64_t max_units, int heads_kv, int row_tiles,
                                  bool combine, int64_t max_batch, cudaStream_t stream);
// Enqueues the append kernel over p.num_runs runs; `wide`: 16-byte copies.
cudaError_t kv_append_launch(const decode::AppendParams& p, bool wide, cudaStream_t stream);

}  // namespace attn::cuda
