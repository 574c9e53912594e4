#pragma once
// KvMemory: the interface between the model and a KV cache (contiguous here, paged in cache_manager).
#include <torch/torch.h>

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cache_manager/draft_view.h"
#include "common/check.h"
#include "policies/policy_config.h"

namespace kvserve {

// Which sequences a decode step covers and where each new token sits (its true position). A
// speculative step's verified tokens of one sequence are consecutive entries at consecutive positions.
struct DecodeBatch {
  std::vector<int64_t> seq_ids;
  std::vector<int64_t> positions;
  // A self-speculative draft step attends through this view of each sequence's cache (inactive:
  // everything it holds); what the step appends is the draft's, truncated before verification.
  DraftView view{};
  // A draft step (through a view, or a draft model's over the whole cache): its appends are
  // truncated before the step that verifies them, so nothing is evicted or trimmed for it.
  bool draft = false;
  bool drafting() const { return draft || view.active(); }
};

// prefix_reuse: compressed: the parked sequence (a finished request of the same conversation) whose
// KV covers this prompt's first `length` positions, as its policy left it.
struct ResumeFrom {
  int64_t seq_id = -1;  // < 0: none
  int64_t length = 0;
};

// What a prompt chunk's queries attend to besides themselves (KvMemory::prefill_context): k, v
// [KV, n, D]; with KV heads of different lengths (head-wise budgets after a compressed context or
// turn) each head's length, its rows past it being padding.
struct EarlierKv {
  torch::Tensor k, v;
  std::vector<int64_t> head_lengths;  // empty: every head holds all n
};

class KvMemory {
 public:
  virtual ~KvMemory() = default;
  // Called once before the first layer of a sequence's prefill; `policy` names the KV policy
  // that decides what the sequence keeps ("" = the memory's default).
  virtual void begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string& policy) = 0;
  // One layer's full prompt K/V after RoPE ([KV, T, D]) and queries ([H, T, D]); the memory keeps
  // all of it or a policy's selection. Called for layers in increasing order.
  virtual void store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v) = 0;
  // A prompt chunk's K or V ([KV, T, D], after RoPE) as the sequence's later reads will find them
  // in this memory. A sequence that keeps its whole prompt in a pool that rounds or quantizes K/V
  // attends to its own prompt so, as it attends to earlier chunks and to cached prefixes, so that a
  // chunked or prefix-cached prefill computes what one forward computes (vLLM reads a prompt's K/V
  // back from its cache likewise). A compressing policy's prompt attends to them as computed and
  // is scored from them (they are quantized only when stored). Identity by default.
  virtual torch::Tensor as_stored(int64_t seq_id, const torch::Tensor& x) const {
    (void)seq_id;
    return x;
  }
  // Called after the last layer (policies that rebalance across layers settle here). A chunked
  // prefill calls it once, after its last chunk.
  virtual void end_prefill(int64_t seq_id) = 0;
  // Chunked prefill (docs/architecture.md, "Chunked prefill"): the prompt of begin_prefill's
  // `prompt_len` arrives over several forwards, each a run of positions [start, start + T).
  // prefill_context returns the K/V [KV, n, D] the earlier chunks left for `layer` (what the
  // chunk's queries attend to besides themselves; n = start, or fewer for a resumed conversation or
  // a compressed context, every one of them before the chunk, heads possibly of different lengths); store_prefill_chunk takes the chunk's K/V
  // ([KV, T, D], after RoPE) and queries ([H, T, D]). The memory keeps every earlier position until
  // the chunk that ends the prompt, where a policy selects over the whole prompt as store_prefill
  // would. A memory that cannot take chunks throws.
  virtual EarlierKv prefill_context(int64_t seq_id, int64_t layer) {
    KV_FAIL("this KV memory does not support chunked prefill (sequence " << seq_id << ", layer " << layer << ")");
  }
  virtual void store_prefill_chunk(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& q,
                                   const torch::Tensor& k, const torch::Tensor& v) {
    KV_FAIL("this KV memory does not support chunked prefill (sequence " << seq_id << ", layer " << layer
                                                                          << ", chunk at " << start << ")");
  }
  // Prefix caching (docs/architecture.md, "Prefix caching"): the tokens [start, start + n) of a
  // prompt being prefilled, told before the chunk's layers run (every chunk, so that the memory
  // knows the whole prompt by end_prefill). At the first chunk (start 0) and with max_hit >= 0,
  // looks the prompt up and returns how many leading positions (whole blocks, fewer than n, at most
  // max_hit) the memory now holds from cached blocks: the caller computes only the rest, as a chunk
  // at that position. max_hit < 0: no lookup. `keep_copy`: a compressing policy may also copy its
  // full-precision prompt blocks into the cache (the scheduler reserved room for them). `resume`:
  // the prompt continues a parked sequence's KV instead, which it takes over (returns its length;
  // the chunk's queries then attend to the kept positions only; nothing is selected again). A
  // memory without a prefix cache returns 0.
  static constexpr int64_t kNoLookup = -1;
  virtual int64_t prefill_tokens(int64_t seq_id, int64_t start, std::span<const int64_t> tokens, int64_t max_hit,
                                 bool keep_copy, ResumeFrom resume = {}) {
    (void)seq_id, (void)start, (void)tokens, (void)max_hit, (void)keep_copy, (void)resume;
    return 0;
  }
  // Compressed contexts (docs/architecture.md, "Compressed contexts"): a prompt whose policy
  // compresses its context alone runs in two parts. begin_prefill(seq, context_len) starts the
  // context; begin_context then tells the memory the context's tokens and the whole prompt's
  // length and, with `lookup`, takes the context's compressed KV from the memory's cache when it
  // holds it: it returns the context's length and the context needs no prefill. Otherwise (0) the
  // caller prefills the context as a whole prompt (its selection, reconstruction pass and
  // end_prefill included; the memory may then cache the compressed KV), and then calls
  // continue_prompt. Either way the rest of the prompt follows as chunks from the context's end,
  // attending to the kept entries and appended whole, and a final end_prefill.
  virtual int64_t begin_context(int64_t seq_id, std::span<const int64_t> context, int64_t prompt_len, bool lookup) {
    (void)context, (void)prompt_len, (void)lookup;
    KV_FAIL("this KV memory does not compress contexts (sequence " << seq_id << ")");
  }
  virtual void continue_prompt(int64_t seq_id) {
    KV_FAIL("this KV memory does not compress contexts (sequence " << seq_id << ")");
  }
  // Scores after the prefill (PolicyConfig::scores_after_prefill: kvzip's reconstruction pass,
  // backend/scoring/kvzip_scorer.h; kvzap's predictor, backend/scoring/kvzap_predictor.h): such a sequence holds its
  // whole prompt in every layer after its prefill's layers ran, until select_by_scores gets every
  // layer's scores and keeps the policy's selection; end_prefill comes after.
  // The policy's parameters while that selection is pending (nullptr otherwise).
  virtual const PolicyConfig* pending_selection(int64_t seq_id) const {
    (void)seq_id;
    return nullptr;
  }
  // The policy of a sequence between begin_prefill and end_prefill (nullptr: none, or full KV).
  virtual const PolicyConfig* prefill_policy(int64_t seq_id) const {
    (void)seq_id;
    return nullptr;
  }
  // Scores a layer's predictor gave the prompt positions [start, start + n) during the prefill
  // (kvzap): fp32 [KV, n]; kept until take_scores.
  virtual void record_scores(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& scores) {
    (void)layer, (void)start, (void)scores;
    KV_FAIL("this KV memory does not keep predicted scores (sequence " << seq_id << ")");
  }
  // What record_scores got, per layer of this memory (ascending), [KV, positions recorded]; cleared.
  virtual std::vector<torch::Tensor> take_scores(int64_t seq_id) {
    KV_FAIL("this KV memory does not keep predicted scores (sequence " << seq_id << ")");
  }
  // A reconstruction pass's queries of this shard's heads [H_local, n, D] -> every query head of its
  // KV heads' groups, where tensor parallelism split a group (KV heads replicated across ranks).
  virtual torch::Tensor reconstruction_queries(const torch::Tensor& q) { return q; }
  // scores: per layer of this memory (ascending), fp32 [KV, prompt - window], higher = keep.
  virtual void select_by_scores(int64_t seq_id, const std::vector<torch::Tensor>& scores) {
    (void)scores;
    KV_FAIL("this KV memory does not select by scores given after the prefill (sequence " << seq_id << ")");
  }
  // Called once per decode step before the first layer: a memory may plan the whole step here
  // (take every layer's blocks, send its tables to the device once). Optional for callers:
  // decode_attention plans a step itself when it finds none. padded_rows > batch size asks for a
  // step padded to that many entries (a CUDA graph's batch bucket): decode_attention then gets
  // q/k/v with that many rows, and the padding must change nothing; a memory that cannot pad throws.
  virtual void begin_decode(const DecodeBatch& batch, int64_t padded_rows = 0) {
    KV_CHECK(padded_rows <= static_cast<int64_t>(batch.seq_ids.size()), "this KV memory cannot pad a decode step");
  }
  // Appends one token per sequence (k, v: [B, KV, D]) to `layer` and returns attention of q
  // ([B, H, D]) over each sequence's cached tokens of that layer, the new one included: [B, H, D].
  virtual torch::Tensor decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                         const torch::Tensor& k, const torch::Tensor& v) = 0;
  // Speculative decoding: drops the sequence's last n tokens of every layer (the K/V a verify step
  // appended for draft tokens it rejected). A memory that cannot throws.
  virtual void truncate(int64_t seq_id, int64_t n) {
    (void)n;
    KV_FAIL("this KV memory cannot drop rejected draft tokens (sequence " << seq_id << ")");
  }
  // Frees everything the sequence holds.
  virtual void release(int64_t seq_id) = 0;
  // The sliding window a (global) layer's decode attention applies (0: none). The model checks it
  // against its own layers', so that a memory built without them fails instead of attending too far.
  virtual int64_t layer_window(int64_t layer) const {
    (void)layer;
    return 0;
  }
  // Tokens held for (sequence, layer); layers may differ once a policy compressed them.
  virtual int64_t cached_tokens(int64_t seq_id, int64_t layer) const = 0;

  // Pool occupancy in blocks (a block = block_size tokens of one layer, all KV heads). Admission is
  // not asked here: the scheduler runs PagedKvMemory::prompt_blocks and decode_demand on every
  // shard's reported usage.
  virtual int64_t blocks_total() const = 0;
  virtual int64_t blocks_used() const = 0;
  virtual int64_t blocks_high_water() const = 0;
  // KV tokens (summed over layers) the sequence holds; what full KV would hold is layers x length.
  virtual int64_t kept_tokens(int64_t seq_id) const = 0;
};

}  // namespace kvserve
