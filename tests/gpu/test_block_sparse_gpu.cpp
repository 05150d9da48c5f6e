// Block-sparse plans on the CUDA backend against the fp64 reference
// (tests/common/reference.c: S and P materialised in double, with the block
// selection materialised as a pair mask on top of the plan's dense mask).
//
// Masks: random blocky selections (per block: none, every element, or
// random elements at a random density), given as a materialised matrix
// (attn_block_mask_add_dense); block sizes 32, 48, 64, 96, 128 and unequal
// ones, smaller than, equal to and not dividing the kernels' tiles; masks
// per KV head, shared by all heads, per sequence; causal, sliding window
// and causal-with-window plans; odd and unequal lengths; GQA; softcap; rows
// with no visible key; a few queries against 60-70K keys (lists of more
// than 256 KV tiles). The builders' patterns (causal window + 64 sinks;
// BigBird: window, global keys and queries, random blocks) at a medium
// size, their selection read back from the mask (attn_block_mask_get_blocks);
// the Sparse Transformer's strided pattern with its local window, and
// documents of random lengths packed per sequence (causal, lq < lk).
//
// Each case runs the forward, the backward with dQ by atomics and the
// deterministic backward (three times: bit-identical); those that set
// fwd_only, the forward alone. The dK/dV lists of
// the backward with atomics get cut into several work items where a few
// KV tiles are seen by most query tiles (BigBird's global keys), or, in
// the cases that set cut_item, everywhere (ATTN_CUDA_BSPARSE_ITEM); with a
// whole group (the cases that set ATTN_CUDA_BWD_GROUP_SPLIT=1, or
// group 1) the cut tiles then accumulate in slots of their own, which the
// plan's kernel name says ("-cut"), and the cases that expect it check
// that. The cases that set fwd_persist run the persistent forward
// (ATTN_CUDA_BSPARSE_FWD_PERSIST=1, "-bsparse-p" in the kernel name:
// resident blocks, each looping over the query tiles dealt to it), those
// that set bwd_persist the persistent dK/dV kernel likewise
// (ATTN_CUDA_BSPARSE_BWD_PERSIST=1, "+bwd-p"); those that set prefetch
// have the dK/dV kernel's blocks prefetch later blocks' K and V
// (ATTN_CUDA_BSPARSE_PREFETCH=1). Tolerance
// (FlashAttention's rule, as the other GPU tests): max |X - X_fp64| <=
// 2 * max |X_plain - X_fp64| + atol, X_plain from ref_lowp_* (every op
// rounded to the dtype, fp32 sums); for dQ and dK plus twice the error
// floor of O handed over in the dtype (ref_backward_o_rounding_floor). LSE
// within 2e-3. Rows that see no key: O = 0, LSE = -inf and dQ = 0 exactly;
// keys no row sees: dK = dV = 0 exactly. Outputs are poisoned (NaN) before
// every run, and every element must be written. attn_plan_describe must name
// the block-sparse kernels: on an sm_90 device the sm_90a (wgmma) forward
// at d = 64 and 128 without softcap (192x128 tiles at d = 64, which block
// sizes such as 128, 80 and 48x80 do not divide; 128x128 at d = 128; the
// warp-specialised one, "-bsparse-ws" with 128x128 tiles at both, unless
// ATTN_CUDA_FWD_SM90_WS=0, its own meson test), the
// sm_80 one otherwise and under ATTN_CUDA_FWD_SM90=0 (its own meson test);
// on an sm_90 device the sm_90a (wgmma) dK/dV kernel's block-sparse
// instantiation ("+bwd-wgmma-bs-") at d = 64 and 128 without softcap,
// except in the cases that ask for the sm_80 kernel's tuning hooks
// (persistent dK/dV kernel, prefetch) and under ATTN_CUDA_BWD_SM90_SPARSE=0
// (its own meson test), and the sm_80 dK/dV kernel everywhere else.
// (MoBA plans: test_moba_gpu.)
//
// The tuning hooks are parsed strictly: a malformed value of any of them
// fails plan creation with INVALID_ARGUMENT, a message naming the variable
// and the value, and *plan unchanged (hook_errors).
//
// Fresh random inputs every run (seed printed; ATTN_TEST_SEED=n repeats
// one). ATTN_GPU_TEST_FILTER=text runs only the cases whose name contains
// text. Exit 77 without a CUDA device.

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "sparse_common.hpp"

using namespace gpu_test;

namespace {

enum class Source { kRandom, kWindowSinks, kBigBird, kStrided, kDocuments };

struct Case : CaseShape {
  int64_t bq = 64, bk = 64;                // the block mask's block sizes
  int64_t mask_batch = 1, mask_heads = 1;  // 1, or batch / heads_kv
  Source src = Source::kRandom;
  double p_none = 0.3;        // chance that a block selects nothing
  bool empty_block0 = false;  // query block 0 of slot 0 selects nothing
  int cut_item = 0;           // > 0: ATTN_CUDA_BSPARSE_ITEM for the plans
  int group_split = 0;        // > 0: ATTN_CUDA_BWD_GROUP_SPLIT for the plans
  bool expect_cut = false;    // the backward with atomics must say "-cut"
  bool cut_either = false;    // the plan's own rule decides whether it cuts (not checked)
  bool fwd_persist = false;   // ATTN_CUDA_BSPARSE_FWD_PERSIST=1 for the plans
  bool prefetch = false;      // ATTN_CUDA_BSPARSE_PREFETCH=1 for the plans
  bool bwd_persist = false;   // ATTN_CUDA_BSPARSE_BWD_PERSIST=1 for the plans
  bool fwd_only = false;      // the backward neither run nor checked (sparse_common.hpp)
};
using Problem = CaseProblem<Case>;

uint64_t g_seed = 0;
bool g_sm90 = false;  // sm_90 device and ATTN_CUDA_FWD_SM90 != 0
bool g_ws = false;    // sm_90 device and not ATTN_CUDA_FWD_SM90_WS=0
// sm_90 device, and none of ATTN_CUDA_BWD_SM90_SPARSE=0, ATTN_CUDA_BWD_SM90=0
// and ATTN_CUDA_BWD_VARIANT (which keep the sm_80 dK/dV kernel).
bool g_sm90_bwd_sparse = false;

// The warp-specialised forward ("-bsparse-ws", 128-row tiles): sm_90a
// plans at d = 64 and 128 without softcap unless ATTN_CUDA_FWD_SM90_WS=0.
bool expects_ws(const Case& c) {
  return g_ws && (c.d == 64 || c.d == 128) && c.softcap == 0.0f && !c.fwd_persist;
}

// The forward kernel a case's plans must name, and its tile.
struct ExpectedForward {
  const char* prefix;
  int32_t tile_q, tile_kv;
};
ExpectedForward expected_forward(const Case& c) {
  // (The persistent block-sparse forward, a tuning hook, is an sm_80 kernel.)
  if (g_sm90 && (c.d == 64 || c.d == 128) && c.softcap == 0.0f && !c.fwd_persist)
    return {"cuda-sm90-wgmma-", c.d == 64 && !expects_ws(c) ? 192 : 128, 128};
  return {"cuda-fa2-", 128, 64};
}

// Whether a case's plans must run the sm_90a block-sparse dK/dV kernel.
bool expects_sm90_backward(const Case& c) {
  return g_sm90_bwd_sparse && (c.d == 64 || c.d == 128) && c.softcap == 0.0f &&
         !c.bwd_persist && !c.prefetch;
}

// The selection [mask_batch][mask_heads][lq][lk] of a random blocky mask.
std::vector<uint8_t> draw_selection(const Case& c, std::mt19937_64& rng) {
  const int64_t slots = c.mask_batch * c.mask_heads;
  const int64_t nqb = (c.lq + c.bq - 1) / c.bq, nkb = (c.lk + c.bk - 1) / c.bk;
  std::vector<uint8_t> sel(size_t(slots * c.lq * c.lk), 0);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t qb = 0; qb < nqb; ++qb)
      for (int64_t kb = 0; kb < nkb; ++kb) {
        if (u(rng) < c.p_none || (c.empty_block0 && s == 0 && qb == 0)) continue;
        const bool whole = u(rng) < 0.4;
        const double density = 0.15 + 0.7 * u(rng);
        for (int64_t i = qb * c.bq; i < std::min(c.lq, (qb + 1) * c.bq); ++i)
          for (int64_t j = kb * c.bk; j < std::min(c.lk, (kb + 1) * c.bk); ++j)
            if (whole || u(rng) < density) sel[size_t((s * c.lq + i) * c.lk + j)] = 1;
      }
  return sel;
}

// The selection a mask holds, read back from its canonical tables.
std::vector<uint8_t> read_selection(const Case& c, attn_block_mask_t mask) {
  const int64_t slots = c.mask_batch * c.mask_heads;
  const int64_t nqb = (c.lq + c.bq - 1) / c.bq, rows = slots * nqb;
  int32_t mp = 0, mf = 0;
  ATTN_CHECK(attn_block_mask_get_max_blocks(mask, &mp, &mf));
  mp = std::max(mp, 1), mf = std::max(mf, 1);
  const size_t tile_bytes = size_t(ATTN_BLOCK_MASK_TILE_BYTES(c.bq, c.bk));
  const size_t n_rows = size_t(rows);
  std::vector<int32_t> np(n_rows), nf(n_rows), ip(n_rows * size_t(mp)), jf(n_rows * size_t(mf));
  std::vector<uint8_t> bits(size_t(rows * mp) * tile_bytes);
  ATTN_CHECK(attn_block_mask_get_blocks(mask, np.data(), ip.data(), mp, bits.data(), nf.data(),
                                        jf.data(), mf));
  std::vector<uint8_t> sel(size_t(slots * c.lq * c.lk), 0);
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t s = k / nqb, qb = k % nqb;
    auto mark = [&](int64_t kb, const uint8_t* tile) {
      for (int64_t r = 0; r < c.bq; ++r)
        for (int64_t col = 0; col < c.bk; ++col) {
          const int64_t i = qb * c.bq + r, j = kb * c.bk + col, t = r * c.bk + col;
          if (i >= c.lq || j >= c.lk) continue;
          if (tile == nullptr || ((tile[t / 8] >> (t % 8)) & 1))
            sel[size_t((s * c.lq + i) * c.lk + j)] = 1;
        }
    };
    for (int32_t e = 0; e < nf[size_t(k)]; ++e) mark(jf[size_t(k * mf + e)], nullptr);
    for (int32_t e = 0; e < np[size_t(k)]; ++e)
      mark(ip[size_t(k * mp + e)], bits.data() + size_t(k * mp + e) * tile_bytes);
  }
  return sel;
}

// attn_block_mask_set_device_blocks: tables in device memory, written on a
// non-blocking stream just before the call, give the mask the same host
// tables give; host pointers are refused and leave the mask unchanged.
bool device_tables(attn_context_t ctx) {
  const int64_t heads = 2, lq = 300, lk = 260, bq = 64, bk = 32;
  attn_block_mask_t src = nullptr, dst = nullptr;
  ATTN_CHECK(attn_block_mask_create(1, heads, lq, lk, bq, bk, &src));
  ATTN_CHECK(attn_block_mask_add_window(src, 45, 3));  // partial blocks with bits
  ATTN_CHECK(attn_block_mask_add_random_blocks(src, 2, g_seed));
  int32_t mp = 0, mf = 0;
  ATTN_CHECK(attn_block_mask_get_max_blocks(src, &mp, &mf));
  mp = std::max(mp, 1), mf = std::max(mf, 1);
  const size_t rows = size_t(heads * ((lq + bq - 1) / bq));
  const size_t tile_bytes = size_t(ATTN_BLOCK_MASK_TILE_BYTES(bq, bk));
  struct Tables {
    std::vector<int32_t> np, ip, nf, jf;
    std::vector<uint8_t> bits;
  };
  auto read = [&](attn_block_mask_t m) {
    Tables t{std::vector<int32_t>(rows), std::vector<int32_t>(rows * size_t(mp)),
             std::vector<int32_t>(rows), std::vector<int32_t>(rows * size_t(mf)),
             std::vector<uint8_t>(rows * size_t(mp) * tile_bytes)};
    ATTN_CHECK(attn_block_mask_get_blocks(m, t.np.data(), t.ip.data(), mp, t.bits.data(),
                                          t.nf.data(), t.jf.data(), mf));
    return t;
  };
  const Tables host = read(src);
  cudaStream_t stream = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<void*> dev;
  auto upload = [&](const auto& v) {
    void* p = nullptr;
    const size_t bytes = v.size() * sizeof(v[0]);
    GPU_CHECK(cudaMalloc(&p, bytes));
    GPU_CHECK(cudaMemcpyAsync(p, v.data(), bytes, cudaMemcpyHostToDevice, stream));
    dev.push_back(p);
    return p;
  };
  auto* d_np = static_cast<const int32_t*>(upload(host.np));
  auto* d_ip = static_cast<const int32_t*>(upload(host.ip));
  auto* d_bits = static_cast<const uint8_t*>(upload(host.bits));
  auto* d_nf = static_cast<const int32_t*>(upload(host.nf));
  auto* d_jf = static_cast<const int32_t*>(upload(host.jf));
  ATTN_CHECK(attn_block_mask_create(1, heads, lq, lk, bq, bk, &dst));
  ATTN_CHECK(attn_block_mask_set_device_blocks(dst, ctx, stream, d_np, d_ip, mp, d_bits, d_nf,
                                               d_jf, mf));
  const Tables got = read(dst);
  bool ok = got.np == host.np && got.ip == host.ip && got.nf == host.nf && got.jf == host.jf &&
            got.bits == host.bits;
  // Host tables are not device memory: refused, naming the first table.
  ATTN_CHECK(attn_block_mask_set_blocks(dst, nullptr, nullptr, 0, nullptr, nullptr, nullptr, 0));
  const attn_status_t s = attn_block_mask_set_device_blocks(
      dst, ctx, stream, host.np.data(), host.ip.data(), mp, host.bits.data(), host.nf.data(),
      host.jf.data(), mf);
  const std::string msg = attn_last_error_message();
  int32_t after_p = -1, after_f = -1;
  ATTN_CHECK(attn_block_mask_get_max_blocks(dst, &after_p, &after_f));
  ok = ok && s == ATTN_STATUS_INVALID_ARGUMENT && msg.find("kv_num_blocks") == 0 &&
       msg.find("host memory") != std::string::npos && after_p == 0 && after_f == 0;
  std::printf("%s block mask from device tables (%zu rows, %d partial / %d full per row); host "
              "tables: %s: %s\n",
              ok ? "ok  " : "FAIL", rows, mp, mf, attn_status_string(s), msg.c_str());
  for (void* p : dev) GPU_CHECK(cudaFree(p));
  GPU_CHECK(cudaStreamDestroy(stream));
  attn_block_mask_destroy(src);
  attn_block_mask_destroy(dst);
  return ok;
}

// Sets an environment variable for its lifetime when `value` is not empty
// (else leaves it as it is), then restores what it was.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (value.empty()) return;
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value.c_str(), 1);
    set_ = true;
  }
  ~ScopedEnv() {
    if (!set_) return;
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false, set_ = false;
};

// The backend's tuning hooks (read at plan creation) take only what they
// document: each malformed value below fails attn_plan_create with
// INVALID_ARGUMENT, a message naming the variable and quoting the value,
// and *plan unchanged; the variable is restored after. A block-sparse GQA
// backward plan at d = 128 reads every hook. Returns the failures.
int hook_errors(attn_context_t ctx) {
  struct Bad {
    const char* name;
    const char* value;
  };
  const Bad bad[] = {
      {"ATTN_CUDA_BWD_SM90_SPARSE", "yes"},   {"ATTN_CUDA_BWD_SM90_SPARSE", "2"},
      {"ATTN_CUDA_BSPARSE_FWD_PERSIST", "on"}, {"ATTN_CUDA_BSPARSE_BWD_PERSIST", "1x"},
      {"ATTN_CUDA_BSPARSE_PREFETCH", "true"},  {"ATTN_CUDA_BSPARSE_ITEM", "0"},
      {"ATTN_CUDA_BSPARSE_ITEM", "four"},      {"ATTN_CUDA_BSPARSE_ITEM", " 4"},
      {"ATTN_CUDA_MOBA_GATHER", "no"},         {"ATTN_CUDA_FWD_SM90", "off"},
      {"ATTN_CUDA_FWD_SM90_BM", "160"},        {"ATTN_CUDA_BWD_SM90", "-1"},
      {"ATTN_CUDA_BWD_VARIANT", "1.5"},        {"ATTN_CUDA_BWD_GROUP_SPLIT", "0"},
      {"ATTN_CUDA_BWD_GROUP_SPLIT", "99999999999"}, {"ATTN_CUDA_MOBA_SM90", "yes"},
      {"ATTN_CUDA_MOBA_GATHER_SM90", "2"},     {"ATTN_CUDA_MOBA_GATHER_BWD_SM90", "y"},
      {"ATTN_CUDA_FWD_SM90_WS", "on"},         {"ATTN_CUDA_FWD_SM90_WS_ORDER", "2"},
      {"ATTN_CUDA_MOBA_GATHER_WS", "yes"},      {"ATTN_CUDA_FWD_SM90_WS_HEADS", "0"},
      {"ATTN_CUDA_BSPARSE_BWD_HEADS", "all"},
  };
  const int64_t heads_q = 4, heads_kv = 2, l = 200, d = 128;
  attn_block_mask_t mask = nullptr;
  ATTN_CHECK(attn_block_mask_create(1, heads_kv, l, l, 64, 64, &mask));
  ATTN_CHECK(attn_block_mask_add_window(mask, 70, 2));
  attn_plan_desc_t pd = nullptr;
  ATTN_CHECK(attn_plan_desc_create(&pd));
  ATTN_CHECK(attn_plan_desc_set_shape(pd, 1, heads_q, heads_kv, l, l, d, d));
  ATTN_CHECK(attn_plan_desc_set_dtype(pd, ATTN_DTYPE_BF16));
  ATTN_CHECK(attn_plan_desc_set_passes(pd, ATTN_PASSES_FORWARD_BACKWARD));
  ATTN_CHECK(attn_plan_desc_set_block_mask(pd, mask));
  int failures = 0;
  for (const Bad& b : bad) {
    attn_plan_t sentinel = reinterpret_cast<attn_plan_t>(&failures);  // must stay as is
    attn_plan_t plan = sentinel;
    attn_status_t st;
    std::string msg;
    {
      ScopedEnv env(b.name, b.value);
      st = attn_plan_create(ctx, pd, &plan);
      msg = attn_last_error_message();
    }
    const std::string quoted = std::string("\"") + b.value + "\"";
    const bool ok = st == ATTN_STATUS_INVALID_ARGUMENT && msg.find(b.name) != std::string::npos &&
                    msg.find(quoted) != std::string::npos && plan == sentinel;
    std::printf("%s %s=%s refused: %s: %s\n", ok ? "ok  " : "FAIL", b.name, b.value,
                attn_status_string(st), msg.c_str());
    if (!ok) ++failures;
    if (st == ATTN_STATUS_SUCCESS && plan != sentinel) attn_plan_destroy(plan);
  }
  // The same plan is created with the hooks as the run sets them (so the
  // refusals above came from the values), and with well-formed values.
  const Bad good[] = {{"ATTN_CUDA_BWD_SM90_SPARSE", "0"}, {"ATTN_CUDA_BSPARSE_ITEM", "3"},
                      {"ATTN_CUDA_BWD_GROUP_SPLIT", "99999"}, {"ATTN_CUDA_FWD_SM90_BM", "192"},
                      {"ATTN_CUDA_FWD_SM90_WS_ORDER", "1"}, {"ATTN_CUDA_FWD_SM90_WS_HEADS", "3"},
                      {"ATTN_CUDA_BSPARSE_BWD_HEADS", "1000"}, {"", ""}};
  for (const Bad& g : good) {
    attn_plan_t plan = nullptr;
    attn_status_t st;
    {
      ScopedEnv env(g.name[0] ? g.name : "ATTN_CUDA_BSPARSE_ITEM", g.value);
      st = attn_plan_create(ctx, pd, &plan);
    }
    const bool ok = st == ATTN_STATUS_SUCCESS && plan != nullptr;
    std::printf("%s plan with %s%s%s: %s\n", ok ? "ok  " : "FAIL", g.name[0] ? g.name : "no hook",
                g.name[0] ? "=" : "", g.value, ok ? "created" : attn_last_error_message());
    if (!ok) ++failures;
    if (plan != nullptr) attn_plan_destroy(plan);
  }
  attn_plan_desc_destroy(pd);
  attn_block_mask_destroy(mask);
  return failures;
}

// The block mask of a case and its selection as a matrix.
attn_block_mask_t make_mask(const Case& c, std::mt19937_64& rng, std::vector<uint8_t>& sel) {
  attn_block_mask_t mask = nullptr;
  ATTN_CHECK(attn_block_mask_create(c.mask_batch, c.mask_heads, c.lq, c.lk, c.bq, c.bk, &mask));
  switch (c.src) {
    case Source::kRandom:
      sel = draw_selection(c, rng);
      ATTN_CHECK(attn_block_mask_add_dense(mask, sel.data()));
      break;
    case Source::kWindowSinks: {
      std::vector<int64_t> sinks(64);
      for (int64_t i = 0; i < 64; ++i) sinks[size_t(i)] = i;
      ATTN_CHECK(attn_block_mask_add_window(mask, 511, 0));
      ATTN_CHECK(attn_block_mask_add_global_keys(mask, sinks.data(), 64));
      break;
    }
    case Source::kBigBird: {
      const int64_t globals[2] = {0, c.lk / 2 + 3};
      ATTN_CHECK(attn_block_mask_add_window(mask, c.bk, c.bk));
      ATTN_CHECK(attn_block_mask_add_global_keys(mask, globals, 2));
      ATTN_CHECK(attn_block_mask_add_global_queries(mask, globals, 1));
      ATTN_CHECK(attn_block_mask_add_random_blocks(mask, 3, rng()));
      break;
    }
    case Source::kStrided:
      // The Sparse Transformer's two heads in one mask: the local window
      // (stride - 1, 0) and the strided keys; a stride that no block size
      // divides, so that every visited tile is partial.
      ATTN_CHECK(attn_block_mask_add_window(mask, 70, 0));
      ATTN_CHECK(attn_block_mask_add_strided(mask, 71));
      break;
    case Source::kDocuments: {
      // Packed documents of random lengths (10..400 tokens; the query and
      // key sides share the boundaries, aligned at the end as the causal
      // diagonal), per sequence of the mask's batch; every block first.
      std::vector<int32_t> doc_q(size_t(c.mask_batch * c.lq)), doc_kv(size_t(c.mask_batch * c.lk));
      std::uniform_int_distribution<int64_t> len(10, 400);
      for (int64_t b = 0; b < c.mask_batch; ++b) {
        std::vector<int32_t> ids(size_t(c.lk));
        int32_t id = 0;
        for (int64_t j = 0; j < c.lk; ++id)
          for (int64_t n = len(rng); n > 0 && j < c.lk; --n, ++j) ids[size_t(j)] = id;
        for (int64_t j = 0; j < c.lk; ++j) doc_kv[size_t(b * c.lk + j)] = ids[size_t(j)];
        for (int64_t i = 0; i < c.lq; ++i)
          doc_q[size_t(b * c.lq + i)] = ids[size_t(i + c.lk - c.lq)];
      }
      ATTN_CHECK(attn_block_mask_add_window(mask, -1, -1));
      ATTN_CHECK(attn_block_mask_and_documents(mask, doc_q.data(), doc_kv.data()));
      break;
    }
  }
  if (c.src != Source::kRandom) sel = read_selection(c, mask);
  return mask;
}


// What phase one (the device) leaves for phase two, with the selection.
struct Run : SparseRun<Case> {
  std::vector<uint8_t> sel;
};

attn_plan_t build_plan(const Problem& p, attn_context_t ctx, attn_block_mask_t mask,
                       bool deterministic) {
  attn_plan_desc_t pd = case_plan_desc(p, ATTN_TENSOR_DV + 1);
  ATTN_CHECK(attn_plan_desc_set_passes(pd, ATTN_PASSES_FORWARD_BACKWARD));
  ATTN_CHECK(attn_plan_desc_set_deterministic(pd, deterministic ? 1 : 0));
  ATTN_CHECK(attn_plan_desc_set_allow_empty_rows(pd, 1));
  ATTN_CHECK(attn_plan_desc_set_block_mask(pd, mask));
  return plan_or_exit(ctx, pd, p.c.name);
}

// Phase one: the mask, inputs and every CUDA run of a case.
Run run_device(const Case& c0, attn_context_t ctx) {
  std::mt19937_64 rng(g_seed ^ std::hash<std::string>{}(c0.name));
  Run r;
  r.p = make_problem(c0);
  const Problem& p = r.p;
  const Case& c = p.c;
  attn_block_mask_t mask = make_mask(c, rng, r.sel);

  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto normal = [&](int64_t, int64_t, int64_t, int64_t) { return to_half(c.dtype, nd(rng)); };
  fill_inputs(r, normal, normal, normal, normal);

  // The tuning hooks are read at plan creation; the test's own environment
  // (e.g. ATTN_CUDA_BWD_GROUP_SPLIT of the fallback run) is restored after.
  attn_plan_t plans[2];
  {
    ScopedEnv item("ATTN_CUDA_BSPARSE_ITEM", c.cut_item > 0 ? std::to_string(c.cut_item) : "");
    ScopedEnv split("ATTN_CUDA_BWD_GROUP_SPLIT",
                    c.group_split > 0 ? std::to_string(c.group_split) : "");
    ScopedEnv persist("ATTN_CUDA_BSPARSE_FWD_PERSIST", c.fwd_persist ? "1" : "");
    ScopedEnv prefetch("ATTN_CUDA_BSPARSE_PREFETCH", c.prefetch ? "1" : "");
    ScopedEnv bwd_persist("ATTN_CUDA_BSPARSE_BWD_PERSIST", c.bwd_persist ? "1" : "");
    plans[0] = build_plan(p, ctx, mask, false);
    plans[1] = build_plan(p, ctx, mask, true);
  }
  ATTN_CHECK(attn_block_mask_destroy(mask));
  const ExpectedForward want = expected_forward(c);
  for (int det = 0; det < 2; ++det) {
    const attn_plan_info_t info = describe(plans[det]);
    if (std::strstr(info.kernel, "bsparse") == nullptr ||
        std::strncmp(info.kernel, want.prefix, std::strlen(want.prefix)) != 0 ||
        info.tile_q != want.tile_q || info.tile_kv != want.tile_kv)
      r.describe_error += std::string(" kernel '") + info.kernel + "' (tile " +
                          std::to_string(info.tile_q) + "x" + std::to_string(info.tile_kv) +
                          ") is not the block-sparse " + want.prefix + " one (" +
                          std::to_string(want.tile_q) + "x" + std::to_string(want.tile_kv) + ");";
    // The whole name fits attn_plan_info_t's 64 characters: the backward's
    // part comes last and is there.
    if (std::strlen(info.kernel) + 1 >= sizeof info.kernel || std::strstr(info.kernel, "+bwd-") == nullptr)
      r.describe_error += std::string(" kernel name '") + info.kernel + "' truncated or without +bwd-;";
    if (info.visited_tile_pairs > info.total_tile_pairs || info.block_q != c.bq ||
        info.block_kv != c.bk)
      r.describe_error += " visited/total tile pairs or block sizes wrong;";
    // Deterministic plans never cut their lists.
    const bool cut = std::strstr(info.kernel, "-cut") != nullptr;
    if (cut != (c.expect_cut && det == 0) && !(c.cut_either && det == 0))
      r.describe_error += std::string(" kernel '") + info.kernel + "': expected " +
                          (c.expect_cut && det == 0 ? "" : "no ") + "cut lists;";
    if ((std::strstr(info.kernel, "-bsparse-p-") != nullptr) != c.fwd_persist)
      r.describe_error += std::string(" kernel '") + info.kernel + "': expected the " +
                          (c.fwd_persist ? "persistent" : "one-block-per-tile") + " forward;";
    if ((std::strstr(info.kernel, "-bsparse-ws") != nullptr) != expects_ws(c))
      r.describe_error += std::string(" kernel '") + info.kernel + "': expected the " +
                          (expects_ws(c) ? "warp-specialised" : "one-tile") + " forward;";
    if ((std::strstr(info.kernel, "+bwd-p-") != nullptr) != c.bwd_persist)
      r.describe_error += std::string(" kernel '") + info.kernel + "': expected the " +
                          (c.bwd_persist ? "persistent" : "one-block-per-item") + " dK/dV kernel;";
    const bool sm90_bwd = expects_sm90_backward(c);
    if ((std::strstr(info.kernel, "+bwd-wgmma-bs-") != nullptr) != sm90_bwd)
      r.describe_error += std::string(" kernel '") + info.kernel + "': expected the " +
                          (sm90_bwd ? "sm_90a" : "sm_80") + " block-sparse dK/dV kernel;";
  }

  run_passes(r, plans);
  attn_plan_destroy(plans[0]);
  attn_plan_destroy(plans[1]);
  return r;
}

// Phase two: the reference and the verdict of one case.
Outcome judge(const Run& r) {
  const Problem& p = r.p;
  const Case& c = p.c;
  ref_problem rp = base_ref_problem(p);
  rp.window_left = c.mask == ATTN_MASK_WINDOW ? c.wl : -1;
  rp.window_right = c.mask == ATTN_MASK_WINDOW ? c.wr : c.mask == ATTN_MASK_CAUSAL ? 0 : -1;
  rp.pair_mask = r.sel.data();
  rp.pair_mask_batch = c.mask_batch;
  // The reference's rule: 1, heads_q (per query head) or else per KV head.
  rp.pair_mask_heads = c.mask_heads;
  // Varlen: the mask is the longest sequence's; each sequence its corner.
  rp.pair_mask_rows = c.lq, rp.pair_mask_cols = c.lk;
  return judge_run(r, rp, inputs64(r), "");
}

Case make(const std::string& name, attn_dtype_t dt, int64_t d, int64_t batch, int64_t hq,
          int64_t hkv, int64_t lq, int64_t lk, attn_mask_t mask, int64_t bq, int64_t bk) {
  Case c;
  c.name = name, c.dtype = dt, c.d = d, c.batch = batch, c.hq = hq, c.hkv = hkv, c.lq = lq,
  c.lk = lk, c.mask = mask, c.bq = bq, c.bk = bk;
  return c;
}

std::vector<Case> cases() {
  constexpr attn_dtype_t BF = ATTN_DTYPE_BF16, FP = ATTN_DTYPE_FP16;
  constexpr attn_mask_t NONE = ATTN_MASK_NONE, CAUSAL = ATTN_MASK_CAUSAL, WIN = ATTN_MASK_WINDOW;
  std::vector<Case> v;
  Case c = make("d128-bf16-b64-causal-gqa4/2-per-head", BF, 128, 1, 4, 2, 300, 300, CAUSAL, 64, 64);
  c.mask_heads = 2;
  v.push_back(c);
  c = make("d128-fp16-b128-window(100,20)-per-batch", FP, 128, 2, 2, 2, 333, 333, WIN, 128, 128);
  c.wl = 100, c.wr = 20, c.mask_batch = 2;
  v.push_back(c);
  c = make("d128-bf16-b96-causal+window(150,0)-lq<lk", BF, 128, 1, 2, 2, 250, 389, WIN, 96, 96);
  c.wl = 150, c.wr = 0, c.mask_heads = 2;
  v.push_back(c);
  c = make("d128-fp16-b48-none-lq>lk-gqa4/1-shared", FP, 128, 1, 4, 1, 261, 200, NONE, 48, 48);
  v.push_back(c);
  c = make("d128-bf16-b128x64-causal-lq<lk", BF, 128, 2, 2, 1, 150, 350, CAUSAL, 128, 64);
  c.mask_batch = 2;
  v.push_back(c);
  c = make("d128-bf16-b32-none-empty-rows", BF, 128, 1, 2, 2, 257, 257, NONE, 32, 32);
  c.p_none = 0.6, c.empty_block0 = true, c.mask_heads = 2;
  v.push_back(c);
  // Query tile 0 of the forward (128 rows) without any key: the persistent
  // forward's empty-list path.
  c = make("d128-bf16-b128-none-empty-tile-persistent", BF, 128, 1, 2, 2, 300, 300, NONE, 128,
           128);
  c.p_none = 0.6, c.empty_block0 = true, c.mask_heads = 2;
  c.fwd_persist = true, c.bwd_persist = true;
  v.push_back(c);
  c = make("d128-bf16-b64-softcap30", BF, 128, 1, 2, 1, 190, 190, NONE, 64, 64);
  c.softcap = 30.0f;
  v.push_back(c);
  c = make("d64-bf16-b48x80-causal-gqa2/1", BF, 64, 1, 2, 1, 277, 277, CAUSAL, 48, 80);
  v.push_back(c);
  c = make("d64-fp16-b128-window(64,64)", FP, 64, 1, 2, 2, 300, 300, WIN, 128, 128);
  c.wl = 64, c.wr = 64, c.mask_heads = 2;
  v.push_back(c);
  // d = 64 over several of the sm_90a kernel's 192-row tiles, with block
  // sizes that do not divide them (80, 100) and ones that do (32).
  c = make("d64-bf16-b80-causal-lq<lk-per-head-gqa2/1", BF, 64, 1, 4, 2, 700, 900, CAUSAL, 80, 80);
  c.mask_heads = 2;
  v.push_back(c);
  c = make("d64-fp16-b32-none-empty-rows-per-batch", FP, 64, 2, 2, 2, 450, 420, NONE, 32, 32);
  c.p_none = 0.6, c.empty_block0 = true, c.mask_batch = 2;
  v.push_back(c);
  // Varlen batches: the mask is given for the longest sequence and each
  // sequence runs its corner of it (a plan per sequence): one mask for all,
  // and one per sequence, with an empty sequence and lq > lk.
  c = make("varlen-d128-bf16-b64-causal-shared-mask", BF, 128, 0, 2, 2, 0, 0, CAUSAL, 64, 64);
  c.seq_q = {300, 0, 77, 129}, c.seq_kv = {300, 50, 100, 60};
  c.allow_empty = true;
  v.push_back(c);
  c = make("varlen-d64-fp16-b48-none-per-sequence-mask", FP, 64, 0, 4, 2, 0, 0, NONE, 48, 48);
  c.seq_q = {200, 33, 150}, c.seq_kv = {180, 90, 150};
  c.mask_batch = 3, c.mask_heads = 2;
  v.push_back(c);
  c = make("d64-bf16-b128-causal-window512+64sinks", BF, 64, 1, 2, 1, 2000, 2000, CAUSAL, 128, 128);
  c.src = Source::kWindowSinks;
  v.push_back(c);
  c = make("d64-fp16-b100-bigbird-causal", FP, 64, 1, 2, 2, 1500, 1500, CAUSAL, 100, 100);
  c.src = Source::kBigBird;
  c.cut_either = true;  // global key tiles: cut or not by the SM count's measure
  v.push_back(c);
  c.cut_either = false;
  // Query tiles of the sm_90a forward (192 rows at d = 64, 128 at d = 128)
  // that visit nothing; a window plan over a batch sharing one mask.
  c = make("d64-bf16-b192x64-none-empty-tile0-gqa2/1", BF, 64, 1, 2, 1, 500, 460, NONE, 192, 64);
  c.p_none = 0.5, c.empty_block0 = true;
  v.push_back(c);
  c = make("d128-fp16-b128-causal-empty-tile0-per-head", FP, 128, 1, 2, 2, 400, 400, CAUSAL, 128, 128);
  c.p_none = 0.4, c.empty_block0 = true, c.mask_heads = 2;
  v.push_back(c);
  c = make("d64-bf16-b96-window(200,30)-batch2-shared-gqa2/1", BF, 64, 2, 4, 2, 650, 650, WIN, 96, 96);
  c.wl = 200, c.wr = 30;
  v.push_back(c);
  // Masks per sequence and per KV head at once (slot = b * heads_kv + hk).
  c = make("d128-fp16-b64x128-causal-per-batch-per-head-gqa2", FP, 128, 2, 4, 2, 420, 420, CAUSAL, 64, 128);
  c.mask_batch = 2, c.mask_heads = 2;
  v.push_back(c);
  // Few queries, many keys: query tiles that visit more than 256 KV tiles
  // (the sm_90a forward's ring of visits is refilled, twice or more).
  c = make("d128-bf16-b64x96-none-long-lists-lk70000", BF, 128, 1, 2, 1, 100, 70000, NONE, 64, 96);
  c.p_none = 0.1;
  v.push_back(c);
  c = make("d64-fp16-b128-causal-long-lists-lk60000", FP, 64, 1, 2, 2, 150, 60000, CAUSAL, 128, 128);
  c.p_none = 0.1, c.mask_heads = 2;
  v.push_back(c);
  // One query tile against 282 KV tiles: one ring refill, small enough for
  // compute-sanitizer's racecheck (ATTN_GPU_TEST_FILTER=ring-refill).
  c = make("d128-bf16-b128-none-ring-refill", BF, 128, 1, 1, 1, 64, 36000, NONE, 128, 128);
  c.p_none = 0.02;
  v.push_back(c);
  c = make("d64-fp16-b64-causal-ring-refill", FP, 64, 1, 1, 1, 100, 36000, CAUSAL, 64, 64);
  c.p_none = 0.02;
  v.push_back(c);
  c = make("d96-fp16-b96-causal", FP, 96, 1, 2, 2, 290, 290, CAUSAL, 96, 96);
  c.mask_heads = 2;
  v.push_back(c);
  c = make("d96-bf16-b64-window(90,30)-gqa4/2-persistent", BF, 96, 2, 4, 2, 400, 400, WIN, 64,
           64);
  c.wl = 90, c.wr = 30, c.mask_batch = 2, c.fwd_persist = true, c.bwd_persist = true;
  v.push_back(c);
  c = make("d256-bf16-b64-causal-gqa2/1", BF, 256, 1, 2, 1, 200, 200, CAUSAL, 64, 64);
  v.push_back(c);
  c = make("d256-fp16-b32x48-none", FP, 256, 1, 1, 1, 150, 170, NONE, 32, 48);
  v.push_back(c);
  // The builders' patterns at a medium size.
  c = make("d128-bf16-b128-causal-window512+64sinks", BF, 128, 1, 2, 1, 2000, 2000, CAUSAL, 128, 128);
  c.src = Source::kWindowSinks;
  v.push_back(c);
  c = make("d128-bf16-b64-bigbird", BF, 128, 1, 2, 1, 1800, 1800, NONE, 64, 64);
  c.src = Source::kBigBird;
  v.push_back(c);
  c = make("d128-bf16-b64-causal-strided71+local70-gqa2/1", BF, 128, 1, 2, 1, 1000, 1000, CAUSAL,
           64, 64);
  c.src = Source::kStrided;
  v.push_back(c);
  c = make("d64-fp16-b128-causal-documents-lq<lk-per-batch", FP, 64, 2, 2, 2, 900, 1100, CAUSAL,
           128, 128);
  c.src = Source::kDocuments, c.mask_batch = 2;
  v.push_back(c);
  c = make("d128-fp16-b96-bigbird-causal", FP, 128, 1, 2, 2, 1500, 1500, CAUSAL, 96, 96);
  c.src = Source::kBigBird;
  c.expect_cut = true;  // the global key tiles' lists (24 query tiles)
  v.push_back(c);
  c.name = "d128-fp16-b96-bigbird-causal-persistent-prefetch";
  c.fwd_persist = true, c.prefetch = true, c.bwd_persist = true;
  v.push_back(c);
  // Cut lists with whole groups: the cut tiles' own accumulators, per
  // (sequence, KV head) of a mask shared by the batch, with GQA.
  c = make("d128-bf16-b128-bigbird-gqa4/2-whole-group-batch2", BF, 128, 2, 4, 2, 1100, 1100,
           NONE, 128, 128);
  c.src = Source::kBigBird, c.mask_heads = 2, c.group_split = 1, c.expect_cut = true;
  c.padded = true, c.fwd_persist = true, c.prefetch = true, c.bwd_persist = true;
  v.push_back(c);
  // Every list cut into items of 3 visits: masks per sequence and KV head
  // cut different numbers of tiles (empty accumulator slots).
  c = make("d64-bf16-b64-causal-cut3-per-batch", BF, 64, 2, 2, 2, 700, 700, CAUSAL, 64, 64);
  c.mask_batch = 2, c.mask_heads = 2, c.cut_item = 3, c.expect_cut = true, c.fwd_persist = true;
  c.prefetch = true;
  v.push_back(c);
  c = make("d256-fp16-b64-none-cut2-lq<lk", FP, 256, 1, 2, 1, 300, 333, NONE, 64, 64);
  c.cut_item = 2, c.group_split = 1, c.expect_cut = true, c.fwd_persist = true;
  c.bwd_persist = true;
  v.push_back(c);
  // Cut lists in a split group: every tile in the whole accumulators.
  c = make("d128-bf16-b64-cut2-gqa4/1-split2", BF, 128, 1, 4, 1, 500, 500, CAUSAL, 64, 64);
  c.cut_item = 2, c.group_split = 2;
  v.push_back(c);
  c.name = "d128-bf16-b64-cut2-gqa4/1-split2-persistent-bwd";
  c.bwd_persist = true;
  v.push_back(c);
  // Several query tiles per SM for the warp-specialised forward's blocks
  // (about 3 work items each on 132 SMs: both Q buffers reused, lists of
  // different lengths, some empty, dealt in snake rounds); forward only
  // (the backward's kernels are those of the cases above, and its fp64
  // reference here took minutes).
  c = make("d128-bf16-b128-causal-many-items-gqa4", BF, 128, 2, 16, 4, 1536, 1536, CAUSAL, 128,
           128);
  c.mask_heads = 4, c.fwd_only = true;
  v.push_back(c);
  c = make("d64-fp16-b64-none-many-items-gqa4", FP, 64, 2, 16, 4, 1500, 1500, NONE, 64, 64);
  c.p_none = 0.5, c.fwd_only = true;
  v.push_back(c);
  // The same at d = 128 (2 KV stages): blocks whose items alternate
  // between lists with and without KV tiles (the producer's copy orders
  // must not wait on a tile an empty item never asks for).
  c = make("d128-bf16-b128-none-many-items-empty-gqa4", BF, 128, 2, 16, 4, 1536, 1536, NONE, 128,
           128);
  c.p_none = 0.6, c.empty_block0 = true, c.mask_heads = 4, c.fwd_only = true;
  v.push_back(c);
  // BigBird with about two items per block, small enough for
  // compute-sanitizer's racecheck (ATTN_GPU_TEST_FILTER=bigbird-race).
  c = make("d128-bf16-b128-bigbird-race-gqa4", BF, 128, 2, 8, 2, 2304, 2304, CAUSAL, 128, 128);
  c.src = Source::kBigBird, c.mask_heads = 2, c.fwd_only = true;
  v.push_back(c);
  return v;
}

}  // namespace

int main() {
  skip_without_device();
  g_seed = test_seed();
  cudaDeviceProp prop{};
  GPU_CHECK(cudaGetDeviceProperties(&prop, 0));
  const char* sm90_env = std::getenv("ATTN_CUDA_FWD_SM90");
  g_sm90 = prop.major == 9 && prop.minor == 0 && !(sm90_env && std::strcmp(sm90_env, "0") == 0);
  const char* ws_env = std::getenv("ATTN_CUDA_FWD_SM90_WS");
  g_ws = g_sm90 && !(ws_env != nullptr && std::strcmp(ws_env, "0") == 0);
  std::printf("device sm_%d%d: d = 64/128 forwards expected on the %s kernel\n", prop.major,
              prop.minor, g_ws ? "sm_90a warp-specialised" : g_sm90 ? "sm_90a (wgmma)" : "sm_80");
  const char* bwd_sparse_env = std::getenv("ATTN_CUDA_BWD_SM90_SPARSE");
  const char* bwd_sm90_env = std::getenv("ATTN_CUDA_BWD_SM90");
  g_sm90_bwd_sparse = prop.major == 9 && prop.minor == 0 &&
                      !(bwd_sparse_env && std::strcmp(bwd_sparse_env, "0") == 0) &&
                      !(bwd_sm90_env && std::strcmp(bwd_sm90_env, "0") == 0) &&
                      !(std::getenv("ATTN_CUDA_BWD_VARIANT") &&  // empty: unset (core/env.hpp)
                        std::getenv("ATTN_CUDA_BWD_VARIANT")[0] != '\0');
  std::printf("d = 64/128 dK/dV expected on the %s block-sparse kernel\n",
              g_sm90_bwd_sparse ? "sm_90a (wgmma)" : "sm_80");

  attn_context_t ctx = nullptr;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  int failures = device_tables(ctx) ? 0 : 1;
  failures += hook_errors(ctx);

  failures += run_and_judge(
      filtered(cases()), [&](const Case& c) { return run_device(c, ctx); }, judge,
      [](const Case& c) { return c.hq * c.lq * c.lk * c.d; });
  attn_context_destroy(ctx);
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
