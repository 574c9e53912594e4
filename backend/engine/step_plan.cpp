#include "backend/engine/step_plan.h"

namespace kvserve {

ShardUsage shard_usage(const PagedKvMemory& kv, const StepPlan& plan) {
  ShardUsage u;
  u.geometry = kv.geometry();
  u.blocks_total = kv.blocks_total();
  u.blocks_used = kv.blocks_used();
  u.blocks_high_water = kv.blocks_high_water();
  u.blocks_cached = kv.cache().cached_blocks();
  u.block_bytes = kv.cache().block_bytes();
  u.cached_bytes = u.blocks_cached * u.block_bytes;
  if (const HostKvTier* t = kv.cache().host_tier()) {
    u.host_cached_bytes = t->used_slots() * t->slot_bytes();
    u.host_capacity_bytes = t->total_bytes();
    u.host_stores = t->stores();
    u.host_loads = t->loads();
  }
  if (const CompressedContextCache* c = kv.cache().context_cache()) {
    u.context_entries = c->num_entries();
    u.context_blocks = c->cached_blocks();
    u.context_full_blocks = c->full_blocks();
  }
  auto add = [&](int64_t id) {
    u.held.push_back(kv.private_blocks(id));
    u.demand.push_back(kv.decode_demand({id}));
  };
  for (int64_t id : plan.decode.seq_ids) add(id);
  for (const auto& p : plan.prefill) add(p.seq_id);
  return u;
}

}  // namespace kvserve
