#pragma once
// SignalWaiter: SIGINT/SIGTERM/SIGHUP blocked in every thread and taken by one waiter thread, so
// that shutdown and reload run as ordinary code instead of inside a signal handler.
#include <signal.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace kvserve::cli {

class SignalWaiter {
 public:
  // Blocks the signals in the calling thread (and so in every thread it starts afterwards).
  SignalWaiter();
  ~SignalWaiter();
  SignalWaiter(const SignalWaiter&) = delete;
  SignalWaiter& operator=(const SignalWaiter&) = delete;

  // Runs on the waiter thread when SIGINT/SIGTERM arrives (set before one can arrive).
  void set_handler(std::function<void(int)> fn) { on_signal_ = std::move(fn); }
  // Runs on the waiter thread for every SIGHUP (may be set or cleared any time).
  void set_reload(std::function<void()> fn);
  // Blocks until SIGINT/SIGTERM; returns the signal.
  int wait();
  bool received();

 private:
  sigset_t set_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  int signal_ = 0;
  std::function<void(int)> on_signal_;
  std::function<void()> on_hup_;
  std::atomic<bool> stopping_{false};
};

}  // namespace kvserve::cli
