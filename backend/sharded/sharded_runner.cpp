#include "backend/sharded/sharded_runner.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <iostream>

#include "backend/model/decoder_model.h"
#include "backend/spec_decode/draft_verifier.h"
#include "backend/spec_decode/self_drafter.h"
#include "backend/spec_decode/separate_kv_drafter.h"
#include "backend/spec_decode/speculative_config.h"
#include "common/check.h"
#include "common/log.h"
#include "parallel/communicator.h"

namespace kvserve {

// The control protocol: a plan per step, a keep-alive, and the end.
enum class ShardOp : int64_t {
  kStep = 1,
  kPing,
  kShutdown,
  kSelfDraft,  // every rank's draft setup (ShardedRunner::configure_self_draft), between two steps
};

// A command: op + int64 payload (strings as one byte per element).
struct ShardCommand {
  ShardOp op = ShardOp::kPing;
  std::vector<int64_t> payload;
  size_t at = 0;  // read cursor

  void put(int64_t v) { payload.push_back(v); }
  void put(double v) { payload.push_back(std::bit_cast<int64_t>(v)); }
  void put(const std::vector<char>& v) { put(std::vector<int64_t>(v.begin(), v.end())); }
  void put(const SamplingParams& p) {
    put(p.temperature), put(p.top_p), put(p.top_k), put(p.min_p), put(p.repetition_penalty);
    put(p.presence_penalty), put(p.frequency_penalty), put(p.logprobs);
    put(static_cast<int64_t>(p.logit_bias.size()));
    for (const auto& [t, b] : p.logit_bias) put(t), put(b);
    put(p.allowed_token_ids);
    put(static_cast<int64_t>(p.bad_words_ids.size()));
    for (const auto& w : p.bad_words_ids) put(w);
  }
  void put(const std::vector<int64_t>& v) {
    put(static_cast<int64_t>(v.size()));
    payload.insert(payload.end(), v.begin(), v.end());
  }
  void put(const std::string& s) {
    put(static_cast<int64_t>(s.size()));
    for (unsigned char c : s) payload.push_back(c);
  }
  int64_t get() {
    KV_CHECK(at < payload.size(), "malformed command from rank 0");
    return payload[at++];
  }
  std::vector<int64_t> get_vector() {
    const int64_t n = get();
    KV_CHECK(n >= 0 && at + static_cast<size_t>(n) <= payload.size(), "malformed command from rank 0");
    std::vector<int64_t> v(payload.begin() + static_cast<std::ptrdiff_t>(at), payload.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += static_cast<size_t>(n);
    return v;
  }
  double get_double() { return std::bit_cast<double>(get()); }
  std::vector<char> get_flags() {
    auto v = get_vector();
    return std::vector<char>(v.begin(), v.end());
  }
  // Only what the sampler reads; stop conditions stay with rank 0's engine.
  SamplingParams get_params() {
    SamplingParams p;
    p.temperature = get_double();
    p.top_p = get_double();
    p.top_k = get();
    p.min_p = get_double();
    p.repetition_penalty = get_double();
    p.presence_penalty = get_double();
    p.frequency_penalty = get_double();
    p.logprobs = get();
    const int64_t biases = get();
    KV_CHECK(biases >= 0 && biases <= static_cast<int64_t>(payload.size()), "malformed command from rank 0");
    for (int64_t i = 0; i < biases; ++i) {
      const int64_t t = get();
      p.logit_bias.emplace_back(t, get_double());
    }
    p.allowed_token_ids = get_vector();
    const int64_t words = get();
    KV_CHECK(words >= 0 && words <= static_cast<int64_t>(payload.size()), "malformed command from rank 0");
    for (int64_t i = 0; i < words; ++i) p.bad_words_ids.push_back(get_vector());
    return p;
  }
  std::string get_string() {
    std::string s;
    for (int64_t c : get_vector()) s.push_back(static_cast<char>(c));
    return s;
  }
  void put(const StepPlan& p) {
    std::vector<int64_t> cut_ids, cut_counts;
    for (const auto& [id, n] : p.truncate) cut_ids.push_back(id), cut_counts.push_back(n);
    put(cut_ids), put(cut_counts);
    put(p.release), put(p.park), put(p.remove);
    put(static_cast<int64_t>(p.start.size()));
    for (const auto& s : p.start) put(s.seq_id), put(static_cast<int64_t>(s.seed)), put(s.eos_ids), put(s.prompt), put(s.sampling);
    put(p.decode.seq_ids), put(p.decode.positions), put(p.decode_tokens), put(p.decode_ban_eos);
    put(p.self_draft.sink_blocks), put(p.self_draft.window_blocks), put(static_cast<int64_t>(p.model_draft));
    put(static_cast<int64_t>(p.prefill.size()));
    for (const auto& w : p.prefill) {
      KV_CHECK(!w.chunked(), "internal: a sharded job prefills whole prompts (chunked prefill is local only)");
    }
    for (const auto& w : p.prefill)
      put(w.seq_id), put(w.policy), put(w.tokens), put(static_cast<int64_t>(w.sample)), put(static_cast<int64_t>(w.ban_eos)),
          put(static_cast<int64_t>(w.keep_copy)), put(w.cached), put(w.resume.seq_id), put(w.resume.length),
          put(w.context_len), put(static_cast<int64_t>(w.drafts));
  }
  StepPlan get_plan() {
    StepPlan p;
    const std::vector<int64_t> cut_ids = get_vector(), cut_counts = get_vector();
    KV_CHECK(cut_ids.size() == cut_counts.size(), "malformed command from rank 0");
    for (size_t i = 0; i < cut_ids.size(); ++i) p.truncate.push_back({cut_ids[i], cut_counts[i]});
    p.release = get_vector();
    p.park = get_vector();
    p.remove = get_vector();
    const int64_t starts = get();
    KV_CHECK(starts >= 0 && starts <= static_cast<int64_t>(payload.size()), "malformed command from rank 0");
    for (int64_t i = 0; i < starts; ++i) {
      SequenceStart s;
      s.seq_id = get();
      s.seed = static_cast<uint64_t>(get());
      s.eos_ids = get_vector();
      s.prompt = get_vector();
      s.sampling = get_params();
      p.start.push_back(std::move(s));
    }
    p.decode.seq_ids = get_vector();
    p.decode.positions = get_vector();
    p.decode_tokens = get_vector();
    p.decode_ban_eos = get_flags();
    p.self_draft.sink_blocks = get();
    p.self_draft.window_blocks = get();
    p.model_draft = get() != 0;
    KV_CHECK(p.self_draft.sink_blocks >= 0 && p.self_draft.window_blocks >= 0, "malformed command from rank 0");
    const int64_t prefills = get();
    KV_CHECK(prefills >= 0 && prefills <= static_cast<int64_t>(payload.size()), "malformed command from rank 0");
    for (int64_t i = 0; i < prefills; ++i) {
      PrefillWork w;
      w.seq_id = get();
      w.policy = get_string();
      w.tokens = get_vector();
      w.sample = get() != 0;
      w.ban_eos = get() != 0;
      w.keep_copy = get() != 0;
      w.cached = get();
      w.resume.seq_id = get();
      w.resume.length = get();
      w.context_len = get();
      w.drafts = get() != 0;
      KV_CHECK(w.context_len == 0 || (w.context_len > 0 && w.context_len < static_cast<int64_t>(w.tokens.size())),
               "malformed command from rank 0");
      p.prefill.push_back(std::move(w));
    }
    return p;
  }
};

namespace {

// A rank's self-draft setup, as rank 0's configure_self_draft sent it to every rank.
struct DraftSetup {
  bool sampled = false;  // draft_sampling "sample": the sampler rank draws a sampling sequence's drafts
};

ShardCommand draft_command(const SpeculativeConfig& spec) {
  ShardCommand c;
  c.op = ShardOp::kSelfDraft;
  c.put(spec.draft_policy);
  for (int64_t v : {spec.draft_budget, spec.min_context_tokens(), spec.draft_sink_tokens, spec.draft_refresh_tokens,
                    int64_t{spec.draft_sampling == "sample"}})
    c.put(v);
  return c;
}

// Sets this rank's memory up as the command says (a draft policy's selection runs on every shard,
// through the shards' score exchange, so every rank must have it from the same step on).
DraftSetup apply_draft_command(ShardCommand& c, PagedKvMemory& kv) {
  const std::string policy = c.get_string();
  const int64_t budget = c.get(), min_context = c.get(), sink = c.get(), refresh = c.get(), sampled = c.get();
  if (!policy.empty()) kv.set_draft_policy(policy, budget, min_context, sink, refresh);
  return {sampled != 0};
}

constexpr int kSampledTag = 9;
constexpr int kVerifiedTag = 10;  // a decode step's tokens per sequence (speculative) and its time, before the tokens

template <typename... Args>
ShardCommand command(ShardOp op, const Args&... args) {
  ShardCommand c;
  c.op = op;
  (c.put(args), ...);
  return c;
}

// A command travels in one broadcast of a fixed-size frame [op, payload size, payload...]; only a
// payload longer than the frame (a step with hundreds of rows, or long prompts) needs a second one.
constexpr int64_t kFrameWords = 1024;

void send_command(parallel::ProcessGroup& world, const ShardCommand& c) {
  const int64_t n = static_cast<int64_t>(c.payload.size());
  auto frame = torch::zeros({kFrameWords}, torch::kInt64);
  int64_t* f = frame.data_ptr<int64_t>();
  f[0] = static_cast<int64_t>(c.op);
  f[1] = n;
  const int64_t inline_words = std::min(n, kFrameWords - 2);
  std::copy(c.payload.begin(), c.payload.begin() + inline_words, f + 2);
  world.broadcast(frame, 0);
  if (n > inline_words) {
    auto rest = torch::tensor(std::vector<int64_t>(c.payload.begin() + inline_words, c.payload.end()), torch::kInt64);
    world.broadcast(rest, 0);
  }
}

ShardCommand receive_command(parallel::ProcessGroup& world) {
  auto frame = torch::zeros({kFrameWords}, torch::kInt64);
  world.broadcast(frame, 0);
  const int64_t* f = frame.data_ptr<int64_t>();
  ShardCommand c;
  c.op = static_cast<ShardOp>(f[0]);
  const int64_t n = f[1];
  KV_CHECK(n >= 0 && n < (int64_t{1} << 32), "malformed command header from rank 0");
  const int64_t inline_words = std::min(n, kFrameWords - 2);
  c.payload.assign(f + 2, f + 2 + inline_words);
  if (n > inline_words) {
    auto rest = torch::zeros({n - inline_words}, torch::kInt64);
    world.broadcast(rest, 0);
    c.payload.insert(c.payload.end(), rest.data_ptr<int64_t>(), rest.data_ptr<int64_t>() + (n - inline_words));
  }
  return c;
}

// KV tokens of a sequence as one process counts them (PagedKvMemory::kept_tokens), in parts that
// rank 0 sums and divides by kept_divisor. Layer-wise, TP rank 0 of each stage counts its layers (the
// other TP ranks hold the same lengths). Head-wise a layer counts its heads' mean, and TP ranks hold
// different heads: one replica of each KV head adds its heads' lengths, and the sum is divided by
// the model's KV heads.
int64_t local_kept(const PagedKvMemory& kv, const ShardLayout& s, int64_t seq_id) {
  if (!kv.geometry().head_blocks) return s.tp_rank == 0 ? kv.kept_tokens(seq_id) : 0;
  return s.tp_rank % s.kv_replicas == 0 ? kv.head_kept(seq_id).sum : 0;
}
int64_t kept_divisor(const PagedKvMemory& kv, const ShardLayout& s) {
  return kv.geometry().head_blocks ? s.kv_heads * s.tp_size / s.kv_replicas : 1;
}

// Sampled tokens travel to rank 0 as float64: token, chosen logprob, top count, (id, logprob)...
torch::Tensor pack(const std::vector<SampledToken>& v) {
  std::vector<double> d;
  for (const auto& t : v) {
    d.push_back(static_cast<double>(t.token));
    d.push_back(t.chosen.logprob);
    d.push_back(static_cast<double>(t.top.size()));
    for (const auto& x : t.top) d.push_back(static_cast<double>(x.token_id)), d.push_back(x.logprob);
  }
  return torch::tensor(d, torch::kFloat64);
}

std::vector<SampledToken> unpack(const torch::Tensor& t, size_t rows) {
  const double* d = t.data_ptr<double>();
  const int64_t n = t.numel();
  int64_t at = 0;
  std::vector<SampledToken> out(rows);
  for (auto& s : out) {
    KV_CHECK(at + 3 <= n, "malformed sampled tokens from the last pipeline stage");
    s.token = static_cast<int64_t>(d[at]);
    s.chosen.token_id = s.token;
    s.chosen.logprob = d[at + 1];
    const auto k = static_cast<int64_t>(d[at + 2]);
    at += 3;
    KV_CHECK(k >= 0 && at + 2 * k <= n, "malformed sampled tokens from the last pipeline stage");
    for (int64_t i = 0; i < k; ++i, at += 2) s.top.push_back({static_cast<int64_t>(d[at]), "", d[at + 1]});
  }
  return out;
}

// Prefix caching: the positions each of the plan's prompts takes from the prefix cache, the same on
// every rank (a prompt with a compressed context: its context's length when every shard holds the
// context compressed, else nothing). Rank 0's lookup is in the plan; a shard may have reclaimed some of those blocks since
// (pools of different shards run short at different times), so when rank 0 found anything the
// ranks agree on the least of what each holds now (one all-reduce). Called after the step's decode,
// which may reclaim, and before any prompt allocates.
std::vector<int64_t> agree_prefix_hits(const StepPlan& plan, const PagedKvMemory& kv, parallel::ProcessGroup& world) {
  const auto P = static_cast<int64_t>(plan.prefill.size());
  std::vector<int64_t> hits;
  for (const auto& w : plan.prefill) hits.push_back(w.cached);
  if (std::none_of(hits.begin(), hits.end(), [](int64_t h) { return h > 0; })) return hits;
  auto all = torch::zeros({world.size(), P}, torch::kInt64);
  int64_t* mine = all.data_ptr<int64_t>() + world.rank() * P;
  for (int64_t i = 0; i < P; ++i) {
    const auto& w = plan.prefill[static_cast<size_t>(i)];
    const int64_t holds = w.context_len > 0 ? kv.context_lookup(std::span(w.tokens).first(static_cast<size_t>(w.context_len)), w.policy)
                                            : kv.prefix_lookup(w.tokens, w.policy);
    mine[i] = w.cached > 0 ? std::min(w.cached, holds) : 0;
  }
  world.all_reduce_sum(all);
  auto least = std::get<0>(all.min(0));
  for (int64_t i = 0; i < P; ++i)
    if (hits[static_cast<size_t>(i)] > 0) hits[static_cast<size_t>(i)] = least[i].item<int64_t>();
  return hits;
}

// One step of `plan` on this rank: every rank runs the same executor calls on its shard; the
// sampler rank samples and sends rank 0 the tokens; one all-reduce brings every rank's pool (its
// slot of [geometry, occupancy, per row: held, demand, kept]) to every rank. Rank 0 gets the result.
StepResult run_step(const StepPlan& plan, ShardedExecutor& exec, PagedKvMemory& kv, SamplerBank& samplers,
                    parallel::ProcessGroup& world, const DraftSetup& setup, OwnCacheDraft& own) {
  const ShardLayout& layout = exec.layout();
  const int me = world.rank(), src = sampler_rank(layout);
  const bool sampler = me == src;
  KV_CHECK(!own.active || !sampler || own.drafter, "internal: the sampler rank holds no draft model of its own");
  if (own.drafter) own.drafter->begin_step(plan);
  for (const auto& [id, n] : plan.truncate) kv.truncate(id, n);
  for (int64_t id : plan.release) kv.release(id);
  for (int64_t id : plan.park) kv.park(id);
  for (int64_t id : plan.remove) samplers.remove(id);
  if (sampler)
    for (const auto& s : plan.start) samplers.add(s.seq_id, s.sampling, s.prompt, s.seed, s.eos_ids);

  std::vector<SampledToken> sampled;
  // A speculative step: the sampler verifies the drafts; rank 0 learns each sequence's count first.
  const bool drafts = has_drafts(plan.decode);
  const bool decodes = !plan.decode.seq_ids.empty();
  std::vector<int64_t> counts;
  // The decode part's time on the sampler's clock: from this step's start on that rank to its
  // verified tokens, i.e. the whole pipeline's forward (the last stage waits for the others) and the
  // sampling. It reaches rank 0 with the counts, for the speculation governor.
  int64_t decode_ns = 0;
  // Self-drafts and a draft model's: every rank runs the draft steps on its shard (of the model,
  // through the view, or of the draft model, over the whole cache); the sampler rank chooses each
  // step's drafts and one broadcast gives them to every rank for the next step.
  int64_t draft_steps_run = 0, draft_prefix_hits = -1;
  double draft_s = 0.0;
  std::vector<int64_t> tokens = plan.decode_tokens;
  std::vector<SampledDraft> sampled_drafts;
  const bool draws = sampler && setup.sampled;
  if (drafts && plan.model_draft && own.active) {
    // A draft of another shape: the sampler rank drafts alone, and one broadcast gives every rank
    // the rows' tokens (and rank 0 the draft steps run).
    const auto t0 = std::chrono::steady_clock::now();
    if (sampler)
      draft_steps_run = own.drafter->draft(plan.decode, tokens, draws ? &samplers : nullptr, draws ? &sampled_drafts : nullptr);
    // ... and the drafter's prefix-cache hits so far, for rank 0's /metrics.
    std::vector<int64_t> shared = tokens;
    shared.push_back(draft_steps_run);
    shared.push_back(sampler ? own.drafter->prefix_hits() : 0);
    auto t = torch::tensor(shared, torch::kInt64);
    world.broadcast(t, src);
    tokens.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel() - 2);
    draft_steps_run = t.data_ptr<int64_t>()[t.numel() - 2];
    draft_prefix_hits = t.data_ptr<int64_t>()[t.numel() - 1];
    draft_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } else if (drafts && (plan.self_draft.active() || plan.model_draft)) {
    const auto t0 = std::chrono::steady_clock::now();
    DraftStepFns fns;
    fns.forward = [&](const DecodeBatch& step, const std::vector<int64_t>& in) {
      torch::Tensor lg = exec.decode(step, in, /*to_rank0=*/false, /*with_draft=*/plan.model_draft);
      return sampler ? lg : torch::Tensor();
    };
    fns.share = [&](std::vector<int64_t>& chosen) {
      auto t = torch::tensor(chosen, torch::kInt64);
      world.broadcast(t, src);
      chosen.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
    };
    draft_steps_run = draft_steps(fns, kv, plan.decode, plan.self_draft, tokens, draws ? &samplers : nullptr,
                                  draws ? &sampled_drafts : nullptr);
    draft_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (decodes) {
    const auto start = std::chrono::steady_clock::now();
    auto logits = exec.decode(plan.decode, tokens, /*to_rank0=*/false);
    if (sampler) {
      VerifiedTokens v = verify_drafts(samplers, plan.decode, tokens, logits, plan.decode_ban_eos, sampled_drafts);
      if (own.drafter) own.drafter->after_decode(plan.decode, tokens, v.counts, /*failed=*/false);
      sampled = std::move(v.tokens);
      counts = std::move(v.counts);
      decode_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    }
  }
  // The draft of another shape follows this step's prompts at the next step's start.
  if (own.drafter) own.drafter->defer_prefills(plan.prefill);
  const std::vector<int64_t> hits = agree_prefix_hits(plan, kv, world);
  // Every prompt takes its agreed hit before any of them allocates. A compressed context taken from
  // the cache allocates as it starts (its partly filled blocks' copies, a copy back from the host
  // tier), so it starts last; rank 0 plans at most one per step (ShardedRunner::execute), so that
  // its allocation cannot reclaim another prompt's entry.
  for (const bool late : {false, true}) {
    for (size_t i = 0; i < plan.prefill.size(); ++i) {
      const auto& w = plan.prefill[i];
      if (late != (w.context_len > 0 && hits[i] > 0)) continue;
      if (w.context_len > 0)
        exec.begin_context(w.seq_id, w.tokens, w.context_len, w.policy, hits[i] > 0, w.keep_copy);
      else
        exec.begin_prefill(w.seq_id, w.tokens, w.policy, hits[i], w.keep_copy, w.resume);
    }
  }
  for (size_t i = 0; i < plan.prefill.size(); ++i) {
    const auto& w = plan.prefill[i];
    const int64_t from = w.resume.seq_id >= 0 ? w.resume.length : std::max<int64_t>(hits[i], 0);
    auto logits = w.context_len > 0 ? exec.run_context(w.seq_id, w.tokens, w.context_len, hits[i] > 0, /*to_rank0=*/false)
                                    : exec.run_prefill(w.seq_id, w.tokens, from, false, /*to_rank0=*/false);
    if (sampler && w.sample) sampled.push_back(samplers.sample(w.seq_id, logits[0], w.ban_eos));
  }
  if (sampler && me != 0) {
    if (decodes) {
      std::vector<int64_t> head = counts;  // [counts per sequence (speculative steps only)..., decode_ns]
      head.push_back(decode_ns);
      world.send_tensor(torch::tensor(head, torch::kInt64), 0, kVerifiedTag);
    }
    world.send_tensor(pack(sampled), 0, kSampledTag);
    world.wait_sends();
  } else if (me == 0 && !sampler) {
    size_t rows = plan.decode.seq_ids.size();
    if (decodes) {
      const torch::Tensor c = world.recv_tensor(src, kVerifiedTag, torch::kCPU);
      KV_CHECK(c.numel() >= 1, "internal: a decode step's counts and time came without the time");
      counts.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel() - 1);
      decode_ns = c.data_ptr<int64_t>()[c.numel() - 1];
    }
    if (drafts) {
      rows = 0;
      for (int64_t n : counts) rows += static_cast<size_t>(n);
    }
    for (const auto& w : plan.prefill) rows += w.sample;
    sampled = unpack(world.recv_tensor(src, kSampledTag, torch::kCPU), rows);
  }

  const ShardUsage mine = shard_usage(kv, plan);
  const int64_t R = static_cast<int64_t>(mine.held.size());
  constexpr int64_t kHead = 21;
  constexpr int64_t kRow = 7;  // per sequence: held, demand, kept, and the head stats (min, max, sum, tables)
  const int64_t slot = kHead + kRow * R;
  auto all = torch::zeros({world.size() * slot}, torch::kInt64);
  int64_t* d = all.data_ptr<int64_t>() + me * slot;
  const auto& g = mine.geometry;
  for (int64_t v : {g.first_layer, g.num_layers, g.total_layers, g.num_kv_heads, g.block_size, int64_t{g.rounds_kv},
                    int64_t{g.prefix_caching}, mine.blocks_total,
                    mine.blocks_used, mine.blocks_high_water, mine.blocks_cached, mine.cached_bytes,
                    mine.block_bytes, mine.host_cached_bytes, mine.host_capacity_bytes, mine.host_stores,
                    mine.host_loads, int64_t{g.head_blocks}, mine.context_entries, mine.context_blocks,
                    mine.context_full_blocks})
    *d++ = v;
  std::vector<int64_t> rows = plan.decode.seq_ids;
  for (const auto& w : plan.prefill) rows.push_back(w.seq_id);
  for (int64_t r = 0; r < R; ++r) {
    *d++ = mine.held[static_cast<size_t>(r)];
    *d++ = mine.demand[static_cast<size_t>(r)];
    *d++ = local_kept(kv, layout, rows[static_cast<size_t>(r)]);
    const auto hk = kv.head_kept(rows[static_cast<size_t>(r)]);
    for (int64_t v : {hk.min, hk.max, hk.sum, hk.count}) *d++ = v;
  }
  world.all_reduce_sum(all);
  if (me != 0) return {};

  StepResult result;
  // The verify part on the sampler's clock; the draft steps on rank 0's, which takes part in each
  // step's broadcast of drafts and so ends its loop with the last of them. Prompt lookup drafts on
  // rank 0's host, before the step.
  result.decode_s = static_cast<double>(decode_ns) * 1e-9 + draft_s;
  if (drafts) result.verify_s = static_cast<double>(decode_ns) * 1e-9;
  result.draft_s = draft_s;
  result.draft_steps = draft_steps_run;
  result.draft_prefix_hits = draft_prefix_hits;
  const int64_t* a = all.data_ptr<int64_t>();
  std::vector<int64_t> kept(static_cast<size_t>(R), 0);
  std::vector<PagedKvMemory::HeadKeptStats> heads(static_cast<size_t>(R));
  for (int rank = 0; rank < world.size(); ++rank, a += slot) {
    ShardUsage u;
    // The whole geometry: the scheduler's admission reads prefix_caching (room for a compressing
    // prompt's cache copy) and rounds_kv from it.
    u.geometry = {a[0], a[1], a[2], a[3], a[4], a[5] != 0, a[6] != 0, a[17] != 0};
    u.blocks_total = a[7];
    u.blocks_used = a[8];
    u.blocks_high_water = a[9];
    u.blocks_cached = a[10];
    u.cached_bytes = a[11];
    u.block_bytes = a[12];
    u.host_cached_bytes = a[13];
    u.host_capacity_bytes = a[14];
    u.host_stores = a[15];
    u.host_loads = a[16];
    u.context_entries = a[18];
    u.context_blocks = a[19];
    u.context_full_blocks = a[20];
    for (int64_t r = 0; r < R; ++r) {
      const int64_t* row = a + kHead + kRow * r;
      u.held.push_back(row[0]);
      u.demand.push_back(row[1]);
      kept[static_cast<size_t>(r)] += row[2];
      // Every rank reports its own heads' stats: least of the least, most of the most.
      PagedKvMemory::HeadKeptStats& hk = heads[static_cast<size_t>(r)];
      if (row[6] > 0) {
        hk.min = hk.count ? std::min(hk.min, row[3]) : row[3];
        hk.max = std::max(hk.max, row[4]);
        hk.sum += row[5];
        hk.count += row[6];
      }
    }
    result.shards.push_back(std::move(u));
  }
  size_t next = 0;
  size_t decoded = plan.decode.seq_ids.size();
  if (drafts) {
    decoded = 0;
    for (int64_t n : counts) decoded += static_cast<size_t>(n);
    result.decode_counts = counts;
  }
  for (size_t i = 0; i < decoded; ++i) result.decoded.push_back(std::move(sampled.at(next++)));
  for (size_t p = 0; p < plan.prefill.size(); ++p) {
    PrefillOutcome o;
    if (plan.prefill[p].sample) o.first = std::move(sampled.at(next++));
    o.kept_tokens = kept[plan.decode.seq_ids.size() + p] / kept_divisor(kv, layout);
    const PagedKvMemory::HeadKeptStats& hk = heads[plan.decode.seq_ids.size() + p];
    o.kept_head_min = hk.min;
    o.kept_head_max = hk.max;
    o.kept_head_sum = hk.sum;
    o.head_tables = hk.count;
    o.queried_tokens = kv.prefix_queried(plan.prefill[p].seq_id);
    o.cached_tokens = kv.prefix_hit(plan.prefill[p].seq_id);
    result.prefilled.push_back(std::move(o));
  }
  return result;
}

// This rank's part of a draft: a slice for the executor, or (a draft of another shape) the sampler
// rank's drafter over a cache of its own.
OwnCacheDraft set_up_draft(ShardDraft draft, ShardedExecutor& exec, const PagedKvMemory& kv) {
  OwnCacheDraft own;
  if (!draft.own_cache) {
    exec.set_draft_model(std::move(draft.model));
    return own;
  }
  own.active = true;
  if (draft.model) own.drafter = make_separate_kv_drafter(std::move(draft.model), kv, draft.why);
  return own;
}

}  // namespace

int sampler_rank(const ShardLayout& s) { return static_cast<int>(s.global_rank(s.pp_size - 1, 0)); }

OwnCacheDraft::OwnCacheDraft() = default;
OwnCacheDraft::OwnCacheDraft(OwnCacheDraft&&) noexcept = default;
OwnCacheDraft& OwnCacheDraft::operator=(OwnCacheDraft&&) noexcept = default;
OwnCacheDraft::~OwnCacheDraft() = default;

ShardedRunner::ShardedRunner(std::unique_ptr<PagedKvMemory> kv, std::shared_ptr<DecoderModel> model, parallel::ParallelGroups groups,
                             int64_t micro_batches, std::function<void(const std::string&)> on_comm_failure, ShardDraft draft)
    : kv_(std::move(kv)), groups_(groups), exec_(std::move(model), *kv_, groups, micro_batches),
      on_comm_failure_(std::move(on_comm_failure)) {
  KV_CHECK(groups_.world->rank() == 0, "internal: the sharded runner lives on rank 0");
  own_draft_ = set_up_draft(std::move(draft), exec_, *kv_);
}

ShardedRunner::~ShardedRunner() { stop(); }

bool ShardedRunner::samples_in_process() const { return sampler_rank(exec_.layout()) == 0; }

void ShardedRunner::stop() {
  if (dead_ || stopped_) return;
  stopped_ = true;
  try {
    send_command(*groups_.world, command(ShardOp::kShutdown));
  } catch (const std::exception& e) {
    KV_LOG("stopping the workers: " << e.what());
  }
}

// Any failure inside a step leaves the ranks out of step with each other, so it ends the job: the
// engine then fails every request with the reason instead of hanging.
template <typename F>
auto ShardedRunner::guarded(F&& f) -> decltype(f()) {
  KV_CHECK(!dead_, "the sharded job has failed; restart the server");
  KV_CHECK(!stopped_, "internal: the sharded job was stopped");
  try {
    return f();
  } catch (const parallel::CommError& e) {
    dead_ = true;
    if (on_comm_failure_) on_comm_failure_(e.what());
    throw;
  } catch (const std::exception& e) {
    dead_ = true;
    if (on_comm_failure_) on_comm_failure_(e.what());
    throw parallel::CommError(std::string("a step failed on rank 0: ") + e.what());
  }
}

StepResult ShardedRunner::execute(const StepPlan& plan) {
  return guarded([&] {
    const int64_t before = groups_.world->collectives();
    // The prefix-cache decision is rank 0's, made here and sent with the plan.
    StepPlan sent = plan;
    bool context_hit = false;  // one per step (run_step)
    for (auto& w : sent.prefill) {
      if (w.context_len > 0) {
        KV_CHECK(w.start == 0 && w.resume.seq_id < 0, "internal: a compressed context in a chunk or a resumed prompt");
        const bool hit =
            !context_hit && kv_->context_lookup(std::span(w.tokens).first(static_cast<size_t>(w.context_len)), w.policy) > 0;
        w.cached = hit ? w.context_len : KvMemory::kNoLookup;
        context_hit = context_hit || hit;
        continue;
      }
      w.cached = kv_->prefix_caching() && w.start == 0 && w.resume.seq_id < 0 && w.reuse_prefix
                     ? kv_->prefix_lookup(w.tokens, w.policy)
                     : KvMemory::kNoLookup;
    }
    send_command(*groups_.world, command(ShardOp::kStep, sent));
    StepResult r = run_step(sent, exec_, *kv_, samplers_, *groups_.world, {sampled_drafts_}, own_draft_);
    step_collectives_ += groups_.world->collectives() - before;
    return r;
  });
}

void ShardedRunner::configure_self_draft(const SpeculativeConfig& spec) {
  ShardCommand c = draft_command(spec);
  // Rank 0 first: a configuration error (an unknown draft policy) stops the start before any
  // worker changes.
  sampled_drafts_ = apply_draft_command(c, *kv_).sampled;
  guarded([&] {
    send_command(*groups_.world, c);
    return 0;
  });
}

void ShardedRunner::idle() {
  guarded([&] {
    send_command(*groups_.world, command(ShardOp::kPing));
    return 0;
  });
}

int run_shard_worker(std::unique_ptr<PagedKvMemory> kv, std::shared_ptr<DecoderModel> model, parallel::ParallelGroups groups,
                     int64_t micro_batches, ShardDraft draft) {
  ShardedExecutor exec(std::move(model), *kv, groups, micro_batches);
  OwnCacheDraft own = set_up_draft(std::move(draft), exec, *kv);
  SamplerBank samplers;  // used on the sampler rank only
  DraftSetup setup;
  auto& world = *groups.world;
  try {
    for (;;) {
      ShardCommand c = receive_command(world);
      switch (c.op) {
        case ShardOp::kStep:
          run_step(c.get_plan(), exec, *kv, samplers, world, setup, own);
          break;
        case ShardOp::kSelfDraft:
          setup = apply_draft_command(c, *kv);
          break;
        case ShardOp::kPing:
          break;
        case ShardOp::kShutdown:
          return 0;
        default:
          KV_FAIL("unknown command " << static_cast<int64_t>(c.op) << " from rank 0");
      }
    }
  } catch (const std::exception& e) {
    KV_LOG("rank " << world.ranks()[static_cast<size_t>(world.rank())] << ": " << e.what()
              << "; this worker exits");
    return 1;
  }
}

}  // namespace kvserve
