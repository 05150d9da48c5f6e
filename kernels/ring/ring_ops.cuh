// Device code of the CUDA ring plan: the elementwise steps between the dense
// block kernels. Local tensors are contiguous in the plan's layout; element
// (b, s, h, c) of one lives at b * stride_b + s * stride_s + h * stride_h + c.
// A *chunk* is the rows s in [start, start + len) of every (b, h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attn::ring_kernels {

struct ChunkRows {
  int64_t batch, heads, dim;
  int64_t start, len;                   // the chunk's rows of the local sequence
  int64_t stride_b, stride_s, stride_h;  // of the tensor, in elements
};

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ inline T from_float(float x);
template <> __device__ inline float from_float<float>(float x) { return x; }
template <> __device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Row r of a chunk, r = (b * heads + h) * len + i: its element offset.
__device__ inline int64_t chunk_row_offset(const ChunkRows& g, int64_t r) {
  const int64_t i = r % g.len, bh = r / g.len;
  const int64_t h = bh % g.heads, b = bh / g.heads;
  return b * g.stride_b + (g.start + i) * g.stride_s + h * g.stride_h;
}

// p[0..n) = value.   grid-stride
// (A template, like every kernel here: the host stub of a plain kernel would
// be a strong global symbol outside namespace attn in the static library.)
template <class T>
__global__ void fill_kernel(T* p, T value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

// dst[i] = T(src[i]) for a contiguous tensor of n elements.
template <class T>
__global__ void store_kernel(T* dst, const float* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_float<T>(src[i]);
}

// acc[chunk] += part[chunk]: acc fp32, part in the dtype, same layout.
// One warp per row, lanes over the head dim.
template <class T>
__global__ void accumulate_kernel(float* acc, const T* part, ChunkRows g) {
  const int64_t rows = g.batch * g.heads * g.len;
  const int lane = threadIdx.x % 32;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; r < rows;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t off = chunk_row_offset(g, r);
    for (int64_t c = lane; c < g.dim; c += 32) acc[off + c] += to_float(part[off + c]);
  }
}

// The (O, LSE) merge of attn_merge_states for one chunk, in place into the
// fp32 running state:  m = max(lse_acc, lse_part), w = exp(lse - m),
// O_acc = (w_acc O_acc + w_part O_part) / (w_acc + w_part),
// LSE_acc = m + log(w_acc + w_part). Both empty (m = -inf): unchanged (the
// running state starts as O = 0, LSE = -inf). LSE of the chunk is
// [batch, heads, len]. One warp per row.
template <class T>
__global__ void merge_kernel(float* o_acc, float* lse_acc, const T* o_part, const float* lse_part,
                             ChunkRows g) {
  const int64_t rows = g.batch * g.heads * g.len;
  const int lane = threadIdx.x % 32;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; r < rows;
       r += int64_t(gridDim.x) * blockDim.x / 32) {
    const float la = lse_acc[r], lp = lse_part[r];
    const float m = fmaxf(la, lp);
    if (m == -INFINITY) continue;
    const float wa = __expf(la - m), wp = __expf(lp - m);  // exp(-inf) = 0
    const float inv = 1.0f / (wa + wp);
    const int64_t off = chunk_row_offset(g, r);
    for (int64_t c = lane; c < g.dim; c += 32) {
      const float part = wp != 0.0f ? to_float(o_part[off + c]) : 0.0f;
      o_acc[off + c] = (wa * o_acc[off + c] + wp * part) * inv;
    }
    __syncwarp();
    if (lane == 0) lse_acc[r] = m + logf(wa + wp);
  }
}

// Row permutations of the varlen zigzag layout (one row = heads * dim
// elements of one token): `map` gives, for each token of the chunk-major
// order, its token in the caller's order.

// f(x, i, c) for every element x = i * row + c of n rows of `row`
// elements, grid-stride over the elements.
template <class F>
__device__ __forceinline__ void for_each_row_element(int64_t n, int64_t row, F&& f) {
  for (int64_t x = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; x < n * row;
       x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = x / row, c = x - i * row;
    f(x, i, c);
  }
}

// dst[i] = src[map[i]], rows of `row` words W.
template <class W>
__global__ void gather_rows_kernel(W* dst, const W* src, const int32_t* map, int64_t n,
                                   int64_t row) {
  for_each_row_element(n, row, [&](int64_t x, int64_t i, int64_t c) {
    dst[x] = src[int64_t(map[i]) * row + c];
  });
}

// dst[map[i]] = T(src[i]), rows of `row` elements; src fp32.
template <class T>
__global__ void scatter_store_kernel(T* dst, const float* src, const int32_t* map, int64_t n,
                                     int64_t row) {
  for_each_row_element(n, row, [&](int64_t x, int64_t i, int64_t c) {
    dst[int64_t(map[i]) * row + c] = from_float<T>(src[x]);
  });
}

// LSE between the chunk-major layout, chunk c = [heads, rows] at c * heads *
// rows, and the caller's [heads, local_total]: entry (c, h, i) is the
// caller's (h, map[c * rows + i]). to_user: chunk-major -> caller's.
template <class F>
__global__ void permute_lse_kernel(F* dst, const F* src, const int32_t* map, int64_t chunks,
                                   int64_t heads, int64_t rows, int64_t local_total, bool to_user) {
  const int64_t n = chunks * heads * rows;
  for (int64_t x = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; x < n;
       x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = x % rows, ch = x / rows;
    const int64_t h = ch % heads, c = ch / heads;
    const int64_t user = h * local_total + map[c * rows + i];
    if (to_user)
      dst[user] = src[x];
    else
      dst[x] = src[user];
  }
}

}  // namespace attn::ring_kernels
