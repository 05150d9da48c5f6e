#include "core/error.hpp"

#include <cstring>

namespace attn {
namespace {
// Fixed-size so that recording an error can never itself fail (no allocation).
constexpr size_t kMessageCapacity = 1024;
thread_local char t_last_error[kMessageCapacity] = {0};
}  // namespace

void set_last_error(const char* message) noexcept {
  if (message == nullptr) message = "";
  size_t n = std::strlen(message);
  if (n >= kMessageCapacity) n = kMessageCapacity - 1;
  std::memcpy(t_last_error, message, n);
  t_last_error[n] = '\0';
}

void clear_last_error() noexcept { t_last_error[0] = '\0'; }

const char* last_error() noexcept { return t_last_error; }

}  // namespace attn
