// Exchanges run as ncclSend/ncclRecv pairs on a communication stream of the
// transport's own. start() makes that stream wait for what the compute
// stream has enqueued so far (the buffer to send is written, the buffer to
// receive into is no longer read); finish() makes the compute stream wait
// for the exchange. Nothing waits on the host for an exchange to complete
// (a non-blocking communicator's calls are waited for until enqueued), so
// a ring execution stays stream-ordered. Errors: every NCCL call's result,
// and the communicator's asynchronous error (ncclCommGetAsyncError, which
// does not block), become COMMUNICATION_ERROR with NCCL's own description.
#include "ring/nccl_transport.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "cuda/cuda_util.hpp"

namespace attn::ring {
namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  fail(ATTN_STATUS_BACKEND_ERROR, "ring (NCCL transport): ", what, ": ", cudaGetErrorName(e), " (",
       cudaGetErrorString(e), ")");
}

void check_nccl(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  fail(ATTN_STATUS_COMMUNICATION_ERROR, "ring (NCCL transport): ", what, ": ",
       ncclGetErrorString(r));
}

// A non-blocking communicator (ncclConfig_t::blocking = 0) may answer a
// call with ncclInProgress: the operation is being enqueued, and the
// communicator's asynchronous state says when that is done (NCCL's
// documented pattern: poll ncclCommGetAsyncError until it leaves
// ncclInProgress). Blocking communicators never return it.
ncclResult_t settled(ncclComm_t comm, ncclResult_t r) {
  while (r == ncclInProgress) {
    std::this_thread::yield();
    const ncclResult_t q = ncclCommGetAsyncError(comm, &r);
    if (q != ncclSuccess) return q;
  }
  return r;
}

// A query of a communicator whose non-blocking initialisation may still
// be running: asked again once that has settled.
template <class Query>
void query_settled(ncclComm_t comm, Query query, const char* what) {
  ncclResult_t r = query();
  if (r == ncclInProgress) {
    check_nccl(settled(comm, r), what);
    r = query();
  }
  check_nccl(r, what);
}

class NcclTransport final : public Transport {
 public:
  explicit NcclTransport(ncclComm_t comm) : comm_(comm) {
    query_settled(comm_, [&] { return ncclCommUserRank(comm_, &rank_); }, "ncclCommUserRank");
    query_settled(comm_, [&] { return ncclCommCount(comm_, &size_); }, "ncclCommCount");
    query_settled(comm_, [&] { return ncclCommCuDevice(comm_, &device_); }, "ncclCommCuDevice");
    cuda::DeviceScope scope(device_, "ring (CUDA)");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    if (cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&done_, cudaEventDisableTiming) != cudaSuccess) {
      release();
      check_cuda(cudaGetLastError(), "cudaEventCreate");
      fail(ATTN_STATUS_BACKEND_ERROR, "ring (NCCL transport): cudaEventCreate failed");
    }
    // agree()'s all-gather buffer: every rank's fingerprint, then this rank's.
    const cudaError_t e = cudaMalloc(&fingerprints_, sizeof(uint64_t) * (size_t(size_) + 1));
    if (e != cudaSuccess) {
      fingerprints_ = nullptr;
      release();
      check_cuda(e, "cudaMalloc (fingerprints)");
    }
  }
  ~NcclTransport() override { release(); }
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  const char* name() const override { return "nccl"; }
  attn_backend_t backend() const override { return ATTN_BACKEND_CUDA; }
  int32_t device() const override { return device_; }

  // Plan creation may block: all-gather the fingerprints and compare. The
  // all-gather is joined on every call (a rank that skipped it would leave
  // its peers waiting): an aborted communicator sends the failure mark and
  // throws after it, and the buffer exists since construction.
  void agree(uint64_t fingerprint) override {
    std::exception_ptr unusable;
    try {
      check_usable();
    } catch (...) {
      unusable = std::current_exception();
      fingerprint = kRingPlanFailed;
    }
    cuda::DeviceScope scope(device_, "ring (CUDA)");
    const size_t n = size_t(size_);
    uint64_t* const buf = fingerprints_;
    std::vector<uint64_t> all(n);
    check_cuda(cudaMemcpyAsync(buf + n, &fingerprint, sizeof fingerprint, cudaMemcpyHostToDevice,
                               stream_),
               "cudaMemcpyAsync");
    check_nccl(settled(comm_, ncclAllGather(buf + n, buf, 1, ncclUint64, comm_, stream_)),
               "ncclAllGather");
    check_cuda(cudaMemcpyAsync(all.data(), buf, sizeof(uint64_t) * n, cudaMemcpyDeviceToHost,
                               stream_),
               "cudaMemcpyAsync");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    if (unusable) std::rethrow_exception(unusable);
    if (fingerprint == kRingPlanFailed) return;  // the caller reports its own error
    for (size_t r = 0; r < n; ++r)
      if (all[r] == kRingPlanFailed)
        fail(ATTN_STATUS_COMMUNICATION_ERROR, "ring (NCCL rank ", rank_, " of ", size_, "): rank ",
             r, " failed to create its ring plan (its own status says why)");
    for (size_t r = 0; r < n; ++r)
      if (all[r] != fingerprint)
        fail(ATTN_STATUS_COMMUNICATION_ERROR, "ring (NCCL rank ", rank_, " of ", size_, "): rank ",
             r, " created its ring plan from another descriptor, layout or rank count, ",
             "or with another ATTN_RING_DKV_HOME (plans differ between ranks)");
  }

  void check_usable() override {
    if (aborted_.load()) {
      std::lock_guard lock(mutex_);
      fail(ATTN_STATUS_COMMUNICATION_ERROR, "ring (NCCL rank ", rank_, " of ", size_,
           "): the communicator was aborted: ", reason_);
    }
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
    if (async != ncclSuccess && async != ncclInProgress)
      check_nccl(async, "the communicator reports an asynchronous error");
  }

  void start(const Exchange& x, void* stream) override {
    check_usable();
    cuda::DeviceScope scope(device_, "ring (CUDA)");
    auto compute = static_cast<cudaStream_t>(stream);
    check_cuda(cudaEventRecord(ready_, compute), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    ncclResult_t s = ncclSend(x.send, x.bytes, ncclUint8, next, comm_, stream_);
    ncclResult_t r = ncclRecv(x.recv, x.bytes, ncclUint8, prev, comm_, stream_);
    ncclResult_t e = settled(comm_, ncclGroupEnd());  // always close the group, then report
    // (Inside a group a non-blocking communicator may answer ncclInProgress;
    // the group's end settles it.)
    if (s != ncclInProgress) check_nccl(s, "ncclSend");
    if (r != ncclInProgress) check_nccl(r, "ncclRecv");
    check_nccl(e, "ncclGroupEnd");
  }

  void finish(const Exchange&, void* stream) override {
    cuda::DeviceScope scope(device_, "ring (CUDA)");
    check_cuda(cudaEventRecord(done_, stream_), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), done_, 0),
               "cudaStreamWaitEvent");
    check_usable();
  }

  // Enqueued NCCL operations cannot be withdrawn: the buffers stay in use
  // until they complete or the application aborts the NCCL communicator. So
  // that the caller's later work on its stream (reusing or freeing the
  // workspace) does not race with them, and a captured graph's fork of the
  // communication stream is joined, the caller's stream waits for them.
  void cancel(const Exchange&, void* stream) noexcept override {
    int prev = 0;
    const bool switched = cudaGetDevice(&prev) == cudaSuccess && prev != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    if (cudaEventRecord(done_, stream_) != cudaSuccess ||
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), done_, 0) != cudaSuccess)
      (void)cudaGetLastError();  // nothing more a noexcept path can do
    if (switched) (void)cudaSetDevice(prev);
  }

  // Peers learn of it only through NCCL (its timeouts, or ncclCommAbort by
  // the application): this rank stops taking part.
  void abort(const std::string& reason) noexcept override {
    try {
      std::lock_guard lock(mutex_);
      if (!aborted_.load()) reason_ = reason;
    } catch (...) {
      // keep the flag even without the reason
    }
    aborted_.store(true);
  }

 private:
  void release() noexcept {
    int prev = 0;
    const bool switched = cudaGetDevice(&prev) == cudaSuccess && prev != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    if (fingerprints_) (void)cudaFree(fingerprints_);
    fingerprints_ = nullptr;
    if (done_) (void)cudaEventDestroy(done_);
    if (ready_) (void)cudaEventDestroy(ready_);
    if (stream_) (void)cudaStreamDestroy(stream_);
    done_ = ready_ = nullptr;
    stream_ = nullptr;
    if (switched) (void)cudaSetDevice(prev);
  }

  ncclComm_t comm_;
  int rank_ = 0, size_ = 1, device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  uint64_t* fingerprints_ = nullptr;
  std::atomic<bool> aborted_{false};
  std::mutex mutex_;
  std::string reason_;
};

}  // namespace

std::shared_ptr<Transport> make_nccl_transport(void* nccl_comm) {
  return std::make_shared<NcclTransport>(static_cast<ncclComm_t>(nccl_comm));
}

}  // namespace attn::ring
