#pragma once
// ScoreExchange: what the shards of a sharded job share so that each shard's KV policy scores and
// budgets a prompt exactly as one process would (docs/parallel.md, "KV policies across shards").
// The KV memory and the prefill selector talk only to this interface; the implementation over
// process groups lives in parallel/ (ShardScoreExchange), the one-process one here.
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace kvserve {

// DynamicKV's pooled scores of some layers: global layer indices ascending and their scores
// [layers, every KV head, N] (undefined when there are none).
struct LayerScores {
  std::vector<int64_t> layers;
  torch::Tensor scores;
};

class ScoreExchange {
 public:
  virtual ~ScoreExchange() = default;

  // Heads split across shards with KV heads replicated: a shard's query rows [H_local, Tq, D] ->
  // the query heads of its KV head's whole group [H / KV, Tq, D], so scorers see what one process
  // sees. gathers_queries() is false where the shard's own queries already are that group.
  virtual bool gathers_queries() const = 0;
  virtual torch::Tensor gather_queries(const torch::Tensor& q) = 0;

  // Heads split across shards: DynamicKV's pooled scores of `layer` for this shard's KV heads
  // [local KV heads, N] -> every KV head's [all KV heads, N] (heads in model order), the same on
  // every shard of the layer.
  virtual torch::Tensor gather_scores(int64_t layer, const torch::Tensor& local) = 0;
  // Where this shard's KV heads start among gather_scores' rows (model order).
  virtual int64_t first_kv_head() const { return 0; }

  // Layers split across shards (a DynamicKV prefill; every shard makes these calls in this order):
  // a shard after the first, before its first layer: every earlier layer's scores, from the shard
  // holding the layers just before its own.
  virtual LayerScores receive_scores() = 0;
  // A shard before the last, after its last layer: the scores of every layer so far, to the shard
  // holding the layers just after its own.
  virtual void send_scores(const LayerScores& scores) = 0;
  // Every shard, after the whole prompt: the final scored budgets (window excluded, one per model
  // layer) that the shard holding the last layer computed, passed there as `own` (ignored elsewhere).
  virtual std::vector<int64_t> agree_final_budgets(const std::vector<int64_t>& own) = 0;

  // Every shard, after a reconstruction scorer's passes (kvzip's global allocator: one top-k over the
  // whole model): this shard's scores, one [local KV heads, N] per layer it holds -> every model
  // layer's [all KV heads, N] (layers and heads in model order), the same on every shard.
  virtual std::vector<torch::Tensor> gather_all_layers(const std::vector<torch::Tensor>& local) { return local; }
};

// One process holds every layer and KV head: its scores already are everyone's and nothing travels.
class LocalScoreExchange final : public ScoreExchange {
 public:
  bool gathers_queries() const override { return false; }
  torch::Tensor gather_queries(const torch::Tensor& q) override { return q; }
  torch::Tensor gather_scores(int64_t, const torch::Tensor& local) override { return local; }
  LayerScores receive_scores() override { return {}; }
  void send_scores(const LayerScores&) override {}
  std::vector<int64_t> agree_final_budgets(const std::vector<int64_t>& own) override { return own; }
};

}  // namespace kvserve
