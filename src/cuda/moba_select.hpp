// Host-side handles to MoBA's selector kernels (kernels/moba/moba_select.cuh),
// compiled by nvcc in moba_select.cu. Plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include "moba/moba_params.cuh"

namespace attn::cuda {

// Raises select_kernel's dynamic shared-memory limit on the current device
// for head dimension d.
cudaError_t moba_select_prepare(int d);

// Enqueues the selection on stream: pools the keys, writes p.selected,
// selects, then builds the q lists when p.q_count is set, the kv lists
// when p.kv_count is set and the gathered row lists when p.row_offsets is.
// With select = false the pooled keys and p.selected are those already in
// the workspace (a kept selection): only the lists are built.
// Returns the first launch error.
cudaError_t moba_select_launch(const moba::SelectParams& p, bool bf16, cudaStream_t stream,
                               bool select = true);

// Enqueues the gathered forward's step for the rows that see no key (none
// when seqlen_q <= seqlen_kv): O = 0, LSE = -inf.
cudaError_t moba_blind_rows_launch(const moba::BlindRowsParams& p, bool bf16,
                                   cudaStream_t stream);

}  // namespace attn::cuda
