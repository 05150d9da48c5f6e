#pragma once
// Options and tuning hooks read from the environment at plan creation.
// Unset or empty: the default. Any value that does not parse is an invalid
// argument naming the variable and the value, so that a typo never leaves
// an option silently at its default (atoi would read "yes" as 0).
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>

#include "core/error.hpp"

namespace attn {

// "0": off, "1": on.
inline bool env_flag(const char* name, bool default_value) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return default_value;
  if (std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") == 0) return true;
  invalid_argument(name, " must be 0 or 1, got \"", v, "\"");
}

// A decimal integer in [lo, hi]; nothing when unset or empty.
inline std::optional<int> env_int(const char* name, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v, &end, 10);
  // strtol would also take leading blanks and '+'.
  const bool digits_first = (v[0] >= '0' && v[0] <= '9') || v[0] == '-';
  if (!digits_first || end == v || *end != '\0' || errno == ERANGE || n < lo || n > hi)
    invalid_argument(name, " must be an integer from ", lo, " to ", hi, ", got \"", v, "\"");
  return int(n);
}

// One of `choices`, written as a decimal integer; nothing when unset or
// empty. Anything else names the choices, not a range that would suggest
// the values between them.
inline std::optional<int> env_int_choice(const char* name, std::initializer_list<int> choices) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == '\0') return std::nullopt;
  for (const int c : choices)
    if (std::to_string(c) == v) return c;
  std::string list;
  size_t i = 0;
  for (const int c : choices) {
    list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + std::to_string(c);
    ++i;
  }
  invalid_argument(name, " must be ", list, ", got \"", v, "\"");
}

}  // namespace attn
