// Paged decode on sm_90 with tensor copies: the block, pipeline and
// barriers of the bulk-copy kernel (paged_decode_sm90.cuh), each 8-slot
// segment of K and V moved by cp.async.bulk.tensor through a tensor map
// over the pool, 128-byte swizzled.
//
// Why: plain bulk copies write contiguous bytes, so the bulk kernel pads 16
// bytes between segments for conflict-free ldmatrix, which lands half of
// its copies mid-sector; the copy engine then asks L2 for 11% more sectors
// than it reads (bench/results/ncu-decode-*). A swizzled tensor copy writes
// a 1024-byte aligned box whose rows keep their 16-byte chunks permuted
// (chunk c of row r at c ^ r): aligned, and an ldmatrix reading 8 rows of
// one box meets 8 distinct bank groups. A token-major (NHD) pool with
// several KV heads also moves 8 (strided) rows per copy instead of one.
//
// Tensor maps (encoded by the host, decode_cuda.cpp): dims {D, page_size,
// heads_kv, pages} with the pool's strides, box {64, 8, 1, 1} (64 elements:
// the swizzle's 128-byte span), so D = 128 is two boxes per segment. A K
// (or V) tile in shared memory: [segment 8][box D / 64][row 8][64 swizzled];
// tile key k is row k % 8 of segment k / 8. Warp w takes segments 2w and
// 2w + 1 (its n-tile nt: keys (2w + nt) * 8 + c in column c), in S = Q K^T
// and in P V.
//
// Slots without a key: a segment with none (past the unit, or wholly at
// positions >= n) is copied from coordinates before the tensor's first
// slot, which the copy fills with zeros; the one segment with some (it holds
// position n - 1, n % 8 != 0) is copied whole, and the warp that reads it
// zeroes its V rows past n first: they may hold anything, and a zero weight
// does not cancel a NaN. K rows need nothing: masked scores are replaced.
#pragma once

#include "decode/paged_decode_sm90.cuh"

namespace attn::decode {

// A box of `map` at coordinates (c0 fastest) to shared dst (1024-byte
// aligned for the swizzle), completing on barrier bar; coordinates outside
// the tensor read as zeros (and count as bytes).
__device__ __forceinline__ void tensor_load_4d(uint32_t dst, const CUtensorMap* map, int c0,
                                               int c1, int c2, int c3, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
#endif
}

template <int D, int S>
struct TensorSmem {
  static_assert(S >= 2, "a tile in flight while one is computed");
  static constexpr int kSegRows = 8;
  static constexpr int kSegs = kTileKeys / kSegRows;
  static_assert(kSegs == 8 && kWarps * 2 == kSegs, "8 segments; two per warp");
  static constexpr int kBoxElems = 64;  // 128 bytes, the swizzle's span
  static_assert(D % kBoxElems == 0, "whole boxes per row");
  static constexpr int kBoxes = D / kBoxElems;
  static constexpr int kBoxBytes = kSegRows * kBoxElems * 2;  // 1024
  static constexpr int kSegBytes = kBoxes * kBoxBytes;
  static constexpr int kTileBytes = kSegs * kSegBytes;
  static constexpr int kKvBytes = S * 2 * kTileBytes;
  static constexpr int kPosBytes = S * kTileKeys * 4;
  static constexpr int kEntriesPerTile = kTileKeys + 1;  // as in Smem
  static constexpr int kEntryBytes = S * kEntriesPerTile * 16;
  static constexpr int kLdQ = D + 8;
  static constexpr int kQBytes = 16 * kLdQ * 2;
  static constexpr int kBarBytes = (S * 8 + 15) / 16 * 16;
  static constexpr int kMergeBytes = kWarps * 16 * (D + 2) * 4;
  static_assert(kMergeBytes <= kKvBytes, "merge area fits");
  // The dynamic area's base is aligned up to 1024 bytes in the kernel (its
  // alignment is not promised beyond 16).
  static constexpr int kAlign = 1024;
  static constexpr int kBytes = kKvBytes + kPosBytes + kEntryBytes + kQBytes + kBarBytes + kAlign;
};

// One work unit u of the tensor-copy kernel below; tile t of the unit uses
// stage (tile_base + t) % S and completes phase (tile_base + t) / S of that
// stage's barrier (as in decode_unit_bulk).
template <class T, int D, int S>
__device__ __forceinline__ void decode_unit_tensor(const DecodeParams& p, const WorkUnit& u,
                                                   unsigned char* smem, int& tile_base) {
  using flash::cp_async_16;
  using flash::smem_u32;
  using SM = TensorSmem<D, S>;
  constexpr int kLdQ = SM::kLdQ;
  constexpr int kChunks = D / 8;

  const uint32_t sKV = smem_u32(smem);  // [stage][K|V][segment][box][8][64], swizzled
  int* sPos = reinterpret_cast<int*>(smem + SM::kKvBytes);  // [stage][kTileKeys]
  PageEntry* sEnt = reinterpret_cast<PageEntry*>(smem + SM::kKvBytes + SM::kPosBytes);  // [S][kEntriesPerTile]
  T* sQ = reinterpret_cast<T*>(smem + SM::kKvBytes + SM::kPosBytes + SM::kEntryBytes);  // [16][kLdQ]
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM::kKvBytes + SM::kPosBytes +
                                               SM::kEntryBytes + SM::kQBytes);  // [S]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t ps = p.page_size;
  const uint32_t ups = uint32_t(ps);
  const int64_t num_entries = u.entry_end - u.entry_begin;
  const int64_t slots = num_entries * ps;
  const int tiles = int((slots + kTileKeys - 1) / kTileKeys);

  // Entries of tile `tile` into buffer tile % S, S - 1 iterations before its
  // K/V (as in paged_decode_kernel).
  auto fetch_entries = [&](int tile) {
    const int64_t first = int64_t(uint32_t(tile * kTileKeys) / ups);
    const int64_t last = min(int64_t(uint32_t(tile * kTileKeys + kTileKeys - 1) / ups), num_entries - 1);
    if (tid <= last - first)
      cp_async_16(smem_u32(sEnt + (tile % S) * SM::kEntriesPerTile + tid),
                  p.entries + u.entry_begin + first + tid, true);
  };
  for (int j = 0; j < S - 1; ++j)
    if (j < tiles) fetch_entries(j);

  const SeqMeta sm = p.seqs[u.seq];
  const int g = block_kv_head(p);
  const int G = p.group;
  const int rows = int(sm.q_len) * G;
  const int row0 = blockIdx.z * 16;
  if (row0 >= rows) {
    flash::cp_async_commit();
    flash::cp_async_wait<0>();
    return;
  }
  const int64_t n = sm.length;
  const T* q = static_cast<const T*>(p.q);

  for (int idx = tid; idx < 16 * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int rr = row0 + r;
    const int64_t t = rr / G, h = int64_t(g) * G + rr % G;
    const bool valid = rr < rows;
    cp_async_16(smem_u32(sQ + r * kLdQ + c * 8),
                valid ? q + ((sm.q_begin + t) * p.heads_q + h) * D + c * 8 : q, valid);
  }

  // Tile `tile` into stage (base + tile) % S: thread tid < kTileKeys (whole
  // warps: the ballot) records tile key tid's position; the first thread of
  // each segment copies it (8 slots from a multiple of 8 lie in one page:
  // page size % 8 == 0, and a unit starts at a page).
  const int base = tile_base;
  tile_base += tiles;
  auto issue_kv = [&](int tile) {
    const int st = (base + tile) % S;
    const uint32_t sK = sKV + uint32_t(st * 2 * SM::kTileBytes);
    const uint32_t sV = sK + SM::kTileBytes;
    const PageEntry* ent = sEnt + (tile % S) * SM::kEntriesPerTile;
    const uint32_t slot0 = uint32_t(tile * kTileKeys);
    const uint32_t first = slot0 / ups;
    const int key = tid, seg = key / 8, row = key % 8;
    const uint32_t slot = slot0 + uint32_t(key);
    const uint32_t e = slot / ups, in_page = slot - e * ups;
    bool valid = false;
    int pos = -1;
    int page = 0;
    if (int64_t(slot) < slots) {
      const PageEntry pe = ent[e - first];
      pos = int(pe.logical * ps + in_page);
      valid = pos < n;
      page = int(pe.page);
    }
    sPos[st * kTileKeys + key] = valid ? pos : -1;
    // Positions grow along a segment: when any of its slots holds a key,
    // its first does.
    const bool any = (__ballot_sync(0xffffffffu, valid) >> (lane & 24)) & 0xffu;
    if (row == 0) {
      const uint32_t bar = smem_u32(sBar + st);
      mbar_arrive_expect_tx(bar, 2 * SM::kSegBytes);
      const int c1 = any ? int(in_page) : -SM::kSegRows;  // no key: zeros
      const int c3 = any ? page : 0;
#pragma unroll
      for (int b = 0; b < SM::kBoxes; ++b) {
        const uint32_t off = uint32_t(seg * SM::kSegBytes + b * SM::kBoxBytes);
        tensor_load_4d(sK + off, &p.k_map, b * SM::kBoxElems, c1, g, c3, bar);
        tensor_load_4d(sV + off, &p.v_map, b * SM::kBoxElems, c1, g, c3, bar);
      }
    }
  };

  // The pipeline of decode_unit_bulk: entries on cp.async groups, K/V on
  // the stage barriers; the barrier at the top of iteration i also ends
  // every warp's reads of the stage it refills.
  flash::cp_async_commit();
  flash::cp_async_wait<0>();
  __syncthreads();  // sQ, the entries of tiles 0 .. S-2, the barriers
#pragma unroll
  for (int j = 0; j < S - 1; ++j) {
    if (j > 0) __syncthreads();
    if (j < tiles && tid < kTileKeys) issue_kv(j);
    if (S - 1 + j < tiles) fetch_entries(S - 1 + j);
    flash::cp_async_commit();
  }

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    flash::ldsm_x4(qf[kk], smem_u32(sQ + (lane % 16) * kLdQ + kk * 16 + (lane / 16) * 8));

  const int i0 = lane / 4;
  long long qpos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = row0 + i0 + 8 * h;
    qpos[h] = rr < rows ? n - sm.q_len + rr / G : -1;
  }
  constexpr float kLog2e = 1.4426950408889634f;
  const float scale2 = p.scale * kLog2e;

  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  // ldmatrix lanes: lane l addresses row l % 8 of matrix l / 8. K (S = Q
  // K^T): matrix mi is n-tile mi / 2 (segment 2w + mi / 2), d half mi % 2;
  // V (P V, transposed): keys of segment 2w + mi % 2, d half mi / 2. Chunk
  // 2 * (kk % 4) + half of box kk / 4 sits at chunk (2 * (kk % 4)) ^ (half ^
  // row) of the row (the half is the chunk's low bit).
  const int r8 = lane % 8, mi = lane / 8;
  const uint32_t k_row = uint32_t((2 * warp + mi / 2) * SM::kSegBytes + r8 * 128);
  const uint32_t k_xor = uint32_t((mi % 2) ^ r8);
  const uint32_t v_row = uint32_t((2 * warp + mi % 2) * SM::kSegBytes + r8 * 128);
  const uint32_t v_xor = uint32_t((mi / 2) ^ r8);

  for (int tile = 0; tile < tiles; ++tile) {
    const int st = (base + tile) % S;
    flash::cp_async_wait<S - 2>();
    mbar_wait(smem_u32(sBar + st), uint32_t((base + tile) / S) & 1u);
    __syncthreads();
    if (tile + S - 1 < tiles && tid < kTileKeys) issue_kv(tile + S - 1);
    if (tile + 2 * S - 2 < tiles) fetch_entries(tile + 2 * S - 2);
    flash::cp_async_commit();

    const uint32_t sK = sKV + uint32_t(st * 2 * SM::kTileBytes);
    const uint32_t sV = sK + SM::kTileBytes;
    const int* pos = sPos + st * kTileKeys + 16 * warp;  // this warp's 16 keys

    // A segment of this warp with some keys and some empty slots (the
    // sequence's end): zero its empty V rows (whole rows: the swizzle only
    // permutes a row's chunks) before the warp reads them.
    {
      const uint32_t empty = __ballot_sync(0xffffffffu, lane < 16 && pos[lane % 16] < 0);
      uint32_t fix = 0;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t e8 = (empty >> (8 * nt)) & 0xffu;
        if (e8 != 0 && e8 != 0xffu) fix |= e8 << (8 * nt);
      }
      if (fix != 0) {
#pragma unroll 1
        for (int idx = lane; idx < 16 * kChunks; idx += 32) {
          const int k = idx / kChunks, c = idx % kChunks;
          if ((fix >> k) & 1u) {
            const uint32_t a = sV + uint32_t((2 * warp + k / 8) * SM::kSegBytes +
                                             (c / 8) * SM::kBoxBytes + (k % 8) * 128 + (c % 8) * 16);
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0u) : "memory");
          }
        }
        // Generic writes before the next copies into this stage (after the
        // barrier that ends this tile's reads).
        flash::fence_proxy_async_shared();
        __syncwarp();
      }
    }

    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t b[4];
      flash::ldsm_x4(b, sK + k_row + uint32_t((kk / 4) * SM::kBoxBytes) +
                            (((2u * uint32_t(kk % 4)) ^ k_xor) << 4));
      flash::mma_16816<T>(s[0], qf[kk], b[0], b[1]);
      flash::mma_16816<T>(s[1], qf[kk], b[2], b[3]);
    }
    uint32_t a[4];
    online_softmax_step<T, D>(s, [&](int nt, int c) { return pos[nt * 8 + c]; }, qpos, p, scale2,
                              m, l, acc, a);
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      uint32_t b[4];
      flash::ldsm_x4_trans(b, sV + v_row + uint32_t((dn / 4) * SM::kBoxBytes) +
                                  (((2u * uint32_t(dn % 4)) ^ v_xor) << 4));
      flash::mma_16816<T>(acc[2 * dn], a, b[0], b[1]);
      flash::mma_16816<T>(acc[2 * dn + 1], a, b[2], b[3]);
    }
  }
  flash::cp_async_wait<0>();
  __syncthreads();  // every warp's last reads of the K/V area, now the merge area

  merge_and_store<T, D>(smem, p, u, sm, g, row0, rows, m, l, acc);
  // The merge's generic writes to the K/V area before a next unit's copies.
  flash::fence_proxy_async_shared();
}

// Grid and block as paged_decode_kernel; p is a grid constant because the
// copies address its tensor maps.
template <class T, int D, int S, bool kBalanced>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 4 : 3)
    paged_decode_tensor_kernel(const __grid_constant__ DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using SM = TensorSmem<D, S>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem =
      smem_raw + ((SM::kAlign - (flash::smem_u32(smem_raw) & (SM::kAlign - 1))) & (SM::kAlign - 1));
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM::kKvBytes + SM::kPosBytes +
                                               SM::kEntryBytes + SM::kQBytes);  // [S]
  launch_dependents();
  // One arrival per segment (its copying thread) and phase.
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(flash::smem_u32(sBar + s), SM::kSegs);
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.k_map)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.v_map)) : "memory");
  }
  mbar_init_fence();
  int tile_base = 0;
  for_each_unit<kBalanced>(
      p, [&](const WorkUnit& u) { decode_unit_tensor<T, D, S>(p, u, smem, tile_base); });
#else
  __trap();  // the host launches this kernel only on devices it was built for
#endif
}

}  // namespace attn::decode
