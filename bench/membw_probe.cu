// Read-bandwidth probe for the decode kernels' access pattern (not part of
// the library; built by hand on a GPU machine):
//   nvcc -O3 -std=c++17 -Ikernels -gencode=arch=compute_90a,code=sm_90a bench/membw_probe.cu -o membw_probe
//   ./membw_probe
// Paged decode over an HND cache reads, per (sequence, KV head) block, 4 KB
// chunks (16 tokens x 128 dims x bf16) that lie 32 KB apart (a page holds
// the 8 KV heads' chunks side by side), about 1 GB in all at batch 32 x 8K.
// The probe reads 1 GiB with `blocks` blocks of 128 threads in two layouts,
// each block's share either contiguous or as 4 KB chunks strided by
// 8 chunks (8 blocks interleaved: the HND cache's), by two mechanisms:
//   ldg   every thread loads 16-byte vectors, `unroll` of them in flight
//   bulk  one thread issues cp.async.bulk of one chunk per stage into
//         shared memory (an mbarrier per stage), `stages` in flight, as
//         the sm90-bulk decode kernel does
// and prints TB/s (median of 9 runs; the buffer is 20x L2). Last, the
// decode kernel's stage shape without its arithmetic (bulk-kv: each block
// reads a K and a V half, stages of C copies of CH bytes alternating
// between them, a block-wide barrier per stage), 256 blocks; and the same
// stages over the cache's own layouts (paged-kv: separate K and V pools,
// dense or HND pages, the kernel's copy issuers, a stand-in for its
// arithmetic between refills), to tell the layout's cost from the kernel's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

// The decode kernels' mbarrier and bulk-copy wrappers (mbar_*, bulk_load).
#include "decode/paged_decode_sm90.cuh"

using attn::decode::bulk_load;
using attn::decode::mbar_arrive_expect_tx;
using attn::decode::mbar_init;
using attn::decode::mbar_init_fence;
using attn::decode::mbar_wait;
using attn::flash::smem_u32;

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));       \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

constexpr int kThreads = 128;
constexpr size_t kChunk = 4096;  // bytes

// Byte offset of chunk i of block x's share: contiguous, or interleaved
// with 7 other blocks' chunks (block x of a group of 8 takes every 8th).
__device__ __forceinline__ size_t chunk_offset(bool strided, size_t per_block, int x, size_t i) {
  if (!strided) return size_t(x) * per_block + i * kChunk;
  const size_t group = size_t(x / 8), lane = size_t(x % 8);
  return group * 8 * per_block + (i * 8 + lane) * kChunk;
}

template <int U>
__global__ void __launch_bounds__(kThreads) ldg_kernel(const uint4* __restrict__ src,
                                                       size_t per_block, bool strided,
                                                       uint32_t* sink) {
  const size_t chunks = per_block / kChunk;
  constexpr int kPerChunk = int(kChunk / 16 / kThreads);  // vectors per thread per chunk (2)
  uint32_t acc = 0;
  for (size_t c0 = 0; c0 < chunks; c0 += U) {
    uint4 v[U][kPerChunk];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < kPerChunk; ++k) {
        const size_t c = min(c0 + u, chunks - 1);
        const uint4* p = reinterpret_cast<const uint4*>(
            reinterpret_cast<const char*>(src) + chunk_offset(strided, per_block, blockIdx.x, c));
        v[u][k] = __ldcs(p + k * kThreads + threadIdx.x);
      }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < kPerChunk; ++k) acc ^= v[u][k].x ^ v[u][k].y ^ v[u][k].z ^ v[u][k].w;
  }
  if (acc == 0x9e3779b9u) sink[threadIdx.x] = acc;  // keeps the loads
}

template <int S>
__global__ void __launch_bounds__(kThreads) bulk_kernel(const char* __restrict__ src,
                                                        size_t per_block, bool strided,
                                                        uint32_t* sink) {
  extern __shared__ __align__(128) unsigned char buf[];  // [S][kChunk]
  __shared__ __align__(8) uint64_t bars[S];
  const size_t chunks = per_block / kChunk;
  if (threadIdx.x == 0)
    for (int s = 0; s < S; ++s) mbar_init(smem_u32(&bars[s]), 1);
  mbar_init_fence();
  __syncthreads();
  auto issue = [&](size_t c) {
    const int s = int(c % S);
    const uint32_t bar = smem_u32(&bars[s]);
    mbar_arrive_expect_tx(bar, uint32_t(kChunk));
    bulk_load(smem_u32(buf + size_t(s) * kChunk),
              src + chunk_offset(strided, per_block, blockIdx.x, c), uint32_t(kChunk), bar);
  };
  if (threadIdx.x == 0)
    for (size_t c = 0; c < min(size_t(S), chunks); ++c) issue(c);
  uint32_t acc = 0;
  for (size_t c = 0; c < chunks; ++c) {
    const int s = int(c % S);
    const uint32_t bar = smem_u32(&bars[s]), parity = uint32_t((c / S) & 1);
    mbar_wait(bar, parity);
    acc ^= reinterpret_cast<const uint32_t*>(buf + size_t(s) * kChunk)[threadIdx.x];
    __syncthreads();  // every thread has read stage s: it may be refilled
    if (threadIdx.x == 0 && c + S < chunks) issue(c + S);
  }
  if (acc == 0x9e3779b9u) sink[threadIdx.x] = acc;
}

// The decode kernel's stage shape: stage j of a block is C copies of CH
// bytes, alternately from the K and the V half of its share (the two
// pools), on one mbarrier; S stages; every thread reads a word of the stage,
// the block meets, thread 0 refills it.
template <int S, int C, int CH>
__global__ void __launch_bounds__(kThreads) bulk_kv_kernel(const char* __restrict__ src,
                                                           size_t per_block, uint32_t* sink) {
  extern __shared__ __align__(128) unsigned char buf[];  // [S][C][CH]
  __shared__ __align__(8) uint64_t bars[S];
  constexpr size_t kStage = size_t(C) * CH;
  const size_t stages = per_block / kStage;
  const char* k = src + size_t(blockIdx.x) * per_block;
  const char* v = k + per_block / 2;
  if (threadIdx.x == 0)
    for (int s = 0; s < S; ++s) mbar_init(smem_u32(&bars[s]), 1);
  mbar_init_fence();
  __syncthreads();
  auto issue = [&](size_t j) {
    const int s = int(j % S);
    const uint32_t bar = smem_u32(&bars[s]);
    mbar_arrive_expect_tx(bar, uint32_t(kStage));
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const char* from = (c % 2 == 0 ? k : v) + (j * (C / 2) + c / 2) * CH;
      bulk_load(smem_u32(buf + size_t(s) * kStage + size_t(c) * CH), from, uint32_t(CH), bar);
    }
  };
  if (threadIdx.x == 0)
    for (size_t j = 0; j < min(size_t(S), stages); ++j) issue(j);
  uint32_t acc = 0;
  for (size_t j = 0; j < stages; ++j) {
    const int s = int(j % S);
    const uint32_t bar = smem_u32(&bars[s]), parity = uint32_t((j / S) & 1);
    mbar_wait(bar, parity);
    acc ^= reinterpret_cast<const uint32_t*>(buf + size_t(s) * kStage)[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0 && j + S < stages) issue(j + S);
  }
  if (acc == 0x9e3779b9u) sink[threadIdx.x] = acc;
}

// The decode kernel's reads as the paged cache lays them out (paged-kv):
// K and V in two pools (the two halves of the buffer); block x is
// (sequence x / 8, KV head x % 8) of 32 sequences of 8192 tokens; a tile
// is 64 keys, K and V each 8 segments of 8 rows (2 KB) written to shared
// memory 32 bytes apart as sm90-bulk32 does. Layout Ps: 0 = dense [seq,
// head, token, 128] as SDPA's tensors, else HND pages of Ps tokens, a
// sequence's pages consecutive, a page holding the 8 heads' rows side by
// side. Issuers: 1 (thread 0 copies the 16 segments) or 8 (as the kernel:
// the first thread of each segment copies its K and V rows, 64 threads
// arrive). After its refill each warp spins Work cycles (the kernel's
// scores and P V), in the kernel's order: wait, barrier, refill, work.
template <int S, int Ps, int Issuers, int Work>
__global__ void __launch_bounds__(kThreads) paged_kv_kernel(const char* __restrict__ src,
                                                            uint32_t* sink) {
  constexpr int kKeys = 64, kRow = 256, kSegBytes = 8 * kRow + 32;
  constexpr int kTileBytes = 8 * kSegBytes;
  constexpr size_t kSeqTokens = 8192;
  constexpr int kHeads = 8;
  extern __shared__ __align__(128) unsigned char buf[];  // [S][K|V][8][kSegBytes]
  __shared__ __align__(8) uint64_t bars[S];
  const char* k_pool = src;
  const char* v_pool = src + (size_t(1) << 29);
  const size_t seq = blockIdx.x / kHeads, g = blockIdx.x % kHeads;
  constexpr int tiles = int(kSeqTokens / kKeys);
  if (threadIdx.x == 0)
    for (int s = 0; s < S; ++s) mbar_init(smem_u32(&bars[s]), Issuers == 1 ? 1 : kKeys);
  mbar_init_fence();
  __syncthreads();
  auto row_offset = [&](size_t key) -> size_t {
    if constexpr (Ps == 0) {
      return ((seq * kHeads + g) * kSeqTokens + key) * kRow;
    } else {
      const size_t page = seq * (kSeqTokens / Ps) + key / Ps;
      return ((page * kHeads + g) * Ps + key % Ps) * kRow;
    }
  };
  auto issue_seg = [&](int t, int sg, uint32_t bar) {
    const int s = t % S;
    const size_t off = row_offset(size_t(t) * kKeys + size_t(sg) * 8);
    const uint32_t dk = smem_u32(buf + size_t(s) * 2 * kTileBytes + size_t(sg) * kSegBytes);
    bulk_load(dk, k_pool + off, 8 * kRow, bar);
    bulk_load(dk + kTileBytes, v_pool + off, 8 * kRow, bar);
  };
  auto issue = [&](int t) {
    const uint32_t bar = smem_u32(&bars[t % S]);
    if (Issuers == 1) {
      if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, 2 * kKeys * kRow);
        for (int sg = 0; sg < 8; ++sg) issue_seg(t, sg, bar);
      }
    } else if (threadIdx.x < kKeys) {
      if (threadIdx.x % 8 == 0) {
        mbar_arrive_expect_tx(bar, 2 * 8 * kRow);
        issue_seg(t, threadIdx.x / 8, bar);
      } else {
        attn::decode::mbar_arrive(bar);
      }
    }
  };
  for (int t = 0; t < S - 1 && t < tiles; ++t) issue(t);
  uint32_t acc = 0;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % S;
    mbar_wait(smem_u32(&bars[s]), uint32_t((t / S) & 1));
    __syncthreads();  // every warp is done with tile t - 1's stage
    if (t + S - 1 < tiles) issue(t + S - 1);
    acc ^= reinterpret_cast<const uint32_t*>(buf + size_t(s) * 2 * kTileBytes)[threadIdx.x];
    if (Work > 0) {
      const long long t0 = clock64();
      while (clock64() - t0 < Work) acc += 1;
    }
  }
  if (acc == 0x9e3779b9u) sink[threadIdx.x] = acc;
}

int main() {
  const size_t bytes = size_t(1) << 30;
  char* src = nullptr;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&sink, 4096));
  CHECK(cudaMemset(src, 1, bytes));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  auto time = [&](auto launch) {
    std::vector<float> t;
    for (int r = 0; r < 11; ++r) {
      cudaEventRecord(e0);
      launch();
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      if (r >= 2) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return double(bytes) / (t[t.size() / 2] * 1e-3) / 1e12;
  };
  CHECK(cudaFuncSetAttribute(bulk_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 4096));
  CHECK(cudaFuncSetAttribute(bulk_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 4096));
  CHECK(cudaFuncSetAttribute(bulk_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize, 16 * 4096));
  std::printf("%-6s %-10s %6s %6s %8s\n", "kind", "layout", "blocks", "depth", "TB/s");
  for (int blocks : {256, 512, 1024}) {
    const size_t per_block = bytes / size_t(blocks);
    for (bool strided : {false, true}) {
      const char* layout = strided ? "strided" : "contiguous";
      auto ldg = [&](auto u) {
        constexpr int U = decltype(u)::value;
        const double tb = time([&] {
          ldg_kernel<U><<<blocks, kThreads>>>(reinterpret_cast<const uint4*>(src), per_block,
                                              strided, sink);
        });
        std::printf("%-6s %-10s %6d %6d %8.3f\n", "ldg", layout, blocks, U * 4, tb);
      };
      ldg(std::integral_constant<int, 2>{});
      ldg(std::integral_constant<int, 4>{});
      ldg(std::integral_constant<int, 8>{});
      auto bulk = [&](auto st) {
        constexpr int S = decltype(st)::value;
        const double tb = time([&] {
          bulk_kernel<S><<<blocks, kThreads, S * kChunk>>>(src, per_block, strided, sink);
        });
        std::printf("%-6s %-10s %6d %6d %8.3f\n", "bulk", layout, blocks, S * 4, tb);
      };
      bulk(std::integral_constant<int, 4>{});
      bulk(std::integral_constant<int, 8>{});
      bulk(std::integral_constant<int, 16>{});
    }
  }
  // The decode kernel's stages: two pools, stages of C copies of CH bytes.
  std::printf("%-10s %6s %6s %6s %6s %8s\n", "bulk-kv", "blocks", "stages", "copies", "bytes", "TB/s");
  auto kv = [&](auto st, auto cp, auto ch) {
    constexpr int S = decltype(st)::value, C = decltype(cp)::value, CH = decltype(ch)::value;
    const int smem = S * C * CH;
    if (cudaFuncSetAttribute(bulk_kv_kernel<S, C, CH>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem) != cudaSuccess)
      return;
    const int blocks = 256;
    const double tb = time([&] {
      bulk_kv_kernel<S, C, CH><<<blocks, kThreads, smem>>>(src, bytes / blocks, sink);
    });
    std::printf("%-10s %6d %6d %6d %6d %8.3f\n", "bulk-kv", blocks, S, C, CH, tb);
  };
  using std::integral_constant;
  kv(integral_constant<int, 2>{}, integral_constant<int, 16>{}, integral_constant<int, 2048>{});
  kv(integral_constant<int, 2>{}, integral_constant<int, 8>{}, integral_constant<int, 4096>{});
  kv(integral_constant<int, 3>{}, integral_constant<int, 16>{}, integral_constant<int, 2048>{});
  kv(integral_constant<int, 4>{}, integral_constant<int, 8>{}, integral_constant<int, 2048>{});
  kv(integral_constant<int, 4>{}, integral_constant<int, 4>{}, integral_constant<int, 4096>{});
  kv(integral_constant<int, 8>{}, integral_constant<int, 4>{}, integral_constant<int, 2048>{});
  kv(integral_constant<int, 8>{}, integral_constant<int, 2>{}, integral_constant<int, 4096>{});
  // The decode reads in the cache's layouts (256 blocks: 32 x 8K, 8 heads).
  std::printf("%-10s %6s %6s %6s %6s %8s\n", "paged-kv", "stages", "page", "issuer", "work", "TB/s");
  auto paged = [&](auto st, auto ps, auto is, auto wk) {
    constexpr int S = decltype(st)::value, Ps = decltype(ps)::value;
    constexpr int Is = decltype(is)::value, W = decltype(wk)::value;
    const int smem = S * 2 * 8 * (8 * 256 + 32);
    if (cudaFuncSetAttribute(paged_kv_kernel<S, Ps, Is, W>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem) != cudaSuccess)
      return;
    const double tb = time([&] { paged_kv_kernel<S, Ps, Is, W><<<256, kThreads, smem>>>(src, sink); });
    std::printf("%-10s %6d %6d %6d %6d %8.3f\n", "paged-kv", S, Ps, Is, W, tb);
  };
  using I = std::integral_constant<int, 0>;
  using P16 = std::integral_constant<int, 16>;
  using P64 = std::integral_constant<int, 64>;
  using S2 = std::integral_constant<int, 2>;
  using S3 = std::integral_constant<int, 3>;
  using One = std::integral_constant<int, 1>;
  using Eight = std::integral_constant<int, 8>;
  paged(S2{}, I{}, One{}, I{});
  paged(S2{}, P16{}, One{}, I{});
  paged(S2{}, P64{}, One{}, I{});
  paged(S2{}, I{}, Eight{}, I{});
  paged(S2{}, P16{}, Eight{}, I{});
  paged(S3{}, P16{}, Eight{}, I{});
  paged(S2{}, P16{}, Eight{}, std::integral_constant<int, 500>{});
  paged(S2{}, P16{}, Eight{}, std::integral_constant<int, 1000>{});
  paged(S2{}, P16{}, Eight{}, std::integral_constant<int, 2000>{});
  paged(S3{}, P16{}, Eight{}, std::integral_constant<int, 1000>{});
  paged(S2{}, I{}, Eight{}, std::integral_constant<int, 1000>{});
  CHECK(cudaGetLastError());
  std::printf("(depth: KB in flight per block; %d SMs)\n", sms);
  return 0;
}
