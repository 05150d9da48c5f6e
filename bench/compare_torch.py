#!/usr/bin/env python3
"""libattn's CUDA backend next to PyTorch's SDPA backends, in one process.

libattn is loaded through ctypes and runs on the very tensors PyTorch uses
(BSHD memory; SDPA gets the [B, H, L, d] transposed view of it), on PyTorch's
current stream. For each case it checks that libattn's output (and gradients,
when the plan supports the backward pass) agree with SDPA's, then times both
with CUDA events (warm-up, median of many runs; the tensors are larger than
the L2 cache) and reports TFLOP/s counted on visible pairs: forward
4 * pairs * d, backward 2.5 x forward.

With --lib-before, a second libattn (say, built from an earlier commit) runs
on the same tensors in the same process, so that a change is measured
against its baseline in one run ("before" columns and after/before ratios).
GQA cases (query heads sharing KV heads; SDPA with enable_gqa) follow the
dense ones unless --no-gqa.

Usage: compare_torch.py [--lib build/src/libattn.so] [--lib-before old/libattn.so]
                        [--out results.md] [--quick] [--no-gqa]
"""
import argparse
import datetime
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # attn_ffi, from any working directory
from attn_ffi import (ATTN_BACKEND_CUDA, ATTN_DTYPE_BF16, ATTN_DTYPE_FP16,  # noqa: E402
                      ATTN_MASK_CAUSAL, ATTN_MASK_NONE, ATTN_PASSES_FORWARD,
                      ATTN_PASSES_FORWARD_BACKWARD, ATTN_STATUS_NOT_SUPPORTED, AttnError, Lib, Plan,
                      rel_err, time_ms)


def sdpa_backends():
    out = [("torch-fa2", SDPBackend.FLASH_ATTENTION)]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        out.append(("torch-cudnn", SDPBackend.CUDNN_ATTENTION))
    return out


def make_plan(lib, ctx, b, hq, hkv, L, d, dtype, causal):
    """A forward + backward plan, or a forward one where the backward is not supported."""
    kind = {"dtype": ATTN_DTYPE_BF16 if dtype == torch.bfloat16 else ATTN_DTYPE_FP16,
            "mask": ATTN_MASK_CAUSAL if causal else ATTN_MASK_NONE}
    try:
        return Plan(lib, ctx, b, hq, hkv, L, d, passes=ATTN_PASSES_FORWARD_BACKWARD, **kind), True
    except AttnError as e:
        if e.status != ATTN_STATUS_NOT_SUPPORTED:
            raise
        return Plan(lib, ctx, b, hq, hkv, L, d, passes=ATTN_PASSES_FORWARD, **kind), False


def run_case(libs, d, L, causal, hq, hkv, dtype, warmup, reps):
    """libs: [(name, Lib, context)], the library under test first."""
    b = max(1, 16384 // L)
    gen = torch.Generator(device="cuda").manual_seed(1234 + d + L + int(causal) + 7 * hkv)
    q, do = (torch.randn(b, L, hq, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, L, hkv, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    gqa = {"enable_gqa": True} if hq != hkv else {}
    pairs = b * hq * (L * (L + 1) // 2 if causal else L * L)
    fwd_flop = 4.0 * pairs * d
    rows = []
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa).transpose(1, 2)
        qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2),
                                             vr.transpose(1, 2), is_causal=causal, **gqa)
        grads = torch.autograd.grad(out, (qr, kr, vr), do.transpose(1, 2))
    del out, qr, kr, vr
    kernel, errs, ok = "", "", True
    for name, lib, ctx in libs:
        plan, want_bwd = make_plan(lib, ctx, b, hq, hkv, L, d, dtype, causal)
        assert abs(plan.info.flops_forward - fwd_flop) < 1e-6 * fwd_flop, "pair count differs"
        o = torch.full_like(q, float("nan"))
        lse = torch.full((b, hq, L), float("nan"), device="cuda", dtype=torch.float32)
        plan.forward(q, k, v, o, lse)
        err_o = rel_err(o, ref)
        case_ok = err_o < 2e-2 and not torch.isnan(o).any().item()
        case_errs = f"O {err_o:.1e}"
        if want_bwd:
            dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
            plan.backward(q, k, v, o, lse, do, dq, dk, dv)
            e = [rel_err(x, y) for x, y in zip((dq, dk, dv), grads)]
            case_errs += " dQ %.1e dK %.1e dV %.1e" % tuple(e)
            case_ok = case_ok and max(e) < 5e-2
        if not kernel:  # the library under test
            kernel, errs = plan.info.kernel.decode(), case_errs
        ok = ok and case_ok
        t = time_ms(lambda: plan.forward(q, k, v, o, lse), warmup, reps)
        rows.append((name, "fwd", t, fwd_flop / t / 1e9))
        if want_bwd:
            t = time_ms(lambda: plan.backward(q, k, v, o, lse, do, dq, dk, dv), warmup, reps)
            rows.append((name, "bwd", t, 2.5 * fwd_flop / t / 1e9))
        plan.close()
    for name, be in sdpa_backends():
        try:
            with sdpa_kernel(be):
                t = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa),
                            warmup, reps)
                rows.append((name, "fwd", t, fwd_flop / t / 1e9))
                qr, kr, vr = (x.detach().clone().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
                out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, **gqa)
                g = do.transpose(1, 2)
                t = time_ms(lambda: torch.autograd.grad(out, (qr, kr, vr), g, retain_graph=True),
                            warmup, reps)
                rows.append((name, "bwd", t, 2.5 * fwd_flop / t / 1e9))
        except RuntimeError as ex:  # backend unavailable for this shape
            rows.append((name, "n/a", float("nan"), float("nan")))
            print(f"  {name}: {str(ex).splitlines()[0]}", file=sys.stderr)
    return kernel, errs, ok, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.environ.get("LIBATTN", "build/src/libattn.so"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--lib-before", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-gqa", action="store_true")
    args = ap.parse_args()
    libs = []
    for name, path in (("libattn", args.lib), ("before", args.lib_before)):
        if path is None:
            continue
        lib = Lib(path)
        libs.append((name, lib, lib.context(ATTN_BACKEND_CUDA, 0, 1)))
    before = len(libs) > 1
    # (d, L, causal, heads_q, heads_kv): heads = 2048 / d, GQA 8 query heads per KV head.
    cases = [(d, L, c, 2048 // d, 2048 // d)
             for d in (64, 128) for L in (1024, 2048, 4096, 8192, 16384) for c in (False, True)]
    if args.quick:
        cases = [(128, 8192, False, 16, 16), (128, 16384, True, 16, 16), (64, 8192, False, 32, 32)]
    if not args.no_gqa:
        cases += [(128, 8192, c, 16, 2) for c in (True, False)] + [(64, 8192, True, 32, 4)]
    warmup, reps = (3, 10) if args.quick else (5, 30)
    # ATTN_COMMIT names the commit where the tree's own .git cannot (a copy
    # of the tree, or a stale .git beside it); otherwise ask git.
    commit = os.environ.get("ATTN_COMMIT")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
            if subprocess.run(["git", "diff", "--quiet", "HEAD"]).returncode:
                commit += "-dirty"
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    lines = [f"# libattn CUDA vs PyTorch SDPA, {datetime.date.today()}", "",
             f"commit `{commit}`, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"bf16, batch x seqlen = 16K, heads = 2048/d (GQA: heads q/kv), BSHD; median of {reps} "
             f"after {warmup} warm-up; TFLOP/s on visible pairs (fwd 4*pairs*d, bwd 2.5x)."
             + (f" 'before': {args.lib_before}, same process and tensors." if before else ""), "",
             "| d | L | mask | heads q/kv | pass | libattn TFLOP/s |" + (" before | after/before |" if before else "")
             + " torch FA2 | torch cuDNN | ours/FA2 | ours/cuDNN | agreement (rel. L2 vs FA2) | kernel |",
             "|---|---|---|---|---|---:|" + ("---:|---:|" if before else "") + "---:|---:|---:|---:|---|---|"]
    all_ok = True
    nan = float("nan")
    for d, L, causal, hq, hkv in cases:
        kernel, errs, ok, rows = run_case(libs, d, L, causal, hq, hkv, torch.bfloat16, warmup, reps)
        all_ok &= ok
        by = {(r[0], r[1]): r[3] for r in rows}
        for ps in ("fwd", "bwd"):
            ours = by.get(("libattn", ps), nan)
            old = by.get(("before", ps), nan)
            fa2, cud = by.get(("torch-fa2", ps), nan), by.get(("torch-cudnn", ps), nan)
            ratio = lambda a, b: f"{a / b:.2f}" if b == b and b > 0 else "n/a"
            lines.append(f"| {d} | {L} | {'causal' if causal else 'full'} | {hq}/{hkv} | {ps} | {ours:.1f} | "
                         + (f"{old:.1f} | {ratio(ours, old)} | " if before else "")
                         + f"{fa2:.1f} | {cud:.1f} | {ratio(ours, fa2)} | {ratio(ours, cud)} | "
                         f"{errs}{'' if ok else ' MISMATCH'} | {kernel} |")
        print(lines[-2] + "\n" + lines[-1], flush=True)
    for _, lib, ctx in libs:
        lib.dll.attn_context_destroy(ctx)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
