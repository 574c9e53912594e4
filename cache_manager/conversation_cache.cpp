#include "cache_manager/conversation_cache.h"

#include <algorithm>

#include "common/check.h"

namespace kvserve {

void ConversationCache::park(int64_t seq_id, std::vector<int64_t> tokens, std::string policy) {
  KV_CHECK(std::none_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.seq_id == seq_id; }),
           "internal: sequence " << seq_id << " parked twice");
  entries_.push_back({seq_id, std::move(tokens), std::move(policy)});
}

const ConversationCache::Entry* ConversationCache::find(std::span<const int64_t> prompt,
                                                        const std::string& policy) const {
  const Entry* best = nullptr;
  for (const Entry& e : entries_) {
    const auto& t = e.tokens;
    if (e.policy != policy || t.empty() || t.size() >= prompt.size()) continue;
    if (best && best->tokens.size() >= t.size()) continue;
    if (std::equal(t.begin(), t.end(), prompt.begin())) best = &e;
  }
  return best;
}

bool ConversationCache::erase(int64_t seq_id) {
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.seq_id == seq_id; });
  if (it == entries_.end()) return false;
  entries_.erase(it);
  return true;
}

std::optional<int64_t> ConversationCache::oldest() const {
  if (entries_.empty()) return std::nullopt;
  return entries_.front().seq_id;
}

std::vector<int64_t> ConversationCache::seq_ids() const {
  std::vector<int64_t> out;
  for (const auto& e : entries_) out.push_back(e.seq_id);
  return out;
}

}  // namespace kvserve
