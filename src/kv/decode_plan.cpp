#include "kv/decode_plan.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "attn_config.h"
#include "core/checked.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/sized_struct.hpp"
#include "core/workspace.hpp"
#if ATTN_HAVE_CUDA
#include "cuda/decode_cuda.hpp"
#endif

namespace attn::kv {
namespace {

// Auto split: no chunk shorter than this many tokens, since each chunk adds
// a partial state to write and merge.
constexpr int64_t kMinAutoChunkTokens = 256;
// Auto split on CUDA: the start of a block (Q, the first page entries, the
// pipeline's fill) costs about as long as streaming this many keys (an
// estimate); it keeps the split from preferring two waves of short chunks
// over one wave of chunks twice as long.
constexpr int64_t kBlockStartTokens = 128;

// For a >= 0, b > 0. Limits such as max_kv_tokens and kv_chunk_tokens
// reach INT64_MAX, where a + b - 1 would overflow.
int64_t ceil_div(int64_t a, int64_t b) { return ceil_div_nonneg(a, b); }

// CUDA: the prepare that last wrote each device workspace's metadata, by
// any plan (base address -> its stamp). A plan's own record cannot tell
// that another plan has prepared the same buffer since, and its kernels
// would then read that plan's tables through this plan's offsets. Never
// destroyed: plans may outlive static destruction.
struct LastPrepares {
  std::mutex mutex;
  std::unordered_map<uintptr_t, uint64_t> stamp;
};
LastPrepares& last_prepares() {
  static LastPrepares* const last = new LastPrepares;
  return *last;
}

}  // namespace

DecodeConfig validate_decode_config(const attn_decode_config_t* config, const CacheConfig& cache) {
  if (config == nullptr) invalid_argument("config is NULL");
  // The first layout ends with softcap; later fields default to zero for
  // callers built against an older header (see validate_config).
  constexpr size_t first_size = offsetof(attn_decode_config_t, softcap) + sizeof(float);
  if (config->struct_size < first_size)
    invalid_argument("config->struct_size (", config->struct_size,
                     ") is too small: set it to sizeof(attn_decode_config_t)");
  attn_decode_config_t c{};
  require_known_tail(config, config->struct_size, sizeof c, "config");
  std::memcpy(&c, config, std::min<size_t>(size_t(config->struct_size), sizeof c));
  // As a plan's heads (attn_plan_desc_set_shape); also keeps the packed
  // rows, max_query_tokens x group, far from int64 overflow.
  if (c.heads_q < 1 || c.heads_q > kMaxShapeCount)
    invalid_argument("config->heads_q must be in 1..2^31-1, got ", c.heads_q);
  if (c.heads_q % cache.heads_kv != 0)
    invalid_argument("config->heads_q (", c.heads_q, ") must be a multiple of the cache's heads_kv (",
                     cache.heads_kv, ")");
  if (c.max_batch < 1 || c.max_batch > (int64_t(1) << 24))
    invalid_argument("config->max_batch must be in 1..2^24, got ", c.max_batch);
  if (c.max_query_tokens < 1 || c.max_query_tokens > (int64_t(1) << 24))
    invalid_argument("config->max_query_tokens must be in 1..2^24, got ", c.max_query_tokens);
  if (c.max_kv_tokens < 0)
    invalid_argument("config->max_kv_tokens must be >= 0 (0: from the cache), got ",
                     c.max_kv_tokens);
  if (c.kv_chunk_tokens < -1)
    invalid_argument("config->kv_chunk_tokens must be -1 (never split), 0 (auto) or > 0, got ",
                     c.kv_chunk_tokens);
  if (!(std::isfinite(c.softmax_scale) && c.softmax_scale >= 0.0f))
    invalid_argument("config->softmax_scale must be finite and > 0 (or 0 for the default), got ",
                     c.softmax_scale);
  if (!(std::isfinite(c.softcap) && c.softcap >= 0.0f && c.softcap <= kMaxSoftcap))
    invalid_argument("config->softcap must be finite, >= 0 (0 disables it) and at most ",
                     kMaxSoftcap, ", got ", c.softcap);
  DecodeConfig d;
  d.heads_q = c.heads_q;
  d.max_batch = c.max_batch;
  d.max_query_tokens = c.max_query_tokens;
  d.kv_chunk_tokens = c.kv_chunk_tokens;
  d.scale = c.softmax_scale > 0.0f ? c.softmax_scale
                                   : float(1.0 / std::sqrt(double(cache.head_dim_qk)));
  d.softcap = c.softcap;
  const int64_t capacity = cache.num_pages * cache.page_size;
  int64_t limit = capacity;
  if (cache.window > 0)
    limit = std::min(capacity, cache.sink_tokens + cache.window + c.max_query_tokens - 1);
  d.max_kv_tokens = c.max_kv_tokens == 0 ? limit : c.max_kv_tokens;
  // The workspace holds max_batch page lists of this length.
  const double entries = double(c.max_batch) * double(ceil_div(d.max_kv_tokens, cache.page_size) + 2);
  if (entries > 1.0e10)
    invalid_argument("config->max_kv_tokens: ", d.max_kv_tokens, " keys",
                     c.max_kv_tokens == 0 ? " (the default: what the cache can hold)" : "",
                     " for each of ", c.max_batch, " sequences: more than 1e10 page entries ",
                     "in all (max_batch x (max_kv_tokens / page_size + 2)); set a smaller ",
                     "max_kv_tokens or max_batch");
  return d;
}

// Drops this plan's claims on workspaces that no other plan has prepared
// since (the map would otherwise grow with every buffer ever prepared).
DecodePlan::~DecodePlan() {
  std::lock_guard<std::mutex> lock(prepared_mutex_);
  if (prepared_.empty()) return;
  LastPrepares& last = last_prepares();
  std::lock_guard<std::mutex> lock_last(last.mutex);
  for (const auto& [base, rec] : prepared_) {
    auto it = last.stamp.find(base);
    if (it != last.stamp.end() && it->second == rec.stamp) last.stamp.erase(it);
  }
}

DecodePlan::DecodePlan(const ContextConfig& ctx, const CacheConfig& cache, const DecodeConfig& cfg)
    : ctx_(ctx), cache_(cache), cfg_(cfg), id_(next_generation()) {
  on_device_ = ctx.backend != ATTN_BACKEND_CPU;
  bool device_balanced_requested = false;
#if ATTN_HAVE_CUDA
  if (on_device_) {
    // Every tuning hook first, so that a malformed one fails the plan
    // before any device state (the kernels' shared memory limit) changes.
    device_stages_ = cuda::decode_pipeline_stages();
    const int32_t requested = cuda::decode_kernel_requested();
    // The balanced split only replaces the automatic one.
    device_balanced_requested = cuda::decode_split_balanced() && cfg_.kv_chunk_tokens == 0;
    const bool pdl_requested = cuda::decode_pdl_requested();
    device_kernel_ = cuda::decode_check_supported(ctx.device, cache_, cfg_.heads_q,
                                                  cfg_.max_query_tokens, device_stages_, requested,
                                                  device_balanced_requested);
    device_wave_ = cuda::decode_resident_blocks(ctx.device, cache_, device_stages_, device_kernel_,
                                                device_balanced_requested);
    device_pdl_ = cuda::decode_use_pdl(ctx.device, pdl_requested, cache_);
  }
#else
  if (on_device_) not_supported("ctx: this build of libattn has no CUDA backend");
#endif
  threads_ = on_device_ ? 1 : std::max<int32_t>(1, ctx.num_threads);
  const int64_t ps = cache_.page_size;
  // A page straddling each end of the window, plus the sink pages' tail.
  max_entries_per_seq_ = ceil_div(cfg_.max_kv_tokens, ps) + 2;
  const int64_t units_per_seq_forced =
      cfg_.kv_chunk_tokens > 0 ? ceil_div(max_entries_per_seq_, ceil_div(cfg_.kv_chunk_tokens, ps))
                               : 1;
  if (cfg_.kv_chunk_tokens > 0) {
    max_units_ = cfg_.max_batch * units_per_seq_forced;
    max_partials_ = units_per_seq_forced > 1 ? max_units_ : 0;
  } else if (cfg_.kv_chunk_tokens == 0 && on_device_ && device_balanced_requested) {
    // Balanced: a wave of B = W / (heads_kv * row tiles) blocks per (KV
    // head, row tile), whose runs of pages cut at most B - 1 sequences, so
    // at most batch + B - 1 units.
    const int64_t row_tiles = ceil_div(cfg_.max_query_tokens * group(), 16);
    device_blocks_ = std::max<int64_t>(1, device_wave_ / (cache_.heads_kv * row_tiles));
    max_units_ = cfg_.max_batch + device_blocks_;
    max_partials_ = max_units_;
  } else if (cfg_.kv_chunk_tokens == 0 && on_device_) {
    // Auto cuts each sequence into at most c chunks, c <= 2 W / (batch *
    // heads_kv * row tiles) (W: the wave), so that a split batch has at
    // most 2 W / heads_kv units.
    const int64_t split_units = std::max<int64_t>(1, 2 * device_wave_ / cache_.heads_kv);
    max_units_ = std::max(cfg_.max_batch, split_units);
    max_partials_ = split_units;
  } else if (cfg_.kv_chunk_tokens == 0 && threads_ > 1) {
    // Auto splits only when batch * heads_kv < threads, into at most
    // ceil(2 threads / (batch * heads_kv)) chunks per sequence: fewer than
    // 2 threads + batch < 3 threads units in all.
    max_units_ = std::max<int64_t>(cfg_.max_batch, 3 * int64_t(threads_));
    max_partials_ = 3 * int64_t(threads_);
  } else {
    max_units_ = cfg_.max_batch;
    max_partials_ = 0;
  }
  if (on_device_) {
    // The CUDA grids at their largest (under graph capture every execute
    // launches them so): the decode kernel's x is (block slot, KV head)
    // flattened, at most 2^31 - 1; the combine's y the query heads, at most
    // 65535. Refused here rather than by a launch at execute.
    const int64_t slots = device_grid_blocks();
    if (slots > int64_t(INT32_MAX) / cache_.heads_kv)
      not_supported("config: ", slots, " work units (max_batch ", cfg_.max_batch,
                    ", kv_chunk_tokens ", cfg_.kv_chunk_tokens, ") x ", cache_.heads_kv,
                    " KV heads exceed the CUDA decode grid's 2^31 - 1 blocks; use a larger ",
                    "kv_chunk_tokens or a smaller max_batch");
    if (max_partials_ > 0 && cfg_.heads_q > 65535)
      not_supported("config->heads_q: the CUDA combine kernel of a plan that may split takes ",
                    "at most 65535 query heads, got ", cfg_.heads_q,
                    " (kv_chunk_tokens -1 never splits)");
  }

  // The workspace in double first: limits whose sizes do not fit are
  // refused here instead of wrapping in the size_t arithmetic below.
  {
    const double rows = double(cfg_.max_query_tokens) * double(group());
    const double q_rows = double(cfg_.max_query_tokens) * double(cfg_.heads_q);
    const double dqk = double(cache_.head_dim_qk), dv = double(cache_.head_dim_v);
    const double scratch_floats =
        rows * (dqk + double(ps) + dv + 2.0) + double(ps) * (dqk + dv) + dqk + 8.0 * 16.0;
    const double bytes =
        double(threads_) * scratch_floats * 4.0 +
        double(max_partials_) * q_rows * (dv + 1.0) * 4.0 +
        double(cfg_.max_batch) * (double(sizeof(SeqMeta)) +
                                  double(max_entries_per_seq_) * double(sizeof(PageEntry))) +
        double(max_units_) * double(sizeof(WorkUnit)) +
        double(device_grid_blocks() + 1) * 4.0 + 16.0 * double(kWorkspaceAlign);
    if (!(bytes <= double(int64_t(1) << 62)))
      invalid_argument("config: a workspace of ", bytes, " bytes for max_batch ", cfg_.max_batch,
                       ", max_query_tokens ", cfg_.max_query_tokens, ", heads_q ", cfg_.heads_q,
                       " and max_kv_tokens ", cfg_.max_kv_tokens, " is too large");
  }

  const size_t a = kWorkspaceAlign / sizeof(float);
  auto carve = [&](size_t& cursor, size_t floats) {
    const size_t off = cursor;
    cursor += align_up(floats, a);
    return off;
  };
  const size_t rows = size_t(cfg_.max_query_tokens * group());
  const size_t dqk = size_t(cache_.head_dim_qk), dv = size_t(cache_.head_dim_v);
  size_t c = 0;
  scratch_.q = carve(c, rows * dqk);
  scratch_.k = carve(c, size_t(ps) * dqk);
  scratch_.krow = carve(c, dqk);
  scratch_.v = carve(c, size_t(ps) * dv);
  scratch_.s = carve(c, rows * size_t(ps));
  scratch_.acc = carve(c, rows * dv);
  scratch_.m = carve(c, rows);
  scratch_.l = carve(c, rows);
  scratch_.floats = c;

  const size_t q_rows = size_t(cfg_.max_query_tokens * cfg_.heads_q);
  WorkspaceLayout w;
  off_header_ = w.add(sizeof(PreparedHeader));
  off_seqs_ = w.add(size_t(cfg_.max_batch) * sizeof(SeqMeta));
  off_entries_ = w.add(size_t(cfg_.max_batch * max_entries_per_seq_) * sizeof(PageEntry));
  off_units_ = w.add(size_t(max_units_) * sizeof(WorkUnit));
  off_block_units_ = w.add(device_balanced() ? size_t(device_grid_blocks() + 1) * sizeof(int32_t) : 0);
  off_partial_o_ = w.add(size_t(max_partials_) * q_rows * dv * sizeof(float));
  off_partial_lse_ = w.add(size_t(max_partials_) * q_rows * sizeof(float));
  off_scratch_ = w.add(on_device_ ? 0 : size_t(threads_) * scratch_.floats * sizeof(float));
  total_bytes_ = w.total_bytes();
#if ATTN_HAVE_CUDA
  if (on_device_) {
    // The metadata part of the workspace, staged on the host. The pinned
    // block is page-aligned, so the workspace's offsets apply to it as is.
    auto* st = new cuda::DecodeStaging(ctx.device, off_partial_o_);
    staging_ = std::shared_ptr<void>(st, [](void* q) { delete static_cast<cuda::DecodeStaging*>(q); });
  }
#endif
}

DecodeWorkspace DecodePlan::carve(void* workspace) const {
  char* base = workspace_base(workspace);
  DecodeWorkspace ws;
  ws.header = reinterpret_cast<PreparedHeader*>(base + off_header_);
  ws.seqs = reinterpret_cast<SeqMeta*>(base + off_seqs_);
  ws.entries = reinterpret_cast<PageEntry*>(base + off_entries_);
  ws.units = reinterpret_cast<WorkUnit*>(base + off_units_);
  ws.block_units = device_balanced() ? reinterpret_cast<int32_t*>(base + off_block_units_) : nullptr;
  ws.partial_o = reinterpret_cast<float*>(base + off_partial_o_);
  ws.partial_lse = reinterpret_cast<float*>(base + off_partial_lse_);
  ws.scratch = reinterpret_cast<float*>(base + off_scratch_);
  return ws;
}

void DecodePlan::check_cache(const KvCache& cache) const {
  if (!(cache.config() == cache_))
    invalid_argument("cache: configured differently from the cache the plan was made for ",
                     "(dtype, layout, page size, pages, heads, head dims, window and sinks ",
                     "must all match)");
  if (cache.backend() != ctx_.backend)
    invalid_argument("cache: lives on another backend than the plan");
}

static void check_workspace(size_t needed, const void* workspace, size_t bytes) {
  if (bytes < needed)
    fail(ATTN_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes: ", bytes,
         " bytes given, the plan needs ", needed);
  if (needed > 0 && workspace == nullptr) invalid_argument("workspace is NULL");
}

void DecodePlan::prepare(const KvCache& cache, int32_t num_seqs, const int64_t* ids,
                         const int32_t* query_lens, void* workspace, size_t workspace_bytes,
                         attn_decode_step_info_t* info, void* stream) const {
  check_cache(cache);
  if (num_seqs < 1 || num_seqs > cfg_.max_batch)
    invalid_argument("num_seqs must be in 1..", cfg_.max_batch, " (the plan's max_batch), got ",
                     num_seqs);
  if (ids == nullptr) invalid_argument("seq_ids is NULL");
  if (query_lens == nullptr) invalid_argument("query_lens is NULL");
  const size_t min_info = offsetof(attn_decode_step_info_t, num_work_units);  // and total_q
  if (info != nullptr && info->struct_size < min_info)
    invalid_argument("info->struct_size (", info->struct_size,
                     ") is too small: set it to sizeof(attn_decode_step_info_t)");
  check_workspace(total_bytes_, workspace, workspace_bytes);

  // Everything is built in host vectors first and copied at the end, so that
  // a failure leaves the workspace untouched.
  const int64_t ps = cache_.page_size, w = cache_.window, sinks = cache_.sink_tokens;
  std::vector<SeqMeta> seqs(static_cast<size_t>(num_seqs));
  std::vector<PageEntry> entries;
  std::vector<int64_t> entry_begin(static_cast<size_t>(num_seqs) + 1, 0);
  int64_t total_q = 0, tokens_read = 0;  // tokens: the kernel reads whole (filled) pages
  uint64_t pairs = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const Sequence& s = cache.sequence(ids[i], "seq_ids");
    const int64_t ql = query_lens[i];
    if (ql < 1 || ql > cfg_.max_query_tokens)
      invalid_argument("query_lens[", i, "] must be in 1..", cfg_.max_query_tokens,
                       " (the plan's max_query_tokens), got ", ql);
    if (ql > s.length)
      invalid_argument("query_lens[", i, "]: ", ql, " query tokens but sequence ", ids[i],
                       " holds only ", s.length, " tokens (append the new tokens first)");
    const int64_t n = s.length;
    // Keys the queries see: the window [lo, n) and the sinks below lo.
    const int64_t lo = w > 0 ? std::max<int64_t>(0, n - ql - w + 1) : 0;
    const int64_t sink_end = std::min(sinks, lo);
    const int64_t keys = (n - lo) + sink_end;
    const int64_t sink_pages = ceil_div(sink_end, ps);
    const int64_t first = std::max(sink_pages, lo / ps), last = (n - 1) / ps;
    auto add = [&](int64_t l) {
      const int32_t p = s.page(l);
      if (p < 0)
        invalid_argument("query_lens[", i, "]: the queries of sequence ", ids[i],
                         " see keys at positions ", std::max(l * ps, lo), "..",
                         std::min(n, (l + 1) * ps) - 1,
                         ", which the rolling window already evicted (more query tokens than ",
                         "the sequence's last append, or its parent's last one before a fork, ",
                         "reach behind the window)");
      entries.push_back(PageEntry{l, p});
    };
    for (int64_t l = 0; l < sink_pages; ++l) add(l);
    for (int64_t l = first; l <= last; ++l) add(l);
    // (After the eviction check: with the default max_kv_tokens, keys can
    // only exceed it where some were evicted, the cause to name.)
    if (keys > cfg_.max_kv_tokens)
      invalid_argument("query_lens[", i, "]: the queries of sequence ", ids[i], " see ", keys,
                       " keys, more than the plan's max_kv_tokens (", cfg_.max_kv_tokens, ")");
    entry_begin[size_t(i) + 1] = int64_t(entries.size());
    for (int64_t e = entry_begin[size_t(i)]; e < entry_begin[size_t(i) + 1]; ++e)
      tokens_read += std::min(ps, n - entries[size_t(e)].logical * ps);
    seqs[size_t(i)] = SeqMeta{total_q, ql, n, 0, 0};
    total_q += ql;
    // Visible pairs: query t at position n - ql + t sees its window (and the
    // sinks below it).
    for (int64_t t = 0; t < ql; ++t) {
      const int64_t p = n - ql + t;
      const int64_t wlo = w > 0 ? std::max<int64_t>(0, p - w + 1) : 0;
      pairs = sat_add(pairs, sat_mul(uint64_t((p - wlo + 1) + std::min(sinks, wlo)),
                                     uint64_t(cfg_.heads_q)));
    }
  }

  // The split.
  int64_t chunk_pages = 0;  // 0: one unit per sequence
  int64_t max_entries = 0;
  for (int32_t i = 0; i < num_seqs; ++i)
    max_entries = std::max(max_entries, entry_begin[size_t(i) + 1] - entry_begin[size_t(i)]);
  if (cfg_.kv_chunk_tokens > 0) {
    chunk_pages = ceil_div(cfg_.kv_chunk_tokens, ps);
  } else if (cfg_.kv_chunk_tokens == 0 && on_device_) {
    chunk_pages = device_chunk_pages(num_seqs, query_lens, entry_begin);
  } else if (cfg_.kv_chunk_tokens == 0 && threads_ > 1) {
    const int64_t items = int64_t(num_seqs) * cache_.heads_kv;
    if (items < threads_) {
      const int64_t target = ceil_div(2 * int64_t(threads_), items);
      chunk_pages = std::max(ceil_div(max_entries, target), ceil_div(kMinAutoChunkTokens, ps));
    }
  }
  // The partial-state slots of a split sequence's chunks are consecutive
  // (the CUDA combine finds them from the first one's).
  std::vector<WorkUnit> units;
  std::vector<int32_t> block_units;  // balanced split only
  if (device_balanced() && chunk_pages > 0) {
    // Where the waves' policy would split, the balanced one cuts instead.
    balanced_units(num_seqs, entry_begin, units, block_units, chunk_pages);
  } else {
    for (int32_t i = 0; i < num_seqs; ++i) {
      const int64_t b = entry_begin[size_t(i)], e = entry_begin[size_t(i) + 1];
      const int64_t chunks = chunk_pages > 0 ? std::max<int64_t>(1, ceil_div(e - b, chunk_pages)) : 1;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t cb = chunks == 1 ? b : b + c * chunk_pages;
        const int64_t ce = chunks == 1 ? e : std::min(e, cb + chunk_pages);
        units.push_back(WorkUnit{i, cb, ce, -1});
      }
    }
    if (device_balanced()) {  // one unit per block, as many blocks as units
      block_units.resize(size_t(device_grid_blocks()) + 1);
      for (size_t b = 0; b < block_units.size(); ++b)
        block_units[b] = int32_t(std::min(b, units.size()));
    }
  }
  int64_t partials = 0, split_seqs = 0, max_chunks = 1;
  for (size_t k = 0; k < units.size();) {
    const int64_t i = units[k].seq;
    size_t end = k;
    while (end < units.size() && units[end].seq == i) ++end;
    const int64_t chunks = int64_t(end - k);
    seqs[size_t(i)].first_unit = int64_t(k);
    seqs[size_t(i)].num_units = chunks;
    max_chunks = std::max(max_chunks, chunks);
    if (chunks > 1) {
      ++split_seqs;
      for (size_t c = k; c < end; ++c) units[c].partial = partials++;
    }
    k = end;
  }
  if (int64_t(units.size()) > max_units_ || partials > max_partials_ ||
      int64_t(entries.size()) > cfg_.max_batch * max_entries_per_seq_)
    fail(ATTN_STATUS_INTERNAL_ERROR, "decode prepare: ", units.size(), " units, ", partials,
         " partial states or ", entries.size(), " page entries exceed the workspace's room (",
         max_units_, ", ", max_partials_, ", ", cfg_.max_batch * max_entries_per_seq_, ")");

  // Commit: into the workspace, or on a device into the staging area and
  // from there to the workspace on the stream.
  std::unique_lock<std::mutex> staging_lock(prepared_mutex_, std::defer_lock);
  char* target = static_cast<char*>(workspace);
#if ATTN_HAVE_CUDA
  auto* staging = static_cast<cuda::DecodeStaging*>(staging_.get());
  if (on_device_) {
    staging_lock.lock();
    target = staging->acquire();
  }
#else
  (void)stream;
#endif
  DecodeWorkspace ws = carve(target);
  std::memcpy(ws.seqs, seqs.data(), seqs.size() * sizeof(SeqMeta));
  if (!entries.empty()) std::memcpy(ws.entries, entries.data(), entries.size() * sizeof(PageEntry));
  std::memcpy(ws.units, units.data(), units.size() * sizeof(WorkUnit));
  if (!block_units.empty())
    std::memcpy(ws.block_units, block_units.data(), block_units.size() * sizeof(int32_t));
  PreparedHeader h;
  h.magic = kPreparedMagic;
  h.plan_id = id_;
  h.cache_id = uint64_t(reinterpret_cast<uintptr_t>(&cache));
  h.generation = cache.generation();
  h.batch = num_seqs;
  h.total_q = total_q;
  h.num_units = int64_t(units.size());
  h.chunk_pages = split_seqs > 0 ? chunk_pages : 0;
  std::memcpy(ws.header, &h, sizeof h);
#if ATTN_HAVE_CUDA
  if (on_device_) {
    const std::vector<std::pair<size_t, size_t>> pieces = {
        {off_header_, sizeof h},
        {off_seqs_, seqs.size() * sizeof(SeqMeta)},
        {off_entries_, entries.size() * sizeof(PageEntry)},
        {off_units_, units.size() * sizeof(WorkUnit)},
        {off_block_units_, block_units.size() * sizeof(int32_t)}};
    char* base = workspace_base(workspace);
    prepared_.erase(uintptr_t(base));  // stale until the upload is enqueued
    // Claimed before the upload: if it fails, no plan's record matches.
    const uint64_t stamp = next_generation();
    {
      LastPrepares& last = last_prepares();
      std::lock_guard<std::mutex> lock(last.mutex);
      last.stamp[uintptr_t(base)] = stamp;
    }
    staging->upload(base, pieces, stream);
    // Blocks holding work: the units, or with the balanced split the
    // blocks up to the last with a unit.
    int64_t launch_blocks = int64_t(units.size());
    if (device_balanced()) {
      launch_blocks = 0;
      for (size_t b = 0; b + 1 < block_units.size(); ++b)
        if (block_units[b] < block_units[b + 1]) launch_blocks = int64_t(b) + 1;
    }
    prepared_[uintptr_t(base)] = Prepared{uintptr_t(&cache), cache.generation(),
                                          std::max<int64_t>(launch_blocks, 1), split_seqs > 0,
                                          stamp};
  }
#endif

  if (info != nullptr) {
    attn_decode_step_info_t full;
    std::memset(&full, 0, sizeof full);
    full.struct_size = info->struct_size;
    full.total_q = total_q;
    full.num_work_units = int64_t(units.size());
    full.split_sequences = split_seqs;
    full.max_chunks = max_chunks;
    full.kv_chunk_tokens = split_seqs > 0 ? chunk_pages * ps : 0;
    full.visible_pairs = pairs;
    full.kv_bytes_read = double(tokens_read) * double(cache_.bytes_per_token());
    const size_t n = std::min<size_t>(size_t(info->struct_size), sizeof full);
    std::memcpy(info, &full, n);
  }
}

// The automatic split on CUDA. A block runs one (unit, KV head, row tile)
// task and W blocks run at once. Cutting every sequence into at most c
// chunks of ceil(P / c) pages (P: the longest sequence's pages) takes about
// ceil(tasks(c) / W) waves, each as long as one chunk plus a block's start;
// c runs from 1 (no split) to the most chunks that keep tasks within two
// waves and chunks at least kMinAutoChunkTokens long, and the cheapest
// wins (the fewest chunks among equals).
int64_t DecodePlan::device_chunk_pages(int32_t num_seqs, const int32_t* query_lens,
                                       const std::vector<int64_t>& entry_begin) const {
  const int64_t ps = cache_.page_size, wave = std::max<int64_t>(1, device_wave_);
  int64_t max_entries = 0, max_q = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    max_entries = std::max(max_entries, entry_begin[size_t(i) + 1] - entry_begin[size_t(i)]);
    max_q = std::max<int64_t>(max_q, query_lens[i]);
  }
  const int64_t tasks_per_unit = cache_.heads_kv * ceil_div(max_q * group(), 16);
  const int64_t items = int64_t(num_seqs) * tasks_per_unit;
  // The sm_90 kernels (bulk and tensor copies) keep enough bytes in flight
  // per block that half a wave of blocks already streams at the device's
  // bandwidth: splitting then only adds partial states and the combine (32
  // x 8K on an H200, 256 tasks, bulk copies: 4.03 TB/s unsplit against 3.82
  // in 3 chunks).
#if ATTN_HAVE_CUDA
  if (device_kernel_ != cuda::kDecodeKernelSm80 && 2 * items >= wave) return 0;
#endif
  const int64_t max_chunks = std::min(2 * wave / items, max_entries / ceil_div(kMinAutoChunkTokens, ps));
  int64_t best_pages = 0;
  double best_cost = double(ceil_div(items, wave)) * double(max_entries * ps + kBlockStartTokens);
  for (int64_t c = 2; c <= max_chunks; ++c) {
    const int64_t pages = ceil_div(max_entries, c);
    int64_t units = 0;
    for (int32_t i = 0; i < num_seqs; ++i)
      units += std::max<int64_t>(1, ceil_div(entry_begin[size_t(i) + 1] - entry_begin[size_t(i)], pages));
    const double cost =
        double(ceil_div(units * tasks_per_unit, wave)) * double(pages * ps + kBlockStartTokens);
    if (cost < best_cost) {
      best_cost = cost;
      best_pages = pages;
    }
  }
  return best_pages;
}

// The balanced split. The batch's page lists, back to back, are cut into
// runs of R = ceil(P / B) pages (P pages in all, B = device_blocks_ blocks
// per KV head and row tile; R at least kMinAutoChunkTokens), block b taking
// run b: every block streams about the same pages, whatever the lengths,
// where whole chunks per block leave the second wave part empty (at 32 x
// 8K on an H200 768 tasks fill 1.94 waves of 396). A run that crosses a
// sequence's end becomes two units (pieces), so a block may run several,
// one after the other; a sequence cut into pieces has them merged by the
// combine kernel. run_pages receives R.
void DecodePlan::balanced_units(int32_t num_seqs, const std::vector<int64_t>& entry_begin,
                                std::vector<WorkUnit>& units, std::vector<int32_t>& block_units,
                                int64_t& run_pages) const {
  const int64_t total = entry_begin[size_t(num_seqs)];
  const int64_t run = std::max(ceil_div(total, device_blocks_),
                               ceil_div(kMinAutoChunkTokens, cache_.page_size));
  units.clear();
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int64_t e = entry_begin[size_t(i) + 1];
    for (int64_t c = entry_begin[size_t(i)]; c < e;) {
      const int64_t end = std::min(e, (c / run + 1) * run);
      units.push_back(WorkUnit{i, c, end, -1});
      c = end;
    }
  }
  // Units are in page order, so block b's are those whose first page lies
  // in run b.
  block_units.assign(size_t(device_grid_blocks()) + 1, int32_t(units.size()));
  size_t u = 0;
  for (size_t b = 0; b < block_units.size(); ++b) {
    while (u < units.size() && units[u].entry_begin < int64_t(b) * run) ++u;
    block_units[b] = int32_t(u);
  }
  run_pages = run;
}

void DecodePlan::execute(const KvCache& cache, const void* q, void* o, float* lse,
                         void* workspace, size_t workspace_bytes, void* stream) const {
  check_cache(cache);
  if (q == nullptr) invalid_argument("q is NULL");
  if (o == nullptr) invalid_argument("o is NULL");
  check_workspace(total_bytes_, workspace, workspace_bytes);
  if (on_device_) {
    execute_device(cache, q, o, lse, workspace, stream);
    return;
  }
  (void)stream;
  DecodeWorkspace ws = carve(workspace);
  PreparedHeader h;
  std::memcpy(&h, ws.header, sizeof h);
  if (h.magic != kPreparedMagic || h.plan_id != id_)
    invalid_argument("workspace: not prepared by attn_decode_prepare with this plan");
  if (h.cache_id != uint64_t(reinterpret_cast<uintptr_t>(&cache)))
    invalid_argument("cache: the workspace was prepared for another cache");
  if (h.generation != cache.generation())
    invalid_argument("workspace: prepared before the cache last changed (append, add, fork or ",
                     "release); call attn_decode_prepare again");
  cpu::decode_execute(*this, cache, ws, q, o, lse);
}

void DecodePlan::execute_device(const KvCache& cache, const void* q, void* o, float* lse,
                                void* workspace, void* stream) const {
  // The kernels copy Q in 16-byte pieces (cp.async, and bulk copies on
  // sm_90), O and LSE element by element: a misaligned Q would fault the
  // device context instead of failing this call.
  if (reinterpret_cast<uintptr_t>(q) % 16 != 0)
    invalid_argument("q: the CUDA decode kernels need a 16-byte aligned device pointer, got ", q);
  if (reinterpret_cast<uintptr_t>(o) % dtype_size(cache_.dtype) != 0)
    invalid_argument("o: the device pointer must be aligned to its element, got ", o);
  if (lse != nullptr && reinterpret_cast<uintptr_t>(lse) % alignof(float) != 0)
    invalid_argument("lse: the device pointer must be 4-byte aligned, got ", lse);
  char* base = workspace_base(workspace);
  Prepared rec{};
  {
    std::lock_guard<std::mutex> lock(prepared_mutex_);
    auto it = prepared_.find(uintptr_t(base));
    if (it == prepared_.end())
      invalid_argument("workspace: not prepared by attn_decode_prepare with this plan");
    rec = it->second;
  }
  {
    LastPrepares& last = last_prepares();
    std::lock_guard<std::mutex> lock(last.mutex);
    auto it = last.stamp.find(uintptr_t(base));
    if (it == last.stamp.end() || it->second != rec.stamp)
      invalid_argument("workspace: prepared by attn_decode_prepare with another plan since this ",
                       "plan prepared it; call attn_decode_prepare again with this plan");
  }
  if (rec.cache_id != uintptr_t(&cache))
    invalid_argument("cache: the workspace was prepared for another cache");
  if (rec.generation != cache.generation())
    invalid_argument("workspace: prepared before the cache last changed (append, add, fork or ",
                     "release); call attn_decode_prepare again");
#if ATTN_HAVE_CUDA
  // Under stream capture the grid and the combine are the plan's largest,
  // so that the graph serves every later prepare (its metadata is read from
  // the workspace at replay); outside it, exactly the prepared batch's.
  if (cuda::stream_is_capturing(device(), stream))
    cuda::decode_launch(*this, cache, carve(workspace), device_grid_blocks(), q, o, lse,
                        max_partials_ > 0, stream);
  else
    cuda::decode_launch(*this, cache, carve(workspace), rec.launch_blocks, q, o, lse, rec.split,
                        stream);
#else
  (void)q, (void)o, (void)lse, (void)stream;
#endif
}

void DecodePlan::describe(attn_decode_plan_info_t& info) const {
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  info.backend = ctx_.backend;
  info.dtype = cache_.dtype;
  info.heads_q = cfg_.heads_q;
  info.heads_kv = cache_.heads_kv;
  info.max_batch = cfg_.max_batch;
  info.max_query_tokens = cfg_.max_query_tokens;
  info.max_kv_tokens = cfg_.max_kv_tokens;
  info.kv_chunk_tokens = cfg_.kv_chunk_tokens;
  info.num_threads = threads_;
  info.workspace_bytes = total_bytes_;
  std::snprintf(info.algorithm, sizeof info.algorithm, "%s%s",
                max_partials_ > 0 ? "paged-decode-gqa-packed-split-kv" : "paged-decode-gqa-packed",
                device_balanced() ? "-balanced" : "");
  // CUDA: the variant, then "-s3" for the three-stage pipeline and "-pdl"
  // for the combine's programmatic dependent launch (where the plan can
  // split at all: without partial states the combine never runs).
  const char* kernel = "cpu-scalar";
#if ATTN_HAVE_CUDA
  if (on_device_)
    kernel = device_kernel_ == cuda::kDecodeKernelSm90Tensor ? "cuda-sm90-tensor-paged"
             : device_kernel_ == cuda::kDecodeKernelSm90Bulk ? "cuda-sm90-bulk-paged"
             : device_kernel_ == cuda::kDecodeKernelSm90Bulk32 ? "cuda-sm90-bulk32-paged"
                                                              : "cuda-sm80-mma-paged";
#endif
  std::snprintf(info.kernel, sizeof info.kernel, "%s%s%s", kernel,
                on_device_ && device_stages_ == 3 ? "-s3" : "", device_pdl_ && max_partials_ > 0 ? "-pdl" : "");
  if (cfg_.kv_chunk_tokens == 0 && (on_device_ || threads_ > 1)) {
    info.split_target_tasks = on_device_ ? device_wave_ : threads_;
    info.split_min_chunk_tokens = kMinAutoChunkTokens;
  }
}

}  // namespace attn::kv
