// Unit tests of the tokenizer: hand-built tokenizer.json files for the mechanics (byte-level
// alphabet, merges, added tokens, decoders, errors) and the fixture tokenizers, when
// $KVSERVE_FIXTURES holds them, for streaming detokenization.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <random>

#include <nlohmann/json.hpp>

#include "common/check.h"
#include "text/tokenizer.h"
#include "text/tokenizer_nfc.h"
#include "text/tokenizer_text.h"

namespace kvserve {
namespace {

using json = nlohmann::json;

// A byte-level vocabulary: the 256 alphabet chars, then the merges' results.
json byte_level_tokenizer() {
  json vocab = json::object();
  int id = 0;
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    // Same construction as GPT-2's bytes_to_unicode, spelled out independently of the library.
    const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    std::string s;
    text::append_utf8(s, keep ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++));
    vocab[s] = id++;
  }
  json merges = json::array();
  for (auto [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"\xC4\xA0", "w"}, {"o", "r"}, {"\xC4\xA0w", "or"}}) {
    vocab[a + b] = id++;
    merges.push_back(json::array({a, b}));
  }
  json tj = {
      {"version", "1.0"},
      {"added_tokens",
       json::array({{{"id", id}, {"content", "<|bos|>"}, {"special", true}, {"normalized", false}},
                    {{"id", id + 1}, {"content", "<|eos|>"}, {"special", true}, {"normalized", false}},
                    {{"id", id + 2}, {"content", "<|eos|>x"}, {"special", false}, {"normalized", false}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Split"},
                       {"pattern", {{"Regex", R"( ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"}}},
                       {"behavior", "Isolated"},
                       {"invert", false}},
                      {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<|bos|>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens", {{"<|bos|>", {{"id", "<|bos|>"}, {"ids", json::array({id})}, {"tokens", json::array({"<|bos|>"})}}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"ignore_merges", false}}}};
  return tj;
}

const json kByteLevelConfig = {{"bos_token", "<|bos|>"}, {"eos_token", {{"content", "<|eos|>"}}},
                               {"add_bos_token", true}, {"chat_template", "{{ messages }}"}};

Tokenizer make(const json& tj, const json& cfg = json::object()) {
  return Tokenizer::from_json(tj.dump(), cfg.dump(), "/fake/tokenizer.json");
}

std::vector<std::string> tokens(const Tokenizer& t, const std::vector<int64_t>& ids) {
  std::vector<std::string> out;
  for (auto id : ids) out.push_back(t.id_to_token(id));
  return out;
}

TEST(TokenizerText, SanitizeReplacesMaximalSubparts) {
  // Python: b"a\xe2\x82b\xff\xf0\x9f\x98".decode("utf-8", "replace") == "a\ufffdb\ufffd\ufffd"
  EXPECT_EQ(text::sanitize_utf8("a\xE2\x82" "b\xFF\xF0\x9F\x98"), "a\xEF\xBF\xBD" "b\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(text::sanitize_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(text::sanitize_utf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");                  // overlong
  EXPECT_TRUE(text::is_valid_utf8("h\xC3\xA9 \xF0\x9F\x98\x80"));
  EXPECT_FALSE(text::is_valid_utf8("\xF0\x9F\x98"));
}

TEST(TokenizerText, OnigClassesRewritten) {
  text::Regex re(R"(\s+|\w+)");
  // U+0085 is whitespace for Oniguruma; combining marks are word characters.
  auto m = re.find_all("a\xC2\x85\xC2\x85" "e\xCC\x81");
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[1], std::make_pair(size_t{1}, size_t{5}));
  EXPECT_EQ(m[2], std::make_pair(size_t{5}, size_t{8}));
  // Oniguruma skips an empty match right after the previous match.
  text::Regex empty("x*");
  EXPECT_EQ(empty.find_all("ab").size(), 3u);
}

TEST(TokenizerNfc, ComposesAndReorders) {
  EXPECT_EQ(text::nfc::to_nfc("e\xCC\x81"), "\xC3\xA9");                          // e + acute -> é
  EXPECT_EQ(text::nfc::to_nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // jamo -> 각
  EXPECT_EQ(text::nfc::to_nfc("q\xCC\x87\xCC\xA3"), "q\xCC\xA3\xCC\x87");         // canonical order
  EXPECT_EQ(text::nfc::to_nfc("\xE2\x84\xA6"), "\xCE\xA9");                        // Ohm sign singleton
  EXPECT_TRUE(text::nfc::is_nfc_quick("plain ascii"));
}

TEST(Tokenizer, ByteLevelMappingAndMerges) {
  const Tokenizer t = make(byte_level_tokenizer(), kByteLevelConfig);
  const auto ids = t.encode("hello world\n", false);
  EXPECT_EQ(tokens(t, ids), (std::vector<std::string>{"hello", "\xC4\xA0wor", "l", "d", "\xC4\x8A"}));
  EXPECT_EQ(t.decode(ids), "hello world\n");
  // Every byte has a token, so arbitrary text (and repaired invalid UTF-8) round-trips.
  const std::string odd = "\t\x01 caf\xC3\xA9 \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD";
  EXPECT_EQ(t.decode(t.encode(odd, false)), odd);
  EXPECT_EQ(t.decode(t.encode("ok\xFF", false)), "ok\xEF\xBF\xBD");
}

TEST(Tokenizer, MergePriorityIsRankThenLeftmost) {
  // "hello": (h,e) rank 0 and (l,l) rank 1 both apply before (he,ll) rank 2, then (hell,o).
  const Tokenizer t = make(byte_level_tokenizer());
  EXPECT_EQ(tokens(t, t.encode("hello", false)), std::vector<std::string>{"hello"});
  EXPECT_EQ(tokens(t, t.encode("hel", false)), (std::vector<std::string>{"he", "l"}));
}

TEST(Tokenizer, AddedTokensSplitFirstLongestWins) {
  const Tokenizer t = make(byte_level_tokenizer(), kByteLevelConfig);
  const auto bos = *t.token_to_id("<|bos|>");
  const auto eos = *t.token_to_id("<|eos|>");
  const auto eosx = *t.token_to_id("<|eos|>x");
  const auto ids = t.encode("hello<|eos|>x<|eos|> <|bos", true);
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids[0], bos);  // the template's bos
  EXPECT_EQ(ids[1], *t.token_to_id("hello"));
  EXPECT_EQ(ids[2], eosx);  // leftmost-longest: "<|eos|>x" beats "<|eos|>"
  EXPECT_EQ(ids[3], eos);
  EXPECT_TRUE(t.is_special(eos));
  EXPECT_FALSE(t.is_special(eosx));
  EXPECT_EQ(t.decode(ids, true), "hello<|eos|>x <|bos");
  EXPECT_EQ(t.decode(ids, false), "<|bos|>hello<|eos|>x<|eos|> <|bos");
}

TEST(Tokenizer, AddedTokenFlags) {
  json tj = byte_level_tokenizer();
  tj["added_tokens"][1]["lstrip"] = true;
  tj["added_tokens"][1]["rstrip"] = true;
  tj["added_tokens"][2]["single_word"] = true;
  const Tokenizer t = make(tj);
  const auto eos = *t.token_to_id("<|eos|>");
  EXPECT_EQ(t.encode("hello  <|eos|>  hello", false),
            (std::vector<int64_t>{*t.token_to_id("hello"), eos, *t.token_to_id("hello")}));
  // single_word: "<|eos|>x" inside a word is not the added token.
  const auto ids = t.encode("a<|eos|>xb", false);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *t.token_to_id("<|eos|>x")), 0);
}

TEST(Tokenizer, ConfigAccessors) {
  const Tokenizer t = make(byte_level_tokenizer(), kByteLevelConfig);
  EXPECT_EQ(t.bos_token(), "<|bos|>");
  EXPECT_EQ(t.eos_token(), "<|eos|>");
  EXPECT_EQ(t.bos_id(), t.token_to_id("<|bos|>"));
  EXPECT_EQ(t.eos_id(), t.token_to_id("<|eos|>"));
  EXPECT_TRUE(t.add_bos_token());
  EXPECT_EQ(t.chat_template(), "{{ messages }}");
  EXPECT_EQ(t.vocab_size(), 256 + 7 + 3);
  EXPECT_EQ(t.id_to_token(100000), "");
  EXPECT_EQ(t.decode({-5, 100000}), "");
}

TEST(Tokenizer, NoPostProcessorFallsBackToAddBos) {
  json tj = byte_level_tokenizer();
  tj["post_processor"] = nullptr;
  const Tokenizer t = make(tj, kByteLevelConfig);
  EXPECT_EQ(t.encode("hello").front(), *t.bos_id());
  EXPECT_EQ(t.encode("hello", false).size(), 1u);
}

// A SentencePiece-style tokenizer in Llama-2's tokenizer.json form.
json metaspace_tokenizer() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  int id = 3;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = id++;
  }
  json merges = json::array();
  for (std::string c : {"\xE2\x96\x81", "h", "i", "a"}) vocab[c] = id++;
  for (auto [a, b] : std::vector<std::pair<std::string, std::string>>{{"\xE2\x96\x81", "h"}, {"\xE2\x96\x81h", "i"}}) {
    vocab[a + b] = id++;
    merges.push_back(a + " " + b);  // the older "a b" merge format
  }
  return {{"added_tokens",
           json::array({{{"id", 0}, {"content", "<unk>"}, {"special", true}, {"normalized", false}},
                        {{"id", 1}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
                        {{"id", 2}, {"content", "</s>"}, {"special", true}, {"normalized", false}}})},
          {"normalizer",
           {{"type", "Sequence"},
            {"normalizers", json::array({{{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}},
                                         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xE2\x96\x81"}}})}}},
          {"pre_tokenizer", nullptr},
          {"post_processor", nullptr},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
                                      {{"type", "ByteFallback"}},
                                      {{"type", "Fuse"}},
                                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
          {"model",
           {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"unk_token", "<unk>"}, {"fuse_unk", true},
            {"byte_fallback", true}}}};
}

TEST(Tokenizer, SentencePieceByteFallback) {
  const Tokenizer t = make(metaspace_tokenizer(), {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"add_bos_token", true}});
  const auto ids = t.encode("hi ha\xC3\xA9");
  EXPECT_EQ(tokens(t, ids), (std::vector<std::string>{"<s>", "\xE2\x96\x81hi", "\xE2\x96\x81h", "a", "<0xC3>", "<0xA9>"}));
  EXPECT_EQ(t.decode(ids, true), "hi ha\xC3\xA9");
  // A lone continuation byte decodes to U+FFFD per byte, as HF's ByteFallback does.
  EXPECT_EQ(t.decode({*t.token_to_id("h"), *t.token_to_id("<0xA9>"), *t.token_to_id("<0xA9>")}),
            "h\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(Tokenizer, MalformedFilesNameFileAndKey) {
  auto expect_error = [](const std::string& tj, const std::string& needle) {
    try {
      Tokenizer::from_json(tj, "{}", "/m/tokenizer.json");
      ADD_FAILURE() << "no error for " << tj;
    } catch (const KvError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("/m/tokenizer.json"), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
  };
  expect_error("{not json", "malformed JSON");
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}}})", "model.merges");
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": "x"}, "merges": []}})", "model.vocab");
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})", "model.merges[0]");
  expect_error(R"({"model": {"type": "Unigram", "vocab": []}})", "model");
  expect_error(R"({"model": {"type": "BPE", "vocab": {}, "merges": []}, "pre_tokenizer": {"type": "Split"}})",
               "pre_tokenizer");
  expect_error(R"({"model": {"type": "BPE", "vocab": {}, "merges": []}, "decoder": {"type": "Nope"}})", "decoder");
  // Found by fuzz/tokenizer_load: a single huge id made loading allocate a slot per id (30 GB).
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1879048192}, "merges": []}})",
               "key 'model.vocab' has id 1879048192 but only 2 tokens");
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},)"
               R"( "added_tokens": [{"id": 4611686018427387904, "content": "<x>"}]})",
               "added_tokens[0].id");
  try {
    Tokenizer::from_json(R"({"model": {"type": "BPE", "vocab": {}, "merges": []}})", R"({"bos_token": 3})",
                         "/m/tokenizer.json");
    ADD_FAILURE();
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("/m/tokenizer_config.json"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tokenizer::from_dir("/nonexistent/dir"), KvError);
}

// The concatenation of streamed pieces equals decode(all), and every piece is valid UTF-8.
void check_stream(const Tokenizer& t, const std::vector<int64_t>& ids, bool skip_special) {
  IncrementalDetokenizer d(t, skip_special);
  std::string all;
  for (auto id : ids) {
    const std::string piece = d.add(id);
    ASSERT_TRUE(text::is_valid_utf8(piece));
    all += piece;
  }
  const std::string rest = d.flush();
  ASSERT_TRUE(text::is_valid_utf8(rest));
  all += rest;
  ASSERT_EQ(all, t.decode(ids, skip_special));
}

TEST(IncrementalDetokenizer, HoldsBackSplitCharacters) {
  const Tokenizer t = make(byte_level_tokenizer(), kByteLevelConfig);
  const auto ids = t.encode("a \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD!", false);  // emoji as 8 byte tokens
  IncrementalDetokenizer d(t);
  std::vector<std::string> pieces;
  for (auto id : ids) pieces.push_back(d.add(id));
  pieces.push_back(d.flush());
  std::string all;
  for (auto& p : pieces) {
    EXPECT_TRUE(text::is_valid_utf8(p)) << p;
    EXPECT_EQ(p.find("\xEF\xBF\xBD"), std::string::npos);
    all += p;
  }
  EXPECT_EQ(all, "a \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD!");
  check_stream(t, ids, false);
  // A byte that never completes comes out as U+FFFD at flush, like decode().
  check_stream(t, {*t.token_to_id("h"), t.encode("\xC3\xA9", false)[0]}, false);
}

TEST(IncrementalDetokenizer, ContextIsNotReturned) {
  const Tokenizer t = make(metaspace_tokenizer());
  const auto prompt = t.encode("hi", false);
  IncrementalDetokenizer d(t, false, prompt);
  std::string out = d.add(t.encode("hi", false));
  out += d.flush();
  EXPECT_EQ(out, " hi");  // the generated token's leading space survives
}

std::filesystem::path fixture(const std::string& name) {
  const char* env = std::getenv("KVSERVE_FIXTURES");
  if (!env) return {};
  auto p = std::filesystem::path(env) / "tokenizers" / name;
  return std::filesystem::exists(p / "tokenizer.json") ? p : std::filesystem::path{};
}

class FixtureTokenizer : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureTokenizer, StreamingEqualsDecodeOnTextAndRandomIds) {
  const auto dir = fixture(GetParam());
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/tokenizers/" << GetParam();
  const Tokenizer t = Tokenizer::from_dir(dir.string());
  const std::vector<std::string> texts = {
      "Hello, world! It's 2024.",
      "  leading spaces\tand\ttabs   ",
      "\xE6\x95\xB0\xE6\x8D\xAE \xD9\x85\xD8\xB1\xD8\xAD\xD8\xA8\xD8\xA7 \xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9"
      "\xE2\x80\x8D\xF0\x9F\x91\xA7 \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD",
      "code:\n    return x + 1\n\n",
      "\x01\x1b[0m \xC2\x85 \xEF\xBB\xBF end"};
  for (const auto& s : texts) {
    SCOPED_TRACE(s);
    const auto ids = t.encode(s, true);
    check_stream(t, ids, false);
    check_stream(t, ids, true);
  }
  std::mt19937 rng(42);
  std::uniform_int_distribution<int64_t> pick(0, t.vocab_size() - 1);
  for (int k = 0; k < 300; ++k) {
    std::vector<int64_t> ids(rng() % 40);
    for (auto& id : ids) id = pick(rng);
    SCOPED_TRACE(::testing::PrintToString(ids));
    check_stream(t, ids, k % 2 == 0);
  }
}

TEST_P(FixtureTokenizer, ConfigIsRead) {
  const auto dir = fixture(GetParam());
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/tokenizers/" << GetParam();
  const Tokenizer t = Tokenizer::from_dir(dir.string());
  EXPECT_FALSE(t.chat_template().empty());
  ASSERT_TRUE(t.eos_id().has_value());
  EXPECT_TRUE(t.is_special(*t.eos_id()));
  if (t.add_bos_token()) {
    EXPECT_EQ(t.encode("x").front(), *t.bos_id());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureTokenizer, ::testing::Values("bytelevel", "metaspace", "metaspace_pt", "qwen2"));

}  // namespace
}  // namespace kvserve
