// MoBA's selector (moba/moba_select.cuh select_kernel) on general fp32
// values: the gates it computes on tensor cores against fp64 dot products,
// and its top_k merge against the gates it computed.
//
// test_moba_gpu keeps its inputs exact (values of {-2, -1, 1, 2}, blocks of
// powers of two), so that the selection compares bit for bit with the fp64
// rule; there every block mean and summed query row is a bf16 value and the
// split terms (mid and lo planes, kernel comment above select_kernel) are
// zero. Here they are not: the block means are fp32 values built as hi +
// mid + lo with every plane non-zero, and the query rows are bf16 of one
// head (their mid and lo terms zero: the three-product path), the fp32 sum
// of four bf16 heads of decreasing size (mid and lo non-zero), or fp16 of
// one head (11 bits: mid non-zero).
//
// Each plane's sign is chosen per channel so that every kept cross product
// (hi.mid, mid.hi, hi.lo, lo.hi) adds up over the channels while hi.hi does
// not (signs sigma_c of the query rows' hi, tau_c of the means' hi; the means'
// mid and lo carry sigma_c, the query rows' mid and lo tau_c). A kept product
// computed from a wrong fragment, or left out, then moves the gates by
// about that product's size, which the test prints and requires to be
// well above the error it allows: relative to each gate's scale
// sqrt(sum_c (q_c m_c)^2), an RMS error of at most 2^-22, an fp32 FMA
// loop's over the channels on these inputs (about 2^-22.5; its largest
// about 2^-19), and a largest one of 2^-18 (a margin for the random inputs
// of every run). Measured on an H200 (three runs): 2^-23.3 to 2^-24.3 RMS,
// 2^-20.4 to 2^-21.6 max; before each k-step's products got their own
// accumulator (summed into the running gates on the tensor cores) 2^-19.1 to
// 2^-20.9 RMS, 2^-16.9 max. (The bounds were measured on sm_90 only; the
// test runs on sm_80 and later.)
//
// The merge: each row's selected blocks (the `selected` words) must be its
// own block and the top_k of its past blocks by the kernel's own gates
// (larger first, equal gates: lower block index), or every block up to its
// own when it has at most top_k past ones.
//
// Inputs are random, fresh per run (seed printed; ATTN_TEST_SEED=n repeats
// one); gates and words are poisoned first. Exit 77 without a CUDA device.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_common.hpp"
#include "moba/moba_select.cuh"

namespace {

using gpu_test::from_bf16;
using gpu_test::to_bf16;

// Round to nearest even of fp32 to bf16, as fp32 (inputs are finite).
float bf16_rn(float x) { return from_bf16(to_bf16(x)); }

// The kernel's split (split_bf16x3): hi, mid, lo with fp32 residuals.
struct Split {
  double hi, mid, lo;
};
Split split3(float x) {
  const float h = bf16_rn(x);
  const float r = x - h;
  const float m = bf16_rn(r);
  const float l = bf16_rn(r - m);
  return {h, m, l};
}

// A bf16 value of sign s and magnitude 2^u (u in [lo, hi)) whose mantissa
// lies in [1.25, 1.75): away from the binade's ends, so that adding the
// smaller planes below never changes its rounding.
float bf16_value(std::mt19937_64& rng, float s, double lo, double hi) {
  std::uniform_real_distribution<double> ue(lo, hi), um(1.25, 1.75);
  const double mag = std::ldexp(um(rng), int(std::floor(ue(rng))));
  return bf16_rn(float(s * mag));
}

enum class QKind { kBf16One, kBf16Sum4, kFp16One };
const char* kind_name(QKind k) {
  return k == QKind::kBf16One ? "bf16, one head" : k == QKind::kBf16Sum4 ? "bf16, 4 heads summed"
                                                                         : "fp16, one head";
}

struct Config {
  QKind kind;
  int d, top_k;
};

int g_failures = 0;

template <class T>
void run(const Config& cfg, uint64_t seed) {
  const int d = cfg.d, G = cfg.kind == QKind::kBf16Sum4 ? 4 : 1;
  const int L = 2048, block = 16, nb = L / block, q_words = (L + 63) / 64;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> coin(0, 1);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::vector<float> sigma(static_cast<size_t>(d)), tau(static_cast<size_t>(d));
  for (int c = 0; c < d; ++c) {
    sigma[size_t(c)] = coin(rng) ? 1.f : -1.f;
    tau[size_t(c)] = coin(rng) ? 1.f : -1.f;
  }

  // Block means [nb][d], fp32: hi (sign tau_c) + mid + lo (sign sigma_c).
  std::vector<float> means(size_t(nb) * d);
  for (int kb = 0; kb < nb; ++kb)
    for (int c = 0; c < d; ++c) {
      const float hi = bf16_value(rng, tau[size_t(c)], -2.0, 2.0);
      const float mid = bf16_rn(float(sigma[size_t(c)] * std::fabs(hi) * std::exp2(-9.0 - 0.5 * u01(rng))));
      const float lo = bf16_rn(float(sigma[size_t(c)] * std::fabs(mid) * std::exp2(-9.0 - 0.5 * u01(rng))));
      means[size_t(kb) * d + c] = (hi + mid) + lo;
    }

  // Query rows [L][G][d] in T, and their head sums in fp32 (head order, as
  // the kernel adds them).
  std::vector<uint16_t> qbits(size_t(L) * G * d);
  std::vector<float> qsum(size_t(L) * d);
  for (int r = 0; r < L; ++r)
    for (int c = 0; c < d; ++c) {
      const float s = sigma[size_t(c)], t = tau[size_t(c)];
      float heads[4] = {0.f, 0.f, 0.f, 0.f};
      if (cfg.kind == QKind::kFp16One) {
        // hi + k ulp16 (k = 1..3, sign tau_c): the mid term, below half a
        // bf16 ulp of hi.
        const float hi = bf16_value(rng, s, -2.0, 2.0);
        const int e = std::ilogb(hi);
        const float v = hi + t * float(1 + int(u01(rng) * 3.0)) * std::ldexp(1.0f, e - 10);
        const __half h = __float2half_rn(v);
        heads[0] = __half2float(h);
        if (heads[0] != v) {
          std::printf("FAIL fp16 construction: %g not representable\n", double(v));
          std::exit(1);
        }
        uint16_t b;
        std::memcpy(&b, &h, 2);
        qbits[(size_t(r) * G) * d + c] = b;
      } else {
        heads[0] = bf16_value(rng, s, -2.0, 2.0);
        if (G == 4) {
          heads[1] = bf16_rn(float(t * std::fabs(heads[0]) * std::exp2(-9.0 - 0.5 * u01(rng))));
          heads[2] = bf16_rn(float(t * std::fabs(heads[1]) * std::exp2(-9.0 - 0.5 * u01(rng))));
          heads[3] = bf16_rn(float((coin(rng) ? 1.0 : -1.0) * std::fabs(heads[0]) * std::exp2(-30.0)));
        }
        for (int h = 0; h < G; ++h) qbits[(size_t(r) * G + h) * d + c] = to_bf16(heads[h]);
      }
      float acc = 0.f;
      for (int h = 0; h < G; ++h) acc += heads[h];
      qsum[size_t(r) * d + c] = acc;
    }

  attn::moba::SelectParams p{};
  uint16_t* dq = nullptr;
  float *dpooled = nullptr, *dgates = nullptr;
  uint64_t* dsel = nullptr;
  GPU_CHECK(cudaMalloc(&dq, qbits.size() * 2));
  GPU_CHECK(cudaMalloc(&dpooled, means.size() * 4));
  GPU_CHECK(cudaMalloc(&dgates, size_t(L) * nb * 4));
  GPU_CHECK(cudaMalloc(&dsel, size_t(nb) * q_words * 8));
  GPU_CHECK(cudaMemcpy(dq, qbits.data(), qbits.size() * 2, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaMemcpy(dpooled, means.data(), means.size() * 4, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaMemset(dgates, 0xff, size_t(L) * nb * 4));  // NaN
  GPU_CHECK(cudaMemset(dsel, 0xa5, size_t(nb) * q_words * 8));
  p.q = dq;
  p.q_batch = int64_t(L) * G * d, p.q_seq = int64_t(G) * d, p.q_head = d;
  p.pooled = dpooled;
  p.selected = dsel;
  p.gates = dgates;
  p.batch = 1, p.heads_q = G, p.heads_kv = 1, p.group = G;
  p.seqlen_q = L, p.seqlen_kv = L, p.d = d;
  p.block = block, p.num_blocks = nb, p.top_k = cfg.top_k;
  p.shared = G > 1 ? 1 : 0;
  p.sel_heads = 1;  // shared: one per KV head; else one per query head (G = 1)
  p.q_words = q_words;
  const int smem = int(attn::moba::select_smem_bytes(d));
  GPU_CHECK(cudaFuncSetAttribute(attn::moba::select_kernel<T, true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  attn::moba::select_kernel<T, true>
      <<<dim3(unsigned(q_words), 1, 1), attn::moba::kSelectThreads, size_t(smem)>>>(p);
  GPU_CHECK(cudaGetLastError());
  GPU_CHECK(cudaDeviceSynchronize());
  std::vector<float> gates(size_t(L) * nb);
  std::vector<uint64_t> sel(size_t(nb) * q_words);
  GPU_CHECK(cudaMemcpy(gates.data(), dgates, gates.size() * 4, cudaMemcpyDeviceToHost));
  GPU_CHECK(cudaMemcpy(sel.data(), dsel, sel.size() * 8, cudaMemcpyDeviceToHost));
  GPU_CHECK(cudaFree(dq));
  GPU_CHECK(cudaFree(dpooled));
  GPU_CHECK(cudaFree(dgates));
  GPU_CHECK(cudaFree(dsel));

  // Gates: every past block of every row whose own block exceeds top_k (the
  // kernel computes a tile's gates up to its last row's own block; rows
  // with fewer past blocks than top_k + 1 read none).
  bool ok = true;
  std::string why;
  double err2 = 0.0, err_max = 0.0;
  // kept cross products: hi.mid, mid.hi, hi.lo, lo.hi, mid.mid
  double term2[5] = {0, 0, 0, 0, 0};
  int64_t n = 0;
  std::vector<Split> ms(means.size()), qs(static_cast<size_t>(d));
  for (size_t i = 0; i < means.size(); ++i) ms[i] = split3(means[i]);
  for (int r = 0; r < L; ++r) {
    const int own = r / block;
    if (own <= cfg.top_k) continue;
    for (int c = 0; c < d; ++c) qs[size_t(c)] = split3(qsum[size_t(r) * d + c]);
    for (int kb = 0; kb < own; ++kb) {
      double ref = 0.0, scale2 = 0.0, t[5] = {0, 0, 0, 0, 0};
      for (int c = 0; c < d; ++c) {
        const double q = qsum[size_t(r) * d + c], m = means[size_t(kb) * d + c];
        ref += q * m;
        scale2 += q * m * q * m;
        const Split& a = qs[size_t(c)];
        const Split& b = ms[size_t(kb) * d + c];
        t[0] += a.hi * b.mid, t[1] += a.mid * b.hi, t[2] += a.hi * b.lo, t[3] += a.lo * b.hi;
        t[4] += a.mid * b.mid;
      }
      const double scale = std::sqrt(scale2);
      const float g = gates[size_t(r) * nb + kb];
      if (!std::isfinite(g)) {
        if (ok) why = "row " + std::to_string(r) + " block " + std::to_string(kb) + ": no gate written";
        ok = false;
        continue;
      }
      const double e = std::fabs(double(g) - ref) / scale;
      err2 += e * e;
      err_max = std::max(err_max, e);
      for (int i = 0; i < 5; ++i) term2[i] += (t[i] / scale) * (t[i] / scale);
      ++n;
    }
  }
  const double err_rms = std::sqrt(err2 / double(std::max<int64_t>(n, 1)));
  double term_rms[5];
  for (int i = 0; i < 5; ++i) term_rms[i] = std::sqrt(term2[i] / double(std::max<int64_t>(n, 1)));
  const double rms_bound = std::ldexp(1.0, -22), max_bound = std::ldexp(1.0, -18);
  if (ok && !(n > 0 && err_rms <= rms_bound && err_max <= max_bound)) {
    why = "gate error above its bound";
    ok = false;
  }
  // Sensitivity: the products this kind of query row exercises must be well
  // above the bound (hi.mid, hi.lo always; mid.hi for fp16 and summed rows;
  // lo.hi for summed rows).
  const bool need[4] = {true, cfg.kind != QKind::kBf16One, true, cfg.kind == QKind::kBf16Sum4};
  for (int i = 0; i < 4; ++i)
    if (need[i] && !(term_rms[i] >= 2.0 * rms_bound)) {
      if (ok) why = "a kept product too small to be seen (test construction)";
      ok = false;
    }

  // The merge against the kernel's gates.
  int64_t rows_checked = 0;
  for (int r = 0; r < L && ok; ++r) {
    const int own = r / block;
    std::vector<int> want;
    if (own <= cfg.top_k) {
      for (int kb = 0; kb <= own; ++kb) want.push_back(kb);
    } else {
      std::vector<int> past(static_cast<size_t>(own));
      for (int kb = 0; kb < own; ++kb) past[size_t(kb)] = kb;
      auto key = [&](int kb) { return gates[size_t(r) * nb + kb] + 0.0f; };  // -0 -> +0
      std::stable_sort(past.begin(), past.end(), [&](int a, int b) { return key(a) > key(b); });
      want.assign(past.begin(), past.begin() + cfg.top_k);
      want.push_back(own);
      std::sort(want.begin(), want.end());
    }
    std::vector<int> got;
    for (int kb = 0; kb < nb; ++kb)
      if ((sel[size_t(kb) * q_words + size_t(r / 64)] >> (r % 64)) & 1u) got.push_back(kb);
    if (got != want) {
      ok = false;
      why = "row " + std::to_string(r) + ": selection differs from the top_k of its gates";
    }
    ++rows_checked;
  }

  std::printf("%-22s d %3d top_k %2d: %s  gates %" PRId64 ", error rms 2^%.1f max 2^%.1f (bounds 2^-22, 2^-18);"
              " products rms hi.mid 2^%.1f mid.hi 2^%.1f hi.lo 2^%.1f lo.hi 2^%.1f mid.mid 2^%.1f;"
              " rows merged %" PRId64 "%s%s\n",
              kind_name(cfg.kind), d, cfg.top_k, ok ? "ok" : "FAIL", n, std::log2(err_rms), std::log2(err_max),
              std::log2(term_rms[0]), std::log2(term_rms[1]), std::log2(term_rms[2]), std::log2(term_rms[3]),
              std::log2(term_rms[4]), rows_checked, ok ? "" : ": ", why.c_str());
  if (!ok) ++g_failures;
}

}  // namespace

int main() {
  gpu_test::skip_without_device();
  int major = 0;
  GPU_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 8) {
    std::printf("device older than sm_80: skipped\n");
    return 77;
  }
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, attn::moba::select_kernel<__nv_bfloat16, true>) != cudaSuccess) {
    std::printf("no kernel image for this device in this build: skipped\n");
    return 77;
  }
  const char* env = std::getenv("ATTN_TEST_SEED");
  const uint64_t seed = env ? std::strtoull(env, nullptr, 10) : std::random_device{}() * 2654435761ull;
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)\n", seed, seed);
  const Config configs[] = {{QKind::kBf16One, 128, 8},  {QKind::kBf16Sum4, 128, 8}, {QKind::kFp16One, 128, 8},
                            {QKind::kBf16One, 64, 32},  {QKind::kBf16Sum4, 64, 3},  {QKind::kFp16One, 64, 32}};
  uint64_t s = seed;
  for (const Config& c : configs) {
    if (c.kind == QKind::kFp16One)
      run<__half>(c, s++);
    else
      run<__nv_bfloat16>(c, s++);
  }
  std::printf("%s\n", g_failures == 0 ? "all passed" : "FAILED");
  return g_failures == 0 ? 0 : 1;
}
