// The per-sequence set-up of the kernels that own one query tile (the
// forward and the deterministic dQ kernel): where the tile's sequence starts
// (varlen offsets), its lengths, and the keys each query row sees.
#pragma once

#include <cstdint>

namespace attn::flash {

// Query tile m_block (rows [r0, r0 + rows)) of sequence b. P is FwdParams
// or BwdParams (cu_q, cu_kv, seqlen_q, seqlen_kv, window_left, window_right,
// diag_shift).
struct QueryTile {
  int lq, lk;             // this sequence's lengths
  int64_t q_tok, kv_tok;  // its first token (varlen), else 0
  int r0, rows;
  int off;  // lk - lq (+ diag_shift[b]): causal and window bounds are bottom-right aligned
  // The tile's key range: first row [lo_first, hi_first], last row
  // [lo_last, hi_last]; no row sees a key when hi_last < lo_first.
  int lo_first, hi_first, lo_last, hi_last;
};

// Visible keys of query row i: [key_lo(i), key_hi(i)], clamped to [0, lk).
// The window bounds come from the parameters at each use, as they did
// before this helper: copies in the struct changed how ptxas scheduled the
// forward's KV loop at its register limit.
template <class P>
__device__ __forceinline__ int key_lo(const P& p, const QueryTile& t, int i) {
  if (p.window_left < 0) return 0;
  const long long x = (long long)i + t.off - p.window_left;
  return int(x < 0 ? 0 : (x > t.lk ? t.lk : x));
}
template <class P>
__device__ __forceinline__ int key_hi(const P& p, const QueryTile& t, int i) {
  if (p.window_right < 0) return t.lk - 1;
  const long long x = (long long)i + t.off + p.window_right;
  return int(x < -1 ? -1 : (x > t.lk - 1 ? t.lk - 1 : x));
}

// False when the tile starts past the end of its sequence (nothing to do).
template <int BM, class P>
__device__ __forceinline__ bool query_tile_of(const P& p, int b, int m_block, QueryTile& t) {
  t.lq = p.seqlen_q, t.lk = p.seqlen_kv;
  t.q_tok = 0, t.kv_tok = 0;
  if (p.cu_q != nullptr) {
    t.q_tok = p.cu_q[b];
    t.kv_tok = p.cu_kv[b];
    t.lq = p.cu_q[b + 1] - int(t.q_tok);
    t.lk = p.cu_kv[b + 1] - int(t.kv_tok);
  }
  t.r0 = m_block * BM;
  if (t.r0 >= t.lq) return false;
  t.rows = min(BM, t.lq - t.r0);
  t.off = t.lk - t.lq + (p.diag_shift != nullptr ? p.diag_shift[b] : 0);
  t.lo_first = key_lo(p, t, t.r0), t.hi_first = key_hi(p, t, t.r0);
  t.lo_last = key_lo(p, t, t.r0 + t.rows - 1), t.hi_last = key_hi(p, t, t.r0 + t.rows - 1);
  return true;
}

// The dense KV tiles of BN keys the tile's rows see: tiles [end - count,
// end), count returned (0: no row sees a key).
template <int BN>
__device__ __forceinline__ int dense_kv_tiles(const QueryTile& t, int& end) {
  end = t.hi_last / BN + 1;
  return t.hi_last < t.lo_first ? 0 : end - t.lo_first / BN;
}

// True when every row of the tile sees every key of the KV tile that starts
// at key c0 (no element predicate needed).
template <int BN>
__device__ __forceinline__ bool dense_tile_full(const QueryTile& t, int c0) {
  return c0 + BN <= t.lk && c0 >= t.lo_last && c0 + BN - 1 <= t.hi_first;
}

}  // namespace attn::flash
