#include "ring/ring_schedule.hpp"

#include <cstring>

#include "core/checked.hpp"
#include "core/error.hpp"
#include "schedule/dense_schedule.hpp"

namespace attn::ring {
namespace {

uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

uint64_t hash_combine(uint64_t h, uint64_t v) { return mix64(h ^ (v + 0x9e3779b97f4a7c15ull)); }

uint64_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

}  // namespace

const char* ring_layout_name(attn_ring_layout_t layout) {
  return layout == ATTN_RING_LAYOUT_ZIGZAG ? "zigzag" : "contiguous";
}

void RingSchedule::check_lengths(const PlanDesc& desc, int32_t size, attn_ring_layout_t layout) {
  if (desc.seqlen_q < 1 || desc.seqlen_kv < 1)
    invalid_argument("desc: ring plans need seqlen_q and seqlen_kv >= 1 (got ", desc.seqlen_q, "/",
                     desc.seqlen_kv, ")");
  const int64_t parts = layout == ATTN_RING_LAYOUT_ZIGZAG ? 2 * int64_t(size) : size;
  const char* chunking = layout == ATTN_RING_LAYOUT_ZIGZAG ? " (2 chunks per rank)" : "";
  if (desc.varlen) {
    // cu_q and cu_kv hold varlen_batch + 1 offsets (attn_plan_desc_set_varlen).
    for (size_t b = 0; b < size_t(desc.varlen_batch); ++b) {
      const int64_t lq = desc.cu_q[b + 1] - desc.cu_q[b], lk = desc.cu_kv[b + 1] - desc.cu_kv[b];
      if (lq % parts != 0 || lk % parts != 0)
        invalid_argument("desc: sequence ", b, " of the varlen batch has lengths ", lq, "/", lk,
                         " (cu_seqlens_q/cu_seqlens_kv), which must be multiples of ", parts,
                         " for the ", ring_layout_name(layout), " layout over ", size, " ranks",
                         chunking);
    }
    return;
  }
  if (desc.seqlen_q % parts != 0 || desc.seqlen_kv % parts != 0)
    invalid_argument("desc: seqlen_q and seqlen_kv (", desc.seqlen_q, "/", desc.seqlen_kv,
                     ") must be multiples of ", parts, " for the ", ring_layout_name(layout),
                     " layout over ", size, " ranks", chunking);
}

RingSchedule RingSchedule::build(const Problem& g, int32_t rank, int32_t size,
                                 attn_ring_layout_t layout) {
  RingSchedule s;
  s.layout = layout;
  s.rank = rank;
  s.size = size;
  s.chunks = layout == ATTN_RING_LAYOUT_ZIGZAG ? 2 : 1;
  const int64_t parts = int64_t(s.chunks) * size;
  for (int64_t b = 0; b < g.batch; ++b) {
    s.cq_seq.push_back(g.lq(b) / parts);
    s.ck_seq.push_back(g.lk(b) / parts);
  }
  if (g.varlen) {
    s.sq = g.total_q() / size;
    s.sk = g.total_kv() / size;
  } else {
    s.cq = g.seqlen_q / parts;
    s.ck = g.seqlen_kv / parts;
    s.sq = s.cq * s.chunks;
    s.sk = s.ck * s.chunks;
  }

  s.steps.resize(size_t(size));
  uint64_t pairs = 0;
  for (int32_t t = 0; t < size; ++t) {
    const int32_t owner = (rank - t + size) % size;
    for (int32_t qc = 0; qc < s.chunks; ++qc)
      for (int32_t kc = 0; kc < s.chunks; ++kc) {
        RingBlock blk{qc, kc, {}, true};
        uint64_t visible = 0;  // saturated, as the plan's pair counts (core/checked.hpp)
        for (int64_t b = 0; b < g.batch; ++b) {
          const int64_t cq = s.cq_seq[size_t(b)], ck = s.ck_seq[size_t(b)];
          const int64_t qs = s.chunk_index(rank, qc) * cq;
          const int64_t ks = s.chunk_index(owner, kc) * ck;
          // Query i of the block is global qs + i and sees key ks + j when
          // the global predicate holds: the block's own diagonal offset is
          // this, which for a varlen batch differs per sequence.
          const int64_t off = qs + (g.lk(b) - g.lq(b)) - ks;
          const int64_t seen = SequenceMask(cq, ck, g.window, off).visible_pairs();
          visible = sat_add(visible, uint64_t(seen));
          blk.full = blk.full && seen == cq * ck;
          blk.shifts.push_back(off - (ck - cq));
        }
        if (visible == 0) {
          ++s.blocks_skipped;
          continue;
        }
        ++s.blocks_computed;
        pairs = sat_add(pairs, visible);
        s.steps[size_t(t)].push_back(std::move(blk));
      }
  }
  s.visible_pairs = sat_mul(pairs, uint64_t(g.heads_q));

  uint64_t h = 0x52494e47ull;
  for (uint64_t v : {uint64_t(size), uint64_t(layout), uint64_t(g.dtype), uint64_t(g.layout),
                     uint64_t(g.batch), uint64_t(g.heads_q), uint64_t(g.heads_kv),
                     uint64_t(g.seqlen_q), uint64_t(g.seqlen_kv), uint64_t(g.head_dim_qk),
                     uint64_t(g.head_dim_v), uint64_t(g.mask), uint64_t(g.window.left),
                     uint64_t(g.window.right), float_bits(g.scale), float_bits(g.softcap),
                     uint64_t(g.varlen)})
    h = hash_combine(h, v);
  if (g.varlen)
    for (int64_t b = 0; b <= g.batch; ++b)
      h = hash_combine(hash_combine(h, uint64_t(g.cu_q[size_t(b)])), uint64_t(g.cu_kv[size_t(b)]));
  s.fingerprint = h;
  return s;
}

uint64_t RingSchedule::tag(attn_pass_t pass, int32_t step, Traffic what) const {
  return hash_combine(hash_combine(hash_combine(fingerprint, uint64_t(pass)), uint64_t(step)),
                      uint64_t(what));
}

}  // namespace attn::ring
