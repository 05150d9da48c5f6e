// How ring steps move bytes between ranks. A transport connects one rank to
// the others of its group; the ring only ever sends to rank + 1 and receives
// from rank - 1, one exchange in flight at a time, so the interface is that
// exchange split in two: start() posts it, the caller computes, finish()
// completes it. Implementations: in-process threads (inprocess_transport)
// and NCCL.
#pragma once

#include <attn/attn.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace attn::ring {

// One exchange: `bytes` from `send` go to rank + 1 while rank - 1's message
// of the same size lands in `recv`. `tag` names the plan, pass and step; a
// receiver whose peer sent another tag or size reports a mismatch instead of
// reading a message it does not understand. send must stay unchanged and
// recv untouched by the caller until finish() returns.
struct Exchange {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t bytes = 0;
  uint64_t tag = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Ring executions on one communicator must not overlap (attn.h): the
  // first takes the communicator, a concurrent second one is refused at
  // once (ExecutionTurn, ring_plan.hpp) instead of mixing its messages in.
  bool try_begin_execution() noexcept { return !executing_.exchange(true); }
  void end_execution() noexcept { executing_.store(false); }
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  virtual const char* name() const = 0;
  // The backend whose memory the buffers of an exchange live in, and its
  // device (0 for host memory).
  virtual attn_backend_t backend() const = 0;
  virtual int32_t device() const = 0;

  // Called by every rank at ring plan creation, twice: with the plan's
  // fingerprint (never kRingPlanFailed) once the schedule is known and once
  // the plan is built, or with kRingPlanFailed by a rank that failed before
  // either point (it then reports its own error), so that every rank takes
  // part in each call. A transport that cannot check each message (NCCL)
  // compares them here (a collective call) and throws COMMUNICATION_ERROR
  // on a mismatch or a failed peer; the in-process one checks the tag of
  // every message instead and does nothing.
  static constexpr uint64_t kRingPlanFailed = 0;
  virtual void agree(uint64_t fingerprint) = 0;

  // Throws COMMUNICATION_ERROR when the group has failed already, so that a
  // ring without exchanges (one rank) notices too.
  virtual void check_usable() = 0;

  // Both throw attn::Error(COMMUNICATION_ERROR) when the group failed or
  // fails meanwhile (a peer left, a mismatch, a timeout); the group is then
  // unusable for every rank.
  virtual void start(const Exchange& x, void* stream) = 0;
  virtual void finish(const Exchange& x, void* stream) = 0;

  // Withdraws a started exchange that will not be finished (the caller
  // failed in between), so that its buffers may be reused or freed: the
  // in-process transport waits only for a copy out of the send buffer that
  // is already running; NCCL, whose enqueued operations cannot be
  // withdrawn, makes the caller's stream wait for them (until the peers
  // take part or the application aborts the NCCL communicator).
  virtual void cancel(const Exchange& x, void* stream) noexcept = 0;

  // Marks the whole group failed, so that every rank's current and future
  // exchanges fail with `reason` instead of waiting for this rank.
  virtual void abort(const std::string& reason) noexcept = 0;

  // This rank leaves the group (its communicator is destroyed): every later
  // execution fails, and so does a current exchange that still needs this
  // rank, but one that has what it waited for (a rank returns once its own
  // exchanges are done, while its peers may still finish theirs) goes on.
  // By default, as abort().
  virtual void leave(const std::string& reason) noexcept { abort(reason); }

 private:
  std::atomic<bool> executing_{false};
};

}  // namespace attn::ring
