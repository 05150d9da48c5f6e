/* See sparse_patterns.h. */
#include "sparse_patterns.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n == 0 ? 1 : n, size);
  if (p == NULL) {
    fprintf(stderr, "sparse_patterns: out of memory\n");
    abort();
  }
  return p;
}

static void check(attn_status_t st, const char *call) {
  if (st != ATTN_STATUS_SUCCESS)
    fail_msg("%s returned %s: %s", call, attn_status_string(st), attn_last_error_message());
}

size_t sp_plane_size(const sp_geom *g) { return (size_t)(g->lq * g->lk); }
size_t sp_matrix_size(const sp_geom *g) { return (size_t)(g->batch * g->heads) * sp_plane_size(g); }
int64_t sp_q_blocks(const sp_geom *g) { return (g->lq + g->bq - 1) / g->bq; }
int64_t sp_kv_blocks(const sp_geom *g) { return (g->lk + g->bk - 1) / g->bk; }

void sp_draw_tables(const sp_geom *g, const sp_draw_opts *o, tu_rng *rng, sp_tables *d) {
  const int64_t lq = g->lq, lk = g->lk, bq = g->bq, bk = g->bk;
  const int64_t nqb = sp_q_blocks(g), nkb = sp_kv_blocks(g);
  const int64_t rows = g->batch * g->heads * nqb;
  const size_t tile_bytes = (size_t)ATTN_BLOCK_MASK_TILE_BYTES(bq, bk);
  int32_t *order = (int32_t *)xcalloc((size_t)nkb, sizeof(int32_t));
  int64_t k, e, r, col;
  d->pair = (unsigned char *)xcalloc(sp_matrix_size(g), 1);
  d->num_p = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
  d->num_f = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
  d->idx_p = (int32_t *)xcalloc((size_t)(rows * nkb), sizeof(int32_t));
  d->idx_f = (int32_t *)xcalloc((size_t)(rows * nkb), sizeof(int32_t));
  d->bits = (uint8_t *)xcalloc((size_t)(rows * nkb) * tile_bytes, 1);
  for (k = 0; k < rows * nkb; ++k) d->idx_p[k] = d->idx_f[k] = 12345;
  memset(d->bits, 0xA5, (size_t)(rows * nkb) * tile_bytes);
  for (k = 0; k < rows; ++k) {
    const int64_t slot = k / nqb, qb = k % nqb;
    unsigned char *plane = d->pair + (size_t)slot * sp_plane_size(g);
    tu_rng_permutation(rng, order, (size_t)nkb);
    for (e = 0; e < nkb; ++e) {
      const int64_t kb = order[e];
      const double kind = tu_rng_uniform(rng, 0.0, 1.0);
      const double density = tu_rng_uniform(rng, 0.15, 0.85);
      const int listed = tu_rng_uniform(rng, 0.0, 1.0) >= o->p_none && !(o->empty_block0 && k == 0);
      /* full 30%, partial with random bits 50%, partial with every bit set 20%
       * (also those outside the sequence, which the library must ignore) */
      const int full = kind < 0.3, with_bits = kind >= 0.3 && kind < 0.8 && !o->no_bits;
      uint8_t *tile = NULL;
      const int64_t r0 = o->corner_bits ? tu_rng_int(rng, 0, bq - (bq + 3) / 4) : 0;
      const int64_t c0 = o->corner_bits ? tu_rng_int(rng, 0, bk - (bk + 3) / 4) : 0;
      const int64_t r1 = o->corner_bits ? r0 + (bq + 3) / 4 : bq;
      const int64_t c1 = o->corner_bits ? c0 + (bk + 3) / 4 : bk;
      if (!listed) continue;
      if (full) {
        d->idx_f[k * nkb + d->num_f[k]++] = (int32_t)kb;
      } else {
        tile = d->bits + (size_t)(k * nkb + d->num_p[k]) * tile_bytes;
        memset(tile, with_bits ? 0 : 0xFF, tile_bytes);
        d->idx_p[k * nkb + d->num_p[k]++] = (int32_t)kb;
      }
      for (r = 0; r < bq; ++r)
        for (col = 0; col < bk; ++col) {
          const int64_t i = qb * bq + r, j = kb * bk + col, t = r * bk + col;
          const int in_corner = r >= r0 && r < r1 && col >= c0 && col < c1;
          const int on =
              full || !with_bits || (in_corner && tu_rng_uniform(rng, 0.0, 1.0) < density);
          if (tile != NULL && with_bits && on) tile[t / 8] = (uint8_t)(tile[t / 8] | (1u << (t % 8)));
          if (i < lq && j < lk && on) plane[i * lk + j] = 1;
        }
    }
  }
  free(order);
}

void sp_tables_free(sp_tables *d) {
  free(d->pair);
  free(d->num_p);
  free(d->idx_p);
  free(d->num_f);
  free(d->idx_f);
  free(d->bits);
  memset(d, 0, sizeof *d);
}

/* The key aligned with query i. */
static int64_t diag(const sp_geom *g, int64_t i) { return i + g->lk - g->lq; }

void sp_or_window(const sp_geom *g, unsigned char *sel, int64_t left, int64_t right) {
  size_t s;
  int64_t i, j;
  for (s = 0; s < (size_t)(g->batch * g->heads); ++s)
    for (i = 0; i < g->lq; ++i)
      for (j = 0; j < g->lk; ++j)
        /* distances to the diagonal are small: no overflow for any reach */
        if ((left < 0 || diag(g, i) - j <= left) && (right < 0 || j - diag(g, i) <= right))
          sel[s * sp_plane_size(g) + (size_t)(i * g->lk + j)] = 1;
}

void sp_or_keys(const sp_geom *g, unsigned char *sel, const int64_t *pos, int64_t n, int rows) {
  size_t s;
  int64_t i, k;
  for (s = 0; s < (size_t)(g->batch * g->heads); ++s)
    for (k = 0; k < n; ++k)
      for (i = 0; i < (rows ? g->lk : g->lq); ++i) {
        /* rows: query pos[k] sees every key i; else every query i sees key pos[k] */
        const int64_t qi = rows ? pos[k] : i, kj = rows ? i : pos[k];
        sel[s * sp_plane_size(g) + (size_t)(qi * g->lk + kj)] = 1;
      }
}

void sp_or_strided(const sp_geom *g, unsigned char *sel, int64_t stride) {
  size_t s;
  int64_t i, j;
  for (s = 0; s < (size_t)(g->batch * g->heads); ++s)
    for (i = 0; i < g->lq; ++i)
      for (j = 0; j < g->lk; ++j)
        if (((diag(g, i) - j) % stride + stride) % stride == 0)
          sel[s * sp_plane_size(g) + (size_t)(i * g->lk + j)] = 1;
}

static uint64_t splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void sp_or_random_blocks(const sp_geom *g, unsigned char *sel, int64_t per_row, uint64_t seed) {
  const int64_t nqb = sp_q_blocks(g), nkb = sp_kv_blocks(g);
  int64_t *perm = (int64_t *)xcalloc((size_t)nkb, sizeof(int64_t));
  uint64_t state = seed;
  int64_t s, qb, t, i, j;
  for (s = 0; s < g->batch * g->heads; ++s)
    for (qb = 0; qb < nqb; ++qb) {
      for (t = 0; t < nkb; ++t) perm[t] = t;
      for (t = 0; t < per_row; ++t) {
        const int64_t u = t + (int64_t)(splitmix64(&state) % (uint64_t)(nkb - t));
        const int64_t kb = perm[u];
        perm[u] = perm[t];
        perm[t] = kb;
        for (i = qb * g->bq; i < (qb + 1) * g->bq && i < g->lq; ++i)
          for (j = kb * g->bk; j < (kb + 1) * g->bk && j < g->lk; ++j)
            sel[(size_t)s * sp_plane_size(g) + (size_t)(i * g->lk + j)] = 1;
      }
    }
  free(perm);
}

void sp_and_docs(const sp_geom *g, unsigned char *sel, const int32_t *dq, const int32_t *dk) {
  int64_t b, h, i, j;
  for (b = 0; b < g->batch; ++b)
    for (h = 0; h < g->heads; ++h)
      for (i = 0; i < g->lq; ++i)
        for (j = 0; j < g->lk; ++j)
          if (dq[b * g->lq + i] != dk[b * g->lk + j])
            sel[(size_t)(b * g->heads + h) * sp_plane_size(g) + (size_t)(i * g->lk + j)] = 0;
}

void sp_draw_docs(tu_rng *rng, int32_t *ids, int64_t n, int64_t max_run) {
  int64_t i = 0;
  int32_t doc = 0;
  while (i < n) {
    int64_t run = tu_rng_int(rng, 1, max_run), k;
    for (k = 0; k < run && i < n; ++k) ids[i++] = doc;
    ++doc;
  }
}

void sp_check_readback(const sp_geom *g, attn_block_mask_t mask, const unsigned char *pair,
                       const char *what) {
  const int64_t lq = g->lq, lk = g->lk, bq = g->bq, bk = g->bk;
  const int64_t nqb = sp_q_blocks(g), nkb = sp_kv_blocks(g);
  const int64_t rows = g->batch * g->heads * nqb;
  const size_t tile_bytes = (size_t)ATTN_BLOCK_MASK_TILE_BYTES(bq, bk);
  int32_t max_p = -1, max_f = -1, mp, mf;
  int32_t *num_p, *idx_p, *num_f, *idx_f;
  uint8_t *bits;
  int64_t k, kb, r, col, e;
  check(attn_block_mask_get_max_blocks(mask, &max_p, &max_f), "attn_block_mask_get_max_blocks");
  mp = max_p > 0 ? max_p : 1;
  mf = max_f > 0 ? max_f : 1;
  num_p = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
  num_f = (int32_t *)xcalloc((size_t)rows, sizeof(int32_t));
  idx_p = (int32_t *)xcalloc((size_t)(rows * mp), sizeof(int32_t));
  idx_f = (int32_t *)xcalloc((size_t)(rows * mf), sizeof(int32_t));
  bits = (uint8_t *)xcalloc((size_t)(rows * mp) * tile_bytes, 1);
  check(attn_block_mask_get_blocks(mask, num_p, idx_p, mp, bits, num_f, idx_f, mf),
        "attn_block_mask_get_blocks");
  for (k = 0; k < rows; ++k) {
    const int64_t slot = k / nqb, qb = k % nqb;
    const unsigned char *plane = pair + (size_t)slot * sp_plane_size(g);
    int32_t ep = 0, ef = 0;
    for (e = num_p[k]; e < mp; ++e)
      if (idx_p[k * mp + e] != -1)
        fail_msg("%s: row %lld: unused partial slot %lld holds %d, not -1", what, (long long)k,
                 (long long)e, idx_p[k * mp + e]);
    for (e = num_f[k]; e < mf; ++e)
      if (idx_f[k * mf + e] != -1)
        fail_msg("%s: row %lld: unused full slot %lld holds %d, not -1", what, (long long)k,
                 (long long)e, idx_f[k * mf + e]);
    for (kb = 0; kb < nkb; ++kb) {
      int64_t on = 0, in_range = 0;
      const int is_full = ef < num_f[k] && idx_f[k * mf + ef] == kb;
      const int is_partial = ep < num_p[k] && idx_p[k * mp + ep] == kb;
      const uint8_t *tile = is_partial ? bits + (size_t)(k * mp + ep) * tile_bytes : NULL;
      for (r = 0; r < bq; ++r)
        for (col = 0; col < bk; ++col) {
          const int64_t i = qb * bq + r, j = kb * bk + col, t = r * bk + col;
          const int bit = tile != NULL && ((tile[t / 8] >> (t % 8)) & 1);
          if (i >= lq || j >= lk) {
            if (bit)
              fail_msg("%s: row %lld block %lld: a bit outside the sequence is set", what,
                       (long long)k, (long long)kb);
            continue;
          }
          ++in_range;
          on += plane[i * lk + j] != 0;
          if (is_partial && bit != (plane[i * lk + j] != 0))
            fail_msg("%s: row %lld block %lld element (%lld, %lld): bit %d, expected %d", what,
                     (long long)k, (long long)kb, (long long)r, (long long)col, bit,
                     plane[i * lk + j] != 0);
        }
      if (is_full != (on == in_range && on > 0) || is_partial != (on > 0 && on < in_range))
        fail_msg("%s: row %lld key block %lld: listed full %d partial %d, but %lld of %lld "
                 "elements are selected", what, (long long)k, (long long)kb, is_full, is_partial,
                 (long long)on, (long long)in_range);
      ef += is_full;
      ep += is_partial;
    }
    /* every listed index was matched in increasing order: sorted, in range */
    if (ef != num_f[k] || ep != num_p[k])
      fail_msg("%s: row %lld lists %d full and %d partial blocks, %d and %d of them sorted and "
               "selecting something", what, (long long)k, num_f[k], num_p[k], ef, ep);
  }
  free(num_p);
  free(num_f);
  free(idx_p);
  free(idx_f);
  free(bits);
}
