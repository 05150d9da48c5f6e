#!/usr/bin/env python3
"""The hottest instructions of an Nsight Compute source-page CSV export.

Usage: ncu_hot_lines.py SOURCE_CSV [N]

`ncu -i REPORT --page source --csv --print-source sass[,cuda]` writes, per
profiled kernel, a header line naming the kernel and then a CSV table with
one row per SASS instruction (its address, source, and the sampling
columns). This prints, per kernel, the N rows (default 40) with the most
warp-state samples, with the column of the largest stall reason beside
each, so that a profile's stalls can be read without the GUI.
"""
import csv
import io
import sys


def tables(text):
    """(title, rows) for each CSV table in the export."""
    title, block = "", []
    for line in text.splitlines():
        if line.startswith('"'):
            block.append(line)
            continue
        if block:
            yield title, list(csv.reader(io.StringIO("\n".join(block))))
            block = []
        if line.strip():
            title = line.strip()
    if block:
        yield title, list(csv.reader(io.StringIO("\n".join(block))))


def number(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return None


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    text = open(path, errors="replace").read()
    found = False
    for title, rows in tables(text):
        if len(rows) < 2:
            continue
        head = rows[0]
        samp = [i for i, h in enumerate(head) if "Sampling" in h and "All" in h]
        if not samp:
            samp = [i for i, h in enumerate(head) if "Samples" in h]
        if not samp:
            continue
        found = True
        si = samp[0]
        stall = [i for i, h in enumerate(head) if h.startswith("stall_") or "Stall" in h]
        src = [i for i, h in enumerate(head) if h in ("Source", "# Source", "Address")]
        body = [r for r in rows[1:] if len(r) == len(head)]
        total = sum(number(r[si]) or 0.0 for r in body)
        print(f"== {title} ({len(body)} rows, {total:.0f} samples; columns: {', '.join(head[:6])}...)")
        body.sort(key=lambda r: -(number(r[si]) or 0.0))
        for r in body[:top]:
            n = number(r[si]) or 0.0
            worst = ""
            if stall:
                j = max(stall, key=lambda i: number(r[i]) or 0.0)
                worst = f"{head[j]}={r[j]}"
            where = " | ".join(r[i] for i in src)
            print(f"{n:8.0f} {100 * n / max(total, 1):5.1f}%  {worst:40s} {where[:160]}")
    if not found:
        print("no table with sampling columns; the export's first lines:")
        print("\n".join(text.splitlines()[:20]))


if __name__ == "__main__":
    main()
