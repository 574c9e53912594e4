#include "backend/engine/model_runner.h"

#include <algorithm>
#include <chrono>

#include "backend/engine/decode_graphs.h"
#include "backend/model/decoder_model.h"
#include "backend/spec_decode/draft_model.h"
#include "backend/spec_decode/draft_verifier.h"
#include "backend/spec_decode/separate_kv_drafter.h"
#include "backend/spec_decode/self_drafter.h"
#include "common/log.h"

namespace kvserve {

LocalRunner::LocalRunner(std::shared_ptr<DecoderModel> model, std::unique_ptr<PagedKvMemory> kv, LocalRunnerOptions options)
    : LocalRunner(std::move(model), std::make_unique<MixedKvMemory>(std::move(kv)), options) {}

LocalRunner::LocalRunner(std::shared_ptr<DecoderModel> model, std::unique_ptr<MixedKvMemory> kv, LocalRunnerOptions options)
    : model_(std::move(model)), kv_(std::move(kv)),
      prefill_batch_tokens_(static_cast<size_t>(std::max<int64_t>(1, options.prefill_batch_tokens))) {
  if (options.enforce_eager || !model_->device().is_cuda()) return;
  const std::string why = kv_->num_formats() > 1
                              ? "the KV cache holds " + std::to_string(kv_->num_formats()) + " formats (policies' kv_dtype)"
                              : DecodeGraphs::unsupported(*model_, kv_->format(0));
  if (!why.empty()) {
    KV_LOG("decode runs eagerly, without CUDA graphs: " << why);
    return;
  }
  DecodeGraphOptions go;
  go.max_batch = options.max_num_seqs;
  graphs_ = std::make_unique<DecodeGraphs>(*model_, kv_->format(0), go);
}

LocalRunner::~LocalRunner() = default;

void LocalRunner::set_draft_model(std::shared_ptr<DecoderModel> draft) {
  draft_model_.reset();
  separate_.reset();
  if (!draft) return;
  const std::string why = draft_model_mismatch(*model_, *draft);
  if (why.empty()) {
    draft_model_ = std::move(draft);
    return;
  }
  // Sized after the default format's pool (what a draft of another shape keeps is its own).
  separate_ = make_separate_kv_drafter(std::move(draft), kv_->format(0), why);
}

int64_t LocalRunner::graph_captures() const { return graphs_ ? graphs_->stats().captures : 0; }

double LocalRunner::graph_capture_s() const { return graphs_ ? graphs_->stats().capture_s : 0; }

void LocalRunner::set_cancel_check(CancelCheck check) { model_->set_cancel_check(std::move(check)); }

StepResult LocalRunner::execute(const StepPlan& plan) {
  StepResult r;
  if (separate_) {
    separate_->begin_step(plan);  // the prompts it follows: where its prefix cache serves them
    r.draft_prefix_hits = separate_->prefix_hits();
  }
  for (const auto& [id, n] : plan.truncate) kv_->truncate(id, n);
  for (int64_t id : plan.release) kv_->release(id);
  for (int64_t id : plan.park) kv_->park(id);
  for (int64_t id : plan.remove) samplers_.remove(id);
  for (const auto& s : plan.start) samplers_.add(s.seq_id, s.sampling, s.prompt, s.seed, s.eos_ids);
  if (!plan.decode.seq_ids.empty()) {
    try {
      // A speculative step (drafts as further rows of their sequences) runs eagerly: a CUDA graph
      // captures one row per sequence.
      const bool drafts = has_drafts(plan.decode);
      if (drafts) {
        std::vector<int64_t> ids = plan.decode.seq_ids;
        ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
        samplers_.prepare(ids);  // grammar masks of the first verified rows, beside the forward
      } else {
        samplers_.prepare(plan.decode.seq_ids);  // grammar masks, beside the forward
      }
      using clock = std::chrono::steady_clock;
      const auto start = clock::now();
      auto t0 = start;
      std::vector<int64_t> tokens = plan.decode_tokens;
      std::vector<SampledDraft> sampled;  // drafts drawn from their distribution (draft_sampling "sample")
      if (drafts && (plan.self_draft.active() || plan.model_draft)) {
        SamplerBank* draws = sampled_drafts_ ? &samplers_ : nullptr;
        std::vector<SampledDraft>* drawn = sampled_drafts_ ? &sampled : nullptr;
        if (plan.model_draft && separate_) {
          r.draft_steps = separate_->draft(plan.decode, tokens, draws, drawn);
        } else {
          KV_CHECK(!plan.model_draft || draft_model_, "internal: a plan for a draft model, and none is loaded");
          // A draft model reads the whole cache; the model itself drafts through the plan's view.
          DecoderModel& drafter = plan.model_draft ? *draft_model_ : *model_;
          r.draft_steps = draft_with_own_kv(drafter, *kv_, plan.decode, plan.self_draft, tokens, draws, drawn);
        }
        const auto t1 = clock::now();
        r.draft_s = std::chrono::duration<double>(t1 - t0).count();
        t0 = t1;
      }
      // Sampled where the logits are: only token ids (and asked-for logprobs) reach the host.
      torch::Tensor logits = graphs_ && !drafts ? graphs_->decode(plan.decode, tokens)
                                                : model_->decode(plan.decode, tokens, *kv_);
      VerifiedTokens v = verify_drafts(samplers_, plan.decode, tokens, logits, plan.decode_ban_eos, sampled);
      const auto end = clock::now();
      if (drafts) r.verify_s = std::chrono::duration<double>(end - t0).count();
      r.decode_s = std::chrono::duration<double>(end - start).count();
      if (separate_) separate_->after_decode(plan.decode, tokens, v.counts, /*failed=*/false);
      r.decoded = std::move(v.tokens);
      r.decode_counts = std::move(v.counts);
    } catch (const std::exception& e) {
      if (separate_) separate_->after_decode(plan.decode, {}, {}, /*failed=*/true);
      r.decoded.clear();
      r.decode_counts.clear();
      r.decode_error = e.what();
    }
  }
  // The prefills run in groups of up to prefill_batch_tokens_ prompt tokens, one forward each. When a
  // group's forward fails (it leaves no KV behind), its prompts run again one by one, so that only
  // the one at fault reports an error, as when every prompt ran alone. A chunk that continues a
  // prompt runs alone: its failure frees the earlier chunks' KV, so it could not be retried.
  auto input = [](const PrefillWork& p) {
    PrefillInput in{p.seq_id, p.tokens, p.policy, p.start, p.total()};
    in.keep_copy = p.keep_copy;
    in.reuse_prefix = p.reuse_prefix;
    in.resume = p.resume;
    in.context_len = p.context_len;
    return in;
  };
  // prompt_logprobs (top-k, or -1): such a prompt runs alone, with the logits of every position. The
  // scheduler prefills it whole.
  auto prompt_k = [&](const PrefillWork& p) {
    return p.sample && !p.chunked() ? samplers_.prompt_logprobs(p.seq_id) : int64_t{-1};
  };
  // What the policy kept: per layer and per (layer, KV head).
  auto kept_of = [&](int64_t seq_id, PrefillOutcome& o) {
    o.kept_tokens = kv_->kept_tokens(seq_id);
    const auto hk = kv_->head_kept(seq_id);
    o.kept_head_min = hk.min;
    o.kept_head_max = hk.max;
    o.kept_head_sum = hk.sum;
    o.head_tables = hk.count;
  };
  // What a first chunk found in the prefix cache (later chunks report nothing).
  auto looked_up = [&](const PrefillWork& p, PrefillOutcome& o) {
    if (p.start != 0) return;
    o.queried_tokens = kv_->prefix_queried(p.seq_id);
    o.cached_tokens = kv_->prefix_hit(p.seq_id);
  };
  for (size_t g = 0; g < plan.prefill.size();) {
    size_t end = g + 1;
    // A prompt that resumes a parked conversation runs alone too: a failed group frees that KV.
    auto groupable = [&](const PrefillWork& p) { return p.start == 0 && prompt_k(p) < 0 && p.resume.seq_id < 0 && p.context_len == 0;
    };
    for (size_t rows = plan.prefill[g].tokens.size();
         groupable(plan.prefill[g]) && end < plan.prefill.size() && groupable(plan.prefill[end]) &&
         rows + plan.prefill[end].tokens.size() <= prefill_batch_tokens_;
         ++end)
      rows += plan.prefill[end].tokens.size();
    torch::Tensor group_logits;
    if (end - g > 1) {
      std::vector<PrefillInput> batch;
      for (size_t i = g; i < end; ++i) batch.push_back(input(plan.prefill[i]));
      try {
        group_logits = model_->prefill_batch(batch, *kv_);
      } catch (const PrefillCancelled&) {
        // One of them was cancelled: the rest run one by one below, the cancelled one stops at once.
      } catch (const std::exception& e) {
        KV_LOG("a prefill of " << end - g << " prompts failed (" << e.what() << "); running them one by one");
      }
    }
    if (group_logits.defined()) {
      // One sampling call for the group's rows that sample, on the logits' device.
      std::vector<int64_t> rows, ids;
      std::vector<char> ban;
      for (size_t i = g; i < end; ++i) {
        if (!plan.prefill[i].sample || !plan.prefill[i].last_chunk()) continue;
        rows.push_back(static_cast<int64_t>(i - g));
        ids.push_back(plan.prefill[i].seq_id);
        ban.push_back(plan.prefill[i].ban_eos);
      }
      std::vector<SampledToken> firsts;
      std::string error;
      try {
        if (!rows.empty())
          firsts = samplers_.sample_batch(ids, group_logits.index_select(0, torch::tensor(rows).to(group_logits.device())), ban);
      } catch (const std::exception& e) {
        error = e.what();  // the prompts that sample report it, as when each sampled alone
      }
      for (size_t i = g, k = 0; i < end; ++i) {
        PrefillOutcome o;
        if (plan.prefill[i].sample && plan.prefill[i].last_chunk()) {
          if (error.empty()) o.first = firsts[k++];
          else o.error = error;
        }
        kept_of(plan.prefill[i].seq_id, o);
        looked_up(plan.prefill[i], o);
        r.prefilled.push_back(std::move(o));
      }
      g = end;
      continue;
    }
    for (size_t i = g; i < end; ++i) {
      const PrefillWork& p = plan.prefill[i];
      PrefillOutcome o;
      try {
        const int64_t k = prompt_k(p);
        torch::Tensor logits = model_->prefill_batch({input(p)}, *kv_, /*all_logits=*/k >= 0);
        if (p.sample && p.last_chunk()) {
          o.first = samplers_.sample(p.seq_id, logits[logits.size(0) - 1], p.ban_eos);
          if (k >= 0) o.first->prompt = kvserve::prompt_logprobs(logits, p.tokens, k);
        }
        kept_of(p.seq_id, o);
        looked_up(p, o);
      } catch (const std::exception& e) {
        o.error = e.what();
      }
      r.prefilled.push_back(std::move(o));
    }
    g = end;
  }
  // A draft model with its own cache prefills what the model prefilled at the next step's start,
  // so that a prompt's first token waits for the model only.
  if (separate_) separate_->defer_prefills(plan.prefill);
  r.shards.push_back(shard_usage(*kv_, plan));
  return r;
}

}  // namespace kvserve
