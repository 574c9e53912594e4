#include "policies/decode_evictor.h"

#include <algorithm>
#include <limits>

#include "common/check.h"
#include "policies/top_select.h"

namespace kvserve {

DecodeEvictor::DecodeEvictor(const PolicyConfig& cfg, int64_t layer) : cfg_(cfg) {
  active_ = cfg.decode_budget > 0 && !cfg.skips_layer(layer) &&
            (cfg.scorer == ScorerKind::kKeyNorm || cfg.scorer == ScorerKind::kSinkRecent ||
             cfg.scorer == ScorerKind::kAccumulatedAttention);
  if (active_) validate_policy_config(cfg_);
}

torch::Tensor DecodeEvictor::select(const torch::Tensor& positions, const torch::Tensor& keys,
                                    const torch::Tensor& scores) const {
  KV_CHECK(active_, "DecodeEvictor::select: policy '" << cfg_.name << "' does not evict during decode here");
  KV_CHECK(positions.defined() && positions.dim() == 2 && positions.scalar_type() == torch::kInt64,
           "DecodeEvictor::select: positions must be int64 [KV, n]");
  const int64_t kv = positions.size(0), n = positions.size(1);
  const int64_t target = target_count();
  if (n <= target) return position_range(kv, 0, n, positions.device());

  // Base score: higher = keep, fp32 [KV, n].
  torch::Tensor s;
  switch (cfg_.scorer) {
    case ScorerKind::kKeyNorm:
      KV_CHECK(keys.defined() && keys.dim() == 3 && keys.size(0) == kv && keys.size(1) == n,
               "DecodeEvictor::select: key_norm needs keys [" << kv << ", " << n << ", D]");
      s = torch::linalg_vector_norm(keys, 2, {-1}, false, torch::kFloat32).neg();
      break;
    case ScorerKind::kAccumulatedAttention:
      KV_CHECK(scores.defined() && scores.dim() == 2 && scores.size(0) == kv && scores.size(1) == n,
               "DecodeEvictor::select: accumulated_attention needs scores [" << kv << ", " << n << "]");
      s = scores.to(torch::kFloat32);
      break;
    default:  // sink_recent: recency by original position
      s = positions.to(torch::kFloat32);
      break;
  }
  // Protected slots: the `window` most recent positions per head, and the first `sink` positions.
  auto protect = torch::zeros({kv, n}, positions.options().dtype(torch::kBool));
  if (cfg_.window > 0) {
    const int64_t w = std::min(cfg_.window, n);
    auto recent = std::get<1>(torch::topk(positions, w, 1, /*largest=*/true));
    protect.scatter_(1, recent, true);
  }
  if (cfg_.scorer == ScorerKind::kSinkRecent && cfg_.sink > 0) protect.logical_or_(positions < cfg_.sink);
  const auto inf = std::numeric_limits<float>::infinity();
  s = s.masked_fill(protect, inf);
  return stable_top_positions(s, target);
}

}  // namespace kvserve
