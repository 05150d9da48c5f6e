// Makes a CUDA device current for a scope and restores the caller's: ring
// executions and transports may be driven from threads whose current device
// is another (host code, built only with CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.hpp"

namespace attn::ring {

class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device) {
    cudaError_t e = cudaGetDevice(&prev_);
    if (e == cudaSuccess && prev_ != device) {
      e = cudaSetDevice(device);
      restore_ = e == cudaSuccess;
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      fail(ATTN_STATUS_BACKEND_ERROR, "ring (CUDA): making device ", device, " current: ",
           cudaGetErrorName(e));
    }
  }
  ~CudaDeviceScope() {
    if (restore_) (void)cudaSetDevice(prev_);
  }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  int prev_ = 0;
  bool restore_ = false;
};

}  // namespace attn::ring
