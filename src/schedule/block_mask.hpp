// A block mask (attn_block_mask_t): for every (batch, KV head, query block),
// the KV blocks whose elements the query block may see, each either whole
// ("full") or through a bit tile of block_q x block_kv bits. The plan's dense
// mask (causal, window) applies on top; see attn.h for the semantics.
//
// The representation is canonical, so that two masks that select the same
// elements compare equal: a listed block selects at least one element that
// lies inside the sequences, a bit tile has no bit set outside them, and a
// block whose every in-range element is selected is stored as full.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.hpp"

namespace attn {

class BlockMask {
 public:
  // One listed KV block; tile == kWhole: every element.
  struct Entry {
    int32_t kv_block;
    int32_t tile;
  };
  static constexpr int32_t kWhole = -1;

  BlockMask(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_kv, int64_t block_q,
            int64_t block_kv);

  int64_t batch() const { return batch_; }
  int64_t heads() const { return heads_; }
  int64_t seqlen_q() const { return lq_; }
  int64_t seqlen_kv() const { return lk_; }
  int64_t block_q() const { return bq_; }
  int64_t block_kv() const { return bk_; }
  int64_t num_q_blocks() const { return nqb_; }
  int64_t num_kv_blocks() const { return nkb_; }
  // A bit tile: tile_rows() rows of words_per_row 64-bit words, bit c of
  // row r at word r * words_per_row + c / 64, bit c % 64. A tile holds only
  // the rows and columns a block can have inside the sequences (at most
  // min(block, seqlen) of each), so that a block size far above the lengths
  // costs nothing (blocks go up to 65536).
  int64_t tile_rows() const { return std::max<int64_t>(1, std::min(bq_, lq_)); }
  int64_t words_per_row() const { return (std::max<int64_t>(1, std::min(bk_, lk_)) + 63) / 64; }
  int64_t words_per_tile() const { return tile_rows() * words_per_row(); }
  // Rows / columns of block qb / kb that lie inside the sequence.
  int64_t rows_in(int64_t qb) const { return std::min(bq_, lq_ - qb * bq_); }
  int64_t cols_in(int64_t kb) const { return std::min(bk_, lk_ - kb * bk_); }

  // The listed blocks of (mask batch mb, mask head mh, query block qb),
  // sorted by kv_block.
  const std::vector<Entry>& row(int64_t mb, int64_t mh, int64_t qb) const {
    return rows_[size_t((mb * heads_ + mh) * nqb_ + qb)];
  }
  const uint64_t* tile_bits(int32_t tile) const {
    return bits_.data() + size_t(tile) * size_t(words_per_tile());
  }

  // ORs a pattern into block (qb, kb): `tile` (words_per_tile words in the
  // layout above, bits outside the sequence ignored) or, when null, every
  // element.
  void add(int64_t mb, int64_t mh, int64_t qb, int64_t kb, const uint64_t* tile);

  // Keeps only the selected elements for which keep(mb, mh, i, j) holds
  // (an AND with an element predicate).
  template <class Keep>
  void restrict_to(Keep keep);

  // Calls hide(j0, j1) for each maximal range [j0, j1) of keys in [c0, c1)
  // that the selection hides in query row i.
  template <class Hide>
  void for_each_hidden(int64_t mb, int64_t mh, int64_t i, int64_t c0, int64_t c1, Hide hide) const;

  // Selected keys of row i in [c0, c1).
  int64_t count_selected(int64_t mb, int64_t mh, int64_t i, int64_t c0, int64_t c1) const;

  // The longest list of whole blocks and of blocks with bit tiles.
  void max_entries(int64_t* whole, int64_t* partial) const;

  // A copy without the bit tiles no entry refers to any more.
  BlockMask compacted() const;

  // Mask batch entry mb's selection over a sequence of lq queries and lk
  // keys (at most the mask's lengths), counted from its first position, as
  // a mask of batch 1: the blocks of [0, lq) x [0, lk), canonical for those
  // lengths (a varlen batch's sequence under a mask of the longest one's).
  BlockMask crop(int64_t mb, int64_t lq, int64_t lk) const;

 private:
  std::vector<Entry>& row_mut(int64_t mb, int64_t mh, int64_t qb) {
    return rows_[size_t((mb * heads_ + mh) * nqb_ + qb)];
  }
  // 0: no in-range bit set, 1: some, 2: all. Clears bits outside the sequence.
  int classify(uint64_t* tile, int64_t qb, int64_t kb) const;
  // The index the next bit tile appended gets. Entry::tile is int32, so a
  // mask holds at most 2^31 - 1 of them; past that, INVALID_ARGUMENT (the
  // callers build on a copy, so the mask stays as it was).
  int32_t next_tile() const;

  int64_t batch_, heads_, lq_, lk_, bq_, bk_, nqb_, nkb_;
  std::vector<std::vector<Entry>> rows_;  // [batch][heads][num_q_blocks]
  std::vector<uint64_t> bits_;            // bit tiles, words_per_tile words each
};

inline bool tile_bit(const uint64_t* tile, int64_t words_per_row, int64_t r, int64_t c) {
  return (tile[r * words_per_row + (c >> 6)] >> (c & 63)) & 1u;
}

template <class Hide>
void BlockMask::for_each_hidden(int64_t mb, int64_t mh, int64_t i, int64_t c0, int64_t c1,
                                Hide hide) const {
  const int64_t qb = i / bq_, r = i - qb * bq_, wpr = words_per_row();
  const std::vector<Entry>& list = row(mb, mh, qb);
  auto it = std::lower_bound(list.begin(), list.end(), int32_t(c0 / bk_),
                             [](const Entry& e, int32_t kb) { return e.kv_block < kb; });
  int64_t cur = c0;
  for (; it != list.end() && int64_t(it->kv_block) * bk_ < c1; ++it) {
    const int64_t base = int64_t(it->kv_block) * bk_;
    const int64_t b0 = std::max(base, c0), b1 = std::min(base + bk_, c1);
    if (b0 > cur) hide(cur, b0);
    if (it->tile != kWhole) {
      const uint64_t* t = tile_bits(it->tile);
      int64_t run = -1;
      for (int64_t j = b0; j < b1; ++j) {
        if (!tile_bit(t, wpr, r, j - base)) {
          if (run < 0) run = j;
        } else if (run >= 0) {
          hide(run, j);
          run = -1;
        }
      }
      if (run >= 0) hide(run, b1);
    }
    cur = b1;
  }
  if (cur < c1) hide(cur, c1);
}

template <class Keep>
void BlockMask::restrict_to(Keep keep) {
  std::vector<uint64_t> tile(static_cast<size_t>(words_per_tile()));
  const int64_t wpr = words_per_row();
  for (int64_t mb = 0; mb < batch_; ++mb)
    for (int64_t mh = 0; mh < heads_; ++mh)
      for (int64_t qb = 0; qb < nqb_; ++qb) {
        std::vector<Entry>& list = row_mut(mb, mh, qb);
        std::vector<Entry> kept;
        for (const Entry& e : list) {
          std::fill(tile.begin(), tile.end(), 0);
          const uint64_t* old = e.tile == kWhole ? nullptr : tile_bits(e.tile);
          for (int64_t r = 0; r < rows_in(qb); ++r)
            for (int64_t c = 0; c < cols_in(e.kv_block); ++c)
              if ((old == nullptr || tile_bit(old, wpr, r, c)) &&
                  keep(mb, mh, qb * bq_ + r, int64_t(e.kv_block) * bk_ + c))
                tile[size_t(r * wpr + (c >> 6))] |= uint64_t(1) << (c & 63);
          const int kind = classify(tile.data(), qb, e.kv_block);
          if (kind == 0) continue;
          if (kind == 2) {
            kept.push_back({e.kv_block, kWhole});
          } else if (e.tile != kWhole) {
            std::copy(tile.begin(), tile.end(), bits_.begin() + e.tile * words_per_tile());
            kept.push_back(e);
          } else {
            const int32_t index = next_tile();
            bits_.insert(bits_.end(), tile.begin(), tile.end());
            kept.push_back({e.kv_block, index});
          }
        }
        list = std::move(kept);
      }
}

}  // namespace attn
