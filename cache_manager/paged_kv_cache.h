#pragma once
// PagedKvCache: per-(sequence, layer) paged K/V of one shard: write, compact, append, attend, release.
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache_manager/block_allocator.h"
#include "cache_manager/block_table.h"
#include "cache_manager/compressed_context_cache.h"
#include "cache_manager/device_block_tables.h"
#include "cache_manager/draft_view.h"
#include "cache_manager/host_kv_tier.h"
#include "cache_manager/kv_block_pool.h"
#include "cache_manager/kv_slabs.h"
#include "cache_manager/prefix_cache.h"

namespace kvserve {

// One decode step's block tables for one layer, built once and shared by every kernel call of that step.
struct DecodeTables {
  torch::Tensor block_table;  // int32 [B, max_blocks] on the pool's device (padding: block 0)
  torch::Tensor lengths;      // int32 [B] on the pool's device
};

// Owns the pool, the allocator and every sequence's block tables. Layers are numbered 0..num_layers-1
// locally (a pipeline stage maps its global layers). Token positions are kept per (layer, head, slot)
// in a host array paged like the K/V blocks, so they are freed and compacted with them.
// A block table belongs to a (sequence, layer, lane): one lane holding every KV head (the per-layer
// layout, one length per layer), or with KvPoolOptions::head_blocks one lane per KV head, each with
// its own blocks and length (head-wise budgets). Every call takes and returns all KV heads of a
// layer ([KV, ...] tensors); a decode step runs each (sequence, lane) as one row of the kernels, so
// the kernels are the same for both layouts.
// Failure contract: an operation that cannot get its blocks throws KvError "KV pool exhausted: ..."
// before changing anything. Not thread-safe: one engine thread drives it.
class PagedKvCache {
 public:
  // slabs null: the cache owns its pool, sized by `options`. Otherwise its blocks are carved from
  // slabs of a storage it shares with caches of other formats (cache_manager/kv_slabs.h; `options`
  // must be one of the formats the storage was sized for).
  // Its pool is a view of the whole storage in its own blocks, its allocator takes slabs as it needs
  // them, and when it is short it first reclaims its own cached blocks, then asks the other caches
  // to reclaim theirs. The pool's size options are ignored: the storage's bytes are the budget.
  PagedKvCache(int64_t num_layers, const KvPoolOptions& options, std::shared_ptr<KvSlabs> slabs = nullptr);
  ~PagedKvCache();
  // The shared storage's reclaimer points at this cache.
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;

  // --- sequences -------------------------------------------------------------------------------
  void add_sequence(int64_t seq_id);  // every layer empty
  bool has_sequence(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  void release(int64_t seq_id);       // returns every block; unknown ids are an error
  std::vector<int64_t> sequence_ids() const;

  // --- content -----------------------------------------------------------------------------------
  // Replaces the layer's content: k, v [KV, n, D] (any float dtype/device, converted), positions
  // [KV, n] integer (host or device). n may be 0. Blocks the layer held are reused/freed.
  // head_lengths (head-wise layout only; empty = n for every head): head h keeps its first
  // head_lengths[h] <= n rows, the rest of its row is padding and not stored.
  void write(int64_t seq_id, int64_t layer, const torch::Tensor& k, const torch::Tensor& v,
             const torch::Tensor& positions, const std::vector<int64_t>& head_lengths = {});
  // Appends n tokens to the layer after its current content: k, v [KV, n, D], positions [KV, n]
  // (a chunk of a chunked prefill). Takes only the blocks the new tokens need.
  void extend(int64_t seq_id, int64_t layer, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& positions);
  // Keeps, per head, the slots keep_slots [KV, m] (int64, each in [0, length)) in the given order:
  // new slot j of head h = old slot keep_slots[h][j]. Copied into fresh blocks, old ones freed at once.
  // head_counts (head-wise layout only): head h keeps only the first head_counts[h] entries of its row.
  void compact(int64_t seq_id, int64_t layer, const torch::Tensor& keep_slots,
               const std::vector<int64_t>& head_counts = {});
  // Drops the first n blocks of every lane of a layer (a sliding-window layer whose oldest slots no
  // query can see any more): the remaining slots move down by n * block_size, their positions with
  // them. The blocks go back to the pool unless another holder (the prefix cache) references them.
  void drop_leading_blocks(int64_t seq_id, int64_t layer, int64_t n);
  // Decode: one token per sequence (k, v [B, KV, D]) at true positions[b] (same for every head).
  // A block is taken only when a sequence's last block of this layer is full. An id may repeat only
  // in consecutive entries at consecutive positions (a speculative step's tokens of one sequence).
  void append(int64_t layer, const std::vector<int64_t>& seq_ids, const torch::Tensor& k, const torch::Tensor& v,
              const std::vector<int64_t>& positions);
  // Drops the last n slots of every layer and lane of a sequence (a speculative step's rejected
  // tokens), returning the blocks that then hold nothing. n may not exceed any lane's length.
  void truncate_last(int64_t seq_id, int64_t n);
  // The model's decode hook in one call: append, build the tables, paged attention. q [B, H, D] → [B, H, D].
  torch::Tensor append_and_attend(int64_t layer, const std::vector<int64_t>& seq_ids,
                                  const std::vector<int64_t>& positions, const torch::Tensor& q,
                                  const torch::Tensor& k, const torch::Tensor& v, double scale = -1.0);
  // Block tables of `layer` for a batch, ready for paged_attention() (rows of the device tables).
  DecodeTables decode_tables(int64_t layer, const std::vector<int64_t>& seq_ids);
  // paged_attention() over the current content (no append).
  torch::Tensor attend(int64_t layer, const std::vector<int64_t>& seq_ids, const torch::Tensor& q, double scale = -1.0);

  // --- a decode step, planned once for every layer -----------------------------------------------
  // Takes the blocks every layer's append needs (or throws the exhaustion error before changing
  // anything), advances the host lengths and positions, and sends the step's table changes, batch
  // rows and positions to the device in one copy. decode_layer() then runs each layer on the device
  // alone: no host-built indices, no host synchronisation.
  // padded_rows > B pads the step to that many batch entries (a CUDA graph's bucket): the extra
  // entries use the device tables' null row (length 0 everywhere), so they read no K/V, get a zero
  // attention output and write nothing; no blocks, lengths or positions change for them.
  // An active `view` (a self-speculative draft step) makes every full-attention layer attend
  // through draft_view_tables() of the tables (sinks and window; the appended token is in the window).
  void begin_decode(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& positions,
                    int64_t padded_rows = 0, const DraftView& view = {});
  // True when begin_decode() planned this batch (through this view) and `layer` has not run yet.
  bool decode_planned(const std::vector<int64_t>& seq_ids, int64_t layer, const DraftView& view = {}) const;
  // Writes k, v [P, KV, D] (P = the planned batch entries, padding included) into the slots
  // begin_decode() took and returns paged attention of q [P, H, D] over each entry's tokens of
  // `layer`, the new one included (zero rows for padding). window > 0: a sliding-window layer, each
  // entry attends to its last `window` slots only (paged_attention).
  torch::Tensor decode_layer(int64_t layer, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             double scale = -1.0, int64_t window = 0);
  // Batch entries of the planned step (padding included), and the most blocks any real entry holds
  // in any layer after the step's append.
  int64_t planned_rows() const { return step_.active ? static_cast<int64_t>(step_.padded_rows) : 0; }
  int64_t planned_max_blocks() const;
  // Makes every layer of the planned step size its split-K launch from `hint` instead of its own
  // block count: a captured CUDA graph bakes the launch shape in, so it must not vary per step.
  // Any hint is correct (paged_decode_attention); one below the step's blocks is only slower.
  void fix_split_hint(int64_t hint);
  // Lets the planned step's layers run again (a CUDA graph's warm-up run, then its capture). The
  // host plan is unchanged and running a layer twice writes the same K/V to the same slots.
  void rearm_decode();
  // The planned step has run outside decode_layer (a CUDA graph replay).
  void end_decode() { step_.active = false; }
  // Whether decode_layer() runs kvserve's CUDA kernels, which read everything from device memory
  // and never sync (the libtorch path builds indices on the host and cannot be captured).
  bool device_kernels() const;
  // Room in the device tables for this many batch entries (sequences plus padding), reserved now.
  void reserve_decode_rows(int64_t rows);
  const DeviceBlockTables& device_tables() const { return dev_; }

  // --- prefix caching (cache_manager/prefix_cache.h) ---------------------------------------------
  // Keeps full-precision prompt blocks after their request, reclaimed (least recently used first)
  // whenever an allocation finds the free list short; `salt` names what else changes the K/V.
  // host_tier_bytes > 0 adds the host-RAM tier (cache.prefix_cache_bytes) that reclaimed entries
  // move to instead of being dropped.
  void enable_prefix_cache(uint64_t salt, PrefixCache::KeyFn key_fn = nullptr, int64_t host_tier_bytes = 0);
  const HostKvTier* host_tier() const { return tier_ ? &*tier_ : nullptr; }
  // Brings entries that are in the host tier back into pool blocks (PrefixCache::promote), with
  // the positions they were cached at; entries already in the pool are left alone. Returns how
  // many of `entries`, from the first, are now in the pool: where the pool had no room, the rest
  // stays on the host.
  size_t prefix_promote(const std::vector<int32_t>& entries);
  PrefixCache* prefix_cache() { return prefix_ ? &*prefix_ : nullptr; }
  const PrefixCache* prefix_cache() const { return prefix_ ? &*prefix_ : nullptr; }
  // PrefixCache::insert on this pool's allocator (-1: not inserted).
  int32_t prefix_insert(int32_t parent, std::span<const int64_t> block_tokens, const std::vector<int32_t>& blocks) {
    KV_CHECK(prefix_, "prefix cache not enabled");
    return prefix_->insert(parent, block_tokens, blocks, alloc_);
  }
  // Makes an empty layer of seq_id hold `blocks` (full, shared: each gets a reference) as its first
  // `length` slots; their positions are those the blocks were written with. Head-wise, `blocks` is
  // lane-major (lane 0's blocks, then lane 1's, ...) and `length` is every lane's.
  void share(int64_t seq_id, int64_t layer, const std::vector<int32_t>& blocks, int64_t length);
  // Writes k, v [KV, n, D] at positions first, first + 1, ... into fresh blocks that no sequence
  // holds (one reference each, the caller's); throws the exhaustion error when they cannot be had.
  // Head-wise, the blocks come back lane-major (lanes() runs of ceil(n / block_size)).
  std::vector<int32_t> store_blocks(const torch::Tensor& k, const torch::Tensor& v, int64_t first);
  // --- compressed contexts (cache_manager/compressed_context_cache.h) ------------------------------
  // Frees cached blocks no request uses (prefix cache first, then compressed contexts, which move to
  // the host tier where it has room) until `need` are free; whether they are.
  bool reclaim(int64_t need);
  // The shared storage (null: the cache owns its pool).
  const KvSlabs* slabs() const { return slabs_.get(); }
  // Brings a compressed context in the host tier (in use: acquired) back into pool blocks with the
  // positions it was kept at; throws the exhaustion error when the pool has no room.
  void context_to_pool(int32_t entry);
  void enable_context_cache();
  CompressedContextCache* context_cache() { return contexts_ ? &*contexts_ : nullptr; }
  const CompressedContextCache* context_cache() const { return contexts_ ? &*contexts_ : nullptr; }
  // A sequence's every (layer, lane) table as an entry would hold it, with references of its own:
  // whole blocks shared, a partly filled last block copied (the sequence goes on appending to its
  // own). Throws the exhaustion error, changing nothing, when the copies cannot be had.
  std::vector<CompressedContextCache::Table> snapshot(int64_t seq_id);
  // Makes an empty sequence hold an entry's tables (layers x lanes, layer-major) the same way:
  // whole blocks shared, each partly filled last block copied into a block of its own.
  void adopt(int64_t seq_id, const std::vector<CompressedContextCache::Table>& tables);
  // Blocks snapshot/adopt copy for these tables.
  int64_t tail_copies(const std::vector<CompressedContextCache::Table>& tables) const;
  // Returns blocks from store_blocks (or any reference the caller holds).
  void drop(std::vector<int32_t>& blocks) { drop_blocks(blocks); }
  // Blocks of a sequence's tables that only it references (what its release frees at once).
  int64_t private_blocks_of(int64_t seq_id) const;

  // Moves a sequence's tables (and its device row) to another id (a parked conversation resumed
  // by its next turn's request).
  void rename_sequence(int64_t from, int64_t to);

  // Self-speculation with a draft policy (SpeculativeConfig::draft_policy): the blocks of a
  // (sequence, layer, lane) table that its draft view keeps between the sinks and the window (block
  // indices of the table, ascending; draft_view.h). Dropped with the sequence, and for a layer
  // whose blocks move (compact, drop_leading_blocks). draft_blocks: null when none were set.
  void set_draft_blocks(int64_t seq_id, int64_t layer, int64_t lane, std::vector<int32_t> blocks);
  const std::vector<int32_t>* draft_blocks(int64_t seq_id, int64_t layer, int64_t lane) const;

  // --- inspection --------------------------------------------------------------------------------
  // The layer's length: the longest of its heads' (they are all equal in the per-layer layout).
  int64_t length(int64_t seq_id, int64_t layer) const;
  // Every KV head's length in the layer.
  std::vector<int64_t> head_lengths(int64_t seq_id, int64_t layer) const;
  // Whether every KV head of the layer holds the same number of tokens.
  bool uniform(int64_t seq_id, int64_t layer) const;
  // Original token positions, int64 [KV, length] on the host; a head shorter than the layer's
  // length is padded with -1.
  torch::Tensor positions(int64_t seq_id, int64_t layer) const;
  // Contiguous copies k, v [KV, length, D] in the pool's dtype/device (tests, debugging, eviction
  // scoring, a chunk's context); a quantized pool's rows come back decoded. Needs every head at one
  // length (throws otherwise).
  std::pair<torch::Tensor, torch::Tensor> gather(int64_t seq_id, int64_t layer) const;
  // The same for heads of any lengths: k, v padded with zeros to the longest head, and every KV
  // head's length (empty when they are all equal and nothing is padded).
  std::tuple<torch::Tensor, torch::Tensor, std::vector<int64_t>> gather_padded(int64_t seq_id, int64_t layer) const;
  // One lane's table (lane 0 .. lanes() - 1; the per-layer layout has lane 0 only).
  const LayerBlocks& layer_blocks(int64_t seq_id, int64_t layer, int64_t lane = 0) const;
  // Block tables per (sequence, layer): 1, or the KV heads with head-wise blocks.
  int64_t lanes() const { return lanes_; }
  bool head_blocks() const { return head_split_; }
  // Drops every prefix-cache and compressed-context entry no request uses, in the pool and in the
  // host tier (the engine's warm-up leaves nothing of its throwaway prompts behind).
  void drop_cached();

  // --- accounting --------------------------------------------------------------------------------
  // Free counts cached blocks no request uses: an allocation reclaims them.
  int64_t free_blocks() const { return alloc_.free_blocks() + reclaimable_blocks(); }
  // Blocks this cache's requests hold (on a shared storage, not the other formats' slabs).
  int64_t used_blocks() const { return alloc_.used_blocks() - reclaimable_blocks(); }
  int64_t reclaimable_blocks() const {
    return (prefix_ ? prefix_->reclaimable_blocks() : 0) + (contexts_ ? contexts_->reclaimable_blocks() : 0);
  }
  // On a shared storage: per slab of it, the blocks this cache's requests use there (its blocks in
  // use less the cached ones no request uses, which a reclaim frees); empty on an own pool.
  std::vector<int32_t> request_blocks_per_slab() const;
  // Blocks the prefix cache holds (used by requests or not).
  int64_t cached_blocks() const { return prefix_ ? prefix_->cached_blocks() : 0; }
  int64_t total_blocks() const { return alloc_.total_blocks(); }
  int64_t high_water_blocks() const { return alloc_.high_water_blocks(); }
  void reset_high_water() { alloc_.reset_high_water(); }
  int64_t block_bytes() const { return pool_.block_bytes(); }
  int64_t blocks_of(int64_t seq_id) const;
  int64_t bytes_of(int64_t seq_id) const { return blocks_of(seq_id) * block_bytes(); }
  // Blocks for a sequence holding tokens_per_layer[l] tokens in layer l (admission control).
  int64_t blocks_needed(const std::vector<int64_t>& tokens_per_layer) const;
  // Blocks the next append of one token to every layer of seq_id would take.
  int64_t blocks_for_next_token(int64_t seq_id) const;
  // Full consistency check (allocator invariants, every table's blocks referenced, lengths fit).
  void check_invariants() const;

  int64_t num_layers() const { return num_layers_; }
  int64_t block_size() const { return pool_.block_size(); }
  int64_t num_kv_heads() const { return heads_; }
  int64_t head_dim() const { return pool_.head_dim(); }
  const KvBlockPool& pool() const { return pool_; }
  const BlockAllocator& allocator() const { return alloc_; }

 private:
  SequenceBlockTable& table_of(int64_t seq_id);
  const SequenceBlockTable& table_of(int64_t seq_id) const;
  // A (layer, lane)'s index in a SequenceBlockTable, and a (sequence, lane)'s key in the device tables.
  int64_t slot(int64_t layer, int64_t lane) const { return layer * lanes_ + lane; }
  int64_t row_key(int64_t seq_id, int64_t lane) const { return lanes_ == 1 ? seq_id : seq_id * lanes_ + lane; }
  LayerBlocks& lane_of(int64_t seq_id, int64_t layer, int64_t lane);
  // Checks a per-head length list against n rows; empty means n for every head.
  std::vector<int64_t> lane_lengths(const char* what, const std::vector<int64_t>& head_lengths, int64_t n) const;
  // A [KV, ...] tensor's rows of one lane.
  torch::Tensor lane_rows(const torch::Tensor& t, int64_t lane) const { return t.narrow(0, lane * kv_, kv_); }
  // reclaim() of this cache's own cached blocks only, and what another cache on the same storage
  // asks of it: reclaim cached blocks until the storage has `slabs` free slabs or nothing is left.
  bool reclaim_own(int64_t need);
  void reclaim_slabs(int64_t slabs);
  // Takes n blocks or throws the exhaustion error naming the sequence and layer; no change on failure.
  std::vector<int32_t> take_blocks(int64_t n, int64_t seq_id, int64_t layer);
  // K or V rows [..., D] in the pool's storage form (its dtype, or quantized rows) on its device,
  // and stored rows back as values of the pool's dtype.
  torch::Tensor encode(const torch::Tensor& x) const;
  torch::Tensor decode(const torch::Tensor& rows) const;
 public:
  // Values [..., D] as the pool would give them back after storing them (rounded to its dtype or
  // quantized and decoded), in x's dtype and device.
  torch::Tensor round_trip(const torch::Tensor& x) const { return decode(encode(x)).to(x.options()); }
  // Whether stored rows are rotated (kv_quant_rotate) before a quantized pool encodes them.
  bool rotates() const { return rotates_; }

 private:
  // paged_attention() of q [rows, heads, D] over the pool through these tables, in unrotated terms.
  torch::Tensor stored_attention(const torch::Tensor& q, const torch::Tensor& table, const torch::Tensor& lengths,
                                 double scale, int64_t window) const;
  // Copies a block's K/V and positions into another.
  void clone_block(int32_t src, int32_t dst);
  std::vector<CompressedContextCache::Table> share_tables(const std::vector<CompressedContextCache::Table>& from,
                                                          int64_t seq_id);
  void drop_blocks(std::vector<int32_t>& blocks);
  // Pool slot addressing for a layer's first `count` slots: block ids and offsets as int64 tensors.
  std::pair<torch::Tensor, torch::Tensor> slot_index(const std::vector<int32_t>& blocks, int64_t count) const;
  // An idle compressed context's blocks into the host tier (dropping older tier contexts to make
  // room there); false, changing nothing, when the tier cannot hold it.
  bool context_to_host(int32_t entry);
  int32_t* pos_ptr(int32_t block, int64_t head) { return pos_.data() + (int64_t{block} * kv_ + head) * bs_; }
  const int32_t* pos_ptr(int32_t block, int64_t head) const {
    return pos_.data() + (int64_t{block} * kv_ + head) * bs_;
  }

  // Records a (layer, lane)'s whole table and length for the device.
  void mirror_layer(int64_t seq_id, int64_t layer, int64_t lane, const LayerBlocks& lb);
  // The batch's kernel rows: every (sequence, lane) pair, sequence-major.
  std::vector<int64_t> lane_keys(const std::vector<int64_t>& seq_ids) const;
  // Table rows of a batch as a device tensor, and the most blocks any of them holds in `layer`.
  torch::Tensor batch_rows(const std::vector<int64_t>& seq_ids);
  int64_t max_blocks(int64_t layer, const std::vector<int64_t>& seq_ids) const;
  // Where one new token per sequence goes in layers [first, first + layers): per layer and batch
  // entry its block and offset, and per layer the most blocks a batch entry then holds.
  struct Slots {
    std::vector<int32_t> rows;          // [B] device table rows
    std::vector<int32_t> block;         // [layers * B]
    std::vector<int64_t> offset;        // [layers * B]
    std::vector<int64_t> max_blocks;    // [layers]
    // A sequence in several consecutive entries (a speculative step): each entry's layer length
    // after its own append, [layers * B] (empty otherwise).
    bool grouped = false;
    std::vector<int32_t> lengths;
  };
  // Append and decode share this: checks the batch, takes the blocks of every layer in the range (or
  // throws the exhaustion error before changing anything), records the positions and advances the
  // lengths on the host and, as diffs, for the device. `what` prefixes the error messages.
  Slots take_slots(const char* what, const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& positions,
                   int64_t first, int64_t layers);
  // Writes k, v [B, KV, D] to slots (block, offset) per batch entry, from host-known slots.
  void write_slots(const int32_t* blk, const int64_t* off, const torch::Tensor& k, const torch::Tensor& v);

  // What begin_decode() planned: every layer's slots for the batch.
  struct DecodePlan {
    std::vector<int64_t> seq_ids;
    torch::Tensor rows;  // int32 [B] on the device (the step's batch rows)
    Slots slots;
    std::vector<char> done;  // [layers]
    bool active = false;
    size_t padded_rows = 0;  // batch entries incl. padding (>= seq_ids.size())
    int64_t split_hint = -1;  // >= 0: every layer's split-K hint (fix_split_hint)
    DraftView view;           // active: a draft step's attention reads this view of the tables
  };

  int64_t num_layers_;
  int64_t heads_;            // the shard's KV heads
  int64_t lanes_;            // block tables per (sequence, layer)
  bool head_split_;          // KvPoolOptions::head_blocks
  int64_t heads_per_block_;  // KV heads one block holds (heads_ / lanes_)
  std::shared_ptr<KvSlabs> slabs_;  // the storage shared with other formats' caches (null: own pool)
  KvBlockPool pool_;
  BlockAllocator alloc_;
  int64_t kv_, bs_, d_;      // kv_: heads per block (and per lane)
  std::vector<int32_t> pos_;  // [num_blocks, heads per block, block_size] original positions
  std::unordered_map<int64_t, SequenceBlockTable> seqs_;
  std::unordered_map<int64_t, std::vector<std::vector<int32_t>>> draft_blocks_;  // [layers * lanes] per sequence
  // Mutable: flushing brings the device mirror up to date without changing what the cache holds.
  mutable DeviceBlockTables dev_;
  DecodePlan step_;
  bool rotates_ = false;  // stored rows are kv_quant_rotate()d (a quantized pool)
  std::optional<HostKvTier> tier_;  // before prefix_, which points at it
  std::optional<PrefixCache> prefix_;
  std::optional<CompressedContextCache> contexts_;
};

}  // namespace kvserve
