// CUDA backend, host side: validates what the kernels support, fills their
// parameters once at plan creation and launches them on the caller's stream.
// Execution allocates nothing and never synchronises, so it can be captured
// in a CUDA graph.
//
// Backward workspace: D = rowsum(dO * O) and LSE in base 2 (fp32, LSE's
// layout), then, unless the plan is deterministic, the fp32 dQ accumulator
// [token][heads_q][D], and, when the group is split (group_splits_ > 1),
// the fp32 dK and dV accumulators [token][heads_kv][D] each; a block-sparse
// plan whose dK/dV lists are cut (kv_lists_split_) and whose group is whole
// has them for the cut KV tiles only, [batch][heads_kv][max_cut][block_n][D]
// each (compact_kv_accum()): zeroing, adding and converting the whole
// tensors for a few cut tiles (BigBird's global keys) cost more than the
// dK/dV kernel's visits.
//
// Block-sparse plans run the same kernels' Sparse instantiations, which walk
// tile lists (cuda/block_sparse.hpp) instead of the dense intervals: one set
// per kernel tile shape (forward; dK/dV, KV-major; the deterministic dQ),
// uploaded into one device allocation at plan creation and freed with the
// plan. Tuning hooks, read at plan creation (CudaHooks: a malformed value
// is an invalid argument), so that one run can time both sides:
// ATTN_CUDA_BSPARSE_FWD_PERSIST=1, the persistent forward (blocks
// that stay resident and loop over query tiles dealt at plan creation,
// "-bsparse-p" in the kernel name); ATTN_CUDA_BSPARSE_BWD_PERSIST=1, the
// persistent dK/dV kernel (likewise, work items dealt at plan creation,
// "+bwd-p"); ATTN_CUDA_BSPARSE_PREFETCH=1, L2 prefetches of later dK/dV
// blocks' K and V; ATTN_CUDA_BSPARSE_ITEM=n, dK/dV work items of at most n
// visits (split_kv_lists); ATTN_CUDA_BWD_SM90_SPARSE=0, the sm_80 dK/dV
// kernel where sm_90 devices otherwise run the sm_90a (wgmma) one's Sparse
// instantiation at d = 64 and 128 ("+bwd-wgmma-bs"; faster on an H200 at
// L = 32K, d = 128, causal: window + sinks 9.44 -> 7.19 ms, random 4.35 ->
// 3.39, BigBird 2.12 -> 1.61).
//
// MoBA plans run the kernels' Moba instantiations after the selector
// (cuda/moba_select.hpp), which writes the run-time schedule into the
// workspace of each pass, behind what the pass needs otherwise
// (cuda/moba_plan.hpp); the backward pass selects again, with the same
// launches, and so sees the forward's selection bit for bit.
// By default the kernels walk, per block, the rows that selected it
// (gathered lists): the forward one launch per round (each row's own
// block, then its next selected block down, ...: moba/moba_params.cuh)
// merging into per-row softmax states, the dK/dV kernel per KV tile;
// "-moba-gather" in the kernel name. On sm_90 devices, plans at d = 64 and
// 128 without softcap run both on the sm_90a (wgmma) kernels' Moba gather
// instantiations (pick_sm90_forward, pick_sm90_backward), unless
// ATTN_CUDA_MOBA_GATHER_SM90=0 / ATTN_CUDA_MOBA_GATHER_BWD_SM90=0 (or
// the passes' general hooks: ATTN_CUDA_FWD_SM90=0, ATTN_CUDA_BWD_SM90=0,
// ATTN_CUDA_BWD_VARIANT) keep the sm_80 one of that pass. ATTN_CUDA_MOBA_GATHER=0 (a test and
// tuning hook) takes the tile-union schedule instead: the query tiles in
// which some row selected the block ("-moba"), which is also the path of
// plans whose row lists would not fit 32-bit offsets. With
// ATTN_CUDA_MOBA_SM90=1, MoBA plans at d = 64 and 128 without softcap on
// sm_90 devices run the sm_90a (wgmma) kernels' Moba instantiations on that
// tile-union schedule instead ("cuda-sm90-wgmma-...-moba", "+bwd-wgmma-...";
// moba_fits_sm90). Not the default: the tile union costs what the rows of a
// tile select together, nearly every past block when they disagree, so on
// an H200 (d = 128) its forward ran 1.1-1.6x faster than the gathered sm_80
// kernels' on queries that agree over 256-token runs (forward and backward
// together 1.02-1.23x), but on independent ones forward and backward took
// up to 7.8x as long (L = 128K; bench/results/cuda-moba-sm90-*2026-12-01-
// c37f71b.md). Nor where MoBA keeps most of the causal pairs: with
// independent queries the union cost 1.3x the dense plan there, no less
// than the gathered kernels (32K, block 4096, top 3: 46.4 against 47.5 ms;
// 128K, block 4096, top 12: 682 against 613; bench/results/cuda-moba-*
// 2026-12-01-cd51e18.md).
#include "cuda/cuda_backend.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "core/checked.hpp"
#include "core/dtype.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "cuda/block_sparse.hpp"
#include "cuda/bsparse_fwd.hpp"
#include "cuda/kernel_name.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/limits.hpp"
#include "cuda/flash_bwd.hpp"
#include "cuda/flash_bwd_sm90.hpp"
#include "cuda/flash_fwd.hpp"
#include "cuda/fwd_sm90_shape.hpp"
#include "cuda/moba_kernels.hpp"
#include "cuda/moba_plan.hpp"
#include "cuda/moba_select.hpp"
#include "plan/plan.hpp"

namespace attn::cuda {
namespace {

FwdKernel pick_kernel(int64_t d, bool bf16, bool sparse, bool moba, bool moba_gather) {
  if (moba_gather) switch (d) {
      case 64: return fwd_kernel_moba_gather_d64(bf16);
      case 96: return fwd_kernel_moba_gather_d96(bf16);
      case 128: return fwd_kernel_moba_gather_d128(bf16);
      default: return fwd_kernel_moba_gather_d256(bf16);
    }
  if (moba) switch (d) {
      case 64: return fwd_kernel_moba_d64(bf16);
      case 96: return fwd_kernel_moba_d96(bf16);
      case 128: return fwd_kernel_moba_d128(bf16);
      default: return fwd_kernel_moba_d256(bf16);
    }
  switch (d) {
    case 64: return fwd_kernel_d64(bf16, sparse);
    case 96: return fwd_kernel_d96(bf16, sparse);
    case 128: return fwd_kernel_d128(bf16, sparse);
    default: return fwd_kernel_d256(bf16, sparse);
  }
}

BwdKernels pick_bwd_kernels(int64_t d, bool bf16, int variant, bool sparse, bool moba,
                            bool moba_gather) {
  if (moba) switch (d) {
      case 64: return bwd_kernels_moba_d64(bf16, variant, moba_gather);
      case 96: return bwd_kernels_moba_d96(bf16, variant, moba_gather);
      case 128: return bwd_kernels_moba_d128(bf16, variant, moba_gather);
      default: return bwd_kernels_moba_d256(bf16, variant, moba_gather);
    }
  switch (d) {
    case 64: return bwd_kernels_d64(bf16, variant, sparse);
    case 96: return bwd_kernels_d96(bf16, variant, sparse);
    case 128: return bwd_kernels_d128(bf16, variant, sparse);
    default: return bwd_kernels_d256(bf16, variant, sparse);
  }
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr size_t kWorkspaceAlign = 256;

// Query heads whose rows start together in the block-sparse dK/dV kernels
// (TileLists::head_group). H100, L = 32K, d = 128, 16 heads, masks shared
// by the heads, against one group of all: random blocks 3.40 ms against
// 4.19, at 8K 0.355 against 0.390 (H200, 32K: 3.27 against 3.34). Lists
// that are local (lists_are_local) keep one group: window + sinks took
// 7.20 ms in groups of 4 against 7.15, 8.44 in groups of 1
// (bench/results/cuda-bsparse-order-2026-12-05-ea0af18.md).
constexpr int kSparseBwdGroupHeads = 4;

// Saturating, as the workspace sizes are (a MoBA selection can pass 2^64
// bytes; create_plan then refuses the plan).
size_t align_up(size_t x) { return size_t(sat_align_up(x, kWorkspaceAlign)); }

// The backend's tuning and test hooks, read from the environment once, at
// the start of plan creation (before anything is allocated), so that a
// malformed value fails every plan with INVALID_ARGUMENT naming the
// variable and the value (core/env.hpp), whichever kernels the plan runs.
struct CudaHooks {
  bool moba_gather;               // ATTN_CUDA_MOBA_GATHER (default 1)
  bool moba_sm90;                 // ATTN_CUDA_MOBA_SM90 (default 0)
  bool moba_gather_sm90;          // ATTN_CUDA_MOBA_GATHER_SM90 (default 1)
  bool moba_gather_bwd_sm90;      // ATTN_CUDA_MOBA_GATHER_BWD_SM90 (default 1)
  bool moba_gather_ws;            // ATTN_CUDA_MOBA_GATHER_WS (default 1)
  bool fwd_persist;               // ATTN_CUDA_BSPARSE_FWD_PERSIST (default 0)
  bool bwd_persist;               // ATTN_CUDA_BSPARSE_BWD_PERSIST (default 0)
  bool prefetch;                  // ATTN_CUDA_BSPARSE_PREFETCH (default 0)
  std::optional<int> bwd_heads;   // ATTN_CUDA_BSPARSE_BWD_HEADS: TileLists::head_group
  std::optional<int> item;        // ATTN_CUDA_BSPARSE_ITEM: visits per dK/dV work item
  bool fwd_sm90;                  // ATTN_CUDA_FWD_SM90 (default 1)
  bool fwd_sm90_ws;               // ATTN_CUDA_FWD_SM90_WS (default 1)
  std::optional<int> fwd_sm90_ws_order;  // ATTN_CUDA_FWD_SM90_WS_ORDER: 0 or 1
  std::optional<int> fwd_sm90_ws_heads;  // ATTN_CUDA_FWD_SM90_WS_HEADS: pairs per group
  std::optional<int> fwd_sm90_bm; // ATTN_CUDA_FWD_SM90_BM: 128 or 192
  bool bwd_sm90;                  // ATTN_CUDA_BWD_SM90 (default 1)
  bool bwd_sm90_sparse;           // ATTN_CUDA_BWD_SM90_SPARSE (default 1)
  std::optional<int> bwd_variant; // ATTN_CUDA_BWD_VARIANT: first sm_80 variant tried
  std::optional<int> group_split; // ATTN_CUDA_BWD_GROUP_SPLIT: dK/dV blocks per group

  static CudaHooks from_env() {
    CudaHooks h;
    h.moba_gather = env_flag("ATTN_CUDA_MOBA_GATHER", true);
    h.moba_sm90 = env_flag("ATTN_CUDA_MOBA_SM90", false);
    h.moba_gather_sm90 = env_flag("ATTN_CUDA_MOBA_GATHER_SM90", true);
    h.moba_gather_bwd_sm90 = env_flag("ATTN_CUDA_MOBA_GATHER_BWD_SM90", true);
    h.moba_gather_ws = env_flag("ATTN_CUDA_MOBA_GATHER_WS", true);
    h.fwd_persist = env_flag("ATTN_CUDA_BSPARSE_FWD_PERSIST", false);
    h.bwd_persist = env_flag("ATTN_CUDA_BSPARSE_BWD_PERSIST", false);
    h.prefetch = env_flag("ATTN_CUDA_BSPARSE_PREFETCH", false);
    h.bwd_heads = env_int("ATTN_CUDA_BSPARSE_BWD_HEADS", 1, std::numeric_limits<int>::max());
    h.item = env_int("ATTN_CUDA_BSPARSE_ITEM", 1, std::numeric_limits<int>::max());
    h.fwd_sm90 = env_flag("ATTN_CUDA_FWD_SM90", true);
    h.fwd_sm90_ws = env_flag("ATTN_CUDA_FWD_SM90_WS", true);
    h.fwd_sm90_ws_order = env_int_choice("ATTN_CUDA_FWD_SM90_WS_ORDER", {0, 1});
    h.fwd_sm90_ws_heads =
        env_int("ATTN_CUDA_FWD_SM90_WS_HEADS", 1, std::numeric_limits<int>::max());
    h.fwd_sm90_bm = env_int_choice("ATTN_CUDA_FWD_SM90_BM", {128, 192});
    h.bwd_sm90 = env_flag("ATTN_CUDA_BWD_SM90", true);
    h.bwd_sm90_sparse = env_flag("ATTN_CUDA_BWD_SM90_SPARSE", true);
    // Past the last variant: the last (the search starts there).
    h.bwd_variant = env_int("ATTN_CUDA_BWD_VARIANT", 0, std::numeric_limits<int>::max());
    // Past the group: the whole group (rounded down to a divisor).
    h.group_split = env_int("ATTN_CUDA_BWD_GROUP_SPLIT", 1, std::numeric_limits<int>::max());
    return h;
  }
};

class CudaPlan final : public BackendPlan {
 public:
  CudaPlan(const Problem& p, const ContextConfig& ctx) : problem_(p), device_(ctx.device) {
    validate(p);
    hooks_ = CudaHooks::from_env();
    const int64_t d = p.head_dim_qk;
    const bool bf16 = p.dtype == ATTN_DTYPE_BF16;
    const bool sparse = p.block_mask != nullptr;
    const bool moba = p.moba_block > 0;

    DeviceScope scope(device_);
    int major = 0, minor = 0, smem_optin = 0, sm_count = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_),
          "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_),
          "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_),
          "cudaDeviceGetAttribute");
    if (major < 8)
      not_supported("backend CUDA: device ", device_, " is sm_", major, minor,
                    "; the attention kernels need sm_80 or newer (mma.sync, cp.async)");
    // MoBA on sm_90a takes the tile-union schedule in both passes (the
    // wgmma kernels walk its lists); elsewhere the gathered one by default.
    moba_sm90_ = moba && moba_fits_sm90(p, major, minor, size_t(smem_optin));
    const bool gather = moba && !moba_sm90_ && hooks_.moba_gather && moba_rows_fit(p);
    cfg_ = flash::fwd_config(int(d));
    kernel_ = pick_kernel(d, bf16, sparse, moba, gather);
    // ATTN_CUDA_BSPARSE_FWD_PERSIST=1 (a tuning hook): the persistent
    // block-sparse forward (flash_fwd_bsparse_persistent_kernel).
    fwd_persist_ = sparse && hooks_.fwd_persist;
    if (fwd_persist_) kernel_ = fwd_kernel_bsparse_persistent(int(d), bf16);
    auto require_image = [&](const void* func) {
      cudaFuncAttributes attrs{};
      const cudaError_t fe = cudaFuncGetAttributes(&attrs, func);
      if (fe == cudaErrorNoKernelImageForDevice || fe == cudaErrorInvalidDeviceFunction ||
          fe == cudaErrorUnsupportedPtxVersion) {
        (void)cudaGetLastError();
        not_supported("backend CUDA: this build of libattn has no kernel image for device ",
                      device_, " (sm_", major, minor, "); rebuild with -Dgpu_archs including sm_",
                      major, minor);
      }
      check(fe, "cudaFuncGetAttributes");
    };
    auto require_smem = [&](size_t smem, const char* pass) {
      if (size_t(smem_optin) < smem)
        not_supported("backend CUDA: head_dim ", d, " needs ", smem, " bytes of shared memory per ",
                      "block for the ", pass, " pass; device ", device_, " allows ", smem_optin);
    };
    pick_sm90_forward(p, major, minor, size_t(smem_optin), gather);
    require_image(kernel_.func);
    require_smem(sm90_ ? sm90_cfg_.smem_bytes(int(d)) : cfg_.smem_bytes(int(d)), "forward");
    check(kernel_.prepare(), "cudaFuncSetAttribute");
    if (p.backward) {
      // The first variant whose shared memory and instructions the device
      // has (the last one otherwise, which then fails the check below with
      // NOT_SUPPORTED).
      // ATTN_CUDA_BWD_VARIANT=n starts the search at variant n instead, so
      // that the fallbacks of small devices can be tested on large ones.
      int variant = 0;
      if (hooks_.bwd_variant)
        variant = std::min(*hooks_.bwd_variant, flash::bwd_variants(int(d)) - 1);
      // A configuration past sm_80 also needs its kernel compiled for that
      // architecture: a build whose image for the device is PTX of an older
      // one (gpu_archs without the device's, JIT-compiled on load) has the
      // sm_90 instructions trap (flash/sm80.cuh), whatever the device.
      auto fits = [&](int v) {
        const flash::BwdConfig c = flash::bwd_config(int(d), v);
        if (size_t(smem_optin) < c.smem_bytes(int(d)) || major < c.min_sm_major()) return false;
        if (c.min_sm_major() <= 8) return true;
        cudaFuncAttributes attrs{};
        const cudaError_t fe =
            cudaFuncGetAttributes(&attrs, pick_bwd_kernels(d, bf16, v, sparse, moba, gather)
                                              .dkdv_func);
        if (fe != cudaSuccess) {
          (void)cudaGetLastError();  // no image: the next variant (require_image reports it)
          return false;
        }
        return attrs.ptxVersion >= 10 * c.min_sm_major();
      };
      while (variant + 1 < flash::bwd_variants(int(d)) && !fits(variant)) ++variant;
      bwd_ = pick_bwd_kernels(d, bf16, variant, sparse, moba, gather);
      // ATTN_CUDA_BSPARSE_BWD_PERSIST=1 (a tuning hook): the persistent
      // block-sparse dK/dV kernel (upload_tile_lists deals its work).
      bwd_persist_ = sparse && hooks_.bwd_persist;
      bwd_cfg_ = flash::bwd_config(int(d), variant);
      require_image(bwd_.dkdv_func);
      require_smem(bwd_cfg_.smem_bytes(int(d)), "backward");
      require_smem(flash::dq_config(int(d)).smem_bytes(int(d)), "backward");
      check(bwd_.prepare(), "cudaFuncSetAttribute");
      pick_sm90_backward(p, major, minor, size_t(smem_optin), gather);
    }
    if (moba) {
      require_smem(moba::select_smem_bytes(int(d)), "MoBA selection");
      check(moba_select_prepare(int(d)), "cudaFuncSetAttribute");
      // The q lists in 128-row tiles (every forward's and the dQ kernel's,
      // flash::kSm90MobaBlockM); the kv lists in the dK/dV kernel's.
      const int kv_tile_rows =
          !p.backward ? 0 : bwd_sm90_ ? bwd_sm90_cfg_.block_m : bwd_cfg_.block_m;
      moba_.emplace(p, tile_q(), kv_tile_rows, gather);
    }

    fill_params();
    fill_bwd_params();
    if (p.backward) {
      check(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device_),
            "cudaDeviceGetAttribute");
      group_splits_ = pick_group_splits(sm_count);
      bwd_params_.group_splits = group_splits_;
      sm_count_ = sm_count;
    }
    m_blocks_ = int((p.seqlen_q + tile_q() - 1) / tile_q());

    // Device copies of the varlen offsets and of the diagonal shifts, in
    // one allocation: [cu_q, cu_kv] (batch + 1 each), then [shift] (batch).
    const bool shifted = std::any_of(p.diagonal_shift.begin(), p.diagonal_shift.end(),
                                     [](int64_t s) { return s != 0; });
    if (p.varlen || shifted) {
      const size_t n = p.varlen ? size_t(p.batch) + 1 : 0;
      std::vector<int32_t> host(2 * n);
      for (size_t i = 0; i < n; ++i) {
        host[i] = int32_t(p.cu_q[i]);
        host[n + i] = int32_t(p.cu_kv[i]);
      }
      if (shifted)
        for (int64_t b = 0; b < p.batch; ++b)  // int32 by check_plan_limits
          host.push_back(int32_t(p.shift(b)));
      void* dev = nullptr;
      const cudaError_t ae = cudaMalloc(&dev, host.size() * sizeof(int32_t));
      if (ae == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        fail(ATTN_STATUS_OUT_OF_MEMORY, "backend CUDA: no device memory for ",
             host.size() * sizeof(int32_t), " bytes of varlen offsets");
      }
      check(ae, "cudaMalloc");
      cu_dev_ = static_cast<int32_t*>(dev);  // owned from here: the destructor frees it
      try {
        check(cudaMemcpy(cu_dev_, host.data(), host.size() * sizeof(int32_t),
                         cudaMemcpyHostToDevice),
              "cudaMemcpy");
      } catch (...) {
        (void)cudaFree(cu_dev_);
        throw;
      }
      if (p.varlen) {
        params_.cu_q = bwd_params_.cu_q = cu_dev_;
        params_.cu_kv = bwd_params_.cu_kv = cu_dev_ + n;
      }
      if (shifted) params_.diag_shift = bwd_params_.diag_shift = cu_dev_ + 2 * n;
    }

    if (fwd_persist_) {
      // As many blocks as are resident at once (each loops over its items).
      int per_sm = 0;
      check(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device_),
            "cudaDeviceGetAttribute");
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_.func, cfg_.threads(),
                                                          cfg_.smem_bytes(int(d))),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
      const int64_t items = p.batch * p.heads_q * ((p.seqlen_q + cfg_.block_m - 1) / cfg_.block_m);
      fwd_grid_ = int(std::clamp<int64_t>(int64_t(std::max(per_sm, 1)) * sm_count, 1,
                                          std::max<int64_t>(items, 1)));
    }
    if (sparse) upload_tile_lists();

    // The forward's kernel, then the backward's variant: "-atomic" adds dQ
    // with fp32 atomics, "-bulk" with bulk reductions from shared memory
    // (sm_90), "-det" computes it in a separate pass without them.
    // Block-sparse and MoBA plans say "-bsparse" or "-moba..." and leave out
    // warps and stages (on sm_90a also the tile, which info.tile_q and
    // tile_kv give), so that the name fits attn_plan_info_t's 64
    // characters; block-sparse ones also "sm80" (the same kernel family),
    // for room for their markers: "-p" after "bsparse" and after "+bwd" (the
    // persistent kernels) and "-cut" (below); their sm_90a dK/dV kernel says
    // "+bwd-wgmma-bs". Where a name would still not fit (extreme group
    // splits, MoBA gather names), cuda/kernel_name.hpp shortens fixed parts
    // so that "-cut" and "-gsN" are never lost.
    using F = KernelNameFacts::Forward;
    using B = KernelNameFacts::Backward;
    KernelNameFacts name;
    name.dtype = dtype_name(p.dtype);
    name.head_dim = int(d);
    name.forward = sparse && sm90_ ? F::kSparseSm90
                   : moba && sm90_ ? F::kMobaSm90
                   : moba          ? F::kMoba
                   : sparse        ? F::kSparseSm80
                   : sm90_         ? F::kSm90
                                   : F::kSm80;
    name.kind = moba ? (moba_->gathers() ? "moba-gather" : "moba")
                     : fwd_persist_ ? "bsparse-p" : "bsparse";
    name.ws = sm90_ && sm90_cfg_.producers > 0;
    name.fwd_block_m = sm90_ ? sm90_cfg_.block_m : cfg_.block_m;
    name.fwd_block_n = sm90_ ? sm90_cfg_.block_n : cfg_.block_n;
    name.fwd_warps = cfg_.warps;
    name.fwd_stages = sm90_ ? sm90_cfg_.stages : cfg_.stages;
    if (p.backward) {
      name.backward = bwd_sm90_ && sparse ? B::kSm90Sparse
                      : bwd_sm90_         ? B::kSm90
                      : sparse || moba    ? B::kSm80Listed
                                          : B::kSm80;
      name.bwd_persist = bwd_persist_;
      name.bwd_block_m = bwd_sm90_ ? bwd_sm90_cfg_.block_m : bwd_cfg_.block_m;
      name.bwd_block_n = bwd_sm90_ ? bwd_sm90_cfg_.block_n : bwd_cfg_.block_n;
      name.bwd_warps = bwd_cfg_.warps;
      name.bwd_register_path = bwd_cfg_.register_path();
      name.dq_kind = p.deterministic                            ? "det"
                     : bwd_sm90_ || (bwd_cfg_.bulk_dq && !gather) ? "bulk"
                                                                  : "atomic";
    }
    // "-cut": some dK/dV lists are cut, their tiles accumulated in fp32
    // (compact_kv_accum(); split groups accumulate every tile).
    name.cut = compact_kv_accum();
    name.group_splits = group_splits_;
    compose_kernel_name(name, kernel_name_, sizeof kernel_name_);
  }

  ~CudaPlan() override {
    if (cu_dev_ == nullptr && lists_dev_ == nullptr) return;
    int prev = 0;
    const bool switched = cudaGetDevice(&prev) == cudaSuccess && prev != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    if (cu_dev_ != nullptr) (void)cudaFree(cu_dev_);
    if (lists_dev_ != nullptr) (void)cudaFree(lists_dev_);
    if (switched) (void)cudaSetDevice(prev);
    (void)cudaGetLastError();
  }

  size_t workspace_bytes(attn_pass_t pass) const override {
    if (pass == ATTN_PASS_FORWARD) return moba_ ? moba_forward_layout().end : 0;
    if (pass != ATTN_PASS_BACKWARD || !problem_.backward) return 0;
    const size_t plain = 2 * delta_bytes() + dq_accum_bytes() + 2 * kv_accum_bytes();
    if (!moba_) return plain;
    return keep_selection() ? size_t(sat_add(bwd_plain_offset(), plain))
                            : moba_backward_layout().end;
  }

  void forward(const ForwardArgs& a) const override {
    const Problem& p = problem_;
    if (p.seqlen_q == 0 || p.total_q() == 0) return;
    require_aligned(a.q, "q");
    require_aligned(a.o, "o");
    if (p.total_kv() > 0) {
      require_aligned(a.k, "k");
      require_aligned(a.v, "v");
    }
    require_lse_aligned(a.lse);
    flash::FwdParams prm = params_;
    prm.q = a.q;
    prm.k = a.k;
    prm.v = a.v;
    prm.o = a.o;
    prm.lse = a.lse;
    DeviceScope scope(device_);
    if (moba_) {
      require_aligned(a.workspace, "workspace");
      const MobaLayout l = moba_forward_layout();
      const bool gather = moba_->gathers(), bf16 = p.dtype == ATTN_DTYPE_BF16;
      const auto stream = static_cast<cudaStream_t>(a.stream);
      char* ws = static_cast<char*>(a.workspace);
      const moba::SelectParams sp =
          moba_->select_params(a.q, a.k, ws, l, !gather, false, gather);
      check(moba_select_launch(sp, bf16, stream), "MoBA selection launch");
      prm.moba = moba_->lists(sp);
      if (gather) {
        // One launch per round, own blocks first (see flash/fwd_kernel.cuh),
        // each row's last round writing its O and LSE; then the rows that
        // see no key, in no list. A round's tiles are counted on the device
        // only: each (sequence, head) gets a thread block per tile the
        // round can have, those without one return at once.
        prm.moba.state = reinterpret_cast<float*>(ws + l.state);
        for (int32_t r = 0; r < moba_->rounds(); ++r) {
          prm.moba.fwd_round = r;
          check(kernel_.launch(prm, int(moba_->round_tiles()), int(p.heads_q), int(p.batch),
                               stream),
                "forward kernel launch");
        }
        check(moba_blind_rows_launch(moba_->blind_rows_params(a.o, a.lse), bf16, stream),
              "MoBA forward launch (rows that see no key)");
        return;
      }
    }
    const int grid_x = fwd_persist_ ? fwd_grid_ : m_blocks_;
    check(kernel_.launch(prm, grid_x, int(p.heads_q), int(p.batch),
                         static_cast<cudaStream_t>(a.stream)),
          "forward kernel launch");
  }

  void backward(const BackwardArgs& a) const override {
    const Problem& p = problem_;
    const int64_t total_q = p.total_q(), total_kv = p.total_kv();
    if (total_q == 0 && total_kv == 0) return;
    if (total_q > 0) {
      require_aligned(a.q, "q");
      require_aligned(a.o, "o");
      require_aligned(a.d_o, "d_o");
      require_aligned(a.dq, "dq");
      require_lse_aligned(a.lse);
    }
    if (total_kv > 0) {
      require_aligned(a.k, "k");
      require_aligned(a.v, "v");
      require_aligned(a.dk, "dk");
      require_aligned(a.dv, "dv");
    }
    if (workspace_bytes(ATTN_PASS_BACKWARD) > 0) require_aligned(a.workspace, "workspace");
    flash::BwdParams prm = bwd_params_;
    prm.q = a.q;
    prm.k = a.k;
    prm.v = a.v;
    prm.o = a.o;
    prm.d_o = a.d_o;
    prm.lse = a.lse;
    prm.dq = a.dq;
    prm.dk = a.dk;
    prm.dv = a.dv;
    char* const ws_moba = static_cast<char*>(a.workspace);
    // A kept selection: the MoBA regions first, as in the forward's workspace.
    char* ws = ws_moba + bwd_plain_offset();
    prm.delta = reinterpret_cast<float*>(ws);
    prm.lse2 = reinterpret_cast<float*>(ws + delta_bytes());
    prm.dq_accum = p.deterministic ? nullptr : reinterpret_cast<float*>(ws + 2 * delta_bytes());
    const size_t kv_accum = kv_accum_bytes();
    if (kv_accum > 0) {
      char* at = ws + 2 * delta_bytes() + dq_accum_bytes();
      prm.dk_accum = reinterpret_cast<float*>(at);
      prm.dv_accum = reinterpret_cast<float*>(at + kv_accum);
    }
    const int64_t rows = total_q * p.heads_q;
    const auto stream = static_cast<cudaStream_t>(a.stream);
    DeviceScope scope(device_);
    if (rows > 0) check(bwd_.preprocess(prm, rows, stream), "backward preprocess launch");
    if (moba_) {
      // The kv lists for the dK/dV kernel; the q lists for the dQ kernel.
      const MobaLayout l = moba_backward_layout();
      const moba::SelectParams sp =
          moba_->select_params(a.q, a.k, ws_moba, l, p.deterministic, true);
      check(moba_select_launch(sp, p.dtype == ATTN_DTYPE_BF16, stream, !keep_selection()),
            "MoBA selection launch");
      prm.moba = moba_->lists(sp);
    }
    if (total_kv > 0) {
      if (kv_accum > 0)
        check(cudaMemsetAsync(prm.dk_accum, 0, 2 * kv_accum, stream), "cudaMemsetAsync");
      // Block-sparse: one block per work item (tile_lists.cuh).
      const int n_blocks = p.block_mask ? kv_items_
                                        : int((p.seqlen_kv + bwd_block_n() - 1) / bwd_block_n());
      if (bwd_persist_)
        check(bwd_.dkdv_persistent(prm, bwd_grid_, 0, 0, stream), "backward dK/dV kernel launch");
      else
        check(bwd_.dkdv(prm, n_blocks, int(p.heads_kv) * group_splits_, int(p.batch), stream),
              "backward dK/dV kernel launch");
      if (kv_accum > 0)
        check(compact_kv_accum() ? bwd_.convert_dkdv_tiles(prm, kv_accum_rows(), stream)
                                 : bwd_.convert_dkdv(prm, kv_accum_rows(), stream),
              "backward dK/dV conversion launch");
    }
    if (rows == 0) return;
    if (p.deterministic) {
      const int bm = flash::dq_config(int(p.head_dim_qk)).block_m;
      const int m_blocks = int((p.seqlen_q + bm - 1) / bm);
      check(bwd_.dq(prm, m_blocks, int(p.heads_q), int(p.batch), stream),
            "backward dQ kernel launch");
    } else {
      check(bwd_.convert(prm, rows, stream), "backward dQ conversion launch");
    }
  }

  int32_t tile_q() const override { return sm90_ ? sm90_cfg_.block_m : cfg_.block_m; }
  int32_t tile_kv() const override { return sm90_ ? sm90_cfg_.block_n : cfg_.block_n; }
  int32_t num_threads() const override { return 1; }
  const char* algorithm() const override {
    return moba_ ? "flash-moba-online-softmax" : "flash-tiled-online-softmax";
  }
  const char* kernel() const override { return kernel_name_; }

 private:
  static void validate(const Problem& p) {
    if (p.dtype != ATTN_DTYPE_FP16 && p.dtype != ATTN_DTYPE_BF16)
      not_supported("backend CUDA: dtype ", dtype_name(p.dtype),
                    " is not supported by the CUDA kernels (fp16 and bf16 are)");
    if (p.head_dim_v != p.head_dim_qk)
      not_supported("backend CUDA: head_dim_v (", p.head_dim_v, ") different from head_dim_qk (",
                    p.head_dim_qk, ") is not supported");
    const int64_t d = p.head_dim_qk;
    if (d != 64 && d != 96 && d != 128 && d != 256)
      not_supported("backend CUDA: head_dim ", d, " is not supported (64, 96, 128 or 256)");
    // Grids, and what the kernels take in 32 bits (cuda/limits.hpp).
    check_plan_limits(p);
    validate_moba(p);
    const attn_tensor_role_t roles[] = {ATTN_TENSOR_Q,  ATTN_TENSOR_K,  ATTN_TENSOR_V,
                                        ATTN_TENSOR_O,  ATTN_TENSOR_DO, ATTN_TENSOR_DQ,
                                        ATTN_TENSOR_DK, ATTN_TENSOR_DV};
    for (attn_tensor_role_t r : roles) {
      if (!p.backward && r > ATTN_TENSOR_O) break;
      const TensorStrides& s = p.strides[r];
      const bool ok = s.seq % 8 == 0 && s.head % 8 == 0 && (p.varlen || s.batch % 8 == 0);
      if (!ok)
        not_supported("backend CUDA: tensor ", tensor_role_name(r),
                      ": strides must be multiples of 8 elements (16-byte vector loads); got batch ",
                      s.batch, ", seq ", s.seq, ", head ", s.head);
    }
  }

  // The sm_90a (wgmma) forward replaces the sm_80 one for dense plans at
  // d = 64 and 128 (softcap plans take its Cap instantiation) and for
  // block-sparse ones without softcap (its Sparse instantiation), on sm_90
  // devices whose image of it was compiled for sm_90a (ptxVersion 90: built
  // for other targets its body is empty). ATTN_CUDA_FWD_SM90=0 keeps the
  // sm_80 kernel (read at plan creation; unset, empty or 1 takes the
  // sm_90a one where it applies). At d = 64 a dense plan's query tile is
  // 192 or 128 rows, whichever cuda/fwd_sm90_shape.hpp estimates faster for
  // this grid; ATTN_CUDA_FWD_SM90_BM=128 or 192 forces one (tests, timing;
  // another value is an invalid argument). Softcap at d = 64 is built with 128 rows only
  // (the 192-row shape spills under it); block-sparse plans keep the default
  // shape (their tile lists are built for it).
  // Whether the device runs the sm_90a forward kernel k of tile shape c: an
  // image compiled for sm_90a (PTX 9.0; other images' kernels are empty)
  // and the shared memory.
  static bool sm90_forward_runs(const FwdKernel& k, const flash::FwdSm90Config& c, int64_t d,
                                size_t smem_optin) {
    cudaFuncAttributes attrs{};
    if (cudaFuncGetAttributes(&attrs, k.func) != cudaSuccess) {
      (void)cudaGetLastError();  // no image: the sm_80 kernels
      return false;
    }
    return attrs.ptxVersion >= 90 && smem_optin >= c.smem_bytes(int(d));
  }

  // Whether the warp-specialised forward's tensor maps encode for the
  // plan's strides (tried on stand-in bases aligned as execute requires).
  static bool fwd_ws_maps_encode(const Problem& p, bool bf16) {
    // What the encoder would refuse anyway (asked, it reports an API error
    // that tools such as compute-sanitizer count): an empty side, strides
    // that are not whole 16-byte units.
    if (p.seqlen_q <= 0 || p.seqlen_kv <= 0) return false;
    for (const attn_tensor_role_t t : {ATTN_TENSOR_Q, ATTN_TENSOR_K, ATTN_TENSOR_V}) {
      const TensorStrides& s = p.strides[t];
      if (s.seq % 8 != 0 || s.head % 8 != 0 || (p.batch > 1 && s.batch % 8 != 0)) return false;
    }
    flash::FwdParams t{};
    fill_shape(t, p);
    return fwd_sm90_ws_maps_encode(t, int(p.head_dim_qk), bf16, int(p.heads_q), int(p.batch));
  }

  void pick_sm90_forward(const Problem& p, int major, int minor, size_t smem_optin, bool gather) {
    if (!hooks_.fwd_sm90) return;
    // ATTN_CUDA_BSPARSE_FWD_PERSIST=1 asks for the persistent sm_80 kernel.
    if (fwd_persist_) return;
    const int64_t d = p.head_dim_qk;
    const bool sparse = p.block_mask != nullptr, softcap = p.softcap > 0.0f;
    // MoBA's gathered forward on wgmma (the same round lists, 128-row tiles
    // as the sm_80 one's) unless ATTN_CUDA_MOBA_GATHER_SM90=0: 17% faster
    // than the sm_80 one with blocks of 4096 keys (H200, L = 32K, d = 128;
    // bench/results/cuda-moba-gather-sm90-2026-12-01-a46bb94.md), 1-3% with
    // blocks of 512 since the merge's rows are fetched at the tile's start
    // (L = 32K and 128K; cuda-moba-prefetch-2026-12-01-bbf03aa.md there).
    if (gather) {
      const bool wanted = hooks_.moba_gather_sm90;
      if (!wanted || softcap || (d != 64 && d != 128) || major != 9 || minor != 0) return;
      const bool bf16 = p.dtype == ATTN_DTYPE_BF16;
      // The rounds run on the warp-specialised kernel
      // (flash_fwd_sm90_ws_moba_gather_kernel: items of 128 gathered rows
      // overlapped with the next item's loads and first GEMM) where its
      // tensor maps encode, unless ATTN_CUDA_MOBA_GATHER_WS=0 (the one-tile
      // kernel below): its kernel time 3-4% lower at blocks of 512 (top 3 and
      // 12) and 10% at blocks of 4096 (top 3; H200, L = 32K, d = 128;
      // bench/results/cuda-moba-ws-2026-12-05-a3f4e40.md).
      // (Its work items, the most tiles of a round per (sequence, head), are
      // counted in 32 bits.)
      const int64_t ws_items = moba_round_cap(p, flash::kSm90MobaBlockM) /
                               flash::kSm90MobaBlockM * p.heads_q * p.batch;
      if (hooks_.moba_gather_ws && ws_items <= std::numeric_limits<int32_t>::max()) {
        const FwdKernel k = d == 64 ? fwd_kernel_sm90_ws_moba_gather_d64(bf16)
                                    : fwd_kernel_sm90_ws_moba_gather_d128(bf16);
        const flash::FwdSm90Config c = flash::fwd_sm90_ws_config(int(d));
        const size_t extra = fwd_sm90_ws_moba_gather_smem(int(d)) - c.smem_bytes(int(d));
        if (sm90_forward_runs(k, c, d, size_t(smem_optin) - std::min(size_t(smem_optin), extra)) &&
            fwd_ws_maps_encode(p, bf16)) {
          kernel_ = k;
          sm90_cfg_ = c;
          sm90_ = true;
          return;
        }
      }
      const FwdKernel k =
          d == 64 ? fwd_kernel_sm90_moba_gather_d64(bf16) : fwd_kernel_sm90_moba_gather_d128(bf16);
      const flash::FwdSm90Config c = flash::fwd_sm90_config(int(d), flash::kSm90MobaBlockM);
      if (!sm90_forward_runs(k, c, d, smem_optin)) return;
      kernel_ = k;
      sm90_cfg_ = c;
      sm90_ = true;
      return;
    }
    if ((p.moba_block > 0 && !moba_sm90_) || (sparse && softcap) || (d != 64 && d != 128) ||
        major != 9 || minor != 0)
      return;
    const bool bf16 = p.dtype == ATTN_DTYPE_BF16;
    if (moba_sm90_) {  // moba_fits_sm90 checked the image and the shared memory
      kernel_ = d == 64 ? fwd_kernel_sm90_moba_d64(bf16) : fwd_kernel_sm90_moba_d128(bf16);
      sm90_cfg_ = flash::fwd_sm90_config(int(d), flash::kSm90MobaBlockM);
      sm90_ = true;
      return;
    }
    int block_m = flash::fwd_sm90_config(int(d)).block_m;
    if (d == 64 && softcap) {
      block_m = 128;
    } else if (d == 64 && !sparse) {
      if (hooks_.fwd_sm90_bm) {
        block_m = *hooks_.fwd_sm90_bm;
      } else {
        int sms = 0;
        check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_),
              "cudaDeviceGetAttribute");
        block_m = fwd_sm90_block_m_d64(p, flash::fwd_sm90_config(64).block_n, sms);
      }
    }
    // The warp-specialised persistent kernel (flash/fwd_sm90_ws_kernel.cuh)
    // for fixed-length plans without softcap whose tensors the tensor copies
    // can address, unless ATTN_CUDA_FWD_SM90_WS=0 (the one-tile kernel
    // below): on an H200 (bf16, d = 128, L = 32K, 16 heads, causal) 8.05
    // against 9.83 ms dense, 1.76 / 0.85 / 0.38 against 2.41 / 1.13 / 0.55
    // for the block masks of bench/bench_sparse_flex.py
    // (bench/results/cuda-fwd-ws-2026-12-02-*.md).
    // (ATTN_CUDA_FWD_SM90_BM, which forces a tile of the one-tile kernel at
    // d = 64, keeps that kernel.)
    // (Its work items are counted in 32 bits.)
    const int64_t ws_bm = flash::fwd_sm90_ws_config(int(d)).block_m;
    const int64_t ws_items = (p.seqlen_q + ws_bm - 1) / ws_bm * p.heads_q * p.batch;
    if (hooks_.fwd_sm90_ws && !softcap && !p.varlen && !(d == 64 && hooks_.fwd_sm90_bm) &&
        ws_items <= std::numeric_limits<int32_t>::max()) {
      const FwdKernel k = d == 64 ? fwd_kernel_sm90_ws_d64(bf16, sparse)
                                  : fwd_kernel_sm90_ws_d128(bf16, sparse);
      const flash::FwdSm90Config c = flash::fwd_sm90_ws_config(int(d));
      // (The encoder needs the context that the attribute query creates.)
      if (sm90_forward_runs(k, c, d, smem_optin) && fwd_ws_maps_encode(p, bf16)) {
        kernel_ = k;
        sm90_cfg_ = c;
        sm90_ = true;
        return;
      }
    }
    const FwdKernel k = sparse ? (d == 64 ? fwd_kernel_sm90_bsparse_d64(bf16)
                                          : fwd_kernel_sm90_bsparse_d128(bf16))
                        : d == 64 ? fwd_kernel_sm90_d64(bf16, block_m, softcap)
                                  : fwd_kernel_sm90_d128(bf16, softcap);
    const flash::FwdSm90Config c = flash::fwd_sm90_config(int(d), block_m);
    if (!sm90_forward_runs(k, c, d, smem_optin)) return;
    kernel_ = k;
    sm90_cfg_ = c;
    sm90_ = true;
  }

  // With ATTN_CUDA_MOBA_SM90=1 (a test and tuning hook; by default the
  // gathered kernels, on wgmma where pick_sm90_forward and
  // pick_sm90_backward take them, or the tile-union sm_80 ones with
  // ATTN_CUDA_MOBA_GATHER=0), MoBA plans without
  // softcap at d = 64 and 128 run the wgmma kernels' Moba instantiations on
  // the tile-union schedule, on sm_90 devices whose image of the forward one
  // was compiled for sm_90a (as pick_sm90_forward checks). The forward then
  // runs the wgmma one unless ATTN_CUDA_FWD_SM90=0, the dK/dV pass unless
  // ATTN_CUDA_BWD_SM90=0 or ATTN_CUDA_BWD_VARIANT (the sm_80 kernels' Moba
  // instantiations on the same lists otherwise).
  bool moba_fits_sm90(const Problem& p, int major, int minor, size_t smem_optin) const {
    const int64_t d = p.head_dim_qk;
    if (!hooks_.moba_sm90 || p.softcap > 0.0f || (d != 64 && d != 128) || major != 9 ||
        minor != 0)
      return false;
    const bool bf16 = p.dtype == ATTN_DTYPE_BF16;
    const FwdKernel k = d == 64 ? fwd_kernel_sm90_moba_d64(bf16) : fwd_kernel_sm90_moba_d128(bf16);
    return sm90_forward_runs(k, flash::fwd_sm90_config(int(d), flash::kSm90MobaBlockM), d,
                             smem_optin);
  }

  // The sm_90a (wgmma) dK/dV kernel replaces the sm_80 one for dense plans
  // at d = 64 and 128 (softcap plans take its Cap instantiation), on sm_90
  // devices whose image of it was compiled for sm_90a; the other launches
  // of the backward stay those of bwd_ (deterministic plans: its dQ kernel,
  // the wgmma kernel's instantiation without dQ computing dK and dV).
  // ATTN_CUDA_BWD_SM90=0 keeps the sm_80 kernel, and so does
  // ATTN_CUDA_BWD_VARIANT (which asks for an sm_80 variant); read at plan
  // creation. Block-sparse plans without softcap take its Sparse
  // instantiation (faster than the sm_80 one on an H200 for window + sinks,
  // random and BigBird masks) unless ATTN_CUDA_BWD_SM90_SPARSE=0 or the
  // sm_80 kernel's own tuning hooks are asked for (the persistent dK/dV
  // kernel, L2 prefetches).
  // MoBA's gathered rows take its Moba gather instantiation (no softcap;
  // faster than the sm_80 one at every block size and top-k measured on an
  // H200) unless ATTN_CUDA_MOBA_GATHER_BWD_SM90=0.
  void pick_sm90_backward(const Problem& p, int major, int minor, size_t smem_optin,
                          bool gather) {
    if (!hooks_.bwd_sm90 || hooks_.bwd_variant) return;
    const int64_t d = p.head_dim_qk;
    const bool sparse = p.block_mask != nullptr, softcap = p.softcap > 0.0f;
    if (sparse && (!hooks_.bwd_sm90_sparse || softcap || bwd_persist_ || hooks_.prefetch)) return;
    const bool moba_gather = gather && hooks_.moba_gather_bwd_sm90 && !softcap;
    if ((p.moba_block > 0 && !moba_sm90_ && !moba_gather) || (d != 64 && d != 128) ||
        major != 9 || minor != 0)
      return;
    const bool bf16 = p.dtype == ATTN_DTYPE_BF16;
    const BwdSm90Kernel k =
        moba_gather ? (d == 64 ? bwd_kernel_sm90_moba_gather_d64(bf16, p.deterministic)
                               : bwd_kernel_sm90_moba_gather_d128(bf16, p.deterministic))
        : moba_sm90_ ? (d == 64 ? bwd_kernel_sm90_moba_d64(bf16, p.deterministic)
                                : bwd_kernel_sm90_moba_d128(bf16, p.deterministic))
        : sparse ? (d == 64 ? bwd_kernel_sm90_bsparse_d64(bf16, p.deterministic)
                            : bwd_kernel_sm90_bsparse_d128(bf16, p.deterministic))
        : d == 64 ? bwd_kernel_sm90_d64(bf16, p.deterministic, softcap)
                  : bwd_kernel_sm90_d128(bf16, p.deterministic, softcap);
    const flash::BwdSm90Config c = sparse && !moba_sm90_ && !moba_gather
                                       ? flash::bwd_sm90_sparse_config(int(d))
                                       : flash::bwd_sm90_config(int(d));
    cudaFuncAttributes attrs{};
    if (cudaFuncGetAttributes(&attrs, k.func) != cudaSuccess) {
      (void)cudaGetLastError();  // no image: the sm_80 kernel
      return;
    }
    if (attrs.ptxVersion < 90 || smem_optin < c.smem_bytes(int(d))) return;
    check(k.prepare(), "cudaFuncSetAttribute");
    bwd_.dkdv = k.dkdv;
    bwd_.dkdv_func = k.func;
    bwd_sm90_cfg_ = c;
    bwd_sm90_ = true;
  }
  // Keys per dK/dV block.
  int bwd_block_n() const { return bwd_sm90_ ? bwd_sm90_cfg_.block_n : bwd_cfg_.block_n; }

  // Builds the tile lists of every kernel the plan runs and uploads them
  // into one device allocation (lists_dev_, owned by the plan).
  void upload_tile_lists() {  // after the backward's kernels are prepared
    const Problem& p = problem_;
    const std::shared_ptr<const BlockMask>& mask = p.block_mask;
    HostTileLists sets[3];
    flash::TileLists* dst[3] = {&params_.sparse, &bwd_params_.sparse_kv, &bwd_params_.sparse_dq};
    const int n = !p.backward ? 1 : p.deterministic ? 3 : 2;
    sets[0] = build_tile_lists(mask, p.window, tile_q(), tile_kv(), false);
    const int64_t mask_slots = mask->batch() * mask->heads();
    // The sm_90a forward takes its query tiles from work items, longest
    // first; the warp-specialised one in groups of heads where the lists
    // are not local (sparse_fwd_head_group).
    if (sm90_) {
      if (!hooks_.fwd_sm90_ws_heads && !hooks_.fwd_sm90_ws_order &&
          !lists_are_local(sets[0], mask_slots))
        params_.ws_group = sparse_fwd_head_group(p);
      cut_work_items(sets[0], mask_slots, INT32_MAX);
      if (!widen_sm90_forward_items(sets[0], mask_slots))
        fail(ATTN_STATUS_INTERNAL_ERROR,
             "block-sparse plan: the sm_90a forward's work items are not one per query tile");
    }
    if (fwd_persist_) {
      fwd_persist_ = order_forward_items(sets[0], p.batch, p.heads_q, p.group(), mask->batch(),
                                         mask->heads(), fwd_grid_);
      if (!fwd_persist_) {  // too many items: one block per query tile
        kernel_ = pick_kernel(p.head_dim_qk, p.dtype == ATTN_DTYPE_BF16, true, false, false);
        check(kernel_.prepare(), "cudaFuncSetAttribute");
      }
    }
    // The dK/dV kernel's KV-major lists, in its tiles (rows of a bit tile:
    // its keys).
    if (n > 1) {
      const int bwd_block_m = bwd_sm90_ ? bwd_sm90_cfg_.block_m : bwd_cfg_.block_m;
      sets[1] = build_tile_lists(mask, p.window, bwd_block_m, bwd_block_n(), true);
    }
    if (n > 2) {
      const flash::DqConfig dq = flash::dq_config(int(p.head_dim_qk));
      sets[2] = build_tile_lists(mask, p.window, dq.block_m, dq.block_n, false);
    }
    if (n > 1) {
      split_kv_lists(sets[1]);
      kv_items_ = sets[1].max_items;
    }
    if (n > 1 && bwd_persist_) {
      int per_sm = 0;
      const size_t smem = bwd_cfg_.smem_bytes(int(p.head_dim_qk));
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bwd_.dkdv_persistent_func,
                                                          bwd_cfg_.threads(), smem),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
      bwd_grid_ = std::max(per_sm, 1) * std::max(sm_count_, 1);
      bwd_persist_ = deal_dkdv_work(sets[1], p.batch, p.heads_kv, group_splits_,
                                    p.group() / group_splits_, mask->batch(), mask->heads(),
                                    bwd_grid_);
    }
    // ATTN_CUDA_BSPARSE_PREFETCH=1 (a tuning hook): the dK/dV kernel's
    // blocks prefetch the K, V tiles of the block one device-full later.
    int kv_prefetch = 0;
    if (n > 1 && hooks_.prefetch) {
      int per_sm = 0;
      const size_t smem = bwd_cfg_.smem_bytes(int(p.head_dim_qk));
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bwd_.dkdv_func,
                                                          bwd_cfg_.threads(), smem),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
      kv_prefetch = std::max(per_sm, 1) * sm_count_;
    }
    // Layout: per set its bit tiles (8-byte words first), offsets, visits,
    // work items, their offsets, the cut tiles, the persistent dK/dV
    // kernel's work and its offsets.
    constexpr int kArrays = 8;
    size_t bytes = 0, at[3][kArrays];
    for (int k = 0; k < n; ++k) {
      const size_t sizes[kArrays] = {sets[k].bits.size() * sizeof(uint64_t),
                                     sets[k].offsets.size() * sizeof(int32_t),
                                     sets[k].visits.size() * sizeof(int32_t),
                                     sets[k].items.size() * sizeof(int32_t),
                                     sets[k].item_offsets.size() * sizeof(int32_t),
                                     sets[k].cut_tiles.size() * sizeof(int32_t),
                                     sets[k].dealt.size() * sizeof(int32_t),
                                     sets[k].dealt_offsets.size() * sizeof(int32_t)};
      for (int a = 0; a < kArrays; ++a) {
        at[k][a] = bytes;
        bytes += sizes[a];
      }
      bytes = (bytes + 7) / 8 * 8;
    }
    std::vector<unsigned char> host(bytes);
    auto put = [&](size_t off, const void* src, size_t size) {
      if (size > 0) std::memcpy(host.data() + off, src, size);
    };
    for (int k = 0; k < n; ++k) {
      put(at[k][0], sets[k].bits.data(), sets[k].bits.size() * 8);
      put(at[k][1], sets[k].offsets.data(), sets[k].offsets.size() * 4);
      put(at[k][2], sets[k].visits.data(), sets[k].visits.size() * 4);
      put(at[k][3], sets[k].items.data(), sets[k].items.size() * 4);
      put(at[k][4], sets[k].item_offsets.data(), sets[k].item_offsets.size() * 4);
      put(at[k][5], sets[k].cut_tiles.data(), sets[k].cut_tiles.size() * 4);
      put(at[k][6], sets[k].dealt.data(), sets[k].dealt.size() * 4);
      put(at[k][7], sets[k].dealt_offsets.data(), sets[k].dealt_offsets.size() * 4);
    }
    void* dev = nullptr;
    const cudaError_t ae = cudaMalloc(&dev, bytes);
    if (ae == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      fail(ATTN_STATUS_OUT_OF_MEMORY, "backend CUDA: no device memory for ", bytes,
           " bytes of block-sparse tile lists");
    }
    check(ae, "cudaMalloc");
    try {
      check(cudaMemcpy(dev, host.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    } catch (...) {
      (void)cudaFree(dev);  // the constructor fails: no destructor runs
      throw;
    }
    lists_dev_ = dev;
    const BlockMask& m = *mask;
    for (int k = 0; k < n; ++k) {
      unsigned char* base = static_cast<unsigned char*>(dev);
      flash::TileLists& l = *dst[k];
      l.bits = reinterpret_cast<const uint64_t*>(base + at[k][0]);
      l.offsets = reinterpret_cast<const int32_t*>(base + at[k][1]);
      l.visits = reinterpret_cast<const int32_t*>(base + at[k][2]);
      l.items = reinterpret_cast<const int32_t*>(base + at[k][3]);
      l.item_offsets = reinterpret_cast<const int32_t*>(base + at[k][4]);
      l.cut_tiles = reinterpret_cast<const int32_t*>(base + at[k][5]);
      l.max_cut = sets[k].max_cut;
      l.prefetch_ahead = k == 1 ? kv_prefetch : 0;
      // The dK/dV blocks start in groups of about kSparseBwdGroupHeads query
      // heads' rows (KV heads and parts), group after group: the blocks
      // running at a time then share most of their Q, dO and dQ tiles in
      // L2, while within a group the longest items still start first.
      // ATTN_CUDA_BSPARSE_BWD_HEADS=n (a tuning hook): groups of n rows.
      // The persistent kernel deals its blocks heads fastest (its prefetch
      // decodes block indices with sparse_kv_block): one group there.
      const int heads_per_row = std::max<int>(1, int(p.group()) / group_splits_);
      const bool local = k == 1 && lists_are_local(sets[1], mask_slots);
      l.head_group = bwd_persist_ ? 0
                     : hooks_.bwd_heads.value_or(
                           local ? 0 : std::max(1, kSparseBwdGroupHeads / heads_per_row));
      l.dealt = reinterpret_cast<const int32_t*>(base + at[k][6]);
      l.dealt_offsets = reinterpret_cast<const int32_t*>(base + at[k][7]);
      l.grid_x = sets[k].grid_x;
      l.grid_y = sets[k].grid_y;
      l.tiles = sets[k].tiles;
      l.mask_batch = int32_t(m.batch());
      l.mask_heads = int32_t(m.heads());
      l.words_per_row = sets[k].words_per_row;
      l.rows = sets[k].rows;
    }
  }

  // Cuts the dK/dV kernel's long lists into several work items when the
  // longest block would otherwise outlast the average work per SM by half
  // again (global keys, sinks: one KV tile seen by every query tile), so
  // that it no longer sets the time. The items' dK and dV then meet in fp32
  // accumulators (those of split groups, or the cut tiles' own). Not for
  // deterministic plans (the additions' order would vary).
  // ATTN_CUDA_BSPARSE_ITEM=n (a test and tuning hook) cuts every list into
  // items of at most n visits instead, whatever the balance.
  void split_kv_lists(HostTileLists& l) {
    const Problem& p = problem_;
    if (p.deterministic || sm_count_ < 1) return;
    const BlockMask& m = *p.block_mask;
    if (hooks_.item) {
      cut_work_items(l, m.batch() * m.heads(), *hooks_.item);
      kv_lists_split_ = l.max_cut > 0;
      return;
    }
    const int64_t heads_per = p.group() / group_splits_;
    int64_t work = 0, longest = 0;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
        const int64_t slot = (m.batch() > 1 ? b : 0) * m.heads() + (m.heads() > 1 ? hk : 0);
        for (int64_t t = 0; t < l.tiles; ++t) {
          const int64_t n = l.offsets[size_t(slot * l.tiles + t) + 1] - l.offsets[size_t(slot * l.tiles + t)];
          work += n * p.group();
          longest = std::max(longest, n * heads_per);
        }
      }
    const int64_t per_sm = work / sm_count_;
    if (2 * longest <= 3 * per_sm) return;
    cut_work_items(l, m.batch() * m.heads(), std::max<int64_t>(8, per_sm / (2 * heads_per)));
    kv_lists_split_ = l.max_cut > 0;
  }

  // The forward's tensor strides, lengths and group.
  static void fill_shape(flash::FwdParams& f, const Problem& p) {
    const TensorStrides& q = p.strides[ATTN_TENSOR_Q];
    const TensorStrides& k = p.strides[ATTN_TENSOR_K];
    const TensorStrides& v = p.strides[ATTN_TENSOR_V];
    const TensorStrides& o = p.strides[ATTN_TENSOR_O];
    f.q_batch = q.batch, f.q_seq = q.seq, f.q_head = q.head;
    f.k_batch = k.batch, f.k_seq = k.seq, f.k_head = k.head;
    f.v_batch = v.batch, f.v_seq = v.seq, f.v_head = v.head;
    f.o_batch = o.batch, f.o_seq = o.seq, f.o_head = o.head;
    f.seqlen_q = int32_t(p.seqlen_q);
    f.seqlen_kv = int32_t(p.seqlen_kv);
    f.group = int32_t(p.group());
  }

  // The block-sparse forward's items in groups of (sequence, head) pairs
  // whose K and V take about 1.3 times the L2 cache: the items running at a
  // time then find most KV tiles in L2 (with all heads at once, L = 32K x
  // 16 heads, they came from DRAM), while within a group the longest items
  // still start first. H100, d = 128, 16 heads, masks shared by the heads:
  // at 32K (groups of 4) random blocks 0.906 ms against 1.073 with one
  // group; at 8K (one group) groups of 4 and fewer were slower, random
  // 0.122 against 0.097. Local lists (lists_are_local: windows,
  // BigBird) keep one group
  // (bench/results/cuda-bsparse-order-2026-12-05-ea0af18.md).
  int32_t sparse_fwd_head_group(const Problem& p) const {
    int l2 = 0;
    check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device_), "cudaDeviceGetAttribute");
    const double kv_head_bytes = double(p.seqlen_kv) * double(p.head_dim_qk + p.head_dim_v) *
                                 double(dtype_size(p.dtype));
    const double kv_heads = std::floor(1.3 * double(l2) / std::max(kv_head_bytes, 1.0));
    const double pairs = double(p.heads_q) * double(p.batch);
    // (Query heads of one KV head are adjacent pairs: whole groups of them.)
    return int32_t(std::clamp(std::max(kv_heads, 1.0) * double(p.group()), 1.0, pairs));
  }

  void fill_params() {
    const Problem& p = problem_;
    flash::FwdParams& f = params_;
    fill_shape(f, p);
    // ATTN_CUDA_FWD_SM90_WS_ORDER=0 or 1 (a tuning hook): the warp-specialised
    // forward's items numbered query tile fastest or slowest, instead of its
    // own choice by mask; ATTN_CUDA_FWD_SM90_WS_HEADS=n: in groups of n
    // (sequence, head) pairs, query tile slowest within a group.
    // (Block-sparse plans: upload_tile_lists() may set a group.)
    f.ws_group = hooks_.fwd_sm90_ws_heads ? *hooks_.fwd_sm90_ws_heads
                 : hooks_.fwd_sm90_ws_order ? (*hooks_.fwd_sm90_ws_order ? int32_t(1) << 30 : 1)
                                            : 0;
    // LSE: [batch, heads_q, seqlen_q] or, varlen, [heads_q, total_q] (Problem::lse_offset).
    f.lse_batch = p.heads_q * p.seqlen_q;
    f.lse_head = p.varlen ? p.total_q() : p.seqlen_q;
    // A reach beyond every key is the same as unbounded (validate() made
    // sure that every other bound fits the kernels' int32).
    const KernelWindow w = kernel_window(p);
    f.window_left = w.left;
    f.window_right = w.right;
    if (p.softcap > 0.0f) {
      f.softcap = p.softcap;
      f.softcap_in = float(2.0 * double(kLog2e) * double(p.scale) / double(p.softcap));
      f.scale_log2 = kLog2e;
    } else {
      f.softcap = 0.0f;
      f.softcap_in = 0.0f;
      f.scale_log2 = p.scale * kLog2e;
    }
  }

  void fill_bwd_params() {
    const Problem& p = problem_;
    flash::BwdParams& f = bwd_params_;
    const flash::FwdParams& fw = params_;
    f.q_batch = fw.q_batch, f.q_seq = fw.q_seq, f.q_head = fw.q_head;
    f.k_batch = fw.k_batch, f.k_seq = fw.k_seq, f.k_head = fw.k_head;
    f.v_batch = fw.v_batch, f.v_seq = fw.v_seq, f.v_head = fw.v_head;
    f.o_batch = fw.o_batch, f.o_seq = fw.o_seq, f.o_head = fw.o_head;
    const TensorStrides& d_o = p.strides[ATTN_TENSOR_DO];
    const TensorStrides& dq = p.strides[ATTN_TENSOR_DQ];
    const TensorStrides& dk = p.strides[ATTN_TENSOR_DK];
    const TensorStrides& dv = p.strides[ATTN_TENSOR_DV];
    f.do_batch = d_o.batch, f.do_seq = d_o.seq, f.do_head = d_o.head;
    f.dq_batch = dq.batch, f.dq_seq = dq.seq, f.dq_head = dq.head;
    f.dk_batch = dk.batch, f.dk_seq = dk.seq, f.dk_head = dk.head;
    f.dv_batch = dv.batch, f.dv_seq = dv.seq, f.dv_head = dv.head;
    f.lse_batch = fw.lse_batch, f.lse_head = fw.lse_head;
    f.seqlen_q = fw.seqlen_q, f.seqlen_kv = fw.seqlen_kv;
    f.heads_q = int32_t(p.heads_q);
    f.group = fw.group;
    f.group_splits = 1;
    f.window_left = fw.window_left, f.window_right = fw.window_right;
    f.scale = p.scale;
    f.scale_log2 = fw.scale_log2;
    f.softcap = fw.softcap;
    f.softcap_in = fw.softcap_in;
  }

  // Query heads of a group split over this many dK/dV blocks per (KV tile,
  // KV head): the fewest (a divisor of the group) that give 8 blocks per SM,
  // or the whole group. A GQA backward otherwise runs `group` times fewer,
  // longer blocks, and under a causal mask the longest of them sets the
  // time (GQA 16/2, d = 128, L = 8K causal: 184 TFLOP/s against 258 dense,
  // H200). Deterministic plans keep one block per KV head: atomics would
  // make dK and dV depend on the order of the additions.
  // ATTN_CUDA_BWD_GROUP_SPLIT=n asks for n instead (rounded down to a
  // divisor of the group), so that both paths can be timed and tested.
  int pick_group_splits(int sm_count) const {
    const Problem& p = problem_;
    const int group = int(p.group());
    if (p.deterministic || group <= 1) return 1;
    auto divisor_at_most = [&](int n) {
      n = std::clamp(n, 1, group);
      while (group % n != 0) --n;
      return n;
    };
    if (hooks_.group_split) return divisor_at_most(*hooks_.group_split);
    const int64_t blocks =
        (p.seqlen_kv + bwd_block_n() - 1) / bwd_block_n() * p.heads_kv * p.batch;
    for (int s = 1; s < group; ++s)
      if (group % s == 0 && blocks * s >= 8 * int64_t(sm_count)) return s;
    return group;
  }

  MobaLayout moba_forward_layout() const {
    const bool gather = moba_->gathers();
    return moba_->layout(0, !gather, false, gather);
  }
  // The backward's MoBA regions follow its other buffers (delta, LSE2, the
  // dQ and dK/dV accumulators), or, for a kept selection, start the
  // workspace (the pooled keys and selection where the forward left them)
  // and those buffers follow them (bwd_plain_offset()).
  bool keep_selection() const { return moba_ && problem_.moba_keep_selection; }
  MobaLayout moba_backward_layout() const {
    const size_t plain = 2 * delta_bytes() + dq_accum_bytes() + 2 * kv_accum_bytes();
    return moba_->layout(keep_selection() ? 0 : plain, problem_.deterministic, true);
  }
  size_t bwd_plain_offset() const {
    return keep_selection() ? align_up(moba_backward_layout().end) : 0;
  }

  size_t delta_bytes() const { return align_up(size_t(problem_.lse_elements()) * sizeof(float)); }
  size_t dq_accum_bytes() const {
    const Problem& p = problem_;
    if (p.deterministic) return 0;
    return size_t(p.total_q()) * size_t(p.heads_q) * size_t(p.head_dim_qk) * sizeof(float);
  }

  // Whether dK/dV accumulate in the cut tiles' slots only (BwdParams::dk_accum).
  bool compact_kv_accum() const { return group_splits_ <= 1 && kv_lists_split_; }
  // (token or cut tile row, head) rows of the dK and of the dV accumulator.
  int64_t kv_accum_rows() const {
    const Problem& p = problem_;
    if (compact_kv_accum())
      return p.batch * p.heads_kv * int64_t(bwd_params_.sparse_kv.max_cut) * bwd_block_n();
    return group_splits_ > 1 ? p.total_kv() * p.heads_kv : 0;
  }
  size_t kv_accum_bytes() const {
    return size_t(kv_accum_rows()) * size_t(problem_.head_dim_qk) * sizeof(float);
  }

  Problem problem_;
  CudaHooks hooks_{};  // read first, in the constructor
  int device_;
  int group_splits_ = 1;
  int sm_count_ = 0;
  int kv_items_ = 0;             // block-sparse: the dK/dV kernel's blocks per slot
  bool kv_lists_split_ = false;  // block-sparse: some dK/dV list is cut into several items
  flash::FwdConfig cfg_{};
  FwdKernel kernel_{};
  bool sm90_ = false;  // kernel_ is the sm_90a forward (sm90_cfg_), else the sm_80 one (cfg_)
  // MoBA on the wgmma kernels (moba_fits_sm90): the tile-union schedule.
  bool moba_sm90_ = false;
  flash::FwdSm90Config sm90_cfg_{};
  flash::FwdParams params_{};
  flash::BwdConfig bwd_cfg_{};
  BwdKernels bwd_{};
  bool bwd_sm90_ = false;  // bwd_.dkdv is the sm_90a kernel (bwd_sm90_cfg_)
  flash::BwdSm90Config bwd_sm90_cfg_{};
  flash::BwdParams bwd_params_{};
  int m_blocks_ = 0;
  bool fwd_persist_ = false;  // block-sparse: the persistent forward
  int fwd_grid_ = 0;          // its blocks
  bool bwd_persist_ = false;  // block-sparse: the persistent dK/dV kernel
  int bwd_grid_ = 0;          // its blocks
  int32_t* cu_dev_ = nullptr;
  void* lists_dev_ = nullptr;  // block-sparse tile lists (upload_tile_lists)
  std::optional<MobaSchedule> moba_;  // MoBA plans
  char kernel_name_[64] = {};
};

}  // namespace

std::unique_ptr<BackendPlan> make_plan(const Problem& problem, const ContextConfig& ctx) {
  return std::make_unique<CudaPlan>(problem, ctx);
}

}  // namespace attn::cuda
