#!/usr/bin/env python3
"""One paged decode call of libattn and one of PyTorch's cuDNN SDPA on the same
K/V, for Nsight Compute (scripts/profile-decode.sh): batch 32 x 8K context, bf16,
d = 128, 32 query heads on 8 KV heads, page size 16, HND (bench_decode.py's first
case). Each runs 3 warm-up calls, then one call between
cudaProfilerStart/Stop, so that `ncu --profile-from-start off` sees those two
calls' kernels only.

Usage: profile_decode.py --lib build/src/libattn.so [--batch 32] [--context 8192]
"""
import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_ffi import ATTN_BACKEND_CUDA, ATTN_KV_LAYOUT_HND, Lib  # noqa: E402
from bench_decode import PAGE_SIZE, PagedCache, PagedDecode, sdpa_runner  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args()
    B, L, hq, hkv, d = args.batch, args.context, 32, 8, 128
    lib = Lib(args.lib)
    ctx = lib.context(ATTN_BACKEND_CUDA, 0, 1)
    torch.manual_seed(0)
    k = torch.randn(B, L, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, L, hkv, d, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(B, hq, d, dtype=torch.bfloat16, device="cuda")
    o = torch.empty_like(q)
    cache = PagedCache(lib, ctx, k, v, PAGE_SIZE, ATTN_KV_LAYOUT_HND)
    plan = PagedDecode(cache, hq, 0)
    kc, vc = k.permute(0, 2, 1, 3).contiguous(), v.permute(0, 2, 1, 3).contiguous()
    del k, v
    cudnn, how = sdpa_runner(SDPBackend.CUDNN_ATTENTION, q.view(B, hq, 1, d), kc, vc, hq)
    runners = [("libattn " + plan.kernel, lambda: plan.execute(q, o))]
    if cudnn is not None:
        runners.append((f"cuDNN ({how})", cudnn))
    for _, fn in runners:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _, fn in runners:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled, in order: " + "; ".join(name for name, _ in runners), flush=True)
    plan.close()
    cache.close()


if __name__ == "__main__":
    main()
