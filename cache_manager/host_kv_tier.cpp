#include "cache_manager/host_kv_tier.h"

#include "common/check.h"

namespace kvserve {

HostKvTier::HostKvTier(const KvBlockPool& pool, int64_t num_layers, int64_t bytes)
    : pool_(pool),
      num_layers_(num_layers),
      slot_bytes_(slot_bytes(pool, num_layers)),
      slots_([&] {
        KV_CHECK(num_layers > 0, "host prefix tier needs layers");
        KV_CHECK(bytes >= slot_bytes(pool, num_layers),
                 "cache.prefix_cache_bytes: " << bytes << " bytes hold no cached block (one block of every layer takes "
                                              << slot_bytes(pool, num_layers) << " bytes)");
        return bytes / slot_bytes(pool, num_layers);
      }()) {
  auto opts = torch::TensorOptions().dtype(pool.storage_dtype()).device(torch::kCPU);
  // Pinned memory lets the copies run asynchronously; a CPU pool has no transfer to speed up.
  if (pool.device().is_cuda()) opts = opts.pinned_memory(true);
  storage_ = torch::empty({num_slots(), num_layers, 2, pool.num_kv_heads(), pool.block_size(), pool.row_elems()}, opts);
}

torch::Tensor HostKvTier::index_of(const std::vector<int32_t>& pool_blocks) const {
  KV_CHECK(static_cast<int64_t>(pool_blocks.size()) == num_layers_,
           "host prefix tier: " << pool_blocks.size() << " pool blocks for an entry of " << num_layers_ << " layers");
  std::vector<int64_t> ids(pool_blocks.begin(), pool_blocks.end());
  return torch::tensor(ids, torch::kLong).to(pool_.device());
}

int32_t HostKvTier::store(const std::vector<int32_t>& pool_blocks) {
  const torch::Tensor idx = index_of(pool_blocks);
  const int32_t slot = slots_.allocate();
  storage_[slot].copy_(pool_.storage().index_select(0, idx), /*non_blocking=*/true);
  ++stores_;
  return slot;
}

void HostKvTier::load(int32_t slot, const std::vector<int32_t>& pool_blocks) {
  KV_CHECK(slots_.refcount(slot) > 0, "host prefix tier: slot " << slot << " is free");
  const torch::Tensor idx = index_of(pool_blocks);
  pool_.storage().index_copy_(0, idx, storage_[slot].to(pool_.device(), /*non_blocking=*/true));
  ++loads_;
}

void HostKvTier::free(int32_t slot) { slots_.decref(slot); }

}  // namespace kvserve
