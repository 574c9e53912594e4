#pragma once
// The KV dtype ladder: a policy with kv_dtype "ladder" and a budget_bytes picks, per prompt, the
// precision its bytes buy the most from (issue 47, docs/eval/kv-dtype.md): the cache's own dtype
// while the bytes keep the whole prompt, int8 while they keep enough of it, int4 below.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "policies/policy_config.h"

namespace kvserve {

// One step down the ladder: the rung's policy (the ladder policy's name + "@" + kv_dtype), its KV
// dtype, and the least fraction of a prompt the policy's bytes must keep in it for it to be chosen.
struct KvDtypeRung {
  std::string policy;
  std::string kv_dtype;
  double min_kept = 0.0;
};

// The rungs below the cache's dtype for `cfg`, in order: its kv_ladder where it has one, else by
// scorer. Scorers that rebuild the context (kvzip,
// kvzap) keep their answers at a quarter kept in int8, so int8 holds down to 25 %; query-aware
// scorers (snapkv, pyramidkv, ...) gain more from tokens than from bits, so int4 takes over below
// half kept (the equal-bytes rows of docs/eval/kv-dtype.md).
std::vector<KvDtypeRung> kv_dtype_ladder(const std::string& name, const PolicyConfig& cfg);

// Puts policy `name` (kv_dtype "ladder") into `out` as its rungs: `name` itself in the cache's dtype
// with kv_rungs naming the others, and one policy per rung. Throws naming the policy when it has no
// budget_bytes or a rung's name is taken.
void expand_kv_dtype_ladder(const std::string& name, PolicyConfig cfg, std::map<std::string, PolicyConfig>& out);

// The policy a prompt of prompt_len tokens runs under: `policy`, or the first of its rungs whose
// budget (resolved in its dtype) keeps at least its min_kept of the prompt, else its last rung.
const std::string& choose_kv_rung(const std::map<std::string, PolicyConfig>& policies, const std::string& policy,
                                  int64_t prompt_len);

}  // namespace kvserve
