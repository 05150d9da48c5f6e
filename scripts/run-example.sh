#!/usr/bin/env bash
# Builds libattn (CPU backend; CUDA too when nvcc is found) and runs the main
# example. Installs missing build tools first (scripts/install-deps.sh).
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
else
  meson setup "$build" --buildtype=release ${MESON_ARGS:-}
fi
meson compile -C "$build" attn_example
"$build/examples/attn_example"
