#include "paged_kv_memory.h"

#include <algorithm>

#include "kv_check.h"

namespace kvserve {

std::map<std::string, PolicyConfig> resolve_policies(
    const std::map<std::string, std::map<std::string, std::string>>& specs) {
  std::map<std::string, PolicyConfig> out;
  out.emplace("full", make_policy_config("full"));
  for (const auto& [name, params] : specs) {
    auto rest = params;
    std::string method = name;
    if (auto it = rest.find("name"); it != rest.end()) {
      method = it->second;
      rest.erase(it);
    }
    try {
      PolicyConfig cfg = make_policy_config(method, rest);
      cfg.name = name;
      out[name] = cfg;
    } catch (const KvError& e) {
      KV_FAIL("policy '" << name << "': " << e.what());
    }
  }
  return out;
}

PagedKvMemory::PagedKvMemory(int64_t num_layers, const KvPoolOptions& pool, std::map<std::string, PolicyConfig> policies,
                             std::string default_policy)
    : num_layers_(num_layers), cache_(num_layers, pool), policies_(std::move(policies)),
      default_policy_(std::move(default_policy)) {
  policies_.emplace("full", make_policy_config("full"));
  KV_CHECK(policies_.count(default_policy_), "default policy '" << default_policy_ << "' is not defined");
  for (const auto& [name, cfg] : policies_) {
    // H2O's decode-time eviction ranks by attention accumulated over decode steps, which the paged
    // decode kernel does not produce: refuse it here instead of failing in the middle of a generation.
    KV_CHECK(!(cfg.decode_budget > 0 && cfg.scorer == ScorerKind::kAccumulatedAttention),
             "policy '" << name << "': decode_budget (decode-time eviction) is not supported with scorer "
                        << to_string(cfg.scorer) << " (decode computes no attention scores); use knorm or streamingllm");
  }
}

const PolicyConfig& PagedKvMemory::policy(const std::string& name) const {
  auto it = policies_.find(name.empty() ? default_policy_ : name);
  if (it == policies_.end()) KV_FAIL("unknown kv_policy '" << name << "'");
  return it->second;
}

int64_t PagedKvMemory::blocks_for_prompt(int64_t prompt_len, const std::string& name) const {
  const PolicyConfig& cfg = policy(name);
  std::vector<int64_t> per_layer(num_layers_, prompt_len);
  // Compaction copies a layer's kept tokens into fresh blocks before it frees the old ones, so the
  // pool must also hold one layer's compacted copy: DynamicKV's re-budgeting (at most one layer's
  // candidates) and the first decode-time eviction (decode_budget - decode_evict_chunk tokens).
  int64_t transient = 0;
  if (!cfg.is_full()) {
    // Before any layer is seen, DynamicKV's budgets are its candidate counts (bs + window): the peak.
    PrefillSelector sel(cfg, num_layers_, cache_.num_kv_heads(), prompt_len);
    per_layer = sel.budgets();
    if (sel.is_dynamic()) transient = cache_.blocks_needed({*std::max_element(per_layer.begin(), per_layer.end())});
  }
  if (cfg.decode_budget > 0) {
    transient = std::max(transient, cache_.blocks_needed({std::max<int64_t>(0, cfg.decode_budget - cfg.decode_evict_chunk)}));
  }
  for (auto& n : per_layer) n += 1;  // room for the first decoded token
  return cache_.blocks_needed(per_layer) + transient;
}

bool PagedKvMemory::can_prefill(int64_t prompt_len, const std::string& p) const {
  return blocks_for_prompt(prompt_len, p) <= cache_.free_blocks();
}

bool PagedKvMemory::fits_when_empty(int64_t prompt_len, const std::string& p) const {
  return blocks_for_prompt(prompt_len, p) <= cache_.total_blocks();
}

bool PagedKvMemory::can_decode(const std::vector<int64_t>& seq_ids) const {
  // Mirrors decode_attention layer by layer: decode-time evictions first (each compacts into fresh
  // blocks before freeing the old ones), then one appended token per sequence.
  const int64_t bs = cache_.block_size();
  int64_t free = cache_.free_blocks();
  std::vector<int64_t> len(seq_ids.size()), held(seq_ids.size());
  for (int64_t l = 0; l < num_layers_; ++l) {
    for (size_t i = 0; i < seq_ids.size(); ++i) {
      const LayerBlocks& lb = cache_.layer_blocks(seq_ids[i], l);
      len[i] = lb.length;
      held[i] = static_cast<int64_t>(lb.blocks.size());
      auto it = seqs_.find(seq_ids[i]);
      if (it == seqs_.end() || it->second.evictors.empty()) continue;
      const DecodeEvictor& ev = it->second.evictors[static_cast<size_t>(l)];
      if (!ev.needs_eviction(len[i] + 1)) continue;
      const int64_t target = std::min(len[i], ev.target_count());
      const int64_t fresh = cache_.blocks_needed({target});
      if (fresh > free) return false;
      free += held[i] - fresh;
      len[i] = target;
      held[i] = fresh;
    }
    for (size_t i = 0; i < seq_ids.size(); ++i) free -= len[i] == held[i] * bs;
    if (free < 0) return false;
  }
  return true;
}

int64_t PagedKvMemory::kept_tokens(int64_t seq_id) const {
  if (!cache_.has_sequence(seq_id)) return 0;
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers_; ++l) n += cache_.length(seq_id, l);
  return n;
}

void PagedKvMemory::begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string& name) {
  const PolicyConfig& cfg = policy(name);
  KV_CHECK(!seqs_.count(seq_id), "sequence " << seq_id << " already has KV state");
  cache_.add_sequence(seq_id);
  SeqState& s = seqs_[seq_id];
  s.policy = &cfg;
  s.prompt_len = prompt_len;
  if (!cfg.is_full()) s.selector = std::make_unique<PrefillSelector>(cfg, num_layers_, cache_.num_kv_heads(), prompt_len);
  if (cfg.decode_budget > 0) {
    for (int64_t l = 0; l < num_layers_; ++l) s.evictors.emplace_back(cfg, l);
  }
}

void PagedKvMemory::apply_updates(int64_t seq_id) {
  SeqState& s = seqs_.at(seq_id);
  for (auto& [layer, kept] : s.selector->take_updates()) {
    // Earlier layers hold their positions in ascending order per head: find the surviving slots.
    auto held = cache_.positions(seq_id, layer).to(kept.device());
    auto slots = torch::searchsorted(held, kept.to(torch::kInt64).contiguous());
    cache_.compact(seq_id, layer, slots.to(torch::kCPU));
  }
}

void PagedKvMemory::store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v) {
  SeqState& s = seqs_.at(seq_id);
  const int64_t KV = k.size(0), T = k.size(1), D = k.size(2);
  if (!s.selector || !s.selector->compresses()) {
    auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kInt64)).unsqueeze(0).expand({KV, T});
    cache_.write(seq_id, layer, k, v, pos);
    return;
  }
  torch::Tensor kept = s.selector->on_layer(layer, q, k);  // [KV, n] ascending positions
  auto idx = kept.to(k.device()).unsqueeze(-1).expand({KV, kept.size(1), D});
  cache_.write(seq_id, layer, k.gather(1, idx), v.gather(1, idx), kept);
  apply_updates(seq_id);
}

void PagedKvMemory::end_prefill(int64_t seq_id) {
  SeqState& s = seqs_.at(seq_id);
  if (s.selector) {
    s.selector->finish();
    apply_updates(seq_id);
    s.selector.reset();
  }
  s.budgets.clear();
  for (int64_t l = 0; l < num_layers_; ++l) s.budgets.push_back(cache_.length(seq_id, l));
}

torch::Tensor PagedKvMemory::decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                              const torch::Tensor& k, const torch::Tensor& v) {
  // Decode-time eviction runs once per decode_evict_chunk tokens for sequences whose policy evicts.
  for (int64_t id : batch.seq_ids) {
    SeqState& s = seqs_.at(id);
    if (s.evictors.empty()) continue;
    const DecodeEvictor& ev = s.evictors[layer];
    if (!ev.needs_eviction(cache_.length(id, layer) + 1)) continue;
    auto [keys, values] = cache_.gather(id, layer);
    cache_.compact(id, layer, ev.select(cache_.positions(id, layer), keys).to(torch::kCPU));
  }
  return cache_.append_and_attend(layer, batch.seq_ids, batch.positions, q, k, v);
}

void PagedKvMemory::release(int64_t seq_id) {
  if (cache_.has_sequence(seq_id)) cache_.release(seq_id);
  seqs_.erase(seq_id);
}

}  // namespace kvserve
