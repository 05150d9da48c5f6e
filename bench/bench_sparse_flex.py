#!/usr/bin/env python3
"""libattn's block-sparse CUDA plans next to FlexAttention, in one process.

The masks of issue 4, at L = 32K, 16 heads, d = 128, bf16, batch 1, all on
top of a causal mask:
  window-sinks  each query sees the 4096 keys up to itself and the 64 first
                keys (element-exact, not block-aligned at the window's start)
  random        a seeded 10% of the causal 128 x 128 blocks plus the diagonal
  bigbird       128 x 128 blocks: a window of 3 blocks (the row's block and
                its neighbours), 2 global key blocks (0, 1), 2 global query
                blocks (0, 1) and 3 random blocks per row
  causal        the dense causal plan (libattn without a block mask; for
                FlexAttention, its causal block mask)
libattn gets the same selection as FlexAttention: builders for window-sinks,
the block tables (attn_block_mask_set_blocks) for random and bigbird.
FlexAttention runs under torch.compile with one mask_mod for every case (its
tensors are rewritten between cases), so it is compiled once per pass.

Both run on the very same BSHD tensors (FlexAttention on the [B, H, L, d]
view), on PyTorch's current stream. libattn's output and gradients are
compared with FlexAttention's, then each pass is timed with CUDA events
(warm-up, median). TFLOP/s count visible pairs (forward 4 * pairs * d,
backward 2.5 x forward, from attn_plan_describe) and, in the "tile" columns,
every pair of the (query tile, KV tile) pairs the forward visits, which is
the rate the kernels run at on the work they do.
Where the plans run the sm_90a forward, a forward-only plan on the sm_80 one
(ATTN_CUDA_FWD_SM90=0 at its creation) is timed too, for the same ratios.

--variant NAME=VALUE[,NAME=VALUE...] (repeatable) times every sparse mask
once per variant with those environment variables set while its plan is
created (the CUDA backend's block-sparse tuning hooks, listed at the top of
src/cuda/cuda_backend.cpp: ATTN_CUDA_BSPARSE_FWD_PERSIST=1,
ATTN_CUDA_BSPARSE_BWD_PERSIST=1, ATTN_CUDA_BSPARSE_PREFETCH=1,
ATTN_CUDA_BSPARSE_ITEM=n, ATTN_CUDA_BWD_SM90_SPARSE=0 for the sm_80
block-sparse dK/dV kernel where the default is the sm_90a (wgmma) one,
"+bwd-wgmma-bs" in the kernel column; ATTN_CUDA_FWD_SM90_WS=1 for the
warp-specialised sm_90a forward); "" is the library's defaults. FlexAttention runs with the first
variant only. --dense-variants times the dense causal plan under every variant too.

Usage: bench_sparse_flex.py --lib build/src/libattn.so [--out results.md]
                            [--seqlen 32768] [--reps 10] [--no-flex] [--interleave]
                            [--variant "" --variant ATTN_CUDA_BWD_SM90_SPARSE=0,...]
"""
import argparse
import ctypes
import datetime
import os
import sys

import torch

# --interleave: the spin each timed call waits behind (about 0.5 ms at
# H200 clocks, longer than either side's host launch path).
SPIN_CYCLES = 1_000_000

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # attn_ffi, from any working directory
from attn_ffi import (ATTN_BACKEND_CUDA, ATTN_PASSES_FORWARD, Lib, Plan, rel_err,  # noqa: E402
                      time_ms)

vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
P = ctypes.POINTER


def block_tables(kind, nb, gen):
    """[nb, nb] bool block selection of the random and bigbird masks (causal blocks only)."""
    qb = torch.arange(nb).view(-1, 1)
    kb = torch.arange(nb).view(1, -1)
    causal = kb <= qb
    if kind == "random":
        return ((torch.rand(nb, nb, generator=gen) < 0.10) & causal) | (kb == qb)
    t = (kb - qb).abs() <= 1
    t |= kb < 2
    t |= qb < 2
    for r in range(nb):
        t[r, torch.randperm(nb, generator=gen)[:3]] = True
    return t & causal


def make_mask(lib, kind, L, table, block=128):
    dl = lib.dll
    m = vp()
    lib.check(dl.attn_block_mask_create(1, 1, L, L, block, block, ctypes.byref(m)), "mask create")
    if kind == "window-sinks":
        lib.check(dl.attn_block_mask_add_window(m, 4095, 0), "add_window")
        sinks = (i64 * 64)(*range(64))
        lib.check(dl.attn_block_mask_add_global_keys(m, sinks, 64), "add_global_keys")
    else:
        nb = table.shape[0]
        counts = table.sum(1).to(torch.int32)
        width = int(counts.max())
        idx = torch.full((nb, width), -1, dtype=torch.int32)
        for r in range(nb):
            cols = table[r].nonzero().flatten().to(torch.int32)
            idx[r, : cols.numel()] = cols
        counts, idx = counts.contiguous(), idx.contiguous()
        cp = counts.numpy().ctypes.data_as(P(i32))
        ip = idx.numpy().ctypes.data_as(P(i32))
        lib.check(dl.attn_block_mask_set_blocks(m, None, None, 0, None, cp, ip, width), "set_blocks")
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--commit", default=os.environ.get("ATTN_COMMIT", "unknown"))
    ap.add_argument("--variant", action="append",
                    help='NAME=VALUE[,NAME=VALUE...]: environment at plan creation ("": defaults)')
    ap.add_argument("--dense-variants", action="store_true",
                    help="time the dense causal plan under every variant too ('vs dense' stays "
                         "the first variant's)")
    ap.add_argument("--interleave", action="store_true",
                    help="time libattn's plans in turn, one call of each per round, instead of "
                         "each plan's calls back to back: the GPU's clock under these kernels "
                         "moves from launch to launch, and ratios between plans then see the "
                         "same clock states")
    ap.add_argument("--masks", default="causal,window-sinks,random,bigbird",
                    help="comma-separated subset of the masks, in this order (without causal "
                         "the 'vs dense' columns are empty)")
    a = ap.parse_args()
    kinds = [k for k in ("causal", "window-sinks", "random", "bigbird") if k in a.masks.split(",")]
    variants = []
    for spec in a.variant or [""]:
        env = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
        variants.append((spec, env))
    L, H, d, B = a.seqlen, a.heads, 128, 128
    nb = (L + B - 1) // B
    lib = Lib(a.lib)
    ctx = lib.context(ATTN_BACKEND_CUDA, 0, 0)

    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, do = (torch.randn(1, L, H, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    o = torch.empty_like(q)
    lse = torch.empty(1, H, L, device="cuda", dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    flex = None
    if not a.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # A mask_mod per case over its own tensors: with --interleave every
        # case's FlexAttention calls are replayed after the last case is made,
        # and tensors shared between cases (rewritten in place) would give the
        # earlier cases the last one's mask and fail their saved backward.
        def make_mask_mod(sel, win, sinks):
            def mask_mod(b, h, qi, kj):
                return (qi >= kj) & (sel[qi // B, kj // B] | (qi - kj < win) | (kj < sinks))
            return mask_mod

        flex = torch.compile(flex_attention, dynamic=False)

    cpu_gen = torch.Generator().manual_seed(2024)
    rows = []
    kept = []  # --interleave: (row, plan, fwd, bwd, info, tile flops, bwd tile flops)
    flex_kept = []  # --interleave: (row, FlexAttention forward, backward)
    mismatches = []  # masks whose outputs differ from FlexAttention's
    dense = None
    runs = []  # (mask kind, its block table, variant index)
    for kind in ("causal", "window-sinks", "random", "bigbird"):
        # Drawn for every mask, so that a subset runs the same tables.
        table = block_tables(kind, nb, cpu_gen) if kind in ("random", "bigbird") else None
        if kind not in kinds:
            continue
        one = kind == "causal" and not a.dense_variants
        runs += [(kind, table, vi) for vi in range(1 if one else len(variants))]
    for kind, table, vi in runs:
        spec, env = variants[vi] if kind != "causal" or a.dense_variants else ("", {})
        mask = None if kind == "causal" else make_mask(lib, kind, L, table)
        saved = {n: os.environ.get(n) for n in env}
        os.environ.update(env)
        try:
            plan = Plan(lib, ctx, 1, H, H, L, d, block_mask=mask)
        finally:
            for n, old in saved.items():
                if old is None:
                    del os.environ[n]
                else:
                    os.environ[n] = old
        info = plan.info
        plan80 = None
        if info.kernel.decode().startswith("cuda-sm90"):
            # The same forward on the sm_80 kernel (the variable is read at plan creation).
            saved = os.environ.get("ATTN_CUDA_FWD_SM90")
            os.environ["ATTN_CUDA_FWD_SM90"] = "0"
            try:
                plan80 = Plan(lib, ctx, 1, H, H, L, d, block_mask=mask, passes=ATTN_PASSES_FORWARD)
            finally:
                if saved is None:
                    del os.environ["ATTN_CUDA_FWD_SM90"]
                else:
                    os.environ["ATTN_CUDA_FWD_SM90"] = saved
        if mask is not None:
            lib.dll.attn_block_mask_destroy(mask)
        fwd = lambda: plan.forward(q, k, v, o, lse)
        bwd = lambda: plan.backward(q, k, v, o, lse, do, dq, dk, dv)
        # NaN first: the comparison with FlexAttention below reads these
        # outputs, and rows a plan left unwritten must not pass on the
        # previous plan's values.
        for x in (o, lse, dq, dk, dv):
            x.fill_(float("nan"))
        fwd()
        bwd()
        torch.cuda.synchronize()
        # (--interleave: timed after the loop, every plan in turn; NaN until then)
        t_f = float("nan") if a.interleave else time_ms(fwd, 3, a.reps)
        t_b = float("nan") if a.interleave else time_ms(bwd, 3, a.reps)
        tile_flops = 4.0 * info.visited_tile_pairs * info.tile_q * info.tile_kv * d
        # The backward's "tile" rate counts the sm_80 forward's tiles (128x64) where
        # both exist, as results before the sm_90a forward did.
        i_b = plan80.info if plan80 is not None else info
        tile_flops_b = 4.0 * i_b.visited_tile_pairs * i_b.tile_q * i_b.tile_kv * d
        label = kind if not spec else f"{kind} [{spec}]"
        row = {"mask": label, "kernel": info.kernel.decode(), "pairs": info.visible_pairs,
               "tile": f"{info.tile_q}x{info.tile_kv}",
               "density": info.visible_pairs / (H * L * (L + 1) / 2),
               "tiles": f"{info.visited_tile_pairs}/{info.total_tile_pairs}",
               "fwd": t_f, "bwd": t_b,
               "tf_f": info.flops_forward / t_f / 1e9, "tf_b": info.flops_backward / t_b / 1e9,
               "tile_f": tile_flops / t_f / 1e9, "tile_b": 2.5 * tile_flops_b / t_b / 1e9}
        if kind == "causal" and vi == 0:
            dense = row
        if flex is not None and vi == 0:
            try:
                sel = (table.cuda() if table is not None
                       else torch.zeros(nb, nb, dtype=torch.bool, device="cuda"))
                if kind == "causal":
                    sel.fill_(True)
                win = torch.tensor(4096 if kind == "window-sinks" else 0, dtype=torch.int64,
                                   device="cuda")
                sinks = torch.tensor(64 if kind == "window-sinks" else 0, dtype=torch.int64,
                                     device="cuda")
                mask_mod = make_mask_mod(sel, win, sinks)
                try:  # compiled: the eager path materialises all L x L pairs
                    bm = create_block_mask(mask_mod, None, None, L, L, device="cuda", BLOCK_SIZE=B,
                                           _compile=True)
                except TypeError:
                    bm = create_block_mask(mask_mod, None, None, L, L, device="cuda", BLOCK_SIZE=B)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (qt, kt, vt))
                out = flex(qr, kr, vr, block_mask=bm)
                grads = torch.autograd.grad(out, (qr, kr, vr), do.transpose(1, 2), retain_graph=True)
                torch.cuda.synchronize()
                row["err"] = max(rel_err(o, out.transpose(1, 2)),
                                 *(rel_err(g1, g2.transpose(1, 2)) for g1, g2 in zip((dq, dk, dv), grads)))
                if not row["err"] <= 2e-2:  # (NaN too) bf16 on both sides: ~3e-3 when equal
                    mismatches.append(f"{kind}: relative difference {row['err']:.2e}")
                # Timed with grad enabled as in the first call (another grad mode
                # would compile again); the forward then also keeps its LSE.
                flex_f = lambda bm=bm, qr=qr, kr=kr, vr=vr: flex(qr, kr, vr, block_mask=bm)
                flex_b = lambda out=out, qr=qr, kr=kr, vr=vr: torch.autograd.grad(
                    out, (qr, kr, vr), do.transpose(1, 2), retain_graph=True)
                if a.interleave:
                    # In the same rounds as libattn's plans (after the loop):
                    # the measuring order moves the timings by up to 10%.
                    flex_kept.append((row, flex_f, flex_b))
                else:
                    row["flex_fwd"] = time_ms(flex_f, 3, a.reps)
                    row["flex_bwd"] = time_ms(flex_b, 3, a.reps)
                del grads
            except Exception as e:  # keep libattn's numbers
                print(f"FlexAttention failed on {kind}: {type(e).__name__}: {e}", flush=True)
        if plan80 is not None:
            info80 = plan80.info
            fwd80 = lambda: plan80.forward(q, k, v, o, lse)
            fwd80()  # after the comparison with FlexAttention: it rewrites o
            torch.cuda.synchronize()
            row["fwd80"] = time_ms(fwd80, 3, a.reps)
            row["tile_f80"] = (4.0 * info80.visited_tile_pairs * info80.tile_q * info80.tile_kv * d /
                               row["fwd80"] / 1e9)
            row["kernel80"] = info80.kernel.decode()
            plan80.close()
        rows.append(row)
        if a.interleave:
            # Each plan its own O and LSE (this mask's forward's), so that its
            # backward reads them; bound now, as the loop's fwd and bwd would see
            # whichever plan the name holds last.
            o_i, lse_i = o.clone(), lse.clone()
            kept.append((row, plan, lambda pl=plan, o_i=o_i, l_i=lse_i: pl.forward(q, k, v, o_i, l_i),
                         lambda pl=plan, o_i=o_i, l_i=lse_i: pl.backward(q, k, v, o_i, l_i, do, dq, dk, dv),
                         info, tile_flops, tile_flops_b))
            continue
        plan.close()
        print(row, flush=True)

    if kept:
        # Round r times one forward of every kept plan in turn (libattn's, then
        # FlexAttention's), then one backward of each.
        calls = [(fwd, bwd) for _, _, fwd, bwd, *_ in kept] + [(f, b) for _, f, b in flex_kept]
        for fwd, bwd in calls:
            for _ in range(3):
                fwd()
                bwd()
        times = [([], []) for _ in calls]
        # Each timed call queued behind a spinning kernel, so that the start
        # event fires with the call already waiting: the events then time the
        # device alone, not each side's host launch path (ctypes here; Dynamo
        # guards and autograd for FlexAttention), tens of microseconds against
        # calls of 0.4 ms and up.
        spin = getattr(torch.cuda, "_sleep", None)
        for _ in range(a.reps):
            for pass_index in (0, 1):
                for i, (fwd, bwd) in enumerate(calls):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    if spin is not None:
                        spin(SPIN_CYCLES)
                    e0.record()
                    (fwd if pass_index == 0 else bwd)()
                    e1.record()
                    e1.synchronize()
                    times[i][pass_index].append(e0.elapsed_time(e1))
        for (row, _, _), (ff, fb) in zip(flex_kept, times[len(kept):]):
            ff.sort()
            fb.sort()
            row["flex_fwd"], row["flex_bwd"] = ff[len(ff) // 2], fb[len(fb) // 2]
        for (row, plan, _, _, info, tile_flops, tile_flops_b), (tf, tb) in zip(kept, times):
            tf.sort()
            tb.sort()
            t_f, t_b = tf[len(tf) // 2], tb[len(tb) // 2]  # medians, as time_ms
            row.update({"fwd": t_f, "bwd": t_b,
                        "tf_f": info.flops_forward / t_f / 1e9, "tf_b": info.flops_backward / t_b / 1e9,
                        "tile_f": tile_flops / t_f / 1e9, "tile_b": 2.5 * tile_flops_b / t_b / 1e9})
            plan.close()
            print(row, flush=True)

    if dense is None:  # no causal run: empty 'vs dense' columns
        dense = {"tile": "-", "tile_f": float("nan"), "tile_b": float("nan")}
    lines = [f"# Block-sparse CUDA plans vs FlexAttention ({datetime.date.today()}, commit {a.commit})",
             "", f"{torch.cuda.get_device_name()}, torch {torch.__version__}; L = {L}, {H} heads, "
             f"d = {d}, bf16, batch 1, causal; median of {a.reps} timed runs after 3 warm-ups"
             + (" (interleaved: each round one call of every plan in turn, libattn's and "
                "FlexAttention's, forwards then backwards, each queued behind a spinning kernel of "
                f"{SPIN_CYCLES} cycles so that the events time the device alone; the sm80 columns "
                "back to back)." if a.interleave else "."),
             "TFLOP/s on visible pairs (fwd 4 * pairs * d, bwd 2.5x); 'tile' TFLOP/s count every pair "
             f"of the visited forward tiles ({dense['tile']} for the dense plan; see the kernels "
             "below; 'tile bwd': the sm_80 forward's tiles where it is timed too); "
             "'vs dense' = tile TFLOP/s / the dense causal "
             "plan's tile TFLOP/s; err = max relative L2 difference of O, dQ, dK, dV from FlexAttention. "
             "sm80 columns: the forward on the sm_80 kernel (ATTN_CUDA_FWD_SM90=0), its tiles.",
             "", "| mask | density | tiles visited | ours fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | "
             "tile fwd | tile bwd | vs dense fwd | vs dense bwd | flex fwd ms | flex bwd ms | err | "
             "sm80 fwd ms | sm80 tile fwd | sm80 vs dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['mask']} | {r['density']:.3f} | {r['tiles']} | {r['fwd']:.3f} | {r['bwd']:.3f} | "
            f"{r['tf_f']:.0f} | {r['tf_b']:.0f} | {r['tile_f']:.0f} | {r['tile_b']:.0f} | "
            f"{r['tile_f'] / dense['tile_f']:.2f} | {r['tile_b'] / dense['tile_b']:.2f} | "
            f"{r.get('flex_fwd', float('nan')):.3f} | {r.get('flex_bwd', float('nan')):.3f} | "
            f"{r.get('err', float('nan')):.1e} | {r.get('fwd80', float('nan')):.3f} | "
            f"{r.get('tile_f80', float('nan')):.0f} | "
            f"{r.get('tile_f80', float('nan')) / dense.get('tile_f80', float('nan')):.2f} |")
    lines.append("")
    lines.append("Kernels (forward tile): " +
                 "; ".join(f"{r['mask']}: {r['kernel']} ({r['tile']})" for r in rows))
    if any("kernel80" in r for r in rows):
        lines.append("sm80 columns: " + "; ".join(f"{r['mask']}: {r['kernel80']}"
                                                  for r in rows if "kernel80" in r))
    if mismatches:
        lines.append("")
        lines.append("MISMATCH with FlexAttention (above 2e-2): " + "; ".join(mismatches))
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 3 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
