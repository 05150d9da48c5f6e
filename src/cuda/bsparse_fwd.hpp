// Host-side handles to the persistent block-sparse forward
// (flash::flash_fwd_bsparse_persistent_kernel), one per (dtype, head dim).
// Plain C++: the kernels are compiled by nvcc in bsparse_fwd.cu.
#pragma once

#include "cuda/flash_fwd.hpp"

namespace attn::cuda {

// launch() takes grid (blocks, 1, 1): the heads_q and batch arguments are
// ignored; the work items come from params.sparse.items.
FwdKernel fwd_kernel_bsparse_persistent(int d, bool bf16);

}  // namespace attn::cuda
