#pragma once
// ShardScoreExchange: the ScoreExchange of one rank of a tensor x pipeline parallel job, over its
// process groups: TP all-gathers of queries and DynamicKV scores within a stage, the scores sent
// stage to stage, and the last stage's final budgets broadcast to every rank.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "parallel/parallel_groups.h"
#include "parallel/shard_layout.h"
#include "policies/score_exchange.h"

namespace kvserve::parallel {

class ShardScoreExchange final : public ScoreExchange {
 public:
  // Point-to-point tags on the data group (the runtime's own messages use other tags).
  static constexpr int kScoreLayersTag = 2, kScoresTag = 3;

  // num_kv_heads, num_heads: the whole model's; device: where received scores go (the model's).
  ShardScoreExchange(const ShardLayout& layout, int64_t num_kv_heads, int64_t num_heads, ParallelGroups groups,
                     torch::Device device);

  bool gathers_queries() const override;
  torch::Tensor gather_queries(const torch::Tensor& q) override;
  torch::Tensor gather_scores(int64_t layer, const torch::Tensor& local) override;
  int64_t first_kv_head() const override { return layout_.kv_head_begin; }
  LayerScores receive_scores() override;
  void send_scores(const LayerScores& scores) override;
  std::vector<int64_t> agree_final_budgets(const std::vector<int64_t>& own) override;
  std::vector<torch::Tensor> gather_all_layers(const std::vector<torch::Tensor>& local) override;

 private:
  ShardLayout layout_;
  int64_t num_kv_heads_, num_heads_;
  ParallelGroups groups_;
  torch::Device device_;
};

}  // namespace kvserve::parallel
