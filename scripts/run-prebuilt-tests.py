#!/usr/bin/env python3
"""Runs the GPU test suite from a bundle of scripts/prebuild-variants.sh,
on a machine with a CUDA device but no build of its own (nothing compiles).

  scripts/run-prebuilt-tests.py BUNDLE [--lib DIR] [--match REGEX] [--jobs N] [--logs DIR]
                                [--timeout-cap SECONDS]

BUNDLE/base/gpu-tests.json lists the suite's tests as meson defines them
(name, program, arguments, environment, timeout); each runs as
BUNDLE/base/tests/gpu/PROGRAM with that environment and the library of
--lib DIR (default BUNDLE/base/src, or a variant's directory) first on
LD_LIBRARY_PATH, which the programs search before their run path. A copy of
CMocka in .deps/lib of this repository is added when present. --match
keeps the tests whose name matches the regular expression; --jobs runs
that many at once (they share the GPU: for correctness, not timing), except
tests meson marks is_parallel: false (the NCCL ring's), which run alone
after the others. --timeout-cap lowers every test's timeout to at most that
many seconds (meson's are up to 900, longer than a device command may run).
Prints the bundle's commit, a line per test (PASS, SKIP for exit status 77,
FAIL with its status, TIMEOUT, ERROR when the program cannot start) with its
seconds, the last lines of each failure's log, and a summary; logs go to
--logs (default /tmp/attn-prebuilt-tests). Exit status 1 if any test failed,
timed out or could not start; 2 if every test skipped (no usable device).
"""
import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--lib")
    ap.add_argument("--match", default="")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--logs", default="/tmp/attn-prebuilt-tests")
    ap.add_argument("--timeout-cap", type=float, default=0.0)
    a = ap.parse_args()
    base = os.path.join(a.bundle, "base")
    with open(os.path.join(base, "gpu-tests.json")) as f:
        tests = [t for t in json.load(f) if re.search(a.match, t["name"])]
    lib = os.path.abspath(a.lib or os.path.join(base, "src"))
    if not os.path.exists(os.path.join(lib, "libattn.so.0")):
        sys.exit(f"no libattn.so.0 in {lib}")
    paths = [lib]
    deps = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".deps", "lib")
    if os.path.isdir(deps):
        paths.append(os.path.abspath(deps))
    if os.environ.get("LD_LIBRARY_PATH"):
        paths.append(os.environ["LD_LIBRARY_PATH"])
    os.makedirs(a.logs, exist_ok=True)
    commit = "unknown"
    try:
        with open(os.path.join(a.bundle, "COMMIT")) as f:
            commit = " ".join(f.read().split())
    except OSError:
        pass
    print(f"bundle of commit {commit}: {len(tests)} tests, library {lib}", flush=True)

    def run(t):
        env = dict(os.environ)
        env.update(t["env"])
        env["LD_LIBRARY_PATH"] = ":".join(paths)
        prog = os.path.join(base, "tests", "gpu", t["program"])
        log = os.path.join(a.logs, t["name"] + ".log")
        timeout = t["timeout"]
        if a.timeout_cap > 0:
            timeout = min(timeout, a.timeout_cap) if timeout else a.timeout_cap
        start = time.time()
        with open(log, "w") as out:
            try:
                rc = subprocess.run([prog] + t["args"], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, timeout=timeout or None).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            except OSError as e:  # missing or not executable: this test, not the run
                out.write(f"cannot start {prog}: {e}\n")
                rc = "error"
        return t["name"], rc, time.time() - start, log

    counts = {"pass": 0, "skip": 0, "bad": 0}

    def report(result):
        name, rc, secs, log = result
        verdict = ("TIMEOUT" if rc == "timeout" else "ERROR" if rc == "error" else
                   "PASS" if rc == 0 else "SKIP" if rc == 77 else f"FAIL ({rc})")
        print(f"{verdict:10} {name} {secs:.1f} s", flush=True)
        if rc == 0:
            counts["pass"] += 1
        elif rc == 77:
            counts["skip"] += 1
        else:
            counts["bad"] += 1
            with open(log, errors="replace") as f:
                for line in f.readlines()[-5:]:
                    print("    " + line.rstrip())

    parallel = [t for t in tests if t.get("is_parallel", True)]
    serial = [t for t in tests if not t.get("is_parallel", True)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for result in pool.map(run, parallel):
            report(result)
    for t in serial:  # alone: they use every GPU (NCCL)
        report(run(t))
    print(f"{counts['pass']} passed, {counts['skip']} skipped, {counts['bad']} failed "
          f"(of {len(tests)}); logs in {a.logs}")
    if counts["bad"]:
        return 1
    return 2 if tests and counts["skip"] == len(tests) else 0


if __name__ == "__main__":
    sys.exit(main())
