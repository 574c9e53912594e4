#include "sharded_runner.h"

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
};

// A command: op + int64 payload (strings as one byte per element).
struct ShardCommand {
  ShardOp op = ShardOp::kPing;
  std::vector<int64_t> payload;
  size_t at = 0;  // read cursor

  void put(int64_t v) { payload.push_back(v); }
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
  std::string get_string() {
    std::string s;
    for (int64_t c : get_vector()) s.push_back(static_cast<char>(c));
    return s;
  }
};

namespace {

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

torch::Tensor ShardedRunner::prefill(int64_t seq_id, const std::vector<int64_t>& tokens, const std::string& policy) {
  return guarded([&] {
    send_command(*groups_.world, command(ShardOp::kPrefill, seq_id, policy, tokens));
    return exec_.prefill(seq_id, tokens, policy, false);
  });
}

torch::Tensor ShardedRunner::decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens) {
  return guarded([&] {
    send_command(*groups_.world, command(ShardOp::kDecode, batch.seq_ids, batch.positions, tokens));
    return exec_.decode(batch, tokens);
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
  auto& world = *groups.world;
  try {
    for (;;) {
      ShardCommand c = receive_command(world);
      switch (c.op) {
        case ShardOp::kPrefill: {
          const int64_t seq = c.get();
          const std::string policy = c.get_string();
          exec.prefill(seq, c.get_vector(), policy, false);
          break;
        }
        case ShardOp::kDecode: {
          std::vector<int64_t> tokens;
          const DecodeBatch b = decode_batch(c, &tokens);
          exec.decode(b, tokens);
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
