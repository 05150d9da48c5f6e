// The sm_90a building blocks of the wgmma forward (flash/sm90.cuh), alone:
// for each instantiated tile shape (flash::fwd_sm90_config of d = 64 and
// 128, fp16 and bf16), one thread block with the forward's warpgroups
// loads Q [BM][D], K and V [BN][D] into the swizzled panels with the same
// copy, descriptors and fences as the kernel, computes S = Q K^T (both
// operands from shared memory) and O = P V (P from registers, packed from
// global in the documented A-fragment layout; V MN-major), and writes both
// out through the documented accumulator layout. The host compares them
// with fp64 products of the same rounded inputs and prints the first
// mismatching (row, col), so a wrong descriptor or fragment layout shows in
// one run. Random normal inputs, fresh per run (seed printed; ATTN_TEST_SEED
// repeats one); outputs poisoned with NaN first.
// Exit 77 without an sm_90 device or without the sm_90a image.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "flash/fwd_sm90_kernel.cuh"

namespace {

using namespace attn::flash;

#define CHECK_CUDA(x)                                                                     \
  do {                                                                                    \
    const cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                              \
      std::printf("FAIL %s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

// q [BM][D], k, v [BN][D], p [BM][BN] (row-major, T); s [BM][BN], o [BM][D] fp32.
template <class T, int D>
__global__ void __launch_bounds__(FwdSm90Traits<D>::kThreads, 1)
    sm90_mma_kernel(const T* q, const T* k, const T* v, const T* p, float* s_out, float* o_out) {
#if ATTN_SM90_WGMMA
  using Tr = FwdSm90Traits<D>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, NTH = Tr::kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t raw = smem_u32(smem);
  const uint32_t sQa = (raw + 1023u) & ~1023u;
  const uint32_t sKa = sQa + uint32_t(BM * D * 2), sVa = sKa + uint32_t(BN * D * 2);
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  // Q and K whole, V with its last rows zero-filled (valid = BN - 5): the
  // kernel's tail handling.
  sm90::load_tile_swizzled<BM, D, NTH>(sQa, q, D, BM, tid);
  sm90::load_tile_swizzled<BN, D, NTH>(sKa, k, D, BN, tid);
  sm90::load_tile_swizzled<BN, D, NTH>(sVa, v, D, BN - 5, tid);
  cp_async_commit();
  cp_async_wait<0>();
  sm90::fence_proxy_async();
  __syncthreads();

  const int row0 = wg * 64 + ((wtid >> 5) << 4) + g;
  float s[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.0f;
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    sm90::Wgmma<T, BN>::ss(s, sm90::desc_k_major(sQa + uint32_t(wg * 64 * 128), BM, kk),
                           sm90::desc_k_major(sKa, BN, kk), kk > 0);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::reg_fence(s);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      s_out[(row0 + 8 * (e >> 1)) * BN + 8 * j + 2 * t4 + (e & 1)] = s[4 * j + e];

  // A fragment of k-step kk: (g, 2t), (g + 8, 2t), (g, 8 + 2t), (g + 8, 8 + 2t)
  // pairs of columns 16 kk + ..
  const uint32_t* p32 = reinterpret_cast<const uint32_t*>(p);
  uint32_t pa[BN / 16][4];
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int x = 0; x < 4; ++x)
      pa[kk][x] = p32[((row0 + 8 * (x & 1)) * BN + 16 * kk + 8 * (x >> 1) + 2 * t4) / 2];
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  sm90::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    sm90::Wgmma<T, D>::rs(o, pa[kk], sm90::desc_mn_major(sVa, BN, kk), true);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::reg_fence(o);
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      o_out[(row0 + 8 * (e >> 1)) * D + 8 * j + 2 * t4 + (e & 1)] = o[4 * j + e];
#endif
}

template <class T>
T to_t(float x);
template <>
__half to_t<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__nv_bfloat16 to_t<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
float from_t(__half x) { return __half2float(x); }
float from_t(__nv_bfloat16 x) { return __bfloat162float(x); }

// Compares got [rows][cols] with want; bound: 2e-4 * sum |terms| + 1e-5
// (the tensor cores' fp32 accumulation of exact 16-bit products; a layout
// error is off by the order of the terms themselves).
bool compare(const char* what, const std::vector<float>& got, const std::vector<double>& want,
             const std::vector<double>& mag, int rows, int cols) {
  int bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const size_t i = size_t(r) * cols + c;
      const double err = std::fabs(double(got[i]) - want[i]);
      const double tol = 2e-4 * mag[i] + 1e-5;
      if (!(err <= tol)) {
        if (bad == 0)
          std::printf("     %s: first mismatch at (row %d, col %d): got %.6g, want %.6g\n", what, r,
                      c, double(got[i]), want[i]);
        ++bad;
      }
    }
  if (bad > 0) std::printf("     %s: %d of %d elements wrong\n", what, bad, rows * cols);
  return bad == 0;
}

template <class T, int D>
bool run(const char* name, std::mt19937_64& rng) {
  using Tr = FwdSm90Traits<D>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<T> q(BM * D), k(BN * D), v(BN * D), p(BM * BN);
  for (auto& x : q) x = to_t<T>(nd(rng));
  for (auto& x : k) x = to_t<T>(nd(rng));
  for (auto& x : v) x = to_t<T>(nd(rng));
  for (auto& x : p) x = to_t<T>(std::fabs(nd(rng)));

  std::vector<double> s_want(BM * BN), s_mag(BM * BN), o_want(BM * D), o_mag(BM * D);
  for (int r = 0; r < BM; ++r)
    for (int c = 0; c < BN; ++c) {
      double acc = 0, mag = 0;
      for (int x = 0; x < D; ++x) {
        const double t = double(from_t(q[r * D + x])) * double(from_t(k[c * D + x]));
        acc += t, mag += std::fabs(t);
      }
      s_want[r * BN + c] = acc, s_mag[r * BN + c] = mag;
    }
  for (int r = 0; r < BM; ++r)
    for (int c = 0; c < D; ++c) {
      double acc = 0, mag = 0;
      for (int j = 0; j < BN - 5; ++j) {  // the last 5 rows of V load as zeros
        const double t = double(from_t(p[r * BN + j])) * double(from_t(v[j * D + c]));
        acc += t, mag += std::fabs(t);
      }
      o_want[r * D + c] = acc, o_mag[r * D + c] = mag;
    }

  T *dq, *dk, *dv, *dp;
  float *ds, *dout;
  CHECK_CUDA(cudaMalloc(&dq, q.size() * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&dk, k.size() * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&dv, v.size() * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&dp, p.size() * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&ds, s_want.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dout, o_want.size() * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dq, q.data(), q.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, k.data(), k.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dp, p.data(), p.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(ds, 0xFF, s_want.size() * sizeof(float)));  // NaN
  CHECK_CUDA(cudaMemset(dout, 0xFF, o_want.size() * sizeof(float)));
  const size_t smem = size_t(BM + 2 * BN) * D * 2 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(sm90_mma_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(smem)));
  sm90_mma_kernel<T, D><<<1, Tr::kThreads, smem>>>(dq, dk, dv, dp, ds, dout);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> s_got(s_want.size()), o_got(o_want.size());
  CHECK_CUDA(cudaMemcpy(s_got.data(), ds, s_got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(o_got.data(), dout, o_got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (void* ptr : {(void*)dq, (void*)dk, (void*)dv, (void*)dp, (void*)ds, (void*)dout})
    CHECK_CUDA(cudaFree(ptr));

  const bool ok_s = compare("S = Q K^T", s_got, s_want, s_mag, BM, BN);
  const bool ok_o = compare("O = P V", o_got, o_want, o_mag, BM, D);
  std::printf("%s %s: S = Q K^T [%d x %d], O = P V [%d x %d]\n", ok_s && ok_o ? "ok  " : "FAIL",
              name, BM, BN, BM, D);
  return ok_s && ok_o;
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaFuncAttributes attrs{};
  if (prop.major != 9 || prop.minor != 0 ||
      cudaFuncGetAttributes(&attrs, sm90_mma_kernel<__nv_bfloat16, 128>) != cudaSuccess ||
      attrs.ptxVersion < 90) {
    std::printf("SKIP: needs an sm_90 device and a build for sm_90a (device sm_%d%d)\n", prop.major,
                prop.minor);
    return 77;
  }
  const char* seed_env = std::getenv("ATTN_TEST_SEED");
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10)
                                 : uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  std::printf("seed %" PRIu64 " (ATTN_TEST_SEED=%" PRIu64 " repeats this run)\n", seed, seed);
  std::mt19937_64 rng(seed);
  int failures = 0;
  failures += !run<__nv_bfloat16, 128>("bf16 d128", rng);
  failures += !run<__half, 128>("fp16 d128", rng);
  failures += !run<__nv_bfloat16, 64>("bf16 d64", rng);
  failures += !run<__half, 64>("fp16 d64", rng);
  std::printf("%s: %d failure(s), seed %" PRIu64 "\n", failures ? "FAILED" : "PASSED", failures,
              seed);
  return failures ? 1 : 0;
}
