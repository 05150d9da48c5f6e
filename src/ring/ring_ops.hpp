// Host entry points of the CUDA ring plan's elementwise kernels
// (kernels/ring/ring_ops.cuh). No CUDA types: streams are void*. Each call
// enqueues on `stream` and throws BACKEND_ERROR when the launch fails.
#pragma once

#include <attn/attn.h>

#include <cstdint>

namespace attn::ring {

// A chunk of a local tensor; see kernels/ring/ring_ops.cuh.
struct DeviceChunk {
  int64_t batch, heads, dim;
  int64_t start, len;
  int64_t stride_b, stride_s, stride_h;
};

void device_fill(float* p, float value, int64_t n, void* stream);
// dst (dtype, contiguous n elements) = src (fp32).
void device_store(void* dst, attn_dtype_t dtype, const float* src, int64_t n, void* stream);
// acc (fp32) += part (dtype) over the chunk.
void device_accumulate(float* acc, const void* part, attn_dtype_t dtype, const DeviceChunk& chunk,
                       void* stream);
// (o_acc, lse_acc) := merge((o_acc, lse_acc), (o_part, lse_part)) over the
// chunk; lse_* are the chunk's [batch, heads, len].
void device_merge(float* o_acc, float* lse_acc, const void* o_part, const float* lse_part,
                  attn_dtype_t dtype, const DeviceChunk& chunk, void* stream);

// Row permutations (kernels/ring/ring_ops.cuh): rows of `row_bytes` bytes
// (even); map[i] is the caller's row of chunk-major row i, n rows.
// dst[i] = src[map[i]].
void device_gather_rows(void* dst, const void* src, const int32_t* map, int64_t n,
                        int64_t row_bytes, void* stream);
// dst[map[i]] = dtype(src[i]), rows of row_elems elements, src fp32.
void device_scatter_store(void* dst, attn_dtype_t dtype, const float* src, const int32_t* map,
                          int64_t n, int64_t row_elems, void* stream);
// LSE between chunk-major [chunks][heads][rows] and the caller's [heads,
// local_total] (token map[c * rows + i]); to_user picks the direction.
void device_permute_lse(float* dst, const float* src, const int32_t* map, int64_t chunks,
                        int64_t heads, int64_t rows, int64_t local_total, bool to_user,
                        void* stream);

}  // namespace attn::ring
