// What the sparse GPU tests (test_block_sparse_gpu, test_moba_gpu) share:
// phase one runs a case's forward and backward passes on the device, phase
// two compares them with the fp64 reference of tests/common on the host, the
// cases' references in parallel. Each test chooses the inputs, the plans and
// the reference's mask; the checks and the report are the same.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_common.hpp"
#include "reference.h"

namespace gpu_test {

// The seed of this run: ATTN_TEST_SEED, else a fresh one; printed.
inline uint64_t test_seed() {
  const char* env = std::getenv("ATTN_TEST_SEED");
  const uint64_t seed =
      env ? std::strtoull(env, nullptr, 10) : std::random_device{}() * 2654435761ull;
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)\n", seed, seed);
  return seed;
}

// The cases whose name contains ATTN_GPU_TEST_FILTER (all without it).
template <class C>
std::vector<C> filtered(const std::vector<C>& cases) {
  const char* filter = std::getenv("ATTN_GPU_TEST_FILTER");
  std::vector<C> all;
  for (const C& c : cases)
    if (filter == nullptr || c.name.find(filter) != std::string::npos) all.push_back(c);
  return all;
}

// One tensor kind's comparison with the reference.
struct Err {
  double err = 0, plain = 0, ref_max = 0;
  int64_t bad = 0;  // non-finite, unwritten, or nonzero where exactly zero is required
};

struct Outcome {
  std::string line;
  bool ok = true;
};

// Whether a case checks only its forward pass (a case type's `fwd_only`;
// false for types without one). Such a case's backward is neither run nor
// referenced: large cases of the forward's scheduling, whose fp64
// backward reference would take minutes.
template <class C>
bool fwd_only_case(const C& c) {
  if constexpr (requires { c.fwd_only; })
    return c.fwd_only;
  else
    return false;
}

// What phase one (the device) leaves for phase two (the host reference).
template <class C>
struct SparseRun {
  CaseProblem<C> p;
  std::vector<uint16_t> q, k, v, d_o, o;  // dtype bits
  std::vector<float> lse;
  std::vector<uint16_t> grads[2][3];  // atomic, det: dQ, dK, dV
  bool det_repeatable = true;
  std::string describe_error;
};

// Fills r.q, r.d_o, r.k and r.v (dtype bits; padding: the poison pattern)
// with gen_*(b, s, h, x), called per sequence b in this order: the query
// rows (Q before dO at each element), then the key rows (K before V).
template <class C, class GQ, class GDO, class GK, class GV>
void fill_inputs(SparseRun<C>& r, GQ&& gen_q, GDO&& gen_do, GK&& gen_k, GV&& gen_v) {
  const CaseProblem<C>& p = r.p;
  const C& c = p.c;
  const uint16_t poison = poison_half(c.dtype);
  r.q.assign(p.tq.elems, poison), r.d_o.assign(p.tq.elems, poison);
  r.k.assign(p.tk.elems, poison), r.v.assign(p.tk.elems, poison);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t s = 0; s < p.lq(b); ++s)
      for (int64_t h = 0; h < c.hq; ++h)
        for (int64_t x = 0; x < c.d; ++x) {
          r.q[size_t(p.off_q(b, s, h) + x)] = gen_q(b, s, h, x);
          r.d_o[size_t(p.off_q(b, s, h) + x)] = gen_do(b, s, h, x);
        }
    for (int64_t s = 0; s < p.lk(b); ++s)
      for (int64_t h = 0; h < c.hkv; ++h)
        for (int64_t x = 0; x < c.d; ++x) {
          r.k[size_t(p.off_k(b, s, h) + x)] = gen_k(b, s, h, x);
          r.v[size_t(p.off_k(b, s, h) + x)] = gen_v(b, s, h, x);
        }
  }
}

// The device runs of a case on its inputs, with plans[0] (dQ by atomics)
// and plans[1] (deterministic): the forward of plans[0] once, the backward
// of plans[0] once and of plans[1] three times (r.det_repeatable: the three
// bit-identical). Outputs and workspaces are poisoned (NaN) before every
// run; a pass without workspace gets none (null).
template <class C>
void run_passes(SparseRun<C>& r, const attn_plan_t (&plans)[2]) {
  const CaseProblem<C>& p = r.p;
  const uint16_t poison = poison_half(p.c.dtype);
  DeviceBuf q(p.tq.elems * 2), k(p.tk.elems * 2), v(p.tk.elems * 2), o(p.tq.elems * 2),
      d_o(p.tq.elems * 2), lse(size_t(p.lse_elems()) * 4 + 16), dq(p.tq.elems * 2),
      dk(p.tk.elems * 2), dv(p.tk.elems * 2);
  q.upload(r.q.data()), k.upload(r.k.data()), v.upload(r.v.data()), d_o.upload(r.d_o.data());
  const std::vector<uint16_t> pq(p.tq.elems, poison), pk(p.tk.elems, poison);
  const std::vector<float> plse(size_t(p.lse_elems()) + 4, NAN);
  o.upload(pq.data());
  GPU_CHECK(cudaMemcpy(lse.p, plse.data(), plse.size() * 4, cudaMemcpyHostToDevice));
  size_t fwsb = 0;
  ATTN_CHECK(attn_plan_workspace_size(plans[0], ATTN_PASS_FORWARD, &fwsb));
  DeviceBuf fws(fwsb);
  GPU_CHECK(cudaMemset(fws.p, 0xff, std::max<size_t>(fwsb, 16)));  // NaN everywhere
  GPU_CHECK(cudaDeviceSynchronize());
  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ATTN_CHECK(attn_forward(plans[0], q.p, k.p, v.p, o.p, static_cast<float*>(lse.p),
                          fwsb ? fws.p : nullptr, fwsb, stream));
  GPU_CHECK(cudaStreamSynchronize(stream));
  GPU_CHECK(cudaGetLastError());
  r.o.resize(p.tq.elems);
  o.download(r.o.data());
  r.lse.resize(size_t(p.lse_elems()));
  GPU_CHECK(cudaMemcpy(r.lse.data(), lse.p, r.lse.size() * 4, cudaMemcpyDeviceToHost));

  for (int det = 0; det < (fwd_only_case(p.c) ? 0 : 2); ++det) {
    size_t wsb = 0;
    ATTN_CHECK(attn_plan_workspace_size(plans[det], ATTN_PASS_BACKWARD, &wsb));
    DeviceBuf ws(wsb);
    for (int rep = 0; rep < (det ? 3 : 1); ++rep) {
      dq.upload(pq.data()), dk.upload(pk.data()), dv.upload(pk.data());
      GPU_CHECK(cudaMemset(ws.p, 0xff, std::max<size_t>(wsb, 16)));  // NaN everywhere
      GPU_CHECK(cudaDeviceSynchronize());
      ATTN_CHECK(attn_backward(plans[det], q.p, k.p, v.p, o.p, static_cast<const float*>(lse.p),
                               d_o.p, dq.p, dk.p, dv.p, wsb ? ws.p : nullptr, wsb, stream));
      GPU_CHECK(cudaStreamSynchronize(stream));
      GPU_CHECK(cudaGetLastError());
      std::vector<uint16_t> g[3] = {std::vector<uint16_t>(p.tq.elems),
                                    std::vector<uint16_t>(p.tk.elems),
                                    std::vector<uint16_t>(p.tk.elems)};
      dq.download(g[0].data()), dk.download(g[1].data()), dv.download(g[2].data());
      if (rep == 0) {
        for (int t = 0; t < 3; ++t) r.grads[det][t] = std::move(g[t]);
      } else {
        for (int t = 0; t < 3; ++t)
          if (g[t] != r.grads[det][t]) r.det_repeatable = false;
      }
    }
  }
  GPU_CHECK(cudaStreamDestroy(stream));
}

inline ref_strides strides_of(const Tensor& t) { return {t.sb, t.ss, t.sh}; }

// The reference problem of a case without its masks: the caller sets the
// window and the pair mask.
template <class C>
ref_problem base_ref_problem(const CaseProblem<C>& p) {
  const C& c = p.c;
  ref_problem rp{};
  rp.batch = c.batch, rp.heads_q = c.hq, rp.heads_kv = c.hkv;
  rp.head_dim_qk = rp.head_dim_v = c.d;
  rp.cu_q = p.cu_q.data(), rp.cu_kv = p.cu_kv.data();
  rp.varlen = varlen(c) ? 1 : 0;
  rp.scale = p.scale;
  rp.softcap = c.softcap;
  rp.key_filter = nullptr;
  rp.q = rp.o = rp.d_o = rp.dq = strides_of(p.tq);
  rp.k = rp.v = rp.dk = rp.dv = strides_of(p.tk);
  return rp;
}

// A run's inputs in double, as the reference takes them.
struct Inputs64 {
  std::vector<double> q, k, v, d_o;
};

template <class C>
Inputs64 inputs64(const SparseRun<C>& r) {
  auto to_double = [&](const std::vector<uint16_t>& x) {
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = from_half(r.p.c.dtype, x[i]);
    return y;
  };
  return {to_double(r.q), to_double(r.k), to_double(r.v), to_double(r.d_o)};
}

// Phase two: the fp64 and the plain (ref_lowp_*) references of rp (masks
// set) on the inputs x, and the verdict on run r. `fwd_note` ends the
// parenthesis of the forward line.
template <class C>
Outcome judge_run(const SparseRun<C>& r, const ref_problem& rp, const Inputs64& x,
                  const std::string& fwd_note) {
  const CaseProblem<C>& p = r.p;
  const C& c = p.c;
  const double u = c.dtype == ATTN_DTYPE_BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  // As test_flash_fwd and test_flash_bwd.
  const double atol_f =
      c.dtype == ATTN_DTYPE_BF16 ? 2.0 * std::ldexp(1.0, -10) : 2.0 * std::ldexp(1.0, -13);
  const double atol_b = atol_f / 4.0;

  const double *q = x.q.data(), *k = x.k.data(), *v = x.v.data(), *d_o = x.d_o.data();
  const size_t nq = p.tq.elems, nk = p.tk.elems, nl = size_t(p.lse_elems());
  std::vector<double> o64(nq, 0.0), ol(nq, 0.0), lse64(nl), lsel(nl);
  ref_forward(&rp, q, k, v, o64.data(), lse64.data());
  ref_lowp_forward(&rp, c.dtype, q, k, v, ol.data(), lsel.data());
  const bool bwd = !fwd_only_case(c);
  const size_t gq = bwd ? nq : 0, gk = bwd ? nk : 0;
  std::vector<double> g64[3] = {std::vector<double>(gq, 0.0), std::vector<double>(gk, 0.0),
                                std::vector<double>(gk, 0.0)};
  std::vector<double> gl[3] = {std::vector<double>(gq, 0.0), std::vector<double>(gk, 0.0),
                               std::vector<double>(gk, 0.0)};
  std::vector<double> fq(gq, 0.0), fk(gk, 0.0);
  if (bwd) {
    ref_backward(&rp, q, k, v, d_o, g64[0].data(), g64[1].data(), g64[2].data());
    ref_lowp_backward(&rp, c.dtype, q, k, v, d_o, gl[0].data(), gl[1].data(), gl[2].data());
    ref_backward_o_rounding_floor(&rp, u, q, k, v, d_o, fq.data(), fk.data());
  }

  // Rows that see no key and keys no row sees.
  std::vector<uint8_t> row_any(size_t(c.batch * c.hq * c.lq)),
      key_any(size_t(c.batch * c.hkv * c.lk));
  // (Varlen: c.lq and c.lk are the longest sequence's, p.lq(b) and p.lk(b)
  // sequence b's.)
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < p.lq(b); ++i)
        row_any[size_t((b * c.hq + h) * c.lq + i)] = uint8_t(ref_row_sees_any_head(&rp, b, h, i));
    for (int64_t h = 0; h < c.hkv; ++h)
      for (int64_t j = 0; j < p.lk(b); ++j)
        key_any[size_t((b * c.hkv + h) * c.lk + j)] = uint8_t(ref_key_seen_head(&rp, b, h, j));
  }

  // Compares tensor `got` (dtype bits) over its rows; `zero(b, s, h)`: the
  // row must be exactly 0.
  auto compare = [&](const std::vector<uint16_t>& got, const std::vector<double>& ref,
                     const std::vector<double>& plain, bool q_side, auto&& zero) {
    Err e;
    const int64_t heads = q_side ? c.hq : c.hkv;
    std::vector<uint8_t> inside(got.size(), 0);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t s = 0; s < (q_side ? p.lq(b) : p.lk(b)); ++s)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t at = q_side ? p.off_q(b, s, h) : p.off_k(b, s, h);
          const bool z = zero(b, s, h);
          for (int64_t xi = 0; xi < c.d; ++xi) {
            const size_t i = size_t(at + xi);
            inside[i] = 1;
            const double g = from_half(c.dtype, got[i]);
            if (!std::isfinite(g) || (z && g != 0.0)) ++e.bad;
            e.err = std::max(e.err, std::isfinite(g) ? std::fabs(g - ref[i]) : double(INFINITY));
            e.plain = std::max(e.plain, std::fabs(plain[i] - ref[i]));
            e.ref_max = std::max(e.ref_max, std::fabs(ref[i]));
          }
        }
    const uint16_t poison = poison_half(c.dtype);
    for (size_t i = 0; i < got.size(); ++i)
      if (!inside[i] && got[i] != poison) ++e.bad;  // padding clobbered
    return e;
  };
  auto row_empty = [&](int64_t b, int64_t s, int64_t h) {
    return !row_any[size_t((b * c.hq + h) * c.lq + s)];
  };
  auto key_unseen = [&](int64_t b, int64_t s, int64_t h) {
    return !key_any[size_t((b * c.hkv + h) * c.lk + s)];
  };

  Outcome out;
  char buf[256];
  int64_t empty_rows = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < p.lq(b); ++i) empty_rows += row_empty(b, i, h);
  const Err eo = compare(r.o, o64, ol, true, row_empty);
  double lse_err = 0;
  int64_t lse_bad = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < p.lq(b); ++i) {
        const size_t at = size_t(p.lse_off(b, h, i));
        const double l = r.lse[at];
        if (row_empty(b, i, h)) {
          if (l != -INFINITY) ++lse_bad;
        } else if (!std::isfinite(l)) {
          ++lse_bad;
        } else {
          lse_err = std::max(lse_err, std::fabs(l - lse64[at]));
        }
      }
  const double tol_o = 2.0 * eo.plain + atol_f;
  const bool ok_o = eo.err <= tol_o && eo.bad == 0 && lse_err <= 2e-3 && lse_bad == 0;
  out.ok = ok_o;
  std::snprintf(buf, sizeof buf,
                "\n     fwd    O %.2e/%.2e%s LSE %.1e%s (empty rows %" PRId64 "%s)", eo.err,
                tol_o, eo.bad ? "(BAD)" : ok_o ? "" : "(!)", lse_err, lse_bad ? "(BAD)" : "",
                empty_rows, fwd_note.c_str());
  out.line += buf;

  double floor_q = 0, floor_k = 0;
  for (double f : fq) floor_q = std::max(floor_q, f);
  for (double f : fk) floor_k = std::max(floor_k, f);
  const char* names[3] = {"dQ", "dK", "dV"};
  const double floors[3] = {floor_q, floor_k, 0.0};
  if (!bwd) out.line += "\n     (forward only)";
  for (int det = 0; det < (bwd ? 2 : 0); ++det) {
    int n = std::snprintf(buf, sizeof buf, "\n     %-6s", det ? "det" : "atomic");
    double magnitude = 0;
    Err e[3];
    for (int t = 0; t < 3; ++t) {
      e[t] = t == 0 ? compare(r.grads[det][t], g64[t], gl[t], true, row_empty)
                    : compare(r.grads[det][t], g64[t], gl[t], false, key_unseen);
      magnitude = std::max(magnitude, e[t].ref_max);
    }
    for (int t = 0; t < 3; ++t) {
      const double tol = 2.0 * e[t].plain + atol_b * std::max(1.0, magnitude) + 2.0 * floors[t];
      const bool ok = e[t].err <= tol && e[t].bad == 0;
      out.ok = out.ok && ok;
      n += std::snprintf(buf + n, sizeof buf - size_t(n), " %s %.2e/%.2e%s", names[t], e[t].err,
                         tol, e[t].bad ? "(BAD)" : ok ? "" : "(!)");
    }
    if (det && !r.det_repeatable) {
      out.ok = false;
      std::snprintf(buf + n, sizeof buf - size_t(n), " NOT bit-identical over 3 runs");
    } else if (det) {
      std::snprintf(buf + n, sizeof buf - size_t(n), " (3 runs bit-identical)");
    }
    out.line += buf;
  }
  if (!r.describe_error.empty()) {
    out.ok = false;
    out.line += "\n     describe:" + r.describe_error;
  }
  return out;
}

// Runs the cases on the device one after another (run(case) gives a run),
// then the references (the slow part) in parallel, one case per thread,
// the largest cost(case) first; each verdict (judge(run) gives an Outcome)
// is printed as soon as it is known. Returns the number of failed cases.
template <class C, class RunFn, class JudgeFn, class CostFn>
int run_and_judge(const std::vector<C>& all, RunFn&& run, JudgeFn&& judge, CostFn&& cost) {
  using R = decltype(run(all[0]));
  std::vector<R> runs;
  runs.reserve(all.size());
  for (const C& c : all) runs.push_back(run(c));
  std::printf("device runs done (%zu cases); references:\n", runs.size());
  std::fflush(stdout);
  std::atomic<size_t> next{0};
  std::atomic<int> failed{0};
  std::mutex print;
  std::vector<std::thread> pool;
  const unsigned nt = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 16u));
  std::vector<size_t> order(runs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return cost(all[a]) > cost(all[b]); });
  for (unsigned t = 0; t < nt; ++t)
    pool.emplace_back([&] {
      for (size_t k; (k = next.fetch_add(1)) < runs.size();) {
        const auto t0 = std::chrono::steady_clock::now();
        const Outcome o = judge(runs[order[k]]);
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::lock_guard<std::mutex> lock(print);
        std::printf("%s %s (%.1fs)%s\n", o.ok ? "ok  " : "FAIL", all[order[k]].name.c_str(), secs,
                    o.line.c_str());
        std::fflush(stdout);
        if (!o.ok) ++failed;
      }
    });
  for (auto& th : pool) th.join();
  return failed.load();
}

}  // namespace gpu_test
