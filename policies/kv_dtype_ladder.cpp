#include "policies/kv_dtype_ladder.h"

#include "common/check.h"

namespace kvserve {

namespace {

bool rebuilds_context(const PolicyConfig& cfg) {
  return cfg.scorer == ScorerKind::kReconstruction || cfg.scorer == ScorerKind::kPredicted;
}

// Fraction of a prompt of n tokens a policy keeps per layer (its resolved budget over n).
double kept_fraction(const PolicyConfig& cfg, int64_t n) {
  if (cfg.is_full() || n <= 0) return 1.0;
  return static_cast<double>(cfg.budget_tokens(n)) / static_cast<double>(n);
}

}  // namespace

std::vector<KvDtypeRung> kv_dtype_ladder(const std::string& name, const PolicyConfig& cfg) {
  if (cfg.kv_ladder.empty())
    return {{name + "@int8", "int8", rebuilds_context(cfg) ? 0.25 : 0.5}, {name + "@int4", "int4", 0.0}};
  std::vector<KvDtypeRung> rungs;
  for (const auto& [dtype, kept] : cfg.kv_ladder) rungs.push_back({name + "@" + dtype, dtype, kept});
  return rungs;
}

void expand_kv_dtype_ladder(const std::string& name, PolicyConfig cfg, std::map<std::string, PolicyConfig>& out) {
  KV_CHECK(!cfg.is_full() && cfg.budget_bytes > 0,
           "policy '" << name << "': kv_dtype 'ladder' chooses a dtype for a budget in bytes: give it budget_bytes");
  const std::vector<KvDtypeRung> rungs = kv_dtype_ladder(name, cfg);
  cfg.kv_dtype.clear();
  cfg.kv_rungs.clear();
  cfg.kv_ladder.clear();
  for (const KvDtypeRung& r : rungs) {
    KV_CHECK(!out.count(r.policy), "policy '" << name << "': its ladder's rung '" << r.policy
                                              << "' is also configured as a policy; rename that one");
    PolicyConfig rung = cfg;
    rung.name = r.policy;
    rung.kv_dtype = r.kv_dtype;
    out[r.policy] = rung;
    cfg.kv_rungs.emplace_back(r.policy, r.min_kept);
  }
  out[name] = cfg;
}

const std::string& choose_kv_rung(const std::map<std::string, PolicyConfig>& policies, const std::string& policy,
                                  int64_t prompt_len) {
  auto it = policies.find(policy);
  if (it == policies.end() || it->second.kv_rungs.empty()) return policy;
  // The cache's own dtype while the bytes keep the whole prompt: nothing is evicted or rounded more.
  if (kept_fraction(it->second, prompt_len) >= 1.0) return it->first;
  for (const auto& [rung, min_kept] : it->second.kv_rungs) {
    const PolicyConfig& r = policies.at(rung);
    if (kept_fraction(r, prompt_len) >= min_kept) return r.name;
  }
  return policies.at(it->second.kv_rungs.back().first).name;
}

}  // namespace kvserve
