#include "backend/sharded_executor.h"

#include <algorithm>

#include "backend/llama_model.h"
#include "common/check.h"
#include "parallel/communicator.h"

namespace kvserve {

namespace {
// Message tags between stages; decode micro-batch i uses kDecodeHidden + i and kDecodeLogits + i.
constexpr int kPrefillHidden = 1, kPrefillScoreLayers = 2, kPrefillScores = 3, kPrefillLogits = 4;
constexpr int kDecodeHidden = 64, kDecodeLogits = 4096;
}  // namespace

ShardedExecutor::ShardedExecutor(std::shared_ptr<LlamaModel> model, PagedKvMemory& kv, ParallelGroups groups,
                                 int64_t micro_batches)
    : model_(std::move(model)), kv_(kv), g_(std::move(groups)),
      micro_batches_(micro_batches > 0 ? micro_batches : model_->layout().pp_size) {
  KV_CHECK(g_.world && g_.data, "internal: a sharded executor needs its process groups");
  KV_CHECK(micro_batches_ < kDecodeLogits - kDecodeHidden, "too many micro-batches: " << micro_batches_);
}

const ShardLayout& ShardedExecutor::layout() const { return model_->layout(); }
int64_t ShardedExecutor::prev_rank() const { return layout().global_rank(layout().stage - 1, layout().tp_rank); }
int64_t ShardedExecutor::next_rank() const { return layout().global_rank(layout().stage + 1, layout().tp_rank); }
int64_t ShardedExecutor::last_stage_head() const { return layout().global_rank(layout().pp_size - 1, 0); }

torch::Tensor ShardedExecutor::prefill(int64_t seq_id, const std::vector<int64_t>& tokens, const std::string& policy,
                                       bool all_logits, bool to_rank0) {
  torch::NoGradGuard ng;
  const ShardLayout& s = layout();
  const int64_t T = static_cast<int64_t>(tokens.size());
  KV_CHECK(T > 0, "empty prompt");
  auto& data = *g_.data;
  const auto dev = model_->device();
  const int rank = g_.world->rank();

  kv_.begin_prefill(seq_id, T, policy);
  const bool dynamic = kv_.is_dynamic_prefill(seq_id);
  torch::Tensor x;
  if (s.first_stage()) {
    x = model_->embed(tokens);
  } else {
    x = data.recv_tensor(static_cast<int>(prev_rank()), kPrefillHidden, dev);
    if (dynamic) {
      // DynamicKV: every earlier layer's (TP-gathered) scores, replayed in order so this stage's
      // budgets evolve exactly as in one process.
      auto layers = data.recv_tensor(static_cast<int>(prev_rank()), kPrefillScoreLayers, torch::kCPU);
      auto scores = data.recv_tensor(static_cast<int>(prev_rank()), kPrefillScores, dev);
      for (int64_t i = 0; i < layers.numel(); ++i) kv_.import_layer_scores(seq_id, layers[i].item<int64_t>(), scores[i]);
    }
  }
  x = model_->prefill_layers(seq_id, x, kv_);
  kv_.end_prefill(seq_id);
  torch::Tensor logits;
  if (!s.last_stage()) {
    data.send_tensor(x, static_cast<int>(next_rank()), kPrefillHidden);
    if (dynamic) {
      auto [layers, scores] = kv_.export_layer_scores(seq_id, s.layer_end);
      data.send_tensor(torch::tensor(layers, torch::kInt64).to(dev), static_cast<int>(next_rank()), kPrefillScoreLayers);
      data.send_tensor(scores.defined() ? scores : torch::empty({0}, torch::TensorOptions().device(dev)),
                       static_cast<int>(next_rank()), kPrefillScores);
    }
  } else {
    logits = model_->logits(all_logits ? x : x.narrow(0, T - 1, 1));
    if (to_rank0 && s.tp_rank == 0 && rank != 0) data.send_tensor(logits, 0, kPrefillLogits);
  }
  if (dynamic && s.pp_size > 1) {
    // The last stage alone saw every layer's scores: its final budgets settle the earlier stages.
    auto budgets = torch::zeros({s.num_layers_total}, torch::kInt64);
    if (s.last_stage()) {
      const auto& b = kv_.final_dynamic_budgets(seq_id);
      std::copy(b.begin(), b.end(), budgets.data_ptr<int64_t>());
    }
    g_.world->broadcast(budgets, static_cast<int>(last_stage_head()));
    if (!s.last_stage()) {
      std::vector<int64_t> b(budgets.data_ptr<int64_t>(), budgets.data_ptr<int64_t>() + budgets.numel());
      kv_.apply_final_budgets(seq_id, b);
    }
  }
  data.wait_sends();
  if (!to_rank0) return logits;
  if (rank == 0 && !s.last_stage()) logits = data.recv_tensor(static_cast<int>(last_stage_head()), kPrefillLogits, dev);
  return rank == 0 ? logits.to(torch::kCPU) : torch::Tensor();
}

torch::Tensor ShardedExecutor::decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, bool to_rank0) {
  torch::NoGradGuard ng;
  const ShardLayout& s = layout();
  const int64_t B = static_cast<int64_t>(tokens.size());
  KV_CHECK(B > 0 && batch.seq_ids.size() == tokens.size() && batch.positions.size() == tokens.size(),
           "decode batch of " << B << " tokens does not match its sequence list");
  auto& data = *g_.data;
  const auto dev = model_->device();
  const int rank = g_.world->rank();
  // Contiguous micro-batches: stage s works on micro-batch i while stage s+1 works on i-1.
  const int64_t M = std::min<int64_t>(micro_batches_, B);
  std::vector<torch::Tensor> out;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t lo = B * m / M, hi = B * (m + 1) / M;
    DecodeBatch mb;
    mb.seq_ids.assign(batch.seq_ids.begin() + lo, batch.seq_ids.begin() + hi);
    mb.positions.assign(batch.positions.begin() + lo, batch.positions.begin() + hi);
    torch::Tensor x = s.first_stage()
                          ? model_->embed(std::vector<int64_t>(tokens.begin() + lo, tokens.begin() + hi))
                          : data.recv_tensor(static_cast<int>(prev_rank()), kDecodeHidden + static_cast<int>(m), dev);
    x = model_->decode_layers(mb, x, kv_);
    if (!s.last_stage()) {
      data.send_tensor(x, static_cast<int>(next_rank()), kDecodeHidden + static_cast<int>(m));
    } else {
      auto lg = model_->logits(x);
      if (rank == 0 || !to_rank0) {
        out.push_back(lg);
      } else if (s.tp_rank == 0) {
        data.send_tensor(lg, 0, kDecodeLogits + static_cast<int>(m));
      }
    }
  }
  if (!to_rank0) {
    data.wait_sends();
    return s.last_stage() ? torch::cat(out) : torch::Tensor();
  }
  if (rank == 0 && !s.last_stage()) {
    for (int64_t m = 0; m < M; ++m)
      out.push_back(data.recv_tensor(static_cast<int>(last_stage_head()), kDecodeLogits + static_cast<int>(m), dev));
  }
  data.wait_sends();
  return rank == 0 ? torch::cat(out).to(torch::kCPU) : torch::Tensor();
}

}  // namespace kvserve
