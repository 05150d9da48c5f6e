// The d = 64 query-tile choice of the sm_90a forward (cuda/fwd_sm90_shape.hpp),
// host arithmetic only, so it runs without a GPU:
//   - the estimated makespan lies between the list-scheduling bounds,
//     max(total / SMs, longest block) <= makespan <= total / SMs + longest
//     block, with block costs recomputed here by brute force over the rows
//     and keys of each tile (not through DenseTileSchedule);
//   - past 64 waves it is total / SMs;
//   - the choices the rule exists for: short causal sequences take 128 rows,
//     long full ones whose length both tiles divide take 192, and a grid
//     smaller than the device takes the tile that keeps more SMs busy.
// Shapes are random (seed printed; ATTN_TEST_SEED=n repeats a run).
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "cuda/fwd_sm90_shape.hpp"

namespace {

int g_failures = 0;

void expect(bool ok, const char* what, const char* detail = "") {
  std::printf("%s %s%s\n", ok ? "ok  " : "FAIL", what, detail);
  if (!ok) ++g_failures;
}

attn::Problem make(int64_t batch, int64_t heads, int64_t lq, int64_t lk, int64_t left,
                   int64_t right) {
  attn::Problem p;
  p.batch = batch, p.heads_q = p.heads_kv = heads, p.seqlen_q = lq, p.seqlen_kv = lk;
  p.head_dim_qk = p.head_dim_v = 64;
  p.window = attn::WindowBounds{left, right};
  for (int64_t b = 0; b <= batch; ++b) p.cu_q.push_back(b * lq), p.cu_kv.push_back(b * lk);
  return p;
}

// Cost of every block of one sequence: (KV tiles holding a visible key of
// the tile's rows + 1 + the masked-tile extra for each of them that has an
// invisible pair or ends past the last key) x bm / 192 / rate, by looking
// at every pair.
std::vector<double> brute_costs(const attn::Problem& p, int64_t bm) {
  const int64_t lq = p.seqlen_q, lk = p.seqlen_kv, off = lk - lq, bn = 128;
  const double per = double(bm) / 192.0 / (bm == 192 ? 1.0 : attn::cuda::kFwdSm90Rate128);
  std::vector<double> out;
  for (int64_t r0 = 0; r0 < lq; r0 += bm) {
    int64_t tiles = 0, masked = 0;
    for (int64_t c0 = 0; c0 < lk; c0 += bn) {
      bool seen = false, hidden = c0 + bn > lk;
      for (int64_t i = r0; i < std::min(lq, r0 + bm); ++i)
        for (int64_t j = c0; j < std::min(lk, c0 + bn); ++j) {
          const bool vis = (p.window.left < 0 || j >= i + off - p.window.left) &&
                           (p.window.right < 0 || j <= i + off + p.window.right);
          seen = seen || vis;
          hidden = hidden || !vis;
        }
      tiles += seen ? 1 : 0;
      masked += seen && hidden ? 1 : 0;
    }
    out.push_back((double(tiles + 1) + attn::cuda::kFwdSm90MaskedTile * double(masked)) * per);
  }
  return out;
}

}  // namespace

int main() {
  const char* seed_env = std::getenv("ATTN_TEST_SEED");
  const uint64_t now = uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : now;
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)\n", seed, seed);
  std::mt19937_64 rng(seed);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };

  for (int trial = 0; trial < 40; ++trial) {
    const int64_t lq = uni(1, 900), lk = uni(1, 900), sms = uni(1, 140);
    const int kind = int(uni(0, 2));  // full, causal, window
    const int64_t left = kind == 0 ? -1 : kind == 1 ? -1 : uni(0, 300);
    const int64_t right = kind == 0 ? -1 : kind == 1 ? 0 : uni(0, 50);
    const attn::Problem p = make(uni(1, 4), uni(1, 6), lq, lk, left, right);
    for (int64_t bm : {128, 192}) {
      const std::vector<double> c = brute_costs(p, bm);
      double sum = 0, longest = 0;
      for (double x : c) sum += x, longest = std::max(longest, x);
      const double total = sum * double(p.batch * p.heads_q);
      const double got = attn::cuda::fwd_sm90_makespan(p, bm, 128, sms);
      const int64_t blocks = int64_t(c.size()) * p.batch * p.heads_q;
      const double eps = 1e-9 * (total + 1);
      bool ok;
      if (blocks > 64 * sms)
        ok = std::abs(got - total / double(sms)) <= eps;
      else
        ok = got + eps >= std::max(total / double(sms), longest) &&
             got <= total / double(sms) + longest + eps;
      char detail[200];
      std::snprintf(detail, sizeof detail,
                    ": bm %" PRId64 " b %" PRId64 " h %" PRId64 " %" PRId64 "x%" PRId64
                    " window (%" PRId64 ",%" PRId64 ") sms %" PRId64
                    ": %.3f (total %.3f, longest %.3f)",
                    bm, p.batch, p.heads_q, lq, lk, left, right, sms, got, total, longest);
      if (!ok) expect(false, "makespan within the list-scheduling bounds", detail);
    }
  }
  expect(g_failures == 0,
         "makespan within the list-scheduling bounds (40 random shapes x 2 tiles)");

  // Short causal sequences: 128 rows (L = 1K: 5.3 tiles of 192, the longest
  // one a third empty).
  expect(attn::cuda::fwd_sm90_block_m_d64(make(16, 32, 1024, 1024, -1, 0), 128, 132) == 128,
         "causal L = 1K, 16 x 32 heads: 128-row tiles");
  // Long full sequences that neither tile pads: 192 rows (the better rate).
  expect(attn::cuda::fwd_sm90_block_m_d64(make(1, 32, 15360, 15360, -1, -1), 128, 132) == 192,
         "full L = 15360 (40 x 384): 192-row tiles");
  // One sequence of one head, smaller than the device: more, shorter blocks.
  expect(attn::cuda::fwd_sm90_block_m_d64(make(1, 1, 1536, 1536, -1, -1), 128, 132) == 128,
         "full L = 1536, one head: 128-row tiles (12 blocks instead of 8)");
  std::printf("%s: %d failure(s), seed %" PRIu64 "\n", g_failures ? "FAILED" : "PASSED",
              g_failures, seed);
  return g_failures ? 1 : 0;
}
