#include "parallel/shard_score_exchange.h"

#include <algorithm>

#include "common/check.h"
#include "parallel/communicator.h"

namespace kvserve::parallel {

namespace {
// Rows of a TP all-gather [tp * local KV heads, N] in rank order -> one per model KV head: a KV head
// replicated across ranks appears once per replica, and the first copy is kept.
torch::Tensor one_per_replica(const torch::Tensor& rows, int64_t num_kv_heads, int64_t replicas) {
  return replicas > 1 ? rows.view({num_kv_heads, replicas, rows.size(1)}).select(1, 0).contiguous() : rows;
}
}  // namespace

ShardScoreExchange::ShardScoreExchange(const ShardLayout& layout, int64_t num_kv_heads, int64_t num_heads,
                                       ParallelGroups groups, torch::Device device)
    : layout_(layout), num_kv_heads_(num_kv_heads), num_heads_(num_heads), groups_(std::move(groups)),
      device_(device) {
  KV_CHECK(groups_.world && groups_.data, "internal: a score exchange needs the job's process groups");
  KV_CHECK(layout_.tp_size == 1 || groups_.tp, "internal: tensor parallel score exchange without a TP group");
}

bool ShardScoreExchange::gathers_queries() const { return groups_.tp && layout_.kv_replicas > 1; }

torch::Tensor ShardScoreExchange::gather_queries(const torch::Tensor& q) {
  if (!gathers_queries()) return q;
  const int64_t group = num_heads_ / num_kv_heads_;  // query heads per KV head
  return groups_.tp->all_gather(q.contiguous()).narrow(0, layout_.kv_head_begin * group, group);
}

torch::Tensor ShardScoreExchange::gather_scores(int64_t, const torch::Tensor& local) {
  if (!groups_.tp) return local;
  return one_per_replica(groups_.tp->all_gather(local.contiguous()), num_kv_heads_, layout_.kv_replicas);
}

LayerScores ShardScoreExchange::receive_scores() {
  KV_CHECK(!layout_.first_stage(), "internal: the first pipeline stage has no earlier scores to receive");
  const int prev = static_cast<int>(layout_.global_rank(layout_.stage - 1, layout_.tp_rank));
  auto layers = groups_.data->recv_tensor(prev, kScoreLayersTag, torch::kCPU);
  LayerScores out;
  out.scores = groups_.data->recv_tensor(prev, kScoresTag, device_);
  out.layers.assign(layers.data_ptr<int64_t>(), layers.data_ptr<int64_t>() + layers.numel());
  return out;
}

void ShardScoreExchange::send_scores(const LayerScores& s) {
  KV_CHECK(!layout_.last_stage(), "internal: the last pipeline stage has no later stage to send scores to");
  const int next = static_cast<int>(layout_.global_rank(layout_.stage + 1, layout_.tp_rank));
  // Queued like the stage's activations; the runtime's wait_sends finishes them.
  groups_.data->send_tensor(torch::tensor(s.layers, torch::kInt64).to(device_), next, kScoreLayersTag);
  groups_.data->send_tensor(s.scores.defined() ? s.scores : torch::empty({0}, torch::TensorOptions().device(device_)),
                            next, kScoresTag);
}

std::vector<int64_t> ShardScoreExchange::agree_final_budgets(const std::vector<int64_t>& own) {
  auto budgets = torch::zeros({layout_.num_layers_total}, torch::kInt64);
  if (layout_.last_stage()) {
    KV_CHECK(static_cast<int64_t>(own.size()) == layout_.num_layers_total,
             "internal: " << own.size() << " final DynamicKV budgets for " << layout_.num_layers_total << " layers");
    std::copy(own.begin(), own.end(), budgets.data_ptr<int64_t>());
  }
  groups_.world->broadcast(budgets, static_cast<int>(layout_.global_rank(layout_.pp_size - 1, 0)));
  if (layout_.last_stage()) return own;
  return std::vector<int64_t>(budgets.data_ptr<int64_t>(), budgets.data_ptr<int64_t>() + budgets.numel());
}

std::vector<torch::Tensor> ShardScoreExchange::gather_all_layers(const std::vector<torch::Tensor>& local) {
  KV_CHECK(!local.empty(), "internal: no layers of scores to gather");
  const int64_t KVl = local[0].size(0), N = local[0].size(1);
  const int64_t tp = layout_.tp_size, world = layout_.tp_size * layout_.pp_size;
  // Stages may hold different numbers of layers: every rank says which it holds, and pads its scores
  // to the most any holds, so that one all-gather over the job carries them all.
  auto range = torch::tensor({layout_.layer_begin, layout_.layer_end}, torch::kInt64).view({1, 2}).to(device_);
  const auto ranges = groups_.world->all_gather(range).to(torch::kCPU);  // [world, 2], global rank order
  KV_CHECK(ranges.size(0) == world, "internal: " << ranges.size(0) << " layer ranges from a job of " << world);
  const auto r = ranges.accessor<int64_t, 2>();
  int64_t most = 0;
  for (int64_t i = 0; i < world; ++i) most = std::max(most, r[i][1] - r[i][0]);
  auto mine = torch::zeros({most, KVl, N}, local[0].options());
  for (size_t l = 0; l < local.size(); ++l) {
    KV_CHECK(local[l].dim() == 2 && local[l].size(0) == KVl && local[l].size(1) == N,
             "internal: layer scores " << local[l].sizes() << " beside [" << KVl << ", " << N << "]");
    mine[static_cast<int64_t>(l)].copy_(local[l]);
  }
  const auto all = groups_.world->all_gather(mine.contiguous());  // [world * most, KVl, N]
  std::vector<torch::Tensor> out(static_cast<size_t>(layout_.num_layers_total));
  for (int64_t stage = 0; stage < layout_.pp_size; ++stage) {
    const int64_t head = layout_.global_rank(stage, 0);
    for (int64_t g = r[head][0]; g < r[head][1]; ++g) {
      std::vector<torch::Tensor> heads;  // the stage's TP ranks hold consecutive KV heads
      for (int64_t t = 0; t < tp; ++t) {
        const int64_t rank = layout_.global_rank(stage, t);
        heads.push_back(all[rank * most + (g - r[rank][0])]);
      }
      out[static_cast<size_t>(g)] = one_per_replica(torch::cat(heads, 0), num_kv_heads_, layout_.kv_replicas);
    }
  }
  for (int64_t g = 0; g < layout_.num_layers_total; ++g)
    KV_CHECK(out[static_cast<size_t>(g)].defined(), "internal: no shard holds layer " << g << "'s scores");
  return out;
}

}  // namespace kvserve::parallel
