// The interface a backend implements for one validated problem. A backend
// plan is immutable after construction; execute functions may run
// concurrently with distinct workspaces.
#pragma once

#include <attn/attn.h>

#include <cstddef>
#include <cstdint>

namespace attn {

struct ForwardArgs {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // may be null
  void* workspace;
  void* stream;
};

struct BackwardArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const float* lse;
  const void* d_o;
  void* dq;
  void* dk;
  void* dv;
  void* workspace;
  void* stream;
};

class BackendPlan {
 public:
  virtual ~BackendPlan() = default;
  virtual size_t workspace_bytes(attn_pass_t pass) const = 0;
  virtual void forward(const ForwardArgs& args) const = 0;
  virtual void backward(const BackwardArgs& args) const = 0;
  virtual int32_t tile_q() const = 0;
  virtual int32_t tile_kv() const = 0;
  virtual int32_t num_threads() const = 0;
  virtual const char* algorithm() const = 0;
  virtual const char* kernel() const = 0;
};

}  // namespace attn
