// Ring attention on the CUDA backend over NCCL: one thread per GPU, one
// NCCL communicator each (ncclCommInitAll), every rank running forward and
// backward on its shards; the results, put back in their global places,
// are compared with the fp64 reference (tests/common/reference.h) on the
// whole sequence, with single-GPU dense attention on the same inputs as the
// same-precision yardstick (FlashAttention's rule), per output X:
//     max |X_ring - X_ref| <= 2 max |X_dense - X_ref| + 4 u max |X_ref|
// (u the dtype's unit roundoff, max |X_ref| each output's own; LSE: + 1e-4
// max(1, |LSE_ref|)), the yardstick itself within 32 u max |X_ref| (LSE:
// 1e-2 max(1, |LSE_ref|)). Outputs and workspaces are poisoned (NaN) before
// the run; each ring rank runs both passes twice on one workspace, the
// outputs poisoned again in between, and the second run's are checked.
//
// Rank counts: 1 (every part of the CUDA ring plan but the exchanges: its
// block plans, merges, accumulations, permutations and token maps; zigzag
// still makes two chunks), and with more GPUs 2, 3 and all of them (up to
// 8): with 2 the next and previous rank are the same, and the buffers'
// rotation wraps only from 3 on.
//
// Cases: full and causal masks, sliding windows (left only, left and right,
// causal with a left reach), GQA, seqlen_q != seqlen_kv (with rows that see
// no key), BSHD, BHSD and
// varlen batches (THD: sequences of different lengths, a chunk of a single
// token), contiguous and zigzag. Also checked: attn_ring_plan_describe names
// the NCCL transport and skips wholly masked blocks, a ring the CUDA
// backend cannot run (fp32) is NOT_SUPPORTED on every rank, misaligned
// pointers are refused before the ring starts, and (2 ranks or more) a rank
// whose plan creation fails makes its peers' creation fail too instead of
// leaving them waiting for it.
// Exit 77 without a GPU. ATTN_TEST_SEED=n repeats a run;
// ATTN_TEST_NCCL_NONBLOCKING=1 runs it all on non-blocking communicators.

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_common.hpp"
#include "reference.h"

using namespace gpu_test;

namespace {

uint64_t g_seed = 0;
int g_failures = 0;

struct Case {
  std::string name;
  attn_dtype_t dtype;
  attn_layout_t layout;  // BSHD or BHSD; THD when chunks_q has several entries
  attn_ring_layout_t ring;
  int64_t hq, hkv, d;
  attn_mask_t mask;
  int64_t left, right;  // WINDOW only
  // Positions per chunk of each sequence (one entry per batch entry; a
  // varlen batch when `varlen`); seqlen = chunks * chunk.
  std::vector<int64_t> chunks_q, chunks_kv;
  bool varlen;
  bool expect_skips;  // the mask hides whole blocks: describe must count them
};

int64_t parts(const Case& c, int n) { return c.ring == ATTN_RING_LAYOUT_ZIGZAG ? 2 * n : n; }
int64_t local_chunks(const Case& c) { return c.ring == ATTN_RING_LAYOUT_ZIGZAG ? 2 : 1; }

// One side (Q or K) of the problem, global or one rank's shard: per
// sequence its length and token offset (varlen), and the element index of
// (b, s, h, x) in the layout.
struct Geom {
  std::vector<int64_t> len, cu;  // cu: batch + 1 offsets (fixed length: b * len)
  int64_t heads, dim;
  bool bhsd, varlen;
  int64_t batch() const { return int64_t(len.size()); }
  int64_t seq() const { return len[0]; }  // fixed length
  size_t count() const { return size_t(cu.back() * heads * dim); }
  size_t index(int64_t b, int64_t s, int64_t h, int64_t x) const {
    if (varlen) return size_t(((cu[size_t(b)] + s) * heads + h) * dim + x);
    if (bhsd) return size_t(((b * heads + h) * seq() + s) * dim + x);
    return size_t(((b * seq() + s) * heads + h) * dim + x);
  }
  // LSE [batch, heads, seq] or, varlen, [heads, total].
  size_t lse_index(int64_t b, int64_t h, int64_t s) const {
    if (varlen) return size_t(h * cu.back() + cu[size_t(b)] + s);
    return size_t((b * heads + h) * seq() + s);
  }
  ref_strides strides() const {
    if (varlen) return {0, heads * dim, dim};
    if (bhsd) return {heads * seq() * dim, dim, seq() * dim};
    return {seq() * heads * dim, heads * dim, dim};
  }
};

Geom make_geom(const std::vector<int64_t>& len, int64_t heads, int64_t dim, bool bhsd, bool varlen) {
  Geom g{len, {0}, heads, dim, bhsd, varlen};
  for (int64_t l : len) g.cu.push_back(g.cu.back() + l);
  return g;
}

// Global position of local position s of a sequence whose chunks have
// `chunk` positions, on rank `rank` of n.
int64_t global_pos(const Case& c, int n, int rank, int64_t chunk, int64_t s) {
  const int64_t k = s / chunk;
  const int64_t g = c.ring == ATTN_RING_LAYOUT_ZIGZAG ? (k == 0 ? rank : 2 * n - 1 - rank) : rank;
  return g * chunk + s % chunk;
}

// Copies rank r's shard between the global tensor and the local one (with
// the chunk lengths `chunk` per sequence).
template <class T>
void shard(const Case& c, int n, int r, const std::vector<int64_t>& chunk, const Geom& gg,
           const Geom& lg, std::vector<T>& global, std::vector<T>& local, bool to_local) {
  for (int64_t b = 0; b < lg.batch(); ++b)
    for (int64_t s = 0; s < lg.len[size_t(b)]; ++s) {
      const int64_t gs = global_pos(c, n, r, chunk[size_t(b)], s);
      for (int64_t h = 0; h < lg.heads; ++h)
        for (int64_t x = 0; x < lg.dim; ++x) {
          if (to_local)
            local[lg.index(b, s, h, x)] = global[gg.index(b, gs, h, x)];
          else
            global[gg.index(b, gs, h, x)] = local[lg.index(b, s, h, x)];
        }
    }
}

struct Outputs {
  std::vector<uint16_t> o, dq, dk, dv;
  std::vector<float> lse;
};

struct Lengths {
  std::vector<int64_t> q, kv;    // global lengths per sequence
  std::vector<int32_t> cu_q, cu_kv;
};

Lengths lengths(const Case& c, int n) {
  Lengths l;
  l.cu_q.assign(1, 0);
  l.cu_kv.assign(1, 0);
  for (size_t b = 0; b < c.chunks_q.size(); ++b) {
    l.q.push_back(c.chunks_q[b] * parts(c, n));
    l.kv.push_back(c.chunks_kv[b] * parts(c, n));
    l.cu_q.push_back(l.cu_q.back() + int32_t(l.q.back()));
    l.cu_kv.push_back(l.cu_kv.back() + int32_t(l.kv.back()));
  }
  return l;
}

attn_plan_desc_t make_desc(const Case& c, const Lengths& l, attn_dtype_t dtype) {
  attn_plan_desc_t d;
  const int64_t batch = int64_t(l.q.size());
  const int64_t sq = *std::max_element(l.q.begin(), l.q.end());
  const int64_t skv = *std::max_element(l.kv.begin(), l.kv.end());
  ATTN_CHECK(attn_plan_desc_create(&d));
  ATTN_CHECK(attn_plan_desc_set_shape(d, batch, c.hq, c.hkv, sq, skv, c.d, c.d));
  ATTN_CHECK(attn_plan_desc_set_dtype(d, dtype));
  if (c.varlen)
    ATTN_CHECK(attn_plan_desc_set_varlen(d, batch, l.cu_q.data(), l.cu_kv.data()));
  else
    ATTN_CHECK(attn_plan_desc_set_layout(d, c.layout));
  ATTN_CHECK(attn_plan_desc_set_mask(d, c.mask, c.mask == ATTN_MASK_WINDOW ? c.left : -1,
                                     c.mask == ATTN_MASK_WINDOW ? c.right : -1));
  ATTN_CHECK(attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD_BACKWARD));
  // Rows with no key (seqlen_q > seqlen_kv under a window) give O = 0 and
  // LSE = -inf on the ring too.
  ATTN_CHECK(attn_plan_desc_set_allow_empty_rows(d, 1));
  return d;
}

// Device buffers of one problem's tensors: q k v dO (in), o dq dk dv (out,
// dtype), lse (fp32).
struct DeviceTensors {
  void* p[9] = {};
  size_t bytes[9] = {};
  DeviceTensors(size_t nq, size_t nk, size_t nl) {
    const size_t sizes[9] = {nq * 2, nk * 2, nk * 2, nq * 2, nq * 2, nq * 2, nk * 2, nk * 2, nl * 4};
    for (int i = 0; i < 9; ++i) {
      bytes[i] = std::max<size_t>(sizes[i], 16);
      GPU_CHECK(cudaMalloc(&p[i], bytes[i]));
    }
    for (int i = 4; i < 9; ++i) GPU_CHECK(cudaMemset(p[i], 0xff, bytes[i]));  // NaN
  }
  ~DeviceTensors() {
    for (void* x : p) (void)cudaFree(x);
  }
  void upload(const std::vector<uint16_t>* in) {
    for (int i = 0; i < 4; ++i)
      GPU_CHECK(cudaMemcpy(p[i], in[i].data(), in[i].size() * 2, cudaMemcpyHostToDevice));
  }
  void download(Outputs& o, size_t nq, size_t nk, size_t nl) const {
    o.o.resize(nq), o.dq.resize(nq), o.dk.resize(nk), o.dv.resize(nk), o.lse.resize(nl);
    GPU_CHECK(cudaMemcpy(o.o.data(), p[4], nq * 2, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(o.dq.data(), p[5], nq * 2, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(o.dk.data(), p[6], nk * 2, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(o.dv.data(), p[7], nk * 2, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(o.lse.data(), p[8], nl * 4, cudaMemcpyDeviceToHost));
  }
  float* lse() const { return static_cast<float*>(p[8]); }
};

// Forward then backward of `plan` on t, with a poisoned workspace; returns
// the first failure's status (message in *why).
// `runs` times: a run after the first finds the workspace as the last left
// it and the outputs poisoned again, so that what is checked is the last
// run's (a plan must not rely on a fresh workspace).
attn_status_t execute(attn_plan_t plan, const DeviceTensors& t, cudaStream_t stream,
                      std::string* why, attn_status_t* bwd_status, int runs = 1) {
  size_t fwd = 0, bwd = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fwd));
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &bwd));
  void* ws = nullptr;
  const size_t ws_bytes = std::max(fwd, bwd) + 1;
  GPU_CHECK(cudaMalloc(&ws, ws_bytes));
  GPU_CHECK(cudaMemset(ws, 0xff, ws_bytes));
  attn_status_t s = ATTN_STATUS_SUCCESS;
  *bwd_status = ATTN_STATUS_SUCCESS;
  for (int run = 0; run < runs && s == ATTN_STATUS_SUCCESS && *bwd_status == ATTN_STATUS_SUCCESS;
       ++run) {
    if (run > 0)
      for (int i = 4; i < 9; ++i) GPU_CHECK(cudaMemsetAsync(t.p[i], 0xff, t.bytes[i], stream));
    s = attn_forward(plan, t.p[0], t.p[1], t.p[2], t.p[4], t.lse(), ws, fwd, stream);
    *bwd_status = ATTN_STATUS_INTERNAL_ERROR;
    if (s != ATTN_STATUS_SUCCESS) {
      *why = attn_last_error_message();
    } else {
      *bwd_status = attn_backward(plan, t.p[0], t.p[1], t.p[2], t.p[4], t.lse(), t.p[3], t.p[5],
                                  t.p[6], t.p[7], ws, bwd, stream);
      if (*bwd_status != ATTN_STATUS_SUCCESS) *why = attn_last_error_message();
    }
  }
  GPU_CHECK(cudaStreamSynchronize(stream));
  GPU_CHECK(cudaFree(ws));
  return s;
}

// Dense plan over the whole problem on device 0.
void run_dense(const Case& c, const Lengths& l, const Geom& gq, const Geom& gk,
               const std::vector<uint16_t>* in, Outputs* out) {
  GPU_CHECK(cudaSetDevice(0));
  attn_plan_desc_t desc = make_desc(c, l, c.dtype);
  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  attn_plan_t plan;
  ATTN_CHECK(attn_plan_create(ctx, desc, &plan));
  const size_t nl = size_t(gq.cu.back() * c.hq);
  DeviceTensors t(gq.count(), gk.count(), nl);
  t.upload(in);
  std::string why;
  attn_status_t bwd;
  ATTN_CHECK(execute(plan, t, nullptr, &why, &bwd));
  ATTN_CHECK(bwd);
  t.download(*out, gq.count(), gk.count(), nl);
  ATTN_CHECK(attn_plan_destroy(plan));
  ATTN_CHECK(attn_context_destroy(ctx));
  ATTN_CHECK(attn_plan_desc_destroy(desc));
}

// The fp64 reference over the whole problem: o dq dk dv lse.
void run_reference(const Case& c, const Lengths& l, const Geom& gq, const Geom& gk,
                   const std::vector<uint16_t>* in, std::vector<double>* ref) {
  std::vector<int64_t> cu_q(l.cu_q.begin(), l.cu_q.end()), cu_kv(l.cu_kv.begin(), l.cu_kv.end());
  ref_problem p;
  std::memset(&p, 0, sizeof p);
  p.batch = int64_t(l.q.size());
  p.heads_q = c.hq, p.heads_kv = c.hkv;
  p.head_dim_qk = p.head_dim_v = c.d;
  p.cu_q = cu_q.data(), p.cu_kv = cu_kv.data();
  p.varlen = c.varlen;
  p.scale = double(float(1.0 / std::sqrt(double(c.d))));
  p.window_left = c.mask == ATTN_MASK_WINDOW ? c.left : -1;
  p.window_right = c.mask == ATTN_MASK_NONE ? -1 : c.mask == ATTN_MASK_CAUSAL ? 0 : c.right;
  p.q = p.o = p.d_o = p.dq = gq.strides();
  p.k = p.v = p.dk = p.dv = gk.strides();
  std::vector<double> x[4];
  for (int i = 0; i < 4; ++i) {
    x[i].resize(in[i].size());
    for (size_t j = 0; j < in[i].size(); ++j) x[i][j] = from_half(c.dtype, in[i][j]);
  }
  ref[0].assign(gq.count(), 0.0), ref[1].assign(gq.count(), 0.0);
  ref[2].assign(gk.count(), 0.0), ref[3].assign(gk.count(), 0.0);
  ref[4].assign(ref_lse_count(&p), 0.0);
  ref_forward(&p, x[0].data(), x[1].data(), x[2].data(), ref[0].data(), ref[4].data());
  ref_backward(&p, x[0].data(), x[1].data(), x[2].data(), x[3].data(), ref[1].data(),
               ref[2].data(), ref[3].data());
}

struct RankResult {
  attn_status_t create = ATTN_STATUS_INTERNAL_ERROR, fwd = ATTN_STATUS_INTERNAL_ERROR,
                bwd = ATTN_STATUS_INTERNAL_ERROR;
  std::string message, transport;
  uint64_t blocks_skipped = 0;
  int32_t exchanges_backward = -1;
  Outputs out;
};

// Rank r on GPU r: its shards in, forward and backward, results out (run =
// false: plan creation only, in `dtype`).
void run_rank(const Case& c, const Lengths& l, int n, int r, ncclComm_t nccl, const Geom* lq,
              const Geom* lk, const std::vector<uint16_t>* local_in, RankResult* res,
              attn_dtype_t dtype, bool run) {
  GPU_CHECK(cudaSetDevice(r));
  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, r, 0, &ctx));
  attn_comm_t comm;
  ATTN_CHECK(attn_comm_create_nccl(nccl, &comm));
  int32_t rank = -1, size = -1;
  ATTN_CHECK(attn_comm_get_rank(comm, &rank));
  ATTN_CHECK(attn_comm_get_size(comm, &size));
  if (rank != r || size != n) {
    res->message = "attn_comm_get_rank/size disagree with NCCL";
    attn_comm_destroy(comm);
    attn_context_destroy(ctx);
    return;
  }
  attn_plan_desc_t desc = make_desc(c, l, dtype);
  attn_plan_t plan = nullptr;
  res->create = attn_ring_plan_create(ctx, desc, comm, c.ring, &plan);
  res->message = attn_last_error_message();
  ATTN_CHECK(attn_plan_desc_destroy(desc));
  if (res->create == ATTN_STATUS_SUCCESS && run) {
    attn_ring_plan_info_t info;
    info.struct_size = sizeof info;
    ATTN_CHECK(attn_ring_plan_describe(plan, &info));
    res->transport = info.transport;
    res->blocks_skipped = info.blocks_skipped;
    res->exchanges_backward = info.exchanges_backward;
    const size_t nl = size_t(lq->cu.back() * c.hq);
    DeviceTensors t(lq->count(), lk->count(), nl);
    t.upload(local_in);
    cudaStream_t stream;
    GPU_CHECK(cudaStreamCreate(&stream));
    res->fwd = execute(plan, t, stream, &res->message, &res->bwd, 2);
    GPU_CHECK(cudaStreamDestroy(stream));
    t.download(res->out, lq->count(), lk->count(), nl);
  }
  if (plan) ATTN_CHECK(attn_plan_destroy(plan));
  ATTN_CHECK(attn_comm_destroy(comm));
  ATTN_CHECK(attn_context_destroy(ctx));
}

double max_err(const std::vector<uint16_t>& got, attn_dtype_t t, const std::vector<double>& ref,
               bool* bad) {
  double m = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = from_half(t, got[i]);
    if (!std::isfinite(g)) *bad = true;
    m = std::max(m, std::fabs(g - ref[i]));
  }
  return m;
}

// LSE: -inf where the reference has -inf (a row that sees no key).
double max_err_lse(const std::vector<float>& got, const std::vector<double>& ref, bool* bad) {
  double m = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      if (got[i] != -std::numeric_limits<float>::infinity()) *bad = true;
      continue;
    }
    if (!std::isfinite(got[i])) *bad = true;
    m = std::max(m, std::fabs(double(got[i]) - ref[i]));
  }
  return m;
}

double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (double v : x)
    if (std::isfinite(v)) m = std::max(m, std::fabs(v));
  return m;
}

void run_case(const Case& c, int n, ncclComm_t* comms) {
  const Lengths l = lengths(c, n);
  const bool bhsd = c.layout == ATTN_LAYOUT_BHSD;
  const Geom gq = make_geom(l.q, c.hq, c.d, bhsd, c.varlen);
  const Geom gk = make_geom(l.kv, c.hkv, c.d, bhsd, c.varlen);
  std::vector<int64_t> local_q, local_kv;  // local lengths per sequence
  for (size_t b = 0; b < l.q.size(); ++b) {
    local_q.push_back(c.chunks_q[b] * local_chunks(c));
    local_kv.push_back(c.chunks_kv[b] * local_chunks(c));
  }
  const Geom lq = make_geom(local_q, c.hq, c.d, bhsd, c.varlen);
  const Geom lk = make_geom(local_kv, c.hkv, c.d, bhsd, c.varlen);

  std::mt19937_64 rng(g_seed ^ std::hash<std::string>()(c.name));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> in[4];  // q k v dO
  for (int i = 0; i < 4; ++i) {
    in[i].resize(i == 0 || i == 3 ? gq.count() : gk.count());
    for (auto& x : in[i]) x = to_half(c.dtype, normal(rng));
  }
  std::vector<double> ref[5];  // o dq dk dv lse
  run_reference(c, l, gq, gk, in, ref);
  Outputs dense;
  run_dense(c, l, gq, gk, in, &dense);

  std::vector<std::vector<uint16_t>> local(static_cast<size_t>(n) * 4);
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < 4; ++i) {
      const bool qs = i == 0 || i == 3;
      std::vector<uint16_t>& dst = local[size_t(r) * 4 + size_t(i)];
      dst.resize(qs ? lq.count() : lk.count());
      shard(c, n, r, qs ? c.chunks_q : c.chunks_kv, qs ? gq : gk, qs ? lq : lk, in[i], dst, true);
    }
  std::vector<RankResult> res(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back(run_rank, std::cref(c), std::cref(l), n, r, comms[r], &lq, &lk,
                         &local[size_t(r) * 4], &res[size_t(r)], c.dtype, true);
  for (auto& t : threads) t.join();

  Outputs ring;
  ring.o.assign(gq.count(), 0), ring.dq.assign(gq.count(), 0);
  ring.dk.assign(gk.count(), 0), ring.dv.assign(gk.count(), 0);
  ring.lse.assign(ref[4].size(), 0.0f);
  bool ok = true;
  uint64_t skipped = 0;
  // By default the own dK/dV stay home, one dK/dV exchange fewer;
  // ATTN_RING_DKV_HOME=0 (the ring_nccl_dkv_exchange entry) sends them round
  // too. The count also shows which schedule ran.
  const char* home_env = std::getenv("ATTN_RING_DKV_HOME");
  const bool dkv_home = home_env == nullptr || std::strcmp(home_env, "0") != 0;
  const int32_t want_exchanges = n > 1 ? 2 * n - 1 - (dkv_home ? 1 : 0) : 0;
  for (int r = 0; r < n; ++r) {
    RankResult& rr = res[size_t(r)];
    if (rr.create != ATTN_STATUS_SUCCESS || rr.fwd != ATTN_STATUS_SUCCESS ||
        rr.bwd != ATTN_STATUS_SUCCESS || rr.transport != "nccl") {
      std::printf("  rank %d: create %s, forward %s, backward %s, transport \"%s\": %s\n", r,
                  attn_status_string(rr.create), attn_status_string(rr.fwd),
                  attn_status_string(rr.bwd), rr.transport.c_str(), rr.message.c_str());
      ok = false;
      continue;
    }
    if (rr.exchanges_backward != want_exchanges) {
      std::printf("  rank %d: attn_ring_plan_describe: %d backward exchanges, expected %d\n", r,
                  int(rr.exchanges_backward), int(want_exchanges));
      ok = false;
    }
    skipped += rr.blocks_skipped;
    shard(c, n, r, c.chunks_q, gq, lq, ring.o, rr.out.o, false);
    shard(c, n, r, c.chunks_q, gq, lq, ring.dq, rr.out.dq, false);
    shard(c, n, r, c.chunks_kv, gk, lk, ring.dk, rr.out.dk, false);
    shard(c, n, r, c.chunks_kv, gk, lk, ring.dv, rr.out.dv, false);
    for (int64_t b = 0; b < lq.batch(); ++b)
      for (int64_t h = 0; h < c.hq; ++h)
        for (int64_t s = 0; s < lq.len[size_t(b)]; ++s)
          ring.lse[gq.lse_index(b, h, global_pos(c, n, r, c.chunks_q[size_t(b)], s))] =
              rr.out.lse[lq.lse_index(b, h, s)];
  }
  if (ok && c.expect_skips && n >= 2 && skipped == 0) {
    std::printf("  the mask hides whole blocks but describe reports none skipped\n");
    ok = false;
  }
  if (ok) {
    const double u = c.dtype == ATTN_DTYPE_BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    const char* names[5] = {"O", "dQ", "dK", "dV", "LSE"};
    const std::vector<uint16_t>* rg[4] = {&ring.o, &ring.dq, &ring.dk, &ring.dv};
    const std::vector<uint16_t>* dn[4] = {&dense.o, &dense.dq, &dense.dk, &dense.dv};
    for (int i = 0; i < 5; ++i) {
      bool bad = false, dense_bad = false;
      double e_ring, e_dense, atol, dense_max;
      if (i < 4) {
        e_ring = max_err(*rg[i], c.dtype, ref[i], &bad);
        e_dense = max_err(*dn[i], c.dtype, ref[i], &dense_bad);
        atol = 4.0 * u * max_abs(ref[i]);
        dense_max = 32.0 * u * max_abs(ref[i]);
      } else {
        e_ring = max_err_lse(ring.lse, ref[4], &bad);
        e_dense = max_err_lse(dense.lse, ref[4], &dense_bad);
        atol = 1e-4 * std::max(1.0, max_abs(ref[4]));
        dense_max = 1e-2 * std::max(1.0, max_abs(ref[4]));
      }
      const double tol = 2.0 * e_dense + atol;
      const bool yardstick = e_dense <= dense_max;
      const bool pass = !bad && !dense_bad && yardstick && e_ring <= tol;
      std::printf("  %-3s ring err %.3g, dense err %.3g, tol %.3g%s\n", names[i], e_ring, e_dense,
                  tol,
                  pass ? ""
                  : bad || dense_bad ? "  NON-FINITE"
                  : !yardstick       ? "  DENSE YARDSTICK OFF"
                                     : "  FAIL");
      ok = ok && pass;
    }
  }
  std::printf("%s %s (%d ranks, %zu sequence(s), %" PRId64 "/%" PRId64 " tokens, %" PRIu64
              " blocks skipped)\n",
              ok ? "ok  " : "FAIL", c.name.c_str(), n, l.q.size(), gq.cu.back(), gk.cu.back(),
              skipped);
  if (!ok) ++g_failures;
}

// A ring the CUDA backend cannot run (fp32 inputs): every rank fails plan
// creation alike, naming the dtype.
void test_not_supported(int n, ncclComm_t* comms) {
  const Case c{"fp32", ATTN_DTYPE_FP32, ATTN_LAYOUT_BSHD, ATTN_RING_LAYOUT_ZIGZAG, 2, 2, 64,
               ATTN_MASK_WINDOW, 16, 0, {32}, {32}, false, false};
  const Lengths l = lengths(c, n);
  std::vector<RankResult> res(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back(run_rank, std::cref(c), std::cref(l), n, r, comms[r], nullptr, nullptr,
                         nullptr, &res[size_t(r)], ATTN_DTYPE_FP32, false);
  for (auto& t : threads) t.join();
  bool ok = true;
  for (int r = 0; r < n; ++r)
    if (res[size_t(r)].create != ATTN_STATUS_NOT_SUPPORTED ||
        res[size_t(r)].message.find("dtype fp32") == std::string::npos) {
      std::printf("  rank %d: %s: %s\n", r, attn_status_string(res[size_t(r)].create),
                  res[size_t(r)].message.c_str());
      ok = false;
    }
  std::printf("%s an fp32 ring is NOT_SUPPORTED on every rank\n", ok ? "ok  " : "FAIL");
  if (!ok) ++g_failures;
}

// The last rank's descriptor has a global length its ring cannot shard
// (not a multiple of the chunks): its creation fails with INVALID_ARGUMENT
// before the ranks compare plans; the other ranks' creations must then fail
// with COMMUNICATION_ERROR naming that rank, not wait for it.
void test_creation_failure(int n, ncclComm_t* comms) {
  const Case c{"one-rank-fails", ATTN_DTYPE_BF16, ATTN_LAYOUT_BSHD, ATTN_RING_LAYOUT_ZIGZAG, 2, 1,
               64, ATTN_MASK_CAUSAL, -1, -1, {32}, {32}, false, false};
  const Lengths l = lengths(c, n);
  Lengths bad = l;
  bad.q[0] += 1;
  bad.kv[0] += 1;
  std::vector<RankResult> res(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back(run_rank, std::cref(c), std::cref(r == n - 1 ? bad : l), n, r, comms[r],
                         nullptr, nullptr, nullptr, &res[size_t(r)], c.dtype, false);
  for (auto& t : threads) t.join();
  bool ok = true;
  const std::string named = "rank " + std::to_string(n - 1) + " failed to create its ring plan";
  for (int r = 0; r < n; ++r) {
    const RankResult& rr = res[size_t(r)];
    const bool want = r == n - 1 ? rr.create == ATTN_STATUS_INVALID_ARGUMENT
                                 : rr.create == ATTN_STATUS_COMMUNICATION_ERROR &&
                                       rr.message.find(named) != std::string::npos;
    if (!want) {
      std::printf("  rank %d: %s: %s\n", r, attn_status_string(rr.create), rr.message.c_str());
      ok = false;
    }
  }
  std::printf("%s a rank whose plan creation fails fails its peers' creation too\n",
              ok ? "ok  " : "FAIL");
  if (!ok) ++g_failures;
}

// True when every byte of the device buffer still holds the 0xff poison.
bool untouched(const void* p, size_t bytes) {
  std::vector<unsigned char> h(bytes);
  GPU_CHECK(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
  return std::all_of(h.begin(), h.end(), [](unsigned char b) { return b == 0xff; });
}

// Rank r of the misaligned-pointer check (see test_misaligned): appends
// what went wrong to *fail.
void misaligned_rank(const Case& c, const Lengths& l, int r, ncclComm_t nccl, const Geom* lq,
                     const Geom* lk, const std::vector<uint16_t>* local_in, std::string* fail) {
  GPU_CHECK(cudaSetDevice(r));
  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, r, 0, &ctx));
  attn_comm_t comm;
  ATTN_CHECK(attn_comm_create_nccl(nccl, &comm));
  attn_plan_desc_t desc = make_desc(c, l, c.dtype);
  attn_plan_t plan;
  ATTN_CHECK(attn_ring_plan_create(ctx, desc, comm, c.ring, &plan));
  ATTN_CHECK(attn_plan_desc_destroy(desc));
  const size_t nl = size_t(lq->cu.back() * c.hq);
  DeviceTensors t(lq->count(), lk->count(), nl);
  t.upload(local_in);
  size_t fwd = 0, bwd = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fwd));
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &bwd));
  void* ws = nullptr;
  GPU_CHECK(cudaMalloc(&ws, std::max(fwd, bwd)));
  auto off8 = [](void* p) { return static_cast<void*>(static_cast<char*>(p) + 8); };
  auto expect = [&](attn_status_t got, attn_status_t want, const char* what, const char* name) {
    const std::string msg = got == ATTN_STATUS_SUCCESS ? "" : attn_last_error_message();
    if (got != want || (name != nullptr && msg.find(std::string(name) + ": the CUDA kernels need") == std::string::npos))
      *fail += std::string("  rank ") + std::to_string(r) + ", " + what + ": " +
               attn_status_string(got) + " (" + msg + ")\n";
  };
  // Q 8 bytes past a 16-byte boundary: refused before the ring starts.
  expect(attn_forward(plan, off8(t.p[0]), t.p[1], t.p[2], t.p[4], t.lse(), ws, fwd, nullptr),
         ATTN_STATUS_INVALID_ARGUMENT, "forward, misaligned q", "q");
  GPU_CHECK(cudaDeviceSynchronize());
  if (!untouched(t.p[4], t.bytes[4]) || !untouched(t.p[8], t.bytes[8]))
    *fail += "  rank " + std::to_string(r) + ": the refused forward wrote O or LSE\n";
  // The group is still usable.
  expect(attn_forward(plan, t.p[0], t.p[1], t.p[2], t.p[4], t.lse(), ws, fwd, nullptr),
         ATTN_STATUS_SUCCESS, "forward after the refusal", nullptr);
  // dQ misaligned (written only at the end, by an elementwise store).
  expect(attn_backward(plan, t.p[0], t.p[1], t.p[2], t.p[4], t.lse(), t.p[3], off8(t.p[5]),
                       t.p[6], t.p[7], ws, bwd, nullptr),
         ATTN_STATUS_INVALID_ARGUMENT, "backward, misaligned dq", "dq");
  GPU_CHECK(cudaDeviceSynchronize());
  for (int i = 5; i < 8; ++i)
    if (!untouched(t.p[i], t.bytes[i]))
      *fail += "  rank " + std::to_string(r) + ": the refused backward wrote dQ, dK or dV\n";
  expect(attn_backward(plan, t.p[0], t.p[1], t.p[2], t.p[4], t.lse(), t.p[3], t.p[5], t.p[6],
                       t.p[7], ws, bwd, nullptr),
         ATTN_STATUS_SUCCESS, "backward after the refusal", nullptr);
  GPU_CHECK(cudaDeviceSynchronize());
  GPU_CHECK(cudaFree(ws));
  ATTN_CHECK(attn_plan_destroy(plan));
  ATTN_CHECK(attn_comm_destroy(comm));
  ATTN_CHECK(attn_context_destroy(ctx));
}

// Misaligned device pointers on every rank (the CUDA backend needs 16-byte
// alignment) are INVALID_ARGUMENT naming the pointer, before the first
// exchange: nothing is written and the group stays usable.
void test_misaligned(int n, ncclComm_t* comms) {
  const Case c{"misaligned", ATTN_DTYPE_BF16, ATTN_LAYOUT_BSHD, ATTN_RING_LAYOUT_ZIGZAG, 2, 1, 64,
               ATTN_MASK_CAUSAL, -1, -1, {32}, {32}, false, false};
  const Lengths l = lengths(c, n);
  const Geom lq = make_geom({c.chunks_q[0] * 2}, c.hq, c.d, false, false);
  const Geom lk = make_geom({c.chunks_kv[0] * 2}, c.hkv, c.d, false, false);
  std::mt19937_64 rng(g_seed ^ 0x6d6973616c69676eull);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<uint16_t>> local(static_cast<size_t>(n) * 4);
  for (size_t i = 0; i < local.size(); ++i) {
    local[i].resize(i % 4 == 0 || i % 4 == 3 ? lq.count() : lk.count());
    for (auto& x : local[i]) x = to_half(c.dtype, normal(rng));
  }
  std::vector<std::string> fails(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back(misaligned_rank, std::cref(c), std::cref(l), r, comms[r], &lq, &lk,
                         &local[size_t(r) * 4], &fails[size_t(r)]);
  for (auto& t : threads) t.join();
  bool ok = true;
  for (const std::string& f : fails)
    if (!f.empty()) std::printf("%s", f.c_str()), ok = false;
  std::printf("%s misaligned pointers are INVALID_ARGUMENT before the ring starts\n",
              ok ? "ok  " : "FAIL");
  if (!ok) ++g_failures;
}

// n communicators over devices 0..n-1. ATTN_TEST_NCCL_NONBLOCKING=1
// creates them non-blocking (ncclConfig_t::blocking = 0), whose calls may
// answer ncclInProgress: the library must wait those out (its transport's
// settled()), and so do creation and destruction here.
bool nonblocking_comms() {
  const char* e = std::getenv("ATTN_TEST_NCCL_NONBLOCKING");
  return e != nullptr && std::strcmp(e, "1") == 0;
}

ncclResult_t wait_comm(ncclComm_t comm, ncclResult_t r) {
  while (r == ncclInProgress) {
    std::this_thread::yield();
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
  }
  return r;
}

ncclResult_t create_comms(int n, std::vector<ncclComm_t>& comms) {
  comms.assign(static_cast<size_t>(n), nullptr);
  if (!nonblocking_comms()) {
    std::vector<int> devs(static_cast<size_t>(n));
    std::iota(devs.begin(), devs.end(), 0);
    return ncclCommInitAll(comms.data(), n, devs.data());
  }
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return r;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  r = ncclGroupStart();
  for (int i = 0; i < n && r == ncclSuccess; ++i) {
    GPU_CHECK(cudaSetDevice(i));
    r = ncclCommInitRankConfig(&comms[size_t(i)], n, id, i, &config);
    if (r == ncclInProgress) r = ncclSuccess;
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r != ncclSuccess) return r;
  if (end != ncclSuccess && end != ncclInProgress) return end;
  for (ncclComm_t c : comms) {
    r = wait_comm(c, ncclInProgress);
    if (r != ncclSuccess) return r;
  }
  return ncclSuccess;
}

void destroy_comms(std::vector<ncclComm_t>& comms) {
  for (size_t i = 0; i < comms.size(); ++i) {
    GPU_CHECK(cudaSetDevice(int(i)));
    if (nonblocking_comms()) (void)wait_comm(comms[i], ncclCommFinalize(comms[i]));
    ncclCommDestroy(comms[i]);
  }
}

}  // namespace

int main() {
  skip_without_device();
  int devices = 0;
  GPU_CHECK(cudaGetDeviceCount(&devices));
  const char* seed_env = std::getenv("ATTN_TEST_SEED");
  g_seed = seed_env ? std::strtoull(seed_env, nullptr, 10)
                    : uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run), %d GPU(s)\n",
              g_seed, g_seed, devices);
  std::vector<int> rank_counts = {1};
  for (int n : {2, 3, std::min(devices, 8)})
    if (n <= devices && n > rank_counts.back()) rank_counts.push_back(n);

  const attn_ring_layout_t contig = ATTN_RING_LAYOUT_CONTIGUOUS, zigzag = ATTN_RING_LAYOUT_ZIGZAG;
  const attn_layout_t bshd = ATTN_LAYOUT_BSHD, bhsd = ATTN_LAYOUT_BHSD;
  const attn_dtype_t bf16 = ATTN_DTYPE_BF16, fp16 = ATTN_DTYPE_FP16;
  const attn_mask_t none = ATTN_MASK_NONE, causal = ATTN_MASK_CAUSAL, window = ATTN_MASK_WINDOW;
  const Case cases[] = {
      // Fixed-length batches, full and causal.
      {"bf16-zigzag-causal-gqa-d128", bf16, bshd, zigzag, 8, 2, 128, causal, -1, -1, {128, 128},
       {128, 128}, false, false},
      {"bf16-contiguous-causal-d64", bf16, bshd, contig, 4, 1, 64, causal, -1, -1, {256}, {256},
       false, false},
      {"fp16-contiguous-full-bhsd-d64", fp16, bhsd, contig, 4, 4, 64, none, -1, -1, {192}, {192},
       false, false},
      {"bf16-zigzag-full-d96", bf16, bshd, zigzag, 2, 2, 96, none, -1, -1, {80}, {80}, false,
       false},
      {"fp16-zigzag-causal-bhsd-d256", fp16, bhsd, zigzag, 2, 1, 256, causal, -1, -1, {64}, {64},
       false, false},
      // Sliding windows: left only, left and right, causal with a left reach.
      {"bf16-contiguous-window-left-d64", bf16, bshd, contig, 4, 2, 64, window, 48, -1, {96}, {96},
       false, false},
      {"bf16-zigzag-window-left-right-gqa-d128", bf16, bshd, zigzag, 4, 2, 128, window, 40, 24,
       {64, 64}, {64, 64}, false, true},
      {"fp16-zigzag-window-causal-bhsd-d64", fp16, bhsd, zigzag, 2, 2, 64, window, 70, 0, {64},
       {64}, false, true},
      {"bf16-contiguous-window-causal-d128", bf16, bshd, contig, 2, 1, 128, window, 100, 0, {128},
       {128}, false, false},
      // seqlen_q != seqlen_kv (bottom-right alignment over the global lengths).
      {"bf16-contiguous-causal-lq<lk-d64", bf16, bshd, contig, 4, 2, 64, causal, -1, -1, {48},
       {80}, false, false},
      {"fp16-zigzag-window-lq>lk-gqa-d128", fp16, bshd, zigzag, 4, 1, 128, window, 30, 30, {72},
       {40}, false, false},  // queries 0..97 see no key
      {"bf16-zigzag-window-lq<lk-d64", bf16, bshd, zigzag, 2, 2, 64, window, 60, 0, {40}, {72},
       false, true},
      // Varlen batches (THD), a chunk of a single token among them.
      {"bf16-varlen-contiguous-causal-gqa-d64", bf16, bshd, contig, 4, 2, 64, causal, -1, -1,
       {37, 1, 64, 5}, {37, 1, 64, 5}, true, false},
      {"bf16-varlen-zigzag-causal-gqa-d128", bf16, bshd, zigzag, 8, 2, 128, causal, -1, -1,
       {1, 50, 17, 64}, {1, 50, 17, 64}, true, false},
      {"fp16-varlen-zigzag-window-d128", fp16, bshd, zigzag, 2, 2, 128, window, 30, 10,
       {20, 1, 33}, {20, 1, 33}, true, false},
      {"bf16-varlen-contiguous-full-d96", bf16, bshd, contig, 2, 1, 96, none, -1, -1, {13, 40},
       {13, 40}, true, false},
      {"bf16-varlen-contiguous-window-left-right-d128", bf16, bshd, contig, 4, 4, 128, window, 20,
       5, {30, 1, 9}, {30, 1, 9}, true, false},
      {"fp16-varlen-zigzag-window-left-gqa-d64", fp16, bshd, zigzag, 6, 2, 64, window, 24, -1,
       {40, 3, 1}, {40, 3, 1}, true, false},
      {"bf16-varlen-zigzag-window-causal-lq<lk-d64", bf16, bshd, zigzag, 2, 2, 64, window, 24, 0,
       {10, 3}, {16, 3}, true, true},
      // Empty sequences: no queries (keys only), no keys (its rows see
      // nothing: O = 0, LSE = -inf), both empty.
      {"bf16-varlen-zigzag-window-empty-seqs-gqa-d64", bf16, bshd, zigzag, 4, 2, 64, window, 20, 0,
       {8, 0, 16, 0, 3}, {8, 4, 0, 0, 3}, true, false},
      {"fp16-varlen-contiguous-causal-empty-seqs-d128", fp16, bshd, contig, 2, 2, 128, causal, -1,
       -1, {0, 24, 5}, {6, 0, 5}, true, false},
  };
  for (int n : rank_counts) {
    std::printf("-- %d rank(s)%s\n", n, n == 1 ? " (no exchanges)" : "");
    std::vector<ncclComm_t> comms;
    const ncclResult_t init = create_comms(n, comms);
    if (init != ncclSuccess) {
      std::printf("NCCL communicators (%d ranks%s): %s\n", n,
                  nonblocking_comms() ? ", non-blocking" : "", ncclGetErrorString(init));
      return 1;
    }
    for (const Case& c : cases) run_case(c, n, comms.data());
    test_not_supported(n, comms.data());
    test_misaligned(n, comms.data());
    if (n >= 2) test_creation_failure(n, comms.data());
    destroy_comms(comms);
  }
  std::printf("%s: %d failure(s), seed %" PRIu64 "\n", g_failures ? "FAILED" : "PASSED", g_failures,
              g_seed);
  return g_failures ? 1 : 0;
}
