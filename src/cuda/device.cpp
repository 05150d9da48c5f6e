#include "cuda/device.hpp"

#include <cuda_runtime_api.h>

namespace attn::cuda {

int32_t device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error of a missing driver
    return 0;
  }
  return n;
}

}  // namespace attn::cuda
