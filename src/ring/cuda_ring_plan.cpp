// Ring attention on the CUDA backend (built with CUDA and NCCL).
//
// The same schedule as the CPU ring plan (ring_schedule.hpp), with the
// blocks run by the CUDA dense kernels, which read the caller's tensors in
// their dtype: query-side tensors are chunk views of the caller's local
// tensors, K/V views of the shard that arrived (in the dtype, as it
// travels). A block is a dense plan whose mask keeps each sequence's global
// diagonal through the kernels' diagonal shift (Problem::diagonal_shift):
// one plan for the fully visible blocks (no mask) and one per distinct set
// of shifts, so windows, seqlen_q != seqlen_kv and varlen batches run as
// on the CPU. Rows a block hides wholly come out of it with LSE = -inf and
// O = 0, which the merge ignores.
//
// Varlen batches work in chunk-major order, as the CPU ring plan: chunk c of
// every sequence packed back to back, then chunk c + 1, so that one chunk is
// a packed (THD) batch and a block one varlen dense plan. With one chunk per
// rank (contiguous) that is the caller's order; with two (zigzag) the
// query-side inputs are gathered into that order in the workspace, K and V
// as they are packed for travel, and the outputs scattered back at the end,
// through token maps built at plan creation (device memory the plan owns).
//
// Each block's O (dtype) and LSE merge into an fp32 running state, and its
// dQ, dK, dV (dtype) are added into fp32 accumulators, by the kernels of
// kernels/ring; dK/dV accumulators travel in fp32. The outputs are written
// once, from the fp32 sums, after the last exchange. All of it is enqueued
// on the caller's stream; the transport orders its own stream with it by
// events, and nothing waits on the host.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "core/workspace.hpp"
#include "cuda/cuda_util.hpp"
#include "ring/ring_ops.hpp"
#include "ring/ring_plan.hpp"
#include "ring/ring_schedule.hpp"

namespace attn::ring {
namespace {

void check(cudaError_t e, const char* what) { cuda::check(e, what, "ring (CUDA)"); }

// One local tensor, contiguous in the plan's layout: [batch, seq, heads,
// dim] (BSHD) or [batch, heads, seq, dim] (BHSD); a varlen batch's
// chunk-major THD tokens are BSHD with batch 1.
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

// The CUDA backend's rule for tensor pointers (attn.h), checked before the
// ring starts: the blocks' plans would find a misaligned Q, O or dO only
// after the first exchange, which fails the whole group, and the gathers
// and stores of the other tensors would not find it at all.
void require_aligned(const void* p, const char* name) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    invalid_argument(name, ": the CUDA kernels need a 16-byte aligned device pointer, got ", p);
}
void require_lse_aligned(const float* lse) {
  if (reinterpret_cast<uintptr_t>(lse) % alignof(float) != 0)
    invalid_argument("lse: the device pointer must be 4-byte aligned");
}

using Traffic = RingSchedule::Traffic;

class CudaRingPlan final : public RingBackendPlan {
 public:
  CudaRingPlan(const ContextConfig& ctx, const Problem& global, std::shared_ptr<Transport> transport,
               const RingSchedule& schedule)
      : ctx_(ctx), g_(global), tr_(std::move(transport)), s_(schedule) {
    es_ = dtype_size(g_.dtype);
    if (g_.varlen) {
      // Chunk-major THD: [chunks * rows, heads, dim], seen as one sequence.
      cu_q_.assign(1, 0);
      cu_k_.assign(1, 0);
      for (int64_t b = 0; b < g_.batch; ++b) {
        cu_q_.push_back(cu_q_.back() + s_.cq_seq[size_t(b)]);
        cu_k_.push_back(cu_k_.back() + s_.ck_seq[size_t(b)]);
      }
      rows_q_ = cu_q_.back();
      rows_k_ = cu_k_.back();
      bh_ = g_.heads_q;
      permuted_ = s_.chunks > 1;
      const attn_layout_t L = ATTN_LAYOUT_BSHD;
      q_ = {L, 1, s_.sq, g_.heads_q, g_.head_dim_qk};
      o_ = {L, 1, s_.sq, g_.heads_q, g_.head_dim_v};
      k_ = {L, 1, s_.sk, g_.heads_kv, g_.head_dim_qk};
      v_ = {L, 1, s_.sk, g_.heads_kv, g_.head_dim_v};
    } else {
      rows_q_ = s_.cq;
      rows_k_ = s_.ck;
      bh_ = g_.batch * g_.heads_q;
      const attn_layout_t L = g_.layout;
      q_ = {L, g_.batch, s_.sq, g_.heads_q, g_.head_dim_qk};
      o_ = {L, g_.batch, s_.sq, g_.heads_q, g_.head_dim_v};
      k_ = {L, g_.batch, s_.sk, g_.heads_kv, g_.head_dim_qk};
      v_ = {L, g_.batch, s_.sk, g_.heads_kv, g_.head_dim_v};
    }

    // One dense plan for the fully visible blocks and one per distinct set
    // of diagonal shifts of the others. Ranks' block plans differ only in
    // their shifts, which the CUDA kernels take whatever they are, so every
    // rank reaches the same verdict.
    const auto plans = block_plans(s_, [&](bool full, const std::vector<int64_t>& shifts) {
      plans_.push_back(make_block_plan(full, shifts));
      return static_cast<const BackendPlan*>(plans_.back()->impl.get());
    });
    blocks_.resize(s_.steps.size());
    for (size_t t = 0; t < s_.steps.size(); ++t)
      for (size_t i = 0; i < s_.steps[t].size(); ++i)
        blocks_[t].push_back(Block{s_.steps[t][i].q_chunk, s_.steps[t][i].kv_chunk, plans[t][i]});
    fill_facts(facts, s_, tr_->name());
    build_workspace();
    if (permuted_) upload_token_maps();
  }

  ~CudaRingPlan() override {
    if (maps_dev_ == nullptr) return;
    int prev = 0;
    const bool switched = cudaGetDevice(&prev) == cudaSuccess && prev != ctx_.device &&
                          cudaSetDevice(ctx_.device) == cudaSuccess;
    (void)cudaFree(maps_dev_);
    if (switched) (void)cudaSetDevice(prev);
    (void)cudaGetLastError();
  }
  CudaRingPlan(const CudaRingPlan&) = delete;
  CudaRingPlan& operator=(const CudaRingPlan&) = delete;

  size_t workspace_bytes(attn_pass_t pass) const override {
    return pass == ATTN_PASS_FORWARD ? fwd_.bytes : bwd_.bytes;
  }
  int32_t tile_q() const override { return any_plan() ? any_plan()->tile_q() : 0; }
  int32_t tile_kv() const override { return any_plan() ? any_plan()->tile_kv() : 0; }
  int32_t num_threads() const override { return 1; }
  const char* algorithm() const override { return "ring-attention"; }
  const char* kernel() const override { return any_plan() ? any_plan()->kernel() : "none"; }

  void forward(const ForwardArgs& a) const override {
    require_aligned(a.q, "q");
    require_aligned(a.k, "k");
    require_aligned(a.v, "v");
    require_aligned(a.o, "o");
    require_lse_aligned(a.lse);
    cuda::DeviceScope scope(ctx_.device, "ring (CUDA)");
    cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
    char* ws = workspace_base(a.workspace);
    float* o_acc = reinterpret_cast<float*>(ws + fwd_.o_acc);
    char* o_part = ws + fwd_.o_part;
    float* lse_acc = reinterpret_cast<float*>(ws + fwd_.lse_acc);
    float* lse_part = reinterpret_cast<float*>(ws + fwd_.lse_part);
    char* kv[2] = {ws + fwd_.kv[0], ws + fwd_.kv[1]};
    void* sub_ws = ws + fwd_.sub;
    const int64_t e = int64_t(es_);

    tr_->check_usable();
    Exchange x;
    bool in_flight = false;
    try {
      const char* q = bytes(a.q);
      if (permuted_) {
        gather_q_side(ws + fwd_.q_perm, a.q, q_, a.stream);
        q = ws + fwd_.q_perm;
      }
      check(cudaMemsetAsync(o_acc, 0, sizeof(float) * size_t(o_.elements()), stream),
            "cudaMemsetAsync");
      device_fill(lse_acc, -std::numeric_limits<float>::infinity(), bh_ * s_.sq, a.stream);
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
          const int64_t qs = blk.q_chunk * rows_q_, ks = blk.kv_chunk * rows_k_;
          blk.plan->forward(ForwardArgs{q + q_.row_offset(qs) * e, k + k_.row_offset(ks) * e,
                                        v + v_.row_offset(ks) * e, o_part + o_.row_offset(qs) * e,
                                        lse_part, sub_ws, a.stream});
          device_merge(o_acc, lse_acc + blk.q_chunk * bh_ * rows_q_, o_part, lse_part, g_.dtype,
                       o_.chunk(qs, rows_q_), a.stream);
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
    store_output(a.o, o_acc, o_, map_q(), a.stream);
    if (a.lse == nullptr) return;
    if (permuted_) {
      device_permute_lse(a.lse, lse_acc, map_q(), s_.chunks, g_.heads_q, rows_q_, s_.sq, true,
                         a.stream);
      return;
    }
    for (int32_t c = 0; c < s_.chunks; ++c)
      check(cudaMemcpy2DAsync(a.lse + c * rows_q_, sizeof(float) * size_t(s_.sq),
                              lse_acc + c * bh_ * rows_q_, sizeof(float) * size_t(rows_q_),
                              sizeof(float) * size_t(rows_q_), size_t(bh_),
                              cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpy2DAsync (LSE)");
  }

  void backward(const BackwardArgs& a) const override {
    require_aligned(a.q, "q");
    require_aligned(a.k, "k");
    require_aligned(a.v, "v");
    require_aligned(a.o, "o");
    require_lse_aligned(a.lse);
    require_aligned(a.d_o, "d_o");
    require_aligned(a.dq, "dq");
    require_aligned(a.dk, "dk");
    require_aligned(a.dv, "dv");
    cuda::DeviceScope scope(ctx_.device, "ring (CUDA)");
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
    const int64_t nk = k_.elements(), nv = v_.elements();
    const int64_t e = int64_t(es_);

    tr_->check_usable();
    Exchange x;
    bool in_flight = false;
    int kv_cur = 0, dkv_cur = 0;
    try {
      const char *q = bytes(a.q), *o = bytes(a.o), *d_o = bytes(a.d_o);
      if (permuted_) {
        gather_q_side(ws + bwd_.q_perm, a.q, q_, a.stream);
        gather_q_side(ws + bwd_.o_perm, a.o, o_, a.stream);
        gather_q_side(ws + bwd_.do_perm, a.d_o, o_, a.stream);
        q = ws + bwd_.q_perm, o = ws + bwd_.o_perm, d_o = ws + bwd_.do_perm;
      }
      check(cudaMemsetAsync(dq_acc, 0, sizeof(float) * size_t(q_.elements()), stream),
            "cudaMemsetAsync");
      check(cudaMemsetAsync(dkv[0], 0, sizeof(float) * size_t(nk + nv), stream),
            "cudaMemsetAsync");
      // The dense plans read LSE as [batch, heads, chunk rows]: one copy per chunk.
      if (permuted_)
        device_permute_lse(lse_c, a.lse, map_q(), s_.chunks, g_.heads_q, rows_q_, s_.sq, false,
                           a.stream);
      else
        for (int32_t c = 0; c < s_.chunks; ++c)
          check(cudaMemcpy2DAsync(lse_c + c * bh_ * rows_q_, sizeof(float) * size_t(rows_q_),
                                  a.lse + c * rows_q_, sizeof(float) * size_t(s_.sq),
                                  sizeof(float) * size_t(rows_q_), size_t(bh_),
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
          const int64_t qs = blk.q_chunk * rows_q_, ks = blk.kv_chunk * rows_k_;
          blk.plan->backward(BackwardArgs{
              q + q_.row_offset(qs) * e, k + k_.row_offset(ks) * e, v + v_.row_offset(ks) * e,
              o + o_.row_offset(qs) * e, lse_c + blk.q_chunk * bh_ * rows_q_,
              d_o + o_.row_offset(qs) * e, dq_part + q_.row_offset(qs) * e,
              dk_part + k_.row_offset(ks) * e, dv_part + v_.row_offset(ks) * e, sub_ws, a.stream});
          device_accumulate(dq_acc, dq_part, g_.dtype, q_.chunk(qs, rows_q_), a.stream);
          device_accumulate(dk_acc, dk_part, g_.dtype, k_.chunk(ks, rows_k_), a.stream);
          device_accumulate(dv_acc, dv_part, g_.dtype, v_.chunk(ks, rows_k_), a.stream);
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
    store_output(a.dq, dq_acc, q_, map_q(), a.stream);
    store_output(a.dk, dkv[dkv_cur], k_, map_k(), a.stream);
    store_output(a.dv, dkv[dkv_cur] + nk, v_, map_k(), a.stream);
  }

 private:
  struct Block {
    int32_t q_chunk, kv_chunk;
    const BackendPlan* plan;
  };
  struct ForwardSpace {
    size_t o_acc = 0, o_part = 0, lse_acc = 0, lse_part = 0, kv[2] = {0, 0}, q_perm = 0, sub = 0,
           bytes = 0;
  };
  struct BackwardSpace {
    size_t dq_acc = 0, dq_part = 0, lse_chunks = 0, kv[2] = {0, 0}, dkv[2] = {0, 0}, dk_part = 0,
           dv_part = 0, q_perm = 0, o_perm = 0, do_perm = 0, sub = 0, bytes = 0;
  };

  const BackendPlan* any_plan() const {
    return plans_.empty() ? nullptr : plans_.front()->impl.get();
  }

  // A dense plan over one block: fixed length, chunk views of the local
  // tensors (layout strides); varlen, one chunk of the chunk-major order
  // (contiguous THD, sequence b with its chunk lengths).
  std::unique_ptr<Plan> make_block_plan(bool full, const std::vector<int64_t>& shifts) const {
    PlanDesc d;
    d.batch = g_.batch;
    d.heads_q = g_.heads_q;
    d.heads_kv = g_.heads_kv;
    d.head_dim_qk = g_.head_dim_qk;
    d.head_dim_v = g_.head_dim_v;
    d.dtype = g_.dtype;
    d.scale = g_.scale;
    d.softcap = g_.softcap;
    d.mask = full ? ATTN_MASK_NONE : g_.mask;
    d.window_left = !full && g_.mask == ATTN_MASK_WINDOW ? g_.window.left : -1;
    d.window_right = !full && g_.mask == ATTN_MASK_WINDOW ? g_.window.right : -1;
    d.allow_empty_rows = true;  // a block may hide rows that other blocks show
    d.passes = g_.backward ? ATTN_PASSES_FORWARD_BACKWARD : ATTN_PASSES_FORWARD;
    d.deterministic = g_.deterministic;
    if (!full) d.diagonal_shift = shifts;
    if (g_.varlen) {
      d.varlen = true;
      d.varlen_batch = g_.batch;
      d.cu_q = cu_q_;
      d.cu_kv = cu_k_;
      d.seqlen_q = *std::max_element(s_.cq_seq.begin(), s_.cq_seq.end());
      d.seqlen_kv = *std::max_element(s_.ck_seq.begin(), s_.ck_seq.end());
      return create_plan(ctx_, d);
    }
    d.seqlen_q = s_.cq;
    d.seqlen_kv = s_.ck;
    d.layout = g_.layout;
    d.layout_set = true;
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
    const size_t lse_local = size_t(bh_ * s_.sq);
    const size_t lse_chunk = size_t(bh_ * rows_q_);
    kv_bytes_ = (nk + nv) * es_;
    dkv_bytes_ = (nk + nv) * f;
    size_t sub_fwd = 0, sub_bwd = 0;
    for (const auto& p : plans_) {
      sub_fwd = std::max(sub_fwd, p->impl->workspace_bytes(ATTN_PASS_FORWARD));
      if (g_.backward) sub_bwd = std::max(sub_bwd, p->impl->workspace_bytes(ATTN_PASS_BACKWARD));
    }
    const size_t perm = permuted_ ? 1 : 0;  // chunk-major copies of Q, O, dO
    WorkspaceLayout fl;
    fwd_.o_acc = fl.add(no * f);
    fwd_.o_part = fl.add(no * es_);
    fwd_.lse_acc = fl.add(lse_local * f);
    fwd_.lse_part = fl.add(lse_chunk * f);
    fwd_.kv[0] = fl.add(kv_bytes_);
    fwd_.kv[1] = fl.add(kv_bytes_);
    fwd_.q_perm = fl.add(perm * nq * es_);
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
      bwd_.q_perm = bl.add(perm * nq * es_);
      bwd_.o_perm = bl.add(perm * no * es_);
      bwd_.do_perm = bl.add(perm * no * es_);
      bwd_.sub = bl.add(sub_bwd);
      bwd_.bytes = bl.total_bytes();
    }
    facts.bytes_per_step_forward = kv_bytes_;
    facts.bytes_per_step_backward = kv_bytes_ + dkv_bytes_;
  }

  // Varlen zigzag: for each token of the chunk-major order (chunk c, then
  // sequence b, then position i), its token in the caller's order (sequence
  // b's two chunks back to back): [Q side (s_.sq), K side (s_.sk)].
  void upload_token_maps() {
    std::vector<int32_t> host;
    host.reserve(size_t(s_.sq + s_.sk));
    for (const std::vector<int64_t>* cu : {&cu_q_, &cu_k_})
      for (int32_t c = 0; c < s_.chunks; ++c)
        for (size_t b = 0; b + 1 < cu->size(); ++b) {
          const int64_t len = (*cu)[b + 1] - (*cu)[b];
          for (int64_t i = 0; i < len; ++i)
            host.push_back(int32_t(s_.chunks * (*cu)[b] + c * len + i));
        }
    cuda::DeviceScope scope(ctx_.device, "ring (CUDA)");
    const size_t size = std::max<size_t>(host.size(), 1) * sizeof(int32_t);
    void* dev = nullptr;
    const cudaError_t ae = cudaMalloc(&dev, size);
    if (ae == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      fail(ATTN_STATUS_OUT_OF_MEMORY, "ring (CUDA): no device memory for ", size,
           " bytes of token maps");
    }
    check(ae, "cudaMalloc");
    try {
      if (!host.empty())
        check(cudaMemcpy(dev, host.data(), host.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
              "cudaMemcpy (token maps)");
    } catch (...) {
      (void)cudaFree(dev);  // the constructor fails: no destructor runs
      throw;
    }
    maps_dev_ = static_cast<int32_t*>(dev);  // owned from here: the destructor frees it
  }
  const int32_t* map_q() const { return maps_dev_; }
  const int32_t* map_k() const { return maps_dev_ == nullptr ? nullptr : maps_dev_ + s_.sq; }

  // The caller's query-side tensor t into chunk-major order at dst.
  void gather_q_side(char* dst, const void* src, const LocalTensor& t, void* stream) const {
    device_gather_rows(dst, src, map_q(), t.seq, t.heads * t.dim * int64_t(es_), stream);
  }

  // An output from its fp32 sum (chunk-major for varlen zigzag).
  void store_output(void* dst, const float* src, const LocalTensor& t, const int32_t* map,
                    void* stream) const {
    if (permuted_)
      device_scatter_store(dst, g_.dtype, src, map, t.seq, t.heads * t.dim, stream);
    else
      device_store(dst, g_.dtype, src, t.elements(), stream);
  }

  // Local K then V into the buffer that travels (chunk-major for varlen zigzag).
  void pack_kv(const void* k, const void* v, char* dst, cudaStream_t stream) const {
    const size_t kb = size_t(k_.elements()) * es_, vb = size_t(v_.elements()) * es_;
    if (permuted_) {
      device_gather_rows(dst, k, map_k(), k_.seq, k_.heads * k_.dim * int64_t(es_), stream);
      device_gather_rows(dst + kb, v, map_k(), v_.seq, v_.heads * v_.dim * int64_t(es_), stream);
      return;
    }
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
  int64_t rows_q_ = 0, rows_k_ = 0;  // rows of one chunk (per batch entry; varlen: in all)
  int64_t bh_ = 0;                   // LSE rows per chunk row: batch * heads_q (varlen: heads_q)
  bool permuted_ = false;            // varlen zigzag: chunk-major copies and token maps
  std::vector<int64_t> cu_q_, cu_k_;  // varlen: offsets of the sequences in one chunk
  std::vector<std::unique_ptr<Plan>> plans_;
  std::vector<std::vector<Block>> blocks_;
  int32_t* maps_dev_ = nullptr;  // varlen zigzag: token maps (upload_token_maps)
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
