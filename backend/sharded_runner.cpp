#include "sharded_runner.h"

#include <bit>
#include <iostream>

#include "communicator.h"
#include "kv_check.h"
#include "llama_model.h"

namespace kvserve {

enum class ShardOp : int64_t {
  kPrefill = 1,
  kDecode,
  kRelease,
  kCanPrefill,
  kFitsWhenEmpty,
  kCanDecode,
  kKeptTokens,
  kUsage,
  kPing,
  kShutdown,
  kAddSequence,
  kRemoveSequence,
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
    return p;
  }
  std::string get_string() {
    std::string s;
    for (int64_t c : get_vector()) s.push_back(static_cast<char>(c));
    return s;
  }
};

namespace {

constexpr int kSampledTag = 9;

template <typename... Args>
ShardCommand command(ShardOp op, const Args&... args) {
  ShardCommand c;
  c.op = op;
  (c.put(args), ...);
  return c;
}

void send_command(parallel::ProcessGroup& world, const ShardCommand& c) {
  auto header = torch::tensor({static_cast<int64_t>(c.op), static_cast<int64_t>(c.payload.size())}, torch::kInt64);
  world.broadcast(header, 0);
  if (!c.payload.empty()) {
    auto body = torch::tensor(c.payload, torch::kInt64);
    world.broadcast(body, 0);
  }
}

ShardCommand receive_command(parallel::ProcessGroup& world) {
  auto header = torch::zeros({2}, torch::kInt64);
  world.broadcast(header, 0);
  ShardCommand c;
  c.op = static_cast<ShardOp>(header[0].item<int64_t>());
  const int64_t n = header[1].item<int64_t>();
  KV_CHECK(n >= 0 && n < (int64_t{1} << 32), "malformed command header from rank 0");
  if (n > 0) {
    auto body = torch::zeros({n}, torch::kInt64);
    world.broadcast(body, 0);
    c.payload.assign(body.data_ptr<int64_t>(), body.data_ptr<int64_t>() + n);
  }
  return c;
}

// Sums one int64 per rank over the world (admission answers: count of shards that say no).
int64_t world_sum(parallel::ProcessGroup& world, int64_t v) {
  auto t = torch::tensor({v}, torch::kInt64);
  world.all_reduce_sum(t);
  return t.item<int64_t>();
}

KvUsage world_usage(parallel::ProcessGroup& world, const PagedKvMemory& kv) {
  auto t = torch::tensor({kv.blocks_total(), kv.blocks_used(), kv.blocks_high_water()}, torch::kInt64);
  world.all_reduce_sum(t);
  return {t[0].item<int64_t>(), t[1].item<int64_t>(), t[2].item<int64_t>()};
}

// KV tokens of a sequence counted once per layer: TP ranks of a stage hold the same layers.
int64_t local_kept(const PagedKvMemory& kv, const ShardLayout& s, int64_t seq_id) {
  return s.tp_rank == 0 ? kv.kept_tokens(seq_id) : 0;
}

// The rank that samples: the last stage's first TP rank (every TP rank there has the full logits).
int sampler_rank(const ShardLayout& s) { return static_cast<int>(s.global_rank(s.pp_size - 1, 0)); }

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

// Every rank calls it after a step with its logits (defined on the last stage): the sampler rank
// samples each row, and rank 0 gets the tokens (only they and the requested logprobs travel).
std::vector<SampledToken> sample_rows(parallel::ProcessGroup& world, const ShardLayout& s, SamplerBank& bank,
                                      const torch::Tensor& logits, const std::vector<int64_t>& seq_ids,
                                      const std::vector<char>& ban) {
  std::vector<SampledToken> out;
  const int me = world.rank(), src = sampler_rank(s);
  if (me == src) {
    for (size_t i = 0; i < seq_ids.size(); ++i) out.push_back(bank.sample(seq_ids[i], logits[static_cast<int64_t>(i)], ban[i]));
    if (me != 0) {
      world.send_tensor(pack(out), 0, kSampledTag);
      world.wait_sends();
    }
  } else if (me == 0) {
    out = unpack(world.recv_tensor(src, kSampledTag, torch::kCPU), seq_ids.size());
  }
  return out;
}

DecodeBatch decode_batch(ShardCommand& c, std::vector<int64_t>* tokens) {
  DecodeBatch b;
  b.seq_ids = c.get_vector();
  b.positions = c.get_vector();
  *tokens = c.get_vector();
  return b;
}

}  // namespace

ShardedRunner::ShardedRunner(std::unique_ptr<PagedKvMemory> kv, std::shared_ptr<LlamaModel> model, ParallelGroups groups,
                             int64_t micro_batches, std::function<void(const std::string&)> on_comm_failure)
    : kv_(std::move(kv)), groups_(groups), exec_(std::move(model), *kv_, groups, micro_batches),
      on_comm_failure_(std::move(on_comm_failure)) {
  KV_CHECK(groups_.world->rank() == 0, "internal: the sharded runner lives on rank 0");
}

ShardedRunner::~ShardedRunner() { stop(); }

void ShardedRunner::stop() {
  if (dead_ || stopped_) return;
  stopped_ = true;
  try {
    send_command(*groups_.world, command(ShardOp::kShutdown));
  } catch (const std::exception& e) {
    std::cerr << "kvserve: stopping the workers: " << e.what() << "\n";
  }
}

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
  }
}

void ShardedRunner::add_sequence(int64_t seq_id, const SamplingParams& params, const std::vector<int64_t>& prompt,
                                 uint64_t seed, const std::vector<int64_t>& eos_ids) {
  guarded([&] {
    send_command(*groups_.world, command(ShardOp::kAddSequence, seq_id, static_cast<int64_t>(seed), eos_ids, prompt, params));
    if (sampler_rank(exec_.layout()) == 0) samplers_.add(seq_id, params, prompt, seed, eos_ids);
    return 0;
  });
}

void ShardedRunner::remove_sequence(int64_t seq_id) {
  guarded([&] {
    send_command(*groups_.world, command(ShardOp::kRemoveSequence, seq_id));
    samplers_.remove(seq_id);
    return 0;
  });
}

std::optional<SampledToken> ShardedRunner::prefill(int64_t seq_id, const std::vector<int64_t>& tokens,
                                                   const std::string& policy, bool sample, bool ban_eos) {
  return guarded([&]() -> std::optional<SampledToken> {
    send_command(*groups_.world, command(ShardOp::kPrefill, seq_id, policy, tokens, static_cast<int64_t>(sample),
                                         static_cast<int64_t>(ban_eos)));
    auto logits = exec_.prefill(seq_id, tokens, policy, false, /*to_rank0=*/false);
    if (!sample) return std::nullopt;
    return sample_rows(*groups_.world, exec_.layout(), samplers_, logits, {seq_id}, {static_cast<char>(ban_eos)})[0];
  });
}

std::vector<SampledToken> ShardedRunner::decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens,
                                                const std::vector<char>& ban_eos) {
  return guarded([&] {
    send_command(*groups_.world, command(ShardOp::kDecode, batch.seq_ids, batch.positions, tokens, ban_eos));
    auto logits = exec_.decode(batch, tokens, /*to_rank0=*/false);
    return sample_rows(*groups_.world, exec_.layout(), samplers_, logits, batch.seq_ids, ban_eos);
  });
}

void ShardedRunner::release(int64_t seq_id) {
  guarded([&] {
    send_command(*groups_.world, command(ShardOp::kRelease, seq_id));
    kv_->release(seq_id);
    return 0;
  });
}

bool ShardedRunner::every_shard(const ShardCommand& c, const std::function<bool()>& local) {
  return guarded([&] {
    send_command(*groups_.world, c);
    return world_sum(*groups_.world, local() ? 0 : 1) == 0;
  });
}

bool ShardedRunner::can_prefill(int64_t n, const std::string& policy) {
  return every_shard(command(ShardOp::kCanPrefill, n, policy), [&] { return kv_->can_prefill(n, policy); });
}

bool ShardedRunner::fits_when_empty(int64_t n, const std::string& policy) {
  return every_shard(command(ShardOp::kFitsWhenEmpty, n, policy), [&] { return kv_->fits_when_empty(n, policy); });
}

bool ShardedRunner::can_decode(const std::vector<int64_t>& ids) {
  return every_shard(command(ShardOp::kCanDecode, ids), [&] { return kv_->can_decode(ids); });
}

int64_t ShardedRunner::kept_tokens(int64_t seq_id) {
  return guarded([&] {
    send_command(*groups_.world, command(ShardOp::kKeptTokens, seq_id));
    return world_sum(*groups_.world, local_kept(*kv_, exec_.layout(), seq_id));
  });
}

KvUsage ShardedRunner::usage() {
  return guarded([&] {
    send_command(*groups_.world, command(ShardOp::kUsage));
    return world_usage(*groups_.world, *kv_);
  });
}

void ShardedRunner::idle() {
  guarded([&] {
    send_command(*groups_.world, command(ShardOp::kPing));
    return 0;
  });
}

int run_shard_worker(std::unique_ptr<PagedKvMemory> kv, std::shared_ptr<LlamaModel> model, ParallelGroups groups,
                     int64_t micro_batches) {
  const ShardLayout layout = model->layout();
  ShardedExecutor exec(std::move(model), *kv, groups, micro_batches);
  SamplerBank samplers;  // used on the sampler rank only
  const bool sampler = sampler_rank(layout) == groups.world->rank();
  auto& world = *groups.world;
  try {
    for (;;) {
      ShardCommand c = receive_command(world);
      switch (c.op) {
        case ShardOp::kAddSequence: {
          const int64_t seq = c.get();
          const auto seed = static_cast<uint64_t>(c.get());
          auto eos = c.get_vector();
          auto prompt = c.get_vector();
          const SamplingParams params = c.get_params();
          if (sampler) samplers.add(seq, params, prompt, seed, std::move(eos));
          break;
        }
        case ShardOp::kRemoveSequence:
          samplers.remove(c.get());
          break;
        case ShardOp::kPrefill: {
          const int64_t seq = c.get();
          const std::string policy = c.get_string();
          const auto tokens = c.get_vector();
          const bool sample = c.get() != 0;
          const char ban = static_cast<char>(c.get());
          auto logits = exec.prefill(seq, tokens, policy, false, /*to_rank0=*/false);
          if (sample) sample_rows(world, layout, samplers, logits, {seq}, {ban});
          break;
        }
        case ShardOp::kDecode: {
          std::vector<int64_t> tokens;
          const DecodeBatch b = decode_batch(c, &tokens);
          const auto ban = c.get_flags();
          auto logits = exec.decode(b, tokens, /*to_rank0=*/false);
          sample_rows(world, layout, samplers, logits, b.seq_ids, ban);
          break;
        }
        case ShardOp::kRelease:
          kv->release(c.get());
          break;
        case ShardOp::kCanPrefill: {
          const int64_t n = c.get();
          world_sum(world, kv->can_prefill(n, c.get_string()) ? 0 : 1);
          break;
        }
        case ShardOp::kFitsWhenEmpty: {
          const int64_t n = c.get();
          world_sum(world, kv->fits_when_empty(n, c.get_string()) ? 0 : 1);
          break;
        }
        case ShardOp::kCanDecode:
          world_sum(world, kv->can_decode(c.get_vector()) ? 0 : 1);
          break;
        case ShardOp::kKeptTokens:
          world_sum(world, local_kept(*kv, layout, c.get()));
          break;
        case ShardOp::kUsage:
          world_usage(world, *kv);
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
    std::cerr << "kvserve: rank " << world.ranks()[static_cast<size_t>(world.rank())] << ": " << e.what()
              << "; this worker exits\n";
    return 1;
  }
}

}  // namespace kvserve
