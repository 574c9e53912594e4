#pragma once
// MixedKvMemory: one shard's KV memory whose sequences store K/V in different formats (float16, int8,
// int4, ...), each format a PagedKvMemory, all drawing their blocks from one KvSlabs storage.
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache_manager/kv_memory.h"
#include "cache_manager/kv_slabs.h"
#include "cache_manager/paged_kv_memory.h"

namespace kvserve {

// A sequence's format is its policy's (PolicyConfig::kv_dtype), fixed at begin_prefill; every later
// call about it goes to that format's memory. A decode step over sequences of several formats runs
// each format's rows through its own memory (its kernels, its block tables) and puts the rows back
// in the step's order, so the model sees one KvMemory and one batch. With a single format every call
// passes straight through.
class MixedKvMemory final : public KvMemory {
 public:
  // memories[0] is the default format (policies not named in policy_format, and the empty policy
  // name); every memory after the first must be built on `slabs`, as memories[0] then is too.
  MixedKvMemory(std::vector<std::unique_ptr<PagedKvMemory>> memories, std::map<std::string, size_t> policy_format,
                std::shared_ptr<KvSlabs> slabs);
  explicit MixedKvMemory(std::unique_ptr<PagedKvMemory> only);

  size_t num_formats() const { return memories_.size(); }
  PagedKvMemory& format(size_t i) { return *memories_.at(i); }
  const PagedKvMemory& format(size_t i) const { return *memories_.at(i); }
  // The format a policy's sequences use, and the memory that holds a sequence (throws naming it
  // when none does).
  size_t format_of_policy(const std::string& policy) const;
  PagedKvMemory& of(int64_t seq_id) { return *memories_[owner(seq_id)]; }
  const PagedKvMemory& of(int64_t seq_id) const { return *memories_[owner(seq_id)]; }
  bool holds(int64_t seq_id) const { return owner_.count(seq_id) > 0; }
  size_t format_of(int64_t seq_id) const { return owner(seq_id); }
  // Policies whose sequences are not in memories[0]'s format, and theirs.
  const std::map<std::string, size_t>& policy_formats() const { return policy_format_; }
  const KvSlabs* slabs() const { return slabs_.get(); }

  // KvMemory, routed by sequence.
  void begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string& policy) override;
  void store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override;
  torch::Tensor as_stored(int64_t seq_id, const torch::Tensor& x) const override;
  void end_prefill(int64_t seq_id) override;
  EarlierKv prefill_context(int64_t seq_id, int64_t layer) override;
  void store_prefill_chunk(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& q, const torch::Tensor& k,
                           const torch::Tensor& v) override;
  int64_t prefill_tokens(int64_t seq_id, int64_t start, std::span<const int64_t> tokens, int64_t max_hit,
                         bool keep_copy, ResumeFrom resume = {}) override;
  int64_t begin_context(int64_t seq_id, std::span<const int64_t> context, int64_t prompt_len, bool lookup) override;
  void continue_prompt(int64_t seq_id) override;
  const PolicyConfig* pending_selection(int64_t seq_id) const override;
  const PolicyConfig* prefill_policy(int64_t seq_id) const override;
  void record_scores(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& scores) override;
  std::vector<torch::Tensor> take_scores(int64_t seq_id) override;
  torch::Tensor reconstruction_queries(const torch::Tensor& q) override;
  void select_by_scores(int64_t seq_id, const std::vector<torch::Tensor>& scores) override;
  // A step over several formats cannot be padded (a CUDA graph captures one format's kernels); a
  // format that fails to plan its rows undoes what the earlier formats planned before it throws.
  void begin_decode(const DecodeBatch& batch, int64_t padded_rows = 0) override;
  torch::Tensor decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                 const torch::Tensor& k, const torch::Tensor& v) override;
  void truncate(int64_t seq_id, int64_t n) override;
  void release(int64_t seq_id) override;
  int64_t layer_window(int64_t layer) const override { return memories_[0]->layer_window(layer); }
  int64_t cached_tokens(int64_t seq_id, int64_t layer) const override { return of(seq_id).cached_tokens(seq_id, layer); }
  // With one format, its blocks. With several, in units of unit_bytes() (the largest size that
  // divides every format's block): a block of format f is block_units(f) units, the storage
  // bytes_total() / unit_bytes(), used each format's blocks in units, summed, and high water the
  // most slabs held at once, in units (with what is free inside them). The
  // scheduler counts in these units (ShardUsage::policy_units) so that one admission check covers
  // every format. A format's free blocks inside slabs it holds are not another's: counting them free
  // is exact only once its slabs drain (fullest-first allocation keeps that slack small).
  int64_t blocks_total() const override;
  int64_t blocks_used() const override;
  int64_t blocks_high_water() const override;
  int64_t kept_tokens(int64_t seq_id) const override { return of(seq_id).kept_tokens(seq_id); }

  // Where each format could put blocks now, in units, with several formats on one storage: the free
  // and reclaimable blocks of slabs its requests use (only it can fill them) and the slabs no request
  // uses (free, or holding only cached blocks a reclaim frees), which any format takes whole. The
  // scheduler plans against this rather than one free count, so that blocks free inside one
  // format's slabs never look like room for another's.
  struct Room {
    std::vector<int64_t> own_units;  // per format
    int64_t free_slabs = 0;
    int64_t slab_units = 0;          // 0: one pool, own_units[0] is all the room
  };
  Room room() const;

  // KV bytes the storage holds, and those the sequences and caches of every format use.
  int64_t bytes_total() const;
  int64_t bytes_used() const;
  int64_t unit_bytes() const { return unit_bytes_; }
  int64_t block_units(size_t format) const { return block_units_.at(format); }
  int64_t policy_block_units(const std::string& policy) const { return block_units_[format_of_policy(policy)]; }

  // PagedKvMemory's per-sequence and per-policy questions, routed.
  void park(int64_t seq_id) { of(seq_id).park(seq_id); }
  PagedKvMemory::HeadKeptStats head_kept(int64_t seq_id) const { return of(seq_id).head_kept(seq_id); }
  int64_t prefix_queried(int64_t seq_id) const { return of(seq_id).prefix_queried(seq_id); }
  int64_t prefix_hit(int64_t seq_id) const { return of(seq_id).prefix_hit(seq_id); }
  int64_t shared_prefix_blocks(std::span<const int64_t> prompt, const std::string& policy,
                               std::span<const int64_t> leaving) const {
    return memories_[format_of_policy(policy)]->shared_prefix_blocks(prompt, policy, leaving);
  }
  // Every format's.
  void reset_caches();
  void set_draft_policy(const std::string& name, int64_t budget, int64_t min_prompt_tokens, int64_t sink_tokens,
                        int64_t refresh_tokens = 0);

 private:
  size_t owner(int64_t seq_id) const;
  // A decode batch's rows by format, in the batch's order within each (kept while the batch is the same).
  struct Part {
    size_t format = 0;
    DecodeBatch batch;
    torch::Tensor rows;  // int64 indices of the part's rows in the step's batch
  };
  const std::vector<Part>& split(const DecodeBatch& batch);

  std::vector<std::unique_ptr<PagedKvMemory>> memories_;
  std::map<std::string, size_t> policy_format_;
  std::shared_ptr<KvSlabs> slabs_;
  int64_t unit_bytes_ = 0;
  std::vector<int64_t> block_units_;  // per format
  std::unordered_map<int64_t, size_t> owner_;  // sequence -> format, from begin_prefill to release
  DecodeBatch split_of_;
  std::vector<Part> parts_;
};

}  // namespace kvserve
