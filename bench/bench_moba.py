#!/usr/bin/env python3
"""libattn's MoBA plans on CUDA next to its own dense causal plan, in one process.

MoBA (attn_plan_desc_set_moba) at L = 32K and 128K, bf16, d = 128 (--head-dim), batch 1,
16 heads (--heads-q / --heads-kv for GQA, --shared for one selection per
group), for a few (block size, top_k) pairs. Each forward and backward is
timed end to end: the selector (pooled keys, gates, top-k, block lists,
written into the workspace) and the attention kernel, as attn_forward and
attn_backward run them (the backward selects again). The dense causal plan
of the same shape runs on the very same tensors. Libattn is called through
attn_ffi.py (ctypes) on PyTorch's current stream; CUDA events, warm-up,
median.

"pairs" is the share of the causal (query, key) pairs MoBA's rule keeps at
most (attn_plan_describe's visible_pairs, an upper bound: the selection
depends on the data); "speed-up" is the dense plan's time over MoBA's;
"rate/pair" is MoBA's rate per kept pair over the dense plan's (dense time
x pairs / MoBA time; 1 when the time follows the pairs kept).
Inputs: independent normal entries by default, so that the 128 rows of a
query tile pick unrelated blocks and their union (what a tile visits) is
nearly every past block; --coherent adds to Q a component that is constant
over runs of 256 tokens (and to K one per 256 tokens), so that neighbouring
rows pick the same blocks, as the queries of trained models tend to.

Each MoBA configuration runs once per variant: --variant NAME=VALUE[,NAME=
VALUE...] (repeatable) sets those environment variables while its plan is
created (the library reads its hooks there; variables another variant sets
are restored to their values outside this program), "" is the library's
defaults. E.g. on an sm_90 device --variant "" --variant
ATTN_CUDA_MOBA_GATHER_SM90=0,ATTN_CUDA_MOBA_GATHER_BWD_SM90=0 times the
gathered kernels on wgmma (the default there at d = 64 and 128) and on
mma.sync (sm_80) side by side, and --variant ATTN_CUDA_MOBA_SM90=1 the
wgmma kernels on the tile-union lists; the kernel column says which ran.
keep_selection=1 in a variant is no environment variable but the plan option
attn_plan_desc_set_moba_keep_selection: its backward reads the selection
the forward left in the workspace (both passes share one here).
Without --variant, one per schedule of --schedules, each on the kernels
the defaults pick for it: "union", the kernels visit the
query tiles in which some row chose the block (ATTN_CUDA_MOBA_GATHER=0);
"gather", tiles of the rows that chose it (ATTN_CUDA_MOBA_GATHER=1, the
kernel name says "-moba-gather"). (With ATTN_CUDA_MOBA_SM90=1, on sm_90
devices d = 64 and 128 plans run the wgmma kernels on the union lists
whatever ATTN_CUDA_MOBA_GATHER says.)

--kernels adds, per configuration, where one forward and one backward call
spend device time: torch.profiler (CUPTI) records every kernel the library
launches (the selector's, the attention's, the merges), summed per kernel
name with its launch count, so that the selection's share and the cost of
many small launches can be read next to the attention kernels'.

A plan whose top_k covers every past block computes plain causal attention,
and runs as the dense causal plan: its "err" column is the largest relative
L2 difference of O, dQ, dK and dV from the dense plan, which checks the
harness, not a MoBA kernel. For the selecting plans the benchmark checks
only that every output is written ("unwritten": non-finite outputs after
calls on NaN-filled buffers); their values are checked against fp64 by
tests/gpu/test_moba_gpu.

Usage: bench_moba.py --lib build/src/libattn.so [--out results.md] [--reps 5]
                     [--seqlens 32768,131072] [--heads-q 16 --heads-kv 16] [--shared]
                     [--coherent] [--schedules union,gather] [--head-dim 128]
                     [--variant "" --variant ATTN_CUDA_MOBA_SM90=1 ...] [--kernels]
                     [--combos 512:3,4096:12]
"""
import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # attn_ffi, from any working directory
from attn_ffi import ATTN_BACKEND_CUDA, Lib, Plan, rel_err, time_ms  # noqa: E402


def kernel_times(fn):
    """Device time per kernel name (ms, launches) of one call of fn, largest first."""
    import re

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if not us:
            continue
        # attn::flash::flash_fwd_kernel<__nv_bfloat16, 128, ...>(...) -> flash_fwd_kernel
        name = re.sub(r"[<(].*", "", e.key).split("::")[-1].strip() or e.key[:40]
        ms, n = totals.get(name, (0.0, 0))
        totals[name] = (ms + us / 1e3, n + e.count)
    return sorted(totals.items(), key=lambda kv: -kv[1][0])


# The spin each interleaved call waits behind (about 0.5 ms at H200 clocks,
# longer than a call's host launch path).
SPIN_CYCLES = 1_000_000


def interleaved(calls, reps, warmup=2):
    """[(forward, backward), ...] timed in rounds: each round one forward of
    every entry in turn, then one backward of each, every call queued behind a
    spinning kernel so that the CUDA events time the device alone. Returns the
    medians [(forward ms, backward ms), ...]."""
    for fwd, bwd in calls:
        for _ in range(warmup):
            fwd()
            bwd()
    spin = getattr(torch.cuda, "_sleep", None)
    times = [([], []) for _ in calls]
    for _ in range(reps):
        for pass_index in (0, 1):
            for i, pair in enumerate(calls):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if spin is not None:
                    spin(SPIN_CYCLES)
                e0.record()
                pair[pass_index]()
                e1.record()
                e1.synchronize()
                times[i][pass_index].append(e0.elapsed_time(e1))
    out = []
    for tf, tb in times:
        tf.sort()
        tb.sort()
        out.append((tf[len(tf) // 2], tb[len(tb) // 2]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out")
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--heads-q", type=int, default=16)
    ap.add_argument("--heads-kv", type=int, default=16)
    ap.add_argument("--shared", action="store_true", help="one selection per GQA group")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--coherent", action="store_true",
                    help="Q and K with a component shared by runs of 256 tokens")
    ap.add_argument("--schedules", default="union,gather",
                    help="without --variant: schedules to time: union, gather or both")
    ap.add_argument("--variant", action="append",
                    help='NAME=VALUE[,NAME=VALUE...] set at plan creation ("" = defaults); repeatable')
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kernels", action="store_true",
                    help="also profile one forward and one backward call per configuration")
    ap.add_argument("--combos",
                    help="BLOCK:TOP_K[,BLOCK:TOP_K...] instead of the default pairs per length")
    ap.add_argument("--commit", default=os.environ.get("ATTN_COMMIT", "unknown"))
    a = ap.parse_args()
    hq, hkv, d = a.heads_q, a.heads_kv, a.head_dim
    # (label, environment) per variant.
    # keep_selection=1 in a variant is the plan option
    # (attn_plan_desc_set_moba_keep_selection), not an environment variable.
    variants = []
    if a.variant:
        for spec in a.variant:
            env = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
            keep = env.pop("keep_selection", "0") == "1"
            variants.append((spec or "defaults", env, keep))
    else:
        for sched in a.schedules.split(","):
            variants.append((sched, {"ATTN_CUDA_MOBA_GATHER": "1" if sched == "gather" else "0"},
                             False))
    hook_names = sorted({n for _, env, _ in variants for n in env})
    outside = {n: os.environ.get(n) for n in hook_names}

    def set_hooks(env):
        for n in hook_names:
            value = env.get(n, outside[n])
            if value is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = value

    lib = Lib(a.lib)
    ctx = lib.context(ATTN_BACKEND_CUDA)
    # (block, top_k) per length; at 32K, block 4096 with top_k 12 covers all
    # 7 past blocks: plain causal, checked against the dense plan.
    combos = {32768: [(512, 3), (512, 12), (4096, 3), (4096, 12)],
              131072: [(512, 3), (512, 12), (4096, 3), (4096, 12)]}
    other = [(512, 3), (4096, 3)]  # other lengths
    if a.combos:
        other = [tuple(int(x) for x in c.split(":")) for c in a.combos.split(",")]
        combos = {}

    rows = []
    for L in (int(x) for x in a.seqlens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(7)
        q, do = (torch.randn(1, L, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                 for _ in range(2))
        k, v = (torch.randn(1, L, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        if a.coherent:
            runs = (L + 255) // 256
            for x, h in ((q, hq), (k, hkv)):
                c = torch.randn(1, runs, h, d, device="cuda", generator=gen).repeat_interleave(256, 1)
                x.mul_(0.5).add_((2.0 * c[:, :L]).to(torch.bfloat16))
        o = torch.empty_like(q)
        lse = torch.empty(1, hq, L, device="cuda", dtype=torch.float32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        dense = Plan(lib, ctx, 1, hq, hkv, L, d)
        dense.forward(q, k, v, o, lse)
        dense.backward(q, k, v, o, lse, do, dq, dk, dv)
        torch.cuda.synchronize()
        ref = [x.clone() for x in (o, dq, dk, dv)]
        # The dense plan's own outputs (the MoBA plans' are NaN-filled and checked).
        od, lsed, dqd, dkd, dvd = (x.clone() for x in (o, lse, dq, dk, dv))
        dense_fwd = lambda: dense.forward(q, k, v, od, lsed)
        dense_bwd = lambda: dense.backward(q, k, v, od, lsed, do, dqd, dkd, dvd)
        d_f = time_ms(dense_fwd, 2, a.reps)
        d_b = time_ms(dense_bwd, 2, a.reps)
        causal_pairs = dense.info.visible_pairs
        rows.append({"L": L, "cfg": "dense causal", "pairs": 1.0, "fwd": d_f, "bwd": d_b,
                     "dense_f": d_f, "dense_b": d_b, "kernel": dense.info.kernel.decode(),
                     "ws": dense.ws_bytes})
        print(rows[-1], flush=True)

        for (block, top_k), (label, env, keep) in ((c, v) for c in combos.get(L, other)
                                                   for v in variants):
            set_hooks(env)  # read by the library at plan creation
            plan = Plan(lib, ctx, 1, hq, hkv, L, d, moba=(block, top_k, a.shared),
                        keep_selection=keep)
            set_hooks({})
            fwd = lambda: plan.forward(q, k, v, o, lse)
            bwd = lambda: plan.backward(q, k, v, o, lse, do, dq, dk, dv)
            # NaN first: every output must be written (causal, lq = lk: every
            # row sees its own key). What is compared with a reference is only
            # the plan that keeps every block (below); tests/gpu/test_moba_gpu
            # checks the selecting kernels against fp64.
            for x in (o, lse, dq, dk, dv):
                x.fill_(float("nan"))
            fwd()
            bwd()
            torch.cuda.synchronize()
            unwritten = sum(int((~torch.isfinite(x)).sum()) for x in (o, lse, dq, dk, dv))
            row = {"L": L, "cfg": f"block {block} top {top_k} {label}", "pairs": plan.info.visible_pairs / causal_pairs,
                   "kernel": plan.info.kernel.decode(), "dense_f": d_f, "dense_b": d_b,
                   "ws": plan.ws_bytes, "unwritten": unwritten}
            if unwritten:
                print(f"NOT WRITTEN: {unwritten} non-finite outputs for {row['cfg']} at L = {L}",
                      flush=True)
            if top_k >= (L + block - 1) // block - 1:
                row["err"] = max(rel_err(x, y) for x, y in zip((o, dq, dk, dv), ref))
            # The MoBA plan and the dense one in interleaved rounds, each call
            # queued behind a spin: the clock states and the measuring order
            # (which move the dense plan by up to 10%) are the same for both,
            # so "rate/pair" compares like with like.
            (row["fwd"], row["bwd"]), (row["dense_f"], row["dense_b"]) = interleaved(
                [(fwd, bwd), (dense_fwd, dense_bwd)], a.reps)
            if a.kernels:
                row["kernels"] = {"fwd": kernel_times(fwd), "bwd": kernel_times(bwd)}
            plan.close()
            rows.append(row)
            print(row, flush=True)
        dense.close()
        del q, k, v, do, o, lse, dq, dk, dv, ref, od, lsed, dqd, dkd, dvd
        torch.cuda.empty_cache()

    sel = "shared per GQA group" if a.shared else "per head"
    sel += "; coherent inputs (a component shared by 256-token runs)" if a.coherent else \
        "; independent normal inputs"
    lines = [f"# MoBA CUDA plans vs the dense causal plan ({datetime.date.today()}, commit {a.commit})",
             "", f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {hq} query / {hkv} KV heads, "
             f"d = {d}, bf16, batch 1, causal; selection {sel}; median of {a.reps} timed runs after 2 "
             "warm-ups, each configuration interleaved with the dense plan (a round: the forward of "
             "each, then the backward of each, every call queued behind a spinning kernel), whose "
             "times on its row ('dense' columns) are from those rounds; the 'dense causal' row is "
             "timed back to back. MoBA times include the selection (each pass selects, but the backward of a "
             "keep_selection=1 variant, which reads the forward's); 'pairs' = the most "
             "causal pairs MoBA keeps (visible_pairs / causal); rate/pair: dense time x pairs / MoBA "
             "time; err: max relative L2 difference of "
             "O, dQ, dK, dV from the dense plan where MoBA keeps every past block (which then runs "
             "as the dense plan); unwritten: non-finite outputs after calls on NaN-filled buffers "
             "(the selecting plans' values are checked by tests/gpu/test_moba_gpu, not here).",
             "", "| L | config | pairs | fwd ms | bwd ms | fwd+bwd ms | speed-up fwd | speed-up bwd | "
             "speed-up total | rate/pair fwd | rate/pair bwd | workspace MiB | err | unwritten |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tot, dtot = r["fwd"] + r["bwd"], r["dense_f"] + r["dense_b"]
        lines.append(
            f"| {r['L']} | {r['cfg']} | {r['pairs']:.3f} | {r['fwd']:.2f} | {r['bwd']:.2f} | {tot:.2f} | "
            f"{r['dense_f'] / r['fwd']:.2f} | {r['dense_b'] / r['bwd']:.2f} | {dtot / tot:.2f} | "
            f"{r['dense_f'] * r['pairs'] / r['fwd']:.2f} | {r['dense_b'] * r['pairs'] / r['bwd']:.2f} | "
            f"{r['ws'] / 2**20:.1f} | {r.get('err', float('nan')):.1e} | {r.get('unwritten', '-')} |")
    lines.append("")
    lines.append("Kernels: " + "; ".join(sorted({r["kernel"] for r in rows})))
    if a.kernels:
        lines += ["", "## Where one call's device time goes (torch.profiler, one call each)", "",
                  "| L | config | pass | kernel | ms | launches |", "|---|---|---|---|---|---|"]
        for r in rows:
            for pass_name, per_kernel in r.get("kernels", {}).items():
                for name, (ms, n) in per_kernel:
                    lines.append(f"| {r['L']} | {r['cfg']} | {pass_name} | {name} | {ms:.3f} | {n} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    lib.dll.attn_context_destroy(ctx)
    return 3 if any(r.get("unwritten") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
