// MoBA's selector on the GPU (see attn_plan_desc_set_moba and
// moba/moba_params.cuh): four stream-ordered launches that write the
// run-time schedule into the workspace before the attention kernel reads it.
//
//   pool_kernel     pooled[b][hk][kb][:] = mean of the keys of block kb, fp32
//                   (one thread block per block, a fixed summation order)
//   select_kernel   per query row the gates q . mean over its past blocks
//                   (summed over the selecting heads), the top_k of them
//                   (larger gate first, equal gates: lower block index) plus
//                   the own block -> every word of `selected` (64 rows)
//   q_list_kernel   per (slot, forward query tile) the blocks its rows chose
//   kv_list_kernel  per (sequence, KV head, block) the dK/dV kernel's query
//                   tiles with a row that chose it
//   row_count_kernel, row_scan_kernel, row_scatter_kernel
//                   (the gathered backward, instead of kv_list_kernel) per
//                   (slot, block) the rows that chose it: counts, their
//                   prefix sums per slot, then the row indices in
//                   increasing order (the gathered forward's round lists:
//                   moba/moba_rounds.cuh)
//   blind_rows_kernel (gathered forward, with its launches, one per round)
//                   O = 0 and LSE = -inf for the rows that see no key
//
// The kernels that are not templates are static: their host stubs stay out
// of the library's global symbols (tests/ffi/check_exports.py).
//
// Every launch is deterministic (a word's bits are ORed in shared memory,
// which commutes, then stored by one thread), so the backward pass, which
// runs the same launches on the same inputs, sees the forward's selection
// bit for bit. The gates are close to the CPU backend's fp32 ones (fp32
// operands split into three bf16 terms on tensor cores, select_kernel;
// tests/gpu/test_moba_gates.cu bounds their error against fp64); the
// summation order differs (the selecting heads' query rows are added first,
// then multiplied with the block mean), so the two agree except where two
// gates lie within a few fp32 roundings of each other.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flash/sm80.cuh"
#include "moba/moba_params.cuh"

namespace attn::moba {

template <class T>
__device__ __forceinline__ float to_f32(T x);
template <>
__device__ __forceinline__ float to_f32<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Element e (0..7) of 8 packed 16-bit values of T, as fp32 (bit operations:
// no type punning through pointers).
template <class T>
__device__ __forceinline__ float unpacked_f32(const uint4& x, int e);
__device__ __forceinline__ uint32_t packed_bits(const uint4& x, int e) {
  const uint32_t w = e < 2 ? x.x : e < 4 ? x.y : e < 6 ? x.z : x.w;
  return (e & 1) ? w >> 16 : w & 0xffffu;
}
template <>
__device__ __forceinline__ float unpacked_f32<__half>(const uint4& x, int e) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(packed_bits(x, e))));
}
template <>
__device__ __forceinline__ float unpacked_f32<__nv_bfloat16>(const uint4& x, int e) {
  return __uint_as_float(packed_bits(x, e) << 16);
}

// Grid (num_blocks, heads_kv, batch), kPoolThreads threads: thread t sums
// channels [8 (t % chunks), +8) over the block's rows t / chunks, t / chunks
// + lanes, ...; the lanes' partial sums are then added in lane order.
template <class T>
__global__ void __launch_bounds__(kPoolThreads)
    pool_kernel(const __grid_constant__ SelectParams p) {
  __shared__ float part[kPoolThreads * 8];  // [thread][8 channels]
  const int kb = int(blockIdx.x), hk = int(blockIdx.y), b = int(blockIdx.z);
  const int d = p.d, chunks = d / 8, lanes = kPoolThreads / chunks;
  const int tid = int(threadIdx.x), ch = tid % chunks, rl = tid / chunks;
  const int j0 = kb * p.block, j1 = min(p.seqlen_kv, j0 + p.block);
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
  if (rl < lanes) {
    const T* base = static_cast<const T*>(p.k) + b * p.k_batch + hk * p.k_head + ch * 8;
    for (int j = j0 + rl; j < j1; j += lanes) {
      const uint4 x = *reinterpret_cast<const uint4*>(base + int64_t(j) * p.k_seq);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += unpacked_f32<T>(x, e);
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) part[tid * 8 + e] = acc[e];
  __syncthreads();
  const float inv = 1.0f / float(j1 - j0);
  float* out = p.pooled + ((int64_t(b) * p.heads_kv + hk) * p.num_blocks + kb) * d;
  for (int c = tid; c < d; c += kPoolThreads) {
    float s = 0.0f;
    for (int l = 0; l < lanes; ++l) s += part[(l * chunks + c / 8) * 8 + c % 8];
    out[c] = s * inv;
  }
}

// A gate as a uint32 whose unsigned order is the gates' order: -0 is
// mapped to +0 first (equal gates must compare equal, as floats do), every
// NaN to the largest key (NaN gates rank first, equal among themselves, as
// on the CPU backend: a NaN in q or in a block's keys reaches the output),
// and the result is at least 1, since 0 marks an empty candidate below.
__device__ __forceinline__ uint32_t gate_key(float g) {
  uint32_t u = __float_as_uint(g);
  if ((u << 1) == 0u) u = 0u;                          // -0 (bits, whatever the float flags)
  if ((u & 0x7fffffffu) > 0x7f800000u) return ~0u;     // NaN, either sign
  return max((u & 0x80000000u) ? ~u : u | 0x80000000u, 1u);
}

// x and y as three bf16 pairs, x = hi + mid + lo to fp32's 24 bits (each
// residual is exact in fp32): a product of two such splits on bf16 tensor
// cores is the fp32 product up to the dropped small cross terms.
__device__ __forceinline__ void split_bf16x3(float x, float y, uint32_t& hi, uint32_t& mid,
                                             uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  const float2 hf = __bfloat1622float2(h);
  const float rx = x - hf.x, ry = y - hf.y;
  const __nv_bfloat162 m = __floats2bfloat162_rn(rx, ry);
  const float2 mf = __bfloat1622float2(m);
  const __nv_bfloat162 l = __floats2bfloat162_rn(rx - mf.x, ry - mf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  mid = *reinterpret_cast<const uint32_t*>(&m);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// Grid (ceil(seqlen_q / kSelectRows), sel_heads, batch), kSelectThreads
// threads, select_smem_bytes(d) of dynamic shared memory; CTA x owns the
// words x of its slot's columns (kSelectRows = 64 rows: one word).
//
// Gates of kSelectRows rows x kSelectBlocks past blocks per chunk. The
// selecting heads' query rows are added in fp32 (head order) into shared
// memory once; the chunk's block means come in slabs of kSelectSlab
// channels (global loads of the next slab overlap the current one's
// products), stored split into three bf16 planes (hi, mid, lo: split_bf16x3).
// Warp w computes rows 16 (w % 4) .. + 15 x blocks 32 (w / 4) .. + 31 with
// mma.sync m16n8k16 (bf16 in, fp32 accumulators), its query fragments split
// likewise as they are read: per k-step the products hi.hi, hi.mid, mid.hi,
// hi.lo, lo.hi and mid.mid (one selecting head of bf16 inputs, whose query
// rows are bf16 already: hi.hi, hi.mid, hi.lo). So a gate is the fp32 dot
// product up to terms below 2^-24 |q| |mean| per channel and the summation
// order. (The fp32 FMA loop this replaces made the selector
// instruction-bound; the mma path issues a fraction of its instructions.)
//
// The merge: warp w keeps the running top_k of rows 8 w .. 8 w + 7 in
// registers, entry t of a row in lane t (key gate_key, block index). Per
// chunk a row's candidates are its kept entries and the chunk's gates of
// its past blocks (lane l: blocks l and l + 32 of the chunk); min(top_k,
// candidates) rounds of a warp argmax on (larger gate, then lower block
// index) build the new list, round t's winner into lane t. That is the
// top_k under that order, whatever the chunking: equal gates keep the lower
// block index, as on the CPU backend. A row with at most top_k past blocks
// takes them all, without gates.
//
// The output: after the last chunk, per 64 blocks the CTA ORs its rows'
// bits into 64 words in shared memory and stores them, zeros included, for
// every block of the slab's column: no global atomics, and `selected`
// needs no zeroing before (a CTA none of whose rows sees a key writes its
// zero words like the others).
// The CTAs per SM select_kernel's registers are bounded for: what shared
// memory allows at d = 128 (3 on sm_90's 228 KiB, 2 on sm_80's 164 KiB).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kSelectMinBlocks = 2;
#else
constexpr int kSelectMinBlocks = 3;
#endif

//
// kGates (the gate test only): every gate computed is also stored to
// p.gates.
template <class T, bool kGates = false>
__global__ void __launch_bounds__(kSelectThreads, kSelectMinBlocks)
    select_kernel(const __grid_constant__ SelectParams p) {
  static_assert(kSelectRows == 64 && kSelectBlocks == 64 && kSelectThreads == 256,
                "16 x 32 gates per warp, 8 rows per warp merged, one word per CTA and block");
  static_assert(kMaxTopK <= 32, "entry t of a row's top list in lane t");
  static_assert(kSelectSlab % 16 == 0, "whole k-steps per slab");
  extern __shared__ __align__(16) unsigned char smem[];
  // Row pitches: d + 8 floats and kSelectLdSlab bf16 put a warp's fragment
  // reads (rows g, columns 2t) in distinct banks.
  const int d = p.d, ld = d + 8;
  constexpr int ls = kSelectLdSlab, plane = kSelectBlocks * ls;
  float* qs = reinterpret_cast<float*>(smem);  // [kSelectRows][ld]
  __nv_bfloat16* ps =                          // [3][kSelectBlocks][ls]: hi, mid, lo
      reinterpret_cast<__nv_bfloat16*>(qs + kSelectRows * ld);
  float* gs = reinterpret_cast<float*>(ps + 3 * plane);  // [kSelectRows][kSelectBlocks + 1]
  unsigned long long* words =                             // [kSelectBlocks]
      reinterpret_cast<unsigned long long*>(gs + kSelectRows * (kSelectBlocks + 1));
  int32_t* top_idx_s = reinterpret_cast<int32_t*>(words + kSelectBlocks);  // [kSelectRows][32]

  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int r0 = int(blockIdx.x) * kSelectRows, hs = int(blockIdx.y), b = int(blockIdx.z);
  const int lq = p.seqlen_q, off = p.seqlen_kv - p.seqlen_q;
  const int rows = min(kSelectRows, lq - r0);
  const int last_diag = r0 + rows - 1 + off;  // < 0: no row of the tile sees a key
  const int own_last = last_diag >= 0 ? last_diag / p.block : -1;
  const int h0 = p.shared ? hs * p.group : hs, nh = p.shared ? p.group : 1;
  const int hk = p.shared ? hs : hs / p.group;
  const int top_k = min(p.top_k, kMaxTopK);
  // Past blocks kb < own <= own_last, needed when some row has more than top_k.
  const int past_end = top_k > 0 && own_last > p.top_k ? own_last : 0;

  // The selecting heads' query rows, added (rows past the sequence: 0), 8
  // channels per 16-byte load. A thread's chunks go in groups of 4 whose
  // loads go out together, head by head: one memory latency per group and
  // head instead of per chunk and head (this phase was the selector's
  // largest stall once its gates ran on tensor cores).
  if (past_end > 0) {
    const T* gq = static_cast<const T*>(p.q) + b * p.q_batch + int64_t(r0) * p.q_seq;
    const int chunks = d / 8, total = kSelectRows * chunks;
    constexpr int kGroup = 4;
    for (int x0 = tid; x0 < total; x0 += kGroup * kSelectThreads) {
      float s[kGroup][8];
#pragma unroll
      for (int i = 0; i < kGroup; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) s[i][e] = 0.0f;
      for (int h = h0; h < h0 + nh; ++h) {
        uint4 v[kGroup];
#pragma unroll
        for (int i = 0; i < kGroup; ++i) {
          const int x = x0 + i * kSelectThreads, r = x / chunks, c = (x - r * chunks) * 8;
          v[i] = x < total && r < rows ? *reinterpret_cast<const uint4*>(
                                             gq + int64_t(r) * p.q_seq + h * p.q_head + c)
                                       : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int i = 0; i < kGroup; ++i)
#pragma unroll
          for (int e = 0; e < 8; ++e) s[i][e] += unpacked_f32<T>(v[i], e);
      }
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        const int x = x0 + i * kSelectThreads, r = x / chunks, c = (x - r * chunks) * 8;
        if (x >= total) break;
        *reinterpret_cast<float4*>(qs + r * ld + c) =
            make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
        *reinterpret_cast<float4*>(qs + r * ld + c + 4) =
            make_float4(s[i][4], s[i][5], s[i][6], s[i][7]);
      }
    }
  }

  // Row r's own block (-1: not a row, or it sees no key), divided out once
  // per row: the merge and the words read it per row and chunk. (First
  // read after a barrier: the slab loop's, or the words'.)
  __shared__ int own_s[kSelectRows];
  if (tid < kSelectRows) {
    const int diag = r0 + tid + off;
    own_s[tid] = tid < rows && diag >= 0 ? diag / p.block : -1;
  }
  auto own_of = [&](int k) { return own_s[warp * 8 + k]; };  // row 8 warp + k
  // Entry `lane` of row 8 warp + k: its key (0: none) in a register, its
  // block index in shared memory (top_idx[k][lane]: registers are short
  // during the gate product).
  uint32_t top_key[8];
  int32_t* top_idx = top_idx_s + warp * 8 * 32 + lane;
#pragma unroll
  for (int k = 0; k < 8; ++k) top_key[k] = 0u, top_idx[32 * k] = -1;

  const float* pooled = p.pooled + (int64_t(b) * p.heads_kv + hk) * int64_t(p.num_blocks) * d;
  // This warp's gate tile: rows wr + g (+ 8) x blocks wb + 8 j + 2 t (+ 1),
  // j < 4 (the mma accumulator layout, flash/sm80.cuh).
  const int g = lane >> 2, t = lane & 3;
  const int wr = (warp & 3) * 16, wb = (warp >> 2) * 32;
  // Query rows that are bf16 already (one selecting head of bf16 inputs):
  // their mid and lo terms are 0.
  const bool q_exact = std::is_same_v<T, __nv_bfloat16> && nh == 1;
  // Slab loads: float4 number tid and tid + kSelectThreads of a slab
  // [kSelectBlocks][kSelectSlab].
  constexpr int slab_vecs = kSelectSlab / 4;
  static_assert(kSelectBlocks * slab_vecs == 2 * kSelectThreads, "two float4 per thread per slab");
  const int slabs = d / kSelectSlab;
  float4 next[2];
  auto load_slab = [&](int kb0, int c0) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int x = tid + u * kSelectThreads, bl = x / slab_vecs, c = c0 + (x % slab_vecs) * 4;
      next[u] = kb0 + bl < past_end  // (later blocks: gates nobody reads)
                    ? *reinterpret_cast<const float4*>(pooled + int64_t(kb0 + bl) * d + c)
                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  if (past_end > 0) load_slab(0, 0);
  for (int kb0 = 0; kb0 < past_end; kb0 += kSelectBlocks) {
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    // A warp whose 32 blocks all lie at or after past_end computes no gate
    // anyone reads (causal tiles see half the blocks on average).
    const bool gate_warp = kb0 + wb < past_end;
    for (int s = 0; s < slabs; ++s) {
      __syncthreads();  // qs written; the previous slab consumed
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int x = tid + u * kSelectThreads;
        uint32_t hi[2], mid[2], lo[2];
        split_bf16x3(next[u].x, next[u].y, hi[0], mid[0], lo[0]);
        split_bf16x3(next[u].z, next[u].w, hi[1], mid[1], lo[1]);
        const int at = (x / slab_vecs) * ls + (x % slab_vecs) * 4;
        *reinterpret_cast<uint2*>(ps + at) = make_uint2(hi[0], hi[1]);
        *reinterpret_cast<uint2*>(ps + plane + at) = make_uint2(mid[0], mid[1]);
        *reinterpret_cast<uint2*>(ps + 2 * plane + at) = make_uint2(lo[0], lo[1]);
      }
      __syncthreads();
      if (s + 1 < slabs)
        load_slab(kb0, (s + 1) * kSelectSlab);
      else if (kb0 + kSelectBlocks < past_end)
        load_slab(kb0 + kSelectBlocks, 0);
      if (!gate_warp) continue;
#pragma unroll 1
      for (int ks = 0; ks < kSelectSlab / 16; ++ks) {
        // A: rows wr + g (+ 8), channels c + 2t (+ 8) of the slab's range.
        const float* qa = qs + (wr + g) * ld + s * kSelectSlab + ks * 16 + 2 * t;
        const float2 x0 = *reinterpret_cast<const float2*>(qa);
        const float2 x1 = *reinterpret_cast<const float2*>(qa + 8 * ld);
        const float2 x2 = *reinterpret_cast<const float2*>(qa + 8);
        const float2 x3 = *reinterpret_cast<const float2*>(qa + 8 * ld + 8);
        uint32_t ah[4], am[4], al[4];
        split_bf16x3(x0.x, x0.y, ah[0], am[0], al[0]);
        split_bf16x3(x1.x, x1.y, ah[1], am[1], al[1]);
        split_bf16x3(x2.x, x2.y, ah[2], am[2], al[2]);
        split_bf16x3(x3.x, x3.y, ah[3], am[3], al[3]);
        // B: block wb + 8 j + g, channels ks * 16 + 2t (+ 8) of the slab,
        // plane by plane (lo, mid, hi: small terms first), each paired with
        // the query terms whose product is kept. The k-step's products go
        // into a zeroed accumulator, added to the gates' in fp32 after: the
        // tensor cores' fp32 accumulation truncates each product sum to the
        // accumulator's exponent, and into the running gate that lost the
        // small terms' bits (2^-19 RMS of the gate's scale, measured by
        // test_moba_gates, against 2^-22.5 for an fp32 FMA loop).
        const __nv_bfloat16* pb = ps + (wb + g) * ls + ks * 16 + 2 * t;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float step[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int pl = 2; pl >= 0; --pl) {
            const __nv_bfloat16* b = pb + pl * plane + 8 * j * ls;
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(b),
                           b1 = *reinterpret_cast<const uint32_t*>(b + 8);
            if (pl == 2) {  // lo
              flash::mma_16816<__nv_bfloat16>(step, ah, b0, b1);
            } else if (pl == 1) {  // mid
              if (!q_exact) flash::mma_16816<__nv_bfloat16>(step, am, b0, b1);
              flash::mma_16816<__nv_bfloat16>(step, ah, b0, b1);
            } else {  // hi
              if (!q_exact) {
                flash::mma_16816<__nv_bfloat16>(step, al, b0, b1);
                flash::mma_16816<__nv_bfloat16>(step, am, b0, b1);
              }
              flash::mma_16816<__nv_bfloat16>(step, ah, b0, b1);
            }
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] += step[e];
        }
      }
    }
    // gs is free: the previous chunk's merge ended before this chunk's
    // first slab barrier.
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        gs[(wr + g + 8 * (e >> 1)) * (kSelectBlocks + 1) + wb + 8 * j + 2 * t + (e & 1)] = acc[j][e];
    if constexpr (kGates) {
      if (gate_warp) {
        float* out = p.gates + (int64_t(b) * p.sel_heads + hs) * int64_t(lq) * p.num_blocks;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = wr + g + 8 * (e >> 1), kb = kb0 + wb + 8 * j + 2 * t + (e & 1);
            if (r < rows && kb < past_end) out[int64_t(r0 + r) * p.num_blocks + kb] = acc[j][e];
          }
      }
    }
    __syncthreads();

#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int own = own_of(k);  // the same in every lane: the branch is warp-uniform
      if (own <= p.top_k || own <= kb0) continue;  // takes every past block / none in this chunk
      const int n = min(kSelectBlocks, own - kb0);
      const int kept = min(top_k, kb0);  // every block before kb0 is past for this row
      const int rounds = min(top_k, kept + n);
      const float* g = gs + (warp * 8 + k) * (kSelectBlocks + 1);
      // Candidates of this lane, in increasing block index: its kept entry,
      // then blocks kb0 + lane and kb0 + lane + 32.
      uint32_t key0 = lane < kept ? top_key[k] : 0u;
      uint32_t key1 = lane < n ? gate_key(g[lane]) : 0u;
      uint32_t key2 = lane + 32 < n ? gate_key(g[lane + 32]) : 0u;
      const int idx0 = top_idx[32 * k], idx1 = kb0 + lane, idx2 = kb0 + lane + 32;
      uint32_t new_key = 0u;
      int32_t new_idx = -1;
      for (int t = 0; t < rounds; ++t) {
        // The lane's best: strictly larger keys only, so that among equal
        // gates the lower block index stays.
        uint32_t best = key0;
        int best_idx = idx0, from = 0;
        if (key1 > best) best = key1, best_idx = idx1, from = 1;
        if (key2 > best) best = key2, best_idx = idx2, from = 2;
        const uint32_t top = __reduce_max_sync(0xffffffffu, best);
        const uint32_t win = __reduce_min_sync(
            0xffffffffu, best == top ? uint32_t(best_idx) : 0xffffffffu);
        // top >= 1: there are at least `rounds` non-empty candidates.
        if (best == top && uint32_t(best_idx) == win) {
          if (from == 0) key0 = 0u;
          if (from == 1) key1 = 0u;
          if (from == 2) key2 = 0u;
        }
        if (lane == t) new_key = top, new_idx = int32_t(win);
      }
      top_key[k] = new_key;
      top_idx[32 * k] = new_idx;
    }
  }

  // The words, 64 blocks at a time: the bits of the rows' top lists, of
  // their own blocks, and of every block up to the own one for rows that
  // take them all.
  const int64_t slot = int64_t(b) * p.sel_heads + hs;
  uint64_t* col = p.selected + slot * p.num_blocks * int64_t(p.q_words) + blockIdx.x;
  // The bits go in as 32-bit shared ORs (the 64-bit ones, with every row
  // of a CTA setting its own block's word, had a fifth of the selector's
  // warp samples): half warp / 4 of a word holds warps 4 (warp / 4) .. + 3.
  uint32_t* const half_words = reinterpret_cast<uint32_t*>(words) + (warp >> 2);
  for (int ob = 0; ob < p.num_blocks; ob += kSelectBlocks) {
    if (tid < kSelectBlocks) words[tid] = 0ull;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int own = own_of(k);
      if (own < ob) continue;  // (own -1 included: no bit)
      const uint32_t bit = 1u << ((warp & 3) * 8 + k);
      if (own <= p.top_k) {
        for (int kb = ob + lane; kb <= min(own, ob + kSelectBlocks - 1); kb += 32)
          atomicOr(&half_words[2 * (kb - ob)], bit);
        continue;
      }
      if (lane == 0 && own < ob + kSelectBlocks) atomicOr(&half_words[2 * (own - ob)], bit);
      const int kb = top_idx[32 * k];
      if (lane < top_k && kb >= ob && kb < ob + kSelectBlocks)
        atomicOr(&half_words[2 * (kb - ob)], bit);
    }
    __syncthreads();
    if (tid < kSelectBlocks && ob + tid < p.num_blocks)
      col[int64_t(ob + tid) * p.q_words] = words[tid];
    __syncthreads();  // read before the next step zeroes them
  }
}

// Whether any and whether every row of [r0, r0 + n) has its bit set in the
// column `col` of 64-bit words (n >= 1).
__device__ __forceinline__ void rows_any_all(const uint64_t* col, int r0, int n, bool& any,
                                             bool& all) {
  any = false;
  all = true;
  for (int w = r0 >> 6; w <= (r0 + n - 1) >> 6; ++w) {
    const int a = max(r0, w * 64) - w * 64, e = min(r0 + n, w * 64 + 64) - w * 64;
    const uint64_t m = (e - a == 64 ? ~0ull : (1ull << (e - a)) - 1ull) << a;
    const uint64_t x = col[w] & m;
    any = any || x != 0;
    all = all && x == m;
  }
}

// One warp per (slot, forward query tile): the blocks some row of the tile
// selected, in increasing order (ballot compaction), flagged kMobaAllRows
// when every row did.
static __global__ void __launch_bounds__(kListThreads)
    q_list_kernel(const __grid_constant__ SelectParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t list = int64_t(blockIdx.x) * (kListThreads / 32) + int(threadIdx.x) / 32;
  const int64_t lists = int64_t(p.batch) * p.sel_heads * p.q_tiles;
  if (list >= lists) return;
  const int64_t slot = list / p.q_tiles;
  const int t = int(list - slot * p.q_tiles);
  const int r0 = t * p.q_tile_rows, n = min(p.q_tile_rows, p.seqlen_q - r0);
  const int d_last = r0 + n - 1 + p.seqlen_kv - p.seqlen_q;
  int32_t* out = p.q_blocks + list * p.q_cap;
  int count = 0;
  if (d_last >= 0) {
    const int own_last = d_last / p.block;
    const uint64_t* sel = p.selected + slot * p.num_blocks * int64_t(p.q_words);
    for (int base = 0; base <= own_last; base += 32) {
      const int kb = base + lane;
      bool any = false, all = false;
      if (kb <= own_last) rows_any_all(sel + int64_t(kb) * p.q_words, r0, n, any, all);
      const unsigned m = __ballot_sync(0xffffffffu, any);
      const int at = count + __popc(m & ((1u << lane) - 1u));
      if (any && at < p.q_cap) out[at] = kb | (all ? flash::kMobaAllRows : 0);
      count += __popc(m);
    }
  }
  if (lane == 0) p.q_count[list] = min(count, p.q_cap);
}

// One warp per (sequence, KV head, block): the dK/dV kernel's query tiles
// (kv_tile_rows rows) in which a row of a selecting slot of the KV head
// (the group's shared slot, or each query head of the group) selected the
// block, in increasing order, flagged kMobaAllRows when every row of every
// such slot did.
static __global__ void __launch_bounds__(kListThreads)
    kv_list_kernel(const __grid_constant__ SelectParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t list = int64_t(blockIdx.x) * (kListThreads / 32) + int(threadIdx.x) / 32;
  const int64_t lists = int64_t(p.batch) * p.heads_kv * p.num_blocks;
  if (list >= lists) return;
  const int kb = int(list % p.num_blocks);
  const int64_t bh = list / p.num_blocks;  // b * heads_kv + hk
  const int b = int(bh / p.heads_kv), hk = int(bh - int64_t(b) * p.heads_kv);
  const int64_t slot0 = p.shared ? bh : int64_t(b) * p.heads_q + int64_t(hk) * p.group;
  const int slots = p.shared ? 1 : p.group;
  const int lq = p.seqlen_q, rows_per = p.kv_tile_rows;
  // The first row whose diagonal reaches the block.
  const int i0 = max(0, kb * p.block - (p.seqlen_kv - lq));
  int32_t* out = p.kv_tiles + list * p.kv_cap;
  int count = 0;
  for (int base = i0 / rows_per; i0 < lq && base < p.kv_q_tiles; base += 32) {
    const int t = base + lane;
    bool any = false, all = false;
    if (t < p.kv_q_tiles) {
      const int r0 = t * rows_per, n = min(rows_per, lq - r0);
      all = true;
      for (int s = 0; s < slots; ++s) {
        const uint64_t* col = p.selected + ((slot0 + s) * p.num_blocks + kb) * int64_t(p.q_words);
        bool a1, l1;
        rows_any_all(col, r0, n, a1, l1);
        any = any || a1;
        all = all && l1;
      }
    }
    const unsigned m = __ballot_sync(0xffffffffu, any);
    const int at = count + __popc(m & ((1u << lane) - 1u));
    if (any && at < p.kv_cap) out[at] = t | (all ? flash::kMobaAllRows : 0);
    count += __popc(m);
  }
  if (lane == 0) p.kv_count[list] = min(count, p.kv_cap);
}

// The gathered row lists (flash::MobaLists with gather = 1). The rows that
// can select block kb start at the first row whose diagonal reaches it.
__device__ __forceinline__ int first_row_of_block(const SelectParams& p, int kb) {
  return max(0, kb * p.block - (p.seqlen_kv - p.seqlen_q));
}

// The inclusive prefix sum of x over the lanes of the warp, lane 0 first.
__device__ __forceinline__ int warp_inclusive_sum(int x, int lane) {
#pragma unroll
  for (int s = 1; s < 32; s <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, s);
    if (lane >= s) x += y;
  }
  return x;
}

// One warp per (slot, block): the number of rows that selected the block,
// into row_offsets[slot][kb + 1] (row_scan_kernel turns them into offsets).
static __global__ void __launch_bounds__(kListThreads)
    row_count_kernel(const __grid_constant__ SelectParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t list = int64_t(blockIdx.x) * (kListThreads / 32) + int(threadIdx.x) / 32;
  if (list >= int64_t(p.batch) * p.sel_heads * p.num_blocks) return;
  const int64_t slot = list / p.num_blocks;
  const int kb = int(list - slot * p.num_blocks);
  const uint64_t* col = p.selected + list * int64_t(p.q_words);
  int count = 0;
  for (int w = first_row_of_block(p, kb) / 64 + lane; w < p.q_words; w += 32)
    count += __popcll(col[w]);
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) count += __shfl_xor_sync(0xffffffffu, count, s);
  if (lane == 0) p.row_offsets[slot * (p.num_blocks + 1) + kb + 1] = count;
}

// One warp per slot: row_offsets[slot][0] = 0 and the inclusive prefix sums
// of the counts after it, 32 at a time in block order.
static __global__ void __launch_bounds__(kListThreads)
    row_scan_kernel(const __grid_constant__ SelectParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t slot = int64_t(blockIdx.x) * (kListThreads / 32) + int(threadIdx.x) / 32;
  if (slot >= int64_t(p.batch) * p.sel_heads) return;
  int32_t* off = p.row_offsets + slot * (p.num_blocks + 1);
  if (lane == 0) off[0] = 0;
  int carry = 0;
  for (int k0 = 1; k0 <= p.num_blocks; k0 += 32) {
    const int k = k0 + lane;
    const int x = warp_inclusive_sum(k <= p.num_blocks ? off[k] : 0, lane);
    if (k <= p.num_blocks) off[k] = carry + x;
    carry += __shfl_sync(0xffffffffu, x, 31);
  }
}

// One warp per (slot, block): the indices of the rows that selected the
// block, increasing, at rows[slot][row_offsets[slot][kb] ...]. Lane l takes
// word w0 + l of each 32-word step and writes its bits after the set bits
// of the lower lanes' words: the order is fixed, whatever the scheduling.
static __global__ void __launch_bounds__(kListThreads)
    row_scatter_kernel(const __grid_constant__ SelectParams p) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t list = int64_t(blockIdx.x) * (kListThreads / 32) + int(threadIdx.x) / 32;
  if (list >= int64_t(p.batch) * p.sel_heads * p.num_blocks) return;
  const int64_t slot = list / p.num_blocks;
  const int kb = int(list - slot * p.num_blocks);
  const uint64_t* col = p.selected + list * int64_t(p.q_words);
  int32_t* out =
      p.rows + slot * int64_t(p.rows_cap) + p.row_offsets[slot * (p.num_blocks + 1) + kb];
  int count = 0;
  for (int w0 = first_row_of_block(p, kb) / 64; w0 < p.q_words; w0 += 32) {
    const int w = w0 + lane;
    uint64_t bits = w < p.q_words ? col[w] : 0ull;
    const int n = __popcll(bits);
    const int below = warp_inclusive_sum(n, lane);  // of the lanes' counts
    int at = count + below - n;
    while (bits != 0ull) {
      const int bit = __ffsll(static_cast<long long>(bits)) - 1;
      out[at++] = w * 64 + bit;
      bits &= bits - 1ull;
    }
    count += __shfl_sync(0xffffffffu, below, 31);
  }
}

// One thread per 8 channels of a (sequence, query head, row) of the rows
// that see no key (before the first key's diagonal; no list holds them):
// O = 0, LSE = -inf.
template <class T>
__global__ void __launch_bounds__(kListThreads)
    blind_rows_kernel(const __grid_constant__ BlindRowsParams p) {
  const int chunks = p.d / 8;
  const int blind = p.seqlen_q - p.seqlen_kv;
  const int64_t rows = int64_t(p.batch) * p.heads_q * blind;
  const int64_t t = int64_t(blockIdx.x) * kListThreads + int(threadIdx.x);
  if (t >= rows * chunks) return;
  const int64_t row = t / chunks;
  const int ch = int(t - row * chunks);
  const int64_t bh = row / blind;
  const int i = int(row - bh * blind);
  const int b = int(bh / p.heads_q), h = int(bh - int64_t(b) * p.heads_q);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.o) + b * p.o_batch + int64_t(i) * p.o_seq +
                            h * p.o_head + ch * 8) = make_uint4(0u, 0u, 0u, 0u);
  if (ch == 0 && p.lse != nullptr) p.lse[b * p.lse_batch + h * p.lse_head + i] = -INFINITY;
}

}  // namespace attn::moba
