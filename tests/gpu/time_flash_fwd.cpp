// Quick timing of the CUDA forward: bf16, batch * seqlen = 16K tokens,
// 2048 / d heads, CUDA events around each run after warm-up, median of
// ATTN_TIME_REPS runs (default 20). TFLOP/s counts visible pairs only
// (attn_plan_describe's flops_forward = 4 * pairs * d). Inputs are 64 MiB
// per tensor, larger than L2. Exit 77 without a CUDA device.
// Usage: time_flash_fwd [extra "d,L,causal" cases ...]

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
  for (int64_t d : {64, 128})
    for (int64_t l : {2048, 8192})
      for (bool causal : {false, true}) configs.push_back({d, l, causal});
  configs.push_back({128, 16384, true});
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
  void *q, *k, *v, *o;
  float* lse;
  GPU_CHECK(cudaMalloc(&q, elems * 2));
  GPU_CHECK(cudaMalloc(&k, elems * 2));
  GPU_CHECK(cudaMalloc(&v, elems * 2));
  GPU_CHECK(cudaMalloc(&o, elems * 2));
  GPU_CHECK(cudaMalloc(reinterpret_cast<void**>(&lse), size_t(tokens) * 64 * 4));
  for (void* p : {q, k, v}) {
    for (auto& x : host) x = to_bf16(u(rng));
    GPU_CHECK(cudaMemcpy(p, host.data(), elems * 2, cudaMemcpyHostToDevice));
  }

  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  cudaStream_t s;
  GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  GPU_CHECK(cudaEventCreate(&e0));
  GPU_CHECK(cudaEventCreate(&e1));

  std::vector<std::string> lines;
  for (const Config& c : configs) {
    const int64_t batch = std::max<int64_t>(1, tokens / c.l), heads = width / c.d;
    attn_plan_desc_t pd;
    ATTN_CHECK(attn_plan_desc_create(&pd));
    ATTN_CHECK(attn_plan_desc_set_shape(pd, batch, heads, heads, c.l, c.l, c.d, c.d));
    ATTN_CHECK(attn_plan_desc_set_dtype(pd, ATTN_DTYPE_BF16));
    ATTN_CHECK(attn_plan_desc_set_mask(pd, c.causal ? ATTN_MASK_CAUSAL : ATTN_MASK_NONE, -1, -1));
    attn_plan_t plan;
    ATTN_CHECK(attn_plan_create(ctx, pd, &plan));
    attn_plan_desc_destroy(pd);
    attn_plan_info_t info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    ATTN_CHECK(attn_plan_describe(plan, &info));
    for (int i = 0; i < 3; ++i) ATTN_CHECK(attn_forward(plan, q, k, v, o, lse, nullptr, 0, s));
    std::vector<float> ms(static_cast<size_t>(reps));
    for (int i = 0; i < reps; ++i) {
      GPU_CHECK(cudaEventRecord(e0, s));
      ATTN_CHECK(attn_forward(plan, q, k, v, o, lse, nullptr, 0, s));
      GPU_CHECK(cudaEventRecord(e1, s));
      GPU_CHECK(cudaEventSynchronize(e1));
      GPU_CHECK(cudaEventElapsedTime(&ms[size_t(i)], e0, e1));
    }
    GPU_CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const double tflops = info.flops_forward / (med * 1e-3) / 1e12;
    char line[256];
    std::snprintf(line, sizeof line, "%4" PRId64 " %6" PRId64 " %-6s %5" PRId64 " %5" PRId64
                  " %9.3f %9.3f %8.1f  %s",
                  c.d, c.l, c.causal ? "causal" : "full", batch, heads, med, ms.front(), tflops,
                  info.kernel);
    lines.push_back(line);
    std::printf("%s\n", line);
    std::fflush(stdout);
    attn_plan_destroy(plan);
  }
  std::printf("\nbf16 forward, batch*seqlen = 16K, heads = 2048/d, median of %d runs\n", reps);
  std::printf("%4s %6s %-6s %5s %5s %9s %9s %8s  %s\n", "d", "L", "mask", "batch", "heads", "ms(med)",
              "ms(min)", "TFLOP/s", "kernel");
  for (const auto& l : lines) std::printf("%s\n", l.c_str());
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(lse);
  attn_context_destroy(ctx);
  return 0;
}
