#include "cache_manager/kv_memory_factory.h"

#include <algorithm>

#include "common/check.h"

namespace kvserve {

KvLayout parse_kv_layout(const std::string& name) {
  if (name == "auto") return KvLayout::kAuto;
  if (name == "layer") return KvLayout::kLayer;
  if (name == "head") return KvLayout::kHead;
  KV_FAIL("KV layout must be one of auto, layer, head; got '" << name << "'");
}

std::string to_string(KvLayout layout) {
  return layout == KvLayout::kAuto ? "auto" : layout == KvLayout::kLayer ? "layer" : "head";
}

bool uses_head_blocks(KvLayout layout, const std::map<std::string, PolicyConfig>& policies) {
  if (layout != KvLayout::kAuto) return layout == KvLayout::kHead;
  return std::any_of(policies.begin(), policies.end(), [](const auto& p) { return p.second.head_adaptive(); });
}

void set_local_layers(std::map<std::string, PolicyConfig>& policies, const std::vector<int64_t>& local_layers) {
  for (auto& [name, cfg] : policies) cfg.local_layers = local_layers;
}

namespace {
void resolve_budget_bytes(std::map<std::string, PolicyConfig>& policies, const KvMemoryLayout& layout) {
  const std::string dtype = kv_cache_dtype_label(layout.dtype, layout.quant);
  const int64_t layers = layout.total_layers > 0 ? layout.total_layers : layout.first_layer + layout.num_layers;
  for (auto& [name, cfg] : policies) cfg.resolve_budget_bytes(layout.model_token_layer_bytes, layers, dtype);
}
}  // namespace

void apply_model_layout(std::map<std::string, PolicyConfig>& policies, const KvMemoryLayout& layout) {
  set_local_layers(policies, layout.local_layers);
  resolve_budget_bytes(policies, layout);
}

std::unique_ptr<PagedKvMemory> make_kv_memory(const KvMemoryLayout& layout, const KvPoolSize& size,
                                              std::map<std::string, PolicyConfig> policies,
                                              const std::string& default_policy, KvShard shard) {
  KV_CHECK(layout.num_layers > 0 && layout.num_kv_heads > 0 && layout.head_dim > 0,
           "internal: a KV memory needs layers, KV heads and a head size");
  resolve_budget_bytes(policies, layout);
  KvPoolOptions pool;
  pool.num_kv_heads = layout.num_kv_heads;
  pool.head_dim = layout.head_dim;
  pool.block_size = size.block_size;
  pool.num_blocks = size.num_blocks;
  pool.kv_cache_bytes = size.kv_cache_bytes;
  pool.dtype = layout.dtype;
  pool.quant = layout.quant;
  pool.device = layout.device;
  pool.rounds = layout.rounds;
  pool.head_blocks = uses_head_blocks(size.layout, policies);
  shard.first_layer = layout.first_layer;
  shard.total_layers = layout.total_layers > 0 ? layout.total_layers : layout.first_layer + layout.num_layers;
  auto mem = std::make_unique<PagedKvMemory>(layout.num_layers, pool, std::move(policies), default_policy, std::move(shard));
  if (!layout.layer_windows.empty()) mem->set_layer_windows(layout.layer_windows, layout.local_layers);
  KV_CHECK(size.prefix_cache_bytes == 0 || size.prefix_caching,
           "cache.prefix_cache_bytes (" << size.prefix_cache_bytes << ") needs cache.enable_prefix_caching: true");
  if (size.prefix_caching) mem->enable_prefix_cache(layout.kv_salt, nullptr, size.prefix_cache_bytes);
  if (size.context_caching) mem->enable_context_cache(layout.kv_salt);
  return mem;
}

}  // namespace kvserve
