// attn_bench_cuda: times one dense attention plan on libattn's CUDA backend
// with CUDA events.
//
//   attn_bench_cuda --batch 1 --heads-q 16 --seqlen 16384 --head-dim 128
//                   --dtype bf16 --mask causal --passes fwd,bwd
//
// Run with --help for every option. What it does:
//   - builds the plan through the public C API (any shape, dtype, layout,
//     mask, soft-cap, varlen or deterministic option the library accepts:
//     what it refuses is reported with attn_last_error_message());
//   - fills the inputs on the host with random non-zero values (magnitude in
//     [0.1, 1), either sign) and copies them to the device;
//   - allocates enough independent sets of tensors (Q, K, V, O, LSE, and for
//     the backward dO, dQ, dK, dV) that between two uses of one set the other
//     sets touch at least 3 x the device's L2 (cudaDevAttrL2CacheSize), and
//     rotates among them from one call to the next, so that no timed call
//     finds its tensors in a warm L2; --sets overrides the count;
//   - sizes one workspace from attn_plan_workspace_size (both passes);
//   - runs --warmup untimed calls, then --repeat timed calls, each between
//     its own pair of cudaEventRecord on a created non-blocking stream. The
//     calls are queued back to back (the host runs ahead), so the GPU stays
//     busy and the events time the GPU work of one call only;
//   - reports the median and minimum milliseconds and TFLOP/s from the
//     plan's own flop count (attn_plan_describe: flops_forward =
//     4 * visible pairs * d, flops_backward = 2.5 x that: only the (query,
//     key) pairs the mask lets through count);
//   - checks every CUDA call and every libattn status, and that the outputs
//     (O, LSE; dQ, dK, dV) of every set that ran hold no NaN or inf. The
//     outputs (and the workspace) are filled with NaN before the first call,
//     so an element a kernel failed to write is caught as well.
// The backward needs O and LSE of its own inputs: the forward is run once,
// untimed, on every set before the backward is timed.
//
// Output: human-readable lines, then machine-readable lines starting with
// "meta," (key, value) and "csv," (the first csv line names the columns).
// Exit status: 0 success, 1 a failure (CUDA or libattn error, NaN), 2 bad
// command line, 3 no usable CUDA device.
//
// Host code only: the C API and the CUDA runtime API, no kernels.

#include <attn/attn.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr const char* kProg = "attn_bench_cuda";
constexpr int kExitFail = 1, kExitUsage = 2, kExitNoDevice = 3;

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

[[noreturn]] void die(int code, const std::string& msg) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s: %s\n", kProg, msg.c_str());
  std::exit(code);
}

void cuda_check(cudaError_t e, const char* call, int line) {
  if (e == cudaSuccess) return;
  std::fflush(stdout);
  std::fprintf(stderr, "%s: line %d: %s failed: %s (%s)\n", kProg, line, call, cudaGetErrorName(e),
               cudaGetErrorString(e));
  std::exit(kExitFail);
}

void attn_check(attn_status_t st, const char* call, int line) {
  if (st == ATTN_STATUS_SUCCESS) return;
  std::fflush(stdout);
  std::fprintf(stderr, "%s: line %d: %s failed: %s: %s\n", kProg, line, call,
               attn_status_string(st), attn_last_error_message());
  std::exit(kExitFail);
}

#define CUDA_CHECK(call) cuda_check((call), #call, __LINE__)
#define ATTN_CHECK(call) attn_check((call), #call, __LINE__)

// ---------------------------------------------------------------------------
// Host data: random non-zero values in the plan's dtype
// ---------------------------------------------------------------------------

// xorshift64*: reproducible, fast, no dependence on the C library's rand().
struct Rng {
  uint64_t s = 0x9E3779B97F4A7C15ull;
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  // Never zero: magnitude in [0.1, 1), either sign.
  float value() {
    const uint64_t x = next();
    const double u = double(x >> 11) * (1.0 / 9007199254740992.0);
    const double mag = 0.1 + 0.9 * u;
    return float((x & 1u) ? -mag : mag);
  }
};

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Round to nearest even.
uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x40u);
  return uint16_t((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

uint16_t float_to_fp16(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t exp8 = int32_t((x >> 23) & 0xFFu);
  uint32_t mant = x & 0x7FFFFFu;
  if (exp8 == 0xFF) return uint16_t(sign | 0x7C00u | (mant != 0 ? 0x200u : 0u));
  const int32_t e = exp8 - 127 + 15;
  if (e >= 31) return uint16_t(sign | 0x7C00u);
  if (e <= 0) {  // subnormal half (units of 2^-24) or zero
    if (e < -10) return uint16_t(sign);
    mant |= 0x800000u;
    const uint32_t shift = uint32_t(14 - e);
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = (uint32_t(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return uint16_t(sign | h);
}

size_t dtype_size(attn_dtype_t dt) { return dt == ATTN_DTYPE_FP32 ? 4 : 2; }

const char* dtype_name(attn_dtype_t dt) {
  switch (dt) {
    case ATTN_DTYPE_FP16: return "fp16";
    case ATTN_DTYPE_BF16: return "bf16";
    default: return "fp32";
  }
}

// Fills `host` (n elements of dt) with random non-zero values.
void fill_random(std::vector<unsigned char>& host, size_t n, attn_dtype_t dt, Rng& rng) {
  host.resize(n * dtype_size(dt));
  if (dt == ATTN_DTYPE_FP32) {
    float* p = reinterpret_cast<float*>(host.data());
    for (size_t i = 0; i < n; ++i) p[i] = rng.value();
  } else {
    uint16_t* p = reinterpret_cast<uint16_t*>(host.data());
    const bool bf16 = dt == ATTN_DTYPE_BF16;
    for (size_t i = 0; i < n; ++i) {
      const float v = rng.value();
      p[i] = bf16 ? float_to_bf16(v) : float_to_fp16(v);
    }
  }
}

// Number of NaN or inf elements among n of dt; *first gets the first one's index.
size_t count_nonfinite(const unsigned char* data, size_t n, attn_dtype_t dt, size_t* first) {
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    bool nonfinite;
    if (dt == ATTN_DTYPE_FP32) {
      uint32_t x;
      std::memcpy(&x, data + 4 * i, 4);
      nonfinite = (x & 0x7F800000u) == 0x7F800000u;
    } else {
      uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      nonfinite = dt == ATTN_DTYPE_BF16 ? (h & 0x7F80u) == 0x7F80u : (h & 0x7C00u) == 0x7C00u;
    }
    if (nonfinite && bad++ == 0) *first = i;
  }
  return bad;
}

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

struct Options {
  int64_t batch = 1, heads_q = 16, heads_kv = -1, seqlen_q = 4096, seqlen_kv = -1;
  int64_t head_dim = 128, head_dim_v = -1;
  attn_dtype_t dtype = ATTN_DTYPE_BF16;
  attn_layout_t layout = ATTN_LAYOUT_BSHD;
  attn_mask_t mask = ATTN_MASK_NONE;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool varlen = false;
  bool run_fwd = true, run_bwd = false;
  bool deterministic = false;
  int warmup = 5, repeat = 20;
  int device = 0;
  int64_t sets = 0;  // 0: from the L2 size
  std::string label;
};

void usage(FILE* f) {
  std::fputs(
      "usage: attn_bench_cuda [options]\n"
      "  --batch N            sequences (1)\n"
      "  --heads-q N          query heads (16)\n"
      "  --heads-kv N         key/value heads, divides heads-q (= heads-q)\n"
      "  --seqlen N           seqlen_q = seqlen_kv = N (4096)\n"
      "  --seqlen-q N         query length\n"
      "  --seqlen-kv N        key/value length (= seqlen-q)\n"
      "  --head-dim N         head_dim_qk = head_dim_v = N (128)\n"
      "  --head-dim-v N       value head dim (= head-dim)\n"
      "  --dtype T            fp16 | bf16 (bf16); fp32 is passed on to the library\n"
      "  --layout L           bshd | bhsd (bshd); ignored with --varlen (THD)\n"
      "  --mask M             none | causal | window LEFT RIGHT (none);\n"
      "                       -1 for an unbounded window side\n"
      "  --softcap X          logit soft-cap, 0 = off (0)\n"
      "  --varlen             a varlen batch of equal lengths (packed THD)\n"
      "  --passes P           fwd | bwd | fwd,bwd (fwd)\n"
      "  --deterministic      deterministic backward (dQ without atomics)\n"
      "  --warmup N           untimed calls per pass before timing (5)\n"
      "  --repeat N           timed calls per pass (20)\n"
      "  --device N           CUDA device ordinal (0)\n"
      "  --sets N             tensor sets to rotate among, 0 = enough to defeat\n"
      "                       the L2 (0)\n"
      "  --label NAME         case name in the output (from the mask)\n"
      "  --help\n"
      "Exit status: 0 ok, 1 failure, 2 bad command line, 3 no usable CUDA device.\n",
      f);
}

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "%s: %s (--help lists the options)\n", kProg, msg.c_str());
  std::exit(kExitUsage);
}

int64_t parse_int(const char* opt, const char* s, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
    usage_error(std::string(opt) + ": '" + s + "' is not an integer in [" + std::to_string(lo) +
                ", " + std::to_string(hi) + "]");
  return int64_t(v);
}

// The value after argv[*i], for option `opt`.
const char* need_arg(int argc, char** argv, int* i, const char* opt = nullptr) {
  if (*i + 1 >= argc) usage_error(std::string(opt ? opt : argv[*i]) + " needs a value");
  return argv[++*i];
}

Options parse_options(int argc, char** argv) {
  Options o;
  const int64_t big = int64_t(1) << 40;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (a == "--batch") {
      o.batch = parse_int(argv[i], need_arg(argc, argv, &i), 1, big);
    } else if (a == "--heads-q") {
      o.heads_q = parse_int(argv[i], need_arg(argc, argv, &i), 1, big);
    } else if (a == "--heads-kv") {
      o.heads_kv = parse_int(argv[i], need_arg(argc, argv, &i), 1, big);
    } else if (a == "--seqlen") {
      o.seqlen_q = o.seqlen_kv = parse_int(argv[i], need_arg(argc, argv, &i), 1, big);
    } else if (a == "--seqlen-q") {
      o.seqlen_q = parse_int(argv[i], need_arg(argc, argv, &i), 1, big);
    } else if (a == "--seqlen-kv") {
      o.seqlen_kv = parse_int(argv[i], need_arg(argc, argv, &i), 1, big);
    } else if (a == "--head-dim") {
      o.head_dim = o.head_dim_v = parse_int(argv[i], need_arg(argc, argv, &i), 1, 1024);
    } else if (a == "--head-dim-v") {
      o.head_dim_v = parse_int(argv[i], need_arg(argc, argv, &i), 1, 1024);
    } else if (a == "--dtype") {
      const std::string v = need_arg(argc, argv, &i);
      if (v == "bf16") o.dtype = ATTN_DTYPE_BF16;
      else if (v == "fp16") o.dtype = ATTN_DTYPE_FP16;
      else if (v == "fp32") o.dtype = ATTN_DTYPE_FP32;
      else usage_error("--dtype must be fp16 or bf16 (or fp32)");
    } else if (a == "--layout") {
      const std::string v = need_arg(argc, argv, &i);
      if (v == "bshd") o.layout = ATTN_LAYOUT_BSHD;
      else if (v == "bhsd") o.layout = ATTN_LAYOUT_BHSD;
      else usage_error("--layout must be bshd or bhsd");
    } else if (a == "--mask") {
      const std::string v = need_arg(argc, argv, &i);
      if (v == "none" || v == "full") {
        o.mask = ATTN_MASK_NONE;
        o.window_left = o.window_right = -1;
      } else if (v == "causal") {
        o.mask = ATTN_MASK_CAUSAL;
        o.window_left = o.window_right = -1;
      } else if (v == "window") {
        o.mask = ATTN_MASK_WINDOW;
        const char* left = need_arg(argc, argv, &i, "--mask window LEFT");
        o.window_left = parse_int("--mask window LEFT", left, -1, big);
        const char* right = need_arg(argc, argv, &i, "--mask window RIGHT");
        o.window_right = parse_int("--mask window RIGHT", right, -1, big);
      } else {
        usage_error("--mask must be none, causal or window LEFT RIGHT");
      }
    } else if (a == "--softcap") {
      const char* v = need_arg(argc, argv, &i);
      char* end = nullptr;
      o.softcap = std::strtof(v, &end);
      if (end == v || *end != '\0' || !(o.softcap >= 0.0f) || !std::isfinite(o.softcap))
        usage_error("--softcap must be a finite number >= 0");
    } else if (a == "--varlen") {
      o.varlen = true;
    } else if (a == "--passes") {
      const std::string v = need_arg(argc, argv, &i);
      if (v == "fwd") o.run_fwd = true, o.run_bwd = false;
      else if (v == "bwd") o.run_fwd = false, o.run_bwd = true;
      else if (v == "fwd,bwd" || v == "bwd,fwd" || v == "both") o.run_fwd = o.run_bwd = true;
      else usage_error("--passes must be fwd, bwd or fwd,bwd");
    } else if (a == "--deterministic") {
      o.deterministic = true;
    } else if (a == "--warmup") {
      o.warmup = int(parse_int(argv[i], need_arg(argc, argv, &i), 0, 100000));
    } else if (a == "--repeat") {
      o.repeat = int(parse_int(argv[i], need_arg(argc, argv, &i), 1, 100000));
    } else if (a == "--device") {
      o.device = int(parse_int(argv[i], need_arg(argc, argv, &i), 0, 1024));
    } else if (a == "--sets") {
      o.sets = parse_int(argv[i], need_arg(argc, argv, &i), 0, 100000);
    } else if (a == "--label") {
      o.label = need_arg(argc, argv, &i);
      if (o.label.empty() || o.label.find_first_of(",\n\r") != std::string::npos)
        usage_error("--label must be non-empty, without commas or newlines");
    } else {
      usage_error("unknown option '" + a + "'");
    }
  }
  if (o.heads_kv < 0) o.heads_kv = o.heads_q;
  if (o.seqlen_kv < 0) o.seqlen_kv = o.seqlen_q;
  if (o.head_dim_v < 0) o.head_dim_v = o.head_dim;
  if (o.label.empty()) {
    if (o.mask == ATTN_MASK_CAUSAL) o.label = "causal";
    else if (o.mask == ATTN_MASK_WINDOW)
      o.label = "window_" + std::to_string(o.window_left) + "_" + std::to_string(o.window_right);
    else o.label = "full";
  }
  return o;
}

std::string shape_string(const Options& o) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "b%" PRId64 "-hq%" PRId64 "-hkv%" PRId64 "-lq%" PRId64
                "-lk%" PRId64 "-d%" PRId64,
                o.batch, o.heads_q, o.heads_kv, o.seqlen_q, o.seqlen_kv, o.head_dim);
  std::string s = buf;
  if (o.head_dim_v != o.head_dim) s += "-dv" + std::to_string(o.head_dim_v);
  if (o.varlen) s += "-thd";
  else if (o.layout == ATTN_LAYOUT_BHSD) s += "-bhsd";
  if (o.softcap > 0.0f) {
    std::snprintf(buf, sizeof buf, "-cap%g", double(o.softcap));
    s += buf;
  }
  if (o.deterministic && o.run_bwd) s += "-det";
  return s;
}

const char* mask_name(attn_mask_t m) {
  return m == ATTN_MASK_CAUSAL ? "causal" : m == ATTN_MASK_WINDOW ? "window" : "none";
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1024.0 * 1024.0));
  return buf;
}

// ---------------------------------------------------------------------------
// Device tensors
// ---------------------------------------------------------------------------

// One independent set of a plan's tensors.
struct TensorSet {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  void *d_o = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  bool ran_fwd = false, ran_bwd = false;
};

struct Sizes {
  size_t nq, nk, nv, no, nlse;  // elements
  size_t eb;                    // bytes per element
  // Q, K, V, O and LSE: what a forward touches.
  size_t fwd_bytes() const { return (nq + nk + nv + no) * eb + nlse * sizeof(float); }
  // ... and dO, dQ, dK, dV: a whole set of a backward plan, what a backward touches.
  size_t set_bytes(bool bwd) const { return fwd_bytes() + (bwd ? (no + nq + nk + nv) * eb : 0); }
};

void* device_alloc(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes == 0 ? 256 : bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    die(kExitFail, std::string("out of device memory allocating ") + what + " (" +
                       mib(double(bytes)) + "); try fewer --sets or a smaller problem");
  }
  CUDA_CHECK(e);
  return p;
}

// Uploads random non-zero data of n elements to dst.
void upload_random(void* dst, size_t n, attn_dtype_t dt, Rng& rng,
                   std::vector<unsigned char>& staging) {
  fill_random(staging, n, dt, rng);
  CUDA_CHECK(cudaMemcpy(dst, staging.data(), n * dtype_size(dt), cudaMemcpyHostToDevice));
}

// Copies n elements back and fails on any NaN or inf.
void check_finite(const void* src, size_t n, attn_dtype_t dt, const char* name, size_t set,
                  std::vector<unsigned char>& staging) {
  staging.resize(n * dtype_size(dt));
  CUDA_CHECK(cudaMemcpy(staging.data(), src, n * dtype_size(dt), cudaMemcpyDeviceToHost));
  size_t first = 0;
  const size_t bad = count_nonfinite(staging.data(), n, dt, &first);
  if (bad != 0)
    die(kExitFail, std::string(name) + " of tensor set " + std::to_string(set) + " holds " +
                       std::to_string(bad) + " NaN or inf of " + std::to_string(n) +
                       " elements (first at element " + std::to_string(first) +
                       "; outputs were filled with NaN before the first call, so an element "
                       "never written shows as NaN too)");
}

// ---------------------------------------------------------------------------
// Timing
// ---------------------------------------------------------------------------

struct Timing {
  double median_ms = 0, min_ms = 0, mean_ms = 0, max_ms = 0;
  bool done = false;
};

Timing summarise(std::vector<float> ms) {
  Timing t;
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  t.min_ms = ms.front();
  t.max_ms = ms.back();
  t.median_ms = (n % 2) ? ms[n / 2] : 0.5 * (double(ms[n / 2 - 1]) + double(ms[n / 2]));
  double sum = 0;
  for (float x : ms) sum += x;
  t.mean_ms = sum / double(n);
  t.done = true;
  return t;
}

double tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) * 1e-12 : 0.0; }

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_options(argc, argv);

  // --- device ---------------------------------------------------------------
  int device_count = 0;
  const cudaError_t ce = cudaGetDeviceCount(&device_count);
  if (ce != cudaSuccess || device_count == 0) {
    if (ce != cudaSuccess)
      std::fprintf(stderr, "%s: no usable CUDA device: cudaGetDeviceCount: %s (%s)\n", kProg,
                   cudaGetErrorName(ce), cudaGetErrorString(ce));
    else
      std::fprintf(stderr, "%s: no usable CUDA device: cudaGetDeviceCount found none\n", kProg);
    return kExitNoDevice;
  }
  if (o.device >= device_count)
    die(kExitNoDevice, "--device " + std::to_string(o.device) + ": this machine has " +
                           std::to_string(device_count) + " CUDA device(s)");
  CUDA_CHECK(cudaSetDevice(o.device));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, o.device));
  int l2_bytes = 0, driver_version = 0, runtime_version = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, o.device));
  CUDA_CHECK(cudaDriverGetVersion(&driver_version));
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime_version));

  // --- plan -----------------------------------------------------------------
  attn_context_t ctx = nullptr;
  attn_plan_desc_t desc = nullptr;
  attn_plan_t plan = nullptr;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, o.device, 0, &ctx));
  ATTN_CHECK(attn_plan_desc_create(&desc));
  ATTN_CHECK(attn_plan_desc_set_shape(desc, o.batch, o.heads_q, o.heads_kv, o.seqlen_q,
                                      o.seqlen_kv, o.head_dim, o.head_dim_v));
  ATTN_CHECK(attn_plan_desc_set_dtype(desc, o.dtype));
  if (o.varlen) {
    // Equal lengths, packed back to back; offsets are int32.
    if (o.batch * o.seqlen_q > INT32_MAX || o.batch * o.seqlen_kv > INT32_MAX)
      die(kExitUsage, "--varlen: batch * seqlen must fit in int32");
    std::vector<int32_t> cu_q(size_t(o.batch) + 1), cu_kv(size_t(o.batch) + 1);
    for (int64_t b = 0; b <= o.batch; ++b) {
      cu_q[size_t(b)] = int32_t(b * o.seqlen_q);
      cu_kv[size_t(b)] = int32_t(b * o.seqlen_kv);
    }
    ATTN_CHECK(attn_plan_desc_set_varlen(desc, o.batch, cu_q.data(), cu_kv.data()));
  } else {
    ATTN_CHECK(attn_plan_desc_set_layout(desc, o.layout));
  }
  ATTN_CHECK(attn_plan_desc_set_mask(desc, o.mask, o.window_left, o.window_right));
  if (o.softcap > 0.0f) ATTN_CHECK(attn_plan_desc_set_softcap(desc, o.softcap));
  ATTN_CHECK(attn_plan_desc_set_passes(
      desc, o.run_bwd ? ATTN_PASSES_FORWARD_BACKWARD : ATTN_PASSES_FORWARD));
  if (o.deterministic) ATTN_CHECK(attn_plan_desc_set_deterministic(desc, 1));
  ATTN_CHECK(attn_plan_create(ctx, desc, &plan));

  attn_plan_info_t info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  ATTN_CHECK(attn_plan_describe(plan, &info));
  size_t needed = 0;
  ATTN_CHECK(attn_plan_summary(plan, nullptr, 0, &needed));
  std::vector<char> summary_buf(needed + 1, '\0');
  ATTN_CHECK(attn_plan_summary(plan, summary_buf.data(), summary_buf.size(), nullptr));
  const std::string summary = summary_buf.data();
  size_t ws_fwd = 0, ws_bwd = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &ws_fwd));
  if (o.run_bwd) ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &ws_bwd));
  const size_t ws_bytes = std::max(ws_fwd, ws_bwd);

  // --- memory: sets of tensors rotated so that no call finds a warm L2 -------
  // Element counts do not depend on the layout (default, dense strides).
  Sizes sz;
  sz.nq = size_t(o.batch * o.seqlen_q * o.heads_q * o.head_dim);
  sz.nk = size_t(o.batch * o.seqlen_kv * o.heads_kv * o.head_dim);
  sz.nv = size_t(o.batch * o.seqlen_kv * o.heads_kv * o.head_dim_v);
  sz.no = size_t(o.batch * o.seqlen_q * o.heads_q * o.head_dim_v);
  sz.nlse = size_t(o.batch * o.heads_q * o.seqlen_q);
  sz.eb = dtype_size(o.dtype);
  const size_t set_bytes = sz.set_bytes(o.run_bwd);
  // Between two uses of one set, the (sets - 1) others touch >= 3 x L2; a
  // call touches the forward's tensors or the whole set, whichever pass is
  // timed with less.
  const double l2_target = 3.0 * double(l2_bytes);
  const double touched = double(o.run_fwd ? sz.fwd_bytes() : set_bytes);
  int64_t sets = o.sets;
  bool sets_capped = false;
  if (sets == 0) {
    sets = std::max<int64_t>(2, 1 + int64_t(std::ceil(l2_target / touched)));
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double budget = 0.9 * double(free_b) - double(ws_bytes);
    const int64_t fit = budget > 0 ? int64_t(budget / double(set_bytes)) : 0;
    if (fit < 1)
      die(kExitFail, "out of device memory: one tensor set needs " + mib(double(set_bytes)) +
                         " plus a workspace of " + mib(double(ws_bytes)) + ", " +
                         mib(double(free_b)) + " are free");
    if (fit < sets) sets = fit, sets_capped = true;
  }
  const bool l2_defeated = sets >= 2 && double(sets - 1) * touched >= l2_target;

  // --- human-readable header -----------------------------------------------
  std::printf("libattn %s CUDA benchmark\n", attn_version_string());
  std::printf("device:   %d: %s, sm_%d%d, %d SMs, L2 %s, %.1f GiB, driver %d.%d, runtime %d.%d\n",
              o.device, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              mib(double(l2_bytes)).c_str(),
              double(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0), driver_version / 1000,
              (driver_version % 1000) / 10, runtime_version / 1000, (runtime_version % 1000) / 10);
  std::printf("plan:     %s\n", summary.c_str());
  std::printf("kernel:   %s (%s), tiles %d x %d\n", info.kernel, info.algorithm, int(info.tile_q),
              int(info.tile_kv));
  std::printf("problem:  %s %s %s, %" PRIu64 " visible pairs, forward %.3f GFLOP, backward "
              "%.3f GFLOP\n",
              shape_string(o).c_str(), dtype_name(o.dtype), o.label.c_str(),
              uint64_t(info.visible_pairs), info.flops_forward * 1e-9, info.flops_backward * 1e-9);
  std::printf("memory:   %" PRId64 " tensor set(s) of %s rotated call to call (%s), "
              "workspace %s\n",
              sets, mib(double(set_bytes)).c_str(),
              l2_defeated ? "the others touch >= 3 x L2 between two uses of one"
                          : "NOT enough to defeat the L2",
              mib(double(ws_bytes)).c_str());
  std::printf("timing:   %d warm-up + %d timed calls per pass, CUDA events around each call, "
              "queued back to back on a non-blocking stream; median and min\n",
              o.warmup, o.repeat);
  if (!l2_defeated)
    std::fprintf(stderr, "%s: warning: %" PRId64 " set(s) of %s%s do not defeat an L2 of %s: "
                 "timed calls may find their inputs in a warm cache\n",
                 kProg, sets, mib(double(set_bytes)).c_str(),
                 sets_capped ? " (as many as fit in device memory)" : "",
                 mib(double(l2_bytes)).c_str());
  std::fflush(stdout);

  // --- tensors ----------------------------------------------------------------
  std::vector<TensorSet> ts(static_cast<size_t>(sets));
  std::vector<unsigned char> staging;
  Rng rng;
  const size_t eb = sz.eb;
  for (TensorSet& t : ts) {
    t.q = device_alloc(sz.nq * eb, "Q");
    t.k = device_alloc(sz.nk * eb, "K");
    t.v = device_alloc(sz.nv * eb, "V");
    t.o = device_alloc(sz.no * eb, "O");
    t.lse = static_cast<float*>(device_alloc(sz.nlse * sizeof(float), "LSE"));
    upload_random(t.q, sz.nq, o.dtype, rng, staging);
    upload_random(t.k, sz.nk, o.dtype, rng, staging);
    upload_random(t.v, sz.nv, o.dtype, rng, staging);
    // Outputs start as NaN (all-ones bytes: NaN in fp32, fp16 and bf16).
    CUDA_CHECK(cudaMemset(t.o, 0xFF, sz.no * eb));
    CUDA_CHECK(cudaMemset(t.lse, 0xFF, sz.nlse * sizeof(float)));
    if (o.run_bwd) {
      t.d_o = device_alloc(sz.no * eb, "dO");
      t.dq = device_alloc(sz.nq * eb, "dQ");
      t.dk = device_alloc(sz.nk * eb, "dK");
      t.dv = device_alloc(sz.nv * eb, "dV");
      upload_random(t.d_o, sz.no, o.dtype, rng, staging);
      CUDA_CHECK(cudaMemset(t.dq, 0xFF, sz.nq * eb));
      CUDA_CHECK(cudaMemset(t.dk, 0xFF, sz.nk * eb));
      CUDA_CHECK(cudaMemset(t.dv, 0xFF, sz.nv * eb));
    }
  }
  void* ws = nullptr;
  if (ws_bytes > 0) {
    ws = device_alloc(ws_bytes, "the workspace");
    CUDA_CHECK(cudaMemset(ws, 0xFF, ws_bytes));  // the library may assume nothing of it
  }
  staging.clear();
  staging.shrink_to_fit();

  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ev_start(size_t(o.repeat)), ev_stop(size_t(o.repeat));
  for (int i = 0; i < o.repeat; ++i) {
    CUDA_CHECK(cudaEventCreate(&ev_start[size_t(i)]));
    CUDA_CHECK(cudaEventCreate(&ev_stop[size_t(i)]));
  }
  CUDA_CHECK(cudaDeviceSynchronize());

  size_t next_set = 0;  // rotates across passes too: consecutive calls use distinct sets
  auto take_set = [&]() -> TensorSet& {
    TensorSet& t = ts[next_set];
    next_set = (next_set + 1) % ts.size();
    return t;
  };
  auto forward = [&](TensorSet& t) {
    ATTN_CHECK(attn_forward(plan, t.q, t.k, t.v, t.o, t.lse, ws, ws_bytes, stream));
    t.ran_fwd = true;
  };
  auto backward = [&](TensorSet& t) {
    ATTN_CHECK(attn_backward(plan, t.q, t.k, t.v, t.o, t.lse, t.d_o, t.dq, t.dk, t.dv, ws,
                             ws_bytes, stream));
    t.ran_bwd = true;
  };
  // Warm-up, then timed calls each between its own events; one sync at the end.
  auto time_pass = [&](auto&& call) {
    for (int i = 0; i < o.warmup; ++i) call(take_set());
    for (int i = 0; i < o.repeat; ++i) {
      TensorSet& t = take_set();
      CUDA_CHECK(cudaEventRecord(ev_start[size_t(i)], stream));
      call(t);
      CUDA_CHECK(cudaEventRecord(ev_stop[size_t(i)], stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaGetLastError());
    std::vector<float> ms(size_t(o.repeat));
    for (int i = 0; i < o.repeat; ++i)
      CUDA_CHECK(cudaEventElapsedTime(&ms[size_t(i)], ev_start[size_t(i)], ev_stop[size_t(i)]));
    return summarise(std::move(ms));
  };

  // --- run ----------------------------------------------------------------------
  Timing t_fwd, t_bwd;
  if (o.run_bwd) {
    // O and LSE of every set, for its backward.
    for (TensorSet& t : ts) forward(t);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaGetLastError());
  }
  if (o.run_fwd) {
    t_fwd = time_pass(forward);
    std::fprintf(stderr, "fwd: median %.4f ms\n", t_fwd.median_ms);
  }
  size_t checked_fwd = 0, checked_bwd = 0;
  for (size_t s = 0; s < ts.size(); ++s) {
    if (!ts[s].ran_fwd) continue;
    check_finite(ts[s].o, sz.no, o.dtype, "O", s, staging);
    check_finite(ts[s].lse, sz.nlse, ATTN_DTYPE_FP32, "LSE", s, staging);
    ++checked_fwd;
  }
  if (o.run_bwd) {
    t_bwd = time_pass(backward);
    std::fprintf(stderr, "bwd: median %.4f ms\n", t_bwd.median_ms);
    for (size_t s = 0; s < ts.size(); ++s) {
      if (!ts[s].ran_bwd) continue;
      check_finite(ts[s].dq, sz.nq, o.dtype, "dQ", s, staging);
      check_finite(ts[s].dk, sz.nk, o.dtype, "dK", s, staging);
      check_finite(ts[s].dv, sz.nv, o.dtype, "dV", s, staging);
      ++checked_bwd;
    }
  }

  // --- results ------------------------------------------------------------------
  struct Row {
    const char* pass;
    double flops;
    const Timing* t;
  };
  const Row rows[2] = {{"fwd", info.flops_forward, &t_fwd}, {"bwd", info.flops_backward, &t_bwd}};
  std::printf("\n%-12s %-5s %11s %11s %12s %12s %12s\n", "case", "pass", "median ms", "min ms",
              "GFLOP", "TFLOP/s med", "TFLOP/s best");
  for (const Row& r : rows) {
    if (!r.t->done) continue;
    std::printf("%-12s %-5s %11.4f %11.4f %12.3f %12.2f %12.2f\n", o.label.c_str(), r.pass,
                r.t->median_ms, r.t->min_ms, r.flops * 1e-9, tflops(r.flops, r.t->median_ms),
                tflops(r.flops, r.t->min_ms));
  }
  std::printf("check:    no NaN or inf in O and LSE (%zu set(s))", checked_fwd);
  if (o.run_bwd) std::printf(", dQ, dK and dV (%zu set(s))", checked_bwd);
  std::printf("\n");

  std::printf("\nmeta,version,%s\n", attn_version_string());
  std::printf("meta,device,%s\n", prop.name);
  std::printf("meta,sm,%d%d\n", prop.major, prop.minor);
  std::printf("meta,sms,%d\n", prop.multiProcessorCount);
  std::printf("meta,l2_bytes,%d\n", l2_bytes);
  std::printf("meta,driver,%d\n", driver_version);
  std::printf("meta,runtime,%d\n", runtime_version);
  std::printf("meta,summary,%s\n", summary.c_str());
  std::printf("meta,kernel,%s\n", info.kernel);
  std::printf("meta,algorithm,%s\n", info.algorithm);
  std::printf("meta,workspace_bytes,%zu\n", ws_bytes);
  std::printf("meta,sets,%" PRId64 "\n", sets);
  std::printf("meta,set_bytes,%zu\n", set_bytes);
  std::printf("meta,l2_defeated,%d\n", l2_defeated ? 1 : 0);
  std::printf("csv,case,pass,shape,dtype,mask,window_left,window_right,softcap,varlen,"
              "deterministic,batch,heads_q,heads_kv,seqlen_q,seqlen_kv,head_dim,visible_pairs,"
              "gflop,median_ms,min_ms,mean_ms,max_ms,tflops_median,tflops_best,warmup,repeat,sets\n");
  for (const Row& r : rows) {
    if (!r.t->done) continue;
    std::printf("csv,%s,%s,%s,%s,%s,%" PRId64 ",%" PRId64 ",%g,%d,%d,%" PRId64 ",%" PRId64
                ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRIu64
                ",%.6f,%.5f,%.5f,%.5f,%.5f,%.3f,%.3f,%d,%d,%" PRId64 "\n",
                o.label.c_str(), r.pass, shape_string(o).c_str(), dtype_name(o.dtype),
                mask_name(o.mask), o.window_left, o.window_right, double(o.softcap),
                o.varlen ? 1 : 0, o.deterministic ? 1 : 0, o.batch, o.heads_q, o.heads_kv,
                o.seqlen_q, o.seqlen_kv, o.head_dim, uint64_t(info.visible_pairs),
                r.flops * 1e-9, r.t->median_ms, r.t->min_ms, r.t->mean_ms, r.t->max_ms,
                tflops(r.flops, r.t->median_ms), tflops(r.flops, r.t->min_ms), o.warmup,
                o.repeat, sets);
  }
  std::fflush(stdout);

  // --- clean up -----------------------------------------------------------------
  for (int i = 0; i < o.repeat; ++i) {
    CUDA_CHECK(cudaEventDestroy(ev_start[size_t(i)]));
    CUDA_CHECK(cudaEventDestroy(ev_stop[size_t(i)]));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  for (TensorSet& t : ts)
    for (void* p : {t.q, t.k, t.v, t.o, static_cast<void*>(t.lse), t.d_o, t.dq, t.dk, t.dv})
      if (p != nullptr) CUDA_CHECK(cudaFree(p));
  if (ws != nullptr) CUDA_CHECK(cudaFree(ws));
  ATTN_CHECK(attn_plan_destroy(plan));
  ATTN_CHECK(attn_plan_desc_destroy(desc));
  ATTN_CHECK(attn_context_destroy(ctx));
  return 0;
}
