#pragma once
// DecodeGraphs: the decode step's forward (embedding -> layers -> final norm -> LM head) captured in
// CUDA graphs, one per batch-size bucket, and replayed with the KV memory's device tables as inputs.
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cache_manager/kv_memory.h"

namespace kvserve {

class DecoderModel;
class PagedKvMemory;

// Batch sizes graphs are captured for, up to max_batch (which is always the last): 1, 2, 4, 8,
// then steps of 8 to 64, of 16 to 128, of 32 to 256, of 64 beyond (vLLM's spacing, coarser as a
// padded row costs less of a big batch).
std::vector<int64_t> decode_graph_buckets(int64_t max_batch);
// The smallest bucket holding `batch` entries; 0 when the batch is larger than every bucket.
int64_t decode_graph_bucket(const std::vector<int64_t>& buckets, int64_t batch);
// The split-K hint a graph bakes into its attention launches, from the step's most blocks per
// (sequence, layer): rounded up to a quarter octave (16, 20, 24, 28, 32, 40, ...), so a graph serves
// contexts that grow by up to 25 % and a split is at most 25 % emptier than the step's own plan.
int64_t decode_graph_split_hint(int64_t max_blocks);

// The largest bucket, whatever max_num_seqs is: the static logits buffer is [bucket, V] fp32 (a
// 128K vocabulary makes that 256 MiB at 512), and bigger batches gain little from a graph.
constexpr int64_t kMaxDecodeGraphBatch = 512;

struct DecodeGraphOptions {
  int64_t max_batch = 32;  // the largest bucket (the scheduler's max_num_seqs; capped at kMaxDecodeGraphBatch)
  // false: run every bucketed step eagerly, padded exactly as a graph would run it (the same
  // static inputs, padding and fixed split hint) instead of capturing it. The CPU tests use this to
  // check the padded step; it also isolates a graph problem from a padding problem on a GPU.
  bool capture = true;
};

struct DecodeGraphStats {
  int64_t captures = 0;     // graphs captured (a recapture after growth counts again)
  double capture_s = 0;     // host wall time of those captures (warm-up run + capture), the steps wait for it
  int64_t replays = 0;      // steps served by a graph replay
  int64_t padded_eager = 0; // bucketed steps run eagerly (capture = false)
  int64_t eager = 0;        // steps a graph could not serve (batch above the largest bucket)
  int64_t invalidations = 0;  // times every graph was dropped (device tables or RoPE tables moved)
  // The most recent capture's graph: kernel nodes in all, and by kernel name ("?" where the runtime
  // cannot name one). The fixed per-step cost of a decode step grows with this count.
  int64_t kernel_nodes = 0;
  std::map<std::string, int64_t> kernels_by_name;
  // Host wall time of the latest step's planning (plan_decode, the split hint, the inputs' pinned
  // copy), which runs before the replay while the GPU may idle; -1 when the latest step was not
  // planned here (it ran whole through DecoderModel::decode: a batch above the largest bucket, or
  // graphs off after a failed capture).
  double last_plan_s = -1;
};

// Serves LocalRunner's decode steps on a CUDA model. Per step, on the host and outside any graph:
// the batch is padded to its bucket, the KV memory plans the step (evictions, blocks, one table
// copy; padding rows point at the tables' null row), the RoPE tables are grown, and the token ids and
// positions go to static device inputs in one copy. Then the bucket's graph is replayed, or captured
// first: a warm-up run and the capture on a side stream, into one private memory pool shared by
// every bucket; each graph ends by copying its logits into one static buffer. A graph is keyed by (bucket, split hint) and bakes in the device tables' and RoPE
// tables' storage; when either is reallocated every graph is dropped and recaptured on demand.
// Steps above the largest bucket run eagerly. Not thread-safe (the engine thread drives it).
class DecodeGraphs {
 public:
  // `model` and `kv` must outlive this.
  DecodeGraphs(DecoderModel& model, PagedKvMemory& kv, DecodeGraphOptions options);
  ~DecodeGraphs();
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;

  // Why graphs cannot serve this model and memory ("" = they can): a CPU model, a build without
  // the CUDA kernels or with KVSERVE_PAGED_KERNEL=torch, tensor or pipeline parallelism.
  static std::string unsupported(const DecoderModel& model, const PagedKvMemory& kv);

  // One decode step, as DecoderModel::decode: fp32 logits [B, V] on the model's device. A replayed
  // step's logits are a view of a buffer every replay rewrites: valid until the next step.
  torch::Tensor decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens);

  const std::vector<int64_t>& buckets() const { return buckets_; }
  const DecodeGraphStats& stats() const { return stats_; }
  int64_t graphs() const;

 private:
  struct Graph;
  // What every graph bakes in besides its bucket and hint; a change drops them all.
  struct Baked {
    int64_t tables_generation = -1;
    int64_t rope_capacity = -1;
    bool operator!=(const Baked& o) const {
      return tables_generation != o.tables_generation || rope_capacity != o.rope_capacity;
    }
  };
  torch::Tensor run_body(const DecodeBatch& batch, int64_t rows);
  Graph& capture(const DecodeBatch& batch, int64_t rows, int64_t hint);
  void drop_graphs();

  DecoderModel& model_;
  PagedKvMemory& kv_;
  DecodeGraphOptions options_;
  std::vector<int64_t> buckets_;
  torch::Tensor inputs_;  // int64 [2, max bucket] on the device: token ids, then positions
  // fp32 [max bucket, V]: every graph copies its logits here, so no graph keeps a live output in the
  // shared pool (graphs may then replay in any order, and the pool holds one graph's temporaries).
  torch::Tensor logits_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Graph>> graphs_;  // (bucket, hint) -> graph
  Baked baked_;
  bool broken_ = false;  // a capture failed: every later step runs eagerly
  DecodeGraphStats stats_;
  struct Cuda;  // the side stream and memory pool (only in CUDA builds)
  std::unique_ptr<Cuda> cuda_;
};

}  // namespace kvserve
