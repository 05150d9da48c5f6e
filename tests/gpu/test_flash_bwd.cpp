// CUDA backward vs an fp64 reference (S, P, dP and dS materialised in
// double) and vs the CPU backend, over masks (window boundaries included),
// GQA and MQA, unequal and varlen lengths with empty rows and sequences,
// softcap, dtypes, layouts with non-default strides and every supported head
// dim; every case runs both the default plan (dQ by fp32 atomics) and the
// deterministic one (dQ in its own pass). On sm_90 devices the default
// plan's dK/dV kernel at d = 64 and 128 (softcap included) is the sm_90a
// (wgmma) one unless ATTN_CUDA_BWD_SM90=0 or ATTN_CUDA_BWD_VARIANT is set
// (deterministic plans too, with the sm_80 deterministic dQ kernel); each
// case checks from attn_plan_describe which one ran.
//
// Tolerance (FlashAttention's rule), per gradient: max |dX - dX_fp64| <=
// 2 * max |dX_plain - dX_fp64| + atol, where dX_plain comes from a
// straightforward implementation in the same precision (logits, P, dP, dS
// and every output rounded to the dtype, fp32 sums) and atol is a small
// absolute term (a quarter of the forward test's: fp32 noise where the exact
// gradient is 0). Rows that see no key must give dQ = 0 exactly, keys no
// row sees dK = dV = 0 exactly. Large shapes check sampled dQ rows against
// fp64 and every element against the CPU backend (relative to the largest
// element). Inputs are fresh random values every run (seed printed;
// ATTN_TEST_SEED=n repeats one); outputs, their padding and the workspace
// are poisoned before each run.
//
// Also: a deterministic plan's backward repeated 50 times is bit-identical;
// forward + backward captured in a CUDA graph and replayed give the bits of
// a direct run; attn_plan_describe names the backward variant and its
// workspace; misaligned or short workspaces are rejected.
// ATTN_GPU_TEST_QUICK=1 runs only small cases (for compute-sanitizer);
// ATTN_GPU_TEST_FILTER=text only the cases whose name contains text.
// Exit 77 without a CUDA device.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <functional>
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
bool g_bwd_sm90 = false;  // sm_90 device, ATTN_CUDA_BWD_SM90 != 0, no ATTN_CUDA_BWD_VARIANT

// Whether the plans of c (default and deterministic) run the sm_90a dK/dV kernel.
bool expects_bwd_sm90(const CaseShape& c) { return g_bwd_sm90 && (c.d == 64 || c.d == 128); }

struct Case : CaseShape {
  bool vs_cpu = true;  // compare every element with the CPU backend
};
using Problem = CaseProblem<Case>;

attn_plan_t build_plan(const Problem& p, attn_context_t ctx, bool deterministic) {
  attn_plan_desc_t pd = case_plan_desc(p, ATTN_TENSOR_DV + 1);
  ATTN_CHECK(attn_plan_desc_set_passes(pd, ATTN_PASSES_FORWARD_BACKWARD));
  ATTN_CHECK(attn_plan_desc_set_deterministic(pd, deterministic ? 1 : 0));
  return plan_or_exit(ctx, pd, p.c.name);
}

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
unsigned n_workers() { return std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 32u)); }

// Host copies of every tensor (dtype bits, with the tensors' strides; padding
// holds the poison pattern) and, for the reference, dense float copies
// [b][head][row][d] of the inputs.
struct Host {
  std::vector<uint16_t> q, k, v, o, d_o;
  std::vector<float> lse;
};

double atol_for(attn_dtype_t t) {
  // A quarter of the forward test's term (twice the rounding error near 0.3).
  return t == ATTN_DTYPE_BF16 ? 0.5 * std::ldexp(1.0, -10) : 0.5 * std::ldexp(1.0, -13);
}

// The three gradients, as dtype bits with the tensors' strides.
struct Grads {
  std::vector<uint16_t> dq, dk, dv;
};

// Reference gradients of one tensor kind over the rows checked, plus the
// elements that must be exactly zero.
struct Check {
  double err = 0, err_plain = 0, ref_max = 0;
  int64_t bad = 0;  // non-finite outputs or nonzero where exactly zero is required
  void merge(const Check& o) {
    err = std::max(err, o.err), err_plain = std::max(err_plain, o.err_plain);
    ref_max = std::max(ref_max, o.ref_max), bad += o.bad;
  }
};

float ld(const Problem& p, const std::vector<uint16_t>& buf, int64_t off) {
  return from_half(p.c.dtype, buf[size_t(off)]);
}

// fp64 and plain reference of one query row (b, h, i): P, dS over its
// visible keys [lo, hi] and dQ. P and dS are also returned for dK and dV.
struct RowRef {
  int64_t lo = 0, hi = -1;
  std::vector<double> p64, ds64, dq64;
  std::vector<float> pr, dsr, dqr;  // plain: rounded values
};

void ref_row(const Problem& p, const Host& h, int64_t b, int64_t hh, int64_t i, RowRef& r) {
  const Case& c = p.c;
  const attn_dtype_t dt = c.dtype;
  const int64_t d = c.d, hk = hh / p.group();
  p.bounds(b, i, r.lo, r.hi);
  r.dq64.assign(size_t(d), 0.0);
  r.dqr.assign(size_t(d), 0.0f);
  if (r.lo > r.hi) return;
  const int64_t n = r.hi - r.lo + 1;
  std::vector<float> qrow(static_cast<size_t>(d)), dorow(static_cast<size_t>(d));
  for (int64_t x = 0; x < d; ++x) {
    qrow[size_t(x)] = ld(p, h.q, p.off_q(b, i, hh) + x);
    dorow[size_t(x)] = ld(p, h.d_o, p.off_q(b, i, hh) + x);
  }
  std::vector<double> z64(static_cast<size_t>(n)), dp64(static_cast<size_t>(n));
  std::vector<float> z32(static_cast<size_t>(n)), dp32(static_cast<size_t>(n));
  const double cap = c.softcap;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t ko = p.off_k(b, r.lo + j, hk);
    double s64 = 0, t64 = 0;
    float s32 = 0, t32 = 0;
    for (int64_t x = 0; x < d; ++x) {
      const float kv = ld(p, h.k, ko + x), vv = ld(p, h.v, ko + x);
      s64 += double(qrow[size_t(x)]) * double(kv);
      s32 += qrow[size_t(x)] * kv;
      t64 += double(dorow[size_t(x)]) * double(vv);
      t32 += dorow[size_t(x)] * vv;
    }
    double zz = double(p.scale) * s64;
    float zl = round_half(dt, p.scale * s32);
    if (cap > 0) {
      zz = cap * std::tanh(zz / cap);
      zl = round_half(dt, float(cap) * std::tanh(zl / float(cap)));
    }
    z64[size_t(j)] = zz;
    z32[size_t(j)] = zl;
    dp64[size_t(j)] = t64;
    dp32[size_t(j)] = round_half(dt, t32);
  }
  const double m64 = *std::max_element(z64.begin(), z64.end());
  const float m32 = *std::max_element(z32.begin(), z32.end());
  double l64 = 0;
  float l32 = 0;
  r.p64.resize(size_t(n));
  r.pr.resize(size_t(n));
  for (int64_t j = 0; j < n; ++j) {
    r.p64[size_t(j)] = std::exp(z64[size_t(j)] - m64);
    l64 += r.p64[size_t(j)];
    r.pr[size_t(j)] = std::exp(z32[size_t(j)] - m32);
    l32 += r.pr[size_t(j)];
  }
  for (int64_t j = 0; j < n; ++j) {
    r.p64[size_t(j)] /= l64;
    r.pr[size_t(j)] = round_half(dt, r.pr[size_t(j)] / l32);
  }
  // D = dO . O with the exact O (fp64) and the plain O (rounded).
  std::vector<double> o64(size_t(d), 0.0);
  std::vector<float> o32(size_t(d), 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t vo = p.off_k(b, r.lo + j, hk);
    for (int64_t x = 0; x < d; ++x) {
      const float vv = ld(p, h.v, vo + x);
      o64[size_t(x)] += r.p64[size_t(j)] * double(vv);
      o32[size_t(x)] += r.pr[size_t(j)] * vv;
    }
  }
  double dd64 = 0;
  float dd32 = 0;
  for (int64_t x = 0; x < d; ++x) {
    dd64 += double(dorow[size_t(x)]) * o64[size_t(x)];
    dd32 += dorow[size_t(x)] * round_half(dt, o32[size_t(x)]);
  }
  dd32 = round_half(dt, dd32);
  r.ds64.resize(size_t(n));
  r.dsr.resize(size_t(n));
  for (int64_t j = 0; j < n; ++j) {
    double g64 = 1;
    float g32 = 1;
    if (cap > 0) {
      const double y = z64[size_t(j)] / cap;
      g64 = 1 - y * y;
      const float y32 = z32[size_t(j)] / float(cap);
      g32 = 1 - y32 * y32;
    }
    r.ds64[size_t(j)] = r.p64[size_t(j)] * (dp64[size_t(j)] - dd64) * g64;
    r.dsr[size_t(j)] = round_half(dt, r.pr[size_t(j)] * (dp32[size_t(j)] - dd32) * g32);
  }
  std::vector<float> acc(size_t(d), 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t ko = p.off_k(b, r.lo + j, hk);
    for (int64_t x = 0; x < d; ++x) {
      const float kv = ld(p, h.k, ko + x);
      r.dq64[size_t(x)] += r.ds64[size_t(j)] * double(kv);
      acc[size_t(x)] += r.dsr[size_t(j)] * kv;
    }
  }
  for (int64_t x = 0; x < d; ++x) {
    r.dq64[size_t(x)] *= double(p.scale);
    r.dqr[size_t(x)] = round_half(dt, p.scale * acc[size_t(x)]);
  }
}

void compare(Check& ck, double got, double ref, double plain) {
  if (!std::isfinite(got)) ++ck.bad;
  ck.err = std::max(ck.err, std::fabs(got - ref));
  ck.err_plain = std::max(ck.err_plain, std::fabs(double(plain) - ref));
  ck.ref_max = std::max(ck.ref_max, std::fabs(ref));
}

// Full fp64 reference of dQ, dK, dV against `g`, sequence by sequence.
void check_full(const Problem& p, const Host& h, const Grads& g, Check ck[3]) {
  const Case& c = p.c;
  const int64_t d = c.d, G = p.group();
  const unsigned nw = n_workers();
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t m = p.lq(b), n = p.lk(b);
    if (m == 0 && n == 0) continue;
    // Per query head and row: P and dS over the visible keys.
    std::vector<RowRef> rows(size_t(c.hq * m));
    std::vector<Check> per(nw * 3);
    parallel_for(rows.size(), [&](unsigned t, size_t k) {
      const int64_t hh = int64_t(k) / std::max<int64_t>(m, 1), i = int64_t(k) % std::max<int64_t>(m, 1);
      RowRef& r = rows[k];
      ref_row(p, h, b, hh, i, r);
      Check& q = per[t * 3];
      const int64_t o = p.off_q(b, i, hh);
      for (int64_t x = 0; x < d; ++x) {
        const float got = ld(p, g.dq, o + x);
        if (r.lo > r.hi && got != 0.0f) ++q.bad;  // a row that saw nothing: exactly 0
        compare(q, got, r.dq64[size_t(x)], r.dqr[size_t(x)]);
      }
      // Keep only what dK/dV need.
      r.dq64.clear(), r.dqr.clear();
    });
    // Per KV head and key: dK = scale sum dS^T Q, dV = sum P^T dO over the group.
    parallel_for(size_t(c.hkv * n), [&](unsigned t, size_t k) {
      const int64_t hk = int64_t(k) / n, j = int64_t(k) % n;
      std::vector<double> dk64(size_t(d), 0.0), dv64(size_t(d), 0.0);
      std::vector<float> dk32(size_t(d), 0.0f), dv32(size_t(d), 0.0f);
      bool seen = false;
      for (int64_t hh = hk * G; hh < (hk + 1) * G; ++hh)
        for (int64_t i = 0; i < m; ++i) {
          const RowRef& r = rows[size_t(hh * m + i)];
          if (j < r.lo || j > r.hi) continue;
          seen = true;
          const size_t jj = size_t(j - r.lo);
          const int64_t o = p.off_q(b, i, hh);
          for (int64_t x = 0; x < d; ++x) {
            const float qv = ld(p, h.q, o + x), dov = ld(p, h.d_o, o + x);
            dk64[size_t(x)] += r.ds64[jj] * double(qv);
            dv64[size_t(x)] += r.p64[jj] * double(dov);
            dk32[size_t(x)] += r.dsr[jj] * qv;
            dv32[size_t(x)] += r.pr[jj] * dov;
          }
        }
      Check& kc = per[t * 3 + 1];
      Check& vc = per[t * 3 + 2];
      const int64_t o = p.off_k(b, j, hk);
      for (int64_t x = 0; x < d; ++x) {
        const float gk = ld(p, g.dk, o + x), gv = ld(p, g.dv, o + x);
        if (!seen && (gk != 0.0f || gv != 0.0f)) ++kc.bad;  // a key nobody sees: exactly 0
        compare(kc, gk, double(p.scale) * dk64[size_t(x)], round_half(c.dtype, p.scale * dk32[size_t(x)]));
        compare(vc, gv, dv64[size_t(x)], round_half(c.dtype, dv32[size_t(x)]));
      }
    });
    for (unsigned t = 0; t < nw; ++t)
      for (int k = 0; k < 3; ++k) ck[k].merge(per[t * 3 + k]);
  }
}

// Sampled dQ rows against fp64 (large shapes).
void check_sampled(const Problem& p, const Host& h, const Grads& g, std::mt19937_64& rng,
                   Check& cq) {
  const Case& c = p.c;
  struct Row {
    int64_t b, h, i;
  };
  std::vector<Row> rows;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t hh = 0; hh < c.hq; ++hh) {
      const int64_t lq = p.lq(b);
      if (lq <= c.sample) {
        for (int64_t i = 0; i < lq; ++i) rows.push_back({b, hh, i});
        continue;
      }
      for (int64_t i = 0; i < 4; ++i) rows.push_back({b, hh, i}), rows.push_back({b, hh, lq - 1 - i});
      std::uniform_int_distribution<int64_t> u(0, lq - 1);
      for (int k = 8; k < c.sample; ++k) rows.push_back({b, hh, u(rng)});
    }
  std::vector<Check> per(n_workers());
  parallel_for(rows.size(), [&](unsigned t, size_t k) {
    RowRef r;
    ref_row(p, h, rows[k].b, rows[k].h, rows[k].i, r);
    const int64_t o = p.off_q(rows[k].b, rows[k].i, rows[k].h);
    for (int64_t x = 0; x < c.d; ++x) {
      const float got = ld(p, g.dq, o + x);
      if (r.lo > r.hi && got != 0.0f) ++per[t].bad;
      compare(per[t], got, r.dq64[size_t(x)], r.dqr[size_t(x)]);
    }
  });
  for (const Check& x : per) cq.merge(x);
}

// Every element of the tensor finite, padding untouched: returns the number
// of violations.
int64_t check_written(const Problem& p, const std::vector<uint16_t>& buf, bool q_side) {
  const Case& c = p.c;
  const uint16_t poison = poison_half(c.dtype);
  std::vector<uint8_t> inside(buf.size(), 0);
  int64_t bad = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t len = q_side ? p.lq(b) : p.lk(b), heads = q_side ? c.hq : c.hkv;
    for (int64_t s = 0; s < len; ++s)
      for (int64_t hh = 0; hh < heads; ++hh) {
        const int64_t o = q_side ? p.off_q(b, s, hh) : p.off_k(b, s, hh);
        for (int64_t x = 0; x < c.d; ++x) {
          inside[size_t(o + x)] = 1;
          if (!std::isfinite(from_half(c.dtype, buf[size_t(o + x)]))) ++bad;
        }
      }
  }
  for (size_t i = 0; i < buf.size(); ++i)
    if (!inside[i] && buf[i] != poison) ++bad;
  return bad;
}

// max |a - b| over the tensor's elements.
double max_diff(const Problem& p, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                bool q_side, double* max_abs = nullptr) {
  const Case& c = p.c;
  double m = 0, mx = 0;
  for (int64_t bb = 0; bb < c.batch; ++bb) {
    const int64_t len = q_side ? p.lq(bb) : p.lk(bb), heads = q_side ? c.hq : c.hkv;
    for (int64_t s = 0; s < len; ++s)
      for (int64_t hh = 0; hh < heads; ++hh) {
        const int64_t o = q_side ? p.off_q(bb, s, hh) : p.off_k(bb, s, hh);
        for (int64_t x = 0; x < c.d; ++x) {
          const double u = from_half(c.dtype, a[size_t(o + x)]), w = from_half(c.dtype, b[size_t(o + x)]);
          const double e = std::fabs(u - w);
          m = std::max(m, std::isnan(e) ? double(INFINITY) : e);
          mx = std::max(mx, std::fabs(w));
        }
      }
  }
  if (max_abs) *max_abs = mx;
  return m;
}

// The CUDA buffers of one problem: inputs uploaded once, forward run once.
struct Device {
  DeviceBuf q, k, v, o, d_o, lse, dq, dk, dv;
  Device(const Problem& p)
      : q(p.tq.elems * 2), k(p.tk.elems * 2), v(p.tk.elems * 2), o(p.tq.elems * 2),
        d_o(p.tq.elems * 2), lse(size_t(std::max<int64_t>(p.lse_elems(), 1)) * 4),
        dq(p.tq.elems * 2), dk(p.tk.elems * 2), dv(p.tk.elems * 2) {}
};

// Runs the backward of `plan` with poisoned outputs and workspace; returns the gradients.
Grads run_backward(const Problem& p, attn_plan_t plan, Device& dev, cudaStream_t s) {
  const uint16_t poison = poison_half(p.c.dtype);
  const std::vector<uint16_t> pq(p.tq.elems, poison), pk(p.tk.elems, poison);
  dev.dq.upload(pq.data());
  dev.dk.upload(pk.data());
  dev.dv.upload(pk.data());
  size_t wsb = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &wsb));
  DeviceBuf ws(wsb);
  GPU_CHECK(cudaMemset(ws.p, 0xff, std::max<size_t>(wsb, 16)));  // NaN everywhere
  // The copies and the memset above run on the legacy default stream, which
  // a non-blocking stream does not wait for.
  GPU_CHECK(cudaDeviceSynchronize());
  ATTN_CHECK(attn_backward(plan, dev.q.p, dev.k.p, dev.v.p, dev.o.p,
                           static_cast<const float*>(dev.lse.p), dev.d_o.p, dev.dq.p, dev.dk.p,
                           dev.dv.p, wsb ? ws.p : nullptr, wsb, s));
  GPU_CHECK(cudaStreamSynchronize(s));
  GPU_CHECK(cudaGetLastError());
  Grads g;
  g.dq.resize(p.tq.elems), g.dk.resize(p.tk.elems), g.dv.resize(p.tk.elems);
  dev.dq.download(g.dq.data());
  dev.dk.download(g.dk.data());
  dev.dv.download(g.dv.data());
  return g;
}

void run_case(const Case& c0, attn_context_t cuda_ctx, attn_context_t cpu_ctx) {
  if (g_quick && c0.big) return;
  if (g_filter != nullptr && c0.name.find(g_filter) == std::string::npos) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::mt19937_64 rng(g_seed ^ std::hash<std::string>{}(c0.name));
  const Problem p = make_problem(c0);
  const Case& c = p.c;

  Host h;
  const uint16_t poison = poison_half(c.dtype);
  h.q.assign(p.tq.elems, poison);
  h.d_o.assign(p.tq.elems, poison);
  h.k.assign(p.tk.elems, poison);
  h.v.assign(p.tk.elems, poison);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t s = 0; s < p.lq(b); ++s)
      for (int64_t hh = 0; hh < c.hq; ++hh)
        for (int64_t x = 0; x < c.d; ++x) {
          h.q[size_t(p.off_q(b, s, hh) + x)] = to_half(c.dtype, c.qmul * nd(rng));
          h.d_o[size_t(p.off_q(b, s, hh) + x)] = to_half(c.dtype, nd(rng));
        }
    for (int64_t s = 0; s < p.lk(b); ++s)
      for (int64_t hh = 0; hh < c.hkv; ++hh)
        for (int64_t x = 0; x < c.d; ++x) {
          h.k[size_t(p.off_k(b, s, hh) + x)] = to_half(c.dtype, nd(rng));
          h.v[size_t(p.off_k(b, s, hh) + x)] = to_half(c.dtype, nd(rng));
        }
  }

  attn_plan_t plan = build_plan(p, cuda_ctx, false);
  attn_plan_t plan_det = build_plan(p, cuda_ctx, true);
  {
    const bool want = expects_bwd_sm90(c);
    const attn_plan_info_t info = describe(plan), info_det = describe(plan_det);
    if ((std::strstr(info.kernel, "+bwd-wgmma-") != nullptr) != want ||
        (std::strstr(info_det.kernel, "+bwd-wgmma-") != nullptr) != want ||
        std::strstr(info_det.kernel, "-det") == nullptr) {
      std::printf("FAIL %s: backward kernels %s and (deterministic) %s, expected %s\n",
                  c.name.c_str(), info.kernel, info_det.kernel,
                  want ? "the sm_90a dK/dV kernel" : "the sm_80 ones");
      ++g_failures;
    }
  }
  Device dev(p);
  dev.q.upload(h.q.data());
  dev.k.upload(h.k.data());
  dev.v.upload(h.v.data());
  dev.d_o.upload(h.d_o.data());
  const std::vector<uint16_t> pq(p.tq.elems, poison);
  dev.o.upload(pq.data());
  GPU_CHECK(cudaDeviceSynchronize());  // the uploads before work on a non-blocking stream
  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  size_t fws = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fws));
  DeviceBuf fwork(fws);
  ATTN_CHECK(attn_forward(plan, dev.q.p, dev.k.p, dev.v.p, dev.o.p, static_cast<float*>(dev.lse.p),
                          fws ? fwork.p : nullptr, fws, stream));
  GPU_CHECK(cudaStreamSynchronize(stream));
  h.o.resize(p.tq.elems);
  dev.o.download(h.o.data());
  h.lse.resize(size_t(std::max<int64_t>(p.lse_elems(), 1)));
  dev.lse.download(h.lse.data());

  const Grads g[2] = {run_backward(p, plan, dev, stream), run_backward(p, plan_det, dev, stream)};
  GPU_CHECK(cudaStreamDestroy(stream));
  attn_plan_destroy(plan);
  attn_plan_destroy(plan_det);

  // CPU backend on the same inputs (and the CUDA forward's O and LSE).
  Grads gc;
  if (c.vs_cpu) {
    attn_plan_t cplan = build_plan(p, cpu_ctx, false);
    size_t cws = 0;
    ATTN_CHECK(attn_plan_workspace_size(cplan, ATTN_PASS_BACKWARD, &cws));
    std::vector<char> work(cws + 64);
    gc.dq.assign(p.tq.elems, poison), gc.dk.assign(p.tk.elems, poison), gc.dv.assign(p.tk.elems, poison);
    ATTN_CHECK(attn_backward(cplan, h.q.data(), h.k.data(), h.v.data(), h.o.data(), h.lse.data(),
                             h.d_o.data(), gc.dq.data(), gc.dk.data(), gc.dv.data(),
                             cws ? work.data() : nullptr, cws, nullptr));
    attn_plan_destroy(cplan);
  }

  const double atol = atol_for(c.dtype);
  const char* names[3] = {"dQ", "dK", "dV"};
  bool all_ok = true;
  std::string line;
  for (int v = 0; v < 2; ++v) {
    const Grads& gg = g[v];
    const int64_t unwritten = check_written(p, gg.dq, true) + check_written(p, gg.dk, false) +
                              check_written(p, gg.dv, false);
    Check ck[3];
    if (c.sample == 0) {
      check_full(p, h, gg, ck);
    } else {
      check_sampled(p, h, gg, rng, ck[0]);
    }
    bool ok = unwritten == 0;
    char buf[512];
    int n = std::snprintf(buf, sizeof buf, "\n     %-6s", v ? "det" : "atomic");
    const int checked = c.sample == 0 ? 3 : 1;
    for (int t = 0; t < checked; ++t) {
      const double tol = 2.0 * ck[t].err_plain + atol;
      const bool tok = ck[t].err <= tol && ck[t].bad == 0;
      ok = ok && tok;
      n += std::snprintf(buf + n, sizeof buf - size_t(n), " %s %.2e/%.2e%s", names[t], ck[t].err,
                         tol, tok ? "" : (ck[t].bad ? "(BAD)" : "(!)"));
    }
    if (c.vs_cpu) {
      const std::vector<uint16_t>* mine[3] = {&gg.dq, &gg.dk, &gg.dv};
      const std::vector<uint16_t>* cpu[3] = {&gc.dq, &gc.dk, &gc.dv};
      n += std::snprintf(buf + n, sizeof buf - size_t(n), " | cpu");
      for (int t = 0; t < 3; ++t) {
        double mx = 0;
        const double diff = max_diff(p, *mine[t], *cpu[t], t == 0, &mx);
        // Full reference: the kernel's budget on every element. Sampled: the
        // CPU backend (fp32, rounded outputs) within 2^-6 (bf16) / 2^-9
        // (fp16) of the largest element, a few times the dtype's rounding.
        const double tol = c.sample == 0 ? 3.0 * ck[t].err_plain + 2.0 * atol
                                         : (c.dtype == ATTN_DTYPE_BF16 ? 0x1p-6 : 0x1p-9) * mx + atol;
        const bool tok = diff <= tol;
        ok = ok && tok;
        n += std::snprintf(buf + n, sizeof buf - size_t(n), " %s %.2e/%.2e%s", names[t], diff, tol,
                           tok ? "" : "(!)");
      }
    }
    if (unwritten) std::snprintf(buf + n, sizeof buf - size_t(n), " unwritten/clobbered %" PRId64, unwritten);
    line += buf;
    all_ok = all_ok && ok;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s %-44s %.1fs%s\n", all_ok ? "ok  " : "FAIL", c.name.c_str(), secs, line.c_str());
  if (!all_ok) ++g_failures;
  std::fflush(stdout);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  const attn_dtype_t dts[2] = {ATTN_DTYPE_BF16, ATTN_DTYPE_FP16};
  const char* dn[2] = {"bf16", "fp16"};
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
      x.mask = ATTN_MASK_WINDOW, x.wl = 100, x.wr = 50, x.big = true;
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
  struct W {
    int64_t lq, lk, l, r;
    bool empty;
  };
  const W ws[] = {{3, 5, 1, 0, false},       {1000, 1000, 0, 0, false},   {1000, 1000, 1, 0, false},
                  {1000, 1000, 0, 1, false},  {1000, 1000, -1, 2, false},  {1000, 1000, 5, -1, false},
                  {300, 300, 63, 0, false},   {300, 300, 64, 64, false},   {300, 300, 127, 0, false},
                  {129, 129, 1000, 1000, false}, {200, 64, 0, 0, true},    {64, 200, 3, 3, false},
                  {129, 7, -1, 0, true},      {300, 300, 0, 127, false}};
  for (const W& w : ws) {
    Case x = b;
    x.name = "window(" + std::to_string(w.l) + "," + std::to_string(w.r) + ")-" +
             std::to_string(w.lq) + "x" + std::to_string(w.lk);
    x.lq = w.lq, x.lk = w.lk, x.mask = ATTN_MASK_WINDOW, x.wl = w.l, x.wr = w.r, x.hq = 2, x.hkv = 1;
    x.allow_empty = w.empty;
    x.big = w.lq * w.lk > 100000;
    add(x);
  }
  for (auto hh : {std::pair<int64_t, int64_t>{8, 8}, {8, 2}, {16, 2}, {8, 1}}) {
    Case x = b;
    x.name = "causal-gqa" + std::to_string(hh.first) + "/" + std::to_string(hh.second) + "-L257";
    x.hq = hh.first, x.hkv = hh.second, x.lq = x.lk = 257, x.mask = ATTN_MASK_CAUSAL;
    add(x);
  }
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
    x.allow_empty = true, x.dtype = ATTN_DTYPE_BF16;
    add(x);
    x.name = "none-0x300", x.mask = ATTN_MASK_NONE, x.lq = 0, x.lk = 300, x.allow_empty = false;
    add(x);
  }
  {
    Case x = b;
    x.name = "varlen-causal-gqa", x.hq = 4, x.hkv = 2, x.mask = ATTN_MASK_CAUSAL;
    x.seq_q = {5, 0, 130, 64, 1, 300}, x.seq_kv = {7, 3, 200, 0, 1, 129}, x.allow_empty = true;
    add(x);
    x.name = "varlen-none-fp16-d64-padded", x.d = 64, x.dtype = ATTN_DTYPE_FP16,
    x.mask = ATTN_MASK_NONE, x.padded = true, x.seq_q = {17, 0, 256, 1},
    x.seq_kv = {300, 9, 64, 1}, x.allow_empty = false;
    add(x);
    x.name = "varlen-window-d96", x.d = 96, x.dtype = ATTN_DTYPE_BF16, x.mask = ATTN_MASK_WINDOW,
    x.wl = 17, x.wr = 3, x.padded = false, x.seq_q = {200, 129, 3}, x.seq_kv = {190, 300, 3};
    x.allow_empty = true;
    add(x);
    x.name = "varlen-causal-d256-padded-fp16", x.d = 256, x.dtype = ATTN_DTYPE_FP16,
    x.mask = ATTN_MASK_CAUSAL, x.padded = true, x.seq_q = {70, 0, 33}, x.seq_kv = {100, 5, 0};
    add(x);
  }
  {
    Case x = b;
    x.name = "softcap30-causal-q4", x.softcap = 30.0f, x.qmul = 4.0f, x.mask = ATTN_MASK_CAUSAL,
    x.lq = x.lk = 333, x.hq = 2, x.hkv = 1;
    add(x);
    x.name = "softcap5-none-d256-fp16", x.softcap = 5.0f, x.qmul = 2.0f, x.d = 256,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_NONE, x.lq = 200, x.lk = 257;
    add(x);
    x.name = "softcap10-window-d64", x.softcap = 10.0f, x.qmul = 3.0f, x.d = 64,
    x.dtype = ATTN_DTYPE_BF16, x.mask = ATTN_MASK_WINDOW, x.wl = 40, x.wr = 10, x.lq = 300,
    x.lk = 280, x.allow_empty = true;
    add(x);
    // More of the sm_90a kernel's softcap instantiation: fp16 at d = 64 and
    // 128, GQA, varlen, a cap that barely bends and one that saturates.
    x.name = "softcap50-causal-d64-fp16-gqa2", x.softcap = 50.0f, x.qmul = 1.0f,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_CAUSAL, x.hq = 4, x.hkv = 2, x.lq = x.lk = 260,
    x.allow_empty = false;
    add(x);
    x.name = "softcap3-none-d128-fp16-150x333", x.softcap = 3.0f, x.qmul = 3.0f, x.d = 128,
    x.mask = ATTN_MASK_NONE, x.hq = x.hkv = 2, x.lq = 150, x.lk = 333;
    add(x);
    x = b;
    x.name = "softcap12-varlen-causal-d64", x.softcap = 12.0f, x.qmul = 2.0f, x.d = 64,
    x.mask = ATTN_MASK_CAUSAL, x.hq = 2, x.hkv = 1, x.seq_q = {129, 0, 200, 64},
    x.seq_kv = {129, 7, 300, 64}, x.allow_empty = true;
    add(x);
    // A cap far above the logits (see the forward's case): the sm_90a dK/dV
    // instantiation at d = 64 and the sm_80 kernels (varlen, d = 128).
    x = b;
    x.name = "softcap1e5-causal-d64-fp16-gqa2", x.softcap = 1e5f, x.d = 64,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_CAUSAL, x.hq = 4, x.hkv = 2, x.lq = x.lk = 260;
    add(x);
    x = b;
    x.name = "softcap1e5-varlen-causal-d128-fp16", x.softcap = 1e5f, x.d = 128,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_CAUSAL, x.seq_q = {90, 140},
    x.seq_kv = {90, 300}, x.allow_empty = false;
    add(x);
    x = b;
    x.name = "peaky-q8-fp16-scale0.3", x.qmul = 8.0f, x.scale = 0.3f, x.dtype = ATTN_DTYPE_FP16,
    x.lq = x.lk = 200, x.mask = ATTN_MASK_CAUSAL;
    add(x);
  }
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
      }
  // d = 64 (the sm_90a kernel's 128-row query tiles) with strides, odd
  // lengths over several tiles, and a window over unequal lengths.
  for (attn_layout_t lay : {ATTN_LAYOUT_BSHD, ATTN_LAYOUT_BHSD}) {
    Case x = b;
    x.dtype = lay == ATTN_LAYOUT_BSHD ? ATTN_DTYPE_FP16 : ATTN_DTYPE_BF16;
    x.layout = lay, x.padded = true, x.batch = 2, x.hq = 6, x.hkv = 2, x.lq = 300, x.lk = 517;
    x.mask = ATTN_MASK_CAUSAL, x.d = 64;
    x.name = std::string(lay == ATTN_LAYOUT_BSHD ? "bshd" : "bhsd") + "-padded-d64-causal-300x517";
    add(x);
  }
  {
    Case x = b;
    x.name = "window(70,20)-d64-bf16-400x260", x.d = 64, x.lq = 400, x.lk = 260, x.hq = 2,
    x.hkv = 1, x.mask = ATTN_MASK_WINDOW, x.wl = 70, x.wr = 20, x.allow_empty = true;
    add(x);
  }
  // Larger shapes: sampled dQ rows against fp64, everything against the CPU backend.
  {
    Case x = b;
    x.big = true, x.sample = 24;
    x.name = "big-causal-L16K-gqa2-bf16", x.lq = x.lk = 16384, x.hq = 2, x.hkv = 1,
    x.mask = ATTN_MASK_CAUSAL;
    add(x);
    x.name = "big-window(1024,0)-L8K-fp16-d64", x.lq = x.lk = 8192, x.d = 64,
    x.dtype = ATTN_DTYPE_FP16, x.mask = ATTN_MASK_WINDOW, x.wl = 1024, x.wr = 0;
    add(x);
    x.name = "big-none-2000x3001-bf16-d64-gqa4/2", x.lq = 2000, x.lk = 3001, x.d = 64, x.hq = 4,
    x.hkv = 2, x.dtype = ATTN_DTYPE_BF16, x.mask = ATTN_MASK_NONE;
    add(x);
    x.name = "big-none-L4K-fp16-d128", x.lq = x.lk = 4096, x.d = 128, x.hq = 2, x.hkv = 2,
    x.dtype = ATTN_DTYPE_FP16;
    add(x);
    x.name = "big-none-4Kx3K-bf16-d256", x.lq = 4096, x.lk = 3000, x.d = 256, x.hq = 1, x.hkv = 1,
    x.dtype = ATTN_DTYPE_BF16, x.mask = ATTN_MASK_NONE;
    add(x);
  }
  return v;
}

void expect(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++g_failures;
}

// A deterministic plan's backward, repeated, gives the same bits; forward +
// backward captured in a CUDA graph and replayed give the bits of a direct
// run (and the default plan's replay stays within rounding of it).
void test_determinism_and_graph(attn_context_t ctx) {
  Case c;
  c.name = "det", c.batch = 2, c.hq = 8, c.hkv = 2, c.lq = 777, c.lk = 901, c.d = 128,
  c.mask = ATTN_MASK_CAUSAL;
  const Problem p = make_problem(c);
  std::mt19937_64 rng(g_seed + 11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> hq(p.tq.elems), hk(p.tk.elems), hv(p.tk.elems), hdo(p.tq.elems);
  for (auto* buf : {&hq, &hk, &hv, &hdo})
    for (auto& x : *buf) x = to_half(c.dtype, nd(rng));
  Device dev(p);
  dev.q.upload(hq.data()), dev.k.upload(hk.data()), dev.v.upload(hv.data()), dev.d_o.upload(hdo.data());
  GPU_CHECK(cudaDeviceSynchronize());  // the uploads before work on a non-blocking stream
  cudaStream_t s;
  GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int det = 1; det >= 0; --det) {
    attn_plan_t plan = build_plan(p, ctx, det == 1);
    size_t wsb = 0;
    ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &wsb));
    DeviceBuf ws(wsb);
    auto snapshot = [&] {
      std::vector<uint16_t> out(p.tq.elems + 2 * p.tk.elems);
      GPU_CHECK(cudaStreamSynchronize(s));
      dev.dq.download(out.data());
      dev.dk.download(out.data() + p.tq.elems);
      dev.dv.download(out.data() + p.tq.elems + p.tk.elems);
      return out;
    };
    auto poison = [&] {
      GPU_CHECK(cudaMemsetAsync(dev.dq.p, 0xff, dev.dq.bytes, s));
      GPU_CHECK(cudaMemsetAsync(dev.dk.p, 0xff, dev.dk.bytes, s));
      GPU_CHECK(cudaMemsetAsync(dev.dv.p, 0xff, dev.dv.bytes, s));
      GPU_CHECK(cudaMemsetAsync(ws.p, 0xff, std::max<size_t>(wsb, 16), s));
    };
    auto fwd_bwd = [&] {
      attn_status_t st = attn_forward(plan, dev.q.p, dev.k.p, dev.v.p, dev.o.p,
                                      static_cast<float*>(dev.lse.p), nullptr, 0, s);
      if (st != ATTN_STATUS_SUCCESS) return st;
      return attn_backward(plan, dev.q.p, dev.k.p, dev.v.p, dev.o.p,
                           static_cast<const float*>(dev.lse.p), dev.d_o.p, dev.dq.p, dev.dk.p,
                           dev.dv.p, ws.p, wsb, s);
    };
    poison();
    ATTN_CHECK(fwd_bwd());
    const std::vector<uint16_t> first = snapshot();
    if (det) {
      int same = 0;
      for (int r = 0; r < 50; ++r) {
        poison();
        ATTN_CHECK(attn_backward(plan, dev.q.p, dev.k.p, dev.v.p, dev.o.p,
                                 static_cast<const float*>(dev.lse.p), dev.d_o.p, dev.dq.p,
                                 dev.dk.p, dev.dv.p, ws.p, wsb, s));
        same += snapshot() == first;
      }
      std::printf("     deterministic backward: %d/50 repeats bit-identical\n", same);
      expect(same == 50, "deterministic plan: 50 backward runs bit-identical");
    }
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    GPU_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    const attn_status_t st = fwd_bwd();
    const std::string why = attn_last_error_message();  // before later calls reset it
    GPU_CHECK(cudaStreamEndCapture(s, &graph));
    bool ok = st == ATTN_STATUS_SUCCESS;
    double diff = 0;
    if (ok) {
      GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      poison();
      GPU_CHECK(cudaGraphLaunch(exec, s));
      GPU_CHECK(cudaGraphLaunch(exec, s));
      const std::vector<uint16_t> replay = snapshot();
      GPU_CHECK(cudaGraphExecDestroy(exec));
      if (det) {
        ok = replay == first;
      } else {
        // Atomics: the summation order may differ, by a rounding or so.
        for (size_t i = 0; i < replay.size(); ++i) {
          const double a = from_half(c.dtype, replay[i]), e0 = from_half(c.dtype, first[i]);
          const double e = std::fabs(a - e0) / (std::max(std::fabs(a), std::fabs(e0)) + 1e-3);
          diff = std::max(diff, std::isnan(e) ? double(INFINITY) : e);
        }
        ok = diff <= 0x1p-6;
      }
    }
    GPU_CHECK(cudaGraphDestroy(graph));
    char what[160];
    std::snprintf(what, sizeof what, "%s plan: forward + backward graph replay == direct run%s (max rel diff %.1e)%s",
                  det ? "deterministic" : "default", det ? ", bitwise" : "", diff,
                  why.c_str());
    expect(ok, what);
    attn_plan_destroy(plan);
  }
  GPU_CHECK(cudaStreamDestroy(s));
}

void test_describe_and_errors(attn_context_t ctx) {
  Case c;
  c.lq = 100, c.lk = 120, c.d = 128, c.hq = 4, c.hkv = 2, c.batch = 3;
  const Problem p = make_problem(c);
  for (int det = 0; det < 2; ++det) {
    attn_plan_t plan = build_plan(p, ctx, det == 1);
    attn_plan_info_t info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    ATTN_CHECK(attn_plan_describe(plan, &info));
    char line[600];
    ATTN_CHECK(attn_plan_summary(plan, line, sizeof line, nullptr));
    std::printf("     %s\n", line);
    const uint64_t delta = (uint64_t(3 * 4 * 100) * 4 + 255) / 256 * 256;
    const uint64_t accum = det ? 0 : uint64_t(3 * 100) * 4 * 128 * 4;
    // A problem this small splits its group of 2 over two dK/dV blocks,
    // unless deterministic or ATTN_CUDA_BWD_GROUP_SPLIT=1 asks for one:
    // then fp32 dK and dV accumulators [3 * 120][2][128] join the workspace.
    const char* split_env = std::getenv("ATTN_CUDA_BWD_GROUP_SPLIT");
    const bool split = !det && (split_env == nullptr || std::atoi(split_env) >= 2);
    const uint64_t kv_accum = split ? 2 * uint64_t(3 * 120) * 2 * 128 * 4 : 0;
    const bool ok = info.supports_backward == 1 && std::strstr(info.kernel, "+bwd-") &&
                    (det ? std::strstr(info.kernel, "-det") != nullptr
                         : std::strstr(info.kernel, "-atomic") || std::strstr(info.kernel, "-bulk")) &&
                    (std::strstr(info.kernel, "-gs2") != nullptr) == split &&
                    info.workspace_bytes_forward == 0 &&
                    info.workspace_bytes_backward == 2 * delta + accum + kv_accum;
    expect(ok, det ? "describe: deterministic backward variant and workspace"
                   : "describe: atomic backward variant and workspace");
    if (!det) {
      DeviceBuf buf(p.tq.elems * 2 + p.tk.elems * 4 + info.workspace_bytes_backward + 64);
      char* base = static_cast<char*>(buf.p);
      const attn_status_t s1 =
          attn_backward(plan, base, base, base, base, reinterpret_cast<const float*>(base), base,
                        base, base, base, base, info.workspace_bytes_backward - 1, nullptr);
      expect(s1 == ATTN_STATUS_WORKSPACE_TOO_SMALL, "short workspace -> WORKSPACE_TOO_SMALL");
      const attn_status_t s2 =
          attn_backward(plan, base, base, base, base, reinterpret_cast<const float*>(base), base,
                        base, base, base, base + 8, info.workspace_bytes_backward, nullptr);
      expect(s2 == ATTN_STATUS_INVALID_ARGUMENT &&
                 std::strstr(attn_last_error_message(), "workspace") != nullptr,
             "misaligned workspace -> INVALID_ARGUMENT naming workspace");
    }
    attn_plan_destroy(plan);
  }
  attn_plan_desc_t d;
  ATTN_CHECK(attn_plan_desc_create(&d));
  const attn_status_t s = attn_plan_desc_set_deterministic(d, 2);
  expect(s == ATTN_STATUS_INVALID_ARGUMENT &&
             std::strstr(attn_last_error_message(), "deterministic") != nullptr,
         "attn_plan_desc_set_deterministic(2) -> INVALID_ARGUMENT naming deterministic");
  attn_plan_desc_destroy(d);
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
  {
    int dev = 0;
    cudaDeviceProp prop{};
    GPU_CHECK(cudaGetDevice(&dev));
    GPU_CHECK(cudaGetDeviceProperties(&prop, dev));
    const char* env = std::getenv("ATTN_CUDA_BWD_SM90");
    g_bwd_sm90 = prop.major == 9 && prop.minor == 0 && !(env && std::strcmp(env, "0") == 0) &&
                 std::getenv("ATTN_CUDA_BWD_VARIANT") == nullptr;
    std::printf("device sm_%d%d: default dK/dV kernel at d = 64, 128: %s\n", prop.major, prop.minor,
                g_bwd_sm90 ? "sm_90a (wgmma)" : "sm_80");
  }
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)%s\n", g_seed, g_seed,
              g_quick ? ", quick" : "");
  std::printf("per case: err/tol vs fp64 of dQ, dK, dV (sampled: dQ rows only), then vs the CPU "
              "backend, for the atomic and the deterministic plan\n");

  attn_context_t cuda_ctx = nullptr, cpu_ctx = nullptr;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &cuda_ctx));
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CPU, 0, 0, &cpu_ctx));

  if (g_filter == nullptr) test_describe_and_errors(cuda_ctx);
  for (const Case& c : cases()) run_case(c, cuda_ctx, cpu_ctx);
  if (!g_quick && g_filter == nullptr) test_determinism_and_graph(cuda_ctx);

  attn_context_destroy(cpu_ctx);
  attn_context_destroy(cuda_ctx);
  std::printf("%s: %d failure(s), seed %" PRIu64 "\n", g_failures ? "FAILED" : "PASSED", g_failures,
              g_seed);
  return g_failures ? 1 : 0;
}
