// Arithmetic on sizes that come from caller-supplied values (shapes, page
// counts, block sizes, thread counts). Their products can pass 64 bits: a
// signed product is then undefined behaviour and a wrapped size_t a buffer
// too small for what is written into it. These helpers saturate instead, so
// that a chain of products and sums needs one comparison at its end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace attn {

// Sizes are size_t and compared with 64-bit limits below.
static_assert(sizeof(size_t) == 8, "libattn needs a 64-bit size_t");

// The most bytes a workspace, pool or table sized from caller values may
// need. Far below SIZE_MAX and INT64_MAX, so that offsets inside such a
// region, plus alignment slack, stay exact in both.
constexpr uint64_t kMaxBytes = uint64_t(1) << 62;

// The largest logit softcap. The kernels work in base 2: they multiply the
// cap by log2(e) and the backward divides by that product, which past
// about 2.4e38 overflows (NaN outputs) and past about 6e37 leaves the
// normal fp32 range (flushed to 0 on the GPU).
constexpr float kMaxSoftcap = 1e30f;

// The largest batch, head count or sequence length: work units, varlen
// offsets and block-mask tables count them in 32 bits.
constexpr int64_t kMaxShapeCount = std::numeric_limits<int32_t>::max();

// The saturated value: every result that does not fit in 64 bits.
constexpr uint64_t kSaturated = std::numeric_limits<uint64_t>::max();

inline uint64_t sat_add(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? kSaturated : r;
}

inline uint64_t sat_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? kSaturated : r;
}

// The product of any number of factors (each a non-negative count).
template <class... Rest>
uint64_t sat_mul(uint64_t a, uint64_t b, Rest... rest) {
  return sat_mul(sat_mul(a, b), uint64_t(rest)...);
}

// n rounded up to a multiple of a (a > 0), saturated.
inline uint64_t sat_align_up(uint64_t n, uint64_t a) {
  const uint64_t r = n % a;
  return r == 0 ? n : sat_add(n, a - r);
}

// ceil(a / b) for a >= 0, b > 0, without forming a + b - 1 (which overflows
// for a near INT64_MAX).
inline int64_t ceil_div_nonneg(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace attn
