// CUDA device discovery for contexts (host side; built only with CUDA).
#pragma once

#include <cstdint>

namespace attn::cuda {

// Number of usable CUDA devices; 0 when the driver or runtime reports none
// (or no driver is installed).
int32_t device_count() noexcept;

}  // namespace attn::cuda
