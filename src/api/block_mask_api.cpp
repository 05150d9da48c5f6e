// The C boundary of block masks (argument checks, conversion between the
// public FlexAttention-style tables and attn::BlockMask) and of the MoBA
// plan option.

#include <attn/attn.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "attn_config.h"

#include "api/guarded.hpp"
#include "api/handles.hpp"
#include "core/checked.hpp"
#include "schedule/block_mask.hpp"
#include "schedule/block_patterns.hpp"
#if ATTN_HAVE_CUDA
#include "cuda/device.hpp"
#endif

using attn::BlockMask;
using attn::checked;
using attn::guarded;
using attn::invalid_argument;
using attn::require_out;

namespace {

constexpr int64_t kMaxBlock = int64_t(1) << 16;
constexpr int64_t kMaxBlocks = INT32_MAX;

// The tables of attn_block_mask_set_blocks and _get_blocks are the caller's
// arrays of rows x max entries (int32) and rows x max_partial bit tiles,
// indexed as k * max + e: sizes past kMaxBytes cannot be arrays anyone
// holds, and would wrap the offsets (and, for device tables, the sizes of
// their host copies). Refused before a table is read or written.
void check_table_sizes(const BlockMask& m, int32_t max_partial, bool partial, bool bits,
                       int32_t max_full, bool full) {
  const uint64_t rows = uint64_t(m.batch() * m.heads() * m.num_q_blocks());
  const uint64_t tile_bytes = uint64_t(ATTN_BLOCK_MASK_TILE_BYTES(m.block_q(), m.block_kv()));
  // The index table (4 bytes an entry) and, with bits, the tile table.
  const uint64_t entry_bytes = bits ? std::max<uint64_t>(tile_bytes, 4) : 4;
  if (partial && attn::sat_mul(rows, uint64_t(max_partial), entry_bytes) > attn::kMaxBytes)
    invalid_argument("max_partial: ", max_partial, " entries for each of ", rows, " rows",
                     bits ? " (with their bit tiles)" : "", " are more than 2^62 bytes of tables");
  if (full && attn::sat_mul(rows, uint64_t(max_full), 4) > attn::kMaxBytes)
    invalid_argument("max_full: ", max_full, " entries for each of ", rows,
                     " rows are more than 2^62 bytes of tables");
}

// "[b][h][q]" of table row k, for messages.
std::string row_name(const BlockMask& m, int64_t k) {
  const int64_t q = k % m.num_q_blocks(), bh = k / m.num_q_blocks();
  char name[80];
  std::snprintf(name, sizeof name, "[%lld][%lld][%lld]", (long long)(bh / m.heads()),
                (long long)(bh % m.heads()), (long long)q);
  return name;
}

// One public bit tile (row-major bits, LSB first) -> the internal words.
// Only the rows and columns a block can have inside the sequences are read
// (the others are ignored, as attn.h says).
void tile_from_bytes(const BlockMask& m, const uint8_t* bytes, uint64_t* words) {
  const int64_t wpr = m.words_per_row();
  const int64_t cols = std::min(m.block_kv(), m.seqlen_kv());
  std::fill(words, words + m.words_per_tile(), 0);
  for (int64_t r = 0; r < std::min(m.block_q(), m.seqlen_q()); ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t t = r * m.block_kv() + c;
      if ((bytes[t / 8] >> (t % 8)) & 1) words[r * wpr + c / 64] |= uint64_t(1) << (c % 64);
    }
}

void tile_to_bytes(const BlockMask& m, const uint64_t* words, uint8_t* bytes) {
  std::memset(bytes, 0, size_t(ATTN_BLOCK_MASK_TILE_BYTES(m.block_q(), m.block_kv())));
  const int64_t cols = std::min(m.block_kv(), m.seqlen_kv());
  for (int64_t r = 0; r < std::min(m.block_q(), m.seqlen_q()); ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (attn::tile_bit(words, m.words_per_row(), r, c)) {
        const int64_t t = r * m.block_kv() + c;
        bytes[t / 8] = uint8_t(bytes[t / 8] | (1u << (t % 8)));
      }
}

// Builds on a copy so that a failure (out of memory) leaves the mask as it
// was. The result is compacted: a builder leaves behind the bit tiles of
// blocks it turned whole or empty, and a mask composed step by step would
// otherwise keep (and copy, and count against its limit of 2^31 - 1 tiles)
// every tile of its history.
template <class Build>
void update(attn_block_mask& h, Build build) {
  BlockMask next = *h.mask;
  build(next);
  *h.mask = next.compacted();
}

void check_positions(const int64_t* pos, int64_t count, int64_t limit, const char* name,
                     const char* limit_name) {
  if (count < 0) invalid_argument("count must be >= 0, got ", count);
  if (count > 0 && pos == nullptr) invalid_argument(name, " is NULL but count is ", count);
  for (int64_t k = 0; k < count; ++k)
    if (pos[k] < 0 || pos[k] >= limit)
      invalid_argument(name, "[", k, "] = ", pos[k], " is outside 0..", limit - 1, " (", limit_name,
                       " ", limit, ")");
}

// The argument rules of the tables that do not need to read them.
void check_table_pointers(const int32_t* kv_num_blocks, const int32_t* kv_indices,
                          int32_t max_partial, const uint8_t* partial_bits,
                          const int32_t* full_kv_num_blocks, const int32_t* full_kv_indices,
                          int32_t max_full) {
  if ((kv_num_blocks == nullptr) != (kv_indices == nullptr))
    invalid_argument("kv_num_blocks and kv_indices must both be given or both be NULL");
  if ((full_kv_num_blocks == nullptr) != (full_kv_indices == nullptr))
    invalid_argument("full_kv_num_blocks and full_kv_indices must both be given or both be NULL");
  if (partial_bits != nullptr && kv_num_blocks == nullptr)
    invalid_argument("partial_bits is given without kv_num_blocks and kv_indices");
  if (kv_num_blocks != nullptr && max_partial < 1)
    invalid_argument("max_partial must be >= 1, got ", max_partial);
  if (full_kv_num_blocks != nullptr && max_full < 1)
    invalid_argument("max_full must be >= 1, got ", max_full);
}

// attn_block_mask_set_blocks on host tables (pointers already checked).
void set_blocks_from_host(attn_block_mask& h, const int32_t* kv_num_blocks,
                          const int32_t* kv_indices, int32_t max_partial,
                          const uint8_t* partial_bits, const int32_t* full_kv_num_blocks,
                          const int32_t* full_kv_indices, int32_t max_full) {
  const BlockMask& cur = *h.mask;
  check_table_sizes(cur, max_partial, kv_num_blocks != nullptr, partial_bits != nullptr, max_full,
                    full_kv_num_blocks != nullptr);
  BlockMask next(cur.batch(), cur.heads(), cur.seqlen_q(), cur.seqlen_kv(), cur.block_q(),
                 cur.block_kv());
  const int64_t rows = cur.batch() * cur.heads() * cur.num_q_blocks();
  const int64_t nkb = cur.num_kv_blocks();
  const size_t tile_bytes = size_t(ATTN_BLOCK_MASK_TILE_BYTES(cur.block_q(), cur.block_kv()));
  // A row's listings (key block, pass, entry), sorted to find a block listed
  // twice: memory by the row's length, not by the number of key blocks.
  struct Listing {
    int64_t kb;
    int pass;
    int64_t e;
    bool operator<(const Listing& o) const {
      return kb != o.kb ? kb < o.kb : pass != o.pass ? pass < o.pass : e < o.e;
    }
  };
  std::vector<Listing> listed;
  std::vector<uint64_t> tile(size_t(cur.words_per_tile()));
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t mb = k / (cur.heads() * cur.num_q_blocks());
    const int64_t mh = (k / cur.num_q_blocks()) % cur.heads(), qb = k % cur.num_q_blocks();
    // The row's counts and indices first (ranges, then repeats), then its blocks.
    listed.clear();
    for (int pass = 0; pass < 2; ++pass) {  // full blocks, then partial ones
      const bool full = pass == 0;
      const int32_t* counts = full ? full_kv_num_blocks : kv_num_blocks;
      const int32_t* indices = full ? full_kv_indices : kv_indices;
      const int64_t max = full ? max_full : max_partial;
      const char* cname = full ? "full_kv_num_blocks" : "kv_num_blocks";
      const char* iname = full ? "full_kv_indices" : "kv_indices";
      if (counts == nullptr) continue;
      const int64_t n = counts[k];
      if (n < 0 || n > std::min(max, nkb))
        invalid_argument(cname, row_name(cur, k), " = ", n, " is outside 0..",
                         std::min(max, nkb), " (", full ? "max_full" : "max_partial",
                         " and the number of key blocks)");
      for (int64_t e = 0; e < n; ++e) {
        const int64_t kb = indices[k * max + e];
        if (kb < 0 || kb >= nkb)
          invalid_argument(iname, row_name(cur, k), "[", e, "] = ", kb, " is outside 0..",
                           nkb - 1);
        listed.push_back(Listing{kb, pass, e});
      }
    }
    std::sort(listed.begin(), listed.end());
    for (size_t x = 1; x < listed.size(); ++x)
      if (listed[x].kb == listed[x - 1].kb)
        invalid_argument(listed[x].pass == 0 ? "full_kv_indices" : "kv_indices",
                         row_name(cur, k), "[", listed[x].e, "]: key block ", listed[x].kb,
                         listed[x].pass == listed[x - 1].pass ? " is listed twice"
                                                              : " is listed both full and partial");
    for (int pass = 0; pass < 2; ++pass) {
      const bool full = pass == 0;
      const int32_t* counts = full ? full_kv_num_blocks : kv_num_blocks;
      const int32_t* indices = full ? full_kv_indices : kv_indices;
      const int64_t max = full ? max_full : max_partial;
      if (counts == nullptr) continue;
      for (int64_t e = 0; e < counts[k]; ++e) {
        const int64_t kb = indices[k * max + e];
        if (!full && partial_bits != nullptr) {
          tile_from_bytes(cur, partial_bits + size_t(k * max + e) * tile_bytes, tile.data());
          next.add(mb, mh, qb, kb, tile.data());
        } else {
          next.add(mb, mh, qb, kb, nullptr);
        }
      }
    }
  }
  *h.mask = std::move(next);
}

}  // namespace

extern "C" {

attn_status_t attn_block_mask_create(int64_t batch, int64_t heads, int64_t seqlen_q,
                                     int64_t seqlen_kv, int64_t block_q, int64_t block_kv,
                                     attn_block_mask_t* mask) {
  return guarded([&] {
    require_out(mask, "mask");
    if (batch < 1) invalid_argument("batch must be >= 1, got ", batch);
    if (heads < 1) invalid_argument("heads must be >= 1, got ", heads);
    // The lengths of a plan (attn_plan_desc_set_shape), which a mask must
    // match; bounding them first also keeps seqlen + block - 1 below.
    if (seqlen_q < 0 || seqlen_q > attn::kMaxShapeCount)
      invalid_argument("seqlen_q must be in 0..2^31-1, got ", seqlen_q);
    if (seqlen_kv < 0 || seqlen_kv > attn::kMaxShapeCount)
      invalid_argument("seqlen_kv must be in 0..2^31-1, got ", seqlen_kv);
    if (block_q < 1 || block_q > kMaxBlock)
      invalid_argument("block_q must be in 1..", kMaxBlock, ", got ", block_q);
    if (block_kv < 1 || block_kv > kMaxBlock)
      invalid_argument("block_kv must be in 1..", kMaxBlock, ", got ", block_kv);
    // Rows are indexed (batch * heads + head) * query blocks + block in int64.
    const int64_t q_blocks = (seqlen_q + block_q - 1) / block_q;
    if (double(batch) * double(heads) * double(std::max<int64_t>(q_blocks, 1)) > double(kMaxBlocks))
      invalid_argument("batch x heads x query blocks (", batch, " x ", heads, " x ", q_blocks,
                       ") is more than ", kMaxBlocks, " rows");
    BlockMask m(batch, heads, seqlen_q, seqlen_kv, block_q, block_kv);
    attn_block_mask_t h = nullptr;
    attn::create_handle(&h);
    h->mask.emplace(std::move(m));
    *mask = h;
  });
}

attn_status_t attn_block_mask_destroy(attn_block_mask_t mask) {
  return guarded([&] { attn::destroy_handle(mask, "mask"); });
}

attn_status_t attn_block_mask_set_blocks(attn_block_mask_t mask, const int32_t* kv_num_blocks,
                                         const int32_t* kv_indices, int32_t max_partial,
                                         const uint8_t* partial_bits,
                                         const int32_t* full_kv_num_blocks,
                                         const int32_t* full_kv_indices, int32_t max_full) {
  return guarded([&] {
    attn_block_mask& h = checked(mask, "mask");
    check_table_pointers(kv_num_blocks, kv_indices, max_partial, partial_bits,
                         full_kv_num_blocks, full_kv_indices, max_full);
    set_blocks_from_host(h, kv_num_blocks, kv_indices, max_partial, partial_bits,
                         full_kv_num_blocks, full_kv_indices, max_full);
  });
}

attn_status_t attn_block_mask_set_device_blocks(attn_block_mask_t mask, attn_context_t ctx,
                                                void* stream, const int32_t* kv_num_blocks,
                                                const int32_t* kv_indices, int32_t max_partial,
                                                const uint8_t* partial_bits,
                                                const int32_t* full_kv_num_blocks,
                                                const int32_t* full_kv_indices,
                                                int32_t max_full) {
  return guarded([&] {
    attn_block_mask& h = checked(mask, "mask");
    const attn_context& c = checked(ctx, "ctx");
    check_table_pointers(kv_num_blocks, kv_indices, max_partial, partial_bits,
                         full_kv_num_blocks, full_kv_indices, max_full);
    if (c.config.backend == ATTN_BACKEND_CPU) {  // the CPU backend computes on host memory
      set_blocks_from_host(h, kv_num_blocks, kv_indices, max_partial, partial_bits,
                           full_kv_num_blocks, full_kv_indices, max_full);
      return;
    }
#if ATTN_HAVE_CUDA
    const BlockMask& m = *h.mask;
    // Before the host copies are sized from these.
    check_table_sizes(m, max_partial, kv_num_blocks != nullptr, partial_bits != nullptr, max_full,
                      full_kv_num_blocks != nullptr);
    const size_t rows = size_t(m.batch() * m.heads() * m.num_q_blocks());
    const size_t tile_bytes = size_t(ATTN_BLOCK_MASK_TILE_BYTES(m.block_q(), m.block_kv()));
    // Host copies, in the stream's order; the checks then run on them.
    auto fetch = [&](const auto* src, size_t count, const char* name) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(src)>>;
      std::vector<T> host;
      if (src == nullptr) return host;
      host.resize(count);
      attn::cuda::copy_device_to_host(c.config.device, stream, host.data(), src,
                                      count * sizeof(T), name);
      return host;
    };
    const std::vector<int32_t> num = fetch(kv_num_blocks, rows, "kv_num_blocks");
    const std::vector<int32_t> idx = fetch(kv_indices, rows * size_t(max_partial), "kv_indices");
    const std::vector<uint8_t> bits =
        fetch(partial_bits, rows * size_t(max_partial) * tile_bytes, "partial_bits");
    const std::vector<int32_t> fnum = fetch(full_kv_num_blocks, rows, "full_kv_num_blocks");
    const std::vector<int32_t> fidx =
        fetch(full_kv_indices, rows * size_t(max_full), "full_kv_indices");
    auto ptr = [](const auto& v) { return v.empty() ? nullptr : v.data(); };
    set_blocks_from_host(h, ptr(num), ptr(idx), max_partial, ptr(bits), ptr(fnum), ptr(fidx),
                         max_full);
#else
    (void)stream;
    attn::fail(ATTN_STATUS_INTERNAL_ERROR, "ctx: a context of a backend this build lacks");
#endif
  });
}

attn_status_t attn_block_mask_get_max_blocks(attn_block_mask_t mask, int32_t* max_partial,
                                             int32_t* max_full) {
  return guarded([&] {
    const attn_block_mask& h = checked(mask, "mask");
    require_out(max_partial, "max_partial");
    require_out(max_full, "max_full");
    int64_t whole, partial;
    h.mask->max_entries(&whole, &partial);
    *max_partial = int32_t(partial);
    *max_full = int32_t(whole);
  });
}

attn_status_t attn_block_mask_get_blocks(attn_block_mask_t mask, int32_t* kv_num_blocks,
                                         int32_t* kv_indices, int32_t max_partial,
                                         uint8_t* partial_bits, int32_t* full_kv_num_blocks,
                                         int32_t* full_kv_indices, int32_t max_full) {
  return guarded([&] {
    const attn_block_mask& h = checked(mask, "mask");
    const BlockMask& m = *h.mask;
    require_out(kv_num_blocks, "kv_num_blocks");
    require_out(kv_indices, "kv_indices");
    require_out(full_kv_num_blocks, "full_kv_num_blocks");
    require_out(full_kv_indices, "full_kv_indices");
    int64_t whole, partial;
    m.max_entries(&whole, &partial);
    if (max_partial < 1) invalid_argument("max_partial must be >= 1, got ", max_partial);
    if (max_full < 1) invalid_argument("max_full must be >= 1, got ", max_full);
    if (max_partial < partial)
      invalid_argument("max_partial = ", max_partial, " but a row lists ", partial,
                       " partial blocks");
    if (max_full < whole)
      invalid_argument("max_full = ", max_full, " but a row lists ", whole, " full blocks");
    check_table_sizes(m, max_partial, true, partial_bits != nullptr, max_full, true);
    const size_t tile_bytes = size_t(ATTN_BLOCK_MASK_TILE_BYTES(m.block_q(), m.block_kv()));
    const int64_t rows = m.batch() * m.heads() * m.num_q_blocks();
    for (int64_t k = 0; k < rows; ++k) {
      const int64_t mb = k / (m.heads() * m.num_q_blocks());
      const int64_t mh = (k / m.num_q_blocks()) % m.heads(), qb = k % m.num_q_blocks();
      int32_t np = 0, nf = 0;
      for (const BlockMask::Entry& e : m.row(mb, mh, qb)) {
        if (e.tile == BlockMask::kWhole) {
          full_kv_indices[k * max_full + nf++] = e.kv_block;
        } else {
          if (partial_bits != nullptr)
            tile_to_bytes(m, m.tile_bits(e.tile), partial_bits + size_t(k * max_partial + np) * tile_bytes);
          kv_indices[k * max_partial + np++] = e.kv_block;
        }
      }
      kv_num_blocks[k] = np;
      full_kv_num_blocks[k] = nf;
      for (int32_t e = np; e < max_partial; ++e) {
        kv_indices[k * max_partial + e] = -1;
        if (partial_bits != nullptr)
          std::memset(partial_bits + size_t(k * max_partial + e) * tile_bytes, 0, tile_bytes);
      }
      for (int32_t e = nf; e < max_full; ++e) full_kv_indices[k * max_full + e] = -1;
    }
  });
}

attn_status_t attn_block_mask_add_dense(attn_block_mask_t mask, const uint8_t* visible) {
  return guarded([&] {
    attn_block_mask& h = checked(mask, "mask");
    require_out(visible, "visible");
    // visible is [batch][heads][seqlen_q][seqlen_kv] bytes, indexed in
    // int64: one past kMaxBytes is no array the caller has.
    const BlockMask& cur = *h.mask;
    if (attn::sat_mul(uint64_t(cur.batch()), uint64_t(cur.heads()), uint64_t(cur.seqlen_q()),
                      uint64_t(cur.seqlen_kv())) > attn::kMaxBytes)
      invalid_argument("visible: [", cur.batch(), "][", cur.heads(), "][", cur.seqlen_q(), "][",
                       cur.seqlen_kv(), "] is more than 2^62 bytes");
    BlockMask next = cur;  // the handle changes only when everything worked
    const int64_t lq = next.seqlen_q(), lk = next.seqlen_kv(), bq = next.block_q(),
                  bk = next.block_kv(), wpr = next.words_per_row();
    std::vector<uint64_t> tile(size_t(next.words_per_tile()));
    for (int64_t mb = 0; mb < next.batch(); ++mb)
      for (int64_t mh = 0; mh < next.heads(); ++mh) {
        const uint8_t* plane = visible + size_t((mb * next.heads() + mh) * lq * lk);
        for (int64_t qb = 0; qb < next.num_q_blocks(); ++qb)
          for (int64_t kb = 0; kb < next.num_kv_blocks(); ++kb) {
            std::fill(tile.begin(), tile.end(), 0);
            bool any = false;
            for (int64_t r = 0; r < next.rows_in(qb); ++r)
              for (int64_t c = 0; c < next.cols_in(kb); ++c)
                if (plane[(qb * bq + r) * lk + kb * bk + c] != 0) {
                  tile[size_t(r * wpr + c / 64)] |= uint64_t(1) << (c % 64);
                  any = true;
                }
            if (any) next.add(mb, mh, qb, kb, tile.data());
          }
      }
    *h.mask = std::move(next);
  });
}

attn_status_t attn_block_mask_add_window(attn_block_mask_t mask, int64_t left, int64_t right) {
  return guarded([&] {
    attn_block_mask& h = checked(mask, "mask");
    if (left < -1) invalid_argument("left must be >= -1 (-1: unbounded), got ", left);
    if (right < -1) invalid_argument("right must be >= -1 (-1: unbounded), got ", right);
    update(h, [&](BlockMask& m) { attn::add_window(m, left, right); });
  });
}


attn_status_t attn_block_mask_add_global_keys(attn_block_mask_t mask, const int64_t* keys,
                                              int64_t count) {
  return guarded([&] {
    attn_block_mask& h = checked(mask, "mask");
    check_positions(keys, count, h.mask->seqlen_kv(), "keys", "seqlen_kv");
    update(h, [&](BlockMask& m) { attn::add_global_keys(m, keys, count); });
  });
}

attn_status_t attn_block_mask_add_global_queries(attn_block_mask_t mask, const int64_t* queries,
                                                 int64_t count) {
  return guarded([&] {
    attn_block_mask& h = checked(mask, "mask");
    check_positions(queries, count, h.mask->seqlen_q(), "queries", "seqlen_q");
    update(h, [&](BlockMask& m) { attn::add_global_queries(m, queries, count); });
  });
}

attn_status_t attn_block_mask_add_strided(attn_block_mask_t mask, int64_t stride) {
  return guarded([&] {
    attn_block_mask& h = checked(mask, "mask");
    if (stride < 1) invalid_argument("stride must be >= 1, got ", stride);
    update(h, [&](BlockMask& m) { attn::add_strided(m, stride); });
  });
}

attn_status_t attn_block_mask_add_random_blocks(attn_block_mask_t mask, int32_t blocks_per_row,
                                                uint64_t seed) {
  return guarded([&] {
    attn_block_mask& h = checked(mask, "mask");
    if (blocks_per_row < 0 || blocks_per_row > h.mask->num_kv_blocks())
      invalid_argument("blocks_per_row = ", blocks_per_row, " is outside 0..",
                       h.mask->num_kv_blocks(), " (the number of key blocks)");
    update(h, [&](BlockMask& m) { attn::add_random_blocks(m, blocks_per_row, seed); });
  });
}

attn_status_t attn_block_mask_and_documents(attn_block_mask_t mask, const int32_t* doc_q,
                                            const int32_t* doc_kv) {
  return guarded([&] {
    attn_block_mask& h = checked(mask, "mask");
    require_out(doc_q, "doc_q");
    require_out(doc_kv, "doc_kv");
    update(h, [&](BlockMask& m) { attn::and_documents(m, doc_q, doc_kv); });
  });
}

attn_status_t attn_plan_desc_set_block_mask(attn_plan_desc_t desc, attn_block_mask_t mask) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (mask == nullptr) {
      d.block_mask.reset();
      return;
    }
    const attn_block_mask& h = checked(mask, "mask");
    d.block_mask = std::make_shared<const BlockMask>(h.mask->compacted());
  });
}

attn_status_t attn_plan_desc_set_moba(attn_plan_desc_t desc, int64_t block_size, int64_t top_k,
                                      int32_t shared_per_group) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (block_size < 0 || block_size > kMaxBlock)
      invalid_argument("block_size must be 0 (off) or in 1..", kMaxBlock, ", got ", block_size);
    if (top_k < 0) invalid_argument("top_k must be >= 0, got ", top_k);
    if (shared_per_group != 0 && shared_per_group != 1)
      invalid_argument("shared_per_group must be 0 or 1, got ", shared_per_group);
    d.moba_block = block_size;
    d.moba_top_k = top_k;
    d.moba_shared = shared_per_group == 1;
  });
}

attn_status_t attn_plan_desc_set_moba_keep_selection(attn_plan_desc_t desc, int32_t keep) {
  return guarded([&] {
    attn::PlanDesc& d = checked(desc, "desc").desc;
    if (keep != 0 && keep != 1) invalid_argument("keep must be 0 or 1, got ", keep);
    d.moba_keep_selection = keep == 1;
  });
}

}  // extern "C"
