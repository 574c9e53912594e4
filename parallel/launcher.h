#pragma once
// Launcher: starts this node's worker processes for a TP x PP job (the same binary and arguments,
// with the torchrun variables set) and watches them, so that a dead rank never goes unnoticed and
// no process outlives the job.
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel/dist_env.h"

namespace kvserve::parallel {

// Records argv once (from main) so the launcher can start the same command in worker processes.
void set_command_line(int argc, char** argv);

struct LaunchSpec {
  int world_size = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0 = a free local port (single node only)
};

// Where this process stands, given the launch flags and the environment: the torchrun variables
// win when set (this process was started by a launcher); otherwise single process, or this node's
// local rank 0 of a job described by `spec`. Validates nnodes/node_rank/world divisibility.
DistEnv plan_process(const LaunchSpec& spec, bool* must_spawn);

// The worker processes this process started (local ranks 1.. of its node).
class WorkerGroup {
 public:
  // Starts local ranks 1..local_world_size-1 of `self`'s node; `self` must be local rank 0.
  static std::unique_ptr<WorkerGroup> spawn(const DistEnv& self);
  ~WorkerGroup();  // shutdown(5 s)

  // Runs once, on the monitor thread, when a worker exits while the job is running; then the
  // monitor stops every other worker. Set it before the job can fail (right after spawn).
  void set_on_failure(std::function<void(const std::string& what)> f);
  // Asks workers to stop (SIGTERM), kills what is left after `grace` (SIGKILL) and reaps all.
  void shutdown(std::chrono::milliseconds grace);
  // Waits for every worker to exit by itself (they were told to stop), up to `grace`, then shutdown.
  void join(std::chrono::milliseconds grace);

 private:
  WorkerGroup() = default;
  void monitor();
  bool reap();                   // reaps exited workers; true while any is alive
  std::string collect_exits();   // reaps; describes the first unexpected exit ("" if none)
  void report(const std::string& failure);  // once: log it and run on_failure
  void signal_alive(int sig);
  struct Child {
    pid_t pid;
    int rank;
    bool alive;
  };
  mutable std::mutex mu_;
  std::vector<Child> children_;
  std::function<void(const std::string&)> on_failure_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  std::atomic<bool> quit_{false};
  std::thread thread_;
};

// A free TCP port on 127.0.0.1 (bound and released; good enough for a local rendezvous).
int pick_free_port();

}  // namespace kvserve::parallel
