// Decode and chunked-prefill plans over a paged KV cache.
//
// A plan fixes the limits (batch, query tokens, visible keys) and so the
// workspace. attn_decode_prepare is a host step that turns one batch into
// metadata in the workspace: per sequence its length and the pages its
// queries read, and the work units (sequence, chunk of pages). Execution
// reads only that metadata, Q and the pages, which is what lets a device
// backend capture it in a graph later.
#pragma once

#include <attn/attn.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/context.hpp"
#include "kv/kv_cache.hpp"

namespace attn::kv {

struct DecodeConfig {
  int64_t heads_q = 0;
  int64_t max_batch = 0;
  int64_t max_query_tokens = 0;
  int64_t max_kv_tokens = 0;    // resolved (never 0)
  int64_t kv_chunk_tokens = 0;  // as configured: 0 auto, -1 never, n > 0 fixed
  float scale = 1.0f;
  float softcap = 0.0f;
};

// --- metadata in the workspace (plain data, shared with the kernels) -------

constexpr uint64_t kPreparedMagic = 0x6b76646563303031ull;  // "kvdec001"

struct PreparedHeader {
  uint64_t magic;
  uint64_t plan_id;     // DecodePlan::id() of the plan that prepared it
  uint64_t cache_id;    // address of the KvCache it describes
  uint64_t generation;  // the cache's generation at prepare time
  int64_t batch;
  int64_t total_q;
  int64_t num_units;
  int64_t chunk_pages;  // 0: no split
};

struct SeqMeta {
  int64_t q_begin;      // first query token in Q / O
  int64_t q_len;
  int64_t length;       // tokens in the cache, the new ones included
  int64_t first_unit;   // units [first_unit, first_unit + num_units)
  int64_t num_units;
};

// One page a sequence's queries read.
struct PageEntry {
  int64_t logical;  // holds positions [logical * page_size, ... + page_size)
  int64_t page;     // physical page
};

struct WorkUnit {
  int64_t seq;
  int64_t entry_begin, entry_end;  // into the entry array
  int64_t partial;                 // partial-state slot, -1: writes O directly
};

// Pointers into a prepared workspace.
struct DecodeWorkspace {
  PreparedHeader* header;
  SeqMeta* seqs;
  PageEntry* entries;
  WorkUnit* units;
  // CUDA, balanced split: the blocks of slot b of the decode grid (one per
  // KV head and row tile) run units [block_units[b], block_units[b + 1])
  // ([device_grid_blocks() + 1]; null else).
  int32_t* block_units;
  float* partial_o;    // [slot][max_query_tokens][heads_q][head_dim_v]
  float* partial_lse;  // [slot][max_query_tokens][heads_q]
  float* scratch;      // [threads][scratch_floats]
};

class DecodePlan {
 public:
  DecodePlan(const ContextConfig& ctx, const CacheConfig& cache, const DecodeConfig& cfg);
  ~DecodePlan();
  DecodePlan(const DecodePlan&) = delete;
  DecodePlan& operator=(const DecodePlan&) = delete;

  size_t workspace_bytes() const { return total_bytes_; }
  // On the CUDA backend prepare uploads the metadata on `stream` from the
  // plan's pinned staging area (prepares of one plan are serialised, and
  // each waits until the previous upload has left the staging area), and
  // execute only launches kernels on `stream`.
  void prepare(const KvCache& cache, int32_t num_seqs, const int64_t* ids,
               const int32_t* query_lens, void* workspace, size_t workspace_bytes,
               attn_decode_step_info_t* info, void* stream) const;
  void execute(const KvCache& cache, const void* q, void* o, float* lse, void* workspace,
               size_t workspace_bytes, void* stream) const;
  void describe(attn_decode_plan_info_t& info) const;

  const CacheConfig& cache_config() const { return cache_; }
  const DecodeConfig& config() const { return cfg_; }
  int32_t num_threads() const { return threads_; }
  int64_t group() const { return cfg_.heads_q / cache_.heads_kv; }
  // Unique in the process, unlike the plan's address: a plan made where a
  // destroyed one lived must not accept that one's metadata, whose limits
  // (batch, query tokens, split) may exceed its own workspace layout.
  uint64_t id() const { return id_; }
  int32_t device() const { return ctx_.device; }
  // CUDA: stages of the decode kernel's pipeline, and its variant
  // (cuda::kDecodeKernelSm80, kDecodeKernelSm90Bulk, kDecodeKernelSm90Bulk32 or
  // kDecodeKernelSm90Tensor).
  int32_t device_stages() const { return device_stages_; }
  int32_t device_kernel() const { return device_kernel_; }
  // CUDA: whether the automatic split balances the pages over a fixed grid
  // of device_blocks() blocks per (KV head, row tile), each running a run
  // of units (ATTN_CUDA_DECODE_SPLIT=balanced), rather than one unit per
  // block in whole waves.
  bool device_balanced() const { return device_blocks_ > 0; }
  int64_t device_blocks() const { return device_blocks_; }
  // CUDA: the combine kernel launched with programmatic dependent launch
  // (ATTN_CUDA_DECODE_PDL=1 on sm_90+).
  bool device_pdl() const { return device_pdl_; }
  // Block slots of the decode grid at its largest (the grid's x is slots x
  // heads_kv, see decode_launch; slots past the prepared work return).
  int64_t device_grid_blocks() const {
    return device_blocks_ > 0 ? std::max(device_blocks_, cfg_.max_batch) : max_units_;
  }

  // Per-thread scratch regions (offsets in floats, each 16-float aligned).
  struct Scratch {
    size_t q = 0, k = 0, krow = 0, v = 0, s = 0, acc = 0, m = 0, l = 0, floats = 0;
  };
  const Scratch& scratch() const { return scratch_; }

 private:
  void check_cache(const KvCache& cache) const;
  DecodeWorkspace carve(void* workspace) const;
  // The automatic split on CUDA: pages per chunk (0: no split) for a batch
  // whose sequence i reads entries [entry_begin[i], entry_begin[i + 1]).
  int64_t device_chunk_pages(int32_t num_seqs, const int32_t* query_lens,
                             const std::vector<int64_t>& entry_begin) const;
  // The balanced split: cuts the batch's page lists, back to back, into
  // device_blocks_ runs of equal length; the pieces of sequences become
  // the units (in order) and block b's run of units ends at
  // block_units[b + 1].
  void balanced_units(int32_t num_seqs, const std::vector<int64_t>& entry_begin,
                      std::vector<WorkUnit>& units, std::vector<int32_t>& block_units,
                      int64_t& run_pages) const;
  void execute_device(const KvCache& cache, const void* q, void* o, float* lse, void* workspace,
                      void* stream) const;

  ContextConfig ctx_;
  CacheConfig cache_;
  DecodeConfig cfg_;
  uint64_t id_;
  int32_t threads_ = 1;
  int64_t max_entries_per_seq_ = 0;
  int64_t max_units_ = 0, max_partials_ = 0;
  Scratch scratch_;
  size_t off_header_ = 0, off_seqs_ = 0, off_entries_ = 0, off_units_ = 0, off_block_units_ = 0;
  size_t off_partial_o_ = 0, off_partial_lse_ = 0, off_scratch_ = 0;
  size_t total_bytes_ = 0;

  // CUDA: the decode blocks resident on the device at once (one wave: the
  // automatic split's target), the
  // pinned staging area of prepare (a cuda::DecodeStaging) and, per
  // prepared workspace, the cache and its state that the metadata describe
  // (the host cannot read the device header before launching).
  bool on_device_ = false;
  int64_t device_wave_ = 0;
  int32_t device_stages_ = 2;
  int32_t device_kernel_ = 0;
  bool device_pdl_ = false;
  int64_t device_blocks_ = 0;  // balanced split: blocks per (KV head, row tile); 0: waves
  std::shared_ptr<void> staging_;
  // A workspace's last prepare, as execute needs it: which cache and state
  // it describes, and for launches outside graph capture the grid that
  // covers exactly its blocks (blocks past them only return, yet an H200
  // read 32 x 8K at 3.85 TB/s with the plan's largest grid against 4.10
  // with exactly the batch's) and whether any sequence was split (else the
  // combine kernel has nothing to merge).
  // stamp: this prepare's, unique in the process; execute also checks that
  // it is still the workspace's last prepare by any plan (decode_plan.cpp).
  struct Prepared {
    uintptr_t cache_id;
    uint64_t generation;
    int64_t launch_blocks;
    bool split;
    uint64_t stamp;
  };
  mutable std::mutex prepared_mutex_;
  mutable std::unordered_map<uintptr_t, Prepared> prepared_;
};

// Validates a public config against the cache's and resolves defaults.
DecodeConfig validate_decode_config(const attn_decode_config_t* config, const CacheConfig& cache);

}  // namespace attn::kv

namespace attn::cpu {
// Runs a prepared decode step on the CPU (src/cpu/decode_cpu.cpp).
void decode_execute(const kv::DecodePlan& plan, const kv::KvCache& cache,
                    const kv::DecodeWorkspace& ws, const void* q, void* o, float* lse);
}  // namespace attn::cpu
