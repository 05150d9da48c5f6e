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
// The backward's GEMMs likewise (flash/bwd_sm90_kernel.cuh's helpers, for
// each tile shape of flash::bwd_sm90_config): S^T = K Q^T (both K-major
// from shared memory), dV = P^T dO (P^T from registers in the A-fragment
// layout, dO MN-major), and dQ = dS K with dS^T written to shared memory by
// the kernel's fragment store and read back as a transposed A, K as an
// MN-major B, each warpgroup its [64][64] part of dQ.
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

#include "flash/bwd_sm90_kernel.cuh"
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

// q, d_o [BM][D], k [BN][D] (rows >= BN - 5 load as zeros), pt, dst [BN][BM]
// (row-major, T); st [BN][BM], dv [BN][D], dq [BM][D] fp32.
template <class T, int D>
__global__ void __launch_bounds__(BwdSm90Traits<D>::kThreads, 1)
    sm90_bwd_mma_kernel(const T* q, const T* d_o, const T* k, const T* pt, const T* dst,
                        float* st_out, float* dv_out, float* dq_out) {
#if ATTN_SM90_WGMMA
  using Tr = BwdSm90Traits<D>;
  constexpr int BM = Tr::kBM, BN = Tr::kBN, NTH = Tr::kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t raw = smem_u32(smem);
  const uint32_t s0 = (raw + 1023u) & ~1023u;
  unsigned char* const sb = smem + (s0 - raw);
  const uint32_t sK = s0 + Tr::kOffK, sQ = s0 + Tr::kOffQ, sDo = s0 + Tr::kOffDo,
                 sDs = s0 + Tr::kOffDs;
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  sm90::load_tile_swizzled<BM, D, NTH>(sQ, q, D, BM, tid);
  sm90::load_tile_swizzled<BM, D, NTH>(sDo, d_o, D, BM, tid);
  sm90::load_tile_swizzled<BN, D, NTH>(sK, k, D, BN - 5, tid);
  cp_async_commit();
  cp_async_wait<0>();
  sm90::fence_proxy_async();
  __syncthreads();

  const int key0 = wg * 64 + ((wtid >> 5) << 4) + g;
  // S^T = K Q^T for the warpgroup's 64 keys.
  float s[BM / 2];
  sm90::wgmma_fence();
  bwd_sm90::issue_scores<T, D, BM, BN>(s, sK + uint32_t(wg * 64 * 128), sQ);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::reg_fence(s);
#pragma unroll
  for (int j = 0; j < BM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      st_out[(key0 + 8 * (e >> 1)) * BM + 8 * j + 2 * t4 + (e & 1)] = s[4 * j + e];

  // P^T and dS^T fragments from global: (key0, 2t), (key0 + 8, 2t),
  // (key0, 8 + 2t), (key0 + 8, 8 + 2t) pairs of columns 16 kk + ..
  const uint32_t* pt32 = reinterpret_cast<const uint32_t*>(pt);
  const uint32_t* ds32 = reinterpret_cast<const uint32_t*>(dst);
  uint32_t pa[BM / 16][4], da[BM / 16][4];
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int at = ((key0 + 8 * (x & 1)) * BM + 16 * kk + 8 * (x >> 1) + 2 * t4) / 2;
      pa[kk][x] = pt32[at];
      da[kk][x] = ds32[at];
    }
  float dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dv[i] = 0.0f;
  sm90::wgmma_fence();
  bwd_sm90::issue_grad<T, D, BM>(dv, pa, sDo);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  bwd_sm90::hold(pa);
  sm90::reg_fence(dv);
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dv_out[(key0 + 8 * (e >> 1)) * D + 8 * j + 2 * t4 + (e & 1)] = dv[4 * j + e];

  // dS^T through shared memory, then dQ = dS K as the kernel splits it.
  bwd_sm90::store_frags<BN, BM>(sb + Tr::kOffDs, da, key0, t4);
  sm90::fence_proxy_async();
  __syncthreads();
  constexpr bool kSplitRows = BM == 128;
  const int dq_r = kSplitRows ? wg * 64 : 0, dq_c = kSplitRows ? 0 : wg * 64;
  float dq[32];
  sm90::wgmma_fence();
  bwd_sm90::issue_dq<T, BN>(dq, sDs + uint32_t(kSplitRows ? wg * BN * 128 : 0),
                            sK + uint32_t(kSplitRows ? 0 : wg * BN * 128));
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::reg_fence(dq);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dq_out[(dq_r + ((wtid >> 5) << 4) + g + 8 * (e >> 1)) * D + dq_c + 8 * j + 2 * t4 + (e & 1)] =
          dq[4 * j + e];
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

template <class T, int D>
bool run_bwd(const char* name, std::mt19937_64& rng) {
  using Tr = BwdSm90Traits<D>;
  constexpr int BM = Tr::kBM, BN = Tr::kBN, KV = BN - 5;  // K rows >= KV load as zeros
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<T> q(BM * D), d_o(BM * D), k(BN * D), pt(BN * BM), dst(BN * BM);
  for (auto* buf : {&q, &d_o, &k, &dst})
    for (auto& x : *buf) x = to_t<T>(nd(rng));
  for (auto& x : pt) x = to_t<T>(std::fabs(nd(rng)));
  auto f = [](const std::vector<T>& v, int i) { return double(from_t(v[size_t(i)])); };

  std::vector<double> st_want(BN * BM), st_mag(BN * BM), dv_want(BN * D), dv_mag(BN * D),
      dq_want(BM * D), dq_mag(BM * D);
  for (int j = 0; j < BN; ++j)
    for (int i = 0; i < BM; ++i) {
      double acc = 0, mag = 0;
      for (int x = 0; j < KV && x < D; ++x) {
        const double t = f(k, j * D + x) * f(q, i * D + x);
        acc += t, mag += std::fabs(t);
      }
      st_want[j * BM + i] = acc, st_mag[j * BM + i] = mag;
    }
  for (int j = 0; j < BN; ++j)
    for (int c = 0; c < D; ++c) {
      double acc = 0, mag = 0;
      for (int i = 0; i < BM; ++i) {
        const double t = f(pt, j * BM + i) * f(d_o, i * D + c);
        acc += t, mag += std::fabs(t);
      }
      dv_want[j * D + c] = acc, dv_mag[j * D + c] = mag;
    }
  for (int i = 0; i < BM; ++i)
    for (int c = 0; c < D; ++c) {
      double acc = 0, mag = 0;
      for (int j = 0; j < KV; ++j) {
        const double t = f(dst, j * BM + i) * f(k, j * D + c);
        acc += t, mag += std::fabs(t);
      }
      dq_want[i * D + c] = acc, dq_mag[i * D + c] = mag;
    }

  std::vector<T*> in;
  for (auto* buf : {&q, &d_o, &k, &pt, &dst}) {
    T* dev = nullptr;
    CHECK_CUDA(cudaMalloc(&dev, buf->size() * sizeof(T)));
    CHECK_CUDA(cudaMemcpy(dev, buf->data(), buf->size() * sizeof(T), cudaMemcpyHostToDevice));
    in.push_back(dev);
  }
  float *st_dev, *dv_dev, *dq_dev;
  CHECK_CUDA(cudaMalloc(&st_dev, st_want.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dv_dev, dv_want.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dq_dev, dq_want.size() * sizeof(float)));
  CHECK_CUDA(cudaMemset(st_dev, 0xFF, st_want.size() * sizeof(float)));  // NaN
  CHECK_CUDA(cudaMemset(dv_dev, 0xFF, dv_want.size() * sizeof(float)));
  CHECK_CUDA(cudaMemset(dq_dev, 0xFF, dq_want.size() * sizeof(float)));
  const size_t smem = Tr::kCfg.smem_bytes(D);
  CHECK_CUDA(cudaFuncSetAttribute(sm90_bwd_mma_kernel<T, D>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  sm90_bwd_mma_kernel<T, D>
      <<<1, Tr::kThreads, smem>>>(in[0], in[1], in[2], in[3], in[4], st_dev, dv_dev, dq_dev);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> st_got(st_want.size()), dv_got(dv_want.size()), dq_got(dq_want.size());
  CHECK_CUDA(cudaMemcpy(st_got.data(), st_dev, st_got.size() * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(dv_got.data(), dv_dev, dv_got.size() * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(dq_got.data(), dq_dev, dq_got.size() * 4, cudaMemcpyDeviceToHost));
  for (T* ptr : in) CHECK_CUDA(cudaFree(ptr));
  for (float* ptr : {st_dev, dv_dev, dq_dev}) CHECK_CUDA(cudaFree(ptr));

  const bool ok_s = compare("S^T = K Q^T", st_got, st_want, st_mag, BN, BM);
  const bool ok_v = compare("dV = P^T dO", dv_got, dv_want, dv_mag, BN, D);
  const bool ok_q = compare("dQ = dS K (dS^T from shared)", dq_got, dq_want, dq_mag, BM, D);
  std::printf("%s %s backward: S^T [%d x %d], dV [%d x %d], dQ [%d x %d]\n",
              ok_s && ok_v && ok_q ? "ok  " : "FAIL", name, BN, BM, BN, D, BM, D);
  return ok_s && ok_v && ok_q;
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
  failures += !run_bwd<__nv_bfloat16, 128>("bf16 d128", rng);
  failures += !run_bwd<__half, 128>("fp16 d128", rng);
  failures += !run_bwd<__nv_bfloat16, 64>("bf16 d64", rng);
  failures += !run_bwd<__half, 64>("fp16 d64", rng);
  std::printf("%s: %d failure(s), seed %" PRIu64 "\n", failures ? "FAILED" : "PASSED", failures,
              seed);
  return failures ? 1 : 0;
}
