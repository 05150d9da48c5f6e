#pragma once
// The kernel name of a CUDA plan, as attn_plan_describe() reports it in
// attn_plan_info_t::kernel (64 characters with the terminating NUL). Plain
// C++ without CUDA, so that tests/unit checks the longest names on any
// machine.
//
// The name is the forward's kernel, then "+bwd..." the backward's, then the
// plan's marker: "-cut" (cut dK/dV lists accumulated in slots of their own,
// whole groups only) or "-gsN" (query heads of a group split over N dK/dV
// blocks; N <= 65535, the backend's limit on query heads). Markers are
// never cut: where the whole name would not fit (extreme GQA
// backward plans, MoBA gather names), fixed parts that carry no information
// of their own are shortened first, in this order, until it fits:
//   "cuda-"     -> ""      (attn_plan_info_t::backend says it)
//   "fa2-sm80-" -> "fa2-"  (the block-sparse names' spelling: the same family)
//   "wgmma"     -> "wg"
//   "-atomic"   -> "-at"   (dQ added with atomics)
// With head dims, tiles and warps of at most 3, 3 and 2 digits every name
// fits after that (tests/unit/test_kernel_name.cpp checks the longest).
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>

namespace attn::cuda {

struct KernelNameFacts {
  enum class Forward { kSm80, kSm90, kSparseSm80, kSparseSm90, kMoba, kMobaSm90 };
  enum class Backward { kNone, kSm80, kSm80Listed, kSm90, kSm90Sparse };
  const char* dtype = "";
  int head_dim = 0;
  Forward forward = Forward::kSm80;
  const char* kind = "";  // block-sparse, MoBA: "bsparse", "bsparse-p", "moba", "moba-gather"
  bool ws = false;        // sm_90a: the warp-specialised forward ("-ws")
  int fwd_block_m = 0, fwd_block_n = 0, fwd_warps = 0, fwd_stages = 0;
  // kSm80Listed: the sm_80 dK/dV kernel walking tile lists (block-sparse,
  // MoBA), which leaves out the warps for room.
  Backward backward = Backward::kNone;
  bool bwd_persist = false;  // the persistent dK/dV kernel ("+bwd-p")
  int bwd_block_m = 0, bwd_block_n = 0, bwd_warps = 0;
  bool bwd_register_path = false;  // sm_80: "r", else "s"
  const char* dq_kind = "";        // "det", "bulk" or "atomic"
  bool cut = false;
  int group_splits = 1;
};

// The forward's and the backward's parts, whole.
inline std::string kernel_name_body(const KernelNameFacts& f) {
  using F = KernelNameFacts::Forward;
  using B = KernelNameFacts::Backward;
  char buf[256];
  int len = 0;
  switch (f.forward) {
    case F::kSparseSm90:
      len = std::snprintf(buf, sizeof buf, "cuda-sm90-wgmma-%s-d%d-bsparse%s", f.dtype, f.head_dim,
                          f.ws ? "-ws" : "");
      break;
    case F::kMobaSm90:  // the tile (128 x 128) is in info.tile_q and tile_kv
      len = std::snprintf(buf, sizeof buf, "cuda-sm90-wgmma-%s-d%d-%s%s", f.dtype, f.head_dim,
                          f.kind, f.ws ? "-ws" : "");
      break;
    case F::kMoba:
      len = std::snprintf(buf, sizeof buf, "cuda-fa2-sm80-%s-d%d-%s-%dx%d", f.dtype, f.head_dim,
                          f.kind, f.fwd_block_m, f.fwd_block_n);
      break;
    case F::kSparseSm80:
      len = std::snprintf(buf, sizeof buf, "cuda-fa2-%s-d%d-%s-%dx%d", f.dtype, f.head_dim, f.kind,
                          f.fwd_block_m, f.fwd_block_n);
      break;
    case F::kSm90:
      len = std::snprintf(buf, sizeof buf, "cuda-sm90-wgmma-%s-d%d-%dx%d-s%d%s", f.dtype,
                          f.head_dim, f.fwd_block_m, f.fwd_block_n, f.fwd_stages,
                          f.ws ? "-ws" : "");
      break;
    case F::kSm80:
      len = std::snprintf(buf, sizeof buf, "cuda-fa2-sm80-%s-d%d-%dx%d-w%d-s%d", f.dtype,
                          f.head_dim, f.fwd_block_m, f.fwd_block_n, f.fwd_warps, f.fwd_stages);
      break;
  }
  std::string body(buf, size_t(std::clamp(len, 0, int(sizeof buf) - 1)));
  const char* path = f.bwd_register_path ? "r" : "s";
  switch (f.backward) {
    case B::kNone: return body;
    case B::kSm90Sparse:  // "-bs" instead of the tile, which is BwdSm90Config's
      len = std::snprintf(buf, sizeof buf, "+bwd-wgmma-bs-%s", f.dq_kind);
      break;
    case B::kSm90:
      len = std::snprintf(buf, sizeof buf, "+bwd-wgmma-%dx%d-%s", f.bwd_block_m, f.bwd_block_n,
                          f.dq_kind);
      break;
    case B::kSm80Listed:
      len = std::snprintf(buf, sizeof buf, "+bwd%s-%dx%d-%s-%s", f.bwd_persist ? "-p" : "",
                          f.bwd_block_m, f.bwd_block_n, path, f.dq_kind);
      break;
    case B::kSm80:
      len = std::snprintf(buf, sizeof buf, "+bwd-%dx%d-w%d%s-%s", f.bwd_block_m, f.bwd_block_n,
                          f.bwd_warps, path, f.dq_kind);
      break;
  }
  return body.append(buf, size_t(std::clamp(len, 0, int(sizeof buf) - 1)));
}

inline std::string kernel_name_markers(const KernelNameFacts& f) {
  std::string m;
  if (f.cut) m += "-cut";
  if (f.group_splits > 1) m += "-gs" + std::to_string(f.group_splits);
  return m;
}

// Writes the name into out[cap] (NUL-terminated), shortened as the top of
// this file says where it must be; the markers stay whole.
inline void compose_kernel_name(const KernelNameFacts& f, char* out, size_t cap) {
  if (cap == 0) return;
  std::string body = kernel_name_body(f);
  const std::string markers = kernel_name_markers(f);
  static const char* const kShorter[][2] = {
      {"cuda-", ""}, {"fa2-sm80-", "fa2-"}, {"wgmma", "wg"}, {"-atomic", "-at"}};
  for (const auto& rule : kShorter) {
    if (body.size() + markers.size() < cap) break;
    const size_t from = std::strlen(rule[0]), to = std::strlen(rule[1]);
    for (size_t at = body.find(rule[0]); at != std::string::npos; at = body.find(rule[0], at + to))
      body.replace(at, from, rule[1]);
  }
  // Past the bounds above only: the body gives way, not the markers.
  const size_t keep_markers = std::min(markers.size(), cap - 1);
  body.resize(std::min(body.size(), cap - 1 - keep_markers));
  const std::string name = body + markers.substr(0, keep_markers);
  std::memcpy(out, name.c_str(), name.size() + 1);
}

}  // namespace attn::cuda
