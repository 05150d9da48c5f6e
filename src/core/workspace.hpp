// Workspace carving: a plan computes the layout of its scratch once (offsets
// of aligned regions); an execution turns the caller's pointer into region
// pointers. The size includes slack so that any base address works.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attn {

constexpr size_t kWorkspaceAlign = 64;  // a cache line, and a full AVX-512 vector

inline size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

class WorkspaceLayout {
 public:
  // Reserves `bytes` and returns the region's offset from the aligned base.
  size_t add(size_t bytes) {
    size_t off = size_;
    size_ = align_up(size_ + bytes, kWorkspaceAlign);
    return off;
  }
  // Bytes the caller must provide (0 when nothing was reserved).
  size_t total_bytes() const { return size_ == 0 ? 0 : size_ + kWorkspaceAlign - 1; }
  size_t used_bytes() const { return size_; }

 private:
  size_t size_ = 0;
};

// The aligned base inside the caller's workspace.
inline char* workspace_base(void* workspace) {
  auto p = reinterpret_cast<uintptr_t>(workspace);
  return reinterpret_cast<char*>(align_up(p, kWorkspaceAlign));
}

}  // namespace attn
