#pragma once
// Prefill attention of a sliding-window (local) layer: each query sees only the keys of the last
// `window` positions, its own included (Gemma 3's local layers; transformers' mask: key position >
// query position - window).
#include <torch/torch.h>

#include <cstdint>

namespace kvserve {

// q [H, T, D]: queries at positions q_start .. q_start + T - 1; k, v [KV, P, D]: keys at positions
// k_start .. k_start + P - 1, the last one at the last query's position (earlier chunks' keys, if
// any, followed by the chunk's own); H is a multiple of KV (GQA). Scale 1/sqrt(D), as SDPA's default.
// Returns [H, T, D]. Queries run in blocks whose keys are cut to the blocks' windows, so the work is
// O(T * (window + block)) rather than O(T * P).
torch::Tensor sliding_window_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       int64_t q_start, int64_t k_start, int64_t window);

}  // namespace kvserve
