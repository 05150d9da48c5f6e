// Element types: sizes, names and scalar conversions to and from fp32.
// fp16 and bf16 are stored as uint16_t bit patterns; conversions round to
// nearest even and keep infinities and NaN.
#pragma once

#include <attn/attn.h>

#include <cstdint>
#include <cstring>

namespace attn {

inline bool dtype_is_valid(int dtype) {
  return dtype == ATTN_DTYPE_FP32 || dtype == ATTN_DTYPE_FP16 || dtype == ATTN_DTYPE_BF16;
}

inline size_t dtype_size(attn_dtype_t dtype) { return dtype == ATTN_DTYPE_FP32 ? 4 : 2; }

inline const char* dtype_name(attn_dtype_t dtype) {
  switch (dtype) {
    case ATTN_DTYPE_FP32: return "fp32";
    case ATTN_DTYPE_FP16: return "fp16";
    case ATTN_DTYPE_BF16: return "bf16";
  }
  return "unknown";
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                         // round to nearest even
  return uint16_t(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    // zero or subnormal: man * 2^-24
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_fp16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // result is subnormal (or zero): value / 2^-24, rounded to nearest even
    float v = bits_float(a) * 16777216.0f;  // exact scaling by 2^24
    // v < 1024; round to nearest even integer
    uint32_t r = uint32_t(v);
    float frac = v - float(r);
    if (frac > 0.5f || (frac == 0.5f && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  // normal: rebias exponent, round mantissa from 23 to 10 bits
  uint32_t v = a - 0x38000000u;  // exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return uint16_t(sign | (v >> 13));
}

// Reads element i of a tensor of `dtype` as fp32.
inline float load_as_float(const void* base, int64_t i, attn_dtype_t dtype) {
  switch (dtype) {
    case ATTN_DTYPE_FP32: return static_cast<const float*>(base)[i];
    case ATTN_DTYPE_FP16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case ATTN_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

inline void store_from_float(void* base, int64_t i, attn_dtype_t dtype, float v) {
  switch (dtype) {
    case ATTN_DTYPE_FP32: static_cast<float*>(base)[i] = v; break;
    case ATTN_DTYPE_FP16: static_cast<uint16_t*>(base)[i] = float_to_fp16(v); break;
    case ATTN_DTYPE_BF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
  }
}

}  // namespace attn
