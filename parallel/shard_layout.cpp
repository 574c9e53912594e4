#include "parallel/shard_layout.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "common/check.h"

namespace kvserve::parallel {

std::vector<LayerRange> pipeline_layer_ranges(int64_t num_layers, int64_t pp) {
  KV_CHECK(pp >= 1, "pipeline size must be >= 1 (got " << pp << ")");
  KV_CHECK(num_layers >= pp, "cannot split " << num_layers << " layers over " << pp << " pipeline stages");
  std::vector<LayerRange> out;
  const int64_t base = num_layers / pp, extra = num_layers % pp;
  int64_t at = 0;
  for (int64_t s = 0; s < pp; ++s) {
    const int64_t n = base + (s < extra ? 1 : 0);
    out.push_back({at, at + n});
    at += n;
  }
  return out;
}

int64_t kv_heads_per_rank(int64_t num_kv_heads, int64_t tp) {
  KV_CHECK(tp >= 1 && num_kv_heads >= 1, "bad KV heads " << num_kv_heads << " / tensor parallel size " << tp);
  if (num_kv_heads >= tp) {
    KV_CHECK(num_kv_heads % tp == 0,
             num_kv_heads << " KV heads do not split evenly over tensor parallel size " << tp);
    return num_kv_heads / tp;
  }
  KV_CHECK(tp % num_kv_heads == 0, "tensor parallel size " << tp << " is not a multiple of the " << num_kv_heads
                                                           << " KV heads (needed to replicate them)");
  return 1;
}

void validate_parallel_shape(const ModelShape& m, int64_t tp, int64_t pp, const std::vector<int64_t>& stage_layers) {
  KV_CHECK(tp >= 1, "tensor parallel size must be >= 1, got " << tp);
  KV_CHECK(pp >= 1, "pipeline parallel size must be >= 1, got " << pp);
  KV_CHECK(m.num_heads % tp == 0, m.num_heads << " attention heads do not split evenly over tensor parallel size " << tp);
  kv_heads_per_rank(m.num_kv_heads, tp);
  KV_CHECK(tp <= m.intermediate_size, "tensor parallel size " << tp << " exceeds the MLP width " << m.intermediate_size);
  if (stage_layers.empty()) {
    KV_CHECK(m.num_layers >= pp, "cannot split " << m.num_layers << " layers over " << pp << " pipeline stages");
  } else {
    KV_CHECK(static_cast<int64_t>(stage_layers.size()) == pp,
             "pipeline layer split lists " << stage_layers.size() << " stages, but pipeline parallel size is " << pp);
    for (size_t s = 0; s < stage_layers.size(); ++s)
      KV_CHECK(stage_layers[s] >= 1, "pipeline layer split: stage " << s << " has " << stage_layers[s] << " layers (needs >= 1)");
    const int64_t sum = std::accumulate(stage_layers.begin(), stage_layers.end(), int64_t{0});
    KV_CHECK(sum == m.num_layers, "pipeline layer split sums to " << sum << " layers, but the model has " << m.num_layers);
  }
}

std::string ShardLayout::describe() const {
  std::ostringstream o;
  o << "stage " << stage << "/" << pp_size << " tp " << tp_rank << "/" << tp_size << ": layers [" << layer_begin << ", "
    << layer_end << "), q heads [" << q_head_begin << ", " << q_head_begin + q_heads << "), kv heads [" << kv_head_begin
    << ", " << kv_head_begin + kv_heads << ")" << (kv_replicas > 1 ? " (replicated)" : "") << ", mlp ["
    << inter_begin << ", " << inter_begin + inter_len << "), vocab [" << vocab_begin << ", " << vocab_begin + vocab_len
    << ")";
  return o.str();
}

ShardLayout make_shard_layout(const ModelShape& m, int64_t tp, int64_t tp_rank, int64_t pp, int64_t stage,
                              const std::vector<int64_t>& stage_layers) {
  validate_parallel_shape(m, tp, pp, stage_layers);
  KV_CHECK(tp_rank >= 0 && tp_rank < tp && stage >= 0 && stage < pp,
           "rank (stage " << stage << ", tp " << tp_rank << ") outside " << pp << "x" << tp);
  ShardLayout s;
  s.tp_size = tp;
  s.tp_rank = tp_rank;
  s.pp_size = pp;
  s.stage = stage;
  s.num_layers_total = m.num_layers;
  if (stage_layers.empty()) {
    const auto r = pipeline_layer_ranges(m.num_layers, pp)[static_cast<size_t>(stage)];
    s.layer_begin = r.begin;
    s.layer_end = r.end;
  } else {
    s.layer_begin = std::accumulate(stage_layers.begin(), stage_layers.begin() + stage, int64_t{0});
    s.layer_end = s.layer_begin + stage_layers[static_cast<size_t>(stage)];
  }
  s.q_heads = m.num_heads / tp;
  s.q_head_begin = tp_rank * s.q_heads;
  s.kv_heads = kv_heads_per_rank(m.num_kv_heads, tp);
  if (m.num_kv_heads >= tp) {
    s.kv_head_begin = tp_rank * s.kv_heads;
  } else {
    s.kv_replicas = tp / m.num_kv_heads;
    s.kv_head_begin = tp_rank / s.kv_replicas;
  }
  const int64_t ic = (m.intermediate_size + tp - 1) / tp;
  s.inter_begin = std::min(m.intermediate_size, tp_rank * ic);
  s.inter_len = std::min(m.intermediate_size, s.inter_begin + ic) - s.inter_begin;
  s.vocab_per_rank = (m.vocab_size + tp - 1) / tp;
  s.vocab_begin = std::min(m.vocab_size, tp_rank * s.vocab_per_rank);
  s.vocab_len = std::min(m.vocab_size, s.vocab_begin + s.vocab_per_rank) - s.vocab_begin;
  return s;
}

}  // namespace kvserve::parallel
