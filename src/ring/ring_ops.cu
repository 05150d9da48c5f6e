// Launchers of the CUDA ring plan's elementwise kernels.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <type_traits>

#include "core/error.hpp"
#include "ring/ring_ops.hpp"
#include "ring/ring_ops.cuh"

namespace attn::ring {
namespace {

namespace rk = attn::ring_kernels;

constexpr int kThreads = 256;

// Enough blocks to fill the device for `work` items; grid-stride loops do the rest.
unsigned blocks_for(int64_t work) {
  return unsigned(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, 65535));
}

void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    fail(ATTN_STATUS_BACKEND_ERROR, "ring (CUDA): launching ", what, ": ", cudaGetErrorName(e),
         " (", cudaGetErrorString(e), ")");
}

rk::ChunkRows rows_of(const DeviceChunk& c) {
  return rk::ChunkRows{c.batch, c.heads, c.dim, c.start, c.len, c.stride_b, c.stride_s, c.stride_h};
}

template <class F>
void by_dtype(attn_dtype_t dtype, F f) {
  switch (dtype) {
    case ATTN_DTYPE_FP16: f(static_cast<__half*>(nullptr)); break;
    case ATTN_DTYPE_BF16: f(static_cast<__nv_bfloat16*>(nullptr)); break;
    case ATTN_DTYPE_FP32: f(static_cast<float*>(nullptr)); break;
  }
}

}  // namespace

void device_fill(float* p, float value, int64_t n, void* stream) {
  if (n == 0) return;
  rk::fill_kernel<float><<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, value, n);
  check_launch("fill_kernel");
}

void device_store(void* dst, attn_dtype_t dtype, const float* src, int64_t n, void* stream) {
  if (n == 0) return;
  by_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rk::store_kernel<T><<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(dst), src, n);
  });
  check_launch("store_kernel");
}

void device_accumulate(float* acc, const void* part, attn_dtype_t dtype, const DeviceChunk& chunk,
                       void* stream) {
  const int64_t rows = chunk.batch * chunk.heads * chunk.len;
  if (rows == 0) return;
  by_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rk::accumulate_kernel<T><<<blocks_for(rows * 32), kThreads, 0,
                               static_cast<cudaStream_t>(stream)>>>(
        acc, static_cast<const T*>(part), rows_of(chunk));
  });
  check_launch("accumulate_kernel");
}

void device_merge(float* o_acc, float* lse_acc, const void* o_part, const float* lse_part,
                  attn_dtype_t dtype, const DeviceChunk& chunk, void* stream) {
  const int64_t rows = chunk.batch * chunk.heads * chunk.len;
  if (rows == 0) return;
  by_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rk::merge_kernel<T><<<blocks_for(rows * 32), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        o_acc, lse_acc, static_cast<const T*>(o_part), lse_part, rows_of(chunk));
  });
  check_launch("merge_kernel");
}

}  // namespace attn::ring
