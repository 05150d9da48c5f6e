#!/usr/bin/env python3
"""The ABI surface of libattn.

  - `nm -D --defined-only` on the shared library lists only attn_* symbols,
    all of them functions, and exactly the functions attn.h declares with
    ATTN_API (nothing missing, nothing undocumented);
  - the soname is versioned (libattn.so.<soversion>) and the library file is
    named after it;
  - the static library defines no strong global symbol outside attn_* and
    the C++ namespace attn (so it cannot clash with a consumer's symbols).

Exit 0 on success, 1 with a list of problems, 77 (skip) when a tool is missing.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys


def run(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def declared_functions(header):
    text = open(header, encoding="utf-8").read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)  # drop comments
    text = re.sub(r"^\s*#.*$", " ", text, flags=re.M)  # and preprocessor lines
    return set(re.findall(r"\bATTN_API\b[^;{]*?\b(attn_\w+)\s*\(", text, flags=re.S))


def dynamic_symbols(nm, lib):
    """(name, type letter) of the defined dynamic symbols."""
    out = []
    for line in run([nm, "-D", "--defined-only", lib]).splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[-1], parts[-2]
        out.append((name.split("@")[0], kind))  # strip symbol versions
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True, help="the shared library (as built)")
    ap.add_argument("--static-lib", help="the static library (optional)")
    ap.add_argument("--header", required=True, help="include/attn/attn.h")
    ap.add_argument("--soversion", required=True)
    ap.add_argument("--nm", default="nm")
    ap.add_argument("--readelf", default="readelf")
    args = ap.parse_args()

    for tool in (args.nm, args.readelf):
        if shutil.which(tool) is None and not os.path.exists(tool):
            print(f"SKIP: {tool} not found")
            return 77

    problems = []

    # 1. Exported symbols.
    syms = dynamic_symbols(args.nm, args.lib)
    names = {n for n, _ in syms}
    foreign = sorted(n for n in names if not n.startswith("attn_"))
    if foreign:
        problems.append(f"{len(foreign)} exported symbols outside attn_*: " + ", ".join(foreign[:20]))
    not_func = sorted(f"{n} ({k})" for n, k in syms if n.startswith("attn_") and k not in ("T", "t", "i"))
    if not_func:
        problems.append("exported attn_* symbols that are not functions: " + ", ".join(not_func))
    declared = declared_functions(args.header)
    if len(declared) < 10:
        problems.append(f"could only find {len(declared)} ATTN_API declarations in {args.header}")
    exported = {n for n in names if n.startswith("attn_")}
    missing = sorted(declared - exported)
    extra = sorted(exported - declared)
    if missing:
        problems.append("declared in attn.h but not exported: " + ", ".join(missing))
    if extra:
        problems.append("exported but not declared in attn.h: " + ", ".join(extra))

    # 2. The soname.
    dyn = run([args.readelf, "-d", args.lib])
    m = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", dyn)
    want = f"libattn.so.{args.soversion}"
    if not m:
        problems.append("the shared library has no SONAME")
    else:
        soname = m.group(1)
        if soname != want:
            problems.append(f"SONAME is {soname!r}, expected {want!r}")
        base = os.path.basename(os.path.realpath(args.lib))
        if not base.startswith(soname):
            problems.append(f"library file {base!r} is not named after its SONAME {soname!r}")

    # 3. The static library's global namespace.
    if args.static_lib:
        strong = set()
        for line in run([args.nm, "-g", "--defined-only", args.static_lib]).splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDBRG":  # strong definitions only
                strong.add(parts[2])
        cxx_attn = re.compile(r"^_Z(T[VIS]|GV|Z)?N[KVRO]*4attn")
        clashing = sorted(s for s in strong if not s.startswith("attn_") and not cxx_attn.match(s))
        if clashing:
            problems.append("static library defines global symbols outside attn_* / namespace attn: "
                            + ", ".join(clashing[:20]))

    print(f"{len(exported)} attn_* functions exported, {len(declared)} declared; soname "
          f"{m.group(1) if m else '(none)'}")
    if problems:
        for p in problems:
            print("FAIL:", p)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
