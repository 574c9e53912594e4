#pragma once
// DecodeEvictor: decode-time eviction that keeps one (sequence, layer) under cfg.decode_budget.
#include <cstdint>

#include <torch/torch.h>

#include "policies/policy_config.h"

namespace kvserve {

// Decides which cached slots of one (sequence, layer) to drop during decoding. Eviction waits until
// the cache holds more than decode_budget tokens, then drops down to decode_budget -
// decode_evict_chunk in one go, so it runs once per decode_evict_chunk + 1 new tokens rather than
// every token. The most recent `window` positions and (sink_recent) the first `sink` positions are
// never evicted. key_norm drops the largest key norms, sink_recent the oldest non-sink tokens,
// accumulated_attention the lowest caller-accumulated attention.
class DecodeEvictor {
 public:
  DecodeEvictor(const PolicyConfig& cfg, int64_t layer);

  // Whether this layer evicts during decode at all (decode_budget > 0, a supported scorer, not skipped).
  bool active() const { return active_; }
  // Whether a cache of `cached` tokens must be evicted now.
  bool needs_eviction(int64_t cached) const { return active_ && cached > cfg_.decode_budget; }
  // Tokens left after an eviction.
  int64_t target_count() const { return cfg_.decode_budget - cfg_.decode_evict_chunk; }

  // Kept slot indices, int64 [KV, target_count()] sorted ascending per head. positions [KV, n] int64:
  // the original position held by each slot; keys [KV, n, D] (key_norm); scores [KV, n] higher =
  // keep (accumulated_attention). Unused arguments may be undefined tensors.
  torch::Tensor select(const torch::Tensor& positions, const torch::Tensor& keys,
                       const torch::Tensor& scores = {}) const;

 private:
  PolicyConfig cfg_;
  bool active_ = false;
};

}  // namespace kvserve
