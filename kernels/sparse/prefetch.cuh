// L2 prefetches of the tiles a later block of a block-sparse kernel will
// load first: that block's start then reads them from L2 instead of
// memory. Device code (sm_80+).
#pragma once

#include <cstdint>

namespace attn::flash {

__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// Rows [0, rows) of a tile of D elements of T per row, row pitch `stride`
// elements, one 128-byte line per thread and step (nth threads).
template <class T, int D>
__device__ __forceinline__ void prefetch_rows_l2(const T* base, int64_t stride, int rows, int tid,
                                                 int nth) {
  constexpr int kLines = (D * int(sizeof(T)) + 127) / 128;  // lines per row
  constexpr int kPerLine = 128 / int(sizeof(T));
  for (int c = tid; c < rows * kLines; c += nth)
    prefetch_l2(base + (c / kLines) * stride + (c % kLines) * kPerLine);
}

}  // namespace attn::flash
