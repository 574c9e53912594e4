#pragma once
// PagedKvMemory: the model's KV memory on the paged pool, with each sequence's policy choosing what it keeps.
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "decode_evictor.h"
#include "kv_block_pool.h"
#include "kv_memory.h"
#include "paged_kv_cache.h"
#include "policy_config.h"
#include "prefill_selector.h"

namespace kvserve {

// Resolves {name -> params} (params may carry "name" = the library policy, default the key) into
// validated policy configs; "full" is always present.
std::map<std::string, PolicyConfig> resolve_policies(const std::map<std::string, std::map<std::string, std::string>>& specs);

class PagedKvMemory final : public KvMemory {
 public:
  PagedKvMemory(int64_t num_layers, const KvPoolOptions& pool, std::map<std::string, PolicyConfig> policies,
                std::string default_policy = "full");

  void begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string& policy) override;
  void store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override;
  void end_prefill(int64_t seq_id) override;
  torch::Tensor decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& v) override;
  void release(int64_t seq_id) override;
  int64_t cached_tokens(int64_t seq_id, int64_t layer) const override { return cache_.length(seq_id, layer); }

  bool can_prefill(int64_t prompt_len, const std::string& policy) const override;
  bool fits_when_empty(int64_t prompt_len, const std::string& policy) const override;
  bool can_decode(const std::vector<int64_t>& seq_ids) const override;
  int64_t blocks_total() const override { return cache_.total_blocks(); }
  int64_t blocks_used() const override { return cache_.used_blocks(); }
  int64_t blocks_high_water() const override { return cache_.high_water_blocks(); }
  int64_t kept_tokens(int64_t seq_id) const override;

  const PolicyConfig& policy(const std::string& name) const;
  // Per-layer kept counts decided at prefill (before any decode-time eviction).
  const std::vector<int64_t>& prefill_budgets(int64_t seq_id) const { return seqs_.at(seq_id).budgets; }
  const PagedKvCache& cache() const { return cache_; }
  PagedKvCache& cache() { return cache_; }

 private:
  // Per-layer tokens a prompt occupies at its peak under `policy` (DynamicKV: its candidates).
  int64_t blocks_for_prompt(int64_t prompt_len, const std::string& policy) const;
  void apply_updates(int64_t seq_id);

  // One sequence's policy state; the selector lives only during prefill.
  struct SeqState {
    const PolicyConfig* policy = nullptr;
    std::unique_ptr<PrefillSelector> selector;
    std::vector<DecodeEvictor> evictors;  // per layer; empty when the policy never evicts in decode
    std::vector<int64_t> budgets;
    int64_t prompt_len = 0;
  };
  int64_t num_layers_;
  PagedKvCache cache_;
  std::map<std::string, PolicyConfig> policies_;
  std::string default_policy_;
  std::unordered_map<int64_t, SeqState> seqs_;
};

}  // namespace kvserve
