// Which blocks each ring step computes, shared by the ring plans of every
// backend.
//
// Each global sequence (seqlen_q queries, seqlen_kv keys per batch entry;
// for a varlen batch, each sequence's own lengths) is cut into equal
// chunks. Rank r holds one chunk of each (contiguous layout: chunk r of N)
// or two (zigzag: chunks r and 2N-1-r of 2N), the same chunks of Q and of
// K/V, back to back in its local tensors. At step t rank r holds the K/V
// shard of rank r - t; every (local query chunk, held KV chunk) pair is a
// *block*, a dense problem over the batch whose mask keeps each sequence's
// global alignment through Problem::diagonal_shift. Blocks the mask hides
// entirely, in every sequence, are not listed.
#pragma once

#include <attn/attn.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "plan/plan.hpp"
#include "plan/problem.hpp"

namespace attn::ring {

struct RingBlock {
  int32_t q_chunk, kv_chunk;  // local chunk indices (0, or 1 for zigzag's second)
  // The diagonal shift of the block's dense problem per sequence (batch
  // entry), varlen or not.
  std::vector<int64_t> shifts;
  bool full;  // every (query, key) pair of the block is visible, in every sequence
};

struct RingSchedule {
  attn_ring_layout_t layout = ATTN_RING_LAYOUT_CONTIGUOUS;
  int32_t rank = 0, size = 1;
  int32_t chunks = 1;           // chunks per rank
  int64_t cq = 0, ck = 0;       // chunk lengths (fixed-length batches; 0 for varlen)
  int64_t sq = 0, sk = 0;       // local lengths per sequence (varlen: local tokens in all)
  std::vector<int64_t> cq_seq, ck_seq;  // chunk length of each sequence (varlen or not)
  std::vector<std::vector<RingBlock>> steps;  // steps[t]: the blocks of step t
  uint64_t blocks_computed = 0, blocks_skipped = 0;
  uint64_t visible_pairs = 0;   // over this rank's blocks, all batch entries and heads
  uint64_t fingerprint = 0;     // what every rank's plan must agree on

  // Checks that the lengths can be cut as `layout` needs (INVALID_ARGUMENT).
  static void check_lengths(const PlanDesc& desc, int32_t size, attn_ring_layout_t layout);
  static RingSchedule build(const Problem& global, int32_t rank, int32_t size,
                            attn_ring_layout_t layout);

  // Global chunk index of local chunk c of rank s.
  int64_t chunk_index(int32_t s, int32_t c) const { return c == 0 ? s : 2 * int64_t(size) - 1 - s; }

  // Names one message: plan, pass, step and what travels.
  enum class Traffic : uint64_t { kv = 1, dkv = 2 };
  uint64_t tag(attn_pass_t pass, int32_t step, Traffic what) const;
};

const char* ring_layout_name(attn_ring_layout_t layout);

// The dense plan each block of `s` runs as, per step: one for the fully
// visible blocks and one per distinct set of diagonal shifts of the others.
// make(full, shifts) creates a plan the caller keeps and returns its
// BackendPlan.
template <class Make>
std::vector<std::vector<const BackendPlan*>> block_plans(const RingSchedule& s, Make&& make) {
  std::vector<std::vector<const BackendPlan*>> out(s.steps.size());
  const BackendPlan* full = nullptr;
  std::vector<std::pair<std::vector<int64_t>, const BackendPlan*>> by_shifts;
  for (size_t t = 0; t < s.steps.size(); ++t)
    for (const RingBlock& rb : s.steps[t]) {
      const BackendPlan* plan = nullptr;
      if (rb.full) {
        if (full == nullptr) full = make(true, std::vector<int64_t>{});
        plan = full;
      } else {
        for (const auto& e : by_shifts)
          if (e.first == rb.shifts) plan = e.second;
        if (plan == nullptr) {
          plan = make(false, rb.shifts);
          by_shifts.push_back({rb.shifts, plan});
        }
      }
      out[t].push_back(plan);
    }
  return out;
}

}  // namespace attn::ring
