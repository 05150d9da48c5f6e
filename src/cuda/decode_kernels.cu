// Instantiates and launches the paged decode kernels (fp16 and bf16, head
// dims 64 and 128, two- and three-stage pipelines, the cp.async, sm_90
// bulk-copy and sm_90 tensor-copy variants) and the KV append kernel.
#include <algorithm>
#include <climits>
#include <cuda_runtime.h>

#include "cuda/decode_kernels.hpp"
#include "decode/paged_decode.cuh"
#include "decode/paged_decode_sm90.cuh"
#include "decode/paged_decode_tma.cuh"

namespace attn::cuda {
namespace {

// The decode kernel of (dtype, head dim, stages, variant) and its dynamic
// shared memory.
using DecodeKernelFn = void (*)(decode::DecodeParams);
struct KernelChoice {
  DecodeKernelFn fn;
  int smem_bytes;
};
// Dynamic shared memory that leaves room for two blocks per SM but not
// three on sm_90 (228 KiB per SM, 227 KiB per block at most).
constexpr int kTwoPerSmBytes = 78 * 1024;
template <class T, int D, int S>
KernelChoice kernel_of(DecodeKernel variant, bool balanced) {
  if (variant == DecodeKernel::kSm90Tensor)
    return {balanced ? decode::paged_decode_mbar_kernel<T, D, S, true, decode::TensorCopy<T, D, S>>
                     : decode::paged_decode_mbar_kernel<T, D, S, false, decode::TensorCopy<T, D, S>>,
            decode::TensorSmem<D, S>::kBytes};
  if (variant == DecodeKernel::kSm90Bulk32)
    return {balanced ? decode::paged_decode_mbar_kernel<T, D, S, true, decode::BulkCopy<T, D, S, 16>>
                     : decode::paged_decode_mbar_kernel<T, D, S, false, decode::BulkCopy<T, D, S, 16>>,
            std::max(decode::BulkSmem<D, S, 16>::kBytes, kTwoPerSmBytes)};
  if (variant == DecodeKernel::kSm90Bulk)
    return {balanced ? decode::paged_decode_mbar_kernel<T, D, S, true, decode::BulkCopy<T, D, S>>
                     : decode::paged_decode_mbar_kernel<T, D, S, false, decode::BulkCopy<T, D, S>>,
            decode::BulkSmem<D, S>::kBytes};
  return {balanced ? decode::paged_decode_kernel<T, D, S, true> : decode::paged_decode_kernel<T, D, S, false>,
          decode::Smem<D, S>::kBytes};
}

// kernel_of for the runtime choice of dtype, head dim and pipeline stages.
KernelChoice choose(bool bf16, int head_dim, int stages, DecodeKernel variant, bool balanced) {
  if (stages == 3) {
    if (head_dim == 64)
      return bf16 ? kernel_of<__nv_bfloat16, 64, 3>(variant, balanced)
                  : kernel_of<__half, 64, 3>(variant, balanced);
    return bf16 ? kernel_of<__nv_bfloat16, 128, 3>(variant, balanced)
                : kernel_of<__half, 128, 3>(variant, balanced);
  }
  if (head_dim == 64)
    return bf16 ? kernel_of<__nv_bfloat16, 64, 2>(variant, balanced)
                : kernel_of<__half, 64, 2>(variant, balanced);
  return bf16 ? kernel_of<__nv_bfloat16, 128, 2>(variant, balanced)
              : kernel_of<__half, 128, 2>(variant, balanced);
}

// The combine kernel of (dtype, head dim).
DecodeKernelFn combine_of(bool bf16, int head_dim) {
  if (head_dim == 64)
    return bf16 ? decode::decode_combine_kernel<__nv_bfloat16, 64> : decode::decode_combine_kernel<__half, 64>;
  return bf16 ? decode::decode_combine_kernel<__nv_bfloat16, 128> : decode::decode_combine_kernel<__half, 128>;
}

}  // namespace

cudaError_t decode_kernels_available(DecodeKernel variant, int* virtual_arch) {
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(
      &attr, reinterpret_cast<const void*>(kernel_of<__half, 64, 2>(variant, false).fn));
  if (e == cudaSuccess && virtual_arch != nullptr) *virtual_arch = attr.ptxVersion;
  return e;
}

cudaError_t decode_combine_virtual_arch(bool bf16, int head_dim, int* virtual_arch) {
  cudaFuncAttributes attr;
  const cudaError_t e =
      cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(combine_of(bf16, head_dim)));
  if (e == cudaSuccess) *virtual_arch = attr.ptxVersion;
  return e;
}

cudaError_t decode_kernels_allow_smem(bool bf16, int head_dim, int stages, DecodeKernel variant,
                                      bool balanced) {
  const KernelChoice k = choose(bf16, head_dim, stages, variant, balanced);
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(k.fn),
                              cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem_bytes);
}

cudaError_t decode_kernels_blocks_per_sm(bool bf16, int head_dim, int stages, DecodeKernel variant,
                                         bool balanced, int* blocks) {
  const KernelChoice k = choose(bf16, head_dim, stages, variant, balanced);
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, reinterpret_cast<const void*>(k.fn),
                                                       decode::kThreads, k.smem_bytes);
}

cudaError_t decode_kernels_launch(const decode::DecodeParams& p, bool bf16, int head_dim,
                                  int stages, DecodeKernel variant, bool balanced, int64_t blocks,
                                  int heads_kv, int row_tiles, bool combine, bool pdl,
                                  int64_t max_batch, cudaStream_t stream) {
  const KernelChoice k = choose(bf16, head_dim, stages, variant, balanced);
  // x: (block slot, KV head), the head fastest (decode::block_slot).
  if (blocks * heads_kv > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid{unsigned(blocks * heads_kv), 1, unsigned(row_tiles)};
  k.fn<<<grid, decode::kThreads, k.smem_bytes, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || !combine) return e;
  const unsigned tokens = unsigned(p.max_q < decode::kCombineTokens ? p.max_q : decode::kCombineTokens);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3{unsigned(max_batch), unsigned(p.heads_q), tokens};
  cfg.blockDim = dim3{unsigned(decode::kCombineThreads), 1, 1};
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl) {
    // The combine kernel's launch overlaps the decode kernel's last blocks
    // (it waits in griddepcontrol.wait for their partial states).
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, combine_of(bf16, head_dim), p);
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
