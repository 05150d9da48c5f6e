// MoBA on the CUDA backend: the run-time schedule the selector kernels
// (moba/moba_select.cuh) write into the workspace and the attention kernels'
// MoBA instantiations walk. Plain C++ (no CUDA syntax) so that the host side
// in src/cuda fills it with an ordinary C++ compiler.
//
// A "selecting slot" is (sequence b, selecting head hs): hs is the KV head
// when the selection is shared by a GQA group, else the query head;
// slot = b * sel_heads + hs.
//
// The schedule is kept at the granularity of MoBA blocks, not of kernel
// tiles, so that its size does not grow with tiles x tiles:
//   selected   [slots][num_blocks][q_words] 64-bit words: bit i % 64 of word
//              i / 64 says that query row i selected the block (its own
//              block included). The one bit a kernel needs per (row, tile).
//   q lists    per (slot, forward query tile of q_tile_rows rows) the blocks
//              any of the tile's rows selected, increasing, each with
//              kMobaAllRows when every row of the tile selected it.
//   kv lists   per (sequence, KV head, block) the backward dK/dV kernel's
//              query tiles (kv_tile_rows rows) in which some row of some
//              query head of the group selected the block, increasing, with
//              kMobaAllRows when every row of every such head did.
//   row lists  (gather = 1, instead of the kv lists) per (slot, block) the
//              query rows that selected the block, increasing: the dK/dV
//              kernel walks tiles of these rows, so that its work follows
//              the selected (row, block) pairs, not the union over a tile.
//              Rows whose own block is kb come first and are contiguous
//              (every row selects its own block; a row never selects a
//              later one), which the kernel's causal mask relies on.
//   round lists (the gathered forward, instead of the row lists) round r
//              of a row is its r-th selected block counting down from its
//              own block (round 0); per (round, slot, block) the rows whose
//              round-r block it is. The forward runs one launch per round
//              over every list of the round, so that a launch fills the GPU
//              and meets each row at most once (its softmax state is
//              merged without races), with rounds <= top_k + 1 launches
//              instead of one per block. Each list starts at a multiple of
//              the forward's query tile in the slot's rows (a tile holds
//              rows of one block); round 0's lists are the own-block rows in
//              increasing order (the causal mask numbers them), the others'
//              order is the device's (their rows see the whole block, and a
//              row's result does not depend on the tile it shares). A
//              row's entry in the list of its last round carries
//              kMobaLastRound: that launch writes its O and LSE.
#pragma once

#include <cstdint>
#include <climits>

namespace attn::flash {

constexpr int32_t kMobaAllRows = int32_t(1) << 30;  // list entry flag
constexpr int32_t kMobaIndexMask = kMobaAllRows - 1;
// Round lists: the row's last round (its entry negative), and the row.
constexpr int32_t kMobaLastRound = INT32_MIN;
constexpr int32_t kMobaRowMask = INT32_MAX;

struct MobaLists {
  const uint64_t* selected;  // [slots][num_blocks][ceil(seqlen_q / 64)]
  const int32_t* q_count;    // [slots][q_tiles]
  const int32_t* q_blocks;   // [slots][q_tiles][q_cap]
  // gather = 0: the kv lists. gather = 1: the row lists, kv_count holding
  // [slots][num_blocks + 1] offsets (list (slot, kb) is entries
  // [kv_count[kb], kv_count[kb + 1]) of the slot's part) and kv_tiles
  // [slots][kv_cap] row indices (kv_cap: a slot's most entries). The
  // gathered forward: the round lists, kv_count holding [rounds][slots]
  // [num_blocks + 1] pairs (start in the slot's rows, rows; the last pair's
  // start ends the round's lists) and kv_tiles [slots][kv_cap] rows.
  const int32_t* kv_count;   // [batch * heads_kv][num_blocks]
  const int32_t* kv_tiles;   // [batch * heads_kv][num_blocks][kv_cap]
  // Gathered forward: per (sequence, query head, row) the softmax state of
  // the blocks done so far, O (normalised, fp32) [batch][heads_q][seqlen_q][d]
  // then its LSE [batch][heads_q][seqlen_q]; a row's last round writes O
  // and LSE instead.
  float* state;
  int32_t block;             // keys per MoBA block, a multiple of every kernel's KV tile
  int32_t num_blocks;        // ceil(seqlen_kv / block)
  int32_t q_tiles;           // ceil(seqlen_q / the forward kernel's block_m)
  int32_t q_cap, kv_cap;     // list capacities (entries)
  int32_t sel_heads;         // heads_kv when shared, else heads_q
  int32_t fwd_round;         // gathered forward: the round this launch computes
  int16_t per_query_head;    // 1: slots count query heads
  // 1: kv_count and kv_tiles are the row lists (the gathered kernels,
  // flash_fwd_moba_gather_kernel and flash_bwd_dkdv_moba_gather_kernel).
  int16_t gather;
};
// The size it had before the gathered lists: the parameter layout of every
// kernel (dense ones included) stays the same.
static_assert(sizeof(MobaLists) == 80, "MobaLists: the kernels' parameter layout");

}  // namespace attn::flash

namespace attn::moba {

// The selector kernels' parameters (moba/moba_select.cuh). Strides in
// elements, as flash::FwdParams; fixed-length batches only.
struct SelectParams {
  const void* q;  // [batch, seqlen_q, heads_q, d]
  const void* k;  // [batch, seqlen_kv, heads_kv, d]
  int64_t q_batch, q_seq, q_head;
  int64_t k_batch, k_seq, k_head;
  float* pooled;       // [batch][heads_kv][num_blocks][d] block means of K
  uint64_t* selected;  // flash::MobaLists::selected, every word written by select_kernel
  int32_t* q_count;    // flash::MobaLists (null: the q lists are not built)
  int32_t* q_blocks;
  int32_t* kv_count;  // flash::MobaLists (null: the kv lists are not built)
  int32_t* kv_tiles;
  int32_t* row_offsets;  // gathered row lists (null: not built): flash::MobaLists
  int32_t* rows;         // kv_count and kv_tiles with gather = 1
  int32_t rows_cap;      // entries per slot: seqlen_q x min(top_k + 1, num_blocks)
  // The gathered forward's round lists (null: not built): flash::MobaLists
  // kv_count and kv_tiles of its launches; round r's lists lie in entries
  // [r round_cap, (r + 1) round_cap) of the slot's rows.
  int32_t* round_lists;  // [rounds][slots][num_blocks + 1][2], zeroed before the selection
  int32_t* round_rows;   // [slots][rounds * round_cap]
  int32_t rounds;        // min(top_k + 1, num_blocks)
  int32_t round_tile;    // the forward's query tile: every list starts at a multiple
  int32_t round_cap;     // seqlen_q + num_blocks * (round_tile - 1)
  int32_t batch, heads_q, heads_kv, group, seqlen_q, seqlen_kv, d;
  int32_t block, num_blocks, top_k, shared;
  int32_t sel_heads, q_words;
  int32_t q_tiles, q_tile_rows, q_cap;       // forward query tiles
  int32_t kv_q_tiles, kv_tile_rows, kv_cap;  // the dK/dV kernel's query tiles
  // Written by select_kernel<T, true> only (the gate test,
  // tests/gpu/test_moba_gates.cu): [slots][seqlen_q][num_blocks], the gates
  // the kernel computed, for every row of a 64-row tile and the blocks
  // before the tile's last row's own block (a row reads those before its
  // own); other entries are left as they were.
  float* gates;
};

// The gathered forward's rows that see no key (moba/moba_select.cuh
// blind_rows_kernel: the first seqlen_q - seqlen_kv of each sequence, in no
// list): O = 0, LSE = -inf.
struct BlindRowsParams {
  void* o;             // [batch, seqlen_q, heads_q, d] with the strides below
  float* lse;          // may be null
  int64_t o_batch, o_seq, o_head, lse_batch, lse_head;
  int32_t batch, heads_q, seqlen_q, seqlen_kv, d;
};

// The selector's tiling: query rows and past blocks per step of the gate
// product, the channels of block means staged at a time (d must be a
// multiple), and the largest top_k it keeps per row.
constexpr int kSelectRows = 64, kSelectBlocks = 64, kSelectThreads = 256;
constexpr int kSelectSlab = 32;
constexpr int kMaxTopK = 32;
constexpr int kPoolThreads = 256;
constexpr int kListThreads = 256;  // 8 warps, one list each

// Dynamic shared memory of select_kernel for head dimension d: Q rows in
// fp32 (padded by 8 floats), a slab of a chunk's block means as three bf16
// planes (padded by 8 elements; see select_kernel), the chunk's gates, the
// CTA's 64 output words and the block indices of the rows' running top
// lists. d = 128: 73.75 KiB, d = 256: 105.75 KiB.
constexpr int kSelectLdSlab = kSelectSlab + 8;
constexpr size_t select_smem_bytes(int d) {
  return size_t(kSelectRows) * size_t(d + 8) * 4u + 3u * size_t(kSelectBlocks) * kSelectLdSlab * 2u +
         size_t(kSelectRows) * size_t(kSelectBlocks + 1) * 4u + size_t(kSelectBlocks) * 8u +
         size_t(kSelectRows) * kMaxTopK * 4u;
}

}  // namespace attn::moba
