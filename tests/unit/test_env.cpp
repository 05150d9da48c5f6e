// The strict parsing of options and tuning hooks (core/env.hpp), host code
// only, so it runs in every build (the CUDA hooks that use it are otherwise
// tested only on a GPU):
//   - unset or empty: the default (env_flag) or nothing (env_int,
//     env_int_choice);
//   - the accepted spellings give their value;
//   - everything else (blanks, signs, other bases, trailing text, out of
//     range, overflow) throws INVALID_ARGUMENT whose message names the
//     variable and quotes the value;
//   - random integers in and out of range (seed printed; ATTN_TEST_SEED=n
//     repeats a run).
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "core/env.hpp"
#include "testutil.h"

namespace {

constexpr const char* kVar = "ATTN_TEST_ENV_VALUE";

int g_failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

// Sets kVar to `value` (nullptr: unsets it).
void set(const char* value) {
  if (value != nullptr)
    setenv(kVar, value, 1);
  else
    unsetenv(kVar);
}

// Runs `parse` with kVar = value; true when it throws INVALID_ARGUMENT
// naming kVar, quoting the value and containing `words`.
bool refused(const char* value, const std::function<void()>& parse, const char* words) {
  set(value);
  bool ok = false;
  std::string msg = "(not refused)";
  try {
    parse();
  } catch (const attn::Error& e) {
    msg = e.what();
    ok = e.status() == ATTN_STATUS_INVALID_ARGUMENT && msg.find(kVar) != std::string::npos &&
         msg.find(std::string("\"") + value + "\"") != std::string::npos &&
         msg.find(words) != std::string::npos;
  }
  set(nullptr);
  if (!ok) std::printf("     \"%s\": %s\n", value, msg.c_str());
  return ok;
}

}  // namespace

int main() {
  // env_flag
  for (const bool dflt : {false, true}) {
    set(nullptr);
    expect(attn::env_flag(kVar, dflt) == dflt, "env_flag: unset is the default");
    set("");
    expect(attn::env_flag(kVar, dflt) == dflt, "env_flag: empty is the default");
    set("0");
    expect(!attn::env_flag(kVar, dflt), "env_flag: \"0\" is off");
    set("1");
    expect(attn::env_flag(kVar, dflt), "env_flag: \"1\" is on");
  }
  for (const char* bad : {"yes", "no", "true", "2", "-1", "01", " 1", "1 ", "+1", "on"})
    expect(refused(bad, [] { attn::env_flag(kVar, true); }, "must be 0 or 1"),
           std::string("env_flag: \"") + bad + "\" refused");

  // env_int
  const auto in_1_100 = [] { return attn::env_int(kVar, 1, 100); };
  set(nullptr);
  expect(!in_1_100().has_value(), "env_int: unset is nothing");
  set("");
  expect(!in_1_100().has_value(), "env_int: empty is nothing");
  for (const auto& [text, value] : {std::pair<const char*, int>{"1", 1}, {"100", 100}, {"037", 37}}) {
    set(text);
    const std::optional<int> got = in_1_100();
    expect(got.has_value() && *got == value, std::string("env_int: \"") + text + "\" read");
  }
  set(nullptr);
  for (const char* bad : {"0", "101", "-1", "+5", " 5", "5 ", "5x", "0x10", "1.5", "1e2", "-",
                          "four", "99999999999999999999", "-99999999999999999999"})
    expect(refused(bad, [&] { in_1_100(); }, "must be an integer from 1 to 100"),
           std::string("env_int [1, 100]: \"") + bad + "\" refused");
  set("2147483647");
  expect(attn::env_int(kVar, 0, INT_MAX) == INT_MAX, "env_int: INT_MAX read");
  expect(refused("2147483648", [] { attn::env_int(kVar, 0, INT_MAX); }, "from 0 to 2147483647"),
         "env_int: INT_MAX + 1 refused");

  // env_int_choice
  const auto bm = [] { return attn::env_int_choice(kVar, {128, 192}); };
  set(nullptr);
  expect(!bm().has_value(), "env_int_choice: unset is nothing");
  set("");
  expect(!bm().has_value(), "env_int_choice: empty is nothing");
  for (const int v : {128, 192}) {
    set(std::to_string(v).c_str());
    expect(bm() == v, "env_int_choice: " + std::to_string(v) + " read");
  }
  set(nullptr);
  for (const char* bad : {"160", "129", "64", "abc", "0128", " 128", "128 ", "+192", "-128"})
    expect(refused(bad, [&] { bm(); }, "must be 128 or 192"),
           std::string("env_int_choice {128, 192}: \"") + bad + "\" refused");
  expect(refused("7", [] { attn::env_int_choice(kVar, {1, 2, 4}); }, "must be 1, 2 or 4"),
         "env_int_choice: three choices listed");

  // Random integers in and out of [lo, hi].
  std::mt19937_64 rng(tu_seed());  // ATTN_TEST_SEED repeats a run (printed)
  int random_failures = 0;
  for (int i = 0; i < 1000; ++i) {
    std::uniform_int_distribution<int> any(INT_MIN, INT_MAX);
    int lo = any(rng), hi = any(rng);
    if (lo > hi) std::swap(lo, hi);
    const long long n = std::uniform_int_distribution<long long>(
        (long long)lo - 1000, (long long)hi + 1000)(rng);
    const std::string text = std::to_string(n);
    set(text.c_str());
    bool ok;
    if (n >= lo && n <= hi) {
      ok = attn::env_int(kVar, lo, hi) == int(n);
    } else {
      ok = refused(text.c_str(), [&] { attn::env_int(kVar, lo, hi); }, "must be an integer");
    }
    set(nullptr);
    if (!ok) {
      std::printf("FAIL env_int [%d, %d]: \"%s\"\n", lo, hi, text.c_str());
      ++random_failures;
    }
  }
  expect(random_failures == 0, "env_int: 1000 random values in and out of range");

  std::printf("%d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
