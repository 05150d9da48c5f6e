#include "plan/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "attn_config.h"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cpu/cpu_backend.hpp"
#if ATTN_HAVE_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace attn {

const char* tensor_role_name(attn_tensor_role_t role) {
  switch (role) {
    case ATTN_TENSOR_Q: return "Q";
    case ATTN_TENSOR_K: return "K";
    case ATTN_TENSOR_V: return "V";
    case ATTN_TENSOR_O: return "O";
    case ATTN_TENSOR_DO: return "dO";
    case ATTN_TENSOR_DQ: return "dQ";
    case ATTN_TENSOR_DK: return "dK";
    case ATTN_TENSOR_DV: return "dV";
  }
  return "?";
}

namespace {

const char* layout_name(attn_layout_t layout) {
  switch (layout) {
    case ATTN_LAYOUT_BSHD: return "BSHD";
    case ATTN_LAYOUT_BHSD: return "BHSD";
    case ATTN_LAYOUT_THD: return "THD";
  }
  return "?";
}

bool is_q_side(attn_tensor_role_t r) {
  return r == ATTN_TENSOR_Q || r == ATTN_TENSOR_O || r == ATTN_TENSOR_DO || r == ATTN_TENSOR_DQ;
}

// The dims a tensor of `role` must have, in the layout's order.
int32_t expected_dims(const Problem& p, attn_tensor_role_t role, int64_t* dims) {
  const bool q = is_q_side(role);
  const int64_t heads = q ? p.heads_q : p.heads_kv;
  const bool v_dim = role == ATTN_TENSOR_V || role == ATTN_TENSOR_O || role == ATTN_TENSOR_DO ||
                     role == ATTN_TENSOR_DV;
  const int64_t dim = v_dim ? p.head_dim_v : p.head_dim_qk;
  const int64_t seq = q ? p.seqlen_q : p.seqlen_kv;
  switch (p.layout) {
    case ATTN_LAYOUT_BSHD:
      dims[0] = p.batch, dims[1] = seq, dims[2] = heads, dims[3] = dim;
      return 4;
    case ATTN_LAYOUT_BHSD:
      dims[0] = p.batch, dims[1] = heads, dims[2] = seq, dims[3] = dim;
      return 4;
    case ATTN_LAYOUT_THD:
      dims[0] = q ? p.total_q() : p.total_kv(), dims[1] = heads, dims[2] = dim;
      return 3;
  }
  return 0;
}

std::string dims_string(int32_t n, const int64_t* dims) {
  std::string s = "[";
  for (int32_t i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

bool is_output(attn_tensor_role_t r) {
  return r == ATTN_TENSOR_O || r == ATTN_TENSOR_DQ || r == ATTN_TENSOR_DK || r == ATTN_TENSOR_DV;
}

// True when no two elements share an address: with the dims of extent > 1
// sorted by stride, each stride must pass the span of the smaller ones. This
// accepts every layout made of nested (possibly padded) dimensions, which
// covers permutations, slices and padding.
bool strides_are_disjoint(int32_t n, const int64_t* dims, const int64_t* strides) {
  std::pair<int64_t, int64_t> d[8];  // (stride, extent)
  int32_t k = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (dims[i] == 0) return true;  // no elements at all
    if (dims[i] > 1) d[k++] = {strides[i], dims[i]};
  }
  for (int32_t i = 1; i < k; ++i)  // insertion sort: at most 4 entries
    for (int32_t j = i; j > 0 && d[j] < d[j - 1]; --j) std::swap(d[j], d[j - 1]);
  int64_t span = 1;  // addresses covered by the dims so far: [0, span)
  for (int32_t i = 0; i < k; ++i) {
    if (d[i].first < span) return false;
    span = d[i].first * (d[i].second - 1) + span;
  }
  return true;
}

// Strides (batch, seq, head) of a tensor: the layout's contiguous default or
// the user's override, checked against the expected dims.
TensorStrides tensor_strides(const Problem& p, const PlanDesc& d, attn_tensor_role_t role) {
  int64_t dims[4];
  const int32_t n = expected_dims(p, role, dims);
  int64_t strides[4];
  const std::optional<TensorDesc>& user = d.tensors[role];
  if (user) {
    const char* name = tensor_role_name(role);
    if (user->dtype != p.dtype)
      invalid_argument("tensor ", name, ": dtype ", dtype_name(user->dtype),
                       " differs from the plan's dtype ", dtype_name(p.dtype));
    bool same = user->ndim == n;
    for (int32_t i = 0; same && i < n; ++i) same = user->dims[i] == dims[i];
    if (!same)
      invalid_argument("tensor ", name, ": dims ", dims_string(user->ndim, user->dims.data()),
                       " do not match ", dims_string(n, dims), " expected for layout ",
                       layout_name(p.layout));
    if (user->strides[n - 1] != 1)
      invalid_argument("tensor ", name, ": the last (head_dim) stride must be 1, got ",
                       user->strides[n - 1]);
    std::memcpy(strides, user->strides.data(), sizeof(int64_t) * size_t(n));
    if (is_output(role) && !strides_are_disjoint(n, dims, strides))
      invalid_argument("tensor ", name, ": its strides ", dims_string(n, strides),
                       " map different elements to the same address; an output must not",
                       " overlap itself");
  } else {
    contiguous_strides(n, dims, strides);
  }
  TensorStrides t;
  switch (p.layout) {
    case ATTN_LAYOUT_BSHD: t = {strides[0], strides[1], strides[2]}; break;
    case ATTN_LAYOUT_BHSD: t = {strides[0], strides[2], strides[1]}; break;
    case ATTN_LAYOUT_THD: t = {0, strides[0], strides[1]}; break;
  }
  return t;
}

}  // namespace

std::unique_ptr<Plan> create_plan(const ContextConfig& ctx, const PlanDesc& d) {
  Problem p;
  if (d.seqlen_q < 0 || d.head_dim_qk <= 0 || d.head_dim_v <= 0)
    invalid_argument("desc: the shape was not set (attn_plan_desc_set_shape)");
  if (d.heads_q % d.heads_kv != 0)
    invalid_argument("desc: heads_q (", d.heads_q, ") must be a multiple of heads_kv (", d.heads_kv,
                     ")");
  p.dtype = d.dtype;
  p.batch = d.batch;
  p.heads_q = d.heads_q;
  p.heads_kv = d.heads_kv;
  p.seqlen_q = d.seqlen_q;
  p.seqlen_kv = d.seqlen_kv;
  p.head_dim_qk = d.head_dim_qk;
  p.head_dim_v = d.head_dim_v;
  p.scale = d.scale ? *d.scale : float(1.0 / std::sqrt(double(d.head_dim_qk)));
  p.softcap = d.softcap;
  p.mask = d.mask;
  switch (d.mask) {
    case ATTN_MASK_NONE: p.window = {-1, -1}; break;
    case ATTN_MASK_CAUSAL: p.window = {-1, 0}; break;
    case ATTN_MASK_WINDOW: p.window = {d.window_left, d.window_right}; break;
  }
  p.allow_empty_rows = d.allow_empty_rows;
  p.backward = d.passes == ATTN_PASSES_FORWARD_BACKWARD;
  p.deterministic = d.deterministic;
  p.diagonal_shift = d.diagonal_shift;
  if (p.diagonal_shift != 0 && ctx.backend != ATTN_BACKEND_CPU)
    not_supported("a shifted mask diagonal (ring steps) runs on the CPU backend only");

  if (d.varlen) {
    if (d.layout_set && d.layout != ATTN_LAYOUT_THD)
      invalid_argument("desc: layout ", layout_name(d.layout),
                       " was set but a varlen batch uses THD (packed tokens)");
    if (d.varlen_batch != d.batch)
      invalid_argument("desc: the varlen batch has ", d.varlen_batch,
                       " sequences but the shape's batch is ", d.batch);
    p.varlen = true;
    p.layout = ATTN_LAYOUT_THD;
    p.cu_q = d.cu_q;
    p.cu_kv = d.cu_kv;
    int64_t max_q = 0, max_kv = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      max_q = std::max(max_q, p.lq(b));
      max_kv = std::max(max_kv, p.lk(b));
    }
    if (max_q != d.seqlen_q || max_kv != d.seqlen_kv)
      invalid_argument("desc: seqlen_q/seqlen_kv (", d.seqlen_q, "/", d.seqlen_kv,
                       ") must be the longest sequences of the varlen batch (", max_q, "/", max_kv,
                       ")");
  } else {
    if (d.layout == ATTN_LAYOUT_THD)
      invalid_argument("desc: layout THD needs a varlen batch (attn_plan_desc_set_varlen)");
    p.layout = d.layout;
    p.cu_q.resize(size_t(p.batch) + 1);
    p.cu_kv.resize(size_t(p.batch) + 1);
    for (int64_t b = 0; b <= p.batch; ++b) {
      p.cu_q[size_t(b)] = b * p.seqlen_q;
      p.cu_kv[size_t(b)] = b * p.seqlen_kv;
    }
  }

  for (int r = 0; r < 8; ++r) {
    auto role = attn_tensor_role_t(r);
    p.strides[r] = tensor_strides(p, d, role);
  }

  auto plan = std::make_unique<Plan>();
  int64_t empty = 0, first_b = -1, first_row = -1;
  for (int64_t b = 0; b < p.batch; ++b) {
    const SequenceMask m = p.sequence_mask(b);
    const int64_t e = m.empty_rows();
    if (e > 0 && first_b < 0) {
      first_b = b;
      for (int64_t i = 0; i < m.lq(); ++i)
        if (m.key_lo(i) > m.key_hi(i)) {
          first_row = i;
          break;
        }
    }
    empty += e;
    plan->visible_pairs += uint64_t(m.visible_pairs()) * uint64_t(p.heads_q);
  }
  if (empty > 0 && !p.allow_empty_rows)
    invalid_argument("desc: the mask leaves ", empty, " query rows per head without any visible key",
                     " (first: batch ", first_b, ", row ", first_row,
                     "); call attn_plan_desc_set_allow_empty_rows if that is intended");

  plan->context = ctx;
  switch (ctx.backend) {
    case ATTN_BACKEND_CPU: plan->impl = cpu::make_plan(p, ctx); break;
    case ATTN_BACKEND_CUDA:
#if ATTN_HAVE_CUDA
      plan->impl = cuda::make_plan(p, ctx);
      break;
#else
      not_supported("backend CUDA: this build of libattn has no CUDA attention kernels");
#endif
    default: fail(ATTN_STATUS_INTERNAL_ERROR, "context with unresolved backend");
  }
  plan->problem = std::move(p);
  return plan;
}

void Plan::describe(attn_plan_info_t& info) const {
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  info.backend = context.backend;
  info.dtype = problem.dtype;
  info.tile_q = impl->tile_q();
  info.tile_kv = impl->tile_kv();
  info.num_threads = impl->num_threads();
  info.supports_backward = problem.backward ? 1 : 0;
  info.workspace_bytes_forward = impl->workspace_bytes(ATTN_PASS_FORWARD);
  info.workspace_bytes_backward = problem.backward ? impl->workspace_bytes(ATTN_PASS_BACKWARD) : 0;
  info.visible_pairs = visible_pairs;
  const Problem& p = problem;
  info.flops_forward = 2.0 * double(visible_pairs) * double(p.head_dim_qk + p.head_dim_v);
  info.flops_backward = 2.5 * info.flops_forward;
  const double es = double(dtype_size(p.dtype));
  const double q = double(p.total_q()) * double(p.heads_q);
  const double kv = double(p.total_kv()) * double(p.heads_kv);
  const double q_bytes = q * double(p.head_dim_qk) * es, o_bytes = q * double(p.head_dim_v) * es;
  const double k_bytes = kv * double(p.head_dim_qk) * es, v_bytes = kv * double(p.head_dim_v) * es;
  const double lse_bytes = q * 4.0;
  info.bytes_forward = q_bytes + k_bytes + v_bytes + o_bytes + lse_bytes;
  // read Q K V O dO LSE, write dQ dK dV
  info.bytes_backward = 2.0 * (q_bytes + k_bytes + v_bytes) + 2.0 * o_bytes + lse_bytes;
  std::snprintf(info.algorithm, sizeof info.algorithm, "%s", impl->algorithm());
  std::snprintf(info.kernel, sizeof info.kernel, "%s", impl->kernel());
}

}  // namespace attn
