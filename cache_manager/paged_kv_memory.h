#pragma once
// PagedKvMemory: the model's KV memory on the paged pool, with each sequence's policy choosing what it keeps.
#include <map>
#include <span>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache_manager/kv_block_pool.h"
#include "cache_manager/kv_memory.h"
#include "cache_manager/paged_kv_cache.h"
#include "policies/decode_evictor.h"
#include "policies/policy_config.h"
#include "policies/prefill_selector.h"
#include "policies/score_exchange.h"

namespace kvserve {

// Resolves {name -> params} (params may carry "name" = the library policy, default the key) into
// validated policy configs; "full" is always present.
std::map<std::string, PolicyConfig> resolve_policies(const std::map<std::string, std::map<std::string, std::string>>& specs);

// Where one shard's layers and KV heads sit in the whole model (layers and heads may be split
// across shards). Layer indices passed to the memory are always global; budgets use the model's
// layer count.
struct KvShard {
  int64_t first_layer = 0;
  int64_t total_layers = 0;  // 0 = this memory holds every layer
  // How this shard's policies share scores with the other shards so that every shard keeps what one
  // process would; null = one process (LocalScoreExchange).
  std::shared_ptr<ScoreExchange> exchange;
};

class PagedKvMemory final : public KvMemory {
 public:
  // slabs: a storage shared with memories of other KV formats (PagedKvCache's third argument; null:
  // this memory owns its pool), so that sequences of different precisions draw on one byte budget.
  PagedKvMemory(int64_t num_layers, const KvPoolOptions& pool, std::map<std::string, PolicyConfig> policies,
                std::string default_policy = "full", KvShard shard = {}, std::shared_ptr<KvSlabs> slabs = nullptr);

  void begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string& policy) override;
  void store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override;
  void end_prefill(int64_t seq_id) override;
  int64_t prefill_tokens(int64_t seq_id, int64_t start, std::span<const int64_t> tokens, int64_t max_hit,
                         bool keep_copy, ResumeFrom resume = {}) override;
  EarlierKv prefill_context(int64_t seq_id, int64_t layer) override;
  torch::Tensor as_stored(int64_t seq_id, const torch::Tensor& x) const override;
  int64_t begin_context(int64_t seq_id, std::span<const int64_t> context, int64_t prompt_len, bool lookup) override;
  void continue_prompt(int64_t seq_id) override;
  void store_prefill_chunk(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& q, const torch::Tensor& k,
                           const torch::Tensor& v) override;
  const PolicyConfig* pending_selection(int64_t seq_id) const override;
  const PolicyConfig* prefill_policy(int64_t seq_id) const override;
  void record_scores(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& scores) override;
  std::vector<torch::Tensor> take_scores(int64_t seq_id) override;
  torch::Tensor reconstruction_queries(const torch::Tensor& q) override;
  void select_by_scores(int64_t seq_id, const std::vector<torch::Tensor>& scores) override;
  // Runs the decode-time evictions the step needs, then plans it in the cache (PagedKvCache::begin_decode).
  void begin_decode(const DecodeBatch& batch, int64_t padded_rows = 0) override;
  void truncate(int64_t seq_id, int64_t n) override;
  torch::Tensor decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& v) override;
  void release(int64_t seq_id) override;
  // A finished sequence whose conversation may continue from its KV (prefix_reuse: compressed):
  // its KV stays as it is until a later prompt resumes it (prefill_tokens) or it is released.
  void park(int64_t seq_id);
  // Drops the prefix cache's and compressed contexts' entries that no sequence uses and restarts the
  // high-water mark from the blocks in use: what the engine's warm-up prompts left behind.
  void reset_caches();
  bool parked(int64_t seq_id) const;
  int64_t cached_tokens(int64_t seq_id, int64_t layer) const override { return cache_.length(seq_id, local(layer)); }

  int64_t blocks_total() const override { return cache_.total_blocks(); }
  int64_t blocks_used() const override { return cache_.used_blocks(); }
  int64_t blocks_high_water() const override { return cache_.high_water_blocks(); }
  int64_t kept_tokens(int64_t seq_id) const override;

  const PolicyConfig& policy(const std::string& name) const;

  // Self-speculation over a policy's kept set (SpeculativeConfig::draft_policy: a configured
  // policy's name, else a method's, e.g. snapkv, with its default parameters): a prompt of at
  // least min_prompt_tokens whose own policy keeps it whole runs the named policy's selection with
  // `budget` tokens per layer as its prefill ends, without dropping anything, and each layer's
  // draft view (PagedKvCache::set_draft_blocks) keeps the blocks that hold most of what it chose.
  // Throws naming the policy where its selection cannot run so (scores after the prefill,
  // DynamicKV's re-selections, H2O's every query). The first sink_tokens' blocks are the view's
  // sinks anyway and are not counted. Every `refresh_tokens` decoded tokens (0: never) the selection
  // runs again over the sequence's whole cache, a window scorer with the latest decode queries (CPU
  // pools: a CUDA decode step may be a graph, which records nothing). An empty name turns it off.
  void set_draft_policy(const std::string& name, int64_t budget, int64_t min_prompt_tokens, int64_t sink_tokens,
                        int64_t refresh_tokens = 0);

  // Sliding-window (local) layers: per layer of this shard, 0 = global, w > 0 = its queries see the
  // last w positions (the decode kernel masks the older slots within a block). A local layer is a
  // ring of blocks: a block no later query can see goes back to the pool (after each prefill layer
  // or chunk, or at end_prefill when the prompt's blocks go to the prefix cache first, and before
  // each decode step), so it holds at most ceil(w / block_size) + 1 blocks per sequence from the end
  // of its prefill on. A compressing policy compresses the global layers only: local layers keep
  // every position (their slots must stay their positions), and the allocators spread the budget
  // over the global layers of the model (PolicyConfig::local_layers), `model_local_layers` (global
  // indices; a pipeline stage holds only some of the model's layers) together with this shard's.
  // DynamicKV, the global allocator and reconstruction scoring are refused on such a memory.
  void set_layer_windows(std::vector<int64_t> windows, const std::vector<int64_t>& model_local_layers = {});
  int64_t layer_window(int64_t layer) const override {
    return windows_.empty() ? 0 : windows_[static_cast<size_t>(local(layer))];
  }

  // Automatic prefix caching (cache_manager/prefix_cache.h): full prompt blocks stay in the pool
  // after their request, keyed with `salt` (what else changes the K/V: model, dtypes, RoPE, shard).
  void enable_prefix_cache(uint64_t salt, PrefixCache::KeyFn key_fn = nullptr, int64_t host_tier_bytes = 0);
  bool prefix_caching() const { return cache_.prefix_cache() != nullptr; }
  // Compressed contexts (cache_manager/compressed_context_cache.h): keyed with `salt` as the prefix
  // cache is, and each policy's parameters.
  void enable_context_cache(uint64_t salt);
  bool context_caching() const { return cache_.context_cache() != nullptr; }
  // What the last prefill_tokens lookup of a sequence found: prompt tokens looked up (0: none was
  // made) and positions taken from the cache.
  int64_t prefix_queried(int64_t seq_id) const;
  int64_t prefix_hit(int64_t seq_id) const;
  // The lookup prefill_tokens would make for a new prompt under `policy`, taking nothing: how many
  // leading positions it would find in the cache now. A sharded job's rank 0 puts this in the step
  // plan, and the shards agree on the least of theirs before any of them takes its blocks.
  int64_t prefix_lookup(std::span<const int64_t> prompt, const std::string& policy) const;
  // The same for a compressed context (begin_context's lookup): its length when the context cache
  // holds it compressed under `policy`, else 0.
  int64_t context_lookup(std::span<const int64_t> context, const std::string& policy) const;
  // Blocks (all layers) a new `full` prompt would share with running requests instead of taking
  // new ones: its cached leading blocks that are in the pool and used by a sequence that is not
  // `leaving` (released before the prompt runs). Admission counts only the rest; blocks it would
  // pin from idle entries are counted, since pinning takes them from the reclaimable ones.
  int64_t shared_prefix_blocks(std::span<const int64_t> prompt, const std::string& policy,
                               std::span<const int64_t> leaving) const;

  // Admission arithmetic, also for a shard whose memory lives in another process (the scheduler
  // runs it in the driving process for every shard of a sharded job).
  struct Geometry {
    int64_t first_layer = 0, num_layers = 0, total_layers = 0, num_kv_heads = 0, block_size = 16;
    // The pool stores K/V in another dtype than the model computes them: a chunk reading the earlier
    // chunks back gets them rounded, so compressing policies do not chunk (their selection must see
    // the computed keys, as a whole prefill does).
    bool rounds_kv = false;
    bool prefix_caching = false;  // full prompt blocks go into a prefix cache
    // Head-wise blocks (KvPoolOptions::head_blocks): a block holds one KV head's tokens, so every
    // count below is per (layer, KV head) table.
    bool head_blocks = false;
    int64_t lanes() const { return head_blocks ? num_kv_heads : 1; }
  };
  Geometry geometry() const;
  // Blocks a prompt occupies at its peak under `cfg` in the shard's layers (DynamicKV: its
  // candidates; plus one layer's compaction copy and room for the first decoded token).
  // `chunked`: the prompt is prefilled over several steps, so a compressing policy holds every
  // position of every layer until the last chunk selects (the chunked peak).
  static int64_t prompt_blocks(const PolicyConfig& cfg, const Geometry& g, int64_t prompt_len, bool chunked = false);
  // Blocks a prompt of prompt_len tokens whose first context_len are compressed alone takes at its
  // peak: the context's (prompt_blocks), then the rest appended whole with the first decoded token,
  // and the copies of each (layer, lane)'s partly filled last block (the sequence's and the cache
  // entry's).
  static int64_t context_prompt_blocks(const PolicyConfig& cfg, const Geometry& g, int64_t context_len,
                                       int64_t prompt_len);
  // Blocks a compressing policy's prefill takes on top of prompt_blocks to copy its full prompt
  // blocks into the prefix cache (0 for policies whose own blocks are cached, or without a cache).
  static int64_t prefix_copy_blocks(const PolicyConfig& cfg, const Geometry& g, int64_t prompt_len);

  // Whether prompts under `cfg` may be prefilled in chunks with the same kept positions as whole:
  // not H2O's accumulated attention, which needs every query of the prompt at once (its prompts
  // are prefilled whole).
  static bool chunkable(const PolicyConfig& cfg);
  int64_t free_blocks() const { return cache_.free_blocks(); }
  // At most how many blocks one decode step of these sequences takes at its peak (a fresh block
  // wherever a layer's last block is full; a decode-time eviction's compacted copy until the blocks
  // it replaces go back), summed over the sequences.
  int64_t decode_demand(const std::vector<int64_t>& seq_ids) const;
  // Blocks the sequence holds over this shard's layers (0 when it holds none).
  int64_t blocks_held(int64_t seq_id) const;
  // Of those, the blocks no other holder (sequence or prefix cache) references.
  int64_t private_blocks(int64_t seq_id) const { return cache_.has_sequence(seq_id) ? cache_.private_blocks_of(seq_id) : 0; }
  // Kept tokens per (layer, KV head) of this shard's layers: min, mean and max over the tables (what
  // head-wise budgets save shows in the spread).
  struct HeadKeptStats {
    int64_t min = 0, max = 0, sum = 0, count = 0;  // count: (layer, KV head) pairs
    double mean() const { return count ? static_cast<double>(sum) / static_cast<double>(count) : 0.0; }
  };
  HeadKeptStats head_kept(int64_t seq_id) const;
  // Per-layer kept counts decided at prefill (before any decode-time eviction), this shard's layers.
  const std::vector<int64_t>& prefill_budgets(int64_t seq_id) const { return seqs_.at(seq_id).budgets; }
  // Kept positions [local KV heads, n] of a (global) layer.
  torch::Tensor kept_positions(int64_t seq_id, int64_t layer) const { return cache_.positions(seq_id, local(layer)); }

  const PagedKvCache& cache() const { return cache_; }
  PagedKvCache& cache() { return cache_; }

 private:
  void apply_updates(int64_t seq_id);
  // Frees a local layer's leading blocks that no query at or after the layer's end can see.
  void trim_window(int64_t seq_id, int64_t ll);
  // DynamicKV with the layers split across shards (docs/parallel.md, "KV policies across shards"):
  // a shard after the first replays the earlier shards' scores before its first layer; after its
  // last layer a shard before the last passes every layer's scores on, and all agree on the final
  // budgets the last shard computed.
  void receive_earlier_scores(int64_t seq_id);
  LayerScores scores_so_far(int64_t seq_id) const;
  void finish_dynamic(int64_t seq_id);
  // The queries a policy's scorer reads from a prompt's q [H, T, D]: with KV heads replicated over
  // tensor-parallel ranks, the window's rows gathered from the group (a collective).
  torch::Tensor scorer_queries(const PolicyConfig& cfg, const torch::Tensor& q) const;
  void settle(int64_t seq_id);
  // Prefix caching: a compressing policy's full-precision copy of a layer's cacheable blocks (kf, vf
  // [KV, prompt, D]), and at end_prefill the prompt's new full blocks into the cache.
  void copy_for_cache(int64_t seq_id, int64_t ll, const torch::Tensor& kf, const torch::Tensor& vf);
  void publish_prefix(int64_t seq_id, bool compressed);
  // Writes a selection's K/V (kept [KV, n] positions of kf/vf [KV, T, D], per-head counts when the
  // heads keep different numbers) into a layer.
  void write_kept(int64_t seq_id, int64_t ll, const torch::Tensor& kf, const torch::Tensor& vf, const torch::Tensor& kept,
                  const std::vector<int64_t>& counts);
  void drop_prefix(int64_t seq_id);
  int64_t local(int64_t layer) const;
  bool last_shard() const { return shard_.first_layer + num_layers_ == shard_.total_layers; }
  bool holds_every_layer() const { return shard_.first_layer == 0 && last_shard(); }

  // One sequence's policy state; the selector lives only during prefill.
  struct SeqState {
    const PolicyConfig* policy = nullptr;
    std::unique_ptr<PrefillSelector> selector;
    std::vector<DecodeEvictor> evictors;  // per layer; empty when the policy never evicts in decode
    std::vector<int64_t> budgets;
    int64_t prompt_len = 0;
    // Chunked prefill of a compressing policy: per layer the last `window` queries seen so far
    // (what window attention scores with at the last chunk); undefined when not needed.
    std::vector<torch::Tensor> query_tail;
    // Self-speculation over a draft policy's kept set: its selection, run beside a whole prompt;
    // then (draft_live) re-run every draft_refresh tokens: per local layer the latest queries
    // [H, <= window, D] of the positions before draft_tail_end (decode steps record them; a window
    // scorer reads them), and the length the view was last chosen at.
    std::unique_ptr<PrefillSelector> draft_selector;
    bool draft_live = false;
    std::vector<torch::Tensor> draft_tail;
    int64_t draft_tail_end = 0, draft_chosen_at = 0;
    // Prefix caching: the prompt's tokens told so far, the cache entries the sequence uses (a chain
    // from the prompt's first block), what its lookup found, whether it may copy its blocks into
    // the cache and, per layer, those copies (blocks [hit, prompt_len / block_size)).
    std::vector<int64_t> tokens;
    std::vector<int32_t> prefix;
    int64_t queried = 0, hit = 0;
    bool keep_copy = false;
    std::vector<std::vector<int32_t>> copies;
    // Conversation reuse: the prompt continues a parked sequence's KV (its first `hit` positions
    // are what that sequence kept; the rest is appended whole); the sequence is parked.
    bool resumed = false;
    bool parked = false;
    // Scores after the prefill: the whole prompt is held until select_by_scores runs.
    bool awaiting_scores = false;
    // ...and, where the pool rounds or quantizes K/V (Geometry::rounds_kv), per local layer its
    // prompt K/V as computed: the reconstruction pass attends to them and the selection keeps rows
    // of them, so that scores and kept rows never see the pool's rounding (quantized once, after).
    std::vector<std::pair<torch::Tensor, torch::Tensor>> pending_kv;
    // kvzap: per local layer the predictor's scores so far ([KV, n] pieces in position order).
    std::vector<std::vector<torch::Tensor>> recorded;
    // Compressed contexts: the prefill compresses the context (begin_context's tokens) of a prompt
    // of context_prompt_len tokens; its KV goes into the cache at end_prefill unless it came from
    // there; `context_entry` is the cache entry the sequence uses (-1: none).
    std::vector<int64_t> context;
    int64_t context_prompt_len = 0;
    int32_t context_entry = -1;
  };
  // The cache key of a context under a policy.
  uint64_t context_key(const PolicyConfig& cfg, std::span<const int64_t> context) const;
  void publish_context(int64_t seq_id);
  // The most prompt positions the sequence may take from the prefix cache: the last position, and
  // a window scorer's last `window` queries, are always computed (H2O's every query), so a hit
  // never changes what a policy keeps.
  int64_t reuse_limit(const PolicyConfig& cfg, bool compresses, int64_t prompt_len) const;
  // prefill_tokens with a parked sequence to continue: moves its KV state to seq_id.
  int64_t resume_parked(int64_t seq_id, ResumeFrom from, int64_t prompt_len);
  // The cache entries a prompt (its first chunk `tokens`) may take, at most max_hit positions.
  std::vector<int32_t> prefix_match(const PolicyConfig& cfg, bool compresses, int64_t prompt_len,
                                    std::span<const int64_t> tokens, int64_t max_hit) const;

  int64_t num_layers_;
  KvShard shard_;
  PagedKvCache cache_;
  std::map<std::string, PolicyConfig> policies_;
  std::optional<PolicyConfig> draft_policy_;  // set_draft_policy's, budget in tokens
  int64_t draft_min_prompt_ = 0, draft_skip_blocks_ = 0, draft_refresh_ = 0;
  // The draft view's blocks of a layer from a selection's `kept` ([KV, n] positions).
  void set_draft_view(int64_t seq_id, int64_t ll, const torch::Tensor& kept, const std::vector<int64_t>& counts);
  // Runs the draft policy's selection of a layer whose whole prompt K (and the last queries) are here.
  void draft_select(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k);
  // Decode steps (not draft steps) of a live draft view: the rows' queries of layer ll, kept per sequence.
  void record_draft_queries(int64_t ll, const DecodeBatch& batch, const torch::Tensor& q);
  // The draft policy's selection again over the sequence's whole cache of `len` positions.
  void rescore_draft_view(int64_t seq_id, int64_t len);
  std::string default_policy_;
  bool rounds_kv_ = false;  // Geometry::rounds_kv
  uint64_t context_salt_ = 0;
  std::unordered_map<int64_t, SeqState> seqs_;
  std::vector<int64_t> windows_;  // per local layer, set_layer_windows
  // Whether layer ll (of this shard) is a sliding-window layer.
  bool windowed(int64_t ll) const { return !windows_.empty() && windows_[static_cast<size_t>(ll)] > 0; }
};

}  // namespace kvserve
