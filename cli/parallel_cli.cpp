#include "cli/parallel_cli.h"

#include <sstream>

#include "common/check.h"

namespace kvserve::cli {

void ParallelFlags::add_to(CLI::App* cmd) {
  const std::string g = "Parallelism";
  cmd->add_option("--tensor-parallel-size,--tp", tp, "tensor parallel ranks (heads and MLP split; all-reduce per layer)")
      ->group(g);
  cmd->add_option("--pipeline-parallel-size,--pp", pp, "pipeline stages (contiguous layer ranges)")->group(g);
  cmd->add_option("--pipeline-layers", pipeline_layers, "layers per stage, e.g. 3,2 (default: even split)")->group(g);
  cmd->add_option("--micro-batches", micro_batches, "decode micro-batches in flight (default: one per stage)")->group(g);
  cmd->add_option("--nnodes", nnodes, "nodes in the job (each runs this command with its --node-rank)")->group(g);
  cmd->add_option("--node-rank", node_rank, "this node's index; node 0 hosts rank 0 (HTTP and the scheduler)")->group(g);
  cmd->add_option("--master-addr", master_addr, "address of node 0 for the rendezvous (default 127.0.0.1)")->group(g);
  cmd->add_option("--master-port", master_port, "rendezvous port (default: a free port on one node)")->group(g);
  cmd->add_option("--parallel-timeout", timeout_s, "seconds a collective may take before the job is failed")->group(g);
}

ParallelOptions ParallelFlags::apply(ParallelOptions o) const {
  if (tp) o.tensor_parallel_size = *tp;
  if (pp) o.pipeline_parallel_size = *pp;
  if (micro_batches) o.micro_batches = *micro_batches;
  if (nnodes) o.nnodes = *nnodes;
  if (node_rank) o.node_rank = *node_rank;
  if (master_addr) o.master_addr = *master_addr;
  if (master_port) o.master_port = *master_port;
  if (timeout_s) o.timeout_s = *timeout_s;
  if (pipeline_layers) {
    o.pipeline_layers.clear();
    std::stringstream ss(*pipeline_layers);
    std::string item;
    while (std::getline(ss, item, ',')) {
      size_t used = 0;
      long long v = 0;
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      KV_CHECK(used == item.size() && used > 0 && v >= 1,
               "--pipeline-layers '" << *pipeline_layers << "': '" << item << "' is not a positive layer count");
      o.pipeline_layers.push_back(v);
    }
  }
  KV_CHECK(o.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1, got " << o.tensor_parallel_size);
  KV_CHECK(o.pipeline_parallel_size >= 1, "--pipeline-parallel-size must be >= 1, got " << o.pipeline_parallel_size);
  KV_CHECK(o.micro_batches >= 0, "--micro-batches must be >= 0, got " << o.micro_batches);
  KV_CHECK(o.nnodes >= 1, "--nnodes must be >= 1, got " << o.nnodes);
  KV_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, "--node-rank " << o.node_rank << " is outside [0, " << o.nnodes << ")");
  KV_CHECK(o.master_port >= 0 && o.master_port <= 65535, "--master-port " << o.master_port << " is outside [0, 65535]");
  KV_CHECK(o.timeout_s > 0, "--parallel-timeout must be > 0, got " << o.timeout_s);
  KV_CHECK(o.pipeline_layers.empty() || static_cast<int64_t>(o.pipeline_layers.size()) == o.pipeline_parallel_size,
           "--pipeline-layers lists " << o.pipeline_layers.size() << " stages, but the pipeline parallel size is "
                                      << o.pipeline_parallel_size);
  return o;
}

ParallelOptions to_parallel_options(const config::ParallelSection& s) {
  ParallelOptions o;
  o.tensor_parallel_size = s.tensor_parallel_size;
  o.pipeline_parallel_size = s.pipeline_parallel_size;
  o.pipeline_layers = s.pipeline_layers;
  o.micro_batches = s.micro_batches;
  o.nnodes = s.nnodes;
  o.node_rank = s.node_rank;
  o.master_addr = s.master_addr;
  o.master_port = s.master_port;
  o.timeout_s = s.timeout_s;
  return o;
}

}  // namespace kvserve::cli
