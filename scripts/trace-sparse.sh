#!/usr/bin/env bash
# Where the sm_90a kernels' work items spend their time, on the masks of
# bench/bench_sparse_flex.py: builds the library with -DATTN_FWD_WS_TRACE=1
# and -DATTN_BWD_SM90_TRACE=1 in its own build directory and runs each mask
# once without FlexAttention. Each launch then prints:
#   ws-trace   the warp-specialised forward (flash/fwd_sm90_ws_kernel.cuh,
#              ws::Trace): three blocks' cycles per item by phase (Q and
#              record, first K tile, S_0, first softmax, the steps j >= 1
#              and per step, last P V, epilogue: staging, the warpgroup's
#              barrier, stores), and how far apart the two
#              consumer warpgroups issue their steps' S GEMMs, and the
#              block's clock cycles over its nanoseconds (the SM clock
#              it ran at: the GPU throttles under load)
#   bwd-trace  the sm_90a dK/dV kernel (flash/bwd_sm90_kernel.cuh,
#              bwd_sm90::Trace): all blocks' average cycles per item by
#              phase (start, first loads, iterations and per iteration, end:
#              loads drained and the last dQ reduction, dK/dV staged, stored)
# Run from the repository root on a machine with an sm_90 device and torch;
# writes $OUT/trace-sparse.txt and prints the trace lines under their masks.
#
# Environment: BUILD_DIR (default /tmp/attn-trace-build), GPU_ARCHS
# (sm_90a), OUT, TRACE_MASKS (default "causal,window-sinks,random,bigbird"),
# TRACE_VARIANT (a bench_sparse_flex.py --variant, default ""),
# TRACE_DEFINES (more device-code macros, comma-separated NAME=VALUE, e.g.
# ATTN_FWD_WS_DENSE_END=2; give each set its own BUILD_DIR), TRACE_LIB (a
# trace library built elsewhere, e.g. by scripts/prebuild-variants.sh with
# the two TRACE macros: no build here, TRACE_DEFINES unused).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-/tmp/attn-trace-build}
out=${OUT:-$build/trace}
mkdir -p "$out"
defs="'-DATTN_FWD_WS_TRACE=1','-DATTN_BWD_SM90_TRACE=1'"
if [ -n "${TRACE_DEFINES:-}" ]; then
  IFS=, read -r -a extra <<<"$TRACE_DEFINES"
  defs="$defs$(printf ",'-D%s'" "${extra[@]}")"
fi
lib=${TRACE_LIB:-$build/src/libattn.so}
if [ -z "${TRACE_LIB:-}" ]; then
  . scripts/profile-build.sh
  profile_build "$build" "$out" "" -Dtests=false "-Dcuda_args=[$defs]" || exit 1
fi
# stdbuf: the kernels' printf output leaves through the C library's stdout,
# fully buffered into a file, and must stay in order with Python's rows.
linebuf=()
command -v stdbuf >/dev/null && linebuf=(stdbuf -oL)
"${linebuf[@]}" python3 bench/bench_sparse_flex.py --lib "$lib" --no-flex --reps 1 \
  --masks "${TRACE_MASKS:-causal,window-sinks,random,bigbird}" --variant "${TRACE_VARIANT:-}" \
  >"$out/trace-sparse.txt" 2>&1
rc=$?
# A plan's row (printed once it is timed) follows its launches' lines.
grep -E "^(ws|bwd)-trace|^\{'mask'" "$out/trace-sparse.txt" |
  sed -E "s/^\{'mask': '([^']*)'.*/== \1 (the lines above)/"
exit $rc
