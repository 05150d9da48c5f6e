// Paged decode on sm_80+: attention of a batch's newest query tokens over
// the pages of a KV cache, the GQA group packed as the rows of one m16 tile.
//
// Block (unit, KV head g, row tile z) (unit and g flattened into the
// grid's x, see block_slot), 128 threads (with the balanced
// split a block runs a list of units, one after the other). Rows of the
// tile are r = z * 16 + i (i < 16) of the sequence's q_len * G packed rows, row r
// being query token r / G, query head g * G + r % G. The block streams the
// unit's pages in tiles of kTileKeys key slots through an S-stage cp.async
// pipeline (S - 1 tiles in flight while one is computed: S = 2 fits three
// blocks on an H100/H200 SM, S = 3 two); each of the 4 warps takes 16 slots
// of a tile (S = Q K^T and O += P V on mma.sync m16n8k16) and keeps its own
// online-softmax state, and the warps' states are merged at the end. A key
// slot of a page is loaded once per block, so once per group (and per 16
// rows). The page entries of a tile are copied into shared memory S
// iterations ahead of its K/V, so that the K/V copies never wait on a
// dependent global load.
//
// Units of a split sequence write fp32 partial (O, LSE) states, merged by
// decode_combine_kernel (the chunks of a row in parallel). The online
// softmax step and the warps' merge are shared with the sm_90 bulk-copy
// variant (paged_decode_sm90.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "decode/decode_params.cuh"
#include "flash/sm80.cuh"

namespace attn::decode {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTileKeys = 16 * kWarps;  // key slots per pipeline stage

template <int D, int S>
struct Smem {
  static_assert(S >= 2, "a tile in flight while one is computed");
  static constexpr int kLd = D + 8;  // row pitch (elements): ldmatrix without bank conflicts
  static constexpr int kTileElems = kTileKeys * kLd;
  // K and V of each stage, the slots' positions, Q.
  static constexpr int kKvBytes = S * 2 * kTileElems * 2;
  static constexpr int kPosBytes = S * kTileKeys * 4;
  // Page entries one tile can touch (page size 1: one per slot, plus one
  // when a tile starts inside a page); S buffers (see the kernel).
  static constexpr int kEntriesPerTile = kTileKeys + 1;
  static constexpr int kEntryBufs = S;
  static constexpr int kEntryBytes = kEntryBufs * kEntriesPerTile * 16;
  static constexpr int kQBytes = 16 * kLd * 2;
  // The warps' final states reuse the K/V area.
  static constexpr int kMergeBytes = kWarps * 16 * (D + 2) * 4;
  static_assert(kMergeBytes <= kKvBytes, "merge area fits");
  static constexpr int kBytes = kKvBytes + kPosBytes + kEntryBytes + kQBytes;
};

// Programmatic dependent launch (sm_90+; nothing before): the decode
// kernel lets the combine kernel launch as soon as every decode block has
// started, and the combine kernel waits there until the decode grid has
// completed and its writes are visible. Without the launch attribute
// (ATTN_CUDA_DECODE_PDL unset) both are no-ops.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// One tile's scores to probabilities for this thread's two rows (i0 =
// lane / 4 and i0 + 8): s[nt][e] (row i0 + 8 * (e / 2), key column
// c = 2 * (lane % 4) + (e & 1) of n-tile nt) is scaled (or capped), masked
// by position (key_pos(nt, c): the key's position, -1 for none; qpos[h]:
// the row's query position, -1 for a padding row) and exponentiated
// against the updated running max m (log2 units); l and acc are rescaled
// and l gains the row sums. a receives P as the A fragment of P V.
template <class T, int D, class KeyPos>
__device__ __forceinline__ void online_softmax_step(float (&s)[2][4], const KeyPos& key_pos,
                                                    const long long (&qpos)[2],
                                                    const DecodeParams& p, float scale2,
                                                    float (&m)[2], float (&l)[2],
                                                    float (&acc)[D / 8][4], uint32_t (&a)[4]) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int lane = threadIdx.x % 32;
  const bool capped = p.softcap > 0.0f;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e / 2;
      const long long kp = key_pos(nt, 2 * (lane % 4) + (e & 1));  // -1: no key
      const long long qp = qpos[h];
      const bool visible = kp >= 0 && kp <= qp &&
                           (p.window == 0 || kp >= qp - p.window + 1 || kp < p.sinks);
      float x = s[nt][e];
      if (capped) x = p.softcap * tanhf(x * p.scale / p.softcap) * kLog2e;
      else x *= scale2;
      x = visible ? x : -INFINITY;
      s[nt][e] = x;
      mx[h] = fmaxf(mx[h], x);
    }
  float corr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    const float m_new = fmaxf(m[h], mx[h]);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // no key yet: keep zeros
    corr[h] = flash::fast_exp2(m[h] - m_use);
    m[h] = m_new;
    l[h] *= corr[h];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        s[nt][e] = flash::fast_exp2(s[nt][e] - m_use);
        l[h] += s[nt][e];
      }
  }
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    acc[j][0] *= corr[0];
    acc[j][1] *= corr[0];
    acc[j][2] *= corr[1];
    acc[j][3] *= corr[1];
  }
  a[0] = flash::pack2<T>(s[0][0], s[0][1]);
  a[1] = flash::pack2<T>(s[0][2], s[0][3]);
  a[2] = flash::pack2<T>(s[1][0], s[1][1]);
  a[3] = flash::pack2<T>(s[1][2], s[1][3]);
}

// The end of a block: merges the kWarps warps' states (m, l, acc of rows
// i0 and i0 + 8 of each warp) through shared memory `smem` (kWarps * 16 *
// (D + 2) floats; the caller's barrier before ensures it is free) and
// writes the 16-row tile's rows below `rows`: O and LSE, or the fp32
// partial state of unit u.
template <class T, int D>
__device__ __forceinline__ void merge_and_store(unsigned char* smem, const DecodeParams& p,
                                                const WorkUnit& u, const SeqMeta& sm, int g,
                                                int row0, int rows, float (&m)[2], float (&l)[2],
                                                float (&acc)[D / 8][4]) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, i0 = lane / 4;
  const int G = p.group;
  float* sM = reinterpret_cast<float*>(smem);
  float* sL = sM + kWarps * 16;
  float* sO = sL + kWarps * 16;  // [warp][16][D]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    if (lane % 4 == 0) {
      sM[warp * 16 + i0 + 8 * h] = m[h];
      sL[warp * 16 + i0 + 8 * h] = l[h];
    }
  }
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      sO[(warp * 16 + i0 + 8 * (e / 2)) * D + j * 8 + 2 * (lane % 4) + (e & 1)] = acc[j][e];
  __syncthreads();
  T* o = static_cast<T*>(p.o);
  for (int idx = tid; idx < 16 * D; idx += kThreads) {
    const int i = idx / D, c = idx % D;
    const int rr = row0 + i;
    if (rr >= rows) break;  // rows grow with idx
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sM[w * 16 + i]);
    float L = 0.0f, val = 0.0f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(sM[w * 16 + i] - M);
        L += f * sL[w * 16 + i];
        val += f * sO[(w * 16 + i) * D + c];
      }
    }
    const bool empty = L == 0.0f;
    const float out = empty ? 0.0f : val / L;
    const float row_lse = empty ? -INFINITY : (M + log2f(L)) * 0.6931471805599453f;
    const int64_t t = rr / G, h = int64_t(g) * G + rr % G;
    if (u.partial < 0) {
      o[((sm.q_begin + t) * p.heads_q + h) * D + c] = T(out);
      if (c == 0 && p.lse != nullptr) p.lse[h * p.header->total_q + sm.q_begin + t] = row_lse;
    } else {
      const int64_t row = (u.partial * p.max_q + t) * p.heads_q + h;
      p.partial_o[row * D + c] = out;
      if (c == 0) p.partial_lse[row] = row_lse;
    }
  }
}

// The decode grid's x dimension is (block slot, KV head) flattened, the KV
// head fastest, so that the blocks of the prepared units, which are the
// first slots, are also the first blocks launched when the grid is the
// plan's largest (under graph capture: one shape for every prepare), rather
// than launched between blocks that only return.
__device__ __forceinline__ int64_t block_slot(const DecodeParams& p) {
  return int64_t(blockIdx.x) / p.heads_kv;
}
__device__ __forceinline__ int block_kv_head(const DecodeParams& p) {
  return int(int64_t(blockIdx.x) % p.heads_kv);
}

// Calls run(unit) for each work unit of this block, one after the other
// (a barrier in between: the last unit's merge read shared memory): with
// the balanced split those of p.block_units, else unit block_slot(p), if
// prepared (a kernel of its own: the loop costs registers). The block's start
// is a chain of dependent loads before its first K/V copy; it is kept to
// three there: the unit (read with the header: the grid is the plan's max
// units, so a unit past the prepared ones is stale but inside the
// workspace), then its first page entries and its sequence, then Q; the
// balanced split adds the block's unit range first.
template <bool kBalanced, class Run>
__device__ __forceinline__ void for_each_unit(const DecodeParams& p, const Run& run) {
  if constexpr (!kBalanced) {
    const int64_t unit_index = block_slot(p);
    const int64_t num_units = p.header->num_units;
    const WorkUnit u = p.units[unit_index];
    if (unit_index < num_units) run(u);
    return;
  }
  const int64_t slot = block_slot(p);
  const int32_t first = p.block_units[slot], last = p.block_units[slot + 1];
  for (int32_t i = first; i < last; ++i) {
    if (i > first) __syncthreads();
    run(p.units[i]);
  }
}

// One work unit u of the cp.async kernel below.
template <class T, int D, int S>
__device__ __forceinline__ void decode_unit(const DecodeParams& p, const WorkUnit& u,
                                            unsigned char* smem) {
  using flash::cp_async_16;
  using flash::smem_u32;
  using SM = Smem<D, S>;
  constexpr int kLd = SM::kLd;
  constexpr int kChunks = D / 8;  // 16-byte chunks of a row

  T* sKV = reinterpret_cast<T*>(smem);  // [stage][K|V][kTileKeys][kLd]
  int* sPos = reinterpret_cast<int*>(smem + SM::kKvBytes);  // [stage][kTileKeys]
  PageEntry* sEnt = reinterpret_cast<PageEntry*>(smem + SM::kKvBytes + SM::kPosBytes);  // [S][kEntriesPerTile]
  T* sQ = reinterpret_cast<T*>(smem + SM::kKvBytes + SM::kPosBytes + SM::kEntryBytes);  // [16][kLd]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t ps = p.page_size;
  // Positions are below 2^31 (int32 in shared memory), and so are a unit's
  // key slots.
  const uint32_t ups = uint32_t(ps);
  const int64_t num_entries = u.entry_end - u.entry_begin;
  const int64_t slots = num_entries * ps;
  const int tiles = int((slots + kTileKeys - 1) / kTileKeys);

  // The page entries that tile `tile` reads go to entry buffer tile % S,
  // fetched S - 1 iterations before its K/V (see the pipeline below), so
  // that the K/V copies never wait on them.
  auto fetch_entries = [&](int tile) {
    const int64_t first = int64_t(uint32_t(tile * kTileKeys) / ups);
    const int64_t last = min(int64_t(uint32_t(tile * kTileKeys + kTileKeys - 1) / ups), num_entries - 1);
    if (tid <= last - first)
      cp_async_16(smem_u32(sEnt + (tile % S) * SM::kEntriesPerTile + tid),
                  p.entries + u.entry_begin + first + tid, true);
  };
  // The entries of tiles 0 .. S-2 (committed with Q below).
  for (int j = 0; j < S - 1; ++j)
    if (j < tiles) fetch_entries(j);

  const SeqMeta sm = p.seqs[u.seq];
  const int g = block_kv_head(p);
  const int G = p.group;
  const int rows = int(sm.q_len) * G;
  const int row0 = blockIdx.z * 16;
  if (row0 >= rows) {  // a row tile past this sequence's rows
    flash::cp_async_commit();
    flash::cp_async_wait<0>();  // no copy outlives the block
    return;
  }
  const int64_t n = sm.length;
  const T* q = static_cast<const T*>(p.q);
  const T* k_pool = static_cast<const T*>(p.k_pool);
  const T* v_pool = static_cast<const T*>(p.v_pool);

  // Q rows (zeros past the sequence's rows).
  for (int idx = tid; idx < 16 * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int rr = row0 + r;
    const int64_t t = rr / G, h = int64_t(g) * G + rr % G;
    const bool valid = rr < rows;
    cp_async_16(smem_u32(sQ + r * kLd + c * 8),
                valid ? q + ((sm.q_begin + t) * p.heads_q + h) * D + c * 8 : q, valid);
  }
  const int64_t head_off = int64_t(g) * p.head_stride;

  // Issues the K/V copies of tile `tile` into stage tile % S from its
  // entries (in shared memory by now). A slot past the unit, or at a
  // position >= n (the unfilled end of the last page), becomes zeros and
  // position -1. Each thread copies chunk c of rows r0, r0 + kRowStep, ...
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kTileKeys % kRowStep == 0, "rows divide among threads");
  const int chunk = tid % kChunks, r0 = tid / kChunks;
  auto issue_kv = [&](int tile) {
    const int st = tile % S;
    T* sK = sKV + st * 2 * SM::kTileElems;
    T* sV = sK + SM::kTileElems;
    const PageEntry* ent = sEnt + (tile % S) * SM::kEntriesPerTile;
    const uint32_t slot0 = uint32_t(tile * kTileKeys);
    const uint32_t first = slot0 / ups;
#pragma unroll
    for (int k = 0; k < kTileKeys / kRowStep; ++k) {
      const int r = r0 + k * kRowStep;
      const uint32_t slot = slot0 + uint32_t(r);
      const uint32_t e = slot / ups, in_page = slot - e * ups;
      bool valid = false;
      int pos = -1;
      int64_t off = 0;
      if (int64_t(slot) < slots) {
        const PageEntry pe = ent[e - first];
        pos = int(pe.logical * ps + in_page);
        valid = pos < n;
        off = pe.page * p.page_elems + head_off + int64_t(in_page) * p.slot_stride + chunk * 8;
      }
      cp_async_16(smem_u32(sK + r * kLd + chunk * 8), valid ? k_pool + off : k_pool, valid);
      cp_async_16(smem_u32(sV + r * kLd + chunk * 8), valid ? v_pool + off : v_pool, valid);
      if (chunk == 0) sPos[st * kTileKeys + r] = valid ? pos : -1;
    }
  };

  // The pipeline, in cp.async groups: the prologue waits for Q and the
  // entries of tiles 0 .. S-2 (issued above), then commits P_j = {K/V of
  // tile j, entries of tile S-1+j} for j < S-1; iteration i waits until at
  // most S-2 groups are pending (so P_i, or G_{i-S+1}, is complete: K/V of
  // tile i and the entries of tile i+S-1) and commits G_i = {K/V of tile
  // i+S-1, entries of tile i+2S-2}. Entry buffer (i+2S-2) % S held the
  // entries of tile i+S-2, read by the previous iteration's issue (a
  // barrier in between).
  flash::cp_async_commit();
  flash::cp_async_wait<0>();
  __syncthreads();  // sQ and the entries of tiles 0 .. S-2
#pragma unroll
  for (int j = 0; j < S - 1; ++j) {
    if (j > 0) __syncthreads();  // buffer (j - 1) % S was read by the last issue
    if (j < tiles) issue_kv(j);
    if (S - 1 + j < tiles) fetch_entries(S - 1 + j);
    flash::cp_async_commit();
  }

  // Q fragments: A of m16n8k16 for each 16-wide slice of D.
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    flash::ldsm_x4(qf[kk], smem_u32(sQ + (lane % 16) * kLd + kk * 16 + (lane / 16) * 8));

  // This thread's rows of the tile: i0 = lane / 4 and i0 + 8.
  const int i0 = lane / 4;
  long long qpos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = row0 + i0 + 8 * h;
    qpos[h] = rr < rows ? n - sm.q_len + rr / G : -1;  // -1: a padding row sees nothing
  }
  constexpr float kLog2e = 1.4426950408889634f;
  const float scale2 = p.scale * kLog2e;

  float m[2] = {-INFINITY, -INFINITY};  // running max, log2 units
  float l[2] = {0.0f, 0.0f};            // this thread's part of the row sums
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  for (int tile = 0; tile < tiles; ++tile) {
    const int st = tile % S;
    // K/V of this tile and the entries of tile + S - 1 are in.
    flash::cp_async_wait<S - 2>();
    __syncthreads();
    if (tile + S - 1 < tiles) issue_kv(tile + S - 1);
    if (tile + 2 * S - 2 < tiles) fetch_entries(tile + 2 * S - 2);
    flash::cp_async_commit();

    const T* sK = sKV + st * 2 * SM::kTileElems;
    const T* sV = sK + SM::kTileElems;
    const int* pos = sPos + st * kTileKeys;
    const int key0 = warp * 16;

    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t b[4];
      flash::ldsm_x4(b, smem_u32(sK + (key0 + lane % 8 + (lane / 16) * 8) * kLd + kk * 16 +
                                 ((lane / 8) % 2) * 8));
      flash::mma_16816<T>(s[0], qf[kk], b[0], b[1]);
      flash::mma_16816<T>(s[1], qf[kk], b[2], b[3]);
    }

    // Key kw = nt * 8 + c of the warp's 16 is key0 + kw of the tile.
    uint32_t a[4];
    online_softmax_step<T, D>(s, [&](int nt, int c) { return pos[key0 + nt * 8 + c]; }, qpos, p,
                              scale2, m, l, acc, a);
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      uint32_t b[4];
      flash::ldsm_x4_trans(b, smem_u32(sV + (key0 + lane % 8 + ((lane / 8) % 2) * 8) * kLd +
                                       dn * 16 + (lane / 16) * 8));
      flash::mma_16816<T>(acc[2 * dn], a, b[0], b[1]);
      flash::mma_16816<T>(acc[2 * dn + 1], a, b[2], b[3]);
    }
    __syncthreads();  // the stage is refilled by the next iteration's load
  }
  flash::cp_async_wait<0>();
  __syncthreads();

  merge_and_store<T, D>(smem, p, u, sm, g, row0, rows, m, l, acc);
}

// Grid (blocks, heads_kv, row tiles): the plan's max units, or with the
// balanced split its blocks (see for_each_unit); blocks past the prepared
// units or rows return at once, so that one launch shape serves every
// prepared batch (and a captured graph can be replayed after each prepare).
template <class T, int D, int S, bool kBalanced>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(const DecodeParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  launch_dependents();
  for_each_unit<kBalanced>(p, [&](const WorkUnit& u) { decode_unit<T, D, S>(p, u, smem); });
}

constexpr int kCombineThreads = 128;
constexpr int kCombineTokens = 8;  // most query tokens of a sequence in parallel (grid z)

// Grid (max batch, heads_q, min(max_q, kCombineTokens)), kCombineThreads
// threads: merges the chunks of each split sequence for query head
// blockIdx.y and query tokens blockIdx.z, + gridDim.z, ...:
//   M = max_k LSE_k,  w_k = exp(LSE_k - M),
//   LSE = M + log sum_k w_k,  O = sum_k w_k O_k / sum_k w_k.
// The chunks are spread over the block: a group of D / 4 threads holds one
// chunk's row (4 columns each, one float4 load), the block's groups take
// chunks group, group + groups, ... (four at a time, so that each thread
// has four loads in flight), after a block-wide max. The groups' sums are
// added in a fixed order, so a replay gives identical bits.
template <class T, int D>
__global__ void __launch_bounds__(kCombineThreads) decode_combine_kernel(const DecodeParams p) {
  constexpr int kLanes = D / 4;                      // threads per chunk row
  constexpr int kGroups = kCombineThreads / kLanes;  // chunks read at once
  constexpr int kWarpsC = kCombineThreads / 32;
  constexpr int kUnroll = 4;
  static_assert(kCombineThreads % kLanes == 0 && D <= kCombineThreads, "a row per group");
  wait_for_primary();  // the decode kernel's partial states (launched with PDL)
  const int64_t b = blockIdx.x;
  if (b >= p.header->batch) return;
  const SeqMeta sm = p.seqs[b];
  if (sm.num_units < 2) return;
  const int64_t h = blockIdx.y;
  const int tid = threadIdx.x, grp = tid / kLanes, lane4 = tid % kLanes;
  const int64_t chunks = sm.num_units;
  // Slots of the sequence's chunks are consecutive (prepare numbers them
  // so); a chunk's state is max_q * heads_q rows after the previous one's.
  const int64_t slot0 = p.units[sm.first_unit].partial;
  const int64_t chunk_rows = int64_t(p.max_q) * p.heads_q;
  __shared__ float s_max[kWarpsC];
  __shared__ float s_sum[kGroups];
  __shared__ __align__(16) float s_o[kGroups * D];
  T* o = static_cast<T*>(p.o);
  for (int64_t t = blockIdx.z; t < sm.q_len; t += gridDim.z) {
    const int64_t row0 = (slot0 * p.max_q + t) * p.heads_q + h;  // chunk k: + k * chunk_rows
    float mx = -INFINITY;
    for (int64_t k = tid; k < chunks; k += kCombineThreads)
      mx = fmaxf(mx, p.partial_lse[row0 + k * chunk_rows]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (tid % 32 == 0) s_max[tid / 32] = mx;
    __syncthreads();
    float M = s_max[0];
#pragma unroll
    for (int w = 1; w < kWarpsC; ++w) M = fmaxf(M, s_max[w]);

    float sum = 0.0f;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    auto add = [&](float lse, const float4& v) {
      const float w = expf(lse - M);
      sum += w;
      if (w != 0.0f) {
        acc.x += w * v.x;
        acc.y += w * v.y;
        acc.z += w * v.z;
        acc.w += w * v.w;
      }
    };
    if (M != -INFINITY) {  // else no chunk saw a key: the identity
      int64_t k = grp;
      for (; k + (kUnroll - 1) * kGroups < chunks; k += kUnroll * kGroups) {
        float lse[kUnroll];
        float4 v[kUnroll];
#pragma unroll
        for (int j = 0; j < kUnroll; ++j) {
          const int64_t row = row0 + (k + j * kGroups) * chunk_rows;
          lse[j] = p.partial_lse[row];
          v[j] = *reinterpret_cast<const float4*>(p.partial_o + row * D + lane4 * 4);
        }
#pragma unroll
        for (int j = 0; j < kUnroll; ++j) add(lse[j], v[j]);
      }
      for (; k < chunks; k += kGroups) {
        const int64_t row = row0 + k * chunk_rows;
        add(p.partial_lse[row], *reinterpret_cast<const float4*>(p.partial_o + row * D + lane4 * 4));
      }
    }
    *reinterpret_cast<float4*>(s_o + grp * D + lane4 * 4) = acc;
    if (lane4 == 0) s_sum[grp] = sum;
    __syncthreads();
    if (tid < D) {
      float total = 0.0f, val = 0.0f;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        total += s_sum[g];
        val += s_o[g * D + tid];
      }
      const int64_t out_row = (sm.q_begin + t) * p.heads_q + h;
      const bool empty = M == -INFINITY;
      o[out_row * D + tid] = T(empty ? 0.0f : val / total);
      if (tid == 0 && p.lse != nullptr)
        p.lse[h * p.header->total_q + sm.q_begin + t] = empty ? -INFINITY : M + logf(total);
    }
    __syncthreads();  // s_max, s_sum and s_o are reused for the next token
  }
}

// ---- KV cache appends --------------------------------------------------------

// Grid (runs, 2 sides: K then V, slices), kAppendThreads threads: the
// blocks of (run, side) copy that run's count x heads_kv rows of the side,
// slice z taking every gridDim.z-th group of kAppendThreads x kAppendIlp
// units (Unit: 16 bytes when every row is a multiple of 16 bytes and
// aligned, else 2 bytes). Each thread issues its kAppendIlp loads before
// its stores, so that an SM keeps enough bytes in flight to stream: one
// unit at a time per thread left a 4K-token prefill at ~6% of the copy
// bandwidth.
template <class Unit>
__global__ void __launch_bounds__(kAppendThreads) kv_append_kernel(const AppendParams p) {
  const AppendRun run = p.runs[blockIdx.x];
  const bool k_side = blockIdx.y == 0;
  const unsigned char* src = k_side ? p.k_src : p.v_src;
  unsigned char* pool = k_side ? p.k_pool : p.v_pool;
  const int64_t row_bytes = k_side ? p.k_row_bytes : p.v_row_bytes;
  unsigned char* page = pool + int64_t(run.page) * (k_side ? p.k_page_bytes : p.v_page_bytes);
  const int64_t hs = k_side ? p.k_head_stride : p.v_head_stride;
  const int64_t ss = k_side ? p.k_slot_stride : p.v_slot_stride;
  const int64_t upr = row_bytes / int64_t(sizeof(Unit));
  const int64_t total = int64_t(run.count) * p.heads_kv * upr;
  // The run's source rows are consecutive: token-major, heads inside.
  const Unit* s = reinterpret_cast<const Unit*>(src + run.src_token * p.heads_kv * row_bytes);
  constexpr int64_t kGroup = int64_t(kAppendThreads) * kAppendIlp;
  for (int64_t base = int64_t(blockIdx.z) * kGroup; base < total; base += int64_t(gridDim.z) * kGroup) {
    Unit buf[kAppendIlp];
    Unit* dst[kAppendIlp];
#pragma unroll
    for (int k = 0; k < kAppendIlp; ++k) {
      const int64_t i = base + k * kAppendThreads + threadIdx.x;
      dst[k] = nullptr;
      if (i < total) {
        const int64_t x = i % upr, row = i / upr;  // row = t * heads_kv + h
        const int64_t h = row % p.heads_kv, t = row / p.heads_kv;
        buf[k] = s[i];
        dst[k] = reinterpret_cast<Unit*>(page + h * hs + (run.slot + t) * ss) + x;
      }
    }
#pragma unroll
    for (int k = 0; k < kAppendIlp; ++k)
      if (dst[k] != nullptr) *dst[k] = buf[k];
  }
}

}  // namespace attn::decode
