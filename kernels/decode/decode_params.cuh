// Parameters of the paged decode and KV append kernels (plain data, shared
// by the host code in src/cuda and the kernels in paged_decode.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace attn::decode {

// Mirrors of the metadata the host writes into the workspace
// (src/kv/decode_plan.hpp; the host side checks that the layouts agree).
struct Header {
  uint64_t magic, plan_id, cache_id, generation;
  int64_t batch, total_q, num_units, chunk_pages;
};
struct SeqMeta {
  int64_t q_begin, q_len, length, first_unit, num_units;
};
struct PageEntry {
  int64_t logical, page;
};
struct WorkUnit {
  int64_t seq, entry_begin, entry_end, partial;
};

struct DecodeParams {
  const void* q;  // [total_q][heads_q][D]
  void* o;        // [total_q][heads_q][D]
  float* lse;     // [heads_q][total_q] or null
  const void* k_pool;  // page p of K at k_pool + p * page_elems
  const void* v_pool;
  int64_t page_elems;                 // elements of one K (or V) page
  int64_t head_stride, slot_stride;   // a token row at head * head_stride + slot * slot_stride
  const Header* header;
  const SeqMeta* seqs;
  const PageEntry* entries;
  const WorkUnit* units;
  // Balanced split: block x runs units [block_units[x], block_units[x + 1]);
  // null: unit x (when below the header's num_units).
  const int32_t* block_units;
  float* partial_o;    // [slot][max_q][heads_q][D]
  float* partial_lse;  // [slot][max_q][heads_q]
  int32_t page_size, heads_q, group, max_q;
  int32_t heads_kv, pad;
  int64_t window, sinks;  // window 0: none
  float scale, softcap;   // softcap 0: off
  // The tensor-copy kernel's views of the K and V pools (paged_decode_tma.cuh;
  // encoded by the host per launch, unused by the other kernels).
  CUtensorMap k_map, v_map;
};

// A run of tokens of one append that land in consecutive slots of one page.
struct AppendRun {
  int64_t src_token;  // first token in the append's K/V
  int32_t page, slot, count, pad;
};
constexpr int kAppendRunsPerLaunch = 96;
// The append kernel's block size and the units each thread moves per pass.
constexpr int kAppendThreads = 256, kAppendIlp = 4;

struct AppendParams {
  const unsigned char* k_src;  // [tokens][heads_kv][dk] bytes of the element type
  const unsigned char* v_src;
  unsigned char* k_pool;
  unsigned char* v_pool;
  int64_t k_page_bytes, v_page_bytes;
  int64_t k_row_bytes, v_row_bytes;  // one head of one token
  int64_t k_head_stride, k_slot_stride, v_head_stride, v_slot_stride;  // bytes
  int32_t heads_kv, num_runs;
  AppendRun runs[kAppendRunsPerLaunch];
};

}  // namespace attn::decode
