// CUDA device discovery for contexts (host side; built only with CUDA).
#pragma once

#include <cstddef>
#include <cstdint>

namespace attn::cuda {

// Number of usable CUDA devices; 0 when the driver or runtime reports none
// (or no driver is installed).
int32_t device_count() noexcept;

// Copies `bytes` of device memory of `device` at src to host memory at dst,
// in the order of `stream` (a cudaStream_t; NULL: the legacy default
// stream), and waits for the copy. Throws INVALID_ARGUMENT naming `what`
// when src is not memory of that device, BACKEND_ERROR on a CUDA failure.
// Keeps the calling thread's current device.
void copy_device_to_host(int32_t device, void* stream, void* dst, const void* src, size_t bytes,
                         const char* what);

}  // namespace attn::cuda
