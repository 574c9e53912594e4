#include "cache_manager/kv_slabs.h"

#include <algorithm>

#include <limits>
#include <numeric>
#include <sstream>

#include "common/check.h"

namespace kvserve {

namespace {

std::string format_name(const KvPoolOptions& o) {
  std::ostringstream s;
  if (o.quant != KvQuant::none) {
    s << kv_quant_name(o.quant);
  } else {
    s << c10::toString(o.dtype);
  }
  s << " (" << KvSlabs::block_bytes_of(o) << "-byte blocks)";
  return s.str();
}

}  // namespace

int64_t KvSlabs::block_bytes_of(const KvPoolOptions& o) {
  return KvBlockPool::bytes_per_block(o.head_blocks ? 1 : o.num_kv_heads, o.block_size, o.head_dim, o.dtype, o.quant);
}

int64_t KvSlabs::slab_bytes_of(const std::vector<KvPoolOptions>& formats) {
  KV_CHECK(!formats.empty(), "shared KV storage: no formats");
  int64_t lcm = 1, smallest = std::numeric_limits<int64_t>::max();
  std::string names;
  for (const KvPoolOptions& o : formats) {
    KV_CHECK(o.num_kv_heads > 0 && o.head_dim > 0 && o.block_size > 0,
             "shared KV storage: a format needs positive num_kv_heads, head_dim and block_size");
    check_kv_quant_head_dim(o.quant, o.head_dim, "shared KV storage");
    KV_CHECK(o.device == formats.front().device, "shared KV storage: formats on " << formats.front().device << " and "
                                                                                 << o.device);
    const int64_t bb = block_bytes_of(o);
    lcm = std::lcm(lcm, bb);
    smallest = std::min(smallest, bb);
    names += (names.empty() ? "" : ", ") + format_name(o);
  }
  KV_CHECK(lcm / smallest <= kMaxBlocksPerSlab, "shared KV storage: the formats " << names << " share no slab of at most "
                                                << kMaxBlocksPerSlab << " blocks (a common multiple is " << lcm
                                                << " bytes)");
  return lcm;
}

int64_t KvSlabs::slabs_for(const std::vector<KvPoolOptions>& formats) {
  const int64_t slab = slab_bytes_of(formats);
  const KvPoolOptions& first = formats.front();
  const int64_t bytes = KvBlockPool::resolve_num_blocks(first) * block_bytes_of(first);
  KV_CHECK(bytes >= slab, "shared KV storage: " << bytes << " bytes hold no slab of " << slab << " bytes");
  return bytes / slab;
}

KvSlabs::KvSlabs(const std::vector<KvPoolOptions>& formats)
    : KvSlabs(slabs_for(formats), slab_bytes_of(formats), formats.front().device) {}

KvSlabs::KvSlabs(int64_t num_slabs, int64_t slab_bytes, torch::Device device) : slab_bytes_(slab_bytes) {
  KV_CHECK(num_slabs > 0 && slab_bytes > 0, "shared KV storage of " << num_slabs << " slabs of " << slab_bytes << " bytes");
  KV_CHECK(num_slabs <= std::numeric_limits<int32_t>::max(), "shared KV storage: " << num_slabs << " slabs exceed int32 ids");
  const std::vector<int64_t> shape = {num_slabs * slab_bytes};
  const auto topts = torch::TensorOptions().dtype(torch::kUInt8).device(device);
  storage_ = device.is_cpu() ? KvBlockPool::host_storage(shape, topts, num_slabs * slab_bytes) : torch::empty(shape, topts);
  holder_.assign(static_cast<size_t>(num_slabs), -1);
  for (int64_t s = num_slabs - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
}

int KvSlabs::join() {
  reclaimers_.emplace_back();
  return static_cast<int>(reclaimers_.size()) - 1;
}

void KvSlabs::check_slab(int32_t slab) const {
  KV_CHECK(slab >= 0 && slab < num_slabs(), "slab " << slab << " out of range [0, " << num_slabs() << ")");
}

int32_t KvSlabs::take(int client) {
  KV_CHECK(client >= 0 && client < static_cast<int>(reclaimers_.size()), "shared KV storage: unknown client " << client);
  if (free_.empty()) return -1;
  const int32_t s = free_.back();
  free_.pop_back();
  holder_[static_cast<size_t>(s)] = client;
  high_water_ = std::max(high_water_, num_slabs() - free_slabs());
  return s;
}

void KvSlabs::give(int32_t slab, int client) {
  check_slab(slab);
  KV_CHECK(holder_[static_cast<size_t>(slab)] == client,
           "slab " << slab << " given back by client " << client << ", held by " << holder_[static_cast<size_t>(slab)]);
  holder_[static_cast<size_t>(slab)] = -1;
  free_.push_back(slab);
}

int KvSlabs::holder(int32_t slab) const {
  check_slab(slab);
  return holder_[static_cast<size_t>(slab)];
}

void KvSlabs::set_reclaimer(int client, Reclaimer fn) {
  KV_CHECK(client >= 0 && client < static_cast<int>(reclaimers_.size()), "shared KV storage: unknown client " << client);
  reclaimers_[static_cast<size_t>(client)] = std::move(fn);
}

bool KvSlabs::reclaim_for(int client, int64_t slabs) {
  if (reclaiming_) return free_slabs() >= slabs;
  reclaiming_ = true;
  for (size_t c = 0; c < reclaimers_.size() && free_slabs() < slabs; ++c) {
    if (static_cast<int>(c) == client || !reclaimers_[c]) continue;
    try {
      reclaimers_[c](slabs);
    } catch (...) {
      reclaiming_ = false;
      throw;
    }
  }
  reclaiming_ = false;
  return free_slabs() >= slabs;
}

void KvSlabs::check_invariants() const {
  std::vector<char> seen(holder_.size(), 0);
  for (int32_t s : free_) {
    check_slab(s);
    KV_CHECK(holder_[static_cast<size_t>(s)] == -1, "free slab " << s << " is held by " << holder_[static_cast<size_t>(s)]);
    KV_CHECK(!seen[static_cast<size_t>(s)], "slab " << s << " twice in the free list");
    seen[static_cast<size_t>(s)] = 1;
  }
  for (size_t s = 0; s < holder_.size(); ++s) {
    KV_CHECK(seen[s] || holder_[s] >= 0, "slab " << s << " neither free nor held");
    KV_CHECK(holder_[s] < static_cast<int>(reclaimers_.size()), "slab " << s << " held by unknown client " << holder_[s]);
  }
}

}  // namespace kvserve
