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

namespace {
KvPoolOptions pool_options(const KvMemoryLayout& layout, const KvPoolSize& size,
                           const std::map<std::string, PolicyConfig>& policies) {
  KV_CHECK(layout.num_layers > 0 && layout.num_kv_heads > 0 && layout.head_dim > 0,
           "internal: a KV memory needs layers, KV heads and a head size");
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
  return pool;
}

std::unique_ptr<PagedKvMemory> build_memory(const KvMemoryLayout& layout, const KvPoolSize& size,
                                            std::map<std::string, PolicyConfig> policies,
                                            const std::string& default_policy, KvShard shard,
                                            std::shared_ptr<KvSlabs> slabs) {
  const KvPoolOptions pool = pool_options(layout, size, policies);
  shard.first_layer = layout.first_layer;
  shard.total_layers = layout.total_layers > 0 ? layout.total_layers : layout.first_layer + layout.num_layers;
  auto mem = std::make_unique<PagedKvMemory>(layout.num_layers, pool, std::move(policies), default_policy,
                                             std::move(shard), std::move(slabs));
  if (!layout.layer_windows.empty()) mem->set_layer_windows(layout.layer_windows, layout.local_layers);
  KV_CHECK(size.prefix_cache_bytes == 0 || size.prefix_caching,
           "cache.prefix_cache_bytes (" << size.prefix_cache_bytes << ") needs cache.enable_prefix_caching: true");
  if (size.prefix_caching) mem->enable_prefix_cache(layout.kv_salt, nullptr, size.prefix_cache_bytes);
  if (size.context_caching) mem->enable_context_cache(layout.kv_salt);
  return mem;
}

std::string label_of(const KvMemoryLayout& layout) { return kv_cache_dtype_label(layout.dtype, layout.quant); }

// The layout a policy's sequences use: formats.base unless it names a KV dtype of its own.
const KvMemoryLayout& layout_of(const KvFormats& formats, const std::string& name, const PolicyConfig& cfg) {
  if (cfg.kv_dtype.empty()) return formats.base;
  auto it = formats.by_dtype.find(cfg.kv_dtype);
  KV_CHECK(it != formats.by_dtype.end(), "policy '" << name << "': kv_dtype '" << cfg.kv_dtype
                                                    << "' has no KV layout here (this runner stores every sequence in "
                                                    << label_of(formats.base) << ")");
  return it->second;
}
}  // namespace

void apply_model_layout(std::map<std::string, PolicyConfig>& policies, const KvFormats& formats) {
  set_local_layers(policies, formats.base.local_layers);
  for (auto& [name, cfg] : policies) {
    const KvMemoryLayout& l = layout_of(formats, name, cfg);
    const int64_t layers = l.total_layers > 0 ? l.total_layers : l.first_layer + l.num_layers;
    cfg.resolve_budget_bytes(l.model_token_layer_bytes, layers, label_of(l));
  }
}

std::unique_ptr<PagedKvMemory> make_kv_memory(const KvMemoryLayout& layout, const KvPoolSize& size,
                                              std::map<std::string, PolicyConfig> policies,
                                              const std::string& default_policy, KvShard shard) {
  resolve_budget_bytes(policies, layout);
  for (const auto& [name, cfg] : policies)
    KV_CHECK(cfg.kv_dtype.empty(), "policy '" << name << "': kv_dtype '" << cfg.kv_dtype
                                              << "': a KV dtype per policy is served by one process's engine only "
                                              << "(not by tensor / pipeline parallel shards or this tool); "
                                              << "set cache.kv_cache_dtype (--kv-cache-dtype) instead");
  return build_memory(layout, size, std::move(policies), default_policy, std::move(shard), nullptr);
}

std::unique_ptr<MixedKvMemory> make_mixed_kv_memory(const KvFormats& formats, const KvPoolSize& size,
                                                    std::map<std::string, PolicyConfig> policies,
                                                    const std::string& default_policy, KvShard shard) {
  // Formats by label: two names of one dtype ("fp16", "float16") share a memory.
  std::vector<const KvMemoryLayout*> layouts{&formats.base};
  std::vector<std::string> labels{label_of(formats.base)};
  std::map<std::string, size_t> policy_format;
  for (const auto& [name, cfg] : policies) {
    const KvMemoryLayout& l = layout_of(formats, name, cfg);
    const std::string label = label_of(l);
    size_t f = 0;
    while (f < labels.size() && labels[f] != label) ++f;
    if (f == labels.size()) {
      layouts.push_back(&l);
      labels.push_back(label);
    }
    if (f > 0) policy_format[name] = f;
  }
  apply_model_layout(policies, formats);
  for (auto& [name, cfg] : policies) cfg.kv_dtype.clear();  // each memory stores its one format
  if (layouts.size() == 1) {
    auto only = build_memory(formats.base, size, std::move(policies), default_policy, std::move(shard), nullptr);
    return std::make_unique<MixedKvMemory>(std::move(only));
  }
  std::vector<KvPoolOptions> pools;
  for (const KvMemoryLayout* l : layouts) pools.push_back(pool_options(*l, size, policies));
  auto slabs = std::make_shared<KvSlabs>(pools);
  std::vector<std::unique_ptr<PagedKvMemory>> memories;
  for (const KvMemoryLayout* l : layouts) memories.push_back(build_memory(*l, size, policies, default_policy, shard, slabs));
  return std::make_unique<MixedKvMemory>(std::move(memories), std::move(policy_format), std::move(slabs));
}

}  // namespace kvserve
