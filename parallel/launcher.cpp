#include "parallel/launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iostream>

#include "common/check.h"
#include "common/log.h"

extern char** environ;

namespace kvserve::parallel {

namespace {
std::vector<std::string>& command_line() {
  static std::vector<std::string> argv;
  return argv;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
                                  strsignal(WTERMSIG(status)) + ")";
  return "stopped";
}
}  // namespace

void set_command_line(int argc, char** argv) {
  command_line().assign(argv, argv + argc);
}

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  KV_CHECK(fd >= 0, "socket(): " << std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  KV_CHECK(ok, "cannot find a free local port: " << std::strerror(errno));
  return ntohs(a.sin_port);
}

DistEnv plan_process(const LaunchSpec& spec, bool* must_spawn) {
  *must_spawn = false;
  if (auto env = dist_env_from_environment()) {
    KV_CHECK(env->world_size == spec.world_size,
             "WORLD_SIZE=" << env->world_size << " from the environment does not match tensor x pipeline parallel size "
                           << spec.world_size);
    return *env;
  }
  KV_CHECK(spec.world_size >= 1, "world size must be >= 1");
  KV_CHECK(spec.nnodes >= 1, "--nnodes must be >= 1, got " << spec.nnodes);
  KV_CHECK(spec.node_rank >= 0 && spec.node_rank < spec.nnodes,
           "--node-rank " << spec.node_rank << " is outside [0, --nnodes=" << spec.nnodes << ")");
  KV_CHECK(spec.world_size % spec.nnodes == 0,
           "tensor x pipeline parallel size " << spec.world_size << " does not divide over --nnodes " << spec.nnodes);
  DistEnv e;
  e.world_size = spec.world_size;
  e.local_world_size = spec.world_size / spec.nnodes;
  e.rank = spec.node_rank * e.local_world_size;
  e.local_rank = 0;
  e.master_addr = spec.master_addr;
  e.master_port = spec.master_port;
  if (e.world_size == 1) return e;
  if (e.master_port == 0) {
    KV_CHECK(spec.nnodes == 1, "--master-port is required with --nnodes " << spec.nnodes);
    e.master_port = pick_free_port();
  }
  validate(e);
  *must_spawn = e.local_world_size > 1;
  return e;
}

std::unique_ptr<WorkerGroup> WorkerGroup::spawn(const DistEnv& self) {
  KV_CHECK(self.local_rank == 0, "only local rank 0 starts workers");
  const auto& argv = command_line();
  KV_CHECK(!argv.empty(), "internal: the launcher needs the command line (set_command_line)");
  std::unique_ptr<WorkerGroup> g(new WorkerGroup());
  for (int lr = 1; lr < self.local_world_size; ++lr) {
    const int rank = self.rank + lr;
    // Everything the child needs is prepared before fork: after it, only exec-safe calls.
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) {
      std::string s = *e;
      const std::string key = s.substr(0, s.find('='));
      if (key == "RANK" || key == "WORLD_SIZE" || key == "LOCAL_RANK" || key == "LOCAL_WORLD_SIZE" ||
          key == "MASTER_ADDR" || key == "MASTER_PORT")
        continue;
      env_strings.push_back(std::move(s));
    }
    env_strings.push_back("RANK=" + std::to_string(rank));
    env_strings.push_back("WORLD_SIZE=" + std::to_string(self.world_size));
    env_strings.push_back("LOCAL_RANK=" + std::to_string(lr));
    env_strings.push_back("LOCAL_WORLD_SIZE=" + std::to_string(self.local_world_size));
    env_strings.push_back("MASTER_ADDR=" + self.master_addr);
    env_strings.push_back("MASTER_PORT=" + std::to_string(self.master_port));
    std::vector<char*> envp, args;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_copy = argv;
    for (auto& s : argv_copy) args.push_back(s.data());
    args.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    KV_CHECK(pid >= 0, "fork() for rank " << rank << " failed: " << std::strerror(errno));
    if (pid == 0) {
      // A worker never outlives the process that started it.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      // The parent may block signals for a signal-waiter thread; exec keeps the mask, so clear it.
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::execve("/proc/self/exe", args.data(), envp.data());
      ::_exit(127);
    }
    g->children_.push_back({pid, rank, true});
    KV_LOG("started rank " << rank << " (pid " << pid << ")");
  }
  g->thread_ = std::thread([p = g.get()] { p->monitor(); });
  return g;
}

WorkerGroup::~WorkerGroup() {
  shutdown(std::chrono::milliseconds(5000));
  quit_ = true;
  if (thread_.joinable()) thread_.join();
}

void WorkerGroup::set_on_failure(std::function<void(const std::string&)> f) {
  std::lock_guard<std::mutex> lk(mu_);
  on_failure_ = std::move(f);
}

std::string WorkerGroup::collect_exits() {
  std::lock_guard<std::mutex> lk(mu_);
  std::string failure;
  for (auto& c : children_) {
    if (!c.alive) continue;
    int status = 0;
    if (::waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
    c.alive = false;
    if (stopping_ || failed_ || !failure.empty()) continue;
    const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    failure = "rank " + std::to_string(c.rank) + " (pid " + std::to_string(c.pid) + ") " +
              (clean ? std::string("exited unexpectedly") : describe_status(status));
  }
  return failure;
}

bool WorkerGroup::reap() {
  collect_exits();
  std::lock_guard<std::mutex> lk(mu_);
  return std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.alive; });
}

void WorkerGroup::report(const std::string& failure) {
  bool expected = false;
  if (failure.empty() || !failed_.compare_exchange_strong(expected, true)) return;
  std::function<void(const std::string&)> cb;
  {
    std::lock_guard<std::mutex> lk(mu_);
    cb = on_failure_;
  }
  KV_LOG(failure << "; stopping the other ranks");
  if (cb) cb(failure);
}

void WorkerGroup::monitor() {
  while (!quit_) {
    const std::string failure = collect_exits();
    if (!failure.empty()) {
      report(failure);
      // The job cannot continue without that rank: stop the rest so nothing is left behind.
      shutdown(std::chrono::milliseconds(3000));
    }
    if (stopping_ && !reap()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void WorkerGroup::signal_alive(int sig) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& c : children_)
    if (c.alive) ::kill(c.pid, sig);
}

void WorkerGroup::join(std::chrono::milliseconds grace) {
  stopping_ = true;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (reap()) {
    if (std::chrono::steady_clock::now() >= deadline) return shutdown(std::chrono::milliseconds(2000));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void WorkerGroup::shutdown(std::chrono::milliseconds grace) {
  // A worker that died before anyone noticed (e.g. a collective failed first) is still named. Its
  // sockets close while it exits, so a peer's collective can fail before the process is waitable:
  // give it a moment to become so.
  if (!stopping_ && !failed_) {
    std::string failure = collect_exits();
    for (int i = 0; failure.empty() && i < 25; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      failure = collect_exits();
    }
    report(failure);
  }
  stopping_ = true;
  signal_alive(SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  bool killed = false;
  while (reap()) {
    if (!killed && std::chrono::steady_clock::now() >= deadline) {
      signal_alive(SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace kvserve::parallel
