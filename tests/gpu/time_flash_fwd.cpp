// Quick timing of the CUDA forward: bf16, batch * seqlen = 16K tokens,
// 2048 / d heads, CUDA events around each run after warm-up, median of
// ATTN_TIME_REPS runs (default 20). TFLOP/s counts visible pairs only
// (attn_plan_describe's flops_forward = 4 * pairs * d). Inputs are 64 MiB
// per tensor, larger than L2. Exit 77 without a CUDA device.
// Each shape is timed on the default kernel choice and then with
// ATTN_CUDA_FWD_SM90=0 (the sm_80 forward) when that picks another kernel,
// so that one run shows the sm_90a and sm_80 kernels side by side (the
// kernel column names each); ATTN_TIME_FWD_COMPARE=0 times the default only.
// Usage: time_flash_fwd [extra "d,L,causal" cases ...]

#include <cstdlib>
#include <cstring>
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

  const char* compare_env = std::getenv("ATTN_TIME_FWD_COMPARE");
  const bool compare = compare_env == nullptr || std::strcmp(compare_env, "0") != 0;
  // Plans read ATTN_CUDA_FWD_SM90 when created: the caller's value (or
  // none) for the first pass, "0" for the second.
  const char* sm90_env = std::getenv("ATTN_CUDA_FWD_SM90");
  const std::string caller_choice = sm90_env ? sm90_env : "";
  std::vector<std::string> lines;
  std::string first_kernel;
  for (const TimingShape& c : shapes) {
    for (int pass = 0; pass < (compare ? 2 : 1); ++pass) {
      if (pass == 1)
        setenv("ATTN_CUDA_FWD_SM90", "0", 1);
      else if (sm90_env != nullptr)
        setenv("ATTN_CUDA_FWD_SM90", caller_choice.c_str(), 1);
      else
        unsetenv("ATTN_CUDA_FWD_SM90");
      attn_plan_t plan = timing_plan(ctx, c, false, false);
      const attn_plan_info_t info = describe(plan);
      if (pass == 0) first_kernel = info.kernel;
      if (pass == 1 && first_kernel == info.kernel) {  // the same kernel: timed already
        attn_plan_destroy(plan);
        continue;
      }
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
  }
  std::printf("\nbf16 forward, batch*seqlen = 16K, heads = 2048/d, median of %d runs\n", reps);
  std::printf("%4s %6s %-6s %5s %5s %9s %9s %8s  %s\n", "d", "L", "mask", "batch", "heads", "ms(med)",
              "ms(min)", "TFLOP/s", "kernel");
  for (const auto& l : lines) std::printf("%s\n", l.c_str());
  attn_context_destroy(ctx);
  return 0;
}
