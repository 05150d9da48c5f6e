// The deterministic dQ kernel of the backward pass: one block per query tile
// of one query head walks the KV tiles that tile sees (the forward's
// schedule) and accumulates dQ = scale * dS K in registers, with no atomics,
// so the result does not depend on scheduling. Each of the 4 warps owns 16
// query rows:
//
//   S = Q K^T, dP = dO V^T    [16][BN] fp32 per warp
//   P = 2^(z log2 e - lse2),  dS = P (dP - D) (softcap chain rule applied)
//   dQ += dS K                dS repacked from C to A fragments in registers
//
// K and V stream through `stages` shared buffers (two for D <= 128).
// Block-sparse plans (Sparse) walk the query tile's list of KV tiles
// (p.sparse_dq, in this kernel's tile sizes) instead of the dense interval.
// MoBA plans (Moba) walk the blocks of the forward query tile that holds
// this one (p.moba's q lists, a superset), up to the own block of the
// tile's last row, with one selection bit per row as the predicate.
#pragma once

#include "flash/bwd_kernel.cuh"
#include "flash/fwd_params.cuh"
#include "flash/sequence.cuh"

namespace attn::flash {

// The forward kernel's query tile rows (those of MoBA's q lists).
template <int D>
struct FwdRows {
  static constexpr int kRows = fwd_config(D).block_m;
};

template <class T, int D, bool Sparse = false, bool Moba = false>
__global__ void __launch_bounds__(DqTraits<D>::kThreads, 2)
    flash_bwd_dq_kernel(const __grid_constant__ BwdParams p) {
  using Tr = DqTraits<D>;
  constexpr int BM = Tr::kCfg.block_m, BN = Tr::kCfg.block_n, NTH = Tr::kThreads;
  constexpr int ST = Tr::kCfg.stages;
  constexpr int LD = D + 8, NT = BN / 8, DT = D / 8;
  constexpr uint32_t kTile = uint32_t(BN * LD * 2);
  static_assert(BM == 16 * Tr::kCfg.warps && BN % 16 == 0 && D % 16 == 0, "16 rows per warp");

  extern __shared__ __align__(16) unsigned char smem[];
  T* sQp = reinterpret_cast<T*>(smem);
  const uint32_t sQ = smem_u32(smem);
  const uint32_t sDo = sQ + uint32_t(BM * LD * 2);
  const uint32_t sK = sDo + uint32_t(BM * LD * 2);  // [ST][BN][LD]
  const uint32_t sV = sK + uint32_t(ST) * kTile;    // [ST][BN][LD]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y;
  const int m_block = int(gridDim.x) - 1 - int(blockIdx.x);  // long (causal) tiles first

  QueryTile qt;
  if (!query_tile_of<BM>(p, b, m_block, qt)) return;
  const int lk = qt.lk, r0 = qt.r0, rows = qt.rows;
  const bool varlen = p.cu_q != nullptr;
  const int64_t q_tok = qt.q_tok, kv_tok = qt.kv_tok;
  const int hk = h / p.group;

  const T* gQ = static_cast<const T*>(p.q) + (varlen ? q_tok * p.q_seq : b * p.q_batch) +
                h * p.q_head + r0 * p.q_seq;
  const T* gDo = static_cast<const T*>(p.d_o) + (varlen ? q_tok * p.do_seq : b * p.do_batch) +
                 h * p.do_head + r0 * p.do_seq;
  const T* gK = static_cast<const T*>(p.k) + (varlen ? kv_tok * p.k_seq : b * p.k_batch) +
                hk * p.k_head;
  const T* gV = static_cast<const T*>(p.v) + (varlen ? kv_tok * p.v_seq : b * p.v_batch) +
                hk * p.v_head;
  T* gDq = static_cast<T*>(p.dq) + (varlen ? q_tok * p.dq_seq : b * p.dq_batch) + h * p.dq_head +
           r0 * p.dq_seq;
  const int64_t stat0 = (varlen ? q_tok : b * p.lse_batch) + h * p.lse_head + r0;

  auto key_lo = [&](int i) { return flash::key_lo(p, qt, i); };
  auto key_hi = [&](int i) { return flash::key_hi(p, qt, i); };
  const int lo_first = qt.lo_first, hi_last = qt.hi_last;
  const int lo_last = qt.lo_last, hi_first = qt.hi_first;

  // Sparse: the tile's visits (KV tile, kind), in increasing KV tile order.
  const int32_t* visits = nullptr;
  int n_tiles, n_begin = 0;
  // MoBA, as the forward: visit it is tile it % tpb of block it / tpb of
  // the list; the last block ends at the diagonal.
  const int32_t* moba_blocks = nullptr;
  auto moba_tpb = [&] { return p.moba.block / BN; };
  if constexpr (Moba) {
    const MobaLists& mb = p.moba;
    const int64_t slot = int64_t(b) * mb.sel_heads + (mb.per_query_head ? h : hk);
    const int64_t list = slot * mb.q_tiles + r0 / FwdRows<D>::kRows;
    int count = mb.q_count[list];
    moba_blocks = mb.q_blocks + list * mb.q_cap;
    n_tiles = 0;
    if (hi_last >= 0) {
      // Blocks past the own block of this tile's last row were chosen by
      // later rows of the forward tile only.
      const int own = hi_last / mb.block;
      while (count > 0 && (moba_blocks[count - 1] & kMobaIndexMask) > own) --count;
      if (count > 0)
        n_tiles = (count - 1) * moba_tpb() + hi_last / BN -
                  (moba_blocks[count - 1] & kMobaIndexMask) * moba_tpb() + 1;
    }
  } else if constexpr (Sparse) {
    const TileLists& sp = p.sparse_dq;
    const int list = mask_slot(sp, b, hk) *
                         sp.tiles + m_block;
    const int v0 = sp.offsets[list];
    n_tiles = sp.offsets[list + 1] - v0;
    visits = sp.visits + 2 * int64_t(v0);
  } else {
    n_tiles = hi_last < lo_first ? 0 : hi_last / BN + 1 - lo_first / BN;
    n_begin = lo_first / BN;
  }
  auto tile_of = [&](int it) {
    if constexpr (Moba)
      return (moba_blocks[it / moba_tpb()] & kMobaIndexMask) * moba_tpb() + it % moba_tpb();
    else
      return Sparse ? visits[2 * it] : n_begin + it;
  };

  if (n_tiles == 0) {  // no row of the tile sees a key: dQ = 0
    for (int c = tid; c < BM * DT; c += NTH) {
      const int r = c / DT, ch = c % DT;
      if (r < rows)
        *reinterpret_cast<uint4*>(gDq + r * p.dq_seq + ch * 8) = make_uint4(0, 0, 0, 0);
    }
    return;
  }

  auto load_kv = [&](int it) {
    if (it < n_tiles) {
      const int n = tile_of(it);
      const uint32_t so = ST == 1 ? 0u : uint32_t(it % ST) * kTile;
      const int64_t ks = opaque(p.k_seq), vs = opaque(p.v_seq);
      load_tile<BN, D, NTH>(sK + so, gK + n * BN * ks, ks, lk - n * BN, tid);
      load_tile<BN, D, NTH>(sV + so, gV + n * BN * vs, vs, lk - n * BN, tid);
    }
    cp_async_commit();
  };
  load_tile<BM, D, NTH>(sQ, gQ, p.q_seq, rows, tid);
  load_tile<BM, D, NTH>(sDo, gDo, p.do_seq, rows, tid);
  load_kv(0);

  // Row statistics of this thread's rows g and g + 8 of the warp; rows past
  // the sequence get lse2 = +inf (P = 0).
  float lse2[2], dd[2];
  Interval vis[2];  // visible keys of the row
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = warp * 16 + hh * 8 + g;
    const bool ok = r < rows;
    lse2[hh] = ok ? p.lse2[stat0 + r] : INFINITY;
    dd[hh] = ok ? p.delta[stat0 + r] : 0.0f;
    vis[hh] = Interval::of(key_lo(r0 + r), key_hi(r0 + r));
  }

  // Lane addresses: A (Q, dO rows of the warp), B non-transposed (K, V as
  // [n][k]), B transposed (K as [k][n] for dQ).
  const uint32_t a_lane = uint32_t(((warp * 16 + (lane & 15)) * LD + (lane >> 4) * 8) * 2);
  const uint32_t b_nk =
      uint32_t((((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8) * 2);
  const uint32_t b_kn = uint32_t(((lane & 15) * LD + (lane >> 4) * 8) * 2);

  float acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.0f;
  const bool capped = p.softcap > 0.0f;

#pragma unroll 1
  for (int it = 0; it < n_tiles; ++it) {
    const int n = tile_of(it);
    const int c0 = n * BN;
    const uint32_t so = ST == 1 ? 0u : uint32_t(it % ST) * kTile;
    cp_async_wait<0>();
    __syncthreads();
    if (ST > 1) load_kv(it + 1);

    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = 0.0f;
        dp[nt][e] = -dd[e >> 1];
      }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[4], ao[4];
      ldsm_x4(aq, sQ + a_lane + uint32_t(kk * 32));
      ldsm_x4(ao, sDo + a_lane + uint32_t(kk * 32));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bk[4], bv[4];
        ldsm_x4(bk, sK + so + b_nk + uint32_t((np * 16 * LD + kk * 16) * 2));
        ldsm_x4(bv, sV + so + b_nk + uint32_t((np * 16 * LD + kk * 16) * 2));
        mma_16816<T>(s[2 * np], aq, bk[0], bk[1]);
        mma_16816<T>(s[2 * np + 1], aq, bk[2], bk[3]);
        mma_16816<T>(dp[2 * np], ao, bv[0], bv[1]);
        mma_16816<T>(dp[2 * np + 1], ao, bv[2], bv[3]);
      }
    }

    bool full;
    int kind = kVisitDense;
    if constexpr (Moba) {
      const int entry = moba_blocks[it / moba_tpb()];
      full = (entry & kMobaAllRows) != 0 && c0 + BN <= lk && c0 + BN - 1 <= hi_first;
    } else if constexpr (Sparse) {
      kind = visits[2 * it + 1];
      full = kind == kVisitFull;
    } else {
      full = c0 + BN <= lk && c0 >= lo_last && c0 + BN - 1 <= hi_first;
    }
    auto lse2_of = [&](int, int e) { return lse2[e >> 1]; };
    if (capped)
      probs_and_dscores<true>(s, dp, p, lse2_of);
    else
      probs_and_dscores<false>(s, dp, p, lse2_of);
    if constexpr (Moba) {
      if (!full) {
        const MobaLists& mb = p.moba;
        const int64_t slot = int64_t(b) * mb.sel_heads + (mb.per_query_head ? h : hk);
        const uint64_t* sel =
            mb.selected + (slot * mb.num_blocks + n / moba_tpb()) * int64_t((p.seqlen_q + 63) / 64);
        bool on[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = r0 + warp * 16 + hh * 8 + g;
          on[hh] = row < qt.lq && ((sel[row >> 6] >> (row & 63)) & 1u);
        }
        apply_mask(s, dp, [&](int nt, int e) {
          return !on[e >> 1] || vis[e >> 1].outside(c0 + nt * 8 + 2 * t4 + (e & 1));
        });
      }
    } else if (Sparse && kind >= 0) {
      // Rows g and g + 8 of the warp in the bit tile (one word: BN <= 64).
      static_assert(BN <= 64, "one bit-tile word per row");
      const uint64_t* tb = p.sparse_dq.bits + int64_t(kind) * BM;
      const uint64_t w[2] = {tb[warp * 16 + g], tb[warp * 16 + 8 + g]};
      apply_mask(s, dp, [&](int nt, int e) {
        return !((w[e >> 1] >> (nt * 8 + 2 * t4 + (e & 1))) & 1u);
      });
    } else if (!full) {
      apply_mask(s, dp, [&](int nt, int e) {
        return vis[e >> 1].outside(c0 + nt * 8 + 2 * t4 + (e & 1));
      });
    }
    uint32_t da[NT / 2][4];
    pack_a<T>(da, dp);

    // dQ += dS K (k = keys, n = head dim)
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t bk[4];
        ldsm_x4_trans(bk, sK + so + b_kn + uint32_t((kk * 16 * LD + np * 16) * 2));
        mma_16816<T>(acc[2 * np], da[kk], bk[0], bk[1]);
        mma_16816<T>(acc[2 * np + 1], da[kk], bk[2], bk[3]);
      }
    if (ST == 1) {
      __syncthreads();  // the single K/V buffer is free
      load_kv(it + 1);
    }
  }
  cp_async_wait<0>();

  // Epilogue: dQ = scale * acc, staged in the warp's own Q rows.
  __syncwarp();
  const float scale = p.scale;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = warp * 16 + hh * 8 + g;
    uint32_t* dst = reinterpret_cast<uint32_t*>(sQp + row * LD) + t4;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      dst[dt * 4] = pack2<T>(acc[dt][hh * 2] * scale, acc[dt][hh * 2 + 1] * scale);
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 * DT / 32; ++i) {
    const int c = lane + i * 32;
    const int r = warp * 16 + c / DT, ch = c % DT;
    if (r < rows)
      *reinterpret_cast<uint4*>(gDq + r * p.dq_seq + ch * 8) =
          *reinterpret_cast<const uint4*>(sQp + r * LD + ch * 8);
  }
}

}  // namespace attn::flash
