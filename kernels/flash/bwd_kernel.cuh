// FlashAttention-2 backward on tensor cores (sm_80+: mma.sync m16n8k16,
// ldmatrix, cp.async). Three or four launches per backward:
//
//   preprocess   D = rowsum(dO * O) and LSE in base 2, fp32 (laid out as
//                LSE), and, unless deterministic, zeroes the fp32 dQ
//                accumulator
//   dK/dV        one block per (KV tile, KV head, sequence); loops over the
//                query tiles of every query head of the group that see its
//                keys (the transposed schedule); dK, dV stay in registers and
//                dQ contributions are added into the accumulator with
//                atomics, or (bulk_dq, sm_90) with bulk reductions from a
//                shared-memory staging tile (deterministic plans skip that
//                part). A split group
//                (group_splits > 1, not deterministic) has group_splits
//                blocks per (KV tile, KV head), each over its share of the
//                query heads, adding dK and dV into fp32 accumulators too;
//                so do a block-sparse plan's work items of cut lists, in
//                slots of their tiles only
//   convert      dQ = scale * accumulator, in the dtype with dQ's strides;
//                split groups and cut lists also dK, dV from theirs
//   dQ (deterministic plans, instead of the atomics and convert): one block
//                per (query tile, query head, sequence) loops over its KV
//                tiles like the forward and writes dQ once
//
// The dK/dV kernel computes the transposed scores S^T = K Q^T and
// dP^T = V dO^T of a query tile, so that P^T and dS^T come out in the C
// fragments of the mma. On the "register path" (bwd_config) a warp owns 16
// keys, all queries and all of D: repacked, those fragments are directly the
// A operands of dV += P^T dO and dK += dS^T Q. Otherwise (D = 128 on large
// devices, D = 256) P^T and dS^T go through shared memory, so that score
// tiles and dK/dV tiles can be laid out independently (32 x 32 and 32 x 64
// warp tiles at D = 128, which read less shared memory per mma). dS^T is
// stored to shared memory in both cases, from where dQ = dS K is computed
// by all warps after a second barrier. (Pipelining dQ into the next
// iteration, with dS^T double-buffered and one barrier per iteration, was
// the d = 64 default until the bulk dQ reduction beat it: bwd_params.cuh.)
//
// Probabilities are recomputed from LSE: P = 2^(z log2(e) - LSE log2(e)),
// z the (softcapped) logit; dS = P (dP - D), times dz/du = 1 - (z/cap)^2
// with softcap; dQ = scale dS K, dK = scale dS^T Q. Masked pairs get P = 0
// by selection, so rows that saw nothing (LSE = -inf) contribute exactly 0.
// The mask arithmetic is that of src/schedule/dense_schedule.hpp (row_lo,
// row_hi, q_tiles_of, is_full), redone here because device code does not
// include host headers. Block-sparse plans (Sparse) take each KV tile's
// query tiles from a list instead (p.sparse_kv), each marked full,
// dense-masked, or masked by a precomputed bit tile (and may run the body
// in flash_bwd_dkdv_bsparse_persistent_kernel, over work dealt at plan
// creation). MoBA plans (Moba) take
// them from the list the selector wrote for the tile's block (p.moba), and
// mask a query row that did not select the block by its selection bit; or,
// in flash_bwd_dkdv_moba_gather_kernel (the body's Gather), walk tiles of
// BM of the rows that selected the block (loaded by index, dQ added at
// each row's index), with no selection bit:
// the list starts with the rows whose own block it is, contiguous, so that
// a tile's causal mask is that of query rows numbered from the first row
// of that block on, and the later rows, which see the whole block, are
// numbered past that block's rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "flash/bwd_params.cuh"
#include "flash/sm80.cuh"
#include "sparse/prefetch.cuh"

namespace attn::flash {

template <int D, int V = 0>
struct BwdTraits {
  static constexpr BwdConfig kCfg = bwd_config(D, V);
  static constexpr int kBM = kCfg.block_m;
  static constexpr int kBN = kCfg.block_n;
  static constexpr int kWarps = kCfg.warps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr bool kRegPath = kCfg.register_path();
  // S^T phase: warps kSWK (keys) x kSWQ (queries), tiles of kKS keys (kMS
  // m-tiles) x kQC queries.
  static constexpr int kSWK = kCfg.s_wk, kSWQ = kWarps / kSWK;
  static constexpr int kKS = kBN / kSWK, kMS = kKS / 16, kQC = kBM / kSWQ;
  // dK/dV phase: warps kVWK (keys) x kVWD (head dim), tiles of kKK keys
  // (kMK m-tiles) x kDC columns.
  static constexpr int kVWK = kCfg.kv_wk, kVWD = kWarps / kVWK;
  static constexpr int kKK = kBN / kVWK, kMK = kKK / 16, kDC = D / kVWD;
  static constexpr int kDqRows = kBM / kCfg.dq_wm, kDqCols = D / kCfg.dq_wn;
  static constexpr int kLd = D + 8;              // Q, dO, K, V rows (elements)
  static constexpr int kLdS = kCfg.block_m + 8;  // P^T, dS^T rows (elements)
  // Byte offsets in shared memory.
  static constexpr uint32_t kTileKV = uint32_t(kBN * kLd * 2), kTileQ = uint32_t(kBM * kLd * 2);
  static constexpr uint32_t kOffK = 0, kOffV = kTileKV, kOffQ = 2 * kTileKV;
  static constexpr uint32_t kOffDo = kOffQ + 2 * kTileQ;
  static constexpr uint32_t kOffDs = kOffDo + 2 * kTileQ;
  static constexpr uint32_t kTileS = uint32_t(kBN * kLdS * 2);
  // P^T off the register path.
  static constexpr uint32_t kOffP = kOffDs + kTileS;
  static constexpr uint32_t kOffStat = kOffP + (kRegPath ? 0u : kTileS);
  // The dQ staging tile [kBM][kLdDq] fp32 (bulk_dq).
  static constexpr bool kBulk = kCfg.bulk_dq;
  static constexpr int kLdDq = kCfg.ld_dq(D);
  static constexpr uint32_t kOffStage = kOffStat + uint32_t(4 * kBM * 4);
  static_assert(!kBulk || kThreads >= kBM, "bulk dQ: one issuing thread per row");
  static_assert(kOffStage + (kBulk ? uint32_t(kBM * kLdDq * 4) : 0u) == kCfg.smem_bytes(D),
                "layout = config");
  static_assert(kSWK * kKS == kBN && kKS % 16 == 0 && kVWK * kKK == kBN && kKK % 16 == 0 &&
                    kCfg.dq_wm * kCfg.dq_wn == kWarps && kWarps % kSWK == 0 &&
                    kWarps % kVWK == 0,
                "warp grids");
  static_assert(!kRegPath || kMS == 1, "register path: 16 keys per warp");
  static_assert(D % 16 == 0 && kQC % 16 == 0 && kDC % 16 == 0 && kDqRows % 16 == 0 &&
                    kDqCols % 16 == 0,
                "whole mma tiles");
  static_assert(2 * kBM <= kThreads, "one thread per row statistic");
};

template <int D>
struct RowTraits {
  static constexpr int kTpr = row_threads(D);  // threads per row
};

template <int D>
struct DqTraits {
  static constexpr DqConfig kCfg = dq_config(D);
  static constexpr int kThreads = kCfg.warps * 32;
};

constexpr float kBwdLog2e = 1.4426950408889634f;

// Two 16-bit values of T (low half first) as floats.
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t x);
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t x) {
  __half2 h;
  memcpy(&h, &x, 4);
  return __half22float2(h);
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t x) {
  __nv_bfloat162 h;
  memcpy(&h, &x, 4);
  return __bfloat1622float2(h);
}

// Base-2 LSE of a row; a row that saw nothing (LSE = -inf) gets +inf, so
// that 2^(z - lse2) = 0 even before the mask is applied.
__device__ __forceinline__ float lse_to_log2(float l) {
  return l == -INFINITY ? INFINITY : l * kBwdLog2e;
}

// The visible query columns of one key row (or keys of one query row) form
// an interval; `col` is inside when (unsigned)(col - lo) <= span. An empty
// interval is lo = 2^29, span = 0.
struct Interval {
  int lo, span;
  __device__ __forceinline__ static Interval of(int lo, int hi) {
    return hi >= lo ? Interval{lo, hi - lo} : Interval{1 << 29, 0};
  }
  __device__ __forceinline__ bool outside(int col) const {
    return unsigned(col - lo) > unsigned(span);
  }
};

// Element offsets of the (token, head) row `row` = token * heads_q + head of
// a query-side tensor with strides (batch, seq, head), and of its LSE entry.
struct RowAddr {
  int64_t elem;  // in the tensor
  int64_t stat;  // in LSE / D
};
__device__ __forceinline__ RowAddr row_addr(const BwdParams& p, int64_t row, int64_t sb,
                                            int64_t ss, int64_t sh) {
  const int64_t tok = row / p.heads_q;
  const int h = int(row - tok * p.heads_q);
  if (p.cu_q != nullptr) return {tok * ss + h * sh, tok + h * p.lse_head};
  const int64_t b = tok / p.seqlen_q, s = tok - b * p.seqlen_q;
  return {b * sb + s * ss + h * sh, b * p.lse_batch + h * p.lse_head + s};
}

// D = rowsum(dO * O) and the base-2 LSE for every (token, head) row, and
// zeros in the dQ accumulator. row_threads(D) threads per row, one 16-byte
// chunk each.
template <class T, int D>
__global__ void __launch_bounds__(kRowKernelThreads)
    flash_bwd_preprocess_kernel(const __grid_constant__ BwdParams p, int64_t n_rows) {
  constexpr int TPR = RowTraits<D>::kTpr, CH = D / 8;
  const int tid = threadIdx.x, ch = tid % TPR;
  const int64_t row = int64_t(blockIdx.x) * (kRowKernelThreads / TPR) + tid / TPR;
  const bool valid = row < n_rows;
  float sum = 0.0f;
  RowAddr a{0, 0};
  if (valid) {
    a = row_addr(p, row, p.do_batch, p.do_seq, p.do_head);
    const RowAddr ao = row_addr(p, row, p.o_batch, p.o_seq, p.o_head);
    if (ch < CH) {
      const uint4 x = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.d_o) + a.elem + ch * 8);
      const uint4 y = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + ao.elem + ch * 8);
      const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 u = unpack2<T>(xs[i]), w = unpack2<T>(ys[i]);
        sum = fmaf(u.x, w.x, sum);
        sum = fmaf(u.y, w.y, sum);
      }
    }
  }
#pragma unroll
  for (int m = TPR / 2; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if (!valid) return;
  if (ch == 0) {
    p.delta[a.stat] = sum;
    p.lse2[a.stat] = lse_to_log2(p.lse[a.stat]);
  }
  if (p.dq_accum != nullptr && ch < CH) {
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + row * D + ch * 8);
    acc[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    acc[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// Eight fp32 accumulator values times s, rounded to T, to dst (16 bytes).
template <class T>
__device__ __forceinline__ void store_scaled8(const float* acc, float s, T* dst) {
  const float4 x = reinterpret_cast<const float4*>(acc)[0];
  const float4 y = reinterpret_cast<const float4*>(acc)[1];
  uint4 out;
  out.x = pack2<T>(x.x * s, x.y * s);
  out.y = pack2<T>(x.z * s, x.w * s);
  out.z = pack2<T>(y.x * s, y.y * s);
  out.w = pack2<T>(y.z * s, y.w * s);
  *reinterpret_cast<uint4*>(dst) = out;
}

// dQ = scale * accumulator, rounded to T, written with dQ's strides.
// Split groups: dK = scale * dk_accum and dV = dv_accum, rounded to T and
// written with their strides; n_rows = total_kv * heads_kv (token, head) rows.
template <class T, int D>
__global__ void __launch_bounds__(kRowKernelThreads)
    flash_bwd_convert_dkdv_kernel(const __grid_constant__ BwdParams p, int64_t n_rows) {
  constexpr int TPR = RowTraits<D>::kTpr, CH = D / 8;
  const int tid = threadIdx.x, ch = tid % TPR;
  const int64_t row = int64_t(blockIdx.x) * (kRowKernelThreads / TPR) + tid / TPR;
  if (row >= n_rows || ch >= CH) return;
  const int heads_kv = p.heads_q / p.group;
  const int64_t tok = row / heads_kv;
  const int h = int(row - tok * heads_kv);
  int64_t k_at = tok * p.dk_seq + h * p.dk_head, v_at = tok * p.dv_seq + h * p.dv_head;
  if (p.cu_kv == nullptr) {
    const int64_t b = tok / p.seqlen_kv, s = tok - b * p.seqlen_kv;
    k_at = b * p.dk_batch + s * p.dk_seq + h * p.dk_head;
    v_at = b * p.dv_batch + s * p.dv_seq + h * p.dv_head;
  }
  store_scaled8(p.dk_accum + row * D + ch * 8, p.scale, static_cast<T*>(p.dk) + k_at + ch * 8);
  store_scaled8(p.dv_accum + row * D + ch * 8, 1.0f, static_cast<T*>(p.dv) + v_at + ch * 8);
}

// Block-sparse plans with cut dK/dV lists (and whole groups): dK = scale *
// dk_accum and dV = dv_accum of the cut tiles only, from the compact
// accumulators [batch][heads_kv][max_cut][BN][D] (BN = sparse_kv.rows), slot
// c of (b, hk) holding KV tile sparse_kv.cut_tiles[mask slot * max_cut + c];
// n_rows = batch * heads_kv * max_cut * BN. Empty slots and rows past the
// sequence write nothing (the dK/dV kernel wrote no accumulator there).
template <class T, int D>
__global__ void __launch_bounds__(kRowKernelThreads)
    flash_bwd_convert_dkdv_tiles_kernel(const __grid_constant__ BwdParams p, int64_t n_rows) {
  constexpr int TPR = RowTraits<D>::kTpr, CH = D / 8;
  const int tid = threadIdx.x, ch = tid % TPR;
  const int64_t row = int64_t(blockIdx.x) * (kRowKernelThreads / TPR) + tid / TPR;
  if (row >= n_rows || ch >= CH) return;
  const TileLists& sp = p.sparse_kv;
  const int heads_kv = p.heads_q / p.group, bn = sp.rows;
  const int64_t slot_index = row / bn;  // ((b * heads_kv + hk) * max_cut + c)
  const int r = int(row - slot_index * bn);
  const int64_t pair = slot_index / sp.max_cut;
  const int c = int(slot_index - pair * sp.max_cut);
  const int b = int(pair / heads_kv), hk = int(pair - int64_t(b) * heads_kv);
  const int slot = mask_slot(sp, b, hk);
  const int tile = sp.cut_tiles[slot * sp.max_cut + c];
  if (tile < 0) return;
  const int s = tile * bn + r;
  int64_t k_at, v_at;
  if (p.cu_kv != nullptr) {
    const int64_t tok = p.cu_kv[b];
    if (s >= p.cu_kv[b + 1] - tok) return;
    k_at = (tok + s) * p.dk_seq + hk * p.dk_head;
    v_at = (tok + s) * p.dv_seq + hk * p.dv_head;
  } else {
    if (s >= p.seqlen_kv) return;
    k_at = b * p.dk_batch + s * p.dk_seq + hk * p.dk_head;
    v_at = b * p.dv_batch + s * p.dv_seq + hk * p.dv_head;
  }
  store_scaled8(p.dk_accum + row * D + ch * 8, p.scale, static_cast<T*>(p.dk) + k_at + ch * 8);
  store_scaled8(p.dv_accum + row * D + ch * 8, 1.0f, static_cast<T*>(p.dv) + v_at + ch * 8);
}

template <class T, int D>
__global__ void __launch_bounds__(kRowKernelThreads)
    flash_bwd_convert_dq_kernel(const __grid_constant__ BwdParams p, int64_t n_rows) {
  constexpr int TPR = RowTraits<D>::kTpr, CH = D / 8;
  const int tid = threadIdx.x, ch = tid % TPR;
  const int64_t row = int64_t(blockIdx.x) * (kRowKernelThreads / TPR) + tid / TPR;
  if (row >= n_rows || ch >= CH) return;
  const RowAddr a = row_addr(p, row, p.dq_batch, p.dq_seq, p.dq_head);
  const float4* acc = reinterpret_cast<const float4*>(p.dq_accum + row * D + ch * 8);
  const float4 x = acc[0], y = acc[1];
  const float s = p.scale;
  uint4 out;
  out.x = pack2<T>(x.x * s, x.y * s);
  out.y = pack2<T>(x.z * s, x.w * s);
  out.z = pack2<T>(y.x * s, y.y * s);
  out.w = pack2<T>(y.z * s, y.w * s);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + a.elem + ch * 8) = out;
}

// P and dS from the scores and dP - D accumulators of 16 rows x N columns
// (held as mma C fragments: rows g, g + 8, columns 8 nt + 2 t4 + {0, 1};
// the dP accumulators start at -D, which saves registers), in place: s
// becomes P, dp becomes dS (natural units, softcap chain rule applied).
// lse2(nt, e) gives an element's base-2 LSE. Masked elements may come out
// as anything, inf included: apply_mask() zeroes them afterwards.
template <bool CAP, int N, class Lse>
__device__ __forceinline__ void probs_and_dscores(float (&s)[N][4], float (&dp)[N][4],
                                                  const BwdParams& p, Lse&& lse2_of) {
  const float sl2 = p.scale_log2, cap = p.softcap, cin = p.softcap_in;
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float lse2 = lse2_of(nt, e);
      float z = s[nt][e], gate = 1.0f;
      if (CAP) {
        // z = cap tanh(u) and 1 - tanh^2 = q (2 - q) (softcap_logit)
        float q;
        z = softcap_logit(z * cin, cap, q);
        gate = q * (2.0f - q);
      }
      float pr = fast_exp2(fmaf(z, sl2, -lse2));
      s[nt][e] = pr;
      float ds = pr * dp[nt][e];
      if (CAP) ds *= gate;
      dp[nt][e] = ds;
    }
}

// P = dS = 0 where masked(nt, e) (by selection: the values there may be inf).
template <int N, class Masked>
__device__ __forceinline__ void apply_mask(float (&s)[N][4], float (&dp)[N][4], Masked&& masked) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (masked(nt, e)) s[nt][e] = dp[nt][e] = 0.0f;
}

// The C fragments of 16 rows x 16 k-columns (n-tiles 2kk, 2kk+1) are the A
// fragment of k-step kk.
template <class T, int N>
__device__ __forceinline__ void pack_a(uint32_t (&a)[N / 2][4], const float (&c)[N][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 2; ++kk) {
    a[kk][0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
    a[kk][1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
    a[kk][2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[kk][3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

// c[mt] += A B^T and e[mt] += A2 B2^T over k = D for M m-tiles of 16 rows
// and N n-tiles of 8: A rows at a, a2 (row-major tiles, lane address of
// the A pattern, m-tile mt at + 16 mt rows), B rows at b, b2 ([8 N][D],
// lane address of the non-transposed B pattern); row pitch LD elements.
// Both products in one loop: twice the independent accumulators.
template <class T, int D, int M, int N, int LD>
__device__ __forceinline__ void scores_t2(float (&c)[M][N][4], uint32_t a, uint32_t b,
                                          float (&e)[M][N][4], uint32_t a2, uint32_t b2) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t af[M][4], af2[M][4];
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
      ldsm_x4(af[mt], a + uint32_t((mt * 16 * LD + kk * 16) * 2));
      ldsm_x4(af2[mt], a2 + uint32_t((mt * 16 * LD + kk * 16) * 2));
    }
#pragma unroll
    for (int np = 0; np < N / 2; ++np) {
      uint32_t bf[4], bf2[4];
      ldsm_x4(bf, b + uint32_t((np * 16 * LD + kk * 16) * 2));
      ldsm_x4(bf2, b2 + uint32_t((np * 16 * LD + kk * 16) * 2));
#pragma unroll
      for (int mt = 0; mt < M; ++mt) {
        mma_16816<T>(c[mt][2 * np], af[mt], bf[0], bf[1]);
        mma_16816<T>(c[mt][2 * np + 1], af[mt], bf[2], bf[3]);
        mma_16816<T>(e[mt][2 * np], af2[mt], bf2[0], bf2[1]);
        mma_16816<T>(e[mt][2 * np + 1], af2[mt], bf2[2], bf2[3]);
      }
    }
  }
}

// Block-sparse dK/dV: into L2, the K and V tiles of the block that starts
// lin-th (< n_lin) in sequence b's launch order (sparse_kv_block; ny: the
// grid's rows, n_lin / ny its work items; see flash_bwd_dkdv_tile), if there
// is one. (The persistent kernel's dealing counts heads fastest: its plans
// have one group, TileLists::head_group = 0.)
template <class T, int D, int BN, int NTH>
__device__ __forceinline__ void prefetch_dkdv_item(const BwdParams& p, int b, int lin, int ny,
                                                   int n_lin) {
  if (lin >= n_lin) return;
  int bx, by;
  sparse_kv_block(p.sparse_kv, lin, n_lin / ny, ny, bx, by);
  const int hk = by / p.group_splits;
  const TileLists& sp = p.sparse_kv;
  const int slot = mask_slot(sp, b, hk);
  const int i0 = sp.item_offsets[slot];
  if (bx >= sp.item_offsets[slot + 1] - i0) return;
  const int c0 = sp.items[kItemWords * (i0 + bx)] * BN;
  int lk = p.seqlen_kv;
  int64_t kv_tok = 0;
  if (p.cu_kv != nullptr) {
    kv_tok = p.cu_kv[b];
    lk = p.cu_kv[b + 1] - int(kv_tok);
  }
  if (c0 >= lk) return;
  const bool varlen = p.cu_q != nullptr;
  const T* gK = static_cast<const T*>(p.k) + (varlen ? kv_tok * p.k_seq : b * p.k_batch) +
                hk * p.k_head + c0 * p.k_seq;
  const T* gV = static_cast<const T*>(p.v) + (varlen ? kv_tok * p.v_seq : b * p.v_batch) +
                hk * p.v_head + c0 * p.v_seq;
  const int rows = min(BN, lk - c0);
  prefetch_rows_l2<T, D>(gK, p.k_seq, rows, int(threadIdx.x), NTH);
  prefetch_rows_l2<T, D>(gV, p.v_seq, rows, int(threadIdx.x), NTH);
}

// MoBA's gathered rows for the dK/dV kernels: block kb's row lists of the
// query heads [h_first, h_end) of KV head hk of sequence b, walked in tiles
// of BM rows, head by head, each list from its tile skip(). (Addresses are
// rebuilt from the parameters at each use: registers are scarce.) F gives
// b(), hk(), kb(), h_end() and skip(): MobaWalkFields holds them in
// registers.
//
// skip: every list starts with the block's own rows in increasing order
// (all of them select it), and those before the KV tile's first diagonal
// (row_lo) see none of its keys; the whole tiles of them are skipped, as
// the dense kernels start at row_lo's tile (for a KV tile t tiles into its
// block those were ~t BN / BM tiles per head, all masked).
__device__ __forceinline__ int moba_walk_skip(int row_lo, int moba_row0, int bm) {
  return max(0, row_lo - moba_row0) / bm;
}
struct MobaWalkFields {
  int b_, hk_, kb_, h_end_, skip_;
  __device__ __forceinline__ int b() const { return b_; }
  __device__ __forceinline__ int hk() const { return hk_; }
  __device__ __forceinline__ int kb() const { return kb_; }
  __device__ __forceinline__ int h_end() const { return h_end_; }
  __device__ __forceinline__ int skip() const { return skip_; }
};
template <int BM, class F = MobaWalkFields>
struct MobaGatherWalk {
  const BwdParams& p;
  F f;
  // The rows of query head hh that selected the block (its slot's list),
  // and how many.
  __device__ __forceinline__ const int32_t* rows(int hh, int& count) const {
    const MobaLists& mb = p.moba;
    const int64_t slot = int64_t(f.b()) * mb.sel_heads + (mb.per_query_head ? hh : f.hk());
    const int32_t* at = mb.kv_count + slot * (mb.num_blocks + 1) + f.kb();
    const int first = at[0];
    count = at[1] - first;
    return mb.kv_tiles + slot * int64_t(mb.kv_cap) + first;
  }
  // (hh, mm) -> the next (head, tile of BM rows) with rows; from (h_first,
  // -1), the first. (Every list has more than skip() tiles: its own rows
  // reach past row_lo.)
  __device__ __forceinline__ void next(int& hh, int& mm) const {
    mm = max(mm + 1, f.skip());
    while (hh < f.h_end()) {
      int count;
      rows(hh, count);
      if (mm * BM < count) break;
      mm = f.skip();
      ++hh;
    }
  }
  // The tiles of every head from h_first.
  __device__ __forceinline__ int tiles(int h_first) const {
    int n = 0;
    for (int hh = h_first; hh < f.h_end(); ++hh) {
      int count;
      rows(hh, count);
      n += (count + BM - 1) / BM - f.skip();
    }
    return n;
  }
};

// The dK/dV kernels' body. Gather (with Moba): MoBA's gathered rows.
// Persist (with Sparse): the block `work` of the one-block-per-item grid
// (flash_bwd_dkdv_bsparse_persistent_kernel) instead of this block's.
template <class T, int D, int V, bool Sparse, bool Moba, bool Gather, bool Persist = false>
__device__ __forceinline__ void flash_bwd_dkdv_tile(const BwdParams& p, int work = 0) {
  using Tr = BwdTraits<D, V>;
  constexpr int BM = Tr::kBM, BN = Tr::kBN, NTH = Tr::kThreads, LD = Tr::kLd, LDS = Tr::kLdS;
  // Gathered rows are not consecutive: their dQ goes row by row with REDs.
  constexpr bool REG = Tr::kRegPath, BULK = Tr::kBulk && !Gather;
  constexpr int KS = Tr::kKS, MS = Tr::kMS, QC = Tr::kQC;
  constexpr int KK = Tr::kKK, MK = Tr::kMK, DC = Tr::kDC, ND = DC / 8;
  constexpr int DQR = Tr::kDqRows, DQC = Tr::kDqCols, MQ = DQR / 16, NQQ = DQC / 8;
  constexpr int kDqWn = Tr::kCfg.dq_wn;
  // S^T of the warp's keys x QC queries is computed in PASSES passes of QP
  // queries (register path); at least two at D = 128 for sm_80, whose
  // register allocation needs the room.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  constexpr int PASSES = REG && D >= 128 && Tr::kCfg.passes < 2 ? 2 : Tr::kCfg.passes;
#else
  constexpr int PASSES = Tr::kCfg.passes;
#endif
  constexpr int QP = QC / PASSES, NP = QP / 8;
  static_assert(QP % 16 == 0, "whole k-steps per pass");

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t s0 = smem_u32(smem);
  const uint32_t sK = s0 + Tr::kOffK, sV = s0 + Tr::kOffV, sQ = s0 + Tr::kOffQ,
                 sDo = s0 + Tr::kOffDo, sDs = s0 + Tr::kOffDs, sP = s0 + Tr::kOffP,
                 sStat = s0 + Tr::kOffStat;
  const float* stat = reinterpret_cast<const float*>(smem + Tr::kOffStat);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  // Warp grids (warp < kWarps, which the compiler cannot know).
  const int sk = REG ? warp : warp % Tr::kSWK, sq = REG ? 0 : warp / Tr::kSWK;  // S^T
  const int vk = REG ? warp : warp % Tr::kVWK, vd = REG ? 0 : warp / Tr::kVWK;  // dK, dV
  const int wm = warp / kDqWn, wn = warp % kDqWn;                                // dQ
  // by = hk * group_splits + part: KV head hk, query heads [h_first,
  // h_first + heads_per) of its group; bx: the KV tile. Sparse: bx is a
  // work item of the slot (a KV tile and a range of its list, longest
  // first), and blocks start in the order of their linear index, which
  // counts KV heads (and parts) fastest within groups of them: one group
  // of all, so that a few long lists (global keys, sinks) start first
  // instead of after every head before theirs, or smaller ones, so that
  // the blocks running at a time share their heads' Q, dO and dQ in L2
  // (TileLists::head_group; sparse_kv_block).
  int bx = int(blockIdx.x), by = int(blockIdx.y), b = int(blockIdx.z);
  if constexpr (Sparse) {
    int lin = bx + by * int(gridDim.x), ny = int(gridDim.y);
    if constexpr (Persist) {
      // work = b * grid_x * grid_y + lin in that grid, heads fastest.
      ny = p.sparse_kv.grid_y;
      const int per_b = p.sparse_kv.grid_x * ny;
      b = work / per_b;
      lin = work - b * per_b;
      bx = lin / ny;
      by = lin - bx * ny;
    } else {
      sparse_kv_block(p.sparse_kv, lin, int(gridDim.x), ny, bx, by);
    }
    // (Not in the configurations without bulk dQ: there its registers
    // made variant 1 at D = 128 spill.)
    if constexpr (Tr::kBulk && !Persist)
      if (p.sparse_kv.prefetch_ahead > 0)
        prefetch_dkdv_item<T, D, Tr::kBN, NTH>(p, b, lin + p.sparse_kv.prefetch_ahead, ny,
                                               int(gridDim.x) * ny);
  }
  const int hk = by / p.group_splits;
  const int heads_per = p.group / p.group_splits;
  const int h_first = hk * p.group + (by - hk * p.group_splits) * heads_per;
  // Sparse: the item's KV tile, its visits and the tile's accumulator slot
  // (-1: its list is not cut).
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

  // Visible pairs: dmin <= j - i <= dmax. The query rows that see a key of
  // the tile form [row_lo, row_hi] (dense_schedule's row_lo, row_hi).
  // Lengths are below 2^30 (checked at plan creation), so bounds clamped to
  // +-2^30 compare the same with any j - i.
  const int off = lk - lq + (p.diag_shift != nullptr ? p.diag_shift[b] : 0);
  constexpr long long kFar = 1ll << 30;
  auto clamp_far = [](long long x) { return int(x < -kFar ? -kFar : (x > kFar ? kFar : x)); };
  const int dmin = p.window_left < 0 ? int(-kFar) : clamp_far((long long)off - p.window_left);
  const int dmax = p.window_right < 0 ? int(kFar) : clamp_far((long long)off + p.window_right);
  const int row_lo = max(0, c0 - dmax);
  const int row_hi = int(min((long long)lq - 1, (long long)c0 + kv_valid - 1 - dmin));
  // Sparse: m counts the visits of the tile's list (query tile, kind) instead
  // of query tiles.
  const int32_t* visits = nullptr;
  int m_begin, n_mt;
  // MoBA: the KV tile lies in block c0 / block, whose list holds the query
  // tiles (one word each) in which some row selected it.
  int moba_kb = 0;
  if constexpr (Moba) {
    moba_kb = c0 / p.moba.block;
    const MobaLists& mb = p.moba;
    const int64_t list = (int64_t(b) * (p.heads_q / p.group) + hk) * mb.num_blocks + moba_kb;
    m_begin = 0;
    n_mt = 0;  // Gather: see moba_rows
    if constexpr (!Gather) {
      n_mt = mb.kv_count[list];
      visits = mb.kv_tiles + list * mb.kv_cap;
    }
  } else if constexpr (Sparse) {
    m_begin = 0;
    n_mt = item_end - item_begin;
    visits = p.sparse_kv.visits + 2 * int64_t(item_begin);
  } else {
    m_begin = row_lo <= row_hi ? row_lo / BM : 0;
    n_mt = row_lo <= row_hi ? row_hi / BM - m_begin + 1 : 0;
  }
  // The query tile of step m.
  auto q_tile = [&](int mm) {
    if constexpr (Moba) return visits[mm] & kMobaIndexMask;
    else return Sparse ? visits[2 * mm] : mm;
  };
  // MoBA gather: the rows of the group's heads that selected the block.
  // The query row the mask numbers the first gathered row of the block with.
  const int moba_row0 = Gather ? max(0, moba_kb * p.moba.block - off) : 0;
  const MobaGatherWalk<BM> walk{
      p, {b, hk, moba_kb, h_first + heads_per, moba_walk_skip(row_lo, moba_row0, BM)}};
  auto moba_rows = [&](int hh, int& count) { return walk.rows(hh, count); };
  auto moba_next = [&](int& hh, int& mm) { walk.next(hh, mm); };
  const int n_iter = Gather ? walk.tiles(h_first) : n_mt * heads_per;

  // Iteration it: query head h_first + it / n_mt, query tile m_begin + it % n_mt,
  // tracked by counters (no division). (Addresses are rebuilt from the
  // parameters each time: registers are scarce.)
  const int m_end = m_begin + n_mt;
  int ld_h = h_first, ld_m = m_begin;  // the next tile to load
  if constexpr (Gather) ld_m = -1, moba_next(ld_h, ld_m);
  auto load_q = [&](int it) {
    const int h = ld_h;
    if constexpr (Gather) {
      int count;
      const int32_t* idx = moba_rows(h, count) + ld_m * BM;
      const int rows = min(BM, count - ld_m * BM);
      moba_next(ld_h, ld_m);
      const uint32_t st = uint32_t(it & 1);
      const int64_t qs = opaque(p.q_seq), ds = opaque(p.do_seq);
      const T* gQb = static_cast<const T*>(p.q) + b * p.q_batch + h * p.q_head;
      const T* gDob = static_cast<const T*>(p.d_o) + b * p.do_batch + h * p.do_head;
      load_rows<BM, D, NTH>(sQ + st * Tr::kTileQ, gQb, qs, idx, rows, tid);
      load_rows<BM, D, NTH>(sDo + st * Tr::kTileQ, gDob, ds, idx, rows, tid);
      if (tid < 2 * BM) {
        const int r = tid % BM;
        const float* src = (tid < BM ? p.lse2 : p.delta) + b * p.lse_batch + h * p.lse_head;
        cp_async_4(sStat + (st * 2 * BM + tid) * 4u, r < rows ? src + idx[r] : src, r < rows);
      }
      return;
    }
    const int r0 = q_tile(ld_m) * BM;
    if (++ld_m == m_end) ld_m = m_begin, ++ld_h;
    const int rows = min(BM, lq - r0);
    const uint32_t st = uint32_t(it & 1);
    const int64_t qs = opaque(p.q_seq), ds = opaque(p.do_seq), tok = opaque(q_tok);
    const T* gQb = static_cast<const T*>(p.q) + (varlen ? tok * qs : b * p.q_batch);
    const T* gDob = static_cast<const T*>(p.d_o) + (varlen ? tok * ds : b * p.do_batch);
    const int64_t stat_base = varlen ? tok : b * p.lse_batch;
    load_tile<BM, D, NTH>(sQ + st * Tr::kTileQ, gQb + h * p.q_head + r0 * qs, qs, rows, tid);
    load_tile<BM, D, NTH>(sDo + st * Tr::kTileQ, gDob + h * p.do_head + r0 * ds, ds, rows, tid);
    if (tid < 2 * BM) {
      const int r = tid % BM;
      const float* src = (tid < BM ? p.lse2 : p.delta) + stat_base + h * p.lse_head + r0;
      cp_async_4(sStat + (st * 2 * BM + tid) * 4u, r < rows ? src + r : src, r < rows);
    }
  };

  float acc_dk[MK][ND][4], acc_dv[MK][ND][4];
#pragma unroll
  for (int mt = 0; mt < MK; ++mt)
#pragma unroll
    for (int nt = 0; nt < ND; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[mt][nt][e] = acc_dv[mt][nt][e] = 0.0f;

  if (n_iter > 0) {
    const T* gK = static_cast<const T*>(p.k) + (varlen ? kv_tok * p.k_seq : b * p.k_batch) +
                  hk * p.k_head + c0 * p.k_seq;
    const T* gV = static_cast<const T*>(p.v) + (varlen ? kv_tok * p.v_seq : b * p.v_batch) +
                  hk * p.v_head + c0 * p.v_seq;
    load_tile<BN, D, NTH>(sK, gK, p.k_seq, kv_valid, tid);
    load_tile<BN, D, NTH>(sV, gV, p.v_seq, kv_valid, tid);
    load_q(0);
  }
  cp_async_commit();

  // Per-lane ldmatrix byte offsets.
  //  A, row-major [row][col] (K, V rows of the S^T tile; P^T, dS^T rows of
  //    the dK/dV tile): lanes 0-15 rows 0-15 at column 0, lanes 16-31 rows
  //    0-15 at column 8.
  //  B from [n][k] storage (Q, dO for S^T, dP^T): matrices (n 0-7, k 0-7),
  //    (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
  //  B from [k][n] storage, transposed (dO, Q for dV, dK; K for dQ): lanes
  //    0-15 rows 0-15 at column 0, lanes 16-31 at column 8.
  //  A from [k][m] storage, transposed (dS for dQ, stored as dS^T): matrices
  //    (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15).
  const uint32_t a_kv = uint32_t(((sk * KS + (lane & 15)) * LD + (lane >> 4) * 8) * 2);
  const uint32_t a_ps = uint32_t(((vk * KK + (lane & 15)) * LDS + (lane >> 4) * 8) * 2);
  const uint32_t b_nk = uint32_t((((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8) * 2);
  const uint32_t b_kn = uint32_t(((lane & 15) * LD + (lane >> 4) * 8 + vd * DC) * 2);
  const uint32_t a_dq =
      uint32_t((((lane & 7) + (lane >> 4) * 8) * LDS + ((lane >> 3) & 1) * 8 + wm * DQR) * 2);
  const uint32_t b_dq = uint32_t(((lane & 15) * LD + (lane >> 4) * 8 + wn * DQC) * 2);
  const bool accum = p.dq_accum != nullptr;
  const bool capped = p.softcap > 0.0f;
  int h = h_first, m = m_begin;  // the tile of this iteration
  if constexpr (Gather) m = -1, moba_next(h, m);
  // dQ (BM x D) += dS K for the query tile at row tr0 (trows valid) of head
  // th, dS^T at ds_buf: warp (wm, wn) owns DQR rows x DQC columns.
  // Gather: tidx, the tile's row indices (else null, rows from tr0).
  auto dq_tile = [&](uint32_t ds_buf, int tr0, int trows, int th, const int32_t* tidx) {
    float dq[MQ][NQQ][4];
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int nt = 0; nt < NQQ; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[mt][nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MQ][4];
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
        ldsm_x4_trans(a[mt], ds_buf + a_dq + uint32_t((kk * 16 * LDS + mt * 16) * 2));
#pragma unroll
      for (int np = 0; np < NQQ / 2; ++np) {
        uint32_t bk[4];
        ldsm_x4_trans(bk, sK + b_dq + uint32_t((kk * 16 * LD + np * 16) * 2));
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt) {
          mma_16816<T>(dq[mt][2 * np], a[mt], bk[0], bk[1]);
          mma_16816<T>(dq[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }
    if constexpr (BULK) {
      // To the staging tile; bulk_issue adds it to the accumulator. (The
      // tile's rows past trows hold zeros from dS^T's masked rows.)
      float* stage = reinterpret_cast<float*>(smem + Tr::kOffStage);
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float* dst = stage + (wm * DQR + mt * 16 + hh * 8 + g) * Tr::kLdDq + wn * DQC + 2 * t4;
#pragma unroll
          for (int nt = 0; nt < NQQ; ++nt)
            *reinterpret_cast<float2*>(dst + nt * 8) =
                make_float2(dq[mt][nt][2 * hh], dq[mt][nt][2 * hh + 1]);
        }
      fence_proxy_async_shared();  // visible to the bulk copies after the next barrier
      (void)trows, (void)th, (void)tr0;
      return;
    }
    // Nsight Compute puts 13-15% of this kernel's stall samples (long
    // scoreboard) on the address computation right after each row's
    // reductions, which rewrites the registers they read (the REDs hold
    // them until the LSU takes them): bulk_dq avoids that where it can.
    // Computing every row's address first, in registers of its own, did
    // not change the time (d = 64 and 128, H200) and spilled in variant 1
    // at d = 128.
    const int64_t acc_row = opaque(int64_t(p.heads_q) * D);
    // Adds the warp's rows of dQ (those < trows) into the accumulator, tile
    // row `row` at acc + at(row) * acc_row.
    auto red_rows = [&](float* acc, auto&& at) {
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = wm * DQR + mt * 16 + hh * 8 + g;
          if (row < trows) {
            float* dst = acc + at(row) * acc_row;
#pragma unroll
            for (int nt = 0; nt < NQQ; ++nt)
              red_add_f32x2(dst + nt * 8, dq[mt][nt][2 * hh], dq[mt][nt][2 * hh + 1]);
          }
        }
    };
    if constexpr (Gather) {
      red_rows(p.dq_accum + (opaque(q_tok) * p.heads_q + th) * D + wn * DQC + 2 * t4,
               [&](int row) { return tidx[row]; });
      return;
    }
    red_rows(p.dq_accum + ((opaque(q_tok) + tr0) * p.heads_q + th) * D + wn * DQC + 2 * t4,
             [](int row) { return row; });
  };

  // BULK: the staged dQ of the previous iteration's tile, one bulk
  // reduction per valid row, issued by thread `row` (the staging writes are
  // behind a fence and a barrier). The thread waits for the read before the
  // barrier that lets the tile be staged again.
  auto bulk_issue = [&](int it) {
    const bool first = m == m_begin;
    const int pm = first ? m_end - 1 : m - 1, ph = first ? h - 1 : h;
    const int pr0 = q_tile(pm) * BM;
    if (tid < min(BM, lq - pr0)) {
      float* dst = p.dq_accum + ((opaque(q_tok) + pr0 + tid) * p.heads_q + ph) * D;
      bulk_reduce_add_f32(dst, s0 + Tr::kOffStage + uint32_t(tid * Tr::kLdDq * 4), D * 4);
      bulk_commit();
    }
    (void)it;
  };

#pragma unroll 1
  for (int it = 0; it < n_iter; ++it) {
    cp_async_wait<0>();
    __syncthreads();  // tile `it` landed; iteration it-1 is done with the other stage and dS^T
    if (it + 1 < n_iter) load_q(it + 1);
    cp_async_commit();
    if (BULK && accum && it > 0) bulk_issue(it);

    int r0, rows;
    const int32_t* tile_idx = nullptr;  // MoBA gather: the tile's row indices
    if constexpr (Gather) {
      int count;
      tile_idx = moba_rows(h, count) + m * BM;
      r0 = moba_row0 + m * BM;
      rows = min(BM, count - m * BM);
    } else {
      r0 = q_tile(m) * BM;
      rows = min(BM, lq - r0);
    }
    const uint32_t st = uint32_t(it & 1);
    const uint32_t q_st = sQ + st * Tr::kTileQ, do_st = sDo + st * Tr::kTileQ;
    const float* lse_s = stat + st * 2 * BM;
    const float* del_s = lse_s + BM;

    // Mask: key jl (local) sees query il (local) when
    // jl - hi_rel <= il <= jl - lo_rel and jl < kv_valid.
    const int r1 = r0 + rows - 1;
    bool full;
    int kind = kVisitDense;
    if constexpr (Sparse) {
      kind = visits[2 * m + 1];
      full = kind == kVisitFull;
    } else {
      full = c0 + BN <= lk && c0 - r1 >= dmin && c0 + BN - 1 - r0 <= dmax;
      if constexpr (Moba && !Gather) full = full && (visits[m] & kMobaAllRows) != 0;
    }
    // MoBA: the column of the block's selection bits of this head's slot.
    const uint64_t* moba_sel = nullptr;
    if constexpr (Moba) {
      const MobaLists& mb = p.moba;
      const int64_t slot = int64_t(b) * mb.sel_heads + (mb.per_query_head ? h : hk);
      moba_sel = mb.selected + (slot * mb.num_blocks + moba_kb) * int64_t((p.seqlen_q + 63) / 64);
    }
    auto clampi = [](long long x) {
      return int(x < -(BM + 1) ? -(BM + 1) : (x > BN + 1 ? BN + 1 : x));
    };
    const int lo_rel = clampi((long long)dmin - (c0 - r0));
    const int hi_rel = clampi((long long)dmax - (c0 - r0));

    // dK += dS^T Q for the NP / 2 k-steps of queries from q0 (register path).
    auto dk_step = [&](const uint32_t (&da)[NP / 2][4], int q0) {
#pragma unroll
      for (int kk = 0; kk < NP / 2; ++kk)
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {
          uint32_t bq[4];
          ldsm_x4_trans(bq, q_st + b_kn + uint32_t(((q0 + kk * 16) * LD + np * 16) * 2));
          mma_16816<T>(acc_dk[0][2 * np], da[kk], bq[0], bq[1]);
          mma_16816<T>(acc_dk[0][2 * np + 1], da[kk], bq[2], bq[3]);
        }
    };
    // The last pass's dS^T, kept for dK after the barrier, where dK runs next
    // to dQ = dS K (more independent mma there).
    uint32_t da_last[NP / 2][4];

    // The S^T tile: keys sk * KS + [0, KS), queries sq * QC + [0, QC) in
    // PASSES passes of QP.
#pragma unroll
    for (int ps = 0; ps < PASSES; ++ps) {
      const int q0 = sq * QC + ps * QP;  // first query (local) of the pass
      // S^T = K Q^T and dP^T - D = V dO^T - D.
      float s[MS][NP][4], dp[MS][NP][4];
#pragma unroll
      for (int nt = 0; nt < NP; ++nt) {
        const float2 d = *reinterpret_cast<const float2*>(del_s + q0 + nt * 8 + 2 * t4);
#pragma unroll
        for (int mt = 0; mt < MS; ++mt) {
          dp[mt][nt][0] = dp[mt][nt][2] = -d.x;
          dp[mt][nt][1] = dp[mt][nt][3] = -d.y;
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
        }
      }
      const uint32_t qrow = uint32_t(q0 * LD * 2);
      scores_t2<T, D, MS, NP, LD>(s, sK + a_kv, q_st + b_nk + qrow, dp, sV + a_kv,
                                  do_st + b_nk + qrow);

      auto lse2_of = [&](int nt, int e) { return lse_s[q0 + nt * 8 + 2 * t4 + (e & 1)]; };
#pragma unroll
      for (int mt = 0; mt < MS; ++mt) {
        if (capped)
          probs_and_dscores<true>(s[mt], dp[mt], p, lse2_of);
        else
          probs_and_dscores<false>(s[mt], dp[mt], p, lse2_of);
        if (Sparse && kind >= 0) {
          // Key row jl of the bit tile; the pass's QP queries lie in one word.
          static_assert(!Sparse || (QP <= 64 && 64 % QP == 0), "a pass within one word");
          constexpr int WPR = (BM + 63) / 64;
          const uint64_t* tb = p.sparse_kv.bits + int64_t(kind) * (BN * WPR);
          uint64_t w[2];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int jl = sk * KS + mt * 16 + g + hh * 8;
            w[hh] = tb[jl * WPR + (q0 >> 6)] >> (q0 & 63);
          }
          apply_mask(s[mt], dp[mt],
                     [&](int nt, int e) { return !((w[e >> 1] >> (nt * 8 + 2 * t4 + (e & 1))) & 1u); });
        } else if (!full) {
          // Key row jl sees the pass's query columns il in [jl - hi_rel - q0,
          // jl - lo_rel - q0], none when jl >= kv_valid.
          Interval vis[2];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int jl = sk * KS + mt * 16 + g + hh * 8;
            vis[hh] = Interval::of(jl - hi_rel - q0, jl < kv_valid ? jl - lo_rel - q0 : -BN - BM);
          }
          if constexpr (Gather) {
            // Gathered rows: every one selected the block.
            apply_mask(s[mt], dp[mt], [&](int nt, int e) {
              return vis[e >> 1].outside(nt * 8 + 2 * t4 + (e & 1));
            });
          } else if constexpr (Moba) {
            // The pass's QP queries (r0 + q0 is a multiple of QP, which
            // divides 64) lie in one word of the selection column.
            static_assert(!Moba || (QP <= 64 && 64 % QP == 0), "a pass within one word");
            const int i = r0 + q0;
            const uint64_t w = i < lq ? moba_sel[i >> 6] >> (i & 63) : 0ull;
            apply_mask(s[mt], dp[mt], [&](int nt, int e) {
              const int col = nt * 8 + 2 * t4 + (e & 1);
              return vis[e >> 1].outside(col) || !((w >> col) & 1u);
            });
          } else {
            apply_mask(s[mt], dp[mt],
                       [&](int nt, int e) { return vis[e >> 1].outside(nt * 8 + 2 * t4 + (e & 1)); });
          }
        }
      }

      uint32_t pa[MS][NP / 2][4], da[MS][NP / 2][4];
#pragma unroll
      for (int mt = 0; mt < MS; ++mt) {
        pack_a<T>(pa[mt], s[mt]);
        pack_a<T>(da[mt], dp[mt]);
      }

      // dS^T (and P^T off the register path) to shared memory.
      if (accum || !REG) {
#pragma unroll
        for (int mt = 0; mt < MS; ++mt) {
          const int row = sk * KS + mt * 16 + g;
          uint32_t* ds_row = reinterpret_cast<uint32_t*>(
                                 smem + Tr::kOffDs) +
                             (row * LDS + q0 + 2 * t4) / 2;
          uint32_t* p_row = reinterpret_cast<uint32_t*>(smem + Tr::kOffP) + (row * LDS + q0 + 2 * t4) / 2;
#pragma unroll
          for (int kk = 0; kk < NP / 2; ++kk) {
            ds_row[kk * 8] = da[mt][kk][0];
            ds_row[kk * 8 + 4] = da[mt][kk][2];
            ds_row[4 * LDS + kk * 8] = da[mt][kk][1];
            ds_row[4 * LDS + kk * 8 + 4] = da[mt][kk][3];
            if (!REG) {
              p_row[kk * 8] = pa[mt][kk][0];
              p_row[kk * 8 + 4] = pa[mt][kk][2];
              p_row[4 * LDS + kk * 8] = pa[mt][kk][1];
              p_row[4 * LDS + kk * 8 + 4] = pa[mt][kk][3];
            }
          }
        }
      }
      if (REG) {
        // dV += P^T dO over the pass's queries (k), all of D (n); then dK +=
        // dS^T Q likewise, except for the last pass when dQ is computed.
#pragma unroll
        for (int kk = 0; kk < NP / 2; ++kk)
#pragma unroll
          for (int np = 0; np < ND / 2; ++np) {
            const uint32_t o = uint32_t(((q0 + kk * 16) * LD + np * 16) * 2);
            uint32_t bo[4];
            ldsm_x4_trans(bo, do_st + b_kn + o);
            mma_16816<T>(acc_dv[0][2 * np], pa[0][kk], bo[0], bo[1]);
            mma_16816<T>(acc_dv[0][2 * np + 1], pa[0][kk], bo[2], bo[3]);
          }
        if (ps + 1 < PASSES || !accum) {
          dk_step(da[0], q0);
        } else {
#pragma unroll
          for (int kk = 0; kk < NP / 2; ++kk)
#pragma unroll
            for (int i = 0; i < 4; ++i) da_last[kk][i] = da[0][kk][i];
        }
      }
    }
    if (!REG) {
      if (BULK && accum) bulk_wait_read<0>();  // the staging tile is read before it is rewritten
      __syncthreads();  // P^T, dS^T complete
      // dV += P^T dO, dK += dS^T Q over the BM queries (k) for the warp's KK
      // keys (m) and DC columns (n).
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t ap[MK][4], ad[MK][4];
#pragma unroll
        for (int mt = 0; mt < MK; ++mt) {
          ldsm_x4(ap[mt], sP + a_ps + uint32_t((mt * 16 * LDS + kk * 16) * 2));
          ldsm_x4(ad[mt], sDs + a_ps + uint32_t((mt * 16 * LDS + kk * 16) * 2));
        }
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {
          const uint32_t o = uint32_t((kk * 16 * LD + np * 16) * 2);
          uint32_t bo[4], bq[4];
          ldsm_x4_trans(bo, do_st + b_kn + o);
          ldsm_x4_trans(bq, q_st + b_kn + o);
#pragma unroll
          for (int mt = 0; mt < MK; ++mt) {
            mma_16816<T>(acc_dv[mt][2 * np], ap[mt], bo[0], bo[1]);
            mma_16816<T>(acc_dv[mt][2 * np + 1], ap[mt], bo[2], bo[3]);
            mma_16816<T>(acc_dk[mt][2 * np], ad[mt], bq[0], bq[1]);
            mma_16816<T>(acc_dk[mt][2 * np + 1], ad[mt], bq[2], bq[3]);
          }
        }
      }
    }

    if (accum) {
      if (REG) {
        if (BULK) bulk_wait_read<0>();  // the staging tile is read before it is rewritten
        __syncthreads();  // dS^T complete
        dk_step(da_last, (PASSES - 1) * QP);
      }
      dq_tile(sDs, r0, rows, h, tile_idx);
    }
    if constexpr (Gather) {
      moba_next(h, m);
      continue;
    }
    if (++m == m_end) m = m_begin, ++h;
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with K and V
  if (BULK && accum && n_iter > 0) {
    bulk_issue(n_iter);  // the last tile's dQ
    bulk_wait<0>();      // shared memory must outlive the copies
  }

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
    for (int mt = 0; mt < MK; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = vk * KK + mt * 16 + g + hh * 8;
        if (row >= kv_valid) continue;
        int64_t at = ((tok0 + row) * heads_kv + hk) * D + vd * DC + 2 * t4;
        if constexpr (Sparse)
          if (compact) at = (slot_row0 + row) * D + vd * DC + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < ND; ++nt) {
          red_add_f32x2(p.dk_accum + at + nt * 8, acc_dk[mt][nt][2 * hh], acc_dk[mt][nt][2 * hh + 1]);
          red_add_f32x2(p.dv_accum + at + nt * 8, acc_dv[mt][nt][2 * hh], acc_dv[mt][nt][2 * hh + 1]);
        }
      }
    return;
  }

  // Epilogue: dK = scale * acc_dk and dV staged in the K and V tiles, then
  // written with 16-byte stores.
  T* sKp = reinterpret_cast<T*>(smem + Tr::kOffK);
  T* sVp = reinterpret_cast<T*>(smem + Tr::kOffV);
  const float scale = p.scale;
#pragma unroll
  for (int mt = 0; mt < MK; ++mt)
#pragma unroll
    for (int nt = 0; nt < ND; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int idx = (vk * KK + mt * 16 + g + hh * 8) * LD + vd * DC + nt * 8 + 2 * t4;
        *reinterpret_cast<uint32_t*>(sKp + idx) =
            pack2<T>(acc_dk[mt][nt][2 * hh] * scale, acc_dk[mt][nt][2 * hh + 1] * scale);
        *reinterpret_cast<uint32_t*>(sVp + idx) =
            pack2<T>(acc_dv[mt][nt][2 * hh], acc_dv[mt][nt][2 * hh + 1]);
      }
  __syncthreads();
  T* gdK = static_cast<T*>(p.dk) + (varlen ? kv_tok * p.dk_seq : b * p.dk_batch) +
           hk * p.dk_head + c0 * p.dk_seq;
  T* gdV = static_cast<T*>(p.dv) + (varlen ? kv_tok * p.dv_seq : b * p.dv_batch) +
           hk * p.dv_head + c0 * p.dv_seq;
  constexpr int CH = D / 8;
#pragma unroll
  for (int i = 0; i < (BN * CH + NTH - 1) / NTH; ++i) {
    const int c = tid + i * NTH;
    const int r = c / CH, ch = c % CH;
    if (c < BN * CH && r < kv_valid) {
      *reinterpret_cast<uint4*>(gdK + r * p.dk_seq + ch * 8) =
          *reinterpret_cast<const uint4*>(sKp + r * LD + ch * 8);
      *reinterpret_cast<uint4*>(gdV + r * p.dv_seq + ch * 8) =
          *reinterpret_cast<const uint4*>(sVp + r * LD + ch * 8);
    }
  }
}

template <class T, int D, int V, bool Sparse = false, bool Moba = false>
__global__ void __launch_bounds__(BwdTraits<D, V>::kThreads, 1)
    flash_bwd_dkdv_kernel(const __grid_constant__ BwdParams p) {
  flash_bwd_dkdv_tile<T, D, V, Sparse, Moba, false>(p);
}

// Block-sparse dK/dV, persistent: grid (blocks resident at once, 1, 1);
// block x computes the blocks of the one-block-per-item grid dealt to it at
// plan creation (p.sparse_kv.dealt [dealt_offsets[x], dealt_offsets[x + 1]),
// src/cuda/block_sparse.hpp) one after the other, and prefetches the next
// one's K and V into L2 (bulk-dQ configurations, as above). No block
// launch, and no K, V load from memory, per work item.
template <class T, int D, int V>
__global__ void __launch_bounds__(BwdTraits<D, V>::kThreads, 1)
    flash_bwd_dkdv_bsparse_persistent_kernel(const __grid_constant__ BwdParams p) {
  using Tr = BwdTraits<D, V>;
  const TileLists& sp = p.sparse_kv;
  const int end = sp.dealt_offsets[blockIdx.x + 1];
  for (int w = sp.dealt_offsets[blockIdx.x]; w < end; ++w) {
    if constexpr (Tr::kBulk) {
      if (w + 1 < end) {
        const int next = sp.dealt[w + 1], per_b = sp.grid_x * sp.grid_y;
        const int b = next / per_b;
        prefetch_dkdv_item<T, D, Tr::kBN, Tr::kThreads>(p, b, next - b * per_b, sp.grid_y, per_b);
      }
    }
    flash_bwd_dkdv_tile<T, D, V, true, false, false, true>(p, sp.dealt[w]);
    __syncthreads();  // the next work item reuses shared memory
  }
}

// MoBA's dK/dV kernel over the rows that selected each block (the row
// lists, p.moba.gather); grid as flash_bwd_dkdv_kernel's.
template <class T, int D, int V>
__global__ void __launch_bounds__(BwdTraits<D, V>::kThreads, 1)
    flash_bwd_dkdv_moba_gather_kernel(const __grid_constant__ BwdParams p) {
  flash_bwd_dkdv_tile<T, D, V, false, true, true>(p);
}

}  // namespace attn::flash
