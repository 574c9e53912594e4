#pragma once
// run_on_fresh_thread: runs a function on a thread of its own that ends with it, and hands back its
// result (or rethrows its exception) on the caller's thread.
//
// Why: libgomp, the OpenMP runtime behind libtorch's CPU ops and MKL, keeps a pool of worker
// threads for every thread that has run a parallel region, for as long as that thread lives. When
// the main thread loads the model and builds the engine (parallel casts, copies and fills) and then
// only waits while the engine's own thread decodes, the main thread's idle pool stays counted: with
// more OpenMP threads than cores, libgomp spins only briefly at a barrier before it sleeps on a futex,
// so every parallel region of a decode step pays a thread wake-up. On two cores that made CPU decode
// steps of `kvserve generate` and `serve` 1.1-2.5x slower than the same steps in `kvserve bench
// decode` (docs/benchmarks-engine-ab.md, "One OpenMP pool"). Start-up work done on a thread that ends
// takes its pool with it.
#include <future>
#include <thread>
#include <type_traits>
#include <utility>

namespace kvserve {

template <class F>
std::invoke_result_t<std::decay_t<F>&> run_on_fresh_thread(F&& f) {
  std::packaged_task<std::invoke_result_t<std::decay_t<F>&>()> task(std::forward<F>(f));
  auto result = task.get_future();
  std::thread(std::move(task)).join();
  return result.get();
}

}  // namespace kvserve
