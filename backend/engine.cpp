#include "engine.h"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <random>
#include <unordered_set>

#include "communicator.h"
#include "kv_check.h"
#include "model_runner.h"
#include "llama_model.h"
#include "sampler.h"
#include "tokenizer.h"

namespace kvserve {

namespace {

// One request inside the engine: its tokens so far, sampler, detokenizer and stop-string state.
struct Sequence {
  int64_t id = 0;
  GenerationRequest req;
  EventCallback on_event;
  std::vector<int64_t> output;
  uint64_t seed = 0;            // the sampler's RNG seed (the request's, or one the engine drew)
  bool sampler_added = false;   // the runner holds its sampler
  std::unique_ptr<IncrementalDetokenizer> detok;
  std::string held;       // decoded text not yet sent (could be the start of a stop string)
  bool in_cache = false;  // has KV in the memory
  std::chrono::steady_clock::time_point arrival;  // submit()
  bool scheduled = false;                          // admitted for prefill at least once
  bool suspect = false;  // was in a decode batch that failed: decodes alone until one step succeeds
  int64_t kept_kv = 0, full_kv = 0;

  int64_t next_position() const { return static_cast<int64_t>(req.prompt_ids.size() + output.size()) - 1; }
  // Tokens a (re)prefill runs: the prompt, plus everything generated but the last token, which the
  // next decode step feeds (preemption by recompute).
  std::vector<int64_t> prefill_tokens() const {
    std::vector<int64_t> t = req.prompt_ids;
    if (!output.empty()) t.insert(t.end(), output.begin(), output.end() - 1);
    return t;
  }
};

}  // namespace

struct Engine::Impl {
  std::unique_ptr<ModelRunner> runner;
  std::string unhealthy_reason;  // guarded by mu
  std::vector<int64_t> eos_ids;
  int64_t max_model_len = 0;

  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Sequence>> incoming;  // guarded by mu
  std::unordered_set<std::string> cancels;         // guarded by mu
  bool stopping = false, drain = false;            // guarded by mu
  EngineStats stats;                               // guarded by mu

  // Loop thread only.
  std::deque<std::unique_ptr<Sequence>> waiting;
  std::vector<std::unique_ptr<Sequence>> running;
  int64_t next_id = 1;
  std::mt19937_64 seed_rng{std::random_device{}()};
};

Engine::Engine(std::shared_ptr<LlamaModel> model, std::shared_ptr<const Tokenizer> tokenizer, EngineOptions options,
               std::unique_ptr<ModelRunner> runner)
    : model_(std::move(model)), tokenizer_(std::move(tokenizer)), options_(std::move(options)),
      impl_(std::make_unique<Impl>()) {
  const ModelConfig& c = model_->config();
  impl_->max_model_len = options_.max_model_len > 0 ? options_.max_model_len : c.max_position_embeddings;
  impl_->runner = runner ? std::move(runner) : std::make_unique<LocalRunner>(model_, make_kv_memory(*model_, options_));
  impl_->eos_ids = c.eos_token_ids;
  if (auto e = tokenizer_->eos_id(); e && std::find(impl_->eos_ids.begin(), impl_->eos_ids.end(), *e) == impl_->eos_ids.end())
    impl_->eos_ids.push_back(*e);
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

void Engine::submit(GenerationRequest req, EventCallback on_event) {
  if (!healthy_) throw EngineOverloaded("the engine is unhealthy: " + unhealthy_reason());
  const int64_t vocab = model_->config().vocab_size;
  KV_CHECK(!req.prompt_ids.empty(), "the prompt is empty");
  for (int64_t t : req.prompt_ids) KV_CHECK(t >= 0 && t < vocab, "prompt token id " << t << " is outside the vocabulary");
  const int64_t n = static_cast<int64_t>(req.prompt_ids.size());
  if (n >= impl_->max_model_len) {
    KV_FAIL("the prompt has " << n << " tokens, but this model's maximum context length is " << impl_->max_model_len
                              << " tokens");
  }
  if (req.kv_policy.empty()) req.kv_policy = options_.default_policy;
  if (!has_policy(req.kv_policy)) KV_FAIL("unknown kv_policy '" << req.kv_policy << "'");
  KV_CHECK(req.sampling.max_tokens >= 1, "max_tokens must be at least 1");
  auto seq = std::make_unique<Sequence>();
  seq->arrival = std::chrono::steady_clock::now();
  seq->req = std::move(req);
  seq->on_event = std::move(on_event);
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (impl_->stopping) throw EngineOverloaded("the server is shutting down");
    if (impl_->stats.waiting + static_cast<int64_t>(impl_->incoming.size()) >= options_.max_waiting) {
      throw EngineOverloaded("too many requests waiting (" + std::to_string(options_.max_waiting) + "); retry later");
    }
    impl_->incoming.push_back(std::move(seq));
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

// Sends the final event and clears the sequence's state; safe to call once per sequence.
void finish(Sequence& s, ModelRunner* kv, const std::string& reason, const std::string& error = "") {
  if (s.in_cache) {
    if (kv) kv->release(s.id);  // null once the job is dead: nothing left to free
    s.in_cache = false;
  }
  if (s.sampler_added) {
    if (kv) kv->remove_sequence(s.id);
    s.sampler_added = false;
  }
  GenerationEvent ev;
  ev.finished = true;
  ev.finish_reason = reason;
  ev.error = error;
  if (reason != "stop" && s.detok) ev.text_delta = s.held + s.detok->flush();
  s.held.clear();
  ev.prompt_tokens = static_cast<int64_t>(s.req.prompt_ids.size());
  ev.completion_tokens = static_cast<int64_t>(s.output.size());
  ev.kept_kv_tokens = s.kept_kv;
  ev.full_kv_tokens = s.full_kv;
  s.on_event(ev);
}

// Length of the longest suffix of `text` that is a proper prefix of some stop string.
size_t held_suffix(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const auto& st : stops) {
    for (size_t k = std::min(st.size() - 1, text.size()); k > best; --k) {
      if (text.compare(text.size() - k, k, st, 0, k) == 0) {
        best = k;
        break;
      }
    }
  }
  return best;
}

}  // namespace

void Engine::loop() {
  Impl& im = *impl_;
  ModelRunner& kv = *im.runner;
  ModelRunner* live = &kv;  // null once the runner failed for good
  // Handles one freshly sampled token: emits text, checks stop conditions. Returns true when done.
  auto on_token = [&](Sequence& s, int64_t tok, const TokenLogprob& chosen, std::vector<TokenLogprob> top) -> bool {
    s.output.push_back(tok);
    const auto& sp = s.req.sampling;
    const bool is_eos = !sp.ignore_eos && std::find(im.eos_ids.begin(), im.eos_ids.end(), tok) != im.eos_ids.end();
    const bool is_stop_id = std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), tok) != sp.stop_token_ids.end();
    GenerationEvent ev;
    ev.token_ids = {tok};
    if (sp.logprobs >= 0) {
      TokenLogprob c = chosen;
      c.token = tokenizer_->decode({tok});
      ev.chosen.push_back(c);
      for (auto& t : top) t.token = tokenizer_->decode({t.token_id});
      ev.top_logprobs.push_back(std::move(top));
    }
    bool done = false;
    std::string reason;
    if ((is_eos || is_stop_id) && static_cast<int64_t>(s.output.size()) > sp.min_tokens) {
      done = true;
      reason = "stop";
      // The stop token's own text is not part of the output (unless it is an ordinary token).
    } else {
      s.held += s.detok->add(tok);
    }
    if (!done && !sp.stop.empty()) {
      size_t cut = std::string::npos, cut_len = 0;
      for (const auto& st : sp.stop) {
        size_t p = s.held.find(st);
        if (p != std::string::npos && p < cut) cut = p, cut_len = st.size();
      }
      if (cut != std::string::npos) {
        s.held.resize(sp.include_stop_str_in_output ? cut + cut_len : cut);
        done = true;
        reason = "stop";
      }
    }
    if (!done && (static_cast<int64_t>(s.output.size()) >= sp.max_tokens ||
                  s.next_position() + 1 >= im.max_model_len)) {
      done = true;
      reason = "length";
    }
    if (done && reason == "length") s.held += s.detok->flush();
    const size_t keep = done ? 0 : held_suffix(s.held, sp.stop);
    ev.text_delta = s.held.substr(0, s.held.size() - keep);
    s.held.erase(0, s.held.size() - keep);
    ev.prompt_tokens = static_cast<int64_t>(s.req.prompt_ids.size());
    ev.completion_tokens = static_cast<int64_t>(s.output.size());
    s.on_event(ev);
    if (done) {
      s.detok.reset();  // nothing more to flush
      finish(s, live, reason);
    }
    return done;
  };

  // min_tokens: EOS may not end the sequence yet, so the sampler masks it.
  auto ban_eos = [](const Sequence& s) -> char {
    const auto& sp = s.req.sampling;
    return static_cast<int64_t>(s.output.size()) < sp.min_tokens && !sp.ignore_eos;
  };

  // One scheduling step: cancellations, a decode step, admissions. True = the loop is done.
  auto step = [&](const std::unordered_set<std::string>& cancels, bool stopping, bool drain) -> bool {
    // Cancellations (and a non-draining shutdown) free their blocks before anything else runs.
    auto drop = [&](auto& list) {
      for (auto& s : list) {
        if (s && (cancels.count(s->req.request_id) || (stopping && !drain))) {
          finish(*s, live, "abort");
          s.reset();
        }
      }
      list.erase(std::remove(list.begin(), list.end(), nullptr), list.end());
    };
    drop(im.running);
    drop(im.waiting);
    if (stopping && im.running.empty() && im.waiting.empty()) return true;

    // Decode first: every running sequence advances one token. Preempt (recompute later) the most
    // recently admitted sequences while the pool cannot hold one more token for each.
    while (!im.running.empty()) {
      std::vector<int64_t> ids;
      for (auto& s : im.running) ids.push_back(s->id);
      if (kv.can_decode(ids)) break;
      auto victim = std::move(im.running.back());
      im.running.pop_back();
      kv.release(victim->id);
      victim->in_cache = false;
      im.waiting.push_front(std::move(victim));
      std::lock_guard<std::mutex> lk(im.mu);
      ++im.stats.preemptions_total;
    }
    int64_t generated = 0;
    if (!im.running.empty()) {
      // A failing decode must fail only its own request. Sequences that were in a failed batch
      // decode alone (one batch each) until a step succeeds; everyone else decodes together.
      std::vector<std::vector<size_t>> batches(1);
      for (size_t i = 0; i < im.running.size(); ++i) {
        if (im.running[i]->suspect) batches.push_back({i});
        else batches[0].push_back(i);
      }
      std::vector<std::unique_ptr<Sequence>> recompute;
      for (const auto& members : batches) {
        if (members.empty()) continue;
        DecodeBatch batch;
        std::vector<int64_t> tokens;
        std::vector<char> ban;
        for (size_t i : members) {
          Sequence& s = *im.running[i];
          batch.seq_ids.push_back(s.id);
          batch.positions.push_back(s.next_position());
          tokens.push_back(s.output.back());
          ban.push_back(ban_eos(s));
        }
        try {
          auto sampled = kv.decode(batch, tokens, ban);
          for (size_t k = 0; k < members.size(); ++k) {
            auto& s = im.running[members[k]];
            ++generated;
            s->suspect = false;
            if (on_token(*s, sampled[k].token, sampled[k].chosen, std::move(sampled[k].top))) s.reset();
          }
        } catch (const parallel::CommError&) {
          throw;  // the job is dead: handled by the loop
        } catch (const std::exception& e) {
          if (members.size() == 1) {
            auto& s = im.running[members[0]];
            finish(*s, live, "error", e.what());
            s.reset();
            continue;
          }
          // Which sequence failed is unknown, and the step may have written part of their KV: all
          // of them start over from a recompute (as after a preemption), then decode alone.
          std::cerr << "kvserve: a decode step of " << members.size() << " sequences failed (" << e.what()
                    << "); recomputing them one by one\n";
          for (size_t i : members) {
            auto& s = im.running[i];
            kv.release(s->id);
            s->in_cache = false;
            s->suspect = true;
            recompute.push_back(std::move(s));
          }
        }
      }
      im.running.erase(std::remove(im.running.begin(), im.running.end(), nullptr), im.running.end());
      if (!recompute.empty()) {
        std::lock_guard<std::mutex> lk(im.mu);
        im.stats.preemptions_total += static_cast<int64_t>(recompute.size());
      }
      for (auto it = recompute.rbegin(); it != recompute.rend(); ++it) im.waiting.push_front(std::move(*it));
    }

    // Then admit waiting sequences while the pool holds them at their compressed size.
    int64_t prefilled = 0;
    while (!im.waiting.empty() && static_cast<int64_t>(im.running.size()) < options_.max_num_seqs) {
      Sequence& s = *im.waiting.front();
      const auto toks = s.prefill_tokens();
      const int64_t n = static_cast<int64_t>(toks.size());
      if (!kv.fits_when_empty(n, s.req.kv_policy)) {
        finish(s, live, "error", "the request needs more KV cache than the whole pool holds (" + std::to_string(n) +
                                   " tokens); raise cache.kv_cache_bytes or use a compressing kv_policy");
        im.waiting.pop_front();
        continue;
      }
      if (prefilled > 0 && prefilled + n > options_.max_num_batched_tokens) break;
      if (!kv.can_prefill(n, s.req.kv_policy)) break;
      auto owned = std::move(im.waiting.front());
      im.waiting.pop_front();
      if (!owned->scheduled) {  // queue time ends at the first admission, not at a re-admission
        owned->scheduled = true;
        if (options_.on_queue_time)
          options_.on_queue_time(std::chrono::duration<double>(std::chrono::steady_clock::now() - owned->arrival).count());
      }
      try {
        if (!owned->sampler_added) {
          kv.add_sequence(owned->id, owned->req.sampling, owned->req.prompt_ids, owned->seed, im.eos_ids);
          owned->sampler_added = true;
        }
        owned->in_cache = true;
        auto first = kv.prefill(owned->id, toks, owned->req.kv_policy, owned->output.empty(), ban_eos(*owned));
        prefilled += n;
        owned->kept_kv = kv.kept_tokens(owned->id);
        owned->full_kv = n * model_->config().num_hidden_layers;
        if (first) {
          ++generated;
          if (on_token(*owned, first->token, first->chosen, std::move(first->top))) continue;  // finished on its first token
        }
        im.running.push_back(std::move(owned));
      } catch (const parallel::CommError&) {
        throw;  // the job is dead: handled by the loop
      } catch (const std::exception& e) {
        finish(*owned, live, "error", e.what());
      }
    }
    const KvUsage usage = kv.usage();
    {
      std::lock_guard<std::mutex> lk(im.mu);
      im.stats.running = static_cast<int64_t>(im.running.size());
      im.stats.running_high_water = std::max(im.stats.running_high_water, im.stats.running);
      im.stats.waiting = static_cast<int64_t>(im.waiting.size());
      im.stats.kv_blocks_total = usage.blocks_total;
      im.stats.kv_blocks_used = usage.blocks_used;
      im.stats.kv_blocks_high_water = usage.blocks_high_water;
      im.stats.prompt_tokens_total += prefilled;
      im.stats.generation_tokens_total += generated;
      ++im.stats.steps_total;
    }
    return false;
  };

  for (;;) {
    std::vector<std::unique_ptr<Sequence>> fresh;
    std::unordered_set<std::string> cancels;
    bool stopping, drain;
    {
      std::unique_lock<std::mutex> lk(im.mu);
      auto has_work = [&] {
        return im.stopping || !im.incoming.empty() || !im.cancels.empty() || !im.running.empty() ||
               !im.waiting.empty() || (live && !healthy_);
      };
      if (!im.cv.wait_for(lk, std::chrono::seconds(1), has_work)) {
        lk.unlock();
        if (live) {
          try {
            kv.idle();
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
      im.waiting.push_back(std::move(s));
    }
    // A dead job (a rank died or hung): every request gets the error, nothing runs any more.
    if (live && !healthy_) live = nullptr;
    if (!live) {
      const std::string why = "the engine is unhealthy: " + unhealthy_reason();
      for (auto& s : im.running) finish(*s, nullptr, "error", why);
      im.running.clear();
      for (auto& s : im.waiting) finish(*s, nullptr, "error", why);
      im.waiting.clear();
      if (stopping) break;
      continue;
    }
    try {
      if (step(cancels, stopping, drain)) break;
    } catch (const parallel::CommError& e) {
      std::cerr << "kvserve: " << e.what() << "\n";
      mark_unhealthy(e.what());
    }
  }
  if (live) {
    try {
      kv.stop();
    } catch (const std::exception& e) {
      std::cerr << "kvserve: " << e.what() << "\n";
    }
  }
}

}  // namespace kvserve
