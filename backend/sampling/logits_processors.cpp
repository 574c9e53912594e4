// logit_bias, allowed_token_ids and bad_words on a batch of logits.
#include "backend/sampling/logits_processors.h"

#include <algorithm>
#include <limits>

namespace kvserve {

bool has_logit_edits(const SamplingParams& p) {
  return !p.logit_bias.empty() || !p.allowed_token_ids.empty() || !p.bad_words_ids.empty();
}

namespace {

torch::Tensor on(const std::vector<int64_t>& v, const torch::Device& device) {
  return torch::tensor(v, torch::TensorOptions().dtype(torch::kInt64)).to(device);
}

}  // namespace

void apply_logit_edits(torch::Tensor& l, const std::vector<LogitEditRow>& rows) {
  if (rows.empty()) return;
  const int64_t V = l.size(1);
  const torch::Device device = l.device();
  // Host side: flat indices into the logits (row * V + token), so that each edit is one device op.
  std::vector<int64_t> allow_rows, allow_at, bias_at, banned_at;
  std::vector<float> bias;
  for (const auto& r : rows) {
    const SamplingParams& p = *r.params;
    if (!p.allowed_token_ids.empty()) {
      const int64_t a = static_cast<int64_t>(allow_rows.size());
      allow_rows.push_back(r.row);
      for (int64_t t : p.allowed_token_ids)
        if (t >= 0 && t < V) allow_at.push_back(a * V + t);
    }
    for (const auto& [t, b] : p.logit_bias) {
      if (t < 0 || t >= V) continue;
      bias_at.push_back(r.row * V + t);
      bias.push_back(static_cast<float>(b));
    }
    const std::vector<int64_t>& out = *r.output;
    for (const auto& w : p.bad_words_ids) {
      if (w.empty() || w.back() < 0 || w.back() >= V) continue;
      const size_t before = w.size() - 1;  // tokens that must end the output
      if (before > out.size()) continue;
      if (std::equal(w.begin(), w.end() - 1, out.end() - static_cast<std::ptrdiff_t>(before)))
        banned_at.push_back(r.row * V + w.back());
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  if (!allow_rows.empty()) {
    const auto idx = on(allow_rows, device);
    auto keep = torch::zeros({static_cast<int64_t>(allow_rows.size()), V}, torch::TensorOptions().dtype(torch::kBool).device(device));
    if (!allow_at.empty()) keep.view(-1).index_fill_(0, on(allow_at, device), true);
    l.index_copy_(0, idx, l.index_select(0, idx).masked_fill_(keep.logical_not(), -inf));
  }
  if (!bias_at.empty())
    l.view(-1).index_add_(0, on(bias_at, device), torch::tensor(bias, torch::TensorOptions().dtype(torch::kFloat32)).to(device));
  if (!banned_at.empty()) l.view(-1).index_fill_(0, on(banned_at, device), -inf);
}

std::vector<std::vector<int64_t>> bad_words_token_ids(
    const std::vector<std::string>& words, const std::function<std::vector<int64_t>(const std::string&)>& encode) {
  std::vector<std::vector<int64_t>> out;
  for (const auto& word : words) {
    const std::string bare = word.substr(std::min(word.find_first_not_of(" \t\n\r\f\v"), word.size()));
    std::vector<int64_t> plain = encode(bare);
    if (plain.empty()) continue;
    std::vector<int64_t> spaced = encode(" " + bare);
    out.push_back(plain);
    if (!spaced.empty() && spaced.size() == plain.size() && spaced.front() != plain.front()) out.push_back(std::move(spaced));
  }
  return out;
}

}  // namespace kvserve
