// The CPU decode kernel: one task per (work unit, KV head). A task packs
// the query rows of every query token and every query head of the KV
// head's group ([q_len * group, head_dim_qk], pre-scaled, fp32), then walks
// the unit's pages once: each page's K and V rows are converted to fp32 a
// single time and used by all packed rows. Online softmax in fp32 as in the
// dense kernels. Units of a split sequence write partial (O, LSE) states
// into the workspace, merged afterwards by the rule of attn_merge_states.
#include <algorithm>
#include <cmath>
#include <limits>

#include "attn_config.h"
#include "core/dtype.hpp"
#include "kv/decode_plan.hpp"

#if ATTN_HAVE_OPENMP
#include <omp.h>
#endif

namespace attn::cpu {
namespace {

using kv::DecodeWorkspace;
using kv::SeqMeta;
using kv::WorkUnit;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// dst[c] = scale * element (off + c) of src, for c < n.
void load_row(const void* src, int64_t off, attn_dtype_t dtype, int64_t n, float scale,
              float* dst) {
  switch (dtype) {
    case ATTN_DTYPE_FP32: {
      const float* s = static_cast<const float*>(src) + off;
      for (int64_t c = 0; c < n; ++c) dst[c] = scale * s[c];
      break;
    }
    case ATTN_DTYPE_FP16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + off;
      for (int64_t c = 0; c < n; ++c) dst[c] = scale * fp16_to_float(s[c]);
      break;
    }
    case ATTN_DTYPE_BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + off;
      for (int64_t c = 0; c < n; ++c) dst[c] = scale * bf16_to_float(s[c]);
      break;
    }
  }
}

struct Task {
  const kv::DecodePlan& plan;
  const kv::KvCache& cache;
  const DecodeWorkspace& ws;
  const void* q;
  void* o;
  float* lse;
  int64_t total_q;
};

void run_task(const Task& tk, const WorkUnit& u, int64_t g, float* scratch) {
  const kv::CacheConfig& cc = tk.plan.cache_config();
  const kv::DecodeConfig& cfg = tk.plan.config();
  const kv::DecodePlan::Scratch& sc = tk.plan.scratch();
  const SeqMeta& sm = tk.ws.seqs[u.seq];
  const int64_t G = tk.plan.group(), hq = cfg.heads_q;
  const int64_t dqk = cc.head_dim_qk, dv = cc.head_dim_v, ps = cc.page_size;
  const int64_t n = sm.length, ql = sm.q_len, rows = ql * G;
  const attn_dtype_t dt = cc.dtype;
  const float cap = cfg.softcap;
  float* qs = scratch + sc.q;    // [rows][dqk]
  float* ks = scratch + sc.k;    // [dqk][ps], transposed
  float* krow = scratch + sc.krow;  // [dqk], one key before transposition
  float* vs = scratch + sc.v;    // [ps][dv]
  float* s = scratch + sc.s;     // [rows][ps]
  float* acc = scratch + sc.acc; // [rows][dv]
  float* m = scratch + sc.m;
  float* l = scratch + sc.l;

  // Row r = t * G + j is query token t, query head g * G + j.
  for (int64_t t = 0; t < ql; ++t)
    for (int64_t j = 0; j < G; ++j) {
      const int64_t r = t * G + j, h = g * G + j;
      load_row(tk.q, ((sm.q_begin + t) * hq + h) * dqk, dt, dqk, cfg.scale, qs + r * dqk);
      m[r] = kNegInf;
      l[r] = 0.0f;
      std::fill(acc + r * dv, acc + (r + 1) * dv, 0.0f);
    }

  for (int64_t e = u.entry_begin; e < u.entry_end; ++e) {
    const kv::PageEntry& pe = tk.ws.entries[e];
    const int64_t base = pe.logical * ps;
    const int64_t cnt = std::min(ps, n - base);
    const void* kp = tk.cache.k_page(int32_t(pe.page));
    const void* vp = tk.cache.v_page(int32_t(pe.page));
    // K transposed ([dqk][ps]) so that the scores of a row are a sum of
    // scaled K columns: a loop over keys that vectorises without
    // reassociating a dot product.
    for (int64_t j = 0; j < cnt; ++j) {
      load_row(kp, cc.slot_offset(j, g, dqk), dt, dqk, 1.0f, krow);
      for (int64_t c = 0; c < dqk; ++c) ks[c * ps + j] = krow[c];
      load_row(vp, cc.slot_offset(j, g, dv), dt, dv, 1.0f, vs + j * dv);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qpos = n - ql + r / G;
      const float* qr = qs + r * dqk;
      float* sr = s + r * ps;
      std::fill(sr, sr + cnt, 0.0f);
      for (int64_t c = 0; c < dqk; ++c) {
        const float qc = qr[c];
        const float* kc = ks + c * ps;
        for (int64_t j = 0; j < cnt; ++j) sr[j] += qc * kc[j];
      }
      float mx = kNegInf;
      for (int64_t j = 0; j < cnt; ++j) {
        const int64_t pos = base + j;
        const bool visible = pos <= qpos && (cc.window == 0 || pos >= qpos - cc.window + 1 ||
                                             pos < cc.sink_tokens);
        if (!visible) {
          sr[j] = kNegInf;
          continue;
        }
        if (cap > 0.0f) sr[j] = cap * std::tanh(sr[j] / cap);
        mx = std::max(mx, sr[j]);
      }
      if (mx == kNegInf) continue;  // this page holds no key of this row
      const float m_new = std::max(m[r], mx);
      const float corr = std::exp(m[r] - m_new);  // 0 when m[r] = -inf
      float* ar = acc + r * dv;
      float sum = l[r] * corr;
      for (int64_t c = 0; c < dv; ++c) ar[c] *= corr;
      for (int64_t j = 0; j < cnt; ++j) {
        if (sr[j] == kNegInf) continue;
        const float p = std::exp(sr[j] - m_new);
        sum += p;
        const float* vr = vs + j * dv;
        for (int64_t c = 0; c < dv; ++c) ar[c] += p * vr[c];
      }
      l[r] = sum;
      m[r] = m_new;
    }
  }

  const int64_t maxq = cfg.max_query_tokens;
  for (int64_t t = 0; t < ql; ++t)
    for (int64_t j = 0; j < G; ++j) {
      const int64_t r = t * G + j, h = g * G + j;
      const bool empty = l[r] == 0.0f;
      const float inv = empty ? 0.0f : 1.0f / l[r];
      const float row_lse = empty ? kNegInf : m[r] + std::log(l[r]);
      const float* ar = acc + r * dv;
      if (u.partial < 0) {
        const int64_t oo = ((sm.q_begin + t) * hq + h) * dv;
        for (int64_t c = 0; c < dv; ++c) store_from_float(tk.o, oo + c, dt, ar[c] * inv);
        if (tk.lse) tk.lse[h * tk.total_q + sm.q_begin + t] = row_lse;
      } else {
        const int64_t row = (u.partial * maxq + t) * hq + h;
        float* po = tk.ws.partial_o + row * dv;
        for (int64_t c = 0; c < dv; ++c) po[c] = ar[c] * inv;
        tk.ws.partial_lse[row] = row_lse;
      }
    }
}

// Merges the chunks of split sequence sm into O and LSE:
//   LSE = log sum_u exp(LSE_u),  O = sum_u exp(LSE_u - LSE) O_u.
void merge_sequence(const Task& tk, const SeqMeta& sm) {
  const kv::DecodeConfig& cfg = tk.plan.config();
  const int64_t hq = cfg.heads_q, dv = tk.plan.cache_config().head_dim_v;
  const int64_t maxq = cfg.max_query_tokens;
  const attn_dtype_t dt = tk.plan.cache_config().dtype;
  const WorkUnit* units = tk.ws.units + sm.first_unit;
  for (int64_t t = 0; t < sm.q_len; ++t)
    for (int64_t h = 0; h < hq; ++h) {
      float mx = kNegInf;
      for (int64_t u = 0; u < sm.num_units; ++u)
        mx = std::max(mx, tk.ws.partial_lse[(units[u].partial * maxq + t) * hq + h]);
      const int64_t oo = ((sm.q_begin + t) * hq + h) * dv;
      float* lse_out = tk.lse ? tk.lse + h * tk.total_q + sm.q_begin + t : nullptr;
      if (mx == kNegInf) {  // no chunk saw a key: the identity
        for (int64_t c = 0; c < dv; ++c) store_from_float(tk.o, oo + c, dt, 0.0f);
        if (lse_out) *lse_out = kNegInf;
        continue;
      }
      float total = 0.0f;
      for (int64_t u = 0; u < sm.num_units; ++u)
        total += std::exp(tk.ws.partial_lse[(units[u].partial * maxq + t) * hq + h] - mx);
      const float inv = 1.0f / total;
      for (int64_t c = 0; c < dv; ++c) {
        float sum = 0.0f;
        for (int64_t u = 0; u < sm.num_units; ++u) {
          const int64_t row = (units[u].partial * maxq + t) * hq + h;
          const float w = std::exp(tk.ws.partial_lse[row] - mx);
          if (w != 0.0f) sum += w * tk.ws.partial_o[row * dv + c];
        }
        store_from_float(tk.o, oo + c, dt, sum * inv);
      }
      if (lse_out) *lse_out = mx + std::log(total);
    }
}

}  // namespace

void decode_execute(const kv::DecodePlan& plan, const kv::KvCache& cache,
                    const DecodeWorkspace& ws, const void* q, void* o, float* lse) {
  const kv::PreparedHeader& h = *ws.header;
  const Task tk{plan, cache, ws, q, o, lse, h.total_q};
  const int64_t hkv = plan.cache_config().heads_kv;
  const int64_t tasks = h.num_units * hkv;
  const int64_t scratch_floats = int64_t(plan.scratch().floats);
#if ATTN_HAVE_OPENMP
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(plan.num_threads(), tasks)));
#pragma omp parallel num_threads(threads)
  {
    float* scratch = ws.scratch + int64_t(omp_get_thread_num()) * scratch_floats;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; ++i) run_task(tk, ws.units[i / hkv], i % hkv, scratch);
  }
  if (h.chunk_pages > 0) {
    const int merge_threads = int(std::max<int64_t>(1, std::min<int64_t>(plan.num_threads(), h.batch)));
#pragma omp parallel for schedule(dynamic, 1) num_threads(merge_threads)
    for (int64_t b = 0; b < h.batch; ++b)
      if (ws.seqs[b].num_units > 1) merge_sequence(tk, ws.seqs[b]);
  }
#else
  (void)scratch_floats;
  for (int64_t i = 0; i < tasks; ++i) run_task(tk, ws.units[i / hkv], i % hkv, ws.scratch);
  if (h.chunk_pages > 0)
    for (int64_t b = 0; b < h.batch; ++b)
      if (ws.seqs[b].num_units > 1) merge_sequence(tk, ws.seqs[b]);
#endif
}

}  // namespace attn::cpu
