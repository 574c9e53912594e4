// IncrementalDetokenizer (declared in tokenizer.h): streaming text of a growing token sequence.
#include "common/check.h"
#include "text/tokenizer.h"
#include "text/tokenizer_text.h"

namespace kvserve {

namespace {
// Decoders write U+FFFD for bytes that do not (yet) form a character; at the end of the window it
// usually means the next token completes the character, so that text is held back.
bool ends_with_replacement(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}
// How many context tokens to decode in front of the first new one: enough for decoders whose
// output for a token depends on its neighbours (byte pieces, a leading-space strip).
constexpr size_t kContextTokens = 5;
}  // namespace

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens,
                                               std::vector<int64_t> context)
    : tokenizer_(tokenizer), skip_special_(skip_special_tokens), ids_(std::move(context)) {
  read_offset_ = ids_.size();
  prefix_offset_ = ids_.size() > kContextTokens ? ids_.size() - kContextTokens : 0;
}

std::string IncrementalDetokenizer::add(int64_t id) {
  ids_.push_back(id);
  return step(false);
}

std::string IncrementalDetokenizer::add(const std::vector<int64_t>& ids) {
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  return step(false);
}

std::string IncrementalDetokenizer::flush() { return step(true); }

std::string IncrementalDetokenizer::step(bool final) {
  if (read_offset_ >= ids_.size()) return {};
  if (!final && tokenizer_.holds_byte_run(ids_.back())) return {};
  const auto first = ids_.begin() + static_cast<long>(prefix_offset_);
  const std::string prefix_text =
      tokenizer_.decode(std::vector<int64_t>(first, ids_.begin() + static_cast<long>(read_offset_)), skip_special_);
  const std::string new_text = tokenizer_.decode(std::vector<int64_t>(first, ids_.end()), skip_special_);
  if (new_text.size() <= prefix_text.size() || (!final && ends_with_replacement(new_text))) {
    if (final) read_offset_ = ids_.size();
    return {};
  }
  size_t cut = prefix_text.size();
  if (new_text.compare(0, cut, prefix_text) != 0) {
    // The window's earlier text changed (a held byte resolved differently); never split a char.
    while (cut < new_text.size() && (static_cast<unsigned char>(new_text[cut]) & 0xC0) == 0x80) ++cut;
  }
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  return new_text.substr(cut);
}

}  // namespace kvserve
