#include "model_runner.h"

#include "llama_model.h"

namespace kvserve {

std::unique_ptr<PagedKvMemory> make_kv_memory(const LlamaModel& model, const EngineOptions& options, KvShard shard) {
  const ModelConfig& c = model.config();
  const ShardLayout& s = model.layout();
  KvPoolOptions pool;
  pool.num_kv_heads = s.kv_heads;
  pool.head_dim = c.head_dim;
  pool.block_size = options.block_size;
  pool.kv_cache_bytes = options.kv_cache_bytes;
  pool.dtype = model.dtype();
  pool.device = model.device();
  shard.first_layer = s.layer_begin;
  shard.total_layers = c.num_hidden_layers;
  return std::make_unique<PagedKvMemory>(s.num_layers(), pool, resolve_policies(options.policies), options.default_policy,
                                         std::move(shard));
}

std::optional<SampledToken> LocalRunner::prefill(int64_t seq_id, const std::vector<int64_t>& tokens,
                                                const std::string& policy, bool sample, bool ban_eos) {
  torch::Tensor logits = model_->prefill(seq_id, tokens, *kv_, false, policy);
  if (!sample) return std::nullopt;
  return samplers_.sample(seq_id, logits[0], ban_eos);
}

std::vector<SampledToken> LocalRunner::decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens,
                                              const std::vector<char>& ban_eos) {
  torch::Tensor logits = model_->decode(batch, tokens, *kv_).to(torch::kCPU);
  std::vector<SampledToken> out;
  for (size_t i = 0; i < batch.seq_ids.size(); ++i) out.push_back(samplers_.sample(batch.seq_ids[i], logits[static_cast<int64_t>(i)], ban_eos[i]));
  return out;
}

}  // namespace kvserve
