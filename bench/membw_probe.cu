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
// between them, a block-wide barrier per stage), 256 blocks.
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
  CHECK(cudaGetLastError());
  std::printf("(depth: KB in flight per block; %d SMs)\n", sms);
  return 0;
}
