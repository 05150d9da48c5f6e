// CUDA forward vs an fp64 reference (S and P materialised in double) and vs
// the CPU backend, over masks, GQA, unequal and varlen lengths, softcap,
// dtypes, layouts with non-default strides and every supported head dim.
//
// Tolerance (FlashAttention's rule): max |O - O_fp64| <= 2 * max |O_plain -
// O_fp64| + atol, where O_plain is a straightforward implementation in the
// same precision (S and P rounded to the dtype, fp32 sums). LSE is compared
// with an absolute bound. Rows that see no key must give exactly O = 0 and
// LSE = -inf. Inputs are fresh random values every run (seed printed;
// ATTN_TEST_SEED=n repeats one); outputs, LSE and tensor padding are
// poisoned with NaN patterns, so unwritten outputs, writes outside the
// tensor and reads of padding all fail.
//
// Also: CUDA graph capture and replay give the same bits as a direct run,
// attn_plan_describe names the kernel and its tile, and unsupported requests
// fail at plan creation with NOT_SUPPORTED.
// Kernel choice: on an sm_90 device, dense plans at d = 64 and 128 (softcap
// included) must run the sm_90a (wgmma) forward, unless ATTN_CUDA_FWD_SM90=0,
// under which every plan must run the sm_80 one; each case checks the name
// attn_plan_describe gives (the build must include sm_90a, as
// scripts/gpu-check.sh's does). Under ATTN_CUDA_FWD_SM90_BM=128 or 192 the
// d = 64 cases must also name that query tile (softcap ones: 128, the only
// one built with it), and tile_q must match. Fixed-length plans without
// softcap must run the warp-specialised one ("-ws", 128-row tiles) unless
// ATTN_CUDA_FWD_SM90_WS=0 (or, at d = 64, ATTN_CUDA_FWD_SM90_BM) asks for
// the one-tile kernel.
// ATTN_GPU_TEST_QUICK=1 runs only small cases (for compute-sanitizer);
// ATTN_GPU_TEST_FILTER=text only the cases whose name contains text;
// ATTN_GPU_TEST_HEAD_DIM=n only the cases of head dim n.
// Exit 77 without a CUDA device.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <cinttypes>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_common.hpp"

using namespace gpu_test;

namespace {

uint64_t g_seed = 0;
bool g_quick = false;
const char* g_filter = nullptr;
int g_failures = 0;
int64_t g_head_dim = 0;  // ATTN_GPU_TEST_HEAD_DIM, 0: every head dim
bool g_sm90 = false;  // sm_90 device and ATTN_CUDA_FWD_SM90 != 0
int g_sm90_bm = 0;    // ATTN_CUDA_FWD_SM90_BM when 128 or 192, else 0
bool g_ws = false;    // sm_90 device and not ATTN_CUDA_FWD_SM90_WS=0

// The forward kernel a plan of case c must run.
bool expects_sm90(const CaseShape& c) { return g_sm90 && (c.d == 64 || c.d == 128); }
// The warp-specialised one ("-ws", 128-row tiles): fixed-length plans
// without softcap whose tensors a tensor map can describe (no empty side).
// (ATTN_CUDA_FWD_SM90_BM, forcing a d = 64 tile, keeps the one-tile kernel.)
bool expects_ws(const CaseShape& c) {
  return g_ws && expects_sm90(c) && c.softcap == 0.0f && !varlen(c) && c.lq > 0 && c.lk > 0 &&
         !(c.d == 64 && g_sm90_bm != 0);
}

// The query tile the sm_90a forward must take for case c; 0: 128 or 192
// (the plan's own estimate decides).
int expected_sm90_rows(const CaseShape& c) {
  if (c.d == 128 || expects_ws(c)) return 128;
  return c.softcap > 0.0f ? 128 : g_sm90_bm;
}

struct Case : CaseShape {
  bool vs_cpu = false;  // also compare every row with the CPU backend
  bool with_lse = true;
};
using Problem = CaseProblem<Case>;

// With `status`, a failed plan creation is reported there (null plan).
attn_plan_t build_plan(const Problem& p, attn_context_t ctx, attn_status_t* status = nullptr) {
  return plan_or_exit(ctx, case_plan_desc(p, ATTN_TENSOR_O + 1), p.c.name, status);
}

// Inputs: padding holds the poison pattern, so reading it shows up as NaN.
struct HostData {
  std::vector<uint16_t> q, k, v;
  std::vector<float> qf, kf, vf;  // the same values as floats, dense [row][d]
};

void fill_inputs(const Problem& p, std::mt19937_64& rng, HostData& h) {
  const Case& c = p.c;
  const uint16_t poison = poison_half(c.dtype);
  h.q.assign(p.tq.elems, poison);
  h.k.assign(p.tk.elems, poison);
  h.v.assign(p.tk.elems, poison);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t s = 0; s < p.lq(b); ++s)
      for (int64_t hh = 0; hh < c.hq; ++hh)
        for (int64_t x = 0; x < c.d; ++x) h.q[size_t(p.off_q(b, s, hh) + x)] = to_half(c.dtype, c.qmul * nd(rng));
    for (int64_t s = 0; s < p.lk(b); ++s)
      for (int64_t hh = 0; hh < c.hkv; ++hh)
        for (int64_t x = 0; x < c.d; ++x) {
          h.k[size_t(p.off_k(b, s, hh) + x)] = to_half(c.dtype, nd(rng));
          h.v[size_t(p.off_k(b, s, hh) + x)] = to_half(c.dtype, nd(rng));
        }
  }
}

float load(const Problem& p, const std::vector<uint16_t>& buf, int64_t off) {
  return from_half(p.c.dtype, buf[size_t(off)]);
}

// Reference for one row: fp64 and the plain same-precision version.
struct RowRef {
  std::vector<double> o64;
  std::vector<float> oplain;
  double lse64 = 0;
  float lseplain = 0;
  bool empty = false;
};

void ref_row(const Problem& p, const HostData& h, int64_t b, int64_t hh, int64_t i, RowRef& r) {
  const Case& c = p.c;
  const int64_t d = c.d, hk = hh / (c.hq / c.hkv);
  int64_t lo, hi;
  p.bounds(b, i, lo, hi);
  r.o64.assign(size_t(d), 0.0);
  r.oplain.assign(size_t(d), 0.0f);
  r.empty = lo > hi;
  if (r.empty) {
    r.lse64 = -INFINITY;
    r.lseplain = -INFINITY;
    return;
  }
  const int64_t n = hi - lo + 1;
  std::vector<float> qrow(static_cast<size_t>(d));
  for (int64_t x = 0; x < d; ++x) qrow[size_t(x)] = load(p, h.q, p.off_q(b, i, hh) + x);
  std::vector<double> z64(static_cast<size_t>(n));
  std::vector<float> z32(static_cast<size_t>(n));
  const double cap = c.softcap;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t ko = p.off_k(b, lo + j, hk);
    double s64 = 0;
    float s32 = 0;
    for (int64_t x = 0; x < d; ++x) {
      const float kv = load(p, h.k, ko + x);
      s64 += double(qrow[size_t(x)]) * double(kv);
      s32 += qrow[size_t(x)] * kv;
    }
    double zz = double(p.scale) * s64;
    float zl = round_half(c.dtype, p.scale * s32);
    if (cap > 0) {
      zz = cap * std::tanh(zz / cap);
      zl = round_half(c.dtype, float(cap) * std::tanh(zl / float(cap)));
    }
    z64[size_t(j)] = zz;
    z32[size_t(j)] = zl;
  }
  const double m64 = *std::max_element(z64.begin(), z64.end());
  const float m32 = *std::max_element(z32.begin(), z32.end());
  double l64 = 0;
  float l32 = 0;
  for (int64_t j = 0; j < n; ++j) {
    z64[size_t(j)] = std::exp(z64[size_t(j)] - m64);
    l64 += z64[size_t(j)];
    z32[size_t(j)] = std::exp(z32[size_t(j)] - m32);
    l32 += z32[size_t(j)];
  }
  std::vector<float> acc(size_t(d), 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t vo = p.off_k(b, lo + j, hk);
    const double w64 = z64[size_t(j)] / l64;
    const float w32 = round_half(c.dtype, z32[size_t(j)] / l32);
    for (int64_t x = 0; x < d; ++x) {
      const float vv = load(p, h.v, vo + x);
      r.o64[size_t(x)] += w64 * double(vv);
      acc[size_t(x)] += w32 * vv;
    }
  }
  for (int64_t x = 0; x < d; ++x) r.oplain[size_t(x)] = round_half(c.dtype, acc[size_t(x)]);
  r.lse64 = m64 + std::log(l64);
  r.lseplain = m32 + std::log(l32);
}

struct Stats {
  double err = 0, err_plain = 0, lse_err = 0, lse_err_plain = 0;
  int64_t bad_empty = 0, bad_value = 0, rows = 0, empty_rows = 0;
  void merge(const Stats& o) {
    err = std::max(err, o.err), err_plain = std::max(err_plain, o.err_plain);
    lse_err = std::max(lse_err, o.lse_err), lse_err_plain = std::max(lse_err_plain, o.lse_err_plain);
    bad_empty += o.bad_empty, bad_value += o.bad_value, rows += o.rows, empty_rows += o.empty_rows;
  }
};

template <class F>
void parallel_for(size_t n, F&& f) {
  const unsigned nt = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 32u));
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < nt; ++t)
    pool.emplace_back([&, t] {
      for (size_t i; (i = next.fetch_add(1)) < n;) f(t, i);
    });
  for (auto& th : pool) th.join();
}

double atol_for(attn_dtype_t t) {
  // Twice the rounding error of a value near 0.3, as FlashAttention's tests.
  return t == ATTN_DTYPE_BF16 ? 2.0 * std::ldexp(1.0, -10) : 2.0 * std::ldexp(1.0, -13);
}

// The spacing of the 16-bit dtype at |x|: two outputs rounded from nearby
// fp32 values may differ by one such step whatever the fp32 values' gap.
double spacing_at(attn_dtype_t t, double x) {
  int e = 0;
  std::frexp(std::fabs(x), &e);  // |x| = f 2^e, f in [0.5, 1)
  const int mant = t == ATTN_DTYPE_BF16 ? 7 : 10, emin = t == ATTN_DTYPE_BF16 ? -126 : -14;
  return std::ldexp(1.0, std::max(e - 1, emin) - mant);
}

struct Row {
  int64_t b, h, i;
};

std::vector<Row> pick_rows(const Problem& p, std::mt19937_64& rng) {
  std::vector<Row> rows;
  for (int64_t b = 0; b < p.c.batch; ++b)
    for (int64_t h = 0; h < p.c.hq; ++h) {
      const int64_t lq = p.lq(b);
      if (p.c.sample == 0 || lq <= p.c.sample) {
        for (int64_t i = 0; i < lq; ++i) rows.push_back({b, h, i});
        continue;
      }
      // both ends (mask boundaries) plus random rows
      for (int64_t i = 0; i < 4; ++i) rows.push_back({b, h, i}), rows.push_back({b, h, lq - 1 - i});
      std::uniform_int_distribution<int64_t> u(0, lq - 1);
      for (int k = 8; k < p.c.sample; ++k) rows.push_back({b, h, u(rng)});
    }
  return rows;
}

struct DeviceBuffers {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *ws = nullptr;
  float* lse = nullptr;
  ~DeviceBuffers() {
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(lse), cudaFree(ws);
  }
};

const uint32_t kLsePoison = 0x7fc0beefu;

void run_case(const Case& c0, attn_context_t cuda_ctx, attn_context_t cpu_ctx) {
  if (g_quick && c0.big) return;
  if (g_filter != nullptr && c0.name.find(g_filter) == std::string::npos) return;
  if (g_head_dim != 0 && c0.d != g_head_dim) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::mt19937_64 rng(g_seed ^ std::hash<std::string>{}(c0.name));
  const Problem p = make_problem(c0);
  const Case& c = p.c;
  HostData h;
  fill_inputs(p, rng, h);

  attn_plan_t plan = build_plan(p, cuda_ctx);
  const char* want_kernel = expects_sm90(c) ? "cuda-sm90-wgmma-" : "cuda-fa2-sm80-";
  const attn_plan_info_t info = describe(plan);
  if (std::strstr(info.kernel, want_kernel) != info.kernel) {
    std::printf("FAIL %s: runs %s, expected %s...\n", c.name.c_str(), info.kernel, want_kernel);
    ++g_failures;
  }
  if (expects_sm90(c)) {
    // Unforced d = 64: either tile, as long as name and tile_q agree.
    const int bm = expected_sm90_rows(c) != 0 ? expected_sm90_rows(c)
                   : info.tile_q == 128       ? 128
                                              : 192;
    const std::string tile = "-d" + std::to_string(c.d) + "-" + std::to_string(bm) + "x128-";
    if (std::strstr(info.kernel, tile.c_str()) == nullptr || info.tile_q != bm) {
      std::printf("FAIL %s: runs %s (tile_q %d), expected the %s tile\n", c.name.c_str(),
                  info.kernel, int(info.tile_q), tile.c_str());
      ++g_failures;
    }
    if ((std::strstr(info.kernel, "-ws") != nullptr) != expects_ws(c)) {
      std::printf("FAIL %s: runs %s, expected the %s forward\n", c.name.c_str(), info.kernel,
                  expects_ws(c) ? "warp-specialised" : "one-tile");
      ++g_failures;
    }
  }
  size_t ws = 1;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws));
  if (ws != 0) {
    std::printf("FAIL %s: forward workspace %zu, expected 0\n", c.name.c_str(), ws);
    ++g_failures;
  }

  DeviceBuffers dev;
  const size_t bytes_q = p.tq.elems * 2, bytes_k = p.tk.elems * 2;
  const size_t lse_n = size_t(std::max<int64_t>(p.lse_elems(), 1));
  GPU_CHECK(cudaMalloc(&dev.q, bytes_q));
  GPU_CHECK(cudaMalloc(&dev.k, bytes_k));
  GPU_CHECK(cudaMalloc(&dev.v, bytes_k));
  GPU_CHECK(cudaMalloc(&dev.o, bytes_q));
  GPU_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev.lse), lse_n * 4));
  if (ws > 0) GPU_CHECK(cudaMalloc(&dev.ws, ws));
  GPU_CHECK(cudaMemcpy(dev.q, h.q.data(), bytes_q, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaMemcpy(dev.k, h.k.data(), bytes_k, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaMemcpy(dev.v, h.v.data(), bytes_k, cudaMemcpyHostToDevice));
  const std::vector<uint16_t> o_poison(p.tq.elems, poison_half(c.dtype));
  const std::vector<uint32_t> lse_poison(lse_n, kLsePoison);
  GPU_CHECK(cudaMemcpy(dev.o, o_poison.data(), bytes_q, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaMemcpy(dev.lse, lse_poison.data(), lse_n * 4, cudaMemcpyHostToDevice));
  // The copies run on the legacy default stream, which a non-blocking stream
  // does not wait for.
  GPU_CHECK(cudaDeviceSynchronize());

  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ATTN_CHECK(attn_forward(plan, dev.q, dev.k, dev.v, dev.o, c.with_lse ? dev.lse : nullptr, dev.ws,
                          ws, stream));
  GPU_CHECK(cudaStreamSynchronize(stream));
  GPU_CHECK(cudaGetLastError());
  GPU_CHECK(cudaStreamDestroy(stream));
  std::vector<uint16_t> o(p.tq.elems);
  std::vector<uint32_t> lse_bits(lse_n);
  GPU_CHECK(cudaMemcpy(o.data(), dev.o, bytes_q, cudaMemcpyDeviceToHost));
  GPU_CHECK(cudaMemcpy(lse_bits.data(), dev.lse, lse_n * 4, cudaMemcpyDeviceToHost));
  attn_plan_destroy(plan);

  // Every output element written and finite; padding and LSE (if not asked
  // for) untouched.
  int64_t unwritten = 0, clobbered = 0;
  {
    std::vector<uint16_t> rest = o;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t s = 0; s < p.lq(b); ++s)
        for (int64_t hh = 0; hh < c.hq; ++hh)
          for (int64_t x = 0; x < c.d; ++x) {
            const size_t at = size_t(p.off_q(b, s, hh) + x);
            if (!std::isfinite(from_half(c.dtype, o[at]))) ++unwritten;
            rest[at] = poison_half(c.dtype);
          }
    for (uint16_t u : rest) clobbered += u != poison_half(c.dtype);
    for (int64_t i = 0; i < p.lse_elems(); ++i) {
      const float l = bitsf(lse_bits[size_t(i)]);
      if (c.with_lse ? (std::isnan(l) || l == INFINITY) : lse_bits[size_t(i)] != kLsePoison)
        ++unwritten;
    }
  }

  // CPU backend on the same inputs (host memory, same strides).
  std::vector<uint16_t> o_cpu;
  std::vector<float> lse_cpu;
  if (c.vs_cpu) {
    attn_plan_t cplan = build_plan(p, cpu_ctx);
    size_t cws = 0;
    ATTN_CHECK(attn_plan_workspace_size(cplan, ATTN_PASS_FORWARD, &cws));
    std::vector<char> work(cws + 1);
    o_cpu.assign(p.tq.elems, poison_half(c.dtype));
    lse_cpu.assign(lse_n, NAN);
    ATTN_CHECK(attn_forward(cplan, h.q.data(), h.k.data(), h.v.data(), o_cpu.data(), lse_cpu.data(),
                            work.data(), cws, nullptr));
    attn_plan_destroy(cplan);
  }

  std::vector<Row> rows = pick_rows(p, rng);
  const unsigned nt = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 32u));
  std::vector<Stats> per(nt);
  parallel_for(rows.size(), [&](unsigned t, size_t k) {
    const Row& r = rows[k];
    RowRef ref;
    ref_row(p, h, r.b, r.h, r.i, ref);
    Stats& st = per[t];
    ++st.rows;
    const int64_t oo = p.off_q(r.b, r.i, r.h);
    const float lse = bitsf(lse_bits[size_t(p.lse_off(r.b, r.h, r.i))]);
    if (ref.empty) {
      ++st.empty_rows;
      for (int64_t x = 0; x < c.d; ++x)
        if (from_half(c.dtype, o[size_t(oo + x)]) != 0.0f) ++st.bad_empty;
      if (c.with_lse && lse != -INFINITY) ++st.bad_empty;
      return;
    }
    for (int64_t x = 0; x < c.d; ++x) {
      const double got = from_half(c.dtype, o[size_t(oo + x)]);
      if (!std::isfinite(got)) ++st.bad_value;
      st.err = std::max(st.err, std::fabs(got - ref.o64[size_t(x)]));
      st.err_plain = std::max(st.err_plain, std::fabs(double(ref.oplain[size_t(x)]) - ref.o64[size_t(x)]));
    }
    if (c.with_lse) {
      if (!std::isfinite(lse)) ++st.bad_value;
      st.lse_err = std::max(st.lse_err, std::fabs(double(lse) - ref.lse64));
      st.lse_err_plain = std::max(st.lse_err_plain, std::fabs(double(ref.lseplain) - ref.lse64));
    }
  });
  Stats s;
  for (const Stats& x : per) s.merge(x);

  const double atol = atol_for(c.dtype);
  const double tol = 2.0 * s.err_plain + atol;
  const double lse_tol = 2e-3;
  bool ok = s.err <= tol && s.lse_err <= lse_tol && s.bad_empty == 0 && s.bad_value == 0 &&
            unwritten == 0 && clobbered == 0;

  double cpu_diff = 0, cpu_excess = 0, cpu_lse_diff = 0;
  if (c.vs_cpu) {
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t ss = 0; ss < p.lq(b); ++ss)
        for (int64_t hh = 0; hh < c.hq; ++hh) {
          const int64_t oo = p.off_q(b, ss, hh);
          for (int64_t x = 0; x < c.d; ++x) {
            const double a = from_half(c.dtype, o[size_t(oo + x)]),
                         e = from_half(c.dtype, o_cpu[size_t(oo + x)]), d = std::fabs(a - e);
            cpu_diff = std::max(cpu_diff, d);
            // (NaN: the excess becomes infinite, std::max would drop it.)
            const double over = d - spacing_at(c.dtype, std::max(std::fabs(a), std::fabs(e)));
            cpu_excess = std::max(cpu_excess, std::isnan(over) ? double(INFINITY) : over);
          }
          if (!c.with_lse) continue;
          const float a = bitsf(lse_bits[size_t(p.lse_off(b, hh, ss))]);
          const float e = lse_cpu[size_t(p.lse_off(b, hh, ss))];
          const double dl = a == e ? 0.0 : std::fabs(double(a) - double(e));  // inf vs finite: inf
          cpu_lse_diff = std::max(cpu_lse_diff, std::isnan(dl) ? double(INFINITY) : dl);
        }
    // The CPU backend is fp32 throughout (output rounding only): allow the
    // kernel's budget on every row, with margin for rows the sample missed,
    // beyond the one step by which two roundings of an element may differ
    // (rows of few keys have |O| up to the largest |V|, where that step is
    // larger than the sampled rows' budget).
    ok = ok && cpu_excess <= 3.0 * s.err_plain + 2.0 * atol && cpu_lse_diff <= lse_tol;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s %-44s rows %7" PRId64 " (empty %5" PRId64 ") err %.2e plain %.2e tol %.2e lse %.1e",
              ok ? "ok  " : "FAIL", c.name.c_str(), s.rows, s.empty_rows, s.err, s.err_plain, tol,
              s.lse_err);
  if (c.vs_cpu)
    std::printf(" cpu %.2e (%.2e beyond a step) lse %.1e", cpu_diff, cpu_excess, cpu_lse_diff);
  std::printf(" %.1fs\n", secs);
  if (!ok) {
    std::printf("     unwritten %" PRId64 " clobbered %" PRId64 " bad_empty %" PRId64
                " bad_value %" PRId64 "\n",
                unwritten, clobbered, s.bad_empty, s.bad_value);
    ++g_failures;
  }
  std::fflush(stdout);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  const attn_dtype_t dts[2] = {ATTN_DTYPE_BF16, ATTN_DTYPE_FP16};
  const char* dn[2] = {"bf16", "fp16"};
  // Every head dim x dtype: tiny, causal GQA batch, a window over 1000.
  for (int64_t d : {64, 96, 128, 256})
    for (int t = 0; t < 2; ++t) {
      const std::string pre = "d" + std::to_string(d) + "-" + dn[t] + "-";
      Case a;
      a.dtype = dts[t], a.d = d;
      Case x = a;
      x.name = pre + "none-L1-mqa", x.hq = 2, x.hkv = 1, x.lq = x.lk = 1;
      v.push_back(x);
      x = a;
      x.name = pre + "causal-L129-b2-gqa4", x.batch = 2, x.hq = 4, x.hkv = 1, x.lq = x.lk = 129,
      x.mask = ATTN_MASK_CAUSAL;
      v.push_back(x);
      x = a;
      x.name = pre + "window(100,50)-L1000", x.hq = 2, x.hkv = 2, x.lq = x.lk = 1000,
      x.mask = ATTN_MASK_WINDOW, x.wl = 100, x.wr = 50;
      v.push_back(x);
    }
  auto add = [&](Case x) { v.push_back(std::move(x)); };
  Case b;  // d=128 bf16 unless said otherwise
  {
    Case x = b;
    x.name = "none-L7", x.lq = x.lk = 7, x.hq = 3, x.hkv = 3;
    add(x);
    x.name = "causal-L7", x.mask = ATTN_MASK_CAUSAL;
    add(x);
  }
  // Windows, including the header's picture and tile-edge boundaries.
  struct W { int64_t lq, lk, l, r; bool empty; };
  const W ws[] = {{3, 5, 1, 0, false},     {1000, 1000, 0, 0, false}, {1000, 1000, 1, 0, false},
                  {1000, 1000, 0, 1, false}, {1000, 1000, -1, 2, false}, {1000, 1000, 5, -1, false},
                  {300, 300, 63, 0, false},  {300, 300, 64, 64, false}, {300, 300, 127, 0, false},
                  {129, 129, 1000, 1000, false}, {200, 64, 0, 0, true}, {64, 200, 3, 3, false},
                  {129, 7, -1, 0, true}};
  for (const W& w : ws) {
    Case x = b;
    x.name = "window(" + std::to_string(w.l) + "," + std::to_string(w.r) + ")-" +
             std::to_string(w.lq) + "x" + std::to_string(w.lk);
    x.lq = w.lq, x.lk = w.lk, x.mask = ATTN_MASK_WINDOW, x.wl = w.l, x.wr = w.r, x.hq = 2, x.hkv = 1;
    x.allow_empty = w.empty;
    add(x);
  }
  // GQA ratios 1/4/8 and MQA.
  for (auto hh : {std::pair<int64_t, int64_t>{8, 8}, {8, 2}, {16, 2}, {8, 1}}) {
    Case x = b;
    x.name = "causal-gqa" + std::to_string(hh.first) + "/" + std::to_string(hh.second) + "-L257";
    x.hq = hh.first, x.hkv = hh.second, x.lq = x.lk = 257, x.mask = ATTN_MASK_CAUSAL;
    add(x);
  }
  // seqlen_q != seqlen_kv both ways.
  {
    Case x = b;
    x.hq = 2, x.hkv = 1, x.mask = ATTN_MASK_CAUSAL;
    x.name = "causal-100x1000", x.lq = 100, x.lk = 1000;
    add(x);
    x.name = "causal-1000x100-empty", x.lq = 1000, x.lk = 100, x.allow_empty = true;
    add(x);
    x.name = "none-129x7", x.mask = ATTN_MASK_NONE, x.lq = 129, x.lk = 7, x.allow_empty = false;
    add(x);
    x.name = "none-7x1000-fp16", x.lq = 7, x.lk = 1000, x.dtype = ATTN_DTYPE_FP16;
    add(x);
    x.name = "causal-300x0-empty", x.mask = ATTN_MASK_CAUSAL, x.lq = 300, x.lk = 0,
    x.allow_empty = true;
    add(x);
  }
  // Varlen with empty sequences (both sides) and empty rows.
  {
    Case x = b;
    x.name = "varlen-causal-gqa", x.hq = 4, x.hkv = 2, x.mask = ATTN_MASK_CAUSAL;
    x.seq_q = {5, 0, 130, 64, 1, 300}, x.seq_kv = {7, 3, 200, 0, 1, 129}, x.allow_empty = true;
    add(x);
    x.name = "varlen-none-fp16-d64-padded", x.d = 64, x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_NONE,
    x.padded = true, x.seq_q = {17, 0, 256, 1}, x.seq_kv = {300, 9, 64, 1}, x.allow_empty = false;
    add(x);
    x.name = "varlen-window-d96", x.d = 96, x.dtype = ATTN_DTYPE_BF16, x.mask = ATTN_MASK_WINDOW,
    x.wl = 17, x.wr = 3, x.padded = false, x.seq_q = {200, 129, 3}, x.seq_kv = {190, 300, 3};
    x.allow_empty = true;
    add(x);
  }
  // Softcap (saturating with a peaky Q), scale.
  {
    Case x = b;
    x.name = "softcap30-causal-q4", x.softcap = 30.0f, x.qmul = 4.0f, x.mask = ATTN_MASK_CAUSAL,
    x.lq = x.lk = 333, x.hq = 2, x.hkv = 1;
    add(x);
    x.name = "softcap5-none-d256-fp16", x.softcap = 5.0f, x.qmul = 2.0f, x.d = 256,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_NONE, x.lq = 200, x.lk = 257;
    add(x);
    // The sm_90a kernels' softcap instantiations: d = 64 (128-row tiles)
    // and 128, saturating and not, both dtypes, a window and varlen.
    x.name = "softcap20-causal-d64-q4-gqa2", x.softcap = 20.0f, x.qmul = 4.0f, x.d = 64,
    x.dtype = ATTN_DTYPE_BF16, x.mask = ATTN_MASK_CAUSAL, x.lq = x.lk = 333, x.hq = 4, x.hkv = 2;
    add(x);
    x.name = "softcap2-none-d64-fp16-300x520", x.softcap = 2.0f, x.qmul = 3.0f,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_NONE, x.lq = 300, x.lk = 520, x.hq = x.hkv = 2;
    add(x);
    x.name = "softcap50-none-d128-fp16-129x700", x.softcap = 50.0f, x.qmul = 1.0f, x.d = 128,
    x.lq = 129, x.lk = 700;
    add(x);
    x.name = "softcap8-window(70,10)-d128-q3", x.softcap = 8.0f, x.qmul = 3.0f,
    x.dtype = ATTN_DTYPE_BF16, x.mask = ATTN_MASK_WINDOW, x.wl = 70, x.wr = 10, x.lq = x.lk = 400;
    add(x);
    x = b;
    x.name = "softcap15-varlen-causal-d64", x.softcap = 15.0f, x.qmul = 3.0f, x.d = 64,
    x.mask = ATTN_MASK_CAUSAL, x.hq = 2, x.hkv = 1, x.seq_q = {129, 0, 300, 64},
    x.seq_kv = {129, 5, 400, 64}, x.allow_empty = true;
    add(x);
    // A cap far above the logits (z = cap tanh(u / cap) ~ u): tanh as
    // 1 - 2 / (e^{2y} + 1) alone would put ~1e-7 cap = 1e-2 into every
    // logit (softcap_logit). The sm_90a instantiation (d = 128) and the
    // sm_80 kernel (varlen).
    x = b;
    x.name = "softcap1e5-causal-d128-fp16", x.softcap = 1e5f, x.d = 128,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_CAUSAL, x.lq = x.lk = 300, x.hq = 2, x.hkv = 1;
    add(x);
    x = b;
    x.name = "softcap1e5-varlen-none-d64-fp16", x.softcap = 1e5f, x.d = 64,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_NONE, x.seq_q = {100, 33},
    x.seq_kv = {150, 200}, x.allow_empty = false;
    add(x);
    x = b;
    x.name = "peaky-q8-fp16-scale0.3", x.qmul = 8.0f, x.scale = 0.3f, x.dtype = ATTN_DTYPE_FP16,
    x.lq = x.lk = 200, x.mask = ATTN_MASK_CAUSAL;
    add(x);
    x.name = "no-lse-causal", x.qmul = 1.0f, x.scale = 0.0f, x.with_lse = false;
    add(x);
  }
  // Layouts with default and non-default strides.
  for (int t = 0; t < 2; ++t)
    for (attn_layout_t lay : {ATTN_LAYOUT_BSHD, ATTN_LAYOUT_BHSD})
      for (bool pad : {false, true}) {
        Case x = b;
        x.dtype = dts[t];
        x.layout = lay, x.padded = pad, x.batch = 2, x.hq = 4, x.hkv = 2, x.lq = 150, x.lk = 170;
        x.mask = ATTN_MASK_CAUSAL, x.d = t == 0 ? 128 : 96;
        x.name = std::string(lay == ATTN_LAYOUT_BSHD ? "bshd" : "bhsd") + (pad ? "-padded" : "") +
                 "-" + dn[t] + "-d" + std::to_string(x.d);
        add(x);
        // d = 64 (the sm_90a kernel's 192-row tile), full mask.
        x.d = 64, x.mask = ATTN_MASK_NONE, x.lq = 400, x.lk = 130;
        x.name = std::string(lay == ATTN_LAYOUT_BSHD ? "bshd" : "bhsd") + (pad ? "-padded" : "") +
                 "-" + dn[t] + "-d64-none-400x130";
        add(x);
      }
  // d = 64 at lengths around both query tiles (128 and 192 rows): causal,
  // partial last tiles, GQA, lq != lk, varlen.
  for (int64_t l : {191, 193, 384, 640}) {
    Case x = b;
    x.d = 64, x.mask = ATTN_MASK_CAUSAL, x.lq = x.lk = l, x.hq = 4, x.hkv = 2, x.batch = 2;
    x.name = "d64-causal-L" + std::to_string(l) + "-b2-gqa2";
    add(x);
  }
  {
    Case x = b;
    x.d = 64, x.mask = ATTN_MASK_CAUSAL, x.dtype = ATTN_DTYPE_FP16;
    x.name = "d64-causal-300x700-fp16", x.lq = 300, x.lk = 700;
    add(x);
    x.name = "d64-causal-700x300-fp16-empty", x.lq = 700, x.lk = 300, x.allow_empty = true;
    add(x);
    x.name = "d64-varlen-causal-bf16", x.dtype = ATTN_DTYPE_BF16, x.hq = 4, x.hkv = 1,
    x.seq_q = {192, 1, 0, 257, 128}, x.seq_kv = {192, 3, 4, 257, 500}, x.allow_empty = true;
    add(x);
  }
  // Larger shapes: sampled rows against fp64, every row against the CPU backend.
  {
    Case x = b;
    x.big = true, x.sample = 48, x.vs_cpu = true;
    x.name = "big-causal-L16K-gqa2-bf16", x.lq = x.lk = 16384, x.hq = 2, x.hkv = 1,
    x.mask = ATTN_MASK_CAUSAL;
    add(x);
    x.name = "big-window(1024,0)-L8K-fp16-d64", x.lq = x.lk = 8192, x.d = 64,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_WINDOW, x.wl = 1024, x.wr = 0;
    add(x);
    x.name = "big-none-4Kx3K-bf16-d256", x.lq = 4096, x.lk = 3000, x.d = 256, x.hq = 1, x.hkv = 1,
    x.dtype = ATTN_DTYPE_BF16, x.mask = ATTN_MASK_NONE;
    add(x);
    x.name = "big-none-L4K-b2-gqa2-bf16-d64", x.lq = x.lk = 4096, x.d = 64, x.batch = 2, x.hq = 2,
    x.hkv = 1;
    add(x);
    x.name = "big-causal-L2K-b2-gqa2-bf16-d64", x.lq = x.lk = 2048, x.mask = ATTN_MASK_CAUSAL;
    add(x);
    x.name = "big-causal-3000x5000-fp16-d128", x.lq = 3000, x.lk = 5000, x.d = 128, x.batch = 1,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_CAUSAL;
    add(x);
    // Many query tiles per SM for the warp-specialised forward's blocks
    // (about 8 and 11 work items each on 132 SMs: both Q buffers reused,
    // stages reused across items), the second with leading tiles that see
    // no key (items without KV tiles between the others).
    x.name = "big-causal-L4K-b2-gqa4-bf16-d128", x.lq = x.lk = 4096, x.batch = 2, x.hq = 16,
    x.hkv = 4, x.dtype = ATTN_DTYPE_BF16;
    add(x);
    x.name = "big-causal-6000x2000-b2-gqa4-fp16-d64-empty", x.lq = 6000, x.lk = 2000, x.d = 64,
    x.dtype = ATTN_DTYPE_FP16, x.allow_empty = true;
    add(x);
  }
  return v;
}

// Graph capture and replay of attn_forward reproduce a direct run bit for
// bit, and a second direct run does too (a race would show).
void test_graph(attn_context_t ctx) {
  Case c;
  c.name = "graph", c.batch = 2, c.hq = 8, c.hkv = 2, c.lq = 777, c.lk = 901, c.d = 128,
  c.mask = ATTN_MASK_CAUSAL;
  const Problem p = make_problem(c);
  std::mt19937_64 rng(g_seed + 7);
  HostData h;
  fill_inputs(p, rng, h);
  attn_plan_t plan = build_plan(p, ctx);
  DeviceBuffers dev;
  const size_t bq = p.tq.elems * 2, bk = p.tk.elems * 2, nl = size_t(p.lse_elems());
  GPU_CHECK(cudaMalloc(&dev.q, bq));
  GPU_CHECK(cudaMalloc(&dev.k, bk));
  GPU_CHECK(cudaMalloc(&dev.v, bk));
  GPU_CHECK(cudaMalloc(&dev.o, bq));
  GPU_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev.lse), nl * 4));
  GPU_CHECK(cudaMemcpy(dev.q, h.q.data(), bq, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaMemcpy(dev.k, h.k.data(), bk, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaMemcpy(dev.v, h.v.data(), bk, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaDeviceSynchronize());
  cudaStream_t s;
  GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto snapshot = [&](std::vector<uint8_t>& out) {
    out.resize(bq + nl * 4);
    GPU_CHECK(cudaMemcpy(out.data(), dev.o, bq, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(out.data() + bq, dev.lse, nl * 4, cudaMemcpyDeviceToHost));
  };
  auto poison = [&] {
    GPU_CHECK(cudaMemsetAsync(dev.o, 0xff, bq, s));
    GPU_CHECK(cudaMemsetAsync(dev.lse, 0xff, nl * 4, s));
  };
  std::vector<uint8_t> direct, direct2, replay;
  poison();
  ATTN_CHECK(attn_forward(plan, dev.q, dev.k, dev.v, dev.o, dev.lse, nullptr, 0, s));
  GPU_CHECK(cudaStreamSynchronize(s));
  snapshot(direct);
  poison();
  ATTN_CHECK(attn_forward(plan, dev.q, dev.k, dev.v, dev.o, dev.lse, nullptr, 0, s));
  GPU_CHECK(cudaStreamSynchronize(s));
  snapshot(direct2);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  GPU_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const attn_status_t st = attn_forward(plan, dev.q, dev.k, dev.v, dev.o, dev.lse, nullptr, 0, s);
  const std::string why = attn_last_error_message();  // before later calls reset it
  GPU_CHECK(cudaStreamEndCapture(s, &graph));
  bool ok = st == ATTN_STATUS_SUCCESS;
  if (ok) {
    GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    poison();
    GPU_CHECK(cudaGraphLaunch(exec, s));
    GPU_CHECK(cudaGraphLaunch(exec, s));
    GPU_CHECK(cudaStreamSynchronize(s));
    snapshot(replay);
    GPU_CHECK(cudaGraphExecDestroy(exec));
    ok = replay == direct && direct2 == direct;
  }
  GPU_CHECK(cudaGraphDestroy(graph));
  GPU_CHECK(cudaStreamDestroy(s));
  attn_plan_destroy(plan);
  std::printf("%s graph capture + replay == direct run, bitwise (and run-to-run)%s\n",
              ok ? "ok  " : "FAIL", why.c_str());
  if (!ok) ++g_failures;
}

void expect(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++g_failures;
}

void test_describe(attn_context_t ctx) {
  Case c;
  c.lq = c.lk = 100, c.d = 128;
  attn_plan_t plan = build_plan(make_problem(c), ctx);
  attn_plan_info_t info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  ATTN_CHECK(attn_plan_describe(plan, &info));
  char line[600];
  ATTN_CHECK(attn_plan_summary(plan, line, sizeof line, nullptr));
  std::printf("     %s\n", line);
  const bool sm90 = expects_sm90(c);
  const bool ok = info.backend == ATTN_BACKEND_CUDA &&
                  std::strstr(info.kernel, sm90 ? "cuda-sm90-wgmma" : "cuda-fa2") &&
                  std::strstr(info.kernel, "bf16-d128") &&
                  std::strstr(info.kernel, sm90 ? "128x128" : "128x64") && info.tile_q == 128 &&
                  info.tile_kv == (sm90 ? 128 : 64) && info.workspace_bytes_forward == 0 &&
                  info.visible_pairs == 100 * 100 && info.supports_backward == 0;
  expect(ok, sm90 ? "attn_plan_describe names the sm_90a kernel and its 128x128 tile"
                  : "attn_plan_describe names the sm_80 kernel and its 128x64 tile");
  attn_plan_destroy(plan);
  // The d = 64 tile the plan picks by itself (cuda/fwd_sm90_shape.hpp, tested
  // without a GPU by tests/unit): on this device's SM count, short causal
  // sequences take 128 rows, long full ones that both tiles divide 192.
  if (!sm90 || g_sm90_bm != 0 || g_ws) return;
  struct Pick {
    int64_t batch, heads, l;
    attn_mask_t mask;
    int want;
  };
  for (const Pick& k : {Pick{16, 32, 1024, ATTN_MASK_CAUSAL, 128},
                        Pick{1, 32, 15360, ATTN_MASK_NONE, 192}}) {
    Case x;
    x.d = 64, x.batch = k.batch, x.hq = x.hkv = k.heads, x.lq = x.lk = k.l, x.mask = k.mask;
    attn_plan_t pk = build_plan(make_problem(x), ctx);
    const attn_plan_info_t pi = describe(pk);
    const std::string what = std::string("d = 64 ") +
                             (k.mask == ATTN_MASK_CAUSAL ? "causal" : "full") + " L = " +
                             std::to_string(k.l) + ": " + std::to_string(k.want) +
                             "-row tiles (" + pi.kernel + ")";
    expect(pi.tile_q == k.want, what.c_str());
    attn_plan_destroy(pk);
  }
}

void test_not_supported(attn_context_t ctx) {
  struct Bad {
    const char* what;
    const char* needle;
    void (*tweak)(attn_plan_desc_t);
  };
  const Bad bads[] = {
      {"fp32 -> NOT_SUPPORTED", "fp32", [](attn_plan_desc_t d) { attn_plan_desc_set_dtype(d, ATTN_DTYPE_FP32); }},
      {"head_dim 80 -> NOT_SUPPORTED", "head_dim",
       [](attn_plan_desc_t d) { attn_plan_desc_set_shape(d, 1, 2, 2, 64, 64, 80, 80); }},
      {"head_dim_v != head_dim_qk -> NOT_SUPPORTED", "head_dim_v",
       [](attn_plan_desc_t d) { attn_plan_desc_set_shape(d, 1, 2, 2, 64, 64, 128, 64); }},
      // The grids' y (query heads) and z (sequences), and 32-bit offsets:
      // refused at plan creation, never launched.
      {"65536 query heads -> NOT_SUPPORTED", "heads_q",
       [](attn_plan_desc_t d) { attn_plan_desc_set_shape(d, 1, 65536, 1, 64, 64, 64, 64); }},
      {"65536 sequences -> NOT_SUPPORTED", "batch",
       [](attn_plan_desc_t d) { attn_plan_desc_set_shape(d, 65536, 1, 1, 64, 64, 64, 64); }},
      {"2^30 keys -> NOT_SUPPORTED", "seqlen_kv",
       [](attn_plan_desc_t d) { attn_plan_desc_set_shape(d, 1, 1, 1, 64, 1 << 30, 64, 64); }},
      {"strides not a multiple of 8 -> NOT_SUPPORTED", "multiples of 8",
       [](attn_plan_desc_t d) {
         attn_tensor_desc_t t;
         attn_tensor_desc_create(&t);
         const int64_t dims[4] = {1, 64, 2, 64}, strides[4] = {64 * 132, 132, 66, 1};
         attn_tensor_desc_set(t, ATTN_DTYPE_BF16, 4, dims, strides);
         attn_plan_desc_set_tensor(d, ATTN_TENSOR_K, t);
         attn_tensor_desc_destroy(t);
       }},
  };
  for (const Bad& bad : bads) {
    attn_plan_desc_t d;
    ATTN_CHECK(attn_plan_desc_create(&d));
    ATTN_CHECK(attn_plan_desc_set_shape(d, 1, 2, 2, 64, 64, 64, 64));
    ATTN_CHECK(attn_plan_desc_set_dtype(d, ATTN_DTYPE_BF16));
    bad.tweak(d);
    attn_plan_t plan = nullptr;
    const attn_status_t s = attn_plan_create(ctx, d, &plan);
    const bool ok = s == ATTN_STATUS_NOT_SUPPORTED && plan == nullptr &&
                    std::strstr(attn_last_error_message(), bad.needle) != nullptr;
    if (!ok) std::printf("     got %s: %s\n", attn_status_string(s), attn_last_error_message());
    expect(ok, bad.what);
    attn_plan_destroy(plan);
    attn_plan_desc_destroy(d);
  }
  // A misaligned pointer is rejected before anything runs.
  Case c;
  c.lq = c.lk = 64, c.d = 64;
  const Problem p = make_problem(c);
  attn_plan_t plan = build_plan(p, ctx);
  DeviceBuffers dev;
  GPU_CHECK(cudaMalloc(&dev.q, p.tq.elems * 2 + 16));
  const char* q = static_cast<const char*>(dev.q);
  const attn_status_t s =
      attn_forward(plan, q + 2, dev.q, dev.q, dev.q, nullptr, nullptr, 0, nullptr);
  expect(s == ATTN_STATUS_INVALID_ARGUMENT, "misaligned q -> INVALID_ARGUMENT");
  attn_plan_destroy(plan);
}

}  // namespace

int main() {
  skip_without_device();
  const char* seed_env = std::getenv("ATTN_TEST_SEED");
  g_seed = seed_env ? std::strtoull(seed_env, nullptr, 10)
                    : uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  const char* quick = std::getenv("ATTN_GPU_TEST_QUICK");
  g_quick = quick != nullptr && quick[0] == '1';
  g_filter = std::getenv("ATTN_GPU_TEST_FILTER");
  const char* head_dim_env = std::getenv("ATTN_GPU_TEST_HEAD_DIM");
  g_head_dim = head_dim_env ? std::atoll(head_dim_env) : 0;
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)%s\n", g_seed, g_seed,
              g_quick ? ", quick" : "");

  cudaDeviceProp prop{};
  GPU_CHECK(cudaGetDeviceProperties(&prop, 0));
  const char* sm90_env = std::getenv("ATTN_CUDA_FWD_SM90");
  g_sm90 = prop.major == 9 && prop.minor == 0 && !(sm90_env && std::strcmp(sm90_env, "0") == 0);
  const char* bm_env = std::getenv("ATTN_CUDA_FWD_SM90_BM");
  const int bm = bm_env ? std::atoi(bm_env) : 0;
  g_sm90_bm = bm == 128 || bm == 192 ? bm : 0;
  const char* ws_env = std::getenv("ATTN_CUDA_FWD_SM90_WS");
  g_ws = g_sm90 && !(ws_env != nullptr && std::strcmp(ws_env, "0") == 0);
  std::printf("device sm_%d%d: d = 64/128 plans expected on the %s forward\n", prop.major,
              prop.minor, g_sm90 ? "sm_90a (wgmma)" : "sm_80");

  attn_context_t cuda_ctx = nullptr, cpu_ctx = nullptr;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &cuda_ctx));
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CPU, 0, 0, &cpu_ctx));

  test_describe(cuda_ctx);
  test_not_supported(cuda_ctx);
  for (const Case& c : cases()) run_case(c, cuda_ctx, cpu_ctx);
  if (!g_quick && g_filter == nullptr && g_head_dim == 0) test_graph(cuda_ctx);

  attn_context_destroy(cpu_ctx);
  attn_context_destroy(cuda_ctx);
  std::printf("%s: %d failure(s), seed %" PRIu64 "\n", g_failures ? "FAILED" : "PASSED", g_failures,
              g_seed);
  return g_failures ? 1 : 0;
}
