// Instantiates and launches the warp-specialised sm_90a forward
// (flash_fwd_sm90_ws_kernel<T, D, Sparse>), and encodes its tensor maps;
// included by flash_fwd_sm90_ws_d{64,128}.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/flash_fwd.hpp"
#include "cuda/tensor_map.hpp"
#include "flash/fwd_sm90_ws_kernel.cuh"

namespace attn::cuda {

// The map of one of Q, K, V ([batch][seqlen][heads][d], strides in
// elements): dims {d, seqlen, heads, batch}, box {64, 128, 1, 1} (a panel
// of the swizzled layout), 128-byte swizzle, zeros outside.
inline CUresult encode_fwd_rows_map(CUtensorMap* map, bool bf16, int d, const void* base,
                                    int64_t seqlen, int64_t heads, int64_t batch, int64_t seq_stride,
                                    int64_t head_stride, int64_t batch_stride) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  constexpr cuuint64_t es = 2;
  // A batch of one never steps along the last dim: any valid stride.
  const int64_t bs = batch > 1 ? batch_stride : seqlen * seq_stride;
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(seqlen), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(seq_stride) * es, cuuint64_t(head_stride) * es,
                                 cuuint64_t(bs) * es};
  const cuuint32_t box[4] = {64, 128, 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// The three maps of wp.p's tensors; false if the encoder refuses one
// (strides or base not 16-byte aligned, no encoder).
inline bool encode_fwd_ws_maps(flash::FwdWsParams& wp, int d, bool bf16) {
  const flash::FwdParams& p = wp.p;
  const int64_t heads_kv = wp.heads_q / p.group;
  return encode_fwd_rows_map(&wp.q_map, bf16, d, p.q, p.seqlen_q, wp.heads_q, wp.batch, p.q_seq,
                             p.q_head, p.q_batch) == CUDA_SUCCESS &&
         encode_fwd_rows_map(&wp.k_map, bf16, d, p.k, p.seqlen_kv, heads_kv, wp.batch, p.k_seq,
                             p.k_head, p.k_batch) == CUDA_SUCCESS &&
         encode_fwd_rows_map(&wp.v_map, bf16, d, p.v, p.seqlen_kv, heads_kv, wp.batch, p.v_seq,
                             p.v_head, p.v_batch) == CUDA_SUCCESS;
}

template <class T, int D, bool Sparse>
cudaError_t fwd_ws_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_sm90_ws_kernel<T, D, Sparse>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(flash::ws::smem_bytes<D>()));
}

// The parameters of m_blocks x heads_q x batch work items and the grid
// that deals them over one block per SM (0 blocks: no item); false where
// the tensor maps do not encode.
template <class T, int D>
cudaError_t fwd_ws_setup(const flash::FwdParams& params, int m_blocks, int heads_q, int batch,
                         flash::FwdWsParams& wp, int& blocks) {
  wp = flash::FwdWsParams{};
  wp.p = params;
  wp.m_blocks = m_blocks;
  wp.heads_q = heads_q;
  wp.batch = batch;
  if (!encode_fwd_ws_maps(wp, D, std::is_same_v<T, __nv_bfloat16>)) return cudaErrorInvalidValue;
  int device = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  blocks = int(std::min<int64_t>(int64_t(m_blocks) * heads_q * batch, sms));
  return cudaSuccess;
}

// m_blocks x heads_q x batch work items (Sparse: one per query tile of the
// tile lists), dealt over one block per SM.
template <class T, int D, bool Sparse>
cudaError_t fwd_ws_launch(const flash::FwdParams& params, int m_blocks, int heads_q, int batch,
                          cudaStream_t stream) {
  flash::FwdWsParams wp;
  int blocks = 0;
  const cudaError_t e = fwd_ws_setup<T, D>(params, m_blocks, heads_q, batch, wp, blocks);
  if (e != cudaSuccess || blocks == 0) return e;
  // Items of different lengths (see the kernel's top): block-sparse lists,
  // causal and window masks; unless the plan asks for an order.
  const int pairs = heads_q * batch;
  wp.x_group = params.ws_group > 0 ? std::min(params.ws_group, pairs)
               : Sparse || params.window_left >= 0 || params.window_right >= 0 ? pairs
                                                                                : 1;
  constexpr flash::FwdSm90Config cfg = flash::fwd_sm90_ws_config(D);
  flash::flash_fwd_sm90_ws_kernel<T, D, Sparse>
      <<<blocks, cfg.threads(), flash::ws::smem_bytes<D>(), stream>>>(wp);
#if ATTN_FWD_WS_TRACE
  flash::ws::trace_print_kernel<<<1, 1, 0, stream>>>();  // diagnostic builds
#endif
  return cudaGetLastError();
}

// MoBA's gathered forward (flash_fwd_sm90_ws_moba_gather_kernel): one round
// (params.moba.fwd_round), m_blocks the most tiles the round can have per
// (sequence, query head).
template <int D>
constexpr size_t fwd_ws_moba_gather_smem() {
  return flash::ws::smem_bytes<D>() + sizeof(flash::ws::GatherCtl);
}
template <class T, int D>
cudaError_t fwd_ws_moba_gather_prepare() {
  return cudaFuncSetAttribute(flash::flash_fwd_sm90_ws_moba_gather_kernel<T, D>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(fwd_ws_moba_gather_smem<D>()));
}
template <class T, int D>
cudaError_t fwd_ws_moba_gather_launch(const flash::FwdParams& params, int m_blocks, int heads_q,
                                      int batch, cudaStream_t stream) {
  flash::FwdWsParams wp;
  int blocks = 0;
  const cudaError_t e = fwd_ws_setup<T, D>(params, m_blocks, heads_q, batch, wp, blocks);
  if (e != cudaSuccess || blocks == 0) return e;
  constexpr flash::FwdSm90Config cfg = flash::fwd_sm90_ws_config(D);
  flash::flash_fwd_sm90_ws_moba_gather_kernel<T, D>
      <<<blocks, cfg.threads(), fwd_ws_moba_gather_smem<D>(), stream>>>(wp);
#if ATTN_FWD_WS_TRACE
  flash::ws::trace_print_kernel<<<1, 1, 0, stream>>>();  // diagnostic builds
#endif
  return cudaGetLastError();
}
template <int D>
FwdKernel make_fwd_kernel_sm90_ws_moba_gather(bool bf16) {
  if (bf16)
    return {&fwd_ws_moba_gather_prepare<__nv_bfloat16, D>,
            &fwd_ws_moba_gather_launch<__nv_bfloat16, D>,
            reinterpret_cast<const void*>(
                &flash::flash_fwd_sm90_ws_moba_gather_kernel<__nv_bfloat16, D>)};
  return {&fwd_ws_moba_gather_prepare<__half, D>, &fwd_ws_moba_gather_launch<__half, D>,
          reinterpret_cast<const void*>(&flash::flash_fwd_sm90_ws_moba_gather_kernel<__half, D>)};
}

template <class T, int D, bool Sparse>
FwdKernel make_fwd_kernel_sm90_ws_t() {
  return {&fwd_ws_prepare<T, D, Sparse>, &fwd_ws_launch<T, D, Sparse>,
          reinterpret_cast<const void*>(&flash::flash_fwd_sm90_ws_kernel<T, D, Sparse>)};
}

template <int D>
FwdKernel make_fwd_kernel_sm90_ws(bool bf16, bool sparse) {
  if (bf16)
    return sparse ? make_fwd_kernel_sm90_ws_t<__nv_bfloat16, D, true>()
                  : make_fwd_kernel_sm90_ws_t<__nv_bfloat16, D, false>();
  return sparse ? make_fwd_kernel_sm90_ws_t<__half, D, true>()
                : make_fwd_kernel_sm90_ws_t<__half, D, false>();
}

}  // namespace attn::cuda
