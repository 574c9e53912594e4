#include "contiguous_kv_cache.h"

#include <cmath>

#include "kv_check.h"

namespace kvserve {

ContiguousKvCache::ContiguousKvCache(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim,
                                     torch::TensorOptions options)
    : num_layers_(num_layers), num_kv_heads_(num_kv_heads), head_dim_(head_dim), options_(options) {}

void ContiguousKvCache::begin_prefill(int64_t seq_id, int64_t) {
  KV_CHECK(!seqs_.count(seq_id), "sequence " << seq_id << " already has a cache");
  seqs_[seq_id].resize(num_layers_);
}

ContiguousKvCache::Layer& ContiguousKvCache::layer_of(int64_t seq_id, int64_t layer) {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end(), "sequence " << seq_id << " has no cache");
  KV_CHECK(layer >= 0 && layer < num_layers_, "layer " << layer << " out of range");
  return it->second[layer];
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
  return it->second.at(layer).len;
}

}  // namespace kvserve
