#!/usr/bin/env bash
# Builds, on a machine with nvcc but no GPU, everything scripts/ab-sparse.sh
# needs to compare build-time variants of the device code on a GPU machine
# without building there: a release build for sm_90a (the library and the
# forward, block-sparse and MoBA GPU tests) and one library per variant
# (scripts/build-variant-lib.sh), packed into OUT_DIR.tar.xz.
#
#   scripts/prebuild-variants.sh OUT_DIR NAME:NAME=VALUE[,NAME=VALUE...][:SOURCE_REGEX] ...
#   e.g. scripts/prebuild-variants.sh alt/prebuilt klead2:ATTN_FWD_WS_K_LEAD=2 \
#          trace:ATTN_FWD_WS_TRACE=1,ATTN_BWD_SM90_TRACE=1:'flash_(fwd_sm90_ws|bwd_sm90)'
#
# OUT_DIR/base/src/libattn.so.0 is the base library and OUT_DIR/base/tests/gpu
# its tests (their run path finds ../../src; LD_LIBRARY_PATH overrides it);
# OUT_DIR/NAME/libattn.so.0 each variant; OUT_DIR/COMMIT the commit built.
# Put OUT_DIR under alt/ (ignored by git), carry the tarball to the GPU
# machine, unpack it there and run e.g.
#   AB_TEST_BUILD=alt/prebuilt/base scripts/ab-sparse.sh lib=alt/prebuilt/base/src lib=alt/prebuilt/klead1
# A spec's SOURCE_REGEX says which sources its macros reach (default
# build-variant-lib.sh's: the warp-specialised forward's).
# Environment: PREBUILD_BASE (the base build directory, /tmp/attn-prebuild),
# JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,23p "$0"; exit 2; }
out=$1
shift
base=${PREBUILD_BASE:-/tmp/attn-prebuild}
if [ ! -f "$base/build.ninja" ]; then
  meson setup "$base" -Dgpu_archs=sm_90a -Dbench=disabled -Dexamples=false --buildtype=release >/dev/null
fi
lib=$(ninja -C "$base" -t targets all | grep -o "^src/libattn\.so\.[0-9.]*:" | tr -d :)
tests="tests/gpu/test_flash_fwd tests/gpu/test_block_sparse_gpu tests/gpu/test_moba_gpu"
ninja -C "$base" ${JOBS:+-j "$JOBS"} "$lib" $tests >/dev/null
rm -rf "$out"
mkdir -p "$out/base/src" "$out/base/tests/gpu"
cp "$base/$lib" "$out/base/src/"
ln -s "${lib#src/}" "$out/base/src/libattn.so.0"
for t in $tests; do cp "$base/$t" "$out/base/tests/gpu/"; done
git rev-parse --short HEAD >"$out/COMMIT"
git diff --quiet HEAD -- src kernels include meson.build || echo "(with uncommitted changes)" >>"$out/COMMIT"
for spec in "$@"; do
  IFS=: read -r name defines regex <<<"$spec"
  scripts/build-variant-lib.sh "$base" "$out/$name" "$defines" ${regex:+"$regex"} | tail -1
  rm -rf "$out/$name/obj" "$out/$name/build.sh"
done
tar -C "$(dirname "$out")" -cJf "$out.tar.xz" "$(basename "$out")"
echo "$out.tar.xz: $(du -h "$out.tar.xz" | cut -f1), commit $(head -1 "$out/COMMIT")"
