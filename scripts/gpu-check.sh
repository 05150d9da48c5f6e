#!/usr/bin/env bash
# The GPU check, run on a machine with a CUDA device from the repository root:
# builds libattn for the device, reports the kernels' registers and spills,
# runs the GPU test suite, compute-sanitizer on small cases, then times the
# forward kernel (and PyTorch's FlashAttention-2 backend for reference when
# torch is importable) and prints a short table last.
#
# Environment:
#   BUILD_DIR            build directory (default /tmp/attn-gpu-build)
#   GPU_ARCHS            meson gpu_archs (default sm_90a)
#   GPU_CHECK_SANITIZE   0 skips compute-sanitizer
#   GPU_CHECK_TORCH      0 skips the PyTorch reference timing
#   OUT                  when set, logs go there (else $BUILD_DIR/logs)
# A .deps/ folder (../shared/tools/device-deps.sh) supplies CMocka where the
# machine lacks it.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${BUILD_DIR:-/tmp/attn-gpu-build}
archs=${GPU_ARCHS:-sm_90a}
logs=${OUT:-$build/logs}
mkdir -p "$logs"
if [ -d .deps/pc ]; then
  export PKG_CONFIG_PATH=$root/.deps/pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$root/.deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
summary=()
step() { echo; echo "== $* ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"

step "configure and build for $archs"
if [ ! -f "$build/build.ninja" ]; then
  if ! meson setup "$build" -Dgpu_archs="$archs" -Dbench=disabled -Dexamples=false \
      >"$logs/setup.log" 2>&1; then
    tail -40 "$logs/setup.log"
    exit 1
  fi
fi
start=$(date +%s)
# Only what this check runs: other targets need not build for it to work.
if ! ninja -C "$build" tests/gpu/test_flash_fwd tests/gpu/time_flash_fwd >"$logs/build.log" 2>&1; then
  grep -E "error|FAILED" -A4 "$logs/build.log" | head -80
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s"

step "kernel resources (registers, stack, local memory)"
lib="$build/src/libattn.so"
if command -v cuobjdump >/dev/null; then
  # one line per kernel: mangled <T, D> suffix, then REG/STACK/SHARED/LOCAL
  cuobjdump -res-usage "$lib" 2>/dev/null | grep --no-group-separator -A1 "flash_fwd_kernel" |
    sed -E 's/.*Function _ZN4attn5flash16flash_fwd_kernelI([^:]*):.*/\1/; s/^[[:space:]]+//' |
    paste - - | tee "$logs/resources.txt"
  spills=$(cuobjdump -sass "$lib" 2>/dev/null | grep -cE '\b(LDL|STL)\b' || true)
  echo "local-memory instructions (LDL/STL) in SASS: $spills"
  summary+=("LDL/STL instructions in kernels: $spills")
fi

step "GPU test suite"
meson test -C "$build" --no-rebuild --suite gpu --print-errorlogs --verbose 2>&1 | tee "$logs/test.log"
test_rc=${PIPESTATUS[0]}
summary+=("meson test --suite gpu: $([ "$test_rc" = 0 ] && echo PASS || echo "FAIL ($test_rc)")")

test_bin="$build/tests/gpu/test_flash_fwd"
if [ "${GPU_CHECK_SANITIZE:-1}" != 0 ] && command -v compute-sanitizer >/dev/null; then
  step "compute-sanitizer memcheck (small cases)"
  ATTN_GPU_TEST_QUICK=1 compute-sanitizer --tool memcheck --error-exitcode 3 "$test_bin" \
    >"$logs/memcheck.log" 2>&1
  rc=$?
  tail -4 "$logs/memcheck.log"
  summary+=("compute-sanitizer memcheck: $([ $rc = 0 ] && echo clean || echo "FAIL ($rc)")")
  step "compute-sanitizer racecheck (causal L=129, every head dim)"
  ATTN_GPU_TEST_FILTER=causal-L129 compute-sanitizer --tool racecheck --error-exitcode 3 \
    "$test_bin" >"$logs/racecheck.log" 2>&1
  rc=$?
  tail -3 "$logs/racecheck.log"
  summary+=("compute-sanitizer racecheck: $([ $rc = 0 ] && echo clean || echo "FAIL ($rc)")")
fi

step "timing: libattn forward"
"$build/tests/gpu/time_flash_fwd" 2>&1 | tee "$logs/timing.log"

torch_table=""
if [ "${GPU_CHECK_TORCH:-1}" != 0 ] && python3 -c "import torch" 2>/dev/null; then
  step "timing: PyTorch SDPA FlashAttention-2 backend (same shapes)"
  torch_table=$(python3 - <<'PY' 2>&1 | tee "$logs/torch.log"
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
rows = []
for d, L, causal in [(64, 8192, False), (128, 8192, False), (128, 16384, True)]:
    b, h = max(1, 16384 // L), 2048 // d
    q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    pairs = b * h * (L * (L + 1) // 2 if causal else L * L)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for _ in range(3):
            f()
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); f(); e1.record(); e1.synchronize()
            ts.append(e0.elapsed_time(e1))
    ts.sort()
    med = ts[len(ts) // 2]
    rows.append(f"{d:4d} {L:6d} {'causal' if causal else 'full':6s} {med:9.3f} {4 * pairs * d / med / 1e9:8.1f}  torch-sdpa-flash")
print("\n".join(rows))
PY
)
fi

step "summary"
for s in "${summary[@]}"; do echo "$s"; done
echo
grep -A20 "^bf16 forward" "$logs/timing.log" || true
if [ -n "$torch_table" ]; then
  echo "PyTorch FA2 (same machine, same shapes):"
  printf '%4s %6s %-6s %9s %8s\n' d L mask "ms(med)" TFLOP/s
  echo "$torch_table" | grep -E "^ *[0-9]" || echo "$torch_table" | tail -3
fi
[ "$test_rc" = 0 ]
