// Host side of the CUDA KV cache and decode plans: page memory, appends
// (a kernel over runs of tokens, passed by value so that nothing is
// uploaded first), the prepare staging area and the decode launches.
// The kernels are in kernels/decode, launched through decode_kernels.cu.
#include "cuda/decode_cuda.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/env.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/decode_kernels.hpp"
#include "cuda/limits.hpp"
#include "cuda/tensor_map.hpp"
#include "kv/decode_plan.hpp"

namespace attn::cuda {
namespace {

// The kernels read the host's metadata structs through mirrors.
static_assert(sizeof(decode::Header) == sizeof(kv::PreparedHeader));
static_assert(offsetof(decode::Header, num_units) == offsetof(kv::PreparedHeader, num_units));
static_assert(offsetof(decode::Header, total_q) == offsetof(kv::PreparedHeader, total_q));
static_assert(offsetof(decode::Header, batch) == offsetof(kv::PreparedHeader, batch));
static_assert(sizeof(decode::SeqMeta) == sizeof(kv::SeqMeta));
static_assert(offsetof(decode::SeqMeta, num_units) == offsetof(kv::SeqMeta, num_units));
static_assert(offsetof(decode::SeqMeta, length) == offsetof(kv::SeqMeta, length));
static_assert(sizeof(decode::PageEntry) == sizeof(kv::PageEntry));
static_assert(offsetof(decode::PageEntry, page) == offsetof(kv::PageEntry, page));
static_assert(sizeof(decode::WorkUnit) == sizeof(kv::WorkUnit));
static_assert(offsetof(decode::WorkUnit, partial) == offsetof(kv::WorkUnit, partial));

// The tensor-copy kernel's view of a K or V pool (paged_decode_tma.cuh):
// dims {head dim, page slots, KV heads, pages} with the layout's strides, a
// box of 8 slots x 64 elements of one head and page, 128-byte swizzled;
// coordinates outside read as zeros.
CUresult try_encode_pool_map(CUtensorMap* map, const kv::CacheConfig& cc, const void* pool) {
  const cuuint64_t esize = cuuint64_t(dtype_size(cc.dtype));
  const cuuint64_t dims[4] = {cuuint64_t(cc.head_dim_qk), cuuint64_t(cc.page_size),
                              cuuint64_t(cc.heads_kv), cuuint64_t(cc.num_pages)};
  const cuuint64_t strides[3] = {cuuint64_t(cc.slot_offset(1, 0, cc.head_dim_qk)) * esize,
                                 cuuint64_t(cc.slot_offset(0, 1, cc.head_dim_qk)) * esize,
                                 cuuint64_t(cc.k_page_elems()) * esize};
  const cuuint32_t box[4] = {64, 8, 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  return tensor_map_encoder()(
      map, cc.dtype == ATTN_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      4, const_cast<void*>(pool), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Whether a pool of this configuration has a tensor map (the encoder
// exists and takes its dims and strides; tried on a stand-in address with
// the alignment of the pools, so at plan creation, before any cache): the
// plan then never meets an encoding failure at execute.
bool pool_map_encodes(const kv::CacheConfig& cc) {
  if (tensor_map_encoder() == nullptr) return false;
  CUtensorMap map;
  return try_encode_pool_map(&map, cc, reinterpret_cast<const void*>(uintptr_t(1) << 20)) ==
         CUDA_SUCCESS;
}

void encode_pool_map(CUtensorMap* map, const kv::CacheConfig& cc, const void* pool) {
  const CUresult r = try_encode_pool_map(map, cc, pool);
  if (r != CUDA_SUCCESS)
    fail(ATTN_STATUS_INTERNAL_ERROR, "decode: cuTensorMapEncodeTiled failed (CUresult ", int(r),
         ") for the KV pool at ", pool);
}

}  // namespace

void* kv_pool_alloc(int32_t device, size_t bytes) {
  DeviceScope scope(device);
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    fail(ATTN_STATUS_OUT_OF_MEMORY, "KV cache: cudaMalloc of ", bytes, " bytes on device ",
         device, " failed");
  }
  check(e, "cudaMalloc (KV cache pages)");
  return p;
}

void kv_pool_free(int32_t device, void* p) noexcept {
  if (p == nullptr) return;
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) return;
  if (prev != device) (void)cudaSetDevice(device);
  (void)cudaFree(p);
  if (prev != device) (void)cudaSetDevice(prev);
}

void kv_append_enqueue(int32_t device, const kv::CacheConfig& cfg, void* k_base, void* v_base,
                       const std::vector<std::pair<int32_t, int32_t>>& page_copies,
                       const std::vector<KvCopyRun>& runs, const void* k, const void* v,
                       void* stream) {
  DeviceScope scope(device);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const size_t es = dtype_size(cfg.dtype);
  const size_t kpb = size_t(cfg.k_page_elems()) * es, vpb = size_t(cfg.v_page_elems()) * es;
  char* kb = static_cast<char*>(k_base);
  char* vb = static_cast<char*>(v_base);
  for (const auto& [from, to] : page_copies) {
    check(cudaMemcpyAsync(kb + size_t(to) * kpb, kb + size_t(from) * kpb, kpb,
                          cudaMemcpyDeviceToDevice, s),
          "cudaMemcpyAsync (copy-on-write K page)");
    check(cudaMemcpyAsync(vb + size_t(to) * vpb, vb + size_t(from) * vpb, vpb,
                          cudaMemcpyDeviceToDevice, s),
          "cudaMemcpyAsync (copy-on-write V page)");
  }
  if (runs.empty()) return;
  decode::AppendParams p;
  std::memset(&p, 0, sizeof p);
  p.k_src = static_cast<const unsigned char*>(k);
  p.v_src = static_cast<const unsigned char*>(v);
  p.k_pool = reinterpret_cast<unsigned char*>(kb);
  p.v_pool = reinterpret_cast<unsigned char*>(vb);
  p.k_page_bytes = int64_t(kpb);
  p.v_page_bytes = int64_t(vpb);
  p.k_row_bytes = cfg.head_dim_qk * int64_t(es);
  p.v_row_bytes = cfg.head_dim_v * int64_t(es);
  p.k_head_stride = cfg.slot_offset(0, 1, cfg.head_dim_qk) * int64_t(es);
  p.k_slot_stride = cfg.slot_offset(1, 0, cfg.head_dim_qk) * int64_t(es);
  p.v_head_stride = cfg.slot_offset(0, 1, cfg.head_dim_v) * int64_t(es);
  p.v_slot_stride = cfg.slot_offset(1, 0, cfg.head_dim_v) * int64_t(es);
  p.heads_kv = int32_t(cfg.heads_kv);
  // 16-byte units when every row and base allows it.
  const bool wide = p.k_row_bytes % 16 == 0 && p.v_row_bytes % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(k) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(v) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(kb) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(vb) % 16 == 0;
  for (size_t first = 0; first < runs.size(); first += decode::kAppendRunsPerLaunch) {
    const size_t count = std::min<size_t>(decode::kAppendRunsPerLaunch, runs.size() - first);
    p.num_runs = int32_t(count);
    for (size_t i = 0; i < count; ++i) {
      const KvCopyRun& r = runs[first + i];
      p.runs[i] = decode::AppendRun{r.src_token, r.page, r.slot, r.count, 0};
    }
    check(kv_append_launch(p, wide, s), "KV append kernel launch");
  }
}

int decode_pipeline_stages() {
  const char* env = std::getenv("ATTN_CUDA_DECODE_STAGES");
  if (env == nullptr || env[0] == '\0') return 2;
  if (std::strcmp(env, "2") == 0) return 2;
  if (std::strcmp(env, "3") == 0) return 3;
  invalid_argument("ATTN_CUDA_DECODE_STAGES must be 2 or 3, got \"", env, "\"");
}

int32_t decode_kernel_requested() {
  const char* env = std::getenv("ATTN_CUDA_DECODE_KERNEL");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) return kDecodeKernelAuto;
  if (std::strcmp(env, "sm80") == 0) return kDecodeKernelSm80;
  if (std::strcmp(env, "sm90-bulk") == 0) return kDecodeKernelSm90Bulk;
  if (std::strcmp(env, "sm90-bulk32") == 0) return kDecodeKernelSm90Bulk32;
  if (std::strcmp(env, "sm90-tensor") == 0) return kDecodeKernelSm90Tensor;
  invalid_argument("ATTN_CUDA_DECODE_KERNEL must be auto, sm80, sm90-bulk, sm90-bulk32 or sm90-tensor, got \"",
                   env, "\"");
}

bool decode_split_balanced() {
  const char* env = std::getenv("ATTN_CUDA_DECODE_SPLIT");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) return false;
  if (std::strcmp(env, "waves") == 0) return false;
  if (std::strcmp(env, "balanced") == 0) return true;
  invalid_argument("ATTN_CUDA_DECODE_SPLIT must be auto, waves or balanced, got \"", env, "\"");
}

bool decode_pdl_requested() {
  // On by default: the combine's launch overlapping the decode kernel's
  // last blocks was as fast or faster in every case measured on an H200
  // (bench_decode.py --variants; 1 x 128K: 3.52 TB/s against 3.40).
  return env_flag("ATTN_CUDA_DECODE_PDL", true);
}

bool decode_use_pdl(int32_t device, bool requested, const kv::CacheConfig& cache) {
  if (!requested) return false;
  DeviceScope scope(device);
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute");
  if (major < 9) return false;
  // Launched as a dependent, the combine may start before the decode grid
  // has finished; only its griddepcontrol.wait (compiled for sm_90 and up)
  // holds it until the partial states are written.
  int arch = 0;
  check(decode_combine_virtual_arch(cache.dtype == ATTN_DTYPE_BF16, int(cache.head_dim_qk), &arch),
        "cudaFuncGetAttributes (decode combine)");
  return arch >= 90;
}

int32_t decode_check_supported(int32_t device, const kv::CacheConfig& cache, int64_t heads_q,
                               int64_t max_query_tokens, int stages, int32_t requested,
                               bool balanced) {
  if (cache.dtype != ATTN_DTYPE_FP16 && cache.dtype != ATTN_DTYPE_BF16)
    not_supported("decode plan: the CUDA decode kernel runs fp16 and bf16 caches only, not ",
                  dtype_name(cache.dtype));
  if (cache.head_dim_qk != cache.head_dim_v)
    not_supported("decode plan: the CUDA decode kernel needs head_dim_qk == head_dim_v, got ",
                  cache.head_dim_qk, " and ", cache.head_dim_v);
  if (cache.head_dim_qk != 64 && cache.head_dim_qk != 128)
    not_supported("decode plan: the CUDA decode kernel has head_dim 64 and 128, not ",
                  cache.head_dim_qk);
  check_kv_page_size(cache.page_size);  // DecodeParams::page_size is an int32
  const int64_t rows = max_query_tokens * (heads_q / cache.heads_kv);
  if (rows > 16 * 64)
    not_supported("decode plan: max_query_tokens * (heads_q / heads_kv) = ", rows,
                  " rows per KV head; the CUDA decode kernel takes at most 1024");
  DeviceScope scope(device);
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute");
  if (major < 8)
    not_supported("decode plan: device ", device, " is older than sm_80 (mma.sync, cp.async)");
  const cudaError_t e = decode_kernels_available(DecodeKernel::kSm80CpAsync, nullptr);
  if (e == cudaErrorInvalidDeviceFunction || e == cudaErrorNoKernelImageForDevice) {
    (void)cudaGetLastError();
    not_supported("decode plan: this build has no decode kernel for device ", device,
                  "; rebuild with -Dgpu_archs including its architecture");
  }
  check(e, "cudaFuncGetAttributes (decode)");
  // The default, for pages of a multiple of 8 tokens, where 8-row segments
  // move in one copy: head-major (HND) pages on the bulk-copy kernel,
  // token-major (NHD) ones on the tensor-copy kernel (the bulk kernel copies
  // their rows one by one when the pool holds several KV heads); else the
  // cp.async kernel. On an H200 (bench_decode.py --variants, bf16 d 128,
  // bench/results/decode-variants-2026-12-01-ecc8647.md): HND 32 x 8K bulk
  // 4.21 TB/s, tensor 4.14, cp.async 3.83; 4 x 64K 4.03, 4.09, 3.89;
  // 1 x 128K 3.82, 3.79, 3.65; NHD 32 x 8K bulk 2.50, tensor 4.15, cp.async
  // 3.84. At head dim 128 the HND default is the bulk kernel with 32-byte
  // aligned segments and two blocks per SM (sm90-bulk32; 2026-12-02 at
  // 68388d8, bench/results/decode-variants-2026-12-02-68388d8.md): 32 x 8K
  // 4.34 TB/s against 4.22, 4 x 64K 4.30 against 4.03, 1 x 128K 3.91 against
  // 3.83 (cuDNN 4.53, 4.46, 4.21); head dim 64 was not measured and keeps
  // the bulk kernel, and so do devices other than sm_90 (bulk32's shared
  // memory request keeps two blocks on an SM of 228 KiB; elsewhere it may
  // keep one).
  if (requested == kDecodeKernelAuto)
    requested = cache.page_size % 8 != 0                 ? kDecodeKernelSm80
                : cache.layout != ATTN_KV_LAYOUT_HND     ? kDecodeKernelSm90Tensor
                : cache.head_dim_qk == 128 && major == 9 ? kDecodeKernelSm90Bulk32
                                                         : kDecodeKernelSm90Bulk;
  // The tensor copies move 8-slot segments of one page through a tensor map
  // of the pool: for other page sizes, or where the driver has no encoder
  // or the pool's dims do not encode, a request for them takes the
  // bulk-copy kernel (describe() names the kernel that runs).
  if (requested == kDecodeKernelSm90Tensor && major >= 9 &&
      (cache.page_size % 8 != 0 || !pool_map_encodes(cache)))
    requested = kDecodeKernelSm90Bulk;
  // The sm_90 kernels only where code compiled for sm_90 or later runs (not
  // sm_80 PTX compiled by the driver); else the cp.async kernel.
  int32_t kernel = kDecodeKernelSm80;
  if ((requested == kDecodeKernelSm90Bulk || requested == kDecodeKernelSm90Bulk32 ||
       requested == kDecodeKernelSm90Tensor) &&
      major >= 9) {
    int arch = 0;
    if (decode_kernels_available(DecodeKernel(requested), &arch) == cudaSuccess && arch >= 90)
      kernel = requested;
    else
      (void)cudaGetLastError();
  }
  // At plan creation rather than in execute, which may be under capture.
  check(decode_kernels_allow_smem(cache.dtype == ATTN_DTYPE_BF16, int(cache.head_dim_qk), stages,
                                  DecodeKernel(kernel), balanced),
        "cudaFuncSetAttribute (decode)");
  return kernel;
}

int64_t decode_resident_blocks(int32_t device, const kv::CacheConfig& cache, int stages,
                               int32_t kernel, bool balanced) {
  DeviceScope scope(device);
  int sms = 0, per_sm = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  check(decode_kernels_blocks_per_sm(cache.dtype == ATTN_DTYPE_BF16, int(cache.head_dim_qk),
                                     stages, DecodeKernel(kernel), balanced, &per_sm),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor (decode)");
  return int64_t(std::max(sms, 1)) * std::max(per_sm, 1);
}

DecodeStaging::DecodeStaging(int32_t device, size_t bytes) : device_(device), bytes_(bytes) {
  DeviceScope scope(device);
  void* h = nullptr;
  const cudaError_t e = cudaMallocHost(&h, std::max<size_t>(bytes, 1));
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    fail(ATTN_STATUS_OUT_OF_MEMORY, "decode plan: cudaMallocHost of ", bytes,
         " bytes (the prepare staging area) failed");
  }
  check(e, "cudaMallocHost (decode staging)");
  host_ = static_cast<char*>(h);
  cudaEvent_t ev = nullptr;
  const cudaError_t e2 = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e2 != cudaSuccess) {
    (void)cudaFreeHost(host_);
    check(e2, "cudaEventCreate (decode staging)");
  }
  event_ = ev;
}

DecodeStaging::~DecodeStaging() {
  if (event_ != nullptr) {
    (void)cudaEventSynchronize(static_cast<cudaEvent_t>(event_));
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  }
  if (host_ != nullptr) (void)cudaFreeHost(host_);
}

char* DecodeStaging::acquire() {
  if (pending_) {
    check(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)),
          "cudaEventSynchronize (the previous prepare's upload)");
    pending_ = false;
  }
  return host_;
}

void DecodeStaging::upload(void* device_base, const std::vector<std::pair<size_t, size_t>>& pieces,
                           void* stream) {
  DeviceScope scope(device_);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  char* dst = static_cast<char*>(device_base);
  for (const auto& [off, n] : pieces) {
    if (n == 0) continue;
    check(cudaMemcpyAsync(dst + off, host_ + off, n, cudaMemcpyHostToDevice, s),
          "cudaMemcpyAsync (decode metadata)");
  }
  check(cudaEventRecord(static_cast<cudaEvent_t>(event_), s), "cudaEventRecord (decode staging)");
  pending_ = true;
}

bool stream_is_capturing(int32_t device, void* stream) {
  DeviceScope scope(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status),
        "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

void decode_launch(const kv::DecodePlan& plan, const kv::KvCache& cache,
                   const kv::DecodeWorkspace& ws, int64_t blocks, const void* q, void* o,
                   float* lse, bool may_split, void* stream) {
  const kv::CacheConfig& cc = plan.cache_config();
  const kv::DecodeConfig& cfg = plan.config();
  DeviceScope scope(plan.device());
  decode::DecodeParams p;
  std::memset(&p, 0, sizeof p);
  p.q = q;
  p.o = o;
  p.lse = lse;
  p.k_pool = cache.k_page(0);
  p.v_pool = cache.v_page(0);
  p.page_elems = cc.k_page_elems();
  p.head_stride = cc.slot_offset(0, 1, cc.head_dim_qk);
  p.slot_stride = cc.slot_offset(1, 0, cc.head_dim_qk);
  p.header = reinterpret_cast<const decode::Header*>(ws.header);
  p.seqs = reinterpret_cast<const decode::SeqMeta*>(ws.seqs);
  p.entries = reinterpret_cast<const decode::PageEntry*>(ws.entries);
  p.units = reinterpret_cast<const decode::WorkUnit*>(ws.units);
  p.block_units = ws.block_units;
  p.partial_o = ws.partial_o;
  p.partial_lse = ws.partial_lse;
  p.page_size = int32_t(cc.page_size);
  p.heads_q = int32_t(cfg.heads_q);
  p.group = int32_t(plan.group());
  p.max_q = int32_t(cfg.max_query_tokens);
  p.heads_kv = int32_t(cc.heads_kv);
  p.window = cc.window;
  p.sinks = cc.sink_tokens;
  p.scale = cfg.scale;
  p.softcap = cfg.softcap;
  if (plan.device_kernel() == kDecodeKernelSm90Tensor) {
    encode_pool_map(&p.k_map, cc, p.k_pool);
    encode_pool_map(&p.v_map, cc, p.v_pool);
  }
  const int row_tiles = int((cfg.max_query_tokens * plan.group() + 15) / 16);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  check(decode_kernels_launch(p, cc.dtype == ATTN_DTYPE_BF16, int(cc.head_dim_qk),
                              plan.device_stages(), DecodeKernel(plan.device_kernel()),
                              plan.device_balanced(), blocks, int(cc.heads_kv), row_tiles,
                              may_split, plan.device_pdl(), cfg.max_batch, s),
        "decode kernel launch");
}

}  // namespace attn::cuda
