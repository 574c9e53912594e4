// kvpress-identical float arithmetic below: no FMA contraction.
#pragma GCC optimize("fp-contract=off")
#include "policies/kvzip_scores.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "common/check.h"
#include "policies/top_select.h"

namespace kvserve {

ReconstructionPlan plan_reconstruction(const PolicyConfig& cfg, int64_t prompt_len, int64_t context_begin) {
  KV_CHECK(prompt_len >= 1, "plan_reconstruction: prompt_len must be >= 1, got " << prompt_len);
  KV_CHECK(cfg.chunk_size >= 1, "plan_reconstruction: chunk_size must be >= 1, got " << cfg.chunk_size);
  ReconstructionPlan p;
  p.end = prompt_len - std::min(cfg.window, prompt_len);
  p.begin = std::clamp<int64_t>(context_begin, 0, p.end);
  p.sink = std::min(cfg.sink, p.end);
  for (int64_t s = p.begin; s < p.end; s += cfg.chunk_size) p.chunks.emplace_back(s, std::min(p.end, s + cfg.chunk_size));
  return p;
}

int64_t score_sink_keys(int64_t sink, int64_t start) { return std::max<int64_t>(0, std::min(sink, start)); }

namespace {

// exp of 8 floats (x <= 0 here: a row minus its maximum), Cephes' expf: a degree-6 polynomial on
// [-ln2/2, ln2/2] times 2^n, within 2 ulp of expf; below -87.3 it gives 0 (std::exp: a denormal),
// which moves a sum of at least 1 by nothing.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, x), x), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// One row's log-sum-exp: the maximum, then the sum of exp(row - max) accumulated in double.
float row_lse(const float* row, int64_t len) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(row + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = *std::max_element(lanes, lanes + 8);
  for (; j < len; ++j) m = std::max(m, row[j]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (j = 0; j + 8 <= len; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mb));
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double dl[4];
  _mm256_store_pd(dl, _mm256_add_pd(s0, s1));
  double sum = (dl[0] + dl[1]) + (dl[2] + dl[3]);
  for (; j < len; ++j) sum += std::exp(row[j] - m);
  return static_cast<float>(static_cast<double>(m) + std::log(sum));
}

// w [G, rows, k] row-major holds query rows q0 .. q0 + rows - 1 of a pass (each head of a group),
// over the keys [sinks and chunk (`visible` columns), own tokens]; query i sees the visible columns
// and its own tokens up to itself (the causal mask: masked columns add exactly 0 to the sum, as
// kvpress's finfo.min does). Per row: lse = log(sum(exp(row))), then
// best[j] = max(best[j], row[first + j] - lse) for j < c. Rows run in parallel, each range of
// them into its own maximum, merged under a lock (a maximum is the same in any order).
void row_max_minus_lse(const float* w, int64_t groups, int64_t rows, int64_t k, int64_t visible, int64_t q0,
                       int64_t first, int64_t c, float* best) {
  std::mutex merge;
  at::parallel_for(0, groups * rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> local(static_cast<size_t>(c), -std::numeric_limits<float>::infinity());
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = w + r * k;
      const int64_t len = std::min(k, visible + q0 + r % rows + 1);
      const float lse = row_lse(row, len);
      const float* col = row + first;
      for (int64_t j = 0; j < c; ++j) local[static_cast<size_t>(j)] = std::max(local[static_cast<size_t>(j)], col[j] - lse);
    }
    const std::lock_guard<std::mutex> lock(merge);
    for (int64_t j = 0; j < c; ++j) best[j] = std::max(best[j], local[static_cast<size_t>(j)]);
  });
}

}  // namespace

torch::Tensor reconstruction_attention_max(const torch::Tensor& q, const torch::Tensor& sink_k, const torch::Tensor& chunk_k,
                                           const torch::Tensor& own_k) {
  KV_CHECK(q.dim() == 3 && own_k.dim() == 3 && chunk_k.dim() == 3 && sink_k.dim() == 3,
           "reconstruction_attention_max: q [H, n, D] and keys [KV, *, D] expected");
  const int64_t H = q.size(0), n = q.size(1), D = q.size(2), KV = own_k.size(0);
  KV_CHECK(KV >= 1 && H % KV == 0 && own_k.size(1) == n && chunk_k.size(0) == KV && sink_k.size(0) == KV &&
               own_k.size(2) == D && chunk_k.size(2) == D && sink_k.size(2) == D,
           "reconstruction_attention_max: q " << q.sizes() << ", sinks " << sink_k.sizes() << ", chunk " << chunk_k.sizes()
                                              << ", own " << own_k.sizes());
  const int64_t G = H / KV, s = sink_k.size(1), c = chunk_k.size(1);
  const auto dt = q.scalar_type();
  // The own part's causal mask, added as kvpress adds it (the dtype's lowest value where masked).
  const double low = dt == torch::kFloat64 ? std::numeric_limits<double>::lowest()
                                           : (dt == torch::kFloat32 ? std::numeric_limits<float>::lowest() : -65504.0);
  auto opts = q.options();
  // fp32 on CPU: a raw loop that stops each row at its causal end (no mask, no softmax written out).
  const bool raw = q.device().is_cpu() && dt == torch::kFloat32;
  torch::Tensor mask;
  if (!raw) mask = torch::zeros({n, n}, opts).masked_fill_(torch::triu(torch::ones({n, n}, opts), 1).to(torch::kBool), low);
  const double scale = std::sqrt(static_cast<double>(D));
  // Queries in tiles, so that a tile's scores [G, rows, s + c + n] stay in cache through the
  // log-sum-exp and the maximum; each tile's maximum is merged into the running one.
  constexpr int64_t kTile = 256;
  auto out = torch::full({KV, c}, -std::numeric_limits<double>::infinity(), opts);
  for (int64_t h = 0; h < KV; ++h) {
    auto keys = torch::cat({sink_k[h], chunk_k[h], own_k[h]}, 0).to(dt).t().contiguous();  // [D, s + c + n]
    auto best = out[h];
    for (int64_t r0 = 0; r0 < n; r0 += kTile) {
      const int64_t rows = std::min(kTile, n - r0);
      auto qh = q.narrow(0, h * G, G).narrow(1, r0, rows);  // [G, rows, D]
      // max_i softmax(w)_ij = exp(max_i (w_ij - lse_i)): the chunk's columns only, no softmax written out.
      if (raw) {
        const int64_t cols = s + c + r0 + rows;  // the tile's last query sees no own token after it
        auto w = torch::matmul(qh, keys.narrow(1, 0, cols)).div_(scale);  // [G, rows, cols]
        row_max_minus_lse(w.data_ptr<float>(), G, rows, cols, s + c, r0, s, c, best.data_ptr<float>());
      } else {
        auto w = torch::matmul(qh, keys).div_(scale);  // [G, rows, s + c + n]
        w.narrow(2, s + c, n).add_(mask.narrow(0, r0, rows));
        auto lse = torch::logsumexp(w, -1, /*keepdim=*/true);  // [G, rows, 1]
        best.copy_(torch::maximum(best, std::get<0>((w.narrow(2, s, c) - lse).amax(1).max(0))));
      }
    }
  }
  out.exp_();
  return out;
}

KvzipScoreBoard::KvzipScoreBoard(int64_t num_layers, int64_t num_kv_heads, int64_t scored, torch::TensorOptions options)
    : scored_(scored) {
  KV_CHECK(num_layers >= 1 && num_kv_heads >= 1 && scored >= 0,
           "KvzipScoreBoard: " << num_layers << " layers, " << num_kv_heads << " KV heads, " << scored << " positions");
  for (int64_t l = 0; l < num_layers; ++l) scores_.push_back(torch::zeros({num_kv_heads, scored}, options));
}

void KvzipScoreBoard::record(int64_t layer, int64_t start, const torch::Tensor& chunk_scores) {
  KV_CHECK(layer >= 0 && layer < num_layers(), "KvzipScoreBoard::record: layer " << layer << " outside [0, " << num_layers() << ")");
  auto& s = scores_[static_cast<size_t>(layer)];
  KV_CHECK(chunk_scores.dim() == 2 && chunk_scores.size(0) == s.size(0) && start >= 0 &&
               start + chunk_scores.size(1) <= scored_,
           "KvzipScoreBoard::record: scores " << chunk_scores.sizes() << " at " << start << " outside [" << s.size(0) << ", "
                                              << scored_ << "]");
  auto dst = s.narrow(1, start, chunk_scores.size(1));
  dst.copy_(torch::maximum(dst, chunk_scores.to(s.scalar_type())));
}

void protect_sinks(std::vector<torch::Tensor>& scores, int64_t sink) {
  if (scores.empty()) return;
  const int64_t n = std::min(sink, scores[0].size(1));
  if (n <= 0) return;
  auto top = scores[0].amax();
  for (const auto& s : scores) top = torch::maximum(top, s.amax());
  top = top + 1.0;
  for (auto& s : scores) s.narrow(1, 0, n).fill_(top);
}

void KvzipScoreBoard::protect_sinks(int64_t sink) { kvserve::protect_sinks(scores_, sink); }

torch::Tensor KvzipScoreBoard::layer_scores(int64_t layer) const {
  KV_CHECK(layer >= 0 && layer < num_layers(), "KvzipScoreBoard: layer " << layer << " outside [0, " << num_layers() << ")");
  return scores_[static_cast<size_t>(layer)].to(torch::kFloat32);
}

int64_t global_kept_total(const PolicyConfig& cfg, int64_t num_layers, int64_t num_kv_heads, int64_t prompt_len) {
  const int64_t w = std::min(cfg.window, prompt_len);
  const int64_t heads = num_layers * num_kv_heads;
  const int64_t scored_max = heads * (prompt_len - w);
  int64_t kept = 0;  // window included
  if (cfg.semantics == Semantics::kKvpress && cfg.budget_ratio > 0.0) {
    const double compression_ratio = 1.0 - cfg.budget_ratio;
    const int64_t n = heads * prompt_len;
    kept = n - static_cast<int64_t>(static_cast<double>(n) * compression_ratio);
  } else {
    kept = heads * cfg.budget_tokens(prompt_len);
  }
  return std::clamp<int64_t>(kept - heads * w, 0, scored_max);
}

std::vector<HeadSelection> global_head_selection(const std::vector<torch::Tensor>& scores, int64_t total, int64_t window,
                                                 int64_t layer_begin, int64_t layers, int64_t head_begin, int64_t heads) {
  KV_CHECK(!scores.empty(), "global_head_selection: no layers");
  const int64_t KV = scores[0].size(0), N = scores[0].size(1), L = static_cast<int64_t>(scores.size());
  for (const auto& s : scores) {
    KV_CHECK(s.dim() == 2 && s.size(0) == KV && s.size(1) == N,
             "global_head_selection: every layer's scores must be [" << KV << ", " << N << "], got " << s.sizes());
  }
  KV_CHECK(total >= 0 && total <= L * KV * N, "global_head_selection: " << total << " kept of " << L * KV * N);
  KV_CHECK(window >= 0, "global_head_selection: negative window " << window);
  if (layers < 0) layers = L - layer_begin;
  if (heads < 0) heads = KV - head_begin;
  KV_CHECK(0 <= layer_begin && layer_begin + layers <= L && 0 <= head_begin && head_begin + heads <= KV,
           "global_head_selection: layers [" << layer_begin << ", +" << layers << ") heads [" << head_begin << ", +"
                                             << heads << ") of " << L << " x " << KV);
  // Layer-major, then head, then position: ties go to the lower (layer, head, position).
  auto flat = torch::stack(scores).to(torch::kFloat32).reshape({1, L * KV * N});
  auto mask = torch::zeros({L * KV * N}, flat.options().dtype(torch::kBool));
  if (total > 0) mask.index_fill_(0, stable_top_positions(flat, total).reshape({-1}), true);
  mask = mask.view({L, KV, N});
  std::vector<HeadSelection> out;
  const int64_t width_all = N + window;
  for (int64_t l = layer_begin; l < layer_begin + layers; ++l) {
    auto kept = mask[l].narrow(0, head_begin, heads);
    if (window > 0) kept = torch::cat({kept, torch::ones({heads, window}, kept.options())}, 1);
    auto counts_t = kept.sum(1).to(torch::kCPU);
    HeadSelection sel;
    sel.counts.assign(counts_t.data_ptr<int64_t>(), counts_t.data_ptr<int64_t>() + heads);
    const int64_t width = *std::max_element(sel.counts.begin(), sel.counts.end());
    // Kept positions first in ascending order, then the dropped ones (padding that indexes validly).
    auto idx = torch::arange(width_all, kept.options().dtype(torch::kInt64)).unsqueeze(0).expand({heads, width_all});
    auto key = torch::where(kept, idx, idx + width_all);
    sel.positions = std::get<0>(torch::sort(key, 1)).narrow(1, 0, width).remainder(width_all).contiguous();
    sel.kept = kept;
    out.push_back(std::move(sel));
  }
  return out;
}

}  // namespace kvserve
