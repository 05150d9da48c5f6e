#!/usr/bin/env python3
"""Compares the kernels of two cubins (or lists one's) section by section.

A refactor that should not change the machine code, or a source that picks
among measured variants per instantiation, is checked by building the
touched .cu file with -cubin before and after (same flags) and comparing:

  nvcc ... -cubin -c src/cuda/X.cu -o before.cubin    (then after.cubin)
  scripts/cubin_sections.py before.cubin after.cubin

For each kernel (its .text section, with .nv.info: registers, barriers,
parameters) it prints the size and whether the bytes are identical; a
kernel in one file only is listed as such. Exit status 1 if any differs.
With one file, prints each kernel's sizes and digests.
"""
import hashlib
import struct
import sys


def kernels(path):
    """{kernel name: {section kind: (size, md5)}} of an ELF64 cubin."""
    d = open(path, "rb").read()
    if d[:4] != b"\x7fELF" or d[4] != 2:
        sys.exit(f"{path}: not an ELF64 file")
    shoff, = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]
    out = {}
    for s in secs:
        name = d[names + s[0]:d.index(b"\0", names + s[0])].decode()
        for kind in (".text.", ".nv.info."):
            if name.startswith(kind) and len(name) > len(kind):
                body = d[s[4]:s[4] + s[5]] if s[1] != 8 else b""  # SHT_NOBITS has no bytes
                out.setdefault(name[len(kind):], {})[kind.strip(".")] = (
                    s[5], hashlib.md5(body).hexdigest()[:12])
    return out


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    a = kernels(sys.argv[1])
    if len(sys.argv) == 2:
        for k in sorted(a):
            print(k, " ".join(f"{kind} {size} {md5}" for kind, (size, md5) in sorted(a[k].items())))
        return 0
    b = kernels(sys.argv[2])
    differ = 0
    for k in sorted(set(a) | set(b)):
        if k not in a or k not in b:
            print(f"only in {'first' if k in a else 'second'}: {k}")
            differ += 1
            continue
        same = a[k] == b[k]
        size = a[k].get("text", (0, ""))[0], b[k].get("text", (0, ""))[0]
        print(f"{'same' if same else 'DIFFERS'} {k} (text {size[0]} / {size[1]} bytes)")
        differ += not same
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
