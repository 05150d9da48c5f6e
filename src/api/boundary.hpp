// Helpers of the C boundary shared by the files of src/api: every public
// function runs its body through guarded(), which turns exceptions into a
// status and the thread-local message.
#pragma once

#include <attn/attn.h>

#include <exception>
#include <memory>
#include <new>
#include <string>

#include "api/handles.hpp"
#include "core/error.hpp"

namespace attn::api {

// Runs body; converts what it throws. Always resets the last-error message.
template <class Body>
attn_status_t guarded(Body&& body) noexcept {
  attn::clear_last_error();
  try {
    body();
    return ATTN_STATUS_SUCCESS;
  } catch (const attn::Error& e) {
    attn::set_last_error(e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    attn::set_last_error("out of host memory");
    return ATTN_STATUS_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    std::string msg = std::string("internal error: ") + e.what();
    attn::set_last_error(msg.c_str());
    return ATTN_STATUS_INTERNAL_ERROR;
  } catch (...) {
    attn::set_last_error("internal error: unknown exception");
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
  attn::register_handle(h.get(), attn::kind_of<T>());
  *out = h.release();
}

template <class T>
void destroy_handle(T* h, const char* arg) {
  if (h == nullptr) return;
  if (!attn::unregister_handle(h, attn::kind_of<T>()))
    attn::fail(ATTN_STATUS_INVALID_HANDLE, arg, " is not a live ",
               attn::kind_name(attn::kind_of<T>()), " (destroyed twice, or a handle of another kind)");
  delete h;
}

}  // namespace attn::api
