// The dense forward kernel's interface: its launch parameters and its tile
// configuration per head dimension. Plain C++ (no CUDA syntax) so that the
// host side in src/cuda fills it with an ordinary C++ compiler.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moba/moba_params.cuh"
#include "sparse/tile_lists.cuh"

namespace attn::flash {

// Element (b, s, h, c) of tensor X lives at X + base(b) + s * x_seq + h * x_head + c,
// base(b) = cu ? cu[b] * x_seq : b * x_batch (cu_q for Q and O, cu_kv for K and V).
// Strides are in elements and multiples of 8 (16-byte vector accesses).
struct FwdParams {
  const void* q;  // [.., seqlen_q, heads_q, D]
  const void* k;  // [.., seqlen_kv, heads_kv, D]
  const void* v;  // [.., seqlen_kv, heads_kv, D]
  void* o;        // [.., seqlen_q, heads_q, D]
  float* lse;     // may be null; row (b, h, s) at lse_base(b) + h * lse_head + s
  int64_t q_batch, q_seq, q_head;
  int64_t k_batch, k_seq, k_head;
  int64_t v_batch, v_seq, v_head;
  int64_t o_batch, o_seq, o_head;
  int64_t lse_batch, lse_head;  // lse_base(b) = cu_q ? cu_q[b] : b * lse_batch
  const int32_t* cu_q;          // batch + 1 token offsets in device memory; null: fixed length
  const int32_t* cu_kv;
  int32_t seqlen_q, seqlen_kv;  // per sequence, fixed-length batches only
  int32_t group;                // heads_q / heads_kv
  // Query i sees key j when i + off - left <= j <= i + off + right, off = lk - lq
  // (+ diag_shift[b]); a negative bound is unbounded.
  int32_t window_left, window_right;
  // Per sequence in device memory, null: 0. Ring steps run a block of a
  // longer sequence as a dense problem that keeps that sequence's diagonal.
  const int32_t* diag_shift;
  float scale_log2;  // logit -> base-2 exponent: scale * log2(e), or log2(e) with softcap
  float softcap;     // cap, 0 = off: z = cap * tanh(scale * q.k / cap)
  float softcap_in;  // 2 * log2(e) * scale / cap, so that tanh needs one exp2
  // Block-sparse plans only (the kernel's Sparse instantiation): per query
  // tile, its KV tiles (query-major, block_m x block_n bit tiles).
  TileLists sparse;
  // MoBA plans only (the kernel's Moba instantiation): the run-time
  // schedule the selector wrote into the workspace.
  MobaLists moba;
  // The warp-specialised forward's item order (flash/fwd_sm90_ws_kernel.cuh):
  // (sequence, head) pairs per group, query tile slowest within a group; 0
  // its own choice (one group of all, or one pair per group).
  int32_t ws_group;
};

// Tile shape per head dimension D. Rows per warp = block_m / warps: 32 when
// the output accumulator fits in registers (D <= 128), else 16. Shared
// memory holds Q [block_m][D+8] and `stages` buffers each of K and V
// [block_n][D+8]; the 8-element pad puts the 8 rows an ldmatrix reads in 8
// distinct bank groups.
struct FwdConfig {
  int block_m, block_n, warps, stages;
  constexpr int threads() const { return warps * 32; }
  constexpr int ld(int d) const { return d + 8; }
  constexpr size_t smem_bytes(int d) const {
    return size_t(block_m + 2 * stages * block_n) * size_t(ld(d)) * 2u;
  }
};

constexpr FwdConfig fwd_config(int d) {
  // block_n = 128 for d = 64 spills (S alone takes 128 registers); d = 256
  // takes one stage to stay under sm_80's 163 KB of shared memory per block.
  // With 2 blocks per SM (255 registers, <= 104 KB each) this shape ran at
  // 363 TFLOP/s (d = 128, L = 8K, bf16) on an H200 (scripts/gpu-check.sh).
  // At d = 64 (292 TFLOP/s, L = 8K full) 16 rows per warp and more warps
  // per SM did worse: 128x64 with 8 warps and 128x128 with 8 warps (60
  // bytes spilled), 2 blocks per SM each, 271 and 277; 64x64 with 4 warps
  // at 3 blocks per SM, 250.
  return d <= 128 ? FwdConfig{128, 64, 4, 2} : FwdConfig{128, 64, 8, 1};
}

// The sm_90a forward (flash/fwd_sm90_kernel.cuh): block_m = 64 query rows
// per consumer warpgroup, KV tiles of block_n keys in `stages` buffers.
// Shared memory holds Q [block_m][D] and K, V [block_n][D] per stage, in
// 128-byte swizzled panels without padding, plus 1024 bytes to align the
// first panel to the swizzle atom, then the block-sparse instantiation's
// ring of visits (kSm90VisitRing x 2 words; reserved for the dense one too:
// either runs one block per SM, on far less than the SM's shared memory).
constexpr int kSm90VisitRing = 256;
struct FwdSm90Config {
  int block_m, block_n, warpgroups, stages;
  // The warp-specialised forward (flash/fwd_sm90_ws_kernel.cuh): a producer
  // warpgroup besides the `warpgroups` consumers, two Q buffers.
  int producers = 0, q_buffers = 1;
  constexpr int threads() const { return (warpgroups + producers) * 128; }
  constexpr size_t smem_bytes(int d) const {
    return size_t(q_buffers * block_m + 2 * stages * block_n) * size_t(d) * 2u + 1024u +
           size_t(kSm90VisitRing) * 8u;
  }
};

// d = 64: three warpgroups (192 rows) so that a block keeps 12 warps busy
// at one block per SM, and 3 stages (loads two KV tiles ahead: a tile's
// GEMMs are short); d = 128: two warpgroups (the accumulators of O and S
// take 128 registers per thread), 2 stages (3 would leave no room in the
// 227 KB of shared memory).
constexpr FwdSm90Config fwd_sm90_config(int d) {
  return d == 64 ? FwdSm90Config{192, 128, 3, 3} : FwdSm90Config{128, 128, 2, 2};
}

// The shapes the sm_90a forward is built in: the one above, and at d = 64
// also 128-row query tiles (two warpgroups, 3 stages; registers allow one
// block per SM either way), which the host picks when the 192-row tiles
// would pad many rows or leave SMs idle (short or causal sequences:
// cuda/fwd_sm90_shape.hpp). block_m = 0: the first.
constexpr FwdSm90Config fwd_sm90_config(int d, int block_m) {
  return d == 64 && block_m == 128 ? FwdSm90Config{128, 128, 2, 3} : fwd_sm90_config(d);
}

// The warp-specialised forward: 128-row query tiles on two consumer
// warpgroups, one producer warpgroup (tensor copies), Q double-buffered so
// that the next work item's Q and first KV tiles land while this one ends;
// d = 128: 2 stages (2 Q + 4 KV tiles = 192 KB), d = 64: 4.
constexpr FwdSm90Config fwd_sm90_ws_config(int d) {
  return FwdSm90Config{128, 128, 2, d == 64 ? 4 : 2, 1, 2};
}

// MoBA plans run the sm_90a forward with 128-row query tiles at d = 64 and
// 128: those of the selector's q lists, which the sm_80 forward and the
// deterministic dQ kernel read too (one list per 128 rows), and a tile
// never spans more than two own blocks (a block is a multiple of 128 keys).
constexpr int kSm90MobaBlockM = 128;
static_assert(fwd_config(64).block_m == kSm90MobaBlockM &&
                  fwd_config(128).block_m == kSm90MobaBlockM &&
                  fwd_sm90_config(64, kSm90MobaBlockM).block_m == kSm90MobaBlockM &&
                  fwd_sm90_config(128, kSm90MobaBlockM).block_m == kSm90MobaBlockM,
              "MoBA: one q list tiling for every forward and dQ kernel");

}  // namespace attn::flash
