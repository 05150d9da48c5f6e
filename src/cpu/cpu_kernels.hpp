// The contract between the CPU backend's host side (cpu_backend.cpp) and its
// kernels (flash_kernels.cpp), which are compiled once per instruction set
// and chosen at plan creation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "plan/backend.hpp"
#include "plan/problem.hpp"
#include "schedule/block_schedule.hpp"

namespace attn::cpu {

// Square tiles of 96 rows: a multiple of every register-block shape the ISA
// variants use (6 or 12 rows, 8, 16 or 32 columns), so tiles are never split
// into remainder blocks except at the end of a sequence.
constexpr int64_t kTile = 96;

// One work unit: sequence b, tile index t (a query tile for the forward and
// dQ passes, a KV tile for the dK/dV pass). Heads are the inner loop.
struct Unit {
  int32_t b;
  int32_t tile;
};

// Per-thread scratch regions: offsets in floats from the thread's slice
// (each a multiple of 16 floats, so every region is 64-byte aligned).
struct Scratch {
  size_t q = 0;                  // [tile][dqk_pad] packed query rows (forward)
  size_t s = 0, dp = 0, z = 0;   // [tile][tile] scores, dP / dS, saved logits
  size_t acc_o = 0, acc_dq = 0, acc_dk = 0, acc_dv = 0;  // [tile][d_pad] fp32 sums
  size_t row_a = 0, row_b = 0;   // [tile] per-row statistics
  size_t moba = 0;               // MoBA selector: gates and order, [num_blocks] each
  size_t floats = 0;             // size of one thread's slice
};

// An fp32 copy of one tensor, packed tile by tile, in the workspace: tile g
// (numbered across the batch, see KernelPlan::q_tile_base) of head h starts
// at offset + (g * heads + h) * tile_floats floats. Packing once per
// execution, instead of once per visiting tile, takes the dtype conversion,
// transposition and strided reads out of the inner loop.
struct PackedTensor {
  size_t offset = 0;       // bytes from the aligned workspace base
  size_t tile_floats = 0;  // floats per (tile, head)
  int64_t heads = 0;
};

struct KernelPlan {
  const Problem* problem = nullptr;
  int32_t num_threads = 1;
  int64_t dqk_pad = 0, dv_pad = 0;  // head dims rounded up to the column block
  std::vector<Unit> q_units;        // (b, query tile), heaviest first
  std::vector<Unit> kv_units;       // (b, KV tile), heaviest first
  std::vector<int64_t> q_tile_base, kv_tile_base;  // first global tile of sequence b
  // Block-sparse plans: the tiles to visit (kTile x kTile); null for dense
  // plans, whose tiles follow from the window.
  std::shared_ptr<const BlockTileSchedule> sparse;
  // MoBA plans (problem->moba_block > 0), per pass, bytes from the base: the
  // pooled keys [batch][heads_kv][num_blocks][dqk] (fp32) and the selection
  // [batch][moba_heads][seqlen_q][moba_words] (bit kb: key block kb seen).
  int64_t moba_words = 0;
  size_t fwd_moba_pooled = 0, fwd_moba_selection = 0;
  size_t bwd_moba_pooled = 0, bwd_moba_selection = 0;
  Scratch fwd, bwd;
  // Forward: Kt [dqk][tile] and V [tile][dv_pad] per KV tile and KV head.
  PackedTensor fwd_kt, fwd_v;
  // Backward: Q (pre-scaled) [tile][dqk_pad] and dO [tile][dv_pad] per query
  // tile and query head; Kt [dqk][tile], Vt [dv][tile] and K [tile][dqk_pad]
  // per KV tile and KV head.
  PackedTensor bwd_q, bwd_do, bwd_kt, bwd_vt, bwd_k;
  size_t fwd_threads_offset = 0;  // per-thread scratch, bytes from the base
  size_t bwd_delta_offset = 0;    // D = rowsum(dO * O), laid out like LSE
  size_t bwd_threads_offset = 0;
};

// What each ISA variant provides.
struct IsaKernels {
  const char* name;    // "cpu-avx512", "cpu-avx2", "cpu-generic"
  int32_t col_block;   // columns of the register block (head dims pad to it)
  void (*forward)(const KernelPlan&, const ForwardArgs&);
  void (*backward)(const KernelPlan&, const BackwardArgs&);
};

namespace generic { const IsaKernels& kernels(); }
namespace avx2 { const IsaKernels& kernels(); }
namespace avx512 { const IsaKernels& kernels(); }

}  // namespace attn::cpu
