# Sourced by the profile-*.sh scripts: the CMocka copy in .deps/ where
# present (as scripts/gpu-check.sh uses it), and one function that
# configures a GPU build directory when it has none and builds what the
# profile runs.
#
#   profile_build BUILD OUT TARGET [MESON_ARG...]
#     BUILD   the build directory (configured with -Dgpu_archs=$GPU_ARCHS,
#             default sm_90a, benchmarks and examples off, plus MESON_ARG)
#     OUT     where setup.log and build.log go
#     TARGET  the ninja target ("" for all)
#   Returns non-zero, after the log's tail, when either step fails.
if [ -d .deps/pc ]; then
  export PKG_CONFIG_PATH=$PWD/.deps/pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$PWD/.deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

profile_build() {
  local build=$1 out=$2 target=$3
  shift 3
  if [ ! -f "$build/build.ninja" ]; then
    meson setup "$build" -Dgpu_archs="${GPU_ARCHS:-sm_90a}" -Dbench=disabled -Dexamples=false \
      "$@" >"$out/setup.log" 2>&1 || { tail -30 "$out/setup.log"; return 1; }
  fi
  # shellcheck disable=SC2086  # an empty target builds everything
  ninja -C "$build" $target >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; return 1; }
}
