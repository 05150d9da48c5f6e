#include "ring/ring_plan.hpp"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "attn_config.h"
#include "core/env.hpp"
#include "core/error.hpp"

namespace attn::ring {
namespace {

// "0" or "1" (core/env.hpp); unset or empty: RingOptions' defaults.
RingOptions options_from_env() {
  RingOptions o;
  o.profile = env_flag("ATTN_RING_PROFILE", o.profile);
  o.dkv_home = env_flag("ATTN_RING_DKV_HOME", o.dkv_home);
  return o;
}

}  // namespace

void fill_facts(RingFacts& f, const RingSchedule& s, const char* transport) {
  f.layout = s.layout;
  f.rank = s.rank;
  f.size = s.size;
  f.steps = s.size;
  f.exchanges_forward = s.size - 1;
  f.exchanges_backward = s.size > 1 ? 2 * s.size - 1 : 0;
  f.local_seqlen_q = s.sq;
  f.local_seqlen_kv = s.sk;
  f.blocks_computed = s.blocks_computed;
  f.blocks_skipped = s.blocks_skipped;
  f.local_visible_pairs = s.visible_pairs;
  f.transport = transport;
}

ExecutionTurn::ExecutionTurn(Transport& transport) : transport_(transport) {
  if (!transport.try_begin_execution())
    invalid_argument("comm: another ring execution on this rank's communicator is running ",
                     "(executions on one communicator must not overlap)");
}

void fail_ring_group(Transport& transport, int32_t rank, const Exchange* pending,
                     void* stream) noexcept {
  try {
    std::string why = "rank " + std::to_string(rank) + " failed: ";
    bool from_group = false;
    try {
      throw;
    } catch (const Error& e) {
      from_group = e.status() == ATTN_STATUS_COMMUNICATION_ERROR;
      why += e.what();
    } catch (const std::exception& e) {
      why += e.what();
    } catch (...) {
      why += "unknown error";
    }
    if (!from_group) transport.abort(why);
  } catch (...) {
    transport.abort("a rank failed (out of memory while saying why)");
  }
  if (pending != nullptr) transport.cancel(*pending, stream);
}

namespace {

// A rank that failed during plan creation still takes part in the
// agreement its peers are in (NCCL: a collective they would otherwise wait
// in forever); its own error is what it reports.
void agree_failed(Transport& transport) noexcept {
  try {
    transport.agree(Transport::kRingPlanFailed);
  } catch (...) {
    // the rank's own error is the one to report
  }
}

// The plan's problem, schedule and options, checked, before any agreement.
std::unique_ptr<Plan> create_ring_plan_unagreed(const ContextConfig& ctx, const PlanDesc& desc,
                                                const Transport& comm, attn_ring_layout_t layout,
                                                RingSchedule& schedule, RingOptions& options) {
  if (ctx.backend != comm.backend())
    invalid_argument("comm: a ", comm.name(), " communicator moves ",
                     comm.backend() == ATTN_BACKEND_CUDA ? "CUDA device" : "host",
                     " memory, which ctx's backend does not compute on");
  if (ctx.device != comm.device())
    invalid_argument("comm: its ", comm.name(), " communicator is on device ",
                     comm.device(), " but ctx is on device ", ctx.device);
  if (desc.block_mask)
    not_supported("desc: ring plans do not take a block mask yet (attn_plan_desc_set_block_mask)");
  if (desc.moba_block > 0)
    not_supported("desc: ring plans do not run MoBA (attn_plan_desc_set_moba)");
  for (int r = 0; r < 8; ++r)
    if (desc.tensors[r])
      not_supported("desc: ring plans take local shards with the layout's contiguous strides; ",
                    "the strides set for tensor ", tensor_role_name(attn_tensor_role_t(r)),
                    " (attn_plan_desc_set_tensor) are not supported");
  RingSchedule::check_lengths(desc, comm.size(), layout);
  // Before the dense plan is built: a malformed option fails with nothing
  // made (and names the variable, not whatever the plan would reject).
  options = options_from_env();

  // The global problem, validated as a dense plan would be (shapes, GQA,
  // empty rows, what the backend supports); its backend binding is then
  // replaced by the ring.
  std::unique_ptr<Plan> plan = create_plan(ctx, desc);
  schedule = RingSchedule::build(plan->problem, comm.rank(), comm.size(), layout);
  // The order of the backward's exchanges depends on dkv_home: ranks must agree on it too
  // where it applies (a backward over 2 or more ranks). (Tags derive from the fingerprint,
  // so both ranks' tags change alike.)
  if (options.dkv_home && plan->problem.backward && comm.size() > 1)
    schedule.fingerprint ^= 0x646b765f686f6d65ull;
  // Never the failure mark (Transport::agree).
  if (schedule.fingerprint == Transport::kRingPlanFailed) schedule.fingerprint = 1;
  return plan;
}

// The backend's ring plan into plan.impl.
void build_ring_backend(const ContextConfig& ctx, Plan& plan, std::shared_ptr<Transport> transport,
                        const RingSchedule& schedule, const RingOptions& options) {
  switch (ctx.backend) {
    case ATTN_BACKEND_CPU:
      plan.impl = make_cpu_ring_plan(ctx, plan.problem, std::move(transport), schedule, options);
      break;
    case ATTN_BACKEND_CUDA:
#if ATTN_HAVE_CUDA && ATTN_HAVE_NCCL
      plan.impl = make_cuda_ring_plan(ctx, plan.problem, std::move(transport), schedule,
                                         options);
      break;
#else
      not_supported("ctx: this build of libattn has no CUDA ring attention (needs NCCL)");
#endif
    default: fail(ATTN_STATUS_INTERNAL_ERROR, "context with unresolved backend");
  }
  // attn_ring_plan_info_t::exchanges_backward says what a backward sends
  // under the options; the backends count one dK/dV exchange fewer only
  // where they run one, so a plan without a backward pass would report the
  // schedule of ATTN_RING_DKV_HOME=0 while the default is the other.
  if (options.dkv_home && !plan.problem.backward && schedule.size > 1)
    static_cast<RingBackendPlan&>(*plan.impl).facts.exchanges_backward = 2 * schedule.size - 2;
}

}  // namespace

std::unique_ptr<Plan> create_ring_plan(const ContextConfig& ctx, const PlanDesc& desc,
                                       std::shared_ptr<Transport> transport,
                                       attn_ring_layout_t layout) {
  // Two agreements: every rank knows the schedule (and that the ranks'
  // schedules are equal), then every rank has built its plan. A rank that
  // throws before one of them joins it (and the next) with the failure
  // mark, so that its peers fail (COMMUNICATION_ERROR) instead of waiting.
  const std::shared_ptr<Transport> group = transport;
  std::unique_ptr<Plan> plan;
  RingSchedule schedule;
  RingOptions options;
  // (Transport::agree joins its collective exactly once, whatever fails.)
  try {
    plan = create_ring_plan_unagreed(ctx, desc, *transport, layout, schedule, options);
  } catch (...) {
    join_failed_ring_creation(*group);
    throw;
  }
  try {
    group->agree(schedule.fingerprint);  // (a peer failed, plans differ, or a local error)
  } catch (...) {
    agree_failed(*group);
    throw;
  }
  try {
    build_ring_backend(ctx, *plan, std::move(transport), schedule, options);
  } catch (...) {
    agree_failed(*group);
    throw;
  }
  group->agree(schedule.fingerprint);
  return plan;
}

void join_failed_ring_creation(Transport& transport) noexcept {
  agree_failed(transport);
  agree_failed(transport);
}

const char* ring_piece_name(RingPiece what) {
  switch (what) {
    case RingPiece::prologue: return "prologue";
    case RingPiece::block: return "block";
    case RingPiece::merge: return "merge";
    case RingPiece::accumulate: return "accumulate";
    case RingPiece::wait_kv: return "wait K/V";
    case RingPiece::exchange_dkv: return "dK/dV exchange";
    case RingPiece::epilogue: return "epilogue";
  }
  return "?";
}

std::vector<RingPieceTime> ring_profile(const Plan& plan, attn_pass_t pass) {
  const auto* ring = dynamic_cast<const RingBackendPlan*>(plan.impl.get());
  return ring != nullptr ? ring->profile(pass) : std::vector<RingPieceTime>{};
}

const RingFacts* ring_facts(const Plan& plan) {
  const auto* ring = dynamic_cast<const RingBackendPlan*>(plan.impl.get());
  return ring != nullptr ? &ring->facts : nullptr;
}

}  // namespace attn::ring
