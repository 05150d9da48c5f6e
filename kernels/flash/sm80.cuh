// sm_80 building blocks: cp.async, ldmatrix, mma.sync m16n8k16 and fast
// exp2, as thin inline-PTX wrappers.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4; each b32
// register holds two 16-bit elements, the lower column in the low half):
//   A 16x16 (row-major): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 8+2t..)  a3 (g+8, 8+2t..)
//   B 16x8  (k x n):     b0 (k = 2t..2t+1, n = g)          b1 (k = 8+2t.., n = g)
//   C 16x8  fp32:        c0 c1 (g, 2t..2t+1)               c2 c3 (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "moba/moba_params.cuh"

namespace attn::flash {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy through L2 only. !valid writes zeros and
// reads nothing (tile rows past the end of a sequence).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// 4 bytes (both addresses 4-byte aligned), through L1.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 4-byte global -> shared copy through L1 (row statistics); !valid writes
// zeros and reads nothing.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i,
// and register i receives matrix i (row g, columns 2t, 2t+1).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// The same, transposed: register i receives matrix i (rows 2t, 2t+1, column g).
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b on tensor cores, fp32 accumulation.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to nearest into one b32 register (lo in the low half).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// An output accumulator times its row's scale (1 / l, or a merge weight):
// 0 when the scale is 0 (a row that saw no key), also where the accumulator
// is not finite, which a P of 0 times a non-finite V at a key the row does
// not see leaves there (0 * Inf = NaN).
__device__ __forceinline__ float o_scaled(float acc, float scale) {
  return scale != 0.0f ? acc * scale : 0.0f;
}

// max(a, b), NaN if either is (fmaxf drops a NaN operand): merges of (O,
// LSE) states take it so that a NaN row stays NaN rather than empty.
__device__ __forceinline__ float max_keep_nan(float a, float b) {
  return (a != a || b != b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
}

// 2^x, relative error ~2^-22; 2^-inf = +0, so masked scores vanish.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The softcapped logit cap * tanh(y) from x = 2 y log2(e) (a score times
// the kernels' softcap_in), and q = 2 / (e^{2y} + 1), so that tanh(y) =
// 1 - q and the backward's 1 - tanh^2 = q (2 - q). 1 - q costs one exp2 and
// is exact at both saturations, but its error is absolute (~1e-7): with a
// cap far above the logits, z = cap tanh(y) ~ u would carry an error of
// ~1e-7 cap. Below |y| = 1/16 the series y - y^3/3 + 2 y^5/15 keeps the
// relative precision (truncation under 1e-9 relative); above it 1 - q is
// within 2e-6 relative, far inside what bf16 and fp16 inputs allow.
__device__ __forceinline__ float softcap_logit(float x, float cap, float& q) {
  q = __fdividef(2.0f, fast_exp2(x) + 1.0f);
  const float y = x * 0.34657359027997264f;  // ln(2) / 2
  const float y2 = y * y;
  const float t = fmaf(y * y2, fmaf(y2, 2.0f / 15.0f, -1.0f / 3.0f), y);
  return cap * (fabsf(y) < 0.0625f ? t : 1.0f - q);
}

// p[0] += a, p[1] += b in global memory, the result unused (8-byte aligned
// p). One vector reduction on sm_90+, two scalar ones before.
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// sm_90+ bulk reductions (the TMA unit): dst[0, bytes) += src[0, bytes) as
// fp32, src in shared memory, both 16-byte aligned, bytes a multiple of 16.
// The issuing thread's registers are free at once, unlike a RED's, which
// stay locked until the LSU reads them. Generic-proxy writes to src must be
// made visible first (fence_proxy_async_shared, then a barrier), and src
// may be rewritten after bulk_wait_read<0> in the issuing thread. Built for
// older devices these trap: callers use them only where the host chose a
// configuration that needs sm_90.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(src), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until this thread's committed bulk operations but N have read
// their source (shared memory reusable).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
// Waits until this thread's committed bulk operations but N are complete.
template <int N>
__device__ __forceinline__ void bulk_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// An opaque copy of x: values derived from it are recomputed where used
// instead of being hoisted out of the KV loop into registers.
__device__ __forceinline__ int64_t opaque(int64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}

// How load_tile and load_rows share a [ROWS][D] tile among THREADS threads:
// thread tid copies 16-byte column chunk tid % kPitch (if < kChunks) of
// rows tid / kPitch + i * kRowStep into shared rows of pitch kLd elements.
template <int ROWS, int D, int THREADS>
struct TileCopy {
  static constexpr int kChunks = D / 8;
  static constexpr int kPitch = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr int kRowStep = THREADS / kPitch;
  static constexpr int kLd = D + 8;
  static_assert(kChunks <= 32 && ROWS % kRowStep == 0, "tile rows divide among threads");
};

// Copies a [ROWS][D] tile (row r at src + r * stride) into shared memory at
// dst with row pitch D + 8; rows >= valid become zeros (so that masked keys
// multiply finite values). Each thread copies one 16-byte column chunk of
// every kRowStep-th row; with D = 96 a quarter of the threads idle.
template <int ROWS, int D, int THREADS, class T>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* src, int64_t stride, int valid,
                                          int tid) {
  using C = TileCopy<ROWS, D, THREADS>;
  constexpr int kRowStep = C::kRowStep, kLd = C::kLd;
  const int ch = tid % C::kPitch, r = tid / C::kPitch;
  if (ch >= C::kChunks) return;
  const T* g = src + r * stride + ch * 8;
  const int64_t step = kRowStep * stride;
  const uint32_t s = dst + uint32_t(r * kLd + ch * 8) * 2u;
#pragma unroll
  for (int i = 0; i < ROWS / kRowStep; ++i) {
    const bool ok = r + i * kRowStep < valid;
    cp_async_16(s + uint32_t(i * kRowStep * kLd * 2), ok ? g : src, ok);
    g += step;
  }
}

// load_tile for gathered rows: row r of the tile is src + idx[r] * stride
// (rows >= valid become zeros), idx's sign bit ignored (kMobaLastRound).
template <int ROWS, int D, int THREADS, class T>
__device__ __forceinline__ void load_rows(uint32_t dst, const T* src, int64_t stride,
                                          const int32_t* idx, int valid, int tid) {
  using C = TileCopy<ROWS, D, THREADS>;
  constexpr int kRowStep = C::kRowStep, kLd = C::kLd;
  const int ch = tid % C::kPitch, r = tid / C::kPitch;
  if (ch >= C::kChunks) return;
  const uint32_t s = dst + uint32_t(r * kLd + ch * 8) * 2u;
#pragma unroll
  for (int i = 0; i < ROWS / kRowStep; ++i) {
    const int row = r + i * kRowStep;
    const bool ok = row < valid;
    const T* g = ok ? src + int64_t(idx[row] & kMobaRowMask) * stride + ch * 8 : src;
    cp_async_16(s + uint32_t(i * kRowStep * kLd * 2), g, ok);
  }
}

}  // namespace attn::flash
