#include "backend/engine/step_plan.h"

#include "cache_manager/kv_quant.h"

namespace kvserve {

namespace {
std::string dtype_label(const PagedKvMemory& kv) {
  return kv_cache_dtype_label(kv.cache().pool().dtype(), kv.cache().pool().quant());
}

// Adds a cache's host tier and compressed contexts to `u`, its blocks as `units` each.
void add_caches(ShardUsage& u, const PagedKvCache& cache, int64_t units) {
  if (const HostKvTier* t = cache.host_tier()) {
    u.host_cached_bytes += t->used_slots() * t->slot_bytes();
    u.host_capacity_bytes += t->total_bytes();
    u.host_stores += t->stores();
    u.host_loads += t->loads();
  }
  if (const CompressedContextCache* c = cache.context_cache()) {
    u.context_entries += c->num_entries();
    u.context_blocks += c->cached_blocks() * units;
    u.context_full_blocks += c->full_blocks() * units;
  }
}
}  // namespace

ShardUsage shard_usage(const PagedKvMemory& kv, const StepPlan& plan) {
  ShardUsage u;
  u.geometry = kv.geometry();
  u.blocks_total = kv.blocks_total();
  u.blocks_used = kv.blocks_used();
  u.blocks_high_water = kv.blocks_high_water();
  u.blocks_cached = kv.cache().cached_blocks();
  u.block_bytes = kv.cache().block_bytes();
  u.cached_bytes = u.blocks_cached * u.block_bytes;
  u.bytes_used_by_dtype[dtype_label(kv)] = u.blocks_used * u.block_bytes;
  add_caches(u, kv.cache(), 1);
  auto add = [&](int64_t id) {
    u.held.push_back(kv.private_blocks(id));
    u.demand.push_back(kv.decode_demand({id}));
  };
  for (int64_t id : plan.decode.seq_ids) add(id);
  for (const auto& p : plan.prefill) add(p.seq_id);
  return u;
}

ShardUsage shard_usage(const MixedKvMemory& kv, const StepPlan& plan) {
  if (kv.num_formats() == 1) return shard_usage(kv.format(0), plan);
  ShardUsage u;
  u.geometry = kv.format(0).geometry();
  u.blocks_total = kv.blocks_total();
  u.blocks_used = kv.blocks_used();
  u.blocks_high_water = kv.blocks_high_water();
  u.block_bytes = kv.unit_bytes();
  for (size_t f = 0; f < kv.num_formats(); ++f) {
    const PagedKvMemory& m = kv.format(f);
    const int64_t w = kv.block_units(f);
    // A compressing policy must not chunk where any format rounds what a chunk reads back.
    u.geometry.rounds_kv = u.geometry.rounds_kv || m.geometry().rounds_kv;
    u.blocks_cached += m.cache().cached_blocks() * w;
    u.bytes_used_by_dtype[dtype_label(m)] += m.blocks_used() * m.cache().block_bytes();
    add_caches(u, m.cache(), w);
  }
  u.cached_bytes = u.blocks_cached * u.block_bytes;
  u.base_units = kv.block_units(0);
  for (const auto& [policy, f] : kv.policy_formats()) u.policy_units[policy] = kv.block_units(f);
  const MixedKvMemory::Room room = kv.room();
  u.format_room = room.own_units;
  u.free_slabs = room.free_slabs;
  u.slab_units = room.slab_units;
  u.policy_format = kv.policy_formats();
  auto add = [&](int64_t id) {
    if (!kv.holds(id)) {
      u.held.push_back(0);
      u.demand.push_back(0);
      return;
    }
    const PagedKvMemory& m = kv.of(id);
    const int64_t w = kv.block_units(kv.format_of(id));
    u.held.push_back(m.private_blocks(id) * w);
    u.demand.push_back(m.decode_demand({id}) * w);
  };
  for (int64_t id : plan.decode.seq_ids) add(id);
  for (const auto& p : plan.prefill) add(p.seq_id);
  return u;
}

}  // namespace kvserve
