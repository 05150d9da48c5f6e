// The CUDA plans' kernel names (cuda/kernel_name.hpp), host code only, so it
// runs without a GPU: attn_plan_info_t::kernel holds 63 characters, and
//   - everyday names are composed as before, whole (exact strings);
//   - the longest names of every kernel family (3-digit tiles and head
//     dims; "-cut", or group splits up to 65535, the backend's limit on
//     query heads) fit, end with their markers, and keep every number of the whole name in order and the
//     words that say which kernels run ("moba-gather", "bsparse-p",
//     "+bwd-p-", "-bs-"): shortening drops fixed words only;
//   - random facts (seed printed; ATTN_TEST_SEED=n repeats a run) keep the
//     same properties, and names that fit are never shortened.
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/kernel_name.hpp"
#include "testutil.h"

namespace {

using attn::cuda::KernelNameFacts;
using F = KernelNameFacts::Forward;
using B = KernelNameFacts::Backward;

int g_failures = 0;

void expect(bool ok, const char* what, const std::string& detail) {
  std::printf("%s %s: %s\n", ok ? "ok  " : "FAIL", what, detail.c_str());
  if (!ok) ++g_failures;
}

std::string compose(const KernelNameFacts& f) {
  char out[64];
  std::memset(out, 'X', sizeof out);
  attn::cuda::compose_kernel_name(f, out, sizeof out);
  if (std::memchr(out, '\0', sizeof out) == nullptr) return "<not terminated>";
  return out;
}

// The numbers of a name in order, past the family words ("fa2", "sm80",
// "sm90"; "fa2-sm80-" may become "fa2-", which block-sparse names say).
std::vector<long long> numbers(const std::string& name) {
  std::string s;
  for (size_t i = 0; i < name.size();) {
    size_t skip = 0;
    for (const char* word : {"fa2", "sm80", "sm90"})
      if (name.compare(i, std::strlen(word), word) == 0) skip = std::strlen(word);
    s += skip > 0 ? '-' : name[i];
    i += skip > 0 ? skip : 1;
  }
  std::vector<long long> n;
  for (size_t i = 0; i < s.size();) {
    if (s[i] >= '0' && s[i] <= '9') {
      size_t j = i;
      while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
      n.push_back(std::stoll(s.substr(i, j - i)));
      i = j;
    } else {
      ++i;
    }
  }
  return n;
}

const char* const kWords[] = {"moba-gather", "-ws",  "bsparse-p", "+bwd-p-",
                               "-bs-",        "-det", "-bulk"};

// The properties every name must have; returns the name.
std::string check(const char* what, const KernelNameFacts& f) {
  const std::string name = compose(f);
  const std::string whole = attn::cuda::kernel_name_body(f) + attn::cuda::kernel_name_markers(f);
  const std::string markers = attn::cuda::kernel_name_markers(f);
  bool ok = name.size() <= 63 && name.size() >= markers.size() &&
            name.compare(name.size() - markers.size(), markers.size(), markers) == 0 &&
            numbers(name) == numbers(whole);
  for (const char* w : kWords)
    ok = ok && (whole.find(w) != std::string::npos) == (name.find(w) != std::string::npos);
  if (whole.size() <= 63) ok = ok && name == whole;
  expect(ok, what, name + " (whole: " + whole + ")");
  return name;
}

KernelNameFacts base(F fwd, B bwd) {
  KernelNameFacts f;
  f.dtype = "bf16";
  f.head_dim = 128;
  f.forward = fwd;
  f.kind = fwd == F::kMoba ? "moba-gather" : fwd == F::kMobaSm90 ? "moba" : "bsparse";
  f.fwd_block_m = 128, f.fwd_block_n = 64, f.fwd_warps = 4, f.fwd_stages = 2;
  f.backward = bwd;
  f.bwd_block_m = 64, f.bwd_block_n = 128, f.bwd_warps = 8;
  f.dq_kind = bwd == B::kSm90 || bwd == B::kSm90Sparse ? "bulk" : "atomic";
  return f;
}

}  // namespace

int main() {
  // Everyday names, whole and as before.
  KernelNameFacts f = base(F::kSm90, B::kSm90);
  f.fwd_block_n = 128, f.bwd_block_m = 128, f.group_splits = 2;
  expect(compose(f) == "cuda-sm90-wgmma-bf16-d128-128x128-s2+bwd-wgmma-128x128-bulk-gs2",
         "dense sm_90a GQA", compose(f));
  f = base(F::kSm80, B::kSm80);
  expect(compose(f) == "cuda-fa2-sm80-bf16-d128-128x64-w4-s2+bwd-64x128-w8s-atomic",
         "dense sm_80", compose(f));
  f = base(F::kSparseSm80, B::kSm80Listed);
  f.cut = true, f.bwd_persist = true;
  expect(compose(f) == "cuda-fa2-bf16-d128-bsparse-128x64+bwd-p-64x128-s-atomic-cut",
         "block-sparse sm_80, cut", compose(f));
  f = base(F::kMobaSm90, B::kSm90);
  expect(compose(f) == "cuda-sm90-wgmma-bf16-d128-moba+bwd-wgmma-64x128-bulk", "MoBA sm_90a",
         compose(f));
  f.kind = "moba-gather", f.ws = true;
  expect(compose(f) == "cuda-sm90-wgmma-bf16-d128-moba-gather-ws+bwd-wgmma-64x128-bulk",
         "MoBA gathered, warp-specialised sm_90a", compose(f));

  // The longest names of each family: 3-digit tiles and head dims, the
  // longest markers ("-cut" only with a whole group).
  for (int gs : {1, 2, 100, 65535}) {
    for (bool cut : {false, true}) {
      if (cut && gs > 1) continue;
      const std::string tag = " gs" + std::to_string(gs) + (cut ? " cut" : "");
      auto longest = [&](F fwd, B bwd) {
        KernelNameFacts l = base(fwd, bwd);
        l.head_dim = 256, l.fwd_block_m = l.fwd_block_n = 192, l.fwd_warps = 16;
        l.fwd_stages = 4, l.bwd_block_m = l.bwd_block_n = 192, l.bwd_warps = 16;
        l.bwd_register_path = false, l.cut = cut, l.group_splits = gs;
        l.bwd_persist = bwd == B::kSm80Listed && fwd != F::kMoba;
        if (fwd == F::kSparseSm80) l.kind = "bsparse-p";
        l.ws = fwd == F::kSm90 || fwd == F::kSparseSm90;  // "-ws"
        return l;
      };
      check(("dense sm_90a" + tag).c_str(), longest(F::kSm90, B::kSm90));
      check(("dense sm_80" + tag).c_str(), longest(F::kSm80, B::kSm80));
      check(("block-sparse sm_90a, wgmma bwd" + tag).c_str(),
            longest(F::kSparseSm90, B::kSm90Sparse));
      check(("block-sparse sm_90a, sm_80 bwd" + tag).c_str(),
            longest(F::kSparseSm90, B::kSm80Listed));
      check(("block-sparse sm_80 persistent" + tag).c_str(),
            longest(F::kSparseSm80, B::kSm80Listed));
      check(("MoBA gather" + tag).c_str(), longest(F::kMoba, B::kSm80Listed));
      check(("MoBA sm_90a" + tag).c_str(), longest(F::kMobaSm90, B::kSm90));
      check(("MoBA sm_90a, sm_80 bwd" + tag).c_str(), longest(F::kMobaSm90, B::kSm80Listed));
      KernelNameFacts g = longest(F::kMobaSm90, B::kSm90);
      g.kind = "moba-gather", g.ws = true;
      check(("MoBA gathered, warp-specialised sm_90a" + tag).c_str(), g);
    }
  }

  // Random facts.
  std::mt19937_64 rng(tu_seed());  // ATTN_TEST_SEED repeats a run (printed)
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const char* dtypes[] = {"fp16", "bf16"};
  const char* kinds[] = {"bsparse", "bsparse-p", "moba", "moba-gather"};
  const char* dq[] = {"det", "bulk", "atomic"};
  const int failures_before = g_failures;
  for (int i = 0; i < 2000; ++i) {
    KernelNameFacts r;
    r.dtype = dtypes[pick(0, 1)];
    r.head_dim = pick(1, 999);
    // Consistent facts: tile-list backwards with tile-list forwards, the
    // persistent dK/dV kernel for block-sparse plans, "-cut" with whole
    // groups.
    r.forward = F(pick(0, 5));
    const bool moba_sm90 = r.forward == F::kMobaSm90;
    const bool listed = r.forward == F::kSparseSm80 || r.forward == F::kSparseSm90 ||
                        r.forward == F::kMoba || moba_sm90;
    r.kind = kinds[r.forward == F::kMoba ? pick(2, 3) : moba_sm90 ? 2 : pick(0, 1)];
    r.fwd_block_m = pick(1, 999), r.fwd_block_n = pick(1, 999);
    r.fwd_warps = pick(1, 99), r.fwd_stages = pick(1, 9);
    r.ws = (r.forward == F::kSm90 || r.forward == F::kSparseSm90) && pick(0, 1) == 1;
    const B listed_bwd[] = {B::kNone, B::kSm80Listed, B::kSm90Sparse};
    const B dense_bwd[] = {B::kNone, B::kSm80, B::kSm90};
    const B moba_sm90_bwd[] = {B::kNone, B::kSm80Listed, B::kSm90};
    r.backward = moba_sm90 ? moba_sm90_bwd[pick(0, 2)]
                 : listed  ? listed_bwd[pick(0, r.forward == F::kMoba ? 1 : 2)]
                           : dense_bwd[pick(0, 2)];
    const bool moba = r.forward == F::kMoba || moba_sm90;
    r.bwd_persist = !moba && r.backward == B::kSm80Listed && pick(0, 1) == 1;
    r.bwd_block_m = pick(1, 999), r.bwd_block_n = pick(1, 999), r.bwd_warps = pick(1, 99);
    r.bwd_register_path = pick(0, 1) == 1;
    r.dq_kind = dq[pick(0, 2)];
    r.group_splits = pick(0, 1) ? pick(1, 64) : pick(1, 65535);
    r.cut = listed && !moba && r.group_splits == 1 && pick(0, 1) == 1;
    const std::string name = compose(r);
    const std::string whole =
        attn::cuda::kernel_name_body(r) + attn::cuda::kernel_name_markers(r);
    const std::string markers = attn::cuda::kernel_name_markers(r);
    bool ok = name.size() <= 63 && name.size() >= markers.size() &&
              name.compare(name.size() - markers.size(), markers.size(), markers) == 0 &&
              numbers(name) == numbers(whole) && (whole.size() > 63 || name == whole);
    if (!ok) expect(false, "random facts", name + " (whole: " + whole + ")");
  }
  expect(g_failures == failures_before, "2000 random facts", "fit, markers and numbers kept");

  std::printf("%d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
