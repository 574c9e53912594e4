#pragma once
// Text primitives the tokenizer needs: UTF-8 decoding/sanitising and Oniguruma-compatible regexes.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvserve::text {

// Decodes the code point at s[i] (s must be valid UTF-8); returns it and advances i.
char32_t next_codepoint(std::string_view s, size_t& i);
// Byte length of the UTF-8 sequence that starts with lead byte b (1 for stray bytes).
inline size_t utf8_len(unsigned char b) { return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }
void append_utf8(std::string& out, char32_t cp);

// Replaces every maximal invalid subsequence with U+FFFD, the policy of Python's
// bytes.decode('utf-8', 'replace') and Rust's String::from_utf8_lossy, so decode output matches HF.
std::string sanitize_utf8(std::string_view s);
bool is_valid_utf8(std::string_view s);
// Length of the longest prefix of s that ends on a complete UTF-8 character (or an invalid byte).
size_t complete_utf8_prefix(std::string_view s);

// Rust's char::is_whitespace (Unicode White_Space), used for added-token lstrip/rstrip and Strip.
bool is_whitespace(char32_t c);

// A compiled PCRE2 regex that behaves like the Oniguruma regexes in HF tokenizers (Ruby syntax,
// Unicode classes): \s, \S, \w, \W and \d are rewritten to Oniguruma's Unicode definitions.
class Regex {
 public:
  explicit Regex(const std::string& onig_pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Every match as [start, end) byte offsets, with onig's rule for empty matches (an empty match
  // right after the previous match is skipped). s must be valid UTF-8.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;
  // Whether the pattern matches somewhere in s.
  bool search(std::string_view s) const;
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
};

// Translates an Oniguruma pattern into the PCRE2 pattern used by Regex (exposed for tests).
std::string onig_to_pcre2(const std::string& pattern);

}  // namespace kvserve::text
