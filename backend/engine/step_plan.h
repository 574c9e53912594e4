#pragma once
// StepPlan and StepResult: one engine step as the scheduler decides it and as a runner reports it.
// One plan drives one process or every shard of a sharded job alike, so it holds plain values only.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/engine/kv_room.h"
#include "backend/sampling/sampler.h"
#include "backend/sampling/sampling_params.h"
#include "cache_manager/kv_memory.h"
#include "cache_manager/mixed_kv_memory.h"
#include "cache_manager/paged_kv_memory.h"

namespace kvserve {

// A sequence's sampler, created before its first prefill and kept across preemptions.
struct SequenceStart {
  int64_t seq_id = 0;
  SamplingParams sampling;
  std::vector<int64_t> prompt;
  uint64_t seed = 0;
  std::vector<int64_t> eos_ids;  // masked while min_tokens is not reached
};

// One prompt to prefill (a preempted sequence's prompt plus what it had generated), or one chunk of
// it: with chunked prefill a prompt longer than the step's token budget runs over several steps.
struct PrefillWork {
  int64_t seq_id = 0;
  std::vector<int64_t> tokens;  // the prompt's tokens [start, start + tokens.size())
  std::string policy;
  bool sample = true;    // false after a preemption (the next token is already known) and before the last chunk
  bool ban_eos = false;  // min_tokens not reached yet
  int64_t start = 0;       // the chunk's first position; > 0: earlier chunks' KV is in the pool
  int64_t prompt_len = 0;  // the whole prompt (0: tokens.size(), not chunked)
  // Prefix caching: a compressing policy may copy its full prompt blocks into the cache (the
  // scheduler reserved room for the copies).
  bool keep_copy = false;
  // Whether the prompt may start from the prefix cache. A compressing policy's whole-prompt prefill
  // holds the cached blocks it takes (pinned) besides its compressed peak until it ends; admission
  // counted room for them only together with the copies (keep_copy), whose bound covers both.
  bool reuse_prefix = true;
  // A sharded job's prefix-cache lookup, made once by rank 0 before the plan goes out: the leading
  // positions its shard found cached (KvMemory::kNoLookup: none is made). The shards then take the
  // least that all of them still hold.
  int64_t cached = KvMemory::kNoLookup;
  // prefix_reuse: compressed: the parked sequence of the same conversation whose KV this prompt
  // (a whole one) continues.
  ResumeFrom resume{};
  // Compressed contexts: the (whole) prompt's first context_len tokens are compressed alone, from
  // or into the memory's cache (PrefillInput::context_len). 0 = none.
  int64_t context_len = 0;
  // Whether the sequence may ever draft (Scheduler::may_draft): a draft model with a cache of its
  // own follows only those that may.
  bool drafts = true;

  int64_t total() const { return prompt_len > 0 ? prompt_len : static_cast<int64_t>(tokens.size()); }
  bool last_chunk() const { return start + static_cast<int64_t>(tokens.size()) == total(); }
  bool chunked() const { return total() != static_cast<int64_t>(tokens.size()); }
};

// What one step runs, in this order: drop rejected draft tokens' KV, free (or park) KV, drop and
// create samplers, one decode token for every running sequence (or, speculating, its last token and
// its drafts: consecutive rows of one sequence), then the admitted prefills.
struct StepPlan {
  // Speculative decoding: (sequence, n) drops the last n tokens' KV the previous step appended for
  // drafts it rejected.
  std::vector<std::pair<int64_t, int64_t>> truncate;
  std::vector<int64_t> release;  // sequences whose KV is freed (finished, cancelled, preempted)
  std::vector<int64_t> park;     // finished sequences whose KV stays for their conversation's next turn
  std::vector<int64_t> remove;   // sequences whose sampler is dropped (their request is over)
  std::vector<SequenceStart> start;
  DecodeBatch decode;
  std::vector<int64_t> decode_tokens;  // each decoded sequence's last token
  std::vector<char> decode_ban_eos;
  // Active: the decode rows after a sequence's last token are placeholders for self-speculative
  // drafts, which the runner drafts through this view of the sequence's KV before verifying them.
  DraftView self_draft;
  // The decode rows after a sequence's last token are placeholders that the runner's draft model
  // drafts over the whole cache (speculative_config method "draft_model").
  bool model_draft = false;
  std::vector<PrefillWork> prefill;

  bool empty() const {
    return truncate.empty() && release.empty() && park.empty() && remove.empty() && start.empty() && decode.seq_ids.empty() && prefill.empty();
  }
};

// One shard's pool after a step: what /metrics shows and what the scheduler's admission arithmetic
// reads (the scheduler never asks a shard a question between steps).
struct ShardUsage {
  PagedKvMemory::Geometry geometry;
  int64_t blocks_total = 0;
  int64_t blocks_used = 0;
  int64_t blocks_high_water = 0;
  int64_t blocks_cached = 0;  // held by the prefix cache (requests may use them too)
  int64_t cached_bytes = 0;   // the same in bytes
  int64_t block_bytes = 0;    // one block (one layer's block_size tokens, K and V)
  // The prefix cache's host-RAM tier (cache.prefix_cache_bytes): bytes it holds and can hold, and
  // entries moved there and back since the start.
  int64_t host_cached_bytes = 0;
  int64_t host_capacity_bytes = 0;
  int64_t host_stores = 0;
  int64_t host_loads = 0;
  // Compressed contexts (cache.enable_context_caching): entries, the blocks they hold, and what the
  // same contexts would hold uncompressed.
  int64_t context_entries = 0;
  int64_t context_blocks = 0;
  int64_t context_full_blocks = 0;
  // Per sequence the step touched (decoded rows, then prefills, in plan order): blocks only it
  // holds (what its release frees) and the most its next decode step can take. Empty entries for
  // a failed part.
  std::vector<int64_t> held;
  std::vector<int64_t> demand;
  // Where policies store K/V in several formats (PolicyConfig::kv_dtype), every count above is in
  // units of block_bytes (MixedKvMemory's units): a block of a policy named in policy_units takes
  // that many, one of any other policy base_units. One format: blocks, one unit each.
  int64_t base_units = 1;
  // Bytes of the blocks in use per KV cache dtype (kv_cache_dtype_label: "float16", "int8", ...).
  std::map<std::string, int64_t> bytes_used_by_dtype;
  std::map<std::string, int64_t> policy_units;
  int64_t units(const std::string& policy) const {
    auto it = policy_units.find(policy);
    return it == policy_units.end() ? base_units : it->second;
  }
  // Several formats on one slab storage (MixedKvMemory::Room): each format's room in the slabs it
  // holds, the slabs any format may take, a slab's units, and the format of each policy named (any
  // other: format 0). Empty format_room: one pool, whose room is blocks_total - blocks_used.
  std::vector<int64_t> format_room;
  int64_t free_slabs = 0;
  int64_t slab_units = 0;
  std::map<std::string, size_t> policy_format;
  size_t format(const std::string& policy) const {
    auto it = policy_format.find(policy);
    return it == policy_format.end() ? 0 : it->second;
  }
  size_t num_formats() const { return format_room.empty() ? 1 : format_room.size(); }
  KvRoom room() const {
    return format_room.empty() ? KvRoom(blocks_total - blocks_used) : KvRoom(format_room, free_slabs, slab_units);
  }
};

struct PrefillOutcome {
  std::optional<SampledToken> first;  // when the plan asked to sample
  int64_t kept_tokens = 0;            // KV tokens kept, summed over layers (each layer counted once)
  // Tokens kept per (layer, KV head): least, most, and their sum over `head_tables` tables (every
  // shard's; a replicated KV head counts once per replica, which leaves the mean unchanged).
  int64_t kept_head_min = 0, kept_head_max = 0, kept_head_sum = 0, head_tables = 0;
  int64_t queried_tokens = 0;         // prompt tokens looked up in the prefix cache (first chunk)
  int64_t cached_tokens = 0;          // of those, taken from it
  std::string error;                  // non-empty: this prefill failed; the others ran
};

struct StepResult {
  // One per decode row, unless decode_error is set; with speculation (a sequence in several rows)
  // the tokens each decoded sequence emitted (accepted drafts and one more), sequence after sequence.
  std::vector<SampledToken> decoded;
  std::vector<int64_t> decode_counts;  // speculation: tokens per decoded sequence in `decoded` (else empty)
  std::string decode_error;           // non-empty: the decode failed for every row
  // Speculative steps' cost on the runner's clock: self-draft steps run and their seconds, and the
  // seconds of the forward and sampling that verified drafts (a step without drafts adds nothing).
  int64_t draft_steps = 0;
  double draft_s = 0.0, verify_s = 0.0;
  // A draft model of another shape: prompt tokens its own prefix cache has served so far (a running
  // total); -1 without one, or on a step whose drafter did not report.
  int64_t draft_prefix_hits = -1;
  // The decode part's seconds (drafting, forward, sampling) for the speculation governor; 0: untimed.
  // A sharded job's are the sampling rank's.
  double decode_s = 0.0;
  std::vector<PrefillOutcome> prefilled;  // one per plan prefill
  std::vector<ShardUsage> shards;         // one per shard holding KV (one for a single process)
};

// Pool occupancy in blocks, summed over every shard of the job.
struct KvUsage {
  int64_t blocks_total = 0;
  int64_t blocks_used = 0;
  // The same in bytes (a block's bytes depend on the KV cache dtype: int8 / int4 blocks are smaller).
  int64_t bytes_total = 0;
  int64_t bytes_used = 0;
  std::map<std::string, int64_t> bytes_used_by_dtype;  // the same per KV cache dtype
  int64_t blocks_high_water = 0;
  int64_t blocks_cached = 0;
  int64_t cached_bytes = 0;
  int64_t host_cached_bytes = 0;
  int64_t host_capacity_bytes = 0;
  int64_t host_stores = 0;
  int64_t host_loads = 0;
  int64_t context_entries = 0;
  int64_t context_blocks = 0;
  int64_t context_full_blocks = 0;
  int64_t context_bytes = 0;
  // Parked conversations (prefix_reuse: compressed): entries, and the blocks and bytes they hold.
  int64_t conversations_parked = 0;
  int64_t blocks_parked = 0;
  int64_t parked_bytes = 0;
};

// One shard's pool after `plan` ran: geometry, occupancy, and the touched sequences' blocks.
ShardUsage shard_usage(const PagedKvMemory& kv, const StepPlan& plan);
// The same over every format of a mixed memory, counted in its units (one format: its blocks).
ShardUsage shard_usage(const MixedKvMemory& kv, const StepPlan& plan);

}  // namespace kvserve
