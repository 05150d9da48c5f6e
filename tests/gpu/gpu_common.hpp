// Helpers shared by the GPU test and the GPU timing program: fp16/bf16
// conversion on the host, CUDA error checks, strided tensors.
#pragma once

#include <attn/attn.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace gpu_test {

inline uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bitsf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf16(float f) {
  uint32_t u = fbits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float from_bf16(uint16_t h) { return bitsf(uint32_t(h) << 16); }

inline uint16_t to_fp16(float f) {
  const uint32_t x = fbits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t e8 = int32_t((x >> 23) & 0xffu);
  uint32_t man = x & 0x7fffffu;
  if (e8 == 0xff) return uint16_t(sign | 0x7c00u | (man ? 0x200u : 0u));
  const int32_t e = e8 - 127 + 15;
  if (e >= 31) return uint16_t(sign | 0x7c00u);
  if (e <= 0) {  // subnormal result: units of 2^-24
    if (e < -10) return uint16_t(sign);
    man |= 0x800000u;
    const int shift = 14 - e;
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = (uint32_t(e) << 10) | (man >> 13);
  const uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may round up to inf
  return uint16_t(sign | h);
}
inline float from_fp16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (e == 0x1f) return bitsf(sign | 0x7f800000u | (man << 13));
  if (e == 0) {
    const float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bitsf(sign | ((e + 112u) << 23) | (man << 13));
}

inline uint16_t to_half(attn_dtype_t t, float f) {
  return t == ATTN_DTYPE_BF16 ? to_bf16(f) : to_fp16(f);
}
inline float from_half(attn_dtype_t t, uint16_t h) {
  return t == ATTN_DTYPE_BF16 ? from_bf16(h) : from_fp16(h);
}
inline float round_half(attn_dtype_t t, float f) { return from_half(t, to_half(t, f)); }
// A quiet-NaN pattern used to poison outputs; never produced by the kernel.
inline uint16_t poison_half(attn_dtype_t t) { return t == ATTN_DTYPE_BF16 ? 0x7fa5u : 0x7e5au; }

#define GPU_CHECK(call)                                                                       \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

#define ATTN_CHECK(call)                                                                    \
  do {                                                                                      \
    attn_status_t s_ = (call);                                                              \
    if (s_ != ATTN_STATUS_SUCCESS) {                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call,                 \
                   attn_status_string(s_), attn_last_error_message());                      \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

// Exit code 77 (meson: skipped) unless a CUDA device is usable.
inline void skip_without_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIP: no CUDA device\n");
    std::exit(77);
  }
  attn_context_t ctx = nullptr;
  if (attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx) != ATTN_STATUS_SUCCESS) {
    std::printf("SKIP: CUDA backend unavailable: %s\n", attn_last_error_message());
    std::exit(77);
  }
  attn_context_destroy(ctx);
}

}  // namespace gpu_test
