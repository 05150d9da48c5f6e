// FlashAttention backward, dK/dV kernel on sm_90a warpgroup MMA (wgmma),
// dense plans at d = 64 and 128. One thread block owns the BN = 128 keys of
// one KV tile of one KV head (two warpgroups of 64 keys each) and walks the
// query tiles (BM rows, flash::bwd_sm90_config) of the query heads of its
// group (or its share of a split group) that see them, as
// flash_bwd_dkdv_kernel (flash/bwd_kernel.cuh) does. Per query tile:
//
//   S^T  = K Q^T         [64 keys][BM] per warpgroup, wgmma, A (K) and B (Q)
//                        K-major from shared memory
//   dP^T = V dO^T        likewise
//   P^T  = 2^(S^T scale log2(e) - LSE2), masked; dS^T = P^T (dP^T - D)
//   dV  += P^T dO        A (P^T) from registers, B (dO) MN-major in shared
//   dK  += dS^T Q        A (dS^T) from registers, B (Q) MN-major in shared
//   dQ   = dS K          [BM][D] over the tile's 128 keys: dS^T stored to
//                        shared memory and read as a transposed A, K as an
//                        MN-major B; each warpgroup a [64][64] half of it
//                        (d = 128: columns 64 wg..; d = 64: rows 64 wg..),
//                        staged in fp32 and added to the accumulator by one
//                        bulk reduction per row in the next iteration
//
// Order within an iteration: S^T and dP^T are issued, then the next tile's
// loads and the previous tile's dQ reductions; P^T is computed while dP^T
// runs, dS^T while dV runs, and dK runs across the barrier before dQ.
//
// Loads: every thread cp.asyncs into the swizzled panels of flash/sm90.cuh
// (K, V once; Q, dO, LSE2 and D of the next query tile into the other of
// two stages), fences the async proxy and meets the others at the
// iteration's first barrier; a second barrier publishes dS^T (and frees the
// dQ staging tile) before the dQ GEMM. Masks, the preprocess (D, LSE2), the
// dQ conversion and split groups' fp32 dK/dV accumulators are those of the
// sm_80 backward; the instantiation for deterministic plans (Accum = false)
// skips the dQ part, which the sm_80 deterministic dQ kernel computes.
//
// Block-sparse plans (Sparse, flash_bwd_dkdv_sm90_bsparse_kernel, no
// softcap) walk a work item of the KV-major tile lists (sparse/tile_lists.cuh,
// built in this kernel's BM x BN tiles) instead of the dense interval, as
// the sm_80 kernel's Sparse instantiation does: the block's linear index
// counts KV heads fastest within groups of them (TileLists::head_group), the item gives the KV
// tile and a range of its list, and each visit is full (no predicate),
// dense-masked (the interval test below) or a bit tile (one bit per (key,
// query) pair, rows = keys). A cut list's items add dK and dV into its
// tile's slot of the compact fp32 accumulators (split groups: into the
// whole ones), as the sm_80 kernel's, so that the host's conversions and
// the dQ path are those of the sm_80 backward. Without Sparse the code is
// that of the dense kernel before it existed.
// MoBA plans (Moba, flash_bwd_dkdv_sm90_moba_kernel, no softcap) walk the
// tile-union list the selector wrote for the KV tile's block (p.moba's kv
// list: the query tiles of BM rows in which some row of some query head of
// the group selected it, flagged kMobaAllRows when every such row did), as
// the sm_80 kernel's Moba instantiation does; grid and accumulation are
// the dense kernel's. A visit that is not flagged, or that the diagonal
// cuts, is masked by the interval test and by the rows' selection bits of
// the query head's slot (one or two 64-bit words per tile, read while the
// score GEMMs run).
// MoBA's gathered rows (Moba and Gather, flash_bwd_dkdv_sm90_moba_gather_kernel)
// walk, per query head of the group, tiles of BM of the rows that selected
// the KV tile's block (MobaGatherWalk of flash/bwd_kernel.cuh: Q, dO and the
// row statistics loaded by index, dQ reduced at each row's index), numbered
// for the causal mask as the sm_80 kernel's Gather does (the block's own
// rows lead the list, and the tiles of them before the KV tile's diagonal
// are skipped), with no selection bit. The tiles' heads, rows and indices
// come from a ring in shared memory filled two iterations ahead
// (bwd_sm90::moba_gather_ring).
// Softcap plans run the Cap instantiation: the logit z = cap tanh(u) and
// dS^T = P^T (dP^T - D) (1 - (z/cap)^2), as flash/bwd_kernel.cuh; it waits
// for dP^T before the exponentials and folds the tanh derivative into it
// there, so that no gate array lives across the dV GEMM. Without Cap the
// code is that of the kernel before softcap existed.
//
// Built only for sm_90a (ATTN_SM90_WGMMA); other targets get an empty
// kernel, which the host never launches (it checks the image's PTX version).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "flash/bwd_kernel.cuh"
#include "flash/bwd_params.cuh"
#include "flash/sm80.cuh"
#include "flash/sm90.cuh"

namespace attn::flash {

template <int D, int QS = 2>
struct BwdSm90Traits {
  static constexpr BwdSm90Config kCfg = QS == 2 ? bwd_sm90_config(D) : bwd_sm90_sparse_config(D);
  static_assert(kCfg.q_stages == QS, "two or three stages");
  static constexpr int kBM = kCfg.block_m, kBN = kCfg.block_n, kThreads = kCfg.threads();
  static constexpr int kLdDq = kCfg.ld_dq(D);  // staging row pitch (floats)
  // Byte offsets from the 1024-byte aligned base: K, V [BN][D]; Q, dO
  // [QS][BM][D]; dS^T [BN][BM]; LSE2, D [QS][2][BM] fp32; dQ [BM][kLdDq] fp32.
  static constexpr uint32_t kTileKV = uint32_t(kBN * D * 2), kTileQ = uint32_t(kBM * D * 2);
  static constexpr uint32_t kOffK = 0, kOffV = kTileKV, kOffQ = 2 * kTileKV;
  static constexpr uint32_t kOffDo = kOffQ + QS * kTileQ, kOffDs = kOffDo + QS * kTileQ;
  static constexpr uint32_t kOffStat = kOffDs + uint32_t(kBN * kBM * 2);
  static constexpr uint32_t kOffStage = kOffStat + uint32_t(2 * QS * kBM * 4);
  static_assert(kOffStage + uint32_t(kBM * kLdDq * 4) + 1024u == kCfg.smem_bytes(D),
                "layout = config");
  static_assert((D == 64 || D == 128) && kBN == 128 && kBM * D == 8192 && kThreads == 256,
                "the wgmma shapes instantiated: dQ is [64][64] per warpgroup");
  static_assert(2 * kBM <= kThreads && kBM <= kThreads, "one thread per row statistic");
};

namespace bwd_sm90 {

// MoBA gather: the walk's tiles in a ring (tile `it` in entry it % kGatherRing):
// its query head, its tile in that head's row list, its rows and their
// indices. Entry it + 2 is filled during iteration it (the fields by thread
// 0, the indices by cp.async with the loads of tile it + 1), so that tile
// it + 1's loads and tile it - 1's dQ reductions read their row indices in
// shared memory: read from the global list there, each stalled the
// iteration on a dependent global load. Fields are read through volatile,
// so that no register holds them through the GEMMs.
constexpr int kGatherRing = 4, kGatherRowsMax = 128;
struct GatherTile {
  int h, m, rows, pad;
  int32_t idx[kGatherRowsMax];
};
__shared__ GatherTile moba_gather_ring[kGatherRing];
__device__ __forceinline__ int gather_field(int entry, int i) {
  return reinterpret_cast<const volatile int*>(&moba_gather_ring[entry % kGatherRing])[i];
}
// Likewise the walk's sequence, KV head, block, end head and skip (MobaGatherWalk
// of flash/bwd_kernel.cuh), written by thread 0 before the first barrier
// (in registers, the d = 64 kernel spilled 44 bytes).
__shared__ int moba_gather_fields[5];
struct WalkFieldsSmem {
  __device__ __forceinline__ static int at(int i) {
    return static_cast<const volatile int*>(moba_gather_fields)[i];
  }
  __device__ __forceinline__ int b() const { return at(0); }
  __device__ __forceinline__ int hk() const { return at(1); }
  __device__ __forceinline__ int kb() const { return at(2); }
  __device__ __forceinline__ int h_end() const { return at(3); }
  __device__ __forceinline__ int skip() const { return at(4); }
};

// acc[64][BM] (+)= A[64][D] B[D][BM] with A = 64 rows of a [BN][D] tile
// (K or V; `rows` its first row's address in panel 0) and B = a [BM][D]
// tile (Q or dO), both K-major: S^T = K Q^T or dP^T = V dO^T. Not committed.
template <class T, int D, int BM, int BN>
__device__ __forceinline__ void issue_scores(float (&acc)[BM / 2], uint32_t rows, uint32_t tile) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    sm90::Wgmma<T, BM>::ss(acc, sm90::desc_k_major(rows, BN, kk), sm90::desc_k_major(tile, BM, kk),
                           kk > 0);
}

// acc[64][D] += A[64][BM] B[BM][D], A in registers (the k-step fragments of
// P^T or dS^T), B a [BM][D] tile (dO or Q) read MN-major. Not committed.
template <class T, int D, int BM>
__device__ __forceinline__ void issue_grad(float (&acc)[D / 2], const uint32_t (&a)[BM / 16][4],
                                           uint32_t tile) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk)
    sm90::Wgmma<T, D>::rs(acc, a[kk], sm90::desc_mn_major(tile, BM, kk), true);
}

// dq[64][64] = dS[64][BN] K[BN][64]: a_panel the panel of 64 queries of dS^T
// [BN][BM], b_panel the panel of 64 columns of K [BN][D]. Not committed.
template <class T, int BN>
__device__ __forceinline__ void issue_dq(float (&dq)[32], uint32_t a_panel, uint32_t b_panel) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    sm90::WgmmaMnMn<T>::ss(dq, sm90::desc_mn_major(a_panel, BN, kk),
                           sm90::desc_mn_major(b_panel, BN, kk), kk > 0);
}

// The accumulators of columns [16 kk, 16 kk + 16) as the A fragment of
// k-step kk (flash/sm90.cuh).
template <class T, int N>
__device__ __forceinline__ void pack_a(uint32_t (&a)[N / 16][4], const float (&c)[N / 2]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    a[kk][0] = pack2<T>(c[8 * kk + 0], c[8 * kk + 1]);
    a[kk][1] = pack2<T>(c[8 * kk + 2], c[8 * kk + 3]);
    a[kk][2] = pack2<T>(c[8 * kk + 4], c[8 * kk + 5]);
    a[kk][3] = pack2<T>(c[8 * kk + 6], c[8 * kk + 7]);
  }
}

// Stores the fragments a (rows key0, key0 + 8 of this thread; columns
// 16 kk + 2 t4 (+ 8)) into the swizzled [BN][BM] tile at ds: a warp's store
// of one register hits 8 distinct 16-byte chunks of 8 rows, no conflict.
template <int BN, int BM>
__device__ __forceinline__ void store_frags(unsigned char* ds, const uint32_t (&a)[BM / 16][4],
                                            int key0, int t4) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
    for (int x = 0; x < 4; ++x)
      *reinterpret_cast<uint32_t*>(
          ds + sm90::swizzled_offset(BN, key0 + 8 * (x & 1), 16 * kk + 8 * (x >> 1) + 2 * t4)) =
          a[kk][x];
}

// Keeps registers a wgmma still reads (A fragments) allocated to their
// values until after the wait that follows.
template <int N>
__device__ __forceinline__ void hold(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}

#ifndef ATTN_BWD_SM90_TRACE
#define ATTN_BWD_SM90_TRACE 0
#endif
#if ATTN_BWD_SM90_TRACE
}  // namespace bwd_sm90
}  // namespace attn::flash
#include <cstdio>
namespace attn::flash {
namespace bwd_sm90 {
// Per-launch sums of the blocks' phases (cycles; see Trace).
static __device__ unsigned long long trace_sum[8];
static __device__ unsigned int trace_blocks;
#endif

// Diagnostic builds (-DATTN_BWD_SM90_TRACE=1): thread 0 of every block
// times the phases of its work item with clock64() and adds them to
// per-launch sums when the block ends (wherever it returns);
// trace_print_kernel, launched after the kernel, prints the averages per
// item and resets them (a printf in the kernel itself is a call, across
// which ptxas serialises every wgmma of the kernel: warning C7510). Phases:
// 0 from the start to the loop (the item's lookup, the first loads issued),
// 1 waiting for K, V and the first query tile, 2 the iterations, then the
// end: 3 the last loads drained and dQ's last reductions complete, 4 dK and
// dV staged (or, accumulated ones, added), 5 their stores issued. The
// default build's methods are empty.
struct Trace {
#if ATTN_BWD_SM90_TRACE
  long long t0 = 0, last = 0, ph[6] = {0, 0, 0, 0, 0, 0};
  int iters = -1;  // -1: the block had no item
  __device__ Trace() {
    if (threadIdx.x == 0) t0 = last = clock64();
  }
  __device__ void mark(int k) {
    if (threadIdx.x != 0) return;
    const long long t = clock64();
    ph[k] += t - last;
    last = t;
  }
  __device__ void item(int n) { iters = n; }
  __device__ ~Trace() {
    if (threadIdx.x != 0) return;
    mark(5);
    if (iters >= 0) {
      for (int k = 0; k < 6; ++k) atomicAdd(&trace_sum[k], (unsigned long long)ph[k]);
      atomicAdd(&trace_sum[6], (unsigned long long)iters);
      atomicAdd(&trace_sum[7], 1ull);
    }
    atomicAdd(&trace_blocks, 1u);
  }
#else
  __device__ void mark(int) {}
  __device__ void item(int) {}
#endif
};

#if ATTN_BWD_SM90_TRACE
// One thread, after the dK/dV kernel: the launch's averages per item.
// Static, as the sums it reads: each source that launches the kernel has its
// own copy.
static __global__ void trace_print_kernel() {
  const double n = double(trace_sum[7] ? trace_sum[7] : 1);
  printf("bwd-trace: %u blocks, %llu with an item, %.2f iterations each; cycles per item: "
         "start %.0f first loads %.0f iterations %.0f (%.0f each) end %.0f (drain and dQ %.0f, "
         "dK/dV staged %.0f, stored %.0f)\n",
         trace_blocks, trace_sum[7], double(trace_sum[6]) / n, double(trace_sum[0]) / n,
         double(trace_sum[1]) / n, double(trace_sum[2]) / n,
         trace_sum[6] ? double(trace_sum[2]) / double(trace_sum[6]) : 0.0,
         double(trace_sum[3] + trace_sum[4] + trace_sum[5]) / n, double(trace_sum[3]) / n,
         double(trace_sum[4]) / n, double(trace_sum[5]) / n);
  for (int k = 0; k < 8; ++k) trace_sum[k] = 0;
  trace_blocks = 0;
}
#endif

}  // namespace bwd_sm90

// Accum: dQ is added into p.dq_accum; otherwise (deterministic plans) the
// kernel computes dK and dV only. Cap: softcap plans. Sparse: block-sparse
// plans (p.sparse_kv; not with Cap).
template <class T, int D, bool Accum, bool Cap, bool Sparse = false, bool Moba = false,
          bool Gather = false>
__device__ __forceinline__ void flash_bwd_dkdv_sm90_tile(const BwdParams& p) {
  static_assert(!(Sparse && Cap), "no softcap on block-sparse plans");
  static_assert(!(Moba && (Sparse || Cap)), "MoBA: neither block masks nor softcap");
  static_assert(!Gather || Moba, "gathered rows: MoBA only");
  // Stages of Q, dO and their row statistics (BwdSm90Config): three for
  // block-sparse plans, loaded two iterations ahead.
  constexpr int QS = Sparse ? 3 : 2;
  using Tr = BwdSm90Traits<D, QS>;
  constexpr int BM = Tr::kBM, BN = Tr::kBN, NTH = Tr::kThreads, LDQ = Tr::kLdDq;
  constexpr int NS = BM / 2;  // S^T, dP^T accumulators per thread
  constexpr int NA = D / 2;   // dK, dV accumulators per thread
  bwd_sm90::Trace trace;      // diagnostic builds only

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t raw = smem_u32(smem);
  const uint32_t s0 = (raw + 1023u) & ~1023u;  // the swizzle atom's alignment
  unsigned char* const sb = smem + (s0 - raw);
  const uint32_t sK = s0 + Tr::kOffK, sV = s0 + Tr::kOffV, sQ = s0 + Tr::kOffQ,
                 sDo = s0 + Tr::kOffDo, sDs = s0 + Tr::kOffDs, sStat = s0 + Tr::kOffStat,
                 sStage = s0 + Tr::kOffStage;
  const float* stat = reinterpret_cast<const float*>(sb + Tr::kOffStat);
  float* stage = reinterpret_cast<float*>(sb + Tr::kOffStage);

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  // by = hk * group_splits + part: KV head hk, query heads [h_first,
  // h_first + heads_per) of its group; bx: the KV tile. Sparse: bx is a
  // work item of the slot, in the launch order of sparse_kv_block (as
  // flash_bwd_dkdv_tile's).
  const int b = blockIdx.z;
  int bx = int(blockIdx.x), by = int(blockIdx.y);
  if constexpr (Sparse)
    sparse_kv_block(p.sparse_kv, bx + by * int(gridDim.x), int(gridDim.x), int(gridDim.y), bx, by);
  const int hk = by / p.group_splits;
  const int heads_per = p.group / p.group_splits;
  const int h_first = hk * p.group + (by - hk * p.group_splits) * heads_per;
  // Sparse: the item's KV tile, its visits [item_begin, item_end) and the
  // tile's accumulator slot (-1: its list is not cut).
  KvWorkItem it{bx, 0, 0, -1};
  if constexpr (Sparse)
    if (!kv_work_item(p.sparse_kv, b, hk, bx, &it)) return;  // this slot has fewer items
  const int kv_tile = it.kv_tile, item_begin = it.visit_begin, item_end = it.visit_end,
            acc_slot = it.acc_slot;
  const int c0 = kv_tile * BN;  // first key of the tile

  int lq = p.seqlen_q, lk = p.seqlen_kv;
  int64_t q_tok = int64_t(b) * p.seqlen_q, kv_tok = 0;
  const bool varlen = p.cu_q != nullptr;
  if (varlen) {
    q_tok = p.cu_q[b];
    kv_tok = p.cu_kv[b];
    lq = p.cu_q[b + 1] - int(q_tok);
    lk = p.cu_kv[b + 1] - int(kv_tok);
  }
  if (c0 >= lk) return;
  const int kv_valid = min(BN, lk - c0);

  // Visible pairs: dmin <= j - i <= dmax (as flash_bwd_dkdv_tile).
  const int off = lk - lq + (p.diag_shift != nullptr ? p.diag_shift[b] : 0);
  constexpr long long kFar = 1ll << 30;
  auto clamp_far = [](long long x) { return int(x < -kFar ? -kFar : (x > kFar ? kFar : x)); };
  const int dmin = p.window_left < 0 ? int(-kFar) : clamp_far((long long)off - p.window_left);
  const int dmax = p.window_right < 0 ? int(kFar) : clamp_far((long long)off + p.window_right);
  const int row_lo = max(0, c0 - dmax);
  const int row_hi = int(min((long long)lq - 1, (long long)c0 + kv_valid - 1 - dmin));
  // Sparse: m counts the visits of the item (query tile, kind) instead of
  // query tiles.
  const int32_t* visits = nullptr;
  int m_begin, n_mt;
  // MoBA: the KV tile lies in block c0 / block, whose list holds the query
  // tiles (one word each) in which some row selected it.
  if constexpr (Gather) {
    m_begin = 0;
    n_mt = 0;  // see walk
  } else if constexpr (Moba) {
    const MobaLists& mb = p.moba;
    const int64_t list = (int64_t(b) * (p.heads_q / p.group) + hk) * mb.num_blocks + c0 / mb.block;
    m_begin = 0;
    n_mt = mb.kv_count[list];
    visits = mb.kv_tiles + list * mb.kv_cap;
  } else if constexpr (Sparse) {
    m_begin = 0;
    n_mt = item_end - item_begin;
    visits = p.sparse_kv.visits + 2 * int64_t(item_begin);
  } else {
    m_begin = row_lo <= row_hi ? row_lo / BM : 0;
    n_mt = row_lo <= row_hi ? row_hi / BM - m_begin + 1 : 0;
  }
  const int m_end = m_begin + n_mt;
  // MoBA gather: the rows of the group's heads that selected the block, the
  // first numbered (for the mask) as the block's first own row.
  if (Gather && tid == 0) {
    int* fields = bwd_sm90::moba_gather_fields;
    fields[0] = b, fields[1] = hk, fields[2] = c0 / p.moba.block, fields[3] = h_first + heads_per;
    fields[4] = moba_walk_skip(row_lo, max(0, (c0 / p.moba.block) * p.moba.block - off), BM);
  }
  if constexpr (Gather) __syncthreads();
  const MobaGatherWalk<BM, bwd_sm90::WalkFieldsSmem> walk{p, {}};
  const int moba_row0 = Gather ? max(0, (c0 / p.moba.block) * p.moba.block - off) : 0;
  const int n_iter = Gather ? walk.tiles(h_first) : n_mt * heads_per;
  // MoBA gather: ring entry `e` := the walk's tile after (hh, mm) (from
  // (h_first, -1): the first); its indices by cp.async (async) or loads.
  // Only the threads that write the entry walk the lists (their global
  // loads stalled every warp); the others read it after a barrier.
  static_assert(!Gather || BM <= bwd_sm90::kGatherRowsMax, "a tile's indices fit the ring");
  static_assert(!Gather || BM % 32 == 0, "whole warps walk");
  auto gather_fill = [&](int e, int hh, int mm, bool async) {
    if (tid >= BM) return;
    walk.next(hh, mm);
    int count;
    const int32_t* idx = walk.rows(hh, count) + mm * BM;
    const int rows = min(BM, count - mm * BM);
    bwd_sm90::GatherTile& t = bwd_sm90::moba_gather_ring[e % bwd_sm90::kGatherRing];
    if (tid == 0) t.h = hh, t.m = mm, t.rows = rows;
    if (tid < rows) {
      if (async) cp_async_4(smem_u32(&t.idx[tid]), idx + tid);
      else t.idx[tid] = idx[tid];
    }
  };
  if constexpr (Gather) {
    // Tile 0 (load_q(it) fills tile it + 1).
    if (n_iter > 0) gather_fill(0, h_first, -1, false);
    __syncthreads();
  }
  // The query tile of step mm.
  auto q_tile = [&](int mm) {
    if constexpr (Moba) return visits[mm] & kMobaIndexMask;
    else if constexpr (Sparse) return visits[2 * mm];
    else return mm;
  };

  // Iteration it: query head h_first + it / n_mt, query tile q_tile(m_begin + it % n_mt).
  int ld_h = h_first, ld_m = m_begin;  // the next tile to load (not Gather)
  auto load_q = [&](int it) {
    if constexpr (Gather) {  // ring entry it, then entry it + 1 goes out
      const int h = bwd_sm90::gather_field(it, 0), rows = bwd_sm90::gather_field(it, 2);
      const int32_t* idx = bwd_sm90::moba_gather_ring[it % bwd_sm90::kGatherRing].idx;
      if (it + 1 < n_iter)
        gather_fill(it + 1, h, bwd_sm90::gather_field(it, 1), true);
      const uint32_t st = uint32_t(it & 1);
      const int64_t qs = opaque(p.q_seq), ds = opaque(p.do_seq);
      sm90::load_rows_swizzled<BM, D, NTH>(
          sQ + st * Tr::kTileQ, static_cast<const T*>(p.q) + b * p.q_batch + h * p.q_head, qs, idx,
          rows, tid);
      sm90::load_rows_swizzled<BM, D, NTH>(
          sDo + st * Tr::kTileQ, static_cast<const T*>(p.d_o) + b * p.do_batch + h * p.do_head,
          ds, idx, rows, tid);
      if (tid < 2 * BM) {
        const int r = tid % BM;
        const float* src = (tid < BM ? p.lse2 : p.delta) + b * p.lse_batch + h * p.lse_head;
        cp_async_4(sStat + (st * 2 * BM + tid) * 4u, r < rows ? src + idx[r] : src, r < rows);
      }
      return;
    }
    const int h = ld_h, r0 = q_tile(ld_m) * BM;
    if (++ld_m == m_end) ld_m = m_begin, ++ld_h;
    const int rows = min(BM, lq - r0);
    const uint32_t st = uint32_t(it % QS);
    const int64_t qs = opaque(p.q_seq), ds = opaque(p.do_seq), tok = opaque(q_tok);
    const T* gQb = static_cast<const T*>(p.q) + (varlen ? tok * qs : b * p.q_batch);
    const T* gDob = static_cast<const T*>(p.d_o) + (varlen ? tok * ds : b * p.do_batch);
    const int64_t stat_base = varlen ? tok : b * p.lse_batch;
    sm90::load_tile_swizzled<BM, D, NTH>(sQ + st * Tr::kTileQ, gQb + h * p.q_head + r0 * qs, qs,
                                         rows, tid);
    sm90::load_tile_swizzled<BM, D, NTH>(sDo + st * Tr::kTileQ, gDob + h * p.do_head + r0 * ds,
                                         ds, rows, tid);
    if (tid < 2 * BM) {
      const int r = tid % BM;
      const float* src = (tid < BM ? p.lse2 : p.delta) + stat_base + h * p.lse_head + r0;
      cp_async_4(sStat + (st * 2 * BM + tid) * 4u, r < rows ? src + r : src, r < rows);
    }
  };

  float acc_dk[NA], acc_dv[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) acc_dk[i] = acc_dv[i] = 0.0f;

  if (n_iter > 0) {
    const T* gK = static_cast<const T*>(p.k) + (varlen ? kv_tok * p.k_seq : b * p.k_batch) +
                  hk * p.k_head + c0 * p.k_seq;
    const T* gV = static_cast<const T*>(p.v) + (varlen ? kv_tok * p.v_seq : b * p.v_batch) +
                  hk * p.v_head + c0 * p.v_seq;
    sm90::load_tile_swizzled<BN, D, NTH>(sK, gK, p.k_seq, kv_valid, tid);
    sm90::load_tile_swizzled<BN, D, NTH>(sV, gV, p.v_seq, kv_valid, tid);
    load_q(0);
  }
  cp_async_commit();
  if constexpr (QS == 3) {  // tile 1 in a group of its own
    if (n_iter > 1) load_q(1);
    cp_async_commit();
  }
  trace.item(n_iter);
  trace.mark(0);

  // This thread's accumulator rows of S^T, dK, dV: keys key0, key0 + 8.
  const int key0 = wg * 64 + ((wtid >> 5) << 4) + g;
  const uint32_t k_rows = sK + uint32_t(wg * 64 * 128), v_rows = sV + uint32_t(wg * 64 * 128);
  // dQ: warpgroup wg computes rows [dq_r, dq_r + 64) x columns [dq_c, dq_c + 64).
  constexpr bool kSplitRows = BM == 128;  // d = 64; d = 128 splits the columns
  const int dq_r = kSplitRows ? wg * 64 : 0, dq_c = kSplitRows ? 0 : wg * 64;
  const uint32_t dq_a = sDs + uint32_t(kSplitRows ? wg * BN * 128 : 0);
  const uint32_t dq_b = sK + uint32_t(kSplitRows ? 0 : wg * BN * 128);
  const float sl2 = p.scale_log2;

  // Deterministic plans (no accumulator) get dQ from the sm_80 dQ kernel.
  constexpr bool accum = Accum;
  int h = h_first, m = m_begin;  // the tile of this iteration (not Gather: the ring's)
  // The staged dQ of the previous iteration's tile (Gather: tile t's), one
  // bulk reduction per valid row, issued by thread `row` (the staging
  // writes are behind a fence and a barrier).
  auto bulk_issue = [&](int t) {
    if constexpr (Gather) {  // at the rows' indices
      if (tid < bwd_sm90::gather_field(t, 2)) {
        const int32_t row = bwd_sm90::moba_gather_ring[t % bwd_sm90::kGatherRing].idx[tid];
        float* dst = p.dq_accum + ((opaque(q_tok) + row) * p.heads_q + bwd_sm90::gather_field(t, 0)) * D;
        bulk_reduce_add_f32(dst, sStage + uint32_t(tid * LDQ * 4), D * 4);
        bulk_commit();
      }
      return;
    }
    const bool first = m == m_begin;
    const int pm = first ? m_end - 1 : m - 1, ph = first ? h - 1 : h;
    const int pr0 = q_tile(pm) * BM;
    if (tid < min(BM, lq - pr0)) {
      float* dst = p.dq_accum + ((opaque(q_tok) + pr0 + tid) * p.heads_q + ph) * D;
      bulk_reduce_add_f32(dst, sStage + uint32_t(tid * LDQ * 4), D * 4);
      bulk_commit();
    }
  };

#pragma unroll 1
  for (int it = 0; it < n_iter; ++it) {
    cp_async_wait<QS - 2>();  // tile `it` (three stages: tile it + 1 may be on its way)
    sm90::fence_proxy_async();
    __syncthreads();  // tile `it` landed; iteration it-1 is done with the other stage and dS^T
    if (it == 0) trace.mark(1);

    int r0, rows;
    if constexpr (Gather) {
      r0 = moba_row0 + bwd_sm90::gather_field(it, 1) * BM;
      rows = bwd_sm90::gather_field(it, 2);
    } else {
      r0 = q_tile(m) * BM;
      rows = min(BM, lq - r0);
    }
    const int r1 = r0 + rows - 1;
    const uint32_t st = uint32_t(it % QS);
    const uint32_t q_st = sQ + st * Tr::kTileQ, do_st = sDo + st * Tr::kTileQ;
    const float* lse_s = stat + st * 2 * BM;
    const float* del_s = lse_s + BM;

    // S^T and dP^T (two groups: the exponentials start while dP^T runs).
    float s[NS], dp[NS];
    sm90::wgmma_fence();
    bwd_sm90::issue_scores<T, D, BM, BN>(s, k_rows, q_st);
    sm90::wgmma_commit();
    bwd_sm90::issue_scores<T, D, BM, BN>(dp, v_rows, do_st);
    sm90::wgmma_commit();
    // The next tile's loads (into the stage no GEMM in flight reads) and the
    // previous tile's dQ reductions go out while the tensor cores run.
    if (it + QS - 1 < n_iter) load_q(it + QS - 1);
    cp_async_commit();
    if (accum && it > 0) bulk_issue(it - 1);
    // Sparse: the visit's kind, and for a bit tile this thread's key rows
    // key0, key0 + 8 of it ([BN keys][WPR words]), read while the GEMMs run.
    constexpr int WPR = (BM + 63) / 64;
    int kind = kVisitDense;
    uint64_t bit_rows[2][WPR];
    if constexpr (Sparse) {
      kind = visits[2 * m + 1];
      if (kind >= 0) {
        const uint64_t* tb = p.sparse_kv.bits + int64_t(kind) * (BN * WPR);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int x = 0; x < WPR; ++x) bit_rows[hh][x] = tb[(key0 + 8 * hh) * WPR + x];
      }
    }
    // MoBA: the selection bits of the tile's rows (r0 is a multiple of BM,
    // itself of 64) in query head h's slot, the same for every key row
    // (words past the sequence's rows are 0), read while the GEMMs run; and
    // whether every row of every query head of the group selected the block.
    [[maybe_unused]] uint64_t moba_sel[WPR];
    bool moba_all = false;
    if constexpr (Moba && !Gather) {
      const MobaLists& mb = p.moba;
      moba_all = (visits[m] & kMobaAllRows) != 0;
      const int64_t slot = int64_t(b) * mb.sel_heads + (mb.per_query_head ? h : hk);
      const int q_words = (lq + 63) / 64;
      const uint64_t* col = mb.selected + (slot * mb.num_blocks + c0 / mb.block) * q_words;
#pragma unroll
      for (int x = 0; x < WPR; ++x) {
        const int w = r0 / 64 + x;
        moba_sel[x] = w < q_words ? col[w] : 0ull;
      }
    }
    if constexpr (Cap) {
      // Both GEMMs done: z = cap tanh(u) and, with q = 2 / (e^{2u} + 1),
      // dP^T - D becomes (dP^T - D) (1 - tanh^2) = (dP^T - D) q (2 - q)
      // (softcap_logit).
      sm90::wgmma_wait<0>();
      sm90::reg_fence(s);
      sm90::reg_fence(dp);
      const float cap = p.softcap, cin = p.softcap_in;
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        const float2 dd = *reinterpret_cast<const float2*>(del_s + 8 * j + 2 * t4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float q;
          s[4 * j + e] = softcap_logit(s[4 * j + e] * cin, cap, q);
          dp[4 * j + e] = (dp[4 * j + e] - ((e & 1) ? dd.y : dd.x)) * (q * (2.0f - q));
        }
      }
    } else {
      sm90::wgmma_wait<1>();
      sm90::reg_fence(s);
    }
    // P^T: column (query) 8 j + 2 t4 + (e & 1) of register 4 j + e.
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const float2 l = *reinterpret_cast<const float2*>(lse_s + 8 * j + 2 * t4);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], sl2, -((e & 1) ? l.y : l.x)));
    }
    // Mask (P = 0 by selection: the value may be inf past the last key):
    // key jl (local) sees query il (local) when jl - hi_rel <= il <=
    // jl - lo_rel and jl < kv_valid. dS = P (dP - D) is then 0 there too
    // (dP and D are finite). Sparse: the visit's kind says full, dense mask
    // or bit tile.
    bool full;
    if constexpr (Sparse) {
      full = kind == kVisitFull;
    } else {
      full = c0 + BN <= lk && c0 - r1 >= dmin && c0 + BN - 1 - r0 <= dmax;
      if constexpr (Moba && !Gather) full = full && moba_all;
    }
    if (Sparse && kind >= 0) {
      // Bit tile: column (query) 8 j + 2 t4 + (e & 1) of register 4 j + e
      // lies in word j / 8 (a constant per unrolled j).
#pragma unroll
      for (int j = 0; j < BM / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * t4 + (e & 1);
          if (!((bit_rows[e >> 1][(8 * j) >> 6] >> (col & 63)) & 1u)) s[4 * j + e] = 0.0f;
        }
    } else if (!full) {
      auto clampi = [](long long x) {
        return int(x < -(BM + 1) ? -(BM + 1) : (x > BN + 1 ? BN + 1 : x));
      };
      const int lo_rel = clampi((long long)dmin - (c0 - r0));
      const int hi_rel = clampi((long long)dmax - (c0 - r0));
      Interval vis[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int jl = key0 + 8 * hh;
        vis[hh] = Interval::of(jl - hi_rel, jl < kv_valid ? jl - lo_rel : -BN - BM);
      }
#pragma unroll
      for (int j = 0; j < BM / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * t4 + (e & 1);
          bool hidden = vis[e >> 1].outside(col);
          // MoBA: query col's row did not select the block (word j / 8, a
          // constant per unrolled j).
          if constexpr (Moba && !Gather)
            hidden = hidden || !((moba_sel[(8 * j) >> 6] >> (col & 63)) & 1u);
          if (hidden) s[4 * j + e] = 0.0f;
        }
    }
    // dV += P^T dO runs while dS^T is computed.
    uint32_t pa[BM / 16][4], da[BM / 16][4];
    bwd_sm90::pack_a<T, BM>(pa, s);
    sm90::wgmma_fence();
    bwd_sm90::issue_grad<T, D, BM>(acc_dv, pa, do_st);
    sm90::wgmma_commit();
    if constexpr (Cap) {
#pragma unroll
      for (int i = 0; i < NS; ++i) dp[i] *= s[i];  // dP^T - D, gated above
    } else {
      sm90::wgmma_wait<1>();  // dP^T done
      sm90::reg_fence(dp);
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        const float2 dd = *reinterpret_cast<const float2*>(del_s + 8 * j + 2 * t4);
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? dd.y : dd.x));
      }
    }
    bwd_sm90::pack_a<T, BM>(da, dp);
    if (accum) {
      bwd_sm90::store_frags<BN, BM>(sb + Tr::kOffDs, da, key0, t4);
      sm90::fence_proxy_async();  // dS^T is read by the tensor cores after the barrier
    }
    sm90::wgmma_fence();
    bwd_sm90::issue_grad<T, D, BM>(acc_dk, da, q_st);
    sm90::wgmma_commit();
    if (accum) {
      bulk_wait_read<0>();  // the staging tile is read before it is rewritten
      __syncthreads();      // dS^T complete
      float dq[32];
      sm90::wgmma_fence();
      bwd_sm90::issue_dq<T, BN>(dq, dq_a, dq_b);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::reg_fence(dq);
      // To the staging tile (rows past `rows` hold zeros: dS^T is 0 there,
      // and no reduction reads them).
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<float2*>(stage + (dq_r + ((wtid >> 5) << 4) + g + 8 * hh) * LDQ +
                                     dq_c + 8 * j + 2 * t4) =
              make_float2(dq[4 * j + 2 * hh], dq[4 * j + 2 * hh + 1]);
      fence_proxy_async_shared();  // read by the bulk reductions after the next barrier
    }
    sm90::wgmma_wait<0>();
    bwd_sm90::hold(pa);
    bwd_sm90::hold(da);
    sm90::reg_fence(acc_dv);
    sm90::reg_fence(acc_dk);
    if constexpr (Gather) continue;
    if (++m == m_end) m = m_begin, ++h;
  }
  trace.mark(n_iter > 0 ? 2 : 1);
  cp_async_wait<0>();
  __syncthreads();  // every warpgroup is done with K and V, the last tile is staged
  if (accum && n_iter > 0) {
    bulk_issue(n_iter - 1);  // the last tile's dQ
    bulk_wait<0>();  // shared memory must outlive the copies
  }
  trace.mark(3);

  // Block-sparse plans without split groups accumulate only the tiles whose
  // list is cut, in slots of their own (compact); the others store directly.
  bool compact = false;
  if constexpr (Sparse) compact = p.group_splits == 1;
  if (compact ? acc_slot >= 0 : p.dk_accum != nullptr) {
    // A split group: add this block's share (dK unscaled) into the fp32
    // accumulators [token][heads_kv][D]; a cut list (compact): into its
    // tile's slot of [batch][heads_kv][max_cut][BN][D]. Rows past the
    // sequence add nothing.
    const int64_t heads_kv = p.heads_q / p.group;
    const int64_t tok0 = (varlen ? kv_tok : int64_t(b) * p.seqlen_kv) + c0;
    int64_t slot_row0 = 0;
    if constexpr (Sparse)
      slot_row0 = ((int64_t(b) * heads_kv + hk) * p.sparse_kv.max_cut + acc_slot) * BN;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = key0 + 8 * hh;
      if (row >= kv_valid) continue;
      int64_t at = ((tok0 + row) * heads_kv + hk) * D + 2 * t4;
      if constexpr (Sparse)
        if (compact) at = (slot_row0 + row) * D + 2 * t4;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        red_add_f32x2(p.dk_accum + at + 8 * j, acc_dk[4 * j + 2 * hh], acc_dk[4 * j + 2 * hh + 1]);
        red_add_f32x2(p.dv_accum + at + 8 * j, acc_dv[4 * j + 2 * hh], acc_dv[4 * j + 2 * hh + 1]);
      }
    }
    trace.mark(4);
    return;
  }

  // Epilogue: dK = scale * acc_dk and dV staged in the K and V tiles (same
  // swizzled layout), then written with 16-byte stores.
  const float scale = p.scale;
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t o = sm90::swizzled_offset(BN, key0 + 8 * hh, 8 * j + 2 * t4);
      *reinterpret_cast<uint32_t*>(sb + Tr::kOffK + o) =
          pack2<T>(acc_dk[4 * j + 2 * hh] * scale, acc_dk[4 * j + 2 * hh + 1] * scale);
      *reinterpret_cast<uint32_t*>(sb + Tr::kOffV + o) =
          pack2<T>(acc_dv[4 * j + 2 * hh], acc_dv[4 * j + 2 * hh + 1]);
    }
  __syncthreads();
  trace.mark(4);
  T* gdK = static_cast<T*>(p.dk) + (varlen ? kv_tok * p.dk_seq : b * p.dk_batch) +
           hk * p.dk_head + c0 * p.dk_seq;
  T* gdV = static_cast<T*>(p.dv) + (varlen ? kv_tok * p.dv_seq : b * p.dv_batch) +
           hk * p.dv_head + c0 * p.dv_seq;
  constexpr int CH = D / 8;
#pragma unroll
  for (int i = 0; i < BN * CH / NTH; ++i) {
    const int c = tid + i * NTH;
    const int r = c / CH, ch = c % CH;
    if (r < kv_valid) {
      const uint32_t o = sm90::swizzled_offset(BN, r, ch * 8);
      *reinterpret_cast<uint4*>(gdK + r * p.dk_seq + ch * 8) =
          *reinterpret_cast<const uint4*>(sb + Tr::kOffK + o);
      *reinterpret_cast<uint4*>(gdV + r * p.dv_seq + ch * 8) =
          *reinterpret_cast<const uint4*>(sb + Tr::kOffV + o);
    }
  }
}

template <class T, int D, bool Accum, bool Cap = false>
__global__ void __launch_bounds__(BwdSm90Traits<D>::kThreads, 1)
    flash_bwd_dkdv_sm90_kernel(const __grid_constant__ BwdParams p) {
#if ATTN_SM90_WGMMA
  flash_bwd_dkdv_sm90_tile<T, D, Accum, Cap>(p);
#endif
}

// MoBA plans (the tile-union lists): grid as flash_bwd_dkdv_sm90_kernel's.
template <class T, int D, bool Accum>
__global__ void __launch_bounds__(BwdSm90Traits<D>::kThreads, 1)
    flash_bwd_dkdv_sm90_moba_kernel(const __grid_constant__ BwdParams p) {
#if ATTN_SM90_WGMMA
  flash_bwd_dkdv_sm90_tile<T, D, Accum, false, false, true>(p);
#endif
}

// MoBA's gathered rows: grid as flash_bwd_dkdv_sm90_kernel's.
template <class T, int D, bool Accum>
__global__ void __launch_bounds__(BwdSm90Traits<D>::kThreads, 1)
    flash_bwd_dkdv_sm90_moba_gather_kernel(const __grid_constant__ BwdParams p) {
#if ATTN_SM90_WGMMA
  flash_bwd_dkdv_sm90_tile<T, D, Accum, false, false, true, true>(p);
#endif
}

// Block-sparse plans: grid (the most work items of a slot, heads_kv *
// group_splits, batch), the sm_80 Sparse instantiation's.
template <class T, int D, bool Accum>
__global__ void __launch_bounds__(BwdSm90Traits<D>::kThreads, 1)
    flash_bwd_dkdv_sm90_bsparse_kernel(const __grid_constant__ BwdParams p) {
#if ATTN_SM90_WGMMA
  flash_bwd_dkdv_sm90_tile<T, D, Accum, false, true>(p);
#endif
}

}  // namespace attn::flash
