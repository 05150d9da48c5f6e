#!/usr/bin/env python3
"""bench/attn_ffi.py (the benchmarks' ctypes layer) against include/attn/attn.h.

  - every enumerator of attn.h is a constant of the module with the same
    value, and the module has no ATTN_* constant attn.h lacks;
  - every struct of attn.h has a ctypes.Structure (attn_kv_cache_info_t ->
    KvCacheInfo) with the same fields in the same order and of the same
    types, and ctypes.sizeof equals the C compiler's sizeof (printed by
    bench_ffi_sizes, built from attn.h);
  - every signature the module declares matches the header's prototype
    (argument count, each argument's type, the result);
  - with --lib, the declarations at work on the CPU backend: a forward pass
    against a float64 reference computed here, describe, a KV cache's info
    and a decode step (also against the reference), and a failed call
    raising AttnError with the status and the library's message.

No torch needed. Inputs are seeded random numbers (the seed is printed);
outputs start as NaN. Exit 0 on success, 1 with the list of problems.
"""
import argparse
import ctypes
import math
import os
import random
import re
import subprocess
import sys

SCALARS = {
    "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint8_t": ctypes.c_uint8,
    "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64, "size_t": ctypes.c_size_t,
    "float": ctypes.c_float, "double": ctypes.c_double, "char": ctypes.c_char,
}


class Header:
    """The declarations of attn.h that a ctypes caller mirrors."""

    def __init__(self, path):
        text = open(path, encoding="utf-8").read()
        text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
        text = re.sub(r"^\s*#.*(\\\n.*)*$", " ", text, flags=re.M)  # preprocessor, with continuations
        self.enums = {}        # typedef name -> [(enumerator, value)]
        for m in re.finditer(r"typedef\s+enum\s+\w+\s+ATTN_ENUM_BASE\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
            items, value = [], -1
            for entry in filter(None, (e.strip() for e in m.group(1).split(","))):
                name, _, expr = entry.partition("=")
                value = int(expr.strip(), 0) if expr.strip() else value + 1
                items.append((name.strip(), value))
            self.enums[m.group(2)] = items
        self.structs = {}      # typedef name -> [(field, base type, array length or None)]
        for m in re.finditer(r"typedef\s+struct\s+\w+\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
            fields = []
            for decl in filter(None, (d.strip() for d in m.group(1).split(";"))):
                base, _, rest = decl.partition(" ")
                for declarator in rest.split(","):
                    a = re.fullmatch(r"\s*(\w+)\s*(?:\[\s*(\d+)\s*\])?\s*", declarator)
                    if a is None:
                        raise ValueError(f"{m.group(2)}: cannot read the field '{decl}'")
                    fields.append((a.group(1), base, int(a.group(2)) if a.group(2) else None))
            self.structs[m.group(2)] = fields
        self.handles = set(re.findall(r"typedef\s+struct\s+\w+\s*\*\s*(\w+)\s*;", text))
        self.functions = {}    # name -> (result, [parameter])
        for m in re.finditer(r"\bATTN_API\b([^;{]*?)\b(attn_\w+)\s*\(([^)]*)\)\s*;", text, re.S):
            params = [" ".join(p.split()) for p in m.group(3).split(",")]
            self.functions[m.group(2)] = (" ".join(m.group(1).split()), [] if params == ["void"] else params)


def parse_type(decl, has_name):
    """('base', pointer depth) of a C declaration such as 'const int64_t *seq_ids'."""
    words = re.findall(r"\w+|\*", decl)
    words = [w for w in words if w != "const"]
    if has_name:
        words = words[:-1]
    return words[0], words.count("*")


def class_name(typedef):
    """attn_kv_cache_info_t -> KvCacheInfo."""
    return "".join(w.capitalize() for w in typedef[len("attn_"):-len("_t")].split("_"))


def same_ctype(a, b):
    if hasattr(a, "_length_") or hasattr(b, "_length_"):
        return (hasattr(a, "_length_") and hasattr(b, "_length_") and a._length_ == b._length_
                and same_ctype(a._type_, b._type_))
    return a is b


def expected_ctypes(header, ffi, base, depth):
    """The ctypes types that may stand for a C type (base, pointer depth)."""
    vp, P = ctypes.c_void_p, ctypes.POINTER
    int_like = base == "attn_status_t" or base in header.enums
    if depth == 0:
        if base in SCALARS:
            return [SCALARS[base]]
        if int_like:
            return [ctypes.c_int32]
        if base in header.handles:
            return [vp]
    elif depth == 1:
        if base == "void":
            return [vp]
        if base == "char":  # a string, or the caller's buffer for one
            return [ctypes.c_char_p, P(ctypes.c_char)]
        if base in header.handles:
            return [P(vp)]
        if base in header.structs:
            cls = getattr(ffi, class_name(base), None)
            return [P(cls)] if cls is not None else []
        if base in SCALARS:  # a host array, or memory given by address (torch's data_ptr())
            return [P(SCALARS[base]), vp]
        if int_like:
            return [P(ctypes.c_int32)]
    elif depth == 2:
        return [P(vp), vp]
    return []


def check_declarations(header, ffi, sizes, problems):
    # Enumerations.
    header_values = {}
    for typedef, items in header.enums.items():
        for name, value in items:
            header_values[name] = value
            if not hasattr(ffi, name):
                problems.append(f"{typedef}: attn_ffi lacks {name} (= {value})")
            elif getattr(ffi, name) != value:
                problems.append(f"{name}: attn_ffi has {getattr(ffi, name)}, attn.h {value}")
    for name in dir(ffi):
        if re.fullmatch(r"ATTN_[A-Z0-9_]+", name) and name not in header_values:
            problems.append(f"attn_ffi.{name} is no enumerator of attn.h")
    if len(header_values) < 30:
        problems.append(f"could only read {len(header_values)} enumerators from attn.h")

    # Structs: fields, then sizes.
    if len(header.structs) < 7:
        problems.append(f"could only read {len(header.structs)} structs from attn.h")
    for typedef, fields in header.structs.items():
        cls = getattr(ffi, class_name(typedef), None)
        if cls is None:
            problems.append(f"{typedef}: attn_ffi lacks class {class_name(typedef)}")
            continue
        want = [(n, SCALARS[b] * k if k else SCALARS[b]) for n, b, k in fields]
        have = list(cls._fields_)
        for i in range(max(len(want), len(have))):
            w = want[i] if i < len(want) else ("(none)", None)
            h = have[i] if i < len(have) else ("(none)", None)
            if w[0] != h[0] or not same_ctype(w[1], h[1]):
                problems.append(f"{typedef} field {i}: attn.h {w[0]} {getattr(w[1], '__name__', w[1])}, "
                                f"{cls.__name__} {h[0]} {getattr(h[1], '__name__', h[1])}")
        if typedef not in sizes:
            problems.append(f"{typedef}: bench_ffi_sizes does not print its size (add it there)")
        elif sizes[typedef] != ctypes.sizeof(cls):
            problems.append(f"{typedef}: sizeof {sizes[typedef]} in C, {ctypes.sizeof(cls)} in ctypes")
    if sizes.get("attn_status_t") != ctypes.sizeof(ctypes.c_int32):
        problems.append(f"sizeof(attn_status_t) is {sizes.get('attn_status_t')}, not that of int32_t")

    # Signatures.
    for name, (args, res) in ffi.SIGNATURES.items():
        if name not in header.functions:
            problems.append(f"{name}: declared in attn_ffi, not in attn.h")
            continue
        c_res, c_params = header.functions[name]
        if len(args) != len(c_params):
            problems.append(f"{name}: {len(args)} arguments in attn_ffi, {len(c_params)} in attn.h")
            continue
        for i, (t, p) in enumerate(zip(args, c_params)):
            if not any(same_ctype(t, e) for e in expected_ctypes(header, ffi, *parse_type(p, True))):
                problems.append(f"{name} argument {i} ('{p}'): attn_ffi has {t.__name__}")
        if not any(same_ctype(res, e) for e in expected_ctypes(header, ffi, *parse_type(c_res, False))):
            problems.append(f"{name} result ('{c_res}'): attn_ffi has {getattr(res, '__name__', res)}")
    if len(ffi.SIGNATURES) < 20:
        problems.append(f"attn_ffi declares only {len(ffi.SIGNATURES)} functions")


def attention_ref(q_rows, keys, values, scale):
    """softmax(q k^T * scale) v in float64 for each query row of one head."""
    out = []
    for q in q_rows:
        s = [scale * sum(a * b for a, b in zip(q, k)) for k in keys]
        m = max(s)
        p = [math.exp(x - m) for x in s]
        z = sum(p)
        out.append([sum(pj * v[c] for pj, v in zip(p, values)) / z for c in range(len(values[0]))])
    return out


def max_rel_diff(got, want):
    # Python's max() drops a NaN that does not come first: an output left
    # unwritten (NaN-poisoned) must count as the worst difference.
    got = list(got)
    if len(got) != len(want) or not all(math.isfinite(g) for g in got):
        return math.inf
    num = max(abs(g - w) for g, w in zip(got, want))
    return num / max(max(abs(w) for w in want), 1e-30)


def check_runtime(ffi, lib_path, seed, problems):
    """The declared signatures and structs in calls to the CPU backend."""
    rng = random.Random(seed)
    lib = ffi.Lib(lib_path)
    dl = lib.dll
    vp, f32 = ctypes.c_void_p, ctypes.c_float
    ctx = lib.context(ffi.ATTN_BACKEND_CPU, 0, 1)
    try:
        # A failed call: AttnError with the status and the message naming the argument.
        desc = vp()
        lib.check(dl.attn_plan_desc_create(ctypes.byref(desc)), "plan_desc_create")
        try:
            lib.check(dl.attn_plan_desc_set_shape(desc, 0, 2, 2, 5, 7, 16, 16), "set_shape")
            problems.append("set_shape with batch 0 raised nothing")
        except ffi.AttnError as e:
            if e.status != ffi.ATTN_STATUS_INVALID_ARGUMENT or not str(e).startswith("set_shape: ") \
                    or "batch" not in str(e):
                problems.append(f"set_shape with batch 0: status {e.status}, '{e}'")

        # Forward of a causal fp32 BSHD plan: B 1, H 2, Lq 5, Lkv 7, d 16.
        hq, lq, lk, d = 2, 5, 7, 16
        lib.check(dl.attn_plan_desc_set_shape(desc, 1, hq, hq, lq, lk, d, d), "set_shape")
        lib.check(dl.attn_plan_desc_set_dtype(desc, ffi.ATTN_DTYPE_FP32), "set_dtype")
        lib.check(dl.attn_plan_desc_set_layout(desc, ffi.ATTN_LAYOUT_BSHD), "set_layout")
        lib.check(dl.attn_plan_desc_set_mask(desc, ffi.ATTN_MASK_CAUSAL, -1, -1), "set_mask")
        lib.check(dl.attn_plan_desc_set_passes(desc, ffi.ATTN_PASSES_FORWARD), "set_passes")
        plan = vp()
        try:
            lib.check(dl.attn_plan_create(ctx, desc, ctypes.byref(plan)), "plan_create")
        finally:
            dl.attn_plan_desc_destroy(desc)
        try:
            info = ffi.sized(ffi.PlanInfo)
            lib.check(dl.attn_plan_describe(plan, ctypes.byref(info)), "describe")
            pairs = hq * sum(i + 1 + (lk - lq) for i in range(lq))  # bottom-right causal
            got = (info.struct_size, info.backend, info.dtype, info.visible_pairs, info.flops_forward,
                   info.supports_backward, info.block_q, info.block_kv)
            want = (ctypes.sizeof(ffi.PlanInfo), ffi.ATTN_BACKEND_CPU, ffi.ATTN_DTYPE_FP32, pairs,
                    4.0 * pairs * d, 0, 0, 0)
            if got != want or not info.kernel.startswith(b"cpu") or info.total_tile_pairs < 1:
                problems.append(f"attn_plan_describe: (struct_size, backend, dtype, pairs, flops, bwd, "
                                f"block_q, block_kv) {got}, want {want}; kernel {info.kernel!r}, "
                                f"tile pairs {info.visited_tile_pairs}/{info.total_tile_pairs}")
            ws_n = ctypes.c_size_t()
            lib.check(dl.attn_plan_workspace_size(plan, ffi.ATTN_PASS_FORWARD, ctypes.byref(ws_n)), "ws")
            if ws_n.value != info.workspace_bytes_forward:
                problems.append(f"workspace {ws_n.value} bytes, describe says {info.workspace_bytes_forward}")
            q = [rng.uniform(-1, 1) for _ in range(lq * hq * d)]
            k = [rng.uniform(-1, 1) for _ in range(lk * hq * d)]
            v = [rng.uniform(-1, 1) for _ in range(lk * hq * d)]
            qb, kb, vb = ((f32 * len(x))(*x) for x in (q, k, v))
            ob = (f32 * len(q))(*[math.nan] * len(q))
            lse = (f32 * (hq * lq))(*[math.nan] * (hq * lq))
            ws = (ctypes.c_uint8 * max(ws_n.value, 1))()
            lib.check(dl.attn_forward(plan, ctypes.addressof(qb), ctypes.addressof(kb), ctypes.addressof(vb),
                                      ctypes.addressof(ob), ctypes.addressof(lse), ctypes.addressof(ws),
                                      ws_n.value, None), "attn_forward")
            row = lambda buf, s, h: [float(buf[(s * hq + h) * d + c]) for c in range(d)]  # noqa: E731
            worst = 0.0
            for h in range(hq):
                for i in range(lq):
                    seen = i + 1 + lk - lq
                    ref = attention_ref([row(q, i, h)], [row(k, j, h) for j in range(seen)],
                                        [row(v, j, h) for j in range(seen)], 1 / math.sqrt(d))[0]
                    worst = max(worst, max_rel_diff(row(ob, i, h), ref))
            if not worst < 1e-5:
                problems.append(f"attn_forward through attn_ffi: max relative difference {worst:.2e}")
        finally:
            dl.attn_plan_destroy(plan)

        # A KV cache (fp32, HND, 4-token pages, 2 KV heads, d 16) holding 5 tokens of one sequence.
        hkv, page, n = 2, 4, 5
        cfg = ffi.KvCacheConfig(ctypes.sizeof(ffi.KvCacheConfig), ffi.ATTN_DTYPE_FP32, ffi.ATTN_KV_LAYOUT_HND,
                                page, 8, hkv, d, d, 0, 0)
        cache = vp()
        lib.check(dl.attn_kv_cache_create(ctx, ctypes.byref(cfg), None, 0, ctypes.byref(cache)), "cache")
        try:
            lib.check(dl.attn_kv_cache_add_sequence(cache, 3), "add_sequence")
            ids = (ctypes.c_int64 * 1)(3)
            counts = (ctypes.c_int32 * 1)(n)
            kc = [rng.uniform(-1, 1) for _ in range(n * hkv * d)]  # [tokens, H_kv, d]
            vc = [rng.uniform(-1, 1) for _ in range(n * hkv * d)]
            kcb, vcb = (f32 * len(kc))(*kc), (f32 * len(vc))(*vc)
            lib.check(dl.attn_kv_cache_append(cache, 1, ids, counts, ctypes.addressof(kcb),
                                              ctypes.addressof(vcb), None), "append")
            ci = ffi.sized(ffi.KvCacheInfo)
            lib.check(dl.attn_kv_cache_get_info(cache, ctypes.byref(ci)), "get_info")
            got = (ci.struct_size, ci.num_pages, ci.pages_in_use, ci.num_sequences, ci.page_size,
                   ci.bytes_per_token, ci.owns_memory, ci.reserved)
            want = (ctypes.sizeof(ffi.KvCacheInfo), 8, 2, 1, page, 2 * hkv * d * 4, 1, 0)
            if got != want:
                problems.append(f"attn_kv_cache_get_info: {got}, want {want}")

            # One decode step: 4 query heads on the 2 KV heads, one query token.
            hq = 4
            dc = ffi.DecodeConfig(ctypes.sizeof(ffi.DecodeConfig), hq, 1, 1, 0, 0, 0.0, 0.0)
            dplan = vp()
            lib.check(dl.attn_decode_plan_create(ctx, cache, ctypes.byref(dc), ctypes.byref(dplan)), "plan")
            try:
                wsn = ctypes.c_size_t()
                lib.check(dl.attn_decode_plan_workspace_size(dplan, ctypes.byref(wsn)), "workspace size")
                pi = ffi.sized(ffi.DecodePlanInfo)
                lib.check(dl.attn_decode_plan_describe(dplan, ctypes.byref(pi)), "describe")
                got = (pi.struct_size, pi.backend, pi.dtype, pi.heads_q, pi.heads_kv, pi.max_batch,
                       pi.max_query_tokens, pi.kv_chunk_tokens, pi.reserved, pi.workspace_bytes)
                want = (ctypes.sizeof(ffi.DecodePlanInfo), ffi.ATTN_BACKEND_CPU, ffi.ATTN_DTYPE_FP32, hq, hkv,
                        1, 1, 0, 0, wsn.value)
                if got != want or not pi.kernel.startswith(b"cpu") or pi.split_target_tasks < 0 \
                        or pi.split_min_chunk_tokens < 0:
                    problems.append(f"attn_decode_plan_describe: {got}, want {want}; kernel {pi.kernel!r}, "
                                    f"split {pi.split_target_tasks}, {pi.split_min_chunk_tokens}")
                dws = (ctypes.c_uint8 * max(wsn.value, 1))()
                qlens = (ctypes.c_int32 * 1)(1)
                si = ffi.sized(ffi.DecodeStepInfo)
                lib.check(dl.attn_decode_prepare(dplan, cache, 1, ids, qlens, ctypes.addressof(dws), wsn.value,
                                                 ctypes.byref(si), None), "prepare")
                got = (si.struct_size, si.total_q, si.visible_pairs)
                want = (ctypes.sizeof(ffi.DecodeStepInfo), 1, hq * n)
                if got != want or si.num_work_units < 1 or not si.kv_bytes_read > 0:
                    problems.append(f"attn_decode_prepare info: {got}, want {want}; units "
                                    f"{si.num_work_units}, kv bytes {si.kv_bytes_read}")
                qd = [rng.uniform(-1, 1) for _ in range(hq * d)]  # [H_q, d]
                qdb = (f32 * len(qd))(*qd)
                od = (f32 * len(qd))(*[math.nan] * len(qd))
                lib.check(dl.attn_decode_execute(dplan, cache, ctypes.addressof(qdb), ctypes.addressof(od), None,
                                                 ctypes.addressof(dws), wsn.value, None), "execute")
                worst = 0.0
                for h in range(hq):
                    g = h // (hq // hkv)
                    kv_rows = lambda x: [x[(t * hkv + g) * d:(t * hkv + g + 1) * d] for t in range(n)]  # noqa: E731
                    ref = attention_ref([qd[h * d:(h + 1) * d]], kv_rows(kc), kv_rows(vc), 1 / math.sqrt(d))[0]
                    worst = max(worst, max_rel_diff([float(x) for x in od[h * d:(h + 1) * d]], ref))
                if not worst < 1e-5:
                    problems.append(f"attn_decode_execute through attn_ffi: max relative difference {worst:.2e}")
            finally:
                dl.attn_decode_plan_destroy(dplan)
        finally:
            dl.attn_kv_cache_destroy(cache)
    finally:
        dl.attn_context_destroy(ctx)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--header", required=True, help="include/attn/attn.h")
    ap.add_argument("--bench-dir", required=True, help="the folder of attn_ffi.py")
    ap.add_argument("--sizes", required=True, help="the bench_ffi_sizes program")
    ap.add_argument("--lib", help="libattn.so, for the calls on the CPU backend")
    ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    args = ap.parse_args()
    print(f"seed {args.seed}")

    sys.path.insert(0, os.path.abspath(args.bench_dir))
    import attn_ffi
    if "torch" in sys.modules:
        print("attn_ffi imported torch at import time")
        return 1

    header = Header(args.header)
    sizes = {}
    for line in subprocess.run([args.sizes], check=True, capture_output=True, text=True).stdout.splitlines():
        name, size = line.split()
        sizes[name] = int(size)
    problems = []
    for name in sizes:
        if name not in header.structs and name != "attn_status_t":
            problems.append(f"bench_ffi_sizes prints {name}, which attn.h does not define as a struct")
    check_declarations(header, attn_ffi, sizes, problems)
    if args.lib:
        check_runtime(attn_ffi, args.lib, args.seed, problems)

    for p in problems:
        print("FAIL:", p)
    print(f"{len(header.enums)} enums, {len(header.structs)} structs, {len(attn_ffi.SIGNATURES)} signatures "
          f"checked{' and called' if args.lib else ''}: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
