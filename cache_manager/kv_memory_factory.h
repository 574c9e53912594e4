#pragma once
// make_kv_memory: the one way to build a shard's KV memory (pool + policy-enforcing paged memory),
// used by the engine, the sharded workers and the CLI tools alike.
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cache_manager/mixed_kv_memory.h"
#include "cache_manager/paged_kv_memory.h"

namespace kvserve {

// The KV shape of one shard as the memory sees it (the backend fills it from a loaded model).
struct KvMemoryLayout {
  int64_t num_layers = 0;    // layers this shard holds
  int64_t first_layer = 0;   // global index of the first of them
  int64_t total_layers = 0;  // the whole model's layer count (budgets are per model layer)
  int64_t num_kv_heads = 0;  // KV heads this shard holds
  int64_t head_dim = 0;
  torch::ScalarType dtype = torch::kFloat32;
  KvQuant quant = KvQuant::none;  // a quantized pool's row format (then dtype is what rows decode to)
  torch::Device device = torch::kCPU;
  bool rounds = false;  // dtype differs from the model's compute dtype: K/V read back are rounded
  uint64_t kv_salt = 0;  // names what else makes the K/V (the prefix cache's key salt)
  // One token of one layer, K and V of every KV head of the whole model, in the cache's dtype: what
  // a policy's budget_bytes is divided by (PolicyConfig::resolve_budget_bytes).
  int64_t model_token_layer_bytes = 0;
  // Per layer of this shard: 0 = global attention, w > 0 = a sliding-window (local) layer whose
  // queries see the last w positions. Empty = every layer global.
  std::vector<int64_t> layer_windows;
  // The whole model's sliding-window layers (global indices, ascending): the policies spread their
  // budgets over the other layers (PolicyConfig::local_layers).
  std::vector<int64_t> local_layers;
};

// A shard's KV layouts when policies store K/V in other dtypes than the cache's (PolicyConfig::kv_dtype):
// `base` is the cache's, `by_dtype` the model's layout for each other name a policy gives (the
// backend builds them: the names and what they mean depend on the device).
struct KvFormats {
  KvMemoryLayout base;
  std::map<std::string, KvMemoryLayout> by_dtype;
};

// Tells every policy the model's sliding-window layers, as make_kv_memory does for its memory's
// copies: for other holders of the configs (the scheduler's admission arithmetic).
void set_local_layers(std::map<std::string, PolicyConfig>& policies, const std::vector<int64_t>& local_layers);
// The same, and every budget_bytes resolved to tokens per layer in this layout's KV cache dtype.
void apply_model_layout(std::map<std::string, PolicyConfig>& policies, const KvMemoryLayout& layout);

// How a pool lays out its blocks (cache.kv_layout): kLayer, a block holds every KV head of a layer
// (one length per layer); kHead, one KV head (each head its own length, for head-wise budgets);
// kAuto, kHead exactly when a configured policy has head_budgets=adaptive.
enum class KvLayout { kAuto, kLayer, kHead };

// How big the pool is: num_blocks when > 0, else kv_cache_bytes.
struct KvPoolSize {
  int64_t block_size = 16;
  int64_t num_blocks = 0;
  int64_t kv_cache_bytes = 0;
  bool prefix_caching = false;  // keep full prompt blocks for later requests (cache.enable_prefix_caching)
  int64_t prefix_cache_bytes = 0;  // the prefix cache's host-RAM tier (cache.prefix_cache_bytes), 0 = none
  KvLayout layout = KvLayout::kAuto;
  bool context_caching = false;  // keep compressed contexts for later requests (cache.enable_context_caching)
};

// "auto" | "layer" | "head" (cache.kv_layout, --kv-layout); throws naming the value otherwise.
KvLayout parse_kv_layout(const std::string& name);
std::string to_string(KvLayout layout);
// Whether a pool for these policies uses head-wise blocks under `layout`.
bool uses_head_blocks(KvLayout layout, const std::map<std::string, PolicyConfig>& policies);

// The same, each policy's budget_bytes resolved in its own KV dtype.
void apply_model_layout(std::map<std::string, PolicyConfig>& policies, const KvFormats& formats);

// `policies`: the named policies sequences may ask for ("full" is always there); `shard`: a sharded
// job's score exchange (its layer fields are taken from `layout`).
std::unique_ptr<PagedKvMemory> make_kv_memory(const KvMemoryLayout& layout, const KvPoolSize& size,
                                              std::map<std::string, PolicyConfig> policies,
                                              const std::string& default_policy = "full", KvShard shard = {});

// A memory whose policies may name KV dtypes of their own: one PagedKvMemory per distinct format on
// one KvSlabs storage sized as `size` sizes the base format's pool, each policy's sequences in its
// format (a single format: make_kv_memory's memory, passed through). Throws naming a policy whose
// kv_dtype has no layout in `formats`.
std::unique_ptr<MixedKvMemory> make_mixed_kv_memory(const KvFormats& formats, const KvPoolSize& size,
                                                    std::map<std::string, PolicyConfig> policies,
                                                    const std::string& default_policy = "full", KvShard shard = {});

}  // namespace kvserve
