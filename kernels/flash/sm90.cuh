// sm_90a building blocks: warpgroup MMA (wgmma) with shared-memory matrix
// descriptors, its fences and groups, and the 128-byte swizzled shared
// layout the descriptors describe, as thin inline-PTX wrappers.
//
// Everything here assembles only for sm_90a (wgmma is an arch-specific
// feature): callers guard their bodies with ATTN_SM90_WGMMA, which is 1
// only in the sm_90a device pass.
//
// Shared layout (one "panel" per 64 columns of 16-bit elements): a tile of
// ROWS rows and C columns is C / 64 panels of [ROWS][64] elements, each row
// 128 bytes, panel p at byte p * ROWS * 128. Inside a panel, the 16-byte
// chunk c (elements 8c..8c+7) of row r sits at chunk c ^ (r % 8) of the
// row (the 128-byte swizzle; its 8-row, 1024-byte atom must be 1024-byte
// aligned, since the hardware applies the XOR to address bits [4, 7) from
// bits [7, 10)). The same storage serves
//   - a K-major operand (Q, K: rows are M or N, columns are the reduction
//     dim k): descriptor SBO = 1024 (next 8 rows), LBO unused; the k16 step
//     kk starts at panel kk / 4, byte (kk % 4) * 32 of row 0;
//   - an MN-major operand (V for O += P V: rows are the reduction dim, the
//     keys; columns the N dim): SBO = 1024 (next 8 keys), LBO = ROWS * 128
//     (next 64 columns, the next panel); the k16 step kk starts at row 16 kk
//     of panel 0, and the instruction's transpose-B flag is set.
//
// Accumulator fragment of wgmma m64nNk16 (fp32, thread = 32 w + 4 g + t in
// the warpgroup, w = warp 0..3): register 4 j + e holds row 16 w + g + 8 (e / 2),
// column 8 j + 2 t + (e % 2), j = 0 .. N / 8 - 1: per warp, the mma.sync
// m16n8 C layout repeated along N. The register A operand (m64k16) is per
// warp the mma.sync m16n8k16 A fragment of rows 16 w .. 16 w + 15 (see
// sm80.cuh), so S accumulators of columns [16 kk, 16 kk + 16) pack directly
// into the A fragment of k-step kk.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "moba/moba_params.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTN_SM90_WGMMA 1
#else
#define ATTN_SM90_WGMMA 0
#endif

namespace attn::flash::sm90 {

// Byte offset of element (r, c) of a [rows][C] tile in the swizzled panel
// layout above (c a multiple of 8 gives the start of a 16-byte chunk).
__host__ __device__ constexpr uint32_t swizzled_offset(int rows, int r, int c) {
  return uint32_t((c >> 6) * rows * 128 + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) +
                  (c & 7) * 2);
}

// Matrix descriptor: start address, leading and stride byte offsets (all
// encoded >> 4, 14 bits each), base offset 0, 128-byte swizzle (mode 1 in
// bits 62-63).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

// desc with its start address `bytes` (a multiple of 16) further: one
// 32-bit add to the start address field (bits 0-13, >> 4), which cannot
// carry out, shared addresses being below 2^18. The k-steps of a GEMM share
// their tile's descriptor and differ by constants: built once, each step
// costs that add instead of the whole encoding.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = uint32_t(desc) + (bytes >> 4), hi = uint32_t(desc >> 32);
  return (uint64_t(hi) << 32) | lo;
}

// K-major operand of `rows` rows (Q or K) for k-step kk: see the top.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t tile, int rows, int kk) {
  return desc_advance(smem_desc(tile, 16u, 1024u), uint32_t((kk >> 2) * rows * 128 + (kk & 3) * 32));
}
// MN-major operand (V, [rows = keys][columns]) for k-step kk (keys 16 kk..).
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t tile, int rows, int kk) {
  return desc_advance(smem_desc(tile, uint32_t(rows * 128), 1024u), uint32_t(kk * 16 * 128));
}

// Orders this warpgroup's register accesses before the wgmma that follows
// (needed before the first wgmma and after registers it reads or
// accumulates into were written by other instructions).
__device__ __forceinline__ void wgmma_fence() {
#if ATTN_SM90_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if ATTN_SM90_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N of this warpgroup's committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if ATTN_SM90_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Keeps the compiler from moving accesses of accumulator registers across
// a wgmma wait or fence (the asm statements do not name them).
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Shared memory written by ordinary stores (or cp.async) and read next by
// wgmma: each writing thread fences before the barrier that publishes it.
__device__ __forceinline__ void fence_proxy_async() {
#if ATTN_SM90_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same barrier, returning whether `pred` holds in every participating
// thread (a decision the threads must share, e.g. which wgmmas to issue).
__device__ __forceinline__ bool named_barrier_and(int id, int threads, bool pred) {
  uint32_t all = 0;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(all)
      : "r"(uint32_t(pred)), "r"(id), "r"(threads)
      : "memory");
  return all != 0;
}

#define ATTN_SM90_ACC8(i)                                                                   \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define ATTN_SM90_ACC32 ATTN_SM90_ACC8(0), ATTN_SM90_ACC8(8), ATTN_SM90_ACC8(16), ATTN_SM90_ACC8(24)
#define ATTN_SM90_ACC64 \
  ATTN_SM90_ACC32, ATTN_SM90_ACC8(32), ATTN_SM90_ACC8(40), ATTN_SM90_ACC8(48), ATTN_SM90_ACC8(56)

#define ATTN_SM90_REGS32                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ATTN_SM90_REGS64                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"

// d[64 x N] (+)= A[64 x 16] B[16 x N], fp32 accumulators d[N / 2] in the
// fragment above; accumulate = false overwrites d. Both operands from
// shared memory (K-major A and B): wgmma_ss. A from registers (the m16n8k16
// A fragment of each warp's 16 rows) and B MN-major: wgmma_rs.
template <class T, int N>
struct Wgmma;

#define ATTN_SM90_WGMMA_DEF(TY, PTXTY)                                                         \
  template <>                                                                                 \
  struct Wgmma<TY, 128> {                                                                     \
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t a, uint64_t b,         \
                                              bool accumulate) {                              \
      ATTN_SM90_SS_BODY("m64n128k16", PTXTY, ATTN_SM90_REGS64, "64", "65", "66", ATTN_SM90_ACC64) \
    }                                                                                         \
    static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4],         \
                                              uint64_t b, bool accumulate) {                  \
      ATTN_SM90_RS_BODY("m64n128k16", PTXTY, ATTN_SM90_REGS64, "64", "65", "66", "67", "68",  \
                        "69", ATTN_SM90_ACC64)                                                \
    }                                                                                         \
  };                                                                                          \
  template <>                                                                                 \
  struct Wgmma<TY, 64> {                                                                      \
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t a, uint64_t b,         \
                                              bool accumulate) {                              \
      ATTN_SM90_SS_BODY("m64n64k16", PTXTY, ATTN_SM90_REGS32, "32", "33", "34", ATTN_SM90_ACC32) \
    }                                                                                         \
    static __device__ __forceinline__ void rs(float (&d)[32], const uint32_t (&a)[4],         \
                                              uint64_t b, bool accumulate) {                  \
      ATTN_SM90_RS_BODY("m64n64k16", PTXTY, ATTN_SM90_REGS32, "32", "33", "34", "35", "36",   \
                        "37", ATTN_SM90_ACC32)                                                \
    }                                                                                         \
  };

#if ATTN_SM90_WGMMA
// scale-d is a predicate: 0 ignores the old accumulators.
#define ATTN_SM90_SS_BODY(SHAPE, PTXTY, REGS, A, B, S, ACC)                                   \
  asm volatile(                                                                               \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\n"                                         \
      "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTXTY "." PTXTY " " REGS ", %" A ", %" B   \
      ", p, 1, 1, 0, 0;\n}\n"                                                                 \
      : ACC                                                                                   \
      : "l"(a), "l"(b), "r"(int(accumulate)));
#define ATTN_SM90_RS_BODY(SHAPE, PTXTY, REGS, A0, A1, A2, A3, B, S, ACC)                      \
  asm volatile(                                                                               \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\n"                                         \
      "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTXTY "." PTXTY " " REGS ", {%" A0        \
      ", %" A1 ", %" A2 ", %" A3 "}, %" B ", p, 1, 1, 1;\n}\n"                                  \
      : ACC                                                                                   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)));
#else
// Other targets: no body (the kernels using these are empty there).
#define ATTN_SM90_SS_BODY(SHAPE, PTXTY, REGS, A, B, S, ACC) \
  (void)d, (void)a, (void)b, (void)accumulate;
#define ATTN_SM90_RS_BODY(SHAPE, PTXTY, REGS, A0, A1, A2, A3, B, S, ACC) \
  (void)d, (void)a, (void)b, (void)accumulate;
#endif

ATTN_SM90_WGMMA_DEF(__half, "f16")
ATTN_SM90_WGMMA_DEF(__nv_bfloat16, "bf16")

#undef ATTN_SM90_WGMMA_DEF
#undef ATTN_SM90_SS_BODY
#undef ATTN_SM90_RS_BODY
#undef ATTN_SM90_REGS32
#undef ATTN_SM90_REGS64
#undef ATTN_SM90_ACC8
#undef ATTN_SM90_ACC32
#undef ATTN_SM90_ACC64

// d[64 x 64] (+)= A[64 x 16] B[16 x 64] with both operands MN-major in
// shared memory (the transpose flags set): A stored [k][m] (the backward's
// dS^T, [keys][queries], read as dS), B stored [k][n] (K, [keys][D]), each
// described by desc_mn_major. 16-bit types only (the only ones wgmma
// transposes).
template <class T>
struct WgmmaMnMn;

#if ATTN_SM90_WGMMA
#define ATTN_SM90_MNMN_DEF(TY, PTXTY)                                                             \
  template <>                                                                                     \
  struct WgmmaMnMn<TY> {                                                                          \
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t a, uint64_t b,             \
                                              bool accumulate) {                                  \
      asm volatile(                                                                               \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                            \
          "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTXTY "." PTXTY                           \
          " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "   \
          "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, "  \
          "1, 1, 1, 1;\n}\n"                                                                      \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),   \
            "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),            \
            "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),         \
            "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),         \
            "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),         \
            "+f"(d[31])                                                                           \
          : "l"(a), "l"(b), "r"(int(accumulate)));                                                \
    }                                                                                             \
  };
#else
#define ATTN_SM90_MNMN_DEF(TY, PTXTY)                                                 \
  template <>                                                                         \
  struct WgmmaMnMn<TY> {                                                              \
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t a, uint64_t b, \
                                              bool accumulate) {                      \
      (void)d, (void)a, (void)b, (void)accumulate;                                    \
    }                                                                                 \
  };
#endif
ATTN_SM90_MNMN_DEF(__half, "f16")
ATTN_SM90_MNMN_DEF(__nv_bfloat16, "bf16")
#undef ATTN_SM90_MNMN_DEF

// Copies a [ROWS][C] tile of 16-bit elements (row r at row_src(r), 16-byte
// aligned rows) into the swizzled panel layout at dst (1024-byte aligned)
// with cp.async, THREADS threads sharing the 16-byte chunks; rows >= valid
// become zeros (so that masked keys multiply finite values): their
// copies read 0 bytes at row_src(0).
template <int ROWS, int C, int THREADS, class RowSrc>
__device__ __forceinline__ void load_swizzled(uint32_t dst, int valid, int tid, RowSrc&& row_src) {
  constexpr int kChunks = C / 8, kTotal = ROWS * kChunks;
  static_assert(THREADS % kChunks == 0, "a thread keeps one column chunk");
  constexpr int kRowStep = THREADS / kChunks;
  const int ch = tid % kChunks, r = tid / kChunks;
#pragma unroll
  for (int i = 0; i < (kTotal + THREADS - 1) / THREADS; ++i) {
    const int row = r + i * kRowStep;
    if (kTotal % THREADS != 0 && row >= ROWS) break;
    const bool ok = row < valid;
    const auto* g = ok ? row_src(row) + ch * 8 : row_src(0);
    const uint32_t s = dst + swizzled_offset(ROWS, row, ch * 8);
    const int bytes = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(bytes));
  }
}

// A tile whose row r is at src + r * stride.
template <int ROWS, int C, int THREADS, class T>
__device__ __forceinline__ void load_tile_swizzled(uint32_t dst, const T* src, int64_t stride,
                                                   int valid, int tid) {
  load_swizzled<ROWS, C, THREADS>(dst, valid, tid,
                                  [&](int row) { return src + int64_t(row) * stride; });
}

// Gathered rows: row r of the tile is src + idx[r] * stride, idx's sign bit
// ignored (kMobaLastRound).
template <int ROWS, int C, int THREADS, class T>
__device__ __forceinline__ void load_rows_swizzled(uint32_t dst, const T* src, int64_t stride,
                                                   const int32_t* idx, int valid, int tid) {
  load_swizzled<ROWS, C, THREADS>(dst, valid, tid,
                                  [&](int row) { return src + int64_t(idx[row] & kMobaRowMask) * stride; });
}

}  // namespace attn::flash::sm90
