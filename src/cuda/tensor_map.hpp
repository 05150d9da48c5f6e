// The driver's tensor-map encoder (cuTensorMapEncodeTiled), for the kernels
// that move tiles with tensor copies (the decode kernels' tensor variant,
// the warp-specialised forward).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

namespace attn::cuda {

// Through the runtime, so that the library does not link libcuda itself;
// null when the driver has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

}  // namespace attn::cuda
