// Limits of the CUDA kernels that the CPU backend does not have: grid
// dimensions (x at most 2^31 - 1 blocks, y and z at most 65535) and
// lengths, offsets, window bounds and diagonal shifts that reach the
// kernels as int32. Plain C++, so that tests/unit checks them without a
// GPU. The CUDA backend calls them at plan (and cache) creation, before it
// allocates anything: past a limit the call fails with NOT_SUPPORTED naming
// it, instead of a launch failing at execution or a narrowed value
// computing something else.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "core/error.hpp"
#include "plan/problem.hpp"

namespace attn::cuda {

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxGridX = kMaxInt32;
constexpr int64_t kMaxGridYZ = 65535;

// The window bounds as the kernels take them (kernels/flash/sequence.cuh):
// int32, negative for unbounded.
struct KernelWindow {
  int32_t left = -1, right = -1;
};

// A bound past the lengths and shifts (the loose reach) is unbounded, as
// the kernels have always taken it. One that stays but does not fit int32
// is unbounded too when it hides no key of any sequence (its exact reach:
// left hides key j of row i when j < i + off - left, so never once left >=
// lq - 1 + off; right when j > i + off + right, never once right >= lk - 1
// - off); any other cannot be passed on.
inline KernelWindow kernel_window(const Problem& p) {
  int64_t max_shift = 0, exact_left = 0, exact_right = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    max_shift = std::max(max_shift, std::abs(p.shift(b)));
    const int64_t lq = p.lq(b), lk = p.lk(b), off = lk - lq + p.shift(b);
    if (lq == 0 || lk == 0) continue;
    exact_left = std::max(exact_left, lq - 1 + off);
    exact_right = std::max(exact_right, lk - 1 - off);
  }
  const int64_t reach = p.seqlen_q + p.seqlen_kv + max_shift + 1;
  auto bound = [&](int64_t w, int64_t exact, const char* side) {
    if (w < 0 || w > reach || (w > kMaxInt32 && w >= exact)) return int32_t(-1);
    if (w > kMaxInt32)
      not_supported("backend CUDA: window_", side, " ", w,
                    " limits some row but does not fit the kernels' 32-bit window bounds");
    return int32_t(w);
  };
  return KernelWindow{bound(p.window.left, exact_left, "left"),
                      bound(p.window.right, exact_right, "right")};
}

// What every plan of the CUDA backend must fit, the dense family's grids
// first: the forward's {query tiles, heads_q, batch} and the dK/dV kernel's
// {KV tiles, heads_kv x group splits (at most heads_q), batch}.
inline void check_plan_limits(const Problem& p) {
  if (p.heads_q > kMaxGridYZ)
    not_supported("backend CUDA: more than 65535 query heads (heads_q is the grids' y)");
  if (p.batch > kMaxGridYZ)
    not_supported("backend CUDA: a batch of more than 65535 sequences (batch is the grids' z)");
  // Lengths and offsets in 32-bit arithmetic.
  const int64_t max_len = int64_t(1) << 30;
  if (p.seqlen_q >= max_len || p.seqlen_kv >= max_len || p.total_q() >= max_len * 2 ||
      p.total_kv() >= max_len * 2)
    not_supported("backend CUDA: seqlen_q ", p.seqlen_q, ", seqlen_kv ", p.seqlen_kv,
                  " (tokens in all ", p.total_q(), " and ", p.total_kv(),
                  "): the kernels take sequences of less than 2^30 tokens and batches of ",
                  "less than 2^31");
  // Row-wise backward kernels: (token, head) rows in 64-bit, blocks in 32:
  // dQ's rows, and the fp32 dK/dV accumulators' (split groups: every key
  // row; cut block-sparse lists: whole tiles of at most 128 keys).
  if (p.backward && p.total_q() * p.heads_q >= (int64_t(1) << 33))
    not_supported("backend CUDA: a backward pass over ", p.total_q(), " query tokens x heads_q ",
                  p.heads_q, ", 2^33 or more (token, head) rows");
  if (p.backward && (p.total_kv() + p.batch * 128) * p.heads_kv >= (int64_t(1) << 33))
    not_supported("backend CUDA: a backward pass over ", p.total_kv(), " key tokens x heads_kv ",
                  p.heads_kv, ", 2^33 or more (token, head) rows of dK/dV accumulators");
  // Each sequence's diagonal offset lk - lq + shift is an int in the
  // kernels, the shift an int32 in device memory.
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t off = p.lk(b) - p.lq(b) + p.shift(b);
    if (std::abs(p.shift(b)) > kMaxInt32 || std::abs(off) > kMaxInt32)
      not_supported("backend CUDA: sequence ", b, "'s diagonal offset ", off,
                    " does not fit the kernels' 32 bits");
  }
  (void)kernel_window(p);
}

// A KV cache's pages on the CUDA backend: the append kernel's copy runs and
// the decode kernel's parameters hold a token slot of a page in an int32.
inline void check_kv_page_size(int64_t page_size) {
  if (page_size > kMaxInt32)
    not_supported("config->page_size: ", page_size,
                  " tokens per page; the CUDA KV kernels take at most 2^31 - 1");
}

// Block-sparse tile lists: list slot * tiles + tile is an int in the
// kernels (and the lists' offsets, one per list, are counted alike).
inline void check_tile_lists(int64_t slots, int64_t tiles) {
  if (slots * tiles > kMaxInt32)
    not_supported("block mask: ", slots, " (batch, head) slots x ", tiles,
                  " tiles is more than the CUDA kernels' 2^31 - 1 tile lists");
}

}  // namespace attn::cuda
