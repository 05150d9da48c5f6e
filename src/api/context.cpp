#include <algorithm>
#include <thread>

#include "attn_config.h"
#include "core/context.hpp"
#include "core/error.hpp"

#if ATTN_HAVE_OPENMP
#include <omp.h>
#endif
#if ATTN_HAVE_CUDA
#include "cuda/device.hpp"
#endif

namespace attn {

namespace {
// More threads than any machine runs one attention problem on. Each one
// has its own scratch in the workspaces, and an OpenMP runtime that cannot
// create a team exits the process (libgomp does), so a count such as
// INT32_MAX must not reach it.
constexpr int32_t kMaxThreads = 4096;

int32_t default_threads() {
#if ATTN_HAVE_OPENMP
  return std::clamp(omp_get_num_procs(), 1, kMaxThreads);
#else
  return 1;
#endif
}
}  // namespace

ContextConfig make_context_config(attn_backend_t backend, int32_t device, int32_t num_threads) {
  if (backend != ATTN_BACKEND_AUTO && backend != ATTN_BACKEND_CPU && backend != ATTN_BACKEND_CUDA)
    invalid_argument("backend: unknown value ", int(backend));
  if (num_threads < 0 || num_threads > kMaxThreads)
    invalid_argument("num_threads must be in 0..", kMaxThreads, " (0: one per core), got ",
                     num_threads);
  if (device < 0) invalid_argument("device must be >= 0, got ", device);
  ContextConfig cfg;
  cfg.device = device;
#if ATTN_HAVE_OPENMP
  cfg.num_threads = num_threads == 0 ? default_threads() : num_threads;
#else
  cfg.num_threads = 1;
#endif

  int32_t cuda_devices = 0;
#if ATTN_HAVE_CUDA
  cuda_devices = cuda::device_count();
#endif
  if (backend == ATTN_BACKEND_AUTO)
    backend = cuda_devices > device ? ATTN_BACKEND_CUDA : ATTN_BACKEND_CPU;

  if (backend == ATTN_BACKEND_CPU) {
    if (device != 0) invalid_argument("device must be 0 for the CPU backend, got ", device);
  } else {
#if !ATTN_HAVE_CUDA
    fail(ATTN_STATUS_BACKEND_UNAVAILABLE, "backend CUDA: this library was built without CUDA");
#else
    if (cuda_devices == 0)
      fail(ATTN_STATUS_BACKEND_UNAVAILABLE, "backend CUDA: no CUDA device is visible");
    if (device >= cuda_devices)
      invalid_argument("device ", device, " does not exist (", cuda_devices, " CUDA devices)");
#endif
  }
  cfg.backend = backend;
  return cfg;
}

}  // namespace attn
