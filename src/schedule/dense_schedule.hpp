// Tile schedules of the dense family (full, causal, sliding window), computed
// by arithmetic on tile coordinates.
//
// For one sequence with lq queries and lk keys, off = lk - lq aligns the last
// query with the last key (bottom-right). Query i sees key j when
//     i + off - left <= j <= i + off + right
// with a negative bound meaning unbounded on that side. Both bounds are
// non-decreasing in i, which is what makes every range below a single
// interval:
//   - a query row sees the key interval [key_lo(i), key_hi(i)];
//   - a query tile visits the KV tiles that cover [key_lo(first row),
//     key_hi(last row)]; a visited KV tile is *full* when every (row, key)
//     pair of the two tiles is visible, else *partial* and the per-element
//     predicate applies;
//   - the transpose (which query tiles see a KV tile, used by the backward
//     pass for dK and dV) is the same reasoning with rows and keys swapped.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attn {

// A key window relative to the aligned diagonal; -1 = unbounded.
struct WindowBounds {
  int64_t left = -1;
  int64_t right = -1;
};

struct TileRange {
  int64_t begin = 0;  // first tile index
  int64_t end = 0;    // one past the last; begin == end: nothing to visit
};

class SequenceMask {
 public:
  SequenceMask(int64_t lq, int64_t lk, WindowBounds w) : lq_(lq), lk_(lk), w_(w), off_(lk - lq) {}
  // An explicit diagonal offset: a block cut out of a longer sequence (a
  // ring step) keeps its global alignment, query i then lining up with key
  // i + off. With it a row may also be emptied by the left bound.
  SequenceMask(int64_t lq, int64_t lk, WindowBounds w, int64_t off)
      : lq_(lq), lk_(lk), w_(w), off_(off) {}

  int64_t lq() const { return lq_; }
  int64_t lk() const { return lk_; }

  // First and last visible key of query row i (key_lo > key_hi: none).
  int64_t key_lo(int64_t i) const { return w_.left < 0 ? 0 : std::max<int64_t>(0, i + off_ - w_.left); }
  int64_t key_hi(int64_t i) const {
    return w_.right < 0 ? lk_ - 1 : std::min<int64_t>(lk_ - 1, i + off_ + w_.right);
  }
  bool visible(int64_t i, int64_t j) const { return j >= key_lo(i) && j <= key_hi(i); }

  // First and last query row that sees key j (row_lo > row_hi: none).
  int64_t row_lo(int64_t j) const {
    return w_.right < 0 ? 0 : std::max<int64_t>(0, j - off_ - w_.right);
  }
  int64_t row_hi(int64_t j) const {
    return w_.left < 0 ? lq_ - 1 : std::min<int64_t>(lq_ - 1, j - off_ + w_.left);
  }

  // Number of query rows that see no key: rows with i + off + right < 0
  // (before the first key) or i + off - left > lk - 1 (past the last).
  int64_t empty_rows() const {
    if (lk_ == 0) return lq_;
    const int64_t first = w_.right < 0 ? 0 : std::clamp<int64_t>(-off_ - w_.right, 0, lq_);
    const int64_t end = w_.left < 0 ? lq_ : std::clamp<int64_t>(lk_ + w_.left - off_, 0, lq_);
    return lq_ - std::max<int64_t>(0, end - first);
  }

  // Visible (query, key) pairs.
  int64_t visible_pairs() const {
    int64_t pairs = 0;
    for (int64_t i = 0; i < lq_; ++i) pairs += std::max<int64_t>(0, key_hi(i) - key_lo(i) + 1);
    return pairs;
  }

 private:
  int64_t lq_, lk_;
  WindowBounds w_;
  int64_t off_;
};

// Tiles of tile_q query rows by tile_kv keys over one sequence.
class DenseTileSchedule {
 public:
  DenseTileSchedule(const SequenceMask& mask, int64_t tile_q, int64_t tile_kv)
      : mask_(mask), tq_(tile_q), tk_(tile_kv) {}

  int64_t num_q_tiles() const { return (mask_.lq() + tq_ - 1) / tq_; }
  int64_t num_kv_tiles() const { return (mask_.lk() + tk_ - 1) / tk_; }
  int64_t q_begin(int64_t t) const { return t * tq_; }
  int64_t q_end(int64_t t) const { return std::min(mask_.lq(), (t + 1) * tq_); }
  int64_t kv_begin(int64_t t) const { return t * tk_; }
  int64_t kv_end(int64_t t) const { return std::min(mask_.lk(), (t + 1) * tk_); }

  // KV tiles visited by query tile qt.
  TileRange kv_tiles_of(int64_t qt) const {
    int64_t lo = mask_.key_lo(q_begin(qt));
    int64_t hi = mask_.key_hi(q_end(qt) - 1);
    if (lo > hi) return {0, 0};
    return {lo / tk_, hi / tk_ + 1};
  }

  // Query tiles that visit KV tile kt (the transpose).
  TileRange q_tiles_of(int64_t kt) const {
    int64_t lo = mask_.row_lo(kv_begin(kt));
    int64_t hi = mask_.row_hi(kv_end(kt) - 1);
    if (lo > hi) return {0, 0};
    return {lo / tq_, hi / tq_ + 1};
  }

  // True when every pair of (query tile qt, KV tile kt) is visible, so no
  // element predicate is needed.
  bool is_full(int64_t qt, int64_t kt) const {
    int64_t r0 = q_begin(qt), r1 = q_end(qt) - 1;
    int64_t c0 = kv_begin(kt), c1 = kv_end(kt) - 1;
    return mask_.key_lo(r1) <= c0 && c1 <= mask_.key_hi(r0);
  }

  const SequenceMask& mask() const { return mask_; }

 private:
  SequenceMask mask_;
  int64_t tq_, tk_;
};

}  // namespace attn
