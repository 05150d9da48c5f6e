// The persistent dense sm_90a forward (ATTN_CUDA_FWD_SM90_PERSIST=1): one
// block per SM walks work items, each the query tile of one head that a
// block of flash_fwd_sm90_kernel (flash/fwd_sm90_kernel.cuh) computes, with
// the same GEMMs, softmax and epilogue. What it adds is one cp.async
// pipeline that runs across items, so that the next item's Q and first KV
// tiles land while the current item's last tiles and its epilogue run: the
// one-item kernel pays them as an exposed prologue and epilogue per block.
//
// Work items: item k = x + m_blocks * (h + heads * b), the one-item
// kernel's grid order flattened (query tile m_block = m_blocks - 1 - x, the
// last ones first); block x takes items x, x + gridDim.x, ... An item whose
// tile lies past its sequence does nothing; one whose rows see no key
// writes O = 0 and LSE = -inf and takes no part in the pipeline.
//
// Slots. The items that have KV tiles get consecutive ranges of slots:
// item i's n_i tiles occupy slots [base_i, base_i + n_i) and the item owns
// n'_i = max(n_i, ST) slots (base_{i+1} = base_i + n'_i; the slots past
// n_i are bubbles, with nothing to load or compute). Slot s is stage
// s % ST for both its K and its V. Commit group s holds K of slot s and V
// of slot s - 1, and also the item's Q when s is its base: one running
// group counter for every item, so group s is issued at step s - (ST - 1),
// whoever's tile it carries. Q of the c-th item with tiles goes to Q
// buffer c % 2.
//
// Step s (tile_ready): wait for group s, fence the async proxy, barrier,
// issue group s + ST - 1. Then, for item i with tile t = s - base_i:
//   t < n_i:  S_t = Q K_t (and O += P_{t-1} V_{t-1} when t > 0), as the
//             one-item kernel's iteration t;
//   t = n_i:  the last P V, then the epilogue, staged in item i's own Q
//             buffer as in the one-item kernel.
// When n_i >= ST the step base_i + n_i is also step 0 of item i + 1 (one
// barrier for both); otherwise the bubbles between run as bare steps.
//
// Reuse, each protected by the barrier of a step:
// - K stage (s-1) % ST, written by group s + ST - 1 at step s: its last
//   reader, S of slot s - 1, completed (wgmma wait) in step s - 1.
// - V stage (s-2) % ST, written at step s: its last reader, P V of slot
//   s - 2, completed in step s - 1.
// - Q buffer c % 2, written by group base_c at step base_c - ST + 1: its
//   last users are item c - 2's S GEMMs and its epilogue (staging writes
//   and reads) at step base_{c-1}; base_c - ST + 1 = base_{c-1} + n'_{c-1}
//   - ST + 1 > base_{c-1}, hence the bubbles: the write comes after the
//   next barrier. The other Q buffer holds item c - 1's Q, which its S
//   GEMMs read while item c's Q lands.
// - The epilogue's generic writes into the Q buffer and the cp.async
//   writes after them are ordered by those barriers; the wgmma reads of the
//   new Q by the fence at the step that waits for it.
//
// Built only for sm_90a (ATTN_SM90_WGMMA), as the one-item kernel.
#pragma once

#include "flash/fwd_sm90_kernel.cuh"

namespace attn::flash {

template <class T, int D, int BM_>
__device__ __forceinline__ void flash_fwd_sm90_persist(const FwdParams& p, const FwdSm90Items& w) {
  using Tr = FwdSm90Traits<D, BM_>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, ST = Tr::kStages, NTH = Tr::kThreads;
  constexpr int NS = BN / 2, NO = D / 2;  // accumulators per thread: S, O
  constexpr uint32_t kQBytes = uint32_t(BM * D * 2), kKvBytes = uint32_t(BN * D * 2);

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t raw = smem_u32(smem);
  const uint32_t sQa = (raw + 1023u) & ~1023u;        // [2][BM][D]: Q buffers, then O tiles
  const uint32_t sKa = sQa + 2u * kQBytes;             // [ST][BN][D]
  const uint32_t sVa = sKa + uint32_t(ST) * kKvBytes;  // [ST][BN][D]
  unsigned char* const sQ = smem + (sQa - raw);

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const bool varlen = p.cu_q != nullptr;

  // Item k's (sequence, head, query tile) and tile; false: past its sequence.
  auto item_tile = [&](int k, int& b, int& h, QueryTile& qt) {
    const int x = k % w.m_blocks, hb = k / w.m_blocks;
    h = hb % w.heads;
    b = hb / w.heads;
    return query_tile_of<BM>(p, b, w.m_blocks - 1 - x, qt);
  };

  // The loader: the item whose K tiles the next group carries (ld_k, its
  // slots from ld_base, ld_n tiles ending before KV tile ld_end, keys
  // ld_lk, K and V of its head at element offsets ld_koff, ld_voff) and
  // the Q buffer of its Q (ld_buf).
  int ld_k = int(blockIdx.x) - int(gridDim.x), ld_base = -ST, ld_n = 0, ld_end = 0, ld_lk = 0;
  int ld_buf = 1;
  int64_t ld_koff = 0, ld_voff = 0;
  // Moves the loader to the next item with KV tiles, whose slots start at
  // slot s, and issues its Q (part of group s).
  auto loader_next = [&](int s) {
    ld_base = s;
    ld_n = 0;
    for (ld_k += int(gridDim.x); ld_k < w.count; ld_k += int(gridDim.x)) {
      int b, h;
      QueryTile qt;
      if (!item_tile(ld_k, b, h, qt)) continue;
      ld_n = dense_kv_tiles<BN>(qt, ld_end);
      if (ld_n == 0) continue;
      const int hk = h / p.group;
      ld_lk = qt.lk;
      ld_koff = (varlen ? qt.kv_tok * p.k_seq : b * p.k_batch) + hk * p.k_head;
      ld_voff = (varlen ? qt.kv_tok * p.v_seq : b * p.v_batch) + hk * p.v_head;
      ld_buf ^= 1;
      const T* gQ = static_cast<const T*>(p.q) + (varlen ? qt.q_tok * p.q_seq : b * p.q_batch) +
                    h * p.q_head + qt.r0 * p.q_seq;
      sm90::load_tile_swizzled<BM, D, NTH>(sQa + uint32_t(ld_buf) * kQBytes, gQ, p.q_seq,
                                           qt.rows, tid);
      return;
    }
  };
  // Group s: V of slot s - 1, then K of slot s (first moving to the next
  // item when slot s is past the loader's), then the commit.
  auto load_group = [&](int grp) {
    const int tv = grp - 1 - ld_base;
    if (tv >= 0 && tv < ld_n) {
      const int n = ld_end - 1 - tv;
      sm90::load_tile_swizzled<BN, D, NTH>(
          sVa + uint32_t((grp - 1) % ST) * kKvBytes,
          static_cast<const T*>(p.v) + ld_voff + int64_t(n) * BN * p.v_seq, p.v_seq,
          ld_lk - n * BN, tid);
    }
    if (ld_k < w.count && grp - ld_base >= max(ld_n, ST)) loader_next(grp);
    const int tk = grp - ld_base;
    if (tk < ld_n) {
      const int n = ld_end - 1 - tk;
      sm90::load_tile_swizzled<BN, D, NTH>(
          sKa + uint32_t(grp % ST) * kKvBytes,
          static_cast<const T*>(p.k) + ld_koff + int64_t(n) * BN * p.k_seq, p.k_seq,
          ld_lk - n * BN, tid);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int grp = 0; grp < ST - 1; ++grp) load_group(grp);

  // Step `at`: its group has landed for every thread; group at + ST - 1
  // goes out.
  auto tile_ready = [&](int at) {
    cp_async_wait<ST - 2>();
    sm90::fence_proxy_async();
    __syncthreads();
    load_group(at + ST - 1);
  };

  const int row0 = wg * 64 + ((wtid >> 5) << 4) + g;
  const float scale_log2 = p.scale_log2;
  float acc_o[NO];
  float row_max[2], row_sum[2];
  uint32_t pa[BN / 16][4];
  float s[NS];

  int step = 0;      // the next step to run
  int base = 0;      // the slots of the next item with KV tiles start here
  int buf = 1;       // the Q buffer of the current item
#pragma unroll 1
  for (int k = int(blockIdx.x); k < w.count; k += int(gridDim.x)) {
    int b, h;
    QueryTile qt;
    if (!item_tile(k, b, h, qt)) continue;
    int n_end;
    const int n_tiles = dense_kv_tiles<BN>(qt, n_end);
    const int rows = qt.rows;
    T* gO = static_cast<T*>(p.o) + (varlen ? qt.q_tok * p.o_seq : b * p.o_batch) +
            h * p.o_head + qt.r0 * p.o_seq;
    float* gL = p.lse == nullptr ? nullptr
                                 : p.lse + (varlen ? qt.q_tok : b * p.lse_batch) +
                                       h * p.lse_head + qt.r0;
    if (n_tiles == 0) {  // no row of the tile sees a key
      constexpr int DT = D / 8;
      for (int c = tid; c < BM * DT; c += NTH) {
        const int r = c / DT, ch = c % DT;
        if (r < rows)
          *reinterpret_cast<uint4*>(gO + r * p.o_seq + ch * 8) = make_uint4(0, 0, 0, 0);
      }
      if (gL != nullptr)
        for (int r = tid; r < rows; r += NTH) gL[r] = -INFINITY;
      continue;
    }
    buf ^= 1;
    const uint32_t sQb = sQa + uint32_t(buf) * kQBytes;
    const uint32_t q_rows = sQb + uint32_t(wg * 64 * 128);  // the warpgroup's rows, panel 0

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
    // As the one-item kernel's softmax (dense, no softcap).
    auto softmax = [&](int j, float (&alpha)[2]) {
      const int c0 = (n_end - 1 - j) * BN;
      if (!dense_tile_full<BN>(qt, c0)) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = qt.r0 + row0 + hh * 8;
          const int lo = key_lo(p, qt, row), hi = key_hi(p, qt, row);
#pragma unroll
          for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = c0 + jj * 8 + t4 * 2 + e;
              if (col < lo || col > hi) s[jj * 4 + hh * 2 + e] = -INFINITY;
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
          for (int e = 0; e < 2; ++e) {
            const float pe = fast_exp2(fmaf(s[jj * 4 + hh * 2 + e], scale_log2, -m_scaled));
            s[jj * 4 + hh * 2 + e] = pe;
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
    unsigned char* const sO = sQ + uint32_t(buf) * kQBytes;
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
      const int c = wtid + i * 128;
      const int r = wg * 64 + c / DT, ch = c % DT;
      if (r < rows)
        *reinterpret_cast<uint4*>(gO + r * p.o_seq + ch * 8) =
            *reinterpret_cast<const uint4*>(sO + sm90::swizzled_offset(BM, r, ch * 8));
    }
  }
  cp_async_wait<0>();  // the groups past the last item are empty
}

template <class T, int D, int BM = fwd_sm90_config(D).block_m>
__global__ void __launch_bounds__(FwdSm90Traits<D, BM>::kThreads, 1)
    flash_fwd_sm90_persist_kernel(const __grid_constant__ FwdParams p, const FwdSm90Items w) {
#if ATTN_SM90_WGMMA
  flash_fwd_sm90_persist<T, D, BM>(p, w);
#endif
}

}  // namespace attn::flash
