// The paged KV cache: a pool of fixed-size pages for keys and values, and
// per sequence the list of pages that hold its tokens. Pages are
// reference-counted so that forked sequences share their common prefix;
// appending into a shared, partly filled page copies it first.
//
// Every mutation validates and counts what it needs before changing
// anything, so a failed call leaves the cache exactly as it was.
#pragma once

#include <attn/attn.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/context.hpp"

namespace attn::kv {

// The validated configuration (attn_kv_cache_config_t without its tag).
struct CacheConfig {
  attn_dtype_t dtype = ATTN_DTYPE_FP32;
  attn_kv_layout_t layout = ATTN_KV_LAYOUT_NHD;
  int64_t page_size = 0;
  int64_t num_pages = 0;
  int64_t heads_kv = 0;
  int64_t head_dim_qk = 0, head_dim_v = 0;
  int64_t window = 0;  // 0: none
  int64_t sink_tokens = 0;

  bool operator==(const CacheConfig&) const = default;

  // Elements of one page of K (or V) for one token slot of all heads.
  int64_t k_page_elems() const { return page_size * heads_kv * head_dim_qk; }
  int64_t v_page_elems() const { return page_size * heads_kv * head_dim_v; }
  size_t bytes_per_token() const;
  // Logical pages [0, sink_pages()) are never evicted.
  int64_t sink_pages() const { return (sink_tokens + page_size - 1) / page_size; }
  // Element offset of (token slot, head) inside a K page (dim = head_dim_qk)
  // or V page (dim = head_dim_v).
  int64_t slot_offset(int64_t slot, int64_t head, int64_t dim) const {
    return layout == ATTN_KV_LAYOUT_NHD ? (slot * heads_kv + head) * dim
                                        : (head * page_size + slot) * dim;
  }
};

// The next value of a process-wide counter: the state stamps of caches
// (KvCache::generation) and the ids of decode plans (DecodePlan::id).
uint64_t next_generation();

// Checks every field of a public config and returns the internal one.
// Throws INVALID_ARGUMENT naming the field.
CacheConfig validate_config(const attn_kv_cache_config_t* config);

// The page memory a config needs: K pool, then V pool, each 64-byte aligned
// from an aligned base; includes the alignment slack.
struct PoolLayout {
  size_t k_offset = 0, v_offset = 0, used = 0, total = 0;
};
PoolLayout pool_layout(const CacheConfig& c);

// The pages of one sequence. Logical page L holds positions
// [L * page_size, (L + 1) * page_size). Held pages are the sink pages
// [0, sink.size()) and the recent ones [recent_first, recent_first +
// recent.size()); logical pages in between were evicted.
struct Sequence {
  int64_t length = 0;
  std::vector<int32_t> sink;
  std::vector<int32_t> recent;
  int64_t recent_first = 0;

  // Physical page of logical page L, or -1 when it is not held.
  int32_t page(int64_t logical) const {
    if (logical < int64_t(sink.size())) return sink[size_t(logical)];
    if (logical >= recent_first && logical < recent_first + int64_t(recent.size()))
      return recent[size_t(logical - recent_first)];
    return -1;
  }
};

class KvCache {
 public:
  // memory == nullptr: allocate (and own) the pool.
  KvCache(const ContextConfig& ctx, const CacheConfig& config, void* memory, size_t memory_bytes);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const CacheConfig& config() const { return config_; }
  attn_backend_t backend() const { return backend_; }
  // A process-wide unique stamp of the cache's state, new with every
  // mutation; prepared decode metadata record it. Unique across caches, so
  // that a new cache at a freed cache's address cannot match stale metadata.
  uint64_t generation() const { return generation_; }

  void add_sequence(int64_t id);
  // On the CUDA backend k and v are device pointers and the copies into
  // the pages (and copy-on-write page copies) are enqueued on `stream`;
  // every check happens on the host before anything is enqueued.
  void append(int32_t num_seqs, const int64_t* ids, const int32_t* num_tokens, const void* k,
              const void* v, void* stream);
  void fork(int64_t parent, int64_t child, int64_t num_tokens);
  // Shortens sequence id to its first num_tokens tokens (drops rejected
  // draft tokens): the pages a fork at num_tokens would take, then the old
  // ones let go.
  void truncate(int64_t id, int64_t num_tokens);
  void release(int64_t id);

  // Throws INVALID_ARGUMENT naming `arg` when id is not live.
  const Sequence& sequence(int64_t id, const char* arg) const;
  int64_t num_sequences() const { return int64_t(sequences_.size()); }
  int64_t pages_in_use() const { return config_.num_pages - int64_t(free_.size()); }
  bool owns_memory() const { return owned_ != nullptr || device_owned_ != nullptr; }
  // The pages of K and V, without the alignment gap between the two pools.
  size_t memory_bytes() const {
    return size_t(config_.num_pages * config_.page_size) * config_.bytes_per_token();
  }

  // Base of physical page p in the K and V pools.
  const void* k_page(int32_t p) const { return k_base_ + size_t(p) * k_page_bytes_; }
  const void* v_page(int32_t p) const { return v_base_ + size_t(p) * v_page_bytes_; }

 private:
  // First position the next appended token can see; pages wholly below it
  // (and above the sinks) are evicted before appending.
  int64_t evict_below(const Sequence& s) const {
    return config_.window > 0 ? s.length - config_.window + 1 : 0;
  }
  // Drops (logical page, physical page) pairs of s below `below`; calls
  // drop(physical) for each.
  template <class Drop>
  void evict(Sequence& s, int64_t below, Drop&& drop) const;
  void unref(int32_t page);
  int32_t take_free_page();
  void copy_page(int32_t from, int32_t to);  // host pools only
  void release_device_memory() noexcept;

  CacheConfig config_;
  attn_backend_t backend_;
  PoolLayout layout_;
  std::unique_ptr<char[]> owned_;
  void* device_owned_ = nullptr;  // CUDA: the library's cudaMalloc
  int32_t device_ = 0;
  char* k_base_ = nullptr;
  char* v_base_ = nullptr;
  size_t k_page_bytes_ = 0, v_page_bytes_ = 0;
  std::vector<int32_t> refcount_;  // [num_pages]
  std::vector<int32_t> free_;      // a stack of free pages
  std::unordered_map<int64_t, Sequence> sequences_;
  // The first num_tokens tokens of `parent` as a new sequence holding the
  // parent's pages (not yet counted); throws INVALID_ARGUMENT (names
  // `arg`) when tokens its next one would see were evicted.
  Sequence prefix_of(const Sequence& parent, int64_t parent_id, int64_t num_tokens,
                     const char* arg) const;
  uint64_t generation_;
};

}  // namespace attn::kv
