#!/usr/bin/env bash
# Builds, on a machine with nvcc but no GPU, everything scripts/ab-sparse.sh
# needs to compare build-time variants of the device code on a GPU machine
# without building there: a release build for sm_90a (the library and every
# program of the GPU test suite, with the suite's test list and environments
# in OUT_DIR/base/gpu-tests.json for scripts/run-prebuilt-tests.py) and one
# library per variant (scripts/build-variant-lib.sh), packed into
# OUT_DIR.tar.xz.
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
#   scripts/run-prebuilt-tests.py alt/prebuilt              (the whole GPU suite)
#   scripts/run-prebuilt-tests.py alt/prebuilt --lib alt/prebuilt/klead2 --match sparse
#   AB_TEST_BUILD=alt/prebuilt/base scripts/ab-sparse.sh lib=alt/prebuilt/base/src lib=alt/prebuilt/klead2
# A spec's SOURCE_REGEX says which sources its macros reach (default
# build-variant-lib.sh's: the warp-specialised forward's).
# Environment: PREBUILD_BASE (the base build directory, /tmp/attn-prebuild),
# JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,25p "$0"; exit 2; }
out=${1%/}
shift
base=${PREBUILD_BASE:-/tmp/attn-prebuild}
if [ ! -f "$base/build.ninja" ]; then
  meson setup "$base" -Dgpu_archs=sm_90a -Dbench=disabled -Dexamples=false --buildtype=release >/dev/null
fi
# Regenerated first: the test list and targets below must include what was
# added to the meson files since the base directory last built.
ninja -C "$base" build.ninja >/dev/null
# CUDA objects older than a header they include: meson < 1.5 does not tell
# ninja about those headers, and the bundle would carry kernels older than
# their sources.
python3 scripts/cuda-stale-objects.py "$base" | sed 's/^/stale CUDA object, rebuilt: /' >&2
lib=$(ninja -C "$base" -t targets all | grep -o "^src/libattn\.so\.[0-9.]*:" | tr -d :)
# The GPU suite's tests: their programs, and each test's name, program,
# environment (less the build's library path) and timeout.
gpu_json=$(mktemp)
meson introspect "$base" --tests | python3 -c '
import json, os, sys
tests = [t for t in json.load(sys.stdin) if any(s.endswith(":gpu") for s in t["suite"])]
out = [{"name": t["name"], "program": os.path.basename(t["cmd"][0]), "args": t["cmd"][1:],
        "env": {k: v for k, v in t["env"].items() if k != "LD_LIBRARY_PATH"},
        "timeout": t["timeout"], "is_parallel": t.get("is_parallel", True)} for t in tests]
json.dump(out, sys.stdout, indent=1)
' >"$gpu_json"
tests=$(python3 -c 'import json, sys
print(" ".join(sorted({"tests/gpu/" + t["program"] for t in json.load(open(sys.argv[1]))})))' "$gpu_json")
ninja -C "$base" ${JOBS:+-j "$JOBS"} "$lib" $tests >/dev/null
rm -rf "$out"
mkdir -p "$out/base/src" "$out/base/tests/gpu"
cp "$base/$lib" "$out/base/src/"
ln -s "${lib#src/}" "$out/base/src/libattn.so.0"
for t in $tests; do cp "$base/$t" "$out/base/tests/gpu/"; done
mv "$gpu_json" "$out/base/gpu-tests.json"
git rev-parse --short HEAD >"$out/COMMIT"
git diff --quiet HEAD -- src kernels include tests meson.build ||
  echo "(with uncommitted changes)" >>"$out/COMMIT"
for spec in "$@"; do
  IFS=: read -r name defines regex <<<"$spec"
  scripts/build-variant-lib.sh "$base" "$out/$name" "$defines" ${regex:+"$regex"} | tail -1
  rm -rf "$out/$name/obj" "$out/$name/build.sh"
done
tar -C "$(dirname "$out")" -cJf "$out.tar.xz" "$(basename "$out")"
echo "$out.tar.xz: $(du -h "$out.tar.xz" | cut -f1), commit $(head -1 "$out/COMMIT")"
