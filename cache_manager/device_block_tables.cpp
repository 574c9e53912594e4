#include "cache_manager/device_block_tables.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "common/check.h"

namespace kvserve {

DeviceBlockTables::DeviceBlockTables(int64_t num_layers, torch::Device device) : layers_(num_layers), device_(device) {
  KV_CHECK(num_layers > 0, "DeviceBlockTables needs at least one layer, got " << num_layers);
  grow(8, 16);
}

int32_t DeviceBlockTables::add(int64_t seq_id) {
  KV_CHECK(!rows_.count(seq_id), "sequence " << seq_id << " already has a device table row");
  int32_t r;
  if (!free_rows_.empty()) {
    r = free_rows_.back();
    free_rows_.pop_back();
  } else {
    r = next_row_++;
  }
  rows_.emplace(seq_id, r);
  // A reused row still holds its last owner's lengths on the device.
  for (int64_t l = 0; l < layers_; ++l) set_length(r, l, 0);
  return r;
}

void DeviceBlockTables::remove(int64_t seq_id) {
  auto it = rows_.find(seq_id);
  KV_CHECK(it != rows_.end(), "sequence " << seq_id << " has no device table row");
  free_rows_.push_back(it->second);
  rows_.erase(it);
}

void DeviceBlockTables::rename(int64_t from, int64_t to) {
  auto it = rows_.find(from);
  KV_CHECK(it != rows_.end(), "sequence " << from << " has no device table row");
  KV_CHECK(!rows_.count(to), "sequence " << to << " already has a device table row");
  const int32_t r = it->second;
  rows_.erase(it);
  rows_.emplace(to, r);
}

int32_t DeviceBlockTables::null_row() {
  if (null_row_ < 0) {
    null_row_ = next_row_++;
    for (int64_t l = 0; l < layers_; ++l) set_length(null_row_, l, 0);
  }
  return null_row_;
}

void DeviceBlockTables::reserve(int64_t rows, int64_t blocks) {
  KV_CHECK(rows >= 0 && blocks >= 0, "reserve: negative capacity (" << rows << " rows, " << blocks << " blocks)");
  if (rows > row_cap_ || blocks > block_cap_) grow(rows, blocks);
}

int32_t DeviceBlockTables::row(int64_t seq_id) const {
  auto it = rows_.find(seq_id);
  KV_CHECK(it != rows_.end(), "sequence " << seq_id << " has no device table row");
  return it->second;
}

void DeviceBlockTables::set_block(int32_t row, int64_t layer, int64_t index, int32_t block) {
  pending_.push_back({Kind::kBlock, row, static_cast<int32_t>(layer), index, block});
}

void DeviceBlockTables::set_blocks(int32_t row, int64_t layer, const std::vector<int32_t>& blocks) {
  for (size_t i = 0; i < blocks.size(); ++i) set_block(row, layer, static_cast<int64_t>(i), blocks[i]);
}

void DeviceBlockTables::set_length(int32_t row, int64_t layer, int64_t length) {
  KV_CHECK(length >= 0 && length <= std::numeric_limits<int32_t>::max(), "length " << length << " out of range");
  pending_.push_back({Kind::kLength, row, static_cast<int32_t>(layer), 0, static_cast<int32_t>(length)});
}

void DeviceBlockTables::set_batch(const std::vector<int32_t>& rows, const std::vector<int64_t>& positions) {
  KV_CHECK(rows.size() == positions.size(), rows.size() << " batch rows for " << positions.size() << " positions");
  for (size_t b = 0; b < rows.size(); ++b) {
    KV_CHECK(positions[b] >= 0 && positions[b] <= std::numeric_limits<int32_t>::max(),
             "position " << positions[b] << " out of range");
    pending_.push_back({Kind::kBatchRow, 0, 0, static_cast<int64_t>(b), rows[b]});
    pending_.push_back({Kind::kPosition, 0, 0, static_cast<int64_t>(b), static_cast<int32_t>(positions[b])});
  }
}

int64_t DeviceBlockTables::flat_index(const Change& c) const {
  const int64_t lengths_at = tables_size(), batch_at = lengths_at + layers_ * row_cap_, pos_at = batch_at + row_cap_;
  switch (c.kind) {
    case Kind::kBlock:
      return (int64_t{c.layer} * row_cap_ + c.row) * block_cap_ + c.index;
    case Kind::kLength:
      return lengths_at + int64_t{c.layer} * row_cap_ + c.row;
    case Kind::kBatchRow:
      return batch_at + c.index;
    case Kind::kPosition:
      return pos_at + c.index;
  }
  return -1;
}

void DeviceBlockTables::grow(int64_t rows, int64_t blocks) {
  const int64_t old_rows = row_cap_, old_blocks = block_cap_;
  const torch::Tensor old = state_;
  row_cap_ = std::max(rows, row_cap_);
  block_cap_ = std::max(blocks, block_cap_);
  ++generation_;
  state_ = torch::zeros({tables_size() + layers_ * row_cap_ + 2 * row_cap_},
                        torch::TensorOptions().dtype(torch::kInt32).device(device_));
  if (!old.defined()) return;
  const int64_t old_tables = layers_ * old_rows * old_blocks;
  state_.narrow(0, 0, tables_size())
      .view({layers_, row_cap_, block_cap_})
      .narrow(1, 0, old_rows)
      .narrow(2, 0, old_blocks)
      .copy_(old.narrow(0, 0, old_tables).view({layers_, old_rows, old_blocks}));
  state_.narrow(0, tables_size(), layers_ * row_cap_)
      .view({layers_, row_cap_})
      .narrow(1, 0, old_rows)
      .copy_(old.narrow(0, old_tables, layers_ * old_rows).view({layers_, old_rows}));
}

void DeviceBlockTables::flush() {
  if (pending_.empty()) return;
  int64_t rows = std::max<int64_t>(next_row_, 1), blocks = 1;
  for (const Change& c : pending_) {
    if (c.kind == Kind::kBlock) blocks = std::max(blocks, c.index + 1);
    if (c.kind == Kind::kBatchRow) rows = std::max(rows, c.index + 1);
  }
  if (rows > row_cap_ || blocks > block_cap_) {
    grow(rows > row_cap_ ? std::max(rows, 2 * row_cap_) : row_cap_,
         blocks > block_cap_ ? std::max(blocks, 2 * block_cap_) : block_cap_);
  }
  // Later changes to an entry win: keep the last one per index (a device scatter with repeated
  // indices picks an arbitrary one).
  const int64_t n = static_cast<int64_t>(pending_.size());
  std::vector<int64_t> flat(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) flat[i] = flat_index(pending_[static_cast<size_t>(i)]);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return flat[a] < flat[b]; });
  std::vector<int64_t> keep;
  keep.reserve(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    if (i + 1 < order.size() && flat[order[i + 1]] == flat[order[i]]) continue;
    keep.push_back(order[i]);
  }
  const int64_t m = static_cast<int64_t>(keep.size());
  torch::Tensor host = torch::empty({2, m}, torch::TensorOptions().dtype(torch::kInt64).pinned_memory(device_.is_cuda()));
  int64_t* hp = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    hp[i] = flat[keep[i]];
    hp[m + i] = pending_[static_cast<size_t>(keep[i])].value;
  }
  pending_.clear();
  const torch::Tensor dev = device_.is_cpu() ? host : host.to(device_, /*non_blocking=*/true);
  state_.index_put_({dev[0]}, dev[1].to(torch::kInt32));
  ++copies_;
}

torch::Tensor DeviceBlockTables::tables(int64_t layer) const {
  KV_CHECK(layer >= 0 && layer < layers_, "layer " << layer << " out of range [0, " << layers_ << ")");
  return state_.narrow(0, layer * row_cap_ * block_cap_, row_cap_ * block_cap_).view({row_cap_, block_cap_});
}

torch::Tensor DeviceBlockTables::lengths(int64_t layer) const {
  KV_CHECK(layer >= 0 && layer < layers_, "layer " << layer << " out of range [0, " << layers_ << ")");
  return state_.narrow(0, tables_size() + layer * row_cap_, row_cap_);
}

const int32_t* DeviceBlockTables::host_tables(int64_t layer) const {
  KV_CHECK(layer >= 0 && layer < layers_, "layer " << layer << " out of range [0, " << layers_ << ")");
  KV_CHECK(state_.device().is_cpu(), "internal: host_tables of block tables on " << state_.device());
  return state_.data_ptr<int32_t>() + layer * row_cap_ * block_cap_;
}

const int32_t* DeviceBlockTables::host_lengths(int64_t layer) const {
  KV_CHECK(layer >= 0 && layer < layers_, "layer " << layer << " out of range [0, " << layers_ << ")");
  KV_CHECK(state_.device().is_cpu(), "internal: host_lengths of block tables on " << state_.device());
  return state_.data_ptr<int32_t>() + tables_size() + layer * row_cap_;
}

torch::Tensor DeviceBlockTables::batch_rows(int64_t batch) const {
  KV_CHECK(batch >= 0 && batch <= row_cap_, "batch of " << batch << " rows past the capacity " << row_cap_);
  return state_.narrow(0, tables_size() + layers_ * row_cap_, batch);
}

torch::Tensor DeviceBlockTables::batch_positions(int64_t batch) const {
  KV_CHECK(batch >= 0 && batch <= row_cap_, "batch of " << batch << " rows past the capacity " << row_cap_);
  return state_.narrow(0, tables_size() + layers_ * row_cap_ + row_cap_, batch);
}

}  // namespace kvserve
