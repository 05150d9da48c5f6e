#!/usr/bin/env bash
# Compares source trees of libattn on one GPU machine in one go (machines of
# one kind differ by several per cent, so versions are compared within a
# run): for each tree given (default: this one), builds the library and the
# forward and block-sparse GPU tests in its own build directory, runs the
# tests (and compute-sanitizer's racecheck on the block-sparse cases that
# exercise the warp-specialised forward's records), then times every tree's
# library with bench/bench_sparse_flex.py (no FlexAttention) and prints a
# table of the forward and backward ms of each mask per tree and round (and,
# with AB_ROUNDS > 1, one of each tree's means).
#
#   scripts/ab-sparse.sh [TREE[:DEFINES] ...]   e.g. . alt/ws-tma-epilogue
#   scripts/ab-sparse.sh . .:ATTN_FWD_WS_DENSE_END=2,ATTN_FWD_WS_SPARSE_END=2
#
# A tree is a checkout of the repository (e.g. `git worktree add alt/NAME
# BRANCH`; alt/ is ignored by git, so a copy of this tree that takes only
# tracked files leaves it out unless asked). DEFINES (comma-separated
# NAME=VALUE) build that tree's device code with those macros set (meson's
# cuda_args), for the kernels' build-time variants.
# A tree may also be lib=DIR: a library built elsewhere (DIR holds
# libattn.so.0, e.g. from scripts/build-variant-lib.sh), timed as it is and
# tested with the test programs of AB_TEST_BUILD (a build directory of the
# same commit whose GPU tests are built) loading it instead of their own.
# Environment: AB_BUILD_ROOT (default /tmp/attn-ab), GPU_ARCHS (sm_90a),
# OUT (logs; default $AB_BUILD_ROOT/logs), AB_TESTS=0 (skip tests
# and racecheck), AB_BENCH_ARGS (extra bench_sparse_flex.py arguments, e.g.
# "--masks random,bigbird --variant ATTN_CUDA_FWD_SM90_WS_PINGPONG=1"),
# AB_ROUNDS (default 1): rounds of timings, each timing every tree once in
# turn, starting one tree later each round (the GPU's clock under these
# kernels moves from launch to launch, so single runs of two trees differ
# by chance); with more than one, a last table gives each tree's mean,
# range and count of rounds per mask.
# Uses the CMocka copy in .deps/ of this tree where present.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
broot=${AB_BUILD_ROOT:-/tmp/attn-ab}
logs=${OUT:-$broot/logs}
mkdir -p "$logs"
rounds=${AB_ROUNDS:-1}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "AB_ROUNDS must be a positive integer, got '$rounds'"; exit 1; }
if [ -d .deps/pc ]; then
  export PKG_CONFIG_PATH=$root/.deps/pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$root/.deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
trees=("$@")
[ ${#trees[@]} -eq 0 ] && trees=(.)
declare -A libs
rc=0
# A spec's build name: the tree's directory name ("this" for .), then its
# defines with characters other than letters, digits, '_' and '=' as '-'.
spec_name() {
  if [[ $1 == lib=* ]]; then  # the directory's name, or its parent's for a build's src/
    local d=${1#lib=}
    d=${d%/}
    [ "$(basename "$d")" = src ] && d=$(dirname "$d")
    printf 'lib-%s' "$(basename "$d")"
    return
  fi
  local t=${1%%:*} d=""
  [ "$1" != "$t" ] && d=-$(printf '%s' "${1#*:}" | tr -c 'A-Za-z0-9_=' '-')
  if [ "$t" = . ]; then printf 'this%s' "$d"; else printf '%s%s' "$(basename "$(cd "$t" && pwd)")" "$d"; fi
}
# run_tests NAME BUILD LIBDIR: the forward and block-sparse GPU tests of
# BUILD and racecheck on the block-sparse cases that exercise the forward's
# records; with LIBDIR, the programs load that directory's library (their
# run path is searched after LD_LIBRARY_PATH).
run_tests() {
  local name=$1 b=$2 env=()
  [ -n "$3" ] && env=("LD_LIBRARY_PATH=$3${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  for test in test_flash_fwd test_block_sparse_gpu; do
    env "${env[@]}" "$b/tests/gpu/$test" >"$logs/$name-$test.log" 2>&1
    r=$?
    echo "$test: $([ $r = 0 ] && echo PASS || echo "FAIL ($r)")"
    grep -E "^FAIL" "$logs/$name-$test.log" | head -5
    [ $r = 0 ] || rc=1
  done
  for filter in -causal-gqa bigbird-race; do
    env "${env[@]}" ATTN_GPU_TEST_FILTER=$filter compute-sanitizer --tool racecheck --error-exitcode 3 \
      "$b/tests/gpu/test_block_sparse_gpu" >"$logs/$name-racecheck$filter.log" 2>&1
    r=$?
    echo "racecheck $filter: $(grep -E "RACECHECK SUMMARY" "$logs/$name-racecheck$filter.log" | sed 's/.*SUMMARY: //')"
    [ $r = 0 ] || rc=1
  done
}
for spec in "${trees[@]}"; do
  t=${spec%%:*}
  name=$(spec_name "$spec")
  b=$broot/$name
  echo "== $name ($spec)"
  if [[ $spec == lib=* ]]; then
    dir=$(cd "${spec#lib=}" && pwd)
    [ -e "$dir/libattn.so.0" ] || { echo "no libattn.so.0 in $dir"; rc=1; continue; }
    libs[$name]=$dir/libattn.so.0
    [ -f "$dir/DEFINES" ] && echo "defines: $(cat "$dir/DEFINES")"
    if [ "${AB_TESTS:-1}" != 0 ]; then
      if [ -z "${AB_TEST_BUILD:-}" ]; then
        echo "tests: skipped (AB_TEST_BUILD not set)"
      else
        run_tests "$name" "$AB_TEST_BUILD" "$dir"
      fi
    fi
    continue
  fi
  if [ ! -f "$b/build.ninja" ]; then
    cuda_args=()
    if [ "$spec" != "$t" ]; then
      IFS=, read -r -a defs <<<"${spec#*:}"
      list=$(printf "'-D%s'," "${defs[@]}")
      cuda_args=("-Dcuda_args=[${list%,}]")
    fi
    meson setup "$b" "$t" -Dgpu_archs="${GPU_ARCHS:-sm_90a}" -Dbench=disabled -Dexamples=false \
      "${cuda_args[@]}" >"$logs/$name-setup.log" 2>&1 ||
      { tail -20 "$logs/$name-setup.log"; rc=1; continue; }
  fi
  lib=$(ninja -C "$b" -t targets all | grep -o "^src/libattn\.so\.[0-9.]*:" | tr -d :)
  start=$(date +%s)
  ninja -C "$b" "$lib" tests/gpu/test_flash_fwd tests/gpu/test_block_sparse_gpu \
    >"$logs/$name-build.log" 2>&1 || { grep -E "error" -A3 "$logs/$name-build.log" | head -30; rc=1; continue; }
  echo "built in $(( $(date +%s) - start )) s"
  libs[$name]=$b/$lib
  [ "${AB_TESTS:-1}" != 0 ] && run_tests "$name" "$b" ""
done
# The timings: in each round, one tree after the other on the same machine.
read -r -a extra <<<"${AB_BENCH_ARGS:-}"
n_trees=${#trees[@]}
for ((r = 1; r <= rounds; ++r)); do
  for ((i = 0; i < n_trees; ++i)); do
    spec=${trees[$(( (i + r - 1) % n_trees ))]}
    name=$(spec_name "$spec")
    rm -f "$logs/$name-sparse-r$r.md"  # (a failed run leaves none, not an older one)
    [ -n "${libs[$name]:-}" ] || continue
    python3 bench/bench_sparse_flex.py --lib "${libs[$name]}" --no-flex "${extra[@]}" \
      --out "$logs/$name-sparse-r$r.md" >"$logs/$name-sparse-r$r.log" 2>&1 || rc=1
  done
done
echo
echo "| tree | round | mask | fwd ms | bwd ms | vs dense fwd | vs dense bwd |"
echo "|---|---|---|---|---|---|---|"
rows=$logs/rows.txt
: >"$rows"
for ((r = 1; r <= rounds; ++r)); do
  for spec in "${trees[@]}"; do
    name=$(spec_name "$spec")
    [ -f "$logs/$name-sparse-r$r.md" ] || continue
    grep -E "^\| [a-z]" "$logs/$name-sparse-r$r.md" | grep -v "^| mask" |
      awk -F'|' -v n="$name" -v r="$r" '{printf "| %s | %s |%s|%s|%s|%s|%s|\n", n, r, $2, $5, $6, $11, $12}' |
      tee -a "$rows"
  done
done
if [ "$rounds" -gt 1 ]; then
  echo
  echo "| tree | mask | rounds | fwd ms mean (min-max) | bwd ms mean (min-max) |"
  echo "|---|---|---|---|---|"
  awk -F'|' '{
      gsub(/ /, "", $2); gsub(/^ +| +$/, "", $4); k = $2 SUBSEP $4
      if (!(k in n)) { order[++m] = k; lo_f[k] = hi_f[k] = $5; lo_b[k] = hi_b[k] = $6 }
      n[k]++; f[k] += $5; b[k] += $6
      if ($5 < lo_f[k]) lo_f[k] = $5; if ($5 > hi_f[k]) hi_f[k] = $5
      if ($6 < lo_b[k]) lo_b[k] = $6; if ($6 > hi_b[k]) hi_b[k] = $6
    } END {
      for (i = 1; i <= m; ++i) {
        k = order[i]; split(k, t, SUBSEP)
        printf "| %s | %s | %d | %.3f (%.3f-%.3f) | %.3f (%.3f-%.3f) |\n", t[1], t[2], n[k],
               f[k] / n[k], lo_f[k], hi_f[k], b[k] / n[k], lo_b[k], hi_b[k]
      }
    }' "$rows"
fi
exit $rc
