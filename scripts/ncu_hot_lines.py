#!/usr/bin/env python3
"""The hottest source lines of an Nsight Compute source-page CSV export.

Usage: ncu_hot_lines.py SOURCE_CSV [N]

`ncu -i REPORT --page source --csv --print-source sass,cuda` writes, per
profiled kernel and source file, a "File Path" and a "Function Name" line,
then a table whose rows with a "Line No" are source lines (followed by the
SASS rows of each). This adds every kernel's source-line rows over its
launches and files and prints, per kernel, its stall reasons' shares and
the N lines (default 30) with the most warp samples, with their three
largest stall reasons: where a kernel's warps wait, without the GUI.
"""
import collections
import csv
import sys


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    # kernel -> (file, line) -> [samples, stall counter, source text]
    kernels = collections.OrderedDict()
    kernel, file_name, head = None, None, None
    with open(path, errors="replace", newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                file_name = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Function Name":
                kernel = row[1]
            elif row[0] == "Line No":
                head = row
            elif head is not None and kernel is not None and row[0] and len(row) == len(head):
                try:
                    samples = float(row[4])
                except ValueError:
                    continue
                lines = kernels.setdefault(kernel, {})
                entry = lines.setdefault((file_name, int(row[0])),
                                         [0.0, collections.Counter(), row[1].strip()])
                entry[0] += samples
                for i, name in enumerate(head):
                    if name.startswith("stall_") and "Not Issued" not in name:
                        try:
                            entry[1][name[6:]] += float(row[i])
                        except ValueError:
                            pass
    if not kernels:
        print("no source-line table found; is this a --page source --csv export?")
        return 1
    for kernel, lines in kernels.items():
        total = sum(e[0] for e in lines.values()) or 1.0
        stalls = collections.Counter()
        for e in lines.values():
            stalls.update(e[1])
        print(f"== {kernel} ({total:.0f} samples)")
        print("   stalls: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in stalls.most_common(8)))
        for (fname, line), e in sorted(lines.items(), key=lambda kv: -kv[1][0])[:top]:
            reasons = ", ".join(f"{k} {int(v)}" for k, v in e[1].most_common(3))
            print(f"{100 * e[0] / total:5.1f}% {fname}:{line:<5d} [{reasons}]  {e[2][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
