// Host-side helpers of the CUDA code (built only with CUDA): turning a CUDA
// error into attn::Error, and making a device current for a scope.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

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

// The CUDA backend's rules for tensor pointers (attn.h): 16-byte aligned
// (the kernels' vector and bulk copies), LSE 4-byte aligned (null passes:
// whether a pointer may be null is the caller's to check).
inline void require_aligned(const void* p, const char* name) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    invalid_argument(name, ": the CUDA kernels need a 16-byte aligned device pointer, got ", p);
}
inline void require_lse_aligned(const float* lse) {
  if (reinterpret_cast<uintptr_t>(lse) % alignof(float) != 0)
    invalid_argument("lse: the device pointer must be 4-byte aligned");
}

}  // namespace attn::cuda
