// Ring attention on the CUDA backend over NCCL: one thread per GPU, one
// NCCL communicator each (ncclCommInitAll), every rank running forward and
// backward on its shards; the results, put back in their global places,
// are compared with single-GPU dense attention on the whole sequence.
//
// Reference: the CPU backend in fp32 on the same (dtype-rounded) inputs.
// Tolerance, per output X (FlashAttention's rule with the dense CUDA plan as
// the same-precision yardstick):
//     max |X_ring - X_ref| <= 2 max |X_dense - X_ref| + 4 u max |X_ref|
// (u the dtype's unit roundoff; LSE: + 1e-4 max(1, |LSE_ref|)). Outputs are
// poisoned before the run. Also checked: attn_ring_plan_describe names the
// NCCL transport, and a ring the CUDA kernels cannot run (a window) is
// NOT_SUPPORTED on every rank.
// Exit 77 with fewer than 2 GPUs. ATTN_TEST_SEED=n repeats a run.

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_common.hpp"

using namespace gpu_test;

namespace {

uint64_t g_seed = 0;
int g_failures = 0;

struct Case {
  std::string name;
  attn_dtype_t dtype;
  attn_layout_t layout;
  attn_ring_layout_t ring;
  int64_t batch, hq, hkv, chunk, d;  // chunk: positions per chunk (seqlen = chunks * chunk)
  attn_mask_t mask;
};

// [batch, seq, heads, dim] in the case's layout.
struct Geom {
  int64_t batch, seq, heads, dim;
  bool bhsd;
  size_t count() const { return size_t(batch * seq * heads * dim); }
  size_t index(int64_t b, int64_t s, int64_t h, int64_t c) const {
    return size_t(bhsd ? ((b * heads + h) * seq + s) * dim + c : ((b * seq + s) * heads + h) * dim + c);
  }
};

int64_t global_pos(const Case& c, int n, int rank, int64_t len, int64_t s) {
  const bool zig = c.ring == ATTN_RING_LAYOUT_ZIGZAG;
  const int64_t chunk = len / (zig ? 2 * n : n);
  const int64_t k = s / chunk;
  const int64_t g = zig ? (k == 0 ? rank : 2 * n - 1 - rank) : rank;
  return g * chunk + s % chunk;
}

template <class T>
void shard(const Case& c, int n, int rank, const Geom& gg, const Geom& lg, std::vector<T>& global,
           std::vector<T>& local, bool to_local) {
  for (int64_t b = 0; b < lg.batch; ++b)
    for (int64_t s = 0; s < lg.seq; ++s) {
      const int64_t gs = global_pos(c, n, rank, gg.seq, s);
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

attn_plan_desc_t make_desc(const Case& c, int64_t seqlen) {
  attn_plan_desc_t d;
  ATTN_CHECK(attn_plan_desc_create(&d));
  ATTN_CHECK(attn_plan_desc_set_shape(d, c.batch, c.hq, c.hkv, seqlen, seqlen, c.d, c.d));
  ATTN_CHECK(attn_plan_desc_set_dtype(d, c.dtype));
  ATTN_CHECK(attn_plan_desc_set_layout(d, c.layout));
  ATTN_CHECK(attn_plan_desc_set_mask(d, c.mask, c.mask == ATTN_MASK_WINDOW ? 16 : -1,
                                     c.mask == ATTN_MASK_WINDOW ? 0 : -1));
  ATTN_CHECK(attn_plan_desc_set_passes(d, ATTN_PASSES_FORWARD_BACKWARD));
  return d;
}

// Dense plan on device 0, or the fp32 CPU reference (cpu = true, inputs as float).
void run_dense(const Case& c, int64_t seqlen, bool cpu, const Geom& gq, const Geom& gk,
               const std::vector<uint16_t>* in16, std::vector<float>* out32, Outputs* out16) {
  attn_plan_desc_t desc = make_desc(c, seqlen);
  if (cpu) ATTN_CHECK(attn_plan_desc_set_dtype(desc, ATTN_DTYPE_FP32));
  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(cpu ? ATTN_BACKEND_CPU : ATTN_BACKEND_CUDA, 0, 0, &ctx));
  attn_plan_t plan;
  ATTN_CHECK(attn_plan_create(ctx, desc, &plan));
  size_t fwd = 0, bwd = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fwd));
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &bwd));
  const size_t nq = gq.count(), nk = gk.count(), nl = size_t(c.batch * c.hq * seqlen);
  if (cpu) {
    // in: q k v do as float; out: o dq dk dv lse
    std::vector<float> f[4];
    for (int i = 0; i < 4; ++i) {
      const size_t n = (i == 0 || i == 3) ? nq : nk;
      f[i].resize(n);
      for (size_t j = 0; j < n; ++j) f[i][j] = from_half(c.dtype, in16[i][j]);
    }
    out32[0].assign(nq, 0.0f), out32[1].assign(nq, 0.0f), out32[2].assign(nk, 0.0f);
    out32[3].assign(nk, 0.0f), out32[4].assign(nl, 0.0f);
    std::vector<char> ws(std::max(fwd, bwd) + 1);
    ATTN_CHECK(attn_forward(plan, f[0].data(), f[1].data(), f[2].data(), out32[0].data(),
                            out32[4].data(), ws.data(), fwd, nullptr));
    ATTN_CHECK(attn_backward(plan, f[0].data(), f[1].data(), f[2].data(), out32[0].data(),
                             out32[4].data(), f[3].data(), out32[1].data(), out32[2].data(),
                             out32[3].data(), ws.data(), bwd, nullptr));
  } else {
    void* dev[9];
    const size_t sizes[9] = {nq * 2, nk * 2, nk * 2, nq * 2, nq * 2, nq * 2, nk * 2, nk * 2, nl * 4};
    for (int i = 0; i < 9; ++i) GPU_CHECK(cudaMalloc(&dev[i], sizes[i]));
    GPU_CHECK(cudaMemcpy(dev[0], in16[0].data(), sizes[0], cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMemcpy(dev[1], in16[1].data(), sizes[1], cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMemcpy(dev[2], in16[2].data(), sizes[2], cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMemcpy(dev[3], in16[3].data(), sizes[3], cudaMemcpyHostToDevice));
    void* ws = nullptr;
    GPU_CHECK(cudaMalloc(&ws, std::max(fwd, bwd) + 1));
    ATTN_CHECK(attn_forward(plan, dev[0], dev[1], dev[2], dev[4], static_cast<float*>(dev[8]), ws,
                            fwd, nullptr));
    ATTN_CHECK(attn_backward(plan, dev[0], dev[1], dev[2], dev[4], static_cast<float*>(dev[8]),
                             dev[3], dev[5], dev[6], dev[7], ws, bwd, nullptr));
    GPU_CHECK(cudaDeviceSynchronize());
    out16->o.resize(nq), out16->dq.resize(nq), out16->dk.resize(nk), out16->dv.resize(nk);
    out16->lse.resize(nl);
    GPU_CHECK(cudaMemcpy(out16->o.data(), dev[4], sizes[4], cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(out16->dq.data(), dev[5], sizes[5], cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(out16->dk.data(), dev[6], sizes[6], cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(out16->dv.data(), dev[7], sizes[7], cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(out16->lse.data(), dev[8], sizes[8], cudaMemcpyDeviceToHost));
    for (void* p : dev) GPU_CHECK(cudaFree(p));
    GPU_CHECK(cudaFree(ws));
  }
  ATTN_CHECK(attn_plan_destroy(plan));
  ATTN_CHECK(attn_context_destroy(ctx));
  ATTN_CHECK(attn_plan_desc_destroy(desc));
}

struct RankResult {
  attn_status_t create = ATTN_STATUS_INTERNAL_ERROR, fwd = ATTN_STATUS_INTERNAL_ERROR,
                bwd = ATTN_STATUS_INTERNAL_ERROR;
  std::string message, transport;
  Outputs out;
};

// Rank r on GPU r: its shards in, forward and backward, results out.
void run_rank(const Case& c, int n, int r, ncclComm_t nccl, int64_t seqlen, const Geom& lq,
              const Geom& lk, const std::vector<uint16_t>* local_in, RankResult* res,
              bool run) {
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
  attn_plan_desc_t desc = make_desc(c, seqlen);
  attn_plan_t plan = nullptr;
  res->create = attn_ring_plan_create(ctx, desc, comm, c.ring, &plan);
  res->message = attn_last_error_message();
  ATTN_CHECK(attn_plan_desc_destroy(desc));
  if (res->create == ATTN_STATUS_SUCCESS && run) {
    attn_ring_plan_info_t info;
    info.struct_size = sizeof info;
    ATTN_CHECK(attn_ring_plan_describe(plan, &info));
    res->transport = info.transport;
    size_t fwd = 0, bwd = 0;
    ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fwd));
    ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &bwd));
    const size_t nq = lq.count(), nk = lk.count(), nl = size_t(c.batch * c.hq * lq.seq);
    void* dev[9];
    const size_t sizes[9] = {nq * 2, nk * 2, nk * 2, nq * 2, nq * 2, nq * 2, nk * 2, nk * 2, nl * 4};
    for (int i = 0; i < 9; ++i) GPU_CHECK(cudaMalloc(&dev[i], sizes[i]));
    for (int i = 0; i < 4; ++i)
      GPU_CHECK(cudaMemcpy(dev[i], local_in[i].data(), sizes[i], cudaMemcpyHostToDevice));
    for (int i = 4; i < 9; ++i) GPU_CHECK(cudaMemset(dev[i], 0xff, sizes[i]));  // NaN
    void* ws = nullptr;
    GPU_CHECK(cudaMalloc(&ws, std::max(fwd, bwd) + 1));
    GPU_CHECK(cudaMemset(ws, 0xff, std::max(fwd, bwd) + 1));
    cudaStream_t stream;
    GPU_CHECK(cudaStreamCreate(&stream));
    res->fwd = attn_forward(plan, dev[0], dev[1], dev[2], dev[4], static_cast<float*>(dev[8]), ws,
                            fwd, stream);
    if (res->fwd != ATTN_STATUS_SUCCESS) res->message = attn_last_error_message();
    if (res->fwd == ATTN_STATUS_SUCCESS) {
      res->bwd = attn_backward(plan, dev[0], dev[1], dev[2], dev[4], static_cast<float*>(dev[8]),
                               dev[3], dev[5], dev[6], dev[7], ws, bwd, stream);
      if (res->bwd != ATTN_STATUS_SUCCESS) res->message = attn_last_error_message();
    }
    GPU_CHECK(cudaStreamSynchronize(stream));
    Outputs& o = res->out;
    o.o.resize(nq), o.dq.resize(nq), o.dk.resize(nk), o.dv.resize(nk), o.lse.resize(nl);
    GPU_CHECK(cudaMemcpy(o.o.data(), dev[4], sizes[4], cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(o.dq.data(), dev[5], sizes[5], cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(o.dk.data(), dev[6], sizes[6], cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(o.dv.data(), dev[7], sizes[7], cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(o.lse.data(), dev[8], sizes[8], cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaStreamDestroy(stream));
    for (void* p : dev) GPU_CHECK(cudaFree(p));
    GPU_CHECK(cudaFree(ws));
  }
  if (plan) ATTN_CHECK(attn_plan_destroy(plan));
  ATTN_CHECK(attn_comm_destroy(comm));
  ATTN_CHECK(attn_context_destroy(ctx));
}

double max_err(const std::vector<uint16_t>& got, attn_dtype_t t, const std::vector<float>& ref,
               bool* bad) {
  double m = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = from_half(t, got[i]);
    if (!std::isfinite(g)) *bad = true;
    m = std::max(m, std::fabs(g - double(ref[i])));
  }
  return m;
}

double max_err_lse(const std::vector<float>& got, const std::vector<float>& ref, bool* bad) {
  double m = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) *bad = true;
    m = std::max(m, std::fabs(double(got[i]) - double(ref[i])));
  }
  return m;
}

double max_abs(const std::vector<float>& x) {
  double m = 0.0;
  for (float v : x) m = std::max(m, double(std::fabs(v)));
  return m;
}

void run_case(const Case& c, int n, ncclComm_t* comms) {
  const int64_t chunks = c.ring == ATTN_RING_LAYOUT_ZIGZAG ? 2 * n : n;
  const int64_t seqlen = chunks * c.chunk;
  const bool bhsd = c.layout == ATTN_LAYOUT_BHSD;
  const Geom gq{c.batch, seqlen, c.hq, c.d, bhsd}, gk{c.batch, seqlen, c.hkv, c.d, bhsd};
  const Geom lq{c.batch, seqlen / n, c.hq, c.d, bhsd}, lk{c.batch, seqlen / n, c.hkv, c.d, bhsd};

  std::mt19937_64 rng(g_seed ^ std::hash<std::string>()(c.name));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> in[4];  // q k v dO
  for (int i = 0; i < 4; ++i) {
    in[i].resize(i == 0 || i == 3 ? gq.count() : gk.count());
    for (auto& x : in[i]) x = to_half(c.dtype, normal(rng));
  }
  std::vector<float> ref[5];  // o dq dk dv lse
  run_dense(c, seqlen, true, gq, gk, in, ref, nullptr);
  Outputs dense;
  run_dense(c, seqlen, false, gq, gk, in, nullptr, &dense);

  std::vector<std::vector<uint16_t>> local(static_cast<size_t>(n) * 4);
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < 4; ++i) {
      local[size_t(r) * 4 + size_t(i)].resize(i == 0 || i == 3 ? lq.count() : lk.count());
      shard(c, n, r, i == 0 || i == 3 ? gq : gk, i == 0 || i == 3 ? lq : lk, in[i],
            local[size_t(r) * 4 + size_t(i)], true);
    }
  std::vector<RankResult> res(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back(run_rank, std::cref(c), n, r, comms[r], seqlen, std::cref(lq),
                         std::cref(lk), &local[size_t(r) * 4], &res[size_t(r)], true);
  for (auto& t : threads) t.join();

  Outputs ring;
  ring.o.assign(gq.count(), 0), ring.dq.assign(gq.count(), 0);
  ring.dk.assign(gk.count(), 0), ring.dv.assign(gk.count(), 0);
  ring.lse.assign(size_t(c.batch * c.hq * seqlen), 0.0f);
  bool ok = true;
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
    shard(c, n, r, gq, lq, ring.o, rr.out.o, false);
    shard(c, n, r, gq, lq, ring.dq, rr.out.dq, false);
    shard(c, n, r, gk, lk, ring.dk, rr.out.dk, false);
    shard(c, n, r, gk, lk, ring.dv, rr.out.dv, false);
    for (int64_t bh = 0; bh < c.batch * c.hq; ++bh)
      for (int64_t s = 0; s < lq.seq; ++s)
        ring.lse[size_t(bh * seqlen + global_pos(c, n, r, seqlen, s))] =
            rr.out.lse[size_t(bh * lq.seq + s)];
  }
  if (ok) {
    const double u = c.dtype == ATTN_DTYPE_BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    const double m_grad = std::max({max_abs(ref[1]), max_abs(ref[2]), max_abs(ref[3])});
    const char* names[5] = {"O", "dQ", "dK", "dV", "LSE"};
    const std::vector<uint16_t>* rg[4] = {&ring.o, &ring.dq, &ring.dk, &ring.dv};
    const std::vector<uint16_t>* dn[4] = {&dense.o, &dense.dq, &dense.dk, &dense.dv};
    for (int i = 0; i < 5; ++i) {
      bool bad = false, dense_bad = false;
      double e_ring, e_dense, atol;
      if (i < 4) {
        e_ring = max_err(*rg[i], c.dtype, ref[i], &bad);
        e_dense = max_err(*dn[i], c.dtype, ref[i], &dense_bad);
        atol = 4.0 * u * (i == 0 ? max_abs(ref[0]) : m_grad);
      } else {
        e_ring = max_err_lse(ring.lse, ref[4], &bad);
        e_dense = max_err_lse(dense.lse, ref[4], &dense_bad);
        atol = 1e-4 * std::max(1.0, max_abs(ref[4]));
      }
      const double tol = 2.0 * e_dense + atol;
      const bool pass = !bad && !dense_bad && e_ring <= tol;
      std::printf("  %-3s ring err %.3g, dense err %.3g, tol %.3g%s\n", names[i], e_ring, e_dense,
                  tol, pass ? "" : (bad ? "  NON-FINITE" : "  FAIL"));
      ok = ok && pass;
    }
  }
  std::printf("%s %s (%d ranks, seqlen %" PRId64 ")\n", ok ? "ok  " : "FAIL", c.name.c_str(), n,
              seqlen);
  if (!ok) ++g_failures;
}

// Windows give blocks the CUDA kernels cannot run: every rank says so.
void test_not_supported(int n, ncclComm_t* comms) {
  const Case c{"window", ATTN_DTYPE_BF16, ATTN_LAYOUT_BSHD, ATTN_RING_LAYOUT_CONTIGUOUS, 1, 2, 2,
               64, 64, ATTN_MASK_WINDOW};
  const Geom lq{1, 64, 2, 64, false};
  std::vector<RankResult> res(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back(run_rank, std::cref(c), n, r, comms[r], int64_t(64) * n, std::cref(lq),
                         std::cref(lq), nullptr, &res[size_t(r)], false);
  for (auto& t : threads) t.join();
  bool ok = true;
  for (int r = 0; r < n; ++r)
    if (res[size_t(r)].create != ATTN_STATUS_NOT_SUPPORTED ||
        res[size_t(r)].message.find("shifted") == std::string::npos) {
      std::printf("  rank %d: %s: %s\n", r, attn_status_string(res[size_t(r)].create),
                  res[size_t(r)].message.c_str());
      ok = false;
    }
  std::printf("%s window ring is NOT_SUPPORTED on every rank\n", ok ? "ok  " : "FAIL");
  if (!ok) ++g_failures;
}

}  // namespace

int main() {
  skip_without_device();
  int devices = 0;
  GPU_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    std::printf("SKIP: ring attention over NCCL needs 2 GPUs, found %d\n", devices);
    return 77;
  }
  const int n = std::min(devices, 8);
  const char* seed_env = std::getenv("ATTN_TEST_SEED");
  g_seed = seed_env ? std::strtoull(seed_env, nullptr, 10)
                    : uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run), %d GPUs\n", g_seed,
              g_seed, n);

  std::vector<ncclComm_t> comms(static_cast<size_t>(n));
  std::vector<int> devs(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) devs[size_t(i)] = i;
  const ncclResult_t init = ncclCommInitAll(comms.data(), n, devs.data());
  if (init != ncclSuccess) {
    std::printf("ncclCommInitAll: %s\n", ncclGetErrorString(init));
    return 1;
  }

  const attn_ring_layout_t contig = ATTN_RING_LAYOUT_CONTIGUOUS, zigzag = ATTN_RING_LAYOUT_ZIGZAG;
  const Case cases[] = {
      {"bf16-zigzag-causal-gqa-d128", ATTN_DTYPE_BF16, ATTN_LAYOUT_BSHD, zigzag, 2, 8, 2, 128, 128,
       ATTN_MASK_CAUSAL},
      {"bf16-contiguous-causal-d64", ATTN_DTYPE_BF16, ATTN_LAYOUT_BSHD, contig, 1, 4, 1, 256, 64,
       ATTN_MASK_CAUSAL},
      {"fp16-contiguous-full-bhsd-d64", ATTN_DTYPE_FP16, ATTN_LAYOUT_BHSD, contig, 1, 4, 4, 192, 64,
       ATTN_MASK_NONE},
      {"bf16-zigzag-full-d96", ATTN_DTYPE_BF16, ATTN_LAYOUT_BSHD, zigzag, 1, 2, 2, 80, 96,
       ATTN_MASK_NONE},
      {"fp16-zigzag-causal-bhsd-d256", ATTN_DTYPE_FP16, ATTN_LAYOUT_BHSD, zigzag, 1, 2, 1, 64, 256,
       ATTN_MASK_CAUSAL},
  };
  for (const Case& c : cases) run_case(c, n, comms.data());
  test_not_supported(n, comms.data());

  for (ncclComm_t c : comms) ncclCommDestroy(c);
  std::printf("%s: %d failure(s), seed %" PRIu64 "\n", g_failures ? "FAILED" : "PASSED", g_failures,
              g_seed);
  return g_failures ? 1 : 0;
}
