#include "cpu/cpu_backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attn_config.h"
#include "core/checked.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/workspace.hpp"
#include "cpu/cpu_kernels.hpp"

#if ATTN_HAVE_OPENMP
#include <omp.h>
#endif

namespace attn::cpu {
namespace {

struct IsaChoice {
  const char* name;
  bool built;
  bool (*supported)();
  const IsaKernels& (*kernels)();
};

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}
bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}
bool always() { return true; }

// Best first.
const IsaChoice kIsas[] = {
#if ATTN_CPU_HAVE_AVX512
    {"avx512", true, &cpu_has_avx512, &avx512::kernels},
#else
    {"avx512", false, &cpu_has_avx512, nullptr},
#endif
#if ATTN_CPU_HAVE_AVX2
    {"avx2", true, &cpu_has_avx2, &avx2::kernels},
#else
    {"avx2", false, &cpu_has_avx2, nullptr},
#endif
    {"generic", true, &always, &generic::kernels},
};

const IsaKernels& choose_isa() {
  const char* forced = std::getenv("ATTN_CPU_ISA");
  if (forced != nullptr && forced[0] != '\0') {
    for (const IsaChoice& c : kIsas) {
      if (std::strcmp(c.name, forced) != 0) continue;
      if (!c.built) not_supported("ATTN_CPU_ISA=", forced, ": this library was built without it");
      if (!c.supported()) not_supported("ATTN_CPU_ISA=", forced, ": this processor lacks it");
      return c.kernels();
    }
    invalid_argument("ATTN_CPU_ISA=", forced, " is not one of avx512, avx2, generic");
  }
  for (const IsaChoice& c : kIsas)
    if (c.built && c.supported()) return c.kernels();
  return generic::kernels();
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

class CpuPlan final : public BackendPlan {
 public:
  CpuPlan(const Problem& problem, const ContextConfig& ctx) : problem_(problem), isa_(choose_isa()) {
    const Problem& p = problem_;
    kp_.problem = &problem_;
    kp_.num_threads = std::max<int32_t>(1, ctx.num_threads);
    kp_.dqk_pad = round_up(p.head_dim_qk, isa_.col_block);
    kp_.dv_pad = round_up(p.head_dim_v, isa_.col_block);

    // Work units, heaviest first so that dynamic scheduling balances causal
    // and windowed problems.
    std::vector<std::pair<int64_t, Unit>> q, kv;
    if (p.block_mask)
      kp_.sparse = std::make_shared<const BlockTileSchedule>(p.block_mask, p.window, kTile, kTile);
    for (int64_t b = 0; b < p.batch; ++b) {
      const DenseTileSchedule sched(p.sequence_mask(b), kTile, kTile);
      for (int64_t t = 0; t < sched.num_q_tiles(); ++t) {
        TileRange r = sched.kv_tiles_of(t);
        q.push_back({sparse_weight(b, t, true, r.end - r.begin), Unit{int32_t(b), int32_t(t)}});
      }
      for (int64_t t = 0; t < sched.num_kv_tiles(); ++t) {
        TileRange r = sched.q_tiles_of(t);
        kv.push_back({sparse_weight(b, t, false, r.end - r.begin), Unit{int32_t(b), int32_t(t)}});
      }
    }
    auto heavier = [](const auto& x, const auto& y) { return x.first > y.first; };
    std::stable_sort(q.begin(), q.end(), heavier);
    std::stable_sort(kv.begin(), kv.end(), heavier);
    for (auto& e : q) kp_.q_units.push_back(e.second);
    for (auto& e : kv) kp_.kv_units.push_back(e.second);

    // Waking a thread team costs microseconds and its idle threads spin for a
    // while afterwards, so a problem of less than ~10 us of work runs on the
    // calling thread, and no more threads are used than there are work items.
    double tile_pairs = 0.0;
    for (auto& e : q) tile_pairs += double(e.first);
    // (sparse weights already sum over the KV heads)
    const double flop_heads = double(kp_.sparse ? p.group() : p.heads_q);
    const double flops = tile_pairs * flop_heads * double(kTile * kTile) * 2.0 *
                         double(p.head_dim_qk + p.head_dim_v);
    const int64_t items = std::max<int64_t>(1, int64_t(q.size()) * p.heads_q);
    if (flops < 1.0e6) kp_.num_threads = 1;
    kp_.num_threads = int32_t(std::min<int64_t>(kp_.num_threads, items));

    kp_.q_tile_base.assign(size_t(p.batch) + 1, 0);
    kp_.kv_tile_base.assign(size_t(p.batch) + 1, 0);
    for (int64_t b = 0; b < p.batch; ++b) {
      const DenseTileSchedule sched(p.sequence_mask(b), kTile, kTile);
      kp_.q_tile_base[size_t(b) + 1] = kp_.q_tile_base[size_t(b)] + sched.num_q_tiles();
      kp_.kv_tile_base[size_t(b) + 1] = kp_.kv_tile_base[size_t(b)] + sched.num_kv_tiles();
    }
    const size_t q_tiles = size_t(kp_.q_tile_base.back());
    const size_t kv_tiles = size_t(kp_.kv_tile_base.back());

    const size_t tile = size_t(kTile);
    const size_t ldq = size_t(kp_.dqk_pad), ldv = size_t(kp_.dv_pad);
    const size_t dqk = size_t(p.head_dim_qk), dv = size_t(p.head_dim_v);
    const size_t floats_align = kWorkspaceAlign / sizeof(float);
    auto carve = [&](size_t& cursor, size_t floats) {
      size_t off = cursor;
      cursor += align_up(floats, floats_align);
      return off;
    };
    // Region sizes saturate (core/checked.hpp); create_plan refuses a
    // workspace past kMaxBytes, so no offset below is used after a wrap.
    auto packed = [&](WorkspaceLayout& layout, size_t tiles, int64_t heads, size_t tile_floats) {
      PackedTensor t;
      t.tile_floats = align_up(tile_floats, floats_align);
      t.heads = heads;
      t.offset = layout.add(sat_mul(tiles, uint64_t(heads), t.tile_floats, sizeof(float)));
      return t;
    };
    const size_t threads = size_t(kp_.num_threads);

    Scratch& f = kp_.fwd;
    size_t c = 0;
    f.q = carve(c, tile * ldq);
    f.s = carve(c, tile * tile);
    f.acc_o = carve(c, tile * ldv);
    f.row_a = carve(c, tile);
    f.row_b = carve(c, tile);
    const size_t moba_blocks = p.moba_block > 0 ? size_t(p.moba_num_blocks()) : 0;
    if (moba_blocks > 0) f.moba = carve(c, 2 * moba_blocks);
    f.floats = c;
    kp_.moba_words = int64_t((moba_blocks + 63) / 64);
    // The selection is a bit per (row, key block): with small blocks and
    // long sequences it is the product that outgrows 64 bits first.
    const uint64_t moba_pooled_bytes =
        sat_mul(uint64_t(p.batch), uint64_t(p.heads_kv), moba_blocks, dqk, sizeof(float));
    const uint64_t moba_selection_bytes =
        sat_mul(uint64_t(p.batch), uint64_t(p.moba_heads()), uint64_t(p.seqlen_q),
                uint64_t(kp_.moba_words), sizeof(uint64_t));
    WorkspaceLayout fl;
    // A selection the backward keeps (attn_plan_desc_set_moba_keep_selection)
    // starts both passes' workspaces: the same offsets in each.
    const bool keep = moba_blocks > 0 && p.moba_keep_selection;
    if (keep) {
      kp_.fwd_moba_pooled = fl.add(moba_pooled_bytes);
      kp_.fwd_moba_selection = fl.add(moba_selection_bytes);
    }
    kp_.fwd_kt = packed(fl, kv_tiles, p.heads_kv, dqk * tile);
    kp_.fwd_v = packed(fl, kv_tiles, p.heads_kv, tile * ldv);
    kp_.fwd_threads_offset = fl.add(sat_mul(threads, f.floats, sizeof(float)));
    if (moba_blocks > 0 && !keep) {
      kp_.fwd_moba_pooled = fl.add(moba_pooled_bytes);
      kp_.fwd_moba_selection = fl.add(moba_selection_bytes);
    }
    fwd_bytes_ = fl.total_bytes();

    if (p.backward) {
      Scratch& g = kp_.bwd;
      c = 0;
      g.s = carve(c, tile * tile);
      g.dp = carve(c, tile * tile);
      if (p.softcap > 0.0f) g.z = carve(c, tile * tile);
      g.acc_dq = carve(c, tile * ldq);
      g.acc_dk = carve(c, tile * ldq);
      g.acc_dv = carve(c, tile * ldv);
      g.row_a = carve(c, tile);
      g.row_b = carve(c, tile);
      if (moba_blocks > 0) g.moba = carve(c, 2 * moba_blocks);
      g.floats = c;
      WorkspaceLayout bl;
      if (keep) {
        kp_.bwd_moba_pooled = bl.add(moba_pooled_bytes);
        kp_.bwd_moba_selection = bl.add(moba_selection_bytes);
      }
      kp_.bwd_delta_offset = bl.add(sat_mul(uint64_t(p.lse_elements()), sizeof(float)));
      kp_.bwd_q = packed(bl, q_tiles, p.heads_q, tile * ldq);
      kp_.bwd_do = packed(bl, q_tiles, p.heads_q, tile * ldv);
      kp_.bwd_kt = packed(bl, kv_tiles, p.heads_kv, dqk * tile);
      kp_.bwd_vt = packed(bl, kv_tiles, p.heads_kv, dv * tile);
      kp_.bwd_k = packed(bl, kv_tiles, p.heads_kv, tile * ldq);
      kp_.bwd_threads_offset = bl.add(sat_mul(threads, g.floats, sizeof(float)));
      if (moba_blocks > 0 && !keep) {
        kp_.bwd_moba_pooled = bl.add(moba_pooled_bytes);
        kp_.bwd_moba_selection = bl.add(moba_selection_bytes);
      }
      bwd_bytes_ = bl.total_bytes();
    }
  }

  size_t workspace_bytes(attn_pass_t pass) const override {
    return pass == ATTN_PASS_FORWARD ? fwd_bytes_ : bwd_bytes_;
  }
  void forward(const ForwardArgs& args) const override { isa_.forward(kp_, args); }
  void backward(const BackwardArgs& args) const override { isa_.backward(kp_, args); }
  int32_t tile_q() const override { return int32_t(kTile); }
  int32_t tile_kv() const override { return int32_t(kTile); }
  int32_t num_threads() const override { return kp_.num_threads; }
  const char* algorithm() const override {
    if (kp_.sparse) return "flash-block-sparse-online-softmax";
    return problem_.moba_block > 0 ? "flash-moba-online-softmax" : "flash-tiled-online-softmax";
  }
  const char* kernel() const override { return isa_.name; }

 private:
  // Tiles a work unit visits, over the KV heads (block-sparse plans), or the
  // dense count.
  int64_t sparse_weight(int64_t b, int64_t tile, bool q_unit, int64_t dense) const {
    if (!kp_.sparse) return dense;
    int64_t n = 0;
    for (int64_t hk = 0; hk < problem_.heads_kv; ++hk) {
      const int64_t slot = kp_.sparse->slot(b, hk);
      n += int64_t(q_unit ? kp_.sparse->kv_tiles_of(slot, tile).size()
                          : kp_.sparse->q_tiles_of(slot, tile).size());
    }
    return n;
  }

  Problem problem_;
  const IsaKernels& isa_;
  KernelPlan kp_;
  size_t fwd_bytes_ = 0, bwd_bytes_ = 0;
};

}  // namespace

std::unique_ptr<BackendPlan> make_plan(const Problem& problem, const ContextConfig& ctx) {
  return std::make_unique<CpuPlan>(problem, ctx);
}

PerSequenceOps per_sequence_ops(const ContextConfig& ctx) {
  PerSequenceOps ops;
  ops.make_plan = [ctx](const Problem& p) { return make_plan(p, ctx); };
  ops.copy_rows = [](float* dst, int64_t dst_pitch, const float* src, int64_t src_pitch,
                     int64_t width, int64_t rows, void*) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + r * dst_pitch, src + r * src_pitch, sizeof(float) * size_t(width));
  };
  return ops;
}

void merge_states(const ContextConfig& ctx, int32_t num_parts, const TensorDesc& o,
                  const TensorDesc& lse, const void* const* o_parts, const float* const* lse_parts,
                  void* o_out, float* lse_out) {
  const int32_t lead = o.ndim - 1;
  const int64_t dim = o.dims[lead];
  int64_t rows = 1;
  for (int32_t i = 0; i < lead; ++i) rows *= o.dims[i];
  const attn_dtype_t dtype = o.dtype;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int threads = std::max<int32_t>(1, ctx.num_threads);
  (void)threads;

#if ATTN_HAVE_OPENMP
#pragma omp parallel for schedule(static) num_threads(threads)
#endif
  for (int64_t r = 0; r < rows; ++r) {
    // Row r's element offsets in O and LSE, from its multi-index.
    int64_t oo = 0, lo = 0, rem = r;
    for (int32_t i = lead - 1; i >= 0; --i) {
      const int64_t idx = rem % o.dims[i];
      rem /= o.dims[i];
      oo += idx * o.strides[i];
      lo += idx * lse.strides[i];
    }
    // The max, NaN if any LSE is (std::max would drop it, and a row of NaN
    // parts would come out as an empty one).
    float m = neg_inf;
    for (int32_t p = 0; p < num_parts; ++p) {
      const float x = lse_parts[p][lo];
      m = (x != x || m != m) ? std::numeric_limits<float>::quiet_NaN() : std::max(m, x);
    }
    if (m == neg_inf) {  // every part empty: the identity
      for (int64_t c = 0; c < dim; ++c) store_from_float(o_out, oo + c, dtype, 0.0f);
      if (lse_out) lse_out[lo] = neg_inf;
      continue;
    }
    // Weights first (in-place merge may overwrite part 0), then one pass per
    // channel so that o_out == o_parts[0] is safe.
    float total = 0.0f;
    constexpr int32_t kStackParts = 64;
    float wbuf[kStackParts];
    for (int32_t p = 0; p < num_parts; ++p) {
      const float w = std::exp(lse_parts[p][lo] - m);
      if (p < kStackParts) wbuf[p] = w;
      total += w;
    }
    const float inv = 1.0f / total;
    for (int64_t c = 0; c < dim; ++c) {
      float acc = 0.0f;
      for (int32_t p = 0; p < num_parts; ++p) {
        const float w = p < kStackParts ? wbuf[p] : std::exp(lse_parts[p][lo] - m);
        if (w != 0.0f) acc += w * load_as_float(o_parts[p], oo + c, dtype);
      }
      store_from_float(o_out, oo + c, dtype, acc * inv);
    }
    if (lse_out) lse_out[lo] = m + std::log(total);
  }
}

}  // namespace attn::cpu
