#pragma once
// DeviceBlockTables: every (layer, sequence)'s block table and length in persistent tensors on the
// pool's device, kept equal to the host's tables by diffs that travel in one copy per step.
#include <torch/torch.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace kvserve {

// The device side of the paged cache's bookkeeping (vLLM's persistent block tables, one per layer
// here because each (sequence, layer) holds its own length). The host records what changed; flush()
// sends it over with one host→device copy (pinned and asynchronous on CUDA) and applies it with one
// device scatter, so a decode step's layer loop reads tables, lengths, batch rows and positions from
// device memory and never waits for the host.
//
// One int32 buffer holds, in order: tables [layers, row_cap, block_cap], lengths [layers, row_cap],
// the step's batch rows [row_cap] and positions [row_cap]. Rows are assigned per sequence and reused;
// table entries past a row's length are stale and never read. Capacities grow (doubling) when a
// sequence or a layer needs more; growing copies the old content on the device.
class DeviceBlockTables {
 public:
  DeviceBlockTables(int64_t num_layers, torch::Device device);

  // A table row for the sequence (all layers empty); remove() gives it back.
  int32_t add(int64_t seq_id);
  void remove(int64_t seq_id);
  // The sequence's row (tables unchanged) now belongs to `to`.
  void rename(int64_t from, int64_t to);
  int32_t row(int64_t seq_id) const;
  // A row no sequence ever gets: length 0 in every layer, so the kernels read nothing through it and
  // the append writes nowhere. The padded entries of a batch bucket (a CUDA graph's fixed batch size)
  // point here. Reserved on first use.
  int32_t null_row();

  // Makes room for `rows` rows and `blocks` blocks per table now, so that later steps need not grow.
  void reserve(int64_t rows, int64_t blocks);

  // Host-side changes, applied at the next flush() (later changes to the same entry win).
  void set_block(int32_t row, int64_t layer, int64_t index, int32_t block);
  void set_blocks(int32_t row, int64_t layer, const std::vector<int32_t>& blocks);
  void set_length(int32_t row, int64_t layer, int64_t length);
  // The decode step's batch: entry b uses table row rows[b] and sits at positions[b].
  void set_batch(const std::vector<int32_t>& rows, const std::vector<int64_t>& positions);

  // Applies every recorded change on the device; nothing to do costs nothing.
  void flush();
  bool dirty() const { return !pending_.empty(); }

  // Views into the device buffer (valid until the next flush that grows it). Call flush() first.
  torch::Tensor tables(int64_t layer) const;  // int32 [row_cap, block_cap]
  torch::Tensor lengths(int64_t layer) const;  // int32 [row_cap]
  torch::Tensor batch_rows(int64_t batch) const;  // int32 [batch]
  // The same tables and lengths as raw host memory, for a CPU pool's decode step (a tensor view
  // per layer costs more than the copy of a few rows); throws on a device buffer.
  const int32_t* host_tables(int64_t layer) const;   // [row_cap, block_cap]
  const int32_t* host_lengths(int64_t layer) const;  // [row_cap]
  torch::Tensor batch_positions(int64_t batch) const;  // int32 [batch]

  int64_t num_layers() const { return layers_; }
  int64_t row_capacity() const { return row_cap_; }
  int64_t block_capacity() const { return block_cap_; }
  // Host→device copies so far (one per flush that had changes).
  int64_t copies() const { return copies_; }
  const torch::Device& device() const { return device_; }
  // Changes whenever the buffer is reallocated (growth): views taken before, and a CUDA graph that
  // captured them, then point at the old storage.
  int64_t generation() const { return generation_; }

 private:
  enum class Kind : uint8_t { kBlock, kLength, kBatchRow, kPosition };
  struct Change {
    Kind kind;
    int32_t row;
    int32_t layer;
    int64_t index;
    int32_t value;
  };
  int64_t flat_index(const Change& c) const;
  // Reallocates the buffer for (rows, blocks) capacity and copies the content over.
  void grow(int64_t rows, int64_t blocks);
  int64_t tables_size() const { return layers_ * row_cap_ * block_cap_; }

  int64_t layers_;
  torch::Device device_;
  int64_t row_cap_ = 0, block_cap_ = 0;
  torch::Tensor state_;  // int32, flat, on device_
  std::vector<Change> pending_;
  std::unordered_map<int64_t, int32_t> rows_;  // sequence -> row
  std::vector<int32_t> free_rows_;
  int32_t next_row_ = 0;
  int64_t copies_ = 0;
  int64_t generation_ = 0;
  int32_t null_row_ = -1;
};

}  // namespace kvserve
