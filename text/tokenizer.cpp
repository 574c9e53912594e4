#include "text/tokenizer.h"

#include "common/model_path.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <queue>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "common/check.h"
#include "text/tokenizer_nfc.h"
#include "text/tokenizer_text.h"

namespace kvserve {

using json = nlohmann::json;
using text::Regex;

namespace {

// ---------------------------------------------------------------------------------------------
// JSON access with errors that name the file and the key path.

// A JSON node plus its dotted key path, so every error says where in which file it happened.
struct Node {
  const json& j;
  std::string path;
  const std::string& where;

  [[noreturn]] void fail(const std::string& what) const {
    KV_FAIL(where << ": key '" << path << "' " << what);
  }
  bool has(const char* key) const { return j.is_object() && j.contains(key) && !j.at(key).is_null(); }
  Node at(const char* key) const {
    if (!j.is_object()) fail("must be an object");
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) KV_FAIL(where << ": missing key '" << (path.empty() ? "" : path + ".") << key << "'");
    return Node{*it, path.empty() ? key : path + "." + key, where};
  }
  Node at(size_t i) const { return Node{j.at(i), path + "[" + std::to_string(i) + "]", where}; }
  std::string str() const {
    if (!j.is_string()) fail("must be a string (found " + std::string(j.type_name()) + ")");
    return j.get<std::string>();
  }
  int64_t integer() const {
    if (!j.is_number_integer()) fail("must be an integer (found " + std::string(j.type_name()) + ")");
    return j.get<int64_t>();
  }
  bool boolean() const {
    if (!j.is_boolean()) fail("must be a boolean (found " + std::string(j.type_name()) + ")");
    return j.get<bool>();
  }
  const json& array() const {
    if (!j.is_array()) fail("must be a list (found " + std::string(j.type_name()) + ")");
    return j;
  }
  std::string str_or(const char* key, const std::string& dflt) const { return has(key) ? at(key).str() : dflt; }
  bool bool_or(const char* key, bool dflt) const { return has(key) ? at(key).boolean() : dflt; }
  int64_t int_or(const char* key, int64_t dflt) const { return has(key) ? at(key).integer() : dflt; }
  std::string type() const { return at("type").str(); }
};

// ---------------------------------------------------------------------------------------------
// Pieces of text with their original byte offsets (HF's NormalizedString, reduced to what
// changes token ids: Metaspace's prepend_scheme "first" asks whether a piece starts the input).

// A span of (possibly normalized) text on its way to the model, or an already-resolved added token.
struct Piece {
  std::string s;
  std::vector<uint32_t> orig;  // per byte of s: offset in the original input of the char it came from
  int64_t added = -1;          // id when this piece is an added token

  Piece slice(size_t a, size_t b) const {
    Piece p;
    p.s = s.substr(a, b - a);
    p.orig.assign(orig.begin() + static_cast<long>(a), orig.begin() + static_cast<long>(b));
    return p;
  }
  void prepend(const std::string& t) {
    const uint32_t o = orig.empty() ? 0 : orig.front();
    s.insert(0, t);
    orig.insert(orig.begin(), t.size(), o);
  }
};

// A Split/Replace pattern: a literal string or an Oniguruma regex.
class Pattern {
 public:
  Pattern(const Node& n) {
    if (n.has("String")) {
      literal_ = n.at("String").str();
    } else if (n.has("Regex")) {
      regex_ = std::make_shared<Regex>(n.at("Regex").str());
    } else {
      n.fail("must hold 'String' or 'Regex'");
    }
  }
  explicit Pattern(std::shared_ptr<Regex> re) : regex_(std::move(re)) {}
  static Pattern literal(std::string s) {
    Pattern p(std::shared_ptr<Regex>{});
    p.literal_ = std::move(s);
    return p;
  }

  // Non-overlapping matches, leftmost first.
  std::vector<std::pair<size_t, size_t>> matches(const std::string& s) const {
    if (regex_) return regex_->find_all(s);
    std::vector<std::pair<size_t, size_t>> out;
    if (literal_.empty()) return out;
    for (size_t pos = s.find(literal_); pos != std::string::npos; pos = s.find(literal_, pos + literal_.size()))
      out.emplace_back(pos, pos + literal_.size());
    return out;
  }

 private:
  std::string literal_;
  std::shared_ptr<Regex> regex_;
};

// HF's SplitDelimiterBehavior.
enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior parse_behavior(const Node& n) {
  const std::string b = n.str();
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  n.fail("has unknown split behavior '" + b + "'");
}

// NormalizedString::split: cut p around the pattern's matches; empty pieces are dropped.
void split_piece(const Piece& p, const Pattern& pat, Behavior behavior, bool invert, std::vector<Piece>& out) {
  struct Span {
    size_t a, b;
    bool m;
  };
  std::vector<Span> spans;
  size_t prev = 0;
  for (auto [a, b] : pat.matches(p.s)) {
    if (prev != a) spans.push_back({prev, a, invert});
    spans.push_back({a, b, !invert});
    prev = b;
  }
  if (prev != p.s.size()) spans.push_back({prev, p.s.size(), invert});

  std::vector<Span> res;  // m = "remove this span"
  switch (behavior) {
    case Behavior::kIsolated:
      for (auto sp : spans) res.push_back({sp.a, sp.b, false});
      break;
    case Behavior::kRemoved:
      res = spans;
      break;
    case Behavior::kContiguous: {
      bool prev_match = false;
      for (auto sp : spans) {
        if (sp.m == prev_match && !res.empty()) res.back().b = sp.b;
        else res.push_back({sp.a, sp.b, false});
        prev_match = sp.m;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (auto sp : spans) {
        if (sp.m && !prev_match && !res.empty()) res.back().b = sp.b;
        else res.push_back({sp.a, sp.b, false});
        prev_match = sp.m;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool prev_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->m && !prev_match && !res.empty()) res.back().a = it->a;
        else res.push_back({it->a, it->b, false});
        prev_match = it->m;
      }
      std::reverse(res.begin(), res.end());
      break;
    }
  }
  for (auto sp : res)
    if (!sp.m && sp.b > sp.a) out.push_back(p.slice(sp.a, sp.b));
}

// Replaces every match of pat in p with content; new bytes inherit the match's original offset.
void replace_in_piece(Piece& p, const Pattern& pat, const std::string& content) {
  auto ms = pat.matches(p.s);
  if (ms.empty()) return;
  Piece r;
  size_t prev = 0;
  for (auto [a, b] : ms) {
    r.s.append(p.s, prev, a - prev);
    r.orig.insert(r.orig.end(), p.orig.begin() + static_cast<long>(prev), p.orig.begin() + static_cast<long>(a));
    const uint32_t o = a < p.orig.size() ? p.orig[a] : (p.orig.empty() ? 0 : p.orig.back());
    r.s += content;
    r.orig.insert(r.orig.end(), content.size(), o);
    prev = b;
  }
  r.s.append(p.s, prev, std::string::npos);
  r.orig.insert(r.orig.end(), p.orig.begin() + static_cast<long>(prev), p.orig.end());
  p.s = std::move(r.s);
  p.orig = std::move(r.orig);
}

// ---------------------------------------------------------------------------------------------
// Byte-level alphabet (GPT-2's bytes_to_unicode): printable bytes map to themselves, the rest to
// U+0100 onwards, so every byte string becomes printable text without spaces.

// The byte <-> char tables of the byte-level alphabet.
struct ByteLevelTables {
  std::array<std::string, 256> byte_to_utf8;
  std::unordered_map<char32_t, uint8_t> char_to_byte;
  ByteLevelTables() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const char32_t cp = keep ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      text::append_utf8(byte_to_utf8[b], cp);
      char_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};
const ByteLevelTables& byte_level() {
  static const ByteLevelTables t;
  return t;
}

// ---------------------------------------------------------------------------------------------
// Normalizers.

// One step of tokenizer.json's "normalizer".
struct Normalizer {
  virtual ~Normalizer() = default;
  virtual void apply(Piece& p) const = 0;
};

// Prepend: adds a prefix to non-empty text (Llama-2's "▁").
struct PrependNorm : Normalizer {
  std::string prefix;
  void apply(Piece& p) const override {
    if (!p.s.empty()) p.prepend(prefix);
  }
};

// Replace: pattern -> content everywhere.
struct ReplaceNorm : Normalizer {
  Pattern pattern;
  std::string content;
  ReplaceNorm(const Node& n) : pattern(n.at("pattern")), content(n.at("content").str()) {}
  void apply(Piece& p) const override { replace_in_piece(p, pattern, content); }
};

// Strip: removes leading/trailing Unicode whitespace.
struct StripNorm : Normalizer {
  bool left = true, right = true;
  void apply(Piece& p) const override {
    size_t a = 0, b = p.s.size();
    if (left) {
      while (a < b) {
        size_t i = a;
        if (!text::is_whitespace(text::next_codepoint(p.s, i))) break;
        a = i;
      }
    }
    if (right) {
      while (b > a) {
        size_t st = b - 1;
        while (st > a && (static_cast<unsigned char>(p.s[st]) & 0xC0) == 0x80) --st;
        size_t i = st;
        if (!text::is_whitespace(text::next_codepoint(p.s, i))) break;
        b = st;
      }
    }
    if (a != 0 || b != p.s.size()) p = p.slice(a, b);
  }
};

// NFC: canonical composition (tables in tokenizer_nfc.h).
struct NfcNorm : Normalizer {
  void apply(Piece& p) const override {
    if (text::nfc::is_nfc_quick(p.s)) return;
    // Offsets only matter for "does this piece start the input", which NFC cannot change.
    const uint32_t o = p.orig.empty() ? 0 : p.orig.front();
    p.s = text::nfc::to_nfc(p.s);
    p.orig.assign(p.s.size(), o);
  }
};

// Sequence of normalizers.
struct SequenceNorm : Normalizer {
  std::vector<std::unique_ptr<Normalizer>> steps;
  void apply(Piece& p) const override {
    for (auto& s : steps) s->apply(p);
  }
};

std::unique_ptr<Normalizer> parse_normalizer(const Node& n) {
  const std::string type = n.type();
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceNorm>();
    const Node list = n.at("normalizers");
    for (size_t i = 0; i < list.array().size(); ++i) seq->steps.push_back(parse_normalizer(list.at(i)));
    return seq;
  }
  if (type == "Prepend") {
    auto p = std::make_unique<PrependNorm>();
    p->prefix = n.at("prepend").str();
    return p;
  }
  if (type == "Replace") return std::make_unique<ReplaceNorm>(n);
  if (type == "Strip") {
    auto s = std::make_unique<StripNorm>();
    s->left = n.bool_or("strip_left", true);
    s->right = n.bool_or("strip_right", true);
    return s;
  }
  if (type == "NFC") return std::make_unique<NfcNorm>();
  n.fail("has unsupported normalizer type '" + type + "'");
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers.

// One step of tokenizer.json's "pre_tokenizer": splits each piece into smaller ones.
struct PreTokenizer {
  virtual ~PreTokenizer() = default;
  virtual void split(const Piece& p, std::vector<Piece>& out) const = 0;
  void apply(std::vector<Piece>& pieces) const {
    std::vector<Piece> out;
    out.reserve(pieces.size());
    for (auto& p : pieces) split(p, out);
    pieces = std::move(out);
  }
};

const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ByteLevel: optional prefix space, optional GPT-2 regex split, then bytes -> alphabet chars.
struct ByteLevelPre : PreTokenizer {
  bool add_prefix_space = false;
  std::optional<Pattern> regex;
  void split(const Piece& in, std::vector<Piece>& out) const override {
    Piece p = in;
    if (add_prefix_space && (p.s.empty() || p.s[0] != ' ')) p.prepend(" ");
    const size_t first = out.size();
    if (regex) split_piece(p, *regex, Behavior::kIsolated, false, out);
    else if (!p.s.empty()) out.push_back(std::move(p));
    const auto& t = byte_level();
    for (size_t k = first; k < out.size(); ++k) {
      Piece& q = out[k];
      Piece m;
      for (size_t i = 0; i < q.s.size(); ++i) {
        const std::string& c = t.byte_to_utf8[static_cast<unsigned char>(q.s[i])];
        m.s += c;
        m.orig.insert(m.orig.end(), c.size(), q.orig[i]);
      }
      q = std::move(m);
    }
  }
};

// Split: a pattern with a delimiter behavior (Llama-3 / Qwen2 regexes).
struct SplitPre : PreTokenizer {
  Pattern pattern;
  Behavior behavior;
  bool invert;
  SplitPre(const Node& n)
      : pattern(n.at("pattern")), behavior(parse_behavior(n.at("behavior"))), invert(n.bool_or("invert", false)) {}
  void split(const Piece& p, std::vector<Piece>& out) const override { split_piece(p, pattern, behavior, invert, out); }
};

// Metaspace: spaces -> replacement char, optional prefix, optional split before each replacement.
struct MetaspacePre : PreTokenizer {
  enum class Scheme { kAlways, kFirst, kNever };
  std::string replacement;
  Scheme scheme = Scheme::kAlways;
  bool split_ = true;
  void split(const Piece& in, std::vector<Piece>& out) const override {
    Piece p = in;
    static const Pattern space = Pattern::literal(" ");
    replace_in_piece(p, space, replacement);
    const bool starts = p.s.compare(0, replacement.size(), replacement) == 0;
    if (!starts && (scheme == Scheme::kAlways || (scheme == Scheme::kFirst && !p.orig.empty() && p.orig[0] == 0)))
      p.prepend(replacement);
    if (split_) split_piece(p, Pattern::literal(replacement), Behavior::kMergedWithNext, false, out);
    else if (!p.s.empty()) out.push_back(std::move(p));
  }
};

// Digits: numbers apart from the rest, one digit per piece when individual_digits.
struct DigitsPre : PreTokenizer {
  Pattern pattern{std::make_shared<Regex>(R"(\p{N})")};
  bool individual = false;
  void split(const Piece& p, std::vector<Piece>& out) const override {
    split_piece(p, pattern, individual ? Behavior::kIsolated : Behavior::kContiguous, false, out);
  }
};

// Whitespace / WhitespaceSplit: keep the matches of a regex, drop the rest.
struct KeepMatchesPre : PreTokenizer {
  Pattern pattern;
  explicit KeepMatchesPre(const char* re) : pattern(std::make_shared<Regex>(re)) {}
  void split(const Piece& p, std::vector<Piece>& out) const override {
    split_piece(p, pattern, Behavior::kRemoved, true, out);
  }
};

// Sequence of pre-tokenizers, each applied to all pieces of the previous one.
struct SequencePre : PreTokenizer {
  std::vector<std::unique_ptr<PreTokenizer>> steps;
  void split(const Piece& p, std::vector<Piece>& out) const override {
    std::vector<Piece> cur{p};
    for (auto& s : steps) s->apply(cur);
    for (auto& c : cur) out.push_back(std::move(c));
  }
};

MetaspacePre::Scheme parse_scheme(const Node& n) {
  if (n.has("prepend_scheme")) {
    const std::string s = n.at("prepend_scheme").str();
    if (s == "always") return MetaspacePre::Scheme::kAlways;
    if (s == "first") return MetaspacePre::Scheme::kFirst;
    if (s == "never") return MetaspacePre::Scheme::kNever;
    n.at("prepend_scheme").fail("must be always, first or never (found '" + s + "')");
  }
  return n.bool_or("add_prefix_space", true) ? MetaspacePre::Scheme::kAlways : MetaspacePre::Scheme::kNever;
}

std::string parse_replacement(const Node& n) {
  const std::string r = n.has("replacement") ? n.at("replacement").str() : n.str_or("str_rep", "\u2581");
  size_t i = 0;
  if (r.empty() || (text::next_codepoint(r, i), i != r.size())) n.fail("replacement must be one character");
  return r;
}

std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const Node& n) {
  const std::string type = n.type();
  if (type == "Sequence") {
    auto seq = std::make_unique<SequencePre>();
    const Node list = n.at("pretokenizers");
    for (size_t i = 0; i < list.array().size(); ++i) seq->steps.push_back(parse_pre_tokenizer(list.at(i)));
    return seq;
  }
  if (type == "ByteLevel") {
    auto b = std::make_unique<ByteLevelPre>();
    b->add_prefix_space = n.bool_or("add_prefix_space", true);
    if (n.bool_or("use_regex", true)) b->regex.emplace(std::make_shared<Regex>(kGpt2Pattern));
    return b;
  }
  if (type == "Split") return std::make_unique<SplitPre>(n);
  if (type == "Metaspace") {
    auto m = std::make_unique<MetaspacePre>();
    m->replacement = parse_replacement(n);
    m->scheme = parse_scheme(n);
    m->split_ = n.bool_or("split", true);
    return m;
  }
  if (type == "Digits") {
    auto d = std::make_unique<DigitsPre>();
    d->individual = n.bool_or("individual_digits", false);
    return d;
  }
  if (type == "Whitespace") return std::make_unique<KeepMatchesPre>(R"(\w+|[^\w\s]+)");
  if (type == "WhitespaceSplit") return std::make_unique<KeepMatchesPre>(R"(\S+)");
  n.fail("has unsupported pre-tokenizer type '" + type + "'");
}

// ---------------------------------------------------------------------------------------------
// The BPE model.

// tokenizer.json's "model" of type BPE: vocabulary, ranked merges and the fallbacks for unknowns.
struct BpeModel {
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::string> id_to_token;  // "" for holes
  // (left id, right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<uint32_t, int64_t>> merges;
  std::optional<int64_t> unk_id;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::string continuing_subword_prefix, end_of_word_suffix;
  std::array<int64_t, 256> byte_ids{};  // <0xNN> ids, -1 when absent

  static uint64_t key(int64_t a, int64_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

  void tokenize(const std::string& w, std::vector<int64_t>& out) const;
};

// A symbol of a word under merging: a doubly-linked list over token ids (HF's Word).
struct Symbol {
  int64_t id;
  int prev, next;
  size_t len;
};

// A candidate merge; lowest rank first, then leftmost, as HF orders its heap.
struct MergeCand {
  uint32_t rank;
  int pos;
  int64_t new_id;
  bool operator<(const MergeCand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

void BpeModel::tokenize(const std::string& w, std::vector<int64_t>& out) const {
  if (ignore_merges) {
    auto it = vocab.find(w);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<Symbol> sym;
  int64_t unk = -1;  // pending run of unknown chars: its id (or -1) and byte length
  size_t unk_len = 0;
  auto add = [&](int64_t id, size_t len) {
    const int n = static_cast<int>(sym.size());
    sym.push_back({id, n - 1, n + 1, len});
  };
  std::string buf;
  size_t i = 0;
  while (i < w.size()) {
    const size_t end = std::min(w.size(), i + text::utf8_len(static_cast<unsigned char>(w[i])));
    const size_t blen = end - i;
    buf.clear();
    if (i > 0) buf += continuing_subword_prefix;
    buf.append(w, i, blen);
    if (end == w.size()) buf += end_of_word_suffix;
    auto it = vocab.find(buf);
    if (it != vocab.end()) {
      if (unk >= 0) add(unk, unk_len), unk = -1;
      add(it->second, blen);
    } else {
      bool done = false;
      if (byte_fallback) {
        bool all = true;
        for (size_t k = i; k < end; ++k) all = all && byte_ids[static_cast<unsigned char>(w[k])] >= 0;
        if (all) {
          // HF does not flush a pending unknown run before byte pieces, so order follows it.
          for (size_t k = i; k < end; ++k) add(byte_ids[static_cast<unsigned char>(w[k])], 1);
          done = true;
        }
      }
      if (!done && unk_id) {
        if (unk >= 0 && fuse_unk) {
          unk_len += blen;
        } else {
          if (unk >= 0) add(unk, unk_len);
          unk = *unk_id;
          unk_len = blen;
        }
      }
      // Without an unk token HF raises an error; kvserve drops the character instead.
    }
    i = end;
  }
  if (unk >= 0) add(unk, unk_len);
  if (sym.empty()) return;
  sym.back().next = -1;

  std::priority_queue<MergeCand> q;
  for (size_t k = 0; k + 1 < sym.size(); ++k) {
    auto it = merges.find(key(sym[k].id, sym[k + 1].id));
    if (it != merges.end()) q.push({it->second.first, static_cast<int>(k), it->second.second});
  }
  while (!q.empty()) {
    const MergeCand top = q.top();
    q.pop();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    Symbol& right = sym[cur.next];
    auto it = merges.find(key(cur.id, right.id));
    if (it == merges.end() || it->second.second != top.new_id) continue;
    cur.id = top.new_id;
    cur.len += right.len;
    right.len = 0;
    cur.next = right.next;
    if (cur.next >= 0) sym[cur.next].prev = top.pos;
    if (cur.prev >= 0) {
      auto m = merges.find(key(sym[cur.prev].id, cur.id));
      if (m != merges.end()) q.push({m->second.first, cur.prev, m->second.second});
    }
    if (cur.next >= 0) {
      auto m = merges.find(key(cur.id, sym[cur.next].id));
      if (m != merges.end()) q.push({m->second.first, top.pos, m->second.second});
    }
  }
  for (const Symbol& s : sym)
    if (s.len) out.push_back(s.id);
}

// Token ids index tables with one slot per id (id -> token, byte pieces), so an id far beyond the
// number of tokens listed would make a small file allocate gigabytes. Real vocabularies are dense
// (gaps of a few reserved ids at most); this bound only rejects corrupt or hostile files.
constexpr int64_t kMaxIdGap = int64_t{1} << 16;

BpeModel parse_bpe(const Node& n) {
  BpeModel m;
  const std::string type = n.str_or("type", "BPE");
  if (type != "BPE") n.fail("has unsupported model type '" + type + "' (kvserve supports BPE)");
  const Node vocab = n.at("vocab");
  if (!vocab.j.is_object()) vocab.fail("must be an object of token -> id");
  int64_t max_id = -1;
  for (auto it = vocab.j.begin(); it != vocab.j.end(); ++it) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0)
      KV_FAIL(vocab.where << ": key '" << vocab.path << "' has a non-integer id for token '" << it.key() << "'");
    const int64_t id = it->get<int64_t>();
    KV_CHECK(id < (int64_t{1} << 31), vocab.where << ": key 'model.vocab' id " << id << " is too large");
    m.vocab[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  if (max_id >= static_cast<int64_t>(m.vocab.size()) + kMaxIdGap)
    KV_FAIL(vocab.where << ": key 'model.vocab' has id " << max_id << " but only " << m.vocab.size()
                        << " tokens (ids must be dense: at most " << kMaxIdGap << " beyond the token count)");
  m.id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
  for (auto& [tok, id] : m.vocab) m.id_to_token[static_cast<size_t>(id)] = tok;

  m.continuing_subword_prefix = n.str_or("continuing_subword_prefix", "");
  m.end_of_word_suffix = n.str_or("end_of_word_suffix", "");
  const Node merges = n.at("merges");
  const json& ml = merges.array();
  for (size_t r = 0; r < ml.size(); ++r) {
    std::string a, b;
    const json& e = ml[r];
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        merges.at(r).fail("must be two tokens separated by one space (found '" + s + "')");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      merges.at(r).fail("must be \"a b\" or [a, b]");
    }
    auto ia = m.vocab.find(a), ib = m.vocab.find(b);
    // With a continuing-subword prefix ("##"), the right part's prefix is not repeated in the merge.
    const std::string& pre = m.continuing_subword_prefix;
    const bool strip = !pre.empty() && b.compare(0, pre.size(), pre) == 0;
    auto inew = m.vocab.find(a + (strip ? b.substr(pre.size()) : b));
    if (ia == m.vocab.end() || ib == m.vocab.end() || inew == m.vocab.end())
      merges.at(r).fail("refers to a token missing from model.vocab ('" + a + "' + '" + b + "')");
    m.merges[BpeModel::key(ia->second, ib->second)] = {static_cast<uint32_t>(r), inew->second};
  }
  if (n.has("unk_token")) {
    const std::string unk = n.at("unk_token").str();
    auto it = m.vocab.find(unk);
    // HF accepts an unk_token that is missing from the vocabulary and fails only when it is needed.
    if (it != m.vocab.end()) m.unk_id = it->second;
  }
  m.fuse_unk = n.bool_or("fuse_unk", false);
  m.byte_fallback = n.bool_or("byte_fallback", false);
  m.ignore_merges = n.bool_or("ignore_merges", false);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    auto it = m.vocab.find(name);
    m.byte_ids[b] = it == m.vocab.end() ? -1 : it->second;
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// Decoders (HF decode_chain: a list of token strings in, a list out, joined at the end).

// One step of tokenizer.json's "decoder".
struct Decoder {
  virtual ~Decoder() = default;
  virtual void chain(std::vector<std::string>& toks) const = 0;
};

// ByteLevel: alphabet chars -> bytes, lossily decoded as UTF-8. Tokens with chars outside the
// alphabet (added tokens such as "<|eot_id|>" with a space) keep their own bytes.
struct ByteLevelDec : Decoder {
  void chain(std::vector<std::string>& toks) const override {
    const auto& t = byte_level();
    std::string bytes;
    for (const std::string& tok : toks) {
      std::string mapped;
      bool ok = true;
      for (size_t i = 0; i < tok.size() && ok;) {
        auto it = t.char_to_byte.find(text::next_codepoint(tok, i));
        if (it == t.char_to_byte.end()) ok = false;
        else mapped.push_back(static_cast<char>(it->second));
      }
      bytes += ok ? mapped : tok;
    }
    toks.assign(1, text::sanitize_utf8(bytes));
  }
};

// Metaspace: replacement char -> space; the first token loses its replacement chars when a
// prefix was being added at encode time.
struct MetaspaceDec : Decoder {
  std::string replacement;
  bool strip_first = true;
  void chain(std::vector<std::string>& toks) const override {
    for (size_t i = 0; i < toks.size(); ++i) {
      std::string out;
      const std::string& t = toks[i];
      for (size_t p = 0; p < t.size();) {
        if (t.compare(p, replacement.size(), replacement) == 0) {
          if (!(i == 0 && strip_first)) out += ' ';
          p += replacement.size();
        } else {
          out += t[p++];
        }
      }
      toks[i] = std::move(out);
    }
  }
};

// Replace: pattern -> content in every token.
struct ReplaceDec : Decoder {
  Pattern pattern;
  std::string content;
  ReplaceDec(const Node& n) : pattern(n.at("pattern")), content(n.at("content").str()) {}
  void chain(std::vector<std::string>& toks) const override {
    for (auto& t : toks) {
      Piece p{t, std::vector<uint32_t>(t.size(), 0), -1};
      replace_in_piece(p, pattern, content);
      t = std::move(p.s);
    }
  }
};

// ByteFallback: runs of <0xNN> tokens become their bytes, or one U+FFFD per byte if not UTF-8.
struct ByteFallbackDec : Decoder {
  static int byte_of(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    auto hex = [](char c) {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      return -1;
    };
    const int h = hex(t[3]), l = hex(t[4]);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
  void chain(std::vector<std::string>& toks) const override {
    std::vector<std::string> out;
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (text::is_valid_utf8(pending)) out.push_back(pending);
      else
        for (size_t k = 0; k < pending.size(); ++k) out.emplace_back("\xEF\xBF\xBD");
      pending.clear();
    };
    for (auto& t : toks) {
      const int b = byte_of(t);
      if (b >= 0) {
        pending.push_back(static_cast<char>(b));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    toks = std::move(out);
  }
};

// Fuse: all tokens into one string.
struct FuseDec : Decoder {
  void chain(std::vector<std::string>& toks) const override {
    std::string all;
    for (auto& t : toks) all += t;
    toks.assign(1, std::move(all));
  }
};

// Strip: removes up to `start` leading and `stop` trailing copies of a char from each token.
struct StripDec : Decoder {
  char32_t content = ' ';
  size_t start = 0, stop = 0;
  void chain(std::vector<std::string>& toks) const override {
    for (auto& t : toks) {
      std::vector<std::pair<size_t, char32_t>> chars;  // (byte offset, code point)
      for (size_t i = 0; i < t.size();) {
        const size_t at = i;
        chars.emplace_back(at, text::next_codepoint(t, i));
      }
      size_t a = 0, b = chars.size();
      for (size_t k = 0; k < start && k < chars.size() && chars[k].second == content; ++k) a = k + 1;
      for (size_t k = 0; k < stop && k < chars.size(); ++k) {
        const size_t idx = chars.size() - k - 1;
        if (chars[idx].second != content) break;
        b = idx;
      }
      if (a >= b) {
        t.clear();
        continue;
      }
      const size_t ba = chars[a].first, bb = b < chars.size() ? chars[b].first : t.size();
      t = t.substr(ba, bb - ba);
    }
  }
};

// Sequence of decoders.
struct SequenceDec : Decoder {
  std::vector<std::unique_ptr<Decoder>> steps;
  void chain(std::vector<std::string>& toks) const override {
    for (auto& s : steps) s->chain(toks);
  }
};

std::unique_ptr<Decoder> parse_decoder(const Node& n) {
  const std::string type = n.type();
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceDec>();
    const Node list = n.at("decoders");
    for (size_t i = 0; i < list.array().size(); ++i) seq->steps.push_back(parse_decoder(list.at(i)));
    return seq;
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDec>();
  if (type == "Metaspace") {
    auto m = std::make_unique<MetaspaceDec>();
    m->replacement = parse_replacement(n);
    m->strip_first = parse_scheme(n) != MetaspacePre::Scheme::kNever;
    return m;
  }
  if (type == "Replace") return std::make_unique<ReplaceDec>(n);
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDec>();
  if (type == "Fuse") return std::make_unique<FuseDec>();
  if (type == "Strip") {
    auto s = std::make_unique<StripDec>();
    const std::string c = n.at("content").str();
    size_t i = 0;
    if (c.empty() || (s->content = text::next_codepoint(c, i), i != c.size()))
      n.at("content").fail("must be one character");
    const int64_t st = n.at("start").integer(), sp = n.at("stop").integer();
    if (st < 0 || sp < 0) n.fail("start/stop must not be negative");
    s->start = static_cast<size_t>(st);
    s->stop = static_cast<size_t>(sp);
    return s;
  }
  n.fail("has unsupported decoder type '" + type + "'");
}

// ---------------------------------------------------------------------------------------------
// Post-processors (single sequences only: kvserve never encodes pairs).

// One step of tokenizer.json's "post_processor".
struct PostProcessor {
  virtual ~PostProcessor() = default;
  virtual void apply(std::vector<int64_t>& ids) const = 0;
};

// TemplateProcessing's "single" template, e.g. "<s> $A".
struct TemplatePost : PostProcessor {
  std::vector<int64_t> pre, post;  // special-token ids before and after $A
  void apply(std::vector<int64_t>& ids) const override {
    if (pre.empty() && post.empty()) return;
    std::vector<int64_t> out = pre;
    out.insert(out.end(), ids.begin(), ids.end());
    out.insert(out.end(), post.begin(), post.end());
    ids = std::move(out);
  }
};

// BertProcessing / RobertaProcessing: cls + ids + sep.
struct ClsSepPost : PostProcessor {
  int64_t cls, sep;
  void apply(std::vector<int64_t>& ids) const override {
    ids.insert(ids.begin(), cls);
    ids.push_back(sep);
  }
};

// Sequence of post-processors.
struct SequencePost : PostProcessor {
  std::vector<std::unique_ptr<PostProcessor>> steps;
  void apply(std::vector<int64_t>& ids) const override {
    for (auto& s : steps) s->apply(ids);
  }
};

// A post-processor that changes no ids (ByteLevel only adjusts offsets).
struct NoopPost : PostProcessor {
  void apply(std::vector<int64_t>&) const override {}
};

std::unique_ptr<PostProcessor> parse_post(const Node& n) {
  const std::string type = n.type();
  if (type == "Sequence") {
    auto seq = std::make_unique<SequencePost>();
    const Node list = n.at("processors");
    for (size_t i = 0; i < list.array().size(); ++i) seq->steps.push_back(parse_post(list.at(i)));
    return seq;
  }
  if (type == "ByteLevel") return std::make_unique<NoopPost>();
  if (type == "TemplateProcessing") {
    auto t = std::make_unique<TemplatePost>();
    const Node single = n.at("single");
    const Node specials = n.at("special_tokens");
    bool seen_seq = false;
    for (size_t i = 0; i < single.array().size(); ++i) {
      const Node item = single.at(i);
      if (item.has("Sequence")) {
        seen_seq = true;
      } else if (item.has("SpecialToken")) {
        const std::string name = item.at("SpecialToken").at("id").str();
        if (!specials.j.is_object() || !specials.j.contains(name))
          specials.fail("has no entry for template token '" + name + "'");
        const Node ids = specials.at(name.c_str()).at("ids");
        auto& dst = seen_seq ? t->post : t->pre;
        for (size_t k = 0; k < ids.array().size(); ++k) dst.push_back(ids.at(k).integer());
      } else {
        item.fail("must be a SpecialToken or a Sequence");
      }
    }
    return t;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    auto p = std::make_unique<ClsSepPost>();
    p->cls = n.at("cls").at(1).integer();
    p->sep = n.at("sep").at(1).integer();
    return p;
  }
  n.fail("has unsupported post-processor type '" + type + "'");
}

// ---------------------------------------------------------------------------------------------
// Added tokens: matched on raw text (normalized=false) or on normalized text (normalized=true)
// with leftmost-longest semantics, as HF's Aho-Corasick matcher does.

// An entry of tokenizer.json's "added_tokens".
struct AddedToken {
  std::string content;
  int64_t id;
  bool special, normalized, lstrip, rstrip, single_word;
};

// Byte trie over added-token contents.
class AddedMatcher {
 public:
  void add(const std::string& s, size_t token) {
    if (s.empty()) return;
    int node = 0;
    for (unsigned char c : s) {
      const uint32_t k = static_cast<uint32_t>(node) << 8 | c;
      auto it = edges_.find(k);
      if (it == edges_.end()) {
        it = edges_.emplace(k, static_cast<int>(term_.size())).first;
        term_.push_back(-1);
      }
      node = it->second;
    }
    term_[static_cast<size_t>(node)] = static_cast<int64_t>(token);
  }
  bool empty() const { return edges_.empty(); }
  // Non-overlapping leftmost-longest matches: (start, end, token index).
  std::vector<std::tuple<size_t, size_t, size_t>> find(const std::string& s) const {
    std::vector<std::tuple<size_t, size_t, size_t>> out;
    size_t i = 0;
    while (i < s.size()) {
      int node = 0;
      size_t best_end = 0;
      int64_t best = -1;
      for (size_t j = i; j < s.size(); ++j) {
        auto it = edges_.find(static_cast<uint32_t>(node) << 8 | static_cast<unsigned char>(s[j]));
        if (it == edges_.end()) break;
        node = it->second;
        if (term_[static_cast<size_t>(node)] >= 0) best = term_[static_cast<size_t>(node)], best_end = j + 1;
      }
      if (best >= 0) {
        out.emplace_back(i, best_end, static_cast<size_t>(best));
        i = best_end;
      } else {
        ++i;
      }
    }
    return out;
  }

 private:
  std::unordered_map<uint32_t, int> edges_;
  std::vector<int64_t> term_{-1};  // node -> token index
};

}  // namespace

// ---------------------------------------------------------------------------------------------

// Everything parsed from the two files; shared, immutable, by all copies of a Tokenizer.
struct Tokenizer::Impl {
  std::string where;
  BpeModel model;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Decoder> decoder;
  std::unique_ptr<PostProcessor> post;
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int64_t> added_by_content;
  std::unordered_map<int64_t, size_t> added_by_id;
  AddedMatcher raw_matcher, normalized_matcher;
  std::unique_ptr<Regex> word_start, word_end;

  std::string bos_token, eos_token, chat_template;
  std::string config_json = "{}";
  std::optional<int64_t> bos_id, eos_id;
  bool add_bos = false, add_eos = false;
  int64_t model_max_length = 0;
  int64_t vocab_size = 0;
  // With a ByteFallback decoder a run of <0xNN> tokens is decoded as a whole (invalid runs become
  // U+FFFD per byte), so streaming must not emit text while such a run may still grow.
  bool byte_fallback_decoder = false;
  std::vector<bool> is_byte_piece;  // by id: a <0xNN> token

  // Splits p by the matcher's added tokens, applying lstrip/rstrip/single_word (HF find_matches).
  void split_added(const Piece& p, const AddedMatcher& m, std::vector<Piece>& out) const {
    if (p.added >= 0 || m.empty()) {
      out.push_back(p);
      return;
    }
    const std::string& s = p.s;
    size_t start_offset = 0;
    for (auto [st, en, idx] : m.find(s)) {
      size_t start = st, stop = en;
      const AddedToken& t = added[idx];
      if (t.single_word) {
        const bool start_space = start == 0 || !word_end->search(std::string_view(s).substr(0, start));
        const bool stop_space = stop == s.size() || !word_start->search(std::string_view(s).substr(stop));
        if (!start_space || !stop_space) continue;
      }
      if (t.lstrip) {
        size_t ns = 0;  // just after the last non-whitespace char before start
        for (size_t i = 0; i < start;) {
          if (!text::is_whitespace(text::next_codepoint(s, i))) ns = i;
        }
        start = std::max(ns, start_offset);
      }
      if (t.rstrip) {
        size_t i = stop;
        while (i < s.size()) {
          size_t j = i;
          if (!text::is_whitespace(text::next_codepoint(s, j))) break;
          i = j;
        }
        stop = i;
      }
      if (start_offset < start) out.push_back(p.slice(start_offset, start));
      Piece tok = p.slice(std::min(start, s.size()), std::min(stop, s.size()));
      tok.added = t.id;
      out.push_back(std::move(tok));
      start_offset = stop;
    }
    if (start_offset < s.size()) out.push_back(p.slice(start_offset, s.size()));
  }

  std::string token_of(int64_t id) const {
    auto a = added_by_id.find(id);
    if (a != added_by_id.end()) return added[a->second].content;
    if (id >= 0 && static_cast<size_t>(id) < model.id_to_token.size()) return model.id_to_token[static_cast<size_t>(id)];
    return {};
  }
};

namespace {

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  KV_CHECK(f, p.string() << ": cannot open file");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// tokenizer_config.json spells tokens as a string or as an AddedToken object {"content": ...}.
std::string config_token(const Node& cfg, const char* key) {
  if (!cfg.has(key)) return {};
  const Node n = cfg.at(key);
  if (n.j.is_string()) return n.str();
  if (n.j.is_object()) return n.at("content").str();
  n.fail("must be a string or an object with 'content'");
}

}  // namespace

bool Tokenizer::holds_byte_run(int64_t last_id) const {
  const Impl& m = *impl_;
  return m.byte_fallback_decoder && last_id >= 0 && last_id < m.vocab_size && m.is_byte_piece[static_cast<size_t>(last_id)];
}

Tokenizer Tokenizer::from_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path d(model_side_dir(dir));
  const fs::path tj = d / "tokenizer.json";
  KV_CHECK(fs::exists(tj), tj.string() << ": not found (kvserve needs a Hugging Face tokenizer.json)");
  const fs::path tc = d / "tokenizer_config.json";
  const std::string cfg = fs::exists(tc) ? read_file(tc) : std::string("{}");
  Tokenizer t = from_json(read_file(tj), cfg, tj.string());
  const fs::path jinja = d / "chat_template.jinja";
  if (t.impl_->chat_template.empty() && fs::exists(jinja)) {
    auto impl = std::const_pointer_cast<Impl>(t.impl_);
    impl->chat_template = read_file(jinja);
  }
  return t;
}

Tokenizer Tokenizer::from_json(const std::string& tokenizer_json, const std::string& config_text,
                               const std::string& where) {
  auto impl = std::make_shared<Impl>();
  impl->where = where;
  json j;
  try {
    j = json::parse(tokenizer_json);
  } catch (const json::exception& e) {
    KV_FAIL(where << ": malformed JSON: " << e.what());
  }
  const Node root{j, "", impl->where};
  if (!j.is_object()) KV_FAIL(where << ": top level must be an object");
  impl->model = parse_bpe(root.at("model"));
  if (root.has("normalizer")) impl->normalizer = parse_normalizer(root.at("normalizer"));
  if (root.has("pre_tokenizer")) impl->pre_tokenizer = parse_pre_tokenizer(root.at("pre_tokenizer"));
  if (root.has("decoder")) {
    impl->decoder = parse_decoder(root.at("decoder"));
    std::function<bool(const json&)> has_byte_fallback = [&](const json& d) {
      if (d.value("type", "") == "ByteFallback") return true;
      if (d.contains("decoders") && d["decoders"].is_array())
        for (const auto& e : d["decoders"])
          if (has_byte_fallback(e)) return true;
      return false;
    };
    impl->byte_fallback_decoder = has_byte_fallback(j["decoder"]);
  }
  if (root.has("post_processor")) impl->post = parse_post(root.at("post_processor"));
  if (root.has("truncation")) KV_FAIL(where << ": key 'truncation' is set; kvserve does not truncate inputs");
  if (root.has("padding")) KV_FAIL(where << ": key 'padding' is set; kvserve does not pad inputs");

  int64_t max_id = static_cast<int64_t>(impl->model.id_to_token.size()) - 1;
  if (root.has("added_tokens")) {
    const Node list = root.at("added_tokens");
    for (size_t i = 0; i < list.array().size(); ++i) {
      const Node t = list.at(i);
      AddedToken a{t.at("content").str(), t.at("id").integer(), t.bool_or("special", false),
                   t.bool_or("normalized", !t.bool_or("special", false)), t.bool_or("lstrip", false),
                   t.bool_or("rstrip", false), t.bool_or("single_word", false)};
      if (a.id < 0) t.at("id").fail("must not be negative");
      if (a.id >= static_cast<int64_t>(impl->model.vocab.size() + list.array().size()) + kMaxIdGap)
        t.at("id").fail("is " + std::to_string(a.id) + ", far beyond the " +
                        std::to_string(impl->model.vocab.size() + list.array().size()) +
                        " tokens listed (ids must be dense)");
      impl->added_by_content[a.content] = a.id;
      impl->added_by_id[a.id] = impl->added.size();
      max_id = std::max(max_id, a.id);
      impl->added.push_back(std::move(a));
    }
  }
  for (size_t k = 0; k < impl->added.size(); ++k) {
    const AddedToken& a = impl->added[k];
    if (!a.normalized) {
      impl->raw_matcher.add(a.content, k);
    } else {
      // HF matches normalized added tokens in normalized text, so their pattern is normalized too.
      Piece p{a.content, std::vector<uint32_t>(a.content.size(), 0), -1};
      if (impl->normalizer) impl->normalizer->apply(p);
      impl->normalized_matcher.add(p.s, k);
    }
  }
  impl->word_start = std::make_unique<Regex>(R"(\A\w)");
  impl->word_end = std::make_unique<Regex>(R"(\w\z)");
  impl->vocab_size = max_id + 1;
  impl->is_byte_piece.assign(static_cast<size_t>(impl->vocab_size), false);
  for (int64_t id = 0; id < impl->vocab_size; ++id)
    impl->is_byte_piece[static_cast<size_t>(id)] = ByteFallbackDec::byte_of(impl->token_of(id)) >= 0;

  const std::string cfg_where = std::filesystem::path(where).parent_path().append("tokenizer_config.json").string();
  json c;
  try {
    c = json::parse(config_text);
  } catch (const json::exception& e) {
    KV_FAIL(cfg_where << ": malformed JSON: " << e.what());
  }
  if (!c.is_object()) KV_FAIL(cfg_where << ": top level must be an object");
  impl->config_json = c.dump();
  const Node cfg{c, "", cfg_where};
  impl->bos_token = config_token(cfg, "bos_token");
  impl->eos_token = config_token(cfg, "eos_token");
  impl->add_bos = cfg.bool_or("add_bos_token", false);
  impl->add_eos = cfg.bool_or("add_eos_token", false);
  if (cfg.has("model_max_length") && cfg.at("model_max_length").j.is_number()) {
    // transformers writes a huge float (1e30) when there is no limit.
    const double v = cfg.at("model_max_length").j.get<double>();
    impl->model_max_length = v > 0 && v < 1e15 ? static_cast<int64_t>(v) : 0;
  }
  if (cfg.has("chat_template")) {
    const Node ct = cfg.at("chat_template");
    if (ct.j.is_string()) {
      impl->chat_template = ct.str();
    } else if (ct.j.is_array()) {
      // Several named templates: use "default", else the first.
      for (size_t i = 0; i < ct.j.size(); ++i) {
        const Node e = ct.at(i);
        if (impl->chat_template.empty() || e.str_or("name", "") == "default") impl->chat_template = e.at("template").str();
      }
    } else {
      ct.fail("must be a string or a list of {name, template}");
    }
  }
  Tokenizer t(impl);
  impl->bos_id = impl->bos_token.empty() ? std::nullopt : t.token_to_id(impl->bos_token);
  impl->eos_id = impl->eos_token.empty() ? std::nullopt : t.token_to_id(impl->eos_token);
  KV_CHECK(impl->bos_token.empty() || impl->bos_id,
           cfg_where << ": key 'bos_token' names '" << impl->bos_token << "', which is not in the vocabulary");
  KV_CHECK(impl->eos_token.empty() || impl->eos_id,
           cfg_where << ": key 'eos_token' names '" << impl->eos_token << "', which is not in the vocabulary");
  return t;
}

std::vector<int64_t> Tokenizer::encode(const std::string& input, bool add_special_tokens) const {
  const Impl& m = *impl_;
  Piece whole;
  whole.s = text::is_valid_utf8(input) ? input : text::sanitize_utf8(input);
  whole.orig.resize(whole.s.size());
  for (size_t i = 0; i < whole.s.size(); ++i) whole.orig[i] = static_cast<uint32_t>(i);

  std::vector<Piece> pieces;
  m.split_added(whole, m.raw_matcher, pieces);
  std::vector<Piece> normalized;
  for (Piece& p : pieces) {
    if (p.added < 0 && m.normalizer) m.normalizer->apply(p);
    if (p.added < 0 && p.s.empty()) continue;
    m.split_added(p, m.normalized_matcher, normalized);
  }
  std::vector<int64_t> ids;
  std::vector<Piece> words;
  for (Piece& p : normalized) {
    if (p.added >= 0) {
      ids.push_back(p.added);
      continue;
    }
    words.clear();
    if (m.pre_tokenizer) m.pre_tokenizer->split(p, words);
    else words.push_back(std::move(p));
    for (const Piece& w : words)
      if (!w.s.empty()) m.model.tokenize(w.s, ids);
  }
  if (add_special_tokens) {
    if (m.post) {
      m.post->apply(ids);
    } else {
      if (m.add_bos && m.bos_id) ids.insert(ids.begin(), *m.bos_id);
      if (m.add_eos && m.eos_id) ids.push_back(*m.eos_id);
    }
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int64_t id : ids) {
    auto a = m.added_by_id.find(id);
    if (a != m.added_by_id.end()) {
      if (skip_special_tokens && m.added[a->second].special) continue;
      toks.push_back(m.added[a->second].content);
    } else if (id >= 0 && static_cast<size_t>(id) < m.model.id_to_token.size() &&
               !m.model.id_to_token[static_cast<size_t>(id)].empty()) {
      toks.push_back(m.model.id_to_token[static_cast<size_t>(id)]);
    }
  }
  if (!m.decoder) {
    std::string out;
    for (size_t i = 0; i < toks.size(); ++i) out += (i ? " " : "") + toks[i];
    return out;
  }
  m.decoder->chain(toks);
  std::string out;
  for (auto& t : toks) out += t;
  return out;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int64_t> Tokenizer::token_to_id(const std::string& token) const {
  auto a = impl_->added_by_content.find(token);
  if (a != impl_->added_by_content.end()) return a->second;
  auto v = impl_->model.vocab.find(token);
  if (v != impl_->model.vocab.end()) return v->second;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int64_t id) const { return impl_->token_of(id); }

bool Tokenizer::is_special(int64_t id) const {
  auto a = impl_->added_by_id.find(id);
  return a != impl_->added_by_id.end() && impl_->added[a->second].special;
}

std::optional<int64_t> Tokenizer::bos_id() const { return impl_->bos_id; }
std::optional<int64_t> Tokenizer::eos_id() const { return impl_->eos_id; }
const std::string& Tokenizer::bos_token() const { return impl_->bos_token; }
const std::string& Tokenizer::eos_token() const { return impl_->eos_token; }
bool Tokenizer::add_bos_token() const { return impl_->add_bos; }
const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }
int64_t Tokenizer::model_max_length() const { return impl_->model_max_length; }
const std::string& Tokenizer::config_json() const { return impl_->config_json; }

}  // namespace kvserve
