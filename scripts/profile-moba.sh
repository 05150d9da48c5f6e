#!/usr/bin/env bash
# Nsight Compute on the kernels of one MoBA plan's forward and backward
# (bench/bench_moba.py, one configuration: by default L = 32K, 16 heads,
# d 128, bf16, blocks of 512 keys, top 3): the selector, the gathered
# forward's round launches and the gathered dK/dV kernel, so that their
# time can be read as memory traffic, occupancy or stalls (with the source
# lines where warps stall most: the library is built with -lineinfo in its
# own build directory). Clocks are left
# alone (--clock-control none), as the benchmark runs. Run from the
# repository root on a machine with a CUDA device, ncu and torch; writes
# $OUT/ncu-moba.txt and prints the headline metrics of each kernel.
#
# Environment: BUILD_DIR (default /tmp/attn-profile-moba-build: its own,
# since profile_build configures a directory only once, and one the other
# profile scripts configured would keep their options, without -lineinfo),
# GPU_ARCHS (sm_90a), OUT, PROFILE_ARGS (bench_moba.py arguments, default
# "--seqlens 32768 --combos 512:3"), PROFILE_KERNELS (an ncu kernel-name
# regex, default "select_kernel|moba_gather"), PROFILE_COUNT (launches
# profiled, default 7: the forward's selection and rounds, the backward's
# selection and dK/dV kernel), PROFILE_SOURCE=1 (also export the report and
# write the source page (source lines and SASS with their stall samples)
# to $OUT/ncu-moba-source.csv, and each kernel's stall reasons and 40
# hottest source lines to $OUT/ncu-moba-hot.txt: scripts/ncu_hot_lines.py).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-/tmp/attn-profile-moba-build}
out=${OUT:-$build/profile}
mkdir -p "$out"
. scripts/profile-build.sh
# -lineinfo: the stall samples (SourceCounters) name source lines.
profile_build "$build" "$out" "" -Dtests=false -Dcuda_args=-lineinfo || exit 1

read -r -a args <<<"${PROFILE_ARGS:---seqlens 32768 --combos 512:3}"
# The sections' bodies (the stall reasons) where this ncu can print them.
details=()
if ncu --help 2>/dev/null | grep -q -- --print-details; then details=(--print-details all); fi
export_args=()
if [ "${PROFILE_SOURCE:-0}" = 1 ]; then export_args=(-f -o "$out/ncu-moba"); fi
ncu --clock-control none "${export_args[@]}" "${details[@]}" --kernel-name "regex:${PROFILE_KERNELS:-select_kernel|moba_gather}" \
  --launch-count "${PROFILE_COUNT:-7}" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section SourceCounters --import-source no \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum \
  python3 bench/bench_moba.py --lib "$build/src/libattn.so" --reps 1 --variant "" "${args[@]}" \
  >"$out/ncu-moba.txt" 2>&1
rc=$?
grep -E "^  [a-zA-Z_].*\(([0-9]+, ){2}[0-9]+\)x|Duration|DRAM Throughput|dram__bytes_(read|write).sum|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Grid Size|Dynamic Shared|Eligible Warps|Issued Warp|No Eligible|Warp Cycles Per Issued|[Ss]tall" \
  "$out/ncu-moba.txt" | head -150
if [ "${PROFILE_SOURCE:-0}" = 1 ] && [ -f "$out/ncu-moba.ncu-rep" ]; then
  # The exported report printed again (the text above comes from the run).
  ncu -i "$out/ncu-moba.ncu-rep" --page source --csv --print-source sass,cuda \
    >"$out/ncu-moba-source.csv" 2>&1 ||
    ncu -i "$out/ncu-moba.ncu-rep" --page source --csv --print-source sass \
      >"$out/ncu-moba-source.csv" 2>&1
  python3 scripts/ncu_hot_lines.py "$out/ncu-moba-source.csv" 40 >"$out/ncu-moba-hot.txt" 2>&1
  head -120 "$out/ncu-moba-hot.txt"
fi
exit $rc
