// FlashAttention forward on sm_90a with warp specialisation: a persistent
// kernel (one block per SM walking work items) whose first warpgroup only
// moves data and whose other two only compute.
//
//   producer  warpgroup 0 (one thread issuing): per work item, Q by tensor
//             copy into one of two Q buffers, then the item's KV tiles, K
//             and V each into `stages` buffers; every buffer has a "full"
//             mbarrier (the copies' bytes) and an "empty" one (the consumer
//             warps' arrivals once their wgmma read it)
//   consumers warpgroups 1 and 2, 64 query rows each: the loop of
//             flash/fwd_sm90_kernel.cuh (S_j issued with P_{j-1} V_{j-1},
//             the softmax under the latter) on waits for "full" barriers
//             instead of block barriers, and no loads of their own; at an
//             item's end the next item's S_0 is issued before the epilogue
//             is done (in an order per kind of item: ws::kDenseEnd)
//
// Why: the one-tile kernel pays, per query tile, the latency of its first
// loads and an epilogue that nothing overlaps, about two KV steps (4-5 us
// on an H200 at d = 128); short tile lists (BigBird, random block masks)
// feel it. Here the producer fetches the next item's Q and first KV tiles
// while the consumers finish the current one, and the consumers' KV steps
// carry no copies, address arithmetic or block barriers.
//
// Work: item w is a query tile x of a (sequence, head) (Sparse: item x of
// the slot's longest-first list, else query tile m_blocks - 1 - x, the
// causal longest first), dealt in rounds of gridDim.x, block k taking item
// k of even rounds and gridDim.x - 1 - k of odd ones (a snake: a block that
// got a long item gets a short one next). Item order (FwdWsParams::x_group:
// the (sequence, head) pairs in groups of x_group, group after group, x
// slowest within a group):
//   x slowest  where the items' lengths differ (masked and block-sparse
//   (one group) plans): the items run about longest first, so that the
//              snake balances the blocks (H200, bf16, d = 128, causal:
//              16K x 16 heads 1.92 ms against 2.57 with x fastest, 32K
//              7.98 against 9.55; the one-tile kernel's 2.47 and 9.83)
//   x fastest  where they are equal (no mask): the items running at a time
//   (groups    share their heads' K and V in L2 (full, 4K-8K: 594-597
//   of one)    TFLOP/s against 512-523 with x slowest).
//   groups of  block-sparse plans whose lists are not local (random
//   n pairs    blocks): groups whose K and V fill about 1.3 times the L2
//              (the host's sparse_fwd_head_group), x slowest within one.
//
// MoBA's gathered rounds (Gather, flash_fwd_sm90_ws_moba_gather_kernel):
// items are tiles of 128 rows of a round's row lists (moba/moba_rounds.cuh),
// whose Q the producer warp's lanes gather by row index (cp.async) while
// its lane 0 issues the block's KV tiles; the consumers merge each item's
// (O, LSE) into the rows' states (their epilogue) under the next item's
// first S GEMM (order 1), and stop at a record the producer ends with.
//
// Tensor maps (FwdWsParams, encoded by the host): dims {D, seqlen, heads,
// batch} with the tensors' strides, box {64, 128, 1, 1}, 128-byte swizzle:
// one box is one panel of the swizzled layout of flash/sm90.cuh, so a tile
// of D = 128 is two copies. Rows past the sequence read as zeros (as the
// one-tile kernel's zero-filled loads). Fixed-length plans only: in a
// packed (varlen) batch a tile would read the next sequence's rows.
#pragma once

#include <cuda.h>

#include "flash/fwd_sm90_kernel.cuh"
#include "flash/mbarrier.cuh"

namespace attn::flash {

struct FwdWsParams {
  FwdParams p;
  CUtensorMap q_map, k_map, v_map;
  int32_t m_blocks, heads_q, batch;  // the work: m_blocks x heads_q x batch items
  int32_t x_group;  // (sequence, head) pairs per group of items (see the top)
};

namespace ws {

template <int D>
struct Traits {
  static constexpr FwdSm90Config kCfg = fwd_sm90_ws_config(D);
};

// The control block after the tiles (in the one-tile kernel's visit ring
// area).
template <int KST, int VST>
struct Ctl {
  uint64_t q_full[2], q_empty[2];
  uint64_t k_full[KST], k_empty[KST], v_full[VST], v_empty[VST];
  int32_t item[2][4];  // per Q buffer: query tile, KV tiles, sequence, query head
  int32_t meta[KST][2];  // per K stage: KV tile, visit kind (kVisitFull / kVisitDense / bit tile)
};

// MoBA's gathered rounds (flash_fwd_sm90_ws_moba_gather_kernel): per Q
// buffer the item's rows (their round-list entries: the row, with
// kMobaLastRound in its last round), in rounds after the first their
// states' LSE, and the rows' numbering for the causal mask (r0) and count;
// in shared memory after the control block's area.
struct GatherCtl {
  int32_t entry[2][128];
  float lse[2][128];
  int32_t r0[2], rows[2];
};
// Its arrivals on a Q buffer's "full" barrier: one per producer lane, once
// the lane's copies of rows (and states' LSE) have landed and it has fenced
// them for the tensor cores (cp.async writes, wgmma reads).
constexpr int kGatherQArrivals = 32;

// Register budgets of the two roles (setmaxnreg, as FlashAttention-3's):
// 128 (24 + 2 x 240) <= 65536, the SM's file (the consumers spill at the
// launch's 168; 32 for the producer left no slack and the kernel hung).
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
// MoBA's gathered rounds: the producer lanes also copy Q's rows by index
// (24 registers spilled 1.3 KB there) and the consumers need fewer (210).
constexpr int kGatherProducerRegs = 40, kGatherConsumerRegs = 232;
static_assert(kGatherProducerRegs + 2 * kGatherConsumerRegs == kProducerRegs + 2 * kConsumerRegs,
              "the same register file");
// Arrivals on the "empty" barriers: one per consumer warp on the V
// stages' (only the tensor cores read them), one per consumer thread on
// the Q buffers' and K stages', whose records (ctl.item, ctl.meta) every
// thread reads: mbarrier.arrive releases the arriving thread's own reads,
// so each reader arrives (compute-sanitizer's racecheck flagged the
// record's rewrite when a warp's lane 0 arrived for it after __syncwarp).
constexpr int kConsumerWarps = 8, kConsumerThreads = 256;

// The order of an item's end (see there) for dense and for block-sparse
// items. H200, bf16, d = 128, L = 32K, 16 heads, causal, fwd ms against
// the earlier order without overlap, in the same run: order 1 took the
// dense plan to 6.67 against 7.53 but BigBird to 0.438 against 0.387
// (random 0.926 / 0.910, window + sinks 1.726 / 1.692: short lists wait
// for the next item's first tile, which with 2 stages lands about when the
// last step ends); order 2 left BigBird, random and window at 0.394 /
// 0.394, 0.921 / 0.922, 1.701 / 1.723 and the dense plan at 7.96 / 7.64
// (bench/results/cuda-fwd-ws-tail-2026-12-04-1742a1c.md). With the K
// lead below (the next item's first K tile copied a step earlier), order
// 1 no longer waits at short lists' ends: K lead 1 with order 1 for
// block-sparse items against K lead 0 with order 2, four runs each on
// 2026-12-05, fwd ms means: BigBird 0.383 / 0.401, random 0.897 / 0.913,
// window + sinks 1.740 / 1.721 (bench/results/cuda-fwd-ws-klead-2026-12-05-c0ef6e3.md).
// Builds for measurements may set -DATTN_FWD_WS_DENSE_END=2 (3, 4) or
// -DATTN_FWD_WS_SPARSE_END=2 (3, 4).
#ifndef ATTN_FWD_WS_DENSE_END
#define ATTN_FWD_WS_DENSE_END 1
#endif
#ifndef ATTN_FWD_WS_SPARSE_END
#define ATTN_FWD_WS_SPARSE_END 1
#endif
// Order 3 chooses per item: order 1 when the next item's record, Q and
// first K tile have already landed (nothing to wait for), else order 2;
// the warpgroup agrees by a barrier reduction, as its wgmmas must be the
// same for all its warps. Measured once for block-sparse items, with K
// lead 2: BigBird 0.388, random 0.909, window 1.786 ms, no better than
// the defaults (cuda-fwd-ws-klead-2026-12-05-c0ef6e3.md).
// Order 4 treats an item's end as a step: the next item's S_0 is issued
// with the last P V, its softmax runs under that P V, and the epilogue
// under the next item's S_1 (its P_0 V_0 issued after it): the first
// softmax, which orders 1 and 2 run with no GEMM of the warpgroup in flight
// (about 2,100 cycles a BigBird item against its ~2,900-cycle steps,
// cuda-fwd-epilogue-exp2-2026-12-05-12e2707.md), overlaps like the others.
// MoBA's gathered rounds (four-step items at block 512) may take it too.
// Measured once (bench/results/cuda-fwd-ws-end4-2026-12-05-ccce83f.md):
// random about 1% faster, BigBird and window + sinks level; not the default.
constexpr int kDenseEnd = ATTN_FWD_WS_DENSE_END, kSparseEnd = ATTN_FWD_WS_SPARSE_END;
static_assert(kDenseEnd >= 1 && kDenseEnd <= 4 && kSparseEnd >= 1 && kSparseEnd <= 4,
              "item-end orders are 1 to 4");
// MoBA's gathered rounds: order 1 or 4 (-DATTN_FWD_WS_GATHER_END=4).
#ifndef ATTN_FWD_WS_GATHER_END
#define ATTN_FWD_WS_GATHER_END 1
#endif
constexpr int kGatherEnd = ATTN_FWD_WS_GATHER_END;
static_assert(kGatherEnd == 1 || kGatherEnd == 4, "gathered item-end orders are 1 and 4");

// The producer's order of copies. 0: K_j and V_j together, in step order.
// 1 (K lead): K_{j+1} before V_j, so that a K tile is copied as soon as
// its stage is free (the S GEMM two steps back done, early in the step
// before) instead of after V_j's stage is free (that step's end): about
// one more step between a K tile's copy and its S GEMM, and the next
// item's first K tile (which order 1 of an item's end waits for) issued
// during the item's last-but-one step instead of at its end. V keeps its
// time. The default (measured with order 1 above; K lead 2 was no
// better: BigBird 0.385, random 0.899, window 1.730 ms in the same runs);
// builds for measurements may set -DATTN_FWD_WS_K_LEAD=0 or 2.
// 2: K tiles two steps ahead of the V tiles (K_{j+2} before V_j), in one K
// stage more than V stages (d = 128: 3 and 2, 224 KB of tiles, with the
// control block the whole 227 KB an SM gives a block).
#ifndef ATTN_FWD_WS_K_LEAD
#define ATTN_FWD_WS_K_LEAD 1
#endif
constexpr int kKLeadSteps = ATTN_FWD_WS_K_LEAD;
static_assert(kKLeadSteps >= 0 && kKLeadSteps <= 2, "a K lead of 0, 1 or 2 steps");
constexpr bool kKLead = kKLeadSteps != 0;
constexpr int kKExtraStages = kKLeadSteps > 1 ? kKLeadSteps - 1 : 0;
// The block's dynamic shared memory (the config's, plus the extra K stages).
template <int D>
constexpr size_t smem_bytes() {
  return fwd_sm90_ws_config(D).smem_bytes(D) + size_t(kKExtraStages) * 128u * size_t(D) * 2u;
}

#ifndef ATTN_FWD_WS_TRACE
#define ATTN_FWD_WS_TRACE 0
#endif
#if ATTN_FWD_WS_TRACE
}  // namespace ws
}  // namespace attn::flash
#include <cstdio>
namespace attn::flash {
namespace ws {
#endif
// Per-phase cycle sums of one consumer thread (diagnostic builds only; the
// default build's methods are empty). Phases of an item: 0 its Q and
// record, 1 its first K tile, 2 S_0, 3 its first softmax, 4 the steps
// j >= 1, 5 the last P V, 6 the epilogue (in order 1, split into 7 staging
// O and LSE, 8 the warpgroup's barrier, 6 the stores and the Q buffer's
// release). Where an item's S_0 overlaps the
// previous item's end, 0 is the wait for its record, Q and first K tile
// there, 1 is empty and 2 the wait for S_0 after that item's epilogue.
// In order 4, 2 is the wait for S_0 and 3 its softmax (both under the
// previous item's last P V), and the next item's step 1 counts in 4 but
// not among the S issues below.
// Also the clock (clock64, the SM's) at each step's S issue, summed by
// thread 0 of each consumer warpgroup: the mean difference between the two
// says whether they run in lock-step (about 0) or apart (ping-pong would
// put them half a step apart).
// Blocks 0, gridDim.x / 2 and gridDim.x - 1 save their sums in device
// memory, which trace_print_kernel (launched after the kernel) prints: a
// printf in the kernel itself is a call, across which ptxas serialises
// every wgmma of the kernel (warning C7510), which distorted the phases.
#if ATTN_FWD_WS_TRACE
// Per saved block: block index, items, KV tiles, the nine sums; per
// consumer warpgroup the summed clocks of its steps' S issues and their count.
static __device__ uint32_t trace_saved[3][12];
static __device__ unsigned long long trace_issue_sum[3][2];
static __device__ uint32_t trace_issues[3][2];
// Per saved block: its consumer's clock64 cycles and %globaltimer ns from
// start() to save(): the SM clock the block actually ran at.
static __device__ unsigned long long trace_span[3][2];
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif
struct Trace {
#if ATTN_FWD_WS_TRACE
  uint32_t sum[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0}, last = 0, items = 0, tiles = 0;
  unsigned long long c0 = 0, t0 = 0;
  __device__ __forceinline__ void start() {
    last = uint32_t(clock());
    c0 = clock64();
    t0 = global_ns();
  }
  __device__ __forceinline__ void mark(int k) {
    const uint32_t t = uint32_t(clock());
    sum[k] += t - last;
    last = t;
  }
  unsigned long long issue_sum = 0;
  uint32_t issues = 0;
  __device__ __forceinline__ void item(int n_tiles) {
    ++items;
    tiles += uint32_t(n_tiles);
  }
  __device__ __forceinline__ void issue() {
    issue_sum += clock64();
    ++issues;
  }
  // By thread wtid of consumer warpgroup cw.
  __device__ void save(int wtid, int cw) const {
    const unsigned x = blockIdx.x;
    const int slot = x == 0 ? 0 : x == gridDim.x / 2 ? 1 : x == gridDim.x - 1 ? 2 : -1;
    if (wtid != 0 || items == 0 || slot < 0) return;
    trace_issue_sum[slot][cw] = issue_sum;
    trace_issues[slot][cw] = issues;
    if (cw != 0) return;
    trace_span[slot][0] = clock64() - c0;
    trace_span[slot][1] = global_ns() - t0;
    uint32_t* r = trace_saved[slot];
    r[0] = x;
    r[1] = items;
    r[2] = tiles;
    for (int k = 0; k < 9; ++k) r[3 + k] = sum[k];
  }
#else
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void mark(int) {}
  __device__ __forceinline__ void item(int) {}
  __device__ __forceinline__ void issue() {}
  __device__ __forceinline__ void save(int, int) const {}
#endif
};

#if ATTN_FWD_WS_TRACE
// One thread: prints the saved blocks' averages per item and clears them.
// Static, as the sums it reads: each source that launches the kernels has
// its own copy.
static __global__ void trace_print_kernel() {
  for (int slot = 0; slot < 3; ++slot) {
    uint32_t* r = trace_saved[slot];
    if (r[1] == 0) continue;
    const float i = float(r[1]);
    const uint32_t* sum = r + 3;
    printf("ws-trace block %u: %u items, %.2f tiles each; cycles per item: q %.0f k0 %.0f s0 %.0f "
           "softmax0 %.0f steps %.0f (%.0f per step) pv %.0f epilogue %.0f (staging %.0f, "
           "barrier %.0f, stores %.0f)\n",
           r[0], r[1], float(r[2]) / i, sum[0] / i, sum[1] / i, sum[2] / i, sum[3] / i, sum[4] / i,
           r[2] > r[1] ? sum[4] / float(r[2] - r[1]) : 0.0f, sum[5] / i,
           (sum[6] + sum[7] + sum[8]) / i, sum[7] / i, sum[8] / i, sum[6] / i);
    const uint32_t n = trace_issues[slot][0];
    if (n > 0 && trace_issues[slot][1] == n)
      printf("ws-trace block %u: warpgroup 2's S issues %.0f cycles after warpgroup 1's, mean of %u "
             "steps\n",
             r[0], (double(trace_issue_sum[slot][1]) - double(trace_issue_sum[slot][0])) / n, n);
    if (trace_span[slot][1] > 0)
      printf("ws-trace block %u: %llu cycles in %.1f us, %.0f MHz\n", r[0], trace_span[slot][0],
             trace_span[slot][1] * 1e-3, trace_span[slot][0] * 1e3 / double(trace_span[slot][1]));
    r[1] = 0;
  }
}
#endif

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if ATTN_SM90_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if ATTN_SM90_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

}  // namespace ws

// Item of round r for this block (see the top), or -1 past the last.
__device__ __forceinline__ int ws_item(int r, int total) {
  const int k = (r & 1) ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int64_t w = int64_t(r) * gridDim.x + k;
  return w < total ? int(w) : -1;
}

// Gather: MoBA's gathered forward, round p.moba.fwd_round (see
// flash_fwd_sm90_ws_moba_gather_kernel below).
template <class T, int D, bool Sparse, bool Gather = false>
__device__ __forceinline__ void flash_fwd_sm90_ws(const FwdWsParams& wp) {
  static_assert(!(Sparse && Gather), "gathered rows: MoBA plans only");
  constexpr FwdSm90Config kCfg = ws::Traits<D>::kCfg;
  constexpr int BM = kCfg.block_m, BN = kCfg.block_n, ST = kCfg.stages;
  // K and V stages: as many, but with a K lead of 2 steps one K stage more.
  constexpr int KST = ST + ws::kKExtraStages, VST = ST;
  static_assert(BM == 128 && BN == 128 && kCfg.warpgroups == 2, "two consumer warpgroups");
  constexpr int NS = BN / 2, NO = D / 2;  // accumulators per thread: S, O
  constexpr int kPanels = D / 64;
  constexpr uint32_t kQBytes = uint32_t(BM * D * 2), kKvBytes = uint32_t(BN * D * 2);
  using Ctl = ws::Ctl<KST, VST>;
  static_assert(sizeof(Ctl) <= size_t(kSm90VisitRing) * 8u, "the control block fits");
  const FwdParams& p = wp.p;

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t raw = smem_u32(smem);
  const uint32_t sQa = (raw + 1023u) & ~1023u;          // [2][BM][D]
  const uint32_t sKa = sQa + 2u * kQBytes;              // [KST][BN][D]
  const uint32_t sVa = sKa + uint32_t(KST) * kKvBytes;  // [VST][BN][D]
  Ctl& ctl = *reinterpret_cast<Ctl*>(smem + (sVa + uint32_t(VST) * kKvBytes - raw));
  auto bar = [](const uint64_t& b) { return smem_u32(&b); };
  // Gather: the rows of the Q buffers' items (ws::GatherCtl).
  auto gather_ctl = [&]() -> ws::GatherCtl& {
    return *reinterpret_cast<ws::GatherCtl*>(smem + (sVa + uint32_t(VST) * kKvBytes - raw) +
                                             size_t(kSm90VisitRing) * 8u);
  };

  const int tid = threadIdx.x, wg = tid >> 7;
  const int total = wp.m_blocks * wp.heads_q * wp.batch;

  if (tid == 0) {
    for (int i = 0; i < 2; ++i) {
      mbar_init(bar(ctl.q_full[i]), Gather ? ws::kGatherQArrivals : 1);
      mbar_init(bar(ctl.q_empty[i]), ws::kConsumerThreads);
    }
    if constexpr (KST == VST) {
      for (int s = 0; s < ST; ++s) {
        mbar_init(bar(ctl.k_full[s]), 1);
        mbar_init(bar(ctl.v_full[s]), 1);
        mbar_init(bar(ctl.k_empty[s]), ws::kConsumerThreads);
        mbar_init(bar(ctl.v_empty[s]), ws::kConsumerWarps);
      }
    } else {
      for (int s = 0; s < KST; ++s) {
        mbar_init(bar(ctl.k_full[s]), 1);
        mbar_init(bar(ctl.k_empty[s]), ws::kConsumerThreads);
      }
      for (int s = 0; s < VST; ++s) {
        mbar_init(bar(ctl.v_full[s]), 1);
        mbar_init(bar(ctl.v_empty[s]), ws::kConsumerWarps);
      }
    }
  }
  mbar_init_fence();
  __syncthreads();

  if (wg == 0) {
    // ---- producer ----
    ws::setmaxnreg_dec<Gather ? ws::kGatherProducerRegs : ws::kProducerRegs>();
    if (tid >= 32) return;
    const int lane = tid;
    if (lane == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&wp.q_map)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&wp.k_map)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&wp.v_map)) : "memory");
    }
    uint32_t kv = 0;  // the block's KV steps so far
    int n = 0;        // its items so far
    // Lane 0's copies of step k's K tile into stage k % KST and V tile into
    // stage k % VST, each once the consumers have freed the stage.
    auto load_k = [&](uint32_t k, int tile, int kind, int hk, int b) {
      const int s = int(k % KST);
      mbar_wait(bar(ctl.k_empty[s]), ((k / KST) & 1u) ^ 1u);
      ctl.meta[s][0] = tile;
      ctl.meta[s][1] = kind;
      mbar_arrive_expect_tx(bar(ctl.k_full[s]), kKvBytes);
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn)
        tensor_load_4d(sKa + uint32_t(s) * kKvBytes + uint32_t(pn * BN * 128), &wp.k_map, pn * 64,
                       tile * BN, hk, b, bar(ctl.k_full[s]));
    };
    auto load_v = [&](uint32_t k, int tile, int hk, int b) {
      const int s = int(k % VST);
      mbar_wait(bar(ctl.v_empty[s]), ((k / VST) & 1u) ^ 1u);
      mbar_arrive_expect_tx(bar(ctl.v_full[s]), kKvBytes);
#pragma unroll
      for (int pn = 0; pn < kPanels; ++pn)
        tensor_load_4d(sVa + uint32_t(s) * kKvBytes + uint32_t(pn * BN * 128), &wp.v_map, pn * 64,
                       tile * BN, hk, b, bar(ctl.v_full[s]));
    };
    // K lead: the V tiles still due, those of steps kv - v_count .. kv - 1
    // (oldest first: their KV tile, KV head and sequence (hk << 16 | b), and
    // item), copied kKLeadSteps steps after their K tiles.
    constexpr int kLead = ws::kKLeadSteps > 0 ? ws::kKLeadSteps : 1;
    int v_count = 0;
    int v_tile[kLead] = {}, v_item[kLead] = {};
    uint32_t v_hb[kLead] = {};
    auto issue_due_v = [&] {  // the oldest due V tile
      if (lane == 0)
        load_v(kv - uint32_t(v_count), v_tile[0], int(v_hb[0] >> 16), int(v_hb[0] & 0xffffu));
#pragma unroll
      for (int i = 0; i + 1 < kLead; ++i) {
        v_tile[i] = v_tile[i + 1];
        v_item[i] = v_item[i + 1];
        v_hb[i] = v_hb[i + 1];
      }
      --v_count;
    };
    if constexpr (Gather) {
      // MoBA's gathered round: work item w is tile m = w % m_blocks of the
      // round lists of (sequence, query head) w / m_blocks (m_blocks: the
      // most tiles a round can have; tiles past the lists' end are skipped
      // here, so that the consumers see only items with rows). A tile is
      // BM entries of one list (lists start at whole tiles), the rows that
      // chose block kb in this round: Q by row index (cp.async, every
      // lane), then block kb's KV tiles up to the tile's last diagonal (the
      // own block of round 0, which the causal mask cuts) by tensor copies,
      // as flash_fwd_moba_gather_kernel's tiles. After the last item, a
      // record with n_tiles = -1 ends the consumers' walk.
      const MobaLists& mb = p.moba;
      ws::GatherCtl& gc = gather_ctl();
      const int nb = mb.num_blocks, tpb = mb.block / BN;
      const int64_t slots = int64_t(wp.batch) * mb.sel_heads;
      const bool fresh = mb.fwd_round == 0;
      const int64_t rows_all = int64_t(wp.batch) * wp.heads_q * p.seqlen_q;
      int cur = -1, first = 0, tiles = 0;
      const int32_t* e = nullptr;  // the (sequence, head)'s round lists: (start, rows) pairs
      for (int r = 0;; ++r) {
        const int w = ws_item(r, total);
        if (w < 0) break;
        const int bh = w / wp.m_blocks, m = w - bh * wp.m_blocks;
        const int h = bh % wp.heads_q, b = bh / wp.heads_q, hk = h / p.group;
        const int64_t slot = int64_t(b) * mb.sel_heads + (mb.per_query_head ? h : hk);
        if (bh != cur) {
          cur = bh;
          e = mb.kv_count + 2 * (int64_t(mb.fwd_round) * slots + slot) * (nb + 1);
          first = e[0];
          tiles = (e[2 * nb] - first) / BM;
        }
        if (m >= tiles) continue;
        const int at = first + m * BM;
        // The list that holds entry `at`: the last kb with start(kb) <= at
        // (lists starting at the same entry are empty but the last one), by
        // a 32-way search (two rounds of loads up to 1024 blocks).
        int lo = 0, hi = nb;
        while (hi - lo > 1) {
          const int step = (hi - lo + 31) / 32, probe = lo + lane * step;
          const unsigned le = __ballot_sync(0xffffffffu, probe < hi && e[2 * probe] <= at);
          lo += (31 - __clz(int(le))) * step;  // (lane 0's probe, lo, always holds)
          hi = min(hi, lo + step);
        }
        const int kb = lo, s0 = e[2 * kb];
        const int rows = min(BM, s0 + e[2 * kb + 1] - at);
        QueryTile qt;
        query_tile_of<BM>(p, b, 0, qt);  // the lengths and the diagonal's offset
        // Round 0: the block's own rows, in order; later rounds: rows after
        // the block, which see all of its keys.
        qt.r0 = max(0, (fresh ? kb : kb + 1) * mb.block - qt.off) + (at - s0);
        qt.rows = rows;
        qt.lo_first = 0, qt.hi_first = key_hi(p, qt, qt.r0);
        qt.lo_last = 0, qt.hi_last = key_hi(p, qt, qt.r0 + rows - 1);
        const int n_tiles = min(qt.hi_last, (kb + 1) * mb.block - 1) / BN - kb * tpb + 1;
        if (rows <= 0 || n_tiles <= 0) continue;  // (every listed row sees a key of its block)
        const int qb = n & 1;
        // (Every lane waits: each writes the buffer's records below.)
        mbar_wait(bar(ctl.q_empty[qb]), uint32_t((n >> 1) & 1) ^ 1u);
        const int32_t* idx = mb.kv_tiles + slot * int64_t(mb.kv_cap) + at;
        for (int i = lane; i < BM; i += 32) gc.entry[qb][i] = i < rows ? idx[i] : 0;
        if (lane == 0) {
          ctl.item[qb][0] = kb;
          ctl.item[qb][1] = n_tiles;
          ctl.item[qb][2] = b;
          ctl.item[qb][3] = h;
          gc.r0[qb] = qt.r0;
          gc.rows[qb] = rows;
        }
        __syncwarp();
        {
          // The rows into the buffer's swizzled panels, 16 bytes per copy,
          // a lane keeping one column chunk; rows past the list's read as
          // zeros. (A loop, not unrolled: unrolled, its addresses took the
          // producer's registers and spilled.)
          constexpr int kChunks = D / 8, kRowStep = 32 / kChunks;
          const int ch = lane % kChunks;
          const T* const src = static_cast<const T*>(p.q) + b * p.q_batch + h * p.q_head + ch * 8;
          const uint32_t dst = sQa + uint32_t(qb) * kQBytes;
#pragma unroll 2
          for (int row = lane / kChunks; row < BM; row += kRowStep) {
            const bool ok = row < rows;
            const T* g = src + int64_t(gc.entry[qb][ok ? row : 0] & kMobaRowMask) * p.q_seq;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                             dst + sm90::swizzled_offset(BM, row, ch * 8)),
                         "l"(g), "r"(ok ? 16 : 0));
          }
        }
        if (!fresh) {
          // The states the item merges into: their LSE into shared memory,
          // their O rows asked of L2 for the consumers' merge.
          const int64_t head_rows = int64_t(bh) * p.seqlen_q;
          constexpr int kLines = D * 4 / 128;
          for (int i = lane; i < rows; i += 32) {
            const int64_t row = head_rows + (gc.entry[qb][i] & kMobaRowMask);
            cp_async_4(smem_u32(&gc.lse[qb][i]), mb.state + rows_all * D + row);
#pragma unroll
            for (int l = 0; l < kLines; ++l) prefetch_l2(mb.state + row * D + l * 32);
          }
        }
        cp_async_commit();
        // The KV tiles, the last first. The first K tile's copy is issued
        // before the rows are waited for (it overlaps theirs), its V tile's
        // after they are published (that stage may still be in use).
        for (int i = 0; i < n_tiles; ++i, ++kv) {
          const int tile = kb * tpb + n_tiles - 1 - i;
          if (lane == 0)
            load_k(kv, tile, dense_tile_full<BN>(qt, tile * BN) ? kVisitFull : kVisitDense, hk, b);
          if (i == 0) {
            cp_async_wait<0>();
            sm90::fence_proxy_async();
            mbar_arrive(bar(ctl.q_full[qb]));
          }
          if (lane == 0) load_v(kv, tile, hk, b);
          __syncwarp();
        }
        ++n;
      }
      const int qb = n & 1;
      mbar_wait(bar(ctl.q_empty[qb]), uint32_t((n >> 1) & 1) ^ 1u);
      if (lane == 0) ctl.item[qb][1] = -1;
      __syncwarp();
      mbar_arrive(bar(ctl.q_full[qb]));
    } else {
      for (int w; (w = ws_item(n, total)) >= 0; ++n) {
        // Item w: groups of x_group (sequence, head) pairs, one after the
        // other, query tile slowest within a group (the last may be smaller).
        const int hb = wp.heads_q * wp.batch;
        const int g0 = w / (wp.m_blocks * wp.x_group) * wp.x_group, gs = min(wp.x_group, hb - g0);
        const int r = w - g0 * wp.m_blocks;
        const int x = r / gs;
        const int bh = g0 + (r - x * gs);  // b * heads_q + h
        const int h = bh % wp.heads_q, b = bh / wp.heads_q, hk = h / p.group;
        int m_block, n_tiles, last;  // last: Sparse, the end visit; dense, the end KV tile
        QueryTile qt;
        if constexpr (Sparse) {
          const int32_t* item =
              p.sparse.items +
              kSm90FwdItemWords * (mask_slot(p.sparse, b, hk) * p.sparse.tiles + x);
          m_block = item[0];
          last = item[2];
          n_tiles = item[2] - item[1];
        } else {
          m_block = wp.m_blocks - 1 - x;
          query_tile_of<BM>(p, b, m_block, qt);
          n_tiles = dense_kv_tiles<BN>(qt, last);
        }
        const int qb = n & 1;
        if constexpr (ws::kKLead) {
          // The Q buffer below is freed once item n - 2 has ended, which
          // needs its V tiles: those still due go now (after an item with
          // fewer KV tiles than the lead, or none).
          while (v_count > 0 && v_item[0] < n - 1) issue_due_v();
        }
        if (lane == 0) {
          mbar_wait(bar(ctl.q_empty[qb]), uint32_t((n >> 1) & 1) ^ 1u);
          ctl.item[qb][0] = m_block;
          ctl.item[qb][1] = n_tiles;
          ctl.item[qb][2] = b;
          ctl.item[qb][3] = h;
          if (n_tiles > 0) {
            mbar_arrive_expect_tx(bar(ctl.q_full[qb]), kQBytes);
#pragma unroll
            for (int pn = 0; pn < kPanels; ++pn)
              tensor_load_4d(sQa + uint32_t(qb) * kQBytes + uint32_t(pn * BM * 128), &wp.q_map,
                             pn * 64, m_block * BM, h, b, bar(ctl.q_full[qb]));
          } else {
            mbar_arrive(bar(ctl.q_full[qb]));  // publishes the item: nothing to load
          }
        }
        // 32 steps at a time: lane l reads step it0 + l's KV tile and kind.
        for (int it0 = 0; it0 < n_tiles; it0 += 32) {
          int my_tile = 0, my_kind = kVisitFull;
          if (it0 + lane < n_tiles) {
            if constexpr (Sparse) {
              const int32_t* v = p.sparse.visits + 2 * int64_t(last - 1 - (it0 + lane));
              my_tile = v[0];
              my_kind = v[1];
            } else {
              my_tile = last - 1 - (it0 + lane);
              my_kind = dense_tile_full<BN>(qt, my_tile * BN) ? kVisitFull : kVisitDense;
            }
          }
          const int steps = min(32, n_tiles - it0);
          for (int i = 0; i < steps; ++i, ++kv) {
            const int tile = __shfl_sync(0xffffffffu, my_tile, i);
            const int kind = __shfl_sync(0xffffffffu, my_kind, i);
            if constexpr (ws::kKLead) {
              if (lane == 0) load_k(kv, tile, kind, hk, b);
              if (v_count == kLead) issue_due_v();
#pragma unroll
              for (int e = 0; e < kLead; ++e)  // (entry v_count, by constant indices: registers)
                if (e == v_count) {
                  v_tile[e] = tile;
                  v_item[e] = n;
                  v_hb[e] = uint32_t(hk) << 16 | uint32_t(b);
                }
              ++v_count;
            } else if (lane == 0) {
              // (The measured default's code, written out: through load_k and
              // load_v it compiles to other machine code.)
              const int s = int(kv % ST);
              const uint32_t free_parity = ((kv / ST) & 1u) ^ 1u;
              mbar_wait(bar(ctl.k_empty[s]), free_parity);
              ctl.meta[s][0] = tile;
              ctl.meta[s][1] = kind;
              mbar_arrive_expect_tx(bar(ctl.k_full[s]), kKvBytes);
#pragma unroll
              for (int pn = 0; pn < kPanels; ++pn)
                tensor_load_4d(sKa + uint32_t(s) * kKvBytes + uint32_t(pn * BN * 128), &wp.k_map,
                               pn * 64, tile * BN, hk, b, bar(ctl.k_full[s]));
              mbar_wait(bar(ctl.v_empty[s]), free_parity);
              mbar_arrive_expect_tx(bar(ctl.v_full[s]), kKvBytes);
#pragma unroll
              for (int pn = 0; pn < kPanels; ++pn)
                tensor_load_4d(sVa + uint32_t(s) * kKvBytes + uint32_t(pn * BN * 128), &wp.v_map,
                               pn * 64, tile * BN, hk, b, bar(ctl.v_full[s]));
            }
            __syncwarp();
          }
        }
      }
      if constexpr (ws::kKLead) {
        while (v_count > 0) issue_due_v();
      }
    }
    return;
  }

  // ---- consumers ----
  ws::setmaxnreg_inc<Gather ? ws::kGatherConsumerRegs : ws::kConsumerRegs>();
  const int cw = wg - 1, wtid = tid & 127;  // consumer warpgroup, thread in it
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  // This thread's two rows of the tile (accumulator rows g and g + 8 of its
  // warp's 16).
  const int row0 = cw * 64 + ((wtid >> 5) << 4) + g;
  const float scale_log2 = p.scale_log2;
  // The warp's arrival once all its lanes are done with the buffer.
  auto release = [&](const uint64_t& b) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar(b));
  };
  // Every thread's arrival (the Q buffers' and K stages' barriers).
  auto release_all = [&](const uint64_t& b) { mbar_arrive(bar(b)); };

  uint32_t kv = 0;  // the block's KV steps before the current item's
  int n = 0;        // the current item
  int qb = 0, m_block = 0, n_tiles = 0, b = 0, h = 0;  // its record
  auto read_item = [&](int w) {
    qb = w & 1;
    mbar_wait(bar(ctl.q_full[qb]), uint32_t(w >> 1) & 1u);
    m_block = ctl.item[qb][0];
    n_tiles = ctl.item[qb][1];
    b = ctl.item[qb][2];
    h = ctl.item[qb][3];
  };
  QueryTile qt;
  // Items without a KV tile: no row of the tile sees a key, O = 0 and
  // LSE = -inf.
  auto write_empty = [&] {
    query_tile_of<BM>(p, b, m_block, qt);
    T* gO = static_cast<T*>(p.o) + b * p.o_batch + h * p.o_head + qt.r0 * p.o_seq;
    float* gL = p.lse == nullptr ? nullptr : p.lse + b * p.lse_batch + h * p.lse_head + qt.r0;
    constexpr int DT = D / 8;
    for (int c = wtid; c < 64 * DT; c += 128) {
      const int r = cw * 64 + c / DT, ch = c % DT;
      if (r < qt.rows) *reinterpret_cast<uint4*>(gO + r * p.o_seq + ch * 8) = make_uint4(0, 0, 0, 0);
    }
    if (gL != nullptr)
      for (int r = cw * 64 + wtid; r < cw * 64 + 64; r += 128)
        if (r < qt.rows) gL[r] = -INFINITY;
    release_all(ctl.q_empty[qb]);
  };
  // The next item with KV tiles from item n on (writing the empty ones on
  // the way) as the current one; false past the last.
  auto find_item = [&]() -> bool {
    if constexpr (Gather) {  // the producer hands out items with rows, then an end record
      read_item(n);
      return n_tiles > 0;
    } else {
      for (; ws_item(n, total) >= 0; ++n) {
        read_item(n);
        if (n_tiles > 0) return true;
        write_empty();
      }
      return false;
    }
  };

  float acc_o[NO];
  float row_max[2], row_sum[2];
  uint32_t pa[BN / 16][4];  // P_{j-1} in T: the A fragments of O += P V
  float s[NS];

  // Step j of the current item is the block's KV step kv + j, in stage
  // (kv + j) % KST and % VST; the steps' waits and GEMMs take the block's step.
  auto wait_k = [&](uint32_t k, int& tile, int& kind) {
    mbar_wait(bar(ctl.k_full[k % KST]), (k / KST) & 1u);
    tile = ctl.meta[k % KST][0];
    kind = ctl.meta[k % KST][1];
  };
  auto wait_v = [&](uint32_t k) { mbar_wait(bar(ctl.v_full[k % VST]), (k / VST) & 1u); };
  // S = Q K^T of the warpgroup's rows of Q buffer q (the step's K tile).
  auto issue_s = [&](int q, uint32_t k) {
    const uint32_t q_rows = sQa + uint32_t(q) * kQBytes + uint32_t(cw * 64 * 128);
    const uint32_t k_tile = sKa + (k % KST) * kKvBytes;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      sm90::Wgmma<T, BN>::ss(s, sm90::desc_k_major(q_rows, BM, kk),
                             sm90::desc_k_major(k_tile, BN, kk), kk > 0);
    sm90::wgmma_commit();
  };
  auto issue_pv = [&](uint32_t k) {  // O += P V of the step
    const uint32_t v_tile = sVa + (k % VST) * kKvBytes;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      sm90::Wgmma<T, D>::rs(acc_o, pa[kk], sm90::desc_mn_major(v_tile, BN, kk), true);
    sm90::wgmma_commit();
  };
  // Mask and online softmax of S_j in place (as the one-tile kernel's).
  auto softmax = [&](int tile, int kind, float (&alpha)[2]) {
    if constexpr (Sparse) {
      if (kind >= 0) mask_by_bits(s, p.sparse.bits + int64_t(kind) * (2 * BM), row0, t4);
    }
    if (kind == kVisitDense) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = int(opaque(qt.r0 + row0 + hh * 8));
        mask_key_range(s, hh, tile * BN, t4, key_lo(p, qt, row), key_hi(p, qt, row));
      }
    }
    online_softmax_rows(s, row_max, row_sum, scale_log2, alpha);
  };
  // S_0 of the current item (in s) to P_0: a fresh O and row statistics.
  // The current item's query tile (qt), for its masks.
  auto item_tile = [&] {
    if constexpr (Gather) {  // the producer's numbering of the gathered rows
      const ws::GatherCtl& gc = gather_ctl();
      query_tile_of<BM>(p, b, 0, qt);
      qt.r0 = gc.r0[qb];
      qt.rows = gc.rows[qb];
      qt.lo_first = 0, qt.hi_first = key_hi(p, qt, qt.r0);
      qt.lo_last = 0, qt.hi_last = key_hi(p, qt, qt.r0 + qt.rows - 1);
    } else {
      query_tile_of<BM>(p, b, m_block, qt);
    }
  };
  auto first_softmax = [&](int tile, int kind) {
    item_tile();
#pragma unroll
    for (int i = 0; i < NO; ++i) acc_o[i] = 0.0f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
    float alpha[2];
    softmax(tile, kind, alpha);
    pack_p_fragments<T>(s, pa);
  };

  // Gather: the item's (O, LSE), this thread's rows row0 and row0 + 8 of
  // it, merged into the rows' softmax states (fp32 O, normalised, and LSE
  // in p.moba.state) by the (O, LSE) merge rule, or, in a row's last round
  // (kMobaLastRound), written as the row's O and LSE; from the
  // accumulators, 8-byte accesses (a quad covers 32 contiguous bytes of a
  // row). Rows of round 0 have no state yet.
  auto gather_merge = [&](int q, int gb, int gh, int rows, const float (&r_max)[2],
                          const float (&r_sum)[2]) {
    const MobaLists& mb = p.moba;
    const ws::GatherCtl& gc = gather_ctl();
    const bool fresh = mb.fwd_round == 0;
    const int64_t head_rows = (int64_t(gb) * wp.heads_q + gh) * p.seqlen_q;
    const int64_t rows_all = int64_t(wp.batch) * wp.heads_q * p.seqlen_q;
    float* const state_o = mb.state + head_rows * D;
    float* const state_lse = mb.state + rows_all * D + head_rows;
    T* const o = static_cast<T*>(p.o) + gb * p.o_batch + gh * p.o_head;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float l = quad_sum(r_sum[hh]);  // (every lane of the quad: the same row)
      const float lse_t = row_lse(r_max[hh], l, scale_log2);
      const int row = row0 + hh * 8;
      if (row >= rows) continue;
      const int32_t entry = gc.entry[q][row];
      const int64_t at = entry & kMobaRowMask;
      const float lse_s = fresh ? -INFINITY : gc.lse[q][row];
      const float mx = max_keep_nan(lse_t, lse_s);
      float w_s = 0.0f, w_t = 0.0f, lse = -INFINITY;
      if (mx != -INFINITY) {
        const float e_s = expf(lse_s - mx), e_t = expf(lse_t - mx), sum = e_s + e_t;
        w_s = e_s / sum;
        w_t = l != 0.0f ? e_t / sum / l : 0.0f;  // (acc is O times l; NaN l: NaN)
        lse = mx + logf(sum);
      }
      if (t4 == 0) {
        if (entry >= 0)
          state_lse[at] = lse;
        else if (p.lse != nullptr)
          p.lse[gb * p.lse_batch + gh * p.lse_head + at] = lse;
      }
      float2* const so = reinterpret_cast<float2*>(state_o + at * D) + t4;
      float2 old[D / 8];
#pragma unroll
      for (int j = 0; j < D / 8; ++j) old[j] = w_s > 0.0f ? so[j * 4] : make_float2(0.0f, 0.0f);
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const float x = old[j].x * w_s + o_scaled(acc_o[j * 4 + hh * 2], w_t);
        const float y = old[j].y * w_s + o_scaled(acc_o[j * 4 + hh * 2 + 1], w_t);
        if (entry >= 0)
          so[j * 4] = make_float2(x, y);
        else
          *reinterpret_cast<uint32_t*>(o + at * p.o_seq + j * 8 + 2 * t4) = pack2<T>(x, y);
      }
    }
  };

  // Diagnostic builds (-DATTN_FWD_WS_TRACE=1): clock cycles per phase of an
  // item, summed by one consumer thread and saved at exit for three blocks
  // (ws::Trace, scripts/trace-sparse.sh).
  ws::Trace trace;
  trace.start();
  int tile = 0, kind = 0;
  // An item's start with S_0 alone (the block's first item, and one after
  // an empty item).
  auto start_alone = [&] {
    trace.mark(0);
    wait_k(kv, tile, kind);
    trace.mark(1);
    sm90::wgmma_fence();
    issue_s(qb, kv);
    sm90::wgmma_wait<0>();
    sm90::reg_fence(s);
    trace.mark(2);
    release_all(ctl.k_empty[kv % KST]);
    first_softmax(tile, kind);
    trace.mark(3);
  };
  bool have = find_item();
  if (have) start_alone();
  int j0 = 1;  // the current item's first step done in the loop (order 4 did step 1 at its start)
#pragma unroll 1
  while (have) {
#pragma unroll 1
    for (int j = j0; j < n_tiles; ++j) {
      const uint32_t k = kv + uint32_t(j);
      float alpha[2];
      wait_k(k, tile, kind);
      wait_v(k - 1);  // (landed with K_{j-1}: a wait between the GEMMs would split their fence)
      sm90::wgmma_fence();
      trace.issue();
      issue_s(qb, k);
      issue_pv(k - 1);
      sm90::wgmma_wait<1>();  // S_j done; P_{j-1} V_{j-1} runs on under the softmax
      sm90::reg_fence(s);
      release_all(ctl.k_empty[k % KST]);
      softmax(tile, kind, alpha);
      sm90::wgmma_wait<0>();
      sm90::reg_fence(acc_o);
      release(ctl.v_empty[(k - 1) % VST]);
#pragma unroll
      for (int i = 0; i < NO; ++i) acc_o[i] *= alpha[(i >> 1) & 1];
      pack_p_fragments<T>(s, pa);
    }
    trace.mark(4);  // the steps j >= 1
    j0 = 1;

    // The item's end, in one of four orders (ws::kDenseEnd, ws::kSparseEnd,
    // ws::kGatherEnd):
    // 1: the last P V issued with the next item's S_0 once that item's Q
    //    and first K tile are in, the epilogue under S_0;
    // 2: the last P V, O staged in the warpgroup's own rows of the item's
    //    Q buffer (its S GEMMs are done), then the next item's S_0 when
    //    that item has KV tiles, under O's global stores.
    // 3: order 1 when the next item's record and Q and its first K tile
    //    have all landed (tested without waiting, and as every thread of
    //    the warpgroup sees them: its wgmmas must agree), else order 2,
    //    which reads the record where it does unless this thread did here;
    // 4: see below (ws::kDenseEnd).
    // (The branches repeat the epilogue's lines: each is the code that
    // was measured, and sharing them in lambdas changed the machine code.)
    const uint32_t last = kv + uint32_t(n_tiles - 1);
    const int e_qb = qb, e_b = b, e_h = h;  // this item's, for the epilogue
    const int e_r0 = qt.r0, e_rows = qt.rows;
    constexpr int kEnd = Gather ? ws::kGatherEnd : Sparse ? ws::kSparseEnd : ws::kDenseEnd;
    if constexpr (kEnd == 4) {
      // 4: the next item's S_0 with the last P V, its softmax under the P V;
      // the epilogue under the next item's S_1, then its P_0 V_0. The
      // record read here replaces the current one (e_*: this item's).
      bool overlap = false;
      if (Gather || ws_item(n + 1, total) >= 0) {  // (Gather: the end record too)
        read_item(n + 1);
        overlap = n_tiles > 0;
      }
      const float e_max[2] = {row_max[0], row_max[1]}, e_sum[2] = {row_sum[0], row_sum[1]};
      // The epilogue, as order 2's, with this item's row statistics.
      auto epilogue4 = [&] {
        if constexpr (Gather) {
          gather_merge(e_qb, e_b, e_h, e_rows, e_max, e_sum);
        } else {
          unsigned char* const sQp = smem + (sQa + uint32_t(e_qb) * kQBytes - raw);
          float* gL = p.lse == nullptr ? nullptr
                                       : p.lse + e_b * p.lse_batch + e_h * p.lse_head + e_r0;
          stage_o_rows<T, D, BM>(sQp, acc_o, e_max, e_sum, row0, t4, gL, e_rows, scale_log2);
          sm90::named_barrier(1 + cw, 128);
          T* gO = static_cast<T*>(p.o) + e_b * p.o_batch + e_h * p.o_head + e_r0 * p.o_seq;
          store_o_rows<D, BM>(gO, p.o_seq, sQp, cw, wtid, e_rows);
          sm90::fence_proxy_async();  // the staging writes before the producer's next tensor copy
        }
        release_all(ctl.q_empty[e_qb]);
        trace.mark(6);  // the epilogue
        trace.item(last + 1 - kv);
        kv = last + 1;
        ++n;
      };
      wait_v(last);
      if (overlap) {
        wait_k(last + 1, tile, kind);
        trace.mark(0);  // the next item's record, Q and first K tile
        sm90::wgmma_fence();
        issue_s(qb, last + 1);
        issue_pv(last);
        sm90::wgmma_wait<1>();  // S_0 done; the last P V runs on under its softmax
        sm90::reg_fence(s);
        trace.mark(2);
        release_all(ctl.k_empty[(last + 1) % KST]);
        item_tile();
        row_max[0] = row_max[1] = -INFINITY;
        row_sum[0] = row_sum[1] = 0.0f;
        float alpha[2];
        softmax(tile, kind, alpha);  // (alpha: nothing to rescale yet)
        trace.mark(3);
        sm90::wgmma_wait<0>();
        sm90::reg_fence(acc_o);
        trace.mark(5);  // the last P V
        release(ctl.v_empty[last % VST]);
        pack_p_fragments<T>(s, pa);  // (the last P V has read pa)
        if (n_tiles > 1) {
          wait_k(last + 2, tile, kind);
          sm90::wgmma_fence();
          issue_s(qb, last + 2);
          epilogue4();  // under S_1
#pragma unroll
          for (int i = 0; i < NO; ++i) acc_o[i] = 0.0f;
          wait_v(kv);
          sm90::wgmma_fence();
          issue_pv(kv);
          sm90::wgmma_wait<1>();  // S_1 done; P_0 V_0 runs on under the softmax
          sm90::reg_fence(s);
          release_all(ctl.k_empty[(kv + 1) % KST]);
          softmax(tile, kind, alpha);
          sm90::wgmma_wait<0>();
          sm90::reg_fence(acc_o);
          release(ctl.v_empty[kv % VST]);
#pragma unroll
          for (int i = 0; i < NO; ++i) acc_o[i] *= alpha[(i >> 1) & 1];
          pack_p_fragments<T>(s, pa);
          j0 = 2;  // the loop goes on with step 2
        } else {
          epilogue4();
#pragma unroll
          for (int i = 0; i < NO; ++i) acc_o[i] = 0.0f;
        }
        continue;
      }
      trace.mark(0);
      sm90::wgmma_fence();
      issue_pv(last);
      sm90::wgmma_wait<0>();
      sm90::reg_fence(acc_o);
      trace.mark(5);  // the last P V
      release(ctl.v_empty[last % VST]);
      epilogue4();
    } else {
    bool end2 = kEnd == 2, read3 = false, overlap3 = false;
    if constexpr (kEnd == 3) {
      bool landed = false;
      const int w = n + 1;
      if (ws_item(w, total) >= 0 && mbar_test(bar(ctl.q_full[w & 1]), uint32_t(w >> 1) & 1u)) {
        read_item(w);  // (no wait: the phase has completed)
        read3 = true;
        overlap3 = n_tiles > 0;
        landed = overlap3 && mbar_test(bar(ctl.k_full[(last + 1) % KST]), ((last + 1) / KST) & 1u);
      }
      end2 = !sm90::named_barrier_and(1 + cw, 128, landed);
    }
    if (end2) {
      wait_v(last);
      sm90::wgmma_fence();
      issue_pv(last);
      sm90::wgmma_wait<0>();
      sm90::reg_fence(acc_o);
      trace.mark(5);  // the last P V
      release(ctl.v_empty[last % VST]);
      unsigned char* const sQp = smem + (sQa + uint32_t(e_qb) * kQBytes - raw);
      {
        float* gL = p.lse == nullptr ? nullptr
                                     : p.lse + e_b * p.lse_batch + e_h * p.lse_head + e_r0;
        stage_o_rows<T, D, BM>(sQp, acc_o, row_max, row_sum, row0, t4, gL, e_rows, scale_log2);
      }
      sm90::named_barrier(1 + cw, 128);
      // O's stores, and the buffer back to the producer.
      auto store_o = [&] {
        T* gO = static_cast<T*>(p.o) + e_b * p.o_batch + e_h * p.o_head + e_r0 * p.o_seq;
        store_o_rows<D, BM>(gO, p.o_seq, sQp, cw, wtid, e_rows);
        // The staging writes (generic proxy) before the producer's next tensor
        // copy into the buffer (async proxy).
        sm90::fence_proxy_async();
        release_all(ctl.q_empty[e_qb]);
        trace.mark(6);  // the epilogue
        trace.item(last + 1 - kv);
        kv = last + 1;
        ++n;
      };
      bool overlap = overlap3;
      if (!read3 && ws_item(n + 1, total) >= 0) {
        read_item(n + 1);
        overlap = n_tiles > 0;
      }
      if (overlap) {
        wait_k(last + 1, tile, kind);
        trace.mark(0);  // the next item's record, Q and first K tile
        sm90::wgmma_fence();
        issue_s(qb, last + 1);
        store_o();
        sm90::wgmma_wait<0>();
        sm90::reg_fence(s);
        trace.mark(2);  // the next item's S_0
        release_all(ctl.k_empty[kv % KST]);
        first_softmax(tile, kind);
        trace.mark(3);
        continue;
      }
      store_o();
    } else {
      bool overlap = overlap3;
      // (Gather: the next record always exists, the end's included.)
      if (!read3 && (Gather || ws_item(n + 1, total) >= 0)) {
        read_item(n + 1);
        overlap = n_tiles > 0;
      }
      wait_v(last);
      if (overlap) wait_k(last + 1, tile, kind);
      trace.mark(0);  // the next item's record, Q and first K tile

      // Epilogue: O = acc / l and LSE; the warpgroup stages its 64 rows in its
      // own rows of the item's Q buffer (its S GEMMs are done), then writes
      // them with 16-byte stores, and frees the buffer for the producer.
      auto epilogue = [&] {
        sm90::reg_fence(acc_o);
        trace.mark(5);  // the last P V
        release(ctl.v_empty[last % VST]);
        if constexpr (Gather) {
          gather_merge(e_qb, e_b, e_h, e_rows, row_max, row_sum);
        } else {
          unsigned char* const sQp = smem + (sQa + uint32_t(e_qb) * kQBytes - raw);
          float* gL = p.lse == nullptr ? nullptr
                                       : p.lse + e_b * p.lse_batch + e_h * p.lse_head + e_r0;
          T* gO = static_cast<T*>(p.o) + e_b * p.o_batch + e_h * p.o_head + e_r0 * p.o_seq;
          stage_o_rows<T, D, BM>(sQp, acc_o, row_max, row_sum, row0, t4, gL, e_rows, scale_log2);
          trace.mark(7);  // staged (the epilogue's first part)
          sm90::named_barrier(1 + cw, 128);
          trace.mark(8);  // the warpgroup's barrier
          store_o_rows<D, BM>(gO, p.o_seq, sQp, cw, wtid, e_rows);
          // The staging writes (generic proxy) before the producer's next
          // tensor copy into the buffer (async proxy).
          sm90::fence_proxy_async();
        }
        release_all(ctl.q_empty[e_qb]);
        trace.mark(6);  // the epilogue
        trace.item(last + 1 - kv);
        kv = last + 1;
        ++n;
      };
      if (overlap) {
        sm90::wgmma_fence();
        issue_pv(last);
        issue_s(qb, last + 1);
        sm90::wgmma_wait<1>();  // the P V done; S_0 runs on under the epilogue
        epilogue();
        sm90::wgmma_wait<0>();
        sm90::reg_fence(s);
        trace.mark(2);  // the next item's S_0
        release_all(ctl.k_empty[kv % KST]);
        first_softmax(tile, kind);
        trace.mark(3);
        continue;
      }
      sm90::wgmma_fence();
      issue_pv(last);
      sm90::wgmma_wait<0>();
      epilogue();
    }
    }  // orders 1 to 3
    // No next item, or an empty one (written here): the next with KV
    // tiles, if any, starts with S_0 alone. (Gather: the end record.)
    if (Gather || ws_item(n, total) < 0) break;
    write_empty();
    ++n;
    have = find_item();
    if (have) start_alone();
  }
  trace.save(wtid, cw);
}

template <class T, int D, bool Sparse>
__global__ void __launch_bounds__(ws::Traits<D>::kCfg.threads(), 1)
    flash_fwd_sm90_ws_kernel(const __grid_constant__ FwdWsParams wp) {
#if ATTN_SM90_WGMMA
  flash_fwd_sm90_ws<T, D, Sparse>(wp);
#endif
}

// MoBA's gathered forward on the warp-specialised kernel, round
// p.moba.fwd_round per launch (the round lists and the merge of
// flash_fwd_moba_gather_kernel, flash/fwd_kernel.cuh): items of 128 rows
// of one list, Q loaded by row index, each item's (O, LSE) merged into the
// rows' states in its epilogue, under the next item's first S GEMM.
// Dynamic shared memory: the config's plus sizeof(ws::GatherCtl).
template <class T, int D>
__global__ void __launch_bounds__(ws::Traits<D>::kCfg.threads(), 1)
    flash_fwd_sm90_ws_moba_gather_kernel(const __grid_constant__ FwdWsParams wp) {
#if ATTN_SM90_WGMMA
  flash_fwd_sm90_ws<T, D, false, true>(wp);
#endif
}

}  // namespace attn::flash
