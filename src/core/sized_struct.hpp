// Size-tagged input structs (attn_kv_cache_config_t, attn_decode_config_t)
// from callers built against another version of attn.h: an older, smaller
// struct gets the appended fields' defaults (zero); a newer, larger one may
// only have zeros past what this library knows, else it asks for something
// this library cannot do and is refused rather than silently ignored.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/error.hpp"

namespace attn {

// Largest struct_size accepted: far above any layout, so that a garbage
// size is refused before bytes past the caller's struct are read.
constexpr uint64_t kMaxStructSize = 4096;

// s points at a struct of struct_size bytes of which this library knows
// `known`; `what` names it in messages ("config").
inline void require_known_tail(const void* s, uint64_t struct_size, size_t known,
                               const char* what) {
  if (struct_size <= known) return;
  if (struct_size > kMaxStructSize)
    invalid_argument(what, "->struct_size (", struct_size, ") is implausibly large (this library's ",
                     "struct has ", known, " bytes)");
  const auto* bytes = static_cast<const unsigned char*>(s);
  for (uint64_t i = known; i < struct_size; ++i)
    if (bytes[i] != 0)
      invalid_argument(what, ": byte ", i, " is set, past the ", known,
                       " bytes of the struct this library knows (a field of a newer attn.h ",
                       "it cannot honour; leave such fields zero)");
}

}  // namespace attn
