#include "policies/token_scorer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/check.h"

namespace kvserve {

namespace {

void check_qk(const torch::Tensor& q, const torch::Tensor& k, const char* who) {
  KV_CHECK(k.defined() && k.dim() == 3, who << ": keys must be [KV, T, D], got " << (k.defined() ? k.sizes() : at::IntArrayRef{}));
  KV_CHECK(q.defined() && q.dim() == 3, who << ": queries must be [H, T, D], got " << (q.defined() ? q.sizes() : at::IntArrayRef{}));
  KV_CHECK(q.size(2) == k.size(2), who << ": head_dim differs: q " << q.sizes() << " vs k " << k.sizes());
  KV_CHECK(q.size(0) % k.size(0) == 0,
           who << ": query heads " << q.size(0) << " not a multiple of KV heads " << k.size(0));
  KV_CHECK(q.device() == k.device(), who << ": q and k on different devices");
}

// Pools [rows, N] along N per row with stride 1, padding kernel/2 (odd kernel keeps the length).
torch::Tensor pool_rows(const torch::Tensor& x, int64_t kernel, PoolingKind pooling) {
  if (kernel <= 1) return x;
  auto in = x.unsqueeze(1);  // [rows, 1, N]
  torch::Tensor out;
  if (pooling == PoolingKind::kMax) {
    out = torch::max_pool1d(in, {kernel}, {1}, {kernel / 2});
  } else {
    out = torch::avg_pool1d(in, {kernel}, {1}, {kernel / 2}, /*ceil_mode=*/false, /*count_include_pad=*/true);
  }
  return out.squeeze(1);
}

}  // namespace

bool scorer_needs_queries(ScorerKind s) {
  return s == ScorerKind::kWindowAttention || s == ScorerKind::kAccumulatedAttention;
}

torch::Tensor window_attention_scores(const torch::Tensor& q, const torch::Tensor& k, int64_t window, int64_t kernel,
                                      PoolingKind pooling, bool mean_over_window) {
  auto per_head = window_attention_head_scores(q, k, window, kernel, pooling, mean_over_window);
  const int64_t kv = k.size(0);
  return per_head.view({kv, per_head.size(0) / kv, per_head.size(1)}).mean(1);
}

torch::Tensor window_attention_head_scores(const torch::Tensor& q, const torch::Tensor& k, int64_t window,
                                           int64_t kernel, PoolingKind pooling, bool mean_over_window) {
  check_qk(q, k, "window_attention_scores");
  const int64_t kv = k.size(0), t = k.size(1), d = k.size(2), h = q.size(0), g = h / kv;
  KV_CHECK(window >= 1 && window < t, "window_attention_scores: window " << window << " must be in [1, " << t << ")");
  KV_CHECK(q.size(1) >= window, "window_attention_scores: need the last " << window << " queries, got " << q.size(1));
  KV_CHECK(kernel >= 1 && kernel % 2 == 1, "window_attention_scores: kernel must be odd, got " << kernel);
  const int64_t n = t - window;
  // [KV, G*w, D] x [KV, D, T]: the query heads of a KV head share its keys (no repeat_kv copy).
  auto qw = q.narrow(1, q.size(1) - window, window).to(torch::kFloat32).reshape({kv, g * window, d});
  auto kf = k.to(torch::kFloat32);
  auto logits = torch::bmm(qw, kf.transpose(1, 2)).mul_(1.0 / std::sqrt(static_cast<double>(d)));
  logits = logits.view({kv, g, window, t});
  // Causal inside the window: window query i (position n + i) sees keys <= n + i.
  auto rows = torch::arange(window, k.options().dtype(torch::kInt64)).view({window, 1});
  auto cols = torch::arange(window, k.options().dtype(torch::kInt64)).view({1, window});
  auto future = (cols > rows);  // [w, w]
  logits.narrow(3, n, window).masked_fill_(future, -std::numeric_limits<float>::infinity());
  auto probs = torch::softmax(logits, 3).narrow(3, 0, n);  // [KV, G, w, n]
  auto per_head = mean_over_window ? probs.mean(2) : probs.sum(2);  // [KV, G, n]
  return pool_rows(per_head.reshape({kv * g, n}), kernel, pooling);  // [H, n]
}

torch::Tensor accumulated_attention_scores(const torch::Tensor& q, const torch::Tensor& k, int64_t window,
                                           int64_t query_chunk) {
  check_qk(q, k, "accumulated_attention_scores");
  const int64_t kv = k.size(0), t = k.size(1), d = k.size(2), h = q.size(0), g = h / kv;
  KV_CHECK(q.size(1) == t, "accumulated_attention_scores: needs every query: q " << q.sizes() << " vs k " << k.sizes());
  KV_CHECK(window >= 0 && window < t, "accumulated_attention_scores: window " << window << " must be < " << t);
  if (query_chunk <= 0) {
    // Keep one chunk's probabilities near 16M floats.
    query_chunk = std::clamp<int64_t>((int64_t{1} << 24) / std::max<int64_t>(1, h * t), 1, t);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto kf = k.to(torch::kFloat32);
  auto qf = q.to(torch::kFloat32).view({kv, g, t, d});
  auto acc = torch::zeros({kv, g, t}, kf.options());
  auto idx_opts = k.options().dtype(torch::kInt64);
  for (int64_t i0 = 0; i0 < t; i0 += query_chunk) {
    const int64_t c = std::min(query_chunk, t - i0);
    const int64_t visible = i0 + c;  // keys [0, visible) can be seen by this chunk
    auto qc = qf.narrow(2, i0, c).reshape({kv, g * c, d});
    auto logits = torch::bmm(qc, kf.narrow(1, 0, visible).transpose(1, 2)).mul_(scale).view({kv, g, c, visible});
    auto rows = torch::arange(i0, i0 + c, idx_opts).view({c, 1});
    auto cols = torch::arange(visible, idx_opts).view({1, visible});
    logits.masked_fill_(cols > rows, -std::numeric_limits<float>::infinity());
    acc.narrow(2, 0, visible).add_(torch::softmax(logits, 3).sum(2));
  }
  auto counts = torch::arange(t, 0, -1, kf.options());  // queries that see key j: T - j
  auto scores = (acc / counts).mean(1);                   // [KV, T]
  return scores.narrow(1, 0, t - window).contiguous();
}

torch::Tensor sink_recent_scores(int64_t num_kv_heads, int64_t n, int64_t sink, const torch::Device& device) {
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  // Later positions score higher; sinks score above every non-sink.
  auto s = torch::arange(n, opts).div_(static_cast<double>(std::max<int64_t>(n, 1)));
  if (sink > 0) s.narrow(0, 0, std::min(sink, n)).fill_(2.0);
  return s.unsqueeze(0).expand({num_kv_heads, n}).contiguous();
}

torch::Tensor key_norm_scores(const torch::Tensor& k, int64_t n) {
  KV_CHECK(k.defined() && k.dim() == 3, "key_norm_scores: keys must be [KV, T, D]");
  KV_CHECK(n >= 0 && n <= k.size(1), "key_norm_scores: n=" << n << " outside [0, " << k.size(1) << "]");
  return torch::linalg_vector_norm(k.narrow(1, 0, n), 2, {-1}, false, torch::kFloat32).neg();
}

torch::Tensor random_scores(int64_t num_kv_heads, int64_t n, uint64_t seed, const torch::Device& device) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto s = torch::rand({num_kv_heads, n}, gen, torch::TensorOptions().dtype(torch::kFloat32));
  return s.to(device);
}

torch::Tensor score_tokens(const PolicyConfig& cfg, int64_t layer, const torch::Tensor& q, const torch::Tensor& k) {
  KV_CHECK(k.defined() && k.dim() == 3, "score_tokens: keys must be [KV, T, D]");
  const int64_t kv = k.size(0), t = k.size(1);
  const int64_t n = t - std::min(cfg.window, t);
  switch (cfg.scorer) {
    case ScorerKind::kWindowAttention:
      return window_attention_scores(q, k, cfg.window, cfg.kernel, cfg.pooling, cfg.window_mean());
    case ScorerKind::kAccumulatedAttention:
      return accumulated_attention_scores(q, k, std::min(cfg.window, t));
    case ScorerKind::kSinkRecent:
      return sink_recent_scores(kv, n, cfg.sink, k.device());
    case ScorerKind::kKeyNorm:
      return key_norm_scores(k, n);
    case ScorerKind::kRandom:
      return random_scores(kv, n, cfg.seed + static_cast<uint64_t>(layer) * 1000003ULL, k.device());
    case ScorerKind::kReconstruction:
    case ScorerKind::kPredicted:
      KV_FAIL("score_tokens: policy '" << cfg.name << "' gets its scores (" << to_string(cfg.scorer)
                                       << ") after the prefill, not from the layer's queries and keys");
    case ScorerKind::kNone:
      break;
  }
  KV_FAIL("score_tokens: policy '" << cfg.name << "' has no scorer");
}

}  // namespace kvserve
