// attn_merge_states on the CUDA backend against the CPU backend's merge of
// the same parts (and, for LSE, against fp64): O of shape [2, 37, 3, dim]
// (BSHD rows) with LSE [2, 3, 37] (its own strides), fp32 / fp16 / bf16,
// dim 64, 40 and 0, 1 / 3 / 130 parts (130: the launches chain through
// o_out and lse_out), in place (o_out = o_parts[0], lse_out = lse_parts[0])
// and not, LSE drawn in [-6, 6] with some parts empty for a row (-inf) and
// some rows empty in every part (O = 0, LSE = -inf exactly). Then: a merge
// captured in a CUDA graph and replayed gives the same bits; more parts than
// one launch takes without lse_out is NOT_SUPPORTED, a misaligned o_out is
// INVALID_ARGUMENT, and neither writes the output; NaN LSE parts give NaN
// rows, and an empty part's NaN O is ignored (nan_case).
// Exit 77 without a GPU.

#include <cuda_runtime.h>

#include <attn/attn.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_common.hpp"

namespace {

using namespace gpu_test;

int g_failures = 0;
constexpr int64_t kB = 2, kS = 37, kH = 3;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

size_t es_of(attn_dtype_t t) { return t == ATTN_DTYPE_FP32 ? 4 : 2; }
const char* name_of(attn_dtype_t t) {
  return t == ATTN_DTYPE_FP32 ? "fp32" : t == ATTN_DTYPE_FP16 ? "fp16" : "bf16";
}
float unit_roundoff(attn_dtype_t t) {
  return t == ATTN_DTYPE_FP32 ? 0x1p-24f : t == ATTN_DTYPE_FP16 ? 0x1p-11f : 0x1p-8f;
}

// Host values of one part in the dtype's bytes.
std::vector<uint8_t> encode(attn_dtype_t t, const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * es_of(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == ATTN_DTYPE_FP32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = to_half(t, v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}
std::vector<float> decode(attn_dtype_t t, const std::vector<uint8_t>& b) {
  std::vector<float> out(b.size() / es_of(t));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == ATTN_DTYPE_FP32) {
      std::memcpy(&out[i], b.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, b.data() + 2 * i, 2);
      out[i] = from_half(t, h);
    }
  }
  return out;
}

struct Descs {
  attn_tensor_desc_t o = nullptr, lse = nullptr;
  Descs(attn_dtype_t t, int64_t dim) {
    const int64_t od[4] = {kB, kS, kH, dim};
    const int64_t ld[3] = {kB, kS, kH};
    const int64_t ls[3] = {kH * kS, 1, kS};  // LSE [B, H, S] seen as [B, S, H]
    ATTN_CHECK(attn_tensor_desc_create(&o));
    ATTN_CHECK(attn_tensor_desc_create(&lse));
    ATTN_CHECK(attn_tensor_desc_set(o, t, 4, od, nullptr));
    ATTN_CHECK(attn_tensor_desc_set(lse, ATTN_DTYPE_FP32, 3, ld, ls));
  }
  ~Descs() {
    attn_tensor_desc_destroy(o);
    attn_tensor_desc_destroy(lse);
  }
};

void report(bool ok, const std::string& what, const std::string& detail) {
  std::printf("%-60s %s%s%s\n", what.c_str(), ok ? "ok" : "FAIL", detail.empty() ? "" : "  ",
              detail.c_str());
  if (!ok) ++g_failures;
}

void run_case(attn_context_t cpu, attn_context_t gpu, attn_dtype_t t, int64_t dim, int parts,
              bool in_place, std::mt19937_64& rng) {
  const int64_t rows = kB * kS * kH, n_o = rows * dim;
  const size_t o_bytes = size_t(n_o) * es_of(t), l_bytes = size_t(rows) * 4;
  std::uniform_real_distribution<float> uo(-2.0f, 2.0f), ul(-6.0f, 6.0f), u01(0.0f, 1.0f);
  std::vector<std::vector<uint8_t>> o_host(static_cast<size_t>(parts));
  std::vector<std::vector<float>> l_host(static_cast<size_t>(parts),
                                         std::vector<float>(static_cast<size_t>(rows)));
  for (int p = 0; p < parts; ++p) {
    std::vector<float> v(static_cast<size_t>(n_o));
    for (float& x : v) x = uo(rng);
    o_host[size_t(p)] = encode(t, v);
    for (int64_t r = 0; r < rows; ++r) l_host[size_t(p)][size_t(r)] = u01(rng) < 0.2f ? kNegInf : ul(rng);
  }
  // Rows that every part left empty: (b, s, h) = (0, 5, *) and (1, 36, 2).
  for (int p = 0; p < parts; ++p) {
    for (int64_t h = 0; h < kH; ++h) l_host[size_t(p)][size_t(0 * kH * kS + h * kS + 5)] = kNegInf;
    l_host[size_t(p)][size_t(1 * kH * kS + 2 * kS + 36)] = kNegInf;
  }
  Descs d(t, dim);

  // CPU reference merge.
  std::vector<const void*> op_cpu(static_cast<size_t>(parts));
  std::vector<const float*> lp_cpu(static_cast<size_t>(parts));
  for (int p = 0; p < parts; ++p) op_cpu[size_t(p)] = o_host[size_t(p)].data(), lp_cpu[size_t(p)] = l_host[size_t(p)].data();
  std::vector<uint8_t> o_want(std::max<size_t>(o_bytes, 1));
  std::vector<float> l_want(static_cast<size_t>(rows));
  ATTN_CHECK(attn_merge_states(cpu, parts, d.o, d.lse, op_cpu.data(), lp_cpu.data(), o_want.data(),
                               l_want.data(), nullptr));

  // Device parts and outputs (poisoned).
  std::vector<DeviceBuf*> o_dev, l_dev;
  std::vector<const void*> op(static_cast<size_t>(parts));
  std::vector<const float*> lp(static_cast<size_t>(parts));
  for (int p = 0; p < parts; ++p) {
    o_dev.push_back(new DeviceBuf(o_bytes));
    l_dev.push_back(new DeviceBuf(l_bytes));
    if (o_bytes > 0) o_dev.back()->upload(o_host[size_t(p)].data());
    l_dev.back()->upload(l_host[size_t(p)].data());
    op[size_t(p)] = o_dev.back()->p;
    lp[size_t(p)] = static_cast<const float*>(l_dev.back()->p);
  }
  DeviceBuf o_out(o_bytes), l_out(l_bytes);
  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The poison goes on the merge's stream: a plain cudaMemset runs on the
  // legacy stream, which a non-blocking stream does not wait for.
  GPU_CHECK(cudaMemsetAsync(o_out.p, 0x7f, std::max<size_t>(o_bytes, 16), stream));
  GPU_CHECK(cudaMemsetAsync(l_out.p, 0x7f, l_bytes, stream));
  void* dst_o = in_place ? o_dev[0]->p : o_out.p;
  float* dst_l = static_cast<float*>(in_place ? l_dev[0]->p : l_out.p);
  ATTN_CHECK(attn_merge_states(gpu, parts, d.o, d.lse, op.data(), lp.data(), dst_o, dst_l, stream));
  GPU_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> o_got(std::max<size_t>(o_bytes, 1));
  std::vector<float> l_got(static_cast<size_t>(rows));
  if (o_bytes > 0) GPU_CHECK(cudaMemcpy(o_got.data(), dst_o, o_bytes, cudaMemcpyDeviceToHost));
  GPU_CHECK(cudaMemcpy(l_got.data(), dst_l, l_bytes, cudaMemcpyDeviceToHost));

  // O against the CPU's within two roundings of the dtype (and the fp32
  // sums' rounding: expf and another order on the device) of the largest |O|;
  // LSE against the CPU's and against fp64; empty rows exactly.
  o_got.resize(o_bytes), o_want.resize(o_bytes);
  const std::vector<float> og = decode(t, o_got), ow = decode(t, o_want);
  float o_err = 0.0f, o_max = 0.0f;
  bool finite = true;
  for (size_t i = 0; i < og.size(); ++i) {
    finite = finite && std::isfinite(og[i]);
    o_err = std::max(o_err, std::fabs(og[i] - ow[i]));
    o_max = std::max(o_max, std::fabs(ow[i]));
  }
  // (fp32 sums over up to 130 parts in another order: a few hundred units.)
  const float o_tol = 2.0f * unit_roundoff(t) * o_max + 256 * 0x1p-24f * o_max;
  double l_err = 0.0, l64_err = 0.0;
  bool empty_ok = true;
  std::string empty_detail;  // the first wrong empty row, for the report
  for (int64_t r = 0; r < rows; ++r) {
    double m = -INFINITY;
    for (int p = 0; p < parts; ++p) m = std::max(m, double(l_host[size_t(p)][size_t(r)]));
    double s = 0.0;
    if (m != -INFINITY)
      for (int p = 0; p < parts; ++p) s += std::exp(double(l_host[size_t(p)][size_t(r)]) - m);
    const double l64 = m == -INFINITY ? -INFINITY : m + std::log(s);
    if (l64 == -INFINITY) {
      if ((l_got[size_t(r)] != kNegInf || l_want[size_t(r)] != kNegInf) && empty_ok) {
        char e[120];
        std::snprintf(e, sizeof e, " (LSE row %lld: got %g, cpu %g)", static_cast<long long>(r),
                      double(l_got[size_t(r)]), double(l_want[size_t(r)]));
        empty_detail = e;
        empty_ok = false;
      }
      continue;
    }
    // (std::max would drop a NaN: count non-finite LSE as a failure.)
    finite = finite && std::isfinite(l_got[size_t(r)]);
    l_err = std::max(l_err, std::fabs(double(l_got[size_t(r)]) - double(l_want[size_t(r)])));
    l64_err = std::max(l64_err, std::fabs(double(l_got[size_t(r)]) - l64));
  }
  // O of the empty rows: exactly zero (BSHD offset of (b, s, h)).
  auto o_row_zero = [&](int64_t b, int64_t s, int64_t h) {
    for (int64_t c = 0; c < dim; ++c)
      if (og[size_t(((b * kS + s) * kH + h) * dim + c)] != 0.0f) return false;
    return true;
  };
  bool o_empty_ok = true;
  for (int64_t h = 0; h < kH; ++h) o_empty_ok = o_empty_ok && o_row_zero(0, 5, h);
  o_empty_ok = o_empty_ok && o_row_zero(1, 36, 2);
  if (!o_empty_ok) empty_detail += " (O of an empty row not zero)";
  empty_ok = empty_ok && o_empty_ok;
  const bool ok = finite && o_err <= o_tol && l_err <= 1e-5 && l64_err <= 1e-5 && empty_ok;
  char detail[300];
  std::snprintf(detail, sizeof detail, "O err %.3g (tol %.3g), LSE err %.3g (fp64 %.3g)%s%s%s",
                double(o_err), double(o_tol), l_err, l64_err, finite ? "" : ", not finite",
                empty_ok ? "" : ", empty rows wrong", empty_detail.c_str());
  report(ok, std::string("merge ") + name_of(t) + " dim " + std::to_string(dim) + ", " +
                 std::to_string(parts) + " part(s)" + (in_place ? ", in place" : ""),
         detail);
  GPU_CHECK(cudaStreamDestroy(stream));
  for (DeviceBuf* b : o_dev) delete b;
  for (DeviceBuf* b : l_dev) delete b;
}

// A merge captured in a graph, replayed: the same bits as the direct call.
void graph_case(attn_context_t gpu) {
  const attn_dtype_t t = ATTN_DTYPE_BF16;
  const int64_t dim = 64, rows = kB * kS * kH;
  const size_t o_bytes = size_t(rows * dim) * 2, l_bytes = size_t(rows) * 4;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  DeviceBuf o0(o_bytes), o1(o_bytes), l0(l_bytes), l1(l_bytes), out(o_bytes), lout(l_bytes);
  for (DeviceBuf* b : {&o0, &o1}) {
    std::vector<float> v(static_cast<size_t>(rows * dim));
    for (float& x : v) x = u(rng);
    b->upload(encode(t, v).data());
  }
  for (DeviceBuf* b : {&l0, &l1}) {
    std::vector<float> v(static_cast<size_t>(rows));
    for (float& x : v) x = 2.0f * u(rng);
    b->upload(v.data());
  }
  Descs d(t, dim);
  const void* op[2] = {o0.p, o1.p};
  const float* lp[2] = {static_cast<const float*>(l0.p), static_cast<const float*>(l1.p)};
  cudaStream_t s;
  GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ATTN_CHECK(attn_merge_states(gpu, 2, d.o, d.lse, op, lp, out.p, static_cast<float*>(lout.p), s));
  GPU_CHECK(cudaStreamSynchronize(s));
  std::vector<uint8_t> direct(o_bytes), replay(o_bytes);
  std::vector<float> ldirect(static_cast<size_t>(rows)), lreplay(static_cast<size_t>(rows));
  out.download(direct.data());
  lout.download(ldirect.data());
  GPU_CHECK(cudaMemset(out.p, 0, o_bytes));
  GPU_CHECK(cudaMemset(lout.p, 0, l_bytes));
  GPU_CHECK(cudaDeviceSynchronize());  // the legacy stream's memsets before the replay on s
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  GPU_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  ATTN_CHECK(attn_merge_states(gpu, 2, d.o, d.lse, op, lp, out.p, static_cast<float*>(lout.p), s));
  GPU_CHECK(cudaStreamEndCapture(s, &graph));
  GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  GPU_CHECK(cudaGraphLaunch(exec, s));
  GPU_CHECK(cudaStreamSynchronize(s));
  out.download(replay.data());
  lout.download(lreplay.data());
  report(direct == replay && std::memcmp(ldirect.data(), lreplay.data(), l_bytes) == 0,
         "merge captured in a graph, replayed: the same bits", "");
  GPU_CHECK(cudaGraphExecDestroy(exec));
  GPU_CHECK(cudaGraphDestroy(graph));
  GPU_CHECK(cudaStreamDestroy(s));
}

// Non-finite inputs, as the CPU merge (attn.h): fp32, dim 64, 3 parts; in
// rows (b, s, h) = (0, s, 0) every part's LSE is NaN for s = 0, one part's
// for s = 1 (O and LSE NaN), and for s = 2 the empty part (-inf) has a NaN
// O (the row finite, the part ignored); other rows finite.
void nan_case(attn_context_t gpu) {
  const attn_dtype_t t = ATTN_DTYPE_FP32;
  const int64_t dim = 64, rows = kB * kS * kH;
  const size_t o_bytes = size_t(rows * dim) * 4, l_bytes = size_t(rows) * 4;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  auto lse_at = [](int64_t b, int64_t s, int64_t h) { return size_t((b * kH + h) * kS + s); };
  std::vector<DeviceBuf*> o(3), l(3);
  for (int p = 0; p < 3; ++p) {
    std::vector<float> ov(static_cast<size_t>(rows * dim)), lv(static_cast<size_t>(rows));
    for (float& x : ov) x = u(rng);
    for (float& x : lv) x = 2.0f * u(rng);
    lv[lse_at(0, 0, 0)] = nan;
    if (p == 1) lv[lse_at(0, 1, 0)] = nan;
    if (p == 2) {
      lv[lse_at(0, 2, 0)] = kNegInf;
      ov[size_t((0 * kS + 2) * kH * dim + 5)] = nan;  // row (0, 2, 0), channel 5
    }
    o[size_t(p)] = new DeviceBuf(o_bytes), l[size_t(p)] = new DeviceBuf(l_bytes);
    o[size_t(p)]->upload(ov.data());
    l[size_t(p)]->upload(lv.data());
  }
  DeviceBuf out(o_bytes), lout(l_bytes);
  Descs d(t, dim);
  const void* op[3] = {o[0]->p, o[1]->p, o[2]->p};
  const float* lp[3] = {static_cast<const float*>(l[0]->p), static_cast<const float*>(l[1]->p),
                        static_cast<const float*>(l[2]->p)};
  ATTN_CHECK(attn_merge_states(gpu, 3, d.o, d.lse, op, lp, out.p, static_cast<float*>(lout.p),
                               nullptr));
  GPU_CHECK(cudaDeviceSynchronize());
  std::vector<float> og(static_cast<size_t>(rows * dim)), lg(static_cast<size_t>(rows));
  out.download(og.data());
  lout.download(lg.data());
  int64_t wrong = 0;
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t s = 0; s < kS; ++s)
      for (int64_t h = 0; h < kH; ++h) {
        const bool want_nan = b == 0 && h == 0 && s < 2;
        wrong += std::isnan(lg[lse_at(b, s, h)]) != want_nan;
        for (int64_t c = 0; c < dim; ++c)
          wrong += std::isnan(og[size_t(((b * kS + s) * kH + h) * dim + c)]) != want_nan;
      }
  report(wrong == 0, "merge with NaN LSE parts and a NaN O in an empty part",
         wrong ? std::to_string(wrong) + " elements NaN where they should not be or not NaN" : "");
  for (DeviceBuf* b : o) delete b;
  for (DeviceBuf* b : l) delete b;
}

// Refusals, with the output left as it was.
void error_cases(attn_context_t gpu) {
  const attn_dtype_t t = ATTN_DTYPE_FP16;
  const int64_t dim = 64, rows = kB * kS * kH;
  const size_t o_bytes = size_t(rows * dim) * 2, l_bytes = size_t(rows) * 4;
  Descs d(t, dim);
  DeviceBuf part(o_bytes), lpart(l_bytes), out(o_bytes + 16);
  GPU_CHECK(cudaMemset(part.p, 0, o_bytes));
  GPU_CHECK(cudaMemset(lpart.p, 0, l_bytes));
  GPU_CHECK(cudaMemset(out.p, 0x55, o_bytes + 16));
  std::vector<const void*> op(200, part.p);
  std::vector<const float*> lp(200, static_cast<const float*>(lpart.p));
  auto untouched = [&] {
    std::vector<uint8_t> h(o_bytes + 16);
    out.download(h.data());
    for (uint8_t x : h)
      if (x != 0x55) return false;
    return true;
  };
  attn_status_t st = attn_merge_states(gpu, 200, d.o, d.lse, op.data(), lp.data(), out.p, nullptr,
                                       nullptr);
  std::string msg = attn_last_error_message();
  GPU_CHECK(cudaDeviceSynchronize());
  report(st == ATTN_STATUS_NOT_SUPPORTED && msg.find("lse_out") != std::string::npos && untouched(),
         "merge: 200 parts without lse_out refused", msg);
  st = attn_merge_states(gpu, 2, d.o, d.lse, op.data(), lp.data(),
                         static_cast<char*>(out.p) + 1, nullptr, nullptr);
  msg = attn_last_error_message();
  GPU_CHECK(cudaDeviceSynchronize());
  report(st == ATTN_STATUS_INVALID_ARGUMENT && msg.find("o_out") != std::string::npos && untouched(),
         "merge: misaligned fp16 o_out refused", msg);
}

}  // namespace

int main() {
  skip_without_device();
  attn_context_t cpu = nullptr, gpu = nullptr;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CPU, 0, 1, &cpu));
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &gpu));
  std::mt19937_64 rng(20261205);
  for (attn_dtype_t t : {ATTN_DTYPE_FP32, ATTN_DTYPE_FP16, ATTN_DTYPE_BF16})
    for (int64_t dim : {64, 40, 0})
      for (int parts : {1, 3, 130})
        for (bool in_place : {false, true}) run_case(cpu, gpu, t, dim, parts, in_place, rng);
  graph_case(gpu);
  nan_case(gpu);
  error_cases(gpu);
  attn_context_destroy(cpu);
  attn_context_destroy(gpu);
  std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}
