// MoBA's selector on the CPU (see attn_plan_desc_set_moba): mean-pooled keys
// per block, then per query row the gate of every past block and the top_k
// of them. Scalar fp32 code in a fixed order, so that the forward and the
// backward pass select the same blocks; it runs inside the kernels'
// parallel loops and never allocates.
#pragma once

#include <cstdint>

#include "plan/problem.hpp"

namespace attn::cpu {

// pooled[0..dqk) = mean of the keys of block kb of sequence b, KV head hk
// (zeros for a block past the sequence's keys: varlen batches size the
// blocks by the longest sequence).
void moba_pool(const Problem& p, const void* k, int64_t b, int64_t hk, int64_t kb, float* pooled);

// The selection of query row i of sequence b for selecting head hs (a KV
// head when shared, else a query head): bits[0..words) with bit kb set for
// each key block the row sees (none for a row past the sequence's queries,
// or left of its first key). pooled holds [heads_kv][num_blocks][dqk] of
// sequence b; gates and order are scratch of num_blocks entries.
void moba_select_row(const Problem& p, const void* q, const float* pooled, int64_t b, int64_t hs,
                     int64_t i, float* gates, int32_t* order, uint64_t* bits, int64_t words);

}  // namespace attn::cpu
