// The C boundary of the streaming KV cache and the decode plans: handle and
// argument checks, exceptions turned into a status and the thread-local
// message, as in api.cpp.

#include <attn/attn.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "api/guarded.hpp"
#include "api/handles.hpp"
#include "core/error.hpp"
#include "kv/decode_plan.hpp"
#include "kv/kv_cache.hpp"

struct attn_kv_cache {
  std::unique_ptr<attn::kv::KvCache> cache;
};
struct attn_decode_plan {
  std::unique_ptr<attn::kv::DecodePlan> plan;
};

using attn::checked;
using attn::destroy_handle;
using attn::guarded;
using attn::invalid_argument;
using attn::require_out;

namespace {

// Registers h and hands it out only when both the allocation and the
// registration worked.
template <class T>
void publish(std::unique_ptr<T> h, T** out) {
  attn::register_handle(h.get(), attn::kind_of<T>());
  *out = h.release();
}

attn::kv::KvCache& cache_of(attn_kv_cache_t cache) { return *checked(cache, "cache").cache; }

// Copies the first struct_size bytes of `full` into *out, keeping the
// caller's struct_size, which must cover at least the first field after it
// (first_end: where that field ends), as for every size-tagged output.
template <class Info>
void copy_sized(const Info& full, Info* out, size_t first_end, const char* arg) {
  require_out(out, arg);
  if (out->struct_size < first_end)
    invalid_argument(arg, "->struct_size (", out->struct_size,
                     ") is too small: set it to the sizeof of the struct");
  attn::copy_sized_prefix(full, out);
}

}  // namespace

extern "C" {

attn_status_t attn_kv_cache_memory_size(const attn_kv_cache_config_t* config, size_t* bytes) {
  return guarded([&] {
    const attn::kv::CacheConfig c = attn::kv::validate_config(config);
    require_out(bytes, "bytes");
    *bytes = attn::kv::pool_layout(c).total;
  });
}

attn_status_t attn_kv_cache_create(attn_context_t ctx, const attn_kv_cache_config_t* config,
                                   void* memory, size_t memory_bytes, attn_kv_cache_t* cache) {
  return guarded([&] {
    const attn_context& c = checked(ctx, "ctx");
    const attn::kv::CacheConfig cfg = attn::kv::validate_config(config);
    require_out(cache, "cache");
    auto h = std::make_unique<attn_kv_cache>();
    h->cache = std::make_unique<attn::kv::KvCache>(c.config, cfg, memory, memory_bytes);
    publish(std::move(h), cache);
  });
}

attn_status_t attn_kv_cache_destroy(attn_kv_cache_t cache) {
  return guarded([&] { destroy_handle(cache, "cache"); });
}

attn_status_t attn_kv_cache_add_sequence(attn_kv_cache_t cache, int64_t seq_id) {
  return guarded([&] { cache_of(cache).add_sequence(seq_id); });
}

attn_status_t attn_kv_cache_append(attn_kv_cache_t cache, int32_t num_seqs, const int64_t* seq_ids,
                                   const int32_t* num_tokens, const void* k, const void* v,
                                   void* stream) {
  return guarded([&] {
    cache_of(cache).append(num_seqs, seq_ids, num_tokens, k, v, stream);
  });
}

attn_status_t attn_kv_cache_fork(attn_kv_cache_t cache, int64_t parent_id, int64_t child_id,
                                 int64_t num_tokens) {
  return guarded([&] { cache_of(cache).fork(parent_id, child_id, num_tokens); });
}

attn_status_t attn_kv_cache_truncate(attn_kv_cache_t cache, int64_t seq_id, int64_t num_tokens) {
  return guarded([&] { cache_of(cache).truncate(seq_id, num_tokens); });
}

attn_status_t attn_kv_cache_release(attn_kv_cache_t cache, int64_t seq_id) {
  return guarded([&] { cache_of(cache).release(seq_id); });
}

attn_status_t attn_kv_cache_sequence_length(attn_kv_cache_t cache, int64_t seq_id,
                                            int64_t* length) {
  return guarded([&] {
    const attn::kv::KvCache& c = cache_of(cache);
    require_out(length, "length");
    *length = c.sequence(seq_id, "seq_id").length;
  });
}

attn_status_t attn_kv_cache_get_info(attn_kv_cache_t cache, attn_kv_cache_info_t* info) {
  return guarded([&] {
    const attn::kv::KvCache& c = cache_of(cache);
    attn_kv_cache_info_t full;
    std::memset(&full, 0, sizeof full);
    full.struct_size = sizeof full;
    full.num_pages = c.config().num_pages;
    full.pages_in_use = c.pages_in_use();
    full.num_sequences = c.num_sequences();
    full.page_size = c.config().page_size;
    full.bytes_per_token = c.config().bytes_per_token();
    full.memory_bytes = c.memory_bytes();
    full.owns_memory = c.owns_memory() ? 1 : 0;
    copy_sized(full, info, offsetof(attn_kv_cache_info_t, pages_in_use), "info");
  });
}

attn_status_t attn_decode_plan_create(attn_context_t ctx, attn_kv_cache_t cache,
                                      const attn_decode_config_t* config,
                                      attn_decode_plan_t* plan) {
  return guarded([&] {
    const attn_context& c = checked(ctx, "ctx");
    const attn::kv::KvCache& kc = cache_of(cache);
    const attn::kv::DecodeConfig cfg = attn::kv::validate_decode_config(config, kc.config());
    require_out(plan, "plan");
    if (kc.backend() != c.config.backend)
      invalid_argument("cache: lives on another backend than ctx (a plan runs where its cache is)");
    auto h = std::make_unique<attn_decode_plan>();
    h->plan = std::make_unique<attn::kv::DecodePlan>(c.config, kc.config(), cfg);
    publish(std::move(h), plan);
  });
}

attn_status_t attn_decode_plan_destroy(attn_decode_plan_t plan) {
  return guarded([&] { destroy_handle(plan, "plan"); });
}

attn_status_t attn_decode_plan_workspace_size(attn_decode_plan_t plan, size_t* bytes) {
  return guarded([&] {
    const attn::kv::DecodePlan& p = *checked(plan, "plan").plan;
    require_out(bytes, "bytes");
    *bytes = p.workspace_bytes();
  });
}

attn_status_t attn_decode_prepare(attn_decode_plan_t plan, attn_kv_cache_t cache,
                                  int32_t num_seqs, const int64_t* seq_ids,
                                  const int32_t* query_lens, void* workspace,
                                  size_t workspace_bytes, attn_decode_step_info_t* info,
                                  void* stream) {
  return guarded([&] {
    const attn::kv::DecodePlan& p = *checked(plan, "plan").plan;
    const attn::kv::KvCache& c = cache_of(cache);
    p.prepare(c, num_seqs, seq_ids, query_lens, workspace, workspace_bytes, info, stream);
  });
}

attn_status_t attn_decode_execute(attn_decode_plan_t plan, attn_kv_cache_t cache, const void* q,
                                  void* o, float* lse, void* workspace, size_t workspace_bytes,
                                  void* stream) {
  return guarded([&] {
    const attn::kv::DecodePlan& p = *checked(plan, "plan").plan;
    const attn::kv::KvCache& c = cache_of(cache);
    p.execute(c, q, o, lse, workspace, workspace_bytes, stream);
  });
}

attn_status_t attn_decode_plan_describe(attn_decode_plan_t plan, attn_decode_plan_info_t* info) {
  return guarded([&] {
    const attn::kv::DecodePlan& p = *checked(plan, "plan").plan;
    attn_decode_plan_info_t full;
    p.describe(full);
    copy_sized(full, info, offsetof(attn_decode_plan_info_t, dtype), "info");
  });
}

}  // extern "C"
