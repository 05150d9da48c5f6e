#!/usr/bin/env python3
"""libattn's CUDA paged decode next to PyTorch SDPA, in one process.

bf16, d = 128, 32 query heads on 8 KV heads, one query token per sequence
at the end of its context. libattn (through ctypes, on PyTorch's current
stream) reads a paged KV cache (page size 16, HND unless stated) filled by
attn_kv_cache_append from the very K/V that SDPA gets as contiguous
[B, H_kv, L, d] tensors (GQA through enable_gqa, or K/V expanded to the
query heads when a backend refuses it: then the table says so). The figure
is KV bytes read per second: the bytes of the keys and values of every
sequence (libattn's attn_decode_step_info_t.kv_bytes_read; the same count
for SDPA, the unique K/V bytes, whatever the backend re-reads), timed with
CUDA events, median of many runs after warm-up, inputs larger than L2.
The device's copy bandwidth (a clone of a 1 GiB tensor, read + write) is
the ceiling. Outputs are compared with SDPA's (relative L2). At 1 x 128K
the automatic split is also compared with fixed chunk lengths
(kv_chunk_tokens), the same cache and Q.

Then the KV cache itself: append throughput of attn_kv_cache_append on
CUDA (one decode token for each of 32 sequences per call, and a 4K-token
prefill chunk of one sequence per call; host wall time per call, ctypes
overhead included, and the device time between events around the calls)
and the memory held per token (attn_kv_cache_get_info: K and V bytes of a
token, and the pages in use x page size x that, per token held).

With --variants every case is also timed with each variant of the decode
kernel (ATTN_CUDA_DECODE_KERNEL x ATTN_CUDA_DECODE_STAGES x
ATTN_CUDA_DECODE_SPLIT x ATTN_CUDA_DECODE_PDL, read at plan creation), same
cache and Q, outputs
compared with the default's (and each kernel x stages once more without a
split): one run says which variant wins. The main table's libattn column
is the default.

Usage: bench_decode.py [--lib build/src/libattn.so] [--out results.md] [--quick] [--variants]
                       [--no-sweep] [--no-append] [--cases 32x8K,4x64K,1x128K]
"""
import argparse
import ctypes
import datetime
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # attn_ffi, from any working directory
from attn_ffi import (ATTN_BACKEND_CUDA, ATTN_DTYPE_BF16, ATTN_KV_LAYOUT_HND,  # noqa: E402
                      ATTN_KV_LAYOUT_NHD, DecodeConfig, DecodePlanInfo, DecodeStepInfo, KvCacheConfig,
                      KvCacheInfo, Lib, rel_err, sized, time_ms)


class PagedDecode:
    """A CUDA cache holding k, v ([B, L, H_kv, d]) and a decode plan for one query per sequence."""

    def __init__(self, lib, ctx, k, v, hq, page_size, layout, chunk):
        self.lib, self.ctx, dl = lib, ctx, lib.dll
        B, L, hkv, d = k.shape
        self.B = B
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        cfg = KvCacheConfig(ctypes.sizeof(KvCacheConfig), ATTN_DTYPE_BF16, layout, page_size,
                            B * ((L + page_size - 1) // page_size), hkv, d, d, 0, 0)
        self.cache = ctypes.c_void_p()
        lib.check(dl.attn_kv_cache_create(ctx, ctypes.byref(cfg), None, 0, ctypes.byref(self.cache)), "cache")
        self.ids = (ctypes.c_int64 * B)(*range(B))
        for i in range(B):
            lib.check(dl.attn_kv_cache_add_sequence(self.cache, i), "add")
        counts = (ctypes.c_int32 * B)(*([L] * B))
        lib.check(dl.attn_kv_cache_append(self.cache, B, self.ids, counts, ctypes.c_void_p(k.data_ptr()),
                                          ctypes.c_void_p(v.data_ptr()), stream), "append")
        self.hq, self.L, self.plan = hq, L, None
        self.replan(chunk)

    def replan(self, chunk):
        """A new decode plan over the same cache with kv_chunk_tokens = chunk, prepared."""
        lib, dl, B = self.lib, self.lib.dll, self.B
        if self.plan is not None:
            dl.attn_decode_plan_destroy(self.plan)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        dc = DecodeConfig(ctypes.sizeof(DecodeConfig), self.hq, B, 1, self.L, chunk, 0.0, 0.0)
        self.plan = ctypes.c_void_p()
        lib.check(dl.attn_decode_plan_create(self.ctx, self.cache, ctypes.byref(dc), ctypes.byref(self.plan)), "plan")
        ws = ctypes.c_size_t()
        lib.check(dl.attn_decode_plan_workspace_size(self.plan, ctypes.byref(ws)), "workspace size")
        self.ws_bytes = ws.value
        self.ws = torch.empty(max(ws.value, 1), dtype=torch.uint8, device="cuda")
        self.qlens = (ctypes.c_int32 * B)(*([1] * B))
        self.info = sized(DecodeStepInfo)
        lib.check(dl.attn_decode_prepare(self.plan, self.cache, B, self.ids, self.qlens,
                                         ctypes.c_void_p(self.ws.data_ptr()), self.ws_bytes,
                                         ctypes.byref(self.info), stream), "prepare")
        pi = sized(DecodePlanInfo)
        lib.check(dl.attn_decode_plan_describe(self.plan, ctypes.byref(pi)), "describe")
        self.kernel = pi.kernel.decode()
        self.split_target = pi.split_target_tasks

    def execute(self, q, o):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.lib.check(self.lib.dll.attn_decode_execute(
            self.plan, self.cache, ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(o.data_ptr()), None,
            ctypes.c_void_p(self.ws.data_ptr()), self.ws_bytes, stream), "execute")

    def close(self):
        self.lib.dll.attn_decode_plan_destroy(self.plan)
        self.lib.dll.attn_kv_cache_destroy(self.cache)


# The decode kernel's variants timed with --variants: (label, environment at plan creation), every
# kernel x pipeline stages x automatic split policy x programmatic launch of the combine kernel.
VARIANTS = tuple((f"{kernel}, {stages} stages, {split}{', pdl' if pdl == '1' else ''}",
                  {"ATTN_CUDA_DECODE_KERNEL": kernel, "ATTN_CUDA_DECODE_STAGES": stages,
                   "ATTN_CUDA_DECODE_SPLIT": split, "ATTN_CUDA_DECODE_PDL": pdl})
                 for kernel in ("sm80", "sm90-bulk") for stages in ("2", "3") for split in ("waves", "balanced")
                 for pdl in ("0", "1"))

# And each kernel x stages without a split (kv_chunk_tokens -1: one block per sequence and KV head).
NO_SPLIT_VARIANTS = tuple((f"{kernel}, {stages} stages, no split",
                           {"ATTN_CUDA_DECODE_KERNEL": kernel, "ATTN_CUDA_DECODE_STAGES": stages})
                          for kernel in ("sm80", "sm90-bulk") for stages in ("2", "3"))

# Fixed kv_chunk_tokens timed next to the automatic split, per (batch, context). 2736 at 4 x 64K and
# 1328 at 1 x 128K (83 pages) are the old two-wave splits (24 and 99 chunks), now with the parallel combine.
SPLIT_SWEEP = {(32, 8192): (-1, 4096, 2048), (4, 65536): (-1, 2736, 8192),
               (1, 131072): (1024, 1328, 2048, 4096, 8192)}


def split_label(info):
    if not info.split_sequences:
        return f"none ({info.num_work_units})"
    return f"{info.max_chunks} x {info.kv_chunk_tokens} tok ({info.num_work_units})"


def cache_info(lib, cache):
    ci = sized(KvCacheInfo)
    lib.check(lib.dll.attn_kv_cache_get_info(cache, ctypes.byref(ci)), "get_info")
    return ci


def bench_append(lib, ctx, hkv, d, ps, layout, warmup, reps):
    """Rows of the append table: (case, tokens/s, device us/call, device GB/s, B/token, held B/token)."""
    dl = lib.dll
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    rows = []
    for name, B, per_call in (("decode: 1 token x 32 sequences", 32, 1),
                              ("prefill: 4096 tokens x 1 sequence", 1, 4096)):
        calls = warmup + 2 * reps
        per_seq = calls * per_call
        pages = B * ((per_seq + ps - 1) // ps)
        cfg = KvCacheConfig(ctypes.sizeof(KvCacheConfig), ATTN_DTYPE_BF16, layout, ps, pages, hkv, d, d, 0, 0)
        cache = ctypes.c_void_p()
        lib.check(dl.attn_kv_cache_create(ctx, ctypes.byref(cfg), None, 0, ctypes.byref(cache)), "cache")
        ids = (ctypes.c_int64 * B)(*range(B))
        for i in range(B):
            lib.check(dl.attn_kv_cache_add_sequence(cache, i), "add")
        counts = (ctypes.c_int32 * B)(*([per_call] * B))
        # Distinct K/V per call, from a pool larger than L2 for the prefill.
        slots = max(1, min(calls, (256 << 20) // (2 * B * per_call * hkv * d * 2)))
        k = torch.randn(slots, B * per_call, hkv, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)

        def append(i):
            lib.check(dl.attn_kv_cache_append(cache, B, ids, counts, ctypes.c_void_p(k[i % slots].data_ptr()),
                                              ctypes.c_void_p(v[i % slots].data_ptr()), stream), "append")
        for i in range(warmup):
            append(i)
        torch.cuda.synchronize()
        # As a host issues them: wall time from the first call to the end of the last one's copies.
        t0 = time.perf_counter()
        for i in range(warmup, warmup + reps):
            append(i)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps
        # The device's part: the calls queued behind a sleeping kernel, then run back to back.
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(100_000_000)  # cycles: tens of ms, longer than queueing the calls takes
        e0.record()
        for i in range(warmup + reps, calls):
            append(i)
        e1.record()
        e1.synchronize()
        device_s = e0.elapsed_time(e1) * 1e-3 / reps if sleep is not None else float("nan")
        ci = cache_info(lib, cache)
        held = ci.pages_in_use * ci.page_size * ci.bytes_per_token / (B * per_seq)
        tokens = B * per_call
        rows.append((name, tokens / wall, device_s * 1e6, tokens * ci.bytes_per_token / device_s / 1e9,
                     ci.bytes_per_token, held))
        lib.check(dl.attn_kv_cache_destroy(cache), "destroy")
        del k, v
        torch.cuda.empty_cache()
    return rows


def sdpa_runner(backend, q4, kc, vc, hq):
    """fn() running SDPA with `backend`, and how GQA is given to it."""
    def gqa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True)
    try:
        gqa()
        torch.cuda.synchronize()
        return gqa, "enable_gqa"
    except RuntimeError:
        pass
    g = hq // kc.shape[1]
    ke, ve = kc.repeat_interleave(g, dim=1), vc.repeat_interleave(g, dim=1)

    def expanded():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q4, ke, ve)
    try:
        expanded()
        torch.cuda.synchronize()
        return expanded, "expanded K/V"
    except RuntimeError as e:
        return None, f"refused ({str(e).splitlines()[0][:60]})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.environ.get("LIBATTN", "build/src/libattn.so"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", action="store_true",
                    help="also time each decode kernel variant (VARIANTS) on every case")
    ap.add_argument("--no-sweep", action="store_true", help="skip the fixed kv_chunk_tokens sweep")
    ap.add_argument("--no-append", action="store_true", help="skip the append table")
    ap.add_argument("--cases", default="", help="comma-separated batch x context cases, e.g. 32x8K,4x64K")
    args = ap.parse_args()
    lib = Lib(args.lib)
    ctx = lib.context(ATTN_BACKEND_CUDA, 0, 1)
    hq, hkv, d, ps = 32, 8, 128, 16
    # (batch, context, layout, page size); 32 x 8K with 64-token pages says what page granularity costs.
    cases = [(32, 8192, ATTN_KV_LAYOUT_HND, ps), (32, 8192, ATTN_KV_LAYOUT_NHD, ps),
             (32, 8192, ATTN_KV_LAYOUT_HND, 64),
             (4, 65536, ATTN_KV_LAYOUT_HND, ps), (1, 131072, ATTN_KV_LAYOUT_HND, ps)]
    if args.cases:  # e.g. "32x8K,4x64K": those batch x context cases only (every layout and page size)
        wanted = {c.strip() for c in args.cases.split(",")}
        cases = [c for c in cases if f"{c[0]}x{c[1] // 1024}K" in wanted]
    warmup, reps = (3, 10) if args.quick else (10, 50)
    commit = os.environ.get("ATTN_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    # Copy bandwidth: read + write of 1 GiB.
    big = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(big)
    copy_ms = time_ms(lambda: dst.copy_(big), warmup, reps)
    copy_tbs = 2 * big.numel() * 2 / (copy_ms * 1e-3) / 1e12
    del big, dst
    lines = [f"# Paged decode: libattn CUDA vs PyTorch SDPA, {datetime.date.today()}", "",
             f"commit `{commit}`, {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, d = {d}, "
             f"heads q/kv {hq}/{hkv}, one query token per sequence, libattn page size {ps} unless stated; median of {reps} "
             f"after {warmup} warm-up; TB/s of K/V bytes read (unique bytes for every column). "
             f"Device copy (read + write, 1 GiB): {copy_tbs:.2f} TB/s.", "",
             "| batch x context | libattn layout | libattn TB/s | split (units) | torch FA2 TB/s | torch cuDNN TB/s "
             "| ours/FA2 | ours/cuDNN | rel. L2 vs SDPA | kernel |",
             "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    print("\n".join(lines), flush=True)
    torch.manual_seed(0)
    sweep, variants = [], []
    for B, L, layout, page in cases:
        k = torch.randn(B, L, hkv, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(B, L, hkv, d, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(B, hq, d, dtype=torch.bfloat16, device="cuda")
        o = torch.empty_like(q)
        pd = PagedDecode(lib, ctx, k, v, hq, page, layout, 0)
        kv_bytes = 2 * B * L * hkv * d * 2
        assert abs(pd.info.kv_bytes_read - kv_bytes) < 1, (pd.info.kv_bytes_read, kv_bytes)
        pd.execute(q, o)
        torch.cuda.synchronize()
        ours_ms = time_ms(lambda: pd.execute(q, o), warmup, reps)
        ours = kv_bytes / (ours_ms * 1e-3) / 1e12
        # The kernel variants (tuning environment variables, read at plan creation), same cache and Q.
        o_ref = o.clone()
        lname = ("HND" if layout == ATTN_KV_LAYOUT_HND else "NHD") + ("" if page == ps else f", page {page}")
        runs = [(label, env, 0) for label, env in VARIANTS]
        runs += [(label, env, -1) for label, env in NO_SPLIT_VARIANTS]
        for label, env, chunk in runs if args.variants else ():
            saved = {var: os.environ.get(var) for var in env}
            os.environ.update(env)
            try:
                pd.replan(chunk)
            finally:
                for var, val in saved.items():
                    if val is None:
                        del os.environ[var]
                    else:
                        os.environ[var] = val
            o.fill_(float("nan"))
            pd.execute(q, o)
            torch.cuda.synchronize()
            err = rel_err(o, o_ref)
            ms = time_ms(lambda: pd.execute(q, o), warmup, reps)
            variants.append((f"{B} x {L // 1024}K", lname, label, pd.kernel, kv_bytes / (ms * 1e-3) / 1e12,
                             split_label(pd.info), f"{err:.1e}"))
            print("variant: " + " | ".join(str(x) for x in variants[-1]), flush=True)
        pd.replan(0)
        o.copy_(o_ref)
        # SDPA on contiguous [B, H_kv, L, d] K/V.
        kc, vc = k.permute(0, 2, 1, 3).contiguous(), v.permute(0, 2, 1, 3).contiguous()
        del k, v
        q4 = q.view(B, hq, 1, d)
        res, errs = {}, []
        for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            fn, how = sdpa_runner(be, q4, kc, vc, hq)
            if fn is None:
                res[name] = (float("nan"), how)
                continue
            ref = fn().view(B, hq, d)
            errs.append(f"{name} {rel_err(o, ref):.1e}")
            ms = time_ms(fn, warmup, reps)
            res[name] = (kv_bytes / (ms * 1e-3) / 1e12, how)
        fa2, cud = res["fa2"][0], res["cudnn"][0]
        ratio = lambda a, b: f"{a / b:.2f}" if b == b and b > 0 else "n/a"
        note = lambda r: "" if r[1] == "enable_gqa" else f" ({r[1]})"
        lines.append(f"| {B} x {L // 1024}K | {lname} | {ours:.2f} | "
                     f"{split_label(pd.info)} | "
                     f"{fa2:.2f}{note(res['fa2'])} | {cud:.2f}{note(res['cudnn'])} | {ratio(ours, fa2)} | "
                     f"{ratio(ours, cud)} | {', '.join(errs)} | {pd.kernel} |")
        print(lines[-1], flush=True)
        if layout == ATTN_KV_LAYOUT_HND and page == ps and not args.no_sweep:
            # Fixed splits next to the automatic one (target: split_target_tasks blocks at once).
            auto = (split_label(pd.info), ours, pd.split_target)
            o_auto = o.clone()
            first = len(sweep)
            for chunk in SPLIT_SWEEP.get((B, L), ()):
                pd.replan(chunk)
                o.fill_(float("nan"))
                pd.execute(q, o)
                torch.cuda.synchronize()
                err = rel_err(o, o_auto)
                ms = time_ms(lambda: pd.execute(q, o), warmup, reps)
                sweep.append((f"{B} x {L // 1024}K", chunk, split_label(pd.info), kv_bytes / (ms * 1e-3) / 1e12,
                              f"{err:.1e}"))
            sweep.insert(first, (f"{B} x {L // 1024}K", f"auto (target {auto[2]} blocks)", auto[0], auto[1], "-"))
        pd.close()
        del kc, vc, q, o
        torch.cuda.empty_cache()
    if sweep:
        lines += ["", "Split-KV choices (HND; same cache and Q; libattn TB/s of K/V read; -1: never split):", "",
                  "| batch x context | kv_chunk_tokens | split (units) | libattn TB/s | rel. L2 vs auto |",
                  "|---|---|---|---:|---|"]
        lines += [f"| {c} | {k} | {s} | {t:.2f} | {e} |" for c, k, s, t, e in sweep]
        print("\n".join(lines[-len(sweep) - 2:]), flush=True)
    if variants:
        lines += ["", "Decode kernel variants (ATTN_CUDA_DECODE_KERNEL, ATTN_CUDA_DECODE_STAGES, "
                  "ATTN_CUDA_DECODE_SPLIT, ATTN_CUDA_DECODE_PDL; automatic split, or none where the variant says "
                  "so; same cache and Q; libattn TB/s of K/V read):", "",
                  "| batch x context | layout | variant | kernel | libattn TB/s | split (units) | rel. L2 vs default |",
                  "|---|---|---|---|---:|---|---|"]
        lines += ["| " + " | ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in row) + " |"
                  for row in variants]
        best = {}
        for row in variants:
            key = (row[0], row[1])
            if key not in best or row[4] > best[key][4]:
                best[key] = row
        lines += ["", "Fastest variant per case: " +
                  "; ".join(f"{c} {lay}: {r[2]} ({r[4]:.2f} TB/s)" for (c, lay), r in best.items())]
        print("\n".join(lines[-len(variants) - 4:]), flush=True)

    def save():
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
    save()  # the decode tables, should the append part fail
    if args.no_append:
        lib.dll.attn_context_destroy(ctx)
        return
    rows = bench_append(lib, ctx, hkv, d, ps, ATTN_KV_LAYOUT_HND, warmup, reps)
    lines += ["", f"attn_kv_cache_append on CUDA (bf16, HND, page {ps}, {hkv} KV heads, d {d}; mean of {reps} calls "
              f"after {warmup}). tokens/s: host wall time per call until its copies ran (ctypes included); "
              "device: event time of calls queued behind a sleeping kernel, and the K+V bytes written per second "
              "then (each also read once). Memory per token from attn_kv_cache_get_info: bytes_per_token, and "
              "pages in use x page size x bytes_per_token / tokens held:", "",
              "| append | tokens/s | device us/call | device GB/s written | bytes/token (K+V) | held bytes/token |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {n} | {tps:.3g} | {dev:.1f} | {gbs:.1f} | {bpt} | {held:.0f} |"
              for n, tps, dev, gbs, bpt, held in rows]
    print("\n".join(lines[-len(rows) - 2:]), flush=True)
    lib.dll.attn_context_destroy(ctx)
    save()


if __name__ == "__main__":
    main()
