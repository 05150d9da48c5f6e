// MoBA plans (attn_plan_desc_set_moba) on the CUDA backend against a direct
// fp64 implementation of the rule: ref_moba_select (tests/common/reference.c)
// pools the keys of each block, gates every past block, takes the top_k
// (ties: lower block index) plus the own block, and the fp64 reference then
// runs with that selection materialised as a pair mask under the causal
// mask (S and P materialised in double).
//
// The selection must not depend on rounding, or the test could flake: Q and
// K are drawn from {-2, -1, 1, 2} and every block size is a power of two, so
// block means, gates and their sums over heads are exact in fp32 in any
// summation order, and the GPU's gates equal the fp64 ones, ties (which
// such data has plenty of) included. (The last block may be ragged, with an
// inexact mean, but it is never a past block of any row.) V and dO are
// normal.
//
// Cases: block sizes 128, 256 and 512 (lengths not multiples of them),
// top_k 0..12 and one above the number of blocks (plain causal), per-head and
// GQA-shared selection, MHA/GQA/MQA, lq < lk and lq > lk (rows that see no
// key), batch > 1, BHSD and padded strides, d = 64, 96, 128, 256, bf16 and
// fp16; independent random query rows, and "coherent" ones (runs of equal
// rows, which select alike, as neighbouring tokens of real text tend to);
// one case with more than 64 blocks (the selector's steps of 64 blocks).
// With ATTN_CUDA_MOBA_SM90=1 on an sm_90 device, plans at d = 64 and 128
// run the sm_90a (wgmma) kernels' MoBA instantiations on the tile-union
// lists (forward "cuda-sm90-wgmma-...-moba", dK/dV "+bwd-wgmma-"; meson
// tests moba_gpu_sm90*), unless ATTN_CUDA_FWD_SM90=0 (the sm_80 forward on
// the same lists: moba_gpu_sm90_sm80fwd) or ATTN_CUDA_BWD_SM90=0 /
// ATTN_CUDA_BWD_VARIANT (the sm_80 dK/dV kernel: moba_gpu_sm90_sm80bwd).
// Otherwise, by default the forward
// and the dK/dV kernel walk the gathered row lists
// (the forward merging one round per launch into fp32 row states in the
// workspace; on sm_90 devices at d = 64 and 128 on the wgmma forward, the
// sm_80 one with ATTN_CUDA_MOBA_GATHER_SM90=0: meson test
// moba_gpu_gather_sm80fwd; the dK/dV kernel on wgmma there too, the sm_80
// one with ATTN_CUDA_MOBA_GATHER_BWD_SM90=0: moba_gpu_gather_sm80bwd);
// with ATTN_CUDA_MOBA_GATHER=0 (meson tests moba_gpu_union*)
// they walk the tile-union lists; describe must say which. Each runs the forward, the backward with dQ by atomics and the
// deterministic backward (three times: bit-identical), then the forward
// again without LSE (lse = NULL: O bit-identical). Tolerance as
// test_block_sparse_gpu (FlashAttention's rule): max |X - X_fp64| <=
// 2 * max |X_plain - X_fp64| + atol, X_plain from ref_lowp_* (every op
// rounded to the dtype, fp32 sums), for dQ and dK plus twice the error floor
// of O handed over in the dtype; LSE within 2e-3. Rows that see no key:
// O = 0, LSE = -inf, dQ = 0 exactly; keys no row sees: dK = dV = 0 exactly.
// Outputs and workspaces are poisoned (NaN) before every run, and every
// output element must be written. attn_plan_describe must name the MoBA
// kernels. Error paths: block sizes that are not multiples of 128 and top_k
// above 32 (NOT_SUPPORTED, naming the argument, no plan), a forward
// workspace one byte short (WORKSPACE_TOO_SMALL) or misaligned
// (INVALID_ARGUMENT), O and LSE untouched. A NaN gate ranks first
// (nan_gates).
//
// Fresh random inputs every run (seed printed; ATTN_TEST_SEED=n repeats
// one). ATTN_GPU_TEST_FILTER=text runs only the cases whose name contains
// text. Exit 77 without a CUDA device.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "sparse_common.hpp"

using namespace gpu_test;

namespace {

struct Case : CaseShape {
  int64_t block = 128, top_k = 2;
  bool shared = false;
  bool coherent = false;  // query rows equal in runs of kCoherentRun
};
constexpr int64_t kCoherentRun = 96;
using Problem = CaseProblem<Case>;

uint64_t g_seed = 0;
bool g_gather = true;  // unless ATTN_CUDA_MOBA_GATHER=0: the kernels gather rows
// sm_90 device and ATTN_CUDA_MOBA_SM90=1: d = 64 and 128 plans run the
// wgmma kernels (tile-union lists), the forward unless ATTN_CUDA_FWD_SM90=0,
// the dK/dV pass unless ATTN_CUDA_BWD_SM90=0 or ATTN_CUDA_BWD_VARIANT is set.
bool g_moba_sm90 = false, g_fwd_sm90 = true, g_bwd_sm90 = true;
// sm_90 device, gathered lists: d = 64 and 128 plans run the gathered
// forward on wgmma, unless ATTN_CUDA_MOBA_GATHER_SM90=0 or
// ATTN_CUDA_FWD_SM90=0.
bool g_gather_sm90 = false;
// ... on the warp-specialised forward ("-moba-gather-ws") unless
// ATTN_CUDA_MOBA_GATHER_WS=0 (the one-tile wgmma kernel).
bool g_gather_ws = false;
// sm_90 device, gathered lists: d = 64 and 128 plans run the gathered dK/dV
// kernel on wgmma, unless ATTN_CUDA_MOBA_GATHER_BWD_SM90=0,
// ATTN_CUDA_BWD_SM90=0 or ATTN_CUDA_BWD_VARIANT is set.
bool g_gather_bwd_sm90 = false;

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}
bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0';
}

// What attn_plan_describe must say of a case's (non-dense) MoBA plans.
struct ExpectedKernels {
  bool gather;       // "moba-gather" (else "moba", the tile-union lists)
  bool fwd_sm90;     // "cuda-sm90-wgmma-" forward, else "fa2-"
  bool bwd_sm90;     // "+bwd-wgmma-" (or shortened "+bwd-wg-") dK/dV kernel
  int32_t tile_kv;  // the forward's KV tile (its query tile is 128 either way)
};
ExpectedKernels expected_kernels(const Case& c) {
  const bool sm90 = g_moba_sm90 && (c.d == 64 || c.d == 128);
  ExpectedKernels e;
  e.gather = !sm90 && g_gather;
  e.fwd_sm90 = (sm90 && g_fwd_sm90) || (e.gather && g_gather_sm90 && (c.d == 64 || c.d == 128));
  e.bwd_sm90 =
      (sm90 && g_bwd_sm90) || (e.gather && g_gather_bwd_sm90 && (c.d == 64 || c.d == 128));
  e.tile_kv = e.fwd_sm90 ? 128 : 64;
  return e;
}

using Run = SparseRun<Case>;

attn_plan_desc_t moba_desc(const Problem& p, bool deterministic) {
  attn_plan_desc_t pd = case_plan_desc(p, ATTN_TENSOR_DV + 1);
  ATTN_CHECK(attn_plan_desc_set_passes(pd, ATTN_PASSES_FORWARD_BACKWARD));
  ATTN_CHECK(attn_plan_desc_set_deterministic(pd, deterministic ? 1 : 0));
  ATTN_CHECK(attn_plan_desc_set_allow_empty_rows(pd, 1));
  ATTN_CHECK(attn_plan_desc_set_moba(pd, p.c.block, p.c.top_k, p.c.shared ? 1 : 0));
  return pd;
}

// The forward of `plan` once more, with lse = NULL (O poisoned, workspace
// NaN): O must be bit-identical to r.o, the run's with LSE (the gathered
// forward writes a row's O in its last round next to its LSE, and the
// rows that see no key apart). Returns what differs ("" if nothing).
std::string forward_without_lse(const Run& r, attn_plan_t plan) {
  const Problem& p = r.p;
  DeviceBuf q(p.tq.elems * 2), k(p.tk.elems * 2), v(p.tk.elems * 2), o(p.tq.elems * 2);
  q.upload(r.q.data()), k.upload(r.k.data()), v.upload(r.v.data());
  const std::vector<uint16_t> po(p.tq.elems, poison_half(p.c.dtype));
  o.upload(po.data());
  size_t wsb = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &wsb));
  DeviceBuf ws(wsb);
  GPU_CHECK(cudaMemset(ws.p, 0xff, std::max<size_t>(wsb, 16)));  // NaN everywhere
  GPU_CHECK(cudaDeviceSynchronize());
  ATTN_CHECK(
      attn_forward(plan, q.p, k.p, v.p, o.p, nullptr, wsb ? ws.p : nullptr, wsb, nullptr));
  GPU_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(p.tq.elems);
  o.download(out.data());
  return out == r.o ? "" : " forward with lse = NULL: O not bit-identical to the one with LSE;";
}

// The deterministic plan once more with a kept selection
// (attn_plan_desc_set_moba_keep_selection): its forward and backward share
// one workspace (poisoned first), and the backward reads the forward's
// selection instead of selecting; O and LSE must be bit-identical to
// r.o / r.lse and dQ, dK, dV to the deterministic plan's (the selection
// is deterministic). Returns what differs ("" if nothing).
std::string kept_selection_run(const Run& r, attn_context_t ctx) {
  const Problem& p = r.p;
  attn_plan_desc_t pd = moba_desc(p, true);
  ATTN_CHECK(attn_plan_desc_set_moba_keep_selection(pd, 1));
  const bool every_block_all = p.c.top_k >= (p.c.lk + p.c.block - 1) / p.c.block - 1;
  if (varlen(p.c) && !every_block_all) {
    // A varlen batch runs its sequences one after another on one
    // workspace: a selection kept for the backward is refused.
    attn_status_t st = ATTN_STATUS_SUCCESS;
    std::string msg;
    attn_plan_t refused_plan = plan_or_exit(ctx, pd, p.c.name, &st, &msg);
    attn_plan_destroy(refused_plan);
    return st == ATTN_STATUS_NOT_SUPPORTED && refused_plan == nullptr &&
                   msg.find("varlen") != std::string::npos
               ? ""
               : std::string(" kept selection on a varlen batch: not refused as NOT_SUPPORTED (") +
                     attn_status_string(st) + ": " + msg + ");";
  }
  attn_plan_t plan = plan_or_exit(ctx, pd, p.c.name);
  const attn_plan_info_t info = describe(plan);
  std::string err;
  const bool every_block = p.c.top_k >= (p.c.lk + p.c.block - 1) / p.c.block - 1;
  if ((std::strstr(info.algorithm, "+kept-selection") != nullptr) == every_block)
    err += std::string(" kept selection: algorithm '") + info.algorithm + "';";
  size_t fwsb = 0, bwsb = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fwsb));
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_BACKWARD, &bwsb));
  const size_t wsb = std::max(fwsb, bwsb);
  DeviceBuf q(p.tq.elems * 2), k(p.tk.elems * 2), v(p.tk.elems * 2), o(p.tq.elems * 2),
      d_o(p.tq.elems * 2), lse(size_t(p.lse_elems()) * 4 + 16), dq(p.tq.elems * 2),
      dk(p.tk.elems * 2), dv(p.tk.elems * 2), ws(std::max<size_t>(wsb, 16));
  q.upload(r.q.data()), k.upload(r.k.data()), v.upload(r.v.data()), d_o.upload(r.d_o.data());
  const std::vector<uint16_t> pq(p.tq.elems, poison_half(p.c.dtype)),
      pk(p.tk.elems, poison_half(p.c.dtype));
  o.upload(pq.data()), dq.upload(pq.data()), dk.upload(pk.data()), dv.upload(pk.data());
  GPU_CHECK(cudaMemset(ws.p, 0xff, std::max<size_t>(wsb, 16)));  // NaN everywhere
  GPU_CHECK(cudaMemset(lse.p, 0xff, size_t(p.lse_elems()) * 4 + 16));
  GPU_CHECK(cudaDeviceSynchronize());
  float* l = static_cast<float*>(lse.p);
  ATTN_CHECK(attn_forward(plan, q.p, k.p, v.p, o.p, l, wsb ? ws.p : nullptr, wsb, nullptr));
  ATTN_CHECK(attn_backward(plan, q.p, k.p, v.p, o.p, l, d_o.p, dq.p, dk.p, dv.p,
                           wsb ? ws.p : nullptr, wsb, nullptr));
  GPU_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> out_o(p.tq.elems), g[3] = {std::vector<uint16_t>(p.tq.elems),
                                                    std::vector<uint16_t>(p.tk.elems),
                                                    std::vector<uint16_t>(p.tk.elems)};
  std::vector<float> out_lse(size_t(p.lse_elems()));
  o.download(out_o.data()), dq.download(g[0].data()), dk.download(g[1].data());
  dv.download(g[2].data());
  GPU_CHECK(cudaMemcpy(out_lse.data(), lse.p, out_lse.size() * 4, cudaMemcpyDeviceToHost));
  attn_plan_destroy(plan);
  if (out_o != r.o || std::memcmp(out_lse.data(), r.lse.data(), out_lse.size() * 4) != 0)
    err += " kept selection: O or LSE not bit-identical to the plan's without;";
  const char* names[3] = {"dQ", "dK", "dV"};
  for (int t = 0; t < 3; ++t)
    if (g[t] != r.grads[1][t])
      err += std::string(" kept selection: ") + names[t] +
             " not bit-identical to the deterministic plan's;";
  return err;
}

// Phase one: inputs and every CUDA run of a case.
Run run_device(const Case& c0, attn_context_t ctx) {
  std::mt19937_64 rng(g_seed ^ std::hash<std::string>{}(c0.name));
  Run r;
  r.p = make_problem(c0);
  const Problem& p = r.p;
  const Case& c = p.c;

  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 3);
  const float small_ints[4] = {-2.0f, -1.0f, 1.0f, 2.0f};
  auto normal = [&](int64_t, int64_t, int64_t, int64_t) { return to_half(c.dtype, nd(rng)); };
  auto small_int = [&](int64_t, int64_t, int64_t, int64_t) {
    return to_half(c.dtype, small_ints[pick(rng)]);
  };
  auto query = [&](int64_t b, int64_t s, int64_t h, int64_t x) {
    const bool copy = c.coherent && s % kCoherentRun != 0;
    return copy ? r.q[size_t(p.off_q(b, s - 1, h) + x)] : small_int(b, s, h, x);
  };
  fill_inputs(r, query, normal, small_int, normal);

  attn_plan_t plans[2] = {plan_or_exit(ctx, moba_desc(p, false), c.name),
                          plan_or_exit(ctx, moba_desc(p, true), c.name)};
  // A top_k that keeps every past block runs as the dense causal plan.
  const bool every_block = c.top_k >= (c.lk + c.block - 1) / c.block - 1;
  for (attn_plan_t plan : plans) {
    const attn_plan_info_t info = describe(plan);
    size_t fws = 0;
    ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &fws));
    if ((std::strstr(info.kernel, "moba") == nullptr) != every_block)
      r.describe_error += std::string(" kernel '") + info.kernel + "' for top_k " +
                          std::to_string(c.top_k) + ";";
    const ExpectedKernels want = expected_kernels(c);
    if (!every_block && (std::strstr(info.kernel, "moba-gather") != nullptr) != want.gather)
      r.describe_error += std::string(" kernel '") + info.kernel + "' where the " +
                          (want.gather ? "gathered" : "tile-union") + " schedule was expected;";
    if (!every_block && (std::strstr(info.kernel, want.fwd_sm90 ? "sm90-wgmma-" : "fa2-") ==
                             nullptr ||
                         info.tile_q != 128 || info.tile_kv != want.tile_kv))
      r.describe_error += std::string(" kernel '") + info.kernel + "' (tile " +
                          std::to_string(info.tile_q) + "x" + std::to_string(info.tile_kv) +
                          ") where the " + (want.fwd_sm90 ? "sm_90a" : "sm_80") +
                          " forward was expected;";
    const bool ws_wanted = want.gather && want.fwd_sm90 && g_gather_ws;
    if (!every_block && (std::strstr(info.kernel, "moba-gather-ws") != nullptr) != ws_wanted)
      r.describe_error += std::string(" kernel '") + info.kernel + "' where the " +
                          (ws_wanted ? "warp-specialised" : "one-tile") +
                          " gathered forward was expected;";
    if (!every_block && (std::strstr(info.kernel, "+bwd-wg") != nullptr) != want.bwd_sm90)
      r.describe_error += std::string(" kernel '") + info.kernel + "' where the " +
                          (want.bwd_sm90 ? "sm_90a" : "sm_80") + " dK/dV kernel was expected;";
    const char* algorithm = every_block ? "moba-keeps-every-block:flash-tiled-online-softmax"
                            : varlen(c) ? "flash-moba-per-sequence-online-softmax"
                                        : "flash-moba-online-softmax";
    if (std::strcmp(info.algorithm, algorithm) != 0)
      r.describe_error += std::string(" algorithm '") + info.algorithm + "';";
    // (The dense forward needs no workspace; MoBA's holds the selection.)
    if ((fws == 0 && !every_block) || info.workspace_bytes_forward != fws)
      r.describe_error += " forward workspace 0 or not what attn_plan_workspace_size says;";
  }

  run_passes(r, plans);
  r.describe_error += forward_without_lse(r, plans[0]);
  if (!fwd_only_case(c)) r.describe_error += kept_selection_run(r, ctx);
  attn_plan_destroy(plans[0]);
  attn_plan_destroy(plans[1]);
  return r;
}

// Phase two: the fp64 selection, the reference and the verdict of one case.
Outcome judge(const Run& r) {
  const Problem& p = r.p;
  const Case& c = p.c;
  ref_problem rp = base_ref_problem(p);
  rp.window_left = -1;
  rp.window_right = 0;  // causal
  const Inputs64 x = inputs64(r);
  std::vector<unsigned char> pair(size_t(c.batch * c.hq * c.lq * c.lk));
  ref_moba_select(&rp, x.q.data(), x.k.data(), c.block, c.top_k, c.shared ? 1 : 0, pair.data());
  rp.pair_mask = pair.data();
  rp.pair_mask_batch = c.batch;
  rp.pair_mask_heads = c.hq;
  rp.pair_mask_rows = c.lq;  // (varlen: the longest sequence's, as ref_moba_select pads)
  rp.pair_mask_cols = c.lk;

  // The share of (row, key) pairs under the causal mask that MoBA keeps.
  int64_t kept = 0, causal = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < p.lq(b); ++i)
        for (int64_t j = 0; j < p.lk(b); ++j)
          if (j <= i + p.lk(b) - p.lq(b)) {
            ++causal;
            kept += pair[size_t(((b * c.hq + h) * c.lq + i) * c.lk + j)] != 0;
          }
  char note[64];
  std::snprintf(note, sizeof note, ", kept %.0f%% of causal",
                causal ? 100.0 * double(kept) / double(causal) : 0.0);
  return judge_run(r, rp, x, note);
}

Case make(const std::string& name, attn_dtype_t dt, int64_t d, int64_t batch, int64_t hq,
          int64_t hkv, int64_t lq, int64_t lk, int64_t block, int64_t top_k, bool shared) {
  Case c;
  c.name = name, c.dtype = dt, c.d = d, c.batch = batch, c.hq = hq, c.hkv = hkv, c.lq = lq,
  c.lk = lk, c.mask = ATTN_MASK_CAUSAL, c.block = block, c.top_k = top_k, c.shared = shared;
  // Logits of integer Q, K have a standard deviation of 2.5 sqrt(d) times
  // the scale: about 1 with this one.
  c.scale = float(0.4 / std::sqrt(double(d)));
  return c;
}

std::vector<Case> cases() {
  constexpr attn_dtype_t BF = ATTN_DTYPE_BF16, FP = ATTN_DTYPE_FP16;
  std::vector<Case> v;
  v.push_back(
      make("d128-bf16-b128-top3-per-head-batch2", BF, 128, 2, 2, 2, 1000, 1000, 128, 3, false));
  v.push_back(make("d128-fp16-b128-top1-shared-gqa4/2", FP, 128, 1, 4, 2, 777, 777, 128, 1, true));
  v.push_back(
      make("d128-bf16-b256-top2-shared-mqa4/1-lq<lk", BF, 128, 1, 4, 1, 1000, 1500, 256, 2, true));
  v.push_back(
      make("d128-bf16-b512-top2-per-head-gqa2/1", BF, 128, 1, 2, 1, 2100, 2100, 512, 2, false));
  v.push_back(
      make("d128-fp16-b128-top2-lq>lk-empty-rows", FP, 128, 1, 2, 2, 800, 700, 128, 2, false));
  v.push_back(make("d128-bf16-b128-top0-own-block-only", BF, 128, 1, 2, 1, 500, 500, 128, 0, true));
  v.push_back(make("d128-bf16-b128-top100-all-past-is-causal", BF, 128, 1, 2, 2, 800, 800, 128, 100,
                   false));
  Case c =
      make("d128-bf16-b128-top5-bhsd-padded-batch2", BF, 128, 2, 2, 1, 1400, 1400, 128, 5, false);
  c.layout = ATTN_LAYOUT_BHSD, c.padded = true;
  v.push_back(c);
  v.push_back(make("d64-fp16-b128-top8-per-head", FP, 64, 1, 2, 2, 2000, 2000, 128, 8, false));
  v.push_back(make("d64-bf16-b256-top2-shared-gqa4/2", BF, 64, 1, 4, 2, 1111, 1111, 256, 2, true));
  v.push_back(make("d96-bf16-b128-top3-shared-gqa2/1", BF, 96, 1, 2, 1, 900, 900, 128, 3, true));
  v.push_back(make("d256-bf16-b128-top2-per-head", BF, 256, 1, 2, 2, 700, 700, 128, 2, false));
  v.push_back(make("d256-fp16-b256-top1-shared-gqa2/1", FP, 256, 1, 2, 1, 650, 650, 256, 1, true));
  // Per-head selection in a group of 4: the heads' row lists differ in
  // length; top_k up to 12 of 16 past blocks.
  v.push_back(
      make("d64-bf16-b128-top12-per-head-gqa4/1", BF, 64, 1, 4, 1, 2100, 2100, 128, 12, false));
  v.push_back(
      make("d128-fp16-b128-top6-per-head-gqa4/2", FP, 128, 1, 4, 2, 1300, 1300, 128, 6, false));
  c = make("d128-bf16-b128-top4-per-head-coherent", BF, 128, 1, 2, 2, 1900, 1900, 128, 4, false);
  c.coherent = true;
  v.push_back(c);
  c = make("d64-fp16-b256-top3-shared-gqa2/1-coherent", FP, 64, 1, 2, 1, 2000, 2000, 256, 3, true);
  c.coherent = true;
  v.push_back(c);
  c = make("d256-bf16-b128-top10-per-head-coherent-lq<lk", BF, 256, 1, 2, 2, 900, 1700, 128, 10,
           false);
  c.coherent = true;
  v.push_back(c);
  // Diagonals off the tiles (lq < lk by an odd offset: own blocks start
  // inside query tiles of either pass), lengths no tile or block divides,
  // batches, shared and per-head groups, at d = 64 and 128 (the sm_90a
  // kernels' sizes).
  v.push_back(make("d64-bf16-b512-top3-per-head-gqa4/2-lq<lk", BF, 64, 1, 4, 2, 1234, 1601, 512,
                   3, false));
  v.push_back(
      make("d128-fp16-b256-top4-shared-gqa4/1-batch2", FP, 128, 2, 4, 1, 1537, 1537, 256, 4, true));
  v.push_back(
      make("d64-fp16-b128-top1-shared-mha-lq>lk", FP, 64, 1, 2, 2, 900, 645, 128, 1, true));
  // Blocks of several KV tiles with rows that see no key: the gathered dK/dV
  // kernels skip, per KV tile, the own rows before its diagonal, numbered
  // from the block's first row that sees a key.
  v.push_back(
      make("d128-fp16-b256-top2-per-head-lq>lk", FP, 128, 1, 2, 2, 1300, 1100, 256, 2, false));
  v.push_back(
      make("d64-bf16-b512-top1-shared-gqa2/1-lq>lk", BF, 64, 1, 2, 1, 1500, 1100, 512, 1, true));
  c = make("d128-bf16-b128-top7-shared-gqa2/1-coherent-lq<lk", BF, 128, 1, 2, 1, 1100, 1333, 128,
           7, true);
  c.coherent = true;
  v.push_back(c);
  // Varlen batches (THD): a plan per sequence length, each sequence pooling
  // and gating its own blocks; sequences that select, short ones that keep
  // every block, one with fewer keys than queries (rows that see no key),
  // two of equal lengths (one plan), one without queries whose keys would
  // select (its backward writes dK = dV = 0) and one without keys.
  c = make("varlen-d128-bf16-b128-top2-per-head-gqa4/2", BF, 128, 0, 4, 2, 0, 0, 128, 2, false);
  c.seq_q = {700, 0, 300, 1000, 300, 0, 50}, c.seq_kv = {700, 200, 100, 1300, 100, 900, 0};
  v.push_back(c);
  c = make("varlen-d64-fp16-b256-top1-shared-gqa2/1", FP, 64, 0, 2, 1, 0, 0, 256, 1, true);
  c.seq_q = {513, 129, 1, 1100}, c.seq_kv = {513, 129, 1, 1100};
  v.push_back(c);
  c = make("varlen-d128-fp16-b128-top3-shared-coherent", FP, 128, 0, 2, 2, 0, 0, 128, 3, true);
  c.seq_q = {900, 640}, c.seq_kv = {1200, 640};
  c.coherent = true;
  v.push_back(c);
  // More than 64 blocks: the selector gates 64 past blocks per step and
  // merges each step into the rows' running top lists (rows of the last
  // blocks carry a list into a second step). One head: the fp64 reference
  // is quadratic in the length.
  v.push_back(make("d64-bf16-b128-top5-per-head-66-blocks", BF, 64, 1, 1, 1, 8400, 8400, 128, 5,
                   false));
  return v;
}

// A MoBA plan's creation (batch x heads, head dim d) must fail with
// `status`, a message naming `word`, and no plan.
bool refused(attn_context_t ctx, const char* what, int64_t block, int64_t top_k, int64_t lq,
             attn_status_t status, const char* word, int64_t batch = 1, int64_t heads = 2,
             int64_t d = 128) {
  attn_plan_desc_t pd = nullptr;
  ATTN_CHECK(attn_plan_desc_create(&pd));
  ATTN_CHECK(attn_plan_desc_set_shape(pd, batch, heads, heads, lq, lq, d, d));
  ATTN_CHECK(attn_plan_desc_set_dtype(pd, ATTN_DTYPE_BF16));
  ATTN_CHECK(attn_plan_desc_set_mask(pd, ATTN_MASK_CAUSAL, -1, -1));
  ATTN_CHECK(attn_plan_desc_set_moba(pd, block, top_k, 0));
  attn_plan_t plan = nullptr;
  const attn_status_t s = attn_plan_create(ctx, pd, &plan);
  const std::string msg = attn_last_error_message();  // before the next call resets it
  attn_plan_desc_destroy(pd);
  const bool ok = s == status && plan == nullptr && msg.find(word) != std::string::npos &&
                  msg.find("MoBA") != std::string::npos;
  std::printf("%s %s: %s: %s\n", ok ? "ok  " : "FAIL", what, attn_status_string(s), msg.c_str());
  attn_plan_destroy(plan);
  return ok;
}

// A forward with a workspace one byte short (WORKSPACE_TOO_SMALL), and one
// with a workspace that is not 16-byte aligned (INVALID_ARGUMENT), fail
// with a message naming the workspace and write neither O nor LSE.
bool workspace_errors(attn_context_t ctx) {
  Case c = make("workspace-errors", ATTN_DTYPE_BF16, 128, 1, 2, 2, 300, 300, 128, 1, false);
  const Problem p = make_problem(c);
  attn_plan_t plan = plan_or_exit(ctx, moba_desc(p, false), c.name);
  size_t wsb = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &wsb));
  DeviceBuf q(p.tq.elems * 2), k(p.tk.elems * 2), v(p.tk.elems * 2), o(p.tq.elems * 2),
      lse(size_t(p.lse_elems()) * 4), ws(wsb + 16);
  std::vector<uint16_t> ones(p.tq.elems, to_bf16(1.0f)), kv(p.tk.elems, to_bf16(0.5f));
  q.upload(ones.data()), k.upload(kv.data()), v.upload(kv.data());
  const std::vector<uint16_t> po(p.tq.elems, poison_half(c.dtype));
  const std::vector<float> pl(size_t(p.lse_elems()), NAN);
  struct Try {
    const char* what;
    void* ws;
    size_t bytes;
    attn_status_t want;
  };
  const Try tries[2] = {
      {"a workspace one byte short", ws.p, wsb - 1, ATTN_STATUS_WORKSPACE_TOO_SMALL},
      {"a misaligned workspace", static_cast<char*>(ws.p) + 8, wsb, ATTN_STATUS_INVALID_ARGUMENT}};
  bool all_ok = wsb > 0;
  for (const Try& t : tries) {
    o.upload(po.data()), lse.upload(pl.data());
    const attn_status_t s =
        attn_forward(plan, q.p, k.p, v.p, o.p, static_cast<float*>(lse.p), t.ws, t.bytes, nullptr);
    const std::string msg = attn_last_error_message();
    GPU_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> o_after(p.tq.elems);
    std::vector<float> l_after(size_t(p.lse_elems()));
    o.download(o_after.data()), lse.download(l_after.data());
    bool untouched = o_after == po;
    for (float x : l_after) untouched = untouched && std::isnan(x);
    const bool ok = s == t.want && msg.find("workspace") != std::string::npos && untouched;
    std::printf("%s forward with %s (%zu bytes needed): %s: %s%s\n", ok ? "ok  " : "FAIL", t.what,
                wsb, attn_status_string(s), msg.c_str(), untouched ? "" : " (outputs written)");
    all_ok = all_ok && ok;
  }
  attn_plan_destroy(plan);
  return all_ok;
}

// A NaN gate ranks above every number (attn.h), on the CUDA selector as on
// the CPU: with one NaN key (the first of block n), every row of block n and
// after must give NaN in every column of O (block n is its own or among its
// top_k), every row before it a finite O. bf16, d = 128, blocks of 128,
// top_k 2 of up to 7 past blocks; forward only.
bool nan_gates(attn_context_t ctx) {
  constexpr int64_t L = 1024, D = 128, kBlock = 128;
  attn_plan_desc_t pd = nullptr;
  ATTN_CHECK(attn_plan_desc_create(&pd));
  ATTN_CHECK(attn_plan_desc_set_shape(pd, 1, 1, 1, L, L, D, D));
  ATTN_CHECK(attn_plan_desc_set_dtype(pd, ATTN_DTYPE_BF16));
  ATTN_CHECK(attn_plan_desc_set_mask(pd, ATTN_MASK_CAUSAL, -1, -1));
  ATTN_CHECK(attn_plan_desc_set_moba(pd, kBlock, 2, 0));
  attn_plan_t plan = plan_or_exit(ctx, pd, "nan-gates");
  attn_plan_desc_destroy(pd);
  std::mt19937_64 rng(g_seed ^ 0x4e614eull);
  std::uniform_int_distribution<int> pick(0, 3);
  std::normal_distribution<float> normal;
  const float kValues[4] = {-2.0f, -1.0f, 1.0f, 2.0f};
  std::vector<uint16_t> q(L * D), k(L * D), v(L * D), out(L * D);
  for (auto& x : q) x = to_bf16(kValues[pick(rng)]);
  for (auto& x : k) x = to_bf16(kValues[pick(rng)]);
  for (auto& x : v) x = to_bf16(normal(rng));
  size_t wsb = 0;
  ATTN_CHECK(attn_plan_workspace_size(plan, ATTN_PASS_FORWARD, &wsb));
  DeviceBuf dq(L * D * 2), dk(L * D * 2), dv(L * D * 2), o(L * D * 2), lse(L * 4),
      ws(std::max<size_t>(wsb, 16));
  dq.upload(q.data()), dv.upload(v.data());
  bool ok = true;
  for (const int64_t n : {0, 1, 3, 6}) {
    std::vector<uint16_t> kn = k;
    kn[size_t(n * kBlock * D)] = 0x7fc0;  // bf16 NaN
    dk.upload(kn.data());
    GPU_CHECK(cudaMemset(o.p, 0, L * D * 2));
    ATTN_CHECK(attn_forward(plan, dq.p, dk.p, dv.p, o.p, static_cast<float*>(lse.p), ws.p, wsb,
                            nullptr));
    GPU_CHECK(cudaDeviceSynchronize());
    o.download(out.data());
    int64_t wrong = 0, first = -1;
    for (int64_t i = 0; i < L; ++i) {
      const bool want_nan = i >= n * kBlock;
      for (int64_t c = 0; c < D; ++c) {
        const float x = from_bf16(out[size_t(i * D + c)]);
        if (want_nan != std::isnan(x)) {
          if (first < 0) first = i;
          ++wrong;
        }
      }
    }
    std::printf("  nan-gates (NaN key in block %lld): %s", (long long)n, wrong ? "FAIL" : "ok");
    if (wrong) std::printf(" (%lld elements; first row %lld)", (long long)wrong, (long long)first);
    std::printf("\n");
    ok = ok && wrong == 0;
  }
  attn_plan_destroy(plan);
  return ok;
}

}  // namespace

int main() {
  skip_without_device();
  g_seed = test_seed();
  g_gather = !env_is("ATTN_CUDA_MOBA_GATHER", "0");
  cudaDeviceProp prop{};
  GPU_CHECK(cudaGetDeviceProperties(&prop, 0));
  g_moba_sm90 = prop.major == 9 && prop.minor == 0 && env_is("ATTN_CUDA_MOBA_SM90", "1");
  g_fwd_sm90 = !env_is("ATTN_CUDA_FWD_SM90", "0");
  g_bwd_sm90 = !env_is("ATTN_CUDA_BWD_SM90", "0") && !env_set("ATTN_CUDA_BWD_VARIANT");
  g_gather_sm90 = prop.major == 9 && prop.minor == 0 && g_fwd_sm90 &&
                  !env_is("ATTN_CUDA_MOBA_GATHER_SM90", "0");
  g_gather_ws = g_gather_sm90 && !env_is("ATTN_CUDA_MOBA_GATHER_WS", "0");
  g_gather_bwd_sm90 = prop.major == 9 && prop.minor == 0 && g_bwd_sm90 &&
                      !env_is("ATTN_CUDA_MOBA_GATHER_BWD_SM90", "0");
  // (As expected_kernels says for d = 64 and 128.)
  const bool fwd_wgmma = g_moba_sm90 ? g_fwd_sm90 : g_gather && g_gather_sm90;
  const bool bwd_wgmma = g_moba_sm90 ? g_bwd_sm90 : g_gather && g_gather_bwd_sm90;
  std::printf("device sm_%d%d: d = 64/128 plans expected on the %s forward and the %s dK/dV "
              "kernel; elsewhere the %s schedule\n",
              prop.major, prop.minor, fwd_wgmma ? "sm_90a (wgmma)" : "sm_80",
              bwd_wgmma ? "sm_90a (wgmma)" : "sm_80",
              g_gather ? "gathered (the default)" : "tile-union (ATTN_CUDA_MOBA_GATHER=0)");

  attn_context_t ctx = nullptr;
  ATTN_CHECK(attn_context_create(ATTN_BACKEND_CUDA, 0, 0, &ctx));
  int failures = 0;
  failures += !refused(ctx, "block_size 64", 64, 2, 512, ATTN_STATUS_NOT_SUPPORTED, "block_size");
  failures += !refused(ctx, "block_size 192", 192, 2, 1024, ATTN_STATUS_NOT_SUPPORTED, "block_size");
  failures += !refused(ctx, "top_k 33 of 63 past blocks", 128, 33, 8192, ATTN_STATUS_NOT_SUPPORTED,
                       "top_k");
  // 2 x 65535 per-head selections of 2^25 queries: 2^35 query-tile lists
  // for the selector, 2^32 blocks of its grid's x (2^31 - 1 at most).
  failures += !refused(ctx, "selector lists past the grid", 128, 3, int64_t(1) << 25,
                       ATTN_STATUS_NOT_SUPPORTED, "grid", 2, 65535, 64);
  failures += !workspace_errors(ctx);
  failures += !nan_gates(ctx);

  failures += run_and_judge(
      filtered(cases()), [&](const Case& c) { return run_device(c, ctx); }, judge,
      [](const Case& c) { return c.batch * c.hq * c.lq * c.lk * c.d; });
  attn_context_destroy(ctx);
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
