#include "cache_manager/paged_kv_memory.h"

#include <algorithm>
#include <limits>
#include <unordered_map>

#include "common/check.h"
#include "common/hash_mix.h"
#include "policies/kv_dtype_ladder.h"
#include "policies/kvzip_scores.h"
#include "policies/token_scorer.h"

namespace kvserve {
namespace {

// Per layer, what its KV heads hold on average (the layer's budget when heads keep different counts).
std::vector<int64_t> mean_head_lengths(const PagedKvCache& cache, int64_t seq_id) {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < cache.num_layers(); ++l) {
    int64_t sum = 0;
    const auto lens = cache.head_lengths(seq_id, l);
    for (int64_t x : lens) sum += x;
    out.push_back(sum / std::max<int64_t>(1, static_cast<int64_t>(lens.size())));
  }
  return out;
}

}  // namespace

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
      if (cfg.kv_dtype == "ladder") {
        expand_kv_dtype_ladder(name, cfg, out);
        continue;
      }
      KV_CHECK(!out.count(name) || out.at(name).kv_dtype.empty(),
               "the name is a rung of a kv_dtype ladder policy; rename it");
      out[name] = cfg;
    } catch (const KvError& e) {
      // A message that already names this policy (its name is its method) is not named twice.
      const std::string what = e.what(), prefix = "policy '" + name + "': ";
      if (what.rfind(prefix, 0) == 0) throw;
      KV_FAIL(prefix << what);
    }
  }
  return out;
}

PagedKvMemory::PagedKvMemory(int64_t num_layers, const KvPoolOptions& pool, std::map<std::string, PolicyConfig> policies,
                             std::string default_policy, KvShard shard, std::shared_ptr<KvSlabs> slabs)
    : num_layers_(num_layers), shard_(std::move(shard)), cache_(num_layers, pool, std::move(slabs)), policies_(std::move(policies)),
      default_policy_(std::move(default_policy)), rounds_kv_(pool.rounds) {
  if (shard_.total_layers == 0) shard_.total_layers = num_layers;
  if (!shard_.exchange) shard_.exchange = std::make_shared<LocalScoreExchange>();
  KV_CHECK(shard_.first_layer >= 0 && shard_.first_layer + num_layers <= shard_.total_layers,
           "KV shard layers [" << shard_.first_layer << ", " << shard_.first_layer + num_layers << ") outside the model's "
                               << shard_.total_layers);
  policies_.emplace("full", make_policy_config("full"));
  KV_CHECK(policies_.count(default_policy_), "default policy '" << default_policy_ << "' is not defined");
  for (const auto& [name, cfg] : policies_) {
    KV_CHECK(!cfg.head_adaptive() || pool.head_blocks,
             "policy '" << name << "': head_budgets=adaptive needs a KV pool with head-wise blocks (head_blocks)");
    // H2O's decode-time eviction ranks by attention accumulated over decode steps, which the paged
    // decode kernel does not produce: refuse it here instead of failing in the middle of a generation.
    KV_CHECK(!(cfg.decode_budget > 0 && cfg.scorer == ScorerKind::kAccumulatedAttention),
             "policy '" << name << "': decode_budget (decode-time eviction) is not supported with scorer "
                        << to_string(cfg.scorer) << " (decode computes no attention scores); use knorm or streamingllm");
  }
}

void PagedKvMemory::set_layer_windows(std::vector<int64_t> windows, const std::vector<int64_t>& model_local_layers) {
  KV_CHECK(static_cast<int64_t>(windows.size()) == num_layers_,
           "internal: " << windows.size() << " layer windows for a KV memory of " << num_layers_ << " layers");
  for (int64_t w : windows) KV_CHECK(w >= 0, "internal: layer window " << w);
  windows_ = std::move(windows);
  std::vector<int64_t> locals = model_local_layers;
  for (int64_t ll = 0; ll < num_layers_; ++ll)
    if (windowed(ll)) locals.push_back(shard_.first_layer + ll);
  std::sort(locals.begin(), locals.end());
  locals.erase(std::unique(locals.begin(), locals.end()), locals.end());
  for (auto& [name, cfg] : policies_) cfg.local_layers = locals;
}

const PolicyConfig& PagedKvMemory::policy(const std::string& name) const {
  auto it = policies_.find(name.empty() ? default_policy_ : name);
  if (it == policies_.end()) KV_FAIL("unknown kv_policy '" << name << "'");
  return it->second;
}

void PagedKvMemory::set_draft_policy(const std::string& name, int64_t budget, int64_t min_prompt_tokens,
                                     int64_t sink_tokens, int64_t refresh_tokens) {
  if (name.empty()) {
    draft_policy_.reset();
    return;
  }
  const std::string where = "speculative_config.draft_policy: policy '" + name + "'";
  KV_CHECK(budget > 0, "speculative_config.draft_budget must be > 0 tokens, got " << budget);
  // A configured policy's parameters, else the library method of that name with its defaults.
  PolicyConfig cfg;
  if (policies_.count(name)) {
    cfg = policy(name);
  } else {
    try {
      cfg = make_policy_config(name, {{"budget", std::to_string(budget)}});
    } catch (const KvError& e) {
      KV_FAIL(where << " is neither a configured policy nor a method: " << e.what());
    }
    cfg.local_layers = policy("full").local_layers;
  }
  KV_CHECK(!cfg.is_full(), where << " keeps every token; name a policy that selects (snapkv, pyramidkv, knorm, ...)");
  KV_CHECK(chunkable(cfg), where << " (scorer " << to_string(cfg.scorer)
                                 << ") scores after the prefill or with every query; its selection cannot run as a "
                                    "prompt kept whole ends");
  KV_CHECK(cfg.allocator != AllocatorKind::kDynamic && cfg.allocator != AllocatorKind::kGlobal,
           where << " re-selects across layers (DynamicKV or a global top-k); name a per-layer policy");
  KV_CHECK(sink_tokens >= 0 && min_prompt_tokens >= 0 && refresh_tokens >= 0,
           "speculative_config: negative draft_sink_tokens, draft_min_context_tokens or draft_refresh_tokens");
  cfg.budget = budget;
  cfg.budget_ratio = 0.0;
  cfg.budget_bytes = 0;
  cfg.decode_budget = 0;
  draft_policy_ = std::move(cfg);
  draft_min_prompt_ = min_prompt_tokens;
  draft_skip_blocks_ = blocks_for_tokens(sink_tokens, cache_.block_size());
  draft_refresh_ = refresh_tokens;
}

void PagedKvMemory::draft_select(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k) {
  SeqState& s = seqs_.at(seq_id);
  const PolicyConfig& cfg = *draft_policy_;
  // A prefix hit can leave fewer computed queries than the window: that sequence drafts over sinks
  // and window alone.
  if (scorer_needs_queries(cfg.scorer) && (!q.defined() || q.size(1) < cfg.window)) {
    s.draft_selector.reset();
    return;
  }
  const torch::Tensor kept = s.draft_selector->on_layer(layer, q, k);  // [KV, n] ascending positions
  const int64_t ll = local(layer);
  set_draft_view(seq_id, ll, kept, s.draft_selector->last_head_counts());
  if (draft_refresh_ == 0) return;
  s.draft_live = true;
  s.draft_tail_end = s.draft_chosen_at = k.size(1);
  if (!scorer_needs_queries(cfg.scorer)) return;
  if (s.draft_tail.empty()) s.draft_tail.resize(static_cast<size_t>(num_layers_));
  const int64_t w = std::min<int64_t>(cfg.window, q.size(1));
  s.draft_tail[static_cast<size_t>(ll)] = q.narrow(1, q.size(1) - w, w).contiguous().clone();
}

void PagedKvMemory::set_draft_view(int64_t seq_id, int64_t ll, const torch::Tensor& kept,
                                   const std::vector<int64_t>& counts) {
  const int64_t lanes = cache_.lanes(), per = cache_.num_kv_heads() / lanes;
  for (int64_t lane = 0; lane < lanes; ++lane) {
    std::vector<int64_t> c;
    if (!counts.empty()) c.assign(counts.begin() + lane * per, counts.begin() + (lane + 1) * per);
    cache_.set_draft_blocks(seq_id, ll, lane,
                            blocks_of_kept(kept.narrow(0, lane * per, per), c, cache_.block_size(), draft_skip_blocks_));
  }
}

void PagedKvMemory::record_draft_queries(int64_t ll, const DecodeBatch& batch, const torch::Tensor& q) {
  if (!scorer_needs_queries(draft_policy_->scorer) || windowed(ll)) return;
  const size_t B = batch.seq_ids.size();
  for (size_t r0 = 0, r1 = 0; r0 < B; r0 = r1) {
    // A verify step's rows of one sequence are consecutive.
    for (r1 = r0 + 1; r1 < B && batch.seq_ids[r1] == batch.seq_ids[r0];) ++r1;
    auto it = seqs_.find(batch.seq_ids[r0]);
    if (it == seqs_.end() || !it->second.draft_live || it->second.draft_tail.empty()) continue;
    SeqState& s = it->second;
    torch::Tensor& tail = s.draft_tail[static_cast<size_t>(ll)];
    const torch::Tensor rows = q.narrow(0, static_cast<int64_t>(r0), static_cast<int64_t>(r1 - r0)).transpose(0, 1);
    tail = tail.defined() ? torch::cat({tail, rows.to(tail.scalar_type())}, 1) : rows.contiguous();
    const int64_t keep = std::min<int64_t>(draft_policy_->window, tail.size(1));
    tail = tail.narrow(1, tail.size(1) - keep, keep).contiguous();
    s.draft_tail_end = batch.positions[r1 - 1] + 1;
  }
}

void PagedKvMemory::rescore_draft_view(int64_t seq_id, int64_t len) {
  SeqState& s = seqs_.at(seq_id);
  const PolicyConfig& cfg = *draft_policy_;
  const bool queries = scorer_needs_queries(cfg.scorer);
  // A window scorer needs the window's queries of exactly the positions before `len`.
  if (queries && s.draft_tail_end != len) return;
  PrefillSelector sel(cfg, shard_.total_layers, cache_.num_kv_heads(), len);
  if (!sel.compresses()) return;
  sel.set_exchange(*shard_.exchange);
  for (int64_t ll = 0; ll < num_layers_; ++ll) {
    if (windowed(ll)) continue;
    const torch::Tensor q = queries ? s.draft_tail[static_cast<size_t>(ll)] : torch::Tensor();
    if (queries && (!q.defined() || q.size(1) < cfg.window)) return;
    const torch::Tensor k = cache_.gather(seq_id, ll).first;
    if (k.size(1) != len) return;  // not a whole prompt's cache (cannot happen for a sequence kept whole)
    set_draft_view(seq_id, ll, sel.on_layer(shard_.first_layer + ll, q, queries ? k.to(q.scalar_type()) : k),
                   sel.last_head_counts());
  }
  s.draft_chosen_at = len;
}

PagedKvMemory::Geometry PagedKvMemory::geometry() const {
  return {shard_.first_layer, num_layers_, shard_.total_layers, cache_.num_kv_heads(), cache_.block_size(), rounds_kv_,
          prefix_caching(), cache_.head_blocks()};
}

int64_t PagedKvMemory::prefix_copy_blocks(const PolicyConfig& cfg, const Geometry& g, int64_t prompt_len) {
  if (!g.prefix_caching || cfg.is_full()) return 0;
  return prompt_len / g.block_size * g.num_layers * g.lanes();
}

int64_t PagedKvMemory::context_prompt_blocks(const PolicyConfig& cfg, const Geometry& g, int64_t context_len,
                                             int64_t prompt_len) {
  return prompt_blocks(cfg, g, context_len) +
         g.num_layers * g.lanes() * (blocks_for_tokens(prompt_len - context_len + 1, g.block_size) + 2);
}

bool PagedKvMemory::chunkable(const PolicyConfig& cfg) {
  // Reconstruction scores need the whole prompt's prefill first (its pass runs after the last layer);
  // predicted scores could come chunk by chunk, but their selection is not wired to the last chunk.
  return cfg.scorer != ScorerKind::kAccumulatedAttention && !cfg.scores_after_prefill();
}

int64_t PagedKvMemory::prompt_blocks(const PolicyConfig& cfg, const Geometry& g, int64_t prompt_len, bool chunked) {
  std::vector<int64_t> per_layer(static_cast<size_t>(g.num_layers), prompt_len);
  auto blocks = [&](int64_t tokens) { return blocks_for_tokens(tokens, g.block_size); };
  // Compaction copies a layer's kept tokens into fresh blocks before it frees the old ones, so the
  // pool must also hold one layer's compacted copy: DynamicKV's re-budgeting (at most one layer's
  // candidates) and the first decode-time eviction (decode_budget - decode_evict_chunk tokens).
  int64_t transient = 0;
  if (!cfg.is_full()) {
    // Before any layer is seen, DynamicKV's budgets are its candidate counts (bs + window): the peak.
    PrefillSelector sel(cfg, g.total_layers, g.num_kv_heads, prompt_len);
    const auto all = sel.budgets();
    per_layer.assign(all.begin() + g.first_layer, all.begin() + g.first_layer + g.num_layers);
    if (sel.is_dynamic()) transient = blocks(*std::max_element(per_layer.begin(), per_layer.end()));
    // Chunked, every layer holds the whole prompt until the last chunk; the selection then rewrites
    // each layer in place (PagedKvCache::write reuses its blocks), so only DynamicKV's re-budgeting
    // copy comes on top.
    // Reconstruction scoring holds every layer's whole prompt until its pass has run, then rewrites
    // each layer in place, as the last chunk does.
    if (chunked || cfg.scores_after_prefill()) per_layer.assign(per_layer.size(), prompt_len);
  }
  const bool whole = chunked || cfg.scores_after_prefill();
  if (cfg.decode_budget > 0) transient = std::max(transient, blocks(std::max<int64_t>(0, cfg.decode_budget - cfg.decode_evict_chunk)));
  const int64_t lanes = g.lanes();
  int64_t n = transient * lanes;
  for (int64_t t : per_layer) {
    // Head-adaptive (before chunking's whole prompt), a layer's KV * t tokens spread unevenly: at
    // most one partly filled block per head on top of the even split.
    if (lanes > 1 && cfg.head_adaptive() && !whole) {
      n += std::min(blocks((t + 1) * lanes) + lanes, lanes * blocks(prompt_len + 1));
    } else {
      n += blocks(t + 1) * lanes;  // room for the first decoded token
    }
  }
  return n;
}

int64_t PagedKvMemory::decode_demand(const std::vector<int64_t>& seq_ids) const {
  // Replays a step layer by layer as decode_attention runs it: a decode-time eviction compacts into
  // fresh blocks before the old ones go back, then the appended token may open a block. The demand
  // is the peak of that running count per sequence (summing every layer's compaction copies would
  // ask for blocks the step never holds at once, and a lone sequence in a pool of its
  // prompt_blocks would be preempted forever).
  const int64_t bs = cache_.block_size();
  int64_t demand = 0;
  for (int64_t id : seq_ids) {
    if (!cache_.has_sequence(id)) continue;
    auto it = seqs_.find(id);
    const bool evicts = it != seqs_.end() && !it->second.evictors.empty();
    int64_t net = 0, peak = 0;
    for (int64_t l = 0; l < num_layers_; ++l) {
      for (int64_t lane = 0; lane < cache_.lanes(); ++lane) {
        const LayerBlocks& lb = cache_.layer_blocks(id, l, lane);
        int64_t len = lb.length, held = static_cast<int64_t>(lb.blocks.size());
        if (evicts) {
          const DecodeEvictor& ev = it->second.evictors[static_cast<size_t>(l)];
          if (ev.needs_eviction(len + 1)) {
            len = std::min(len, ev.target_count());
            const int64_t fresh = blocks_for_tokens(len, bs);
            peak = std::max(peak, net + fresh);
            net += fresh - held;
            held = fresh;
          }
        }
        net += len == held * bs;
        peak = std::max(peak, net);
      }
    }
    demand += peak;
  }
  return demand;
}

int64_t PagedKvMemory::blocks_held(int64_t seq_id) const {
  return cache_.has_sequence(seq_id) ? cache_.blocks_of(seq_id) : 0;
}

int64_t PagedKvMemory::kept_tokens(int64_t seq_id) const {
  if (!cache_.has_sequence(seq_id)) return 0;
  // Head-wise, a layer counts its heads' mean (what one length per layer would be).
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers_; ++l) {
    if (cache_.lanes() == 1) {
      n += cache_.length(seq_id, l);
    } else {
      for (int64_t x : cache_.head_lengths(seq_id, l)) n += x;
    }
  }
  return cache_.lanes() == 1 ? n : n / cache_.num_kv_heads();
}

PagedKvMemory::HeadKeptStats PagedKvMemory::head_kept(int64_t seq_id) const {
  HeadKeptStats out;
  if (!cache_.has_sequence(seq_id)) return out;
  out.min = std::numeric_limits<int64_t>::max();
  for (int64_t l = 0; l < num_layers_; ++l) {
    for (int64_t x : cache_.head_lengths(seq_id, l)) {
      out.min = std::min(out.min, x);
      out.max = std::max(out.max, x);
      out.sum += x;
      ++out.count;
    }
  }
  if (out.count == 0) out.min = 0;
  return out;
}

void PagedKvMemory::begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string& name) {
  const PolicyConfig& cfg = policy(name);
  KV_CHECK(!seqs_.count(seq_id), "sequence " << seq_id << " already has KV state");
  // Local layers keep every position (their decode reads the last `window` slots as the last
  // positions) and the budget goes to the global layers (DynamicKV moves it among those alone,
  // kvzip's global top-k runs over theirs).
  cache_.add_sequence(seq_id);
  SeqState& s = seqs_[seq_id];
  s.policy = &cfg;
  s.prompt_len = prompt_len;
  if (!cfg.is_full()) {
    s.selector = std::make_unique<PrefillSelector>(cfg, shard_.total_layers, cache_.num_kv_heads(), prompt_len);
    s.selector->set_exchange(*shard_.exchange);
  }
  if (cfg.decode_budget > 0) {
    for (int64_t l = 0; l < num_layers_; ++l) s.evictors.emplace_back(cfg, shard_.first_layer + l);
  }
  if (draft_policy_ && !(s.selector && s.selector->compresses()) && prompt_len >= draft_min_prompt_) {
    s.draft_selector = std::make_unique<PrefillSelector>(*draft_policy_, shard_.total_layers, cache_.num_kv_heads(), prompt_len);
    s.draft_selector->set_exchange(*shard_.exchange);
    if (!s.draft_selector->compresses()) s.draft_selector.reset();  // within the budget: the view is the cache
  }
}

// ---------------------------------------------------------------------------------------------------
// prefix caching

void PagedKvMemory::enable_prefix_cache(uint64_t salt, PrefixCache::KeyFn key_fn, int64_t host_tier_bytes) {
  cache_.enable_prefix_cache(salt, std::move(key_fn), host_tier_bytes);
}

int64_t PagedKvMemory::prefix_queried(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? 0 : it->second.queried;
}

int64_t PagedKvMemory::prefix_hit(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? 0 : it->second.hit;
}

int64_t PagedKvMemory::reuse_limit(const PolicyConfig& cfg, bool compresses, int64_t n) const {
  if (!compresses) return n - 1;  // the last position's logits are computed
  // A compressing policy continues from the cached prefix as a chunked prefill's last chunk does:
  // where that chunk could not run, nothing is reused.
  if (!chunkable(cfg) || rounds_kv_) return 0;
  // The window's queries score the whole prompt: they are computed, never cached.
  return scorer_needs_queries(cfg.scorer) ? n - std::max<int64_t>(cfg.window, 1) : n - 1;
}

std::vector<int32_t> PagedKvMemory::prefix_match(const PolicyConfig& cfg, bool compresses, int64_t prompt_len,
                                                 std::span<const int64_t> tokens, int64_t max_hit) const {
  const PrefixCache* pc = cache_.prefix_cache();
  if (!pc || max_hit < 0) return {};
  const int64_t bs = cache_.block_size();
  const int64_t limit = std::min({reuse_limit(cfg, compresses, prompt_len), static_cast<int64_t>(tokens.size()) - 1, max_hit});
  if (limit < bs) return {};
  return pc->match(tokens, limit / bs);
}

int64_t PagedKvMemory::prefix_lookup(std::span<const int64_t> prompt, const std::string& name) const {
  if (!prefix_caching() || prompt.empty()) return 0;
  const PolicyConfig& cfg = policy(name);
  const int64_t n = static_cast<int64_t>(prompt.size());
  const bool compresses = !cfg.is_full() && PrefillSelector(cfg, shard_.total_layers, cache_.num_kv_heads(), n).compresses();
  return static_cast<int64_t>(prefix_match(cfg, compresses, n, prompt, n).size()) * cache_.block_size();
}

int64_t PagedKvMemory::context_lookup(std::span<const int64_t> context, const std::string& name) const {
  const CompressedContextCache* cc = cache_.context_cache();
  if (!cc || context.empty()) return 0;
  return cc->find(context_key(policy(name), context), context) >= 0 ? static_cast<int64_t>(context.size()) : 0;
}

int64_t PagedKvMemory::shared_prefix_blocks(std::span<const int64_t> prompt, const std::string& name,
                                            std::span<const int64_t> leaving) const {
  const PrefixCache* pc = cache_.prefix_cache();
  const PolicyConfig& cfg = policy(name);
  if (!pc || !cfg.is_full() || prompt.empty()) return 0;
  const int64_t n = static_cast<int64_t>(prompt.size());
  std::unordered_map<int32_t, int64_t> gone;  // uses that end before the prompt runs
  for (int64_t id : leaving) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) continue;
    for (int32_t e : it->second.prefix) ++gone[e];
  }
  int64_t shared = 0;
  for (int32_t e : prefix_match(cfg, false, n, prompt, n)) {
    auto g = gone.find(e);
    if (pc->on_host(e) || pc->users(e) - (g == gone.end() ? 0 : g->second) <= 0) break;
    ++shared;
  }
  return shared * num_layers_ * cache_.lanes();
}

int64_t PagedKvMemory::prefill_tokens(int64_t seq_id, int64_t start, std::span<const int64_t> tokens, int64_t max_hit,
                                      bool keep_copy, ResumeFrom resume) {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end(), "prefill: sequence " << seq_id << " has no KV state");
  if (start == 0 && resume.seq_id >= 0) return resume_parked(seq_id, resume, static_cast<int64_t>(tokens.size()));
  PrefixCache* pc = cache_.prefix_cache();
  if (!pc) return 0;
  SeqState& s = it->second;
  if (static_cast<int64_t>(s.tokens.size()) != start) {
    s.tokens.clear();  // told out of order (a caller that skips chunks): this prompt is not cached
    return 0;
  }
  s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  if (start != 0) return 0;
  s.keep_copy = keep_copy;
  if (max_hit < 0) return 0;
  s.queried = s.prompt_len;
  const bool compresses = s.selector && s.selector->compresses();
  std::vector<int32_t> hit = prefix_match(*s.policy, compresses, s.prompt_len, tokens, max_hit);
  if (hit.empty()) return 0;
  pc->acquire(hit);
  // Entries in the host tier come back into the pool first; where the pool has no room for one,
  // the prompt is prefilled from there on.
  const size_t in_pool = cache_.prefix_promote(hit);
  if (in_pool < hit.size()) {
    pc->release(std::vector<int32_t>(hit.begin() + static_cast<std::ptrdiff_t>(in_pool), hit.end()));
    hit.resize(in_pool);
    if (hit.empty()) return 0;
  }
  s.prefix = hit;
  const int64_t bs = cache_.block_size();
  const int64_t h = static_cast<int64_t>(hit.size()) * bs;
  // An entry holds a block per (layer, lane); a layer shares them lane-major.
  const int64_t lanes = cache_.lanes();
  std::vector<int32_t> layer_blocks(hit.size() * static_cast<size_t>(lanes));
  for (int64_t l = 0; l < num_layers_; ++l) {
    for (int64_t lane = 0; lane < lanes; ++lane)
      for (size_t b = 0; b < hit.size(); ++b)
        layer_blocks[static_cast<size_t>(lane) * hit.size() + b] = pc->blocks(hit[b])[static_cast<size_t>(l * lanes + lane)];
    cache_.share(seq_id, l, layer_blocks, h);
  }
  s.hit = h;
  return h;
}

void PagedKvMemory::copy_for_cache(int64_t seq_id, int64_t ll, const torch::Tensor& kf, const torch::Tensor& vf) {
  SeqState& s = seqs_.at(seq_id);
  if (!s.keep_copy || !cache_.prefix_cache() || static_cast<int64_t>(s.tokens.size()) != s.prompt_len) return;
  const int64_t bs = cache_.block_size(), first = s.hit, end = s.prompt_len / bs * bs;
  if (end <= first) return;
  if (s.copies.empty()) s.copies.resize(static_cast<size_t>(num_layers_));
  try {
    s.copies[static_cast<size_t>(ll)] =
        cache_.store_blocks(kf.narrow(1, first, end - first), vf.narrow(1, first, end - first), first);
  } catch (const KvError&) {
    // No room after all: this prompt is simply not cached (its prefill goes on).
    for (auto& c : s.copies) cache_.drop(c);
    s.copies.clear();
    s.keep_copy = false;
  }
}

void PagedKvMemory::publish_prefix(int64_t seq_id, bool compressed) {
  SeqState& s = seqs_.at(seq_id);
  PrefixCache* pc = cache_.prefix_cache();
  const int64_t bs = cache_.block_size();
  const int64_t first = s.hit / bs, end = s.prompt_len / bs;
  const bool told = static_cast<int64_t>(s.tokens.size()) == s.prompt_len;
  // Uncompressed, the sequence's own blocks hold the full-precision prompt and become the cache's
  // (shared: the sequence uses them as one of the entries' users); compressed, its copies do.
  const bool own = !compressed;
  const int64_t lanes = cache_.lanes();
  const bool have_copies = !s.copies.empty() && std::all_of(s.copies.begin(), s.copies.end(), [&](const auto& c) {
    return static_cast<int64_t>(c.size()) == (end - first) * lanes;
  });
  if (pc && told && end > first && (own || have_copies)) {
    int32_t parent = s.prefix.empty() ? -1 : s.prefix.back();
    std::vector<int32_t> blocks(static_cast<size_t>(num_layers_ * lanes));
    for (int64_t b = first; b < end; ++b) {
      for (int64_t l = 0; l < num_layers_; ++l) {
        for (int64_t lane = 0; lane < lanes; ++lane) {
          blocks[static_cast<size_t>(l * lanes + lane)] =
              own ? cache_.layer_blocks(seq_id, l, lane).blocks[static_cast<size_t>(b)]
                  : s.copies[static_cast<size_t>(l)][static_cast<size_t>(lane * (end - first) + b - first)];
        }
      }
      const auto tok = std::span<const int64_t>(s.tokens).subspan(static_cast<size_t>(b * bs), static_cast<size_t>(bs));
      const int32_t id = cache_.prefix_insert(parent, tok, blocks);
      if (id < 0) break;  // cached meanwhile by another prompt (or a key collision): stop here
      if (own) {
        pc->acquire({id});
        s.prefix.push_back(id);
      }
      parent = id;
    }
  }
  // The copies' own references go (the cache holds what it took), and a compressed sequence no
  // longer reads the cached prefix: its layers hold their own compressed blocks now.
  for (auto& c : s.copies) cache_.drop(c);
  s.copies.clear();
  if (compressed) drop_prefix(seq_id);
  s.tokens.clear();
  s.tokens.shrink_to_fit();
}

void PagedKvMemory::drop_prefix(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  SeqState& s = it->second;
  if (!s.prefix.empty() && cache_.prefix_cache()) cache_.prefix_cache()->release(s.prefix);
  s.prefix.clear();
  if (s.context_entry >= 0 && cache_.context_cache()) cache_.context_cache()->release(s.context_entry);
  s.context_entry = -1;
  for (auto& c : s.copies) cache_.drop(c);
  s.copies.clear();
}

void PagedKvMemory::trim_window(int64_t seq_id, int64_t ll) {
  const int64_t w = windows_.empty() ? 0 : windows_[static_cast<size_t>(ll)];
  if (w == 0) return;
  // The next query (at the layer's end position) sees the last w - 1 slots besides its own: whole
  // blocks before those are dead. Slots are positions here (local layers are never compressed).
  const int64_t dead = cache_.length(seq_id, ll) - (w - 1);
  if (dead >= cache_.block_size()) cache_.drop_leading_blocks(seq_id, ll, dead / cache_.block_size());
}

void PagedKvMemory::apply_updates(int64_t seq_id) {
  SeqState& s = seqs_.at(seq_id);
  for (auto& [layer, kept] : s.selector->take_updates()) {
    // Earlier layers hold their positions in ascending order per head (a shorter head's padding,
    // -1, goes last for the search): find the surviving slots; past a head's count they are unused.
    auto held = cache_.positions(seq_id, local(layer)).to(kept.device());
    held = held.masked_fill(held < 0, std::numeric_limits<int64_t>::max());
    auto slots = torch::searchsorted(held, kept.to(torch::kInt64).contiguous());
    const std::vector<int64_t> counts = s.selector->head_counts(layer);
    if (!counts.empty()) slots = slots.clamp_max(std::max<int64_t>(0, held.size(1) - 1));
    cache_.compact(seq_id, local(layer), slots.to(torch::kCPU), counts);
  }
}

void PagedKvMemory::store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v) {
  SeqState& s = seqs_.at(seq_id);
  const int64_t KV = k.size(0), T = k.size(1);
  const int64_t ll = local(layer);
  if (ll == 0 && shard_.first_layer > 0 && s.selector && s.selector->is_dynamic()) receive_earlier_scores(seq_id);
  const bool compresses = s.selector && s.selector->compresses();
  if (!compresses || s.policy->scores_after_prefill() || windowed(ll)) {
    // Reconstruction scoring selects after the whole prompt's pass (select_by_scores); a local layer
    // keeps every position (its window is its budget).
    auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kInt64)).unsqueeze(0).expand({KV, T});
    cache_.write(seq_id, ll, k, v, pos);
    // With a prefix cache the prompt's full blocks are published at end_prefill first; a local layer
    // of a prompt awaiting reconstruction scores holds its prompt for that pass (trimmed at end_prefill).
    if (!prefix_caching() && !(compresses && s.policy->scores_after_prefill())) trim_window(seq_id, ll);
    if (!compresses && s.draft_selector && !windowed(ll)) draft_select(seq_id, layer, q, k);
    if (compresses) {
      copy_for_cache(seq_id, ll, k, v);
      s.awaiting_scores = s.policy->scores_after_prefill();
      if (s.awaiting_scores && rounds_kv_) {
        s.pending_kv.resize(static_cast<size_t>(num_layers_));
        s.pending_kv[static_cast<size_t>(ll)] = {k.clone(), v.clone()};
      }
    }
    return;
  }
  torch::Tensor kept = s.selector->on_layer(layer, scorer_queries(*s.policy, q), k);  // [KV, n] ascending positions
  copy_for_cache(seq_id, ll, k, v);
  write_kept(seq_id, ll, k, v, kept, s.selector->last_head_counts());
  apply_updates(seq_id);
}

void PagedKvMemory::write_kept(int64_t seq_id, int64_t ll, const torch::Tensor& kf, const torch::Tensor& vf,
                               const torch::Tensor& kept, const std::vector<int64_t>& counts) {
  const int64_t KV = kf.size(0), D = kf.size(2);
  auto idx = kept.to(kf.device()).unsqueeze(-1).expand({KV, kept.size(1), D});
  cache_.write(seq_id, ll, kf.gather(1, idx), vf.gather(1, idx), kept, counts);
}

torch::Tensor PagedKvMemory::scorer_queries(const PolicyConfig& cfg, const torch::Tensor& q) const {
  if (!shard_.exchange->gathers_queries() || !scorer_needs_queries(cfg.scorer)) return q;
  // Window scorers read only the window's queries: gather just those rows.
  const int64_t T = q.size(1);
  const bool all_rows = cfg.scorer == ScorerKind::kAccumulatedAttention;
  const int64_t rows = all_rows ? T : std::min<int64_t>(cfg.window, T);
  return shard_.exchange->gather_queries(q.narrow(1, T - rows, rows).contiguous());
}

torch::Tensor PagedKvMemory::as_stored(int64_t seq_id, const torch::Tensor& x) const {
  if (!rounds_kv_) return x;
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end(), "prefill: sequence " << seq_id << " has no KV state");
  if (it->second.selector && it->second.selector->compresses()) return x;
  return cache_.round_trip(x);
}

EarlierKv PagedKvMemory::prefill_context(int64_t seq_id, int64_t layer) {
  KV_CHECK(seqs_.count(seq_id), "chunked prefill: sequence " << seq_id << " has no KV state");
  const SeqState& s = seqs_.at(seq_id);
  const auto ll = static_cast<size_t>(local(layer));
  if (ll < s.pending_kv.size() && s.pending_kv[ll].first.defined()) return {s.pending_kv[ll].first, s.pending_kv[ll].second, {}};
  auto [k, v, lengths] = cache_.gather_padded(seq_id, local(layer));
  return {std::move(k), std::move(v), std::move(lengths)};
}

// ---------------------------------------------------------------------------------------------------
// compressed contexts

void PagedKvMemory::enable_context_cache(uint64_t salt) {
  cache_.enable_context_cache();
  context_salt_ = salt;
}

uint64_t PagedKvMemory::context_key(const PolicyConfig& cfg, std::span<const int64_t> context) const {
  // The policy's every parameter is part of the key: another budget or scorer keeps another set.
  uint64_t h = mix64(context_salt_ ^ 0x6b767a6970637478ULL);
  for (unsigned char c : to_json(cfg).dump()) h = mix64(h ^ c);
  h = mix64(h ^ static_cast<uint64_t>(context.size()));
  for (int64_t t : context) h = mix64(h ^ static_cast<uint64_t>(t));
  return h;
}

int64_t PagedKvMemory::begin_context(int64_t seq_id, std::span<const int64_t> context, int64_t prompt_len, bool lookup) {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end(), "context: sequence " << seq_id << " has no KV state");
  SeqState& s = it->second;
  const int64_t c = static_cast<int64_t>(context.size());
  KV_CHECK(c > 0 && c == s.prompt_len && c < prompt_len && s.tokens.empty() && s.context_prompt_len == 0,
           "context: sequence " << seq_id << " began a prefill of " << s.prompt_len << " tokens, not a context of " << c
                                << " tokens before a prompt of " << prompt_len);
  s.context.assign(context.begin(), context.end());
  s.context_prompt_len = prompt_len;
  CompressedContextCache* cc = cache_.context_cache();
  if (!lookup || !cc) return 0;
  s.queried = prompt_len;
  const int32_t e = cc->find(context_key(*s.policy, context), context);
  if (e < 0) return 0;
  cc->acquire(e);
  try {
    if (cc->on_host(e)) cache_.context_to_pool(e);
    cache_.adopt(seq_id, cc->tables(e));
  } catch (...) {
    cc->release(e);
    throw;
  }
  s.context_entry = e;
  // The context needs no prefill: the sequence is where its own compression would have left it.
  s.selector.reset();
  s.context.clear();
  s.hit = c;
  s.budgets = mean_head_lengths(cache_, seq_id);
  s.resumed = true;
  s.prompt_len = prompt_len;
  return c;
}

void PagedKvMemory::continue_prompt(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end() && it->second.context_prompt_len > 0 && !it->second.selector && !it->second.awaiting_scores,
           "context: sequence " << seq_id << " has no compressed context to continue");
  SeqState& s = it->second;
  if (s.queried > 0) s.queried = s.context_prompt_len;
  s.resumed = true;
  s.prompt_len = s.context_prompt_len;
}

void PagedKvMemory::publish_context(int64_t seq_id) {
  SeqState& s = seqs_.at(seq_id);
  CompressedContextCache* cc = cache_.context_cache();
  std::vector<int64_t> context = std::move(s.context);  // end_prefill leaves it empty either way
  if (!cc || context.empty()) return;
  const uint64_t key = context_key(*s.policy, context);
  if (cc->find(key, context) >= 0) return;  // cached meanwhile by another request
  std::vector<CompressedContextCache::Table> tables;
  try {
    tables = cache_.snapshot(seq_id);
  } catch (const KvError&) {
    return;  // no room for the copies of its last blocks: this context is simply not cached
  }
  const int64_t full = blocks_for_tokens(static_cast<int64_t>(context.size()), cache_.block_size()) * num_layers_ * cache_.lanes();
  const int32_t e = cc->insert(key, std::move(context), tables, full);
  if (e < 0) {
    for (auto& t : tables) cache_.drop(t.blocks);
    return;
  }
  cc->acquire(e);
  s.context_entry = e;
}

void PagedKvMemory::store_prefill_chunk(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& q,
                                        const torch::Tensor& k, const torch::Tensor& v) {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end(), "chunked prefill: sequence " << seq_id << " has no KV state");
  SeqState& s = it->second;
  const int64_t ll = local(layer), KV = k.size(0), T = k.size(1);
  const int64_t held = cache_.length(seq_id, ll);
  // A resumed conversation holds only what the earlier turns kept, all before the chunk; a local
  // layer only its window's blocks.
  const bool fewer = s.resumed || (!windows_.empty() && windows_[static_cast<size_t>(ll)] > 0);
  KV_CHECK(fewer ? held <= start : held == start, "chunked prefill: sequence " << seq_id << ", layer " << layer
                                                        << " holds " << held << " positions, the chunk starts at " << start);
  KV_CHECK(start + T <= s.prompt_len, "chunked prefill: chunk [" << start << ", " << start + T << ") past the prompt of "
                                                                   << s.prompt_len << " tokens");
  const bool last = start + T == s.prompt_len;
  const bool compresses = s.selector && s.selector->compresses();
  if (compresses) {
    KV_CHECK(chunkable(*s.policy), "policy '" << s.policy->name << "' (scorer " << to_string(s.policy->scorer)
                                              << ") cannot prefill in chunks; its prompts are prefilled whole");
    KV_CHECK(!rounds_kv_, "policy '" << s.policy->name << "' cannot prefill in chunks over a KV cache stored in another "
                                     << "dtype than the model computes (its selection would see rounded keys)");
  }
  if (!compresses || !last || windowed(ll)) {
    // Every position stays until the last chunk: as they are for `full`, for the selection otherwise
    // (a local layer's, for good: its window is its budget).
    auto pos = torch::arange(start, start + T, torch::TensorOptions().dtype(torch::kInt64)).unsqueeze(0).expand({KV, T});
    cache_.extend(seq_id, ll, k, v, pos);
    if (compresses && last && prefix_caching()) {
      // A compressing prompt's cache entries are copies of every layer's whole prompt; a local
      // layer still holds all of it here (with a prefix cache its ring is trimmed at end_prefill).
      auto [pk, pv] = cache_.gather(seq_id, ll);
      copy_for_cache(seq_id, ll, pk, pv);
    }
    if (!prefix_caching()) trim_window(seq_id, ll);
    const bool drafts = !compresses && s.draft_selector && !s.resumed;  // a draft policy's selection ends this prompt
    const PolicyConfig* scoring = compresses ? s.policy : drafts ? &*draft_policy_ : nullptr;
    if (scoring && !windowed(ll) && scorer_needs_queries(scoring->scorer)) {
      // The last chunk's window may reach back into this one: keep the latest `window` queries.
      if (s.query_tail.empty()) s.query_tail.resize(static_cast<size_t>(num_layers_));
      torch::Tensor& tail = s.query_tail[static_cast<size_t>(ll)];
      tail = tail.defined() ? torch::cat({tail, q}, 1) : q;
      const int64_t keep = std::min<int64_t>(scoring->window, tail.size(1));
      tail = tail.narrow(1, tail.size(1) - keep, keep).contiguous();
    }
    if (drafts && last && !windowed(ll)) {
      // The whole prompt's keys as the cache holds them; the draft view only proposes, so rounded
      // keys (a quantized pool) may steer it but never change what is verified.
      torch::Tensor qt;
      if (!s.query_tail.empty()) std::swap(qt, s.query_tail[static_cast<size_t>(ll)]);
      draft_select(seq_id, layer, qt, cache_.gather(seq_id, ll).first.to(k.scalar_type()));
    }
    return;
  }
  // The last chunk of a compressing policy: the whole prompt's keys (and the window's queries) as
  // one forward would hand them over, then the same selection as store_prefill.
  auto [pk, pv] = cache_.gather(seq_id, ll);
  const auto dt = k.scalar_type();
  torch::Tensor kf = torch::cat({pk.to(dt), k}, 1), vf = torch::cat({pv.to(dt), v}, 1);
  torch::Tensor qf = q;
  if (!s.query_tail.empty() && s.query_tail[static_cast<size_t>(ll)].defined()) {
    qf = torch::cat({s.query_tail[static_cast<size_t>(ll)].to(q.scalar_type()), q}, 1);
    s.query_tail[static_cast<size_t>(ll)] = torch::Tensor();
  }
  if (ll == 0 && shard_.first_layer > 0 && s.selector->is_dynamic()) receive_earlier_scores(seq_id);
  torch::Tensor kept = s.selector->on_layer(layer, scorer_queries(*s.policy, qf), kf);  // [KV, n] ascending positions
  copy_for_cache(seq_id, ll, kf, vf);
  write_kept(seq_id, ll, kf, vf, kept, s.selector->last_head_counts());
  apply_updates(seq_id);
}

const PolicyConfig* PagedKvMemory::pending_selection(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it != seqs_.end() && it->second.awaiting_scores ? it->second.policy : nullptr;
}

const PolicyConfig* PagedKvMemory::prefill_policy(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it != seqs_.end() && it->second.selector && it->second.selector->compresses() ? it->second.policy : nullptr;
}

void PagedKvMemory::record_scores(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& scores) {
  SeqState& s = seqs_.at(seq_id);
  const int64_t ll = local(layer);
  if (s.recorded.empty()) s.recorded.resize(static_cast<size_t>(num_layers_));
  auto& pieces = s.recorded[static_cast<size_t>(ll)];
  int64_t have = 0;
  for (const auto& p : pieces) have += p.size(1);
  KV_CHECK(start == have && scores.dim() == 2 && scores.size(0) == cache_.num_kv_heads(),
           "record_scores: sequence " << seq_id << " layer " << layer << ": scores " << scores.sizes() << " at position "
                                      << start << " after " << have << " recorded, for " << cache_.num_kv_heads()
                                      << " KV heads");
  pieces.push_back(scores.to(torch::kFloat32));
}

std::vector<torch::Tensor> PagedKvMemory::take_scores(int64_t seq_id) {
  SeqState& s = seqs_.at(seq_id);
  KV_CHECK(static_cast<int64_t>(s.recorded.size()) == num_layers_,
           "take_scores: sequence " << seq_id << " has no predicted scores recorded");
  std::vector<torch::Tensor> out;
  for (auto& pieces : s.recorded) {
    KV_CHECK(!pieces.empty(), "take_scores: sequence " << seq_id << " misses a layer's predicted scores");
    out.push_back(pieces.size() == 1 ? pieces[0] : torch::cat(pieces, 1));
  }
  s.recorded.clear();
  return out;
}

torch::Tensor PagedKvMemory::reconstruction_queries(const torch::Tensor& q) {
  return shard_.exchange->gathers_queries() ? shard_.exchange->gather_queries(q.contiguous()) : q;
}

void PagedKvMemory::select_by_scores(int64_t seq_id, const std::vector<torch::Tensor>& scores) {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end() && it->second.awaiting_scores,
           "select_by_scores: sequence " << seq_id << " has no prefill awaiting reconstruction scores");
  SeqState& s = it->second;
  const PolicyConfig& cfg = *s.policy;
  KV_CHECK(static_cast<int64_t>(scores.size()) == num_layers_,
           "select_by_scores: " << scores.size() << " layers of scores for " << num_layers_ << " layers");
  const int64_t w = std::min(cfg.window, s.prompt_len);
  // Each layer holds its whole prompt (store_prefill): it is rewritten in place with its selection.
  auto rewrite = [&](int64_t ll, const torch::Tensor& kept, const std::vector<int64_t>& counts) {
    const auto i = static_cast<size_t>(ll);
    if (i < s.pending_kv.size() && s.pending_kv[i].first.defined()) {
      const auto held = std::move(s.pending_kv[i]);
      s.pending_kv[i] = {};
      write_kept(seq_id, ll, held.first, held.second, kept, counts);
      return;
    }
    auto [kf, vf] = cache_.gather(seq_id, ll);
    write_kept(seq_id, ll, kf, vf, kept, counts);
  };
  if (cfg.allocator == AllocatorKind::kGlobal) {
    // One top-k over every global layer and KV head of the model (a sliding-window layer keeps its
    // window): a shard gathers everyone's scores, makes the one selection every shard makes, and
    // keeps its own layers' and heads' part of it.
    const std::vector<torch::Tensor> all = shard_.exchange->gather_all_layers(scores);
    KV_CHECK(static_cast<int64_t>(all.size()) == shard_.total_layers,
             "internal: " << all.size() << " layers of gathered scores for " << shard_.total_layers);
    std::vector<torch::Tensor> global;
    std::vector<int64_t> place(static_cast<size_t>(shard_.total_layers), -1);  // model layer -> index in global
    for (int64_t l : cfg.global_layers(shard_.total_layers)) {
      place[static_cast<size_t>(l)] = static_cast<int64_t>(global.size());
      global.push_back(all[static_cast<size_t>(l)]);
    }
    const int64_t model_kv = all[0].size(0);
    const int64_t total = global_kept_total(cfg, static_cast<int64_t>(global.size()), model_kv, s.prompt_len);
    const auto sels = global_head_selection(global, total, w, 0, -1, shard_.exchange->first_kv_head(), cache_.num_kv_heads());
    for (int64_t ll = 0; ll < num_layers_; ++ll) {
      const int64_t g = place[static_cast<size_t>(shard_.first_layer + ll)];
      if (g < 0) continue;
      const HeadSelection& sel = sels[static_cast<size_t>(g)];
      rewrite(ll, sel.positions, sel.counts);
    }
  } else {
    for (int64_t ll = 0; ll < num_layers_; ++ll) {
      if (windowed(ll)) continue;
      torch::Tensor kept = s.selector->on_layer_scores(shard_.first_layer + ll, scores[static_cast<size_t>(ll)]);
      rewrite(ll, kept, s.selector->last_head_counts());
      apply_updates(seq_id);
    }
  }
  s.pending_kv.clear();
  s.awaiting_scores = false;  // the local layers held their prompts for the pass: end_prefill trims them
}

void PagedKvMemory::end_prefill(int64_t seq_id) {
  SeqState& s = seqs_.at(seq_id);
  KV_CHECK(!s.awaiting_scores, "policy '" << s.policy->name << "': sequence " << seq_id << " ends its prefill without "
                                          << "the reconstruction pass its scorer needs");
  const bool compressed = s.selector && s.selector->compresses();
  if (s.selector && s.selector->is_dynamic()) finish_dynamic(seq_id);
  settle(seq_id);
  if (!s.resumed) {
    publish_prefix(seq_id, compressed);
    // A context its policy kept whole (a budget above its length) is the prefix cache's already:
    // its blocks went there as they are.
    if (compressed) publish_context(seq_id);
    s.context.clear();
  }
  for (int64_t ll = 0; ll < num_layers_; ++ll) trim_window(seq_id, ll);
  // The draft view is chosen (a refresh makes a selector of its own): the prompt's scores can go.
  s.draft_selector.reset();
}

void PagedKvMemory::park(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  KV_CHECK(it != seqs_.end() && !it->second.selector && it->second.tokens.empty(),
           "park: sequence " << seq_id << " has no finished prefill");
  it->second.parked = true;
}

bool PagedKvMemory::parked(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it != seqs_.end() && it->second.parked;
}

int64_t PagedKvMemory::resume_parked(int64_t seq_id, ResumeFrom from, int64_t prompt_len) {
  auto it = seqs_.find(from.seq_id);
  KV_CHECK(it != seqs_.end() && it->second.parked, "resume: sequence " << from.seq_id << " is not parked");
  SeqState& fresh = seqs_.at(seq_id);
  KV_CHECK(it->second.policy == fresh.policy, "resume: sequence " << from.seq_id << " was kept under policy '"
                                                  << it->second.policy->name << "', not '" << fresh.policy->name << "'");
  KV_CHECK(from.length > 0 && from.length < prompt_len && prompt_len == fresh.prompt_len,
           "resume: " << from.length << " parked positions for a prompt of " << prompt_len);
  for (int64_t l = 0; l < num_layers_; ++l) {
    KV_CHECK(cache_.length(from.seq_id, l) <= from.length, "resume: sequence " << from.seq_id << " holds "
                                                               << cache_.length(from.seq_id, l) << " positions in layer "
                                                               << shard_.first_layer + l << ", more than " << from.length);
  }
  // The parked state (its tables, prefix-cache references and decode evictors) becomes this
  // sequence's; the new positions are appended whole after the kept ones, and none of this prompt
  // goes into the prefix cache (its blocks are not the full prompt's).
  SeqState s = std::move(it->second);
  seqs_.erase(it);
  cache_.release(seq_id);
  cache_.rename_sequence(from.seq_id, seq_id);
  s.parked = false;
  s.resumed = true;
  s.prompt_len = prompt_len;
  s.tokens.clear();
  s.keep_copy = false;
  s.queried = prompt_len;
  s.hit = from.length;
  seqs_[seq_id] = std::move(s);
  return from.length;
}

void PagedKvMemory::receive_earlier_scores(int64_t seq_id) {
  SeqState& s = seqs_.at(seq_id);
  const LayerScores earlier = shard_.exchange->receive_scores();
  for (size_t i = 0; i < earlier.layers.size(); ++i) {
    s.selector->replay_layer(earlier.layers[i], earlier.scores[static_cast<int64_t>(i)]);
    apply_updates(seq_id);
  }
}

LayerScores PagedKvMemory::scores_so_far(int64_t seq_id) const {
  const PrefillSelector& sel = *seqs_.at(seq_id).selector;
  LayerScores out;
  std::vector<torch::Tensor> scores;
  for (int64_t l = 0; l < shard_.first_layer + num_layers_; ++l) {
    if (sel.layer_budgets()[static_cast<size_t>(l)].full) continue;
    out.layers.push_back(l);
    scores.push_back(sel.layer_scores(l));
  }
  if (!scores.empty()) out.scores = torch::stack(scores);
  return out;
}

void PagedKvMemory::finish_dynamic(int64_t seq_id) {
  PrefillSelector& sel = *seqs_.at(seq_id).selector;
  std::vector<int64_t> final_budgets;
  if (last_shard()) {
    sel.finish();
    final_budgets = sel.dynamic_budgets();
  } else {
    shard_.exchange->send_scores(scores_so_far(seq_id));
  }
  if (holds_every_layer()) return;
  // The last shard alone saw every layer's scores: its final budgets settle the earlier shards.
  final_budgets = shard_.exchange->agree_final_budgets(final_budgets);
  if (!last_shard()) sel.apply_final_budgets(final_budgets);
}

void PagedKvMemory::settle(int64_t seq_id) {
  SeqState& s = seqs_.at(seq_id);
  // The rest of a prompt after its compressed context keeps the budgets the context settled.
  if (s.context_prompt_len > 0 && s.resumed && !s.selector && !s.budgets.empty()) return;
  s.budgets.clear();
  if (s.selector) {
    apply_updates(seq_id);
    // Head-adaptive, a layer's heads keep different counts: its budget is the allocator's per-head
    // share (their mean), the same on every shard whichever heads it holds.
    if (s.policy->allocator == AllocatorKind::kGlobal && s.selector->compresses()) {
      // One top-k over every layer: a layer's budget is what its heads keep on average, over every
      // KV head of the model (TP shards gather each other's lengths), the same on every shard.
      // (One process: gather_scores hands back its own.)
      for (int64_t ll = 0; ll < num_layers_; ++ll) {
        const auto lens = cache_.head_lengths(seq_id, ll);
        auto mine = torch::tensor(lens, torch::kInt64).view({-1, 1}).to(cache_.pool().device());
        const auto all = shard_.exchange->gather_scores(shard_.first_layer + ll, mine).to(torch::kCPU);
        s.budgets.push_back(all.sum().item<int64_t>() / all.size(0));
      }
    } else if (s.policy->head_adaptive() && s.selector->compresses()) {
      const auto all = s.selector->budgets();
      s.budgets.assign(all.begin() + shard_.first_layer, all.begin() + shard_.first_layer + num_layers_);
    }
    s.selector.reset();
  }
  s.query_tail.clear();
  if (s.budgets.empty())
    for (int64_t l = 0; l < num_layers_; ++l) s.budgets.push_back(cache_.length(seq_id, l));
}

int64_t PagedKvMemory::local(int64_t layer) const {
  const int64_t l = layer - shard_.first_layer;
  KV_CHECK(l >= 0 && l < num_layers_, "layer " << layer << " is not held by this KV shard [" << shard_.first_layer << ", "
                                               << shard_.first_layer + num_layers_ << ")");
  return l;
}

void PagedKvMemory::begin_decode(const DecodeBatch& batch, int64_t padded_rows) {
  // Decode-time eviction runs once per decode_evict_chunk tokens for sequences whose policy evicts.
  // Each layer's eviction reads only that layer's cache, which this step has not touched yet, so
  // running them all before the step keeps what evicting layer by layer would, and its peak block
  // count is no higher (decode_demand's bound holds).
  for (size_t b = 0; b < batch.seq_ids.size(); ++b) {
    const int64_t id = batch.seq_ids[b];
    const bool repeated = b > 0 && batch.seq_ids[b - 1] == id;  // a speculative step's later token
    auto it = seqs_.find(id);
    KV_CHECK(it != seqs_.end(), "decode: sequence " << id << " has no KV state");
    SeqState& s = it->second;
    // Eviction picks its victims at a given length: tokens a speculation may reject would move it.
    KV_CHECK(!repeated || s.evictors.empty(),
             "decode: sequence " << id << " evicts during decode and cannot verify several tokens in one step");
    // A draft step's slots are truncated before the step that verifies it, whose rows may need what
    // a window left behind at the draft's later positions: nothing is evicted or dropped for it.
    if (!repeated && batch.view.active() && s.draft_live && batch.positions[b] - s.draft_chosen_at >= draft_refresh_)
      rescore_draft_view(id, batch.positions[b]);  // the draft step's token sits at the cache's length
    if (repeated || batch.drafting()) continue;
    for (int64_t ll = 0; ll < static_cast<int64_t>(s.evictors.size()); ++ll) {
      const DecodeEvictor& ev = s.evictors[static_cast<size_t>(ll)];
      if (!ev.needs_eviction(cache_.length(id, ll) + 1)) continue;
      auto [keys, values] = cache_.gather(id, ll);
      cache_.compact(id, ll, ev.select(cache_.positions(id, ll), keys).to(torch::kCPU));
    }
    // Local layers drop the block the window left before this step can take a new one.
    for (int64_t ll = 0; ll < static_cast<int64_t>(windows_.size()); ++ll) trim_window(id, ll);
  }
  cache_.begin_decode(batch.seq_ids, batch.positions, padded_rows, batch.view);
}

torch::Tensor PagedKvMemory::decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                              const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t ll = local(layer);
  if (!cache_.decode_planned(batch.seq_ids, ll, batch.view)) begin_decode(batch);
  if (draft_refresh_ > 0 && !batch.drafting() && q.device().is_cpu()) record_draft_queries(ll, batch, q);
  return cache_.decode_layer(ll, q, k, v, -1.0, windows_.empty() ? 0 : windows_[static_cast<size_t>(ll)]);
}

void PagedKvMemory::reset_caches() {
  cache_.drop_cached();
  cache_.reset_high_water();
}

void PagedKvMemory::truncate(int64_t seq_id, int64_t n) {
  KV_CHECK(seqs_.count(seq_id) && cache_.has_sequence(seq_id), "truncate: sequence " << seq_id << " has no KV state");
  SeqState& s = seqs_.at(seq_id);
  if (s.draft_live && !s.draft_tail.empty()) {
    // Rejected rows' queries go with them; a draft step's rows (past the recorded ones) had none.
    int64_t len = 0;
    for (int64_t ll = 0; ll < num_layers_ && len == 0; ++ll)
      if (!windowed(ll)) len = cache_.length(seq_id, ll);
    const int64_t drop = std::max<int64_t>(0, s.draft_tail_end - (len - n));
    for (auto& t : s.draft_tail)
      if (t.defined()) t = t.narrow(1, 0, std::max<int64_t>(0, t.size(1) - drop)).contiguous();
    s.draft_tail_end -= drop;
  }
  cache_.truncate_last(seq_id, n);
}

void PagedKvMemory::release(int64_t seq_id) {
  drop_prefix(seq_id);
  if (cache_.has_sequence(seq_id)) cache_.release(seq_id);
  seqs_.erase(seq_id);
}

}  // namespace kvserve
