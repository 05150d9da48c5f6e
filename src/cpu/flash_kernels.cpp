// FlashAttention on the CPU: tiled, online softmax, no L x L matrix.
//
// This file is compiled once per instruction set (meson passes -mavx2 -mfma,
// -mavx512f ..., or nothing) with ATTN_CPU_ISA naming the namespace; the
// vector width follows from the compiler's target macros. Everything is fp32
// inside; fp16/bf16 inputs are converted while tiles are packed.
//
// Shapes (one work item, per head):
//   Qp  [tile_q][dqk_pad]    query rows, pre-scaled (see q_scale)
//   Kt  [dqk][tile_kv]       keys, transposed: the score GEMM's B operand
//   Vp  [tile_kv][dv_pad]    values (forward), Vt [dv][tile_kv] (backward)
//   S   [tile_q][tile_kv]    scores in log2 units, then probabilities
//   Oacc[tile_q][dv_pad]     unnormalised output
// Scores are kept in base 2 (s2 = z * log2 e, z the natural logit) so that
// the softmax needs exp2 only; LSE is converted back to natural log.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "attn_config.h"
#include "core/dtype.hpp"
#include "core/workspace.hpp"
#include "cpu/cpu_kernels.hpp"
#include "cpu/moba_select.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attn::cpu::ATTN_CPU_ISA {
namespace {

#if defined(__AVX512F__)
constexpr int W = 16;   // floats per vector
constexpr int MR = 12;  // register block: MR rows x NV vectors
#elif defined(__AVX2__)
constexpr int W = 8;
constexpr int MR = 6;
#else
constexpr int W = 4;
constexpr int MR = 6;
#endif
constexpr int NV = 2;
constexpr int NR = NV * W;
// Keys are padded to a multiple of both block shapes: they are the columns of
// the score GEMMs (NR) and the rows of the dK/dV GEMMs (MR).
constexpr int kKeyPad = std::lcm(MR, NR);
static_assert(kTile % kKeyPad == 0, "tile must hold whole register blocks");

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// x - 0 is x for every x (also -0), so this folds to one broadcast; 0 + x would not.
inline vf vbroadcast(float x) { return x - vf{}; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// 2^x for a vector, relative error ~2e-7. Inputs below -127 give exactly 0
// (so -inf, a masked score, gives 0); NaN propagates (the clamps keep it).
inline vf vexp2(vf x) {
  x = x > vbroadcast(127.0f) ? vbroadcast(127.0f) : x;
  x = x < vbroadcast(-127.0f) ? vbroadcast(-127.0f) : x;
  // round to nearest with the 1.5 * 2^23 trick; f in [-0.5, 0.5]
  const vf magic = vbroadcast(12582912.0f);
  vf n = (x + magic) - magic;
  vf f = x - n;
  // 2^f = e^(f ln2), Taylor to degree 6 (error < 1.2e-7 on |f| <= 0.5)
  vf p = vbroadcast(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;  // n = -127 gives 0
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// tanh(y) for a vector. 1 - 2 / (e^(2y) + 1) costs one exp2, but its error
// is ~1e-7 absolute, not relative: small y (a softcap far above the logits)
// would lose their digits to the cancellation. Below |y| = 0.25 the odd
// Taylor series to y^9 is used instead (truncation < 1e-8 relative there).
inline vf vtanh(vf y) {
  const vf e = vexp2(y * (2.0f * kLog2e));
  const vf large = 1.0f - 2.0f / (e + 1.0f);
  const vf y2 = y * y;
  vf p = vbroadcast(62.0f / 2835.0f);
  p = p * y2 - 17.0f / 315.0f;
  p = p * y2 + 2.0f / 15.0f;
  p = p * y2 - 1.0f / 3.0f;
  const vf small = y + y * y2 * p;
  const vf ay = y < vbroadcast(0.0f) ? -y : y;
  return ay < vbroadcast(0.25f) ? small : large;
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}
inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// ---------------------------------------------------------------------------
// GEMM on packed tiles: C[M x N] (+)= A[M x K] * B[K x N].
// A element (i, k) at A[i * rsa + k * csa] (any strides: it is broadcast, so
// A may be a transposed view); B and C row-major. M % MR == 0, N % NR == 0.

template <bool Accumulate>
inline void micro_kernel(int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B,
                         int64_t ldb, float* C, int64_t ldc) {
  vf acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Accumulate ? vload(C + r * ldc + v * W) : vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * W);
    const float* a = A + k * csa;
    for (int r = 0; r < MR; ++r) {
      vf ar = vbroadcast(a[r * rsa]);
      for (int v = 0; v < NV; ++v) acc[r][v] += ar * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) vstore(C + r * ldc + v * W, acc[r][v]);
}

template <bool Accumulate>
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa,
          const float* B, int64_t ldb, float* C, int64_t ldc) {
  for (int64_t j = 0; j < N; j += NR)
    for (int64_t i = 0; i < M; i += MR)
      micro_kernel<Accumulate>(K, A + i * rsa, rsa, csa, B + j, ldb, C + i * ldc + j, ldc);
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// ---------------------------------------------------------------------------
// Packing: strided tensor rows of any dtype -> fp32 tiles with zero padding.

// dst[i][c] = scale * src[row i][c] for i < rows, c < cols; zero up to
// (rows_pad, ld). Row i of the source starts at base + i * row_stride.
void pack_rows(const void* src, attn_dtype_t dtype, int64_t base, int64_t row_stride, int64_t rows,
               int64_t cols, float scale, float* dst, int64_t rows_pad, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    float* d = dst + i * ld;
    int64_t s = base + i * row_stride;
    if (dtype == ATTN_DTYPE_FP32) {
      const float* f = static_cast<const float*>(src) + s;
      for (int64_t c = 0; c < cols; ++c) d[c] = scale * f[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) d[c] = scale * load_as_float(src, s + c, dtype);
    }
    for (int64_t c = cols; c < ld; ++c) d[c] = 0.0f;
  }
  for (int64_t i = rows; i < rows_pad; ++i) std::fill(dst + i * ld, dst + (i + 1) * ld, 0.0f);
}

// dst[c][j] = src[row j][c] for j < rows, c < cols; columns rows..cols_pad
// of every dst row are zero. ld >= cols_pad.
void pack_transposed(const void* src, attn_dtype_t dtype, int64_t base, int64_t row_stride,
                     int64_t rows, int64_t cols, float* dst, int64_t cols_pad, int64_t ld) {
  for (int64_t j = 0; j < rows; ++j) {
    int64_t s = base + j * row_stride;
    if (dtype == ATTN_DTYPE_FP32) {
      const float* f = static_cast<const float*>(src) + s;
      for (int64_t c = 0; c < cols; ++c) dst[c * ld + j] = f[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[c * ld + j] = load_as_float(src, s + c, dtype);
    }
  }
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t j = rows; j < cols_pad; ++j) dst[c * ld + j] = 0.0f;
}

// dst row (base + i * row_stride) = scale * acc[i][0..cols) for i < rows.
void store_rows(const float* acc, int64_t ld, int64_t rows, int64_t cols, float scale, void* dst,
                attn_dtype_t dtype, int64_t base, int64_t row_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* a = acc + i * ld;
    int64_t s = base + i * row_stride;
    if (dtype == ATTN_DTYPE_FP32) {
      float* f = static_cast<float*>(dst) + s;
      for (int64_t c = 0; c < cols; ++c) f[c] = scale * a[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) store_from_float(dst, s + c, dtype, scale * a[c]);
    }
  }
}

// ---------------------------------------------------------------------------
// Scores for one (query tile, KV tile) pair, shared by forward and backward.

struct TileView {
  const Problem* p;
  const SequenceMask* mask;
  int64_t r0, m, m_pad;  // query rows [r0, r0 + m), padded to m_pad
  int64_t c0, n, n_pad;  // keys [c0, c0 + n), padded to n_pad
  bool full;             // no element of the tile is masked
};

// Scale folded into the packed Q rows: with no softcap, the GEMM then yields
// base-2 logits directly.
inline float q_scale(const Problem& p) {
  return p.softcap > 0.0f ? p.scale : p.scale * kLog2e;
}

// S = Qp * Kt, then softcap, then -inf outside the mask (and in the padding
// columns), leaving base-2 logits for rows < m.
void compute_scores(const TileView& t, const float* qp, int64_t ldq, const float* kt, float* s) {
  const Problem& p = *t.p;
  gemm<false>(t.m_pad, t.n_pad, p.head_dim_qk, qp, ldq, 1, kt, kTile, s, kTile);
  if (p.softcap > 0.0f) {
    // z = cap * tanh(u / cap), u the scaled logit, in base 2
    const float inv_cap = 1.0f / p.softcap;
    const float out = p.softcap * kLog2e;
    for (int64_t i = 0; i < t.m; ++i) {
      float* row = s + i * kTile;
      for (int64_t j = 0; j < t.n_pad; j += W) vstore(row + j, vtanh(vload(row + j) * inv_cap) * out);
    }
  }
  if (!t.full || t.n != t.n_pad) {
    for (int64_t i = 0; i < t.m; ++i) {
      float* row = s + i * kTile;
      int64_t lo = 0, hi = t.n - 1;
      if (!t.full) {
        lo = std::max<int64_t>(0, t.mask->key_lo(t.r0 + i) - t.c0);
        hi = std::min<int64_t>(t.n - 1, t.mask->key_hi(t.r0 + i) - t.c0);
      }
      if (lo > hi) {
        std::fill(row, row + t.n_pad, kNegInf);
        continue;
      }
      std::fill(row, row + lo, kNegInf);
      std::fill(row + hi + 1, row + t.n_pad, kNegInf);
    }
  }
}

// Block-sparse plans, partial tiles: -inf where the block selection hides a
// key (compute_scores applied the dense mask already).
void hide_unselected(const KernelPlan& kp, int64_t b, int64_t hk, const TileView& t, float* s) {
  const BlockTileSchedule& sched = *kp.sparse;
  const int64_t mb = sched.mask_batch(b), mh = sched.mask_head(hk);
  for (int64_t i = 0; i < t.m; ++i) {
    float* row = s + i * kTile;
    sched.mask().for_each_hidden(mb, mh, t.r0 + i, t.c0, t.c0 + t.n, [&](int64_t j0, int64_t j1) {
      std::fill(row + (j0 - t.c0), row + (j1 - t.c0), kNegInf);
    });
  }
}

// MoBA: the selection bit rows of sequence b, selecting head hs (row i at
// + i * moba_words).
inline const uint64_t* moba_rows(const KernelPlan& kp, char* ws, size_t offset, int64_t b,
                                 int64_t hs) {
  const Problem& p = *kp.problem;
  return reinterpret_cast<const uint64_t*>(ws + offset) +
         size_t(((b * p.moba_heads() + hs) * p.seqlen_q) * kp.moba_words);
}

// Whether any row of the tile selected a key block that meets its keys.
bool moba_meets(const KernelPlan& kp, const uint64_t* rows, const TileView& t) {
  const int64_t bs = t.p->moba_block;
  for (int64_t i = 0; i < t.m; ++i) {
    const uint64_t* bits = rows + (t.r0 + i) * kp.moba_words;
    for (int64_t kb = t.c0 / bs; kb * bs < t.c0 + t.n; ++kb)
      if ((bits[kb / 64] >> (kb % 64)) & 1u) return true;
  }
  return false;
}

// -inf where a row did not select the key's block (the causal mask is
// applied by compute_scores).
void hide_unselected_moba(const KernelPlan& kp, const uint64_t* rows, const TileView& t, float* s) {
  const int64_t bs = t.p->moba_block;
  for (int64_t i = 0; i < t.m; ++i) {
    const uint64_t* bits = rows + (t.r0 + i) * kp.moba_words;
    float* row = s + i * kTile;
    for (int64_t kb = t.c0 / bs; kb * bs < t.c0 + t.n; ++kb)
      if (!((bits[kb / 64] >> (kb % 64)) & 1u)) {
        const int64_t j0 = std::max(kb * bs, t.c0), j1 = std::min((kb + 1) * bs, t.c0 + t.n);
        std::fill(row + (j0 - t.c0), row + (j1 - t.c0), kNegInf);
      }
  }
}

// The MoBA selector over the whole batch, in two parallel loops of the
// enclosing team: pooled keys, then every row's selection.
void moba_select(const KernelPlan& kp, const void* q, const void* k, char* ws, size_t pooled_off,
                 size_t selection_off, float* scratch) {
  const Problem& p = *kp.problem;
  const int64_t nb = p.moba_num_blocks(), dqk = p.head_dim_qk;
  float* pooled = reinterpret_cast<float*>(ws + pooled_off);
  uint64_t* selection = reinterpret_cast<uint64_t*>(ws + selection_off);
  const int64_t pool_items = p.batch * p.heads_kv * nb;
#pragma omp for schedule(static)
  for (int64_t w = 0; w < pool_items; ++w)
    moba_pool(p, k, w / (p.heads_kv * nb), (w / nb) % p.heads_kv, w % nb, pooled + w * dqk);
  const int64_t rows = p.batch * p.moba_heads() * p.seqlen_q;
#pragma omp for schedule(dynamic, 16)
  for (int64_t w = 0; w < rows; ++w) {
    const int64_t b = w / (p.moba_heads() * p.seqlen_q);
    moba_select_row(p, q, pooled + b * p.heads_kv * nb * dqk, b, (w / p.seqlen_q) % p.moba_heads(),
                    w % p.seqlen_q, scratch, reinterpret_cast<int32_t*>(scratch + nb),
                    selection + w * kp.moba_words, kp.moba_words);
  }
}

inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline float* slice(char* thread_base, size_t offset_floats) {
  return reinterpret_cast<float*>(thread_base) + offset_floats;
}

// Tile g (global index), head h of a packed tensor.
inline float* packed_tile(char* ws, const PackedTensor& t, int64_t g, int64_t h) {
  return reinterpret_cast<float*>(ws + t.offset) + (size_t(g * t.heads + h) * t.tile_floats);
}

// Rows [r0, r0 + m) and their padding up to a multiple of MR.
struct RowSpan {
  int64_t r0, m, m_pad;
};
inline RowSpan q_rows(const DenseTileSchedule& sched, int64_t qt) {
  const int64_t r0 = sched.q_begin(qt), m = sched.q_end(qt) - r0;
  return {r0, m, round_up(m, MR)};
}
inline RowSpan kv_rows(const DenseTileSchedule& sched, int64_t kt) {
  const int64_t c0 = sched.kv_begin(kt), n = sched.kv_end(kt) - c0;
  return {c0, n, round_up(n, kKeyPad)};
}

// Packs KV tile u.tile of KV head hk: Kt [dqk][tile] always, V rows
// [tile][dv_pad] (forward) or Vt [dv][tile] and K rows [tile][dqk_pad]
// (backward), each when its destination is given.
void pack_kv_tile(const KernelPlan& kp, const void* k, const void* v, const Unit& u, int64_t hk,
                  float* kt, float* v_rows, float* vt, float* k_rows) {
  const Problem& p = *kp.problem;
  const DenseTileSchedule sched(p.sequence_mask(u.b), kTile, kTile);
  const RowSpan r = kv_rows(sched, u.tile);
  const int64_t koff = p.offset(ATTN_TENSOR_K, u.b, r.r0, hk);
  const int64_t voff = p.offset(ATTN_TENSOR_V, u.b, r.r0, hk);
  const int64_t kseq = p.strides[ATTN_TENSOR_K].seq, vseq = p.strides[ATTN_TENSOR_V].seq;
  pack_transposed(k, p.dtype, koff, kseq, r.m, p.head_dim_qk, kt, r.m_pad, kTile);
  if (v_rows) pack_rows(v, p.dtype, voff, vseq, r.m, p.head_dim_v, 1.0f, v_rows, r.m_pad, kp.dv_pad);
  if (vt) pack_transposed(v, p.dtype, voff, vseq, r.m, p.head_dim_v, vt, r.m_pad, kTile);
  if (k_rows)
    pack_rows(k, p.dtype, koff, kseq, r.m, p.head_dim_qk, 1.0f, k_rows, r.m_pad, kp.dqk_pad);
}

// ---------------------------------------------------------------------------
// Forward

// How a kernel finds its tiles: the window's range (dense), the block-sparse
// schedule, or the window's range filtered by the MoBA selection.
enum class Mode { dense, block, moba };

// Calls item(mode) with the plan's Mode as a compile-time constant
// (std::integral_constant), so that item can pick the kernel instance.
template <class Item>
void with_mode(const KernelPlan& kp, Item&& item) {
  if (kp.sparse)
    item(std::integral_constant<Mode, Mode::block>{});
  else if (kp.problem->moba_block > 0)
    item(std::integral_constant<Mode, Mode::moba>{});
  else
    item(std::integral_constant<Mode, Mode::dense>{});
}

// The two helpers below stand for blocks the kernels would otherwise
// repeat; they are always inlined, so that each kernel compiles as if the
// block were written in place.

// S = the scores of t's query rows against the packed Kt of its KV tile,
// -inf where the block mask (of a partial tile) or the MoBA selection hides
// a key.
template <Mode M>
[[gnu::always_inline]] inline void masked_scores(const KernelPlan& kp, const uint64_t* moba,
                                                 int64_t b, int64_t hk, const TileView& t,
                                                 const float* qp, int64_t ldq, const float* kt,
                                                 float* s) {
  compute_scores(t, qp, ldq, kt, s);
  if constexpr (M == Mode::block)
    if (!t.full) hide_unselected(kp, b, hk, t, s);
  if constexpr (M == Mode::moba) hide_unselected_moba(kp, moba, t, s);
}

// Which tiles for_each_tile_pair walks: the KV tiles a query tile sees, or
// (the transpose) the query tiles that see a KV tile.
enum class Walk { kv_of_q, q_of_kv };

// Calls visit(other, full) for each tile on the other side of tile `own`
// (query tile for kv_of_q, KV tile for q_of_kv) that the pair is visited
// for: the block-sparse list, or the window's range, of which MoBA keeps
// the pairs its selection meets (t's fixed side is set for moba_meets; the
// walked side is set here).
template <Mode M, Walk D, class Visit>
[[gnu::always_inline]] inline void for_each_tile_pair(const KernelPlan& kp,
                                                      const DenseTileSchedule& sched,
                                                      const uint64_t* moba, int64_t b, int64_t hk,
                                                      int64_t own, TileView& t, Visit&& visit) {
  constexpr bool kv_of_q = D == Walk::kv_of_q;
  if constexpr (M == Mode::block) {
    const int64_t slot = kp.sparse->slot(b, hk);
    for (const TileVisit& v :
         kv_of_q ? kp.sparse->kv_tiles_of(slot, own) : kp.sparse->q_tiles_of(slot, own))
      visit(v.tile, v.full != 0);
  } else {
    const TileRange range = kv_of_q ? sched.kv_tiles_of(own) : sched.q_tiles_of(own);
    for (int64_t other = range.begin; other < range.end; ++other) {
      if constexpr (M == Mode::moba) {
        if constexpr (kv_of_q) {
          const RowSpan cr = kv_rows(sched, other);
          t.c0 = cr.r0, t.n = cr.m;
        } else {
          const RowSpan qr = q_rows(sched, other);
          t.r0 = qr.r0, t.m = qr.m;
        }
        if (moba_meets(kp, moba, t)) visit(other, false);
      } else {
        visit(other, kv_of_q ? sched.is_full(own, other) : sched.is_full(other, own));
      }
    }
  }
}

template <Mode M>
void forward_item(const KernelPlan& kp, const ForwardArgs& a, char* ws, const Unit& u,
                  int64_t h, char* scratch) {
  const Problem& p = *kp.problem;
  const int64_t b = u.b, qt = u.tile, hk = h / p.group();
  const SequenceMask mask = p.sequence_mask(b);
  const DenseTileSchedule sched(mask, kTile, kTile);
  const int64_t dqk = p.head_dim_qk, dv = p.head_dim_v;
  const int64_t ldq = kp.dqk_pad, ldv = kp.dv_pad;

  float* qp = slice(scratch, kp.fwd.q);
  float* s = slice(scratch, kp.fwd.s);
  float* acc = slice(scratch, kp.fwd.acc_o);
  float* row_m = slice(scratch, kp.fwd.row_a);
  float* row_l = slice(scratch, kp.fwd.row_b);

  const RowSpan qr = q_rows(sched, qt);
  TileView t{&p, &mask, qr.r0, qr.m, qr.m_pad, 0, 0, 0, true};
  const uint64_t* moba = nullptr;
  if constexpr (M == Mode::moba)
    moba = moba_rows(kp, ws, kp.fwd_moba_selection, b, p.moba_shared ? hk : h);
  pack_rows(a.q, p.dtype, p.offset(ATTN_TENSOR_Q, b, t.r0, h), p.strides[ATTN_TENSOR_Q].seq, t.m,
            dqk, q_scale(p), qp, t.m_pad, ldq);
  std::fill(acc, acc + t.m_pad * ldv, 0.0f);
  std::fill(row_m, row_m + t.m, kNegInf);
  std::fill(row_l, row_l + t.m, 0.0f);

  auto visit = [&](int64_t kti, bool full) {
    const RowSpan cr = kv_rows(sched, kti);
    t.c0 = cr.r0, t.n = cr.m, t.n_pad = cr.m_pad;
    t.full = full;
    const int64_t g = kp.kv_tile_base[size_t(b)] + kti;
    masked_scores<M>(kp, moba, b, hk, t, qp, ldq, packed_tile(ws, kp.fwd_kt, g, hk), s);

    // Online softmax, one row at a time: S becomes P = 2^(s - m_new).
    for (int64_t i = 0; i < t.m; ++i) {
      float* row = s + i * kTile;
      vf vm = vbroadcast(kNegInf);
      for (int64_t j = 0; j < t.n_pad; j += W) vm = vmax(vm, vload(row + j));
      const float m_new = std::max(row_m[i], hmax(vm));
      if (m_new == kNegInf) {  // nothing visible yet: P row is 0
        // unless a score is NaN (the max skipped it): then the row's sum
        // becomes NaN, so that O and LSE are NaN rather than an empty row's
        for (int64_t j = 0; j < t.n; ++j)
          if (row[j] != row[j]) row_l[i] = std::numeric_limits<float>::quiet_NaN();
        std::fill(row, row + t.n_pad, 0.0f);
        continue;
      }
      const vf vmn = vbroadcast(m_new);
      vf vsum{};
      for (int64_t j = 0; j < t.n_pad; j += W) {
        vf e = vexp2(vload(row + j) - vmn);
        vstore(row + j, e);
        vsum += e;
      }
      const float alpha = std::exp2(row_m[i] - m_new);  // 0 when row_m was -inf
      row_l[i] = row_l[i] * alpha + hsum(vsum);
      row_m[i] = m_new;
      if (alpha != 1.0f) {
        float* o = acc + i * ldv;
        for (int64_t c = 0; c < ldv; c += W) vstore(o + c, vload(o + c) * alpha);
      }
    }
    // Padding rows (i >= m) of S hold finite scores of zero query rows; their
    // output rows are never stored.
    gemm<true>(t.m_pad, ldv, t.n_pad, s, kTile, 1, packed_tile(ws, kp.fwd_v, g, hk), ldv, acc, ldv);
  };
  for_each_tile_pair<M, Walk::kv_of_q>(kp, sched, moba, b, hk, qt, t, visit);

  // O = Oacc / l, LSE = m ln2 + ln l; a row that saw nothing gives 0 and -inf
  // (zeros stored, not Oacc * 0: its P was 0 but a tile's V may hold a
  // non-finite value at a key it does not see).
  const auto& os = p.strides[ATTN_TENSOR_O];
  for (int64_t i = 0; i < t.m; ++i) {
    const float l = row_l[i];
    if (l == 0.0f) std::fill(acc + i * ldv, acc + (i + 1) * ldv, 0.0f);  // (a NaN l stays NaN)
    const float inv = l != 0.0f ? 1.0f / l : 0.0f;  // (NaN l: NaN)
    store_rows(acc + i * ldv, ldv, 1, dv, inv, a.o, p.dtype,
               p.offset(ATTN_TENSOR_O, b, t.r0 + i, h), os.seq);
    if (a.lse)
      a.lse[p.lse_offset(b, h, t.r0 + i)] = l != 0.0f ? row_m[i] * kLn2 + std::log(l) : kNegInf;
  }
}

void forward(const KernelPlan& kp, const ForwardArgs& a) {
  const Problem& p = *kp.problem;
  // No query rows: nothing to write, and K, V may be null (attn_forward
  // checks them only when there are queries).
  if (p.total_q() == 0) return;
  char* ws = workspace_base(a.workspace);
  char* base = ws + kp.fwd_threads_offset;
  const int64_t pack_items = int64_t(kp.kv_units.size()) * p.heads_kv;
  const int64_t items = int64_t(kp.q_units.size()) * p.heads_q;
#pragma omp parallel num_threads(kp.num_threads)
  {
    char* scratch = base + size_t(thread_index()) * kp.fwd.floats * sizeof(float);
#pragma omp for schedule(dynamic, 4)
    for (int64_t w = 0; w < pack_items; ++w) {
      const Unit& u = kp.kv_units[size_t(w / p.heads_kv)];
      const int64_t hk = w % p.heads_kv, g = kp.kv_tile_base[size_t(u.b)] + u.tile;
      pack_kv_tile(kp, a.k, a.v, u, hk, packed_tile(ws, kp.fwd_kt, g, hk),
                   packed_tile(ws, kp.fwd_v, g, hk), nullptr, nullptr);
    }
    if (p.moba_block > 0)
      moba_select(kp, a.q, a.k, ws, kp.fwd_moba_pooled, kp.fwd_moba_selection,
                  slice(scratch, kp.fwd.moba));
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; ++w) {
      const Unit& u = kp.q_units[size_t(w / p.heads_q)];
      with_mode(kp, [&](auto mode) {
        forward_item<decltype(mode)::value>(kp, a, ws, u, w % p.heads_q, scratch);
      });
    }
  }
}

// ---------------------------------------------------------------------------
// Backward. Phases, all parallel, none with atomics (so results do not
// depend on the thread count or schedule):
//   0. pack Q (pre-scaled), dO, Kt, Vt and K rows; D = rowsum(dO * O).
//   1. per (sequence, KV head, KV tile): dK and dV over every query tile and
//      query head of the group that sees it (the transposed schedule).
//   2. per (sequence, query head, query tile): dQ over its KV tiles.
// Probabilities are recomputed from LSE in phases 1 and 2.

// P = 2^(s - lse2) for rows < m (rows >= m and masked entries give 0), then
// dP = dO * V^T, and dS = P * (dP - D) in place of dP. lse2 and delta hold
// the rows' base-2 LSE (+inf for a row that saw nothing) and D.
void probabilities_and_dscores(const TileView& t, const float* lse2, const float* delta,
                               const float* dop, int64_t ldo, const float* vt, float* s,
                               float* dp) {
  const Problem& p = *t.p;
  for (int64_t i = 0; i < t.m; ++i) {
    float* row = s + i * kTile;
    const vf l2 = vbroadcast(lse2[i]);
    for (int64_t j = 0; j < t.n_pad; j += W) vstore(row + j, vexp2(vload(row + j) - l2));
  }
  std::fill(s + t.m * kTile, s + t.m_pad * kTile, 0.0f);
  gemm<false>(t.m_pad, t.n_pad, p.head_dim_v, dop, ldo, 1, vt, kTile, dp, kTile);
  for (int64_t i = 0; i < t.m; ++i) {
    float* prow = s + i * kTile;
    float* drow = dp + i * kTile;
    const vf d = vbroadcast(delta[i]);
    for (int64_t j = 0; j < t.n_pad; j += W) vstore(drow + j, vload(prow + j) * (vload(drow + j) - d));
  }
  std::fill(dp + t.m * kTile, dp + t.m_pad * kTile, 0.0f);
}

// Softcap chain rule: du = dz * (1 - (z/cap)^2), with z/cap taken from the
// base-2 logits s2 saved before exponentiation (-inf where masked).
void apply_softcap_grad(const TileView& t, const float* s2, float* ds) {
  const float inv = 1.0f / (t.p->softcap * kLog2e);
  for (int64_t i = 0; i < t.m; ++i) {
    const float* zrow = s2 + i * kTile;
    float* drow = ds + i * kTile;
    for (int64_t j = 0; j < t.n_pad; j += W) {
      vf y = vload(zrow + j) * inv;  // z / cap, -inf where masked
      vf g = vbroadcast(1.0f) - y * y;
      g = g < vbroadcast(0.0f) ? vbroadcast(0.0f) : g;  // masked: 0 (and P = 0 there)
      vstore(drow + j, vload(drow + j) * g);
    }
  }
}

// The backward's recomputation on tile t: S (masked_scores), then P in s
// and dS in ds (probabilities_and_dscores), through the softcap when there
// is one (z keeps the logits for its chain rule). Always inlined, as the
// helpers of the forward.
template <Mode M>
[[gnu::always_inline]] inline void recompute_tile(const KernelPlan& kp, const uint64_t* moba,
                                                  int64_t b, int64_t hk, const TileView& t,
                                                  const float* qp, const float* kt,
                                                  const float* dop, const float* vt,
                                                  const float* lse2, const float* delta, float* z,
                                                  float* s, float* ds) {
  const bool capped = t.p->softcap > 0.0f;
  masked_scores<M>(kp, moba, b, hk, t, qp, kp.dqk_pad, kt, s);
  if (capped) std::copy(s, s + t.m_pad * kTile, z);
  probabilities_and_dscores(t, lse2, delta, dop, kp.dv_pad, vt, s, ds);
  if (capped) apply_softcap_grad(t, z, ds);
}

// Packs query tile u.tile of head h (Q pre-scaled, dO) and computes D for
// its rows.
void backward_pack_q_tile(const KernelPlan& kp, const BackwardArgs& a, char* ws, float* delta,
                          const Unit& u, int64_t h) {
  const Problem& p = *kp.problem;
  const DenseTileSchedule sched(p.sequence_mask(u.b), kTile, kTile);
  const RowSpan r = q_rows(sched, u.tile);
  const int64_t g = kp.q_tile_base[size_t(u.b)] + u.tile;
  float* qp = packed_tile(ws, kp.bwd_q, g, h);
  float* dop = packed_tile(ws, kp.bwd_do, g, h);
  pack_rows(a.q, p.dtype, p.offset(ATTN_TENSOR_Q, u.b, r.r0, h), p.strides[ATTN_TENSOR_Q].seq,
            r.m, p.head_dim_qk, q_scale(p), qp, r.m_pad, kp.dqk_pad);
  pack_rows(a.d_o, p.dtype, p.offset(ATTN_TENSOR_DO, u.b, r.r0, h),
            p.strides[ATTN_TENSOR_DO].seq, r.m, p.head_dim_v, 1.0f, dop, r.m_pad, kp.dv_pad);
  const int64_t oseq = p.strides[ATTN_TENSOR_O].seq;
  int64_t oo = p.offset(ATTN_TENSOR_O, u.b, r.r0, h);
  for (int64_t i = 0; i < r.m; ++i, oo += oseq) {
    const float* d = dop + i * kp.dv_pad;
    float sum = 0.0f;
    for (int64_t c = 0; c < p.head_dim_v; ++c) sum += d[c] * load_as_float(a.o, oo + c, p.dtype);
    delta[p.lse_offset(u.b, h, r.r0 + i)] = sum;
  }
}

// Loads the base-2 LSE (+inf for empty rows, so that P = 0) and D of rows
// [r0, r0 + m) of head h.
void load_row_stats(const Problem& p, const BackwardArgs& a, const float* delta, int64_t b,
                    int64_t h, int64_t r0, int64_t m, float* lse2, float* d) {
  for (int64_t i = 0; i < m; ++i) {
    const int64_t idx = p.lse_offset(b, h, r0 + i);
    const float l = a.lse[idx];
    lse2[i] = l == kNegInf ? std::numeric_limits<float>::infinity() : l * kLog2e;
    d[i] = delta[idx];
  }
}

template <Mode M>
void backward_dkdv_item(const KernelPlan& kp, const BackwardArgs& a, char* ws, const float* delta,
                        const Unit& u, int64_t hk, char* scratch) {
  const Problem& p = *kp.problem;
  const int64_t b = u.b, kti = u.tile;
  const SequenceMask mask = p.sequence_mask(b);
  const DenseTileSchedule sched(mask, kTile, kTile);
  const int64_t ldq = kp.dqk_pad, ldv = kp.dv_pad;

  float* s = slice(scratch, kp.bwd.s);
  float* dp = slice(scratch, kp.bwd.dp);
  float* z = slice(scratch, kp.bwd.z);  // saved logits when softcapped
  float* acc_dk = slice(scratch, kp.bwd.acc_dk);
  float* acc_dv = slice(scratch, kp.bwd.acc_dv);
  float* lse2 = slice(scratch, kp.bwd.row_a);
  float* dd = slice(scratch, kp.bwd.row_b);

  const RowSpan cr = kv_rows(sched, kti);
  const int64_t gk = kp.kv_tile_base[size_t(b)] + kti;
  const float* kt = packed_tile(ws, kp.bwd_kt, gk, hk);
  const float* vt = packed_tile(ws, kp.bwd_vt, gk, hk);
  TileView t{&p, &mask, 0, 0, 0, cr.r0, cr.m, cr.m_pad, true};
  std::fill(acc_dk, acc_dk + t.n_pad * ldq, 0.0f);
  std::fill(acc_dv, acc_dv + t.n_pad * ldv, 0.0f);

  for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
    const uint64_t* moba = nullptr;
    if constexpr (M == Mode::moba)
      moba = moba_rows(kp, ws, kp.bwd_moba_selection, b, p.moba_shared ? hk : h);
    auto visit = [&](int64_t qt, bool full) {
      const RowSpan qr = q_rows(sched, qt);
      t.r0 = qr.r0, t.m = qr.m, t.m_pad = qr.m_pad;
      t.full = full;
      const int64_t gq = kp.q_tile_base[size_t(b)] + qt;
      const float* qp = packed_tile(ws, kp.bwd_q, gq, h);
      const float* dop = packed_tile(ws, kp.bwd_do, gq, h);
      load_row_stats(p, a, delta, b, h, t.r0, t.m, lse2, dd);
      recompute_tile<M>(kp, moba, b, hk, t, qp, kt, dop, vt, lse2, dd, z, s, dp);
      // dV += P^T dO;  dK += dS^T Qp (rescaled at the end)
      gemm<true>(t.n_pad, ldv, t.m_pad, s, 1, kTile, dop, ldv, acc_dv, ldv);
      gemm<true>(t.n_pad, ldq, t.m_pad, dp, 1, kTile, qp, ldq, acc_dk, ldq);
    };
    for_each_tile_pair<M, Walk::q_of_kv>(kp, sched, moba, b, hk, kti, t, visit);
  }
  // dS is in natural units (P is a true probability). S2 = Qp K^T with
  // Qp = q_scale * Q and z = scale * Q K^T, so dK = (scale / q_scale) dS^T Qp.
  const float dk_scale = p.scale / q_scale(p);
  store_rows(acc_dk, ldq, t.n, p.head_dim_qk, dk_scale, a.dk, p.dtype,
             p.offset(ATTN_TENSOR_DK, b, t.c0, hk), p.strides[ATTN_TENSOR_DK].seq);
  store_rows(acc_dv, ldv, t.n, p.head_dim_v, 1.0f, a.dv, p.dtype,
             p.offset(ATTN_TENSOR_DV, b, t.c0, hk), p.strides[ATTN_TENSOR_DV].seq);
}

template <Mode M>
void backward_dq_item(const KernelPlan& kp, const BackwardArgs& a, char* ws, const float* delta,
                      const Unit& u, int64_t h, char* scratch) {
  const Problem& p = *kp.problem;
  const int64_t b = u.b, qt = u.tile, hk = h / p.group();
  const SequenceMask mask = p.sequence_mask(b);
  const DenseTileSchedule sched(mask, kTile, kTile);
  const int64_t ldq = kp.dqk_pad;

  float* s = slice(scratch, kp.bwd.s);
  float* dp = slice(scratch, kp.bwd.dp);
  float* z = slice(scratch, kp.bwd.z);
  float* acc_dq = slice(scratch, kp.bwd.acc_dq);
  float* lse2 = slice(scratch, kp.bwd.row_a);
  float* dd = slice(scratch, kp.bwd.row_b);

  const RowSpan qr = q_rows(sched, qt);
  const int64_t gq = kp.q_tile_base[size_t(b)] + qt;
  const float* qp = packed_tile(ws, kp.bwd_q, gq, h);
  const float* dop = packed_tile(ws, kp.bwd_do, gq, h);
  TileView t{&p, &mask, qr.r0, qr.m, qr.m_pad, 0, 0, 0, true};
  const uint64_t* moba = nullptr;
  if constexpr (M == Mode::moba)
    moba = moba_rows(kp, ws, kp.bwd_moba_selection, b, p.moba_shared ? hk : h);
  load_row_stats(p, a, delta, b, h, t.r0, t.m, lse2, dd);
  std::fill(acc_dq, acc_dq + t.m_pad * ldq, 0.0f);

  auto visit = [&](int64_t kti, bool full) {
    const RowSpan cr = kv_rows(sched, kti);
    t.c0 = cr.r0, t.n = cr.m, t.n_pad = cr.m_pad;
    t.full = full;
    const int64_t gk = kp.kv_tile_base[size_t(b)] + kti;
    recompute_tile<M>(kp, moba, b, hk, t, qp, packed_tile(ws, kp.bwd_kt, gk, hk), dop,
                      packed_tile(ws, kp.bwd_vt, gk, hk), lse2, dd, z, s, dp);
    // dQ += dS K
    gemm<true>(t.m_pad, ldq, t.n_pad, dp, kTile, 1, packed_tile(ws, kp.bwd_k, gk, hk), ldq, acc_dq,
               ldq);
  };
  for_each_tile_pair<M, Walk::kv_of_q>(kp, sched, moba, b, hk, qt, t, visit);
  store_rows(acc_dq, ldq, t.m, p.head_dim_qk, p.scale, a.dq, p.dtype,
             p.offset(ATTN_TENSOR_DQ, b, t.r0, h), p.strides[ATTN_TENSOR_DQ].seq);
}

void backward(const KernelPlan& kp, const BackwardArgs& a) {
  const Problem& p = *kp.problem;
  char* ws = workspace_base(a.workspace);
  float* delta = reinterpret_cast<float*>(ws + kp.bwd_delta_offset);
  char* base = ws + kp.bwd_threads_offset;
  const int64_t kv_items = int64_t(kp.kv_units.size()) * p.heads_kv;
  const int64_t q_items = int64_t(kp.q_units.size()) * p.heads_q;
#pragma omp parallel num_threads(kp.num_threads)
  {
    char* scratch = base + size_t(thread_index()) * kp.bwd.floats * sizeof(float);
#pragma omp for schedule(dynamic, 4) nowait
    for (int64_t w = 0; w < kv_items; ++w) {
      const Unit& u = kp.kv_units[size_t(w / p.heads_kv)];
      const int64_t hk = w % p.heads_kv, g = kp.kv_tile_base[size_t(u.b)] + u.tile;
      pack_kv_tile(kp, a.k, a.v, u, hk, packed_tile(ws, kp.bwd_kt, g, hk), nullptr,
                   packed_tile(ws, kp.bwd_vt, g, hk), packed_tile(ws, kp.bwd_k, g, hk));
    }
#pragma omp for schedule(dynamic, 4)
    for (int64_t w = 0; w < q_items; ++w)
      backward_pack_q_tile(kp, a, ws, delta, kp.q_units[size_t(w / p.heads_q)], w % p.heads_q);
    // (A kept selection is the forward's, where the workspace starts.)
    if (p.moba_block > 0 && !p.moba_keep_selection)
      moba_select(kp, a.q, a.k, ws, kp.bwd_moba_pooled, kp.bwd_moba_selection,
                  slice(scratch, kp.bwd.moba));
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < kv_items; ++w) {
      const Unit& u = kp.kv_units[size_t(w / p.heads_kv)];
      with_mode(kp, [&](auto mode) {
        backward_dkdv_item<decltype(mode)::value>(kp, a, ws, delta, u, w % p.heads_kv, scratch);
      });
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < q_items; ++w) {
      const Unit& u = kp.q_units[size_t(w / p.heads_q)];
      with_mode(kp, [&](auto mode) {
        backward_dq_item<decltype(mode)::value>(kp, a, ws, delta, u, w % p.heads_q, scratch);
      });
    }
  }
}

}  // namespace

const IsaKernels& kernels() {
  static const IsaKernels k{ATTN_CPU_ISA_NAME, NR, &forward, &backward};
  return k;
}

}  // namespace attn::cpu::ATTN_CPU_ISA
