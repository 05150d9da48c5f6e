// The CUDA side of the paged KV cache and the decode plans (host code; the
// kernels are in kernels/decode). Plain C++ with opaque pointers so that
// src/kv, which builds without CUDA, can call it; built only with CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kv/kv_cache.hpp"

namespace attn::kv {
struct DecodeWorkspace;
class DecodePlan;
}  // namespace attn::kv

namespace attn::cuda {

// Device memory for a cache's pages on `device` (cudaMalloc), and its release.
void* kv_pool_alloc(int32_t device, size_t bytes);
void kv_pool_free(int32_t device, void* p) noexcept;

// One run of an append: `count` tokens from token `src_token` of the
// append's K/V into slots slot.. of physical page `page`.
struct KvCopyRun {
  int64_t src_token;
  int32_t page, slot, count;
};

// Enqueues on `stream`, in this order: the page copies (copy-on-write, from
// -> to, K and V) and the token copies of an append. k_base / v_base are
// the pools' device bases, k / v the caller's device K and V.
void kv_append_enqueue(int32_t device, const kv::CacheConfig& cfg, void* k_base, void* v_base,
                       const std::vector<std::pair<int32_t, int32_t>>& page_copies,
                       const std::vector<KvCopyRun>& runs, const void* k, const void* v,
                       void* stream);

// Stages of the decode kernel's pipeline: 2, or what
// ATTN_CUDA_DECODE_STAGES says (2 or 3; a tuning hook, read at plan
// creation; other values are an invalid argument).
int decode_pipeline_stages();

// The decode kernel's variants (cuda::DecodeKernel in decode_kernels.hpp).
constexpr int32_t kDecodeKernelSm80 = 0;      // cp.async from every thread, sm_80+
constexpr int32_t kDecodeKernelSm90Bulk = 1;  // bulk copies on mbarriers, sm_90 code
constexpr int32_t kDecodeKernelSm90Tensor = 2;  // swizzled tensor copies, sm_90 code
constexpr int32_t kDecodeKernelSm90Bulk32 = 3;  // bulk copies to 32-byte aligned segments, <= 2 blocks/SM
constexpr int32_t kDecodeKernelAuto = -1;     // the default choice, by layout and device

// The variant ATTN_CUDA_DECODE_KERNEL asks for (a tuning hook, read at plan
// creation): unset, empty or "auto": kDecodeKernelAuto; "sm80",
// "sm90-bulk", "sm90-bulk32" or "sm90-tensor"; other values are an invalid
// argument.
int32_t decode_kernel_requested();

// Whether ATTN_CUDA_DECODE_SPLIT (a tuning hook, read at plan creation)
// asks for the balanced automatic split: unset, empty, "auto" or "waves":
// no (whole chunks per block, in waves); "balanced": yes (equal runs of
// pages over one wave of blocks, see DecodePlan::balanced_units); other
// values are an invalid argument.
bool decode_split_balanced();

// Whether ATTN_CUDA_DECODE_PDL (a tuning hook, read at plan creation)
// lets the combine kernel use programmatic dependent launch: "1", unset or
// empty: yes; "0": no; other values are an invalid argument.
bool decode_pdl_requested();

// Whether the combine kernel is launched with programmatic dependent
// launch on `device`: where `requested` (decode_pdl_requested), on an
// sm_90+ device, and only if the cache's combine kernel was compiled with
// its wait for the decode grid (virtual architecture 90 or newer).
bool decode_use_pdl(int32_t device, bool requested, const kv::CacheConfig& cache);

// Throws NOT_SUPPORTED (naming the feature) when the decode kernels cannot
// serve a cache so configured with `heads_q` query heads and up to
// `max_query_tokens` tokens per sequence on `device`; else returns the
// variant that will run (`requested`, or the sm_80 one where the device or
// the build has no sm_90 code) and readies its kernel of `stages`
// pipeline stages (of the balanced split or not) for launch.
int32_t decode_check_supported(int32_t device, const kv::CacheConfig& cache, int64_t heads_q,
                               int64_t max_query_tokens, int stages, int32_t requested,
                               bool balanced);

// Decode blocks (one per work unit, KV head and row tile) resident on
// `device` at once for a cache so configured: the wave that automatic
// split-KV fills.
int64_t decode_resident_blocks(int32_t device, const kv::CacheConfig& cache, int stages,
                               int32_t kernel, bool balanced);

// The host staging area of one plan's prepare: pinned memory of the size of
// the workspace's metadata part, and an event that marks when the last
// upload from it finished (the next prepare waits for it before writing).
class DecodeStaging {
 public:
  DecodeStaging(int32_t device, size_t bytes);
  ~DecodeStaging();
  DecodeStaging(const DecodeStaging&) = delete;
  DecodeStaging& operator=(const DecodeStaging&) = delete;

  // Waits until the previous upload has read the staging memory, then
  // returns it for writing.
  char* acquire();
  // Enqueues copies of [offset, offset + bytes) pieces of the staging
  // memory to the same offsets of `device_base` on `stream`, then records
  // the event.
  void upload(void* device_base, const std::vector<std::pair<size_t, size_t>>& pieces,
              void* stream);

 private:
  int32_t device_;
  size_t bytes_;
  char* host_ = nullptr;
  void* event_ = nullptr;  // cudaEvent_t
  bool pending_ = false;
};

// Whether `stream` (a cudaStream_t; null: the legacy default stream) of
// `device` is being captured into a CUDA graph.
bool stream_is_capturing(int32_t device, void* stream);

// Launches the decode kernel, `blocks` x heads_kv x row tiles (and, when
// `may_split`, the combine kernel) of `plan` on stream; everything they
// read is in the workspace.
void decode_launch(const kv::DecodePlan& plan, const kv::KvCache& cache,
                   const kv::DecodeWorkspace& ws, int64_t blocks, const void* q, void* o,
                   float* lse, bool may_split, void* stream);

}  // namespace attn::cuda
