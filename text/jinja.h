#pragma once
// Internals of the chat-template interpreter (a Jinja2 subset): values, syntax tree, parser and
// evaluator. Only chat_template.cpp and the unit tests include this; everyone else uses
// chat_template.h.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace kvserve::text::jinja {

struct Value;
struct Dict;
struct Callable;
struct LoopState;
struct Evaluator;
struct CallArgs;
using List = std::vector<Value>;

// Python type a Value stands for; Generator marks jinja2's lazy results (map, select, ...), which
// Python treats differently from lists (always truthy, no len()).
enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, List, Tuple, Generator, Dict, Namespace, Callable, Loop };

// A dynamically typed template value with Python semantics; containers are shared and immutable
// once built, except Namespace, which `{% set ns.attr %}` mutates through every copy.
struct Value {
  Kind kind = Kind::Undefined;
  bool b = false;
  bool unsafe = false;  // Undefined standing for a sandbox-forbidden attribute
  int64_t i = 0;
  double f = 0;
  std::string s;  // String payload; for Undefined the message raised when it is used
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Callable> fn;
  std::shared_ptr<LoopState> loop;

  static Value undefined(std::string hint = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v);
  static Value make_list(List items, Kind k = Kind::List);
  static Value make_dict();
  static Value namespace_();
  static Value callable(std::string name, std::function<Value(Evaluator&, CallArgs&)> f);

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_string() const { return kind == Kind::String; }
  bool is_sequence() const { return kind == Kind::List || kind == Kind::Tuple || kind == Kind::Generator; }
  bool is_mapping() const { return kind == Kind::Dict; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
};

// Insertion-ordered mapping, as Python dicts are; keys compare with Python equality.
struct Dict {
  std::vector<std::pair<Value, Value>> items;
  const Value* find(const Value& key) const;
  const Value* find(const std::string& key) const;
  void set(const Value& key, Value v);
};

// Positional and keyword arguments of a call, in source order.
struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* get(size_t index, const char* name) const;
};

// A function value: globals (range, namespace, ...), bound methods, macros, loop.cycle.
struct Callable {
  std::string name;
  std::function<Value(Evaluator&, CallArgs&)> fn;
};

// The state behind `loop` inside a for body.
struct LoopState {
  std::shared_ptr<List> items;
  size_t index0 = 0;
  int depth = 1;
  Value last_changed;
  bool has_changed = false;
  std::function<Value(Evaluator&, const Value&)> recurse;  // set for `recursive` loops
};

// UTF-8 helpers: strings stay UTF-8 bytes; code points are decoded where Python semantics need them.
uint32_t next_cp(std::string_view s, size_t& i);  // invalid bytes decode as themselves
void append_utf8(std::string& out, uint32_t cp);
bool is_py_space(uint32_t cp);  // Python str.isspace()

// Python semantics helpers shared by evaluator and tests.
bool truthy(const Value& v);
std::string to_str(const Value& v);       // Python str()
std::string repr(const Value& v);         // Python repr()
std::string float_repr(double d);         // Python repr() of a float
bool py_equal(const Value& a, const Value& b);
int py_compare(const Value& a, const Value& b);  // <0, 0, >0; throws on unorderable types
std::string type_name(const Value& v);    // Python type name: str, dict, list, ...
Value from_json(const nlohmann::json& j);
Value from_json(const nlohmann::ordered_json& j);  // keeps the document's key order, as Python does
// json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...); indent < 0 means None.
std::string to_json(const Value& v, int indent, const std::string& indent_str, bool has_indent,
                    const std::string* item_sep, const std::string* key_sep, bool sort_keys,
                    bool ensure_ascii = false);

// ---- syntax tree ----

struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

// Expression node kinds.
enum class ExprKind : uint8_t {
  Const, Name, Getattr, Getitem, Slice, Call, Filter, Test, Neg, Pos, Not, Add, Sub, Mul, Div,
  FloorDiv, Mod, Pow, And, Or, Compare, Concat, CondExpr, ListLit, TupleLit, DictLit
};

// One expression node; which fields are used depends on `kind`.
struct Expr {
  ExprKind kind;
  int line = 0;
  Value constant;                 // Const
  std::string name;               // Name, Getattr attribute, Filter/Test name
  ExprPtr a, b, c;                // operands; Filter/Test input in `a` (null for filter blocks)
  std::vector<ExprPtr> args;      // call args, list items, compare operands, concat parts, dict keys/values interleaved
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr dyn_args, dyn_kwargs;   // *args / **kwargs
  std::vector<std::string> ops;   // Compare operators: eq ne lt lteq gt gteq in notin
  bool negated = false;           // Test: `is not`
};

// An assignment target: a name, a tuple of names, or a namespace attribute.
struct Target {
  std::vector<std::string> names;
  bool is_tuple = false;
  std::string ns_attr;  // non-empty: `{% set names[0].ns_attr = ... %}`
};

// Statement node kinds.
enum class StmtKind : uint8_t { Data, Print, If, For, Set, SetBlock, Macro, CallBlock, FilterBlock, Break, Continue, With, Scope };

// One statement node; which fields are used depends on `kind`.
struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;                      // Data; Macro name
  ExprPtr expr;                          // Print/Set value, For iterable, CallBlock call, Set/FilterBlock filter chain
  ExprPtr cond;                          // For `if` filter
  std::vector<std::pair<ExprPtr, Body>> branches;  // If / elif
  Body body, else_body;
  Target target;
  bool recursive = false;
  std::vector<std::string> params;       // Macro / CallBlock signature
  std::vector<ExprPtr> defaults;         // defaults for the last params
  std::vector<Target> with_targets;      // With
  std::vector<ExprPtr> with_values;
};

// A parsed template, immutable and shareable between renders.
struct Program {
  Body body;
};

// Parses template source into a Program; throws TemplateError on syntax errors.
std::shared_ptr<const Program> parse(const std::string& source);

// Caps that keep adversarial templates from exhausting time, memory or stack.
struct Limits {
  size_t max_output = 64u << 20;
  size_t max_steps = 3'000'000;  // a 1000-message conversation needs ~100k
  int max_call_depth = 64;
  size_t max_container = 10'000'000;  // elements or bytes in one built value
};

// Renders a Program against a dict of variables.
std::string render(const Program& program, const Value& context, const Limits& limits = {});

}  // namespace kvserve::text::jinja
