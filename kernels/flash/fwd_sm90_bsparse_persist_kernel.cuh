// The persistent block-sparse forward on sm_90a (ATTN_CUDA_BSPARSE_FWD_PERSIST
// on an sm_90a device): one block per SM computes the work items dealt to
// it at plan creation, each the query tile of one head that a block of
// flash_fwd_sm90_kernel<..., Sparse> (flash/fwd_sm90_kernel.cuh) computes,
// with the same GEMMs, masks, softmax and epilogue. What it adds is one
// cp.async pipeline across items: the next item's Q, first KV tiles and
// visits land while the current item's last tiles and its epilogue run.
// Block-sparse lists are short (BigBird at L = 32K: 5 KV tiles per query
// tile), so the one-item kernel's exposed start (the item's record, then
// Q and the first tiles from memory) and end cost about as much as the
// tiles themselves.
//
// Work: block x computes items [item_offsets[x], item_offsets[x + 1]) of
// p.sparse.items (kSm90FwdItemWords words: query tile, first visit, end
// visit, KV tiles of its first two iterations, sequence, query head),
// src/cuda/block_sparse.hpp's deal_sm90_forward_items.
//
// Slots. Item c (counted from 0 per block) with n_c KV tiles owns
// n'_c = max(n_c, ST) consecutive slots from base_c (base_{c+1} = base_c +
// n'_c); the slots past n_c are bubbles with nothing to load or compute.
// An item past its sequence or with no visit has n_c = 0 (the latter
// writes O = 0 and LSE = -inf). Slot s is stage s % ST for its K and V.
// Commit group s holds K of slot s and V of slot s - 1, and, when s is an
// item's base, its Q (Q buffer c % 2), its visits (visit ring c % 2) and
// the next item's record (record buffer (c + 1) % 3). Group s is issued at
// step s - (ST - 1), whichever item it serves.
//
// Step s (tile_ready): wait for group s, fence the async proxy, barrier,
// refill the current item's ring (long lists, as the one-item kernel),
// issue group s + ST - 1. For item c with t = s - base_c:
//   t < n_c:  S_t = Q K_t (and O += P_{t-1} V_{t-1} when t > 0);
//   t = n_c:  the last P V, then the epilogue staged in item c's Q buffer.
// When n_c >= ST the step base_c + n_c is also step 0 of item c + 1 (one
// barrier for both); otherwise the bubbles between run as bare steps.
//
// Reuse, each ordered by the barrier of a step:
// - K stage and V stage: as the one-item kernel (read one and two steps
//   before a group overwrites them).
// - Q buffer c % 2: written by group base_c at step base_c - ST + 1 >=
//   base_{c-1} + 1 (n' >= ST), after item c - 2's S GEMMs and epilogue,
//   which end in step base_{c-1} at the latest.
// - Visit ring c % 2: item c - 2's last reads (its masks, its loads) come
//   before step base_{c-1}; refills of item c's own ring as the one-item
//   kernel's (landing ST - 1 steps after issue, kHalf >= 2 ST - 2 steps
//   before their first use).
// - Record buffer (c + 1) % 3: written at step base_c - ST + 1, after item
//   c - 2's last read (its epilogue, step base_{c-1} at the latest).
// The first two tiles of an item come from its record, not its ring: group
// base_c is issued in the step that also issues the ring's copies (and
// at ST = 3 group base_c + 1 before they land).
//
// Built only for sm_90a (ATTN_SM90_WGMMA), as the one-item kernel.
#pragma once

#include "flash/fwd_sm90_kernel.cuh"

namespace attn::flash {

template <class T, int D>
__device__ __forceinline__ void flash_fwd_sm90_bsparse_persist(const FwdParams& p) {
  using Tr = FwdSm90Traits<D>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, ST = Tr::kStages, NTH = Tr::kThreads;
  constexpr int NS = BN / 2, NO = D / 2;  // accumulators per thread: S, O
  constexpr uint32_t kQBytes = uint32_t(BM * D * 2), kKvBytes = uint32_t(BN * D * 2);
  constexpr int kRing = kSm90VisitRing, kHalf = kRing / 2, W = kSm90FwdItemWords;
  static_assert(kHalf >= 2 * ST - 2, "a refill lands before its first use");
  static_assert(W * 4 == 32, "a record is two 16-byte copies");

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t raw = smem_u32(smem);
  const uint32_t sQa = (raw + 1023u) & ~1023u;        // [2][BM][D]: Q buffers, then O tiles
  const uint32_t sKa = sQa + 2u * kQBytes;             // [ST][BN][D]
  const uint32_t sVa = sKa + uint32_t(ST) * kKvBytes;  // [ST][BN][D]
  unsigned char* const sQ = smem + (sQa - raw);
  // [2][kRing][2]: visit v of item c in ring c % 2, entry v % kRing.
  int32_t* const sRings = reinterpret_cast<int32_t*>(sQ + 2u * kQBytes + 2u * ST * kKvBytes);
  int32_t* const sRecs = sRings + 2 * 2 * kRing;  // [3][W]

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const TileLists& sp = p.sparse;
  const int first = sp.item_offsets[blockIdx.x];
  const int count = sp.item_offsets[blockIdx.x + 1] - first;
  if (count <= 0) return;
  const int32_t* const items = sp.items + int64_t(W) * first;
  const bool varlen = p.cu_q != nullptr;

  auto record = [&](int c) { return sRecs + W * (c % 3); };
  auto fetch_record = [&](int c) {  // part of the caller's group
    if (tid < 2) cp_async_16(smem_u32(record(c)) + 16u * uint32_t(tid), items + W * c + 4 * tid, true);
  };
  auto ring_of = [&](int c) { return sRings + 2 * kRing * (c & 1); };
  // Visits [lo, hi) of item c (counted from its first, at vbeg) into its ring.
  auto fill_ring = [&](int c, int vbeg, int lo, int hi) {
    int32_t* const ring = ring_of(c);
    for (int v = lo + tid; v < hi; v += NTH)
      cp_async_8(smem_u32(ring + 2 * (v & (kRing - 1))), sp.visits + 2 * int64_t(vbeg + v));
  };
  // Ring entry of iteration t (the last visit first) of an item of n visits.
  auto ring_entry = [](int n, int t) { return 2 * ((n - 1 - t) & (kRing - 1)); };

  // The loader: item ld_c, whose slots start at ld_base, ld_n tiles, keys
  // ld_lk, K and V of its head at element offsets ld_koff, ld_voff.
  int ld_c = -1, ld_base = -ST, ld_n = 0, ld_lk = 0;
  int64_t ld_koff = 0, ld_voff = 0;
  // Moves the loader to the next item, whose slots start at slot s, and
  // issues its Q, its visits and the record after it (part of group s).
  auto loader_next = [&](int s) {
    ++ld_c;
    ld_base = s;
    ld_n = 0;
    if (ld_c + 1 < count) fetch_record(ld_c + 1);
    const int32_t* r = record(ld_c);
    const int b = r[5], h = r[6], vbeg = r[1], n = r[2] - r[1];
    QueryTile qt;
    if (n <= 0 || !query_tile_of<BM>(p, b, r[0], qt)) return;
    ld_n = n;
    ld_lk = qt.lk;
    const int hk = h / p.group;
    ld_koff = (varlen ? qt.kv_tok * p.k_seq : b * p.k_batch) + hk * p.k_head;
    ld_voff = (varlen ? qt.kv_tok * p.v_seq : b * p.v_batch) + hk * p.v_head;
    const T* gQ = static_cast<const T*>(p.q) + (varlen ? qt.q_tok * p.q_seq : b * p.q_batch) +
                  h * p.q_head + qt.r0 * p.q_seq;
    sm90::load_tile_swizzled<BM, D, NTH>(sQa + uint32_t(ld_c & 1) * kQBytes, gQ, p.q_seq, qt.rows,
                                         tid);
    fill_ring(ld_c, vbeg, max(0, n - kRing), n);
  };
  // KV tile of the loader's iteration t.
  auto ld_tile = [&](int t) {
    return t < 2 ? record(ld_c)[3 + t] : ring_of(ld_c)[ring_entry(ld_n, t)];
  };
  // Group s: V of slot s - 1, then K of slot s (first moving to the next
  // item when slot s is past the loader's), then the commit.
  auto load_group = [&](int grp) {
    const int tv = grp - 1 - ld_base;
    if (tv >= 0 && tv < ld_n) {
      const int n = ld_tile(tv);
      sm90::load_tile_swizzled<BN, D, NTH>(
          sVa + uint32_t((grp - 1) % ST) * kKvBytes,
          static_cast<const T*>(p.v) + ld_voff + int64_t(n) * BN * p.v_seq, p.v_seq,
          ld_lk - n * BN, tid);
    }
    if (ld_c + 1 < count && grp - ld_base >= max(ld_n, ST)) loader_next(grp);
    const int tk = grp - ld_base;
    if (tk >= 0 && tk < ld_n) {
      const int n = ld_tile(tk);
      sm90::load_tile_swizzled<BN, D, NTH>(
          sKa + uint32_t(grp % ST) * kKvBytes,
          static_cast<const T*>(p.k) + ld_koff + int64_t(n) * BN * p.k_seq, p.k_seq,
          ld_lk - n * BN, tid);
    }
    cp_async_commit();
  };

  // Item 0's record, then the groups ahead of step 0.
  fetch_record(0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int grp = 0; grp < ST - 1; ++grp) load_group(grp);

  // The item being computed (its ring refills): ordinal, first visit,
  // tiles, first slot.
  int cur_c = 0, cur_vbeg = 0, cur_n = 0, cur_base = 0;
  // Step `at`: its group has landed for every thread; group at + ST - 1
  // goes out.
  auto tile_ready = [&](int at) {
    cp_async_wait<ST - 2>();
    sm90::fence_proxy_async();
    __syncthreads();
    const int j = at - cur_base;
    if (j >= kHalf && j % kHalf == 0 && cur_n - j - kHalf > 0)
      fill_ring(cur_c, cur_vbeg, max(0, cur_n - j - kRing), cur_n - j - kHalf);
    load_group(at + ST - 1);
  };

  const int row0 = wg * 64 + ((wtid >> 5) << 4) + g;
  const float scale_log2 = p.scale_log2;
  float acc_o[NO];
  float row_max[2], row_sum[2];
  uint32_t pa[BN / 16][4];
  float s[NS];

  int step = 0;  // the next step to run
  int base = 0;  // the slots of item c start here
  // An item without tiles still runs its first slot's step: the loader,
  // which moves only in steps, fetches each record an item ahead.
  auto skip_item = [&] {
#pragma unroll 1
    while (step <= base) tile_ready(step++);
    base += ST;
  };
#pragma unroll 1
  for (int c = 0; c < count; ++c) {
    const int32_t* r = record(c);
    const int b = r[5], h = r[6], n_tiles = r[2] - r[1];
    cur_c = c, cur_vbeg = r[1], cur_base = base;
    cur_n = 0;
    QueryTile qt;
    if (!query_tile_of<BM>(p, b, r[0], qt)) {  // past its sequence
      skip_item();
      continue;
    }
    const int rows = qt.rows;
    T* gO = static_cast<T*>(p.o) + (varlen ? qt.q_tok * p.o_seq : b * p.o_batch) +
            h * p.o_head + qt.r0 * p.o_seq;
    float* gL = p.lse == nullptr ? nullptr
                                 : p.lse + (varlen ? qt.q_tok : b * p.lse_batch) +
                                       h * p.lse_head + qt.r0;
    if (n_tiles <= 0) {  // no row of the tile sees a key
      constexpr int DT = D / 8;
      for (int i = tid; i < BM * DT; i += NTH) {
        const int rr = i / DT, ch = i % DT;
        if (rr < rows)
          *reinterpret_cast<uint4*>(gO + rr * p.o_seq + ch * 8) = make_uint4(0, 0, 0, 0);
      }
      if (gL != nullptr)
        for (int rr = tid; rr < rows; rr += NTH) gL[rr] = -INFINITY;
      skip_item();
      continue;
    }
    cur_n = n_tiles;
    const int32_t* const ring = ring_of(c);
    const uint32_t q_rows = sQa + uint32_t(c & 1) * kQBytes + uint32_t(wg * 64 * 128);
    const int r0 = qt.r0;

    auto issue_s = [&](int slot) {
      const uint32_t k_tile = sKa + uint32_t(slot % ST) * kKvBytes;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        sm90::Wgmma<T, BN>::ss(s, sm90::desc_k_major(q_rows, BM, kk),
                               sm90::desc_k_major(k_tile, BN, kk), kk > 0);
      sm90::wgmma_commit();
    };
    auto issue_pv = [&](int slot) {
      const uint32_t v_tile = sVa + uint32_t(slot % ST) * kKvBytes;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        sm90::Wgmma<T, D>::rs(acc_o, pa[kk], sm90::desc_mn_major(v_tile, BN, kk), true);
      sm90::wgmma_commit();
    };
    // Mask and online softmax of S_j, as the one-item kernel's Sparse path.
    auto softmax = [&](int j, float (&alpha)[2]) {
      const int e = ring_entry(n_tiles, j);
      const int kind = ring[e + 1];
      if (kind >= 0) mask_by_bits(s, sp.bits + int64_t(kind) * (2 * BM), row0, t4);
      if (kind == kVisitDense) {
        const int c0 = ring[e] * BN;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = int(opaque(r0 + row0 + hh * 8));
          const int lo = key_lo(p, qt, row), hi = key_hi(p, qt, row);
#pragma unroll
          for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
            for (int ee = 0; ee < 2; ++ee) {
              const int col = c0 + jj * 8 + t4 * 2 + ee;
              if (col < lo || col > hi) s[jj * 4 + hh * 2 + ee] = -INFINITY;
            }
        }
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = row_max[hh];
#pragma unroll
        for (int jj = 0; jj < BN / 8; ++jj)
          mx = fmaxf(mx, fmaxf(s[jj * 4 + hh * 2], s[jj * 4 + hh * 2 + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_scaled = mx == -INFINITY ? 0.0f : mx * scale_log2;
        alpha[hh] = fast_exp2(row_max[hh] * scale_log2 - m_scaled);
        row_max[hh] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
          for (int ee = 0; ee < 2; ++ee) {
            const float pe = fast_exp2(fmaf(s[jj * 4 + hh * 2 + ee], scale_log2, -m_scaled));
            s[jj * 4 + hh * 2 + ee] = pe;
            sum += pe;
          }
        row_sum[hh] = row_sum[hh] * alpha[hh] + sum;
      }
    };
    auto pack_p = [&] {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };

    // Bubbles of the previous item, then this item's step 0 (already run
    // when it was the previous item's last step).
#pragma unroll 1
    while (step <= base) tile_ready(step++);
#pragma unroll
    for (int i = 0; i < NO; ++i) acc_o[i] = 0.0f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
    float alpha[2];
    sm90::wgmma_fence();
    issue_s(base);
    sm90::wgmma_wait<0>();
    sm90::reg_fence(s);
    softmax(0, alpha);
    pack_p();
#pragma unroll 1
    for (int j = 1; j < n_tiles; ++j) {
      tile_ready(step++);  // step == base + j
      sm90::wgmma_fence();
      issue_s(base + j);
      issue_pv(base + j - 1);
      sm90::wgmma_wait<1>();
      sm90::reg_fence(s);
      softmax(j, alpha);
      sm90::wgmma_wait<0>();
      sm90::reg_fence(acc_o);
#pragma unroll
      for (int i = 0; i < NO; ++i) acc_o[i] *= alpha[(i >> 1) & 1];
      pack_p();
    }
    // Step base + n_tiles: the last P V (and, when n_tiles >= ST, the next
    // item's step 0).
    tile_ready(step++);
    sm90::wgmma_fence();
    issue_pv(base + n_tiles - 1);
    sm90::wgmma_wait<0>();
    sm90::reg_fence(acc_o);
    base += max(n_tiles, ST);

    // Epilogue, as the one-item kernel's, staged in this item's Q buffer.
    unsigned char* const sO = sQ + uint32_t(c & 1) * kQBytes;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float l = quad_sum(row_sum[hh]);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int row = row0 + hh * 8;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<uint32_t*>(sO + sm90::swizzled_offset(BM, row, j * 8 + t4 * 2)) =
            pack2<T>(acc_o[j * 4 + hh * 2] * inv, acc_o[j * 4 + hh * 2 + 1] * inv);
      if (gL != nullptr && t4 == 0 && row < rows) gL[row] = row_lse(row_max[hh], l, scale_log2);
    }
    sm90::named_barrier(1 + wg, 128);
    constexpr int DT = D / 8;
#pragma unroll
    for (int i = 0; i < 64 * DT / 128; ++i) {
      const int cc = wtid + i * 128;
      const int rr = wg * 64 + cc / DT, ch = cc % DT;
      if (rr < rows)
        *reinterpret_cast<uint4*>(gO + rr * p.o_seq + ch * 8) =
            *reinterpret_cast<const uint4*>(sO + sm90::swizzled_offset(BM, rr, ch * 8));
    }
  }
  cp_async_wait<0>();  // the groups past the last item are empty
}

// Grid (blocks, 1, 1): block x computes the items dealt to it.
template <class T, int D>
__global__ void __launch_bounds__(FwdSm90Traits<D>::kThreads, 1)
    flash_fwd_sm90_bsparse_persist_kernel(const __grid_constant__ FwdParams p) {
#if ATTN_SM90_WGMMA
  flash_fwd_sm90_bsparse_persist<T, D>(p);
#endif
}

}  // namespace attn::flash
