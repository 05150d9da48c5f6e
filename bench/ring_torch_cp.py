#!/usr/bin/env python3
"""PyTorch's context-parallel SDPA ring, timed per rank as bench/ring_bench.cpp times ours.

torch.distributed.tensor.experimental.context_parallel shards Q/K/V over the ranks of a
DeviceMesh and replaces F.scaled_dot_product_attention with a ring: each rank keeps its query
shard, K/V shards rotate (all-to-all or all-gather: set_rotate_method), each step runs
FlashAttention-2 (forced here with sdpa_kernel(SDPBackend.FLASH_ATTENTION)) and merges its
(O, LSE) in fp32. For causal attention its head-tail load balancer gives rank r the chunks r
and 2N-1-r of 2N (our zigzag layout); full attention is sharded contiguously (the ring refuses
load balancing without is_causal).

Per rank, with CUDA events on the rank's stream, --warmup untimed and --repeat timed calls,
median (min); before every call the rank drains its stream and meets the others at a barrier:
  - ring fwd     the forward under torch.no_grad() (O only)
  - ring bwd     torch.autograd.grad of one forward's O (retain_graph): the ring backward alone
  - ring fwdbwd  forward then backward
  - comp fwd/bwd the ring's own SDPA calls on the rank's GPU (same shapes, same is_causal, in
                 the ring's order), without communication, merge or accumulation
Before timing, a small problem (--check-tokens) is run through the same ring and compared
with single-GPU SDPA over the whole sequence (O, dQ, dK, dV after context_parallel_unshard).

Run:  torchrun --standalone --nproc-per-node 2 bench/ring_torch_cp.py
  or  python3 bench/ring_torch_cp.py   (spawns one process per GPU itself)
Output (rank 0, stdout): 'meta,KEY,VALUE', 'check,...' and 'csv,...' lines, each csv kind
after a header line whose second field is the column name list, then a markdown table.
Exit status 0 also when torch, two GPUs or context_parallel are missing (a 'SKIP:' line says
why), so that a script running this after our benchmark still finishes; 1 on a failure.
"""
import os

# NVLink multicast stays off on the shared multi-GPU machines (NCCL, PyTorch's symmetric
# memory, NVSHMEM): set before torch and NCCL read them.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

PROG = "ring_torch_cp"


def skip(reason):
    print(f"SKIP: {PROG}: {reason}", flush=True)
    sys.exit(0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens-per-rank", type=int, default=65536)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--configs", default="causal,full",
                   help="comma list of causal (head-tail load-balanced) and full")
    p.add_argument("--rotate", default="alltoall,allgather",
                   help="comma list of set_rotate_method values to time")
    p.add_argument("--passes", default="fwd,bwd,fwdbwd", help="comma list of fwd, bwd, fwdbwd")
    p.add_argument("--no-compute-only", action="store_true", help="skip the compute-only timing")
    p.add_argument("--check-tokens", type=int, default=4096,
                   help="global length of the correctness check (0: none)")
    a = p.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    a.rotate = [r for r in a.rotate.split(",") if r]
    a.passes = [s for s in a.passes.split(",") if s]
    bad = ([c for c in a.configs if c not in ("causal", "full")] +
           [r for r in a.rotate if r not in ("alltoall", "allgather")] +
           [s for s in a.passes if s not in ("fwd", "bwd", "fwdbwd")])
    if bad or a.repeat < 1 or a.warmup < 0 or a.tokens_per_rank < 2 or a.check_tokens < 0:
        p.error(f"bad values: {bad or 'counts'}")
    return a


# ---------------------------------------------------------------------------------------------
# The torch API this needs, found or reported
# ---------------------------------------------------------------------------------------------

def find_context_parallel():
    """(module holding context_parallel, _cp_options, set_rotate_method and
    context_parallel_unshard; its name; the public context_parallel's module) or
    (None, reasons, None). The options must be read from the module whose ring reads them, so
    the module that defines the public context_parallel is tried first."""
    reasons = []
    public_module = None
    try:
        from torch.distributed.tensor.experimental import context_parallel as public
        public_module = getattr(public, "__module__", None)
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to report
        reasons.append(f"torch.distributed.tensor.experimental.context_parallel: {e!r}")
    candidates = [public_module] if public_module else []
    candidates += ["torch.distributed.tensor.experimental._context_parallel._attention",
                   "torch.distributed.tensor.experimental._attention"]
    need = ("context_parallel", "_cp_options", "set_rotate_method", "context_parallel_unshard")
    for name in dict.fromkeys(candidates):
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            reasons.append(f"{name}: {e!r}")
            continue
        missing = [n for n in need if not hasattr(mod, n)]
        opts = getattr(mod, "_cp_options", None)
        if not missing and not hasattr(opts, "enable_load_balance"):
            missing.append("_cp_options.enable_load_balance")
        if missing:
            reasons.append(f"{name} lacks {', '.join(missing)}")
            continue
        return mod, name, public_module
    return None, reasons, None


# ---------------------------------------------------------------------------------------------
# Per rank
# ---------------------------------------------------------------------------------------------

def ring_calls(rank, world, causal, load_balance, lq, lk):
    """The SDPA calls torch's ring makes on `rank` (as its _templated_ring_attention does):
    a list of (query rows, key rows, is_causal). Step 0 is the local block (causal when the
    mask is); with head-tail balancing, a later step from an earlier source runs all local
    queries on the first half of the arriving keys, and from a later source the second half of
    the local queries on all of them; without balancing, later sources are skipped."""
    calls = []
    for i in range(world):
        if not causal:
            calls.append((lq, lk, False))
        elif i == 0:
            calls.append((lq, lk, True))
        elif not load_balance:
            if (rank - i) % world < rank:
                calls.append((lq, lk, False))
        elif i <= rank:
            calls.append((lq, lk // 2, False))
        else:
            calls.append((lq // 2, lk, False))
    return calls


def pairs_of(calls, heads):
    return heads * sum(q * (q + 1) // 2 if c else q * k for q, k, c in calls)


class Rank:
    def __init__(self, args, torch, dist, mesh, cp_mod, local_rank):
        self.a, self.torch, self.dist, self.mesh, self.cp = args, torch, dist, mesh, cp_mod
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = local_rank
        self.dev = torch.device("cuda", local_rank)
        self.original_sdpa = torch.nn.functional.scaled_dot_product_attention
        from torch.nn.attention import SDPBackend, sdpa_kernel
        self.flash = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)

    # Inputs: magnitude in [0.1, 1), either sign, as ring_bench's; the same on every rank
    # (same seed), so that each rank can compute the single-GPU reference of the check.
    def random(self, shape, seed):
        t = self.torch
        g = t.Generator(device=self.dev)
        g.manual_seed(seed)
        mag = 0.1 + 0.9 * t.rand(shape, generator=g, device=self.dev, dtype=t.float32)
        sign = t.where(t.rand(shape, generator=g, device=self.dev) < 0.5, -1.0, 1.0)
        return (mag * sign).to(t.bfloat16)

    def sync(self):
        self.torch.cuda.synchronize(self.dev)
        self.dist.barrier(device_ids=[self.local_rank])
        self.torch.cuda.synchronize(self.dev)

    def time(self, fn):
        """(median, min) ms of fn over --repeat calls after --warmup, each from a barrier."""
        t = self.torch
        for _ in range(self.a.warmup):
            self.sync()
            fn()
        ms = []
        for _ in range(self.a.repeat):
            self.sync()
            e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ms.append(e0.elapsed_time(e1))
        self.sync()
        return statistics.median(ms), min(ms)

    def sdpa(self, q, k, v, causal):
        # Looked up at each call: inside context_parallel the attribute is the ring.
        return self.torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def set_options(self, causal, rotate):
        self.cp._cp_options.enable_load_balance = causal
        self.cp.set_rotate_method(rotate)

    def run_ring(self, total, causal, rotate, seed, timed, check):
        """One context_parallel scope over a global sequence of `total` tokens. Returns
        (timings {pass: (median, min)}, check errors or None, finite)."""
        t, a = self.torch, self.a
        self.set_options(causal, rotate)
        shape = (1, a.heads, total, a.head_dim)  # BHSD: the ring shards dim 2
        q, k, v, g = (self.random(shape, seed + i) for i in range(4))
        errors = None
        ref = None
        if check:
            ql, kl, vl = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
            with self.flash():
                o = self.sdpa(ql, kl, vl, causal)
            ref = (o.detach(), *t.autograd.grad(o, (ql, kl, vl), g))
            del ql, kl, vl, o
        timings = {}
        finite = True
        with self.cp.context_parallel(self.mesh, buffers=[q, k, v, g], buffer_seq_dims=[2] * 4,
                                      no_restore_buffers={q, k, v, g}):
            # q, k, v, g are now this rank's shards (1, heads, total / world, d)
            ql, kl, vl = (x.detach().requires_grad_(True) for x in (q, k, v))
            with self.flash():
                out = self.sdpa(ql, kl, vl, causal)
                grads = t.autograd.grad(out, (ql, kl, vl), g, retain_graph=True)
                finite = bool(t.isfinite(out).all()) and all(bool(t.isfinite(x).all())
                                                             for x in grads)
                if check:
                    got = self.cp.context_parallel_unshard(self.mesh, [out.detach(), *grads],
                                                           [2] * 4)
                    errors = [float((x.float() - r.float()).norm() / r.float().norm())
                              for x, r in zip(got, ref)]
                if timed:
                    if "fwd" in a.passes:
                        def fwd():
                            with t.no_grad():
                                self.sdpa(ql, kl, vl, causal)
                        timings["fwd"] = self.time(fwd)
                    if "bwd" in a.passes:
                        timings["bwd"] = self.time(
                            lambda: t.autograd.grad(out, (ql, kl, vl), g, retain_graph=True))
                    if "fwdbwd" in a.passes:
                        def fwdbwd():
                            o = self.sdpa(ql, kl, vl, causal)
                            t.autograd.grad(o, (ql, kl, vl), g)
                        timings["fwdbwd"] = self.time(fwdbwd)
            del out, grads, ql, kl, vl
        del q, k, v, g, ref
        t.cuda.empty_cache()
        return timings, errors, finite

    def run_compute_only(self, causal, seed):
        """The ring's SDPA calls on this rank's GPU, back to back, without communication."""
        t, a = self.torch, self.a
        n = a.tokens_per_rank
        calls = ring_calls(self.rank, self.world, causal, causal, n, n)
        blocks = []
        for j, (lq, lk, c) in enumerate(calls):
            q = self.random((1, a.heads, lq, a.head_dim), seed + 4 * j).requires_grad_(True)
            k = self.random((1, a.heads, lk, a.head_dim), seed + 4 * j + 1).requires_grad_(True)
            v = self.random((1, a.heads, lk, a.head_dim), seed + 4 * j + 2).requires_grad_(True)
            g = self.random((1, a.heads, lq, a.head_dim), seed + 4 * j + 3)
            blocks.append((q, k, v, g, c))
        timings = {}
        with self.flash():
            def fwd():
                with t.no_grad():
                    for q, k, v, _, c in blocks:
                        self.sdpa(q, k, v, c)
            timings["fwd"] = self.time(fwd)
            outs = [self.sdpa(q, k, v, c) for q, k, v, _, c in blocks]

            def bwd():
                for o, (q, k, v, g, _) in zip(outs, blocks):
                    t.autograd.grad(o, (q, k, v), g, retain_graph=True)
            timings["bwd"] = self.time(bwd)
        del outs, blocks
        t.cuda.empty_cache()
        return timings, calls


def rank_main(args, local_rank):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(local_rank)
    # A rank that fails leaves its peer in a collective: a short timeout ends that wait.
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                            timeout=datetime.timedelta(minutes=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    cp_mod, cp_name, public_module = find_context_parallel()
    if cp_mod is None:
        if rank == 0:
            print(f"SKIP: {PROG}: context_parallel unavailable in torch {torch.__version__}: "
                  + "; ".join(cp_name), flush=True)
        dist.destroy_process_group()
        return 0
    mesh = init_device_mesh("cuda", (world,))
    r = Rank(args, torch, dist, mesh, cp_mod, local_rank)
    total = args.tokens_per_rank * world
    if total % (2 * world) != 0:
        raise SystemExit(f"{PROG}: tokens per rank must be even (head-tail: 2 chunks a rank)")
    rows, checks, failures = [], [], []
    seed = 20261130
    def attempt(what, fn):
        """fn() or None: a failure is recorded and the other cases still run (the ranks take
        the same code path, so they fail at the same point and stay in step)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            failures.append(f"{what} rank {rank}: {type(e).__name__}: {str(e)[:300]}")
            # The context manager does not restore SDPA when its body raises.
            restore = getattr(cp_mod, "_disable_context_parallel_dispatcher_impl", None)
            try:
                if restore is not None and torch.nn.functional.scaled_dot_product_attention \
                        is not r.original_sdpa:
                    restore()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return None

    def progress(msg):
        if rank == 0:
            print(f"{PROG}: {msg}", file=sys.stderr, flush=True)

    if args.check_tokens % (2 * world):
        raise SystemExit(f"{PROG}: --check-tokens must be a multiple of {2 * world}")
    for cfg in args.configs:
        causal = cfg == "causal"
        name = "causal_lb" if causal else "full"
        lq = args.tokens_per_rank
        pairs = pairs_of(ring_calls(rank, world, causal, causal, lq, lq), args.heads)
        for rotate in args.rotate:
            if args.check_tokens:
                res = attempt(f"check {name} {rotate}", lambda: r.run_ring(
                    args.check_tokens, causal, rotate, seed, False, True))
                if res is not None:
                    _, err, fin = res
                    ok = fin and all(e < 2e-2 for e in err)
                    checks.append((name, rotate, rank, *err, "ok" if ok else "FAIL"))
                    progress(f"check {name} {rotate}: rel err O, dQ, dK, dV {err}")
                    if not ok:
                        failures.append(f"check {name} {rotate} rank {rank}: rel err {err}")
            res = attempt(f"ring {name} {rotate}", lambda: r.run_ring(
                total, causal, rotate, seed + 100, True, False))
            if res is None:
                continue
            timings, _, fin = res
            if not fin:
                failures.append(f"ring {name} {rotate} rank {rank}: non-finite O or gradients")
            for p, (med, mn) in timings.items():
                rows.append(("torch_ring", name, rotate, rank, p, med, mn, pairs))
            progress(f"ring {name} {rotate}: " + ", ".join(
                f"{p} {med:.2f} ms" for p, (med, _) in timings.items()))
        if not args.no_compute_only:
            res = attempt(f"compute-only {name}", lambda: r.run_compute_only(causal, seed + 200))
            if res is not None:
                for p, (med, mn) in res[0].items():
                    rows.append(("torch_comp", name, "-", rank, p, med, mn, pairs))
                progress(f"compute-only {name}: " + ", ".join(
                    f"{p} {med:.2f} ms" for p, (med, _) in res[0].items()))

    gathered = [None] * world
    dist.all_gather_object(gathered, (rows, checks, failures))
    if rank == 0:
        report(args, torch, world, cp_name, public_module, gathered)
    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()
    return 1 if any(g[2] for g in gathered) else 0


def report(args, torch, world, cp_name, public_module, gathered):
    d = args.head_dim
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
    prop = torch.cuda.get_device_properties(0)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = [("date", when), ("torch", torch.__version__), ("cuda", torch.version.cuda),
            ("nccl", nccl), ("device", f"{world} x {prop.name}"),
            ("context_parallel_module", cp_name),
            ("public_context_parallel_module", public_module or "-"),
            ("problem", f"bf16 BHSD batch 1 heads {args.heads} d {d} "
                        f"{world} x {args.tokens_per_rank} = {world * args.tokens_per_rank} tokens"),
            ("timing", f"{args.warmup} warm-up + {args.repeat} timed calls, CUDA events, "
                       "median (min), stream drained and NCCL barrier before each call"),
            ("backend", "sdpa_kernel(SDPBackend.FLASH_ATTENTION)"),
            ("layout", "causal: head-tail load balancer (rank r: chunks r, 2N-1-r); "
                       "full: contiguous (no balancer)")]
    for k, v in meta:
        print(f"meta,{k},{v}")
    print("check,columns,config,rotate,rank,rel_err_o,rel_err_dq,rel_err_dk,rel_err_dv,result")
    for _, checks, _ in gathered:
        for c in checks:
            print("check," + ",".join(f"{x:.3e}" if isinstance(x, float) else str(x) for x in c))
    print("csv,columns,impl,config,rotate,rank,pass,median_ms,min_ms,pairs,tflops")
    table = []
    for rows, _, _ in gathered:
        for impl, cfg, rot, rank, p, med, mn, pairs in rows:
            scale = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[p]
            tf = 4.0 * pairs * d * scale / (med * 1e-3) / 1e12
            print(f"csv,{impl},{cfg},{rot},{rank},{p},{med:.3f},{mn:.3f},{pairs},{tf:.1f}")
            table.append((cfg, rank, rot, impl, p, med, mn, tf))
    failures = [f for _, _, fs in gathered for f in fs]
    for f in failures:
        print(f"FAIL: {f}")
    # Markdown: one row per (config, rank, rotate); compute-only beside each ring row.
    comp = {(c, rk, p): med for c, rk, _, i, p, med, _, _ in table if i == "torch_comp"}
    ring = {}
    for c, rk, rot, i, p, med, mn, tf in table:
        if i == "torch_ring":
            ring.setdefault((c, rk, rot), {})[p] = (med, mn, tf)
    print()
    print("| config | rank | rotate | ring fwd ms | comp fwd ms | fwd ratio | ring bwd ms | "
          "comp bwd ms | bwd ratio | ring fwd+bwd ms | fwd TF/s | bwd TF/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for (c, rk, rot), ps in ring.items():
        f, b, fb = (ps.get(p, (nan, nan, nan)) for p in ("fwd", "bwd", "fwdbwd"))
        cf, cb = comp.get((c, rk, "fwd"), nan), comp.get((c, rk, "bwd"), nan)
        print(f"| {c} | {rk} | {rot} | {f[0]:.2f} ({f[1]:.2f}) | {cf:.2f} | {f[0] / cf:.3f} | "
              f"{b[0]:.2f} ({b[1]:.2f}) | {cb:.2f} | {b[0] / cb:.3f} | {fb[0]:.2f} ({fb[1]:.2f}) | "
              f"{f[2]:.0f} | {b[2]:.0f} |")
    sys.stdout.flush()


def spawned(local_rank, args, world, port):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rc = rank_main(args, local_rank)
    if rc:
        sys.exit(rc)


def main():
    args = parse_args()
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        skip(f"torch not importable ({e!r})")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        skip(f"needs 2 CUDA devices, found {n}")
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_nccl_available():
        skip("torch.distributed with NCCL unavailable")
    try:
        if "LOCAL_RANK" in os.environ:  # started by torchrun
            return rank_main(args, int(os.environ["LOCAL_RANK"]))
        world = torch.cuda.device_count()
        with socket.socket() as s:  # a free port for the rendezvous, on this host only
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        import torch.multiprocessing as mp
        mp.spawn(spawned, args=(args, world, port), nprocs=world, join=True)
        return 0
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001 - report and fail; our numbers were printed before
        traceback.print_exc()
        print(f"{PROG}: FAILED", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
