// MoBA on a varlen batch on the CUDA backend: one fixed-length MoBA plan
// per distinct (seqlen_q, seqlen_kv) of the batch's sequences, run sequence
// by sequence on the caller's stream.
//
// The selector and the MoBA kernels lay out their selection, block means
// and lists per fixed-length sequence; a packed (THD) sequence is such a
// sequence of batch 1 once its tensors start at its first token, since a
// THD tensor's token and head strides are those of a batch-1 BSHD one. Each
// sequence pools and gates its own blocks, as the CPU backend's varlen
// MoBA does. A sequence whose top_k covers all its past blocks (short ones,
// and empty ones) runs as the dense causal plan, as a whole plan would.
// What differs is LSE: the varlen layout is [heads_q, total_q], the batch-1
// plan's [heads_q, seqlen_q]; a sequence's LSE goes through a region of the
// workspace, copied (2D, on the stream) to or from its columns.
//
// The sequences share one workspace, one after another on the stream, so a
// kept selection (attn_plan_desc_set_moba_keep_selection), which must
// survive from the forward to the backward, is refused. Work per launch is
// one sequence's: batches of many short sequences pay for many launches.
#include "cuda/moba_varlen.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/checked.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/workspace.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_util.hpp"

namespace attn::cuda {
namespace {

constexpr size_t kRegionAlign = 256;

class VarlenMobaPlan final : public BackendPlan {
 public:
  VarlenMobaPlan(const Problem& p, const ContextConfig& ctx) : p_(p), device_(ctx.device) {
    if (p.moba_keep_selection)
      not_supported("desc: a kept MoBA selection (attn_plan_desc_set_moba_keep_selection) with a ",
                    "varlen batch on the CUDA backend: not supported (its sequences run one after ",
                    "another on one workspace)");
    std::map<std::pair<int64_t, int64_t>, size_t> by_lengths;
    seq_plan_.resize(size_t(p.batch));
    for (int64_t b = 0; b < p.batch; ++b) {
      const std::pair<int64_t, int64_t> key{p.lq(b), p.lk(b)};
      auto [it, fresh] = by_lengths.emplace(key, plans_.size());
      if (fresh) plans_.push_back(make_plan(sequence_problem(key.first, key.second), ctx));
      seq_plan_[size_t(b)] = it->second;
      max_lq_ = std::max(max_lq_, key.first);
    }
    // Describe the plan by a sequence that selects, if any does.
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
    require_aligned(a.q, "q"), require_aligned(a.k, "k"), require_aligned(a.v, "v");
    require_aligned(a.o, "o"), require_aligned(a.workspace, "workspace");
    require_lse_aligned(a.lse);
    DeviceScope scope(device_);
    const auto [lse_ws, ws] = regions(a.workspace);
    const size_t es = dtype_size(p_.dtype);
    const auto stream = static_cast<cudaStream_t>(a.stream);
    for (int64_t b = 0; b < p_.batch; ++b) {
      const int64_t lq = p_.lq(b);
      if (lq == 0) continue;  // nothing to write
      ForwardArgs s{at(a.q, ATTN_TENSOR_Q, b, es), at(a.k, ATTN_TENSOR_K, b, es),
                    at(a.v, ATTN_TENSOR_V, b, es), at(a.o, ATTN_TENSOR_O, b, es),
                    a.lse != nullptr ? lse_ws : nullptr, ws, a.stream};
      plans_[seq_plan_[size_t(b)]]->forward(s);
      if (a.lse != nullptr) copy_lse(a.lse + p_.cu_q[size_t(b)], p_.total_q(), lse_ws, lq, lq, stream);
    }
  }

  void backward(const BackwardArgs& a) const override {
    require_aligned(a.q, "q"), require_aligned(a.k, "k"), require_aligned(a.v, "v");
    require_aligned(a.o, "o"), require_aligned(a.d_o, "d_o"), require_aligned(a.dq, "dq");
    require_aligned(a.dk, "dk"), require_aligned(a.dv, "dv"), require_aligned(a.workspace, "workspace");
    require_lse_aligned(a.lse);
    DeviceScope scope(device_);
    const auto [lse_ws, ws] = regions(a.workspace);
    const size_t es = dtype_size(p_.dtype);
    const auto stream = static_cast<cudaStream_t>(a.stream);
    for (int64_t b = 0; b < p_.batch; ++b) {
      const int64_t lq = p_.lq(b);
      if (lq == 0 && p_.lk(b) == 0) continue;
      if (lq > 0) copy_lse(lse_ws, lq, a.lse + p_.cu_q[size_t(b)], p_.total_q(), lq, stream);
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
  int32_t num_threads() const override { return 1; }
  // The sequences' plans (of a sequence that selects, if any does).
  const char* algorithm() const override { return "flash-moba-per-sequence-online-softmax"; }
  const char* kernel() const override { return plans_[shown_]->kernel(); }

 private:
  // Sequence b's batch-1 problem: the batch's, with its lengths, fixed-length
  // (a THD tensor's strides are a batch-1 BSHD one's), MoBA dropped where
  // top_k covers every past block of the sequence.
  Problem sequence_problem(int64_t lq, int64_t lk) const {
    Problem s = p_;
    s.varlen = false;
    s.batch = 1;
    s.seqlen_q = lq, s.seqlen_kv = lk;
    s.cu_q = {0, lq};
    s.cu_kv = {0, lk};
    for (TensorStrides& t : s.strides) t.batch = 0;
    if (s.moba_top_k >= s.moba_num_blocks() - 1) s.moba_block = s.moba_top_k = 0, s.moba_shared = false;
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

  // As the fixed-length plans (attn_forward): 16-byte aligned device
  // pointers (null ones are the API's to refuse or allow), LSE 4-byte.
  static void require_aligned(const void* p, const char* name) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
      invalid_argument(name, ": the CUDA kernels need a 16-byte aligned device pointer, got ", p);
  }
  static void require_lse_aligned(const float* lse) {
    if (reinterpret_cast<uintptr_t>(lse) % alignof(float) != 0)
      invalid_argument("lse: the device pointer must be 4-byte aligned");
  }

  // lq LSE values of every query head, from rows src_pitch floats apart to
  // rows dst_pitch floats apart (the varlen [heads_q, total_q] at a
  // sequence's column, or its plan's [heads_q, lq]), on the stream.
  void copy_lse(float* dst, int64_t dst_pitch, const float* src, int64_t src_pitch, int64_t lq,
                cudaStream_t stream) const {
    check(cudaMemcpy2DAsync(dst, sizeof(float) * size_t(dst_pitch), src,
                            sizeof(float) * size_t(src_pitch), sizeof(float) * size_t(lq),
                            size_t(p_.heads_q), cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpy2DAsync (a sequence's LSE)");
  }

  std::pair<float*, void*> regions(void* workspace) const {
    const auto base = align_up(reinterpret_cast<uintptr_t>(workspace), kRegionAlign);
    return {reinterpret_cast<float*>(base), reinterpret_cast<void*>(base + lse_bytes_)};
  }

  Problem p_;
  int32_t device_;
  std::vector<std::unique_ptr<BackendPlan>> plans_;  // one per distinct (lq, lk)
  std::vector<size_t> seq_plan_;                     // sequence -> its plan
  size_t shown_ = 0;
  int64_t max_lq_ = 0;
  size_t lse_bytes_ = 0;
};

}  // namespace

std::unique_ptr<BackendPlan> make_varlen_moba_plan(const Problem& problem,
                                                   const ContextConfig& ctx) {
  return std::make_unique<VarlenMobaPlan>(problem, ctx);
}

}  // namespace attn::cuda
