// Block-sparse plans on the CUDA backend, host side: the block mask's tile
// schedule (src/schedule/block_schedule.hpp) laid out as the flat arrays the
// kernels walk (flash::TileLists), in one kernel's tile sizes, with the bit
// tiles its partial visits need. Plain C++; the CUDA plan uploads the arrays
// at plan creation.
//
// A visit that is not full gets a bit tile only when the block selection
// hides some pair the dense mask (window, lengths) shows in that tile;
// otherwise the kernel's dense predicate is exact there and no bits are
// stored. The bit tile then holds the visible pairs themselves (dense mask
// AND selection), so the kernel tests one bit per pair.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "cuda/limits.hpp"
#include "schedule/block_schedule.hpp"
#include "sparse/tile_lists.cuh"

namespace attn::cuda {

struct HostTileLists {
  std::vector<int32_t> offsets;  // [slots * tiles + 1]
  std::vector<int32_t> visits;   // (other tile, kind) per visit
  std::vector<uint64_t> bits;    // bit tiles, rows * words_per_row words each
  // KV-major only: work items (tile, first visit, end visit, accumulator
  // slot) per slot, longest first, and their offsets
  // (flash::TileLists::items); the tiles whose list is cut, max_cut per
  // slot, padded with -1 (flash::TileLists::cut_tiles).
  std::vector<int32_t> items, item_offsets, cut_tiles;
  // KV-major only, the persistent dK/dV kernel's: its blocks' work
  // (flash::TileLists::dealt) and the grid it numbers them in.
  std::vector<int32_t> dealt, dealt_offsets;
  int32_t grid_x = 0, grid_y = 0;
  int32_t tiles = 0, words_per_row = 0, rows = 0;
  int32_t max_items = 0;  // the most items of a slot
  int32_t max_cut = 0;    // the most cut tiles of a slot
};

// How local the lists are: the mean, over the lists of every slot that
// have a next one (tile + 1) and at least one visit, of the share of their
// visited tiles that the next list visits too. About 1 for windows (the
// blocks running at a time, neighbours in launch order, share most of their
// other side's tiles whatever the head order), about the density for random
// blocks; BigBird's (window of 1, 2 global blocks each way, 3 random)
// 0.58 in 128 x 128 query-major tiles, 0.34 in 64 x 128 KV-major ones.
inline double neighbour_overlap(const HostTileLists& l, int64_t slots) {
  int32_t other = 0;
  for (size_t v = 0; v < l.visits.size(); v += 2) other = std::max(other, l.visits[v] + 1);
  std::vector<char> in_next(size_t(other), 0);
  double sum = 0.0;
  int64_t lists = 0;
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t t = 0; t + 1 < l.tiles; ++t) {
      const int64_t k = s * l.tiles + t;
      const int32_t b0 = l.offsets[size_t(k)], e0 = l.offsets[size_t(k + 1)],
                    e1 = l.offsets[size_t(k + 2)];
      if (e0 == b0) continue;
      for (int32_t v = e0; v < e1; ++v) in_next[size_t(l.visits[2 * size_t(v)])] = 1;
      int64_t shared = 0;
      for (int32_t v = b0; v < e0; ++v) shared += in_next[size_t(l.visits[2 * size_t(v)])];
      for (int32_t v = e0; v < e1; ++v) in_next[size_t(l.visits[2 * size_t(v)])] = 0;
      sum += double(shared) / double(e0 - b0);
      ++lists;
    }
  return lists > 0 ? sum / double(lists) : 1.0;
}

// Lists at least this local keep the kernels' blocks in one group of all
// heads (TileLists::head_group, the forward's x_group): neighbouring blocks
// already share their tiles in L2. Window + sinks (0.97) lost 2-4% in
// groups of 4 heads on an H100; BigBird (0.58 / 0.34) gained 1.5-2.3% on
// an H100 and lost 2.7% (backward) on an H200; random blocks (0.10) gained
// 16-19% on the H100 and 2% (backward) on the H200, whose DRAM is faster
// (bench/results/cuda-bsparse-order-2026-12-05-ea0af18.md).
constexpr double kLocalListOverlap = 0.25;
inline bool lists_are_local(const HostTileLists& l, int64_t slots) {
  return neighbour_overlap(l, slots) >= kLocalListOverlap;
}

// The dK/dV kernel's work items of KV-major lists: per slot, every tile's
// list cut evenly into items of at most max_item visits, longest first.
// The tiles cut into several items are numbered per slot in tile order
// (their accumulator slots); an uncut tile's items say -1.
inline void cut_work_items(HostTileLists& l, int64_t slots, int64_t max_item) {
  const int64_t tiles = l.tiles;
  l.items.clear();
  l.item_offsets.assign(1, 0);
  l.max_items = 0;
  l.max_cut = 0;
  std::vector<int32_t> items;  // (tile, begin, end, accumulator slot, length) before sorting
  std::vector<size_t> rank;
  std::vector<std::vector<int32_t>> cut(static_cast<size_t>(slots));  // per slot, its cut tiles
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t* off = l.offsets.data() + s * tiles;
    items.clear();
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n = off[t + 1] - off[t];
      const int64_t parts = std::max<int64_t>(1, (n + max_item - 1) / max_item);
      int32_t acc = -1;
      if (parts > 1) {
        acc = int32_t(cut[size_t(s)].size());
        cut[size_t(s)].push_back(int32_t(t));
      }
      for (int64_t k = 0; k < parts; ++k) {
        const int64_t a = off[t] + n * k / parts, e = off[t] + n * (k + 1) / parts;
        items.insert(items.end(), {int32_t(t), int32_t(a), int32_t(e), acc, int32_t(e - a)});
      }
    }
    const size_t count = items.size() / 5;
    rank.resize(count);
    for (size_t i = 0; i < count; ++i) rank[i] = i;
    std::stable_sort(rank.begin(), rank.end(),
                     [&](size_t x, size_t y) { return items[5 * x + 4] > items[5 * y + 4]; });
    for (size_t i : rank)
      l.items.insert(l.items.end(),
                     {items[5 * i], items[5 * i + 1], items[5 * i + 2], items[5 * i + 3]});
    l.item_offsets.push_back(int32_t(l.items.size() / flash::kItemWords));
    l.max_items = std::max(l.max_items, int32_t(count));
    l.max_cut = std::max(l.max_cut, int32_t(cut[size_t(s)].size()));
  }
  l.cut_tiles.assign(size_t(slots * l.max_cut), -1);
  for (int64_t s = 0; s < slots; ++s)
    std::copy(cut[size_t(s)].begin(), cut[size_t(s)].end(),
              l.cut_tiles.begin() + s * l.max_cut);
}

// Deals work to `blocks` blocks, in `order` (the queue's order; each entry
// a work number and its cost), each to the block that would be free first,
// counting start_cost for each one's start and end: the assignment a dynamic
// queue would make, fixed at plan creation. Per block its work in that
// order, [offsets[x], offsets[x + 1]).
inline void deal_work(const std::vector<std::pair<int32_t, int64_t>>& order, int64_t blocks,
                      int64_t start_cost, std::vector<int32_t>& dealt,
                      std::vector<int32_t>& offsets) {
  std::vector<std::vector<int32_t>> per(static_cast<size_t>(blocks));
  using Free = std::pair<int64_t, int64_t>;  // (time the block would be free, block)
  std::priority_queue<Free, std::vector<Free>, std::greater<Free>> free_at;
  for (int64_t x = 0; x < blocks; ++x) free_at.push({0, x});
  for (const auto& [work, cost] : order) {
    const Free f = free_at.top();
    free_at.pop();
    per[size_t(f.second)].push_back(work);
    free_at.push({f.first + cost + start_cost, f.second});
  }
  dealt.clear();
  offsets.assign(1, 0);
  for (const std::vector<int32_t>& w : per) {
    dealt.insert(dealt.end(), w.begin(), w.end());
    offsets.push_back(int32_t(dealt.size()));
  }
}

// The sm_90a forward's work items (flash::kSm90FwdItemWords words): the
// query-major lists' items of cut_work_items, one per tile (never cut), each
// widened by the KV tiles of its last two visits, which the kernel visits
// first and loads before its visit ring is filled. False (nothing changed)
// when some tile has other than one item.
inline bool widen_sm90_forward_items(HostTileLists& l, int64_t slots) {
  const size_t count = l.items.size() / flash::kItemWords;
  if (count != size_t(slots) * size_t(l.tiles)) return false;
  for (int64_t s = 0; s <= slots; ++s)
    if (l.item_offsets[size_t(s)] != int32_t(s * l.tiles)) return false;
  std::vector<int32_t> wide(count * flash::kSm90FwdItemWords, -1);
  for (size_t i = 0; i < count; ++i) {
    const int32_t* item = l.items.data() + flash::kItemWords * i;
    int32_t* w = wide.data() + flash::kSm90FwdItemWords * i;
    w[0] = item[0], w[1] = item[1], w[2] = item[2];
    if (item[2] > item[1]) w[3] = l.visits[2 * size_t(item[2] - 1)];
    if (item[2] - item[1] > 1) w[4] = l.visits[2 * size_t(item[2] - 2)];
  }
  l.items = std::move(wide);
  return true;
}

// The persistent forward's work (flash::TileLists::items): every
// (sequence, query head, query tile) of `batch` sequences of heads_q query
// heads (group per KV head), dealt to `blocks` blocks (deal_work; cost:
// the list's visits, start cost two visits' worth, a guess) in the order
// the one-block-per-tile forward starts its blocks (sequence by sequence,
// head by head, so that the blocks at work at one time share K and V in
// L2), each head's longest lists first. Per block, its items in that order,
// [item_offsets[x], item_offsets[x + 1]). False (nothing changed) when they
// would not fit 32-bit counts.
inline bool order_forward_items(HostTileLists& l, int64_t batch, int64_t heads_q, int64_t group,
                                int64_t mask_batch, int64_t mask_heads, int64_t blocks) {
  constexpr int W = flash::kItemWords;
  const int64_t tiles = l.tiles, count = batch * heads_q * tiles;
  if (count * W > INT32_MAX || blocks < 1 || blocks > INT32_MAX) return false;
  std::vector<int32_t> work;  // (b, h, tile, length), in the queue's order
  work.reserve(size_t(count) * W);
  std::vector<std::pair<int32_t, int64_t>> order;
  std::vector<int32_t> rank(static_cast<size_t>(tiles));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads_q; ++h) {
      const int64_t slot = (mask_batch > 1 ? b : 0) * mask_heads + (mask_heads > 1 ? h / group : 0);
      const int32_t* off = l.offsets.data() + slot * tiles;
      for (int64_t t = 0; t < tiles; ++t) rank[size_t(t)] = int32_t(t);
      std::stable_sort(rank.begin(), rank.end(), [&](int32_t x, int32_t y) {
        return off[x + 1] - off[x] > off[y + 1] - off[y];
      });
      for (int32_t t : rank) {
        const int32_t length = off[t + 1] - off[t];
        order.push_back({int32_t(work.size() / W), length});
        work.insert(work.end(), {int32_t(b), int32_t(h), t, length});
      }
    }
  std::vector<int32_t> dealt;
  deal_work(order, blocks, 2, dealt, l.item_offsets);
  l.items.clear();
  l.items.reserve(work.size());
  for (int32_t i : dealt)
    l.items.insert(l.items.end(), work.begin() + W * i, work.begin() + W * (i + 1));
  l.max_items = 0;
  for (size_t x = 0; x + 1 < l.item_offsets.size(); ++x)
    l.max_items = std::max(l.max_items, l.item_offsets[x + 1] - l.item_offsets[x]);
  return true;
}

// The persistent dK/dV kernel's work (KV-major lists, items cut): the
// blocks of the one-block-per-item grid (per sequence, grid_x = max_items
// item ranks by grid_y = heads_kv * group_splits blocks of heads_per query
// heads each, numbered b * grid_x * grid_y + rank * grid_y + part) that
// have an item, in that grid's launch order, dealt to `blocks` blocks
// (deal_work; cost: the item's visits times heads_per, start cost two
// visits' worth, a guess). False (nothing changed) when the numbers would
// not fit 32 bits.
inline bool deal_dkdv_work(HostTileLists& l, int64_t batch, int64_t heads_kv,
                           int64_t group_splits, int64_t heads_per, int64_t mask_batch,
                           int64_t mask_heads, int64_t blocks) {
  const int64_t gx = l.max_items, gy = heads_kv * group_splits;
  if (batch * gx * gy > INT32_MAX || blocks < 1 || blocks > INT32_MAX) return false;
  std::vector<std::pair<int32_t, int64_t>> order;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t lin = 0; lin < gx * gy; ++lin) {
      const int64_t rank = lin / gy, hk = (lin % gy) / group_splits;
      const int64_t slot = (mask_batch > 1 ? b : 0) * mask_heads + (mask_heads > 1 ? hk : 0);
      const int32_t i0 = l.item_offsets[size_t(slot)];
      if (rank >= l.item_offsets[size_t(slot) + 1] - i0) continue;
      const int32_t* item = l.items.data() + size_t(flash::kItemWords) * size_t(i0 + rank);
      order.push_back({int32_t(b * gx * gy + lin), int64_t(item[2] - item[1]) * heads_per});
    }
  deal_work(order, blocks, 2 * heads_per, l.dealt, l.dealt_offsets);
  l.grid_x = int32_t(gx);
  l.grid_y = int32_t(gy);
  return true;
}

// The lists of a tile_q x tile_kv kernel: per query tile its KV tiles
// (kv_major false: bit tiles of tile_q rows by tile_kv keys) or per KV tile
// its query tiles (kv_major true: bit tiles of tile_kv keys by tile_q rows,
// and one work item per tile).
inline HostTileLists build_tile_lists(const std::shared_ptr<const BlockMask>& mask,
                                      WindowBounds window, int64_t tile_q, int64_t tile_kv,
                                      bool kv_major) {
  const BlockMask& m = *mask;
  // Before the schedule, whose offsets are slots x tiles entries.
  check_tile_lists(m.batch() * m.heads(),
                   kv_major ? (m.seqlen_kv() + tile_kv - 1) / tile_kv
                            : (m.seqlen_q() + tile_q - 1) / tile_q);
  const BlockTileSchedule sched(mask, window, tile_q, tile_kv);
  const SequenceMask dense(m.seqlen_q(), m.seqlen_kv(), window);
  const int64_t lq = m.seqlen_q(), lk = m.seqlen_kv();
  const int64_t slots = m.batch() * m.heads();
  const int64_t tiles = kv_major ? sched.num_kv_tiles() : sched.num_q_tiles();
  const int64_t wpr_q = (tile_kv + 63) / 64;  // query-major words per row
  HostTileLists out;
  out.tiles = int32_t(tiles);
  out.rows = int32_t(kv_major ? tile_kv : tile_q);
  out.words_per_row = int32_t(kv_major ? (tile_q + 63) / 64 : wpr_q);
  const size_t tile_words = size_t(out.rows) * size_t(out.words_per_row);
  out.offsets.reserve(size_t(slots * tiles) + 1);
  out.offsets.push_back(0);

  std::vector<uint64_t> qm(size_t(tile_q * wpr_q));  // query-major pattern of one visit
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t mb = s / m.heads(), mh = s % m.heads();
    for (int64_t t = 0; t < tiles; ++t) {
      const auto list = kv_major ? sched.q_tiles_of(s, t) : sched.kv_tiles_of(s, t);
      for (const TileVisit& v : list) {
        const int64_t qt = kv_major ? v.tile : t, kt = kv_major ? t : v.tile;
        int32_t kind = flash::kVisitFull;
        // The schedule calls a KV tile clipped by the sequence's end full when
        // every key it has is visible; the kernels skip the predicate only on
        // whole tiles (their keys past the end are zeros, not absent).
        if (!v.full || (kt + 1) * tile_kv > lk) {
          // Visible pairs of the two tiles under the dense mask, minus what the
          // selection hides.
          std::fill(qm.begin(), qm.end(), 0);
          bool hidden = false;
          const int64_t c0 = kt * tile_kv, c1 = std::min(lk, c0 + tile_kv);
          for (int64_t r = 0; r < tile_q && qt * tile_q + r < lq; ++r) {
            const int64_t i = qt * tile_q + r;
            const int64_t a = std::max(dense.key_lo(i), c0), b = std::min(dense.key_hi(i) + 1, c1);
            if (a >= b) continue;
            uint64_t* row = qm.data() + r * wpr_q;
            for (int64_t j = a; j < b; ++j) row[(j - c0) >> 6] |= uint64_t(1) << ((j - c0) & 63);
            m.for_each_hidden(mb, mh, i, a, b, [&](int64_t j0, int64_t j1) {
              hidden = true;
              for (int64_t j = j0; j < j1; ++j) row[(j - c0) >> 6] &= ~(uint64_t(1) << ((j - c0) & 63));
            });
          }
          kind = flash::kVisitDense;
          if (hidden) {
            const size_t index = out.bits.size() / tile_words;
            if (index > size_t(INT32_MAX))
              not_supported("block mask: more than 2^31 bit tiles for the CUDA kernels");
            kind = int32_t(index);
            if (!kv_major) {
              out.bits.insert(out.bits.end(), qm.begin(), qm.end());
            } else {
              const size_t at = out.bits.size();
              out.bits.resize(at + tile_words, 0);
              const int64_t wpr = out.words_per_row;
              for (int64_t r = 0; r < tile_q; ++r)
                for (int64_t c = 0; c < tile_kv; ++c)
                  if ((qm[size_t(r * wpr_q + (c >> 6))] >> (c & 63)) & 1u)
                    out.bits[at + size_t(c * wpr + (r >> 6))] |= uint64_t(1) << (r & 63);
            }
          }
        }
        out.visits.push_back(int32_t(kv_major ? qt : kt));
        out.visits.push_back(kind);
      }
      if (out.visits.size() / 2 > size_t(INT32_MAX))
        not_supported("block mask: more than 2^31 tile visits for the CUDA kernels");
      out.offsets.push_back(int32_t(out.visits.size() / 2));
    }
  }
  if (kv_major) cut_work_items(out, slots, INT32_MAX);
  return out;
}

}  // namespace attn::cuda
