// Instantiates and launches the paged decode kernels (fp16 and bf16, head
// dims 64 and 128) and the KV append kernel.
#include <cuda_runtime.h>

#include "cuda/decode_kernels.hpp"
#include "decode/paged_decode.cuh"

namespace attn::cuda {
namespace {

template <class T, int D>
cudaError_t allow_smem_t() {
  return cudaFuncSetAttribute(decode::paged_decode_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, decode::Smem<D>::kBytes);
}

template <class T, int D>
cudaError_t blocks_per_sm_t(int* blocks) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, decode::paged_decode_kernel<T, D>,
                                                       decode::kThreads, decode::Smem<D>::kBytes);
}

template <class T, int D>
cudaError_t launch_t(const decode::DecodeParams& p, int64_t max_units, int heads_kv,
                     int row_tiles, bool combine, int64_t max_batch, cudaStream_t stream) {
  const dim3 grid{unsigned(max_units), unsigned(heads_kv), unsigned(row_tiles)};
  decode::paged_decode_kernel<T, D><<<grid, decode::kThreads, decode::Smem<D>::kBytes, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || !combine) return e;
  const unsigned tokens = unsigned(p.max_q < decode::kCombineTokens ? p.max_q : decode::kCombineTokens);
  const dim3 cgrid{unsigned(max_batch), unsigned(p.heads_q), tokens};
  decode::decode_combine_kernel<T, D><<<cgrid, decode::kCombineThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t decode_kernels_available() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(
      &attr, reinterpret_cast<const void*>(&decode::paged_decode_kernel<__half, 64>));
}

cudaError_t decode_kernels_allow_smem() {
  cudaError_t e = allow_smem_t<__half, 64>();
  if (e == cudaSuccess) e = allow_smem_t<__nv_bfloat16, 64>();
  if (e == cudaSuccess) e = allow_smem_t<__half, 128>();
  if (e == cudaSuccess) e = allow_smem_t<__nv_bfloat16, 128>();
  return e;
}

cudaError_t decode_kernels_blocks_per_sm(bool bf16, int head_dim, int* blocks) {
  if (head_dim == 64)
    return bf16 ? blocks_per_sm_t<__nv_bfloat16, 64>(blocks) : blocks_per_sm_t<__half, 64>(blocks);
  return bf16 ? blocks_per_sm_t<__nv_bfloat16, 128>(blocks) : blocks_per_sm_t<__half, 128>(blocks);
}

cudaError_t decode_kernels_launch(const decode::DecodeParams& p, bool bf16, int head_dim,
                                  int64_t max_units, int heads_kv, int row_tiles, bool combine,
                                  int64_t max_batch, cudaStream_t stream) {
  if (head_dim == 64)
    return bf16 ? launch_t<__nv_bfloat16, 64>(p, max_units, heads_kv, row_tiles, combine, max_batch, stream)
                : launch_t<__half, 64>(p, max_units, heads_kv, row_tiles, combine, max_batch, stream);
  return bf16 ? launch_t<__nv_bfloat16, 128>(p, max_units, heads_kv, row_tiles, combine, max_batch, stream)
              : launch_t<__half, 128>(p, max_units, heads_kv, row_tiles, combine, max_batch, stream);
}

cudaError_t kv_append_launch(const decode::AppendParams& p, bool wide, cudaStream_t stream) {
  if (wide)
    decode::kv_append_kernel<uint4><<<unsigned(p.num_runs), 128, 0, stream>>>(p);
  else
    decode::kv_append_kernel<uint16_t><<<unsigned(p.num_runs), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attn::cuda
