// Workspace carving: a plan computes the layout of its scratch once (offsets
// of aligned regions); an execution turns the caller's pointer into region
// pointers. The size includes slack so that any base address works.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/checked.hpp"

namespace attn {

constexpr size_t kWorkspaceAlign = 64;  // a cache line, and a full AVX-512 vector

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Sizes saturate (core/checked.hpp): a region whose size overflowed, or a
// sum past 64 bits, leaves total_bytes() at kSaturated, beyond kMaxBytes,
// which the plan then refuses; the offsets are meaningless only then.
class WorkspaceLayout {
 public:
  // Reserves `bytes` and returns the region's offset from the aligned base.
  size_t add(uint64_t bytes) {
    size_t off = size_t(size_);
    size_ = sat_align_up(sat_add(size_, bytes), kWorkspaceAlign);
    return off;
  }
  // Bytes the caller must provide (0 when nothing was reserved).
  size_t total_bytes() const {
    return size_ == 0 ? 0 : size_t(sat_add(size_, kWorkspaceAlign - 1));
  }
  size_t used_bytes() const { return size_t(size_); }

 private:
  uint64_t size_ = 0;
};

// The aligned base inside the caller's workspace.
inline char* workspace_base(void* workspace) {
  auto p = reinterpret_cast<uintptr_t>(workspace);
  return reinterpret_cast<char*>(align_up(p, kWorkspaceAlign));
}

}  // namespace attn
