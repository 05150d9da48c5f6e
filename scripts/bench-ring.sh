#!/usr/bin/env bash
# The ring benchmark, ours next to PyTorch's, in one run on a machine with two
# or more CUDA devices, from any directory: builds bench/ring_bench (NCCL),
# runs it (our ring over NCCL and the same blocks without communication), then
# bench/ring_torch_cp.py under torchrun (PyTorch's context-parallel SDPA ring
# over FlashAttention-2 and its compute-only calls), and prints one short
# table last: per rank, forward, backward and forward+backward, causal
# (zigzag / head-tail balanced) and full, each ring's time and its ratio to
# its own compute-only time, and torch's ring time over ours.
#
# Problem (both): bf16, batch 1, 16 heads, d 128, RANKS x 65536 tokens.
#
# The report's ring_bench section also holds, per configuration, rank and
# pass, where the ring's time goes (ring plans with ATTN_RING_PROFILE=1:
# CUDA events between block kernels, merges / accumulations, the waits on
# the exchanges, prologue and epilogue), and the default backward (the own
# shard's dK/dV kept home) next to the one with ATTN_RING_DKV_HOME=0 (every
# shard's dK/dV sent round the ring).
#
# Environment (all optional):
#   BUILD_DIR     build directory (/tmp/attn-bench-ring; configured here if it
#                 is not: release, -Dgpu_archs=$GPU_ARCHS, -Dcuda=enabled,
#                 -Dnccl=enabled, -Dtests=false, -Dexamples=false)
#   GPU_ARCHS     meson gpu_archs when configuring (sm_90a)
#   RANKS         GPUs (processes) for both rings (2)
#   RING_ARGS     extra options for ring_bench (e.g. "--repeat 10")
#   TORCH_ARGS    extra options for ring_torch_cp.py (e.g. "--rotate alltoall")
#   TORCH_RING    0 skips PyTorch's ring
#   OUT           where the report (bench-ring.md) and the logs go
#                 ($BUILD_DIR/bench-ring-logs when unset)
#   ATTN_COMMIT   the commit to report (else the tree's git HEAD)
# A .deps/ folder (as for scripts/gpu-check.sh) supplies pkg-config files and
# libraries the machine lacks.
#
# NVLink multicast stays off (NCCL, PyTorch's symmetric memory, NVSHMEM): the
# variables below are exported for both programs, whatever the caller set.
# Exit status: 0 when our ring ran (PyTorch's ring may be skipped or failed:
# the report says so), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
build=${BUILD_DIR:-/tmp/attn-bench-ring}
archs=${GPU_ARCHS:-sm_90a}
ranks=${RANKS:-2}
read -r -a ring_args <<<"${RING_ARGS:-}"
read -r -a torch_args <<<"${TORCH_ARGS:-}"
if [ -d .deps/pc ]; then
  export PKG_CONFIG_PATH=$root/.deps/pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$root/.deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
say() { echo "bench-ring: $*" >&2; }
logs=${OUT:-$build/bench-ring-logs}
mkdir -p "$build" "$logs"

# --- build ---------------------------------------------------------------------
# -Dbench is left at auto: ring_bench is built whenever CUDA and NCCL are, and
# 'enabled' would also demand the CPU benchmark's CBLAS, which this run needs not.
if [ ! -f "$build/build.ninja" ]; then
  say "configuring $build for $archs"
  if ! meson setup "$build" --buildtype=release -Dgpu_archs="$archs" -Dcuda=enabled \
      -Dnccl=enabled -Dtests=false -Dexamples=false >"$build/bench-ring-setup.log" 2>&1; then
    tail -40 "$build/bench-ring-setup.log" >&2
    say "meson setup failed (log: $build/bench-ring-setup.log)"
    exit 1
  fi
fi
start=$(date +%s)
if ! ninja -C "$build" bench/ring_bench >"$logs/build.log" 2>&1; then
  grep -E "error|FAILED|unknown target" -A4 "$logs/build.log" | head -60 >&2
  say "building bench/ring_bench in $build failed (CUDA and NCCL enabled there?); log: $logs/build.log"
  exit 1
fi
say "built in $(( $(date +%s) - start )) s"

# ATTN_COMMIT wins: a copied tree may carry a .git that is not its own.
if [ -n "${ATTN_COMMIT:-}" ]; then
  rev=$ATTN_COMMIT
elif [ -e .git ] && rev=$(git rev-parse --short HEAD 2>/dev/null); then
  [ -z "$(git status --porcelain 2>/dev/null)" ] || rev="$rev-dirty"
else
  rev=unknown
fi
day=$(date -u +%Y-%m-%d)
# GPU0's row of the topology matrix, without colour codes, on one line.
topo=$(nvidia-smi topo -m 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | grep -m1 '^GPU0' |
  tr -s ' \t' ' ' || true)

# --- our ring ------------------------------------------------------------------------
say "ring_bench on $ranks GPUs ..."
start=$(date +%s)
ATTN_COMMIT=$rev "$build/bench/ring_bench" --ranks "$ranks" "${ring_args[@]}" \
  >"$logs/ring_bench.out" 2>"$logs/ring_bench.err"
ring_rc=$?
say "ring_bench: exit $ring_rc in $(( $(date +%s) - start )) s"
if [ "$ring_rc" != 0 ]; then
  tail -5 "$logs/ring_bench.out" "$logs/ring_bench.err" >&2
fi

# --- PyTorch's ring --------------------------------------------------------------------
torch_rc=skipped
if [ "${TORCH_RING:-1}" = 0 ]; then
  echo "SKIP: TORCH_RING=0" >"$logs/ring_torch_cp.log"
elif ! python3 -c "import torch" >/dev/null 2>&1; then
  echo "SKIP: python3 cannot import torch" >"$logs/ring_torch_cp.log"
else
  say "ring_torch_cp.py on $ranks GPUs (torchrun) ..."
  start=$(date +%s)
  PYTHONUNBUFFERED=1 python3 -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
    bench/ring_torch_cp.py "${torch_args[@]}" >"$logs/ring_torch_cp.log" 2>&1
  torch_rc=$?
  say "ring_torch_cp.py: exit $torch_rc in $(( $(date +%s) - start )) s"
fi
if [ "$torch_rc" != 0 ]; then
  grep -E "^SKIP|Error|error" "$logs/ring_torch_cp.log" | head -8 >&2
fi

# --- report ----------------------------------------------------------------------------
# The table joins ring_bench's 'Per rank' rows (causal zigzag, full contiguous) with the
# torch script's csv lines (causal_lb, full). fwd+bwd: ours is the sum of the separately
# timed forward and backward medians; torch's is timed as one call pair.
summary=$(python3 - "$logs/ring_bench.out" "$logs/ring_torch_cp.log" <<'PY'
import sys
nan = float("nan")
ours = {}  # (config, rank) -> dict
for line in open(sys.argv[1], errors="replace"):
    f = [x.strip() for x in line.split("|")]
    if len(f) >= 12 and f[1] in ("causal zigzag", "full contiguous") and f[2].isdigit():
        num = lambda s: float(s.split()[0])
        cfg = "causal" if f[1].startswith("causal") else "full"
        ours[(cfg, int(f[2]))] = {"fwd": num(f[6]), "cfwd": num(f[7]), "bwd": num(f[9]),
                                  "cbwd": num(f[10])}
theirs, comp, checks, notes = {}, {}, [], []
try:
    lines = open(sys.argv[2], errors="replace").read().splitlines()
except OSError:
    lines = []
for line in lines:
    f = line.split(",")
    if f[0] == "csv" and f[1] != "columns" and len(f) >= 8:
        cfg = "causal" if f[2].startswith("causal") else "full"
        key, ms = (cfg, int(f[4]), f[5]), float(f[6])
        if f[1] == "torch_ring":
            if key not in theirs or ms < theirs[key][0]:
                theirs[key] = (ms, f[3])
        elif f[1] == "torch_comp":
            comp[key] = ms
    elif line.startswith(("FAIL:", "SKIP:")):
        notes.append(line)
    elif f[0] == "check" and f[1] != "columns":
        checks.append((f"{f[1]} {f[2]} rank {f[3]}", f[-1]))
print("| config | pass | rank | ours ring ms | ours / comp | torch ring ms (rotate) | torch / comp | torch / ours |")
print("|---|---|---|---|---|---|---|---|")
for cfg in ("causal", "full"):
    for p in ("fwd", "bwd", "fwd+bwd"):
        for rank in sorted({r for c, r in ours if c == cfg} | {k[1] for k in theirs if k[0] == cfg}):
            o = ours.get((cfg, rank))
            if o is None:
                ring = cring = nan
            elif p == "fwd+bwd":
                ring, cring = o["fwd"] + o["bwd"], o["cfwd"] + o["cbwd"]
            else:
                ring, cring = o[p], o["c" + p]
            tp = "fwdbwd" if p == "fwd+bwd" else p
            tms, rot = theirs.get((cfg, rank, tp), (nan, "-"))
            if p == "fwd+bwd":
                tc = comp.get((cfg, rank, "fwd"), nan) + comp.get((cfg, rank, "bwd"), nan)
            else:
                tc = comp.get((cfg, rank, tp), nan)
            name = "causal (zigzag / head-tail)" if cfg == "causal" else "full (contiguous)"
            print(f"| {name} | {p} | {rank} | {ring:.2f} | {ring / cring:.3f} | {tms:.2f} ({rot}) | "
                  f"{tms / tc:.3f} | {tms / ring:.3f} |")
if checks:
    bad = [c for c, result in checks if result != "ok"]
    print()
    print(f"torch's ring against single-GPU SDPA (small check, O, dQ, dK, dV): "
          f"{len(checks) - len(bad)} of {len(checks)} cases ok" +
          (f"; FAILED: {', '.join(bad)}" if bad else ""))
if notes or not lines:
    print()
for n in notes[:8]:
    print(f"torch: {n}")
if not lines:
    print("torch: no output (log missing)")
PY
)

report() {
  echo "# Ring attention on $ranks GPUs: libattn's ring next to PyTorch's context-parallel ring ($day, commit $rev)"
  echo
  echo "| | |"
  echo "|---|---|"
  echo "| date | $(date -u '+%Y-%m-%d %H:%M UTC') |"
  echo "| commit | \`$rev\` |"
  echo "| GPUs | $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n1) x $ranks; topology: ${topo:-n/a} |"
  echo "| build | \`meson setup --buildtype=release -Dgpu_archs=$archs -Dcuda=enabled -Dnccl=enabled\`, \`ninja bench/ring_bench\` |"
  echo "| environment | NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 |"
  echo "| commands | \`ring_bench --ranks $ranks ${ring_args[*]}\` (exit $ring_rc); \`torchrun --standalone --nproc-per-node $ranks bench/ring_torch_cp.py ${torch_args[*]}\` (exit $torch_rc) |"
  echo
  echo "## Summary"
  echo
  echo "Ratios: each ring over its own compute-only time (ours: the ring's blocks as dense plans;"
  echo "torch: the ring's SDPA calls, same shapes, no communication). torch / ours > 1: ours is"
  echo "faster. Ours' fwd+bwd is the sum of its separately timed passes; torch's is timed as one."
  echo "Torch's ring time is the faster of the rotate methods timed."
  echo
  echo "$summary"
  echo
  echo "## libattn: ring_bench"
  echo
  sed 's/^# /### /' "$logs/ring_bench.out"
  echo
  echo "## PyTorch: ring_torch_cp.py"
  echo
  echo '```'
  grep -E "^(meta|check|csv|SKIP|FAIL)" "$logs/ring_torch_cp.log" || tail -20 "$logs/ring_torch_cp.log"
  echo '```'
  echo
  grep -E "^\|" "$logs/ring_torch_cp.log"
}
report >"$logs/bench-ring.md"
say "wrote $logs/bench-ring.md"
echo
echo "$summary"
[ "$ring_rc" = 0 ]
