#!/usr/bin/env bash
# The CUDA benchmark of libattn, run on a machine with a CUDA device from any
# directory: builds bench/attn_bench_cuda for the device, times a default
# matrix of dense plans with CUDA events (bench/attn_bench_cuda.cpp: inputs
# rotated among sets larger than L2, warm-up, median and min of the timed
# calls, outputs checked for NaN) and prints a markdown table last.
#
# Matrix: bf16, BSHD, batch * seqlen = 16K tokens, heads = 2048 / d,
# d = 64 and 128, L = 2K, 8K and 16K, causal and full, forward and backward;
# plus one GQA case (d 128, L 8K, 16 query heads on 2 KV heads, causal) and
# one sliding-window case (d 128, L 16K, each query sees itself and the 4095
# keys before it). TFLOP/s come from the plan's own count (attn_plan_describe:
# forward 4 * visible pairs * d, backward 2.5 x forward).
#
# Environment (all optional):
#   BUILD_DIR    build directory (/tmp/attn-bench-cuda; configured here if it
#                is not: release, -Dgpu_archs=$GPU_ARCHS, -Dcuda=enabled,
#                -Dtests=false, -Dexamples=false)
#   GPU_ARCHS    meson gpu_archs when configuring (sm_90a)
#   WARMUP       untimed calls per pass (5)
#   REPEAT       timed calls per pass (20)
#   DEVICE       CUDA device ordinal (0)
#   BENCH_ARGS   extra options for every case, e.g. "--deterministic"
#   BUILD_ONLY   1: build, then stop
#   OUT          when set, the report is also written to $OUT/bench-cuda.md and
#                each case's full output to $OUT/bench-cuda-logs/
#   ATTN_COMMIT  the commit to report where the tree has no .git
# A .deps/ folder (as for scripts/gpu-check.sh) supplies pkg-config files and
# libraries the machine lacks.
#
# Progress goes to stderr; the report (ending with the table) to stdout.
# Exit status: 0 when every case ran, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
build=${BUILD_DIR:-/tmp/attn-bench-cuda}
archs=${GPU_ARCHS:-sm_90a}
warmup=${WARMUP:-5}
repeat=${REPEAT:-20}
device=${DEVICE:-0}
read -r -a extra <<<"${BENCH_ARGS:-}"
if [ -d .deps/pc ]; then
  export PKG_CONFIG_PATH=$root/.deps/pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$root/.deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
say() { echo "bench-cuda: $*" >&2; }

if [ -n "${OUT:-}" ]; then
  logs=$OUT/bench-cuda-logs
else
  logs=$build/bench-cuda-logs
fi

# --- build --------------------------------------------------------------------
mkdir -p "$build"
if [ ! -f "$build/build.ninja" ]; then
  say "configuring $build for $archs"
  if ! meson setup "$build" --buildtype=release -Dgpu_archs="$archs" -Dcuda=enabled \
      -Dtests=false -Dexamples=false >"$build/bench-cuda-setup.log" 2>&1; then
    tail -40 "$build/bench-cuda-setup.log" >&2
    say "meson setup failed (log: $build/bench-cuda-setup.log)"
    exit 1
  fi
fi
start=$(date +%s)
if ! ninja -C "$build" bench/attn_bench_cuda >"$build/bench-cuda-build.log" 2>&1; then
  grep -E "error|FAILED|unknown target" -A4 "$build/bench-cuda-build.log" | head -60 >&2
  say "building bench/attn_bench_cuda in $build failed (is the CUDA backend enabled there," \
      "and the bench not disabled?); log: $build/bench-cuda-build.log"
  exit 1
fi
say "built in $(( $(date +%s) - start )) s"
exe=$build/bench/attn_bench_cuda
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
mkdir -p "$logs"

# --- provenance -----------------------------------------------------------------
if [ -e .git ] && rev=$(git rev-parse --short HEAD 2>/dev/null); then
  [ -z "$(git status --porcelain 2>/dev/null)" ] || rev="$rev-dirty"
else
  rev=${ATTN_COMMIT:-unknown}
fi
when=$(date -u '+%Y-%m-%d %H:%M UTC')
gpu=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu=$(nvidia-smi -i "$device" --format=csv,noheader \
    --query-gpu=name,driver_version,clocks.max.sm,power.limit 2>/dev/null | head -n1)
fi
buildtype=$(meson introspect --buildoptions "$build" 2>/dev/null |
  python3 -c 'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"]=="buildtype"))' \
  2>/dev/null || echo unknown)
built_archs=$(meson introspect --buildoptions "$build" 2>/dev/null |
  python3 -c 'import json,sys; print(",".join(next(o["value"] for o in json.load(sys.stdin) if o["name"]=="gpu_archs")))' \
  2>/dev/null || echo "$archs")

# --- cases ----------------------------------------------------------------------
# Each case: "name|mask shown|attn_bench_cuda options".
cases=()
for d in 64 128; do
  for L in 2048 8192 16384; do
    for mask in causal none; do
      b=$((16384 / L))
      h=$((2048 / d))
      shown=$mask
      [ "$mask" = none ] && shown=full
      cases+=("d$d-L$((L / 1024))K-$shown|$shown|--batch $b --heads-q $h --seqlen $L --head-dim $d --mask $mask")
    done
  done
done
cases+=("gqa-d128-L8K-causal|causal|--batch 2 --heads-q 16 --heads-kv 2 --seqlen 8192 --head-dim 128 --mask causal")
cases+=("swa-d128-L16K|window (4095, 0)|--batch 1 --heads-q 16 --seqlen 16384 --head-dim 128 --mask window 4095 0")

failed=0
rows=()   # markdown rows, in case order
kernels=()
for c in "${cases[@]}"; do
  IFS='|' read -r name shown args <<<"$c"
  log=$logs/$name.log
  say "$name ..."
  # shellcheck disable=SC2086  # args is a word list on purpose
  "$exe" $args --dtype bf16 --layout bshd --passes fwd,bwd --warmup "$warmup" \
    --repeat "$repeat" --device "$device" --label "$name" "${extra[@]}" >"$log" 2>&1
  rc=$?
  if [ "$rc" = 3 ]; then
    cat "$log" >&2
    say "no usable CUDA device: stopping"
    exit 1
  fi
  # Shape columns from the options themselves, so that a failed case has them.
  read -r b hq hkv L d <<<"$(awk '{
      for (i = 1; i < NF; ++i) {
        if ($i == "--batch") b = $(i + 1); else if ($i == "--heads-q") hq = $(i + 1)
        else if ($i == "--heads-kv") hkv = $(i + 1); else if ($i == "--seqlen") L = $(i + 1)
        else if ($i == "--head-dim") d = $(i + 1)
      }
      if (hkv == "") hkv = hq
      print b, hq, hkv, L, d }' <<<"$args")"
  if [ "$rc" != 0 ]; then
    failed=1
    why=$(grep -E "^attn_bench_cuda: " "$log" | tail -n1 | sed 's/^attn_bench_cuda: //; s/|/\\|/g')
    [ -n "$why" ] || why=$(tail -n1 "$log" | sed 's/|/\\|/g')
    say "$name FAILED (exit $rc): $why"
    rows+=("| $name | $d | $L | $b | $hq/$hkv | $shown | FAILED (exit $rc): ${why:0:160} | | | | | |")
    continue
  fi
  # The csv lines, by column name.
  row=$(awk -F, '
    $1 == "csv" && $2 == "case" { for (i = 2; i <= NF; ++i) col[$i] = i; next }
    $1 == "csv" {
      p = $(col["pass"])
      ms[p] = $(col["median_ms"]); tf[p] = $(col["tflops_median"]); best[p] = $(col["tflops_best"])
    }
    END {
      printf "| %.3f | %.1f | %.1f | %.3f | %.1f | %.1f |", ms["fwd"], tf["fwd"], best["fwd"],
             ms["bwd"], tf["bwd"], best["bwd"]
    }' "$log")
  rows+=("| $name | $d | $L | $b | $hq/$hkv | $shown $row")
  kernels+=("| $name | \`$(sed -n 's/^meta,kernel,//p' "$log")\` | $(sed -n 's/^meta,sets,//p' "$log") |")
  say "$name: $(awk -F, '$1 == "csv" && $2 == "case" { for (i = 2; i <= NF; ++i) col[$i] = i; next }
    $1 == "csv" { printf "%s %s ms %s TFLOP/s  ", $(col["pass"]), $(col["median_ms"]), $(col["tflops_median"]) }' "$log")"
done

# --- report -----------------------------------------------------------------------
first_ok=$(for c in "${cases[@]}"; do
  n=${c%%|*}
  grep -q '^meta,device,' "$logs/$n.log" 2>/dev/null && { echo "$logs/$n.log"; break; }
done)
meta() { [ -n "$first_ok" ] && sed -n "s/^meta,$1,//p" "$first_ok" | head -n1; }
cuda_version() { awk '{ printf "%d.%d", $1 / 1000, ($1 % 1000) / 10 }'; }  # 12080 -> 12.8
report() {
  echo "# libattn CUDA benchmark"
  echo
  echo "| | |"
  echo "|---|---|"
  echo "| date | $when |"
  echo "| commit | \`$rev\` |"
  echo "| device | ${gpu:-$(meta device)} (sm_$(meta sm), $(meta sms) SMs, L2 $(meta l2_bytes | awk '{ printf "%.1f MiB", $1 / 1048576 }')) |"
  echo "| CUDA | driver API $(meta driver | cuda_version), runtime $(meta runtime | cuda_version) |"
  echo "| build | $build, buildtype $buildtype, gpu_archs $built_archs |"
  echo "| timing | $warmup warm-up + $repeat timed calls per pass, CUDA events around each call; median (best = min) |"
  echo "| inputs | random non-zero bf16, rotated among tensor sets so that >= 3 x L2 is touched between two uses of one set |"
  [ "${#extra[@]}" = 0 ] || echo "| extra options | \`${extra[*]}\` |"
  echo
  echo "Plans (kernel that ran; tensor sets rotated):"
  echo
  echo "| case | kernel | sets |"
  echo "|---|---|---:|"
  for k in "${kernels[@]}"; do echo "$k"; done
  echo
  echo "TFLOP/s count visible (query, key) pairs only: forward 4 * pairs * d, backward"
  echo "2.5 x forward; causal counts about half of full. Shape: bf16, BSHD, batch *"
  echo "seqlen = 16K tokens, heads = 2048 / d (GQA: query/KV heads)."
  echo
  echo "| case | d | L | batch | heads q/kv | mask | fwd ms | fwd TFLOP/s | fwd best | bwd ms | bwd TFLOP/s | bwd best |"
  echo "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"
  for r in "${rows[@]}"; do echo "$r"; done
}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  report | tee "$OUT/bench-cuda.md"
  say "wrote $OUT/bench-cuda.md"
else
  report
fi
exit "$failed"
