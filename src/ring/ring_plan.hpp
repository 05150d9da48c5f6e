// Ring attention plans: one rank's part of an attention problem whose
// sequence is split over the ranks of a communicator. The block schedule is
// in ring_schedule.hpp; each backend runs it in its own ring plan.
#pragma once

#include <attn/attn.h>

#include <memory>
#include <vector>

#include "attn_config.h"
#include "core/context.hpp"
#include "plan/plan.hpp"
#include "ring/ring_schedule.hpp"
#include "ring/transport.hpp"

namespace attn::ring {

// What attn_ring_plan_describe reports (see attn_ring_plan_info_t).
struct RingFacts {
  attn_ring_layout_t layout = ATTN_RING_LAYOUT_CONTIGUOUS;
  int32_t rank = 0, size = 1;
  int32_t steps = 1;               // ring steps of attention (= size)
  int32_t exchanges_forward = 0;   // sends per forward (size - 1)
  int32_t exchanges_backward = 0;  // sends per backward
  int64_t local_seqlen_q = 0, local_seqlen_kv = 0;
  uint64_t bytes_per_step_forward = 0;   // sent by this rank per forward exchange
  uint64_t bytes_per_step_backward = 0;  // sent per backward step (K, V, dK, dV)
  uint64_t blocks_computed = 0;  // (query chunk, KV chunk) blocks this rank computes per pass
  uint64_t blocks_skipped = 0;   // blocks wholly masked, never computed
  uint64_t local_visible_pairs = 0;  // (query, key) pairs this rank computes, all heads
  const char* transport = "";
};

// What one timed piece of a ring execution was (RingPieceTime).
enum class RingPiece : int32_t {
  prologue,      // before the first step: zeroing, packing K/V, gathers
  block,         // one block's dense kernels
  merge,         // forward: the block's (O, LSE) merge into the running state
  accumulate,    // backward: the block's dQ, dK, dV added into the fp32 sums
  wait_kv,       // the compute stream waiting for the K/V exchange to land
  exchange_dkv,  // backward: the dK/dV accumulators' exchange, as exposed on the stream
  epilogue,      // after the last step: outputs from the fp32 sums
};
const char* ring_piece_name(RingPiece what);

// One piece of the last execution of a pass, in stream order: `ms` from the
// end of the previous piece (the start of the pass for the first).
struct RingPieceTime {
  int32_t step;   // ring step (-1: prologue / epilogue)
  int32_t block;  // index of the block in its step, or -1
  RingPiece what;
  float ms;
};

// Diagnostics and schedule options of the ring plans, read from the
// environment at plan creation (create_ring_plan).
struct RingOptions {
  // ATTN_RING_PROFILE=1 (CUDA ring plans): CUDA events between the pieces
  // of each step (ring_profile() reads them); nothing else changes.
  bool profile = false;
  // On by default (backward, 2 or more ranks): the rank's own K/V shard's
  // dK/dV stay home; its blocks run one before the foreign steps (covering
  // the first K/V exchange) and the rest after them, covering the return of
  // the travelling accumulator, which then starts at step 1: one dK/dV
  // exchange fewer, and the last one overlapped with compute (2 x H200,
  // 64K causal zigzag backward: 231.6 -> 226.6 ms). ATTN_RING_DKV_HOME=0
  // sends every shard's dK/dV round the ring instead.
  bool dkv_home = true;
};

// A backend's ring plan: a BackendPlan that also describes its ring.
class RingBackendPlan : public BackendPlan {
 public:
  RingFacts facts;
  // The pieces of the last `pass` execution (waits for it to finish); empty
  // unless the plan profiles (RingOptions::profile).
  virtual std::vector<RingPieceTime> profile(attn_pass_t) const { return {}; }
};

// The pieces of a ring plan's last `pass` (RingBackendPlan::profile); empty
// for other plans. Diagnostics for ring_bench; not part of the C API.
std::vector<RingPieceTime> ring_profile(const Plan& plan, attn_pass_t pass);

// Fills the facts that follow from the schedule (all but the bytes).
void fill_facts(RingFacts& facts, const RingSchedule& schedule, const char* transport);

// A ring execution's hold on its communicator, from its first line: a
// second execution on the communicator meanwhile is INVALID_ARGUMENT
// before it does anything (the running one, and the group, unaffected).
class ExecutionTurn {
 public:
  explicit ExecutionTurn(Transport& transport);
  ~ExecutionTurn() { transport_.end_execution(); }
  ExecutionTurn(const ExecutionTurn&) = delete;
  ExecutionTurn& operator=(const ExecutionTurn&) = delete;

 private:
  Transport& transport_;
};

// Called from a catch block of a ring execution: a failure of this rank
// mid-ring fails the whole group, so that peers stop waiting for it (a
// COMMUNICATION_ERROR came from the group and is not echoed); a started
// exchange is withdrawn.
void fail_ring_group(Transport& transport, int32_t rank, const Exchange* pending,
                     void* stream) noexcept;

// Builds the plan of rank transport->rank() for the global problem `desc`
// (global sequence lengths). Throws attn::Error. Collective: it takes part
// in two agreements of the ranks (Transport::agree) on every path, failed
// ones included, so that a rank's failure fails its peers' creation
// instead of leaving them waiting.
std::unique_ptr<Plan> create_ring_plan(const ContextConfig& ctx, const PlanDesc& desc,
                                       std::shared_ptr<Transport> transport,
                                       attn_ring_layout_t layout);
// For a rank whose ring plan creation failed before create_ring_plan (its
// arguments): its part in the two agreements, as a failed rank's.
void join_failed_ring_creation(Transport& transport) noexcept;

// The ring facts of a plan, or nullptr when it is not a ring plan.
const RingFacts* ring_facts(const Plan& plan);

// The backends' ring plans (the global problem is validated).
std::unique_ptr<RingBackendPlan> make_cpu_ring_plan(const ContextConfig& ctx, const Problem& global,
                                                    std::shared_ptr<Transport> transport,
                                                    const RingSchedule& schedule,
                                                    const RingOptions& options);
#if ATTN_HAVE_CUDA && ATTN_HAVE_NCCL
std::unique_ptr<RingBackendPlan> make_cuda_ring_plan(const ContextConfig& ctx, const Problem& global,
                                                     std::shared_ptr<Transport> transport,
                                                     const RingSchedule& schedule,
                                                     const RingOptions& options);
#endif

}  // namespace attn::ring
