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
for SDPA, the unique K/V bytes, whatever the backend re-reads); the K/V of
every case are many times larger than L2. The device's copy bandwidth (a
copy of a 1 GiB tensor, read + write) is the ceiling. Outputs are compared
with SDPA's (relative L2). The automatic split is also compared with fixed
chunk lengths (kv_chunk_tokens, SPLIT_SWEEP), the same cache and Q.

How it is timed, so that a ratio to cuDNN can be trusted: the device's
speed drifts over minutes (one configuration read 4.03, 3.47 and 3.56 TB/s
in three runs of one day, cuDNN 4.00, 3.55 and 4.02), so timing each side
once, minutes apart, moved ours/cuDNN between 0.89 and 1.01. Instead, for
each case libattn, FA2 and cuDNN are timed in interleaved rounds (7, or 3
with --quick; --rounds N): every runner is warmed up, then each round times
each runner once, back to back (3 untimed calls, then the median of 50
CUDA-event timings of one call each; 10 with --quick), the order rotated by
one every round. A table's TB/s is the median over the rounds and its
min-max column the spread over the rounds; a ratio is the median of the
per-round ratios (same round, nearly the same device), with their min-max.
Each timed call is queued behind a kernel that spins for about 1 ms
(torch.cuda._sleep), so that its start event fires with the call already
waiting: the events time the device's work, not the host's launch path
(Python, ctypes, the SDPA dispatcher), which differs between the runners;
--no-queue times calls issued to an idle device instead, as the results
before this method did. The results header says how many timed calls
found the device idle all the same (each is then timed again behind a
spin twice as long).

Then the KV cache itself: append throughput of attn_kv_cache_append on
CUDA (one decode token for each of 32 sequences per call, and a 4K-token
prefill chunk of one sequence per call; host wall time per call, ctypes
overhead included, and the device time between events around the calls)
and the memory held per token (attn_kv_cache_get_info: K and V bytes of a
token, and the pages in use x page size x that, per token held).

With --variants every case is also timed with each variant of the decode
kernel (ATTN_CUDA_DECODE_KERNEL x ATTN_CUDA_DECODE_STAGES x
ATTN_CUDA_DECODE_SPLIT x ATTN_CUDA_DECODE_PDL, read at plan creation; and
each kernel x stages once more without a split), one plan each over the
same cache and Q, outputs compared with the default's. The variants, the
default plan and cuDNN are timed in the same interleaved rounds, and each
variant's ratio to the default and to cuDNN is the median of its per-round
ratios: one run says which variant wins, and by more than the spread or
not. --variant-match keeps the variants whose label contains one of the
given strings (separated by ';'). The main table's libattn column is the
default.

Usage: bench_decode.py [--lib build/src/libattn.so] [--out results.md] [--quick] [--rounds N]
                       [--variants] [--variant-match 'sm90-bulk, 2 stages;no split'] [--no-queue]
                       [--no-sweep] [--no-append] [--cases 32x8K,4x64K,1x128K]
"""
import argparse
import ctypes
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # attn_ffi, from any working directory
from attn_ffi import (ATTN_BACKEND_CUDA, ATTN_DTYPE_BF16, ATTN_KV_LAYOUT_HND,  # noqa: E402
                      ATTN_KV_LAYOUT_NHD, DecodeConfig, DecodePlanInfo, DecodeStepInfo, KvCacheConfig,
                      KvCacheInfo, Lib, rel_err, sized)


class PagedCache:
    """A CUDA cache holding k, v ([B, L, H_kv, d]) of B sequences (ids 0 .. B - 1), one context each."""

    def __init__(self, lib, ctx, k, v, page_size, layout):
        self.lib, self.ctx, dl = lib, ctx, lib.dll
        B, L, hkv, d = k.shape
        self.B, self.L = B, L
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        cfg = KvCacheConfig(ctypes.sizeof(KvCacheConfig), ATTN_DTYPE_BF16, layout, page_size,
                            B * ((L + page_size - 1) // page_size), hkv, d, d, 0, 0)
        self.handle = ctypes.c_void_p()
        lib.check(dl.attn_kv_cache_create(ctx, ctypes.byref(cfg), None, 0, ctypes.byref(self.handle)), "cache")
        self.ids = (ctypes.c_int64 * B)(*range(B))
        for i in range(B):
            lib.check(dl.attn_kv_cache_add_sequence(self.handle, i), "add")
        counts = (ctypes.c_int32 * B)(*([L] * B))
        lib.check(dl.attn_kv_cache_append(self.handle, B, self.ids, counts, ctypes.c_void_p(k.data_ptr()),
                                          ctypes.c_void_p(v.data_ptr()), stream), "append")

    def close(self):
        self.lib.dll.attn_kv_cache_destroy(self.handle)


class PagedDecode:
    """A decode plan over `cache` for one query per sequence with kv_chunk_tokens = chunk, prepared in its own
    workspace; the environment at creation picks the kernel variant. Several may share one cache."""

    def __init__(self, cache, hq, chunk, env=None):
        lib, dl, B = cache.lib, cache.lib.dll, cache.B
        self.lib, self.cache = lib, cache
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        dc = DecodeConfig(ctypes.sizeof(DecodeConfig), hq, B, 1, cache.L, chunk, 0.0, 0.0)
        self.plan = ctypes.c_void_p()
        saved = {var: os.environ.get(var) for var in env or {}}
        os.environ.update(env or {})
        try:
            lib.check(dl.attn_decode_plan_create(cache.ctx, cache.handle, ctypes.byref(dc),
                                                 ctypes.byref(self.plan)), "plan")
        finally:
            for var, val in saved.items():
                if val is None:
                    del os.environ[var]
                else:
                    os.environ[var] = val
        try:
            ws = ctypes.c_size_t()
            lib.check(dl.attn_decode_plan_workspace_size(self.plan, ctypes.byref(ws)), "workspace size")
            self.ws_bytes = ws.value
            self.ws = torch.empty(max(ws.value, 1), dtype=torch.uint8, device="cuda")
            self.qlens = (ctypes.c_int32 * B)(*([1] * B))
            self.info = sized(DecodeStepInfo)
            lib.check(dl.attn_decode_prepare(self.plan, cache.handle, B, cache.ids, self.qlens,
                                             ctypes.c_void_p(self.ws.data_ptr()), self.ws_bytes,
                                             ctypes.byref(self.info), stream), "prepare")
            pi = sized(DecodePlanInfo)
            lib.check(dl.attn_decode_plan_describe(self.plan, ctypes.byref(pi)), "describe")
        except BaseException:
            dl.attn_decode_plan_destroy(self.plan)
            raise
        self.kernel = pi.kernel.decode()
        self.split_target = pi.split_target_tasks

    def execute(self, q, o):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.lib.check(self.lib.dll.attn_decode_execute(
            self.plan, self.cache.handle, ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(o.data_ptr()), None,
            ctypes.c_void_p(self.ws.data_ptr()), self.ws_bytes, stream), "execute")

    def close(self):
        self.lib.dll.attn_decode_plan_destroy(self.plan)
        self.ws = None


PAGE_SIZE = 16
# (batch, context, layout, page size); 32 x 8K with 64-token pages says what page granularity costs.
CASES = [(32, 8192, ATTN_KV_LAYOUT_HND, PAGE_SIZE), (32, 8192, ATTN_KV_LAYOUT_NHD, PAGE_SIZE),
         (32, 8192, ATTN_KV_LAYOUT_HND, 64),
         (4, 65536, ATTN_KV_LAYOUT_HND, PAGE_SIZE), (1, 131072, ATTN_KV_LAYOUT_HND, PAGE_SIZE)]
# Elements of the tensor copied to measure the device's copy bandwidth: 1 GiB of bf16.
COPY_ELEMENTS = 1 << 29

# The decode kernel's variants timed with --variants: (label, environment at plan creation), every
# kernel x pipeline stages x automatic split policy x programmatic launch of the combine kernel.
VARIANTS = tuple((f"{kernel}, {stages} stages, {split}{', pdl' if pdl == '1' else ''}",
                  {"ATTN_CUDA_DECODE_KERNEL": kernel, "ATTN_CUDA_DECODE_STAGES": stages,
                   "ATTN_CUDA_DECODE_SPLIT": split, "ATTN_CUDA_DECODE_PDL": pdl})
                 for kernel in ("sm80", "sm90-bulk", "sm90-bulk32", "sm90-tensor") for stages in ("2", "3") for split in ("waves", "balanced")
                 for pdl in ("0", "1"))

# And each kernel x stages without a split (kv_chunk_tokens -1: one block per sequence and KV head).
NO_SPLIT_VARIANTS = tuple((f"{kernel}, {stages} stages, no split",
                           {"ATTN_CUDA_DECODE_KERNEL": kernel, "ATTN_CUDA_DECODE_STAGES": stages})
                          for kernel in ("sm80", "sm90-bulk", "sm90-bulk32", "sm90-tensor") for stages in ("2", "3"))

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


# Cycles of the spinning kernel that each timed call is queued behind: about 1 ms at the H200's 1.98 GHz,
# far more than the host needs to queue two events and one call (tens of us).
QUEUE_SLEEP_CYCLES = 2_000_000
MAX_SLEEP_CYCLES = 64 * QUEUE_SLEEP_CYCLES
# Untimed calls of a runner at the start of its turn in a round, after another runner's data filled L2.
ROUND_WARMUP = 3


class DeviceTimer:
    """timer(fn, warmup, reps): the median (the upper one for an even reps) of reps CUDA-event timings of one
    fn() call each, in ms, after warmup untimed calls.

    Queued (the default): before each timed call a kernel that spins for `cycles` is launched, then the start
    event, the call and the end event are queued behind it, so the start event fires when the spin ends with
    the call already waiting: the events time the device's work alone. Around a call issued to an idle device
    (attn_ffi.time_ms, queued=False) they would also time the host's launch path (Python, ctypes, the SDPA
    dispatcher and cuDNN's graph lookup: tens of us, different for each runner, against ~270 us of decode at
    32 x 8K). A call whose start event had already fired when the host finished queueing it (the spin was too
    short) counts in `gaps` and is timed again behind a spin twice as long (kept once the spin reaches
    MAX_SLEEP_CYCLES); `calls` counts every timed call."""

    def __init__(self, queued):
        self.sleep = getattr(torch.cuda, "_sleep", None) if queued else None
        self.cycles = QUEUE_SLEEP_CYCLES
        self.gaps = self.calls = 0

    def describe(self):
        if self.sleep is None:
            return "events around each call issued to an idle device (host launch time included)"
        return (f"each call queued behind a spinning kernel (torch.cuda._sleep, {QUEUE_SLEEP_CYCLES} cycles or "
                f"more), so the events time the device alone; {self.gaps} of {self.calls} timed calls found the "
                f"device idle when queued, each then timed again behind a spin twice as long up to "
                f"{MAX_SLEEP_CYCLES} cycles (spin now {self.cycles} cycles)")

    def __call__(self, fn, warmup, reps):
        for _ in range(warmup):
            fn()
        times = []
        while len(times) < reps:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.sleep is not None:
                self.sleep(self.cycles)
            e0.record()
            fn()
            e1.record()
            gap = self.sleep is not None and e0.query()
            e1.synchronize()
            self.calls += 1
            if gap:
                self.gaps += 1
                if self.cycles < MAX_SLEEP_CYCLES:  # time it again behind a longer spin
                    self.cycles = min(2 * self.cycles, MAX_SLEEP_CYCLES)
                    continue
            times.append(e0.elapsed_time(e1))
        times.sort()
        return times[len(times) // 2]


def interleaved(timer, runners, rounds, warmup, reps):
    """{name: [ms of round 0, round 1, ...]} for each (name, fn) of runners, timed in turns.

    The device drifts over minutes (clocks, temperature, a neighbour's load on the host): one runner timed
    once, minutes after another, gave ratios from 0.89 to 1.01 for the same code. So every runner is warmed
    up (warmup calls), then in each of `rounds` rounds each is timed once (ROUND_WARMUP untimed calls, then
    the median of reps), back to back: within a round all see nearly the same device. The order rotates by
    one each round, so that no runner is always the first after the warm-up or always follows the same one."""
    for _, fn in runners:
        for _ in range(warmup):
            fn()
    ms = {name: [] for name, _ in runners}
    n = len(runners)
    for r in range(rounds):
        for i in range(n):
            name, fn = runners[(r + i) % n]
            ms[name].append(timer(fn, min(ROUND_WARMUP, warmup), reps))
    return ms


def median_range(values):
    """(median, min, max) of values; NaN for none."""
    vs = sorted(values)
    if not vs:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(vs), vs[0], vs[-1]


def per_round_ratios(ours_ms, their_ms):
    """Our speed over theirs (their time over ours), round by round."""
    return [t / o for o, t in zip(ours_ms, their_ms)]


def fmt(x):
    return "n/a" if x != x else f"{x:.2f}"


def variant_row(row):
    """A row of the variants table from (case, layout, label, kernel, TB/s, split, rel. L2, vs default, vs cuDNN),
    each of the last three but rel. L2 a (median, min, max)."""
    c, lay, label, kern, t, split, err, rd, rc = row
    return (f"| {c} | {lay} | {label} | {kern} | {fmt(t[0])} | {split} | {err} | {fmt_range(t)} | {fmt(rd[0])} | "
            f"{fmt_range(rd)} | {fmt(rc[0])} | {fmt_range(rc)} |")


def fmt_range(mr):
    """'min-max' of a (median, min, max)."""
    return "n/a" if mr[1] != mr[1] else f"{mr[1]:.2f}-{mr[2]:.2f}"


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
    ap.add_argument("--quick", action="store_true", help="3 rounds of 10 calls after 3 warm-up")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default 7, 3 with --quick)")
    ap.add_argument("--variants", action="store_true",
                    help="also time the decode kernel variants (VARIANTS) on every case, interleaved with the "
                         "default and cuDNN")
    ap.add_argument("--variant-match", default="",
                    help="with --variants: only the variants whose label contains one of these strings, separated "
                         "by ';' (labels hold commas), e.g. 'sm90-bulk, 2 stages;no split'")
    ap.add_argument("--no-queue", action="store_true",
                    help="time each call issued to an idle device (host launch time included), as before")
    ap.add_argument("--no-sweep", action="store_true", help="skip the fixed kv_chunk_tokens sweep")
    ap.add_argument("--no-append", action="store_true", help="skip the append table")
    ap.add_argument("--cases", default="", help="comma-separated batch x context cases, e.g. 32x8K,4x64K")
    args = ap.parse_args()
    lib = Lib(args.lib)
    ctx = lib.context(ATTN_BACKEND_CUDA, 0, 1)
    hq, hkv, d, ps = 32, 8, 128, PAGE_SIZE
    cases = CASES
    if args.cases:  # e.g. "32x8K,4x64K": those batch x context cases only (every layout and page size)
        wanted = {c.strip() for c in args.cases.split(",")}
        cases = [c for c in cases if f"{c[0]}x{c[1] // 1024}K" in wanted]
    warmup, reps = (3, 10) if args.quick else (10, 50)
    rounds = args.rounds or (3 if args.quick else 7)
    variant_runs = [(label, env, 0) for label, env in VARIANTS]
    variant_runs += [(label, env, -1) for label, env in NO_SPLIT_VARIANTS]
    if args.variant_match:
        wanted = [w.strip() for w in args.variant_match.split(";") if w.strip()]
        variant_runs = [r for r in variant_runs if any(w in r[0] for w in wanted)]
    commit = os.environ.get("ATTN_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    timer = DeviceTimer(queued=not args.no_queue)
    # Copy bandwidth: read + write of 1 GiB.
    big = torch.empty(COPY_ELEMENTS, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(big)
    copy_ms = timer(lambda: dst.copy_(big), warmup, reps)
    copy_bytes = big.numel() * big.element_size()
    copy_tbs = 2 * copy_bytes / (copy_ms * 1e-3) / 1e12
    del big, dst
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
    l2_text = f"{l2_bytes / 2**20:.0f} MiB" if l2_bytes else "size not reported"
    elem = torch.empty(1, dtype=torch.bfloat16, device="cuda").element_size()
    smallest = min((2 * B * L * hkv * d * elem for B, L, _, _ in cases), default=0) / 2**20

    def method(timing):
        return (f"Method: for each case libattn and each PyTorch backend are timed in {rounds} interleaved rounds "
                f"(after {warmup} warm-up calls each; in a round each runs {ROUND_WARMUP} untimed calls then "
                f"{reps} timed ones, back to back, the order rotated by one every round), so that all see the "
                f"same state of the device. A round's figure is the median of its {reps} CUDA-event timings of "
                f"one call each; timing: {timing}. Each TB/s column is the median over the rounds, its min-max "
                f"column the spread over the rounds; each ratio (ours/X) is the median of the per-round ratios, "
                f"with their min-max. The K/V of every case (>= {smallest:.0f} MiB) are many times L2 "
                f"({l2_text}): a call finds at most what the previous one left there in cache.")
    lines = [f"# Paged decode: libattn CUDA vs PyTorch SDPA, {datetime.date.today()}", "",
             f"commit `{commit}`, {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, d = {d}, "
             f"heads q/kv {hq}/{hkv}, one query token per sequence, libattn page size {ps} unless stated; "
             f"TB/s of K/V bytes read (unique bytes for every column). "
             f"Device copy (read + write, {copy_bytes / 2**30:g} GiB): {copy_tbs:.2f} TB/s.", "",
             method(timer.describe()), "",
             "| batch x context | libattn layout | libattn TB/s | split (units) | torch FA2 TB/s | torch cuDNN TB/s "
             "| ours/FA2 | ours/cuDNN | rel. L2 vs SDPA | kernel | libattn min-max | FA2 min-max | cuDNN min-max "
             "| ours/FA2 min-max | ours/cuDNN min-max |",
             "|---|---|---:|---|---:|---:|---:|---:|---|---|---|---|---|---|---|"]
    method_line = 4  # the method paragraph, rewritten at the end with the timer's final account
    print("\n".join(lines), flush=True)
    torch.manual_seed(0)
    sweep, variants = [], []
    tbs_of = lambda kv_bytes, ms: [kv_bytes / (m * 1e-3) / 1e12 for m in ms]  # noqa: E731
    for B, L, layout, page in cases:
        case = f"{B} x {L // 1024}K"
        k = torch.randn(B, L, hkv, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(B, L, hkv, d, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(B, hq, d, dtype=torch.bfloat16, device="cuda")
        o = torch.full_like(q, float("nan"))
        cache = PagedCache(lib, ctx, k, v, page, layout)
        pd = PagedDecode(cache, hq, 0)
        kv_bytes = 2 * B * L * hkv * d * elem
        assert abs(pd.info.kv_bytes_read - kv_bytes) < 1, (pd.info.kv_bytes_read, kv_bytes)
        pd.execute(q, o)
        torch.cuda.synchronize()
        o_ref = o.clone()
        lname = ("HND" if layout == ATTN_KV_LAYOUT_HND else "NHD") + ("" if page == ps else f", page {page}")
        # SDPA on contiguous [B, H_kv, L, d] K/V.
        kc, vc = k.permute(0, 2, 1, 3).contiguous(), v.permute(0, 2, 1, 3).contiguous()
        del k, v
        q4 = q.view(B, hq, 1, d)
        torch_fns, hows, errs = {}, {}, []
        for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            fn, hows[name] = sdpa_runner(be, q4, kc, vc, hq)
            if fn is not None:
                errs.append(f"{name} {rel_err(o_ref, fn().view(B, hq, d)):.1e}")
                torch_fns[name] = fn
        ours_fn = lambda pd=pd: pd.execute(q, o)  # noqa: E731
        ms = interleaved(timer, [("ours", ours_fn)] + list(torch_fns.items()), rounds, warmup, reps)
        ours = median_range(tbs_of(kv_bytes, ms["ours"]))
        res, rat = {}, {}
        for name in ("fa2", "cudnn"):
            res[name] = median_range(tbs_of(kv_bytes, ms.get(name, [])))
            rat[name] = median_range(per_round_ratios(ms["ours"], ms[name]) if name in ms else [])
        note = lambda name: "" if hows[name] == "enable_gqa" else f" ({hows[name]})"  # noqa: E731
        lines.append(f"| {case} | {lname} | {fmt(ours[0])} | {split_label(pd.info)} | "
                     f"{fmt(res['fa2'][0])}{note('fa2')} | {fmt(res['cudnn'][0])}{note('cudnn')} | "
                     f"{fmt(rat['fa2'][0])} | {fmt(rat['cudnn'][0])} | {', '.join(errs)} | {pd.kernel} | "
                     f"{fmt_range(ours)} | {fmt_range(res['fa2'])} | {fmt_range(res['cudnn'])} | "
                     f"{fmt_range(rat['fa2'])} | {fmt_range(rat['cudnn'])} |")
        print(lines[-1], flush=True)
        if layout == ATTN_KV_LAYOUT_HND and page == ps and not args.no_sweep and SPLIT_SWEEP.get((B, L)):
            # Fixed splits next to the automatic one (target: split_target_tasks blocks at once), interleaved.
            plans = []
            try:
                for chunk in SPLIT_SWEEP[(B, L)]:
                    plans.append(PagedDecode(cache, hq, chunk))
                    o.fill_(float("nan"))
                    plans[-1].execute(q, o)
                    torch.cuda.synchronize()
                    plans[-1].err = f"{rel_err(o, o_ref):.1e}"
                runners = [("auto", ours_fn)] + [(i, lambda p=p: p.execute(q, o)) for i, p in enumerate(plans)]
                sms = interleaved(timer, runners, rounds, warmup, reps)
                auto = median_range(tbs_of(kv_bytes, sms["auto"]))
                sweep.append((case, f"auto (target {pd.split_target} blocks)", split_label(pd.info), auto, "-",
                              (1.0, 1.0, 1.0)))
                for i, (chunk, p) in enumerate(zip(SPLIT_SWEEP[(B, L)], plans)):
                    sweep.append((case, chunk, split_label(p.info), median_range(tbs_of(kv_bytes, sms[i])), p.err,
                                  median_range(per_round_ratios(sms[i], sms["auto"]))))
            finally:
                for p in plans:
                    p.close()
        if args.variants and variant_runs:
            # The kernel variants (tuning environment variables, read at plan creation), same cache and Q,
            # interleaved with the default plan and cuDNN.
            plans = []
            try:
                for label, env, chunk in variant_runs:
                    plans.append(PagedDecode(cache, hq, chunk, env))
                    o.fill_(float("nan"))
                    plans[-1].execute(q, o)
                    torch.cuda.synchronize()
                    plans[-1].err = f"{rel_err(o, o_ref):.1e}"
                runners = [("default", ours_fn)] + [(i, lambda p=p: p.execute(q, o)) for i, p in enumerate(plans)]
                runners += [("cudnn", torch_fns["cudnn"])] if "cudnn" in torch_fns else []
                vms = interleaved(timer, runners, rounds, warmup, reps)
                vs_cudnn = lambda key: median_range(  # noqa: E731
                    per_round_ratios(vms[key], vms["cudnn"]) if "cudnn" in vms else [])
                variants.append((case, lname, "default", pd.kernel, median_range(tbs_of(kv_bytes, vms["default"])),
                                 split_label(pd.info), "-", (1.0, 1.0, 1.0), vs_cudnn("default")))
                for i, ((label, _, _), p) in enumerate(zip(variant_runs, plans)):
                    variants.append((case, lname, label, p.kernel, median_range(tbs_of(kv_bytes, vms[i])),
                                     split_label(p.info), p.err, median_range(per_round_ratios(vms[i], vms["default"])),
                                     vs_cudnn(i)))
                print("\n".join("variant: " + variant_row(row) for row in variants[-len(plans) - 1:]), flush=True)
            finally:
                for p in plans:
                    p.close()
        pd.close()
        cache.close()
        runners = ours_fn = None  # their closures hold the case's tensors
        del kc, vc, q, o, q4, torch_fns
        torch.cuda.empty_cache()
    if sweep:
        lines += ["", "Split-KV choices (HND; same cache and Q; libattn TB/s of K/V read, interleaved rounds as "
                  "above: median over rounds, min-max; vs auto: median of per-round ratios to the automatic split; "
                  "-1: never split):", "",
                  "| batch x context | kv_chunk_tokens | split (units) | libattn TB/s | rel. L2 vs auto | min-max "
                  "| vs auto | vs auto min-max |",
                  "|---|---|---|---:|---|---|---:|---|"]
        lines += [f"| {c} | {k} | {s} | {fmt(t[0])} | {e} | {fmt_range(t)} | {fmt(r[0])} | {fmt_range(r)} |"
                  for c, k, s, t, e, r in sweep]
        print("\n".join(lines[-len(sweep) - 2:]), flush=True)
    if variants:
        lines += ["", "Decode kernel variants (ATTN_CUDA_DECODE_KERNEL, ATTN_CUDA_DECODE_STAGES, "
                  "ATTN_CUDA_DECODE_SPLIT, ATTN_CUDA_DECODE_PDL; automatic split, or none where the variant says "
                  "so; same cache and Q; libattn TB/s of K/V read). Each case's variants, the default plan and "
                  "cuDNN are timed in the same interleaved rounds: TB/s median over rounds and min-max; vs default "
                  "and vs cuDNN: median of per-round ratios and min-max:", "",
                  "| batch x context | layout | variant | kernel | libattn TB/s | split (units) | rel. L2 vs default "
                  "| min-max | vs default | vs default min-max | vs cuDNN | vs cuDNN min-max |",
                  "|---|---|---|---|---:|---|---|---|---:|---|---:|---|"]
        lines += [variant_row(row) for row in variants]
        best = {}
        for row in variants:
            key = (row[0], row[1])
            if key not in best or row[4][0] > best[key][4][0]:
                best[key] = row
        lines += ["", "Fastest variant per case (median over rounds): " +
                  "; ".join(f"{c} {lay}: {r[2]} ({r[4][0]:.2f} TB/s, {fmt(r[8][0])} of cuDNN)"
                            for (c, lay), r in best.items())]
        print("\n".join(lines[-len(variants) - 4:]), flush=True)
    lines[method_line] = method(timer.describe())
    print(lines[method_line], flush=True)

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
