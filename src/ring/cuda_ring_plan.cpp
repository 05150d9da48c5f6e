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
//
// Two options, read from the environment at plan creation (RingOptions):
// ATTN_RING_PROFILE=1 (off by default) records CUDA events between the
// pieces of every step for ring_profile(); the backward keeps the own
// shard's dK/dV home (backward_dkv_home) unless ATTN_RING_DKV_HOME=0.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
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

// The CUDA backend's rules for tensor pointers (cuda_util.hpp), checked
// before the ring starts: the blocks' plans would find a misaligned Q, O or
// dO only after the first exchange, which fails the whole group, and the
// gathers and stores of the other tensors would not find it at all.
using cuda::require_aligned;
using cuda::require_lse_aligned;

using Traffic = RingSchedule::Traffic;

// CUDA events between the pieces of one pass, created with the plan; each
// execution re-records them (a plan profiles one execution at a time).
class PassProfile {
 public:
  void create(size_t marks) {
    events_.assign(marks, nullptr);
    labels_.assign(marks, RingPieceTime{-1, -1, RingPiece::prologue, 0.0f});
    for (cudaEvent_t& ev : events_) check(cudaEventCreate(&ev), "cudaEventCreate (profile)");
  }
  void destroy() noexcept {
    for (cudaEvent_t ev : events_)
      if (ev != nullptr) (void)cudaEventDestroy(ev);
    events_.clear();
  }
  bool on() const { return !events_.empty(); }

  // The start of a pass.
  void begin(cudaStream_t stream) {
    used_ = 0;
    mark(stream, -1, -1, RingPiece::prologue);
  }
  // The end of a piece (what ran on the stream since the previous mark).
  void mark(cudaStream_t stream, int32_t step, int32_t block, RingPiece what) {
    if (used_ >= events_.size()) return;
    check(cudaEventRecord(events_[used_], stream), "cudaEventRecord (profile)");
    labels_[used_] = RingPieceTime{step, block, what, 0.0f};
    ++used_;
  }
  std::vector<RingPieceTime> read() const {
    std::vector<RingPieceTime> out;
    if (used_ < 2) return out;
    check(cudaEventSynchronize(events_[used_ - 1]), "cudaEventSynchronize (profile)");
    for (size_t i = 1; i < used_; ++i) {
      RingPieceTime p = labels_[i];
      check(cudaEventElapsedTime(&p.ms, events_[i - 1], events_[i]), "cudaEventElapsedTime");
      out.push_back(p);
    }
    return out;
  }

 private:
  std::vector<cudaEvent_t> events_;
  std::vector<RingPieceTime> labels_;
  size_t used_ = 0;
};

class CudaRingPlan final : public RingBackendPlan {
 public:
  CudaRingPlan(const ContextConfig& ctx, const Problem& global, std::shared_ptr<Transport> transport,
               const RingSchedule& schedule, const RingOptions& options)
      : ctx_(ctx), g_(global), tr_(std::move(transport)), s_(schedule) {
    dkv_home_ = options.dkv_home && g_.backward && s_.size > 1;
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
    if (dkv_home_) facts.exchanges_backward = 2 * s_.size - 2;  // no dK/dV exchange after step 0
    build_workspace();
    if (permuted_) upload_token_maps();
    if (options.profile) create_profiles();
  }

  ~CudaRingPlan() override { release(); }
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

  std::vector<RingPieceTime> profile(attn_pass_t pass) const override {
    cuda::DeviceScope scope(ctx_.device, "ring (CUDA)");
    const std::lock_guard<std::mutex> lock(prof_mutex_);
    return (pass == ATTN_PASS_FORWARD ? prof_fwd_ : prof_bwd_).read();
  }

  // A profiling plan records each pass into one set of events: its passes
  // (and reads of the profile) take turns, so that concurrent calls on the
  // plan stay as safe as without profiling. Plans without it lock nothing.
  std::unique_lock<std::mutex> profile_turn() const {
    return prof_fwd_.on() || prof_bwd_.on() ? std::unique_lock<std::mutex>(prof_mutex_)
                                            : std::unique_lock<std::mutex>();
  }

  void forward(const ForwardArgs& a) const override {
    const ExecutionTurn turn_of_comm(*tr_);
    const std::unique_lock<std::mutex> turn = profile_turn();
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
    PassProfile& prof = prof_fwd_;
    if (prof.on()) prof.begin(stream);
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
      if (prof.on()) prof.mark(stream, -1, -1, RingPiece::prologue);
      int cur = 0;
      for (int32_t t = 0; t < s_.size; ++t) {
        if (t + 1 < s_.size) {
          x = {kv[cur], kv[1 - cur], kv_bytes_, s_.tag(ATTN_PASS_FORWARD, t, Traffic::kv)};
          in_flight = true;  // (also when start throws: NCCL may have enqueued it)
          tr_->start(x, a.stream);
        }
        const char* k = kv[cur];
        const char* v = kv[cur] + size_t(k_.elements()) * es_;
        int32_t bi = 0;
        for (const Block& blk : blocks_[size_t(t)]) {
          const int64_t qs = blk.q_chunk * rows_q_, ks = blk.kv_chunk * rows_k_;
          blk.plan->forward(ForwardArgs{q + q_.row_offset(qs) * e, k + k_.row_offset(ks) * e,
                                        v + v_.row_offset(ks) * e, o_part + o_.row_offset(qs) * e,
                                        lse_part, sub_ws, a.stream});
          if (prof.on()) prof.mark(stream, t, bi, RingPiece::block);
          device_merge(o_acc, lse_acc + blk.q_chunk * bh_ * rows_q_, o_part, lse_part, g_.dtype,
                       o_.chunk(qs, rows_q_), a.stream);
          if (prof.on()) prof.mark(stream, t, bi, RingPiece::merge);
          ++bi;
        }
        if (in_flight) {
          in_flight = false;
          tr_->finish(x, a.stream);
          if (prof.on()) prof.mark(stream, t, -1, RingPiece::wait_kv);
          cur = 1 - cur;
        }
      }
    } catch (...) {
      fail_ring_group(*tr_, s_.rank, in_flight ? &x : nullptr, a.stream);
      throw;
    }
    store_output(a.o, o_acc, o_, map_q(), a.stream);
    if (a.lse != nullptr) {
      if (permuted_)
        device_permute_lse(a.lse, lse_acc, map_q(), s_.chunks, g_.heads_q, rows_q_, s_.sq, true,
                           a.stream);
      else
        for (int32_t c = 0; c < s_.chunks; ++c)
          check(cudaMemcpy2DAsync(a.lse + c * rows_q_, sizeof(float) * size_t(s_.sq),
                                  lse_acc + c * bh_ * rows_q_, sizeof(float) * size_t(rows_q_),
                                  sizeof(float) * size_t(rows_q_), size_t(bh_),
                                  cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpy2DAsync (LSE)");
    }
    if (prof.on()) prof.mark(stream, -1, -1, RingPiece::epilogue);
  }

  void backward(const BackwardArgs& a) const override {
    const ExecutionTurn turn_of_comm(*tr_);
    const std::unique_lock<std::mutex> turn = profile_turn();
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
    BackwardBuffers b = backward_buffers(a);
    PassProfile& prof = prof_bwd_;

    tr_->check_usable();
    if (prof.on()) prof.begin(stream);
    if (dkv_home_) {
      backward_dkv_home(a, b);
      return;
    }
    Exchange x;
    bool in_flight = false;
    int kv_cur = 0, dkv_cur = 0;
    try {
      backward_prologue(a, b);
      pack_kv(a.k, a.v, b.kv[0], stream);
      if (prof.on()) prof.mark(stream, -1, -1, RingPiece::prologue);
      for (int32_t t = 0; t < s_.size; ++t) {
        backward_kv_step(a, b, t, x, in_flight, kv_cur, dkv_cur);
        if (s_.size > 1) {  // the accumulators follow their K/V, then go home
          x = {b.dkv[dkv_cur], b.dkv[1 - dkv_cur], dkv_bytes_,
               s_.tag(ATTN_PASS_BACKWARD, t, Traffic::dkv)};
          in_flight = true;
          tr_->start(x, a.stream);
          in_flight = false;
          tr_->finish(x, a.stream);
          if (prof.on()) prof.mark(stream, t, -1, RingPiece::exchange_dkv);
          dkv_cur = 1 - dkv_cur;
        }
      }
    } catch (...) {
      fail_ring_group(*tr_, s_.rank, in_flight ? &x : nullptr, a.stream);
      throw;
    }
    store_output(a.dq, b.dq_acc, q_, map_q(), a.stream);
    store_output(a.dk, b.dkv[dkv_cur], k_, map_k(), a.stream);
    store_output(a.dv, b.dkv[dkv_cur] + k_.elements(), v_, map_k(), a.stream);
    if (prof.on()) prof.mark(stream, -1, -1, RingPiece::epilogue);
  }

 private:
  // The backward's workspace regions and its query-side inputs (chunk-major
  // copies for varlen zigzag, filled by backward_prologue).
  struct BackwardBuffers {
    float* dq_acc;
    char* dq_part;
    float* lse_c;
    char* kv[2];
    float* dkv[2];
    char* kv_own;    // dkv_home: the own K/V, never received into
    float* dkv_own;  // dkv_home: the own shard's dK, dV sums
    char* dk_part;
    char* dv_part;
    void* sub_ws;
    const char *q, *o, *d_o;
  };

  // Backward step t on the travelling K/V buffer kv_cur (accumulating into
  // dkv_cur), while the next K/V arrives into the other buffer (steps before
  // the last); x and in_flight say what is in flight, for the error path.
  void backward_kv_step(const BackwardArgs& a, BackwardBuffers& b, int32_t t, Exchange& x,
                        bool& in_flight, int& kv_cur, int dkv_cur) const {
    cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
    PassProfile& prof = prof_bwd_;
    if (t + 1 < s_.size) {
      x = {b.kv[kv_cur], b.kv[1 - kv_cur], kv_bytes_, s_.tag(ATTN_PASS_BACKWARD, t, Traffic::kv)};
      in_flight = true;  // (also when start throws: NCCL may have enqueued it)
      tr_->start(x, a.stream);
    }
    for (size_t i = 0; i < blocks_[size_t(t)].size(); ++i)
      backward_block(a, b, t, i, b.kv[kv_cur], b.dkv[dkv_cur]);
    if (in_flight) {
      in_flight = false;
      tr_->finish(x, a.stream);
      if (prof.on()) prof.mark(stream, t, -1, RingPiece::wait_kv);
      kv_cur = 1 - kv_cur;
    }
  }

  // The backward with the own shard's dK/dV kept home (RingOptions::dkv_home,
  // 2 or more ranks). Step 0's blocks (the own K/V, from a copy that never
  // travels) are split: the first runs while the first K/V exchange is in
  // flight, the others after the last foreign step, while the travelling
  // accumulator goes home. That accumulator starts at zero at step 1 and
  // collects the foreign holders' dK/dV; the owner adds it to its own sums.
  // Every rank posts the same exchanges in the same order: K/V after steps
  // 0 .. size - 2, dK/dV after steps 1 .. size - 1.
  void backward_dkv_home(const BackwardArgs& a, BackwardBuffers& b) const {
    cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
    PassProfile& prof = prof_bwd_;
    const std::vector<Block>& own = blocks_[0];
    const size_t own_head = std::min<size_t>(own.size(), 1);
    Exchange x;
    bool in_flight = false;
    int kv_cur = 0, dkv_cur = 0;
    try {
      backward_prologue(a, b);
      check(cudaMemsetAsync(b.dkv_own, 0, dkv_bytes_, stream), "cudaMemsetAsync");
      pack_kv(a.k, a.v, b.kv_own, stream);
      if (prof.on()) prof.mark(stream, -1, -1, RingPiece::prologue);
      x = {b.kv_own, b.kv[0], kv_bytes_, s_.tag(ATTN_PASS_BACKWARD, 0, Traffic::kv)};
      in_flight = true;  // (also when start throws: NCCL may have enqueued it)
      tr_->start(x, a.stream);
      for (size_t i = 0; i < own_head; ++i) backward_block(a, b, 0, i, b.kv_own, b.dkv_own);
      in_flight = false;
      tr_->finish(x, a.stream);
      if (prof.on()) prof.mark(stream, 0, -1, RingPiece::wait_kv);
      for (int32_t t = 1; t < s_.size; ++t) {
        backward_kv_step(a, b, t, x, in_flight, kv_cur, dkv_cur);
        x = {b.dkv[dkv_cur], b.dkv[1 - dkv_cur], dkv_bytes_,
             s_.tag(ATTN_PASS_BACKWARD, t, Traffic::dkv)};
        in_flight = true;
        tr_->start(x, a.stream);
        dkv_cur = 1 - dkv_cur;
        if (t + 1 < s_.size) {  // the next holder adds into it at once
          in_flight = false;
          tr_->finish(x, a.stream);
          if (prof.on()) prof.mark(stream, t, -1, RingPiece::exchange_dkv);
        }  // else going home: the rest of the own blocks cover it
      }
      for (size_t i = own_head; i < own.size(); ++i)
        backward_block(a, b, 0, i, b.kv_own, b.dkv_own);
      in_flight = false;
      tr_->finish(x, a.stream);
      if (prof.on()) prof.mark(stream, s_.size - 1, -1, RingPiece::exchange_dkv);
    } catch (...) {
      fail_ring_group(*tr_, s_.rank, in_flight ? &x : nullptr, a.stream);
      throw;
    }
    // The own sums plus the foreign ones that came home (fp32 += fp32, all rows).
    device_accumulate(b.dkv_own, b.dkv[dkv_cur], ATTN_DTYPE_FP32, k_.chunk(0, k_.seq), a.stream);
    device_accumulate(b.dkv_own + k_.elements(), b.dkv[dkv_cur] + k_.elements(), ATTN_DTYPE_FP32,
                      v_.chunk(0, v_.seq), a.stream);
    store_output(a.dq, b.dq_acc, q_, map_q(), a.stream);
    store_output(a.dk, b.dkv_own, k_, map_k(), a.stream);
    store_output(a.dv, b.dkv_own + k_.elements(), v_, map_k(), a.stream);
    if (prof.on()) prof.mark(stream, -1, -1, RingPiece::epilogue);
  }

  BackwardBuffers backward_buffers(const BackwardArgs& a) const {
    char* ws = workspace_base(a.workspace);
    BackwardBuffers b;
    b.dq_acc = reinterpret_cast<float*>(ws + bwd_.dq_acc);
    b.dq_part = ws + bwd_.dq_part;
    b.lse_c = reinterpret_cast<float*>(ws + bwd_.lse_chunks);
    b.kv[0] = ws + bwd_.kv[0];
    b.kv[1] = ws + bwd_.kv[1];
    b.dkv[0] = reinterpret_cast<float*>(ws + bwd_.dkv[0]);
    b.dkv[1] = reinterpret_cast<float*>(ws + bwd_.dkv[1]);
    b.kv_own = ws + bwd_.kv_own;
    b.dkv_own = reinterpret_cast<float*>(ws + bwd_.dkv_own);
    b.dk_part = ws + bwd_.dk_part;
    b.dv_part = ws + bwd_.dv_part;
    b.sub_ws = ws + bwd_.sub;
    b.q = bytes(a.q), b.o = bytes(a.o), b.d_o = bytes(a.d_o);
    if (permuted_) b.q = ws + bwd_.q_perm, b.o = ws + bwd_.o_perm, b.d_o = ws + bwd_.do_perm;
    return b;
  }

  // Zeroes the sums (dQ, the first dK/dV accumulator), gathers the
  // query-side inputs (varlen zigzag) and lays out LSE per chunk.
  void backward_prologue(const BackwardArgs& a, const BackwardBuffers& b) const {
    cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
    char* ws = workspace_base(a.workspace);
    if (permuted_) {
      gather_q_side(ws + bwd_.q_perm, a.q, q_, a.stream);
      gather_q_side(ws + bwd_.o_perm, a.o, o_, a.stream);
      gather_q_side(ws + bwd_.do_perm, a.d_o, o_, a.stream);
    }
    check(cudaMemsetAsync(b.dq_acc, 0, sizeof(float) * size_t(q_.elements()), stream),
          "cudaMemsetAsync");
    check(cudaMemsetAsync(b.dkv[0], 0, dkv_bytes_, stream), "cudaMemsetAsync");
    // The dense plans read LSE as [batch, heads, chunk rows]: one copy per chunk.
    if (permuted_)
      device_permute_lse(b.lse_c, a.lse, map_q(), s_.chunks, g_.heads_q, rows_q_, s_.sq, false,
                         a.stream);
    else
      for (int32_t c = 0; c < s_.chunks; ++c)
        check(cudaMemcpy2DAsync(b.lse_c + c * bh_ * rows_q_, sizeof(float) * size_t(rows_q_),
                                a.lse + c * rows_q_, sizeof(float) * size_t(s_.sq),
                                sizeof(float) * size_t(rows_q_), size_t(bh_),
                                cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpy2DAsync (LSE)");
  }

  // Block i of step t on the K/V at `kv` (K then V): its dense backward,
  // then dQ into the local sum and dK, dV into `dkv` (dK then dV, fp32).
  void backward_block(const BackwardArgs& a, const BackwardBuffers& b, int32_t t, size_t i,
                      const char* kv, float* dkv) const {
    const Block& blk = blocks_[size_t(t)][i];
    const int64_t e = int64_t(es_), nk = k_.elements();
    const int64_t qs = blk.q_chunk * rows_q_, ks = blk.kv_chunk * rows_k_;
    const char* k = kv;
    const char* v = kv + size_t(nk) * es_;
    blk.plan->backward(BackwardArgs{
        b.q + q_.row_offset(qs) * e, k + k_.row_offset(ks) * e, v + v_.row_offset(ks) * e,
        b.o + o_.row_offset(qs) * e, b.lse_c + blk.q_chunk * bh_ * rows_q_,
        b.d_o + o_.row_offset(qs) * e, b.dq_part + q_.row_offset(qs) * e,
        b.dk_part + k_.row_offset(ks) * e, b.dv_part + v_.row_offset(ks) * e, b.sub_ws,
        a.stream});
    cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
    if (prof_bwd_.on()) prof_bwd_.mark(stream, t, int32_t(i), RingPiece::block);
    device_accumulate(b.dq_acc, b.dq_part, g_.dtype, q_.chunk(qs, rows_q_), a.stream);
    device_accumulate(dkv, b.dk_part, g_.dtype, k_.chunk(ks, rows_k_), a.stream);
    device_accumulate(dkv + nk, b.dv_part, g_.dtype, v_.chunk(ks, rows_k_), a.stream);
    if (prof_bwd_.on()) prof_bwd_.mark(stream, t, int32_t(i), RingPiece::accumulate);
  }

  void create_profiles() {
    cuda::DeviceScope scope(ctx_.device, "ring (CUDA)");
    // Marks: start, prologue, per step a block and a merge / accumulation
    // per block, a K/V wait and a dK/dV exchange; the epilogue; a spare.
    size_t marks = 4;
    for (const auto& step : blocks_) marks += 2 * step.size() + 2;
    try {
      prof_fwd_.create(marks);
      if (g_.backward) prof_bwd_.create(marks);
    } catch (...) {
      release();  // the constructor fails: no destructor runs
      throw;
    }
  }

  void release() noexcept {
    int prev = 0;
    const bool switched = cudaGetDevice(&prev) == cudaSuccess && prev != ctx_.device &&
                          cudaSetDevice(ctx_.device) == cudaSuccess;
    prof_fwd_.destroy();
    prof_bwd_.destroy();
    if (maps_dev_ != nullptr) (void)cudaFree(maps_dev_);
    maps_dev_ = nullptr;
    if (switched) (void)cudaSetDevice(prev);
    (void)cudaGetLastError();
  }
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
           dv_part = 0, q_perm = 0, o_perm = 0, do_perm = 0, kv_own = 0, dkv_own = 0, sub = 0,
           bytes = 0;
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
      const size_t home = dkv_home_ ? 1 : 0;  // the own K/V copy and dK/dV sums
      bwd_.kv_own = bl.add(home * kv_bytes_);
      bwd_.dkv_own = bl.add(home * dkv_bytes_);
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
  bool dkv_home_ = false;                    // RingOptions::dkv_home, where it applies
  mutable PassProfile prof_fwd_, prof_bwd_;  // RingOptions::profile: events of the last pass
  mutable std::mutex prof_mutex_;             // profile_turn()
};

}  // namespace

std::unique_ptr<RingBackendPlan> make_cuda_ring_plan(const ContextConfig& ctx, const Problem& global,
                                                     std::shared_ptr<Transport> transport,
                                                     const RingSchedule& schedule,
                                                     const RingOptions& options) {
  return std::make_unique<CudaRingPlan>(ctx, global, std::move(transport), schedule, options);
}

}  // namespace attn::ring
