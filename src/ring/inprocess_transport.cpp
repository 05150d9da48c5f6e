#include "ring/inprocess_transport.hpp"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#include "core/error.hpp"

namespace attn::ring {
namespace {

// The group's state, shared by its transports. inbox[r] holds the message
// rank r - 1 posted for rank r: a pointer to the sender's buffer, copied
// straight into the receiver's. A mover thread of the group does that copy
// as soon as both sides have started the exchange, so that it runs while
// the ranks compute; a receiver that gets to finish() first copies itself.
struct Group {
  enum class SlotState { empty, posted, copying, delivered };
  struct Slot {
    SlotState state = SlotState::empty;
    const void* data = nullptr;  // the sender's side
    size_t bytes = 0;
    uint64_t tag = 0;
    void* recv = nullptr;        // the receiver's side, once it started
    size_t recv_bytes = 0;
    uint64_t recv_tag = 0;
  };

  Group(int32_t n, int64_t timeout)
      : size(n), timeout_ms(timeout), inbox(size_t(n)), departed(size_t(n), 0) {
    if (n <= 1) return;
    try {
      mover = std::thread([this] { move_messages(); });
    } catch (const std::system_error& e) {
      // The system lacks the memory or thread slots: a resource failure
      // like an allocation, not a bug.
      fail(ATTN_STATUS_OUT_OF_MEMORY, "num_ranks: could not start the group's message thread (",
           e.what(), ")");
    }
  }
  ~Group() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
      changed.notify_all();
    }
    if (mover.joinable()) mover.join();
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const int32_t size;
  const int64_t timeout_ms;
  std::mutex mutex;
  std::condition_variable changed;
  bool aborted = false;
  bool stopping = false;
  std::string reason;
  std::vector<Slot> inbox;
  // Ranks that left (destroyed their communicator), and the first one's why.
  std::vector<char> departed;
  int32_t first_departed = -1;
  std::string departed_reason;
  std::thread mover;

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
  [[noreturn]] void throw_departed(int32_t rank, int32_t peer) const {
    fail(ATTN_STATUS_COMMUNICATION_ERROR, "ring (in-process rank ", rank, " of ", size,
         "): rank ", peer, " left the group (",
         peer == first_departed ? departed_reason : std::string("it destroyed its communicator"),
         ")");
  }
  // Under the lock: fails when the group aborted or a rank left.
  void check_usable_locked(int32_t rank) const {
    if (aborted) throw_aborted(rank);
    if (first_departed >= 0) throw_departed(rank, first_departed);
  }

  // What a wait is for, as "<before><peer><after>" (no peer when peer < 0).
  // Kept as pieces so that the text is only built when a wait times out:
  // exchanges run inside executions, which never allocate.
  struct WaitingFor {
    const char* before;
    int32_t peer;
    const char* after;
  };

  // Waits under `lock` until ready(), the group aborts, or the peer it
  // waits on (what.peer, if any) leaves without having done its part (then
  // aborts the group and throws); aborts the group itself when the timeout
  // expires. A rank that left after doing its part fails nothing here.
  template <class Ready>
  void wait(std::unique_lock<std::mutex>& lock, int32_t rank, const WaitingFor& what,
            Ready ready) {
    auto peer_left = [&] { return what.peer >= 0 && departed[size_t(what.peer)] != 0; };
    auto done = [&] { return aborted || ready() || peer_left(); };
    // Beyond 2^40 ms (35 years) the deadline now + timeout overflows the
    // clock's nanoseconds and would lie in the past: wait without bound.
    constexpr int64_t kUnboundedMs = int64_t(1) << 40;
    if (timeout_ms <= 0 || timeout_ms >= kUnboundedMs) {
      changed.wait(lock, done);
    } else if (!changed.wait_for(lock, std::chrono::milliseconds(timeout_ms), done)) {
      abort_locked("rank " + std::to_string(rank) + " timed out after " +
                   std::to_string(timeout_ms) + " ms waiting for " + what.before +
                   (what.peer >= 0 ? std::to_string(what.peer) : std::string()) + what.after);
    }
    // What this rank waited for happened: an abort that came in meanwhile
    // (a peer done with it leaving, then another rank failing on that) is
    // not this wait's failure; the rank's next wait, if any, sees it.
    if (ready()) return;
    if (aborted) throw_aborted(rank);
    // The peer left without doing its part: this execution cannot complete
    // on any rank, so fail the group (ranks that do not wait on the one
    // that left would otherwise wait on this one).
    abort_locked("rank " + std::to_string(what.peer) + " left the group (" +
                 (what.peer == first_departed ? departed_reason
                                              : std::string("it destroyed its communicator")) +
                 ")");
    throw_departed(rank, what.peer);
  }

  // Slot r is ready to copy: posted, and its receiver has started.
  bool ready_to_copy(const Slot& s) const {
    return s.state == SlotState::posted && s.recv != nullptr;
  }

  // Under the lock, for slot r whose both sides are known: false (and the
  // group aborted) when they disagree on the message.
  bool matches_locked(int32_t r, const Slot& s) {
    if (s.tag == s.recv_tag && s.bytes == s.recv_bytes) return true;
    const int32_t prev = (r + size - 1) % size;
    abort_locked("rank " + std::to_string(r) + " expected a message of " +
                 std::to_string(s.recv_bytes) + " bytes with tag " + std::to_string(s.recv_tag) +
                 " but rank " + std::to_string(prev) + " sent " + std::to_string(s.bytes) +
                 " bytes with tag " + std::to_string(s.tag) +
                 " (plans or calls differ between ranks)");
    return false;
  }

  // Copies slot r's message outside the lock (both buffers stay valid while
  // the state is `copying`: neither side returns before it ends).
  void copy_unlocked(std::unique_lock<std::mutex>& lock, Slot& s) {
    s.state = SlotState::copying;
    const void* src = s.data;
    void* dst = s.recv;
    const size_t n = s.bytes;
    lock.unlock();
    std::memcpy(dst, src, n);
    lock.lock();
    s.state = SlotState::delivered;
    changed.notify_all();
  }

  void move_messages() {
    std::unique_lock lock(mutex);
    for (;;) {
      int32_t found = -1;
      changed.wait(lock, [&] {
        if (stopping) return true;
        if (aborted) return false;  // no new copies into a failed group
        for (int32_t r = 0; r < size; ++r)
          if (ready_to_copy(inbox[size_t(r)])) {
            found = r;
            return true;
          }
        return false;
      });
      if (stopping) return;
      Slot& s = inbox[size_t(found)];
      if (matches_locked(found, s)) copy_unlocked(lock, s);
    }
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
    group_->check_usable_locked(rank_);
  }

  void start(const Exchange& x, void*) override {
    Group& g = *group_;
    std::unique_lock lock(g.mutex);
    Group::Slot& in = g.inbox[size_t(rank_)];
    Group::Slot& out = g.inbox[size_t(next())];
    // Free unless the previous exchange was abandoned half way.
    g.wait(lock, rank_, {"rank ", next(), " to take its previous message"},
           [&] { return out.state == Group::SlotState::empty; });
    out.state = Group::SlotState::posted;
    out.data = x.send;
    out.bytes = x.bytes;
    out.tag = x.tag;
    in.recv = x.recv;
    in.recv_bytes = x.bytes;
    in.recv_tag = x.tag;
    g.changed.notify_all();
  }

  void finish(const Exchange& x, void*) override {
    Group& g = *group_;
    std::unique_lock lock(g.mutex);
    Group::Slot& in = g.inbox[size_t(rank_)];
    Group::Slot& out = g.inbox[size_t(next())];
    try {
      const int32_t prev = (rank_ + g.size - 1) % g.size;
      g.wait(lock, rank_, {"rank ", prev, ""}, [&] {
        return in.state == Group::SlotState::posted || in.state == Group::SlotState::delivered;
      });
      if (in.state == Group::SlotState::posted) {  // the mover has not taken it: copy here
        if (!g.matches_locked(rank_, in)) g.throw_aborted(rank_);
        g.copy_unlocked(lock, in);
      }
      in.state = Group::SlotState::empty;
      in.data = nullptr;
      in.recv = nullptr;
      g.changed.notify_all();
      g.wait(lock, rank_, {"rank ", next(), " to take this rank's message"},
             [&] { return out.state == Group::SlotState::empty; });
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

  void leave(const std::string& reason) noexcept override {
    try {
      std::lock_guard lock(group_->mutex);
      Group& g = *group_;
      g.departed[size_t(rank_)] = 1;
      if (g.first_departed < 0) {
        g.first_departed = rank_;
        g.departed_reason = reason;
      }
      g.changed.notify_all();
    } catch (...) {
      abort(reason);  // (the string copy could not be made: fail the group instead)
    }
  }

 private:
  int32_t next() const { return (rank_ + 1) % group_->size; }

  // The caller may free its buffers once we return: take our message back
  // unless the receiver has it already, and stop receiving, waiting out a
  // copy from or into our buffers that is running (it ends by itself).
  void withdraw(std::unique_lock<std::mutex>& lock, const Exchange& x) {
    Group& g = *group_;
    Group::Slot& in = g.inbox[size_t(rank_)];
    Group::Slot& out = g.inbox[size_t(next())];
    g.changed.wait(lock, [&] {
      return out.state != Group::SlotState::copying && in.state != Group::SlotState::copying;
    });
    if (out.data == x.send &&
        (out.state == Group::SlotState::posted || out.state == Group::SlotState::delivered)) {
      out.state = Group::SlotState::empty;
      out.data = nullptr;
    }
    if (in.recv == x.recv) in.recv = nullptr;
    g.changed.notify_all();
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
