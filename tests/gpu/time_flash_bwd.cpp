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
// Where the default plan's dK/dV kernel is the sm_90a (wgmma) one, its
// backward is also timed with ATTN_CUDA_BWD_SM90=0 (the sm_80 kernel),
// printing "SM80BWD d L mask ms TFLOP/s" lines and a column of the table;
// ATTN_TIME_BWD_COMPARE=0 skips that.

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_common.hpp"

using namespace gpu_test;

int main(int argc, char** argv) {
  skip_without_device();
  const int reps = timing_reps();
  const char* only = std::getenv("ATTN_TIME_ONLY");  // 1: just the command line's shapes
  const std::vector<TimingShape> shapes =
      timing_shapes(argc, argv, only != nullptr && only[0] == '1');
  TimingTensors t(true);
  void* ws = nullptr;
  size_t ws_bytes = 0;
  attn_context_t ctx;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  EventTimer timer;
  const cudaStream_t s = timer.stream();
  auto fit_workspace = [&](const attn_plan_info_t& info) {
    if (info.workspace_bytes_backward <= ws_bytes) return;
    GPU_CHECK(cudaFree(ws));
    ws_bytes = info.workspace_bytes_backward;
    GPU_CHECK(cudaMalloc(&ws, ws_bytes));
  };
  auto backward = [&](attn_plan_t plan) {
    return attn_backward(plan, t.q, t.k, t.v, t.o, t.lse, t.d_o, t.dq, t.dk, t.dv, ws, ws_bytes, s);
  };

  const char* compare_env = std::getenv("ATTN_TIME_BWD_COMPARE");
  const bool compare = compare_env == nullptr || std::strcmp(compare_env, "0") != 0;
  // Plans read ATTN_CUDA_BWD_SM90 when created: the caller's value (or none)
  // for the default plans, "0" for the comparison.
  const char* sm90_env = std::getenv("ATTN_CUDA_BWD_SM90");
  const std::string caller_choice = sm90_env ? sm90_env : "";
  std::vector<std::string> lines;
  for (const TimingShape& c : shapes) {
    double fwd_ms = 0, bwd_ms[2] = {0, 0};
    attn_plan_info_t info{};
    for (int det = 0; det < 2; ++det) {
      attn_plan_t plan = timing_plan(ctx, c, true, det == 1);
      const attn_plan_info_t plan_info = describe(plan);
      if (det == 0) info = plan_info;  // the default plan's kernels are the table's
      fit_workspace(plan_info);
      double f = 0;
      timer.time([&] { return attn_forward(plan, t.q, t.k, t.v, t.o, t.lse, nullptr, 0, s); },
                 reps, &f);
      if (det == 0) fwd_ms = f;
      timer.time([&] { return backward(plan); }, reps, &bwd_ms[det]);
      attn_plan_destroy(plan);
    }
    const char* tv = std::getenv("ATTN_TIME_VARIANTS");
    if (tv != nullptr && tv[0] == '1' && (c.d == 64 || c.d == 128)) {
      setenv("ATTN_CUDA_BWD_VARIANT", "1", 1);
      attn_plan_t plan = timing_plan(ctx, c, true, false);
      unsetenv("ATTN_CUDA_BWD_VARIANT");
      fit_workspace(describe(plan));
      double v1 = 0;
      timer.time([&] { return backward(plan); }, reps, &v1);
      std::printf("VARIANT1 %" PRId64 " %" PRId64 " %s %.4f %.1f\n", c.d, c.l,
                  c.causal ? "causal" : "full", v1, info.flops_backward / (v1 * 1e-3) / 1e12);
      attn_plan_destroy(plan);
    }
    double sm80_ms = 0;  // 0: not timed (the default plan runs the sm_80 kernel already)
    if (compare && std::strstr(info.kernel, "+bwd-wgmma-") != nullptr) {
      setenv("ATTN_CUDA_BWD_SM90", "0", 1);
      attn_plan_t plan = timing_plan(ctx, c, true, false);
      if (sm90_env != nullptr)
        setenv("ATTN_CUDA_BWD_SM90", caller_choice.c_str(), 1);
      else
        unsetenv("ATTN_CUDA_BWD_SM90");
      fit_workspace(describe(plan));
      timer.time([&] { return backward(plan); }, reps, &sm80_ms);
      std::printf("SM80BWD %" PRId64 " %" PRId64 " %s %.4f %.1f  %s\n", c.d, c.l,
                  c.causal ? "causal" : "full", sm80_ms,
                  info.flops_backward / (sm80_ms * 1e-3) / 1e12, describe(plan).kernel);
      attn_plan_destroy(plan);
    }
    const double tf = info.flops_forward / (fwd_ms * 1e-3) / 1e12;
    const double tb = info.flops_backward / (bwd_ms[0] * 1e-3) / 1e12;
    const double td = info.flops_backward / (bwd_ms[1] * 1e-3) / 1e12;
    std::printf("RESULT %" PRId64 " %" PRId64 " %s %.4f %.1f %.4f %.1f %.4f %.1f\n", c.d, c.l,
                c.causal ? "causal" : "full", fwd_ms, tf, bwd_ms[0], tb, bwd_ms[1], td);
    const double t80 = sm80_ms > 0 ? info.flops_backward / (sm80_ms * 1e-3) / 1e12 : 0.0;
    char line[256];
    std::snprintf(line, sizeof line,
                  "%4" PRId64 " %6" PRId64 " %-6s %5" PRId64 " %5" PRId64
                  " %8.3f %7.1f %8.3f %7.1f %8.3f %7.1f %8.3f %7.1f  %s",
                  c.d, c.l, c.causal ? "causal" : "full", c.batch(), c.heads(), fwd_ms, tf,
                  bwd_ms[0], tb, bwd_ms[1], td, sm80_ms, t80, info.kernel);
    lines.push_back(line);
    std::fflush(stdout);
  }
  std::printf("\nbf16 backward, batch*seqlen = 16K, heads = 2048/d, median of %d runs (ms, TFLOP/s)\n",
              reps);
  std::printf("%4s %6s %-6s %5s %5s %8s %7s %8s %7s %8s %7s %8s %7s  %s\n", "d", "L", "mask",
              "batch", "heads", "fwd", "TF/s", "bwd", "TF/s", "bwd-det", "TF/s", "bwd-sm80", "TF/s",
              "kernels (forward+bwd)");
  for (const auto& l : lines) std::printf("%s\n", l.c_str());
  cudaFree(ws);
  attn_context_destroy(ctx);
  return 0;
}
