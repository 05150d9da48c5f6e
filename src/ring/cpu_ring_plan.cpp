// Ring attention on the CPU backend, on top of the dense CPU plans.
//
// The blocks of each step (ring_schedule.hpp) run as dense plans. The
// forward merges each block's (O, LSE) into a running state; the backward
// runs each block with the global LSE and the global O (so D = rowsum(dO *
// O) is global), which makes the block's dQ, dK and dV exactly its share of
// the gradient: dQ accumulates locally, dK and dV accumulate in buffers that
// travel with their K/V around the ring and end at their owner after one
// last step.
//
// Everything is computed in fp32: local Q, O, dO and each arriving K/V
// shard are converted into fp32 copies in the workspace and the blocks run
// fp32 dense plans, so that merges and gradient sums never round to the
// input dtype before the end. K/V travel in the input dtype; the dK/dV
// accumulators travel in fp32.
//
// With RingOptions::dkv_home (the default; ATTN_RING_DKV_HOME=0 at plan
// creation turns it off) the backward keeps the own shard's dK/dV home, in
// the order the CUDA ring plan uses (backward_dkv_home there), so that these
// in-process rings test both schedules.
//
// The copies are chunk-major: local chunk c of every sequence, packed back
// to back, then chunk c + 1. One chunk is then a packed (THD) batch whose
// sequence b has the chunk length of b, so every block runs as one varlen
// dense plan, for fixed-length and varlen batches alike.
#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "core/workspace.hpp"
#include "cpu/cpu_backend.hpp"
#include "ring/ring_plan.hpp"
#include "ring/ring_schedule.hpp"

namespace attn::ring {
namespace {

// One local tensor: its shape and where its rows live in the caller's
// memory, and the chunk-major order of its fp32 copies and messages.
struct LocalShape {
  int64_t heads = 0, dim = 0;
  int32_t chunks = 1;
  std::vector<int64_t> len;        // [batch] chunk length of each sequence
  std::vector<int64_t> cu;         // [batch + 1] offsets of the sequences in one chunk's rows
  std::vector<int64_t> user_base;  // [batch] caller's element offset of sequence b's first row
  int64_t user_seq = 0, user_head = 0;  // caller's strides between positions and heads
  int64_t local_seq = 0;           // fixed length: local positions of each sequence
  bool varlen = false;
  int64_t local_total = 0;         // local positions of all sequences

  int64_t rows() const { return cu.back(); }  // one chunk's rows over the batch
  int64_t chunk_elements() const { return rows() * heads * dim; }
  int64_t elements() const { return chunks * chunk_elements(); }
  // Caller's LSE offset of (sequence b, head h, local position 0):
  // [batch, heads, local seq], or varlen [heads, local total].
  int64_t lse_base(int64_t b, int64_t h) const {
    return varlen ? h * local_total + chunks * cu[size_t(b)] : (b * heads + h) * local_seq;
  }
};

// The local shape of a tensor with `heads` x `dim` rows whose sequences
// have chunk lengths `len`, `chunks` chunks per rank: BSHD or BHSD with
// contiguous strides over [batch, local seq, heads, dim] for fixed-length
// batches (all lengths equal), THD [local total, heads, dim] for varlen.
LocalShape local_shape(const Problem& g, const std::vector<int64_t>& len, int32_t chunks,
                       int64_t heads, int64_t dim) {
  LocalShape t;
  t.heads = heads;
  t.dim = dim;
  t.chunks = chunks;
  t.len = len;
  t.varlen = g.varlen;
  t.cu.assign(1, 0);
  for (int64_t l : len) t.cu.push_back(t.cu.back() + l);
  t.local_total = chunks * t.cu.back();
  const int64_t local_seq = len.empty() ? 0 : chunks * len[0];  // fixed length only
  t.local_seq = local_seq;
  for (size_t b = 0; b < len.size(); ++b) {
    if (g.varlen)
      t.user_base.push_back(chunks * t.cu[b] * heads * dim);
    else if (g.layout == ATTN_LAYOUT_BHSD)
      t.user_base.push_back(int64_t(b) * heads * local_seq * dim);
    else
      t.user_base.push_back(int64_t(b) * local_seq * heads * dim);
  }
  if (!g.varlen && g.layout == ATTN_LAYOUT_BHSD) {
    t.user_seq = dim;
    t.user_head = local_seq * dim;
  } else {
    t.user_seq = heads * dim;
    t.user_head = dim;
  }
  return t;
}

// Calls row(user, packed) for each (sequence, position, head) row of t with
// the element offsets of its first element in the caller's memory and in
// the chunk-major copy.
template <class Row>
void for_each_row(const LocalShape& t, Row&& row) {
  const int64_t rows = t.rows();
  for (size_t b = 0; b < t.len.size(); ++b)
    for (int32_t c = 0; c < t.chunks; ++c)
      for (int64_t i = 0; i < t.len[b]; ++i) {
        const int64_t user = t.user_base[b] + (c * t.len[b] + i) * t.user_seq;
        const int64_t packed = (c * rows + t.cu[b] + i) * t.heads * t.dim;
        for (int64_t h = 0; h < t.heads; ++h) row(user + h * t.user_head, packed + h * t.dim);
      }
}

void to_fp32(const void* src, attn_dtype_t dtype, const LocalShape& t, float* dst) {
  for_each_row(t, [&](int64_t from, int64_t to) {
    for (int64_t c = 0; c < t.dim; ++c) dst[to + c] = load_as_float(src, from + c, dtype);
  });
}

void from_fp32(const float* src, const LocalShape& t, attn_dtype_t dtype, void* dst) {
  for_each_row(t, [&](int64_t to, int64_t from) {
    for (int64_t c = 0; c < t.dim; ++c) store_from_float(dst, to + c, dtype, src[from + c]);
  });
}

// The caller's tensor, in its dtype, into the chunk-major order that travels.
void gather_raw(const void* src, size_t elem, const LocalShape& t, char* dst) {
  const size_t row = size_t(t.dim) * elem;
  for_each_row(t, [&](int64_t from, int64_t to) {
    std::memcpy(dst + size_t(to) * elem, static_cast<const char*>(src) + size_t(from) * elem, row);
  });
}

void contiguous_to_fp32(const void* src, attn_dtype_t dtype, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_as_float(src, i, dtype);
}

// acc[chunk c] += part[chunk c], for chunk-major copies.
void add_chunk(float* acc, const float* part, const LocalShape& t, int32_t c) {
  const int64_t n = t.chunk_elements(), off = c * n;
  for (int64_t i = 0; i < n; ++i) acc[off + i] += part[off + i];
}

// Copies LSE between the caller's layout and the chunk-major one the
// blocks use: chunk c is [heads, rows of chunk c] (a varlen plan's LSE).
template <class Copy>
void for_each_lse_run(const LocalShape& t, Copy&& copy) {
  const int64_t rows = t.rows();
  for (int32_t c = 0; c < t.chunks; ++c)
    for (int64_t h = 0; h < t.heads; ++h)
      for (size_t b = 0; b < t.len.size(); ++b)
        copy(t.lse_base(int64_t(b), h) + c * t.len[b], (c * t.heads + h) * rows + t.cu[b],
             t.len[b]);
}

float* floats(char* base, size_t offset) { return reinterpret_cast<float*>(base + offset); }

using Traffic = RingSchedule::Traffic;

class CpuRingPlan final : public RingBackendPlan {
 public:
  CpuRingPlan(const ContextConfig& ctx, const Problem& global, std::shared_ptr<Transport> transport,
              const RingSchedule& schedule, const RingOptions& options)
      : ctx_(ctx), g_(global), tr_(std::move(transport)), sched_(schedule) {
    rank_ = sched_.rank;
    n_ = sched_.size;
    dkv_home_ = options.dkv_home && g_.backward && n_ > 1;
    chunks_ = sched_.chunks;
    q_ = local_shape(g_, sched_.cq_seq, chunks_, g_.heads_q, g_.head_dim_qk);
    o_ = local_shape(g_, sched_.cq_seq, chunks_, g_.heads_q, g_.head_dim_v);
    k_ = local_shape(g_, sched_.ck_seq, chunks_, g_.heads_kv, g_.head_dim_qk);
    v_ = local_shape(g_, sched_.ck_seq, chunks_, g_.heads_kv, g_.head_dim_v);

    build_blocks();
    build_workspace();
  }

  size_t workspace_bytes(attn_pass_t pass) const override {
    return pass == ATTN_PASS_FORWARD ? fwd_.bytes : bwd_.bytes;
  }
  int32_t tile_q() const override { return sub_plans_.empty() ? 0 : sub_plans_[0]->impl->tile_q(); }
  int32_t tile_kv() const override {
    return sub_plans_.empty() ? 0 : sub_plans_[0]->impl->tile_kv();
  }
  int32_t num_threads() const override {
    return sub_plans_.empty() ? 1 : sub_plans_[0]->impl->num_threads();
  }
  const char* algorithm() const override { return "ring-attention"; }
  const char* kernel() const override {
    return sub_plans_.empty() ? "none" : sub_plans_[0]->impl->kernel();
  }

  void forward(const ForwardArgs& a) const override {
    const ExecutionTurn turn_of_comm(*tr_);
    char* ws = workspace_base(a.workspace);
    float* qf = floats(ws, fwd_.qf);
    float* o_acc = floats(ws, fwd_.o_acc);
    float* o_part = floats(ws, fwd_.o_part);
    float* lse_acc = floats(ws, fwd_.lse_acc);
    float* lse_part = floats(ws, fwd_.lse_part);
    float* kf = floats(ws, fwd_.kf);
    float* vf = floats(ws, fwd_.vf);
    char* kv[2] = {ws + fwd_.kv[0], ws + fwd_.kv[1]};
    void* sub_ws = ws + fwd_.sub;

    tr_->check_usable();
    to_fp32(a.q, g_.dtype, q_, qf);
    std::fill(o_acc, o_acc + o_.elements(), 0.0f);
    std::fill(lse_acc, lse_acc + g_.heads_q * q_.local_total, -std::numeric_limits<float>::infinity());
    pack_kv(a.k, a.v, kv[0]);

    Exchange x;
    bool in_flight = false;
    try {
      int cur = 0;
      for (int32_t t = 0; t < n_; ++t)
        kv_step(ATTN_PASS_FORWARD, t, kv, cur, x, in_flight, kf, vf, a.stream, [&] {
          for (const Block& blk : blocks_[size_t(t)]) {
            const int32_t qc = blk.q_chunk, kc = blk.kv_chunk;
            blk.plan->forward(ForwardArgs{qf + chunk_offset(q_, qc), kf + chunk_offset(k_, kc),
                                          vf + chunk_offset(v_, kc), o_part + chunk_offset(o_, qc),
                                          lse_part, sub_ws, a.stream});
            merge_block(o_acc, lse_acc, o_part, lse_part, blk.q_chunk);
          }
        });
    } catch (...) {
      fail_group(in_flight ? &x : nullptr, a.stream);
      throw;
    }

    // Outputs only now: a failed ring leaves them untouched.
    from_fp32(o_acc, o_, g_.dtype, a.o);
    if (a.lse != nullptr)
      for_each_lse_run(q_, [&](int64_t user, int64_t packed, int64_t n) {
        std::memcpy(a.lse + user, lse_acc + packed, sizeof(float) * size_t(n));
      });
  }

  void backward(const BackwardArgs& a) const override {
    const ExecutionTurn turn_of_comm(*tr_);
    char* ws = workspace_base(a.workspace);
    float* qf = floats(ws, bwd_.qf);
    float* of = floats(ws, bwd_.of);
    float* dof = floats(ws, bwd_.dof);
    float* dq_acc = floats(ws, bwd_.dq_acc);
    float* lse_c = floats(ws, bwd_.lse_chunks);
    float* kf = floats(ws, bwd_.kf);
    float* vf = floats(ws, bwd_.vf);
    char* kv[2] = {ws + bwd_.kv[0], ws + bwd_.kv[1]};
    float* dkv[2] = {floats(ws, bwd_.dkv[0]), floats(ws, bwd_.dkv[1])};
    const int64_t nk = k_.elements(), nv = v_.elements();

    tr_->check_usable();
    to_fp32(a.q, g_.dtype, q_, qf);
    to_fp32(a.o, g_.dtype, o_, of);
    to_fp32(a.d_o, g_.dtype, o_, dof);
    std::fill(dq_acc, dq_acc + q_.elements(), 0.0f);
    // The sub-plans read LSE as [heads, rows of the chunk]: one copy per chunk.
    for_each_lse_run(q_, [&](int64_t user, int64_t packed, int64_t n) {
      std::memcpy(lse_c + packed, a.lse + user, sizeof(float) * size_t(n));
    });
    std::fill(dkv[0], dkv[0] + nk + nv, 0.0f);
    if (dkv_home_) {
      backward_dkv_home(a, kv, dkv);
      return;
    }
    pack_kv(a.k, a.v, kv[0]);

    Exchange x;
    bool in_flight = false;
    int kv_cur = 0, dkv_cur = 0;
    try {
      for (int32_t t = 0; t < n_; ++t) {
        kv_step(ATTN_PASS_BACKWARD, t, kv, kv_cur, x, in_flight, kf, vf, a.stream, [&] {
          for (size_t i = 0; i < blocks_[size_t(t)].size(); ++i)
            backward_block(a, t, i, dkv[dkv_cur]);
        });
        // The accumulators follow their K/V; after the last step they go
        // home (rank r then receives its own shard's).
        if (n_ > 1) {
          x = {dkv[dkv_cur], dkv[1 - dkv_cur], dkv_bytes_, tag(ATTN_PASS_BACKWARD, t, Traffic::dkv)};
          tr_->start(x, a.stream);  // nothing to overlap: the next step needs it
          tr_->finish(x, a.stream);
          dkv_cur = 1 - dkv_cur;
        }
      }
    } catch (...) {
      fail_group(in_flight ? &x : nullptr, a.stream);
      throw;
    }

    from_fp32(dq_acc, q_, g_.dtype, a.dq);
    from_fp32(dkv[dkv_cur], k_, g_.dtype, a.dk);
    from_fp32(dkv[dkv_cur] + nk, v_, g_.dtype, a.dv);
  }

 private:
  struct Block {
    int32_t q_chunk, kv_chunk;  // local chunk indices
    const BackendPlan* plan;
  };

  // Step t of a pass on the K/V in kv[cur]: posts their send to the next
  // rank (unless t is the last step), unpacks them into kf, vf, runs
  // compute, then waits for the exchange and flips cur to the K/V received.
  // x and in_flight stay the caller's, for its fail_group on a throw.
  template <class Compute>
  void kv_step(attn_pass_t pass, int32_t t, char* const kv[2], int& cur, Exchange& x,
               bool& in_flight, float* kf, float* vf, void* stream, Compute&& compute) const {
    if (t + 1 < n_) {
      x = {kv[cur], kv[1 - cur], kv_bytes_, tag(pass, t, Traffic::kv)};
      tr_->start(x, stream);
      in_flight = true;
    }
    unpack_kv(kv[cur], kf, vf);
    compute();
    if (in_flight) {
      in_flight = false;
      tr_->finish(x, stream);
      cur = 1 - cur;
    }
  }

  // Block i of step t on the K/V in kf, vf: its dense backward, then dQ
  // into the local sum and dK, dV into dkv (dK then dV).
  void backward_block(const BackwardArgs& a, int32_t t, size_t i, float* dkv) const {
    char* ws = workspace_base(a.workspace);
    const Block& blk = blocks_[size_t(t)][i];
    const int32_t qc = blk.q_chunk, kc = blk.kv_chunk;
    float* kf = floats(ws, bwd_.kf);
    float* vf = floats(ws, bwd_.vf);
    float* dq_part = floats(ws, bwd_.dq_part);
    float* dk_part = floats(ws, bwd_.dk_part);
    float* dv_part = floats(ws, bwd_.dv_part);
    blk.plan->backward(BackwardArgs{
        floats(ws, bwd_.qf) + chunk_offset(q_, qc), kf + chunk_offset(k_, kc),
        vf + chunk_offset(v_, kc), floats(ws, bwd_.of) + chunk_offset(o_, qc),
        floats(ws, bwd_.lse_chunks) + qc * g_.heads_q * q_.rows(),
        floats(ws, bwd_.dof) + chunk_offset(o_, qc), dq_part + chunk_offset(q_, qc),
        dk_part + chunk_offset(k_, kc), dv_part + chunk_offset(v_, kc), ws + bwd_.sub, a.stream});
    add_chunk(floats(ws, bwd_.dq_acc), dq_part, q_, qc);
    add_chunk(dkv, dk_part, k_, kc);
    add_chunk(dkv + k_.elements(), dv_part, v_, kc);
  }

  // The backward with the own shard's dK/dV kept home: step 0's blocks (own
  // K/V) split around the foreign steps, the first before them, the others
  // after, while the travelling accumulator (zero at step 1, the foreign
  // holders' sums) goes home; the owner adds it to its own sums. Exchanges:
  // K/V after steps 0 .. n - 2, dK/dV after steps 1 .. n - 1.
  void backward_dkv_home(const BackwardArgs& a, char* const kv[2], float* const dkv[2]) const {
    char* ws = workspace_base(a.workspace);
    char* kv_own = ws + bwd_.kv_own;
    float* dkv_own = floats(ws, bwd_.dkv_own);
    float* kf = floats(ws, bwd_.kf);
    float* vf = floats(ws, bwd_.vf);
    const int64_t nk = k_.elements(), nkv = k_.elements() + v_.elements();
    const size_t own = blocks_[0].size(), own_head = std::min<size_t>(own, 1);
    pack_kv(a.k, a.v, kv_own);
    std::fill(dkv_own, dkv_own + nkv, 0.0f);

    Exchange x;
    bool in_flight = false;
    int kv_cur = 0, dkv_cur = 0;
    try {
      x = {kv_own, kv[0], kv_bytes_, tag(ATTN_PASS_BACKWARD, 0, Traffic::kv)};
      tr_->start(x, a.stream);
      in_flight = true;
      unpack_kv(kv_own, kf, vf);
      for (size_t i = 0; i < own_head; ++i) backward_block(a, 0, i, dkv_own);
      in_flight = false;
      tr_->finish(x, a.stream);
      for (int32_t t = 1; t < n_; ++t) {
        kv_step(ATTN_PASS_BACKWARD, t, kv, kv_cur, x, in_flight, kf, vf, a.stream, [&] {
          for (size_t i = 0; i < blocks_[size_t(t)].size(); ++i)
            backward_block(a, t, i, dkv[dkv_cur]);
        });
        x = {dkv[dkv_cur], dkv[1 - dkv_cur], dkv_bytes_, tag(ATTN_PASS_BACKWARD, t, Traffic::dkv)};
        tr_->start(x, a.stream);
        dkv_cur = 1 - dkv_cur;
        if (t + 1 < n_)
          tr_->finish(x, a.stream);  // the next holder adds into it at once
        else
          in_flight = true;  // going home, while the rest of the own blocks run
      }
      unpack_kv(kv_own, kf, vf);
      for (size_t i = own_head; i < own; ++i) backward_block(a, 0, i, dkv_own);
      in_flight = false;
      tr_->finish(x, a.stream);
    } catch (...) {
      fail_group(in_flight ? &x : nullptr, a.stream);
      throw;
    }
    const float* home = dkv[dkv_cur];
    for (int64_t i = 0; i < nkv; ++i) dkv_own[i] += home[i];
    from_fp32(floats(ws, bwd_.dq_acc), q_, g_.dtype, a.dq);
    from_fp32(dkv_own, k_, g_.dtype, a.dk);
    from_fp32(dkv_own + nk, v_, g_.dtype, a.dv);
  }

  struct ForwardSpace {
    size_t qf, o_acc, o_part, lse_acc, lse_part, kv[2], kf, vf, sub, bytes = 0;
  };
  struct BackwardSpace {
    size_t qf, of, dof, dq_acc, dq_part, lse_chunks, kv[2], kf, vf, dkv[2], dk_part, dv_part,
        kv_own = 0, dkv_own = 0, sub, bytes = 0;
  };

  // One dense plan for the fully visible blocks (no mask) and one per
  // distinct set of diagonal shifts of the others; blocks point at theirs.
  void build_blocks() {
    const auto plans = block_plans(sched_, [&](bool full, const std::vector<int64_t>& shifts) {
      sub_plans_.push_back(make_block_plan(full, shifts));
      return static_cast<const BackendPlan*>(sub_plans_.back()->impl.get());
    });
    blocks_.resize(sched_.steps.size());
    for (size_t t = 0; t < sched_.steps.size(); ++t)
      for (size_t i = 0; i < sched_.steps[t].size(); ++i)
        blocks_[t].push_back(
            Block{sched_.steps[t][i].q_chunk, sched_.steps[t][i].kv_chunk, plans[t][i]});
    fill_facts(facts, sched_, tr_->name());
    if (dkv_home_) facts.exchanges_backward = 2 * n_ - 2;  // no dK/dV exchange after step 0
  }

  // A dense fp32 varlen plan over one block: query chunk and KV chunk of
  // every sequence, packed (THD) as in the chunk-major copies.
  std::unique_ptr<Plan> make_block_plan(bool full, const std::vector<int64_t>& shifts) const {
    PlanDesc d;
    d.batch = g_.batch;
    d.heads_q = g_.heads_q;
    d.heads_kv = g_.heads_kv;
    d.seqlen_q = *std::max_element(q_.len.begin(), q_.len.end());
    d.seqlen_kv = *std::max_element(k_.len.begin(), k_.len.end());
    d.head_dim_qk = g_.head_dim_qk;
    d.head_dim_v = g_.head_dim_v;
    d.dtype = ATTN_DTYPE_FP32;
    d.varlen = true;
    d.varlen_batch = g_.batch;
    d.cu_q = q_.cu;
    d.cu_kv = k_.cu;
    d.scale = g_.scale;
    d.softcap = g_.softcap;
    d.mask = full ? ATTN_MASK_NONE : g_.mask;
    d.window_left = !full && g_.mask == ATTN_MASK_WINDOW ? g_.window.left : -1;
    d.window_right = !full && g_.mask == ATTN_MASK_WINDOW ? g_.window.right : -1;
    d.allow_empty_rows = true;  // a block may hide rows that other blocks show
    d.passes = g_.backward ? ATTN_PASSES_FORWARD_BACKWARD : ATTN_PASSES_FORWARD;
    d.diagonal_shift = shifts;
    return create_plan(ctx_, d);
  }

  void build_workspace() {
    const size_t f = sizeof(float);
    const size_t es = dtype_size(g_.dtype);
    const size_t nq = size_t(q_.elements()), no = size_t(o_.elements());
    const size_t nk = size_t(k_.elements()), nv = size_t(v_.elements());
    const size_t lse_local = size_t(g_.heads_q * q_.local_total);
    const size_t lse_chunk = size_t(g_.heads_q * q_.rows());
    kv_bytes_ = (nk + nv) * es;
    dkv_bytes_ = (nk + nv) * f;
    size_t sub_fwd = 0, sub_bwd = 0;
    for (const auto& p : sub_plans_) {
      sub_fwd = std::max(sub_fwd, p->impl->workspace_bytes(ATTN_PASS_FORWARD));
      if (g_.backward) sub_bwd = std::max(sub_bwd, p->impl->workspace_bytes(ATTN_PASS_BACKWARD));
    }

    WorkspaceLayout fl;
    fwd_.qf = fl.add(nq * f);
    fwd_.o_acc = fl.add(no * f);
    fwd_.o_part = fl.add(no * f);
    fwd_.lse_acc = fl.add(lse_local * f);
    fwd_.lse_part = fl.add(lse_chunk * f);
    fwd_.kv[0] = fl.add(kv_bytes_);
    fwd_.kv[1] = fl.add(kv_bytes_);
    fwd_.kf = fl.add(nk * f);
    fwd_.vf = fl.add(nv * f);
    fwd_.sub = fl.add(sub_fwd);
    fwd_.bytes = fl.total_bytes();

    if (g_.backward) {
      WorkspaceLayout bl;
      bwd_.qf = bl.add(nq * f);
      bwd_.of = bl.add(no * f);
      bwd_.dof = bl.add(no * f);
      bwd_.dq_acc = bl.add(nq * f);
      bwd_.dq_part = bl.add(nq * f);
      bwd_.lse_chunks = bl.add(lse_local * f);
      bwd_.kv[0] = bl.add(kv_bytes_);
      bwd_.kv[1] = bl.add(kv_bytes_);
      bwd_.kf = bl.add(nk * f);
      bwd_.vf = bl.add(nv * f);
      bwd_.dkv[0] = bl.add(dkv_bytes_);
      bwd_.dkv[1] = bl.add(dkv_bytes_);
      bwd_.dk_part = bl.add(nk * f);
      bwd_.dv_part = bl.add(nv * f);
      const size_t home = dkv_home_ ? 1 : 0;  // the own K/V message and dK/dV sums
      bwd_.kv_own = bl.add(home * kv_bytes_);
      bwd_.dkv_own = bl.add(home * dkv_bytes_);
      bwd_.sub = bl.add(sub_bwd);
      bwd_.bytes = bl.total_bytes();
    }
    facts.bytes_per_step_forward = kv_bytes_;
    facts.bytes_per_step_backward = kv_bytes_ + dkv_bytes_;
  }

  static int64_t chunk_offset(const LocalShape& t, int32_t c) { return c * t.chunk_elements(); }

  uint64_t tag(attn_pass_t pass, int32_t step, Traffic what) const {
    return sched_.tag(pass, step, what);
  }

  // Local K then V, in the input dtype, contiguous: the message of a step.
  void pack_kv(const void* k, const void* v, char* dst) const {
    const size_t es = dtype_size(g_.dtype);
    gather_raw(k, es, k_, dst);
    gather_raw(v, es, v_, dst + size_t(k_.elements()) * es);
  }
  void unpack_kv(const char* src, float* kf, float* vf) const {
    const size_t es = dtype_size(g_.dtype);
    contiguous_to_fp32(src, g_.dtype, k_.elements(), kf);
    contiguous_to_fp32(src + size_t(k_.elements()) * es, g_.dtype, v_.elements(), vf);
  }

  // (O, LSE) of local query chunk c: acc := merge(acc, part). The chunk's O
  // is [rows, heads, dim] and its LSE [heads, rows].
  void merge_block(float* o_acc, float* lse_acc, const float* o_part, const float* lse_part,
                   int32_t c) const {
    const int64_t T = o_.rows(), H = g_.heads_q, D = g_.head_dim_v;
    TensorDesc od, ld;
    od.dtype = ld.dtype = ATTN_DTYPE_FP32;
    od.ndim = 3;
    od.dims[0] = T, od.dims[1] = H, od.dims[2] = D;
    od.strides[0] = H * D, od.strides[1] = D, od.strides[2] = 1;
    ld.ndim = 2;
    ld.dims[0] = T, ld.dims[1] = H;
    ld.strides[0] = 1, ld.strides[1] = T;
    float* o_rows = o_acc + chunk_offset(o_, c);
    float* lse_rows = lse_acc + c * H * T;
    const void* o_parts[2] = {o_rows, o_part + chunk_offset(o_, c)};
    const float* lse_parts[2] = {lse_rows, lse_part};
    cpu::merge_states(ctx_, 2, od, ld, o_parts, lse_parts, o_rows, lse_rows);
  }

  void fail_group(const Exchange* pending, void* stream) const noexcept {
    fail_ring_group(*tr_, rank_, pending, stream);
  }

  ContextConfig ctx_;
  Problem g_;
  std::shared_ptr<Transport> tr_;
  RingSchedule sched_;
  int32_t rank_ = 0, n_ = 1, chunks_ = 1;
  LocalShape q_, o_, k_, v_;
  std::vector<std::vector<Block>> blocks_;
  std::vector<std::unique_ptr<Plan>> sub_plans_;
  size_t kv_bytes_ = 0, dkv_bytes_ = 0;
  bool dkv_home_ = false;  // RingOptions::dkv_home, where it applies (backward, 2+ ranks)
  ForwardSpace fwd_;
  BackwardSpace bwd_;
};

}  // namespace

std::unique_ptr<RingBackendPlan> make_cpu_ring_plan(const ContextConfig& ctx, const Problem& global,
                                                    std::shared_ptr<Transport> transport,
                                                    const RingSchedule& schedule,
                                                    const RingOptions& options) {
  return std::make_unique<CpuRingPlan>(ctx, global, std::move(transport), schedule, options);
}

}  // namespace attn::ring
