// Host side of attn_merge_states on CUDA: checks what the kernel needs of
// the pointers, then launches kernels/merge/merge_states.cuh once per
// kMaxParts parts, each launch after the first merging the running result
// (o_out, lse_out) with the next parts.
#include "cuda/merge_cuda.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/cuda_util.hpp"
#include "merge/merge_states.cuh"

namespace attn::cuda {
namespace {

namespace mk = attn::merge_kernels;

void require_aligned(const void* p, size_t align, const char* name, int32_t index) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    if (index >= 0)
      invalid_argument(name, "[", index, "]: the CUDA merge needs ", align,
                       "-byte aligned device pointers (element-aligned), got ", p);
    invalid_argument(name, ": the CUDA merge needs ", align,
                     "-byte aligned device pointers (element-aligned), got ", p);
  }
}

template <class T>
void launch(const mk::MergeParams& params, cudaStream_t stream) {
  const int64_t blocks = std::clamp<int64_t>(
      (params.rows + mk::kWarpsPerBlock - 1) / mk::kWarpsPerBlock, 1, int64_t(1) << 20);
  mk::merge_states_kernel<T><<<unsigned(blocks), mk::kWarpsPerBlock * 32, 0, stream>>>(params);
  check(cudaGetLastError(), "launching merge_states_kernel", "attn_merge_states (CUDA)");
}

}  // namespace

int32_t merge_max_parts_without_lse() { return mk::kMaxParts; }

void merge_states(const ContextConfig& ctx, int32_t num_parts, const TensorDesc& o,
                  const TensorDesc& lse, const void* const* o_parts, const float* const* lse_parts,
                  void* o_out, float* lse_out, void* stream) {
  const int32_t lead = o.ndim - 1;
  int64_t rows = 1;
  for (int32_t i = 0; i < lead; ++i) rows *= o.dims[i];
  const int64_t dim = o.dims[lead];
  if (rows == 0) return;
  if (num_parts > mk::kMaxParts && lse_out == nullptr)
    not_supported("attn_merge_states (CUDA): more than ", mk::kMaxParts, " parts (", num_parts,
                  ") need lse_out, which carries the running state between the kernel's launches");
  const size_t es = dtype_size(o.dtype);
  for (int32_t i = 0; i < num_parts; ++i) {
    require_aligned(lse_parts[i], alignof(float), "lse_parts", i);
    if (dim > 0) require_aligned(o_parts[i], es, "o_parts", i);
  }
  if (lse_out != nullptr) require_aligned(lse_out, alignof(float), "lse_out", -1);
  if (dim > 0) require_aligned(o_out, es, "o_out", -1);

  DeviceScope scope(ctx.device, "attn_merge_states (CUDA)");
  mk::MergeParams params{};
  params.o_out = o_out;
  params.lse_out = lse_out;
  params.lead = lead;
  for (int32_t i = 0; i < lead; ++i) {
    params.dims[i] = o.dims[i];
    params.o_strides[i] = o.strides[i];
    params.lse_strides[i] = lse.strides[i];
  }
  params.rows = rows;
  params.dim = dim;
  const auto s = static_cast<cudaStream_t>(stream);
  // Launch k merges parts [first, first + take); after the first, slot 0
  // holds the running result (o_out, lse_out).
  for (int32_t first = 0; first < num_parts;) {
    const int32_t carried = first == 0 ? 0 : 1;
    const int32_t take = std::min(num_parts - first, mk::kMaxParts - carried);
    if (carried) {
      params.o[0] = o_out;
      params.lse[0] = lse_out;
    }
    for (int32_t j = 0; j < take; ++j) {
      params.o[carried + j] = o_parts[first + j];
      params.lse[carried + j] = lse_parts[first + j];
    }
    params.num_parts = carried + take;
    switch (o.dtype) {
      case ATTN_DTYPE_FP16: launch<__half>(params, s); break;
      case ATTN_DTYPE_BF16: launch<__nv_bfloat16>(params, s); break;
      default: launch<float>(params, s); break;
    }
    first += take;
  }
}

}  // namespace attn::cuda
