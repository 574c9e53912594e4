#pragma once
// ContiguousKvCache: uncompressed per-sequence KV tensors that grow by doubling; the exactness baseline.
#include <unordered_map>

#include "kv_memory.h"

namespace kvserve {

class ContiguousKvCache final : public KvMemory {
 public:
  ContiguousKvCache(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim, torch::TensorOptions options);

  void begin_prefill(int64_t seq_id, int64_t prompt_len) override;
  void store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override;
  void end_prefill(int64_t) override {}
  torch::Tensor decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& v) override;
  void release(int64_t seq_id) override { seqs_.erase(seq_id); }
  int64_t cached_tokens(int64_t seq_id, int64_t layer) const override;

 private:
  struct Layer {
    torch::Tensor k, v;  // [KV, capacity, D]
    int64_t len = 0;
  };
  Layer& layer_of(int64_t seq_id, int64_t layer);
  int64_t num_layers_, num_kv_heads_, head_dim_;
  torch::TensorOptions options_;
  std::unordered_map<int64_t, std::vector<Layer>> seqs_;
};

}  // namespace kvserve
