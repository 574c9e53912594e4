#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/tokenizer_text.h"

#include <pcre2.h>

#include <optional>

#include "common/check.h"

namespace kvserve::text {

char32_t next_codepoint(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  size_t n = utf8_len(b0);
  if (i + n > s.size()) n = 1;
  char32_t cp;
  switch (n) {
    case 1: cp = b0; break;
    case 2: cp = ((b0 & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu); break;
    case 3:
      cp = ((b0 & 0x0Fu) << 12) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 6) |
           (static_cast<unsigned char>(s[i + 2]) & 0x3Fu);
      break;
    default:
      cp = ((b0 & 0x07u) << 18) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 12) |
           ((static_cast<unsigned char>(s[i + 2]) & 0x3Fu) << 6) | (static_cast<unsigned char>(s[i + 3]) & 0x3Fu);
  }
  i += n;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {

// Length of the valid sequence at s[i], or 0 with `bad` set to the maximal invalid subpart length
// (Unicode's "substitution of maximal subparts", table 3-7 well-formed byte sequences).
size_t valid_seq(std::string_view s, size_t i, size_t& bad) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  bad = 1;
  if (c < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  size_t k = 1;
  for (; k <= need; ++k) {
    if (i + k >= s.size()) break;
    const unsigned char x = b(i + k);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (x < l || x > h) break;
  }
  if (k == need + 1) return need + 1;
  bad = k;
  return 0;
}

}  // namespace

std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t bad;
    const size_t n = valid_seq(s, i, bad);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t bad;
    const size_t n = valid_seq(s, i, bad);
    if (!n) return false;
    i += n;
  }
  return true;
}

size_t complete_utf8_prefix(std::string_view s) {
  // Walk back at most 3 bytes to the last lead byte; keep it only if its sequence is complete.
  size_t i = s.size();
  for (size_t back = 1; back <= 4 && back <= s.size(); ++back) {
    const auto c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) != 0x80) {
      if (c >= 0xC0 && utf8_len(c) > back) i = s.size() - back;
      break;
    }
  }
  return i;
}

bool is_whitespace(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
  if (c < 0x85) return false;
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string onig_to_pcre2(const std::string& p) {
  // Oniguruma's Unicode classes, spelled so PCRE2's version and options cannot change them.
  static const std::string kSpace = R"(\t\n\x0B\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
  // Oniguruma's word class is Alphabetic | Mark | Nd | Pc; a bare \w (not inside [...]) also takes
  // the Latin-1 digits ² ³ ¹ ¼ ½ ¾ (measured against HF tokenizers).
  static const std::string kWord = R"(\p{Alphabetic}\p{M}\p{Nd}\p{Pc})";
  static const std::string kBareWord = kWord + R"(\x{B2}\x{B3}\x{B9}\x{BC}-\x{BE})";
  static const std::string kDigit = R"(\p{Nd})";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      const std::string* cls = nullptr;
      bool neg = false;
      switch (e) {
        case 's': cls = &kSpace; break;
        case 'S': cls = &kSpace; neg = true; break;
        case 'w': cls = &kWord; break;
        case 'W': cls = &kWord; neg = true; break;
        case 'd': cls = &kDigit; break;
        case 'D': cls = &kDigit; neg = true; break;
        default: break;
      }
      if (cls && in_class && !neg) {
        out += *cls;
      } else if (cls && !in_class) {
        out += neg ? "[^" : "[";
        out += cls == &kWord ? kBareWord : *cls;
        out += "]";
      } else {
        // Negated shorthands inside a class have no simple rewrite; keep PCRE2's meaning.
        out += c;
        out += e;
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal in both dialects.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(const std::string& onig_pattern) : pattern_(onig_pattern) {
  const std::string pat = onig_to_pcre2(onig_pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  // Ruby syntax (HF's default for onig) anchors ^ and $ at line boundaries.
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(),
                             PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof buf);
    KV_FAIL("invalid regex '" << onig_pattern << "' at offset " << off << ": " << reinterpret_cast<char*>(buf));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

namespace {
// Owns one pcre2 match block; kept per call so Regex stays usable from several threads.
struct MatchData {
  explicit MatchData(pcre2_code* c) : md(pcre2_match_data_create_from_pattern(c, nullptr)) {}
  ~MatchData() { pcre2_match_data_free(md); }
  pcre2_match_data* md;
};
}  // namespace

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  auto* code = static_cast<pcre2_code*>(code_);
  MatchData m(code);
  std::vector<std::pair<size_t, size_t>> out;
  size_t pos = 0;
  std::optional<size_t> last_end;
  while (pos <= s.size()) {
    const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, PCRE2_NO_UTF_CHECK,
                               m.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    KV_CHECK(rc >= 0, "regex match failed (pcre2 error " << rc << ") for pattern '" << pattern_ << "'");
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md);
    const size_t st = ov[0], en = ov[1];
    if (st == en && last_end && *last_end == en) {
      // Onig's iterator: skip one character and search again rather than repeat an empty match.
      if (pos >= s.size()) break;
      pos += utf8_len(static_cast<unsigned char>(s[pos]));
      continue;
    }
    out.emplace_back(st, en);
    last_end = en;
    pos = en;
  }
  return out;
}

bool Regex::search(std::string_view s) const {
  auto* code = static_cast<pcre2_code*>(code_);
  MatchData m(code);
  const int rc =
      pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, PCRE2_NO_UTF_CHECK, m.md, nullptr);
  return rc >= 0;
}

}  // namespace kvserve::text
