#include "backend/engine/decode_graphs.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "backend/model/decoder_model.h"
#include "cache_manager/paged_kv_memory.h"
#include "common/check.h"
#include "common/log.h"

#ifdef KVSERVE_HAVE_CUDA_GRAPHS
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kvserve {

#ifdef KVSERVE_HAVE_CUDA_GRAPHS
namespace {

// Counts the kernel nodes of the graph the stream is capturing (the runtime lets a capture's graph
// be queried, not changed). Names come from cudaFuncGetName; kernels it cannot name (e.g. ones
// launched through the driver API) count as "?".
void count_kernels(cudaStream_t stream, DecodeGraphStats& stats) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  if (cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph) != cudaSuccess || graph == nullptr) {
    (void)cudaGetLastError();
    return;
  }
  size_t n = 0;
  if (cudaGraphGetNodes(graph, nullptr, &n) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0 && cudaGraphGetNodes(graph, nodes.data(), &n) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  stats.kernel_nodes = 0;
  stats.kernels_by_name.clear();
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    if (cudaGraphNodeGetType(node, &type) != cudaSuccess || type != cudaGraphNodeTypeKernel) continue;
    ++stats.kernel_nodes;
    cudaKernelNodeParams params{};
    const char* name = nullptr;
    if (cudaGraphKernelNodeGetParams(node, &params) != cudaSuccess || params.func == nullptr ||
        cudaFuncGetName(&name, params.func) != cudaSuccess || name == nullptr) {
      name = "?";
    }
    ++stats.kernels_by_name[name];
  }
  (void)cudaGetLastError();
}

}  // namespace
#endif

std::vector<int64_t> decode_graph_buckets(int64_t max_batch) {
  KV_CHECK(max_batch >= 1, "decode graphs: the largest batch must be >= 1, got " << max_batch);
  std::vector<int64_t> out;
  for (int64_t b = 1; b <= max_batch;) {
    out.push_back(b);
    b = b < 8 ? 2 * b : b < 64 ? b + 8 : b < 128 ? b + 16 : b < 256 ? b + 32 : b + 64;
  }
  if (out.back() != max_batch) out.push_back(max_batch);
  return out;
}

int64_t decode_graph_bucket(const std::vector<int64_t>& buckets, int64_t batch) {
  KV_CHECK(batch >= 1, "decode graphs: empty batch");
  auto it = std::lower_bound(buckets.begin(), buckets.end(), batch);
  return it == buckets.end() ? 0 : *it;
}

int64_t decode_graph_split_hint(int64_t max_blocks) {
  // Up to 16 blocks the kernels' planner runs one split of everything, whatever the hint.
  constexpr int64_t kSmall = 16;
  if (max_blocks <= kSmall) return kSmall;
  int64_t octave = kSmall;
  while (2 * octave < max_blocks) octave *= 2;
  for (int64_t q = 1; q <= 4; ++q) {
    const int64_t hint = octave + q * octave / 4;
    if (hint >= max_blocks) return hint;
  }
  return 2 * octave;  // not reached: octave < max_blocks <= 2 * octave
}

// One captured step of one bucket.
struct DecodeGraphs::Graph {
#ifdef KVSERVE_HAVE_CUDA_GRAPHS
  at::cuda::CUDAGraph graph;
#endif
};

struct DecodeGraphs::Cuda {
#ifdef KVSERVE_HAVE_CUDA_GRAPHS
  explicit Cuda(c10::DeviceIndex device)
      : side(at::cuda::getStreamFromPool(/*isHighPriority=*/false, device)), pool(at::cuda::graph_pool_handle()) {}
  at::cuda::CUDAStream side;  // warm-up and capture run here (capture cannot use the default stream)
  c10::cuda::MempoolId_t pool;  // shared by every bucket's graph
#endif
};

std::string DecodeGraphs::unsupported(const DecoderModel& model, const PagedKvMemory& kv) {
#ifndef KVSERVE_HAVE_CUDA_GRAPHS
  return "this build has no CUDA graph support (no CUDA kernels)";
#else
  if (!model.device().is_cuda()) return "the model is on " + model.device().str();
  if (model.tensor_parallel() || model.layout().pp_size > 1) return "tensor or pipeline parallel models decode eagerly";
  if (!kv.cache().device_kernels())
    return "the paged decode runs on the libtorch path (KVSERVE_PAGED_KERNEL=torch, or a dtype/head_dim kvserve's "
           "kernels do not take), which reads lengths back on the host";
  return "";
#endif
}

DecodeGraphs::DecodeGraphs(DecoderModel& model, PagedKvMemory& kv, DecodeGraphOptions options)
    : model_(model),
      kv_(kv),
      options_(options),
      buckets_(decode_graph_buckets(std::min(options.max_batch, kMaxDecodeGraphBatch))) {
  if (options_.capture) {
    const std::string why = unsupported(model_, kv_);
    KV_CHECK(why.empty(), "decode graphs: " << why);
  }
  KV_CHECK(model_.layout().pp_size == 1, "decode graphs: the model must be whole (no pipeline stages)");
  inputs_ = torch::zeros({2, buckets_.back()}, torch::TensorOptions().dtype(torch::kInt64).device(model_.device()));
  // Every sequence and the padding's null row fit from the start: a growth would move the tables
  // and force every graph to be recaptured.
  kv_.cache().reserve_decode_rows(buckets_.back());
#ifdef KVSERVE_HAVE_CUDA_GRAPHS
  if (options_.capture) {
    const c10::DeviceIndex dev = model_.device().has_index() ? model_.device().index() : c10::cuda::current_device();
    cuda_ = std::make_unique<Cuda>(dev);
    logits_ = torch::empty({buckets_.back(), model_.config().vocab_size},
                           torch::TensorOptions().dtype(torch::kFloat32).device(model_.device()));
  }
#endif
}

DecodeGraphs::~DecodeGraphs() = default;

int64_t DecodeGraphs::graphs() const { return static_cast<int64_t>(graphs_.size()); }

void DecodeGraphs::drop_graphs() {
  graphs_.clear();
#ifdef KVSERVE_HAVE_CUDA_GRAPHS
  // The old pool goes with its last graph; later captures start a fresh one.
  if (cuda_) cuda_->pool = at::cuda::graph_pool_handle();
#endif
}

torch::Tensor DecodeGraphs::run_body(const DecodeBatch& batch, int64_t rows) {
  return model_.decode_planned(batch, inputs_[0].narrow(0, 0, rows), inputs_[1].narrow(0, 0, rows), kv_);
}

torch::Tensor DecodeGraphs::decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens) {
  torch::NoGradGuard ng;
  const int64_t B = static_cast<int64_t>(tokens.size());
  KV_CHECK(B > 0 && batch.seq_ids.size() == tokens.size(), "decode batch of " << B << " tokens does not match its sequence list");
  const int64_t rows = broken_ ? 0 : decode_graph_bucket(buckets_, B);
  stats_.last_plan_s = -1;
  if (rows == 0) {
    ++stats_.eager;
    return model_.decode(batch, tokens, kv_);
  }
#ifdef KVSERVE_HAVE_CUDA_GRAPHS
  std::optional<c10::cuda::CUDAGuard> guard;
  if (model_.device().is_cuda()) guard.emplace(model_.device());
#endif
  // Host work, outside any graph: evictions, blocks, the tables' one copy (padding -> null row).
  const auto plan_start = std::chrono::steady_clock::now();
  model_.plan_decode(batch, tokens, kv_, rows);
  PagedKvCache& cache = kv_.cache();
  const int64_t hint = decode_graph_split_hint(cache.planned_max_blocks());
  cache.fix_split_hint(hint);
  // The static inputs, in one (pinned, asynchronous) copy; padding rows read token 0 at position 0.
  const int64_t cap = buckets_.back();
  torch::Tensor host =
      torch::zeros({2, cap}, torch::TensorOptions().dtype(torch::kInt64).pinned_memory(model_.device().is_cuda()));
  int64_t* hp = host.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    hp[b] = tokens[static_cast<size_t>(b)];
    hp[cap + b] = batch.positions[static_cast<size_t>(b)];
  }
  inputs_.copy_(host, /*non_blocking=*/true);
  stats_.last_plan_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - plan_start).count();

  if (!options_.capture) {
    ++stats_.padded_eager;
    return run_body(batch, rows).narrow(0, 0, B);
  }
#ifndef KVSERVE_HAVE_CUDA_GRAPHS
  KV_FAIL("internal: decode graphs without CUDA graph support");
#else
  const Baked now{cache.device_tables().generation(), model_.rope_capacity()};
  if (now != baked_) {
    if (!graphs_.empty()) {
      ++stats_.invalidations;
      drop_graphs();
    }
    baked_ = now;
  }
  Graph* g = nullptr;
  if (auto it = graphs_.find({rows, hint}); it != graphs_.end()) {
    g = it->second.get();
  } else {
    try {
      g = &capture(batch, rows, hint);
    } catch (const std::exception& e) {
      KV_LOG("CUDA graph capture of a decode step (bucket " << rows << ") failed; decode runs eagerly from now on: "
                                                             << e.what());
      broken_ = true;
      drop_graphs();
      // The step is still planned: run it eagerly (a layer that already ran writes the same K/V again).
      cache.rearm_decode();
      ++stats_.eager;
      return run_body(batch, rows).narrow(0, 0, B);
    }
  }
  g->graph.replay();
  cache.end_decode();
  ++stats_.replays;
  return logits_.narrow(0, 0, B);
#endif
}

DecodeGraphs::Graph& DecodeGraphs::capture(const DecodeBatch& batch, int64_t rows, int64_t hint) {
#ifndef KVSERVE_HAVE_CUDA_GRAPHS
  KV_FAIL("internal: decode graphs without CUDA graph support");
#else
  PagedKvCache& cache = kv_.cache();
  const auto capture_start = std::chrono::steady_clock::now();
  auto g = std::make_unique<Graph>();
  const c10::DeviceIndex dev = cuda_->side.device_index();
  const at::cuda::CUDAStream main = at::cuda::getCurrentCUDAStream(dev);
  // The side stream starts after the tables' flush and the inputs' copy queued on the main one.
  at::cuda::CUDAEvent ready;
  ready.record(main);
  ready.block(cuda_->side);
  {
    const at::cuda::CUDAStreamGuard on_side(cuda_->side);
    // Warm-up outside the capture: lazy initialisation (cuBLAS handles and workspaces, module
    // loading) must not happen inside it. It computes this very step, writing the K/V that the
    // replay below writes again to the same slots.
    run_body(batch, rows);
    cache.rearm_decode();
    try {
      g->graph.capture_begin(cuda_->pool, cudaStreamCaptureModeThreadLocal);
      logits_.narrow(0, 0, rows).copy_(run_body(batch, rows));
      count_kernels(cuda_->side.stream(), stats_);
      g->graph.capture_end();
    } catch (...) {
      // A capture that failed part-way leaves the stream capturing: end it before the graph object
      // releases its pool, so that the stream is usable again.
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(cuda_->side.stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
        cudaGraph_t raw = nullptr;
        if (cudaStreamEndCapture(cuda_->side.stream(), &raw) == cudaSuccess && raw != nullptr) cudaGraphDestroy(raw);
      }
      (void)cudaGetLastError();
      g.reset();
      throw;
    }
  }
  // The replay runs on the main stream, after the warm-up's writes.
  at::cuda::CUDAEvent done;
  done.record(cuda_->side);
  done.block(main);
  ++stats_.captures;
  stats_.capture_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - capture_start).count();
  Graph& ref = *g;
  graphs_[{rows, hint}] = std::move(g);
  return ref;
#endif
}

}  // namespace kvserve
