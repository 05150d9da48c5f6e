// Ring attention on the CUDA backend (built with CUDA and NCCL).
//
// The same schedule as the CPU ring plan (ring_schedule.hpp), with the
// blocks run by the CUDA dense kernels, which read the caller's tensors in
// their dtype: query-side tensors are chunk views of the caller's local
// tensors, K/V views of the shard that arrived (in the dtype, as it
// travels). The kernels take no diagonal shift, so a block must be either
// fully visible (run with no mask) or aligned like the whole sequence
// (shift 0: run with the plan's own mask); that covers full and causal
// masks with seqlen_q == seqlen_kv over both layouts, and plan creation
// refuses the rest (windows, seqlen_q != seqlen_kv with a mask).
//
// Each block's O (dtype) and LSE merge into an fp32 running state, and its
// dQ, dK, dV (dtype) are added into fp32 accumulators, by the kernels of
// kernels/ring; dK/dV accumulators travel in fp32. The outputs are written
// once, from the fp32 sums, after the last exchange. All of it is enqueued
// on the caller's stream; the transport orders its own stream with it by
// events, and nothing waits on the host.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "core/workspace.hpp"
#include "ring/cuda_device_scope.hpp"
#include "ring/ring_ops.hpp"
#include "ring/ring_plan.hpp"
#include "ring/ring_schedule.hpp"

namespace attn::ring {
namespace {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  fail(ATTN_STATUS_BACKEND_ERROR, "ring (CUDA): ", what, ": ", cudaGetErrorName(e), " (",
       cudaGetErrorString(e), ")");
}

// One local tensor, contiguous in the plan's layout: [batch, seq, heads,
// dim] (BSHD) or [batch, heads, seq, dim] (BHSD).
struct LocalTensor {
  attn_layout_t layout;
  int64_t batch, seq, heads, dim;

  int64_t elements() const { return batch * seq * heads * dim; }
  int64_t stride_b() const { return seq * heads * dim; }
  int64_t stride_s() const { return layout == ATTN_LAYOUT_BHSD ? dim : heads * dim; }
  int64_t stride_h() const { return layout == ATTN_LAYOUT_BHSD ? seq * dim : dim; }

  // Element offset of row s (all of batch 0, head 0 before it).
  int64_t row_offset(int64_t s) const { return s * stride_s(); }

  // A dense plan's descriptor of `len` rows of this tensor (layout order).
  TensorDesc view(attn_dtype_t dtype, int64_t len) const {
    TensorDesc t;
    t.dtype = dtype;
    t.ndim = 4;
    t.dims[0] = batch, t.dims[3] = dim, t.strides[0] = stride_b(), t.strides[3] = 1;
    if (layout == ATTN_LAYOUT_BHSD) {
      t.dims[1] = heads, t.dims[2] = len;
      t.strides[1] = stride_h(), t.strides[2] = stride_s();
    } else {
      t.dims[1] = len, t.dims[2] = heads;
      t.strides[1] = stride_s(), t.strides[2] = stride_h();
    }
    return t;
  }

  DeviceChunk chunk(int64_t start, int64_t len) const {
    return DeviceChunk{batch, heads, dim, start, len, stride_b(), stride_s(), stride_h()};
  }
};

const char* bytes(const void* p) { return static_cast<const char*>(p); }

using Traffic = RingSchedule::Traffic;

class CudaRingPlan final : public RingBackendPlan {
 public:
  CudaRingPlan(const ContextConfig& ctx, const Problem& global, std::shared_ptr<Transport> transport,
               const RingSchedule& schedule)
      : ctx_(ctx), g_(global), tr_(std::move(transport)), s_(schedule) {
    const attn_layout_t L = g_.layout;
    q_ = {L, g_.batch, s_.sq, g_.heads_q, g_.head_dim_qk};
    o_ = {L, g_.batch, s_.sq, g_.heads_q, g_.head_dim_v};
    k_ = {L, g_.batch, s_.sk, g_.heads_kv, g_.head_dim_qk};
    v_ = {L, g_.batch, s_.sk, g_.heads_kv, g_.head_dim_v};
    es_ = dtype_size(g_.dtype);

    // Every rank must reach the same verdict, so the blocks of all ranks
    // are checked, not only this rank's.
    for (int32_t r = 0; r < s_.size; ++r) {
      const RingSchedule other = r == s_.rank ? s_ : RingSchedule::build(g_, r, s_.size, s_.layout);
      for (size_t t = 0; t < other.steps.size(); ++t)
        for (const RingBlock& rb : other.steps[t])
          if (!rb.full && rb.shift != 0)
            not_supported("ctx: on the CUDA backend every ring block must be fully visible or "
                          "aligned like the whole sequence, but step ", t, " of rank ", r,
                          " has a block shifted by ", rb.shift, " (windows, or a mask with ",
                          "seqlen_q != seqlen_kv); use the CPU backend");
    }
    // At most two dense plans: fully visible blocks, and blocks aligned like
    // the whole sequence.
    blocks_.resize(s_.steps.size());
    for (size_t t = 0; t < s_.steps.size(); ++t)
      for (const RingBlock& rb : s_.steps[t]) {
        const bool full = rb.full;
        std::unique_ptr<Plan>& plan = full ? full_plan_ : aligned_plan_;
        if (!plan) plan = make_block_plan(full);
        blocks_[t].push_back(Block{rb.q_chunk, rb.kv_chunk, plan->impl.get()});
      }
    fill_facts(facts, s_, tr_->name());
    build_workspace();
  }

  size_t workspace_bytes(attn_pass_t pass) const override {
    return pass == ATTN_PASS_FORWARD ? fwd_.bytes : bwd_.bytes;
  }
  int32_t tile_q() const override { return any_plan() ? any_plan()->tile_q() : 0; }
  int32_t tile_kv() const override { return any_plan() ? any_plan()->tile_kv() : 0; }
  int32_t num_threads() const override { return 1; }
  const char* algorithm() const override { return "ring-attention"; }
  const char* kernel() const override { return any_plan() ? any_plan()->kernel() : "none"; }

  void forward(const ForwardArgs& a) const override {
    CudaDeviceScope scope(ctx_.device);
    cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
    char* ws = workspace_base(a.workspace);
    float* o_acc = reinterpret_cast<float*>(ws + fwd_.o_acc);
    char* o_part = ws + fwd_.o_part;
    float* lse_acc = reinterpret_cast<float*>(ws + fwd_.lse_acc);
    float* lse_part = reinterpret_cast<float*>(ws + fwd_.lse_part);
    char* kv[2] = {ws + fwd_.kv[0], ws + fwd_.kv[1]};
    void* sub_ws = ws + fwd_.sub;
    const int64_t bh = g_.batch * g_.heads_q;

    tr_->check_usable();
    Exchange x;
    bool in_flight = false;
    try {
      check(cudaMemsetAsync(o_acc, 0, sizeof(float) * size_t(o_.elements()), stream),
            "cudaMemsetAsync");
      device_fill(lse_acc, -std::numeric_limits<float>::infinity(), bh * s_.sq, a.stream);
      pack_kv(a.k, a.v, kv[0], stream);
      int cur = 0;
      for (int32_t t = 0; t < s_.size; ++t) {
        if (t + 1 < s_.size) {
          x = {kv[cur], kv[1 - cur], kv_bytes_, s_.tag(ATTN_PASS_FORWARD, t, Traffic::kv)};
          tr_->start(x, a.stream);
          in_flight = true;
        }
        const char* k = kv[cur];
        const char* v = kv[cur] + size_t(k_.elements()) * es_;
        for (const Block& blk : blocks_[size_t(t)]) {
          const int64_t qs = blk.q_chunk * s_.cq, ks = blk.kv_chunk * s_.ck;
          blk.plan->forward(ForwardArgs{
              bytes(a.q) + q_.row_offset(qs) * int64_t(es_), k + k_.row_offset(ks) * int64_t(es_),
              v + v_.row_offset(ks) * int64_t(es_), o_part + o_.row_offset(qs) * int64_t(es_),
              lse_part, sub_ws, a.stream});
          device_merge(o_acc, lse_acc + blk.q_chunk * bh * s_.cq, o_part, lse_part, g_.dtype,
                       o_.chunk(qs, s_.cq), a.stream);
        }
        if (in_flight) {
          in_flight = false;
          tr_->finish(x, a.stream);
          cur = 1 - cur;
        }
      }
    } catch (...) {
      fail_ring_group(*tr_, s_.rank, in_flight ? &x : nullptr, a.stream);
      throw;
    }
    device_store(a.o, g_.dtype, o_acc, o_.elements(), a.stream);
    if (a.lse != nullptr)
      for (int32_t c = 0; c < s_.chunks; ++c)
        check(cudaMemcpy2DAsync(a.lse + c * s_.cq, sizeof(float) * size_t(s_.sq),
                                lse_acc + c * bh * s_.cq, sizeof(float) * size_t(s_.cq),
                                sizeof(float) * size_t(s_.cq), size_t(bh),
                                cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpy2DAsync (LSE)");
  }

  void backward(const BackwardArgs& a) const override {
    CudaDeviceScope scope(ctx_.device);
    cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
    char* ws = workspace_base(a.workspace);
    float* dq_acc = reinterpret_cast<float*>(ws + bwd_.dq_acc);
    char* dq_part = ws + bwd_.dq_part;
    float* lse_c = reinterpret_cast<float*>(ws + bwd_.lse_chunks);
    char* kv[2] = {ws + bwd_.kv[0], ws + bwd_.kv[1]};
    float* dkv[2] = {reinterpret_cast<float*>(ws + bwd_.dkv[0]),
                     reinterpret_cast<float*>(ws + bwd_.dkv[1])};
    char* dk_part = ws + bwd_.dk_part;
    char* dv_part = ws + bwd_.dv_part;
    void* sub_ws = ws + bwd_.sub;
    const int64_t bh = g_.batch * g_.heads_q;
    const int64_t nk = k_.elements(), nv = v_.elements();

    tr_->check_usable();
    Exchange x;
    bool in_flight = false;
    int kv_cur = 0, dkv_cur = 0;
    try {
      check(cudaMemsetAsync(dq_acc, 0, sizeof(float) * size_t(q_.elements()), stream),
            "cudaMemsetAsync");
      check(cudaMemsetAsync(dkv[0], 0, sizeof(float) * size_t(nk + nv), stream),
            "cudaMemsetAsync");
      // The dense plans read LSE as [batch, heads, chunk]: one copy per chunk.
      for (int32_t c = 0; c < s_.chunks; ++c)
        check(cudaMemcpy2DAsync(lse_c + c * bh * s_.cq, sizeof(float) * size_t(s_.cq),
                                a.lse + c * s_.cq, sizeof(float) * size_t(s_.sq),
                                sizeof(float) * size_t(s_.cq), size_t(bh),
                                cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpy2DAsync (LSE)");
      pack_kv(a.k, a.v, kv[0], stream);
      for (int32_t t = 0; t < s_.size; ++t) {
        if (t + 1 < s_.size) {
          x = {kv[kv_cur], kv[1 - kv_cur], kv_bytes_, s_.tag(ATTN_PASS_BACKWARD, t, Traffic::kv)};
          tr_->start(x, a.stream);
          in_flight = true;
        }
        const char* k = kv[kv_cur];
        const char* v = kv[kv_cur] + size_t(nk) * es_;
        float* dk_acc = dkv[dkv_cur];
        float* dv_acc = dkv[dkv_cur] + nk;
        for (const Block& blk : blocks_[size_t(t)]) {
          const int64_t qs = blk.q_chunk * s_.cq, ks = blk.kv_chunk * s_.ck;
          const int64_t e = int64_t(es_);
          blk.plan->backward(BackwardArgs{
              bytes(a.q) + q_.row_offset(qs) * e, k + k_.row_offset(ks) * e,
              v + v_.row_offset(ks) * e, bytes(a.o) + o_.row_offset(qs) * e,
              lse_c + blk.q_chunk * bh * s_.cq, bytes(a.d_o) + o_.row_offset(qs) * e,
              dq_part + q_.row_offset(qs) * e, dk_part + k_.row_offset(ks) * e,
              dv_part + v_.row_offset(ks) * e, sub_ws, a.stream});
          device_accumulate(dq_acc, dq_part, g_.dtype, q_.chunk(qs, s_.cq), a.stream);
          device_accumulate(dk_acc, dk_part, g_.dtype, k_.chunk(ks, s_.ck), a.stream);
          device_accumulate(dv_acc, dv_part, g_.dtype, v_.chunk(ks, s_.ck), a.stream);
        }
        if (in_flight) {
          in_flight = false;
          tr_->finish(x, a.stream);
          kv_cur = 1 - kv_cur;
        }
        if (s_.size > 1) {  // the accumulators follow their K/V, then go home
          x = {dkv[dkv_cur], dkv[1 - dkv_cur], dkv_bytes_,
               s_.tag(ATTN_PASS_BACKWARD, t, Traffic::dkv)};
          tr_->start(x, a.stream);
          tr_->finish(x, a.stream);
          dkv_cur = 1 - dkv_cur;
        }
      }
    } catch (...) {
      fail_ring_group(*tr_, s_.rank, in_flight ? &x : nullptr, a.stream);
      throw;
    }
    device_store(a.dq, g_.dtype, dq_acc, q_.elements(), a.stream);
    device_store(a.dk, g_.dtype, dkv[dkv_cur], nk, a.stream);
    device_store(a.dv, g_.dtype, dkv[dkv_cur] + nk, nv, a.stream);
  }

 private:
  struct Block {
    int32_t q_chunk, kv_chunk;
    const BackendPlan* plan;
  };
  struct ForwardSpace {
    size_t o_acc = 0, o_part = 0, lse_acc = 0, lse_part = 0, kv[2] = {0, 0}, sub = 0, bytes = 0;
  };
  struct BackwardSpace {
    size_t dq_acc = 0, dq_part = 0, lse_chunks = 0, kv[2] = {0, 0}, dkv[2] = {0, 0}, dk_part = 0,
           dv_part = 0, sub = 0, bytes = 0;
  };

  const BackendPlan* any_plan() const {
    if (aligned_plan_) return aligned_plan_->impl.get();
    return full_plan_ ? full_plan_->impl.get() : nullptr;
  }

  std::unique_ptr<Plan> make_block_plan(bool full) const {
    PlanDesc d;
    d.batch = g_.batch;
    d.heads_q = g_.heads_q;
    d.heads_kv = g_.heads_kv;
    d.seqlen_q = s_.cq;
    d.seqlen_kv = s_.ck;
    d.head_dim_qk = g_.head_dim_qk;
    d.head_dim_v = g_.head_dim_v;
    d.dtype = g_.dtype;
    d.layout = g_.layout;
    d.layout_set = true;
    d.scale = g_.scale;
    d.softcap = g_.softcap;
    d.mask = full ? ATTN_MASK_NONE : g_.mask;
    d.window_left = !full && g_.mask == ATTN_MASK_WINDOW ? g_.window.left : -1;
    d.window_right = !full && g_.mask == ATTN_MASK_WINDOW ? g_.window.right : -1;
    d.allow_empty_rows = true;
    d.passes = g_.backward ? ATTN_PASSES_FORWARD_BACKWARD : ATTN_PASSES_FORWARD;
    d.deterministic = g_.deterministic;
    d.tensors[ATTN_TENSOR_Q] = d.tensors[ATTN_TENSOR_DQ] = q_.view(g_.dtype, s_.cq);
    d.tensors[ATTN_TENSOR_O] = d.tensors[ATTN_TENSOR_DO] = o_.view(g_.dtype, s_.cq);
    d.tensors[ATTN_TENSOR_K] = d.tensors[ATTN_TENSOR_DK] = k_.view(g_.dtype, s_.ck);
    d.tensors[ATTN_TENSOR_V] = d.tensors[ATTN_TENSOR_DV] = v_.view(g_.dtype, s_.ck);
    return create_plan(ctx_, d);
  }

  void build_workspace() {
    const size_t f = sizeof(float);
    const size_t nq = size_t(q_.elements()), no = size_t(o_.elements());
    const size_t nk = size_t(k_.elements()), nv = size_t(v_.elements());
    const size_t lse_local = size_t(g_.batch * g_.heads_q * s_.sq);
    const size_t lse_chunk = size_t(g_.batch * g_.heads_q * s_.cq);
    kv_bytes_ = (nk + nv) * es_;
    dkv_bytes_ = (nk + nv) * f;
    size_t sub_fwd = 0, sub_bwd = 0;
    for (const Plan* p : {full_plan_.get(), aligned_plan_.get()}) {
      if (p == nullptr) continue;
      sub_fwd = std::max(sub_fwd, p->impl->workspace_bytes(ATTN_PASS_FORWARD));
      if (g_.backward) sub_bwd = std::max(sub_bwd, p->impl->workspace_bytes(ATTN_PASS_BACKWARD));
    }
    WorkspaceLayout fl;
    fwd_.o_acc = fl.add(no * f);
    fwd_.o_part = fl.add(no * es_);
    fwd_.lse_acc = fl.add(lse_local * f);
    fwd_.lse_part = fl.add(lse_chunk * f);
    fwd_.kv[0] = fl.add(kv_bytes_);
    fwd_.kv[1] = fl.add(kv_bytes_);
    fwd_.sub = fl.add(sub_fwd);
    fwd_.bytes = fl.total_bytes();
    if (g_.backward) {
      WorkspaceLayout bl;
      bwd_.dq_acc = bl.add(nq * f);
      bwd_.dq_part = bl.add(nq * es_);
      bwd_.lse_chunks = bl.add(lse_local * f);
      bwd_.kv[0] = bl.add(kv_bytes_);
      bwd_.kv[1] = bl.add(kv_bytes_);
      bwd_.dkv[0] = bl.add(dkv_bytes_);
      bwd_.dkv[1] = bl.add(dkv_bytes_);
      bwd_.dk_part = bl.add(nk * es_);
      bwd_.dv_part = bl.add(nv * es_);
      bwd_.sub = bl.add(sub_bwd);
      bwd_.bytes = bl.total_bytes();
    }
    facts.bytes_per_step_forward = kv_bytes_;
    facts.bytes_per_step_backward = kv_bytes_ + dkv_bytes_;
  }

  // Local K then V (contiguous tensors) into the buffer that travels.
  void pack_kv(const void* k, const void* v, char* dst, cudaStream_t stream) const {
    const size_t kb = size_t(k_.elements()) * es_, vb = size_t(v_.elements()) * es_;
    check(cudaMemcpyAsync(dst, k, kb, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync (K)");
    check(cudaMemcpyAsync(dst + kb, v, vb, cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync (V)");
  }

  ContextConfig ctx_;
  Problem g_;
  std::shared_ptr<Transport> tr_;
  RingSchedule s_;
  LocalTensor q_{}, o_{}, k_{}, v_{};
  size_t es_ = 2;
  std::unique_ptr<Plan> full_plan_, aligned_plan_;
  std::vector<std::vector<Block>> blocks_;
  size_t kv_bytes_ = 0, dkv_bytes_ = 0;
  ForwardSpace fwd_;
  BackwardSpace bwd_;
};

}  // namespace

std::unique_ptr<RingBackendPlan> make_cuda_ring_plan(const ContextConfig& ctx, const Problem& global,
                                                     std::shared_ptr<Transport> transport,
                                                     const RingSchedule& schedule) {
  return std::make_unique<CudaRingPlan>(ctx, global, std::move(transport), schedule);
}

}  // namespace attn::ring
