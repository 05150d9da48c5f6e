// Device code of attn_merge_states on the CUDA backend: num_parts partial
// states (O_p, LSE_p) of the same rows merged into the state over the union
// of their keys (attn.h):
//
//   LSE = m + log(sum_p w_p),  w_p = exp(LSE_p - m),  m = max_p LSE_p
//   O   = sum_p w_p O_p / sum_p w_p      (every part empty: O = 0, LSE = -inf)
//
// Shapes: O_p and O_out [lead dims..., dim] with the descriptor's strides
// (last stride 1), LSE_p and LSE_out [lead dims...] fp32 with theirs. One
// warp per row: lanes over the parts for the weights, then over the
// channels. Every part and the output of a row are read and written by that
// warp only, each element by one lane, and the LSE after every lane has read
// its parts, so that O_out == O_0 and LSE_out == LSE_0 (in place) are safe.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attn::merge_kernels {

// Parts per launch (they travel as kernel parameters); the host merges more
// by chaining launches through O_out and LSE_out.
constexpr int kMaxParts = 128;
constexpr int kMaxLead = 7;  // ATTN_MAX_DIMS - 1 leading dims
constexpr int kWarpsPerBlock = 8;

struct MergeParams {
  const void* o[kMaxParts];
  const float* lse[kMaxParts];
  void* o_out;
  float* lse_out;  // may be null
  int32_t num_parts;
  int32_t lead;  // leading dims
  int64_t dims[kMaxLead];
  int64_t o_strides[kMaxLead], lse_strides[kMaxLead];
  int64_t rows, dim;
};

__device__ inline float load_float(const float* p) { return *p; }
__device__ inline float load_float(const __half* p) { return __half2float(*p); }
__device__ inline float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ inline void store_float(float* p, float x) { *p = x; }
__device__ inline void store_float(__half* p, float x) { *p = __float2half_rn(x); }
__device__ inline void store_float(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// grid: ceil(rows / kWarpsPerBlock) blocks, at most 2^20 (the host's cap;
// the rows beyond, grid-stride), kWarpsPerBlock * 32 threads.
template <class T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    merge_states_kernel(const __grid_constant__ MergeParams p) {
  __shared__ float weights[kWarpsPerBlock][kMaxParts];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* w = weights[warp];
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + warp; row < p.rows; row += warps) {
    // The row's element offsets, from its multi-index (last dim fastest).
    int64_t oo = 0, lo = 0, rem = row;
    for (int i = p.lead - 1; i >= 0; --i) {
      const int64_t idx = rem % p.dims[i];
      rem /= p.dims[i];
      oo += idx * p.o_strides[i];
      lo += idx * p.lse_strides[i];
    }
    // Lanes over the parts: the row's max LSE, then the weights.
    float m = -INFINITY;
    bool nan = false;
    for (int part = lane; part < p.num_parts; part += 32) {
      const float x = p.lse[part][lo];
      w[part] = x;
      m = fmaxf(m, x);
      nan = nan || x != x;
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, s));
    // A NaN LSE makes the row NaN (fmaxf drops it: a row of NaN parts would
    // come out as an empty one).
    if (__any_sync(0xffffffffu, nan)) m = __int_as_float(0x7fffffff);
    const bool empty = m == -INFINITY;  // every part saw no key: the identity
    float total = 0.0f;
    for (int part = lane; part < p.num_parts; part += 32) {
      const float e = empty ? 0.0f : expf(w[part] - m);
      w[part] = e;
      total += e;
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) total += __shfl_xor_sync(0xffffffffu, total, s);
    __syncwarp();  // the weights in shared memory, for every lane
    const float inv = empty ? 0.0f : 1.0f / total;
    // Lanes over the channels.
    T* out = static_cast<T*>(p.o_out) + oo;
    for (int64_t c = lane; c < p.dim; c += 32) {
      float acc = 0.0f;
      for (int part = 0; part < p.num_parts; ++part)
        if (w[part] != 0.0f) acc += w[part] * load_float(static_cast<const T*>(p.o[part]) + oo + c);
      store_float(out + c, acc * inv);
    }
    if (lane == 0 && p.lse_out != nullptr) p.lse_out[lo] = empty ? -INFINITY : m + logf(total);
    __syncwarp();  // the weights are read before the next row writes them
  }
}

}  // namespace attn::merge_kernels
