#pragma once
// ReferenceSampler: the per-row host sampler the engine used before the batched device sampler; the
// batched one must pick the same tokens, so tests compare against this unchanged arithmetic.
#include <torch/torch.h>

#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "backend/engine/engine_types.h"
#include "backend/sampling/sampling_params.h"

namespace kvserve {

// One sequence's sampling state on the host: the RNG stream and output token counts for penalties.
class ReferenceSampler {
 public:
  ReferenceSampler(const SamplingParams& params, const std::vector<int64_t>& prompt, uint64_t fallback_seed,
                   std::vector<int64_t> eos_ids = {});
  // Picks the next token from fp32 logits [V] (CPU); fills logprob outputs when requested.
  int64_t sample(const torch::Tensor& logits, TokenLogprob* chosen, std::vector<TokenLogprob>* top);
  // What SamplerBank::sample did: masks EOS when ban_eos, samples, and records the token.
  int64_t sample_and_observe(const torch::Tensor& logits, bool ban_eos, TokenLogprob* chosen,
                             std::vector<TokenLogprob>* top);
  // Records a token produced by this sequence (for penalties).
  void observe(int64_t token);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int64_t> eos_ids_;
  std::unordered_map<int64_t, int64_t> output_counts_;
  std::vector<int64_t> seen_;  // prompt + output token ids, unique, for the repetition penalty
  std::vector<char> seen_mask_;
};

}  // namespace kvserve
