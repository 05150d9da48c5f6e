#include "schedule/block_mask.hpp"

#include <bit>
#include <limits>

namespace attn {

BlockMask::BlockMask(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_kv,
                     int64_t block_q, int64_t block_kv)
    : batch_(batch), heads_(heads), lq_(seqlen_q), lk_(seqlen_kv), bq_(block_q), bk_(block_kv),
      nqb_((seqlen_q + block_q - 1) / block_q), nkb_((seqlen_kv + block_kv - 1) / block_kv),
      rows_(size_t(batch * heads * nqb_)) {}

int BlockMask::classify(uint64_t* tile, int64_t qb, int64_t kb) const {
  const int64_t rows = rows_in(qb), cols = cols_in(kb), wpr = words_per_row();
  bool any = false, all = true;
  for (int64_t r = 0; r < tile_rows(); ++r)
    for (int64_t w = 0; w < wpr; ++w) {
      uint64_t& word = tile[r * wpr + w];
      const int64_t c0 = w * 64;
      const int64_t valid = r < rows ? std::clamp<int64_t>(cols - c0, 0, 64) : 0;
      const uint64_t in = valid == 64 ? ~uint64_t(0) : (uint64_t(1) << valid) - 1;
      word &= in;
      any = any || word != 0;
      all = all && word == in;
    }
  return any ? (all ? 2 : 1) : 0;
}

void BlockMask::add(int64_t mb, int64_t mh, int64_t qb, int64_t kb, const uint64_t* tile) {
  std::vector<Entry>& list = row_mut(mb, mh, qb);
  auto it = std::lower_bound(list.begin(), list.end(), int32_t(kb),
                             [](const Entry& e, int32_t k) { return e.kv_block < k; });
  const bool present = it != list.end() && it->kv_block == kb;
  if (present && it->tile == kWhole) return;
  const size_t wpt = size_t(words_per_tile());
  if (tile == nullptr && rows_in(qb) > 0 && cols_in(kb) > 0) {  // every element: whole
    if (present)
      it->tile = kWhole;
    else
      list.insert(it, Entry{int32_t(kb), kWhole});
    return;
  }
  std::vector<uint64_t> merged(wpt, ~uint64_t(0));
  if (tile != nullptr) {
    std::copy(tile, tile + wpt, merged.begin());
    if (present) {
      const uint64_t* old = tile_bits(it->tile);
      for (size_t w = 0; w < wpt; ++w) merged[w] |= old[w];
    }
  }
  const int kind = classify(merged.data(), qb, kb);
  if (kind == 0) return;  // selects nothing (and nothing was there)
  if (kind == 2) {
    if (present)
      it->tile = kWhole;
    else
      list.insert(it, Entry{int32_t(kb), kWhole});
    return;
  }
  if (present) {
    std::copy(merged.begin(), merged.end(), bits_.begin() + size_t(it->tile) * wpt);
    return;
  }
  const int32_t index = next_tile();
  list.insert(it, Entry{int32_t(kb), index});
  bits_.insert(bits_.end(), merged.begin(), merged.end());
}

int32_t BlockMask::next_tile() const {
  const size_t n = bits_.size() / size_t(words_per_tile());
  if (n >= size_t(std::numeric_limits<int32_t>::max()))
    invalid_argument("mask: more than 2^31 - 1 partial blocks (blocks with bit tiles)");
  return int32_t(n);
}

int64_t BlockMask::count_selected(int64_t mb, int64_t mh, int64_t i, int64_t c0,
                                  int64_t c1) const {
  if (c0 >= c1) return 0;
  const int64_t qb = i / bq_, r = i - qb * bq_, wpr = words_per_row();
  const std::vector<Entry>& list = row(mb, mh, qb);
  auto it = std::lower_bound(list.begin(), list.end(), int32_t(c0 / bk_),
                             [](const Entry& e, int32_t kb) { return e.kv_block < kb; });
  int64_t n = 0;
  for (; it != list.end() && int64_t(it->kv_block) * bk_ < c1; ++it) {
    const int64_t base = int64_t(it->kv_block) * bk_;
    const int64_t b0 = std::max(base, c0) - base, b1 = std::min(base + bk_, c1) - base;
    if (it->tile == kWhole) {
      n += b1 - b0;
      continue;
    }
    const uint64_t* words = tile_bits(it->tile) + r * wpr;
    for (int64_t w = b0 / 64; w * 64 < b1; ++w) {
      const int64_t lo = std::max<int64_t>(b0 - w * 64, 0), hi = std::min<int64_t>(b1 - w * 64, 64);
      uint64_t m = hi == 64 ? ~uint64_t(0) : (uint64_t(1) << hi) - 1;
      m &= ~((uint64_t(1) << lo) - 1);
      n += std::popcount(words[w] & m);
    }
  }
  return n;
}

void BlockMask::max_entries(int64_t* whole, int64_t* partial) const {
  *whole = 0, *partial = 0;
  for (const std::vector<Entry>& list : rows_) {
    int64_t w = 0;
    for (const Entry& e : list) w += e.tile == kWhole;
    *whole = std::max(*whole, w);
    *partial = std::max(*partial, int64_t(list.size()) - w);
  }
}

BlockMask BlockMask::crop(int64_t mb, int64_t lq, int64_t lk) const {
  BlockMask out(1, heads_, lq, lk, bq_, bk_);
  // The tiles re-laid for out's shorter rows and columns (a prefix of each).
  const int64_t wpr = words_per_row(), out_rows = out.tile_rows(), out_wpr = out.words_per_row();
  std::vector<uint64_t> tile(size_t(out.words_per_tile()));
  for (int64_t mh = 0; mh < heads_; ++mh)
    for (int64_t qb = 0; qb < out.nqb_; ++qb)
      for (const Entry& e : row(mb, mh, qb)) {
        if (e.kv_block >= out.nkb_) continue;  // (add clears what lies past lq and lk)
        if (e.tile == kWhole) {
          out.add(0, mh, qb, e.kv_block, nullptr);
          continue;
        }
        const uint64_t* src = tile_bits(e.tile);
        for (int64_t r = 0; r < out_rows; ++r)
          std::copy(src + r * wpr, src + r * wpr + out_wpr, tile.begin() + r * out_wpr);
        out.add(0, mh, qb, e.kv_block, tile.data());
      }
  return out;
}

BlockMask BlockMask::compacted() const {
  BlockMask out(batch_, heads_, lq_, lk_, bq_, bk_);
  const size_t wpt = size_t(words_per_tile());
  for (size_t k = 0; k < rows_.size(); ++k) {
    out.rows_[k] = rows_[k];
    for (Entry& e : out.rows_[k]) {
      if (e.tile == kWhole) continue;
      const uint64_t* src = tile_bits(e.tile);
      e.tile = int32_t(out.bits_.size() / wpt);
      out.bits_.insert(out.bits_.end(), src, src + wpt);
    }
  }
  return out;
}

}  // namespace attn
