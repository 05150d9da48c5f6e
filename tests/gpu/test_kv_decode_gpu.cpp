// The paged KV cache and decode plans on the CUDA backend against an fp64
// reference computed here on the gathered tokens: the test keeps every
// appended token of every sequence on the host and, per query token (at
// position n - q_len + t), materialises the scores of the keys it sees
// (causal by position, the cache's window and sinks) in double.
//
// Cases: many sequences of different lengths, GQA 1/4/8, page sizes 1, 13,
// 16, 24 and 40 (1 in both layouts; 24 and 40 multiples of 8 that tiles
// of 64 slots start inside; NHD with one KV head: slots contiguous in the
// pool), both page layouts, q_len 1 and 4 (4 x 8 packed rows: two row tiles),
// window + sinks with eviction, softcap, split-KV forced on, forced off and
// automatic, bf16 and fp16, head dims 64 and 128; long single sequences cut
// into many chunks (up to ~1500, so that the combine's threads each take
// several chunks; the automatic split must cut them), a batch of one with 8
// query tokens (4 row tiles) and a batch mixing one long sequence with
// short unsplit ones, and 12 query tokens per sequence (more than the
// combine's 8 tokens in parallel). Then fork + append on the
// device (copy-on-write of a shared partial page), CAPACITY (nothing
// changes: lengths, pages in use and the pages' contents, checked by a
// decode afterwards), a CUDA graph of execute replayed (bit-identical, and
// replayed again after the next prepare; one captured after a prepare of a
// single unit replayed after one of many), stale and unprepared workspaces
// refused without writing O, NOT_SUPPORTED for what the kernel lacks (grids
// past CUDA's limits included), and
// ATTN_CUDA_DECODE_STAGES refused unless 2 or 3, ATTN_CUDA_DECODE_KERNEL
// refused unless auto, sm80, sm90-bulk, sm90-bulk32 or sm90-tensor, ATTN_CUDA_DECODE_SPLIT unless
// auto, waves or balanced, ATTN_CUDA_DECODE_PDL unless 0 or 1. The page memory is the test's,
// every byte 0xff (NaN) before the first append, so that slots holding no
// token must not weigh in. Under ATTN_CUDA_DECODE_KERNEL=sm80, sm90-bulk,
// sm90-bulk32 or sm90-tensor every plan must name that kernel in describe() (the sm_90 ones
// on sm_90+ devices, the sm_80 one before; sm90-tensor on page sizes that
// are multiples of 8, sm90-bulk on others); under ATTN_CUDA_DECODE_SPLIT=balanced
// the automatic split's plans must name the balanced split.
//
// Tolerance (FlashAttention's rule, as the other GPU tests): max |O -
// O_fp64| <= 2 max |O_plain - O_fp64| + atol, O_plain with scores in fp32, P
// rounded to the dtype and the output rounded; LSE within 2e-3. Outputs
// are poisoned (NaN) before every run and every element must be written.
// Fresh random inputs every run (seed printed; ATTN_TEST_SEED=n repeats
// one). ATTN_GPU_TEST_QUICK=1 shortens the long sequences (for
// compute-sanitizer); ATTN_GPU_TEST_FILTER=text runs only the cases whose
// name contains text. Exit 77 without a CUDA device.

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpu_common.hpp"

using namespace gpu_test;

namespace {

uint64_t g_seed = 0;
int g_failures = 0;
bool g_quick = false;
const char* g_filter = nullptr;
// The decode kernel every plan must name in describe() when
// ATTN_CUDA_DECODE_KERNEL forces one (null: any); g_expect_kernel_p8 for
// page sizes that are multiples of 8.
const char* g_expect_kernel = nullptr;
const char* g_expect_kernel_p8 = nullptr;
// ATTN_CUDA_DECODE_SPLIT=balanced: plans of the automatic split must say
// so in describe()'s algorithm.
bool g_expect_balanced = false;

bool selected(const std::string& name) {
  return g_filter == nullptr || name.find(g_filter) != std::string::npos;
}

struct CacheShape {
  attn_dtype_t dtype = ATTN_DTYPE_BF16;
  attn_kv_layout_t layout = ATTN_KV_LAYOUT_HND;
  int64_t page_size = 16, num_pages = 256, hkv = 2, d = 128, window = 0, sinks = 0;
  // The page memory: the caller's, every byte 0xff (NaN in fp16 and bf16)
  // before the first append, so that a kernel reading a slot that holds no
  // token (the unfilled end of a last page) or letting it weigh in shows;
  // else the library's.
  bool poisoned_memory = true;
};

attn_kv_cache_config_t cache_config(const CacheShape& c) {
  attn_kv_cache_config_t k;
  std::memset(&k, 0, sizeof k);
  k.struct_size = sizeof k;
  k.dtype = c.dtype;
  k.layout = c.layout;
  k.page_size = c.page_size;
  k.num_pages = c.num_pages;
  k.heads_kv = c.hkv;
  k.head_dim_qk = c.d;
  k.head_dim_v = c.d;
  k.window = c.window;
  k.sink_tokens = c.sinks;
  return k;
}

// A CUDA cache with a host copy of every token appended to each sequence
// (rounded to the dtype, as stored).
struct Harness {
  CacheShape shape;
  attn_context_t ctx = nullptr;
  attn_kv_cache_t cache = nullptr;
  cudaStream_t stream = nullptr;
  void* memory = nullptr;  // the caller's page memory (poisoned_memory)
  std::map<int64_t, std::vector<float>> k_host, v_host;  // id -> [pos][hkv][d]
  std::mt19937_64 rng;

  Harness(const CacheShape& s, uint64_t salt) : shape(s), rng(g_seed ^ salt) {
    ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
    const attn_kv_cache_config_t cfg = cache_config(s);
    size_t bytes = 0;
    if (s.poisoned_memory) {
      ATTN_CHECK(attn_kv_cache_memory_size(&cfg, &bytes));
      GPU_CHECK(cudaMalloc(&memory, bytes));
      GPU_CHECK(cudaMemset(memory, 0xff, bytes));
      GPU_CHECK(cudaDeviceSynchronize());
    }
    ATTN_CHECK(attn_kv_cache_create(ctx, &cfg, memory, bytes, &cache));
    GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  ~Harness() {
    attn_kv_cache_destroy(cache);
    attn_context_destroy(ctx);
    cudaStreamDestroy(stream);
    cudaFree(memory);
  }

  void add(int64_t id) {
    ATTN_CHECK(attn_kv_cache_add_sequence(cache, id));
    k_host[id];
    v_host[id];
  }
  void fork(int64_t parent, int64_t child, int64_t n) {
    ATTN_CHECK(attn_kv_cache_fork(cache, parent, child, n));
    const size_t row = size_t(shape.hkv * shape.d);
    k_host[child].assign(k_host[parent].begin(), k_host[parent].begin() + n * row);
    v_host[child].assign(v_host[parent].begin(), v_host[parent].begin() + n * row);
  }

  void truncate(int64_t id, int64_t n) {
    ATTN_CHECK(attn_kv_cache_truncate(cache, id, n));
    const size_t row = size_t(shape.hkv * shape.d);
    k_host[id].resize(size_t(n) * row);
    v_host[id].resize(size_t(n) * row);
  }

  // Random tokens for `counts` tokens of `ids`; returns the status of the
  // append and records the tokens only on success.
  attn_status_t append(const std::vector<int64_t>& ids, const std::vector<int32_t>& counts) {
    int64_t total = 0;
    for (int32_t c : counts) total += c;
    const size_t row = size_t(shape.hkv * shape.d);
    std::vector<uint16_t> kh(size_t(total) * row), vh(kh.size());
    std::vector<float> kf(kh.size()), vf(kh.size());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (size_t i = 0; i < kh.size(); ++i) {
      kh[i] = to_half(shape.dtype, u(rng));
      vh[i] = to_half(shape.dtype, u(rng));
      kf[i] = from_half(shape.dtype, kh[i]);
      vf[i] = from_half(shape.dtype, vh[i]);
    }
    void *kd = nullptr, *vd = nullptr;
    GPU_CHECK(cudaMalloc(&kd, std::max<size_t>(kh.size() * 2, 16)));
    GPU_CHECK(cudaMalloc(&vd, std::max<size_t>(kh.size() * 2, 16)));
    GPU_CHECK(cudaMemcpy(kd, kh.data(), kh.size() * 2, cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMemcpy(vd, vh.data(), vh.size() * 2, cudaMemcpyHostToDevice));
    // A pageable upload may still be in flight when cudaMemcpy returns, and
    // the legacy stream does not order the non-blocking one.
    GPU_CHECK(cudaDeviceSynchronize());
    const attn_status_t st = attn_kv_cache_append(cache, int32_t(ids.size()), ids.data(),
                                                  counts.data(), kd, vd, stream);
    GPU_CHECK(cudaStreamSynchronize(stream));  // before freeing the sources
    GPU_CHECK(cudaFree(kd));
    GPU_CHECK(cudaFree(vd));
    if (st == ATTN_STATUS_SUCCESS) {
      size_t off = 0;
      for (size_t i = 0; i < ids.size(); ++i) {
        const size_t n = size_t(counts[i]) * row;
        k_host[ids[i]].insert(k_host[ids[i]].end(), kf.begin() + off, kf.begin() + off + n);
        v_host[ids[i]].insert(v_host[ids[i]].end(), vf.begin() + off, vf.begin() + off + n);
        off += n;
      }
    }
    return st;
  }
  int64_t length(int64_t id) const { return int64_t(k_host.at(id).size()) / (shape.hkv * shape.d); }
};

struct DecodeOpts {
  int64_t hq = 8;
  int64_t max_q = 1;
  int64_t chunk = 0;  // kv_chunk_tokens
  float softcap = 0.0f;
  int64_t max_batch = 0;  // 0: the batch
};

attn_decode_plan_t make_plan(Harness& h, const DecodeOpts& o, int64_t batch) {
  attn_decode_config_t c;
  std::memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.heads_q = o.hq;
  c.max_batch = o.max_batch > 0 ? o.max_batch : batch;
  c.max_query_tokens = o.max_q;
  c.kv_chunk_tokens = o.chunk;
  c.softcap = o.softcap;
  attn_decode_plan_t p = nullptr;
  ATTN_CHECK(attn_decode_plan_create(h.ctx, h.cache, &c, &p));
  return p;
}

// Device buffers of one step: Q random, O and LSE poisoned.
struct Step {
  std::vector<int64_t> ids;
  std::vector<int32_t> qlens;
  int64_t total_q = 0;
  std::vector<float> q;  // [total_q][hq][d], rounded
  void *q_dev = nullptr, *o_dev = nullptr, *ws = nullptr;
  float* lse_dev = nullptr;
  size_t ws_bytes = 0, o_elems = 0;

  ~Step() {
    cudaFree(q_dev);
    cudaFree(o_dev);
    cudaFree(lse_dev);
    cudaFree(ws);
  }
};

void make_step(Harness& h, attn_decode_plan_t plan, int64_t hq, Step& s) {
  s.total_q = 0;
  for (int32_t q : s.qlens) s.total_q += q;
  const size_t n = size_t(s.total_q * hq * h.shape.d);
  std::vector<uint16_t> qh(n);
  s.q.resize(n);
  std::uniform_real_distribution<float> u(-1.5f, 1.5f);
  for (size_t i = 0; i < n; ++i) {
    qh[i] = to_half(h.shape.dtype, u(h.rng));
    s.q[i] = from_half(h.shape.dtype, qh[i]);
  }
  s.o_elems = n;
  GPU_CHECK(cudaMalloc(&s.q_dev, n * 2));
  GPU_CHECK(cudaMalloc(&s.o_dev, n * 2));
  GPU_CHECK(cudaMalloc(reinterpret_cast<void**>(&s.lse_dev), size_t(s.total_q * hq) * 4));
  GPU_CHECK(cudaMemcpy(s.q_dev, qh.data(), n * 2, cudaMemcpyHostToDevice));
  ATTN_CHECK(attn_decode_plan_workspace_size(plan, &s.ws_bytes));
  GPU_CHECK(cudaMalloc(&s.ws, std::max<size_t>(s.ws_bytes, 1)));
  GPU_CHECK(cudaDeviceSynchronize());  // the uploads before work on the non-blocking stream
}

void poison(const Harness& h, Step& s) {
  std::vector<uint16_t> p(s.o_elems, poison_half(h.shape.dtype));
  GPU_CHECK(cudaMemcpy(s.o_dev, p.data(), p.size() * 2, cudaMemcpyHostToDevice));
  GPU_CHECK(cudaMemset(s.lse_dev, 0xff, s.o_elems / size_t(h.shape.d) * 4));  // NaN
  GPU_CHECK(cudaDeviceSynchronize());  // before work on the non-blocking stream
}

struct Result {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};
Result fetch(const Harness& h, const Step& s) {
  Result r;
  r.o.resize(s.o_elems);
  r.lse.resize(s.o_elems / size_t(h.shape.d));
  GPU_CHECK(cudaStreamSynchronize(h.stream));
  GPU_CHECK(cudaMemcpy(r.o.data(), s.o_dev, r.o.size() * 2, cudaMemcpyDeviceToHost));
  GPU_CHECK(cudaMemcpy(r.lse.data(), s.lse_dev, r.lse.size() * 4, cudaMemcpyDeviceToHost));
  return r;
}

// Compares r with the fp64 reference of step s; prints one line.
bool check(const Harness& h, const Step& s, const DecodeOpts& o, const Result& r,
           const std::string& name) {
  const int64_t d = h.shape.d, hq = o.hq, G = hq / h.shape.hkv;
  const double scale = 1.0 / std::sqrt(double(d));
  const double atol = h.shape.dtype == ATTN_DTYPE_BF16 ? 2.0 * std::ldexp(1.0, -10)
                                                       : 2.0 * std::ldexp(1.0, -13);
  double err = 0.0, err_plain = 0.0, lse_err = 0.0;
  int64_t bad = 0, rows = 0;
  int64_t q_begin = 0;
  for (size_t b = 0; b < s.ids.size(); ++b) {
    const std::vector<float>& K = h.k_host.at(s.ids[b]);
    const std::vector<float>& V = h.v_host.at(s.ids[b]);
    const int64_t n = h.length(s.ids[b]), ql = s.qlens[b];
    for (int64_t t = 0; t < ql; ++t) {
      const int64_t qp = n - ql + t;
      std::vector<int64_t> keys;
      for (int64_t j = 0; j <= qp; ++j)
        if (h.shape.window == 0 || j >= qp - h.shape.window + 1 || j < h.shape.sinks)
          keys.push_back(j);
      for (int64_t hh = 0; hh < hq; ++hh) {
        const int64_t g = hh / G;
        const float* qr = s.q.data() + ((q_begin + t) * hq + hh) * d;
        std::vector<double> sc(keys.size());
        std::vector<float> sf(keys.size());
        double mx = -INFINITY;
        float mxf = -INFINITY;
        for (size_t k = 0; k < keys.size(); ++k) {
          const float* kr = K.data() + (keys[k] * h.shape.hkv + g) * d;
          double dot = 0.0;
          float dotf = 0.0f;
          for (int64_t c = 0; c < d; ++c) {
            dot += double(qr[c]) * double(kr[c]);
            dotf += qr[c] * kr[c];
          }
          double x = dot * scale;
          float xf = dotf * float(scale);
          if (o.softcap > 0.0f) {
            x = o.softcap * std::tanh(x / o.softcap);
            xf = o.softcap * std::tanh(xf / o.softcap);
          }
          sc[k] = x;
          sf[k] = xf;
          mx = std::max(mx, x);
          mxf = std::max(mxf, xf);
        }
        double l = 0.0;
        float lf = 0.0f;
        std::vector<double> out(size_t(d), 0.0), outf(size_t(d), 0.0);
        for (size_t k = 0; k < keys.size(); ++k) {
          const double pr = std::exp(sc[k] - mx);
          const float pf = std::exp(sf[k] - mxf);
          l += pr;
          lf += pf;
          const float pr_low = round_half(h.shape.dtype, pf);
          const float* vr = V.data() + (keys[k] * h.shape.hkv + g) * d;
          for (int64_t c = 0; c < d; ++c) {
            out[size_t(c)] += pr * vr[c];
            outf[size_t(c)] += double(pr_low * vr[c]);
          }
        }
        const double lse_ref = mx + std::log(l);
        const int64_t orow = ((q_begin + t) * hq + hh) * d;
        for (int64_t c = 0; c < d; ++c) {
          const double ref = out[size_t(c)] / l;
          const double plain = round_half(h.shape.dtype, float(outf[size_t(c)] / lf));
          const float got = from_half(h.shape.dtype, r.o[size_t(orow + c)]);
          if (!std::isfinite(got)) {
            ++bad;
            continue;
          }
          err = std::max(err, std::fabs(got - ref));
          err_plain = std::max(err_plain, std::fabs(plain - ref));
        }
        const float gl = r.lse[size_t(hh * s.total_q + q_begin + t)];
        if (!std::isfinite(gl)) ++bad;
        else lse_err = std::max(lse_err, std::fabs(double(gl) - lse_ref));
        ++rows;
      }
    }
    q_begin += ql;
  }
  const double tol = 2.0 * err_plain + atol;
  const bool ok = bad == 0 && err <= tol && lse_err <= 2e-3;
  std::printf("%-58s rows %6" PRId64 "  err %.2e (tol %.2e)  lse %.1e %s\n", name.c_str(), rows,
              err, tol, lse_err, ok ? "ok" : bad ? "BAD (unwritten/NaN)" : "FAIL");
  if (!ok) ++g_failures;
  return ok;
}

attn_decode_step_info_t prepare(Harness& h, attn_decode_plan_t plan, Step& s) {
  attn_decode_step_info_t info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  ATTN_CHECK(attn_decode_prepare(plan, h.cache, int32_t(s.ids.size()), s.ids.data(),
                                 s.qlens.data(), s.ws, s.ws_bytes, &info, h.stream));
  return info;
}

void execute(Harness& h, attn_decode_plan_t plan, Step& s) {
  ATTN_CHECK(attn_decode_execute(plan, h.cache, s.q_dev, s.o_dev, s.lse_dev, s.ws, s.ws_bytes,
                                 h.stream));
}

// Decodes step (ids, qlens) with each split option; checks each. With
// min_auto_chunks > 0 the automatic split (chunk 0) must cut some sequence
// into at least that many chunks, and describe() must report its target.
void decode_and_check(Harness& h, const std::vector<int64_t>& ids,
                      const std::vector<int32_t>& qlens, DecodeOpts o,
                      const std::vector<int64_t>& chunks, const std::string& name,
                      int64_t min_auto_chunks = 0) {
  for (int64_t chunk : chunks) {
    o.chunk = chunk;
    attn_decode_plan_t plan = make_plan(h, o, int64_t(ids.size()));
    {
      attn_decode_plan_info_t pi;
      std::memset(&pi, 0, sizeof pi);
      pi.struct_size = sizeof pi;
      ATTN_CHECK(attn_decode_plan_describe(plan, &pi));
      const char* expect = h.shape.page_size % 8 == 0 ? g_expect_kernel_p8 : g_expect_kernel;
      if (expect != nullptr && std::strncmp(pi.kernel, expect, std::strlen(expect)) != 0) {
        std::printf("  FAIL: %s: the plan runs %s, not %s\n", name.c_str(), pi.kernel, expect);
        ++g_failures;
      }
      const bool balanced = std::strstr(pi.algorithm, "-balanced") != nullptr;
      if (balanced != (g_expect_balanced && chunk == 0)) {
        std::printf("  FAIL: %s chunk=%" PRId64 ": algorithm %s\n", name.c_str(), chunk,
                    pi.algorithm);
        ++g_failures;
      }
    }
    Step s;
    s.ids = ids;
    s.qlens = qlens;
    make_step(h, plan, o.hq, s);
    poison(h, s);
    const attn_decode_step_info_t info = prepare(h, plan, s);
    execute(h, plan, s);
    const Result r = fetch(h, s);
    char label[200];
    std::snprintf(label, sizeof label,
                  "%s chunk=%" PRId64 " (units %" PRId64 ", split %" PRId64 ", chunks %" PRId64 ")",
                  name.c_str(), chunk, info.num_work_units, info.split_sequences,
                  info.max_chunks);
    check(h, s, o, r, label);
    if (chunk > 0 && info.split_sequences == 0) {
      std::printf("  FAIL: chunk %" PRId64 " split nothing\n", chunk);
      ++g_failures;
    }
    if (chunk == 0 && min_auto_chunks > 0) {
      attn_decode_plan_info_t pi;
      std::memset(&pi, 0, sizeof pi);
      pi.struct_size = sizeof pi;
      ATTN_CHECK(attn_decode_plan_describe(plan, &pi));
      const bool ok = info.max_chunks >= min_auto_chunks && pi.split_target_tasks > 0 &&
                      pi.split_min_chunk_tokens > 0 &&
                      info.kv_chunk_tokens >= pi.split_min_chunk_tokens;
      std::printf("  auto split: %" PRId64 " chunks of %" PRId64 " tokens (target %" PRId64
                  " tasks, chunks >= %" PRId64 " tokens) %s\n",
                  info.max_chunks, info.kv_chunk_tokens, pi.split_target_tasks,
                  pi.split_min_chunk_tokens, ok ? "ok" : "FAIL");
      if (!ok) ++g_failures;
    }
    attn_decode_plan_destroy(plan);
  }
}

// A batch of sequences with the given prefill lengths (appended in pieces
// of at most `piece` tokens), then q_len new tokens each, decoded.
void batch_case(const std::string& name, const CacheShape& cs, DecodeOpts o,
                const std::vector<int32_t>& lengths, int32_t q_len, int32_t piece,
                const std::vector<int64_t>& chunks, int64_t min_auto_chunks = 0) {
  if (!selected(name)) return;
  Harness h(cs, std::hash<std::string>{}(name));
  std::vector<int64_t> ids;
  for (size_t i = 0; i < lengths.size(); ++i) {
    ids.push_back(int64_t(100 + 7 * i));
    h.add(ids.back());
  }
  std::vector<int32_t> left = lengths;
  for (;;) {
    std::vector<int64_t> step_ids;
    std::vector<int32_t> counts;
    for (size_t i = 0; i < ids.size(); ++i)
      if (left[i] > 0) {
        const int32_t c = std::min(left[i], piece);
        step_ids.push_back(ids[i]);
        counts.push_back(c);
        left[i] -= c;
      }
    if (step_ids.empty()) break;
    ATTN_CHECK(h.append(step_ids, counts));
  }
  ATTN_CHECK(h.append(ids, std::vector<int32_t>(ids.size(), q_len)));
  o.max_q = std::max<int64_t>(o.max_q, q_len);
  decode_and_check(h, ids, std::vector<int32_t>(ids.size(), q_len), o, chunks, name,
                   min_auto_chunks);
}

void fork_case() {
  if (!selected("fork")) return;
  CacheShape cs;
  cs.page_size = 16;
  cs.hkv = 2;
  Harness h(cs, 11);
  DecodeOpts o;
  o.hq = 8;
  h.add(1);
  ATTN_CHECK(h.append({1}, {37}));  // pages 0, 1 full; page 2 holds 5 tokens
  h.fork(1, 2, 37);                 // shares the partial page
  h.fork(1, 3, 20);                 // shares pages 0 and a partial page 1
  ATTN_CHECK(h.append({1, 2, 3}, {3, 20, 1}));
  ATTN_CHECK(h.append({2, 1}, {1, 1}));
  decode_and_check(h, {1, 2, 3}, {1, 1, 1}, o, {-1, 16}, "fork: three sequences share pages");
  // Release the parent: the children keep their tokens.
  ATTN_CHECK(attn_kv_cache_release(h.cache, 1));
  h.k_host.erase(1);
  h.v_host.erase(1);
  ATTN_CHECK(h.append({3}, {2}));
  decode_and_check(h, {2, 3}, {1, 1}, o, {0}, "fork: after the parent's release");
}

// Speculative decoding's rejected drafts: truncate, then append again
// (into a partly filled page that a fork shares, and in a windowed cache),
// and decode against the tokens the sequences now hold.
void truncate_case() {
  if (!selected("truncate")) return;
  {
    CacheShape cs;
    cs.page_size = 16;
    cs.hkv = 2;
    Harness h(cs, 13);
    DecodeOpts o;
    o.hq = 8;
    o.max_q = 4;
    h.add(1);
    ATTN_CHECK(h.append({1}, {37}));
    h.fork(1, 2, 37);                 // shares page 2 (5 tokens)
    ATTN_CHECK(h.append({1}, {4}));   // four drafts (page 2 copied first)
    h.truncate(1, 38);                // one accepted
    ATTN_CHECK(h.append({1, 2}, {3, 2}));
    decode_and_check(h, {1, 2}, {3, 2}, o, {-1, 16}, "truncate: drafts dropped beside a fork");
    h.truncate(2, 30);  // inside the shared page 1
    ATTN_CHECK(h.append({2}, {1}));
    decode_and_check(h, {1, 2}, {1, 1}, o, {0}, "truncate: into a shared page");
  }
  {
    CacheShape cs;
    cs.page_size = 8;
    cs.hkv = 2;
    cs.window = 40;
    cs.sinks = 4;
    cs.num_pages = 64;
    Harness h(cs, 14);
    DecodeOpts o;
    o.hq = 4;
    o.max_q = 5;
    h.add(7);
    ATTN_CHECK(h.append({7}, {100}));
    ATTN_CHECK(h.append({7}, {5}));  // five drafts
    h.truncate(7, 102);
    ATTN_CHECK(h.append({7}, {2}));
    decode_and_check(h, {7}, {2}, o, {-1, 16}, "truncate: window 40 + 4 sinks");
  }
}

void capacity_case() {
  if (!selected("capacity")) return;
  CacheShape cs;
  cs.page_size = 16;
  cs.num_pages = 10;
  cs.hkv = 2;
  cs.dtype = ATTN_DTYPE_FP16;
  cs.poisoned_memory = false;  // the library's page memory
  Harness h(cs, 12);
  DecodeOpts o;
  o.hq = 4;
  h.add(1);
  h.add(2);
  ATTN_CHECK(h.append({1, 2}, {70, 50}));  // 5 + 4 pages
  attn_kv_cache_info_t before;
  std::memset(&before, 0, sizeof before);
  before.struct_size = sizeof before;
  ATTN_CHECK(attn_kv_cache_get_info(h.cache, &before));
  // 70 -> 81 tokens needs a sixth page for seq 1, 50 -> 80 a fifth for
  // seq 2: the batch needs 2 pages, 1 is free.
  const attn_status_t st = h.append({1, 2}, {11, 30});
  const std::string message = attn_last_error_message();  // before the next call replaces it
  attn_kv_cache_info_t after = before;
  ATTN_CHECK(attn_kv_cache_get_info(h.cache, &after));
  const bool msg = message.find("nothing was appended") != std::string::npos;
  const bool ok = st == ATTN_STATUS_CAPACITY && msg && after.pages_in_use == before.pages_in_use &&
                  h.length(1) == 70 && h.length(2) == 50;
  int64_t len1 = 0, len2 = 0;
  ATTN_CHECK(attn_kv_cache_sequence_length(h.cache, 1, &len1));
  ATTN_CHECK(attn_kv_cache_sequence_length(h.cache, 2, &len2));
  const bool ok2 = ok && len1 == 70 && len2 == 50;
  std::printf("%-58s %s (%s: %s)\n", "capacity: a batch that does not fit changes nothing",
              ok2 ? "ok" : "FAIL", attn_status_string(st), message.c_str());
  if (!ok2) ++g_failures;
  // The pages still hold exactly the tokens appended before.
  decode_and_check(h, {1, 2}, {4, 1}, DecodeOpts{4, 4, 0, 0.0f, 0}, {-1}, "capacity: contents after");
}

void graph_case() {
  if (!selected("graph")) return;
  CacheShape cs;
  cs.page_size = 16;
  cs.hkv = 4;
  Harness h(cs, 13);
  DecodeOpts o;
  o.hq = 16;
  o.chunk = 0;
  std::vector<int64_t> ids = {5, 6, 7};
  for (int64_t id : ids) h.add(id);
  ATTN_CHECK(h.append(ids, {300, 1, 777}));
  attn_decode_plan_t plan = make_plan(h, o, 3);
  Step s;
  s.ids = ids;
  s.qlens = {1, 1, 1};
  make_step(h, plan, o.hq, s);
  poison(h, s);
  prepare(h, plan, s);
  execute(h, plan, s);
  const Result direct = fetch(h, s);
  check(h, s, o, direct, "graph: direct execute");

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  GPU_CHECK(cudaStreamBeginCapture(h.stream, cudaStreamCaptureModeThreadLocal));
  execute(h, plan, s);
  GPU_CHECK(cudaStreamEndCapture(h.stream, &graph));
  GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  poison(h, s);
  GPU_CHECK(cudaGraphLaunch(exec, h.stream));
  const Result replay = fetch(h, s);
  const bool same = replay.o == direct.o &&
                    std::memcmp(replay.lse.data(), direct.lse.data(), direct.lse.size() * 4) == 0;
  std::printf("%-58s %s\n", "graph: replay is bit-identical to the direct execute",
              same ? "ok" : "FAIL");
  if (!same) ++g_failures;

  // Next step: one token each, prepare into the same workspace, replay.
  ATTN_CHECK(h.append(ids, {1, 1, 1}));
  prepare(h, plan, s);
  poison(h, s);
  GPU_CHECK(cudaGraphLaunch(exec, h.stream));
  check(h, s, o, fetch(h, s), "graph: replay after the next step's prepare");

  // A graph captured after a prepare of one short sequence (one work unit,
  // nothing split), replayed after a prepare of all three: the capture must
  // launch the plan's largest grid and the combine, not the blocks of the
  // prepare before it (which a direct execute launches). The replay above
  // would not show that: its prepare has the captured one's units.
  {
    Step t;
    t.ids = ids;
    t.qlens = {1, 1, 1};
    make_step(h, plan, o.hq, t);  // Q, O and LSE for all three
    t.ids = {6};
    t.qlens = {1};
    const attn_decode_step_info_t one = prepare(h, plan, t);
    cudaGraph_t graph_one = nullptr;
    cudaGraphExec_t exec_one = nullptr;
    GPU_CHECK(cudaStreamBeginCapture(h.stream, cudaStreamCaptureModeThreadLocal));
    execute(h, plan, t);
    GPU_CHECK(cudaStreamEndCapture(h.stream, &graph_one));
    GPU_CHECK(cudaGraphInstantiate(&exec_one, graph_one, 0));
    t.ids = ids;
    t.qlens = {1, 1, 1};
    const attn_decode_step_info_t all = prepare(h, plan, t);
    poison(h, t);
    GPU_CHECK(cudaGraphLaunch(exec_one, h.stream));
    const bool grows = one.num_work_units == 1 && one.split_sequences == 0 &&
                       all.num_work_units > 1;
    std::printf("%-58s %s (%" PRId64 " unit(s) captured, %" PRId64 " replayed, %" PRId64
                " split)\n",
                "graph: the replayed prepare has more units", grows ? "ok" : "FAIL",
                one.num_work_units, all.num_work_units, all.split_sequences);
    if (!grows) ++g_failures;
    check(h, t, o, fetch(h, t), "graph: captured after 1 unit, replayed after all");
    GPU_CHECK(cudaGraphExecDestroy(exec_one));
    GPU_CHECK(cudaGraphDestroy(graph_one));
  }

  // Stale metadata (the cache changed after prepare) and an unprepared
  // workspace are refused and O is not written.
  ATTN_CHECK(h.append(ids, {1, 1, 1}));
  poison(h, s);
  const attn_status_t st1 = attn_decode_execute(plan, h.cache, s.q_dev, s.o_dev, s.lse_dev, s.ws,
                                                s.ws_bytes, h.stream);
  const std::string m1 = attn_last_error_message();
  void* other = nullptr;
  GPU_CHECK(cudaMalloc(&other, s.ws_bytes));
  const attn_status_t st2 = attn_decode_execute(plan, h.cache, s.q_dev, s.o_dev, s.lse_dev, other,
                                                s.ws_bytes, h.stream);
  const std::string m2 = attn_last_error_message();
  GPU_CHECK(cudaFree(other));
  const Result untouched = fetch(h, s);
  bool all_poison = true;
  for (uint16_t x : untouched.o) all_poison = all_poison && x == poison_half(h.shape.dtype);
  const bool ok = st1 == ATTN_STATUS_INVALID_ARGUMENT && m1.find("prepare again") != std::string::npos &&
                  st2 == ATTN_STATUS_INVALID_ARGUMENT && m2.find("workspace") != std::string::npos &&
                  all_poison;
  std::printf("%-58s %s (%s | %s)\n", "errors: stale and unprepared workspaces refused",
              ok ? "ok" : "FAIL", m1.c_str(), m2.c_str());
  if (!ok) ++g_failures;

  // One workspace prepared by this plan, then by another plan of the same
  // cache (buffers shared between batch-size buckets): this plan's record
  // still matches the cache, but the metadata are the other plan's, laid
  // out by its offsets. This plan is refused until it prepares again; the
  // other one runs.
  {
    attn_decode_plan_t other_plan = make_plan(h, o, 5);
    size_t other_bytes = 0;
    ATTN_CHECK(attn_decode_plan_workspace_size(other_plan, &other_bytes));
    if (other_bytes > s.ws_bytes) {  // one buffer that serves both plans
      GPU_CHECK(cudaFree(s.ws));
      s.ws_bytes = other_bytes;
      GPU_CHECK(cudaMalloc(&s.ws, s.ws_bytes));
    }
    prepare(h, plan, s);
    prepare(h, other_plan, s);
    poison(h, s);
    const attn_status_t st3 = attn_decode_execute(plan, h.cache, s.q_dev, s.o_dev, s.lse_dev,
                                                  s.ws, s.ws_bytes, h.stream);
    const std::string m3 = attn_last_error_message();
    const Result kept = fetch(h, s);
    bool poisoned = true;
    for (uint16_t x : kept.o) poisoned = poisoned && x == poison_half(h.shape.dtype);
    const bool refused = st3 == ATTN_STATUS_INVALID_ARGUMENT &&
                         m3.find("another plan") != std::string::npos && poisoned;
    std::printf("%-58s %s (%s)\n", "errors: a workspace another plan prepared since refused",
                refused ? "ok" : "FAIL", m3.c_str());
    if (!refused) ++g_failures;
    execute(h, other_plan, s);
    check(h, s, o, fetch(h, s), "errors: the other plan runs on it");
    attn_decode_plan_destroy(other_plan);
    prepare(h, plan, s);
    execute(h, plan, s);
    check(h, s, o, fetch(h, s), "errors: this plan again after its own prepare");
  }
  // A Q the kernels' 16-byte copies cannot read: refused, O not written
  // (the device context stays usable: the next execute runs).
  {
    poison(h, s);
    const attn_status_t st4 =
        attn_decode_execute(plan, h.cache, static_cast<const char*>(s.q_dev) + 2, s.o_dev,
                            s.lse_dev, s.ws, s.ws_bytes, h.stream);
    const std::string m4 = attn_last_error_message();
    const Result kept = fetch(h, s);
    bool poisoned = true;
    for (uint16_t x : kept.o) poisoned = poisoned && x == poison_half(h.shape.dtype);
    const bool refused = st4 == ATTN_STATUS_INVALID_ARGUMENT &&
                         m4.find("q:") != std::string::npos && poisoned;
    std::printf("%-58s %s (%s)\n", "errors: a misaligned q refused", refused ? "ok" : "FAIL",
                m4.c_str());
    if (!refused) ++g_failures;
    execute(h, plan, s);
    check(h, s, o, fetch(h, s), "errors: runs again after the refusal");
  }
  GPU_CHECK(cudaGraphExecDestroy(exec));
  GPU_CHECK(cudaGraphDestroy(graph));
  attn_decode_plan_destroy(plan);
}

void not_supported_case() {
  if (!selected("not supported")) return;
  struct Bad {
    CacheShape cs;
    const char* word;
    int64_t heads_q = 4, max_batch = 2, max_kv_tokens = 0, chunk = 0;
  };
  std::vector<Bad> bad(4);
  bad[0].cs.d = 96;
  bad[0].word = "head_dim";
  bad[1].cs.dtype = ATTN_DTYPE_FP32;
  bad[1].word = "fp32";
  // Grids past CUDA's limits, refused at plan creation rather than by a
  // launch at execute: 65536 query heads (64 groups of 1024 rows) for the
  // combine's y, and 2^24 sequences x 4 one-page chunks x 64 KV heads =
  // 2^32 decode blocks.
  bad[2].cs.hkv = 64, bad[2].cs.d = 64, bad[2].cs.num_pages = 4;
  bad[2].heads_q = 65536;
  bad[2].word = "config->heads_q";
  bad[3].cs.hkv = 64, bad[3].cs.d = 64, bad[3].cs.num_pages = 4;
  bad[3].heads_q = 64, bad[3].max_batch = int64_t(1) << 24, bad[3].max_kv_tokens = 32;
  bad[3].chunk = 16;
  bad[3].word = "kv_chunk_tokens";
  for (const Bad& b : bad) {
    attn_context_t ctx = nullptr;
    ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
    const attn_kv_cache_config_t cfg = cache_config(b.cs);
    attn_kv_cache_t cache = nullptr;
    ATTN_CHECK(attn_kv_cache_create(ctx, &cfg, nullptr, 0, &cache));
    attn_decode_config_t c;
    std::memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.heads_q = b.heads_q;
    c.max_batch = b.max_batch;
    c.max_query_tokens = 1;
    c.max_kv_tokens = b.max_kv_tokens;
    c.kv_chunk_tokens = b.chunk;
    attn_decode_plan_t plan = reinterpret_cast<attn_decode_plan_t>(&c);  // must stay as is
    const attn_status_t st = attn_decode_plan_create(ctx, cache, &c, &plan);
    const bool ok = st == ATTN_STATUS_NOT_SUPPORTED &&
                    std::strstr(attn_last_error_message(), b.word) != nullptr &&
                    plan == reinterpret_cast<attn_decode_plan_t>(&c);
    std::printf("%-58s %s (%s)\n", (std::string("not supported: ") + b.word).c_str(),
                ok ? "ok" : "FAIL", attn_last_error_message());
    if (!ok) ++g_failures;
    attn_kv_cache_destroy(cache);
    attn_context_destroy(ctx);
  }
  // Pages of 2^31 tokens: the append kernel's copy runs and the decode
  // kernel take a slot of a page as an int32. Refused when the cache is
  // made (before its 2^31 x 2 x 64 x 2 x 2 bytes are allocated), not
  // narrowed at the first append.
  {
    CacheShape cs;
    cs.page_size = int64_t(1) << 31, cs.num_pages = 1, cs.d = 64;
    attn_context_t ctx = nullptr;
    ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
    const attn_kv_cache_config_t cfg = cache_config(cs);
    attn_kv_cache_t cache = reinterpret_cast<attn_kv_cache_t>(&cs);  // must stay as is
    const attn_status_t st = attn_kv_cache_create(ctx, &cfg, nullptr, 0, &cache);
    const bool ok = st == ATTN_STATUS_NOT_SUPPORTED &&
                    std::strstr(attn_last_error_message(), "page_size") != nullptr &&
                    cache == reinterpret_cast<attn_kv_cache_t>(&cs);
    std::printf("%-58s %s (%s)\n", "not supported: page_size 2^31", ok ? "ok" : "FAIL",
                attn_last_error_message());
    if (!ok) ++g_failures;
    attn_context_destroy(ctx);
  }
}

// Sets (value non-null) or unsets an environment variable for a scope and
// restores what it was.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* prev = std::getenv(name);
    had_ = prev != nullptr;
    if (had_) saved_ = prev;
    set(value);
  }
  void set(const char* value) {
    if (value != nullptr) setenv(name_, value, 1);
    else unsetenv(name_);
  }
  ~ScopedEnv() { set(had_ ? saved_.c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string saved_;
};

// The tuning variables of the decode kernel: a value outside each one's set
// is refused at plan creation (INVALID_ARGUMENT, message naming it and
// quoting the value, *plan unchanged); the accepted values are named by
// describe(): ATTN_CUDA_DECODE_STAGES (2, 3: "-s3"), ATTN_CUDA_DECODE_KERNEL
// (auto, sm80, sm90-bulk, sm90-bulk32, sm90-tensor: the kernel), ATTN_CUDA_DECODE_SPLIT (auto, waves,
// balanced: "-balanced" in the algorithm of an automatic split, not of a
// fixed one) and ATTN_CUDA_DECODE_PDL (0, 1: "-pdl" on sm_90+). The
// variables are restored after.
void kernel_env_case() {
  if (!selected("kernel env")) return;
  CacheShape cs;
  attn_context_t ctx = nullptr;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  const attn_kv_cache_config_t cfg = cache_config(cs);
  attn_kv_cache_t cache = nullptr;
  ATTN_CHECK(attn_kv_cache_create(ctx, &cfg, nullptr, 0, &cache));
  attn_decode_config_t c;
  std::memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.heads_q = 4;
  c.max_batch = 2;
  c.max_query_tokens = 1;
  int major = 0;
  GPU_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  bool ok = true;
  std::string messages, names;
  // `name`=`bad` must be refused as above.
  auto refused = [&](const char* name, const char* bad) {
    ScopedEnv env(name, bad);
    attn_decode_plan_t plan = reinterpret_cast<attn_decode_plan_t>(&c);  // must stay as is
    const attn_status_t st = attn_decode_plan_create(ctx, cache, &c, &plan);
    const std::string msg = attn_last_error_message();
    ok = ok && st == ATTN_STATUS_INVALID_ARGUMENT && msg.find(name) != std::string::npos &&
         msg.find(std::string("\"") + bad + "\"") != std::string::npos &&
         plan == reinterpret_cast<attn_decode_plan_t>(&c);
    messages += msg + " | ";
  };
  // describe() of a plan (kv_chunk_tokens `chunk`) created under name=value.
  auto described = [&](const char* name, const char* value, int64_t chunk) {
    ScopedEnv env(name, value);
    attn_decode_config_t cc = c;
    cc.kv_chunk_tokens = chunk;
    attn_decode_plan_t p = nullptr;
    ATTN_CHECK(attn_decode_plan_create(ctx, cache, &cc, &p));
    attn_decode_plan_info_t pi;
    std::memset(&pi, 0, sizeof pi);
    pi.struct_size = sizeof pi;
    ATTN_CHECK(attn_decode_plan_describe(p, &pi));
    attn_decode_plan_destroy(p);
    names += std::string(name + std::strlen("ATTN_CUDA_DECODE_")) + "=" + value + " chunk " +
             std::to_string(chunk) + ": " + pi.kernel + " " + pi.algorithm + "; ";
    return pi;
  };

  refused("ATTN_CUDA_DECODE_STAGES", "4");
  ok = ok && std::strstr(described("ATTN_CUDA_DECODE_STAGES", "3", 0).kernel, "-s3") != nullptr;

  refused("ATTN_CUDA_DECODE_KERNEL", "sm91");
  // (The cache's pages hold 16 slots of a head-major pool at head dim 128:
  // the tensor copies apply; the default is the bulk copies, to 32-byte
  // aligned segments on sm_90.)
  const char* bulk_name = major >= 9 ? "cuda-sm90-bulk-paged" : "cuda-sm80-mma-paged";
  const char* bulk32_name = major >= 9 ? "cuda-sm90-bulk32-paged" : "cuda-sm80-mma-paged";
  const char* tensor_name = major >= 9 ? "cuda-sm90-tensor-paged" : "cuda-sm80-mma-paged";
  for (const auto& [value, kernel] : {std::pair<const char*, const char*>{"sm80", "cuda-sm80-mma-paged"},
                                      {"sm90-bulk", bulk_name},
                                      {"sm90-bulk32", bulk32_name},
                                      {"sm90-tensor", tensor_name},
                                      {"auto", major == 9 ? bulk32_name : bulk_name}}) {
    const attn_decode_plan_info_t pi = described("ATTN_CUDA_DECODE_KERNEL", value, 0);
    ok = ok && std::strncmp(pi.kernel, kernel, std::strlen(kernel)) == 0;
  }

  refused("ATTN_CUDA_DECODE_SPLIT", "even");
  const struct {
    const char* env;
    int64_t chunk;
    bool balanced;
  } splits[] = {{"waves", 0, false}, {"balanced", 0, true}, {"balanced", 64, false}};
  for (const auto& w : splits) {
    const attn_decode_plan_info_t pi = described("ATTN_CUDA_DECODE_SPLIT", w.env, w.chunk);
    ok = ok && (std::strstr(pi.algorithm, "-balanced") != nullptr) == w.balanced;
  }

  refused("ATTN_CUDA_DECODE_PDL", "yes");
  for (const char* v : {"0", "1"}) {
    const attn_decode_plan_info_t pi = described("ATTN_CUDA_DECODE_PDL", v, 0);
    ok = ok && (std::strstr(pi.kernel, "-pdl") != nullptr) == (v[0] == '1' && major >= 9);
  }

  std::printf("%-58s %s (%s%s)\n", "kernel env: STAGES, KERNEL, SPLIT, PDL refused and named",
              ok ? "ok" : "FAIL", messages.c_str(), names.c_str());
  if (!ok) ++g_failures;
  attn_kv_cache_destroy(cache);
  attn_context_destroy(ctx);
}

}  // namespace

int main() {
  skip_without_device();
  const char* env = std::getenv("ATTN_TEST_SEED");
  g_seed = env ? std::strtoull(env, nullptr, 10) : std::random_device{}() * 2654435761ull;
  const char* quick = std::getenv("ATTN_GPU_TEST_QUICK");
  g_quick = quick != nullptr && quick[0] == '1';
  g_filter = std::getenv("ATTN_GPU_TEST_FILTER");
  const char* forced = std::getenv("ATTN_CUDA_DECODE_KERNEL");
  {
    int major = 0;
    GPU_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    const char* sm80 = "cuda-sm80-mma-paged";
    const bool sm90 = major >= 9;
    if (forced != nullptr && std::strcmp(forced, "sm90-bulk") == 0) {
      g_expect_kernel = g_expect_kernel_p8 = sm90 ? "cuda-sm90-bulk-paged" : sm80;
    } else if (forced != nullptr && std::strcmp(forced, "sm90-bulk32") == 0) {
      g_expect_kernel = g_expect_kernel_p8 = sm90 ? "cuda-sm90-bulk32-paged" : sm80;
    } else if (forced != nullptr && std::strcmp(forced, "sm90-tensor") == 0) {
      g_expect_kernel = sm90 ? "cuda-sm90-bulk-paged" : sm80;
      g_expect_kernel_p8 = sm90 ? "cuda-sm90-tensor-paged" : sm80;
    } else if (forced != nullptr && std::strcmp(forced, "sm80") == 0) {
      g_expect_kernel = g_expect_kernel_p8 = sm80;
    }
  }
  const char* split = std::getenv("ATTN_CUDA_DECODE_SPLIT");
  g_expect_balanced = split != nullptr && std::strcmp(split, "balanced") == 0;
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)%s%s%s%s\n", g_seed,
              g_seed, g_quick ? ", quick" : "", g_expect_kernel_p8 ? ", kernel " : "",
              g_expect_kernel_p8 ? g_expect_kernel_p8 : "", g_expect_balanced ? ", balanced split" : "");

  const std::vector<int64_t> all_splits = {-1, 0, 64};
  {
    CacheShape cs;  // bf16 HND, page 16, d 128, GQA 4
    cs.hkv = 2;
    cs.num_pages = 512;
    batch_case("bf16 HND p16 d128 GQA4 q1", cs, DecodeOpts{8, 1, 0, 0.0f, 0},
               {1, 15, 16, 17, 100, 255, 700, 1000, 3}, 1, 256, all_splits);
  }
  {
    CacheShape cs;  // fp16 NHD, odd page, d 64, GQA 8, q 4 (32 packed rows)
    cs.dtype = ATTN_DTYPE_FP16;
    cs.layout = ATTN_KV_LAYOUT_NHD;
    cs.page_size = 13;
    cs.hkv = 2;
    cs.d = 64;
    cs.num_pages = 512;
    batch_case("fp16 NHD p13 d64 GQA8 q4", cs, DecodeOpts{16, 4, 0, 0.0f, 0},
               {0, 9, 13, 26, 40, 333, 1200}, 4, 100, all_splits);
  }
  {
    CacheShape cs;  // GQA 1 (MHA), bf16 NHD, d 128
    cs.layout = ATTN_KV_LAYOUT_NHD;
    cs.hkv = 4;
    cs.num_pages = 400;
    batch_case("bf16 NHD p16 d128 GQA1 q1", cs, DecodeOpts{4, 1, 0, 0.0f, 0},
               {5, 64, 129, 900, 2000}, 1, 512, all_splits);
  }
  {
    CacheShape cs;  // fp16 HND d 128, q 4, GQA 4, softcap
    cs.dtype = ATTN_DTYPE_FP16;
    cs.hkv = 2;
    cs.num_pages = 300;
    batch_case("fp16 HND p16 d128 GQA4 q4 softcap 30", cs, DecodeOpts{8, 4, 0, 30.0f, 0},
               {3, 77, 500, 1500}, 4, 300, all_splits);
  }
  {
    CacheShape cs;  // window + sinks with eviction, odd page, bf16 HND
    cs.page_size = 13;
    cs.hkv = 2;
    cs.window = 100;
    cs.sinks = 5;
    cs.num_pages = 200;
    batch_case("bf16 HND p13 d128 GQA4 window 100 + 5 sinks q4", cs, DecodeOpts{8, 4, 0, 0.0f, 0},
               {2, 60, 104, 600, 1500}, 4, 40, {-1, 0, 26});
  }
  {
    CacheShape cs;  // window + sinks, fp16 NHD d 64, GQA 8, q 1
    cs.dtype = ATTN_DTYPE_FP16;
    cs.layout = ATTN_KV_LAYOUT_NHD;
    cs.hkv = 1;
    cs.d = 64;
    cs.window = 64;
    cs.sinks = 16;
    cs.num_pages = 100;
    batch_case("fp16 NHD p16 d64 GQA8 window 64 + 16 sinks q1", cs, DecodeOpts{8, 1, 0, 0.0f, 0},
               {1, 30, 80, 700}, 1, 50, {-1, 0, 32});
  }
  {
    // One long sequence, as 1 x 128K decode at a small size: forced chunks
    // of one page (~1500 chunks) and of 1000 tokens, and the automatic
    // split, which must cut it (a batch of 1 x 2 KV heads fills no GPU).
    const int32_t len = g_quick ? 3000 : 24000;
    CacheShape cs;
    cs.hkv = 2;
    cs.num_pages = len / 16 + 16;
    batch_case("bf16 HND p16 d128 GQA4 one long sequence, many chunks q1", cs,
               DecodeOpts{8, 1, 0, 0.0f, 0}, {len}, 1, 4096, {0, -1, 16, 1000}, 8);
  }
  {
    // A batch of one with 8 query tokens x GQA 8: 64 packed rows, 4 row
    // tiles per unit, each token's row merged over the chunks.
    const int32_t len = g_quick ? 2500 : 9000;
    CacheShape cs;
    cs.dtype = ATTN_DTYPE_FP16;
    cs.layout = ATTN_KV_LAYOUT_NHD;
    cs.page_size = 13;
    cs.hkv = 1;
    cs.d = 64;
    cs.num_pages = len / 13 + 16;
    batch_case("fp16 NHD p13 d64 GQA8 batch 1 q8, many chunks", cs, DecodeOpts{8, 8, 0, 0.0f, 0},
               {len}, 8, 2048, {0, -1, 13, 500}, 4);
  }
  {
    // One long sequence next to short ones: split and unsplit sequences
    // in one batch, q 2.
    const int32_t len = g_quick ? 3000 : 20000;
    CacheShape cs;
    cs.layout = ATTN_KV_LAYOUT_NHD;
    cs.hkv = 1;
    cs.num_pages = len / 16 + 64;
    batch_case("bf16 NHD p16 d128 GQA8 long + short sequences q2, many chunks", cs,
               DecodeOpts{8, 2, 0, 0.0f, 0}, {len, 5, 300, 40}, 2, 4096, {0, 32}, 4);
  }
  {
    // 12 query tokens (chunked prefill): the combine's blocks take tokens
    // t and t + 8, reusing their shared memory.
    CacheShape cs;
    cs.d = 64;
    cs.hkv = 2;
    cs.num_pages = 600;
    batch_case("bf16 HND p16 d64 GQA2 q12, many chunks", cs, DecodeOpts{4, 12, 0, 0.0f, 0},
               {g_quick ? 1500 : 4000, 700}, 12, 1000, {0, 64}, 2);
  }
  {
    // Page size 1, both layouts: a page entry per key slot, 64 per tile.
    for (attn_kv_layout_t layout : {ATTN_KV_LAYOUT_HND, ATTN_KV_LAYOUT_NHD}) {
      CacheShape cs;
      cs.layout = layout;
      cs.page_size = 1;
      cs.hkv = 2;
      cs.num_pages = 2000;
      batch_case(std::string("bf16 ") + (layout == ATTN_KV_LAYOUT_HND ? "HND" : "NHD") +
                     " p1 d128 GQA4 q3",
                 cs, DecodeOpts{8, 3, 0, 0.0f, 0}, {1, 2, 63, 64, 65, 700}, 3, 128, {-1, 0, 5});
    }
  }
  {
    // Page 24 (a multiple of 8, not a power of two: tiles of 64 slots start
    // inside pages), HND, window + sinks, q 2.
    CacheShape cs;
    cs.page_size = 24;
    cs.hkv = 2;
    cs.window = 90;
    cs.sinks = 7;
    cs.num_pages = 200;
    batch_case("bf16 HND p24 d128 GQA4 window 90 + 7 sinks q2", cs, DecodeOpts{8, 2, 0, 0.0f, 0},
               {3, 25, 71, 96, 500, 2000}, 2, 70, {-1, 0, 48});
  }
  {
    // Page 40, NHD with one KV head (slots contiguous in the pool), fp16
    // d 64, GQA 8, q 1, softcap.
    CacheShape cs;
    cs.dtype = ATTN_DTYPE_FP16;
    cs.layout = ATTN_KV_LAYOUT_NHD;
    cs.page_size = 40;
    cs.hkv = 1;
    cs.d = 64;
    cs.num_pages = 300;
    batch_case("fp16 NHD p40 d64 GQA8 q1 softcap 20", cs, DecodeOpts{8, 1, 0, 20.0f, 0},
               {1, 39, 40, 41, 130, 3000}, 1, 1000, {-1, 0, 80});
  }
  fork_case();
  truncate_case();
  capacity_case();
  graph_case();
  not_supported_case();
  kernel_env_case();
  if (g_failures > 0) {
    std::printf("%d FAILED\n", g_failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
