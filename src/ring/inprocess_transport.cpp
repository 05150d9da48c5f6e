#include "ring/inprocess_transport.hpp"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>

#include "core/error.hpp"

namespace attn::ring {
namespace {

// The group's state, shared by its transports. inbox[r] holds the message
// rank r - 1 posted for rank r: the receiver copies straight out of the
// sender's buffer, so a message is a pointer, not a copy.
struct Group {
  enum class SlotState { empty, posted, copying };
  struct Slot {
    SlotState state = SlotState::empty;
    const void* data = nullptr;
    size_t bytes = 0;
    uint64_t tag = 0;
  };

  Group(int32_t n, int64_t timeout) : size(n), timeout_ms(timeout), inbox(size_t(n)) {}

  const int32_t size;
  const int64_t timeout_ms;
  std::mutex mutex;
  std::condition_variable changed;
  bool aborted = false;
  std::string reason;
  std::vector<Slot> inbox;

  // Under the lock: the first reason wins, later failures are its echoes.
  void abort_locked(const std::string& why) {
    if (!aborted) {
      aborted = true;
      reason = why;
    }
    changed.notify_all();
  }

  [[noreturn]] void throw_aborted(int32_t rank) const {
    fail(ATTN_STATUS_COMMUNICATION_ERROR, "ring (in-process rank ", rank, " of ", size,
         "): the group was aborted: ", reason);
  }

  // Waits under `lock` until ready() or the group aborts (then throws);
  // aborts the group itself when the timeout expires.
  template <class Ready>
  void wait(std::unique_lock<std::mutex>& lock, int32_t rank, const char* what, Ready ready) {
    auto done = [&] { return aborted || ready(); };
    if (timeout_ms <= 0) {
      changed.wait(lock, done);
    } else if (!changed.wait_for(lock, std::chrono::milliseconds(timeout_ms), done)) {
      abort_locked("rank " + std::to_string(rank) + " timed out after " +
                   std::to_string(timeout_ms) + " ms waiting for " + what);
    }
    if (aborted) throw_aborted(rank);
  }
};

class InprocessTransport final : public Transport {
 public:
  InprocessTransport(std::shared_ptr<Group> group, int32_t rank)
      : group_(std::move(group)), rank_(rank) {}

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return group_->size; }
  const char* name() const override { return "inprocess"; }
  attn_backend_t backend() const override { return ATTN_BACKEND_CPU; }
  int32_t device() const override { return 0; }

  void agree(uint64_t) override {}

  void check_usable() override {
    std::lock_guard lock(group_->mutex);
    if (group_->aborted) group_->throw_aborted(rank_);
  }

  void start(const Exchange& x, void*) override {
    Group& g = *group_;
    std::unique_lock lock(g.mutex);
    Group::Slot& out = g.inbox[size_t(next())];
    // Free unless the previous exchange was abandoned half way.
    g.wait(lock, rank_, "its previous message to be taken",
           [&] { return out.state == Group::SlotState::empty; });
    out.state = Group::SlotState::posted;
    out.data = x.send;
    out.bytes = x.bytes;
    out.tag = x.tag;
    g.changed.notify_all();
  }

  void finish(const Exchange& x, void*) override {
    Group& g = *group_;
    std::unique_lock lock(g.mutex);
    Group::Slot& in = g.inbox[size_t(rank_)];
    Group::Slot& out = g.inbox[size_t(next())];
    try {
      const int32_t prev = (rank_ + g.size - 1) % g.size;
      const std::string from = "rank " + std::to_string(prev);
      g.wait(lock, rank_, from.c_str(), [&] { return in.state == Group::SlotState::posted; });
      if (in.tag != x.tag || in.bytes != x.bytes) {
        g.abort_locked("rank " + std::to_string(rank_) + " expected a message of " +
                       std::to_string(x.bytes) + " bytes with tag " + std::to_string(x.tag) +
                       " but rank " + std::to_string(prev) + " sent " + std::to_string(in.bytes) +
                       " bytes with tag " + std::to_string(in.tag) +
                       " (plans or calls differ between ranks)");
        g.throw_aborted(rank_);
      }
      // Copy outside the lock; the sender keeps its buffer until the slot is
      // empty again, even when the group aborts meanwhile (see below).
      in.state = Group::SlotState::copying;
      const void* src = in.data;
      lock.unlock();
      std::memcpy(x.recv, src, x.bytes);
      lock.lock();
      in.state = Group::SlotState::empty;
      in.data = nullptr;
      g.changed.notify_all();
      const std::string to = "rank " + std::to_string(next()) + " to take this rank's message";
      g.wait(lock, rank_, to.c_str(), [&] { return out.state == Group::SlotState::empty; });
    } catch (...) {
      withdraw(lock, x);
      throw;
    }
  }

  void cancel(const Exchange& x, void*) noexcept override {
    try {
      std::unique_lock lock(group_->mutex);
      withdraw(lock, x);
    } catch (...) {
      // locking cannot fail in practice
    }
  }

  void abort(const std::string& reason) noexcept override {
    try {
      std::lock_guard lock(group_->mutex);
      group_->abort_locked(reason);
    } catch (...) {
      // the mutex cannot fail in practice; nothing else to do
    }
  }

 private:
  int32_t next() const { return (rank_ + 1) % group_->size; }

  // The caller may free its send buffer once we return: take the message
  // back unless the receiver took it already, waiting out a copy that is
  // running (it ends by itself).
  void withdraw(std::unique_lock<std::mutex>& lock, const Exchange& x) {
    Group& g = *group_;
    Group::Slot& out = g.inbox[size_t(next())];
    g.changed.wait(lock, [&] { return out.state != Group::SlotState::copying; });
    if (out.state == Group::SlotState::posted && out.data == x.send) {
      out.state = Group::SlotState::empty;
      out.data = nullptr;
      g.changed.notify_all();
    }
  }

  std::shared_ptr<Group> group_;
  int32_t rank_;
};

}  // namespace

std::vector<std::shared_ptr<Transport>> make_inprocess_group(int32_t n, int64_t timeout_ms) {
  auto group = std::make_shared<Group>(n, timeout_ms);
  std::vector<std::shared_ptr<Transport>> ranks;
  for (int32_t r = 0; r < n; ++r) ranks.push_back(std::make_shared<InprocessTransport>(group, r));
  return ranks;
}

}  // namespace attn::ring
