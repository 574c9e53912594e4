#pragma once
// Tensor/pipeline parallel and launch flags shared by serve, generate and forward.
#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "backend/sharded/parallel_job.h"
#include "configs/server_config.h"

namespace kvserve::cli {

struct ParallelFlags {
  std::optional<int64_t> tp, pp, micro_batches;
  std::optional<std::string> pipeline_layers;  // "3,2"
  std::optional<int> nnodes, node_rank, master_port;
  std::optional<std::string> master_addr;
  std::optional<double> timeout_s;

  void add_to(CLI::App* cmd);
  // The flags over `base` (defaults or the YAML `parallel:` section); bad values are KvErrors
  // naming the flag.
  ParallelOptions apply(ParallelOptions base = {}) const;
};

ParallelOptions to_parallel_options(const config::ParallelSection& s);

}  // namespace kvserve::cli
