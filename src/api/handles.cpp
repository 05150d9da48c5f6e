#include "api/handles.hpp"

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

namespace attn {
namespace {

struct Registry {
  std::shared_mutex mutex;
  std::unordered_map<const void*, HandleKind> live;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: handles may outlive static teardown
  return *r;
}

}  // namespace

void register_handle(const void* h, HandleKind kind) {
  Registry& r = registry();
  std::unique_lock lock(r.mutex);
  r.live[h] = kind;
}

bool unregister_handle(const void* h, HandleKind kind) {
  Registry& r = registry();
  std::unique_lock lock(r.mutex);
  auto it = r.live.find(h);
  if (it == r.live.end() || it->second != kind) return false;
  r.live.erase(it);
  return true;
}

bool handle_is_live(const void* h, HandleKind kind) {
  Registry& r = registry();
  std::shared_lock lock(r.mutex);
  auto it = r.live.find(h);
  return it != r.live.end() && it->second == kind;
}

const char* kind_name(HandleKind kind) {
  switch (kind) {
    case HandleKind::context: return "attn_context_t";
    case HandleKind::tensor_desc: return "attn_tensor_desc_t";
    case HandleKind::plan_desc: return "attn_plan_desc_t";
    case HandleKind::plan: return "attn_plan_t";
    case HandleKind::block_mask: return "attn_block_mask_t";
    case HandleKind::kv_cache: return "attn_kv_cache_t";
    case HandleKind::decode_plan: return "attn_decode_plan_t";
    case HandleKind::comm: return "attn_comm_t";
  }
  return "handle";
}

}  // namespace attn
