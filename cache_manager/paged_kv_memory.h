#pragma once
// PagedKvMemory: the model's KV memory on the paged pool, with each sequence's policy choosing what it keeps.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "cache_manager/kv_block_pool.h"
#include "cache_manager/kv_memory.h"
#include "cache_manager/paged_kv_cache.h"
#include "policies/decode_evictor.h"
#include "policies/policy_config.h"
#include "policies/prefill_selector.h"

namespace kvserve {

// Resolves {name -> params} (params may carry "name" = the library policy, default the key) into
// validated policy configs; "full" is always present.
std::map<std::string, PolicyConfig> resolve_policies(const std::map<std::string, std::map<std::string, std::string>>& specs);

// Where one shard's layers and KV heads sit in the whole model (pipeline and tensor parallel).
// Layer indices passed to the memory are always global; budgets use the model's layer count.
struct KvShard {
  int64_t first_layer = 0;
  int64_t total_layers = 0;  // 0 = this memory holds every layer
  // TP: DynamicKV's pooled scores of this rank's KV heads -> every KV head's (an all-gather), so
  // every rank budgets from the same scores.
  PrefillSelector::ScoreGatherer score_gatherer;
  // TP with replicated KV heads: this rank's query rows [H_local, Tq, D] -> the query heads of its
  // KV head's whole group [H / KV, Tq, D] (scorers then see what one process sees).
  std::function<torch::Tensor(const torch::Tensor& q)> query_gatherer;
};

class PagedKvMemory final : public KvMemory {
 public:
  PagedKvMemory(int64_t num_layers, const KvPoolOptions& pool, std::map<std::string, PolicyConfig> policies,
                std::string default_policy = "full", KvShard shard = {});

  void begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string& policy) override;
  void store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override;
  void end_prefill(int64_t seq_id) override;
  torch::Tensor decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& v) override;
  void release(int64_t seq_id) override;
  int64_t cached_tokens(int64_t seq_id, int64_t layer) const override { return cache_.length(seq_id, local(layer)); }

  bool can_prefill(int64_t prompt_len, const std::string& policy) const override;
  bool fits_when_empty(int64_t prompt_len, const std::string& policy) const override;
  bool can_decode(const std::vector<int64_t>& seq_ids) const override;
  int64_t blocks_total() const override { return cache_.total_blocks(); }
  int64_t blocks_used() const override { return cache_.used_blocks(); }
  int64_t blocks_high_water() const override { return cache_.high_water_blocks(); }
  int64_t kept_tokens(int64_t seq_id) const override;

  const PolicyConfig& policy(const std::string& name) const;

  // Admission arithmetic, also for a shard whose memory lives in another process (the scheduler
  // runs it on rank 0 for every shard of a sharded job).
  struct Geometry {
    int64_t first_layer = 0, num_layers = 0, total_layers = 0, num_kv_heads = 0, block_size = 16;
  };
  Geometry geometry() const;
  // Blocks a prompt occupies at its peak under `cfg` in the shard's layers (DynamicKV: its
  // candidates; plus one layer's compaction copy and room for the first decoded token).
  static int64_t prompt_blocks(const PolicyConfig& cfg, const Geometry& g, int64_t prompt_len);
  int64_t free_blocks() const { return cache_.free_blocks(); }
  // At most how many blocks one decode step of these sequences takes (a fresh block wherever a
  // layer's last block is full; a decode-time eviction's compacted copy, counted as never freeing).
  int64_t decode_demand(const std::vector<int64_t>& seq_ids) const;
  // Blocks the sequence holds over this shard's layers (0 when it holds none).
  int64_t blocks_held(int64_t seq_id) const;
  // Per-layer kept counts decided at prefill (before any decode-time eviction), this shard's layers.
  const std::vector<int64_t>& prefill_budgets(int64_t seq_id) const { return seqs_.at(seq_id).budgets; }
  // Kept positions [local KV heads, n] of a (global) layer.
  torch::Tensor kept_positions(int64_t seq_id, int64_t layer) const { return cache_.positions(seq_id, local(layer)); }

  // Pipeline parallel DynamicKV (docs/parallel.md, "KV policies across shards"). A stage imports the (gathered)
  // scores of every earlier stage's layer before its own layers, exports the scores of all layers
  // up to its last, and a stage that is not the last settles when the last stage's final budgets
  // arrive (end_prefill leaves it waiting).
  bool is_dynamic_prefill(int64_t seq_id) const;
  void import_layer_scores(int64_t seq_id, int64_t layer, const torch::Tensor& scores);
  // Layers [0, up_to) whose scores this sequence's selector holds, and the scores [n, heads, N].
  std::pair<std::vector<int64_t>, torch::Tensor> export_layer_scores(int64_t seq_id, int64_t up_to) const;
  // Last stage, after end_prefill: DynamicKV's final scored budgets of every layer.
  const std::vector<int64_t>& final_dynamic_budgets(int64_t seq_id) const { return seqs_.at(seq_id).final_dynamic; }
  void apply_final_budgets(int64_t seq_id, const std::vector<int64_t>& scored);
  const KvShard& shard() const { return shard_; }
  const PagedKvCache& cache() const { return cache_; }
  PagedKvCache& cache() { return cache_; }

 private:
  // Per-layer tokens a prompt occupies at its peak under `policy` (DynamicKV: its candidates).
  int64_t blocks_for_prompt(int64_t prompt_len, const std::string& policy) const;
  void apply_updates(int64_t seq_id);
  void settle(int64_t seq_id);
  int64_t local(int64_t layer) const;
  bool last_shard() const { return shard_.first_layer + num_layers_ == shard_.total_layers; }

  // One sequence's policy state; the selector lives only during prefill.
  struct SeqState {
    const PolicyConfig* policy = nullptr;
    std::unique_ptr<PrefillSelector> selector;
    std::vector<DecodeEvictor> evictors;  // per layer; empty when the policy never evicts in decode
    std::vector<int64_t> budgets;
    std::vector<int64_t> final_dynamic;
    int64_t prompt_len = 0;
  };
  int64_t num_layers_;
  KvShard shard_;
  PagedKvCache cache_;
  std::map<std::string, PolicyConfig> policies_;
  std::string default_policy_;
  std::unordered_map<int64_t, SeqState> seqs_;
};

}  // namespace kvserve
