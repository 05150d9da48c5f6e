// The dense backward kernels' interface: launch parameters and tile
// configurations per head dimension. Plain C++ (no CUDA syntax) so that the
// host side in src/cuda fills it with an ordinary C++ compiler.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moba/moba_params.cuh"
#include "sparse/tile_lists.cuh"

namespace attn::flash {

// Element (b, s, h, c) of tensor X lives at X + base(b) + s * x_seq + h * x_head + c,
// base(b) = cu ? cu[b] * x_seq : b * x_batch (cu_q for Q, O, dO, dQ; cu_kv for
// K, V, dK, dV). Strides are in elements and multiples of 8.
struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* d_o;
  const float* lse;  // row (b, h, s) at lse_base(b) + h * lse_head + s
  void* dq;
  void* dk;
  void* dv;
  // Workspace. delta: D = rowsum(dO * O), laid out as LSE; lse2: LSE in
  // base 2 (LSE * log2(e), +inf for rows that saw nothing), likewise.
  // dq_accum: fp32 [token][heads_q][D] (token = cu_q[b] + s, or
  // b * seqlen_q + s), null for deterministic plans, whose dQ comes from a
  // separate kernel.
  float* delta;
  float* lse2;
  float* dq_accum;
  // Split groups (group_splits > 1): fp32 dK (unscaled) and dV
  // [token][heads_kv][D], zeroed before the dK/dV kernel adds each block's
  // share into them; a convert kernel then writes dK and dV. Block-sparse
  // plans with cut lists and whole groups: the same for the cut KV tiles
  // only, [batch][heads_kv][sparse_kv.max_cut][block_n][D] (slots per
  // TileLists::cut_tiles). Null otherwise.
  float* dk_accum;
  float* dv_accum;
  int64_t q_batch, q_seq, q_head;
  int64_t k_batch, k_seq, k_head;
  int64_t v_batch, v_seq, v_head;
  int64_t o_batch, o_seq, o_head;
  int64_t do_batch, do_seq, do_head;
  int64_t dq_batch, dq_seq, dq_head;
  int64_t dk_batch, dk_seq, dk_head;
  int64_t dv_batch, dv_seq, dv_head;
  int64_t lse_batch, lse_head;  // lse_base(b) = cu_q ? cu_q[b] : b * lse_batch
  const int32_t* cu_q;          // batch + 1 token offsets in device memory; null: fixed length
  const int32_t* cu_kv;
  int32_t seqlen_q, seqlen_kv;  // per sequence, fixed-length batches only
  int32_t heads_q;
  int32_t group;  // heads_q / heads_kv
  // The query heads of a group are shared by group_splits dK/dV blocks per
  // KV tile (group / group_splits heads each), whose dK and dV partial sums
  // meet in dk_accum, dv_accum: without it, the blocks of a GQA backward
  // are group times longer and too few to balance a causal mask.
  int32_t group_splits;
  // Query i sees key j when i + off - left <= j <= i + off + right, off = lk - lq
  // (+ diag_shift[b]); a negative bound is unbounded.
  int32_t window_left, window_right;
  // Per sequence in device memory, null: 0. Ring steps run a block of a
  // longer sequence as a dense problem that keeps that sequence's diagonal.
  const int32_t* diag_shift;
  float scale;       // softmax scale: dQ = scale * dS K, dK = scale * dS^T Q
  float scale_log2;  // logit -> base-2 exponent: scale * log2(e), or log2(e) with softcap
  float softcap;     // cap, 0 = off: z = cap * tanh(scale * q.k / cap)
  float softcap_in;  // 2 * log2(e) * scale / cap, so that tanh needs one exp2
  // Block-sparse plans only (the kernels' Sparse instantiations): per KV
  // tile, its query tiles (KV-major, block_n x block_m bit tiles, for the
  // dK/dV kernel); per query tile, its KV tiles (query-major, in the
  // deterministic dQ kernel's tile sizes).
  TileLists sparse_kv;
  TileLists sparse_dq;
  // MoBA plans only (the kernels' Moba instantiations): the run-time
  // schedule the selector wrote into the workspace (kv lists for the dK/dV
  // kernel, q lists for the deterministic dQ kernel).
  MobaLists moba;
};

// The dK/dV kernel (which also adds dQ into dq_accum): one block owns
// block_n keys of one KV head and loops over the query tiles (block_m rows)
// of the query heads of its group (all of them, or its share of a split
// group) that see them. Per query tile:
//   S^T = K Q^T, dP^T = V dO^T   warps s_wk (keys) x warps / s_wk (queries)
//   dV += P^T dO, dK += dS^T Q   warps kv_wk (keys) x warps / kv_wk (head dim)
//   dQ = dS K                    warps dq_wm (queries) x dq_wn (head dim)
// When one warp computes S^T for all queries of its keys and owns all of D
// for them (s_wk = kv_wk = warps), P^T and dS^T stay in the registers they
// are computed in (the "register path": the warp's 16 keys x block_m
// queries taken in `passes` passes, to bound the registers); otherwise they
// go through shared memory (larger warp tiles, fewer shared-memory reads per
// mma). Shared memory: K, V [block_n][D+8]; two stages of Q, dO
// [block_m][D+8]; dS^T (and P^T off the register path)
// [block_n][block_m+8]; two stages of LSE and D rows; with bulk_dq the dQ
// staging tile [block_m][D+8] fp32.
struct BwdConfig {
  int block_m, block_n, warps, s_wk, kv_wk, dq_wm, dq_wn, passes;
  // sm_90+: a query tile's dQ goes to a staging tile in
  // shared memory, from where one bulk reduction per row, issued by thread
  // `row`, adds it to the accumulator after the next iteration's first
  // barrier.
  bool bulk_dq = false;
  constexpr int threads() const { return warps * 32; }
  constexpr bool register_path() const { return s_wk == warps && kv_wk == warps; }
  constexpr int ld(int d) const { return d + 8; }
  constexpr int ld_s() const { return block_m + 8; }
  // The dQ staging tile's row pitch in floats: rows stay 16-byte aligned and
  // a warp's 8-byte stores of 8 rows x 4 columns take the minimum two
  // wavefronts.
  constexpr int ld_dq(int d) const { return d + 8; }
  constexpr size_t smem_bytes(int d) const {
    return size_t(2 * block_n + 4 * block_m) * size_t(ld(d)) * 2u +
           size_t(register_path() ? 1 : 2) * size_t(block_n) * size_t(ld_s()) * 2u +
           size_t(4 * block_m) * 4u + (bulk_dq ? size_t(block_m) * size_t(ld_dq(d)) * 4u : 0u);
  }
  // The first compute capability (major) the configuration runs on.
  constexpr int min_sm_major() const { return bulk_dq ? 9 : 8; }
};

// Variant 0 is the default; variant 1 (D = 64 and 128) is for devices
// before sm_90 or with less shared memory per block than variant 0 takes
// (D = 64: 184 KB, D = 128: 212 KB, both with the bulk dQ staging tile;
// sm_80: 163 KB). dK and dV of 16 keys x D take D / 2 registers per thread
// each, so the register path holds up to D = 128 and D = 256 splits D over
// two warps. At D = 64 a query tile of 128 rows, in two passes of 64,
// halves the barriers per FLOP and gives dQ 32 x 32 warp tiles: 224 TFLOP/s
// (L = 8K, full, bf16, H200); pipelining dQ into the next iteration took it
// to 234 and the bulk dQ reduction without the pipeline to 247 (4 warps x 64 keys at
// 2 blocks per SM, 218, and 32 x 32 score tiles through shared memory, 234
// with dQ pipelined, did not do better; nor did four passes of 32 queries,
// 240 registers instead of 246: 3% slower at L = 2K to 16K). At D = 128,
// 32 x 32 score tiles and 32 x 64 dK/dV tiles read 18% less shared memory
// than the register path's 16 x 64 and 16 x 128 (272 TFLOP/s against 247;
// with dQ pipelined, 268 and 249; with the bulk dQ reduction, 292).
constexpr BwdConfig bwd_config(int d, int variant = 0) {
  return d == 64    ? (variant == 0 ? BwdConfig{128, 128, 8, 8, 8, 4, 2, 2, true}
                                    : BwdConfig{128, 128, 8, 8, 8, 4, 2, 2})
         : d == 96  ? BwdConfig{64, 128, 8, 8, 8, 4, 2, 1}
         : d == 128 ? (variant == 0 ? BwdConfig{64, 128, 8, 4, 4, 2, 4, 1, true}
                                    : BwdConfig{64, 128, 8, 8, 8, 2, 4, 1})
                    : BwdConfig{32, 64, 8, 4, 4, 2, 4, 1};
}
constexpr int bwd_variants(int d) { return d == 64 || d == 128 ? 2 : 1; }

// The sm_90a (wgmma) dK/dV kernel (flash/bwd_sm90_kernel.cuh): two
// warpgroups of 64 keys each over a KV tile of block_n = 128 keys, query
// tiles of block_m rows. d = 128: block_m = 64 (dK and dV take 128
// accumulator registers per thread, S^T and dP^T 64 more); d = 64:
// block_m = 128, so that a tile's GEMMs are as long as at d = 128 and each
// warpgroup computes dQ for 64 of the rows. Shared memory (swizzled
// panels, 1024-byte aligned): K, V [block_n][d]; q_stages stages of Q, dO
// [block_m][d]; dS^T [block_n][block_m]; q_stages stages of LSE and D rows;
// the fp32 dQ staging tile [block_m][d + 8] of the bulk reductions: 180 KB
// at d = 128, 167 KB at d = 64 with two stages, one block per SM. ptxas
// (CUDA 13.0): 255 registers at d = 128, 252 at d = 64 (254 and 255
// without dQ, for deterministic plans), no spills.
// Block-sparse plans take three stages (bwd_sm90_sparse_config, 212 KB at
// d = 128, 200 KB at d = 64): their query tiles are scattered over the
// heads' rows, so that most loads come from DRAM (BigBird at 32K: an L2
// hit rate of 40% against 99% for the dense causal plan), and a tile
// loaded one iteration ahead arrived late.
struct BwdSm90Config {
  int block_m, block_n;
  int q_stages = 2;
  static constexpr int kWarpgroups = 2;
  constexpr int threads() const { return kWarpgroups * 128; }
  constexpr int ld_dq(int d) const { return d + 8; }
  constexpr size_t smem_bytes(int d) const {
    return 1024u + size_t(2 * block_n + 2 * q_stages * block_m) * size_t(d) * 2u +
           size_t(block_n) * size_t(block_m) * 2u + size_t(2 * q_stages * block_m) * 4u +
           size_t(block_m) * size_t(ld_dq(d)) * 4u;
  }
};
constexpr BwdSm90Config bwd_sm90_config(int d) {
  return d == 64 ? BwdSm90Config{128, 128} : BwdSm90Config{64, 128};
}
constexpr BwdSm90Config bwd_sm90_sparse_config(int d) {
  BwdSm90Config c = bwd_sm90_config(d);
  c.q_stages = 3;
  return c;
}

// The deterministic dQ kernel: one block per query tile of one query head,
// looping over its KV tiles like the forward (4 warps of 16 rows).
struct DqConfig {
  int block_m, block_n, warps, stages;
  constexpr int threads() const { return warps * 32; }
  constexpr size_t smem_bytes(int d) const {
    return size_t(2 * block_m + 2 * stages * block_n) * size_t(d + 8) * 2u;
  }
};

constexpr DqConfig dq_config(int d) {
  // dQ of 16 rows x D is D / 2 registers per thread: at D = 256 the score
  // tiles shrink to 32 keys to make room.
  return d <= 128 ? DqConfig{64, 64, 4, 2} : DqConfig{64, 32, 4, 2};
}

// Threads per row in the row-wise kernels (preprocess, dQ conversion): one
// 16-byte chunk each, rounded up to a power of two.
constexpr int row_threads(int d) { return d / 8 <= 8 ? 8 : d / 8 <= 16 ? 16 : 32; }
constexpr int kRowKernelThreads = 256;

}  // namespace attn::flash
