#pragma once
// Sampler: turns a batch of logits into next tokens with torch ops on the logits' device (penalties,
// temperature, top-k/p, min-p); the random draws stay on the host, one seeded stream per sequence.
#include <torch/torch.h>

#include <cstdint>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend/engine/engine_types.h"
#include "backend/sampling/grammar_mask.h"
#include "backend/sampling/sampling_params.h"

namespace kvserve {

// One sampled token and the logprobs its request asked for (token texts are filled by the engine).
struct SampledToken {
  int64_t token = 0;
  TokenLogprob chosen;
  std::vector<TokenLogprob> top;
  // prompt_logprobs (a prefill's first token only): per prompt position from the second on, that
  // prompt token as `token`/`chosen` and the position's top-k.
  std::vector<SampledToken> prompt{};
  bool grammar_dead_end = false;  // the request's grammar allowed no token: `token` is void
};

// A draft token drawn from a draft distribution (self-speculation with draft_sampling "sample"): the
// row that verifies it keeps it by speculative sampling against the row's own distribution.
struct SampledDraft {
  int64_t token = -1;     // < 0: none
  std::vector<double> q;  // [V]: the distribution it was drawn from
};

// The logprob of each prompt token after the first under the model's fp32 logits of every prompt
// position ([T, V]; row t predicts token t + 1), and each row's top-k (ids ascending among equal
// logprobs). One device-to-host copy.
std::vector<SampledToken> prompt_logprobs(const torch::Tensor& logits, const std::vector<int64_t>& tokens, int64_t k);

// The samplers of the sequences this process samples for: the process that holds the logits (one
// process, or a pipeline's last stage), so that only token ids and logprobs have to travel.
//
// Per row, in this order: EOS masking (ban_eos), logprobs of that distribution (the model's own,
// before penalties), the request's logit edits (logit_bias, allowed_token_ids, bad_words:
// backend/sampling/logits_processors.h), the grammar mask of a structured-output request (GrammarMasks),
// repetition penalty (prompt + output tokens), presence/frequency penalties (output counts), then
// greedy (first maximum) or temperature with top-k, top-p, min-p and one uniform draw over the kept
// mass. The arithmetic is the former per-row host sampler's (float64 probabilities over candidates
// sorted by descending logit, lower id first on ties), so the same
// seed picks the same tokens on the CPU; on CUDA only summation order can move a boundary draw.
class SamplerBank {
 public:
  void add(int64_t seq_id, const SamplingParams& params, const std::vector<int64_t>& prompt, uint64_t seed,
           std::vector<int64_t> eos_ids);
  void remove(int64_t seq_id);
  // Samples row i of fp32 logits [B, V] (any device) for seq_ids[i] and records the token;
  // ban_eos[i] masks that sequence's EOS ids (min_tokens not reached yet). The only host sync is
  // one device-to-host copy of the results.
  std::vector<SampledToken> sample_batch(const std::vector<int64_t>& seq_ids, const torch::Tensor& logits,
                                         const std::vector<char>& ban_eos);
  // ...where drafts[i] (when given and not null) is a token drawn from a draft distribution that row i
  // verifies: a sampling row then keeps it with probability min(1, p / q) under its own distribution
  // p, or draws from max(0, p - q) (backend/sampling/speculative_sampling.h); two uniforms of its
  // stream. Greedy rows ignore it.
  std::vector<SampledToken> sample_batch(const std::vector<int64_t>& seq_ids, const torch::Tensor& logits,
                                         const std::vector<char>& ban_eos, std::span<const SampledDraft* const> drafts);
  // Whether the sequence draws its tokens (temperature > 0); a greedy sequence's drafts are argmaxes.
  bool samples(int64_t seq_id) const;
  // Draws the sequence's draft token from fp32 host logits [V] under its temperature, top-k, top-p
  // and min-p (not its penalties, edits or grammar: any q leaves the verified output exact); one
  // uniform of its stream.
  SampledDraft draft(int64_t seq_id, const float* logits, int64_t V);
  // One row: logits [V] or [1, V].
  SampledToken sample(int64_t seq_id, const torch::Tensor& logits, bool ban_eos);
  // The sequence's prompt_logprobs (-1: none, or no such sequence).
  int64_t prompt_logprobs(int64_t seq_id) const;
  // Starts the grammar masks of the next sample_batch(seq_ids) beside the model's forward.
  void prepare(const std::vector<int64_t>& seq_ids) { grammar_.prepare(seq_ids); }
  // Rows of the device penalty pool held by live sequences (the ones whose params use a penalty).
  int64_t penalty_rows_in_use() const { return pool_capacity_ - static_cast<int64_t>(free_slots_.size()); }

 private:
  // One sequence's host state: its params, its RNG stream and where its penalty row lives.
  struct Entry {
    SamplingParams params;
    std::mt19937_64 rng;
    std::vector<int64_t> eos_ids;
    std::vector<int64_t> prompt;  // kept until the first sample seeds the penalty row (V is known then)
    int64_t slot = -1;            // row of the penalty pool; -1: none (yet)
    std::vector<int64_t> output;  // sampled tokens, kept only for bad_words (matched against their ends)
  };
  int64_t acquire_slot(int64_t vocab, const torch::Device& device);

  std::unordered_map<int64_t, Entry> entries_;
  // Output counts (int32) and seen masks (prompt + outputs, bool) of the penalised sequences, one
  // row [V] each, on the logits' device: a sample updates them in place, nothing copies them back.
  torch::Tensor counts_, seen_;
  int64_t pool_capacity_ = 0;
  std::vector<int64_t> free_slots_;
  GrammarMasks grammar_;  // structured-output requests' matchers
};

}  // namespace kvserve
