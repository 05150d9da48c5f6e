#include "schedule/block_schedule.hpp"

#include <algorithm>

namespace attn {

BlockTileSchedule::BlockTileSchedule(std::shared_ptr<const BlockMask> mask, WindowBounds window,
                                     int64_t tile_q, int64_t tile_kv)
    : mask_(std::move(mask)) {
  const BlockMask& m = *mask_;
  const SequenceMask dense(m.seqlen_q(), m.seqlen_kv(), window);
  const DenseTileSchedule tiles(dense, tile_q, tile_kv);
  nqt_ = tiles.num_q_tiles();
  nkt_ = tiles.num_kv_tiles();
  const int64_t slots = m.batch() * m.heads(), bq = m.block_q(), bk = m.block_kv();
  fwd_off_.assign(size_t(slots * nqt_) + 1, 0);
  std::vector<uint8_t> hit(static_cast<size_t>(nkt_));
  std::vector<size_t> per_kv(size_t(slots * nkt_) + 1, 0);

  for (int64_t s = 0; s < slots; ++s) {
    const int64_t mb = s / m.heads(), mh = s % m.heads();
    for (int64_t qt = 0; qt < nqt_; ++qt) {
      const int64_t r0 = tiles.q_begin(qt), r1 = tiles.q_end(qt);  // rows [r0, r1)
      std::fill(hit.begin(), hit.end(), 0);
      // Every listed block marks the KV tiles where it selects a key that the
      // dense mask shows to one of the rows it shares with this tile. A whole
      // block does so over the dense key range of those rows (one interval,
      // every key of it seen by some row); a bit tile only where a row's bits
      // are set inside that row's own range.
      for (int64_t qb = r0 / bq; qb * bq < r1; ++qb) {
        const int64_t a = std::max(r0, qb * bq), b = std::min(r1, (qb + 1) * bq) - 1;
        const int64_t lo = dense.key_lo(a), hi = dense.key_hi(b);
        for (const BlockMask::Entry& e : m.row(mb, mh, qb)) {
          const int64_t base = int64_t(e.kv_block) * bk;
          const int64_t end = std::min(m.seqlen_kv(), base + bk) - 1;
          const int64_t c0 = std::max(lo, base), c1 = std::min(hi, end);
          if (c0 > c1) continue;
          if (e.tile == BlockMask::kWhole) {
            std::fill(hit.begin() + c0 / tile_kv, hit.begin() + c1 / tile_kv + 1, uint8_t(1));
            continue;
          }
          for (int64_t i = a; i <= b; ++i) {
            const int64_t j1 = std::min(dense.key_hi(i), end);
            for (int64_t j = std::max(dense.key_lo(i), base); j <= j1;) {
              const int64_t kt = j / tile_kv, last = std::min(j1, (kt + 1) * tile_kv - 1);
              if (!hit[size_t(kt)] && m.count_selected(mb, mh, i, j, last + 1) > 0)
                hit[size_t(kt)] = 1;
              j = last + 1;
            }
          }
        }
      }
      for (int64_t kt = 0; kt < nkt_; ++kt) {
        if (!hit[size_t(kt)]) continue;
        // Full: densely full, and every block the tile overlaps is listed whole.
        bool full = tiles.is_full(qt, kt);
        const int64_t c0 = tiles.kv_begin(kt), c1 = tiles.kv_end(kt);
        for (int64_t qb = r0 / bq; full && qb * bq < r1; ++qb) {
          const std::vector<BlockMask::Entry>& list = m.row(mb, mh, qb);
          auto it = std::lower_bound(list.begin(), list.end(), int32_t(c0 / bk),
                                     [](const BlockMask::Entry& e, int32_t k) { return e.kv_block < k; });
          for (int64_t kb = c0 / bk; full && kb * bk < c1; ++kb) {
            full = it != list.end() && it->kv_block == kb && it->tile == BlockMask::kWhole;
            if (full) ++it;  // never past end(): that is undefined, even unused
          }
        }
        fwd_.push_back({int32_t(kt), full ? 1 : 0});
        ++per_kv[size_t(s * nkt_ + kt) + 1];
      }
      fwd_off_[size_t(s * nqt_ + qt) + 1] = fwd_.size();
    }
  }

  // The transpose, by counting sort; query tiles come out in increasing order.
  for (size_t k = 1; k < per_kv.size(); ++k) per_kv[k] += per_kv[k - 1];
  bwd_off_ = per_kv;
  bwd_.resize(fwd_.size());
  std::vector<size_t> cursor(per_kv.begin(), per_kv.end() - 1);
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t qt = 0; qt < nqt_; ++qt)
      for (const TileVisit& v : kv_tiles_of(s, qt))
        bwd_[cursor[size_t(s * nkt_ + v.tile)]++] = {int32_t(qt), v.full};
}

BlockMaskCounts count_visible(const BlockMask& m, WindowBounds window) {
  const SequenceMask dense(m.seqlen_q(), m.seqlen_kv(), window);
  const int64_t slots = m.batch() * m.heads();
  BlockMaskCounts c;
  c.visible_pairs.assign(size_t(slots), 0);
  c.empty_rows.assign(size_t(slots), 0);
  c.first_empty_row.assign(size_t(slots), -1);
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t i = 0; i < m.seqlen_q(); ++i) {
      const int64_t n =
          m.count_selected(s / m.heads(), s % m.heads(), i, dense.key_lo(i), dense.key_hi(i) + 1);
      c.visible_pairs[size_t(s)] += n;
      if (n == 0) {
        if (c.first_empty_row[size_t(s)] < 0) c.first_empty_row[size_t(s)] = i;
        ++c.empty_rows[size_t(s)];
      }
    }
  return c;
}

}  // namespace attn
