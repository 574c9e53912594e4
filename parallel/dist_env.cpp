#include "parallel/dist_env.h"

#include <cstdlib>

#include "common/check.h"

namespace kvserve::parallel {

namespace {
std::optional<std::string> lookup(const std::map<std::string, std::string>* env, const std::string& name) {
  if (env) {
    auto it = env->find(name);
    return it == env->end() ? std::nullopt : std::optional<std::string>(it->second);
  }
  const char* v = std::getenv(name.c_str());
  return v ? std::optional<std::string>(v) : std::nullopt;
}

int parse_int(const std::string& name, const std::string& value) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  KV_CHECK(used == value.size() && !value.empty() && v >= 0 && v <= 1 << 30,
           "environment variable " << name << "='" << value << "' is not a non-negative integer");
  return static_cast<int>(v);
}
}  // namespace

void validate(const DistEnv& e) {
  KV_CHECK(e.world_size >= 1, "WORLD_SIZE must be >= 1, got " << e.world_size);
  KV_CHECK(e.rank >= 0 && e.rank < e.world_size, "RANK=" << e.rank << " is outside [0, WORLD_SIZE=" << e.world_size << ")");
  KV_CHECK(e.local_world_size >= 1 && e.local_world_size <= e.world_size,
           "LOCAL_WORLD_SIZE=" << e.local_world_size << " must be in [1, WORLD_SIZE=" << e.world_size << "]");
  KV_CHECK(e.local_rank >= 0 && e.local_rank < e.local_world_size,
           "LOCAL_RANK=" << e.local_rank << " is outside [0, LOCAL_WORLD_SIZE=" << e.local_world_size << ")");
  KV_CHECK(!e.master_addr.empty(), "MASTER_ADDR is empty");
  KV_CHECK(e.master_port >= 1 && e.master_port <= 65535, "MASTER_PORT=" << e.master_port << " is outside [1, 65535]");
}

std::optional<DistEnv> dist_env_from_environment(const std::map<std::string, std::string>* env) {
  auto rank = lookup(env, "RANK"), world = lookup(env, "WORLD_SIZE");
  if (!rank && !world) return std::nullopt;
  KV_CHECK(rank && world, "RANK and WORLD_SIZE must be set together (got only " << (rank ? "RANK" : "WORLD_SIZE") << ")");
  DistEnv e;
  e.rank = parse_int("RANK", *rank);
  e.world_size = parse_int("WORLD_SIZE", *world);
  e.local_rank = e.rank;
  e.local_world_size = e.world_size;
  if (auto v = lookup(env, "LOCAL_RANK")) e.local_rank = parse_int("LOCAL_RANK", *v);
  if (auto v = lookup(env, "LOCAL_WORLD_SIZE")) {
    e.local_world_size = parse_int("LOCAL_WORLD_SIZE", *v);
  }
  auto addr = lookup(env, "MASTER_ADDR"), port = lookup(env, "MASTER_PORT");
  KV_CHECK(!e.distributed() || (addr && port), "WORLD_SIZE=" << e.world_size << " needs MASTER_ADDR and MASTER_PORT");
  if (addr) e.master_addr = *addr;
  e.master_port = port ? parse_int("MASTER_PORT", *port) : 29500;
  validate(e);
  return e;
}

}  // namespace kvserve::parallel
