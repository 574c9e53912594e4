#include "tests/support/contiguous_kv_cache.h"

#include <cmath>

#include "common/check.h"

namespace kvserve {

ContiguousKvCache::ContiguousKvCache(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim,
                                     torch::TensorOptions options, int64_t capacity_tokens, int64_t block_size)
    : num_layers_(num_layers),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      options_(options),
      capacity_tokens_(capacity_tokens),
      block_size_(block_size) {}

void ContiguousKvCache::add_used(int64_t n) {
  used_tokens_ += n;
  high_water_tokens_ = std::max(high_water_tokens_, used_tokens_);
}

void ContiguousKvCache::begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string&) {
  KV_CHECK(!seqs_.count(seq_id), "sequence " << seq_id << " already has a cache");
  KV_CHECK(used_tokens_ + prompt_len <= capacity_tokens_,
           "KV cache exhausted: a prompt of " << prompt_len << " tokens does not fit (" << used_tokens_ << " of "
                                              << capacity_tokens_ << " tokens in use)");
  auto& seq = seqs_[seq_id];
  seq.layers.resize(num_layers_);
  seq.accounted = prompt_len;
  add_used(prompt_len);
}

void ContiguousKvCache::release(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  used_tokens_ -= it->second.accounted;
  seqs_.erase(it);
}

int64_t ContiguousKvCache::kept_tokens(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return 0;
  int64_t n = 0;
  for (const auto& l : it->second.layers) n += l.len;
  return n;
}

ContiguousKvCache::Layer& ContiguousKvCache::layer_of(int64_t seq_id, int64_t layer) {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end(), "sequence " << seq_id << " has no cache");
  KV_CHECK(layer >= 0 && layer < num_layers_, "layer " << layer << " out of range");
  return it->second.layers[layer];
}

void ContiguousKvCache::store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor&, const torch::Tensor& k,
                                      const torch::Tensor& v) {
  Layer& l = layer_of(seq_id, layer);
  const int64_t n = k.size(1);
  const int64_t cap = std::max<int64_t>(16, n + n / 4);
  l.k = torch::empty({num_kv_heads_, cap, head_dim_}, options_);
  l.v = torch::empty({num_kv_heads_, cap, head_dim_}, options_);
  l.k.narrow(1, 0, n).copy_(k);
  l.v.narrow(1, 0, n).copy_(v);
  l.len = n;
}

torch::Tensor ContiguousKvCache::decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                                  const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t G = H / num_kv_heads_;
  if (layer == 0) {
    for (int64_t id : batch.seq_ids) ++seqs_.at(id).accounted;
    add_used(B);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  torch::Tensor out = torch::empty_like(q);
  for (int64_t b = 0; b < B; ++b) {
    Layer& l = layer_of(batch.seq_ids[b], layer);
    if (l.len == l.k.size(1)) {  // grow by doubling
      const int64_t cap = l.len * 2;
      auto nk = torch::empty({num_kv_heads_, cap, head_dim_}, options_);
      auto nv = torch::empty({num_kv_heads_, cap, head_dim_}, options_);
      nk.narrow(1, 0, l.len).copy_(l.k.narrow(1, 0, l.len));
      nv.narrow(1, 0, l.len).copy_(l.v.narrow(1, 0, l.len));
      l.k = nk;
      l.v = nv;
    }
    l.k.select(1, l.len).copy_(k[b]);
    l.v.select(1, l.len).copy_(v[b]);
    l.len += 1;
    auto kk = l.k.narrow(1, 0, l.len);                                        // [KV, S, D]
    auto vv = l.v.narrow(1, 0, l.len);
    auto qb = q[b].view({num_kv_heads_, G, head_dim_});                       // [KV, G, D]
    auto scores = torch::matmul(qb, kk.transpose(1, 2)).mul_(scale);          // [KV, G, S]
    auto probs = torch::softmax(scores.to(torch::kFloat32), -1).to(q.scalar_type());
    out[b].copy_(torch::matmul(probs, vv).view({H, head_dim_}));
  }
  return out;
}

int64_t ContiguousKvCache::cached_tokens(int64_t seq_id, int64_t layer) const {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end(), "sequence " << seq_id << " has no cache");
  return it->second.layers.at(layer).len;
}

}  // namespace kvserve
