#pragma once
// DistEnv: this process's place in a multi-process job, in the torchrun convention (RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace kvserve::parallel {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool distributed() const { return world_size > 1; }
};

// Reads the torchrun variables; std::nullopt when RANK and WORLD_SIZE are both unset. A variable
// that is set but malformed or inconsistent (RANK >= WORLD_SIZE, port out of range) is a KvError
// naming it. `env` overrides the process environment (tests).
std::optional<DistEnv> dist_env_from_environment(const std::map<std::string, std::string>* env = nullptr);

// Throws KvError naming the field when the values cannot describe a job.
void validate(const DistEnv& env);

}  // namespace kvserve::parallel
