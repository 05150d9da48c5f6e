// Tensor descriptors: dtype, dims and element strides, as set through
// attn_tensor_desc_set.
#pragma once

#include <attn/attn.h>

#include <array>
#include <cstdint>
#include <string>

namespace attn {

// The most elements a tensor descriptor spans (attn_tensor_desc_set): at 4
// bytes an element, byte offsets stay within kMaxBytes (core/checked.hpp).
constexpr int64_t kMaxTensorElements = int64_t(1) << 60;

struct TensorDesc {
  attn_dtype_t dtype = ATTN_DTYPE_FP32;
  int32_t ndim = 0;
  std::array<int64_t, ATTN_MAX_DIMS> dims{};
  std::array<int64_t, ATTN_MAX_DIMS> strides{};

  int64_t numel() const {
    int64_t n = 1;
    for (int32_t i = 0; i < ndim; ++i) n *= dims[i];
    return n;
  }
};

// Row-major strides for dims.
inline void contiguous_strides(int32_t ndim, const int64_t* dims, int64_t* strides) {
  int64_t s = 1;
  for (int32_t i = ndim - 1; i >= 0; --i) {
    strides[i] = s;
    s *= dims[i] > 0 ? dims[i] : 1;
  }
}

// "[d0, d1, ...]", for messages.
inline std::string dims_string(int32_t n, const int64_t* v) {
  std::string s = "[";
  for (int32_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace attn
