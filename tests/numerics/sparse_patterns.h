/*
 * Block masks on the test side, shared by the block-sparse and the random
 * tests: random FlexAttention-style tables, the pattern builders of attn.h
 * written out as boolean matrices, and a read-back check. A selection is a
 * matrix [batch][heads][lq][lk] of the mask's batch and heads (nonzero =
 * selected), what the reference takes as its pair_mask.
 */
#ifndef ATTN_NUMERICS_SPARSE_PATTERNS_H
#define ATTN_NUMERICS_SPARSE_PATTERNS_H

#include <stddef.h>
#include <stdint.h>

#include <attn/attn.h>

#include "testutil.h"

/* A block mask's geometry. */
typedef struct sp_geom {
  int64_t batch, heads, lq, lk, bq, bk;
} sp_geom;

size_t sp_plane_size(const sp_geom *g);  /* lq * lk */
size_t sp_matrix_size(const sp_geom *g); /* batch * heads * lq * lk */
int64_t sp_q_blocks(const sp_geom *g);
int64_t sp_kv_blocks(const sp_geom *g);

/* How sp_draw_tables draws a selection. */
typedef struct sp_draw_opts {
  double p_none;    /* chance that a block is not listed */
  int empty_block0; /* query block 0 of slot 0 lists nothing: empty rows */
  int no_bits;      /* no bit tiles: partial blocks select every element */
  int corner_bits;  /* a partial block's bits lie in a random quarter-size rectangle of it,
                       so that tiles it overlaps, or their visible part, may hold none */
} sp_draw_opts;

/* A random selection drawn block by block, as the matrix `pair` and as the
 * tables of attn_block_mask_set_blocks (max_partial = max_full = the number
 * of key blocks; indices in a random order, unused slots filled with junk
 * that the library must not read). Free with sp_tables_free. */
typedef struct sp_tables {
  unsigned char *pair;
  int32_t *num_p, *idx_p, *num_f, *idx_f;
  uint8_t *bits;
} sp_tables;

void sp_draw_tables(const sp_geom *g, const sp_draw_opts *o, tu_rng *rng, sp_tables *t);
void sp_tables_free(sp_tables *t);

/* The builders' rules (attn.h), ORed into every slot of sel (sp_and_docs
 * ANDs). Windows and strides are measured from the aligned diagonal
 * i + lk - lq; a negative reach is unbounded and any reach, INT64_MAX
 * included, is exact. */
void sp_or_window(const sp_geom *g, unsigned char *sel, int64_t left, int64_t right);
/* rows = 0: every query sees keys pos[0..n); rows = 1: queries pos[0..n)
 * see every key. */
void sp_or_keys(const sp_geom *g, unsigned char *sel, const int64_t *pos, int64_t n, int rows);
void sp_or_strided(const sp_geom *g, unsigned char *sel, int64_t stride);
/* The seeded draw of attn_block_mask_add_random_blocks. */
void sp_or_random_blocks(const sp_geom *g, unsigned char *sel, int64_t per_row, uint64_t seed);
/* doc_q [batch][lq], doc_kv [batch][lk]. */
void sp_and_docs(const sp_geom *g, unsigned char *sel, const int32_t *doc_q,
                 const int32_t *doc_kv);
/* Document ids of packed sequences: runs of 1..max_run tokens, ids
 * increasing from 0. */
void sp_draw_docs(tu_rng *rng, int32_t *ids, int64_t n, int64_t max_run);

/* Reads the mask back (attn_block_mask_get_blocks) and checks that it
 * selects exactly `pair`, in canonical form: a block is listed full iff all
 * its in-range elements are selected, partial iff some are, not at all iff
 * none; lists sorted; unused slots -1; no bit set outside the sequences.
 * Fails the running CMocka test otherwise, with `what` in the message. */
void sp_check_readback(const sp_geom *g, attn_block_mask_t mask, const unsigned char *pair,
                       const char *what);

#endif /* ATTN_NUMERICS_SPARSE_PATTERNS_H */
