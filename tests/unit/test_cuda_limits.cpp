// The CUDA backend's own limits (cuda/limits.hpp, and MoBA's and the
// block-sparse tile lists' checks that use it), host code only, so they are
// checked in every build: grids of at most 65535 in y and z and 2^31 - 1
// blocks in x, and values the kernels take as int32. Each limit refuses
// with NOT_SUPPORTED and a message naming it, just past its edge, and lets
// the edge itself through; window bounds past int32 are unbounded exactly
// when they hide no key. tests/gpu checks that plan and cache creation on a
// device refuse the same way.
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "cuda/block_sparse.hpp"
#include "cuda/limits.hpp"
#include "cuda/moba_plan.hpp"

namespace {

using attn::Problem;

int g_failures = 0;

void expect(bool ok, const std::string& what, const std::string& detail = "") {
  std::printf("%s %s%s%s\n", ok ? "ok  " : "FAIL", what.c_str(), detail.empty() ? "" : ": ",
              detail.c_str());
  if (!ok) ++g_failures;
}

// Runs f; "" when it returns, else the message of the NOT_SUPPORTED it
// throws ("<other>" for anything else).
std::string refusal(const std::function<void()>& f) {
  try {
    f();
    return "";
  } catch (const attn::Error& e) {
    return e.status() == ATTN_STATUS_NOT_SUPPORTED ? std::string(e.what())
                                                   : std::string("<other> ") + e.what();
  } catch (...) {
    return "<other>";
  }
}

void expect_refused(const std::string& what, const std::function<void()>& f, const char* word) {
  const std::string msg = refusal(f);
  expect(!msg.empty() && msg.rfind("<other>", 0) != 0 && msg.find(word) != std::string::npos,
         what + " -> NOT_SUPPORTED naming \"" + word + "\"", msg.empty() ? "accepted" : msg);
}

void expect_accepted(const std::string& what, const std::function<void()>& f) {
  const std::string msg = refusal(f);
  expect(msg.empty(), what + " -> accepted", msg);
}

// A fixed-length problem (no shift unless given: one per sequence).
Problem make(int64_t batch, int64_t hq, int64_t hkv, int64_t lq, int64_t lk, int64_t d = 64,
             std::vector<int64_t> shifts = {}) {
  Problem p;
  p.dtype = ATTN_DTYPE_BF16;
  p.batch = batch, p.heads_q = hq, p.heads_kv = hkv, p.seqlen_q = lq, p.seqlen_kv = lk;
  p.head_dim_qk = p.head_dim_v = d;
  p.mask = ATTN_MASK_NONE;
  p.window = attn::WindowBounds{-1, -1};
  for (int64_t b = 0; b <= batch; ++b) p.cu_q.push_back(b * lq), p.cu_kv.push_back(b * lk);
  p.diagonal_shift = std::move(shifts);
  return p;
}

void plan_limits() {
  using attn::cuda::check_plan_limits;
  const Problem ok = make(65535, 65535, 1, 64, 64);
  expect_accepted("65535 sequences x 65535 query heads", [&] { check_plan_limits(ok); });
  expect_refused("65536 query heads", [&] { check_plan_limits(make(1, 65536, 1, 64, 64)); },
                 "heads_q");
  expect_refused("65536 sequences", [&] { check_plan_limits(make(65536, 1, 1, 64, 64)); },
                 "batch");
  expect_accepted("2^30 - 1 queries and keys",
                  [&] { check_plan_limits(make(1, 1, 1, (1 << 30) - 1, (1 << 30) - 1)); });
  expect_refused("2^30 keys", [&] { check_plan_limits(make(1, 1, 1, 64, int64_t(1) << 30)); },
                 "2^30");
  Problem bwd = make(4, 4096, 1, int64_t(1) << 19, 64);  // 2^33 (token, head) rows
  bwd.backward = true;
  expect_refused("a backward over 2^33 rows", [&] { check_plan_limits(bwd); }, "2^33");
  bwd.backward = false;
  expect_accepted("the same forward only", [&] { check_plan_limits(bwd); });
  Problem kv_rows = make(4, 4096, 4096, 64, int64_t(1) << 19);  // 2^33 (key, KV head) rows
  kv_rows.backward = true;
  expect_refused("a backward over 2^33 dK/dV rows", [&] { check_plan_limits(kv_rows); },
                 "heads_kv");
  // A ring block's diagonal shift is an int32 in device memory.
  const int64_t max32 = INT32_MAX;
  expect_accepted("a shift of 2^31 - 1",
                  [&] { check_plan_limits(make(1, 1, 1, 8, 8, 64, {max32})); });
  expect_refused("a shift of 2^31",
                 [&] { check_plan_limits(make(1, 1, 1, 8, 8, 64, {max32 + 1})); }, "diagonal");
  expect_refused("a diagonal offset past int32",
                 [&] { check_plan_limits(make(1, 1, 1, 8, 16, 64, {max32 - 4})); }, "diagonal");
}

std::string window_string(const attn::cuda::KernelWindow& w) {
  return std::to_string(w.left) + "/" + std::to_string(w.right);
}

void window_bounds() {
  using attn::cuda::kernel_window;
  const int64_t max32 = INT32_MAX;
  // Everyday bounds pass unchanged; a reach past every length and shift is
  // unbounded, as before.
  Problem p = make(2, 1, 1, 100, 300);
  p.window = {100, 0};
  expect(window_string(kernel_window(p)) == "100/0", "window (100, 0)",
         window_string(kernel_window(p)));
  p.window = {-1, 0};
  expect(window_string(kernel_window(p)) == "-1/0", "causal", window_string(kernel_window(p)));
  p.window = {402, 402};
  expect(window_string(kernel_window(p)) == "-1/-1", "a reach past both lengths",
         window_string(kernel_window(p)));
  // A ring block whose diagonal lies 2^31 - 10 keys to the right: a left
  // bound of 2^31 + 6 does not fit int32. It hides no key of rows 0..7
  // (i + off - left < 0 for each), so it is unbounded; with rows up to 999
  // it hides keys of the last ones, which no int32 bound can say: refused.
  // (Both used to be narrowed to a negative int32, which the kernels read as
  // unbounded.)
  Problem r = make(1, 1, 1, 8, 8, 64, {max32 - 10});
  r.window = {max32 + 6, -1};
  expect(window_string(kernel_window(r)) == "-1/-1", "a left bound past int32 and past every key",
         window_string(kernel_window(r)));
  Problem cut = make(1, 1, 1, 1000, 1000, 64, {max32 - 10});
  cut.window = {max32 + 6, -1};
  expect_refused("a left bound past int32 that limits rows", [&] { (void)kernel_window(cut); },
                 "window_left");
  Problem right = make(1, 1, 1, 1000, 1000, 64, {-(max32 - 10)});
  right.window = {-1, max32 + 6};
  expect_refused("a right bound past int32 that limits rows", [&] { (void)kernel_window(right); },
                 "window_right");
}

void kv_page_size() {
  using attn::cuda::check_kv_page_size;
  expect_accepted("pages of 2^31 - 1 tokens", [] { check_kv_page_size(INT32_MAX); });
  expect_refused("pages of 2^31 tokens", [] { check_kv_page_size(int64_t(1) << 31); }, "page_size");
}

void tile_lists() {
  // 1024 heads of 2^22 queries in blocks of 65536 (65536 mask rows), seen
  // through 1-row tiles: 2^32 lists. Refused before the schedule (slots x
  // tiles offsets) is built.
  auto mask = std::make_shared<const attn::BlockMask>(1, 1024, int64_t(1) << 22, 8, 65536, 8);
  expect_refused("2^32 tile lists", [&] {
    (void)attn::cuda::build_tile_lists(mask, attn::WindowBounds{-1, -1}, 1, 64, false);
  }, "tile lists");
  expect_accepted("2^31 - 1 lists", [] { attn::cuda::check_tile_lists(1, INT32_MAX); });
  expect_refused("2^31 lists", [] { attn::cuda::check_tile_lists(2, int64_t(1) << 30); },
                 "tile lists");
}

void moba_grids() {
  // 2 x 65535 per-head selections of 2^29 queries: 2^39 query-tile lists,
  // past the selector's grid; the same with one selection per group fits.
  Problem p = make(2, 65535, 1, int64_t(1) << 29, int64_t(1) << 29);
  p.mask = ATTN_MASK_CAUSAL;
  p.window = {-1, 0};
  p.moba_block = 128, p.moba_top_k = 3, p.moba_shared = false;
  expect_refused("MoBA lists past the grid",
                 [&] { (void)attn::cuda::MobaSchedule(p, 128, 128, true); }, "MoBA");
  p.moba_shared = true;
  expect_accepted("one selection per group",
                  [&] { (void)attn::cuda::MobaSchedule(p, 128, 128, true); });
  // Within the grid the selection stays below 2^62 bytes.
  const attn::cuda::MobaSchedule s(p, 128, 128, true);
  const attn::cuda::MobaLayout l = s.layout(0, false, true, false);
  expect(l.end <= attn::kMaxBytes, "its workspace", std::to_string(l.end) + " bytes");
}


}  // namespace

int main() {
  plan_limits();
  window_bounds();
  kv_page_size();
  tile_lists();
  moba_grids();
  std::printf("%d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
