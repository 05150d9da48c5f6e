// Ring attention plans: one rank's part of an attention problem whose
// sequence is split over the ranks of a communicator.
#pragma once

#include <attn/attn.h>

#include <memory>

#include "core/context.hpp"
#include "plan/plan.hpp"
#include "ring/transport.hpp"

namespace attn::ring {

// What attn_ring_plan_describe reports (see attn_ring_info_t).
struct RingFacts {
  attn_ring_layout_t layout;
  int32_t rank, size;
  int32_t steps;                 // ring steps of attention (= size)
  int32_t exchanges_forward;     // sends per forward (size - 1)
  int32_t exchanges_backward;    // sends per backward
  int64_t local_seqlen_q, local_seqlen_kv;
  uint64_t bytes_per_step_forward;   // sent by this rank per forward exchange
  uint64_t bytes_per_step_backward;  // sent by this rank per backward step (K, V, dK, dV)
  uint64_t blocks_computed;      // (query chunk, KV chunk) blocks this rank computes per pass
  uint64_t blocks_skipped;       // blocks wholly masked, never computed
  uint64_t local_visible_pairs;  // (query, key) pairs this rank computes, all heads
  const char* transport;
};

// Builds the plan of rank transport->rank() for the global problem `desc`
// (global sequence lengths). Throws attn::Error.
std::unique_ptr<Plan> create_ring_plan(const ContextConfig& ctx, const PlanDesc& desc,
                                       std::shared_ptr<Transport> transport,
                                       attn_ring_layout_t layout);

// The ring facts of a plan, or nullptr when it is not a ring plan.
const RingFacts* ring_facts(const Plan& plan);

}  // namespace attn::ring
