// The tile lists a block-sparse plan hands to the flash kernels: for every
// (mask batch, mask head) slot and every tile on one side (query tiles for
// the forward and the dQ kernel, KV tiles for the dK/dV kernel), the tiles
// on the other side that it visits, in increasing order, each with how its
// elements are masked. Plain C++ (no CUDA syntax): src/cuda fills it at plan
// creation from src/schedule/block_schedule.hpp, in the kernel's tile sizes,
// and uploads the arrays to device memory, which the plan owns.
#pragma once

#include <cstdint>

namespace attn::flash {

// A visit's second word: every pair of the two tiles is visible (no element
// predicate), or only the dense mask (causal, window, lengths) applies, or,
// when >= 0, the index of the bit tile that says which pairs are visible
// (dense mask and block selection together, precomputed).
constexpr int32_t kVisitFull = -2;
constexpr int32_t kVisitDense = -1;

struct TileLists {
  // List k = slot * tiles + tile holds visits [offsets[k], offsets[k + 1]).
  const int32_t* offsets;
  // Two words per visit: the other side's tile index, then its kind.
  const int32_t* visits;
  // Bit tiles, each `rows` rows of words_per_row 64-bit words; bit c of
  // row r is pair (r, c) counted from the tile corner, where rows run along
  // the listing side (query rows for query-major lists, keys for KV-major
  // ones). Bits outside the sequence are 0.
  const uint64_t* bits;
  int32_t tiles;          // lists per slot
  int32_t mask_batch;     // 1: every sequence shares slot row 0
  int32_t mask_heads;     // 1: every KV head shares one mask
  // slot = (mask_batch > 1 ? b : 0) * mask_heads + (mask_heads > 1 ? hk : 0)
  int32_t words_per_row;  // ceil(other side's tile / 64)
  int32_t rows;           // rows of a bit tile (the listing side's tile)
  // KV-major lists: the dK/dV kernel's work items, three words each
  // (KV tile, first visit, end visit), items [item_offsets[slot],
  // item_offsets[slot + 1]) for a slot, longest first. Every tile has at
  // least one item; a long list may be cut into several, whose dK and dV
  // partial sums then meet in fp32 accumulators (BwdParams::dk_accum).
  // The sm_90a forward's query-major lists have them too, one per query
  // tile (its order of query tiles); other query-major lists do not.
  const int32_t* items;
  const int32_t* item_offsets;
};

}  // namespace attn::flash
