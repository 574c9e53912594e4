#include "backend/quantization/gguf_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <tuple>
#include <unordered_map>

#include "backend/quantization/gguf_file.h"
#include "common/check.h"

namespace kvserve {

namespace {

// Keys sorted (std::map): an ordered_json object finds a key by scanning, which made a 49K-token
// vocabulary quadratic; Tokenizer::from_json reads the keys in any order.
using json = nlohmann::json;

// llama.cpp's LLAMA_TOKEN_TYPE_*: how a vocabulary entry takes part in tokenizing.
constexpr int64_t kGgufTokenNormal = 1;       // a piece BPE may merge into
constexpr int64_t kGgufTokenControl = 3;      // <|im_start|>, <bos> and the like
constexpr int64_t kGgufTokenUserDefined = 4;  // matched whole before BPE (Gemma's runs of newlines)

json byte_level(bool add_prefix_space, bool trim_offsets) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", add_prefix_space}, {"trim_offsets", trim_offsets},
          {"use_regex", true}};
}

// tokenizer.ggml.pre -> the pre-tokenizer it stands for. Only names checked against a reference
// tokenizer are here: "smollm" (llama.cpp splits every digit, then applies GPT-2's regex; SmolLM2's
// own tokenizer.json says Digits + ByteLevel), tested against the `tokenizers` library.
json pre_tokenizer(const std::string& pre, const std::string& where) {
  if (pre == "smollm")
    return {{"type", "Sequence"},
            {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}}, byte_level(false, true)})}};
  KV_FAIL(where << ": tokenizer.ggml.pre is '" << pre
                << "'; kvserve builds a tokenizer from GGUF metadata only for 'smollm' so far: pass the model's "
                   "Hugging Face tokenizer directory with --tokenizer (model.tokenizer)");
}

// The special-token names of the metadata's *_token_id keys, for tokenizer_config.json.
json token_name(const GgufFile& f, const std::vector<std::string>& tokens, const std::string& key) {
  const auto id = f.get_int(key);
  if (!id) return nullptr;
  KV_CHECK(*id >= 0 && *id < static_cast<int64_t>(tokens.size()),
           f.path() << ": " << key << " = " << *id << " is outside the vocabulary of " << tokens.size());
  return tokens[static_cast<size_t>(*id)];
}

json added_token(size_t id, const std::string& content, bool special) {
  return {{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
          {"normalized", false}, {"special", special}};
}

// tokenizer.json's BPE model; a SentencePiece vocabulary adds an unknown token and byte fallback.
json bpe_model(json vocab, json merges, json unk, bool byte_fallback) {
  return {{"type", "BPE"},
          {"dropout", nullptr},
          {"unk_token", std::move(unk)},
          {"continuing_subword_prefix", nullptr},
          {"end_of_word_suffix", nullptr},
          {"fuse_unk", byte_fallback},
          {"byte_fallback", byte_fallback},
          {"ignore_merges", false},
          {"vocab", std::move(vocab)},
          {"merges", std::move(merges)}};
}

// tokenizer_config.json: the special tokens the metadata names, the context length and the chat template.
std::string tokenizer_config(const GgufFile& f, const std::vector<std::string>& tokens, bool add_bos) {
  json cfg = {{"tokenizer_class", "PreTrainedTokenizerFast"},
              {"add_bos_token", add_bos},
              {"add_eos_token", false},
              {"add_prefix_space", false},
              {"bos_token", token_name(f, tokens, "tokenizer.ggml.bos_token_id")},
              {"eos_token", token_name(f, tokens, "tokenizer.ggml.eos_token_id")},
              {"pad_token", token_name(f, tokens, "tokenizer.ggml.padding_token_id")},
              {"unk_token", token_name(f, tokens, "tokenizer.ggml.unknown_token_id")},
              {"clean_up_tokenization_spaces", false}};
  if (const auto n = f.get_int(f.architecture() + ".context_length")) cfg["model_max_length"] = *n;
  if (const auto t = f.get_string("tokenizer.chat_template")) cfg["chat_template"] = *t;
  return cfg.dump();
}

// Byte offsets where a UTF-8 string's code points start after the first (the places a piece splits).
std::vector<size_t> code_point_splits(const std::string& s) {
  std::vector<size_t> at;
  for (size_t i = 1; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) at.push_back(i);
  return at;
}

// A SentencePiece vocabulary ("llama": pieces with scores, "\u2581" for a space, <0xXX> byte
// pieces) as the BPE model Hugging Face's converters make of it: every split of a normal piece into
// two pieces of the vocabulary is a merge, ranked by the merged piece's score (best first), so BPE
// joins the best-scored piece first as SentencePiece does; unknown text falls back to byte pieces.
GgufTokenizerFiles sentencepiece_files(const GgufFile& f) {
  const std::string& where = f.path();
  KV_CHECK(f.get_int("tokenizer.ggml.add_space_prefix").value_or(0) == 0,
           where << ": tokenizer.ggml.add_space_prefix is set; kvserve builds SentencePiece tokenizers without a "
                    "space prefix (Gemma's) from GGUF metadata: pass the model's tokenizer directory with --tokenizer");
  const std::vector<std::string> tokens = f.get_strings("tokenizer.ggml.tokens");
  const std::vector<double> scores = f.get_floats("tokenizer.ggml.scores");
  const std::vector<int64_t> types = f.get_ints("tokenizer.ggml.token_type");
  KV_CHECK(!tokens.empty(), where << ": tokenizer.ggml.tokens is empty");
  KV_CHECK(scores.size() == tokens.size(),
           where << ": tokenizer.ggml.scores has " << scores.size() << " entries for " << tokens.size() << " tokens");
  KV_CHECK(types.size() == tokens.size(),
           where << ": tokenizer.ggml.token_type has " << types.size() << " entries for " << tokens.size() << " tokens");
  std::unordered_map<std::string, int64_t> ids;
  ids.reserve(tokens.size());
  json vocab = json::object();
  for (size_t i = 0; i < tokens.size(); ++i) {
    KV_CHECK(ids.emplace(tokens[i], static_cast<int64_t>(i)).second,
             where << ": tokenizer.ggml.tokens[" << i << "] = '" << tokens[i] << "' appears twice");
    vocab[tokens[i]] = i;
  }
  struct Merge {
    int64_t left, right;
    double score;
    int64_t merged;
  };
  std::vector<Merge> merges;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (types[i] != kGgufTokenNormal) continue;
    const size_t first = merges.size();
    for (size_t at : code_point_splits(tokens[i])) {
      const auto l = ids.find(tokens[i].substr(0, at));
      const auto r = ids.find(tokens[i].substr(at));
      if (l != ids.end() && r != ids.end()) merges.push_back({l->second, r->second, scores[i], static_cast<int64_t>(i)});
    }
    std::sort(merges.begin() + static_cast<std::ptrdiff_t>(first), merges.end(),
              [](const Merge& a, const Merge& b) { return std::tie(a.left, a.right) < std::tie(b.left, b.right); });
  }
  std::stable_sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    return a.score != b.score ? a.score > b.score : a.merged < b.merged;
  });
  json merge_list = json::array();
  for (const Merge& m : merges)
    merge_list.push_back(json::array({tokens[static_cast<size_t>(m.left)], tokens[static_cast<size_t>(m.right)]}));
  json added = json::array();
  for (int64_t type : {kGgufTokenControl, kGgufTokenUserDefined})
    for (size_t i = 0; i < tokens.size(); ++i)
      if (types[i] == type) added.push_back(added_token(i, tokens[i], type == kGgufTokenControl));
  const json unk = token_name(f, tokens, "tokenizer.ggml.unknown_token_id");
  const json bos = token_name(f, tokens, "tokenizer.ggml.bos_token_id");
  const bool add_bos = f.get_int("tokenizer.ggml.add_bos_token").value_or(0) != 0;
  KV_CHECK(!add_bos || !bos.is_null(), where << ": tokenizer.ggml.add_bos_token is set but there is no tokenizer.ggml.bos_token_id");
  const json space = {{"String", " "}};
  const json marker = {{"String", "\u2581"}};
  json post = nullptr;
  if (add_bos) {
    const json b = {{"SpecialToken", {{"id", bos}, {"type_id", 0}}}};
    auto seq = [](const char* id) { return json{{"Sequence", {{"id", id}, {"type_id", 0}}}}; };
    post = {{"type", "TemplateProcessing"},
            {"single", json::array({b, seq("A")})},
            {"pair", json::array({b, seq("A"), b, seq("B")})},
            {"special_tokens", {{bos.get<std::string>(), {{"id", bos}, {"ids", json::array({ids.at(bos.get<std::string>())})},
                                                          {"tokens", json::array({bos})}}}}}};
  }
  json tok = {{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", {{"type", "Replace"}, {"pattern", space}, {"content", "\u2581"}}},
              {"pre_tokenizer", nullptr},
              {"post_processor", post},
              {"decoder",
               {{"type", "Sequence"},
                {"decoders", json::array({{{"type", "Replace"}, {"pattern", marker}, {"content", " "}},
                                          {{"type", "ByteFallback"}},
                                          {{"type", "Fuse"}}})}}},
              {"model", bpe_model(std::move(vocab), std::move(merge_list), unk, true)}};
  return {tok.dump(), tokenizer_config(f, tokens, add_bos)};
}

}  // namespace

GgufTokenizerFiles gguf_tokenizer_files(const GgufFile& f) {
  const std::string& where = f.path();
  const auto kind = f.get_string("tokenizer.ggml.model");
  KV_CHECK(kind, where << ": no tokenizer.ggml.model in its metadata: pass a tokenizer directory with --tokenizer");
  if (*kind == "llama") return sentencepiece_files(f);
  KV_CHECK(*kind == "gpt2", where << ": tokenizer.ggml.model is '" << *kind
                                  << "'; kvserve builds byte-level BPE ('gpt2') and SentencePiece ('llama') tokenizers "
                                     "from GGUF metadata: pass the model's Hugging Face tokenizer directory with --tokenizer");
  const auto pre = f.get_string("tokenizer.ggml.pre").value_or("default");
  const std::vector<std::string> tokens = f.get_strings("tokenizer.ggml.tokens");
  const std::vector<std::string> merges = f.get_strings("tokenizer.ggml.merges");
  const std::vector<int64_t> types =
      f.has_key("tokenizer.ggml.token_type") ? f.get_ints("tokenizer.ggml.token_type") : std::vector<int64_t>{};
  KV_CHECK(!tokens.empty(), where << ": tokenizer.ggml.tokens is empty");
  KV_CHECK(types.empty() || types.size() == tokens.size(),
           where << ": tokenizer.ggml.token_type has " << types.size() << " entries for " << tokens.size() << " tokens");

  json vocab = json::object();
  for (size_t i = 0; i < tokens.size(); ++i) {
    KV_CHECK(!vocab.contains(tokens[i]), where << ": tokenizer.ggml.tokens[" << i << "] = '" << tokens[i]
                                                  << "' appears twice");
    vocab[tokens[i]] = i;
  }
  json merge_list = json::array();
  for (size_t i = 0; i < merges.size(); ++i) {
    const size_t sp = merges[i].find(' ');
    KV_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < merges[i].size() && merges[i].find(' ', sp + 1) == std::string::npos,
             where << ": tokenizer.ggml.merges[" << i << "] = '" << merges[i] << "' is not two tokens separated by one space");
    merge_list.push_back(json::array({merges[i].substr(0, sp), merges[i].substr(sp + 1)}));
  }
  json added = json::array();
  for (size_t i = 0; i < types.size(); ++i)
    if (types[i] == kGgufTokenControl) added.push_back(added_token(i, tokens[i], true));
  json tok = {{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer", pre_tokenizer(pre, where)},
              {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}},
              {"decoder", byte_level(true, true)},
              {"model", bpe_model(std::move(vocab), std::move(merge_list), nullptr, false)}};
  return {tok.dump(), tokenizer_config(f, tokens, f.get_int("tokenizer.ggml.add_bos_token").value_or(0) != 0)};
}

Tokenizer load_model_tokenizer(const std::string& model_path) {
  namespace fs = std::filesystem;
  const fs::path p(model_path);
  if (p.extension() != ".gguf" || fs::is_directory(p) || fs::exists(p.parent_path() / "tokenizer.json"))
    return Tokenizer::from_dir(model_path);
  const GgufFile f(model_path);
  const GgufTokenizerFiles files = gguf_tokenizer_files(f);
  return Tokenizer::from_json(files.tokenizer_json, files.tokenizer_config_json, model_path + " (its tokenizer metadata)");
}

}  // namespace kvserve
