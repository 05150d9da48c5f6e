// Quick timing of the CUDA backward (and the forward of the same plan): bf16,
// batch * seqlen = 16K tokens, 2048 / d heads, CUDA events around each run
// after warm-up, median of ATTN_TIME_REPS runs (default 20). TFLOP/s counts
// visible pairs only (attn_plan_describe: forward 4 * pairs * d, backward
// 2.5 x that). Both backward variants are timed: the default plan (dQ by
// fp32 atomics) and the deterministic one (dQ in its own pass). Inputs are
// 64 MiB per tensor, larger than L2. Exit 77 without a CUDA device.
// Prints one "RESULT d L mask fwd_ms fwd_tflops bwd_ms bwd_tflops det_ms
// det_tflops" line per shape (for scripts/gpu-check.sh), then a table.
// Usage: time_flash_bwd [extra "d,L,causal" cases ...]; ATTN_TIME_ONLY=1 runs
// only those (e.g. under a profiler). ATTN_TIME_VARIANTS=1 also times the
// backward variant of small-shared-memory devices where there is one
// (ATTN_CUDA_BWD_VARIANT=1), printing "VARIANT1 d L mask ms TFLOP/s" lines.

#include <algorithm>
#include <cinttypes>
#include <random>
#include <string>
#include <vector>

#include "gpu_common.hpp"

using namespace gpu_test;

namespace {

struct Config {
  int64_t d, l;
  bool causal;
};

}  // namespace

int main(int argc, char** argv) {
  skip_without_device();
  const char* reps_env = std::getenv("ATTN_TIME_REPS");
  const int reps = reps_env ? std::max(3, std::atoi(reps_env)) : 20;
  std::vector<Config> configs;
  const char* only = std::getenv("ATTN_TIME_ONLY");  // 1: just the command line's shapes
  if (only == nullptr || only[0] != '1') {
    for (int64_t d : {64, 128})
      for (int64_t l : {2048, 8192})
        for (bool causal : {false, true}) configs.push_back({d, l, causal});
    configs.push_back({128, 16384, true});
  }
  for (int i = 1; i < argc; ++i) {
    Config c{};
    int causal = 0;
    if (std::sscanf(argv[i], "%" SCNd64 ",%" SCNd64 ",%d", &c.d, &c.l, &causal) == 3) {
      c.causal = causal != 0;
      configs.push_back(c);
    }
  }

  const int64_t tokens = 16384, width = 2048;  // heads * d
  const size_t elems = size_t(tokens * width);
  std::vector<uint16_t> host(elems);
  std::mt19937_64 rng(12345);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  void *q, *k, *v, *o, *d_o, *dq, *dk, *dv, *ws = nullptr;
  float* lse;
  for (void** p : {&q, &k, &v, &o, &d_o, &dq, &dk, &dv}) GPU_CHECK(cudaMalloc(p, elems * 2));
  GPU_CHECK(cudaMalloc(reinterpret_cast<void**>(&lse), size_t(tokens) * 64 * 4));
  for (void* p : {q, k, v, d_o}) {
    for (auto& x : host) x = to_bf16(u(rng));
    GPU_CHECK(cudaMemcpy(p, host.data(), elems * 2, cudaMemcpyHostToDevice));
  }
  size_t ws_bytes = 0;

  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  cudaStream_t s;
  GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  GPU_CHECK(cudaEventCreate(&e0));
  GPU_CHECK(cudaEventCreate(&e1));

  // Median milliseconds of f() over `reps` runs after 3 warm-ups.
  auto time_ms = [&](auto&& f) {
    for (int i = 0; i < 3; ++i) ATTN_CHECK(f());
    std::vector<float> ms(static_cast<size_t>(reps));
    for (int i = 0; i < reps; ++i) {
      GPU_CHECK(cudaEventRecord(e0, s));
      ATTN_CHECK(f());
      GPU_CHECK(cudaEventRecord(e1, s));
      GPU_CHECK(cudaEventSynchronize(e1));
      GPU_CHECK(cudaEventElapsedTime(&ms[size_t(i)], e0, e1));
    }
    GPU_CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return double(ms[ms.size() / 2]);
  };

  std::vector<std::string> lines;
  for (const Config& c : configs) {
    const int64_t batch = std::max<int64_t>(1, tokens / c.l), heads = width / c.d;
    double fwd_ms = 0, bwd_ms[2] = {0, 0};
    attn_plan_info_t info;
    for (int det = 0; det < 2; ++det) {
      attn_plan_desc_t pd;
      ATTN_CHECK(attn_plan_desc_create(&pd));
      ATTN_CHECK(attn_plan_desc_set_shape(pd, batch, heads, heads, c.l, c.l, c.d, c.d));
      ATTN_CHECK(attn_plan_desc_set_dtype(pd, ATTN_DTYPE_BF16));
      ATTN_CHECK(attn_plan_desc_set_mask(pd, c.causal ? ATTN_MASK_CAUSAL : ATTN_MASK_NONE, -1, -1));
      ATTN_CHECK(attn_plan_desc_set_passes(pd, ATTN_PASSES_FORWARD_BACKWARD));
      ATTN_CHECK(attn_plan_desc_set_deterministic(pd, det));
      attn_plan_t plan;
      ATTN_CHECK(attn_plan_create(ctx, pd, &plan));
      attn_plan_desc_destroy(pd);
      std::memset(&info, 0, sizeof info);
      info.struct_size = sizeof info;
      ATTN_CHECK(attn_plan_describe(plan, &info));
      if (info.workspace_bytes_backward > ws_bytes) {
        GPU_CHECK(cudaFree(ws));
        ws_bytes = info.workspace_bytes_backward;
        GPU_CHECK(cudaMalloc(&ws, ws_bytes));
      }
      const double f = time_ms([&] { return attn_forward(plan, q, k, v, o, lse, nullptr, 0, s); });
      if (det == 0) fwd_ms = f;
      bwd_ms[det] = time_ms([&] {
        return attn_backward(plan, q, k, v, o, lse, d_o, dq, dk, dv, ws, ws_bytes, s);
      });
      attn_plan_destroy(plan);
    }
    const char* tv = std::getenv("ATTN_TIME_VARIANTS");
    if (tv != nullptr && tv[0] == '1' && (c.d == 64 || c.d == 128)) {
      setenv("ATTN_CUDA_BWD_VARIANT", "1", 1);
      attn_plan_desc_t pd;
      ATTN_CHECK(attn_plan_desc_create(&pd));
      ATTN_CHECK(attn_plan_desc_set_shape(pd, batch, heads, heads, c.l, c.l, c.d, c.d));
      ATTN_CHECK(attn_plan_desc_set_dtype(pd, ATTN_DTYPE_BF16));
      ATTN_CHECK(attn_plan_desc_set_mask(pd, c.causal ? ATTN_MASK_CAUSAL : ATTN_MASK_NONE, -1, -1));
      ATTN_CHECK(attn_plan_desc_set_passes(pd, ATTN_PASSES_FORWARD_BACKWARD));
      attn_plan_t plan;
      ATTN_CHECK(attn_plan_create(ctx, pd, &plan));
      attn_plan_desc_destroy(pd);
      unsetenv("ATTN_CUDA_BWD_VARIANT");
      const double v1 = time_ms([&] {
        return attn_backward(plan, q, k, v, o, lse, d_o, dq, dk, dv, ws, ws_bytes, s);
      });
      std::printf("VARIANT1 %" PRId64 " %" PRId64 " %s %.4f %.1f\n", c.d, c.l,
                  c.causal ? "causal" : "full", v1, info.flops_backward / (v1 * 1e-3) / 1e12);
      attn_plan_destroy(plan);
    }
    const double tf = info.flops_forward / (fwd_ms * 1e-3) / 1e12;
    const double tb = info.flops_backward / (bwd_ms[0] * 1e-3) / 1e12;
    const double td = info.flops_backward / (bwd_ms[1] * 1e-3) / 1e12;
    std::printf("RESULT %" PRId64 " %" PRId64 " %s %.4f %.1f %.4f %.1f %.4f %.1f\n", c.d, c.l,
                c.causal ? "causal" : "full", fwd_ms, tf, bwd_ms[0], tb, bwd_ms[1], td);
    char line[256];
    std::snprintf(line, sizeof line,
                  "%4" PRId64 " %6" PRId64 " %-6s %5" PRId64 " %5" PRId64
                  " %8.3f %7.1f %8.3f %7.1f %8.3f %7.1f",
                  c.d, c.l, c.causal ? "causal" : "full", batch, heads, fwd_ms, tf, bwd_ms[0], tb,
                  bwd_ms[1], td);
    lines.push_back(line);
    std::fflush(stdout);
  }
  std::printf("\nbf16 backward, batch*seqlen = 16K, heads = 2048/d, median of %d runs (ms, TFLOP/s)\n",
              reps);
  std::printf("%4s %6s %-6s %5s %5s %8s %7s %8s %7s %8s %7s\n", "d", "L", "mask", "batch", "heads",
              "fwd", "TF/s", "bwd", "TF/s", "bwd-det", "TF/s");
  for (const auto& l : lines) std::printf("%s\n", l.c_str());
  for (void* p : {q, k, v, o, d_o, dq, dk, dv, ws}) cudaFree(p);
  cudaFree(lse);
  attn_context_destroy(ctx);
  return 0;
}
