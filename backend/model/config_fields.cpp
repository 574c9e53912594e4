#include "backend/model/config_fields.h"

namespace kvserve::config_fields {
namespace {

std::vector<double> number_list(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) KV_FAIL(where << ": missing required key '" << key << "'");
  if (!it->is_array()) KV_FAIL(where << ": key '" << key << "' must be a list of numbers");
  std::vector<double> out;
  for (const auto& e : *it) {
    if (!e.is_number()) KV_FAIL(where << ": key '" << key << "' must hold numbers only");
    out.push_back(e.get<double>());
  }
  return out;
}

// transformers' get_mscale (YaRN's attention temperature): 1 for no extension.
double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// One rope parameter object (rope_parameters, or one layer type's entry of it, or rope_scaling):
// its base (when it states one) into `theta`, its scaling into `s`.
}  // namespace

std::vector<int64_t> id_list(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (it->is_number_integer()) return {it->get<int64_t>()};
  if (it->is_array()) {
    std::vector<int64_t> out;
    for (const auto& e : *it) {
      if (!e.is_number_integer()) KV_FAIL(where << ": key '" << key << "' must hold integers");
      out.push_back(e.get<int64_t>());
    }
    return out;
  }
  KV_FAIL(where << ": key '" << key << "' must be an integer or a list of integers");
}

void parse_rope_object(const json* rp, const ModelConfig& c, RopeScaling& s, double& theta, const std::string& sub) {
  {
    if (auto t = get_opt<double>(*rp, "rope_theta", sub)) theta = *t;
    std::string type = get_opt<std::string>(*rp, "rope_type", sub)
                           .value_or(get_opt<std::string>(*rp, "type", sub).value_or("default"));
    // Every type below rotates the whole head; a partial rotation would silently rotate too much.
    if (auto partial = get_opt<double>(*rp, "partial_rotary_factor", sub); partial && *partial != 1.0)
      KV_FAIL(sub << ": partial_rotary_factor " << *partial << " is not supported (only 1.0)");
    // transformers fills a missing original_max_position_embeddings with max_position_embeddings
    // (standardize_rope_params), and derives a missing yarn/longrope factor from the two.
    auto original_ctx = [&] {
      return get_opt<int64_t>(*rp, "original_max_position_embeddings", sub).value_or(c.max_position_embeddings);
    };
    if (type == "default") {
      s.kind = RopeScaling::Kind::kDefault;
    } else if (type == "linear") {
      s.kind = RopeScaling::Kind::kLinear;
      s.factor = get_req<double>(*rp, "factor", sub);
    } else if (type == "llama3") {
      s.kind = RopeScaling::Kind::kLlama3;
      s.factor = get_req<double>(*rp, "factor", sub);
      s.low_freq_factor = get_req<double>(*rp, "low_freq_factor", sub);
      s.high_freq_factor = get_req<double>(*rp, "high_freq_factor", sub);
      s.original_max_position_embeddings = get_req<int64_t>(*rp, "original_max_position_embeddings", sub);
      KV_CHECK(s.high_freq_factor > s.low_freq_factor,
               sub << ": high_freq_factor must exceed low_freq_factor");
    } else if (type == "dynamic") {
      // Dynamic NTK stretches the base past max_position_embeddings itself (transformers ignores
      // original_max_position_embeddings for this type).
      s.kind = RopeScaling::Kind::kDynamic;
      s.factor = get_req<double>(*rp, "factor", sub);
      s.original_max_position_embeddings = c.max_position_embeddings;
      KV_CHECK(c.head_dim > 2, sub << ": dynamic scaling needs head_dim > 2");
    } else if (type == "yarn") {
      s.kind = RopeScaling::Kind::kYarn;
      s.original_max_position_embeddings = original_ctx();
      KV_CHECK(s.original_max_position_embeddings > 0, sub << ": original_max_position_embeddings must be positive");
      s.factor = get_opt<double>(*rp, "factor", sub)
                     .value_or(static_cast<double>(c.max_position_embeddings) /
                               static_cast<double>(s.original_max_position_embeddings));
      // Python truthiness as transformers tests it: 0 counts as absent.
      const double mscale = get_opt<double>(*rp, "mscale", sub).value_or(0.0);
      const double mscale_all_dim = get_opt<double>(*rp, "mscale_all_dim", sub).value_or(0.0);
      if (auto af = get_opt<double>(*rp, "attention_factor", sub)) {
        s.attention_factor = *af;
      } else if (mscale != 0.0 && mscale_all_dim != 0.0) {
        s.attention_factor = yarn_mscale(s.factor, mscale) / yarn_mscale(s.factor, mscale_all_dim);
      } else {
        s.attention_factor = yarn_mscale(s.factor, 1.0);
      }
      const double bf = get_opt<double>(*rp, "beta_fast", sub).value_or(0.0);
      const double bs = get_opt<double>(*rp, "beta_slow", sub).value_or(0.0);
      s.beta_fast = bf != 0.0 ? bf : 32.0;
      s.beta_slow = bs != 0.0 ? bs : 1.0;
      KV_CHECK(s.beta_fast > 0 && s.beta_slow > 0, sub << ": beta_fast and beta_slow must be positive");
      s.truncate = get_opt<bool>(*rp, "truncate", sub).value_or(true);
    } else if (type == "longrope") {
      s.kind = RopeScaling::Kind::kLongRope;
      s.original_max_position_embeddings = original_ctx();
      KV_CHECK(s.original_max_position_embeddings > 1, sub << ": original_max_position_embeddings must exceed 1");
      s.factor = get_opt<double>(*rp, "factor", sub)
                     .value_or(static_cast<double>(c.max_position_embeddings) /
                               static_cast<double>(s.original_max_position_embeddings));
      if (auto af = get_opt<double>(*rp, "attention_factor", sub)) {
        s.attention_factor = *af;
      } else {
        s.attention_factor = s.factor <= 1.0 ? 1.0
                                             : std::sqrt(1 + std::log(s.factor) /
                                                                 std::log(static_cast<double>(s.original_max_position_embeddings)));
      }
      s.short_factor = number_list(*rp, "short_factor", sub);
      s.long_factor = number_list(*rp, "long_factor", sub);
      for (auto [key, v] : {std::pair{"short_factor", &s.short_factor}, {"long_factor", &s.long_factor}}) {
        KV_CHECK(static_cast<int64_t>(v->size()) == c.head_dim / 2,
                 sub << ": key '" << key << "' has " << v->size() << " entries, head_dim / 2 = " << c.head_dim / 2);
        for (double f : *v) KV_CHECK(f > 0, sub << ": key '" << key << "' must hold positive numbers");
      }
    } else {
      KV_FAIL(sub << ": unsupported rope_type '" << type
                  << "' (supported: default, linear, llama3, yarn, dynamic, longrope)");
    }
    KV_CHECK(s.factor > 0, sub << ": factor must be positive");
    KV_CHECK(std::isfinite(s.attention_factor) && s.attention_factor > 0, sub << ": attention_factor must be positive");
  }
}

const json* rope_json(const json& j, const std::string& where) {
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = j.find(key);
    if (it != j.end() && !it->is_null()) {
      if (!it->is_object()) KV_FAIL(where << ": key '" << key << "' must be an object");
      return &*it;
    }
  }
  return nullptr;
}

void parse_rope(const json& j, ModelConfig& c, const std::string& where) {
  if (const json* rp = rope_json(j, where)) parse_rope_object(rp, c, c.rope_scaling, c.rope_theta, where + ": rope parameters");
  if (auto theta = get_opt<double>(j, "rope_theta", where)) c.rope_theta = *theta;
  KV_CHECK(c.rope_theta > 0, where << ": rope_theta must be positive");
}


void parse_sliding_window(const json& j, ModelConfig& c, const std::string& where, bool default_on) {
  if (get_opt<bool>(j, "use_sliding_window", where).value_or(default_on)) c.sliding_window = get_opt<int64_t>(j, "sliding_window", where);
}

}  // namespace kvserve::config_fields
