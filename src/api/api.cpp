// The C boundary: argument checks, handle checks, and every exception turned
// into a status plus the thread-local message. Nothing below this file sees a
// raw public handle; nothing above it sees an exception.

#include <attn/attn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "api/guarded.hpp"
#include "api/handles.hpp"
#include "core/checked.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "plan/merge.hpp"
#include "plan/plan.hpp"

using attn::checked;
using attn::create_handle;
using attn::destroy_handle;
using attn::guarded;
using attn::invalid_argument;
using attn::require_out;

namespace {

const char* mask_name(attn_mask_t m) {
  switch (m) {
    case ATTN_MASK_NONE: return "none";
    case ATTN_MASK_CAUSAL: return "causal";
    case ATTN_MASK_WINDOW: return "window";
  }
  return "?";
}

const char* backend_name(int32_t b) {
  switch (b) {
    case ATTN_BACKEND_CPU: return "cpu";
    case ATTN_BACKEND_CUDA: return "cuda";
    case ATTN_BACKEND_AUTO: return "auto";
  }
  return "?";
}

void check_workspace(size_t needed, const void* workspace, size_t bytes) {
  if (bytes < needed)
    attn::fail(ATTN_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes: ", bytes,
               " bytes given, the plan needs ", needed);
  if (needed > 0 && workspace == nullptr) invalid_argument("workspace is NULL");
}

}  // namespace

extern "C" {

uint32_t attn_version_number(void) { return ATTN_VERSION_NUMBER; }

const char* attn_version_string(void) {
#define ATTN_STR2(x) #x
#define ATTN_STR(x) ATTN_STR2(x)
  return ATTN_STR(ATTN_VERSION_MAJOR) "." ATTN_STR(ATTN_VERSION_MINOR) "." ATTN_STR(
      ATTN_VERSION_PATCH);
#undef ATTN_STR
#undef ATTN_STR2
}

const char* attn_status_string(attn_status_t status) {
  switch (status) {
    case ATTN_STATUS_SUCCESS: return "ATTN_STATUS_SUCCESS";
    case ATTN_STATUS_INVALID_ARGUMENT: return "ATTN_STATUS_INVALID_ARGUMENT";
    case ATTN_STATUS_INVALID_HANDLE: return "ATTN_STATUS_INVALID_HANDLE";
    case ATTN_STATUS_NOT_SUPPORTED: return "ATTN_STATUS_NOT_SUPPORTED";
    case ATTN_STATUS_WORKSPACE_TOO_SMALL: return "ATTN_STATUS_WORKSPACE_TOO_SMALL";
    case ATTN_STATUS_OUT_OF_MEMORY: return "ATTN_STATUS_OUT_OF_MEMORY";
    case ATTN_STATUS_BACKEND_UNAVAILABLE: return "ATTN_STATUS_BACKEND_UNAVAILABLE";
    case ATTN_STATUS_BACKEND_ERROR: return "ATTN_STATUS_BACKEND_ERROR";
    case ATTN_STATUS_CAPACITY: return "ATTN_STATUS_CAPACITY";
    case ATTN_STATUS_COMMUNICATION_ERROR: return "ATTN_STATUS_COMMUNICATION_ERROR";
    case ATTN_STATUS_INTERNAL_ERROR: return "ATTN_STATUS_INTERNAL_ERROR";
  }
  return "ATTN_STATUS_UNKNOWN";
}

const char* attn_last_error_message(void) { return attn::last_error(); }

// --- context -----------------------------------------------------------------

attn_status_t attn_context_create(attn_backend_t backend, int32_t device, int32_t num_threads,
                                  attn_context_t* ctx) {
  return guarded([&] {
    require_out(ctx, "ctx");
    attn::ContextConfig cfg = attn::make_context_config(backend, device, num_threads);
    attn_context_t h = nullptr;
    create_handle(&h);
    h->config = cfg;
    *ctx = h;
  });
}

attn_status_t attn_context_destroy(attn_context_t ctx) {
  return guarded([&] { destroy_handle(ctx, "ctx"); });
}

attn_status_t attn_context_get_backend(attn_context_t ctx, attn_backend_t* backend) {
  return guarded([&] {
    const attn_context& c = checked(ctx, "ctx");
    require_out(backend, "backend");
    *backend = c.config.backend;
  });
}

attn_status_t attn_context_get_num_threads(attn_context_t ctx, int32_t* num_threads) {
  return guarded([&] {
    const attn_context& c = checked(ctx, "ctx");
    require_out(num_threads, "num_threads");
    *num_threads = c.config.num_threads;
  });
}

// --- tensor descriptors --------------------------------------------------------

attn_status_t attn_tensor_desc_create(attn_tensor_desc_t* desc) {
  return guarded([&] {
    require_out(desc, "desc");
    create_handle(desc);
  });
}

attn_status_t attn_tensor_desc_destroy(attn_tensor_desc_t desc) {
  return guarded([&] { destroy_handle(desc, "desc"); });
}

attn_status_t attn_tensor_desc_set(attn_tensor_desc_t desc, attn_dtype_t dtype, int32_t ndim,
                                   const int64_t* dims, const int64_t* strides) {
  return guarded([&] {
    attn_tensor_desc& t = checked(desc, "desc");
    if (!attn::dtype_is_valid(dtype)) invalid_argument("dtype: unknown value ", int(dtype));
    if (ndim < 1 || ndim > ATTN_MAX_DIMS)
      invalid_argument("ndim: ", ndim, " is outside 1..", ATTN_MAX_DIMS);
    require_out(dims, "dims");
    attn::TensorDesc d;
    d.dtype = dtype;
    d.ndim = ndim;
    for (int32_t i = 0; i < ndim; ++i) {
      if (dims[i] < 0) invalid_argument("dims[", i, "] is negative (", dims[i], ")");
      d.dims[i] = dims[i];
    }
    // Element offsets (index x stride summed over the dims) are int64 and
    // become byte offsets: both the count and the reach stay within
    // kMaxTensorElements. A dim of 0 counts as 1 here, since the default
    // strides still multiply the others.
    uint64_t count = 1;
    for (int32_t i = 0; i < ndim; ++i)
      count = attn::sat_mul(count, uint64_t(std::max<int64_t>(dims[i], 1)));
    if (count > uint64_t(attn::kMaxTensorElements))
      invalid_argument("dims: ", attn::dims_string(ndim, dims), " hold more than 2^60 elements");
    if (strides == nullptr) {
      attn::contiguous_strides(ndim, d.dims.data(), d.strides.data());
    } else {
      uint64_t reach = 0;  // the last element's offset; no element when a dim is 0
      bool empty = false;
      for (int32_t i = 0; i < ndim; ++i) {
        if (strides[i] < 0) invalid_argument("strides[", i, "] is negative (", strides[i], ")");
        d.strides[i] = strides[i];
        empty = empty || dims[i] == 0;
        if (dims[i] > 0)
          reach = attn::sat_add(reach, attn::sat_mul(uint64_t(dims[i] - 1), uint64_t(strides[i])));
      }
      if (!empty && reach >= uint64_t(attn::kMaxTensorElements))
        invalid_argument("strides: ", attn::dims_string(ndim, strides), " over dims ",
                         attn::dims_string(ndim, dims),
                         " reach an element 2^60 or more elements past the first");
    }
    t.desc = d;
  });
}

attn_status_t attn_tensor_desc_get(attn_tensor_desc_t desc, attn_dtype_t* dtype, int32_t* ndim,
                                   int64_t* dims, int64_t* strides) {
  return guarded([&] {
    const attn_tensor_desc& t = checked(desc, "desc");
    require_out(dtype, "dtype");
    require_out(ndim, "ndim");
    *dtype = t.desc.dtype;
    *ndim = t.desc.ndim;
    for (int32_t i = 0; i < t.desc.ndim; ++i) {
      if (dims) dims[i] = t.desc.dims[i];
      if (strides) strides[i] = t.desc.strides[i];
    }
  });
}

// --- plan descriptors ----------------------------------------------------------

attn_status_t attn_plan_desc_create(attn_plan_desc_t* desc) {
  return guarded([&] {
    require_out(desc, "desc");
    create_handle(desc);
  });
}

attn_status_t attn_plan_desc_destroy(attn_plan_desc_t desc) {
  return guarded([&] { destroy_handle(desc, "desc"); });
}

attn_status_t attn_plan_desc_set_shape(attn_plan_desc_t desc, int64_t batch, int64_t heads_q,
                                       int64_t heads_kv, int64_t seqlen_q, int64_t seqlen_kv,
                                       int64_t head_dim_qk, int64_t head_dim_v) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    constexpr int64_t max = attn::kMaxShapeCount;
    if (batch < 1 || batch > max) invalid_argument("batch must be in 1..2^31-1, got ", batch);
    if (heads_q < 1 || heads_q > max)
      invalid_argument("heads_q must be in 1..2^31-1, got ", heads_q);
    if (heads_kv < 1 || heads_kv > max)
      invalid_argument("heads_kv must be in 1..2^31-1, got ", heads_kv);
    if (seqlen_q < 0 || seqlen_q > max)
      invalid_argument("seqlen_q must be in 0..2^31-1, got ", seqlen_q);
    if (seqlen_kv < 0 || seqlen_kv > max)
      invalid_argument("seqlen_kv must be in 0..2^31-1, got ", seqlen_kv);
    if (head_dim_qk < 1 || head_dim_qk > 1024)
      invalid_argument("head_dim_qk must be in 1..1024, got ", head_dim_qk);
    if (head_dim_v < 1 || head_dim_v > 1024)
      invalid_argument("head_dim_v must be in 1..1024, got ", head_dim_v);
    // Offsets are int64 throughout, but element counts must stay far from overflow.
    const double elems = double(batch) * double(std::max(heads_q, heads_kv)) *
                         double(std::max(seqlen_q, seqlen_kv)) *
                         double(std::max(head_dim_qk, head_dim_v));
    if (elems > 9.0e15) invalid_argument("shape: tensors of ", elems, " elements are too large");
    d.batch = batch, d.heads_q = heads_q, d.heads_kv = heads_kv;
    d.seqlen_q = seqlen_q, d.seqlen_kv = seqlen_kv;
    d.head_dim_qk = head_dim_qk, d.head_dim_v = head_dim_v;
  });
}

attn_status_t attn_plan_desc_set_dtype(attn_plan_desc_t desc, attn_dtype_t dtype) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (!attn::dtype_is_valid(dtype)) invalid_argument("dtype: unknown value ", int(dtype));
    d.dtype = dtype;
  });
}

attn_status_t attn_plan_desc_set_layout(attn_plan_desc_t desc, attn_layout_t layout) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (layout != ATTN_LAYOUT_BSHD && layout != ATTN_LAYOUT_BHSD && layout != ATTN_LAYOUT_THD)
      invalid_argument("layout: unknown value ", int(layout));
    d.layout = layout;
    d.layout_set = true;
  });
}

attn_status_t attn_plan_desc_set_tensor(attn_plan_desc_t desc, attn_tensor_role_t role,
                                        attn_tensor_desc_t tensor) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (int(role) < 0 || int(role) > int(ATTN_TENSOR_DV))
      invalid_argument("role: unknown value ", int(role));
    if (tensor == nullptr) {
      d.tensors[role].reset();
      return;
    }
    const attn_tensor_desc& t = checked(tensor, "tensor");
    if (t.desc.ndim == 0) invalid_argument("tensor: its dims were never set (attn_tensor_desc_set)");
    d.tensors[role] = t.desc;
  });
}

attn_status_t attn_plan_desc_set_softmax_scale(attn_plan_desc_t desc, float scale) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (!std::isfinite(scale) || scale <= 0.0f)
      invalid_argument("scale must be finite and > 0, got ", scale);
    d.scale = scale;
  });
}

attn_status_t attn_plan_desc_set_softcap(attn_plan_desc_t desc, float cap) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (!std::isfinite(cap) || cap < 0.0f || cap > attn::kMaxSoftcap)
      invalid_argument("cap must be finite, >= 0 (0 disables it) and at most ", attn::kMaxSoftcap,
                       ", got ", cap);
    d.softcap = cap;
  });
}

attn_status_t attn_plan_desc_set_mask(attn_plan_desc_t desc, attn_mask_t mask, int64_t window_left,
                                      int64_t window_right) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (mask != ATTN_MASK_NONE && mask != ATTN_MASK_CAUSAL && mask != ATTN_MASK_WINDOW)
      invalid_argument("mask: unknown value ", int(mask));
    if (mask != ATTN_MASK_WINDOW && (window_left != -1 || window_right != -1))
      invalid_argument("window_left/window_right must be -1 for mask ", mask_name(mask), " (got ",
                       window_left, ", ", window_right, ")");
    if (window_left < -1) invalid_argument("window_left must be >= -1, got ", window_left);
    if (window_right < -1) invalid_argument("window_right must be >= -1, got ", window_right);
    d.mask = mask;
    d.window_left = window_left;
    d.window_right = window_right;
  });
}

attn_status_t attn_plan_desc_set_varlen(attn_plan_desc_t desc, int64_t batch,
                                        const int32_t* cu_seqlens_q,
                                        const int32_t* cu_seqlens_kv) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (cu_seqlens_q == nullptr && cu_seqlens_kv == nullptr) {
      d.varlen = false;
      d.cu_q.clear();
      d.cu_kv.clear();
      return;
    }
    require_out(cu_seqlens_q, "cu_seqlens_q");
    require_out(cu_seqlens_kv, "cu_seqlens_kv");
    // Checked before the offsets are copied: batch + 1 of them are read.
    if (batch < 1 || batch > attn::kMaxShapeCount)
      invalid_argument("batch must be in 1..2^31-1, got ", batch);
    std::vector<int64_t> q(size_t(batch) + 1), kv(size_t(batch) + 1);
    const int32_t* arrays[2] = {cu_seqlens_q, cu_seqlens_kv};
    const char* names[2] = {"cu_seqlens_q", "cu_seqlens_kv"};
    std::vector<int64_t>* outs[2] = {&q, &kv};
    for (int a = 0; a < 2; ++a) {
      if (arrays[a][0] != 0) invalid_argument(names[a], "[0] must be 0, got ", arrays[a][0]);
      for (int64_t b = 0; b <= batch; ++b) {
        if (b > 0 && arrays[a][b] < arrays[a][b - 1])
          invalid_argument(names[a], " must be non-decreasing, but [", b, "] = ", arrays[a][b],
                           " < [", b - 1, "] = ", arrays[a][b - 1]);
        (*outs[a])[size_t(b)] = arrays[a][b];
      }
    }
    d.varlen = true;
    d.varlen_batch = batch;
    d.cu_q = std::move(q);
    d.cu_kv = std::move(kv);
  });
}

attn_status_t attn_plan_desc_set_allow_empty_rows(attn_plan_desc_t desc, int32_t allow) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (allow != 0 && allow != 1) invalid_argument("allow must be 0 or 1, got ", allow);
    d.allow_empty_rows = allow == 1;
  });
}

attn_status_t attn_plan_desc_set_passes(attn_plan_desc_t desc, attn_passes_t passes) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (passes != ATTN_PASSES_FORWARD && passes != ATTN_PASSES_FORWARD_BACKWARD)
      invalid_argument("passes: unknown value ", int(passes));
    d.passes = passes;
  });
}

attn_status_t attn_plan_desc_set_deterministic(attn_plan_desc_t desc, int32_t deterministic) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (deterministic != 0 && deterministic != 1)
      invalid_argument("deterministic must be 0 or 1, got ", deterministic);
    d.deterministic = deterministic == 1;
  });
}

// --- plans -----------------------------------------------------------------------

attn_status_t attn_plan_create(attn_context_t ctx, attn_plan_desc_t desc, attn_plan_t* plan) {
  return guarded([&] {
    const attn_context& c = checked(ctx, "ctx");
    const attn_plan_desc& d = checked(desc, "desc");
    require_out(plan, "plan");
    auto built = attn::create_plan(c.config, d.desc);
    attn_plan_t h = nullptr;
    create_handle(&h);
    h->plan = std::move(built);
    *plan = h;
  });
}

attn_status_t attn_plan_destroy(attn_plan_t plan) {
  return guarded([&] { destroy_handle(plan, "plan"); });
}

attn_status_t attn_plan_workspace_size(attn_plan_t plan, attn_pass_t pass, size_t* bytes) {
  return guarded([&] {
    const attn::Plan& p = *checked(plan, "plan").plan;
    require_out(bytes, "bytes");
    if (pass != ATTN_PASS_FORWARD && pass != ATTN_PASS_BACKWARD)
      invalid_argument("pass: unknown value ", int(pass));
    if (pass == ATTN_PASS_BACKWARD && !p.problem.backward)
      attn::not_supported("pass BACKWARD: the plan was created for the forward pass only ",
                          "(attn_plan_desc_set_passes(ATTN_PASSES_FORWARD_BACKWARD))");
    *bytes = p.impl->workspace_bytes(pass);
  });
}

attn_status_t attn_plan_describe(attn_plan_t plan, attn_plan_info_t* info) {
  return guarded([&] {
    const attn::Plan& p = *checked(plan, "plan").plan;
    require_out(info, "info");
    attn::require_struct_size(info, offsetof(attn_plan_info_t, dtype), "attn_plan_info_t");
    attn_plan_info_t full;
    p.describe(full);
    attn::copy_sized_prefix(full, info);
  });
}

attn_status_t attn_plan_summary(attn_plan_t plan, char* buf, size_t capacity, size_t* needed) {
  return guarded([&] {
    const attn::Plan& p = *checked(plan, "plan").plan;
    if (buf == nullptr && capacity > 0) invalid_argument("buf is NULL but capacity is ", capacity);
    attn_plan_info_t info;
    p.describe(info);
    const attn::Problem& pr = p.problem;
    char window[64] = "";
    if (pr.mask == ATTN_MASK_WINDOW)
      std::snprintf(window, sizeof window, "(%lld,%lld)", (long long)pr.window.left,
                    (long long)pr.window.right);
    char line[512];
    int n = std::snprintf(
        line, sizeof line,
        "backend=%s kernel=%s algorithm=%s dtype=%s batch=%lld%s heads=%lld/%lld "
        "seqlen=%lld/%lld head_dim=%lld/%lld mask=%s%s softcap=%g scale=%g tiles=%dx%d "
        "threads=%d workspace=%llu/%llu pairs=%llu gflop=%.3f/%.3f",
        backend_name(info.backend), info.kernel, info.algorithm,
        attn::dtype_name(attn_dtype_t(info.dtype)), (long long)pr.batch,
        pr.varlen ? "(varlen)" : "", (long long)pr.heads_q, (long long)pr.heads_kv,
        (long long)pr.seqlen_q, (long long)pr.seqlen_kv, (long long)pr.head_dim_qk,
        (long long)pr.head_dim_v, mask_name(pr.mask), window, double(pr.softcap),
        double(pr.scale), info.tile_q, info.tile_kv, info.num_threads,
        (unsigned long long)info.workspace_bytes_forward,
        (unsigned long long)info.workspace_bytes_backward,
        (unsigned long long)info.visible_pairs, info.flops_forward * 1e-9,
        info.flops_backward * 1e-9);
    if (n < 0) attn::fail(ATTN_STATUS_INTERNAL_ERROR, "summary formatting failed");
    if (needed) *needed = size_t(n) + 1;
    if (capacity > 0) std::snprintf(buf, capacity, "%s", line);
  });
}

// --- execution -----------------------------------------------------------------

attn_status_t attn_forward(attn_plan_t plan, const void* q, const void* k, const void* v, void* o,
                           float* lse, void* workspace, size_t workspace_bytes, void* stream) {
  return guarded([&] {
    const attn::Plan& p = *checked(plan, "plan").plan;
    const attn::Problem& pr = p.problem;
    if (pr.total_q() > 0) {
      require_out(q, "q");
      require_out(o, "o");
      if (pr.total_kv() > 0) {
        require_out(k, "k");
        require_out(v, "v");
      }
    }
    check_workspace(p.impl->workspace_bytes(ATTN_PASS_FORWARD), workspace, workspace_bytes);
    p.impl->forward(attn::ForwardArgs{q, k, v, o, lse, workspace, stream});
  });
}

attn_status_t attn_backward(attn_plan_t plan, const void* q, const void* k, const void* v,
                            const void* o, const float* lse, const void* d_o, void* dq, void* dk,
                            void* dv, void* workspace, size_t workspace_bytes, void* stream) {
  return guarded([&] {
    const attn::Plan& p = *checked(plan, "plan").plan;
    const attn::Problem& pr = p.problem;
    if (!pr.backward)
      attn::not_supported("attn_backward: the plan was created for the forward pass only ",
                          "(attn_plan_desc_set_passes(ATTN_PASSES_FORWARD_BACKWARD))");
    if (pr.total_q() > 0) {
      require_out(q, "q");
      require_out(o, "o");
      require_out(lse, "lse");
      require_out(d_o, "d_o");
      require_out(dq, "dq");
    }
    if (pr.total_kv() > 0) {
      require_out(k, "k");
      require_out(v, "v");
      require_out(dk, "dk");
      require_out(dv, "dv");
    }
    check_workspace(p.impl->workspace_bytes(ATTN_PASS_BACKWARD), workspace, workspace_bytes);
    p.impl->backward(attn::BackwardArgs{q, k, v, o, lse, d_o, dq, dk, dv, workspace, stream});
  });
}

// --- merge -----------------------------------------------------------------------

attn_status_t attn_merge_states(attn_context_t ctx, int32_t num_parts, attn_tensor_desc_t o_desc,
                                attn_tensor_desc_t lse_desc, const void* const* o_parts,
                                const float* const* lse_parts, void* o_out, float* lse_out,
                                void* stream) {
  return guarded([&] {
    const attn_context& c = checked(ctx, "ctx");
    const attn::TensorDesc& od = checked(o_desc, "o_desc").desc;
    const attn::TensorDesc& ld = checked(lse_desc, "lse_desc").desc;
    if (num_parts < 1) invalid_argument("num_parts must be >= 1, got ", num_parts);
    if (od.ndim < 2)
      invalid_argument("o_desc: needs at least 2 dims ([..., head_dim]), has ", od.ndim);
    if (od.strides[od.ndim - 1] != 1)
      invalid_argument("o_desc: the last (head_dim) stride must be 1, got ",
                       od.strides[od.ndim - 1]);
    if (ld.dtype != ATTN_DTYPE_FP32) invalid_argument("lse_desc: dtype must be fp32");
    bool same = ld.ndim == od.ndim - 1;
    for (int32_t i = 0; same && i < ld.ndim; ++i) same = ld.dims[i] == od.dims[i];
    if (!same) invalid_argument("lse_desc: dims must equal o_desc's dims without the last");
    require_out(o_parts, "o_parts");
    require_out(lse_parts, "lse_parts");
    // LSE is read wherever there are rows, O only where rows have channels
    // (head_dim 0: no O element, yet every row's LSE is merged).
    if (ld.numel() > 0)
      for (int32_t i = 0; i < num_parts; ++i)
        if (lse_parts[i] == nullptr) invalid_argument("lse_parts[", i, "] is NULL");
    if (od.numel() > 0) {
      for (int32_t i = 0; i < num_parts; ++i)
        if (o_parts[i] == nullptr) invalid_argument("o_parts[", i, "] is NULL");
      require_out(o_out, "o_out");
    }
    attn::merge_states(c.config, num_parts, od, ld, o_parts, lse_parts, o_out, lse_out, stream);
  });
}

}  // extern "C"
