// MoBA plans (attn_plan_desc_set_moba) on the CUDA backend against a direct
// fp64 implementation of the rule: ref_moba_select (tests/common/reference.c)
// pools the keys of each block, gates every past block, takes the top_k
// (ties: lower block index) plus the own block, and the fp64 reference then
// runs with that selection materialised as a pair mask under the causal
// mask (S and P materialised in double).
//
// The selection must not depend on rounding, or the test could flake: Q and
// K are drawn from {-2, -1, 1, 2} and every block size is a power of two, so
// block means, gates and their sums over heads are exact in fp32 in any
// summation order, and the GPU's gates equal the fp64 ones, ties (which
// such data has plenty of) included. (The last block may be ragged, with an
// inexact mean, but it is never a past block of any row.) V and dO are
// normal.
//
// Cases: block sizes 128, 256 and 512 (lengths not multiples of them),
// top_k 0..12 and one above the number of blocks (plain causal), per-head and
// GQA-shared selection, MHA/GQA/MQA, lq < lk and lq > lk (rows that see no
// key), batch > 1, BHSD and padded strides, d = 64, 96, 128, 256, bf16 and
// fp16; independent random query rows, and "coherent" ones (runs of equal
// rows, which select alike, as neighbouring tokens of real text tend to).
// By default the forward and the dK/dV kernel walk the gathered row lists
// (the forward merging one block per launch into fp32 row states in the
// workspace); with ATTN_CUDA_MOBA_GATHER=0 (meson tests moba_gpu_union*)
// they walk the tile-union lists; describe must say which. Each runs the forward, the backward with dQ by atomics and the
// deterministic backward (three times: bit-identical). Tolerance as
// test_block_sparse_gpu (FlashAttention's rule): max |X - X_fp64| <=
// 2 * max |X_plain - X_fp64| + atol, X_plain from ref_lowp_* (every op
// rounded to the dtype, fp32 sums), for dQ and dK plus twice the error floor
// of O handed over in the dtype; LSE within 2e-3. Rows that see no key:
// O = 0, LSE = -inf, dQ = 0 exactly; keys no row sees: dK = dV = 0 exactly.
// Outputs and workspaces are poisoned (NaN) before every run, and every
// output element must be written. attn_plan_describe must name the MoBA
// kernels. Error paths: block sizes that are not multiples of 128 and top_k
// above 32 (NOT_SUPPORTED, naming the argument, no plan), a forward
// workspace one byte short (WORKSPACE_TOO_SMALL) or misaligned
// (INVALID_ARGUMENT), O and LSE untouched.
//
// Fresh random inputs every run (seed printed; ATTN_TEST_SEED=n repeats
// one). ATTN_GPU_TEST_FILTER=text runs only the cases whose name contains
// text. Exit 77 without a CUDA device.

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

using namespace gpu_test;

namespace {

struct Case : CaseShape {
  int64_t block = 128, top_k = 2;
  bool shared = false;
  bool coherent = false;  // query rows equal in runs of kCoherentRun
};
constexpr int64_t kCoherentRun = 96;
using Problem = CaseProblem<Case>;

uint64_t g_seed = 0;
bool g_gather = true;  // unless ATTN_CUDA_MOBA_GATHER=0: the kernels gather rows

struct Err {
  double err = 0, plain = 0, ref_max = 0;
  int64_t bad = 0;  // non-finite, unwritten, or nonzero where exactly zero is required
};

struct Outcome {
  std::string line;
  bool ok = true;
};

// What phase one (the device) leaves for phase two (the host reference).
struct Run {
  Problem p;
  std::vector<uint16_t> q, k, v, d_o, o;  // dtype bits
  std::vector<float> lse;
  std::vector<uint16_t> grads[2][3];  // atomic, det: dQ, dK, dV
  bool det_repeatable = true;
  std::string describe_error;
};

attn_plan_desc_t moba_desc(const Problem& p, bool deterministic) {
  attn_plan_desc_t pd = case_plan_desc(p, ATTN_TENSOR_DV + 1);
  ATTN_CHECK(attn_plan_desc_set_passes(pd, ATTN_PASSES_FORWARD_BACKWARD));
  ATTN_CHECK(attn_plan_desc_set_deterministic(pd, deterministic ? 1 : 0));
  ATTN_CHECK(attn_plan_desc_set_allow_empty_rows(pd, 1));
  ATTN_CHECK(attn_plan_desc_set_moba(pd, p.c.block, p.c.top_k, p.c.shared ? 1 : 0));
  return pd;
}

// Workspace of `bytes` poisoned with NaN (0xff bytes).
void poison(const DeviceBuf& ws) {
  GPU_CHECK(cudaMemset(ws.p, 0xff, std::max<size_t>(ws.bytes, 16)));
}

// Phase one: inputs and every CUDA run of a case.
Run run_device(const Case& c0, attn_context_t ctx) {
  std::mt19937_64 rng(g_seed ^ std::hash<std::string>{}(c0.name));
  Run r;
  r.p = make_problem(c0);
  const Problem& p = r.p;
  const Case& c = p.c;

  const uint16_t poison_bits = poison_half(c.dtype);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 3);
  const float small_ints[4] = {-2.0f, -1.0f, 1.0f, 2.0f};
  r.q.assign(p.tq.elems, poison_bits), r.d_o.assign(p.tq.elems, poison_bits);
  r.k.assign(p.tk.elems, poison_bits), r.v.assign(p.tk.elems, poison_bits);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t s = 0; s < c.lq; ++s)
      for (int64_t h = 0; h < c.hq; ++h)
        for (int64_t x = 0; x < c.d; ++x) {
          const bool copy = c.coherent && s % kCoherentRun != 0;
          r.q[size_t(p.off_q(b, s, h) + x)] = copy ? r.q[size_t(p.off_q(b, s - 1, h) + x)]
                                                   : to_half(c.dtype, small_ints[pick(rng)]);
          r.d_o[size_t(p.off_q(b, s, h) + x)] = to_half(c.dtype, nd(rng));
        }
    for (int64_t s = 0; s < c.lk; ++s)
      for (int64_t h = 0; h < c.hkv; ++h)
        for (int64_t x = 0; x < c.d; ++x) {
          r.k[size_t(p.off_k(b, s, h) + x)] = to_half(c.dtype, small_ints[pick(rng)]);
          r.v[size_t(p.off_k(b, s, h) + x)] = to_half(c.dtype, nd(rng));
        }
  }

  attn_plan_t plans[2] = {plan_or_exit(ctx, moba_desc(p, false), c.name),
                          plan_or_exit(ctx, moba_desc(p, true), c.name)};
  for (attn_plan_t plan : plans) {
    const attn_plan_info_t info = describe(plan);
    size_t fws = 0;
    ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fws));
    if (std::strstr(info.kernel, "moba") == nullptr)
      r.describe_error += std::string(" kernel '") + info.kernel + "' does not say moba;";
    if ((std::strstr(info.kernel, "moba-gather") != nullptr) != g_gather)
      r.describe_error += std::string(" kernel '") + info.kernel + "' with ATTN_CUDA_MOBA_GATHER " +
                          (g_gather ? "unset" : "=0") + ";";
    if (std::strcmp(info.algorithm, "flash-moba-online-softmax") != 0)
      r.describe_error += std::string(" algorithm '") + info.algorithm + "';";
    if (fws == 0 || info.workspace_bytes_forward != fws)
      r.describe_error += " forward workspace 0 or not what attn_plan_workspace_size says;";
  }

  DeviceBuf q(p.tq.elems * 2), k(p.tk.elems * 2), v(p.tk.elems * 2), o(p.tq.elems * 2),
      d_o(p.tq.elems * 2), lse(size_t(p.lse_elems()) * 4 + 16), dq(p.tq.elems * 2),
      dk(p.tk.elems * 2), dv(p.tk.elems * 2);
  q.upload(r.q.data()), k.upload(r.k.data()), v.upload(r.v.data()), d_o.upload(r.d_o.data());
  const std::vector<uint16_t> pq(p.tq.elems, poison_bits), pk(p.tk.elems, poison_bits);
  const std::vector<float> plse(size_t(p.lse_elems()) + 4, NAN);
  o.upload(pq.data());
  GPU_CHECK(cudaMemcpy(lse.p, plse.data(), plse.size() * 4, cudaMemcpyHostToDevice));
  size_t fwsb = 0;
  ATTN_CHECK(attn_plan_workspace_size(plans[0], ATTN_PASS_FORWARD, &fwsb));
  DeviceBuf fws(fwsb);
  poison(fws);
  GPU_CHECK(cudaDeviceSynchronize());
  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ATTN_CHECK(
      attn_forward(plans[0], q.p, k.p, v.p, o.p, static_cast<float*>(lse.p), fws.p, fwsb, stream));
  GPU_CHECK(cudaStreamSynchronize(stream));
  GPU_CHECK(cudaGetLastError());
  r.o.resize(p.tq.elems);
  o.download(r.o.data());
  r.lse.resize(size_t(p.lse_elems()));
  GPU_CHECK(cudaMemcpy(r.lse.data(), lse.p, r.lse.size() * 4, cudaMemcpyDeviceToHost));

  for (int det = 0; det < 2; ++det) {
    size_t wsb = 0;
    ATTN_CHECK(attn_plan_workspace_size(plans[det], ATTN_PASS_BACKWARD, &wsb));
    DeviceBuf ws(wsb);
    for (int rep = 0; rep < (det ? 3 : 1); ++rep) {
      dq.upload(pq.data()), dk.upload(pk.data()), dv.upload(pk.data());
      poison(ws);
      GPU_CHECK(cudaDeviceSynchronize());
      ATTN_CHECK(attn_backward(plans[det], q.p, k.p, v.p, o.p, static_cast<const float*>(lse.p),
                               d_o.p, dq.p, dk.p, dv.p, ws.p, wsb, stream));
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
  attn_plan_destroy(plans[0]);
  attn_plan_destroy(plans[1]);
  return r;
}

ref_strides strides_of(const Tensor& t) { return {t.sb, t.ss, t.sh}; }

std::vector<double> to_double(const Problem& p, const std::vector<uint16_t>& x) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = from_half(p.c.dtype, x[i]);
  return y;
}

// Phase two: the fp64 selection, the reference and the verdict of one case.
Outcome judge(const Run& r) {
  const Problem& p = r.p;
  const Case& c = p.c;
  const double u = c.dtype == ATTN_DTYPE_BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  // As test_flash_fwd and test_flash_bwd.
  const double atol_f =
      c.dtype == ATTN_DTYPE_BF16 ? 2.0 * std::ldexp(1.0, -10) : 2.0 * std::ldexp(1.0, -13);
  const double atol_b = atol_f / 4.0;

  ref_problem rp{};
  rp.batch = c.batch, rp.heads_q = c.hq, rp.heads_kv = c.hkv;
  rp.head_dim_qk = rp.head_dim_v = c.d;
  rp.cu_q = p.cu_q.data(), rp.cu_kv = p.cu_kv.data();
  rp.varlen = 0;
  rp.scale = p.scale;
  rp.softcap = c.softcap;
  rp.window_left = -1;
  rp.window_right = 0;  // causal
  rp.key_filter = nullptr;
  rp.q = rp.o = rp.d_o = rp.dq = strides_of(p.tq);
  rp.k = rp.v = rp.dk = rp.dv = strides_of(p.tk);

  const std::vector<double> q = to_double(p, r.q), k = to_double(p, r.k), v = to_double(p, r.v),
                            d_o = to_double(p, r.d_o);
  std::vector<unsigned char> pair(size_t(c.batch * c.hq * c.lq * c.lk));
  ref_moba_select(&rp, q.data(), k.data(), c.block, c.top_k, c.shared ? 1 : 0, pair.data());
  rp.pair_mask = pair.data();
  rp.pair_mask_batch = c.batch;
  rp.pair_mask_heads = c.hq;

  const size_t nq = p.tq.elems, nk = p.tk.elems, nl = size_t(p.lse_elems());
  std::vector<double> o64(nq, 0.0), ol(nq, 0.0), lse64(nl), lsel(nl);
  ref_forward(&rp, q.data(), k.data(), v.data(), o64.data(), lse64.data());
  ref_lowp_forward(&rp, c.dtype, q.data(), k.data(), v.data(), ol.data(), lsel.data());
  std::vector<double> g64[3] = {std::vector<double>(nq, 0.0), std::vector<double>(nk, 0.0),
                                std::vector<double>(nk, 0.0)};
  std::vector<double> gl[3] = {std::vector<double>(nq, 0.0), std::vector<double>(nk, 0.0),
                               std::vector<double>(nk, 0.0)};
  ref_backward(&rp, q.data(), k.data(), v.data(), d_o.data(), g64[0].data(), g64[1].data(),
               g64[2].data());
  ref_lowp_backward(&rp, c.dtype, q.data(), k.data(), v.data(), d_o.data(), gl[0].data(),
                    gl[1].data(), gl[2].data());
  std::vector<double> fq(nq, 0.0), fk(nk, 0.0);
  ref_backward_o_rounding_floor(&rp, u, q.data(), k.data(), v.data(), d_o.data(), fq.data(),
                                fk.data());

  // Rows that see no key and keys no row sees.
  std::vector<uint8_t> row_any(size_t(c.batch * c.hq * c.lq)),
      key_any(size_t(c.batch * c.hkv * c.lk));
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < c.lq; ++i)
        row_any[size_t((b * c.hq + h) * c.lq + i)] = uint8_t(ref_row_sees_any_head(&rp, b, h, i));
    for (int64_t h = 0; h < c.hkv; ++h)
      for (int64_t j = 0; j < c.lk; ++j)
        key_any[size_t((b * c.hkv + h) * c.lk + j)] = uint8_t(ref_key_seen_head(&rp, b, h, j));
  }

  // Compares tensor `got` (dtype bits) over its rows; `zero(b, s, h)`: the
  // row must be exactly 0.
  auto compare = [&](const std::vector<uint16_t>& got, const std::vector<double>& ref,
                     const std::vector<double>& plain, bool q_side, auto&& zero) {
    Err e;
    const int64_t heads = q_side ? c.hq : c.hkv, len = q_side ? c.lq : c.lk;
    std::vector<uint8_t> inside(got.size(), 0);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t s = 0; s < len; ++s)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t at = q_side ? p.off_q(b, s, h) : p.off_k(b, s, h);
          const bool z = zero(b, s, h);
          for (int64_t x = 0; x < c.d; ++x) {
            const size_t i = size_t(at + x);
            inside[i] = 1;
            const double g = from_half(c.dtype, got[i]);
            if (!std::isfinite(g) || (z && g != 0.0)) ++e.bad;
            e.err = std::max(e.err, std::isfinite(g) ? std::fabs(g - ref[i]) : double(INFINITY));
            e.plain = std::max(e.plain, std::fabs(plain[i] - ref[i]));
            e.ref_max = std::max(e.ref_max, std::fabs(ref[i]));
          }
        }
    const uint16_t poison_bits = poison_half(c.dtype);
    for (size_t i = 0; i < got.size(); ++i)
      if (!inside[i] && got[i] != poison_bits) ++e.bad;  // padding clobbered
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
  for (uint8_t x : row_any) empty_rows += x == 0;
  const Err eo = compare(r.o, o64, ol, true, row_empty);
  double lse_err = 0;
  int64_t lse_bad = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < c.lq; ++i) {
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
  // The share of (row, key) pairs under the causal mask that MoBA keeps.
  int64_t kept = 0, causal = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < c.lq; ++i)
        for (int64_t j = 0; j < c.lk; ++j)
          if (j <= i + c.lk - c.lq) {
            ++causal;
            kept += pair[size_t(((b * c.hq + h) * c.lq + i) * c.lk + j)] != 0;
          }
  std::snprintf(buf, sizeof buf,
                "\n     fwd    O %.2e/%.2e%s LSE %.1e%s (empty rows %" PRId64
                ", kept %.0f%% of causal)",
                eo.err, tol_o,
                eo.bad ? "(BAD)"
                : ok_o ? ""
                       : "(!)",
                lse_err, lse_bad ? "(BAD)" : "", empty_rows,
                causal ? 100.0 * double(kept) / double(causal) : 0.0);
  out.line += buf;

  double floor_q = 0, floor_k = 0;
  for (double x : fq) floor_q = std::max(floor_q, x);
  for (double x : fk) floor_k = std::max(floor_k, x);
  const char* names[3] = {"dQ", "dK", "dV"};
  const double floors[3] = {floor_q, floor_k, 0.0};
  for (int det = 0; det < 2; ++det) {
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
      n +=
          std::snprintf(buf + n, sizeof buf - size_t(n), " %s %.2e/%.2e%s", names[t], e[t].err, tol,
                        e[t].bad ? "(BAD)"
                        : ok     ? ""
                                 : "(!)");
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

Case make(const std::string& name, attn_dtype_t dt, int64_t d, int64_t batch, int64_t hq,
          int64_t hkv, int64_t lq, int64_t lk, int64_t block, int64_t top_k, bool shared) {
  Case c;
  c.name = name, c.dtype = dt, c.d = d, c.batch = batch, c.hq = hq, c.hkv = hkv, c.lq = lq,
  c.lk = lk, c.mask = ATTN_MASK_CAUSAL, c.block = block, c.top_k = top_k, c.shared = shared;
  // Logits of integer Q, K have a standard deviation of 2.5 sqrt(d) times
  // the scale: about 1 with this one.
  c.scale = float(0.4 / std::sqrt(double(d)));
  return c;
}

std::vector<Case> cases() {
  constexpr attn_dtype_t BF = ATTN_DTYPE_BF16, FP = ATTN_DTYPE_FP16;
  std::vector<Case> v;
  v.push_back(
      make("d128-bf16-b128-top3-per-head-batch2", BF, 128, 2, 2, 2, 1000, 1000, 128, 3, false));
  v.push_back(make("d128-fp16-b128-top1-shared-gqa4/2", FP, 128, 1, 4, 2, 777, 777, 128, 1, true));
  v.push_back(
      make("d128-bf16-b256-top2-shared-mqa4/1-lq<lk", BF, 128, 1, 4, 1, 1000, 1500, 256, 2, true));
  v.push_back(
      make("d128-bf16-b512-top2-per-head-gqa2/1", BF, 128, 1, 2, 1, 2100, 2100, 512, 2, false));
  v.push_back(
      make("d128-fp16-b128-top2-lq>lk-empty-rows", FP, 128, 1, 2, 2, 800, 700, 128, 2, false));
  v.push_back(make("d128-bf16-b128-top0-own-block-only", BF, 128, 1, 2, 1, 500, 500, 128, 0, true));
  v.push_back(make("d128-bf16-b128-top100-all-past-is-causal", BF, 128, 1, 2, 2, 800, 800, 128, 100,
                   false));
  Case c =
      make("d128-bf16-b128-top5-bhsd-padded-batch2", BF, 128, 2, 2, 1, 1400, 1400, 128, 5, false);
  c.layout = ATTN_LAYOUT_BHSD, c.padded = true;
  v.push_back(c);
  v.push_back(make("d64-fp16-b128-top8-per-head", FP, 64, 1, 2, 2, 2000, 2000, 128, 8, false));
  v.push_back(make("d64-bf16-b256-top2-shared-gqa4/2", BF, 64, 1, 4, 2, 1111, 1111, 256, 2, true));
  v.push_back(make("d96-bf16-b128-top3-shared-gqa2/1", BF, 96, 1, 2, 1, 900, 900, 128, 3, true));
  v.push_back(make("d256-bf16-b128-top2-per-head", BF, 256, 1, 2, 2, 700, 700, 128, 2, false));
  v.push_back(make("d256-fp16-b256-top1-shared-gqa2/1", FP, 256, 1, 2, 1, 650, 650, 256, 1, true));
  // Per-head selection in a group of 4: the heads' row lists differ in
  // length; top_k up to 12 of 16 past blocks.
  v.push_back(
      make("d64-bf16-b128-top12-per-head-gqa4/1", BF, 64, 1, 4, 1, 2100, 2100, 128, 12, false));
  v.push_back(
      make("d128-fp16-b128-top6-per-head-gqa4/2", FP, 128, 1, 4, 2, 1300, 1300, 128, 6, false));
  c = make("d128-bf16-b128-top4-per-head-coherent", BF, 128, 1, 2, 2, 1900, 1900, 128, 4, false);
  c.coherent = true;
  v.push_back(c);
  c = make("d64-fp16-b256-top3-shared-gqa2/1-coherent", FP, 64, 1, 2, 1, 2000, 2000, 256, 3, true);
  c.coherent = true;
  v.push_back(c);
  c = make("d256-bf16-b128-top10-per-head-coherent-lq<lk", BF, 256, 1, 2, 2, 900, 1700, 128, 10,
           false);
  c.coherent = true;
  v.push_back(c);
  return v;
}

// A MoBA plan's creation must fail with `status`, a message naming `word`,
// and no plan.
bool refused(attn_context_t ctx, const char* what, int64_t block, int64_t top_k, int64_t lq,
             attn_status_t status, const char* word) {
  attn_plan_desc_t pd = nullptr;
  ATTN_CHECK(attn_plan_desc_create(&pd));
  ATTN_CHECK(attn_plan_desc_set_shape(pd, 1, 2, 2, lq, lq, 128, 128));
  ATTN_CHECK(attn_plan_desc_set_dtype(pd, ATTN_DTYPE_BF16));
  ATTN_CHECK(attn_plan_desc_set_mask(pd, ATTN_MASK_CAUSAL, -1, -1));
  ATTN_CHECK(attn_plan_desc_set_moba(pd, block, top_k, 0));
  attn_plan_t plan = nullptr;
  const attn_status_t s = attn_plan_create(ctx, pd, &plan);
  const std::string msg = attn_last_error_message();  // before the next call resets it
  attn_plan_desc_destroy(pd);
  const bool ok = s == status && plan == nullptr && msg.find(word) != std::string::npos &&
                  msg.find("MoBA") != std::string::npos;
  std::printf("%s %s: %s: %s\n", ok ? "ok  " : "FAIL", what, attn_status_string(s), msg.c_str());
  attn_plan_destroy(plan);
  return ok;
}

// A forward with a workspace one byte short (WORKSPACE_TOO_SMALL), and one
// with a workspace that is not 16-byte aligned (INVALID_ARGUMENT), fail
// with a message naming the workspace and write neither O nor LSE.
bool workspace_errors(attn_context_t ctx) {
  Case c = make("workspace-errors", ATTN_DTYPE_BF16, 128, 1, 2, 2, 300, 300, 128, 1, false);
  const Problem p = make_problem(c);
  attn_plan_t plan = plan_or_exit(ctx, moba_desc(p, false), c.name);
  size_t wsb = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &wsb));
  DeviceBuf q(p.tq.elems * 2), k(p.tk.elems * 2), v(p.tk.elems * 2), o(p.tq.elems * 2),
      lse(size_t(p.lse_elems()) * 4), ws(wsb + 16);
  std::vector<uint16_t> ones(p.tq.elems, to_bf16(1.0f)), kv(p.tk.elems, to_bf16(0.5f));
  q.upload(ones.data()), k.upload(kv.data()), v.upload(kv.data());
  const std::vector<uint16_t> po(p.tq.elems, poison_half(c.dtype));
  const std::vector<float> pl(size_t(p.lse_elems()), NAN);
  struct Try {
    const char* what;
    void* ws;
    size_t bytes;
    attn_status_t want;
  };
  const Try tries[2] = {
      {"a workspace one byte short", ws.p, wsb - 1, ATTN_STATUS_WORKSPACE_TOO_SMALL},
      {"a misaligned workspace", static_cast<char*>(ws.p) + 8, wsb, ATTN_STATUS_INVALID_ARGUMENT}};
  bool all_ok = wsb > 0;
  for (const Try& t : tries) {
    o.upload(po.data()), lse.upload(pl.data());
    const attn_status_t s =
        attn_forward(plan, q.p, k.p, v.p, o.p, static_cast<float*>(lse.p), t.ws, t.bytes, nullptr);
    const std::string msg = attn_last_error_message();
    GPU_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> o_after(p.tq.elems);
    std::vector<float> l_after(size_t(p.lse_elems()));
    o.download(o_after.data()), lse.download(l_after.data());
    bool untouched = o_after == po;
    for (float x : l_after) untouched = untouched && std::isnan(x);
    const bool ok = s == t.want && msg.find("workspace") != std::string::npos && untouched;
    std::printf("%s forward with %s (%zu bytes needed): %s: %s%s\n", ok ? "ok  " : "FAIL", t.what,
                wsb, attn_status_string(s), msg.c_str(), untouched ? "" : " (outputs written)");
    all_ok = all_ok && ok;
  }
  attn_plan_destroy(plan);
  return all_ok;
}

}  // namespace

int main() {
  skip_without_device();
  const char* env = std::getenv("ATTN_TEST_SEED");
  g_seed = env ? std::strtoull(env, nullptr, 10) : std::random_device{}() * 2654435761ull;
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)\n", g_seed, g_seed);
  const char* filter = std::getenv("ATTN_GPU_TEST_FILTER");
  const char* gather_env = std::getenv("ATTN_CUDA_MOBA_GATHER");
  g_gather = gather_env == nullptr || std::atoi(gather_env) != 0;
  std::printf("%s\n", g_gather ? "gathered schedule (the default)"
                               : "ATTN_CUDA_MOBA_GATHER=0: tile-union schedule");

  attn_context_t ctx = nullptr;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  int failures = 0;
  failures += !refused(ctx, "block_size 64", 64, 2, 512, ATTN_STATUS_NOT_SUPPORTED, "block_size");
  failures += !refused(ctx, "block_size 192", 192, 2, 512, ATTN_STATUS_NOT_SUPPORTED, "block_size");
  failures += !refused(ctx, "top_k 33 of 63 past blocks", 128, 33, 8192, ATTN_STATUS_NOT_SUPPORTED,
                       "top_k");
  failures += !workspace_errors(ctx);

  std::vector<Case> all;
  for (const Case& c : cases())
    if (filter == nullptr || c.name.find(filter) != std::string::npos) all.push_back(c);
  // Device runs one case after another; the references (the slow part) in
  // parallel, one case per thread.
  std::vector<Run> runs;
  runs.reserve(all.size());
  for (const Case& c : all) runs.push_back(run_device(c, ctx));
  std::printf("device runs done (%zu cases); references:\n", runs.size());
  std::fflush(stdout);
  std::atomic<size_t> next{0};
  std::atomic<int> failed{0};
  std::mutex print;
  std::vector<std::thread> pool;
  const unsigned nt = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 16u));
  // Largest cases first; each verdict is printed as soon as it is known.
  std::vector<size_t> order(runs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    auto cost = [&](size_t i) {
      return all[i].batch * all[i].hq * all[i].lq * all[i].lk * all[i].d;
    };
    return cost(a) > cost(b);
  });
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
  failures += failed.load();
  attn_context_destroy(ctx);
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
