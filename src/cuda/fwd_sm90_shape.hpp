// The query tile of the sm_90a forward at d = 64: 192 rows (three
// warpgroups) or 128 (two), flash::fwd_sm90_config(64, block_m). Plain C++
// (no CUDA): the choice is arithmetic on the plan, made at plan creation.
//
// Both shapes run one block per SM (registers). A 192-row block keeps 12
// warps busy and so runs a KV tile at a better rate per row, but a short or
// causal sequence pays for it: L = 2K has 10.7 such tiles, the last one a
// third empty and, under a causal mask, the longest (bottom rows see every
// key); 128-row tiles pad nothing there and cut the diagonal finer. The
// estimate deals the grid's blocks to the SMs in launch order (query tiles
// of a head last-first, then heads, then sequences), each the first SM free,
// a block costing (KV tiles visited + 1 for the prologue and epilogue +
// kFwdSm90MaskedTile per tile under the element mask) x rows / rate, and
// takes the shape that finishes first; so the wave count and the last
// wave's fill weigh as well as the padding and the diagonal.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <queue>
#include <vector>

#include "plan/problem.hpp"
#include "schedule/dense_schedule.hpp"

namespace attn::cuda {

// Throughput per query row of the 128-row shape relative to the 192-row one
// (two warpgroups hide less of the softmax behind the tensor cores). An
// estimate, to be replaced by the ratio time_flash_fwd measures on a full
// mask at L = 8K (where padding and waves barely differ): 0.9.
inline constexpr double kFwdSm90Rate128 = 0.9;

// The extra cost of a KV tile under the element mask (the causal diagonal,
// a window's edges, the sequence's end) relative to a full one, fitted to
// the 192-row kernel on an H200: at L = 2K causal ran at 246.5 TFLOP/s and
// full at 313, 6% below what the tile counts alone give.
inline constexpr double kFwdSm90MaskedTile = 0.3;

// KV tiles of `range` that need the element mask for query tile qt: the
// full ones are contiguous (both key bounds grow with the row), so count
// the partial ones in from each end.
inline int64_t masked_kv_tiles(const DenseTileSchedule& sched, int64_t qt, TileRange range,
                               int64_t block_n) {
  auto partial = [&](int64_t kt) {
    return !sched.is_full(qt, kt) || sched.kv_end(kt) - sched.kv_begin(kt) < block_n;
  };
  int64_t lo = range.begin, hi = range.end;
  while (lo < hi && partial(lo)) ++lo;
  if (lo == hi) return range.end - range.begin;
  while (partial(hi - 1)) --hi;
  return (lo - range.begin) + (range.end - hi);
}

// Estimated run time of the forward with block_m-row query tiles, in units
// of one KV tile of a 192-row block; sms: the device's multiprocessor count.
inline double fwd_sm90_makespan(const Problem& p, int64_t block_m, int64_t block_n, int64_t sms) {
  const double per_tile = double(block_m) / 192.0 / (block_m == 192 ? 1.0 : kFwdSm90Rate128);
  sms = std::max<int64_t>(sms, 1);
  // Past 64 waves the last one is a small fraction: total work / SMs.
  const int64_t simulated = 64 * sms;
  int64_t m_blocks = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    m_blocks = std::max(m_blocks, (p.lq(b) + block_m - 1) / block_m);
  const bool simulate = m_blocks * p.heads_q * p.batch <= simulated;
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  if (simulate)
    for (int64_t i = 0; i < sms; ++i) free_at.push(0.0);
  double total = 0.0, finish = 0.0;
  std::vector<double> cost(static_cast<size_t>(m_blocks));  // per query tile, in launch order
  for (int64_t b = 0; b < p.batch; ++b) {
    const DenseTileSchedule sched(p.sequence_mask(b), block_m, block_n);
    for (int64_t x = 0; x < m_blocks; ++x) {
      const int64_t m = m_blocks - 1 - x;  // the kernel's order: last tiles first
      if (m >= sched.num_q_tiles()) {
        cost[size_t(x)] = 0.0;  // returns at once
        continue;
      }
      const TileRange r = sched.kv_tiles_of(m);
      const int64_t masked = masked_kv_tiles(sched, m, r, block_n);
      cost[size_t(x)] = (double(r.end - r.begin + 1) + kFwdSm90MaskedTile * double(masked)) *
                        per_tile;
    }
    for (const double c : cost) total += double(p.heads_q) * c;
    if (!simulate) continue;
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (const double c : cost) {
        if (c == 0.0) continue;
        const double end = free_at.top() + c;
        free_at.pop();
        free_at.push(end);
        finish = std::max(finish, end);
      }
  }
  return simulate ? finish : total / double(sms);
}

// 128 or 192 for a dense d = 64 plan (block_n: the KV tile, the same for both).
inline int fwd_sm90_block_m_d64(const Problem& p, int64_t block_n, int64_t sms) {
  return fwd_sm90_makespan(p, 128, block_n, sms) < fwd_sm90_makespan(p, 192, block_n, sms) ? 128
                                                                                           : 192;
}

}  // namespace attn::cuda
