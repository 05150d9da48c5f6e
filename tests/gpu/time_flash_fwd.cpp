// Quick timing of the CUDA forward: bf16, batch * seqlen = 16K tokens,
// 2048 / d heads, CUDA events around each run after warm-up, median of
// ATTN_TIME_REPS runs (default 20). TFLOP/s counts visible pairs only
// (attn_plan_describe's flops_forward = 4 * pairs * d). Inputs are 64 MiB
// per tensor, larger than L2. Exit 77 without a CUDA device.
// Usage: time_flash_fwd [extra "d,L,causal" cases ...]

#include <string>
#include <vector>

#include "gpu_common.hpp"

using namespace gpu_test;

int main(int argc, char** argv) {
  skip_without_device();
  const int reps = timing_reps();
  const std::vector<TimingShape> shapes = timing_shapes(argc, argv, false);
  TimingTensors t(false);
  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  EventTimer timer;
  const cudaStream_t s = timer.stream();

  std::vector<std::string> lines;
  for (const TimingShape& c : shapes) {
    attn_plan_t plan = timing_plan(ctx, c, false, false);
    const attn_plan_info_t info = describe(plan);
    double med = 0, best = 0;
    timer.time([&] { return attn_forward(plan, t.q, t.k, t.v, t.o, t.lse, nullptr, 0, s); }, reps,
               &med, &best);
    const double tflops = info.flops_forward / (med * 1e-3) / 1e12;
    char line[256];
    std::snprintf(line, sizeof line, "%4" PRId64 " %6" PRId64 " %-6s %5" PRId64 " %5" PRId64
                  " %9.3f %9.3f %8.1f  %s",
                  c.d, c.l, c.causal ? "causal" : "full", c.batch(), c.heads(), med, best, tflops,
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
  attn_context_destroy(ctx);
  return 0;
}
