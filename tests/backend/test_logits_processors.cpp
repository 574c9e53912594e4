// logit_bias, allowed_token_ids and bad_words: the batch edit against a per-row loop, the sampler
// applying them (after the logprobs, before sampling), vLLM's bad-word tokenization, and
// prompt_logprobs against a log-softmax of each row.
#include <gtest/gtest.h>

#include <limits>
#include <map>

#include "backend/sampling/logits_processors.h"
#include "backend/sampling/sampler.h"

using namespace kvserve;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The edits as a plain loop over one row: the reference apply_logit_edits is checked against.
std::vector<float> reference_row(std::vector<float> row, const SamplingParams& p, const std::vector<int64_t>& out) {
  const auto V = static_cast<int64_t>(row.size());
  if (!p.allowed_token_ids.empty())
    for (int64_t t = 0; t < V; ++t)
      if (std::find(p.allowed_token_ids.begin(), p.allowed_token_ids.end(), t) == p.allowed_token_ids.end()) row[t] = -kInf;
  for (const auto& [t, b] : p.logit_bias) row[t] += static_cast<float>(b);
  for (const auto& w : p.bad_words_ids) {
    const size_t pre = w.size() - 1;
    if (pre > out.size()) continue;
    bool match = true;
    for (size_t i = 0; i < pre; ++i) match = match && out[out.size() - pre + i] == w[i];
    if (match) row[w.back()] = -kInf;
  }
  return row;
}

}  // namespace

TEST(LogitEdits, BatchEditEqualsThePerRowLoop) {
  const int64_t V = 12;
  torch::manual_seed(3);
  auto l = torch::randn({4, V});
  std::vector<SamplingParams> p(4);
  p[0].logit_bias = {{2, 5.0}, {7, -100.0}};
  p[1].allowed_token_ids = {1, 4, 9};
  p[1].logit_bias = {{4, 1.5}, {5, 50.0}};  // a bias on a masked token leaves it masked
  p[2].bad_words_ids = {{3}, {6, 8}, {6, 9}, {1, 2, 10}};
  p[3].bad_words_ids = {{6, 8}};
  std::vector<std::vector<int64_t>> out = {{}, {5}, {1, 2, 6}, {6, 8}};
  // Row 2: {3} always, {6, 8} and {6, 9} since the output ends with 6, {1, 2, 10} not (ends 2, 6).
  std::vector<LogitEditRow> rows;
  for (int64_t i = 0; i < 4; ++i) rows.push_back({i, &p[i], &out[i]});
  auto edited = l.clone();
  apply_logit_edits(edited, rows);
  for (int64_t i = 0; i < 4; ++i) {
    std::vector<float> row(l[i].data_ptr<float>(), l[i].data_ptr<float>() + V);
    auto want = reference_row(row, p[i], out[i]);
    for (int64_t t = 0; t < V; ++t) EXPECT_EQ(edited[i][t].item<float>(), want[t]) << "row " << i << " token " << t;
  }
  EXPECT_EQ(edited[2][3].item<float>(), -kInf);
  EXPECT_EQ(edited[2][8].item<float>(), -kInf);
  EXPECT_EQ(edited[2][9].item<float>(), -kInf);
  EXPECT_NE(edited[2][10].item<float>(), -kInf);
  EXPECT_NE(edited[3][8].item<float>(), -kInf);  // the output ends with 8, not with 6
  EXPECT_EQ(edited[1][5].item<float>(), -kInf);
}

TEST(LogitEdits, SamplerAppliesThemAfterTheLogprobs) {
  // Greedy would take token 0; the bias moves it to 3, while the logprobs stay the model's.
  auto l = torch::tensor({3.0f, 1.0f, 0.5f, 0.0f});
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 1;
  p.logit_bias = {{3, 10.0}};
  SamplerBank bank;
  bank.add(0, p, {}, 1, {});
  SampledToken t = bank.sample(0, l, false);
  EXPECT_EQ(t.token, 3);
  const double lse = std::log(std::exp(3.0) + std::exp(1.0) + std::exp(0.5) + 1.0);
  EXPECT_NEAR(t.chosen.logprob, 0.0 - lse, 1e-5);
  ASSERT_EQ(t.top.size(), 1u);
  EXPECT_EQ(t.top[0].token_id, 0);

  // allowed_token_ids under temperature: nothing else is ever drawn.
  SamplingParams a;
  a.temperature = 1.5;
  a.allowed_token_ids = {1, 2};
  bank.add(1, a, {}, 7, {});
  for (int i = 0; i < 200; ++i) {
    const int64_t tok = bank.sample(1, l, false).token;
    EXPECT_TRUE(tok == 1 || tok == 2) << tok;
  }
}

TEST(LogitEdits, MultiTokenBadWordIsNeverCompleted) {
  // The bad word {2, 3}: 2 may be sampled; right after it 3 is banned; after another token it is not.
  const auto first = torch::tensor({0.0f, 1.0f, 5.0f, 4.0f}), then = torch::tensor({0.0f, 3.0f, 1.0f, 5.0f});
  SamplingParams p;
  p.temperature = 0;
  p.bad_words_ids = {{2, 3}};
  SamplerBank bank;
  bank.add(0, p, {}, 1, {});
  EXPECT_EQ(bank.sample(0, first, false).token, 2);
  EXPECT_EQ(bank.sample(0, then, false).token, 1);  // 3 would complete the word
  EXPECT_EQ(bank.sample(0, then, false).token, 3);  // the output ends with 1 now
}

TEST(LogitEdits, BadWordsTokenizeAsVllm) {
  // A toy encoder: a leading space merges into the first letter's token (100 + c) when the word
  // starts with 'a', and is its own token (32) otherwise; other characters are their codes.
  auto encode = [](const std::string& s) {
    std::vector<int64_t> ids;
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] == ' ' && i + 1 < s.size() && s[i + 1] == 'a') {
        ids.push_back(100 + s[i + 1]);
        ++i;
      } else {
        ids.push_back(s[i]);
      }
    }
    return ids;
  };
  auto ids = bad_words_token_ids({"  ab", "cd", "\t"}, encode);
  // "ab" plain and " ab" (same length, another first token); "cd" only plain (" cd" is longer).
  EXPECT_EQ(ids, (std::vector<std::vector<int64_t>>{{'a', 'b'}, {100 + 'a', 'b'}, {'c', 'd'}}));
}

TEST(PromptLogprobs, EqualALogSoftmaxOfEachRow) {
  torch::manual_seed(5);
  const int64_t V = 40;
  std::vector<int64_t> tokens = {3, 17, 5, 39, 0, 12};
  auto l = torch::randn({6, V}) * 3;
  auto got = prompt_logprobs(l, tokens, 3);
  ASSERT_EQ(got.size(), 5u);
  auto lp = torch::log_softmax(l.to(torch::kFloat64), 1);
  for (int64_t r = 0; r < 5; ++r) {
    const auto& s = got[r];
    EXPECT_EQ(s.token, tokens[r + 1]);
    EXPECT_NEAR(s.chosen.logprob, lp[r][tokens[r + 1]].item<double>(), 1e-5);
    EXPECT_EQ(s.chosen.rank, (lp[r] > lp[r][tokens[r + 1]]).sum().item<int64_t>() + 1);
    auto [vals, ids] = lp[r].topk(3);
    ASSERT_EQ(s.top.size(), 3u);
    for (int64_t c = 0; c < 3; ++c) {
      EXPECT_EQ(s.top[c].token_id, ids[c].item<int64_t>());
      EXPECT_NEAR(s.top[c].logprob, vals[c].item<double>(), 1e-5);
      EXPECT_EQ(s.top[c].rank, c + 1);
    }
  }
  EXPECT_TRUE(prompt_logprobs(l.narrow(0, 0, 1), {3}, 2).empty());
}
