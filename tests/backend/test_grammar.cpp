// Grammar-constrained sampling (GrammarCompiler + GrammarMasks inside SamplerBank) over the fixture
// tokenizers (byte-level, byte fallback, Metaspace): the tokenizer's own encoding of a matching
// text is accepted token by token, sampling from random logits always yields text the grammar
// matches, a completed grammar allows only the stop tokens, and bad specs name their field.
#include <gtest/gtest.h>
#include <xgrammar/xgrammar.h>

#include <nlohmann/json.hpp>

#include <random>
#include <regex>

#include "backend/sampling/grammar_compiler.h"
#include "backend/sampling/sampler.h"
#include "tests/support/fixture_models.h"
#include "text/tokenizer.h"

namespace kvserve {
namespace {

using Kind = StructuredOutputSpec::Kind;

StructuredOutputSpec spec(Kind k, std::string text, std::vector<std::string> choices = {}) {
  StructuredOutputSpec s;
  s.kind = k, s.text = std::move(text), s.choices = std::move(choices), s.field = "guided_test";
  return s;
}

class GrammarTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string dir = test::fixture(GetParam());
    if (dir.empty()) GTEST_SKIP() << "fixture " << GetParam() << " missing (make fixtures)";
    tok_ = std::make_unique<Tokenizer>(Tokenizer::from_dir(dir));
    eos_ = tok_->eos_id().value_or(0);
    // Three ids past the tokenizer's: a model's padded embedding rows, never allowed.
    vocab_ = tok_->vocab_size() + 3;
    compiler_ = std::make_unique<GrammarCompiler>(*tok_, vocab_, std::vector<int64_t>{eos_});
  }

  // Samples up to `max` tokens for one sequence from seeded random logits under `g`.
  std::vector<int64_t> run(const std::shared_ptr<const StructuredGrammar>& g, uint64_t seed, int max, bool& stopped,
                           double temperature = 1.0) {
    SamplerBank bank;
    SamplingParams p;
    p.temperature = temperature;
    p.grammar = g;
    bank.add(7, p, {}, seed, {eos_});
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> N(0.f, 3.f);
    std::vector<int64_t> out;
    stopped = false;
    for (int i = 0; i < max; ++i) {
      std::vector<float> l(static_cast<size_t>(vocab_));
      for (auto& x : l) x = N(rng);
      const auto s = bank.sample(7, torch::tensor(l), false);
      EXPECT_FALSE(s.grammar_dead_end);
      if (s.token == eos_) {
        stopped = true;
        break;
      }
      out.push_back(s.token);
    }
    return out;
  }

  std::unique_ptr<Tokenizer> tok_;
  int64_t eos_ = 0, vocab_ = 0;
  std::unique_ptr<GrammarCompiler> compiler_;
};

TEST_P(GrammarTest, TokenizersOwnEncodingIsAccepted) {
  // The matcher reads each token's bytes from the vocabulary as the tokenizer decodes them.
  const std::string text = "hello world 42";
  const auto g = compiler_->compile(spec(Kind::kRegex, " ?hello world [0-9]+"));
  xgrammar::GrammarMatcher m(*g->compiled);
  for (int64_t t : tok_->encode(text, /*add_special_tokens=*/false))
    ASSERT_TRUE(m.AcceptToken(static_cast<int32_t>(t))) << "token " << t << " '" << tok_->id_to_token(t) << "'";
  EXPECT_TRUE(m.AcceptToken(static_cast<int32_t>(eos_)));
  EXPECT_TRUE(m.IsTerminated());
}

TEST_P(GrammarTest, SampledChoiceIsOneOfTheChoices) {
  const std::vector<std::string> choices = {"red", "green", "blue and \"quoted\""};
  const auto g = compiler_->compile(spec(Kind::kChoice, "", choices));
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    bool stopped = false;
    const auto ids = run(g, seed, 64, stopped);
    ASSERT_TRUE(stopped) << "seed " << seed;
    const std::string text = tok_->decode(ids);
    EXPECT_NE(std::find(choices.begin(), choices.end(), text), choices.end()) << "'" << text << "'";
  }
}

TEST_P(GrammarTest, SampledRegexMatches) {
  const std::string re = "[0-9]{3}-[a-z]{2,4}";
  const auto g = compiler_->compile(spec(Kind::kRegex, re));
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    bool stopped = false;
    const auto ids = run(g, seed, 64, stopped);
    ASSERT_TRUE(stopped);
    EXPECT_TRUE(std::regex_match(tok_->decode(ids), std::regex(re))) << tok_->decode(ids);
  }
}

TEST_P(GrammarTest, SampledJsonFollowsTheSchema) {
  const auto g = compiler_->compile(spec(
      Kind::kJsonSchema,
      R"({"type":"object","properties":{"ok":{"type":"boolean"},"n":{"type":"integer","minimum":0,"maximum":9},)"
      R"("tag":{"enum":["a","b"]}},"required":["ok","n","tag"]})"));
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    bool stopped = false;
    const auto ids = run(g, seed, 200, stopped, /*temperature=*/0.0);
    ASSERT_TRUE(stopped);
    const auto j = nlohmann::json::parse(tok_->decode(ids));
    EXPECT_TRUE(j["ok"].is_boolean());
    EXPECT_GE(j["n"].get<int>(), 0);
    EXPECT_LE(j["n"].get<int>(), 9);
    EXPECT_TRUE(j["tag"] == "a" || j["tag"] == "b");
  }
}

TEST_P(GrammarTest, CompletedGrammarWithEosBannedIsADeadEnd) {
  const auto g = compiler_->compile(spec(Kind::kChoice, "", {"x"}));
  SamplerBank bank;
  SamplingParams p;
  p.temperature = 0;
  p.grammar = g;
  bank.add(1, p, {}, 1, {eos_});
  SamplingParams free;
  free.temperature = 0;
  bank.add(2, free, {}, 1, {eos_});  // an unconstrained neighbour in the same batch
  auto l = torch::zeros({2, vocab_});
  auto out = bank.sample_batch({1, 2}, l, {0, 0});
  EXPECT_EQ(tok_->decode({out[0].token}), "x");
  EXPECT_FALSE(out[0].grammar_dead_end);
  out = bank.sample_batch({1, 2}, l, {1, 0});  // min_tokens not reached: EOS banned, nothing left
  EXPECT_TRUE(out[0].grammar_dead_end);
  EXPECT_FALSE(out[1].grammar_dead_end);
  EXPECT_EQ(out[1].token, 0);  // the neighbour's row is untouched: argmax of zeros
}

TEST_P(GrammarTest, BadSpecsNameTheirField) {
  for (const auto& s : {spec(Kind::kJsonSchema, "{not json"), spec(Kind::kJsonSchema, R"({"type": "no-such-type"})"),
                        spec(Kind::kRegex, "(unclosed"), spec(Kind::kGrammar, "root ::= ")}) {
    try {
      compiler_->compile(s);
      ADD_FAILURE() << "compiled: " << s.text;
    } catch (const GrammarError& e) {
      EXPECT_EQ(e.field(), "guided_test");
      EXPECT_FALSE(std::string(e.what()).empty());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, GrammarTest, ::testing::Values("llama-gqa", "llama-tied", "mistral", "qwen2-bias"),
                         test::fixture_param_name);

TEST(ChoiceGrammar, EscapesQuotesBackslashesAndControlBytes) {
  EXPECT_EQ(choice_grammar({"a\"b", "c\\d", "e\nf"}), "root ::= \"a\\\"b\" | \"c\\\\d\" | \"e\\u000af\"\n");
}

}  // namespace
}  // namespace kvserve
