// Template values with Python's semantics: str()/repr() formatting, equality, ordering, and
// json.dumps as transformers' tojson calls it.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "text/jinja.h"

namespace kvserve::text::jinja {

uint32_t next_cp(std::string_view s, size_t& i) {
  unsigned char c = s[i];
  int n = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : 0;
  if (n == 0 || i + n >= s.size()) {
    ++i;
    return c;
  }
  uint32_t cp = c & (0x3f >> n);
  for (int k = 1; k <= n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  i += n + 1;
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

bool is_py_space(uint32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f ||
         c == 0x3000;
}

Value Value::undefined(std::string hint) {
  Value v;
  v.s = std::move(hint);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::None;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.kind = Kind::Bool;
  v.b = b;
  v.i = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.kind = Kind::Int;
  v.i = i;
  return v;
}
Value Value::number(double f) {
  Value v;
  v.kind = Kind::Float;
  v.f = f;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind = Kind::String;
  v.s = std::move(s);
  return v;
}
Value Value::make_list(List items, Kind k) {
  Value v;
  v.kind = k;
  v.list = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::make_dict() {
  Value v;
  v.kind = Kind::Dict;
  v.dict = std::make_shared<Dict>();
  return v;
}
Value Value::namespace_() {
  Value v;
  v.kind = Kind::Namespace;
  v.dict = std::make_shared<Dict>();
  return v;
}
Value Value::callable(std::string name, std::function<Value(Evaluator&, CallArgs&)> f) {
  Value v;
  v.kind = Kind::Callable;
  v.fn = std::make_shared<Callable>(Callable{std::move(name), std::move(f)});
  return v;
}

const Value* Dict::find(const Value& key) const {
  if (key.kind == Kind::String) return find(key.s);
  for (const auto& [k, v] : items)
    if (py_equal(k, key)) return &v;
  return nullptr;
}
const Value* Dict::find(const std::string& key) const {
  for (const auto& [k, v] : items)
    if (k.kind == Kind::String && k.s == key) return &v;
  return nullptr;
}
void Dict::set(const Value& key, Value v) {
  for (auto& [k, old] : items)
    if (py_equal(k, key)) {
      old = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

const Value* CallArgs::get(size_t index, const char* name) const {
  if (index < pos.size()) return &pos[index];
  if (name)
    for (const auto& [k, v] : kw)
      if (k == name) return &v;
  return nullptr;
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return v.b;
    case Kind::Int: return v.i != 0;
    case Kind::Float: return v.f != 0.0;
    case Kind::String: return !v.s.empty();
    case Kind::List:
    case Kind::Tuple: return !v.list->empty();
    case Kind::Dict: return !v.dict->items.empty();
    default: return true;  // generators, namespaces, callables
  }
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string_view s(buf, res.ptr - buf);
  std::string out;
  if (s[0] == '-') {
    out += '-';
    s.remove_prefix(1);
  }
  size_t e = s.find('e');
  std::string digits;
  for (char c : s.substr(0, e))
    if (c != '.') digits += c;
  int exp = std::stoi(std::string(s.substr(e + 1)));
  int decpt = exp + 1;
  int nd = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(-decpt, '0') + digits;
    } else if (decpt >= nd) {
      out += digits + std::string(decpt - nd, '0') + ".0";
    } else {
      out += digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out += digits.substr(0, 1);
    if (nd > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return out;
}

namespace {

// Approximates Python's str.isprintable() for repr(): control, format, separator and private-use
// code points are escaped.
bool is_printable(uint32_t c) {
  if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad) return false;
  if (c == 0x1680 || c == 0x180e || c == 0x061c || (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) ||
      (c >= 0x205f && c <= 0x206f) || c == 0x3000 || c == 0xfeff || (c >= 0xfff9 && c <= 0xfffb) ||
      (c >= 0xd800 && c <= 0xf8ff) || c >= 0xf0000)
    return false;
  return true;
}

std::string str_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  char q = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, q);
  size_t i = 0;
  while (i < s.size()) {
    uint32_t c = next_cp(s, i);
    if (c == static_cast<uint32_t>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (!is_printable(c)) {
      char buf[16];
      if (c <= 0xff) std::snprintf(buf, sizeof buf, "\\x%02x", c);
      else if (c <= 0xffff) std::snprintf(buf, sizeof buf, "\\u%04x", c);
      else std::snprintf(buf, sizeof buf, "\\U%08x", c);
      out += buf;
    } else {
      append_utf8(out, c);
    }
  }
  out += q;
  return out;
}

}  // namespace

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List: return "list";
    case Kind::Tuple: return "tuple";
    case Kind::Generator: return "generator";
    case Kind::Dict: return "dict";
    case Kind::Namespace: return "Namespace";
    case Kind::Callable: return "function";
    case Kind::Loop: return "LoopContext";
  }
  return "object";
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Kind::String: return str_repr(v.s);
    case Kind::List:
    case Kind::Tuple: {
      bool tuple = v.kind == Kind::Tuple;
      std::string out = tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += ", ";
        out += repr((*v.list)[k]);
      }
      if (tuple && v.list->size() == 1) out += ",";
      out += tuple ? ")" : "]";
      return out;
    }
    case Kind::Dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, val] : v.dict->items) {
        if (!first) out += ", ";
        first = false;
        out += repr(k) + ": " + repr(val);
      }
      return out + "}";
    }
    case Kind::Undefined: return "Undefined";
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return v.b ? "True" : "False";
    case Kind::Int: return std::to_string(v.i);
    case Kind::Float: return float_repr(v.f);
    case Kind::String: return v.s;
    case Kind::Generator: return "<generator object>";
    case Kind::Namespace: {
      Value d;
      d.kind = Kind::Dict;
      d.dict = v.dict;
      return "<Namespace " + repr(d) + ">";
    }
    case Kind::Callable: return "<function " + v.fn->name + ">";
    case Kind::Loop: return "<LoopContext " + std::to_string(v.loop->index0 + 1) + "/" + std::to_string(v.loop->items->size()) + ">";
    default: return repr(v);
  }
}

bool py_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::Float || b.kind == Kind::Float) {
      double x = a.kind == Kind::Float ? a.f : static_cast<double>(a.i);
      double y = b.kind == Kind::Float ? b.f : static_cast<double>(b.i);
      return x == y;
    }
    return a.i == b.i;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::Undefined:
    case Kind::None: return true;
    case Kind::String: return a.s == b.s;
    case Kind::List:
    case Kind::Tuple:
      if (a.list == b.list) return true;
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!py_equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Kind::Dict:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->find(k);
        if (!o || !py_equal(v, *o)) return false;
      }
      return true;
    case Kind::Generator: return a.list == b.list;
    case Kind::Namespace: return a.dict == b.dict;
    case Kind::Callable: return a.fn == b.fn;
    case Kind::Loop: return a.loop == b.loop;
    default: return false;
  }
}

int py_compare(const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined()) throw TemplateError(a.is_undefined() ? a.s : b.s);
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::Float || b.kind == Kind::Float) {
      double x = a.kind == Kind::Float ? a.f : static_cast<double>(a.i);
      double y = b.kind == Kind::Float ? b.f : static_cast<double>(b.i);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    return a.i < b.i ? -1 : a.i > b.i ? 1 : 0;
  }
  if (a.kind == Kind::String && b.kind == Kind::String) return a.s.compare(b.s) < 0 ? -1 : a.s == b.s ? 0 : 1;
  if ((a.kind == Kind::List || a.kind == Kind::Tuple) && a.kind == b.kind) {
    size_t n = std::min(a.list->size(), b.list->size());
    for (size_t k = 0; k < n; ++k) {
      if (py_equal((*a.list)[k], (*b.list)[k])) continue;
      return py_compare((*a.list)[k], (*b.list)[k]);
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
  }
  throw TemplateError("'<' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

namespace {
template <class Json>
Value from_json_impl(const Json& j) {
  switch (j.type()) {
    case nlohmann::detail::value_t::null: return Value::none();
    case nlohmann::detail::value_t::boolean: return Value::boolean(j.template get<bool>());
    case nlohmann::detail::value_t::number_integer: return Value::integer(j.template get<int64_t>());
    case nlohmann::detail::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) throw TemplateError("integer too large in template context");
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::detail::value_t::number_float: return Value::number(j.template get<double>());
    case nlohmann::detail::value_t::string: return Value::string(j.template get<std::string>());
    case nlohmann::detail::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json_impl(e));
      return Value::make_list(std::move(items));
    }
    case nlohmann::detail::value_t::object: {
      Value d = Value::make_dict();
      d.dict->items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) d.dict->items.emplace_back(Value::string(it.key()), from_json_impl(it.value()));
      return d;
    }
    default: return Value::none();
  }
}

}  // namespace

Value from_json(const nlohmann::json& j) { return from_json_impl(j); }
Value from_json(const nlohmann::ordered_json& j) { return from_json_impl(j); }

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  size_t i = 0;
  while (i < s.size()) {
    uint32_t c = next_cp(s, i);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default: {
        char buf[16];
        if (c < 0x20 || (ensure_ascii && c > 0x7e)) {
          if (c >= 0x10000) {
            uint32_t v = c - 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
          }
          out += buf;
        } else {
          append_utf8(out, c);
        }
      }
    }
  }
  out += '"';
}

std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return float_repr(d);
}

// json.dumps options as transformers' tojson passes them.
struct JsonOpts {
  bool has_indent;
  std::string indent;
  std::string item_sep, key_sep;
  bool sort_keys;
  bool ensure_ascii;
};

void dump(std::string& out, const Value& v, const JsonOpts& o, int level, int depth) {
  if (depth > 500) throw TemplateError("maximum recursion depth exceeded while encoding a JSON object");
  auto newline = [&](int lvl) {
    out += '\n';
    for (int k = 0; k < lvl; ++k) out += o.indent;
  };
  switch (v.kind) {
    case Kind::None: out += "null"; return;
    case Kind::Bool: out += v.b ? "true" : "false"; return;
    case Kind::Int: out += std::to_string(v.i); return;
    case Kind::Float: out += json_float(v.f); return;
    case Kind::String: json_string(out, v.s, o.ensure_ascii); return;
    case Kind::List:
    case Kind::Tuple: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      if (o.has_indent) newline(level + 1);
      bool first = true;
      for (const auto& e : *v.list) {
        if (!first) {
          out += o.item_sep;
          if (o.has_indent) newline(level + 1);
        }
        first = false;
        dump(out, e, o, level + 1, depth + 1);
      }
      if (o.has_indent) newline(level);
      out += ']';
      return;
    }
    case Kind::Dict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<std::string, const Value*>> entries;
      for (const auto& [k, val] : v.dict->items) {
        std::string key;
        switch (k.kind) {
          case Kind::String: key = k.s; break;
          case Kind::Int: key = std::to_string(k.i); break;
          case Kind::Float: key = json_float(k.f); break;
          case Kind::Bool: key = k.b ? "true" : "false"; break;
          case Kind::None: key = "null"; break;
          default: throw TemplateError("keys must be str, int, float, bool or None, not " + type_name(k));
        }
        entries.emplace_back(std::move(key), &val);
      }
      if (o.sort_keys)
        std::stable_sort(entries.begin(), entries.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
      out += '{';
      if (o.has_indent) newline(level + 1);
      bool first = true;
      for (const auto& [k, val] : entries) {
        if (!first) {
          out += o.item_sep;
          if (o.has_indent) newline(level + 1);
        }
        first = false;
        json_string(out, k, o.ensure_ascii);
        out += o.key_sep;
        dump(out, *val, o, level + 1, depth + 1);
      }
      if (o.has_indent) newline(level);
      out += '}';
      return;
    }
    default:
      throw TemplateError("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, int indent, const std::string& indent_str, bool has_indent, const std::string* item_sep,
                    const std::string* key_sep, bool sort_keys, bool ensure_ascii) {
  JsonOpts o;
  o.has_indent = has_indent;
  o.indent = indent_str.empty() && indent > 0 ? std::string(indent, ' ') : indent_str;
  o.item_sep = item_sep ? *item_sep : (has_indent ? "," : ", ");
  o.key_sep = key_sep ? *key_sep : ": ";
  o.sort_keys = sort_keys;
  o.ensure_ascii = ensure_ascii;
  std::string out;
  dump(out, v, o, 0, 0);
  return out;
}

}  // namespace kvserve::text::jinja
