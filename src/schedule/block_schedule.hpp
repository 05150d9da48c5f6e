// The tile schedule of a block-sparse plan: the block mask (user blocks of
// any size) seen through the kernel's tiles. For every (mask batch, mask
// head) "slot", CSR lists of the KV tiles each query tile visits and, for the
// backward dK/dV pass, the transpose: the query tiles that visit each KV
// tile. A visit is *full* when every (row, key) pair of the two tiles is
// visible (dense mask and block selection), so the kernel skips the element
// predicate; otherwise it is *partial* and the predicate applies. A pair is
// listed exactly when it holds at least one visible element: a bit tile
// whose selected keys lie outside the tile, or all behind the dense mask,
// does not make the kernels visit it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "schedule/block_mask.hpp"
#include "schedule/dense_schedule.hpp"

namespace attn {

struct TileVisit {
  int32_t tile;  // KV tile (forward lists) or query tile (transposed lists)
  int32_t full;  // 1: no element predicate needed
};

class BlockTileSchedule {
 public:
  BlockTileSchedule(std::shared_ptr<const BlockMask> mask, WindowBounds window, int64_t tile_q,
                    int64_t tile_kv);

  const BlockMask& mask() const { return *mask_; }
  int64_t num_q_tiles() const { return nqt_; }
  int64_t num_kv_tiles() const { return nkt_; }
  // The slot of sequence b and KV head hk (a mask of batch or heads 1 is
  // shared).
  int64_t mask_batch(int64_t b) const { return mask_->batch() == 1 ? 0 : b; }
  int64_t mask_head(int64_t hk) const { return mask_->heads() == 1 ? 0 : hk; }
  int64_t slot(int64_t b, int64_t hk) const {
    return mask_batch(b) * mask_->heads() + mask_head(hk);
  }

  std::span<const TileVisit> kv_tiles_of(int64_t slot, int64_t qt) const {
    const size_t k = size_t(slot * nqt_ + qt);
    return {fwd_.data() + fwd_off_[k], fwd_.data() + fwd_off_[k + 1]};
  }
  std::span<const TileVisit> q_tiles_of(int64_t slot, int64_t kt) const {
    const size_t k = size_t(slot * nkt_ + kt);
    return {bwd_.data() + bwd_off_[k], bwd_.data() + bwd_off_[k + 1]};
  }
  // Visits of one slot (one head of one sequence).
  int64_t visits(int64_t slot) const {
    return int64_t(fwd_off_[size_t((slot + 1) * nqt_)] - fwd_off_[size_t(slot * nqt_)]);
  }

 private:
  std::shared_ptr<const BlockMask> mask_;
  int64_t nqt_, nkt_;
  std::vector<size_t> fwd_off_, bwd_off_;
  std::vector<TileVisit> fwd_, bwd_;
};

// Exact visibility counts of a block mask under the dense mask, per slot
// (mask batch * heads + mask head).
struct BlockMaskCounts {
  std::vector<int64_t> visible_pairs;
  std::vector<int64_t> empty_rows;
  std::vector<int64_t> first_empty_row;  // -1: none
};
BlockMaskCounts count_visible(const BlockMask& mask, WindowBounds window);

}  // namespace attn
