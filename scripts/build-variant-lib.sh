#!/usr/bin/env bash
# Builds a variant of libattn.so whose device code differs from a base build
# only by build-time macros, without a second full build: the CUDA sources
# whose path matches a pattern are compiled again with the macros added (the
# base's own commands otherwise), and the library is linked from those
# objects and the base's others. A full CUDA build takes minutes on a GPU
# machine whose time is short and a fraction of an hour on a small one; the
# kernels' build-time variants (e.g. kernels/flash/fwd_sm90_ws_kernel.cuh's
# ATTN_FWD_WS_*) touch a few sources, so their libraries can be built ahead
# on any machine with nvcc and timed by scripts/ab-sparse.sh's lib= trees.
#
#   scripts/build-variant-lib.sh BASE_BUILD OUT_DIR NAME=VALUE[,NAME=VALUE...] [SOURCE_REGEX]
#
# BASE_BUILD: a configured meson build directory whose library is built.
# OUT_DIR: receives the objects, libattn.so.<version> and the libattn.so.0
#          link, and DEFINES (the macros, one line).
# SOURCE_REGEX: an extended regex on the sources' paths (default
#          flash_fwd_sm90_ws: the warp-specialised forward's instantiations).
# Environment: JOBS (parallel compiles; default: the number of CPUs).
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,19p "$0"; exit 2; }
base=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
defines=$3
regex=${4:-flash_fwd_sm90_ws}
lib=$(ninja -C "$base" -t targets all | grep -o "^src/libattn\.so\.[0-9.]*:" | tr -d :)
[ -n "$lib" ] || { echo "no libattn.so target in $base" >&2; exit 1; }
# (meson < 1.5 does not tell ninja which headers a .cu source includes)
python3 "$(dirname "$0")/cuda-stale-objects.py" "$base" | sed 's/^/stale CUDA object, rebuilt: /' >&2
ninja -C "$base" "$lib" >/dev/null
mkdir -p "$out/obj"

# The matching sources' compile commands with the macros, and the link
# command with their objects swapped in, as a script run in the base
# directory.
python3 - "$base" "$out" "$defines" "$regex" "$lib" "${JOBS:-$(nproc)}" >"$out/build.sh" <<'EOF'
import json, re, shlex, subprocess, sys
base, out, defines, regex, lib, jobs = sys.argv[1:]
flags = ["-D" + d for d in defines.split(",") if d]
swapped = {}
compiles = []
for e in json.load(open(f"{base}/compile_commands.json")):
    if not e["output"].startswith(lib + ".p/") or not re.search(regex, e["file"]):
        continue
    args = shlex.split(e["command"])
    if not args[0].endswith("nvcc"):
        continue
    new = f"{out}/obj/{e['output'].rsplit('/', 1)[1]}"
    i = args.index("-o")
    args[i + 1] = new
    compiles.append(shlex.join(args[:1] + flags + args[1:]))
    swapped[e["output"]] = new
if not compiles:
    sys.exit(f"no CUDA source of {lib} matches {regex!r}")
link = subprocess.run(["ninja", "-t", "commands", lib], cwd=base, capture_output=True,
                      text=True, check=True).stdout.strip().splitlines()[-1]
args = shlex.split(link)
args = [swapped.get(a, a) for a in args]
args[args.index("-o") + 1] = f"{out}/{lib.rsplit('/', 1)[1]}"
print("set -e")
print(f"cd {shlex.quote(base)}")
# The compiles in parallel (xargs), then the link.
print("xargs -d '\\n' -P " + jobs + " -I CMD sh -c CMD <<'CMDS'")
for c in compiles:
    print(c)
print("CMDS")
print(shlex.join(args))
EOF
bash "$out/build.sh"
name=${lib#src/}
ln -sf "$name" "$out/libattn.so.0"
echo "$defines" >"$out/DEFINES"
echo "$out/$name ($defines; $(grep -c nvcc "$out/build.sh") sources recompiled)"
