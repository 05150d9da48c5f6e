#!/usr/bin/env bash
# Builds libattn (CPU backend; CUDA too when nvcc is found) and runs the main
# example. Installs missing build tools first (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# a meson that install-deps.sh had to take from PyPI (pip --user)
export PATH="$HOME/.local/bin:$PATH"
./scripts/install-deps.sh
build=${BUILD_DIR:-build}
[ -f "$build/build.ninja" ] || meson setup "$build" --buildtype=release
meson compile -C "$build" attn_example
"$build/examples/attn_example"
