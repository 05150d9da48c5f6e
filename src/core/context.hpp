// What a context fixes: the backend (resolved, never AUTO), the device and
// the CPU thread count. Plans copy it.
#pragma once

#include <attn/attn.h>

#include <cstdint>

namespace attn {

struct ContextConfig {
  attn_backend_t backend = ATTN_BACKEND_CPU;
  int32_t device = 0;
  int32_t num_threads = 1;
};

// Resolves AUTO and the thread count; throws attn::Error when the backend is
// unavailable. Defined in src/api/context.cpp.
ContextConfig make_context_config(attn_backend_t backend, int32_t device, int32_t num_threads);

}  // namespace attn
