// ring_bench: times ring attention on the CUDA backend over NCCL, one
// thread per GPU (ncclCommInitAll), next to the same dense work without any
// communication, and the NCCL exchange the ring makes.
//
//   ring_bench [--tokens-per-rank 65536] [--heads 16] [--head-dim 128]
//              [--ranks N] [--warmup 1] [--repeat 5]
//
// bf16, BSHD, batch 1, heads_q = heads_kv. The global sequence is ranks x
// tokens-per-rank long. For each configuration (causal zigzag, causal
// contiguous, full contiguous), every rank:
//   - creates its ring plan (attn_ring_plan_create, collective) and reads
//     attn_ring_plan_describe (blocks, bytes per exchange);
//   - times attn_forward, then attn_backward, on the ring plan: --warmup
//     untimed calls, then --repeat timed calls, each between two
//     cudaEventRecord on the rank's stream. Before each call every rank
//     drains its stream and meets the others at a host barrier, so a rank's
//     time is one ring pass from a common start (waiting for peers
//     included), not the tail of the previous pass;
//   - times the compute-only baseline on its own GPU, with no
//     communication: public dense plans of the ring's block shape (chunk x
//     chunk; no mask for fully visible blocks, the plan's causal mask for
//     diagonal blocks), run back to back in the ring's block order on the
//     rank's own chunks (a rank's K/V chunks stand in for the ones that would
//     have arrived: same shape, same kernels). No merge, no accumulation.
//     Its block count and (query, key) pairs are checked against
//     attn_ring_plan_describe. Its backward runs on O and LSE of an untimed
//     forward of each block.
//   - per-step breakdown: a ring plan created with ATTN_RING_PROFILE=1
//     (CUDA events between the pieces of each step, see src/ring/
//     ring_plan.hpp) runs --warmup + --repeat more forwards and backwards;
//     each piece's median is reported: block kernels, merges /
//     accumulations, the wait for the K/V exchange, the dK/dV exchange as
//     exposed on the compute stream, prologue and epilogue; each block next
//     to the same block's compute-only time (the compute-only blocks are
//     also timed one by one);
//   - the backward with ATTN_RING_DKV_HOME=0 (every shard's dK/dV sent
//     round the ring, one dK/dV exchange more than the default, which keeps
//     the own shard's home and overlaps the last exchange with the own
//     blocks): timed as the ring above, profiled likewise, and its dQ, dK,
//     dV compared with the default ring's (max |difference| / max |value|).
// Before the configurations, every rank times a plain ncclSend/ncclRecv
// exchange (send to rank + 1, receive from rank - 1, one group, as the ring
// transport does) of the ring's forward bytes per step (K and V, bf16) and
// backward dK/dV bytes (fp32).
//
// Inputs are random non-zero values (magnitude in [0.1, 1), either sign);
// outputs and workspaces are filled with NaN first, and O, LSE, dQ, dK, dV
// of the ring are checked for NaN/inf after the last call.
//
// Output: a markdown report: the exchange, per-rank and summary tables,
// then the DKV_HOME backward and the per-step breakdown. ATTN_COMMIT names the
// commit in the header. Exit status: 0 success, 1 failure (CUDA, NCCL or
// libattn error, NaN, schedule mismatch), 2 bad command line, 77 fewer than
// 2 GPUs. Host code only: the C API, the CUDA runtime API and NCCL, and the
// library's internal attn::ring::ring_profile() for the breakdown (so it
// links the static library).

#include <attn/attn.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "api/handles.hpp"
#include "ring/ring_plan.hpp"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

constexpr const char* kProg = "ring_bench";

[[noreturn]] void die(const std::string& msg) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s: %s\n", kProg, msg.c_str());
  std::fflush(stderr);
  std::_Exit(1);  // other ranks may sit in NCCL: no orderly shutdown
}

void cuda_check(cudaError_t e, const char* call, int line) {
  if (e != cudaSuccess)
    die("line " + std::to_string(line) + ": " + call + ": " + cudaGetErrorName(e) + " (" +
        cudaGetErrorString(e) + ")");
}
void nccl_check(ncclResult_t e, const char* call, int line) {
  if (e != ncclSuccess)
    die("line " + std::to_string(line) + ": " + call + ": " + ncclGetErrorString(e));
}
void attn_check(attn_status_t s, const char* call, int line) {
  if (s != ATTN_STATUS_SUCCESS)
    die("line " + std::to_string(line) + ": " + call + ": " + attn_status_string(s) + ": " +
        attn_last_error_message());
}
#define CUDA_CHECK(x) cuda_check((x), #x, __LINE__)
#define NCCL_CHECK(x) nccl_check((x), #x, __LINE__)
#define ATTN_CHECK(x) attn_check((x), #x, __LINE__)

// Host barrier for the rank threads (reusable).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock lock(m_);
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  uint64_t gen_ = 0;
};

struct Options {
  int64_t tokens = 65536, heads = 16, dim = 128;
  int ranks = 0;  // 0: every GPU (at most 8)
  int warmup = 1, repeat = 5;
};

struct Config {
  const char* name;
  attn_mask_t mask;
  attn_ring_layout_t layout;
};
const Config kConfigs[] = {
    {"causal zigzag", ATTN_MASK_CAUSAL, ATTN_RING_LAYOUT_ZIGZAG},
    {"causal contiguous", ATTN_MASK_CAUSAL, ATTN_RING_LAYOUT_CONTIGUOUS},
    {"full contiguous", ATTN_MASK_NONE, ATTN_RING_LAYOUT_CONTIGUOUS},
};
constexpr int kNumConfigs = 3;

struct Stat {
  double median = 0, min = 0, max = 0;
};
Stat stat_of(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  Stat s;
  s.median = (n % 2) ? ms[n / 2] : 0.5 * (double(ms[n / 2 - 1]) + double(ms[n / 2]));
  s.min = ms.front();
  s.max = ms.back();
  return s;
}

// The pieces of one profiled pass, in stream order, with their times over
// the repeats.
struct PieceSeries {
  int32_t step = -1, block = -1;
  attn::ring::RingPiece what = attn::ring::RingPiece::prologue;
  std::vector<float> ms;
};
enum Variant { kDefault, kDkvExchange, kNumVariants };
const char* const kVariantName[kNumVariants] = {"default (own dK/dV kept home)",
                                                "ATTN_RING_DKV_HOME=0"};

struct RankConfigResult {
  Stat ring_fwd, ring_bwd, comp_fwd, comp_bwd;
  Stat exchange_bwd;           // the backward with ATTN_RING_DKV_HOME=0
  double exchange_diff = 0.0;  // its dQ, dK, dV against the default ring's: max |diff| / max |value|
  std::vector<PieceSeries> pieces[kNumVariants][2];  // [variant][0 fwd, 1 bwd]
  // Compute-only, block by block (ring order): its step and times per call.
  std::vector<int> comp_block_step;
  std::vector<std::vector<float>> comp_block_ms[2];  // [0 fwd, 1 bwd][block]
  uint64_t blocks_computed = 0, blocks_skipped = 0, full_blocks = 0, diagonal_blocks = 0;
  uint64_t pairs = 0, bytes_fwd = 0, bytes_bwd = 0;
  int64_t chunk = 0;
  uint64_t ring_ws_fwd = 0, ring_ws_bwd = 0;
  std::string ring_kernel, comp_kernel;
};

struct RankResult {
  Stat xchg_fwd, xchg_bwd;  // exchange of the forward / backward bytes per step
  uint64_t xchg_fwd_bytes = 0, xchg_bwd_bytes = 0;
  RankConfigResult cfg[kNumConfigs];
};

// ---------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (inputs are finite)
  return uint16_t(u >> 16);
}

// Random non-zero bf16 values: magnitude in [0.1, 1), either sign.
void fill_random(std::vector<uint16_t>& h, uint64_t seed) {
  uint64_t s = seed;
  for (size_t i = 0; i < h.size(); i += 2) {
    const uint64_t r = splitmix(s);
    for (size_t j = 0; j < 2 && i + j < h.size(); ++j) {
      const uint32_t bits = uint32_t(r >> (32 * j));
      const float mag = 0.1f + 0.9f * float(bits & 0xffffffu) / 16777216.0f;
      h[i + j] = float_to_bf16((bits >> 31) ? -mag : mag);
    }
  }
}

bool all_finite_bf16(const void* dev, size_t count) {
  std::vector<uint16_t> h(count);
  CUDA_CHECK(cudaMemcpy(h.data(), dev, count * 2, cudaMemcpyDeviceToHost));
  for (uint16_t x : h)
    if ((x & 0x7f80u) == 0x7f80u) return false;
  return true;
}
bool all_finite_f32(const float* dev, size_t count) {
  std::vector<float> h(count);
  CUDA_CHECK(cudaMemcpy(h.data(), dev, count * 4, cudaMemcpyDeviceToHost));
  for (float x : h)
    if (!std::isfinite(x)) return false;
  return true;
}

// ---------------------------------------------------------------------------
// The ring's blocks on one rank, from the global chunk each local chunk is
// (mirrors the layout documented in attn.h).
// ---------------------------------------------------------------------------

struct Block {
  int step;               // ring step
  int q_chunk, kv_chunk;  // local chunk indices (K/V: of the shard held at that step)
  bool full;              // fully visible; else diagonal (causal, aligned)
  uint64_t pairs;         // per head
};

int64_t global_chunk(attn_ring_layout_t layout, int n, int rank, int c) {
  return layout == ATTN_RING_LAYOUT_ZIGZAG ? (c == 0 ? rank : 2 * n - 1 - rank) : rank;
}

std::vector<Block> ring_blocks(const Config& cfg, int n, int rank, int64_t chunk,
                               uint64_t* skipped) {
  const int chunks = cfg.layout == ATTN_RING_LAYOUT_ZIGZAG ? 2 : 1;
  std::vector<Block> blocks;
  *skipped = 0;
  for (int t = 0; t < n; ++t) {
    const int owner = (rank - t + n) % n;
    for (int qc = 0; qc < chunks; ++qc)
      for (int kc = 0; kc < chunks; ++kc) {
        const int64_t gq = global_chunk(cfg.layout, n, rank, qc);
        const int64_t gk = global_chunk(cfg.layout, n, owner, kc);
        if (cfg.mask == ATTN_MASK_NONE || gq > gk)
          blocks.push_back({t, qc, kc, true, uint64_t(chunk * chunk)});
        else if (gq == gk)
          blocks.push_back({t, qc, kc, false, uint64_t(chunk * (chunk + 1) / 2)});
        else
          ++*skipped;
      }
  }
  return blocks;
}

attn_plan_desc_t make_desc(const Options& o, int64_t seqlen, attn_mask_t mask) {
  attn_plan_desc_t d;
  ATTN_CHECK(attn_plan_desc_create(&d));
  ATTN_CHECK(attn_plan_desc_set_shape(d, 1, o.heads, o.heads, seqlen, seqlen, o.dim, o.dim));
  ATTN_CHECK(attn_plan_desc_set_dtype(d, ATTN_DTYPE_BF16));
  ATTN_CHECK(attn_plan_desc_set_layout(d, ATTN_LAYOUT_BSHD));
  ATTN_CHECK(attn_plan_desc_set_mask(d, mask, -1, -1));
  ATTN_CHECK(attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD_BACKWARD));
  return d;
}

float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---------------------------------------------------------------------------
// One rank
// ---------------------------------------------------------------------------

struct Shared {
  Options opt;
  int n = 0;
  std::vector<ncclComm_t> nccl;
  Barrier* barrier = nullptr;
  std::vector<RankResult> results;
};

class Timer {
 public:
  explicit Timer(cudaStream_t s) : s_(s) {
    CUDA_CHECK(cudaEventCreate(&a_));
    CUDA_CHECK(cudaEventCreate(&b_));
  }
  ~Timer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  void start() { CUDA_CHECK(cudaEventRecord(a_, s_)); }
  float stop() {
    CUDA_CHECK(cudaEventRecord(b_, s_));
    CUDA_CHECK(cudaEventSynchronize(b_));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a_, b_));
    return ms;
  }

 private:
  cudaStream_t s_;
  cudaEvent_t a_ = nullptr, b_ = nullptr;
};

// Creates every rank's ring plan with the environment variables `vars` set
// to their values (the ring reads its options at plan creation). Rank 0 sets and unsets
// them while the others wait at the barrier: no thread reads the
// environment while it changes.
using EnvVars = std::vector<std::pair<const char*, const char*>>;  // (name, value)
attn_plan_t create_ring_plan_with_env(Shared& sh, int r, const EnvVars& vars,
                                      attn_context_t ctx, attn_plan_desc_t desc, attn_comm_t comm,
                                      attn_ring_layout_t layout) {
  sh.barrier->wait();
  if (r == 0)
    for (const auto& [name, value] : vars) setenv(name, value, 1);
  sh.barrier->wait();
  attn_plan_t plan;
  ATTN_CHECK(attn_ring_plan_create(ctx, desc, comm, layout, &plan));
  sh.barrier->wait();
  if (r == 0)
    for (const auto& v : vars) unsetenv(v.first);
  sh.barrier->wait();
  return plan;
}

// Adds the pieces of the last `pass` of `plan` to `series` (the same
// sequence every call).
void collect_pieces(attn_plan_t plan, attn_pass_t pass, std::vector<PieceSeries>& series) {
  const std::vector<attn::ring::RingPieceTime> got = attn::ring::ring_profile(*plan->plan, pass);
  if (got.empty()) die("ring_profile: the plan made with ATTN_RING_PROFILE=1 recorded nothing");
  if (series.empty()) series.resize(got.size());
  if (series.size() != got.size()) die("ring_profile: the pieces differ between calls");
  for (size_t i = 0; i < got.size(); ++i) {
    series[i].step = got[i].step, series[i].block = got[i].block, series[i].what = got[i].what;
    series[i].ms.push_back(got[i].ms);
  }
}

// Runs `call` warmup + repeat times; each timed call starts after every
// rank has drained its stream and met at the barrier.
template <class F>
Stat time_calls(Shared& sh, cudaStream_t stream, bool sync_ranks, F&& call) {
  Timer timer(stream);
  std::vector<float> ms;
  for (int i = 0; i < sh.opt.warmup + sh.opt.repeat; ++i) {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    if (sync_ranks) sh.barrier->wait();
    timer.start();
    call();
    const float t = timer.stop();
    if (i >= sh.opt.warmup) ms.push_back(t);
  }
  return stat_of(ms);
}

void run_rank(Shared& sh, int r) {
  const Options& o = sh.opt;
  const int n = sh.n;
  RankResult& res = sh.results[size_t(r)];
  CUDA_CHECK(cudaSetDevice(r));
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // Local tensors [1, tokens, heads, dim] (bf16), LSE [1, heads, tokens].
  const size_t elems = size_t(o.tokens * o.heads * o.dim), bytes = elems * 2;
  const size_t lse_elems = size_t(o.heads * o.tokens);
  enum { Q, K, V, DO, O, DQ, DK, DV, NT };
  void* t[NT];
  for (void*& p : t) CUDA_CHECK(cudaMalloc(&p, bytes));
  float* lse;
  CUDA_CHECK(cudaMalloc(&lse, lse_elems * 4));
  {
    std::vector<uint16_t> h(elems);
    for (int i = Q; i <= DO; ++i) {
      fill_random(h, 0x5249u + uint64_t(r) * 16 + uint64_t(i));
      CUDA_CHECK(cudaMemcpy(t[i], h.data(), bytes, cudaMemcpyHostToDevice));
    }
  }

  // --- NCCL exchange of the ring's per-step sizes --------------------------
  const int next = (r + 1) % n, prev = (r - 1 + n) % n;
  res.xchg_fwd_bytes = 2 * bytes;      // K and V, bf16
  res.xchg_bwd_bytes = 2 * elems * 4;  // dK and dV accumulators, fp32
  {
    void *send, *recv;
    CUDA_CHECK(cudaMalloc(&send, res.xchg_bwd_bytes));
    CUDA_CHECK(cudaMalloc(&recv, res.xchg_bwd_bytes));
    CUDA_CHECK(cudaMemset(send, 0x3c, res.xchg_bwd_bytes));
    for (int which = 0; which < 2; ++which) {
      const size_t nb = which == 0 ? res.xchg_fwd_bytes : res.xchg_bwd_bytes;
      const Stat s = time_calls(sh, stream, true, [&] {
        NCCL_CHECK(ncclGroupStart());
        NCCL_CHECK(ncclSend(send, nb, ncclUint8, next, sh.nccl[size_t(r)], stream));
        NCCL_CHECK(ncclRecv(recv, nb, ncclUint8, prev, sh.nccl[size_t(r)], stream));
        NCCL_CHECK(ncclGroupEnd());
      });
      (which == 0 ? res.xchg_fwd : res.xchg_bwd) = s;
      std::fprintf(stderr, "%s: rank %d: exchange of %zu bytes: %.3f ms\n", kProg, r, nb,
                   s.median);
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaFree(send));
    CUDA_CHECK(cudaFree(recv));
  }

  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, r, 0, &ctx));
  attn_comm_t comm;
  ATTN_CHECK(attn_comm_create_nccl(sh.nccl[size_t(r)], &comm));
  const int64_t seqlen = o.tokens * n;

  for (int ci = 0; ci < kNumConfigs; ++ci) {
    const Config& cfg = kConfigs[ci];
    RankConfigResult& cr = res.cfg[ci];
    if (r == 0) std::fprintf(stderr, "%s: %s\n", kProg, cfg.name);

    // --- ring --------------------------------------------------------------
    attn_plan_desc_t desc = make_desc(o, seqlen, cfg.mask);
    attn_plan_t plan;
    ATTN_CHECK(attn_ring_plan_create(ctx, desc, comm, cfg.layout, &plan));
    ATTN_CHECK(attn_plan_desc_destroy(desc));
    attn_ring_plan_info_t info;
    info.struct_size = sizeof info;
    ATTN_CHECK(attn_ring_plan_describe(plan, &info));
    attn_plan_info_t pinfo;
    pinfo.struct_size = sizeof pinfo;
    ATTN_CHECK(attn_plan_describe(plan, &pinfo));
    if (std::strcmp(info.transport, "nccl") != 0)
      die(std::string("ring plan transport is \"") + info.transport + "\", not nccl");
    cr.blocks_computed = info.blocks_computed;
    cr.blocks_skipped = info.blocks_skipped;
    cr.pairs = info.local_visible_pairs;
    cr.bytes_fwd = info.bytes_per_step_forward;
    cr.bytes_bwd = info.bytes_per_step_backward;
    cr.ring_kernel = pinfo.kernel;
    size_t ws_fwd = 0, ws_bwd = 0;
    ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_fwd));
    ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &ws_bwd));
    cr.ring_ws_fwd = ws_fwd, cr.ring_ws_bwd = ws_bwd;
    void* ws;
    CUDA_CHECK(cudaMalloc(&ws, std::max(ws_fwd, ws_bwd)));
    CUDA_CHECK(cudaMemset(ws, 0xff, std::max(ws_fwd, ws_bwd)));
    for (int i = O; i <= DV; ++i) CUDA_CHECK(cudaMemset(t[i], 0xff, bytes));  // NaN
    CUDA_CHECK(cudaMemset(lse, 0xff, lse_elems * 4));

    cr.ring_fwd = time_calls(sh, stream, true, [&] {
      ATTN_CHECK(attn_forward(plan, t[Q], t[K], t[V], t[O], lse, ws, ws_fwd, stream));
    });
    cr.ring_bwd = time_calls(sh, stream, true, [&] {
      ATTN_CHECK(attn_backward(plan, t[Q], t[K], t[V], t[O], lse, t[DO], t[DQ], t[DK], t[DV], ws,
                               ws_bwd, stream));
    });
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const char* names[] = {"O", "dQ", "dK", "dV"};
    const int outs[] = {O, DQ, DK, DV};
    for (int i = 0; i < 4; ++i)
      if (!all_finite_bf16(t[outs[i]], elems))
        die(std::string(cfg.name) + ": rank " + std::to_string(r) + ": ring " + names[i] +
            " holds NaN or inf");
    if (!all_finite_f32(lse, lse_elems))
      die(std::string(cfg.name) + ": rank " + std::to_string(r) + ": ring LSE holds NaN or inf");
    ATTN_CHECK(attn_plan_destroy(plan));

    // --- the backward with every dK/dV sent round, against the default's --
    std::vector<uint16_t> ref_grads[3];
    for (int i = 0; i < 3; ++i) {
      ref_grads[i].resize(elems);
      CUDA_CHECK(cudaMemcpy(ref_grads[i].data(), t[DQ + i], bytes, cudaMemcpyDeviceToHost));
    }
    {
      attn_plan_desc_t hd = make_desc(o, seqlen, cfg.mask);
      attn_plan_t exch = create_ring_plan_with_env(sh, r, {{"ATTN_RING_DKV_HOME", "0"}}, ctx, hd,
                                                   comm, cfg.layout);
      ATTN_CHECK(attn_plan_desc_destroy(hd));
      size_t hws = 0;
      ATTN_CHECK(attn_plan_workspace_size(exch, ATTN_PASS_BACKWARD, &hws));
      void* hwsp;
      CUDA_CHECK(cudaMalloc(&hwsp, hws));
      CUDA_CHECK(cudaMemset(hwsp, 0xff, hws));
      for (int i = DQ; i <= DV; ++i) CUDA_CHECK(cudaMemset(t[i], 0xff, bytes));  // NaN
      cr.exchange_bwd = time_calls(sh, stream, true, [&] {
        ATTN_CHECK(attn_backward(exch, t[Q], t[K], t[V], t[O], lse, t[DO], t[DQ], t[DK], t[DV],
                                 hwsp, hws, stream));
      });
      CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<uint16_t> h(elems);
      for (int i = 0; i < 3; ++i) {
        CUDA_CHECK(cudaMemcpy(h.data(), t[DQ + i], bytes, cudaMemcpyDeviceToHost));
        double diff = 0, mag = 0;
        for (size_t j = 0; j < elems; ++j) {
          const double a = bf16_to_float(h[j]), b = bf16_to_float(ref_grads[i][j]);
          if (!std::isfinite(a))
            die(std::string(cfg.name) + ": rank " + std::to_string(r) +
                ": ATTN_RING_DKV_HOME=0 backward holds NaN or inf");
          diff = std::max(diff, std::fabs(a - b));
          mag = std::max(mag, std::fabs(b));
        }
        cr.exchange_diff = std::max(cr.exchange_diff, mag > 0 ? diff / mag : diff);
      }
      ATTN_CHECK(attn_plan_destroy(exch));
      CUDA_CHECK(cudaFree(hwsp));
    }

    // --- per-step breakdown: profiled plans, default and dK/dV exchange -----
    for (int var = 0; var < kNumVariants; ++var) {
      EnvVars vars = {{"ATTN_RING_PROFILE", "1"}};
      if (var == kDkvExchange) vars.push_back({"ATTN_RING_DKV_HOME", "0"});
      attn_plan_desc_t pd = make_desc(o, seqlen, cfg.mask);
      attn_plan_t prof = create_ring_plan_with_env(sh, r, vars, ctx, pd, comm, cfg.layout);
      ATTN_CHECK(attn_plan_desc_destroy(pd));
      size_t pf = 0, pb = 0;
      ATTN_CHECK(attn_plan_workspace_size(prof, ATTN_PASS_FORWARD, &pf));
      ATTN_CHECK(attn_plan_workspace_size(prof, ATTN_PASS_BACKWARD, &pb));
      void* pws = ws;
      if (std::max(pf, pb) > std::max(ws_fwd, ws_bwd)) {
        CUDA_CHECK(cudaMalloc(&pws, std::max(pf, pb)));
      }
      for (int i = 0; i < o.warmup + o.repeat; ++i) {
        CUDA_CHECK(cudaStreamSynchronize(stream));
        sh.barrier->wait();
        if (var == kDefault) {  // the option changes the backward only
          ATTN_CHECK(attn_forward(prof, t[Q], t[K], t[V], t[O], lse, pws, pf, stream));
          if (i >= o.warmup) collect_pieces(prof, ATTN_PASS_FORWARD, cr.pieces[var][0]);
          CUDA_CHECK(cudaStreamSynchronize(stream));
          sh.barrier->wait();
        }
        ATTN_CHECK(attn_backward(prof, t[Q], t[K], t[V], t[O], lse, t[DO], t[DQ], t[DK], t[DV],
                                 pws, pb, stream));
        if (i >= o.warmup) collect_pieces(prof, ATTN_PASS_BACKWARD, cr.pieces[var][1]);
      }
      CUDA_CHECK(cudaStreamSynchronize(stream));
      ATTN_CHECK(attn_plan_destroy(prof));
      if (pws != ws) CUDA_CHECK(cudaFree(pws));
    }
    CUDA_CHECK(cudaFree(ws));

    // --- compute-only: the ring's blocks as dense plans, no communication ---
    const int chunks = cfg.layout == ATTN_RING_LAYOUT_ZIGZAG ? 2 : 1;
    const int64_t chunk = o.tokens / chunks;
    cr.chunk = chunk;
    uint64_t skipped = 0;
    const std::vector<Block> blocks = ring_blocks(cfg, n, r, chunk, &skipped);
    uint64_t pairs = 0;
    for (const Block& b : blocks) {
      pairs += b.pairs * uint64_t(o.heads);
      (b.full ? cr.full_blocks : cr.diagonal_blocks) += 1;
    }
    if (blocks.size() != info.blocks_computed || skipped != info.blocks_skipped ||
        pairs != info.local_visible_pairs)
      die(std::string(cfg.name) + ": rank " + std::to_string(r) +
          ": the compute-only block list differs from attn_ring_plan_describe (" +
          std::to_string(blocks.size()) + " blocks, " + std::to_string(pairs) + " pairs vs " +
          std::to_string(info.blocks_computed) + ", " + std::to_string(info.local_visible_pairs) +
          ")");
    attn_plan_t block_plan[2] = {nullptr, nullptr};  // [0] full, [1] diagonal
    size_t bws = 0;
    for (int k = 0; k < 2; ++k) {
      const bool needed = std::any_of(blocks.begin(), blocks.end(),
                                      [&](const Block& b) { return b.full == (k == 0); });
      if (!needed) continue;
      attn_plan_desc_t bd = make_desc(o, chunk, k == 0 ? ATTN_MASK_NONE : cfg.mask);
      ATTN_CHECK(attn_plan_create(ctx, bd, &block_plan[k]));
      ATTN_CHECK(attn_plan_desc_destroy(bd));
      size_t f = 0, b = 0;
      ATTN_CHECK(attn_plan_workspace_size(block_plan[k], ATTN_PASS_FORWARD, &f));
      ATTN_CHECK(attn_plan_workspace_size(block_plan[k], ATTN_PASS_BACKWARD, &b));
      bws = std::max({bws, f, b});
      attn_plan_info_t bi;
      bi.struct_size = sizeof bi;
      ATTN_CHECK(attn_plan_describe(block_plan[k], &bi));
      if (!cr.comp_kernel.empty()) cr.comp_kernel += " + ";
      cr.comp_kernel += bi.kernel;
    }
    void* bwsp;
    CUDA_CHECK(cudaMalloc(&bwsp, bws + 1));
    CUDA_CHECK(cudaMemset(bwsp, 0xff, bws + 1));
    // Per block: its own O [chunk, heads, dim] and LSE [heads, chunk], so
    // that each block's backward reads the forward of its own inputs.
    const size_t cbytes = size_t(chunk * o.heads * o.dim) * 2;
    const size_t row = size_t(o.heads * o.dim) * 2;  // bytes per position
    std::vector<void*> bo(blocks.size());
    std::vector<float*> blse(blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i) {
      CUDA_CHECK(cudaMalloc(&bo[i], cbytes));
      CUDA_CHECK(cudaMalloc(&blse[i], size_t(o.heads * chunk) * 4));
    }
    auto at = [&](int tensor, int c) {
      return static_cast<void*>(static_cast<char*>(t[tensor]) + size_t(c) * size_t(chunk) * row);
    };
    cr.comp_fwd = time_calls(sh, stream, true, [&] {
      for (size_t i = 0; i < blocks.size(); ++i) {
        const Block& b = blocks[i];
        ATTN_CHECK(attn_forward(block_plan[b.full ? 0 : 1], at(Q, b.q_chunk), at(K, b.kv_chunk),
                                at(V, b.kv_chunk), bo[i], blse[i], bwsp, bws, stream));
      }
    });
    cr.comp_bwd = time_calls(sh, stream, true, [&] {
      for (size_t i = 0; i < blocks.size(); ++i) {
        const Block& b = blocks[i];
        ATTN_CHECK(attn_backward(block_plan[b.full ? 0 : 1], at(Q, b.q_chunk), at(K, b.kv_chunk),
                                 at(V, b.kv_chunk), bo[i], blse[i], at(DO, b.q_chunk),
                                 at(DQ, b.q_chunk), at(DK, b.kv_chunk), at(DV, b.kv_chunk), bwsp,
                                 bws, stream));
      }
    });
    // The same blocks timed one by one (events between them), for the
    // breakdown's block rows.
    {
      std::vector<cudaEvent_t> ev(blocks.size() + 1);
      for (cudaEvent_t& e : ev) CUDA_CHECK(cudaEventCreate(&e));
      for (const Block& b : blocks) cr.comp_block_step.push_back(b.step);
      for (int pass = 0; pass < 2; ++pass) {
        cr.comp_block_ms[pass].assign(blocks.size(), {});
        for (int it = 0; it < o.warmup + o.repeat; ++it) {
          CUDA_CHECK(cudaStreamSynchronize(stream));
          sh.barrier->wait();
          CUDA_CHECK(cudaEventRecord(ev[0], stream));
          for (size_t i = 0; i < blocks.size(); ++i) {
            const Block& b = blocks[i];
            attn_plan_t bp = block_plan[b.full ? 0 : 1];
            if (pass == 0)
              ATTN_CHECK(attn_forward(bp, at(Q, b.q_chunk), at(K, b.kv_chunk), at(V, b.kv_chunk),
                                      bo[i], blse[i], bwsp, bws, stream));
            else
              ATTN_CHECK(attn_backward(bp, at(Q, b.q_chunk), at(K, b.kv_chunk),
                                       at(V, b.kv_chunk), bo[i], blse[i], at(DO, b.q_chunk),
                                       at(DQ, b.q_chunk), at(DK, b.kv_chunk), at(DV, b.kv_chunk),
                                       bwsp, bws, stream));
            CUDA_CHECK(cudaEventRecord(ev[i + 1], stream));
          }
          CUDA_CHECK(cudaEventSynchronize(ev.back()));
          if (it < o.warmup) continue;
          for (size_t i = 0; i < blocks.size(); ++i) {
            float ms = 0;
            CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
            cr.comp_block_ms[pass][i].push_back(ms);
          }
        }
      }
      for (cudaEvent_t e : ev) CUDA_CHECK(cudaEventDestroy(e));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (!all_finite_bf16(bo[i], cbytes / 2))
        die(std::string(cfg.name) + ": compute-only O holds NaN or inf");
      CUDA_CHECK(cudaFree(bo[i]));
      CUDA_CHECK(cudaFree(blse[i]));
    }
    for (attn_plan_t p : block_plan) ATTN_CHECK(attn_plan_destroy(p));
    CUDA_CHECK(cudaFree(bwsp));
    // Progress on stderr, so that a run cut short still leaves its numbers.
    std::fprintf(stderr,
                 "%s: %s, rank %d: ring fwd %.2f ms, bwd %.2f ms; compute-only fwd %.2f ms, "
                 "bwd %.2f ms\n",
                 kProg, cfg.name, r, cr.ring_fwd.median, cr.ring_bwd.median, cr.comp_fwd.median,
                 cr.comp_bwd.median);
  }

  sh.barrier->wait();  // no rank leaves the communicator while others use it
  ATTN_CHECK(attn_comm_destroy(comm));
  ATTN_CHECK(attn_context_destroy(ctx));
  for (void* p : t) CUDA_CHECK(cudaFree(p));
  CUDA_CHECK(cudaFree(lse));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------

void usage(FILE* f) {
  std::fprintf(f,
               "usage: %s [--tokens-per-rank N] [--heads H] [--head-dim D] [--ranks R]\n"
               "          [--warmup W] [--repeat N]\n"
               "defaults: 65536 tokens per rank, 16 heads, d 128, every GPU (<= 8),\n"
               "          1 warm-up and 5 timed calls per pass\n",
               kProg);
}

bool parse_int(const char* s, int64_t lo, int64_t hi, int64_t* out) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

double median_of(std::vector<float> v) { return v.empty() ? 0.0 : stat_of(std::move(v)).median; }

// The breakdown of one profiled pass over the ranks: a summary row per rank
// (pieces of each kind summed, each piece at its median), then the pieces.
void print_breakdown(const Shared& sh, int ci, int var, int pass) {
  using attn::ring::RingPiece;
  const int n = sh.n;
  const Config& cfg = kConfigs[ci];
  const char* pname = pass == 0 ? "fwd" : "bwd";
  std::printf("\n### %s, %s, %s\n\n", cfg.name, pname, kVariantName[var]);
  std::printf("| rank | ring ms (timed) | pieces total | blocks | %s | wait K/V | dK/dV exchange | "
              "prologue | epilogue | comp-only ms | total - comp-only |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n",
              pass == 0 ? "merges" : "accumulations");
  for (int r = 0; r < n; ++r) {
    const RankConfigResult& c = sh.results[size_t(r)].cfg[ci];
    double sum[7] = {0, 0, 0, 0, 0, 0, 0}, total = 0;
    for (const PieceSeries& p : c.pieces[var][pass]) {
      const double m = median_of(p.ms);
      sum[int(p.what)] += m;
      total += m;
    }
    const double timed = pass == 0 ? c.ring_fwd.median
                                   : (var == kDkvExchange ? c.exchange_bwd.median
                                                          : c.ring_bwd.median);
    const double comp = pass == 0 ? c.comp_fwd.median : c.comp_bwd.median;
    std::printf("| %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", r,
                timed, total, sum[int(RingPiece::block)],
                sum[int(RingPiece::merge)] + sum[int(RingPiece::accumulate)],
                sum[int(RingPiece::wait_kv)], sum[int(RingPiece::exchange_dkv)],
                sum[int(RingPiece::prologue)], sum[int(RingPiece::epilogue)], comp, total - comp);
  }
  // Pieces: one column per rank when every rank ran the same sequence.
  const std::vector<PieceSeries>& first = sh.results[0].cfg[ci].pieces[var][pass];
  bool same = true;
  for (int r = 1; r < n && same; ++r) {
    const std::vector<PieceSeries>& o = sh.results[size_t(r)].cfg[ci].pieces[var][pass];
    same = o.size() == first.size();
    for (size_t i = 0; same && i < o.size(); ++i)
      same = o[i].step == first[i].step && o[i].block == first[i].block &&
             o[i].what == first[i].what;
  }
  // The compute-only time of the block a piece ran (same step, same index
  // within the step), or a dash.
  auto comp_of = [&](int r, const PieceSeries& p) -> std::string {
    const RankConfigResult& c = sh.results[size_t(r)].cfg[ci];
    if (p.what != RingPiece::block) return "-";
    int seen = 0;
    for (size_t i = 0; i < c.comp_block_step.size(); ++i)
      if (c.comp_block_step[i] == p.step && seen++ == p.block) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.3f", median_of(c.comp_block_ms[pass][i]));
        return buf;
      }
    return "?";
  };
  auto where = [](const PieceSeries& p) {
    return (p.step < 0 ? std::string("-") : std::to_string(p.step)) + " | " +
           (p.block < 0 ? std::string("-") : std::to_string(p.block)) + " | " +
           attn::ring::ring_piece_name(p.what);
  };
  std::printf("\nPieces in stream order, median ms (step -: before the first / after the last):"
              "\n\n");
  if (same) {
    std::printf("| step | block | piece |");
    for (int r = 0; r < n; ++r) std::printf(" rank %d ms | rank %d comp-only ms |", r, r);
    std::printf("\n|---|---|---|");
    for (int r = 0; r < n; ++r) std::printf("---|---|");
    std::printf("\n");
    for (size_t i = 0; i < first.size(); ++i) {
      std::printf("| %s |", where(first[i]).c_str());
      for (int r = 0; r < n; ++r) {
        const PieceSeries& p = sh.results[size_t(r)].cfg[ci].pieces[var][pass][i];
        std::printf(" %.3f | %s |", median_of(p.ms), comp_of(r, p).c_str());
      }
      std::printf("\n");
    }
    return;
  }
  std::printf("| rank | step | block | piece | median ms | comp-only ms |\n"
              "|---|---|---|---|---|---|\n");
  for (int r = 0; r < n; ++r)
    for (const PieceSeries& p : sh.results[size_t(r)].cfg[ci].pieces[var][pass])
      std::printf("| %d | %s | %.3f | %s |\n", r, where(p).c_str(), median_of(p.ms),
                  comp_of(r, p).c_str());
}

double tflops(uint64_t pairs, double d, double mult, double ms) {
  return ms > 0 ? 4.0 * double(pairs) * d * mult / (ms * 1e-3) / 1e12 : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  Shared sh;
  Options& o = sh.opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    }
    int64_t v = 0;
    if (i + 1 >= argc) {
      usage(stderr);
      return 2;
    }
    const char* val = argv[++i];
    bool ok = true;
    if (a == "--tokens-per-rank") ok = parse_int(val, 2, int64_t(1) << 24, &o.tokens);
    else if (a == "--heads") ok = parse_int(val, 1, 1024, &o.heads);
    else if (a == "--head-dim") ok = parse_int(val, 1, 256, &o.dim);
    else if (a == "--ranks") ok = parse_int(val, 2, 8, &v), o.ranks = int(v);
    else if (a == "--warmup") ok = parse_int(val, 0, 100, &v), o.warmup = int(v);
    else if (a == "--repeat") ok = parse_int(val, 1, 1000, &v), o.repeat = int(v);
    else ok = false;
    if (!ok) {
      std::fprintf(stderr, "%s: bad option or value: %s %s\n", kProg, a.c_str(), val);
      usage(stderr);
      return 2;
    }
  }
  if (o.tokens % 2 != 0) {
    std::fprintf(stderr, "%s: --tokens-per-rank must be even (zigzag: 2 chunks per rank)\n",
                 kProg);
    return 2;
  }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  const int n = o.ranks ? o.ranks : std::min(devices, 8);
  if (devices < 2 || n > devices) {
    std::printf("SKIP: ring_bench needs %d GPUs (at least 2), found %d\n", std::max(n, 2),
                devices);
    return 77;
  }
  sh.n = n;
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int nccl_version = 0, driver = 0, runtime = 0;
  NCCL_CHECK(ncclGetVersion(&nccl_version));
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  int p2p = 0;
  CUDA_CHECK(cudaDeviceCanAccessPeer(&p2p, 0, 1));

  sh.nccl.resize(size_t(n));
  std::vector<int> devs(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) devs[size_t(i)] = i;
  NCCL_CHECK(ncclCommInitAll(sh.nccl.data(), n, devs.data()));
  Barrier barrier(n);
  sh.barrier = &barrier;
  sh.results.resize(size_t(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(run_rank, std::ref(sh), r);
  for (auto& th : threads) th.join();
  for (ncclComm_t c : sh.nccl) ncclCommDestroy(c);

  // --- report ---------------------------------------------------------------
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  const char* commit = std::getenv("ATTN_COMMIT");
  const double d = double(o.dim);
  std::printf("# Ring attention, CUDA backend over NCCL\n\n");
  std::printf("- date: %s; commit: %s; libattn %s\n", date, commit ? commit : "(unknown)",
              attn_version_string());
  std::printf("- device: %d x %s (%d SMs, %.0f GiB), peer access 0<->1: %s; NCCL %d; "
              "CUDA driver %d, runtime %d\n",
              n, prop.name, prop.multiProcessorCount, double(prop.totalGlobalMem) / (1 << 30),
              p2p ? "yes" : "no", nccl_version, driver, runtime);
  std::printf("- problem: bf16, BSHD, batch 1, %" PRId64 " heads (q = kv), d %" PRId64
              ", %d ranks x %" PRId64 " tokens = %" PRId64 " global\n",
              o.heads, o.dim, n, o.tokens, o.tokens * n);
  std::printf("- timing: CUDA events on each rank's stream, %d warm-up + %d timed calls per "
              "pass, median (min); ranks drain their stream and meet at a host barrier before "
              "each call\n",
              o.warmup, o.repeat);
  std::printf("- compute-only: the ring's own blocks as public dense plans of the block shape "
              "(chunk x chunk; no mask when fully visible, causal on the diagonal), in the "
              "ring's order on the rank's GPU, without merge, accumulation or communication\n\n");

  std::printf("## NCCL exchange (ncclSend to rank+1 / ncclRecv from rank-1, one group)\n\n");
  std::printf("| rank | bytes | median ms | min ms | GB/s per direction (median) |\n|---|---|---|---|---|\n");
  for (int r = 0; r < n; ++r) {
    const RankResult& rr = sh.results[size_t(r)];
    for (int w = 0; w < 2; ++w) {
      const uint64_t b = w ? rr.xchg_bwd_bytes : rr.xchg_fwd_bytes;
      const Stat& s = w ? rr.xchg_bwd : rr.xchg_fwd;
      std::printf("| %d | %" PRIu64 " (%s) | %.3f | %.3f | %.1f |\n", r, b,
                  w ? "dK+dV fp32" : "K+V bf16", s.median, s.min,
                  double(b) / (s.median * 1e-3) / 1e9);
    }
  }

  std::printf("\n## Per rank\n\n");
  std::printf("| config | rank | chunk | blocks (full+diag / skipped) | pairs | ring fwd ms | "
              "comp fwd ms | fwd ratio | ring bwd ms | comp bwd ms | bwd ratio | ring fwd TF/s | "
              "ring bwd TF/s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int ci = 0; ci < kNumConfigs; ++ci)
    for (int r = 0; r < n; ++r) {
      const RankConfigResult& c = sh.results[size_t(r)].cfg[ci];
      std::printf("| %s | %d | %" PRId64 " | %" PRIu64 "+%" PRIu64 " / %" PRIu64 " | %.3g | "
                  "%.2f (%.2f) | %.2f (%.2f) | %.3f | %.2f (%.2f) | %.2f (%.2f) | %.3f | %.0f | "
                  "%.0f |\n",
                  kConfigs[ci].name, r, c.chunk, c.full_blocks, c.diagonal_blocks,
                  c.blocks_skipped, double(c.pairs), c.ring_fwd.median, c.ring_fwd.min,
                  c.comp_fwd.median, c.comp_fwd.min, c.ring_fwd.median / c.comp_fwd.median,
                  c.ring_bwd.median, c.ring_bwd.min, c.comp_bwd.median, c.comp_bwd.min,
                  c.ring_bwd.median / c.comp_bwd.median,
                  tflops(c.pairs, d, 1.0, c.ring_fwd.median),
                  tflops(c.pairs, d, 2.5, c.ring_bwd.median));
    }
  const RankConfigResult& c0 = sh.results[0].cfg[0];
  std::printf("\nring kernels: %s; compute-only kernels: %s. Bytes sent per step: forward %" PRIu64
              " (K+V bf16), backward %" PRIu64 " (K+V bf16 + dK+dV fp32). Ring workspace per "
              "rank (zigzag causal): forward %.2f GiB, backward %.2f GiB.\n",
              c0.ring_kernel.c_str(), c0.comp_kernel.c_str(), c0.bytes_fwd, c0.bytes_bwd,
              double(c0.ring_ws_fwd) / (1 << 30), double(c0.ring_ws_bwd) / (1 << 30));

  // Summary: slowest rank (the ring's wall time) against the slowest rank's
  // compute-only work; balance as max/min over ranks.
  std::printf("\n## Summary (slowest rank; balance = max/min over ranks)\n\n");
  std::printf("| config | ring fwd ms | comp fwd ms | fwd ratio | ring bwd ms | comp bwd ms | "
              "bwd ratio | ring fwd bal | ring bwd bal | comp fwd bal | comp bwd bal |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int ci = 0; ci < kNumConfigs; ++ci) {
    double v[4][2] = {{0, 1e300}, {0, 1e300}, {0, 1e300}, {0, 1e300}};  // max, min
    for (int r = 0; r < n; ++r) {
      const RankConfigResult& c = sh.results[size_t(r)].cfg[ci];
      const double m[4] = {c.ring_fwd.median, c.comp_fwd.median, c.ring_bwd.median,
                           c.comp_bwd.median};
      for (int k = 0; k < 4; ++k) v[k][0] = std::max(v[k][0], m[k]), v[k][1] = std::min(v[k][1], m[k]);
    }
    std::printf("| %s | %.2f | %.2f | %.3f | %.2f | %.2f | %.3f | %.3f | %.3f | %.3f | %.3f |\n",
                kConfigs[ci].name, v[0][0], v[1][0], v[0][0] / v[1][0], v[2][0], v[3][0],
                v[2][0] / v[3][0], v[0][0] / v[0][1], v[2][0] / v[2][1], v[1][0] / v[1][1],
                v[3][0] / v[3][1]);
  }

  std::printf("\n## Backward: default (own shard's dK/dV kept home) and ATTN_RING_DKV_HOME=0 "
              "(every shard's dK/dV sent round)\n\n");
  std::printf("| config | rank | default bwd ms | DKV_HOME=0 bwd ms | default / DKV_HOME=0 | "
              "default / comp | DKV_HOME=0 dQ, dK, dV vs default (max diff / max value) |\n"
              "|---|---|---|---|---|---|---|\n");
  for (int ci = 0; ci < kNumConfigs; ++ci)
    for (int r = 0; r < n; ++r) {
      const RankConfigResult& c = sh.results[size_t(r)].cfg[ci];
      std::printf("| %s | %d | %.2f (%.2f) | %.2f (%.2f) | %.3f | %.3f | %.2e |\n",
                  kConfigs[ci].name, r, c.ring_bwd.median, c.ring_bwd.min, c.exchange_bwd.median,
                  c.exchange_bwd.min, c.ring_bwd.median / c.exchange_bwd.median,
                  c.ring_bwd.median / c.comp_bwd.median, c.exchange_diff);
    }

  std::printf("\n## Per-step breakdown (ATTN_RING_PROFILE=1)\n\n");
  std::printf("Ring plans created with ATTN_RING_PROFILE=1 record a CUDA event on the rank's "
              "stream after each piece; a piece's time runs from the previous event to its own. "
              "%d warm-up + %d profiled calls per pass, separate from the timed ones above; "
              "medians. blocks: the blocks' dense kernels; merges / accumulations: the (O, LSE) "
              "merge or the dQ/dK/dV fp32 additions after each block; wait K/V: the compute "
              "stream waiting for the K/V exchange after the step's blocks (exposed "
              "communication); dK/dV exchange: the accumulators' exchange as the stream "
              "waits for it; prologue: zeroing, gathers, K/V packing; epilogue: outputs from "
              "the fp32 sums (in the default backward: after adding the returned dK/dV). The "
              "forward has no ATTN_RING_DKV_HOME=0 variant (the option changes the backward "
              "only). comp-only ms: the "
              "same block as a dense plan alone, timed one by one after the compute-only "
              "runs (a block slower in the ring than alone shares the GPU with the NCCL "
              "kernels of an exchange in flight, or waits for them).\n",
              o.warmup, o.repeat);
  for (int ci = 0; ci < kNumConfigs; ++ci) {
    print_breakdown(sh, ci, kDefault, 0);
    print_breakdown(sh, ci, kDefault, 1);
    print_breakdown(sh, ci, kDkvExchange, 1);
  }
  return 0;
}
