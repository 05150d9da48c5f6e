#!/usr/bin/env bash
# Builds libattn with its tests and runs the whole suite: numerics against the
# fp64 reference, API contracts, FFI and packaging. GPU tests skip (exit code
# 77) on machines without a CUDA device. Installs missing tools first.
# Extra arguments go to `meson test` (e.g. --suite numerics).
set -euo pipefail
cd "$(dirname "$0")/.."
# a meson that install-deps.sh had to take from PyPI (pip --user)
export PATH="$HOME/.local/bin:$PATH"
./scripts/install-deps.sh
build=${BUILD_DIR:-build}
# MESON_ARGS (e.g. -Dcuda=disabled): options for a new build directory, or
# applied to an existing one.
if [ -f "$build/build.ninja" ]; then
  [ -z "${MESON_ARGS:-}" ] || meson configure "$build" ${MESON_ARGS}
  # CUDA objects older than a header they include (meson < 1.5 does not
  # tell ninja about them) are compiled again.
  [ ! -f "$build/compile_commands.json" ] || python3 scripts/cuda-stale-objects.py "$build" |
    sed 's/^/stale CUDA object, rebuilt: /'
else
  meson setup "$build" --buildtype=release ${MESON_ARGS:-}
fi
meson compile -C "$build"
meson test -C "$build" --print-errorlogs --num-processes "${TEST_JOBS:-$(nproc)}" "$@"
