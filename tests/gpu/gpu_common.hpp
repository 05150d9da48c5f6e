// Helpers shared by the GPU tests and the GPU timing programs: fp16/bf16
// conversion on the host, CUDA error checks, device buffers, the test
// cases' strided tensors, lengths and plans, and the timing programs'
// shapes, inputs and event timer.
#pragma once

#include <attn/attn.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace gpu_test {

inline uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bitsf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf16(float f) {
  uint32_t u = fbits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float from_bf16(uint16_t h) { return bitsf(uint32_t(h) << 16); }

inline uint16_t to_fp16(float f) {
  const uint32_t x = fbits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t e8 = int32_t((x >> 23) & 0xffu);
  uint32_t man = x & 0x7fffffu;
  if (e8 == 0xff) return uint16_t(sign | 0x7c00u | (man ? 0x200u : 0u));
  const int32_t e = e8 - 127 + 15;
  if (e >= 31) return uint16_t(sign | 0x7c00u);
  if (e <= 0) {  // subnormal result: units of 2^-24
    if (e < -10) return uint16_t(sign);
    man |= 0x800000u;
    const int shift = 14 - e;
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = (uint32_t(e) << 10) | (man >> 13);
  const uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may round up to inf
  return uint16_t(sign | h);
}
inline float from_fp16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (e == 0x1f) return bitsf(sign | 0x7f800000u | (man << 13));
  if (e == 0) {
    const float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bitsf(sign | ((e + 112u) << 23) | (man << 13));
}

inline uint16_t to_half(attn_dtype_t t, float f) {
  return t == ATTN_DTYPE_BF16 ? to_bf16(f) : to_fp16(f);
}
inline float from_half(attn_dtype_t t, uint16_t h) {
  return t == ATTN_DTYPE_BF16 ? from_bf16(h) : from_fp16(h);
}
inline float round_half(attn_dtype_t t, float f) { return from_half(t, to_half(t, f)); }
// A quiet-NaN pattern used to poison outputs; never produced by the kernel.
inline uint16_t poison_half(attn_dtype_t t) { return t == ATTN_DTYPE_BF16 ? 0x7fa5u : 0x7e5au; }

#define GPU_CHECK(call)                                                                       \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

#define ATTN_CHECK(call)                                                                    \
  do {                                                                                      \
    attn_status_t s_ = (call);                                                              \
    if (s_ != ATTN_STATUS_SUCCESS) {                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call,                 \
                   attn_status_string(s_), attn_last_error_message());                      \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

// Exit code 77 (meson: skipped) without a usable CUDA device (none, or
// device 0 older than sm_80, which the CUDA backend does not run). With
// one, a CUDA context the library cannot create is a failure (exit 1), not
// a skip: a regression there must not turn the GPU suite into skips.
inline void skip_without_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIP: no CUDA device\n");
    std::exit(77);
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess &&
      major < 8) {
    std::printf("SKIP: device 0 is sm_%d0, the CUDA backend needs sm_80 or newer\n", major);
    std::exit(77);
  }
  attn_context_t ctx = nullptr;
  if (attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx) != ATTN_STATUS_SUCCESS) {
    std::printf("FAIL: %d CUDA device(s), but no CUDA context: %s\n", n,
                attn_last_error_message());
    std::exit(1);
  }
  attn_context_destroy(ctx);
}

// A device allocation of `bytes` (at least 16 allocated, so that a size of
// 0 still gives a valid pointer), copied whole to and from the host.
struct DeviceBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuf(size_t n) : bytes(n) { GPU_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16))); }
  ~DeviceBuf() { cudaFree(p); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
  void upload(const void* h) { GPU_CHECK(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice)); }
  void download(void* h) const { GPU_CHECK(cudaMemcpy(h, p, bytes, cudaMemcpyDeviceToHost)); }
};

// ---- Test cases (test_flash_fwd, test_flash_bwd) -----------------------------

// What a test case is made of; each test derives its Case with its own checks.
struct CaseShape {
  std::string name;
  attn_dtype_t dtype = ATTN_DTYPE_BF16;
  int64_t batch = 1, hq = 1, hkv = 1, lq = 0, lk = 0, d = 128;
  attn_mask_t mask = ATTN_MASK_NONE;
  int64_t wl = -1, wr = -1;
  float softcap = 0.0f;
  float scale = 0.0f;  // 0: the default 1/sqrt(d)
  attn_layout_t layout = ATTN_LAYOUT_BSHD;
  bool padded = false;                 // non-default strides (gaps between heads, rows, batches)
  std::vector<int32_t> seq_q, seq_kv;  // varlen lengths; empty: fixed length
  bool allow_empty = false;
  int sample = 0;     // 0: check everything against fp64; else about this many rows per (b, h)
  float qmul = 1.0f;  // Q scale: > 1 gives peakier softmax rows
  bool big = false;   // left out in quick mode
};

inline bool varlen(const CaseShape& c) { return !c.seq_q.empty(); }

// Strides of one tensor (elements) and where (b, s, h) lives.
struct Tensor {
  int32_t ndim = 0;
  int64_t dims[4] = {0, 0, 0, 0}, strides[4] = {0, 0, 0, 0};
  int64_t sb = 0, ss = 0, sh = 0;  // batch, seq, head strides
  size_t elems = 0;                // buffer size
};

// Q, O, dO, dQ share the query-side strides; K, V, dK, dV the key side.
inline Tensor make_tensor(const CaseShape& c, bool q_side, const std::vector<int64_t>& cu) {
  Tensor t;
  const int64_t heads = q_side ? c.hq : c.hkv, seq = q_side ? c.lq : c.lk, d = c.d;
  const int64_t pad = c.padded ? 8 : 0;
  if (varlen(c)) {
    t.ndim = 3;
    t.sh = d + pad;
    t.ss = heads * t.sh + pad;
    t.dims[0] = cu.back(), t.dims[1] = heads, t.dims[2] = d;
    t.strides[0] = t.ss, t.strides[1] = t.sh, t.strides[2] = 1;
  } else if (c.layout == ATTN_LAYOUT_BSHD) {
    t.ndim = 4;
    t.sh = d + pad;
    t.ss = heads * t.sh + 2 * pad;
    t.sb = seq * t.ss + 3 * pad;
    t.dims[0] = c.batch, t.dims[1] = seq, t.dims[2] = heads, t.dims[3] = d;
    t.strides[0] = t.sb, t.strides[1] = t.ss, t.strides[2] = t.sh, t.strides[3] = 1;
  } else {
    t.ndim = 4;
    t.ss = d + pad;
    t.sh = seq * t.ss + 2 * pad;
    t.sb = heads * t.sh + 3 * pad;
    t.dims[0] = c.batch, t.dims[1] = heads, t.dims[2] = seq, t.dims[3] = d;
    t.strides[0] = t.sb, t.strides[1] = t.sh, t.strides[2] = t.ss, t.strides[3] = 1;
  }
  int64_t last = 0;
  bool empty = false;
  for (int i = 0; i < t.ndim; ++i) {
    if (t.dims[i] == 0) empty = true;
    last += (t.dims[i] - 1) * t.strides[i];
  }
  t.elems = empty ? 8 : size_t(last + 1 + pad);
  return t;
}

// A case with its sequence offsets and tensor strides resolved (varlen:
// batch, lq and lk become the count and the longest lengths).
template <class C>
struct CaseProblem {
  C c;
  std::vector<int64_t> cu_q, cu_kv;
  Tensor tq, tk;
  float scale = 0.0f;
  int64_t group() const { return c.hq / c.hkv; }
  int64_t lq(int64_t b) const { return cu_q[b + 1] - cu_q[b]; }
  int64_t lk(int64_t b) const { return cu_kv[b + 1] - cu_kv[b]; }
  int64_t off_q(int64_t b, int64_t s, int64_t h) const {
    return (varlen(c) ? cu_q[b] * tq.ss : b * tq.sb) + s * tq.ss + h * tq.sh;
  }
  int64_t off_k(int64_t b, int64_t s, int64_t h) const {
    return (varlen(c) ? cu_kv[b] * tk.ss : b * tk.sb) + s * tk.ss + h * tk.sh;
  }
  int64_t lse_elems() const { return varlen(c) ? c.hq * cu_q.back() : c.batch * c.hq * c.lq; }
  int64_t lse_off(int64_t b, int64_t h, int64_t s) const {
    return varlen(c) ? h * cu_q.back() + cu_q[b] + s : (b * c.hq + h) * c.lq + s;
  }
  // Visible keys of row i of sequence b (lo > hi: none).
  void bounds(int64_t b, int64_t i, int64_t& lo, int64_t& hi) const {
    const int64_t off = lk(b) - lq(b);
    int64_t wl = c.wl, wr = c.wr;
    if (c.mask == ATTN_MASK_NONE) wl = wr = -1;
    if (c.mask == ATTN_MASK_CAUSAL) wl = -1, wr = 0;
    lo = wl < 0 ? 0 : std::max<int64_t>(0, i + off - wl);
    hi = wr < 0 ? lk(b) - 1 : std::min<int64_t>(lk(b) - 1, i + off + wr);
  }
};

template <class C>
CaseProblem<C> make_problem(const C& c) {
  CaseProblem<C> p;
  p.c = c;
  if (varlen(c)) {
    p.c.batch = int64_t(c.seq_q.size());
    p.cu_q.push_back(0), p.cu_kv.push_back(0);
    int64_t mq = 0, mk = 0;
    for (size_t b = 0; b < c.seq_q.size(); ++b) {
      p.cu_q.push_back(p.cu_q.back() + c.seq_q[b]);
      p.cu_kv.push_back(p.cu_kv.back() + c.seq_kv[b]);
      mq = std::max<int64_t>(mq, c.seq_q[b]);
      mk = std::max<int64_t>(mk, c.seq_kv[b]);
    }
    p.c.lq = mq, p.c.lk = mk;
  } else {
    for (int64_t b = 0; b <= c.batch; ++b) {
      p.cu_q.push_back(b * c.lq);
      p.cu_kv.push_back(b * c.lk);
    }
  }
  p.tq = make_tensor(p.c, true, p.cu_q);
  p.tk = make_tensor(p.c, false, p.cu_kv);
  p.scale = c.scale > 0.0f ? c.scale : float(1.0 / std::sqrt(double(c.d)));
  return p;
}

// The plan descriptor of a case: shape, dtype, layout, mask, softcap, scale,
// varlen offsets, empty rows and, when padded, the strides of the tensor
// roles below `roles` (ATTN_TENSOR_O + 1 for the forward, all 8 for the
// backward). The caller adds what else its test needs, then plan_or_exit().
template <class C>
attn_plan_desc_t case_plan_desc(const CaseProblem<C>& p, int roles) {
  const C& c = p.c;
  attn_plan_desc_t pd = nullptr;
  ATTN_CHECK(attn_plan_desc_create(&pd));
  ATTN_CHECK(attn_plan_desc_set_shape(pd, c.batch, c.hq, c.hkv, c.lq, c.lk, c.d, c.d));
  ATTN_CHECK(attn_plan_desc_set_dtype(pd, c.dtype));
  if (!varlen(c)) ATTN_CHECK(attn_plan_desc_set_layout(pd, c.layout));
  ATTN_CHECK(attn_plan_desc_set_mask(pd, c.mask, c.mask == ATTN_MASK_WINDOW ? c.wl : -1,
                                     c.mask == ATTN_MASK_WINDOW ? c.wr : -1));
  if (c.softcap > 0.0f) ATTN_CHECK(attn_plan_desc_set_softcap(pd, c.softcap));
  if (c.scale > 0.0f) ATTN_CHECK(attn_plan_desc_set_softmax_scale(pd, c.scale));
  if (varlen(c)) {
    std::vector<int32_t> q(p.cu_q.begin(), p.cu_q.end()), kv(p.cu_kv.begin(), p.cu_kv.end());
    ATTN_CHECK(attn_plan_desc_set_varlen(pd, c.batch, q.data(), kv.data()));
  }
  if (c.allow_empty) ATTN_CHECK(attn_plan_desc_set_allow_empty_rows(pd, 1));
  if (c.padded) {
    attn_tensor_desc_t td = nullptr;
    ATTN_CHECK(attn_tensor_desc_create(&td));
    for (int r = 0; r < roles; ++r) {
      const auto role = attn_tensor_role_t(r);
      const bool q_side = role == ATTN_TENSOR_Q || role == ATTN_TENSOR_O ||
                          role == ATTN_TENSOR_DO || role == ATTN_TENSOR_DQ;
      const Tensor& t = q_side ? p.tq : p.tk;
      ATTN_CHECK(attn_tensor_desc_set(td, c.dtype, t.ndim, t.dims, t.strides));
      ATTN_CHECK(attn_plan_desc_set_tensor(pd, role, td));
    }
    attn_tensor_desc_destroy(td);
  }
  return pd;
}

// Creates the plan and destroys pd. With `status`, the status is stored
// there (and attn_plan_create's message in `message`, if given) and a
// failure returns null; without it, a failure ends the program. (The message
// is taken before attn_plan_desc_destroy, which resets it.)
inline attn_plan_t plan_or_exit(attn_context_t ctx, attn_plan_desc_t pd, const std::string& name,
                                attn_status_t* status = nullptr, std::string* message = nullptr) {
  attn_plan_t plan = nullptr;
  const attn_status_t s = attn_plan_create(ctx, pd, &plan);
  const std::string msg = attn_last_error_message();
  attn_plan_desc_destroy(pd);
  if (status != nullptr) {
    *status = s;
    if (message != nullptr) *message = msg;
    return plan;
  }
  if (s != ATTN_STATUS_SUCCESS) {
    std::fprintf(stderr, "plan for %s: %s: %s\n", name.c_str(), attn_status_string(s), msg.c_str());
    std::exit(1);
  }
  return plan;
}

// ---- Timing (time_flash_fwd, time_flash_bwd) -----------------------------------

// bf16, batch * seqlen = kTimingTokens, heads = kTimingWidth / d.
constexpr int64_t kTimingTokens = 16384, kTimingWidth = 2048;

struct TimingShape {
  int64_t d, l;
  bool causal;
  int64_t batch() const { return std::max<int64_t>(1, kTimingTokens / l); }
  int64_t heads() const { return kTimingWidth / d; }
};

// The default shapes (d 64 and 128, L 2K and 8K, full and causal, and d 128
// L 16K causal) unless only_args, then one per "d,L,causal" argument.
inline std::vector<TimingShape> timing_shapes(int argc, char** argv, bool only_args) {
  std::vector<TimingShape> shapes;
  if (!only_args) {
    for (int64_t d : {64, 128})
      for (int64_t l : {2048, 8192})
        for (bool causal : {false, true}) shapes.push_back({d, l, causal});
    shapes.push_back({128, 16384, true});
  }
  for (int i = 1; i < argc; ++i) {
    TimingShape c{};
    int causal = 0;
    if (std::sscanf(argv[i], "%" SCNd64 ",%" SCNd64 ",%d", &c.d, &c.l, &causal) == 3) {
      c.causal = causal != 0;
      shapes.push_back(c);
    }
  }
  return shapes;
}

// Timed runs per measurement: ATTN_TIME_REPS (at least 3), default 20.
inline int timing_reps() {
  const char* env = std::getenv("ATTN_TIME_REPS");
  return env ? std::max(3, std::atoi(env)) : 20;
}

// Device tensors of kTimingTokens x kTimingWidth bf16 (64 MiB each, more
// than L2): Q, K, V, dO random in [-2, 2), the outputs unset; LSE for up to
// 64 heads.
struct TimingTensors {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *d_o = nullptr, *dq = nullptr,
       *dk = nullptr, *dv = nullptr;
  float* lse = nullptr;
  explicit TimingTensors(bool backward) {
    const size_t elems = size_t(kTimingTokens * kTimingWidth);
    for (void** p : {&q, &k, &v, &o}) GPU_CHECK(cudaMalloc(p, elems * 2));
    if (backward)
      for (void** p : {&d_o, &dq, &dk, &dv}) GPU_CHECK(cudaMalloc(p, elems * 2));
    GPU_CHECK(cudaMalloc(reinterpret_cast<void**>(&lse), size_t(kTimingTokens) * 64 * 4));
    std::vector<uint16_t> host(elems);
    std::mt19937_64 rng(12345);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (void* p : {q, k, v, d_o}) {
      if (p == nullptr) continue;
      for (auto& x : host) x = to_bf16(u(rng));
      GPU_CHECK(cudaMemcpy(p, host.data(), elems * 2, cudaMemcpyHostToDevice));
    }
  }
  ~TimingTensors() {
    for (void* p : {q, k, v, o, d_o, dq, dk, dv}) cudaFree(p);
    cudaFree(lse);
  }
  TimingTensors(const TimingTensors&) = delete;
  TimingTensors& operator=(const TimingTensors&) = delete;
};

// A dense bf16 BSHD plan of a timing shape on ctx (CUDA).
inline attn_plan_t timing_plan(attn_context_t ctx, const TimingShape& c, bool backward,
                               bool deterministic) {
  attn_plan_desc_t pd;
  ATTN_CHECK(attn_plan_desc_create(&pd));
  ATTN_CHECK(attn_plan_desc_set_shape(pd, c.batch(), c.heads(), c.heads(), c.l, c.l, c.d, c.d));
  ATTN_CHECK(attn_plan_desc_set_dtype(pd, ATTN_DTYPE_BF16));
  ATTN_CHECK(attn_plan_desc_set_mask(pd, c.causal ? ATTN_MASK_CAUSAL : ATTN_MASK_NONE, -1, -1));
  // ATTN_TIME_SOFTCAP=cap times the kernels' softcap instantiations.
  if (const char* cap = std::getenv("ATTN_TIME_SOFTCAP"))
    ATTN_CHECK(attn_plan_desc_set_softcap(pd, float(std::atof(cap))));
  if (backward) {
    ATTN_CHECK(attn_plan_desc_set_passes(pd, ATTN_PASSES_FORWARD_BACKWARD));
    ATTN_CHECK(attn_plan_desc_set_deterministic(pd, deterministic ? 1 : 0));
  }
  attn_plan_t plan;
  ATTN_CHECK(attn_plan_create(ctx, pd, &plan));
  attn_plan_desc_destroy(pd);
  return plan;
}

inline attn_plan_info_t describe(attn_plan_t plan) {
  attn_plan_info_t info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  ATTN_CHECK(attn_plan_describe(plan, &info));
  return info;
}

// CUDA events around each call on one non-blocking stream.
class EventTimer {
 public:
  EventTimer() {
    GPU_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    GPU_CHECK(cudaEventCreate(&e0_));
    GPU_CHECK(cudaEventCreate(&e1_));
  }
  ~EventTimer() {
    cudaEventDestroy(e0_);
    cudaEventDestroy(e1_);
    cudaStreamDestroy(stream_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  cudaStream_t stream() const { return stream_; }

  // Median and minimum milliseconds of f() (an attn_status_t call on
  // stream()) over reps runs after 3 warm-ups.
  template <class F>
  void time(F&& f, int reps, double* median_ms, double* min_ms = nullptr) {
    for (int i = 0; i < 3; ++i) ATTN_CHECK(f());
    std::vector<float> ms(static_cast<size_t>(reps));
    for (int i = 0; i < reps; ++i) {
      GPU_CHECK(cudaEventRecord(e0_, stream_));
      ATTN_CHECK(f());
      GPU_CHECK(cudaEventRecord(e1_, stream_));
      GPU_CHECK(cudaEventSynchronize(e1_));
      GPU_CHECK(cudaEventElapsedTime(&ms[size_t(i)], e0_, e1_));
    }
    GPU_CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    *median_ms = ms[ms.size() / 2];
    if (min_ms != nullptr) *min_ms = ms.front();
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t e0_ = nullptr, e1_ = nullptr;
};

}  // namespace gpu_test
