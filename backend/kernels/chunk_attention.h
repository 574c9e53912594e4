#pragma once
// Attention of a prompt chunk that starts after positions already in the KV cache (a later chunk of a
// chunked prefill, the rest of a prompt after a prefix-cache hit, a resumed conversation's new turn).

#include <torch/torch.h>

#include <vector>

namespace kvserve {

// q [H, T, D] (the chunk's queries), pk/pv [KV, P, D] (every earlier position the chunk sees, all of
// them visible), k/v [KV, T, D] (the chunk's own keys, seen causally); H is a multiple of KV (GQA).
// Returns [H, T, D]. Each query sees all P earlier positions and the chunk's positions up to its own.
//
// On CPU the two parts run as separate flash-attention calls merged by their log-sum-exps: a single
// call would need a [T, P + T] mask, which rules out the causal half's skipped tiles and computes
// T * (P + T) scores instead of T * P + T^2 / 2 (1.8x slower for 5.5K tokens after a 2.5K-token hit).
// Short chunks (a question after a cached document) gain nothing from the split and keep one call.
torch::Tensor chunk_attention(const torch::Tensor& q, const torch::Tensor& pk, const torch::Tensor& pv,
                              const torch::Tensor& k, const torch::Tensor& v);

// The same when the earlier positions' KV heads hold different numbers of them (head-wise budgets):
// KV head h's first head_lengths[h] rows of pk/pv are real, the rest padding. Runs chunk_attention
// per KV head with its query heads, so nothing padded is ever seen.
torch::Tensor chunk_attention(const torch::Tensor& q, const torch::Tensor& pk, const torch::Tensor& pv,
                              const torch::Tensor& k, const torch::Tensor& v, const std::vector<int64_t>& head_lengths);

// Whether chunk_attention splits a chunk of `t` queries after `p` earlier positions on `device`.
bool chunk_attention_splits(int64_t t, int64_t p, const torch::Device& device);

}  // namespace kvserve
