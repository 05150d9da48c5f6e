// Paged decode on sm_90 with tensor copies: the unit loop of the bulk-copy
// kernel (decode_unit_mbar, paged_decode_sm90.cuh) with the copy policy
// TensorCopy: each 8-slot segment of K and V moved by cp.async.bulk.tensor
// through a tensor map over the pool, 128-byte swizzled.
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

using flash::tensor_load_4d;

// The tensor-copy layout: per segment D / 64 swizzled boxes of 8 rows x
// 128 bytes (1024-byte aligned: the base aligned up to 1024).
template <int D>
struct TensorBoxes {
  static constexpr int kBoxElems = 64;  // 128 bytes, the swizzle's span
  static_assert(D % kBoxElems == 0, "whole boxes per row");
  static constexpr int kBoxes = D / kBoxElems;
  static constexpr int kBoxBytes = 8 * kBoxElems * 2;  // 1024
  static constexpr int kSegBytes = kBoxes * kBoxBytes;
};
template <int D, int S>
struct TensorSmem : MbarSmem<D, S, 8 * TensorBoxes<D>::kSegBytes, 1024>, TensorBoxes<D> {};

template <class T, int D, int S>
struct TensorCopy {
  using SM = TensorSmem<D, S>;
  static constexpr int kArrivals = SM::kSegs;  // per barrier phase: each segment's copying thread

  __device__ static void prefetch(const DecodeParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.k_map)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.v_map)) : "memory");
#endif
  }

  // Thread tid < kTileKeys (whole warps: the ballot) records tile key tid's
  // position; the first thread of each segment copies it (8 slots from a
  // multiple of 8 lie in one page: page size % 8 == 0, and a unit starts at
  // a page).
  __device__ static void issue(const DecodeParams& p, const UnitInfo& ui, const TileIssue& t) {
    const int key = threadIdx.x, lane = key % 32, seg = key / 8, row = key % 8;
    const SlotKey sk = slot_key(ui, t, key);
    t.pos[key] = sk.valid ? sk.pos : -1;
    // Positions grow along a segment: when any of its slots holds a key,
    // its first does.
    const bool any = (__ballot_sync(0xffffffffu, sk.valid) >> (lane & 24)) & 0xffu;
    if (row == 0) {
      mbar_arrive_expect_tx(t.bar, 2 * SM::kSegBytes);
      const int c1 = any ? int(sk.in_page) : -SM::kSegRows;  // no key: zeros
      const int c3 = any ? int(sk.page) : 0;
#pragma unroll
      for (int b = 0; b < SM::kBoxes; ++b) {
        const uint32_t off = uint32_t(seg * SM::kSegBytes + b * SM::kBoxBytes);
        tensor_load_4d(t.k + off, &p.k_map, b * SM::kBoxElems, c1, ui.g, c3, t.bar);
        tensor_load_4d(t.v + off, &p.v_map, b * SM::kBoxElems, c1, ui.g, c3, t.bar);
      }
    }
  }

  // ldmatrix lanes: lane l addresses row l % 8 of matrix l / 8. K (S = Q
  // K^T): matrix mi is n-tile mi / 2 (segment 2w + mi / 2), d half mi % 2;
  // V (P V, transposed): keys of segment 2w + mi % 2, d half mi / 2. Chunk
  // 2 * (kk % 4) + half of box kk / 4 sits at chunk (2 * (kk % 4)) ^ (half ^
  // row) of the row (the half is the chunk's low bit).
  struct Reader {
    uint32_t k_row, k_xor, v_row, v_xor;
    int key0;  // 16 w: the warp's first key
    __device__ Reader(int w, int l)
        : k_row(uint32_t((2 * w + (l / 8) / 2) * SM::kSegBytes + (l % 8) * 128)),
          k_xor(uint32_t(((l / 8) % 2) ^ (l % 8))),
          v_row(uint32_t((2 * w + (l / 8) % 2) * SM::kSegBytes + (l % 8) * 128)),
          v_xor(uint32_t(((l / 8) / 2) ^ (l % 8))),
          key0(16 * w) {}
    __device__ uint32_t k(uint32_t sK, int kk) const {
      return sK + k_row + uint32_t((kk / 4) * SM::kBoxBytes) + (((2u * uint32_t(kk % 4)) ^ k_xor) << 4);
    }
    __device__ uint32_t v(uint32_t sV, int dn) const {
      return sV + v_row + uint32_t((dn / 4) * SM::kBoxBytes) + (((2u * uint32_t(dn % 4)) ^ v_xor) << 4);
    }
    // Tile key of column c of this warp's n-tile nt: segment 2w + nt, row c.
    __device__ int key(int nt, int c) const { return key0 + nt * 8 + c; }
    // A segment of this warp with some keys and some empty slots (the
    // sequence's end): zero its empty V rows (whole rows: the swizzle only
    // permutes a row's chunks) before the warp reads them. pos: the stage's
    // key positions.
    __device__ void prepare(uint32_t sV, const int* pos) const {
      const int lane = threadIdx.x % 32;
      const uint32_t empty = __ballot_sync(0xffffffffu, lane < 16 && pos[key0 + lane % 16] < 0);
      uint32_t fix = 0;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t e8 = (empty >> (8 * nt)) & 0xffu;
        if (e8 != 0 && e8 != 0xffu) fix |= e8 << (8 * nt);
      }
      if (fix == 0) return;
      constexpr int kChunks = D / 8;
#pragma unroll 1
      for (int idx = lane; idx < 16 * kChunks; idx += 32) {
        const int k = idx / kChunks, c = idx % kChunks;
        if ((fix >> k) & 1u) {
          const uint32_t a = sV + uint32_t((key0 / 8 + k / 8) * SM::kSegBytes +
                                           (c / 8) * SM::kBoxBytes + (k % 8) * 128 + (c % 8) * 16);
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0u) : "memory");
        }
      }
      // Generic writes before the next copies into this stage (after the
      // barrier that ends this tile's reads).
      flash::fence_proxy_async_shared();
      __syncwarp();
    }
  };
};

}  // namespace attn::decode
