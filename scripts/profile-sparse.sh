#!/usr/bin/env bash
# Nsight Compute on the block-sparse forward of one mask of
# bench/bench_sparse_flex.py (L = 32K, 16 heads, d 128, bf16, causal; by
# default BigBird and the random mask, one launch each): memory traffic,
# L2 hit rate, occupancy, warp stalls, and the source lines where warps
# stall most (the library is built with -lineinfo in its own build
# directory). Clocks are left alone (--clock-control none), as the
# benchmark runs. Run from the repository root on a machine with a CUDA
# device, ncu and torch; writes $OUT/ncu-sparse-MASK.txt (the sections) and
# $OUT/ncu-sparse-hot.txt (per mask: stall reasons and hottest lines,
# scripts/ncu_hot_lines.py) and prints the headline metrics.
#
# Environment: BUILD_DIR (default /tmp/attn-profile-sparse-build),
# GPU_ARCHS (sm_90a), OUT, PROFILE_MASKS (default "bigbird random"),
# PROFILE_KERNELS (an ncu kernel-name regex, default the forward's kernels:
# "flash_fwd"), PROFILE_VARIANT (a bench_sparse_flex.py --variant, default
# "": the library's defaults), PROFILE_HOT (lines listed per mask, 40).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-/tmp/attn-profile-sparse-build}
out=${OUT:-$build/profile}
mkdir -p "$out"
. scripts/profile-build.sh
# -lineinfo: the stall samples (SourceCounters) name source lines.
profile_build "$build" "$out" "" -Dtests=false -Dcuda_args=-lineinfo || exit 1

details=()
if ncu --help 2>/dev/null | grep -q -- --print-details; then details=(--print-details all); fi
rc=0
: >"$out/ncu-sparse-hot.txt"
for mask in ${PROFILE_MASKS:-bigbird random}; do
  ncu --clock-control none -f -o "$out/ncu-sparse-$mask" "${details[@]}" \
    --kernel-name "regex:${PROFILE_KERNELS:-flash_fwd}" --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section SourceCounters --import-source no \
    --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
    python3 bench/bench_sparse_flex.py --lib "$build/src/libattn.so" --no-flex --reps 1 \
    --masks "$mask" --variant "${PROFILE_VARIANT:-}" >"$out/ncu-sparse-$mask.txt" 2>&1 || rc=1
  # -o keeps the sections out of the run's output: print them from the report.
  [ -f "$out/ncu-sparse-$mask.ncu-rep" ] &&
    ncu -i "$out/ncu-sparse-$mask.ncu-rep" --page details "${details[@]}" >>"$out/ncu-sparse-$mask.txt" 2>&1
  echo "== $mask"
  grep -E "^  [a-zA-Z_].*\(([0-9]+, ){2}[0-9]+\)x|Duration|DRAM Throughput|dram__bytes_read.sum|L2 Hit|lts__t_sector_hit|Compute \(SM\) Throughput|Achieved Occupancy|Eligible Warps|Issued Warp|No Eligible|Warp Cycles Per Issued" \
    "$out/ncu-sparse-$mask.txt" | head -30
  if [ -f "$out/ncu-sparse-$mask.ncu-rep" ]; then
    ncu -i "$out/ncu-sparse-$mask.ncu-rep" --page source --csv --print-source sass,cuda \
      >"$out/ncu-sparse-source.csv" 2>&1 ||
      ncu -i "$out/ncu-sparse-$mask.ncu-rep" --page source --csv --print-source sass \
        >"$out/ncu-sparse-source.csv" 2>&1
    { echo "### $mask"; python3 scripts/ncu_hot_lines.py "$out/ncu-sparse-source.csv" "${PROFILE_HOT:-40}"; } \
      >>"$out/ncu-sparse-hot.txt" 2>&1
    rm -f "$out/ncu-sparse-source.csv" "$out/ncu-sparse-$mask.ncu-rep"
  fi
done
cat "$out/ncu-sparse-hot.txt" | head -150
exit $rc
