#include "kv/kv_cache.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <limits>

#include "attn_config.h"
#include "core/checked.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/sized_struct.hpp"
#include "core/workspace.hpp"
#if ATTN_HAVE_CUDA
#include "cuda/decode_cuda.hpp"
#include "cuda/limits.hpp"
#endif

namespace attn::kv {

uint64_t next_generation() {
  static std::atomic<uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}

size_t CacheConfig::bytes_per_token() const {
  return size_t(heads_kv * (head_dim_qk + head_dim_v)) * dtype_size(dtype);
}

CacheConfig validate_config(const attn_kv_cache_config_t* config) {
  if (config == nullptr) invalid_argument("config is NULL");
  // The first layout ends with sink_tokens. Fields appended later must
  // default to zero for callers built against an older header, which pass
  // their smaller struct_size; so read at most struct_size bytes.
  constexpr size_t first_size = offsetof(attn_kv_cache_config_t, sink_tokens) + sizeof(int64_t);
  if (config->struct_size < first_size)
    invalid_argument("config->struct_size (", config->struct_size,
                     ") is too small: set it to sizeof(attn_kv_cache_config_t)");
  attn_kv_cache_config_t c{};
  require_known_tail(config, config->struct_size, sizeof c, "config");
  std::memcpy(&c, config, std::min<size_t>(size_t(config->struct_size), sizeof c));
  if (!dtype_is_valid(c.dtype)) invalid_argument("config->dtype: unknown value ", c.dtype);
  if (c.layout != ATTN_KV_LAYOUT_NHD && c.layout != ATTN_KV_LAYOUT_HND)
    invalid_argument("config->layout: unknown value ", c.layout);
  if (c.page_size < 1) invalid_argument("config->page_size must be >= 1, got ", c.page_size);
  if (c.num_pages < 1 || c.num_pages > std::numeric_limits<int32_t>::max())
    invalid_argument("config->num_pages must be in 1..2^31-1, got ", c.num_pages);
  // As a plan's heads; the kernels index KV heads in 32 bits.
  if (c.heads_kv < 1 || c.heads_kv > kMaxShapeCount)
    invalid_argument("config->heads_kv must be in 1..2^31-1, got ", c.heads_kv);
  if (c.head_dim_qk < 1 || c.head_dim_qk > 1024)
    invalid_argument("config->head_dim_qk must be in 1..1024, got ", c.head_dim_qk);
  if (c.head_dim_v < 1 || c.head_dim_v > 1024)
    invalid_argument("config->head_dim_v must be in 1..1024, got ", c.head_dim_v);
  // Positions are int64: window, sinks, query tokens and a page are added
  // together (decode limits, sink pages), so each stays below 2^60.
  constexpr int64_t kMaxPositions = int64_t(1) << 60;
  if (c.window < 0 || c.window > kMaxPositions)
    invalid_argument("config->window must be in 0..2^60 (0: no window), got ", c.window);
  if (c.sink_tokens < 0 || c.sink_tokens > kMaxPositions)
    invalid_argument("config->sink_tokens must be in 0..2^60, got ", c.sink_tokens);
  if (c.sink_tokens > 0 && c.window == 0)
    invalid_argument("config->sink_tokens is ", c.sink_tokens,
                     " but config->window is 0: sinks only make sense with a window");
  // Keep every byte offset far from overflow.
  const double bytes = double(c.num_pages) * double(c.page_size) * double(c.heads_kv) *
                       double(c.head_dim_qk + c.head_dim_v) * 4.0;
  if (bytes > 4.0e18 || double(c.page_size) * double(c.num_pages) > 4.0e18)
    invalid_argument("config->num_pages x config->page_size x config->heads_kv x (head_dim_qk + ",
                     "head_dim_v): a pool of ", bytes,
                     " bytes (at 4 bytes an element) is too large");
  CacheConfig out;
  out.dtype = attn_dtype_t(c.dtype);
  out.layout = attn_kv_layout_t(c.layout);
  out.page_size = c.page_size;
  out.num_pages = c.num_pages;
  out.heads_kv = c.heads_kv;
  out.head_dim_qk = c.head_dim_qk;
  out.head_dim_v = c.head_dim_v;
  out.window = c.window;
  out.sink_tokens = c.sink_tokens;
  return out;
}

PoolLayout pool_layout(const CacheConfig& c) {
  const size_t es = dtype_size(c.dtype);
  const size_t k_bytes = size_t(c.k_page_elems()) * es * size_t(c.num_pages);
  const size_t v_bytes = size_t(c.v_page_elems()) * es * size_t(c.num_pages);
  PoolLayout l;
  l.k_offset = 0;
  l.v_offset = align_up(k_bytes, kWorkspaceAlign);
  l.used = l.v_offset + v_bytes;
  l.total = l.used + kWorkspaceAlign - 1;
  return l;
}

KvCache::KvCache(const ContextConfig& ctx, const CacheConfig& config, void* memory,
                 size_t memory_bytes)
    : config_(config), backend_(ctx.backend), layout_(pool_layout(config)),
      device_(ctx.device), generation_(next_generation()) {
#if !ATTN_HAVE_CUDA
  if (ctx.backend != ATTN_BACKEND_CPU)
    not_supported("ctx: this build of libattn has no CUDA backend");
#else
  if (ctx.backend == ATTN_BACKEND_CUDA) cuda::check_kv_page_size(config.page_size);
#endif
  if (memory == nullptr && memory_bytes != 0)
    invalid_argument("memory is NULL but memory_bytes is ", memory_bytes);
  char* raw = nullptr;
  if (memory == nullptr) {
#if ATTN_HAVE_CUDA
    if (ctx.backend == ATTN_BACKEND_CUDA) {
      device_owned_ = cuda::kv_pool_alloc(ctx.device, layout_.total);
      raw = static_cast<char*>(device_owned_);
    } else
#endif
    {
      owned_.reset(new char[layout_.total]);
      raw = owned_.get();
    }
  } else {
    if (memory_bytes < layout_.total)
      invalid_argument("memory_bytes: ", memory_bytes, " bytes given, the cache needs ",
                       layout_.total, " (attn_kv_cache_memory_size)");
    raw = static_cast<char*>(memory);
  }
  char* base = workspace_base(raw);
  k_base_ = base + layout_.k_offset;
  v_base_ = base + layout_.v_offset;
  const size_t es = dtype_size(config_.dtype);
  k_page_bytes_ = size_t(config_.k_page_elems()) * es;
  v_page_bytes_ = size_t(config_.v_page_elems()) * es;
  try {
    refcount_.assign(size_t(config_.num_pages), 0);
    free_.resize(size_t(config_.num_pages));
  } catch (...) {
    release_device_memory();
    throw;
  }
  // A stack: page 0 is handed out first.
  for (int64_t i = 0; i < config_.num_pages; ++i)
    free_[size_t(i)] = int32_t(config_.num_pages - 1 - i);
}

KvCache::~KvCache() { release_device_memory(); }

void KvCache::release_device_memory() noexcept {
#if ATTN_HAVE_CUDA
  cuda::kv_pool_free(device_, device_owned_);
#endif
  device_owned_ = nullptr;
}

const Sequence& KvCache::sequence(int64_t id, const char* arg) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    invalid_argument(arg, ": no live sequence with id ", id, " in this cache");
  return it->second;
}

void KvCache::add_sequence(int64_t id) {
  if (id < 0) invalid_argument("seq_id must be >= 0, got ", id);
  if (sequences_.count(id)) invalid_argument("seq_id: a sequence with id ", id, " is already live");
  sequences_.emplace(id, Sequence{});
  generation_ = next_generation();
}

template <class Drop>
void KvCache::evict(Sequence& s, int64_t below, Drop&& drop) const {
  const int64_t first_kept = below / config_.page_size;  // pages wholly below `below` go
  const int64_t n = std::clamp<int64_t>(first_kept - s.recent_first, 0, int64_t(s.recent.size()));
  for (int64_t i = 0; i < n; ++i) drop(s.recent[size_t(i)]);
  s.recent.erase(s.recent.begin(), s.recent.begin() + n);
  s.recent_first += n;
}

void KvCache::unref(int32_t page) {
  if (--refcount_[size_t(page)] == 0) free_.push_back(page);
}

int32_t KvCache::take_free_page() {
  const int32_t p = free_.back();
  free_.pop_back();
  refcount_[size_t(p)] = 1;
  return p;
}

void KvCache::copy_page(int32_t from, int32_t to) {
  std::memcpy(k_base_ + size_t(to) * k_page_bytes_, k_base_ + size_t(from) * k_page_bytes_,
              k_page_bytes_);
  std::memcpy(v_base_ + size_t(to) * v_page_bytes_, v_base_ + size_t(from) * v_page_bytes_,
              v_page_bytes_);
}

void KvCache::append(int32_t num_seqs, const int64_t* ids, const int32_t* num_tokens,
                     const void* k, const void* v, void* stream) {
  const int64_t ps = config_.page_size;
  const int64_t sp = config_.sink_pages();
  if (num_seqs < 1) invalid_argument("num_seqs must be >= 1, got ", num_seqs);
  // The ids are live and distinct, so there are at most as many as live
  // sequences: checked before num_seqs entries are read or reserved.
  if (num_seqs > num_sequences())
    invalid_argument("num_seqs: ", num_seqs, " sequences, but the cache holds ", num_sequences(),
                     " (the ids must be live and distinct)");
  if (ids == nullptr) invalid_argument("seq_ids is NULL");
  if (num_tokens == nullptr) invalid_argument("num_tokens is NULL");

  // 1. Arguments, and whether each sequence could fit in the pool at all.
  std::vector<Sequence*> seqs(static_cast<size_t>(num_seqs));
  std::unordered_map<int64_t, int32_t> seen;
  int64_t total = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    auto it = sequences_.find(ids[i]);
    if (it == sequences_.end())
      invalid_argument("seq_ids[", i, "]: no live sequence with id ", ids[i], " in this cache");
    auto [where, fresh] = seen.emplace(ids[i], i);
    if (!fresh)
      invalid_argument("seq_ids[", i, "]: id ", ids[i], " appears twice (also seq_ids[",
                       where->second, "])");
    if (num_tokens[i] < 0)
      invalid_argument("num_tokens[", i, "] must be >= 0, got ", num_tokens[i]);
    Sequence& s = it->second;
    seqs[size_t(i)] = &s;
    total += num_tokens[i];
    if (num_tokens[i] == 0) continue;
    const int64_t new_len = s.length + num_tokens[i];
    const int64_t last = (new_len - 1) / ps;
    const int64_t first_recent = std::max(sp, evict_below(s) / ps);
    const int64_t held = std::min(sp, last + 1) + std::max<int64_t>(0, last + 1 - first_recent);
    if (held > config_.num_pages)
      invalid_argument("num_tokens[", i, "]: sequence ", ids[i], " would hold ", held,
                       " pages after appending ", num_tokens[i], " tokens, the whole cache has ",
                       config_.num_pages);
  }
  if (total > 0) {
    if (k == nullptr) invalid_argument("k is NULL but ", total, " tokens are appended");
    if (v == nullptr) invalid_argument("v is NULL but ", total, " tokens are appended");
  }

  // 2. Count pages in the order they will be applied: evictions of every
  //    sequence first (they only free), then per sequence the copy of a
  //    shared partial last page and the new pages.
  std::unordered_map<int32_t, int32_t> drops;  // reference counts given up
  int64_t free_pages = int64_t(free_.size());
  auto ref = [&](int32_t p) {
    auto it = drops.find(p);
    return refcount_[size_t(p)] - (it == drops.end() ? 0 : it->second);
  };
  for (int32_t i = 0; i < num_seqs; ++i) {
    if (num_tokens[i] == 0) continue;
    Sequence copy_of_pages;  // evict() edits; work on a copy of the bookkeeping
    copy_of_pages.recent = seqs[size_t(i)]->recent;
    copy_of_pages.recent_first = seqs[size_t(i)]->recent_first;
    evict(copy_of_pages, evict_below(*seqs[size_t(i)]), [&](int32_t p) {
      ++drops[p];
      if (ref(p) == 0) ++free_pages;
    });
  }
  int64_t needed = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    if (num_tokens[i] == 0) continue;
    const Sequence& s = *seqs[size_t(i)];
    if (s.length % ps != 0) {
      const int32_t last = s.page(s.length / ps);
      if (ref(last) > 1) {
        ++needed;
        ++drops[last];
      }
    }
    needed += (s.length + num_tokens[i] + ps - 1) / ps - (s.length + ps - 1) / ps;
  }
  if (needed > free_pages)
    fail(ATTN_STATUS_CAPACITY, "KV cache full: the batch needs ", needed, " new pages, ",
         free_pages, " are free (of ", config_.num_pages, "); nothing was appended");

  // 3. Apply. Reserve the page lists (and on a device the copy lists)
  //    first: nothing after that can fail but an enqueue error.
  const bool on_device = backend_ == ATTN_BACKEND_CUDA;
  struct DeviceRun {
    int64_t src_token;
    int32_t page, slot, count;
  };
  std::vector<std::pair<int32_t, int32_t>> page_copies;
  std::vector<DeviceRun> runs;
#if ATTN_HAVE_CUDA
  std::vector<cuda::KvCopyRun> device_runs;
#endif
  if (on_device) {
    page_copies.reserve(size_t(num_seqs));
    runs.reserve(size_t(needed) + size_t(num_seqs));
#if ATTN_HAVE_CUDA
    device_runs.reserve(runs.capacity());
#endif
  }
  for (int32_t i = 0; i < num_seqs; ++i) {
    Sequence& s = *seqs[size_t(i)];
    const int64_t pages = (s.length + num_tokens[i] + ps - 1) / ps;
    s.sink.reserve(size_t(std::min(sp, pages)));
    s.recent.reserve(s.recent.size() + size_t(pages - (s.length + ps - 1) / ps));
  }
  for (int32_t i = 0; i < num_seqs; ++i)
    if (num_tokens[i] > 0)
      evict(*seqs[size_t(i)], evict_below(*seqs[size_t(i)]), [&](int32_t p) { unref(p); });
  const size_t es = dtype_size(config_.dtype);
  const int64_t hkv = config_.heads_kv, dqk = config_.head_dim_qk, dv = config_.head_dim_v;
  const char* k_src = static_cast<const char*>(k);
  const char* v_src = static_cast<const char*>(v);
  int64_t src_token = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    Sequence& s = *seqs[size_t(i)];
    const int64_t n = num_tokens[i];
    if (n == 0) continue;
    if (s.length % ps != 0) {
      const int64_t logical = s.length / ps;
      int32_t& slot = logical < int64_t(s.sink.size())
                          ? s.sink[size_t(logical)]
                          : s.recent[size_t(logical - s.recent_first)];
      if (refcount_[size_t(slot)] > 1) {
        const int32_t fresh = take_free_page();
        if (on_device) page_copies.emplace_back(slot, fresh);
        else copy_page(slot, fresh);
        unref(slot);
        slot = fresh;
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = s.length + t;
      const int64_t logical = pos / ps, off = pos % ps;
      if (off == 0) {
        const int32_t fresh = take_free_page();
        if (logical < sp) {
          s.sink.push_back(fresh);
        } else {
          if (s.recent.empty()) s.recent_first = logical;
          s.recent.push_back(fresh);
        }
      }
      const int32_t page = s.page(logical);
      if (on_device) {
        // Tokens of one page are consecutive slots: extend the last run.
        if (off > 0 && t > 0 && !runs.empty() && runs.back().page == page)
          ++runs.back().count;
        else
          runs.push_back(DeviceRun{src_token + t, page, int32_t(off), 1});
        continue;
      }
      char* kp = k_base_ + size_t(page) * k_page_bytes_;
      char* vp = v_base_ + size_t(page) * v_page_bytes_;
      for (int64_t h = 0; h < hkv; ++h) {
        std::memcpy(kp + size_t(config_.slot_offset(off, h, dqk)) * es,
                    k_src + size_t((t * hkv + h) * dqk) * es, size_t(dqk) * es);
        std::memcpy(vp + size_t(config_.slot_offset(off, h, dv)) * es,
                    v_src + size_t((t * hkv + h) * dv) * es, size_t(dv) * es);
      }
    }
    k_src += size_t(n * hkv * dqk) * es;
    v_src += size_t(n * hkv * dv) * es;
    src_token += n;
    s.length += n;
  }
  generation_ = next_generation();
#if ATTN_HAVE_CUDA
  if (on_device) {
    for (const DeviceRun& r : runs) device_runs.push_back({r.src_token, r.page, r.slot, r.count});
    cuda::kv_append_enqueue(device_, config_, k_base_, v_base_, page_copies, device_runs, k, v,
                            stream);
  }
#else
  (void)stream;
#endif
}

Sequence KvCache::prefix_of(const Sequence& parent, int64_t parent_id, int64_t num_tokens,
                           const char* arg) const {
  const int64_t ps = config_.page_size;
  const int64_t sp = config_.sink_pages();
  Sequence child;
  child.length = num_tokens;
  const int64_t pages = (num_tokens + ps - 1) / ps;
  // The child needs at least what its next token will see (the pages from
  // `required` on, as an append would evict), and takes below that the
  // pages the parent still holds: its own last tokens see into them, as
  // the parent's last tokens do, so that decoding them works on the child
  // wherever it works on the parent. The parent's held pages are one run.
  const int64_t below = config_.window > 0 ? num_tokens - config_.window + 1 : 0;
  const int64_t required = std::max(sp, std::max<int64_t>(0, below) / ps);
  int64_t first_recent = required;
  while (first_recent > sp && parent.page(first_recent - 1) >= 0) --first_recent;
  child.recent_first = first_recent;
  for (int64_t l = 0; l < pages; ++l) {
    if (l >= sp && l < first_recent) continue;
    const int32_t p = parent.page(l);
    if (p < 0)
      invalid_argument(arg, ": the visible tokens at positions ", l * ps, "..",
                       std::min(num_tokens, (l + 1) * ps) - 1, " were already evicted from ",
                       "sequence ", parent_id);
    (l < sp ? child.sink : child.recent).push_back(p);
  }
  return child;
}

void KvCache::fork(int64_t parent_id, int64_t child_id, int64_t num_tokens) {
  const Sequence& parent = sequence(parent_id, "parent_id");
  if (child_id < 0) invalid_argument("child_id must be >= 0, got ", child_id);
  if (sequences_.count(child_id))
    invalid_argument("child_id: a sequence with id ", child_id, " is already live");
  if (num_tokens < 0 || num_tokens > parent.length)
    invalid_argument("num_tokens must be in 0..", parent.length, " (the parent's length), got ",
                     num_tokens);
  Sequence child = prefix_of(parent, parent_id, num_tokens, "num_tokens");
  // Insert first: it is the only step that can fail (allocation).
  const Sequence& added = sequences_.emplace(child_id, std::move(child)).first->second;
  for (int32_t p : added.sink) ++refcount_[size_t(p)];
  for (int32_t p : added.recent) ++refcount_[size_t(p)];
  generation_ = next_generation();
}

void KvCache::truncate(int64_t id, int64_t num_tokens) {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    invalid_argument("seq_id: no live sequence with id ", id, " in this cache");
  Sequence& s = it->second;
  if (num_tokens < 0 || num_tokens > s.length)
    invalid_argument("num_tokens must be in 0..", s.length, " (the sequence's length), got ",
                     num_tokens);
  // Built before anything changes: the only step that can fail. A page the
  // sequence keeps is counted again before the old counts drop, so it
  // never looks free; the partly filled last page, if another sequence
  // shares it, is copied by the next append (as after a fork).
  Sequence kept = prefix_of(s, id, num_tokens, "num_tokens");
  for (int32_t p : kept.sink) ++refcount_[size_t(p)];
  for (int32_t p : kept.recent) ++refcount_[size_t(p)];
  for (int32_t p : s.sink) unref(p);
  for (int32_t p : s.recent) unref(p);
  s = std::move(kept);
  generation_ = next_generation();
}

void KvCache::release(int64_t id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    invalid_argument("seq_id: no live sequence with id ", id,
                     " in this cache (never added, or released already)");
  for (int32_t p : it->second.sink) unref(p);
  for (int32_t p : it->second.recent) unref(p);
  sequences_.erase(it);
  generation_ = next_generation();
}

}  // namespace attn::kv
