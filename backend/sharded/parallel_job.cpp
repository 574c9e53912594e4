#include "backend/sharded/parallel_job.h"

#include "backend/model/weight_source.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <thread>

#include "backend/sharded/sharded_runner.h"
#include "backend/spec_decode/draft_model.h"
#include "common/check.h"
#include "common/fresh_thread.h"
#include "common/log.h"
#include "parallel/communicator.h"
#include "parallel/launcher.h"
#include "parallel/shard_score_exchange.h"

namespace kvserve {

std::unique_ptr<ParallelJob> ParallelJob::start(const ParallelOptions& o, const std::string& model_dir, LoadOptions load) {
  std::unique_ptr<ParallelJob> job(new ParallelJob());
  job->options_ = o;
  job->model_dir_ = model_dir;
  KV_CHECK(o.tensor_parallel_size >= 1, "tensor parallel size must be >= 1, got " << o.tensor_parallel_size);
  KV_CHECK(o.pipeline_parallel_size >= 1, "pipeline parallel size must be >= 1, got " << o.pipeline_parallel_size);
  KV_CHECK(o.timeout_s > 0, "parallel timeout must be > 0 s, got " << o.timeout_s);
  KV_CHECK(o.micro_batches >= 0, "micro-batches must be >= 0, got " << o.micro_batches);
  // Check the split against the model before starting any process.
  const ModelConfig cfg = read_model_config(model_dir);
  validate_parallel_shape(model_shape(cfg), o.tensor_parallel_size, o.pipeline_parallel_size, o.pipeline_layers);

  parallel::LaunchSpec spec;
  spec.world_size = static_cast<int>(o.world_size());
  spec.nnodes = o.nnodes;
  spec.node_rank = o.node_rank;
  spec.master_addr = o.master_addr;
  spec.master_port = o.master_port;
  bool must_spawn = false;
  const parallel::DistEnv env = parallel::plan_process(spec, &must_spawn);
  job->rank_ = env.rank;
  job->world_size_ = env.world_size;
  // The loads run on a thread that ends (common/fresh_thread.h): the OpenMP pool their parallel
  // casts and copies start goes with it, instead of idling beside the engine thread's for the
  // process's life. Only the load: a rank spawned below dies with the thread that spawned it.
  if (env.world_size == 1) {
    job->load_ = load;
    job->model_ = run_on_fresh_thread([&] { return DecoderModel::load(model_dir, load); });
    return job;
  }
  if (must_spawn) job->workers_ = parallel::WorkerGroup::spawn(env);

  const bool cuda = load.device.rfind("cuda", 0) == 0;
  if (cuda && load.device == "cuda") load.device = "cuda:" + std::to_string(env.local_rank);
  if (!cuda && !std::getenv("OMP_NUM_THREADS")) {
    // CPU ranks on one machine share its cores: without a split every rank's thread pool would
    // claim all of them and they would fight (OMP_NUM_THREADS overrides).
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    at::set_num_threads(std::max(1, cores / env.local_world_size));
  }
  parallel::CommOptions co;
  co.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));
  job->comm_ = parallel::Communicator::connect(env, co);
  const std::string backend = cuda ? "nccl" : "gloo";
  const int64_t tp = o.tensor_parallel_size, stage = env.rank / tp, tp_rank = env.rank % tp;
  job->groups_.world = std::shared_ptr<parallel::ProcessGroup>(job->comm_, &job->comm_->world());
  if (cuda) {
    std::vector<int> all(static_cast<size_t>(env.world_size));
    for (int i = 0; i < env.world_size; ++i) all[static_cast<size_t>(i)] = i;
    job->groups_.data = job->comm_->new_group("data", all, backend);
  } else {
    job->groups_.data = job->groups_.world;
  }
  if (tp > 1) {
    std::vector<int> members;
    for (int64_t t = 0; t < tp; ++t) members.push_back(static_cast<int>(stage * tp + t));
    job->groups_.tp = job->comm_->new_group("tp" + std::to_string(stage), members, backend);
  }
  load.layout = make_shard_layout(model_shape(cfg), tp, tp_rank, o.pipeline_parallel_size, stage, o.pipeline_layers);
  load.tp_group = job->groups_.tp;
  load.progress = load.progress && env.rank == 0;
  job->load_ = load;
  job->model_ = run_on_fresh_thread([&] { return DecoderModel::load(model_dir, load); });
  KV_LOG("rank " << env.rank << "/" << env.world_size << " ready: " << load.layout.describe());
  return job;
}

ParallelJob::~ParallelJob() {
  if (workers_) workers_->shutdown(std::chrono::milliseconds(5000));
}

void ParallelJob::set_on_failure(std::function<void(const std::string&)> f) {
  if (workers_) workers_->set_on_failure(std::move(f));
}

void ParallelJob::stop_workers() {
  if (workers_) workers_->shutdown(std::chrono::milliseconds(3000));
}

void ParallelJob::join_workers() {
  if (workers_) workers_->join(std::chrono::milliseconds(10000));
}

KvShard ParallelJob::kv_shard() const {
  KvShard shard;
  if (!sharded()) return shard;
  const ModelConfig& cfg = model_->config();
  shard.exchange = std::make_shared<parallel::ShardScoreExchange>(model_->layout(), cfg.num_key_value_heads,
                                                                  cfg.num_attention_heads, groups_, model_->device());
  return shard;
}

namespace {
KvPoolSize pool_size(const EngineOptions& options) {
  return {options.block_size,     0, options.kv_cache_bytes, options.enable_prefix_caching, options.prefix_cache_bytes,
          options.kv_layout, options.enable_context_caching};
}
}  // namespace

std::unique_ptr<PagedKvMemory> ParallelJob::make_memory(const EngineOptions& requested) const {
  // Every shard caches its own layers and heads; rank 0 makes the lookup decision (ShardedRunner).
  const EngineOptions options = options_for_model(requested, model_->config());
  return make_kv_memory(model_->kv_layout(), pool_size(options), resolve_policies(options.policies),
                        options.default_policy, kv_shard());
}

std::unique_ptr<MixedKvMemory> ParallelJob::make_local_memory(const EngineOptions& requested) const {
  // One process: policies may store their sequences in KV dtypes of their own (PolicyConfig::kv_dtype).
  const EngineOptions options = options_for_model(requested, model_->config());
  auto policies = resolve_policies(options.policies);
  const KvFormats formats = model_->kv_formats(policies);
  return make_mixed_kv_memory(formats, pool_size(options), std::move(policies), options.default_policy);
}

std::unique_ptr<ModelRunner> ParallelJob::make_runner(const EngineOptions& options) {
  KV_CHECK(is_driver(), "internal: only rank 0 drives the engine");
  // The draft's weights first: a KV pool sized by the device's free memory leaves them none.
  ShardDraft draft = load_draft(options);
  if (!sharded()) {
    auto runner = std::make_unique<LocalRunner>(
        model_, make_local_memory(options), LocalRunnerOptions{options.max_num_seqs, options.enforce_eager, options.max_num_batched_tokens});
    runner->set_draft_model(std::move(draft.model));
    return runner;
  }
  return std::make_unique<ShardedRunner>(make_memory(options), model_, groups_, options_.micro_batches,
                                         [this](const std::string&) { stop_workers(); }, std::move(draft));
}

ShardDraft ParallelJob::load_draft(const EngineOptions& options) const {
  const SpeculativeConfig& spec = options.speculative;
  if (!spec.loads_draft_model()) return {};
  spec.validate("speculative_config");
  const std::string path = spec.model.empty() ? model_dir_ : spec.model;
  const std::string field = spec.model.empty() ? "speculative_config.quantization" : "speculative_config.model";
  // A self-draft reads the served model's cache through its view.
  auto refuse_for_self = [&](const std::string& why) {
    KV_CHECK(!spec.self_draft() || why.empty(), "speculative_config.model: method 'self' drafts over the served model's KV, "
                                                "so its draft model must share the served model's KV layout (a "
                                                "quantized copy of it): "
                                                    << why);
  };
  ShardDraft d;
  // A draft of the served model's KV layout reads its cache: every rank loads its slice of it, split
  // as the served model is (its layers and heads). One of another shape drafts over a cache of its
  // own: under parallelism the sampler rank alone holds the whole of it. Every rank decides alike,
  // from the configs.
  if (sharded()) {
    ModelConfig dc;
    try {
      dc = read_model_config(path);
    } catch (const std::exception& e) {
      KV_FAIL(field << ": the draft model " << path << " did not load: " << e.what());
    }
    d.why = draft_layout_mismatch(model_->config(), dc);
    d.own_cache = !d.why.empty();
    refuse_for_self(d.why);
  }
  const int sampler = sampler_rank(load_.layout);
  if (!d.own_cache || rank_ == sampler) {
    LoadOptions load = load_;
    if (d.own_cache) {
      load.layout = ShardLayout{};
      load.tp_group = nullptr;
      load.progress = false;
    }
    d.model = run_on_fresh_thread([&] { return load_draft_model(spec, *model_, model_dir_, load); });
    if (!d.own_cache) {
      const std::string why = draft_model_mismatch(*model_, *d.model);
      refuse_for_self(why);
      KV_CHECK(!sharded() || why.empty(), field << ": under tensor or pipeline parallelism a draft of the served model's KV "
                                                   "layout must also have its compute dtype and device: "
                                                << why);
    }
  }
  if (rank_ == 0) {
    std::ostringstream what;
    if (d.model)
      what << d.model->weight_format() << ", " << d.model->weight_bytes() / (1 << 20) << " MiB of weights"
           << (sharded() ? " on rank 0" : "");
    else
      what << "all of it on rank " << sampler << ", which samples";
    KV_LOG("speculative_config: the draft model is " << path << " (" << what.str() << ")");
  }
  return d;
}

int ParallelJob::run_worker(const EngineOptions& options) {
  KV_CHECK(!is_driver() && sharded(), "internal: run_worker is for ranks other than 0");
  ShardDraft draft = load_draft(options);  // before the pool, as on rank 0
  const int rc = run_shard_worker(make_memory(options), model_, groups_, options_.micro_batches, std::move(draft));
  if (rc == 0) {
    join_workers();
  } else {
    stop_workers();
  }
  return rc;
}

}  // namespace kvserve
