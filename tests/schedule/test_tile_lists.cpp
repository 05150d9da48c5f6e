// The tile lists the CUDA kernels walk (src/cuda/block_sparse.hpp), built on
// the host and checked here without a GPU, in every tile shape the CUDA
// plans use: the sm_90a forward's (192 x 128 at d = 64, 128 x 128 at
// d = 128, with one work item per query tile, longest list first), the
// sm_80 forward's (128 x 64) and the dK/dV kernels' KV-major lists (64 x 128
// and 128 x 128; the sm_90a dK/dV kernel's, from flash::bwd_sm90_config,
// with several words per bit-tile row at d = 64).
//
// Masks: random block selections (per block: none, whole, a random bit tile
// or a single selected pair, recorded as drawn: the oracle does not read
// the mask back through BlockMask) with block sizes that divide the tiles and ones
// that do not, under causal, sliding-window and no dense masks, odd lengths,
// per-sequence and per-head slots. For every listed visit, the pairs the kernel lets through
// (all for a full visit, the dense bounds for a dense one, the bit tile's
// bits otherwise) must be exactly the visible pairs (dense mask AND
// selection) inside the sequence, and at least one; full visits must not
// reach past the last key; and the visits of a tile must cover every visible
// pair of its rows.
// Seed printed; ATTN_TEST_SEED=n repeats a run.
#include <chrono>
#include <cmath>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "cuda/block_sparse.hpp"
#include "flash/bwd_params.cuh"

using namespace attn;
using attn::cuda::HostTileLists;

namespace {

int g_failures = 0;

void expect(bool ok, const char* what, const char* where) {
  if (ok) return;
  if (++g_failures <= 20) std::printf("FAIL %s: %s\n", where, what);
}

struct Shape {
  int64_t batch, heads, lq, lk, bq, bk;
  WindowBounds window;
};

// A random mask, and in `selected` [slot][i][j] the pairs it selects as
// drawn here (the oracle: not read back through the mask's own code).
std::shared_ptr<BlockMask> random_mask(const Shape& s, std::mt19937_64& rng,
                                       std::vector<uint8_t>& selected) {
  auto m = std::make_shared<BlockMask>(s.batch, s.heads, s.lq, s.lk, s.bq, s.bk);
  std::vector<uint64_t> tile(size_t(m->words_per_tile()));
  selected.assign(size_t(s.batch * s.heads * s.lq * s.lk), 0);
  auto record = [&](int64_t mb, int64_t mh, int64_t qb, int64_t kb, const uint64_t* bits) {
    for (int64_t r = 0; r < m->rows_in(qb); ++r)
      for (int64_t c = 0; c < m->cols_in(kb); ++c)
        if (bits == nullptr || ((bits[r * m->words_per_row() + c / 64] >> (c % 64)) & 1u))
          selected[size_t((((mb * s.heads + mh) * s.lq) + qb * s.bq + r) * s.lk + kb * s.bk + c)] = 1;
  };
  for (int64_t mb = 0; mb < s.batch; ++mb)
    for (int64_t mh = 0; mh < s.heads; ++mh)
      for (int64_t qb = 0; qb < m->num_q_blocks(); ++qb)
        for (int64_t kb = 0; kb < m->num_kv_blocks(); ++kb) {
          const uint64_t r = rng() % 10;
          if (r < 4) continue;  // none
          if (r < 6) {
            m->add(mb, mh, qb, kb, nullptr);  // whole
            record(mb, mh, qb, kb, nullptr);
            continue;
          }
          if (r < 9) {
            for (uint64_t& w : tile) w = rng() & rng();  // about a quarter of the pairs
          } else {
            // One pair: most tiles the block overlaps hold none of it.
            std::fill(tile.begin(), tile.end(), 0);
            const int64_t row = int64_t(rng() % uint64_t(m->rows_in(qb)));
            const int64_t col = int64_t(rng() % uint64_t(m->cols_in(kb)));
            tile[size_t(row * m->words_per_row() + col / 64)] = uint64_t(1) << (col % 64);
          }
          m->add(mb, mh, qb, kb, tile.data());
          record(mb, mh, qb, kb, tile.data());
        }
  return m;
}

// Checks the lists of a tile_q x tile_kv kernel against brute force.
void check(const Shape& s, int64_t tile_q, int64_t tile_kv, bool kv_major, bool items,
           std::mt19937_64& rng, const char* name) {
  std::vector<uint8_t> selected;
  const std::shared_ptr<BlockMask> mask = random_mask(s, rng, selected);
  const SequenceMask dense(s.lq, s.lk, s.window);
  const int64_t slots = s.batch * s.heads;
  // visible[slot][i][j]: the dense mask and the selection as drawn.
  std::vector<uint8_t> visible(size_t(slots * s.lq * s.lk), 0);
  for (int64_t k = 0; k < slots; ++k)
    for (int64_t i = 0; i < s.lq; ++i) {
      const int64_t lo = dense.key_lo(i), hi = dense.key_hi(i);
      const size_t row = size_t((k * s.lq + i) * s.lk);
      for (int64_t j = lo; j <= hi; ++j) visible[row + size_t(j)] = selected[row + size_t(j)];
    }

  HostTileLists l = cuda::build_tile_lists(mask, s.window, tile_q, tile_kv, kv_major);
  if (items) cuda::cut_work_items(l, slots, INT32_MAX);
  const int64_t nqt = (s.lq + tile_q - 1) / tile_q, nkt = (s.lk + tile_kv - 1) / tile_kv;
  const int64_t tiles = kv_major ? nkt : nqt;
  expect(l.tiles == tiles, "lists per slot", name);
  expect(l.rows == (kv_major ? tile_kv : tile_q), "bit tile rows", name);
  expect(l.words_per_row == ((kv_major ? tile_q : tile_kv) + 63) / 64, "bit tile words per row",
         name);
  expect(int64_t(l.offsets.size()) == slots * tiles + 1, "offsets", name);
  if (g_failures > 0) return;
  const size_t tile_words = size_t(l.rows) * size_t(l.words_per_row);

  std::vector<uint8_t> covered;
  for (int64_t k = 0; k < slots; ++k) {
    for (int64_t t = 0; t < tiles; ++t) {
      // Pairs (query tile rows or KV tile keys) x (all keys or all rows).
      covered.assign(size_t(kv_major ? tile_kv * s.lq : tile_q * s.lk), 0);
      int32_t last = -1;
      for (int32_t v = l.offsets[size_t(k * tiles + t)]; v < l.offsets[size_t(k * tiles + t) + 1];
           ++v) {
        const int32_t other = l.visits[size_t(2 * v)], kind = l.visits[size_t(2 * v) + 1];
        expect(other > last && other < (kv_major ? nqt : nkt), "visits in increasing order", name);
        last = other;
        const int64_t qt = kv_major ? other : t, kt = kv_major ? t : other;
        if (kind == flash::kVisitFull)
          expect((kt + 1) * tile_kv <= s.lk, "a full visit reaches past the last key", name);
        const bool kind_ok = kind == flash::kVisitFull || kind == flash::kVisitDense ||
                             (kind >= 0 && size_t(kind + 1) * tile_words <= l.bits.size());
        expect(kind_ok, "visit kind", name);
        if (!kind_ok) continue;
        bool any = false;
        for (int64_t r = 0; r < tile_q; ++r)
          for (int64_t c = 0; c < tile_kv; ++c) {
            const int64_t i = qt * tile_q + r, j = kt * tile_kv + c;
            bool through;  // what the kernel lets through
            if (kind == flash::kVisitFull) {
              through = true;
            } else if (kind == flash::kVisitDense) {
              through = j >= dense.key_lo(i) && j <= dense.key_hi(i);
            } else {
              const uint64_t* bits = l.bits.data() + size_t(kind) * tile_words;
              // Query-major: row r, bit c; KV-major: row c, bit r.
              const int64_t row = kv_major ? c : r, col = kv_major ? r : c;
              through = (bits[size_t(row * l.words_per_row + col / 64)] >> (col % 64)) & 1u;
              if (i >= s.lq || j >= s.lk) expect(!through, "bits outside the sequence", name);
            }
            if (i >= s.lq || j >= s.lk) continue;  // not written / zero keys
            const bool want = visible[size_t((k * s.lq + i) * s.lk + j)] != 0;
            expect(through == want, "the pairs a visit lets through", name);
            if (through) covered[size_t(kv_major ? c * s.lq + i : r * s.lk + j)] = 1;
            any = any || through;
          }
        // A pair is listed only when it holds a visible pair.
        expect(any, "a visit that lets nothing through", name);
      }
      // Every visible pair of the tile is visited.
      for (int64_t a = 0; a < (kv_major ? tile_kv : tile_q); ++a)
        for (int64_t b = 0; b < (kv_major ? s.lq : s.lk); ++b) {
          const int64_t i = kv_major ? b : t * tile_q + a, j = kv_major ? t * tile_kv + a : b;
          if (i >= s.lq || j >= s.lk || !visible[size_t((k * s.lq + i) * s.lk + j)]) continue;
          expect(covered[size_t(a * (kv_major ? s.lq : s.lk) + b)] != 0, "a visible pair not visited",
                 name);
        }
    }
    if (!items && !kv_major) continue;
    // Work items: one per tile, its whole list, longest first.
    std::vector<uint8_t> seen(size_t(tiles), 0);
    int32_t prev = INT32_MAX;
    expect(int64_t(l.item_offsets.size()) == slots + 1, "item offsets", name);
    expect(l.item_offsets[size_t(k) + 1] - l.item_offsets[size_t(k)] == tiles, "items per slot",
           name);
    for (int32_t it = l.item_offsets[size_t(k)]; it < l.item_offsets[size_t(k) + 1]; ++it) {
      const int32_t* item = l.items.data() + size_t(flash::kItemWords) * size_t(it);
      const int32_t t = item[0], a = item[1], e = item[2];
      expect(item[3] == -1, "an uncut list has no accumulator slot", name);
      expect(t >= 0 && t < tiles && !seen[size_t(t)], "each tile once", name);
      if (t < 0 || t >= tiles) continue;
      seen[size_t(t)] = 1;
      expect(a == l.offsets[size_t(k * tiles + t)] && e == l.offsets[size_t(k * tiles + t) + 1],
             "an item holds its tile's list", name);
      expect(e - a <= prev, "items longest first", name);
      prev = e - a;
    }
  }
  if (!items || kv_major) return;
  // The sm_90a forward's widened items: item x of slot k at k * tiles + x,
  // the narrow item's words, then the KV tiles of its last two visits.
  HostTileLists w = l;
  expect(cuda::widen_sm90_forward_items(w, slots), "widened", name);
  expect(w.items.size() == l.items.size() / flash::kItemWords * flash::kSm90FwdItemWords,
         "widened item words", name);
  if (g_failures > 0) return;
  for (size_t i = 0; i < l.items.size() / flash::kItemWords; ++i) {
    const int32_t* n = l.items.data() + flash::kItemWords * i;
    const int32_t* x = w.items.data() + flash::kSm90FwdItemWords * i;
    const int32_t len = n[2] - n[1];
    expect(x[0] == n[0] && x[1] == n[1] && x[2] == n[2], "widened: the item's words", name);
    expect(x[3] == (len > 0 ? l.visits[size_t(2 * (n[2] - 1))] : -1), "widened: last visit's tile",
           name);
    expect(x[4] == (len > 1 ? l.visits[size_t(2 * (n[2] - 2))] : -1),
           "widened: second-to-last visit's tile", name);
    expect(x[5] == -1 && x[6] == -1 && x[7] == -1, "widened: unused words", name);
  }
  // Lists cut into several items are refused, nothing changed.
  HostTileLists c = l;
  cuda::cut_work_items(c, slots, 1);
  const bool some_cut = c.items.size() != l.items.size();
  const std::vector<int32_t> before = c.items;
  expect(cuda::widen_sm90_forward_items(c, slots) == !some_cut, "cut lists refused", name);
  if (some_cut) expect(c.items == before, "refused: items unchanged", name);
}

}  // namespace

// BlockMask::crop: entry mb's selection over shorter lengths (a varlen
// batch's sequence under a mask of the longest one) is exactly the drawn
// selection's corner.
void check_crop(std::mt19937_64& rng) {
  const Shape s{2, 2, 300, 260, 48, 80, WindowBounds{-1, -1}};
  std::vector<uint8_t> selected;
  const std::shared_ptr<BlockMask> mask = random_mask(s, rng, selected);
  const int64_t lens[][2] = {{300, 260}, {150, 200}, {47, 81}, {0, 100}, {120, 0}, {1, 1}};
  for (int64_t mb = 0; mb < s.batch; ++mb)
    for (const auto& l : lens) {
      const BlockMask crop = mask->crop(mb, l[0], l[1]);
      expect(crop.batch() == 1 && crop.heads() == s.heads && crop.seqlen_q() == l[0] &&
                 crop.seqlen_kv() == l[1],
             "crop geometry", "crop");
      for (int64_t mh = 0; mh < s.heads; ++mh)
        for (int64_t i = 0; i < l[0]; ++i) {
          std::vector<uint8_t> row(size_t(l[1]), 1);
          crop.for_each_hidden(0, mh, i, 0, l[1], [&](int64_t j0, int64_t j1) {
            for (int64_t j = j0; j < j1; ++j) row[size_t(j)] = 0;
          });
          for (int64_t j = 0; j < l[1]; ++j)
            if (row[size_t(j)] != selected[size_t(((mb * s.heads + mh) * s.lq + i) * s.lk + j)]) {
              expect(false, "a cropped pair differs from the drawn selection", "crop");
              return;
            }
        }
    }
  std::printf("ok   crop of a mask to shorter lengths\n");
}

// neighbour_overlap on hand-made lists: the mean share of a list's tiles
// that the next list of its slot visits too, over lists with visits and a
// next one (not across slots).
void check_neighbour_overlap() {
  auto lists = [](int32_t tiles, const std::vector<std::vector<int32_t>>& per_list) {
    HostTileLists l;
    l.tiles = tiles;
    l.offsets.push_back(0);
    for (const auto& list : per_list) {
      for (int32_t t : list) l.visits.insert(l.visits.end(), {t, 0});
      l.offsets.push_back(int32_t(l.visits.size() / 2));
    }
    return l;
  };
  const double band = cuda::neighbour_overlap(lists(4, {{0, 1}, {1, 2}, {2, 3}, {3}}), 1);
  // Slot 0: {5, 6} against the empty list next: 0; the empty list has no
  // share; {6} is last of its slot. Slot 1: {0, 1, 2, 3} against {3, 9}:
  // 1/4; {3, 9} against the empty list: 0. Mean of 0, 1/4 and 0.
  const double two = cuda::neighbour_overlap(
      lists(3, {{5, 6}, {}, {6}, {0, 1, 2, 3}, {3, 9}, {}}), 2);
  const double none = cuda::neighbour_overlap(lists(2, {{}, {}}), 1);
  const bool ok = band == 0.5 && std::fabs(two - 1.0 / 12.0) < 1e-12 && none == 1.0;
  expect(ok, "neighbour_overlap of hand-made lists", "neighbour_overlap");
  std::printf("%s neighbour_overlap: band %.3f (0.5), two slots %.3f (1/12), empty %.1f (1)\n",
              ok ? "ok  " : "FAIL", band, two, none);
}

// lists_are_local on the masks the head groups were measured with
// (bench/bench_sparse_flex.py: L = 32K, 128 x 128 blocks, causal): window
// 4096 + 64 sinks and BigBird (window of one block, 2 global blocks each
// way, 3 random per row) local, keeping one group of heads; 10% random
// blocks plus the diagonal not. In the sm_90a forward's tiles and the
// sm_90a dK/dV kernel's (d = 128).
void check_local_lists(std::mt19937_64& rng) {
  const int64_t nb = 256, b = 128, l = nb * b;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const char* names[] = {"window-sinks", "bigbird", "random"};
  const flash::BwdSm90Config c = flash::bwd_sm90_config(128);
  for (int kind = 0; kind < 3; ++kind) {
    auto m = std::make_shared<BlockMask>(1, 1, l, l, b, b);
    for (int64_t q = 0; q < nb; ++q) {
      std::vector<char> sel(size_t(nb), 0);
      for (int64_t k = 0; k <= q; ++k)
        sel[size_t(k)] = kind == 0   ? q - k <= 32 || k == 0
                         : kind == 1 ? q - k <= 1 || k < 2 || q < 2
                                     : u(rng) < 0.1 || k == q;
      if (kind == 1)
        for (int r = 0; r < 3; ++r) {
          const int64_t k = int64_t(rng() % uint64_t(nb));
          if (k <= q) sel[size_t(k)] = 1;
        }
      for (int64_t k = 0; k < nb; ++k)
        if (sel[size_t(k)]) m->add(0, 0, q, k, nullptr);
    }
    const WindowBounds causal{-1, 0};
    const HostTileLists fwd = cuda::build_tile_lists(m, causal, 128, 128, false);
    const HostTileLists kv = cuda::build_tile_lists(m, causal, c.block_m, c.block_n, true);
    const bool want = kind < 2, f = cuda::lists_are_local(fwd, 1), k = cuda::lists_are_local(kv, 1);
    expect(f == want && k == want, "lists_are_local of a measured mask", names[kind]);
    std::printf("%s lists_are_local %s: forward %d (overlap %.2f), dK/dV %d (%.2f), want %d\n",
                f == want && k == want ? "ok  " : "FAIL", names[kind], f,
                cuda::neighbour_overlap(fwd, 1), k, cuda::neighbour_overlap(kv, 1), want);
  }
}

int main() {
  const char* env = std::getenv("ATTN_TEST_SEED");
  const uint64_t seed = env ? std::strtoull(env, nullptr, 10)
                            : uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)\n", seed, seed);
  std::mt19937_64 rng(seed);
  const WindowBounds none{-1, -1}, causal{-1, 0}, window{200, 30};
  struct Case {
    const char* name;
    Shape s;
    int64_t tile_q, tile_kv;
    bool kv_major, items;
  };
  const Case cases[] = {
      // The sm_90a forward, d = 64 (192 x 128) and d = 128 (128 x 128).
      {"sm90-d64-b80-causal", {1, 1, 700, 900, 80, 80, causal}, 192, 128, false, true},
      {"sm90-d64-b32-none-per-batch", {2, 1, 450, 420, 32, 32, none}, 192, 128, false, true},
      {"sm90-d64-b96-window-per-head", {1, 2, 650, 650, 96, 96, window}, 192, 128, false, true},
      {"sm90-d64-b192x64-none", {1, 1, 500, 460, 192, 64, none}, 192, 128, false, true},
      {"sm90-d128-b128-causal", {1, 2, 400, 389, 128, 128, causal}, 128, 128, false, true},
      {"sm90-d128-b48x100-window", {2, 1, 333, 333, 48, 100, window}, 128, 128, false, true},
      // The sm_80 forward and the dK/dV kernel's KV-major lists.
      {"sm80-fwd-b48x80-causal", {1, 1, 277, 300, 48, 80, causal}, 128, 64, false, false},
      {"dkdv-64x128-b96-window", {1, 2, 390, 420, 96, 96, window}, 64, 128, true, false},
      {"dkdv-128x128-b64-causal", {2, 1, 300, 300, 64, 64, causal}, 128, 128, true, false},
      // The sm_90a dK/dV kernel's KV-major lists, d = 64 and 128.
      {"dkdv-sm90-d64-b80-causal", {1, 2, 333, 401, 80, 80, causal},
       flash::bwd_sm90_config(64).block_m, flash::bwd_sm90_config(64).block_n, true, false},
      {"dkdv-sm90-d128-b48x96-window", {2, 1, 290, 310, 48, 96, window},
       flash::bwd_sm90_config(128).block_m, flash::bwd_sm90_config(128).block_n, true, false},
  };
  for (const Case& c : cases) {
    const int before = g_failures;
    check(c.s, c.tile_q, c.tile_kv, c.kv_major, c.items, rng, c.name);
    std::printf("%s %s\n", g_failures == before ? "ok  " : "FAIL", c.name);
  }
  check_crop(rng);
  check_neighbour_overlap();
  check_local_lists(rng);
  std::printf("%d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
