// Instantiates and launches the paged decode kernels (fp16 and bf16, head
// dims 64 and 128, two- and three-stage pipelines) and the KV append kernel.
#include <algorithm>
#include <cuda_runtime.h>

#include "cuda/decode_kernels.hpp"
#include "decode/paged_decode.cuh"

namespace attn::cuda {
namespace {

template <class T, int D, int S>
cudaError_t allow_smem_t() {
  return cudaFuncSetAttribute(decode::paged_decode_kernel<T, D, S>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, decode::Smem<D, S>::kBytes);
}

template <class T, int D, int S>
cudaError_t blocks_per_sm_t(int* blocks) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, decode::paged_decode_kernel<T, D, S>,
                                                       decode::kThreads, decode::Smem<D, S>::kBytes);
}

template <class T, int D, int S>
cudaError_t launch_t(const decode::DecodeParams& p, int64_t max_units, int heads_kv,
                     int row_tiles, bool combine, int64_t max_batch, cudaStream_t stream) {
  const dim3 grid{unsigned(max_units), unsigned(heads_kv), unsigned(row_tiles)};
  decode::paged_decode_kernel<T, D, S>
      <<<grid, decode::kThreads, decode::Smem<D, S>::kBytes, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || !combine) return e;
  const unsigned tokens = unsigned(p.max_q < decode::kCombineTokens ? p.max_q : decode::kCombineTokens);
  const dim3 cgrid{unsigned(max_batch), unsigned(p.heads_q), tokens};
  decode::decode_combine_kernel<T, D><<<cgrid, decode::kCombineThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Calls f.run<T, D, S>() for the runtime choice of dtype, head dim and
// pipeline stages.
template <class F>
cudaError_t dispatch(bool bf16, int head_dim, int stages, const F& f) {
  if (stages == 3) {
    if (head_dim == 64)
      return bf16 ? f.template run<__nv_bfloat16, 64, 3>() : f.template run<__half, 64, 3>();
    return bf16 ? f.template run<__nv_bfloat16, 128, 3>() : f.template run<__half, 128, 3>();
  }
  if (head_dim == 64)
    return bf16 ? f.template run<__nv_bfloat16, 64, 2>() : f.template run<__half, 64, 2>();
  return bf16 ? f.template run<__nv_bfloat16, 128, 2>() : f.template run<__half, 128, 2>();
}

struct AllowSmem {
  template <class T, int D, int S>
  cudaError_t run() const { return allow_smem_t<T, D, S>(); }
};
struct BlocksPerSm {
  int* blocks;
  template <class T, int D, int S>
  cudaError_t run() const { return blocks_per_sm_t<T, D, S>(blocks); }
};
struct Launch {
  const decode::DecodeParams& p;
  int64_t max_units;
  int heads_kv, row_tiles;
  bool combine;
  int64_t max_batch;
  cudaStream_t stream;
  template <class T, int D, int S>
  cudaError_t run() const {
    return launch_t<T, D, S>(p, max_units, heads_kv, row_tiles, combine, max_batch, stream);
  }
};

}  // namespace

cudaError_t decode_kernels_available() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(
      &attr, reinterpret_cast<const void*>(&decode::paged_decode_kernel<__half, 64, 2>));
}

cudaError_t decode_kernels_allow_smem(bool bf16, int head_dim, int stages) {
  return dispatch(bf16, head_dim, stages, AllowSmem{});
}

cudaError_t decode_kernels_blocks_per_sm(bool bf16, int head_dim, int stages, int* blocks) {
  return dispatch(bf16, head_dim, stages, BlocksPerSm{blocks});
}

cudaError_t decode_kernels_launch(const decode::DecodeParams& p, bool bf16, int head_dim,
                                  int stages, int64_t max_units, int heads_kv, int row_tiles,
                                  bool combine, int64_t max_batch, cudaStream_t stream) {
  return dispatch(bf16, head_dim, stages,
                  Launch{p, max_units, heads_kv, row_tiles, combine, max_batch, stream});
}

cudaError_t kv_append_launch(const decode::AppendParams& p, bool wide, cudaStream_t stream) {
  // Slices per (run, side): enough for the longest run's rows, one group of
  // threads x ILP units each (grid-strided past the grid's limit).
  const int64_t unit = wide ? 16 : 2;
  int64_t longest = 0;
  for (int32_t r = 0; r < p.num_runs; ++r) longest = std::max<int64_t>(longest, p.runs[r].count);
  const int64_t units = longest * p.heads_kv * std::max(p.k_row_bytes, p.v_row_bytes) / unit;
  const int64_t group = int64_t(decode::kAppendThreads) * decode::kAppendIlp;
  const dim3 grid(unsigned(p.num_runs), 2,
                  unsigned(std::clamp<int64_t>((units + group - 1) / group, 1, 65535)));
  if (wide)
    decode::kv_append_kernel<uint4><<<grid, decode::kAppendThreads, 0, stream>>>(p);
  else
    decode::kv_append_kernel<uint16_t><<<grid, decode::kAppendThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attn::cuda
