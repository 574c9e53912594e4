// YAML -> ServerConfig. Every problem is collected with file, line and key, then thrown together.
#include "configs/server_config.h"

#include "policies/policy_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>

namespace kvserve::config {

std::string ServerConfig::model_name() const {
  if (!model.served_model_name.empty()) return model.served_model_name;
  std::string p = model.path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  auto slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

std::string ConfigIssue::format() const {
  std::ostringstream os;
  os << (file.empty() ? "<config>" : file);
  if (line > 0) {
    os << ":" << line;
    if (column > 0) os << ":" << column;
  }
  os << ": ";
  if (!key.empty()) os << "key '" << key << "': ";
  os << message;
  return os.str();
}

static std::string join_issues(const std::vector<ConfigIssue>& issues) {
  std::string out;
  for (size_t i = 0; i < issues.size(); ++i) {
    if (i) out += "\n";
    out += issues[i].format();
  }
  return out.empty() ? "invalid config" : out;
}

ConfigError::ConfigError(std::vector<ConfigIssue> issues)
    : std::runtime_error(join_issues(issues)), issues_(std::move(issues)) {}

int64_t parse_byte_size(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t start = i;
  bool dot = false;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || (text[i] == '.' && !dot))) {
    if (text[i] == '.') dot = true;
    ++i;
  }
  if (i == start) throw std::invalid_argument("'" + text + "' is not a size (examples: 4096, 512MiB, 2GiB, 1.5GB)");
  double number = std::strtod(text.substr(start, i - start).c_str(), nullptr);
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  for (; i < text.size(); ++i) {
    if (std::isspace(static_cast<unsigned char>(text[i]))) break;
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i != text.size()) throw std::invalid_argument("'" + text + "' is not a size: trailing text");
  static const std::map<std::string, double> units = {
      {"", 1.0},           {"b", 1.0},
      {"k", 1024.0},       {"kib", 1024.0},       {"kb", 1e3},
      {"m", 1048576.0},    {"mib", 1048576.0},    {"mb", 1e6},
      {"g", 1073741824.0}, {"gib", 1073741824.0}, {"gb", 1e9},
      {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12},
  };
  auto it = units.find(unit);
  if (it == units.end())
    throw std::invalid_argument("'" + text + "': unknown unit '" + unit + "' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)");
  double bytes = number * it->second;
  if (!std::isfinite(bytes) || bytes >= 9.2e18) throw std::invalid_argument("'" + text + "' is too large");
  return static_cast<int64_t>(std::llround(bytes));
}

void validate_device(const std::string& device) {
  if (device == "cpu" || device == "cuda") return;
  if (device.rfind("cuda:", 0) == 0 && device.size() > 5 && device.size() <= 8) {
    bool digits = true;
    for (size_t i = 5; i < device.size(); ++i) digits = digits && std::isdigit(static_cast<unsigned char>(device[i]));
    if (digits) return;
  }
  throw std::invalid_argument("device must be cpu, cuda or cuda:<index>, got '" + device + "'");
}

std::string effective_api_key(const ServerSection& server) {
  if (!server.api_key.empty()) return server.api_key;
  if (!server.api_key_env.empty()) {
    if (const char* v = std::getenv(server.api_key_env.c_str())) return v;
  }
  return {};
}

namespace {

const std::set<std::string> kDtypes = {"float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "auto"};
// cache.kv_cache_dtype: the float dtypes, and the quantized formats (int8 = q8_0, int4 = q4_0, fp8 =
// fp8_e4m3).
const std::set<std::string> kQuantKvDtypes = {"int8", "int4", "q8_0", "q4_0", "q4_1", "fp8", "fp8_e4m3"};
const char* const kKvDtypeChoices = "auto, float32, bfloat16, float16, int8, int4, fp8, q8_0, q4_0, q4_1, fp8_e4m3";
std::string check_kv_cache_dtype(const std::string& s) {
  if (kDtypes.count(s) || kQuantKvDtypes.count(s)) return {};
  if (s.rfind("fp8", 0) == 0) return "'" + s + "' is not available: kvserve's fp8 KV cache is e4m3 (fp8 or fp8_e4m3)";
  return std::string("must be one of ") + kKvDtypeChoices + "; got '" + s + "'";
}
const std::set<std::string> kCpuGemms = {"mkl", "onednn"};
const std::set<std::string> kQuantizations = {"none", "int8", "int4", "fp8",  "q8_0", "q4_0",
                                              "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"};
const std::set<std::string> kToolParsers = {"auto", "hermes", "llama3_json", "mistral"};

// One spelling per dtype of kDtypes (aliases folded), to compare two names.
std::string canonical_dtype(const std::string& d) {
  if (d == "fp32") return "float32";
  if (d == "bf16") return "bfloat16";
  if (d == "fp16") return "float16";
  return d;
}

bool valid_policy_name(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) return false;
  return true;
}

std::string describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null: return "nothing (null)";
    case YAML::NodeType::Map: return "a mapping";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Scalar: return "'" + n.Scalar() + "'";
    default: return "an undefined value";
  }
}

class Parser {
 public:
  explicit Parser(std::string file) : file_(std::move(file)) {}

  void error(const YAML::Mark& mark, const std::string& key, const std::string& message) {
    ConfigIssue issue;
    issue.file = file_;
    issue.line = mark.line >= 0 ? mark.line + 1 : 0;
    issue.column = mark.column >= 0 ? mark.column + 1 : 0;
    issue.key = key;
    issue.message = message;
    issues_.push_back(std::move(issue));
  }
  // A null value (`key:` with nothing after it) has no useful mark: point at its key instead.
  void error(const YAML::Node& node, const std::string& key, const std::string& message) {
    error(node.IsNull() ? key_mark_ : node.Mark(), key, message);
  }

  using Handler = std::function<void(const YAML::Node& value, const std::string& path)>;

  // Walks a mapping: every key must be in `handlers`; duplicates and unknown keys are reported
  // with the list of valid keys.
  void parse_map(const YAML::Node& node, const std::string& path, const std::vector<std::pair<std::string, Handler>>& handlers) {
    if (!node.IsMap()) {
      if (node.IsNull()) return;  // an empty section keeps the defaults
      error(node, path, "expected a mapping, got " + describe(node));
      return;
    }
    std::set<std::string> seen;
    for (const auto& kv : node) {
      const YAML::Node& k = kv.first;
      if (!k.IsScalar()) {
        error(k, path, "keys must be plain strings");
        continue;
      }
      const std::string name = k.Scalar();
      const std::string full = path.empty() ? name : path + "." + name;
      if (!seen.insert(name).second) {
        error(k, full, "duplicate key");
        continue;
      }
      const Handler* h = nullptr;
      for (const auto& [hname, handler] : handlers)
        if (hname == name) h = &handler;
      if (!h) {
        std::string valid;
        for (const auto& [hname, handler] : handlers) valid += (valid.empty() ? "" : ", ") + hname;
        error(k, full, "unknown key; valid keys " + (path.empty() ? std::string("at top level") : "in '" + path + "'") +
                           ": " + valid);
        continue;
      }
      key_mark_ = k.Mark();
      (*h)(kv.second, full);
    }
  }

  bool scalar(const YAML::Node& n, const std::string& path, const char* what) {
    if (n.IsScalar()) return true;
    error(n, path, std::string("expected ") + what + ", got " + describe(n));
    return false;
  }

  Handler string_of(std::string& out, std::function<std::string(const std::string&)> check = nullptr) {
    return [this, &out, check](const YAML::Node& n, const std::string& path) {
      if (!scalar(n, path, "a string")) return;
      if (check) {
        std::string problem = check(n.Scalar());
        if (!problem.empty()) {
          error(n, path, problem);
          return;
        }
      }
      out = n.Scalar();
    };
  }

  // YAML's core-schema booleans only: `yes`/`on` are strings there, and a typo must not read as false.
  Handler bool_of(bool& out) {
    return [this, &out](const YAML::Node& n, const std::string& path) {
      if (!scalar(n, path, "true or false")) return;
      const std::string& s = n.Scalar();
      if (s == "true" || s == "True" || s == "TRUE") {
        out = true;
      } else if (s == "false" || s == "False" || s == "FALSE") {
        out = false;
      } else {
        error(n, path, "expected true or false, got " + describe(n));
      }
    };
  }

  template <typename Int>
  Handler int_of(Int& out, int64_t lo, int64_t hi) {
    return [this, &out, lo, hi](const YAML::Node& n, const std::string& path) {
      if (!scalar(n, path, "an integer")) return;
      const std::string& s = n.Scalar();
      char* end = nullptr;
      errno = 0;
      long long v = std::strtoll(s.c_str(), &end, 10);
      if (s.empty() || *end != '\0' || (s[0] != '-' && !std::isdigit(static_cast<unsigned char>(s[0])))) {
        error(n, path, "expected an integer, got " + describe(n));
        return;
      }
      if (errno == ERANGE || v < lo || v > hi) {
        error(n, path, "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + s);
        return;
      }
      out = static_cast<Int>(v);
    };
  }

  Handler number_of(double& out, double lo, double hi) {
    return [this, &out, lo, hi](const YAML::Node& n, const std::string& path) {
      if (!scalar(n, path, "a number")) return;
      const std::string& s = n.Scalar();
      char* end = nullptr;
      double v = std::strtod(s.c_str(), &end);
      if (s.empty() || *end != '\0' || !std::isfinite(v)) {
        error(n, path, "expected a number, got " + describe(n));
        return;
      }
      if (v < lo || v > hi) {
        std::ostringstream os;
        os << "must be between " << lo << " and " << hi << ", got " << s;
        error(n, path, os.str());
        return;
      }
      out = v;
    };
  }

  Handler bytes_of(int64_t& out, int64_t lo) {
    return [this, &out, lo](const YAML::Node& n, const std::string& path) {
      if (!scalar(n, path, "a size such as 2GiB")) return;
      try {
        int64_t v = parse_byte_size(n.Scalar());
        if (v < lo) {
          error(n, path, "must be at least " + std::to_string(lo) + " bytes, got " + n.Scalar());
          return;
        }
        out = v;
      } catch (const std::invalid_argument& e) {
        error(n, path, e.what());
      }
    };
  }

  void parse_policies(const YAML::Node& node, const std::string& path, std::map<std::string, PolicySpec>& out) {
    if (node.IsNull()) return;
    if (!node.IsMap()) {
      error(node, path, "expected a mapping of policy name to parameters, got " + describe(node));
      return;
    }
    std::set<std::string> seen;
    for (const auto& kv : node) {
      if (!kv.first.IsScalar()) {
        error(kv.first, path, "policy names must be plain strings");
        continue;
      }
      const std::string name = kv.first.Scalar();
      const std::string full = path + "." + name;
      if (!seen.insert(name).second) {
        error(kv.first, full, "duplicate policy name");
        continue;
      }
      if (!valid_policy_name(name)) {
        error(kv.first, full, "policy names use letters, digits, '_', '-' and '.' (at most 64)");
        continue;
      }
      PolicySpec spec;
      spec.name = name;
      spec.method = name;
      spec.line = kv.first.Mark().line + 1;
      YAML::Mark method_mark = kv.first.Mark();
      const YAML::Node& params = kv.second;
      if (params.IsMap()) {
        std::set<std::string> seen_params;
        for (const auto& p : params) {
          if (!p.first.IsScalar()) {
            error(p.first, full, "parameter names must be plain strings");
            continue;
          }
          const std::string pname = p.first.Scalar();
          const std::string pfull = full + "." + pname;
          if (!seen_params.insert(pname).second) {
            error(p.first, pfull, "duplicate parameter");
            continue;
          }
          if (pname == "method") {
            if (!p.second.IsScalar()) {
              error(p.second, pfull, "expected a policy method name, got " + describe(p.second));
              continue;
            }
            spec.method = p.second.Scalar();
            method_mark = p.second.Mark();
            continue;
          }
          if (p.second.IsScalar()) {
            spec.params[pname] = p.second.Scalar();
          } else if (p.second.IsSequence()) {
            // A list of scalars (e.g. layers to skip) travels as comma-separated text.
            std::string joined;
            bool ok = true;
            for (const auto& item : p.second) {
              if (!item.IsScalar()) {
                error(item, pfull, "list items must be scalars, got " + describe(item));
                ok = false;
                break;
              }
              joined += (joined.empty() ? "" : ",") + item.Scalar();
            }
            if (ok) spec.params[pname] = joined;
          } else {
            error(p.second.IsNull() ? p.first : p.second, pfull,
                  "expected a scalar or a list of scalars, got " + describe(p.second));
          }
        }
      } else if (!params.IsNull()) {
        error(params, full, "expected a mapping of parameters, got " + describe(params));
        continue;
      }
      // The policies library has the last word on methods and parameters.
      const auto& methods = kvserve::policy_names();
      if (std::find(methods.begin(), methods.end(), spec.method) == methods.end()) {
        std::string list;
        for (const auto& m : methods) list += (list.empty() ? "" : ", ") + m;
        error(method_mark, full + ".method",
              "unknown policy method '" + spec.method + "' (set `method:` to one of: " + list + ")");
        continue;
      }
      try {
        kvserve::make_policy_config(spec.method, spec.params);
      } catch (const std::exception& e) {
        error(kv.first.Mark(), full, e.what());
        continue;
      }
      out[name] = std::move(spec);
    }
  }

  std::vector<ConfigIssue>& issues() { return issues_; }

 private:
  std::string file_;
  std::vector<ConfigIssue> issues_;
  YAML::Mark key_mark_;
};

}  // namespace

std::vector<ConfigIssue> validate(const ServerConfig& c) {
  std::vector<ConfigIssue> out;
  auto add = [&](const std::string& key, const std::string& msg) {
    ConfigIssue i;
    i.file = c.source;
    i.key = key;
    i.message = msg;
    out.push_back(std::move(i));
  };
  if (c.model.path.empty()) add("model.path", "must not be empty");
  try {
    validate_device(c.model.device);
  } catch (const std::invalid_argument& e) {
    add("model.device", e.what());
  }
  if (!kDtypes.count(c.model.dtype)) add("model.dtype", "must be one of float32, bfloat16, float16, auto; got '" + c.model.dtype + "'");
  if (!kQuantizations.count(c.model.quantization)) {
    add("model.quantization", "must be one of none, int8, int4, fp8 or a ggml type (q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k); got '" + c.model.quantization + "'");
  } else if (c.model.quantization != "none" && c.model.quantization != "fp8" && c.model.quantization != "int4" &&
             c.model.device.rfind("cuda", 0) == 0) {
    add("model.quantization", "'" + c.model.quantization + "' on " + c.model.device +
                                  ": ggml block types run on the CPU only (on CUDA use fp8 or int4)");
  }
  if (!kCpuGemms.count(c.model.cpu_gemm)) add("model.cpu_gemm", "must be one of mkl, onednn; got '" + c.model.cpu_gemm + "'");
  if (c.server.host.empty()) add("server.host", "must not be empty");
  if (c.server.port < 0 || c.server.port > 65535) add("server.port", "must be between 0 and 65535");
  if (c.cache.block_size <= 0) add("cache.block_size", "must be positive");
  if (const std::string why = check_kv_cache_dtype(c.cache.kv_cache_dtype); !why.empty()) {
    add("cache.kv_cache_dtype", why);
  } else if (c.model.device.rfind("cuda", 0) == 0 && c.cache.kv_cache_dtype != "auto" && kDtypes.count(c.model.dtype) &&
             !kQuantKvDtypes.count(c.cache.kv_cache_dtype) &&
             canonical_dtype(c.cache.kv_cache_dtype) != canonical_dtype(c.model.dtype == "auto" ? "bfloat16" : c.model.dtype)) {
    add("cache.kv_cache_dtype", "'" + c.cache.kv_cache_dtype + "' differs from the compute dtype on " + c.model.device +
                                    ": CUDA pools take only model.dtype (use auto)");
  }
  if (c.cache.prefix_cache_bytes < 0) add("cache.prefix_cache_bytes", "must not be negative");
  if (c.cache.prefix_cache_bytes > 0 && !c.cache.enable_prefix_caching)
    add("cache.prefix_cache_bytes", "is the prefix cache's host tier: it needs cache.enable_prefix_caching: true");
  if (c.scheduler.max_num_seqs <= 0) add("scheduler.max_num_seqs", "must be positive");
  const auto& par = c.parallel;
  if (par.node_rank >= par.nnodes)
    add("parallel.node_rank", std::to_string(par.node_rank) + " is not below parallel.nnodes (" + std::to_string(par.nnodes) + ")");
  if ((par.tensor_parallel_size * par.pipeline_parallel_size) % par.nnodes != 0)
    add("parallel.nnodes", "tensor_parallel_size x pipeline_parallel_size (" +
                               std::to_string(par.tensor_parallel_size * par.pipeline_parallel_size) +
                               ") must divide evenly over " + std::to_string(par.nnodes) + " nodes");
  if (par.nnodes > 1 && par.master_port == 0) add("parallel.master_port", "must be set when parallel.nnodes > 1");
  if (!par.pipeline_layers.empty() && static_cast<int64_t>(par.pipeline_layers.size()) != par.pipeline_parallel_size)
    add("parallel.pipeline_layers", "lists " + std::to_string(par.pipeline_layers.size()) + " stages, but pipeline_parallel_size is " +
                                        std::to_string(par.pipeline_parallel_size));
  if (c.policies.empty()) add("policies", "no policy defined");
  if (!c.policies.count(c.default_policy)) {
    std::string names;
    for (const auto& [n, p] : c.policies) names += (names.empty() ? "" : ", ") + n;
    add("default_policy", "'" + c.default_policy + "' is not a defined policy (defined: " + names + ")");
  }
  return out;
}

ServerConfig default_server_config() {
  ServerConfig c;
  c.source = "<defaults>";
  PolicySpec full;
  full.name = "full";
  full.method = "full";
  c.policies["full"] = full;
  return c;
}

std::map<std::string, std::map<std::string, std::string>> engine_policies(const ServerConfig& config) {
  std::map<std::string, std::map<std::string, std::string>> out;
  for (const auto& [name, spec] : config.policies) {
    auto params = spec.params;
    params["name"] = spec.method;
    out[name] = std::move(params);
  }
  return out;
}

ServerConfig parse_server_config(const std::string& yaml_text, const std::string& source) {
  ServerConfig c = default_server_config();
  c.source = source;
  Parser p(source);
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    p.error(e.mark, "", "YAML syntax error: " + e.msg);
    throw ConfigError(p.issues());
  }
  if (!root.IsMap() && !root.IsNull()) {
    p.error(root, "", "the config must be a mapping of sections, got " + describe(root));
    throw ConfigError(p.issues());
  }

  std::map<std::string, PolicySpec> policies;
  bool have_policies = false;
  int default_policy_line = 0;
  using H = Parser::Handler;
  p.parse_map(root, "",
              {
                  {"model", H([&](const YAML::Node& n, const std::string& path) {
                     auto& m = c.model;
                     p.parse_map(n, path,
                                 {{"path", p.string_of(m.path)},
                                  {"tokenizer", p.string_of(m.tokenizer)},
                                  {"quantization", p.string_of(m.quantization,
                                                               [](const std::string& s) {
                                                                 return kQuantizations.count(s) ? std::string()
                                                                                                : "must be one of none, int8, int4, fp8 or a ggml type (q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k); got '" + s + "'";
                                                               })},
                                  {"served_model_name", p.string_of(m.served_model_name)},
                                  {"device", p.string_of(m.device,
                                                         [](const std::string& s) {
                                                           try {
                                                             validate_device(s);
                                                             return std::string();
                                                           } catch (const std::invalid_argument& e) {
                                                             return std::string(e.what());
                                                           }
                                                         })},
                                  {"dtype", p.string_of(m.dtype,
                                                        [](const std::string& s) {
                                                          return kDtypes.count(s) ? std::string()
                                                                                  : "must be one of float32, bfloat16, float16, auto; got '" + s + "'";
                                                        })},
                                  {"max_model_len", p.int_of(m.max_model_len, 0, int64_t{1} << 40)},
                                  {"cpu_gemm", p.string_of(m.cpu_gemm,
                                                           [](const std::string& s) {
                                                             return kCpuGemms.count(s) ? std::string()
                                                                                       : "must be one of mkl, onednn; got '" + s + "'";
                                                           })},
                                  {"enforce_eager", p.bool_of(m.enforce_eager)},
                                  {"warmup_tokens", p.int_of(m.warmup_tokens, -1, int64_t{1} << 40)},
                                  {"tool_call_parser", p.string_of(m.tool_call_parser,
                                                                   [](const std::string& s) {
                                                                     return kToolParsers.count(s) ? std::string()
                                                                                                  : "must be one of auto, hermes, llama3_json, mistral; got '" + s + "'";
                                                                   })}});
                   })},
                  {"server", H([&](const YAML::Node& n, const std::string& path) {
                     auto& s = c.server;
                     p.parse_map(n, path,
                                 {{"host", p.string_of(s.host,
                                                       [](const std::string& v) {
                                                         return v.empty() ? std::string("must not be empty") : std::string();
                                                       })},
                                  {"port", p.int_of(s.port, 0, 65535)},
                                  {"api_key", p.string_of(s.api_key)},
                                  {"api_key_env", p.string_of(s.api_key_env)},
                                  {"api_keys", [&](const YAML::Node& v, const std::string& vp) {
                                     if (v.IsNull()) return;
                                     if (!v.IsMap()) {
                                       p.error(v, vp, "expected a mapping of key name to key, got " + describe(v));
                                       return;
                                     }
                                     for (const auto& kv : v) {
                                       if (!kv.first.IsScalar() || !kv.second.IsScalar() || kv.second.Scalar().empty()) {
                                         p.error(kv.first, vp, "expected <name>: <non-empty key>");
                                         continue;
                                       }
                                       s.api_keys[kv.first.Scalar()] = kv.second.Scalar();
                                     }
                                   }},
                                  {"max_body_bytes", p.bytes_of(s.max_body_bytes, 64)},
                                  {"request_timeout_s", p.number_of(s.request_timeout_s, 0.001, 1e7)},
                                  {"idle_timeout_s", p.number_of(s.idle_timeout_s, 0.001, 1e7)},
                                  {"header_timeout_s", p.number_of(s.header_timeout_s, 0.001, 1e7)},
                                  {"write_timeout_s", p.number_of(s.write_timeout_s, 0.001, 1e7)},
                                  {"max_concurrent_connections", p.int_of(s.max_concurrent_connections, 1, 1000000)},
                                  {"retry_after_s", p.int_of(s.retry_after_s, 0, 86400)},
                                  {"threads", p.int_of(s.threads, 1, 256)},
                                  {"drain_timeout_s", p.number_of(s.drain_timeout_s, 0.0, 1e7)},
                                  {"strict_fields", p.bool_of(s.strict_fields)},
                                  {"protect_last_tokens", p.int_of(s.protect_last_tokens, 0, int64_t{1} << 30)},
                                  {"allowed_origins", [&](const YAML::Node& v, const std::string& vp) {
                                     if (v.IsNull()) return;
                                     if (!v.IsSequence()) {
                                       p.error(v, vp, "expected a list of origins (e.g. [\"https://app.example.com\"] or [\"*\"]), got " + describe(v));
                                       return;
                                     }
                                     s.allowed_origins.clear();
                                     for (const auto& item : v) {
                                       if (!item.IsScalar() || item.Scalar().empty()) {
                                         p.error(item, vp, "expected an origin such as https://app.example.com or *");
                                         continue;
                                       }
                                       s.allowed_origins.push_back(item.Scalar());
                                     }
                                   }}});
                   })},
                  {"cache", H([&](const YAML::Node& n, const std::string& path) {
                     p.parse_map(n, path,
                                 {{"block_size", p.int_of(c.cache.block_size, 1, 4096)},
                                  {"kv_cache_bytes", p.bytes_of(c.cache.kv_cache_bytes, 1)},
                                  {"kv_cache_dtype", p.string_of(c.cache.kv_cache_dtype, check_kv_cache_dtype)},
                                  {"enable_prefix_caching", p.bool_of(c.cache.enable_prefix_caching)},
                                  {"enable_context_caching", p.bool_of(c.cache.enable_context_caching)},
                                  {"prefix_cache_bytes", p.bytes_of(c.cache.prefix_cache_bytes, 0)},
                                  {"kv_layout", p.string_of(c.cache.kv_layout, [](const std::string& s) {
                                     return s == "auto" || s == "layer" || s == "head"
                                                ? std::string()
                                                : "must be one of auto, layer, head; got '" + s + "'";
                                   })}});
                   })},
                  {"scheduler", H([&](const YAML::Node& n, const std::string& path) {
                     auto& s = c.scheduler;
                     p.parse_map(n, path,
                                 {{"max_num_seqs", p.int_of(s.max_num_seqs, 1, 1 << 20)},
                                  {"max_num_batched_tokens", p.int_of(s.max_num_batched_tokens, 1, int64_t{1} << 40)},
                                  {"enable_chunked_prefill", p.bool_of(s.enable_chunked_prefill)},
                                  {"long_prefill_token_threshold", p.int_of(s.long_prefill_token_threshold, -1, int64_t{1} << 40)},
                                  {"max_waiting", p.int_of(s.max_waiting, 0, int64_t{1} << 30)},
                                  {"max_queue_time_s", p.number_of(s.max_queue_time_s, 0.0, 1e7)}});
                   })},
                  {"speculative_config", H([&](const YAML::Node& n, const std::string& path) {
                     auto& s = c.speculative;
                     p.parse_map(n, path,
                                 {{"method", p.string_of(s.method,
                                                         [](const std::string& v) {
                                                           return v == "none" || v == "ngram" || v == "self" || v == "draft_model"
                                                                      ? std::string()
                                                                      : "must be one of none, ngram, self, draft_model; got '" + v + "'";
                                                         })},
                                  {"num_speculative_tokens", p.int_of(s.num_speculative_tokens, 0, 64)},
                                  {"prompt_lookup_min", p.int_of(s.prompt_lookup_min, 1, 64)},
                                  {"prompt_lookup_max", p.int_of(s.prompt_lookup_max, 1, 64)},
                                  {"disable_by_batch_size", p.int_of(s.disable_by_batch_size, 0, 1 << 20)},
                                  {"auto_disable", p.bool_of(s.auto_disable)},
                                  {"draft_sink_tokens", p.int_of(s.draft_sink_tokens, 0, int64_t{1} << 30)},
                                  {"draft_window_tokens", p.int_of(s.draft_window_tokens, 1, int64_t{1} << 30)},
                                  {"draft_min_context_tokens", p.int_of(s.draft_min_context_tokens, 0, int64_t{1} << 30)},
                                  {"draft_policy", p.string_of(s.draft_policy)},
                                  {"draft_budget", p.int_of(s.draft_budget, 1, int64_t{1} << 30)},
                                  {"draft_refresh_tokens", p.int_of(s.draft_refresh_tokens, 0, int64_t{1} << 30)},
                                  {"draft_sampling", p.string_of(s.draft_sampling,
                                                                 [](const std::string& v) {
                                                                   return v == "greedy" || v == "sample"
                                                                              ? std::string()
                                                                              : "must be greedy or sample; got '" + v + "'";
                                                                 })},
                                  {"model", p.string_of(s.model)},
                                  {"quantization", p.string_of(s.quantization)}});
                   })},
                  {"parallel", H([&](const YAML::Node& n, const std::string& path) {
                     auto& s = c.parallel;
                     p.parse_map(n, path,
                                 {{"tensor_parallel_size", p.int_of(s.tensor_parallel_size, 1, 4096)},
                                  {"pipeline_parallel_size", p.int_of(s.pipeline_parallel_size, 1, 4096)},
                                  {"pipeline_layers", [&](const YAML::Node& v, const std::string& vp) {
                                     if (v.IsNull()) return;
                                     if (!v.IsSequence()) {
                                       p.error(v, vp, "expected a list of layer counts per stage, got " + describe(v));
                                       return;
                                     }
                                     s.pipeline_layers.clear();
                                     for (const auto& item : v) {
                                       int64_t layers = 0;
                                       p.int_of(layers, 1, int64_t{1} << 20)(item, vp);
                                       s.pipeline_layers.push_back(layers);
                                     }
                                   }},
                                  {"micro_batches", p.int_of(s.micro_batches, 0, 4000)},
                                  {"nnodes", p.int_of(s.nnodes, 1, 4096)},
                                  {"node_rank", p.int_of(s.node_rank, 0, 4095)},
                                  {"master_addr", p.string_of(s.master_addr,
                                                              [](const std::string& v) {
                                                                return v.empty() ? std::string("must not be empty") : std::string();
                                                              })},
                                  {"master_port", p.int_of(s.master_port, 0, 65535)},
                                  {"timeout_s", p.number_of(s.timeout_s, 0.1, 1e6)}});
                   })},
                  {"policies", H([&](const YAML::Node& n, const std::string& path) {
                     have_policies = true;
                     p.parse_policies(n, path, policies);
                   })},
                  {"default_policy", H([&](const YAML::Node& n, const std::string& path) {
                     default_policy_line = n.Mark().line + 1;
                     p.string_of(c.default_policy)(n, path);
                   })},
                  {"rollout", H([&](const YAML::Node& n, const std::string& path) {
                     parse_rollout_section(n, path, source, c.rollout, p.issues());
                   })},
              });

  if (have_policies) {
    // An explicit policies section replaces the implicit `full`, but `full` is always available.
    if (!policies.count("full")) {
      PolicySpec full;
      full.name = "full";
      full.method = "full";
      policies["full"] = full;
    }
    c.policies = std::move(policies);
  }
  if (p.issues().empty()) {
    for (auto issue : validate(c)) {
      if (issue.key == "default_policy") issue.line = default_policy_line;
      p.issues().push_back(std::move(issue));
    }
    std::set<std::string> names;
    for (const auto& [n, spec] : c.policies) names.insert(n);
    for (auto& issue : validate_rollout(c.rollout, names, source)) p.issues().push_back(std::move(issue));
  }
  if (!p.issues().empty()) throw ConfigError(p.issues());
  return c;
}

ServerConfig load_server_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    ConfigIssue issue;
    issue.file = path;
    issue.message = "cannot read the config file";
    throw ConfigError({issue});
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_server_config(ss.str(), path);
}

}  // namespace kvserve::config
