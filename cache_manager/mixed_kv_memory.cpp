#include "cache_manager/mixed_kv_memory.h"

#include <numeric>
#include <utility>

#include "common/check.h"

namespace kvserve {

MixedKvMemory::MixedKvMemory(std::vector<std::unique_ptr<PagedKvMemory>> memories,
                             std::map<std::string, size_t> policy_format, std::shared_ptr<KvSlabs> slabs)
    : memories_(std::move(memories)), policy_format_(std::move(policy_format)), slabs_(std::move(slabs)) {
  KV_CHECK(!memories_.empty(), "internal: a KV memory needs at least one format");
  for (const auto& m : memories_) KV_CHECK(m != nullptr, "internal: a KV format without its memory");
  KV_CHECK(memories_.size() == 1 || slabs_ != nullptr, "internal: KV memories of several formats need one shared storage");
  for (const auto& [policy, f] : policy_format_)
    KV_CHECK(f < memories_.size(), "internal: policy '" << policy << "' names KV format " << f << " of " << memories_.size());
  unit_bytes_ = 0;
  for (const auto& m : memories_) unit_bytes_ = std::gcd(unit_bytes_, m->cache().block_bytes());
  for (const auto& m : memories_) block_units_.push_back(m->cache().block_bytes() / unit_bytes_);
}

MixedKvMemory::MixedKvMemory(std::unique_ptr<PagedKvMemory> only) : MixedKvMemory([&] {
  std::vector<std::unique_ptr<PagedKvMemory>> v;
  v.push_back(std::move(only));
  return v;
}(), {}, nullptr) {}

size_t MixedKvMemory::format_of_policy(const std::string& policy) const {
  auto it = policy_format_.find(policy);
  return it == policy_format_.end() ? 0 : it->second;
}

size_t MixedKvMemory::owner(int64_t seq_id) const {
  auto it = owner_.find(seq_id);
  KV_CHECK(it != owner_.end(), "KV memory: sequence " << seq_id << " has no KV state");
  return it->second;
}

void MixedKvMemory::begin_prefill(int64_t seq_id, int64_t prompt_len, const std::string& policy) {
  const size_t f = format_of_policy(policy);
  if (auto it = owner_.find(seq_id); it != owner_.end() && it->second != f) {
    // A sequence restarting its prefill (a preempted request) under a policy of another format.
    memories_[it->second]->release(seq_id);
  }
  parts_.clear();
  memories_[f]->begin_prefill(seq_id, prompt_len, policy);
  owner_[seq_id] = f;
}

void MixedKvMemory::store_prefill(int64_t seq_id, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v) {
  of(seq_id).store_prefill(seq_id, layer, q, k, v);
}

torch::Tensor MixedKvMemory::as_stored(int64_t seq_id, const torch::Tensor& x) const { return of(seq_id).as_stored(seq_id, x); }

void MixedKvMemory::end_prefill(int64_t seq_id) { of(seq_id).end_prefill(seq_id); }

EarlierKv MixedKvMemory::prefill_context(int64_t seq_id, int64_t layer) { return of(seq_id).prefill_context(seq_id, layer); }

void MixedKvMemory::store_prefill_chunk(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& q,
                                        const torch::Tensor& k, const torch::Tensor& v) {
  of(seq_id).store_prefill_chunk(seq_id, layer, start, q, k, v);
}

int64_t MixedKvMemory::prefill_tokens(int64_t seq_id, int64_t start, std::span<const int64_t> tokens, int64_t max_hit,
                                      bool keep_copy, ResumeFrom resume) {
  const size_t f = owner(seq_id);
  if (start == 0 && resume.seq_id >= 0) {
    // The parked sequence's KV moves to seq_id: it must be in the same format.
    KV_CHECK(owner(resume.seq_id) == f, "KV memory: sequence " << seq_id << " cannot continue sequence " << resume.seq_id
                                                               << ", whose KV is in another format");
    const int64_t n = memories_[f]->prefill_tokens(seq_id, start, tokens, max_hit, keep_copy, resume);
    owner_.erase(resume.seq_id);
    return n;
  }
  return memories_[f]->prefill_tokens(seq_id, start, tokens, max_hit, keep_copy, resume);
}

int64_t MixedKvMemory::begin_context(int64_t seq_id, std::span<const int64_t> context, int64_t prompt_len, bool lookup) {
  return of(seq_id).begin_context(seq_id, context, prompt_len, lookup);
}

void MixedKvMemory::continue_prompt(int64_t seq_id) { of(seq_id).continue_prompt(seq_id); }

const PolicyConfig* MixedKvMemory::pending_selection(int64_t seq_id) const {
  return holds(seq_id) ? of(seq_id).pending_selection(seq_id) : nullptr;
}

const PolicyConfig* MixedKvMemory::prefill_policy(int64_t seq_id) const {
  return holds(seq_id) ? of(seq_id).prefill_policy(seq_id) : nullptr;
}

void MixedKvMemory::record_scores(int64_t seq_id, int64_t layer, int64_t start, const torch::Tensor& scores) {
  of(seq_id).record_scores(seq_id, layer, start, scores);
}

std::vector<torch::Tensor> MixedKvMemory::take_scores(int64_t seq_id) { return of(seq_id).take_scores(seq_id); }

torch::Tensor MixedKvMemory::reconstruction_queries(const torch::Tensor& q) {
  // Every format holds the same heads of the same shard.
  return memories_[0]->reconstruction_queries(q);
}

void MixedKvMemory::select_by_scores(int64_t seq_id, const std::vector<torch::Tensor>& scores) {
  of(seq_id).select_by_scores(seq_id, scores);
}

const std::vector<MixedKvMemory::Part>& MixedKvMemory::split(const DecodeBatch& batch) {
  if (!parts_.empty() && split_of_.seq_ids == batch.seq_ids && split_of_.positions == batch.positions &&
      split_of_.view == batch.view && split_of_.draft == batch.draft)
    return parts_;
  KV_CHECK(batch.seq_ids.size() == batch.positions.size(),
           "decode: " << batch.seq_ids.size() << " sequences but " << batch.positions.size() << " positions");
  std::vector<std::vector<int64_t>> rows(memories_.size());
  for (size_t b = 0; b < batch.seq_ids.size(); ++b) rows[owner(batch.seq_ids[b])].push_back(static_cast<int64_t>(b));
  parts_.clear();
  for (size_t f = 0; f < memories_.size(); ++f) {
    if (rows[f].empty()) continue;
    Part p;
    p.format = f;
    p.batch.view = batch.view;
    p.batch.draft = batch.draft;
    for (int64_t r : rows[f]) {
      p.batch.seq_ids.push_back(batch.seq_ids[static_cast<size_t>(r)]);
      p.batch.positions.push_back(batch.positions[static_cast<size_t>(r)]);
    }
    p.rows = torch::tensor(rows[f], torch::kInt64);
    parts_.push_back(std::move(p));
  }
  split_of_ = batch;
  return parts_;
}

void MixedKvMemory::begin_decode(const DecodeBatch& batch, int64_t padded_rows) {
  if (memories_.size() == 1) return memories_[0]->begin_decode(batch, padded_rows);
  const auto& parts = split(batch);
  if (parts.size() == 1) return memories_[parts[0].format]->begin_decode(batch, padded_rows);
  KV_CHECK(padded_rows <= static_cast<int64_t>(batch.seq_ids.size()),
           "decode: a step over sequences of " << parts.size() << " KV formats cannot be padded to " << padded_rows
                                               << " rows (a CUDA graph captures one format's kernels)");
  for (size_t i = 0; i < parts.size(); ++i) {
    try {
      memories_[parts[i].format]->begin_decode(parts[i].batch, 0);
    } catch (...) {
      // Give back the slots the earlier formats took for this step: one per row of each sequence.
      for (size_t j = 0; j < i; ++j) {
        memories_[parts[j].format]->cache().end_decode();  // its planned step never runs
        const auto& ids = parts[j].batch.seq_ids;
        for (size_t b = 0; b < ids.size(); ++b)
          if (b + 1 == ids.size() || ids[b + 1] != ids[b]) {
            size_t first = b;
            while (first > 0 && ids[first - 1] == ids[b]) --first;
            memories_[parts[j].format]->truncate(ids[b], static_cast<int64_t>(b - first + 1));
          }
      }
      parts_.clear();
      throw;
    }
  }
}

torch::Tensor MixedKvMemory::decode_attention(int64_t layer, const DecodeBatch& batch, const torch::Tensor& q,
                                              const torch::Tensor& k, const torch::Tensor& v) {
  if (memories_.size() == 1) return memories_[0]->decode_attention(layer, batch, q, k, v);
  const auto& parts = split(batch);
  if (parts.size() == 1) return memories_[parts[0].format]->decode_attention(layer, batch, q, k, v);
  KV_CHECK(q.size(0) == static_cast<int64_t>(batch.seq_ids.size()),
           "decode: " << q.size(0) << " query rows for a step of " << batch.seq_ids.size() << " sequences of several KV formats");
  torch::Tensor out = torch::empty_like(q);
  for (const Part& p : parts) {
    const torch::Tensor rows = p.rows.to(q.device());
    const torch::Tensor o = memories_[p.format]->decode_attention(layer, p.batch, q.index_select(0, rows),
                                                                  k.index_select(0, rows), v.index_select(0, rows));
    out.index_copy_(0, rows, o.to(out.dtype()));
  }
  return out;
}

void MixedKvMemory::truncate(int64_t seq_id, int64_t n) { of(seq_id).truncate(seq_id, n); }

void MixedKvMemory::release(int64_t seq_id) {
  auto it = owner_.find(seq_id);
  if (it == owner_.end()) return;
  memories_[it->second]->release(seq_id);
  owner_.erase(it);
  parts_.clear();
}

int64_t MixedKvMemory::bytes_total() const {
  if (slabs_) return slabs_->num_slabs() * slabs_->slab_bytes();
  return memories_[0]->blocks_total() * memories_[0]->cache().block_bytes();
}

int64_t MixedKvMemory::bytes_used() const {
  int64_t n = 0;
  for (const auto& m : memories_) n += m->blocks_used() * m->cache().block_bytes();
  return n;
}

MixedKvMemory::Room MixedKvMemory::room() const {
  Room r;
  r.own_units.assign(memories_.size(), 0);
  if (memories_.size() == 1 || !slabs_) {
    r.own_units[0] = blocks_total() - blocks_used();
    return r;
  }
  r.slab_units = slabs_->slab_bytes() / unit_bytes_;
  std::vector<std::vector<int32_t>> used(memories_.size());
  std::unordered_map<int, size_t> format_of_client;
  for (size_t f = 0; f < memories_.size(); ++f) {
    used[f] = memories_[f]->cache().request_blocks_per_slab();
    format_of_client[memories_[f]->cache().allocator().slab_client()] = f;
  }
  for (int32_t s = 0; s < static_cast<int32_t>(slabs_->num_slabs()); ++s) {
    const int h = slabs_->holder(s);
    if (h < 0) {
      ++r.free_slabs;
      continue;
    }
    auto it = format_of_client.find(h);
    if (it == format_of_client.end()) continue;  // not a format of this memory: no room for it
    const size_t f = it->second;
    const int32_t u = used[f][static_cast<size_t>(s)];
    if (u == 0) ++r.free_slabs;
    else r.own_units[f] += (memories_[f]->cache().allocator().blocks_per_slab() - u) * block_units_[f];
  }
  return r;
}

int64_t MixedKvMemory::blocks_total() const {
  if (memories_.size() == 1) return memories_[0]->blocks_total();
  return bytes_total() / unit_bytes_;
}

int64_t MixedKvMemory::blocks_used() const {
  if (memories_.size() == 1) return memories_[0]->blocks_used();
  int64_t n = 0;
  for (size_t f = 0; f < memories_.size(); ++f) n += memories_[f]->blocks_used() * block_units_[f];
  return n;
}

int64_t MixedKvMemory::blocks_high_water() const {
  if (memories_.size() == 1) return memories_[0]->blocks_high_water();
  // The formats' own high waters fall at different times: their sum can exceed the storage.
  return slabs_->high_water_slabs() * (slabs_->slab_bytes() / unit_bytes_);
}

void MixedKvMemory::reset_caches() {
  for (auto& m : memories_) m->reset_caches();
  if (slabs_) slabs_->reset_high_water();
}

void MixedKvMemory::set_draft_policy(const std::string& name, int64_t budget, int64_t min_prompt_tokens,
                                     int64_t sink_tokens, int64_t refresh_tokens) {
  for (auto& m : memories_) m->set_draft_policy(name, budget, min_prompt_tokens, sink_tokens, refresh_tokens);
}

}  // namespace kvserve
