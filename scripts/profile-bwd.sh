#!/usr/bin/env bash
# Nsight Compute on the backward's main kernel, ours next to PyTorch's
# FlashAttention-2 on the same problem (bf16, batch*L = 16K, 2048/d heads),
# so that a gap in time can be read as a gap in instructions, shared-memory
# traffic or stalls. Run from the repository root on a machine with a CUDA
# device, ncu and torch; writes $OUT/ncu-ours.txt and $OUT/ncu-fa2.txt and
# prints the headline metrics of both.
#
# Environment: BUILD_DIR (default /tmp/attn-profile-bwd-build), GPU_ARCHS
# (sm_90a), PROFILE_SHAPE ("d,L,causal", default 128,8192,0), OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-/tmp/attn-profile-bwd-build}
out=${OUT:-$build/profile}
shape=${PROFILE_SHAPE:-128,8192,0}
IFS=, read -r d L causal <<<"$shape"
mkdir -p "$out"
. scripts/profile-build.sh
profile_build "$build" "$out" tests/gpu/time_flash_bwd || exit 1

sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
  --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats
  --section Occupancy --section LaunchStats --section InstructionStats
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__inst_executed_pipe_tensor.sum,smsp__sass_inst_executed_op_shared_ld.sum,smsp__sass_inst_executed_op_shared_st.sum,smsp__sass_inst_executed_op_ldsm.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__sass_inst_executed_op_global_red.sum,lts__t_sectors_op_red.sum")

ATTN_TIME_ONLY=1 ATTN_TIME_REPS=3 ncu --clock-control none --kernel-name regex:flash_bwd_dkdv \
  --launch-skip 2 --launch-count 1 "${sections[@]}" "$build/tests/gpu/time_flash_bwd" "$shape" \
  >"$out/ncu-ours.txt" 2>&1

cat >"$out/fa2_bwd.py" <<PY
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
d, L, causal = $d, $L, bool($causal)
b, h = max(1, 16384 // L), 2048 // d
q, k, v = (torch.randn(b, L, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
           .detach().requires_grad_() for _ in range(3))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    g = torch.randn_like(out)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
torch.cuda.synchronize()
PY
ncu --clock-control none --kernel-name regex:flash_bwd_dq_dk_dv --launch-skip 1 --launch-count 1 \
  "${sections[@]}" python3 "$out/fa2_bwd.py" >"$out/ncu-fa2.txt" 2>&1

for who in ours fa2; do
  echo "== $who ($shape)"
  grep -E "^  [a-zA-Z_].*\(|Duration|Registers Per|Achieved Occupancy|Issued Ipc|Eligible Warps|No Eligible|Shared Memory Configuration Size|Dynamic Shared|Block Size|Grid Size|inst_executed|shared_ld|shared_st|ldsm|wavefronts_mem_shared|bank_conflicts|global_red|op_red|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Hit|L2 Hit" \
    "$out/ncu-$who.txt" | head -40
  echo "-- stalls (warps per issued instruction), largest first"
  grep -E "issue_stalled" "$out/ncu-$who.txt" | awk '{print $NF, $1}' | sort -rn | head -10
done
