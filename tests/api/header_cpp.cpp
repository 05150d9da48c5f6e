// Compiles attn.h as C++ (c++11 and c++20, -Wall -Wextra -Werror -pedantic,
// set by tests/api/meson.build): extern "C" linkage, no C-only constructs,
// usable types; then links and runs against the library.
#include <attn/attn.h>
#include <attn/attn.h>  // the include guard works

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <type_traits>

static_assert(ATTN_VERSION_NUMBER ==
                  ATTN_VERSION_MAJOR * 10000 + ATTN_VERSION_MINOR * 100 + ATTN_VERSION_PATCH,
              "version macros");
static_assert(std::is_standard_layout<attn_plan_info_t>::value, "plain C struct");
static_assert(std::is_trivially_copyable<attn_plan_info_t>::value, "plain C struct");
static_assert(offsetof(attn_plan_info_t, struct_size) == 0, "size tag first");
static_assert(std::is_pointer<attn_context_t>::value && std::is_pointer<attn_plan_t>::value,
              "handles are pointers");
static_assert(std::is_same<decltype(&attn_forward),
                           attn_status_t (*)(attn_plan_t, const void*, const void*, const void*,
                                             void*, float*, void*, std::size_t, void*)>::value,
              "attn_forward prototype");
static_assert(std::is_same<decltype(attn_version_number()), uint32_t>::value, "version type");

namespace {
// Overloading on the handle types works: they are distinct types in C++.
int kind(attn_context_t) { return 1; }
int kind(attn_plan_t) { return 2; }
}  // namespace

int main() {
  attn_context_t ctx = nullptr;
  if (attn_context_create(ATTN_BACKEND_CPU, 0, 1, &ctx) != ATTN_STATUS_SUCCESS) return 1;
  attn_plan_t plan = nullptr;
  if (kind(ctx) != 1 || kind(plan) != 2) return 1;
  attn_backend_t backend = ATTN_BACKEND_AUTO;
  if (attn_context_get_backend(ctx, &backend) != ATTN_STATUS_SUCCESS) return 1;
  if (attn_context_destroy(ctx) != ATTN_STATUS_SUCCESS) return 1;
  if (attn_version_number() != ATTN_VERSION_NUMBER) return 1;
  if (std::strcmp(attn_status_string(ATTN_STATUS_INTERNAL_ERROR), "ATTN_STATUS_INTERNAL_ERROR") != 0)
    return 1;
  std::printf("attn.h OK as C++ (__cplusplus %ld), library %s, backend %d\n",
              static_cast<long>(__cplusplus), attn_version_string(), static_cast<int>(backend));
  return 0;
}
