#!/usr/bin/env python3
"""libattn's MoBA plans on CUDA next to its own dense causal plan, in one process.

MoBA (attn_plan_desc_set_moba) at L = 32K and 128K, bf16, d = 128, batch 1,
16 heads (--heads-q / --heads-kv for GQA, --shared for one selection per
group), for a few (block size, top_k) pairs. Each forward and backward is
timed end to end: the selector (pooled keys, gates, top-k, block lists,
written into the workspace) and the attention kernel, as attn_forward and
attn_backward run them (the backward selects again). The dense causal plan
of the same shape runs on the very same tensors. Libattn is called through
ctypes on PyTorch's current stream; CUDA events, warm-up, median.

"pairs" is the share of the causal (query, key) pairs MoBA's rule keeps at
most (attn_plan_describe's visible_pairs, an upper bound: the selection
depends on the data); "speed-up" is the dense plan's time over MoBA's.
Inputs: independent normal entries by default, so that the 128 rows of a
query tile pick unrelated blocks and their union (what a tile visits) is
nearly every past block; --coherent adds to Q a component that is constant
over runs of 256 tokens (and to K one per 256 tokens), so that neighbouring
rows pick the same blocks, as the queries of trained models tend to.

Each MoBA configuration runs once per backward schedule (--schedules):
"union", the dK/dV kernel visits the query tiles in which some row chose
the block; "gather", it visits tiles of the rows that chose it
(ATTN_CUDA_MOBA_GATHER=1 at plan creation; the kernel name says
"-moba-gather"). The forward is the same in both.

A plan whose top_k covers every past block computes plain causal attention:
its "err" column is the largest relative L2 difference of O, dQ, dK and dV
from the dense plan (a check that the run-time path is right on this GPU).

Usage: bench_moba.py --lib build/src/libattn.so [--out results.md] [--reps 5]
                     [--seqlens 32768,131072] [--heads-q 16 --heads-kv 16] [--shared]
                     [--coherent] [--schedules union,gather]
"""
import argparse
import ctypes
import datetime
import os
import sys

import torch

ATTN_BACKEND_CUDA = 2
ATTN_DTYPE_BF16 = 2
ATTN_LAYOUT_BSHD = 0
ATTN_MASK_CAUSAL = 1
ATTN_PASSES_FORWARD_BACKWARD = 3
ATTN_PASS_FORWARD, ATTN_PASS_BACKWARD = 1, 2

vp, i32, i64, u64, sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t
P = ctypes.POINTER


class PlanInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", u64), ("backend", i32), ("dtype", i32), ("tile_q", i32), ("tile_kv", i32),
        ("num_threads", i32), ("supports_backward", i32), ("workspace_bytes_forward", u64),
        ("workspace_bytes_backward", u64), ("visible_pairs", u64), ("flops_forward", ctypes.c_double),
        ("flops_backward", ctypes.c_double), ("bytes_forward", ctypes.c_double),
        ("bytes_backward", ctypes.c_double), ("algorithm", ctypes.c_char * 64),
        ("kernel", ctypes.c_char * 64), ("visited_tile_pairs", u64), ("total_tile_pairs", u64),
        ("block_q", i32), ("block_kv", i32),
    ]


class Lib:
    def __init__(self, path):
        self.dll = ctypes.CDLL(path)
        sig = {
            "attn_status_string": ([i32], ctypes.c_char_p),
            "attn_last_error_message": ([], ctypes.c_char_p),
            "attn_context_create": ([i32, i32, i32, P(vp)], i32),
            "attn_context_destroy": ([vp], i32),
            "attn_plan_desc_create": ([P(vp)], i32),
            "attn_plan_desc_destroy": ([vp], i32),
            "attn_plan_desc_set_shape": ([vp, i64, i64, i64, i64, i64, i64, i64], i32),
            "attn_plan_desc_set_dtype": ([vp, i32], i32),
            "attn_plan_desc_set_layout": ([vp, i32], i32),
            "attn_plan_desc_set_mask": ([vp, i32, i64, i64], i32),
            "attn_plan_desc_set_passes": ([vp, i32], i32),
            "attn_plan_desc_set_moba": ([vp, i64, i64, i32], i32),
            "attn_plan_create": ([vp, vp, P(vp)], i32),
            "attn_plan_destroy": ([vp], i32),
            "attn_plan_workspace_size": ([vp, i32, P(sz)], i32),
            "attn_plan_describe": ([vp, P(PlanInfo)], i32),
            "attn_forward": ([vp, vp, vp, vp, vp, vp, vp, sz, vp], i32),
            "attn_backward": ([vp] + [vp] * 9 + [vp, sz, vp], i32),
        }
        for name, (args, res) in sig.items():
            f = getattr(self.dll, name)
            f.argtypes, f.restype = args, res

    def check(self, status, what):
        if status != 0:
            raise RuntimeError(f"{what}: {self.dll.attn_status_string(status).decode()}: "
                               f"{self.dll.attn_last_error_message().decode()}")


class Plan:
    """A causal bf16 BSHD plan, MoBA when block > 0, with its two workspaces."""

    def __init__(self, lib, ctx, L, hq, hkv, d, block=0, top_k=0, shared=False):
        dl = lib.dll
        self.lib = lib
        desc = vp()
        lib.check(dl.attn_plan_desc_create(ctypes.byref(desc)), "desc")
        try:
            lib.check(dl.attn_plan_desc_set_shape(desc, 1, hq, hkv, L, L, d, d), "shape")
            lib.check(dl.attn_plan_desc_set_dtype(desc, ATTN_DTYPE_BF16), "dtype")
            lib.check(dl.attn_plan_desc_set_layout(desc, ATTN_LAYOUT_BSHD), "layout")
            lib.check(dl.attn_plan_desc_set_mask(desc, ATTN_MASK_CAUSAL, -1, -1), "mask")
            lib.check(dl.attn_plan_desc_set_passes(desc, ATTN_PASSES_FORWARD_BACKWARD), "passes")
            if block > 0:
                lib.check(dl.attn_plan_desc_set_moba(desc, block, top_k, 1 if shared else 0), "moba")
            self.handle = vp()
            lib.check(dl.attn_plan_create(ctx, desc, ctypes.byref(self.handle)), "plan_create")
        finally:
            dl.attn_plan_desc_destroy(desc)
        self.info = PlanInfo()
        self.info.struct_size = ctypes.sizeof(PlanInfo)
        lib.check(dl.attn_plan_describe(self.handle, ctypes.byref(self.info)), "describe")
        self.ws = {}
        for p in (ATTN_PASS_FORWARD, ATTN_PASS_BACKWARD):
            n = sz()
            lib.check(dl.attn_plan_workspace_size(self.handle, p, ctypes.byref(n)), "ws")
            self.ws[p] = (torch.empty(max(n.value, 1), dtype=torch.uint8, device="cuda"), n.value)

    def forward(self, q, k, v, o, lse):
        s = torch.cuda.current_stream().cuda_stream
        ws, n = self.ws[ATTN_PASS_FORWARD]
        self.lib.check(self.lib.dll.attn_forward(self.handle, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                 o.data_ptr(), lse.data_ptr(), ws.data_ptr(), n, s),
                       "forward")

    def backward(self, q, k, v, o, lse, do, dq, dk, dv):
        s = torch.cuda.current_stream().cuda_stream
        ws, n = self.ws[ATTN_PASS_BACKWARD]
        p = [t.data_ptr() for t in (q, k, v, o, lse, do, dq, dk, dv)]
        self.lib.check(self.lib.dll.attn_backward(self.handle, *p, ws.data_ptr(), n, s), "backward")

    def close(self):
        self.lib.dll.attn_plan_destroy(self.handle)
        self.ws.clear()


def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    ts.sort()
    return ts[len(ts) // 2]


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


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
                    help="backward schedules to time: union, gather or both")
    ap.add_argument("--commit", default=os.environ.get("ATTN_COMMIT", "unknown"))
    a = ap.parse_args()
    hq, hkv, d = a.heads_q, a.heads_kv, 128
    lib = Lib(a.lib)
    ctx = vp()
    lib.check(lib.dll.attn_context_create(ATTN_BACKEND_CUDA, 0, 0, ctypes.byref(ctx)), "context")
    # (block, top_k) per length; at 32K, block 4096 with top_k 12 covers all
    # 7 past blocks: plain causal, checked against the dense plan.
    combos = {32768: [(512, 3), (512, 12), (4096, 3), (4096, 12)],
              131072: [(512, 3), (512, 12), (4096, 3), (4096, 12)]}

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

        dense = Plan(lib, ctx, L, hq, hkv, d)
        dense.forward(q, k, v, o, lse)
        dense.backward(q, k, v, o, lse, do, dq, dk, dv)
        torch.cuda.synchronize()
        ref = [x.clone() for x in (o, dq, dk, dv)]
        d_f = time_ms(lambda: dense.forward(q, k, v, o, lse), 2, a.reps)
        d_b = time_ms(lambda: dense.backward(q, k, v, o, lse, do, dq, dk, dv), 2, a.reps)
        causal_pairs = dense.info.visible_pairs
        rows.append({"L": L, "cfg": "dense causal", "pairs": 1.0, "fwd": d_f, "bwd": d_b,
                     "dense_f": d_f, "dense_b": d_b, "kernel": dense.info.kernel.decode(),
                     "ws": dense.ws[ATTN_PASS_BACKWARD][1]})
        print(rows[-1], flush=True)
        dense.close()

        for (block, top_k), sched in ((c, s) for c in combos.get(L, [(512, 3), (4096, 3)])
                                      for s in a.schedules.split(",")):
            # Read by the library at plan creation.
            os.environ["ATTN_CUDA_MOBA_GATHER"] = "1" if sched == "gather" else "0"
            plan = Plan(lib, ctx, L, hq, hkv, d, block, top_k, a.shared)
            fwd = lambda: plan.forward(q, k, v, o, lse)
            bwd = lambda: plan.backward(q, k, v, o, lse, do, dq, dk, dv)
            fwd()
            bwd()
            torch.cuda.synchronize()
            row = {"L": L, "cfg": f"block {block} top {top_k} {sched}", "pairs": plan.info.visible_pairs / causal_pairs,
                   "kernel": plan.info.kernel.decode(), "dense_f": d_f, "dense_b": d_b,
                   "ws": max(plan.ws[ATTN_PASS_FORWARD][1], plan.ws[ATTN_PASS_BACKWARD][1])}
            if top_k >= (L + block - 1) // block - 1:
                row["err"] = max(rel_err(x, y) for x, y in zip((o, dq, dk, dv), ref))
            row["fwd"] = time_ms(fwd, 2, a.reps)
            row["bwd"] = time_ms(bwd, 2, a.reps)
            plan.close()
            rows.append(row)
            print(row, flush=True)
        del q, k, v, do, o, lse, dq, dk, dv, ref
        torch.cuda.empty_cache()

    sel = "shared per GQA group" if a.shared else "per head"
    sel += "; coherent inputs (a component shared by 256-token runs)" if a.coherent else \
        "; independent normal inputs"
    lines = [f"# MoBA CUDA plans vs the dense causal plan ({datetime.date.today()}, commit {a.commit})",
             "", f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {hq} query / {hkv} KV heads, "
             f"d = {d}, bf16, batch 1, causal; selection {sel}; median of {a.reps} timed runs after 2 "
             "warm-ups. MoBA times include the selection (each pass selects); 'pairs' = the most "
             "causal pairs MoBA keeps (visible_pairs / causal); err: max relative L2 difference of "
             "O, dQ, dK, dV from the dense plan where MoBA keeps every past block.",
             "", "| L | config | pairs | fwd ms | bwd ms | fwd+bwd ms | speed-up fwd | speed-up bwd | "
             "speed-up total | workspace MiB | err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tot, dtot = r["fwd"] + r["bwd"], r["dense_f"] + r["dense_b"]
        lines.append(
            f"| {r['L']} | {r['cfg']} | {r['pairs']:.3f} | {r['fwd']:.2f} | {r['bwd']:.2f} | {tot:.2f} | "
            f"{r['dense_f'] / r['fwd']:.2f} | {r['dense_b'] / r['bwd']:.2f} | {dtot / tot:.2f} | "
            f"{r['ws'] / 2**20:.1f} | {r.get('err', float('nan')):.1e} |")
    lines.append("")
    lines.append("Kernels: " + "; ".join(sorted({r["kernel"] for r in rows})))
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    lib.dll.attn_context_destroy(ctx)


if __name__ == "__main__":
    sys.exit(main())
