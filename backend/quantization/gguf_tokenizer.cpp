#include "backend/quantization/gguf_tokenizer.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "backend/quantization/gguf_file.h"
#include "common/check.h"

namespace kvserve {

namespace {

// Keys sorted (std::map): an ordered_json object finds a key by scanning, which made a 49K-token
// vocabulary quadratic; Tokenizer::from_json reads the keys in any order.
using json = nlohmann::json;

constexpr int64_t kGgufTokenControl = 3;  // llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: <|im_start|> and the like

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

}  // namespace

GgufTokenizerFiles gguf_tokenizer_files(const GgufFile& f) {
  const std::string& where = f.path();
  const auto kind = f.get_string("tokenizer.ggml.model");
  KV_CHECK(kind, where << ": no tokenizer.ggml.model in its metadata: pass a tokenizer directory with --tokenizer");
  KV_CHECK(*kind == "gpt2", where << ": tokenizer.ggml.model is '" << *kind
                                  << "'; kvserve builds only byte-level BPE ('gpt2') tokenizers from GGUF metadata: "
                                     "pass the model's Hugging Face tokenizer directory with --tokenizer");
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
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != kGgufTokenControl) continue;
    added.push_back({{"id", i}, {"content", tokens[i]}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  }
  json tok = {{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer", pre_tokenizer(pre, where)},
              {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}},
              {"decoder", byte_level(true, true)},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", merge_list}}}};

  auto token_name = [&](const std::string& key) -> json {
    const auto id = f.get_int(key);
    if (!id) return nullptr;
    KV_CHECK(*id >= 0 && *id < static_cast<int64_t>(tokens.size()),
             where << ": " << key << " = " << *id << " is outside the vocabulary of " << tokens.size());
    return tokens[static_cast<size_t>(*id)];
  };
  json cfg = {{"tokenizer_class", "PreTrainedTokenizerFast"},
              {"add_bos_token", f.get_int("tokenizer.ggml.add_bos_token").value_or(0) != 0},
              {"add_prefix_space", false},
              {"bos_token", token_name("tokenizer.ggml.bos_token_id")},
              {"eos_token", token_name("tokenizer.ggml.eos_token_id")},
              {"pad_token", token_name("tokenizer.ggml.padding_token_id")},
              {"unk_token", token_name("tokenizer.ggml.unknown_token_id")},
              {"clean_up_tokenization_spaces", false}};
  if (const auto n = f.get_int(f.architecture() + ".context_length")) cfg["model_max_length"] = *n;
  if (const auto t = f.get_string("tokenizer.chat_template")) cfg["chat_template"] = *t;
  return {tok.dump(), cfg.dump()};
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
