#pragma once
// SeparateKvDrafter: a draft model of another shape than the served model (fewer layers, other heads;
// the same vocabulary) drafting over a KV cache of its own. The draft follows the served model: it
// prefills every prompt chunk the served model prefills for a sequence that may draft
// (PrefillWork::drafts), from its own prefix cache where it can, takes the tokens of plain steps and the
// accepted drafts as they come, and drops what the verify step rejected, so that at each speculative
// step its cache holds the sequence's positions before the last token, as the served model's does.
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "backend/engine/step_plan.h"
#include "backend/sampling/sampler.h"
#include "cache_manager/paged_kv_memory.h"

namespace kvserve {

class DecoderModel;

class SeparateKvDrafter {
 public:
  SeparateKvDrafter(std::shared_ptr<DecoderModel> draft, std::unique_ptr<PagedKvMemory> kv);
  ~SeparateKvDrafter();

  // The sequence is over, preempted or parked: its draft KV goes.
  void release(int64_t seq_id);
  // After the served model ran a prompt chunk: the draft prefills the same tokens (a resumed
  // conversation's whole prompt, which the served model continues from its parked KV). A chunk the
  // draft cannot take (its pool is full) leaves the sequence without drafts; the served model's
  // prefill is not affected.
  void follow_prefill(const PrefillWork& w);
  // Fills the draft rows of a speculative decode batch (placeholders after each sequence's last
  // token), as draft_with_own_kv does, with the draft model over its own cache: its first step also
  // runs the tokens the draft has not seen yet (plain steps' tokens, a fully accepted draft's last).
  // A sequence the draft cannot serve gets its last token repeated as drafts (the verify step
  // rejects them). Returns the draft steps run.
  int64_t draft(const DecodeBatch& batch, std::vector<int64_t>& tokens, SamplerBank* samplers,
                std::vector<SampledDraft>* sampled);
  // After the step's decode: `tokens` the rows' tokens (drafts included), `counts` the tokens each
  // sequence emitted (empty: one each, a plain step), or failed: the step's sequences lose their
  // draft KV (the served model's step left no state the draft could follow).
  void after_decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, const std::vector<int64_t>& counts,
                    bool failed);

  const PagedKvMemory& memory() const { return *kv_; }
  // Prompt tokens the draft took from its own prefix cache instead of prefilling them.
  int64_t prefix_hits() const { return prefix_hits_; }
  // After a step: its prefills, which the draft follows at the next step's start (so that a
  // prompt's first token waits for the served model only).
  void defer_prefills(const std::vector<PrefillWork>& work) { pending_ = work; }
  // At a step's start: follows the deferred prefills, then lets go of the sequences the plan
  // releases or parks (a parked sequence's next turn is a new sequence the draft cannot continue).
  void begin_step(const StepPlan& plan);

 private:
  struct Seq {
    int64_t length = 0;  // positions [0, length) are in the draft's cache
    std::vector<int64_t> missing;  // the tokens of positions [length, length + missing.size()), not run yet
    bool broken = false;           // no drafts (its KV is gone)
    int64_t drafted_at = -1;       // this step: the position of the first draft (its cache holds up to
                                   // drafted_at + drafts - 2)
  };
  void drop(int64_t seq_id, Seq& s);
  // Whether s holds or knows every position before `position` (a step's last token); else it drops it.
  bool follows(int64_t seq_id, Seq& s, int64_t position);
  std::shared_ptr<DecoderModel> draft_;
  std::unique_ptr<PagedKvMemory> kv_;
  std::unordered_map<int64_t, Seq> seqs_;
  std::vector<PrefillWork> pending_;
  int64_t prefix_hits_ = 0;
};

// A drafter for `draft` (whose KV layout differs from the served model's as `why` says) with a cache
// holding as many tokens as `served`, the served model's memory (blocks per layer and lane alike),
// halved until it fits where a pool sized by free device memory left less.
std::unique_ptr<SeparateKvDrafter> make_separate_kv_drafter(std::shared_ptr<DecoderModel> draft, const PagedKvMemory& served,
                                                            const std::string& why);

}  // namespace kvserve
