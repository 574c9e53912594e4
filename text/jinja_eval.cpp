// Evaluator of the chat-template interpreter: statements, expressions, jinja2's filters and tests,
// and the Python str/dict/list methods templates call, under ImmutableSandboxedEnvironment rules.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <unordered_map>

#include "text/chat_template.h"
#include "text/jinja.h"

namespace kvserve::text::jinja {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw TemplateError(msg); }

// Using an Undefined in a way that needs a value raises its hint, as jinja2's Undefined does.
[[noreturn]] void fail_undefined(const Value& v) {
  fail(v.s.empty() ? std::string("value is undefined") : v.s);
}

std::string object_desc(const Value& v) {
  if (v.kind == Kind::None) return "None";
  if (v.kind == Kind::Namespace) return "jinja2.utils.Namespace object";
  return type_name(v) + " object";
}

Value undefined_attr(const Value& obj, const std::string& name) {
  return Value::undefined("'" + object_desc(obj) + "' has no attribute '" + name + "'");
}

// ---- UTF-8 string helpers ----

std::vector<uint32_t> cps(const std::string& s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) out.push_back(next_cp(s, i));
  return out;
}
std::string from_cps(const std::vector<uint32_t>& v, size_t b = 0, size_t e = SIZE_MAX) {
  std::string out;
  e = std::min(e, v.size());
  for (size_t k = b; k < e; ++k) append_utf8(out, v[k]);
  return out;
}
size_t cp_len(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xc0) != 0x80;
  return n;
}
size_t cp_index_of_byte(const std::string& s, size_t byte) {
  size_t n = 0;
  for (size_t k = 0; k < byte && k < s.size(); ++k) n += (static_cast<unsigned char>(s[k]) & 0xc0) != 0x80;
  return n;
}

uint32_t cp_lower(uint32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  if ((c >= 0xc0 && c <= 0xde && c != 0xd7)) return c + 32;
  if (c >= 0x100 && c <= 0x137) return c | 1;
  if (c >= 0x139 && c <= 0x148) return (c & 1) ? c + 1 : c;
  if (c >= 0x14a && c <= 0x177) return c | 1;
  if (c == 0x178) return 0xff;
  if (c >= 0x179 && c <= 0x17e) return (c & 1) ? c + 1 : c;
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) return c + 32;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}
uint32_t cp_upper(uint32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  if ((c >= 0xe0 && c <= 0xfe && c != 0xf7)) return c - 32;
  if (c == 0xff) return 0x178;
  if (c >= 0x100 && c <= 0x137) return c & ~1u;
  if (c >= 0x139 && c <= 0x148) return (c & 1) ? c : c - 1;
  if (c >= 0x14a && c <= 0x177) return c & ~1u;
  if (c >= 0x179 && c <= 0x17e) return (c & 1) ? c : c - 1;
  if (c >= 0x3b1 && c <= 0x3c9 && c != 0x3c2) return c - 32;
  if (c == 0x3c2) return 0x3a3;
  if (c >= 0x430 && c <= 0x44f) return c - 32;
  if (c >= 0x450 && c <= 0x45f) return c - 80;
  return c;
}
bool cp_cased(uint32_t c) { return cp_lower(c) != c || cp_upper(c) != c || c == 0xdf; }
bool cp_alpha(uint32_t c) {
  return (c < 0x80 && std::isalpha(static_cast<int>(c))) || (c >= 0x80 && (cp_cased(c) || (c >= 0x4e00 && c <= 0x9fff) || (c >= 0x3040 && c <= 0x30ff) || (c >= 0xac00 && c <= 0xd7af)));
}
// Python's `\w` (str.isalnum() or '_'), approximated: non-ASCII counts as a word character unless
// it is whitespace, Latin-1 punctuation, a combining mark, general punctuation/symbols or emoji.
bool cp_word(uint32_t c) {
  if (c < 0x80) return std::isalnum(static_cast<int>(c)) || c == '_';
  if (is_py_space(c)) return false;
  if (c < 0xc0) return c == 0xaa || c == 0xb2 || c == 0xb3 || c == 0xb5 || c == 0xb9 || c == 0xba || (c >= 0xbc && c <= 0xbe);
  if (c == 0xd7 || c == 0xf7) return false;
  if ((c >= 0x300 && c <= 0x36f) || (c >= 0x2000 && c <= 0x2bff) || (c >= 0x3000 && c <= 0x3004) || (c >= 0x3008 && c <= 0x3020) ||
      (c >= 0xfe00 && c <= 0xfe0f) || (c >= 0xfe30 && c <= 0xfe4f) || (c >= 0xff01 && c <= 0xff0f) || (c >= 0xff1a && c <= 0xff20) ||
      (c >= 0x1f000 && c <= 0x1faff) || (c >= 0xe0000 && c <= 0xe007f))
    return false;
  return true;
}

void append_upper(std::string& out, uint32_t c) {
  if (c == 0xdf) out += "SS";
  else append_utf8(out, cp_upper(c));
}
std::string str_lower(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) append_utf8(out, cp_lower(next_cp(s, i)));
  return out;
}
std::string str_upper(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) append_upper(out, next_cp(s, i));
  return out;
}
std::string str_capitalize(const std::string& s) {
  std::string out;
  size_t i = 0;
  bool first = true;
  while (i < s.size()) {
    uint32_t c = next_cp(s, i);
    if (first) append_upper(out, c);
    else append_utf8(out, cp_lower(c));
    first = false;
  }
  return out;
}
// Python str.title(): a cased letter after an uncased character starts a word.
std::string str_title_method(const std::string& s) {
  std::string out;
  size_t i = 0;
  bool prev_cased = false;
  while (i < s.size()) {
    uint32_t c = next_cp(s, i);
    if (prev_cased) append_utf8(out, cp_lower(c));
    else append_upper(out, c);
    prev_cased = cp_cased(c);
  }
  return out;
}
// jinja2's title filter: words start after `-`, whitespace, `(`, `{`, `[` or `<`.
std::string str_title_filter(const std::string& s) {
  std::string out;
  size_t i = 0;
  bool start = true;
  while (i < s.size()) {
    uint32_t c = next_cp(s, i);
    bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_py_space(c);
    if (start) append_upper(out, c);
    else append_utf8(out, cp_lower(c));
    start = sep;
  }
  return out;
}

bool in_chars(uint32_t c, const std::vector<uint32_t>* chars) {
  if (!chars) return is_py_space(c);
  return std::find(chars->begin(), chars->end(), c) != chars->end();
}
std::string str_strip(const std::string& s, const Value* chars_v, bool left, bool right) {
  std::vector<uint32_t> chars;
  const std::vector<uint32_t>* cp_set = nullptr;
  if (chars_v && !chars_v->is_none()) {
    if (!chars_v->is_string()) fail("strip arg must be None or str");
    chars = cps(chars_v->s);
    cp_set = &chars;
  }
  std::vector<uint32_t> v = cps(s);
  size_t b = 0, e = v.size();
  if (left)
    while (b < e && in_chars(v[b], cp_set)) ++b;
  if (right)
    while (e > b && in_chars(v[e - 1], cp_set)) --e;
  if (b == 0 && e == v.size()) return s;
  return from_cps(v, b, e);
}

std::vector<std::string> str_split(const std::string& s, const Value* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (!sep || sep->is_none()) {
    std::vector<uint32_t> v = cps(s);
    size_t k = 0;
    while (true) {
      while (k < v.size() && is_py_space(v[k])) ++k;
      if (k >= v.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
        size_t e = v.size();
        while (e > k && is_py_space(v[e - 1])) --e;
        out.push_back(from_cps(v, k, e));
        break;
      }
      size_t b = k;
      while (k < v.size() && !is_py_space(v[k])) ++k;
      out.push_back(from_cps(v, b, k));
    }
    return out;
  }
  if (!sep->is_string()) fail("must be str or None, not " + type_name(*sep));
  if (sep->s.empty()) fail("empty separator");
  size_t p = 0;
  while (true) {
    size_t q = s.find(sep->s, p);
    if (q == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit)) {
      out.push_back(s.substr(p));
      break;
    }
    out.push_back(s.substr(p, q - p));
    p = q + sep->s.size();
  }
  return out;
}

std::vector<std::string> str_splitlines(const std::string& s, bool keepends) {
  std::vector<std::string> out;
  std::vector<uint32_t> v = cps(s);
  size_t b = 0, k = 0;
  while (k < v.size()) {
    uint32_t c = v[k];
    bool br = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || (c >= 0x1c && c <= 0x1e) || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!br) {
      ++k;
      continue;
    }
    size_t e = k + 1;
    if (c == '\r' && e < v.size() && v[e] == '\n') ++e;
    out.push_back(from_cps(v, b, keepends ? e : k));
    b = k = e;
  }
  if (b < v.size()) out.push_back(from_cps(v, b));
  return out;
}

std::string str_replace(const std::string& s, const std::string& old, const std::string& rep, int64_t count, size_t limit) {
  std::string out;
  if (old.empty()) {
    std::vector<uint32_t> v = cps(s);
    int64_t n = 0;
    for (size_t k = 0; k <= v.size(); ++k) {
      if (count < 0 || n < count) {
        out += rep;
        ++n;
      }
      if (k < v.size()) append_utf8(out, v[k]);
      if (out.size() > limit) fail("string too long");
    }
    return out;
  }
  size_t p = 0;
  int64_t n = 0;
  while (true) {
    size_t q = (count < 0 || n < count) ? s.find(old, p) : std::string::npos;
    if (q == std::string::npos) break;
    out.append(s, p, q - p);
    out += rep;
    if (out.size() > limit) fail("string too long");
    p = q + old.size();
    ++n;
  }
  out.append(s, p, std::string::npos);
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

int64_t as_int(const Value& v, const char* what) {
  if (v.kind == Kind::Int || v.kind == Kind::Bool) return v.i;
  fail(std::string(what) + ": '" + type_name(v) + "' object cannot be interpreted as an integer");
}
double as_float(const Value& v) { return v.kind == Kind::Float ? v.f : static_cast<double>(v.i); }

Value make_tuple(Value a, Value b) { return Value::make_list({std::move(a), std::move(b)}, Kind::Tuple); }

// Python printf-style formatting (`"%s" % x`, the `format` filter) for the common conversions.
std::string percent_format(const std::string& fmt, const std::vector<Value>& args, const Value* mapping) {
  std::string out;
  size_t ai = 0;
  for (size_t k = 0; k < fmt.size(); ++k) {
    if (fmt[k] != '%') {
      out += fmt[k];
      continue;
    }
    if (++k >= fmt.size()) fail("incomplete format");
    if (fmt[k] == '%') {
      out += '%';
      continue;
    }
    const Value* arg = nullptr;
    if (fmt[k] == '(') {
      size_t e = fmt.find(')', k);
      if (e == std::string::npos || !mapping) fail("format requires a mapping");
      arg = mapping->dict->find(fmt.substr(k + 1, e - k - 1));
      if (!arg) fail("KeyError: " + fmt.substr(k + 1, e - k - 1));
      k = e + 1;
    }
    std::string spec = "%";
    while (k < fmt.size() && std::strchr("-+ #0123456789.", fmt[k])) spec += fmt[k++];
    if (k >= fmt.size()) fail("incomplete format");
    char conv = fmt[k];
    if (!arg) {
      if (ai >= args.size()) fail("not enough arguments for format string");
      arg = &args[ai++];
    }
    char buf[512];
    switch (conv) {
      case 's':
      case 'r': {
        std::string s = conv == 's' ? to_str(*arg) : repr(*arg);
        std::snprintf(buf, sizeof buf, (spec + "s").c_str(), "");
        if (spec == "%") out += s;
        else {
          // width/alignment on strings: pad by code points
          bool left = spec.find('-') != std::string::npos;
          size_t width = 0;
          for (char c : spec)
            if (std::isdigit(static_cast<unsigned char>(c))) width = width * 10 + (c - '0');
          size_t len = cp_len(s);
          std::string pad = len < width ? std::string(width - len, ' ') : "";
          out += left ? s + pad : pad + s;
        }
        break;
      }
      case 'd':
      case 'i': {
        if (!arg->is_number()) fail("%d format: a real number is required, not " + type_name(*arg));
        int64_t v = arg->kind == Kind::Float ? static_cast<int64_t>(arg->f) : arg->i;
        std::snprintf(buf, sizeof buf, (spec + "lld").c_str(), static_cast<long long>(v));
        out += buf;
        break;
      }
      case 'f':
      case 'F':
      case 'e':
      case 'g': {
        if (!arg->is_number()) fail("must be real number, not " + type_name(*arg));
        std::snprintf(buf, sizeof buf, (spec + conv).c_str(), as_float(*arg));
        out += buf;
        break;
      }
      case 'x':
      case 'X':
      case 'o': {
        int64_t v = as_int(*arg, "format");
        std::snprintf(buf, sizeof buf, (spec + "ll" + conv).c_str(), static_cast<long long>(v));
        out += buf;
        break;
      }
      default: fail(std::string("unsupported format character '") + conv + "'");
    }
  }
  if (ai < args.size() && !mapping) fail("not all arguments converted during string formatting");
  return out;
}

// Python str.format() for `{}`, `{0}`, `{name}` fields without format specs.
std::string brace_format(const std::string& fmt, const CallArgs& args) {
  std::string out;
  size_t auto_idx = 0;
  for (size_t k = 0; k < fmt.size(); ++k) {
    char c = fmt[k];
    if (c == '{' && k + 1 < fmt.size() && fmt[k + 1] == '{') {
      out += '{';
      ++k;
    } else if (c == '}' && k + 1 < fmt.size() && fmt[k + 1] == '}') {
      out += '}';
      ++k;
    } else if (c == '{') {
      size_t e = fmt.find('}', k);
      if (e == std::string::npos) fail("Single '{' encountered in format string");
      std::string field = fmt.substr(k + 1, e - k - 1);
      std::string conv;
      size_t colon = field.find_first_of(":!");
      if (colon != std::string::npos) {
        conv = field.substr(colon);
        field = field.substr(0, colon);
      }
      const Value* v = nullptr;
      if (field.empty()) {
        v = args.get(auto_idx++, nullptr);
      } else if (std::all_of(field.begin(), field.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); })) {
        v = args.get(std::stoul(field), nullptr);
      } else {
        for (const auto& [kname, kv] : args.kw)
          if (kname == field) v = &kv;
      }
      if (!v) fail("Replacement index " + field + " out of range for positional args tuple");
      if (conv == "!r") out += repr(*v);
      else if (conv.empty() || conv == "!s") out += to_str(*v);
      else fail("format spec '" + conv + "' is not supported");
      k = e;
    } else if (c == '}') {
      fail("Single '}' encountered in format string");
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

// Variables of one frame: the template top level, one loop iteration, a macro call.
struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
  const Value* lookup(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using ScopePtr = std::shared_ptr<Scope>;

// What a statement asks its enclosing loop to do next.
enum class Flow { Normal, Break, Continue };

using FilterFn = Value (*)(Evaluator&, const Value&, CallArgs&);
using TestFn = bool (*)(Evaluator&, const Value&, CallArgs&);

// Walks the syntax tree, writing output; one per render() call.
struct Evaluator {
  const Limits& limits;
  std::string* out;
  size_t steps = 0;
  int depth = 0;

  Evaluator(const Limits& l, std::string* o) : limits(l), out(o) {}

  void tick() {
    if (++steps > limits.max_steps) fail("template exceeded its step limit");
  }
  void check_size(size_t n) const {
    if (n > limits.max_container) fail("template value too large");
  }
  void emit(const std::string& s) {
    out->append(s);
    if (out->size() > limits.max_output) fail("template output too large");
  }

  // Redirects output into a buffer for captures (macros, block set, filter blocks).
  struct Capture {
    Evaluator& ev;
    std::string* saved;
    std::string buf;
    explicit Capture(Evaluator& e) : ev(e), saved(e.out) { ev.out = &buf; }
    ~Capture() { ev.out = saved; }
  };

  struct DepthGuard {
    Evaluator& ev;
    explicit DepthGuard(Evaluator& e) : ev(e) {
      if (++ev.depth > ev.limits.max_call_depth) fail("maximum recursion depth exceeded in template");
    }
    ~DepthGuard() { --ev.depth; }
  };

  // ---- iteration ----

  List iterate(const Value& v) {
    switch (v.kind) {
      case Kind::List:
      case Kind::Tuple:
      case Kind::Generator: return *v.list;
      case Kind::Undefined:
        if (v.unsafe) fail_undefined(v);
        return {};
      case Kind::String: {
        List out;
        size_t i = 0;
        while (i < v.s.size()) {
          std::string ch;
          append_utf8(ch, next_cp(v.s, i));
          out.push_back(Value::string(std::move(ch)));
        }
        return out;
      }
      case Kind::Dict: {
        List out;
        for (const auto& [k, val] : v.dict->items) out.push_back(k);
        return out;
      }
      default: fail("'" + type_name(v) + "' object is not iterable");
    }
  }

  // ---- attribute and item access ----

  Value bound_method(const Value& self, const std::string& name) {
    return Value::callable(name, [self, name](Evaluator& ev, CallArgs& args) { return ev.call_method(self, name, args); });
  }

  Value unsafe_attr(const Value& obj, const std::string& name) {
    Value u = Value::undefined("access to attribute '" + name + "' of '" + type_name(obj) + "' object is unsafe.");
    u.unsafe = true;
    return u;
  }

  // Python attribute lookup only (no item fallback); nullopt-like Undefined when absent.
  bool python_attr(const Value& obj, const std::string& name, Value& result) {
    static const char* str_methods[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith",
                                        "upper", "lower", "title", "capitalize", "swapcase", "replace", "find", "rfind", "index",
                                        "rindex", "count", "join", "format", "isdigit", "isalpha", "isalnum", "isspace", "islower",
                                        "isupper", "isnumeric", "isdecimal", "removeprefix", "removesuffix", "zfill", "ljust", "rjust",
                                        "center", "partition", "rpartition"};
    static const char* dict_methods[] = {"items", "keys", "values", "get", "copy"};
    static const char* dict_mut[] = {"pop", "popitem", "update", "setdefault", "clear"};
    static const char* list_methods[] = {"index", "count", "copy"};
    static const char* list_mut[] = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"};
    auto has = [&](auto& table) {
      for (const char* m : table)
        if (name == m) return true;
      return false;
    };
    switch (obj.kind) {
      case Kind::String:
        if (has(str_methods)) return result = bound_method(obj, name), true;
        return false;
      case Kind::Dict:
        if (has(dict_methods)) return result = bound_method(obj, name), true;
        if (has(dict_mut)) return result = unsafe_attr(obj, name), true;
        return false;
      case Kind::List:
      case Kind::Tuple:
        if (has(list_methods)) return result = bound_method(obj, name), true;
        if (obj.kind == Kind::List && has(list_mut)) return result = unsafe_attr(obj, name), true;
        return false;
      case Kind::Namespace: {
        const Value* v = obj.dict->find(name);
        if (v) return result = *v, true;
        return false;
      }
      case Kind::Loop: return loop_attr(obj, name, result);
      default: return false;
    }
  }

  bool loop_attr(const Value& obj, const std::string& name, Value& result) {
    LoopState& L = *obj.loop;
    size_t n = L.items->size(), k = L.index0;
    if (name == "index") result = Value::integer(k + 1);
    else if (name == "index0") result = Value::integer(k);
    else if (name == "revindex") result = Value::integer(n - k);
    else if (name == "revindex0") result = Value::integer(n - k - 1);
    else if (name == "first") result = Value::boolean(k == 0);
    else if (name == "last") result = Value::boolean(k + 1 == n);
    else if (name == "length") result = Value::integer(n);
    else if (name == "depth") result = Value::integer(L.depth);
    else if (name == "depth0") result = Value::integer(L.depth - 1);
    else if (name == "previtem") result = k > 0 ? (*L.items)[k - 1] : Value::undefined("there is no previous item");
    else if (name == "nextitem") result = k + 1 < n ? (*L.items)[k + 1] : Value::undefined("there is no next item");
    else if (name == "cycle") {
      auto state = obj.loop;
      result = Value::callable("cycle", [state](Evaluator&, CallArgs& a) {
        if (a.pos.empty()) fail("no items for cycling given");
        return a.pos[state->index0 % a.pos.size()];
      });
    } else if (name == "changed") {
      auto state = obj.loop;
      result = Value::callable("changed", [state](Evaluator&, CallArgs& a) {
        Value v = Value::make_list(a.pos, Kind::Tuple);
        if (!state->has_changed || !py_equal(v, state->last_changed)) {
          state->has_changed = true;
          state->last_changed = v;
          return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    } else {
      return false;
    }
    return true;
  }

  // jinja2 getattr: Python attribute first, then item.
  Value getattr(const Value& obj, const std::string& name) {
    if (obj.is_undefined()) fail_undefined(obj);
    if (!name.empty() && name[0] == '_') return unsafe_attr(obj, name);
    Value r;
    if (python_attr(obj, name, r)) return r;
    if (obj.kind == Kind::Dict) {
      const Value* v = obj.dict->find(name);
      if (v) return *v;
    }
    return undefined_attr(obj, name);
  }

  // jinja2 getitem: item first, then (for string keys) Python attribute.
  Value getitem(const Value& obj, const Value& key) {
    if (obj.is_undefined()) fail_undefined(obj);
    switch (obj.kind) {
      case Kind::Dict: {
        const Value* v = obj.dict->find(key);
        if (v) return *v;
        break;
      }
      case Kind::List:
      case Kind::Tuple:
        if (key.kind == Kind::Int || key.kind == Kind::Bool) {
          int64_t n = static_cast<int64_t>(obj.list->size()), k = key.i < 0 ? key.i + n : key.i;
          if (k >= 0 && k < n) return (*obj.list)[k];
        }
        break;
      case Kind::String:
        if (key.kind == Kind::Int || key.kind == Kind::Bool) {
          std::vector<uint32_t> v = cps(obj.s);
          int64_t n = static_cast<int64_t>(v.size()), k = key.i < 0 ? key.i + n : key.i;
          if (k >= 0 && k < n) return Value::string(from_cps(v, k, k + 1));
        }
        break;
      default: break;
    }
    if (key.is_string()) {
      if (!key.s.empty() && key.s[0] == '_') return unsafe_attr(obj, key.s);
      Value r;
      if (python_attr(obj, key.s, r)) return r;
      return undefined_attr(obj, key.s);
    }
    return Value::undefined("'" + object_desc(obj) + "' has no element " + repr(key));
  }

  Value slice(const Value& obj, const Value* start_v, const Value* stop_v, const Value* step_v) {
    if (obj.is_undefined()) fail_undefined(obj);
    auto opt = [&](const Value* v, bool& present) -> int64_t {
      present = v && !v->is_none();
      if (!present) return 0;
      if (v->kind != Kind::Int && v->kind != Kind::Bool) fail("slice indices must be integers or None");
      return v->i;
    };
    bool has_start, has_stop, has_step;
    int64_t start = opt(start_v, has_start), stop = opt(stop_v, has_stop), step = has_step = false;
    step = opt(step_v, has_step);
    if (!has_step) step = 1;
    if (step == 0) fail("slice step cannot be zero");
    bool is_str = obj.kind == Kind::String;
    std::vector<uint32_t> chars;
    int64_t len;
    if (is_str) {
      chars = cps(obj.s);
      len = static_cast<int64_t>(chars.size());
    } else if (obj.kind == Kind::List || obj.kind == Kind::Tuple) {
      len = static_cast<int64_t>(obj.list->size());
    } else {
      return Value::undefined("'" + object_desc(obj) + "' is not subscriptable");
    }
    auto adjust = [&](int64_t v, bool present, int64_t dflt) {
      if (!present) return dflt;
      if (v < 0) {
        v += len;
        if (v < 0) v = step < 0 ? -1 : 0;
      } else if (v >= len) {
        v = step < 0 ? len - 1 : len;
      }
      return v;
    };
    start = adjust(start, has_start, step < 0 ? len - 1 : 0);
    stop = adjust(stop, has_stop, step < 0 ? -1 : len);
    std::vector<int64_t> idx;
    if (step > 0)
      for (int64_t k = start; k < stop; k += step) idx.push_back(k);
    else
      for (int64_t k = start; k > stop; k += step) idx.push_back(k);
    if (is_str) {
      std::string out;
      for (int64_t k : idx) append_utf8(out, chars[k]);
      return Value::string(std::move(out));
    }
    List out;
    for (int64_t k : idx) out.push_back((*obj.list)[k]);
    return Value::make_list(std::move(out), obj.kind);
  }

  // ---- calls ----

  Value call(const Value& f, CallArgs& args) {
    if (f.kind == Kind::Callable) return f.fn->fn(*this, args);
    if (f.is_undefined()) fail_undefined(f);
    if (f.kind == Kind::Loop && f.loop->recurse) {
      if (args.pos.size() != 1) fail("loop() takes exactly one argument");
      return f.loop->recurse(*this, args.pos[0]);
    }
    fail("'" + type_name(f) + "' object is not callable");
  }

  Value call_method(const Value& self, const std::string& name, CallArgs& a) {
    auto arg = [&](size_t k) -> const Value* { return a.get(k, nullptr); };
    auto need_str = [&](const Value* v, const char* what) -> const std::string& {
      if (!v || !v->is_string()) fail(std::string(what) + " argument must be str");
      return v->s;
    };
    if (self.kind == Kind::String) {
      const std::string& s = self.s;
      if (name == "strip") return Value::string(str_strip(s, arg(0), true, true));
      if (name == "lstrip") return Value::string(str_strip(s, arg(0), true, false));
      if (name == "rstrip") return Value::string(str_strip(s, arg(0), false, true));
      if (name == "split" || name == "rsplit") {
        const Value* sep = a.get(0, "sep");
        const Value* mx = a.get(1, "maxsplit");
        int64_t maxsplit = mx ? as_int(*mx, "maxsplit") : -1;
        std::vector<std::string> parts;
        if (name == "rsplit" && maxsplit >= 0) {
          // rsplit with a limit: split fully, then re-join the leading surplus.
          parts = str_split(s, sep, -1);
          if (static_cast<int64_t>(parts.size()) > maxsplit + 1) {
            if (!sep || sep->is_none()) {
              std::vector<uint32_t> v = cps(s);
              size_t e = v.size();
              int64_t taken = 0;
              std::vector<std::string> tail;
              while (taken < maxsplit) {
                while (e > 0 && is_py_space(v[e - 1])) --e;
                size_t b = e;
                while (b > 0 && !is_py_space(v[b - 1])) --b;
                tail.insert(tail.begin(), from_cps(v, b, e));
                e = b;
                ++taken;
              }
              while (e > 0 && is_py_space(v[e - 1])) --e;
              size_t b0 = 0;
              while (b0 < e && is_py_space(v[b0])) ++b0;
              parts.clear();
              if (e > b0) parts.push_back(from_cps(v, b0, e));
              parts.insert(parts.end(), tail.begin(), tail.end());
            } else {
              size_t keep = parts.size() - maxsplit;
              std::string head;
              for (size_t k = 0; k < keep; ++k) head += (k ? sep->s : "") + parts[k];
              std::vector<std::string> np{head};
              np.insert(np.end(), parts.begin() + keep, parts.end());
              parts = std::move(np);
            }
          }
        } else {
          parts = str_split(s, sep, maxsplit);
        }
        List out;
        for (auto& p : parts) out.push_back(Value::string(std::move(p)));
        return Value::make_list(std::move(out));
      }
      if (name == "splitlines") {
        const Value* ke = a.get(0, "keepends");
        List out;
        for (auto& p : str_splitlines(s, ke && truthy(*ke))) out.push_back(Value::string(std::move(p)));
        return Value::make_list(std::move(out));
      }
      if (name == "startswith" || name == "endswith") {
        const Value* p = arg(0);
        if (!p) fail(name + " takes at least 1 argument");
        std::vector<std::string> cands;
        if (p->kind == Kind::Tuple) {
          for (const auto& e : *p->list) cands.push_back(need_str(&e, name.c_str()));
        } else {
          cands.push_back(need_str(p, name.c_str()));
        }
        std::string sub = s;
        if (arg(1) || arg(2)) sub = to_str(slice(self, arg(1), arg(2), nullptr));
        for (const auto& c : cands) {
          if (name == "startswith" ? sub.compare(0, c.size(), c) == 0 && sub.size() >= c.size()
                                   : sub.size() >= c.size() && sub.compare(sub.size() - c.size(), c.size(), c) == 0)
            return Value::boolean(true);
        }
        return Value::boolean(false);
      }
      if (name == "upper") return Value::string(str_upper(s));
      if (name == "lower") return Value::string(str_lower(s));
      if (name == "title") return Value::string(str_title_method(s));
      if (name == "capitalize") return Value::string(str_capitalize(s));
      if (name == "swapcase") {
        std::string out;
        size_t i = 0;
        while (i < s.size()) {
          uint32_t c = next_cp(s, i);
          if (cp_lower(c) != c) append_utf8(out, cp_lower(c));
          else append_upper(out, c);
        }
        return Value::string(out);
      }
      if (name == "replace") {
        const Value* c = arg(2);
        return Value::string(str_replace(s, need_str(arg(0), "replace"), need_str(arg(1), "replace"), c ? as_int(*c, "count") : -1,
                                         limits.max_container));
      }
      if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
        const std::string& sub = need_str(arg(0), name.c_str());
        size_t base = 0;
        std::string hay = s;
        if (arg(1) || arg(2)) {
          // Restrict to the [start:end] window, remembering its code-point offset.
          int64_t n = static_cast<int64_t>(cp_len(s));
          int64_t st = arg(1) && !arg(1)->is_none() ? as_int(*arg(1), "start") : 0;
          if (st < 0) st = std::max<int64_t>(0, st + n);
          base = static_cast<size_t>(std::min(st, n));
          hay = to_str(slice(self, arg(1), arg(2), nullptr));
        }
        if (name == "count") {
          if (sub.empty()) return Value::integer(cp_len(hay) + 1);
          int64_t c = 0;
          for (size_t p = hay.find(sub); p != std::string::npos; p = hay.find(sub, p + sub.size())) ++c;
          return Value::integer(c);
        }
        size_t p = (name == "find" || name == "index") ? hay.find(sub) : hay.rfind(sub);
        if (p == std::string::npos) {
          if (name == "index" || name == "rindex") fail("substring not found");
          return Value::integer(-1);
        }
        return Value::integer(static_cast<int64_t>(base + cp_index_of_byte(hay, p)));
      }
      if (name == "join") {
        const Value* it = arg(0);
        if (!it) fail("join() takes exactly one argument");
        std::string out;
        bool first = true;
        for (const auto& e : iterate(*it)) {
          if (!e.is_string()) fail("sequence item: expected str instance, " + type_name(e) + " found");
          if (!first) out += s;
          first = false;
          out += e.s;
          check_size(out.size());
        }
        return Value::string(std::move(out));
      }
      if (name == "format") return Value::string(brace_format(s, a));
      if (name == "isdigit" || name == "isnumeric" || name == "isdecimal")
        return Value::boolean(!s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }));
      if (name == "isalpha" || name == "isalnum" || name == "isspace" || name == "islower" || name == "isupper") {
        std::vector<uint32_t> v = cps(s);
        if (v.empty()) return Value::boolean(false);
        bool ok = true, any_cased = false;
        for (uint32_t c : v) {
          if (name == "isalpha") ok &= cp_alpha(c);
          else if (name == "isalnum") ok &= cp_alpha(c) || (c >= '0' && c <= '9');
          else if (name == "isspace") ok &= is_py_space(c);
          else if (name == "islower") {
            if (cp_upper(c) != c || c == 0xdf) any_cased = true;
            if (cp_lower(c) != c) ok = false;
          } else {
            if (cp_lower(c) != c) any_cased = true;
            if (cp_upper(c) != c) ok = false;
          }
        }
        if (name == "islower" || name == "isupper") ok = ok && any_cased;
        return Value::boolean(ok);
      }
      if (name == "removeprefix") {
        const std::string& p = need_str(arg(0), "removeprefix");
        return Value::string(s.compare(0, p.size(), p) == 0 && s.size() >= p.size() ? s.substr(p.size()) : s);
      }
      if (name == "removesuffix") {
        const std::string& p = need_str(arg(0), "removesuffix");
        bool ends = !p.empty() && s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
        return Value::string(ends ? s.substr(0, s.size() - p.size()) : s);
      }
      if (name == "zfill" || name == "ljust" || name == "rjust" || name == "center") {
        int64_t width = arg(0) ? as_int(*arg(0), name.c_str()) : 0;
        check_size(static_cast<size_t>(std::max<int64_t>(width, 0)));
        std::string fill = arg(1) ? need_str(arg(1), name.c_str()) : " ";
        int64_t len = static_cast<int64_t>(cp_len(s));
        if (width <= len) return self;
        int64_t pad = width - len;
        auto rep = [&](int64_t n, const std::string& f) {
          std::string r;
          for (int64_t k = 0; k < n; ++k) r += f;
          return r;
        };
        if (name == "ljust") return Value::string(s + rep(pad, fill));
        if (name == "rjust") return Value::string(rep(pad, fill) + s);
        if (name == "zfill") {
          if (!s.empty() && (s[0] == '-' || s[0] == '+')) return Value::string(s.substr(0, 1) + rep(pad, "0") + s.substr(1));
          return Value::string(rep(pad, "0") + s);
        }
        int64_t left = pad / 2 + (pad & width & 1);
        return Value::string(rep(left, fill) + s + rep(pad - left, fill));
      }
      if (name == "partition" || name == "rpartition") {
        const std::string& sep = need_str(arg(0), name.c_str());
        if (sep.empty()) fail("empty separator");
        size_t p = name == "partition" ? s.find(sep) : s.rfind(sep);
        if (p == std::string::npos) {
          if (name == "partition") return Value::make_list({self, Value::string(""), Value::string("")}, Kind::Tuple);
          return Value::make_list({Value::string(""), Value::string(""), self}, Kind::Tuple);
        }
        return Value::make_list({Value::string(s.substr(0, p)), Value::string(sep), Value::string(s.substr(p + sep.size()))}, Kind::Tuple);
      }
    }
    if (self.kind == Kind::Dict) {
      if (name == "items") {
        List out;
        for (const auto& [k, v] : self.dict->items) out.push_back(make_tuple(k, v));
        return Value::make_list(std::move(out));
      }
      if (name == "keys" || name == "values") {
        List out;
        for (const auto& [k, v] : self.dict->items) out.push_back(name == "keys" ? k : v);
        return Value::make_list(std::move(out));
      }
      if (name == "get") {
        if (!arg(0)) fail("get expected at least 1 argument, got 0");
        const Value* v = self.dict->find(*arg(0));
        if (v) return *v;
        return arg(1) ? *arg(1) : Value::none();
      }
      if (name == "copy") {
        Value d = Value::make_dict();
        d.dict->items = self.dict->items;
        return d;
      }
    }
    if (self.kind == Kind::List || self.kind == Kind::Tuple) {
      if (name == "count") {
        int64_t c = 0;
        for (const auto& e : *self.list) c += arg(0) && py_equal(e, *arg(0));
        return Value::integer(c);
      }
      if (name == "index") {
        for (size_t k = 0; k < self.list->size(); ++k)
          if (arg(0) && py_equal((*self.list)[k], *arg(0))) return Value::integer(k);
        fail(repr(arg(0) ? *arg(0) : Value::none()) + " is not in list");
      }
      if (name == "copy") return Value::make_list(*self.list);
    }
    fail("'" + type_name(self) + "' object has no attribute '" + name + "'");
  }

  // ---- expressions ----

  Value lookup(const std::string& name, const ScopePtr& scope) {
    const Value* v = scope->lookup(name);
    if (v) return *v;
    return Value::undefined("'" + name + "' is undefined");
  }

  void eval_args(const Expr& e, const ScopePtr& scope, CallArgs& args) {
    for (const auto& a : e.args) args.pos.push_back(eval(*a, scope));
    for (const auto& [k, v] : e.kwargs) args.kw.emplace_back(k, eval(*v, scope));
    if (e.dyn_args) {
      for (auto& v : iterate(eval(*e.dyn_args, scope))) args.pos.push_back(std::move(v));
    }
    if (e.dyn_kwargs) {
      Value d = eval(*e.dyn_kwargs, scope);
      if (d.kind != Kind::Dict) fail("argument after ** must be a mapping");
      for (const auto& [k, v] : d.dict->items) args.kw.emplace_back(to_str(k), v);
    }
  }

  Value eval(const Expr& e, const ScopePtr& scope) {
    tick();
    switch (e.kind) {
      case ExprKind::Const: return e.constant;
      case ExprKind::Name: return lookup(e.name, scope);
      case ExprKind::Getattr: return getattr(eval(*e.a, scope), e.name);
      case ExprKind::Getitem: {
        Value obj = eval(*e.a, scope);
        if (e.b->kind == ExprKind::Slice) {
          Value s, t, u;
          if (e.b->a) s = eval(*e.b->a, scope);
          if (e.b->b) t = eval(*e.b->b, scope);
          if (e.b->c) u = eval(*e.b->c, scope);
          return slice(obj, e.b->a ? &s : nullptr, e.b->b ? &t : nullptr, e.b->c ? &u : nullptr);
        }
        return getitem(obj, eval(*e.b, scope));
      }
      case ExprKind::Slice: fail("slice outside of a subscript");
      case ExprKind::Call: {
        Value f = eval(*e.a, scope);
        CallArgs args;
        eval_args(e, scope, args);
        return call(f, args);
      }
      case ExprKind::Filter: {
        Value in = eval(*e.a, scope);
        CallArgs args;
        eval_args(e, scope, args);
        return apply_filter(e.name, in, args);
      }
      case ExprKind::Test: {
        Value in;
        // `x is defined` must not raise on a missing attribute chain's last link.
        in = eval(*e.a, scope);
        CallArgs args;
        eval_args(e, scope, args);
        bool r = apply_test(e.name, in, args);
        return Value::boolean(e.negated ? !r : r);
      }
      case ExprKind::Neg:
      case ExprKind::Pos: {
        Value v = eval(*e.a, scope);
        if (v.is_undefined()) fail_undefined(v);
        if (v.kind == Kind::Float) return Value::number(e.kind == ExprKind::Neg ? -v.f : v.f);
        if (v.kind == Kind::Int || v.kind == Kind::Bool) {
          if (e.kind == ExprKind::Pos) return Value::integer(v.i);
          if (v.i == INT64_MIN) fail("integer overflow");
          return Value::integer(-v.i);
        }
        fail(std::string("bad operand type for unary ") + (e.kind == ExprKind::Neg ? "-" : "+") + ": '" + type_name(v) + "'");
      }
      case ExprKind::Not: return Value::boolean(!truthy(eval(*e.a, scope)));
      case ExprKind::And: {
        Value l = eval(*e.a, scope);
        return truthy(l) ? eval(*e.b, scope) : l;
      }
      case ExprKind::Or: {
        Value l = eval(*e.a, scope);
        return truthy(l) ? l : eval(*e.b, scope);
      }
      case ExprKind::Add:
      case ExprKind::Sub:
      case ExprKind::Mul:
      case ExprKind::Div:
      case ExprKind::FloorDiv:
      case ExprKind::Mod:
      case ExprKind::Pow: return binop(e.kind, eval(*e.a, scope), eval(*e.b, scope));
      case ExprKind::Compare: {
        Value left = eval(*e.a, scope);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.args[k], scope);
          if (!compare(e.ops[k], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case ExprKind::Concat: {
        std::string s;
        for (const auto& a : e.args) {
          Value v = eval(*a, scope);
          if (v.unsafe) fail_undefined(v);
          s += to_str(v);
          check_size(s.size());
        }
        return Value::string(std::move(s));
      }
      case ExprKind::CondExpr:
        if (truthy(eval(*e.a, scope))) return eval(*e.b, scope);
        if (e.c) return eval(*e.c, scope);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
      case ExprKind::ListLit:
      case ExprKind::TupleLit: {
        List items;
        for (const auto& a : e.args) items.push_back(eval(*a, scope));
        return Value::make_list(std::move(items), e.kind == ExprKind::ListLit ? Kind::List : Kind::Tuple);
      }
      case ExprKind::DictLit: {
        Value d = Value::make_dict();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          Value key = eval(*e.args[k], scope);
          if (key.kind == Kind::List || key.kind == Kind::Dict || key.is_undefined()) fail("unhashable type: '" + type_name(key) + "'");
          d.dict->set(key, eval(*e.args[k + 1], scope));
        }
        return d;
      }
    }
    fail("unknown expression");
  }

  bool contains(const Value& container, const Value& item) {
    switch (container.kind) {
      case Kind::String:
        if (!item.is_string()) fail("'in <string>' requires string as left operand, not " + type_name(item));
        return container.s.find(item.s) != std::string::npos;
      case Kind::Dict: return container.dict->find(item) != nullptr;
      case Kind::Undefined:
        if (container.unsafe) fail_undefined(container);
        return false;
      case Kind::List:
      case Kind::Tuple:
      case Kind::Generator:
        for (const auto& e : *container.list)
          if (py_equal(e, item)) return true;
        return false;
      default: fail("argument of type '" + type_name(container) + "' is not iterable");
    }
  }

  bool compare(const std::string& op, const Value& l, const Value& r) {
    if (op == "eq") return py_equal(l, r);
    if (op == "ne") return !py_equal(l, r);
    if (op == "in") return contains(r, l);
    if (op == "notin") return !contains(r, l);
    int c = py_compare(l, r);
    if (op == "lt") return c < 0;
    if (op == "lteq") return c <= 0;
    if (op == "gt") return c > 0;
    return c >= 0;
  }

  Value repeat(const Value& seq, int64_t n) {
    if (n < 0) n = 0;
    if (seq.is_string()) {
      check_size(seq.s.size() * static_cast<size_t>(n));
      std::string out;
      for (int64_t k = 0; k < n; ++k) out += seq.s;
      return Value::string(std::move(out));
    }
    check_size(seq.list->size() * static_cast<size_t>(n));
    List out;
    for (int64_t k = 0; k < n; ++k) out.insert(out.end(), seq.list->begin(), seq.list->end());
    return Value::make_list(std::move(out), seq.kind);
  }

  Value binop(ExprKind k, const Value& l, const Value& r) {
    if (l.is_undefined()) fail_undefined(l);
    if (r.is_undefined()) fail_undefined(r);
    static const char* sym[] = {"+", "-", "*", "/", "//", "%", "**"};
    const char* op = sym[static_cast<int>(k) - static_cast<int>(ExprKind::Add)];
    auto type_err = [&]() -> Value {
      fail(std::string("unsupported operand type(s) for ") + op + ": '" + type_name(l) + "' and '" + type_name(r) + "'");
    };
    if (l.is_number() && r.is_number()) {
      bool fl = l.kind == Kind::Float || r.kind == Kind::Float;
      if (!fl) {
        int64_t a = l.i, b = r.i, res = 0;
        switch (k) {
          case ExprKind::Add:
            if (__builtin_add_overflow(a, b, &res)) fail("integer overflow");
            return Value::integer(res);
          case ExprKind::Sub:
            if (__builtin_sub_overflow(a, b, &res)) fail("integer overflow");
            return Value::integer(res);
          case ExprKind::Mul:
            if (__builtin_mul_overflow(a, b, &res)) fail("integer overflow");
            return Value::integer(res);
          case ExprKind::Div:
            if (b == 0) fail("division by zero");
            return Value::number(static_cast<double>(a) / static_cast<double>(b));
          case ExprKind::FloorDiv:
          case ExprKind::Mod: {
            if (b == 0) fail("integer division or modulo by zero");
            if (a == INT64_MIN && b == -1) fail("integer overflow");
            int64_t q = a / b, m = a % b;
            if (m != 0 && ((m < 0) != (b < 0))) {
              --q;
              m += b;
            }
            return Value::integer(k == ExprKind::FloorDiv ? q : m);
          }
          case ExprKind::Pow: {
            if (b < 0) return Value::number(std::pow(static_cast<double>(a), static_cast<double>(b)));
            int64_t acc = 1, base = a;
            for (int64_t e = b; e > 0; e >>= 1) {
              if (e & 1)
                if (__builtin_mul_overflow(acc, base, &acc)) fail("integer overflow");
              if (e > 1 && __builtin_mul_overflow(base, base, &base)) fail("integer overflow");
            }
            return Value::integer(acc);
          }
          default: break;
        }
      }
      double a = as_float(l), b = as_float(r);
      switch (k) {
        case ExprKind::Add: return Value::number(a + b);
        case ExprKind::Sub: return Value::number(a - b);
        case ExprKind::Mul: return Value::number(a * b);
        case ExprKind::Div:
          if (b == 0) fail("float division by zero");
          return Value::number(a / b);
        case ExprKind::FloorDiv:
          if (b == 0) fail("float floor division by zero");
          return Value::number(std::floor(a / b));
        case ExprKind::Mod: {
          if (b == 0) fail("float modulo");
          double m = std::fmod(a, b);
          if (m != 0 && ((m < 0) != (b < 0))) m += b;
          return Value::number(m);
        }
        case ExprKind::Pow: return Value::number(std::pow(a, b));
        default: break;
      }
    }
    if (k == ExprKind::Add) {
      if (l.is_string() && r.is_string()) {
        check_size(l.s.size() + r.s.size());
        return Value::string(l.s + r.s);
      }
      if ((l.kind == Kind::List || l.kind == Kind::Tuple) && l.kind == r.kind) {
        check_size(l.list->size() + r.list->size());
        List out = *l.list;
        out.insert(out.end(), r.list->begin(), r.list->end());
        return Value::make_list(std::move(out), l.kind);
      }
      if (l.is_string() || r.is_string()) fail("can only concatenate str (not \"" + type_name(l.is_string() ? r : l) + "\") to str");
    }
    if (k == ExprKind::Mul) {
      bool lseq = l.is_string() || l.kind == Kind::List || l.kind == Kind::Tuple;
      bool rseq = r.is_string() || r.kind == Kind::List || r.kind == Kind::Tuple;
      if (lseq && (r.kind == Kind::Int || r.kind == Kind::Bool)) return repeat(l, r.i);
      if (rseq && (l.kind == Kind::Int || l.kind == Kind::Bool)) return repeat(r, l.i);
    }
    if (k == ExprKind::Mod && l.is_string()) {
      if (r.kind == Kind::Tuple) return Value::string(percent_format(l.s, *r.list, nullptr));
      if (r.kind == Kind::Dict) return Value::string(percent_format(l.s, {}, &r));
      return Value::string(percent_format(l.s, {r}, nullptr));
    }
    return type_err();
  }

  // ---- statements ----

  void assign(const Target& t, const Value& v, const ScopePtr& scope) {
    if (!t.ns_attr.empty()) {
      Value ns = lookup(t.names[0], scope);
      if (ns.kind != Kind::Namespace) fail("cannot assign attribute on non-namespace object");
      ns.dict->set(Value::string(t.ns_attr), v);
      return;
    }
    if (!t.is_tuple) {
      scope->vars[t.names[0]] = v;
      return;
    }
    List items = iterate(v);
    if (items.size() < t.names.size()) fail("not enough values to unpack (expected " + std::to_string(t.names.size()) + ", got " + std::to_string(items.size()) + ")");
    if (items.size() > t.names.size()) fail("too many values to unpack (expected " + std::to_string(t.names.size()) + ")");
    for (size_t k = 0; k < items.size(); ++k) scope->vars[t.names[k]] = items[k];
  }

  Flow exec_body(const Body& body, const ScopePtr& scope) {
    for (const auto& s : body) {
      Flow f = exec(*s, scope);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Value make_macro(const Stmt& s, const ScopePtr& closure, bool is_caller) {
    const Stmt* stmt = &s;
    // A macro lives in the scope it closes over, so it holds that scope weakly (no cycle); a
    // caller only lives for its call expression and may hold it strongly.
    std::weak_ptr<Scope> weak = closure;
    ScopePtr strong = is_caller ? closure : nullptr;
    std::string name = is_caller ? "caller" : s.text;
    return Value::callable(name, [stmt, weak, strong, name](Evaluator& ev, CallArgs& args) {
      ScopePtr parent = strong ? strong : weak.lock();
      if (!parent) fail("macro '" + name + "' called after its scope ended");
      DepthGuard g(ev);
      auto frame = std::make_shared<Scope>();
      frame->parent = parent;
      const auto& params = stmt->params;
      if (args.pos.size() > params.size())
        fail("macro '" + name + "' takes not more than " + std::to_string(params.size()) + " argument(s)");
      size_t first_default = params.size() - stmt->defaults.size();
      for (size_t k = 0; k < params.size(); ++k) {
        const Value* v = k < args.pos.size() ? &args.pos[k] : nullptr;
        if (!v)
          for (const auto& [kn, kv] : args.kw)
            if (kn == params[k]) v = &kv;
        if (v) frame->vars[params[k]] = *v;
        else if (k >= first_default) frame->vars[params[k]] = ev.eval(*stmt->defaults[k - first_default], frame);
        else frame->vars[params[k]] = Value::undefined("parameter '" + params[k] + "' was not provided");
      }
      for (const auto& [kn, kv] : args.kw) {
        if (kn == "caller") {
          frame->vars["caller"] = kv;
          continue;
        }
        if (std::find(params.begin(), params.end(), kn) == params.end())
          fail("macro '" + name + "' takes no keyword argument '" + kn + "'");
      }
      Capture cap(ev);
      ev.exec_body(stmt->body, frame);
      return Value::string(std::move(cap.buf));
    });
  }

  Flow run_loop(const Stmt& s, const Value& iterable, const ScopePtr& scope, int depth) {
    std::shared_ptr<List> items;
    if (!s.cond && iterable.is_sequence()) {
      items = iterable.list;  // shared, never mutated: no copy
    } else {
      items = std::make_shared<List>();
      for (auto& v : iterate(iterable)) {
        if (s.cond) {
          auto probe = std::make_shared<Scope>();
          probe->parent = scope;
          assign(s.target, v, probe);
          if (!truthy(eval(*s.cond, probe))) continue;
        }
        items->push_back(std::move(v));
      }
    }
    if (items->empty()) {
      exec_body(s.else_body, scope);
      return Flow::Normal;
    }
    auto state = std::make_shared<LoopState>();
    state->items = std::move(items);
    state->depth = depth;
    if (s.recursive) {
      const Stmt* stmt = &s;
      state->recurse = [stmt, scope, depth](Evaluator& ev, const Value& it) {
        DepthGuard g(ev);
        Capture cap(ev);
        ev.run_loop(*stmt, it, scope, depth + 1);
        return Value::string(std::move(cap.buf));
      };
    }
    Value loop_val;
    loop_val.kind = Kind::Loop;
    loop_val.loop = state;
    ScopePtr frame;
    for (size_t k = 0; k < state->items->size(); ++k) {
      tick();
      state->index0 = k;
      // Each iteration gets a fresh frame; reuse the last one when nothing kept a reference to it.
      if (frame && frame.use_count() == 1) {
        frame->vars.clear();
      } else {
        frame = std::make_shared<Scope>();
        frame->parent = scope;
      }
      assign(s.target, (*state->items)[k], frame);
      frame->vars["loop"] = loop_val;
      Flow f = exec_body(s.body, frame);
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  }

  Flow exec(const Stmt& s, const ScopePtr& scope) {
    tick();
    switch (s.kind) {
      case StmtKind::Data: emit(s.text); return Flow::Normal;
      case StmtKind::Print: {
        emit(to_str(eval(*s.expr, scope)));
        return Flow::Normal;
      }
      case StmtKind::If:
        for (const auto& [cond, body] : s.branches)
          if (truthy(eval(*cond, scope))) return exec_body(body, scope);
        return exec_body(s.else_body, scope);
      case StmtKind::For: return run_loop(s, eval(*s.expr, scope), scope, 1);
      case StmtKind::Set: assign(s.target, eval(*s.expr, scope), scope); return Flow::Normal;
      case StmtKind::SetBlock: {
        std::string text;
        {
          Capture cap(*this);
          auto frame = std::make_shared<Scope>();
          frame->parent = scope;
          exec_body(s.body, frame);
          text = std::move(cap.buf);
        }
        Value v = Value::string(std::move(text));
        if (s.expr) v = apply_filter_chain(*s.expr, v, scope);
        assign(s.target, v, scope);
        return Flow::Normal;
      }
      case StmtKind::FilterBlock: {
        std::string text;
        {
          Capture cap(*this);
          auto frame = std::make_shared<Scope>();
          frame->parent = scope;
          exec_body(s.body, frame);
          text = std::move(cap.buf);
        }
        emit(to_str(apply_filter_chain(*s.expr, Value::string(std::move(text)), scope)));
        return Flow::Normal;
      }
      case StmtKind::Macro: scope->vars[s.text] = make_macro(s, scope, false); return Flow::Normal;
      case StmtKind::CallBlock: {
        Value caller = make_macro(s, scope, true);
        Value f = eval(*s.expr->a, scope);
        CallArgs args;
        eval_args(*s.expr, scope, args);
        args.kw.emplace_back("caller", caller);
        emit(to_str(call(f, args)));
        return Flow::Normal;
      }
      case StmtKind::Break: return Flow::Break;
      case StmtKind::Continue: return Flow::Continue;
      case StmtKind::With: {
        auto frame = std::make_shared<Scope>();
        frame->parent = scope;
        for (size_t k = 0; k < s.with_targets.size(); ++k) assign(s.with_targets[k], eval(*s.with_values[k], scope), frame);
        exec_body(s.body, frame);
        return Flow::Normal;
      }
      case StmtKind::Scope: return exec_body(s.body, scope);
    }
    return Flow::Normal;
  }

  // Applies a parsed filter chain (innermost first) whose innermost input is `v`.
  Value apply_filter_chain(const Expr& f, const Value& v, const ScopePtr& scope) {
    Value in = f.a ? apply_filter_chain(*f.a, v, scope) : v;
    CallArgs args;
    eval_args(f, scope, args);
    return apply_filter(f.name, in, args);
  }

  Value apply_filter(const std::string& name, const Value& in, CallArgs& args);
  bool apply_test(const std::string& name, const Value& in, CallArgs& args);

  // jinja2's make_attrgetter: dotted path, integer parts index, item lookup first.
  Value attr_path(const Value& v, const std::string& path) {
    Value cur = v;
    size_t p = 0;
    while (true) {
      size_t q = path.find('.', p);
      std::string part = path.substr(p, q == std::string::npos ? std::string::npos : q - p);
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      cur = getitem(cur, digits ? Value::integer(std::stoll(part)) : Value::string(part));
      if (q == std::string::npos) return cur;
      p = q + 1;
    }
  }
  Value attr_getter_value(const Value& v, const Value& attribute) {
    if (attribute.kind == Kind::Int) return getitem(v, attribute);
    return attr_path(v, to_str(attribute));
  }
};

namespace {

const Value* kwarg(CallArgs& a, size_t pos, const char* name) { return a.get(pos, name); }

bool arg_bool(CallArgs& a, size_t pos, const char* name, bool dflt) {
  const Value* v = kwarg(a, pos, name);
  return v ? truthy(*v) : dflt;
}

Value gen(List items) { return Value::make_list(std::move(items), Kind::Generator); }

// Sort/unique key: strings lowercased unless case-sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(str_lower(v.s));
  return v;
}

Value f_length(Evaluator&, const Value& v, CallArgs&) {
  switch (v.kind) {
    case Kind::String: return Value::integer(cp_len(v.s));
    case Kind::List:
    case Kind::Tuple: return Value::integer(v.list->size());
    case Kind::Dict: return Value::integer(v.dict->items.size());
    case Kind::Undefined: return Value::integer(0);
    default: fail("object of type '" + type_name(v) + "' has no len()");
  }
}

Value f_tojson(Evaluator&, const Value& v, CallArgs& a) {
  const Value* ensure = kwarg(a, 0, "ensure_ascii");
  const Value* indent = kwarg(a, 1, "indent");
  const Value* seps = kwarg(a, 2, "separators");
  bool sort_keys = arg_bool(a, 3, "sort_keys", false);
  bool has_indent = indent && !indent->is_none();
  std::string indent_str;
  int n = 0;
  if (has_indent) {
    if (indent->is_string()) indent_str = indent->s;
    else n = static_cast<int>(std::max<int64_t>(0, as_int(*indent, "indent")));
  }
  std::string item_sep, key_sep;
  bool has_seps = seps && !seps->is_none();
  if (has_seps) {
    if (!seps->is_sequence() || seps->list->size() != 2 || !(*seps->list)[0].is_string() || !(*seps->list)[1].is_string())
      fail("separators must be a (item_separator, key_separator) pair of strings");
    item_sep = (*seps->list)[0].s;
    key_sep = (*seps->list)[1].s;
  }
  return Value::string(to_json(v, n, indent_str, has_indent, has_seps ? &item_sep : nullptr, has_seps ? &key_sep : nullptr,
                               sort_keys, ensure && truthy(*ensure)));
}

Value f_trim(Evaluator&, const Value& v, CallArgs& a) { return Value::string(str_strip(to_str(v), kwarg(a, 0, "chars"), true, true)); }
Value f_upper(Evaluator&, const Value& v, CallArgs&) { return Value::string(str_upper(to_str(v))); }
Value f_lower(Evaluator&, const Value& v, CallArgs&) { return Value::string(str_lower(to_str(v))); }
Value f_title(Evaluator&, const Value& v, CallArgs&) { return Value::string(str_title_filter(to_str(v))); }
Value f_capitalize(Evaluator&, const Value& v, CallArgs&) { return Value::string(str_capitalize(to_str(v))); }
Value f_string(Evaluator&, const Value& v, CallArgs&) {
  if (v.is_string()) return v;
  return Value::string(to_str(v));
}
Value f_safe(Evaluator&, const Value& v, CallArgs&) { return v.is_string() ? v : Value::string(to_str(v)); }
Value f_escape(Evaluator&, const Value& v, CallArgs&) { return Value::string(html_escape(to_str(v))); }
Value f_pprint(Evaluator&, const Value& v, CallArgs&) { return Value::string(repr(v)); }

Value f_replace(Evaluator& ev, const Value& v, CallArgs& a) {
  const Value* old = kwarg(a, 0, "old");
  const Value* rep = kwarg(a, 1, "new");
  const Value* count = kwarg(a, 2, "count");
  if (!old || !rep) fail("replace() missing required arguments");
  return Value::string(str_replace(to_str(v), to_str(*old), to_str(*rep), count && !count->is_none() ? as_int(*count, "count") : -1,
                                   ev.limits.max_container));
}

Value f_default(Evaluator&, const Value& v, CallArgs& a) {
  const Value* d = kwarg(a, 0, "default_value");
  bool boolean = arg_bool(a, 1, "boolean", false);
  if (v.is_undefined() || (boolean && !truthy(v))) return d ? *d : Value::string("");
  return v;
}

Value f_join(Evaluator& ev, const Value& v, CallArgs& a) {
  const Value* d = kwarg(a, 0, "d");
  const Value* attribute = kwarg(a, 1, "attribute");
  std::string sep = d ? to_str(*d) : "";
  std::string out;
  bool first = true;
  for (const auto& e : ev.iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += to_str(attribute && !attribute->is_none() ? ev.attr_getter_value(e, *attribute) : e);
    ev.check_size(out.size());
  }
  return Value::string(std::move(out));
}

Value f_first(Evaluator& ev, const Value& v, CallArgs&) {
  List items = ev.iterate(v);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}
Value f_last(Evaluator& ev, const Value& v, CallArgs&) {
  if (v.kind == Kind::Generator) fail("'generator' object is not reversible");
  List items = ev.iterate(v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}
Value f_list(Evaluator& ev, const Value& v, CallArgs&) { return Value::make_list(ev.iterate(v)); }

Value f_int(Evaluator&, const Value& v, CallArgs& a) {
  const Value* d = kwarg(a, 0, "default");
  Value dflt = d ? *d : Value::integer(0);
  const Value* b = kwarg(a, 1, "base");
  int base = b ? static_cast<int>(as_int(*b, "base")) : 10;
  switch (v.kind) {
    case Kind::Int:
    case Kind::Bool: return Value::integer(v.i);
    case Kind::Float:
      if (!std::isfinite(v.f) || std::fabs(v.f) > 9.2e18) return dflt;
      return Value::integer(static_cast<int64_t>(v.f));
    case Kind::String: {
      std::string s = str_strip(v.s, nullptr, true, true);
      std::string digits;
      for (char c : s)
        if (c != '_') digits += c;
      if (!digits.empty()) {
        errno = 0;
        char* end = nullptr;
        long long r = std::strtoll(digits.c_str(), &end, base);
        if (errno == 0 && end && *end == 0 && s.find("__") == std::string::npos) return Value::integer(r);
        char* fend = nullptr;
        double f = std::strtod(s.c_str(), &fend);
        if (fend && *fend == 0 && std::isfinite(f) && std::fabs(f) < 9.2e18 && s.find_first_of("xX") == std::string::npos)
          return Value::integer(static_cast<int64_t>(f));
      }
      return dflt;
    }
    default: return dflt;
  }
}

Value f_float(Evaluator&, const Value& v, CallArgs& a) {
  const Value* d = kwarg(a, 0, "default");
  Value dflt = d ? *d : Value::number(0.0);
  switch (v.kind) {
    case Kind::Int:
    case Kind::Bool: return Value::number(static_cast<double>(v.i));
    case Kind::Float: return v;
    case Kind::String: {
      std::string s = str_strip(v.s, nullptr, true, true);
      std::string low = str_lower(s);
      if (low == "nan" || low == "+nan" || low == "-nan") return Value::number(NAN);
      if (low == "inf" || low == "+inf" || low == "infinity" || low == "+infinity") return Value::number(INFINITY);
      if (low == "-inf" || low == "-infinity") return Value::number(-INFINITY);
      if (s.empty() || s.find_first_of("xXpP") != std::string::npos) return dflt;
      char* end = nullptr;
      double f = std::strtod(s.c_str(), &end);
      if (end && *end == 0) return Value::number(f);
      return dflt;
    }
    default: return dflt;
  }
}

Value f_abs(Evaluator&, const Value& v, CallArgs&) {
  if (v.kind == Kind::Float) return Value::number(std::fabs(v.f));
  if (v.kind == Kind::Int || v.kind == Kind::Bool) {
    if (v.i == INT64_MIN) fail("integer overflow");
    return Value::integer(v.i < 0 ? -v.i : v.i);
  }
  fail("bad operand type for abs(): '" + type_name(v) + "'");
}

Value f_round(Evaluator&, const Value& v, CallArgs& a) {
  const Value* p = kwarg(a, 0, "precision");
  const Value* m = kwarg(a, 1, "method");
  int64_t precision = p ? as_int(*p, "precision") : 0;
  std::string method = m ? to_str(*m) : "common";
  if (method != "common" && method != "ceil" && method != "floor") fail("method must be common, ceil or floor");
  if (!v.is_number()) fail("type " + type_name(v) + " doesn't define __round__ method");
  if (method == "common") {
    if (v.kind != Kind::Float) return Value::integer(v.i);  // round(int, n) stays an int
    if (!std::isfinite(v.f)) return v;
    if (precision == 0) return Value::number(std::nearbyint(v.f));
    if (precision > 300 || precision < -300) return v;
    if (precision > 0) {
      char buf[512];
      std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(precision), v.f);
      return Value::number(std::strtod(buf, nullptr));
    }
    double scale = std::pow(10.0, static_cast<double>(-precision));
    return Value::number(std::nearbyint(v.f / scale) * scale);
  }
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = as_float(v) * scale;
  return Value::number((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
}

Value f_items(Evaluator&, const Value& v, CallArgs&) {
  if (v.is_undefined()) return gen({});
  if (v.kind != Kind::Dict) fail("Can only get item pairs from a mapping.");
  List out;
  for (const auto& [k, val] : v.dict->items) out.push_back(make_tuple(k, val));
  return gen(std::move(out));
}

Value f_dictsort(Evaluator&, const Value& v, CallArgs& a) {
  bool cs = arg_bool(a, 0, "case_sensitive", false);
  const Value* by = kwarg(a, 1, "by");
  bool reverse = arg_bool(a, 2, "reverse", false);
  std::string b = by ? to_str(*by) : "key";
  if (b != "key" && b != "value") fail("You can only sort by either \"key\" or \"value\"");
  if (v.kind != Kind::Dict) fail("dictsort expects a mapping");
  List out;
  for (const auto& [k, val] : v.dict->items) out.push_back(make_tuple(k, val));
  size_t pos = b == "key" ? 0 : 1;
  std::stable_sort(out.begin(), out.end(), [&](const Value& x, const Value& y) {
    int c = py_compare(sort_key((*x.list)[pos], cs), sort_key((*y.list)[pos], cs));
    return reverse ? c > 0 : c < 0;
  });
  return Value::make_list(std::move(out));
}

Value f_sort(Evaluator& ev, const Value& v, CallArgs& a) {
  bool reverse = arg_bool(a, 0, "reverse", false);
  bool cs = arg_bool(a, 1, "case_sensitive", false);
  const Value* attribute = kwarg(a, 2, "attribute");
  List items = ev.iterate(v);
  std::vector<std::pair<Value, Value>> keyed;
  for (auto& e : items)
    keyed.emplace_back(sort_key(attribute && !attribute->is_none() ? ev.attr_getter_value(e, *attribute) : e, cs), e);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    int c = py_compare(x.first, y.first);
    return reverse ? c > 0 : c < 0;
  });
  List out;
  for (auto& [k, e] : keyed) out.push_back(std::move(e));
  return Value::make_list(std::move(out));
}

Value f_unique(Evaluator& ev, const Value& v, CallArgs& a) {
  bool cs = arg_bool(a, 0, "case_sensitive", false);
  const Value* attribute = kwarg(a, 1, "attribute");
  List out, seen;
  for (const auto& e : ev.iterate(v)) {
    Value key = sort_key(attribute && !attribute->is_none() ? ev.attr_getter_value(e, *attribute) : e, cs);
    bool dup = false;
    for (const auto& s : seen) dup |= py_equal(s, key);
    if (!dup) {
      seen.push_back(key);
      out.push_back(e);
    }
  }
  return gen(std::move(out));
}

Value f_reverse(Evaluator& ev, const Value& v, CallArgs&) {
  if (v.is_string()) {
    std::vector<uint32_t> c = cps(v.s);
    std::reverse(c.begin(), c.end());
    return Value::string(from_cps(c));
  }
  if (v.kind == Kind::Generator) {
    List items = *v.list;
    std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  }
  List items = ev.iterate(v);
  std::reverse(items.begin(), items.end());
  return gen(std::move(items));
}

Value min_max(Evaluator& ev, const Value& v, CallArgs& a, bool want_max) {
  bool cs = arg_bool(a, 0, "case_sensitive", false);
  const Value* attribute = kwarg(a, 1, "attribute");
  List items = ev.iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  Value best_key;
  for (size_t k = 0; k < items.size(); ++k) {
    Value key = sort_key(attribute && !attribute->is_none() ? ev.attr_getter_value(items[k], *attribute) : items[k], cs);
    if (k == 0 || (want_max ? py_compare(key, best_key) > 0 : py_compare(key, best_key) < 0)) {
      best = k;
      best_key = key;
    }
  }
  return items[best];
}
Value f_max(Evaluator& ev, const Value& v, CallArgs& a) { return min_max(ev, v, a, true); }
Value f_min(Evaluator& ev, const Value& v, CallArgs& a) { return min_max(ev, v, a, false); }

Value f_sum(Evaluator& ev, const Value& v, CallArgs& a) {
  const Value* attribute = kwarg(a, 0, "attribute");
  const Value* start = kwarg(a, 1, "start");
  Value acc = start ? *start : Value::integer(0);
  for (const auto& e : ev.iterate(v)) acc = ev.binop(ExprKind::Add, acc, attribute && !attribute->is_none() ? ev.attr_getter_value(e, *attribute) : e);
  return acc;
}

Value f_map(Evaluator& ev, const Value& v, CallArgs& a) {
  List out;
  const Value* attribute = nullptr;
  const Value* dflt = nullptr;
  for (const auto& [k, val] : a.kw) {
    if (k == "attribute") attribute = &val;
    if (k == "default") dflt = &val;
  }
  if (a.pos.empty() && attribute) {
    for (const auto& e : ev.iterate(v)) {
      Value r = ev.attr_getter_value(e, *attribute);
      if (r.is_undefined() && dflt) r = *dflt;
      out.push_back(std::move(r));
    }
    return gen(std::move(out));
  }
  if (a.pos.empty()) fail("map requires a filter argument");
  std::string fname = to_str(a.pos[0]);
  CallArgs rest;
  rest.pos.assign(a.pos.begin() + 1, a.pos.end());
  rest.kw = a.kw;
  for (const auto& e : ev.iterate(v)) {
    CallArgs copy = rest;
    out.push_back(ev.apply_filter(fname, e, copy));
  }
  return gen(std::move(out));
}

Value select_impl(Evaluator& ev, const Value& v, CallArgs& a, bool by_attr, bool want) {
  size_t off = 0;
  Value attribute;
  if (by_attr) {
    if (a.pos.empty()) fail("selectattr/rejectattr need an attribute");
    attribute = a.pos[0];
    off = 1;
  }
  bool has_test = a.pos.size() > off;
  std::string test = has_test ? to_str(a.pos[off]) : "";
  CallArgs targs;
  if (has_test) targs.pos.assign(a.pos.begin() + off + 1, a.pos.end());
  targs.kw = a.kw;
  List out;
  for (const auto& e : ev.iterate(v)) {
    Value x = by_attr ? ev.attr_getter_value(e, attribute) : e;
    bool r;
    if (has_test) {
      CallArgs copy = targs;
      r = ev.apply_test(test, x, copy);
    } else {
      r = truthy(x);
    }
    if (r == want) out.push_back(e);
  }
  return gen(std::move(out));
}
Value f_select(Evaluator& ev, const Value& v, CallArgs& a) { return select_impl(ev, v, a, false, true); }
Value f_reject(Evaluator& ev, const Value& v, CallArgs& a) { return select_impl(ev, v, a, false, false); }
Value f_selectattr(Evaluator& ev, const Value& v, CallArgs& a) { return select_impl(ev, v, a, true, true); }
Value f_rejectattr(Evaluator& ev, const Value& v, CallArgs& a) { return select_impl(ev, v, a, true, false); }

Value f_indent(Evaluator& ev, const Value& v, CallArgs& a) {
  const Value* w = kwarg(a, 0, "width");
  bool first = arg_bool(a, 1, "first", false);
  bool blank = arg_bool(a, 2, "blank", false);
  std::string ind;
  if (w && w->is_string()) ind = w->s;
  else {
    int64_t n = w ? as_int(*w, "width") : 4;
    ev.check_size(static_cast<size_t>(std::max<int64_t>(n, 0)));
    ind = std::string(static_cast<size_t>(std::max<int64_t>(n, 0)), ' ');
  }
  std::string s = to_str(v) + "\n";
  std::vector<std::string> lines = str_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t k = 0; k < lines.size(); ++k) rv += (k ? "\n" + ind : "") + lines[k];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t k = 1; k < lines.size(); ++k) {
      rv += "\n";
      if (!lines[k].empty()) rv += ind;
      rv += lines[k];
      ev.check_size(rv.size());
    }
  }
  if (first) rv = ind + rv;
  return Value::string(std::move(rv));
}

Value f_center(Evaluator& ev, const Value& v, CallArgs& a) {
  const Value* w = kwarg(a, 0, "width");
  CallArgs m;
  m.pos.push_back(w ? *w : Value::integer(80));
  return ev.call_method(Value::string(to_str(v)), "center", m);
}

Value f_wordcount(Evaluator&, const Value& v, CallArgs&) {
  std::string s = to_str(v);
  int64_t n = 0;
  bool in_word = false;
  size_t i = 0;
  while (i < s.size()) {
    bool w = cp_word(next_cp(s, i));
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value::integer(n);
}

Value f_format(Evaluator&, const Value& v, CallArgs& a) {
  if (!a.kw.empty() && !a.pos.empty()) fail("can't handle positional and keyword arguments at the same time");
  if (!a.kw.empty()) {
    Value d = Value::make_dict();
    for (const auto& [k, val] : a.kw) d.dict->set(Value::string(k), val);
    return Value::string(percent_format(to_str(v), {}, &d));
  }
  return Value::string(percent_format(to_str(v), a.pos, nullptr));
}

Value f_attr(Evaluator& ev, const Value& v, CallArgs& a) {
  const Value* n = kwarg(a, 0, "name");
  if (!n) fail("attr() missing name");
  return ev.getattr(v, to_str(*n));
}

Value f_batch(Evaluator& ev, const Value& v, CallArgs& a) {
  const Value* n = kwarg(a, 0, "linecount");
  const Value* fill = kwarg(a, 1, "fill_with");
  int64_t size = n ? as_int(*n, "linecount") : 1;
  if (size <= 0) fail("batch size must be positive");
  List out, cur;
  for (const auto& e : ev.iterate(v)) {
    cur.push_back(e);
    if (static_cast<int64_t>(cur.size()) == size) {
      out.push_back(Value::make_list(std::move(cur)));
      cur.clear();
    }
  }
  if (!cur.empty()) {
    if (fill && !fill->is_none())
      while (static_cast<int64_t>(cur.size()) < size) cur.push_back(*fill);
    out.push_back(Value::make_list(std::move(cur)));
  }
  return gen(std::move(out));
}

const std::unordered_map<std::string, FilterFn>& filters() {
  static const std::unordered_map<std::string, FilterFn> table = {
      {"length", f_length}, {"count", f_length}, {"tojson", f_tojson}, {"trim", f_trim}, {"upper", f_upper},
      {"lower", f_lower}, {"title", f_title}, {"capitalize", f_capitalize}, {"string", f_string}, {"safe", f_safe},
      {"e", f_escape}, {"escape", f_escape}, {"forceescape", f_escape}, {"pprint", f_pprint}, {"replace", f_replace},
      {"default", f_default}, {"d", f_default}, {"join", f_join}, {"first", f_first}, {"last", f_last}, {"list", f_list},
      {"int", f_int}, {"float", f_float}, {"abs", f_abs}, {"round", f_round}, {"items", f_items}, {"dictsort", f_dictsort},
      {"sort", f_sort}, {"unique", f_unique}, {"reverse", f_reverse}, {"max", f_max}, {"min", f_min}, {"sum", f_sum},
      {"map", f_map}, {"select", f_select}, {"reject", f_reject}, {"selectattr", f_selectattr}, {"rejectattr", f_rejectattr},
      {"indent", f_indent}, {"center", f_center}, {"wordcount", f_wordcount}, {"format", f_format}, {"attr", f_attr},
      {"batch", f_batch},
  };
  return table;
}

bool cmp_test(Evaluator& ev, const Value& v, CallArgs& a, const char* op) {
  const Value* other = kwarg(a, 0, "other");
  if (!other) fail("test requires an argument");
  return ev.compare(op, v, *other);
}

const std::unordered_map<std::string, TestFn>& tests() {
  static const std::unordered_map<std::string, TestFn> table = {
      {"defined", [](Evaluator&, const Value& v, CallArgs&) { return !v.is_undefined(); }},
      {"undefined", [](Evaluator&, const Value& v, CallArgs&) { return v.is_undefined(); }},
      {"none", [](Evaluator&, const Value& v, CallArgs&) { return v.is_none(); }},
      {"boolean", [](Evaluator&, const Value& v, CallArgs&) { return v.kind == Kind::Bool; }},
      {"true", [](Evaluator&, const Value& v, CallArgs&) { return v.kind == Kind::Bool && v.b; }},
      {"false", [](Evaluator&, const Value& v, CallArgs&) { return v.kind == Kind::Bool && !v.b; }},
      {"integer", [](Evaluator&, const Value& v, CallArgs&) { return v.kind == Kind::Int; }},
      {"float", [](Evaluator&, const Value& v, CallArgs&) { return v.kind == Kind::Float; }},
      {"number", [](Evaluator&, const Value& v, CallArgs&) { return v.is_number(); }},
      {"string", [](Evaluator&, const Value& v, CallArgs&) { return v.is_string(); }},
      {"mapping", [](Evaluator&, const Value& v, CallArgs&) { return v.kind == Kind::Dict; }},
      {"iterable",
       [](Evaluator&, const Value& v, CallArgs&) {
         return v.is_undefined() || v.is_string() || v.is_sequence() || v.kind == Kind::Dict;
       }},
      {"sequence",
       [](Evaluator&, const Value& v, CallArgs&) {
         return v.is_string() || v.kind == Kind::List || v.kind == Kind::Tuple || v.kind == Kind::Dict;
       }},
      {"callable",
       [](Evaluator&, const Value& v, CallArgs&) { return v.kind == Kind::Callable || (v.kind == Kind::Loop && v.loop->recurse); }},
      {"sameas",
       [](Evaluator&, const Value& v, CallArgs& a) {
         const Value* o = a.get(0, "other");
         if (!o) fail("sameas requires an argument");
         if (v.kind != o->kind) return false;
         switch (v.kind) {
           case Kind::None:
           case Kind::Undefined: return true;
           case Kind::Bool: return v.b == o->b;
           case Kind::Int: return v.i == o->i && v.i >= -5 && v.i <= 256;  // CPython's small-int cache
           case Kind::List:
           case Kind::Tuple:
           case Kind::Generator: return v.list == o->list;
           case Kind::Dict:
           case Kind::Namespace: return v.dict == o->dict;
           default: return false;
         }
       }},
      {"escaped", [](Evaluator&, const Value&, CallArgs&) { return false; }},
      {"in",
       [](Evaluator& ev, const Value& v, CallArgs& a) {
         const Value* o = a.get(0, "seq");
         if (!o) fail("in requires an argument");
         return ev.contains(*o, v);
       }},
      {"odd", [](Evaluator&, const Value& v, CallArgs&) { return (as_int(v, "odd") & 1) != 0; }},
      {"even", [](Evaluator&, const Value& v, CallArgs&) { return (as_int(v, "even") & 1) == 0; }},
      {"divisibleby",
       [](Evaluator&, const Value& v, CallArgs& a) {
         const Value* n = a.get(0, "num");
         if (!n) fail("divisibleby requires an argument");
         int64_t d = as_int(*n, "divisibleby");
         if (d == 0) fail("integer division or modulo by zero");
         return as_int(v, "divisibleby") % d == 0;
       }},
      {"eq", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "eq"); }},
      {"equalto", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "eq"); }},
      {"==", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "eq"); }},
      {"ne", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "ne"); }},
      {"!=", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "ne"); }},
      {"lt", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "lt"); }},
      {"lessthan", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "lt"); }},
      {"<", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "lt"); }},
      {"le", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "lteq"); }},
      {"<=", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "lteq"); }},
      {"gt", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "gt"); }},
      {"greaterthan", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "gt"); }},
      {">", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "gt"); }},
      {"ge", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "gteq"); }},
      {">=", [](Evaluator& ev, const Value& v, CallArgs& a) { return cmp_test(ev, v, a, "gteq"); }},
      {"lower",
       [](Evaluator&, const Value& v, CallArgs&) { return v.is_string() && str_lower(v.s) == v.s; }},
      {"upper",
       [](Evaluator&, const Value& v, CallArgs&) { return v.is_string() && str_upper(v.s) == v.s; }},
      {"filter",
       [](Evaluator&, const Value& v, CallArgs&) { return v.is_string() && filters().count(v.s) > 0; }},
      {"test", [](Evaluator&, const Value& v, CallArgs&) { return v.is_string() && (v.s == "defined" || v.s == "none"); }},
  };
  return table;
}

}  // namespace

Value Evaluator::apply_filter(const std::string& name, const Value& in, CallArgs& args) {
  const auto& table = filters();
  auto it = table.find(name);
  if (it == table.end()) fail("No filter named '" + name + "'.");
  if (in.unsafe) fail_undefined(in);
  return it->second(*this, in, args);
}

bool Evaluator::apply_test(const std::string& name, const Value& in, CallArgs& args) {
  const auto& table = tests();
  auto it = table.find(name);
  if (it == table.end()) fail("No test named '" + name + "'.");
  return it->second(*this, in, args);
}

namespace {

void install_globals(Scope& g) {
  g.vars["range"] = Value::callable("range", [](Evaluator&, CallArgs& a) {
    if (a.pos.empty() || a.pos.size() > 3) fail("range expected 1 to 3 arguments");
    int64_t start = 0, stop, step = 1;
    if (a.pos.size() == 1) {
      stop = as_int(a.pos[0], "range");
    } else {
      start = as_int(a.pos[0], "range");
      stop = as_int(a.pos[1], "range");
      if (a.pos.size() == 3) step = as_int(a.pos[2], "range");
    }
    if (step == 0) fail("range() arg 3 must not be zero");
    double n = step > 0 ? std::ceil((static_cast<double>(stop) - start) / step) : std::ceil((static_cast<double>(start) - stop) / -step);
    if (n > 100000) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    List out;
    for (int64_t v = start; step > 0 ? v < stop : v > stop; v += step) out.push_back(Value::integer(v));
    return Value::make_list(std::move(out));
  });
  auto dict_from = [](CallArgs& a, Value d) {
    if (a.pos.size() > 1) fail("expected at most 1 positional argument");
    if (!a.pos.empty()) {
      const Value& src = a.pos[0];
      if (src.kind == Kind::Dict || src.kind == Kind::Namespace) {
        for (const auto& [k, v] : src.dict->items) d.dict->set(k, v);
      } else if (src.is_sequence()) {
        for (const auto& pair : *src.list) {
          if (!pair.is_sequence() || pair.list->size() != 2) fail("dictionary update sequence element has wrong length");
          d.dict->set((*pair.list)[0], (*pair.list)[1]);
        }
      } else {
        fail("'" + type_name(src) + "' object is not iterable");
      }
    }
    for (const auto& [k, v] : a.kw) d.dict->set(Value::string(k), v);
    return d;
  };
  g.vars["dict"] = Value::callable("dict", [dict_from](Evaluator&, CallArgs& a) { return dict_from(a, Value::make_dict()); });
  g.vars["namespace"] = Value::callable("namespace", [dict_from](Evaluator&, CallArgs& a) { return dict_from(a, Value::namespace_()); });
  g.vars["raise_exception"] = Value::callable("raise_exception", [](Evaluator&, CallArgs& a) -> Value {
    const Value* m = a.get(0, "message");
    throw TemplateError(m ? to_str(*m) : std::string(), true);
  });
  g.vars["strftime_now"] = Value::callable("strftime_now", [](Evaluator&, CallArgs& a) {
    const Value* f = a.get(0, "format");
    if (!f || !f->is_string()) fail("strftime_now expects a format string");
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    std::string out(256 + f->s.size() * 8, '\0');
    size_t n = f->s.empty() ? 0 : std::strftime(out.data(), out.size(), f->s.c_str(), &tm);
    out.resize(n);
    return Value::string(out);
  });
}

}  // namespace

std::string render(const Program& program, const Value& context, const Limits& limits) {
  auto globals = std::make_shared<Scope>();
  install_globals(*globals);
  auto ctx = std::make_shared<Scope>();
  ctx->parent = globals;
  if (context.kind == Kind::Dict)
    for (const auto& [k, v] : context.dict->items) ctx->vars[to_str(k)] = v;
  auto top = std::make_shared<Scope>();
  top->parent = ctx;
  std::string out;
  Evaluator ev(limits, &out);
  ev.exec_body(program.body, top);
  return out;
}

}  // namespace kvserve::text::jinja
