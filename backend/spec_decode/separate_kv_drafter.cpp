#include "backend/spec_decode/separate_kv_drafter.h"

#include <algorithm>

#include "backend/model/decoder_model.h"
#include "backend/spec_decode/draft_verifier.h"
#include "backend/spec_decode/self_drafter.h"
#include "cache_manager/kv_memory_factory.h"
#include "common/check.h"
#include "common/log.h"

namespace kvserve {

SeparateKvDrafter::SeparateKvDrafter(std::shared_ptr<DecoderModel> draft, std::unique_ptr<PagedKvMemory> kv)
    : draft_(std::move(draft)), kv_(std::move(kv)) {}

SeparateKvDrafter::~SeparateKvDrafter() = default;

void SeparateKvDrafter::drop(int64_t seq_id, Seq& s) {
  kv_->release(seq_id);
  s = Seq{};
  s.broken = true;
}

bool SeparateKvDrafter::follows(int64_t seq_id, Seq& s, int64_t position) {
  if (s.length + static_cast<int64_t>(s.missing.size()) == position) return true;
  KV_LOG("internal: the draft model lost track of sequence " << seq_id << " (" << s.length << " + " << s.missing.size()
                                                             << " positions, a step at " << position
                                                             << "); it decodes without drafts");
  drop(seq_id, s);
  return false;
}

void SeparateKvDrafter::release(int64_t seq_id) {
  kv_->release(seq_id);
  seqs_.erase(seq_id);
}

void SeparateKvDrafter::begin_step(const StepPlan& plan) {
  for (const PrefillWork& p : pending_) follow_prefill(p);
  pending_.clear();
  for (const auto* ids : {&plan.release, &plan.park})
    for (int64_t id : *ids) release(id);
}

void SeparateKvDrafter::follow_prefill(const PrefillWork& w) {
  if (w.start == 0) release(w.seq_id);  // a new prompt, or a preempted one computed again
  if (!w.drafts) return;                // it never drafts (opted out; its KV policy evicts)
  Seq& s = seqs_[w.seq_id];
  if (s.broken) return;
  // A chunk the draft did not follow from the start cannot continue. A conversation's next turn
  // (prefix_reuse: compressed) comes whole: the served model resumes its parked KV and prefills the
  // rest, the draft prefills all of it over its own prefix cache (its earlier turns' blocks).
  if (s.length != w.start) {
    drop(w.seq_id, s);
    return;
  }
  PrefillInput in{w.seq_id, w.tokens, "full", w.start, w.total()};
  // The draft's own prefix cache (where the served model has one): a prompt's first chunk starts
  // after the blocks of it that an earlier prompt left there.
  in.reuse_prefix = kv_->prefix_caching();
  in.keep_copy = false;
  try {
    draft_->prefill_batch({in}, *kv_);
    s.length = w.start + static_cast<int64_t>(w.tokens.size());
    if (w.start == 0 && in.reuse_prefix) prefix_hits_ += kv_->prefix_hit(w.seq_id);
  } catch (const std::exception& e) {
    KV_LOG("the draft model could not prefill sequence " << w.seq_id << " (" << e.what() << "); it decodes without drafts");
    drop(w.seq_id, s);
  }
}

int64_t SeparateKvDrafter::draft(const DecodeBatch& batch, std::vector<int64_t>& tokens, SamplerBank* samplers,
                                 std::vector<SampledDraft>* sampled) {
  const size_t R = batch.seq_ids.size();
  KV_CHECK(tokens.size() == R && batch.positions.size() == R && (samplers == nullptr) == (sampled == nullptr),
           "internal: drafting " << R << " rows with " << tokens.size() << " tokens");
  if (sampled != nullptr) sampled->assign(R, SampledDraft{});
  auto [first, rows] = sequence_runs(batch);
  // Sequences that draft: their draft cache holds every position before the last token, or the
  // tokens it lacks are known. The others' rows get the last token repeated.
  std::vector<size_t> runs;
  for (size_t g = 0; g < first.size(); ++g) {
    const size_t f = first[g];
    for (size_t j = 1; j < rows[g]; ++j) tokens[f + j] = tokens[f];
    if (rows[g] < 2) continue;
    auto it = seqs_.find(batch.seq_ids[f]);
    if (it == seqs_.end() || it->second.broken) continue;
    if (follows(batch.seq_ids[f], it->second, batch.positions[f])) runs.push_back(g);
  }
  if (runs.empty()) return 0;
  size_t most = 0;
  for (size_t g : runs) most = std::max(most, rows[g] - 1);
  try {
    for (size_t j = 0; j < most; ++j) {
      // Step 0 runs what each draft cache lacks and the last token (consecutive rows of a sequence,
      // as a verify step's); step j > 0 the draft j of every sequence with more than j drafts.
      DecodeBatch step;
      step.draft = j > 0;  // appends past the last token go when the verify step rejects them
      std::vector<int64_t> in;
      std::vector<int64_t> last;  // per drafting sequence of this step: its last row in `step`
      std::vector<size_t> to;     // ... and the batch row its draft goes to
      DecodeBatch chooser;        // one row per drafting sequence, for choose_drafts
      for (size_t g : runs) {
        if (rows[g] - 1 <= j) continue;
        const size_t f = first[g];
        const int64_t id = batch.seq_ids[f];
        if (j == 0) {
          Seq& s = seqs_.at(id);
          for (size_t m = 0; m < s.missing.size(); ++m) {
            step.seq_ids.push_back(id);
            step.positions.push_back(s.length + static_cast<int64_t>(m));
            in.push_back(s.missing[m]);
          }
        }
        step.seq_ids.push_back(id);
        step.positions.push_back(batch.positions[f + j]);
        in.push_back(tokens[f + j]);
        last.push_back(static_cast<int64_t>(in.size()) - 1);
        to.push_back(f + j + 1);
        chooser.seq_ids.push_back(id);
        chooser.positions.push_back(batch.positions[f + j]);
      }
      torch::Tensor logits = draft_->decode(step, in, *kv_);
      if (last.size() != in.size())
        logits = logits.index_select(0, torch::tensor(last, torch::kInt64).to(logits.device()));
      std::vector<int64_t> chosen(to.size(), 0);
      choose_drafts(logits, chooser, to, chosen, samplers, sampled);
      for (size_t k = 0; k < to.size(); ++k) tokens[to[k]] = chosen[k];
    }
  } catch (const std::exception& e) {
    // The draft's cache may hold part of the failed step: these sequences stop drafting, and their
    // rows keep whatever drafts they got (the verify step decides).
    KV_LOG("a draft model's step failed (" << e.what() << "); its sequences decode without drafts");
    for (size_t g : runs) drop(batch.seq_ids[first[g]], seqs_.at(batch.seq_ids[first[g]]));
    return static_cast<int64_t>(most);
  }
  for (size_t g : runs) {
    Seq& s = seqs_.at(batch.seq_ids[first[g]]);
    s.drafted_at = batch.positions[first[g]] + 1;
    s.length = s.drafted_at + static_cast<int64_t>(rows[g]) - 2;  // the last token and all but the last draft
    s.missing.clear();
  }
  return static_cast<int64_t>(most);
}

void SeparateKvDrafter::after_decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens,
                                     const std::vector<int64_t>& counts, bool failed) {
  auto [first, rows] = sequence_runs(batch);
  for (size_t g = 0; g < first.size(); ++g) {
    const size_t f = first[g];
    auto it = seqs_.find(batch.seq_ids[f]);
    if (it == seqs_.end() || it->second.broken) continue;
    Seq& s = it->second;
    const int64_t drafted_at = s.drafted_at;
    s.drafted_at = -1;
    if (failed) {
      drop(batch.seq_ids[f], s);
      continue;
    }
    const int64_t last = batch.positions[f];  // the position of the step's first row (the last token)
    if (drafted_at != last + 1) {
      // No drafts of its own this step: the served model ran the last token only (a plain row, or
      // drafts the draft could not make, all rejected but the first row's bonus).
      if (follows(batch.seq_ids[f], s, last)) s.missing.push_back(tokens[f]);
      continue;
    }
    // Emitted: the accepted drafts and one more. The draft keeps the positions the served model
    // keeps before the new last token: [0, last + 1 + accepted).
    const int64_t emitted = counts.empty() ? 1 : counts[g];
    const int64_t keep = last + emitted;
    if (keep <= s.length) {
      if (s.length > keep) kv_->truncate(batch.seq_ids[f], s.length - keep);
      s.length = keep;
    } else {
      // Every draft accepted: the last draft was never run through the draft model.
      s.missing.push_back(tokens[f + rows[g] - 1]);
    }
  }
}

std::unique_ptr<SeparateKvDrafter> make_separate_kv_drafter(std::shared_ptr<DecoderModel> draft, const PagedKvMemory& served,
                                                            const std::string& why) {
  const PagedKvMemory::Geometry g = served.geometry();
  const int64_t per_layer = served.blocks_total() / std::max<int64_t>(1, g.num_layers * g.lanes());
  const KvMemoryLayout layout = draft->kv_layout();
  KvPoolSize size;
  size.block_size = g.block_size;
  size.num_blocks = per_layer * layout.num_layers;
  size.layout = KvLayout::kLayer;
  size.prefix_caching = served.prefix_caching();
  std::unique_ptr<PagedKvMemory> memory;
  // A sequence the draft's cache cannot hold decodes without drafts.
  while (!memory) {
    try {
      memory = make_kv_memory(layout, size, {});
    } catch (const std::exception& e) {
      KV_CHECK(size.num_blocks > 16 * layout.num_layers,
               "speculative_config.model: no room for the draft model's cache (" << e.what() << ")");
      size.num_blocks /= 2;
    }
  }
  KV_LOG("speculative_config: the draft model's KV layout differs (" << why << "): it drafts over a cache of its own, "
                                                                      << size.num_blocks << " blocks of " << g.block_size
                                                                      << " tokens ("
                                                                      << memory->cache().block_bytes() * size.num_blocks / (1 << 20)
                                                                      << " MiB"
                                                                      << (size.prefix_caching ? ", with a prefix cache" : "")
                                                                      << ")");
  return std::make_unique<SeparateKvDrafter>(std::move(draft), std::move(memory));
}

}  // namespace kvserve
