#!/usr/bin/env bash
# Installs what building and testing libattn needs, if it is missing, on a
# Debian or Ubuntu machine: a C/C++ compiler, meson (>= 1.0), ninja,
# pkg-config, CMocka, Python 3 with numpy (for the FFI example).
# Safe to run again; does nothing when everything is present.
set -euo pipefail

need=()
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v c++ >/dev/null 2>&1 || need+=(g++)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v python3 >/dev/null 2>&1 || need+=(python3)
if ! command -v meson >/dev/null 2>&1; then need+=(meson); fi
if ! pkg-config --exists cmocka 2>/dev/null; then need+=(libcmocka-dev); fi

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else
    echo "install-deps: need root (or sudo) to run: $*" >&2; return 1; fi
}

apt_updated=0
apt_install() {
  if [ "$apt_updated" -eq 0 ]; then
    as_root apt-get update -qq
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if [ "${#need[@]}" -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-deps: missing ${need[*]} and no apt-get; install them by hand" >&2
    exit 1
  fi
  echo "install-deps: installing ${need[*]}"
  apt_install "${need[@]}"
fi

# meson >= 1.0 (Debian 12 ships 1.0.1); older distributions get it from PyPI.
# The callers (run-tests.sh, run-example.sh) put ~/.local/bin, where
# `pip install --user` puts it, first on their PATH.
if ! meson --version | awk -F. '{ exit !($1 >= 1) }'; then
  echo "install-deps: meson $(meson --version) is too old; installing a newer one with pip"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "install-deps: installing python3-pip"
    apt_install python3-pip
  fi
  python3 -m pip install --user -q 'meson>=1.0' || python3 -m pip install -q 'meson>=1.0'
  export PATH="$HOME/.local/bin:$PATH"
  meson --version | awk -F. '{ exit !($1 >= 1) }' || {
    echo "install-deps: meson >= 1.0 is still not first on PATH" >&2
    exit 1
  }
fi

# numpy for the Python FFI example: Debian's package for Debian's python3,
# else pip for whatever python3 is first on PATH.
if ! python3 -c 'import numpy' >/dev/null 2>&1; then
  if [ "$(command -v python3)" = /usr/bin/python3 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install-deps: installing python3-numpy"
    apt_install python3-numpy
  else
    echo "install-deps: installing numpy with pip"
    python3 -m pip install -q numpy
  fi
fi
