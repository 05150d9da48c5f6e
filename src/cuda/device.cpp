#include "cuda/device.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "core/error.hpp"
#include "cuda/cuda_util.hpp"

namespace attn::cuda {

int32_t device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error of a missing driver
    return 0;
  }
  return n;
}

void copy_device_to_host(int32_t device, void* stream, void* dst, const void* src, size_t bytes,
                         const char* what) {
  if (bytes == 0) return;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, src) != cudaSuccess) {
    (void)cudaGetLastError();
    attr.type = cudaMemoryTypeUnregistered;
  }
  // Managed memory is readable too; pageable or pinned host memory is not
  // what the caller promised (the host variant takes it).
  if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) ||
      attr.device != device)
    invalid_argument(what, " is not memory of CUDA device ", device,
                     attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged
                         ? " (it is on another device)"
                         : " (host memory: pass host tables to the host variant)");
  DeviceScope scope(device);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) {
    const std::string step = std::string("copying ") + what + " to the host";
    check(e, step.c_str());
  }
}

}  // namespace attn::cuda
