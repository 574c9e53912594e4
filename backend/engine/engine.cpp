#include "backend/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <random>
#include <sstream>
#include <tuple>
#include <unordered_set>

#include "backend/sampling/grammar_compiler.h"
#include "backend/model/decoder_model.h"
#include "backend/engine/model_runner.h"
#include "backend/engine/output_processor.h"
#include "backend/engine/scheduler.h"
#include "cache_manager/kv_memory_factory.h"
#include "cache_manager/kv_quant.h"
#include "common/check.h"
#include "common/log.h"
#include "parallel/communicator.h"
#include "policies/kv_dtype_ladder.h"
#include "text/tokenizer.h"

namespace kvserve {

struct Engine::Impl {
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<OutputProcessor> output;
  std::string unhealthy_reason;  // guarded by mu
  int64_t max_model_len = 0;

  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Sequence>> incoming;  // guarded by mu
  std::unordered_set<std::string> cancels;         // guarded by mu
  bool stopping = false, drain = false;            // guarded by mu
  EngineStats stats;                               // guarded by mu
  // Admission on queue time (guarded by mu): when the oldest request still waiting to start
  // arrived, as of the last step (none: nothing waits).
  std::optional<std::chrono::steady_clock::time_point> oldest_waiting;

  // The resolved policies (budget_bytes in tokens), for choosing a ladder's rung at submit, and
  // each one's KV cache dtype and token-layer bytes (GenerationEvent::kv_cache_dtype).
  std::map<std::string, PolicyConfig> policies;
  std::map<std::string, std::pair<std::string, int64_t>> policy_kv;
  // Loop thread only.
  int64_t next_id = 1;
  std::mt19937_64 seed_rng{std::random_device{}()};
};

EngineOptions options_for_model(EngineOptions o, const ModelConfig& c) {
  if (c.rope_scaling.length_dependent()) {
    o.enable_prefix_caching = false;
    o.prefix_cache_bytes = 0;
    o.enable_context_caching = false;
    o.enable_chunked_prefill = false;
  }
  return o;
}

Engine::Engine(std::shared_ptr<DecoderModel> model, std::shared_ptr<const Tokenizer> tokenizer, EngineOptions options,
               std::unique_ptr<ModelRunner> runner)
    : model_(std::move(model)), tokenizer_(std::move(tokenizer)), options_(std::move(options)),
      impl_(std::make_unique<Impl>()) {
  const ModelConfig& c = model_->config();
  if (c.rope_scaling.length_dependent() && (options_.enable_prefix_caching || options_.enable_chunked_prefill))
    KV_LOG("RoPE scaling of " << model_->model_dir() << " depends on the sequence length (dynamic / longrope): "
                              << "prefix caching and chunked prefill are off, prompts are prefilled whole");
  options_ = options_for_model(options_, c);
  impl_->max_model_len = options_.max_model_len > 0 ? options_.max_model_len : context_length(c);
  auto policies = resolve_policies(options_.policies);
  // Each policy's KV format (its kv_dtype, else the cache's); budget_bytes in tokens of that format,
  // the scheduler's copies too.
  const KvFormats formats = model_->kv_formats(policies);
  apply_model_layout(policies, formats);
  // A kvzap policy's predictor is loaded now, so that a missing or mismatched one fails the start
  // (naming its directory) instead of every request that uses it.
  for (const auto& [name, cfg] : policies)
    if (!cfg.is_full() && cfg.scorer == ScorerKind::kPredicted) model_->kvzap_predictor(cfg);
  impl_->runner = runner ? std::move(runner)
                         : std::make_unique<LocalRunner>(
                               model_,
                               make_mixed_kv_memory(formats,
                                              {options_.block_size, 0, options_.kv_cache_bytes, options_.enable_prefix_caching,
                                               options_.prefix_cache_bytes, options_.kv_layout,
                                               options_.enable_context_caching},
                                              policies,
                                              options_.default_policy),
                               LocalRunnerOptions{options_.max_num_seqs, options_.enforce_eager, options_.max_num_batched_tokens});
  // Before the loop starts, so the first request finds the device started (backend/engine/warmup.h).
  WarmupOptions wo;
  wo.tokens = resolve_warmup_tokens(options_.warmup_tokens, model_->device().is_cuda(), options_.max_num_batched_tokens);
  wo.prompts = std::min<int64_t>(options_.max_num_seqs, 8);
  wo.vocab_size = c.vocab_size;
  wo.max_model_len = impl_->max_model_len;
  if (auto it = policies.find(options_.default_policy); it != policies.end()) {
    wo.policy = it->first;
    wo.policy_config = it->second;
  }
  warmup_ = warm_up(*impl_->runner, wo);
  if (warmup_.prompts > 0)
    KV_LOG("warm-up: " << warmup_.prompts << " prompts of " << warmup_.tokens / warmup_.prompts << " tokens ("
                       << wo.policy << ") and " << warmup_.decode_steps << " decode steps in " << warmup_.seconds << " s");
  else if (!warmup_.skipped.empty())
    KV_LOG("no warm-up: " << warmup_.skipped);
  std::vector<int64_t> eos_ids = c.eos_token_ids;
  if (auto e = tokenizer_->eos_id(); e && std::find(eos_ids.begin(), eos_ids.end(), *e) == eos_ids.end())
    eos_ids.push_back(*e);
  Scheduler::Options so;
  so.max_num_seqs = options_.max_num_seqs;
  so.max_num_batched_tokens = options_.max_num_batched_tokens;
  so.enable_chunked_prefill = options_.enable_chunked_prefill && impl_->runner->chunked_prefill();
  so.long_prefill_token_threshold =
      resolve_long_prefill_token_threshold(options_.long_prefill_token_threshold, model_->device().is_cuda());
  if (options_.enable_chunked_prefill && !so.enable_chunked_prefill)
    KV_LOG("chunked prefill is not supported by the sharded runtime yet; prompts are prefilled whole");
  so.compressed_contexts = impl_->runner->compressed_contexts();
  if (so.compressed_contexts)
    for (const auto& [name, cfg] : policies)
      if (!cfg.is_full() && cfg.compress_context) context_policies_.insert(name);
  for (const auto& [name, cfg] : policies) {
    const KvMemoryLayout& l = cfg.kv_dtype.empty() ? formats.base : formats.by_dtype.at(cfg.kv_dtype);
    impl_->policy_kv[name] = {kv_cache_dtype_label(l.dtype, l.quant), l.model_token_layer_bytes};
  }
  impl_->policies = policies;
  so.policies = std::move(policies);
  so.eos_ids = eos_ids;
  options_.speculative.validate("speculative_config");
  if (options_.speculative.enabled()) {
    KV_CHECK(!options_.speculative.self_draft() || impl_->runner->self_drafting(),
             "speculative_config: method 'self': this runner does not draft with its own KV; use method 'ngram'");
    KV_CHECK(!options_.speculative.loads_draft_model() || impl_->runner->model_drafting(),
             "speculative_config: method '" << options_.speculative.method
                                             << "' with a draft model: this runner holds none (ParallelJob::make_runner "
                                                "loads it)");
    if (options_.speculative.runner_drafts()) impl_->runner->configure_self_draft(options_.speculative);
    if (impl_->runner->speculative_decoding())
      so.speculative = speculative_ = options_.speculative;
    else
      KV_LOG("speculative decoding is not supported by the sharded runtime yet; sequences decode one token a step");
  }
  so.on_queue_time = options_.on_queue_time;
  so.shared_prefix_blocks = [runner = impl_->runner.get()](std::span<const int64_t> prompt, const std::string& policy,
                                                           std::span<const int64_t> leaving) {
    return runner->shared_prefix_blocks(prompt, policy, leaving);
  };
  impl_->scheduler = std::make_unique<Scheduler>(std::move(so));
  impl_->output = std::make_unique<OutputProcessor>(*tokenizer_, std::move(eos_ids), impl_->max_model_len);
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(false); }

std::vector<std::string> Engine::policy_names() const {
  std::vector<std::string> names{"full"};
  for (const auto& [n, p] : options_.policies)
    if (n != "full") names.push_back(n);
  return names;
}

bool Engine::has_policy(const std::string& name) const { return name == "full" || options_.policies.count(name); }

std::string Engine::unhealthy_reason() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->unhealthy_reason;
}

void Engine::mark_unhealthy(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (impl_->unhealthy_reason.empty()) impl_->unhealthy_reason = reason;
  }
  healthy_ = false;
  impl_->cv.notify_all();
}

std::shared_ptr<const StructuredGrammar> Engine::compile_grammar(const StructuredOutputSpec& spec) {
  if (!impl_->runner->samples_in_process())
    throw GrammarError(spec.field, "structured outputs are not supported with pipeline parallelism yet (the last "
                                   "stage samples, and the compiled grammar lives on rank 0)");
  std::call_once(grammar_once_, [&] {
    grammar_ = std::make_unique<GrammarCompiler>(*tokenizer_, model_->config().vocab_size, impl_->output->eos_ids());
  });
  return grammar_->compile(spec);
}

void Engine::submit(GenerationRequest req, EventCallback on_event) {
  std::vector<Submission> one;
  one.push_back({std::move(req), std::move(on_event)});
  submit_all(std::move(one));
}

void Engine::submit_all(std::vector<Submission> batch) {
  if (!healthy_) throw EngineOverloaded("the engine is unhealthy: " + unhealthy_reason());
  const int64_t vocab = model_->config().vocab_size;
  const auto arrival = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<Sequence>> seqs;
  seqs.reserve(batch.size());
  for (Submission& sub : batch) {
    GenerationRequest& req = sub.request;
    if (req.sampling.grammar)
      KV_CHECK(impl_->runner->samples_in_process() && req.sampling.grammar->vocab_size == vocab,
               "a grammar compiled for another model or runner");
    KV_CHECK(!req.prompt_ids.empty(), "the prompt is empty");
    for (int64_t t : req.prompt_ids) KV_CHECK(t >= 0 && t < vocab, "prompt token id " << t << " is outside the vocabulary");
    const int64_t n = static_cast<int64_t>(req.prompt_ids.size());
    if (n >= impl_->max_model_len) {
      KV_FAIL("the prompt has " << n << " tokens, but this model's maximum context length is " << impl_->max_model_len
                                << " tokens");
    }
    if (req.kv_policy.empty()) req.kv_policy = options_.default_policy;
    if (!has_policy(req.kv_policy)) KV_FAIL("unknown kv_policy '" << req.kv_policy << "'");
    // A kv_dtype ladder's request runs under the rung its budget_bytes buy most from at this length.
    req.kv_policy = choose_kv_rung(impl_->policies, req.kv_policy, n);
    KV_CHECK(req.sampling.max_tokens >= 1, "max_tokens must be at least 1");
    if (req.sampling.prompt_logprobs >= 0 && !impl_->runner->prompt_logprobs())
      KV_FAIL("prompt_logprobs are not supported by the sharded (tensor/pipeline parallel) runtime");
    auto seq = std::make_unique<Sequence>();
    seq->arrival = arrival;
    std::tie(seq->kv_cache_dtype, seq->kv_token_layer_bytes) = impl_->policy_kv.at(req.kv_policy);
    seq->req = std::move(req);
    seq->on_event = std::move(sub.on_event);
    seqs.push_back(std::move(seq));
  }
  if (seqs.empty()) return;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (impl_->stopping) throw EngineOverloaded("the server is shutting down");
    const int64_t queued = impl_->stats.waiting + static_cast<int64_t>(impl_->incoming.size());
    if (queued + static_cast<int64_t>(seqs.size()) > options_.max_waiting) {
      std::ostringstream why;
      why << "too many requests waiting (" << options_.max_waiting << ")";
      if (seqs.size() > 1) why << " for " << seqs.size() << " more";
      why << "; retry later";
      throw EngineOverloaded(why.str());
    }
    // The queue is already slow: its oldest request has waited half the limit without starting, so
    // one arriving now would likely wait past it. Refused now (503) rather than failed later.
    if (options_.max_queue_time_s > 0 && impl_->oldest_waiting) {
      const double waited = std::chrono::duration<double>(arrival - *impl_->oldest_waiting).count();
      if (waited > options_.max_queue_time_s / 2) {
        std::ostringstream why;
        why << "the server is over capacity: the oldest queued request has waited " << static_cast<int64_t>(waited + 0.5)
            << " s to start, and scheduler.max_queue_time_s is " << options_.max_queue_time_s << " s; retry later";
        throw EngineOverloaded(why.str(), /*over_capacity=*/true);
      }
    }
    // All under one lock: the engine thread takes them in the same step.
    for (auto& seq : seqs) impl_->incoming.push_back(std::move(seq));
  }
  impl_->cv.notify_all();
}

void Engine::cancel(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->cancels.insert(request_id);
  }
  impl_->cv.notify_all();
}

void Engine::shutdown(bool drain) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stopping = true;
    impl_->drain = impl_->drain || drain;
  }
  impl_->cv.notify_all();
  if (thread_.joinable()) thread_.join();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->stats;
}

namespace {

// The pools' side of the engine's stats, as the last step left them.
void record_usage(EngineStats& st, const KvUsage& usage) {
  st.kv_blocks_total = usage.blocks_total;
  st.kv_blocks_used = usage.blocks_used;
  st.kv_blocks_high_water = usage.blocks_high_water;
  st.kv_bytes_total = usage.bytes_total;
  st.kv_bytes_used = usage.bytes_used;
  st.kv_bytes_used_by_dtype = usage.bytes_used_by_dtype;
  st.kv_blocks_cached = usage.blocks_cached;
  st.prefix_cache_bytes = usage.cached_bytes;
  st.prefix_cache_host_bytes = usage.host_cached_bytes;
  st.prefix_cache_host_capacity_bytes = usage.host_capacity_bytes;
  st.prefix_cache_host_stores_total = usage.host_stores;
  st.prefix_cache_host_loads_total = usage.host_loads;
  st.compressed_contexts = usage.context_entries;
  st.kv_blocks_compressed_contexts = usage.context_blocks;
  st.compressed_context_full_blocks = usage.context_full_blocks;
  st.compressed_context_bytes = usage.context_bytes;
  st.conversations_parked = usage.conversations_parked;
  st.kv_blocks_parked = usage.blocks_parked;
  st.conversation_cache_bytes = usage.parked_bytes;
}

// The running and waiting counts, as the scheduler has them now.
void record_queues(EngineStats& st, const Scheduler& sched) {
  st.running = sched.num_running();
  st.running_high_water = std::max(st.running_high_water, st.running);
  st.waiting = sched.num_waiting();
}

// The runner's own counters, as the last step left them.
void record_runner(EngineStats& st, const ModelRunner& runner) {
  st.step_collectives_total = runner.step_collectives();
  st.cuda_graph_captures_total = runner.graph_captures();
  st.cuda_graph_capture_seconds_total = runner.graph_capture_s();
}

}  // namespace

void Engine::loop() {
  Impl& im = *impl_;
  Scheduler& sched = *im.scheduler;
  const OutputProcessor& out = *im.output;
  ModelRunner& runner = *im.runner;
  bool live = true;  // false once the runner failed for good

  // Whether the sequence's request was cancelled since this step began (or the engine stops without draining).
  auto cancelled = [&](const Sequence& s) {
    std::lock_guard<std::mutex> lk(im.mu);
    return (im.stopping && !im.drain) || im.cancels.count(s.req.request_id) > 0;
  };
  // A long prefill stops between layers once its client left, rather than at the step's end.
  runner.set_cancel_check([&](std::span<const int64_t> ids) {
    return std::any_of(ids.begin(), ids.end(), [&](int64_t id) {
      const Sequence* s = sched.running(id);
      return s && cancelled(*s);
    });
  });
  struct {
    int64_t draft_steps = 0, verify_steps = 0, draft_prefix_hits = 0;
    double draft_s = 0.0, verify_s = 0.0;
  } speculated;  // the runner's speculative steps so far
  // One step: cancellations, the plan, the runner, the events. True = the loop is done.
  auto step = [&](const std::unordered_set<std::string>& cancels, bool stopping, bool drain) -> bool {
    // Cancellations (and a non-draining shutdown) free their blocks in the next plan.
    for (auto& s : sched.take_if([&](const Sequence& s) { return cancels.count(s.req.request_id) || (stopping && !drain); }))
      out.finish(*s, "abort");
    // Requests that waited past max_queue_time_s without being admitted: over capacity (503).
    if (options_.max_queue_time_s > 0) {
      const auto now = std::chrono::steady_clock::now();
      for (auto& s : sched.take_if([&](const Sequence& s) {
             return !s.scheduled && std::chrono::duration<double>(now - s.arrival).count() > options_.max_queue_time_s;
           }))
        out.finish(*s, "error",
                   "the server is over capacity: the request waited more than scheduler.max_queue_time_s (" +
                       std::to_string(static_cast<int64_t>(options_.max_queue_time_s)) + " s) to start; retry later",
                   /*request_error=*/false, /*unavailable=*/true);
    }
    std::vector<Scheduler::Rejected> rejected;
    StepPlan plan = sched.schedule(&rejected);
    for (auto& [s, why] : rejected) out.finish(*s, "error", why, /*request_error=*/true);
    if (!plan.empty()) {
      // A long prefill step takes seconds: /metrics shows its requests running while it runs.
      std::lock_guard<std::mutex> lk(im.mu);
      record_queues(im.stats, sched);
    }
    std::vector<Scheduler::Output> outputs;
    if (!plan.empty()) {
      StepResult result = runner.execute(plan);
      speculated.draft_steps += result.draft_steps;
      speculated.draft_s += result.draft_s;
      speculated.verify_steps += result.verify_s > 0;
      speculated.verify_s += result.verify_s;
      if (result.draft_prefix_hits >= 0) speculated.draft_prefix_hits = result.draft_prefix_hits;
      outputs = sched.update(plan, std::move(result));
    }
    int64_t generated = 0;
    // A speculative step gives a sequence several tokens: those after the one that finished it are dropped.
    std::unordered_set<const Sequence*> finished;
    // Sequences this step ended: their responses go out after the step's stats are recorded, so a
    // client that reads /metrics after its last response finds its tokens counted. (Their blocks are
    // freed, or a conversation parked, at the next plan: pool figures follow a step later.)
    struct Ended {
      std::unique_ptr<Sequence> seq;
      std::string reason, error;
    };
    std::vector<Ended> ended;
    for (auto& o : outputs) {
      if (finished.count(o.seq)) continue;
      finished.insert(o.seq);  // until it is known to go on
      if (!o.error.empty()) {
        // A prefill stopped because its client left (the runner's cancel check) ends as the cancel would.
        const bool abort = cancelled(*o.seq);
        if (abort) KV_LOG("request " << o.seq->req.request_id << " left during its prefill: " << o.error);
        ended.push_back({sched.finish(o.seq->id), abort ? "abort" : "error", abort ? "" : o.error});
        continue;
      }
      ++generated;
      if (auto reason = out.on_token(*o.seq, *o.token))
        ended.push_back({sched.finish(o.seq->id, *reason == "stop" || *reason == "length"), *reason, ""});
      else
        finished.erase(o.seq);
    }
    int64_t prefilled = 0;
    for (const auto& p : plan.prefill) prefilled += static_cast<int64_t>(p.tokens.size());
    auto send_ended = [&] {
      for (Ended& e : ended) out.finish(*e.seq, e.reason, e.error);
    };
    try {
      const KvUsage usage = sched.usage();
      const auto oldest = sched.oldest_waiting_arrival();
      std::lock_guard<std::mutex> lk(im.mu);
      im.oldest_waiting = oldest;
      record_queues(im.stats, sched);
      record_usage(im.stats, usage);
      im.stats.prompt_tokens_total += prefilled;
      im.stats.generation_tokens_total += generated;
      im.stats.preemptions_total = sched.preemptions();
      im.stats.kv_admission_waits_total = sched.kv_admission_waits();
      const Scheduler::SpecCounters& spec = sched.spec_counters();
      im.stats.spec_decode_num_drafts = spec.drafts;
      im.stats.spec_decode_num_draft_tokens = spec.draft_tokens;
      im.stats.spec_decode_num_accepted_tokens = spec.accepted_tokens;
      im.stats.spec_decode_accepted_per_pos = spec.accepted_per_pos;
      im.stats.spec_decode_pauses = spec.pauses;
      im.stats.spec_decode_draft_steps = speculated.draft_steps;
      im.stats.spec_decode_draft_prefix_hits = speculated.draft_prefix_hits;
      im.stats.spec_decode_draft_seconds = speculated.draft_s;
      im.stats.spec_decode_verify_steps = speculated.verify_steps;
      im.stats.spec_decode_verify_seconds = speculated.verify_s;
      im.stats.prefix_cache_queries_total = sched.prefix_queries();
      im.stats.prefix_cache_hits_total = sched.prefix_hits();
      if (!plan.empty()) ++im.stats.steps_total;
      record_runner(im.stats, runner);
    } catch (...) {
      send_ended();  // they left the scheduler: the failed-step path cannot reach them
      throw;
    }
    send_ended();
    return stopping && sched.idle() && !sched.has_pending();
  };
  // A dead job (a rank died or hung): every request gets the error, nothing runs any more.
  auto fail_all = [&] {
    const std::string why = "the engine is unhealthy: " + unhealthy_reason();
    for (auto& s : sched.take_if([](const Sequence&) { return true; }))
      out.finish(*s, "error", why, /*request_error=*/false, /*unavailable=*/true);
  };

  try {
    sched.update(StepPlan{}, runner.execute(StepPlan{}));  // learn the pools
    const KvUsage usage = sched.usage();
    std::lock_guard<std::mutex> lk(im.mu);
    record_usage(im.stats, usage);  // the pool and tier sizes are in /metrics before any request
    im.stats.steps_total = 1;
    record_runner(im.stats, runner);
  } catch (const std::exception& e) {
    KV_LOG(e.what());
    mark_unhealthy(e.what());
    live = false;
  }
  for (;;) {
    std::vector<std::unique_ptr<Sequence>> fresh;
    std::unordered_set<std::string> cancels;
    bool stopping, drain;
    {
      std::unique_lock<std::mutex> lk(im.mu);
      auto has_work = [&] {
        return im.stopping || !im.incoming.empty() || !im.cancels.empty() || !sched.idle() || (live && sched.has_pending()) || (live && !healthy_);
      };
      if (!im.cv.wait_for(lk, std::chrono::seconds(1), has_work)) {
        lk.unlock();
        if (live) {
          try {
            runner.idle();
          } catch (const parallel::CommError& e) {
            mark_unhealthy(e.what());
          }
        }
        continue;
      }
      while (!im.incoming.empty()) {
        fresh.push_back(std::move(im.incoming.front()));
        im.incoming.pop_front();
      }
      cancels.swap(im.cancels);
      stopping = im.stopping;
      drain = im.drain;
    }
    for (auto& s : fresh) {
      s->id = im.next_id++;
      s->seed = s->req.sampling.seed.value_or(im.seed_rng());
      s->detok = std::make_unique<IncrementalDetokenizer>(*tokenizer_, s->req.sampling.skip_special_tokens,
                                                          s->req.prompt_ids);
      sched.add(std::move(s));
    }
    if (live && !healthy_) live = false;
    if (!live) {
      fail_all();
      if (stopping) break;
      continue;
    }
    try {
      if (step(cancels, stopping, drain)) break;
    } catch (const std::exception& e) {  // the runner failed for good (a rank died or hung)
      // A dead rank fails the step with its transport's message (Gloo's) before the job's monitor
      // names the rank; the requests failed next (fail_all) should get that name.
      {
        std::unique_lock<std::mutex> lk(im.mu);
        im.cv.wait_for(lk, std::chrono::milliseconds(500), [&] { return !im.unhealthy_reason.empty(); });
      }
      KV_LOG(e.what());
      mark_unhealthy(e.what());
    }
  }
  runner.set_cancel_check(nullptr);
  if (live) {
    try {
      runner.stop();
    } catch (const std::exception& e) {
      KV_LOG(e.what());
    }
  }
}

}  // namespace kvserve
