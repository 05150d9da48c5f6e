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

// Words per work item of the dK/dV kernel (TileLists::items).
constexpr int kItemWords = 4;
// Words per work item of the sm_90a forward's query-major lists: query tile,
// first visit, end visit, the KV tiles of the last and the second-to-last
// visit (its first two iterations; -1: none), three unused.
constexpr int kSm90FwdItemWords = 8;

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
  // KV-major lists only: the dK/dV kernel's work items, kItemWords words
  // each (KV tile, first visit, end visit, accumulator slot), items
  // [item_offsets[slot], item_offsets[slot + 1]) for a slot, longest first.
  // Every tile has at least one item; a long list may be cut into several,
  // whose dK and dV partial sums then meet in fp32 accumulators
  // (BwdParams::dk_accum): the tile's accumulator slot, counted per slot
  // (< max_cut), is the same in all its items, and -1 in an uncut tile's.
  // cut_tiles[slot * max_cut + c] is the KV tile of slot c (-1: none).
  // Query-major lists of the persistent forward: its work items (sequence,
  // query head, query tile, list length), block x's [item_offsets[x],
  // item_offsets[x + 1]); of the sm_90a forward: one item per query tile
  // (kSm90FwdItemWords words), slot by slot, longest list first, so that
  // item x of slot s is item s * tiles + x; empty otherwise.
  const int32_t* items;
  const int32_t* item_offsets;
  const int32_t* cut_tiles;
  int32_t max_cut;  // the most cut tiles of a slot (0: no list is cut)
  // > 0: each block of the dK/dV kernel prefetches into L2 the K and V
  // tiles of the block this many later in launch order (about when it
  // starts), which no other block reads before it; 0: none.
  int32_t prefetch_ahead;
  // The persistent dK/dV kernel's work: block x computes the blocks
  // dealt[dealt_offsets[x]] ... of the one-block-per-item grid (grid_x work
  // items by grid_y blocks each, per sequence), numbered b * grid_x *
  // grid_y + item * grid_y + part; empty otherwise.
  const int32_t* dealt;
  const int32_t* dealt_offsets;
  int32_t grid_x, grid_y;
  // The dK/dV kernels' launch order (sparse_kv_block): the grid's rows (KV
  // heads and parts) in groups of head_group (<= 0: one group of all),
  // group after group, KV heads fastest within one (item x of each head of
  // the group, then item x + 1). One group puts the slots' long lists
  // first; groups of one head let the blocks running at a time share their
  // head's Q, dO and dQ in L2. The persistent kernel's dealing always
  // counts every head fastest.
  int32_t head_group;
};

#if defined(__CUDACC__)  // the header is also the host's (plain C++)
// The mask slot of sequence b, KV head hk (TileLists::mask_batch, mask_heads).
__device__ __forceinline__ int mask_slot(const TileLists& l, int b, int hk) {
  return (l.mask_batch > 1 ? b : 0) * l.mask_heads + (l.mask_heads > 1 ? hk : 0);
}

// Block (bx, by) of the sparse dK/dV kernels' grid (gx by ny blocks, bx the
// work item, by the KV head and part) that starts lin-th in launch order,
// lin = blockIdx.x + blockIdx.y * gx (TileLists::head_group).
__device__ __forceinline__ void sparse_kv_block(const TileLists& l, int lin, int gx, int ny,
                                                int& bx, int& by) {
  const int g = l.head_group <= 0 || l.head_group > ny ? ny : l.head_group;
  const int g0 = lin / (gx * g) * g;  // the group's first row
  const int gs = min(g, ny - g0);     // its rows (the last group may have fewer)
  const int r = lin - g0 * gx;
  bx = r / gs;
  by = g0 + (r - bx * gs);
}

// A dK/dV work item of KV-major lists (TileLists::items).
struct KvWorkItem {
  int kv_tile, visit_begin, visit_end, acc_slot;
};
// Work item x of sequence b, KV head hk's slot into *item; false when the
// slot has fewer items (its block returns).
__device__ __forceinline__ bool kv_work_item(const TileLists& l, int b, int hk, int x,
                                             KvWorkItem* item) {
  const int slot = mask_slot(l, b, hk);
  const int i0 = l.item_offsets[slot];
  if (x >= l.item_offsets[slot + 1] - i0) return false;
  const int32_t* w = l.items + kItemWords * (i0 + x);
  *item = KvWorkItem{w[0], w[1], w[2], w[3]};
  return true;
}
#endif

}  // namespace attn::flash
