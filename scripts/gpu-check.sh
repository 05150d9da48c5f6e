#!/usr/bin/env bash
# The GPU check, run on a machine with a CUDA device from the repository root:
# builds libattn for the device, reports the kernels' registers and spills,
# runs the GPU test suite (forward and backward), compute-sanitizer on small
# cases, then times the forward and backward kernels next to PyTorch's
# FlashAttention-2 and cuDNN SDPA backends (same shapes, same process
# family) when torch is importable, and prints a short table last.
#
# Environment:
#   BUILD_DIR            build directory (default /tmp/attn-gpu-build)
#   GPU_ARCHS            meson gpu_archs (default sm_90a)
#   GPU_CHECK_TESTS      meson test names to run (default: the whole gpu suite)
#   GPU_CHECK_SANITIZE   0 skips compute-sanitizer (forward, backward and decode tests)
#   GPU_CHECK_SANITIZE_MATCH  an extended regex: only the sanitizer runs whose
#                        TOOL_NAME (e.g. racecheck_moba_sm90) matches it
#   GPU_CHECK_TORCH      0 skips the PyTorch reference timing
#   GPU_CHECK_TIMING     0 skips all timing
#   GPU_CHECK_VARIANTS   1 also times the d=64 and d=128 backward variants of sm_80-sized devices
#   GPU_CHECK_NCU        1 profiles the dK/dV kernel (d=128, L=8K, full) with Nsight
#                        Compute (clocks left alone) into $logs/ncu.txt
#   GPU_CHECK_BENCH_MOBA arguments of bench/bench_moba.py (e.g. '--seqlens 32768 --variant ""
#                        --variant ATTN_CUDA_MOBA_GATHER_BWD_SM90=0 --kernels'): run after
#                        the tests on this build, its table in $logs/moba.md and in the summary
#   GPU_CHECK_BENCH_SPARSE arguments of bench/bench_sparse_flex.py (e.g. '--dense-variants
#                        --variant "" --variant ATTN_CUDA_FWD_SM90_WS=0'): likewise, its table
#                        in $logs/sparse.md and in the summary
#   OUT                  when set, logs go there (else $BUILD_DIR/logs)
# On a machine without CMocka installed, an unpacked copy in .deps/ (its
# pkg-config file in .deps/pc, the library in .deps/lib) is used when present.
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
# Only what this check runs: the GPU suite's programs (as meson lists them,
# so that a test added later is built too) and the timing programs.
targets=$(meson introspect "$build" --tests | python3 -c '
import json, os, sys
build = sys.argv[1]
progs = {os.path.relpath(t["cmd"][0], build) for t in json.load(sys.stdin)
         if any(s.endswith(":gpu") for s in t["suite"]) and t["cmd"][0].startswith(build)}
print(" ".join(sorted(progs)))' "$(cd "$build" && pwd)")
targets="$targets tests/gpu/time_flash_fwd tests/gpu/time_flash_bwd"
if ! ninja -C "$build" $targets >"$logs/build.log" 2>&1; then
  grep -E "error|FAILED" -A4 "$logs/build.log" | head -80
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
grep -i "spill" "$logs/build.log" | sort -u | head -10

step "kernel resources (registers, stack, local memory)"
lib="$build/src/libattn.so"
if command -v cuobjdump >/dev/null; then
  # one line per kernel: mangled name suffix, then REG/STACK/SHARED/LOCAL
  cuobjdump -res-usage "$lib" 2>/dev/null | grep --no-group-separator -A1 -E "flash_(fwd|bwd)" |
    sed -E 's/.*Function _ZN4attn5flash[0-9]+(flash_[a-z_]+)I([^:]*):.*/\1 \2/; s/^[[:space:]]+//' |
    paste - - | tee "$logs/resources.txt"
  spills=$(cuobjdump -sass "$lib" 2>/dev/null | grep -cE '\b(LDL|STL)\b' || true)
  echo "local-memory instructions (LDL/STL) in SASS: $spills"
  summary+=("LDL/STL instructions in kernels: $spills")
fi

step "GPU test suite"
meson test -C "$build" --no-rebuild --suite gpu --print-errorlogs --verbose ${GPU_CHECK_TESTS:-} \
  2>&1 | tee "$logs/test.log" | grep -vE "^ *(atomic|det) " |
  grep -E "^(ok|FAIL|seed|PASS|[0-9]+/)|FAIL|Ok:|Fail:|Skipped:|[Ee]rror"
test_rc=${PIPESTATUS[0]}
grep -E "^FAIL" -A2 "$logs/test.log" | head -40
summary+=("meson test --suite gpu ${GPU_CHECK_TESTS:-}: $([ "$test_rc" = 0 ] && echo PASS || echo "FAIL ($test_rc)")")

# sanitize TOOL NAME BIN [VAR=value ...]: one compute-sanitizer run of a GPU
# test program under the given environment, logged to $logs/TOOL_NAME.log.
sanitize() {
  local tool=$1 name=$2 bin=$3
  shift 3
  [[ "${tool}_$name" =~ ${GPU_CHECK_SANITIZE_MATCH:-.} ]] || return 0
  step "compute-sanitizer $tool, $name"
  env "$@" compute-sanitizer --tool "$tool" --error-exitcode 3 "$bin" \
    >"$logs/${tool}_$name.log" 2>&1
  local rc=$?
  tail -3 "$logs/${tool}_$name.log"
  summary+=("compute-sanitizer $tool $name: $([ $rc = 0 ] && echo clean || echo "FAIL ($rc)")")
}

if [ "${GPU_CHECK_SANITIZE:-1}" != 0 ] && command -v compute-sanitizer >/dev/null; then
  # Dense: small cases; races on causal L=129 at every head dim.
  for t in fwd bwd; do
    bin="$build/tests/gpu/test_flash_$t"
    sanitize memcheck "$t" "$bin" ATTN_GPU_TEST_QUICK=1
    sanitize racecheck "$t" "$bin" ATTN_GPU_TEST_FILTER=causal-L129
  done
  # The one-tile sm_90a forward (the defaults run the warp-specialised one).
  sanitize memcheck fwd_onetile "$build/tests/gpu/test_flash_fwd" ATTN_GPU_TEST_QUICK=1 \
    ATTN_CUDA_FWD_SM90_WS=0
  # The sm_90a forward's 128-row d = 64 tile (the estimate picks 192 rows
  # for most small cases), softcap cases included.
  sanitize memcheck fwd_bm128 "$build/tests/gpu/test_flash_fwd" ATTN_GPU_TEST_QUICK=1 \
    ATTN_CUDA_FWD_SM90_BM=128 ATTN_GPU_TEST_HEAD_DIM=64
  sanitize racecheck fwd_bm128 "$build/tests/gpu/test_flash_fwd" ATTN_CUDA_FWD_SM90_BM=128 \
    ATTN_GPU_TEST_HEAD_DIM=64 ATTN_GPU_TEST_FILTER=causal-L129
  # Decode, on each kernel variant with the balanced split (its runs use
  # the split kernels, its unsplit and fixed cases the others): every case
  # with the long sequences shortened (memcheck); the long single sequence
  # (unsplit, split in ~190 chunks and automatic: the pipeline's shared
  # memory, the bulk copies' mbarriers, the combine's reductions) for
  # races, the sm_90 one with both pipelines; on the sm_90 one also the
  # page-1 cases (per-row bulk copies, stand-in rows) and long + short
  # sequences (several units per block).
  bin="$build/tests/gpu/test_kv_decode_gpu"
  for kernel in sm80 sm90-bulk sm90-bulk32 sm90-tensor; do
    sanitize memcheck "decode_$kernel" "$bin" ATTN_CUDA_DECODE_KERNEL=$kernel \
      ATTN_CUDA_DECODE_SPLIT=balanced ATTN_GPU_TEST_QUICK=1
  done
  for run in sm80:2 sm90-bulk:2 sm90-bulk:3 sm90-bulk32:2 sm90-tensor:2 sm90-tensor:3; do
    kernel=${run%:*} stages=${run#*:}
    sanitize racecheck "decode_${kernel}_s$stages" "$bin" ATTN_CUDA_DECODE_KERNEL=$kernel \
      ATTN_CUDA_DECODE_SPLIT=balanced ATTN_CUDA_DECODE_STAGES=$stages ATTN_GPU_TEST_QUICK=1 \
      "ATTN_GPU_TEST_FILTER=one long sequence"
  done
  for kernel in sm90-bulk sm90-bulk32; do
    sanitize racecheck "decode_${kernel}_p1" "$bin" ATTN_CUDA_DECODE_KERNEL=$kernel \
      ATTN_GPU_TEST_QUICK=1 "ATTN_GPU_TEST_FILTER= p1 d128"
  done
  for kernel in sm90-bulk sm90-bulk32 sm90-tensor; do
    sanitize racecheck "decode_${kernel}_units" "$bin" ATTN_CUDA_DECODE_KERNEL=$kernel \
      ATTN_CUDA_DECODE_SPLIT=balanced ATTN_GPU_TEST_QUICK=1 "ATTN_GPU_TEST_FILTER=long + short"
  done
  # The tensor copies on a token-major pool with several KV heads (strided
  # rows), and the window + sinks cases (pages of 16 and 24 slots; the one
  # of 13 runs the bulk copies).
  sanitize racecheck decode_sm90-tensor_nhd "$bin" ATTN_CUDA_DECODE_KERNEL=sm90-tensor \
    ATTN_GPU_TEST_QUICK=1 "ATTN_GPU_TEST_FILTER=NHD p16 d128 GQA1"
  sanitize racecheck decode_sm90-tensor_windows "$bin" ATTN_CUDA_DECODE_KERNEL=sm90-tensor \
    ATTN_GPU_TEST_QUICK=1 "ATTN_GPU_TEST_FILTER=sinks"
  # Block-sparse: every case (tile lists with full, masked and bit-tile
  # entries, cut dK/dV lists), on both backward paths, the second one with
  # the sm_80 forward (the first runs the sm_90a one on sm_90 devices, and
  # the sm_90a (wgmma) dK/dV kernel at d = 64 and 128 without softcap);
  # races on the small causal GQA cases (d = 64, 128, 256).
  bin="$build/tests/gpu/test_block_sparse_gpu"
  sanitize memcheck sparse "$bin"
  sanitize memcheck sparse_fallback "$bin" ATTN_CUDA_BWD_VARIANT=1 ATTN_CUDA_BWD_GROUP_SPLIT=2 \
    ATTN_CUDA_FWD_SM90=0
  sanitize racecheck sparse "$bin" ATTN_GPU_TEST_FILTER=-causal-gqa
  # The sm_80 block-sparse dK/dV kernel where the default is the wgmma one.
  sanitize memcheck sparse_sm80bwd "$bin" ATTN_CUDA_BWD_SM90_SPARSE=0
  sanitize racecheck sparse_sm80bwd "$bin" ATTN_CUDA_BWD_SM90_SPARSE=0 \
    ATTN_GPU_TEST_FILTER=-causal-gqa
  # MoBA on the sm_90a (wgmma) kernels (ATTN_CUDA_MOBA_SM90=1; sm_90 devices,
  # d = 64 and 128: the tile-union lists in both passes), on the cases of GQA
  # groups of 4 over 2 KV heads (both head dims, shared and per-head
  # selection, one with lq < lk); then with the sm_80 dK/dV kernel on the
  # same lists, and the sm_80 gathered kernels (gathered rows: the default
  # path off sm_90, which the wgmma ones replace on it at d = 64 and 128);
  # races on the shared-selection ones.
  bin="$build/tests/gpu/test_moba_gpu"
  sm80_gather=(ATTN_CUDA_MOBA_GATHER_SM90=0 ATTN_CUDA_MOBA_GATHER_BWD_SM90=0)
  sanitize memcheck moba_sm90 "$bin" ATTN_CUDA_MOBA_SM90=1 ATTN_GPU_TEST_FILTER=gqa4/2
  sanitize racecheck moba_sm90 "$bin" ATTN_CUDA_MOBA_SM90=1 ATTN_GPU_TEST_FILTER=shared-gqa4/2
  sanitize memcheck moba_sm90_sm80bwd "$bin" ATTN_CUDA_MOBA_SM90=1 ATTN_CUDA_BWD_SM90=0 \
    ATTN_GPU_TEST_FILTER=gqa4/2
  sanitize memcheck moba "$bin" "${sm80_gather[@]}" ATTN_GPU_TEST_FILTER=shared-gqa4/2
  # The sm_80 gathered kernels on the case of 66 blocks (the selector's
  # chunks of 64 blocks, the forward's round lists), and races on a
  # per-head GQA case (lists of several heads; all of them take minutes
  # under racecheck).
  sanitize memcheck moba_66_blocks "$bin" "${sm80_gather[@]}" ATTN_GPU_TEST_FILTER=66-blocks
  sanitize racecheck moba_per_head "$bin" "${sm80_gather[@]}" \
    ATTN_GPU_TEST_FILTER=top6-per-head-gqa4
  # The same on the gathered wgmma kernels (the one-tile forward; named
  # here so that the runs stay what they say if the defaults change).
  sanitize memcheck moba_gather_sm90 "$bin" ATTN_CUDA_MOBA_GATHER_SM90=1 ATTN_CUDA_MOBA_GATHER_WS=0 \
    ATTN_CUDA_MOBA_GATHER_BWD_SM90=1 ATTN_GPU_TEST_FILTER=66-blocks
  # (Whole groups: the dK/dV kernel with dQ walks both heads of a group.)
  sanitize racecheck moba_gather_sm90 "$bin" ATTN_CUDA_MOBA_GATHER_SM90=1 ATTN_CUDA_MOBA_GATHER_WS=0 \
    ATTN_CUDA_MOBA_GATHER_BWD_SM90=1 ATTN_CUDA_BWD_GROUP_SPLIT=1 \
    ATTN_GPU_TEST_FILTER=top6-per-head-gqa4
  sanitize memcheck moba_gather_sm90_gqa "$bin" ATTN_CUDA_MOBA_GATHER_SM90=1 ATTN_CUDA_MOBA_GATHER_WS=0 \
    ATTN_CUDA_MOBA_GATHER_BWD_SM90=1 ATTN_GPU_TEST_FILTER=gqa4/2
  # The gathered rounds on the warp-specialised forward (the default on sm_90).
  sanitize memcheck moba_gather_ws "$bin" ATTN_CUDA_MOBA_GATHER_WS=1 \
    ATTN_GPU_TEST_FILTER=66-blocks
  sanitize racecheck moba_gather_ws "$bin" ATTN_CUDA_MOBA_GATHER_WS=1 \
    ATTN_GPU_TEST_FILTER=top6-per-head-gqa4
  sanitize synccheck moba_gather_ws "$bin" ATTN_CUDA_MOBA_GATHER_WS=1 \
    ATTN_GPU_TEST_FILTER=top6-per-head-gqa4
  # The CUDA ring plan (its token maps, permutations, merges and
  # accumulations; exchanges from 2 GPUs on), both dK/dV schedules.
  if [ -x "$build/tests/gpu/test_ring_nccl" ]; then
    sanitize memcheck ring "$build/tests/gpu/test_ring_nccl"
    sanitize memcheck ring_dkv_exchange "$build/tests/gpu/test_ring_nccl" ATTN_RING_DKV_HOME=0
  fi
fi

torch_out=""
if [ "${GPU_CHECK_TIMING:-1}" != 0 ]; then
  step "timing: libattn forward and backward"
  # The default shapes plus the rest of L = 1K..16K at d = 64 and 128.
  ATTN_TIME_VARIANTS=${GPU_CHECK_VARIANTS:-0} "$build/tests/gpu/time_flash_bwd" \
    64,1024,0 64,1024,1 128,1024,0 128,1024,1 64,16384,0 64,16384,1 128,16384,0 2>&1 |
    tee "$logs/timing.log" | grep -v "^RESULT"

  if [ "${GPU_CHECK_TORCH:-1}" != 0 ] && python3 -c "import torch" 2>/dev/null; then
    step "timing: PyTorch SDPA FlashAttention-2 and cuDNN backends (same shapes)"
    python3 - >"$logs/torch.log" 2>&1 <<'PY'
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
sdpa = torch.nn.functional.scaled_dot_product_attention

def median_ms(f, reps=20):
    for _ in range(3):
        f()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); f(); e1.record(); e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    ts.sort()
    return ts[len(ts) // 2]

configs = [(d, L, c) for d in (64, 128) for L in (1024, 2048, 8192, 16384) for c in (False, True)]
for d, L, causal in configs:
    b, h = max(1, 16384 // L), 2048 // d
    # BSHD memory, as libattn's timing uses; leaves that require grad
    q, k, v = (torch.randn(b, L, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .detach().requires_grad_() for _ in range(3))
    pairs = b * h * (L * (L + 1) // 2 if causal else L * L)
    fl_f = 4 * pairs * d
    fl_b = 2.5 * fl_f
    for name, backend in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                with torch.no_grad():
                    tf = median_ms(lambda: sdpa(q, k, v, is_causal=causal))
                out = sdpa(q, k, v, is_causal=causal)
                g = torch.randn_like(out)
                tb = median_ms(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
            print(f"TORCH {name} {d} {L} {'causal' if causal else 'full'} {tf:.4f} {fl_f / tf / 1e9:.1f} "
                  f"{tb:.4f} {fl_b / tb / 1e9:.1f}", flush=True)
            del out, g
        except Exception as e:  # a backend that refuses the shape
            print(f"TORCH {name} {d} {L} {'causal' if causal else 'full'} nan nan nan nan  # {e}",
                  flush=True)
    del q, k, v
    torch.cuda.empty_cache()
PY
    grep -v "^TORCH" "$logs/torch.log" | tail -5
    torch_out=$(grep "^TORCH" "$logs/torch.log")
  fi
fi

# bench_on_build SCRIPT NAME ARGS: one of bench/'s Python benchmarks on this
# build, its table in $logs/NAME.md (eval: ARGS may hold quoted empty variants).
bench_on_build() {
  local script=$1 name=$2 args=$3
  step "benchmark: $script $args"
  eval "python3 bench/$script --lib '$build/src/libattn.so' --out '$logs/$name.md' $args" \
    >"$logs/$name.log" 2>&1
  summary+=("$script: $([ $? = 0 ] && echo "done ($logs/$name.md)" || echo FAILED)")
  tail -3 "$logs/$name.log"
}
[ -n "${GPU_CHECK_BENCH_MOBA:-}" ] && bench_on_build bench_moba.py moba "$GPU_CHECK_BENCH_MOBA"
[ -n "${GPU_CHECK_BENCH_SPARSE:-}" ] && bench_on_build bench_sparse_flex.py sparse "$GPU_CHECK_BENCH_SPARSE"

if [ "${GPU_CHECK_NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  step "Nsight Compute: dK/dV kernel, d=128, L=8K, full"
  ATTN_TIME_ONLY=1 ATTN_TIME_REPS=3 ncu --clock-control none --kernel-name regex:flash_bwd_dkdv \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    "$build/tests/gpu/time_flash_bwd" 128,8192,0 >"$logs/ncu.txt" 2>&1
  grep -E "Duration|Throughput|Issued|Eligible|Frequency" "$logs/ncu.txt" | head -12
  # stall reasons (warps per issued instruction), largest first
  grep -E "issue_stalled" "$logs/ncu.txt" | awk '{print $NF, $1}' | sort -rn | head -12
fi

step "summary"
for s in "${summary[@]}"; do echo "$s"; done
if [ -f "$logs/moba.md" ]; then
  echo
  grep -E "^\| (L|[0-9]+) \|" "$logs/moba.md" | grep -v " fwd | \| bwd | " | head -40
fi
if [ -f "$logs/sparse.md" ]; then
  echo
  grep -E "^\| (mask|causal|window|random|bigbird)" "$logs/sparse.md" | cut -d"|" -f2,5,6,11,12,13,14
fi
if [ -f "$logs/timing.log" ]; then
  echo
  echo "bf16, batch*seqlen = 16K, heads = 2048/d: TFLOP/s (fwd 4*pairs*d, bwd 2.5x); ratio = libattn bwd / other bwd"
  python3 - "$logs/timing.log" <<PY
import sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if f and f[0] == "RESULT":
        rows[(f[1], f[2], f[3])] = {"attn": (float(f[5]), float(f[7])), "det": float(f[9])}
for line in """$torch_out""".splitlines():
    f = line.split()
    if len(f) >= 9 and f[0] == "TORCH" and (f[2], f[3], f[4]) in rows:
        rows[(f[2], f[3], f[4])][f[1]] = (float(f[6]), float(f[8]))
print(f"{'d':>4} {'L':>6} {'mask':6} | {'attn fwd':>8} {'bwd':>6} {'bwd-det':>7} | {'FA2 fwd':>7} {'bwd':>6} | {'cuDNN fwd':>9} {'bwd':>6} | {'bwd/FA2':>7} {'bwd/cuDNN':>9}")
for (d, L, m), r in rows.items():
    a = r["attn"]; fa = r.get("fa2", (float("nan"),) * 2); cu = r.get("cudnn", (float("nan"),) * 2)
    print(f"{d:>4} {L:>6} {m:6} | {a[0]:8.1f} {a[1]:6.1f} {r['det']:7.1f} | {fa[0]:7.1f} {fa[1]:6.1f} | "
          f"{cu[0]:9.1f} {cu[1]:6.1f} | {a[1] / fa[1]:7.2f} {a[1] / cu[1]:9.2f}")
PY
fi
[ "$test_rc" = 0 ]
