#!/usr/bin/env bash
# Nsight Compute on one paged decode call of libattn and one of PyTorch's
# cuDNN SDPA on the same K/V (bench/profile_decode.py: batch 32 x 8K, bf16,
# d 128, 32/8 heads, pages of 16 tokens, HND), so that the gap in KV bytes per
# second can be read as DRAM traffic, occupancy or stalls. Clocks are left
# alone (--clock-control none), as the benchmark runs. Run from the
# repository root on a machine with a CUDA device, ncu and torch; writes
# $OUT/ncu-decode.txt and prints the headline metrics of each kernel.
#
# Environment: BUILD_DIR (default /tmp/attn-profile-decode-build), GPU_ARCHS
# (sm_90a), OUT, PROFILE_ARGS (e.g. "--batch 4 --context 65536").
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-/tmp/attn-profile-decode-build}
out=${OUT:-$build/profile}
mkdir -p "$out"
. scripts/profile-build.sh
profile_build "$build" "$out" "" -Dtests=false || exit 1

read -r -a extra <<<"${PROFILE_ARGS:-}"
ncu --profile-from-start off --clock-control none \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct \
  python3 bench/profile_decode.py --lib "$build/src/libattn.so" "${extra[@]}" >"$out/ncu-decode.txt" 2>&1
rc=$?
grep -E "profiled, in order" "$out/ncu-decode.txt"
# Per kernel: its name line, then the headline rows.
grep -E "^  [a-zA-Z_].*\(([0-9]+, ){2}[0-9]+\)x|Duration|DRAM Throughput|dram__bytes_read.sum|Memory Throughput|L2 Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Grid Size|Block Size|Dynamic Shared|Eligible Warps|Issued Warp|No Eligible|lts__t_sector_op_read_hit_rate" \
  "$out/ncu-decode.txt" | head -80
exit $rc
