#pragma once
// KVzip's score bookkeeping (Kim et al., 2025, arXiv 2505.23416; docs/eval/kvzip-notes.md): which
// passes reconstruct which context positions, the maximum attention each (layer, KV head, position)
// receives from a pass's queries, and the selection over every layer's scores at once. Tensor math
// only; the passes themselves run in the backend (backend/scoring/kvzip_scorer.h).
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "policies/head_allocation.h"
#include "policies/policy_config.h"

namespace kvserve {

// The reconstruction of one prompt: positions [begin, end) are fed again, `chunks` at a time, after
// a repeat prompt; positions [0, end) are scored (those before `begin` keep score 0, the sinks
// [0, sink) score above everything); [end, prompt) is the window, kept whole and never seen by the
// passes, so the kept set of [0, end) depends on the tokens [0, end) alone.
struct ReconstructionPlan {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t sink = 0;
  std::vector<std::pair<int64_t, int64_t>> chunks;  // [start, stop) in prompt positions, ascending
};

// The plan for a prompt of prompt_len tokens under cfg (scorer reconstruction): end = prompt -
// window; begin = context_begin (kvpress: the chat template's prefix length, which its press skips;
// paper: 0), clamped to [0, end); chunks of cfg.chunk_size tokens from begin.
ReconstructionPlan plan_reconstruction(const PolicyConfig& cfg, int64_t prompt_len, int64_t context_begin);

// The keys a pass's softmax runs over when it reconstructs chunk [start, stop): the first
// min(sink, start) positions (kvpress's and the authors' `sink = min(n_sink, start_idx)`), the chunk
// itself, and the pass's own tokens (causally).
int64_t score_sink_keys(int64_t sink, int64_t start);

// One pass's contribution for one layer: q [H, n, D] the pass's post-RoPE queries; sink_k
// [KV, s, D], chunk_k [KV, c, D] the cached keys of the sinks and of the chunk; own_k [KV, n, D]
// the pass's own keys. Softmax of q k^T / sqrt(D) over [sinks, chunk, own] (own causal), in the
// queries' dtype; returns the maximum over the n queries and each KV head's query heads of the
// chunk's columns: [KV, c] in the queries' dtype. Computed per KV head (extra memory G * n * (s + c + n)).
torch::Tensor reconstruction_attention_max(const torch::Tensor& q, const torch::Tensor& sink_k, const torch::Tensor& chunk_k,
                                           const torch::Tensor& own_k);

// Gives positions [0, sink) of every layer's scores ([KV, n] each) the largest score of all of them
// plus one (kvpress), so that they are kept under every allocator.
void protect_sinks(std::vector<torch::Tensor>& scores, int64_t sink);

// Per (layer, KV head, position) maximum over every pass, for positions [0, scored) of a prompt.
class KvzipScoreBoard {
 public:
  KvzipScoreBoard(int64_t num_layers, int64_t num_kv_heads, int64_t scored, torch::TensorOptions options);
  // Max-merges a pass's chunk scores [KV, c] into positions [start, start + c) of `layer`.
  void record(int64_t layer, int64_t start, const torch::Tensor& chunk_scores);
  // Gives the sinks [0, sink) the largest score of every layer plus one (kvpress), so that they are
  // kept under every allocator. Call once, after the last pass.
  void protect_sinks(int64_t sink);
  // fp32 [KV, scored] of a layer.
  torch::Tensor layer_scores(int64_t layer) const;
  int64_t num_layers() const { return static_cast<int64_t>(scores_.size()); }
  int64_t scored() const { return scored_; }

 private:
  std::vector<torch::Tensor> scores_;
  int64_t scored_;
};

// The global allocator's total: scored entries kept over every (layer, KV head) of the model,
// window excluded. Paper: layers x KV x (B - window) with B the policy's per-layer budget (a ratio
// of the prompt: max(1, int(ratio * prompt))). kvpress (KVzipPress, layerwise=False): of
// N = layers x KV x prompt entries it prunes int(N * (1 - ratio)) (or keeps layers x KV x budget
// for a token budget), the window counted inside.
int64_t global_kept_total(const PolicyConfig& cfg, int64_t num_layers, int64_t num_kv_heads, int64_t prompt_len);

// KVzip's selection: one top-`total` over every layer's scores (scores[l] [KV, N], the same N for
// every layer), ties to the lower (layer, head, position); the trailing `window` positions
// [N, N + window) are kept by every head on top. Per layer, what each KV head keeps (positions
// ascending, a shorter head padded as adaptive_head_selection pads). 0 <= total <= L x KV x N.
// A shard takes its own part of the one selection: layers [layer_begin, layer_begin + layers) and
// KV heads [head_begin, head_begin + heads) (-1: to the end).
std::vector<HeadSelection> global_head_selection(const std::vector<torch::Tensor>& scores, int64_t total, int64_t window,
                                                 int64_t layer_begin = 0, int64_t layers = -1, int64_t head_begin = 0,
                                                 int64_t heads = -1);

}  // namespace kvserve
