// A MoBA or block-sparse plan on a varlen batch, run sequence by sequence:
// one fixed-length plan per distinct (seqlen_q, seqlen_kv) of the batch's
// sequences (and, for a block mask of one entry per sequence, per sequence).
//
// A block mask on a varlen batch is given for the longest sequence; each
// sequence takes its blocks from its own first position on (the mask's
// corner of its lengths: BlockMask::crop), with the plan's dense mask
// aligned to its own lengths on top. Both backends run such plans this way.
//
// The CUDA selector and MoBA kernels lay out their selection, block means
// and lists per fixed-length sequence; a packed (THD) sequence is such a
// sequence of batch 1 once its tensors start at its first token, since a
// THD tensor's token and head strides are those of a batch-1 BSHD one. Each
// sequence pools and gates its own blocks, as the varlen MoBA rule says. A
// sequence whose top_k covers all its past blocks (short ones, and empty
// ones) runs as the dense causal plan, as a whole plan would. What differs
// is LSE: the varlen layout is [heads_q, total_q], the batch-1 plan's
// [heads_q, seqlen_q]; a sequence's LSE goes through a region of the
// workspace, copied to or from its columns in the stream's order.
//
// The sequences share one workspace, one after another, so a kept
// selection (attn_plan_desc_set_moba_keep_selection), which must survive
// from the forward to the backward, is refused. Work per launch is one
// sequence's: batches of many short sequences pay for many launches. The
// CUDA backend runs varlen MoBA this way; the CPU backend runs it natively,
// and this way only under ATTN_CPU_MOBA_PER_SEQUENCE=1 (a test hook: the
// CPU numerics tests then check this plan's logic against fp64).
#include "plan/per_sequence_plan.hpp"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checked.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/workspace.hpp"

namespace attn {
namespace {

constexpr size_t kRegionAlign = 256;

class PerSequencePlan final : public BackendPlan {
 public:
  PerSequencePlan(const Problem& p, const PerSequenceOps& ops) : p_(p), ops_(ops) {
    if (p.moba_keep_selection)
      not_supported("desc: a kept MoBA selection (attn_plan_desc_set_moba_keep_selection) with a ",
                    "varlen batch on this backend: not supported (its sequences run one after ",
                    "another on one workspace)");
    // Sequences share a plan when their lengths and their mask entry (a
    // mask of batch 1 serves all) are the same.
    std::map<std::tuple<int64_t, int64_t, int64_t>, size_t> by_lengths;
    seq_plan_.resize(size_t(p.batch));
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t mb = p.block_mask && p.block_mask->batch() > 1 ? b : 0;
      const std::tuple<int64_t, int64_t, int64_t> key{p.lq(b), p.lk(b), mb};
      auto [it, fresh] = by_lengths.emplace(key, plans_.size());
      if (fresh) plans_.push_back(ops_.make_plan(sequence_problem(p.lq(b), p.lk(b), mb)));
      seq_plan_[size_t(b)] = it->second;
      max_lq_ = std::max(max_lq_, p.lq(b));
    }
    // Described by a sequence that selects, if any does.
    for (size_t i = 0; i < plans_.size(); ++i)
      if (std::string(plans_[i]->algorithm()).find("moba") != std::string::npos) {
        shown_ = i;
        break;
      }
    lse_bytes_ = size_t(sat_align_up(
        sat_mul(uint64_t(p.heads_q), uint64_t(max_lq_), sizeof(float)), kRegionAlign));
  }

  size_t workspace_bytes(attn_pass_t pass) const override {
    if (pass == ATTN_PASS_BACKWARD && !p_.backward) return 0;
    uint64_t most = 0;
    for (const auto& plan : plans_) most = std::max<uint64_t>(most, plan->workspace_bytes(pass));
    // the aligned base, the LSE region, the sequences' workspace
    return size_t(sat_add(kRegionAlign - 1, sat_add(lse_bytes_, most)));
  }

  void forward(const ForwardArgs& a) const override {
    // Every pointer first: the sequences' plans check only the tensors
    // their own sequence uses, after earlier sequences were written.
    if (ops_.check_forward) ops_.check_forward(a, p_.total_q() > 0, p_.total_kv() > 0);
    const auto [lse_ws, ws] = regions(a.workspace);
    const size_t es = dtype_size(p_.dtype);
    for (int64_t b = 0; b < p_.batch; ++b) {
      const int64_t lq = p_.lq(b);
      if (lq == 0) continue;  // nothing to write
      ForwardArgs s{at(a.q, ATTN_TENSOR_Q, b, es), at(a.k, ATTN_TENSOR_K, b, es),
                    at(a.v, ATTN_TENSOR_V, b, es), at(a.o, ATTN_TENSOR_O, b, es),
                    a.lse != nullptr ? lse_ws : nullptr, ws, a.stream};
      plans_[seq_plan_[size_t(b)]]->forward(s);
      if (a.lse != nullptr)
        ops_.copy_rows(a.lse + p_.cu_q[size_t(b)], p_.total_q(), lse_ws, lq, lq, p_.heads_q,
                       a.stream);
    }
  }

  void backward(const BackwardArgs& a) const override {
    if (ops_.check_backward) ops_.check_backward(a, p_.total_q() > 0, p_.total_kv() > 0);
    const auto [lse_ws, ws] = regions(a.workspace);
    const size_t es = dtype_size(p_.dtype);
    for (int64_t b = 0; b < p_.batch; ++b) {
      const int64_t lq = p_.lq(b);
      if (lq == 0 && p_.lk(b) == 0) continue;
      if (lq > 0)
        ops_.copy_rows(lse_ws, lq, a.lse + p_.cu_q[size_t(b)], p_.total_q(), lq, p_.heads_q,
                       a.stream);
      // (A sequence without queries still writes its keys' dK = dV = 0.)
      BackwardArgs s{at(a.q, ATTN_TENSOR_Q, b, es),   at(a.k, ATTN_TENSOR_K, b, es),
                     at(a.v, ATTN_TENSOR_V, b, es),   at(a.o, ATTN_TENSOR_O, b, es),
                     lse_ws,                          at(a.d_o, ATTN_TENSOR_DO, b, es),
                     at(a.dq, ATTN_TENSOR_DQ, b, es), at(a.dk, ATTN_TENSOR_DK, b, es),
                     at(a.dv, ATTN_TENSOR_DV, b, es), ws,
                     a.stream};
      plans_[seq_plan_[size_t(b)]]->backward(s);
    }
  }

  int32_t tile_q() const override { return plans_[shown_]->tile_q(); }
  int32_t tile_kv() const override { return plans_[shown_]->tile_kv(); }
  int32_t num_threads() const override { return plans_[shown_]->num_threads(); }
  const char* algorithm() const override {
    if (p_.moba_block > 0) return "flash-moba-per-sequence-online-softmax";
    return p_.block_mask ? "flash-block-sparse-per-sequence-online-softmax"
                         : "flash-tiled-per-sequence-online-softmax";
  }
  // The sequences' plans' (of a sequence that selects, if any does).
  const char* kernel() const override { return plans_[shown_]->kernel(); }

 private:
  // A sequence's batch-1 problem: the batch's, with its lengths, fixed-length
  // (a THD tensor's strides are a batch-1 BSHD one's), MoBA dropped where
  // top_k covers every past block of the sequence, and the block mask
  // entry mb cropped to its lengths.
  Problem sequence_problem(int64_t lq, int64_t lk, int64_t mb) const {
    Problem s = p_;
    // (No ring block plan, the only user of diagonal shifts, runs per
    // sequence: a shift here would be another sequence's.)
    if (!s.diagonal_shift.empty())
      fail(ATTN_STATUS_INTERNAL_ERROR, "per-sequence plan of a diagonal-shifted problem");
    s.varlen = false;
    s.batch = 1;
    s.seqlen_q = lq, s.seqlen_kv = lk;
    s.cu_q = {0, lq};
    s.cu_kv = {0, lk};
    for (TensorStrides& t : s.strides) t.batch = 0;
    if (s.moba_block > 0 && s.moba_top_k >= s.moba_num_blocks() - 1)
      s.moba_block = s.moba_top_k = 0, s.moba_shared = false;
    if (s.block_mask) s.block_mask = std::make_shared<const BlockMask>(s.block_mask->crop(mb, lq, lk));
    return s;
  }

  // Sequence b's first token of tensor `role` (element offset times size).
  template <class Ptr>
  Ptr at(Ptr base, attn_tensor_role_t role, int64_t b, size_t es) const {
    if (base == nullptr) return base;
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const char, char>;
    return reinterpret_cast<Ptr>(reinterpret_cast<Byte*>(base) +
                                 size_t(p_.offset(role, b, 0, 0)) * es);
  }

  std::pair<float*, void*> regions(void* workspace) const {
    const auto base = align_up(reinterpret_cast<uintptr_t>(workspace), kRegionAlign);
    return {reinterpret_cast<float*>(base), reinterpret_cast<void*>(base + lse_bytes_)};
  }

  Problem p_;
  PerSequenceOps ops_;
  std::vector<std::unique_ptr<BackendPlan>> plans_;  // one per distinct (lq, lk)
  std::vector<size_t> seq_plan_;                     // sequence -> its plan
  size_t shown_ = 0;
  int64_t max_lq_ = 0;
  size_t lse_bytes_ = 0;
};

}  // namespace

std::unique_ptr<BackendPlan> make_per_sequence_plan(const Problem& problem,
                                                    const PerSequenceOps& ops) {
  return std::make_unique<PerSequencePlan>(problem, ops);
}

}  // namespace attn
