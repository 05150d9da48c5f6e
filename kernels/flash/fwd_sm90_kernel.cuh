// FlashAttention forward on sm_90a warpgroup MMA (wgmma). One thread block
// computes one query tile of one head with `warpgroups` warpgroups of 64
// query rows each (flash::fwd_sm90_config):
//
//   Q tile  [BM][D]    cp.async -> shared (swizzled panels, flash/sm90.cuh)
//   K, V    [BN][D]    streamed through `stages` shared buffers each
//   S = Q K^T          wgmma m64nBNk16, A (Q) and B (K) K-major from shared;
//                      [64][BN] fp32 per warpgroup in registers
//   P = exp2(S - m)    rounded to T in registers, the A operand of P V
//   O += P V           wgmma m64nDk16, B (V) MN-major from shared
//
// The dense forward of flash/fwd_kernel.cuh otherwise: the same KV tile
// interval and element mask (flash/sequence.cuh), tiles visited from the
// last to the first, the same online softmax and the same (O, LSE) for rows
// that see no key. Every thread loads (cp.async, `stages` - 1 KV tiles
// ahead), fences the async proxy and meets the others at one barrier per
// KV tile before the tensor cores read it. Each warpgroup issues the next
// S GEMM together with the current P V GEMM and runs the softmax while the
// latter is in flight.
// Cap (softcap plans): S becomes cap * tanh(S scale / cap) before the mask,
// as in flash/fwd_kernel.cuh; without it the code is that of the kernel
// before softcap existed.
//
// Block-sparse plans (Sparse) take the KV tiles from the tile lists
// (p.sparse, query-major, built for this kernel's BM x BN tiles), as the
// sm_80 kernel's Sparse instantiation does: each visit full (no predicate),
// dense-masked, or masked by its bit tile; the pipeline is the same. The
// lists' work items (one per query tile, longest list first) give block x
// its query tile, so that the longest tiles start first and the short ones
// fill the tail. The tile's visits are copied into a ring in shared memory
// (kSm90VisitRing entries, refilled half a ring at a time), so that the
// loads ahead and the masks read them there: a global read of the list
// at each iteration would stall the warps right before they issue the
// GEMMs.
//
// MoBA plans (Moba, the tile-union schedule of moba/moba_params.cuh) take
// the blocks some row of the tile selected (p.moba's q list, written by the
// selector into the workspace at run time; built for 128-row tiles, this
// kernel's BM for MoBA) and visit every KV tile of each, the last block up
// to the tile's diagonal, as the sm_80 kernel's Moba instantiation does.
// The list is copied into the visit ring's shared memory (its first
// kSm90MobaListSmem entries; the rare longer lists read the rest from
// global memory), so that the loads ahead and the masks do not wait on a
// global read. A tile that some row did not select, or that the diagonal
// cuts, gets the predicate: row i sees key j when it selected j's block
// (one bit per row) and j <= its diagonal.
//
// MoBA's gathered forward (Moba and Gather, flash_fwd_sm90_moba_gather_kernel)
// is that of the sm_80 kernel (flash/fwd_kernel.cuh): one round per launch,
// a tile of 128 rows of one round list (Q rows loaded by index), the KV
// tiles of its block up to the diagonal (round 0's own rows, the only ones
// the causal mask cuts), and the tile's (O, LSE) merged into the rows'
// softmax states (moba_merge_tile) instead of written out, but for the rows
// whose last round it is.
//
// Built only for sm_90a (ATTN_SM90_WGMMA); other targets get an empty
// kernel, which the host never launches (it checks the image's PTX version).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "flash/fwd_kernel.cuh"
#include "flash/fwd_params.cuh"
#include "flash/sequence.cuh"
#include "flash/sm80.cuh"
#include "flash/sm90.cuh"

namespace attn::flash {

// BM: the query tile's rows (fwd_sm90_config(D, BM)).
template <int D, int BM = fwd_sm90_config(D).block_m>
struct FwdSm90Traits {
  static constexpr FwdSm90Config kCfg = fwd_sm90_config(D, BM);
  static constexpr int kBlockM = kCfg.block_m;
  static constexpr int kBlockN = kCfg.block_n;
  static constexpr int kStages = kCfg.stages;
  static constexpr int kThreads = kCfg.threads();
  static_assert(kBlockM == BM && kBlockM == 64 * kCfg.warpgroups, "64 rows per warpgroup");
  static_assert((D == 64 || D == 128) && kBlockN == 128, "the wgmma shapes instantiated");
};

// Sparse: every pair of row `row` (of the tile) and the KV tile's column
// jj * 8 + 2 * t4 + e whose bit is clear in the bit tile tb ([BM][2] 64-bit
// words, BN = 128) becomes -inf in s (this thread's accumulator layout).
template <int NS>
__device__ __forceinline__ void mask_by_bits(float (&s)[NS], const uint64_t* tb, int row0,
                                             int t4) {
  static_assert(NS == 64, "BN = 128: two words per row");
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const uint64_t* w = tb + 2 * (row0 + hh * 8);
    // Shifted so that column jj * 8 + e of a word is bit (jj % 8) * 8 + e.
    const uint64_t w0 = w[0] >> (2 * t4), w1 = w[1] >> (2 * t4);
#pragma unroll
    for (int jj = 0; jj < 16; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint64_t word = jj < 8 ? w0 : w1;
        if (!((word >> ((jj & 7) * 8 + e)) & 1u)) s[jj * 4 + hh * 2 + e] = -INFINITY;
      }
  }
}

// MoBA: the entries of a tile's block list kept in shared memory (the visit
// ring's words).
constexpr int kSm90MobaListSmem = 2 * kSm90VisitRing;

// The per-tile steps both sm_90a forwards share (this one and the
// warp-specialised one, flash/fwd_sm90_ws_kernel.cuh), on a thread's share
// of a warpgroup's [64][BN] S accumulators (two rows, hh = 0 and 1).

// Scores of row half hh outside the keys [lo, hi] become -inf (the tile's
// first key c0).
template <int NS>
__device__ __forceinline__ void mask_key_range(float (&s)[NS], int hh, int c0, int t4, int lo,
                                               int hi) {
#pragma unroll
  for (int jj = 0; jj < NS / 4; ++jj)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = c0 + jj * 8 + t4 * 2 + e;
      if (col < lo || col > hi) s[jj * 4 + hh * 2 + e] = -INFINITY;
    }
}

// Online softmax of S in place (P in fp32); alpha: the factor that takes O
// to S's row maxima. Each row lives in the 4 lanes of a quad.
template <int NS>
__device__ __forceinline__ void online_softmax_rows(float (&s)[NS], float (&row_max)[2],
                                                    float (&row_sum)[2], float scale_log2,
                                                    float (&alpha)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float mx = row_max[hh];
#pragma unroll
    for (int jj = 0; jj < NS / 4; ++jj)
      mx = fmaxf(mx, fmaxf(s[jj * 4 + hh * 2], s[jj * 4 + hh * 2 + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // A row masked so far keeps mx = -inf: subtract 0 so that
    // exp2(-inf - 0) = 0 instead of NaN.
    const float m_scaled = mx == -INFINITY ? 0.0f : mx * scale_log2;
    alpha[hh] = fast_exp2(row_max[hh] * scale_log2 - m_scaled);
    row_max[hh] = mx;
    float sum = 0.0f;
#pragma unroll
    for (int jj = 0; jj < NS / 4; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = fast_exp2(fmaf(s[jj * 4 + hh * 2 + e], scale_log2, -m_scaled));
        s[jj * 4 + hh * 2 + e] = pe;
        sum += pe;
      }
    row_sum[hh] = row_sum[hh] * alpha[hh] + sum;
  }
}

// P in T: accumulator columns [16 kk, 16 kk + 16) are the A fragment of
// k-step kk of O += P V.
template <class T, int NS>
__device__ __forceinline__ void pack_p_fragments(const float (&s)[NS], uint32_t (&pa)[NS / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < NS / 8; ++kk) {
    pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// Epilogue: O = acc / l into the rows row0 and row0 + 8 of a BM-row tile in
// the swizzled layout at sQ (the quad's stores of a column group hit 8
// distinct chunks), LSE = m * scale_log2 * ln2 + ln l to gL (if not null)
// for rows below `rows`.
template <class T, int D, int BM>
__device__ __forceinline__ void stage_o_rows(unsigned char* sQ, const float (&acc_o)[D / 2],
                                             const float (&row_max)[2], const float (&row_sum)[2],
                                             int row0, int t4, float* gL, int rows,
                                             float scale_log2) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float l = quad_sum(row_sum[hh]);
    const float inv = l != 0.0f ? 1.0f / l : 0.0f;  // (NaN l: NaN)
    const int row = row0 + hh * 8;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(sQ + sm90::swizzled_offset(BM, row, j * 8 + t4 * 2)) =
          pack2<T>(o_scaled(acc_o[j * 4 + hh * 2], inv), o_scaled(acc_o[j * 4 + hh * 2 + 1], inv));
    if (gL != nullptr && t4 == 0 && row < rows) gL[row] = row_lse(row_max[hh], l, scale_log2);
  }
}

// The staged rows [64 wg, 64 wg + 64) of warpgroup wg (its thread wtid)
// to O (rows below `rows`) with 16-byte stores.
template <int D, int BM, class T>
__device__ __forceinline__ void store_o_rows(T* gO, int64_t o_seq, const unsigned char* sQ, int wg,
                                             int wtid, int rows) {
  constexpr int DT = D / 8;
#pragma unroll
  for (int i = 0; i < 64 * DT / 128; ++i) {
    const int c = wtid + i * 128;
    const int r = wg * 64 + c / DT, ch = c % DT;
    if (r < rows)
      *reinterpret_cast<uint4*>(gO + r * o_seq + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + sm90::swizzled_offset(BM, r, ch * 8));
  }
}

template <class T, int D, int BM_, bool Cap, bool Sparse, bool Moba = false, bool Gather = false>
__device__ __forceinline__ void flash_fwd_sm90_tile(const FwdParams& p) {
  static_assert(!(Moba && (Sparse || Cap)), "MoBA: neither block masks nor softcap");
  static_assert(!Gather || Moba, "gathered rows: MoBA only");
  // The union schedule's list (Moba without Gather).
  constexpr bool kMobaList = Moba && !Gather;
  using Tr = FwdSm90Traits<D, BM_>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, ST = Tr::kStages, NTH = Tr::kThreads;
  constexpr int NS = BN / 2, NO = D / 2;  // accumulators per thread: S, O
  constexpr uint32_t kQBytes = uint32_t(BM * D * 2), kKvBytes = uint32_t(BN * D * 2);

  extern __shared__ __align__(16) unsigned char smem[];
  // Panels start on a 1024-byte boundary (the swizzle atom).
  const uint32_t raw = smem_u32(smem);
  const uint32_t sQa = (raw + 1023u) & ~1023u;        // [BM][D], then the O tile
  const uint32_t sKa = sQa + kQBytes;                 // [ST][BN][D]
  const uint32_t sVa = sKa + uint32_t(ST) * kKvBytes;  // [ST][BN][D]
  unsigned char* const sQ = smem + (sQa - raw);
  // Sparse: visit v of the tile (KV tile, kind) in entry v % kSm90VisitRing.
  int32_t* const sRing = reinterpret_cast<int32_t*>(sQ + kQBytes + 2u * uint32_t(ST) * kKvBytes);
  constexpr int kRing = kSm90VisitRing, kHalf = kRing / 2;
  static_assert(kHalf >= ST, "a refill lands a barrier before its first use");

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y;
  const int hk = h / p.group;
  // Dense: last query tiles first (under a causal mask they are the
  // longest). Sparse: work item x of the slot, (tile, first visit, end).
  int m_block, n_tiles = 0, n_end = 0;
  // Sparse: this block's work item (kSm90FwdItemWords words, item x of its
  // slot at slot * tiles + x: no offset to read first), recomputed where
  // needed (registers); the KV tiles of its first two iterations (its last
  // two visits), so that their loads need not wait for the visit ring.
  auto work_item = [&] {
    const TileLists& sp = p.sparse;
    const int b_ = int(blockIdx.z), hk_ = int(blockIdx.y) / p.group;
    return sp.items + kSm90FwdItemWords * (mask_slot(sp, b_, hk_) * sp.tiles + int(blockIdx.x));
  };
  [[maybe_unused]] int first_tiles[2] = {-1, -1};
  if constexpr (Sparse) {
    const int32_t* item = work_item();
    m_block = item[0];
    n_tiles = item[2] - item[1];
    first_tiles[0] = item[3];
    first_tiles[1] = item[4];
  } else {
    m_block = Gather ? 0 : int(gridDim.x) - 1 - int(blockIdx.x);
  }

  QueryTile qt;
  if (!query_tile_of<BM>(p, b, m_block, qt)) return;
  if constexpr (Gather) {  // numbered as flash_fwd_moba_gather_kernel says
    qt.r0 = gather_field(moba_gather_tile.r0);
    qt.rows = gather_field(moba_gather_tile.rows);
    qt.lo_first = 0, qt.hi_first = key_hi(p, qt, qt.r0);
    qt.lo_last = 0, qt.hi_last = key_hi(p, qt, qt.r0 + qt.rows - 1);
  }
  const int lk = qt.lk, r0 = qt.r0, rows = qt.rows;
  const bool varlen = p.cu_q != nullptr;
  const T* gQ = static_cast<const T*>(p.q) + (varlen ? qt.q_tok * p.q_seq : b * p.q_batch) +
                h * p.q_head + r0 * p.q_seq;
  const T* gK = static_cast<const T*>(p.k) + (varlen ? qt.kv_tok * p.k_seq : b * p.k_batch) +
                hk * p.k_head;
  const T* gV = static_cast<const T*>(p.v) + (varlen ? qt.kv_tok * p.v_seq : b * p.v_batch) +
                hk * p.v_head;
  T* gO = static_cast<T*>(p.o) + (varlen ? qt.q_tok * p.o_seq : b * p.o_batch) + h * p.o_head +
          r0 * p.o_seq;
  float* gL = p.lse == nullptr
                  ? nullptr
                  : p.lse + (varlen ? qt.q_tok : b * p.lse_batch) + h * p.lse_head + r0;

  // MoBA: the selecting slot of this (sequence, head), recomputed where
  // used (registers), and the tile's block list (increasing, entries with
  // kMobaAllRows when every row selected the block): `count` blocks of
  // tpb KV tiles each, the last one up to the tile's diagonal. Visit v
  // (counted from the first) is tile v % tpb of block v / tpb.
  auto moba_slot = [&] {
    return int64_t(blockIdx.z) * p.moba.sel_heads +
           (p.moba.per_query_head ? int(blockIdx.y) : int(blockIdx.y) / p.group);
  };
  // (MoBA plans are fixed-length: the tile is the dense grid's, m_block
  // recomputed from the block index, and the lengths are the parameters'.)
  auto moba_list = [&] {
    const int tile = int(gridDim.x) - 1 - int(blockIdx.x);
    return p.moba.q_blocks + (moba_slot() * p.moba.q_tiles + tile) * p.moba.q_cap;
  };
  auto moba_tpb = [&] { return p.moba.block / BN; };  // reread, not kept in a register
  // List entry i (shared memory for the first kSm90MobaListSmem).
  auto moba_entry = [&](int i) {
    return i < kSm90MobaListSmem ? sRing[i] : moba_list()[i];
  };
  int moba_count = 0;
  if constexpr (Gather) {
    // The block's KV tiles up to the tile's last diagonal.
    const int kb = gather_field(moba_gather_tile.kb);
    n_tiles = min(qt.hi_last, (kb + 1) * p.moba.block - 1) / BN - kb * moba_tpb() + 1;
  } else if constexpr (Moba) {
    moba_count = p.moba.q_count[moba_slot() * p.moba.q_tiles + m_block];
    if (moba_count > 0 && qt.hi_last >= 0)
      n_tiles = (moba_count - 1) * moba_tpb() + qt.hi_last / BN -
                (moba_list()[moba_count - 1] & kMobaIndexMask) * moba_tpb() + 1;
  } else if constexpr (!Sparse) {
    n_tiles = dense_kv_tiles<BN>(qt, n_end);
  }
  // Sparse: ring entry of iteration it's visit (the last visit first).
  auto ring_entry = [&](int it) { return 2 * ((n_tiles - 1 - it) & (kRing - 1)); };
  // KV tile of iteration it (the last first).
  auto tile_of = [&](int it) {
    if constexpr (Gather) {
      return gather_field(moba_gather_tile.kb) * moba_tpb() + n_tiles - 1 - it;
    } else if constexpr (Moba) {
      const int v = n_tiles - 1 - it, tpb = moba_tpb();
      return (moba_entry(v / tpb) & kMobaIndexMask) * tpb + v % tpb;
    } else {
      return Sparse ? sRing[ring_entry(it)] : n_end - 1 - it;
    }
  };
  // Sparse: copies visits [lo, hi) of the tile into the ring.
  auto fill_ring = [&](int lo, int hi) {
    const int32_t* src = p.sparse.visits + 2 * int64_t(work_item()[1]);
    for (int w = 2 * lo + tid; w < 2 * hi; w += NTH) sRing[w & (2 * kRing - 1)] = src[w];
  };
  if constexpr (Gather) {
    if (n_tiles <= 0) return;  // (every listed row sees a key of the block)
  }
  if (n_tiles == 0) {  // no row of the tile sees a key
    constexpr int DT = D / 8;
    for (int c = tid; c < BM * DT; c += NTH) {
      const int r = c / DT, ch = c % DT;
      if (r < rows) *reinterpret_cast<uint4*>(gO + r * p.o_seq + ch * 8) = make_uint4(0, 0, 0, 0);
    }
    if (gL != nullptr)
      for (int r = tid; r < rows; r += NTH) gL[r] = -INFINITY;
    return;
  }

  // Pipeline. Iteration j (0 <= j <= n_tiles) issues S_j = Q K_j and
  // O += P_{j-1} V_{j-1} together, then computes the softmax of S_j while
  // the tensor cores run the second GEMM; O is rescaled by S_j's alpha once
  // that GEMM is done. Loads run ST - 1 iterations ahead: commit group g_p
  // holds K_p and V_{p-1} (g_0 also Q); g_0 .. g_{ST-1} before the loop
  // (every buffer is free then: g_{ST-1} need not wait for iteration 0's
  // barrier, where only S_0's GEMM would hide its latency, once per query
  // tile, which short tile lists such as block-sparse and MoBA ones feel),
  // g_{j+ST-1} at iteration j >= 1, after the barrier, into the K buffer
  // S_{j-1} read and the V buffer O's GEMM of iteration j-1 read (each wgmma
  // has completed before its warpgroup reaches the next barrier). Iteration
  // j needs g_j: ST - 2 younger groups may stay in flight (ST - 1 at j = 0).
  // Group grp's copies: KV tile kn's K (-1: none) into buffer grp % ST,
  // tile vn's V into buffer (grp - 1) % ST.
  auto load_kv = [&](int grp, int kn, int vn) {
    if (kn >= 0)
      sm90::load_tile_swizzled<BN, D, NTH>(sKa + uint32_t(grp % ST) * kKvBytes,
                                           gK + int64_t(kn) * BN * p.k_seq, p.k_seq,
                                           lk - kn * BN, tid);
    if (vn >= 0)
      sm90::load_tile_swizzled<BN, D, NTH>(sVa + uint32_t((grp - 1) % ST) * kKvBytes,
                                           gV + int64_t(vn) * BN * p.v_seq, p.v_seq,
                                           lk - vn * BN, tid);
  };
  auto load_group = [&](int grp) {
    load_kv(grp, grp < n_tiles ? tile_of(grp) : -1,
            grp >= 1 && grp - 1 < n_tiles ? tile_of(grp - 1) : -1);
    cp_async_commit();
  };
  // Q first: its copies need no visit (Sparse: neither do the first two
  // groups' K and V, from the work item) and run while the ring fills.
  if constexpr (Gather) {
    moba_merge_prefetch<BM, D, NTH>(p, gather_field(moba_gather_tile.start), rows, tid);
    const MobaLists& mb = p.moba;
    const int64_t slot = int64_t(b) * mb.sel_heads + (mb.per_query_head ? h : h / p.group);
    sm90::load_rows_swizzled<BM, D, NTH>(
        sQa, static_cast<const T*>(p.q) + b * p.q_batch + h * p.q_head, p.q_seq,
        mb.kv_tiles + slot * int64_t(mb.kv_cap) + gather_field(moba_gather_tile.start), rows, tid);
  } else {
    sm90::load_tile_swizzled<BM, D, NTH>(sQa, gQ, p.q_seq, rows, tid);
  }
  if constexpr (Sparse) {
    // Groups 0 and 1 from the item's first tiles (n_tiles >= 1 here), then
    // the ring; the barrier of iteration 0 publishes it to the masks, and
    // with ST > 2 one here to the loads of the later groups.
    load_kv(0, first_tiles[0], -1);
    cp_async_commit();
    load_kv(1, n_tiles > 1 ? first_tiles[1] : -1, first_tiles[0]);
    cp_async_commit();
    fill_ring(max(0, n_tiles - kRing), n_tiles);
    if constexpr (ST > 2) __syncthreads();
#pragma unroll
    for (int grp = 2; grp < ST; ++grp) load_group(grp);
  } else {
    if constexpr (kMobaList) {
      const int32_t* src = moba_list();
      for (int i = tid; i < min(moba_count, kSm90MobaListSmem); i += NTH) sRing[i] = src[i];
      __syncthreads();
    }
#pragma unroll
    for (int grp = 0; grp < ST; ++grp) load_group(grp);
  }

  // This thread's two rows of the tile (accumulator rows g and g + 8 of
  // its warp's 16).
  const int row0 = wg * 64 + ((wtid >> 5) << 4) + g;
  const uint32_t q_rows = sQa + uint32_t(wg * 64 * 128);  // the warpgroup's rows, panel 0

  float acc_o[NO];
#pragma unroll
  for (int i = 0; i < NO; ++i) acc_o[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const float scale_log2 = p.scale_log2;
  uint32_t pa[BN / 16][4];  // P_{j-1} in T: the A fragments of O += P V
  float s[NS];

  // The top of iteration j: g_j has landed for every thread; the next group
  // goes out.
  // Sparse: at iterations j = k * kHalf (k >= 1) the visits of iterations
  // [j + kHalf, j + kRing) replace those of [j - kHalf, j), all done;
  // loads read ST - 1 iterations ahead, so the first of them is read after
  // the next barrier.
  auto tile_ready = [&](int j) {
    if (j == 0)
      cp_async_wait<ST - 1>();
    else
      cp_async_wait<ST - 2>();
    sm90::fence_proxy_async();
    __syncthreads();
    if constexpr (Sparse) {
      if (j >= kHalf && j % kHalf == 0 && n_tiles - j - kHalf > 0)
        fill_ring(max(0, n_tiles - j - kRing), n_tiles - j - kHalf);
    }
    if (j > 0) load_group(j + ST - 1);
  };
  // S = Q K_j^T: [64][BN] for this warpgroup (committed as one group).
  auto issue_s = [&](int j) {
    const uint32_t k_tile = sKa + uint32_t(j % ST) * kKvBytes;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      sm90::Wgmma<T, BN>::ss(s, sm90::desc_k_major(q_rows, BM, kk),
                             sm90::desc_k_major(k_tile, BN, kk), kk > 0);
    sm90::wgmma_commit();
  };
  // O += P_{j-1} V_{j-1} (one group).
  auto issue_pv = [&](int j) {
    const uint32_t v_tile = sVa + uint32_t((j - 1) % ST) * kKvBytes;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      sm90::Wgmma<T, D>::rs(acc_o, pa[kk], sm90::desc_mn_major(v_tile, BN, kk), true);
    sm90::wgmma_commit();
  };
  // Mask and online softmax of S_j in place (P_j in fp32); alpha: the
  // factor that takes O to S_j's row maxima. Each row lives in the 4 lanes
  // of a quad.
  auto softmax = [&](int j, float (&alpha)[2]) {
    if constexpr (Cap) {
      // cap * tanh(y) (softcap_logit; scale_log2 is then log2(e)).
      const float cap = p.softcap, cin = p.softcap_in;
#pragma unroll
      for (int i = 0; i < NS; ++i) {
        float q;
        s[i] = softcap_logit(s[i] * cin, cap, q);
      }
    }
    bool dense_mask;
    if constexpr (Gather) {  // the rows' diagonals, numbered from r0
      dense_mask = !dense_tile_full<BN>(qt, tile_of(j) * BN);
    } else if constexpr (Moba) {
      // Every row selected the block and the diagonal cuts no row's keys of
      // the tile: no predicate.
      const int v = n_tiles - 1 - j, tpb = moba_tpb();
      const int entry = moba_entry(v / tpb);
      const int c0 = ((entry & kMobaIndexMask) * tpb + v % tpb) * BN;
      const bool full =
          (entry & kMobaAllRows) != 0 && c0 + BN <= p.seqlen_kv && c0 + BN - 1 <= qt.hi_first;
      if (!full) {
        // Row i sees the tile's keys up to its diagonal if it selected the
        // tile's block (bit i of the block's column), else none. The
        // thread's rows (r0 a multiple of 128, row0 % 64 < 56) lie in one
        // word; bits of rows past the sequence are 0.
        const int row_a = int(opaque(r0 + row0));
        uint64_t word = 0;
        if (row_a < p.seqlen_q)
          word = p.moba.selected[(moba_slot() * p.moba.num_blocks + (entry & kMobaIndexMask)) *
                                     int64_t((p.seqlen_q + 63) / 64) +
                                 (row_a >> 6)] >>
                 (row_a & 63);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = row_a + hh * 8;
          const bool on = (word >> (hh * 8)) & 1u;
          const int hi = on ? key_hi(p, qt, row) : -1;
#pragma unroll
          for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (c0 + jj * 8 + t4 * 2 + e > hi) s[jj * 4 + hh * 2 + e] = -INFINITY;
        }
      }
      dense_mask = false;
    } else if constexpr (Sparse) {
      const int kind = sRing[ring_entry(j) + 1];
      if (kind >= 0) mask_by_bits(s, p.sparse.bits + int64_t(kind) * (2 * BM), row0, t4);
      dense_mask = kind == kVisitDense;
    } else {
      dense_mask = !dense_tile_full<BN>(qt, (n_end - 1 - j) * BN);
    }
    if (dense_mask) {
      const int c0 = tile_of(j) * BN;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        // Sparse: recomputed at each use; hoisted out of the KV loop, the
        // four bounds were spilled (d = 64).
        const int row = Sparse ? int(opaque(r0 + row0 + hh * 8)) : r0 + row0 + hh * 8;
        mask_key_range(s, hh, c0, t4, key_lo(p, qt, row), key_hi(p, qt, row));
      }
    }
    online_softmax_rows(s, row_max, row_sum, scale_log2, alpha);
  };
  // P_j in T replaces P_{j-1}.
  auto pack_p = [&] { pack_p_fragments<T>(s, pa); };

  // j = 0: S_0 alone (O is still 0).
  float alpha[2];
  tile_ready(0);
  sm90::wgmma_fence();
  issue_s(0);
  sm90::wgmma_wait<0>();
  sm90::reg_fence(s);
  softmax(0, alpha);
  pack_p();
#pragma unroll 1
  for (int j = 1; j < n_tiles; ++j) {
    tile_ready(j);
    sm90::wgmma_fence();
    issue_s(j);
    issue_pv(j);
    sm90::wgmma_wait<1>();  // S_j done; P_{j-1} V_{j-1} runs on under the softmax
    sm90::reg_fence(s);
    softmax(j, alpha);
    sm90::wgmma_wait<0>();
    sm90::reg_fence(acc_o);
#pragma unroll
    for (int i = 0; i < NO; ++i) acc_o[i] *= alpha[(i >> 1) & 1];
    pack_p();
  }
  // The last P V.
  tile_ready(n_tiles);
  sm90::wgmma_fence();
  issue_pv(n_tiles);
  sm90::wgmma_wait<0>();
  sm90::reg_fence(acc_o);
  cp_async_wait<0>();

  if constexpr (Gather) {
    // O = acc / l (fp32) and LSE through shared memory ([BM][D + 4], then
    // [BM] and the merge's [3][BM], over the Q and K buffers: only the
    // other warpgroup's last P V may still read V), then merged into the
    // rows' states, or written as O and LSE in the rows' last round.
    constexpr int LO = D + 4;
    static_assert(kMobaMergeSmemBytes<BM, D> <= kQBytes + uint32_t(ST) * kKvBytes,
                  "the fp32 tile and the merge's rows fit");
    float* sO = reinterpret_cast<float*>(sQ);
    float* sL = sO + BM * LO;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float l = quad_sum(row_sum[hh]);
      const float inv = l != 0.0f ? 1.0f / l : 0.0f;  // (NaN l: NaN)
      const int row = row0 + hh * 8;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<float2*>(sO + row * LO + j * 8 + t4 * 2) =
            make_float2(o_scaled(acc_o[j * 4 + hh * 2], inv),
                        o_scaled(acc_o[j * 4 + hh * 2 + 1], inv));
      if (t4 == 0) sL[row] = row_lse(row_max[hh], l, scale_log2);
    }
    __syncthreads();
    moba_merge_tile<T, BM, D, NTH>(p, sO, sL, rows, tid);
  } else {
    // Epilogue: the warpgroup stages its 64 rows in its own rows of the Q
    // tile (same swizzled layout), then writes them with 16-byte stores.
    stage_o_rows<T, D, BM>(sQ, acc_o, row_max, row_sum, row0, t4, gL, rows, scale_log2);
    sm90::named_barrier(1 + wg, 128);
    store_o_rows<D, BM>(gO, p.o_seq, sQ, wg, wtid, rows);
  }
}

template <class T, int D, int BM = fwd_sm90_config(D).block_m, bool Cap = false,
          bool Sparse = false, bool Moba = false>
__global__ void __launch_bounds__(FwdSm90Traits<D, BM>::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FwdParams p) {
#if ATTN_SM90_WGMMA
  flash_fwd_sm90_tile<T, D, BM, Cap, Sparse, Moba>(p);
#endif
}

// MoBA's gathered forward on wgmma: the grid and the tiles of
// flash_fwd_moba_gather_kernel, 128-row tiles.
template <class T, int D>
__global__ void __launch_bounds__(FwdSm90Traits<D, kSm90MobaBlockM>::kThreads, 1)
    flash_fwd_sm90_moba_gather_kernel(const __grid_constant__ FwdParams p) {
#if ATTN_SM90_WGMMA
  for_each_moba_gather_tile<kSm90MobaBlockM>(p, [&] {
    flash_fwd_sm90_tile<T, D, kSm90MobaBlockM, false, false, true, true>(p);
  });
#endif
}

}  // namespace attn::flash
