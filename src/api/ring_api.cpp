// The C boundary of ring attention: communicators and ring plans.

#include <attn/attn.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "api/guarded.hpp"
#include "attn_config.h"
#include "api/handles.hpp"
#include "core/error.hpp"
#include "ring/inprocess_transport.hpp"
#if ATTN_HAVE_NCCL
#include "ring/nccl_transport.hpp"
#endif
#include "ring/ring_plan.hpp"

struct attn_comm {
  // Shared with the ring plans made from this communicator.
  std::shared_ptr<attn::ring::Transport> transport;
};

using attn::checked;
using attn::invalid_argument;
using attn::create_handle;
using attn::guarded;
using attn::require_out;

extern "C" {

attn_status_t attn_comm_create_inprocess(int32_t num_ranks, int64_t timeout_ms,
                                         attn_comm_t* comms) {
  return guarded([&] {
    if (num_ranks < 1 || num_ranks > 1024)
      invalid_argument("num_ranks must be in 1..1024, got ", num_ranks);
    if (timeout_ms < 0) invalid_argument("timeout_ms must be >= 0 (0: no timeout), got ", timeout_ms);
    require_out(comms, "comms");
    auto transports = attn::ring::make_inprocess_group(num_ranks, timeout_ms);
    // All handles or none: build them first, publish only when all exist.
    std::vector<std::unique_ptr<attn_comm>> made;
    for (int32_t r = 0; r < num_ranks; ++r) {
      made.push_back(std::make_unique<attn_comm>());
      made.back()->transport = transports[size_t(r)];
    }
    std::vector<attn_comm*> registered;
    registered.reserve(made.size());  // so that recording a registration cannot throw
    try {
      for (auto& h : made) {
        attn::register_handle(h.get(), attn::HandleKind::comm);
        registered.push_back(h.get());
      }
    } catch (...) {
      for (attn_comm* h : registered) attn::unregister_handle(h, attn::HandleKind::comm);
      throw;
    }
    for (int32_t r = 0; r < num_ranks; ++r) comms[r] = made[size_t(r)].release();
  });
}

attn_status_t attn_comm_create_nccl(void* nccl_comm, attn_comm_t* comm) {
  return guarded([&] {
    if (nccl_comm == nullptr) invalid_argument("nccl_comm is NULL");
    require_out(comm, "comm");
#if ATTN_HAVE_NCCL
    auto h = std::make_unique<attn_comm>();
    h->transport = attn::ring::make_nccl_transport(nccl_comm);
    attn::register_handle(h.get(), attn::HandleKind::comm);
    *comm = h.release();
#else
    attn::fail(ATTN_STATUS_BACKEND_UNAVAILABLE,
               "nccl_comm: this build of libattn has no NCCL transport (configure with CUDA and ",
               "-Dnccl=enabled)");
#endif
  });
}

attn_status_t attn_comm_destroy(attn_comm_t comm) {
  return guarded([&] {
    if (comm == nullptr) return;
    if (!attn::handle_is_live(comm, attn::HandleKind::comm))
      attn::fail(ATTN_STATUS_INVALID_HANDLE,
                 "comm is not a live attn_comm_t (destroyed twice, or a handle of another kind)");
    // Everything that can fail (the message allocates) comes before the
    // handle is unregistered: a failed destroy leaves it live, not leaked.
    const std::string why =
        "rank " + std::to_string(comm->transport->rank()) + " destroyed its communicator";
    if (!attn::unregister_handle(comm, attn::HandleKind::comm))
      attn::fail(ATTN_STATUS_INVALID_HANDLE,
                 "comm is not a live attn_comm_t (destroyed twice, or a handle of another kind)");
    comm->transport->leave(why);
    delete comm;
  });
}

attn_status_t attn_comm_get_rank(attn_comm_t comm, int32_t* rank) {
  return guarded([&] {
    const attn_comm& c = checked(comm, "comm");
    require_out(rank, "rank");
    *rank = c.transport->rank();
  });
}

attn_status_t attn_comm_get_size(attn_comm_t comm, int32_t* size) {
  return guarded([&] {
    const attn_comm& c = checked(comm, "comm");
    require_out(size, "size");
    *size = c.transport->size();
  });
}

attn_status_t attn_ring_plan_create(attn_context_t ctx, attn_plan_desc_t desc, attn_comm_t comm,
                                    attn_ring_layout_t layout, attn_plan_t* plan) {
  return guarded([&] {
    // Creation is collective (NCCL): with a live comm, a rank whose
    // arguments fail still joins the ranks' agreements as a failed rank, so
    // that its peers fail instead of waiting; the handle is allocated
    // before them, so that nothing fails on this rank after its peers have
    // their plans (but its registration, which an out-of-memory may fail).
    const attn_comm& m = checked(comm, "comm");
    const attn_context* c = nullptr;
    const attn_plan_desc* d = nullptr;
    std::unique_ptr<attn_plan> h;
    try {
      c = &checked(ctx, "ctx");
      d = &checked(desc, "desc");
      if (layout != ATTN_RING_LAYOUT_CONTIGUOUS && layout != ATTN_RING_LAYOUT_ZIGZAG)
        invalid_argument("layout: unknown value ", int(layout));
      require_out(plan, "plan");
      h = std::make_unique<attn_plan>();
    } catch (...) {
      attn::ring::join_failed_ring_creation(*m.transport);
      throw;
    }
    h->plan = attn::ring::create_ring_plan(c->config, d->desc, m.transport, layout);
    attn::register_handle(h.get(), attn::HandleKind::plan);
    *plan = h.release();
  });
}

attn_status_t attn_ring_plan_describe(attn_plan_t plan, attn_ring_plan_info_t* info) {
  return guarded([&] {
    const attn::Plan& p = *checked(plan, "plan").plan;
    require_out(info, "info");
    // Every version has struct_size and layout.
    attn::require_struct_size(info, offsetof(attn_ring_plan_info_t, rank),
                              "attn_ring_plan_info_t");
    const attn::ring::RingFacts* f = attn::ring::ring_facts(p);
    if (f == nullptr)
      invalid_argument("plan is not a ring plan (made by attn_plan_create, not attn_ring_plan_create)");
    attn_ring_plan_info_t full;
    std::memset(&full, 0, sizeof full);
    full.layout = f->layout;
    full.rank = f->rank;
    full.size = f->size;
    full.steps = f->steps;
    full.exchanges_forward = f->exchanges_forward;
    full.exchanges_backward = f->exchanges_backward;
    full.local_seqlen_q = f->local_seqlen_q;
    full.local_seqlen_kv = f->local_seqlen_kv;
    full.bytes_per_step_forward = f->bytes_per_step_forward;
    full.bytes_per_step_backward = f->bytes_per_step_backward;
    full.blocks_computed = f->blocks_computed;
    full.blocks_skipped = f->blocks_skipped;
    full.local_visible_pairs = f->local_visible_pairs;
    std::snprintf(full.transport, sizeof full.transport, "%s", f->transport);
    attn::copy_sized_prefix(full, info);
  });
}

}  // extern "C"
