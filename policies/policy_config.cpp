#include "policies/policy_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>

#include "common/check.h"

namespace kvserve {

bool PolicyConfig::skips_layer(int64_t layer) const {
  return std::find(skip_layers.begin(), skip_layers.end(), layer) != skip_layers.end() || is_local_layer(layer);
}

bool PolicyConfig::is_local_layer(int64_t layer) const {
  return std::binary_search(local_layers.begin(), local_layers.end(), layer);
}

std::vector<int64_t> PolicyConfig::global_layers(int64_t num_layers) const {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < num_layers; ++l)
    if (!is_local_layer(l)) out.push_back(l);
  return out;
}

void PolicyConfig::resolve_budget_bytes(int64_t token_layer_bytes, int64_t num_layers, const std::string& kv_dtype) {
  if (is_full() || budget_bytes <= 0) return;
  KV_CHECK(token_layer_bytes > 0 && num_layers > 0, "internal: budget_bytes resolved without the model's KV geometry");
  const auto layers = static_cast<int64_t>(global_layers(num_layers).size());
  budget = budget_bytes / (token_layer_bytes * std::max<int64_t>(1, layers));
  const int64_t floor = scorer == ScorerKind::kSinkRecent ? sink : window;
  KV_CHECK(budget > floor, "policy '" << name << "': budget_bytes " << budget_bytes << " holds " << budget
                                      << " tokens per layer in a " << kv_dtype << " KV cache (" << token_layer_bytes
                                      << " bytes a token-layer, " << layers << " layers), not more than its "
                                      << (scorer == ScorerKind::kSinkRecent ? "sink " : "window ") << floor);
}

int64_t PolicyConfig::budget_tokens(int64_t prompt_len) const {
  KV_CHECK(budget_bytes <= 0 || budget > 0 || is_full(),
           "policy '" << name << "': budget_bytes is resolved against a model's KV cache; here there is none");
  if (budget_ratio > 0.0) {
    return std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(prompt_len) * budget_ratio));
  }
  return budget;
}

const std::vector<std::string>& policy_names() {
  static const std::vector<std::string> names = {"full",         "snapkv", "pyramidkv", "dynamickv",
                                                 "streamingllm", "h2o",    "knorm",     "random",
                                                 "kvzip",        "kvzap"};
  return names;
}

std::string to_string(AllocatorKind k) {
  switch (k) {
    case AllocatorKind::kFull: return "full";
    case AllocatorKind::kUniform: return "uniform";
    case AllocatorKind::kPyramid: return "pyramid";
    case AllocatorKind::kDynamic: return "dynamic";
    case AllocatorKind::kGlobal: return "global";
  }
  return "?";
}
std::string to_string(ScorerKind k) {
  switch (k) {
    case ScorerKind::kNone: return "none";
    case ScorerKind::kWindowAttention: return "window_attention";
    case ScorerKind::kAccumulatedAttention: return "accumulated_attention";
    case ScorerKind::kSinkRecent: return "sink_recent";
    case ScorerKind::kKeyNorm: return "key_norm";
    case ScorerKind::kRandom: return "random";
    case ScorerKind::kReconstruction: return "reconstruction";
    case ScorerKind::kPredicted: return "predicted";
  }
  return "?";
}
std::string to_string(PoolingKind k) { return k == PoolingKind::kMax ? "max" : "avg"; }
std::string to_string(Semantics k) { return k == Semantics::kPaper ? "paper" : "kvpress"; }
std::string to_string(DynamicVariant k) { return k == DynamicVariant::kPaper ? "paper" : "authors"; }
std::string to_string(ScoreNorm k) {
  switch (k) {
    case ScoreNorm::kNone: return "none";
    case ScoreNorm::kLayer: return "layer";
    case ScoreNorm::kHead: return "head";
    case ScoreNorm::kMax: return "max";
    case ScoreNorm::kKth: return "kth";
  }
  return "?";
}
std::string to_string(BudgetPrior k) { return k == BudgetPrior::kNone ? "none" : "pyramid"; }
std::string to_string(HeadBudgets k) { return k == HeadBudgets::kUniform ? "uniform" : "adaptive"; }

namespace {

int64_t parse_int(const std::string& key, const std::string& v) {
  int64_t out = 0;
  const char* b = v.data();
  const char* e = v.data() + v.size();
  auto [p, ec] = std::from_chars(b, e, out);
  if (ec != std::errc() || p != e || v.empty()) {
    KV_FAIL("policy parameter '" << key << "': '" << v << "' is not an integer");
  }
  return out;
}

double parse_double(const std::string& key, const std::string& v) {
  char* end = nullptr;
  double out = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(out)) {
    KV_FAIL("policy parameter '" << key << "': '" << v << "' is not a number");
  }
  return out;
}

// Bytes: an integer, or a number with K/M/G (x1000) or KiB/MiB/GiB (x1024).
int64_t parse_bytes(const std::string& key, const std::string& v) {
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = used > 0 ? v.substr(used) : "";
  static const std::map<std::string, double> kUnits = {{"", 1},       {"B", 1},       {"K", 1e3},       {"KB", 1e3},
                                                      {"M", 1e6},     {"MB", 1e6},    {"G", 1e9},       {"GB", 1e9},
                                                      {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}};
  const auto u = kUnits.find(unit);
  if (used == 0 || u == kUnits.end() || !(x > 0) || x * u->second >= 9.0e18) {
    KV_FAIL("policy parameter '" << key << "': '" << v << "' must be a positive byte size (e.g. 4194304, 4MiB, 500MB)");
  }
  return static_cast<int64_t>(x * u->second);
}

int64_t parse_nonneg(const std::string& key, const std::string& v, int64_t min_value = 0) {
  int64_t x = parse_int(key, v);
  if (x < min_value) KV_FAIL("policy parameter '" << key << "': '" << v << "' must be >= " << min_value);
  return x;
}

template <class E>
E parse_enum(const std::string& key, const std::string& v, const std::vector<std::pair<std::string, E>>& opts) {
  for (const auto& [s, e] : opts) {
    if (s == v) return e;
  }
  std::ostringstream os;
  for (size_t i = 0; i < opts.size(); ++i) os << (i ? "|" : "") << opts[i].first;
  KV_FAIL("policy parameter '" << key << "': '" << v << "' is not one of " << os.str());
}

std::vector<int64_t> parse_layer_list(const std::string& key, const std::string& v) {
  std::vector<int64_t> out;
  if (v.empty() || v == "none") return out;
  std::string item;
  std::istringstream is(v);
  while (std::getline(is, item, ',')) {
    if (item.empty()) KV_FAIL("policy parameter '" << key << "': '" << v << "' has an empty item");
    out.push_back(parse_nonneg(key, item));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

using Setter = std::function<void(PolicyConfig&, const std::string& key, const std::string& value)>;

const std::map<std::string, Setter>& setters() {
  static const std::map<std::string, Setter> s = {
      {"allocator",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.allocator = parse_enum<AllocatorKind>(k, v,
                                                 {{"full", AllocatorKind::kFull},
                                                  {"uniform", AllocatorKind::kUniform},
                                                  {"pyramid", AllocatorKind::kPyramid},
                                                  {"dynamic", AllocatorKind::kDynamic},
                                                  {"global", AllocatorKind::kGlobal}});
       }},
      {"scorer",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.scorer = parse_enum<ScorerKind>(k, v,
                                           {{"none", ScorerKind::kNone},
                                            {"window_attention", ScorerKind::kWindowAttention},
                                            {"accumulated_attention", ScorerKind::kAccumulatedAttention},
                                            {"sink_recent", ScorerKind::kSinkRecent},
                                            {"key_norm", ScorerKind::kKeyNorm},
                                            {"random", ScorerKind::kRandom},
                                            {"reconstruction", ScorerKind::kReconstruction},
                                            {"predicted", ScorerKind::kPredicted}});
       }},
      {"budget",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         // An integer is tokens per layer; a number in (0, 1) is a ratio of the prompt.
         if (v.find_first_of(".eE") != std::string::npos) {
           double r = parse_double(k, v);
           if (!(r > 0.0 && r < 1.0)) {
             KV_FAIL("policy parameter '" << k << "': '" << v
                                          << "' must be a token count >= 1 or a ratio strictly between 0 and 1");
           }
           c.budget_ratio = r;
           c.budget = 0;
         } else {
           c.budget = parse_nonneg(k, v, 1);
           c.budget_ratio = 0.0;
         }
         c.budget_bytes = 0;
       }},
      {"budget_bytes",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.budget_bytes = parse_bytes(k, v);
         c.budget = 0;
         c.budget_ratio = 0.0;
       }},
      {"kv_dtype",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         // Names are checked where the model's KV layouts are built (they depend on the device).
         KV_CHECK(!v.empty() && v.find_first_of(" \t,") == std::string::npos,
                  "policy parameter '" << k << "': '" << v << "' is not a KV cache dtype name (int8, int4, float16, ...)");
         c.kv_dtype = v == "auto" ? "" : v;
       }},
      {"kv_ladder",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         // "int8:0.3,int4": rungs in order, each but the last with the least fraction it keeps.
         c.kv_ladder.clear();
         std::stringstream in(v);
         std::string rung;
         while (std::getline(in, rung, ',')) {
           rung.erase(0, rung.find_first_not_of(" \t"));
           rung.erase(rung.find_last_not_of(" \t") + 1);
           const auto colon = rung.find(':');
           const std::string dtype = rung.substr(0, colon);
           KV_CHECK(!dtype.empty() && dtype.find_first_of(" \t") == std::string::npos,
                    "policy parameter '" << k << "': '" << rung << "' in '" << v << "' is not 'dtype:fraction' (e.g. int8:0.25)");
           double kept = 0.0;
           if (colon != std::string::npos) {
             kept = parse_double(k, rung.substr(colon + 1));
             KV_CHECK(kept > 0.0 && kept <= 1.0, "policy parameter '" << k << "': the fraction of rung '" << rung
                                                                       << "' must be in (0, 1]");
           }
           c.kv_ladder.emplace_back(dtype, kept);
         }
         KV_CHECK(!c.kv_ladder.empty(), "policy parameter '" << k << "': name at least one rung (e.g. int8:0.25,int4)");
         for (size_t i = 0; i < c.kv_ladder.size(); ++i) {
           const auto& [dtype, kept] = c.kv_ladder[i];
           const bool last = i + 1 == c.kv_ladder.size();
           KV_CHECK(last || kept > 0.0, "policy parameter '" << k << "': rung '" << dtype << "' of '" << v
                                                             << "' needs the least fraction it keeps (" << dtype
                                                             << ":0.25); only the last rung takes every prompt left");
           KV_CHECK(!last || kept == 0.0, "policy parameter '" << k << "': the last rung ('" << dtype << "') of '" << v
                                                               << "' takes every prompt the rungs before it do not: "
                                                               << "drop its fraction");
           KV_CHECK(i == 0 || last || kept < c.kv_ladder[i - 1].second,
                    "policy parameter '" << k << "': the fractions of '" << v << "' must fall rung by rung");
           for (size_t j = 0; j < i; ++j)
             KV_CHECK(c.kv_ladder[j].first != dtype, "policy parameter '" << k << "': '" << v << "' names " << dtype
                                                                          << " twice");
         }
       }},
      {"budget_ratio",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         double r = parse_double(k, v);
         if (!(r > 0.0 && r < 1.0)) {
           KV_FAIL("policy parameter '" << k << "': '" << v << "' must be strictly between 0 and 1");
         }
         c.budget_ratio = r;
         c.budget = 0;
         c.budget_bytes = 0;
       }},
      {"window", [](PolicyConfig& c, const std::string& k, const std::string& v) { c.window = parse_nonneg(k, v); }},
      {"kernel",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         int64_t x = parse_nonneg(k, v, 1);
         if (x % 2 == 0) KV_FAIL("policy parameter '" << k << "': '" << v << "' must be odd");
         c.kernel = x;
       }},
      {"pooling",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.pooling = parse_enum<PoolingKind>(k, v, {{"max", PoolingKind::kMax}, {"avg", PoolingKind::kAvg}});
       }},
      {"beta", [](PolicyConfig& c, const std::string& k, const std::string& v) { c.beta = parse_nonneg(k, v, 1); }},
      {"r_max", [](PolicyConfig& c, const std::string& k, const std::string& v) { c.r_max = parse_nonneg(k, v, 1); }},
      {"update_interval",
       [](PolicyConfig& c, const std::string& k, const std::string& v) { c.update_interval = parse_nonneg(k, v, 1); }},
      {"m", [](PolicyConfig& c, const std::string& k, const std::string& v) { c.update_interval = parse_nonneg(k, v, 1); }},
      {"variant",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.dynamic.variant =
             parse_enum<DynamicVariant>(k, v, {{"paper", DynamicVariant::kPaper}, {"authors", DynamicVariant::kAuthors}});
       }},
      {"normalize",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.dynamic.norm = parse_enum<ScoreNorm>(
             k, v, {{"none", ScoreNorm::kNone}, {"layer", ScoreNorm::kLayer}, {"head", ScoreNorm::kHead}, {"max", ScoreNorm::kMax},
                    {"kth", ScoreNorm::kKth}});
       }},
      {"norm_rank",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         double r = parse_double(k, v);
         if (!(r > 0.0 && r <= 1.0)) KV_FAIL("policy parameter '" << k << "': '" << v << "' must be in (0, 1]");
         c.dynamic.norm_rank = r;
       }},
      {"min_ratio",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         double r = parse_double(k, v);
         if (!(r >= 0.0 && r <= 1.0)) KV_FAIL("policy parameter '" << k << "': '" << v << "' must be in [0, 1]");
         c.dynamic.min_ratio = r;
       }},
      {"prior",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.dynamic.prior = parse_enum<BudgetPrior>(k, v, {{"none", BudgetPrior::kNone}, {"pyramid", BudgetPrior::kPyramid}});
       }},
      {"prior_weight",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         double r = parse_double(k, v);
         if (!(r >= 0.0 && r <= 1.0)) KV_FAIL("policy parameter '" << k << "': '" << v << "' must be in [0, 1]");
         c.dynamic.prior_weight = r;
       }},
      {"sink", [](PolicyConfig& c, const std::string& k, const std::string& v) { c.sink = parse_nonneg(k, v); }},
      {"skip_layers",
       [](PolicyConfig& c, const std::string& k, const std::string& v) { c.skip_layers = parse_layer_list(k, v); }},
      {"semantics",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.semantics = parse_enum<Semantics>(k, v, {{"paper", Semantics::kPaper}, {"kvpress", Semantics::kKvpress}});
       }},
      {"decode_budget",
       [](PolicyConfig& c, const std::string& k, const std::string& v) { c.decode_budget = parse_nonneg(k, v); }},
      {"decode_evict_chunk",
       [](PolicyConfig& c, const std::string& k, const std::string& v) { c.decode_evict_chunk = parse_nonneg(k, v, 1); }},
      {"seed",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.seed = static_cast<uint64_t>(parse_nonneg(k, v));
       }},
      {"head_budgets",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.head_budgets = parse_enum<HeadBudgets>(k, v, {{"uniform", HeadBudgets::kUniform}, {"adaptive", HeadBudgets::kAdaptive}});
       }},
      {"alpha",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.alpha = parse_double(k, v);
         KV_CHECK(c.alpha >= 0.0 && c.alpha <= 1.0, "policy parameter '" << k << "': '" << v << "' must be in [0, 1]");
       }},
      {"chunk_size",
       [](PolicyConfig& c, const std::string& k, const std::string& v) { c.chunk_size = parse_nonneg(k, v, 1); }},
      {"prefix_reuse",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.reuse_compressed = parse_enum<bool>(k, v, {{"exact", false}, {"compressed", true}});
       }},
      {"compress",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         c.compress_context = parse_enum<bool>(k, v, {{"prompt", false}, {"context", true}});
       }},
      {"predictor",
       [](PolicyConfig& c, const std::string& k, const std::string& v) {
         KV_CHECK(!v.empty(), "policy parameter '" << k << "': give the predictor's directory");
         c.predictor = v;
       }},
  };
  return s;
}

bool is_dynamic_key(const std::string& k) {
  return k == "variant" || k == "normalize" || k == "norm_rank" || k == "min_ratio" || k == "prior" || k == "prior_weight";
}

// `dynamickv`'s default: the variant that did best on the default model's quality suite
// (docs/eval/dynamickv.md). An explicit `variant=` starts from that variant exactly instead.
DynamicOptions tuned_dynamic_options() {
  DynamicOptions o;
  o.norm = ScoreNorm::kKth;
  o.norm_rank = 0.75;
  return o;
}

PolicyConfig named_defaults(const std::string& name) {
  PolicyConfig c;
  c.name = name;
  if (name == "full") {
    c.allocator = AllocatorKind::kFull;
    c.scorer = ScorerKind::kNone;
  } else if (name == "snapkv") {
    c.allocator = AllocatorKind::kUniform;
    c.scorer = ScorerKind::kWindowAttention;
    c.budget = 128;
  } else if (name == "pyramidkv") {
    c.allocator = AllocatorKind::kPyramid;
    c.scorer = ScorerKind::kWindowAttention;
    c.budget = 128;
  } else if (name == "dynamickv") {
    c.allocator = AllocatorKind::kDynamic;
    c.scorer = ScorerKind::kWindowAttention;
    c.pooling = PoolingKind::kAvg;  // the authors' Llama setting
    c.budget = 128;
    c.dynamic = tuned_dynamic_options();
  } else if (name == "streamingllm") {
    c.allocator = AllocatorKind::kUniform;
    c.scorer = ScorerKind::kSinkRecent;
    c.window = 0;  // everything after the sinks is "recent"
    c.budget = 128;
  } else if (name == "h2o") {
    c.allocator = AllocatorKind::kUniform;
    c.scorer = ScorerKind::kAccumulatedAttention;
    c.budget = 128;
  } else if (name == "knorm") {
    c.allocator = AllocatorKind::kUniform;
    c.scorer = ScorerKind::kKeyNorm;
    c.window = 0;
    c.skip_layers = {0, 1};
    c.budget_ratio = 0.5;
  } else if (name == "kvzip") {
    // KVzip: reconstruction scores, one top-k over every (layer, KV head, position), sinks kept.
    c.allocator = AllocatorKind::kGlobal;
    c.scorer = ScorerKind::kReconstruction;
    c.head_budgets = HeadBudgets::kAdaptive;
    c.window = 0;
    c.sink = 4;
    c.budget_ratio = 0.25;
    c.compress_context = true;
  } else if (name == "kvzap") {
    // KVzap: kvzip's selection on scores a per-layer model predicts from the hidden states.
    c.allocator = AllocatorKind::kGlobal;
    c.scorer = ScorerKind::kPredicted;
    c.head_budgets = HeadBudgets::kAdaptive;
    c.window = 0;
    c.sink = 4;
    c.budget_ratio = 0.25;
    c.compress_context = true;
  } else if (name == "random") {
    c.allocator = AllocatorKind::kUniform;
    c.scorer = ScorerKind::kRandom;
    c.window = 0;
    c.budget = 128;
  } else {
    std::ostringstream os;
    for (size_t i = 0; i < policy_names().size(); ++i) os << (i ? ", " : "") << policy_names()[i];
    KV_FAIL("unknown KV policy '" << name << "' (known: " << os.str() << ")");
  }
  return c;
}

}  // namespace

void validate_policy_config(const PolicyConfig& c) {
  KV_CHECK(c.kv_ladder.empty() || c.kv_dtype == "ladder",
           "policy '" << c.name << "': kv_ladder orders the rungs of kv_dtype: ladder (this policy's kv_dtype is '"
                      << (c.kv_dtype.empty() ? "auto" : c.kv_dtype) << "')");
  KV_CHECK(!(c.reuse_compressed && c.is_full()),
           "policy '" << c.name << "': prefix_reuse: compressed needs a compressing policy (full KV is reused exactly "
                      << "by the prefix cache)");
  if (c.is_full()) return;
  KV_CHECK(!c.compress_context || c.query_agnostic(),
           "policy '" << c.name << "': compress: context needs a query-agnostic scorer (reconstruction, key_norm, "
                      << "sink_recent), not " << to_string(c.scorer) << ", whose kept set depends on the question");
  KV_CHECK(!(c.compress_context && c.reuse_compressed),
           "policy '" << c.name << "': compress: context and prefix_reuse: compressed do not combine (one continues a "
                      << "compressed context, the other a compressed conversation)");
  KV_CHECK(c.budget > 0 || c.budget_ratio > 0.0 || c.budget_bytes > 0,
           "policy '" << c.name << "': needs a budget (budget=N tokens per layer, budget_ratio=r or budget_bytes=B)");
  KV_CHECK(!(c.budget > 0 && c.budget_ratio > 0.0),
           "policy '" << c.name << "': give either budget or budget_ratio, not both");
  KV_CHECK(c.kernel >= 1 && c.kernel % 2 == 1, "policy parameter 'kernel': '" << c.kernel << "' must be odd");
  KV_CHECK(c.window >= 0, "policy parameter 'window': '" << c.window << "' must be >= 0");
  if (c.budget > 0 && c.scorer != ScorerKind::kSinkRecent) {
    KV_CHECK(c.budget > c.window, "policy '" << c.name << "': budget " << c.budget << " must exceed the window "
                                             << c.window << " (the budget counts the window)");
  }
  if (c.scorer == ScorerKind::kSinkRecent && c.budget > 0) {
    KV_CHECK(c.budget > c.sink, "policy '" << c.name << "': budget " << c.budget << " must exceed sink " << c.sink);
  }
  if (c.allocator == AllocatorKind::kDynamic) {
    KV_CHECK(c.semantics == Semantics::kPaper,
             "policy '" << c.name << "': the dynamic allocator has no kvpress variant (semantics must be paper)");
    KV_CHECK(c.scorer == ScorerKind::kWindowAttention || c.scorer == ScorerKind::kKeyNorm ||
                 c.scorer == ScorerKind::kAccumulatedAttention || c.scorer == ScorerKind::kRandom ||
                 c.scorer == ScorerKind::kReconstruction || c.scorer == ScorerKind::kPredicted,
             "policy '" << c.name << "': the dynamic allocator needs a ranking scorer, not " << to_string(c.scorer));
  }
  if (c.allocator != AllocatorKind::kDynamic) {
    KV_CHECK(c.dynamic.is_paper() && c.dynamic.prior_weight == 0.5 && c.dynamic.norm_rank == 1.0,
             "policy '" << c.name
                        << "': variant, normalize, norm_rank, min_ratio, prior and prior_weight are DynamicKV parameters");
  }
  if (c.dynamic.variant == DynamicVariant::kAuthors) {
    KV_CHECK(c.scorer == ScorerKind::kWindowAttention,
             "policy '" << c.name << "': variant=authors selects per query head and needs scorer window_attention");
  }
  if (c.allocator == AllocatorKind::kDynamic) {
    KV_CHECK(c.skip_layers.empty(), "policy '" << c.name << "': the dynamic allocator budgets every layer (skip_layers must be empty)");
  }
  if (c.scorer == ScorerKind::kWindowAttention) {
    KV_CHECK(c.window >= 1, "policy parameter 'window': '" << c.window << "' must be >= 1 for window_attention");
  }
  if (c.allocator == AllocatorKind::kPyramid || c.allocator == AllocatorKind::kDynamic) {
    KV_CHECK(c.scorer != ScorerKind::kSinkRecent,
             "policy '" << c.name << "': sink_recent works with the uniform allocator only");
  }
  if (c.head_budgets == HeadBudgets::kAdaptive) {
    KV_CHECK(c.allocator != AllocatorKind::kDynamic || c.dynamic.variant == DynamicVariant::kPaper,
             "policy '" << c.name << "': head_budgets=adaptive ranks per KV head; DynamicKV's variant=authors "
                        << "ranks per query head and does not combine with it");
    KV_CHECK(c.scorer != ScorerKind::kSinkRecent && c.scorer != ScorerKind::kRandom,
             "policy '" << c.name << "': head_budgets=adaptive needs a scorer that ranks tokens, not " << to_string(c.scorer));
    KV_CHECK(c.decode_budget == 0, "policy '" << c.name << "': decode_budget (decode-time eviction) is per layer and "
                                              << "does not combine with head_budgets=adaptive yet");
    KV_CHECK(!c.reuse_compressed, "policy '" << c.name << "': prefix_reuse: compressed does not combine with "
                                             << "head_budgets=adaptive yet (a resumed turn attends to one length per layer)");
  }
  if (c.allocator == AllocatorKind::kGlobal) {
    KV_CHECK(c.scores_after_prefill(),
             "policy '" << c.name << "': the global allocator selects over every layer's scores at once and needs scorer "
                        << "reconstruction (kvzip) or predicted (kvzap), not " << to_string(c.scorer));
    KV_CHECK(c.head_budgets == HeadBudgets::kAdaptive,
             "policy '" << c.name << "': the global allocator keeps a different count per (layer, KV head): it needs "
                        << "head_budgets=adaptive");
    KV_CHECK(c.skip_layers.empty(), "policy '" << c.name << "': the global allocator budgets every layer (skip_layers must be empty)");
  }
  if (c.scores_after_prefill()) {
    const std::string scorer = to_string(c.scorer);
    KV_CHECK(c.chunk_size >= 1, "policy parameter 'chunk_size': '" << c.chunk_size << "' must be >= 1");
    KV_CHECK(c.decode_budget == 0, "policy '" << c.name << "': decode_budget (decode-time eviction) has no " << scorer
                                              << " scores to rank new tokens with");
    KV_CHECK(!c.reuse_compressed, "policy '" << c.name << "': prefix_reuse: compressed does not combine with scorer "
                                             << scorer << " yet");
    KV_CHECK(c.dynamic.variant == DynamicVariant::kPaper,
             "policy '" << c.name << "': DynamicKV's variant=authors ranks per query head; " << scorer
                        << " scores are per KV head");
  }
  KV_CHECK(c.predictor.empty() || c.scorer == ScorerKind::kPredicted,
           "policy '" << c.name << "': 'predictor' is a parameter of scorer predicted (kvzap), not " << to_string(c.scorer));
  if (c.decode_budget > 0) {
    KV_CHECK(c.scorer == ScorerKind::kKeyNorm || c.scorer == ScorerKind::kSinkRecent ||
                 c.scorer == ScorerKind::kAccumulatedAttention,
             "policy '" << c.name << "': decode_budget needs scorer key_norm, sink_recent or accumulated_attention");
    int64_t protect = c.window + (c.scorer == ScorerKind::kSinkRecent ? c.sink : 0);
    KV_CHECK(c.decode_budget > protect + c.decode_evict_chunk,
             "policy '" << c.name << "': decode_budget " << c.decode_budget << " must exceed the protected tokens "
                        << protect << " plus decode_evict_chunk " << c.decode_evict_chunk);
  }
}

PolicyConfig make_policy_config(const std::string& name, const std::map<std::string, std::string>& params) {
  PolicyConfig c = named_defaults(name);
  // knorm under kvpress semantics compresses every layer unless skip_layers is given explicitly.
  auto sem = params.find("semantics");
  if (name == "knorm" && sem != params.end() && sem->second == "kvpress" && !params.count("skip_layers")) {
    c.skip_layers.clear();
  }
  if (c.allocator == AllocatorKind::kDynamic && params.count("variant")) c.dynamic = DynamicOptions{};
  // kvzip under kvpress semantics reconstructs 2048 tokens per pass unless chunk_size is given.
  if (name == "kvzip" && sem != params.end() && sem->second == "kvpress" && !params.count("chunk_size")) c.chunk_size = 2048;
  const auto& table = setters();
  for (const auto& [key, value] : params) {
    auto it = table.find(key);
    if (it == table.end()) {
      std::ostringstream os;
      bool first = true;
      for (const auto& [k, _] : table) {
        os << (first ? "" : ", ") << k;
        first = false;
      }
      KV_FAIL("unknown policy parameter '" << key << "' (value '" << value << "'); valid keys: " << os.str());
    }
    it->second(c, key, value);
  }
  if (c.allocator != AllocatorKind::kDynamic &&
      std::none_of(params.begin(), params.end(), [](const auto& kv) { return is_dynamic_key(kv.first); })) {
    c.dynamic = DynamicOptions{};  // dynamickv's tuned options mean nothing for another allocator
  }
  validate_policy_config(c);
  return c;
}

nlohmann::json to_json(const PolicyConfig& c) {
  nlohmann::json j;
  j["name"] = c.name;
  j["allocator"] = to_string(c.allocator);
  j["scorer"] = to_string(c.scorer);
  if (c.budget_bytes > 0) j["budget_bytes"] = c.budget_bytes;
  if (!c.kv_dtype.empty()) j["kv_dtype"] = c.kv_dtype;
  if (c.budget_ratio > 0.0) {
    j["budget_ratio"] = c.budget_ratio;
  } else {
    j["budget"] = c.budget;
  }
  j["window"] = c.window;
  j["kernel"] = c.kernel;
  j["pooling"] = to_string(c.pooling);
  j["beta"] = c.beta;
  j["r_max"] = c.r_max;
  j["update_interval"] = c.update_interval;
  if (c.allocator == AllocatorKind::kDynamic) {
    j["variant"] = to_string(c.dynamic.variant);
    j["normalize"] = to_string(c.dynamic.norm);
    j["norm_rank"] = c.dynamic.norm_rank;
    j["min_ratio"] = c.dynamic.min_ratio;
    j["prior"] = to_string(c.dynamic.prior);
    j["prior_weight"] = c.dynamic.prior_weight;
  }
  j["sink"] = c.sink;
  j["skip_layers"] = c.skip_layers;
  if (!c.local_layers.empty()) j["local_layers"] = c.local_layers;
  j["semantics"] = to_string(c.semantics);
  j["decode_budget"] = c.decode_budget;
  j["decode_evict_chunk"] = c.decode_evict_chunk;
  j["seed"] = c.seed;
  j["prefix_reuse"] = c.reuse_compressed ? "compressed" : "exact";
  if (c.query_agnostic()) j["compress"] = c.compress_context ? "context" : "prompt";
  if (c.scorer == ScorerKind::kReconstruction) j["chunk_size"] = c.chunk_size;
  if (c.scorer == ScorerKind::kPredicted) j["predictor"] = c.predictor;
  if (c.head_budgets == HeadBudgets::kAdaptive) {
    j["head_budgets"] = to_string(c.head_budgets);
    j["alpha"] = c.alpha;
  }
  return j;
}

}  // namespace kvserve
