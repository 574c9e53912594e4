// The `rollout:` section: parsing (every problem with file, line, key) and the pure decide().
#include "configs/rollout.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>

#include "configs/server_config.h"

namespace kvserve::config {

namespace {

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
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

class R {
 public:
  R(std::string file, std::vector<ConfigIssue>& issues) : file_(std::move(file)), issues_(issues) {}

  void error(const YAML::Mark& mark, const std::string& key, const std::string& message) {
    ConfigIssue i;
    i.file = file_;
    i.line = mark.line >= 0 ? mark.line + 1 : 0;
    i.column = mark.column >= 0 ? mark.column + 1 : 0;
    i.key = key;
    i.message = message;
    issues_.push_back(std::move(i));
  }
  void error(const YAML::Node& n, const YAML::Mark& key_mark, const std::string& key, const std::string& message) {
    error(n.IsNull() ? key_mark : n.Mark(), key, message);
  }

  using H = std::function<void(const YAML::Node& value, const std::string& path, const YAML::Mark& key_mark)>;

  // Every key must be known; duplicates are errors. Returns false if `node` is not a mapping.
  bool map(const YAML::Node& node, const YAML::Mark& mark, const std::string& path,
           const std::vector<std::pair<std::string, H>>& handlers) {
    if (!node.IsMap()) {
      error(node, mark, path, "expected a mapping, got " + describe(node));
      return false;
    }
    std::set<std::string> seen;
    for (const auto& kv : node) {
      if (!kv.first.IsScalar()) {
        error(kv.first.Mark(), path, "keys must be plain strings");
        continue;
      }
      const std::string name = kv.first.Scalar();
      const std::string full = path + "." + name;
      if (!seen.insert(name).second) {
        error(kv.first.Mark(), full, "duplicate key");
        continue;
      }
      const H* h = nullptr;
      for (const auto& [hn, hh] : handlers)
        if (hn == name) h = &hh;
      if (!h) {
        std::string valid;
        for (const auto& [hn, hh] : handlers) valid += (valid.empty() ? "" : ", ") + hn;
        error(kv.first.Mark(), full, "unknown key; valid keys in '" + path + "': " + valid);
        continue;
      }
      (*h)(kv.second, full, kv.first.Mark());
    }
    return true;
  }

  bool str(const YAML::Node& n, const YAML::Mark& km, const std::string& path, std::string& out) {
    if (!n.IsScalar() || n.Scalar().empty()) {
      error(n, km, path, "expected a non-empty string, got " + describe(n));
      return false;
    }
    out = n.Scalar();
    return true;
  }
  // A scalar or a list of scalars.
  bool strs(const YAML::Node& n, const YAML::Mark& km, const std::string& path, std::vector<std::string>& out,
            std::vector<int>* lines = nullptr) {
    if (n.IsScalar()) {
      out.push_back(n.Scalar());
      if (lines) lines->push_back(n.Mark().line + 1);
      return true;
    }
    if (!n.IsSequence()) {
      error(n, km, path, "expected a string or a list of strings, got " + describe(n));
      return false;
    }
    for (const auto& item : n) {
      if (!item.IsScalar()) {
        error(item.Mark(), path, "list items must be strings, got " + describe(item));
        return false;
      }
      out.push_back(item.Scalar());
      if (lines) lines->push_back(item.Mark().line + 1);
    }
    return true;
  }
  bool integer(const YAML::Node& n, const YAML::Mark& km, const std::string& path, int64_t& out) {
    if (n.IsScalar()) {
      const std::string& s = n.Scalar();
      char* end = nullptr;
      errno = 0;
      long long v = std::strtoll(s.c_str(), &end, 10);
      if (!s.empty() && *end == '\0' && errno != ERANGE && (std::isdigit(static_cast<unsigned char>(s[0])))) {
        out = v;
        return true;
      }
    }
    error(n, km, path, "expected a non-negative integer, got " + describe(n));
    return false;
  }
  bool number(const YAML::Node& n, const YAML::Mark& km, const std::string& path, double& out) {
    if (n.IsScalar()) {
      const std::string& s = n.Scalar();
      char* end = nullptr;
      double v = std::strtod(s.c_str(), &end);
      if (!s.empty() && *end == '\0' && std::isfinite(v)) {
        out = v;
        return true;
      }
    }
    error(n, km, path, "expected a number, got " + describe(n));
    return false;
  }

 private:
  std::string file_;
  std::vector<ConfigIssue>& issues_;
};

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

bool any_of(const std::vector<std::string>& list, const std::string& v) {
  return std::find(list.begin(), list.end(), v) != list.end();
}

bool matches(const RolloutMatch& m, const RequestFacts& f) {
  if (!m.models.empty() && !any_of(m.models, f.model)) return false;
  for (const auto& [name, values] : m.headers) {
    auto it = f.headers.find(name);
    if (it == f.headers.end() || !any_of(values, it->second)) return false;
  }
  if (!m.api_keys.empty() && !any_of(m.api_keys, f.api_key_name)) return false;
  if (m.min_prompt_tokens || m.max_prompt_tokens) {
    if (f.prompt_tokens < 0) return false;
    if (m.min_prompt_tokens && f.prompt_tokens < *m.min_prompt_tokens) return false;
    if (m.max_prompt_tokens && f.prompt_tokens > *m.max_prompt_tokens) return false;
  }
  if (!m.endpoints.empty() && !any_of(m.endpoints, f.endpoint)) return false;
  return true;
}

}  // namespace

uint32_t canary_bucket(const std::string& rule_name, const std::string& key) {
  uint64_t h = fnv1a(key, fnv1a(std::string(1, '\0'), fnv1a(rule_name)));
  // splitmix64 finalizer: FNV's low bits are weak for short keys.
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return static_cast<uint32_t>(h % 10000u);
}

RolloutDecision decide(const RolloutConfig& c, const RequestFacts& f, const std::string& fallback_default) {
  RolloutDecision d;
  if (!f.requested_policy.empty()) {
    if (!c.present || any_of(c.allow_override, f.requested_policy)) {
      d.policy = f.requested_policy;
      d.rule = "override";
      d.arm = "override";
    } else {
      d.override_rejected = true;
      d.rule = "override";
      d.arm = "override";
    }
    return d;
  }
  const std::string def = c.default_policy.empty() ? fallback_default : c.default_policy;
  for (const auto& rule : c.rules) {
    if (!matches(rule.match, f)) continue;
    d.rule = rule.name;
    d.policy = rule.policy.empty() ? def : rule.policy;
    d.arm = "base";
    d.max_draft_tokens = rule.max_draft_tokens;
    if (rule.canary) {
      std::string key;
      const auto& by = rule.canary->sticky_by;
      if (by == "user") key = f.user;
      else if (by.rfind("header:", 0) == 0) {
        auto it = f.headers.find(lower(by.substr(7)));
        if (it != f.headers.end()) key = it->second;
      }
      if (key.empty()) key = "request:" + f.request_id;
      if (canary_bucket(rule.name, key) < static_cast<uint32_t>(std::llround(rule.canary->percent * 100.0))) {
        d.policy = rule.canary->policy;
        d.arm = "canary";
      }
    }
    return d;
  }
  d.policy = def;
  d.rule = "default";
  d.arm = "default";
  return d;
}

void parse_rollout_section(const YAML::Node& node, const std::string& path, const std::string& file,
                           RolloutConfig& out, std::vector<ConfigIssue>& issues) {
  R r(file, issues);
  out.present = true;
  if (node.IsNull()) return;
  std::set<std::string> names;
  r.map(node, node.Mark(), path,
        {
            {"default", [&](const YAML::Node& n, const std::string& p, const YAML::Mark& km) {
               out.default_line = (n.IsNull() ? km : n.Mark()).line + 1;
               r.str(n, km, p, out.default_policy);
             }},
            {"allow_override", [&](const YAML::Node& n, const std::string& p, const YAML::Mark& km) {
               if (n.IsNull()) return;  // `allow_override:` = none
               r.strs(n, km, p, out.allow_override, &out.allow_override_lines);
             }},
            {"rules", [&](const YAML::Node& n, const std::string& p, const YAML::Mark& km) {
               if (n.IsNull()) return;
               if (!n.IsSequence()) {
                 r.error(n, km, p, "expected a list of rules, got " + describe(n));
                 return;
               }
               size_t index = 0;
               for (const auto& rn : n) {
                 const std::string rp = p + "[" + std::to_string(index++) + "]";
                 RolloutRule rule;
                 rule.line = rn.Mark().line + 1;
                 bool has_policy = false;
                 bool ok = r.map(rn, rn.Mark(), rp,
                     {
                         {"name", [&](const YAML::Node& v, const std::string& vp, const YAML::Mark& vk) {
                            if (!r.str(v, vk, vp, rule.name)) return;
                            if (!names.insert(rule.name).second) r.error(v.Mark(), vp, "duplicate rule name '" + rule.name + "'");
                            if (rule.name == "default" || rule.name == "override")
                              r.error(v.Mark(), vp, "'" + rule.name + "' is reserved");
                          }},
                         {"policy", [&](const YAML::Node& v, const std::string& vp, const YAML::Mark& vk) {
                            has_policy = true;
                            rule.policy_line = (v.IsNull() ? vk : v.Mark()).line + 1;
                            r.str(v, vk, vp, rule.policy);
                          }},
                         {"match", [&](const YAML::Node& v, const std::string& vp, const YAML::Mark& vk) {
                            auto& m = rule.match;
                            r.map(v, vk, vp,
                                  {
                                      {"model", [&](const YAML::Node& x, const std::string& xp, const YAML::Mark& xk) { r.strs(x, xk, xp, m.models); }},
                                      {"api_key", [&](const YAML::Node& x, const std::string& xp, const YAML::Mark& xk) { r.strs(x, xk, xp, m.api_keys); }},
                                      {"endpoint", [&](const YAML::Node& x, const std::string& xp, const YAML::Mark& xk) {
                                         std::vector<std::string> eps;
                                         if (!r.strs(x, xk, xp, eps)) return;
                                         for (const auto& e : eps) {
                                           if (e != "completions" && e != "chat") {
                                             r.error(x.Mark(), xp, "endpoint must be completions or chat, got '" + e + "'");
                                             return;
                                           }
                                         }
                                         m.endpoints = eps;
                                       }},
                                      {"headers", [&](const YAML::Node& x, const std::string& xp, const YAML::Mark& xk) {
                                         if (!x.IsMap()) {
                                           r.error(x, xk, xp, "expected a mapping of header name to value(s), got " + describe(x));
                                           return;
                                         }
                                         for (const auto& h : x) {
                                           if (!h.first.IsScalar()) {
                                             r.error(h.first.Mark(), xp, "header names must be strings");
                                             continue;
                                           }
                                           std::vector<std::string> vals;
                                           if (r.strs(h.second, h.first.Mark(), xp + "." + h.first.Scalar(), vals))
                                             m.headers[lower(h.first.Scalar())] = vals;
                                         }
                                       }},
                                      {"prompt_tokens", [&](const YAML::Node& x, const std::string& xp, const YAML::Mark& xk) {
                                         r.map(x, xk, xp,
                                               {{"min", [&](const YAML::Node& y, const std::string& yp, const YAML::Mark& yk) {
                                                   int64_t v = 0;
                                                   if (r.integer(y, yk, yp, v)) m.min_prompt_tokens = v;
                                                 }},
                                                {"max", [&](const YAML::Node& y, const std::string& yp, const YAML::Mark& yk) {
                                                   int64_t v = 0;
                                                   if (r.integer(y, yk, yp, v)) m.max_prompt_tokens = v;
                                                 }}});
                                         if (m.min_prompt_tokens && m.max_prompt_tokens && *m.min_prompt_tokens > *m.max_prompt_tokens)
                                           r.error(x.Mark(), xp, "min is greater than max");
                                       }},
                                  });
                          }},
                         {"canary", [&](const YAML::Node& v, const std::string& vp, const YAML::Mark& vk) {
                            RolloutCanary c;
                            c.line = (v.IsNull() ? vk : v.Mark()).line + 1;
                            bool has_percent = false, has_cpolicy = false;
                            if (!r.map(v, vk, vp,
                                       {{"policy", [&](const YAML::Node& x, const std::string& xp, const YAML::Mark& xk) {
                                           has_cpolicy = true;
                                           c.line = (x.IsNull() ? xk : x.Mark()).line + 1;
                                           r.str(x, xk, xp, c.policy);
                                         }},
                                        {"percent", [&](const YAML::Node& x, const std::string& xp, const YAML::Mark& xk) {
                                           has_percent = true;
                                           double pct = 0;
                                           if (!r.number(x, xk, xp, pct)) return;
                                           if (pct < 0 || pct > 100) {
                                             r.error(x.Mark(), xp, "must be between 0 and 100, got " + x.Scalar());
                                             return;
                                           }
                                           c.percent = pct;
                                         }},
                                        {"sticky_by", [&](const YAML::Node& x, const std::string& xp, const YAML::Mark& xk) {
                                           std::string s;
                                           if (!r.str(x, xk, xp, s)) return;
                                           if (s != "user" && !(s.rfind("header:", 0) == 0 && s.size() > 7)) {
                                             r.error(x.Mark(), xp, "must be 'user' or 'header:<name>', got '" + s + "'");
                                             return;
                                           }
                                           c.sticky_by = s;
                                         }}}))
                              return;
                            if (!has_cpolicy) r.error(v.Mark(), vp + ".policy", "a canary needs a policy");
                            if (!has_percent) r.error(v.Mark(), vp + ".percent", "a canary needs a percent");
                            rule.canary = c;
                          }},
                         {"speculative", [&](const YAML::Node& v, const std::string& vp, const YAML::Mark& vk) {
                            if (v.IsScalar() && (v.Scalar() == "false" || v.Scalar() == "true")) {
                              if (v.Scalar() == "false") rule.max_draft_tokens = 0;
                              return;
                            }
                            if (!v.IsMap()) {
                              r.error(v, vk, vp, "expected true, false or {num_speculative_tokens: N}, got " + describe(v));
                              return;
                            }
                            r.map(v, vk, vp,
                                  {{"num_speculative_tokens", [&](const YAML::Node& x, const std::string& xp, const YAML::Mark& xk) {
                                      int64_t k = 0;
                                      if (r.integer(x, xk, xp, k)) rule.max_draft_tokens = k;
                                    }}});
                          }},
                     });
                 if (!ok) continue;
                 if (rule.name.empty()) r.error(rn.Mark(), rp + ".name", "every rule needs a name");
                 if (!has_policy && !rule.canary) r.error(rn.Mark(), rp, "a rule needs a policy or a canary");
                 out.rules.push_back(std::move(rule));
               }
             }},
        });
}

std::vector<ConfigIssue> validate_rollout(const RolloutConfig& c, const std::set<std::string>& policies,
                                          const std::string& file) {
  std::vector<ConfigIssue> out;
  std::string names;
  for (const auto& n : policies) names += (names.empty() ? "" : ", ") + n;
  auto check = [&](const std::string& policy, int line, const std::string& key) {
    if (policy.empty() || policies.count(policy)) return;
    ConfigIssue i;
    i.file = file;
    i.line = line;
    i.key = key;
    i.message = "unknown policy '" + policy + "' (defined: " + names + ")";
    out.push_back(std::move(i));
  };
  check(c.default_policy, c.default_line, "rollout.default");
  for (size_t i = 0; i < c.allow_override.size(); ++i)
    check(c.allow_override[i], i < c.allow_override_lines.size() ? c.allow_override_lines[i] : 0, "rollout.allow_override");
  for (size_t i = 0; i < c.rules.size(); ++i) {
    const auto& r = c.rules[i];
    const std::string p = "rollout.rules[" + std::to_string(i) + "]";
    check(r.policy, r.policy_line, p + ".policy");
    if (r.canary) check(r.canary->policy, r.canary->line, p + ".canary.policy");
  }
  return out;
}

}  // namespace kvserve::config
