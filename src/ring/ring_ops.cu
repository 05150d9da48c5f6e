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

void device_gather_rows(void* dst, const void* src, const int32_t* map, int64_t n,
                        int64_t row_bytes, void* stream) {
  if (n == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(src) % 16 == 0;
  if (wide) {
    const int64_t row = row_bytes / 16;
    rk::gather_rows_kernel<uint4><<<blocks_for(n * row), kThreads, 0, s>>>(
        static_cast<uint4*>(dst), static_cast<const uint4*>(src), map, n, row);
  } else {
    const int64_t row = row_bytes / 2;
    rk::gather_rows_kernel<uint16_t><<<blocks_for(n * row), kThreads, 0, s>>>(
        static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), map, n, row);
  }
  check_launch("gather_rows_kernel");
}

void device_scatter_store(void* dst, attn_dtype_t dtype, const float* src, const int32_t* map,
                          int64_t n, int64_t row_elems, void* stream) {
  if (n == 0) return;
  by_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rk::scatter_store_kernel<T><<<blocks_for(n * row_elems), kThreads, 0,
                                  static_cast<cudaStream_t>(stream)>>>(static_cast<T*>(dst), src,
                                                                       map, n, row_elems);
  });
  check_launch("scatter_store_kernel");
}

void device_permute_lse(float* dst, const float* src, const int32_t* map, int64_t chunks,
                        int64_t heads, int64_t rows, int64_t local_total, bool to_user,
                        void* stream) {
  const int64_t n = chunks * heads * rows;
  if (n == 0) return;
  rk::permute_lse_kernel<float><<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      dst, src, map, chunks, heads, rows, local_total, to_user);
  check_launch("permute_lse_kernel");
}

}  // namespace attn::ring
