// FlashAttention-2 forward on tensor cores (sm_80+: mma.sync m16n8k16,
// ldmatrix, cp.async). One thread block computes one query tile of one head:
//
//   Q tile  [BM][D]    loaded once, cp.async -> shared
//   K, V    [BN][D]    streamed through `stages` shared buffers each
//   S = Q K^T          [BM][BN] fp32 in registers, each warp owning R = BM / warps rows
//   P = exp2(S - m)    rounded to T and fed back as the A operand of P V
//   O += P V           [BM][D] fp32 in registers
//
// The KV tiles of a query tile are the interval given by the dense mask
// (bottom-right aligned window, causal = (unbounded, 0)); a tile whose pairs
// are all visible skips the element predicate. This is the arithmetic of
// src/schedule/dense_schedule.hpp (kv_tiles_of, is_full), redone here
// because device code does not include host headers. Block-sparse plans
// (Sparse) take the KV tiles from a list instead (p.sparse, built by
// src/cuda/block_sparse.hpp), each marked full, dense-masked, or masked by
// a precomputed bit tile; the loop is the same (or, in
// flash_fwd_bsparse_persistent_kernel, resident blocks run that body for
// the query tiles dealt to them at plan creation). Tiles are visited from the
// last to the first, so the partially masked tiles of a causal diagonal come
// first. MoBA plans (Moba) take the blocks the selector chose for the tile
// (p.moba, written into the workspace at run time) and visit every KV tile
// of each, the last one up to the diagonal; a tile some row did not select
// gets a predicate of one selection bit per row on top of the causal one.
// MoBA's gathered forward (flash_fwd_moba_gather_kernel) computes one round
// (p.moba.fwd_round) per launch: every row's round-r block, for tiles of
// the rows whose round-r block is the same (the selector's round lists,
// rows loaded by index; round 0's rows numbered as themselves for the
// causal mask, the others' from the first row after the block's own rows,
// so that they see all of it), and merges each row's result into its
// softmax state in the workspace (p.moba.state) by the (O, LSE) rule; round
// 0 is each row's own block, whose write starts its state, and a row's last
// round writes its O and LSE instead.
// Softmax statistics are fp32: m (running max of the raw or softcapped
// logit) and l (sum of exp2, kept per thread and reduced over the 4 threads
// of a row at the end). A row that sees no key ends with l = 0 and gives
// O = 0, LSE = -inf.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "flash/fwd_params.cuh"
#include "flash/sequence.cuh"
#include "flash/sm80.cuh"
#include "sparse/prefetch.cuh"

namespace attn::flash {

template <int D>
struct FwdTraits {
  static constexpr FwdConfig kCfg = fwd_config(D);
  static constexpr int kBlockM = kCfg.block_m;
  static constexpr int kBlockN = kCfg.block_n;
  static constexpr int kWarps = kCfg.warps;
  static constexpr int kStages = kCfg.stages;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = kBlockM / kWarps;  // query rows per warp
  static constexpr int kLd = D + 8;               // padded smem row, in elements
  // Two blocks per SM where registers allow (255 each at 128 threads).
  static constexpr int kMinBlocks = kThreads == 128 ? 2 : 1;
  static_assert(D % 16 == 0 && kBlockN % 16 == 0 && kRows % 16 == 0, "whole mma tiles");
};

// A row's softmax sum l over the four lanes of its quad (each holds a
// quarter of the row's columns).
__device__ __forceinline__ float quad_sum(float l) {
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  return l;
}

// A row's LSE (natural log) from its max m, in the units of the logits
// before scale_log2, and its sum l: -inf for a row that saw no key.
__device__ __forceinline__ float row_lse(float m, float l, float scale_log2) {
  constexpr float kLn2 = 0.69314718055994531f;
  return l != 0.0f ? m * scale_log2 * kLn2 + logf(l) : -INFINITY;  // NaN stays NaN
}

// MoBA's gathered forward: one query tile of a round's lists, rows [start,
// start + rows) of its (sequence, selecting head)'s round rows, all of
// which selected block kb; r0 numbers the first for the causal mask.
struct MobaGatherTile {
  int kb, start, rows, r0;
};
// The gathered forward's current tile, set by flash_fwd_moba_gather_kernel
// and read from shared memory where used (gather_field), so that no
// register holds it through the main loop (in registers, the d = 128
// kernel spilled 80 bytes).
__shared__ MobaGatherTile moba_gather_tile;
__device__ __forceinline__ int gather_field(const volatile int& x) { return x; }

// MoBA gather, the forward's end: merges the tile's normalised O (sO, fp32
// [BM][D + 4]) and LSE (sL [BM]) into the states of the tile's rows (their
// entries and old LSE in moba_merge_rows, below), or, for the rows whose
// last round this is, writes their O and LSE. Per-row work first (one
// thread a row: the weights, into shared memory after sL), then the
// channels in batches of up to kMergeBatch independent 16-byte loads per
// thread (64 KiB of state in flight per tile at d = 128): one state row
// load after another, each waiting on the last, left the tile's end
// latency-bound (ncu: the rounds after the first ran at about half the
// dense kernel's tensor rate). Not inlined: inlined, it made the d = 128
// kernel spill 88 bytes (sm_90a). Shared memory used: BM * (D + 8) floats.
constexpr int kMergeBatch = 16;

// The gathered forward's rows of the current tile, read at the tile's start
// (moba_merge_prefetch, before Q's copies, whose addresses need the same
// entries), so that the merge at its end waits on no global load but the
// state rows, which the start also asks L2 for: the rows' list entries, and
// in rounds after the first their states' LSE (by cp.async, landing with
// the copies of the tile's first KV tile).
constexpr int kMobaMergeRows = 128;  // the gathered kernels' query tile
struct MobaMergeRows {
  int32_t entry[kMobaMergeRows];
  float lse[kMobaMergeRows];
};
__shared__ MobaMergeRows moba_merge_rows;

template <int BM, int D, int NTH>
__device__ __forceinline__ void moba_merge_prefetch(const FwdParams& p, int start, int rows,
                                                    int tid) {
  static_assert(BM <= kMobaMergeRows, "a tile's rows fit");
  const MobaLists& mb = p.moba;
  const int b = int(blockIdx.z), h = int(blockIdx.y);
  const int64_t rows_all = int64_t(gridDim.z) * gridDim.y * p.seqlen_q;
  const int64_t head_rows = (int64_t(b) * gridDim.y + h) * p.seqlen_q;
  const int64_t slot = int64_t(b) * mb.sel_heads + (mb.per_query_head ? h : h / p.group);
  const int32_t* idx = mb.kv_tiles + slot * int64_t(mb.kv_cap) + start;
  const bool fresh = mb.fwd_round == 0;
  constexpr int kLines = D * 4 / 128;  // 128-byte lines of a state row
  for (int r = tid; r < rows; r += NTH) {
    const int32_t e = idx[r];
    const int64_t row = head_rows + (e & kMobaRowMask);
    moba_merge_rows.entry[r] = e;
    if (!fresh) {
#pragma unroll
      for (int l = 0; l < kLines; ++l) prefetch_l2(mb.state + row * D + l * 32);
      cp_async_4(smem_u32(&moba_merge_rows.lse[r]), mb.state + rows_all * D + row);
    }
  }
}
template <int BM, int D>
constexpr int kMobaMergeSmemBytes = BM * (D + 8) * 4;
template <class T, int BM, int D, int NTH>
__device__ __noinline__ void moba_merge_tile(const FwdParams& p, float* sO, float* sL, int rows,
                                             int tid) {
  constexpr int LO = D + 4;
  const MobaLists& mb = p.moba;
  const int b = int(blockIdx.z), h = int(blockIdx.y), lq = p.seqlen_q;
  const int64_t rows_all = int64_t(gridDim.z) * gridDim.y * lq;
  const int64_t head_rows = (int64_t(b) * gridDim.y + h) * lq;
  float* const state_o = mb.state + head_rows * D;
  float* const state_lse = mb.state + rows_all * D + head_rows;
  // Round 0 (each row's own block) starts the rows' states.
  const bool fresh = mb.fwd_round == 0;
  int32_t* sRow = reinterpret_cast<int32_t*>(sL + BM);  // [BM] entries
  float* sWs = sL + 2 * BM;                              // [BM] weights of the state
  float* sWt = sL + 3 * BM;                              // [BM] weights of the tile
  for (int r = tid; r < rows; r += NTH) {
    const int32_t e = moba_merge_rows.entry[r];
    const int row = e & kMobaRowMask;
    const float lse_t = sL[r];
    const float lse_s = fresh ? -INFINITY : moba_merge_rows.lse[r];
    const float mx = max_keep_nan(lse_t, lse_s);
    float w_s = 0.0f, w_t = 0.0f, lse = -INFINITY;
    if (mx != -INFINITY) {
      const float e_s = expf(lse_s - mx), e_t = expf(lse_t - mx), sum = e_s + e_t;
      w_s = e_s / sum, w_t = e_t / sum;
      lse = mx + logf(sum);
    }
    sRow[r] = e, sWs[r] = w_s, sWt[r] = w_t;
    if (e >= 0)
      state_lse[row] = lse;
    else if (p.lse != nullptr)
      p.lse[b * p.lse_batch + h * p.lse_head + row] = lse;
  }
  __syncthreads();
  constexpr int C4 = D / 4;
  constexpr int kBatch = (BM * C4 + NTH - 1) / NTH < kMergeBatch ? (BM * C4 + NTH - 1) / NTH
                                                                 : kMergeBatch;
  T* const o = static_cast<T*>(p.o) + b * p.o_batch + h * p.o_head;
  for (int c0 = tid; c0 < rows * C4; c0 += NTH * kBatch) {
    float4 old[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int c = c0 + u * NTH, r = c / C4, ch = c - r * C4;
      old[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (c < rows * C4 && sWs[r] > 0.0f)
        old[u] = reinterpret_cast<const float4*>(state_o + int64_t(sRow[r] & kMobaRowMask) * D)[ch];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int c = c0 + u * NTH, r = c / C4, ch = c - r * C4;
      if (c >= rows * C4) break;
      const float w_s = sWs[r], w_t = sWt[r];
      const float4 t = *reinterpret_cast<const float4*>(sO + r * LO + ch * 4);
      float4 x;
      x.x = old[u].x * w_s + t.x * w_t;
      x.y = old[u].y * w_s + t.y * w_t;
      x.z = old[u].z * w_s + t.z * w_t;
      x.w = old[u].w * w_s + t.w * w_t;
      const int32_t e = sRow[r];
      if (e >= 0) {
        reinterpret_cast<float4*>(state_o + int64_t(e) * D)[ch] = x;
      } else {
        const uint2 packed = make_uint2(pack2<T>(x.x, x.y), pack2<T>(x.z, x.w));
        *reinterpret_cast<uint2*>(o + int64_t(e & kMobaRowMask) * p.o_seq + ch * 4) = packed;
      }
    }
  }
}

// The kernels' body. Gather (with Moba): MoBA's gathered rows, one round
// per launch (flash_fwd_moba_gather_kernel), the tile moba_gather_tile.
// Persist (with Sparse): the work item `item` (sequence, query head, query
// tile) of flash_fwd_bsparse_persistent_kernel instead of the block's.
template <class T, int D, bool Sparse, bool Moba, bool Gather, bool Persist = false>
__device__ __forceinline__ void flash_fwd_tile(const FwdParams& p, const int32_t* item = nullptr) {
  using Tr = FwdTraits<D>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, ST = Tr::kStages, NTH = Tr::kThreads;
  constexpr int R = Tr::kRows, MT = R / 16, NT = BN / 8, DT = D / 8, LD = Tr::kLd;
  constexpr uint32_t kKvStageBytes = uint32_t(BN * LD * 2);

  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);  // [BM][LD], reused for the O tile at the end
  const uint32_t sQa = smem_u32(sQ);
  const uint32_t sKa = sQa + uint32_t(BM * LD * 2);    // [ST][BN][LD]
  const uint32_t sVa = sKa + uint32_t(ST) * kKvStageBytes;  // [ST][BN][LD]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  int b = blockIdx.z, h = blockIdx.y;
  // Last query tiles first: under a causal mask they are the longest.
  int m_block = Gather ? 0 : int(gridDim.x) - 1 - int(blockIdx.x);
  if constexpr (Persist) b = item[0], h = item[1], m_block = item[2];

  QueryTile qt;
  if (!query_tile_of<BM>(p, b, m_block, qt)) return;
  // MoBA gather: the tile's rows (moba_rows(), recomputed where used:
  // registers are scarce), numbered (qt.r0) for the mask as the tile says.
  auto moba_rows = [&] {
    const MobaLists& mb = p.moba;
    const int64_t slot = int64_t(blockIdx.z) * mb.sel_heads +
                         (mb.per_query_head ? int(blockIdx.y) : int(blockIdx.y) / p.group);
    return mb.kv_tiles + slot * int64_t(mb.kv_cap) + gather_field(moba_gather_tile.start);
  };
  if constexpr (Gather) {
    qt.r0 = gather_field(moba_gather_tile.r0);
    qt.rows = gather_field(moba_gather_tile.rows);
    qt.lo_first = 0, qt.hi_first = key_hi(p, qt, qt.r0);
    qt.lo_last = 0, qt.hi_last = key_hi(p, qt, qt.r0 + qt.rows - 1);
  }
  const int lk = qt.lk, r0 = qt.r0, rows = qt.rows;
  const bool varlen = p.cu_q != nullptr;
  const int64_t q_tok = qt.q_tok, kv_tok = qt.kv_tok;
  const int hk = h / p.group;

  const T* gQ = static_cast<const T*>(p.q) + (varlen ? q_tok * p.q_seq : b * p.q_batch) +
                h * p.q_head + r0 * p.q_seq;
  const T* gK = static_cast<const T*>(p.k) + (varlen ? kv_tok * p.k_seq : b * p.k_batch) +
                hk * p.k_head;
  const T* gV = static_cast<const T*>(p.v) + (varlen ? kv_tok * p.v_seq : b * p.v_batch) +
                hk * p.v_head;
  T* gO = static_cast<T*>(p.o) + (varlen ? q_tok * p.o_seq : b * p.o_batch) + h * p.o_head +
          r0 * p.o_seq;
  float* gL = p.lse == nullptr
                  ? nullptr
                  : p.lse + (varlen ? q_tok : b * p.lse_batch) + h * p.lse_head + r0;

  // Persist: Q's load starts before the list is read (its address does not
  // depend on it); it joins K_0's commit group as below.
  if constexpr (Persist) load_tile<BM, D, NTH>(sQa, gQ, p.q_seq, rows, tid);

  auto key_lo = [&](int i) { return flash::key_lo(p, qt, i); };
  auto key_hi = [&](int i) { return flash::key_hi(p, qt, i); };
  const int lo_first = qt.lo_first, hi_last = qt.hi_last;
  const int lo_last = qt.lo_last, hi_first = qt.hi_first;

  // Sparse: the tile's visits (KV tile, kind), in increasing KV tile order.
  const int32_t* visits = nullptr;
  int n_tiles, n_end = 0;
  // MoBA: the tile's blocks (increasing), each block_size / BN KV tiles;
  // visit v (counted from the first) is tile v % tpb of block v / tpb. The
  // last block (the own block of the tile's last row) ends at the diagonal.
  const int32_t* moba_blocks = nullptr;
  auto moba_tpb = [&] { return p.moba.block / BN; };  // reread, not kept in a register
  // The selecting slot of this (sequence, head), likewise recomputed.
  auto moba_slot = [&] {
    return int64_t(blockIdx.z) * p.moba.sel_heads +
           (p.moba.per_query_head ? int(blockIdx.y) : int(blockIdx.y) / p.group);
  };
  if constexpr (Moba) {
    const MobaLists& mb = p.moba;
    n_tiles = 0;
    if constexpr (Gather) {
      // The block's KV tiles up to the tile's last diagonal.
      const int kb = gather_field(moba_gather_tile.kb);
      n_tiles = min(hi_last, (kb + 1) * mb.block - 1) / BN - kb * moba_tpb() + 1;
    } else {
      const int64_t list = moba_slot() * mb.q_tiles + m_block;
      const int count = mb.q_count[list];
      moba_blocks = mb.q_blocks + list * mb.q_cap;
      if (count > 0)
        n_tiles = (count - 1) * moba_tpb() + hi_last / BN -
                  (moba_blocks[count - 1] & kMobaIndexMask) * moba_tpb() + 1;
    }
  } else if constexpr (Sparse) {
    const TileLists& sp = p.sparse;
    const int list = mask_slot(sp, b, hk) *
                         sp.tiles + m_block;
    const int v0 = sp.offsets[list];
    n_tiles = sp.offsets[list + 1] - v0;
    visits = sp.visits + 2 * int64_t(v0);
  } else {
    n_tiles = hi_last < lo_first ? 0 : hi_last / BN + 1 - lo_first / BN;
    n_end = hi_last / BN + 1;
  }
  // KV tile of iteration it (last first).
  auto tile_of = [&](int it) {
    if constexpr (Moba) {
      const int v = n_tiles - 1 - it, tpb = moba_tpb();
      if constexpr (Gather) return gather_field(moba_gather_tile.kb) * tpb + v;
      return (moba_blocks[v / tpb] & kMobaIndexMask) * tpb + v % tpb;
    } else {
      return Sparse ? visits[2 * (n_tiles - 1 - it)] : n_end - 1 - it;
    }
  };

  if constexpr (Gather) {
    if (n_tiles <= 0) return;  // (every listed row sees a key of the block)
  }
  if (n_tiles == 0) {  // no row of the tile sees a key
    for (int c = tid; c < BM * DT; c += NTH) {
      const int r = c / DT, ch = c % DT;
      if (r < rows) *reinterpret_cast<uint4*>(gO + r * p.o_seq + ch * 8) = make_uint4(0, 0, 0, 0);
    }
    if (gL != nullptr)
      for (int r = tid; r < rows; r += NTH) gL[r] = -INFINITY;
    if constexpr (Persist) {  // Q's load lands before the next item's
      cp_async_commit();
      cp_async_wait<0>();
    }
    return;
  }

  // Pipeline: commit groups alternate K_0, V_0, K_1, V_1, ... (Q joins K_0).
  // At the top of iteration i, K_i is needed and V_{i+ST-1} is issued into
  // the V buffer freed by iteration i-1; in the middle, V_i is needed and
  // K_{i+ST} is issued into the K buffer that S_i no longer reads. Either
  // wait leaves 2 * ST - 2 younger groups in flight.
  auto load_k = [&](int it) {
    if (it < n_tiles) {
      const int n = tile_of(it);
      const int64_t stride = opaque(p.k_seq);
      load_tile<BN, D, NTH>(sKa + uint32_t(it % ST) * kKvStageBytes, gK + n * BN * stride, stride,
                            lk - n * BN, tid);
    }
    cp_async_commit();
  };
  auto load_v = [&](int it) {
    if (it < n_tiles) {
      const int n = tile_of(it);
      const int64_t stride = opaque(p.v_seq);
      load_tile<BN, D, NTH>(sVa + uint32_t(it % ST) * kKvStageBytes, gV + n * BN * stride, stride,
                            lk - n * BN, tid);
    }
    cp_async_commit();
  };
  if constexpr (Gather) {
    moba_merge_prefetch<BM, D, NTH>(p, gather_field(moba_gather_tile.start), rows, tid);
    load_rows<BM, D, NTH>(sQa, static_cast<const T*>(p.q) + b * p.q_batch + h * p.q_head, p.q_seq,
                          moba_rows(), rows, tid);
  }
  else if constexpr (!Persist)
    load_tile<BM, D, NTH>(sQa, gQ, p.q_seq, rows, tid);
  load_k(0);
#pragma unroll
  for (int s = 1; s < ST; ++s) {
    load_v(s - 1);
    load_k(s);
  }

  // Per-lane ldmatrix addresses (bytes). A operand (Q) and transposed B (V):
  // lanes 0-15 rows 0-15 at column 0, lanes 16-31 rows 0-15 at column 8.
  // Plain B (K, rows are keys): matrices (keys 0-7, d 0-7), (0-7, 8-15),
  // (8-15, 0-7), (8-15, 8-15) = b0, b1 of key group 0, then of key group 1.
  const uint32_t q_lane = sQa + uint32_t(((warp * R + (lane & 15)) * LD + (lane >> 4) * 8) * 2);
  const uint32_t k_lane = uint32_t((((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8) * 2);
  const uint32_t v_lane = uint32_t(((lane & 15) * LD + (lane >> 4) * 8) * 2);

  float acc_o[MT][DT][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.0f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }
  const float scale_log2 = p.scale_log2;

#pragma unroll 1
  for (int it = 0; it < n_tiles; ++it) {
    const int n = tile_of(it);
    const uint32_t stage_off = uint32_t(it % ST) * kKvStageBytes;
    cp_async_wait<2 * ST - 2>();
    __syncthreads();
    load_v(it + ST - 1);

    // S = Q K^T for this warp's R rows: [MT][NT] accumulators of 16x8.
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
    const uint32_t k_base = sKa + stage_off + k_lane;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], q_lane + uint32_t((mt * 16 * LD + kk * 16) * 2));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bk[4];
        ldsm_x4(bk, k_base + uint32_t((np * 16 * LD + kk * 16) * 2));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(s[mt][2 * np], a[mt], bk[0], bk[1]);
          mma_16816<T>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    if (p.softcap > 0.0f) {
      // cap * tanh(y) (softcap_logit).
      const float cap = p.softcap, cin = p.softcap_in;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float q;
            s[mt][nt][e] = softcap_logit(s[mt][nt][e] * cin, cap, q);
          }
    }

    const int c0 = n * BN;
    bool full;
    int kind = kVisitDense;
    if constexpr (Moba) {
      // Every row of the tile selected the block, and the causal mask
      // shows the whole KV tile to every row.
      const bool all_rows =
          Gather || (moba_blocks[(n_tiles - 1 - it) / moba_tpb()] & kMobaAllRows) != 0;
      full = all_rows && c0 + BN <= lk && c0 + BN - 1 <= hi_first;
    } else if constexpr (Sparse) {
      kind = visits[2 * (n_tiles - 1 - it) + 1];
      full = kind == kVisitFull;
    } else {
      full = c0 + BN <= lk && c0 >= lo_last && c0 + BN - 1 <= hi_first;
    }
    if constexpr (Moba) {
      if (!full) {
        // Row i sees the tile's keys up to its diagonal if it selected the
        // tile's block (bit i of the block's column), else none.
        // Gathered rows all selected it (row: the mask's numbering).
        const MobaLists& mb = p.moba;
        constexpr bool gathered = Gather;
        const uint64_t* sel = mb.selected + (moba_slot() * mb.num_blocks + n / moba_tpb()) *
                                                int64_t((p.seqlen_q + 63) / 64);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int row = r0 + warp * R + mt * 16 + hh * 8 + g;
            const bool on = gathered || (row < qt.lq && ((sel[row >> 6] >> (row & 63)) & 1u));
            const int hi = on ? key_hi(row) : -1;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e)
                if (c0 + nt * 8 + t4 * 2 + e > hi) s[mt][nt][hh * 2 + e] = -INFINITY;
          }
      }
    } else if (Sparse && kind >= 0) {
      // The bit tile: row r of the tile, key c at word c / 64, bit c % 64.
      constexpr int WPR = (BN + 63) / 64;
      const uint64_t* tb = p.sparse.bits + int64_t(kind) * (BM * WPR);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = warp * R + mt * 16 + hh * 8 + g;
          uint64_t w[WPR];
#pragma unroll
          for (int x = 0; x < WPR; ++x) w[x] = tb[row * WPR + x];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = nt * 8 + t4 * 2 + e;
              if (!((w[col >> 6] >> (col & 63)) & 1u)) s[mt][nt][hh * 2 + e] = -INFINITY;
            }
        }
    } else if (!full) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = r0 + warp * R + mt * 16 + hh * 8 + g;
          const int lo = key_lo(row), hi = key_hi(row);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = c0 + nt * 8 + t4 * 2 + e;
              if (col < lo || col > hi) s[mt][nt][hh * 2 + e] = -INFINITY;
            }
        }
    }

    // Online softmax; each row lives in the 4 lanes of a quad.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = row_max[mt][hh];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mx = fmaxf(mx, fmaxf(s[mt][nt][hh * 2], s[mt][nt][hh * 2 + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // An all-masked row so far keeps mx = -inf: subtract 0 so that
        // exp2(-inf - 0) = 0 instead of NaN.
        const float m_scaled = mx == -INFINITY ? 0.0f : mx * scale_log2;
        const float alpha = fast_exp2(row_max[mt][hh] * scale_log2 - m_scaled);
        row_max[mt][hh] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = fast_exp2(fmaf(s[mt][nt][hh * 2 + e], scale_log2, -m_scaled));
            s[mt][nt][hh * 2 + e] = pe;
            sum += pe;
          }
        row_sum[mt][hh] = row_sum[mt][hh] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          acc_o[mt][dt][hh * 2] *= alpha;
          acc_o[mt][dt][hh * 2 + 1] *= alpha;
        }
      }

    // P in T: the S accumulators of key groups 2kk, 2kk+1 are exactly the
    // A fragment of keys [16kk, 16kk+16).
    uint32_t pa[MT][BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[mt][kk][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][kk][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][kk][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][kk][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }

    cp_async_wait<2 * ST - 2>();
    __syncthreads();
    load_k(it + ST);

    // O += P V
    const uint32_t v_base = sVa + stage_off + v_lane;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bv[4];
        ldsm_x4_trans(bv, v_base + uint32_t((kk * 16 * LD + dp * 16) * 2));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(acc_o[mt][2 * dp], pa[mt][kk], bv[0], bv[1]);
          mma_16816<T>(acc_o[mt][2 * dp + 1], pa[mt][kk], bv[2], bv[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  if constexpr (Gather) {
    // Merge (O_tile, LSE_tile) of each listed row into its state: the
    // row's own block (the first launch that lists it) writes the state,
    // later launches (earlier blocks) combine with it, the row's last one
    // into its O and LSE. The tile goes through shared memory (fp32
    // [BM][D + 4], then LSE [BM] and the merge's per-row words, [3][BM];
    // the Q and K/V buffers are free once every warp is past the loop),
    // so that the state rows are read and written in whole 16-byte
    // chunks, and the accumulators are dead before the merge needs
    // registers.
    constexpr int LO = D + 4;
    static_assert(kMobaMergeSmemBytes<BM, D> <= (BM + 2 * ST * BN) * LD * 2,
                  "the fp32 tile and the merge's rows fit");
    float* sO = reinterpret_cast<float*>(smem);
    float* sL = sO + BM * LO;
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float l = quad_sum(row_sum[mt][hh]);
        const float inv = l != 0.0f ? 1.0f / l : 0.0f;  // (NaN l: NaN)
        const int row = warp * R + mt * 16 + hh * 8 + g;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
          *reinterpret_cast<float2*>(sO + row * LO + dt * 8 + 2 * t4) =
              make_float2(o_scaled(acc_o[mt][dt][hh * 2], inv),
                          o_scaled(acc_o[mt][dt][hh * 2 + 1], inv));
        if (t4 == 0)
          sL[row] = row_lse(row_max[mt][hh], l, scale_log2);
      }
    __syncthreads();
    moba_merge_tile<T, BM, D, NTH>(p, sO, sL, rows, tid);
    return;
  }

  // Epilogue: O = acc / l and LSE = m * scale_log2 * ln2 + ln l. The warp
  // stages its rows in its own part of the Q tile (no other warp reads it),
  // then writes them with 16-byte stores.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float l = quad_sum(row_sum[mt][hh]);
      const float inv = l != 0.0f ? 1.0f / l : 0.0f;  // (NaN l: NaN)
      const int row = warp * R + mt * 16 + hh * 8 + g;
      uint32_t* dst = reinterpret_cast<uint32_t*>(sQ + row * LD) + t4;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        dst[dt * 4] = pack2<T>(o_scaled(acc_o[mt][dt][hh * 2], inv),
                               o_scaled(acc_o[mt][dt][hh * 2 + 1], inv));
      if (gL != nullptr && t4 == 0 && row < rows)
        gL[row] = row_lse(row_max[mt][hh], l, scale_log2);
    }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < R * DT / 32; ++i) {
    const int c = lane + i * 32;
    const int r = warp * R + c / DT, ch = c % DT;
    if (r < rows)
      *reinterpret_cast<uint4*>(gO + r * p.o_seq + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + r * LD + ch * 8);
  }
}

template <class T, int D, bool Sparse = false, bool Moba = false>
__global__ void __launch_bounds__(FwdTraits<D>::kThreads, FwdTraits<D>::kMinBlocks)
    flash_fwd_kernel(const __grid_constant__ FwdParams p) {
  flash_fwd_tile<T, D, Sparse, Moba, false>(p);
}

// Into L2: the Q tile and the first KV tile (the list's last) of a
// block-sparse forward work item, so that its start, an item later, reads
// them from L2 rather than from memory.
template <class T, int D>
__device__ __forceinline__ void prefetch_bsparse_item(const FwdParams& p, const int32_t* item) {
  using Tr = FwdTraits<D>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, NTH = Tr::kThreads;
  const int b = item[0], h = item[1], m_block = item[2];
  QueryTile qt;
  if (!query_tile_of<BM>(p, b, m_block, qt)) return;
  const bool varlen = p.cu_q != nullptr;
  const int tid = threadIdx.x, hk = h / p.group;
  const T* gQ = static_cast<const T*>(p.q) + (varlen ? qt.q_tok * p.q_seq : b * p.q_batch) +
                h * p.q_head + qt.r0 * p.q_seq;
  prefetch_rows_l2<T, D>(gQ, p.q_seq, qt.rows, tid, NTH);
  const TileLists& sp = p.sparse;
  const int list = mask_slot(sp, b, hk) *
                       sp.tiles + m_block;
  const int v_end = sp.offsets[list + 1];
  if (v_end == sp.offsets[list]) return;
  const int n = sp.visits[2 * (v_end - 1)];
  const int rows = min(BN, qt.lk - n * BN);
  const T* gK = static_cast<const T*>(p.k) + (varlen ? qt.kv_tok * p.k_seq : b * p.k_batch) +
                hk * p.k_head + int64_t(n) * BN * p.k_seq;
  const T* gV = static_cast<const T*>(p.v) + (varlen ? qt.kv_tok * p.v_seq : b * p.v_batch) +
                hk * p.v_head + int64_t(n) * BN * p.v_seq;
  prefetch_rows_l2<T, D>(gK, p.k_seq, rows, tid, NTH);
  prefetch_rows_l2<T, D>(gV, p.v_seq, rows, tid, NTH);
}

// Block-sparse forward, persistent: grid (blocks that fit on the device at
// once, 1, 1); block x computes its work items (p.sparse.items [item_offsets[x],
// item_offsets[x + 1]): sequence, query head, query tile, list length; dealt
// at plan creation, src/cuda/block_sparse.hpp) one after the other, and
// prefetches each next item's Q and first K, V tiles into L2 while it
// computes the current one. No block launch per query tile.
template <class T, int D>
__global__ void __launch_bounds__(FwdTraits<D>::kThreads, FwdTraits<D>::kMinBlocks)
    flash_fwd_bsparse_persistent_kernel(const __grid_constant__ FwdParams p) {
  const int end = p.sparse.item_offsets[blockIdx.x + 1];
  for (int w = p.sparse.item_offsets[blockIdx.x]; w < end; ++w) {
    if (w + 1 < end) prefetch_bsparse_item<T, D>(p, p.sparse.items + kItemWords * (w + 1));
    flash_fwd_tile<T, D, true, false, false, true>(p, p.sparse.items + kItemWords * w);
    __syncthreads();  // the next item reuses shared memory
  }
}

// MoBA's gathered forward for round p.moba.fwd_round: grid (x, heads_q,
// batch), block x taking tiles x, x + gridDim.x, ... of its (sequence,
// head)'s round lists, whose number only the device knows (the host sizes
// the grid to the most there can be). Lists start at whole tiles: tile m
// is the BM rows from entry first + m BM of the list that holds it (the
// last list starting at or before it: the one list kb with start(kb) <= at
// < start(kb + 1), which the threads look for side by side, one round of
// loads instead of a bisection's log2(num_blocks) dependent ones).
// for_each_moba_gather_tile sets moba_gather_tile and runs body() per tile.
template <int BM, class Body>
__device__ __forceinline__ void for_each_moba_gather_tile(const FwdParams& p, Body&& body) {
  const MobaLists& mb = p.moba;
  const int h = int(blockIdx.y), nb = mb.num_blocks;
  const int64_t slots = int64_t(gridDim.z) * mb.sel_heads;
  const int64_t slot =
      int64_t(blockIdx.z) * mb.sel_heads + (mb.per_query_head ? h : h / p.group);
  // [num_blocks + 1] pairs (start, rows)
  const int32_t* e = mb.kv_count + 2 * (int64_t(mb.fwd_round) * slots + slot) * (nb + 1);
  const int first = e[0], tiles = (e[2 * nb] - first) / BM;
  const int off = p.seqlen_kv - p.seqlen_q;
  for (int m = int(blockIdx.x); m < tiles; m += int(gridDim.x)) {
    const int at = first + m * BM;
    for (int lo = int(threadIdx.x); lo < nb; lo += int(blockDim.x)) {
      if (!(e[2 * lo] <= at && at < e[2 * lo + 2])) continue;
      MobaGatherTile& gt = moba_gather_tile;
      gt.kb = lo;
      gt.start = at;
      gt.rows = min(BM, e[2 * lo] + e[2 * lo + 1] - at);
      // Round 0: the block's own rows; later rounds: rows after them.
      const int own = mb.fwd_round == 0 ? lo : lo + 1;
      gt.r0 = max(0, own * mb.block - off) + (at - e[2 * lo]);
    }
    __syncthreads();
    body();
    __syncthreads();  // the next tile reuses shared memory and the tile's fields
  }
}

template <class T, int D>
__global__ void __launch_bounds__(FwdTraits<D>::kThreads, FwdTraits<D>::kMinBlocks)
    flash_fwd_moba_gather_kernel(const __grid_constant__ FwdParams p) {
  for_each_moba_gather_tile<FwdTraits<D>::kBlockM>(
      p, [&] { flash_fwd_tile<T, D, false, true, true>(p); });
}

}  // namespace attn::flash
