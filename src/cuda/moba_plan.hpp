// MoBA plans on the CUDA backend, host side: what the CUDA kernels support,
// the workspace the selector writes its schedule into, and the parameters
// that point the kernels at it. Plain C++.
//
// Workspace of a pass (each piece 256-byte aligned, in this order from
// `base`, the end of what the pass needs without MoBA):
//   pooled    fp32 [batch][heads_kv][num_blocks][head_dim]
//   selected  u64  [slots][num_blocks][ceil(seqlen_q / 64)]
//   forward (and the deterministic backward): q lists, int32
//             [slots][q_tiles] counts and [slots][q_tiles][q_cap] entries
//   backward: kv lists, int32 [batch][heads_kv][num_blocks] counts and
//             [batch][heads_kv][num_blocks][kv_q_tiles] entries
// or, when the kernels gather rows (both passes; then no q lists except for
// the deterministic backward's dQ kernel, and no kv lists):
//   backward: row lists int32 [slots][num_blocks + 1] offsets and
//             [slots][rows_cap] rows, rows_cap = seqlen_q x min(top_k + 1,
//             num_blocks) (each row selects its own block and at most top_k
//             others)
//   forward:  round lists int32 [rounds][slots][num_blocks + 1][2] and
//             [slots][rounds][round_cap] rows, rounds = min(top_k + 1,
//             num_blocks), round_cap = seqlen_q + num_blocks x (tile - 1)
//             (each row once per round, each list padded to whole tiles);
//             then the rows' softmax states, fp32 O [batch][heads_q]
//             [seqlen_q][head_dim] and LSE [batch][heads_q][seqlen_q]
// slots = batch x (heads_kv when shared, else heads_q). A q list holds at
// most q_cap = min(num_blocks, tile_rows * top_k + 2) blocks: each row adds
// top_k past blocks and the tile's rows have at most two own blocks (a
// block is at least as long as a tile). All of it is O(L^2 / block) bits
// and O(L / tile x L / block) list entries, never tiles x tiles.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/checked.hpp"
#include "core/error.hpp"
#include "cuda/limits.hpp"
#include "flash/bwd_params.cuh"
#include "flash/fwd_params.cuh"
#include "moba/moba_params.cuh"
#include "plan/problem.hpp"

namespace attn::cuda {

// Every MoBA block must be a whole number of every kernel's KV tiles (the
// forward's and the dQ kernel's 64 or 32 keys, the dK/dV kernel's 128 or
// 64), so that a tile lies in one block and needs one selection bit per row.
constexpr int64_t kMobaBlockMultiple = 128;

constexpr bool moba_tiles_divide_block() {
  for (int d : {64, 96, 128, 256})
    if (kMobaBlockMultiple % flash::fwd_config(d).block_n != 0 ||
        kMobaBlockMultiple % flash::dq_config(d).block_n != 0 ||
        kMobaBlockMultiple % flash::bwd_config(d, 0).block_n != 0 ||
        kMobaBlockMultiple % flash::bwd_config(d, flash::bwd_variants(d) - 1).block_n != 0 ||
        flash::fwd_config(d).block_m % flash::dq_config(d).block_m != 0 ||
        flash::fwd_config(d).block_m > kMobaBlockMultiple)
      return false;
  return true;
}
// The dQ kernel also reads the q lists of the forward tile holding its own;
// moba_rows_fit bounds the gathered forward's tiles by the block multiple.
static_assert(moba_tiles_divide_block(), "MoBA: every KV tile divides the block multiple");

inline void validate_moba(const Problem& p) {
  if (p.moba_block <= 0) return;
  // The selector and the kernels' lists are laid out per fixed-length
  // sequence: a varlen batch runs a plan per sequence (plan/per_sequence_plan.hpp).
  if (p.varlen) fail(ATTN_STATUS_INTERNAL_ERROR, "MoBA: a varlen problem reached the fixed-length plan");
  if (p.moba_block % kMobaBlockMultiple != 0)
    not_supported("desc: MoBA block_size ", p.moba_block,
                  " on the CUDA backend: it must be a "
                  "multiple of ",
                  kMobaBlockMultiple, " (the kernels' KV tiles)");
  // (A top_k of num_blocks - 1 or more keeps every block: such a plan runs
  // as the dense causal plan and never reaches this check.)
  const int64_t nb = p.moba_num_blocks();
  if (p.moba_top_k > moba::kMaxTopK)
    not_supported("desc: MoBA top_k ", p.moba_top_k, " on the CUDA backend: at most ",
                  moba::kMaxTopK, " (or at least num_blocks - 1 = ", nb - 1,
                  ", every past block, which runs as the dense causal plan)");
}

// A selecting slot's most (row, block) pairs: each row selects its own
// block and at most top_k others.
inline int64_t moba_rows_cap(const Problem& p) {
  return p.seqlen_q *
         std::min<int64_t>(std::min<int64_t>(p.moba_top_k, INT32_MAX) + 1, p.moba_num_blocks());
}
// The gathered forward's rounds (moba/moba_params.cuh) and a round's
// entries per slot with lists padded to tiles of tile_rows rows.
inline int64_t moba_rounds(const Problem& p) {
  return std::min<int64_t>(std::min<int64_t>(p.moba_top_k, INT32_MAX) + 1, p.moba_num_blocks());
}
inline int64_t moba_round_cap(const Problem& p, int64_t tile_rows) {
  return p.seqlen_q + p.moba_num_blocks() * (tile_rows - 1);
}
// The kernels can gather rows when a slot's row lists (both passes) have
// 32-bit offsets (the forward's tiles have at most kMobaBlockMultiple rows).
inline bool moba_rows_fit(const Problem& p) {
  return moba_rows_cap(p) < INT32_MAX &&
         moba_rounds(p) * moba_round_cap(p, kMobaBlockMultiple) < INT32_MAX;
}

// The selector's launches (moba_select.cu) put lists, bit words or rows on
// the grid's x, kListThreads / 32 of them per block: each count must stay
// within kMaxGridX blocks. Checked before the plan allocates anything.
inline void check_moba_grids(const Problem& p, int64_t q_tile_rows) {
  const int64_t per_block = moba::kListThreads / 32;
  const int64_t nb = p.moba_num_blocks(), slots = p.batch * p.moba_heads();
  const int64_t q_tiles = (p.seqlen_q + q_tile_rows - 1) / q_tile_rows;
  const int64_t q_words = (p.seqlen_q + 63) / 64;
  const int64_t lists = std::max({slots * q_tiles, p.batch * p.heads_kv * nb, slots * nb,
                                  slots * q_words, moba_rounds(p) * slots});
  // The rows that see no key (seqlen_q > seqlen_kv): a thread per 8 channels.
  const int64_t blind = std::max<int64_t>(0, p.seqlen_q - p.seqlen_kv);
  const int64_t blind_blocks =
      (p.batch * p.heads_q * blind * (p.head_dim_qk / 8) + moba::kListThreads - 1) /
      moba::kListThreads;
  if ((lists + per_block - 1) / per_block > kMaxGridX || blind_blocks > kMaxGridX)
    not_supported("desc: MoBA with block_size ", p.moba_block, " over ", slots,
                  " (sequence, head) selections: the selector's lists pass the CUDA grid's ",
                  "2^31 - 1 blocks");
}

struct MobaLayout {
  size_t pooled = 0, selected = 0, q_count = 0, q_blocks = 0, kv_count = 0, kv_tiles = 0;
  size_t state = 0;  // gathered forward
  size_t end = 0;  // bytes from the workspace start
};

class MobaSchedule {
 public:
  // q_tile_rows: the forward kernel's block_m; kv_tile_rows: the dK/dV
  // kernel's block_m (0 for forward-only plans).
  // gather: the kernels walk the gathered row lists instead of the q lists
  // (forward) and the kv lists (dK/dV), when a slot's row list fits 32-bit
  // offsets (gathers() says).
  MobaSchedule(const Problem& p, int q_tile_rows, int kv_tile_rows, bool gather) : p_(p) {
    check_moba_grids(p, q_tile_rows);
    lists_.block = int32_t(p.moba_block);
    lists_.num_blocks = int32_t(p.moba_num_blocks());
    q_words_ = int32_t((p.seqlen_q + 63) / 64);
    q_tile_rows_ = q_tile_rows;
    lists_.q_tiles = int32_t((p.seqlen_q + q_tile_rows - 1) / q_tile_rows);
    lists_.q_cap = int32_t(std::min<int64_t>(
        p.moba_num_blocks(),
        int64_t(q_tile_rows) * std::min<int64_t>(p.moba_top_k, p.moba_num_blocks()) + 2));
    kv_tile_rows_ = kv_tile_rows;
    kv_q_tiles_ = kv_tile_rows > 0 ? int32_t((p.seqlen_q + kv_tile_rows - 1) / kv_tile_rows) : 0;
    lists_.kv_cap = kv_q_tiles_;
    if (gather && moba_rows_fit(p)) {
      lists_.gather = 1;
      lists_.kv_cap = int32_t(moba_rows_cap(p));
      rounds_ = int32_t(moba_rounds(p));
      round_cap_ = int32_t(moba_round_cap(p, q_tile_rows));
    }
    lists_.sel_heads = int32_t(p.moba_heads());
    lists_.per_query_head = int16_t(p.moba_shared ? 0 : 1);
  }

  // The layout from `base` with the q lists and/or the kv lists (the row
  // lists when gathering), or, for the gathered forward (`forward_rounds`),
  // the round lists and the rows' states.
  MobaLayout layout(size_t base, bool q_lists, bool kv_lists, bool forward_rounds = false) const {
    const Problem& p = p_;
    // Sizes saturate (core/checked.hpp): the selection, slots x blocks x
    // ceil(seqlen_q / 64) words, passes 2^64 bytes within the backend's
    // limits (65535 heads, 2^29 positions), and create_plan refuses a
    // workspace past kMaxBytes; offsets are used only below it.
    auto align = [](uint64_t x) { return sat_align_up(x, 256); };
    const uint64_t nb = uint64_t(lists_.num_blocks), slots = uint64_t(p.batch * p.moba_heads());
    const uint64_t bh = uint64_t(p.batch * p.heads_kv);
    MobaLayout l;
    uint64_t at = align(base);
    auto take = [&](uint64_t bytes) {
      const uint64_t here = at;
      at = align(sat_add(at, bytes));
      return size_t(here);
    };
    l.pooled = take(sat_mul(bh, nb, uint64_t(p.head_dim_qk), sizeof(float)));
    l.selected = take(sat_mul(slots, nb, uint64_t(q_words_), sizeof(uint64_t)));
    if (q_lists) {
      l.q_count = take(sat_mul(slots, uint64_t(lists_.q_tiles), sizeof(int32_t)));
      l.q_blocks =
          take(sat_mul(slots, uint64_t(lists_.q_tiles), uint64_t(lists_.q_cap), sizeof(int32_t)));
    }
    if (forward_rounds) {
      l.kv_count = take(sat_mul(uint64_t(rounds_), slots, nb + 1, 2 * sizeof(int32_t)));
      l.kv_tiles = take(sat_mul(slots, uint64_t(rounds_), uint64_t(round_cap_), sizeof(int32_t)));
    } else if (kv_lists && gathers()) {
      l.kv_count = take(sat_mul(slots, nb + 1, sizeof(int32_t)));
      l.kv_tiles = take(sat_mul(slots, uint64_t(lists_.kv_cap), sizeof(int32_t)));
    } else if (kv_lists) {
      l.kv_count = take(sat_mul(bh, nb, sizeof(int32_t)));
      l.kv_tiles = take(sat_mul(bh, nb, uint64_t(lists_.kv_cap), sizeof(int32_t)));
    }
    if (forward_rounds)
      l.state = take(sat_mul(uint64_t(p.batch), uint64_t(p.heads_q), uint64_t(p.seqlen_q),
                             uint64_t(p.head_dim_qk + 1), sizeof(float)));
    l.end = size_t(at);
    return l;
  }

  // The selector's parameters and the kernels' lists for workspace ws laid
  // out as l (by layout() with the same flags).
  moba::SelectParams select_params(const void* q, const void* k, char* ws, const MobaLayout& l,
                                   bool q_lists, bool kv_lists,
                                   bool forward_rounds = false) const {
    const Problem& p = p_;
    const TensorStrides& sq = p.strides[ATTN_TENSOR_Q];
    const TensorStrides& sk = p.strides[ATTN_TENSOR_K];
    moba::SelectParams s{};
    s.q = q, s.k = k;
    s.q_batch = sq.batch, s.q_seq = sq.seq, s.q_head = sq.head;
    s.k_batch = sk.batch, s.k_seq = sk.seq, s.k_head = sk.head;
    s.pooled = reinterpret_cast<float*>(ws + l.pooled);
    s.selected = reinterpret_cast<uint64_t*>(ws + l.selected);
    if (q_lists) {
      s.q_count = reinterpret_cast<int32_t*>(ws + l.q_count);
      s.q_blocks = reinterpret_cast<int32_t*>(ws + l.q_blocks);
    }
    if (forward_rounds) {
      s.round_lists = reinterpret_cast<int32_t*>(ws + l.kv_count);
      s.round_rows = reinterpret_cast<int32_t*>(ws + l.kv_tiles);
      s.rounds = rounds_, s.round_tile = q_tile_rows_, s.round_cap = round_cap_;
    } else if (kv_lists && gathers()) {
      s.row_offsets = reinterpret_cast<int32_t*>(ws + l.kv_count);
      s.rows = reinterpret_cast<int32_t*>(ws + l.kv_tiles);
      s.rows_cap = lists_.kv_cap;
    } else if (kv_lists) {
      s.kv_count = reinterpret_cast<int32_t*>(ws + l.kv_count);
      s.kv_tiles = reinterpret_cast<int32_t*>(ws + l.kv_tiles);
    }
    s.batch = int32_t(p.batch), s.heads_q = int32_t(p.heads_q), s.heads_kv = int32_t(p.heads_kv);
    s.group = int32_t(p.group()), s.seqlen_q = int32_t(p.seqlen_q),
    s.seqlen_kv = int32_t(p.seqlen_kv);
    s.d = int32_t(p.head_dim_qk);
    s.block = lists_.block, s.num_blocks = lists_.num_blocks;
    s.top_k = int32_t(std::min<int64_t>(p.moba_top_k, INT32_MAX));
    s.shared = p.moba_shared ? 1 : 0;
    s.sel_heads = lists_.sel_heads, s.q_words = q_words_;
    s.q_tiles = lists_.q_tiles, s.q_tile_rows = q_tile_rows_, s.q_cap = lists_.q_cap;
    s.kv_q_tiles = kv_q_tiles_, s.kv_tile_rows = kv_tile_rows_, s.kv_cap = lists_.kv_cap;
    return s;
  }

  flash::MobaLists lists(const moba::SelectParams& s) const {
    flash::MobaLists m = lists_;
    m.selected = s.selected;
    m.q_count = s.q_count, m.q_blocks = s.q_blocks;
    if (s.round_lists != nullptr)
      m.kv_count = s.round_lists, m.kv_tiles = s.round_rows, m.kv_cap = rounds_ * round_cap_;
    else if (gathers())
      m.kv_count = s.row_offsets, m.kv_tiles = s.rows;
    else
      m.kv_count = s.kv_count, m.kv_tiles = s.kv_tiles;
    return m;
  }

  bool gathers() const { return lists_.gather != 0; }

  // The gathered forward: its launches (one per round) and the most query
  // tiles of a (slot, round), its padded lists' entries over tile_rows.
  int32_t rounds() const { return rounds_; }
  int64_t round_tiles() const { return round_cap_ / q_tile_rows_; }

  moba::BlindRowsParams blind_rows_params(void* o, float* lse) const {
    const Problem& p = p_;
    const TensorStrides& so = p.strides[ATTN_TENSOR_O];
    moba::BlindRowsParams f{};
    f.o = o, f.lse = lse;
    f.o_batch = so.batch, f.o_seq = so.seq, f.o_head = so.head;
    f.lse_batch = p.heads_q * p.seqlen_q, f.lse_head = p.seqlen_q;
    f.batch = int32_t(p.batch), f.heads_q = int32_t(p.heads_q);
    f.seqlen_q = int32_t(p.seqlen_q), f.seqlen_kv = int32_t(p.seqlen_kv);
    f.d = int32_t(p.head_dim_qk);
    return f;
  }

 private:
  Problem p_;
  flash::MobaLists lists_{};
  int32_t kv_tile_rows_ = 0, kv_q_tiles_ = 0;
  int32_t q_words_ = 0, q_tile_rows_ = 0;
  int32_t rounds_ = 0, round_cap_ = 0;  // gathered forward
};

}  // namespace attn::cuda
