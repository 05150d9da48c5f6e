// Errors inside the library: an exception type that carries a public status
// and a message, thrown anywhere below the C boundary and turned into a
// status (plus the thread-local last-error message) by src/api.
#pragma once

#include <attn/attn.h>

#include <exception>
#include <sstream>
#include <string>
#include <utility>

namespace attn {

class Error : public std::exception {
 public:
  Error(attn_status_t status, std::string message)
      : status_(status), message_(std::move(message)) {}
  attn_status_t status() const noexcept { return status_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  attn_status_t status_;
  std::string message_;
};

// Concatenates its arguments with operator<< into the message.
template <class... Parts>
[[noreturn]] void fail(attn_status_t status, const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  throw Error(status, out.str());
}

template <class... Parts>
[[noreturn]] void invalid_argument(const Parts&... parts) {
  fail(ATTN_STATUS_INVALID_ARGUMENT, parts...);
}

template <class... Parts>
[[noreturn]] void not_supported(const Parts&... parts) {
  fail(ATTN_STATUS_NOT_SUPPORTED, parts...);
}

// Thread-local message of the last failed call (see attn_last_error_message).
void set_last_error(const char* message) noexcept;
void clear_last_error() noexcept;
const char* last_error() noexcept;

}  // namespace attn
