// Lexer and parser of the chat-template interpreter; both follow jinja2's lexer.py/parser.py rule
// for rule so that whitespace control and precedence come out byte-identical.
#include <cstring>
#include <string_view>

#include "text/chat_template.h"
#include "text/jinja.h"

namespace kvserve::text::jinja {
namespace {

[[noreturn]] void syntax_error(const std::string& msg, int line) {
  throw TemplateError("template syntax error: " + msg + " (line " + std::to_string(line) + ")");
}

// Length of the whitespace suffix of text (Python rstrip()).
size_t rstrip_pos(std::string_view text) {
  // Walk forward remembering where the last non-space code point ended.
  size_t i = 0, keep = 0;
  while (i < text.size()) {
    uint32_t cp = next_cp(text, i);
    if (!is_py_space(cp)) keep = i;
  }
  return keep;
}

bool all_space(std::string_view text) {
  if (text.empty()) return false;
  size_t i = 0;
  while (i < text.size())
    if (!is_py_space(next_cp(text, i))) return false;
  return true;
}

// Length of the leading whitespace of s (what `\s*` after `-%}` swallows).
size_t space_prefix(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    if (!is_py_space(next_cp(s, j))) break;
    i = j;
  }
  return i;
}

// Token types, as jinja2 names them.
enum class Tok { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

// One lexed token; Op tokens carry their operator text in `value`.
struct Token {
  Tok type;
  std::string value;
  int line;
  int64_t ival = 0;
  double fval = 0;
};

// Python's unicode-escape decoding of a string literal's body.
std::string unescape(std::string_view s, int line) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c != '\\' || i + 1 >= s.size()) {
      out += c;
      continue;
    }
    char e = s[++i];
    auto hex = [&](int n) -> uint32_t {
      if (i + n >= s.size()) syntax_error("truncated escape in string", line);
      uint32_t v = 0;
      for (int k = 1; k <= n; ++k) {
        char h = s[i + k];
        int d = (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
        if (d < 0) syntax_error("truncated escape in string", line);
        v = v * 16 + d;
      }
      i += n;
      return v;
    };
    switch (e) {
      case '\n': break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x': append_utf8(out, hex(2)); break;
      case 'u': append_utf8(out, hex(4)); break;
      case 'U': {
        uint32_t v = hex(8);
        if (v > 0x10ffff) syntax_error("illegal Unicode character in string", line);
        append_utf8(out, v);
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          uint32_t v = e - '0';
          for (int k = 0; k < 2 && i + 1 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '7'; ++k) v = v * 8 + (s[++i] - '0');
          append_utf8(out, v);
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

bool is_name_start(unsigned char c) { return std::isalpha(c) || c == '_' || c >= 0x80; }
bool is_name_char(unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80; }

// Tokenizer mirroring jinja2's Lexer with trim_blocks=True, lstrip_blocks=True.
class Lexer {
 public:
  explicit Lexer(const std::string& raw) {
    // Newlines normalise to \n and one trailing newline is dropped (keep_trailing_newline=False).
    src_.reserve(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\r') {
        src_ += '\n';
        if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
      } else {
        src_ += raw[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    while (pos_ < src_.size()) root();
    push(Tok::Eof, "");
    return std::move(toks_);
  }

 private:
  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> toks_;

  void push(Tok t, std::string v) { toks_.push_back(Token{t, std::move(v), line_}); }
  void count_lines(std::string_view s) {
    for (char c : s) line_ += c == '\n';
  }
  bool at(size_t p, const char* lit) const { return src_.compare(p, std::strlen(lit), lit) == 0; }

  // Matches `-%}\s*`, `+%}` or `%}\n?` (closing a block) at p; returns the end or npos.
  size_t block_end_at(size_t p, const char* close) const {
    if (at(p, "-") && at(p + 1, close)) return p + 3 + space_prefix(std::string_view(src_).substr(p + 3));
    if (at(p, "+") && at(p + 1, close)) return p + 3;
    if (at(p, close)) return p + 2 + (p + 2 < src_.size() && src_[p + 2] == '\n');
    return std::string::npos;
  }

  void emit_data(std::string_view text) {
    if (!text.empty()) push(Tok::Data, std::string(text));
    count_lines(text);
  }

  // Applies `-` (rstrip) or lstrip_blocks to the text before a tag.
  std::string_view strip_before(std::string_view text, char sign, bool is_variable) const {
    if (sign == '-') return text.substr(0, rstrip_pos(text));
    if (sign != '+' && !is_variable) {
      size_t nl = text.rfind('\n');
      size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting_) && all_space(text.substr(l_pos))) return text.substr(0, l_pos);
    }
    return text;
  }

  void root() {
    size_t p = pos_;
    while (true) {
      p = src_.find('{', p);
      if (p == std::string::npos || p + 1 >= src_.size()) {
        emit_data(std::string_view(src_).substr(pos_));
        pos_ = src_.size();
        return;
      }
      char k = src_[p + 1];
      if (k == '{' || k == '%' || k == '#') break;
      ++p;
    }
    std::string_view text = std::string_view(src_).substr(pos_, p - pos_);
    char k = src_[p + 1];
    char sign = (p + 2 < src_.size() && (src_[p + 2] == '-' || src_[p + 2] == '+')) ? src_[p + 2] : 0;
    size_t after = p + 2 + (sign ? 1 : 0);
    if (k == '%' && try_raw(p, text, sign, after)) return;
    std::string_view kept = strip_before(text, sign, k == '{');
    if (!kept.empty()) push(Tok::Data, std::string(kept));
    count_lines(text);
    pos_ = after;
    line_starting_ = false;
    if (k == '#') {
      comment();
    } else {
      push(k == '{' ? Tok::VarBegin : Tok::BlockBegin, "");
      tag(k == '{' ? "}}" : "%}", k == '{');
    }
  }

  // `{% raw %}...{% endraw %}`: the content is data, verbatim.
  bool try_raw(size_t p, std::string_view text, char sign, size_t after) {
    size_t q = after + space_prefix(std::string_view(src_).substr(after));
    if (!at(q, "raw")) return false;
    q += 3;
    q += space_prefix(std::string_view(src_).substr(q));
    size_t end;
    if (at(q, "-%}")) end = q + 3 + space_prefix(std::string_view(src_).substr(q + 3));
    else if (at(q, "%}")) end = q + 2;
    else return false;
    std::string_view kept = strip_before(text, sign, false);
    if (!kept.empty()) push(Tok::Data, std::string(kept));
    count_lines(std::string_view(src_).substr(pos_, end - pos_));
    // Find the endraw tag.
    size_t r = end;
    while (true) {
      r = src_.find("{%", r);
      if (r == std::string::npos) syntax_error("Missing end of raw directive", line_);
      char s2 = (r + 2 < src_.size() && (src_[r + 2] == '-' || src_[r + 2] == '+')) ? src_[r + 2] : 0;
      size_t t = r + 2 + (s2 ? 1 : 0);
      t += space_prefix(std::string_view(src_).substr(t));
      if (at(t, "endraw")) {
        t += 6;
        t += space_prefix(std::string_view(src_).substr(t));
        size_t e = block_end_at(t, "%}");
        if (e != std::string::npos) {
          line_starting_ = false;  // the raw body is judged like text after the raw tag
          std::string_view body = std::string_view(src_).substr(end, r - end);
          line_starting_ = end > 0 && src_[end - 1] == '\n';
          std::string_view kb = strip_before(body, s2, false);
          if (!kb.empty()) push(Tok::Data, std::string(kb));
          count_lines(std::string_view(src_).substr(end, e - end));
          pos_ = e;
          line_starting_ = src_[e - 1] == '\n';
          return true;
        }
      }
      r += 2;
    }
  }

  void comment() {
    size_t p = pos_;
    while (true) {
      p = src_.find("#}", p);
      if (p == std::string::npos) syntax_error("Missing end of comment tag", line_);
      size_t start = p;
      size_t end;
      if (p > pos_ && src_[p - 1] == '-') {
        start = p - 1;
        end = p + 2 + space_prefix(std::string_view(src_).substr(p + 2));
      } else if (p > pos_ && src_[p - 1] == '+') {
        start = p - 1;
        end = p + 2;
      } else {
        end = p + 2 + (p + 2 < src_.size() && src_[p + 2] == '\n');
      }
      (void)start;
      count_lines(std::string_view(src_).substr(pos_, end - pos_));
      pos_ = end;
      line_starting_ = src_[end - 1] == '\n';
      return;
    }
  }

  // Lexes the inside of {{ }} or {% %} until its (brace-balanced) end tag.
  void tag(const char* close, bool is_variable) {
    std::vector<char> balance;
    while (true) {
      if (pos_ >= src_.size()) syntax_error(is_variable ? "unexpected end of template, expected '}}'" : "unexpected end of template, expected '%}'", line_);
      if (balance.empty()) {
        size_t e = std::string::npos;
        if (is_variable) {
          if (at(pos_, "-}}")) e = pos_ + 3 + space_prefix(std::string_view(src_).substr(pos_ + 3));
          else if (at(pos_, "}}")) e = pos_ + 2;
        } else {
          e = block_end_at(pos_, close);
        }
        if (e != std::string::npos) {
          count_lines(std::string_view(src_).substr(pos_, e - pos_));
          push(is_variable ? Tok::VarEnd : Tok::BlockEnd, "");
          pos_ = e;
          line_starting_ = src_[e - 1] == '\n';
          return;
        }
      }
      std::string_view rest = std::string_view(src_).substr(pos_);
      size_t ws = space_prefix(rest);
      if (ws) {
        count_lines(rest.substr(0, ws));
        pos_ += ws;
        continue;
      }
      unsigned char c = rest[0];
      if (std::isdigit(c)) {
        number(rest);
        continue;
      }
      if (is_name_start(c)) {
        size_t n = 1;
        while (n < rest.size() && is_name_char(rest[n])) ++n;
        push(Tok::Name, std::string(rest.substr(0, n)));
        pos_ += n;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t n = 1;
        while (n < rest.size() && rest[n] != static_cast<char>(c)) n += rest[n] == '\\' ? 2 : 1;
        if (n >= rest.size()) syntax_error("unexpected char '" + std::string(1, c) + "'", line_);
        push(Tok::String, unescape(rest.substr(1, n - 1), line_));
        count_lines(rest.substr(0, n + 1));
        pos_ += n + 1;
        continue;
      }
      static const char* ops2[] = {"**", "//", "==", "!=", ">=", "<="};
      std::string op;
      for (const char* o : ops2)
        if (rest.substr(0, 2) == o) op = o;
      if (op.empty() && std::strchr("+-/*%~[](){}><=.:|,;", c) && c) op = std::string(1, c);
      if (op.empty()) syntax_error(std::string("unexpected char '") + static_cast<char>(c) + "'", line_);
      if (op == "{" || op == "(" || op == "[") balance.push_back(op == "{" ? '}' : op == "(" ? ')' : ']');
      if (op == "}" || op == ")" || op == "]") {
        if (balance.empty()) syntax_error("unexpected '" + op + "'", line_);
        if (balance.back() != op[0]) syntax_error("unexpected '" + op + "', expected '" + std::string(1, balance.back()) + "'", line_);
        balance.pop_back();
      }
      push(Tok::Op, op);
      pos_ += op.size();
    }
  }

  // Integer or float literal (float_re tried first, as in jinja2; `(?<!\.)` keeps `a.0.1` apart).
  void number(std::string_view rest) {
    auto digits = [&](size_t p) {  // (\d+_)*\d+ ; returns end or p when none
      size_t q = p;
      while (true) {
        size_t r = q;
        while (r < rest.size() && std::isdigit(static_cast<unsigned char>(rest[r]))) ++r;
        if (r == q) return q == p ? p : q - 1;  // drop a dangling '_'
        q = r;
        if (q < rest.size() && rest[q] == '_' && q + 1 < rest.size() && std::isdigit(static_cast<unsigned char>(rest[q + 1]))) {
          ++q;
          continue;
        }
        return q;
      }
    };
    bool after_dot = pos_ > 0 && src_[pos_ - 1] == '.';
    size_t ip = digits(0);
    if (!after_dot) {
      size_t q = ip;
      bool frac = false;
      if (q < rest.size() && rest[q] == '.' && q + 1 < rest.size() && std::isdigit(static_cast<unsigned char>(rest[q + 1]))) {
        q = digits(q + 1);
        frac = true;
      }
      size_t fend = frac ? q : std::string_view::npos;
      if (q < rest.size() && (rest[q] == 'e' || rest[q] == 'E')) {
        size_t r = q + 1;
        if (r < rest.size() && (rest[r] == '+' || rest[r] == '-')) ++r;
        if (r < rest.size() && std::isdigit(static_cast<unsigned char>(rest[r]))) fend = digits(r);
      }
      if (fend != std::string_view::npos) {
        std::string lit;
        for (char ch : rest.substr(0, fend))
          if (ch != '_') lit += ch;
        Token t{Tok::Float, std::string(rest.substr(0, fend)), line_};
        t.fval = std::strtod(lit.c_str(), nullptr);
        toks_.push_back(t);
        pos_ += fend;
        return;
      }
    }
    // integer_re
    int base = 10;
    size_t start = 0, end = 0;
    if (rest.size() > 2 && rest[0] == '0' && std::strchr("bBoOxX", rest[1])) {
      base = (rest[1] == 'b' || rest[1] == 'B') ? 2 : (rest[1] == 'o' || rest[1] == 'O') ? 8 : 16;
      start = 2;
      size_t q = 2;
      while (q < rest.size()) {
        size_t r = q;
        if (rest[r] == '_') ++r;
        if (r >= rest.size()) break;
        char h = static_cast<char>(std::tolower(static_cast<unsigned char>(rest[r])));
        int d = (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : 99;
        if (d >= base) break;
        q = r + 1;
      }
      end = q;
      if (end == 2) { base = 10; start = 0; end = 0; }
    }
    if (end == 0) {
      if (rest[0] == '0') {
        size_t q = 1;
        while (q + 1 < rest.size() + 1) {
          size_t r = q;
          if (r < rest.size() && rest[r] == '_') ++r;
          if (r < rest.size() && rest[r] == '0') q = r + 1;
          else break;
        }
        end = q;
      } else {
        size_t q = 1;
        while (true) {
          size_t r = q;
          if (r < rest.size() && rest[r] == '_') ++r;
          if (r < rest.size() && std::isdigit(static_cast<unsigned char>(rest[r]))) q = r + 1;
          else break;
        }
        end = q;
      }
    }
    int64_t v = 0;
    for (size_t q = start; q < end; ++q) {
      char h = static_cast<char>(std::tolower(static_cast<unsigned char>(rest[q])));
      if (h == '_') continue;
      int d = (h >= '0' && h <= '9') ? h - '0' : h - 'a' + 10;
      if (__builtin_mul_overflow(v, base, &v) || __builtin_add_overflow(v, d, &v)) syntax_error("integer literal too large", line_);
    }
    Token t{Tok::Int, std::string(rest.substr(0, end)), line_};
    t.ival = v;
    toks_.push_back(t);
    pos_ += end;
  }
};

constexpr int kMaxDepth = 200;

// Recursive-descent parser with jinja2's grammar and precedence.
class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  Body parse_all() {
    Body b = subparse({});
    if (cur().type != Tok::Eof) fail("unexpected '" + describe(cur()) + "'");
    return b;
  }

 private:
  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  std::vector<std::string> tag_stack_;

  // Guards the C++ stack against deeply nested input.
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& pp) : p(pp) {
      if (++p.depth_ > kMaxDepth) p.fail("template nesting too deep");
    }
    ~DepthGuard() { --p.depth_; }
  };

  const Token& cur() const { return t_[i_]; }
  const Token& look() const { return t_[std::min(i_ + 1, t_.size() - 1)]; }
  Token next() {
    Token t = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return t;
  }
  [[noreturn]] void fail(const std::string& msg) const { syntax_error(msg, cur().line); }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::Eof: return "end of template";
      case Tok::VarEnd: return "end of print statement";
      case Tok::BlockEnd: return "end of statement block";
      case Tok::VarBegin: return "begin of print statement";
      case Tok::BlockBegin: return "begin of statement block";
      case Tok::Data: return "template data";
      default: return t.value;
    }
  }

  bool is_name(const char* n) const { return cur().type == Tok::Name && cur().value == n; }
  bool is_op(const char* o) const { return cur().type == Tok::Op && cur().value == o; }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  bool skip_op(const char* o) {
    if (!is_op(o)) return false;
    next();
    return true;
  }
  void expect_op(const char* o) {
    if (!skip_op(o)) fail(std::string("expected token '") + o + "', got '" + describe(cur()) + "'");
  }
  void expect_name(const char* n) {
    if (!skip_name(n)) fail(std::string("expected token '") + n + "', got '" + describe(cur()) + "'");
  }
  std::string expect_any_name() {
    if (cur().type != Tok::Name) fail("expected token 'name', got '" + describe(cur()) + "'");
    return next().value;
  }
  void expect_block_end() {
    if (cur().type != Tok::BlockEnd) fail("expected token 'end of statement block', got '" + describe(cur()) + "'");
    next();
  }

  ExprPtr node(ExprKind k) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = cur().line;
    return e;
  }

  // ---- statements ----

  Body subparse(const std::vector<std::string>& end_tokens) {
    Body body;
    while (cur().type != Tok::Eof) {
      const Token& t = cur();
      if (t.type == Tok::Data) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Data;
        s->text = t.value;
        s->line = t.line;
        body.push_back(std::move(s));
        next();
      } else if (t.type == Tok::VarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Print;
        s->line = t.line;
        s->expr = parse_tuple(false, true, {}, false);
        if (cur().type != Tok::VarEnd) fail("expected token 'end of print statement', got '" + describe(cur()) + "'");
        next();
        body.push_back(std::move(s));
      } else if (t.type == Tok::BlockBegin) {
        next();
        if (cur().type == Tok::Name)
          for (const auto& e : end_tokens)
            if (cur().value == e) return body;
        body.push_back(parse_statement());
        expect_block_end();
      } else {
        fail("unexpected '" + describe(t) + "'");
      }
    }
    return body;
  }

  // Parses `%}` body up to one of end_tokens; leaves the end token current unless drop.
  Body parse_statements(const std::vector<std::string>& end_tokens, bool drop) {
    DepthGuard g(*this);
    skip_op(":");
    expect_block_end();
    Body b = subparse(end_tokens);
    if (cur().type == Tok::Eof) {
      std::string expect;
      for (const auto& e : end_tokens) expect += (expect.empty() ? "'" : " or '") + e + "'";
      fail("Unexpected end of template. Jinja was looking for the following tags: " + expect + ".");
    }
    if (drop) next();
    return b;
  }

  StmtPtr make(StmtKind k, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = k;
    s->line = line;
    return s;
  }

  StmtPtr parse_statement() {
    if (cur().type != Tok::Name) fail("tag name expected");
    std::string kw = cur().value;
    int line = cur().line;
    if (kw == "for") return parse_for();
    if (kw == "if") return parse_if();
    if (kw == "set") return parse_set();
    if (kw == "macro") return parse_macro();
    if (kw == "call") return parse_call_block();
    if (kw == "filter") {
      next();
      auto s = make(StmtKind::FilterBlock, line);
      s->expr = parse_filter(nullptr, true);
      s->body = parse_statements({"endfilter"}, true);
      return s;
    }
    if (kw == "with") {
      next();
      auto s = make(StmtKind::With, line);
      while (cur().type != Tok::BlockEnd) {
        if (!s->with_targets.empty()) expect_op(",");
        s->with_targets.push_back(parse_assign_target(false));
        expect_op("=");
        s->with_values.push_back(parse_expression(true));
      }
      s->body = parse_statements({"endwith"}, true);
      return s;
    }
    if (kw == "print") {
      next();
      auto s = make(StmtKind::Print, line);
      s->expr = parse_tuple(false, true, {}, false);
      return s;
    }
    if (kw == "break" || kw == "continue") {
      next();
      bool in_loop = false;
      for (const auto& t : tag_stack_) in_loop |= t == "for";
      if (!in_loop) fail("'" + kw + "' outside of a loop");  // jinja2 accepts it but it fails at compile time
      return make(kw == "break" ? StmtKind::Break : StmtKind::Continue, line);
    }
    if (kw == "generation") {
      // transformers' AssistantTracker tag: renders its body unchanged.
      next();
      auto s = make(StmtKind::Scope, line);
      s->body = parse_statements({"endgeneration"}, true);
      return s;
    }
    if (kw == "autoescape") {
      next();
      parse_expression(true);
      auto s = make(StmtKind::Scope, line);
      s->body = parse_statements({"endautoescape"}, true);
      return s;
    }
    if (kw == "block" || kw == "extends" || kw == "include" || kw == "import" || kw == "from")
      fail("'" + kw + "' is not supported in chat templates");
    fail("Encountered unknown tag '" + kw + "'.");
  }

  StmtPtr parse_for() {
    int line = next().line;
    auto s = make(StmtKind::For, line);
    s->target = parse_assign_target(false);
    expect_name("in");
    s->expr = parse_tuple(false, false, {"recursive"}, false);
    if (skip_name("if")) s->cond = parse_expression(true);
    s->recursive = skip_name("recursive");
    tag_stack_.push_back("for");
    s->body = parse_statements({"endfor", "else"}, false);
    tag_stack_.pop_back();
    if (next().value != "endfor") s->else_body = parse_statements({"endfor"}, true);
    return s;
  }

  StmtPtr parse_if() {
    int line = next().line;
    auto s = make(StmtKind::If, line);
    while (true) {
      ExprPtr test = parse_tuple(false, false, {}, false);
      Body b = parse_statements({"elif", "else", "endif"}, false);
      s->branches.emplace_back(std::move(test), std::move(b));
      Token t = next();
      if (t.value == "elif") continue;
      if (t.value == "else") s->else_body = parse_statements({"endif"}, true);
      break;
    }
    return s;
  }

  StmtPtr parse_set() {
    int line = next().line;
    Target target = parse_assign_target(true);
    if (skip_op("=")) {
      auto s = make(StmtKind::Set, line);
      s->target = std::move(target);
      s->expr = parse_tuple(false, true, {}, false);
      return s;
    }
    auto s = make(StmtKind::SetBlock, line);
    s->target = std::move(target);
    s->expr = parse_filter(nullptr, false);
    s->body = parse_statements({"endset"}, true);
    return s;
  }

  void parse_signature(Stmt& s) {
    expect_op("(");
    while (!is_op(")")) {
      if (!s.params.empty()) expect_op(",");
      s.params.push_back(expect_any_name());
      if (skip_op("=")) s.defaults.push_back(parse_expression(true));
      else if (!s.defaults.empty()) fail("non-default argument follows default argument");
    }
    expect_op(")");
  }

  StmtPtr parse_macro() {
    int line = next().line;
    auto s = make(StmtKind::Macro, line);
    s->text = expect_any_name();
    parse_signature(*s);
    s->body = parse_statements({"endmacro"}, true);
    return s;
  }

  StmtPtr parse_call_block() {
    int line = next().line;
    auto s = make(StmtKind::CallBlock, line);
    if (is_op("(")) parse_signature(*s);
    s->expr = parse_expression(true);
    if (s->expr->kind != ExprKind::Call) fail("expected call");
    s->body = parse_statements({"endcall"}, true);
    return s;
  }

  // Name, `a, b` tuple, or (with_namespace) `ns.attr`.
  Target parse_assign_target(bool with_namespace) {
    Target t;
    auto one = [&]() {
      if (cur().type != Tok::Name) fail("can't assign to '" + describe(cur()) + "'");
      std::string n = next().value;
      if (n == "true" || n == "false" || n == "True" || n == "False" || n == "none" || n == "None")
        fail("can't assign to '" + n + "'");
      return n;
    };
    if (with_namespace && cur().type == Tok::Name && look().type == Tok::Op && look().value == ".") {
      t.names.push_back(next().value);
      next();
      t.ns_attr = expect_any_name();
      return t;
    }
    bool paren = skip_op("(");
    t.names.push_back(one());
    while (skip_op(",")) {
      t.is_tuple = true;
      if (cur().type != Tok::Name) break;
      t.names.push_back(one());
    }
    if (paren) {
      t.is_tuple = true;
      expect_op(")");
    }
    return t;
  }

  // ---- expressions ----

  bool is_tuple_end(const std::vector<std::string>& extra) const {
    if (cur().type == Tok::VarEnd || cur().type == Tok::BlockEnd || cur().type == Tok::Eof) return true;
    if (is_op(")")) return true;
    for (const auto& e : extra)
      if (cur().type == Tok::Name && cur().value == e) return true;
    return false;
  }

  ExprPtr parse_tuple(bool simplified, bool with_condexpr, const std::vector<std::string>& extra, bool explicit_parens) {
    (void)simplified;
    int line = cur().line;
    std::vector<ExprPtr> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) expect_op(",");
      if (is_tuple_end(extra)) break;
      args.push_back(parse_expression(with_condexpr));
      if (is_op(",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parens) fail("Expected an expression, got '" + describe(cur()) + "'");
    }
    auto e = node(ExprKind::TupleLit);
    e->line = line;
    e->args = std::move(args);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard g(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr e1 = parse_or();
    while (skip_name("if")) {
      auto c = node(ExprKind::CondExpr);
      c->a = parse_or();  // test
      c->b = std::move(e1);  // value when true
      if (skip_name("else")) c->c = parse_condexpr();
      e1 = std::move(c);
    }
    return e1;
  }

  ExprPtr binary(ExprKind k, ExprPtr l, ExprPtr r) {
    auto e = node(k);
    e->a = std::move(l);
    e->b = std::move(r);
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr l = parse_and();
    while (skip_name("or")) l = binary(ExprKind::Or, std::move(l), parse_and());
    return l;
  }
  ExprPtr parse_and() {
    ExprPtr l = parse_not();
    while (skip_name("and")) l = binary(ExprKind::And, std::move(l), parse_not());
    return l;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      next();
      DepthGuard g(*this);
      auto e = node(ExprKind::Not);
      e->a = parse_not();
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr first = parse_math1();
    auto e = node(ExprKind::Compare);
    while (true) {
      static const std::pair<const char*, const char*> cmp[] = {{"==", "eq"}, {"!=", "ne"}, {"<", "lt"}, {"<=", "lteq"}, {">", "gt"}, {">=", "gteq"}};
      std::string op;
      if (cur().type == Tok::Op)
        for (auto& [sym, name] : cmp)
          if (cur().value == sym) op = name;
      if (!op.empty()) {
        next();
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && look().type == Tok::Name && look().value == "in") {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      e->ops.push_back(op);
      e->args.push_back(parse_math1());
    }
    if (e->ops.empty()) return first;
    e->a = std::move(first);
    return e;
  }
  ExprPtr parse_math1() {
    ExprPtr l = parse_concat();
    while (is_op("+") || is_op("-")) {
      ExprKind k = next().value == "+" ? ExprKind::Add : ExprKind::Sub;
      l = binary(k, std::move(l), parse_concat());
    }
    return l;
  }
  ExprPtr parse_concat() {
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto e = node(ExprKind::Concat);
    e->args.push_back(std::move(first));
    while (skip_op("~")) e->args.push_back(parse_math2());
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string o = next().value;
      ExprKind k = o == "*" ? ExprKind::Mul : o == "/" ? ExprKind::Div : o == "//" ? ExprKind::FloorDiv : ExprKind::Mod;
      l = binary(k, std::move(l), parse_pow());
    }
    return l;
  }
  ExprPtr parse_pow() {
    ExprPtr l = parse_unary(true);
    while (skip_op("**")) l = binary(ExprKind::Pow, std::move(l), parse_unary(true));
    return l;
  }
  ExprPtr parse_unary(bool with_filter) {
    DepthGuard g(*this);
    ExprPtr n;
    if (is_op("-") || is_op("+")) {
      auto e = node(next().value == "-" ? ExprKind::Neg : ExprKind::Pos);
      e->a = parse_unary(false);
      n = std::move(e);
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
  }
  ExprPtr parse_primary() {
    const Token& t = cur();
    if (t.type == Tok::Name) {
      Token tok = next();
      auto e = node(ExprKind::Const);
      e->line = tok.line;
      if (tok.value == "true" || tok.value == "True") e->constant = Value::boolean(true);
      else if (tok.value == "false" || tok.value == "False") e->constant = Value::boolean(false);
      else if (tok.value == "none" || tok.value == "None") e->constant = Value::none();
      else {
        e->kind = ExprKind::Name;
        e->name = tok.value;
      }
      return e;
    }
    if (t.type == Tok::String) {
      auto e = node(ExprKind::Const);
      std::string s;
      while (cur().type == Tok::String) s += next().value;
      e->constant = Value::string(std::move(s));
      return e;
    }
    if (t.type == Tok::Int || t.type == Tok::Float) {
      auto e = node(ExprKind::Const);
      e->constant = t.type == Tok::Int ? Value::integer(t.ival) : Value::number(t.fval);
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      ExprPtr e = parse_tuple(false, true, {}, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      auto e = node(ExprKind::ListLit);
      next();
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return e;
    }
    if (is_op("{")) {
      auto e = node(ExprKind::DictLit);
      next();
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      expect_op("}");
      return e;
    }
    fail("unexpected '" + describe(t) + "'");
  }

  ExprPtr parse_postfix(ExprPtr n) {
    while (true) {
      if (is_op(".") || is_op("[")) n = parse_subscript(std::move(n));
      else if (is_op("(")) n = parse_call(std::move(n));
      else break;
    }
    return n;
  }
  ExprPtr parse_filter_expr(ExprPtr n) {
    while (true) {
      if (is_op("|")) n = parse_filter(std::move(n), false);
      else if (is_name("is")) n = parse_test(std::move(n));
      else if (is_op("(")) n = parse_call(std::move(n));
      else break;
    }
    return n;
  }

  ExprPtr parse_subscript(ExprPtr n) {
    DepthGuard g(*this);
    Token t = next();
    if (t.value == ".") {
      Token a = next();
      if (a.type == Tok::Name) {
        auto e = node(ExprKind::Getattr);
        e->a = std::move(n);
        e->name = a.value;
        return e;
      }
      if (a.type != Tok::Int) fail("expected name or number");
      auto e = node(ExprKind::Getitem);
      e->a = std::move(n);
      e->b = node(ExprKind::Const);
      e->b->constant = Value::integer(a.ival);
      return e;
    }
    std::vector<ExprPtr> args;
    while (!is_op("]")) {
      if (!args.empty()) expect_op(",");
      args.push_back(parse_subscribed());
    }
    expect_op("]");
    auto e = node(ExprKind::Getitem);
    e->a = std::move(n);
    if (args.size() == 1) {
      e->b = std::move(args[0]);
    } else {
      e->b = node(ExprKind::TupleLit);
      e->b->args = std::move(args);
    }
    return e;
  }

  ExprPtr parse_subscribed() {
    ExprPtr start;
    if (!skip_op(":")) {
      start = parse_expression(true);
      if (!is_op(":")) return start;
      next();
    }
    auto s = node(ExprKind::Slice);
    s->a = std::move(start);
    if (!is_op(":") && !is_op("]") && !is_op(",")) s->b = parse_expression(true);
    if (skip_op(":"))
      if (!is_op("]") && !is_op(",")) s->c = parse_expression(true);
    return s;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool require_comma = false;
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (skip_op("*")) {
        if (e.dyn_args || e.dyn_kwargs) fail("invalid syntax for function call expression");
        e.dyn_args = parse_expression(true);
      } else if (skip_op("**")) {
        if (e.dyn_kwargs) fail("invalid syntax for function call expression");
        e.dyn_kwargs = parse_expression(true);
      } else if (cur().type == Tok::Name && look().type == Tok::Op && look().value == "=") {
        if (e.dyn_kwargs) fail("invalid syntax for function call expression");
        std::string key = next().value;
        next();
        e.kwargs.emplace_back(key, parse_expression(true));
      } else {
        if (e.dyn_args || e.dyn_kwargs || !e.kwargs.empty()) fail("invalid syntax for function call expression");
        e.args.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr n) {
    DepthGuard g(*this);
    auto e = node(ExprKind::Call);
    e->a = std::move(n);
    parse_call_args(*e);
    return e;
  }

  ExprPtr parse_filter(ExprPtr n, bool start_inline) {
    while (is_op("|") || start_inline) {
      DepthGuard g(*this);
      if (!start_inline) next();
      auto e = node(ExprKind::Filter);
      e->name = expect_any_name();
      while (skip_op(".")) e->name += "." + expect_any_name();
      if (is_op("(")) parse_call_args(*e);
      e->a = std::move(n);
      n = std::move(e);
      start_inline = false;
    }
    return n;
  }

  ExprPtr parse_test(ExprPtr n) {
    DepthGuard g(*this);
    next();  // 'is'
    auto e = node(ExprKind::Test);
    e->negated = skip_name("not");
    e->name = expect_any_name();
    while (skip_op(".")) e->name += "." + expect_any_name();
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((cur().type == Tok::Name || cur().type == Tok::String || cur().type == Tok::Int || cur().type == Tok::Float ||
                is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail("You cannot chain multiple tests with is");
      e->args.push_back(parse_postfix(parse_primary()));
    }
    e->a = std::move(n);
    return e;
  }
};

}  // namespace

std::shared_ptr<const Program> parse(const std::string& source) {
  auto p = std::make_shared<Program>();
  Parser parser(Lexer(source).run());
  p->body = parser.parse_all();
  return p;
}

}  // namespace kvserve::text::jinja
