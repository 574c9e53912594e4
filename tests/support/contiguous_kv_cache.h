#pragma once
// ContiguousKvCache: uncompressed per-sequence KV tensors that grow by doubling; the exactness baseline.
#include <unordered_map>

#include "cache_manager/kv_memory.h"

namespace kvserve {

class ContiguousKvCache final : public KvMemory {
 public:
  // `capacity_tokens` bounds the tokens held over all sequences (each token = every layer's K/V);
  // accounting treats `block_size` tokens of one layer as a block so it compares with the paged pool.
  ContiguousKvCache(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim, torch::TensorOptions options,
                    int64_t capacity_tokens = int64_t{1} << 40, int64_t block_size = 16);

  void begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string& policy) override;
  void store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override;
  void end_prefill(int64_t) override {}
  torch::Tensor decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& v) override;
  void release(int64_t seq_id) override;
  int64_t cached_tokens(int64_t seq_id, int64_t layer) const override;

  int64_t blocks_total() const override { return capacity_tokens_ / block_size_ * num_layers_; }
  int64_t blocks_used() const override { return blocks_for(used_tokens_); }
  int64_t blocks_high_water() const override { return blocks_for(high_water_tokens_); }
  int64_t kept_tokens(int64_t seq_id) const override;

 private:
  struct Layer {
    torch::Tensor k, v;  // [KV, capacity, D]
    int64_t len = 0;
  };
  Layer& layer_of(int64_t seq_id, int64_t layer);
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_ * num_layers_; }
  void add_used(int64_t n);
  int64_t num_layers_, num_kv_heads_, head_dim_;
  torch::TensorOptions options_;
  int64_t capacity_tokens_, block_size_;
  int64_t used_tokens_ = 0, high_water_tokens_ = 0;
  struct Seq {
    std::vector<Layer> layers;
    int64_t accounted = 0;  // tokens charged against capacity_tokens_
  };
  std::unordered_map<int64_t, Seq> seqs_;
};

}  // namespace kvserve
