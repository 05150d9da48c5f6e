// Host-side helpers of the CUDA code (built only with CUDA): turning a CUDA
// error into attn::Error, and making a device current for a scope.
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.hpp"

namespace attn::cuda {

// Throws BACKEND_ERROR "<who>: <what>: <name> (<description>)" unless e is
// cudaSuccess, clearing the error first unless it is sticky.
inline void check(cudaError_t e, const char* what, const char* who = "backend CUDA") {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  fail(ATTN_STATUS_BACKEND_ERROR, who, ": ", what, ": ", cudaGetErrorName(e), " (",
       cudaGetErrorString(e), ")");
}

// Makes `device` current for a scope and restores the caller's device:
// plans, caches and transports may be driven from threads whose current
// device is another.
class DeviceScope {
 public:
  explicit DeviceScope(int device, const char* who = "backend CUDA") {
    check(cudaGetDevice(&prev_), "cudaGetDevice", who);
    if (prev_ != device) {
      check(cudaSetDevice(device), "cudaSetDevice", who);
      restore_ = true;
    }
  }
  ~DeviceScope() {
    if (restore_) (void)cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = 0;
  bool restore_ = false;
};

}  // namespace attn::cuda
