#!/usr/bin/env python3
"""Deletes the CUDA objects of a build directory that are older than a file
their source includes, so that the next ninja run compiles them again.

Meson before 1.5 does not ask nvcc for dependency files: ninja then knows
no header of a .cu source, and an edit under kernels/ leaves every object
that includes it as it was (a library whose kernels predate their headers,
without a word). This asks nvcc for each object's includes (-M, a
preprocessor pass, a fraction of a second per source) and compares times.

  scripts/cuda-stale-objects.py BUILD_DIR [--dry-run]

Prints the objects it deleted (or would delete) and nothing else.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def includes(entry):
    """The files nvcc reads to compile `entry` (a compile_commands.json entry)."""
    args = shlex.split(entry["command"])
    i = args.index("-o")
    del args[i:i + 2]
    args = [a for a in args if a != "-c"] + ["-M"]
    r = subprocess.run(args, cwd=entry["directory"], capture_output=True, text=True)
    if r.returncode != 0:
        return None  # let ninja report the error when it compiles
    words = r.stdout.replace("\\\n", " ").split()
    # "target : dep dep ..." (the target may end with ':' or stand alone).
    if ":" in words:
        words = words[words.index(":") + 1:]
    else:
        words = words[1:]
    return [os.path.join(entry["directory"], w) for w in words]


def stale(entry):
    out = os.path.join(entry["directory"], entry["output"])
    if not os.path.exists(out):
        return None
    deps = includes(entry)
    if deps is None:
        return None
    built = os.path.getmtime(out)
    for d in deps:
        try:
            if os.path.getmtime(d) > built:
                return out
        except OSError:
            return out  # an include that is gone: rebuild
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build_dir")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    with open(os.path.join(a.build_dir, "compile_commands.json")) as f:
        entries = [e for e in json.load(f) if shlex.split(e["command"])[0].endswith("nvcc")]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        found = [o for o in pool.map(stale, entries) if o]
    for o in sorted(found):
        print(os.path.relpath(o, a.build_dir))
        if not a.dry_run:
            os.remove(o)
    return 0


if __name__ == "__main__":
    sys.exit(main())
