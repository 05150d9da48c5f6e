#!/usr/bin/env bash
# Where the warp-specialised sm_90a forward's items spend their time: builds
# the library with -DATTN_FWD_WS_TRACE=1 in its own build directory (one
# consumer thread of each block sums clock cycles per phase of its items and
# three blocks print the averages at exit: the item's Q and record, its
# first K tile, S_0, the first softmax, the steps j >= 1 (and per step), the
# last P V, the epilogue; flash/fwd_sm90_ws_kernel.cuh, ws::Trace), then runs
# bench/bench_sparse_flex.py's masks once each without FlexAttention. Run
# from the repository root on a machine with an sm_90 device and torch;
# writes $OUT/trace-fwd-ws.txt and prints the trace lines with the masks.
#
# Environment: BUILD_DIR (default /tmp/attn-trace-fwd-ws-build), GPU_ARCHS
# (sm_90a), OUT, TRACE_MASKS (default "causal,window-sinks,random,bigbird"),
# TRACE_VARIANT (a bench_sparse_flex.py --variant, default "").
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-/tmp/attn-trace-fwd-ws-build}
out=${OUT:-$build/trace}
mkdir -p "$out"
. scripts/profile-build.sh
profile_build "$build" "$out" "" -Dtests=false -Dcuda_args=-DATTN_FWD_WS_TRACE=1 || exit 1
python3 bench/bench_sparse_flex.py --lib "$build/src/libattn.so" --no-flex --reps 1 \
  --masks "${TRACE_MASKS:-causal,window-sinks,random,bigbird}" --variant "${TRACE_VARIANT:-}" \
  >"$out/trace-fwd-ws.txt" 2>&1
rc=$?
# Each plan's row follows its launches' lines.
grep -E "^ws-trace|^\{'mask'" "$out/trace-fwd-ws.txt" | sed -E "s/^\{'mask': '([^']*)'.*/== \1 (the lines above)/"
exit $rc
