// Paged decode on sm_90: the block and pipeline of paged_decode.cuh, with
// the K/V tiles moved by the bulk-copy engine (cp.async.bulk, completing on
// one mbarrier per stage) instead of 16-byte cp.async from every thread.
// The unit loop (decode_unit_mbar) is shared with the tensor-copy variant
// (paged_decode_tma.cuh); a copy policy (BulkCopy here) supplies the shared
// layout of the K/V tiles, the copies and the fragments' addresses.
//
// Why: the cp.async kernel issues 2 * kTileKeys * D / 8 copies (2048 at
// D = 128) and their address arithmetic per tile; here each of the tile's
// kTileKeys slots costs one thread two copies (K and V row), and a run of
// 8 slots that is contiguous in the pool (HND, or NHD with one KV head,
// page size a multiple of 8) costs one thread two copies of 8 rows.
//
// The bulk copies' shared layout and the stand-in rows of empty slots: see
// BulkCopy below.
#pragma once

#include "decode/paged_decode.cuh"
#include "flash/mbarrier.cuh"

namespace attn::decode {

// The mbarrier and bulk-copy wrappers (flash/mbarrier.cuh).
using flash::bulk_load;
using flash::mbar_arrive;
using flash::mbar_arrive_expect_tx;
using flash::mbar_init;
using flash::mbar_init_fence;
using flash::mbar_wait;

// Shared memory of the sm_90 kernels (decode_unit_mbar): S stages of K and
// V tiles of kTileBytes each in the copy policy's layout, then the stages'
// key positions, the page entries (as in Smem), Q, the stage barriers; the
// dynamic area's base aligned to kAlign (the slack counted in kBytes when
// over the 16 bytes promised).
template <int D, int S, int TileBytes, int Align>
struct MbarSmem {
  static_assert(S >= 2, "a tile in flight while one is computed");
  static constexpr int kSegRows = 8;
  static constexpr int kSegs = kTileKeys / kSegRows;
  static_assert(kSegs == 8 && kWarps * 2 == kSegs, "8 segments of 8 keys");
  static constexpr int kTileBytes = TileBytes;
  static constexpr int kKvBytes = S * 2 * kTileBytes;
  static constexpr int kPosBytes = S * kTileKeys * 4;
  static constexpr int kEntriesPerTile = kTileKeys + 1;
  static constexpr int kEntryBytes = S * kEntriesPerTile * 16;
  static constexpr int kLdQ = D + 8;
  static constexpr int kQBytes = 16 * kLdQ * 2;
  static constexpr int kBarBytes = (S * 8 + 15) / 16 * 16;
  static constexpr int kMergeBytes = kWarps * 16 * (D + 2) * 4;
  static_assert(kMergeBytes <= kKvBytes, "merge area fits");
  static_assert(kKvBytes % 16 == 0 && kQBytes % 16 == 0, "16-byte aligned parts");
  static constexpr int kAlign = Align;
  static constexpr int kBytes =
      kKvBytes + kPosBytes + kEntryBytes + kQBytes + kBarBytes + (Align > 16 ? Align : 0);
};

// The bulk-copy layout: segments of 8 rows, Pad elements apart. Pad 8 (16
// bytes) puts the segments of a tile in distinct banks; Pad 16 (32 bytes)
// keeps every copy's destination 32-byte aligned (a destination at an odd
// 16 bytes makes the copy engine read sectors twice: 11% more L2 sectors at
// 32 x 8K) at the cost of a 2-way ldmatrix conflict (segments s and s + 4
// share banks).
template <int D, int Pad>
constexpr int kBulkSegElems = 8 * D + Pad;
template <int D, int S, int Pad = 8>
struct BulkSmem : MbarSmem<D, S, 8 * kBulkSegElems<D, Pad> * 2, Pad * 2> {
  static_assert(Pad == 8 || Pad == 16, "16 or 32 bytes after each segment");
  static constexpr int kSegElems = kBulkSegElems<D, Pad>;
};

// What a copy policy's issue() needs of the unit and of one tile.
struct UnitInfo {
  int64_t slots;    // key slots of the unit (its pages x page size)
  int64_t n;        // the sequence's length: slots at positions >= n hold no key
  int64_t ps;
  uint32_t ups;     // page size as uint32 (positions are below 2^31)
  int g;            // the block's KV head
  int64_t q_begin;  // the sequence's first query token
};
struct TileIssue {
  const PageEntry* ent;   // the tile's page entries, from entry `first` of the unit
  int* pos;               // [kTileKeys] the stage's key positions (-1: no key)
  uint32_t bar;           // the stage's barrier
  uint32_t k, v;          // the stage's K and V tiles (shared addresses)
  uint32_t slot0, first;  // the tile's first key slot and its page entry
};

// Key slot t.slot0 + key of the unit: its position (-1 past the unit),
// whether it holds a key (position < n), its page and slot in the page.
struct SlotKey {
  int pos;
  bool valid;
  int64_t page;
  uint32_t in_page;
};
__device__ __forceinline__ SlotKey slot_key(const UnitInfo& ui, const TileIssue& t, int key) {
  const uint32_t slot = t.slot0 + uint32_t(key);
  const uint32_t e = slot / ui.ups;
  SlotKey k{-1, false, 0, slot - e * ui.ups};
  if (int64_t(slot) < ui.slots) {
    const PageEntry pe = t.ent[e - t.first];
    k.pos = int(pe.logical * ui.ps + k.in_page);
    k.valid = k.pos < ui.n;
    k.page = pe.page;
  }
  return k;
}

// The bulk-copy policy. Shared layout of a K (or V) tile: 8 segments of 8
// rows, [segment][row][D] with Pad elements after each segment; tile key k
// is row k % 8 of segment k / 8 (a bulk copy writes contiguous bytes, so
// rows inside a segment are unpadded). Rows of one segment share their
// banks; with Pad 8 (16 bytes) rows of different segments are 16 bytes
// apart in bank order, so each 8-row ldmatrix, which reads the same row of
// 8 segments, is conflict-free; with Pad 16 (32 bytes, sm90-bulk32, every
// copy's destination 32-byte aligned) segments s and s + 4 share banks, a
// 2-way conflict. Warp w takes rows 2w and 2w + 1 of every segment, n-tile
// nt of its S = Q K^T being row 2w + nt (key c * 8 + 2w + nt in column c),
// and P V reads V in the same order.
//
// Slots that hold no key (past the unit, or at positions >= n in the
// sequence's last page, which may hold anything) are filled from a stand-in
// finite row (Q of the sequence's first token, query head g * G) and get
// position -1: their weight is exactly 0, which would not cancel a NaN or
// Inf left in an unfilled slot.
template <class T, int D, int S, int Pad = 8>
struct BulkCopy {
  using SM = BulkSmem<D, S, Pad>;
  static constexpr int kArrivals = kTileKeys;  // per barrier phase: every key's thread
  static constexpr uint32_t kRowBytes = D * 2;

  __device__ static void prefetch(const DecodeParams&) {}

  // Thread tid < kTileKeys (whole warps: the ballot) takes tile key tid, row
  // tid % 8 of segment tid / 8. 8 slots from a multiple of 8 lie in one page
  // when ps % 8 == 0 (a unit starts at a page) and are contiguous when a
  // slot's row follows the last: then the segment's first thread copies all.
  __device__ static void issue(const DecodeParams& p, const UnitInfo& ui, const TileIssue& t) {
    const T* k_pool = static_cast<const T*>(p.k_pool);
    const T* v_pool = static_cast<const T*>(p.v_pool);
    const int key = threadIdx.x, lane = key % 32, seg = key / 8, row = key % 8;
    const SlotKey sk = slot_key(ui, t, key);
    const int64_t off = sk.page * p.page_elems + int64_t(ui.g) * p.head_stride +
                        int64_t(sk.in_page) * p.slot_stride;
    t.pos[key] = sk.valid ? sk.pos : -1;
    const uint32_t seg_valid = (__ballot_sync(0xffffffffu, sk.valid) >> (lane & 24)) & 0xffu;
    const bool runs_of_8 = ui.ps % 8 == 0 && p.slot_stride == D;
    const uint32_t dk = t.k + uint32_t((seg * SM::kSegElems + row * D) * 2);
    const uint32_t dv = t.v + uint32_t((seg * SM::kSegElems + row * D) * 2);
    if (runs_of_8 && seg_valid == 0xffu) {
      if (row == 0) {
        mbar_arrive_expect_tx(t.bar, 2 * 8 * kRowBytes);
        bulk_load(dk, k_pool + off, 8 * kRowBytes, t.bar);
        bulk_load(dv, v_pool + off, 8 * kRowBytes, t.bar);
      } else {
        mbar_arrive(t.bar);
      }
    } else {
      // token 0 of the sequence, query head g * G: finite
      const T* filler = static_cast<const T*>(p.q) + (ui.q_begin * p.heads_q + int64_t(ui.g) * p.group) * D;
      mbar_arrive_expect_tx(t.bar, 2 * kRowBytes);
      bulk_load(dk, sk.valid ? k_pool + off : filler, kRowBytes, t.bar);
      bulk_load(dv, sk.valid ? v_pool + off : filler, kRowBytes, t.bar);
    }
  }

  // A warp's ldmatrix addresses (lane l: row l % 8 of matrix l / 8) and keys.
  struct Reader {
    uint32_t k_off, v_off;
    int key0;  // 2 w
    __device__ Reader(int w, int lane)
        : k_off(uint32_t((2 * w * D + (lane % 8) * SM::kSegElems + (lane / 16) * D + ((lane / 8) % 2) * 8) * 2)),
          v_off(uint32_t((2 * w * D + (lane % 8) * SM::kSegElems + ((lane / 8) % 2) * D + (lane / 16) * 8) * 2)),
          key0(2 * w) {}
    __device__ uint32_t k(uint32_t sK, int kk) const { return sK + k_off + uint32_t(kk * 32); }
    __device__ uint32_t v(uint32_t sV, int dn) const { return sV + v_off + uint32_t(dn * 32); }
    // Tile key of column c of this warp's n-tile nt.
    __device__ int key(int nt, int c) const { return c * 8 + key0 + nt; }
    // Empty slots hold the stand-in row: nothing to do before reading.
    __device__ void prepare(uint32_t, const int*) const {}
  };
};

// One work unit u of an sm_90 kernel with copy policy Copy: the pipeline of
// paged_decode_kernel, the entries on cp.async groups, the K/V of tile t on
// stage (tile_base + t) % S, completing phase (tile_base + t) / S of that
// stage's barrier (tile_base: the tiles of the block's earlier units,
// advanced here).
template <class T, int D, int S, class Copy>
__device__ __forceinline__ void decode_unit_mbar(const DecodeParams& p, const WorkUnit& u,
                                                 unsigned char* smem, int& tile_base) {
  using flash::cp_async_16;
  using flash::smem_u32;
  using SM = typename Copy::SM;
  constexpr int kLdQ = SM::kLdQ;
  constexpr int kChunks = D / 8;

  const uint32_t sKV = smem_u32(smem);  // [stage][K|V][tile in Copy's layout]
  int* sPos = reinterpret_cast<int*>(smem + SM::kKvBytes);  // [stage][kTileKeys]
  PageEntry* sEnt = reinterpret_cast<PageEntry*>(smem + SM::kKvBytes + SM::kPosBytes);  // [S][kEntriesPerTile]
  T* sQ = reinterpret_cast<T*>(smem + SM::kKvBytes + SM::kPosBytes + SM::kEntryBytes);  // [16][kLdQ]
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM::kKvBytes + SM::kPosBytes +
                                               SM::kEntryBytes + SM::kQBytes);  // [S]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t ps = p.page_size;
  const uint32_t ups = uint32_t(ps);
  const int64_t num_entries = u.entry_end - u.entry_begin;
  const int64_t slots = num_entries * ps;
  const int tiles = int((slots + kTileKeys - 1) / kTileKeys);

  // Entries of tile `tile` into buffer tile % S, S - 1 iterations before its
  // K/V (as in paged_decode_kernel).
  auto fetch_entries = [&](int tile) {
    const int64_t first = int64_t(uint32_t(tile * kTileKeys) / ups);
    const int64_t last = min(int64_t(uint32_t(tile * kTileKeys + kTileKeys - 1) / ups), num_entries - 1);
    if (tid <= last - first)
      cp_async_16(smem_u32(sEnt + (tile % S) * SM::kEntriesPerTile + tid),
                  p.entries + u.entry_begin + first + tid, true);
  };
  for (int j = 0; j < S - 1; ++j)
    if (j < tiles) fetch_entries(j);

  const SeqMeta sm = p.seqs[u.seq];
  const int g = block_kv_head(p);
  const int G = p.group;
  const int rows = int(sm.q_len) * G;
  const int row0 = blockIdx.z * 16;
  if (row0 >= rows) {
    flash::cp_async_commit();
    flash::cp_async_wait<0>();
    return;
  }
  const int64_t n = sm.length;
  const T* q = static_cast<const T*>(p.q);

  for (int idx = tid; idx < 16 * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int rr = row0 + r;
    const int64_t t = rr / G, h = int64_t(g) * G + rr % G;
    const bool valid = rr < rows;
    cp_async_16(smem_u32(sQ + r * kLdQ + c * 8),
                valid ? q + ((sm.q_begin + t) * p.heads_q + h) * D + c * 8 : q, valid);
  }

  const UnitInfo ui{slots, n, ps, ups, g, sm.q_begin};
  const int base = tile_base;
  tile_base += tiles;
  // Tile `tile` into stage (base + tile) % S, by threads tid < kTileKeys.
  auto issue_kv = [&](int tile) {
    const int st = (base + tile) % S;
    const uint32_t slot0 = uint32_t(tile * kTileKeys);
    const uint32_t sK = sKV + uint32_t(st * 2 * SM::kTileBytes);
    const TileIssue t{sEnt + (tile % S) * SM::kEntriesPerTile, sPos + st * kTileKeys,
                      smem_u32(sBar + st), sK, sK + uint32_t(SM::kTileBytes), slot0, slot0 / ups};
    Copy::issue(p, ui, t);
  };

  // The barrier at the top of iteration i also ends every warp's reads of
  // the stage of tile i-1, which the iteration refills.
  flash::cp_async_commit();
  flash::cp_async_wait<0>();
  __syncthreads();  // sQ, the entries of tiles 0 .. S-2, the barriers
#pragma unroll
  for (int j = 0; j < S - 1; ++j) {
    if (j > 0) __syncthreads();
    if (j < tiles && tid < kTileKeys) issue_kv(j);
    if (S - 1 + j < tiles) fetch_entries(S - 1 + j);
    flash::cp_async_commit();
  }

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    flash::ldsm_x4(qf[kk], smem_u32(sQ + (lane % 16) * kLdQ + kk * 16 + (lane / 16) * 8));

  const int i0 = lane / 4;
  long long qpos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = row0 + i0 + 8 * h;
    qpos[h] = rr < rows ? n - sm.q_len + rr / G : -1;
  }
  constexpr float kLog2e = 1.4426950408889634f;
  const float scale2 = p.scale * kLog2e;

  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  const typename Copy::Reader rd(warp, lane);
  for (int tile = 0; tile < tiles; ++tile) {
    const int st = (base + tile) % S;
    flash::cp_async_wait<S - 2>();
    mbar_wait(smem_u32(sBar + st), uint32_t((base + tile) / S) & 1u);
    __syncthreads();
    if (tile + S - 1 < tiles && tid < kTileKeys) issue_kv(tile + S - 1);
    if (tile + 2 * S - 2 < tiles) fetch_entries(tile + 2 * S - 2);
    flash::cp_async_commit();

    const uint32_t sK = sKV + uint32_t(st * 2 * SM::kTileBytes);
    const uint32_t sV = sK + uint32_t(SM::kTileBytes);
    const int* pos = sPos + st * kTileKeys;
    rd.prepare(sV, pos);

    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t b[4];
      flash::ldsm_x4(b, rd.k(sK, kk));
      flash::mma_16816<T>(s[0], qf[kk], b[0], b[1]);
      flash::mma_16816<T>(s[1], qf[kk], b[2], b[3]);
    }
    uint32_t a[4];
    online_softmax_step<T, D>(s, [&](int nt, int c) { return pos[rd.key(nt, c)]; }, qpos, p,
                              scale2, m, l, acc, a);
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      uint32_t b[4];
      flash::ldsm_x4_trans(b, rd.v(sV, dn));
      flash::mma_16816<T>(acc[2 * dn], a, b[0], b[1]);
      flash::mma_16816<T>(acc[2 * dn + 1], a, b[2], b[3]);
    }
  }
  flash::cp_async_wait<0>();
  __syncthreads();  // every warp's last reads of the K/V area, now the merge area

  merge_and_store<T, D>(smem, p, u, sm, g, row0, rows, m, l, acc);
  // The merge's generic writes to the K/V area before a next unit's copies
  // into it.
  flash::fence_proxy_async_shared();
}

// Grid and block as paged_decode_kernel; p is a grid constant because the
// tensor copies address its tensor maps. The minimum of resident blocks
// steers ptxas' register choice: left free, at D = 64 it settles on 96
// registers and spills.
template <class T, int D, int S, bool kBalanced, class Copy>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 4 : 3)
    paged_decode_mbar_kernel(const __grid_constant__ DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using SM = typename Copy::SM;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // The base aligned up to what the copies need (the host adds the slack).
  unsigned char* smem =
      smem_raw + ((SM::kAlign - (flash::smem_u32(smem_raw) & (SM::kAlign - 1))) & (SM::kAlign - 1));
  uint64_t* sBar = reinterpret_cast<uint64_t*>(smem + SM::kKvBytes + SM::kPosBytes +
                                               SM::kEntryBytes + SM::kQBytes);  // [S]
  launch_dependents();
  // Copy::kArrivals per phase, visible to all before a unit's first issue
  // (the barrier after its prologue).
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(flash::smem_u32(sBar + s), Copy::kArrivals);
    Copy::prefetch(p);
  }
  mbar_init_fence();
  int tile_base = 0;
  for_each_unit<kBalanced>(
      p, [&](const WorkUnit& u) { decode_unit_mbar<T, D, S, Copy>(p, u, smem, tile_base); });
#else
  __trap();  // the host launches this kernel only on devices it was built for
#endif
}

}  // namespace attn::decode
