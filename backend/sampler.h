#pragma once
// Sampler: turns one sequence's logits into its next token (penalties, temperature, top-k/p, min-p, seeded RNG).
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <random>
#include <unordered_map>
#include <vector>

#include "backend/engine_types.h"
#include "backend/sampling_params.h"

namespace kvserve {

// Per-sequence sampling state: the RNG stream and output token counts for penalties.
class SequenceSampler {
 public:
  SequenceSampler(const SamplingParams& params, const std::vector<int64_t>& prompt, uint64_t fallback_seed);
  // Picks the next token from fp32 logits [V] (CPU); fills logprob outputs when requested.
  int64_t sample(const torch::Tensor& logits, TokenLogprob* chosen, std::vector<TokenLogprob>* top);
  // Records a token produced by this sequence (for penalties).
  void observe(int64_t token);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::unordered_map<int64_t, int64_t> output_counts_;
  std::vector<int64_t> seen_;  // prompt + output token ids, unique, for the repetition penalty
  std::vector<char> seen_mask_;
};

// One sampled token and the logprobs its request asked for (token texts are filled by the engine).
struct SampledToken {
  int64_t token = 0;
  TokenLogprob chosen;
  std::vector<TokenLogprob> top;
};

// The samplers of the sequences this process samples for: the process that holds the logits (one
// process, or a pipeline's last stage), so that only token ids and logprobs have to travel.
class SamplerBank {
 public:
  void add(int64_t seq_id, const SamplingParams& params, const std::vector<int64_t>& prompt, uint64_t seed,
           std::vector<int64_t> eos_ids);
  void remove(int64_t seq_id) { samplers_.erase(seq_id); }
  // Samples from fp32 logits [V] (any device) and records the token; ban_eos masks the EOS ids
  // (min_tokens not reached yet).
  SampledToken sample(int64_t seq_id, const torch::Tensor& logits, bool ban_eos);

 private:
  struct Entry {
    std::unique_ptr<SequenceSampler> sampler;
    std::vector<int64_t> eos_ids;
  };
  std::unordered_map<int64_t, Entry> samplers_;
};

}  // namespace kvserve
