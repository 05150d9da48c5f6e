// MoBA's selector launches (see moba_select.hpp).
#include <cuda_runtime.h>

#include "cuda/moba_select.hpp"
#include "moba/moba_rounds.cuh"
#include "moba/moba_select.cuh"

namespace attn::cuda {

cudaError_t moba_select_prepare(int d) {
  const int bytes = int(moba::select_smem_bytes(d));
  const cudaError_t e = cudaFuncSetAttribute(moba::select_kernel<__half>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(moba::select_kernel<__nv_bfloat16>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

namespace {

template <class T>
cudaError_t launch_t(const moba::SelectParams& p, cudaStream_t stream, bool select) {
  const int64_t slots = int64_t(p.batch) * p.sel_heads;
  // No zeroing of p.selected: select_kernel stores every word of it (its
  // grid has one CTA per word column, q_words = ceil(seqlen_q / 64)), and
  // when it is not launched `selected` has no word.
  if (select && p.num_blocks > 0 && p.seqlen_q > 0) {
    moba::pool_kernel<T><<<dim3(unsigned(p.num_blocks), unsigned(p.heads_kv), unsigned(p.batch)),
                           moba::kPoolThreads, 0, stream>>>(p);
    const unsigned row_tiles = unsigned((p.seqlen_q + moba::kSelectRows - 1) / moba::kSelectRows);
    moba::select_kernel<T><<<dim3(row_tiles, unsigned(p.sel_heads), unsigned(p.batch)),
                             moba::kSelectThreads, moba::select_smem_bytes(p.d), stream>>>(p);
  }
  constexpr int64_t per_block = moba::kListThreads / 32;
  const int64_t q_lists = slots * p.q_tiles;
  if (p.q_count != nullptr && q_lists > 0)
    moba::q_list_kernel<<<unsigned((q_lists + per_block - 1) / per_block), moba::kListThreads, 0,
                          stream>>>(p);
  const int64_t kv_lists = int64_t(p.batch) * p.heads_kv * p.num_blocks;
  if (p.kv_count != nullptr && kv_lists > 0)
    moba::kv_list_kernel<<<unsigned((kv_lists + per_block - 1) / per_block), moba::kListThreads, 0,
                           stream>>>(p);
  const int64_t row_lists = slots * p.num_blocks;
  if (p.row_offsets != nullptr && row_lists > 0) {
    const unsigned list_blocks = unsigned((row_lists + per_block - 1) / per_block);
    moba::row_count_kernel<<<list_blocks, moba::kListThreads, 0, stream>>>(p);
    moba::row_scan_kernel<<<unsigned((slots + per_block - 1) / per_block), moba::kListThreads, 0,
                            stream>>>(p);
    moba::row_scatter_kernel<<<list_blocks, moba::kListThreads, 0, stream>>>(p);
  }
  if (p.round_lists != nullptr && row_lists > 0) {
    const size_t pair_bytes = size_t(p.rounds) * size_t(slots) * size_t(p.num_blocks + 1) * 8u;
    const cudaError_t e = cudaMemsetAsync(p.round_lists, 0, pair_bytes, stream);
    if (e != cudaSuccess) return e;
    const unsigned word_blocks = unsigned((slots * p.q_words + per_block - 1) / per_block);
    moba::round_count_kernel<<<word_blocks, moba::kListThreads, 0, stream>>>(p);
    moba::round_scan_kernel<<<unsigned((p.rounds * slots + per_block - 1) / per_block),
                              moba::kListThreads, 0, stream>>>(p);
    moba::round_scatter_kernel<<<word_blocks, moba::kListThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t moba_select_launch(const moba::SelectParams& p, bool bf16, cudaStream_t stream,
                               bool select) {
  return bf16 ? launch_t<__nv_bfloat16>(p, stream, select) : launch_t<__half>(p, stream, select);
}

cudaError_t moba_blind_rows_launch(const moba::BlindRowsParams& p, bool bf16,
                                   cudaStream_t stream) {
  const int64_t blind = int64_t(p.seqlen_q) - p.seqlen_kv;
  if (blind <= 0) return cudaSuccess;
  const int64_t threads = int64_t(p.batch) * p.heads_q * blind * (p.d / 8);
  if (threads == 0) return cudaSuccess;
  const unsigned blocks = unsigned((threads + moba::kListThreads - 1) / moba::kListThreads);
  if (bf16)
    moba::blind_rows_kernel<__nv_bfloat16><<<blocks, moba::kListThreads, 0, stream>>>(p);
  else
    moba::blind_rows_kernel<__half><<<blocks, moba::kListThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attn::cuda
