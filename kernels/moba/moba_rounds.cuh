// MoBA's gathered forward: the round lists (moba/moba_params.cuh) built from
// the selection bits, after select_kernel, in three stream-ordered launches:
//
//   round_count_kernel    per (round, slot, block) the rows whose round-r
//                         block it is, into the pairs' second words
//   round_scan_kernel     each list's start (padded to whole query tiles;
//                         round r from entry r round_cap of the slot's rows),
//                         counts reset to 0 for the scatter
//   round_scatter_kernel  the rows into their lists (counts rebuilt)
//
// Round r of a row is its r-th selected block counting down from its own
// block (round 0): the forward merges a row's blocks into its softmax
// state one round per launch, so no launch meets a row twice.
#pragma once

#include <cstdint>

#include "moba/moba_params.cuh"
#include "moba/moba_select.cuh"

namespace attn::moba {

// Walks the blocks from the last own block of the rows of word w (64 query
// rows) of `slot` down to block 0, lane l following rows 64 w + l and
// 64 w + 32 + l; for each block with a set bit in the word, calls
// visit(kb, half, on, r) on every lane (it may use warp collectives) for
// half 0 and 1: `on`, the lane's row selected kb, then as its round r.
template <class Visit>
__device__ __forceinline__ void walk_rounds(const SelectParams& p, int64_t slot, int w, int lane,
                                            Visit&& visit) {
  const int last_row = min(p.seqlen_q - 1, w * 64 + 63);
  const int d_last = last_row + p.seqlen_kv - p.seqlen_q;
  if (d_last < 0) return;
  const uint64_t* col = p.selected + slot * p.num_blocks * int64_t(p.q_words) + w;
  int rank[2] = {0, 0};
  for (int kb = d_last / p.block; kb >= 0; --kb) {
    const uint64_t x = col[int64_t(kb) * p.q_words];
    if (x == 0ull) continue;  // the same word for every lane
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const bool on = ((x >> (half * 32 + lane)) & 1ull) != 0ull;
      visit(kb, half, on, rank[half]);
      rank[half] += on ? 1 : 0;
    }
  }
}

// The pair (start, rows) of list (round r, slot, block kb).
__device__ __forceinline__ int32_t* round_list(const SelectParams& p, int r, int64_t slot, int kb) {
  const int64_t slots = int64_t(p.batch) * p.sel_heads;
  return p.round_lists + 2 * ((int64_t(r) * slots + slot) * (p.num_blocks + 1) + kb);
}

// One warp per (slot, word of 64 rows): the lanes of a half-word with the
// same round share one atomic per block.
static __global__ void __launch_bounds__(kListThreads)
    round_count_kernel(const __grid_constant__ SelectParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t item = int64_t(blockIdx.x) * (kListThreads / 32) + int(threadIdx.x) / 32;
  if (item >= int64_t(p.batch) * p.sel_heads * p.q_words) return;
  const int64_t slot = item / p.q_words;
  const int w = int(item - slot * p.q_words);
  walk_rounds(p, slot, w, lane, [&](int kb, int, bool on, int r) {
    const unsigned peers = __match_any_sync(0xffffffffu, on ? r : -1);
    if (on && lane == __ffs(int(peers)) - 1)
      atomicAdd(round_list(p, r, slot, kb) + 1, __popc(peers));
  });
}

// One warp per (round, slot): the lists' starts, each list padded to whole
// tiles of round_tile rows, from entry r round_cap of the slot's rows; the
// last pair's start ends the round. Counts go back to 0.
static __global__ void __launch_bounds__(kListThreads)
    round_scan_kernel(const __grid_constant__ SelectParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t slots = int64_t(p.batch) * p.sel_heads;
  const int64_t item = int64_t(blockIdx.x) * (kListThreads / 32) + int(threadIdx.x) / 32;
  if (item >= int64_t(p.rounds) * slots) return;
  const int r = int(item / slots);
  int32_t* e = p.round_lists + 2 * item * (p.num_blocks + 1);
  const int t = p.round_tile;
  int carry = r * p.round_cap;
  for (int k0 = 0; k0 < p.num_blocks; k0 += 32) {
    const int k = k0 + lane;
    const int n = k < p.num_blocks ? e[2 * k + 1] : 0;
    const int padded = (n + t - 1) / t * t;
    const int incl = warp_inclusive_sum(padded, lane);
    if (k < p.num_blocks) {
      e[2 * k] = carry + incl - padded;
      e[2 * k + 1] = 0;
    }
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) {
    e[2 * p.num_blocks] = carry;
    e[2 * p.num_blocks + 1] = 0;
  }
}

// One warp per (slot, word of 64 rows): each row into its list of every
// round. Round 0's lists are the rows of one own block, placed in row order
// (the forward's causal mask numbers them); the other rounds' rows take the
// places their half-word's atomic hands out. A row's entry in its last
// round's list carries kMobaLastRound.
static __global__ void __launch_bounds__(kListThreads)
    round_scatter_kernel(const __grid_constant__ SelectParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t item = int64_t(blockIdx.x) * (kListThreads / 32) + int(threadIdx.x) / 32;
  if (item >= int64_t(p.batch) * p.sel_heads * p.q_words) return;
  const int64_t slot = item / p.q_words;
  const int w = int(item - slot * p.q_words);
  int32_t* rows = p.round_rows + slot * int64_t(p.rounds) * p.round_cap;
  int last[2] = {-1, -1};  // the lane's rows' latest entries
  walk_rounds(p, slot, w, lane, [&](int kb, int half, bool on, int r) {
    const unsigned peers = __match_any_sync(0xffffffffu, on ? r : -1);
    const int leader = __ffs(int(peers)) - 1;
    int32_t* e = round_list(p, r, slot, kb);
    int at = 0;
    if (on && lane == leader) at = atomicAdd(e + 1, __popc(peers));
    at = __shfl_sync(0xffffffffu, at, leader);
    if (on) {
      const int i = w * 64 + half * 32 + lane;
      at = r == 0 ? i - first_row_of_block(p, kb) : at + __popc(peers & ((1u << lane) - 1u));
      rows[e[0] + at] = i;
      last[half] = e[0] + at;
    }
  });
#pragma unroll
  for (int half = 0; half < 2; ++half)
    if (last[half] >= 0) rows[last[half]] |= flash::kMobaLastRound;
}

}  // namespace attn::moba
