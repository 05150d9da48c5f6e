#include "cpu/moba_select.hpp"

#include <algorithm>
#include <cmath>

#include "core/dtype.hpp"

namespace attn::cpu {

void moba_pool(const Problem& p, const void* k, int64_t b, int64_t hk, int64_t kb, float* pooled) {
  const int64_t j0 = kb * p.moba_block, j1 = std::min(p.lk(b), j0 + p.moba_block);
  const int64_t dqk = p.head_dim_qk;
  std::fill(pooled, pooled + dqk, 0.0f);
  if (j1 <= j0) return;  // past a shorter sequence's keys (varlen): never gated
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t off = p.offset(ATTN_TENSOR_K, b, j, hk);
    for (int64_t c = 0; c < dqk; ++c) pooled[c] += load_as_float(k, off + c, p.dtype);
  }
  const float inv = 1.0f / float(j1 - j0);
  for (int64_t c = 0; c < dqk; ++c) pooled[c] *= inv;
}

void moba_select_row(const Problem& p, const void* q, const float* pooled, int64_t b, int64_t hs,
                     int64_t i, float* gates, int32_t* order, uint64_t* bits, int64_t words) {
  std::fill(bits, bits + words, 0);
  if (i >= p.lq(b)) return;                 // past a shorter sequence's rows (varlen)
  const int64_t d = i + p.lk(b) - p.lq(b);  // the aligned diagonal
  if (d < 0) return;                        // the row sees no key at all
  const int64_t own = d / p.moba_block, nb = p.moba_num_blocks(), dqk = p.head_dim_qk;
  const int64_t h0 = p.moba_shared ? hs * p.group() : hs;
  const int64_t h1 = p.moba_shared ? h0 + p.group() : hs + 1;
  for (int64_t kb = 0; kb < own; ++kb) gates[kb] = 0.0f;
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t qoff = p.offset(ATTN_TENSOR_Q, b, i, h);
    const float* keys = pooled + (h / p.group()) * nb * dqk;
    for (int64_t kb = 0; kb < own; ++kb) {
      float g = 0.0f;
      for (int64_t c = 0; c < dqk; ++c) g += load_as_float(q, qoff + c, p.dtype) * keys[kb * dqk + c];
      gates[kb] += g;
    }
  }
  const int64_t take = std::min(own, p.moba_top_k);
  for (int64_t kb = 0; kb < own; ++kb) order[kb] = int32_t(kb);
  // NaN gates first (a NaN in q or in a block's keys reaches the output, as
  // in dense attention), then the largest gate; equal gates: the lower block
  // index. A strict weak order even with NaNs, which partial_sort requires.
  std::partial_sort(order, order + take, order + own, [&](int32_t x, int32_t y) {
    const bool nx = std::isnan(gates[x]), ny = std::isnan(gates[y]);
    if (nx != ny) return nx;
    if (!nx && gates[x] != gates[y]) return gates[x] > gates[y];
    return x < y;
  });
  for (int64_t t = 0; t < take; ++t) bits[order[t] / 64] |= uint64_t(1) << (order[t] % 64);
  bits[own / 64] |= uint64_t(1) << (own % 64);
}

}  // namespace attn::cpu
