#pragma once
// Token scorers: a score per (KV head, prompt position) over the non-window prefix; higher = keep.
#include <cstdint>

#include <torch/torch.h>

#include "policies/policy_config.h"

namespace kvserve {

// SnapKV/PyramidKV/DynamicKV window attention. q [H, Tq, D] post-RoPE queries whose last `window`
// rows are the window's (Tq >= window; the full prompt's q or just the window's), k [KV, T, D]
// post-RoPE keys, H % KV == 0. The window queries' fp32 softmax attention over all keys (causal
// inside the window, scale 1/sqrt(D)) is restricted to the prefix [0, T - window), summed (or
// averaged: `mean_over_window`) over the window queries, pooled along the prefix (stride 1, `kernel`,
// padding kernel/2; avg counts the padding like torch's avg_pool1d) per query head, then averaged
// over the query heads of each KV head. Returns fp32 [KV, T - window]. O(window * T) work.
torch::Tensor window_attention_scores(const torch::Tensor& q, const torch::Tensor& k, int64_t window, int64_t kernel,
                                      PoolingKind pooling, bool mean_over_window);
// The same before the average over each KV head's query heads: fp32 [H, T - window], the query
// heads of KV head j in rows [j * H / KV, (j + 1) * H / KV) (DynamicKV variant=authors).
torch::Tensor window_attention_head_scores(const torch::Tensor& q, const torch::Tensor& k, int64_t window,
                                           int64_t kernel, PoolingKind pooling, bool mean_over_window);

// H2O accumulated attention: for every key j the causal softmax attention it receives from all
// queries i >= j, divided by the number of such queries (T - j), averaged over the query heads of
// each KV head; computed in query chunks so no [H, T, T] tensor is materialised. q [H, T, D],
// k [KV, T, D]. Returns fp32 [KV, T - window] (scores of the prefix).
torch::Tensor accumulated_attention_scores(const torch::Tensor& q, const torch::Tensor& k, int64_t window,
                                           int64_t query_chunk = 0);

// StreamingLLM: the first `sink` positions score highest, then later positions above earlier ones.
// Returns fp32 [num_kv_heads, n].
torch::Tensor sink_recent_scores(int64_t num_kv_heads, int64_t n, int64_t sink, const torch::Device& device);

// Key L2 norm: -||k||_2 over head_dim, computed in fp32, for the prefix [0, n). k [KV, T, D].
torch::Tensor key_norm_scores(const torch::Tensor& k, int64_t n);

// Uniform random scores from a CPU generator seeded with `seed` (reproducible on any device).
torch::Tensor random_scores(int64_t num_kv_heads, int64_t n, uint64_t seed, const torch::Device& device);

// The scorer `cfg.scorer` for one layer: fp32 [KV, T - cfg.window] (T = k.size(1)).
torch::Tensor score_tokens(const PolicyConfig& cfg, int64_t layer, const torch::Tensor& q, const torch::Tensor& k);

// Whether cfg.scorer needs the query tensor.
bool scorer_needs_queries(ScorerKind s);

}  // namespace kvserve
