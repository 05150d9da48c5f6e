#include "plan/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <tuple>

#include "attn_config.h"
#include "core/checked.hpp"
#include "core/dtype.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "cpu/cpu_backend.hpp"
#include "plan/per_sequence_plan.hpp"
#include "schedule/block_schedule.hpp"
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

// MoBA: the most pairs a row can see, its own block up to the diagonal and
// top_k whole past blocks, summed over the rows of one sequence.
int64_t moba_max_pairs(const Problem& p, const SequenceMask& m) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < m.lq(); ++i) {
    const int64_t d = i + m.lk() - m.lq();
    if (d < 0) continue;
    const int64_t own = d / p.moba_block;
    pairs += d - own * p.moba_block + 1 + std::min(own, p.moba_top_k) * p.moba_block;
  }
  return pairs;
}

// The query heads that share one slot (mask head) of a block mask: all of
// them for a mask of one head, else the GQA group of the slot's KV head.
int64_t heads_per_mask_head(const Problem& p) {
  return p.block_mask->heads() == 1 ? p.heads_q : p.group();
}

// Tile pairs the kernels visit with the backend's tile sizes, and the number
// an unrestricted mask would visit (attn_plan_info_t), saturated: the query
// heads of a slot (or of a dense sequence) visit the same tiles, so they are
// counted once and multiplied, which keeps this O(batch) for any head count.
void count_tile_pairs(Plan& plan, const Problem& p) {
  const int64_t tq = plan.impl->tile_q(), tk = plan.impl->tile_kv();
  if (tq < 1 || tk < 1) return;
  uint64_t visited = 0, total = 0;
  std::unique_ptr<BlockTileSchedule> sparse;
  if (p.block_mask && !p.varlen)
    sparse = std::make_unique<BlockTileSchedule>(p.block_mask, p.window, tq, tk);
  // Varlen: a sequence's visited tiles per mask head, shared by sequences
  // of equal lengths and mask entry.
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::vector<uint64_t>> per_sequence;
  for (int64_t b = 0; b < p.batch; ++b) {
    const DenseTileSchedule dense(p.sequence_mask(b), tq, tk);
    total = sat_add(total, sat_mul(uint64_t(dense.num_q_tiles()), uint64_t(dense.num_kv_tiles()),
                                   uint64_t(p.heads_q)));
    if (dense.num_q_tiles() == 0) continue;
    if (p.block_mask) {
      const BlockMask& m = *p.block_mask;
      const uint64_t per_slot = uint64_t(heads_per_mask_head(p));
      if (p.varlen) {  // sequence b's own crop, as its plan runs it
        const int64_t mb = m.batch() == 1 ? 0 : b;
        auto [it, fresh] = per_sequence.try_emplace({p.lq(b), p.lk(b), mb});
        if (fresh) {
          const BlockTileSchedule own(
              std::make_shared<const BlockMask>(m.crop(mb, p.lq(b), p.lk(b))), p.window, tq, tk);
          for (int64_t mh = 0; mh < m.heads(); ++mh)
            it->second.push_back(uint64_t(own.visits(own.slot(0, mh))));
        }
        for (uint64_t v : it->second) visited = sat_add(visited, sat_mul(v, per_slot));
        continue;
      }
      for (int64_t mh = 0; mh < m.heads(); ++mh)
        visited = sat_add(visited, sat_mul(uint64_t(sparse->visits(sparse->slot(b, mh))), per_slot));
      continue;
    }
    uint64_t per_head = 0;
    for (int64_t qt = 0; qt < dense.num_q_tiles(); ++qt) {
      const TileRange r = dense.kv_tiles_of(qt);
      per_head += uint64_t(r.end - r.begin);
    }
    visited = sat_add(visited, sat_mul(per_head, uint64_t(p.heads_q)));
  }
  plan.visited_tile_pairs = visited;
  plan.total_tile_pairs = total;
}

// The shape in a message, for what follows from several of its values.
std::string shape_string(const Problem& p) {
  std::string s = "batch " + std::to_string(p.batch) + ", heads_q " + std::to_string(p.heads_q) +
                  ", heads_kv " + std::to_string(p.heads_kv) + ", seqlen_q " +
                  std::to_string(p.seqlen_q) + ", seqlen_kv " + std::to_string(p.seqlen_kv) +
                  ", head dims " + std::to_string(p.head_dim_qk) + "/" +
                  std::to_string(p.head_dim_v);
  if (p.moba_block > 0)
    s += ", MoBA block_size " + std::to_string(p.moba_block) + " and top_k " +
         std::to_string(p.moba_top_k);
  return s;
}

// A pass's workspace must stay within kMaxBytes: a size past it could not
// be allocated, and one past 2^64 would have wrapped. Backends saturate.
void check_workspace_limit(const BackendPlan& impl, const Problem& p) {
  for (const attn_pass_t pass : {ATTN_PASS_FORWARD, ATTN_PASS_BACKWARD}) {
    if (pass == ATTN_PASS_BACKWARD && !p.backward) continue;
    const uint64_t bytes = impl.workspace_bytes(pass);
    if (bytes <= kMaxBytes) continue;
    const std::string need =
        bytes == kSaturated ? std::string("2^64 or more") : std::to_string(bytes);
    invalid_argument("desc: the ", pass == ATTN_PASS_FORWARD ? "forward" : "backward",
                     " pass's workspace would need ", need, " bytes, more than 2^62 (",
                     shape_string(p), ")");
  }
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
  {
    // A reach of seqlen_q + seqlen_kv + max |shift| or more covers every key of
    // every row: make it unbounded, so that the diagonal's i + off -/+
    // reach cannot overflow (INT64_MAX is a natural "everything").
    double max_shift = 0.0;
    for (int64_t shift : d.diagonal_shift) max_shift = std::max(max_shift, std::fabs(double(shift)));
    const double reach_all = double(d.seqlen_q) + double(d.seqlen_kv) + max_shift;
    if (double(p.window.left) >= reach_all) p.window.left = -1;
    if (double(p.window.right) >= reach_all) p.window.right = -1;
  }
  p.allow_empty_rows = d.allow_empty_rows;
  p.backward = d.passes == ATTN_PASSES_FORWARD_BACKWARD;
  p.deterministic = d.deterministic;
  if (!d.diagonal_shift.empty() && int64_t(d.diagonal_shift.size()) != d.batch)
    fail(ATTN_STATUS_INTERNAL_ERROR, "a diagonal shift per sequence needs one entry per batch entry");
  p.diagonal_shift = d.diagonal_shift;

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

  if (d.block_mask) {
    const BlockMask& m = *d.block_mask;
    // (Varlen: seqlen_q and seqlen_kv are the longest sequence's; each
    // sequence takes the mask's blocks from its own first position on.)
    if (m.batch() != 1 && m.batch() != p.batch)
      invalid_argument("desc: the block mask's batch ", m.batch(), " must be 1 or the plan's batch ",
                       p.batch);
    if (m.heads() != 1 && m.heads() != p.heads_kv)
      invalid_argument("desc: the block mask's heads ", m.heads(), " must be 1 or the plan's heads_kv ",
                       p.heads_kv);
    if (m.seqlen_q() != p.seqlen_q || m.seqlen_kv() != p.seqlen_kv)
      invalid_argument("desc: the block mask's seqlen_q/seqlen_kv ", m.seqlen_q(), "/", m.seqlen_kv(),
                       " differ from the plan's ", p.seqlen_q, "/", p.seqlen_kv);
    p.block_mask = d.block_mask;
  }

  bool moba_keeps_every_block = false;
  if (d.moba_keep_selection) {
    if (d.moba_block == 0)
      invalid_argument("desc: keep_selection (attn_plan_desc_set_moba_keep_selection) without MoBA");
    if (d.passes != ATTN_PASSES_FORWARD_BACKWARD)
      invalid_argument("desc: keep_selection (attn_plan_desc_set_moba_keep_selection) on a plan ",
                       "without a backward pass: there is no pass to keep the selection for");
  }
  if (d.moba_block > 0) {
    if (p.block_mask) not_supported("desc: MoBA together with a block mask: not supported");
    if (p.mask != ATTN_MASK_CAUSAL)
      invalid_argument("desc: MoBA needs the mask ATTN_MASK_CAUSAL (future blocks are never seen)");
    p.moba_block = d.moba_block;
    p.moba_top_k = d.moba_top_k;
    p.moba_shared = d.moba_shared;
    p.moba_keep_selection = d.moba_keep_selection;
    // A top_k that covers every past block selects the whole causal mask:
    // the plan is the dense causal one (the same function, without the
    // selection stage and at the dense kernels' speed); describe() says so.
    if (p.moba_top_k >= p.moba_num_blocks() - 1) {
      moba_keeps_every_block = true;
      p.moba_block = p.moba_top_k = 0;
      p.moba_shared = p.moba_keep_selection = false;
    }
  }

  auto plan = std::make_unique<Plan>();
  int64_t empty = 0, first_b = -1, first_row = -1, first_h = -1;
  if (p.block_mask) {
    // Exact: the dense mask AND the block selection, per (sequence, mask
    // head), for each of the query heads that share the mask head.
    const BlockMask& m = *p.block_mask;
    const int64_t per_slot = heads_per_mask_head(p);
    // Fixed length: one count of the whole mask; varlen: each sequence's of
    // its own crop (its lengths, its diagonal).
    // (Sequences of equal lengths and mask entry share one count.)
    const BlockMaskCounts whole = p.varlen ? BlockMaskCounts{} : count_visible(m, p.window);
    std::map<std::tuple<int64_t, int64_t, int64_t>, BlockMaskCounts> per_sequence;
    for (int64_t b = 0; b < p.batch && m.seqlen_q() > 0; ++b) {
      const int64_t mb = m.batch() == 1 ? 0 : b;
      const BlockMaskCounts* counted = &whole;
      if (p.varlen) {
        auto [it, fresh] = per_sequence.try_emplace({p.lq(b), p.lk(b), mb});
        if (fresh) it->second = count_visible(m.crop(mb, p.lq(b), p.lk(b)), p.window);
        counted = &it->second;
      }
      const BlockMaskCounts& c = *counted;
      for (int64_t mh = 0; mh < m.heads(); ++mh) {
        const size_t s = size_t((p.varlen ? 0 : mb) * m.heads() + mh);
        plan->visible_pairs = sat_add(plan->visible_pairs,
                                      sat_mul(uint64_t(c.visible_pairs[s]), uint64_t(per_slot)));
        plan->visible_pairs_f += double(c.visible_pairs[s]) * double(per_slot);
        if (c.empty_rows[s] > 0 && first_b < 0)
          first_b = b, first_h = m.heads() == 1 ? 0 : mh * p.group(),
          first_row = c.first_empty_row[s];
        empty += c.empty_rows[s] * per_slot;
      }
    }
    if (empty > 0 && !p.allow_empty_rows)
      invalid_argument("desc: the mask and the block mask leave ", empty,
                       " (query row, head) pairs without any visible key (first: batch ", first_b,
                       ", query head ", first_h, ", row ", first_row,
                       "); call attn_plan_desc_set_allow_empty_rows if that is intended");
  }
  for (int64_t b = 0; b < p.batch && !p.block_mask; ++b) {
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
    const int64_t pairs = p.moba_block > 0 ? moba_max_pairs(p, m) : m.visible_pairs();
    plan->visible_pairs =
        sat_add(plan->visible_pairs, sat_mul(uint64_t(pairs), uint64_t(p.heads_q)));
    plan->visible_pairs_f += double(pairs) * double(p.heads_q);
  }
  if (empty > 0 && !p.allow_empty_rows)
    invalid_argument("desc: the mask leaves ", empty, " query rows per head without any visible key",
                     " (first: batch ", first_b, ", row ", first_row,
                     "); call attn_plan_desc_set_allow_empty_rows if that is intended");

  plan->context = ctx;
  plan->moba_keeps_every_block = moba_keeps_every_block;
  // MoBA on a varlen batch: natively on the CPU; on CUDA, whose selector and
  // lists are laid out per fixed-length sequence, sequence by sequence
  // (plan/per_sequence_plan.hpp; on the CPU too under the test hook
  // ATTN_CPU_MOBA_PER_SEQUENCE=1, where no kept selection is asked for).
  // A block mask on a varlen batch: sequence by sequence on both backends,
  // each with its own crop of the mask.
  const bool varlen_moba = p.moba_block > 0 && p.varlen;
  const bool varlen_mask = p.block_mask && p.varlen;
  switch (ctx.backend) {
    case ATTN_BACKEND_CPU:
      if (varlen_mask || (varlen_moba && !p.moba_keep_selection &&
                          env_flag("ATTN_CPU_MOBA_PER_SEQUENCE", false)))
        plan->impl = make_per_sequence_plan(p, cpu::per_sequence_ops(ctx));
      else
        plan->impl = cpu::make_plan(p, ctx);
      break;
    case ATTN_BACKEND_CUDA:
#if ATTN_HAVE_CUDA
      plan->impl = varlen_moba || varlen_mask
                       ? make_per_sequence_plan(p, cuda::per_sequence_ops(ctx))
                       : cuda::make_plan(p, ctx);
      break;
#else
      not_supported("backend CUDA: this build of libattn has no CUDA attention kernels");
#endif
    default: fail(ATTN_STATUS_INTERNAL_ERROR, "context with unresolved backend");
  }
  check_workspace_limit(*plan->impl, p);
  count_tile_pairs(*plan, p);
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
  info.flops_forward = 2.0 * visible_pairs_f * double(p.head_dim_qk + p.head_dim_v);
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
  std::snprintf(info.algorithm, sizeof info.algorithm, "%s%s%s",
                moba_keeps_every_block ? "moba-keeps-every-block:" : "", impl->algorithm(),
                p.moba_keep_selection ? "+kept-selection" : "");
  std::snprintf(info.kernel, sizeof info.kernel, "%s", impl->kernel());
  info.visited_tile_pairs = visited_tile_pairs;
  info.total_tile_pairs = total_tile_pairs;
  info.block_q = p.block_mask ? int32_t(p.block_mask->block_q()) : 0;
  info.block_kv = p.block_mask ? int32_t(p.block_mask->block_kv()) : 0;
}

}  // namespace attn
