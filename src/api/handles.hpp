// Handle objects behind the opaque public types, and a registry of live
// handles so that a NULL, foreign or destroyed handle is reported as
// INVALID_HANDLE instead of being dereferenced.
#pragma once

#include <attn/attn.h>

#include <memory>
#include <optional>

#include "core/context.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "plan/plan.hpp"
#include "schedule/block_mask.hpp"

struct attn_context {
  attn::ContextConfig config;
};
struct attn_tensor_desc {
  attn::TensorDesc desc;
};
struct attn_plan_desc {
  attn::PlanDesc desc;
};
struct attn_plan {
  std::unique_ptr<attn::Plan> plan;
};
struct attn_block_mask {
  std::optional<attn::BlockMask> mask;  // set by attn_block_mask_create
};

namespace attn {

enum class HandleKind { context, tensor_desc, plan_desc, plan, block_mask, kv_cache, decode_plan, comm };

void register_handle(const void* h, HandleKind kind);
// Returns false if h was not registered as `kind`.
bool unregister_handle(const void* h, HandleKind kind);
bool handle_is_live(const void* h, HandleKind kind);

template <class T> constexpr HandleKind kind_of();
template <> constexpr HandleKind kind_of<attn_context>() { return HandleKind::context; }
template <> constexpr HandleKind kind_of<attn_tensor_desc>() { return HandleKind::tensor_desc; }
template <> constexpr HandleKind kind_of<attn_plan_desc>() { return HandleKind::plan_desc; }
template <> constexpr HandleKind kind_of<attn_plan>() { return HandleKind::plan; }
template <> constexpr HandleKind kind_of<attn_block_mask>() { return HandleKind::block_mask; }
// (Their handle structs are defined in src/api/kv_api.cpp.)
template <> constexpr HandleKind kind_of<attn_kv_cache>() { return HandleKind::kv_cache; }
template <> constexpr HandleKind kind_of<attn_decode_plan>() { return HandleKind::decode_plan; }
// attn_comm is defined with the ring API (src/api/ring_api.cpp).
template <> constexpr HandleKind kind_of<attn_comm>() { return HandleKind::comm; }

const char* kind_name(HandleKind kind);

// Throws INVALID_HANDLE naming `arg` unless h is a live handle of its type.
template <class T>
T& checked(T* h, const char* arg) {
  if (h == nullptr) fail(ATTN_STATUS_INVALID_HANDLE, arg, " is NULL");
  if (!handle_is_live(h, kind_of<T>()))
    fail(ATTN_STATUS_INVALID_HANDLE, arg, " is not a live ", kind_name(kind_of<T>()),
         " (destroyed, or a handle of another kind)");
  return *h;
}

}  // namespace attn
