// The pattern every C entry point follows: run the body, turn what it throws
// into a status and the thread-local message; and the handle life cycle.
#pragma once

#include <attn/attn.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "api/handles.hpp"
#include "core/error.hpp"

namespace attn {

// Runs body; converts what it throws. Always resets the last-error message.
template <class Body>
attn_status_t guarded(Body&& body) noexcept {
  clear_last_error();
  try {
    body();
    return ATTN_STATUS_SUCCESS;
  } catch (const Error& e) {
    set_last_error(e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error("out of host memory");
    return ATTN_STATUS_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    std::string msg = std::string("internal error: ") + e.what();
    set_last_error(msg.c_str());
    return ATTN_STATUS_INTERNAL_ERROR;
  } catch (...) {
    set_last_error("internal error: unknown exception");
    return ATTN_STATUS_INTERNAL_ERROR;
  }
}

template <class T>
void require_out(T* p, const char* arg) {
  if (p == nullptr) invalid_argument(arg, " is NULL");
}

// Allocates a handle, registers it, and hands it out only when both worked.
template <class T>
void create_handle(T** out) {
  auto h = std::make_unique<T>();
  register_handle(h.get(), kind_of<T>());
  *out = h.release();
}

// Size-tagged output structs (attn.h): the caller's struct_size says how
// much of the library's struct its own version holds.

// Rejects an `info` whose struct_size does not reach min_size (the end of
// the fields every version has); type_name is the struct's C name.
template <class Info>
void require_struct_size(const Info* info, size_t min_size, const char* type_name) {
  if (info->struct_size < min_size)
    invalid_argument("info->struct_size (", info->struct_size, ") is too small: set it to sizeof(",
                     type_name, ")");
}

// Copies the first out->struct_size bytes of full into *out, keeping the
// caller's struct_size.
template <class Info>
void copy_sized_prefix(const Info& full, Info* out) {
  const uint64_t caller_size = out->struct_size;
  std::memcpy(out, &full, std::min<size_t>(size_t(caller_size), sizeof full));
  out->struct_size = caller_size;
}

template <class T>
void destroy_handle(T* h, const char* arg) {
  if (h == nullptr) return;
  if (!unregister_handle(h, kind_of<T>()))
    fail(ATTN_STATUS_INVALID_HANDLE, arg, " is not a live ", kind_name(kind_of<T>()),
         " (destroyed twice, or a handle of another kind)");
  delete h;
}

}  // namespace attn
