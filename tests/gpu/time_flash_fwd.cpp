// Quick timing of the CUDA forward: bf16, batch * seqlen = 16K tokens,
// 2048 / d heads, CUDA events around each run after warm-up, median of
// ATTN_TIME_REPS runs (default 20). TFLOP/s counts visible pairs only
// (attn_plan_describe's flops_forward = 4 * pairs * d). Inputs are 64 MiB
// per tensor, larger than L2. Exit 77 without a CUDA device.
// Shapes: d 64 and 128, L 1K, 2K, 4K, 8K and 16K, full and causal (plus any
// "d,L,causal" arguments). Each shape is timed on the default kernel choice;
// at d = 64 on both query tiles of the sm_90a forward instead
// (ATTN_CUDA_FWD_SM90_BM=192, then 128; "<" marks the one the plan picks by
// itself), so that one run decides the rule of cuda/fwd_sm90_shape.hpp; and
// then with ATTN_CUDA_FWD_SM90=0 (the sm_80 forward) when that picks another
// kernel. The kernel column names each. ATTN_TIME_FWD_COMPARE=0 times the
// default only; a caller's ATTN_CUDA_FWD_SM90 or ATTN_CUDA_FWD_SM90_BM holds
// for the first pass(es). ATTN_TIME_SOFTCAP=cap times softcap plans instead.
// Usage: time_flash_fwd [extra "d,L,causal" cases ...]

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_common.hpp"

using namespace gpu_test;

namespace {

// Sets (value non-null) or removes environment variable name.
void set_env(const char* name, const char* value) {
  if (value != nullptr)
    setenv(name, value, 1);
  else
    unsetenv(name);
}

}  // namespace

int main(int argc, char** argv) {
  skip_without_device();
  const int reps = timing_reps();
  std::vector<TimingShape> shapes;
  for (int64_t d : {64, 128})
    for (int64_t l : {1024, 2048, 4096, 8192, 16384})
      for (bool causal : {false, true}) shapes.push_back({d, l, causal});
  for (const TimingShape& c : timing_shapes(argc, argv, true)) shapes.push_back(c);
  TimingTensors t(false);
  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  EventTimer timer;
  const cudaStream_t s = timer.stream();

  const char* compare_env = std::getenv("ATTN_TIME_FWD_COMPARE");
  const bool compare = compare_env == nullptr || std::strcmp(compare_env, "0") != 0;
  // Plans read ATTN_CUDA_FWD_SM90 and ATTN_CUDA_FWD_SM90_BM when created:
  // the caller's values (or none) for the first passes, then "0".
  const char* sm90_env = std::getenv("ATTN_CUDA_FWD_SM90");
  const char* bm_env = std::getenv("ATTN_CUDA_FWD_SM90_BM");
  const std::string sm90_choice = sm90_env ? sm90_env : "";
  const std::string bm_choice = bm_env ? bm_env : "";
  auto caller_env = [&] {
    set_env("ATTN_CUDA_FWD_SM90", sm90_env ? sm90_choice.c_str() : nullptr);
    set_env("ATTN_CUDA_FWD_SM90_BM", bm_env ? bm_choice.c_str() : nullptr);
  };
  std::vector<std::string> lines;
  for (const TimingShape& c : shapes) {
    // The kernel the plan picks by itself.
    caller_env();
    attn_plan_t probe = timing_plan(ctx, c, false, false);
    const std::string picked = describe(probe).kernel;
    attn_plan_destroy(probe);
    // Passes: the query tiles at d = 64 (unless the caller forced one), or
    // the default; then the sm_80 kernel.
    std::vector<const char*> tiles;
    if (c.d == 64 && compare && bm_env == nullptr)
      tiles = {"192", "128"};
    else
      tiles = {nullptr};
    std::vector<std::string> timed;
    for (size_t pass = 0; pass < tiles.size() + (compare ? 1 : 0); ++pass) {
      caller_env();
      if (pass < tiles.size()) {
        if (tiles[pass] != nullptr) set_env("ATTN_CUDA_FWD_SM90_BM", tiles[pass]);
      } else {
        set_env("ATTN_CUDA_FWD_SM90", "0");
      }
      attn_plan_t plan = timing_plan(ctx, c, false, false);
      const attn_plan_info_t info = describe(plan);
      bool seen = false;
      for (const std::string& k : timed) seen = seen || k == info.kernel;
      if (seen) {  // the same kernel: timed already
        attn_plan_destroy(plan);
        continue;
      }
      timed.push_back(info.kernel);
      double med = 0, best = 0;
      timer.time([&] { return attn_forward(plan, t.q, t.k, t.v, t.o, t.lse, nullptr, 0, s); }, reps,
                 &med, &best);
      const double tflops = info.flops_forward / (med * 1e-3) / 1e12;
      char line[256];
      std::snprintf(line, sizeof line, "%4" PRId64 " %6" PRId64 " %-6s %5" PRId64 " %5" PRId64
                    " %9.3f %9.3f %8.1f  %s%s",
                    c.d, c.l, c.causal ? "causal" : "full", c.batch(), c.heads(), med, best, tflops,
                    info.kernel, picked == info.kernel && tiles.size() > 1 ? " <" : "");
      lines.push_back(line);
      std::printf("%s\n", line);
      std::fflush(stdout);
      attn_plan_destroy(plan);
    }
  }
  caller_env();
  std::printf("\nbf16 forward, batch*seqlen = 16K, heads = 2048/d, median of %d runs"
              " (<: the tile the plan picks)\n", reps);
  std::printf("%4s %6s %-6s %5s %5s %9s %9s %8s  %s\n", "d", "L", "mask", "batch", "heads", "ms(med)",
              "ms(min)", "TFLOP/s", "kernel");
  for (const auto& l : lines) std::printf("%s\n", l.c_str());
  attn_context_destroy(ctx);
  return 0;
}
