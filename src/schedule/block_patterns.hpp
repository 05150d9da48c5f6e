// Builders of the fixed sparsity patterns, each evaluated element by element
// on the mask's (query, key) grid and ORed into (or, for documents, ANDed
// with) a BlockMask, the same for every (batch, head) slot unless stated.
// Positions are 0-based within a sequence; windows and strides are measured
// from the aligned diagonal i + (seqlen_kv - seqlen_q), as the plan's masks.
// Arguments are validated by the caller (src/api).
#pragma once

#include <cstdint>

#include "schedule/block_mask.hpp"

namespace attn {

// Keys j with diag(i) - left <= j <= diag(i) + right; -1: unbounded.
void add_window(BlockMask& m, int64_t left, int64_t right);
// Every query sees keys[0..count) (StreamingLLM sinks, Longformer globals).
void add_global_keys(BlockMask& m, const int64_t* keys, int64_t count);
// queries[0..count) see every key.
void add_global_queries(BlockMask& m, const int64_t* queries, int64_t count);
// Keys j with diag(i) - j a multiple of stride (Sparse Transformer).
void add_strided(BlockMask& m, int64_t stride);
// Per (batch, head, query block), blocks_per_row distinct whole key blocks
// drawn from `seed` (BigBird); the exact draw is specified in attn.h.
void add_random_blocks(BlockMask& m, int64_t blocks_per_row, uint64_t seed);
// Keeps only pairs with doc_q[b][i] == doc_kv[b][j] (b the mask's batch).
void and_documents(BlockMask& m, const int32_t* doc_q, const int32_t* doc_kv);

}  // namespace attn
