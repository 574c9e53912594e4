#pragma once
// Tokenizer: Hugging Face tokenizer.json (BPE: byte-level or SentencePiece-style) + tokenizer_config.json,
// token-for-token identical to the `tokenizers` library; IncrementalDetokenizer for streaming.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kvserve {

// A loaded tokenizer; immutable after loading, so one instance can be shared by all threads.
//
// Behaviour follows `tokenizers.Tokenizer.encode/decode` (not transformers' Python wrappers):
// added tokens are split out first, then normalizer, pre-tokenizer, BPE model, and (when
// add_special_tokens) the post-processor. Documented choices where HF has no equivalent:
//  - text that is not valid UTF-8 is first repaired: each maximal invalid subsequence becomes
//    U+FFFD (what Python's bytes.decode('utf-8', 'replace') does before HF ever sees it);
//  - a tokenizer.json without a post-processor gets bos/eos from tokenizer_config.json's
//    add_bos_token / add_eos_token, as transformers' Llama tokenizers do;
//  - decode() skips ids outside the vocabulary, like HF.
class Tokenizer {
 public:
  // Loads <dir>/tokenizer.json and, when present, <dir>/tokenizer_config.json (and
  // <dir>/chat_template.jinja, which newer transformers write instead of the config key). A .gguf
  // file path reads them from the directory the file sits in (common/model_path.h).
  static Tokenizer from_dir(const std::string& dir);
  // From the files' text; `where` names the source in error messages.
  static Tokenizer from_json(const std::string& tokenizer_json, const std::string& tokenizer_config_json,
                             const std::string& where);

  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = true) const;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  // Largest id + 1 over the model vocabulary and the added tokens.
  int64_t vocab_size() const;
  std::optional<int64_t> token_to_id(const std::string& token) const;
  // The token's string as stored in the vocabulary (byte-level or ▁ form); "" for unknown ids.
  std::string id_to_token(int64_t id) const;
  bool is_special(int64_t id) const;

  std::optional<int64_t> bos_id() const;
  std::optional<int64_t> eos_id() const;
  const std::string& bos_token() const;  // "" when the config names none
  const std::string& eos_token() const;
  bool add_bos_token() const;
  // The Jinja chat template from the config ("" when absent).
  const std::string& chat_template() const;
  int64_t model_max_length() const;  // 0 when the config gives none
  // tokenizer_config.json as loaded, "{}" when there is none (GET /tokenizer_info serves it).
  const std::string& config_json() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  // Whether text decoded up to a sequence ending in last_id may still change with the next token.
  bool holds_byte_run(int64_t last_id) const;
  std::shared_ptr<const Impl> impl_;
  friend class IncrementalDetokenizer;
};

// Streams the text of a growing token sequence: add() returns only text that is complete, never a
// partial UTF-8 character, and add()s + flush() together equal tokenizer.decode(all ids) (without
// context; with it, the text the new ids add after the context).
// Each step decodes a short trailing window (vLLM's prefix/read offsets), so cost is O(new tokens).
class IncrementalDetokenizer {
 public:
  // `context` (e.g. the prompt) is decoded as left context only: its text is never returned.
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens = false,
                                  std::vector<int64_t> context = {});
  std::string add(int64_t id);
  std::string add(const std::vector<int64_t>& ids);
  // Everything held back (an incomplete character at the end becomes U+FFFD, as decode() does).
  std::string flush();
  const std::vector<int64_t>& ids() const { return ids_; }

 private:
  std::string step(bool final);
  Tokenizer tokenizer_;
  bool skip_special_;
  std::vector<int64_t> ids_;
  size_t prefix_offset_ = 0;  // window start: tokens before it are never decoded again
  size_t read_offset_ = 0;    // tokens before it have had their text returned
};

}  // namespace kvserve
