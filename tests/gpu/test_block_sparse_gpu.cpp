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
// with no visible key. The builders' patterns (causal window + 64 sinks;
// BigBird: window, global keys and queries, random blocks) at a medium
// size, their selection read back from the mask (attn_block_mask_get_blocks).
//
// Each case runs the forward, the backward with dQ by atomics and the
// deterministic backward (three times: bit-identical). Tolerance
// (FlashAttention's rule, as the other GPU tests): max |X - X_fp64| <=
// 2 * max |X_plain - X_fp64| + atol, X_plain from ref_lowp_* (every op
// rounded to the dtype, fp32 sums); for dQ and dK plus twice the error
// floor of O handed over in the dtype (ref_backward_o_rounding_floor). LSE
// within 2e-3. Rows that see no key: O = 0, LSE = -inf and dQ = 0 exactly;
// keys no row sees: dK = dV = 0 exactly. Outputs are poisoned (NaN) before
// every run, and every element must be written. attn_plan_describe must name
// the block-sparse kernels. (MoBA plans: test_moba_gpu.)
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

enum class Source { kRandom, kWindowSinks, kBigBird };

struct Case : CaseShape {
  int64_t bq = 64, bk = 64;                // the block mask's block sizes
  int64_t mask_batch = 1, mask_heads = 1;  // 1, or batch / heads_kv
  Source src = Source::kRandom;
  double p_none = 0.3;        // chance that a block selects nothing
  bool empty_block0 = false;  // query block 0 of slot 0 selects nothing
};
using Problem = CaseProblem<Case>;

uint64_t g_seed = 0;

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
  }
  if (c.src != Source::kRandom) sel = read_selection(c, mask);
  return mask;
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

// What phase one (the device) leaves for phase two (the host reference).
struct Run {
  Problem p;
  std::vector<uint8_t> sel;
  std::vector<uint16_t> q, k, v, d_o, o;  // dtype bits
  std::vector<float> lse;
  std::vector<uint16_t> grads[2][3];      // atomic, det: dQ, dK, dV
  bool det_repeatable = true;
  std::string describe_error;
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

  const uint16_t poison = poison_half(c.dtype);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  r.q.assign(p.tq.elems, poison), r.d_o.assign(p.tq.elems, poison);
  r.k.assign(p.tk.elems, poison), r.v.assign(p.tk.elems, poison);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t s = 0; s < c.lq; ++s)
      for (int64_t h = 0; h < c.hq; ++h)
        for (int64_t x = 0; x < c.d; ++x) {
          r.q[size_t(p.off_q(b, s, h) + x)] = to_half(c.dtype, nd(rng));
          r.d_o[size_t(p.off_q(b, s, h) + x)] = to_half(c.dtype, nd(rng));
        }
    for (int64_t s = 0; s < c.lk; ++s)
      for (int64_t h = 0; h < c.hkv; ++h)
        for (int64_t x = 0; x < c.d; ++x) {
          r.k[size_t(p.off_k(b, s, h) + x)] = to_half(c.dtype, nd(rng));
          r.v[size_t(p.off_k(b, s, h) + x)] = to_half(c.dtype, nd(rng));
        }
  }

  attn_plan_t plans[2] = {build_plan(p, ctx, mask, false), build_plan(p, ctx, mask, true)};
  ATTN_CHECK(attn_block_mask_destroy(mask));
  for (attn_plan_t plan : plans) {
    const attn_plan_info_t info = describe(plan);
    if (std::strstr(info.kernel, "bsparse") == nullptr)
      r.describe_error += std::string(" kernel '") + info.kernel + "' does not say bsparse;";
    if (info.visited_tile_pairs > info.total_tile_pairs || info.block_q != c.bq ||
        info.block_kv != c.bk)
      r.describe_error += " visited/total tile pairs or block sizes wrong;";
  }

  DeviceBuf q(p.tq.elems * 2), k(p.tk.elems * 2), v(p.tk.elems * 2), o(p.tq.elems * 2),
      d_o(p.tq.elems * 2), lse(size_t(p.lse_elems()) * 4 + 16), dq(p.tq.elems * 2),
      dk(p.tk.elems * 2), dv(p.tk.elems * 2);
  q.upload(r.q.data()), k.upload(r.k.data()), v.upload(r.v.data()), d_o.upload(r.d_o.data());
  const std::vector<uint16_t> pq(p.tq.elems, poison), pk(p.tk.elems, poison);
  const std::vector<float> plse(size_t(p.lse_elems()) + 4, NAN);
  o.upload(pq.data());
  GPU_CHECK(cudaMemcpy(lse.p, plse.data(), plse.size() * 4, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaDeviceSynchronize());
  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ATTN_CHECK(attn_forward(plans[0], q.p, k.p, v.p, o.p, static_cast<float*>(lse.p), nullptr, 0,
                          stream));
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

// Phase two: the reference and the verdict of one case.
Outcome judge(const Run& r) {
  const Problem& p = r.p;
  const Case& c = p.c;
  const double u = c.dtype == ATTN_DTYPE_BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  // As test_flash_fwd and test_flash_bwd.
  const double atol_f = c.dtype == ATTN_DTYPE_BF16 ? 2.0 * std::ldexp(1.0, -10) : 2.0 * std::ldexp(1.0, -13);
  const double atol_b = atol_f / 4.0;

  ref_problem rp{};
  rp.batch = c.batch, rp.heads_q = c.hq, rp.heads_kv = c.hkv;
  rp.head_dim_qk = rp.head_dim_v = c.d;
  rp.cu_q = p.cu_q.data(), rp.cu_kv = p.cu_kv.data();
  rp.varlen = 0;
  rp.scale = p.scale;
  rp.softcap = c.softcap;
  rp.window_left = c.mask == ATTN_MASK_WINDOW ? c.wl : -1;
  rp.window_right = c.mask == ATTN_MASK_WINDOW ? c.wr : c.mask == ATTN_MASK_CAUSAL ? 0 : -1;
  rp.key_filter = nullptr;
  rp.q = rp.o = rp.d_o = rp.dq = strides_of(p.tq);
  rp.k = rp.v = rp.dk = rp.dv = strides_of(p.tk);
  rp.pair_mask = r.sel.data();
  rp.pair_mask_batch = c.mask_batch;
  // The reference's rule: 1, heads_q (per query head) or else per KV head.
  rp.pair_mask_heads = c.mask_heads;

  const std::vector<double> q = to_double(p, r.q), k = to_double(p, r.k), v = to_double(p, r.v),
                            d_o = to_double(p, r.d_o);
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
  std::vector<uint8_t> row_any(size_t(c.batch * c.hq * c.lq)), key_any(size_t(c.batch * c.hkv * c.lk));
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
  std::snprintf(buf, sizeof buf, "\n     fwd    O %.2e/%.2e%s LSE %.1e%s (empty rows %" PRId64 ")",
                eo.err, tol_o, eo.bad ? "(BAD)" : ok_o ? "" : "(!)", lse_err,
                lse_bad ? "(BAD)" : "", empty_rows);
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
  c = make("d128-bf16-b64-softcap30", BF, 128, 1, 2, 1, 190, 190, NONE, 64, 64);
  c.softcap = 30.0f;
  v.push_back(c);
  c = make("d64-bf16-b48x80-causal-gqa2/1", BF, 64, 1, 2, 1, 277, 277, CAUSAL, 48, 80);
  v.push_back(c);
  c = make("d64-fp16-b128-window(64,64)", FP, 64, 1, 2, 2, 300, 300, WIN, 128, 128);
  c.wl = 64, c.wr = 64, c.mask_heads = 2;
  v.push_back(c);
  c = make("d96-fp16-b96-causal", FP, 96, 1, 2, 2, 290, 290, CAUSAL, 96, 96);
  c.mask_heads = 2;
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
  c = make("d128-fp16-b96-bigbird-causal", FP, 128, 1, 2, 2, 1500, 1500, CAUSAL, 96, 96);
  c.src = Source::kBigBird;
  v.push_back(c);
  return v;
}

}  // namespace

int main() {
  skip_without_device();
  const char* env = std::getenv("ATTN_TEST_SEED");
  g_seed = env ? std::strtoull(env, nullptr, 10) : std::random_device{}() * 2654435761ull;
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)\n", g_seed, g_seed);
  const char* filter = std::getenv("ATTN_GPU_TEST_FILTER");

  attn_context_t ctx = nullptr;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  int failures = device_tables(ctx) ? 0 : 1;

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
    auto cost = [&](size_t i) { return all[i].hq * all[i].lq * all[i].lk * all[i].d; };
    return cost(a) > cost(b);
  });
  for (unsigned t = 0; t < nt; ++t)
    pool.emplace_back([&] {
      for (size_t k; (k = next.fetch_add(1)) < runs.size();) {
        const auto t0 = std::chrono::steady_clock::now();
        const Outcome o = judge(runs[order[k]]);
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
