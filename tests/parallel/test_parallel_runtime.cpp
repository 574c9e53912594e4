// parallel/ runtime pieces: torchrun variables, the launcher's process plan, shard layouts, the
// `parallel:` YAML section, and the c10d communicator (two ranks as threads over real Gloo).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "backend/model/model_config.h"
#include "common/check.h"
#include "configs/server_config.h"
#include "parallel/communicator.h"
#include "parallel/dist_env.h"
#include "parallel/launcher.h"
#include "parallel/shard_layout.h"

namespace kvserve {
namespace {

using parallel::DistEnv;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(DistEnv, ReadsTorchrunVariables) {
  std::map<std::string, std::string> env;
  EXPECT_FALSE(parallel::dist_env_from_environment(&env).has_value());
  env = {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
         {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29511"}};
  auto e = parallel::dist_env_from_environment(&env);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->rank, 3);
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->local_world_size, 2);
  EXPECT_EQ(e->master_addr, "10.0.0.1");
  EXPECT_EQ(e->master_port, 29511);
}

TEST(DistEnv, BadVariablesNameThemselves) {
  std::map<std::string, std::string> env{{"RANK", "x1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}};
  EXPECT_NE(error_of([&] { parallel::dist_env_from_environment(&env); }).find("RANK='x1'"), std::string::npos);
  env["RANK"] = "2";
  EXPECT_NE(error_of([&] { parallel::dist_env_from_environment(&env); }).find("RANK=2 is outside [0, WORLD_SIZE=2)"),
            std::string::npos);
  env = {{"RANK", "0"}};
  EXPECT_NE(error_of([&] { parallel::dist_env_from_environment(&env); }).find("must be set together"), std::string::npos);
  env = {{"RANK", "0"}, {"WORLD_SIZE", "2"}};
  EXPECT_NE(error_of([&] { parallel::dist_env_from_environment(&env); }).find("needs MASTER_ADDR and MASTER_PORT"),
            std::string::npos);
  env = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}};
  EXPECT_NE(error_of([&] { parallel::dist_env_from_environment(&env); }).find("MASTER_PORT=70000"), std::string::npos);
}

TEST(Launcher, PlansNodesAndRanks) {
  ASSERT_EQ(std::getenv("RANK"), nullptr) << "run the tests without torchrun variables";
  parallel::LaunchSpec spec;
  spec.world_size = 8;
  spec.nnodes = 2;
  spec.node_rank = 1;
  spec.master_addr = "10.1.1.1";
  spec.master_port = 29400;
  bool spawn = false;
  DistEnv e = parallel::plan_process(spec, &spawn);
  EXPECT_EQ(e.rank, 4);  // node 1's first process is global rank 4
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_TRUE(spawn);
  spec.master_port = 0;
  EXPECT_NE(error_of([&] { parallel::plan_process(spec, &spawn); }).find("--master-port is required"), std::string::npos);
  spec.world_size = 6;
  spec.nnodes = 4;
  spec.node_rank = 0;
  EXPECT_NE(error_of([&] { parallel::plan_process(spec, &spawn); }).find("does not divide over --nnodes 4"), std::string::npos);
  spec = {};
  spec.world_size = 2;
  e = parallel::plan_process(spec, &spawn);
  EXPECT_TRUE(spawn);
  EXPECT_GT(e.master_port, 0);  // a free local port was picked
}

ModelConfig kvfew_like() {
  ModelConfig c;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 1;
  c.head_dim = 32;
  c.hidden_size = 128;
  c.intermediate_size = 160;
  c.vocab_size = 2119;
  return c;
}

TEST(ShardLayout, SplitsLayersHeadsMlpAndVocabulary) {
  const ModelConfig c = kvfew_like();
  ShardLayout s = parallel::make_shard_layout(model_shape(c), 2, 1, 2, 0);
  EXPECT_EQ(s.layer_begin, 0);
  EXPECT_EQ(s.layer_end, 2);  // 3 layers over 2 stages: 2 + 1
  EXPECT_EQ(s.q_head_begin, 2);
  EXPECT_EQ(s.q_heads, 2);
  EXPECT_EQ(s.kv_heads, 1);       // 1 KV head, 2 ranks: replicated
  EXPECT_EQ(s.kv_head_begin, 0);
  EXPECT_EQ(s.kv_replicas, 2);
  EXPECT_EQ(s.inter_begin, 80);
  EXPECT_EQ(s.inter_len, 80);
  EXPECT_EQ(s.vocab_per_rank, 1060);
  EXPECT_EQ(s.vocab_begin, 1060);
  EXPECT_EQ(s.vocab_len, 1059);  // the last rank is padded by one row
  EXPECT_EQ(s.global_rank(1, 1), 3);
  s = parallel::make_shard_layout(model_shape(c), 1, 0, 2, 1, {1, 2});
  EXPECT_EQ(s.layer_begin, 1);
  EXPECT_EQ(s.layer_end, 3);
  EXPECT_TRUE(s.last_stage());
}

TEST(ShardLayout, RefusesSplitsThatCannotWork) {
  const ModelConfig c = kvfew_like();
  EXPECT_NE(error_of([&] { parallel::make_shard_layout(model_shape(c), 3, 0, 1, 0); }).find("4 attention heads do not split evenly over tensor parallel size 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parallel::make_shard_layout(model_shape(c), 1, 0, 4, 0); }).find("cannot split 3 layers over 4"), std::string::npos);
  EXPECT_NE(error_of([&] { parallel::make_shard_layout(model_shape(c), 1, 0, 2, 0, {2, 2}); }).find("sums to 4 layers, but the model has 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parallel::make_shard_layout(model_shape(c), 1, 0, 2, 0, {3, 0}); }).find("stage 1 has 0 layers"), std::string::npos);
}

TEST(ParallelConfig, ParsesAndValidatesTheSection) {
  auto c = config::parse_server_config(
      "parallel:\n  tensor_parallel_size: 4\n  pipeline_parallel_size: 2\n  pipeline_layers: [41, 39]\n"
      "  nnodes: 2\n  node_rank: 1\n  master_addr: 10.0.0.7\n  master_port: 29500\n  timeout_s: 15\n",
      "p.yaml");
  EXPECT_EQ(c.parallel.tensor_parallel_size, 4);
  EXPECT_EQ(c.parallel.pipeline_parallel_size, 2);
  EXPECT_EQ(c.parallel.pipeline_layers, (std::vector<int64_t>{41, 39}));
  EXPECT_EQ(c.parallel.node_rank, 1);
  EXPECT_EQ(c.parallel.master_port, 29500);
  EXPECT_DOUBLE_EQ(c.parallel.timeout_s, 15);
  auto err = [](const std::string& yaml) { return error_of([&] { config::parse_server_config(yaml, "bad.yaml"); }); };
  EXPECT_NE(err("parallel:\n  pipeline_layers: 3\n").find("parallel.pipeline_layers"), std::string::npos);
  EXPECT_NE(err("parallel:\n  tensor_parallel_size: 0\n").find("bad.yaml:2"), std::string::npos);
  EXPECT_NE(err("parallel:\n  nnodes: 2\n  node_rank: 2\n  master_port: 1\n").find("parallel.node_rank"), std::string::npos);
  EXPECT_NE(err("parallel:\n  nnodes: 2\n").find("parallel.master_port"), std::string::npos);
  EXPECT_NE(err("parallel:\n  pipeline_parallel_size: 2\n  pipeline_layers: [1, 1, 1]\n").find("lists 3 stages"),
            std::string::npos);
  EXPECT_NE(err("parallel:\n  tensor_paralel_size: 2\n").find("tensor_paralel_size"), std::string::npos);
}

// Runs `body(rank, comm)` on two threads that rendezvous like two processes would.
void two_ranks(std::chrono::milliseconds timeout, const std::function<void(int, parallel::Communicator&)>& body) {
  const int port = parallel::pick_free_port();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        DistEnv e;
        e.rank = r;
        e.world_size = 2;
        e.local_rank = r;
        e.local_world_size = 2;
        e.master_port = port;
        parallel::CommOptions o;
        o.timeout = timeout;
        auto comm = parallel::Communicator::connect(e, o);
        body(r, *comm);
      } catch (const std::exception& ex) {
        errors[static_cast<size_t>(r)] = ex.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

TEST(Communicator, CollectivesAndPointToPointOverGloo) {
  two_ranks(std::chrono::milliseconds(20000), [](int r, parallel::Communicator& comm) {
    auto& w = comm.world();
    auto t = torch::full({3}, static_cast<float>(r + 1));
    w.all_reduce_sum(t);
    EXPECT_TRUE(torch::equal(t, torch::full({3}, 3.0f)));
    auto g = w.all_gather(torch::full({1, 2}, static_cast<float>(r)));
    EXPECT_TRUE(torch::equal(g, torch::tensor({0.0f, 0.0f, 1.0f, 1.0f}).view({2, 2})));
    auto b = torch::full({2}, static_cast<int64_t>(r == 1 ? 7 : 0));
    w.broadcast(b, 1);
    EXPECT_EQ(b[0].item<int64_t>(), 7);
    // Shapes and dtypes travel with the data.
    if (r == 0) {
      w.send_tensor(torch::arange(6, torch::kInt64).view({2, 3}), 1, 5);
      w.wait_sends();
    } else {
      auto x = w.recv_tensor(0, 5, torch::kCPU);
      EXPECT_EQ(x.sizes(), (std::vector<int64_t>{2, 3}));
      EXPECT_EQ(x.scalar_type(), torch::kInt64);
      EXPECT_EQ(x[1][2].item<int64_t>(), 5);
    }
    auto sub = comm.new_group("pair", {0, 1}, "gloo");
    EXPECT_EQ(sub->rank(), r);
    auto s = torch::ones({1});
    sub->all_reduce_sum(s);
    EXPECT_EQ(s.item<float>(), 2.0f);
    w.barrier();
  });
}

TEST(Communicator, AnAbsentPeerIsACommErrorWithinTheTimeout) {
  two_ranks(std::chrono::milliseconds(1500), [](int r, parallel::Communicator& comm) {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // never joins the all-reduce
      return;
    }
    auto t0 = std::chrono::steady_clock::now();
    auto t = torch::ones({1});
    std::string what;
    try {
      comm.world().all_reduce_sum(t);
    } catch (const parallel::CommError& e) {
      what = e.what();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(what.find("rank 0: all_reduce in process group 'world' failed"), std::string::npos) << what;
    EXPECT_LT(s, 10.0);
  });
}

TEST(Communicator, NcclAllReduceAcrossTwoGpus) {
  if (!parallel::nccl_available()) GTEST_SKIP() << "this build has no NCCL backend";
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  two_ranks(std::chrono::milliseconds(60000), [](int r, parallel::Communicator& comm) {
    auto g = comm.new_group("gpu", {0, 1}, "nccl");
    auto dev = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(r));
    auto t = torch::full({4}, static_cast<float>(r + 1), torch::TensorOptions().device(dev));
    g->all_reduce_sum(t);
    EXPECT_TRUE(torch::equal(t.cpu(), torch::full({4}, 3.0f)));
    auto all = g->all_gather(torch::full({1}, static_cast<float>(r), torch::TensorOptions().device(dev)));
    EXPECT_TRUE(torch::equal(all.cpu(), torch::tensor({0.0f, 1.0f})));
  });
}

}  // namespace
}  // namespace kvserve
