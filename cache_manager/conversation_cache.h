#pragma once
// ConversationCache: which finished requests left their KV parked for their conversation's next turn.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kvserve {

// The scheduler's index for `prefix_reuse: compressed` (docs/architecture.md, "Conversation
// reuse"). Bookkeeping only: a parked request's KV stays in every shard's pool under its sequence
// id, compressed as its policy left it; an entry records which tokens that KV covers (the prompt
// and every generated token but the last, which was never fed) and under which policy. The next
// request whose prompt extends those tokens continues from it and prefills only what follows.
// The scheduler evicts entries (oldest first) before it preempts anything.
class ConversationCache {
 public:
  struct Entry {
    int64_t seq_id = 0;
    std::vector<int64_t> tokens;
    std::string policy;
  };

  void park(int64_t seq_id, std::vector<int64_t> tokens, std::string policy);
  // The longest entry under `policy` whose tokens are a proper prefix of `prompt` (at least one
  // prompt token follows them), or null.
  const Entry* find(std::span<const int64_t> prompt, const std::string& policy) const;
  // Removes an entry (it was resumed or evicted); false when there is none for seq_id.
  bool erase(int64_t seq_id);
  // The least recently parked entry's sequence (nullopt when empty).
  std::optional<int64_t> oldest() const;

  bool empty() const { return entries_.empty(); }
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  std::vector<int64_t> seq_ids() const;

 private:
  std::vector<Entry> entries_;  // in parking order
};

}  // namespace kvserve
