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

torch::Tensor LocalRunner::prefill(int64_t seq_id, const std::vector<int64_t>& tokens, const std::string& policy) {
  return model_->prefill(seq_id, tokens, *kv_, false, policy).to(torch::kCPU);
}

torch::Tensor LocalRunner::decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens) {
  return model_->decode(batch, tokens, *kv_).to(torch::kCPU);
}

}  // namespace kvserve
