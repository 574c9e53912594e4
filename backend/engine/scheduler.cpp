#include "backend/engine/scheduler.h"

#include <algorithm>

#include "backend/spec_decode/draft_verifier.h"
#include "backend/spec_decode/ngram_proposer.h"
#include "common/check.h"
#include "common/log.h"

namespace kvserve {

std::vector<std::unique_ptr<Sequence>> Scheduler::take_if(const std::function<bool(const Sequence&)>& pred) {
  std::vector<std::unique_ptr<Sequence>> out;
  auto sweep = [&](auto& list) {
    for (auto& s : list) {
      if (s && pred(*s)) {
        drop_later(*s);
        out.push_back(std::move(s));
      }
    }
    list.erase(std::remove(list.begin(), list.end(), nullptr), list.end());
  };
  sweep(running_);
  sweep(waiting_);
  return out;
}

const Sequence* Scheduler::running(int64_t seq_id) const {
  auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& s) { return s->id == seq_id; });
  return it == running_.end() ? nullptr : it->get();
}

std::unique_ptr<Sequence> Scheduler::finish(int64_t seq_id, bool completed) {
  auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& s) { return s->id == seq_id; });
  KV_CHECK(it != running_.end(), "internal: sequence " << seq_id << " is not running");
  std::unique_ptr<Sequence> s = std::move(*it);
  running_.erase(it);
  // Parked only when its prefill compressed something: an uncompressed prompt's blocks are in the
  // prefix cache already (exactly), shared with it, and a parked sequence must hold only its own.
  drop_later(*s, completed && !s->prefilling() && reuses_compressed(*s) && s->kept_kv < s->full_kv);
  return s;
}

bool Scheduler::reuses_compressed(const Sequence& s) const {
  const PolicyConfig& cfg = options_.policies.at(s.req.kv_policy);
  // A head-adaptive policy's heads hold different lengths, which a resumed turn's chunk cannot
  // attend to yet: its requests are served by the exact prefix cache instead.
  return !cfg.is_full() && !cfg.head_adaptive() && s.req.reuse_compressed.value_or(cfg.reuse_compressed);
}

int64_t Scheduler::max_drafts(const Sequence& s) const {
  if (!s.req.speculative) return 0;
  const int64_t most = options_.speculative.num_speculative_tokens;
  return s.req.max_draft_tokens >= 0 ? std::min(most, s.req.max_draft_tokens) : most;
}

bool Scheduler::may_draft(const Sequence& s) const {
  // Policies that evict during decode pick victims by length: their sequences decode plainly. A
  // conversation's turns (parked and resumed KV, prefix_reuse: compressed) draft like any other
  // sequence: the KV is trimmed to the fed tokens before it is parked (drop_later), and a resumed
  // turn's self-drafts read the sinks and window of the rows it holds (its prompt compressed, so no
  // draft policy's selection is made for it).
  return max_drafts(s) > 0 && options_.policies.at(s.req.kv_policy).decode_budget == 0;
}

const ConversationCache::Entry* Scheduler::resumable(const Sequence& s, const std::vector<int64_t>& prompt) const {
  // A request's first prefill only (a preempted one recomputes exactly), and never when every
  // prompt position's logits are asked for.
  if (!reuses_compressed(s) || !s.output.empty() || s.req.sampling.prompt_logprobs >= 0) return nullptr;
  return parked_.find(prompt, s.req.kv_policy);
}

void Scheduler::drop_later(Sequence& s, bool park) {
  if (s.in_cache && park) {
    while (parked_.size() >= std::max<int64_t>(1, options_.max_parked_conversations)) {
      const int64_t oldest = *parked_.oldest();
      parked_.erase(oldest);
      // Freed instead (not parked at all if the plan that parks it has not gone out yet); its
      // books go when the plan's releases are read.
      if (auto p = std::find(park_.begin(), park_.end(), oldest); p != park_.end()) park_.erase(p);
      release_.push_back(oldest);
    }
    // A verify step may have kept K/V for tokens past where a stop string, EOS or max_tokens ended
    // the output: they go before the KV is parked, which must hold exactly the tokens it is filed
    // under (the plan truncates before it parks).
    const std::vector<int64_t> fed = s.prefill_tokens();
    if (s.kv_end > 0) {
      const int64_t surplus = s.kv_end - static_cast<int64_t>(fed.size());
      KV_CHECK(surplus >= 0, "internal: sequence " << s.id << " holds KV up to " << s.kv_end << " for " << fed.size()
                                                   << " fed tokens");
      if (surplus > 0) truncate_.push_back({s.id, surplus});
    }
    park_.push_back(s.id);
    parked_.park(s.id, fed, s.req.kv_policy);
  } else if (s.in_cache) {
    release_.push_back(s.id);
  }
  if (s.sampler_added) remove_.push_back(s.id);
  s.in_cache = false;
  s.sampler_added = false;
}

int64_t resolve_long_prefill_token_threshold(int64_t configured, bool cuda) {
  if (configured >= 0) return configured;
  return cuda ? 0 : kAutoLongPrefillTokensCpu;
}

std::optional<std::string> Scheduler::unfit_reason(int64_t n, const std::string& policy) const {
  const PolicyConfig& cfg = options_.policies.at(policy);
  for (const Pool& p : shards_) {
    // Copies for the prefix cache are optional (admission leaves them out when they do not fit).
    if (PagedKvMemory::prompt_blocks(cfg, p.usage.geometry, n) * p.usage.units(policy) > p.usage.blocks_total)
      return "the request needs more KV cache than the whole pool holds (" + std::to_string(n) +
             " tokens); raise cache.kv_cache_bytes or use a compressing kv_policy";
  }
  return std::nullopt;
}

int64_t Scheduler::context_len(const Sequence& s, int64_t n) const {
  const int64_t c = s.req.context_len;
  if (!options_.compressed_contexts || c <= 0 || c >= n || s.req.sampling.prompt_logprobs >= 0) return 0;
  // A conversation turn (prefix_reuse: compressed) continues its parked KV, which already covers
  // any context; a context entry pinned beside it would be held past the conversation's end.
  if (reuses_compressed(s)) return 0;
  const PolicyConfig& cfg = options_.policies.at(s.req.kv_policy);
  return !cfg.is_full() && cfg.compress_context ? c : 0;
}

bool Scheduler::may_chunk(int64_t n, const std::string& policy) const {
  if (!options_.enable_chunked_prefill) return false;
  const PolicyConfig& cfg = options_.policies.at(policy);
  if (!PagedKvMemory::chunkable(cfg)) return false;
  // A compressing policy holds the whole uncompressed prompt until its last chunk: where a pool
  // cannot hold that, the prompt is prefilled whole (at its compressed peak) instead.
  for (const Pool& p : shards_) {
    if (!cfg.is_full() && p.usage.geometry.rounds_kv) return false;  // see Geometry::rounds_kv
    if (PagedKvMemory::prompt_blocks(cfg, p.usage.geometry, n, true) * p.usage.units(policy) > p.usage.blocks_total)
      return false;
  }
  return true;
}

int64_t Scheduler::reserved(const Sequence& s, size_t i) const {
  const Pool& p = shards_[i];
  const PolicyConfig& cfg = options_.policies.at(s.req.kv_policy);
  int64_t peak = PagedKvMemory::prompt_blocks(cfg, p.usage.geometry, s.prefill_len, true);
  if (s.keep_copy) peak += PagedKvMemory::prefix_copy_blocks(cfg, p.usage.geometry, s.prefill_len);
  peak *= p.usage.units(s.req.kv_policy);
  auto h = p.held.find(s.id);
  return std::max<int64_t>(0, peak - (h == p.held.end() ? 0 : h->second));
}

void Scheduler::plan_chunk(Sequence& s, int64_t budget, StepPlan& plan) const {
  const auto tokens = s.prefill_tokens();
  KV_CHECK(static_cast<int64_t>(tokens.size()) == s.prefill_len,
           "internal: sequence " << s.id << " changed its prompt while prefilling in chunks");
  const int64_t start = s.prefill_done, n = std::min(budget, s.prefill_len - start);
  PrefillWork w;
  w.seq_id = s.id;
  w.tokens.assign(tokens.begin() + start, tokens.begin() + start + n);
  w.policy = s.req.kv_policy;
  w.start = start;
  w.prompt_len = s.prefill_len;
  w.sample = s.output.empty() && w.last_chunk();  // only the last chunk has the next token's logits
  w.ban_eos = s.ban_eos();
  w.keep_copy = s.keep_copy;
  // A whole compressing prompt pins the cached blocks it takes until its end; its reservation
  // covers them only with the copies' (hit blocks + copied blocks <= the prompt's full blocks).
  // Chunked, its peak counts every position of every layer, the cached ones too.
  w.reuse_prefix = w.chunked() || options_.policies.at(s.req.kv_policy).is_full() || s.keep_copy;
  w.context_len = context_len(s, s.prefill_len);
  w.drafts = options_.speculative.enabled() && may_draft(s);
  plan.prefill.push_back(std::move(w));
  s.prefill_done = start + n;
}

std::optional<std::chrono::steady_clock::time_point> Scheduler::oldest_waiting_arrival() const {
  std::optional<std::chrono::steady_clock::time_point> oldest;
  for (const auto& s : waiting_)
    if (!s->scheduled && (!oldest || s->arrival < *oldest)) oldest = s->arrival;
  return oldest;
}

std::vector<int64_t> Scheduler::propose(const Sequence& s, int64_t k) const {
  const SpeculativeConfig& c = options_.speculative;
  // Self-drafts and a draft model's are made by the runner at the step (StepPlan::self_draft,
  // model_draft): placeholders here.
  if (c.runner_drafts()) return std::vector<int64_t>(static_cast<size_t>(k), -1);
  return propose_ngram(s.req.prompt_ids, s.output, k, c.prompt_lookup_min, c.prompt_lookup_max);
}

StepPlan Scheduler::schedule(std::vector<Rejected>* rejected) {
  KV_CHECK(knows_pools(), "internal: the scheduler plans from a first StepResult");
  StepPlan plan;
  plan.truncate.swap(truncate_);
  plan.release.swap(release_);
  plan.remove.swap(remove_);
  plan.park.swap(park_);

  // Room per shard once this plan's releases ran.
  const size_t S = shards_.size();
  std::vector<KvRoom> room(S);
  auto forget = [&](int64_t id) {
    for (size_t i = 0; i < S; ++i) {
      Pool& p = shards_[i];
      auto f = p.format.find(id);
      auto h = p.held.find(id);
      if (h != p.held.end()) room[i].give(f == p.format.end() ? 0 : f->second, h->second), p.held.erase(h);
      if (f != p.format.end()) p.format.erase(f);
      p.demand.erase(id);
    }
  };
  for (size_t i = 0; i < S; ++i) room[i] = shards_[i].usage.room();
  for (int64_t id : plan.release) forget(id);
  // A parked conversation goes (oldest first) before anything waits or is preempted for its room.
  auto evict_parked = [&] {
    const auto id = parked_.oldest();
    if (!id) return false;
    parked_.erase(*id);
    // One that finished last step is parked by this very plan: it is released instead (the shards
    // release before they park, so both would leave them parking a sequence that is gone).
    if (auto p = std::find(plan.park.begin(), plan.park.end(), *id); p != plan.park.end()) plan.park.erase(p);
    plan.release.push_back(*id);
    forget(*id);
    return true;
  };

  // Decode first: every running sequence advances one token. Preempt (recompute later) the most
  // recently admitted sequences while some shard cannot hold one more token for each. A prompt still
  // being prefilled in chunks does not decode yet; it keeps the rest of its peak reserved instead.
  // By KV format: a format's demand can only shrink by preempting its own sequences.
  auto demand = [&](size_t i) {
    std::vector<int64_t> d(shards_[i].usage.num_formats(), 0);
    for (const auto& s : running_) {
      int64_t& df = d.at(shards_[i].format_of(*s));
      if (s->prefilling()) {
        df += reserved(*s, i);
        continue;
      }
      auto it = shards_[i].demand.find(s->id);
      if (it != shards_[i].demand.end()) df += it->second;
    }
    return d;
  };
  // The most recently admitted sequence whose preemption helps a shard that lacks room: one of a
  // format that needs more than its own room there (with one pool, the last one).
  auto victim_index = [&] {
    for (size_t i = 0; i < S; ++i) {
      const std::vector<int64_t> d = demand(i);
      if (room[i].fits(d)) continue;
      for (size_t k = running_.size(); k-- > 0;) {
        const size_t f = shards_[i].format_of(*running_[k]);
        if (room[i].draws_slabs(f, d[f])) return k;
      }
    }
    return running_.size() - 1;
  };
  auto decode_fits = [&] {
    for (size_t i = 0; i < S; ++i)
      if (!room[i].fits(demand(i))) return false;
    return true;
  };
  while (!running_.empty() && !decode_fits()) {
    if (evict_parked()) continue;
    const auto k = static_cast<std::ptrdiff_t>(victim_index());
    std::unique_ptr<Sequence> victim = std::move(running_[static_cast<size_t>(k)]);
    running_.erase(running_.begin() + k);
    forget(victim->id);
    plan.release.push_back(victim->id);
    victim->in_cache = false;
    victim->prefill_done = victim->prefill_len = 0;
    waiting_.push_front(std::move(victim));
    ++preemptions_;
  }
  for (size_t i = 0; i < S; ++i) {
    const std::vector<int64_t> d = demand(i);
    for (size_t f = 0; f < d.size(); ++f) room[i].take(f, d[f]);
  }
  // After a failed decode step its sequences decode alone, one per step, until each succeeds once:
  // a sequence that keeps failing then fails alone (the others wait meanwhile).
  auto suspect = std::find_if(running_.begin(), running_.end(), [](const auto& s) { return s->suspect; });
  // Speculative decoding: a sequence's drafts follow its last token as further rows, when every
  // shard has room for the blocks they may open (at most ceil(k / block_size) per layer and lane
  // beyond its one token's demand), before any prompt is admitted.
  const SpeculativeConfig& spec = options_.speculative;
  const auto decoding = std::count_if(running_.begin(), running_.end(), [](const auto& s) { return !s->prefilling(); });
  const bool speculate = spec.enabled() && suspect == running_.end() && decoding > 0 &&
                         (spec.disable_by_batch_size == 0 || decoding <= spec.disable_by_batch_size) &&
                         (!spec.auto_disable || governor_.allow(decoding));
  for (const auto& s : running_) {
    if (s->prefilling() || (suspect != running_.end() && s != *suspect)) continue;
    plan.decode.seq_ids.push_back(s->id);
    plan.decode.positions.push_back(s->next_position());
    plan.decode_tokens.push_back(s->output.back());
    plan.decode_ban_eos.push_back(s->ban_eos());
    if (!speculate || !may_draft(*s)) continue;
    const int64_t most = max_drafts(*s);
    const auto made = static_cast<int64_t>(s->output.size());
    const int64_t k = std::min(s->spec_k > 0 ? s->spec_k : most, s->req.sampling.max_tokens - made - 1);
    if (k <= 0 || (spec.self_draft() && s->next_position() < spec.min_context_tokens())) continue;
    if (s->spec_pause > 0) {
      --s->spec_pause;
      continue;
    }
    auto draft_blocks = [&](size_t i, int64_t n) {
      const auto& g = shards_[i].usage.geometry;
      return g.num_layers * g.lanes() * blocks_for_tokens(n, g.block_size) * shards_[i].usage.units(s->req.kv_policy);
    };
    bool fits = true;
    for (size_t i = 0; i < S; ++i) fits = fits && room[i].fits(shards_[i].format_of(*s), draft_blocks(i, k));
    if (!fits) continue;
    const std::vector<int64_t> draft = propose(*s, k);
    if (draft.empty()) continue;
    plan.model_draft = plan.model_draft || spec.loads_draft_model();
    if (spec.self_draft()) {
      const int64_t bs = shards_.front().usage.geometry.block_size;
      plan.self_draft = {blocks_for_tokens(spec.draft_sink_tokens, bs),
                         std::max<int64_t>(1, blocks_for_tokens(spec.draft_window_tokens, bs))};
    }
    for (size_t i = 0; i < S; ++i)
      room[i].take(shards_[i].format_of(*s), draft_blocks(i, static_cast<int64_t>(draft.size())));
    const int64_t min_tokens = s->req.sampling.ignore_eos ? 0 : s->req.sampling.min_tokens;
    for (size_t j = 0; j < draft.size(); ++j) {
      plan.decode.seq_ids.push_back(s->id);
      plan.decode.positions.push_back(s->next_position() + 1 + static_cast<int64_t>(j));
      plan.decode_tokens.push_back(draft[j]);
      plan.decode_ban_eos.push_back(made + 1 + static_cast<int64_t>(j) < min_tokens);
    }
  }

  // Prompts being prefilled in chunks go on first, in admission order, within the step's budget:
  // while sequences decode, the smaller of the two (decodes come first and stay cheap).
  const int64_t step_budget = !plan.decode.seq_ids.empty() && options_.long_prefill_token_threshold > 0
                                  ? std::min(options_.max_num_batched_tokens, options_.long_prefill_token_threshold)
                                  : options_.max_num_batched_tokens;
  int64_t prefilled = 0;
  for (const auto& s : running_) {
    if (!s->prefilling() || prefilled >= step_budget) continue;
    const int64_t before = s->prefill_done;
    plan_chunk(*s, step_budget - prefilled, plan);
    prefilled += s->prefill_done - before;
  }

  // Then admit waiting sequences in order while every shard holds them at their peak (compressed)
  // size, reserving what each admitted prompt takes.
  std::vector<int64_t> need(S), copies(S);
  while (!waiting_.empty() && static_cast<int64_t>(running_.size()) < options_.max_num_seqs) {
    Sequence& s = *waiting_.front();
    const auto tokens = s.prefill_tokens();
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (auto why = unfit_reason(n, s.req.kv_policy)) {
      drop_later(s);
      rejected->push_back({std::move(waiting_.front()), *why});
      waiting_.pop_front();
      continue;
    }
    const int64_t budget = step_budget - prefilled;
    // prompt_logprobs need every position's logits from one forward: such prompts run whole.
    // A prompt that may continue its conversation runs whole (the parked KV covers a prefix of it).
    // A prompt with a compressed context runs whole (the context is compressed on its own first).
    const int64_t context = context_len(s, n);
    const bool chunk = n > budget && s.req.sampling.prompt_logprobs < 0 && !reuses_compressed(s) && context == 0 &&
                       may_chunk(n, s.req.kv_policy);
    if (chunk ? budget <= 0 : prefilled > 0 && n > budget) break;
    const PolicyConfig& cfg = options_.policies.at(s.req.kv_policy);
    // A prompt that continues a parked conversation takes that KV over (already counted as used)
    // and adds its new positions whole to every layer.
    const ConversationCache::Entry* from = resumable(s, tokens);
    const int64_t resumed = from ? static_cast<int64_t>(from->tokens.size()) : 0;
    bool fits = true;
    for (size_t i = 0; i < S; ++i) {
      const auto& g = shards_[i].usage.geometry;
      need[i] = from      ? g.num_layers * (blocks_for_tokens(n - resumed + 1, g.block_size) + 1)
                : context ? PagedKvMemory::context_prompt_blocks(cfg, g, context, n)
                          : PagedKvMemory::prompt_blocks(cfg, g, n, chunk);
      // Cached blocks in use by others are shared, not taken (whole prompts only: a chunked one's
      // later reservations count its peak in its own blocks; one asking every position's logits
      // takes nothing from the cache).
      const bool shares = !from && !chunk && cfg.is_full() && s.req.sampling.prompt_logprobs < 0;
      if (S == 1 && shares && options_.shared_prefix_blocks) {
        if (auto shared = options_.shared_prefix_blocks(tokens, s.req.kv_policy, plan.release))
          need[i] = std::max<int64_t>(0, need[i] - *shared);
      }
      need[i] *= shards_[i].usage.units(s.req.kv_policy);
      fits = fits && room[i].fits(shards_[i].format_of(s), need[i]);
    }
    if (!fits && evict_parked()) continue;
    if (!fits) {
      ++kv_admission_waits_;
      break;
    }
    // A compressing policy's prompt also goes into the prefix cache, as a full-precision copy,
    // where every shard has room for it besides the prompt's peak.
    bool keep_copy = !from;
    for (size_t i = 0; i < S; ++i) {
      copies[i] = PagedKvMemory::prefix_copy_blocks(cfg, shards_[i].usage.geometry, context ? context : n) *
                  shards_[i].usage.units(s.req.kv_policy);
      keep_copy = keep_copy && room[i].fits(shards_[i].format_of(s), need[i] + copies[i]);
    }
    for (size_t i = 0; i < S; ++i) room[i].take(shards_[i].format_of(s), need[i] + (keep_copy ? copies[i] : 0));
    std::unique_ptr<Sequence> owned = std::move(waiting_.front());
    waiting_.pop_front();
    if (!owned->scheduled) {  // queue time ends at the first admission, not at a re-admission
      owned->scheduled = true;
      if (options_.on_queue_time)
        options_.on_queue_time(std::chrono::duration<double>(std::chrono::steady_clock::now() - owned->arrival).count());
    }
    if (!owned->sampler_added) {
      plan.start.push_back({owned->id, owned->req.sampling, owned->req.prompt_ids, owned->seed, options_.eos_ids});
      owned->sampler_added = true;
    }
    owned->in_cache = true;
    owned->keep_copy = keep_copy;
    owned->prefill_len = n;
    owned->prefill_done = 0;
    owned->kv_end = 0;
    plan_chunk(*owned, chunk ? budget : n, plan);
    if (from) {
      plan.prefill.back().resume = {from->seq_id, resumed};
      for (auto& p : shards_) p.held.erase(from->seq_id), p.demand.erase(from->seq_id);
      parked_.erase(from->seq_id);
    }
    prefilled += owned->prefill_done;
    running_.push_back(std::move(owned));
  }
  return plan;
}

std::vector<Scheduler::Output> Scheduler::update(const StepPlan& plan, StepResult result) {
  // The pools as the step left them, and each touched sequence's blocks there.
  if (shards_.size() != result.shards.size()) shards_.assign(result.shards.size(), Pool{});
  std::unordered_map<int64_t, Sequence*> by_id;
  for (auto& s : running_) by_id[s->id] = s.get();
  std::vector<int64_t> rows = plan.decode.seq_ids;
  for (const auto& p : plan.prefill) rows.push_back(p.seq_id);
  for (size_t i = 0; i < shards_.size(); ++i) {
    Pool& pool = shards_[i];
    pool.usage = std::move(result.shards[i]);
    for (size_t r = 0; r < rows.size(); ++r) {
      if (r < pool.usage.held.size()) pool.held[rows[r]] = pool.usage.held[r];
      if (r < pool.usage.demand.size()) pool.demand[rows[r]] = pool.usage.demand[r];
      if (auto s = by_id.find(rows[r]); s != by_id.end()) pool.format[rows[r]] = pool.format_of(*s->second);
    }
  }

  std::vector<Output> out;
  const size_t rows_decoded = plan.decode.seq_ids.size();
  if (rows_decoded > 0 && result.decode_error.empty() && options_.speculative.enabled()) {
    const auto seqs = static_cast<int64_t>(sequence_runs(plan.decode).first.size());
    governor_.record(seqs, static_cast<int64_t>(result.decoded.size()), result.decode_s,
                     seqs < static_cast<int64_t>(rows_decoded));
    spec_.pauses = governor_.pauses();
  }
  if (!result.decode_error.empty() && rows_decoded > 1) {
    // Which sequence failed is unknown, and the step may have written part of their KV: all of them
    // start over from a recompute (as after a preemption), then decode alone.
    KV_LOG("a decode step of " << rows_decoded << " sequences failed (" << result.decode_error
                               << "); recomputing them one by one");
    std::vector<std::unique_ptr<Sequence>> redo;
    for (size_t r = 0; r < rows_decoded; ++r) {
      const int64_t id = plan.decode.seq_ids[r];
      if (r > 0 && plan.decode.seq_ids[r - 1] == id) continue;  // a draft row of the sequence before
      auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& s) { return s->id == id; });
      std::unique_ptr<Sequence> s = std::move(*it);
      running_.erase(it);
      if (s->in_cache) release_.push_back(s->id);
      s->in_cache = false;
      s->suspect = true;
      redo.push_back(std::move(s));
    }
    preemptions_ += static_cast<int64_t>(redo.size());
    for (auto it = redo.rbegin(); it != redo.rend(); ++it) waiting_.push_front(std::move(*it));
  } else if (result.decode_error.empty() && !result.decode_counts.empty()) {
    // A speculative step: each sequence's run of rows emitted decode_counts[g] tokens (its accepted
    // drafts and one more); the KV of the rows past them goes in the next plan.
    size_t t = 0, g = 0;
    for (size_t r = 0; r < rows_decoded; ++g) {
      Sequence* s = by_id.at(plan.decode.seq_ids[r]);
      size_t rows = 1;
      while (r + rows < rows_decoded && plan.decode.seq_ids[r + rows] == s->id) ++rows;
      const int64_t m = result.decode_counts.at(g);
      KV_CHECK(m >= 1 && m <= static_cast<int64_t>(rows), "internal: sequence " << s->id << " emitted " << m
                                                                                  << " tokens from " << rows << " rows");
      s->suspect = false;
      for (int64_t j = 0; j < m; ++j) out.push_back({s, std::move(result.decoded.at(t++)), ""});
      s->kv_end = plan.decode.positions.at(r) + m;
      const int64_t drafts = static_cast<int64_t>(rows) - 1, accepted = m - 1;
      if (drafts > 0) {
        ++spec_.drafts;
        spec_.draft_tokens += drafts;
        spec_.accepted_tokens += accepted;
        if (static_cast<int64_t>(spec_.accepted_per_pos.size()) < drafts) spec_.accepted_per_pos.resize(drafts, 0);
        for (int64_t j = 0; j < accepted; ++j) ++spec_.accepted_per_pos[static_cast<size_t>(j)];
        if (drafts > accepted) truncate_.push_back({s->id, drafts - accepted});
        // γ adapts: up by two after a draft accepted whole, down by one otherwise; a single draft
        // rejected pauses drafting (4 steps, doubling up to 64 while it keeps failing), so a
        // sequence whose drafts miss decodes plainly instead of paying for drafts and verify rows.
        const int64_t most = max_drafts(*s);
        const int64_t k = s->spec_k > 0 ? s->spec_k : most;
        s->spec_k = accepted == drafts ? std::min(most, k + 2) : std::max<int64_t>(1, k - 1);
        if (accepted == drafts) {
          s->spec_backoff = 0;
        } else if (k == 1) {
          s->spec_backoff = std::min<int64_t>(64, s->spec_backoff > 0 ? 2 * s->spec_backoff : 4);
          s->spec_pause = s->spec_backoff;
        }
      }
      r += rows;
    }
  } else {
    for (size_t r = 0; r < rows_decoded; ++r) {
      Sequence* s = by_id.at(plan.decode.seq_ids[r]);
      if (!result.decode_error.empty()) {
        out.push_back({s, std::nullopt, result.decode_error});
      } else {
        s->suspect = false;
        s->kv_end = 0;
        out.push_back({s, std::move(result.decoded.at(r)), ""});
      }
    }
  }
  const int64_t layers = shards_.empty() ? 0 : shards_.front().usage.geometry.total_layers;
  for (size_t p = 0; p < plan.prefill.size(); ++p) {
    Sequence* s = by_id.at(plan.prefill[p].seq_id);
    PrefillOutcome& o = result.prefilled.at(p);
    if (plan.prefill[p].last_chunk()) {
      s->kept_kv = o.kept_tokens;
      s->kept_head_min = o.kept_head_min;
      s->kept_head_max = o.kept_head_max;
      s->kept_head_mean = o.head_tables ? static_cast<double>(o.kept_head_sum) / static_cast<double>(o.head_tables) : 0.0;
      s->full_kv = plan.prefill[p].total() * layers;
    }
    if (plan.prefill[p].start == 0 && o.error.empty()) {
      prefix_queries_ += o.queried_tokens;
      prefix_hits_ += o.cached_tokens;
      // A request reports its first prefill's hit (a recompute after a preemption is the engine's affair).
      if (!s->prefix_reported) {
        s->cached_tokens = std::min<int64_t>(o.cached_tokens, static_cast<int64_t>(s->req.prompt_ids.size()));
        s->prefix_reported = true;
      }
    }
    if (!o.error.empty()) out.push_back({s, std::nullopt, o.error});
    else if (o.first) out.push_back({s, std::move(o.first), ""});
  }
  return out;
}

KvUsage Scheduler::usage() const {
  KvUsage u;
  for (const Pool& p : shards_) {
    u.blocks_total += p.usage.blocks_total;
    u.blocks_used += p.usage.blocks_used;
    u.bytes_total += p.usage.blocks_total * p.usage.block_bytes;
    u.bytes_used += p.usage.blocks_used * p.usage.block_bytes;
    for (const auto& [dtype, bytes] : p.usage.bytes_used_by_dtype) u.bytes_used_by_dtype[dtype] += bytes;
    u.blocks_high_water += p.usage.blocks_high_water;
    u.blocks_cached += p.usage.blocks_cached;
    u.cached_bytes += p.usage.cached_bytes;
    u.host_cached_bytes += p.usage.host_cached_bytes;
    u.host_capacity_bytes += p.usage.host_capacity_bytes;
    u.host_stores += p.usage.host_stores;
    u.host_loads += p.usage.host_loads;
    // Every shard holds its part of the same contexts: counted once.
    u.context_entries = std::max(u.context_entries, p.usage.context_entries);
    u.context_blocks += p.usage.context_blocks;
    u.context_full_blocks += p.usage.context_full_blocks;
    u.context_bytes += p.usage.context_blocks * p.usage.block_bytes;
    for (int64_t id : parked_.seq_ids()) {
      if (auto h = p.held.find(id); h != p.held.end()) {
        u.blocks_parked += h->second;
        u.parked_bytes += h->second * p.usage.block_bytes;
      }
    }
  }
  u.conversations_parked = parked_.size();
  return u;
}

}  // namespace kvserve
