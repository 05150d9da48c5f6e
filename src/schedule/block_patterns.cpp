#include "schedule/block_patterns.hpp"

#include <algorithm>
#include <numeric>
#include <vector>

namespace attn {
namespace {

// ORs the elements where selected(i, j) holds into every slot, visiting for
// query block qb only the key blocks in kv_blocks(qb) = [first, last).
template <class KvBlocks, class Selected>
void add_pattern(BlockMask& m, KvBlocks kv_blocks, Selected selected) {
  const int64_t bq = m.block_q(), bk = m.block_kv(), wpr = m.words_per_row();
  std::vector<uint64_t> tile(static_cast<size_t>(m.words_per_tile()));
  for (int64_t qb = 0; qb < m.num_q_blocks(); ++qb) {
    const auto [first, last] = kv_blocks(qb);
    for (int64_t kb = std::max<int64_t>(first, 0); kb < std::min(last, m.num_kv_blocks()); ++kb) {
      std::fill(tile.begin(), tile.end(), 0);
      bool any = false;
      for (int64_t r = 0; r < m.rows_in(qb); ++r)
        for (int64_t c = 0; c < m.cols_in(kb); ++c)
          if (selected(qb * bq + r, kb * bk + c)) {
            tile[size_t(r * wpr + c / 64)] |= uint64_t(1) << (c % 64);
            any = true;
          }
      if (!any) continue;
      for (int64_t mb = 0; mb < m.batch(); ++mb)
        for (int64_t mh = 0; mh < m.heads(); ++mh) m.add(mb, mh, qb, kb, tile.data());
    }
  }
}

std::pair<int64_t, int64_t> all_blocks(const BlockMask& m) { return {0, m.num_kv_blocks()}; }

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

void add_window(BlockMask& m, int64_t left, int64_t right) {
  const int64_t off = m.seqlen_kv() - m.seqlen_q(), bq = m.block_q(), bk = m.block_kv();
  // A reach of seqlen_q + seqlen_kv or more covers every key of every row:
  // make it unbounded, so that i + off -/+ reach cannot overflow.
  const int64_t reach_all = m.seqlen_q() + m.seqlen_kv();
  if (left >= reach_all) left = -1;
  if (right >= reach_all) right = -1;
  auto lo = [&](int64_t i) { return left < 0 ? 0 : i + off - left; };
  auto hi = [&](int64_t i) { return right < 0 ? m.seqlen_kv() - 1 : i + off + right; };
  add_pattern(
      m,
      [&](int64_t qb) {
        // both bounds grow with i: the first and last rows bound the block
        const int64_t a = lo(qb * bq), b = hi(qb * bq + m.rows_in(qb) - 1);
        if (a > b || b < 0) return std::pair<int64_t, int64_t>{0, 0};
        return std::pair<int64_t, int64_t>{std::max<int64_t>(a, 0) / bk, b / bk + 1};
      },
      [&](int64_t i, int64_t j) { return j >= lo(i) && j <= hi(i); });
}

void add_global_keys(BlockMask& m, const int64_t* keys, int64_t count) {
  std::vector<uint8_t> global(size_t(m.seqlen_kv()), 0);
  for (int64_t k = 0; k < count; ++k) global[size_t(keys[k])] = 1;
  add_pattern(m, [&](int64_t) { return all_blocks(m); },
              [&](int64_t, int64_t j) { return global[size_t(j)] != 0; });
}

void add_global_queries(BlockMask& m, const int64_t* queries, int64_t count) {
  std::vector<uint8_t> global(size_t(m.seqlen_q()), 0);
  for (int64_t k = 0; k < count; ++k) global[size_t(queries[k])] = 1;
  add_pattern(
      m,
      [&](int64_t qb) {
        const int64_t r0 = qb * m.block_q();
        const bool any = std::any_of(global.begin() + r0, global.begin() + r0 + m.rows_in(qb),
                                     [](uint8_t g) { return g != 0; });
        return any ? all_blocks(m) : std::pair<int64_t, int64_t>{0, 0};
      },
      [&](int64_t i, int64_t) { return global[size_t(i)] != 0; });
}

void add_strided(BlockMask& m, int64_t stride) {
  const int64_t off = m.seqlen_kv() - m.seqlen_q();
  // A multiple of stride either way of the diagonal: x % stride is 0 for
  // both signs (C++ truncates), and, unlike adding stride to make it
  // non-negative, cannot overflow for a stride near INT64_MAX.
  add_pattern(m, [&](int64_t) { return all_blocks(m); },
              [&](int64_t i, int64_t j) { return (i + off - j) % stride == 0; });
}

void add_random_blocks(BlockMask& m, int64_t blocks_per_row, uint64_t seed) {
  const int64_t nkb = m.num_kv_blocks();
  std::vector<int64_t> perm(static_cast<size_t>(nkb));
  uint64_t state = seed;
  for (int64_t mb = 0; mb < m.batch(); ++mb)
    for (int64_t mh = 0; mh < m.heads(); ++mh)
      for (int64_t qb = 0; qb < m.num_q_blocks(); ++qb) {
        std::iota(perm.begin(), perm.end(), int64_t(0));
        for (int64_t t = 0; t < blocks_per_row; ++t) {
          const int64_t u = t + int64_t(splitmix64(state) % uint64_t(nkb - t));
          std::swap(perm[size_t(t)], perm[size_t(u)]);
          m.add(mb, mh, qb, perm[size_t(t)], nullptr);
        }
      }
}

void and_documents(BlockMask& m, const int32_t* doc_q, const int32_t* doc_kv) {
  const int64_t lq = m.seqlen_q(), lk = m.seqlen_kv();
  m.restrict_to([&](int64_t mb, int64_t, int64_t i, int64_t j) {
    return doc_q[mb * lq + i] == doc_kv[mb * lk + j];
  });
}

}  // namespace attn
